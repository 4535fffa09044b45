"""The bad-input matrix: user mistakes run through the real command lines.

Every case runs a command as a user would (pretrain_gpt.py or a tools/ script, in its own folder)
and must end with: exit code 1, exactly one line on stderr ("error: ...") that names the cause (the
flag, file or variable), no traceback, no hang, and every file that was in the folder before --
data, checkpoints, tokenizer files, earlier outputs -- byte for byte unchanged, with no half-written
temporary files left behind.

Cases run two at a time (each is its own process) to keep the matrix short on 2 cores; failing fast
matters: most are caught before a model is built. The cases caught before torch is imported (about
half a second each) all run in the default tier; of the 20 that import torch (5-20 s each on 2 busy
cores) it runs one of each kind -- training's data reader, checkpoint loading, the launch, the
converter, generation -- and the rest (``slow=True``: more spoilt data and checkpoints, a Hugging Face
tokenizer without eos, two more converter and generator mistakes) run in the slow tier.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest

from megalite_test_utils import ROOT, TINY_LLAMA_ARGS, with_flags

WORKERS = 2
PRETRAIN = "pretrain_gpt.py"
PREPROCESS = "tools/preprocess_data.py"
MERGE = "tools/merge_datasets.py"
TRAIN_TOKENIZER = "tools/train_tokenizer.py"
CONVERT = "tools/convert_checkpoint.py"
GENERATE = "tools/generate.py"
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "200"]
DATA = "data/small_text_document"        # ids < 150 and eod 200: fits --vocab-size 200
BIG = "data/big_text_document"           # ids up to 900 and eod 1000: made with --vocab-size 1000


WORD_LEVEL_WITHOUT_EOS = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                          "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
                          "decoder": None, "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "a": 1, "b": 2},
                                                     "unk_token": "<unk>"}}


@dataclass
class Case:
    id: str
    argv: list[str] | Callable            # argv, or fn(case_dir) -> argv
    fragments: tuple[str, ...]            # all must appear in the one stderr line
    script: str = PRETRAIN
    setup: Callable | None = None         # fn(case_dir, shared) -> optional object kept alive during the run
    env: dict = field(default_factory=dict)
    timeout: float = 60.0
    known_failure: str | None = None      # a fix pending elsewhere: xfail(strict), so the mark goes once it lands
    slow: bool = False                    # slow tier only: it imports torch (5-20 s), see the module docstring

    def __repr__(self):
        return self.id


def pretrain(**overrides) -> list[str]:
    return with_flags(TINY_LLAMA_ARGS, **overrides)


def on_data(prefix=DATA, **overrides) -> list[str]:
    return pretrain(mock_data=False, data_path=prefix, **overrides)


# ---- set-ups: copy shared inputs into the case folder, then spoil something ------------------------------
def copy_data(d, shared):
    shutil.copytree(shared["data"], os.path.join(d, "data"))


def copy_checkpoint(d, shared):
    shutil.copytree(shared["checkpoint"], os.path.join(d, "ck"))


def patch(path: str, offset: int, payload: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(payload)


def then(*steps):
    def setup(d, shared):
        kept = None
        for step in steps:
            kept = step(d, shared) or kept
        return kept
    return setup


def spoil_idx(offset: int, payload: bytes):
    return then(copy_data, lambda d, s: patch(os.path.join(d, DATA + ".idx"), offset, payload))


def truncate(relative: str, size: int):
    def step(d, shared):
        with open(os.path.join(d, relative), "r+b") as f:
            f.truncate(size if size >= 0 else os.path.getsize(os.path.join(d, relative)) + size)
    return then(copy_data, step) if relative.startswith("data/") else step


def write(relative: str, text: str):
    def step(d, shared):
        os.makedirs(os.path.dirname(os.path.join(d, relative)) or d, exist_ok=True)
        with open(os.path.join(d, relative), "w") as f:
            f.write(text)
    return step


def listening_socket(d, shared):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    shared.setdefault("ports", {})[d] = sock.getsockname()[1]
    return sock


def remove(relative: str):
    return lambda d, shared: os.remove(os.path.join(d, relative))


def second_pointer_offset(shared) -> int:
    n = struct.unpack("<Q", open(os.path.join(shared["data"], "small_text_document.idx"), "rb").read()[18:26])[0]
    return 34 + 4 * n + 8            # header, lengths (int32 x n), then pointer of sequence 1


def int32_dataset(d, shared):
    from megalite.data.indexed_dataset import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(os.path.join(d, "data", "wide"), np.int32)
    builder.add_document(np.arange(10))
    builder.finalize()


# ---- the matrix ---------------------------------------------------------------------------------------------
MERGE_ONE = ["--input", DATA, "--output-prefix", "all"]     # the same reader as training, in 0.1 s
WORLD2 = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}

CASES = [
    # batch and parallel sizes (caught while parsing, before torch.distributed starts)
    Case("global-batch-not-divisible", pretrain(global_batch_size=6, micro_batch_size=4),
         ("--global-batch-size 6 must be divisible by --micro-batch-size 4",)),
    Case("micro-batch-above-global", pretrain(micro_batch_size=8),
         ("--micro-batch-size 8", "exceeds --global-batch-size 4")),
    Case("world-size-not-a-multiple", pretrain(tensor_model_parallel_size=2), ("world size 3",),
         env={"WORLD_SIZE": "3"}),
    Case("heads-not-divisible-by-tp", pretrain(tensor_model_parallel_size=3),
         ("--num-attention-heads 4 must be divisible by --tensor-model-parallel-size 3",), env={"WORLD_SIZE": "3"}),
    Case("layers-not-divisible-by-pp", pretrain(num_layers=3, pipeline_model_parallel_size=2),
         ("--num-layers 3", "--pipeline-model-parallel-size 2"), env={"WORLD_SIZE": "2"}),
    Case("world-size-zero", pretrain(), ("WORLD_SIZE='0'",), env={"WORLD_SIZE": "0"}),
    # hybrid sharding (--num-distributed-optimizer-instances)
    Case("instances-without-sharding", pretrain(num_distributed_optimizer_instances=2),
         ("--num-distributed-optimizer-instances 2", "add --use-distributed-optimizer"), env={"WORLD_SIZE": "2"}),
    Case("instances-not-dividing-dp", pretrain(use_distributed_optimizer=True, num_distributed_optimizer_instances=3),
         ("--num-distributed-optimizer-instances 3 must divide the 2 data-parallel",), env={"WORLD_SIZE": "2"}),
    # Mixture of Experts
    Case("ep-not-dividing-experts", pretrain(num_experts=8, expert_model_parallel_size=3, global_batch_size=6),
         ("--expert-model-parallel-size 3 does not divide --num-experts 8",), env={"WORLD_SIZE": "3"}),
    Case("ep-etp-pp-not-dividing-world", pretrain(num_experts=8, expert_model_parallel_size=4,
                                                  pipeline_model_parallel_size=2, global_batch_size=4),
         ("--expert-model-parallel-size 4", "must divide the 2 ranks of each pipeline stage"), env={"WORLD_SIZE": "4"}),
    # --fake-process-group dry runs
    Case("fake-world-not-given", pretrain(fake_process_group=True), ("--fake-process-group", "--fake-world-size N")),
    Case("fake-rank-outside-world", pretrain(fake_process_group=True, fake_world_size=2, fake_rank=2),
         ("--fake-rank 2", "world of 2 ranks")),
    Case("fake-rank-with-save", pretrain(fake_process_group=True, fake_world_size=2, save="ck"),
         ("--fake-process-group", "drop --save")),
    Case("fake-rank-without-dry-run", pretrain(fake_rank=1), ("--fake-rank", "add --fake-process-group")),
    Case("no-storage-without-dry-run", pretrain(no_storage=True), ("--no-storage", "add --fake-process-group")),
    Case("topk-above-experts", pretrain(num_experts=4, moe_router_topk=5),
         ("--moe-router-topk 5 exceeds --num-experts 4",)),
    Case("capacity-factor-not-positive", pretrain(num_experts=4, moe_expert_capacity_factor=0),
         ("--moe-expert-capacity-factor must be > 0",)),
    Case("train-samples-below-one-batch", pretrain(train_iters=None, train_samples=2),
         ("--train-samples 2 is less than one global batch",)),
    # model shape
    Case("hidden-not-divisible-by-heads", pretrain(hidden_size=66), ("--hidden-size 66", "--num-attention-heads 4")),
    Case("seq-length-above-positions", pretrain(seq_length=64), ("--seq-length 64 exceeds --max-position-embeddings 32",)),
    # numbers out of range
    Case("negative-lr", pretrain(lr=-1), ("--lr must be > 0",)),
    Case("nan-lr", pretrain(lr="nan"), ("--lr", "finite")),
    Case("dropout-one", pretrain(hidden_dropout=1.0), ("--hidden-dropout must be in [0, 1)",)),
    Case("negative-seed", pretrain(seed=-1), ("--seed must be >= 0",)),
    Case("not-a-number", pretrain(num_layers="two"), ("--num-layers", "'two'")),
    # contradictory or misspelt flags
    Case("bf16-and-fp16", pretrain(bf16=True, fp16=True), ("--bf16 and --fp16 are exclusive",)),
    Case("mock-data-and-data-path", pretrain(data_path=DATA), ("--mock-data and --data-path",)),
    Case("misspelt-flag", pretrain() + ["--num-layer", "2"], ("unrecognized arguments: --num-layer",)),
    # data files (through training, or through tools/merge_datasets.py, which opens them with the same reader)
    Case("data-prefix-missing", on_data("data/corpus_text_document"), ("data/corpus_text_document",), setup=copy_data,
         slow=True),
    Case("bin-missing", MERGE_ONE, (DATA + ".bin is missing",), script=MERGE,
         setup=then(copy_data, remove(DATA + ".bin"))),
    Case("bin-truncated", on_data(), (DATA + ".idx", "the .bin has"), setup=truncate(DATA + ".bin", -10),
         slow=True),
    Case("idx-bad-magic", on_data(), (DATA + ".idx", "bad magic"), setup=spoil_idx(0, b"NOTANIDX!"), slow=True),
    Case("idx-truncated-header", MERGE_ONE, (DATA + ".idx", "truncated header"), script=MERGE,
         setup=truncate(DATA + ".idx", 20)),
    Case("idx-truncated-arrays", MERGE_ONE, (DATA + ".idx", "does not match its header"), script=MERGE,
         setup=truncate(DATA + ".idx", -8)),
    Case("idx-wrong-version", MERGE_ONE, (DATA + ".idx", "version 7"), script=MERGE,
         setup=spoil_idx(9, struct.pack("<Q", 7))),
    Case("idx-unknown-dtype-code", MERGE_ONE, (DATA + ".idx", "dtype code 42"), script=MERGE,
         setup=spoil_idx(17, bytes([42]))),
    Case("idx-pointer-out-of-place", on_data(), (DATA + ".idx", "sequence 1", "index is corrupt"),
         setup=lambda d, s: spoil_idx(second_pointer_offset(s), struct.pack("<q", 10 ** 6))(d, s), slow=True),
    Case("valid-data-prefix-missing", pretrain(mock_data=False, train_data_path=DATA, valid_data_path="data/valid"),
         ("data/valid",), setup=copy_data, slow=True),
    Case("data-from-a-bigger-vocabulary", on_data(BIG), (BIG, "token id", "--vocab-size 200"), setup=copy_data),
    # tokenizer files
    Case("sentencepiece-model-missing",
         pretrain(vocab_size=None, tokenizer_type="SentencePieceTokenizer", tokenizer_model="tok.model"),
         ("--tokenizer-model tok.model: no such file",)),
    Case("sentencepiece-model-not-a-model",
         pretrain(vocab_size=None, tokenizer_type="SentencePieceTokenizer", tokenizer_model="tok.model"),
         ("--tokenizer-model tok.model", "not a SentencePiece model"), setup=write("tok.model", "hello\n")),
    Case("merge-file-missing",
         pretrain(vocab_size=None, tokenizer_type="GPT2BPETokenizer", vocab_file="vocab.json", merge_file="merges.txt"),
         ("--merge-file merges.txt: no such file",), setup=write("vocab.json", '{"a": 0}')),
    Case("documents-with-a-tokenizer-without-eod",
         pretrain(vocab_size=None, tokenizer_type="HuggingFaceTokenizer", tokenizer_model="hf_tok",
                  reset_attention_mask=True, reset_position_ids=True),
         ("--tokenizer-model hf_tok", "no eos token", "--reset-attention-mask"),
         setup=then(write("hf_tok/tokenizer.json", json.dumps(WORD_LEVEL_WITHOUT_EOS)),
                    write("hf_tok/tokenizer_config.json", '{"tokenizer_class": "PreTrainedTokenizerFast"}')),
         slow=True),
    Case("documents-with-attention-dropout", pretrain(reset_attention_mask=True, attention_dropout=0.1),
         ("--reset-attention-mask", "--attention-dropout 0")),
    Case("hf-tokenizer-folder-missing",
         pretrain(vocab_size=None, tokenizer_type="HuggingFaceTokenizer", tokenizer_model="hf_tok"),
         ("--tokenizer-model hf_tok",)),
    # checkpoints
    Case("checkpoint-of-another-width", pretrain(hidden_size=128, ffn_hidden_size=352, load="ck", save="ck"),
         ("has shape [201, 64] but the model expects [201, 128]", "--hidden-size: 64 in the checkpoint"),
         setup=copy_checkpoint),
    Case("checkpoint-of-another-vocabulary", pretrain(vocab_size=300, load="ck"),
         ("vocabulary: 201 in the checkpoint, 301 in this run",), setup=copy_checkpoint, slow=True),
    Case("checkpoint-args-contradicted", pretrain(hidden_size=128, load="ck", use_checkpoint_args=True),
         ("--hidden-size 128 contradicts the checkpoint's 64",), setup=copy_checkpoint, slow=True),
    Case("load-not-a-checkpoint", pretrain(load="notes"), ("--load notes", "no latest_checkpointed_iteration.txt"),
         setup=write("notes/readme.txt", "my notes\n"), slow=True),
    Case("load-missing", pretrain(load="nowhere"), ("--load nowhere: no such directory",), slow=True),
    Case("tracker-garbage", pretrain(load="ck"), ("not an iteration number",),
         setup=then(copy_checkpoint, write("ck/latest_checkpointed_iteration.txt", "ten")), slow=True),
    Case("checkpoint-tensor-file-truncated", pretrain(load="ck"), ("model-pp000.safetensors is truncated",),
         setup=then(copy_checkpoint, truncate("ck/iter_0000001/model-pp000.safetensors", 1000)),
         slow=True),
    Case("save-is-a-file", pretrain(save="results.txt"), ("--save results.txt: cannot write there",),
         setup=write("results.txt", "keep me\n")),
    Case("save-below-a-file", pretrain(save="results.txt/ck"), ("--save results.txt/ck: cannot write there",),
         setup=write("results.txt", "keep me\n")),
    Case("tensorboard-dir-is-a-file", pretrain(tensorboard_dir="results.txt"),
         ("--tensorboard-dir results.txt: cannot write there",), setup=write("results.txt", "keep me\n")),
    Case("metrics-file-is-a-folder", pretrain(metrics_file="logs"), ("--metrics-file logs is a folder",),
         setup=write("logs/old.jsonl", "{}\n")),
    # launch environment
    Case("master-port-in-use", pretrain(), ("MASTER_PORT", "already in use"), setup=listening_socket,
         env=dict(WORLD2, MASTER_PORT="{port}"), timeout=30),
    Case("rank-outside-world", pretrain(), ("RANK='2'",), env=dict(WORLD2, RANK="2", MASTER_PORT="1"), timeout=30),
    Case("world-size-not-a-number", pretrain(), ("WORLD_SIZE='abc'",), env={"WORLD_SIZE": "abc"}),
    Case("rank-outside-a-world-of-one", pretrain(), ("RANK='1'",), env={"RANK": "1", "WORLD_SIZE": "1"}),
    Case("master-port-not-a-number", pretrain(), ("MASTER_PORT='http'",), env=dict(WORLD2, MASTER_PORT="http"),
         timeout=30),
    # tools/preprocess_data.py
    Case("preprocess-output-exists", ["--input", "in.jsonl", "--output-prefix", "data/small", *NULL],
         ("data/small_text_document.bin already exists", "--overwrite"), script=PREPROCESS,
         setup=then(copy_data, write("in.jsonl", '{"text": "1 2 3"}\n'))),
    Case("preprocess-input-missing", ["--input", "in.jsonl", "--output-prefix", "out", *NULL],
         ("--input in.jsonl: no such file",), script=PREPROCESS),
    Case("preprocess-malformed-line", ["--input", "in.jsonl", "--output-prefix", "out", *NULL],
         ("in.jsonl:2",), script=PREPROCESS, setup=write("in.jsonl", '{"text": "1 2"}\n{"text": 1 2}\n')),
    Case("preprocess-words-for-null-tokenizer", ["--input", "in.jsonl", "--output-prefix", "out", *NULL],
         ("in.jsonl:2", "NullTokenizer"), script=PREPROCESS, setup=write("in.jsonl", '{"text": "1 2"}\n{"text": "a b"}\n')),
    Case("preprocess-output-flag-missing", ["--input", "in.jsonl", *NULL], ("--output-prefix",), script=PREPROCESS),
    Case("preprocess-dtype-too-narrow",
         ["--input", "in.jsonl", "--output-prefix", "out", "--dtype", "uint8", *with_flags(NULL, vocab_size=1000)],
         ("dtype uint8",), script=PREPROCESS, setup=write("in.jsonl", '{"text": "1 2"}\n')),
    Case("preprocess-output-below-a-file", ["--input", "in.jsonl", "--output-prefix", "notes.txt/out", *NULL],
         ("notes.txt/out_text_document.bin",), script=PREPROCESS,
         setup=then(write("in.jsonl", '{"text": "1 2"}\n'), write("notes.txt", "keep me\n"))),
    # tools/merge_datasets.py, tools/train_tokenizer.py
    Case("merge-different-dtypes", ["--input", DATA, "data/wide", "--output-prefix", "all"],
         ("different token dtypes",), script=MERGE, setup=then(copy_data, int32_dataset)),
    Case("merge-corrupt-input", ["--input", DATA, BIG, "--output-prefix", "all"], (DATA + ".idx", "bad magic"),
         script=MERGE, setup=spoil_idx(0, b"garbage!!")),
    Case("merge-output-exists", ["--input", DATA, "--output-prefix", BIG], (BIG + ".bin already exists",),
         script=MERGE, setup=copy_data),
    Case("tokenizer-vocab-too-small", ["--input", "in.jsonl", "--output-prefix", "tok", "--vocab-size", "100"],
         ("--vocab-size 100 is too small",), script=TRAIN_TOKENIZER, setup=write("in.jsonl", '{"text": "hello"}\n')),
    Case("tokenizer-output-exists", ["--input", "in.jsonl", "--output-prefix", "tok", "--vocab-size", "300"],
         ("tok.model already exists",), script=TRAIN_TOKENIZER,
         setup=then(write("in.jsonl", '{"text": "hello"}\n'), write("tok.model", "precious"))),
    # tools/convert_checkpoint.py, tools/generate.py
    Case("convert-not-a-hf-folder", ["--from", "hf", "--to", "megalite", "--input", "data", "--output", "out"],
         ("--input data is not a Hugging Face model directory",), script=CONVERT, setup=copy_data,
         slow=True),
    Case("convert-output-holds-a-model", ["--from", "megalite", "--to", "hf", "--input", "ck", "--output", "hf"],
         ("--output hf already holds a Hugging Face model", "--overwrite"), script=CONVERT,
         setup=then(copy_checkpoint, write("hf/config.json", '{"model_type": "llama"}'))),
    Case("convert-onto-itself", ["--from", "megalite", "--to", "hf", "--input", "ck", "--output", "ck"],
         ("--output ck is the --input directory",), script=CONVERT, setup=copy_checkpoint, slow=True),
    Case("generate-top-p-zero", ["--load", "ck", "--prompt", "1 2", "--top-p", "0"], ("--top-p 0.0",),
         script=GENERATE, setup=copy_checkpoint),
    Case("generate-prompt-outside-vocabulary", ["--load", "ck", "--prompt", "5000 1"], ("prompt token id 5000",),
         script=GENERATE, setup=copy_checkpoint, slow=True),
]


# ---- running the matrix --------------------------------------------------------------------------------------
def snapshot(directory: str) -> dict[str, bytes]:
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, directory)] = open(path, "rb").read()
    return files


@dataclass
class Outcome:
    returncode: int | None
    stderr: str
    before: dict
    after: dict
    seconds: float = 0.0


def run_case(case: Case, directory: str, shared: dict) -> Outcome:
    os.makedirs(directory)
    kept = case.setup(directory, shared) if case.setup else None
    before = snapshot(directory)
    argv = case.argv(directory) if callable(case.argv) else case.argv
    port = shared.get("ports", {}).get(directory)
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           **{k: v.format(port=port) for k, v in case.env.items()}}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        if name not in case.env:
            env.pop(name, None)
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, case.script), *argv], cwd=directory, env=env,
                              capture_output=True, text=True, timeout=case.timeout)
        returncode, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        returncode, stderr = None, (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    finally:
        if kept is not None:
            kept.close()
    return Outcome(returncode, stderr, before, snapshot(directory), time.monotonic() - start)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Inputs the cases copy: two small datasets made by tools/preprocess_data.py and a checkpoint
    saved by a one-iteration pretrain_gpt.py run."""
    base = tmp_path_factory.mktemp("shared")
    rng = np.random.default_rng(0)
    for name, high, vocab in (("small", 150, 200), ("big", 900, 1000)):
        with open(base / f"{name}.jsonl", "w") as f:
            for _ in range(40):
                ids = rng.integers(0, high, size=int(rng.integers(20, 60)))
                ids[0] = high - 1
                f.write(json.dumps({"text": " ".join(map(str, ids))}) + "\n")
        subprocess.run([sys.executable, os.path.join(ROOT, PREPROCESS), "--input", str(base / f"{name}.jsonl"),
                        "--output-prefix", str(base / "data" / name), "--append-eod",
                        *with_flags(NULL, vocab_size=vocab)], check=True, capture_output=True, timeout=120)
    subprocess.run([sys.executable, os.path.join(ROOT, PRETRAIN), *pretrain(train_iters=1, save=str(base / "ck"))],
                   check=True, capture_output=True, timeout=300, env={**os.environ, "WANDB_MODE": "offline"})
    return {"data": str(base / "data"), "checkpoint": str(base / "ck")}


