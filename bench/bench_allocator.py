#!/usr/bin/env python
"""CPU allocators side by side in one run, for both memory and speed: the policy pretrain_gpt.py sets
itself (megalite/train/allocator.py) against glibc's defaults, other glibc thresholds, jemalloc settings,
and megalite before the redesign (its own caching CPU allocator over glibc).

Options (``--options``, comma-separated; the first is the baseline of the step-time ratios):
- hf: transformers' LlamaForCausalLM step (bench_vs_hf.py's), glibc defaults, as a user runs it: the
  "transformers ms / this ms" column is bench_vs_hf.py's ratio for every other option;
- policy: this tree with nothing in the environment: the process sets its own policy, as the bare
  ``torchrun pretrain_gpt.py`` does (a fixed 1 MiB mmap threshold, set with mallopt);
- glibc: glibc's defaults (a ``glibc.malloc`` tunable at its default value keeps the policy off);
- glibc-1mib: a fixed 1 MiB mmap threshold (GLIBC_TUNABLES): the policy, set from the environment;
- glibc-1mib-thp: the same, torch's tensors on transparent huge pages (THP_MEM_ALLOC_ENABLE=1: 2 MiB-aligned,
  madvise'd, so a fresh block faults in 2 MiB at a time);
- glibc-4mib-thp: a fixed 4 MiB mmap threshold, torch's tensors on huge pages (THP_MEM_ALLOC_ENABLE);
- glibc-keep: a fixed 32 MiB mmap threshold and no trimming: freed blocks stay in the heap;
- glibc-4mib-trim, glibc-8mib-trim, glibc-16mib-trim, glibc-32mib-trim: a fixed 4/8/16/32 MiB mmap threshold
  and a trim threshold twice that: blocks below the threshold stay in the heap for the next step's reuse;
- jemalloc: LD_PRELOAD of libjemalloc.so.2 with MALLOC_CONF=oversize_threshold:1,background_thread:true,
  metadata_thp:auto (torch.backends.xeon.run_cpu's, which the Makefile preloaded before the policy);
- jemalloc-thp: the same, torch's tensors on huge pages;
- jemalloc-keep: jemalloc that never purges (dirty_decay_ms:-1, muzzy_decay_ms:-1);
- jemalloc-reuse: oversize_threshold:0 (no dedicated arena for large blocks): a freed block of any size stays
  in its arena for reuse and is purged after the decay time (10 s by default);
- jemalloc-decay1s: the same, purged after 1 s;
- jemalloc-bare: jemalloc's default settings;
- jemalloc-decay1s-a1: jemalloc-decay1s with one arena for every thread (narenas:1);
- jemalloc-decay0: oversize_threshold:0, freed pages purged at once (dirty_decay_ms:0, muzzy_decay_ms:0);
- jemalloc-keep0: oversize_threshold:0 and never purging (dirty_decay_ms:-1, muzzy_decay_ms:-1);
- before: revision ``--baseline`` (default d50f0c9) in a git worktree, run with this venv and PYTHONPATH at
  the worktree; its start-up installs its caching CPU allocator (a worktree is made only for this option).

Two measurements, each option in its own processes with LD_PRELOAD, MALLOC_CONF, GLIBC_TUNABLES and
THP_MEM_ALLOC_ENABLE set as the option says (and nothing inherited):
- step: bench_vs_hf.py's model (``--dtype``, fp32 by default) through megalite's own training loop (each
  tree's bench_vs_hf.MegaliteLoop, the "elapsed time per iteration" its log lines print; the worker first
  applies the policy as pretrain_gpt.py does), one long-lived worker per option, run in rounds of
  ``--steps`` steps per worker in a rotating order so machine noise hits all alike; reported: median
  ms/iteration, the ratio to transformers' step, system CPU ms and minor page faults per iteration, and the
  worker's peak RSS;
- zero: each tree's ``bench/bench_memory.py --sections zero-pretrain`` (``torchrun pretrain_gpt.py`` per ZeRO
  stage at DP=4: peak RSS per rank and the share of each stage's theoretical saving; ``--zero-section zero``
  measures in-process ranks instead), ``--memory-rounds`` runs per option in a rotating order, medians.

The make test wall time of each revision is measured apart (it takes minutes per run); pass the seconds
with --make-test-before / --make-test-after to put them in the table.

    python bench/bench_allocator.py                        # hf, policy, glibc, jemalloc
    python bench/bench_allocator.py --quick                # smoke test: small models, one round
    python bench/bench_allocator.py --options hf,policy,glibc-4mib-thp,jemalloc-reuse --measure step --rounds 4
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Headline, add_common_args, command_line, publish, read_section  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2 ** 20
ALLOCATOR_ENV = ("LD_PRELOAD", "MALLOC_CONF", "GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE")
# the Makefile's JEMALLOC_CONF (torch.backends.xeon.run_cpu's): no separate arena that unmaps every freed
# block of 8 MiB or more at once (oversize_threshold), purging on a background thread
JEMALLOC_CONF = "oversize_threshold:1,background_thread:true,metadata_thp:auto"
TARGET_SHARE = 0.9   # each ZeRO stage saves at least this share of its theoretical saving
MARK = "@@allocator "


def find_jemalloc() -> str | None:
    """$JEMALLOC, else the libjemalloc.so.2 the dynamic linker knows (as the Makefile finds it)."""
    if os.environ.get("JEMALLOC"):
        return os.environ["JEMALLOC"]
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return None
    paths = [line.split("=>")[-1].strip() for line in listing.splitlines() if "libjemalloc.so.2" in line]
    return paths[0] if paths else None


@dataclass(frozen=True)
class Option:
    name: str
    tree: str                      # "before" (the baseline worktree) or "after" (this tree)
    env: dict = field(default_factory=dict)
    what: str = ""
    loop: str = "megalite"         # the step the worker times: megalite's loop, or transformers' ("hf")


def options(jemalloc: str | None, baseline: str) -> dict[str, Option]:
    # a glibc.malloc tunable at its default value: the user chose glibc's defaults, so the process keeps them
    defaults = {"GLIBC_TUNABLES": "glibc.malloc.check=0"}
    thp = {"THP_MEM_ALLOC_ENABLE": "1"}
    found = {
        "before": Option("before", "before", {}, f"revision {baseline}: megalite's caching CPU allocator over glibc"),
        "policy": Option("policy", "after", {}, "this tree's bare command: the policy the process sets itself "
                         "(megalite/train/allocator.py)"),
        "hf": Option("hf", "after", {}, "transformers' LlamaForCausalLM step, bare glibc (bench_vs_hf.py's)",
                     loop="hf"),
        "glibc": Option("glibc", "after", defaults, "this tree, glibc malloc (defaults)"),
        "glibc-1mib": Option("glibc-1mib", "after", {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"},
                             "this tree, glibc with a fixed 1 MiB mmap threshold (the policy, from the environment)"),
        "glibc-1mib-thp": Option("glibc-1mib-thp", "after", {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576",
                                                             **thp},
                                 "this tree, glibc with a fixed 1 MiB mmap threshold, torch's tensors on huge pages"),
        "glibc-4mib-thp": Option("glibc-4mib-thp", "after", {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4194304",
                                                             **thp},
                                 "this tree, glibc with a fixed 4 MiB mmap threshold, torch's tensors on huge pages"),
        "glibc-keep": Option("glibc-keep", "after", {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432:"
                                                                        "glibc.malloc.trim_threshold=4294967296"},
                             "this tree, glibc with a fixed 32 MiB mmap threshold and no trimming"),
    }
    for mib in (4, 8, 16, 32):       # a fixed threshold above small activations, the heap's top kept up to 2x it
        found[f"glibc-{mib}mib-trim"] = Option(
            f"glibc-{mib}mib-trim", "after", {"GLIBC_TUNABLES": f"glibc.malloc.mmap_threshold={mib * MiB}:"
                                                             f"glibc.malloc.trim_threshold={2 * mib * MiB}"},
            f"this tree, glibc with a fixed {mib} MiB mmap threshold and a {2 * mib} MiB trim threshold")
    if jemalloc:
        def jemalloc_option(name, conf, what, extra=None):
            env = {"LD_PRELOAD": jemalloc, **({"MALLOC_CONF": conf} if conf else {}), **(extra or {})}
            found[name] = Option(name, "after", env, f"this tree, jemalloc {what}")
        jemalloc_option("jemalloc", JEMALLOC_CONF, f"preloaded with make's former MALLOC_CONF ({jemalloc})")
        jemalloc_option("jemalloc-thp", JEMALLOC_CONF, "with make's former MALLOC_CONF, torch's tensors on huge "
                        "pages", thp)
        jemalloc_option("jemalloc-keep", JEMALLOC_CONF + ",dirty_decay_ms:-1,muzzy_decay_ms:-1",
                        "that never hands freed pages back to the OS")
        jemalloc_option("jemalloc-reuse", "oversize_threshold:0,background_thread:true,metadata_thp:auto",
                        "without its dedicated arena for large blocks: freed blocks of every size stay for reuse "
                        "and are purged after its decay time (10 s)")
        jemalloc_option("jemalloc-decay1s", "oversize_threshold:0,background_thread:true,dirty_decay_ms:1000,"
                        "muzzy_decay_ms:0", "without the large-block arena, freed pages purged after 1 s")
        jemalloc_option("jemalloc-bare", "", "preloaded with its default settings")
        jemalloc_option("jemalloc-decay1s-a1", "oversize_threshold:0,background_thread:true,dirty_decay_ms:1000,"
                        "muzzy_decay_ms:0,narenas:1", "without the large-block arena, one arena for every thread, "
                        "freed pages purged after 1 s")
        jemalloc_option("jemalloc-keep0", "oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1",
                        "without the large-block arena, never handing freed pages back to the OS")
        jemalloc_option("jemalloc-decay0", "oversize_threshold:0,background_thread:true,dirty_decay_ms:0,"
                        "muzzy_decay_ms:0", "without the large-block arena, freed pages purged at once")
    return found


def option_env(option: Option, tree: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}
    env.update(option.env)
    env["PYTHONPATH"] = tree
    return env


# ---- the baseline revision's tree ------------------------------------------------------------------------
class BaselineTree:
    """The baseline revision checked out as a git worktree: ``path`` if given (reused when it exists), else
    a temporary one, removed on exit (a worktree this created)."""

    def __init__(self, revision: str, path: str | None):
        self.revision, self.path, self.created, self.tmp = revision, path, False, None

    def __enter__(self) -> str:
        if self.path is None:
            self.tmp = tempfile.mkdtemp(prefix="megalite-before-")
            self.path = os.path.join(self.tmp, "tree")
        if not os.path.exists(self.path):
            subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", self.path, self.revision],
                           check=True)
            self.created = True
        head = subprocess.run(["git", "-C", self.path, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        wanted = subprocess.run(["git", "-C", ROOT, "rev-parse", self.revision], capture_output=True, text=True,
                                check=True).stdout.strip()
        if head != wanted:
            raise SystemExit(f"--baseline-tree {self.path} is at {head[:9]}, not {self.revision}: remove it or "
                             f"pass another path")
        return self.path

    def __exit__(self, *exc) -> bool:
        if self.created:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", self.path], check=False)
        if self.tmp and os.path.isdir(self.tmp) and not os.listdir(self.tmp):
            os.rmdir(self.tmp)
        return False


# ---- step time: one long-lived worker per option ----------------------------------------------------------
STEP_DRIVER = r"""
import importlib.util, json, resource, sys
sys.path[:0] = ["bench", "."]
if sys.argv[2] != "hf" and importlib.util.find_spec("megalite.train.allocator"):   # pretrain_gpt.py's first act
    from megalite.train.allocator import set_allocator_policy
    set_allocator_policy()
