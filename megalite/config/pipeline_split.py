"""How many transformer layers each virtual pipeline stage holds (torch-free: the config rules and the
planner read it too).

Layers are split over pp x vpp virtual stages; virtual stage v = chunk * pp + pp_rank holds the layers
after those of virtual stages 0..v-1. The first virtual stage also embeds, the last also normalises,
projects to the vocabulary and computes the loss. How many layers each virtual stage holds follows
Megatron's flags (``virtual_stage_layers``): an even split by default, or

- ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``: the first / last
  pipeline rank holds that many, the middle ranks split the rest evenly (it must divide); with virtual
  stages (``--num-virtual-stages-per-pipeline-rank``) each rank's layers divide evenly over its chunks;
- ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``: the
  embedding / the loss count as one layer each, so num_layers + 1 (+ 1) splits evenly and the first /
  last virtual stage builds one transformer layer fewer;
- ``--pipeline-model-parallel-layout``: every virtual stage spelled out ("Et*3|(tt|)*29,mL"); m, the
  multi-token prediction layers, only in the last stage, which holds them with the output layer.
Layers keep their global index whatever the split, so checkpoints reshard between splits.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from megalite.config.schema import ParallelConfig
from megalite.errors import UserError

LAYOUT_FLAG = "--pipeline-model-parallel-layout"


@dataclass(frozen=True)
class SplitFlags:
    """Megatron's flags that shape the split of the layers over pipeline stages (defaults: even)."""
    layers_per_virtual_stage: int | None = None     # --num-layers-per-virtual-pipeline-stage
    virtual_stages_per_rank: int | None = None      # --num-virtual-stages-per-pipeline-rank
    first: int | None = None                        # --decoder-first-pipeline-num-layers
    last: int | None = None                         # --decoder-last-pipeline-num-layers
    account_for_embedding: bool = False             # --account-for-embedding-in-pipeline-split
    account_for_loss: bool = False                  # --account-for-loss-in-pipeline-split
    layout: str | None = None                       # --pipeline-model-parallel-layout

    @classmethod
    def of(cls, parallel: ParallelConfig) -> "SplitFlags":
        """The split a ParallelConfig asks for, with what its schedule implies: zbv builds two chunks per
        rank unless a count or a layout is given (the planner's command line uses the same names)."""
        split = cls(parallel.num_layers_per_virtual_pipeline_stage, parallel.num_virtual_stages_per_pipeline_rank,
                    parallel.decoder_first_pipeline_num_layers, parallel.decoder_last_pipeline_num_layers,
                    bool(parallel.account_for_embedding_in_pipeline_split),
                    bool(parallel.account_for_loss_in_pipeline_split), parallel.pipeline_model_parallel_layout)
        if parallel.pipeline_schedule == "zbv" and split.virtual_stages_per_rank is None and split.layout is None:
            return replace(split, virtual_stages_per_rank=2)
        return split

    def given(self) -> list[str]:
        """The flags set, by name."""
        names = [("--num-layers-per-virtual-pipeline-stage", self.layers_per_virtual_stage),
                 ("--num-virtual-stages-per-pipeline-rank", self.virtual_stages_per_rank),
                 ("--decoder-first-pipeline-num-layers", self.first),
                 ("--decoder-last-pipeline-num-layers", self.last),
                 ("--account-for-embedding-in-pipeline-split", self.account_for_embedding or None),
                 ("--account-for-loss-in-pipeline-split", self.account_for_loss or None),
                 (LAYOUT_FLAG, self.layout)]
        return [name for name, value in names if value is not None]


def stage_layers_of(num_layers: int, parallel: ParallelConfig) -> list[int]:
    """Transformer layers of each virtual stage for ``parallel``'s flags and schedule."""
    return virtual_stage_layers(num_layers, parallel.pipeline_model_parallel_size, SplitFlags.of(parallel))


def virtual_stage_layers(num_layers: int, pp: int, split: SplitFlags = SplitFlags()) -> list[int]:
    """Transformer layers of each virtual stage, in virtual-stage order (v = chunk * pp + pp_rank;
    pp x vpp entries), or a one-line UserError naming the flag and the fix (Megatron's rules)."""
    if split.layers_per_virtual_stage is not None and split.virtual_stages_per_rank is not None:
        raise UserError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank both set "
                        "the virtual stages; give one")
    if (split.layers_per_virtual_stage or split.virtual_stages_per_rank) and pp == 1:
        flag = split.given()[0]
        raise UserError(f"{flag} needs --pipeline-model-parallel-size > 1")
    if split.layout is not None:
        return _layout_layers(num_layers, pp, split)
    if split.first is not None or split.last is not None:
        return _first_last_layers(num_layers, pp, split)
    return _even_layers(num_layers, pp, split)


def _virtual_stages(per_rank: int, split: SplitFlags, what: str) -> int:
    """vpp from --num-layers-per-virtual-pipeline-stage (dividing ``per_rank``) or
    --num-virtual-stages-per-pipeline-rank."""
    if split.layers_per_virtual_stage is not None:
        if per_rank % split.layers_per_virtual_stage:
            raise UserError(f"{what} must be divisible by --num-layers-per-virtual-pipeline-stage "
                            f"{split.layers_per_virtual_stage}")
        return per_rank // split.layers_per_virtual_stage
    return split.virtual_stages_per_rank or 1


def _even_layers(num_layers: int, pp: int, split: SplitFlags) -> list[int]:
    extra = int(split.account_for_embedding) + int(split.account_for_loss)
    if (num_layers + extra) % pp:
        if not extra:
            raise UserError(f"--num-layers {num_layers} must be divisible by --pipeline-model-parallel-size {pp} "
                            "(or split unevenly with --decoder-first/last-pipeline-num-layers or "
                            f"{LAYOUT_FLAG})")
        accounted = " + ".join(f for f, on in (("embedding", split.account_for_embedding),
                                                ("loss", split.account_for_loss)) if on)
        raise UserError(f"--num-layers {num_layers} + 1 for each of {accounted} (--account-for-...-in-pipeline-split) "
                        f"= {num_layers + extra} must be divisible by --pipeline-model-parallel-size {pp}")
    per_rank = (num_layers + extra) // pp
    what = (f"--num-layers {num_layers} / --pipeline-model-parallel-size {pp} = {per_rank} layers per stage" if not extra
            else f"{per_rank} layers per stage (counting the embedding / loss as layers)")
    vpp = _virtual_stages(per_rank, split, what)
    if per_rank % vpp:
        raise UserError(f"{what} must be divisible by --num-virtual-stages-per-pipeline-rank {vpp}")
    layers = [per_rank // vpp] * (pp * vpp)
    if split.account_for_embedding:
        layers[0] -= 1                  # the embedding takes one layer's place on the first virtual stage
    if split.account_for_loss:
        layers[-1] -= 1                 # and the output layer with the loss one on the last
    if min(layers) < 0:
        raise UserError(f"--account-for-embedding/loss-in-pipeline-split: {per_rank // vpp} layer(s) per virtual "
                        "stage leave no room for both the embedding and the loss on one stage; use fewer stages")
    return layers


def _first_last_layers(num_layers: int, pp: int, split: SplitFlags) -> list[int]:
    named = [(flag, n) for flag, n in (("--decoder-first-pipeline-num-layers", split.first),
                                       ("--decoder-last-pipeline-num-layers", split.last)) if n is not None]
    if pp == 1:
        raise UserError(f"{named[0][0]} needs --pipeline-model-parallel-size > 1")
    if split.account_for_embedding or split.account_for_loss:
        raise UserError(f"{named[0][0]} cannot be combined with --account-for-embedding/loss-in-pipeline-split "
                        "(Megatron's rule); give the first/last stage fewer layers instead")
    if split.layers_per_virtual_stage is not None:
        raise UserError(f"{named[0][0]} with virtual stages needs --num-virtual-stages-per-pipeline-rank "
                        "instead of --num-layers-per-virtual-pipeline-stage")
    vpp = split.virtual_stages_per_rank or 1
    for flag, n in named:
        if n <= 0:
            raise UserError(f"{flag} must be at least 1, got {n}")
        if n % vpp:
            raise UserError(f"{flag} {n} must be divisible by --num-virtual-stages-per-pipeline-rank {vpp}")
    middle_ranks = pp - len(named)
    middle_layers = num_layers - sum(n for _, n in named)
    flags = " and ".join(f"{flag} {n}" for flag, n in named)
    if middle_layers < 0 or (middle_ranks == 0 and middle_layers):
        raise UserError(f"{flags} must add up to --num-layers {num_layers}" + (" or less" if middle_ranks else "")
                        + "; change the first/last counts")
    if middle_ranks and (middle_layers < middle_ranks or middle_layers % middle_ranks):
        raise UserError(f"--num-layers {num_layers} minus {flags} leaves {middle_layers} layers, which the {middle_ranks} "
                        "middle pipeline stages must split evenly (at least one each); change the first/last counts")
    per_rank = [middle_layers // middle_ranks if middle_ranks else 0] * pp
    if split.first is not None:
        per_rank[0] = split.first
    if split.last is not None:
        per_rank[-1] = split.last
    if per_rank[1 if split.first is not None else 0] % vpp:
        raise UserError(f"{per_rank[1 if split.first is not None else 0]} layers per middle pipeline stage must be "
                        f"divisible by --num-virtual-stages-per-pipeline-rank {vpp}")
    return [per_rank[rank] // vpp for _ in range(vpp) for rank in range(pp)]


def parse_layout(layout: str) -> list[str]:
    """Megatron's layout string as one string of symbols per virtual stage: stages split by "|", commas
    cosmetic, "(...)*n" and "x*n" repeat (parentheses unrolled first, not nested)."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return text.split("|")


def _layout_layers(num_layers: int, pp: int, split: SplitFlags) -> list[int]:
    flag = f"{LAYOUT_FLAG} {split.layout!r}"
    others = [name for name in split.given() if name != LAYOUT_FLAG]
    if others:
        raise UserError(f"{LAYOUT_FLAG} places every layer itself; drop {others[0]}")
    stages = parse_layout(split.layout)
    symbols = "".join(stages)
    unknown = sorted(set(symbols) - set("EtmL"))
    if unknown:
        raise UserError(f"{flag}: unknown symbol {unknown[0]!r}; use E (embedding), t (transformer layer), L (loss), "
                        "| between stages, x*n and (...)*n to repeat")
    if "m" in symbols and (not re.fullmatch(r"[^m]*m+L", stages[-1]) or symbols.count("m") != stages[-1].count("m")):
        raise UserError(f"{flag}: m (multi-token prediction layers) must follow every t of the last stage, just "
                        "before L: megalite runs them there, beside the output layer they share")
    if len(stages) % pp:
        raise UserError(f"{flag} has {len(stages)} stages, not a multiple of --pipeline-model-parallel-size {pp}")
    if len(stages) > pp == 1:
        raise UserError(f"{flag} has {len(stages)} stages: virtual stages need --pipeline-model-parallel-size > 1")
    if symbols.count("t") != num_layers:
        raise UserError(f"{flag} places {symbols.count('t')} transformer layers (t) but --num-layers is {num_layers}")
    if symbols.count("E") != 1 or not stages[0].startswith("E"):
        raise UserError(f"{flag}: the embedding E must appear once, first in the first stage")
    if symbols.count("L") != 1 or not stages[-1].endswith("L"):
        raise UserError(f"{flag}: the loss L must appear once, last in the last stage")
    empty = [i for i, stage in enumerate(stages) if not stage]
    if empty:
        raise UserError(f"{flag}: stage {empty[0]} is empty; give every stage at least one of E, t, L")
    return [stage.count("t") for stage in stages]


def layout_mtp_layers(layout: str | None) -> int:
    """The multi-token prediction layers (m) a layout string places (0 without a layout)."""
    return "".join(parse_layout(layout)).count("m") if layout else 0
