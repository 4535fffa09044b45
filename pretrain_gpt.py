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
    from megalite.training import pretrain
    try:
        config = parse_args(argv)
        ignored = compat_flags_used(argv)
        if ignored:
            print(f" > accepted with no effect (megalite chooses its kernels itself): {' '.join(ignored)}")
        pretrain(config)
        shut_down_distributed()
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def shut_down_distributed() -> None:
    """Every rank finishes its last collective, then the process groups are torn down before the
    interpreter exits (a gloo worker thread still holding tensors at exit aborts the process)."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
