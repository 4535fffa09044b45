#!/usr/bin/env python
"""What autograd keeps per transformer layer: megalite vs Megatron's formula vs transformers' Llama.

The count: run a model forward under ``torch.autograd.graph.saved_tensors_hooks`` and add up the
*storages* of every tensor saved for backward (views of one storage count once, by its data_ptr;
parameters and buffers are excluded). A layer's share is what the layer saves first: the storages
first saved while that layer runs forward. Measured on the last layer of a 2-layer model, this is the
per-layer cost of a deep stack — the layer's input (the previous layer's output, saved by its first
norm) counts, tables shared by all layers (RoPE cos/sin, first saved by layer 0) don't.

References per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"), for 16-bit activations:
  Megatron, no flash attention      s*b*h*(34 + 5*a*s/h)        (/t with TP t + sequence parallelism)
  Megatron, flash attention         34*s*b*h                    (/t with TP t + SP)
scaled by (element size / 2) for fp32. Both assume GPT's 4h GELU MLP with dropout; ``minimum`` is the
same accounting (what each op needs for its backward, nothing else) for the configuration measured:

  norm inputs (2 x sbh) + QKV input (sbh) + Q, K, V unexpanded (sbh + 2*s*b*g*d) + attention output =
  output-projection input (sbh) + fc1 input (sbh) + SwiGLU's gate and up (2*s*b*f) + fc2 input (s*b*f)
  [GELU MLP: fc1 output and fc2 input, 2*s*b*f], plus dropout masks (1 byte) and fp32 row statistics
  (norm rstd, attention log-sum-exp), all divided by t under sequence parallelism - except K and V
  when t exceeds the KV heads g: then each rank keeps its group's whole K and V (the QKV weight
  replicates KV heads, as in Megatron), s*b*d each instead of s*b*g*d/t.

    python bench/activation_memory.py          # prints the markdown table (spawns 2 and 4 gloo ranks)
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# ---- counting ----------------------------------------------------------------------------------------
class SavedTensors:
    """Storages saved for backward, each attributed to the scope (e.g. layer) active when first saved."""

    def __init__(self, exclude=()):
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.first_scope: dict[int, str | None] = {}
        self.nbytes: dict[int, int] = {}
        self.shapes: dict[int, list] = {}
        self.scope: str | None = None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta" or t.layout != torch.strided:
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.excluded or storage.nbytes() == 0:
            return t
        if ptr not in self.nbytes:
            self.first_scope[ptr] = self.scope
            self.nbytes[ptr] = storage.nbytes()
            self.shapes[ptr] = []
        self.shapes[ptr].append((tuple(t.shape), t.dtype))
        return t

    def bytes(self, scope: str | None = "__all__") -> int:
        return sum(n for ptr, n in self.nbytes.items() if scope == "__all__" or self.first_scope[ptr] == scope)

    def breakdown(self, scope: str | None = "__all__") -> list[tuple[int, list]]:
        """(bytes, [(shape, dtype) saved from that storage]) for each storage, largest first."""
        rows = [(n, self.shapes[ptr]) for ptr, n in self.nbytes.items()
                if scope == "__all__" or self.first_scope[ptr] == scope]
        return sorted(rows, key=lambda r: -r[0])


@contextmanager
def count_saved(module: torch.nn.Module | None = None, scopes: dict[str, torch.nn.Module] | None = None):
    """Count storages saved for backward inside the block (``module``'s parameters and buffers excluded).

    ``scopes`` name submodules (e.g. layers): a storage is attributed to the scope running when it was
    first saved (None outside all of them)."""
    exclude = list(module.parameters()) + list(module.buffers()) if module is not None else []
    record = SavedTensors(exclude)
    handles = []
    for name, sub in (scopes or {}).items():
        def enter(_mod, _args, name=name):
            record.scope = name

        def leave(_mod, _args, _out):
            record.scope = None
        handles += [sub.register_forward_pre_hook(enter), sub.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(record.pack, lambda t: t):
            yield record
    finally:
        for h in handles:
            h.remove()


# ---- configurations ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A Llama-style layer (RMSNorm, RoPE, GQA, SwiGLU, no biases, no dropout), or with style "gpt" a
    GPT-2 layer as Korthikanti et al. count it (LayerNorm, learned positions, MHA, 4h GELU MLP, biases,
    hidden dropout; attention dropout 0, which flash kernels would apply without storing anything)."""
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 688
    seq: int = 128
    batch: int = 2
    vocab: int = 512
    dtype: str = "bfloat16"
    style: str = "llama"
    hidden_dropout: float = 0.0

    def describe(self) -> str:
        heads = f"a{self.heads}/g{self.kv_heads}" if self.kv_heads != self.heads else f"a{self.heads}"
        extra = f" dropout {self.hidden_dropout}" if self.hidden_dropout else ""
        return (f"{self.style} h{self.hidden} {heads} f{self.ffn} s{self.seq} b{self.batch} "
                f"{'bf16' if self.dtype == 'bfloat16' else 'fp32'}{extra}")

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()


def model_config(shape: Shape, num_layers: int = 2):
    from megalite.config.schema import ModelConfig
    llama = shape.style == "llama"
    return ModelConfig(
        num_layers=num_layers, hidden_size=shape.hidden, num_attention_heads=shape.heads, ffn_hidden_size=shape.ffn,
        kv_channels=shape.hidden // shape.heads, num_query_groups=shape.kv_heads, seq_length=shape.seq,
        max_position_embeddings=shape.seq, padded_vocab_size=shape.vocab, vocab_size=shape.vocab,
        position_embedding_type="rope" if llama else "learned_absolute",
        normalization="RMSNorm" if llama else "LayerNorm", swiglu=llama, openai_gelu=not llama,
        add_bias_linear=not llama, untie_embeddings_and_output_weights=llama, attention_dropout=0.0,
        hidden_dropout=shape.hidden_dropout, params_dtype=shape.dtype)


def _tokens(shape: Shape) -> torch.Tensor:
    return torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(0))


