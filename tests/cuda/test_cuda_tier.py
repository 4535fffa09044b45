"""The GPU path on one GPU: bf16 training equals the CPU run, NCCL at world size 1 drives every
collective path (DDP, ZeRO-1/2/3, bf16 reductions, checkpoint save and load; a TP group of size 1
is no group and runs none), generation works, --compile equals eager, fp16 with loss scaling trains,
TF32 follows --no-tf32, a steady step synchronises with the host only for the gradient norm.

Every training run is pretrain_gpt.py in a subprocess, as a user starts it: plainly (no process
group), under torchrun with one process (NCCL, size-1 groups: the collectives really run), or with
CUDA hidden (the CPU reference)."""
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from harness import ROOT, logged_losses
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

pytestmark = pytest.mark.cuda

ARGV = with_flags(TINY_LLAMA_ARGS, train_iters=8, global_batch_size=8, lr_decay_style="constant", weight_decay=0.1,
                  clip_grad=1.0)
ENTRY = os.path.join(ROOT, "pretrain_gpt.py")


def pretrain(argv: list[str], torchrun: bool = False, cpu: bool = False, timeout: int = 600) -> str:
    """stdout of pretrain_gpt.py (asserting it succeeded); ``torchrun``: launched with one process;
    ``cpu``: CUDA hidden."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"] if torchrun \
        else [sys.executable]
    proc = subprocess.run(launcher + [ENTRY, *argv], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def losses(stdout: str) -> list[float]:
    by_iteration = logged_losses(stdout)
    assert sorted(by_iteration) == list(range(1, len(by_iteration) + 1)) and by_iteration
    return [by_iteration[i] for i in sorted(by_iteration)]


def assert_close(actual: list[float], expected: list[float], rtol: float) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected), start=1):
        assert a == pytest.approx(e, rel=rtol), f"iteration {i}: {a} vs {e} ({actual} vs {expected})"


def field(stdout: str, name: str) -> list[float]:
    """A numeric field of every training line, e.g. 'loss scale' or 'number of skipped iterations'."""
    return [float(v) for v in re.findall(rf"\| {name}:\s*([-+0-9.eE]+|nan|inf) \|", stdout)]


@pytest.fixture(scope="module")
def gpu_fp32():
    """The plain single-process GPU run (no process group): the reference of the collective paths."""
    return losses(pretrain(ARGV))


# ---- precision ---------------------------------------------------------------------------------------
def test_bf16_training_on_the_gpu_equals_the_cpu_run():
    argv = with_flags(ARGV, bf16=True)
    gpu, cpu = losses(pretrain(argv)), losses(pretrain(argv, cpu=True))
    assert_close(gpu, cpu, rtol=2e-2)                # bf16: 8 mantissa bits, different kernels
    assert gpu[-1] < gpu[0]


def test_fp32_training_on_the_gpu_equals_the_cpu_run(gpu_fp32):
    """TF32 is on by default (10-bit mantissa inputs): within a few 1e-3 of the CPU's full fp32;
    --no-tf32 within fp32 rounding."""
    cpu = losses(pretrain(ARGV, cpu=True))
    assert_close(gpu_fp32, cpu, rtol=5e-3)
    assert_close(losses(pretrain(ARGV + ["--no-tf32"])), cpu, rtol=1e-4)


def test_fp16_with_dynamic_loss_scaling_skips_overflows_and_trains():
    """An initial scale of 2^32 overflows fp16 gradients: those steps are skipped and the scale backs
    off until the gradients fit, then training proceeds."""
    argv = with_flags(ARGV, fp16=True, initial_loss_scale=2 ** 32, hysteresis=1, train_iters=16, lr=3e-3)
    out = pretrain(argv)
    values, scales, skipped = losses(out), field(out, "loss scale"), field(out, "number of skipped iterations")
    assert all(math.isfinite(v) for v in values)
    assert skipped[-1] > 0 and scales[-1] < 2 ** 32
    assert values[-1] < values[0]


def test_bf16_weight_gradients_accumulate_fused_into_fp32_main_grad_on_the_gpu():
    """Gradient-accumulation fusion for bf16 weights (tensor_parallel/layers.py): the matmul adds the weight
    gradient of bf16 operands straight into the fp32 main_grad; equal to the fp32 sum of bf16 gradients,
    and the whole bf16 run trains the same with fusion turned off."""
    from megalite.parallel.data.grad_buffer import ParamAndGradBuffer
    from megalite.parallel.tensor.layers import ColumnParallelLinear, TensorParallel
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    torch.manual_seed(0)
    fc = ColumnParallelLinear(64, 32, False, torch.bfloat16, TensorParallel()).to(device)
    torch.nn.init.normal_(fc.weight)
    buffer = ParamAndGradBuffer([("fc.weight", fc.weight)], device=device)
    assert buffer.fuse_weight_grads() == (1 if on_gpu else 0)
    xs = [torch.randn(16, 64, dtype=torch.bfloat16, device=device) for _ in range(4)]
    for x in xs:
        fc(x).float().sum().backward()
    assert fc.weight.grad is None
    expected = sum(torch.ones(16, 32, device=device).t().matmul(x.float()) for x in xs)
    torch.testing.assert_close(fc.weight.main_grad, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    argv = with_flags(ARGV, bf16=True)
    assert_close(losses(pretrain(argv)), losses(pretrain(argv + ["--no-gradient-accumulation-fusion"])), rtol=2e-2)


def test_tf32_is_on_by_default_and_off_with_no_tf32():
    from megalite.train.command_line import parse_args
    from megalite.train.trainer import build_trainer
    if not torch.cuda.is_available():
        pytest.skip("TF32 is a GPU setting")
    build_trainer(parse_args(ARGV, world_size=1), print_fn=lambda *_: None)
    assert torch.get_float32_matmul_precision() == "high"
    build_trainer(parse_args(ARGV + ["--no-tf32"], world_size=1), print_fn=lambda *_: None)
    assert torch.get_float32_matmul_precision() == "highest"


# ---- NCCL at world size 1: every collective path -----------------------------------------------------
COLLECTIVE_PATHS = {
    "ddp": [],
    "ddp-overlap": ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"],
    "zero1": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
              "--ddp-bucket-size", "20000"],
    "zero2": ["--data-parallel-sharding-strategy", "optim_grads", "--overlap-grad-reduce"],
    "zero3": ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce",
              "--overlap-param-gather"],
    # every run above also builds the TP, CP, PP, model-parallel and embedding groups (size 1) and runs the
    # tensor-parallel layers' collectives on them; these add the paths that take further collectives
    "recompute-full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "recompute-selective": ["--recompute-granularity", "selective"],
    "per-token-loss-and-norms": ["--calculate-per-token-loss", "--log-params-norm", "--log-num-zeros-in-grad"],
}


@pytest.mark.parametrize("path", sorted(COLLECTIVE_PATHS))
def test_nccl_world_size_one_equals_the_plain_run(gpu_fp32, path):
    out = pretrain(ARGV + COLLECTIVE_PATHS[path], torchrun=True)
    assert_close(losses(out), gpu_fp32, rtol=1e-5)


def test_nccl_bf16_gradient_reduction_trains_within_bf16_tolerance():
    argv = with_flags(ARGV, bf16=True)
    reference = losses(pretrain(argv, torchrun=True))
    reduced = losses(pretrain(argv + ["--grad-reduce-in-bf16", "--use-distributed-optimizer",
                                      "--overlap-grad-reduce"], torchrun=True))
    assert_close(reduced, reference, rtol=2e-2)


@pytest.mark.parametrize("layout", [[], ["--data-parallel-sharding-strategy", "optim_grads_params"]],
                         ids=["ddp", "zero3"])
def test_nccl_checkpoint_save_and_resume_equals_the_uninterrupted_run(tmp_path, gpu_fp32, layout):
    save = str(tmp_path / "ckpt")
    first = pretrain(with_flags(ARGV, train_iters=4, save=save, save_interval=4) + layout, torchrun=True)
    resumed = pretrain(with_flags(ARGV, load=save) + layout, torchrun=True)
    assert_close(losses(first), gpu_fp32[:4], rtol=1e-5)
    by_iteration = logged_losses(resumed)
    assert sorted(by_iteration) == list(range(5, 9))
    assert_close([by_iteration[i] for i in range(5, 9)], gpu_fp32[4:], rtol=1e-5)


def test_initial_values_drawn_on_the_gpu_are_the_cpu_values():
    """The counter-based initialisation runs on the parameter's device: the integer hash is exact on
    both; float64 log/cos may round a last bit differently, which float32 values must not show beyond."""
    from megalite.model.init import initial_values
    device = "cuda" if torch.cuda.is_available() else "cpu"
    param = torch.nn.Parameter(torch.empty(4096, 1024, device="meta"))
    for start, end in ((0, 1 << 22), ((1 << 22) - 5, 1 << 22)):
        gpu = initial_values(param, "decoder.layers.0.mlp.linear_fc1.weight", 0.02, 2, 1234, start, end, device)
        cpu = initial_values(param, "decoder.layers.0.mlp.linear_fc1.weight", 0.02, 2, 1234, start, end, "cpu")
        assert gpu.device.type == device
        torch.testing.assert_close(gpu.cpu(), cpu, rtol=2 ** -23, atol=0)


def test_async_save_from_pinned_memory_equals_the_synchronous_save(tmp_path):
    """--async-save on the GPU snapshots into reusable pinned host memory and writes from a thread: the
    same losses and byte-identical files as a synchronous save (metadata aside: the run's arguments)."""
    from test_async_save import tree_bytes
    argv = with_flags(ARGV, train_iters=4, save_interval=2) + ["--use-distributed-optimizer"]
    sync = pretrain(argv + ["--save", str(tmp_path / "sync")], torchrun=True)
    background = pretrain(argv + ["--save", str(tmp_path / "async"), "--async-save"], torchrun=True)
    assert losses(background) == losses(sync) and "in the background (training stalled" in background
    for name in ("iter_0000002", "iter_0000004"):
        assert tree_bytes(str(tmp_path / "async" / name)) == tree_bytes(str(tmp_path / "sync" / name))


def test_a_steady_step_on_the_gpu_synchronises_only_for_the_gradient_norm():
    """The steps that neither log nor agree on an exit make one synchronising CUDA call each, as the
    device itself reports them (set_sync_debug_mode): the gradient norm's read; fp16 adds the overflow
    flag's."""
    from test_host_syncs import ARGS, CudaSyncs, assert_reads, steady_reads
    if not torch.cuda.is_available():
        pytest.skip("CUDA's sync debug mode needs a GPU")
    assert_reads(steady_reads(0, 1, ARGS + ["--bf16"], CudaSyncs), 1)
    assert_reads(steady_reads(0, 1, ARGS + ["--fp16", "--initial-loss-scale", "1024"], CudaSyncs), 2)


# ---- --compile -------------------------------------------------------------------------------------
def test_compiled_layers_equal_eager_on_the_gpu():
    fp32 = with_flags(ARGV, no_tf32=True)
    assert_close(losses(pretrain(fp32 + ["--compile"])), losses(pretrain(fp32)), rtol=1e-4)
    bf16 = with_flags(ARGV, bf16=True)
    out = pretrain(bf16 + ["--compile"], torchrun=True)
    assert "--compile: torch.compile per transformer layer" in out
    assert_close(losses(out), losses(pretrain(bf16, torchrun=True)), rtol=2e-2)


# ---- generation ------------------------------------------------------------------------------------
def test_generation_on_the_gpu(tmp_path):
    """Greedy decoding with the KV cache equals decoding without it and the CPU's; seeded sampling
    repeats; tools/generate.py runs with --device cuda."""
    from megalite.model.generation import generate
    from test_generate import TOOL, save_null_tokenizer_checkpoint, tiny_model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu_model = tiny_model("llama", seed=6)
    model = tiny_model("llama", seed=6).to(device)
    prompt = [10, 20, 30]
    greedy = generate(model, prompt, 12, greedy=True)
    assert greedy == generate(model, prompt, 12, greedy=True, use_cache=False)
    assert greedy == generate(cpu_model, prompt, 12, greedy=True)
    sampled = generate(model, prompt, 12, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    assert sampled == generate(model, prompt, 12, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    assert len(generate(tiny_model("llama", seed=6).to(device, torch.bfloat16), prompt, 12, greedy=True)) == 12

    root = str(tmp_path / "ckpt")
    save_null_tokenizer_checkpoint(cpu_model, root)
    result = subprocess.run([sys.executable, TOOL, "--load", root, "--prompt", "10 20 30", "--max-new-tokens", "12",
                             "--greedy", "--device", device.type], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "10 20 30 " + " ".join(map(str, greedy))
