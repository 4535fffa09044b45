"""The search: every layout of the GPUs that megalite accepts, evaluated, the fastest that fit first."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator

from megalite.config import validate as rules
from megalite.config.validate_muon import check_muon
from megalite.config.schema import (ASYNC_SCHEDULES, SHARDING_STRATEGIES, DataConfig, MegaliteConfig, OptimizerConfig,
                                    TrainingConfig)
from megalite.errors import UserError
from megalite.config.pipeline_split import SplitFlags, virtual_stage_layers
from megalite.planning.flags import parallel_config
from megalite.planning.inputs import GiB, GPU_KERNELS, Hardware, Kernels, Layout, Workload, split_name, stage_layers
from megalite.planning.memory import Memory, estimate_memory, state_memory
from megalite.planning.time import StepTime, step_time

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool

    def mfu(self, workload: Workload, hardware: Hardware) -> float:
        return self.time.model_flops / (hardware.num_gpus * hardware.peak_flops(workload.precision) * self.time.total)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layout_problem(workload: Workload, layout: Layout, gpus_per_node: int) -> str | None:
    """Why this layout cannot run, or None: it would span nodes with TP, it lies outside the search space
    (schedules and their chunks per rank, sharding at data-parallel size 1), or megalite's own rules
    (config/validate.py) refuse the run pretrain_gpt.py would get for it."""
    if layout.tp > gpus_per_node:
        return f"TP {layout.tp} would span nodes ({gpus_per_node} GPUs per node)"
    if layout.expert_tp > gpus_per_node:
        return f"ETP {layout.expert_tp} would span nodes ({gpus_per_node} GPUs per node)"
    if layout.schedule == "zbv" and layout.vpp != 2:
        return "--pipeline-schedule zbv places exactly two model chunks per pipeline rank"
    if layout.schedule not in ("1f1b", "zbv") and layout.vpp > 1:
        return f"--pipeline-schedule {layout.schedule} runs one model chunk per pipeline rank"
    if layout.schedule in ASYNC_SCHEDULES and layout.pp == 1:
        return f"--pipeline-schedule {layout.schedule} needs --pipeline-model-parallel-size > 1"
    if layout.shards == 1 and layout.sharding != "no_shard":
        return f"--data-parallel-sharding-strategy {layout.sharding} shards nothing at data-parallel size 1"
    try:
        config = candidate_config(workload, layout)
        rules.check_layout(config)
        rules.check_async_schedule(config)
        check_muon(config)
        stage_layers(layout, workload.model.num_layers)
    except UserError as error:
        return str(error)
    return None


def candidate_config(workload: Workload, layout: Layout) -> MegaliteConfig:
    """The typed config of the run pretrain_gpt.py would get for ``layout`` (what its rules read)."""
    recompute = None if layout.recompute == "none" else layout.recompute
    overlap = layout.overlap_param_gather and layout.sharding != "no_shard" and layout.shards > 1
    return MegaliteConfig(
        model=dataclasses.replace(workload.model, recompute_granularity=recompute,   # padded as pretrain_gpt.py pads
                                  padded_vocab_size=workload.padded_vocab(layout.tp)),
        parallel=dataclasses.replace(parallel_config(workload, layout), overlap_param_gather=overlap),
        optimizer=OptimizerConfig(**{**dataclasses.asdict(workload.muon), "lr": 1e-4, "optimizer": workload.optimizer}),
        data=DataConfig(),
        training=TrainingConfig(micro_batch_size=layout.micro_batch_size,
                                global_batch_size=workload.global_batch_size, train_iters=1))


def pin(flag: str):
    """A Pins field: unpinned (None) by default, named by its pretrain_gpt.py flag."""
    return field(default=None, metadata={"flag": flag})


@dataclass(frozen=True)
class Pins:
    """Layout choices fixed by the user; None leaves a dimension to the search."""
    tp: int | None = pin("--tensor-model-parallel-size")
    pp: int | None = pin("--pipeline-model-parallel-size")
    layers_per_virtual_stage: int | None = pin("--num-layers-per-virtual-pipeline-stage")
    micro_batch_size: int | None = pin("--micro-batch-size")
    recompute: str | None = pin("--recompute-granularity")
    sharding: str | None = pin("--data-parallel-sharding-strategy")
    cp: int | None = pin("--context-parallel-size")
    schedule: str | None = pin("--pipeline-schedule")
    virtual_stages: int | None = pin("--num-virtual-stages-per-pipeline-rank")
    split: SplitFlags | None = None             # first/last counts, account-for flags or a layout string
    ep: int | None = pin("--expert-model-parallel-size")
    etp: int | None = pin("--expert-tensor-parallel-size")
    instances: int | None = pin("--num-distributed-optimizer-instances")

    def allow(self, layout: Layout, num_layers: int) -> bool:
        extra = int(layout.split.account_for_embedding) + int(layout.split.account_for_loss)
        vpp_layers = (num_layers + extra) // (layout.pp * layout.vpp) if layout.vpp > 1 else None
        return all(pin is None or pin == value for pin, value in (
            (self.tp, layout.tp), (self.pp, layout.pp), (self.layers_per_virtual_stage, vpp_layers),
            (self.micro_batch_size, layout.micro_batch_size), (self.recompute, layout.recompute),
            (self.sharding, layout.sharding), (self.cp, layout.cp), (self.schedule, layout.schedule),
            (self.virtual_stages, layout.vpp), (self.split, layout.split), (self.ep, layout.ep),
            (self.etp, layout.expert_tp), (self.instances, layout.instances)))

    def describe(self) -> str:
        values = dataclasses.asdict(self)
        pinned = [f"{f.metadata['flag']} {values[f.name]}" for f in dataclasses.fields(self)
                  if "flag" in f.metadata and values[f.name] is not None]
        return " ".join(pinned + ([f"split {split_name(self.split)}"] if self.split is not None else []))


def candidate_splits(num_layers: int, pp: int) -> list[tuple[SplitFlags, list[int]]]:
    """(split, virtual-stage counts it allows) for pipeline size ``pp``: even when pp divides the layers;
    the embedding and the loss counted as layers when pp divides L + 2 (NVIDIA's Llama-3.1 405B recipe);
    otherwise the first and last stages take the remainder of an even split of the middle stages."""
    if pp == 1:
        return [(SplitFlags(), [1])]
    splits = []
    if num_layers % pp == 0:
        splits.append((SplitFlags(), divisors(num_layers // pp)))
    both = SplitFlags(account_for_embedding=True, account_for_loss=True)
    if (num_layers + 2) % pp == 0 and num_layers + 2 > pp:
        splits.append((both, divisors((num_layers + 2) // pp)))
    if num_layers % pp and pp > 2:
        middle = num_layers // pp + 1
        rest = num_layers - (pp - 2) * middle
        if rest >= 2:
            first, last = rest // 2, rest - rest // 2
            splits.append((SplitFlags(first=first, last=last), [v for v in divisors(middle) if first % v == last % v == 0]))
    elif num_layers % pp and num_layers > 1:
        splits.append((SplitFlags(first=num_layers // 2), [1]))
    return splits


def expert_grids(workload: Workload, stage_ranks: int, tp: int, pins: Pins) -> list[tuple[int, int | None]]:
    """(EP, ETP, None meaning TP) of an MoE model's experts over a pipeline stage's ``stage_ranks`` ranks:
    EP dividing the experts, ETP the experts' hidden size, ETP x EP the stage's ranks (config/validate.py
    checks each again); ETP 1 or TP unless pinned (Megatron's usual choices: whole experts per rank, or
    experts split like the dense MLP). A dense model: (1, None)."""
    model = workload.model
    if not model.num_experts:
        return [(1, None)]
    etps = [pins.etp] if pins.etp is not None else sorted({1, tp})
    grids = []
    for ep in divisors(model.num_experts):
        for etp in etps:
            if stage_ranks % (ep * etp) == 0 and model.expert_ffn_hidden_size % etp == 0:
                grids.append((ep, None if etp == tp else etp))
    return grids


def instance_counts(tp: int, shards: int, sharding: str, pins: Pins, gpus_per_node: int) -> list[int]:
    """Distributed-optimizer instances to try (hybrid sharding): the pinned count; else 1 and, for a sharded
    layout whose tp x DP x CP ranks span nodes, the fewest instances whose shard group fits in one node
    (ZeRO's reduce-scatters and all-gathers then stay on NVLink; only the all-reduce of each 1/(DP/K)
    gradient shard crosses nodes, for K times the optimizer state of K = 1)."""
    if pins.instances is not None:
        return [pins.instances]
    if sharding == "no_shard" or tp * shards <= gpus_per_node:
        return [1]
    within_node = [k for k in divisors(shards) if k > 1 and tp * shards // k <= gpus_per_node]
    return [1] + within_node[:1]


def layouts_of(workload: Workload, num_gpus: int, pins: Pins = Pins(), gpus_per_node: int = 8) -> Iterator[Layout]:
    """Every TP x CP x PP x DP split of ``num_gpus`` (CP as pinned, else 1), every split of the layers
    (``candidate_splits``, or the pinned one) with every virtual-stage count it allows, micro-batch size
    dividing GBS/DP, recomputation and sharding, an MoE model's expert grids (``expert_grids``), the
    distributed-optimizer instances of ``instance_counts``; sequence parallel on; the pinned schedule,
    else 1F1B."""
    layers, gbs = workload.model.num_layers, workload.global_batch_size
    cp = pins.cp or 1
    schedule = pins.schedule or "1f1b"
    for tp in divisors(num_gpus):
        if (num_gpus // tp) % cp or pins.tp not in (None, tp):
            continue
        for pp in divisors(num_gpus // (tp * cp)):
            if pins.pp not in (None, pp):        # (a pinned split is for the pinned pipeline size only)
                continue
            dp = num_gpus // (tp * cp * pp)
            if pins.split is not None:
                splits = [(pins.split, [len(virtual_stage_layers(layers, pp, pins.split)) // pp] if pins.split.layout
                           else [pins.virtual_stages or 1])]
            else:
                splits = candidate_splits(layers, pp)
            if schedule == "zbv":
                splits = [(split, [2]) for split, _ in splits]
            elif schedule != "1f1b":
                splits = [(split, [1]) for split, _ in splits]
            micro_batch_sizes = divisors(gbs // dp) if gbs % dp == 0 else [1]
            grids = expert_grids(workload, tp * cp * dp, tp, pins)
            for split, vpps in splits:
                for vpp in vpps:
                    for mbs in micro_batch_sizes:
                        for recompute in RECOMPUTE:
                            for sharding in SHARDING_STRATEGIES:
                                for ep, etp in grids:
                                    for k in instance_counts(tp, dp * cp, sharding, pins, gpus_per_node):
                                        yield Layout(tp, pp, dp, vpp, mbs, recompute, sharding, cp=cp,
                                                     schedule=schedule, split=split, ep=ep, etp=etp,
                                                     overlap_param_gather=schedule not in ASYNC_SCHEDULES
                                                     or sharding == "no_shard" or dp * cp == 1, instances=k)


def candidate_layouts(workload: Workload, hardware: Hardware, pins: Pins = Pins()) -> list[Layout]:
    """The layouts megalite accepts on ``hardware``, within ``pins``; a one-line UserError naming
    why when there is none."""
    try:
        pinned = [lay for lay in layouts_of(workload, hardware.num_gpus, pins, hardware.gpus_per_node)
                  if pins.allow(lay, workload.model.num_layers)]
    except UserError as error:              # a pinned split that does not fit the model
        raise UserError(f"no layout of {hardware.num_gpus} GPUs suits this model: {error}") from None
    if not pinned:
        raise UserError(f"no layout of {hardware.num_gpus} GPUs has {pins.describe()}: the TP x PP sizes must divide "
                        "the number of GPUs and the virtual stages a stage's layers")
    problems = [(lay, layout_problem(workload, lay, hardware.gpus_per_node)) for lay in pinned]
    valid = [lay for lay, problem in problems if problem is None]
    if not valid:
        reasons = sorted({problem for _, problem in problems})
        more = f" (and {len(reasons) - 1} more reasons)" if len(reasons) > 1 else ""
        raise UserError(f"no layout of {hardware.num_gpus} GPUs suits this model and batch"
                        + (f" with {pins.describe()}" if pins.describe() else "") + f": {reasons[0]}{more}")
    return valid


def evaluate(workload: Workload, layout: Layout, hardware: Hardware, kernels: Kernels = GPU_KERNELS) -> Estimate:
    memory = estimate_memory(workload, layout, kernels)
    return Estimate(layout, memory, step_time(workload, layout, hardware), memory.total <= hardware.usable_bytes)


def plan(workload: Workload, hardware: Hardware, pins: Pins = Pins(), top: int = 5,
         kernels: Kernels = GPU_KERNELS) -> list[Estimate]:
    """The ``top`` fastest layouts that fit, fastest first; a one-line UserError when none does. Layouts
    whose state alone (``memory.state_memory``, a lower bound) exceeds the device are not estimated further
    unless none fits."""
    layouts = candidate_layouts(workload, hardware, pins)
    maybe = [lay for lay in layouts if state_memory(workload, lay) <= hardware.usable_bytes]
    estimates = [evaluate(workload, layout, hardware, kernels) for layout in maybe]
    feasible = sorted((e for e in estimates if e.fits), key=lambda e: (e.time.total, e.memory.total))
    if not feasible:
        estimates = [evaluate(workload, layout, hardware, kernels) for layout in layouts]
        raise UserError(nothing_fits_message(min(estimates, key=lambda e: e.memory.total), hardware))
    return feasible[:top]


def nothing_fits_message(smallest: Estimate, hardware: Hardware) -> str:
    mem = smallest.memory
    state = mem.weights + mem.grads + mem.optimizer
    if state > hardware.usable_bytes:
        advice = (f"the weights, gradients and optimizer state alone take {state / GiB:.1f} GB: add GPUs (the state "
                  "divides over TP x PP, MoE experts over EP x ETP too, and over DP with ZeRO) or use GPUs with "
                  "more memory")
    else:
        advice = (f"{mem.activations / GiB:.1f} GB of it are activations: shorten --seq-length, add GPUs or use GPUs "
                  "with more memory")
    return (f"no layout fits {hardware.num_gpus} x {hardware.gpu_memory_gb:g} GB: the smallest needs "
            f"{mem.total / GiB:.1f} GB per device ({smallest.layout.describe()}) of {hardware.usable_bytes / GiB:.1f} "
            f"GB usable; {advice}")