from bench_vs_hf import FULL, QUICK, HFLoop, MegaliteLoop
shape = QUICK if sys.argv[1] == "quick" else FULL
loop = HFLoop(shape, sys.argv[3]) if sys.argv[2] == "hf" else MegaliteLoop(shape, sys.argv[3], compiled=False)
with open("/proc/self/maps") as f:
    jemalloc = "libjemalloc" in f.read()
cache = sys.modules.get("megalite.caching_cpu_allocator")
caching = cache is not None and getattr(cache, "_library", None) is not None
print("@@allocator " + json.dumps({"jemalloc": jemalloc, "caching": caching}), flush=True)
for line in sys.stdin:
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    times = loop.run(int(line))
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print("@@allocator " + json.dumps({"times": times, "sys": r1.ru_stime - r0.ru_stime,
                                      "user": r1.ru_utime - r0.ru_utime,
                                      "minflt": r1.ru_minflt - r0.ru_minflt, "maxrss": r1.ru_maxrss * 1024}),
          flush=True)
"""


class StepWorker:
    """One option's training loop in its own process, driven over stdin/stdout."""

    def __init__(self, option: Option, tree: str, quick: bool, dtype: str):
        self.option = option
        self.proc = subprocess.Popen([sys.executable, "-c", STEP_DRIVER, "quick" if quick else "full", option.loop,
                                      dtype], cwd=tree,
                                     env=option_env(option, tree), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.times: list[float] = []
        self.sys_seconds, self.user_seconds, self.faults, self.maxrss = 0.0, 0.0, 0, 0
        self.allocator = self.reply()

    def reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"{self.option.name}: the step worker exited with code {self.proc.wait()}")

    def run(self, steps: int, timed: bool = True) -> None:
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        r = self.reply()
        if timed:
            self.times += r["times"]
            self.sys_seconds += r["sys"]
            self.user_seconds += r["user"]
            self.faults += r["minflt"]
        self.maxrss = r["maxrss"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def measure_steps(chosen: list[Option], trees: dict, args) -> dict[str, StepWorker]:
    """Warm every worker up one at a time, then ``args.rounds`` rounds of ``args.steps`` steps per worker."""
    workers = {}
    try:
        for option in chosen:                   # start-up one at a time: they never share the cores
            workers[option.name] = StepWorker(option, trees[option.tree], args.quick, args.dtype)
            workers[option.name].run(args.warmup, timed=False)
            print(f"  step: {option.name} ready ({workers[option.name].allocator})", flush=True)
        names = [o.name for o in chosen]
        for i in range(args.rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:     # nobody always goes first
                workers[name].run(args.steps)
            print(f"  step round {i + 1}/{args.rounds}: " + ", ".join(
                f"{n} {1000 * statistics.median(w.times):.0f} ms" for n, w in workers.items())
                + f" (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return workers


# ---- memory: each tree's bench_memory.py --sections zero --------------------------------------------------
def run_zero(option: Option, tree: str, args) -> dict[str, tuple[float, float | None]]:
    """{strategy: (peak MiB per rank, share of the theoretical saving)} from one bench_memory.py run."""
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "RESULTS.md")
        argv = [sys.executable, "bench/bench_memory.py", "--sections", args.zero_section, "--results", results,
                "--steps", str(args.memory_steps), *(["--quick"] if args.quick else [])]
        subprocess.run(argv, cwd=tree, env=option_env(option, tree), check=True, stdout=subprocess.DEVNULL)
        lines = read_section("bench_memory_" + args.zero_section.replace("-", "_"), results) or []
    rows = {}
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[3].replace(".", "").isdigit():
            rows[cells[0]] = (float(cells[3]), None if cells[5] == "-" else float(cells[5]))
    if not rows:
        raise RuntimeError(f"{option.name}: no ZeRO table in bench_memory.py's output")
    return rows


def measure_zero(chosen: list[Option], trees: dict, args) -> dict[str, dict]:
    chosen = [o for o in chosen if o.loop != "hf"]
    runs = {o.name: [] for o in chosen}
    for i in range(args.memory_rounds):
        for option in chosen[i % len(chosen):] + chosen[:i % len(chosen)]:
            start = time.perf_counter()
            runs[option.name].append(run_zero(option, trees[option.tree], args))
            print(f"  zero: {option.name} round {i + 1}/{args.memory_rounds} in {time.perf_counter() - start:.0f} s",
                  flush=True)
    return {name: {strategy: (statistics.median(r[strategy][0] for r in rs),
                              statistics.median(r[strategy][1] for r in rs) if rs[0][strategy][1] is not None
                              else None)
                   for strategy in rs[0]} for name, rs in runs.items()}


# ---- the section ------------------------------------------------------------------------------------------
def step_rows(chosen: list[Option], workers: dict) -> list[str]:
    """Wall time, and CPU time (user + system: what the step itself used, less sensitive to other work on
    a shared machine than wall time), each against the baseline and transformers' step."""
    def cpu(w):
        return (w.user_seconds + w.sys_seconds) / len(w.times)
    base = statistics.median(workers[chosen[0].name].times)
    hf = workers.get("hf")
    rows = ["| option | ms / iteration (median) | vs " + chosen[0].name + " | transformers ms / this ms | "
            "CPU ms / iteration | transformers CPU ms / this CPU ms | system ms / iteration | minor page faults / "
            "iteration | worker peak RSS MiB | allocator seen |", "|---|---|---|---|---|---|---|---|---|---|"]
    for option in chosen:
        w = workers[option.name]
        ms, n = statistics.median(w.times), len(w.times)
        seen = "caching CPU allocator" if w.allocator["caching"] else ("jemalloc" if w.allocator["jemalloc"]
                                                                       else "glibc")
        mine = hf is not None and option.loop != "hf"
        vs_hf = f"**{statistics.median(hf.times) / ms:.2f}x**" if mine else "-"
        cpu_vs_hf = f"**{cpu(hf) / cpu(w):.2f}x**" if mine else "-"
        rows.append(f"| {option.name} | {1000 * ms:.0f} | {ms / base:.2f}x | {vs_hf} | {1000 * cpu(w):.0f} | "
                    f"{cpu_vs_hf} | {1000 * w.sys_seconds / n:.0f} | {w.faults / n:,.0f} | {w.maxrss / MiB:.0f} | "
                    f"{seen} |")
    return rows


def zero_rows(zero: dict) -> list[str]:
    strategies = list(next(iter(zero.values())))
    rows = ["| option | " + " | ".join(f"{s} peak MiB (share of theoretical saving)" for s in strategies) +
            f" | worst share | all >= {TARGET_SHARE} |", "|---|" + "---|" * (len(strategies) + 2)]
    for name, z in zero.items():
        shares = [z[s][1] for s in strategies if z[s][1] is not None]
        cells = [f"{z[s][0]:.0f}" + (f" ({z[s][1]:.2f})" if z[s][1] is not None else "") for s in strategies]
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {min(shares):.2f} | "
                    f"{'yes' if min(shares) >= TARGET_SHARE else '**no**'} |")
    return rows


def make_test_rows(args) -> list[str]:
    def shown(seconds):
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s" if seconds else "not given"
    ratio = (f"{args.make_test_after / args.make_test_before:.2f}x" if args.make_test_before and args.make_test_after
             else "-")
    return ["| make test wall time | before | after (jemalloc) | after / before |", "|---|---|---|---|",
            f"| `make test` (default suite, 2 workers) | {shown(args.make_test_before)} | "
            f"{shown(args.make_test_after)} | {ratio} |"]


def headlines(chosen: list[Option], workers: dict, zero: dict, command: str) -> list[Headline]:
    found = []
    if "hf" in workers:
        hf = statistics.median(workers["hf"].times)
        found += [Headline(f"megalite training step, {o.name}", "transformers LlamaForCausalLM, bare glibc, same "
                           "model (bench_vs_hf.py's)", f"{hf / statistics.median(workers[o.name].times):.2f}x "
                           "faster (HF ms / megalite ms)", command) for o in chosen if o.loop != "hf"]
    for name, z in zero.items():
        worst = min(share for _, share in z.values() if share is not None)
        found.append(Headline(f"ZeRO-1/2/3 memory saving at DP=4, {name}", "ZeRO theory, each stage over the "
                              f"one before", f"{worst:.2f} of theory at worst (>= {TARGET_SHARE}: "
                              f"{'yes' if worst >= TARGET_SHARE else 'no'})", command))
    return found


def body_lines(chosen: list[Option], workers: dict, zero: dict, args) -> list[str]:
    described = [f"**{o.name}**: {o.what}" + (f" ({', '.join(f'{k}={v}' for k, v in o.env.items())})" if o.env else "")
                 for o in chosen]
    lines = ["Options: " + "; ".join(described) + "."]
    if workers:
        shape = "bench_vs_hf.py --quick's model" if args.quick else "bench_vs_hf.py's model"
        lines += ["", f"Step: {shape}, {args.dtype}, through each tree's megalite training loop (the time its log "
                      f"lines print; the hf option: transformers' step, bench_vs_hf.py's); one worker per option, "
                      f"{args.warmup} warm-up steps, then {args.rounds} rounds of "
                      f"{args.steps} steps per worker in a rotating order; medians. Peak RSS: the worker's "
                      "ru_maxrss (start-up included).", "", *step_rows(chosen, workers)]
    if zero:
        lines += ["", f"ZeRO: each tree's `bench/bench_memory.py --sections {args.zero_section} --steps "
                      f"{args.memory_steps}{' --quick' if args.quick else ''}` (DP=4, bf16; peak RSS per rank, max "
                      f"over ranks; that section's table gives the theory), {args.memory_rounds} run(s) per option, "
                      "medians.", "", *zero_rows(zero)]
    if args.make_test_before or args.make_test_after:
        lines += ["", "`make test` is timed apart (given with --make-test-before/--make-test-after):", "",
                  *make_test_rows(args)]
    return lines


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--options", default="hf,policy,glibc,jemalloc",
                   help="comma-separated option names (the docstring lists them; the first is the baseline of the "
                        "step-time ratios; default hf,policy,glibc,jemalloc)")
    p.add_argument("--baseline", default="d50f0c9", help="the revision 'before' runs (default d50f0c9)")
    p.add_argument("--baseline-tree", help="its worktree: reused if it exists, else created there and removed "
                                           "after (default: a temporary one)")
    p.add_argument("--measure", default="step,zero", help="step, zero or both (default both)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the timed steps' precision")
    p.add_argument("--zero-section", default="zero-pretrain", choices=("zero", "zero-pretrain"),
                   help="bench_memory.py's section the ZeRO memory comes from: through torchrun pretrain_gpt.py "
                        "(zero-pretrain, the default) or its in-process ranks (zero)")
    p.add_argument("--rounds", type=int, help="step-time rounds (default 3; 1 with --quick)")
    p.add_argument("--steps", type=int, help="steps per worker per round (default 2; 1 with --quick)")
    p.add_argument("--warmup", type=int, help="warm-up steps per worker (default 2; 1 with --quick)")
    p.add_argument("--memory-rounds", type=int, help="bench_memory.py runs per option (default 1)")
    p.add_argument("--memory-steps", type=int, help="training steps per bench_memory.py run (default 2)")
    p.add_argument("--make-test-before", type=float, help="seconds `make test` took at the baseline revision")
    p.add_argument("--make-test-after", type=float, help="seconds `make test` took in this tree (jemalloc)")
    add_common_args(p)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.steps = args.steps or (1 if args.quick else 2)
    args.warmup = args.warmup or (1 if args.quick else 2)
    args.memory_rounds = args.memory_rounds or 1
    args.memory_steps = args.memory_steps or 2
    return args