# ---- measurements --------------------------------------------------------------------------------------
def megalite_layer_bytes(shape: Shape, tp=None, breakdown: bool = False):
    """Bytes saved for backward by the last of 2 layers of a megalite GPTModel (this rank's share)."""
    from megalite.model.gpt import GPTModel
    model = GPTModel(model_config(shape), seed=1, tp=tp)
    layers = list(model.decoder.layers)
    tokens = _tokens(shape)
    with count_saved(model, {"layer": layers[-1]}) as record:
        loss = model(tokens, labels=tokens).float().mean()
    loss.backward()                                    # the graph is whole and usable
    return (record.bytes("layer"), record.breakdown("layer")) if breakdown else record.bytes("layer")


def transformers_layer_bytes(shape: Shape, breakdown: bool = False):
    """The same count for the last of 2 decoder layers of transformers' LlamaForCausalLM (sdpa attention),
    with weights in the compute dtype (as megalite's --bf16 model)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                         num_hidden_layers=2, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         max_position_embeddings=shape.seq, tie_word_embeddings=False, attention_dropout=0.0,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, shape.dtype)).train()
    tokens = _tokens(shape)
    layers = list(model.model.layers)
    with count_saved(model, {"layer": layers[-1]}) as record:
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return (record.bytes("layer"), record.breakdown("layer")) if breakdown else record.bytes("layer")


def _tp_rank_bytes(rank: int, world: int, shapes, sequence_parallel: bool = True) -> list[int]:
    from megalite.parallel.mesh import ParallelState
    from megalite.parallel.tensor.layers import TensorParallel
    from megalite.parallel.tensor.random import build_rng_tracker
    state = ParallelState.build(world, rank, tp=world)
    tp = TensorParallel(state.group("tp"), state.tp_rank, state.tp_size, sequence_parallel=sequence_parallel,
                        rng=build_rng_tracker(1234, state.tp_rank, torch.device("cpu")))
    return [megalite_layer_bytes(shape, tp) for shape in shapes]


def megalite_tp_layer_bytes(shapes, tp_size: int, sequence_parallel: bool = True) -> list[int]:
    """Bytes saved by one layer of each shape at TP ``tp_size`` (+ SP), the largest over ranks (one
    spawn of ``tp_size`` gloo ranks for all shapes)."""
    if tp_size == 1:
        return [megalite_layer_bytes(shape) for shape in shapes]
    harness_dir = os.path.join(ROOT, "tests", "distributed")
    if harness_dir not in sys.path:
        sys.path.insert(0, harness_dir)
    from harness import run_ranks
    per_rank = run_ranks(tp_size, _tp_rank_bytes, list(shapes), sequence_parallel)
    return [max(rank[i] for rank in per_rank) for i in range(len(shapes))]


# ---- references --------------------------------------------------------------------------------------
def megatron_formula_bytes(shape: Shape, tp_size: int = 1, flash: bool = True) -> float:
    """Korthikanti et al.: s*b*h*(34 + 5as/h) bytes at 16 bit (34*s*b*h with flash attention), /t with SP;
    scaled to the element size measured."""
    s, b, h, a = shape.seq, shape.batch, shape.hidden, shape.heads
    per16 = s * b * h * (34 + (0 if flash else 5 * a * s / h))
    return per16 * shape.element_size / 2 / tp_size


def minimum_bytes(shape: Shape, tp_size: int = 1) -> float:
    """What the layer's backward needs, per TP rank with sequence parallelism (module docstring)."""
    s, b, h, f, e, t = shape.seq, shape.batch, shape.hidden, shape.ffn, shape.element_size, tp_size
    d = shape.hidden // shape.heads
    kv_width = max(1, shape.kv_heads // t) * d * t            # KV heads replicated when t > groups
    mlp = 3 * f if shape.style == "llama" else 2 * f           # [gate | up] and fc2 input; GELU input and output
    elements = s * b * (6 * h + 2 * kv_width + mlp)
    masks = 2 * s * b * h if shape.hidden_dropout > 0 else 0      # 1 byte per element
    stats_per_row = 1 if shape.style == "llama" else 2           # rstd; LayerNorm: mean and rstd
    fp32_stats = 4 * (2 * stats_per_row * s * b + b * shape.heads * s)    # 2 norms, attention lse
    return (elements * e + masks + fp32_stats) / t


LLAMA = Shape()
CONFIGS = (LLAMA, replace(LLAMA, dtype="float32"), replace(LLAMA, heads=8, kv_heads=4),
           Shape(heads=4, kv_heads=4, ffn=1024, style="gpt", hidden_dropout=0.1))


def activation_table(shapes=CONFIGS, tp_sizes=(1, 2, 4)) -> list[dict]:
    """One row per (config, TP): TP > 1 runs with sequence parallelism; ``measured`` is the bytes one
    layer keeps for backward (the largest over ranks), next to Megatron's formula with flash attention
    (34sbh/t; ``megatron_no_flash``: sbh(34 + 5as/h)/t), the architecture's minimum, transformers'
    LlamaForCausalLM (TP=1, Llama configs) and ``share_of_tp1`` = measured x t / (TP=1 measured)."""
    shapes = list(shapes)
    measured = {t: megalite_tp_layer_bytes(shapes, t) for t in tp_sizes}
    rows = []
    for i, shape in enumerate(shapes):
        hf = transformers_layer_bytes(shape) if shape.style == "llama" else None
        base = measured[1][i] if 1 in measured else None
        for t in tp_sizes:
            m, formula, minimum = measured[t][i], megatron_formula_bytes(shape, t), minimum_bytes(shape, t)
            rows.append({"config": shape.describe(), "tp": t, "sequence_parallel": t > 1, "measured": m,
                         "megatron_formula": formula, "ratio": m / formula,
                         "megatron_no_flash": megatron_formula_bytes(shape, t, flash=False),
                         "minimum": minimum, "vs_minimum": m / minimum,
                         "transformers": hf if t == 1 else None,
                         "vs_transformers": m / hf if t == 1 and hf else None,
                         "share_of_tp1": m * t / base if base else None, "kv_heads": shape.kv_heads,
                         "minimum_share": minimum * t / minimum_bytes(shape, 1)})
    return rows


def markdown(rows: list[dict]) -> str:
    def kib(n):
        return f"{n / 1024:,.0f}" if n is not None else ""

    def ratio(x, digits=2):
        return f"{x:.{digits}f}" if x is not None else ""
    lines = ["| config | TP | measured KiB/layer | Megatron 34sbh/t KiB (flash) | measured / Megatron | "
             "Megatron sbh(34+5as/h)/t KiB | minimum KiB | measured / minimum | transformers KiB | "
             "measured / transformers | measured x t / TP=1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tp = f"{r['tp']}" + (" + SP" if r["sequence_parallel"] else "")
        lines.append(f"| {r['config']} | {tp} | {kib(r['measured'])} | {kib(r['megatron_formula'])} | "
                     f"{ratio(r['ratio'])} | {kib(r['megatron_no_flash'])} | {kib(r['minimum'])} | "
                     f"{ratio(r['vs_minimum'])} | {kib(r['transformers'])} | {ratio(r['vs_transformers'])} | "
                     f"{ratio(r['share_of_tp1'], 3)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    print(markdown(activation_table()))
