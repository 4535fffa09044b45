"""The DeepSeek-V3 family both ways. GLM-4.5 (Glm4MoeForCausalLM): a tiny random model with partial rotary,
q/k/v biases, QK-norm, a dense first layer, sigmoid routing with an expert bias, a shared expert and a
routing scale. DeepSeek-V3 (DeepseekV3ForCausalLM): q-LoRA multi-latent attention with interleaved RoPE rows
and YaRN (mscale), group-limited routing, a shared expert, a dense first layer and an MTP layer; and
DeepSeek-V2-Lite's form (a full query projection, plain RoPE). megalite's logits equal transformers', HF ->
megalite -> HF gives the same tensors (MTP layers included), an FP8 block-scaled checkpoint imports as its
dequantised twin, and the converted DeepSeek-V3 trains on through pretrain_gpt.py with its MTP loss."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megalite.checkpoint.files import CheckpointReader
from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf
from megalite.checkpoint.hf_config import check_convertible
from megalite.checkpoint.hf_fp8 import (DEFAULT_BLOCK, FP8_DTYPES, SCALE_SUFFIX, dequantize, quantization_config,
                                        quantize_checkpoint, scale_name)
from megalite.checkpoint.sharded import load_model
from megalite.errors import UserError
from unit.checkpoint.test_convert_checkpoint import input_ids, logits, randomise_biases_and_norms

transformers = pytest.importorskip("transformers")

LAYERS = 3                  # the main model's; an MTP layer is stored as layer LAYERS
GLM = dict(vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, n_routed_experts=8,
           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
           n_group=1, topk_group=1, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
           initializer_range=0.1, tie_word_embeddings=False)


def make_glm(directory, mtp: bool = False):
    return make_model(directory, transformers.Glm4MoeConfig, {**GLM, "num_nextn_predict_layers": int(mtp)}, mtp)


@pytest.mark.parametrize("mtp", [False, True])
def test_glm4_moe_logits_match_and_round_trip(tmp_path, mtp):
    hf_dir = str(tmp_path / "hf")
    model = make_glm(hf_dir, mtp)
    reader = assert_logits_match_and_round_trip(hf_dir, tmp_path, model)
    m = reader.metadata["model"]
    assert {k: m[k] for k in ("num_experts", "moe_layer_freq", "moe_shared_expert_intermediate_size",
                              "moe_router_score_function", "moe_router_enable_expert_bias",
                              "moe_router_topk_scaling_factor", "rotary_percent", "qk_layernorm", "add_qkv_bias",
                              "mtp_num_layers")} \
        == dict(num_experts=8, moe_layer_freq=[0, 1, 1], moe_shared_expert_intermediate_size=32,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=2.5, rotary_percent=0.5, qk_layernorm=True, add_qkv_bias=True,
                mtp_num_layers=1 if mtp else None)
    assert torch.equal(load_model(reader.directory).decoder.layers[1].mlp.router.expert_bias,
                       torch.linspace(-0.3, 0.3, 8))       # a persistent buffer, loaded with the parameters


@pytest.mark.parametrize("kw, message", [
    (dict(norm_topk_prob=False), "norm_topk_prob=False is not supported"),
    (dict(n_group=4, topk_group=2, num_experts_per_tok=2), "top-2, megalite by their top-.topk / group topk"),
])
def test_unrepresentable_glm_configs_are_refused(kw, message):
    with pytest.raises(UserError, match=message) as error:
        check_convertible(transformers.Glm4MoeConfig(**{**GLM, **kw}))
    assert "\n" not in str(error.value)


# ---- DeepSeek-V3 and DeepSeek-V2-Lite's form ----------------------------------------------------------------
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
V3 = dict(vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=LAYERS,
          num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
          qk_rope_head_dim=6, v_head_dim=10, max_position_embeddings=64, n_routed_experts=8, num_experts_per_tok=4,
          n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
          rope_parameters=YARN, rope_interleave=True, rms_norm_eps=1e-6, initializer_range=0.1,
          tie_word_embeddings=False)
V2_LITE = {**V3, "q_lora_rank": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
           "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2}


def make_deepseek(directory, mtp: bool, **kw):
    return make_model(directory, transformers.DeepseekV3Config, {**V3, **kw}, mtp)


def make_model(directory, config_class, fields: dict, mtp: bool):
    """A random model of ``config_class`` saved with, when ``mtp``, the MTP module as layer LAYERS, as
    DeepSeek-V3 and GLM-4.5 ship it: a decoder layer plus enorm, hnorm, eh_proj, shared_head.norm and copies
    of the embedding and output head. Returns transformers' model loaded from it (without the MTP layer)."""
    torch.manual_seed(0)
    config = config_class(**{**fields, "num_hidden_layers": LAYERS + mtp})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomise_biases_and_norms(model)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers[1:]):      # a bias that changes which experts are picked
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8).roll(i))
    model.save_pretrained(directory)
    if mtp:
        path = os.path.join(directory, "model.safetensors")
        tensors, g, h = load_file(path), torch.Generator().manual_seed(3), fields["hidden_size"]
        hf = f"model.layers.{LAYERS}."
        tensors.update({hf + "enorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                        hf + "hnorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                        hf + "shared_head.norm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                        hf + "eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=g),
                        hf + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                        hf + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
        save_file(tensors, path, metadata={"format": "pt"})
        config.num_hidden_layers, config.num_nextn_predict_layers = LAYERS, 1
        config.save_pretrained(directory)
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()     # ignores the MTP layer


def assert_logits_match_and_round_trip(hf_dir, tmp_path, model):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    hf_to_megalite(hf_dir, ckpt)
    ours, ids = load_model(ckpt), input_ids()
    assert (ours(ids) - logits(model, ids)).abs().max().item() <= 1e-4
    megalite_to_hf(ckpt, out)
    original, again = (load_file(os.path.join(d, "model.safetensors")) for d in (hf_dir, out))
    assert sorted(again) == sorted(original) and all(torch.equal(again[n], original[n]) for n in original)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(model) and torch.equal(logits(reloaded, ids), logits(model, ids))
    return CheckpointReader(ckpt)


def test_deepseek_v3_with_mtp_logits_match_and_round_trip(tmp_path):
    hf_dir = str(tmp_path / "hf")
    model = make_deepseek(hf_dir, mtp=True)
    reader = assert_logits_match_and_round_trip(hf_dir, tmp_path, model)
    m = reader.metadata["model"]
    assert {k: m[k] for k in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                              "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale",
                              "mscale_all_dim", "mtp_num_layers", "moe_router_num_groups", "moe_router_group_topk",
                              "moe_layer_freq", "qk_layernorm")} == dict(
        multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=6,
        v_head_dim=10, rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0, mtp_num_layers=1,
        moe_router_num_groups=4, moe_router_group_topk=2, moe_layer_freq=[0, 1, 1], qk_layernorm=True)
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert torch.equal(reader.tensor("mtp.layers.0.eh_proj.weight"), hf[f"model.layers.{LAYERS}.eh_proj.weight"])
    assert torch.equal(reader.tensor("mtp.layers.0.transformer_layer.mlp.router.expert_bias"),
                       hf[f"model.layers.{LAYERS}.mlp.gate.e_score_correction_bias"])
    # megalite's q RoPE rows are the even ones of each head's interleaved pairs, then the odd ones
    q_up, hf_q = reader.tensor("decoder.layers.0.self_attention.linear_q_up_proj.weight"), hf[
        "model.layers.0.self_attn.q_b_proj.weight"]
    assert torch.equal(q_up[8:14], torch.cat([hf_q[8:14:2], hf_q[9:14:2]]))


