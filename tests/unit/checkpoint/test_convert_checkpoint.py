"""Hugging Face <-> megalite conversion (megalite/checkpoint/hf.py, tools/convert_checkpoint.py).

Tiny random models are built locally with transformers for each family (Llama GQA tied, Llama MQA
untied with an explicit head_dim, Mistral, Qwen2 with q/k/v biases, GPT-2). Every bias and norm
weight is randomised (HF initialises them to 0 and 1, which would hide swapped or dropped tensors).
Checked: megalite's logits equal HF's, HF -> megalite -> HF gives the same tensors, config and logits,
tokenizers travel both ways, and user mistakes are one-line errors.
"""
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from megalite_test_utils import ROOT
from megalite.checkpoint.files import ARCHITECTURE_FIELDS, CheckpointReader, write_checkpoint
from megalite.checkpoint.sharded import load_model
from megalite.errors import UserError
from megalite.checkpoint.hf import fuse_qkv, hf_to_megalite, megalite_to_hf, split_qkv
from megalite.checkpoint.hf_config import EXTRA_FIELDS, default_model_type, extra_defaults

transformers = pytest.importorskip("transformers")

TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")
VOCAB = 100             # not a multiple of 128: megalite pads internally, stores and returns 100
TEXT = "the cat sat on the mat and a dog ran in the park"
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, initializer_range=0.1)


def llama(**kw):
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(**{**SMALL, **kw})


FAMILIES = {
    # Llama 3 style: GQA, rope_theta given the 4.x way, tied embeddings
    "llama_gqa_tied": (lambda: llama(num_key_value_heads=2, rope_theta=500000.0, tie_word_embeddings=True), True),
    # MQA, head_dim != hidden/heads, rope_parameters given the 5.x way, untied output layer
    "llama_mqa_untied": (lambda: llama(num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), False),
    "mistral": (lambda: (transformers.MistralForCausalLM, transformers.MistralConfig(
        **SMALL, num_key_value_heads=2, sliding_window=4, rope_theta=1e6)), True),
    "qwen2": (lambda: (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        **SMALL, num_key_value_heads=2, tie_word_embeddings=True)), False),
    # the first max_window_layers layers full, the window on the others
    "qwen2_window": (lambda: (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        **SMALL, num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=1)), False),
    # sinks, layers alternating window 4 / full, YaRN, attention biases, clamped quick-GEGLU experts with biases
    "gpt_oss": (lambda: (transformers.GptOssForCausalLM, transformers.GptOssConfig(
        **{**SMALL, "intermediate_size": 32}, num_key_value_heads=2, head_dim=16, sliding_window=4,
        num_local_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})), False),
    "gpt2": (lambda: (transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2)), True),
}


def randomise_biases_and_norms(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:       # biases around 0, norm weights around 1
                base = 0.0 if name.endswith("bias") else 1.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))


