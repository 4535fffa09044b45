"""tools/plan_parallelism.py --verify: the planner's memory estimate beside what a dry run measures.

For a layout, one rank of each distinct role runs pretrain_gpt.py's dry run (``dry_run_flags``, without
storage: the rank's own shards, its pipeline stage's schedule and one training step, all on the
meta device) and prints its step's peak by category. Ranks of one pipeline stage hold the same shapes
(their TP, CP, DP and EP positions differ only in which slice they hold), so a role is a pipeline
rank: the first stage, the last, one in the middle, and the first rank of every other kind of stage
(its layers per virtual stage, MoE layers, embedding or head).

The planner's categories map onto the dry run's: weights = parameters + gathered parameters
(ZeRO-3), gradients = gradients + gradient reduction buffers, optimizer state, and activations =
what forward keeps (every layer's, received inputs, the head's) + backward's temporaries. Both are
the fullest moment of a step; the dry run counts tensor storage as CUDA's allocated-bytes counter does.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, fields, replace

from megalite.config.fields import FLAG
from megalite.config.schema import ModelConfig
from megalite.parallel.dry_run import dry_run_flags
from megalite.planning.flags import pretrain_flags
from megalite.planning.inputs import (GPU_KERNELS, GiB, Layout, Workload, holds_embedding, holds_head, rank_layers,
                                      rank_moe_layers)
from megalite.planning.memory import Memory, rank_memory
from megalite.train.memory_account import parse_breakdowns

TOLERANCE = 0.10           # an estimate further than this from the measured peak is flagged
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the planner's category -> the dry run's (memory_account.CATEGORIES)
MEASURED = {"weights": ("parameters", "gathered parameters"), "grads": ("gradients", "gradient reduction"),
            "optimizer": ("optimizer state",), "activations": ("activations", "backward temporaries", "optimizer step")}
# fields the layout's own flags (pretrain_flags) set, or that a dry run does not need
NOT_MODEL_FLAGS = {"recompute_granularity", "recompute_method", "recompute_num_layers", "num_query_groups"}


@dataclass(frozen=True)
class Role:
    pp_rank: int
    rank: int             # the global rank that plays it: TP, CP and DP rank 0 of the stage
    name: str


def roles(workload: Workload, layout: Layout) -> list[Role]:
    """One rank of each distinct role (module docstring), in pipeline order."""
    kinds = {r: (tuple(rank_layers(workload, layout, r)), rank_moe_layers(workload, layout, r),
                 holds_embedding(layout, r), holds_head(layout, r)) for r in range(layout.pp)}
    chosen = {0, layout.pp // 2, layout.pp - 1} | {min(r for r in kinds if kinds[r] == k) for k in kinds.values()}
    stage = layout.num_gpus // layout.pp
    return [Role(r, r * stage, f"pipeline rank {r}: {describe_stage(*kinds[r])}") for r in sorted(chosen)]


def describe_stage(layers: tuple, moe: int, embedding: bool, head: bool) -> str:
    """"embedding + 7 layers", "8 layers in 2 chunks (8 MoE)", "7 layers + head" ..."""
    text = f"{sum(layers)} layers" + (f" in {len(layers)} chunks" if len(layers) > 1 else "")
    text += f" ({moe} MoE)" if moe else ""
    return ("embedding + " if embedding else "") + text + (" + head" if head else "")


def model_flags(workload: Workload) -> list[str]:
    """pretrain_gpt.py's model flags for the workload's model: every flag-set field away from its default."""
    model, flags, values = workload.model, [], vars(workload.model)
    for f in fields(ModelConfig):
        spec = f.metadata.get(FLAG)
        if spec is None or f.name in NOT_MODEL_FLAGS:
            continue
        value = values[f.name]
        if f.default is not None and value == f.default and f.name != "seq_length":
            continue
        if f.type == "bool":
            flags.append(spec.name)
        elif value is not None:
            flags += [spec.name, str(value).replace(" ", "")]
    if model.num_query_groups != model.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(model.num_query_groups)]
    return flags


def mock_data_flags(workload: Workload) -> list[str]:
    """Mock data from the NullTokenizer with the workload's vocabulary (its --vocab-size ids plus the
    end-of-document one), padded as the planner pads it."""
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(workload.model.vocab_size - 1),
            "--make-vocab-size-divisible-by", str(workload.make_vocab_size_divisible_by)]


def measuring_argv(workload: Workload, layout: Layout, role: Role) -> list[str]:
    """The command line of one role's dry run: the layout's flags on mock data, one step, no storage."""
    return [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *model_flags(workload),
            *pretrain_flags(workload, layout), *mock_data_flags(workload), "--train-iters", "1", "--lr", "1e-4",
            "--eval-iters", "0", "--num-workers", "0", *dry_run_flags(layout.num_gpus, role.rank)]


def measure(argv: list[str], rank: int, timeout: float = 1200) -> dict:
    """Run one dry run; its breakdown (memory_account.parse_breakdowns) of ``rank``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    found = parse_breakdowns(proc.stdout)
    if proc.returncode != 0 or rank not in found:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the dry run of rank {rank} failed: {tail}")
    return found[rank]


