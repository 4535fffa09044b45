"""Test set-up: the repo root, tests/ and tests/distributed/ importable; wandb never goes online; the CPU
allocator policy of pretrain_gpt.py."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "distributed")):
    if path not in sys.path:
        sys.path.insert(0, path)

os.environ.setdefault("WANDB_MODE", "offline")

# the CPU allocator policy pretrain_gpt.py sets itself, for this process and (exported) every rank it spawns
from megalite.train.allocator import set_allocator_policy  # noqa: E402  (after the path above)
set_allocator_policy()