def save_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator([TEXT, "hello world", "the end"],
                            trainers.WordLevelTrainer(special_tokens=["<unk>", "<bos>", "<eos>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>",
                                                eos_token="<eos>")
    fast.save_pretrained(directory)


def make_hf(directory, family, dtype=torch.float32):
    build, with_tokenizer = FAMILIES[family]
    cls, config = build()
    torch.manual_seed(0)
    model = cls(config).eval()
    randomise_biases_and_norms(model)
    model = model.to(dtype)
    model.save_pretrained(directory)
    if with_tokenizer:
        save_tokenizer(directory)
    return model


def logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(ids).logits


def input_ids(batch=2, seq=16):     # longer than the windows: they cut the attention
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module", params=list(FAMILIES))
def converted(request, tmp_path_factory):
    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    hf_dir, ckpt, out = str(tmp / "hf"), str(tmp / "megalite"), str(tmp / "hf_again")
    model = make_hf(hf_dir, family)
    warnings = []
    iter_dir = hf_to_megalite(hf_dir, ckpt, log=warnings.append)
    megalite_to_hf(ckpt, out)
    return SimpleNamespace(family=family, hf_dir=hf_dir, ckpt=ckpt, iter_dir=iter_dir, out=out, model=model,
                           warnings=warnings, with_tokenizer=FAMILIES[family][1])


# ---- HF -> megalite --------------------------------------------------------------------------------
def test_megalite_logits_match_transformers(converted):
    model = load_model(converted.ckpt)
    assert not model.training
    ids = input_ids()
    ours, theirs = model(ids), logits(converted.model, ids)
    assert ours.shape == theirs.shape == (2, 16, VOCAB)
    assert (ours - theirs).abs().max().item() <= 1e-4
    # every stored tensor is a parameter of the model the metadata describes, and vice versa
    reader = CheckpointReader(converted.ckpt)
    assert sorted(reader.names()) == sorted({model.global_name(n) for n, _ in model.named_parameters()})
    assert reader.shape("embedding.word_embeddings.weight")[0] == VOCAB


def test_checkpoint_metadata(converted):
    meta = CheckpointReader(converted.ckpt).metadata
    assert converted.iter_dir == os.path.join(converted.ckpt, "iter_0000000")
    assert set(meta["model"]) == set(ARCHITECTURE_FIELDS) | set(EXTRA_FIELDS) | {"params_dtype"}
    if converted.family != "gpt_oss":
        assert {k: meta["model"][k] for k in EXTRA_FIELDS} == extra_defaults()      # dense, no QK-norm
    assert meta["model"]["params_dtype"] == "float32" and meta["model"]["vocab_size"] == VOCAB
    hf_type = converted.model.config.model_type
    assert meta["source"]["format"] == "huggingface" and meta["source"]["model_type"] == hf_type
    assert meta["source"]["architectures"] == [type(converted.model).__name__]
    expected = {"llama_gqa_tied": dict(num_query_groups=2, kv_channels=16, rotary_base=500000.0,
                                       untie_embeddings_and_output_weights=False),
                "llama_mqa_untied": dict(num_query_groups=1, kv_channels=32, norm_epsilon=1e-5,
                                         untie_embeddings_and_output_weights=True),
                "mistral": dict(num_query_groups=2, rotary_base=1e6, swiglu=True, add_qkv_bias=False,
                                window_size=[3, 0], window_attn_skip_freq=None),
                "qwen2": dict(add_qkv_bias=True, add_bias_linear=False, normalization="RMSNorm", window_size=None),
                "qwen2_window": dict(window_size=[4, 0], window_attn_skip_freq=[0, 1], softmax_type="vanilla"),
                "gpt_oss": dict(window_size=[3, 0], window_attn_skip_freq=[1, 0], softmax_type="learnable",
                                position_embedding_type="yarn", rotary_scaling_factor=4.0,
                                yarn_original_max_position_embeddings=16, yarn_correction_range_round_to_int=False,
                                add_bias_linear=True, swiglu=False, quick_geglu=True, glu_linear_offset=1.0,
                                activation_func_clamp_value=7.0, num_experts=4, moe_router_topk=2),
                "gpt2": dict(position_embedding_type="learned_absolute", normalization="LayerNorm", openai_gelu=True,
                             add_bias_linear=True, swiglu=False, ffn_hidden_size=256)}[converted.family]
    assert {k: meta["model"][k] for k in expected} == expected
    assert converted.warnings == []            # windows convert exactly, without a warning


# ---- HF -> megalite -> HF ----------------------------------------------------------------------------
CONFIG_FIELDS = {
    "llama": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
              "tie_word_embeddings", "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id", "dtype",
              "architectures", "sliding_window", "use_sliding_window", "layer_types"),
    "gpt_oss": ("num_local_experts", "num_experts_per_tok", "swiglu_limit", "swiglu_alpha", "attention_bias",
                "router_aux_loss_coef", "output_router_logits"),
    "gpt2": ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_inner", "activation_function",
             "layer_norm_epsilon", "tie_word_embeddings", "bos_token_id", "eos_token_id", "dtype", "architectures"),
}


def config_fields(config):
    fields = CONFIG_FIELDS["gpt2" if config.model_type == "gpt2" else "llama"]
    fields += CONFIG_FIELDS["gpt_oss"] if config.model_type == "gpt_oss" else ()
    values = {k: getattr(config, k, None) for k in fields}
    if "head_dim" in values and values["head_dim"] is None:       # Qwen2: implied by hidden/heads
        values["head_dim"] = config.hidden_size // config.num_attention_heads
    values["dtype"] = str(values["dtype"]).removeprefix("torch.")
    return {"model_type": config.model_type, **values}


