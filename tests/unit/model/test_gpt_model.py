"""GPTModel: both styles' shapes, logits equal to transformers' Llama and GPT-2, layout-independent init."""
import pytest
import torch

from megalite_test_utils import TINY_GPT2_ARGS, TINY_LLAMA_ARGS
from megalite.train.command_line import parse_args
from megalite.model.gpt import GPTModel
from megalite.model.init import full_normal, init_std
from megalite.parallel.param_meta import mark, param_meta


def model_config(argv):
    return parse_args(argv, world_size=1).model


def param_shapes(model):
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_llama_style_parameters_and_shapes():
    cfg = model_config(TINY_LLAMA_ARGS)
    model = GPTModel(cfg)
    shapes = param_shapes(model)
    d, nq, nkv, h = 16, 4, 2, 64
    assert shapes["embedding.word_embeddings.weight"] == (256, h)
    assert "embedding.position_embeddings.weight" not in shapes           # RoPE
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == ((nq + 2 * nkv) * d, h)
    assert shapes["decoder.layers.1.mlp.linear_fc1.weight"] == (2 * 176, h)  # [gate; up]
    assert shapes["decoder.layers.1.mlp.linear_fc2.weight"] == (h, 176)
    assert shapes["output_layer.weight"] == (256, h)                      # untied
    assert not any(n.endswith(".bias") for n in shapes)                   # --disable-bias-linear, RMSNorm
    tokens = torch.randint(0, 201, (3, 32))
    assert model(tokens).shape == (3, 32, 201)                          # logits over the true vocabulary
    assert model(tokens, labels=tokens).shape == (3, 32)


def test_gpt2_style_parameters_and_shapes():
    cfg = model_config(TINY_GPT2_ARGS)
    model = GPTModel(cfg)
    shapes = param_shapes(model)
    assert shapes["embedding.position_embeddings.weight"] == (64, 64)
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == (3 * 64, 64)
    assert shapes["decoder.layers.0.self_attention.linear_qkv.bias"] == (3 * 64,)
    assert shapes["decoder.layers.0.input_layernorm.bias"] == (64,)
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (256, 64)
    assert "output_layer.weight" not in shapes                            # tied to the embedding
    assert model.output_weight() is model.embedding.word_embeddings.weight
    assert model(torch.randint(0, 201, (2, 32))).shape == (2, 32, 201)


def test_init_follows_megatron_scheme_and_is_per_name_deterministic():
    cfg = model_config(TINY_LLAMA_ARGS)
    a, b = GPTModel(cfg, seed=7), GPTModel(cfg, seed=7)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    c = GPTModel(cfg, seed=8)
    assert not torch.equal(a.decoder.layers[0].mlp.linear_fc1.weight, c.decoder.layers[0].mlp.linear_fc1.weight)
    w = a.decoder.layers[0].self_attention.linear_proj.weight
    assert abs(w.std().item() - 0.02 / (2 * cfg.num_layers) ** 0.5) < 0.003   # 1/sqrt(2L) scaled
    assert abs(a.decoder.layers[0].mlp.linear_fc1.weight.std().item() - 0.02) < 0.002
    assert torch.equal(a.decoder.layers[0].input_layernorm.weight, torch.ones(64))


def test_a_later_pipeline_stage_gets_the_same_weights_as_the_whole_model():
    """Layer i of a stage holding layers [1, 2) equals layer 1 of the full model (global names)."""
    cfg = model_config(TINY_LLAMA_ARGS)
    full = GPTModel(cfg, seed=3)
    stage = GPTModel(cfg, seed=3, pre_process=False, layer_offset=1, num_local_layers=1)
    assert stage.global_name("decoder.layers.0.mlp.linear_fc2.weight") == "decoder.layers.1.mlp.linear_fc2.weight"
    assert torch.equal(stage.decoder.layers[0].mlp.linear_fc2.weight, full.decoder.layers[1].mlp.linear_fc2.weight)
    assert torch.equal(stage.output_layer.weight, full.output_layer.weight)


def test_a_shard_equals_the_slice_of_the_full_weight():
    """The hook tensor parallelism uses: a parameter with full_shape/take_shard gets its slice."""
    from megalite.model.init import initialize_parameter
    shard = mark(torch.nn.Parameter(torch.empty(8, 16)), full_shape=(32, 16), take_shard=lambda full: full[8:16],
                 tensor_model_parallel=True, partition_dim=0)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    initialize_parameter(shard, name, 0.02, 2, seed=5)
    full = full_normal(name, (32, 16), init_std(name, 0.02, 2), 5)
    assert torch.equal(shard.data, full[8:16])


