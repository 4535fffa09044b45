"""input_grads_to_compute: a custom backward computes only the gradients the running pass keeps."""
import pytest
import torch

from megalite.parallel.pipeline.split_backward import input_grads_to_compute
from megalite.model.kernels import _RMSNormFunction


class _Scale(torch.autograd.Function):
    """y = x * w (+ a non-tensor argument last); records what its backward was asked to compute."""
    asked: list = []

    @staticmethod
    def forward(ctx, x, w, unused):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        need = input_grads_to_compute(ctx)
        _Scale.asked.append(need)
        return grad * w if need[0] else None, (grad * x).sum(0) if need[1] else None, None


def _graph():
    x0 = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    x = x0 * 2                                  # an interior node between the leaf and the Function
    return x0, w, _Scale.apply(x, w, "not a tensor").sum()


@pytest.mark.parametrize("run, expected", [
    (lambda x0, w, y: y.backward(), (True, True, False)),
    (lambda x0, w, y: torch.autograd.backward(y, inputs=[x0]), (True, False, False)),      # zero-bubble B
    (lambda x0, w, y: torch.autograd.backward(y, inputs=[w]), (False, True, False)),       # zero-bubble W
    (lambda x0, w, y: torch.autograd.grad(y, x0), (True, False, False)),
    (lambda x0, w, y: torch.autograd.grad(y, w), (True, True, False)),    # a leaf under grad(): the engine cannot say
])
def test_backward_computes_only_what_the_pass_keeps(run, expected):
    _Scale.asked.clear()
    x0, w, y = _graph()
    run(x0, w, y)
    assert _Scale.asked == [expected]


def test_rms_norm_split_passes_equal_its_full_backward():
    x = torch.randn(5, 8, dtype=torch.float32, requires_grad=True)
    w = torch.randn(8, dtype=torch.float32, requires_grad=True)
    g = torch.randn(5, 8, dtype=torch.float32)
    _RMSNormFunction.apply(x * 1.0, w, 1e-5).backward(g)
    full_x, full_w = x.grad, w.grad
    x.grad = w.grad = None
    y = _RMSNormFunction.apply(x * 1.0, w, 1e-5)
    torch.autograd.backward(y, g, inputs=[x], retain_graph=True)
    assert w.grad is None
    torch.autograd.backward(y, g, inputs=[w])
    torch.testing.assert_close(x.grad, full_x)
    torch.testing.assert_close(w.grad, full_w)
