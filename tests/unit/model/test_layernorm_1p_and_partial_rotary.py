"""--apply-layernorm-1p and --rotary-percent: logits equal transformers' after conversion both ways; the
one-line mistakes of --rotary-percent."""

import copy

import pytest
import torch

from megalite.train.command_line import parse_args
from megalite.errors import UserError
from megalite_test_utils import TINY_LLAMA_ARGS, masked_micro_batches, run_pretrain, with_flags

transformers = pytest.importorskip("transformers")


def test_zero_centred_norms_scale_by_weight_plus_one():
    from megalite.model.norms import LayerNorm, RMSNorm
    x = torch.randn(5, 2, 16)
    w = torch.randn(16)
    for cls in (RMSNorm, LayerNorm):
        plain, one_p = cls(16, 1e-5, torch.float32), cls(16, 1e-5, torch.float32, zero_centered=True)
        assert torch.equal(one_p.weight, torch.zeros(16))
        with torch.no_grad():
            plain.weight.copy_(w + 1)
            one_p.weight.copy_(w)
        for p in (plain, one_p):
            p.requires_grad_(True)
        torch.testing.assert_close(one_p(x), plain(x))
        one_p(x).sum().backward()
        plain(x).sum().backward()
        torch.testing.assert_close(one_p.weight.grad, plain.weight.grad)
    # a whole model: the 1p norms start at 0 and compute as the plain model's 1s
    from megalite.model.gpt import GPTModel
    b = masked_micro_batches()[0]
    logits = []
    for one_p in (False, True):
        model = GPTModel(parse_args(with_flags(TINY_LLAMA_ARGS, apply_layernorm_1p=one_p), world_size=1).model, seed=2)
        norms = [p for n, p in model.named_parameters() if "layernorm.weight" in n]
        assert all(torch.all(p == (0.0 if one_p else 1.0)) for p in norms)
        logits.append(model(b["tokens"], b["position_ids"]))
    torch.testing.assert_close(logits[1], logits[0])


def _hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(ids).logits


def _randomise_norms(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((0.0 if name.endswith("bias") else 1.0) + 0.3 * torch.randn(p.shape, generator=g))


def _as_layernorm_1p(ckpt: str, out: str) -> None:
    """A copy of a megalite checkpoint stored the --apply-layernorm-1p way: norm weights - 1, flag set."""
    from megalite.checkpoint.files import CheckpointReader, write_checkpoint
    reader = CheckpointReader(ckpt)
    tensors = {n: reader.tensor(n) for n in reader.names()}
    for name in tensors:
        if "layernorm.weight" in name:
            tensors[name] = tensors[name] - 1.0
    meta = copy.deepcopy(reader.metadata)
    meta["model"]["apply_layernorm_1p"] = True
    meta.pop("tensors")
    write_checkpoint(out, 0, {"model-00000.safetensors": tensors}, meta)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_layernorm_1p_logits_match_transformers_and_export_folds_the_one(tmp_path, family):
    """An HF model whose norms megalite stores zero-centred (--apply-layernorm-1p) gives HF's logits, and
    exports (folding + 1 back into the weights) to the same HF model, tensor for tensor."""
    from safetensors.torch import load_file
    from megalite.checkpoint.sharded import load_model
    from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf
    if family == "llama":
        cls, config = transformers.LlamaForCausalLM, transformers.LlamaConfig(
            vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    else:
        cls, config = transformers.GPT2LMHeadModel, transformers.GPT2Config(
            vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    hf = cls(config).eval()
    _randomise_norms(hf)
    hf.save_pretrained(tmp_path / "hf")
    hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "plain"))
    _as_layernorm_1p(str(tmp_path / "plain"), str(tmp_path / "one_p"))
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))

    model = load_model(str(tmp_path / "one_p"))
    assert model.config.apply_layernorm_1p
    torch.testing.assert_close(model(ids), _hf_logits(hf, ids), rtol=1e-4, atol=1e-4)
    megalite_to_hf(str(tmp_path / "one_p"), str(tmp_path / "hf_out"))
    exported = load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for name in original:
        if name in exported and ("norm" in name or ".ln_" in name):
            torch.testing.assert_close(exported[name], original[name], rtol=0, atol=1e-6, msg=name)
    again = cls.from_pretrained(str(tmp_path / "hf_out")).eval()
    torch.testing.assert_close(_hf_logits(again, ids), _hf_logits(hf, ids), rtol=1e-4, atol=1e-4)


PHI3 = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)


