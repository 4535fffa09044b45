"""The dry run's one home: whether this rank's peers are present and whether its tensors have storage.

A dry run (``--fake-process-group``) plays one rank of a world of ``--fake-world-size`` ranks by itself:
torch's fake backend answers every collective at once and leaves its output as it was, so whatever the
rank computes from its absent peers' values means nothing, while its shapes, memory and time are those of
that rank in the real world. ``--no-storage`` adds tensors on the meta device: shapes and memory
accounting, no values. The planner's ``--verify`` measures layouts this way (``dry_run_flags``).

One backend is chosen once from the flags (``choose_run``, in initialize_distributed) and held by
ParallelState as ``run``; everything whose behaviour depends on absent peers or storage asks it rather
than testing a flag (tests/unit/test_dry_run.py keeps the flags' and the dry run's names out of every
other module but the flags' definitions in config/ and launch_env.py, which reads the world a dry run
plays before torch loads):

- the process group and the device (``start``, ``device``);
- the collectives' results a dry run stands in for: MoE token counts (``exchange_counts``,
  ``gather_counts``: the absent peers route as this rank does) and the ranks that share work such as
  the data builder's index caches (``cooperating_ranks``: alone, this rank builds them itself), and when
  a pipeline send is done (``send_completed``: at once);
- what is reported and by whom: the logging rank, the memory and parameter reports (own rank only);
- what the values mean: the NaN stop and the optimizer's non-finite / overflow refusal (``heeds``), the
  first step's memory accounting (``accounts_first_step``), the straggler detector (``compares_peers``);
- values read back from storage-less tensors (``value_reads``: zeros stand in);
- the device whose kernels the GEMMs pick (``kernel_device``): without storage, the real rank's, so an
  FP8 GEMM on meta tensors takes the real rank's path (``torch._scaled_mm`` or the emulation) and
  allocates what that path allocates.

The rule for the meta device: a kernel or op that tests ``tensor.device.type == "meta"`` asks about its
tensor (it has no values to compute on: attention returns shapes, the RNG tracker has no generator there,
a router's counts are a balanced router's, a meta parameter is materialised from ``init_values``; sharded
start-up builds meta parameters in real runs too), and may do so where it is. A decision about the run
(whether to report, to stop, to gather from peers, to stand in for values read back) asks this backend.
"""
from __future__ import annotations

import contextlib
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.parallel.launch_env import LaunchEnv, played_launch_env
from megalite.parallel.tensor.mappings import all_gather

T = TypeVar("T")