def test_deepseek_v2_lite_form_logits_match_and_round_trip(tmp_path):
    hf_dir = str(tmp_path / "hf")
    model = make_deepseek(hf_dir, mtp=False, **V2_LITE)
    m = assert_logits_match_and_round_trip(hf_dir, tmp_path, model).metadata["model"]
    assert (m["q_lora_rank"], m["rope_type"], m["mtp_num_layers"], m["moe_router_num_groups"]) == (None, "rope", None,
                                                                                                    None)


def test_fp8_block_scaled_deepseek_v3_imports_as_its_dequantised_twin(tmp_path):
    hf_dir, fp8_dir, twin_dir = (str(tmp_path / n) for n in ("hf", "fp8", "twin"))
    make_deepseek(hf_dir, mtp=True)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    quantised = quantize_checkpoint(tensors)
    assert quantised["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].dtype == torch.float8_e4m3fn
    assert quantised[f"model.layers.{LAYERS}.mlp.experts.0.up_proj.weight"].dtype == torch.float8_e4m3fn
    twin = {n: dequantize(t, quantised[scale_name(n)], DEFAULT_BLOCK, n, torch.float32) if t.dtype in FP8_DTYPES
            else t for n, t in quantised.items() if not n.endswith(SCALE_SUFFIX)}
    for directory, weights, quantization in ((fp8_dir, quantised, quantization_config()), (twin_dir, twin, None)):
        os.makedirs(directory)
        save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        config = transformers.AutoConfig.from_pretrained(hf_dir)
        if quantization:
            config.quantization_config = quantization
        config.save_pretrained(directory)
    fp8_ckpt, twin_ckpt = hf_to_megalite(fp8_dir, str(tmp_path / "a")), hf_to_megalite(twin_dir, str(tmp_path / "b"))
    ids = input_ids()
    assert (load_model(fp8_ckpt)(ids) - load_model(twin_ckpt)(ids)).abs().max().item() <= 1e-4
    fp8, twin_reader = CheckpointReader(fp8_ckpt), CheckpointReader(twin_ckpt)
    assert all(torch.equal(fp8.tensor(n), twin_reader.tensor(n)) for n in twin_reader.names())


def test_converted_deepseek_v3_trains_on_with_its_mtp_loss(tmp_path, capsys):
    from e2e.test_continue_pretraining import TRAIN_FLAGS, first_batch
    from megalite.train.entry import main
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    model = make_deepseek(hf_dir, mtp=True)
    hf_to_megalite(hf_dir, ckpt)
    argv = TRAIN_FLAGS + ["--load", ckpt, "--train-iters", "2", "--tokenizer-type", "NullTokenizer",
                          "--vocab-size", "99"]
    capsys.readouterr()
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "lm loss:" in line]
    assert len(lines) == 2 and all("mtp_1 loss:" in line for line in lines)
    # iteration 1's loss comes before any update: transformers' on that batch (MLA, YaRN, the expert biases)
    samples = first_batch(argv)
    tokens, labels = (torch.stack([torch.as_tensor(s[k]) for s in samples]).long() for k in ("tokens", "labels"))
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(tokens).logits.flatten(0, 1), labels.flatten()).item()
    first = float(lines[0].split("lm loss:")[1].split("|")[0])
    assert abs(first - expected) <= 1e-5 * expected, (first, expected)


