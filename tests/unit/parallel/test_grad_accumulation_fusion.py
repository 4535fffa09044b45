"""Gradient-accumulation fusion: linears add their weight gradient straight into main_grad.

Proven against plain autograd (F.linear, gradients accumulated by autograd): the same gradients to fp32
tolerance, none left in .grad, the zero-bubble B pass leaving main_grad alone and W filling it, and the
flag that turns it off."""
import torch
import torch.nn.functional as F

from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.parallel.data.grad_buffer import ParamAndGradBuffer
from megalite.parallel.param_meta import mark
from megalite.model.gpt import GPTModel
from megalite.parallel.pipeline.split_backward import backward_input, backward_weight
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, TensorParallel


def fused_pair(seed: int = 0):
    """fc1 (column, with bias) -> relu -> fc2 (row), both weights marked for fusion, each with a main_grad
    that is also its .grad (as the buffer sets up fp32 weights)."""
    torch.manual_seed(seed)
    tp = TensorParallel()
    fc1 = ColumnParallelLinear(6, 10, True, torch.float32, tp)
    fc2 = RowParallelLinear(10, 4, False, torch.float32, tp)
    for p in (fc1.weight, fc1.bias, fc2.weight):
        torch.nn.init.normal_(p)
    for w in (fc1.weight, fc2.weight):
        w.main_grad = torch.zeros_like(w)
        w.grad = w.main_grad
        mark(w, fuse_wgrad_into_main_grad=True)
    return fc1, fc2


def carried_gradients(*weights) -> list:
    """Per weight, whether autograd delivered it a gradient in the next backward (a fused one gets None)."""
    seen = []
    for w in weights:
        w.register_hook(lambda g: seen.append(g is not None))
    return seen


def plain(fc1, fc2, x):
    return F.linear(torch.relu(F.linear(x, fc1.weight, fc1.bias)), fc2.weight)


def test_a_fused_linear_adds_its_weight_gradient_into_main_grad_and_leaves_grad_empty():
    fc1, fc2 = fused_pair()
    ref1, ref2 = fused_pair()
    for w in (ref1.weight, ref2.weight):
        w.grad = None                                   # plain autograd: a fresh .grad, then accumulated
    carried = carried_gradients(fc1.weight, fc2.weight)
    xs = [torch.randn(3, 5, 6, requires_grad=True) for _ in range(3)]      # three micro-batches, [s, b, h]
    for x in xs:
        fc2(torch.relu(fc1(x))).square().sum().backward()
        x_ref = x.detach().requires_grad_()
        plain(ref1, ref2, x_ref).square().sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad)
    assert carried == [False] * 6                      # the matmul added it: autograd carried no weight gradient
    for fused, ref in ((fc1.weight, ref1.weight), (fc2.weight, ref2.weight)):
        assert fused.grad.data_ptr() == fused.main_grad.data_ptr()
        torch.testing.assert_close(fused.main_grad, ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fc1.bias.grad, ref1.bias.grad)       # biases keep autograd's accumulation


def test_an_fp32_weight_whose_grad_was_reset_gets_autograds_gradient():
    """A plain torch optimizer's zero_grad() sets .grad to None: then the gradient goes to a fresh .grad,
    as without fusion, and main_grad is left alone."""
    fc1, fc2 = fused_pair()
    fc1.weight.grad = fc2.weight.grad = None
    carried = carried_gradients(fc1.weight, fc2.weight)
    fc2(torch.relu(fc1(torch.randn(2, 6)))).sum().backward()
    assert carried == [True, True]
    assert fc1.weight.grad.abs().sum() > 0 and fc1.weight.main_grad.abs().sum() == 0


def test_post_accumulate_hooks_still_fire_for_fused_weights():
    """The data-parallel reduction counts arrivals in these hooks (parallel/data/ddp.py)."""
    fc1, fc2 = fused_pair()
    arrived = []
    for w in (fc1.weight, fc2.weight):
        w.register_post_accumulate_grad_hook(lambda p: arrived.append(p))
    fc2(torch.relu(fc1(torch.randn(2, 6)))).sum().backward()
    assert [id(p) for p in arrived] == [id(fc2.weight), id(fc1.weight)]


def test_zero_bubble_b_leaves_main_grad_alone_and_w_fills_it():
    fc1, fc2 = fused_pair()
    ref1, ref2 = fused_pair()
    for w in (ref1.weight, ref2.weight):
        w.grad = None
    x = torch.randn(4, 6, requires_grad=True)
    out = fc2(torch.relu(fc1(x))).square().sum()
    grad_x, pending = backward_input(out, None, x)
    assert all(w.main_grad.abs().sum() == 0 for w in (fc1.weight, fc2.weight))     # B: input gradient only
    x_ref = x.detach().requires_grad_()
    plain(ref1, ref2, x_ref).square().sum().backward()
    torch.testing.assert_close(grad_x, x_ref.grad)
    backward_weight(pending)
    torch.testing.assert_close(fc1.weight.main_grad, ref1.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fc2.weight.main_grad, ref2.weight.grad, rtol=1e-5, atol=1e-5)


def graph_node_names(loss: torch.Tensor) -> set[str]:
    names, stack, seen = set(), [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(child for child, _ in node.next_functions)
    return names


def tiny_model():
    return GPTModel(parse_args(TINY_LLAMA_ARGS, world_size=1).model, seed=3)


def test_the_buffer_fuses_every_linear_of_a_model_and_its_gradients_equal_autograds():
    model, reference = tiny_model(), tiny_model()
    buffer = ParamAndGradBuffer(list(model.named_parameters()))
    matrices = [n for n, p in model.named_parameters() if p.dim() == 2]
    assert buffer.fuse_weight_grads() == len(matrices)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):                                               # two accumulated micro-batches
        tokens = torch.randint(0, 200, (2, 33), generator=g)
        for m in (model, reference):
            loss = m(tokens[:, :-1], labels=tokens[:, 1:]).mean()
            (loss / 2).backward()
    assert "_LinearAccumulatingWeightGradBackward" not in graph_node_names(loss)     # the reference's loss
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    assert "_LinearAccumulatingWeightGradBackward" in graph_node_names(loss)
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.main_grad, r.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_weights_accumulate_in_fp32_fused_or_not():
    """bf16 is fused where PyTorch has an fp32-output addmm of bf16 operands (CUDA); on CPU the bf16 gradient
    goes through the accumulation hook. Either way main_grad is the fp32 sum."""
    torch.manual_seed(0)
    tp = TensorParallel()
    fc = ColumnParallelLinear(8, 4, False, torch.bfloat16, tp)
    torch.nn.init.normal_(fc.weight)
    buffer = ParamAndGradBuffer([("fc.weight", fc.weight)])
    buffer.fuse_weight_grads()
    xs = [torch.randn(3, 8, dtype=torch.bfloat16) for _ in range(4)]
    for x in xs:
        fc(x).float().sum().backward()
    expected = sum(torch.ones(3, 4).t().matmul(x.float()) for x in xs)
    assert fc.weight.grad is None
    # each unfused micro-batch gradient is rounded to bf16 (8 bits) before the fp32 sum: bf16 tolerance
    torch.testing.assert_close(fc.weight.main_grad, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def test_no_gradient_accumulation_fusion_turns_it_off():
    assert parse_args(TINY_LLAMA_ARGS, world_size=1).parallel.gradient_accumulation_fusion
    config = parse_args(with_flags(TINY_LLAMA_ARGS, no_gradient_accumulation_fusion=True), world_size=1)
    assert not config.parallel.gradient_accumulation_fusion
