"""The CPU allocator policy a training process sets for itself, at start-up, before torch allocates.

glibc's malloc, left at its defaults, moves its mmap threshold up to the size of each mmap'd block freed
(up to 32 MiB): from then on blocks below that size come from the heap, and a freed block stays there,
counted in the process's RSS, until a later allocation happens to fit it. A training step frees and
allocates activations, gathered parameters and communication buckets of many sizes, so the heap's
peak grows past what is alive, and a ZeRO stage's saving stops showing in the peak RSS it is measured by.

The policy: ``mallopt(M_MMAP_THRESHOLD, 1 MiB)``, which also turns the adaptive threshold off. Blocks of
1 MiB or more are mmap'd and unmapped when freed, so RSS follows what is alive; the price is that each
step's fresh blocks are faulted in again. What would spare those faults (a larger fixed threshold that keeps
the step's smaller blocks in the heap, an allocator that keeps freed pages for reuse) keeps the freed blocks
in the peak as well, and a ZeRO stage's saving hides in it again (bench/RESULTS.md, "CPU allocator"). The
process's children (loader workers, spawned ranks) get the same policy from the environment, where it is
exported as glibc's tunable (read at a process's start).

Where the user chose an allocator (``LD_PRELOAD`` names one, ``MALLOC_CONF`` or a glibc malloc tunable is
set), or the C library is not glibc, the process keeps what it was given.
"""
from __future__ import annotations

import ctypes
import os

MMAP_THRESHOLD = 2 ** 20        # blocks this large or larger: mmap'd, and returned to the OS when freed
M_MMAP_THRESHOLD = -3           # glibc's malloc.h


def user_chose_allocator(environ=os.environ) -> bool:
    """Whether the environment already sets an allocator or its configuration."""
    glibc_tunables = "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
    return bool(environ.get("LD_PRELOAD") or environ.get("MALLOC_CONF") or glibc_tunables)


def _glibc() -> ctypes.CDLL | None:
    """The running C library when it is glibc (it has ``gnu_get_libc_version`` and ``mallopt``)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    is_glibc = hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")  # probe: the C library's own exports
    return libc if is_glibc else None


def policy_environment() -> dict[str, str]:
    """The policy as the environment variable a child process's glibc reads at its start."""
    tunable = f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}"
    return {"GLIBC_TUNABLES": ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), tunable]))}


def set_allocator_policy() -> bool:
    """Apply the policy to this process and export it to its children (call it before torch is imported);
    whether it was applied."""
    if user_chose_allocator():
        return False
    libc = _glibc()
    if libc is None:
        return False
    os.environ.update(policy_environment())
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
