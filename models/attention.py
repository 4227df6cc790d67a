"""Paged attention over varlen batches with padded rows and padded requests.

Metadata comes at two levels (``AttentionMetadata``, built in ``models.attention_metadata``):

- per token: ``slot_mapping`` (where its K and V go in the cache; -1 for padded rows, which store nothing),
  ``token_req`` (the block-table row of its request; the worker uses the scheduler's slot) and ``token_pos`` (its
  position; -1 marks a padded row). The KV write and the torch reference read these.
- per request, what the Triton kernel reads: ``query_start`` (num_reqs + 1 offsets: request r's query tokens are
  rows query_start[r]..query_start[r + 1]), ``seq_lens`` (its context including the new tokens, 0 for a padded
  request) and ``req_rows`` (its block-table row), plus ``max_query_len``, a host-side bound on any real request's
  query length (static in a CUDA graph). A request's tokens are contiguous rows at consecutive positions, its new
  tokens the last ones of its context, so query row i of request r sits at position seq_lens[r] - query_len + i
  and attends to positions 0..that one. ``pack_requests`` derives the per-request fields from the per-token rows
  on the host (numpy): the graph runtime packs them into the same host-to-device copy as the token rows.

Padded rows belong to padded requests (sequence length 0): the kernel writes zeros there, so no padded row ever
carries NaN or stale values into the layers after attention. One call serves prefill chunks, uniform decode,
adaptive verification and mixed batches.

The KV cache of a layer is one tensor (2, num_blocks + 1, block_size, num_kv_heads, head_dim); the last block
is the dummy that padded rows of the torch path write to, and no block table references it. On CUDA (and under
Triton's interpreter) attention reads the paged cache directly (``models.triton_attention``: one program per
(request's query block, KV head), split across programs for long contexts); on the CPU the step's requests are
gathered into one padded batch for scaled_dot_product_attention (``reference_paged_attention`` is the plain
per-request reference the tests compare against).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from models.attention_metadata import FULL_ATTENTION, AttentionMetadata, LayerAttention
from models.fused import use_triton


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""``--kv-cache-dtype`` values (vLLM's): the model's dtype, or float8 e4m3 (fp8 means e4m3, as in vLLM)."""


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype for ``--kv-cache-dtype`` ``name``; ValueError naming the flag otherwise."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not supported (one of {', '.join(KV_CACHE_DTYPES)})")
    return model_dtype if name == "auto" else torch.float8_e4m3fn


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One (2, num_blocks + 1, block_size, kv_heads, head_dim) tensor per layer; block num_blocks is the dummy."""
    return [torch.zeros(2, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)]


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale) -> torch.Tensor:
    """x in the cache's dtype: an FP8 cache stores x / scale, clamped to e4m3's range (``scale`` a float, or a
    tensor broadcast against x)."""
    if cache.dtype != torch.float8_e4m3fn:
        return x
    return (x.float() / scale).clamp(-448.0, 448.0).to(cache.dtype)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             layer: LayerAttention = FULL_ATTENTION) -> None:
    """Store each token's K and V at its slot; padded rows (slot -1) go to the dummy block: indexing wraps -1 to the
    last slot, which is the dummy's. (The torch path: on the GPU, ``models.fused.rotary_write_kv_`` stores K and V
    in the rotary kernel and skips padded rows.) An FP8 cache gets K / k_scale and V / v_scale."""
    flat = kv_cache.view(2, kv_cache.shape[1] * kv_cache.shape[2], -1)
    flat[0].index_put_((slot_mapping,), _to_cache(k.reshape(k.shape[0], -1), kv_cache, layer.k_scale))
    flat[1].index_put_((slot_mapping,), _to_cache(v.reshape(v.shape[0], -1), kv_cache, layer.v_scale))


def write_kv_rows(kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor,
                  layer: LayerAttention = FULL_ATTENTION) -> None:
    """``write_kv`` for K and V side by side in each token's row, kv (tokens, 2 * kv_heads * head_dim): one indexed
    store for both (the cache's K and V planes seen as one (slots, 2, row) tensor)."""
    planes = kv_cache.view(2, kv_cache.shape[1] * kv_cache.shape[2], -1).transpose(0, 1)
    rows = kv.view(kv.shape[0], 2, -1)
    if kv_cache.dtype == torch.float8_e4m3fn:
        rows = _to_cache(rows, kv_cache, torch.tensor([layer.k_scale, layer.v_scale], device=kv.device)[:, None])
    planes.index_put_((slot_mapping,), rows)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    out: torch.Tensor | None = None, layer: LayerAttention = FULL_ATTENTION,
                    **kernel_options) -> torch.Tensor:
    """q: (tokens, heads, head_dim) -> (tokens, heads, head_dim), into ``out`` when given; ``layer``: the layer's
    KV scales, window and soft-cap. ``kernel_options`` (tests, benchmarks): ``tiles`` and ``num_kv_splits`` of the
    Triton kernel."""
    if out is None:
        out = torch.empty_like(q)
    prepare_paged_attention(q, kv_cache, meta, scale, out, **kernel_options)(kv_cache, layer)
    return out


