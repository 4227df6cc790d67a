"""Paged attention over varlen batches with padded rows.

Metadata is per token: ``token_req`` (the row of the block table holding the token's request; the worker
uses the scheduler's slot), ``token_pos`` (the token's position; it attends to positions 0..pos of its
request; -1 marks a padded row, which attends to nothing and outputs zeros) and ``slot_mapping`` (where its K
and V go in the cache; -1 for padded rows, which write to a reserved dummy block instead). One call serves
prefill chunks, uniform decode, adaptive verification and mixed batches.

The KV cache of a layer is one tensor (2, num_blocks + 1, block_size, num_kv_heads, head_dim); the last block
is the dummy that padded rows write to, and no block table references it. On CUDA the attention reads the
paged cache directly (a Triton kernel, one program per token and KV head); on the CPU a torch reference
gathers each request's context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

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
    return lambda cache: out.copy_(reference_paged_attention(q, cache, meta, scale))


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
