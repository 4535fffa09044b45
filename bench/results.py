"""bench/RESULTS.md: one section per benchmark, replaced in place (the other sections stay as they are).

Every bench script uses the same few pieces from here:
- ``add_common_args``: --quick (fewer steps and sizes, a smoke test), --results (the file to write) and
  --headlines (where run_all.py collects each script's headline figures for its summary table);
- ``publish``: writes the script's section -- title, machine, command, headline ratios, then its table --
  and hands the headlines to run_all.py.

Quick runs write bench/quick/RESULTS.md unless --results says otherwise, so a smoke test never
overwrites the measured figures in bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, dataclass

BENCH = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(BENCH, "RESULTS.md")
QUICK_RESULTS = os.path.join(BENCH, "quick", "RESULTS.md")
TITLE = "# Benchmark results"
QUICK_NOTE = "QUICK MODE (smoke test: fewer steps and sizes; not a measurement)"
INTERNAL_FLAGS = ("--results", "--headlines")      # where to write; not part of the command a reader reruns


@dataclass
class Headline:
    """One row of the summary table: a figure measured side by side with its baseline in one run."""
    benchmark: str
    baseline: str
    ratio: str
    command: str


# ---- flags every bench script takes ------------------------------------------------------------
def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: fewer steps and sizes, marked as such; writes bench/quick/RESULTS.md")
    parser.add_argument("--results", help="the results file to update (default bench/RESULTS.md, or "
                                          "bench/quick/RESULTS.md with --quick)")
    parser.add_argument("--headlines", help="append the headline figures as JSON lines here (run_all.py uses it)")


def results_path(args: argparse.Namespace) -> str:
    return args.results or (QUICK_RESULTS if args.quick else RESULTS)


def command_line(script: str, argv: list[str]) -> str:
    """The command that reruns this benchmark: ``python bench/SCRIPT`` and its flags, less where it writes."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in INTERNAL_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in INTERNAL_FLAGS)):
            kept.append(arg)
    return " ".join(["python", f"bench/{script}", *kept])


# ---- the machine -------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            return names[0]
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"


def machine_description() -> str:
    import torch
    return (f"{cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()} "
            f"({platform.machine()}); Python {platform.python_version()}, torch {torch.__version__}; GPU: {gpu_name()}")


def machine_line() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"Machine: {machine_description()}. {time.strftime('%Y-%m-%d %H:%M')}, load average {load:.1f} "
            "(other work on the machine makes timings noisy when it is above 0).")


# ---- writing sections --------------------------------------------------------------------------
def _markers(key: str) -> tuple[str, str]:
    return f"<!-- {key} begin -->", f"<!-- {key} end -->"


def read_section(key: str, path: str = RESULTS) -> list[str] | None:
    """The lines between a section's markers, or None when the file has no such section."""
    begin, end = _markers(key)
    text = open(path).read() if os.path.exists(path) else ""
    if begin not in text or end not in text:
        return None
    return text[text.index(begin) + len(begin):text.index(end)].strip("\n").split("\n")


def replace_section(key: str, lines: list[str], path: str = RESULTS, top: bool = False) -> None:
    """Replace section ``key`` in place; a new section goes at the end (or, with ``top``, under the title)."""
    begin, end = _markers(key)
    block = "\n".join([begin, *lines, end])
    text = open(path).read() if os.path.exists(path) else TITLE + "\n"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    elif top and text.startswith(TITLE):
        text = TITLE + "\n\n" + block + "\n\n" + text[len(TITLE):].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def section_lines(title: str, command: str, headlines: list[Headline], body: list[str], quick: bool) -> list[str]:
    lines = [f"## {title}" + (f" -- {QUICK_NOTE}" if quick else ""), machine_line(), f"Command: `{command}`"]
    lines += ["", *(f"- **{h.benchmark}**: {h.ratio} (baseline: {h.baseline})" for h in headlines)]
    return lines + ["", *body]


def publish(args: argparse.Namespace, key: str, title: str, command: str, headlines: list[Headline],
            body: list[str]) -> None:
    """Write this benchmark's section of the results file and hand its headlines to run_all.py."""
    if not getattr(args, "no_write", False):
        replace_section(key, section_lines(title, command, headlines, body, args.quick), results_path(args))
    if args.headlines:
        with open(args.headlines, "a") as f:
            for h in headlines:
                f.write(json.dumps(asdict(h)) + "\n")


def read_headlines(path: str) -> list[Headline]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [Headline(**json.loads(line)) for line in f if line.strip()]
