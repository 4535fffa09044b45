"""Ranks never outlive their launcher: torchrun SIGKILLed mid-run (as the OOM killer or a lost node agent
does) takes its ranks with it within seconds, each with one line (its launcher is gone, or the peer that
noticed first has died); nothing more is written under --save, and the newest published checkpoint loads
and trains on."""
import os
import signal
import subprocess
import sys
import time

from harness import ROOT, pretrain_command
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from process_memory import children


def file_text(path) -> str:
    with open(path) as f:
        return f.read()


def tree(root: str) -> dict:
    """Every file under ``root`` with its size and modification time."""
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            stat = os.stat(path)
            found[path] = (stat.st_size, stat.st_mtime_ns)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_killing_torchrun_stops_its_ranks_and_their_writes(tmp_path):
    save = str(tmp_path / "ck")
    argv = with_flags(TINY_LLAMA_ARGS, train_iters=100000, save_interval=3, save=save)
    cmd, env = pretrain_command(2, argv)
    log = tmp_path / "log"
    with open(log, "w") as out:
        launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 240
    while "saved checkpoint at iteration 6" not in file_text(log):
        assert launcher.poll() is None and time.monotonic() < deadline, file_text(log)[-3000:]
        time.sleep(0.2)
    ranks = children(launcher.pid)
    assert len(ranks) == 2, ranks
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    stop = time.monotonic() + 30
    while any(alive(pid) for pid in ranks) and time.monotonic() < stop:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in ranks), "a rank outlived its launcher by 30 s"
    time.sleep(1)
    text = file_text(log)
    assert "its launcher (pid " in text, text[-3000:]
    for rank in (0, 1):          # each says why it stopped: its launcher is gone, or a peer that saw it first
        assert f"rank {rank}: its launcher (pid " in text or f"error: rank {rank}: a peer rank died" in text, text[-3000:]
    written = tree(save)
    time.sleep(2)
    assert tree(save) == written                                     # nothing more is written
    latest = int(file_text(os.path.join(save, "latest_checkpointed_iteration.txt")))
    resumed = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"),
                              *with_flags(argv, train_iters=latest + 1, save=None, save_interval=None), "--load", save],
                             capture_output=True, text=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"iteration {latest + 1:8d}/" in resumed.stdout, resumed.stdout[-2000:]
