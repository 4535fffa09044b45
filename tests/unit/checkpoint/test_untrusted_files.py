"""Untrusted files: loading a checkpoint or a Hugging Face model never runs code from it.

- megalite checkpoints are safetensors + JSON (megalite/checkpoint/files.py): nothing is unpickled;
- a Hugging Face pytorch_model.bin is read with torch.load(weights_only=True), which refuses pickled code;
- a Megatron-LM checkpoint (torch.save pickles under iter_N/mp_rank_XX/) is refused without opening it;
- metadata.json and the index files cannot point the reader at files outside the checkpoint directory;
- config.json / tokenizer_config.json ``auto_map`` entries (remote code) are never imported:
  trust_remote_code is never set.

Each payload, if run, creates a marker file; every test checks that the marker does not exist, and a
control shows the payload does run when the file is loaded the unsafe way.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from megalite_test_utils import ROOT, TINY_LLAMA_ARGS, with_flags
from megalite.checkpoint.files import CheckpointReader
from megalite.errors import UserError

transformers = pytest.importorskip("transformers")


class Payload:
    """Unpickling this calls exec(), which creates ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


def malicious_torch_file(path: str, marker: str) -> None:
    """A torch.save zip whose data.pkl calls exec(): what a hostile pytorch_model.bin looks like."""
    torch.save({"model.embed_tokens.weight": Payload(marker), "lm_head.weight": torch.zeros(2, 2)}, path)


def malicious_raw_pickle(path: str, marker: str) -> None:
    """The pre-zip (legacy) torch format is a bare pickle stream."""
    with open(path, "wb") as f:
        pickle.dump({"model": Payload(marker)}, f)


