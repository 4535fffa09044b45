"""The flat parameter/gradient buffer: views, fp32 accumulation, and equality with plain autograd."""
import pytest
import torch

from megalite.parallel.data import materialise
from megalite.parallel.data.grad_buffer import ParamAndGradBuffer
from megalite.parallel.param_meta import mark


def make_params(dtype):
    torch.manual_seed(0)
    return [("a.weight", torch.nn.Parameter(torch.randn(4, 3, dtype=dtype))),
            ("a.bias", torch.nn.Parameter(torch.randn(4, dtype=dtype))),
            ("b.weight", torch.nn.Parameter(torch.randn(2, 4, dtype=dtype)))]


def loss_of(named, x):
    w1, b1, w2 = (p for _, p in named)
    return (torch.nn.functional.linear(torch.nn.functional.linear(x, w1, b1), w2) ** 2).sum()


def test_params_become_views_and_keep_their_values():
    named = make_params(torch.float32)
    before = [p.detach().clone() for _, p in named]
    buf = ParamAndGradBuffer(named)
    for (name, p), old in zip(named, before):
        assert torch.equal(p, old)
        assert p.data_ptr() == buf.view(buf.param_data, name).data_ptr()
    # reverse order: the last parameter sits at offset 0
    assert buf.slots["b.weight"].start == 0


def test_fp32_gradients_accumulate_in_place_over_micro_batches():
    named, reference = make_params(torch.float32), make_params(torch.float32)
    buf = ParamAndGradBuffer(named)
    xs = [torch.randn(5, 3) for _ in range(3)]
    for x in xs:
        loss_of(named, x).backward()
        loss_of(reference, x).backward()
    for (name, p), (_, r) in zip(named, reference):
        torch.testing.assert_close(p.main_grad, r.grad)
        assert p.grad.data_ptr() == p.main_grad.data_ptr()
    buf.zero_grad()
    assert buf.grad_data.abs().sum() == 0 and named[0][1].grad is named[0][1].main_grad


def test_bf16_gradients_accumulate_in_fp32():
    named = make_params(torch.bfloat16)
    buf = ParamAndGradBuffer(named)
    x = torch.randn(5, 3, dtype=torch.bfloat16)
    expected = torch.zeros_like(buf.grad_data)
    for _ in range(4):
        loss_of(named, x).backward()
    for name, p in named:
        assert p.grad is None                       # freed by the hook
        assert p.main_grad.dtype == torch.float32
    # four identical micro-batches: fp32 sum of four bf16 gradients
    single = make_params(torch.bfloat16)
    loss_of(single, x).backward()
    for (name, p), (_, s) in zip(named, single):
        torch.testing.assert_close(p.main_grad, 4 * s.grad.float())
    assert not torch.equal(buf.grad_data, expected)


def test_the_data_parallel_wrapper_is_freed_without_the_garbage_collector():
    """After close(), dropping the trainer frees the wrapper at once, with the process-group handles it
    holds: the entry point destroys the groups next, and a gloo group freed later by the garbage
    collector (possibly at interpreter exit) aborted the process ("terminate called without an active
    exception"). Nothing in it may point back at it (a bound method of it kept in a member did)."""
    import gc
    import weakref
    from megalite.train.command_line import parse_args
    from megalite.train.trainer import build_trainer
    from megalite_test_utils import TINY_LLAMA_ARGS
    flags = ["--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce"]
    trainer = build_trainer(parse_args(TINY_LLAMA_ARGS + flags, world_size=1), print_fn=lambda *_: None)
    wrapper = weakref.ref(trainer.ddp)
    trainer.close()
    gc.disable()
    try:
        del trainer
        assert wrapper() is None
    finally:
        gc.enable()


def test_zero3_start_up_materialises_each_ranks_elements_from_init_values(monkeypatch):
    """Parameters on the meta device: each rank's ZeRO-3 shard (equal slices or whole parameters) holds
    exactly its elements' initial values, drawn a bounded chunk at a time; together the ranks hold every
    parameter once."""
    monkeypatch.setattr(materialise, "INIT_CHUNK", 5)
    shapes = {"a.weight": (4, 3), "a.bias": (4,), "b.weight": (7, 4)}
    base = {name: 100.0 * i for i, name in enumerate(shapes)}
    calls = []

    def named():
        params = []
        for name, shape in shapes.items():
            p = torch.nn.Parameter(torch.empty(shape, device="meta"))

            def init_values(lo, hi, device, name=name):
                calls.append(hi - lo)
                return base[name] + torch.arange(lo, hi, dtype=torch.float32, device=device)
            mark(p, init_values=init_values)
            params.append((name, p))
        return params

    for whole in (False, True):
        held = {name: torch.full((p.numel(),), -1.0) for name, p in named()}
        for rank in range(3):
            buf = ParamAndGradBuffer(named(), None, rank, 3, shard_params=True, device=torch.device("cpu"),
                                     whole_params=whole)
            materialise.materialise([], buf, torch.device("cpu"))
            for bucket in buf.buckets:
                start, end = buf.local_range(bucket)
                chunk = buf.local_param_chunk(bucket)
                for name in bucket.names:
                    slot = buf.slots[name]
                    lo, hi = max(start, slot.start), min(end, slot.end)
                    if lo < hi:
                        assert bool((held[name][lo - slot.start:hi - slot.start] == -1).all()), name
                        held[name][lo - slot.start:hi - slot.start] = chunk[lo - start:hi - start]
        for name, values in held.items():
            assert torch.equal(values, base[name] + torch.arange(values.numel(), dtype=torch.float32)), (whole, name)
    assert calls and max(calls) <= 5
    with pytest.raises(ValueError, match="init_values"):
        materialise.fill_initial(torch.empty(3), None, 0, 3)
