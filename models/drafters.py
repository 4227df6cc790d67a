"""Drafters that propose K tokens per request for the next step.

``propose_ngram`` (prompt lookup), batched on the device: for each request, find an earlier occurrence of its last
n tokens (n from ``max_n`` down to ``min_n``; among the occurrences of the longest n, the most recent) and propose
the tokens that followed it. A request always gets exactly K proposals, so that uniform batches stay uniform;
positions with no match, or past the end of the history, repeat the last token with confidence 0, which adaptive
verification then leaves unverified.
"""

from __future__ import annotations

import torch


NGRAM_MATCH_CONFIDENCE = 0.8
"""The confidence of an n-gram proposal that a match found (adaptive verification's input)."""


def propose_ngram(history: torch.Tensor, last_pos: torch.Tensor, k: int, min_n: int, max_n: int,
                  match_confidence: float = NGRAM_MATCH_CONFIDENCE,
                  iota: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt-lookup drafts for m requests at once, with no host synchronization and no per-request loop.

    ``history``: (m, L) tokens by position, request i's valid through ``last_pos[i]`` (<= L - 1; the token there is
    the last one, and whatever lies past it is ignored). An occurrence of the last n tokens must end before
    ``last_pos`` (it may overlap the tail itself). The longest n in ``min_n..max_n`` with an occurrence wins; among
    its occurrences the most recent (vLLM's prompt lookup takes the earliest among the longest). The K tokens after
    it are proposed with ``match_confidence``; positions with no match or past ``last_pos`` repeat the last token
    with confidence 0. -> (drafts (m, K) int64, confidences (m, K) float32).

    Three elementwise ops over (m, L) per n (about 30 launches in all at max_n = 3): at n, ``match`` (over the ends
    e = n - 1..L - 1) says the n tokens ending at e equal the last n (a match of n + 1 tokens is one of n), and
    ``score[:, e]`` gains L for every n >= ``min_n`` that matched there, over a base of e - L: the largest score is
    the longest n's latest end, and a request with no match scores -1, which places its proposals past the
    history. ``iota``: 0, 1, ... on the device (int64, longer than L, max_n and K), a constant buffer the aranges
    are views of (default: made here)."""
    m, length = history.shape
    if iota is None or len(iota) <= max(length, max_n, k):
        iota = torch.arange(max(length, max_n, k) + 1, device=history.device)
    last_pos = last_pos if last_pos.dtype == torch.int64 else last_pos.long()
    ends = iota[:length]
    back = (last_pos[:, None] - iota[None, :max_n]).clamp(min=0)
    tail = history.gather(1, back)  # tail[:, i]: the token i before the last
    match = ends[None, :] < last_pos[:, None]  # an occurrence ends before the last token
    score = (ends - length).repeat(m, 1)
    for i in range(min(max_n, length - 1)):  # n = i + 1 (no window of L tokens ends before the last one)
        if i:
            match = match[:, 1:]  # a window of i + 1 tokens ends at i or later
        match = match & (history[:, : length - i] == tail[:, i : i + 1])
        if i + 1 >= min_n:
            score[:, i:].add_(match, alpha=length)
    best = score.amax(dim=1)
    follow = best[:, None] % length + iota[None, 1 : k + 1]
    found = follow <= last_pos[:, None]
    last = history.gather(1, last_pos[:, None])
    drafts = torch.where(found, history.gather(1, follow.clamp(max=length - 1)), last)
    conf = torch.where(found, match_confidence, 0.0)  # (float32, unless the default dtype is another)
    return drafts, conf if conf.dtype == torch.float32 else conf.float()
