"""Multi-token prediction (--mtp-num-layers): the depths' shifted inputs and targets against a per-position
loop, with and without documents; the whole block's loss value and gradients against a straightforward fp64
re-implementation written here; its ZeRO-3 units; MoE depths; and its bad input."""
import pytest
import torch
import torch.nn.functional as F

from megalite.errors import UserError
from megalite.model.attention.inputs import AttentionInputs
from megalite.model.gpt import GPTModel
from megalite.model.moe import MoELayer
from megalite.model.mtp import mtp_targets
from megalite.parallel.pipeline.stages import forward_step
from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

DEPTH, SCALE = 2, 0.3


def random_batch(b=2, s=32, vocab=200, seed=0, documents=None):
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab, (b, s + 1), generator=g)
    batch = {"tokens": stream[:, :-1], "labels": stream[:, 1:], "loss_mask": (torch.rand(b, s, generator=g) > 0.2).float(),
             "position_ids": torch.arange(s).expand(b, s)}
    if documents is not None:          # per sample: the starts of its documents, padded with s
        cu = torch.full((b, s + 1), s, dtype=torch.int32)
        for i, starts in enumerate(documents):
            cu[i, :len(starts)] = torch.tensor(starts, dtype=torch.int32)
        batch["cu_seqlens"] = cu
    return batch


def loop_targets(batch, depth):
    """Per position: depth k at t reads token t+k+1 and predicts label t+k+1 when that position is in the
    sample and (with documents) in t's document."""
    tokens, labels, mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    b, s = tokens.shape
    stream = torch.cat([tokens, labels[:, -1:]], 1)
    out = {key: torch.zeros(b, s, depth) for key in ("mtp_tokens", "mtp_labels", "mtp_loss_mask")}
    for i in range(b):
        doc = torch.zeros(s, dtype=torch.long)
        if "cu_seqlens" in batch:
            for start in batch["cu_seqlens"][i].tolist():
                if start < s:
                    doc[start:] += 1
        for k in range(depth):
            for t in range(s):
                j = t + k + 1
                out["mtp_tokens"][i, t, k] = stream[i, j] if j <= s else stream[i, s]
                if j < s and doc[j] == doc[t]:
                    out["mtp_labels"][i, t, k] = labels[i, j]
                    out["mtp_loss_mask"][i, t, k] = mask[i, j]
    return out


@pytest.mark.parametrize("documents", [None, [[0, 5, 6, 20], [0, 31]]])
def test_targets_shift_within_the_sample_and_its_documents(documents):
    batch = random_batch(documents=documents)
    got, expected = mtp_targets(batch, 3), loop_targets(batch, 3)
    assert torch.equal(got["mtp_loss_mask"], expected["mtp_loss_mask"])
    assert torch.equal(got["mtp_tokens"].float(), expected["mtp_tokens"])
    kept = expected["mtp_loss_mask"] > 0
    assert torch.equal(got["mtp_labels"].float()[kept], expected["mtp_labels"][kept])
    assert got["mtp_loss_mask"][:, -3:, 2].sum() == 0                # no token k+2 ahead at the end
    if documents is not None:      # a one-token document (position 5) has no target at any depth
        assert got["mtp_loss_mask"][0, 5].sum() == 0 and got["mtp_loss_mask"][0, 4, 0] == 0


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_objective(model, batch):
    """lm_loss + SCALE * mean_k(loss_k) and the MTP losses, written out from the model's weights (its
    decoder and the depths' transformer layers used as black boxes)."""
    cfg, eps = model.config, model.config.norm_epsilon
    tokens, labels, mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    b, s = tokens.shape
    embedding, head = model.embedding.word_embeddings.weight, model.output_layer.weight

    def loss(h, targets, m):
        logits = (h @ head.t())[..., :cfg.vocab_size].transpose(0, 1)            # [b, s, V]
        per_token = F.cross_entropy(logits.reshape(b * s, -1), targets.reshape(-1), reduction="none")
        return (per_token.view(b, s) * m).sum() / m.sum()

    x = embedding[tokens].transpose(0, 1)
    inputs = AttentionInputs(model.rotary_tables(x, None, None, None), None)
    h = model.run_layers(x, inputs)
    lm = loss(rms(h, model.decoder.final_layernorm.weight, eps), labels, mask)
    stream = torch.cat([tokens, labels[:, -1:]], 1)
    mtp = []
    for k, depth in enumerate(model.mtp.layers):
        ahead = torch.stack([stream[:, min(t + k + 1, s)] for t in range(s)], 1)
        targets = torch.stack([labels[:, min(t + k + 1, s - 1)] for t in range(s)], 1)
        m = torch.stack([mask[:, t + k + 1] if t + k + 1 < s else torch.zeros(b, dtype=mask.dtype)
                         for t in range(s)], 1)
        e = rms(embedding[ahead].transpose(0, 1), depth.enorm.weight, eps)
        h = torch.cat([e, rms(h, depth.hnorm.weight, eps)], -1) @ depth.eh_proj.weight.t()
        h = depth.transformer_layer(h, inputs)
        mtp.append(loss(rms(h, depth.final_layernorm.weight, eps), targets, m))
    mtp = torch.stack(mtp)
    return lm, lm + SCALE * mtp.mean(), mtp