def measured_categories(breakdown: dict) -> dict[str, int]:
    """The dry run's bytes at its peak in the planner's categories, and the peak as "total"."""
    return {name: sum(breakdown[c] for c in parts) for name, parts in MEASURED.items()} | {"total": breakdown["peak"]}


def estimated_categories(memory: Memory) -> dict[str, float]:
    return {"weights": memory.weights, "grads": memory.grads, "optimizer": memory.optimizer,
            "activations": memory.activations, "total": memory.total}


@dataclass
class RoleCheck:
    role: Role
    estimate: dict[str, float]
    measured: dict[str, int]

    @property
    def error(self) -> float:
        """The estimate's relative error on the peak."""
        return self.estimate["total"] / self.measured["total"] - 1

    @property
    def off(self) -> bool:
        return abs(self.error) > TOLERANCE


def peak_microbatches(layout: Layout, num_microbatches: int) -> int:
    """Micro-batches a step needs to reach its full peak: a pipeline rank holds at most 2pv forward
    passes whose backward has not run (interleaved 1F1B's first stage: 2(p-1) + (v-1)p + 1; ZB-V 2p),
    so the steady state and its peak come by then and only repeat with more; GPipe holds every one. A
    whole number of pipeline rounds (interleaving needs it), and 2 at least (ZeRO-2/3 reduce once per
    micro-batch, and the second finds the first's buckets in flight)."""
    if layout.schedule == "gpipe":
        return num_microbatches
    enough = -(-2 * layout.pp * layout.vpp // layout.pp) * layout.pp
    return min(num_microbatches, max(enough, 2))


def verify(workload: Workload, layout: Layout, log=print) -> list[RoleCheck]:
    """Dry-run every role of ``layout`` and compare with the planner's estimate of its pipeline rank;
    both for a step of ``peak_microbatches``, which has the step's peak at less cost."""
    m = layout.num_microbatches(workload.global_batch_size)
    fewer = peak_microbatches(layout, m)
    if fewer < m:
        log(f"  (each a step of {fewer} micro-batches, not {m}: as many as reach the step's peak)")
    workload = replace(workload, global_batch_size=workload.global_batch_size // m * fewer)
    checks = []
    for role in roles(workload, layout):
        log(f"  dry run of rank {role.rank} of {layout.num_gpus}, {role.name} ...")
        measured = measured_categories(measure(measuring_argv(workload, layout, role), role.rank))
        estimate = estimated_categories(rank_memory(workload, layout, role.pp_rank, GPU_KERNELS))
        checks.append(RoleCheck(role, estimate, measured))
    return checks


def format_checks(checks: list[RoleCheck], usable_bytes: float) -> list[str]:
    """A table: per role and category the estimate and the measure (GiB), the error on the peak, and
    whether the measured peak fits ``usable_bytes``."""
    names = ("weights", "grads", "optimizer", "activations", "total")
    lines = [f"  {'rank':>6} {'role':40} " + " ".join(f"{n:>19}" for n in names) + f" {'error':>7}  fits",
             f"  {'':>6} {'':40} " + " ".join(f"{'plan / dry run GB':>19}" for _ in names)]
    for c in checks:
        cells = " ".join(f"{c.estimate[n] / GiB:9.2f}/{c.measured[n] / GiB:9.2f}" for n in names)
        flag = "  OFF by more than 10%" if c.off else ""
        fits = "yes" if c.measured["total"] <= usable_bytes else "NO"
        lines.append(f"  {c.role.rank:>6} {c.role.name[:40]:40} {cells} {100 * c.error:+6.1f}%  {fits:4}{flag}")
    return lines
