"""The NCCL-semantics tier itself: it fails on patterns NCCL hangs on or mismatches (so a pass under it
means something) and passes the patterns NCCL runs."""
import torch
import torch.distributed as dist

import nccl_semantics
from harness import run_ranks


def _patterns(rank: int, world: int) -> dict:
    """Each pattern between ranks 0 and 1, in its own process group (so a hung one leaves the others'
    streams free): "ok", or the error the tier raised."""
    nccl_semantics.TIMEOUT = 4.0
    peer = 1 - rank
    groups = {name: dist.new_group([0, 1]) for name in ("batched", "ordered", "recv_first", "send_first", "tags",
                                                         "collectives")}
    x, y = torch.full((4,), float(rank)), torch.empty(4)

    def batched(g):
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer, g), dist.P2POp(dist.irecv, y, peer, g)]):
            work.wait()

    def ordered(g):                      # rank 0 sends then receives, rank 1 the mirror image
        ops = [lambda: dist.isend(x, peer, g), lambda: dist.irecv(y, peer, g)]
        for work in [op() for op in (ops if rank == 0 else ops[::-1])]:
            work.wait()

    def recv_first(g):                   # both post a receive first: each waits behind the other's
        for work in [dist.irecv(y, peer, g), dist.isend(x, peer, g)]:
            work.wait()

    def send_first(g):                   # both send first: NCCL does not promise to buffer a send
        for work in [dist.isend(x, peer, g), dist.irecv(y, peer, g)]:
            work.wait()

    def tags(g):                         # tags meant to reorder: NCCL ignores them
        if rank == 0:
            for work in [dist.isend(x, peer, g, tag=1), dist.isend(x + 1, peer, g, tag=2)]:
                work.wait()
        else:
            for work in [dist.irecv(y, peer, g, tag=2), dist.irecv(y, peer, g, tag=1)]:
                work.wait()

    def collectives(g):
        t = torch.ones(3)
        work = dist.all_reduce(t, group=g, async_op=True)
        work.wait()
        dist.all_reduce(t, group=g)
        return t.tolist()

    outcome = {}
    for name, fn in [("batched", batched), ("ordered", ordered), ("recv_first", recv_first),
                     ("send_first", send_first), ("tags", tags), ("collectives", collectives)]:
        try:
            result = fn(groups[name])
            outcome[name] = ("ok", result if result is not None else y.tolist())
        except RuntimeError as error:
            outcome[name] = ("error", str(error).splitlines()[0])
    return outcome


def test_the_tier_hangs_where_nccl_hangs_and_passes_what_nccl_runs():
    for rank, outcome in enumerate(run_ranks(2, _patterns, nccl=True)):
        assert outcome["batched"] == ("ok", [float(1 - rank)] * 4)
        assert outcome["ordered"] == ("ok", [float(1 - rank)] * 4)
        assert outcome["collectives"] == ("ok", [4.0] * 3)
        for hang in ("recv_first", "send_first"):
            assert outcome[hang][0] == "error" and "would hang" in outcome[hang][1], (hang, outcome[hang])
        if rank == 1:
            assert outcome["tags"][0] == "error" and "NCCL ignores tags" in outcome["tags"][1], outcome["tags"]


def test_plain_gloo_forgives_the_same_patterns():
    """The reason for the tier: gloo runs every one of them."""
    for outcome in run_ranks(2, _patterns):
        assert all(status == "ok" for status, _ in outcome.values()), outcome


def test_compare_logs_names_the_first_collective_that_differs(tmp_path):
    import json
    logs = {0: {"g": {"ranks": [0, 1], "ops": [["all_reduce", []], ["broadcast", []]]}},
            1: {"g": {"ranks": [0, 1], "ops": [["broadcast", []], ["all_reduce", []]]}},
            2: {"h": {"ranks": [2], "ops": [["barrier", []]]}}}
    for rank, log in logs.items():
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(log))
    problems = nccl_semantics.compare_logs(str(tmp_path))
    assert len(problems) == 1 and "rank 0 and rank 1 differ at operation 0" in problems[0]
    (tmp_path / "rank1.json").write_text(json.dumps({"g": logs[0]["g"]}))
    assert nccl_semantics.compare_logs(str(tmp_path)) == []


def test_compare_logs_pairs_up_all_to_all_sizes(tmp_path):
    """An all-to-all's sizes differ per rank by design; what rank a sends b must be what b receives from a."""
    import json

    def write(send0, recv0, send1, recv1):
        for rank, (send, recv) in enumerate([(send0, recv0), (send1, recv1)]):
            op = ["all_to_all_single", ["pairwise", [64], "torch.float32", send, recv]]
            (tmp_path / f"rank{rank}.json").write_text(json.dumps({"g": {"ranks": [0, 1], "ops": [op]}}))
    write([3, 5], [3, 2], [2, 7], [5, 7])            # 0 -> 1: 5 rows, 1 -> 0: 2 rows
    assert nccl_semantics.compare_logs(str(tmp_path)) == []
    write([3, 5], [3, 2], [2, 7], [4, 7])            # rank 1 expects 4 rows from rank 0, which sends 5
    problems = nccl_semantics.compare_logs(str(tmp_path))
    assert len(problems) == 1 and "differ at operation 0" in problems[0]
