"""Drafters that propose K tokens per request for the next step.

``NgramDrafter`` (prompt lookup): find the most recent earlier occurrence of the request's last n tokens
(n from ``max_n`` down to ``min_n``) and propose the tokens that followed it. A request always gets exactly K
proposals, so that uniform batches stay uniform; positions with no match repeat the last token with
confidence 0, which adaptive verification then leaves unverified.
"""

from __future__ import annotations

import numpy as np


class NgramDrafter:
    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 3, match_confidence: float = 0.8):
        self.k = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n
        self.match_confidence = match_confidence

    def propose_one(self, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
        arr = np.asarray(tokens, dtype=np.int64)
        length = len(arr)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = arr[length - n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
            hits = np.nonzero((windows == tail).all(axis=1))[0]
            if len(hits):
                start = int(hits[-1]) + n
                found = arr[start : start + k].tolist()
                conf = [self.match_confidence] * len(found)
                return found + [tokens[-1]] * (k - len(found)), conf + [0.0] * (k - len(found))
        return [tokens[-1]] * k, [0.0] * k

    def propose(self, histories: list[list[int]], k: int) -> tuple[np.ndarray, np.ndarray]:
        drafts = np.zeros((len(histories), k), dtype=np.int64)
        conf = np.zeros((len(histories), k), dtype=np.float64)
        for i, tokens in enumerate(histories):
            d, c = self.propose_one(tokens, k)
            drafts[i], conf[i] = d, c
        return drafts, conf