def test_block_equals_a_straightforward_fp64_reimplementation():
    cfg = parse_args(with_flags(TINY_LLAMA_ARGS, mtp_num_layers=DEPTH, mtp_loss_scaling_factor=SCALE),
                     world_size=1).model
    model = GPTModel(cfg, seed=3).double().train()
    names = [n for n, _ in model.named_parameters()]
    assert {f"mtp.layers.{k}.{p}.weight" for k in range(DEPTH) for p in ("enorm", "hnorm", "eh_proj", "final_layernorm")
            } <= set(names)
    assert dict(model.named_parameters())["mtp.layers.0.eh_proj.weight"].shape == (64, 128)
    assert [d.transformer_layer.layer_number for d in model.mtp.layers] == [3, 4]
    batch = random_batch()
    loss, _ = forward_step(model, batch, torch.device("cpu"))
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    sums = model.mtp.take_loss_sums()
    model.zero_grad()
    lm, objective, mtp = reference_objective(model, {k: v for k, v in batch.items()})
    objective.backward()
    # the model's cross-entropy runs in fp32 (its logits upcast), the rest in fp64
    assert float(loss.detach()) == pytest.approx(float(lm.detach()), rel=1e-6)     # the reported loss is the lm loss
    assert torch.allclose(sums[:-1], mtp.detach(), rtol=1e-6) and sums[-1] == 1
    for name, param in model.named_parameters():
        assert torch.allclose(got[name], param.grad, rtol=1e-5, atol=1e-9), name
    assert got["mtp.layers.1.eh_proj.weight"].abs().sum() > 0


def test_depths_are_zero3_units_reading_the_embedding():
    cfg = parse_args(with_flags(TINY_LLAMA_ARGS, mtp_num_layers=DEPTH), world_size=1).model
    model = GPTModel(cfg)
    units = model.data_parallel_units()
    assert [u.name for u in units] == ["embedding", "layer0", "layer1", "mtp0", "mtp1", "head"]
    assert units[3].reads[0] is model.embedding.word_embeddings.weight and units[3].layer


def test_last_stage_copy_of_the_embedding_is_initialised_equal():
    cfg = parse_args(with_flags(TINY_LLAMA_ARGS, mtp_num_layers=1), world_size=1).model
    whole = GPTModel(cfg, seed=5)
    last = GPTModel(cfg, seed=5, pre_process=False, layer_offset=1, num_local_layers=1)
    assert last.global_name("mtp_embedding.weight") == "embedding.word_embeddings.weight"
    assert torch.equal(last.mtp_embedding.weight, whole.embedding.word_embeddings.weight)
    assert torch.equal(last.mtp.layers[0].eh_proj.weight, whole.mtp.layers[0].eh_proj.weight)


def test_moe_depth_is_the_last_layers_kind_and_its_router_is_listed():
    argv = with_flags(TINY_LLAMA_ARGS, mtp_num_layers=1, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
    model = GPTModel(parse_args(argv + ["--moe-layer-freq", "[0,1]"], world_size=1).model).train()
    assert isinstance(model.mtp.layers[0].transformer_layer.mlp, MoELayer)
    assert len(model.moe_routers()) == 2
    loss, _ = forward_step(model, random_batch(), torch.device("cpu"))
    loss.backward()
    assert model.mtp.layers[0].transformer_layer.mlp.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("flags, message", [
    ({"mtp_num_layers": 32}, "--mtp-num-layers 32 predicts up to 33 tokens ahead, which --seq-length 32 leaves"),
    ({"mtp_num_layers": 1, "vocab_size": 1}, "the mock documents hold only the end-of-document token"),
    ({"mtp_num_layers": 1, "position_embedding_type": "learned_absolute"}, "without position embeddings"),
])
def test_bad_mtp_input_is_one_line(flags, message):
    with pytest.raises(UserError, match=message) as err:
        parse_args(with_flags(TINY_LLAMA_ARGS, **flags), world_size=1)
    assert "\n" not in str(err.value)


def test_zbv_with_sharded_gradients_is_refused():
    argv = with_flags(TINY_LLAMA_ARGS, mtp_num_layers=1, num_layers=4, pipeline_model_parallel_size=2,
                      pipeline_schedule="zbv", use_distributed_optimizer=True, global_batch_size=8)
    with pytest.raises(UserError, match="--mtp-num-layers 1 with --pipeline-schedule zbv"):
        parse_args(argv, world_size=4)
