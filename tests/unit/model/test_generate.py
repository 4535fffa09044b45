"""Generation with a KV cache: cached logits equal the full forward's, greedy equals transformers',
sampling is reproducible and filters as asked, and tools/generate.py works end to end."""
import os
import subprocess
import sys

import pytest
import torch

from megalite.checkpoint.files import model_metadata, write_checkpoint
from megalite.config.schema import ModelConfig
from megalite.errors import UserError
from megalite.model.generation import filter_logits, generate
from megalite.model.gpt import GPTModel
from megalite.model.attention.kv_cache import KVCache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TOOL = os.path.join(ROOT, "tools", "generate.py")
COMMON = dict(num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16, seq_length=32,
              max_position_embeddings=48, padded_vocab_size=256, vocab_size=201, attention_dropout=0.0,
              hidden_dropout=0.0, init_method_std=0.1)     # wide init: decisive argmax
STYLES = {
    "llama": ModelConfig(**COMMON, ffn_hidden_size=176, num_query_groups=2, position_embedding_type="rope",
                         normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                         untie_embeddings_and_output_weights=True),
    "gpt2": ModelConfig(**COMMON, ffn_hidden_size=256, num_query_groups=4, position_embedding_type="learned_absolute",
                        normalization="LayerNorm", openai_gelu=True, add_bias_linear=True),
}


def tiny_model(style: str, seed: int = 1) -> GPTModel:
    return GPTModel(STYLES[style], seed=seed).eval()


