"""--compile (megalite/train/compile.py): torch.compile per transformer layer trains equal to eager, through the
real training loop (pretrain), serially and with parallel layouts; layouts it cannot handle say so in one
line and run eager.

Compiling is slow on 2 cores: the default suite compiles one tiny layer serially and reuses it on 2 gloo
ranks with ZeRO-3 (the same layer graph, so inductor's on-disk cache serves the second compile); the
wider layout matrix is marked slow."""
import pytest
import torch

from harness import run_ranks
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.train.compile import compile_layers, compile_unsupported_reason
from megalite.train.trainer import build_trainer, pretrain

ARGV = with_flags(TINY_LLAMA_ARGS, train_iters=4, global_batch_size=4, lr_decay_style="constant", weight_decay=0.1,
                  clip_grad=1.0)


def losses_of(argv: list[str], world_size: int = 1, printed: list | None = None) -> list[float]:
    print_fn = printed.append if printed is not None else (lambda *_: None)
    return pretrain(parse_args(argv, world_size=world_size), print_fn=print_fn).history


def _rank_losses(rank: int, world: int, argv: list[str]) -> tuple[list[float], list[float]]:
    return losses_of(argv, world), losses_of(argv + ["--compile"], world)


def assert_equal_losses(compiled: list[float], eager: list[float]) -> None:
    assert len(compiled) == len(eager) > 0
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=1e-5)


def test_compiled_layers_train_equal_to_eager_serially():
    printed = []
    eager = losses_of(ARGV)
    compiled = losses_of(ARGV + ["--compile"], printed=printed)
    assert_equal_losses(compiled, eager)
    assert eager[-1] < eager[0]
    assert any("--compile: torch.compile per transformer layer (2 on this rank)" in line for line in printed)


def test_compiled_layers_keep_the_zero3_hooks():
    """ZeRO-3 gathers each layer in a forward pre-hook, frees it in a forward hook and reduces gradients
    from post-accumulate-grad hooks: all stay eager around the compiled forward."""
    argv = with_flags(ARGV, data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True,
                      overlap_param_gather=True)
    reference = losses_of(ARGV)
    for eager, compiled in run_ranks(2, _rank_losses, argv):
        assert_equal_losses(eager, reference)
        assert_equal_losses(compiled, reference)


def test_every_layer_shares_one_compiled_graph():
    """Layers differ only in their parameters (graph inputs): 4 layers, one graph, no recompiles."""
    from megalite.train.step import train_step
    from torch._dynamo.utils import counters
    argv = with_flags(ARGV, num_layers=4)
    trainer = build_trainer(parse_args(argv + ["--compile"], world_size=1), print_fn=lambda *_: None)
    assert all(getattr(layer, "compiled", False) for layer in trainer.model.decoder.layers)
    torch._dynamo.reset()
    counters.clear()
    batch = {"tokens": torch.randint(0, 200, (2, 32)), "labels": torch.randint(0, 200, (2, 32)),
             "loss_mask": torch.ones(2, 32), "position_ids": torch.arange(32).expand(2, 32)}
    train_step(trainer, iter([batch] * 4))
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"]


def test_a_layout_compile_cannot_handle_gets_one_line_and_runs_eager():
    argv = with_flags(ARGV, pipeline_model_parallel_size=2, pipeline_schedule="pipedream-2bw", global_batch_size=8)
    config = parse_args(argv + ["--compile"], world_size=2)
    reason = compile_unsupported_reason(config, torch.device("cpu"))
    assert reason is not None and "pipedream-2bw" in reason
    printed = []

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = torch.nn.Module()
            self.decoder.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    chunk = Chunk()
    assert compile_layers([chunk], config, torch.device("cpu"), printed.append) is False
    assert printed == [f" > --compile: {reason}; the layers run eager"]
    assert "forward" not in vars(chunk.decoder.layers[0])            # untouched: eager


def test_compile_is_off_by_default_and_the_flag_parses():
    assert parse_args(ARGV, world_size=1).training.compile is False
    assert parse_args(ARGV + ["--compile"], world_size=1).training.compile is True
    assert compile_unsupported_reason(parse_args(ARGV, world_size=1), torch.device("cpu")) is None


# ---- the layout matrix (slow: a compile per layout and rank) ---------------------------------------
SLOW_LAYOUTS = {
    "tp2-sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "dp2-zero1-overlap": dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True),
    "dp2-zero2": dict(data_parallel_sharding_strategy="optim_grads", overlap_grad_reduce=True),
    "pp2": dict(pipeline_model_parallel_size=2),
    "pp2-zb-h1": dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-h1"),
    "pp2-interleaved": dict(pipeline_model_parallel_size=2, num_layers=4, num_layers_per_virtual_pipeline_stage=1),
    "cp2": dict(context_parallel_size=2),
    "tp2-recompute-full": dict(tensor_model_parallel_size=2, recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=1),
    "dp2-recompute-selective": dict(recompute_granularity="selective"),
    "tp2-dropout": dict(tensor_model_parallel_size=2, hidden_dropout=0.1, attention_dropout=0.1),
    "dp2-bf16": dict(bf16=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(SLOW_LAYOUTS))
def test_compiled_layers_train_equal_to_eager_with_layout(layout):
    argv = with_flags(ARGV, **SLOW_LAYOUTS[layout])
    for eager, compiled in run_ranks(2, _rank_losses, argv):
        if eager:                                   # pipeline stages without the loss log none
            assert_equal_losses(compiled, eager)


@pytest.mark.slow
def test_compiled_layers_train_equal_to_eager_with_fsdp2():
    argv = with_flags(ARGV, use_torch_fsdp2=True)
    for eager, compiled in run_ranks(2, _rank_losses, argv):
        assert_equal_losses(compiled, eager)
