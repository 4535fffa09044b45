"""pretrain_gpt.py's body: parse the flags, then train in a Trainer's with block, as one process of a run.

User mistakes end the run with one line on stderr and exit code 1; under torchrun the line is also
its error file's message, so torchrun's "Root Cause" section shows it. The flags are parsed before
torch is imported (seconds): a flag mistake is reported at once, under torchrun by every rank before
any of them can be stopped by another's exit.
"""
import json
import os
import sys
import time

from megalite.config.megatron_cli import startup_notes
from megalite.errors import UserError
from megalite.parallel.launch_env import read_launch_env
from megalite.train.command_line import parse_args


def main(argv: list[str]) -> int:
    """Train with Megatron's flags ``argv``; the process's exit code."""
    try:
        config = parse_args(argv)
    except UserError as error:
        report(error)
        return 1
    from megalite.train.faults import CollectiveFailure, report_sigterm_in_one_line
    from megalite.train.trainer import Trainer
    report_sigterm_in_one_line(report)
    try:
        if _is_logging_rank():
            for note in startup_notes(argv):
                print(f" > {note}", flush=True)
        with Trainer(config) as trainer:      # leaving it tears down the run and the process group
            trainer.train()
    except CollectiveFailure as error:
        report(error)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)          # the process group is broken: tearing it down would hang or abort
    except UserError as error:
        report(error)
        return 1
    return 0


def report(error: UserError) -> None:
    """One line on stderr from every rank that failed, before it exits, and the same line in torchrun's
    error file. Not from rank 0 only: when another rank exits first, torchrun SIGTERMs rank 0, which
    may not have printed yet, and the user would see no error at all. A rank's own view (a failed
    collective, its launch environment) is prefixed with the rank."""
    rank, world = _launch()
    local = error.local and world > 1
    line = f"error: rank {rank}: {error}" if local else f"error: {error}"
    write_torchrun_error_file(line)
    # one write() of the whole line: ranks share torchrun's stderr, and print() writes the newline
    # separately, so two ranks' lines could run together
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), f"{line}\n".encode())


def write_torchrun_error_file(message: str) -> None:
    """torchrun gives each worker TORCHELASTIC_ERROR_FILE; the agent reads the first failed worker's
    file into its "Root Cause" section (the format torch.distributed.elastic's ErrorHandler writes)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:          # the line on stderr still reaches the user
        pass


def _is_logging_rank() -> bool:
    """The last rank prints start-up lines, as training's own log does."""
    rank, world = _launch()
    return rank == world - 1


def _launch() -> tuple[int, int]:
    """(rank, world size) as the launcher set them (launch_env.py); (0, 1) where they are garbage, which
    the launch-environment check reports itself."""
    try:
        env = read_launch_env()
    except UserError:
        return 0, 1
    return env.rank, env.world_size

