"""The torch floor that requirements.txt and pyproject.toml declare is true for torch.distributed: every
torch.distributed name that megalite/, pretrain_gpt.py and tools/ use exists in that release, and the
single-tensor collectives fall back to their pre-2.13 names where the new ones are absent.

The floor is torch 2.7: ``--compile`` sets ``torch._dynamo.config.recompile_limit`` (named
``cache_size_limit`` before 2.7), and FSDP2 (``--use-torch-fsdp2``) imports ``fully_shard`` and
``MixedPrecisionPolicy`` from ``torch.distributed.fsdp`` (from 2.6) and ``DTensor`` / ``Shard`` from
``torch.distributed.tensor`` (from 2.5). Names outside torch.distributed are not scanned here.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch.distributed as dist

from megalite.parallel import collectives

ROOT = pathlib.Path(__file__).resolve().parents[2]
FLOOR = "2.7"

# torch.distributed names (relative to torch.distributed) that torch 2.7.0 has, limited to those megalite
# uses or may reach for. Checked against the Python sources of the torch 2.7.0 wheel from PyPI:
# torch/distributed/__init__.py (its imports from torch._C._distributed_c10d and from .distributed_c10d,
# whose __all__ it star-imports), distributed_c10d.py, torch/_C/_distributed_c10d.pyi (ReduceOp's
# members), device_mesh.py (DeviceMesh.from_group), fsdp/__init__.py and tensor/__init__.py (DTensor,
# Shard; DTensor.from_local in tensor/_api.py). Not in 2.7: reduce_scatter_single, all_gather_single
# (torch 2.13 names, reached only through megalite.parallel.collectives).
NAMES_AT_FLOOR = frozenset({
    # process groups and ranks
    "init_process_group", "destroy_process_group", "is_available", "is_initialized", "new_group",
    "get_rank", "get_world_size", "get_backend", "get_global_rank", "get_process_group_ranks",
    "group", "group.WORLD", "barrier",
    # errors
    "DistError", "DistStoreError", "DistBackendError",
    # collectives
    "ReduceOp", "ReduceOp.SUM", "ReduceOp.MAX", "ReduceOp.MIN", "all_reduce", "reduce", "broadcast", "all_gather",
    "reduce_scatter", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
    "all_gather_object", "broadcast_object_list",
    # point to point
    "P2POp", "isend", "irecv", "send", "recv", "batch_isend_irecv",
    # FSDP2 and DTensor
    "device_mesh", "device_mesh.DeviceMesh", "device_mesh.DeviceMesh.from_group", "fsdp", "fsdp.fully_shard",
    "fsdp.MixedPrecisionPolicy", "tensor", "tensor.DTensor", "tensor.DTensor.from_local", "tensor.Shard",
})


def source_files() -> list[pathlib.Path]:
    return [*sorted((ROOT / "megalite").rglob("*.py")), ROOT / "pretrain_gpt.py",
            *sorted((ROOT / "tools").rglob("*.py"))]


def _bindings(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted torch path it stands for, from the module's imports."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    bound[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def distributed_names(source: str) -> set[str]:
    """The torch.distributed names ``source`` imports or reads, relative to torch.distributed: the
    outermost attribute chain on an imported torch name (``dist.ReduceOp.SUM`` -> ``ReduceOp.SUM``)."""
    tree = ast.parse(source)
    bound = _bindings(tree)
    paths = list(bound.values())
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            attrs = []
            while isinstance(node, ast.Attribute):
                attrs.append(node.attr)
                node = node.value
            if isinstance(node, ast.Name) and node.id in bound:
                paths.append(".".join([bound[node.id], *reversed(attrs)]))
    prefix = "torch.distributed."
    return {p[len(prefix):] for p in paths if p.startswith(prefix)}


def test_the_scanner_sees_every_way_of_naming_torch_distributed():
    source = """
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as shard
from torch import distributed as d2
dist.ReduceOp.SUM
torch.distributed.all_reduce(x)
d2.get_rank().bit_length()
dist.get_world_size
"""
    assert distributed_names(source) == {"ReduceOp.SUM", "all_reduce", "fsdp.fully_shard", "get_rank",
                                         "get_world_size"}


def test_every_torch_distributed_name_used_exists_at_the_floor():
    used = {}
    for path in source_files():
        for name in distributed_names(path.read_text()):
            used.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert {"all_reduce", "ReduceOp.SUM", "fsdp.fully_shard"} <= used.keys(), "the scan found too little"
    missing = {name: files for name, files in used.items() if name not in NAMES_AT_FLOOR}
    assert not missing, (f"torch.distributed names missing in torch {FLOOR} (raise the floor, or add a "
                         f"fallback in megalite/parallel/collectives.py): {missing}")


def _floor(text: str) -> str:
    found = re.findall(r"""^\s*"?torch>=([0-9.]+)""", text, flags=re.MULTILINE)
    assert len(found) == 1, found
    return found[0]


def test_requirements_and_pyproject_declare_this_floor():
    assert _floor((ROOT / "requirements.txt").read_text()) == FLOOR
    assert _floor((ROOT / "pyproject.toml").read_text()) == FLOOR


# ---- the name fallback of megalite.parallel.collectives ----------------------------------------------
def _recorder(calls: list, name: str):
    def fn(*args, **kwargs):
        calls.append((name, kwargs))
        return name
    return fn


def test_without_the_2_13_names_the_collectives_call_the_old_ones(monkeypatch):
    calls = []
    for name in ("reduce_scatter_single", "all_gather_single"):
        monkeypatch.delattr(dist, name, raising=False)
    for name in ("reduce_scatter_tensor", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, _recorder(calls, name))
    assert collectives.reduce_scatter_single("out", "in", group="g", async_op=True) == "reduce_scatter_tensor"
    assert collectives.all_gather_single("out", "in", group="g") == "all_gather_into_tensor"
    assert calls == [("reduce_scatter_tensor", {"op": dist.ReduceOp.SUM, "group": "g", "async_op": True}),
                     ("all_gather_into_tensor", {"group": "g", "async_op": False})]


def test_with_the_2_13_names_the_collectives_call_them(monkeypatch):
    calls = []
    for name in ("reduce_scatter_single", "all_gather_single", "reduce_scatter_tensor", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, _recorder(calls, name), raising=False)
    collectives.reduce_scatter_single("out", "in", op=dist.ReduceOp.MAX)
    collectives.all_gather_single("out", "in", async_op=True)
    assert [name for name, _ in calls] == ["reduce_scatter_single", "all_gather_single"]
    assert calls[0][1]["op"] == dist.ReduceOp.MAX and calls[1][1]["async_op"]


@pytest.mark.parametrize("value, list_form", [(None, True), ("0", True), ("1", False)])
def test_the_switch_sends_gloo_bucket_collectives_down_the_nccl_branch(monkeypatch, value, list_form):
    monkeypatch.setattr(dist, "get_backend", lambda group: "gloo")
    if value is None:
        monkeypatch.delenv(collectives.FORCE_NCCL_PATH_ENV, raising=False)
    else:
        monkeypatch.setenv(collectives.FORCE_NCCL_PATH_ENV, value)
    assert collectives.bucket_list_form(object()) is list_form
    assert collectives.bucket_list_form(None) is False
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    assert collectives.bucket_list_form(object()) is False
