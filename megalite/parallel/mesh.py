"""The process-group layout of one run: a rank grid in Megatron's order (tp fastest, then cp, dp, pp).

MoE layers see the same ranks through a second grid (Megatron's expert grid): within each pipeline
stage's tp x cp x dp ranks, expert-tensor-parallel (etp) varies fastest, then expert-parallel (ep),
then expert-data-parallel (edp = world / (etp x ep x pp)). Expert weights are split over ep (whole
experts) and etp (each expert's hidden dimension) and replicated over edp, whose ranks reduce their
gradients (and shard them under ZeRO).

Hybrid sharding (``--num-distributed-optimizer-instances K``, Megatron's distributed-optimizer instances,
PyTorch's HSDP): the data-parallel x context-parallel group of D ranks is cut into K instances of D/K
consecutive ranks ("dp_cp_shard": ZeRO shards within it, and consecutive ranks stay inside a node) and
the ranks at the same place in every instance form a replica group of K ("dp_cp_replica": the shards'
gradients are all-reduced across it). The expert-data-parallel group splits the same way ("edp_shard",
"edp_replica"). With K = 1 neither exists: the shard group is the whole group.

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

from megalite.parallel.dry_run import REAL_RUN, RealRun


def rank_grid_groups(world_size: int, tp: int, cp: int, pp: int, varying: str) -> list[list[int]]:
    """All groups of ranks that differ only along ``varying`` (a subset of "tcdp": tp, cp, dp, pp).

    Rank = tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank)): tp varies fastest, so a TP group is a
    run of adjacent ranks (it stays inside a node), and pp slowest.
    """
    return grid_groups({"t": tp, "c": cp, "d": world_size // (tp * cp * pp), "p": pp}, "tcdp", varying)


def grid_groups(sizes: dict, order: str, varying: str) -> list[list[int]]:
    """All groups of ranks that differ only along the axes ``varying`` of a grid whose axes, fastest
    first, are ``order`` with ``sizes``."""
    fixed_axes = [a for a in order if a not in varying]
    groups = []
    for fixed in product(*(range(sizes[a]) for a in fixed_axes)):
        coord = dict(zip(fixed_axes, fixed))
        members = []
        for moving in product(*(range(sizes[a]) for a in varying)):
            coord.update(zip(varying, moving))
            rank, stride = 0, 1
            for axis in order:
                rank, stride = rank + coord[axis] * stride, stride * sizes[axis]
            members.append(rank)
        groups.append(sorted(members))
    return sorted(groups)


def hybrid_groups(members: list[int], instances: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replica groups) of one data-parallel group's ``members`` (in group-rank order) split into
    ``instances``: each shard group is a run of len / instances consecutive members, each replica group
    the members at the same place in every shard group."""
    size = len(members) // instances
    shards = [members[i * size:(i + 1) * size] for i in range(instances)]
    return shards, [members[j::size] for j in range(size)]


