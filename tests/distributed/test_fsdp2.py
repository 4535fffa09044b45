"""PyTorch FSDP2 as the data-parallel backend (--use-torch-fsdp2, megalite/parallel/data/fsdp2.py).

Equivalence with the single-process run (10 steps, same seed and global batch) at DP=2, DP=4,
DP=2 x TP=2 with sequence parallelism, and DP=2 x PP=2 (tied embeddings, so the embedding-group gradient
sum runs over FSDP2 shards), in fp32 and bf16; checkpoints both ways between FSDP2 and megalite's own
ZeRO-3 with resume equal to the uninterrupted losses, plus load_model and HF export from an FSDP2
checkpoint; one-line refusals of what FSDP2 cannot combine with.

Tolerances. fp32: rel 1e-5 on the losses (as every other parallel-equivalence test; measured <= 7e-8)
and 1e-4 on the grad norms (measured <= 4e-6). bf16, against the serial bf16 run: the bf16 weights
are rounded from the same fp32 masters and each micro-batch's forward is the same, but the fp32
gradient sums run in another order (over ranks, micro-batch by micro-batch; with TP also the bf16
partial sums), which now and then moves a weight to the neighbouring bf16 value (2^-8 relative).
Measured over 10 steps at every layout here: losses <= 2.5e-5, grad norms <= 3e-4 relative; the bounds
are ten times that, 2e-4 and 3e-3. The grad norm is checked because Adam's scale invariance hides some
wrong reductions from the loss (a missed 1/dp doubles the norm).

Default suite: one spawn of 2 ranks (DP=2 fp32 with both overlaps, DP=2 bf16, ZeRO-2 mode,
the checkpoint round trips) and one of 4 ranks (DP=4, DP=2 x TP=2 + SP, DP=2 x PP=2, fp32). Slow: the bf16
variants at 4 ranks; fp16 with loss scaling and full recompute at DP=2.
"""
import os

import pytest
import torch
from torch.utils.data import DataLoader

from dp_workloads import DP_ARGS, SyntheticTokens, train_layouts
from harness import run_ranks
from megalite.train.command_line import parse_args
from megalite.checkpoint.save import save_checkpoint
from megalite.checkpoint.sharded import load_checkpoint, load_model
from megalite.data.samplers import MegatronPretrainingSampler
from megalite.errors import UserError
from megalite.train.trainer import build_trainer
from megalite.train.step import train_step
from megalite_test_utils import with_flags

