"""Save and load training checkpoints at any TP x PP x DP x ZeRO layout, and load_model for inference.

On disk (checkpoint_files.py) every tensor is the *full* tensor under its global name, so a checkpoint
written at one layout loads at any other. Two conversions connect that to a rank's memory:

- full <-> TP shard. Each parameter knows its full shape and ``take_shard(full) -> local`` (the same
  function initialisation uses). Loading applies it to the stored tensor. Saving inverts it: applying
  ``take_shard`` to ``arange(numel)`` tells which full-tensor elements a rank holds, so the TP group's
  shards are gathered and scattered to those positions (fused QKV/SwiGLU layouts and replicated KV
  heads need nothing special).
- flat optimizer layout <-> per-parameter tensors. The optimizer keeps fp32 master weights and Adam
  moments over ranges of the flat parameter buffer (all of it, or this data-parallel rank's chunk of
  every bucket under ZeRO). Saving all-gathers the chunks over data parallelism into the flat layout
  and cuts it per parameter; loading builds the flat layout from the full tensors and keeps this
  rank's ranges.

The writer of each pipeline stage (tp = dp = cp = 0) holds that stage's full tensors while writing;
other ranks only take part in the gathers. RNG states are per rank and restored only at the same
layout. The word-embedding copy that a later pipeline stage holds for tied output weights is not
stored twice: it loads from the same global name.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.checkpoint_files import (CheckpointReader, model_config_from_metadata, model_metadata, prepare_temporary_dir,
                                       publish, temporary_dir, tokenizer_metadata,
                                       write_metadata, write_tensor_file, TRACKER, METADATA)
from megalite.errors import UserError

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")


@dataclass
class ParamEntry:
    buffer_name: str      # the parameter's key in the flat buffer ("chunk1.decoder.layers.0..." with virtual stages)
    global_name: str      # its name in the whole model, as stored
    param: nn.Parameter
    stored_here: bool     # False for the tied output-layer copy of the word embeddings (stored once)


def param_entries(chunks: list[nn.Module]) -> list[ParamEntry]:
    entries = []
    for c, chunk in enumerate(chunks):
        prefix = f"chunk{c}." if len(chunks) > 1 else ""
        for name, param in chunk.named_parameters():
            if param.requires_grad:
                entries.append(ParamEntry(prefix + name, chunk.global_name(name), param,
                                          not getattr(param, "shared", False)))
    return entries


# ---- full tensor <-> this rank's shard -----------------------------------------------------------
def full_shape(param: nn.Parameter) -> tuple:
    return tuple(getattr(param, "full_shape", param.shape))


def take_shard(param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    shard = getattr(param, "take_shard", None)
    return shard(full) if shard is not None else full


def stored_shape(global_name: str, shape: tuple, vocab_size: int) -> tuple:
    """The vocabulary is stored at the tokenizer's true size (its padding depends on the TP size)."""
    if global_name in VOCAB_PARAMS and vocab_size > 0:
        return (vocab_size, *shape[1:])
    return tuple(shape)


def pad_vocabulary(full: torch.Tensor, global_name: str, padded_shape: tuple) -> torch.Tensor:
    if global_name in VOCAB_PARAMS and full.shape[0] < padded_shape[0]:
        padding = full.new_zeros(padded_shape[0] - full.shape[0], *full.shape[1:])
        return torch.cat([full, padding])
    return full


