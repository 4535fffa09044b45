"""Several GPUs: every parallel layout (TP / PP / DP / CP and their products) over NCCL at world sizes
2, 4 and 8 trains like the single-GPU run of the same flags: the same `lm loss` and `grad norm` at
every iteration. Each world size runs only where that many GPUs are visible (skipped otherwise).

Every run is pretrain_gpt.py as a user launches it: under torchrun
(`python -m torch.distributed.run --standalone --nproc_per_node N pretrain_gpt.py ...`), or, for one
GPU per task as SLURM's --gpus-per-task=1 gives, as N processes each seeing one GPU.

With MEGALITE_CUDA_TIER_ON_CPU=1 and no GPU the ranks are CPU processes over gloo: world sizes up to
CPU_MAX_WORLD run (a check of this file's launches and comparisons), larger ones are skipped."""
import os
import subprocess
import sys
import time

import pytest
import torch

from harness import free_port, run_pretrain
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from test_cuda_tier import ENTRY, assert_close, field, losses, pretrain

pytestmark = pytest.mark.cuda

ON_CPU = os.environ.get("MEGALITE_CUDA_TIER_ON_CPU") == "1" and not torch.cuda.is_available()
CPU_MAX_WORLD = 4            # keeps the CPU check to a few minutes on 2 cores (8 ranks would share them)

# 8 layers: PP=4 zbv places 2 chunks per rank (8 virtual stages of 1 layer); PP=2 interleaved takes 2 layers
# per virtual stage. 4 heads / 2 query groups split over TP=2; seq 32 splits into 2 x CP x TP chunks
# (CP=2 with sequence-parallel TP=2: 8). 16 micro-batches of 1: at DP=2, 8 per pipeline, a multiple of
# PP=2 and PP=4 as the interleaved and zbv schedules need.
# --no-tf32: full fp32 matmuls, so the layouts differ from the single GPU by fp32 rounding only (as in
# test_cuda_tier's fp32 GPU-vs-CPU check); TF32's 10-bit inputs would need a tolerance that hides bugs.
ARGV = with_flags(TINY_LLAMA_ARGS, num_layers=8, micro_batch_size=1, global_batch_size=16, train_iters=8,
                  lr_decay_style="constant", weight_decay=0.1, clip_grad=1.0, no_tf32=True)
FP32_RTOL = 1e-4             # fp32 rounding of different reduction orders, grown over 8 Adam steps
BF16_RTOL = 2e-2             # bf16: 8 mantissa bits (test_cuda_tier's bf16 tolerance)
GRAD_NORM_ATOL = 2e-3        # the training line prints the grad norm with 3 decimals

TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
PP4 = ["--pipeline-model-parallel-size", "4"]
CP2 = ["--context-parallel-size", "2"]
INTERLEAVED = ["--num-layers-per-virtual-pipeline-stage", "2"]
ZERO1 = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
         "--ddp-bucket-size", "20000"]                   # small buckets: several overlapped reductions per step
ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce",
         "--overlap-param-gather"]

# (world size, flags); data parallelism is what the world size leaves after TP x PP x CP
LAYOUTS = [
    pytest.param(2, TP2, id="w2-tp2-sp"),
    pytest.param(2, PP2, id="w2-pp2-1f1b"),
    pytest.param(2, PP2 + INTERLEAVED, id="w2-pp2-interleaved"),
    pytest.param(2, PP2 + ["--pipeline-schedule", "zb-h1"], id="w2-pp2-zb-h1"),
    pytest.param(2, PP2 + ["--pipeline-schedule", "zbv"], id="w2-pp2-zbv"),
    pytest.param(2, ZERO1, id="w2-dp2-zero1-overlap"),
    pytest.param(2, ZERO3, id="w2-dp2-zero3"),
    pytest.param(2, ["--use-torch-fsdp2"], id="w2-dp2-fsdp2"),
    pytest.param(2, CP2, id="w2-cp2"),
    pytest.param(4, TP2 + PP2, id="w4-tp2-pp2"),
    pytest.param(4, PP4, id="w4-pp4-1f1b"),
    pytest.param(4, PP4 + ["--pipeline-schedule", "zbv"], id="w4-pp4-zbv"),
    pytest.param(4, CP2, id="w4-dp2-cp2"),
    pytest.param(8, TP2 + PP2 + INTERLEAVED + ZERO1, id="w8-tp2-pp2-dp2-interleaved-zero1"),
    pytest.param(8, PP4 + ["--use-distributed-optimizer"], id="w8-pp4-dp2-zero1"),
]


