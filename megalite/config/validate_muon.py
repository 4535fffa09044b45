"""The rules of --optimizer muon: the layouts it runs on and the precision it needs, one line each.

Muon orthogonalises whole matrices, so each rank that updates a matrix must hold all of it: serially,
with replicated data parallelism, with ZeRO-1/2/3 and hybrid sharding in the whole-parameter layout
(megatron_cli.py selects --use-layer-wise-distributed-optimizer with --optimizer muon, as Megatron does:
each rank owns whole parameters, balanced by Newton-Schulz FLOPs; ZeRO-3 gathers them per unit with one
broadcast per owner), under pipeline parallelism, under tensor parallelism by gathering each sharded
matrix (--muon-tp-mode duplicated), and under expert parallelism, where each rank holds whole experts
(gathered over expert tensor parallelism, as over TP).
"""
from __future__ import annotations

from megalite.config.schema import MegaliteConfig
from megalite.errors import UserError

WORKING_LAYOUTS = ("it runs serially, with data parallelism (no_shard, or ZeRO-1/2/3 via --use-distributed-optimizer / "
                   "--data-parallel-sharding-strategy optim|optim_grads|optim_grads_params, also with "
                   "--num-distributed-optimizer-instances), tensor, pipeline, expert and expert tensor parallelism")


def check_muon(config: MegaliteConfig) -> None:
    o, p = config.optimizer, config.parallel
    if o.optimizer != "muon":
        return
    if o.fp16 and o.loss_scale == 1.0:
        raise UserError("--optimizer muon with --fp16 needs loss scaling, which --loss-scale 1 turns off: drop "
                        "--loss-scale (dynamic scaling), give a larger one, or use --bf16")
    if p.use_torch_fsdp2:
        raise UserError(f"--optimizer muon does not run under --use-torch-fsdp2, whose shards cut matrices; {WORKING_LAYOUTS}")
    if p.data_parallel_sharding_strategy != "no_shard" and not p.use_layer_wise_distributed_optimizer:
        raise UserError("--optimizer muon needs whole matrices on each ZeRO rank: add "
                        "--use-layer-wise-distributed-optimizer")
