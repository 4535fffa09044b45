"""Hugging Face <-> megalite conversion of the Mixture-of-Experts families (Mixtral, Qwen2-MoE, Qwen3-MoE)
and of Qwen3's QK-norm (megalite/checkpoint/hf_moe.py, hf.py, --qk-layernorm).

Tiny random fp32 models are built locally with transformers, every norm weight randomised and the
routers' weights large enough that top-2 routing differs per token. Checked: megalite's logits equal
HF's, HF -> megalite -> HF gives the same tensors and an equivalent config (sparse layer pattern
included), transformers 5's fused expert tensors convert like the per-expert files, an export to a
family that cannot hold the checkpoint is one line, and the QK-norm weights train at TP=2 (with and
without sequence parallelism) as in one process.
"""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness import run_ranks
from megalite_test_utils import ROOT, TINY_LLAMA_ARGS, with_flags
from megalite.checkpoint.files import CheckpointReader, model_config_from_metadata
from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf
from megalite.checkpoint.hf_config import EXTRA_FIELDS, default_model_type
from megalite.checkpoint.sharded import expected_full
from megalite.errors import UserError

transformers = pytest.importorskip("transformers")

VOCAB = 100
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)
QWEN_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=8)


def _mixtral():
    return transformers.MixtralForCausalLM, transformers.MixtralConfig(
        **{**SMALL, "num_hidden_layers": 2}, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
        output_router_logits=True)


def _qwen2_moe(**kw):
    return transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
        **SMALL, **QWEN_MOE, shared_expert_intermediate_size=40, **kw)


def _qwen3_moe(**kw):
    return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(**SMALL, **QWEN_MOE, **kw)


# family -> (HF model class and config, expected metadata["model"] fields)
FAMILIES = {
    "mixtral": (_mixtral, dict(num_experts=4, moe_router_topk=2, moe_layer_freq=1, moe_ffn_hidden_size=None,
                               moe_router_pre_softmax=False, moe_shared_expert_intermediate_size=None)),
    # softmax over all experts, not renormalised; gated shared expert
    "qwen2_moe": (_qwen2_moe, dict(num_experts=8, moe_layer_freq=1, moe_ffn_hidden_size=24, moe_router_pre_softmax=True,
                                   moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True,
                                   add_qkv_bias=True)),
    # a dense first layer (mlp_only_layers), renormalised top-k
    "qwen2_moe_dense_first": (lambda: _qwen2_moe(mlp_only_layers=[0], norm_topk_prob=True),
                              dict(moe_layer_freq=[0, 1, 1, 1], moe_router_pre_softmax=False)),
    "qwen3_moe": (_qwen3_moe, dict(num_experts=8, moe_layer_freq=1, qk_layernorm=True, moe_router_pre_softmax=True,
                                   add_qkv_bias=False)),
    # every second layer sparse (decoder_sparse_step=2: layers 1 and 3)
    "qwen3_moe_step2": (lambda: _qwen3_moe(decoder_sparse_step=2, norm_topk_prob=True),
                        dict(moe_layer_freq=[0, 1, 0, 1], moe_router_pre_softmax=False, qk_layernorm=True)),
    "qwen3": (lambda: (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**SMALL, head_dim=8)),
              dict(num_experts=None, qk_layernorm=True)),
}
# the HF config fields an export must reproduce (besides the shared llama-like ones)
MOE_CONFIG_FIELDS = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "norm_topk_prob", "router_aux_loss_coef",
                     "output_router_logits", "intermediate_size", "hidden_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "vocab_size", "tie_word_embeddings")


