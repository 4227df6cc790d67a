"""Triton paged attention: one program per (query block of a request, KV head), in the design of vLLM's
``triton_unified_attention`` (2D and split-KV 3D variants), rewritten for twogrid's metadata and CUDA graphs.

- A tile's rows are BLOCK_Q query tokens of one request times the GQA group of one KV head (row m: token
  m // GROUP, query head m % GROUP), so each K and V block is read once per (request, KV head) for all of the
  request's query tokens in the block and all query heads of that KV head. Decode steps (queries of up to
  MAX_DECODE_QUERY_LEN tokens, speculative verification included) size BLOCK_Q to cover the whole query: one
  program per (request, KV head) and no search. Longer queries (prefill chunks, mixed steps) use query blocks of
  PREFILL_BLOCK_M rows, and a program finds its request by binary search over ``query_start`` (the q-block grid
  is bounded by tokens // BLOCK_Q + requests, as in vLLM).
- Keys are tiled by BLOCK_N over the request's paged context (block table lookups per key); causal within the
  request's new tokens: query token i of a request with context length c (new tokens included) and query length
  q sees keys 0..c - q + i. Tiles that every row sees in full skip the mask. Softmax in float32 with exp2.
- Flash-decoding: when (query blocks x KV heads) are too few to fill the GPU, each program takes one of the
  grid's slices of its context and writes its partial (unnormalized output, running max, sum); a second kernel
  merges the slices, one program per output row loading all of its slices at once. The split count depends only
  on static sizes (programs vs SMs, the context bound: the block table's width in a graph), never on the
  metadata's device values, so a captured graph's launches are fixed. Multi-token queries split too.
- Padded requests (sequence length 0) get zeros in their rows; query blocks past a request's rows end at once.
- Every launch argument depends only on shapes and the metadata's host-side bounds: capturable.
Design notes, metadata and the benchmark: docs/attention.md.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from models.attention_metadata import FULL_ATTENTION, AttentionMetadata, LayerAttention
from models.fused import PDL_MAX_TOKENS, launch_options, pdl_enter

LOG2E = 1.4426950408889634

MAX_DECODE_QUERY_LEN = 16
"""Queries of up to this many tokens (decode with up to 15 drafts) get tiles that hold the whole query."""
PREFILL_BLOCK_M = 128
"""Tile rows for longer queries: PREFILL_BLOCK_M // group query tokens a program."""
SPLIT_PROGRAMS_PER_SM = 4
"""Split contexts while (query blocks x KV heads) is below this many programs per SM."""
MIN_SPLIT_TOKENS = 256
"""No split count that would leave a slice of the context bound shorter than this."""
MAX_KV_SPLITS = 64
MERGE_WARPS = 2
"""Warps of a merge program (one output row: a (splits, head_dim) tile)."""
DEFAULT_SM_COUNT = 132
"""The H200's SM count, assumed where there is no CUDA device (the interpreter)."""
NO_SPECIALIZE = dict(do_not_specialize=["num_reqs"], do_not_specialize_on_alignment=["qs_ptr", "seq_lens_ptr"])
"""Arguments Triton must not specialize on (by default it compiles a variant per integer that is 1, a multiple of
16 or neither, and per pointer that is 16-byte aligned or not): they change from one eager step to the next (the
request count; views into the packed metadata, whose offsets follow the step's token and request counts), and each
new variant would stall a step for its compile (~0.5 s)."""


class AttentionTiles(NamedTuple):
    """A launch's tile shape: tile rows (query tokens x GQA group, padded), keys a step, warps, pipeline stages."""

    block_m: int
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def attention_tiles(group: int, head_dim: int, max_query_len: int) -> AttentionTiles:
    """Decode (queries of up to MAX_DECODE_QUERY_LEN tokens): rows = the query x the group, padded to a power of
    two of at least 16 (tl.dot's minimum). Longer queries: PREFILL_BLOCK_M rows. Keys 64 a step."""
    if max_query_len <= MAX_DECODE_QUERY_LEN:
        block_m = max(16, triton.next_power_of_2(max(1, max_query_len) * group))
    else:
        block_m = max(PREFILL_BLOCK_M, triton.next_power_of_2(group))
    return AttentionTiles(block_m, 64, 4 if block_m <= 64 else 8, 3 if head_dim <= 64 else 2)


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def choose_kv_splits(programs: int, max_context: int, sms: int) -> int:
    """Context slices a program pair (query block, KV head) is split into, from static sizes only: none while the
    launch has SPLIT_PROGRAMS_PER_SM programs an SM; else enough to reach that, at most MAX_KV_SPLITS and no more
    than slices of MIN_SPLIT_TOKENS of the context bound (``max_context``, the block table's width in tokens)."""
    target = sms * SPLIT_PROGRAMS_PER_SM
    if programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), max_context // MIN_SPLIT_TOKENS, MAX_KV_SPLITS))


