"""QK-clip (--qk-clip) and the max attention logit: the per-head max logit that attention records on its
training forward against a dense fp64 q k^T x scale with the mask built here (causal, documents, a
window; GQA and multi-latent attention); the rescale against a hand computation of Megatron's rule, on
master pieces cut mid-row as ZeRO cuts them; the next forward's max logit of a clipped head at the
threshold; the flags' one-line errors."""
import pytest
import torch
from torch import nn

from megalite.config.schema import ModelConfig, OptimizerConfig
from megalite.errors import UserError
from megalite.model.attention import logit_clip, mla, self_attention
from megalite.model.attention.inputs import AttentionInputs
from megalite.model.attention.mla import MultiLatentAttention
from megalite.model.attention.rotary import RotaryEmbedding
from megalite.model.attention.self_attention import SelfAttention
from megalite.optim.master_weights import MasterWeights, Piece
from megalite.optim.mixed_precision import MixedPrecisionOptimizer
from megalite.optim.qk_clip import QKClip, scale_rows
from megalite.parallel.data.grad_buffer import ParamAndGradBuffer
from megalite.parallel.tensor.layers import TensorParallel
from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

S, B, H = 24, 2, 24
DOCUMENTS = torch.tensor([[0, 5, 13, 24], [0, 24, 24, 24]], dtype=torch.int32)


def gqa_config(**kw) -> ModelConfig:
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=4, num_query_groups=2, kv_channels=6,
                ffn_hidden_size=32, seq_length=S, max_position_embeddings=64, padded_vocab_size=64,
                position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False,
                attention_dropout=0.0, hidden_dropout=0.0, qk_clip=True)
    return ModelConfig(**{**base, **kw})


def mla_config(**kw) -> ModelConfig:
    return gqa_config(num_query_groups=4, kv_channels=6, multi_latent_attention=True, q_lora_rank=10,
                      kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, **kw)


def build(config: ModelConfig) -> nn.Module:
    module = (MultiLatentAttention if config.multi_latent_attention else SelfAttention)(config, torch.float32,
                                                                                        TensorParallel())
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.6 if p.dim() > 1 else 1 + 0.1 * torch.randn(p.shape))
    return module.train()


def inputs(config: ModelConfig, documents=None) -> AttentionInputs:
    dim = config.qk_pos_emb_head_dim if config.multi_latent_attention else config.kv_channels
    return AttentionInputs(RotaryEmbedding(dim, 10000.0, 64).tables(None, S, torch.float32), documents)


def visible_reference(s: int, window_left: int | None, documents) -> torch.Tensor:
    """bool [b, s, s], written out: causal, within the window, same document."""
    out = torch.zeros(B, s, s, dtype=torch.bool)
    for b in range(B):
        doc = [0] * s
        if documents is not None:
            bounds = sorted(set(documents[b].tolist()))
            for i in range(s):
                doc[i] = sum(1 for x in bounds[1:] if x <= i)
        for i in range(s):
            for j in range(i + 1):
                out[b, i, j] = doc[i] == doc[j] and (window_left is None or i - j <= window_left)
    return out


