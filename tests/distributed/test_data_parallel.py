"""Data parallelism and ZeRO: the training step at DP=2 and DP=4 with every sharding strategy, with and
without overlap, equals the single-process run; memory per rank, bytes per collective and the timing
of reductions match what the design promises. Each spawn serves many checks (module fixtures). The default
tier runs every strategy once (overlap on and off at DP=2 and DP=4), bf16 ZeRO-3, fp16 ZeRO-2 and the fp16
overflow; the other layouts run in the slow tier (one more spawn per size)."""
import pytest

from dp_workloads import (STRATEGIES, collective_traffic, equivalence_and_eval, layout_flags, memory_by_strategy,
                          overlap_timeline, zero3_gather_trace)
from harness import run_ranks

FP32_LAYOUTS = [(s, overlap) for s in STRATEGIES for overlap in (False, True)]
# the default tier's fp32 cases: every strategy once, overlap on and off at each size; the rest is slow
DEFAULT_FP32 = {2: [("optim", False), ("optim_grads_params", True)], 4: [("no_shard", True), ("optim_grads", False)]}
# mixed precision: fp32 master weights and (fp16) the loss scaler under the distributed optimizer
MIXED = [("bf16", "optim"), ("bf16", "optim_grads_params"), ("fp16", "optim"), ("fp16", "optim_grads")]
DEFAULT_MIXED = [("bf16", "optim_grads_params"), ("fp16", "optim_grads")]
OVERFLOW = dict(fp16=True, initial_loss_scale=2.0 ** 40, hysteresis=1)   # the first steps overflow and skip
OVERFLOW_CASE = ("overflow", "optim_grads_params", True)
# (precision, strategy, overlap) of every spawned equivalence case, by data-parallel size
ALL_CASES = {2: [("fp32", s, o) for s, o in FP32_LAYOUTS] + [(p, s, True) for p, s in MIXED] + [OVERFLOW_CASE],
             4: [("fp32", s, o) for s, o in FP32_LAYOUTS]}
DEFAULT_CASES = {2: [("fp32", s, o) for s, o in DEFAULT_FP32[2]] + [(p, s, True) for p, s in DEFAULT_MIXED]
                 + [OVERFLOW_CASE],
                 4: [("fp32", s, o) for s, o in DEFAULT_FP32[4]]}


def mixed_flags(precision):
    return {precision: True, "initial_loss_scale": 4096} if precision == "fp16" else {precision: True}


def case_flags(case):
    precision, strategy, overlap = case
    extra = OVERFLOW if precision == "overflow" else {} if precision == "fp32" else mixed_flags(precision)
    return layout_flags(strategy, overlap, **extra)


def slow_unless(default, *values):
    return pytest.param(*values, marks=() if default else pytest.mark.slow)


class Reference(dict):
    """precision -> the single-process run the layouts are compared with, computed on first use."""

    def __missing__(self, precision):
        self[precision] = value = equivalence_and_eval(0, 1, [case_flags((precision, "no_shard", False))])[0]
        return value


@pytest.fixture(scope="module")
def reference():
    return Reference()


@pytest.fixture(scope="module")
def dp2():
    return run_ranks(2, equivalence_and_eval, [case_flags(c) for c in DEFAULT_CASES[2]])


@pytest.fixture(scope="module")
def dp4():
    return run_ranks(4, _dp4_everything, [case_flags(c) for c in DEFAULT_CASES[4]])


@pytest.fixture(scope="module")
def slow_cases():
    """world -> per-rank results of the cases the default tier leaves out, one spawn per size."""
    rest = {w: [c for c in ALL_CASES[w] if c not in DEFAULT_CASES[w]] for w in ALL_CASES}
    return {w: (cases, run_ranks(w, equivalence_and_eval, [case_flags(c) for c in cases])) for w, cases in rest.items()}


@pytest.fixture
def results(request):
    """(world, case) -> every rank's result of that case, from the spawn that ran it."""
    def lookup(world, case):
        if case in DEFAULT_CASES[world]:
            i = DEFAULT_CASES[world].index(case)
            ranks = request.getfixturevalue(f"dp{world}")
            return [r[i] if world == 2 else r["equivalence"][i] for r in ranks]
        cases, ranks = request.getfixturevalue("slow_cases")[world]
        return [r[cases.index(case)] for r in ranks]
    return lookup