def test_round_trip_gives_identical_tensors_config_and_logits(converted):
    original = load_file(os.path.join(converted.hf_dir, "model.safetensors"))
    again = load_file(os.path.join(converted.out, "model.safetensors"))
    assert sorted(again) == sorted(original)
    assert all(torch.equal(again[n], original[n]) for n in original), \
        [n for n in original if not torch.equal(again[n], original[n])]
    config = transformers.AutoConfig.from_pretrained(converted.out)
    assert config_fields(config) == config_fields(transformers.AutoConfig.from_pretrained(converted.hf_dir))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(converted.out).eval()
    assert type(reloaded) is type(converted.model)
    ids = input_ids()
    assert torch.equal(logits(reloaded, ids), logits(converted.model, ids))


# ---- tokenizer ------------------------------------------------------------------------------------
def test_tokenizer_is_copied_both_ways(converted):
    from megalite.data.tokenizers import HuggingFaceTokenizer
    meta = CheckpointReader(converted.ckpt).metadata
    tokenizer_dir = os.path.join(converted.iter_dir, "tokenizer")
    if not converted.with_tokenizer:
        assert meta["tokenizer"] is None and not os.path.exists(tokenizer_dir)
        assert not any(f.startswith("tokenizer") for f in os.listdir(converted.out))
        return
    assert meta["tokenizer"] == {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "tokenizer",
                                 "vocab_file": None, "merge_file": None, "vocab_size": None}
    assert sorted(os.listdir(tokenizer_dir)) == ["tokenizer.json", "tokenizer_config.json"]
    original = transformers.AutoTokenizer.from_pretrained(converted.hf_dir)
    ids = original(TEXT, add_special_tokens=False)["input_ids"]
    assert len(set(ids)) > 5
    assert HuggingFaceTokenizer(tokenizer_dir).tokenize(TEXT) == ids           # what training would use
    exported = transformers.AutoTokenizer.from_pretrained(converted.out)
    assert exported(TEXT, add_special_tokens=False)["input_ids"] == ids
    assert exported.eos_token_id == original.eos_token_id


# ---- layouts and file variants ----------------------------------------------------------------------
def test_fused_qkv_layout_is_grouped_per_kv_head():
    nq, nkv, d = 4, 2, 3
    q = torch.arange(nq * d)[:, None].float()                      # q head h holds rows 3h..3h+2
    k, v = 100 + torch.arange(nkv * d)[:, None].float(), 200 + torch.arange(nkv * d)[:, None].float()
    fused = fuse_qkv(q, k, v, nq, nkv, d)
    group0 = torch.cat([q[:2 * d], k[:d], v[:d]])                  # q heads 0,1 then k_0 then v_0
    assert torch.equal(fused[:4 * d], group0)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, nq, nkv, d), (q, k, v)))


def test_sharded_bin_and_prefixless_weights_convert_the_same(tmp_path):
    model = make_hf(str(tmp_path / "hf"), "gpt2")
    reference = load_file(os.path.join(hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "ref")),
                                       "model-00000.safetensors"))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    # a GPT-2 saved from the base model, as on the hub: no "transformer." prefix, the causal-mask buffers
    # included, as a pickle-free-to-load pytorch_model.bin
    os.makedirs(tmp_path / "bin")
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "bin")
    state = {n.removeprefix("transformer."): t for n, t in model.state_dict().items() if n != "lm_head.weight"}
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64, dtype=torch.bool))
    torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
    for variant in ("sharded", "bin"):
        iter_dir = hf_to_megalite(str(tmp_path / variant), str(tmp_path / f"out_{variant}"))
        got = load_file(os.path.join(iter_dir, "model-00000.safetensors"))
        assert sorted(got) == sorted(reference) and all(torch.equal(got[n], reference[n]) for n in reference)