def dense_max(q, k, scale, visible) -> torch.Tensor:
    """fp64 [heads]: max over b, i, j of q_i . k_j x scale where visible."""
    heads = q.shape[2]
    k = k.double().repeat_interleave(heads // k.shape[2], dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q.double(), k) * scale
    return scores.masked_fill(~visible[:, None], float("-inf")).amax(dim=(0, 2, 3))


def captured_forward(monkeypatch, module, x, attention_inputs):
    """The module's forward, with the q, k and mask its core attention received."""
    seen = {}
    home = mla if isinstance(module, MultiLatentAttention) else self_attention
    real = home.run_core_attention

    def spy(q, k, v, mask, **kw):
        seen.update(q=q.detach(), k=k.detach(), mask=mask)
        return real(q, k, v, mask, **kw)
    monkeypatch.setattr(home, "run_core_attention", spy)
    module(x, attention_inputs)
    monkeypatch.setattr(home, "run_core_attention", real)
    return seen


CASES = {"gqa-causal": (gqa_config, None, None), "gqa-documents": (gqa_config, None, DOCUMENTS),
         "gqa-window": (gqa_config, 4, None), "mla-documents": (mla_config, None, DOCUMENTS),
         "mla-window": (mla_config, 5, None)}


@pytest.mark.parametrize("case", CASES)
def test_recorded_max_logit_equals_a_dense_reference(monkeypatch, case):
    make, window, documents = CASES[case]
    config = make(**({"window_size": (window, 0)} if window is not None else {}))
    module = build(config)
    monkeypatch.setattr(logit_clip, "BLOCK", 7)           # blocks cut the sequence unevenly, some skipped
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(5))
    seen = captured_forward(monkeypatch, module, x, inputs(config, documents))
    scale = module.scale if isinstance(module, MultiLatentAttention) else config.kv_channels ** -0.5
    want = dense_max(seen["q"], seen["k"], scale, visible_reference(S, window, documents))
    got = module.max_logits.take()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert module.max_logits.value is None
    with torch.no_grad():                                  # a second micro-batch: the max over both
        module(x * 0.5, inputs(config, documents))
        module(x, inputs(config, documents))
    torch.testing.assert_close(module.max_logits.take().double(), want, rtol=1e-5, atol=1e-5)
    module.eval()(x, inputs(config, documents))
    assert module.max_logits.value is None                 # evaluation records nothing


def clipped_optimizer(module, config, pieces_at=None):
    """An fp32 AdamW at lr 0 (the update leaves the weights) with the module's QK-clip; ``pieces_at``: flat
    offsets where the master pieces are cut (mid-row, as ZeRO's equal slices cut them)."""
    named = list(module.named_parameters())
    buffer = ParamAndGradBuffer(named)
    optimizer = MixedPrecisionOptimizer(buffer, named, OptimizerConfig(lr=0.0, weight_decay=0.0, clip_grad=0.0))
    if pieces_at is not None:
        cuts = [0, *pieces_at, buffer.numel]
        pieces = [Piece(a, b, buffer.param_data[a:b], buffer.grad_data[a:b]) for a, b in zip(cuts, cuts[1:])]
        optimizer.weights = MasterWeights(buffer, named, pieces, False)
    optimizer.qk_clip = QKClip([module], buffer, named, config)
    return optimizer


@pytest.mark.parametrize("cut", [None, [7, 50, 131, 400]])
def test_gqa_clip_rescales_as_megatron_by_hand(cut):
    config = gqa_config(qk_clip_threshold=1.0, qk_clip_alpha=0.3, add_qkv_bias=True)
    module = build(config)
    optimizer = clipped_optimizer(module, config, cut)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    module.max_logits.value = torch.tensor([0.4, 2.5, 0.9, 0.2])      # group 0: heads 0, 1; group 1: heads 2, 3
    assert optimizer.step(0.0).update_successful
    eta = [1.0 / 2.5, 1.0]                                            # group 0's max exceeds 1, group 1's does not
    for name in ("linear_qkv.weight", "linear_qkv.bias"):
        want = before[name].view(2, 4, 6, -1).clone()                 # per group [q, q, k, v] x head dim 6
        for g in range(2):
            want[g, :2] *= eta[g] ** 0.3
            want[g, 2] *= eta[g] ** 0.7
        torch.testing.assert_close(module.get_parameter(name).detach(), want.view_as(before[name]), rtol=1e-6, atol=0)
    for name in before:
        if not name.startswith("linear_qkv"):
            assert torch.equal(module.get_parameter(name).detach(), before[name]), name
    assert float(optimizer.qk_clip.last_max) == 2.5
    assert module.max_logits.value is None