class RealRun:
    """Peers present, storage real: every question answered as a real run does."""

    def start(self, env: LaunchEnv | None) -> LaunchEnv | None:
        """The launch environment of this rank (None: read it from the launcher)."""
        return env

    def device(self, real: Callable[[], torch.device]) -> torch.device:
        """Where tensors live: ``real()``, the rank's GPU or the CPU."""
        return real()

    def kernel_device(self, device: torch.device) -> torch.device:
        """The device whose kernels the run's GEMMs pick (FP8's real or emulated path, precision/fp8.py):
        where its tensors live, ``device``."""
        return device

    def is_logging_rank(self, rank: int, world_size: int) -> bool:
        """Megatron prints the training line from the last rank."""
        return rank == world_size - 1

    def reports_here(self, rank: int) -> bool:
        """Whether this rank prints a report gathered from every rank: rank 0."""
        return rank == 0

    def per_rank(self, rank: int, own: Callable[[], T], everyone: Callable[[], list[T]]) -> dict[int, T]:
        """rank -> its value of a report: ``everyone()`` (collective: every rank calls it)."""
        return dict(enumerate(everyone()))

    def parameter_line(self, own_part: Callable[[], int], whole_model: Callable[[], int], batch: str) -> str:
        """The start-up line of the parameter count: the whole model's (``whole_model()``, collective)."""
        n = whole_model()
        return f" > number of parameters: {n} ({n / 1e6:.2f}M); {batch}"

    def cooperating_ranks(self) -> tuple[int, int, object]:
        """(rank, world size, torch.distributed or None) of the ranks that share work such as building an
        index cache once (rank 0) for the others to read: the started process group's, else (0, 1, None)."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size(), dist
        return 0, 1, None

    def exchange_counts(self, counts: torch.Tensor, group, rank_in_group: int) -> torch.Tensor:
        """[size, n] integer counts, row j for rank j -> [size, n], row j from rank j (no autograd)."""
        if group is None:
            return counts
        out = torch.empty_like(counts)
        dist.all_to_all_single(out, counts.contiguous(), group=group)
        return out

    def gather_counts(self, counts: torch.Tensor, group) -> torch.Tensor:
        """[n] counts of every rank of the group -> [size, n] (no autograd)."""
        if group is None:
            return counts[None]
        return all_gather(counts[None], group, dim=0)

    def send_completed(self, work) -> bool:
        """Whether a posted point-to-point send is done, so its tensor can be dropped: the work says."""
        return work.is_completed()

    def heeds(self, alarm: bool) -> bool:
        """Whether an alarm the values raise (a non-finite loss or gradient norm, an fp16 overflow) counts."""
        return alarm

    def accounts_first_step(self, asked: bool) -> bool:
        """Whether the first step runs under the memory account: when --log-memory-breakdown asks."""
        return asked

    def compares_peers(self, wanted: bool) -> bool:
        """Whether a feature that compares this rank with its peers (the straggler detector) runs: when wanted."""
        return wanted

    def value_reads(self) -> contextlib.AbstractContextManager:
        """The context the training loop runs in for values read back to the host: nothing changes."""
        return contextlib.nullcontext()


class DryRun(RealRun):
    """One rank of ``env``'s world without its peers; ``storage`` False: tensors on the meta device."""

    def __init__(self, env: LaunchEnv, storage: bool):
        self.env, self.storage = env, storage
        self.played: torch.device | None = None         # the rank's real device (``device``)

    def start(self, env: LaunchEnv | None) -> LaunchEnv:
        """torch's fake backend: every collective and point-to-point call returns at once and leaves its
        output as it was; groups are created as usual (no peers to meet). It serves meta tensors too."""
        if not dist.is_initialized():
            from torch.testing._internal.distributed.fake_pg import FakeStore   # registers the "fake" backend
            dist.init_process_group("cpu:fake,cuda:fake,meta:fake", store=FakeStore(), rank=self.env.rank,
                                    world_size=self.env.world_size)
        return self.env

    def device(self, real: Callable[[], torch.device]) -> torch.device:
        self.played = real()
        return self.played if self.storage else torch.device("meta")

    def kernel_device(self, device: torch.device) -> torch.device:
        """The device the rank plays, this machine's GPU or CPU, also without storage: a GEMM on meta
        tensors then takes the path (and makes the copies) the real rank's kernels would. On a machine
        without the GPU it plays, the CPU's path: a recipe the CPU emulates (blockwise) then counts the
        emulation's fp32 operands, which a GPU with the kernel does not make."""
        return self.played or device

    def is_logging_rank(self, rank: int, world_size: int) -> bool:
        """The one rank played logs."""
        return True

    def reports_here(self, rank: int) -> bool:
        return True

    def per_rank(self, rank: int, own: Callable[[], T], everyone: Callable[[], list[T]]) -> dict[int, T]:
        """This rank's own value alone: its peers do not exist."""
        return {rank: own()}

    def parameter_line(self, own_part: Callable[[], int], whole_model: Callable[[], int], batch: str) -> str:
        """This rank's model-parallel part: the whole model's count would need the other stages' counts."""
        n = own_part()
        return (f" > dry run as rank {self.env.rank} of {self.env.world_size} (--fake-process-group): {n} "
                f"parameters ({n / 1e6:.2f}M) in this rank's model-parallel part")

    def cooperating_ranks(self) -> tuple[int, int, object]:
        """This rank alone: the world's rank 0 does not exist, so it builds what rank 0 would."""
        return 0, 1, None

    def exchange_counts(self, counts: torch.Tensor, group, rank_in_group: int) -> torch.Tensor:
        """The absent peers send what this rank sends itself, as if they routed alike."""
        if group is None:
            return counts
        return counts[rank_in_group].expand_as(counts).clone()

    def gather_counts(self, counts: torch.Tensor, group) -> torch.Tensor:
        """Every absent peer's counts are this rank's."""
        if group is None:
            return counts[None]
        return counts[None].expand(dist.get_world_size(group), -1).clone()

    def send_completed(self, work) -> bool:
        """Always: the absent peer takes it at once. The fake backend's works never report completion, and
        holding every sent tensor to the end of the schedule would count memory no real run holds."""
        return True

    def heeds(self, alarm: bool) -> bool:
        """Never: the values are computed on what the absent peers never sent, and the step runs its whole
        course whatever they are, for the memory and time it takes."""
        return False

    def accounts_first_step(self, asked: bool) -> bool:
        """Always: measuring the step's memory is what a dry run is for."""
        return True

    def compares_peers(self, wanted: bool) -> bool:
        """Never: the peers do not exist."""
        return False

    def value_reads(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.storage else MetaStandIns()


class MetaStandIns(TorchDispatchMode):
    """Without storage: a value read back from a meta tensor (``.item()``, ``float()``, ``bool()``, a copy
    to the CPU) is zero, in place of the error the meta device raises. A dry run's values mean nothing
    (its peers never send theirs); zero keeps every check quiet (a zero loss and gradient norm are
    finite, no overflow is found) so the step runs its whole course."""

    def __torch_dispatch__(self, func, _types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return False if args[0].dtype == torch.bool else 0
        if (func is torch.ops.aten._to_copy.default and args[0].device.type == "meta"
                and kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "meta"):
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device=kwargs["device"])
        return func(*args, **kwargs)


REAL_RUN = RealRun()


def choose_run(parallel) -> RealRun:
    """The backend for ``parallel`` (a ParallelConfig): a DryRun under --fake-process-group, else the real
    run. Raises a one-line UserError for a played world that is not given or a rank outside it."""
    if not parallel.fake_process_group:
        return REAL_RUN
    return DryRun(played_launch_env(parallel.fake_world_size, parallel.fake_rank), storage=not parallel.no_storage)


def dry_run_flags(world_size: int, rank: int) -> list[str]:
    """The flags that make pretrain_gpt.py play ``rank`` of ``world_size`` without peers or storage."""
    return ["--fake-process-group", "--fake-world-size", str(world_size), "--fake-rank", str(rank), "--no-storage"]
