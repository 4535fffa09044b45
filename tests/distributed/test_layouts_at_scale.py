"""Published layouts at their real scale, proved by dry runs (bench/bench_layouts.py's list: GPT-3 175B on
1,024 GPUs, Llama-2 70B on 64, Llama-3.1 405B on 16,384, DeepSeek-V3 671B with EP64 on 1,024, Mixtral 8x22B
with EP8 on 256):
tools/plan_parallelism.py --verify runs one rank of each distinct role (--fake-process-group
--no-storage) and prints its peak memory by category beside the planner's estimate. Every role must fit
an 80 GB device, with the planner within 10% of the dry run's peak (the tool's exit code says so, and
the table is checked here). The figures are in bench/RESULTS.md ("Layouts at scale")."""
import os
import re
import subprocess
import sys

import pytest

from megalite_test_utils import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_layouts import GPU_MEMORY_GB, LAYOUTS  # noqa: E402

ROW = re.compile(r"^\s+(\d+) pipeline rank (\d+): .*?\s([+-]\d+\.\d)%  (yes|NO)", re.M)


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_published_layout_fits_and_the_planner_agrees_with_its_dry_runs(name):
    argv = LAYOUTS[name]
    proc = subprocess.run([sys.executable, f"{ROOT}/tools/plan_parallelism.py", *argv, "--gpu-memory-gb",
                           str(GPU_MEMORY_GB), "--top", "1", "--verify"], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = ROW.findall(proc.stdout)
    pp = int(re.search(r"--pipeline-model-parallel-size (\d+)", proc.stdout).group(1))
    stages = {int(stage) for _, stage, _, _ in rows}
    assert {0, pp // 2, pp - 1} <= stages, proc.stdout[-3000:]          # first, middle and last stage at least
    for _, stage, error, fits in rows:
        assert fits == "yes" and abs(float(error)) <= 10, (stage, error, fits)
