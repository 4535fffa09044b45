"""Every tools/*.py script answers a user mistake - an unknown flag, a missing required flag, a missing
input file - with one line ``error: ...`` on stderr naming the flag, and a non-zero exit code."""
from __future__ import annotations

import glob
import importlib.util
import os

import pytest

from conftest import ROOT, _one_line_error

TOOLS = sorted(os.path.basename(path) for path in glob.glob(os.path.join(ROOT, "tools", "*.py")))
MISSING = "/nonexistent/megalite-input"
# the flags each tool requires (none where absent; an argparse-required flag first), so that the one mistake
# under test is the only one
REQUIRED = {
    "convert_checkpoint.py": ["--from", "hf", "--to", "megalite", "--input", MISSING, "--output", "{tmp}/out"],
    "generate.py": ["--load", MISSING, "--prompt", "hi"],
    "merge_datasets.py": ["--input", MISSING, "--output-prefix", "{tmp}/merged"],
    "plan_parallelism.py": ["--num-gpus", "8", "--hf-config", MISSING, "--gpu-memory-gb", "80", "--seq-length", "64",
                            "--global-batch-size", "8"],
    "plot_metrics.py": ["--output-dir", "{tmp}/plots", MISSING],
    "preprocess_data.py": ["--input", MISSING, "--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
                           "--output-prefix", "{tmp}/data"],
    "stdlib_corpus.py": ["--output", "{tmp}/corpus.jsonl", "--root", MISSING],
    "train_tokenizer.py": ["--input", MISSING, "--output-prefix", "{tmp}/tok"],
}


def required(tool: str, tmp_path) -> list[str]:
    return [arg.format(tmp=tmp_path) for arg in REQUIRED.get(tool, [])]


def tool_main(tool: str):
    spec = importlib.util.spec_from_file_location(tool[:-3], os.path.join(ROOT, "tools", tool))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_every_tool_is_covered():
    assert "plan_parallelism.py" in TOOLS and set(REQUIRED) <= set(TOOLS)


@pytest.mark.parametrize("tool", TOOLS)
def test_an_unknown_flag_is_one_line(tool, run_tool, tmp_path):
    proc = run_tool(tool, *required(tool, tmp_path), "--no-such-flag")
    line = _one_line_error(proc.stderr)
    assert proc.returncode != 0 and "--no-such-flag" in line and "--help" in line, proc.stderr


@pytest.mark.parametrize("tool", sorted(REQUIRED))
def test_a_missing_required_flag_is_one_line(tool, tmp_path, capsys):
    """The tool's first required flag left out (in-process: the same main() the script runs)."""
    flag, _, *rest = required(tool, tmp_path)
    code = tool_main(tool)(rest)
    line = _one_line_error(capsys.readouterr().err)
    assert code != 0 and "required" in line and flag in line


@pytest.mark.parametrize("tool", sorted(REQUIRED))
def test_a_missing_input_file_is_one_line(tool, tmp_path, capsys):
    code = tool_main(tool)(required(tool, tmp_path))
    line = _one_line_error(capsys.readouterr().err)
    assert code != 0 and MISSING in line
