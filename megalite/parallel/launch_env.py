"""Who this process is in the job, from the launcher's environment: the one reader of RANK, WORLD_SIZE
and SLURM's variables (the config parser, parallel/initialize.py and the training entry point all ask
it). No torch import, so flags are checked against the right world size before torch loads.

Launchers: torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or SLURM's srun
(SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, the first host of SLURM_JOB_NODELIST). A plain
``python pretrain_gpt.py`` is rank 0 of 1, also inside a SLURM allocation that srun did not start it in
(an sbatch script's batch step, a salloc shell).
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from dataclasses import dataclass

from megalite.errors import UserError

DEFAULT_MASTER_PORT = 29500
SLURM_MAX_NORMAL_STEP_ID = 0xFFFFFFF0     # Slurm's: the ids above are its batch, interactive and extern steps


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    launched: bool = False          # started by torchrun, or by srun as a task of a job step


def read_launch_env(env=None) -> LaunchEnv:
    """torchrun's variables win; SLURM's are used when srun started this process (``srun python ...``,
    see ``started_by_srun``), with the step's number of tasks as the world size. Anything else is one
    process. A value that is not a number, or a rank outside the world, is a one-line error (not a hang)."""
    env = os.environ if env is None else env

    def number(name: str, default: int, low: int, high: int | None = None) -> int:
        text = env.get(name, str(default))
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
            raise rank_error(f"{name}={text!r} must be {allowed}; fix the launcher's environment (torchrun and srun "
                             "set it)")
        return value

    port = number("MASTER_PORT", DEFAULT_MASTER_PORT, 1, 65535)
    if "RANK" in env or not started_by_srun(env):
        world = number("WORLD_SIZE", 1, 1)
        launch = LaunchEnv(number("RANK", 0, 0, world - 1), world, number("LOCAL_RANK", 0, 0),
                           env.get("MASTER_ADDR", "127.0.0.1"), port, "RANK" in env)
    else:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        tasks = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        world = number(tasks, 1, 1)
        launch = LaunchEnv(number("SLURM_PROCID", 0, 0, world - 1), world, number("SLURM_LOCALID", 0, 0),
                           env.get("MASTER_ADDR", first_host(nodelist)), port, True)
    return launch


def played_launch_env(world_size: int | None, rank: int | None, env=None) -> LaunchEnv:
    """The rank a dry run (--fake-process-group, parallel/dry_run.py) plays: --fake-world-size/--fake-rank,
    or else WORLD_SIZE and RANK; one line for a world that is not given or a rank outside it."""
    env = os.environ if env is None else env
    if world_size is None and env.get("WORLD_SIZE", "").isdigit() and int(env["WORLD_SIZE"]) > 0:
        world_size = int(env["WORLD_SIZE"])
    if world_size is None:
        raise UserError("--fake-process-group needs the world it plays a rank of: add --fake-world-size N "
                        "(or set WORLD_SIZE)")
    if rank is None:
        rank = int(env["RANK"]) if env.get("RANK", "").isdigit() else 0
    if rank >= world_size:
        raise UserError(f"--fake-rank {rank} is outside a world of {world_size} ranks; give a rank in "
                        f"0..{world_size - 1}")
    return LaunchEnv(rank, world_size, 0, launched=True)


def launched_world_size(args, launched) -> int:
    """The world size the parsed command line ``args`` trains in: the world a dry run plays, else
    ``launched()``, the launcher's."""
    if args.fake_process_group:
        return played_launch_env(args.fake_world_size, args.fake_rank).world_size
    return launched()


