"""The paged attention kernel as it was before issue 10 (one program per (token, KV head), per-token metadata),
frozen here only so that ``bench_attention_gpu.py`` can time it beside the new kernel in the same run (the JSON's
``ms_before``). Nothing in the server uses it; it is not maintained.

Each program reads its token's whole context from the paged cache with an online softmax; a padded row (position
-1) writes zeros and stops. The grid depends only on the token count.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from models.attention_metadata import AttentionMetadata
from models.fused import launch_options, pdl_enter


@triton.jit
def _baseline_paged_attention_kernel(
    q_ptr, kv_ptr, out_ptr, block_table_ptr, token_req_ptr, token_pos_ptr,
    stride_qt, stride_qh, stride_kv_kind, stride_kv_block, stride_kv_slot, stride_kv_head,
    stride_ot, stride_oh, stride_bt, scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    out_ptrs = out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    pos = tl.load(token_pos_ptr + t)
    if pos < 0:
        tl.store(out_ptrs, tl.zeros([GROUP_PAD, HEAD_DIM], dtype=out_ptr.dtype.element_ty), mask=g_mask[:, None])
        return
    req = tl.load(token_req_ptr + t).to(tl.int64)
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for start in range(0, pos + 1, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n <= pos
        block = tl.load(block_table_ptr + req * stride_bt + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        base = block * stride_kv_block + (offs_n % BLOCK_SIZE) * stride_kv_slot + kv_head * stride_kv_head
        k = tl.load(kv_ptr + base[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        v = tl.load(kv_ptr + stride_kv_kind + base[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def prepare_baseline_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                               out: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """The pre-issue-10 entry point, unchanged: it reads the per-token fields of ``meta`` only (block_table,
    token_req, token_pos); the returned call takes a layer's cache and writes ``out``."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    if num_tokens == 0:
        return lambda cache: None
    launch = _baseline_paged_attention_kernel[(num_tokens, num_kv_heads)]
    rest = (out, meta.block_table, meta.token_req, meta.token_pos, q.stride(0), q.stride(1), kv_cache.stride(0),
            kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), out.stride(0), out.stride(1),
            meta.block_table.stride(0), scale)
    consts = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                  BLOCK_SIZE=block_size, BLOCK_N=64 if head_dim <= 64 else 32, num_warps=4, **launch_options(q))

    def run(cache: torch.Tensor) -> None:
        launch(q, cache, *rest, **consts)

    return run

