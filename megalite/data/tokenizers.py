"""Tokenizers behind one small interface: ``vocab_size``, ``eod``, ``tokenize``, ``detokenize``.

``build_tokenizer(data_config)`` picks one from ``--tokenizer-type`` like Megatron does:

- ``GPT2BPETokenizer``: GPT-2 byte-level BPE from ``--vocab-file`` (vocab.json) and ``--merge-file``
  (merges.txt), run by the ``tokenizers`` library; eod is ``<|endoftext|>``.
- ``SentencePieceTokenizer``: a SentencePiece model (``--tokenizer-model x.model``, e.g. from
  ``tools/train_tokenizer.py``); eod is the model's ``</s>`` (eos) id. Unlike Megatron's class of the
  same name, no extra ``<CLS>/<SEP>/<EOD>/<MASK>`` ids are appended to the vocabulary, which makes it
  Megatron's ``GPTSentencePieceTokenizer``; that name is accepted too.
- ``HuggingFaceTokenizer``: ``transformers.AutoTokenizer`` from a *local* folder
  (``--tokenizer-model DIR``), never remote code, never a download; eod is ``eos_token_id``;
  special tokens (BOS) are not added to documents.
- ``NullTokenizer``: text is whitespace-separated ids; vocab_size = ``--vocab-size`` + 1, eod =
  ``--vocab-size`` (as in Megatron).

Heavy libraries are imported only by the tokenizer that needs them.
"""
from __future__ import annotations

import os
import sys
from abc import ABC, abstractmethod

from megalite.config.schema import DataConfig
from megalite.errors import UserError

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
                   "NullTokenizer")


class MegatronTokenizer(ABC):
    """What the data pipeline and the model need from any tokenizer.

    Every tokenizer sets, in its ``__init__``:
      vocab_size  number of ids it can produce (before padding for the model)
      eod         end-of-document id appended by ``--append-eod``
    """

    vocab_size: int
    eod: int

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def detokenize(self, ids) -> str: ...

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Tokenize several texts; subclasses use their library's batch call where it is faster."""
        return [self.tokenize(t) for t in texts]


def _first_line(error: Exception) -> str:
    """An exception's first line, for one-line error messages."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class NullTokenizer(MegatronTokenizer):
    """Text is whitespace-separated integer ids; eod is one id past ``--vocab-size`` (as in Megatron)."""

    def __init__(self, vocab_size: int):
        self.eod = int(vocab_size)
        self.vocab_size = self.eod + 1

    def tokenize(self, text: str) -> list[int]:
        return [int(tok) for tok in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def _need_file(path, flag: str, kind: str) -> str:
    if not path:
        raise UserError(f"--tokenizer-type {kind} needs {flag}")
    if not os.path.exists(path):
        raise UserError(f"{flag} {path}: no such file")
    return path


class GPT2BPETokenizer(MegatronTokenizer):
    """GPT-2's byte-level BPE (vocab.json + merges.txt), run by the ``tokenizers`` library."""

    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import ByteLevelBPETokenizer

        try:
            self._tok = ByteLevelBPETokenizer.from_file(vocab_file, merge_file)
        except Exception as e:  # the library's messages do not name our flags
            raise UserError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: not a GPT-2 BPE "
                            f"vocabulary and merges pair ({_first_line(e)})")
        eod = self._tok.token_to_id(self.EOD_TOKEN)
        if eod is None:
            raise UserError(f"--vocab-file {vocab_file} has no {self.EOD_TOKEN} token, which "
                            "GPT2BPETokenizer uses as end of document")
        self.eod = int(eod)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


class SentencePieceTokenizer(MegatronTokenizer):
    """A SentencePiece model; end of document is the model's eos (``</s>``) piece."""

    def __init__(self, model_file: str):
        import sentencepiece as spm

        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_file)
        except Exception as e:
            raise UserError(f"--tokenizer-model {model_file}: not a SentencePiece model "
                            f"({_first_line(e)})")
        eos = self._sp.eos_id()
        if eos < 0:
            raise UserError(f"--tokenizer-model {model_file} has no eos piece to use as end of document; "
                            "train it with an eos id (tools/train_tokenizer.py does)")
        self.eod = int(eos)
        self.vocab_size = int(self._sp.get_piece_size())

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        # one thread: parallelism comes from preprocess_data.py's --workers processes
        return self._sp.encode(texts, num_threads=1)

    def detokenize(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


class HuggingFaceTokenizer(MegatronTokenizer):
    """``transformers.AutoTokenizer`` from a local folder; no remote code, no downloads."""

    def __init__(self, path: str):
        if not path:
            raise UserError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR "
                            "(a local folder with the tokenizer files)")
        if not os.path.exists(path):
            raise UserError(f"--tokenizer-model {path}: no such local folder (megalite never downloads "
                            "tokenizers; save one with tokenizer.save_pretrained(DIR) first)")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
        except Exception as e:
            raise UserError(f"--tokenizer-model {path}: cannot load a Hugging Face tokenizer from it ({_first_line(e)})")
        if tok.eos_token_id is None:
            raise UserError(f"--tokenizer-model {path}: the tokenizer has no eos token to use as end of document "
                            "(documents are packed, and --reset-attention-mask split, at it); save it with one")
        tok.model_max_length = sys.maxsize  # documents are long; no truncation warnings
        self._tok = tok
        self.eod = int(tok.eos_token_id)
        self.vocab_size = int(len(tok))

    def tokenize(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False)["input_ids"]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def build_tokenizer(config: DataConfig) -> MegatronTokenizer:
    kind = config.tokenizer_type
    if kind == "NullTokenizer":
        if config.vocab_size is None:
            raise UserError("--tokenizer-type NullTokenizer needs --vocab-size N")
        if config.vocab_size <= 0:
            raise UserError(f"--vocab-size {config.vocab_size} must be positive")
        return NullTokenizer(config.vocab_size)
    if kind == "GPT2BPETokenizer":
        for value, flag in ((config.vocab_file, "--vocab-file"), (config.merge_file, "--merge-file")):
            if not value:
                raise UserError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file "
                                f"({flag} is missing)")
        return GPT2BPETokenizer(_need_file(config.vocab_file, "--vocab-file", kind),
                                _need_file(config.merge_file, "--merge-file", kind))
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        return SentencePieceTokenizer(_need_file(config.tokenizer_model, "--tokenizer-model", kind))
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(config.tokenizer_model)
    if kind is None:
        raise UserError("no tokenizer: pass --tokenizer-type (" + ", ".join(TOKENIZER_TYPES) + ")")
    raise UserError(f"--tokenizer-type {kind} is not supported (choose " + ", ".join(TOKENIZER_TYPES) + ")")
