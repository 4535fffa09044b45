"""RNG streams for tensor parallelism, and activation recomputation that replays them exactly.

Dropout outside TP regions (full, replicated activations) must draw the *same* mask on every TP rank:
it uses the default generator, seeded identically on all TP ranks. Dropout inside TP regions (head
shards in attention, sequence shards under sequence parallelism) must draw *different* masks per
rank: it runs inside ``tracker.fork()``, a stream seeded with seed + 2718 + tp_rank (Megatron's
offsets). Recomputation restores both streams to their forward-time state, so recomputed dropout
masks are identical to the original ones.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.utils.checkpoint

MODEL_PARALLEL_RNG = "model-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718


def _get_default_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_default_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Named generator states that can temporarily replace the default generator."""

    def __init__(self, device: torch.device = torch.device("cpu")):
        self.device = device
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        self.states[name] = torch.Generator(device=self.device).manual_seed(seed).get_state()

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        original = _get_default_state(self.device)
        _set_default_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_default_state(self.device)
            _set_default_state(self.device, original)

    def snapshot(self) -> dict:
        """Every stream's state plus the default generator's (for recomputation and checkpoints)."""
        return {"default": _get_default_state(self.device), "streams": {k: v.clone() for k, v in self.states.items()}}

    def restore(self, snapshot: dict) -> None:
        _set_default_state(self.device, snapshot["default"])
        self.states = {k: v.clone() for k, v in snapshot["streams"].items()}


def build_rng_tracker(seed: int, tp_rank: int, device: torch.device) -> RNGTracker:
    """Seed the default generator with ``seed`` (same on all TP ranks) and the TP stream per rank."""
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    torch.manual_seed(seed)
    tracker = RNGTracker(device)
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
