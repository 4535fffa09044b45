"""What each rank of any TP x PP x DP x ZeRO x CP layout saves (save.py writes it) and loads of a training
checkpoint, and load_model for inference.

A checkpoint holds every tensor at its full shape under its global name (files.py), so a checkpoint
written at one layout loads at any other; yet no rank ever builds a full tensor, and no tensor data
crosses ranks: each rank writes the parts it owns into files of its own, and reads back only the parts
it holds. Only the index and an error flag are exchanged: each rank sends the index entries of its own
pieces to the ranks that hold those tensors' index shards (index.py; a tensor's bands are about the
rows one writer writes, ``writer_rows``), and on load reads only the shards of the tensors it needs,
so no rank sends, holds or reads an index that grows with the world.

What a rank owns is the range of the flat parameter buffer its optimizer updates (``optimizer.pieces``:
the whole buffer, or under ZeRO this data-parallel rank's chunk of every bucket), for four kinds of
tensors: the weights (in the model's dtype), and the fp32 master weights (unless the model is fp32:
then the weights are the master) and Adam moments. Each element is written once: without ZeRO only
data-parallel rank 0 writes (the data-parallel group spans context parallelism too, whose ranks hold
the same state); TP-replicated parameters (norms) are written by TP rank 0; the word-embedding copy
that a later pipeline stage holds for tied output weights is not written (it loads from the same name).

Where a part goes in the full tensor is pieces.py's: a flat range of a TP-local parameter is a few
boxes of the stored tensor, each box one stored piece. Loading cuts every range a rank holds (its
parameters; its optimizer ranges) into boxes the same way and copies in the intersecting pieces.
PipeDream's stashed weight versions are stored like the weights (stashed.py), so any layout reads what
it needs.

RNG states are per rank and restored only at the same layout.
"""
from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from megalite.checkpoint.files import Box, CheckpointReader, as_2d, model_config_from_metadata, TRACKER, METADATA
from megalite.checkpoint.index import band_rows, encode_part, outgoing
from megalite.checkpoint.pieces import (ParamEntry, Placement, box_view, boxes, held_params,
                                        optimizer_ranges, overlap, pad_vocabulary, param_entries, placement,
                                        stored_shape)
from megalite.checkpoint.stashed import load_stashed_versions, stashed_sources
from megalite.checkpoint.state import CheckpointState, persistent_buffers
from megalite.checkpoint.tensor_file import DTYPE_NAMES
from megalite.config.schema import ModelConfig
from megalite.errors import UserError
from megalite.parallel.data.grad_buffer import Bucket
from megalite.parallel.param_meta import full_shape, param_meta
from megalite.precision.fp8 import check_resumed_recipe


# ---- RNG -----------------------------------------------------------------------------------------
def rng_filename(rank: int) -> str:
    """Each rank's own file of generator states (every rank writes one)."""
    return f"rng-rank{rank:05d}.safetensors"


def rng_tensors(tracker) -> dict[str, torch.Tensor]:
    tensors = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state()
    if tracker is not None:
        tensors.update({f"tracker.{k}": v for k, v in tracker.states.items()})
    return tensors


