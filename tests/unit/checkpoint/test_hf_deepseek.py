"""GLM-4.5 (transformers' Glm4MoeForCausalLM) both ways: a tiny random model with partial rotary, q/k/v
biases, QK-norm, a dense first layer, sigmoid routing with an expert bias, a shared expert and a routing
scale; megalite's logits equal transformers', and HF -> megalite -> HF gives the same tensors and config."""
import os

import pytest
import torch
from safetensors.torch import load_file

from megalite.checkpoint.files import CheckpointReader
from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf
from megalite.checkpoint.hf_config import check_convertible
from megalite.checkpoint.sharded import load_model
from megalite.errors import UserError
from unit.checkpoint.test_convert_checkpoint import input_ids, logits, randomise_biases_and_norms

transformers = pytest.importorskip("transformers")

GLM = dict(vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, n_routed_experts=8,
           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
           n_group=1, topk_group=1, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
           initializer_range=0.1, tie_word_embeddings=False)


def make_glm(directory):
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**GLM)).eval()
    randomise_biases_and_norms(model)
    with torch.no_grad():
        for layer in model.model.layers[1:]:              # a bias that changes which experts are picked
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    model.save_pretrained(directory)
    return model


def test_glm4_moe_logits_match_and_round_trip(tmp_path):
    hf_dir, ckpt, out = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "out")
    model = make_glm(hf_dir)
    hf_to_megalite(hf_dir, ckpt)
    m = CheckpointReader(ckpt).metadata["model"]
    assert {k: m[k] for k in ("num_experts", "moe_layer_freq", "moe_shared_expert_intermediate_size",
                              "moe_router_score_function", "moe_router_enable_expert_bias",
                              "moe_router_topk_scaling_factor", "rotary_percent", "qk_layernorm", "add_qkv_bias")} \
        == dict(num_experts=8, moe_layer_freq=[0, 1, 1], moe_shared_expert_intermediate_size=32,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=2.5, rotary_percent=0.5, qk_layernorm=True, add_qkv_bias=True)
    ours = load_model(ckpt)
    for layer in ours.decoder.layers[1:]:           # load_model copies parameters; the expert bias is a buffer
        layer.mlp.router.expert_bias.copy_(CheckpointReader(ckpt).tensor(
            f"decoder.layers.{layer.layer_number - 1}.mlp.router.expert_bias"))
    ids = input_ids()
    assert (ours(ids) - logits(model, ids)).abs().max().item() <= 1e-4
    megalite_to_hf(ckpt, out)
    original, again = (load_file(os.path.join(d, "model.safetensors")) for d in (hf_dir, out))
    assert sorted(again) == sorted(original) and all(torch.equal(again[n], original[n]) for n in original)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(model) and torch.equal(logits(reloaded, ids), logits(model, ids))


@pytest.mark.parametrize("kw, message", [
    (dict(norm_topk_prob=False), "norm_topk_prob=False is not supported"),
    (dict(n_group=4, topk_group=2, num_experts_per_tok=2), "top-2, megalite by their top-.topk / group topk"),
])
def test_unrepresentable_glm_configs_are_refused(kw, message):
    with pytest.raises(UserError, match=message) as error:
        check_convertible(transformers.Glm4MoeConfig(**{**GLM, **kw}))
    assert "\n" not in str(error.value)
