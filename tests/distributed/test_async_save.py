"""--async-save: checkpoints written in the background are the synchronous ones, byte for byte; a run
killed during one resumes exactly from the newest published checkpoint; every way a run ends waits for
the save in flight.

The slow tier kills 20 runs at random points during async saves (test_async_save_kills_resume_exactly).
"""
import json
import os
import signal
import random
import time

import pytest

from harness import logged_losses, run_pretrain
from jobs import Job, read_until
from megalite.checkpoint.files import TRACKER, CheckpointReader
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

ZERO = with_flags(TINY_LLAMA_ARGS, train_iters=6, hidden_dropout=0.1) + ["--use-distributed-optimizer",
                                                                         "--save-interval", "2"]


def tree_bytes(directory: str) -> dict[str, bytes]:
    """{relative path: content} of a checkpoint; metadata.json without the run's own arguments (--save and
    --async-save differ between the runs compared)."""
    out = {}
    for base, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(base, name)
            data = open(path, "rb").read()
            if name == "metadata.json":
                metadata = json.loads(data)
                metadata.pop("args")
                data = json.dumps(metadata, sort_keys=True).encode()
            out[os.path.relpath(path, directory)] = data
    return out


def test_async_saves_are_the_synchronous_saves_byte_for_byte(tmp_path):
    """Two ranks with ZeRO-1 save every 2 iterations, synchronously and in the background (under the
    NCCL-semantics tier: the background thread's collectives on a group of their own): the same losses
    and the same files. The last save (iteration 6) is in flight when training ends: it is published only
    if the end of the run waits for it."""
    sync = run_pretrain(2, ZERO + ["--save", str(tmp_path / "sync")])
    background = run_pretrain(2, ZERO + ["--save", str(tmp_path / "async"), "--async-save"], nccl=True)
    assert sync.returncode == 0 and background.returncode == 0, background.stdout[-2000:] + background.stderr[-2000:]
    assert logged_losses(background.stdout) == logged_losses(sync.stdout)
    assert "in the background (training stalled" in background.stdout
    for iteration in (2, 4, 6):
        assert f"saved checkpoint at iteration {iteration} to" in background.stdout
        name = f"iter_{iteration:07d}"
        assert tree_bytes(str(tmp_path / "async" / name)) == tree_bytes(str(tmp_path / "sync" / name))
    assert open(tmp_path / "async" / TRACKER).read() == "6"
    assert not [n for n in os.listdir(tmp_path / "async") if n.endswith(".tmp")]


def read_every_tensor(save_dir: str) -> None:
    """The published checkpoint is complete: every tensor of its index reads back with its CRC-32."""
    reader = CheckpointReader(save_dir)
    for name in reader.names():
        reader.tensor(name)


def kill_during_saves(tmp_path, save_iterations: list[int], train_iters: int, seed: int = 0) -> int:
    """Kill -9 a run (every rank, and so its writers) at a random moment of each of ``save_iterations``'s
    background saves (up to 50 ms after it starts: a tiny model's save takes about that), restarting each
    time with the same command. The published checkpoint is always complete, and the run's losses are
    the uninterrupted run's. Returns how many kills landed before that save was published."""
    run = with_flags(TINY_LLAMA_ARGS, train_iters=train_iters, hidden_dropout=0.1) + [
        "--use-distributed-optimizer", "--save-interval", "1", "--async-save"]
    reference = run_pretrain(2, run + ["--save", str(tmp_path / "reference")])
    assert reference.returncode == 0, reference.stdout[-2000:] + reference.stderr[-2000:]
    expected = logged_losses(reference.stdout)
    ckpt, chance = str(tmp_path / "ck"), random.Random(seed)
    argv, seen, unpublished = run + ["--save", ckpt, "--load", ckpt], {}, 0
    for iteration in save_iterations:
        job = Job(argv)
        try:
            out = read_until(job, f"saving checkpoint at iteration {iteration} in the background")
            time.sleep(chance.uniform(0, 0.05))
        finally:
            job.signal(signal.SIGKILL)
            job.finish()
        seen.update(logged_losses(out))
        published = int(open(os.path.join(ckpt, TRACKER)).read())
        assert published <= iteration
        unpublished += published < iteration
        read_every_tensor(ckpt)
    last = run_pretrain(2, argv)
    assert last.returncode == 0, last.stdout[-2000:] + last.stderr[-2000:]
    seen.update(logged_losses(last.stdout))
    assert seen == expected
    return unpublished


def test_a_run_killed_during_async_saves_resumes_exactly(tmp_path):
    """One kill in the default tier (the slow tier's test kills 20 times, restarting after each)."""
    kill_during_saves(tmp_path, [3], train_iters=5)


@pytest.mark.slow
def test_async_save_kills_resume_exactly(tmp_path):
    """20 kills at random points of background saves; most of them land before the save is published
    (else this would not test what it says)."""
    unpublished = kill_during_saves(tmp_path, list(range(3, 63, 3)), train_iters=66, seed=20261126)
    print(f"{unpublished} of 20 kills landed before their save was published")
    assert unpublished >= 10


def test_sigterm_with_exit_signal_handler_waits_for_the_save_in_flight(tmp_path):
    """SIGTERM to every process of the job (the writers ignore it): the ranks finish the iteration, save in
    the background, wait for it, and exit 0 with that checkpoint published."""
    ckpt = str(tmp_path / "ck")
    argv = with_flags(TINY_LLAMA_ARGS, train_iters=100_000) + [
        "--use-distributed-optimizer", "--save-interval", "1", "--async-save", "--exit-signal-handler",
        "--save", ckpt]
    job = Job(argv)
    read_until(job, "saving checkpoint at iteration 5 in the background")
    job.signal(signal.SIGTERM)
    codes, out = job.finish()
    assert codes == [0, 0], out[-3000:]
    stopped = int(out.split("> exiting at iteration ")[1].split(":")[0])
    assert f"saved checkpoint at iteration {stopped} to" in out.split("> exiting at iteration")[1]
    assert int(open(os.path.join(ckpt, TRACKER)).read()) == stopped
    read_every_tensor(ckpt)