def make_hf(directory, family):
    cls, config = FAMILIES[family][0]()
    torch.manual_seed(0)
    model = cls(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:                    # norm weights around 1, biases around 0
                p.copy_((0.0 if name.endswith("bias") else 1.0) + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("gate.weight"):  # routers: clear top-k choices that differ per token
                p.copy_(torch.randn(p.shape, generator=g))
    model.save_pretrained(directory)
    return model


def load_converted(ckpt):
    """A single-process GPTModel holding the converted checkpoint (the MoE fields and QK-norm from
    metadata["model"]; stacked expert tensors [E*rows, cols] viewed as the parameter's [E, rows, cols])."""
    from megalite.model.gpt import GPTModel
    reader = CheckpointReader(ckpt)
    meta = reader.metadata["model"]
    config = model_config_from_metadata(meta, **{k: meta[k] for k in EXTRA_FIELDS})
    model = GPTModel(config)
    names = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            g = model.global_name(name)
            names.append(g)
            param.copy_(expected_full(reader, g, param, g, config.vocab_size).view_as(param))
    assert sorted(reader.names()) == sorted(names)       # every stored tensor is a parameter, and vice versa
    return model.eval()


def input_ids(batch=2, seq=16):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(7))


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module", params=list(FAMILIES))
def converted(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    hf_dir, ckpt, out = str(tmp / "hf"), str(tmp / "megalite"), str(tmp / "hf_again")
    model = make_hf(hf_dir, request.param)
    hf_to_megalite(hf_dir, ckpt)
    megalite_to_hf(ckpt, out)
    return SimpleNamespace(family=request.param, hf_dir=hf_dir, ckpt=ckpt, out=out, model=model)


def test_megalite_logits_match_transformers(converted):
    ids = input_ids()
    with torch.no_grad():
        ours = load_converted(converted.ckpt)(ids)
    theirs = hf_logits(converted.model, ids)
    assert ours.shape == theirs.shape == (2, 16, VOCAB)
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_metadata_records_the_moe_fields(converted):
    meta = CheckpointReader(converted.ckpt).metadata
    expected = FAMILIES[converted.family][1]
    assert {k: meta["model"][k] for k in expected} == expected
    assert default_model_type(meta) == converted.model.config.model_type
    if converted.family == "mixtral":          # HF's load-balancing settings travel in metadata["source"]
        assert meta["source"]["router_aux_loss_coef"] == 0.02 and meta["source"]["output_router_logits"]


def sparse_pattern(config):
    if config.model_type == "mixtral":
        return [1] * config.num_hidden_layers
    if config.model_type == "qwen3":
        return [0] * config.num_hidden_layers
    return [int(i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0)
            for i in range(config.num_hidden_layers)]


def config_fields(config):
    values = {k: getattr(config, k, None) for k in MOE_CONFIG_FIELDS}
    return {"model_type": config.model_type, "sparse": sparse_pattern(config), **values}


def test_round_trip_gives_identical_tensors_config_and_logits(converted):
    original = load_file(os.path.join(converted.hf_dir, "model.safetensors"))
    again = load_file(os.path.join(converted.out, "model.safetensors"))
    assert sorted(again) == sorted(original)
    assert [n for n in original if not torch.equal(again[n], original[n])] == []
    config = transformers.AutoConfig.from_pretrained(converted.out)
    assert config_fields(config) == config_fields(converted.model.config)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(converted.out).eval()
    assert type(reloaded) is type(converted.model)
    ids = input_ids()
    assert torch.equal(hf_logits(reloaded, ids), hf_logits(converted.model, ids))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_fused_expert_tensors_convert_like_per_expert_files(tmp_path, family):
    """transformers 5 holds experts.gate_up_proj [E, 2f, h] and experts.down_proj [E, h, f] (Mixtral under
    mlp., not block_sparse_moe.): a file saved from its state_dict converts to the same checkpoint."""
    model = make_hf(str(tmp_path / "hf"), family)
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    state = {n: t.contiguous() for n, t in model.state_dict().items()}
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in state)
    save_file(state, str(fused_dir / "model.safetensors"))
    (fused_dir / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "a"))
    hf_to_megalite(str(fused_dir), str(tmp_path / "b"))
    a, b = CheckpointReader(str(tmp_path / "a")), CheckpointReader(str(tmp_path / "b"))
    assert sorted(a.names()) == sorted(b.names())
    assert all(torch.equal(a.tensor(n), b.tensor(n)) for n in a.names())


