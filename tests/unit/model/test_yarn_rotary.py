"""YaRN RoPE (--position-embedding-type yarn): cos/sin equal transformers' rotary embedding for the same
configuration (GPT-OSS's, DeepSeek-V3's mscale pair, partial rotary, untruncated ramp); the one-line
mistakes of its flags."""
import pytest
import torch

from megalite.errors import UserError
from megalite.model.attention.rotary import RotaryEmbedding, Yarn
from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

transformers = pytest.importorskip("transformers")

CASES = {   # name: (head_dim, partial rotary factor, rope_parameters beyond rope_type/rope_theta)
    "gpt_oss": (64, 1.0, dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                              original_max_position_embeddings=4096)),
    "deepseek": (64, 1.0, dict(factor=40.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                               original_max_position_embeddings=4096)),
    "truncated_partial": (32, 0.5, dict(factor=4.0, beta_fast=16.0, beta_slow=2.0,
                                        original_max_position_embeddings=256)),
}


def _transformers_tables(head_dim, partial, params, positions):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                         max_position_embeddings=8192, partial_rotary_factor=partial,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **params})
    rope = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    return rope(x, positions[None])


@pytest.mark.parametrize("case", CASES)
def test_yarn_tables_equal_transformers(case):
    head_dim, partial, params = CASES[case]
    yarn = Yarn(params["factor"], params["original_max_position_embeddings"], params["beta_fast"],
                params["beta_slow"], params.get("mscale", 1.0), params.get("mscale_all_dim", 0.0),
                params.get("truncate", True))
    ours = RotaryEmbedding(head_dim, 150000.0, 8192, partial, yarn)
    positions = torch.tensor([0, 1, 7, 100, 4095, 4096, 8191])
    cos, sin = _transformers_tables(head_dim, partial, params, positions)
    torch.testing.assert_close(ours.cos[positions], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin[positions], sin[0], rtol=0, atol=1e-6)
    plain = RotaryEmbedding(head_dim, 150000.0, 8192, partial)
    assert not torch.allclose(plain.cos[positions], cos[0], atol=1e-3)      # YaRN changed the tables


def test_yarn_flags_build_the_model_tables():
    flags = dict(position_embedding_type="yarn", rotary_scaling_factor=4.0,
                 yarn_original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.0)
    config = parse_args(with_flags(TINY_LLAMA_ARGS, **flags), world_size=1).model
    from megalite.model.gpt import GPTModel
    model = GPTModel(config, seed=1)
    expected = RotaryEmbedding(config.kv_channels, config.rotary_base, config.max_position_embeddings,
                               yarn=Yarn(4.0, 16))
    assert torch.equal(model.rotary.cos, expected.cos)


@pytest.mark.parametrize("flags, message", [
    (dict(rotary_scaling_factor=4.0), "--rotary-scaling-factor scales RoPE by YaRN"),
    (dict(glu_linear_offset=1.0), "--glu-linear-offset applies to the quick GEGLU"),
    (dict(quick_geglu=True), "--quick-geglu and --swiglu"),
])
def test_variant_mistakes_are_one_line(flags, message):
    with pytest.raises(UserError, match=message):
        parse_args(with_flags(TINY_LLAMA_ARGS, **flags), world_size=1)