def started_by_srun(env) -> bool:
    """Whether srun started this process as one task of a job step.

    srun gives every task SLURM_PROCID and the step's SLURM_STEP_ID (and the older SLURM_STEPID) and
    SLURM_STEP_NUM_TASKS. The batch step running an sbatch script has the job's SLURM_NTASKS and
    SLURM_PROCID=0 but none of the step variables, and neither has a salloc shell (salloc's interactive
    step has a reserved step id): a python started there is one process, not task 0 of SLURM_NTASKS
    waiting for peers that never come. Without SLURM_JOB_ID there is no allocation, and SLURM_PROCID
    and SLURM_NTASKS set by some other launcher are taken as they are."""
    if "SLURM_PROCID" not in env:
        return False
    if "SLURM_JOB_ID" not in env:
        return True
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if step is not None and step.strip().lstrip("-").isdigit():
        return 0 <= int(step) <= SLURM_MAX_NORMAL_STEP_ID
    return step is not None or "SLURM_STEP_NUM_TASKS" in env


def restart_note(env) -> str | None:
    """The one line a torchrun rank prints when --max-restarts could not work: torchrun (2.x) then hands
    every start of the job one rendezvous store without separating their keys, so a restarted rank reads
    its dead predecessors' addresses and the restart hangs (pytorch/pytorch#135712). A fresh store per
    start needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and the c10d rendezvous."""
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if not restarts.isdigit() or int(restarts) == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return (f" > warning: torchrun --max-restarts {restarts} would hang at a restart: it shares one rendezvous "
            "store between starts; run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment "
            "and the c10d rendezvous (--standalone, or --rdzv-backend c10d --rdzv-endpoint HOST:PORT)")


def single_process_note(env) -> str | None:
    """The one line a process that runs alone inside a multi-task SLURM allocation prints."""
    tasks = env.get("SLURM_NTASKS", "")
    if "RANK" in env or started_by_srun(env) or not tasks.isdigit() or int(tasks) < 2:
        return None
    return (f" > SLURM_NTASKS={tasks}, but srun did not start this process (an sbatch script or a salloc shell "
            f"runs it directly): running as one process; to run all {tasks} tasks, launch it with srun "
            "(srun python pretrain_gpt.py ...)")


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: "gpu[07-09,12],cpu1" -> "gpu07"."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise UserError(f"cannot read a host from SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def rank_error(message: str) -> UserError:
    """A start-up error only this rank may see (its environment, its rendezvous): every rank that hits
    one reports it, not only rank 0 (``local``, as train/entry.py's report() reads it)."""
    return UserError(message, local=True)


LAUNCHER_POLL = 0.2              # seconds between a rank's checks that its launcher is alive
LAUNCHER_GONE_EXIT = 75          # the exit status of a rank whose launcher died
_UNINTERRUPTED = threading.Lock()


@contextlib.contextmanager
def finish_before_exit():
    """A short step that a rank whose launcher died completes before it exits: publishing a checkpoint
    (two renames and the tracker), which cut in half could leave the tracker naming a missing directory."""
    with _UNINTERRUPTED:
        yield


def exit_with_launcher(rank: int, parent: int | None = None) -> threading.Thread:
    """A rank started by a launcher (torchrun's agent, slurmstepd) ends when the launcher does. When the
    launcher is SIGKILLed (the OOM killer, a lost node agent) its ranks are re-parented and would train
    on, writing checkpoints into a directory that a relaunch then shares with them. A daemon thread checks
    the parent every LAUNCHER_POLL seconds; once it is gone it prints one line and ends the process at once
    (os._exit: whatever the main thread is blocked in, a collective or a write). A save cut short leaves
    only its temporary directory, never a published checkpoint; a publish under way is completed first
    (finish_before_exit). A process started by hand has no launcher to outlive: the caller starts this
    only for launched ranks."""
    parent = os.getppid() if parent is None else parent
    for thread in threading.enumerate():           # one watch a process (a test may start several runs)
        if thread.name == "launcher-watch":
            return thread

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(LAUNCHER_POLL)
        sys.stderr.write(f"rank {rank}: its launcher (pid {parent}) is gone; stopping now, without writing "
                         f"anything more (exit status {LAUNCHER_GONE_EXIT})\n")
        sys.stderr.flush()
        with _UNINTERRUPTED:
            os._exit(LAUNCHER_GONE_EXIT)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread
