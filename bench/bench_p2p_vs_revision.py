#!/usr/bin/env python
"""Pipeline step time and bubble of this tree's executor against another revision's, side by side in one
run on gloo: what the NCCL-safe posting order (megalite/parallel/pipeline/plan.py) costs where gloo would
have forgiven any order.

For every synchronous schedule at pp=2 (GPipe, 1F1B, interleaved, ZB-H1, ZB-V) it records steps of the
same model through tools/plot_pipeline.py's ``record_schedule`` in both trees (the revision checked out
in a temporary git worktree), alternating which tree goes first each round, and reports the median over
rounds of each tree's step time (first action's start to last action's end over both ranks, median step
of those recorded) and measured bubble share, and their ratios (this tree / revision).

    python bench/bench_p2p_vs_revision.py --baseline 5876bc4        # a revision that posts in action order
    python bench/bench_p2p_vs_revision.py --baseline 5876bc4 --quick
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("zbv", 2)]
DRIVER = """
import json, sys
sys.path[:0] = ["tools", "."]
from plot_pipeline import measured_bubble_share, record_schedule
records = record_schedule(**json.loads(sys.argv[1]))
events = [e for r in records for e in r.events]
print(json.dumps({"step": max(e[4] for e in events) - min(e[3] for e in events),
                  "bubble": measured_bubble_share(records)}))
"""


def measure(tree: str, opts: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(opts)], cwd=tree, env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def name(schedule: str, vpp: int) -> str:
    return {"gpipe": "GPipe", "zb-h1": "ZB-H1", "zbv": "ZB-V"}.get(schedule, "1F1B" if vpp == 1 else "interleaved")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="the git revision to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=8)
    add_common_args(parser)
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    model = dict(layers_per_stage=2, hidden=128, seq=64) if args.quick else dict(layers_per_stage=4, hidden=512, seq=128)
    with tempfile.TemporaryDirectory() as tmp:
        baseline = os.path.join(tmp, "baseline")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", baseline, args.baseline], check=True)
        try:
            results = {}
            for i in range(rounds):
                for schedule, vpp in SCHEDULES:
                    opts = dict(pp=2, microbatches=args.microbatches, vpp=vpp, schedule=schedule, mbs=2, steps=3,
                                layers_per_stage=model["layers_per_stage"] // vpp, hidden=model["hidden"], seq=model["seq"])
                    trees = [("this", ROOT), ("baseline", baseline)][:: 1 if i % 2 == 0 else -1]
                    for label, tree in trees:
                        results.setdefault((schedule, vpp, label), []).append(measure(tree, opts))
                print(f"round {i + 1}/{rounds} done", flush=True)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", baseline], check=False)
    body = [f"pp=2, m={args.microbatches}, fp32, {rounds} rounds alternating which tree runs first; medians.", "",
            "| schedule | step (ms) this / baseline | ratio | bubble this / baseline |", "|---|---|---|---|"]
    ratios = []
    for schedule, vpp in SCHEDULES:
        med = {label: {k: statistics.median(r[k] for r in results[(schedule, vpp, label)]) for k in ("step", "bubble")}
               for label in ("this", "baseline")}
        ratio = med["this"]["step"] / med["baseline"]["step"]
        ratios.append(ratio)
        body.append(f"| {name(schedule, vpp)} | {1e3 * med['this']['step']:.1f} / {1e3 * med['baseline']['step']:.1f} | "
                    f"{ratio:.2f} | {100 * med['this']['bubble']:.1f}% / {100 * med['baseline']['bubble']:.1f}% |")
    command = command_line("bench_p2p_vs_revision.py", sys.argv[1:])
    headline = Headline("pipeline step time, NCCL-safe posting order vs " + args.baseline, args.baseline,
                        f"{min(ratios):.2f}-{max(ratios):.2f}x over {len(SCHEDULES)} schedules", command)
    publish(args, "bench_p2p_vs_revision", "Pipeline posting order: step time against an earlier revision", command,
            [headline], body)
    print("\n".join(body))


if __name__ == "__main__":
    main()
