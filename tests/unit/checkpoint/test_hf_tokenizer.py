"""The exported tokenizer (megalite/checkpoint/hf_tokenizer.py): a checkpoint trained with a SentencePiece
or GPT-2 BPE tokenizer exports tokenizer files that AutoTokenizer loads and that give megalite's tokens."""
import json
import os

import pytest

from megalite.checkpoint.files import CheckpointReader, write_checkpoint
from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf
from megalite.data.tokenizers import GPT2BPETokenizer, SentencePieceTokenizer
from megalite_test_utils import ROOT
from unit.checkpoint.test_convert_checkpoint import make_hf

transformers = pytest.importorskip("transformers")

# the demo's generation prompt, then what source code and other text hold: indentation, tabs, blank lines,
# digits, accents, characters outside the training text (byte fallback), control pieces written as text
TEXTS = ["def __init__(self", "  x = 12345\n\n\tif a:  \n    return 'héllo wörld ✓ 中文 😀'", " leading space",
         "\n\nclass A:\n    pass\n", "a  b   c ", "a</s>b <s> x <unk>", ""]


def corpus():
    with open(os.path.join(ROOT, "megalite", "checkpoint", "hf.py"), encoding="utf-8") as f:
        return [p for p in f.read().split("\n\n") if p.strip()]


def train_sentencepiece(directory, model_type, **options):
    import sentencepiece as spm
    prefix = os.path.join(directory, f"sp_{model_type}")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()), model_prefix=prefix, vocab_size=400,
                                   model_type=model_type, minloglevel=2, character_coverage=1.0, **options)
    return prefix + ".model"


# tools/train_tokenizer.py's settings (the demo's), and SentencePiece's defaults (NFKC, no byte fallback)
DEMO_SETTINGS = dict(byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
                     allow_whitespace_only_pieces=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)


def trained_checkpoint(tmp_path, tokenizer: dict):
    """A checkpoint as --save writes it after training with ``tokenizer`` (absolute paths)."""
    make_hf(str(tmp_path / "hf"), "llama_mqa_untied")
    reader = CheckpointReader(hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "conv")))
    weights = {n: reader.tensor(n) for n in reader.names()}
    write_checkpoint(str(tmp_path / "train"), 10, {"model-pp000.safetensors": weights},
                     {"model": reader.metadata["model"], "tokenizer": tokenizer})
    return str(tmp_path / "train")


def export(tmp_path, tokenizer):
    warnings = []
    out = megalite_to_hf(trained_checkpoint(tmp_path, tokenizer), str(tmp_path / "out"), log=warnings.append)
    return out, warnings


def sp_metadata(model_file):
    return {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": os.path.abspath(model_file),
            "vocab_file": None, "merge_file": None, "vocab_size": None}


@pytest.mark.parametrize("model_type, options", [("bpe", DEMO_SETTINGS), ("unigram", DEMO_SETTINGS),
                                                 ("bpe", {}), ("unigram", {})],
                         ids=["bpe-demo", "unigram-demo", "bpe-nfkc", "unigram-nfkc"])
def test_sentencepiece_export_encodes_like_megalite(tmp_path, model_type, options):
    model_file = train_sentencepiece(tmp_path, model_type, **options)
    out, warnings = export(tmp_path, sp_metadata(model_file))
    assert warnings == []
    ours = SentencePieceTokenizer(model_file)
    exported = transformers.AutoTokenizer.from_pretrained(out)
    ties = 0
    for text in TEXTS + corpus():
        ids, theirs = ours.tokenize(text), exported(text)["input_ids"]     # no BOS: megalite's documents have none
        if theirs != ids and model_type == "unigram" and text not in TEXTS:
            # Unigram's best segmentation may tie (a run of "=" split 16+1 or 1+16): then only the order differs
            score = lambda pieces: sum(ours._sp.get_score(i) for i in pieces)     # noqa: E731
            assert abs(score(theirs) - score(ids)) < 1e-4 and sorted(theirs) == sorted(ids), text
            ties += 1
            continue
        assert theirs == ids, text
        if options:                                                 # byte fallback: decoding is exact too
            assert exported.decode(ids) == ours.detokenize(ids) == text
    assert ties <= 3
    assert exported.eos_token_id == ours.eod == 2 and exported.bos_token_id == 1
    config = json.load(open(os.path.join(out, "config.json")))
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


DEMO_MODEL = os.path.join(ROOT, "data", "stdlib_sp.model")


@pytest.mark.skipif(not os.path.isfile(DEMO_MODEL), reason="the demo's tokenizer is not built (make demo builds it)")
def test_demo_tokenizer_export_gives_megalite_tokens(tmp_path):
    out, warnings = export(tmp_path, sp_metadata(DEMO_MODEL))
    assert warnings == []
    ours, exported = SentencePieceTokenizer(DEMO_MODEL), transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS + corpus():
        assert exported(text)["input_ids"] == ours.tokenize(text), text


def test_gpt2_bpe_export_encodes_like_megalite(tmp_path):
    from tokenizers import ByteLevelBPETokenizer
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus(), vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
    vocab, merges = bpe.save_model(str(tmp_path))
    out, warnings = export(tmp_path, {"tokenizer_type": "GPT2BPETokenizer", "tokenizer_model": None,
                                      "vocab_file": vocab, "merge_file": merges, "vocab_size": None})
    assert warnings == []
    ours, exported = GPT2BPETokenizer(vocab, merges), transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS + ["x<|endoftext|>y"] + corpus():
        assert exported(text)["input_ids"] == ours.tokenize(text), text
    assert exported.eos_token_id == ours.eod


def test_missing_or_vocabulary_free_tokenizers_warn_once(tmp_path):
    out, warnings = export(tmp_path / "null", {"tokenizer_type": "NullTokenizer", "tokenizer_model": None,
                                               "vocab_file": None, "merge_file": None, "vocab_size": 99})
    assert len(warnings) == 1 and "NullTokenizer" in warnings[0]
    assert not any(f.startswith("tokenizer") for f in os.listdir(out))
    out, warnings = export(tmp_path / "moved", sp_metadata(tmp_path / "gone.model"))
    assert len(warnings) == 1 and "gone.model is missing" in warnings[0]
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
