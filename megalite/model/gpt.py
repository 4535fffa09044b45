"""GPTModel: embedding -> transformer layers -> final norm -> output layer -> per-token loss.

One class covers GPT-2 style (learned positions, LayerNorm, GELU, biases, tied embeddings) and Llama
style (RoPE, RMSNorm, SwiGLU, no biases, GQA, untied output) from ModelConfig. ``pre_process`` /
``post_process`` and the layer range let a pipeline stage hold only its part of the model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dataclasses
from contextlib import nullcontext
from functools import partial

from megalite.config.schema import ModelConfig
from megalite.parallel.context.ring_attention import ContextParallel, local_positions
from megalite.errors import UserError
from megalite.model.init import initial_values, initialize_parameter
from megalite.model.moe import MoELayer
from megalite.model.mtp import MultiTokenPrediction
from megalite.model.attention.inputs import AttentionInputs
from megalite.model.attention.kv_cache import KVCache
from megalite.model.attention.rotary import RotaryEmbedding, Yarn
from megalite.model.norms import build_norm
from megalite.model.transformer import TransformerLayer
from megalite.parallel.data.protocol import ModuleUnit
from megalite.parallel.expert.dispatch import ExpertParallel, MoEContext
from megalite.parallel.param_meta import mark
from megalite.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel.tensor.layers import (ColumnParallelLinear, TensorParallel, VocabParallelEmbedding, parallel_logits,
                                             vocab_parallel_lookup)
from megalite.parallel.tensor.mappings import gather_from_tp_region, reduce_from_tp_region, scatter_to_sp_region
from megalite.parallel.tensor.random import checkpoint
from megalite.precision.gemm import GemmPrecision, build_gemm_precision, high_precision_recipe

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Embedding(nn.Module):
    """Word (+ learned position) embeddings -> [s, b, h]; sequence-split under sequence parallelism."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size, dtype, tp)
        self.position_embeddings = None
        if not config.use_rope:
            self.position_embeddings = nn.Embedding(
                config.max_position_embeddings, config.hidden_size, dtype=dtype,
                _weight=torch.empty(config.max_position_embeddings, config.hidden_size, dtype=dtype))
        self.dropout = config.hidden_dropout

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """[b, s] ids -> [s, b, h] activations ([s/tp, b, h] with sequence parallelism)."""
        x = reduce_from_tp_region(self.word_embeddings(input_ids), self.tp.group)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
            x = x + self.position_embeddings(position_ids)
        x = sequence_first(x, self.tp)
        if not self.tp.sequence_parallel:
            return F.dropout(x, self.dropout, self.training)
        with self.tp.rng.fork() if self.dropout > 0 and self.training else nullcontext():
            return F.dropout(x, self.dropout, self.training)


def layer_tp(tp: TensorParallel, config: ModelConfig, layer_number: int) -> TensorParallel:
    """The TensorParallel a transformer layer builds its GEMMs with: ``tp``, or a copy in the model's
    precision for a layer that --first-last-layers-bf16 keeps out of FP8."""
    if config.fp8_layer(layer_number) or config.fp8_format is None:
        return tp
    return dataclasses.replace(tp, gemm_recipe=high_precision_recipe(tp.gemm_recipe))


