"""PipeDream's stashed weight versions in a checkpoint: stored like the weights, under their own names
(pipedream.stashed_name), so a resume at any layout reads the versions it needs (sharded.py writes and
reads them with the weights)."""
from __future__ import annotations

import torch

from megalite.checkpoint.pieces import box_view, boxes, held_params, param_entries, placement
from megalite.checkpoint.state import CheckpointState
from megalite.errors import UserError
from megalite.parallel.pipeline.pipedream import stashed_name


def stashed_sources(run: CheckpointState, global_name: str, start: int, end: int) -> dict[str, torch.Tensor]:
    """For owned_parts: the flat range [start, end) of each stashed older version (pipedream.py)."""
    runner = run.async_pipeline
    if runner is None:
        return {}
    return {stashed_name(k, global_name): flat[start:end] for k, flat in runner.stashed().items()}


@torch.no_grad()
def load_stashed_versions(run: CheckpointState, reader, load_optimizer: bool, log=print) -> None:
    """After the weights are loaded: restart the stream at the checkpoint's iteration with the older
    versions it needs, read from the checkpoint. Without them (--no-load-optim, or a checkpoint of a
    synchronous schedule) they start as copies of the loaded weights; a checkpoint of the same schedule
    that lacks some was saved at a pipeline layout that kept fewer versions: one line."""
    runner = run.async_pipeline
    if runner is None:
        return
    runner.restart_at(int(reader.metadata.get("train_state", {}).get("iteration", reader.iteration)))
    needed = runner.needed_behind()
    if not needed:
        return
    versions = runner.versions
    entries = param_entries(run.chunks)
    names = [stashed_name(k, e.global_name) for k in needed for e in entries]
    if not load_optimizer or not all(reader.has(n) for n in names):
        saved = (reader.metadata.get("args") or {}).get("parallel", {})
        if load_optimizer and saved.get("pipeline_schedule") == runner.schedule:
            raise UserError(f"checkpoint {reader.directory} lacks weight versions that --pipeline-schedule "
                            f"{runner.schedule} needs at this pipeline layout (saved at --pipeline-model-parallel-size "
                            f"{saved.get('pipeline_model_parallel_size')}); resume at that size or add --no-load-optim")
        for k in needed:
            versions.stash[versions.newest - k] = versions.flat.clone()
        log(f" > {runner.schedule}: no stashed weight versions in the checkpoint; the older versions start as "
            "copies of the loaded weights")
        return
    buffer, vocab, targets = run.buffer, run.config.model.vocab_size, []
    for k in needed:
        flat = torch.zeros_like(versions.flat)       # vocabulary padding rows are not stored: they stay zero
        versions.stash[versions.newest - k] = flat
        for entry in entries:
            slot = buffer.slots[entry.buffer_name]
            place = placement(entry.param, entry.global_name, vocab)
            for start, end, _ in held_params(buffer, slot.start, slot.end):
                lo = start - slot.start
                targets += [(stashed_name(k, entry.global_name), box, box_view(flat[start:end], offset - lo, box))
                            for offset, box in boxes(place, lo, end - slot.start)]
    reader.read_into(targets)
