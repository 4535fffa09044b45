"""FP8 layouts equal the serial FP8 run.

One column- and row-parallel linear pair at TP=2 and with its tokens split over CP=2 gives serial's outputs
and gradients to fp32 rounding (its quantised operands are serial's), and other ones without the amax
reductions (precision/fp8_layout.py).

Through pretrain_gpt.py a tiny Llama (widths whole 128-blocks per TP rank, so the block recipes run at TP=2)
with each recipe logs serial's losses and gradient norms at TP=2 + SP, PP=2, DP=2 ZeRO-1, DP=2 ZeRO-3 and
CP=2, and a tiny MoE at EP=2 (over the TP ranks, which hold parts of the same micro-batch). PP and DP run
serial's arithmetic and are compared at every step of one run. TP and CP sum in another order than one process
(TP's partial products, CP's ring attention), and FP8 keeps 2-3 mantissa bits: where an fp32 rounding difference
puts a value on the other side of a rounding midpoint, that one value quantises one FP8 step apart, and the
runs part (by up to ~1e-4 in four steps). So each of their steps is compared from the same weights: the layout
saves a checkpoint every step, and serial, resumed from the layout's checkpoint of step k, logs the layout's
loss and gradient norm of step k + 1 (stepwise). The learning rate of the single-run comparisons is tiny
(1e-7) so that the steps' data and scales decide the later losses; the stepwise one trains at 1e-3, so its
later steps start from weights unlike the first step's. --fp8-format e4m3: E5M2 gradients flip more (TP's
first gradient norm then differs in the last printed digit). --fp8-emulate: a layout's GEMMs have other
shapes than serial's, which would send some to the kernel and some to the emulation (the same quantised
values, another rounding).

Delayed scaling's amax history lives in the checkpoint: saved at TP=2 it is serial's and resumes at TP=1
(and the other way) with the uninterrupted run's loss, and a delayed-scaling checkpoint resumed with another
recipe stops in one line naming --fp8-recipe."""
import os

import pytest
import torch
import torch.distributed as dist

from harness import run_pretrain, run_ranks
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, TensorParallel
from megalite.precision.fp8 import Fp8Recipe
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from test_moe_parallel import train as train_moe

ARGV = with_flags(TINY_LLAMA_ARGS, lr="1e-7", hidden_size=256, num_attention_heads=4, num_query_groups=4,
                  ffn_hidden_size=512, fp8_format="e4m3", fp8_emulate=True)
MOE_ARGV = with_flags(ARGV, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128,
                      moe_token_dispatcher_type="alltoall")
SP = dict(tensor_model_parallel_size=2, sequence_parallel=True)
# layout -> (flags, stepwise): PP and DP run serial's arithmetic and are compared over every step of one run;
# TP and CP sum in another order, so each of their steps is compared from the same weights (stepwise)
LAYOUTS = {"tp2-sp": (SP, True),
           "pp2": (dict(pipeline_model_parallel_size=2), False),
           "dp2-zero1": (dict(use_distributed_optimizer=True), False),
           "dp2-zero3": (dict(data_parallel_sharding_strategy="optim_grads_params"), False),
           "cp2": (dict(context_parallel_size=2), True)}
STEPWISE = with_flags(ARGV, lr="1e-3")
EP2 = dict(expert_model_parallel_size=2, expert_tensor_parallel_size=1, **SP)
RECIPES = ["tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8"]
DEFAULT = {("tensorwise", "tp2-sp")}
# the step at which a CP run's forward meets a value on a rounding midpoint (an input at x s = -84.0000000,
# between -80 and -88, for delayed; 14.4999971 against CP's 14.5000019, between 14 and 15, for rowwise;
# -54.0000000 against -53.9999924, between -52 and -56, for MLA), which one fp32 rounding of ring attention
# sends the other way: the flipped value reaches the token's later layers and the loss (~1e-4); the steps
# before it are compared
MIDPOINT_FLIPS = {("delayed", "cp2"): 2, ("rowwise", "cp2"): 4, ("mla", "cp2"): 3}
# MXFP8's 1 x 32 token tiles are whole on a CP rank from 64 positions (chunks of 16 positions x 2 sequences)
WHOLE_MXFP8_TILES = with_flags(STEPWISE, seq_length=64, max_position_embeddings=64)