STEPS = 10
FSDP2 = with_flags(DP_ARGS, use_torch_fsdp2=True, global_batch_size=8)   # 1-2 micro-batches per rank
OVERLAP = with_flags(FSDP2, overlap_grad_reduce=True, overlap_param_gather=True)
ZERO2_MODE = with_flags(FSDP2, data_parallel_sharding_strategy="optim_grads")
RECOMPUTE = with_flags(FSDP2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
FP16 = with_flags(FSDP2, fp16=True, initial_loss_scale=4096)      # megalite's loss scaler over fp32 shards
TP2_SP = with_flags(FSDP2, tensor_model_parallel_size=2, sequence_parallel=True)
PP2_TIED = with_flags(FSDP2, pipeline_model_parallel_size=2, untie_embeddings_and_output_weights=None)
ZERO3 = with_flags(DP_ARGS, data_parallel_sharding_strategy="optim_grads_params", global_batch_size=8)
FP32, BF16 = (1e-5, 1e-4), (2e-4, 3e-3)     # relative (losses, grad norms)
BEFORE, AFTER = 2, 2                 # checkpoint round trip: steps before the save and after it


def bf16(argv):
    return with_flags(argv, bf16=True)


_serial_runs = {}


def serial(argv) -> dict:
    """The single-process run (megalite's own data parallelism at DP=1) of the model flags of ``argv``."""
    plain = with_flags(argv, use_torch_fsdp2=None, tensor_model_parallel_size=None, sequence_parallel=None,
                       pipeline_model_parallel_size=None, overlap_grad_reduce=None, overlap_param_gather=None,
                       data_parallel_sharding_strategy=None)
    if tuple(plain) not in _serial_runs:
        _serial_runs[tuple(plain)] = train_layouts(0, 1, [plain], STEPS)[0]
    return _serial_runs[tuple(plain)]


def assert_equal_runs(run, reference, tolerance):
    assert run["losses"] == pytest.approx(reference["losses"], rel=tolerance[0])
    assert run["norms"] == pytest.approx(reference["norms"], rel=tolerance[1])


# ---- checkpoints: FSDP2 <-> megalite ZeRO-3 ------------------------------------------------------------
def batches_from(trainer, first_step: int, steps: int):
    t = trainer.config.training
    total = (first_step + steps) * t.global_batch_size
    sampler = MegatronPretrainingSampler(total, first_step * t.global_batch_size, t.micro_batch_size,
                                         trainer.parallel.dp_rank, trainer.parallel.dp_size)
    return iter(DataLoader(SyntheticTokens(total), batch_sampler=sampler))


def save_and_go_on(argv, world: int, directory: str) -> list[float]:
    """BEFORE steps, save, AFTER more steps: the uninterrupted losses after the save."""
    trainer = build_trainer(parse_args(argv, world_size=world))
    data = batches_from(trainer, 0, BEFORE + AFTER)
    for _ in range(BEFORE):
        train_step(trainer, data)
    trainer.state.iteration = BEFORE
    trainer.state.consumed_train_samples = BEFORE * trainer.config.training.global_batch_size
    save_checkpoint(trainer.checkpoint_state, directory)
    return [float(train_step(trainer, data)[0]) for _ in range(AFTER)]


def resume(argv, world: int, directory: str) -> list[float]:
    trainer = build_trainer(parse_args(argv, world_size=world))
    load_checkpoint(trainer.checkpoint_state, directory, log=lambda *_: None)
    assert trainer.state.iteration == BEFORE
    data = batches_from(trainer, BEFORE, AFTER)
    return [float(train_step(trainer, data)[0]) for _ in range(AFTER)]


def two_ranks(rank: int, world: int, tmp: str) -> dict:
    out = {"runs": train_layouts(rank, world, [OVERLAP, bf16(FSDP2), ZERO2_MODE], STEPS)}
    for name, argv in (("fsdp2", FSDP2), ("zero3", ZERO3), ("fsdp2_bf16", bf16(FSDP2))):
        out[f"uninterrupted_{name}"] = save_and_go_on(argv, world, os.path.join(tmp, name))
    out["zero3_from_fsdp2"] = resume(ZERO3, world, os.path.join(tmp, "fsdp2"))
    out["fsdp2_from_zero3"] = resume(FSDP2, world, os.path.join(tmp, "zero3"))
    out["zero3_bf16_from_fsdp2_bf16"] = resume(bf16(ZERO3), world, os.path.join(tmp, "fsdp2_bf16"))
    return out


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("fsdp2"))
    return tmp, run_ranks(2, two_ranks, tmp)


@pytest.fixture(scope="module")
def references():
    return {"fp32": serial(FSDP2), "bf16": serial(bf16(FSDP2))}


def test_dp2_equals_serial_in_fp32_and_bf16(dp2, references):
    _, results = dp2
    overlap, half, zero2_mode = results[0]["runs"]
    assert_equal_runs(overlap, references["fp32"], FP32)
    assert_equal_runs(zero2_mode, references["fp32"], FP32)
    assert_equal_runs(half, references["bf16"], BF16)
    assert results[1]["runs"][0]["losses"] == overlap["losses"]        # both ranks log the DP-mean loss


