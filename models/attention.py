"""Paged attention over varlen batches with padded rows.

Metadata is per token: ``token_req`` (the row of the block table holding the token's request; the worker
uses the scheduler's slot), ``token_pos`` (the token's position; it attends to positions 0..pos of its
request; -1 marks a padded row, which attends to nothing and outputs zeros) and ``slot_mapping`` (where its K
and V go in the cache; -1 for padded rows, which write to a reserved dummy block instead). One call serves
prefill chunks, uniform decode, adaptive verification and mixed batches.

The KV cache of a layer is one tensor (2, num_blocks + 1, block_size, num_kv_heads, head_dim); the last block
is the dummy that padded rows write to, and no block table references it. On CUDA the attention reads the
paged cache directly (a Triton kernel, one program per token and KV head); on the CPU the step's requests are
gathered into one padded batch for scaled_dot_product_attention (``reference_paged_attention`` is the plain
per-request reference the tests compare against).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from models.fused import use_triton


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """(tokens,) int64."""
    token_req: torch.Tensor
    """(tokens,) int32 or int64."""
    token_pos: torch.Tensor
    """(tokens,) int32 or int64; -1 for padded rows."""
    block_table: torch.Tensor
    """(rows, max_blocks_per_seq) int32."""
    cpu_plan: "_CPUPlan | None" = field(default=None, repr=False, compare=False)
    """The CPU path's gather plan, built by the first layer's attention and reused by the others (a step's
    metadata is not changed once built: each step builds its own)."""

    def narrow(self, num_tokens: int) -> "AttentionMetadata":
        return AttentionMetadata(self.slot_mapping[:num_tokens], self.token_req[:num_tokens],
                                 self.token_pos[:num_tokens], self.block_table)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One (2, num_blocks + 1, block_size, kv_heads, head_dim) tensor per layer; block num_blocks is the dummy."""
    return [torch.zeros(2, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)]


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's K and V at its slot; padded rows (slot -1) go to the dummy block. (The torch path: on the
    GPU, ``models.fused.rotary_write_kv_`` stores K and V in the rotary kernel and skips padded rows.)"""
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    dummy = num_slots - kv_cache.shape[2]
    slots = torch.where(slot_mapping < 0, torch.full_like(slot_mapping, dummy), slot_mapping)
    flat = kv_cache.view(2, num_slots, -1)
    flat[0].index_copy_(0, slots, k.reshape(k.shape[0], -1))
    flat[1].index_copy_(0, slots, v.reshape(v.shape[0], -1))


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q: (tokens, heads, head_dim) -> (tokens, heads, head_dim), into ``out`` when given."""
    if out is None:
        out = torch.empty_like(q)
    prepare_paged_attention(q, kv_cache, meta, scale, out)(kv_cache)
    return out


def prepare_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                            out: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A step's attention with everything but the layer's cache bound once: call it with each layer's cache (they
    share shape and strides) to write ``out``. The Triton kernel on the GPU, the torch reference on the CPU."""
    if use_triton(q):
        from models.triton_attention import prepare_paged_attention as prepare_triton

        return prepare_triton(q, kv_cache, meta, scale, out)
    if meta.cpu_plan is None:
        meta.cpu_plan = _CPUPlan.build(meta, kv_cache.shape[2])
    return lambda cache: meta.cpu_plan.run(q, cache, scale, out)


_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class _CPUPlan:
    """The CPU path: the step's requests as a padded batch (requests x queries, requests x context), gathered
    from the paged cache in one indexing per layer and run through one scaled_dot_product_attention call (the
    per-request Python loop of ``reference_paged_attention`` costs about a millisecond a layer)."""

    q_index: torch.Tensor
    """(requests, max queries) rows of q; padding repeats a real row."""
    q_valid: torch.Tensor
    """(requests, max queries) bool."""
    rows: torch.Tensor
    """The real rows, in (request, query) order: where q_valid's outputs go."""
    pad_rows: torch.Tensor
    """Rows with position -1: zeros."""
    k_slots: torch.Tensor
    """(requests, max context) cache slots of each request's context (padding: slot 0, masked)."""
    mask: torch.Tensor
    """(requests, 1, max queries, max context) bool: key position <= query position."""

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int) -> "_CPUPlan | None":
        pos, reqs = meta.token_pos.long(), meta.token_req.long()
        live = pos >= 0
        rows = torch.nonzero(live).flatten()
        pad_rows = torch.nonzero(~live).flatten()
        if rows.numel() == 0:
            return cls(*(torch.zeros(0, dtype=torch.long),) * 2, rows, pad_rows, torch.zeros(0, dtype=torch.long),
                       torch.zeros(0, dtype=torch.bool))
        uniq, inverse, counts = torch.unique(reqs[rows], return_inverse=True, return_counts=True)
        order = torch.argsort(inverse, stable=True)
        rows, inverse = rows[order], inverse[order]
        col = torch.arange(rows.numel()) - (torch.cumsum(counts, 0) - counts)[inverse]
        num_reqs, max_q = uniq.numel(), int(counts.max())
        q_index = torch.full((num_reqs, max_q), int(rows[0]), dtype=torch.long)
        q_index[inverse, col] = rows
        q_pos = torch.full((num_reqs, max_q), -1, dtype=torch.long)
        q_pos[inverse, col] = pos[rows]
        ctx = q_pos.max(dim=1).values + 1
        key_pos = torch.arange(int(ctx.max()))
        blocks = meta.block_table[uniq].long()[:, key_pos // block_size]
        k_slots = blocks * block_size + key_pos % block_size
        mask = key_pos[None, None, :] <= q_pos[:, :, None]
        mask[:, :, 0] |= q_pos < 0  # padded queries see one key (no all-masked row), their output is dropped
        return cls(q_index, q_pos >= 0, rows, pad_rows, k_slots, mask[:, None])

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
        if self.pad_rows.numel():
            out.index_fill_(0, self.pad_rows, 0)
        if self.rows.numel() == 0:
            return out
        flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
        k, v = flat[0][self.k_slots].transpose(1, 2), flat[1][self.k_slots].transpose(1, 2)
        qb = q[self.q_index].transpose(1, 2)
        if _SDPA_GQA:
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=self.mask, scale=scale,
                                               enable_gqa=k.shape[1] != qb.shape[1])
        else:
            group = qb.shape[1] // k.shape[1]
            o = F.scaled_dot_product_attention(qb, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                               attn_mask=self.mask, scale=scale)
        out.index_copy_(0, self.rows, o.transpose(1, 2)[self.q_valid].to(out.dtype))
        return out


def reference_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                              scale: float) -> torch.Tensor:
    """Torch reference (float32 math): gather each request's context from its blocks. Not capturable."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    pos = meta.token_pos.long()
    reqs = meta.token_req.long()
    live = pos >= 0
    for req in torch.unique(reqs[live]).tolist():
        idx = torch.nonzero(live & (reqs == req)).flatten()
        ctx_len = int(pos[idx].max()) + 1
        blocks = meta.block_table[req, : -(-ctx_len // block_size)].long()
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len].float()
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,khd->htk", q[idx].float(), k) * scale
        causal = torch.arange(ctx_len, device=q.device)[None, :] <= pos[idx][:, None]
        scores = scores.masked_fill(~causal[None], float("-inf"))
        out[idx] = torch.einsum("htk,khd->thd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out