def test_partial_rotary_logits_match_transformers_both_ways(tmp_path):
    """--rotary-percent 0.5 is Phi-3's partial_rotary_factor 0.5 (transformers' Llama ignores the factor):
    HF -> megalite gives HF's logits with rotary_percent 0.5, and megalite -> HF gives back the model."""
    from megalite.checkpoint.sharded import load_model
    from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(**PHI3, partial_rotary_factor=0.5)).eval()
    _randomise_norms(hf)
    hf.save_pretrained(tmp_path / "hf")
    hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    model = load_model(str(tmp_path / "ckpt"))
    assert model.config.rotary_percent == 0.5
    torch.testing.assert_close(model(ids), _hf_logits(hf, ids), rtol=1e-4, atol=1e-4)

    # the factor matters: the same weights with full rotary give other logits
    full = transformers.Phi3ForCausalLM(transformers.Phi3Config(**PHI3, partial_rotary_factor=1.0)).eval()
    full.load_state_dict(hf.state_dict())
    assert (_hf_logits(full, ids) - _hf_logits(hf, ids)).abs().max() > 1e-3

    megalite_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf_out"))          # default family: phi3
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_out")).eval()
    assert again.config.model_type == "phi3" and again.config.rope_parameters["partial_rotary_factor"] == 0.5
    torch.testing.assert_close(_hf_logits(again, ids), _hf_logits(hf, ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(UserError, match="use --model-type phi3"):
        megalite_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "as_llama"), model_type="llama")


def test_trained_partial_rotary_model_exports_to_phi3_with_its_logits(tmp_path):
    """A model trained by pretrain_gpt.py with --rotary-percent 0.5 --apply-layernorm-1p exports to an HF
    Phi-3 whose logits are megalite's."""
    from megalite.checkpoint.sharded import load_model
    from megalite.checkpoint.hf import megalite_to_hf
    ckpt = str(tmp_path / "ckpt")
    run_pretrain(with_flags(TINY_LLAMA_ARGS, rotary_percent=0.5, apply_layernorm_1p=True, train_iters=3, save=ckpt))
    megalite_to_hf(ckpt, str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(1))
    ours = load_model(ckpt)(ids)
    torch.testing.assert_close(_hf_logits(hf, ids), ours, rtol=1e-4, atol=1e-4)


def test_partial_rotary_rotates_only_the_leading_dimensions():
    from megalite.model.attention.rotary import RotaryEmbedding
    from megalite.model.kernels import apply_rotary
    x = torch.randn(10, 1, 2, 16)
    half = RotaryEmbedding(16, 10000.0, 10, rotary_percent=0.5)
    whole8 = RotaryEmbedding(8, 10000.0, 10)                   # RoPE over 8 dimensions
    out = apply_rotary(x, *half.tables(None, 10, x.dtype))
    assert torch.equal(out[..., 8:], x[..., 8:])
    torch.testing.assert_close(out[..., :8], apply_rotary(x[..., :8], *whole8.tables(None, 10, x.dtype)))


@pytest.mark.parametrize("percent, extra, fragment", [
    ("0", {}, "--rotary-percent must be in (0, 1]"),
    ("1.5", {}, "--rotary-percent must be in (0, 1]"),
    ("0.2", {}, "rotates 3 of the head's 16 dimensions"),          # int(16 * 0.2): odd
    ("0.5", {"position_embedding_type": "learned_absolute"}, "needs --position-embedding-type rope"),
])
def test_rotary_percent_mistakes(percent, extra, fragment):
    argv = with_flags(TINY_LLAMA_ARGS, rotary_percent=percent, **extra)
    with pytest.raises(UserError, match=fragment.replace("(", r"\(").replace("]", r"\]")):
        parse_args(argv, world_size=1)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)])
def test_rotary_function_equals_the_plain_ops_and_saves_only_the_tables(dtype, tolerance):
    """The eager RoPE writes each half once (two products, rounded once in low precision, where the plain
    ops round three times); its backward is the transposed rotation and autograd keeps only cos and sin."""
    from megalite.model.attention.rotary import RotaryEmbedding
    from megalite.model.kernels import apply_rotary
    cos, sin = RotaryEmbedding(16, 10000.0, 12).tables(None, 12, dtype)
    x = torch.randn(12, 2, 3, 16, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    plain_x = x.detach().clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = apply_rotary(x, cos, sin)
    plain = plain_x * cos + torch.cat([-plain_x[..., 8:], plain_x[..., :8]], dim=-1) * sin
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(grad)
    plain.backward(grad)
    torch.testing.assert_close(out, plain, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(x.grad, plain_x.grad, rtol=tolerance, atol=tolerance)
    assert len(saved) == 2 and saved[0] is cos and saved[1] is sin