@pytest.mark.slow
def test_dp2_fp16_with_loss_scaling_and_full_recompute_equal_serial():
    fp16, recompute = run_ranks(2, four_ranks, [FP16, RECOMPUTE])[0]
    assert_equal_runs(recompute, serial(RECOMPUTE), FP32)
    reference = serial(FP16)
    # fp16: the same steps are skipped for overflow (norm None) while the scale backs off, then the same updates
    assert fp16["losses"] == pytest.approx(reference["losses"], rel=BF16[0])
    assert [n is None for n in fp16["norms"]] == [n is None for n in reference["norms"]]
    assert any(n is not None for n in fp16["norms"])
    assert [n for n in fp16["norms"] if n] == pytest.approx([n for n in reference["norms"] if n], rel=BF16[1])


def test_checkpoints_resume_both_ways_between_fsdp2_and_zero3(dp2):
    _, results = dp2
    for out in results:
        assert out["zero3_from_fsdp2"] == pytest.approx(out["uninterrupted_fsdp2"], rel=FP32[0])
        assert out["fsdp2_from_zero3"] == pytest.approx(out["uninterrupted_zero3"], rel=FP32[0])
        assert out["uninterrupted_fsdp2"] == pytest.approx(out["uninterrupted_zero3"], rel=FP32[0])
        # bf16: the FSDP2 shards are the fp32 masters, stored under the weights' names; ZeRO-3 resumes from them
        assert out["zero3_bf16_from_fsdp2_bf16"] == pytest.approx(out["uninterrupted_fsdp2_bf16"], rel=FP32[0])


def test_load_model_and_hf_export_read_an_fsdp2_checkpoint(dp2, tmp_path):
    tmp, _ = dp2
    from_fsdp2, from_zero3 = load_model(os.path.join(tmp, "fsdp2")), load_model(os.path.join(tmp, "zero3"))
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(from_fsdp2(tokens), from_zero3(tokens), rtol=1e-4, atol=1e-4)
    from megalite.checkpoint.hf import megalite_to_hf
    megalite_to_hf(os.path.join(tmp, "fsdp2"), str(tmp_path / "hf"), log=lambda *_: None)
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, from_fsdp2(tokens), rtol=1e-4, atol=1e-4)


# ---- four ranks: DP=4, DP=2 x TP=2 + SP, DP=2 x PP=2 -------------------------------------------------------
LAYOUTS_4 = {"dp4": FSDP2, "dp2_tp2_sp": TP2_SP, "dp2_pp2": PP2_TIED}


def four_ranks(rank: int, world: int, layouts: list) -> list:
    return train_layouts(rank, world, layouts, STEPS)


def check_four_ranks(precision: str, tolerance: tuple):
    layouts = [a if precision == "fp32" else bf16(a) for a in LAYOUTS_4.values()]
    results = run_ranks(4, four_ranks, layouts)[-1]        # the last rank is on the last pipeline stage
    for name, argv, run in zip(LAYOUTS_4, layouts, results):
        reference = serial(argv)
        try:
            assert_equal_runs(run, reference, tolerance)
        except AssertionError as e:
            raise AssertionError(f"{name} ({precision}): {e}") from None


def test_dp4_tp2_sp_and_pp2_equal_serial_in_fp32():
    check_four_ranks("fp32", FP32)


@pytest.mark.slow
def test_dp4_tp2_sp_and_pp2_equal_serial_in_bf16():
    check_four_ranks("bf16", BF16)


# ---- refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, words", [
    ({"use_distributed_optimizer": True}, "drop --use-distributed-optimizer"),
    ({"data_parallel_sharding_strategy": "optim"}, "optim_grads_params"),
    ({"data_parallel_sharding_strategy": "no_shard"}, "always shards"),
    ({"ddp_bucket_size": 1000}, "--ddp-bucket-size"),
])
def test_bad_combinations_are_refused_in_one_line(extra, words):
    with pytest.raises(UserError) as e:
        parse_args(with_flags(FSDP2, **extra), world_size=2)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_sharding_strategy_picks_reshard_after_forward():
    assert parse_args(FSDP2, world_size=2).parallel.data_parallel_sharding_strategy == "optim_grads_params"
    assert parse_args(ZERO2_MODE, world_size=2).parallel.data_parallel_sharding_strategy == "optim_grads"
