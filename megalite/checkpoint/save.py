"""Saving a training checkpoint: every rank plans its part, writes its files, and once all of them
are durable the index is exchanged and rank 0 publishes (the directory's format: files.py; what a rank
owns and writes: sharded.py). The plan is fixed at the iteration it is taken, so its files can also be
written in the background (background.py)."""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from megalite.checkpoint.files import (iteration_dir, model_metadata, prepare_temporary_dir, publish, temporary_dir,
                                       tokenizer_metadata, write_metadata)
from megalite.checkpoint.index import BANDS, encode, exchange, merge, outgoing, write_index_file
from megalite.checkpoint.sharded import agree, layout_of, planned_shards, rng_tensors
from megalite.checkpoint.tensor_file import write_tensor_file
from megalite.errors import UserError


@dataclasses.dataclass
class SavePlan:
    """One rank's part of a save, fixed at the iteration it is taken: the tensors it writes ({file: {key:
    tensor}}, views of the live state until written or snapshotted; its RNG file among them), its index
    entries (without the CRCs, known once written) and rank 0's metadata."""
    root: str
    iteration: int
    directory: str                       # iter_N.tmp, published as iter_N
    files: dict[str, dict]
    index: dict[str, dict]
    rng_file: str
    metadata: dict | None
    rank: int
    world: int

    def full_disk(self, error: OSError) -> str:
        return (f"--save {self.root}: cannot write the checkpoint ({error.strerror or error}); free some space or "
                "choose another directory")


def plan_save(trainer, root: str) -> SavePlan:
    """Collective: rank 0 prepares a fresh iter_N.tmp and every rank learns whether it could; then this
    rank's plan, once no asynchronous parameter gather can still write into what it saves."""
    p, iteration = trainer.parallel, trainer.state.iteration
    error = None
    if p.rank == 0:
        try:
            prepare_temporary_dir(root, iteration)
        except UserError as e:
            error = str(e)
    agree(error is None, error or "", trainer.device)
    trainer.ddp.wait_for_param_gather()
    files, index = planned_shards(trainer)
    rng_file = f"rng-rank{p.rank:05d}.safetensors"
    files[rng_file] = rng_tensors(trainer.model.tp.rng)
    metadata = None
    if p.rank == 0:
        metadata = training_metadata(trainer, float(next(iter(trainer.optimizer.adam.state.values()))["step"]))
    world = p.world_size if dist.is_initialized() else 1
    return SavePlan(root, iteration, temporary_dir(root, iteration), files, index, rng_file, metadata, p.rank, world)


def write_files(plan: SavePlan, files: dict[str, dict]) -> tuple[dict[str, dict] | None, str | None]:
    """Write ``files`` (the plan's, or a snapshot of them) into the plan's directory: ({file: {key: record}},
    None), or (None, the error) when the disk refuses. Calls nothing of torch given HostArrays."""
    records = {}
    try:
        for filename, tensors in files.items():
            records[filename] = write_tensor_file(plan.directory, filename, tensors)
    except OSError as e:
        return None, plan.full_disk(e)
    return records, None


def publish_plan(plan: SavePlan, records: dict | None, error: str | None, device, group=None) -> str:
    """Collective over ``group`` (every rank): once every rank has written its files (a failure on one
    stops them all), each sends its index entries to their holders, the holders write the index files,
    rank 0 the metadata; once all are on disk rank 0 publishes iter_N.tmp as iter_N."""
    agree(error is None, error or "", device, group)
    for stored in plan.index.values():
        for piece in stored["pieces"]:
            piece["crc32"] = records[piece["file"]][piece["key"]]["crc32"]
    sizes = {name: os.path.getsize(os.path.join(plan.directory, name)) for name in plan.files}
    payloads = encode(outgoing(plan.index, {plan.rng_file: records[plan.rng_file]}, sizes, plan.world), plan.world)
    received = exchange(payloads, device, group) if plan.world > 1 else payloads
    try:
        write_index_file(plan.directory, plan.rank, merge(received))
        if plan.metadata is not None:
            write_metadata(plan.directory, plan.metadata)
    except OSError as e:
        error = plan.full_disk(e)
    except UserError as e:                                  # merge: the writers of a tensor disagree
        error = str(e)
    agree(error is None, error or "", device, group)       # every index file is written before the rename
    final = publish(plan.root, plan.iteration) if plan.rank == 0 else None
    if plan.world > 1:
        dist.barrier(group=group)
    return final or iteration_dir(plan.root, plan.iteration)


def save_checkpoint(trainer, root: str) -> str:
    """Collective: every rank calls it. Writes iter_N.tmp, then rank 0 publishes it as iter_N."""
    plan = plan_save(trainer, root)
    records, error = write_files(plan, plan.files)      # every rank writes: a full disk on one stops them all
    return publish_plan(plan, records, error, trainer.device)


def training_metadata(trainer, adam_step: float) -> dict:
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
        "index": {"shards": trainer.parallel.world_size, "bands": BANDS, "holder": "crc32(key) % shards"},
    }
