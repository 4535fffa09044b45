"""GPT-OSS conversion: what megalite cannot represent is refused in one line, both ways (the logits and
round trip of a tiny GPT-OSS are in test_convert_checkpoint.py's FAMILIES)."""
import pytest

from megalite.checkpoint.hf_config import check_convertible, check_representable, extra_defaults, model_fields
from megalite.errors import UserError

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=4, num_local_experts=4,
            num_experts_per_tok=2)


def config(**kw):
    return transformers.GptOssConfig(**{**BASE, **kw})


@pytest.mark.parametrize("kw, message", [
    (dict(swiglu_alpha=1.5), "swiglu_alpha=1.5 is not supported"),
    (dict(attention_bias=False), "attention_bias=False is not supported"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types chunked_attention"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 8.0}), "rope_type=.linear."),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "attention_factor": 2.0,
                           "original_max_position_embeddings": 16}), "attention_factor=2.0 differs"),
])
def test_unrepresentable_configs_are_refused_in_one_line(kw, message):
    with pytest.raises(UserError, match=message) as error:
        check_convertible(config(**kw))
    assert "\n" not in str(error.value)


def test_rope_parameters_per_layer_type_are_refused_when_they_differ():
    c = config()
    c.rope_parameters = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "default", "rope_theta": 5e5}}
    with pytest.raises(UserError, match="different RoPE parameters per layer type") as error:
        check_convertible(c)
    assert "\n" not in str(error.value)
    c.rope_parameters = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    check_convertible(c)


def test_quantised_checkpoint_is_refused():
    c = config()
    c.quantization_config = {"quant_method": "mxfp4"}
    with pytest.raises(UserError, match=r"quantization_config \(mxfp4\) is not supported"):
        check_convertible(c)


def test_yarn_defaults_and_mscale_pair_map_to_megalite_fields():
    m = model_fields(config())         # GptOssConfig's own default: YaRN factor 32 over 4096 positions
    assert (m["position_embedding_type"], m["rotary_scaling_factor"], m["yarn_original_max_position_embeddings"],
            m["yarn_correction_range_round_to_int"]) == ("yarn", 32.0, 4096, False)
    assert m["window_attn_skip_freq"] == [1, 0] and m["window_size"] == [3, 0]
    paired = model_fields(config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                  "mscale": 0.5, "mscale_all_dim": 0.7,
                                                  "original_max_position_embeddings": 16}))
    assert (paired["mscale"], paired["mscale_all_dim"]) == (0.5, 0.7)


def test_export_refusals_name_the_missing_part():
    m = {**extra_defaults(), **model_fields(config())}
    check_representable(m, "gpt_oss")
    for field, value, message in (("softmax_type", "vanilla", "learned attention sinks"),
                                  ("add_bias_linear", False, "biases on every linear layer"),
                                  ("moe_router_pre_softmax", True, "softmax over the top-k logits")):
        with pytest.raises(UserError, match=message):
            check_representable({**m, field: value}, "gpt_oss")
    for family in ("llama", "mixtral"):                 # sinks, YaRN and the quick GEGLU have nowhere to go
        with pytest.raises(UserError, match=f"--model-type {family} cannot represent"):
            check_representable(m, family)