def prepare_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                            out: torch.Tensor, **kernel_options) -> Callable[..., None]:
    """A step's attention with everything but the layer bound once: call it with each layer's cache (they share
    shape and strides) and ``LayerAttention`` (default: full attention, scales 1) to write ``out``. The Triton kernel
    on the GPU (and under the interpreter), the torch reference on the CPU."""
    if use_triton(q):
        from models.triton_attention import prepare_paged_attention as prepare_triton

        return prepare_triton(q, kv_cache, meta, scale, out, **kernel_options)
    if meta.cpu_plan is None:
        meta.cpu_plan = _CPUPlan.build(meta, kv_cache.shape[2])
    return lambda cache, layer=FULL_ATTENTION: meta.cpu_plan.run(q, cache, scale, out, layer)


_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def _sdpa(q, k, v, mask, scale):
    """scaled_dot_product_attention (batch, heads, rows, dim) with grouped KV heads, in float32: on CPUs without
    native bfloat16 arithmetic (AVX2) SDPA in bfloat16 takes 2-3 times as long as converting and running it in
    float32 (145 vs 62 us a layer for SmolLM2's decode at a 100-token context)."""
    q, k, v = q.float(), k.float(), v.float()
    if _SDPA_GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          attn_mask=mask, scale=scale)