def test_mla_clip_rescales_as_megatron_by_hand():
    config = mla_config(qk_clip_threshold=2.0)
    module = build(config)
    optimizer = clipped_optimizer(module, config, [5, 333])
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    module.max_logits.value = torch.tensor([8.0, 1.0, 3.0, 2.0])
    optimizer.step(0.0)
    eta = torch.tensor([0.25, 1.0, 2.0 / 3.0, 1.0])[:, None, None]
    q = before["linear_q_up_proj.weight"].view(4, 12, -1).clone()
    q[:, :8] *= eta ** 0.5                                            # no-RoPE part
    q[:, 8:] *= eta                                                   # RoPE part
    kv = before["linear_kv_up_proj.weight"].view(4, 14, -1).clone()
    kv[:, :8] *= eta ** 0.5                                           # key rows; values [8:] stay
    torch.testing.assert_close(module.linear_q_up_proj.weight.detach(), q.view(48, -1), rtol=1e-6, atol=0)
    torch.testing.assert_close(module.linear_kv_up_proj.weight.detach(), kv.view(56, -1), rtol=1e-6, atol=0)
    for name in ("linear_kv_down_proj.weight", "linear_q_down_proj.weight", "linear_proj.weight"):
        assert torch.equal(module.get_parameter(name).detach(), before[name]), name


@pytest.mark.parametrize("make", [gqa_config, mla_config])
def test_next_forward_max_logit_of_a_clipped_head_is_the_threshold(make):
    config = make()
    module = build(config)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(7))
    module(x, inputs(config))
    first = module.max_logits.value.clone()
    group = 1 if config.multi_latent_attention else 2                # query heads per rescale unit
    unit_max = first.view(-1, group).amax(1).repeat_interleave(group)
    threshold = float(unit_max.min() + unit_max.max()) / 2           # some units clipped, some not
    config = make(qk_clip_threshold=threshold)
    optimizer = clipped_optimizer(module, config)
    optimizer.step(0.0)
    module(x, inputs(config))
    after = module.max_logits.take()
    eta = torch.where(unit_max > threshold, threshold / unit_max, torch.ones_like(unit_max))
    torch.testing.assert_close(after, first * eta, rtol=1e-5, atol=1e-6)   # q.k scales by eta
    clipped = unit_max > threshold
    assert clipped.any() and not clipped.all()
    torch.testing.assert_close(after.view(-1, group).amax(1)[clipped[::group]],
                               torch.full((int(clipped[::group].sum()),), threshold), rtol=1e-5, atol=1e-6)


def test_scale_rows_on_any_slice_of_a_parameter():
    rows, cols = 5, 4
    scale = torch.arange(1.0, rows + 1)
    for first in range(rows * cols):
        for end in range(first + 1, rows * cols + 1):
            flat = torch.ones(end - first)
            scale_rows(flat, scale, first, cols)
            assert torch.equal(flat, scale[torch.arange(first, end) // cols]), (first, end)


MLA_ARGS = with_flags(TINY_LLAMA_ARGS, multi_latent_attention=True, group_query_attention=None, num_query_groups=None,
                      q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8)


@pytest.mark.parametrize("flags, message", [
    (dict(qk_clip=True, qk_clip_alpha=1.0), "--qk-clip-alpha 1 must lie strictly between 0 and 1"),
    (dict(qk_clip=True, qk_clip_alpha=0), "--qk-clip-alpha 0 must lie strictly between 0 and 1"),
    (dict(qk_clip=True, qk_clip_threshold=0), "--qk-clip-threshold 0 must be greater than 0"),
    (dict(qk_clip=True, qk_layernorm=True), "--qk-clip rescales the query and key projections, but --qk-layernorm"),
])
def test_bad_qk_clip_flags_are_one_line_errors(flags, message):
    with pytest.raises(UserError, match=message) as error:
        parse_args(with_flags(TINY_LLAMA_ARGS, **flags), world_size=1)
    assert "\n" not in str(error.value)


def test_good_qk_clip_flags_parse():
    config = parse_args(with_flags(MLA_ARGS, qk_clip=True, qk_layernorm=True, qk_clip_threshold=30), world_size=1)
    assert config.model.qk_clip and config.model.qk_clip_threshold == 30 and config.model.qk_clip_alpha == 0.5
    assert parse_args(with_flags(TINY_LLAMA_ARGS, log_max_attention_logit=True), world_size=1).model.records_max_logit