@dataclass
class ParallelState:
    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    cp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    etp_size: int = 1
    groups: dict = field(default_factory=dict)   # name -> process group of this rank (None when size 1)
    timeout: timedelta | None = None              # of every group (new groups would get torch's 30 min)
    run: RealRun = REAL_RUN                       # peers present or absent, storage or none (parallel/dry_run.py)
    instances: int = 1                            # --num-distributed-optimizer-instances (module docstring)

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

    # ---- hybrid sharding (module docstring) ----
    @property
    def dp_cp_rank(self) -> int:
        """This rank's place in its data-parallel x context-parallel group (cp varies fastest)."""
        return self.cp_rank + self.cp_size * self.dp_rank

    @property
    def dp_shard_size(self) -> int:
        """Ranks the dense weights' ZeRO state is sharded over: DP x CP / instances."""
        return self.dp_size * self.cp_size // self.instances

    @property
    def dp_shard_rank(self) -> int:
        return self.dp_cp_rank % self.dp_shard_size

    @property
    def instance(self) -> int:
        """Which distributed-optimizer instance this rank belongs to (0 when there is one)."""
        return self.dp_cp_rank // self.dp_shard_size

    @property
    def edp_shard_size(self) -> int:
        return self.edp_size // self.instances

    @property
    def edp_shard_rank(self) -> int:
        return self.edp_rank % self.edp_shard_size

    # ---- the expert grid (module docstring) ----
    @property
    def stage_rank(self) -> int:
        """This rank's index among its pipeline stage's tp x cp x dp ranks."""
        return self.rank % (self.tp_size * self.cp_size * self.dp_size)

    @property
    def etp_rank(self) -> int:
        return self.stage_rank % self.etp_size

    @property
    def ep_rank(self) -> int:
        return (self.stage_rank // self.etp_size) % self.ep_size

    @property
    def edp_size(self) -> int:
        return self.tp_size * self.cp_size * self.dp_size // (self.etp_size * self.ep_size)

    @property
    def edp_rank(self) -> int:
        return self.stage_rank // (self.etp_size * self.ep_size)

    @property
    def is_logging_rank(self) -> bool:
        """Megatron prints the training line from the last rank. It holds the loss unless the schedule puts the
        last virtual stage elsewhere (zbv: pipeline rank 0); train/step.py's reported_loss brings it there.
        The run backend decides (a rank without peers logs itself)."""
        return self.run.is_logging_rank(self.rank, self.world_size)

    def group(self, name: str):
        return self.groups.get(name)

    @classmethod
    def build(cls, world_size: int, rank: int, tp: int = 1, cp: int = 1, pp: int = 1,
              timeout: timedelta | None = None, ep: int = 1, etp: int | None = None,
              experts: bool = False, run: RealRun = REAL_RUN, instances: int = 1,
              cp_a2a: int | None = None) -> "ParallelState":
        """Create every process group (collectively: all ranks must call this in the same order).
        ``etp`` None: the tensor-parallel size (Megatron's default). ``experts``: the model has MoE
        layers, so the expert grid's groups are created too. ``run``: the run backend.
        ``instances``: distributed-optimizer instances (hybrid sharding, module docstring). ``cp_a2a``: the
        all-to-all size of hierarchical context parallelism (``build_hierarchical_cp_groups``)."""
        etp = tp if etp is None else etp
        state = cls(world_size, rank, tp, cp, pp, ep, etp, timeout=timeout, run=run, instances=instances)
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
        state.build_hybrid_groups("dp_cp", rank_grid_groups(world_size, tp, cp, pp, "cd"))
        if cp_a2a is not None:
            state.build_hierarchical_cp_groups(cp_a2a)
        if experts:
            state.build_expert_groups()
        return state

    def build_expert_groups(self) -> None:
        """The expert grid's groups (module docstring): "ep", "etp", "edp", "ep_etp" (the ranks that split
        one layer's experts between them), "expert_mp" (ep x etp x pp: every distinct expert piece) and
        "stage" (tp x cp x dp: every token of one pipeline stage)."""
        stage = self.tp_size * self.cp_size * self.dp_size
        sizes = {"t": self.etp_size, "e": self.ep_size, "d": stage // (self.etp_size * self.ep_size),
                 "p": self.pp_size}
        for name, varying in {"ep": "e", "etp": "t", "edp": "d", "ep_etp": "te", "expert_mp": "tep",
                              "stage": "ted"}.items():
            for members in grid_groups(sizes, "tedp", varying):
                group = self.new_group(members)
                if self.rank in members:
                    self.groups[name] = group
        self.build_hybrid_groups("edp", grid_groups(sizes, "tedp", "d"))

    def build_hierarchical_cp_groups(self, a2a: int) -> None:
        """--hierarchical-context-parallel-sizes: each CP group cut into "cp_a2a" groups of ``a2a`` consecutive
        CP ranks (the all-to-all) and "cp_ring" groups of the CP ranks at the same place in each (the ring)."""
        for members in rank_grid_groups(self.world_size, self.tp_size, self.cp_size, self.pp_size, "c"):
            for kind, split in zip(("cp_a2a", "cp_ring"), hybrid_groups(members, self.cp_size // a2a)):
                for part in split:
                    group = self.new_group(part)
                    if self.rank in part:
                        self.groups[kind] = group

    def build_hybrid_groups(self, name: str, groups: list[list[int]]) -> None:
        """``{name}_shard`` and ``{name}_replica`` of each of ``groups`` (the data-parallel groups whose members
        are sorted in group-rank order) with more than one instance."""
        if self.instances == 1:
            return
        for members in groups:
            for kind, split in zip(("shard", "replica"), hybrid_groups(members, self.instances)):
                for part in split:
                    group = self.new_group(part)
                    if self.rank in part:
                        self.groups[f"{name}_{kind}"] = group
