"""Multi-token prediction (DeepSeek-V3, --mtp-num-layers D): D extra depths after the main model, on the
last pipeline stage, each predicting one token further ahead.

Depth k = 0..D-1 at position t takes two inputs: h, the main model's last hidden state (before its final
norm) for k = 0, else depth k-1's output (its transformer layer's, before its final norm); and the word
embedding of token t+k+1. It computes

    h' = eh_proj(cat([enorm(emb(token t+k+1)), hnorm(h)]))      eh_proj: [h, 2h], column-parallel
    h_k = transformer_layer(h')                                   of the main model's last layer's kind
    loss_k = cross-entropy(output_head(final_layernorm(h_k)), token t+k+2)

with the main model's word embedding and output head (shared). Inputs and targets are the batch's shifted
left by k+1 (``mtp_targets``): depth k at position t reads tokens[t+k+1] and predicts labels[t+k+1] with
loss_mask[t+k+1]; positions whose shifted source falls past the sample, or into another document under
document masks (cu_seqlens), have no target (mask 0). The shift is made on whole sequences, before context
parallelism cuts them into chunks, so no rank needs a neighbour's tokens.

The training objective is lm_loss + --mtp-loss-scaling-factor x mean_k(loss_k), each loss_k the masked mean
over its positions with a target, reduced like the lm loss (context_parallel_loss). As in Megatron, the
MTP term enters only the gradient: the loss value the step reports (and validation, which skips the MTP
depths) stays the lm loss, and the MTP losses are logged on their own (``MTPLosses``, train/metrics.py).
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.config.schema import ModelConfig
from megalite.model.attention.inputs import AttentionInputs
from megalite.model.norms import build_norm
from megalite.model.transformer import TransformerLayer
from megalite.parallel.context.ring_attention import ContextParallel, context_parallel_loss
from megalite.parallel.expert.dispatch import MoEContext
from megalite.parallel.tensor.layers import ColumnParallelLinear, TensorParallel
from megalite.parallel.tensor.mappings import scatter_to_sp_region
from megalite.parallel.tensor.random import checkpoint


class MTPLayer(nn.Module):
    """One depth: enorm, hnorm, eh_proj, transformer_layer, final_layernorm (Megatron-Core's names)."""

    def __init__(self, config: ModelConfig, depth: int, dtype: torch.dtype, tp: TensorParallel,
                 cp: ContextParallel | None, moe: MoEContext | None):
        super().__init__()
        self.tp = tp
        self.recompute = config.recompute_granularity == "full"
        h = config.hidden_size
        self.enorm = build_norm(config, dtype, tp)
        self.hnorm = build_norm(config, dtype, tp)
        # column-parallel with its output gathered: every rank gets the whole [s, b, h]
        self.eh_proj = ColumnParallelLinear(2 * h, h, False, dtype, tp, gather_output=True)
        # built as the main model's last layer (its attention window, MLP or MoE, CP comm type); numbered
        # after the main model's layers
        self.transformer_layer = TransformerLayer(config, config.num_layers, dtype, tp, cp, moe)
        self.transformer_layer.layer_number = config.num_layers + depth + 1
        self.final_layernorm = build_norm(config, dtype, tp)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, inputs: AttentionInputs,
                embed) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` [s(/tp), b, h], ``tokens`` [b, s] (the shifted ids), ``embed``: ids -> [s(/tp), b, h].
        Returns (the transformer layer's output, the next depth's input; its final-normed form)."""
        x = torch.cat([self.enorm(embed(tokens)), self.hnorm(hidden)], dim=-1)
        x = self.eh_proj(x)
        if self.tp.sequence_parallel:      # back to this rank's sequence shard
            x = scatter_to_sp_region(x, self.tp.group)
        if self.recompute and self.training:
            x = checkpoint(self.transformer_layer, x, inputs, tracker=self.tp.rng)
        else:
            x = self.transformer_layer(x, inputs)
        return x, self.final_layernorm(x)


class MultiTokenPrediction(nn.Module):
    """The D depths (``layers``), their loss term and the running sums of their losses for the log."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel, cp: ContextParallel | None,
                 moe: MoEContext | None):
        super().__init__()
        self.depth = config.mtp_num_layers
        self.scale = config.mtp_loss_scaling_factor
        self.layers = nn.ModuleList(MTPLayer(config, k, dtype, tp, cp, moe) for k in range(self.depth))
        self.loss_sums = None           # [D + 1] float64 on the device: each depth's losses, micro-batches

    def hidden_states(self, hidden: torch.Tensor, tokens: torch.Tensor, inputs: AttentionInputs,
                      embed) -> list[torch.Tensor]:
        """Each depth's final-normed output [s(/tp), b, h], for the shared head; ``tokens`` [b, s, D]."""
        out = []
        for k, layer in enumerate(self.layers):
            hidden, normed = layer(hidden, tokens[..., k], inputs, embed)
            out.append(normed)
        return out

    def loss_term(self, per_token: torch.Tensor, loss_mask: torch.Tensor, cp: ContextParallel | None,
                  weight: torch.Tensor | None = None) -> torch.Tensor:
        """A 0-valued term carrying the gradient of scale x mean_k(loss_k); ``per_token`` [D, b, s], ``loss_mask``
        [b, s, D]. Adds each loss_k (times the micro-batch's ``weight`` under --calculate-per-token-loss, as
        the lm loss) to ``loss_sums``."""
        losses = torch.stack([context_parallel_loss(per_token[k], loss_mask[..., k], cp)[0]
                              for k in range(self.depth)])
        self.record(losses.detach() if weight is None else losses.detach() * weight)
        total = self.scale * losses.mean()
        return total - total.detach()

    @torch.no_grad()
    def record(self, losses: torch.Tensor) -> None:
        if self.loss_sums is None:
            self.loss_sums = torch.zeros(self.depth + 1, dtype=torch.float64, device=losses.device)
        self.loss_sums[:-1] += losses.double()
        self.loss_sums[-1] += 1

    def take_loss_sums(self) -> torch.Tensor | None:
        """The sums since the last call (None before the first micro-batch), and a fresh start."""
        sums, self.loss_sums = self.loss_sums, None
        return sums

    def with_targets(self, batch: dict) -> dict:
        return {**batch, **mtp_targets(batch, self.depth)}


def mtp_targets(batch: dict, depth: int) -> dict:
    """The depths' inputs, labels and loss masks ([b, s, depth] each) from a micro-batch's whole sequences:
    column k holds tokens, labels and loss_mask shifted left by k+1, masked (0) where the source position
    t+k+1 is past the sample or, with ``cu_seqlens``, in another document than t."""
    tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    b, s = tokens.shape
    stream = torch.cat([tokens, labels[:, -1:]], dim=1)            # tokens 0..s (labels[s-1] is token s)
    positions = torch.arange(s, device=tokens.device)
    documents = None
    if batch.get("cu_seqlens") is not None:
        bounds = torch.as_tensor(batch["cu_seqlens"]).long()
        documents = torch.searchsorted(bounds, positions.expand(b, s).contiguous(), right=True) - 1
    inputs, targets, masks = [], [], []
    for k in range(depth):
        source = positions + k + 1
        inside = (source < s).expand(b, s)
        source = source.clamp(max=s - 1)
        if documents is not None:
            inside = inside & (documents.gather(1, source.expand(b, s)) == documents)
        inputs.append(stream[:, (positions + k + 1).clamp(max=s)])
        targets.append(labels[:, source])
        masks.append(loss_mask[:, source] * inside)
    return {"mtp_tokens": torch.stack(inputs, -1), "mtp_labels": torch.stack(targets, -1),
            "mtp_loss_mask": torch.stack(masks, -1)}
