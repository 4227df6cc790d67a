"""Paged attention's metadata and what builds it: ``AttentionMetadata`` (per token and per request, see
``models.attention``), ``pack_requests`` (the per-request fields from a step's per-token rows, on the host) and the
``RequestLayout`` it reports; ``LayerAttention``, what a layer adds (KV scales, sliding window, soft-cap). Both
attention paths (``models.attention``, ``models.triton_attention``) and the graph runtime import them from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """(tokens,) int64."""
    token_req: torch.Tensor
    """(tokens,) int32 or int64: the block-table row of each token's request."""
    token_pos: torch.Tensor
    """(tokens,) int32 or int64; -1 for padded rows."""
    block_table: torch.Tensor
    """(rows, max_blocks_per_seq) int32."""
    query_start: torch.Tensor
    """(num_reqs + 1,) int32 or int64: request r's query tokens are rows query_start[r]..query_start[r + 1]."""
    seq_lens: torch.Tensor
    """(num_reqs,): context length including the new tokens; 0 for a padded request."""
    req_rows: torch.Tensor
    """(num_reqs,): each request's block-table row."""
    max_query_len: int
    """Host-side bound on any real request's query length (a padded request may hold more rows: it only writes
    zeros). Static in a CUDA graph; it picks the kernel's tile shape."""
    max_seq_len: int | None = None
    """Host-side bound on any request's sequence length, for eager calls (it decides whether contexts are split
    across programs); None: the block table's width in tokens, the only bound a CUDA graph may assume."""
    cpu_plan: Any = field(default=None, repr=False, compare=False)
    """The CPU path's gather plan (``models.attention._CPUPlan``, typed loosely: this module imports nothing from the
    attention paths), built by the first layer's attention and reused by the others (a step's metadata is not
    changed once built: each step builds its own)."""

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    def narrow(self, num_tokens: int) -> "AttentionMetadata":
        """The first num_tokens rows; the per-request fields must already cover exactly those rows."""
        return AttentionMetadata(self.slot_mapping[:num_tokens], self.token_req[:num_tokens],
                                 self.token_pos[:num_tokens], self.block_table, self.query_start, self.seq_lens,
                                 self.req_rows, self.max_query_len, self.max_seq_len)

    @classmethod
    def from_tokens(cls, slot_mapping: torch.Tensor, token_req: torch.Tensor, token_pos: torch.Tensor,
                    block_table: torch.Tensor, num_reqs: int | None = None,
                    max_query_len: int | None = None) -> "AttentionMetadata":
        """Metadata with the per-request fields derived on the host from per-token rows whose real rows come first
        and padded rows (position -1) after them (``pack_requests``; it copies to the host: not capturable). For
        tests and tools; the graph runtime packs its own."""
        pos = token_pos.cpu().numpy().astype(np.int64)
        num_real = int((pos >= 0).sum())
        if (pos[:num_real] < 0).any():
            raise ValueError("token_pos: padded rows (position -1) must come after every real row")
        num_tokens = pos.shape[0]
        buf = np.empty(3 * max(num_reqs or 0, num_tokens + 1) + 1, dtype=np.int64)
        layout = pack_requests(token_req.cpu().numpy()[:num_real].astype(np.int64), pos[:num_real], buf, num_tokens,
                               num_reqs, max_query_len)
        reqs = layout.num_reqs
        packed = torch.from_numpy(buf[:3 * reqs + 1].copy()).to(token_pos.device)
        return cls(slot_mapping, token_req, token_pos, block_table, packed[:reqs + 1], packed[reqs + 1:2 * reqs + 1],
                   packed[2 * reqs + 1:], max(layout.max_query_len, 1) if max_query_len is None else max_query_len)


class RequestLayout(NamedTuple):
    """What ``pack_requests`` laid out."""

    num_reqs: int
    """Requests laid out, padded ones included."""
    num_real: int
    max_query_len: int
    """The longest real query (0 without real requests)."""
    max_seq_len: int
    """The longest real sequence (0 without real requests)."""