def test_bf16_model_stays_bf16(tmp_path):
    make_hf(str(tmp_path / "hf"), "llama_mqa_untied", dtype=torch.bfloat16)
    ckpt = str(tmp_path / "ckpt")
    hf_to_megalite(str(tmp_path / "hf"), ckpt)
    reader = CheckpointReader(ckpt)
    assert reader.metadata["model"]["params_dtype"] == "bfloat16"
    assert reader.tensor("decoder.layers.0.mlp.linear_fc1.weight").dtype == torch.bfloat16
    ids = input_ids()
    ours = load_model(ckpt)(ids)                                  # fp32 compute on the bf16 weights
    # the reference is loaded fresh in fp32: model.float() on the bf16 module would keep its RoPE
    # inv_freq buffer rounded to bf16 (model.to(bf16) casts buffers too), off by ~2e-3 in the logits
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert (ours - logits(reference, ids)).abs().max().item() <= 1e-4
    megalite_to_hf(ckpt, str(tmp_path / "out"))
    original, again = (load_file(os.path.join(tmp_path, d, "model.safetensors")) for d in ("hf", "out"))
    assert all(again[n].dtype == torch.bfloat16 and torch.equal(again[n], original[n]) for n in original)
    assert json.load(open(tmp_path / "out" / "config.json"))["dtype"] == "bfloat16"


def test_training_checkpoint_exports_model_tensors_only(tmp_path):
    """A checkpoint as --save writes it (other file names, optimizer.* tensors, no "source"): the
    family comes from the architecture and only the weights are exported."""
    make_hf(str(tmp_path / "hf"), "llama_mqa_untied")
    reader = CheckpointReader(hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "conv")))
    weights = {n: reader.tensor(n) for n in reader.names()}
    optimizer = {f"optimizer.exp_avg.{n}": torch.zeros_like(t, dtype=torch.float32) for n, t in weights.items()}
    write_checkpoint(str(tmp_path / "train"), 20, {"model-pp000.safetensors": weights,
                                                   "optimizer-pp000.safetensors": optimizer},
                     {"model": reader.metadata["model"], "tokenizer": None, "optimizer": {"step": 20.0}})
    megalite_to_hf(str(tmp_path / "train"), str(tmp_path / "out"))
    original, again = (load_file(os.path.join(tmp_path, d, "model.safetensors")) for d in ("hf", "out"))
    assert sorted(again) == sorted(original) and all(torch.equal(again[n], original[n]) for n in original)
    assert json.load(open(tmp_path / "out" / "config.json"))["model_type"] == "llama"


def test_default_export_family_follows_source_then_architecture():
    llama_like = dict(position_embedding_type="rope", normalization="RMSNorm", add_qkv_bias=False)
    assert default_model_type({"model": llama_like}) == "llama"
    assert default_model_type({"model": {**llama_like, "add_qkv_bias": True}}) == "qwen2"
    assert default_model_type({"model": dict(llama_like, position_embedding_type="learned_absolute",
                                             normalization="LayerNorm")}) == "gpt2"
    assert default_model_type({"model": llama_like, "source": {"model_type": "mistral"}}) == "mistral"


