"""Rank functions shared by the data-parallel tests: build a trainer from Megatron flags and train on
a synthetic global batch that is identical at every data-parallel size (the real sampler slices it)."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from megalite.train.command_line import parse_args
from megalite.data.samplers import MegatronPretrainingSampler
from megalite.train.trainer import build_trainer
from megalite.train.step import train_step
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

DP_ARGS = with_flags(TINY_LLAMA_ARGS, global_batch_size=16, micro_batch_size=2, weight_decay=0.1, clip_grad=1.0,
                     lr_warmup_iters=2, lr_decay_style="cosine", train_iters=10)
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class SyntheticTokens(Dataset):
    def __init__(self, n: int, seq: int = 32, vocab: int = 200, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        seq = self.x.shape[1] - 1
        return {"tokens": self.x[i, :-1], "labels": self.x[i, 1:], "loss_mask": torch.ones(seq),
                "position_ids": torch.arange(seq)}


def batches(trainer, steps: int):
    t = trainer.config.training
    sampler = MegatronPretrainingSampler(steps * t.global_batch_size, 0, t.micro_batch_size,
                                         trainer.parallel.dp_rank, trainer.parallel.dp_size)
    return iter(DataLoader(SyntheticTokens(steps * t.global_batch_size), batch_sampler=sampler))


def layout_flags(strategy: str, overlap: bool, bucket_size: int | None = 20000, **extra) -> list[str]:
    return with_flags(DP_ARGS, data_parallel_sharding_strategy=strategy, overlap_grad_reduce=overlap,
                      overlap_param_gather=overlap and strategy != "no_shard", ddp_bucket_size=bucket_size, **extra)


def train_losses(argv: list[str], world: int, steps: int = 10) -> dict:
    trainer = build_trainer(parse_args(argv, world_size=world))
    data = batches(trainer, steps)
    losses, norms = [], []
    for _ in range(steps):
        loss, result = train_step(trainer, data)
        losses.append(float(loss))
        norms.append(result.grad_norm)
    trainer.ddp.wait_for_param_gather()
    return {"losses": losses, "norms": norms, "trainer": trainer}


def train_layouts(rank: int, world: int, layouts: list[list[str]], steps: int = 10) -> list[dict]:
    """Each layout's losses and grad norms (rank function for run_ranks)."""
    out = []
    for argv in layouts:
        r = train_losses(argv, world, steps)
        out.append({"losses": r["losses"], "norms": r["norms"]})
    return out


# ---- everything a rank checks in one spawn ----------------------------------------------------------
def equivalence_and_eval(rank: int, world: int, layouts: list[list[str]], steps: int = 10) -> list[dict]:
    """Per layout: losses, grad norms, which steps updated, and the loss of the final model on a
    held-out batch (evaluated through the model's forward, so ZeRO-3 gathers and pending overlapped
    parameter all-gathers are exercised)."""
    from megalite.train.loop import evaluate
    out = []
    for argv in layouts:
        trainer = build_trainer(parse_args(argv, world_size=world))
        data = batches(trainer, steps + 1)
        losses, norms, updated = [], [], []
        for _ in range(steps):
            loss, result = train_step(trainer, data)
            losses.append(float(loss))
            norms.append(result.grad_norm)
            updated.append(result.update_successful)
        held_out = evaluate(trainer, data, 1)              # averaged over data-parallel ranks
        out.append({"losses": losses, "norms": norms, "updated": updated, "eval": held_out,
                    "master_dtype": str(trainer.optimizer.master.dtype),
                    "loss_scale": trainer.optimizer.loss_scale})
    return out


def memory_by_strategy(rank: int, world: int, precisions: list[str]) -> dict:
    """Measured bytes per strategy and precision at start-up (no step taken)."""
    from megalite.train.performance import measure
    out = {}
    for precision in precisions:
        for strategy in STRATEGIES:
            flags = {precision: True} if precision != "fp32" else {}
            trainer = build_trainer(parse_args(layout_flags(strategy, False, **flags), world_size=world))
            m = measure(trainer.ddp, trainer.optimizer)
            m["psi"] = trainer.buffer.numel_unpadded
            out[(precision, strategy)] = m
    return out


