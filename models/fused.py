"""Fused GPU kernels (Triton) for the small per-layer operations, with the torch code as the CPU path.

A host-bound model spends its step on kernel launches and the gaps between them, even inside a CUDA graph, so
each of these replaces a chain of elementwise torch kernels with one: RMSNorm with the residual add, rotary
embeddings with the KV-cache write (padded rows skipped), SiLU-and-multiply, the MoE routing (no memset), and
the MoE combine (each token's expert outputs gathered and summed, weighted, in float32; alone, or with the
residual add and the next layer's input norm). Beside them, ``argmax_prob``: a row's argmax and its softmax
probability in one pass over the logits (greedy sampling and draft proposals). Each rounds where the torch path
rounds, so the two agree to bf16 precision. Under TRITON_INTERPRET=1 the kernels also run on the CPU (tests only).

Programmatic dependent launch (Hopper and later): inside a CUDA graph the GPU still waits about half a
microsecond between two dependent kernels, to retire one and start the next. Every Triton kernel here (and the
MoE and attention kernels) starts with ``pdl_enter``: it waits for the kernels before it to finish (their writes
visible) and lets the next kernel launch at once, so that the next one's launch overlaps this one's work.
A kernel does nothing before that wait, so the order of reads and writes is the stream's, as without it.
``launch_options`` turns it on per launch, for steps of up to PDL_MAX_TOKENS tokens; TWOGRID_PDL=0 turns it off.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter is on (set before the first import): the kernels run on CPU tensors too, in numpy, so that
the CPU test suite checks them (tests/test_kernels_interpreted.py). Never a serving mode."""


def use_triton(t: torch.Tensor) -> bool:
    """Whether ops on ``t`` take the Triton kernels: on the GPU, or anywhere under the interpreter."""
    return triton is not None and (t.is_cuda or INTERPRETED)


def _triton_has_pdl() -> bool:
    """Triton's launcher takes ``launch_pdl`` and the language has the grid-dependency calls (Triton >= 3.4)."""
    if triton is None or INTERPRETED:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


_PDL_BY_DEVICE: dict[int, bool] = {}
_PDL_FORCED: list[bool] = []
_PDL_ON = {"PDL": True, "launch_pdl": True}
_PDL_OFF = {"PDL": False}