@pytest.fixture(scope="module")
def outcomes(request, shared, tmp_path_factory):
    """Runs every selected case (WORKERS at a time) once; the tests then check one outcome each."""
    selected = [item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec") and "case" in item.callspec.params]
    root = tmp_path_factory.mktemp("cases")
    with ThreadPoolExecutor(WORKERS) as pool:
        results = pool.map(lambda c: run_case(c, str(root / c.id), shared), selected)
        return {case.id: outcome for case, outcome in zip(selected, results)}


def test_the_matrix_is_big_enough():
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", [
    pytest.param(c, id=c.id, marks=([pytest.mark.xfail(strict=True, reason=c.known_failure)] if c.known_failure else [])
                 + ([pytest.mark.slow] if c.slow else []))
    for c in CASES])
def test_mistake_gives_one_line_and_damages_nothing(case, outcomes):
    out = outcomes[case.id]
    assert out.returncode is not None, f"hung for {case.timeout} s; stderr: {out.stderr[-1000:]}"
    assert out.returncode == 1, f"exit code {out.returncode}; stderr: {out.stderr[-2000:]}"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("error: "), lines[0]
    for fragment in case.fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    damaged = [name for name, data in out.before.items() if out.after.get(name) != data]
    assert not damaged, f"changed or removed: {damaged}"
    leftovers = [name for name in set(out.after) - set(out.before) if ".tmp" in name]
    assert not leftovers, f"temporary files left behind: {leftovers}"