def _attend(q, k, v, mask, scale, layer: LayerAttention):
    """Attention of (batch, heads, rows, dim) queries over grouped KV heads in float32, with the layer's KV scales
    (k_scale folded into the softmax scale, v_scale onto the output) and soft-cap (scores computed explicitly:
    SDPA has no soft-capping)."""
    if not layer.softcap:
        o = _sdpa(q, k, v, mask, scale * layer.k_scale)
    else:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.tanh(q.float() @ k.float().transpose(-1, -2) * (scale * layer.k_scale / layer.softcap))
        scores = scores * layer.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ v.float()
    return o * layer.v_scale if layer.v_scale != 1.0 else o


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
    mask: torch.Tensor | None
    """(requests, 1, max queries, max context) bool: key position <= query position; None where every query is one
    token and every context as long (nothing to mask: SDPA's unmasked path)."""
    in_order: bool = False
    """Row r is request r's one query and no row is padding: q and the output need no gather or scatter."""
    first_slot: int | None = None
    """One request whose context fills consecutive cache slots from this one on (the block pool hands a lone
    request ascending blocks): its K and V are a slice of the cache, no gather."""
    q_pos: torch.Tensor | None = None
    """(requests, max queries) positions (-1: padding), for sliding-window masks."""
    windowed: dict = field(default_factory=dict)
    """Masks with a sliding window, by window."""

    def mask_for(self, window: int) -> torch.Tensor | None:
        """The causal mask, narrowed to the last ``window`` positions of each query (0: the whole context)."""
        ctx = self.k_slots.shape[-1]
        if not window or ctx <= window or self.q_pos is None:
            return self.mask
        if window not in self.windowed:
            key_pos = torch.arange(ctx)
            q_pos = self.q_pos[:, :, None]
            mask = (key_pos[None, None, :] <= q_pos) & (key_pos[None, None, :] > q_pos - window)
            mask[:, :, 0] |= self.q_pos < 0
            self.windowed[window] = mask[:, None]
        return self.windowed[window]

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int) -> "_CPUPlan | None":
        if meta.token_pos.shape[0] == 1:  # one request's decode step: its plan without the sorting (0.2 of 0.3 ms)
            plan = cls._lone_token(meta, block_size)
            if plan is not None:
                return plan
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
        k_slots = (blocks * block_size + key_pos % block_size).clamp(min=0)  # (past a context: masked; a table's
        # unused entries hold -1)
        if max_q == 1 and bool((ctx == ctx[0]).all()):  # one-token queries over equal contexts see every key
            in_order = pad_rows.numel() == 0 and bool((q_index[:, 0] == torch.arange(num_reqs)).all())
            return cls(q_index, q_pos >= 0, rows, pad_rows, k_slots, None, in_order, _first_of_run(k_slots), q_pos)
        mask = key_pos[None, None, :] <= q_pos[:, :, None]
        mask[:, :, 0] |= q_pos < 0  # padded queries see one key (no all-masked row), their output is dropped
        return cls(q_index, q_pos >= 0, rows, pad_rows, k_slots, mask[:, None], q_pos=q_pos)

    @classmethod
    def _lone_token(cls, meta: AttentionMetadata, block_size: int) -> "_CPUPlan | None":
        """``build``'s plan for a step of one real token (None for one padded row): the same fields."""
        pos = int(meta.token_pos[0])
        if pos < 0:
            return None
        key_pos = torch.arange(pos + 1)
        blocks = meta.block_table[int(meta.token_req[0])].long()[key_pos // block_size]
        k_slots = (blocks * block_size + key_pos % block_size).clamp(min=0)[None]
        zero = torch.zeros(1, dtype=torch.long)
        return cls(zero[:, None], torch.ones(1, 1, dtype=torch.bool), zero, torch.zeros(0, dtype=torch.long), k_slots,
                   None, True, _first_of_run(k_slots), torch.tensor([[pos]]))

    def gather_kv(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """Every request's context, K and V at once, in float32: (2, requests, kv_heads, context, head_dim). One
        index_select and one conversion of a contiguous block (a quarter faster than indexing and converting K
        and V apart: this is most of a CPU decode layer's attention)."""
        reqs, ctx = self.k_slots.shape
        heads, dim = kv_cache.shape[3], kv_cache.shape[4]
        if self.first_slot is not None:
            kv = kv_cache.view(2, -1, heads, dim)[:, self.first_slot:self.first_slot + ctx].float()
        else:
            kv = kv_cache.view(2, -1, heads, dim).index_select(1, self.k_slots.flatten()).float()
        return kv.view(2, reqs, ctx, heads, dim).transpose(2, 3)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float, out: torch.Tensor,
            layer: LayerAttention = FULL_ATTENTION) -> torch.Tensor:
        """``out`` = the step's attention over ``kv_cache`` with the layer's scales, window and soft-cap."""
        ctx = self.k_slots.shape[-1]
        last = layer.window if layer.window and ctx > layer.window else None  # one-token queries at the same
        # position (the in-order paths) see the last ``window`` keys: a slice instead of a mask
        if self.in_order and self.first_slot is not None:  # a lone request's decode: K and V a slice, q and the
            # output as they are (one query a head: (1, heads, dim) is (1, heads, 1, dim)), fewest ops
            n, heads, dim = q.shape
            k, v = self.gather_kv(kv_cache).unbind(0)  # (the slice: first_slot)
            if last:
                k, v = k[:, :, -last:], v[:, :, -last:]
            out.copy_(_attend(q.view(n, heads, 1, dim), k, v, None, scale, layer).view(out.shape))
            return out
        if self.in_order:  # decode: no gather of q, no scatter of the output
            kv = self.gather_kv(kv_cache)
            if last:
                kv = kv[:, :, :, -last:]
            qb = q.view(q.shape[0], 1, *q.shape[1:]).transpose(1, 2)
            o = _attend(qb, kv[0], kv[1], None, scale, layer)
            out.copy_(o.transpose(1, 2).reshape(out.shape))
            return out
        if self.pad_rows.numel():
            out.index_fill_(0, self.pad_rows, 0)
        if self.rows.numel() == 0:
            return out
        kv = self.gather_kv(kv_cache)
        o = _attend(q[self.q_index].transpose(1, 2), kv[0], kv[1], self.mask_for(layer.window), scale, layer)
        out.index_copy_(0, self.rows, o.transpose(1, 2)[self.q_valid].to(out.dtype))
        return out


def _first_of_run(k_slots: torch.Tensor) -> int | None:
    """k_slots (1, context) consecutive slots -> the first; otherwise (or for several requests) None."""
    if k_slots.shape[0] != 1:
        return None
    first = int(k_slots[0, 0])
    return first if bool((k_slots[0] == torch.arange(first, first + k_slots.shape[1])).all()) else None


def reference_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                              layer: LayerAttention = FULL_ATTENTION) -> torch.Tensor:
    """Torch reference (float32 math) from the per-token fields alone: each token attends to positions 0..pos of its
    request's blocks (the last ``layer.window`` of them with a window), scores soft-capped and K and V scaled as
    ``layer`` says; padded rows (position -1) output zeros. Not capturable."""
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
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len].float() * layer.k_scale
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len].float() * layer.v_scale
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,khd->htk", q[idx].float(), k) * scale
        if layer.softcap:
            scores = torch.tanh(scores / layer.softcap) * layer.softcap
        keys = torch.arange(ctx_len, device=q.device)[None, :]
        visible = keys <= pos[idx][:, None]
        if layer.window:
            visible &= keys > pos[idx][:, None] - layer.window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[idx] = torch.einsum("htk,khd->thd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out