def run_tool(script: str, argv: list[str], cwd, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_MODULES_CACHE": str(cwd / "hf_modules")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, argv)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny Llama saved by transformers (config.json + model.safetensors)."""
    d = tmp_path_factory.mktemp("hf_llama")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(d), safe_serialization=True)
    return d


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A megalite checkpoint saved by a one-iteration pretrain_gpt.py run."""
    d = tmp_path_factory.mktemp("ckpt")
    proc = run_tool("pretrain_gpt.py", with_flags(TINY_LLAMA_ARGS, train_iters=1, save=str(d / "ck")), d, 300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return d / "ck"


# ---- the payloads are real ----------------------------------------------------------------------------------
def test_control_the_payloads_run_when_unpickled_unsafely(tmp_path):
    for make in (malicious_torch_file, malicious_raw_pickle):
        marker = tmp_path / f"{make.__name__}.marker"
        make(str(tmp_path / "evil.bin"), str(marker))
        try:
            torch.load(str(tmp_path / "evil.bin"), weights_only=False)
        except Exception:
            pass                          # exec() returned None where a tensor was expected; it ran first
        assert marker.exists(), make.__name__


# ---- (a) pickled checkpoints are refused, without running them ----------------------------------------------
@pytest.fixture(scope="module")
def hf_bin_conversions(hf_llama, tmp_path_factory):
    """tools/convert_checkpoint.py --from hf on a model whose pytorch_model.bin carries code, per format."""
    results = {}
    for make in (malicious_torch_file, malicious_raw_pickle):
        d = tmp_path_factory.mktemp(make.__name__)
        (d / "hf").mkdir()
        shutil.copy(hf_llama / "config.json", d / "hf" / "config.json")
        make(str(d / "hf" / "pytorch_model.bin"), str(d / "marker"))
        proc = run_tool("tools/convert_checkpoint.py", ["--from", "hf", "--to", "megalite", "--input", "hf",
                                                        "--output", "out"], d)
        results[make.__name__] = (d, proc)
    return results


@pytest.mark.parametrize("make", ["malicious_torch_file", "malicious_raw_pickle"])
def test_hf_pytorch_model_bin_with_code_is_not_run(hf_bin_conversions, make):
    d, proc = hf_bin_conversions[make]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert not (d / "marker").exists()
    assert not (d / "out" / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.parametrize("make", ["malicious_torch_file", "malicious_raw_pickle"])
def test_hf_pytorch_model_bin_with_code_is_refused_in_one_line(hf_bin_conversions, make):
    one_line_error(hf_bin_conversions[make][1], "pytorch_model.bin", "weights_only=True")


def megatron_legacy_checkpoint(root, marker) -> None:
    """Megatron-LM's layout: tracker file + iter_0000001/mp_rank_00/model_optim_rng.pt (a torch pickle)."""
    (root / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    malicious_torch_file(str(root / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"), str(marker))


@pytest.mark.parametrize("tool, argv", [
    ("pretrain_gpt.py", with_flags(TINY_LLAMA_ARGS, load="megatron")),
    ("pretrain_gpt.py", with_flags(TINY_LLAMA_ARGS, load="megatron/iter_0000001")),
    ("tools/generate.py", ["--load", "megatron", "--prompt", "1 2"]),
    ("tools/convert_checkpoint.py", ["--from", "megalite", "--to", "hf", "--input", "megatron", "--output", "out"]),
], ids=["pretrain", "pretrain-iteration-dir", "generate", "convert"])
def test_megatron_pickle_checkpoint_is_refused_unopened(tmp_path, tool, argv):
    marker = tmp_path / "marker"
    megatron_legacy_checkpoint(tmp_path / "megatron", marker)
    before = sorted(p.name for p in (tmp_path / "megatron").rglob("*"))
    one_line_error(run_tool(tool, argv, tmp_path), "megatron")
    assert not marker.exists()
    assert sorted(p.name for p in (tmp_path / "megatron").rglob("*")) == before


def test_megalite_checkpoint_whose_tensor_file_is_a_pickle_is_refused(checkpoint, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(checkpoint, ck)
    iteration = ck / "iter_0000001"
    marker = tmp_path / "marker"
    malicious_torch_file(str(iteration / "model-pp000.safetensors"), str(marker))
    index = json.loads((iteration / "index-rank00000.json").read_text())  # sizes match: only the format is wrong
    index["files"]["model-pp000.safetensors"] = (iteration / "model-pp000.safetensors").stat().st_size
    (iteration / "index-rank00000.json").write_text(json.dumps(index))
    one_line_error(run_tool("tools/generate.py", ["--load", ck, "--prompt", "1 2"], tmp_path), "model-pp000.safetensors")
    assert not marker.exists()


@pytest.mark.parametrize("where", ["tensor", "files", "rng_files", "absolute"])
def test_the_index_cannot_name_files_outside_the_checkpoint(checkpoint, tmp_path, where):
    ck = tmp_path / "deep" / "ck"
    shutil.copytree(checkpoint, ck)
    iteration = ck / "iter_0000001"
    secret = tmp_path / "secret"
    shutil.copy(iteration / "model-pp000.safetensors", secret)      # a readable target, to be sure it is not read
    index = json.loads((iteration / "index-rank00000.json").read_text())    # a serial save: one index file
    escape = str(secret) if where == "absolute" else "../../../secret"
    if where in ("tensor", "absolute"):
        for entry in index["tensors"].values():
            for piece in entry["pieces"]:
                if piece["file"] == "model-pp000.safetensors":
                    piece["file"] = escape
        index["files"][escape] = index["files"].pop("model-pp000.safetensors")
    elif where == "files":
        index["files"][escape] = secret.stat().st_size
    else:
        index["rng"][escape] = next(iter(index["rng"].values()))
    (iteration / "index-rank00000.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="outside the checkpoint directory") as err:
        CheckpointReader(str(ck)).has("decoder.final_layernorm.weight")      # the index is read on demand
    assert "\n" not in str(err.value)
    if where == "tensor":          # and through a real command line
        proc = run_tool("pretrain_gpt.py", with_flags(TINY_LLAMA_ARGS, load=ck), tmp_path)
        one_line_error(proc, "outside the checkpoint directory")


# ---- (b) remote code in Hugging Face folders is never imported ----------------------------------------------
EVIL_MODULE = """open({marker!r}, "w").write("remote code ran")
from transformers import LlamaConfig, PreTrainedTokenizerFast
class EvilConfig(LlamaConfig):
    model_type = "llama"
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


def with_remote_code(hf_llama, directory, marker, model_type="llama"):
    """A copy of the tiny Llama whose config.json and tokenizer_config.json ask for their own code."""
    shutil.copytree(hf_llama, directory)
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": [None, "modeling_evil.EvilTokenizer"]}}))
    for name in ("modeling_evil.py", "tokenization_evil.py"):
        (directory / name).write_text(EVIL_MODULE.format(marker=str(marker)))


def test_control_remote_code_runs_when_trusted(hf_llama, tmp_path):
    """The folder's auto_map does load its module when trust_remote_code=True (run in a child process)."""
    marker = tmp_path / "marker"
    with_remote_code(hf_llama, tmp_path / "hf", marker)
    code = ("import transformers; transformers.AutoConfig.from_pretrained(r'%s', trust_remote_code=True, "
            "local_files_only=True)" % (tmp_path / "hf"))
    subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120,
                   env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf_modules"), "HF_HUB_OFFLINE": "1"})
    assert marker.exists()


def test_hf_conversion_ignores_auto_map(hf_llama, tmp_path):
    marker = tmp_path / "marker"
    with_remote_code(hf_llama, tmp_path / "hf", marker)
    proc = run_tool("tools/convert_checkpoint.py", ["--from", "hf", "--to", "megalite", "--input", "hf",
                                                    "--output", "out"], tmp_path)
    if proc.returncode == 0:          # converted as the plain Llama its model_type says ...
        assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").exists()
    else:                             # ... or refused; either way in one line and without running the module
        one_line_error(proc)
    assert not marker.exists(), proc.stderr[-2000:]


def test_hf_model_of_an_unknown_type_with_remote_code_is_refused(hf_llama, tmp_path):
    marker = tmp_path / "marker"
    with_remote_code(hf_llama, tmp_path / "hf", marker, model_type="evil")
    proc = run_tool("tools/convert_checkpoint.py", ["--from", "hf", "--to", "megalite", "--input", "hf",
                                                    "--output", "out"], tmp_path)
    one_line_error(proc, "model_type 'evil' is not supported")
    assert not marker.exists()


def test_hf_tokenizer_folder_with_remote_code_is_not_imported(hf_llama, tmp_path):
    marker = tmp_path / "marker"
    with_remote_code(hf_llama, tmp_path / "hf", marker)
    argv = with_flags(TINY_LLAMA_ARGS, vocab_size=None, tokenizer_type="HuggingFaceTokenizer", tokenizer_model="hf")
    proc = run_tool("pretrain_gpt.py", argv, tmp_path)
    one_line_error(proc, "--tokenizer-model hf")
    assert not marker.exists()
