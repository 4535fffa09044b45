"""Shared fixtures for the data tests: tiny tokenizers built locally (no hub), tiny corpora."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PYTHON = sys.executable
if ROOT not in sys.path:  # megalite importable however pytest is started
    sys.path.insert(0, ROOT)

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "Hello world! Unicode: naïve café — ok.\n",
    "# comment only\n",
]


def _corpus_texts(n: int = 60) -> list[str]:
    rng = np.random.default_rng(0)
    return [CORPUS[i % len(CORPUS)] * int(rng.integers(1, 4)) + f"x = {i}\n" for i in range(n)]


def _write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _run_tool(script: str, *args, check: bool = False) -> subprocess.CompletedProcess:
    """Run tools/<script> in a subprocess, like a user would."""
    proc = subprocess.run([PYTHON, os.path.join(ROOT, "tools", script), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def _one_line_error(stderr: str) -> str:
    """The CLIs' contract for user mistakes: one 'error: ...' line, no traceback."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


# helpers as fixtures (test modules need no import path to this folder)
@pytest.fixture(scope="session")
def corpus_texts():
    return _corpus_texts


@pytest.fixture(scope="session")
def write_jsonl():
    return _write_jsonl


@pytest.fixture(scope="session")
def run_tool():
    return _run_tool


@pytest.fixture(scope="session")
def one_line_error():
    return _one_line_error


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory) -> str:
    """A SentencePiece BPE model (vocab 320) trained by tools/train_tokenizer.py's settings."""
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus_texts(200)), model_prefix=str(d / "sp"), vocab_size=320, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
        character_coverage=1.0)
    return str(d / "sp.model")


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory) -> tuple[str, str]:
    """vocab.json + merges.txt of a tiny GPT-2-style byte-level BPE (with <|endoftext|>)."""
    from tokenizers import ByteLevelBPETokenizer

    d = tmp_path_factory.mktemp("gpt2")
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(_corpus_texts(200), vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
    vocab, merges = tok.save_model(str(d))
    return vocab, merges


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory, gpt2_files) -> str:
    """A local Hugging Face tokenizer folder (save_pretrained), built from the tiny GPT-2 BPE."""
    from transformers import GPT2Tokenizer  # transformers 5: tokenizers-backed, takes vocab= / merges=

    d = tmp_path_factory.mktemp("hf")
    tok = GPT2Tokenizer(vocab=gpt2_files[0], merges=gpt2_files[1], eos_token="<|endoftext|>",
                        bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    assert len(tok) > 300
    tok.save_pretrained(str(d))
    return str(d)
