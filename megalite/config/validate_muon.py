"""The rules of --optimizer muon: the layouts it runs on and the precision it needs, one line each.

Muon orthogonalises whole matrices, so each rank that updates a matrix must hold all of it. It runs
serially, with replicated data parallelism, with ZeRO-1/2/3 and hybrid sharding in the whole-parameter
layout (megatron_cli.py selects --use-layer-wise-distributed-optimizer with --optimizer muon, as Megatron
does: each rank owns whole parameters, balanced by Newton-Schulz FLOPs; ZeRO-3 gathers them per unit with
one broadcast per owner), under --use-torch-fsdp2 (whose row shards are sent to an owner rank per matrix
and back, optim/muon_redistribute.py), under pipeline parallelism, under tensor parallelism by gathering
each sharded matrix (--muon-tp-mode duplicated) or by summing its small Gram matrices over TP
(distributed; blockwise instead orthogonalises each TP rank's part on its own, which changes the result
with TP), and under expert parallelism, where each rank holds whole experts (split over expert tensor
parallelism as a sharded matrix over TP). The equal-slice ZeRO layout cuts matrices mid-row and is refused.
"""
from __future__ import annotations

from megalite.config.schema import MegaliteConfig
from megalite.errors import UserError


def check_muon(config: MegaliteConfig) -> None:
    o, p = config.optimizer, config.parallel
    if o.optimizer != "muon":
        return
    if o.fp16 and o.loss_scale == 1.0:
        raise UserError("--optimizer muon with --fp16 needs loss scaling, which --loss-scale 1 turns off: drop "
                        "--loss-scale (dynamic scaling), give a larger one, or use --bf16")
    whole = p.use_layer_wise_distributed_optimizer or p.use_torch_fsdp2
    if p.data_parallel_sharding_strategy != "no_shard" and not whole:
        raise UserError("--optimizer muon needs whole matrices on each ZeRO rank: add "
                        "--use-layer-wise-distributed-optimizer (or use --use-torch-fsdp2)")
