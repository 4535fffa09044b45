"""The dry run has one home, megalite/parallel/dry_run.py: no other module tests a dry-run flag or names
the dry run's questions (peers absent, no storage) under a name of its own, and its two backends answer
them as the real run and a rank without peers do.

Allowed outside the backend: the flags' definitions and checks (config/, a floor below the backend) and
launch_env.py, which reads the world a dry run plays before torch loads. Prose may describe dry runs (the
planner's --verify measures with them); names and the flags' text may not.
"""
from __future__ import annotations

import ast
import os
from types import SimpleNamespace

import torch

from megalite.parallel.dry_run import REAL_RUN, DryRun, MetaStandIns, choose_run
from megalite.parallel.launch_env import LaunchEnv
from megalite_test_utils import ROOT

PACKAGE = os.path.join(ROOT, "megalite")
ALLOWED = {os.path.join("parallel", "dry_run.py"), os.path.join("parallel", "launch_env.py")}
NAMES = {"fake", "dry_run", "alone", "mirror", "no_storage", "fake_process_group", "fake_world_size", "fake_rank"}
FLAGS = ("--fake-process-group", "--no-storage", "--fake-world-size", "--fake-rank")


def identifiers(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every name the module binds or reads: variables, attributes, arguments, keywords,
    functions, classes and imported names (not the module paths imported from)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.arg):
            found.append((node.lineno, node.arg))
        elif isinstance(node, ast.keyword) and node.arg:
            found.append((node.value.lineno, node.arg))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.lineno, node.name))
        elif isinstance(node, ast.alias):
            found.append((node.lineno, node.asname or node.name.split(".")[-1]))
    return found


def mentions(path: str) -> list[str]:
    text = open(path, encoding="utf-8").read()
    tree = ast.parse(text)
    found = [f"{line}: {name}" for line, name in identifiers(tree) if name in NAMES]
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [f"{node.lineno}: {flag}" for flag in FLAGS if flag in node.value]
    return found


def test_no_module_outside_the_backend_mentions_the_dry_run():
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            path = os.path.join(folder, file)
            rel = os.path.relpath(path, PACKAGE)
            if not file.endswith(".py") or rel in ALLOWED or rel.startswith("config" + os.sep):
                continue
            found += [f"megalite/{rel}:{m}" for m in mentions(path)]
    assert not found, "dry-run names outside megalite/parallel/dry_run.py (ask its backend):\n" + "\n".join(found)


def test_the_check_finds_a_flag_test(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(parallel, run):\n    return parallel.fake or run(alone=True) or '--no-storage'\n")
    assert mentions(str(probe)) == ["2: fake", "2: alone", "2: --no-storage"]


def flags(fake: bool, no_storage: bool = False) -> SimpleNamespace:
    return SimpleNamespace(fake_process_group=fake, no_storage=no_storage, fake_world_size=8, fake_rank=3)


def test_the_backend_is_chosen_from_the_flags():
    assert choose_run(flags(False)) is REAL_RUN
    dry = choose_run(flags(True, no_storage=True))
    assert isinstance(dry, DryRun) and (dry.env.rank, dry.env.world_size, dry.storage) == (3, 8, False)
    assert dry.device(lambda: torch.device("cpu")).type == "meta"
    assert choose_run(flags(True)).device(lambda: torch.device("cpu")).type == "cpu"
    assert REAL_RUN.device(lambda: torch.device("cpu")).type == "cpu"


def test_the_real_run_and_a_rank_without_peers_answer_apart():
    dry = DryRun(LaunchEnv(3, 8, 0, launched=True), storage=True)
    assert (REAL_RUN.is_logging_rank(3, 8), REAL_RUN.is_logging_rank(7, 8), dry.is_logging_rank(3, 8)) == \
        (False, True, True)
    assert (REAL_RUN.reports_here(3), REAL_RUN.reports_here(0), dry.reports_here(3)) == (False, True, True)
    assert REAL_RUN.per_rank(1, lambda: "mine", lambda: ["a", "b"]) == {0: "a", 1: "b"}
    assert dry.per_rank(3, lambda: "mine", lambda: ["a", "b"]) == {3: "mine"}
    assert (REAL_RUN.heeds(True), REAL_RUN.heeds(False), dry.heeds(True)) == (True, False, False)
    assert (REAL_RUN.accounts_first_step(False), dry.accounts_first_step(False)) == (False, True)
    assert (REAL_RUN.compares_peers(True), dry.compares_peers(True)) == (True, False)
    assert dry.cooperating_ranks() == (0, 1, None)
    assert "rank 3 of 8" in dry.parameter_line(lambda: 5, lambda: 1 / 0, "batch")
    assert REAL_RUN.parameter_line(lambda: 1 / 0, lambda: 2_000_000, "batch") == \
        " > number of parameters: 2000000 (2.00M); batch"


def test_absent_peers_send_what_this_rank_sends(monkeypatch):
    dry = DryRun(LaunchEnv(1, 4, 0, launched=True), storage=True)
    counts = torch.tensor([[1, 2], [3, 4]])
    assert dry.exchange_counts(counts, object(), 1).tolist() == [[3, 4], [3, 4]]
    assert dry.exchange_counts(counts, None, 1) is counts
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 3)
    assert dry.gather_counts(torch.tensor([5, 6]), object()).tolist() == [[5, 6]] * 3
    assert REAL_RUN.gather_counts(torch.tensor([5, 6]), None).tolist() == [[5, 6]]


def test_values_read_back_without_storage_are_zeros():
    assert isinstance(DryRun(LaunchEnv(0, 2, 0), storage=False).value_reads(), MetaStandIns)
    with DryRun(LaunchEnv(0, 2, 0), storage=False).value_reads():
        x = torch.ones(3, device="meta")
        assert x.sum().item() == 0 and not bool((x > 0).any()) and x.cpu().tolist() == [0, 0, 0]
