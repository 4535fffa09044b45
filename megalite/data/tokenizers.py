"""Tokenizers behind one small interface: ``vocab_size``, ``eod``, ``tokenize``, ``detokenize``.

``build_tokenizer(data_config)`` picks one from ``--tokenizer-type`` like Megatron does.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from megalite.config import DataConfig
from megalite.errors import UserError


class MegatronTokenizer(ABC):
    """What the data pipeline and the model need from any tokenizer."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (before padding for the model)."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id appended by ``--append-eod``."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def detokenize(self, ids) -> str: ...


class NullTokenizer(MegatronTokenizer):
    """Text is whitespace-separated integer ids; eod is one id past ``--vocab-size`` (as in Megatron)."""

    def __init__(self, vocab_size: int):
        self._vocab_size_without_eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def eod(self) -> int:
        return self._vocab_size_without_eod

    def tokenize(self, text: str) -> list[int]:
        return [int(tok) for tok in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(config: DataConfig) -> MegatronTokenizer:
    kind = config.tokenizer_type
    if kind == "NullTokenizer":
        if config.vocab_size is None:
            raise UserError("--tokenizer-type NullTokenizer needs --vocab-size N")
        return NullTokenizer(config.vocab_size)
    raise UserError(f"--tokenizer-type {kind} is not supported "
                    "(choose GPT2BPETokenizer, SentencePieceTokenizer, HuggingFaceTokenizer or NullTokenizer)")
