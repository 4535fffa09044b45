"""Saving a training checkpoint: every rank plans its part, writes its files, and once all of them
are durable the index is exchanged and rank 0 publishes (the directory's format: files.py; what a rank
owns and writes: sharded.py). The plan is fixed at the iteration it is taken, so its files can also be
written in the background (background.py)."""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from megalite.checkpoint.files import (iteration_dir, model_metadata, prepare_temporary_dir, prune, publish,
                                       remove_leftovers, temporary_dir, tokenizer_metadata, write_metadata)
from megalite.checkpoint.index import BANDS, encode, exchange, merge, outgoing, write_index_file
from megalite.checkpoint.sharded import agree, layout_of, planned_shards, rng_filename, rng_tensors
from megalite.checkpoint.state import CheckpointState
from megalite.checkpoint.tensor_file import write_tensor_file
from megalite.errors import UserError


@dataclasses.dataclass(frozen=True)
class Destination:
    """Where a save goes. ``root`` is shared by every rank (--save, a global non-persistent directory:
    rank 0 prepares and publishes it) or, ``node_local``, a directory of each node's own
    (--non-persistent-local-ckpt-dir: in each distinct directory the lowest rank of local rank 0 that sees
    it does). ``keep``: how many published checkpoints it keeps (None: all)."""
    root: str
    flag: str = "--save"
    node_local: bool = False
    keep: int | None = None


@dataclasses.dataclass
class SavePlan:
    """One rank's part of a save, fixed at the iteration it is taken: the tensors it writes ({file: {key:
    tensor}}, views of the live state until written or snapshotted; its RNG file among them), its index
    entries (without the CRCs, known once written) and, where it publishes the directory, the metadata."""
    destination: Destination
    iteration: int
    directory: str                       # iter_N.tmp, published as iter_N
    files: dict[str, dict]
    index: dict[str, dict]
    rng_file: str
    metadata: dict | None
    rank: int
    world: int

    @property
    def root(self) -> str:
        return self.destination.root

    def full_disk(self, error: OSError) -> str:
        return (f"{self.destination.flag} {self.root}: cannot write the checkpoint ({error.strerror or error}); free "
                "some space or choose another directory")


def plan_save(run: CheckpointState, destination: Destination) -> SavePlan:
    """Collective: a fresh iter_N.tmp in every directory the ranks write to, every rank learning whether it
    could; then this rank's plan, once no asynchronous parameter gather can still write into what it saves."""
    p, iteration = run.parallel, run.train_state.iteration
    publisher = prepare(destination, iteration, p.rank, run.device)
    run.data_parallel.wait_for_param_gather()
    files, index = planned_shards(run)
    rng_file = rng_filename(p.rank)
    files[rng_file] = rng_tensors(run.rng)
    metadata = None
    if publisher:
        metadata = training_metadata(run)
    world = p.world_size if dist.is_initialized() else 1
    return SavePlan(destination, iteration, temporary_dir(destination.root, iteration), files, index, rng_file,
                    metadata, p.rank, world)


def prepare(destination: Destination, iteration: int, rank: int, device) -> bool:
    """Collective: prepares iter_N.tmp; returns whether this rank publishes it. A node-local directory is
    prepared by each node's local rank 0 in two agreed steps (remove leftovers, then create and sign), so
    that ranks that turn out to share one (a shared filesystem) neither delete each other's work nor both
    publish: the lowest signer publishes."""
    root, flag = destination.root, destination.flag
    if not destination.node_local:
        agree(*attempt(rank == 0, lambda: prepare_temporary_dir(root, iteration, flag)), device)
        return rank == 0
    leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
    agree(*attempt(leader, lambda: remove_leftovers(root, flag)), device)
    signature = f".publisher-rank{rank:05d}"

    def create_and_sign() -> None:
        tmp = prepare_temporary_dir(root, iteration, flag, exist_ok=True)
        open(os.path.join(tmp, signature), "w").close()
    agree(*attempt(leader, create_and_sign), device)
    tmp = temporary_dir(root, iteration)
    return leader and min(n for n in os.listdir(tmp) if n.startswith(".publisher-rank")) == signature


def attempt(here: bool, action) -> tuple[bool, str]:
    """(ok, message) of ``action`` where ``here``, for ``agree``."""
    if here:
        try:
            action()
        except UserError as e:
            return False, str(e)
    return True, ""


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
    if plan.metadata is not None:                           # this rank publishes the directory
        publish(plan.root, plan.iteration)
        if plan.destination.keep:
            prune(plan.root, plan.destination.keep)
    if plan.world > 1:
        dist.barrier(group=group)
    return iteration_dir(plan.root, plan.iteration)


def save_checkpoint(run: CheckpointState, root: str | Destination) -> str:
    """Collective: every rank calls it. Writes iter_N.tmp, then rank 0 publishes it as iter_N."""
    plan = plan_save(run, root if isinstance(root, Destination) else Destination(root))
    records, error = write_files(plan, plan.files)      # every rank writes: a full disk on one stops them all
    return publish_plan(plan, records, error, run.device)


def training_metadata(run: CheckpointState) -> dict:
    cfg, state = run.config, run.train_state
    scaler = run.optimizer.loss_scaler
    return {
        "iteration": state.iteration,
        "model": model_metadata(cfg.model),
        "tokenizer": tokenizer_metadata(cfg.data),
        "args": dataclasses.asdict(cfg),
        "layout": layout_of(run),
        "train_state": {"iteration": state.iteration, "consumed_train_samples": state.consumed_train_samples,
                        "consumed_valid_samples": state.consumed_valid_samples,
                        "skipped_iterations": state.skipped_iterations, "nan_iterations": state.nan_iterations},
        "scheduler": run.scheduler.state_dict(),
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "optimizer": {"step": run.optimizer.step_count, "has_master": run.buffer.param_dtype != torch.float32,
                      "rule": cfg.optimizer.optimizer},
        "source": run.source,      # where the weights first came from (e.g. a converted HF model)
        "index": {"shards": run.parallel.world_size, "bands": BANDS, "holder": "crc32(key) % shards"},
    }
