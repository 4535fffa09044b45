"""Tokenizer files of the Hugging Face conversion: copied from a model directory on import, and on export
written from whatever tokenizer the checkpoint was trained with, so that ``AutoTokenizer.from_pretrained``
loads the exported folder and gives megalite's tokens.

- HuggingFaceTokenizer: its folder's tokenizer files are copied.
- SentencePieceTokenizer: the ``.model`` becomes a fast tokenizer (tokenizer.json) by transformers'
  SentencePiece converter, which follows the model's own normaliser spec (dummy prefix, whitespace
  escaping, extra-whitespace removal, precompiled character map), byte fallback and BPE merge ranks.
  megalite encodes documents with ``SentencePieceProcessor.encode``: no BOS/EOS added, and ``<s>`` or
  ``</s>`` written in a text are plain text, never control ids; the export keeps both (no post-processor,
  ``split_special_tokens``). In a Unigram model the unknown, control, byte and unused pieces never match text, so
  their scores are pushed out of reach; where two segmentations score exactly the same, the Unigram
  Viterbi searches of SentencePiece and ``tokenizers`` may order the tied pieces differently.
- GPT2BPETokenizer: vocab.json + merges.txt become the same ``tokenizers`` byte-level BPE megalite runs,
  ``<|endoftext|>`` its eos.
- NullTokenizer (ids as text) has no vocabulary to export: one warning.
"""
from __future__ import annotations

import json
import os
import shutil

from megalite.checkpoint.hf_config import quiet_transformers

# Files a Hugging Face tokenizer may consist of; only these are copied (never the weights next to them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt",
                   "chat_template.jinja", "chat_template.json")
# Any one of these makes a loadable tokenizer (tokenizer_config.json alone does not).
TOKENIZER_CORE = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
SP_NORMAL, SP_USER_DEFINED = 1, 4                   # SentencePiece piece types that match text
SP_UNIGRAM = 1                                          # trainer_spec.model_type
OUT_OF_REACH = -1e9                                     # a Unigram score no segmentation picks
GPT2_EOD = "<|endoftext|>"


def tokenizer_files(directory: str) -> list[str]:
    """The tokenizer files in ``directory`` (empty when there is no loadable tokenizer)."""
    present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, f))]
    return present if any(f in TOKENIZER_CORE for f in present) else []


def copy_tokenizer(source: str, destination: str) -> list[str]:
    files = tokenizer_files(source)
    os.makedirs(destination, exist_ok=True)
    for f in files:
        shutil.copyfile(os.path.join(source, f), os.path.join(destination, f))
    return files


def names_tokenizer_class(directory: str) -> bool:
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("tokenizer_class"))
    except (OSError, ValueError, AttributeError):
        return False


def export_tokenizer(tokenizer: dict | None, iteration_dir: str, output_dir: str, log) -> bool:
    """Write the checkpoint's tokenizer (metadata["tokenizer"]; relative paths are inside ``iteration_dir``)
    into ``output_dir`` as Hugging Face tokenizer files; False, after one warning, when there is none."""
    if not tokenizer:
        return False
    kind = tokenizer.get("tokenizer_type")
    path = lambda key: tokenizer.get(key) and os.path.join(iteration_dir, tokenizer[key])   # noqa: E731
    if kind == "HuggingFaceTokenizer" and path("tokenizer_model"):
        if not tokenizer_files(path("tokenizer_model")):
            return _missing(path("tokenizer_model"), log)
        copy_tokenizer(path("tokenizer_model"), output_dir)
        return True
    if kind == "SentencePieceTokenizer" and path("tokenizer_model"):
        if not os.path.isfile(path("tokenizer_model")):
            return _missing(path("tokenizer_model"), log)
        return _save(_sentencepiece_tokenizer(path("tokenizer_model"), log), output_dir)
    if kind == "GPT2BPETokenizer" and path("vocab_file") and path("merge_file"):
        for key in ("vocab_file", "merge_file"):
            if not os.path.isfile(path(key)):
                return _missing(path(key), log)
        return _save(_gpt2_tokenizer(path("vocab_file"), path("merge_file"), output_dir), output_dir)
    log(f"the checkpoint's tokenizer ({kind}) has no vocabulary to export; no tokenizer files written")
    return False


def _missing(path: str, log) -> bool:
    log(f"tokenizer file {path} is missing (moved or deleted?); no tokenizer exported")
    return False


def _save(fast, output_dir: str) -> bool:
    if fast is None:
        return False
    with quiet_transformers():
        fast.save_pretrained(output_dir)
    return True


def _sentencepiece_tokenizer(model_file: str, log):
    """A fast tokenizer that encodes like ``SentencePieceProcessor(model_file).encode`` (module docstring)."""
    with quiet_transformers():
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf
        build = getattr(SpmConverter, "build_tokenizer_from_spm_proto", None)     # probe: transformers 5 has it
        if build is None:
            log("this transformers has no SentencePiece-model converter (transformers 5 has); no tokenizer exported")
            return None
        proto = import_protobuf().ModelProto()
        with open(model_file, "rb") as f:
            proto.ParseFromString(f.read())
        pieces = proto.pieces
        if proto.trainer_spec.model_type == SP_UNIGRAM:
            vocab = [(p.piece, p.score if p.type in (SP_NORMAL, SP_USER_DEFINED) else OUT_OF_REACH)
                     for p in pieces]
        else:
            vocab = {p.piece: i for i, p in enumerate(pieces)}
        spec = proto.trainer_spec
        special = {name: pieces[i].piece for name, i in (("unk_token", spec.unk_id), ("bos_token", spec.bos_id),
                                                         ("eos_token", spec.eos_id), ("pad_token", spec.pad_id))
                   if 0 <= i < len(pieces)}
        return PreTrainedTokenizerFast(tokenizer_object=build(proto, vocab, legacy=True), split_special_tokens=True,
                                       **special)


def _gpt2_tokenizer(vocab_file: str, merge_file: str, output_dir: str):
    """megalite's GPT2BPETokenizer (tokenizers' ByteLevelBPETokenizer) as a fast tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    os.makedirs(output_dir, exist_ok=True)
    file = os.path.join(output_dir, "tokenizer.json")
    ByteLevelBPETokenizer.from_file(vocab_file, merge_file).save(file)
    with quiet_transformers():
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast(tokenizer_file=file, eos_token=GPT2_EOD, bos_token=GPT2_EOD,
                                       unk_token=GPT2_EOD, split_special_tokens=True)