# ---- refusals ---------------------------------------------------------------------------------------
def config_only_dir(directory, config):
    config.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}), "rope_type='llama3'"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_unsupported_llama_variants_are_refused(tmp_path, kwargs, fragment):
    hf_dir = config_only_dir(tmp_path / "hf", transformers.LlamaConfig(**SMALL, **kwargs))
    with pytest.raises(UserError, match=fragment.replace("(", r"\(")):
        hf_to_megalite(hf_dir, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_unknown_model_type_and_unknown_tensors_are_refused(tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UserError, match="model_type 'bert' is not supported"):
        hf_to_megalite(str(tmp_path / "bert"), str(tmp_path / "out"))
    model = make_hf(str(tmp_path / "hf"), "qwen2")
    state = {n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    state["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    from safetensors.torch import save_file
    save_file(state, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(UserError, match="does not know .*o_proj.bias"):
        hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "out"))


def test_export_refuses_families_that_cannot_represent_the_model(tmp_path):
    make_hf(str(tmp_path / "hf"), "qwen2")
    ckpt = str(tmp_path / "ckpt")
    hf_to_megalite(str(tmp_path / "hf"), ckpt)
    with pytest.raises(UserError, match="--model-type llama cannot represent .*add_qkv_bias"):
        megalite_to_hf(ckpt, str(tmp_path / "out"), model_type="llama")
    with pytest.raises(UserError, match="--model-type gpt2 cannot represent .*learned absolute"):
        megalite_to_hf(ckpt, str(tmp_path / "out"), model_type="gpt2")
    with pytest.raises(UserError, match="--model-type bert is not supported"):
        megalite_to_hf(ckpt, str(tmp_path / "out"), model_type="bert")
    assert not os.path.exists(tmp_path / "out")


def test_existing_output_needs_overwrite(tmp_path):
    make_hf(str(tmp_path / "hf"), "gpt2")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    hf_to_megalite(str(tmp_path / "hf"), ckpt)
    with pytest.raises(UserError, match="already holds a megalite checkpoint; pass --overwrite"):
        hf_to_megalite(str(tmp_path / "hf"), ckpt)
    hf_to_megalite(str(tmp_path / "hf"), ckpt, overwrite=True)
    megalite_to_hf(ckpt, out)
    with pytest.raises(UserError, match="already holds a Hugging Face model; pass --overwrite"):
        megalite_to_hf(ckpt, out)
    (tmp_path / "out" / "model-00001-of-00002.safetensors").write_text("stale shard")
    megalite_to_hf(ckpt, out, overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


# ---- the command line ---------------------------------------------------------------------------------
def run_tool(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=300)


def load_tool():
    """tools/convert_checkpoint.py as a module (its main(argv) is what the command line runs)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("convert_checkpoint_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tool_here(capfd, *args):
    """The tool's main(argv) in this process, saving a process start: (exit code, stdout, stderr). A warning
    a user would see on stderr (Python's default filters show all but the deprecation kinds) counts."""
    import warnings
    tool = load_tool()
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        returncode = tool.main(list(args))
    out = capfd.readouterr()
    shown = [f"{w.category.__name__}: {w.message}" for w in caught
             if not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                                            ResourceWarning))]
    return returncode, out.out, out.err + "".join(line + "\n" for line in shown)


def test_cli_converts_both_ways(tmp_path, capfd):
    model = make_hf(str(tmp_path / "hf"), "mistral")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    result = run_tool("--from", "hf", "--to", "megalite", "--input", str(tmp_path / "hf"), "--output", ckpt)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""                  # the window converts: nothing to warn about
    assert os.path.join(ckpt, "iter_0000000") in result.stdout
    # the export's refusal and the export itself through the same main(argv), in this process
    returncode, _, err = run_tool_here(capfd, "--from", "megalite", "--to", "hf", "--input", ckpt, "--output", out,
                                       "--model-type", "llama")
    assert returncode == 1 and len(err.splitlines()) == 1, err
    assert "--model-type llama cannot represent this checkpoint: llama has no sliding window" in err
    returncode, stdout, err = run_tool_here(capfd, "--from", "megalite", "--to", "hf", "--input", ckpt, "--output", out)
    assert returncode == 0 and err == "", err
    assert stdout.startswith(" > converted megalite"), stdout
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == "MistralForCausalLM" and exported.config.sliding_window == 4
    ids = input_ids()
    assert (logits(exported, ids) - logits(model, ids)).abs().max().item() <= 1e-5


def test_cli_mistakes_exit_1_with_one_line(tmp_path, capfd):
    make_hf(str(tmp_path / "hf"), "gpt2")
    hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    rope = config_only_dir(tmp_path / "rope", transformers.LlamaConfig(
        **SMALL, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}))
    (tmp_path / "empty").mkdir()
    cases = [
        (["--from", "hf", "--to", "megalite", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "x")],
         "no such directory"),
        (["--from", "hf", "--to", "megalite", "--input", str(tmp_path / "empty"), "--output", str(tmp_path / "x")],
         "not a Hugging Face model directory (no config.json"),
        (["--from", "hf", "--to", "megalite", "--input", rope, "--output", str(tmp_path / "x")],
         "rope_type='linear' is not supported"),
        (["--from", "hf", "--to", "megalite", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt")],
         "already holds a megalite checkpoint; pass --overwrite"),
        (["--from", "megalite", "--to", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "x")],
         "is it a megalite checkpoint directory"),
    ]
    # the first mistake through the real command line (a process of its own); the others through the same
    # entry point in this process (main(argv): its exit code and its stderr), which saves a process each
    for i, (argv, fragment) in enumerate(cases):
        if i == 0:
            result = run_tool(*argv)
            returncode, err = result.returncode, result.stderr.strip()
        else:
            returncode, stdout, err = run_tool_here(capfd, *argv)
            err = err.strip()
            assert stdout == "", stdout
        assert returncode == 1, (argv, err)
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith("error: ") and fragment in err, err
    assert not os.path.exists(tmp_path / "x")
