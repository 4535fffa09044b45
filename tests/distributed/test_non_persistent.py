"""Non-persistent checkpoints (--non-persistent-save-interval, --non-persistent-ckpt-type local|global): a
run killed between persistent saves resumes from the newest complete checkpoint, persistent or not, with
the uninterrupted run's losses; a local directory keeps the newest two; a local checkpoint reshards like
any other; one spread over two nodes' directories is refused in one line and the run resumes from the
persistent one.
"""
import os
import signal

import pytest

from harness import logged_losses, run_pretrain
from jobs import Job, read_until
from megalite.checkpoint.files import published_iterations
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

MODEL = with_flags(TINY_LLAMA_ARGS, train_iters=10, hidden_dropout=0.1) + ["--use-distributed-optimizer"]
RUN = MODEL + ["--save-interval", "4", "--non-persistent-save-interval", "1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    proc = run_pretrain(2, RUN + ["--non-persistent-ckpt-type", "global",
                                  "--save", str(tmp_path_factory.mktemp("reference"))])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return logged_losses(proc.stdout)


def kill_after(argv, saved: str, per_node=None) -> dict[int, float]:
    """Run until the log says ``saved``, then kill -9 every rank; the losses it logged."""
    job = Job(argv, per_node)
    try:
        out = read_until(job, saved)
    finally:
        job.signal(signal.SIGKILL)
        job.finish()
    return logged_losses(out)


@pytest.mark.parametrize("kind", ["local", pytest.param("global", marks=pytest.mark.slow)])
def test_a_killed_run_resumes_from_the_newest_non_persistent_checkpoint(tmp_path, reference, kind):
    save, local = str(tmp_path / "save"), str(tmp_path / "local")
    where = {"local": ["--non-persistent-local-ckpt-dir", local], "global": []}[kind]
    argv = RUN + ["--save", save, "--load", save, "--non-persistent-ckpt-type", kind, *where]
    root = local if kind == "local" else os.path.join(save, "non_persistent")
    seen = kill_after(argv, f"saved checkpoint at iteration 6 to {root}")
    assert published_iterations(save) == [4]
    assert published_iterations(root) == [5, 6]                 # the newest two
    resumed = run_pretrain(2, argv)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"loaded checkpoint {root}/iter_0000006 at iteration 6" in resumed.stdout
    seen.update(logged_losses(resumed.stdout))
    assert seen == reference
    if kind == "local":     # its newest (iteration 9) at another layout, one rank, gives the same next loss
        runs = [run_pretrain(n, MODEL + ["--load", local, "--hidden-dropout", "0"]) for n in (1, 2)]
        assert all(f"loaded checkpoint {local}/iter_0000009 at iteration 9" in r.stdout for r in runs)
        serial, pair = (logged_losses(r.stdout)[10] for r in runs)
        assert abs(serial - pair) <= 1e-5 * abs(pair)


def test_a_local_checkpoint_spread_over_nodes_is_refused_in_one_line(tmp_path, reference):
    """Each rank as a node of its own with its own local directory: neither holds the other's files."""
    save = str(tmp_path / "save")
    argv = RUN + ["--save", save, "--load", save, "--non-persistent-ckpt-type", "local"]
    nodes = [["--non-persistent-local-ckpt-dir", str(tmp_path / f"node{n}")] for n in range(2)]
    seen = kill_after(argv, "saved checkpoint at iteration 6 to", nodes)
    assert published_iterations(str(tmp_path / "node0")) == [5, 6]
    job = Job(argv, nodes)
    codes, out = job.finish(timeout=300)
    assert codes == [0, 0], out[-3000:]
    assert "is not whole on every rank" in out and "resuming from iteration 4" in out
    assert f"loaded checkpoint {save}/iter_0000004 at iteration 4" in out
    seen.update(logged_losses(out))
    assert seen == reference
