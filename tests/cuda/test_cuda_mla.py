"""Multi-latent attention on one GPU: the module's forward and gradients (q-LoRA with YaRN, and the full
query projection over packed documents with learned sinks, whose unequal Q/K and V head dims take the
blockwise kernels) equal the CPU fp32 run in fp32 and within bf16 rounding in bf16; a tiny MLA GPTModel
decodes from its latent cache on the GPU as its full forward computes
(tests/unit/model/test_mla.py covers the CPU against transformers)."""
import pytest
import torch

from megalite.model.attention.inputs import AttentionInputs
from megalite.model.attention.kv_cache import KVCache
from megalite.model.attention.mla import MultiLatentAttention
from megalite.model.gpt import GPTModel
from megalite.parallel.tensor.layers import TensorParallel
from unit.model.test_mla import B, H, S, YARN, mla_config, rotary_tables

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CU = torch.tensor([[0, 5, 17, S], [0, 11, S, S]], dtype=torch.int32)
CASES = {"qlora-yarn": (dict(yarn=YARN), False), "full-q-documents-sinks": (dict(q_lora_rank=None,
                                                                                softmax_type="learnable"), True)}


def _run(module, x, grad, tables, documents):
    x = x.clone().requires_grad_()
    out = module(x, AttentionInputs(tables, documents))
    out.backward(grad)
    return [out, x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_mla_on_the_gpu_equals_the_cpu_run(case, dtype):
    fields, with_documents = CASES[case]
    config = mla_config(**fields)
    torch.manual_seed(0)
    cpu = MultiLatentAttention(config, torch.float32, TensorParallel())
    with torch.no_grad():
        for p in cpu.parameters():
            p.normal_(0, 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    gpu = MultiLatentAttention(config, dtype, TensorParallel()).to(DEVICE)
    gpu.load_state_dict(cpu.state_dict())
    g = torch.Generator().manual_seed(1)
    x, grad = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    want = _run(cpu, x, grad, rotary_tables(config, S, torch.float32), CU if with_documents else None)
    tables = tuple(t.to(DEVICE) for t in rotary_tables(config, S, dtype))
    got = _run(gpu, x.to(DEVICE, dtype), grad.to(DEVICE, dtype), tables, CU.to(DEVICE) if with_documents else None)
    tol = 2e-4 if dtype == torch.float32 else 4e-2
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float().cpu(), b, rtol=tol, atol=tol * b.abs().max().item())


def test_cached_latent_decoding_on_the_gpu_equals_the_full_forward():
    model = GPTModel(mla_config(yarn=YARN, init_method_std=0.1), seed=5).to(DEVICE).eval()
    ids = torch.randint(0, 120, (2, 30), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(max_length=30)
        steps = [model(ids[:, :9], kv_cache=cache)] + [model(ids[:, i:i + 1], kv_cache=cache) for i in range(9, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)
