"""What a run reports: Megatron's stdout line, its timers' block (observe/clocks.py times them), a JSON-lines
metrics file, wandb and tensorboard, for MoE models the auxiliary losses and expert load (MoEStats), and with
multi-token prediction its depths' losses (MTPLosses).

The stdout line keeps Megatron's field names and formats exactly, because people grep it.
"""
from __future__ import annotations

import json
import math
import os
from datetime import datetime

import torch

from megalite.config.schema import ModelConfig, TrainingConfig
from megalite.errors import UserError


# ---- the stdout line ----------------------------------------------------------------------------
def format_training_line(*, iteration: int, train_iters: int, consumed_samples: int, elapsed_ms: float,
                         learning_rate: float, global_batch_size: int, losses: dict[str, float],
                         loss_scale: float, grad_norm: float | None, skipped_iterations: int,
                         nan_iterations: int, tflops_per_gpu: float | None = None,
                         num_zeros: float | None = None, params_norm: float | None = None,
                         extra: dict[str, str] | None = None) -> str:
    """Megatron's line, field for field; megalite's own fields (``extra``: tokens/s, MFU, memory) follow it."""
    line = f" [{datetime.now():%Y-%m-%d %H:%M:%S}] iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    if tflops_per_gpu is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.1f} |"
    line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    for key, value in losses.items():
        line += f" {key}: {value:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if num_zeros is not None:                       # --log-num-zeros-in-grad
        line += f" num zeros: {num_zeros:.1f} |"
    if params_norm is not None:                     # --log-params-norm
        line += f" params norm: {params_norm:.3f} |"
    line += f" number of skipped iterations: {skipped_iterations:3d} |"
    line += f" number of nan iterations: {nan_iterations:3d} |"
    for key, value in (extra or {}).items():
        line += f" {key}: {value} |"
    return line


def format_validation_lines(prefix: str, losses: dict[str, float]) -> str:
    body = f" validation loss {prefix} |"
    for key, value in losses.items():
        body += f" {key} value: {value:.6E} | {key} PPL: {math.exp(min(20.0, value)):.6E} |"
    rule = "-" * (len(body) + 1)
    return f"{rule}\n{body}\n{rule}"


# ---- timers' block -----------------------------------------------------------------------------------
def format_timers(values: dict[str, float]) -> str:
    """Megatron's block of timer lines."""
    lines = ["times across ranks (ms):"]
    for name, ms in values.items():
        lines.append(f"    {name:.<60s}: {ms:.2f}")
    return "\n".join(lines)


# ---- metric sinks ----------------------------------------------------------------------------------
class MetricsSinks:
    """JSONL file, wandb and tensorboard; each enabled by its flags. Only the logging rank creates one."""

    def __init__(self, config: TrainingConfig, run_config: dict, log=print):
        self.jsonl = None
        self.wandb_run = None
        self.tensorboard = None
        self.metrics_path = metrics_path(config)
        self.validation_ppl = config.log_validation_ppl_to_tensorboard
        if self.metrics_path:
            os.makedirs(os.path.dirname(self.metrics_path) or ".", exist_ok=True)
            self.jsonl = open(self.metrics_path, "a", encoding="utf-8")
        if config.wandb_project:
            self.wandb_run = _start_wandb(config, run_config)
        if config.tensorboard_dir:
            self.tensorboard = _start_tensorboard(config.tensorboard_dir, log)

    def log(self, iteration: int, metrics: dict) -> None:
        if self.validation_ppl and "validation lm loss" in metrics:      # --log-validation-ppl-to-tensorboard
            metrics = {**metrics, "validation lm loss ppl": math.exp(min(20.0, metrics["validation lm loss"]))}
        if self.jsonl:
            self.jsonl.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
            self.jsonl.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=iteration)
        if self.tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, iteration)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


