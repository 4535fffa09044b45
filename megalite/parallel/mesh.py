"""The process-group layout of one run: a rank grid in Megatron's order (tp fastest, then cp, dp, pp).

``ParallelState`` is built once from the world size and the model-parallel sizes and passed
explicitly to whatever needs a rank or a group; there are no module-level globals. With every size 1
and no process group started (plain ``python pretrain_gpt.py``) it describes a single process and holds no
groups; under torchrun every group exists, size 1 included, so one process runs every collective path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from itertools import product

import torch.distributed as dist

from megalite.config.schema import ParallelConfig
from megalite.config.validate import check_world_size


def rank_grid_groups(world_size: int, tp: int, cp: int, pp: int, varying: str) -> list[list[int]]:
    """All groups of ranks that differ only along ``varying`` (a subset of "tcdp": tp, cp, dp, pp).

    Rank = tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank)): tp varies fastest, so a TP group is a
    run of adjacent ranks (it stays inside a node), and pp slowest.
    """
    dp = world_size // (tp * cp * pp)
    sizes = {"t": tp, "c": cp, "d": dp, "p": pp}
    fixed_axes = [a for a in "tcdp" if a not in varying]
    groups = []
    for fixed in product(*(range(sizes[a]) for a in fixed_axes)):
        coord = dict(zip(fixed_axes, fixed))
        members = []
        for moving in product(*(range(sizes[a]) for a in reversed(varying))):
            coord.update(zip(reversed(varying), moving))
            members.append(coord["t"] + tp * (coord["c"] + cp * (coord["d"] + dp * coord["p"])))
        groups.append(sorted(members))
    return sorted(groups)


@dataclass
class ParallelState:
    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    cp_size: int = 1
    pp_size: int = 1
    groups: dict = field(default_factory=dict)   # name -> process group of this rank (None when size 1)
    timeout: timedelta | None = None              # of every group (new groups would get torch's 30 min)

    def new_group(self, members: list[int]):
        return dist.new_group(members, timeout=self.timeout)

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.cp_size * self.pp_size)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.cp_size

    @property
    def dp_rank(self) -> int:
        return (self.rank // (self.tp_size * self.cp_size)) % self.dp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp_size * self.cp_size * self.dp_size)

    @property
    def is_logging_rank(self) -> bool:
        """Megatron prints the training line from the last rank. It holds the loss unless the schedule puts the
        last virtual stage elsewhere (zbv: pipeline rank 0); train/step.py's reported_loss brings it there."""
        return self.rank == self.world_size - 1

    def group(self, name: str):
        return self.groups.get(name)

    @classmethod
    def build(cls, world_size: int, rank: int, tp: int = 1, cp: int = 1, pp: int = 1,
              timeout: timedelta | None = None) -> "ParallelState":
        """Create every process group (collectively: all ranks must call this in the same order)."""
        check_world_size(world_size, ParallelConfig(world_size=world_size, tensor_model_parallel_size=tp,
                                                    pipeline_model_parallel_size=pp, context_parallel_size=cp))
        state = cls(world_size, rank, tp, cp, pp, timeout=timeout)
        started = dist.is_initialized() and dist.get_world_size() == world_size
        if not started:          # a plain single process (or a 1-process reference inside a larger run)
            return state
        for name, varying in {"tp": "t", "cp": "c", "dp": "d", "pp": "p", "dp_cp": "cd", "mp": "tp",
                              "tp_cp": "tc"}.items():
            for members in rank_grid_groups(world_size, tp, cp, pp, varying):
                group = state.new_group(members)              # every rank creates every group
                if rank in members:
                    state.groups[name] = group
        # first and last pipeline stage of each pipeline: they share the (tied) word embeddings
        for members in rank_grid_groups(world_size, tp, cp, pp, "p"):
            ends = sorted({members[0], members[-1]})
            group = state.new_group(ends)
            if rank in ends:
                state.groups["embedding"] = group
        return state
