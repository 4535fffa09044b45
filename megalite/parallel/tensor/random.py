"""RNG streams for tensor and pipeline parallelism (Megatron-LM's), and activation recomputation that
replays them exactly.

Seeds (Megatron's offsets): pipeline stage p seeds Python, NumPy and the default torch generator with
``seed + 100 * p`` (``stage_seed``), so stages draw different dropout masks; on every stage the
model-parallel stream is seeded with that value + 2718 + tp_rank.

Dropout on activations every TP rank holds in full must draw the *same* mask on every TP rank: it
uses the default generator, seeded identically on the TP ranks of a stage. Dropout on what a TP rank
holds alone must draw a *different* mask per rank: it runs inside ``tracker.fork()``, the
model-parallel stream. That covers the attention probabilities of the rank's own heads, and under
sequence parallelism the whole layer stack (and the embedding dropout): each rank's hidden dropout
then acts on its own sequence shard, and the default stream would apply the same mask to different
tokens on every rank. Without sequence parallelism the hidden dropout acts on replicated activations
and stays on the default stream.

Recomputation restores both streams to their forward-time state, so recomputed dropout masks are
identical to the original ones. Numerics are layout-independent only without dropout: with dropout
the masks depend on the layout, as in Megatron.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.utils.checkpoint

MODEL_PARALLEL_RNG = "model-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718
PIPELINE_SEED_OFFSET = 100


def _get_default_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_default_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def stage_seed(seed: int, pp_rank: int) -> int:
    """The seed pipeline stage ``pp_rank`` draws its dropout masks from (Megatron: --seed + 100 x stage).
    Parameter initialisation keeps --seed itself (megalite/model/init.py), so weights stay
    layout-independent."""
    return seed + PIPELINE_SEED_OFFSET * pp_rank


class RNGTracker:
    """Named generator states that can temporarily replace the default generator."""

    def __init__(self, device: torch.device = torch.device("cpu")):
        self.device = device
        self.states: dict[str, torch.Tensor] = {}
        self.active: str | None = None           # the stream a fork() has swapped in, if any

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        self.states[name] = torch.Generator(device=self.device).manual_seed(seed).get_state()

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw from stream ``name`` inside the block. Inside a fork of the same stream (a dropout in
        the layer stack that sequence parallelism already runs under the fork) the stream simply
        continues: swapping in its stored state again would repeat the masks drawn since the outer fork."""
        if self.active == name:
            yield
            return
        original, outer = _get_default_state(self.device), self.active
        _set_default_state(self.device, self.states[name])
        self.active = name
        try:
            yield
        finally:
            self.states[name] = _get_default_state(self.device)
            _set_default_state(self.device, original)
            self.active = outer

    def snapshot(self) -> dict:
        """Every stream's state, the default generator's and the forked stream (for recomputation)."""
        return {"default": _get_default_state(self.device), "streams": {k: v.clone() for k, v in self.states.items()},
                "active": self.active}

    def restore(self, snapshot: dict) -> None:
        _set_default_state(self.device, snapshot["default"])
        self.states = {k: v.clone() for k, v in snapshot["streams"].items()}
        self.active = snapshot.get("active")


def build_rng_tracker(seed: int, tp_rank: int, device: torch.device) -> RNGTracker:
    """Seed the default generator with ``seed`` (same on all TP ranks; a pipeline stage passes its
    ``stage_seed``) and the model-parallel stream with seed + 2718 + tp_rank."""
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    torch.manual_seed(seed)
    tracker = RNGTracker(torch.device("cpu") if device.type == "meta" else device)   # meta: no generator
    tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    return tracker


def checkpoint(function, *args, tracker: RNGTracker | None = None):
    """Run ``function(*args)`` without keeping its activations; backward recomputes it.

    The RNG state (default generator and tracker streams) seen by the forward pass is replayed
    during recomputation, so dropout draws the same masks.
    """
    if tracker is None:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)

    def contexts():
        saved = tracker.snapshot()          # called before the forward pass runs

        @contextmanager
        def replay():
            current = tracker.snapshot()
            tracker.restore(saved)
            try:
                yield
            finally:
                tracker.restore(current)
        return nullcontext(), replay()

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False,
                                             context_fn=contexts)