def metrics_path(config: TrainingConfig) -> str | None:
    """--metrics-file, else metrics.jsonl in the first of --save, --tensorboard-dir, --wandb-save-dir."""
    if config.metrics_file:
        return config.metrics_file
    for directory in (config.save, config.tensorboard_dir, config.wandb_save_dir):
        if directory:
            return os.path.join(directory, "metrics.jsonl")
    return None


def _start_wandb(config: TrainingConfig, run_config: dict):
    try:
        import wandb
    except ImportError:
        raise UserError("--wandb-project needs the wandb package: pip install wandb") from None
    save_dir = config.wandb_save_dir or os.path.join(config.save or ".", "wandb")
    os.makedirs(save_dir, exist_ok=True)
    return wandb.init(project=config.wandb_project, entity=config.wandb_entity, name=config.wandb_exp_name, dir=save_dir,
                      config=run_config)


def _start_tensorboard(directory: str, log):
    """A SummaryWriter, or None with one line when the tensorboard package is missing. As Megatron, the run
    goes on without it (the metrics still reach the JSONL file and wandb): Megatron's example scripts pass
    --tensorboard-dir, and a run is not worth stopping for its plots."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log(f" > warning: --tensorboard-dir {directory}: the tensorboard package is not installed, so no "
            "tensorboard logs are written (pip install tensorboard); the metrics still go to the JSONL file")
        return None
    return SummaryWriter(log_dir=directory)


# ---- MoE: auxiliary losses and expert load ---------------------------------------------------------
class MoEStats:
    """What the MoE layers add to the log: their auxiliary losses and, per layer, how evenly the tokens
    spread over the experts.

    Losses (Megatron's names): ``load_balancing_loss`` (``seq_load_balancing_loss`` with
    --moe-router-load-balancing-type seq_aux_loss) and ``z_loss``, each logged when its coefficient is set,
    in the units they are added to the objective in (the coefficient included). For each MoE layer: the
    mean over the log interval's steps, their micro-batches and the data-parallel ranks of the layer's
    loss of one micro-batch, that of whole sequences (the sum of the shares of the ranks splitting them:
    sequence and context parallel); then the mean over the model's MoE layers. Each router sums this
    rank's shares and its number of forwards until ``report`` reads them (``loss_sums``); per layer the sum of
    the shares over all ranks, divided by the forwards over all ranks and times the ranks splitting one
    sequence (``MoEContext.sequence_split``), is that mean. (A rank that holds whole sequences counts
    whole losses and its forwards alike: the same quotient.)

    Load, per MoE layer ``i`` (as in ``decoder.layers.{i}``): max / mean of the tokens per expert of the
    log iteration's step (``last_load``, over the layer's pipeline stage; 1 is perfect balance) and, with
    --moe-router-enable-expert-bias, the bias's max - min.

    Cost: the routers add up their loss shares on the device (no host synchronisation); at a log
    iteration one all-reduce over all ranks of a [MoE layers, 5] table, each rank writing its own layers'
    rows: loss shares from every rank, the load and bias (the same on all ranks of a pipeline stage) from
    the first rank of each stage. Every rank calls ``report`` at the same iterations."""

    def __init__(self, chunks: list, config: ModelConfig, parallel, device: torch.device):
        self.moe_layers = [n for n in range(1, config.num_layers + 1) if config.is_moe_layer(n)]
        if config.mtp_num_layers and config.is_moe_layer(config.num_layers):   # MTP layers: the last one's kind
            self.moe_layers += [config.num_layers + k + 1 for k in range(config.mtp_num_layers)]
        local = [layer.layer_number for chunk in chunks for layer in chunk.transformer_layers()
                 if layer.layer_number in self.moe_layers]
        self.routers = [router for chunk in chunks for router in chunk.moe_routers()]     # the same order
        self.rows = torch.tensor([self.moe_layers.index(n) for n in local], dtype=torch.long, device=device)
        self.sequence_split = chunks[0].moe.sequence_split
        self.first_of_stage = parallel.tp_rank == 0 and parallel.cp_rank == 0 and parallel.dp_rank == 0
        self.world_size = parallel.world_size
        self.device = device
        self.expert_bias = config.moe_router_enable_expert_bias
        self.loss_names = {}                 # column of the table -> the name it is logged under
        balancing = config.moe_router_load_balancing_type
        if balancing in ("aux_loss", "seq_aux_loss") and config.moe_aux_loss_coeff:
            self.loss_names[0] = "seq_load_balancing_loss" if balancing == "seq_aux_loss" else "load_balancing_loss"
        if config.moe_z_loss_coeff:
            self.loss_names[1] = "z_loss"

    @torch.no_grad()
    def report(self) -> tuple[dict[str, float], dict[str, float]]:
        """(the interval's losses, the per-layer load figures), on every rank; starts the next interval.
        Collective: every rank calls it at the same log iterations."""
        table = torch.zeros(len(self.moe_layers), 5, dtype=torch.float64, device=self.device)
        if self.routers:
            table[self.rows, :3] = torch.stack([r.loss_sums for r in self.routers]).to(table)
            for router in self.routers:
                router.loss_sums.zero_()
            if self.first_of_stage and self.routers[0].last_load is not None:
                loads = torch.stack([r.last_load for r in self.routers]).double()
                table[self.rows, 3] = loads.amax(1) / loads.mean(1).clamp_min(1e-30)
                if self.expert_bias:
                    bias = torch.stack([r.expert_bias for r in self.routers]).double()
                    table[self.rows, 4] = bias.amax(1) - bias.amin(1)
        if self.world_size > 1:
            torch.distributed.all_reduce(table)
        rows = table.tolist()                # the one host synchronisation
        losses = {}
        for column, name in self.loss_names.items():
            per_layer = [row[column] / row[2] * self.sequence_split for row in rows if row[2] > 0]
            losses[name] = sum(per_layer) / len(per_layer) if per_layer else 0.0
        loads = {}
        for number, row in zip(self.moe_layers, rows):
            loads[f"moe/layer{number - 1}/load_max_over_mean"] = row[3]
            if self.expert_bias:
                loads[f"moe/layer{number - 1}/expert_bias_range"] = row[4]
        return losses, loads


class MTPLosses:
    """Multi-token prediction's losses for the log, Megatron's ``mtp_{k} loss`` for depth k = 1..D: each the mean
    over the log interval's steps, their micro-batches and the data-parallel ranks of the depth's loss (the
    cross-entropy alone, before --mtp-loss-scaling-factor; per token under --calculate-per-token-loss, as the lm
    loss). The last stage's MTP module sums its losses on the device; at a log iteration one all-reduce over
    all ranks of [D + 1] numbers (the sums and the micro-batch count; every rank of a data-parallel replica that
    holds the MTP depths adds the same values, so the quotient is that mean). Every rank calls ``report`` at the
    same iterations."""

    def __init__(self, chunks: list, depth: int, world_size: int, device: torch.device):
        self.modules = [chunk.mtp for chunk in chunks if chunk.post_process and chunk.mtp is not None]
        self.depth, self.world_size, self.device = depth, world_size, device

    @torch.no_grad()
    def report(self) -> dict[str, float]:
        total = torch.zeros(self.depth + 1, dtype=torch.float64, device=self.device)
        for module in self.modules:
            sums = module.take_loss_sums()
            if sums is not None:
                total += sums
        if self.world_size > 1:
            torch.distributed.all_reduce(total)
        values = total.tolist()              # the one host synchronisation
        count = max(values[-1], 1.0)
        return {f"mtp_{k + 1} loss": values[k] / count for k in range(self.depth)}


def worst_load(loads: dict[str, float]) -> dict[str, str]:
    """The log line's summary of the per-layer figures: the largest max/mean tokens per expert and its layer."""
    spreads = {key.split("/")[1]: value for key, value in loads.items() if key.endswith("/load_max_over_mean")}
    if not spreads:
        return {}
    layer = max(spreads, key=spreads.get)
    return {"max/mean tokens per expert": f"{spreads[layer]:.3f} ({layer})"}
