"""Multi-latent attention (model/attention/mla.py): forward and gradients equal transformers'
DeepseekV3Attention on the same weights (q-LoRA with YaRN and mscale, DeepSeek-V2-Lite's full query
projection with plain RoPE, interleaved and half-split RoPE rows); a whole GPTModel trains on it; cached
decoding of the latent equals the full forward; parameter names, shapes and init; the flags' one-line
errors."""
import math

import pytest
import torch

from megalite.config.schema import ModelConfig
from megalite.errors import UserError
from megalite.model.attention import build_attention
from megalite.model.attention.inputs import AttentionInputs
from megalite.model.attention.kv_cache import KVCache
from megalite.model.attention.mla import MultiLatentAttention, softmax_scale
from megalite.model.attention.rotary import RotaryEmbedding, Yarn
from megalite.model.gpt import GPTModel
from megalite.model.init import init_std
from megalite.parallel.tensor.layers import TensorParallel
from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

S, B, H, HEADS, NOPE, ROPE, V_DIM, Q_RANK, KV_RANK = 24, 2, 48, 4, 8, 6, 10, 20, 12
YARN = dict(rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0)
CASES = {   # name: (q_lora_rank, YaRN fields or None for plain RoPE, HF rope_interleave)
    "v3_qlora_yarn_interleaved": (Q_RANK, YARN, True),
    "v2_lite_rope": (None, None, False),
    "v2_lite_yarn_interleaved": (None, YARN, True),
}


def mla_config(q_lora_rank=Q_RANK, yarn=None, **extra) -> ModelConfig:
    """transformers builds the latents' norms with eps 1e-6 whatever rms_norm_eps says: the same here."""
    return ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=HEADS, num_query_groups=HEADS,
                       kv_channels=H // HEADS, ffn_hidden_size=64, seq_length=S, max_position_embeddings=64,
                       padded_vocab_size=128, vocab_size=120, position_embedding_type="rope", normalization="RMSNorm",
                       swiglu=True, add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
                       multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=KV_RANK,
                       qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V_DIM, qk_layernorm=True,
                       rope_type="yarn" if yarn else "rope", norm_epsilon=1e-6, **(yarn or {}), **extra)


