"""The MoE experts in two Triton GEMMs, for small token counts (decode and small mixed steps).

At a few tokens a step, torch's grouped GEMM costs two kernels a GEMM (one prepares the groups' pointers) and
reads far more than the chosen experts' weights, and the SiLU-and-multiply between the GEMMs is a third kernel.
Here one layer's experts are four kernels after the router: routing (top-k and an atomic slot per expert, shared
with the grouped path), alignment (each expert's rows padded to a multiple of the tile height, so that a tile
belongs to one expert), the gate/up GEMM with SiLU-and-multiply in its epilogue, and the down GEMM; then the
usual combine (in a decoder layer, fused with the residual add and the next norm). Small steps do the router GEMM,
routing and alignment in one program (``SINGLE_PROGRAM_MAX_CELLS``): three kernels where the grouped path has
eight. Every shape is static: the grid covers
the most tiles any routing can need, and the tiles past the last expert's rows end at once, so the whole path is
capturable.

Rounding follows the grouped path (GEMM outputs rounded to the model dtype, then SiLU, then the product), so the
two agree to bf16 precision; where a step uses which path depends only on its (padded) token count, so a graph and
the eager run of the same padded shape take the same path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from models.fused import launch_options, moe_combine, route_top_k, triton, use_triton

if triton is not None:
    import triton.language as tl

    from models.fused import pdl_enter


class MoETiles(NamedTuple):
    """Tile shapes of the two GEMMs (tokens per tile, then output columns and reduction step of each GEMM)."""

    block_m: int
    gate_up_n: int
    gate_up_k: int
    down_n: int
    down_k: int
    num_warps: int = 4
    num_stages: int = 3


MAX_TOKENS = 1024
"""Steps of at most this many tokens take this path; above it, torch's grouped GEMM. On the H200
(``benchmarks/bench_moe_gpu.py``, docs/bench/moe_h200.json) one layer here takes 0.62-0.80 of the grouped path's
time up to 512 tokens and 0.91-0.97 at 1024, for both bench MoE shapes."""


SINGLE_PROGRAM_MAX_CELLS = 16384
"""The router GEMM, routing and alignment run as one program (no atomics; one kernel instead of three) while
tokens x choices x experts (each padded to a power of two, tokens and experts to at least 16) stays within this
many cells: up to 64 tokens at top-8 of 32 experts, 16 tokens at top-8 of 128. Larger steps use the router GEMM
and the two-kernel path (atomic slots). Set to 0 to always use that path."""


def tiles_for(num_tokens: int, top_k: int, num_experts: int, hidden: int) -> MoETiles:
    """Tile height from the average rows per expert: 16 up to 16 rows, 32 up to 48, else 64. Output tiles of 64
    columns and a reduction step of 64, except at height 16 with a wide hidden size (>= 2048): narrower, deeper
    tiles (32 columns, steps of 128) keep more programs streaming weights (the fastest shapes measured)."""
    rows_per_expert = num_tokens * top_k / num_experts
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 48 else 64
    if block_m == 16 and hidden >= 2048:
        return MoETiles(block_m, 32, 128, 64, 128)
    return MoETiles(block_m, 64, 64, 64, 64)


def supported(x: torch.Tensor) -> bool:
    return use_triton(x) and 0 < x.shape[0] <= MAX_TOKENS


if triton is not None:

    @triton.jit(do_not_specialize=["n_choices"])  # (the step's token count: no variant per value)
    def _moe_align_kernel(ids_ptr, rank_ptr, counts_ptr, sorted_ptr, inv_ptr, seg_ptr, n_experts, n_choices,
                          E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
        """Per (token, choice): its row in the expert-sorted layout where each expert's segment is padded to a
        multiple of BLOCK_M. Program 0 records the segments' padded ends and the counts; the last program to
        finish zeroes the counts and the ticket for the next layer."""
        pdl_enter(PDL)
        a = tl.program_id(0)
        offs_e = tl.arange(0, E_PAD)
        emask = offs_e < n_experts
        counts = tl.load(counts_ptr + offs_e, mask=emask, other=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        if a == 0:
            tl.store(seg_ptr + offs_e, ends, mask=emask)
            tl.store(seg_ptr + n_experts + offs_e, counts, mask=emask)
        e = tl.load(ids_ptr + a)
        row = tl.sum(tl.where(offs_e == e, ends - padded, 0), axis=0) + tl.load(rank_ptr + a)
        tl.store(inv_ptr + a, row.to(tl.int64))
        tl.store(sorted_ptr + row, a)
        if tl.atomic_add(counts_ptr + n_experts, 1) == n_choices - 1:
            tl.store(counts_ptr + offs_e, tl.zeros([E_PAD], dtype=tl.int32), mask=emask)
            tl.store(counts_ptr + n_experts, 0)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _moe_route_align_kernel(x_ptr, wg_ptr, w_ptr, sorted_ptr, inv_ptr, seg_ptr, stride_x, stride_g, num_tokens,
                                n_experts, hidden, TOP_K: tl.constexpr, K_PAD: tl.constexpr, T_PAD: tl.constexpr,
                                E_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr,
                                NORM_TOPK: tl.constexpr, PDL: tl.constexpr):
        """Router, routing and alignment of a small step in one program, without atomics: the router logits
        (x @ wg.T, rounded to the model dtype like the router GEMM's output), every token's top-k experts and
        weights, then each (token, choice)'s row in the expert-padded layout (within an expert, in token order:
        ranks are a running count per expert), the segments' padded ends and the counts."""
        pdl_enter(PDL)
        offs_t = tl.arange(0, T_PAD)
        offs_e = tl.arange(0, E_PAD)
        offs_k = tl.arange(0, K_PAD)
        offs_h = tl.arange(0, BLOCK_H)
        tmask = offs_t < num_tokens
        emask = offs_e < n_experts
        acc = tl.zeros([T_PAD, E_PAD], dtype=tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            hmask = offs_h < hidden - h0
            xa = tl.load(x_ptr + offs_t[:, None] * stride_x + h0 + offs_h[None, :],
                         mask=tmask[:, None] & hmask[None, :], other=0.0)
            wb = tl.load(wg_ptr + offs_e[None, :] * stride_g + h0 + offs_h[:, None],
                         mask=emask[None, :] & hmask[:, None], other=0.0)
            acc += tl.dot(xa, wb)
        x = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        x = tl.where(emask[None, :], x, float("-inf"))
        x = tl.where(tmask[:, None], x, 0.0)  # rows past the step: finite, and never stored
        top = tl.max(x, axis=1)
        if NORM_TOPK:
            denom = tl.zeros([T_PAD], dtype=tl.float32)
        else:
            denom = tl.sum(tl.where(emask[None, :], tl.exp(x - top[:, None]), 0.0), axis=1)
        ids = tl.zeros([T_PAD, K_PAD], dtype=tl.int32)
        wts = tl.zeros([T_PAD, K_PAD], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            m = tl.max(x, axis=1)
            idx = tl.argmax(x, axis=1)
            e = tl.exp(m - top)
            if NORM_TOPK:
                denom += e
            ids = tl.where(offs_k[None, :] == j, idx[:, None], ids)
            wts = tl.where(offs_k[None, :] == j, e[:, None], wts)
            x = tl.where(offs_e[None, :] == idx[:, None], float("-inf"), x)
        valid = tmask[:, None] & (offs_k < TOP_K)[None, :]
        tl.store(w_ptr + offs_t[:, None] * TOP_K + offs_k[None, :], wts / denom[:, None], mask=valid)
        # one row per (token, choice slot); the sentinel E_PAD matches no expert
        flat_e = tl.reshape(tl.where(valid, ids, E_PAD), [T_PAD * K_PAD])
        onehot = (flat_e[:, None] == offs_e[None, :]).to(tl.int32)
        rank = tl.sum(onehot * tl.cumsum(onehot, axis=0), axis=1) - 1
        counts = tl.sum(onehot, axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        row = tl.sum(onehot * (ends - padded)[None, :], axis=1) + rank
        flat_t = tl.reshape(tl.broadcast_to(offs_t[:, None], [T_PAD, K_PAD]), [T_PAD * K_PAD])
        flat_k = tl.reshape(tl.broadcast_to(offs_k[None, :], [T_PAD, K_PAD]), [T_PAD * K_PAD])
        flat_valid = (flat_t < num_tokens) & (flat_k < TOP_K)
        a = flat_t * TOP_K + flat_k
        tl.store(inv_ptr + a, row.to(tl.int64), mask=flat_valid)
        tl.store(sorted_ptr + row, a, mask=flat_valid)
        tl.store(seg_ptr + offs_e, ends, mask=emask)
        tl.store(seg_ptr + n_experts + offs_e, counts, mask=emask)

    @triton.jit
    def _tile_rows(seg_ptr, n_experts, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
        """This program's tile: (expert, its rows, which rows hold a (token, choice)); expert == n_experts past
        the last segment."""
        offs_e = tl.arange(0, E_PAD)
        emask = offs_e < n_experts
        ends = tl.load(seg_ptr + offs_e, mask=emask, other=2**30)
        row0 = tl.program_id(0) * BLOCK_M
        e = tl.sum((ends <= row0).to(tl.int32), axis=0)
        end_e = tl.sum(tl.where(offs_e == e, ends, 0), axis=0)
        count_e = tl.load(seg_ptr + n_experts + e, mask=e < n_experts, other=0)
        start_e = end_e - (count_e + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        return e, rows, rows - start_e < count_e

    @triton.jit
    def _moe_gate_up_kernel(x_ptr, w_ptr, sorted_ptr, seg_ptr, h_ptr, stride_x, stride_we, stride_wn, stride_h,
                            hidden, inter, n_experts, TOP_K: tl.constexpr, E_PAD: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            PDL: tl.constexpr):
        """h[row] = silu(x[token] @ w_gate[e].T) * (x[token] @ w_up[e].T) for the rows of one tile (one expert)."""
        pdl_enter(PDL)
        e, rows, valid = _tile_rows(seg_ptr, n_experts, E_PAD, BLOCK_M)
        if e >= n_experts:
            return
        token = tl.load(sorted_ptr + rows, mask=valid, other=0) // TOP_K
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < inter
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + token[:, None] * stride_x + offs_k[None, :]
        g_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        u_ptrs = g_ptrs + inter * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_mask = offs_k < hidden - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            acc_g += tl.dot(a, tl.load(g_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0))
            acc_u += tl.dot(a, tl.load(u_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0))
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        dt = h_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dt).to(tl.float32) * acc_u.to(dt).to(tl.float32)
        tl.store(h_ptr + rows[:, None] * stride_h + offs_n[None, :], act.to(dt), mask=valid[:, None] & n_mask[None, :])

    @triton.jit
    def _moe_down_kernel(h_ptr, w_ptr, seg_ptr, y_ptr, stride_h, stride_we, stride_wn, stride_y, hidden, inter,
                         n_experts, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """y[row] = h[row] @ w_down[e].T for the rows of one tile (one expert)."""
        pdl_enter(PDL)
        e, rows, valid = _tile_rows(seg_ptr, n_experts, E_PAD, BLOCK_M)
        if e >= n_experts:
            return
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hidden
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + rows[:, None] * stride_h + offs_k[None, :]
        w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_mask = offs_k < inter - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            acc += tl.dot(a, tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0))
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        tl.store(y_ptr + rows[:, None] * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=valid[:, None] & n_mask[None, :])


def fused_moe(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              norm_topk_prob: bool, tiles: MoETiles | None = None) -> torch.Tensor:
    """The routed experts' combined output for x (tokens, hidden); see ``experts``."""
    return moe_combine(*experts(x, router, w13, w2, top_k, norm_topk_prob, tiles))


class Routing(NamedTuple):
    """A step's routing in the expert-padded layout: each expert's rows start at a multiple of the tile height."""

    sorted_ids: torch.Tensor
    """(max_rows,) int32: the (token, choice) index a = token * top_k + choice held by each row (rows past an
    expert's count are never read)."""
    inv: torch.Tensor
    """(tokens * top_k,) int64: the row of each (token, choice)."""
    seg: torch.Tensor
    """(2 * experts,) int32: each expert's padded segment end, then each expert's count."""
    weights: torch.Tensor
    """(tokens, top_k) float32 routing weights."""
    max_tiles: int
    """Tiles the GEMM grids cover: enough for any routing of this step."""


def route_and_align(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool,
                    block_m: int) -> Routing:
    """Router logits, top-k and the expert-padded layout: one program for small steps (``SINGLE_PROGRAM_MAX_CELLS``),
    else the router GEMM, the per-token route kernel (atomic slots) and the align kernel."""
    num_tokens, hidden = x.shape
    num_experts = router.shape[0]
    dev, n = x.device, num_tokens * top_k
    e_pad = triton.next_power_of_2(num_experts)
    max_tiles = triton.cdiv(n, block_m) + num_experts  # each expert adds at most one partly filled tile
    sorted_ids = torch.empty(max_tiles * block_m, dtype=torch.int32, device=dev)
    inv = torch.empty(n, dtype=torch.int64, device=dev)
    seg = torch.empty(2 * num_experts, dtype=torch.int32, device=dev)
    # one program: at least 16 rows and 16 experts (the router's tl.dot)
    t_pad, k_pad, e16 = max(16, triton.next_power_of_2(num_tokens)), triton.next_power_of_2(top_k), max(16, e_pad)
    if t_pad * k_pad * e16 <= SINGLE_PROGRAM_MAX_CELLS:
        weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev)
        _moe_route_align_kernel[(1,)](x, router, weights, sorted_ids, inv, seg, x.stride(0), router.stride(0),
                                      num_tokens, num_experts, hidden, TOP_K=top_k, K_PAD=k_pad, T_PAD=t_pad,
                                      E_PAD=e16, BLOCK_H=64, BLOCK_M=block_m, NORM_TOPK=norm_topk_prob,
                                      num_warps=8, **launch_options(x))
    else:
        ids, rank, weights, counts = route_top_k(torch.nn.functional.linear(x, router), top_k, norm_topk_prob)
        _moe_align_kernel[(n,)](ids, rank, counts, sorted_ids, inv, seg, num_experts, n, E_PAD=e_pad,
                                BLOCK_M=block_m, num_warps=1, **launch_options(x))
    return Routing(sorted_ids, inv, seg, weights, max_tiles)


def experts(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
            norm_topk_prob: bool, tiles: MoETiles | None = None):
    """The routed experts' outputs before the combine: (y, inv, weights) as ``moe_combine`` takes them, y one row
    per (token, choice) in the expert-padded layout. router (experts, hidden) is the router's weight; w13
    (experts, 2 * inter, hidden) holds gate then up, w2 (experts, hidden, inter), as Hugging Face stores them.
    GPU or interpreter only (see ``supported``)."""
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    if w13.stride(-1) != 1 or w2.stride(-1) != 1 or x.stride(-1) != 1 or router.stride(-1) != 1:
        raise ValueError("fused_moe needs x and the router and expert weights contiguous in their last dimension")
    t = tiles or tiles_for(num_tokens, top_k, num_experts, hidden)
    r = route_and_align(x, router, top_k, norm_topk_prob, t.block_m)
    e_pad, max_rows = triton.next_power_of_2(num_experts), r.sorted_ids.shape[0]
    h = torch.empty(max_rows, inter, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(r.max_tiles, triton.cdiv(inter, t.gate_up_n))](
        x, w13, r.sorted_ids, r.seg, h, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), hidden, inter,
        num_experts, TOP_K=top_k, E_PAD=e_pad, BLOCK_M=t.block_m, BLOCK_N=t.gate_up_n, BLOCK_K=t.gate_up_k,
        num_warps=t.num_warps, num_stages=t.num_stages, **launch_options(x))
    y = torch.empty(max_rows, hidden, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(r.max_tiles, triton.cdiv(hidden, t.down_n))](
        h, w2, r.seg, y, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0), hidden, inter, num_experts,
        E_PAD=e_pad, BLOCK_M=t.block_m, BLOCK_N=t.down_n, BLOCK_K=t.down_k, num_warps=t.num_warps,
        num_stages=t.num_stages, **launch_options(x))
    return y, r.inv, r.weights
