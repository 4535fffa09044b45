"""Data-loader workers hold none of the rank's model or optimizer pages, on the user's default path.

A worker forked from a rank shares its pages copy-on-write; each optimizer step then writes every page of
the rank's state, the rank gets fresh copies, and the worker keeps the stale ones: with 2 workers a rank's
state is held about twice over. Here pretrain_gpt.py runs a ~78M-parameter ZeRO-3 model at DP=2 with the
default 2 workers, and every process under torchrun is sampled for its proportional set size (PSS: each
page counted once over the processes sharing it). Each worker's peak PSS must stay within that of a bare
interpreter that imports torch, measured in the same test, plus 64 MiB: a worker holding a stale share
of the state (about 0.35 GiB a worker here) exceeds it."""
import os
import subprocess
import sys
import time

from megalite_test_utils import ROOT, TINY_LLAMA_ARGS, with_flags

MiB = 2 ** 20
MODEL = dict(num_layers=4, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=8, num_query_groups=2,
             vocab_size=16383, seq_length=8, max_position_embeddings=8)
ARGV = with_flags(TINY_LLAMA_ARGS, **MODEL, bf16=True, micro_batch_size=1, global_batch_size=4, lr=1e-4,
                  train_iters=4, data_parallel_sharding_strategy="optim_grads_params", num_workers=None)
SLACK = 64 * MiB          # a worker's own allocations: the dataset, its batches, the collate buffers


def pss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return None


def children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def descendants(pid: int) -> dict[int, int]:
    """pid -> depth below ``pid``."""
    found, todo = {}, [(pid, 0)]
    while todo:
        p, depth = todo.pop()
        found[p] = depth
        todo += [(c, depth + 1) for c in children(p)]
    return found


def bare_torch_pss() -> int:
    code = "import torch, sys; sys.stdout.write(open('/proc/self/smaps_rollup').read())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return next(int(line.split()[1]) * 1024 for line in out.splitlines() if line.startswith("Pss:"))


def test_loader_workers_hold_no_copy_of_the_rank_state():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "pretrain_gpt.py"), *ARGV]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    peak = {}                  # every process below the ranks: the workers (and a fork server's helpers)
    while proc.poll() is None:
        for pid, depth in descendants(proc.pid).items():
            if depth > 1 and (size := pss(pid)) is not None:
                peak[pid] = max(peak.get(pid, 0), size)
        time.sleep(0.1)
    out = proc.stdout.read()
    assert proc.returncode == 0 and "iteration        4/" in out, out[-3000:]
    bound = bare_torch_pss() + SLACK
    assert len(peak) >= 4, peak                                   # 2 ranks x 2 workers at least
    assert max(peak.values()) <= bound, {"peak PSS MiB": sorted(s // MiB for s in peak.values()),
                                         "bound MiB": bound // MiB}
