"""The caching CPU allocator (megalite/csrc/caching_cpu_allocator.cpp): build, install, measure.

Large CPU blocks freed by one training step serve the next step's requests with their pages still
resident, and the bytes held for them stay within the peak of what was alive at once, so peak RSS is
what returning every block to the OS gives, without its page faults (see the C++ file and
bench/RESULTS.md, "CPU allocator").

The library is compiled on first use with the system's C++ compiler against PyTorch's c10 headers (a few
seconds) into a cache keyed by the source and the PyTorch build, so every process after the first only
loads it. Where no compiler is found, ``install`` returns the reason and the caller keeps glibc's policy.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "caching_cpu_allocator.cpp"
MIN_BLOCK_BYTES = 1 << 20      # smaller blocks stay with glibc's heap, which reuses them without faults

_library: ctypes.CDLL | None = None


@dataclass
class CacheStats:
    live_bytes: int
    cached_bytes: int
    budget_bytes: int
    hits: int           # requests served by a cached block of their size
    resizes: int        # ... by a cached block of another size, resized in place (mremap)
    misses: int         # ... by a fresh mapping
    released: int       # cached blocks unmapped


def cache_dir() -> Path:
    """MEGALITE_BUILD_CACHE, else ~/.cache/megalite, else (a home one cannot write) a per-user folder in /tmp."""
    if os.environ.get("MEGALITE_BUILD_CACHE"):
        return Path(os.environ["MEGALITE_BUILD_CACHE"])
    home = Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "megalite"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"megalite-{os.getuid()}"


def library_path() -> Path:
    """Where this source, built for this PyTorch, lives: a new torch or a changed source gets a new file."""
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() +
                         str(torch._C._GLIBCXX_USE_CXX11_ABI).encode()).hexdigest()[:16]
    return cache_dir() / f"caching_cpu_allocator-{key}.so"


def compiler() -> str:
    return os.environ.get("CXX") or "c++"


def compile_command(output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths
    return [compiler(), "-O2", "-std=c++17", "-shared", "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *[f"-I{p}" for p in include_paths()], str(SOURCE),
            *[f"-L{p}" for p in library_paths()], "-lc10",
            *[f"-Wl,-rpath,{p}" for p in library_paths()], "-o", str(output)]


def build() -> Path:
    """Compile the library unless this version is already built. Ranks starting together take turns on a
    lock file, so one compiles and the rest load its result; the file is written under another name and
    renamed into place, so a build killed half-way leaves nothing to load."""
    target = library_path()
    if target.exists():
        return target
    if shutil.which(compiler()) is None:
        raise RuntimeError(f"no C++ compiler ({compiler()}; set CXX to another)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():                    # another rank built it while this one waited
            return target
        partial = target.with_suffix(f".{os.getpid()}.partial")
        try:
            result = subprocess.run(compile_command(partial), capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler()} failed: {result.stderr.strip()[-400:]}")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target


def load() -> ctypes.CDLL:
    global _library
    if _library is None:
        torch.ones(1)       # libc10 loaded and PyTorch's own CPU allocator registered before ours replaces it
        library = ctypes.CDLL(str(build()))
        library.megalite_cpu_cache_install.argtypes = [ctypes.c_int64]
        library.megalite_cpu_cache_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
        _library = library
    return _library


def install(min_block_bytes: int = MIN_BLOCK_BYTES) -> str | None:
    """Make every later CPU tensor of ``min_block_bytes`` or more come from the cache. Returns None, or why
    it could not (the caller then keeps glibc's policy)."""
    try:
        load().megalite_cpu_cache_install(min_block_bytes)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return " ".join(str(e).split())
    return None


def empty_cache() -> None:
    """Return every cached block to the OS and restart the budget from the bytes alive now (call it where a
    memory measurement starts, so an earlier peak's cache is not counted in it)."""
    if _library is not None:
        _library.megalite_cpu_cache_empty()


def stats() -> CacheStats:
    values = (ctypes.c_int64 * 7)()
    if _library is not None:
        _library.megalite_cpu_cache_stats(values)
    return CacheStats(*values)

