"""The NCCL-semantics tier: NCCL's ordering rules imposed on gloo, so a CPU test fails where NCCL would hang.

gloo matches a send with a receive by (peer, tag) whenever both have been posted, so any posting order
works there. NCCL (as ProcessGroupNCCL drives it) does not forgive:

- a single ``isend``/``irecv`` runs on the stream of its (communicator, rank pair), in posting order, and
  holds that stream until its counterpart on the other rank is reached (a send may not complete before the
  receive is posted: NCCL guarantees no buffering);
- tags are ignored: the n-th send from a to b meets the n-th receive on b from a, whatever it was meant for;
- ``batch_isend_irecv`` is one group call on the communicator's own stream, the stream its collectives use:
  the batch's operations progress together and the batch holds the stream until all of them complete;
- collectives run on that stream in issue order, and every rank of the group must issue the same ones.

``install()`` replaces torch.distributed's point-to-point and collective functions with versions that run
every operation on an emulated stream (one thread per stream, in posting order) over the original gloo
calls. Each message is a rendezvous (the receiver announces that its stream reached the receive; only then
does the sender's stream send) and carries a header with the sender's tag, size and dtype, so a message that
NCCL would deliver to the wrong receive fails loudly instead of landing silently. A wait that does not
complete within ``MEGALITE_NCCL_SEMANTICS_TIMEOUT`` seconds (default 120) raises, listing every stream's
queue: on NCCL it would hang. Each rank records the collectives and batches it issued per group; with
``MEGALITE_NCCL_SEMANTICS=<directory>`` it writes them there at exit and ``compare_logs`` checks that every
rank of a group issued the same sequence.

Test-only: ranks started by ``harness.run_ranks(..., nccl=True)`` install it directly, and
``harness.run_pretrain(..., nccl=True)`` puts ``nccl_site/sitecustomize.py`` on the ranks' path.
Functional collectives (DTensor's redistribution) go to the backend directly and are not covered.
"""
from __future__ import annotations

import atexit
import inspect
import json
import os
import queue
import threading
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

TIMEOUT = float(os.environ.get("MEGALITE_NCCL_SEMANTICS_TIMEOUT", "120"))
# gloo tags of the emulation's own messages: (header, data, ready) for pair streams and for group streams
PAIR_TAGS, GROUP_TAGS = (7101, 7102, 7103), (7111, 7112, 7113)
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
               "reduce_scatter_single", "all_gather", "reduce_scatter", "reduce", "broadcast", "barrier", "all_to_all_single",
               "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
_original: dict = {}
_streams: dict = {}
_streams_lock = threading.Lock()
_log: dict = defaultdict(list)          # group name -> [what was issued on its stream]
_group_ranks: dict = {}
_local = threading.local()


class Work:
    """What an emulated operation returns: ``wait`` blocks until its stream ran it (or times out)."""

    def __init__(self, description: str):
        self.description = description
        self.done, self.error = threading.Event(), None

    def wait(self, timeout=None) -> bool:
        if not self.done.wait(TIMEOUT):
            raise RuntimeError(f"NCCL semantics: {self.description} did not complete in {TIMEOUT:.0f} s: under "
                               f"NCCL this rank would hang. Streams:\n{dump_streams()}")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()

    def is_success(self) -> bool:
        return self.done.is_set() and self.error is None

    def exception(self):
        return self.error


class Stream:
    """One emulated stream: runs its operations one at a time, in posting order, on its own thread."""

    def __init__(self, name: str):
        self.name, self.queue, self.current = name, queue.Queue(), None
        self.waiting: list[str] = []
        threading.Thread(target=self._run, name=f"nccl-stream {name}", daemon=True).start()

    def submit(self, description: str, fn) -> Work:
        """Queue ``fn``; it runs under the caller's grad mode (thread-local, and in-place writes into views
        made under no_grad are refused with grad on)."""
        work, grad = Work(description), torch.is_grad_enabled()
        fn = (lambda inner=fn: _with_grad(grad, inner))
        self.waiting.append(description)
        self.queue.put((work, fn))
        return work

    def _run(self) -> None:
        _local.in_stream = True
        while True:
            work, fn = self.queue.get()
            self.current = self.waiting.pop(0)
            try:
                fn()
            except BaseException as error:        # handed to the waiter
                work.error = error
            self.current = None
            work.done.set()


def _with_grad(enabled: bool, fn) -> None:
    with torch.set_grad_enabled(enabled):
        fn()


def dump_streams() -> str:
    with _streams_lock:
        lines = [f"  {s.name}: running {s.current or '-'}; queued {s.waiting}" for s in _streams.values()]
    return "\n".join(lines)