def pack_requests(token_req: np.ndarray, positions: np.ndarray, out: np.ndarray, num_tokens: int,
                  num_reqs: int | None = None, max_query_len: int | None = None) -> RequestLayout:
    """Per-request attention metadata from a step's real per-token rows (``token_req``: block-table rows,
    ``positions``; a request's rows contiguous, at consecutive positions), written into ``out[:3 * R + 1]`` as
    query_start (R + 1), seq_lens (R), block-table rows (R). Requests are the runs of equal ``token_req``.

    Rows len(token_req)..num_tokens are padding and belong to padded requests (sequence length 0, row 0).
    ``num_reqs`` None: R is the real requests, plus one padded request when there are padded rows. ``num_reqs``
    given (a CUDA graph's request slots): R = num_reqs, the padded requests holding the padded rows in runs of at
    most ``max_query_len`` rows (the last one takes what is left). ``max_query_len`` also bounds the real queries.
    Bad input raises ValueError naming the field and the limit."""
    n = token_req.shape[0]
    cuts = np.flatnonzero(token_req[1:] != token_req[:-1]) if n else None
    real = cuts.shape[0] + 1 if n else 0
    padded_rows = num_tokens - n
    if padded_rows < 0:
        raise ValueError(f"num_tokens: {num_tokens} is fewer than the step's {n} real rows")
    reqs = real + (padded_rows > 0) if num_reqs is None else num_reqs
    if real + (padded_rows > 0) > reqs:
        raise ValueError(f"num_reqs: the step's {real} requests and {padded_rows} padded rows (which need a padded "
                         f"request) do not fit the graph's {reqs} request slots")
    if out.shape[0] < 3 * reqs + 1:
        raise ValueError(f"num_reqs: {reqs} requests, but room for {(out.shape[0] - 1) // 3} (the request capacity)")
    query_start, seq_lens, rows = out[:reqs + 1], out[reqs + 1:2 * reqs + 1], out[2 * reqs + 1:3 * reqs + 1]
    query_start[0] = 0
    longest = longest_seq = 0
    if real:  # (numpy calls kept few: this runs on every step's host path)
        np.add(cuts, 1, out=query_start[1:real])
        query_start[real] = n
        starts, ends = query_start[:real], query_start[1:real + 1]
        np.add(positions[ends - 1], 1, out=seq_lens[:real])
        np.take(token_req, starts, out=rows[:real])
        query_lens = ends - starts
        first = positions[starts]
        context = seq_lens[:real] - query_lens  # where each query starts, if its positions are consecutive
        if (context != first).any() or context.min() < 0:
            bad = int(np.flatnonzero((context != first) | (context < 0))[0])
            raise ValueError(f"positions: request {bad} (block-table row {int(rows[bad])}, rows {int(starts[bad])}.."
                             f"{int(ends[bad]) - 1}) has positions {int(first[bad])}..{int(seq_lens[bad]) - 1}; a "
                             "request's rows must hold consecutive positions from 0 up")
        longest, longest_seq = int(query_lens.max()), int(seq_lens[:real].max())
    if max_query_len is not None and longest > max_query_len:
        raise ValueError(f"max_query_len: a request of {longest} query tokens exceeds the bound {max_query_len}")
    if reqs > real:
        chunk = max_query_len if num_reqs is not None and max_query_len else max(padded_rows, 1)
        pad_ends = query_start[real + 1:reqs + 1]
        np.minimum(np.arange(n + chunk, n + chunk * (reqs - real) + 1, chunk), num_tokens, out=pad_ends)
        query_start[reqs] = num_tokens
        seq_lens[real:] = 0
        rows[real:] = 0
    return RequestLayout(reqs, real, longest, longest_seq)


class LayerAttention(NamedTuple):
    """What one layer's attention adds to the step's shared metadata: the KV cache's scales (an FP8 cache stores
    K / k_scale and V / v_scale, as vLLM's does; 1.0 otherwise), a sliding window (keys at positions
    pos - window + 1 .. pos; 0: the whole context) and logit soft-capping (scores become cap * tanh(scores / cap);
    0: none)."""

    k_scale: float = 1.0
    v_scale: float = 1.0
    window: int = 0
    softcap: float = 0.0


FULL_ATTENTION = LayerAttention()