# ---- mistakes: one line -------------------------------------------------------------------------------
def test_export_to_a_family_that_cannot_hold_the_checkpoint_is_refused(tmp_path):
    make_hf(str(tmp_path / "moe"), "qwen3_moe")
    make_hf(str(tmp_path / "dense"), "qwen3")
    hf_to_megalite(str(tmp_path / "moe"), str(tmp_path / "moe_ckpt"))
    hf_to_megalite(str(tmp_path / "dense"), str(tmp_path / "dense_ckpt"))
    cases = [("moe_ckpt", "qwen3", "qwen3 is a dense model, the checkpoint has 8 experts per MoE layer"),
             ("dense_ckpt", "qwen3_moe", "qwen3_moe is a Mixture-of-Experts model, the checkpoint a dense one"),
             ("moe_ckpt", "mixtral", "mixtral has no q/k norms"),
             ("moe_ckpt", "qwen2_moe", "qwen2_moe has no q/k norms")]
    for ckpt, model_type, message in cases:
        with pytest.raises(UserError, match=message):
            megalite_to_hf(str(tmp_path / ckpt), str(tmp_path / "out"), model_type=model_type)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--from", "megalite",
                           "--to", "hf", "--input", str(tmp_path / "moe_ckpt"), "--output", str(tmp_path / "out"),
                           "--model-type", "llama"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--model-type llama cannot represent this checkpoint" in proc.stderr
    assert not os.path.exists(tmp_path / "out")


def test_router_and_shared_expert_variants_other_families_lack_are_refused(tmp_path):
    make_hf(str(tmp_path / "hf"), "qwen2_moe_dense_first")
    ckpt = str(tmp_path / "ckpt")
    hf_to_megalite(str(tmp_path / "hf"), ckpt)
    meta_path = os.path.join(ckpt, "iter_0000000", "metadata.json")

    def edit_model(**fields):       # the checkpoint as a megalite run with these flags would describe it
        meta = json.load(open(meta_path))
        meta["model"].update(fields)
        json.dump(meta, open(meta_path, "w"))

    edit_model(add_qkv_bias=False)
    for model_type, message in (("mixtral", "mixtral has no shared expert"),
                                ("qwen3_moe", "qwen3_moe normalises q and k per head")):
        with pytest.raises(UserError, match=message):
            megalite_to_hf(ckpt, str(tmp_path / "out"), model_type=model_type)
    edit_model(qk_layernorm=True)
    with pytest.raises(UserError, match="qwen3_moe has no shared expert, the checkpoint has one"):
        megalite_to_hf(ckpt, str(tmp_path / "out"), model_type="qwen3_moe")
    edit_model(qk_layernorm=False, moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False,
               moe_router_pre_softmax=True)
    with pytest.raises(UserError, match="mixtral renormalises .* checkpoint has --moe-router-pre-softmax"):
        megalite_to_hf(ckpt, str(tmp_path / "out"), model_type="mixtral")
    edit_model(moe_router_pre_softmax=False)
    with pytest.raises(UserError, match=r"mixtral has an MoE in every layer, the checkpoint --moe-layer-freq \[0, 1"):
        megalite_to_hf(ckpt, str(tmp_path / "out"), model_type="mixtral")
    edit_model(moe_router_score_function="sigmoid")
    with pytest.raises(UserError, match="qwen2_moe routes by softmax, the checkpoint by sigmoid"):
        megalite_to_hf(ckpt, str(tmp_path / "out"), model_type="qwen2_moe")
    assert not os.path.exists(tmp_path / "out")


def test_moe_tensors_under_a_dense_description_are_refused(tmp_path):
    """A checkpoint whose metadata lost its MoE fields (saved by a megalite that did not record them)."""
    make_hf(str(tmp_path / "hf"), "mixtral")
    ckpt = str(tmp_path / "ckpt")
    hf_to_megalite(str(tmp_path / "hf"), ckpt)
    meta_path = os.path.join(ckpt, "iter_0000000", "metadata.json")
    meta = json.load(open(meta_path))
    for field in EXTRA_FIELDS:
        del meta["model"][field]
    del meta["source"]
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(UserError, match="holds MoE layers .* describes a dense model"):
        megalite_to_hf(ckpt, str(tmp_path / "out"))


