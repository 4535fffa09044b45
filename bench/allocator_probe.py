#!/usr/bin/env python
"""CPU allocator settings against step time and page faults: megalite's training loop (bench_vs_hf.py's model)
in one process per setting, since glibc's malloc options are per process.

    python bench/allocator_probe.py fp32 default,exact,keep,glibc,thr16,thr64 1

default: megalite's CPU default (the caching CPU allocator, megalite/caching_cpu_allocator.py, over a 1 MiB
mmap threshold; transparent huge pages for tensors of 2 MiB or more, megalite/__init__.py); exact: no cache
(MEGALITE_CPU_CACHE=0), every block of 1 MiB or more back to the OS when freed; a "4k" suffix: the same with
4 KiB pages; keep: MEGALITE_KEEP_FREED_MEMORY=1; glibc: glibc's adaptive threshold; thrN: a fixed N MiB
threshold (the last two without the cache).
Prints ms per iteration, system time, minor page faults per iteration and max RSS."""
import multiprocessing as mp
import os
import resource
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
ITERATIONS = 3          # timed per process, after 2 warm-up iterations


def worker(mode: str, dtype: str, n: int, q) -> None:
    """One setting in this fresh process: set glibc's policy the way start-up will, then time n iterations."""
    policy = mode.removesuffix("4k")
    if mode.endswith("4k"):
        os.environ["THP_MEM_ALLOC_ENABLE"] = "0"         # before megalite sets its default
    if policy == "keep":
        os.environ["MEGALITE_KEEP_FREED_MEMORY"] = "1"
    if policy in ("exact", "glibc") or policy.startswith("thr"):
        os.environ["MEGALITE_CPU_CACHE"] = "0"
    import megalite.initialize as init
    if policy == "glibc":
        init.return_freed_memory_to_os = lambda: None
    if policy.startswith("thr"):
        init.MMAP_THRESHOLD = int(policy[3:]) << 20
    import torch
    torch.set_num_threads(2)
    from bench_vs_hf import MegaliteLoop, FULL
    loop = MegaliteLoop(FULL, dtype, False)
    loop.run(2)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    times = loop.run(n)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    q.put((mode, statistics.median(times) * 1000, (r1.ru_stime - r0.ru_stime) / n * 1000,
           (r1.ru_minflt - r0.ru_minflt) / n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))



def main(dtype: str, modes: list[str], rounds: int) -> None:
    ctx = mp.get_context("spawn")
    for _ in range(rounds):
        for mode in modes:
            q = ctx.Queue()
            p = ctx.Process(target=worker, args=(mode, dtype, ITERATIONS, q))
            p.start()
            m, ms, sys_ms, faults, rss = q.get()
            p.join()
            print(f"{dtype} {m:8s} {ms:7.0f} ms/iter  sys {sys_ms:6.0f} ms/iter  minflt {faults:9.0f}/iter  "
                  f"maxrss {rss:.0f} MiB", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: python bench/allocator_probe.py fp32|bf16 MODE[,MODE...] ROUNDS")
    main(sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]))
