"""Acceptance per draft position: p_j, the share of verify events that accepted more than j drafts (vLLM's
per-position counters), so that a request verifying K drafts yields 1 + sum_{j<K} p_j tokens a step. The prior a
configuration gives, its estimate from counts, and the benchmarks' fixed acceptance. Pure; imports no other module
of ``dispatcher.plan`` but its error."""

from __future__ import annotations

from typing import Any, Sequence

from dispatcher.plan.errors import ConfigError

DEFAULT_ACCEPTANCE_RATE = 0.6
"""The prior without ``acceptance_prior``: each draft accepted with 0.6 given the one before it was (p_j = 0.6^(j+1):
mean acceptance length 2.18 at K = 3; the default model's shipped EAGLE-3 head measures 2.40 there)."""
PRIOR_WEIGHT = 32.0
"""Pseudo verify events of the prior at each position (a few steps of measured ones outweigh it)."""



def _is_rate(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 <= x <= 1.0


def acceptance_profile(value: Any, k_max: int, name: str = "--acceptance") -> tuple[float, ...]:
    """Per-position acceptance p_0..p_{K_max - 1} from a rate r (p_j = r^(j+1)), a list of rates (non-increasing:
    accepting draft j + 1 needs draft j accepted), or their text ("0.6" or "0.6,0.35,0.2"). A list shorter than
    K_max goes on by its last ratio (a single rate by itself). ConfigError naming ``name`` otherwise."""
    if isinstance(value, str):
        try:
            parts = [float(p) for p in value.split(",")]
        except ValueError:
            raise ConfigError(f"{name} must be a rate or comma-separated per-position rates in [0, 1], "
                              f"got {value!r}") from None
        value = parts[0] if len(parts) == 1 else parts
    if _is_rate(value):
        return tuple(float(value) ** (j + 1) for j in range(k_max))
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{name} must be a rate in [0, 1] or a non-empty list of per-position rates, got {value!r}")
    for i, p in enumerate(value):
        if not _is_rate(p):
            raise ConfigError(f"{name}[{i}] = {p!r} must be a rate in [0, 1]")
        if i and p > value[i - 1]:
            raise ConfigError(f"{name}[{i}] = {p} exceeds {name}[{i - 1}] = {value[i - 1]}: a draft is accepted "
                              f"only after the one before it, so the rates never grow with the position")
    if len(value) > k_max:
        raise ConfigError(f"{name} has {len(value)} positions, more than num_speculative_tokens = {k_max}")
    rates = [float(p) for p in value]
    ratio = rates[-1] / rates[-2] if len(rates) >= 2 and rates[-2] > 0 else rates[-1]
    while len(rates) < k_max:
        rates.append(rates[-1] * ratio)
    return tuple(rates)


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """Tokens a request verifying k drafts yields a step: its own one and the accepted drafts, 1 + sum_{j<k} p_j."""
    return 1.0 + float(sum(acceptance[:k]))


def fixed_acceptance_rate(mean_length: float, k: int) -> float:
    """Benchmarks' fixed acceptance: the per-draft probability alpha (each draft accepted with alpha if the previous
    one was) whose mean acceptance length 1 + sum_{j=1..k} alpha^j is ``mean_length``; bisection. ValueError outside
    [1, 1 + k]."""
    if not 1.0 <= mean_length <= 1.0 + k:
        raise ValueError(f"fixed_acceptance = {mean_length} must be in [1, 1 + K] = [1, {1 + k}]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if 1.0 + sum(mid ** j for j in range(1, k + 1)) < mean_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def estimate_acceptance(accepted: Sequence[float], reached: Sequence[float], prior: Sequence[float],
                        prior_weight: float = PRIOR_WEIGHT) -> tuple[float, ...]:
    """Per-position acceptance from counts: ``accepted[j]`` events accepted the draft at j out of ``reached[j]`` that
    reached it (verified it, every draft before it accepted). Position 0 is (accepted_0 + w * p_0) / (reached_0 +
    w); each later one is the one before times its conditional rate (accepted_j + w * r_j) / (reached_j + w), r_j the
    prior's p_j / p_{j-1}. Conditional rates keep deep positions true when the first one moves while only a shallow
    tier verifies (a deep position reached by few events follows the one before it, as the prior does)."""
    out: list[float] = []
    for j, p in enumerate(prior):
        a = float(accepted[j]) if j < len(accepted) else 0.0
        n = float(reached[j]) if j < len(reached) else 0.0
        target = p if j == 0 else (p / prior[j - 1] if prior[j - 1] > 0 else 0.0)
        rate = (a + prior_weight * target) / (n + prior_weight) if n + prior_weight > 0 else target
        rate = min(max(rate, 0.0), 1.0)
        out.append(rate if j == 0 else out[-1] * rate)
    return tuple(out)
