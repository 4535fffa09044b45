"""Test set-up: the repo root, tests/ and tests/distributed/ importable; wandb never goes online."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "distributed")):
    if path not in sys.path:
        sys.path.insert(0, path)

os.environ.setdefault("WANDB_MODE", "offline")
