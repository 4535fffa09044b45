"""--decoupled-lr / --decoupled-min-lr: the input embedding and output layer train at their own
schedule."""

import pytest

from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags


def test_decoupled_lr_trains_the_embedding_and_output_layer_at_their_own_schedule():
    """Adam's first update moves every weight with a gradient by about its learning rate: the input
    embedding and the output layer by --decoupled-lr, everything else by --lr; the decoupled rate follows
    the same schedule between --decoupled-lr and --decoupled-min-lr."""
    from megalite.optim.lr_scheduler import LRScheduler
    from megalite.train.trainer import build_trainer
    from megalite.train.step import train_step
    from dp_workloads import batches
    argv = with_flags(TINY_LLAMA_ARGS, lr="1e-3", decoupled_lr="5e-3", weight_decay=0.0, clip_grad=0.0,
                      lr_decay_style="constant", lr_warmup_iters=0)
    trainer = build_trainer(parse_args(argv, world_size=1))
    model = trainer.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(trainer, batches(trainer, 1))
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters()}
    for name, step in moved.items():
        expected = 5e-3 if name in ("embedding.word_embeddings.weight", "output_layer.weight") else 1e-3
        assert step == pytest.approx(expected, rel=0.05), name
    cosine = parse_args(with_flags(TINY_LLAMA_ARGS, lr="1e-3", min_lr="1e-4", decoupled_lr="5e-3",
                                   decoupled_min_lr="5e-4", lr_decay_style="cosine", lr_warmup_iters=2,
                                   train_iters=10), world_size=1).optimizer
    schedule = LRScheduler(cosine, 10)
    for step in (0, 1, 2, 6, 10, 12):
        schedule.num_steps = step
        assert schedule.decoupled_lr == pytest.approx(schedule.lr_at(step, 5e-3, 5e-4))
    schedule.num_steps = 12
    assert schedule.decoupled_lr == pytest.approx(5e-4) and schedule.lr == pytest.approx(1e-4)
