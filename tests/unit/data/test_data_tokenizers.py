"""Tokenizers: one interface over sentencepiece / tokenizers / transformers, local files only."""
from __future__ import annotations

import pytest

from megalite.config.schema import DataConfig
from megalite.data.tokenizers import (GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer,
                                      SentencePieceTokenizer, build_tokenizer)
from megalite.errors import UserError

TEXT = "def add(a, b):\n    return a + b  # naïve café\n\n\tx = 42\n"


def test_null_tokenizer_semantics():
    tok = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer", vocab_size=100))
    assert isinstance(tok, NullTokenizer)
    assert tok.vocab_size == 101 and tok.eod == 100
    assert tok.tokenize("1 2  30\n4") == [1, 2, 30, 4]
    assert tok.detokenize([5, 6]) == "5 6"
    assert tok.tokenize_batch(["1", "2 3"]) == [[1], [2, 3]]


def test_sentencepiece(sp_model):
    import sentencepiece as spm

    tok = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model))
    assert isinstance(tok, SentencePieceTokenizer)
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    assert tok.vocab_size == sp.get_piece_size() == 320
    assert tok.eod == sp.piece_to_id("</s>") == 2
    ids = tok.tokenize(TEXT)
    assert ids == sp.encode(TEXT) and tok.eod not in ids
    assert tok.detokenize(ids) == TEXT  # byte-exact for code
    assert tok.tokenize_batch([TEXT, "x"]) == [ids, sp.encode("x")]


def test_gpt2_bpe_matches_transformers(gpt2_files):
    from transformers import GPT2Tokenizer

    vocab, merges = gpt2_files
    tok = build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    assert isinstance(tok, GPT2BPETokenizer)
    ref = GPT2Tokenizer(vocab=vocab, merges=merges)
    assert len(ref) == 400
    assert tok.tokenize(TEXT) == ref.encode(TEXT)
    assert tok.eod == ref.convert_tokens_to_ids("<|endoftext|>")
    assert tok.vocab_size == len(ref)
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT
    assert tok.tokenize_batch([TEXT, "ab"]) == [ref.encode(TEXT), ref.encode("ab")]


def test_huggingface_local_folder(hf_dir):
    from transformers import AutoTokenizer

    tok = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf_dir))
    assert isinstance(tok, HuggingFaceTokenizer)
    ref = AutoTokenizer.from_pretrained(hf_dir)
    assert tok.tokenize(TEXT) == ref(TEXT, add_special_tokens=False)["input_ids"]
    assert tok.eod == ref.eos_token_id and tok.vocab_size == len(ref)
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT


@pytest.mark.parametrize("cfg,match", [
    (dict(tokenizer_type="NullTokenizer"), "needs --vocab-size"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="v.json"), "--merge-file is missing"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="nope.json", merge_file="nope.txt"),
     "--vocab-file nope.json: no such file"),
    (dict(tokenizer_type="SentencePieceTokenizer"), "needs --tokenizer-model"),
    (dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="missing.model"), "no such file"),
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="gpt2"), "never downloads"),
    (dict(tokenizer_type="BertWordPieceLowerCase"), "not supported"),
    (dict(), "pass --tokenizer-type"),
])
def test_tokenizer_user_errors(cfg, match):
    with pytest.raises(UserError, match=match):
        build_tokenizer(DataConfig(**cfg))


def test_corrupt_tokenizer_files(tmp_path, gpt2_files):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(UserError, match="not a SentencePiece model"):
        build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(bad)))
    with pytest.raises(UserError, match="not a GPT-2 BPE"):
        build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(bad),
                                   merge_file=gpt2_files[1]))
    empty_dir = tmp_path / "hf_empty"
    empty_dir.mkdir()
    with pytest.raises(UserError, match="cannot load a Hugging Face tokenizer"):
        build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(empty_dir)))
