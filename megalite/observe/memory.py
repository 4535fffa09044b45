"""Labels for the memory accounting of one training step (train/memory_account.py's MemoryAccount):
code that allocates marks what its allocations are for, and the account reads the innermost label.
Without a running account a label costs one list append and pop."""
from __future__ import annotations

import contextlib

_LABELS: list[str] = []          # the stack of open labels: the innermost applies


@contextlib.contextmanager
def memory_label(label: str):
    """Allocations inside the block count under ``label`` when a MemoryAccount is running."""
    enter_label(label)
    try:
        yield
    finally:
        leave_label()


def enter_label(label: str) -> None:
    """Open ``label`` until the matching ``leave_label`` (for hooks that cannot hold a ``with`` block, such
    as a module's forward pre-hook and forward hook)."""
    _LABELS.append(label)


def leave_label() -> None:
    _LABELS.pop()


def innermost_label() -> str | None:
    """The label that applies now, or None outside every label."""
    return _LABELS[-1] if _LABELS else None