def gather_full(param: nn.Parameter, local: torch.Tensor, tp_group, tp_size: int) -> torch.Tensor | None:
    """The full tensor of a TP-sharded parameter from every TP rank's ``local`` (on TP rank 0; None
    elsewhere). Replicated parameters are already full."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return local
    shape = full_shape(param)
    positions = take_shard(param, torch.arange(int(torch.Size(shape).numel())).view(shape))
    is_dst = dist.get_rank(tp_group) == 0
    values = [torch.empty_like(local) for _ in range(tp_size)] if is_dst else None
    where = [torch.empty_like(positions) for _ in range(tp_size)] if is_dst else None
    dist.gather(local.contiguous(), values, group=tp_group, group_dst=0)
    dist.gather(positions.contiguous(), where, group=tp_group, group_dst=0)
    if not is_dst:
        return None
    full = torch.empty(torch.Size(shape).numel(), dtype=local.dtype)
    for v, w in zip(values, where):
        full[w.reshape(-1)] = v.reshape(-1).cpu()
    return full.view(shape)


# ---- the optimizer's flat state ------------------------------------------------------------------
def flat_optimizer_state(optimizer, buffer, dp_group) -> dict[str, torch.Tensor]:
    """fp32 master weights and Adam moments over this rank's whole flat buffer layout (ZeRO chunks
    all-gathered over data parallelism)."""
    flat = {k: torch.zeros(buffer.numel, dtype=torch.float32) for k in ("master",) + OPTIMIZER_STATES}
    sharded = optimizer.grads_sharded and dp_group is not None
    buckets = buffer.buckets if optimizer.grads_sharded else [None]
    for bucket, piece, master in zip(buckets, optimizer.pieces, optimizer.master_pieces):
        state = optimizer.adam.state[master]
        values = {"master": master, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        for kind, value in values.items():
            value = value.detach().float().cpu()
            if sharded:
                dist.all_gather_single(flat[kind][bucket.start:bucket.end], value.contiguous(), group=dp_group)
            else:
                flat[kind][piece.start:piece.end] = value
    return flat


def set_flat_optimizer_state(optimizer, flat: dict[str, torch.Tensor], step: float | None) -> None:
    """Master weights from ``flat["master"]``; moments and step from ``flat`` when given, else fresh."""
    for piece, master in zip(optimizer.pieces, optimizer.master_pieces):
        master.data.copy_(flat["master"][piece.start:piece.end].to(master.device))
        state = optimizer.adam.state[master]
        for kind in OPTIMIZER_STATES:
            if kind in flat:
                state[kind].copy_(flat[kind][piece.start:piece.end].to(state[kind].device))
            else:
                state[kind].zero_()
        state["step"].fill_(step or 0.0)


def set_flat_params(buffer, flat_weights: torch.Tensor) -> None:
    """Model-dtype parameters from a flat fp32 layout (ZeRO-3: only this rank's chunks exist)."""
    if buffer.param_data is not None:
        buffer.param_data.copy_(flat_weights.to(buffer.param_data.device, buffer.param_dtype))
        return
    for bucket in buffer.buckets:
        start, end = buffer.local_range(bucket)
        chunk = buffer.local_param_chunk(bucket)
        chunk.copy_(flat_weights[start:end].to(chunk.device, chunk.dtype))


# ---- RNG -----------------------------------------------------------------------------------------
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


def layout_of(trainer) -> dict:
    p = trainer.parallel
    return {"world_size": p.world_size, "tensor_model_parallel_size": p.tp_size, "pipeline_model_parallel_size": p.pp_size,
            "context_parallel_size": p.cp_size, "data_parallel_size": p.dp_size, "virtual_pipeline_chunks": len(trainer.chunks),
            "data_parallel_sharding_strategy": trainer.config.parallel.data_parallel_sharding_strategy}


# ---- save ----------------------------------------------------------------------------------------
def _agree(ok: bool, message: str, device) -> None:
    """Every rank learns whether any rank failed (so none waits in a collective for a failed one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if not ok:
            raise UserError(message)
        return
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if ok else message)
    if int(flag):
        raise UserError(next(m for m in messages if m))


def save_checkpoint(trainer, root: str) -> str:
    """Collective: every rank calls it. Writes iter_N.tmp, then rank 0 publishes it as iter_N."""
    p, iteration = trainer.parallel, trainer.state.iteration
    distributed = dist.is_initialized() and p.world_size > 1
    error = None
    if p.rank == 0:
        try:
            prepare_temporary_dir(root, iteration)
        except UserError as e:
            error = str(e)
    _agree(error is None, error or "", trainer.device)
    if distributed:
        dist.barrier()
    tmp = temporary_dir(root, iteration)

    trainer.ddp.wait_for_param_gather()
    flat = flat_optimizer_state(trainer.optimizer, trainer.buffer, trainer.ddp.group)
    fp32_model = trainer.buffer.param_dtype == torch.float32
    gathers_tp = p.dp_rank == 0 and p.cp_rank == 0            # one TP group per stage assembles full tensors
    writer = gathers_tp and p.tp_rank == 0
    vocab = trainer.config.model.vocab_size
    weights, optimizer_tensors = {}, {}
    for entry in param_entries(trainer.chunks):
        if not entry.stored_here or not gathers_tp:
            continue
        for kind in ("master",) + OPTIMIZER_STATES:
            local = trainer.buffer.view(flat[kind], entry.buffer_name)
            full = gather_full(entry.param, local, p.group("tp"), p.tp_size)
            if not writer:
                continue
            full = full[:stored_shape(entry.global_name, full.shape, vocab)[0]]
            if kind == "master":
                weights[entry.global_name] = full.to(entry.param.dtype)
                if not fp32_model:
                    optimizer_tensors[f"optimizer.master.{entry.global_name}"] = full
            else:
                optimizer_tensors[f"optimizer.{kind}.{entry.global_name}"] = full
    index = {}
    if writer:
        index.update(write_tensor_file(tmp, f"model-pp{p.pp_rank:03d}.safetensors", weights))
        index.update(write_tensor_file(tmp, f"optimizer-pp{p.pp_rank:03d}.safetensors", optimizer_tensors))
    rng_file = f"rng-rank{p.rank:05d}.safetensors"
    rng_index = write_tensor_file(tmp, rng_file, rng_tensors(trainer.model.tp.rng))
    rng_crcs = {rng_file: rng_index}
    if distributed:
        gathered = [None] * p.world_size
        dist.all_gather_object(gathered, (index, rng_crcs))
    else:
        gathered = [(index, rng_crcs)]
    if p.rank == 0:
        tensors, rng = {}, {}
        for part, rng_part in gathered:
            tensors.update(part)
            rng.update(rng_part)
        step = float(next(iter(trainer.optimizer.adam.state.values()))["step"])
        write_metadata(tmp, training_metadata(trainer, tensors, rng, step))
    if distributed:
        dist.barrier()
    final = publish(root, iteration) if p.rank == 0 else None
    if distributed:
        dist.barrier()
    return final or os.path.join(root, f"iter_{iteration:07d}")


def training_metadata(trainer, tensors: dict, rng: dict, adam_step: float) -> dict:
    cfg, state = trainer.config, trainer.state
    scaler = trainer.optimizer.loss_scaler
    return {
        "iteration": state.iteration,
        "model": model_metadata(cfg.model),
        "tokenizer": tokenizer_metadata(cfg.data),
        "args": dataclasses.asdict(cfg),
        "layout": layout_of(trainer),
        "train_state": {"iteration": state.iteration, "consumed_train_samples": state.consumed_train_samples,
                        "consumed_valid_samples": state.consumed_valid_samples,
                        "skipped_iterations": state.skipped_iterations, "nan_iterations": state.nan_iterations},
        "scheduler": trainer.scheduler.state_dict(),
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "optimizer": {"step": adam_step, "has_master": trainer.buffer.param_dtype != torch.float32},
        "source": trainer.checkpoint_source,      # where the weights first came from (e.g. a converted HF model)
        "tensors": tensors,
        "rng_files": rng,
    }


# ---- load ----------------------------------------------------------------------------------------
def has_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TRACKER)) or os.path.isfile(os.path.join(path, METADATA))


def architecture_differences(reader: CheckpointReader, model_config) -> list[str]:
    """Model fields where the checkpoint and this run disagree, as "--flag saved vs this run"."""
    differences = []
    for name, value in reader.metadata.get("model", {}).items():
        if name in ("params_dtype", "seq_length"):
            continue
        mine = getattr(model_config, name, None)
        if mine != value:
            flag = "the tokenizer's vocabulary" if name == "vocab_size" else "--" + name.replace("_", "-")
            differences.append(f"{flag}: {value!r} in the checkpoint, {mine!r} in this run")
    return differences


def _hint(differences: list[str]) -> str:
    return f" ({'; '.join(differences[:3])})" if differences else ""


def expected_full(reader: CheckpointReader, name: str, param: nn.Parameter, global_name: str, vocab: int,
                  differences: list[str] = ()) -> torch.Tensor:
    """The stored tensor ``name`` after checking its shape against the parameter, vocabulary padded."""
    shape = stored_shape(global_name, full_shape(param), vocab)
    if not reader.has(name):
        raise UserError(f"checkpoint {reader.directory} has no tensor {name!r}{_hint(differences)}; it was saved "
                        "from a different model: match the model flags or add --use-checkpoint-args")
    if reader.shape(name) != shape:
        raise UserError(f"checkpoint tensor {name!r} has shape {list(reader.shape(name))} but the model expects "
                        f"{list(shape)}{_hint(differences)}; match the model flags or add --use-checkpoint-args")
    return pad_vocabulary(reader.tensor(name).float(), global_name, full_shape(param))


def load_checkpoint(trainer, path: str, load_optimizer: bool = True, load_rng: bool = True,
                    finetune: bool = False, log=print) -> dict | None:
    """Load weights (and optimizer, scheduler, loss scaler, train state) into ``trainer``. Returns the
    RNG tensors to restore after the data loaders are built (None when they must not be)."""
    reader = CheckpointReader(path)
    cfg = trainer.config
    differences = architecture_differences(reader, cfg.model)
    meta = reader.metadata
    trainer.checkpoint_source = meta.get("source")
    load_optimizer = load_optimizer and not finetune and meta.get("optimizer") is not None
    vocab = cfg.model.vocab_size
    flat = {"master": torch.zeros(trainer.buffer.numel, dtype=torch.float32)}
    if load_optimizer:
        flat.update({k: torch.zeros(trainer.buffer.numel, dtype=torch.float32) for k in OPTIMIZER_STATES})
    for entry in param_entries(trainer.chunks):
        g = entry.global_name
        master = f"optimizer.master.{g}" if reader.has(f"optimizer.master.{g}") else g
        sources = {"master": master, **{k: f"optimizer.{k}.{g}" for k in OPTIMIZER_STATES if k in flat}}
        for kind, name in sources.items():
            full = expected_full(reader, name, entry.param, g, vocab, differences)
            trainer.buffer.view(flat[kind], entry.buffer_name).copy_(take_shard(entry.param, full))
    if differences:          # every tensor fits, but the model differs (e.g. fewer layers, another rotary base)
        raise UserError(f"checkpoint {reader.directory} is from a different model: {differences[0]}; match the model "
                        "flags or add --use-checkpoint-args")
    set_flat_params(trainer.buffer, flat["master"])
    set_flat_optimizer_state(trainer.optimizer, flat, meta["optimizer"]["step"] if load_optimizer else None)
    if finetune:
        log(f" > loaded weights from {reader.directory} (iteration {reader.iteration}); --finetune: starting at "
            "iteration 0 with a fresh optimizer")
        return None
    if load_optimizer:
        trainer.scheduler.load_state_dict(meta["scheduler"])
        if meta["scheduler"].get("decay_iters") not in (None, trainer.scheduler.decay):
            log(f" > note: the learning rate now decays over {trainer.scheduler.decay:g} iterations "
                f"({meta['scheduler']['decay_iters']:g} in the checkpoint's run); this run's flags apply")
        if trainer.optimizer.loss_scaler is not None and meta.get("loss_scaler"):
            trainer.optimizer.loss_scaler.load_state_dict(meta["loss_scaler"])
    s = meta.get("train_state", {})
    trainer.state.iteration = int(s.get("iteration", reader.iteration))
    trainer.state.consumed_train_samples = int(s.get("consumed_train_samples", 0))
    trainer.state.consumed_valid_samples = int(s.get("consumed_valid_samples", 0))
    trainer.state.skipped_iterations = int(s.get("skipped_iterations", 0))
    trainer.state.nan_iterations = int(s.get("nan_iterations", 0))
    if not load_optimizer:
        trainer.scheduler.load_state_dict({"num_steps": trainer.state.iteration})
    same_layout = meta.get("layout") == layout_of(trainer)
    rng = reader.rng_tensors(f"rng-rank{trainer.parallel.rank:05d}.safetensors") if load_rng and same_layout else None
    what = "weights, optimizer" if load_optimizer else "weights"
    note = "" if rng is not None or not load_rng else " (RNG state not restored: the layout differs)"
    log(f" > loaded checkpoint {reader.directory} at iteration {trainer.state.iteration}: {what}{note}")
    return rng


# ---- inference -----------------------------------------------------------------------------------
def load_model(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """A single-process GPTModel in eval mode with the checkpoint's weights; ``model(input_ids)``
    returns logits [batch, seq, vocab] over the tokenizer's true vocabulary."""
    from megalite.model.gpt import DTYPES, GPTModel
    reader = CheckpointReader(path)
    dtype_name = {v: k for k, v in DTYPES.items()}[dtype]
    config = model_config_from_metadata(reader.metadata["model"], params_dtype=dtype_name)
    model = GPTModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            g = model.global_name(name)
            source = f"optimizer.master.{g}" if reader.has(f"optimizer.master.{g}") else g
            param.copy_(expected_full(reader, source, param, g, config.vocab_size))
    model.checkpoint_metadata = reader.metadata
    model.checkpoint_dir = reader.directory
    return model.to(device).eval()