def _stream(key: tuple) -> Stream:
    with _streams_lock:
        if key not in _streams:
            _streams[key] = Stream(" ".join(str(k) for k in key))
        return _streams[key]


def _group(group):
    return c10d._get_default_group() if group is None else group


def _name(group) -> str:
    group = _group(group)
    _group_ranks.setdefault(group.group_name, dist.get_process_group_ranks(group))
    return group.group_name


# ---- one message: a rendezvous, a header, the data ---------------------------------------------------
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.int8, torch.bool, torch.int16]


def _raw(kind: str, tensor, peer: int, group, tag: int) -> None:
    """gloo's own isend / irecv, waited (dist.send and dist.recv call the module's isend / irecv, replaced)."""
    _original[kind](tensor, peer, group=group, tag=tag).wait()


def _send_message(tensor, peer: int, group, tag: int, tags: tuple) -> None:
    header_tag, data_tag, ready_tag = tags
    ready = torch.empty(1, dtype=torch.int64)
    _raw("irecv", ready, peer, group=group, tag=ready_tag)        # the receiver's stream reached it
    header = torch.tensor([tag, tensor.numel(), _DTYPES.index(tensor.dtype)], dtype=torch.int64)
    _raw("isend", header, peer, group=group, tag=header_tag)
    _raw("isend", tensor.contiguous(), peer, group=group, tag=data_tag)


def _recv_message(tensor, peer: int, group, tag: int, tags: tuple) -> None:
    header_tag, data_tag, ready_tag = tags
    _raw("isend", torch.ones(1, dtype=torch.int64), peer, group=group, tag=ready_tag)
    header = torch.empty(3, dtype=torch.int64)
    _raw("irecv", header, peer, group=group, tag=header_tag)
    sent_tag, numel, dtype = (int(x) for x in header)
    if (numel, _DTYPES[dtype]) != (tensor.numel(), tensor.dtype) or sent_tag != tag:
        scratch = torch.empty(numel, dtype=_DTYPES[dtype])
        _raw("irecv", scratch, peer, group=group, tag=data_tag)   # keep the channel in step, then fail
        raise RuntimeError(f"NCCL semantics: rank {dist.get_rank()}'s receive from {peer} (tag {tag}, {tensor.numel()} "
                           f"{tensor.dtype}) would get the message sent with tag {sent_tag} ({numel} {_DTYPES[dtype]}): "
                           "NCCL ignores tags and matches sends and receives in posting order")
    _raw("irecv", tensor, peer, group=group, tag=data_tag)


def _message(is_send: bool, tensor, peer: int, group, tag: int, tags: tuple):
    return lambda: (_send_message if is_send else _recv_message)(tensor, peer, group, tag, tags)


# ---- point to point ------------------------------------------------------------------------------------
def _single(is_send: bool):
    def post(tensor, peer=None, group=None, tag=0, **kwargs):
        group = _group(group)
        peer = peer if peer is not None else dist.get_global_rank(group, kwargs["group_dst" if is_send else "group_src"])
        what = f"{'send to' if is_send else 'recv from'} {peer} (tag {tag}, {tuple(tensor.shape)})"
        return _stream(("pair", _name(group), peer)).submit(what, _message(is_send, tensor, peer, group, tag, PAIR_TAGS))
    return post


def _blocking(is_send: bool):
    def run(tensor, peer=None, group=None, tag=0, **kwargs):
        _single(is_send)(tensor, peer, group, tag, **kwargs).wait()
        return None if is_send else peer
    return run


def batch_isend_irecv(ops: list) -> list:
    """One group call on the group's own stream: its operations run together (a thread per peer and
    direction, in order within each), and the batch completes when all of them have."""
    group = ops[0].group
    lanes = defaultdict(list)
    for op in ops:
        is_send = op.op in (_original["isend"], isend)
        lanes[(op.peer, is_send)].append(_message(is_send, op.tensor, op.peer, group, op.tag, GROUP_TAGS))

    def run():
        errors = []

        def lane(fns):
            try:
                for fn in fns:
                    fn()
            except BaseException as error:
                errors.append(error)
        threads = [threading.Thread(target=lane, args=(fns,), daemon=True) for fns in lanes.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    name = _name(group)
    what = "batch " + ", ".join(f"{'send to' if s else 'recv from'} {p} x{len(f)}" for (p, s), f in lanes.items())
    return [_stream(("group", name)).submit(what, run)]


isend, irecv = _single(True), _single(False)


# ---- collectives -----------------------------------------------------------------------------------------
def _describe(value) -> object:
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype)]
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return [_describe(v) for v in value]
    if isinstance(value, dist.ReduceOp.RedOpType):
        return str(value)
    return None