def hf_attention(q_lora_rank, yarn, interleave: bool):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": yarn["rotary_scaling_factor"],
                "original_max_position_embeddings": yarn["yarn_original_max_position_embeddings"],
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": yarn["mscale"], "mscale_all_dim": yarn["mscale_all_dim"]}
    config = transformers.DeepseekV3Config(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=q_lora_rank,
        kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
        max_position_embeddings=64, rope_parameters=rope, rope_interleave=interleave, attention_bias=False,
        rms_norm_eps=1e-6, attention_dropout=0.0, vocab_size=128, num_hidden_layers=1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = DeepseekV3Attention(config, layer_idx=0)
    with torch.no_grad():
        for p in attention.parameters():
            p.normal_(0, 0.15 if p.dim() == 2 else 0.2).add_(1.0 if p.dim() == 1 else 0.0)
    return attention, DeepseekV3RotaryEmbedding(config)


def rope_rows(rows: int, interleave: bool) -> torch.Tensor:
    """Index of megalite's rows in a block of transformers' [..., rope rows] (the last ``ROPE`` of each
    ``rows``): interleaved pairs become the half-split layout, even indices first."""
    index = torch.arange(rows)
    if interleave:
        index[rows - ROPE:] = rows - ROPE + torch.cat([torch.arange(0, ROPE, 2), torch.arange(1, ROPE, 2)])
    return index


def weight_map(hf, interleave: bool) -> dict:
    """megalite name -> (transformers parameter, row index into it)."""
    qk = NOPE + ROPE
    q_rows = torch.cat([h * qk + rope_rows(qk, interleave) for h in range(HEADS)])
    out = {"linear_kv_down_proj.weight": (hf.kv_a_proj_with_mqa.weight, rope_rows(KV_RANK + ROPE, interleave)),
           "kv_layernorm.weight": (hf.kv_a_layernorm.weight, None),
           "linear_kv_up_proj.weight": (hf.kv_b_proj.weight, None), "linear_proj.weight": (hf.o_proj.weight, None)}
    if hf.q_proj is not None:
        out["linear_q_proj.weight"] = (hf.q_proj.weight, q_rows)
    else:
        out.update({"linear_q_down_proj.weight": (hf.q_a_proj.weight, None),
                    "q_layernorm.weight": (hf.q_a_layernorm.weight, None),
                    "linear_q_up_proj.weight": (hf.q_b_proj.weight, q_rows)})
    return out


def rotary_tables(config: ModelConfig, length: int, dtype: torch.dtype):
    yarn = Yarn.from_config(config) if config.uses_yarn else None
    rope = RotaryEmbedding(config.rotary_head_dim, config.rotary_base, config.max_position_embeddings, 1.0, yarn)
    return rope.tables(None, length, dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Within fp32 rounding of the tensor's scale (transformers' own fp32 run is ~4e-7 of it from its fp64
    run): the two sum and normalise in different orders."""
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * want.detach().abs().max().item(), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_forward_and_gradients_equal_transformers_deepseek_attention(case, dtype=torch.float32):
    q_lora_rank, yarn, interleave = CASES[case]
    hf, hf_rope = hf_attention(q_lora_rank, yarn, interleave)
    hf.to(dtype)
    config = mla_config(q_lora_rank, yarn)
    ours = MultiLatentAttention(config, dtype, TensorParallel())
    mapping = weight_map(hf, interleave)
    assert {n for n, _ in ours.named_parameters()} == set(mapping)
    with torch.no_grad():
        for name, (param, rows) in mapping.items():
            ours.get_parameter(name).copy_(param if rows is None else param[rows])
    assert ours.scale == pytest.approx(hf.scaling, rel=1e-12)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1), dtype=dtype)
    grad = torch.randn(B, S, H, generator=torch.Generator().manual_seed(2), dtype=dtype)

    x_hf = x.clone().requires_grad_()
    positions = torch.arange(S)[None].expand(B, S)
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None].expand(B, 1, S, S)
    want = hf(x_hf, tuple(t.to(dtype) for t in hf_rope(x_hf.float(), positions)), mask.to(dtype))[0]
    want.backward(grad)
    x_ours = x.transpose(0, 1).clone().requires_grad_()
    got = ours(x_ours, AttentionInputs(rotary_tables(config, S, dtype)))
    got.backward(grad.transpose(0, 1))

    assert_close(got.transpose(0, 1), want, "output")
    assert_close(x_ours.grad.transpose(0, 1), x_hf.grad, "input gradient")
    for name, (param, rows) in mapping.items():
        assert_close(ours.get_parameter(name).grad, param.grad if rows is None else param.grad[rows], name)


def test_yarn_softmax_scale_carries_mscale_squared():
    config = mla_config(yarn=YARN)
    mscale = 0.1 * 1.0 * math.log(4.0) + 1
    assert softmax_scale(config) == pytest.approx(mscale ** 2 / math.sqrt(NOPE + ROPE))
    assert softmax_scale(mla_config()) == pytest.approx(1 / math.sqrt(NOPE + ROPE))


def test_parameter_shapes_names_and_init():
    tp = TensorParallel()
    shapes = {n: tuple(p.shape) for n, p in build_attention(mla_config(), torch.float32, tp).named_parameters()}
    assert shapes == {"linear_q_down_proj.weight": (Q_RANK, H), "q_layernorm.weight": (Q_RANK,),
                      "linear_q_up_proj.weight": (HEADS * (NOPE + ROPE), Q_RANK),
                      "linear_kv_down_proj.weight": (KV_RANK + ROPE, H), "kv_layernorm.weight": (KV_RANK,),
                      "linear_kv_up_proj.weight": (HEADS * (NOPE + V_DIM), KV_RANK),
                      "linear_proj.weight": (H, HEADS * V_DIM)}
    lite = {n for n, _ in build_attention(mla_config(q_lora_rank=None), torch.float32, tp).named_parameters()}
    assert "linear_q_proj.weight" in lite and not any("q_down" in n or "q_up" in n for n in lite)
    prefix = "decoder.layers.0.self_attention."
    assert init_std(prefix + "linear_proj.weight", 0.02, 2) == pytest.approx(0.02 / 2)     # scaled output init
    for name in ("linear_q_down_proj.weight", "linear_q_up_proj.weight", "linear_kv_down_proj.weight",
                 "linear_kv_up_proj.weight", "linear_q_proj.weight"):
        assert init_std(prefix + name, 0.02, 2) == 0.02
    model = GPTModel(mla_config())
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight"):
            assert bool((p == 1).all()), name


@pytest.mark.parametrize("q_lora_rank", [Q_RANK, None], ids=["qlora", "full_q"])
def test_tiny_gpt_model_with_mla_trains_on_cpu(q_lora_rank):
    model = GPTModel(mla_config(q_lora_rank, YARN, init_method_std=0.05), seed=3)
    ids = torch.randint(0, 120, (B, S), generator=torch.Generator().manual_seed(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("yarn", [None, YARN], ids=["rope", "yarn"])
def test_cached_latent_decoding_equals_the_full_forward(yarn):
    model = GPTModel(mla_config(yarn=yarn, init_method_std=0.1), seed=5).eval()
    ids = torch.randint(0, 120, (2, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(max_length=30)
        steps = [model(ids[:, :7], kv_cache=cache), model(ids[:, 7:8], kv_cache=cache),
                 model(ids[:, 8:13], kv_cache=cache)]
        steps += [model(ids[:, i:i + 1], kv_cache=cache) for i in range(13, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    latent, key = cache.keys[1], cache.values[1]            # the compressed latent, not per-head K/V
    assert latent.shape == (30, 2, KV_RANK) and key.shape == (30, 2, 1, ROPE)


MLA_ARGS = with_flags(TINY_LLAMA_ARGS, group_query_attention=None, num_query_groups=None, multi_latent_attention=True,
                      kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=12, qk_layernorm=True)


@pytest.mark.parametrize("flags, message", [
    ({"tensor_model_parallel_size": 3, "num_attention_heads": 4}, "--num-attention-heads 4 must be divisible by "
                                                                  "--tensor-model-parallel-size 3"),
    ({"group_query_attention": True, "num_query_groups": 2}, "does not support --group-query-attention"),
    ({"position_embedding_type": "learned_absolute"}, "does not support --position-embedding-type learned_absolute"),
    ({"disable_bias_linear": None}, "does not support linear biases: add --disable-bias-linear"),
    ({"rotary_percent": 0.5}, "does not support --rotary-percent 0.5"),
    ({"qk_pos_emb_head_dim": 5}, "--qk-pos-emb-head-dim 5: RoPE rotates pairs"),
    ({"multi_latent_attention": None, "q_lora_rank": 8}, "--q-lora-rank applies to multi-latent attention"),
])
def test_bad_mla_flags_are_one_line_errors(flags, message):
    world = flags.get("tensor_model_parallel_size", 1)
    with pytest.raises(UserError, match=message) as error:
        parse_args(with_flags(MLA_ARGS, **flags), world_size=world)
    assert "\n" not in str(error.value)


def test_mla_layouts_pass_the_heads_and_groups_rules():
    """MLA's K/V are per head: the query-group rules see one group per head, and an odd --kv-channels
    (hidden / heads) does not trip RoPE's even-dimension rule, which checks the RoPE part."""
    for tp in (1, 2, 4):
        parse_args(with_flags(MLA_ARGS, tensor_model_parallel_size=tp, sequence_parallel=tp > 1), world_size=tp)
    parse_args(with_flags(MLA_ARGS, hidden_size=60, num_attention_heads=4), world_size=1)     # kv_channels 15
    parse_args(with_flags(MLA_ARGS, context_parallel_size=2, cp_comm_type="a2a", num_attention_heads=4,
                          tensor_model_parallel_size=2), world_size=4)
