"""Two-rank pretrain_gpt.py jobs that a test can read line by line and signal as a whole, as a node's
job step is (one process group: the ranks and whatever they fork)."""
import os
import subprocess
import sys

from harness import ROOT, free_port

PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")
ENV = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Job:
    """Two ranks in one new process group, as one node's job step: one killpg reaches every process of
    it (the ranks and their writers); both ranks write into one pipe, ``stdout``."""

    def __init__(self, argv: list[str], per_node: list[list[str]] | None = None):
        """``per_node``: each rank's own further flags, as if each ran on a node of its own (LOCAL_RANK 0)."""
        port, read, write = free_port(), *os.pipe()
        self.ranks = []
        for rank in range(2):
            env = {**ENV, "RANK": str(rank), "LOCAL_RANK": "0" if per_node else str(rank), "WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            extra = per_node[rank] if per_node else []
            group = self.ranks[0].pid if self.ranks else 0          # rank 0 leads a new group
            self.ranks.append(subprocess.Popen([sys.executable, PRETRAIN, *argv, *extra], stdout=write,
                                               stderr=subprocess.STDOUT, env=env, process_group=group))
        os.close(write)
        self.stdout = os.fdopen(read, "r")

    def signal(self, signum: int) -> None:
        os.killpg(self.ranks[0].pid, signum)

    def finish(self, timeout: float = 120) -> tuple[list[int], str]:
        """(each rank's exit code, the rest of the output)."""
        rest = self.stdout.read()
        return [rank.wait(timeout) for rank in self.ranks], rest


def read_until(job: Job, text: str) -> str:
    read = []
    for line in job.stdout:
        read.append(line)
        if text in line:
            return "".join(read)
    raise AssertionError(f"the run ended before {text!r}:\n{''.join(read)[-3000:]}")
