"""Where a run's checkpoints go, and which one it resumes from.

- --save: persistent checkpoints, every --save-interval and at the end of the run; all are kept.
- --non-persistent-save-interval N: cheap, frequent checkpoints between those, of which the newest
  KEEP are kept (Megatron's flags):
  - --non-persistent-ckpt-type global: in --non-persistent-global-ckpt-dir (default SAVE/non_persistent),
    shared by every rank like --save;
  - --non-persistent-ckpt-type local: in --non-persistent-local-ckpt-dir, a directory of each node's
    own (a fast local disk). Each rank writes its files there; each distinct directory is published by
    one rank that sees it (save.prepare).
  An iteration that is also a persistent save is saved only persistently.

On --load (a --save directory), the newest complete checkpoint of the three places wins; a persistent
one wins a tie. A local checkpoint is complete for this run only where every rank sees all of it: a
directory holds all of a checkpoint exactly when it holds every writing rank's RNG and index files
(every rank writes both; its data files go with them). On one node, or with the directory on a shared
filesystem, that holds and the checkpoint loads like any other, at any layout. Spread over several
nodes' disks it cannot be read; the run says so in one line and resumes from the newest other one.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megalite.checkpoint.files import METADATA, TRACKER, iteration_dir, published_iterations
from megalite.checkpoint.index import index_filename
from megalite.checkpoint.save import Destination
from megalite.checkpoint.sharded import has_checkpoint, rng_filename

KEEP = 2            # non-persistent checkpoints kept: the newest can be one that only some nodes published


def persistent(t) -> Destination:
    return Destination(t.save)


def non_persistent(t) -> Destination | None:
    """Where --non-persistent-ckpt-type saves (None: not set)."""
    if t.non_persistent_ckpt_type == "local":
        return Destination(t.non_persistent_local_ckpt_dir, "--non-persistent-local-ckpt-dir", True, KEEP)
    if t.non_persistent_ckpt_type == "global":
        root = t.non_persistent_global_ckpt_dir or os.path.join(t.save, "non_persistent")
        return Destination(root, "--non-persistent-global-ckpt-dir", False, KEEP)
    return None


def resume_directory(t, device, log) -> str | None:
    """The iter_N directory --load resumes from: the one it names, or the newest complete checkpoint of
    --load's and the non-persistent ones; None where there is none yet. Collective with a local type."""
    other = non_persistent(t)
    if os.path.isfile(os.path.join(t.load, METADATA)) or other is None:    # an iter_N directory, or only --load
        return t.load if has_checkpoint(t.load) else None
    found = [(tracked(t.load), 1, t.load)]
    if not other.node_local:
        found.append((tracked(other.root), 0, other.root))
    else:
        found.append((common_local(other.root, device, log, newest_other=max(i for i, _, _ in found)), 0, other.root))
    iteration, _, root = max(found)
    return iteration_dir(root, iteration) if iteration >= 0 else None


def is_non_persistent(t, path: str) -> bool:
    """Whether ``path`` (an iter_N directory) is a non-persistent checkpoint of this run's."""
    other = non_persistent(t)
    return other is not None and os.path.abspath(os.path.dirname(path)) == os.path.abspath(other.root)


def tracked(root: str) -> int:
    """The iteration a save directory's tracker names (-1: none)."""
    try:
        text = open(os.path.join(root, TRACKER)).read().strip()
    except OSError:
        return -1
    return int(text) if text.isdigit() else -1


def whole_here(root: str, iteration: int) -> bool:
    """Whether this rank sees all of a published local checkpoint: every writer's RNG and index file."""
    directory = iteration_dir(root, iteration)
    try:
        writers = json.load(open(os.path.join(directory, METADATA)))["index"]["shards"]
        names = set(os.listdir(directory))
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all(rng_filename(r) in names and index_filename(r) in names for r in range(writers))


def common_local(root: str, device, log, newest_other: int) -> int:
    """Collective: the newest local checkpoint every rank sees whole (-1: none). Where a newer one than
    ``newest_other`` exists that not every rank sees whole, one line says so."""
    published = published_iterations(root)[-KEEP:]
    mine = [i for i in published if whole_here(root, i)]
    row = torch.tensor([*(mine + [-1] * KEEP)[:KEEP], max(published, default=-1)], dtype=torch.int64, device=device)
    rows = [row]
    if dist.is_initialized() and dist.get_world_size() > 1:
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
    rows = [r.tolist() for r in rows]
    common = set.intersection(*({i for i in r[:KEEP] if i >= 0} for r in rows))
    best, newest = max(common, default=-1), max(r[KEEP] for r in rows)
    if newest > max(best, newest_other):
        log(f" > the non-persistent checkpoint of iteration {newest} in --non-persistent-local-ckpt-dir {root} is "
            "not whole on every rank (each node's directory holds its own ranks' files); resuming from "
            + (f"iteration {max(best, newest_other)}" if max(best, newest_other) >= 0 else "scratch"))
    return best