def sequence_first(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """[b, s, h] -> [s, b, h], this rank's sequence shard of it under sequence parallelism."""
    x = x.transpose(0, 1).contiguous()
    return scatter_to_sp_region(x, tp.group) if tp.sequence_parallel else x


class GPTModel(nn.Module):
    def __init__(self, config: ModelConfig, seed: int = 1234, pre_process: bool = True,
                 post_process: bool = True, layer_offset: int = 0, num_local_layers: int | None = None,
                 tp: TensorParallel | None = None, cp: ContextParallel | None = None, meta: bool = False,
                 moe: MoEContext | None = None):
        """``meta``: build the parameters without storage (sharded start-up); each gets ``init_values(start,
        end)`` and building the data-parallel backend materialises only this rank's elements on its
        device. ``moe``: the expert grid of the MoE layers (default: all experts in this process)."""
        super().__init__()
        self.config = config
        self.tp = tp = tp or TensorParallel()
        self.cp = cp = cp or ContextParallel()
        self.moe = moe or MoEContext(ExpertParallel()) if config.num_experts else None
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_offset = layer_offset
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        dtype = DTYPES[config.params_dtype]
        n_local = config.num_layers if num_local_layers is None else num_local_layers

        yarn = Yarn.from_config(config) if config.uses_yarn else None
        self.rotary = (RotaryEmbedding(config.rotary_head_dim, config.rotary_base, config.max_position_embeddings,
                                       config.rotary_percent, yarn)
                       if config.use_rope else None)
        with torch.device("meta") if meta else nullcontext():
            self.embedding = Embedding(config, dtype, tp) if pre_process else None
            self.decoder = nn.Module()
            self.decoder.layers = nn.ModuleList(
                TransformerLayer(config, layer_offset + i + 1, dtype, layer_tp(tp, config, layer_offset + i + 1), cp,
                                 self.moe) for i in range(n_local))
            if post_process:
                self.decoder.final_layernorm = build_norm(config, dtype, tp)
                if not (self.share_embeddings_and_output_weights and pre_process):
                    # tied and on a later pipeline stage: a copy of the word embeddings, initialised equal
                    # (same global name) and kept equal by summing both gradients over the embedding group
                    self.output_layer = ColumnParallelLinear(config.hidden_size, config.padded_vocab_size, False,
                                                             dtype, tp, gemm_recipe=high_precision_recipe(tp.gemm_recipe))
                else:   # the head reads the word embeddings: the model owns the logits GEMM's precision
                    self.output_precision = build_gemm_precision(high_precision_recipe(tp.gemm_recipe))
            self.mtp = None
            if post_process and config.mtp_num_layers:
                self.mtp = MultiTokenPrediction(config, dtype, tp, cp, self.moe)
                if not (pre_process or self.share_embeddings_and_output_weights):
                    # the MTP depths' copy of the word embeddings on a later pipeline stage, kept equal as
                    # a tied output layer is (a tied one serves as the copy itself)
                    self.mtp_embedding = VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size,
                                                                dtype, tp)
        self.mark_shared_embeddings()
        if meta:
            self.attach_initial_values(seed)
        else:
            self.reset_parameters(seed)

    def mark_shared_embeddings(self) -> None:
        """Megatron's markers for the word embeddings that a later pipeline stage also holds (as the tied
        output layer, or for the MTP depths): ``shared_embedding`` on both copies (their gradients are
        summed over the embedding group), ``shared`` on the second copy (counted once in the norm, stored
        once in checkpoints)."""
        if not (self.share_embeddings_and_output_weights or self.config.mtp_num_layers):
            return
        if self.pre_process:
            mark(self.embedding.word_embeddings.weight, shared_embedding=True)
        if self.post_process and not self.pre_process:
            mark(self.last_stage_embedding(), shared_embedding=True, shared=True)

    def last_stage_embedding(self) -> torch.Tensor:
        """The word embeddings as the stage with the loss holds them: the embedding's own on the first
        stage, else the tied output layer or the MTP depths' copy."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.share_embeddings_and_output_weights:
            return self.output_layer.weight
        return self.mtp_embedding.weight

    # ---- parameters -------------------------------------------------------------------------
    def global_name(self, local_name: str) -> str:
        """Parameter name in the whole (unsplit) model: layer indices shifted by this stage's offset."""
        if local_name.startswith("decoder.layers."):
            index, rest = local_name[len("decoder.layers."):].split(".", 1)
            return f"decoder.layers.{int(index) + self.layer_offset}.{rest}"
        if local_name == "output_layer.weight" and self.share_embeddings_and_output_weights:
            return "embedding.word_embeddings.weight"
        if local_name == "mtp_embedding.weight":
            return "embedding.word_embeddings.weight"
        return local_name

    def reset_parameters(self, seed: int) -> None:
        for name, param in self.named_parameters():
            initialize_parameter(param, self.global_name(name), self.config.init_method_std,
                                 self.config.num_layers, seed)

    def attach_initial_values(self, seed: int) -> None:
        """Give each (storage-less) parameter ``init_values(start, end)``: its initial elements [start, end)."""
        for name, param in self.named_parameters():
            mark(param, init_values=partial(initial_values, param, self.global_name(name),
                                            self.config.init_method_std, self.config.num_layers, seed))

    def transformer_layers(self) -> list[TransformerLayer]:
        """This chunk's transformer layers in layer order: the decoder's, then the MTP depths'."""
        mtp = [depth.transformer_layer for depth in self.mtp.layers] if self.post_process and self.mtp else []
        return list(self.decoder.layers) + mtp

    def moe_routers(self) -> list:
        """The routers of this chunk's MoE layers, in layer order."""
        return [layer.mlp.router for layer in self.transformer_layers() if isinstance(layer.mlp, MoELayer)]

    def output_weight(self) -> torch.Tensor:
        if self.share_embeddings_and_output_weights and self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def output_gemm(self) -> GemmPrecision:
        """The logits GEMM's precision: the output layer's, or the model's own for a tied head."""
        if self.share_embeddings_and_output_weights and self.pre_process:
            return self.output_precision
        return self.output_layer.precision

    def data_parallel_units(self) -> list[ModuleUnit]:
        """This chunk's module units in forward order, for the data-parallel backends: the embedding (its
        backward reads only the token ids), each transformer layer, and the head (final norm through the
        whole forward, which computes the logits with the output weight). The MTP depths run between the
        last layer and the head, each a unit that reads the word embeddings."""
        units = []
        if self.pre_process:
            units.append(ModuleUnit("embedding", self.embedding, self.embedding, gather_in_backward=False))
        units += [ModuleUnit(f"layer{i}", layer, layer, layer=True) for i, layer in enumerate(self.decoder.layers)]
        if self.post_process and self.mtp is not None:
            units += [ModuleUnit(f"mtp{k}", depth, depth, reads=(self.last_stage_embedding(),), layer=True)
                      for k, depth in enumerate(self.mtp.layers)]
        if self.post_process:
            units.append(ModuleUnit("head", self.decoder.final_layernorm, self, reads=(self.output_weight(),)))
        return units

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, cu_seqlens: torch.Tensor | None = None,
                mtp_tokens: torch.Tensor | None = None, mtp_labels: torch.Tensor | None = None):
        """First stage takes ``input_ids`` [b, s]; later stages take ``hidden_states`` [s, b, h].

        ``position_ids`` [b, s]: the learned position embeddings' positions, and with
        --reset-position-ids RoPE's too (every stage needs them then). ``cu_seqlens``: the batch's
        document boundaries (int32 [b, n + 1], whole under context parallelism), which every attention
        call keeps each token within; None: each sample is one document.

        Last stage returns per-token losses [b, s] when ``labels`` are given, else logits [b, s, V];
        other stages return hidden states [s, b, h].

        With ``kv_cache`` (inference on a whole model at TP size 1), ``input_ids`` are the tokens after
        the ``kv_cache.length`` cached ones: they get positions from there and attend to the cache,
        and the cache grows by them.

        ``mtp_tokens`` and ``mtp_labels`` [b, s, D] (model/mtp.py's mtp_targets, last stage, with
        ``labels``): the MTP depths run too, and the last stage returns (per-token losses [b, s], the
        depths' per-token losses [D, b, s]).
        """
        positions = None
        if kv_cache is not None:
            positions = self.cached_positions(input_ids, kv_cache)
            if position_ids is None:
                position_ids = positions[None]
        x = self.embedding(input_ids, position_ids) if self.pre_process else hidden_states
        inputs = AttentionInputs(self.rotary_tables(x, positions, position_ids, kv_cache), cu_seqlens)
        # sequence parallelism: each TP rank's hidden dropout acts on its own sequence shard, so the whole
        # stack draws from the rank's model-parallel stream, not the default one shared by the TP ranks
        with self.tp.rng.fork() if self.tp.sequence_parallel and self.tp.rng is not None else nullcontext():
            x = self.run_layers(x, inputs, kv_cache)
            mtp_hidden = None
            if self.post_process and mtp_labels is not None and labels is not None:
                mtp_hidden = self.mtp.hidden_states(x, mtp_tokens, inputs, self.embed_for_mtp)
        if kv_cache is not None:
            kv_cache.length += x.shape[0]
        if not self.post_process:
            return x
        per_token = self.head(self.decoder.final_layernorm(x), labels)
        if mtp_hidden is None:
            return per_token
        return per_token, torch.stack([self.head(h, mtp_labels[..., k]) for k, h in enumerate(mtp_hidden)])

    def embed_for_mtp(self, ids: torch.Tensor) -> torch.Tensor:
        """[b, s] ids -> [s(/tp), b, h]: the word embeddings (MTP runs with RoPE: no position embeddings)
        and the embedding's dropout (inside the forward's RNG fork under sequence parallelism)."""
        per_rank = self.config.padded_vocab_size // self.tp.size
        x = reduce_from_tp_region(vocab_parallel_lookup(ids, self.last_stage_embedding(), self.tp, per_rank),
                                  self.tp.group)
        return F.dropout(sequence_first(x, self.tp), self.config.hidden_dropout, self.training)

    def head(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Final-normed [s(/tp), b, h] -> per-token losses [b, s] against ``labels``, or logits [b, s, V]."""
        logits = parallel_logits(x, self.output_weight(), self.tp, self.output_gemm())      # [s, b, V/tp]
        vocab_start = self.tp.rank * logits.shape[-1]
        mask_padded_vocabulary(logits, vocab_start, self.config.vocab_size)
        if labels is None:     # [b, s, V] over the tokenizer's true vocabulary (padding dropped)
            logits = gather_from_tp_region(logits, self.tp.group).transpose(0, 1)
            return logits[..., :self.config.vocab_size] if self.config.vocab_size > 0 else logits
        return vocab_parallel_cross_entropy(logits, labels.t(), self.tp.group, vocab_start,
                                            fused=self.config.cross_entropy_loss_fusion).t()

    def rotary_tables(self, x: torch.Tensor, cached: torch.Tensor | None, position_ids: torch.Tensor | None,
                      kv_cache: KVCache | None):
        """RoPE's (cos, sin) for this rank's tokens (None without RoPE): per sample from ``position_ids``
        with --reset-position-ids (already this rank's chunks under context parallelism); else shared by
        the batch: this rank's two chunks of the sequence under context parallelism, the ``cached``
        positions after a KV cache, or 0..s-1."""
        if self.rotary is None:
            return None
        if self.config.reset_position_ids and position_ids is not None and kv_cache is None:
            return self.rotary.batch_tables(position_ids, x.dtype)
        full_seq = x.shape[0] * (self.tp.size if self.tp.sequence_parallel else 1)
        if self.cp.size > 1:
            cached = local_positions(full_seq * self.cp.size, self.cp.rank, self.cp.size, self.rotary.cos.device)
        return self.rotary.tables(cached, full_seq, x.dtype)

    def cached_positions(self, input_ids: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """Absolute positions [s] of the tokens following the cached ones (checked to fit)."""
        if self.tp.size > 1 or self.cp.size > 1 or not (self.pre_process and self.post_process):
            raise UserError("generation with a KV cache needs the whole model in one process "
                            "(tensor, context and pipeline parallel size 1)")
        start, end = kv_cache.length, kv_cache.length + input_ids.shape[1]
        limit = min(kv_cache.max_length, self.config.max_position_embeddings)
        if end > limit:
            raise UserError(f"{end} tokens do not fit: the model has --max-position-embeddings "
                            f"{self.config.max_position_embeddings} and the KV cache holds {kv_cache.max_length}")
        return torch.arange(start, end, device=input_ids.device)

    def run_layers(self, x: torch.Tensor, inputs: AttentionInputs, kv_cache: KVCache | None = None) -> torch.Tensor:
        """The layer stack, with full activation recomputation where --recompute-granularity full asks.

        uniform: every chunk of --recompute-num-layers layers is checkpointed as one unit;
        block: the first --recompute-num-layers layers of this stage are checkpointed, the rest not.
        """
        layers = list(self.decoder.layers)
        cfg = self.config
        if cfg.recompute_granularity != "full" or not self.training or kv_cache is not None:
            for layer in layers:
                x = layer(x, inputs, kv_cache)
            return x
        n = cfg.recompute_num_layers or 1
        if cfg.recompute_method == "block":
            for i, layer in enumerate(layers):
                x = checkpoint(layer, x, inputs, tracker=self.tp.rng) if i < n else layer(x, inputs)
            return x
        for start in range(0, len(layers), n):
            chunk = layers[start:start + n]
            x = checkpoint(_run_chunk(chunk), x, inputs, tracker=self.tp.rng)
        return x


def mask_padded_vocabulary(logits: torch.Tensor, vocab_start: int, true_vocab_size: int) -> None:
    """Set logits of padding ids (>= the tokenizer's vocabulary) to -inf, in place.

    The padded size depends on the TP size (Megatron pads to a multiple of divisible-by x tp); masking
    keeps padding out of the softmax, so the loss is the same at every layout and equals the loss over
    the true vocabulary (as in Hugging Face models).
    """
    if true_vocab_size <= 0:
        return
    first_padding = max(0, true_vocab_size - vocab_start)
    if first_padding < logits.shape[-1]:
        logits[..., first_padding:] = float("-inf")


def _run_chunk(layers):
    def run(x, inputs):
        for layer in layers:
            x = layer(x, inputs)
        return x
    return run