def greedy_by_recomputing(model, prompt: list[int], n: int) -> list[int]:
    """Reference decoding without a cache: the whole sequence through the model every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


# ---- the cache reproduces the full forward ---------------------------------------------------------
@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_cached_decoding_logits_equal_the_full_forward(style):
    model = tiny_model(style)
    torch.manual_seed(0)
    ids = torch.randint(0, 201, (2, 40))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(max_length=40)
        # prefill, one token, a chunk of several (cached keys + causal among the new), then one at a time
        steps = [model(ids[:, :9], kv_cache=cache), model(ids[:, 9:10], kv_cache=cache),
                 model(ids[:, 10:15], kv_cache=cache)]
        steps += [model(ids[:, i:i + 1], kv_cache=cache) for i in range(15, 40)]
    assert cache.length == 40
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_greedy_generation_with_the_cache_equals_recomputing(style):
    model = tiny_model(style)
    prompt = [5, 17, 99, 3, 150]
    expected = greedy_by_recomputing(model, prompt, 30)
    assert generate(model, prompt, 30, greedy=True) == expected
    assert generate(model, prompt, 30, greedy=True, use_cache=False) == expected
    assert len(set(expected)) > 3          # not a degenerate constant output


def test_the_cache_refuses_what_does_not_fit_and_tensor_parallel():
    model = tiny_model("llama")
    with pytest.raises(UserError, match="max-position-embeddings 48"):
        model(torch.zeros(1, 10, dtype=torch.long), kv_cache=KVCache(max_length=100, length=40))
    with pytest.raises(UserError, match="prompt tokens"):
        generate(model, list(range(40)), 9, greedy=True)
    assert len(generate(model, list(range(40)), 8, greedy=True)) == 8      # exactly fills the 48 positions
    model.tp.size = 2                                                       # (as a TP rank would be)
    with pytest.raises(UserError, match="tensor, context and pipeline parallel size 1"):
        generate(model, [1, 2], 2, greedy=True)


def test_eos_stops_generation_and_the_model_is_left_in_its_mode():
    model = tiny_model("gpt2").train()
    tokens = generate(model, [1, 2, 3], 20, greedy=True)
    assert model.training
    stop_at = tokens.index(tokens[4])
    assert generate(model, [1, 2, 3], 20, greedy=True, eos_id=tokens[4]) == tokens[:stop_at + 1]


# ---- sampling ------------------------------------------------------------------------------------
def test_sampling_is_reproducible_and_top_k_1_or_tiny_top_p_is_greedy():
    model = tiny_model("llama")
    prompt = [7, 8, 9]
    a = generate(model, prompt, 20, temperature=1.5, seed=3)
    assert a == generate(model, prompt, 20, temperature=1.5, seed=3)
    assert a != generate(model, prompt, 20, temperature=1.5, seed=4)
    greedy = generate(model, prompt, 20, greedy=True)
    assert a != greedy
    assert generate(model, prompt, 20, top_k=1, seed=5) == greedy
    assert generate(model, prompt, 20, top_p=1e-6, seed=5) == greedy
    assert generate(model, prompt, 20, temperature=1e-6, seed=5) == greedy    # vanishing temperature


def test_filters_keep_the_top_k_and_the_nucleus():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = probs.log()
    kept = lambda x: torch.isfinite(x).nonzero().flatten().tolist()   # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [1, 3]
    assert kept(filter_logits(logits, top_p=0.35)) == [1]              # 0.4 alone covers 0.35
    assert kept(filter_logits(logits, top_p=0.5)) == [1, 3]            # 0.4 + 0.3 >= 0.5
    assert kept(filter_logits(logits, top_p=0.86)) == [1, 2, 3, 4]     # 0.85 < 0.86: one more
    # top-p applies to the top-k renormalised: 0.4, 0.3, 0.15 -> 0.47, 0.35, 0.18
    assert kept(filter_logits(logits, top_k=3, top_p=0.8)) == [1, 3]
    assert kept(filter_logits(logits, top_k=3, top_p=0.9)) == [1, 3, 4]
    torch.testing.assert_close(filter_logits(logits, temperature=2.0), logits / 2)


@pytest.mark.parametrize("kwargs,match", [(dict(temperature=0.0), "--temperature"), (dict(top_p=0.0), "--top-p"),
                                          (dict(top_p=1.5), "--top-p"), (dict(top_k=-1), "--top-k")])
def test_bad_sampling_values_are_user_errors(kwargs, match):
    with pytest.raises(UserError, match=match):
        generate(tiny_model("gpt2"), [1], 2, **kwargs)


# ---- against transformers --------------------------------------------------------------------------
def tiny_hf_model(style: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    # no eos (Llama's default 2 is a valid id here): both sides generate exactly n tokens
    if style == "llama":
        config = LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.1,
                             bos_token_id=None, eos_token_id=None, pad_token_id=0)
        model = LlamaForCausalLM(config)
    else:
        # tied embeddings: a random model repeats its last token unless the weights are this wide
        config = GPT2Config(vocab_size=160, n_positions=64, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3,
                            bos_token_id=None, eos_token_id=None, pad_token_id=0)
        model = GPT2LMHeadModel(config)
    model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
    return model.eval()


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_greedy_generation_matches_transformers(style, tmp_path):
    hf_conversion = pytest.importorskip("megalite.checkpoint.hf")
    from megalite.checkpoint.sharded import load_model
    hf = tiny_hf_model(style)
    hf.save_pretrained(tmp_path / "hf")
    model = load_model(hf_conversion.hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "megalite")))
    prompt, n = [3, 41, 15, 92, 65, 35], 30
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    expected = out[0, len(prompt):].tolist()
    assert len(expected) == n and len(set(expected)) > 3
    assert generate(model, prompt, n, greedy=True) == expected
    with torch.no_grad():      # and the logits along the whole sequence
        torch.testing.assert_close(model(out), hf(out).logits, rtol=1e-4, atol=1e-4)


# ---- tools/generate.py ---------------------------------------------------------------------------
def save_null_tokenizer_checkpoint(model: GPTModel, root: str) -> str:
    """A checkpoint of ``model`` as training writes it: full tensors, vocabulary rows trimmed."""
    cfg = model.config
    tensors = {model.global_name(n): p.detach()[:cfg.vocab_size] if "word_embeddings" in n or "output_layer" in n
               else p.detach() for n, p in model.named_parameters()}
    tokenizer = {"tokenizer_type": "NullTokenizer", "tokenizer_model": None, "vocab_file": None, "merge_file": None,
                 "vocab_size": cfg.vocab_size - 1}
    return write_checkpoint(root, 0, {"model-00000.safetensors": tensors},
                            {"model": model_metadata(cfg), "tokenizer": tokenizer})


def run_tool(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=120)


def test_tool_generates_from_a_checkpoint_and_reports_bad_input_in_one_line(tmp_path):
    model = tiny_model("llama", seed=6)        # a seed whose greedy continuation has no eod
    root = str(tmp_path / "ckpt")
    save_null_tokenizer_checkpoint(model, root)
    expected = generate(model, [10, 20, 30], 12, greedy=True)
    assert 200 not in expected                     # the NullTokenizer's eod: no early stop
    result = run_tool("--load", root, "--prompt", "10 20 30", "--max-new-tokens", "12", "--greedy")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "10 20 30 " + " ".join(map(str, expected))

    result = run_tool("--load", root, "--prompt", "10 20 30", "--top-p", "1.5")
    assert result.returncode == 1
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("error: --top-p 1.5")

    result = run_tool("--load", str(tmp_path / "missing"), "--prompt", "1")
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "no such directory" in result.stderr
