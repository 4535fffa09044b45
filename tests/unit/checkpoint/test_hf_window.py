"""Hugging Face sliding windows: which layers of each family get a window, and one-line refusals of windows
and sinks that megalite or the chosen family cannot represent (the conversions themselves, with logits
against transformers, are in test_convert_checkpoint.py)."""
import json
import os

import pytest

from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf
from megalite.checkpoint.hf_window import window_config, window_fields
from megalite.errors import UserError

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


@pytest.mark.parametrize("config, window, skip", [
    (transformers.MistralConfig(**SMALL, sliding_window=8), [7, 0], None),
    (transformers.MistralConfig(**SMALL, sliding_window=64), None, None),         # covers every position
    (transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=2), [7, 0],
     [0, 0, 1, 1]),
    (transformers.Qwen2Config(**SMALL, use_sliding_window=False, sliding_window=8), None, None),
    (transformers.Qwen2MoeConfig(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=4), [7, 0],
     [1, 0, 1, 0]),
    (transformers.LlamaConfig(**SMALL), None, None),
])
def test_layers_with_the_window_as_transformers_applies_them(config, window, skip):
    assert window_fields(config) == {"window_size": window, "window_attn_skip_freq": skip}


def test_window_config_writes_back_what_was_read():
    for config in (transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=2),
                   transformers.MistralConfig(**SMALL, sliding_window=8)):
        m = {"num_layers": 4, **window_fields(config)}
        again = type(config)(**{**SMALL, **window_config(m, config.model_type)})
        assert window_fields(again) == window_fields(config)
        assert again.sliding_window == config.sliding_window


def test_layer_types_megalite_lacks_are_refused(tmp_path):
    config = transformers.Qwen2Config(**SMALL, layer_types=["chunked_attention"] + ["full_attention"] * 3)
    config.save_pretrained(tmp_path / "hf")
    with pytest.raises(UserError, match="qwen2 layer_types chunked_attention are not supported"):
        hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def _edit_model_metadata(ckpt: str, **fields) -> None:
    path = os.path.join(ckpt, "iter_0000000", "metadata.json")
    with open(path) as f:
        meta = json.load(f)
    meta["model"].update(fields)
    with open(path, "w") as f:
        json.dump(meta, f)


def test_export_refuses_windows_and_sinks_the_family_lacks(tmp_path):
    transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=8)).save_pretrained(
        tmp_path / "hf")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    hf_to_megalite(str(tmp_path / "hf"), ckpt)
    with pytest.raises(UserError, match="--model-type llama cannot represent .*llama has no sliding window"):
        megalite_to_hf(ckpt, out, model_type="llama")
    _edit_model_metadata(ckpt, window_attn_skip_freq=[0, 0, 1, 1])
    with pytest.raises(UserError, match="--model-type mistral cannot represent .*every layer"):
        megalite_to_hf(ckpt, out)
    _edit_model_metadata(ckpt, window_attn_skip_freq=None, softmax_type="learnable")
    with pytest.raises(UserError, match="mistral has no attention sinks, the checkpoint --softmax-type learnable"):
        megalite_to_hf(ckpt, out)
    assert not os.path.exists(out)
