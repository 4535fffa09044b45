"""fp16 loss scaling: a constant scale, or Megatron's dynamic scaler with hysteresis.

Dynamic rule: an overflow (inf/NaN gradient) skips the step and uses up one unit of hysteresis; when
hysteresis is exhausted the scale is multiplied by ``backoff`` (0.5), never below ``min_scale``.
After ``window`` consecutive clean steps the scale grows by ``growth`` (2) and hysteresis refills.
"""
from __future__ import annotations


class ConstantLossScaler:
    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    def __init__(self, initial_scale: float, min_scale: float = 1.0, window: int = 1000,
                 hysteresis: int = 2, growth: float = 2.0, backoff: float = 0.5):
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.growth, self.backoff = growth, backoff
        self._clean_steps = 0
        self._hysteresis_left = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
            return
        self._clean_steps += 1
        if self._clean_steps == self.window:
            self._clean_steps = 0
            self._hysteresis_left = self.hysteresis
            self.scale *= self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
