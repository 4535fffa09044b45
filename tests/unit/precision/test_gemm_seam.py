"""The GEMM seam (megalite/precision/gemm.py): every GEMM of the linear and expert layers is a call to the
layer's GemmPrecision.

A recording recipe, registered here, sees each linear's forward, input-gradient and weight-gradient GEMM
and the experts' six grouped GEMMs, in a plain backward, with main_grad fusion and in the zero-bubble
split, while the model's losses and gradients stay bit-identical to the default recipe's; no matmul of the
dense layers runs outside the recipe; and the default recipe's GEMMs are the plain torch matmuls."""
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.model.gpt import GPTModel
from megalite.model.moe import GroupedExperts
from megalite.parallel.data.grad_buffer import ParamAndGradBuffer
from megalite.parallel.pipeline.split_backward import backward_input, backward_weight
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, TensorParallel
from megalite.precision.gemm import RECIPES, GemmPrecision, build_gemm_precision

# layer 1 MoE (4 experts, top-2), layer 2 dense; untied output layer
DENSE_AND_MOE = with_flags(TINY_LLAMA_ARGS, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                           moe_layer_freq=2)
LINEAR = dict(forward=1, grad_input=1, grad_weight=1)                # one micro-batch, one backward
EXPERTS = dict(grouped_forward=2, grouped_grad_input=2, grouped_grad_weight=2)     # fc1 and fc2 each


class Recording(GemmPrecision):
    """The default recipe, counting its calls per GEMM kind; ``inside`` is set while one runs."""
    inside = False

    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def _record(self, kind, gemm, *args):
        self.calls[kind] += 1
        Recording.inside = True
        try:
            return gemm(*args)
        finally:
            Recording.inside = False

    def forward(self, x, w, bias=None):
        return self._record("forward", super().forward, x, w, bias)

    def grad_input(self, grad_out, w):
        return self._record("grad_input", super().grad_input, grad_out, w)

    def grad_weight(self, grad_out, x, main_grad=None):
        return self._record("grad_weight", super().grad_weight, grad_out, x, main_grad)

    def grouped_forward(self, rows, weight, counts, segments=None, axes=(None, None)):
        return self._record("grouped_forward", super().grouped_forward, rows, weight, counts)

    def grouped_grad_input(self, grad_out, weight, counts, segments=None, axes=(None, None)):
        return self._record("grouped_grad_input", super().grouped_grad_input, grad_out, weight, counts)

    def grouped_grad_weight(self, grad_out, rows, counts, segments=None, axes=(None, None)):
        return self._record("grouped_grad_weight", super().grouped_grad_weight, grad_out, rows, counts)


@pytest.fixture(autouse=True)
def recording_recipe(monkeypatch):
    monkeypatch.setitem(RECIPES, "recording", Recording)


def model(recipe: str, argv=DENSE_AND_MOE, **kwargs) -> GPTModel:
    return GPTModel(parse_args(argv, world_size=1).model, seed=3, tp=TensorParallel(gemm_recipe=recipe), **kwargs)


def batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 200, (2, 33), generator=g)
    return tokens[:, :-1], tokens[:, 1:], torch.randn(32, 2, 64, generator=g)


def linears(m: GPTModel) -> list:
    return [x for x in m.modules() if isinstance(x, (ColumnParallelLinear, RowParallelLinear))]


def experts(m: GPTModel) -> list:
    return [x for x in m.modules() if isinstance(x, GroupedExperts)]


def assert_every_layer_saw(m: GPTModel, linear: dict, grouped: dict) -> None:
    # QKV, projection, fc1, fc2 of the dense layer; QKV, projection of the MoE layer; the output layer
    assert len(linears(m)) == 7 and len(experts(m)) == 1
    assert m.output_gemm() is m.output_layer.precision
    for layer in linears(m):
        assert layer.precision.calls == Counter(linear)
    for layer in experts(m):
        assert layer.precision.calls == Counter(grouped)
    recipes = [x for x in m.modules() if isinstance(x, GemmPrecision)]
    assert len(recipes) == 8 and all(isinstance(r, Recording) for r in recipes)


def assert_bit_identical(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x is None and y is None) or torch.equal(x, y)


def test_a_recording_recipe_sees_every_gemm_and_changes_no_bit():
    ids, labels, _ = batch()
    results = {}
    for recipe in ("default", "recording"):
        m = model(recipe)
        loss = m(ids, labels=labels).mean()
        loss.backward()
        results[recipe] = [loss] + [p.grad for p in m.parameters()]
    assert_every_layer_saw(m, LINEAR, EXPERTS)
    assert_bit_identical(results["default"], results["recording"])


