"""Buckets and ZeRO shards of the flat buffer: layout, padding, which chunk each rank owns."""
import torch

from megalite.parallel.data.grad_buffer import ParamAndGradBuffer
from megalite.parallel.param_meta import mark


def make_params(sizes, dtype=torch.float32):
    torch.manual_seed(0)
    return [(f"p{i}.weight", torch.nn.Parameter(torch.randn(n, dtype=dtype))) for i, n in enumerate(sizes)]


def test_buckets_hold_whole_parameters_in_reverse_order_padded_to_the_dp_size():
    named = make_params([5, 7, 3, 11, 2])
    buf = ParamAndGradBuffer(named, bucket_size=10, dp_rank=1, dp_size=4)
    assert [b.names for b in buf.buckets] == [["p4.weight", "p3.weight"], ["p2.weight", "p1.weight"], ["p0.weight"]]
    assert [(b.start, b.end) for b in buf.buckets] == [(0, 16), (16, 28), (28, 36)]    # 13 -> 16, 10 -> 12, 5 -> 8
    assert buf.numel == 36 and buf.numel_unpadded == 28
    for name, p in named:                                     # values kept, params are views of the buffer
        assert p.data_ptr() == buf.view(buf.param_data, name).data_ptr()
    # rank 1 owns the second quarter of every bucket
    assert [buf.local_range(b) for b in buf.buckets] == [(4, 8), (19, 22), (30, 32)]
    assert buf.local_grad_chunk(buf.buckets[1]).data_ptr() == buf.grad_data[19:22].data_ptr()
    assert buf.param_data[buf.slots["p3.weight"].end:16].abs().sum() == 0            # padding is zero


def test_units_start_new_buckets():
    named = make_params([4, 4, 4, 4])
    buf = ParamAndGradBuffer(named, units=[0, 1, 1, 2])
    assert [b.names for b in buf.buckets] == [["p3.weight"], ["p2.weight", "p1.weight"], ["p0.weight"]]
    assert [b.unit for b in buf.buckets] == [2, 1, 0]


def test_sharded_gradients_keep_only_this_ranks_chunks():
    named = make_params([6, 6])
    buf = ParamAndGradBuffer(named, dp_rank=0, dp_size=3, shard_grads=True)
    assert buf.grad_data is None and buf.grad_shard.numel() == 4
    assert buf.grad_bytes() == 4 * 4 and buf.param_bytes() == 12 * 4
    assert not hasattr(named[0][1], "main_grad") or named[0][1].main_grad is None


def test_sharded_parameters_reassemble_from_every_ranks_shard():
    sizes = [5, 3, 8]
    full = [p.detach().clone() for _, p in make_params(sizes)]
    shards, buffers = [], []
    for rank in range(2):
        named = make_params(sizes)
        buf = ParamAndGradBuffer(named, dp_rank=rank, dp_size=2, shard_params=True, units=[0, 1, 1])
        assert buf.param_bytes() == buf.param_shard.numel() * 4          # nothing gathered
        shards.append(buf.param_shard.clone())
        buffers.append((buf, named))
    buf, named = buffers[0]
    for bucket in buf.buckets:                                 # what an all-gather would do
        buf.allocate(bucket)
        lo, hi = buf._local_offsets(bucket)
        bucket.unsharded.tensor.copy_(torch.cat([s[lo:hi] for s in shards]))
    for (name, p), expected in zip(named, full):
        torch.testing.assert_close(p.detach(), expected)
    assert buf.param_bytes() == buf.param_shard.numel() * 4 + buf.numel * 4
    for bucket in buf.buckets:
        buf.release(bucket)
    assert buf.param_bytes() == buf.param_shard.numel() * 4


def test_a_shared_embedding_gets_its_own_bucket_when_sharded():
    named = make_params([4, 6, 4])
    mark(named[1][1], shared_embedding=True)
    buf = ParamAndGradBuffer(named, dp_size=2)
    assert [b.names for b in buf.buckets] == [["p2.weight"], ["p1.weight"], ["p0.weight"]]
    assert len(ParamAndGradBuffer(make_params([4, 6, 4])).buckets) == 1