def main(argv: list[str]) -> None:
    args = parse(argv)
    known = options(find_jemalloc(), args.baseline)
    missing = [n for n in args.options.split(",") if n not in known]
    if missing:
        raise SystemExit(f"unknown or unavailable --options {missing} (available here: {', '.join(known)}; "
                         "the jemalloc ones need libjemalloc.so.2 installed or $JEMALLOC)")
    chosen = [known[n] for n in args.options.split(",")]
    measure = set(args.measure.split(","))
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        trees = {"after": ROOT}
        if any(o.tree == "before" for o in chosen):
            trees["before"] = stack.enter_context(BaselineTree(args.baseline, args.baseline_tree))
        workers = measure_steps(chosen, trees, args) if "step" in measure else {}
        zero = measure_zero(chosen, trees, args) if "zero" in measure else {}
    minutes = (time.perf_counter() - started) / 60
    command = command_line("bench_allocator.py", argv)
    body = [*body_lines(chosen, workers, zero, args), "", f"The comparison took {minutes:.1f} minutes."]
    print("\n".join(body), flush=True)
    publish(args, "bench_allocator", "CPU allocator: before (caching allocator) vs jemalloc vs glibc", command,
            headlines(chosen, workers, zero, command), body)


if __name__ == "__main__":
    main(sys.argv[1:])
