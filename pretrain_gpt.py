#!/usr/bin/env python
"""Pretrain a GPT/Llama model with Megatron-LM's command-line flags.

    python pretrain_gpt.py --num-layers 12 --hidden-size 768 ... --mock-data --tokenizer-type NullTokenizer ...
    torchrun --nproc_per_node N pretrain_gpt.py ...

User mistakes end the run with one line on stderr and exit code 1.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # run from a checkout without installing


def main(argv: list[str]) -> int:
    from megalite.arguments import compat_flags_used, parse_args
    from megalite.errors import UserError
    from megalite.faults import CollectiveFailure
    from megalite.training import pretrain
    try:
        config = parse_args(argv)
        ignored = compat_flags_used(argv)
        if ignored:
            print(f" > accepted with no effect (megalite chooses its kernels itself): {' '.join(ignored)}")
        pretrain(config)
        shut_down_distributed()
    except CollectiveFailure as error:
        report(error)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)          # the process group is broken: tearing it down would hang or abort
    except UserError as error:
        report(error)
        return 1
    return 0


def report(error) -> None:
    """One line on stderr. Errors every rank hits alike (flags, NaN) are printed by rank 0 only;
    a rank's own view of a failed collective by that rank, prefixed with it."""
    rank, world = _env_int("RANK", "SLURM_PROCID", 0), _env_int("WORLD_SIZE", "SLURM_NTASKS", 1)
    if getattr(error, "local", False):
        print(f"error: rank {rank}: {error}" if world > 1 else f"error: {error}", file=sys.stderr)
    elif rank == 0 or world <= 1:
        print(f"error: {error}", file=sys.stderr)


def _env_int(name: str, slurm_name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, os.environ.get(slurm_name, default)))
    except ValueError:       # garbage is reported by the launch-environment check itself
        return default


def shut_down_distributed() -> None:
    """Every rank finishes its last collective, then the process groups are torn down before the
    interpreter exits (a gloo worker thread still holding tensors at exit aborts the process)."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
