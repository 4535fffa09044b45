"""Configuration of the zero-bubble schedules (zb-h1, zbv): the model split zbv implies (what they refuse to
combine with is config/validate.py: check_zero_bubble). Their mechanism, the backward split into B and W,
is split_backward.py."""
from __future__ import annotations

from dataclasses import replace

from megalite.parallel.pipeline.split_backward import backward_input, backward_weight  # noqa: F401 (tests import here)


def schedule_split(split, schedule: str):
    """The split flags a schedule implies: zbv builds two chunks per rank (SplitFlags from stages.py)."""
    if schedule == "zbv" and split.virtual_stages_per_rank is None and split.layout is None:
        return replace(split, virtual_stages_per_rank=2)
    return split
