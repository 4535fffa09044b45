"""Run a function on N gloo ranks on localhost and collect what each rank returns.

    results = run_ranks(4, my_module_level_fn, arg1, arg2)   # results[rank] = my_fn(rank, world, arg1, arg2)

Ranks are fresh processes with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set as torchrun would, so
code under test initialises exactly as in a real launch. A rank that raises fails the call with its
traceback. ``run_pretrain`` launches pretrain_gpt.py under torchrun and returns its output.

``nccl=True`` runs either under the NCCL-semantics tier (nccl_semantics.py): NCCL's stream and matching
rules imposed on gloo, a check that every rank of a group issued the same collectives, and the
collectives' NCCL branch (MEGALITE_FORCE_NCCL_COLLECTIVE_PATH=1, megalite/parallel/collectives.py).

Ranks are forked from a forkserver that imported torch and megalite once for the whole session:
a spawned rank re-imports them, about 4 s of CPU each (torch, and torch._dynamo, which every
torch.optim optimizer imports), and the suite starts ~90 ranks on 2 cores. The forkserver only
imports: it starts no OpenMP or intra-op thread pool (its one native thread besides main is the one
``import torch`` starts anywhere), so nothing a rank needs is lost across the fork. A rank gets the
test's environment (os.environ at the call), not the forkserver's.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once in the forkserver (it starts at the first run_ranks); the ranks forked from it have them loaded
mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "megalite.train.trainer",
                           "megalite.parallel.data.fsdp2"])


def _rank_main(rank: int, world_size: int, port: int, result_dir: str, environ: dict, nccl: bool, fn, args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    if nccl:
        os.environ["MEGALITE_FORCE_NCCL_COLLECTIVE_PATH"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        if nccl:
            import nccl_semantics
            nccl_semantics.install()
        result = fn(rank, world_size, *args)
        if nccl:
            nccl_semantics.write_log(result_dir)
        torch.save({"ok": True, "result": result}, os.path.join(result_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(result_dir, f"{rank}.pt"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, nccl: bool = False) -> list:
    with tempfile.TemporaryDirectory() as result_dir:
        try:
            mp.start_processes(_rank_main, args=(world_size, free_port(), result_dir, dict(os.environ), nccl, fn, args),
                               nprocs=world_size, join=True, start_method="forkserver")
        except Exception:
            pass                                   # reported below with the failing rank's traceback
        results = []
        for rank in range(world_size):
            path = os.path.join(result_dir, f"{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} of {world_size} died without a result")
            record = torch.load(path, weights_only=False)
            if not record["ok"]:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{record['error']}")
            results.append(record["result"])
        if nccl:
            _check_collective_logs(result_dir)
        return results


def _check_collective_logs(directory: str) -> None:
    import nccl_semantics
    problems = nccl_semantics.compare_logs(directory)
    if problems:
        raise RuntimeError("ranks issued different collectives (NCCL would hang or mix them up):\n" + "\n".join(problems))


def pretrain_command(nproc: int, argv: list[str]) -> tuple[list[str], dict]:
    """The command line and environment of pretrain_gpt.py under torchrun (--standalone picks a free port)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "pretrain_gpt.py"), *argv]
    return cmd, {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}


def run_pretrain(nproc: int, argv: list[str], timeout: int = 600, nccl: bool = False) -> subprocess.CompletedProcess:
    """pretrain_gpt.py under torchrun, as a user launches it."""
    cmd, env = pretrain_command(nproc, argv)
    if not nccl:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    with tempfile.TemporaryDirectory() as log_dir:
        site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nccl_site")
        env.update(MEGALITE_NCCL_SEMANTICS=log_dir, MEGALITE_FORCE_NCCL_COLLECTIVE_PATH="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")])))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        logs = [f for f in os.listdir(log_dir) if f.startswith("rank")]
        if proc.returncode == 0 and len(logs) != nproc:
            raise RuntimeError(f"the NCCL-semantics tier ran in {len(logs)} of {nproc} ranks (nccl_site not loaded?)")
        _check_collective_logs(log_dir)
        return proc


def logged_losses(stdout: str) -> dict[int, float]:
    """iteration -> lm loss from Megatron-style lines."""
    losses = {}
    for line in stdout.splitlines():
        it = re.search(r"iteration\s+(\d+)\s*/", line)
        loss = re.search(r"lm loss:\s*([-+0-9.eE]+|nan|inf)", line)
        if it and loss:
            losses[int(it.group(1))] = float(loss.group(1))
    return losses