def assert_equal_runs(reference: dict, run: dict, iterations=(1, 2, 3, 4)) -> None:
    """Losses within 1e-5; gradient norms within 1e-4 or the log's last printed digit (1e-3)."""
    assert sorted(run) == sorted(reference), run
    for it in iterations:
        assert run[it][0] == pytest.approx(reference[it][0], rel=1e-5, abs=1e-5), (it, run, reference)
        assert run[it][1] == pytest.approx(reference[it][1], rel=1e-4, abs=1.001e-3), (it, run, reference)


def train(nproc: int, flags: dict, nccl: bool = False, base=ARGV) -> dict:
    return train_moe(nproc, flags, nccl=nccl, base=base)


def flags_of(recipe: str, **flags) -> dict:
    return dict(fp8_recipe=recipe, fp8_amax_history_len=4 if recipe == "delayed" else 1, **flags)


_serial: dict = {}


def serial(recipe: str, base=ARGV) -> dict:
    key = (recipe, id(base))
    if key not in _serial:
        _serial[key] = train(1, flags_of(recipe), base=base)
    return _serial[key]


def cases():
    for recipe in RECIPES:
        for layout in LAYOUTS:
            marks = () if (recipe, layout) in DEFAULT else pytest.mark.slow
            yield pytest.param(recipe, layout, marks=marks, id=f"{recipe}-{layout}")


def assert_stepwise_equal(recipe: str, flags: dict, save: str, base=STEPWISE, iterations: int = 4) -> None:
    """Each of the first ``iterations`` steps of the layout equals serial's step from the same weights: the
    layout saves each step, and serial resumed from its checkpoint of step k logs the layout's step k + 1
    (its first step: from the same initial weights)."""
    run = train(2, flags_of(recipe, save=save, save_interval=1, **flags), base=base)
    reference = {1: serial(recipe, base)[1]}
    for k in range(1, iterations):
        with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(k))
        reference.update(train(1, flags_of(recipe, load=save, train_iters=k + 1), base=base))
    run = {i: run[i] for i in reference}
    assert_equal_runs(reference, run, range(1, iterations + 1))


@pytest.mark.parametrize("recipe, layout", list(cases()))
def test_fp8_layout_equals_serial(recipe, layout, tmp_path):
    flags, stepwise = LAYOUTS[layout]
    if stepwise:
        base = WHOLE_MXFP8_TILES if (recipe, layout) == ("mxfp8", "cp2") else STEPWISE
        assert_stepwise_equal(recipe, flags, str(tmp_path / "ckpt"), base,
                              MIDPOINT_FLIPS.get((recipe, layout), 5) - 1)
    else:
        assert_equal_runs(serial(recipe), train(2, flags_of(recipe, **flags)))


MLA = with_flags(STEPWISE, group_query_attention=None, num_query_groups=None, multi_latent_attention=True,
                 q_lora_rank=64, kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32)


@pytest.mark.parametrize("layout", ["tp2-sp", pytest.param("cp2", marks=pytest.mark.slow)])
def test_fp8_multi_latent_attention_equals_serial(layout, tmp_path):
    """MLA's down projections are whole on every TP rank and run on its own tokens (its sequence shard,
    its CP positions): their amaxes are reduced over those ranks, so each step is serial's (two steps at
    TP=2+SP: unreduced, the first loss is 1e-3 off)."""
    steps = 2 if layout == "tp2-sp" else MIDPOINT_FLIPS[("mla", layout)] - 1
    assert_stepwise_equal("tensorwise", LAYOUTS[layout][0], str(tmp_path / "ckpt"), MLA, steps)