def test_initial_values_of_any_range_need_no_full_tensor():
    """Sharded start-up: any flat range of a shard is generated alone, equal to the whole shard's slice."""
    from megalite.model.init import initial_values
    cfg = model_config(TINY_LLAMA_ARGS)
    model = GPTModel(cfg, seed=5)
    meta = GPTModel(cfg, seed=5, meta=True)
    for (name, param), (_, empty) in zip(model.named_parameters(), meta.named_parameters()):
        assert empty.device.type == "meta"
        flat = param.detach().reshape(-1)
        n = flat.numel()
        for start, end in ((0, n), (n // 3, n // 2), (n - 1, n)):
            got = param_meta(empty).init_values(start, end)
            assert torch.equal(got.to(param.dtype), flat[start:end]), (name, start, end)
    values = full_normal("x", (1000, 1000), 1.0, 0)
    assert abs(values.mean().item()) < 0.005 and abs(values.std().item() - 1) < 0.005


# ---- logits against transformers ------------------------------------------------------------------
def copy_llama_weights(hf, model, nq, nkv, d, h):
    sd = hf.state_dict()
    with torch.no_grad():
        model.embedding.word_embeddings.weight[:sd["model.embed_tokens.weight"].shape[0]].copy_(sd["model.embed_tokens.weight"])
        model.output_layer.weight[:sd["lm_head.weight"].shape[0]].copy_(sd["lm_head.weight"])
        model.decoder.final_layernorm.weight.copy_(sd["model.norm.weight"])
        for i, layer in enumerate(model.decoder.layers):
            p = f"model.layers.{i}."
            q = sd[p + "self_attn.q_proj.weight"].view(nkv, nq // nkv, d, h)
            k = sd[p + "self_attn.k_proj.weight"].view(nkv, 1, d, h)
            v = sd[p + "self_attn.v_proj.weight"].view(nkv, 1, d, h)
            layer.self_attention.linear_qkv.weight.copy_(torch.cat([q, k, v], 1).reshape(-1, h))
            layer.self_attention.linear_proj.weight.copy_(sd[p + "self_attn.o_proj.weight"])
            layer.mlp.linear_fc1.weight.copy_(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
            layer.mlp.linear_fc2.weight.copy_(sd[p + "mlp.down_proj.weight"])
            layer.input_layernorm.weight.copy_(sd[p + "input_layernorm.weight"])
            layer.pre_mlp_layernorm.weight.copy_(sd[p + "post_attention_layernorm.weight"])


def test_llama_logits_equal_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=201, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                      rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=32)).eval()
    model = GPTModel(model_config(TINY_LLAMA_ARGS)).eval()
    copy_llama_weights(hf, model, nq=4, nkv=2, d=16, h=64)
    tokens = torch.randint(0, 201, (2, 32))
    with torch.no_grad():
        ours = model(tokens)[..., :201]
        theirs = hf(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def test_gpt2_logits_equal_transformers():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=201, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                    layer_norm_epsilon=1e-5, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).eval()
    model = GPTModel(model_config(TINY_GPT2_ARGS)).eval()
    sd = hf.state_dict()
    with torch.no_grad():
        model.embedding.word_embeddings.weight.zero_()
        model.embedding.word_embeddings.weight[:201].copy_(sd["transformer.wte.weight"])
        model.embedding.position_embeddings.weight.copy_(sd["transformer.wpe.weight"])
        model.decoder.final_layernorm.weight.copy_(sd["transformer.ln_f.weight"])
        model.decoder.final_layernorm.bias.copy_(sd["transformer.ln_f.bias"])
        for i, layer in enumerate(model.decoder.layers):
            p = f"transformer.h.{i}."
            for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                getattr(layer, ours).weight.copy_(sd[p + theirs + ".weight"])
                getattr(layer, ours).bias.copy_(sd[p + theirs + ".bias"])
            # Conv1D stores [in, out]; q,k,v concatenated on out. With one KV group per head, Megatron's
            # grouped layout interleaves [q_i, k_i, v_i] per head.
            w = sd[p + "attn.c_attn.weight"].t().view(3, 4, 16, 64).transpose(0, 1).reshape(-1, 64)
            b = sd[p + "attn.c_attn.bias"].view(3, 4, 16).transpose(0, 1).reshape(-1)
            layer.self_attention.linear_qkv.weight.copy_(w)
            layer.self_attention.linear_qkv.bias.copy_(b)
            layer.self_attention.linear_proj.weight.copy_(sd[p + "attn.c_proj.weight"].t())
            layer.self_attention.linear_proj.bias.copy_(sd[p + "attn.c_proj.bias"])
            layer.mlp.linear_fc1.weight.copy_(sd[p + "mlp.c_fc.weight"].t())
            layer.mlp.linear_fc1.bias.copy_(sd[p + "mlp.c_fc.bias"])
            layer.mlp.linear_fc2.weight.copy_(sd[p + "mlp.c_proj.weight"].t())
            layer.mlp.linear_fc2.bias.copy_(sd[p + "mlp.c_proj.bias"])
    tokens = torch.randint(0, 201, (2, 32))
    with torch.no_grad():
        ours = model(tokens)[..., :201]
        theirs = hf(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype_flag, dtype", [("--bf16", torch.bfloat16), ("--fp16", torch.float16)])
def test_low_precision_models_hold_low_precision_weights(dtype_flag, dtype):
    model = GPTModel(model_config(TINY_LLAMA_ARGS + [dtype_flag]))
    assert {p.dtype for p in model.parameters()} == {dtype}
    losses = model(torch.randint(0, 201, (2, 32)), labels=torch.randint(0, 201, (2, 32)))
    assert losses.dtype == torch.float32                        # the loss is computed in fp32
