"""Ring attention's block kernels on one GPU: flash attention (fp16 / bf16, grouped K/V) and the
memory-efficient kernel (fp32: K/V repeated per block, log-sum-exp padded to 32 rows) give plain causal
SDPA's output and q/k/v gradients at cp = 2 and 4, every CP rank emulated in one process as in
tests/unit/parallel/test_ring_attention.py, and one ring step's memory grows linearly with the chunk
length. The ring over NCCL runs in test_multi_gpu.py (CP layouts, 2+ GPUs)."""
import pytest
import torch

from unit.parallel.test_ring_attention import TOLERANCES, assert_ring_equals_sdpa, ring_step

pytestmark = pytest.mark.cuda

# fp32: the memory-efficient kernel's fp32 sums in another order than SDPA's math path
CUDA_TOLERANCES = {**TOLERANCES, torch.float32: dict(atol=1e-4, rtol=1e-4),
                   torch.float16: dict(atol=5e-3, rtol=5e-3)}


@pytest.fixture(autouse=True)
def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False   # an fp32 reference
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.parametrize("chunk", [16, 80])              # 80: log-sum-exp rows not a multiple of 32
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("cp_size", [2, 4])
def test_ring_blocks_equal_causal_sdpa_on_gpu(cp_size, groups, dtype, chunk):
    assert_ring_equals_sdpa(cp_size, groups, dtype, device="cuda", chunk=chunk, tolerance=CUDA_TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ring_step_gpu_memory_is_linear_in_the_chunk_length(dtype):
    peaks = {}
    for chunk in (2048, 8192):
        run = ring_step(chunk, dtype, "cuda")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peaks[chunk] = torch.cuda.max_memory_allocated() - before
    # x 4 in c: x 4 in memory (not x 16 as a block's c x c scores); kernel workspaces add a little
    assert peaks[8192] / peaks[2048] == pytest.approx(4.0, rel=0.25), peaks