def test_the_weight_gradient_gemm_adds_into_main_grad_through_the_recipe():
    ids, labels, _ = batch()
    results = {}
    for recipe in ("default", "recording"):
        m = model(recipe)
        assert ParamAndGradBuffer(list(m.named_parameters())).fuse_weight_grads() > 0
        m(ids, labels=labels).mean().backward()
        results[recipe] = [p.main_grad for p in m.parameters()]
    assert_every_layer_saw(m, LINEAR, EXPERTS)
    fused = [layer.weight for layer in linears(m)]
    assert all(w.main_grad.abs().sum() > 0 for w in fused)
    assert_bit_identical(results["default"], results["recording"])


def test_the_zero_bubble_split_runs_input_gemms_in_b_and_weight_gemms_in_w():
    ids, labels, hidden = batch()
    results = {}
    for recipe in ("default", "recording"):
        m = model(recipe, pre_process=False)       # a later pipeline stage: its input is differentiated
        x = hidden.clone().requires_grad_()
        grad_x, pending = backward_input(m(hidden_states=x, labels=labels).mean(), None, x)
        if recipe == "recording":
            assert_every_layer_saw(m, dict(LINEAR, grad_weight=0), dict(EXPERTS, grouped_grad_weight=0))
        backward_weight(pending)
        results[recipe] = [grad_x] + [p.grad for p in m.parameters()]
    # W runs fc2's input GEMM again: fc1's weight gradient needs its result
    assert_every_layer_saw(m, LINEAR, dict(EXPERTS, grouped_grad_input=3))
    assert_bit_identical(results["default"], results["recording"])


class MatmulsOutsideTheRecipe(TorchDispatchMode):
    GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten.baddbmm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.out}

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.GEMMS and not Recording.inside:
            self.found.append(func)
        return func(*args, **(kwargs or {}))


def test_no_matmul_of_a_dense_model_runs_outside_its_recipes():
    """Attention's core is one fused kernel on a CPU, so every matmul of a dense model is a linear's."""
    ids, labels, _ = batch()
    m = model("recording", TINY_LLAMA_ARGS)
    with MatmulsOutsideTheRecipe() as mode:
        m(ids, labels=labels).mean().backward()
    assert mode.found == []
    assert sum(sum(layer.precision.calls.values()) for layer in linears(m)) == 3 * (4 * 2 + 1)


def test_build_gemm_precision_gives_each_layer_its_own_instance():
    assert type(build_gemm_precision()) is GemmPrecision
    assert build_gemm_precision("recording") is not build_gemm_precision("recording")
    with pytest.raises(ValueError, match="unknown GEMM precision recipe 'fp9'"):
        build_gemm_precision("fp9")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_default_recipes_gemms_are_torchs_matmuls(dtype):
    g = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((5, 3, 16), (24, 16), (24,)))
    grad_y = torch.randn(5, 3, 24, generator=g).to(dtype)
    gemm = GemmPrecision()
    assert torch.equal(gemm.forward(x, w), x @ w.t())
    assert torch.equal(gemm.forward(x, w, b), torch.addmm(b, x.reshape(15, 16), w.t()).view(5, 3, 24))
    # the same ops autograd runs for F.linear: bit-identical input and weight gradients
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    grad_x, grad_w = torch.autograd.grad(F.linear(xr, wr), (xr, wr), grad_y)
    grad_2d, x_2d = grad_y.reshape(15, 24), x.reshape(15, 16)
    assert torch.equal(gemm.grad_input(grad_y, w), grad_x) and torch.equal(grad_x, grad_y @ w)
    assert torch.equal(gemm.grad_weight(grad_2d, x_2d), grad_w) and torch.equal(grad_w, grad_2d.t() @ x_2d)


def test_the_default_weight_gradient_gemm_adds_into_main_grad():
    g = torch.Generator().manual_seed(1)
    grad_out, x, main_grad = (torch.randn(*shape, generator=g) for shape in ((15, 24), (15, 16), (24, 16)))
    expected = main_grad + grad_out.t() @ x
    assert GemmPrecision().grad_weight(grad_out, x, main_grad) is None
    torch.testing.assert_close(main_grad, expected)


def test_the_default_recipes_grouped_gemms_are_per_expert_matmuls():
    g = torch.Generator().manual_seed(2)
    counts = [3, 0, 5]                                  # expert 1 gets no rows
    rows, weight = torch.randn(8, 16, generator=g), torch.randn(3, 24, 16, generator=g)
    grad_out = torch.randn(8, 24, generator=g)
    gemm = GemmPrecision()
    parts, grads = rows.split(counts), grad_out.split(counts)
    assert torch.equal(gemm.grouped_forward(rows, weight, counts),
                       torch.cat([p @ w.t() for p, w in zip(parts, weight)]))
    assert torch.equal(gemm.grouped_grad_input(grad_out, weight, counts),
                       torch.cat([q @ w for q, w in zip(grads, weight)]))
    d_weight = gemm.grouped_grad_weight(grad_out, rows, counts)
    assert torch.equal(d_weight, torch.stack([q.t() @ p for q, p in zip(grads, parts)]))
    assert not d_weight[1].any()
