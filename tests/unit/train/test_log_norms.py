"""--log-params-norm / --log-num-zeros-in-grad / --log-timers-to-tensorboard: the values, and the fields
in the stdout line, JSONL, tensorboard and wandb."""

import glob
import json
import os

import pytest
import torch

from megalite.train.command_line import parse_args
from megalite.train.trainer import build_trainer
from megalite.train.loop import optional_norms
from megalite.train.step import train_step
from megalite_test_utils import TINY_LLAMA_ARGS, log_field, masked_micro_batches, run_pretrain, wandb_offline_history, with_flags


def test_params_norm_and_num_zeros_values():
    """The whole model's parameter L2 norm and count of zero gradient elements (the padded vocabulary
    rows of the embedding and output layer, 56 x 64 each, get no gradient)."""
    argv = with_flags(TINY_LLAMA_ARGS, log_params_norm=True, log_num_zeros_in_grad=True)
    trainer = build_trainer(parse_args(argv, world_size=1))
    train_step(trainer, iter(masked_micro_batches()[:2]))
    norms = optional_norms(trainer)
    params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    assert norms["params norm"] == pytest.approx(float(params.norm()), rel=1e-6)
    assert norms["num zeros"] == float((trainer.buffer.grad_data == 0).sum())
    assert norms["num zeros"] >= 2 * 56 * 64


def test_log_fields_in_stdout_jsonl_tensorboard_and_wandb(tmp_path):
    pytest.importorskip("wandb")
    os.environ["WANDB_MODE"] = "offline"
    argv = with_flags(TINY_LLAMA_ARGS, train_iters=4, log_interval=2, log_params_norm=True, log_num_zeros_in_grad=True,
                      log_timers_to_tensorboard=True, timing_log_level=1, tensorboard_dir=str(tmp_path / "tb"),
                      wandb_project="megalite-test", wandb_save_dir=str(tmp_path / "wandb"))
    _, log = run_pretrain(argv)
    line = [l for l in log.splitlines() if f" iteration {4:8d}/" in l][0]
    # Megatron's order: ... grad norm | num zeros | params norm | number of skipped iterations ...
    assert line.index("| grad norm: ") < line.index("| num zeros: ") < line.index("| params norm: ") \
        < line.index("| number of skipped iterations:")
    records = [json.loads(l) for l in open(tmp_path / "tb" / "metrics.jsonl")]
    assert [r["iteration"] for r in records] == [2, 4]
    for r in records:
        assert r["params norm"] > 0 and r["num zeros"] >= 0 and r["iteration-time"] > 0
        assert r["time forward-backward (ms)"] > 0
    assert records[-1]["params norm"] == pytest.approx(log_field(log, 4, "params norm"), abs=1e-3)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    scalars = EventAccumulator(glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))[0])
    scalars.Reload()
    for key in ("params norm", "num zeros", "iteration-time", "time forward-backward (ms)"):
        assert [e.step for e in scalars.Scalars(key)] == [2, 4], key
    content = wandb_offline_history(str(tmp_path / "wandb"))
    for r in records:       # values are stored as JSON text (a whole float as an integer)
        assert repr(r["params norm"]).encode() in content and b"%d" % r["num zeros"] in content
    assert b"num zeros" in content and b"iteration-time" in content
