"""Hugging Face sliding attention windows <-> megalite's --window-size / --window-attn-skip-freq.

A Hugging Face ``sliding_window`` W lets query i see key j when i - j < W (transformers' mask: key index
> query index - W), i.e. megalite's (and flash attention's) window (left, right) = (W - 1, 0); a window
of at least ``max_position_embeddings`` cuts nothing and is full attention.

Which layers have the window, as transformers 5 applies it:
- Mistral, Mixtral, Phi-3 and Qwen3-MoE: every layer (Qwen3-MoE only with ``use_sliding_window``);
- Qwen2, Qwen3 and Qwen2-MoE: the layers whose ``layer_types`` entry is "sliding_attention" (transformers
  derives the list from ``use_sliding_window`` and ``max_window_layers`` when config.json has none);
- GPT-OSS: likewise by ``layer_types`` (alternating sliding and full unless config.json says otherwise).
megalite has one window for all windowed layers, the others full: --window-attn-skip-freq is the 0/1
list per layer (1: window), absent when every layer has it. Other layer types (chunked attention, say)
and windows that differ between layers are refused.

Only GPT-OSS has attention sinks (--softmax-type learnable); a model with sinks is refused on export to
any other family.
"""
from __future__ import annotations

from megalite.config.schema import is_window_layer
from megalite.errors import UserError

EVERY_LAYER = ("mistral", "mixtral", "phi3", "qwen3_moe")      # config.sliding_window on every layer
LAYER_TYPED = ("qwen2", "qwen3", "qwen2_moe", "gpt_oss")                # on the "sliding_attention" layer types
LAYER_TYPES = ("sliding_attention", "full_attention")


def _hf_layer_windows(config) -> list[int | None]:
    """The window W each layer of a transformers config applies (None: full attention)."""
    n, model_type = config.num_hidden_layers, config.model_type
    window = getattr(config, "sliding_window", None) or None      # probe: a transformers config (Llama has none)
    if model_type in EVERY_LAYER:
        return [window] * n
    if model_type not in LAYER_TYPED:
        return [None] * n
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)      # probe: a transformers config
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise UserError(f"{model_type} layer_types {', '.join(unknown)} are not supported: megalite has sliding-window "
                        "and full attention layers only")
    return [window if t == "sliding_attention" else None for t in types]


def window_fields(config) -> dict:
    """metadata["model"]'s window_size and window_attn_skip_freq for a transformers config (checked by
    check_window_convertible)."""
    windows = [w if w is not None and w < config.max_position_embeddings else None
               for w in _hf_layer_windows(config)]
    sizes = sorted({w for w in windows if w is not None})
    if not sizes:
        return {"window_size": None, "window_attn_skip_freq": None}
    skip = None if all(windows) else [int(w is not None) for w in windows]
    return {"window_size": [sizes[0] - 1, 0], "window_attn_skip_freq": skip}


def check_window_convertible(config) -> None:
    """Refuse (one line) windows megalite cannot represent: several sizes, or one below a single token."""
    sizes = sorted({w for w in _hf_layer_windows(config) if w is not None and w < config.max_position_embeddings})
    if len(sizes) > 1:
        raise UserError(f"{config.model_type} has sliding windows of {', '.join(map(str, sizes))} tokens in different "
                        "layers; megalite has one --window-size for all windowed layers")
    if sizes and sizes[0] < 1:
        raise UserError(f"{config.model_type} sliding_window={sizes[0]} lets a token see no key, not even itself")


def windowed_layers(m: dict) -> list[bool] | None:
    """Per layer whether it has the window, from metadata["model"] ``m``; None when no layer does."""
    window, skip = m.get("window_size"), m.get("window_attn_skip_freq")
    flags = [is_window_layer(window, skip, i + 1) and window[0] >= 0 for i in range(m["num_layers"])]
    return flags if any(flags) else None


def check_window_representable(m: dict, model_type: str, need) -> None:
    """Refuse (``need``) a window or sink the chosen Hugging Face family cannot express."""
    need(m.get("softmax_type", "vanilla") == "vanilla" or model_type == "gpt_oss", f"{model_type} has no attention sinks, the checkpoint "
         f"--softmax-type {m.get('softmax_type')}")
    layers = windowed_layers(m)
    if layers is None:
        return
    need(model_type in EVERY_LAYER + LAYER_TYPED, f"{model_type} has no sliding window, the checkpoint "
         f"--window-size {m['window_size'][0]},0; use --model-type mistral or qwen2")
    if model_type in EVERY_LAYER:
        need(all(layers), f"{model_type} applies its window to every layer, the checkpoint keeps some layers full "
             "(--window-attn-skip-freq); use --model-type qwen2 or qwen3")


def window_config(m: dict, model_type: str) -> dict:
    """The Hugging Face config fields of the checkpoint's window (checked representable)."""
    if model_type not in EVERY_LAYER + LAYER_TYPED:
        return {}
    layers = windowed_layers(m)
    use = layers is not None
    fields = {"sliding_window": m["window_size"][0] + 1 if use else None}
    if model_type in ("qwen3_moe", "qwen2", "qwen3", "qwen2_moe"):
        fields["use_sliding_window"] = use
    if model_type in LAYER_TYPED:
        layers = layers or [False] * m["num_layers"]
        fields["layer_types"] = [LAYER_TYPES[0] if w else LAYER_TYPES[1] for w in layers]
    if model_type in ("qwen2", "qwen3"):      # their rule without layer_types: layers from this index on
        fields["max_window_layers"] = next((i for i, w in enumerate(layers) if w), len(layers))
    return fields
