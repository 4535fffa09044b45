"""SelfAttention with --window-size / --window-attn-skip-freq / --softmax-type: each layer's window, the
learnable sink parameter (its shard, initial values, weight decay, checkpoint placement), and one layer's
output against a dense fp64 softmax with the window and the sink in the denominator, forward and backward."""
import torch

from megalite.model.attention.inputs import AttentionInputs
from megalite.model.gpt import GPTModel
from megalite.model.init import full_normal
from megalite.optim.master_weights import uses_weight_decay
from megalite.parallel.param_meta import full_shape
from megalite.parallel.tensor.layers import TensorParallel, shard_positions
from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

SINK = "decoder.layers.0.self_attention.softmax_offset"


def _config(**flags):
    return parse_args(with_flags(TINY_LLAMA_ARGS, **flags), world_size=1).model


def test_each_layer_builds_its_window():
    model = GPTModel(_config(num_layers=4, window_size="5,0", window_attn_skip_freq="2"))
    assert [layer.self_attention.mask.window for layer in model.decoder.layers] == [(5, 0), (-1, -1)] * 2
    plain = GPTModel(_config())
    assert all(layer.self_attention.mask.plain for layer in plain.decoder.layers)
    assert not any("softmax_offset" in n for n, _ in plain.named_parameters())


def test_learnable_sink_is_a_head_sharded_parameter():
    config = _config(softmax_type="learnable")
    model = GPTModel(config)
    params = dict(model.named_parameters())
    offset = params[SINK]
    assert offset.shape == (4,) and not uses_weight_decay(SINK, offset)        # Megatron: 1-D, no decay
    expected = full_normal(model.global_name(SINK), (4,), config.init_method_std, 1234)
    assert torch.equal(offset.detach(), expected)                                # N(0, --init-method-std)
    for rank in range(2):                        # TP = 2: the rank's heads, placed as the full tensor's rows
        shard = dict(GPTModel(config, tp=TensorParallel(rank=rank, size=2)).named_parameters())[SINK]
        assert shard.shape == (2,) and full_shape(shard) == (4,)
        assert shard_positions(shard)[0].tolist() == [2 * rank, 2 * rank + 1]
        assert torch.equal(shard.detach(), expected[2 * rank:2 * rank + 2])
    assert "softmax_offset" not in str([n for n, _ in GPTModel(_config(softmax_type="off-by-one")).named_parameters()])


def _dense_reference(attn, x, rotary, window_left: int, sink: torch.Tensor | None):
    """fp64 attention of ``attn``'s projections: window (query i sees keys i - left .. i) and the sink's
    exp(logit) added to each softmax denominator."""
    w_qkv, w_proj = attn.linear_qkv.weight.double(), attn.linear_proj.weight.double()
    s, b, _ = x.shape
    q, k, v = attn.split_qkv((x.double() @ w_qkv.t()))
    cos, sin = (t.double() for t in rotary)
    rot = lambda t: t * cos + torch.cat([-t[..., t.shape[-1] // 2:], t[..., :t.shape[-1] // 2]], -1) * sin  # noqa
    q, k = rot(q), rot(k)
    per = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(per, dim=2), v.repeat_interleave(per, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / q.shape[-1] ** 0.5
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    scores = scores.masked_fill((j > i) | (i - j > window_left), float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink.double().view(1, -1, 1, 1).expand(b, -1, s, 1)], dim=-1)
    probs = scores.softmax(-1)[..., :s]
    out = torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(s, b, -1)
    return out @ w_proj.t()


def test_window_and_sink_match_a_dense_softmax():
    for softmax_type in ("learnable", "off-by-one"):
        model = GPTModel(_config(window_size="3,0", softmax_type=softmax_type, seq_length=16))
        attn = model.decoder.layers[0].self_attention
        g = torch.Generator().manual_seed(3)
        if softmax_type == "learnable":
            with torch.no_grad():
                attn.softmax_offset.copy_(torch.randn(4, generator=g))
        x = torch.randn(16, 2, 64, generator=g, requires_grad=True)
        rotary = model.rotary.tables(None, 16, torch.float32)
        sink = attn.softmax_offset if softmax_type == "learnable" else torch.zeros(4)
        out = attn(x, AttentionInputs(rotary))
        ref = _dense_reference(attn, x, rotary, 3, sink)
        assert (out.double() - ref).abs().max().item() < 1e-5
        grad = torch.randn(out.shape, generator=g)
        got = torch.autograd.grad(out, [x, *attn.parameters()], grad)
        want = torch.autograd.grad(ref, [x, *attn.parameters()], grad.double())
        assert all((a.double() - b).abs().max().item() < 1e-5 for a, b in zip(got, want))