@triton.jit
def _locate(qs_ptr, seq_lens_ptr, pid, num_reqs, BLOCK_Q: tl.constexpr, ONE_QBLOCK: tl.constexpr):
    """Query block ``pid``'s request: (request, its first row, its query length, the block's first query token
    within it, its sequence length). Request r owns blocks query_start[r] // BLOCK_Q + r onward (a bound that
    never needs the query lengths on the host); with ONE_QBLOCK, block r is request r."""
    if ONE_QBLOCK:
        req = pid
        row_lo = pid * 0
    else:
        lo = pid * 0
        hi = lo + num_reqs
        while lo < hi:  # the last request whose first block is <= pid
            mid = (lo + hi) // 2
            if tl.load(qs_ptr + mid).to(tl.int32) // BLOCK_Q + mid <= pid:
                lo = mid + 1
            else:
                hi = mid
        req = lo - 1
        row_lo = (pid - tl.load(qs_ptr + req).to(tl.int32) // BLOCK_Q - req) * BLOCK_Q
    q_start = tl.load(qs_ptr + req).to(tl.int32)
    q_len = tl.load(qs_ptr + req + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    return req, q_start, q_len, row_lo, seq_len


@triton.jit
def _zero_rows(out_ptr, q_start, row_lo, q_len, heads, stride_ot, stride_oh, GROUP: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, ONE_QBLOCK: tl.constexpr):
    """A padded request's rows of this block (with ONE_QBLOCK: all of its rows, however many) set to zero."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    if ONE_QBLOCK:
        row_hi = q_len
    else:
        row_hi = tl.minimum(row_lo + BLOCK_Q, q_len)
    zeros = tl.zeros([BLOCK_M, HEAD_DIM], dtype=out_ptr.dtype.element_ty)
    for first in range(row_lo, row_hi, BLOCK_Q):
        tok = first + offs_m // GROUP
        ok = (offs_m < BLOCK_Q * GROUP) & (tok < row_hi)
        ptrs = out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(ptrs, zeros, mask=ok[:, None])


@triton.jit
def _context_tiles(seq_len, q_len, row_lo, window, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                   WINDOW: tl.constexpr):
    """(keys the block's last query token sees (exclusive end), the end of the tiles over them, the end of the
    tiles that every row of the block sees in full, the first tile any row sees, the first tile from which every
    row sees each key past the window's start). Without WINDOW the tiles start at 0."""
    ctx_end = seq_len - q_len + row_lo  # the block's first query token's own position
    kv_end = tl.minimum(seq_len, ctx_end + BLOCK_Q)
    first = 0
    low_full = 0
    if WINDOW:
        first = tl.maximum(ctx_end - window + 1, 0) // BLOCK_N
        low_full = tl.maximum(tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N), first)
    return kv_end, tl.cdiv(kv_end, BLOCK_N), tl.maximum((ctx_end + 1) // BLOCK_N, low_full), first, low_full


@triton.jit
def _attend_tile(q, m_i, l_i, acc, kv_base, bt_row, start, kv_end, last_key, qk_scale, window, softcap,
                 stride_kv_kind, stride_kv_block, stride_kv_slot, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """One tile of keys start..start + BLOCK_N: scores, online softmax (log2 domain), the weighted values.
    MASKED: keys past kv_end are not loaded, and row r sees keys up to last_key[r] only (WINDOW: and past
    last_key[r] - window). K and V are converted to q's dtype (an FP8 cache); SOFTCAP: scores (in log2 units,
    ``softcap`` too) become softcap * tanh(scores / softcap). DOT_PRECISION: tl.dot's input precision, "ieee" for
    float32 queries (Triton's default there is TF32, whose 10-bit mantissa moved a float32 model's logits by ~1e-3)."""
    keys = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if MASKED:
        in_range = keys < kv_end
        block = tl.load(bt_row + keys // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row + keys // BLOCK_SIZE).to(tl.int64)
    ptrs = kv_base + (block * stride_kv_block + (keys % BLOCK_SIZE) * stride_kv_slot)[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(ptrs, mask=in_range[:, None], other=0.0)
        v = tl.load(ptrs + stride_kv_kind, mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(ptrs)
        v = tl.load(ptrs + stride_kv_kind)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
    if MASKED:
        visible = keys[None, :] <= last_key[:, None]
        if WINDOW:
            visible &= keys[None, :] > last_key[:, None] - window
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays empty, not NaN
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=NO_SPECIALIZE["do_not_specialize"] + ["window"],
            do_not_specialize_on_alignment=NO_SPECIALIZE["do_not_specialize_on_alignment"] + ["rows_ptr"])
def _paged_attention_kernel(
    q_ptr, kv_ptr, out_ptr, part_acc_ptr, part_ml_ptr, block_table_ptr, qs_ptr, seq_lens_ptr, rows_ptr, num_reqs,
    stride_qt, stride_qh, stride_kv_kind, stride_kv_block, stride_kv_slot, stride_kv_head, stride_ot, stride_oh,
    stride_bt, qk_scale, v_scale, window, softcap,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ONE_QBLOCK: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """Program (query block, KV head, context slice of the grid's third axis). Without SPLIT: the block's output
    rows; with: the slice's partial (unnormalized output, running max in log2 units, sum) for _merge_splits_kernel.
    The slice count is the grid's, not a constant: one compiled kernel serves every count. The layer's own values:
    ``qk_scale`` (the softmax scale x log2(e) x the cache's k_scale), ``v_scale`` (the cache's), ``window``
    (WINDOW: each row sees its last ``window`` positions) and ``softcap`` (SOFTCAP: x log2(e))."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req, q_start, q_len, row_lo, seq_len = _locate(qs_ptr, seq_lens_ptr, pid, num_reqs, BLOCK_Q, ONE_QBLOCK)
    if row_lo >= q_len:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = row_lo + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    if seq_len == 0:
        if split == 0:
            _zero_rows(out_ptr, q_start, row_lo, q_len, heads, stride_ot, stride_oh, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_M,
                       ONE_QBLOCK)
        return
    kv_end, num_tiles, full_tiles, first, low_full = _context_tiles(seq_len, q_len, row_lo, window, BLOCK_Q, BLOCK_N,
                                                                     WINDOW)
    lo = first
    hi = num_tiles
    if SPLIT:
        per_split = tl.cdiv(num_tiles - first, tl.num_programs(2))
        lo = first + split * per_split
        hi = tl.minimum(lo + per_split, num_tiles)
        if lo >= hi:
            return
    rows_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=rows_ok[:, None], other=0.0)
    bt_row = block_table_ptr + tl.load(rows_ptr + req).to(tl.int64) * stride_bt
    kv_base = kv_ptr + kv_head * stride_kv_head
    last_key = seq_len - q_len + tok
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    low = tl.minimum(tl.maximum(low_full, lo), hi)  # tiles the window's start cuts through (none without WINDOW)
    mid = tl.minimum(tl.maximum(full_tiles, low), hi)
    for t in range(lo, low):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, kv_base, bt_row, t * BLOCK_N, kv_end, last_key, qk_scale, window,
                                     softcap, stride_kv_kind, stride_kv_block, stride_kv_slot, BLOCK_SIZE, BLOCK_N,
                                     HEAD_DIM, True, WINDOW, SOFTCAP, DOT_PRECISION)
    for t in range(low, mid):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, kv_base, bt_row, t * BLOCK_N, kv_end, last_key, qk_scale, window,
                                     softcap, stride_kv_kind, stride_kv_block, stride_kv_slot, BLOCK_SIZE, BLOCK_N,
                                     HEAD_DIM, False, WINDOW, SOFTCAP, DOT_PRECISION)
    for t in range(mid, hi):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, kv_base, bt_row, t * BLOCK_N, kv_end, last_key, qk_scale, window,
                                     softcap, stride_kv_kind, stride_kv_block, stride_kv_slot, BLOCK_SIZE, BLOCK_N,
                                     HEAD_DIM, True, WINDOW, SOFTCAP, DOT_PRECISION)
    acc = acc * v_scale
    if not SPLIT:
        out = acc / l_i[:, None]
        tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None])
    else:
        part = ((pid * tl.num_programs(1) + kv_head) * tl.num_programs(2) + split).to(tl.int64)
        tl.store(part_acc_ptr + (part * BLOCK_M + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], acc)
        tl.store(part_ml_ptr + part * 2 * BLOCK_M + offs_m, m_i)
        tl.store(part_ml_ptr + part * 2 * BLOCK_M + BLOCK_M + offs_m, l_i)


@triton.jit(do_not_specialize=NO_SPECIALIZE["do_not_specialize"] + ["num_splits", "window"],
            do_not_specialize_on_alignment=NO_SPECIALIZE["do_not_specialize_on_alignment"])
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, qs_ptr, seq_lens_ptr, num_reqs, num_splits, stride_ot, stride_oh, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS_PAD: tl.constexpr, ONE_QBLOCK: tl.constexpr, WINDOW: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (query block, KV head, tile row): the row's partials of every context slice that had keys (the
    attention kernel's slicing), loaded at once and merged into its output row. Padded requests' rows were
    written by the attention kernel's first slice."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.program_id(2)
    req, q_start, q_len, row_lo, seq_len = _locate(qs_ptr, seq_lens_ptr, pid, num_reqs, BLOCK_Q, ONE_QBLOCK)
    tok = row_lo + row // GROUP
    if (row >= BLOCK_Q * GROUP) | (tok >= q_len) | (seq_len == 0):
        return
    kv_end, num_tiles, full_tiles, first, low_full = _context_tiles(seq_len, q_len, row_lo, window, BLOCK_Q, BLOCK_N,
                                                                     WINDOW)
    used = tl.cdiv(num_tiles - first, tl.cdiv(num_tiles - first, num_splits))
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    parts = ((pid * tl.num_programs(1) + kv_head) * num_splits + offs_s).to(tl.int64)
    live = offs_s < used
    m_s = tl.load(part_ml_ptr + parts * 2 * BLOCK_M + row, mask=live, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + parts * 2 * BLOCK_M + BLOCK_M + row, mask=live, other=0.0)
    acc_s = tl.load(part_acc_ptr + (parts * BLOCK_M + row)[:, None] * HEAD_DIM + offs_d[None, :], mask=live[:, None],
                    other=0.0)
    weight = tl.exp2(m_s - tl.max(m_s, axis=0))  # the first slice always holds key 0: the max is finite
    out = tl.sum(acc_s * weight[:, None], axis=0) / tl.sum(l_s * weight, axis=0)
    head = kv_head * GROUP + row % GROUP
    tl.store(out_ptr + (q_start + tok) * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


class AttentionLaunch(NamedTuple):
    """A call's launch shape: a function of static sizes only (``plan_launch``)."""

    tiles: AttentionTiles
    block_q: int
    """Query tokens a tile: tiles.block_m // group."""
    one_qblock: bool
    """Every real query fits one tile: program r is request r (no search)."""
    grid0: int
    """Query-block programs: the requests, or tokens // block_q + requests."""
    splits: int
    """Context slices a query block (1: no split, no merge kernel)."""


def plan_launch(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, num_reqs: int, max_query_len: int,
                max_context: int, sms: int, tiles: AttentionTiles | None = None,
                num_kv_splits: int | None = None) -> AttentionLaunch:
    """Tiles, grid and split count from the call's static sizes (token rows, request slots, the query-length bound,
    the context bound: the block table's width in tokens, or an eager call's longest sequence; the SM count), never
    from the metadata's device values: what a CUDA graph captures is the launch every replay needs.
    ``tiles`` / ``num_kv_splits`` override the choices."""
    group = num_heads // num_kv_heads
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim: the Triton attention needs a power of two >= 16, got {head_dim}")
    if num_reqs < 1:
        raise ValueError(f"num_reqs: {num_tokens} rows but no request holds them (padded rows need a padded request)")
    tiles = tiles or attention_tiles(group, head_dim, max_query_len)
    block_q = tiles.block_m // group
    if block_q < 1:
        raise ValueError(f"tiles: block_m {tiles.block_m} is smaller than the GQA group ({group})")
    one_qblock = max_query_len <= block_q
    grid0 = num_reqs if one_qblock else num_tokens // block_q + num_reqs
    splits = num_kv_splits or choose_kv_splits(grid0 * num_kv_heads, max_context, sms)
    return AttentionLaunch(tiles, block_q, one_qblock, grid0, splits)


def eager_launch_shapes(num_heads: int, num_kv_heads: int, head_dim: int, max_num_tokens: int, max_context: int,
                        sms: int) -> list[tuple[int, int, bool]]:
    """(query-length bound, split count, programmatic launch) that together launch every compiled variant eager
    attention can need on this model (tile shape, one query block or not, split or not, the merge's padded split
    count, PDL on for steps of up to PDL_MAX_TOKENS rows and off above), for a warm-up before serving: a variant
    met first while serving stalls its step for the compile."""
    group = num_heads // num_kv_heads
    by_tiles: dict[tuple[AttentionTiles, bool], int] = {}
    for max_query_len in list(range(1, MAX_DECODE_QUERY_LEN + 2)) + [PREFILL_BLOCK_M // group + 1]:
        if max_query_len <= max_num_tokens:
            tiles = attention_tiles(group, head_dim, max_query_len)
            by_tiles.setdefault((tiles, max_query_len <= tiles.block_m // group), max_query_len)
    most = choose_kv_splits(1, max_context, sms)  # the most any launch splits: one program pair
    splits = [1] + [p for p in (2, 4, 8, 16, 32, 64) if p // 2 < most]  # one count per padded count the merge takes
    pdl = [True] + ([False] if max_num_tokens > PDL_MAX_TOKENS else [])
    return [(max_query_len, min(p, most), on) for max_query_len in by_tiles.values() for p in splits for on in pdl]


def dot_precision(dtype: torch.dtype) -> str:
    """The attention kernel's tl.dot input precision: IEEE for float32 (a float32 model computes in float32, as
    torch's matmuls do with TF32 off, their default), TF32 (Triton's default, unused by 16-bit inputs) otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def prepare_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                            out: torch.Tensor, tiles: AttentionTiles | None = None,
                            num_kv_splits: int | None = None) -> Callable[..., None]:
    """Every launch argument of a step's attention but the layer's cache, computed once: the returned call takes a
    layer's cache (all of a model's caches share shape and strides) and writes ``out``. Between PIECEWISE pieces
    this leaves only the launches (one, or two with split contexts) on the host's path, once a layer.
    ``tiles`` and ``num_kv_splits`` override the automatic choices (tests, benchmarks)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if num_tokens == 0:
        return lambda cache: None
    max_context = meta.max_seq_len or meta.block_table.shape[1] * block_size
    launch = plan_launch(num_tokens, num_heads, num_kv_heads, head_dim, meta.num_reqs, meta.max_query_len,
                         max_context, sm_count(q.device), tiles, num_kv_splits)
    tiles, splits, grid0 = launch.tiles, launch.splits, launch.grid0
    if splits > 1:
        parts = grid0 * num_kv_heads * splits * tiles.block_m
        part_acc = torch.empty(parts * head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(2 * parts, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # not read
    consts = dict(GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_Q=launch.block_q, BLOCK_M=tiles.block_m,
                  BLOCK_N=tiles.block_n, ONE_QBLOCK=launch.one_qblock, num_warps=tiles.num_warps, **launch_options(q))
    attend = _paged_attention_kernel[(grid0, num_kv_heads, splits)]
    rest = (out, part_acc, part_ml, meta.block_table, meta.query_start, meta.seq_lens, meta.req_rows, meta.num_reqs,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            out.stride(0), out.stride(1), meta.block_table.stride(0))
    attend_consts = dict(consts, BLOCK_SIZE=block_size, SPLIT=splits > 1, DOT_PRECISION=dot_precision(q.dtype),
                         num_stages=tiles.num_stages)

    def layer_args(layer: LayerAttention) -> tuple:
        return (scale * LOG2E * layer.k_scale, layer.v_scale, layer.window, layer.softcap * LOG2E)

    if splits == 1:
        def run(cache: torch.Tensor, layer: LayerAttention = FULL_ATTENTION) -> None:
            attend(q, cache, *rest, *layer_args(layer), WINDOW=layer.window > 0, SOFTCAP=layer.softcap > 0,
                   **attend_consts)

        return run
    merge = _merge_splits_kernel[(grid0, num_kv_heads, tiles.block_m)]
    merge_args = (out, part_acc, part_ml, meta.query_start, meta.seq_lens, meta.num_reqs, splits, out.stride(0),
                  out.stride(1))
    merge_consts = dict(consts, SPLITS_PAD=triton.next_power_of_2(splits), num_warps=MERGE_WARPS)

    def run_split(cache: torch.Tensor, layer: LayerAttention = FULL_ATTENTION) -> None:
        attend(q, cache, *rest, *layer_args(layer), WINDOW=layer.window > 0, SOFTCAP=layer.softcap > 0,
               **attend_consts)
        merge(*merge_args, layer.window, WINDOW=layer.window > 0, **merge_consts)

    return run_split