def collective_traffic(rank: int, world: int, strategies: list[str]) -> dict:
    """The collectives one training step issues on the data-parallel group: (op, bytes) per call, where
    bytes is the full tensor (all-reduce), the input (reduce-scatter) or the output (all-gather)."""
    import torch.distributed as dist
    calls = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter", "reduce_scatter_single",
                                                        "all_gather_single", "all_gather")}

    def recording(name):
        def wrapper(*args, **kwargs):
            if name == "all_reduce" or name == "all_gather_single":
                nbytes = args[0].numel() * args[0].element_size()
            elif name == "all_gather":                      # list of output chunks (gloo), input
                nbytes = sum(t.numel() * t.element_size() for t in args[0])
            elif name == "reduce_scatter":                  # output, list of input chunks
                nbytes = sum(t.numel() * t.element_size() for t in args[1])
            else:
                nbytes = args[1].numel() * args[1].element_size()
            kind = {"reduce_scatter_single": "reduce_scatter", "all_gather": "all_gather_single"}.get(name, name)
            calls.append((kind, nbytes, kwargs.get("group")))
            return originals[name](*args, **kwargs)
        return wrapper

    out = {}
    try:
        for name in originals:
            setattr(dist, name, recording(name))
        for strategy in strategies:
            trainer = build_trainer(parse_args(layout_flags(strategy, True), world_size=world))
            data = batches(trainer, 2)
            train_step(trainer, data)                    # warm-up step
            trainer.ddp.wait_for_param_gather()
            calls.clear()
            train_step(trainer, data)
            trainer.ddp.wait_for_param_gather()
            dp = trainer.ddp.group
            out[strategy] = {
                "calls": [(n, b) for n, b, g in calls if g is dp],
                "bucket_numels": [b.numel for b in trainer.buffer.buckets],
                "backward_gathered_numels": [b.numel for u in trainer.ddp.units if u.gather_in_backward
                                             for b in u.buckets],
                "psi": trainer.buffer.numel_unpadded, "numel": trainer.buffer.numel,
                "microbatches": trainer.config.num_microbatches}
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return out


def overlap_timeline(rank: int, world: int, layouts: list[tuple[str, bool]]) -> dict:
    """Order of events in one step: 'grad' when the word embedding's gradient lands (the last gradient
    of each backward pass), 'reduce' when a gradient collective starts."""
    import torch.distributed as dist
    originals = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter", "reduce_scatter_single")}
    out = {}
    try:
        for strategy, overlap in layouts:
            events = []
            trainer = build_trainer(parse_args(layout_flags(strategy, overlap), world_size=world))
            dp = trainer.ddp.group

            def recording(name):
                def wrapper(*args, **kwargs):
                    tensor = args[0] if name == "all_reduce" else args[1]
                    numel = sum(t.numel() for t in tensor) if isinstance(tensor, list) else tensor.numel()
                    if kwargs.get("group") is dp and numel > 16:
                        events.append("reduce")
                    return originals[name](*args, **kwargs)
                return wrapper

            for name in originals:
                setattr(dist, name, recording(name))
            embedding = trainer.model.embedding.word_embeddings.weight
            embedding.register_post_accumulate_grad_hook(lambda p: events.append("grad"))
            train_step(trainer, batches(trainer, 1))
            out[(strategy, overlap)] = {"events": events, "buckets": len(trainer.buffer.buckets),
                                        "microbatches": trainer.config.num_microbatches}
            for name, fn in originals.items():
                setattr(dist, name, fn)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return out


def zero3_gather_trace(rank: int, world: int, overlap: bool) -> dict:
    """ZeRO-3 on 4 layers: which layers' parameters are gathered when each layer's forward starts, and
    the parameter bytes held at start-up, after a step, and at the peak seen by the hooks."""
    argv = layout_flags("optim_grads_params", overlap, num_layers=4)
    trainer = build_trainer(parse_args(argv, world_size=world))
    ddp, buf = trainer.ddp, trainer.buffer
    layers = [u for u in ddp.units if u.name.startswith("layer")]
    trace, peak = [], [buf.param_bytes()]

    def record(i):
        def hook(module, args):
            trace.append((i, [j for j, u in enumerate(layers) if all(buf.is_gathered(b) for b in u.buckets)]))
            peak.append(buf.param_bytes())
        return hook

    for i, unit in enumerate(layers):
        unit.module.register_forward_pre_hook(record(i))      # runs after the DDP pre-hook (gather)
    start = buf.param_bytes()
    train_step(trainer, batches(trainer, 1))
    return {"trace": trace, "start": start, "after": buf.param_bytes(), "peak": max(peak),
            "full": buf.numel * buf.param_shard.element_size(), "shard": buf.param_shard.numel() * buf.param_shard.element_size()}