def _dp4_everything(rank, world, layouts):
    return {"equivalence": equivalence_and_eval(rank, world, layouts),
            "memory": memory_by_strategy(rank, world, ["bf16", "fp32"]),
            "traffic": collective_traffic(rank, world, list(STRATEGIES)),
            "timeline": overlap_timeline(rank, world, [(s, o) for s in ("no_shard", "optim", "optim_grads")
                                                       for o in (False, True)]),
            "zero3": zero3_gather_trace(rank, world, overlap=True)}


def assert_matches(ref, got, rel, what):
    for i, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        assert b == pytest.approx(a, rel=rel), f"{what}: loss of step {i + 1}"
    for i, (a, b) in enumerate(zip(ref["norms"], got["norms"])):
        if a is None:
            assert b is None, f"{what}: step {i + 1} should have been skipped"
        else:
            assert b == pytest.approx(a, rel=10 * rel), f"{what}: grad norm of step {i + 1}"
    assert got["updated"] == ref["updated"], what
    assert got["eval"] == pytest.approx(ref["eval"], rel=rel), f"{what}: held-out loss of the final model"


# ---- equivalence with the single-process run ------------------------------------------------------
@pytest.mark.parametrize("world, strategy, overlap", [slow_unless((s, o) in DEFAULT_FP32[w], w, s, o)
                                                     for w in (2, 4) for s, o in FP32_LAYOUTS])
def test_every_strategy_with_and_without_overlap_equals_one_process(world, strategy, overlap, reference, results):
    got = results(world, ("fp32", strategy, overlap))
    what = f"DP={world} {strategy} overlap={overlap}"
    for rank in range(world):                    # every rank logs the DP-averaged loss
        assert_matches(reference["fp32"], got[rank], 1e-5, f"{what} rank {rank}")


@pytest.mark.parametrize("precision, strategy", [slow_unless((p, s) in DEFAULT_MIXED, p, s) for p, s in MIXED])
def test_bf16_and_fp16_keep_fp32_masters_and_the_loss_scaler_under_zero(reference, results, precision, strategy):
    got = results(2, (precision, strategy, True))[0]
    assert got["master_dtype"] == "torch.float32"
    # same updates; low-precision rounding of the forward differs only through reduction order
    assert_matches(reference[precision], got, 1e-4, f"{precision} {strategy}")


def test_fp16_overflow_skips_the_same_steps_on_every_rank(reference, results):
    got = results(2, OVERFLOW_CASE)
    ref = reference["overflow"]
    assert not ref["updated"][0], "the reference must overflow at first"
    for rank_result in got:
        assert rank_result["updated"] == ref["updated"]
        assert rank_result["loss_scale"] == ref["loss_scale"]
        assert_matches(ref, rank_result, 1e-4, "fp16 overflow ZeRO-3")


# ---- memory per rank --------------------------------------------------------------------------------
def test_sharded_bytes_per_rank_follow_the_zero_formulas(dp4):
    d = 4
    for rank, result in enumerate(dp4):
        mem = result["memory"]
        for (precision, strategy), m in mem.items():
            psi = m["psi"]
            elt = 2 if precision == "bf16" else 4
            shards = 1 if strategy == "no_shard" else d
            opt_per_param = 12 if precision == "bf16" else 8          # fp32 models: weights are the master
            assert m["optimizer"] == pytest.approx(opt_per_param * psi / shards, rel=0.02), (precision, strategy)
            assert m["theoretical"] == round(opt_per_param * psi / shards)
            grad_shards = d if strategy in ("optim_grads", "optim_grads_params") else 1
            assert m["gradients"] == pytest.approx(4 * psi / grad_shards, rel=0.02), (precision, strategy)
            param_shards = d if strategy == "optim_grads_params" else 1
            assert m["parameters"] == pytest.approx(elt * psi / param_shards, rel=0.02), (precision, strategy)


def test_zero3_gathers_one_layer_at_a_time_and_frees_it(dp4):
    z = dp4[0]["zero3"]
    assert z["start"] == z["shard"] == z["after"], "only the shard is held outside forward/backward"
    for layer, gathered in z["trace"]:
        assert layer in gathered
        assert all(j in (layer, layer + 1) for j in gathered), f"layer {layer}: gathered {gathered}"  # +1: prefetch
    assert z["peak"] < 0.75 * z["full"] + z["shard"]


# ---- bytes moved per step (ring algorithms) --------------------------------------------------------------
def ring_bytes_per_rank(calls, d):
    """Bytes each rank sends with ring algorithms: all-reduce 2(d-1)/d, reduce-scatter and all-gather
    (d-1)/d of the full tensor."""
    factor = {"all_reduce": 2 * (d - 1) / d, "reduce_scatter": (d - 1) / d, "all_gather_single": (d - 1) / d}
    return sum(factor[op] * nbytes for op, nbytes in calls)


