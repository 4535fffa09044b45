#!/usr/bin/env python
"""Pretrain a GPT/Llama model with Megatron-LM's command-line flags.

    python pretrain_gpt.py --num-layers 12 --hidden-size 768 ... --mock-data --tokenizer-type NullTokenizer ...
    torchrun --nproc_per_node N pretrain_gpt.py ...

Sets the process's CPU allocator policy before torch is loaded (megalite/train/allocator.py: freed large
blocks go back to the OS, so peak RSS follows what is alive), parses the flags, then runs
Trainer(config).train() (megalite/train/entry.py); user mistakes end the run with one line on stderr and
exit code 1.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # run from a checkout without installing

from megalite.train.allocator import set_allocator_policy  # noqa: E402  (after the path above)
from megalite.train.entry import main  # noqa: E402  (imports no torch: the policy comes first)

if __name__ == "__main__":
    set_allocator_policy()
    sys.exit(main(sys.argv[1:]))
