"""Loaded by every Python process whose path holds this folder (harness.run_pretrain(..., nccl=True)): with
MEGALITE_NCCL_SEMANTICS set, the process runs under the NCCL-semantics tier (../nccl_semantics.py)."""
import os
import sys

if os.environ.get("MEGALITE_NCCL_SEMANTICS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import nccl_semantics

    nccl_semantics.install()
