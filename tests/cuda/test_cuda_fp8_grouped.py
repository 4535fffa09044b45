"""The experts' rowwise FP8 GEMMs on a GPU with torch._scaled_grouped_mm (Hopper and later): the probe finds
the kernel for E4M3 operands, and the forward and input-gradient GEMMs of all experts in one grouped kernel
equal the per-expert torch._scaled_mm loop (the same quantised operands, bf16 outputs: to bf16 rounding)."""
import pytest
import torch

from megalite.precision.fp8 import GRAD, INPUT, Fp8Recipe, has_grouped_kernel

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HOPPER = DEVICE.type == "cuda" and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not HOPPER, reason="torch._scaled_grouped_mm needs a CUDA GPU of compute capability 9.0+")
@pytest.mark.parametrize("role", [INPUT, GRAD])
def test_grouped_kernel_equals_the_per_expert_loop(role):
    assert has_grouped_kernel("rowwise", "e4m3", DEVICE, role, torch.bfloat16)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    counts = [32, 0, 48, 16]
    rows = torch.randn(sum(counts), 256, generator=g, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(len(counts), 128, 256, generator=g, device=DEVICE, dtype=torch.bfloat16) * 0.05
    precision = Fp8Recipe("rowwise", "e4m3").build()
    assert precision.grouped_on_kernel(rows, role, weight, counts)
    grouped = precision._grouped(rows, role, weight, counts, None, (None, None)).float()
    precision.grouped_on_kernel = lambda *args: False          # the per-expert torch._scaled_mm loop
    loop = precision._grouped(rows, role, weight, counts, None, (None, None)).float()
    assert torch.allclose(grouped, loop, rtol=1e-2, atol=1e-2 * loop.abs().max().item())