def restore_rng(tensors: dict[str, torch.Tensor], tracker) -> None:
    torch.set_rng_state(tensors["cpu"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    if tracker is not None:
        for name in list(tracker.states):
            if f"tracker.{name}" in tensors:
                tracker.states[name] = tensors[f"tracker.{name}"].clone()


def saved_rng(reader, run: CheckpointState) -> tuple[dict[str, torch.Tensor] | None, str]:
    """This rank's saved generator states, or None and why they do not apply to this run: a rank's
    streams are seeded by its tensor- and pipeline-parallel rank, so they carry over only at the same
    layout, and a CUDA generator's state does not fit a CPU one (or the reverse)."""
    if reader.metadata.get("layout") != layout_of(run):
        return None, "the layout differs"
    tensors = reader.rng_tensors(rng_filename(run.parallel.rank))
    if tensors is None:
        return None, "the checkpoint has none"
    tracker = run.rng
    streams = tracker.states.items() if tracker is not None else ()
    if any(tensors.get(f"tracker.{name}", state).shape != state.shape for name, state in streams):
        return None, "it was saved on another kind of device"
    return tensors, ""


def layout_of(run: CheckpointState) -> dict:
    p = run.parallel
    return {"world_size": p.world_size, "tensor_model_parallel_size": p.tp_size, "pipeline_model_parallel_size": p.pp_size,
            "context_parallel_size": p.cp_size, "data_parallel_size": p.dp_size,
            "virtual_pipeline_chunks": len(run.chunks),
            "data_parallel_sharding_strategy": run.config.parallel.data_parallel_sharding_strategy}


# ---- save ----------------------------------------------------------------------------------------
MESSAGE_BYTES = 1024        # the longest error message one rank passes to the others


def agree(ok: bool, message: str, device, group=None) -> None:
    """Every rank of ``group`` (default: all) learns whether any rank failed (so none waits in a collective
    for a failed one), and all raise the message of the lowest failing rank: one all-reduce of a rank
    number, and only after a failure a broadcast of that rank's message (bounded bytes, whatever the world).
    ``group`` spans every rank (a checkpoint's own group), so its ranks are the global ones."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if not ok:
            raise UserError(message)
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    first = torch.tensor([world if ok else rank], dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    source = int(first)
    if source == world:
        return
    text = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=device)
    if rank == source and message:
        data = message.encode()[:MESSAGE_BYTES]
        text[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    dist.broadcast(text, src=source, group=group)
    raise UserError(bytes(text.cpu().tolist()).rstrip(b"\0").decode(errors="ignore"))


def owned_parts(run: CheckpointState,
                data_rank: int | None = None) -> list[tuple[ParamEntry, int, int, dict[str, torch.Tensor]]]:
    """What this rank writes: per parameter, the local flat range [lo, hi) it owns and, per stored
    tensor name, a flat tensor holding that range (element 0 is local element lo). ``data_rank``: what
    the rank of this TP x PP coordinate at that data-parallel x CP place writes instead (chunk_ranges)."""
    p, buffer, optimizer = run.parallel, run.buffer, run.optimizer
    master_is_weights = buffer.param_dtype == torch.float32
    parts = []
    for entry in param_entries(run.chunks):
        if not entry.stored_here or not writes(p, optimizer.grads_sharded, param_meta(entry.param)):
            continue
        slot, g = buffer.slots[entry.buffer_name], entry.global_name
        ranges = optimizer_ranges(optimizer, slot) if data_rank is None else chunk_ranges(
            run, slot, data_rank, optimizer.state_names_of(entry.buffer_name))
        for start, end, piece, master, state, cut in ranges:
            sources = {g: piece.param[cut]}
            if not master_is_weights:
                sources[f"optimizer.master.{g}"] = master[cut]
            sources.update({f"optimizer.{k}.{g}": tensor[cut] for k, tensor in state.items()})
            sources.update(stashed_sources(run, g, start, end))     # PipeDream's older weight versions
            parts.append((entry, start - slot.start, end - slot.start, sources))
    return parts


def chunk_ranges(run: CheckpointState, slot, data_rank: int, state_names: tuple[str, ...]):
    """optimizer_ranges as the rank at data-parallel x CP place ``data_rank`` (of the first instance) of a
    dense ZeRO layout has them: its chunk of each bucket, as storage-less tensors (where it writes, not
    what), so that one built rank describes what all of its data-parallel group write. ``state_names``:
    the rule's state of the slot's parameter."""
    buffer = run.buffer
    if not run.optimizer.grads_sharded or run.config.model.num_experts:
        raise ValueError("chunk_ranges describes dense ZeRO layouts only")
    for bucket in buffer.buckets:
        start, end = overlap(slot.start, slot.end, *bucket.chunk(data_rank))
        if start < end:
            weights = torch.empty(end - start, dtype=buffer.param_dtype, device="meta")
            master = torch.empty(end - start, dtype=torch.float32, device="meta")
            yield (start, end, SimpleNamespace(param=weights), master,
                   {k: master for k in state_names}, slice(0, end - start))


def writer_rows(run: CheckpointState, entry: ParamEntry, place: Placement) -> int:
    """Rows of a parameter's stored tensor that one writer writes at most at a time, the same number on
    every writer of it (index.band_rows sizes the tensor's index bands by it): under ZeRO the largest
    rank's chunk of the parameter's bucket (the same for every rank), under FSDP2 its share of
    the rows, else the whole TP-local parameter; over the local row width."""
    buffer = run.buffer
    slot = buffer.slots[entry.buffer_name]
    numel = slot.end - slot.start
    if run.optimizer.grads_sharded:
        bucket = next((b for b in buffer.buckets if isinstance(b, Bucket) and b.start <= slot.start < b.end), None)
        numel = min(numel, bucket.largest_chunk_numel) if bucket else -(-numel // buffer.dp_size)
    return -(-numel // place.width)


def writes(p, grads_sharded: bool, meta) -> bool:
    """Whether this rank writes its part of a parameter: every holder of a distinct part (TP shards,
    EP x ETP expert pieces, ZeRO chunks), and of replicas the first (data-parallel rank 0, TP rank 0
    for a replicated dense parameter, expert-data-parallel rank 0 for an expert weight). With hybrid
    sharding (--num-distributed-optimizer-instances) the instances hold the same chunks: the first writes."""
    if meta.expert:
        return grads_sharded and p.edp_rank < p.edp_shard_size or p.edp_rank == 0
    return (grads_sharded and p.instance == 0 or p.dp_rank == 0 and p.cp_rank == 0) and \
        (meta.tensor_model_parallel or p.tp_rank == 0)


def shard_filename(run: CheckpointState, kind: str, data_rank: int | None = None) -> str:
    """model-pp000[-tp001][-dp00002].safetensors: the coordinates of the writer, where there are several
    (an MoE model's experts are written by ranks of any data-parallel coordinate)."""
    p = run.parallel
    name = f"{kind}-pp{p.pp_rank:03d}"
    if p.tp_size > 1:
        name += f"-tp{p.tp_rank:03d}"
    if (run.optimizer.grads_sharded or run.config.model.num_experts) and p.dp_size * p.cp_size > 1:
        name += f"-dp{p.dp_cp_rank if data_rank is None else data_rank:05d}"
    return name + ".safetensors"


def buffer_parts(chunks: list[nn.Module], vocab: int) -> list[tuple[str, tuple, Placement, torch.Tensor]]:
    """(global name, stored shape, placement, flat view) of every persistent buffer of the chunks
    (state.py), placed in its stored tensor by its param_meta marks as a parameter is: unmarked, the
    whole tensor; marked tensor-parallel, this TP rank's shard of the full one."""
    return [(name, stored_shape(name, full_shape(tensor), vocab), placement(tensor, name, vocab), tensor.view(-1))
            for name, tensor in persistent_buffers(chunks)]


def buffer_writers(run: CheckpointState) -> dict[str, bool]:
    """{global name: whether this rank writes its part} of the persistent buffers: they are replicated
    over data parallelism and CP (and over TP unless marked tensor-parallel), so the first replica writes,
    as for a parameter without ZeRO."""
    return {name: writes(run.parallel, False, param_meta(tensor)) for name, tensor in persistent_buffers(run.chunks)}


def planned_shards(run: CheckpointState,
                   data_rank: int | None = None) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict]]:
    """What this rank (or, given ``data_rank``, chunk_ranges' rank) writes, one piece per box: {file:
    {key: tensor}}, and its part of the tensor index (without the CRCs, known once written). A box that
    is the whole tensor is stored under the tensor's own name and shape."""
    vocab = run.config.model.vocab_size
    model, optimizer = shard_filename(run, "model", data_rank), shard_filename(run, "optimizer", data_rank)
    files = {model: {}, optimizer: {}}
    index: dict[str, dict] = {}

    def add(shape: tuple, step: int, place: Placement, lo: int, hi: int, sources: dict[str, torch.Tensor]) -> None:
        rows, cols = as_2d(shape)
        for offset, box in boxes(place, lo, hi):
            r0, r1, c0, c1 = box
            whole = box == (0, rows, 0, cols)
            for name, flat in sources.items():
                file = optimizer if name.startswith("optimizer.") else model
                key = name if whole else f"{name}[{r0}:{r1},{c0}:{c1}]"
                data = box_view(flat, offset - lo, box)
                files[file][key] = data.view(shape) if whole else data
                stored = index.setdefault(name, {"shape": list(shape), "dtype": DTYPE_NAMES[flat.dtype],
                                                 "band_rows": step, "pieces": []})
                stored["pieces"].append({"file": file, "key": key, "box": [[r0, r1], [c0, c1]]})

    writers = buffer_writers(run) if data_rank in (None, 0) else {}     # data_rank: the first replica's place
    for name, shape, place, flat in buffer_parts(run.chunks, vocab):
        if writers.get(name):
            add(shape, band_rows(shape, -(-flat.numel() // place.width)), place, 0, flat.numel(), {name: flat})
    for entry, lo, hi, sources in owned_parts(run, data_rank):
        shape = stored_shape(entry.global_name, full_shape(entry.param), vocab)
        place = placement(entry.param, entry.global_name, vocab)
        add(shape, band_rows(shape, writer_rows(run, entry, place)), place, lo, hi, sources)
    return {file: tensors for file, tensors in files.items() if tensors}, index


def index_payloads(run: CheckpointState, data_rank: int | None = None) -> dict[int, bytes]:
    """{holder: the bytes this rank sends it} on save, computed without writing anything: every CRC and
    file size at its widest, so an upper bound (measurement, dry runs). ``data_rank``: those of the rank
    at that data-parallel x CP place of this rank's TP x PP coordinate (chunk_ranges)."""
    p = run.parallel
    files, index = planned_shards(run, data_rank)
    for stored in index.values():
        for piece in stored["pieces"]:
            piece["crc32"] = 0xFFFFFFFF
    rank = p.rank if data_rank is None else p.tp_rank + p.tp_size * (data_rank + p.cp_size * p.dp_size * p.pp_rank)
    rng_file = rng_filename(rank)
    rng = {rng_file: {name: {"file": rng_file, "shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype],
                             "crc32": 0xFFFFFFFF} for name, t in rng_tensors(run.rng).items()}}
    parts = outgoing(index, rng, {name: 10 ** 12 - 1 for name in [*files, rng_file]}, p.world_size)
    return {holder: encode_part(part) for holder, part in parts.items()}


# ---- load ----------------------------------------------------------------------------------------
def has_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TRACKER)) or os.path.isfile(os.path.join(path, METADATA))


def architecture_differences(reader: CheckpointReader, model_config: ModelConfig) -> list[str]:
    """Model fields where the checkpoint and this run disagree, as "--flag saved vs this run"."""
    differences, fields = [], dataclasses.asdict(model_config)
    stored = reader.metadata.get("model", {})
    for name, value in sorted(stored.items(), key=lambda item: item[0] != "num_experts"):   # MoE vs dense first
        if name in ("params_dtype", "seq_length"):
            continue
        mine = fields.get(name)
        if mine != value:
            flag = "the tokenizer's vocabulary" if name == "vocab_size" else "--" + name.replace("_", "-")
            differences.append(f"{flag}: {value!r} in the checkpoint, {mine!r} in this run")
    return differences


def _hint(differences: list[str]) -> str:
    return f" ({'; '.join(differences[:3])})" if differences else ""


def check_stored(reader: CheckpointReader, name: str, param: nn.Parameter, global_name: str, vocab: int,
                 differences: list[str] = ()) -> None:
    """The checkpoint has tensor ``name`` at the shape the parameter needs."""
    check_shape(reader, name, stored_shape(global_name, full_shape(param), vocab), differences)


def check_shape(reader: CheckpointReader, name: str, shape: tuple, differences: list[str] = ()) -> None:
    """The checkpoint has tensor ``name`` at ``shape``."""
    if not reader.has(name):
        raise UserError(f"checkpoint {reader.directory} has no tensor {name!r}{_hint(differences)}; it was saved "
                        "from a different model: match the model flags or add --use-checkpoint-args")
    if reader.shape(name) != shape:
        raise UserError(f"checkpoint tensor {name!r} has shape {list(reader.shape(name))} but the model expects "
                        f"{list(shape)}{_hint(differences)}; match the model flags or add --use-checkpoint-args")


def expected_full(reader: CheckpointReader, name: str, param: nn.Parameter, global_name: str,
                  vocab: int) -> torch.Tensor:
    """The whole stored tensor ``name``, shape checked, vocabulary padded (single-process use)."""
    check_stored(reader, name, param, global_name, vocab)
    return pad_vocabulary(reader.tensor(name).float(), global_name, full_shape(param))


def source_names(reader: CheckpointReader, global_name: str, state_names: tuple[str, ...]) -> dict[str, str]:
    """Stored names to load from, by kind. The master weights are the weights themselves when the
    checkpoint has no separate master copy (an fp32 run, a converted Hugging Face model); the model's
    parameters come from the master copy too, so a bf16 checkpoint resumed in fp32 keeps fp32 weights."""
    master = f"optimizer.master.{global_name}"
    names = {"master": master if reader.has(master) else global_name}
    names.update({k: f"optimizer.{k}.{global_name}" for k in state_names})
    return names


def load_targets(run: CheckpointState, sources: dict[str, dict[str, str]]) -> list[tuple[str, Box, torch.Tensor]]:
    """(stored name, box, destination view) for everything this rank holds: its parameters and its
    optimizer ranges (master weights, and the Adam moments when ``sources`` names them)."""
    buffer, optimizer, vocab = run.buffer, run.optimizer, run.config.model.vocab_size
    targets = []

    def add(name: str, place: Placement, lo: int, hi: int, flat: torch.Tensor) -> None:
        flat.zero_()                 # vocabulary padding rows are not stored: they stay zero
        targets.extend((name, box, box_view(flat, offset - lo, box)) for offset, box in boxes(place, lo, hi))

    for entry in param_entries(run.chunks):
        names, slot = sources[entry.global_name], buffer.slots[entry.buffer_name]
        place = placement(entry.param, entry.global_name, vocab)
        for start, end, values in held_params(buffer, slot.start, slot.end):
            add(names["master"], place, start - slot.start, end - slot.start, values)
        for start, end, _, master, state, cut in optimizer_ranges(optimizer, slot):
            for kind, name in names.items():
                values = master[cut] if kind == "master" else state[kind][cut]
                add(name, place, start - slot.start, end - slot.start, values)
    return targets


@torch.no_grad()
def load_tensors(run: CheckpointState, reader: CheckpointReader, load_optimizer: bool) -> None:
    """Fill this rank's parameters and optimizer state from ``reader``, reading only what it holds."""
    differences = architecture_differences(reader, run.config.model)
    entries = param_entries(run.chunks)
    if load_optimizer:
        check_same_rule(reader, run.config.optimizer.optimizer)
    sources = {e.global_name: source_names(reader, e.global_name, run.optimizer.state_names_of(e.buffer_name)
                                           if load_optimizer else ()) for e in entries}
    for entry in entries:
        for name in sources[entry.global_name].values():
            check_stored(reader, name, entry.param, entry.global_name, run.config.model.vocab_size, differences)
    check_resumed_recipe(reader.has, run.chunks, run.config.model.fp8_format and run.config.model.fp8_recipe)
    if differences:          # every tensor fits, but the model differs (e.g. fewer layers, another rotary base)
        raise UserError(f"checkpoint {reader.directory} is from a different model: {differences[0]}; match the model "
                        "flags or add --use-checkpoint-args")
    reader.read_into(load_targets(run, sources) + buffer_targets(run, reader))
    load_stashed_versions(run, reader, load_optimizer)         # PipeDream's older weight versions
    run.optimizer.set_step_count(reader.metadata["optimizer"]["step"] if load_optimizer else 0.0)
    if not load_optimizer:
        for master in run.optimizer.master_pieces:
            for tensor in run.optimizer.named_state(master).values():
                tensor.zero_()


def check_same_rule(reader: CheckpointReader, rule: str) -> None:
    """The checkpoint's optimizer state is the state of this run's --optimizer (checkpoints from before the
    choice existed hold AdamW's)."""
    saved = reader.metadata["optimizer"].get("rule", "adam")
    if saved != rule:
        raise UserError(f"checkpoint {reader.directory} holds --optimizer {saved} state but this run uses --optimizer "
                        f"{rule}: add --no-load-optim to start {rule} afresh from the checkpoint's weights")


def buffer_targets(run: CheckpointState, reader: CheckpointReader) -> list[tuple[str, Box, torch.Tensor]]:
    """load_targets of the persistent buffers the checkpoint has; one it lacks (a converted Hugging Face
    model has no MoE expert biases) keeps its initial value."""
    targets, vocab = [], run.config.model.vocab_size
    for name, shape, place, flat in buffer_parts(run.chunks, vocab):
        if reader.has(name):
            check_shape(reader, name, shape)
            targets.extend((name, box, box_view(flat, offset, box)) for offset, box in boxes(place, 0, flat.numel()))
    return targets


def load_checkpoint(run: CheckpointState, path: str, load_optimizer: bool = True, load_rng: bool = True,
                    finetune: bool = False, log=print) -> dict | None:
    """Load weights (and optimizer, scheduler, loss scaler, train state) into ``run``. Returns the
    RNG tensors to restore after the data loaders are built (None when they must not be).

    Collective: ranks read different parts of the checkpoint, so a part that fails on one rank (a
    corrupt piece) must stop them all, in one line."""
    error, rng, rng_skipped = None, None, ""
    try:
        reader = CheckpointReader(path)
        meta = reader.metadata
        load_optimizer = load_optimizer and not finetune and meta.get("optimizer") is not None
        load_tensors(run, reader, load_optimizer)
        if load_rng and not finetune:
            rng, rng_skipped = saved_rng(reader, run)
    except UserError as e:
        error = str(e)
    agree(error is None, error or "", run.device)
    run.source = meta.get("source")
    if finetune:
        log(f" > loaded weights from {reader.directory} (iteration {reader.iteration}); --finetune: starting at "
            "iteration 0 with a fresh optimizer")
        return None
    if load_optimizer:
        run.scheduler.load_state_dict(meta["scheduler"])
        if meta["scheduler"].get("decay_iters") not in (None, run.scheduler.decay):
            log(f" > note: the learning rate now decays over {run.scheduler.decay:g} iterations "
                f"({meta['scheduler']['decay_iters']:g} in the checkpoint's run); this run's flags apply")
        if run.optimizer.loss_scaler is not None and meta.get("loss_scaler"):
            run.optimizer.loss_scaler.load_state_dict(meta["loss_scaler"])
    s = meta.get("train_state", {})
    run.train_state.iteration = int(s.get("iteration", reader.iteration))
    run.train_state.consumed_train_samples = int(s.get("consumed_train_samples", 0))
    run.train_state.consumed_valid_samples = int(s.get("consumed_valid_samples", 0))
    run.train_state.skipped_iterations = int(s.get("skipped_iterations", 0))
    run.train_state.nan_iterations = int(s.get("nan_iterations", 0))
    if not load_optimizer:
        run.scheduler.load_state_dict({"num_steps": run.train_state.iteration})
    what = "weights, optimizer" if load_optimizer else "weights"
    note = "" if rng is not None or not load_rng else (f" (RNG state not restored: {rng_skipped}; dropout masks "
                                                       "start again from --seed)")
    log(f" > loaded checkpoint {reader.directory} at iteration {run.train_state.iteration}: {what}{note}")
    return rng


# ---- inference -----------------------------------------------------------------------------------
def load_model(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """A single-process GPTModel in eval mode with the checkpoint's weights and persistent buffers;
    ``model(input_ids)`` returns logits [batch, seq, vocab] over the tokenizer's true vocabulary."""
    from megalite.model.gpt import DTYPES, GPTModel
    reader = CheckpointReader(path)
    dtype_name = {v: k for k, v in DTYPES.items()}[dtype]
    config = model_config_from_metadata(reader.metadata["model"], params_dtype=dtype_name)
    model = GPTModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            g = model.global_name(name)
            source = f"optimizer.master.{g}" if reader.has(f"optimizer.master.{g}") else g
            param.copy_(expected_full(reader, source, param, g, config.vocab_size).reshape(param.shape))
        for name, tensor in persistent_buffers([model]):      # the MoE routers' expert biases
            if reader.has(name):             # one a checkpoint lacks keeps its initial value, as in training
                check_shape(reader, name, tuple(tensor.shape))
                tensor.copy_(reader.tensor(name))
    model.checkpoint_metadata = reader.metadata
    model.checkpoint_dir = reader.directory
    return model.to(device).eval()