@pytest.mark.parametrize("kw, message", [
    (dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05 is not supported: transformers normalises the q/kv latents"),
    (dict(rope_parameters={**YARN, "mscale": 0.0}), "give both or neither"),
    (dict(num_key_value_heads=2), "every MLA head has its own keys and values"),
    (dict(num_experts_per_tok=2), "must agree .num_experts_per_tok = 2 x topk_group"),
])
def test_unrepresentable_deepseek_configs_are_refused(kw, message):
    with pytest.raises(UserError, match=message) as error:
        check_convertible(transformers.DeepseekV3Config(**{**V3, **kw}))
    assert "\n" not in str(error.value)


def test_mtp_copies_that_differ_from_the_main_model_and_unexportable_norms_are_refused(tmp_path):
    hf_dir = str(tmp_path / "hf")
    make_deepseek(hf_dir, mtp=True)
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    name = f"model.layers.{LAYERS}.shared_head.head.weight"
    tensors[name] = tensors[name] + 1
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(UserError, match=f"{name} differs from lm_head.weight; megalite's multi-token prediction"):
        hf_to_megalite(hf_dir, str(tmp_path / "ckpt"))
    assert not os.path.exists(tmp_path / "ckpt")

    make_deepseek(str(tmp_path / "lite"), mtp=False, **V2_LITE)
    ckpt = hf_to_megalite(str(tmp_path / "lite"), str(tmp_path / "lite_ckpt"))
    meta = json.load(open(os.path.join(ckpt, "metadata.json")))
    meta["model"]["norm_epsilon"] = 1e-5
    json.dump(meta, open(os.path.join(ckpt, "metadata.json"), "w"))
    with pytest.raises(UserError, match="deepseek_v3 normalises the q/kv latents .--qk-layernorm. with eps 1e-06"):
        megalite_to_hf(ckpt, str(tmp_path / "out"))