def need_world(n: int) -> None:
    """Skip unless ``n`` ranks can run here: n GPUs, or on the CPU check up to CPU_MAX_WORLD processes."""
    if ON_CPU:
        if n > CPU_MAX_WORLD:
            pytest.skip(f"world size {n} is not run by the CPU check (MEGALITE_CUDA_TIER_ON_CPU stops at "
                        f"{CPU_MAX_WORLD} ranks); it runs with {n} GPUs")
        return
    have = torch.cuda.device_count()
    if have < n:
        pytest.skip(f"world size {n} needs {n} GPUs; torch sees {have}")


_runs: dict[tuple, str] = {}


def run(nproc: int, argv: list[str]) -> str:
    """stdout of pretrain_gpt.py, plain (nproc 0: no process group, the single-GPU reference) or under
    torchrun with nproc processes; each distinct run once per session."""
    key = (nproc, tuple(argv))
    if key not in _runs:
        if nproc == 0:
            _runs[key] = pretrain(argv)
        else:
            proc = run_pretrain(nproc, argv)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            _runs[key] = proc.stdout
    return _runs[key]


def assert_trains_like(stdout: str, reference: str, rtol: float) -> None:
    """Same lm loss per iteration within rtol, and the same grad norm (within rtol, or the printed
    precision where that is coarser)."""
    assert_close(losses(stdout), losses(reference), rtol=rtol)
    norms, expected = field(stdout, "grad norm"), field(reference, "grad norm")
    assert len(norms) == len(expected) == len(losses(reference))
    for i, (a, e) in enumerate(zip(norms, expected), start=1):
        assert a == pytest.approx(e, rel=rtol, abs=GRAD_NORM_ATOL), \
            f"iteration {i}: grad norm {a} vs {e} ({norms} vs {expected})"


@pytest.mark.parametrize("nproc, layout", LAYOUTS)
def test_layout_trains_like_one_gpu(nproc, layout):
    need_world(nproc)
    assert_trains_like(run(nproc, ARGV + layout), run(0, ARGV), FP32_RTOL)


def test_bf16_tensor_parallel_trains_like_one_gpu_within_bf16_tolerance():
    """bf16 activations all-reduced / reduce-scattered across TP ranks (sequence parallel)."""
    need_world(2)
    argv = with_flags(ARGV, bf16=True, no_tf32=None)
    assert_trains_like(run(2, argv + TP2), run(0, argv), BF16_RTOL)


def test_one_gpu_per_task_trains_like_torchrun(tmp_path):
    """Two ranks launched as SLURM --gpus-per-task=1 starts them: each its own process with
    CUDA_VISIBLE_DEVICES naming one different GPU, so every rank sees only cuda:0 while LOCAL_RANK is 0
    and 1. Same losses as the torchrun run of the same flags (where each rank sees both GPUs).
    On the CPU check there are no GPUs to hide: it checks the launch and the comparison only."""
    need_world(2)
    argv = ARGV + TP2
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if ON_CPU:
        gpus = ["", ""]
    elif visible:
        gpus = [d.strip() for d in visible.split(",")]          # indices or UUIDs, as the machine named them
    else:
        gpus = [str(i) for i in range(torch.cuda.device_count())]
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "CUDA_VISIBLE_DEVICES": gpus[rank]}
        out, err = open(tmp_path / f"rank{rank}.out", "w"), open(tmp_path / f"rank{rank}.err", "w")
        procs.append((subprocess.Popen([sys.executable, ENTRY, *argv], stdout=out, stderr=err, env=env), out, err))
    deadline = time.monotonic() + 600
    try:
        # a rank that fails leaves the other waiting at the rendezvous: stop it too and report the failure
        while any(p.poll() is None for p, _, _ in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p, _, _ in procs):
                break
            time.sleep(0.5)
    finally:
        for p, out, err in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            out.close()
            err.close()
    codes = [p.returncode for p, _, _ in procs]
    stdout = [(tmp_path / f"rank{r}.out").read_text() for r in range(2)]
    stderr = [(tmp_path / f"rank{r}.err").read_text() for r in range(2)]
    assert codes == [0, 0], "\n".join(f"rank {r} exit {c}:\n{stdout[r][-1500:]}\n{stderr[r][-3000:]}"
                                      for r, c in enumerate(codes))
    # the training line comes from the last rank (Megatron's logging rank)
    assert_trains_like(stdout[1], run(2, argv), FP32_RTOL)