@pytest.mark.slow
def test_the_stepwise_comparison_sees_a_drift():
    """The stepwise comparison is needed and can fail: one TP=2 run at lr 1e-3 parts from one serial run by
    more than the 1e-5 tolerance within four steps, through FP8 values flipped at rounding midpoints."""
    run, reference = (train(n, flags_of("tensorwise", **flags), base=STEPWISE) for n, flags in ((2, SP), (1, {})))
    assert run[1][0] == pytest.approx(reference[1][0], abs=1e-5)
    assert max(abs(run[i][0] - reference[i][0]) for i in range(2, 5)) > 1e-5, (run, reference)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_experts_at_ep2_equal_serial(recipe):
    assert_equal_runs(serial(recipe, MOE_ARGV), train(2, flags_of(recipe, **EP2), base=MOE_ARGV), (1,))


def test_the_comparison_sees_fp8():
    """The layouts' comparison can fail: serial tensorwise FP8 logs other losses than the same run without FP8."""
    fp8 = serial("tensorwise")
    plain = train(1, dict(fp8_format=None, fp8_emulate=None))
    assert max(abs(plain[i][0] - fp8[i][0]) for i in range(1, 5)) > 1e-4, (plain, fp8)


def test_fp8_amax_reductions_under_nccl_semantics():
    """The per-GEMM amax all-reduces over TP and the step's over TP x CP and DP are collectives every rank
    issues in the same order (the NCCL-semantics tier compares the ranks' logs)."""
    assert_equal_runs(serial("delayed"), train(2, flags_of("delayed", **SP), nccl=True), (1,))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2-sp", "cp2"])
def test_fp8_multi_latent_attention_under_nccl_semantics(layout):
    """MLA's down projections reduce their amaxes over the sequence-parallel and CP ranks in one order."""
    assert_equal_runs(serial("tensorwise", MLA), train(2, flags_of("tensorwise", **LAYOUTS[layout][0]), nccl=True,
                                                       base=MLA), (1,))


def _operands():
    g = torch.Generator().manual_seed(0)
    x, w1, w2, grad = (torch.randn(*shape, generator=g) for shape in ((64, 256), (512, 256), (256, 512), (64, 256)))
    return x * 3, w1 * 0.05, w2 * 0.05, grad


def _pair(tp: TensorParallel, recipe: Fp8Recipe, reduce: bool, x, w1, w2, grad, dim=0):
    """A column- then row-parallel linear on the operands (rank's part: weights by tp, tokens along ``dim``)
    -> (output, input gradient, both weight gradients, summed over the token ranks)."""
    column = ColumnParallelLinear(256, 512, False, torch.float32, tp)
    row = RowParallelLinear(512, 256, False, torch.float32, tp)
    if not reduce:                                   # each rank's own amaxes
        column.precision, row.precision = recipe.build(), recipe.build()
    with torch.no_grad():
        column.weight.copy_(tp.chunk(w1, 0))
        row.weight.copy_(tp.chunk(w2, 1))
    x = x.clone().requires_grad_()
    y = row(column(x))
    y.backward(grad)
    weight_grads = [column.weight.grad, row.weight.grad]
    if tp.cp_group is not None:
        for g in weight_grads:
            dist.all_reduce(g, group=tp.cp_group)
    return y.detach(), x.grad, *weight_grads