def test_qwen2_moe_without_a_shared_expert_is_refused(tmp_path):
    config = transformers.Qwen2MoeConfig(**SMALL, **QWEN_MOE, shared_expert_intermediate_size=0)
    config.save_pretrained(tmp_path / "hf")
    with pytest.raises(UserError, match="shared_expert_intermediate_size=0 is not supported"):
        hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "out"))


# the run flags of the qwen3_moe / qwen3 families above, dense (no --num-experts) and MoE
DENSE_RUN = ["--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "48", "--num-attention-heads", "4",
             "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "8", "--seq-length", "16",
             "--max-position-embeddings", "64", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
             "--norm-epsilon", "1e-6", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
             "--qk-layernorm", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
             "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99",
             "--attention-dropout", "0", "--hidden-dropout", "0", "--finetune"]
MOE_RUN = DENSE_RUN + ["--num-experts", "8", "--moe-ffn-hidden-size", "24", "--moe-router-pre-softmax"]


def test_loading_a_converted_moe_model_into_a_dense_run_or_the_reverse_names_the_difference(tmp_path):
    from megalite.train.command_line import parse_args
    from megalite.train.trainer import pretrain
    for family in ("qwen3_moe", "qwen3"):
        make_hf(str(tmp_path / family), family)
        hf_to_megalite(str(tmp_path / family), str(tmp_path / f"{family}_ckpt"))
    cases = [(DENSE_RUN, "qwen3_moe", "--num-experts: 8 in the checkpoint, None in this run"),
             (MOE_RUN, "qwen3", "--num-experts: None in the checkpoint, 8 in this run")]
    for flags, family, message in cases:
        with pytest.raises(UserError) as error:
            pretrain(parse_args(flags + ["--load", str(tmp_path / f"{family}_ckpt")], world_size=1),
                     print_fn=lambda *_: None)
        assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
    state = pretrain(parse_args(MOE_RUN + ["--load", str(tmp_path / "qwen3_moe_ckpt")], world_size=1),
                     print_fn=lambda *_: None)                     # the matching flags load and train
    assert len(state.history) == 1


# ---- --qk-layernorm under tensor parallelism -------------------------------------------------------------
# adam_eps 1: updates proportional to the gradients (plain Adam would hide a gradient summed twice)
QK_ARGS = with_flags(TINY_LLAMA_ARGS, lr="0.1", adam_eps="1.0", train_iters=3) + ["--qk-layernorm"]


def _qk_training(rank, world, layouts):
    """Per layout: the losses and the final q/k norm weights of a short training run."""
    from megalite.train.command_line import parse_args
    from megalite.train.trainer import Trainer
    out = []
    for argv in layouts:
        trainer = Trainer(parse_args(argv, world_size=world), lambda *_: None)
        state = trainer.train()
        weights = {n: p.detach().clone() for n, p in trainer.chunks[0].named_parameters() if "_layernorm" in n
                   and "self_attention" in n}
        out.append((state.history, weights))
    return out


def test_qk_layernorm_trains_at_tp2_as_in_one_process():
    """Each TP rank normalises its own heads: the weights' gradients are partial per rank and must be
    summed over TP (finalize_model_grads under sequence parallelism, copy_to_tp_region without)."""
    (reference,) = _qk_training(0, 1, [QK_ARGS])
    layouts = [with_flags(QK_ARGS, tensor_model_parallel_size=2, sequence_parallel=sp) for sp in (False, True)]
    for rank_result in run_ranks(2, _qk_training, layouts):
        for losses, weights in rank_result:
            assert len(losses) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, reference[0]))
            assert weights.keys() == reference[1].keys() and len(weights) == 4
            for name, w in weights.items():
                assert not torch.equal(w, torch.ones_like(w))          # trained
                assert torch.allclose(w, reference[1][name], atol=1e-5, rtol=0), name
