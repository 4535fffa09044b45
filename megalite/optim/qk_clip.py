"""QK-clip (MuonClip, Kimi K2; --qk-clip) and the max attention logit of --log-max-attention-logit, run by
the optimizer after its update rule, with any rule (Muon or AdamW).

Each attention layer records its per-head max logit over the step's forwards (model/attention/
logit_clip.py). After the update: one all-reduce MAX over the data x context-parallel group completes every
layer's maxima (each rank saw its own samples and, under context parallelism, its own queries); with
--qk-clip each rescale unit (a query group under GQA, whose key its heads share: the largest logit of its
heads; a head under MLA) takes eta = threshold / max logit where the max exceeds the threshold, else 1, and
each row of the layer's query/key weights is multiplied by eta to its power (QKRows). Nothing is read on the
host: every factor is a device tensor, 1 where no head is clipped.

The rescale acts on the fp32 master weights this rank updates, whatever part of a parameter they hold
(ZeRO's equal slices cut rows; the whole-parameter layout holds whole ones): each master piece is a range
of the flat layout, and a parameter's slot there is its elements in row-major order, so an element's row is
its offset in the slot divided by the row length. The optimizer then copies the masters into the model and
shares them (the ZeRO all-gather) as after any update, so model and masters agree. Biases of the query and
key rows (--add-qkv-bias) are rescaled with their weights, so that q.k scales exactly by eta.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalite.config.schema import ModelConfig
from megalite.model.attention import ATTENTION
from megalite.model.attention.logit_clip import QKRows
from megalite.optim.master_weights import MasterWeights
from megalite.parallel.data.protocol import FlatLayout

LOGGED = "max attention logit"          # the log line's and metrics' key


class QKClip:
    """The attention layers of ``chunks`` that record their max logit (model/attention/logit_clip.py), and
    with ``clip`` their QK-clip. ``group``: the data x context-parallel group (None: one rank)."""

    def __init__(self, chunks: list[nn.Module], buffer: FlatLayout, named_params, config: ModelConfig, group=None):
        self.layers = [m for chunk in chunks for m in chunk.modules()
                       if isinstance(m, tuple(ATTENTION.values())) and m.max_logits is not None]
        self.heads = [m.num_heads for m in self.layers]
        self.threshold, self.group, self.clip = config.qk_clip_threshold, group, config.qk_clip
        self.layouts: list[QKRows] = [m.qk_rows(config.qk_clip_alpha) for m in self.layers] if self.clip else []
        names = {id(p): n for n, p in named_params}
        # per layer: (flat start, flat end, row length, unit of each row, power of each row) of each parameter
        self.slots = [[_slot(buffer.slots[names[id(p)]], unit, power) for p, unit, power in layout.rows]
                      for layout in self.layouts]
        self.last_max: torch.Tensor | None = None       # the model's max logit of the last step on this rank

    @torch.no_grad()
    def after_update(self, weights: MasterWeights) -> None:
        """Complete the step's per-head maxima over data x context parallelism, keep their maximum for the
        log and, with --qk-clip, rescale the query/key rows of ``weights``' masters; every layer starts
        recording the next step."""
        if not self.layers:
            return
        taken = [m.max_logits.take() for m in self.layers]
        device = self.layers[0].linear_proj.weight.device
        maxima = torch.cat([torch.full((h,), float("-inf"), device=device) if t is None else t
                            for t, h in zip(taken, self.heads)])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.group)
        self.last_max = maxima.max()
        if self.clip:
            units = self._with_sharers([unit_max(m, layout) for m, layout in zip(maxima.split(self.heads),
                                                                                  self.layouts)])
            for layer_units, slots in zip(units, self.slots):
                self._rescale(weights, balancing_eta(layer_units, self.threshold), slots)

    def _with_sharers(self, units: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each layer's unit maxima, over the TP ranks that share its key heads (QKRows.sharers): one
        all-gather over TP of every such layer's maxima."""
        shared = [i for i, layout in enumerate(self.layouts) if layout.sharers is not None]
        if not shared:
            return units
        group, first, count = self.layouts[shared[0]].sharers
        local = torch.cat([units[i] for i in shared])
        gathered = local.new_empty(dist.get_world_size(group) * local.numel())
        dist.all_gather_into_tensor(gathered, local, group=group)
        mine = gathered.view(-1, local.numel())[first:first + count].amax(0).split([units[i].numel() for i in shared])
        return [mine[shared.index(i)] if i in shared else u for i, u in enumerate(units)]

    @staticmethod
    def _rescale(weights: MasterWeights, eta: torch.Tensor, slots: list) -> None:
        for start, end, cols, unit, power in slots:
            scale = eta[unit].pow(power)                     # per row of the parameter
            for piece, master in zip(weights.pieces, weights.masters):
                lo, hi = max(start, piece.start), min(end, piece.end)
                if lo < hi:
                    scale_rows(master[lo - piece.start:hi - piece.start], scale, lo - start, cols)

    def report(self, device: torch.device, world_size: int) -> dict[str, float]:
        """The model's max attention logit of the last step, over all ranks (every rank calls it at the same
        log iterations: one all-reduce of a number and the one host read)."""
        value = (self.last_max if self.last_max is not None else torch.tensor(float("-inf"))).reshape(1).to(device)
        if world_size > 1:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return {LOGGED: float(value)}


def _slot(slot, unit: torch.Tensor, power: torch.Tensor) -> tuple:
    """A parameter's (flat start, flat end, row length, unit and power of each row); the row length from
    its slot, which holds its rows whole (a ZeRO-3 parameter's own tensor may be released)."""
    return slot.start, slot.end, (slot.end - slot.start) // unit.numel(), unit, power


def unit_max(head_max: torch.Tensor, layout: QKRows) -> torch.Tensor:
    """fp32 [units]: the largest max logit of each unit's heads (a GQA group's; an MLA head's own)."""
    init = torch.full((layout.units,), float("-inf"), device=head_max.device)
    return init.scatter_reduce(0, layout.head_unit, head_max, reduce="amax")


def balancing_eta(max_logit: torch.Tensor, threshold: float) -> torch.Tensor:
    """eta = min(threshold / max logit, 1): exactly 1 where the max logit does not exceed the threshold
    (also where no logit was seen: -inf)."""
    return torch.where(max_logit > threshold, threshold / max_logit, torch.ones_like(max_logit))


def scale_rows(flat: torch.Tensor, scale: torch.Tensor, first: int, cols: int) -> None:
    """Multiply ``flat``, elements [first, first + len) of a row-major parameter with rows of ``cols``
    elements, by ``scale[row]`` of each element's row, in place: a partial first row, whole rows, a partial
    last row."""
    end = first + flat.numel()
    r0, r1 = -(-first // cols), end // cols                  # the whole rows inside
    if r0 > r1:                                              # inside one row
        flat.mul_(scale[first // cols])
        return
    head = r0 * cols - first
    if head:
        flat[:head].mul_(scale[r0 - 1])
    body = (r1 - r0) * cols
    flat[head:head + body].view(r1 - r0, cols).mul_(scale[r0:r1, None])
    if head + body < flat.numel():
        flat[head + body:].mul_(scale[r1])


def build_qk_clip(chunks: list[nn.Module], buffer: FlatLayout, named_params, config: ModelConfig,
                  parallel=None) -> QKClip | None:
    """The run's QKClip when --qk-clip or --log-max-attention-logit asks for it, else None."""
    if not config.records_max_logit:
        return None
    return QKClip(chunks, buffer, named_params, config, None if parallel is None else parallel.group("dp_cp"))