def test_collectives_move_the_ring_algorithm_bytes(dp4):
    d = 4
    for rank, result in enumerate(dp4):
        traffic = result["traffic"]
        for strategy, t in traffic.items():
            m, numel, psi = t["microbatches"], t["numel"], t["psi"]
            assert numel - psi <= d * len(t["bucket_numels"])           # padding only
            grads = [(op, b) for op, b in t["calls"] if b > 64]           # the loss / norm scalars are not counted
            by_op = {}
            for op, nbytes in grads:
                by_op.setdefault(op, []).append(nbytes)
            fp32_grads = [4 * n for n in t["bucket_numels"]]
            if strategy == "no_shard":
                assert sorted(by_op) == ["all_reduce"]
                assert sorted(by_op["all_reduce"]) == sorted(fp32_grads)   # every bucket once, after the last micro-batch
                expected = 2 * (d - 1) / d * 4 * psi
            elif strategy == "optim":
                assert sorted(by_op) == ["all_gather_single", "reduce_scatter"]
                assert sorted(by_op["reduce_scatter"]) == sorted(fp32_grads)
                assert sorted(by_op["all_gather_single"]) == sorted(4 * n for n in t["bucket_numels"])
                expected = (d - 1) / d * (4 * psi + 4 * psi)
            elif strategy == "optim_grads":                          # reduce-scatter every micro-batch
                assert sorted(by_op["reduce_scatter"]) == sorted(fp32_grads * m)
                assert sum(by_op["all_gather_single"]) == 4 * numel
                expected = (d - 1) / d * (m * 4 * psi + 4 * psi)
            else:       # ZeRO-3: every unit gathered in forward, all but the embedding again in backward
                layers = sum(t["backward_gathered_numels"])
                assert sorted(by_op["reduce_scatter"]) == sorted(fp32_grads * m)
                assert sum(by_op["all_gather_single"]) == 4 * m * (numel + layers)
                expected = (d - 1) / d * m * (4 * psi + 4 * psi + 4 * layers)
            assert ring_bytes_per_rank(grads, d) == pytest.approx(expected, rel=1e-3), strategy


# ---- when reductions happen ---------------------------------------------------------------------------
def test_overlap_starts_reductions_during_the_last_backward_only(dp4):
    for (strategy, overlap), t in dp4[0]["timeline"].items():
        events, m = t["events"], t["microbatches"]
        assert m == 2 and t["buckets"] > 2
        grads = [i for i, e in enumerate(events) if e == "grad"]
        reduces = [i for i, e in enumerate(events) if e == "reduce"]
        assert len(grads) == m and reduces
        if strategy == "optim_grads":        # ZeRO-2 keeps no full gradient: reduce-scatter every micro-batch
            assert sum(r < grads[0] for r in reduces) == t["buckets"]
            assert len(reduces) == m * t["buckets"]
            continue
        assert min(reduces) > grads[m - 2], f"{strategy}: a reduction before the last micro-batch"
        if overlap:
            assert min(reduces) < grads[-1], f"{strategy}: no reduction overlapped the last backward"
        else:
            assert min(reduces) > grads[-1], f"{strategy}: reduction before backward finished"


# ---- composed with tensor and pipeline parallelism ----------------------------------------------------
@pytest.mark.parametrize("strategy", [slow_unless(False, "optim"), "optim_grads_params"])
def test_tp2_sp_pp2_interleaved_dp2_with_zero1_and_zero3_equals_one_process(strategy):
    """ZeRO-3 in the default tier, ZeRO-1 in the slow tier (one spawn of 8 ranks each)."""
    extra = dict(num_layers=4, tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2,
                 num_layers_per_virtual_pipeline_stage=1)
    reference = equivalence_and_eval(0, 1, [layout_flags("no_shard", False, num_layers=4)])[0]
    results = run_ranks(8, equivalence_and_eval, [layout_flags(strategy, True, **extra)])
    for rank in range(8):
        got = results[rank][0]
        for a, b in zip(reference["norms"], got["norms"]):          # every rank clips by the global norm
            assert b == pytest.approx(a, rel=1e-4), f"{strategy} rank {rank}"
        if rank >= 4:                                              # the last stage holds the loss
            assert_matches(reference, got, 1e-5, f"TP2 SP PP2 VPP DP2 {strategy} rank {rank}")
