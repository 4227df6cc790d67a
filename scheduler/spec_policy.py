"""Speculative-decoding policy: how many drafts each request verifies in a step.

- Fixed K: every decode request verifies its K drafts (q = 1 + K).
- Dynamic tiers: K comes from the step's batch size (``num_speculative_tokens_per_batch_size``).
- Adaptive verification: per-request verify lengths, chosen by draft confidence so that the step's total
  tokens land exactly on a captured adaptive-verification graph size, the size that maximizes expected
  tokens per millisecond on the step-cost curve.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


def tier_table(tiers: Sequence[tuple[int, int, int]], max_num_seqs: int) -> np.ndarray:
    """table[n] = K for a batch of n requests (n in 0..max_num_seqs), from (min_batch, max_batch, K) tiers."""
    table = np.zeros(max_num_seqs + 1, dtype=np.int64)
    for lo, hi, k in tiers:
        table[lo : hi + 1] = k
    table[0] = table[1] if max_num_seqs >= 1 else 0
    return table


def choose_verify_lengths(
    confidences: np.ndarray,
    num_drafts: np.ndarray,
    av_sizes: np.ndarray,
    max_tokens: int,
    step_ms: Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """Drafts to verify per request (0..num_drafts[i]) for an adaptive-verification step of n requests.

    ``confidences[i, j]`` is the drafter's probability that draft j is right given drafts < j are;
    verifying drafts 0..j of request i yields draft j with probability prod(confidences[i, :j + 1]), a gain
    that never grows with j. The step verifies the m drafts of largest gain, where n + m is the captured size
    (within ``max_tokens``) that maximizes (n + expected accepted drafts) / step_ms(n + m); ``step_ms`` takes
    an array of token counts. With no captured size in reach, every draft is verified.
    """
    n, k = confidences.shape
    mask = np.arange(k)[None, :] < num_drafts[:, None]
    gains = np.cumprod(np.where(mask, np.clip(confidences, 0.0, 1.0), 0.0), axis=1)
    flat = gains[mask]
    rows = np.nonzero(mask)[0]
    order = np.argsort(-flat)  # ties may land either way: only how many drafts of each row are picked matters
    expected = np.concatenate(([0.0], np.cumsum(flat[order])))
    lo, hi = n, min(n + len(flat), max_tokens)
    candidates = av_sizes[(av_sizes >= lo) & (av_sizes <= hi)]
    if len(candidates) == 0:
        return num_drafts.copy()
    value = (n + expected[candidates - n]) / step_ms(candidates)
    best = int(candidates[int(np.argmax(value))])
    return np.bincount(rows[order[: best - n]], minlength=n).astype(num_drafts.dtype)