def _gemms_at_tp2_and_cp2(rank: int, world: int, recipe: str, reduce: bool) -> dict:
    """Serial, TP=2 and CP=2 (two token halves) FP8 GEMMs of one linear pair: the largest differences from
    serial, relative to serial's largest value."""
    fp8 = Fp8Recipe(recipe, "hybrid", emulate=True)
    x, w1, w2, grad = _operands()
    ref = _pair(TensorParallel(gemm_recipe=fp8), fp8, True, x, w1, w2, grad)
    tp = TensorParallel(group=dist.group.WORLD, rank=rank, size=world, gemm_recipe=fp8)
    at_tp = _pair(tp, fp8, reduce, x, w1, w2, grad)
    cp = TensorParallel(gemm_recipe=fp8, cp_group=dist.group.WORLD, cp_size=world)
    half = [t.chunk(world)[rank] for t in (x, grad)]
    at_cp = _pair(cp, fp8, reduce, half[0], w1, w2, half[1])

    def diff(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()
    return {"tp": [diff(at_tp[0], ref[0]), diff(at_tp[1], ref[1]), diff(at_tp[2], tp.chunk(ref[2], 0)),
                   diff(at_tp[3], tp.chunk(ref[3], 1))],
            "cp": [diff(at_cp[0], ref[0].chunk(world)[rank]), diff(at_cp[1], ref[1].chunk(world)[rank]),
                   diff(at_cp[2], ref[2]), diff(at_cp[3], ref[3])]}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", pytest.param("blockwise", marks=pytest.mark.slow)])
def test_fp8_gemms_at_tp2_and_cp2_quantise_as_serial(recipe):
    """One column- and row-parallel linear pair: at TP=2 and with the tokens split over CP=2 the outputs, input
    and weight gradients are serial's to fp32 rounding (the quantised operands are serial's); each rank's own
    amaxes instead give other products (not rowwise's: its scales are powers of two, so a rank's own scale
    differs from serial's by a power of two, which moves exponents only, and its FP8 values dequantise to
    serial's outside the subnormal range)."""
    for rank in run_ranks(2, _gemms_at_tp2_and_cp2, recipe, True):
        assert max(rank["tp"] + rank["cp"]) < 1e-5, rank
    if recipe == "rowwise":
        return
    if recipe != "blockwise":           # its blocks are whole on every TP rank; only CP's token tiles are shared
        assert all(max(rank["tp"]) > 1e-3 for rank in run_ranks(2, _gemms_at_tp2_and_cp2, recipe, False))
    assert all(max(rank["cp"]) > 1e-3 for rank in run_ranks(2, _gemms_at_tp2_and_cp2, recipe, False))


def _histories(path: str) -> dict:
    from megalite.checkpoint.files import CheckpointReader
    reader = CheckpointReader(path)
    return {name: reader.tensor(name) for name in reader.names() if name.endswith("_amax_history")}


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [(SP, {}), ({}, SP)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_delayed_history_reshards_between_tp2_and_serial(tmp_path, saved, resumed):
    """Saved after two steps at one layout, the amax histories are serial's (TP=2: the step amaxes reduced over
    the TP ranks, equal to fp32 rounding, which the FP8 flips of the backward grow to 1e-3); resumed at the
    other layout, the first resumed step logs the uninterrupted run's loss and gradient norm."""
    save, reference = str(tmp_path / "ckpt"), str(tmp_path / "serial")
    nproc = lambda flags: 2 if flags else 1                       # noqa: E731
    uninterrupted = train(nproc(saved), flags_of("delayed", save=save, save_interval=2, **saved))
    train(1, flags_of("delayed", save=reference, save_interval=2, exit_interval=2))
    ours, theirs = _histories(os.path.join(save, "iter_0000002")), _histories(os.path.join(reference, "iter_0000002"))
    assert sorted(ours) == sorted(theirs) and len(ours) == 2 * 4 * 3, sorted(ours)      # layers x linears x roles
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], rtol=1e-3, atol=0), (name, ours[name], theirs[name])
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")                                   # resume from the iteration-2 checkpoint
    continued = train(nproc(resumed), flags_of("delayed", load=save, **resumed))
    assert sorted(continued) == [3, 4], continued
    assert continued[3][0] == pytest.approx(uninterrupted[3][0], rel=1e-5, abs=1e-5)
    assert continued[3][1] == pytest.approx(uninterrupted[3][1], rel=1e-4, abs=1.001e-3)


def test_delayed_checkpoint_resumed_with_another_recipe_is_one_line(tmp_path):
    save = str(tmp_path / "ckpt")
    train(1, flags_of("delayed", save=save, save_interval=1, exit_interval=1))
    proc = run_pretrain(1, with_flags(ARGV, load=save, **flags_of("tensorwise")))
    assert proc.returncode != 0
    error = [line for line in proc.stderr.splitlines() + proc.stdout.splitlines() if "--fp8-recipe" in line]
    assert error and "resume it with --fp8-recipe delayed" in error[-1], proc.stderr[-2000:]
