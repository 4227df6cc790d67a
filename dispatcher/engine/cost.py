"""Step-cost curves: milliseconds a forward of t tokens takes, per execution mode.

Used by adaptive verification to pick each step's verify budget, and by ``twogrid simulate`` as the GPU. A
curve interpolates measured (tokens, ms) points linearly and extends the last segment beyond them. The presets
are SPEC section 1's H200 measurements (bf16, random weights, grouped-GEMM MoE, 24 layers, attention left out);
their PIECEWISE column is an estimate (FULL plus one eager attention launch a layer), not a measurement.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from dispatcher.plan.dispatch import MODE_EAGER, MODE_FULL, MODE_PIECEWISE

_TOKENS = (1, 8, 64, 256, 512, 1024, 2048, 4096, 8192)
PRESETS: dict[str, dict[str, tuple[float, ...]]] = {
    # Granite-1B-A400M-shaped MoE: host-bound up to ~2048 tokens.
    "bench-moe": {
        MODE_EAGER: (22.3, 21.2, 20.8, 23.6, 20.7, 23.8, 23.6, 23.9, 40.9),
        MODE_FULL: (2.6, 3.4, 4.2, 4.8, 6.0, 8.9, 13.4, 21.8, 39.4),
    },
    # Qwen3-30B-A3B-shaped MoE: GPU-bound above a few hundred tokens.
    "bench-moe-large": {
        MODE_EAGER: (11.2, 10.5, 14.3, 15.7, 17.4, 22.1, 33.3, 51.8, 93.7),
        MODE_FULL: (3.5, 7.3, 13.3, 14.5, 16.1, 20.8, 32.1, 50.3, 92.5),
    },
}
PIECEWISE_OVERHEAD_MS_PER_LAYER = 0.05
"""Estimated host cost of running attention eagerly between PIECEWISE pieces, per layer."""


@dataclass(frozen=True)
class CostCurve:
    """Piecewise-linear interpolation over sorted (tokens, ms) points."""

    tokens: tuple[int, ...]
    ms: tuple[float, ...]

    def __post_init__(self):
        if len(self.tokens) != len(self.ms) or len(self.tokens) < 2:
            raise ValueError("a cost curve needs at least two (tokens, ms) points")
        if list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError("cost curve tokens must be strictly increasing")

    def __call__(self, num_tokens):
        """ms at ``num_tokens`` (an int, or a numpy array of them): linear between points, the first and last
        segments extended beyond them, never below 0."""
        t, ms = self.tokens, self.ms
        if isinstance(num_tokens, np.ndarray):
            x = num_tokens.astype(np.float64)
            y = np.interp(x, t, ms)
            lo, hi = x < t[0], x > t[-1]
            y[lo] = ms[0] + (ms[1] - ms[0]) * (x[lo] - t[0]) / (t[1] - t[0])
            y[hi] = ms[-1] + (ms[-1] - ms[-2]) * (x[hi] - t[-1]) / (t[-1] - t[-2])
            return np.maximum(y, 0.0)
        i = bisect.bisect_left(t, num_tokens)
        if i < len(t) and t[i] == num_tokens:
            return ms[i]
        i = min(max(i, 1), len(t) - 1)
        x0, x1, y0, y1 = t[i - 1], t[i], ms[i - 1], ms[i]
        return max(0.0, y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0))


@dataclass(frozen=True)
class StepCostModel:
    """ms per step by mode; PIECEWISE defaults to FULL plus eager attention launches."""

    full: CostCurve
    eager: CostCurve
    piecewise: CostCurve | None = None
    num_layers: int = 24

    @classmethod
    def preset(cls, name: str) -> "StepCostModel":
        if name not in PRESETS:
            raise ValueError(f"cost model must be one of {', '.join(PRESETS)}; got {name!r}")
        p = PRESETS[name]
        return cls(CostCurve(_TOKENS, p[MODE_FULL]), CostCurve(_TOKENS, p[MODE_EAGER]))

    def step_ms(self, mode: str, num_tokens):
        """ms of a step (``num_tokens`` an int or a numpy array)."""
        if mode == MODE_FULL:
            return self.full(num_tokens)
        if mode == MODE_PIECEWISE:
            if self.piecewise is not None:
                return self.piecewise(num_tokens)
            return self.full(num_tokens) + PIECEWISE_OVERHEAD_MS_PER_LAYER * self.num_layers
        return np.maximum(self.eager(num_tokens), self.full(num_tokens))
