"""The shape of the code: small modules and functions, a short top level, no duck-typed probes, no dead code.

- no module in megalite/ over 500 lines, no function over 80;
- at most 3 modules at megalite/'s top level (the rest lives in packages that name their job);
- no getattr/hasattr probes on config, model or trainer objects outside Hugging Face conversion (whose
  input is a foreign config of many versions): a probe hides which interface the code relies on. Probes of
  a library for an optional symbol are allowed (torch, torch.distributed), as is a line that says why with
  a ``# probe:`` comment;
- ``vulture megalite --min-confidence 80`` reports nothing beyond tests/unit/vulture_whitelist.py.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from megalite_test_utils import ROOT

PACKAGE = os.path.join(ROOT, "megalite")
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_TOP_LEVEL_MODULES = 500, 80, 3
PROBES = {"getattr", "hasattr"}
LIBRARY_OBJECTS = {"torch", "dist", "torch._C", "torch.ops.aten", "torch.distributed", "np", "numpy"}
FOREIGN_INPUT = {os.path.join("checkpoint", "hf.py"), os.path.join("checkpoint", "hf_config.py")}


def modules() -> list[str]:
    found = []
    for directory, _, files in os.walk(PACKAGE):
        found += [os.path.join(directory, f) for f in files if f.endswith(".py")]
    return sorted(found)


def relative(path: str) -> str:
    return os.path.relpath(path, PACKAGE)


def test_no_module_over_500_lines():
    long = {relative(p): n for p in modules() if (n := len(open(p).read().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_80_lines():
    long = {}
    for path in modules():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f"{relative(path)}:{node.name}"] = length
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_at_most_three_top_level_modules():
    top = sorted(f for f in os.listdir(PACKAGE) if f.endswith(".py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_probes_outside_hf_conversion():
    probes = []
    for path in modules():
        if relative(path) in FOREIGN_INPUT:
            continue
        lines = open(path).read().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES):
                continue
            target = ast.unparse(node.args[0]) if node.args else ""
            if target in LIBRARY_OBJECTS or "# probe:" in lines[node.lineno - 1]:
                continue
            probes.append(f"{relative(path)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not probes, "duck-typed probes (use the typed interface):\n" + "\n".join(probes)


def test_vulture_finds_no_dead_code():
    pytest.importorskip("vulture")
    whitelist = os.path.join(ROOT, "tests", "unit", "vulture_whitelist.py")
    result = subprocess.run([sys.executable, "-m", "vulture", "megalite", whitelist, "--min-confidence", "80"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