def _all_to_all_description(arguments: dict, group) -> list:
    """An all-to-all's sizes legitimately differ across ranks: record what each rank sends to and receives
    from every peer (rows of the row shape), which compare_logs checks pairwise."""
    out, inp = arguments["output"], arguments["input"]
    size = dist.get_world_size(group)
    send = arguments.get("input_split_sizes") or [inp.shape[0] // size] * size
    recv = arguments.get("output_split_sizes") or [out.shape[0] // size] * size
    return ["pairwise", list(inp.shape[1:]), str(inp.dtype), list(send), list(recv)]


def _same_op(a, b, rank_a: int, rank_b: int, members: list) -> bool:
    """Two ranks' records of one operation agree: equal, or an all-to-all whose sizes pair up (what rank a
    sends to b is what b receives from a, and back)."""
    if a == b:
        return True
    if a[0] != "all_to_all_single" or b[0] != "all_to_all_single" or a[1][:3] != b[1][:3]:
        return False
    i, j = members.index(rank_a), members.index(rank_b)
    (send_a, recv_a), (send_b, recv_b) = a[1][3:], b[1][3:]
    return send_a[j] == recv_b[i] and send_b[i] == recv_a[j]


def _collective(name: str):
    original = _original[name]
    signature = inspect.signature(original)

    def issue(*args, **kwargs):
        if getattr(_local, "in_stream", False):
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        async_op = bound.arguments.pop("async_op", False)
        described = [_describe(v) for k, v in bound.arguments.items() if k != "group"]
        if name.endswith("_object") or name.endswith("_object_list"):
            described = []                        # pickled sizes differ across ranks by design
        if name == "all_to_all_single":
            described = _all_to_all_description(bound.arguments, group)
        group_name = _name(group)
        _log[group_name].append([name, described])
        result = {}
        work = _stream(("group", group_name)).submit(
            name, lambda: result.setdefault("value", original(*bound.args, **bound.kwargs)))
        if async_op:
            return work
        work.wait()
        return result.get("value")
    issue.__name__ = name
    return issue


# ---- install, logs ---------------------------------------------------------------------------------------
def install() -> None:
    """Replace torch.distributed's functions with the emulation (idempotent)."""
    if _original:
        return
    for name in ("send", "recv", "isend", "irecv", "batch_isend_irecv") + COLLECTIVES:
        if hasattr(dist, name):
            _original[name] = getattr(dist, name)
    replacements = {"isend": isend, "irecv": irecv, "send": _blocking(True), "recv": _blocking(False),
                    "batch_isend_irecv": batch_isend_irecv}
    replacements.update({name: _collective(name) for name in COLLECTIVES if name in _original})
    for name, fn in replacements.items():
        setattr(dist, name, fn)
    c10d.isend, c10d.irecv = isend, irecv        # P2POp accepts only the module's own isend / irecv
    directory = os.environ.get("MEGALITE_NCCL_SEMANTICS")
    if directory and directory != "1":
        atexit.register(write_log, directory)


def write_log(directory: str) -> None:
    if not _log:
        return
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
        json.dump({name: {"ranks": _group_ranks[name], "ops": ops} for name, ops in _log.items()}, f)


def compare_logs(directory: str) -> list[str]:
    """Where the ranks of a group issued different collectives or batches (empty: none)."""
    logs = {}
    for file in os.listdir(directory):
        if file.startswith("rank") and file.endswith(".json"):
            with open(os.path.join(directory, file)) as f:
                logs[int(file[4:-5])] = json.load(f)
    problems = []
    for rank, groups in logs.items():
        for name, entry in groups.items():
            for other in entry["ranks"]:
                theirs = logs.get(other, {}).get(name, {"ops": []})["ops"]
                members = sorted(entry["ranks"])
                differ = len(theirs) != len(entry["ops"]) or not all(
                    _same_op(a, b, rank, other, members) for a, b in zip(entry["ops"], theirs))
                if other > rank and differ:
                    at = next((i for i, (a, b) in enumerate(zip(entry["ops"], theirs))
                               if not _same_op(a, b, rank, other, members)), min(len(entry["ops"]), len(theirs)))
                    problems.append(f"group {name} {entry['ranks']}: rank {rank} and rank {other} differ at "
                                    f"operation {at}: {entry['ops'][at:at + 1]} vs {theirs[at:at + 1]}")
    return problems
