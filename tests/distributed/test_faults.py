"""How runs stop: signals, time and iteration limits, NaNs, and dead or stuck ranks.

Each case runs pretrain_gpt.py as a user would and checks the exit code, the one line that says why,
and that the checkpoint left behind resumes to the losses of a run that never stopped.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from harness import ROOT, free_port, logged_losses, run_pretrain, run_ranks
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

# constant LR: a run stopped early and a run of any length follow the same schedule
STEADY = with_flags(TINY_LLAMA_ARGS, lr_decay_style="constant", lr_warmup_iters=0, hidden_dropout=0.1,
                    global_batch_size=8)
PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")
ENV = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_single(argv, timeout=300):
    return subprocess.run([sys.executable, PRETRAIN, *argv], capture_output=True, text=True, timeout=timeout, env=ENV)


def launch_ranks(n, argv, script=PRETRAIN, extra_env=None):
    """n ranks started the way SLURM's srun does (no torchrun agent between them and the signal)."""
    port = free_port()
    procs = []
    for rank in range(n):
        env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), **(extra_env or {})}
        procs.append(subprocess.Popen([sys.executable, script, *argv], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    return procs


def wait_for_line(proc, fragment, timeout=120):
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if fragment in line:
            return seen
    raise AssertionError(f"{fragment!r} never appeared:\n{''.join(seen)[-2000:]}")


# ---- signals and exit limits -------------------------------------------------------------------------
def test_sigterm_to_one_rank_makes_every_rank_save_and_exit_0(tmp_path):
    """SLURM sends SIGTERM before its time limit. Only rank 0 gets it here: the ranks agree, finish the
    iteration, save, and both exit 0. Resuming repeats the uninterrupted run's losses bit for bit."""
    save = str(tmp_path / "ck")
    procs = launch_ranks(2, with_flags(STEADY, train_iters=400) + ["--exit-signal-handler", "--save", save])
    seen = wait_for_line(procs[1], "iteration        3/")       # the last rank logs
    procs[0].send_signal(signal.SIGTERM)
    out, err = procs[1].communicate(timeout=120)
    procs[0].communicate(timeout=60)
    assert [p.returncode for p in procs] == [0, 0], err[-2000:]
    stopped_at = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    assert f"exiting at iteration {stopped_at}: received SIGTERM" in out
    before = logged_losses("".join(seen) + out)

    later = with_flags(STEADY, train_iters=stopped_at + 3)
    resumed = logged_losses(run_pretrain(2, later + ["--load", save]).stdout)
    reference = logged_losses(run_pretrain(2, later).stdout)
    assert sorted(resumed) == list(range(stopped_at + 1, stopped_at + 4))
    assert all(resumed[i] == reference[i] for i in resumed)
    assert all(before[i] == reference[i] for i in before if i in reference)


@pytest.mark.parametrize("flags, stop_at, reason", [
    (["--exit-interval", "3"], 3, "--exit-interval 3 reached"),
    (["--exit-duration-in-mins", "0.00001"], 1, "--exit-duration-in-mins 1e-05 reached"),
])
def test_exit_limits_save_and_exit_0(tmp_path, flags, stop_at, reason):
    save = str(tmp_path / "ck")
    proc = run_single(with_flags(STEADY, train_iters=10) + flags + ["--save", save])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"exiting at iteration {stop_at}: {reason}" in proc.stdout
    assert max(logged_losses(proc.stdout)) == stop_at
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == str(stop_at)
    assert "at the end of training" not in proc.stdout


# ---- numerical faults --------------------------------------------------------------------------------
EXPLODING = with_flags(STEADY, lr=1e30, train_iters=4)       # the first update overflows the weights


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_a_nan_gradient_stops_the_run_before_the_update_lands(tmp_path, precision):
    save = tmp_path / "ck"
    proc = run_single(EXPLODING + precision + ["--save", str(save), "--save-interval", "1"])
    assert proc.returncode == 1
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "error: iteration 2:" in err and "gradient norm nan" in err and "update was not applied" in err
    assert "iter_0000001" in err and "--skip-nan-iterations" in err
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest_checkpointed_iteration.txt", "metrics.jsonl"]
    from megalite.checkpoint.sharded import load_model
    model = load_model(str(save))                     # the checkpoint before the fault loads and is finite
    assert all(p.isfinite().all() for p in model.parameters())


def test_skip_nan_iterations_counts_them_and_goes_on(tmp_path):
    proc = run_single(EXPLODING + ["--skip-nan-iterations", "--save", str(tmp_path / "ck")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = [line for line in proc.stdout.splitlines() if "iteration        4/" in line][0]
    assert "number of nan iterations:   3" in last and "(--skip-nan-iterations: going on)" in proc.stdout


def _nonfinite_ranks(rank, world):
    import torch
    from megalite.train.faults import ranks_with_nonfinite_loss
    return ranks_with_nonfinite_loss(torch.tensor(float("nan") if rank == 2 else 1.0), torch.device("cpu"))


def test_every_rank_learns_which_rank_had_the_nan_loss():
    assert run_ranks(3, _nonfinite_ranks) == [[2], [2], [2]]


# ---- dead and stuck ranks -----------------------------------------------------------------------------
FAULTY_RANK = """
import os, sys, time
sys.path.insert(0, {root!r})
import megalite.train.loop as loop
original, calls = loop.train_step, []
def faulty(trainer, data):
    calls.append(1)
    if os.environ["FAULT"] == "die-while-peer-computes" and len(calls) == 3:
        if int(os.environ["RANK"]) == 1:
            os._exit(7)
        time.sleep(30)                   # rank 0 "computes" until torchrun SIGTERMs it (0.1 s after rank 1 exits)
    if int(os.environ["RANK"]) == 1 and len(calls) == 3:
        if os.environ["FAULT"] == "die":
            time.sleep(2)                # rank 0 now waits on this rank in a collective (its step is < 2 s)
            os._exit(7)
        time.sleep(300)                  # stuck: alive but never reaching the next collective
    return original(trainer, data)
loop.train_step = faulty
import pretrain_gpt
sys.exit(pretrain_gpt.main(sys.argv[1:]))
"""


STOPPED = "stopped by SIGTERM during iteration 3: the training step (torchrun sends it when another rank has exited"


@pytest.mark.parametrize("fault, message, also", [
    # the stuck rank, stopped by torchrun once rank 0 gave up on it, says where it was stuck
    ("hang", "no answer within --distributed-timeout-minutes 0.1", ["error: rank 1: " + STOPPED]),
    ("die-while-peer-computes", STOPPED, []),
])
def test_a_dead_or_stuck_rank_ends_the_others_with_one_line(tmp_path, fault, message, also):
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY_RANK.format(root=ROOT))
    argv = with_flags(STEADY, train_iters=20) + ["--distributed-timeout-minutes", "0.1"]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), *argv], capture_output=True, text=True, timeout=240,
                          env={**ENV, "FAULT": fault})
    assert proc.returncode != 0                      # torchrun reports the failed run
    assert time.monotonic() - start < 120
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    rank0 = [line for line in ours if line.startswith("error: rank 0: ")]
    assert len(rank0) == 1 and message in rank0[0], proc.stderr[-3000:]
    assert "during " in rank0[0]                     # names what the run was doing
    others = sorted(line for line in ours if line not in rank0)
    assert len(others) == len(also) and all(o.startswith(a) for o, a in zip(others, also)), proc.stderr[-3000:]


def test_a_rank_that_dies_mid_collective_is_named_by_its_peer(tmp_path):
    """Started as srun starts ranks, with no agent to SIGTERM the survivor: rank 0, waiting on rank 1 in a
    collective when rank 1 dies, learns it from gloo and says so in one line. Under torchrun the same
    line is a race against the agent's SIGTERM, 0.1 s after the death, on a loaded machine."""
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY_RANK.format(root=ROOT))
    argv = with_flags(STEADY, train_iters=20) + ["--distributed-timeout-minutes", "0.5"]
    start = time.monotonic()
    procs = launch_ranks(2, argv, script=str(script), extra_env={"FAULT": "die"})
    (_, err0), _ = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [1, 7], err0[-3000:]
    assert time.monotonic() - start < 120
    ours = [line for line in err0.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and "a peer rank died" in ours[0] and "during " in ours[0], err0[-3000:]