def pdl_available(device: torch.device) -> bool:
    """Programmatic dependent launch on this device: an NVIDIA GPU of compute capability 9.0 or newer, a Triton
    that has it, and TWOGRID_PDL not set to 0."""
    if device.type != "cuda" or torch.version.hip is not None or os.environ.get("TWOGRID_PDL", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PDL_BY_DEVICE:
        _PDL_BY_DEVICE[index] = _triton_has_pdl() and torch.cuda.get_device_capability(index)[0] >= 9
    return _PDL_BY_DEVICE[index]


PDL_MAX_TOKENS = 256
"""Steps of at most this many tokens launch programmatically. On the H200 (docs/runtime.md) it brings a bench-moe
FULL decode step from 1.04-1.10x to 1.00-1.03x its kernels' sum up to 256 tokens; at 512 tokens and more it made
steps 2-10% slower against their kernels' sum (docs/bench/history/runtime_h200_f9fd88d_pdl_every_size.json), where the
kernels are long and a launch's latency is already hidden behind them."""


def launch_options(rows: torch.Tensor) -> dict:
    """Keyword arguments for a Triton launch of an op of a step (``rows``: a tensor of the step whose first
    dimension is its token count): the kernel's PDL switch, and the launcher's."""
    enabled = _PDL_FORCED[-1] if _PDL_FORCED else True
    if enabled and rows.shape[0] <= PDL_MAX_TOKENS and pdl_available(rows.device):
        return _PDL_ON
    return _PDL_OFF


@contextmanager
def programmatic_launch(enabled: bool):
    """Launches inside the block use (where available) or skip programmatic dependent launch; graphs keep what
    they were captured with. For benchmarks and tests that compare the two."""
    _PDL_FORCED.append(enabled)
    try:
        yield
    finally:
        _PDL_FORCED.pop()


# ---------------------------------------------------------------------------------------------------------------
# torch paths
# ---------------------------------------------------------------------------------------------------------------


def rms_norm_torch(x, weight, eps, residual=None):
    if x.device.type == "cpu":
        return _rms_norm_cpu(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one op: the same values
        out = F.rms_norm(x, (x.shape[-1],), weight, eps)
        return out if residual is None else (out, residual)
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out if residual is None else (out, residual)


def _rms_norm_cpu(x, weight, eps, residual=None):
    """rms_norm_torch on the CPU: F.rms_norm's values (to the dtype's rounding; in bfloat16 almost all bit for bit)
    in a third of its time, where rms_norm is a chain of about ten small ops (38 us for one 576-wide row on a 2-core
    AVX2 CPU; a decode step of SmolLM2 calls it 61 times) and layer_norm one kernel: [x, -x] has mean 0 and
    variance mean(x^2), so the first half of its layer norm (weight [w, w], kept on the weight and rebuilt when the
    weight changes) is rms_norm(x). Every op and call counts here (a few microseconds each): [x, -x] from one cat
    (13 us a norm with the residual add, 18 us writing the halves with out=), rows sliced without an Ellipsis."""
    n = x.shape[-1]
    doubled = weight.__dict__.get("_doubled")
    # an inference tensor keeps no version counter: its doubled weight is built every call
    if doubled is None or doubled[1].dtype != x.dtype or doubled[0] != weight._version:
        doubled = (None, torch.cat([weight, weight]).to(x.dtype))
        if not weight.is_inference():
            doubled = weight._doubled = (weight._version, doubled[1])
    if residual is not None:
        x = residual = x + residual
    normed = torch.layer_norm(torch.cat([x, -x], -1), (2 * n,), doubled[1], None, eps)
    normed = normed[:, :n] if normed.dim() == 2 else normed[..., :n]
    return normed if residual is None else (normed, residual)


def rotary_torch(positions, x, cos, sin):
    return rotate(x, cos[positions], sin[positions])


def rotate_prepared(x, cos2, sin2, out=None):
    """``rotate`` with its rows prepared once a forward (``RotaryRows``): cos2 = [c, c] and sin2 = [-s, s], each
    (tokens, 1, head_dim) in float32; x * cos2 + (x with its halves swapped) * sin2 is rotate's values bit for bit
    in six ops instead of eleven (a CPU decode step rotates in every layer). ``out`` (x itself may be it): the
    rotation is written there, in its dtype (one op fewer than a new tensor and a conversion)."""
    xf = x.float()
    if out is None:
        return (xf * cos2 + xf.roll(x.shape[-1] // 2, -1) * sin2).to(x.dtype)
    return torch.add(xf * cos2, xf.roll(x.shape[-1] // 2, -1) * sin2, out=out)


def rotate(x, cos_rows, sin_rows):
    """Neox rotary of x (tokens, heads, head_dim) by each token's (head_dim / 2,) cos and sin rows."""
    c, s = cos_rows.unsqueeze(1), sin_rows.unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------

if triton is not None:
    from triton.language.extra import libdevice

    if _triton_has_pdl():
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """A kernel's first call: with PDL, wait for the kernels before it, then let the next one launch."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, xs_ptr, cs_ptr, row, stride_x, stride_r, stride_ro, n, eps,
                     HAS_RES: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr):
        """One row's RMSNorm, after the residual add (stored at ``res_out_ptr``) with HAS_RES: (its columns, their
        mask, the normed values times the weight in float32, unrounded). SCALED: x is an FP8 projection's product
        with unit scales (``models.fp8.ScaledRows``), multiplied here by the row's scale (``xs_ptr``) and each
        column's (``cs_ptr``) and rounded to x's dtype, as the row-wise scaled GEMM would have written it."""
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if SCALED:
            cs = tl.load(cs_ptr + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) * tl.load(xs_ptr + row) * cs).to(x_ptr.dtype.element_ty)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
            x = x.to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
        xf = x.to(tl.float32)
        normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        return cols, mask, normed.to(x_ptr.dtype.element_ty).to(tl.float32) * w

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, xs_ptr, cs_ptr, stride_x, stride_r, stride_o,
                         stride_ro, n, eps, HAS_RES: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
        pdl_enter(PDL)
        row = tl.program_id(0)
        cols, mask, y = rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, xs_ptr, cs_ptr, row, stride_x, stride_r,
                                     stride_ro, n, eps, HAS_RES, SCALED, BLOCK)
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_heads(ptr, heads, c, s, w_ptr, eps, NUM: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    QK_NORM: tl.constexpr):
        """The NUM heads at ``ptr`` ((HEADS_PAD, HEAD_DIM / 2) tiles, padded heads masked): (QK_NORM: RMS-normalized
        with the norm weight at ``w_ptr``, rounded where the torch path rounds, then) rotated; both halves, float32."""
        offs = tl.arange(0, HEAD_DIM // 2)[None, :]
        mask = heads < NUM
        x1 = tl.load(ptr + heads * HEAD_DIM + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + heads * HEAD_DIM + HEAD_DIM // 2 + offs, mask=mask, other=0.0).to(tl.float32)
        if QK_NORM:
            dt = ptr.dtype.element_ty
            r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
            w1 = tl.load(w_ptr + offs).to(tl.float32)
            w2 = tl.load(w_ptr + HEAD_DIM // 2 + offs).to(tl.float32)
            x1 = ((x1 * r).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
            x2 = ((x2 * r).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
        return x1 * c - x2 * s, x2 * c + x1 * s

    @triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])  # (views at a step's row offsets)
    def _rotary_write_kv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, kv_ptr, slot_ptr, qn_ptr, kn_ptr, eps, stride_t,
                                stride_kind, k_inv, v_inv, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                                HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                                QK_NORM: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr):
        """Program per token, every head of it at once: rotate its query heads in place; rotate its key heads into
        the cache and copy its value heads beside them (a row with slot -1 writes nothing; position -1, a padded
        row, reads position 0's angles). KV_FP8: an e4m3 cache gets K x k_inv and V x v_inv (1 / the layer's
        scales), clamped to e4m3's range."""
        pdl_enter(PDL)
        t = tl.program_id(0)
        pos = tl.maximum(tl.load(pos_ptr + t), 0)
        offs = tl.arange(0, HEAD_DIM // 2)[None, :]
        c = tl.load(cos_ptr + pos * (HEAD_DIM // 2) + offs)
        s = tl.load(sin_ptr + pos * (HEAD_DIM // 2) + offs)
        base = qkv_ptr + t.to(tl.int64) * stride_t
        dt = qkv_ptr.dtype.element_ty
        heads = tl.arange(0, HEADS_PAD)[:, None]
        r1, r2 = _rope_heads(base, heads, c, s, qn_ptr, eps, NUM_HEADS, HEADS_PAD, HEAD_DIM, QK_NORM)
        tl.store(base + heads * HEAD_DIM + offs, r1.to(dt), mask=heads < NUM_HEADS)
        tl.store(base + heads * HEAD_DIM + HEAD_DIM // 2 + offs, r2.to(dt), mask=heads < NUM_HEADS)
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            kv = tl.arange(0, KV_HEADS_PAD)[:, None]
            k_base = base + NUM_HEADS * HEAD_DIM
            k1, k2 = _rope_heads(k_base, kv, c, s, kn_ptr, eps, NUM_KV_HEADS, KV_HEADS_PAD, HEAD_DIM, QK_NORM)
            dst = kv_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + kv * HEAD_DIM
            mask = kv < NUM_KV_HEADS
            dims = tl.arange(0, HEAD_DIM)[None, :]
            v = tl.load(k_base + NUM_KV_HEADS * HEAD_DIM + kv * HEAD_DIM + dims, mask=mask)
            if KV_FP8:
                ct = kv_ptr.dtype.element_ty
                k1 = tl.clamp(k1.to(dt).to(tl.float32) * k_inv, -448.0, 448.0)
                k2 = tl.clamp(k2.to(dt).to(tl.float32) * k_inv, -448.0, 448.0)
                tl.store(dst + offs, k1.to(ct), mask=mask)
                tl.store(dst + HEAD_DIM // 2 + offs, k2.to(ct), mask=mask)
                tl.store(dst + stride_kind + dims, tl.clamp(v.to(tl.float32) * v_inv, -448.0, 448.0).to(ct), mask=mask)
            else:
                tl.store(dst + offs, k1.to(dt), mask=mask)
                tl.store(dst + HEAD_DIM // 2 + offs, k2.to(dt), mask=mask)
                tl.store(dst + stride_kind + dims, v, mask=mask)

    @triton.jit
    def act_mul_cols(row_ptr, cols, mask, n, GELU: tl.constexpr):
        """act(gate) * up at ``cols`` of a row (gate its first n columns, up the next n) in float32, unrounded: act
        silu or (GELU) tanh-approximated GELU, rounded to the row's dtype before the product."""
        g = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(row_ptr + n + cols, mask=mask, other=0.0)
        if GELU:  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(y) = 2 sigmoid(2 y) - 1
            a = (g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))).to(row_ptr.dtype.element_ty)
        else:
            a = (g * tl.sigmoid(g)).to(row_ptr.dtype.element_ty)
        return a.to(tl.float32) * u.to(tl.float32)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr, GELU: tl.constexpr,
                         PDL: tl.constexpr):
        """act(gate) * up, act silu or (GELU) tanh-approximated GELU."""
        pdl_enter(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        y = act_mul_cols(x_ptr + row * stride_x, cols, mask, n, GELU)
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _combine_row(y_ptr, inv_ptr, w_ptr, stride_y, t, cols, mask, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
        """Token t's expert outputs at ``cols``, weighted and summed in float32, in choice order."""
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            r = tl.load(inv_ptr + t * TOP_K + j)
            w = tl.load(w_ptr + t * TOP_K + j)
            acc += w * tl.load(y_ptr + r * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        return acc

    @triton.jit
    def _moe_combine_kernel(y_ptr, inv_ptr, w_ptr, out_ptr, stride_y, stride_o, n, TOP_K: tl.constexpr,
                            BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        acc = _combine_row(y_ptr, inv_ptr, w_ptr, stride_y, t, cols, mask, TOP_K, BLOCK)
        tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _moe_combine_add_norm_kernel(y_ptr, inv_ptr, w_ptr, res_ptr, nw_ptr, out_ptr, res_out_ptr, stride_y, stride_r,
                                     stride_o, stride_ro, n, eps, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                                     PDL: tl.constexpr):
        """One token's row: the MoE combine, the residual add and the next RMSNorm, rounded where the separate
        combine and norm kernels round."""
        pdl_enter(PDL)
        t = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        acc = _combine_row(y_ptr, inv_ptr, w_ptr, stride_y, t, cols, mask, TOP_K, BLOCK)
        dt = out_ptr.dtype.element_ty
        x = acc.to(dt).to(tl.float32) + tl.load(res_ptr + t * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(dt)
        tl.store(res_out_ptr + t * stride_ro + cols, x, mask=mask)
        xf = x.to(tl.float32)
        normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
        y = normed.to(dt).to(tl.float32) * tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_o + cols, y.to(dt), mask=mask)


if triton is not None:

    @triton.jit
    def _moe_route_kernel(logits_ptr, ids_ptr, w_ptr, counts_ptr, rank_ptr, stride_l, n_experts,
                          TOP_K: tl.constexpr, E_PAD: tl.constexpr, NORM_TOPK: tl.constexpr, PDL: tl.constexpr):
        """Per token: top-k experts of the router logits, their weights, and a slot in each expert's segment."""
        pdl_enter(PDL)
        t = tl.program_id(0)
        offs = tl.arange(0, E_PAD)
        x = tl.load(logits_ptr + t * stride_l + offs, mask=offs < n_experts, other=float("-inf")).to(tl.float32)
        top = tl.max(x, axis=0)
        denom = tl.sum(tl.where(offs < n_experts, tl.exp(x - top), 0.0), axis=0)
        if NORM_TOPK:
            denom = 0.0
        for j in tl.static_range(TOP_K):
            m = tl.max(x, axis=0)
            idx = tl.argmax(x, axis=0)
            e = tl.exp(m - top)
            if NORM_TOPK:
                denom += e
            tl.store(ids_ptr + t * TOP_K + j, idx)
            tl.store(w_ptr + t * TOP_K + j, e)
            tl.store(rank_ptr + t * TOP_K + j, tl.atomic_add(counts_ptr + idx, 1))
            x = tl.where(offs == idx, float("-inf"), x)
        for j in tl.static_range(TOP_K):
            tl.store(w_ptr + t * TOP_K + j, tl.load(w_ptr + t * TOP_K + j) / denom)

    @triton.jit(do_not_specialize=["n_choices"])  # (the step's token count: no variant per value)
    def _moe_scatter_kernel(x_ptr, ids_ptr, rank_ptr, counts_ptr, xs_ptr, inv_ptr, offs_ptr, stride_x, stride_xs,
                            hidden, n_experts, n_choices, TOP_K: tl.constexpr, E_PAD: tl.constexpr,
                            H_PAD: tl.constexpr, PDL: tl.constexpr):
        """Per (token, choice): its row in the expert-sorted order; copies the token's hidden state there. The
        last program to finish (a ticket after the counts) zeroes the counts and the ticket for the next call."""
        pdl_enter(PDL)
        a = tl.program_id(0)
        offs_e = tl.arange(0, E_PAD)
        counts = tl.load(counts_ptr + offs_e, mask=offs_e < n_experts, other=0)
        ends = tl.cumsum(counts, axis=0)
        if a == 0:
            tl.store(offs_ptr + offs_e, ends, mask=offs_e < n_experts)
        e = tl.load(ids_ptr + a)
        start = tl.sum(tl.where(offs_e == e, ends - counts, 0), axis=0)
        row = start + tl.load(rank_ptr + a)
        tl.store(inv_ptr + a, row)
        cols = tl.arange(0, H_PAD)
        mask = cols < hidden
        tl.store(xs_ptr + row * stride_xs + cols, tl.load(x_ptr + (a // TOP_K) * stride_x + cols, mask=mask), mask=mask)
        # acq_rel: every program's reads of the counts happen before its ticket, so the last one may zero them
        if tl.atomic_add(counts_ptr + n_experts, 1) == n_choices - 1:
            tl.store(counts_ptr + offs_e, tl.zeros([E_PAD], dtype=tl.int32), mask=offs_e < n_experts)
            tl.store(counts_ptr + n_experts, 0)

    @triton.jit
    def _argmax_prob_kernel(x_ptr, ids_ptr, prob_ptr, stride_x, n, BLOCK: tl.constexpr, WITH_PROB: tl.constexpr):
        """Program per row: the first index of the row's largest value and (WITH_PROB) that value's softmax
        probability, in one pass over the row (an online log-sum-exp in float32)."""
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * stride_x
        cols = tl.arange(0, BLOCK)
        best = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        best_i = tl.sum(tl.zeros([BLOCK], tl.int64), axis=0)
        total = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        for start in range(0, n, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < n, other=float("-inf")).to(tl.float32)
            m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            if WITH_PROB:
                new = tl.maximum(best, m)
                shift = tl.where(new == float("-inf"), 0.0, new)  # (no -inf - -inf while every value so far is -inf)
                total = total * tl.exp(best - shift) + tl.sum(tl.exp(x - shift), axis=0)
            best_i = tl.where(m > best, i.to(tl.int64) + start, best_i)  # (strictly greater: the first max stays)
            best = tl.maximum(best, m)
        tl.store(ids_ptr + row, best_i)
        if WITH_PROB:
            tl.store(prob_ptr + row, 1.0 / total)

    if INTERPRETED:  # (the interpreter has no libdevice: numpy's log, which may differ from torch's in the last bit)
        @triton.jit
        def _logf(x):
            return tl.log(x)
    else:
        @triton.jit
        def _logf(x):
            """CUDA's logf (libdevice's, what torch.log runs on the GPU), not an approximation: the Gumbel noise of
            a sampled token is then bit for bit the torch path's."""
            return libdevice.log(x)

    @triton.jit
    def _first_max(values, index, n):
        """The largest of per-lane maxima and the first index it is at (``index``: each lane's, int32; n where
        none), as int64: torch's argmax, ties to the first."""
        m = tl.max(values, axis=0)
        return m, tl.min(tl.where(values == m, index, n), axis=0).to(tl.int64)

    @triton.jit
    def _splitmix64(x):
        """splitmix64's finalizer on uint64 (logical shifts, wrapping products): ``models.sampling._mix``."""
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB
        return x ^ (x >> 31)

    @triton.jit
    def _penalized_row(x, cols, valid, slot, num_drafts, rep, pres, freq, counts_ptr, seen_ptr, drafts_ptr,
                       stride_counts, stride_seen, stride_drafts):
        """Logits x at ``cols`` of a row with penalties, as ``_penalize_kernel`` makes them (the same operations):
        the counts from its slot's row of the count table plus its slot's first ``num_drafts`` drafts."""
        count = tl.load(counts_ptr + slot * stride_counts + cols, mask=valid, other=0)
        for j in range(0, num_drafts):
            count += (cols == tl.load(drafts_ptr + slot * stride_drafts + j)).to(tl.int32)
        present = count > 0
        seen = tl.load(seen_ptr + slot * stride_seen + cols, mask=valid, other=0) != 0
        scale = tl.where(present | seen, rep, 1.0)
        x = tl.where(x > 0, x / scale, x * scale)
        return x - freq * count.to(tl.float32) - tl.where(present, pres, 0.0)

    @triton.jit
    def _row_block(base, start, cols, n, penalized, param, num_drafts, rep, pres, freq, counts_ptr, seen_ptr,
                   drafts_ptr, stride_counts, stride_seen, stride_drafts, bits_row, PENALTIES: tl.constexpr,
                   HAS_BITMASK: tl.constexpr):
        """A row's logits start..start + BLOCK as float32 (-inf past n), penalized (``_penalized_row``) when its
        slot is, -inf where its packed bitmask row (``bits_row``, HAS_BITMASK) clears a token; and which of them
        are in the row."""
        valid = start + cols < n
        x = tl.load(base + start + cols, mask=valid, other=float("-inf")).to(tl.float32)
        if PENALTIES:
            if penalized:
                x = _penalized_row(x, start + cols, valid, param, num_drafts, rep, pres, freq, counts_ptr, seen_ptr,
                                   drafts_ptr, stride_counts, stride_seen, stride_drafts)
        if HAS_BITMASK:
            words = tl.load(bits_row + (start + cols) // 32, mask=valid, other=-1)
            x = tl.where(((words >> ((start + cols) % 32)) & 1) != 0, x, float("-inf"))
        return x, valid

    # (rows_per_slot: 1 or q, one compiled kernel; the per-row parameters are views at a step's row offsets, whose
    # alignment varies: specialized on it, a served step met a variant the warm-up had not)
    @triton.jit(do_not_specialize=["rows_per_slot"],
                do_not_specialize_on_alignment=["temp_ptr", "seed_ptr", "min_p_ptr", "pos_ptr", "slot_ptr"])
    def _sample_kernel(x_ptr, temp_ptr, seed_ptr, min_p_ptr, pos_ptr, slot_ptr, ids_ptr, penalized_ptr, pen_ptr,
                       counts_ptr, seen_ptr, drafts_ptr, bits_ptr, stride_x, stride_counts, stride_seen, stride_drafts,
                       stride_bits, n, rows_per_slot, BLOCK: tl.constexpr, HAS_MIN_P: tl.constexpr,
                       HAS_SLOTS: tl.constexpr, PENALTIES: tl.constexpr, HAS_BITMASK: tl.constexpr):
        """Program per row: its token, as ``models.sampling.sample_tokens`` draws it without top-k and top-p. A
        greedy row (temperature 0) takes the first index of its largest logit; a sampled one the first argmax of
        logits / T + Gumbel noise, the noise from ``models.sampling.uniform(seed, position, SAMPLE)`` (its bits
        hashed here, column by column), tokens below the row's largest scaled logit + log(min_p) left out (min_p
        0: off). HAS_SLOTS: the row's parameters are at its slot, slot_ptr[row // rows_per_slot], of per-slot
        tables (else at the row). Every float32 value is the torch path's: the division rounded (``div_rn``),
        CUDA's logf, the same operations in the same order. A greedy row hashes nothing. PENALTIES (with
        HAS_SLOTS): a row whose slot is penalized (``penalized_ptr``) gets its slot's repetition, presence and
        frequency penalties (``pen_ptr``, 3 a slot) first, as ``_penalize_kernel`` applies them, counting the
        slot's drafts before the row (column j of a slot's rows: its first j drafts); other rows read one flag.
        HAS_BITMASK: row r's tokens that its packed bitmask (``bits_ptr`` row r, xgrammar's format) clears are -inf
        (after the penalties, which leave -inf as it is: ``models.sampling.apply_packed_bitmask`` then the rest)."""
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * stride_x
        bits_row = bits_ptr + row.to(tl.int64) * stride_bits
        param = row.to(tl.int64)
        if HAS_SLOTS:
            param = tl.load(slot_ptr + row // rows_per_slot).to(tl.int64)
        temp = tl.load(temp_ptr + param)
        min_p = tl.zeros_like(temp)
        if HAS_MIN_P:
            min_p = tl.load(min_p_ptr + param)
        cols = tl.arange(0, BLOCK)
        penalized = False
        rep = tl.zeros_like(temp)
        pres = rep
        freq = rep
        num_drafts = row % rows_per_slot
        if PENALTIES:
            penalized = tl.load(penalized_ptr + param) != 0
            if penalized:
                rep = tl.load(pen_ptr + param * 3)
                pres = tl.load(pen_ptr + param * 3 + 1)
                freq = tl.load(pen_ptr + param * 3 + 2)
        best = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        best_i = tl.sum(tl.zeros([BLOCK], tl.int64), axis=0)
        # (the maxima are kept per lane and reduced once, after the loop: a reduction a block made each block wait
        # for all of the row's warps, which left the kernel latency-bound)
        lane_best = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_i = tl.zeros([BLOCK], tl.int32)
        if (temp == 0.0) | (min_p > 0.0):  # the row's largest logit (and its first index)
            for start in range(0, n, BLOCK):
                x, _ = _row_block(base, start, cols, n, penalized, param, num_drafts, rep, pres, freq, counts_ptr,
                                  seen_ptr, drafts_ptr, stride_counts, stride_seen, stride_drafts, bits_row, PENALTIES,
                                  HAS_BITMASK)
                ahead = x > lane_best  # (strictly greater: each lane keeps its first maximum)
                lane_i = tl.where(ahead, start + cols, lane_i)
                lane_best = tl.where(ahead, x, lane_best)
            best, best_i = _first_max(lane_best, lane_i, n)
        if temp > 0.0:
            t = tl.maximum(temp, 1e-6)
            # (dividing by t > 0 keeps the order: the largest scaled logit is the largest logit scaled)
            threshold = tl.where(min_p > 0.0, tl.math.div_rn(best, t) + _logf(tl.where(min_p > 0.0, min_p, 1.0)),
                                 float("-inf"))
            seed = tl.load(seed_ptr + param).to(tl.uint64, bitcast=True)
            pos = tl.load(pos_ptr + row).to(tl.uint64, bitcast=True)
            key = _splitmix64(seed * 0x9E3779B97F4A7C15 + pos * 0x632BE59BD9B4E019 + 0x2545F4914F6CDD1D)  # salt 1
            lane_top = tl.full([BLOCK], float("-inf"), tl.float32)
            lane_i = tl.zeros([BLOCK], tl.int32)
            for start in range(0, n, BLOCK):
                x, mask = _row_block(base, start, cols, n, penalized, param, num_drafts, rep, pres, freq, counts_ptr,
                                     seen_ptr, drafts_ptr, stride_counts, stride_seen, stride_drafts, bits_row,
                                     PENALTIES, HAS_BITMASK)
                scaled = tl.math.div_rn(x, t)
                bits = _splitmix64(key + (start + cols).to(tl.uint64) * 0x9E3779B97F4A7C15) >> 40  # 24 random bits
                u = tl.minimum((bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0), 1.0 - 1.0 / 16777216.0)
                g = tl.where(scaled < threshold, float("-inf"), scaled - _logf(-_logf(u)))
                g = tl.where(mask, g, float("-inf"))
                ahead = g > lane_top
                lane_i = tl.where(ahead, start + cols, lane_i)
                lane_top = tl.where(ahead, g, lane_top)
            _, best_i = _first_max(lane_top, lane_i, n)
        tl.store(ids_ptr + row, best_i)

    @triton.jit
    def _count_kernel(slot_ptr, tokens_ptr, accepted_ptr, penalized_ptr, counts_ptr, stride_counts, q,
                      Q_PAD: tl.constexpr):
        """Program per request: if its slot is penalized, its step's tokens up to its accepted drafts' (the first
        accepted + 1 of its q) added to its slot's output counts (atomically: a token may repeat)."""
        i = tl.program_id(0)
        slot = tl.load(slot_ptr + i).to(tl.int64)
        if tl.load(penalized_ptr + slot) != 0:
            cols = tl.arange(0, Q_PAD)
            keep = cols <= tl.load(accepted_ptr + i)
            tokens = tl.load(tokens_ptr + i * q + cols, mask=keep & (cols < q), other=0)
            tl.atomic_add(counts_ptr + slot * stride_counts + tokens, 1, mask=keep & (cols < q))

    # (an op-by-op step's slots and drafts are views at its rows' offsets in the step's upload, and one row's
    # penalties are columns of its (1, 3) values, which ``.contiguous()`` leaves as views 4 and 8 bytes in: their
    # alignment varies; specialized on it, served steps met variants the warm-up had not, 0.1-0.2 s, H100 at 8031899)
    @triton.jit(do_not_specialize_on_alignment=["slot_ptr", "drafts_ptr", "rep_ptr", "pres_ptr", "freq_ptr"])
    def _penalize_kernel(x_ptr, slot_ptr, counts_ptr, seen_ptr, rep_ptr, pres_ptr, freq_ptr, drafts_ptr, stride_x,
                         stride_counts, stride_seen, stride_drafts, n, BLOCK: tl.constexpr, NUM_DRAFTS: tl.constexpr):
        """Program per (row, block of the vocabulary): the row's repetition, presence and frequency penalties in
        place on its float32 logits, its token counts read from its slot's row of the count table plus its drafts
        (vLLM's ``_penalties_kernel``, with the drafts given per row). A row without penalties reads nothing."""
        row = tl.program_id(0)
        rep = tl.load(rep_ptr + row)
        pres = tl.load(pres_ptr + row)
        freq = tl.load(freq_ptr + row)
        if (rep != 1.0) | (pres != 0.0) | (freq != 0.0):
            slot = tl.load(slot_ptr + row).to(tl.int64)
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            valid = cols < n
            x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=valid, other=0.0)
            count = tl.load(counts_ptr + slot * stride_counts + cols, mask=valid, other=0)
            for j in tl.static_range(NUM_DRAFTS):
                draft = tl.load(drafts_ptr + row.to(tl.int64) * stride_drafts + j)
                count += (cols == draft).to(tl.int32)
            present = count > 0
            seen = tl.load(seen_ptr + slot * stride_seen + cols, mask=valid, other=0) != 0
            scale = tl.where(present | seen, rep, 1.0)
            x = tl.where(x > 0, x / scale, x * scale)
            x = x - freq * count.to(tl.float32) - tl.where(present, pres, 0.0)
            tl.store(x_ptr + row.to(tl.int64) * stride_x + cols, x, mask=valid)


# ---------------------------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------------------------


if triton is not None:

    @triton.jit
    def _decode_inputs_kernel(ids_ptr, pos_ptr, valid_ptr, table_rows_ptr, block_table_ptr, inputs_ptr, num_reqs, q,
                              stride_ids, stride_pos, stride_bt, block_size, Q_PAD: tl.constexpr):
        """Program per request r of a FULL decode step of num_reqs requests x q tokens: its q rows of the five
        input rows (token, position, KV slot, block-table row, token position) and its metadata (query start,
        sequence length, block-table row), where ``StaticBuffers`` packs them in ``inputs`` for num_reqs * q rows.
        A padded request (``valid`` 0): token 0, position 0, slot -1, token position -1, sequence length 0."""
        r = tl.program_id(0)
        cols = tl.arange(0, Q_PAD)
        in_q = cols < q
        live = tl.load(valid_ptr + r) != 0
        table_row = tl.load(table_rows_ptr + r).to(tl.int64)
        ids = tl.load(ids_ptr + r * stride_ids + cols, mask=in_q, other=0)
        pos = tl.load(pos_ptr + r * stride_pos + cols, mask=in_q, other=0)
        block = tl.load(block_table_ptr + table_row * stride_bt + pos // block_size, mask=in_q & live, other=0)
        num_rows = num_reqs * q
        rows = inputs_ptr + r * q + cols
        tl.store(rows, tl.where(live, ids, 0), mask=in_q)
        tl.store(rows + num_rows, tl.where(live, pos, 0), mask=in_q)
        tl.store(rows + 2 * num_rows, tl.where(live, block.to(tl.int64) * block_size + pos % block_size, -1), mask=in_q)
        tl.store(rows + 3 * num_rows, table_row + cols * 0, mask=in_q)
        tl.store(rows + 4 * num_rows, tl.where(live, pos, -1), mask=in_q)
        meta = inputs_ptr + 5 * num_rows
        tl.store(meta + r, r * q)
        if r == num_reqs - 1:
            tl.store(meta + num_reqs, num_reqs * q)
        last = tl.load(pos_ptr + r * stride_pos + q - 1)
        tl.store(meta + num_reqs + 1 + r, tl.where(live, last + 1, 0))
        tl.store(meta + 2 * num_reqs + 1 + r, table_row)

    @triton.jit
    def _advance_inputs_kernel(proposals_ptr, inputs_ptr, block_table_ptr, num_tokens, num_reqs, stride_bt,
                               block_size, BLOCK: tl.constexpr):
        """A proposing runtime's inputs of num_tokens rows and num_reqs requests (``StaticBuffers``' packing) moved
        to its next one-token step: each row's token its proposal; a real row (position >= 0) one position on, its KV
        slot looked up again (a padded slot stays -1); a real request (sequence length > 0) one token longer."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tok = i < num_tokens
        pos = tl.load(inputs_ptr + num_tokens + i, mask=tok, other=-1)
        slot = tl.load(inputs_ptr + 2 * num_tokens + i, mask=tok, other=-1)
        table_row = tl.load(inputs_ptr + 3 * num_tokens + i, mask=tok, other=0)
        live = pos >= 0
        new_pos = tl.where(live, pos + 1, pos)
        writes = live & (slot >= 0)
        block = tl.load(block_table_ptr + table_row * stride_bt + new_pos // block_size, mask=tok & writes, other=0)
        tl.store(inputs_ptr + i, tl.load(proposals_ptr + i, mask=tok, other=0), mask=tok)
        tl.store(inputs_ptr + num_tokens + i, new_pos, mask=tok)
        tl.store(inputs_ptr + 2 * num_tokens + i, tl.where(writes, block.to(tl.int64) * block_size
                                                          + new_pos % block_size, -1), mask=tok)
        tl.store(inputs_ptr + 4 * num_tokens + i, new_pos, mask=tok)
        req = i < num_reqs
        seq_lens = inputs_ptr + 5 * num_tokens + num_reqs + 1 + i
        seq_len = tl.load(seq_lens, mask=req, other=0)
        tl.store(seq_lens, tl.where(seq_len > 0, seq_len + 1, seq_len), mask=req)

    @triton.jit
    def _accept_kernel(tokens_ptr, drafts_ptr, given_ptr, accepted_ptr, slots_ptr, computed_ptr, token_ids_ptr,
                       num_computed_ptr, out_ptr, q, width, stride_drafts, stride_token_ids, stride_out,
                       Q_PAD: tl.constexpr, W_PAD: tl.constexpr, GIVEN: tl.constexpr):
        """Program per request r of a fused decode step: its drafts accepted (the leading ones equal to the tokens
        drawn at their positions; GIVEN: read from ``given``), its tokens up to them written after its computed
        ones in its slot's token row and its computed count moved past them, and its result row (accepted, then its
        q tokens, the last repeated to ``width``)."""
        r = tl.program_id(0)
        cols = tl.arange(0, Q_PAD)
        in_q = cols < q
        tokens = tl.load(tokens_ptr + r * q + cols, mask=in_q, other=0)
        if GIVEN:
            accepted = tl.load(given_ptr + r)
        else:
            is_draft = cols < q - 1
            drafts = tl.load(drafts_ptr + r * stride_drafts + cols, mask=is_draft, other=-1)
            accepted = tl.min(tl.where(is_draft & (tokens != drafts), cols, q - 1), axis=0).to(tl.int64)
        tl.store(accepted_ptr + r, accepted)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        computed = tl.load(computed_ptr + r)
        tl.store(token_ids_ptr + slot * stride_token_ids + computed + 1 + cols, tokens, mask=in_q & (cols <= accepted))
        tl.store(num_computed_ptr + slot, computed + 1 + accepted)
        w = tl.arange(0, W_PAD)
        row = out_ptr + r * stride_out
        tl.store(row + 1 + w, tl.load(tokens_ptr + r * q + tl.minimum(w, q - 1), mask=w < width), mask=w < width)
        tl.store(row, accepted)


def accept_drafts(tokens: torch.Tensor, drafts: torch.Tensor, slots: torch.Tensor, computed: torch.Tensor,
                  token_ids: torch.Tensor, num_computed: torch.Tensor, out: torch.Tensor, width: int,
                  given: torch.Tensor | None = None) -> torch.Tensor:
    """A fused decode step's verification in one kernel, as ``FusedDecode._finish``'s torch path: per request
    (tokens (n, q) drawn, drafts (n, q - 1), its slot and computed count) its accepted drafts (``given``: those,
    the fixed-acceptance mode's), its tokens up to them into ``token_ids`` and ``num_computed`` (the request state's,
    int64), its ``out`` row (int32: accepted, then the tokens to ``width``). Returns the accepted counts (n,)."""
    n, q = tokens.shape
    accepted = torch.empty(n, dtype=torch.int64, device=tokens.device)
    if n == 0:
        return accepted
    tokens = tokens.contiguous()
    drafts_arg = drafts if q > 1 else tokens  # (no drafts: never read)
    _accept_kernel[(n,)](tokens, drafts_arg, given if given is not None else accepted, accepted, slots, computed,
                         token_ids, num_computed, out, q, width, drafts_arg.stride(0), token_ids.stride(0),
                         out.stride(0), Q_PAD=triton.next_power_of_2(q), W_PAD=triton.next_power_of_2(width),
                         GIVEN=given is not None, num_warps=1)
    return accepted


def decode_inputs(inputs: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                  table_rows: torch.Tensor, block_table: torch.Tensor, block_size: int) -> None:
    """A FULL decode step's inputs for n requests of q tokens (``ids`` and ``positions`` (n, q) int64, each row
    contiguous; ``valid`` (n,) bool, ``table_rows`` (n,) the requests' block-table rows) packed into ``inputs`` (a
    ``StaticBuffers.inputs``, int64) in one kernel, as ``FusedDecode._load``'s torch path packs them."""
    n, q = ids.shape
    if n == 0:
        return
    assert q == 1 or (ids.stride(1) == 1 and positions.stride(1) == 1), "rows of ids and positions must be contiguous"
    _decode_inputs_kernel[(n,)](ids, positions, valid.view(torch.uint8), table_rows, block_table, inputs, n, q,
                                ids.stride(0), positions.stride(0), block_table.stride(0), block_size,
                                Q_PAD=triton.next_power_of_2(q), num_warps=1)


ADVANCE_BLOCK = 256
"""Rows per program of ``advance_inputs``."""


def advance_inputs(inputs: torch.Tensor, proposals: torch.Tensor, num_tokens: int, num_reqs: int,
                   block_table: torch.Tensor, block_size: int) -> None:
    """``GraphRuntime._advance_inputs``' moves of the packed inputs (token, position, KV slot, token position,
    sequence length), in one kernel."""
    grid = (triton.cdiv(max(num_tokens, num_reqs), ADVANCE_BLOCK),)
    _advance_inputs_kernel[grid](proposals, inputs, block_table, num_tokens, num_reqs, block_table.stride(0),
                                 block_size, BLOCK=ADVANCE_BLOCK, num_warps=4)


def argmax_prob(logits: torch.Tensor, with_prob: bool = True,
                out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row of (rows, vocab) logits: the argmax (int64, the first of equal values, as torch.argmax) and, with
    ``with_prob``, its softmax probability (float32), into ``out`` (ids, probs) if given. On the GPU one kernel
    reads each row once, in its own dtype (the torch path converts the rows to float32, takes a softmax and two
    reductions)."""
    rows, n = logits.shape
    if not use_triton(logits) or rows == 0:
        if logits.is_cpu:  # over float32 rows (exact), by numpy: torch's CPU argmax is a scalar loop, 140 us for
            # SmolLM2's 49,152 logits, numpy's 15 (the same index: the first maximum, NaN counting as one)
            ids, prob = torch.from_numpy(np.argmax(logits.float().numpy(), axis=-1)), None
        else:
            ids, prob = logits.argmax(dim=-1), None
        if with_prob:
            prob = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, ids[:, None]).squeeze(1)
        if out is None:
            return ids, prob
        out[0].copy_(ids)
        if with_prob:
            out[1].copy_(prob)
        return out[0], out[1] if with_prob else None
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if out is not None:
        ids, prob = out
    else:
        ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
        prob = torch.empty(rows, dtype=torch.float32, device=logits.device) if with_prob else ids
    _argmax_prob_kernel[(rows,)](logits, ids, prob, logits.stride(0), n, BLOCK=min(4096, triton.next_power_of_2(n)),
                                 WITH_PROB=with_prob, num_warps=8)
    return ids, prob if with_prob else None


def sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
           min_p: torch.Tensor | None = None, slots: torch.Tensor | None = None, rows_per_slot: int = 1,
           penalties: tuple[torch.Tensor, ...] | None = None, out: torch.Tensor | None = None,
           bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of (rows, vocab) logits (int64, into ``out`` if given), in one kernel: the argmax for
    temperature 0, else the seeded Gumbel-max sample at ``positions`` (rows,), min_p (0: off; None: no row uses
    it) applied first; the tokens of ``models.sampling.sample_tokens``'s torch path without top-k and top-p, which
    calls it on the GPU. ``temperature``, ``seeds`` (int64) and ``min_p`` (float32) are per row, or with ``slots``
    per-slot tables: row r reads its slot's, slots[r // rows_per_slot] (a fused decode step's rows, q per
    request, read the request state where it lies). ``penalties`` (with ``slots``): per-slot tables (penalized
    (bool), the repetition, presence and frequency penalties (slots, 3), the output counts and prompt tokens (slots,
    vocab + 1), the drafts (slots, K)): a penalized slot's rows are penalized first, as ``penalize`` does it, row
    j of a slot counting its first j drafts. ``bitmask`` (rows, ceil(vocab / 32)) int32, xgrammar's packed format:
    each row draws among the tokens its row allows (structured outputs: the mask and the draw in one pass over
    the logits, which are only read)."""
    rows, n = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if penalties is not None:
        penalized, pen, counts, seen, drafts = penalties
        tables = (penalized.view(torch.uint8), pen, counts, seen.view(torch.uint8), drafts)
        strides = (counts.stride(0), seen.stride(0), drafts.stride(0))
    else:
        tables, strides = (out,) * 5, (0, 0, 0)  # (any tensors: the kernel reads none of them without PENALTIES)
    if bitmask is not None and bitmask.shape[0] < rows:
        raise ValueError(f"sample: a bitmask of {bitmask.shape[0]} rows for {rows} rows of logits")
    bits = bitmask if bitmask is not None else out  # (any tensor: read only with HAS_BITMASK)
    _sample_kernel[(rows,)](logits, temperature, seeds, min_p if min_p is not None else temperature, positions,
                            slots if slots is not None else positions, out, *tables, bits, logits.stride(0), *strides,
                            bits.stride(0), n, rows_per_slot, BLOCK=min(4096, triton.next_power_of_2(n)),
                            HAS_MIN_P=min_p is not None, HAS_SLOTS=slots is not None,
                            PENALTIES=penalties is not None, HAS_BITMASK=bitmask is not None, num_warps=8)
    return out


def count_accepted(slots: torch.Tensor, tokens: torch.Tensor, accepted: torch.Tensor, penalized: torch.Tensor,
                   counts: torch.Tensor) -> None:
    """A step's accepted tokens into the penalized slots' output counts, in one kernel (the torch path:
    ``SamplingExtras.count``): per request (slots (n,)), its tokens (n, q) int64 up to accepted (n,) + 1, where
    ``penalized`` (a per-slot bool table, indexed by every slot) says so; ``counts`` (slots, vocab + 1) int32."""
    n, q = tokens.shape
    if n == 0:
        return
    _count_kernel[(n,)](slots, tokens.contiguous(), accepted, penalized.view(torch.uint8), counts, counts.stride(0),
                        q, Q_PAD=triton.next_power_of_2(q), num_warps=1)


PENALIZE_BLOCK = 4096
"""Vocabulary entries per program of ``penalize`` (vLLM's kernel takes 8192)."""


def penalize(logits: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
             repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
             drafts: torch.Tensor | None) -> None:
    """The penalties in place on float32 ``logits`` (rows, vocab + 1), as ``models.sampling.apply_penalties``'s
    torch path computes them, in one pass (the last column, padding, untouched). ``counts`` (slots, vocab + 1)
    int32 and ``seen`` (slots, vocab + 1) bool: the slots' output counts and prompt tokens; ``drafts`` (rows, K)
    int64, -1 padded: each row's drafts before it, counted too."""
    rows, n = logits.shape[0], logits.shape[1] - 1
    if rows == 0:
        return
    num_drafts = 0 if drafts is None else drafts.shape[1]
    drafts = drafts if num_drafts else slots  # (any tensor: the kernel reads none with NUM_DRAFTS 0)
    grid = (rows, triton.cdiv(n, PENALIZE_BLOCK))
    _penalize_kernel[grid](logits, slots, counts, seen.view(torch.uint8), repetition.float().contiguous(),
                           presence.float().contiguous(), frequency.float().contiguous(), drafts, logits.stride(0),
                           counts.stride(0), seen.stride(0), drafts.stride(0) if num_drafts else 0, n,
                           BLOCK=PENALIZE_BLOCK, NUM_DRAFTS=num_drafts, num_warps=8)


def rms_norm(x, weight, eps, residual=None, scales=None):
    """norm(x), or (norm(x + residual), x + residual). ``scales`` = (per-row (rows, 1), per-column (cols,)), float32:
    x is an FP8 projection's product with unit scales (``models.fp8.ScaledRows``), to be scaled by both first (on
    the GPU inside the norm's kernel)."""
    if scales is not None and not use_triton(x):
        x, scales = (x.float() * scales[0] * scales[1]).to(x.dtype), None
    if x.is_cpu and not INTERPRETED:  # (the CPU path, without the calls between)
        return _rms_norm_cpu(x, weight, eps, residual)
    if not use_triton(x) or x.shape[0] == 0:
        return rms_norm_torch(x, weight, eps, residual)
    n = x.shape[-1]
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    res_in = residual if residual is not None else x
    xs, cs = scales if scales is not None else (x, x)
    _rms_norm_kernel[(x.shape[0],)](x, res_in, weight, out, res_out, xs, cs, x.stride(0), res_in.stride(0),
                                    out.stride(0), res_out.stride(0), n, eps, HAS_RES=residual is not None,
                                    SCALED=scales is not None, BLOCK=triton.next_power_of_2(n), num_warps=4,
                                    **launch_options(x))
    return out if residual is None else (out, res_out)


def rotary_write_kv_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                     head_dim: int, qk_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                     kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """One kernel for a layer's QKV rows: rotate the query heads in place, and store the rotated key heads and the
    value heads at each row's cache slot (slot -1: nothing stored). The key heads in ``qkv`` stay unrotated.
    ``qk_norms`` = (q norm weight, k norm weight, eps): each query and key head is RMS-normalized first (Qwen3).
    An FP8 cache stores K / kv_scales[0] and V / kv_scales[1]."""
    if head_dim & (head_dim - 1) or kv_cache.stride(-1) != 1 or not kv_cache[0].is_contiguous():
        raise ValueError(f"rotary_write_kv_ needs a power-of-two head_dim (got {head_dim}) and a contiguous cache")
    q_norm, k_norm, eps = qk_norms if qk_norms is not None else (cos, cos, 0.0)
    _rotary_write_kv_kernel[(qkv.shape[0],)](
        qkv, positions, cos, sin, kv_cache, slot_mapping, q_norm, k_norm, eps, qkv.stride(0), kv_cache.stride(0),
        1.0 / kv_scales[0], 1.0 / kv_scales[1], NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads), KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, QK_NORM=qk_norms is not None, KV_FP8=kv_cache.dtype == torch.float8_e4m3fn,
        num_warps=4 if num_heads * head_dim >= 2048 else 2, **launch_options(qkv))


def silu_mul(x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(x[:, :n]) * x[:, n:], act silu (SwiGLU) or gelu_tanh (GeGLU, tanh-approximated GELU)."""
    n = x.shape[-1] // 2
    if not use_triton(x) or x.shape[0] == 0:  # (two slices: cheaper than split on the CPU's one-row steps)
        gate = F.silu(x[..., :n]) if act == "silu" else F.gelu(x[..., :n], approximate="tanh")
        return gate * x[..., n:]
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block,
                                                        GELU=act == "gelu_tanh", **launch_options(x))
    return out


_EXPERT_COUNTS: dict[tuple[str, int], torch.Tensor] = {}


def expert_counts(device: torch.device, num_experts: int) -> torch.Tensor:
    """Per device and expert count, one int32 buffer of the experts' token counts plus a ticket, zero between
    calls: the route kernel counts into it and the scatter kernel zeroes it when done, so no memset kernel runs
    per layer. Allocated once, outside any graph, and never freed (graphs hold its address). Every MoE layer of
    the process uses it in stream order."""
    key = (str(device), num_experts)
    if key not in _EXPERT_COUNTS:
        _EXPERT_COUNTS[key] = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
    return _EXPERT_COUNTS[key]


def route_top_k(logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """GPU: each token's top-k experts (ids, flat int32), its slot within each expert's rows (rank, int32), the
    routing weights (tokens, top_k) float32, and the experts' counts (``expert_counts``, to be zeroed by the
    kernel that consumes them)."""
    num_tokens, num_experts = logits.shape
    dev, n = logits.device, num_tokens * top_k
    ids = torch.empty(n, dtype=torch.int32, device=dev)
    rank = torch.empty(n, dtype=torch.int32, device=dev)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev)
    counts = expert_counts(dev, num_experts)
    _moe_route_kernel[(num_tokens,)](logits, ids, weights, counts, rank, logits.stride(0), num_experts,
                                     TOP_K=top_k, E_PAD=triton.next_power_of_2(num_experts),
                                     NORM_TOPK=norm_topk_prob, num_warps=1, **launch_options(logits))
    return ids, rank, weights, counts


def moe_route(x: torch.Tensor, logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """Route tokens to experts without host synchronization. Returns (xs, offs, inv, weights): the tokens'
    hidden states sorted by expert (one row per (token, choice)), each expert's cumulative end row (int32), the
    sorted row of each (token, choice), and the routing weights (tokens, top_k) in float32.

    GPU: two Triton kernels (per-token top-k and an atomic slot per expert; then the scatter). Rows within an
    expert's segment come in atomic order, which changes no output: a grouped GEMM computes each row alone.
    CPU: torch top-k and a stable sort by expert."""
    num_tokens, num_experts = logits.shape
    if not use_triton(x) or num_tokens == 0:
        logits = logits.float()
        if norm_topk_prob:
            top_logits, top_ids = torch.topk(logits, top_k, dim=-1)
            weights = torch.softmax(top_logits, dim=-1)
        else:
            weights, top_ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        flat = top_ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.shape[0], device=order.device)
        return x[order // top_k], torch.cumsum(counts, 0, dtype=torch.int32), inv, weights
    dev, n, e_pad = x.device, num_tokens * top_k, triton.next_power_of_2(num_experts)
    ids, rank, weights, counts = route_top_k(logits, top_k, norm_topk_prob)
    xs = torch.empty(n, x.shape[1], dtype=x.dtype, device=dev)
    inv = torch.empty(n, dtype=torch.int64, device=dev)
    offs = torch.empty(num_experts, dtype=torch.int32, device=dev)
    _moe_scatter_kernel[(n,)](x, ids, rank, counts, xs, inv, offs, x.stride(0), xs.stride(0), x.shape[1], num_experts,
                              n, TOP_K=top_k, E_PAD=e_pad, H_PAD=triton.next_power_of_2(x.shape[1]), num_warps=4,
                              **launch_options(x))
    return xs, offs, inv, weights


def moe_combine_add_norm(y_sorted: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor,
                         norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(moe_combine(y_sorted, inv, weights), norm_weight, eps, residual) -> (normed, combine + residual):
    one kernel on the GPU (a MoE layer's output, its residual add and the next layer's input norm)."""
    if not use_triton(y_sorted) or weights.shape[0] == 0:
        return rms_norm_torch(moe_combine(y_sorted, inv, weights), norm_weight, eps, residual)
    num_tokens, top_k = weights.shape
    hidden = y_sorted.shape[-1]
    out = torch.empty(num_tokens, hidden, dtype=y_sorted.dtype, device=y_sorted.device)
    res_out = torch.empty_like(out)
    _moe_combine_add_norm_kernel[(num_tokens,)](
        y_sorted, inv, weights.contiguous(), residual, norm_weight, out, res_out, y_sorted.stride(0),
        residual.stride(0), out.stride(0), res_out.stride(0), hidden, eps, TOP_K=top_k,
        BLOCK=triton.next_power_of_2(hidden), num_warps=4, **launch_options(weights))
    return out, res_out


def moe_combine(y_sorted: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * y_sorted[inv[t * top_k + j]], summed in choice order."""
    num_tokens, top_k = weights.shape
    hidden = y_sorted.shape[-1]
    if not use_triton(y_sorted):
        y = y_sorted[inv] * weights.flatten().unsqueeze(1).to(y_sorted.dtype)
        return y.view(num_tokens, top_k, hidden).sum(dim=1)
    out = torch.empty(num_tokens, hidden, dtype=y_sorted.dtype, device=y_sorted.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _moe_combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        y_sorted, inv, weights.contiguous(), out, y_sorted.stride(0), out.stride(0), hidden, TOP_K=top_k, BLOCK=block,
        **launch_options(weights))
    return out
