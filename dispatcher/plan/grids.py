"""Capture grids: which batch sizes get a CUDA graph.

Every function here is pure (integers in, a sorted tuple of integers out) and cached, so a capture plan for
any configuration costs microseconds. Each grid is one rule, written in its docstring.

Where the rules come from (reference, Appendix A): a batch of n rows runs on the smallest graph that holds it;
padding it by d rows costs about e(n) * d / n of its step time, where e(n) = n * T'(n) / T(n) is the step
time's elasticity. Bounding the mean padding cost by eps gives the local step 2 * eps * n / e(n). Each grid
below is that step for one fitted e(n), rounded down to a power of two so that every power of two is a size.
``eps`` and the knee of e(n) are parameters so that an autotuner can refit them to a measured step-time curve.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

PREFILL_EPS = 0.035
"""Mean padding cost bound of the PIECEWISE (prefill / mixed) grid, as a share of step time."""
PREFILL_KNEE_TOKENS = 4096
"""Token count where PIECEWISE step time turns from flat to linear: e(t) = min(1, t / knee)."""
DECODE_EPS = 0.065
"""Mean padding cost bound of the FULL uniform-decode grid."""
DECODE_DENSE_THROUGH = 6
"""The decode grid holds every request count up to this one."""
INTERACTIVITY_DENSE_THROUGH = 32
"""With ``interactivity``, the prefill grid also holds every token count up to this one."""
LEGACY_DEFAULT_MAX_TOKENS = 512
"""The legacy shared list's default maximum off sm100 (what "main" does on H100 / H200)."""


def floor_pow2(x: float) -> int:
    """The largest power of two <= x; 1 for x < 2."""
    if x < 2:
        return 1
    return 1 << (int(x).bit_length() - 1)


def padding_bounded_grid(cap: int, local_step: Callable[[int], float], dense_through: int = 1) -> tuple[int, ...]:
    """Sizes 1..dense_through, then from n the next multiple of stride(n) = floor_pow2(min(n, local_step(n))),
    until the cap; the cap is always the last size."""
    if cap < 1:
        return ()
    sizes = list(range(1, min(dense_through, cap) + 1))
    n = sizes[-1]
    while n < cap:
        stride = floor_pow2(min(n, local_step(n)))
        n = (n // stride + 1) * stride
        if n < cap:
            sizes.append(n)
    if sizes[-1] != cap:
        sizes.append(cap)
    return tuple(sizes)


@lru_cache(maxsize=4096)
def prefill_grid(
    cap_tokens: int,
    eps: float = PREFILL_EPS,
    knee_tokens: int = PREFILL_KNEE_TOKENS,
    dense_through: int = 1,
) -> tuple[int, ...]:
    """PIECEWISE sizes in tokens.

    Rule: from t = 1, stride = min(t, 2 * eps * max(t, knee)) rounded down to a power of two; the next size is
    the next multiple of the stride; the cap is always included. (With e(t) = min(1, t / knee), the local step
    2 * eps * t / e(t) is 2 * eps * max(t, knee).) At cap 8192: 1, 2, 4, ..., 256, every 256 through 7680, then
    8192: 39 sizes. ``dense_through`` adds every count up to it (32 for ``interactivity``: 65 sizes at 8192).
    """
    step = lambda t: 2 * eps * max(t, knee_tokens)  # noqa: E731
    grid = padding_bounded_grid(cap_tokens, step)
    if dense_through > 1 and cap_tokens >= 1:
        grid = tuple(sorted(set(grid) | set(range(1, min(dense_through, cap_tokens) + 1))))
    return grid


@lru_cache(maxsize=4096)
def decode_grid(
    cap_requests: int, eps: float = DECODE_EPS, dense_through: int = DECODE_DENSE_THROUGH
) -> tuple[int, ...]:
    """FULL uniform-decode sizes in requests.

    Rule: every count through ``dense_through`` (6), then stride = 10 * eps * n^(2/3) rounded down to a power
    of two, the next multiple of the stride, cap included. (With the envelope e(n) = n^(1/3) / 5 fitted over
    all measured models, the local step 2 * eps * n / e(n) is 10 * eps * n^(2/3).) At cap 1024: 1..6, 8, 10,
    ..., 992, 1024: 64 sizes.
    """
    step = lambda n: 10 * eps * n ** (2 / 3)  # noqa: E731
    return padding_bounded_grid(cap_requests, step, dense_through)


@lru_cache(maxsize=4096)
def av_grid(cap_tokens: int) -> tuple[int, ...]:
    """Adaptive-verification sizes in tokens (FULL varlen graphs).

    Rule: 1, 2, 4; four sizes per doubling from 8 through 1024 (8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ...);
    every 128 through 4096; every 256 above; sizes below the cap, then the cap. The grid is dense because
    adaptive verification picks each step's verify budget from these sizes: a gap costs acceptance, not just
    padding. At cap 6144: 64 sizes.
    """
    if cap_tokens < 1:
        return ()
    sizes = [1, 2, 4]
    d = 8
    while d < 1024:
        sizes += [d, d + d // 4, d + d // 2, d + 3 * d // 4]
        d *= 2
    sizes += list(range(1024, 4096, 128))
    t = 4096
    while t < cap_tokens:
        sizes.append(t)
        t += 256
    out = [s for s in sizes if s < cap_tokens]
    out.append(cap_tokens)
    return tuple(out)


@lru_cache(maxsize=4096)
def legacy_token_list(max_tokens: int) -> tuple[int, ...]:
    """The legacy shared list (what "main" captures for every kind), in tokens.

    Rule: 1, 2, 4, every 8 through 248, every 16 from 256 through the max (entries above the max are dropped;
    the max itself is included only when it is on that ladder). At 1024: 83 sizes.
    """
    ladder = [1, 2, 4, *range(8, 256, 8), *range(256, max_tokens + 1, 16)]
    return tuple(s for s in ladder if s <= max_tokens)


@lru_cache(maxsize=256)  # (plan --matrix asks for the same few lists thousands of times)
def legacy_decode_sizes(token_sizes: tuple[int, ...], query_len: int) -> tuple[int, ...]:
    """Request counts the legacy shared list gives uniform decode at q tokens a request: entries divisible
    by q, divided by q. Decode reach at 1024 tokens: 1024 / 512 / 336 / 256 / 168 / 128 requests for
    q = 1 / 2 / 3 / 4 / 6 / 8."""
    return tuple(s // query_len for s in token_sizes if s % query_len == 0)


def up_to_first_covering(sizes: tuple[int, ...], widest: int) -> tuple[int, ...]:
    """The prefix of sorted ``sizes`` that ends at the first size >= widest (all of them if none is):
    the sizes a batch of at most ``widest`` can ever be padded to."""
    for i, s in enumerate(sizes):
        if s >= widest:
            return sizes[: i + 1]
    return sizes
