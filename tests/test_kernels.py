"""The Triton kernels against their torch versions (marked ``kernels``): on a GPU in bf16, and on the CPU in float32
under Triton's interpreter (tests/test_kernels_interpreted.py runs this file with TRITON_INTERPRET=1), so that
the CPU suite checks the kernels' logic on every commit. Shapes are smaller under the interpreter (numpy is slow)."""

from __future__ import annotations

import contextlib
import os

import pytest

torch = pytest.importorskip("torch")

from models import fused, fused_moe  # noqa: E402

pytestmark = pytest.mark.kernels
GPU = torch.cuda.is_available()
DEV, DT = ("cuda", torch.bfloat16) if GPU else ("cpu", torch.float32)
TOL = 2e-2 if GPU else 1e-4
"""bf16 kernels vs float32 torch references on the GPU; float32 against float32 under the interpreter."""


@contextlib.contextmanager
def torch_path():
    """Under the interpreter, make the entry points take their torch paths (the references)."""
    saved = fused.INTERPRETED
    fused.INTERPRETED = False
    try:
        yield
    finally:
        fused.INTERPRETED = saved


def random_paged_step(seed, group, kv_heads, head_dim, ctx_lens, query_lens, block_size, padded_rows=0,
                      padded_reqs=0):
    """A step over a random paged layout: request i has context ctx_lens[i] (its query_lens[i] new tokens the last
    ones) in blocks drawn at random from the cache, in random order, at a random block-table row; unused table
    entries hold other blocks' ids (a kernel that reads past a context reads wrong keys). Padded rows (position
    -1, slot -1) follow the real rows, in padded requests (sequence length 0) after the real ones.
    Returns (q, kv cache, metadata, real rows)."""
    import numpy as np

    from models.attention_metadata import AttentionMetadata

    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks) + 3
    kv = torch.randn(2, num_blocks + 1, block_size, kv_heads, head_dim, generator=gen).to(DEV, DT)
    table_rows = len(ctx_lens) + 2
    table = torch.from_numpy(rng.integers(0, num_blocks, size=(table_rows, max(blocks) + 2))).int()
    ids, rows = rng.permutation(num_blocks), rng.permutation(table_rows)[:len(ctx_lens)]
    taken = 0
    for row, n in zip(rows.tolist(), blocks):
        table[row, :n] = torch.from_numpy(ids[taken:taken + n]).int()
        taken += n
    pos = np.concatenate([np.arange(c - q, c) for c, q in zip(ctx_lens, query_lens)] + [np.full(padded_rows, -1)])
    req = np.concatenate([np.full(q, r) for r, q in zip(rows, query_lens)] + [np.zeros(padded_rows, np.int64)])
    num_tokens, num_real = pos.shape[0], int(sum(query_lens))
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    num_reqs = len(ctx_lens) + padded_reqs if padded_reqs else None
    meta = AttentionMetadata.from_tokens(slots.to(DEV), torch.from_numpy(req).int().to(DEV),
                                         torch.from_numpy(pos).int().to(DEV), table.to(DEV), num_reqs,
                                         max(query_lens) if padded_reqs else None)
    q = torch.randn(num_tokens, group * kv_heads, head_dim, generator=gen).to(DEV, DT)
    return q, kv, meta, num_real


def attention_scenarios():
    """(name, contexts, query lengths, padded rows, padded requests, tile override, forced splits): decode, uniform
    verification, varlen queries of 1..16 tokens, split contexts (forced; under the interpreter with tiles of 16
    keys, so that there are several slices), several query blocks a request (the searched grid), and a chunked
    prefill over a cached context beside decodes.
    Small contexts under the interpreter, serving-like ones on the GPU."""
    import random

    from models.triton_attention import AttentionTiles

    r = random.Random(5)
    if GPU:
        ctx = lambda n, lo, hi: [r.randint(lo, hi) for _ in range(n)]  # noqa: E731
        qs = [r.randint(1, 16) for _ in range(12)]
        return [
            ("decode", ctx(24, 1, 700), [1] * 24, 6, 6, None, None),
            ("verify-q8-split", ctx(6, 8, 2000), [8] * 6, 16, 2, None, 5),
            ("varlen", [c + q for c, q in zip(ctx(12, 0, 900), qs)], qs, 7, 1, None, None),
            ("varlen-split", [c + q for c, q in zip(ctx(12, 0, 900), qs)], qs, 7, 1, None, 3),
            ("query-blocks", ctx(5, 20, 600), [20] * 5, 0, 0, "small", 2),
            ("prefill-chunk", [1500, 77, 300], [500, 1, 1], 3, 1, None, None),
            ("prefill-chunk-split", [1500, 77, 300], [500, 1, 1], 3, 1, None, 2),
        ]
    ctx = lambda n, lo, hi: [r.randint(lo, hi) for _ in range(n)]  # noqa: E731
    qs = [r.randint(1, 16) for _ in range(3)]
    small = AttentionTiles(16, 16)
    return [
        ("decode", ctx(4, 1, 40), [1] * 4, 2, 2, None, None),
        ("verify-q8-split", ctx(2, 8, 50), [8] * 2, 8, 1, small, 3),
        ("varlen-split", [c + q for c, q in zip(ctx(3, 0, 30), qs)], qs, 3, 1, small, 4),
        ("query-blocks", ctx(2, 20, 40), [20] * 2, 0, 0, "small", None),
        ("prefill-chunk-split", [54, 9, 30], [24, 1, 1], 2, 1, small, 2),
    ]


ATTENTION_SHAPES = [(1, 64), (2, 64), (4, 128), (8, 128)] + ([(2, 128), (8, 64)] if GPU else [])
"""(GQA group, head_dim): bench-moe's heads are (2, 64), bench-moe-large's (8, 128)."""


@pytest.mark.parametrize("group,head_dim", ATTENTION_SHAPES)
def test_paged_attention_matches_a_float32_reference(group, head_dim):
    """The Triton kernel (and its split-context merge) against the float32 torch reference on random paged layouts:
    every real row within bf16 precision (the GPU) or float32's (the interpreter), every padded row exactly zero
    (outputs are NaN-poisoned first, so an unwritten row fails)."""
    from models.attention import paged_attention, reference_paged_attention
    from models.triton_attention import AttentionTiles

    kv_heads = 2 if GPU and group <= 4 else 1
    block_size = 16 if GPU else 4
    for i, (name, ctx, qlens, pad_rows, pad_reqs, tiles, splits) in enumerate(attention_scenarios()):
        q, kv, meta, num_real = random_paged_step(100 + i, group, kv_heads, head_dim, ctx, qlens, block_size,
                                                  pad_rows, pad_reqs)
        if tiles == "small":  # 20-token queries in blocks of 8 or 16 tokens: several query blocks a request
            tiles = AttentionTiles(max(16, group * 8), 16)
        out = torch.full_like(q, float("nan"))
        paged_attention(q, kv, meta, head_dim ** -0.5, out, tiles=tiles, num_kv_splits=splits)
        ref = reference_paged_attention(q.float(), kv.float(), meta, head_dim ** -0.5)
        got = out.float()
        assert torch.equal(got[num_real:], torch.zeros_like(got[num_real:])), name
        assert not got.isnan().any(), name
        rel = ((got - ref).norm() / ref.norm()).item()
        worst = (got - ref).abs().max().item()
        assert rel < (1e-2 if GPU else 1e-5) and worst < (3e-2 if GPU else 1e-4), (name, rel, worst)


@pytest.mark.gpu
def test_float32_attention_on_the_gpu_computes_in_float32():
    """A float32 model's attention on the GPU within float32's precision of the reference: Triton's tl.dot takes
    float32 inputs as TF32 unless told otherwise, which moved the default model's float32 logits by ~1e-3 and
    broke a near-tie (0.001 nats apart) differently in 1 + K-row verification than in one-row steps."""
    from models.attention import paged_attention, reference_paged_attention

    for i, (name, ctx, qlens, pad_rows, pad_reqs, _, splits) in enumerate(attention_scenarios()):
        q, kv, meta, num_real = random_paged_step(200 + i, 3, 3, 64, ctx, qlens, 16, pad_rows, pad_reqs)
        q, kv = q.float(), kv.float()
        out = torch.full_like(q, float("nan"))
        paged_attention(q, kv, meta, 64 ** -0.5, out, num_kv_splits=splits)
        ref = reference_paged_attention(q, kv, meta, 64 ** -0.5)  # float32 torch (TF32 off, its default)
        rel = ((out[:num_real] - ref[:num_real]).norm() / ref[:num_real].norm()).item()
        assert rel < 1e-5, (name, rel)


LAYER_VARIANTS = {
    "window 24": dict(window=24), "window 5 + softcap": dict(window=5, softcap=2.0), "softcap": dict(softcap=1.5),
    "fp8 cache": dict(k_scale=0.5, v_scale=2.0), "fp8 cache + window": dict(k_scale=0.25, v_scale=1.0, window=40),
}


@pytest.mark.parametrize("variant", list(LAYER_VARIANTS))
def test_paged_attention_with_a_window_softcap_or_fp8_cache_matches_the_reference(variant):
    """The layer options through the Triton kernel and the CPU path, on the scenarios above (split contexts and
    several query blocks a request included): a sliding window (a row sees its last ``window`` positions), logit
    soft-capping, and an FP8 (e4m3) cache holding K / k_scale and V / v_scale; against the float32 reference."""
    from models.attention import _to_cache, paged_attention, reference_paged_attention
    from models.attention_metadata import LayerAttention
    from models.triton_attention import AttentionTiles

    layer = LayerAttention(**LAYER_VARIANTS[variant])
    fp8 = "fp8" in variant
    group, head_dim, kv_heads, block_size = 2, 64, 2 if GPU else 1, 16 if GPU else 4
    for i, (name, ctx, qlens, pad_rows, pad_reqs, tiles, splits) in enumerate(attention_scenarios()):
        q, kv, meta, num_real = random_paged_step(300 + i, group, kv_heads, head_dim, ctx, qlens, block_size,
                                                  pad_rows, pad_reqs)
        if fp8:
            kv = torch.stack([_to_cache(kv[0], kv.to(torch.float8_e4m3fn), layer.k_scale),
                              _to_cache(kv[1], kv.to(torch.float8_e4m3fn), layer.v_scale)])
        if tiles == "small":
            tiles = AttentionTiles(max(16, group * 8), 16)
        ref = reference_paged_attention(q.float(), kv.float(), meta, head_dim ** -0.5, layer)
        for path in ("kernel", "torch"):
            out = torch.full_like(q, float("nan"))
            with torch_path() if path == "torch" else contextlib.nullcontext():
                paged_attention(q, kv, meta, head_dim ** -0.5, out, layer, **(
                    dict(tiles=tiles, num_kv_splits=splits) if path == "kernel" else {}))
            got = out.float()
            assert torch.equal(got[num_real:], torch.zeros_like(got[num_real:])), (name, path)
            rel = ((got - ref).norm() / ref.norm()).item()
            assert rel < (1e-2 if GPU else 1e-5), (variant, name, path, rel)


def test_norm_rotary_kv_write_and_silu_match_torch():
    import torch.nn.functional as F

    from models.attention import write_kv
    from models.layers import RotaryEmbedding

    torch.manual_seed(0)
    x, r = torch.randn(37, 1024, device=DEV, dtype=DT), torch.randn(37, 1024, device=DEV, dtype=DT)
    w = torch.randn(1024, device=DEV, dtype=DT)
    out, res = fused.rms_norm(x, w, 1e-6, r)
    ref, ref_res = fused.rms_norm_torch(x, w, 1e-6, r)
    torch.testing.assert_close(res, ref_res)
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), fused.rms_norm_torch(x, w, 1e-6), rtol=TOL, atol=TOL)
    # rotary on 6 query heads in place, and 2 key heads (rotated) + 2 value heads into the cache; slot -1 skipped
    rot = RotaryEmbedding(64, 4096, 10000.0).to(DEV)
    qkv = torch.randn(37, 10 * 64, device=DEV, dtype=DT)
    pos = torch.randint(0, 4000, (37,), device=DEV)
    slots = torch.randperm(80, device=DEV)[:37]
    slots[5] = slots[20] = -1
    q_ref = fused.rotary_torch(pos, qkv[:, :6 * 64].reshape(37, 6, 64), rot.cos, rot.sin)
    k_ref = fused.rotary_torch(pos, qkv[:, 6 * 64:8 * 64].reshape(37, 2, 64), rot.cos, rot.sin)
    kv_ref = torch.zeros(2, 6, 16, 2, 64, device=DEV, dtype=DT)  # 5 blocks of 16 slots + the dummy block
    write_kv(kv_ref, k_ref, qkv[:, 8 * 64:].reshape(37, 2, 64), slots)
    kv_ref[:, 5] = 0  # the torch path sends padded rows to the dummy block; the kernel stores nothing
    kv = torch.zeros_like(kv_ref)
    fused.rotary_write_kv_(qkv, pos, rot.cos, rot.sin, kv, slots, 6, 2, 64)
    torch.testing.assert_close(qkv[:, :6 * 64].reshape(37, 6, 64), q_ref, rtol=TOL, atol=TOL)
    torch.testing.assert_close(kv, kv_ref, rtol=TOL, atol=TOL)
    assert int((kv != 0).flatten(3).any(-1).sum()) == 2 * 35  # K and V of the 35 real rows: nothing else
    # Qwen3: each query and key head RMS-normalized with its own weights before rotary, in the same kernel
    qkv = torch.randn(37, 10 * 64, device=DEV, dtype=DT) * 3
    qw, kw = torch.rand(64, device=DEV, dtype=DT) + 0.5, torch.rand(64, device=DEV, dtype=DT) + 0.5
    q_ref = fused.rotary_torch(pos, fused.rms_norm_torch(qkv[:, :6 * 64].reshape(37, 6, 64), qw, 1e-6), rot.cos,
                               rot.sin)
    k_ref = fused.rotary_torch(pos, fused.rms_norm_torch(qkv[:, 6 * 64:8 * 64].reshape(37, 2, 64), kw, 1e-6),
                               rot.cos, rot.sin)
    kv_ref.zero_()
    write_kv(kv_ref, k_ref, qkv[:, 8 * 64:].reshape(37, 2, 64), slots)
    kv_ref[:, 5] = 0
    kv.zero_()
    fused.rotary_write_kv_(qkv, pos, rot.cos, rot.sin, kv, slots, 6, 2, 64, (qw, kw, 1e-6))
    torch.testing.assert_close(qkv[:, :6 * 64].reshape(37, 6, 64), q_ref, rtol=TOL, atol=TOL)
    torch.testing.assert_close(kv, kv_ref, rtol=TOL, atol=TOL)
    h = torch.randn(37, 2 * 768, device=DEV, dtype=DT)
    torch.testing.assert_close(fused.silu_mul(h), F.silu(h[:, :768]) * h[:, 768:], rtol=TOL, atol=TOL)


def test_argmax_and_its_probability_match_torch_in_one_pass():
    """Greedy sampling and the drafters' proposals: per row the first index of the largest logit (ties go to the
    earliest, as torch.argmax) and its softmax probability, over a vocabulary wider than one tile and not a
    multiple of it, read from a view of padded rows (compute_logits slices the padded LM head's columns off)."""
    torch.manual_seed(0)
    rows, vocab = (300, 49155) if GPU else (6, 9000)
    padded = torch.randn(rows, vocab + 13, device=DEV, dtype=DT) * 4
    logits = padded[:, :vocab]
    logits[1, 5000] = logits[1, 8999] = logits[1, 7] = 40.0  # a tie across tiles: the first wins
    logits[2, :] = 0.0  # every value equal: index 0, probability 1 / vocab
    logits[3, vocab - 1] = 50.0  # the last column, in the last, partial tile
    logits[4, : vocab // 2 + 1] = float("-inf")  # a first tile all -inf (masked tokens): still a probability
    ids, prob = fused.argmax_prob(logits)
    assert torch.equal(ids, logits.argmax(dim=-1))
    assert ids[1] == 7 and ids[2] == 0 and ids[3] == vocab - 1
    ref = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
    torch.testing.assert_close(prob, ref, rtol=1e-4, atol=1e-6)
    only_ids, none = fused.argmax_prob(logits, with_prob=False)
    assert none is None and torch.equal(only_ids, ids)


def test_penalize_matches_the_torch_path():
    """The fused penalties (models.sampling.apply_penalties' kernel) against its torch path: rows over a few slots
    of count tables, some rows without penalties (left as they were), with and without drafts before them, the
    vocabulary spanning partial blocks; the padding column untouched."""
    from models.sampling import Penalties, apply_penalties

    torch.manual_seed(1)
    rows, vocab, slots = (260, 49155, 300) if GPU else (7, 9000, 10)
    counts = torch.randint(0, 3, (slots, vocab + 1), device=DEV, dtype=torch.int32) * (
        torch.rand(slots, vocab + 1, device=DEV) < 0.01)
    seen = torch.rand(slots, vocab + 1, device=DEV) < 0.01
    row_slots = torch.randint(0, slots, (rows,), device=DEV)
    rep = torch.where(torch.rand(rows, device=DEV) < 0.3, 1.0, 1.5)
    pres = torch.where(torch.rand(rows, device=DEV) < 0.3, 0.0, 0.7)
    freq = torch.where(torch.rand(rows, device=DEV) < 0.5, 0.0, -0.4)
    rep[0], pres[0], freq[0] = 1.0, 0.0, 0.0  # a row without penalties
    for drafts in (None, torch.where(torch.rand(rows, 3, device=DEV) < 0.3, -1,
                                     torch.randint(0, vocab, (rows, 3), device=DEV))):
        work = torch.randn(rows, vocab + 1, device=DEV) * 3
        pen = Penalties(row_slots, counts, seen, rep, pres, freq, drafts)
        got = work.clone()
        apply_penalties(got, pen)
        with torch_path():
            want = work.clone()
            apply_penalties(want, pen)
        torch.testing.assert_close(got[:, :vocab], want[:, :vocab], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[0], work[0]) and torch.equal(got[:, vocab], work[:, vocab])


@pytest.mark.parametrize("norm", [True, False])
def test_moe_route_and_combine_match_torch(norm):
    """300 tokens (20 interpreted), 32 experts, top-8: the same segments and weights as the torch path (on the CPU,
    float32), each (token, choice) row holding its token, the combine equal, and the shared counts left zeroed."""
    torch.manual_seed(0)
    n = 300 if GPU else 20
    x = torch.randn(n, 256, device=DEV, dtype=DT)
    # distinct logits (ties would make the two top-k orders differ legitimately)
    logits = torch.stack([torch.randperm(32) for _ in range(n)]).float().div(8).to(DEV, DT)
    xs, offs, inv, wts = fused.moe_route(x, logits, 8, norm)
    with torch_path():
        xs_c, offs_c, inv_c, wts_c = fused.moe_route(x.cpu().float(), logits.cpu().float(), 8, norm)
    assert torch.equal(offs.cpu(), offs_c)
    assert not fused.expert_counts(x.device, 32).any()  # left zeroed (and the ticket) for the next layer
    torch.testing.assert_close(wts.cpu(), wts_c, rtol=1e-5, atol=1e-6)
    assert torch.equal(xs[inv].cpu().float(), xs_c[inv_c])
    y = torch.randn(n * 8, 256, device=DEV, dtype=DT)
    y_c = torch.empty(n * 8, 256)
    y_c[inv_c] = y[inv].cpu().float()  # the same value for each (token, choice) in the CPU order
    with torch_path():
        ref = fused.moe_combine(y_c, inv_c, wts_c)
    torch.testing.assert_close(fused.moe_combine(y, inv, wts).float().cpu(), ref, rtol=TOL, atol=TOL)
    # the combine fused with the residual add and the next norm: the separate kernels' result, and the torch path's
    residual, norm_w = torch.randn(n, 256, device=DEV, dtype=DT), torch.randn(256, device=DEV, dtype=DT)
    normed, res_out = fused.moe_combine_add_norm(y, inv, wts, residual, norm_w, 1e-6)
    sep_normed, sep_res = fused.rms_norm(fused.moe_combine(y, inv, wts), norm_w, 1e-6, residual)
    torch.testing.assert_close(res_out, sep_res, rtol=0, atol=0)
    torch.testing.assert_close(normed, sep_normed, rtol=TOL / 10, atol=TOL / 10)
    with torch_path():
        ref_normed, ref_res = fused.moe_combine_add_norm(y_c, inv_c, wts_c, residual.cpu().float(),
                                                         norm_w.cpu().float(), 1e-6)
    torch.testing.assert_close(res_out.float().cpu(), ref_res, rtol=TOL, atol=TOL)
    torch.testing.assert_close(normed.float().cpu(), ref_normed, rtol=3 * TOL, atol=3 * TOL)


@pytest.mark.parametrize("single_program", [True, False])
def test_routing_layout_holds_every_choice_once_in_its_experts_segment(single_program):
    """The expert-padded layout, on random steps: every (token, choice) has one row, inside its expert's segment
    (segments start at multiples of the tile height, in expert order, sized by the counts), the row holds it back,
    and each token's chosen experts are its top-k by router logit (the torch route's choice)."""
    import numpy as np

    saved = fused_moe.SINGLE_PROGRAM_MAX_CELLS
    fused_moe.SINGLE_PROGRAM_MAX_CELLS = saved if single_program else 0
    try:
        rng = np.random.default_rng(7)
        for _ in range(6):
            experts, top_k = int(rng.choice([8, 16, 32])), int(rng.choice([1, 2, 4, 8]))
            tokens, hidden, block_m = int(rng.integers(1, 49)), 64, int(rng.choice([16, 32, 64]))
            top_k = min(top_k, experts)
            # exact, distinct logits (no tie, no rounding difference between the router paths): token t's row is
            # a one-hot at a random column, and each router column is a permutation of 0..experts-1, over 8
            cols = torch.from_numpy(rng.integers(0, hidden, size=tokens))
            x = torch.nn.functional.one_hot(cols, hidden).to(DEV, DT)
            router = torch.stack([torch.randperm(experts) for _ in range(hidden)], 1).div(8).to(DEV, DT)
            r = fused_moe.route_and_align(x, router, top_k, True, block_m)
            with torch_path():
                _, ref_ends, ref_inv, ref_weights = fused.moe_route(x.cpu().float(), (x @ router.t()).cpu().float(),
                                                                     top_k, True)
            ends, counts = r.seg[:experts].cpu().numpy(), r.seg[experts:].cpu().numpy()
            padded = -(-counts // block_m) * block_m
            assert (ends == np.cumsum(padded)).all() and counts.sum() == tokens * top_k
            inv, sorted_ids = r.inv.cpu().numpy(), r.sorted_ids.cpu().numpy()
            assert len(set(inv.tolist())) == tokens * top_k
            assert (sorted_ids[inv] == np.arange(tokens * top_k)).all()
            starts = ends - padded
            chosen = np.searchsorted(ends, inv, side="right")  # the segment (expert) each row lies in
            assert (inv - starts[chosen] < counts[chosen]).all()
            # choice by choice, the experts of the torch route (unpadded segments there)
            assert (chosen == np.searchsorted(ref_ends.numpy(), ref_inv.numpy(), side="right")).all()
            torch.testing.assert_close(r.weights.cpu().float(), ref_weights, rtol=3 * TOL, atol=3 * TOL)
        assert not fused.expert_counts(x.device, experts).any()
    finally:
        fused_moe.SINGLE_PROGRAM_MAX_CELLS = saved


MOE_SHAPES = ([(32, 8, 1024, 512, True), (128, 8, 512, 768, False), (8, 2, 64, 32, True)] if GPU else
              [(16, 8, 128, 64, True), (16, 4, 64, 96, False), (8, 2, 64, 32, True)])
"""Under the interpreter each expert a step reaches costs its tiles' programs in Python: top-8 of 16 experts there
(half the programs of 32; test_moe_route_and_combine_match_torch and the routing-layout test route over 32)."""


def experts_reference(x, moe, routing, top_k):
    """The MoE output in float32 torch for a given routing (the experts each (token, choice) landed on, and the
    weights): what the Triton GEMMs must compute, whatever bf16 rounding did to near-tied router logits."""
    import numpy as np

    num_experts, inter = moe.w13.shape[0], moe.w2.shape[2]
    ends = routing.seg[:num_experts].cpu().numpy()
    chosen = torch.from_numpy(np.searchsorted(ends, routing.inv.cpu().numpy(), side="right"))
    xf, w13, w2 = x.cpu().float(), moe.w13.cpu().float(), moe.w2.cpu().float()
    weights = routing.weights.cpu().flatten()
    out = torch.zeros_like(xf)
    for e in chosen.unique().tolist():
        a = torch.nonzero(chosen == e).flatten()
        h = xf[a // top_k] @ w13[e].t()
        y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].t()
        out.index_add_(0, a // top_k, weights[a, None] * y)
    return out


@pytest.mark.parametrize("num_experts,top_k,hidden,inter,norm", MOE_SHAPES)
def test_triton_moe_matches_the_grouped_path_and_a_reference(num_experts, top_k, hidden, inter, norm, monkeypatch):
    """The small-step Triton experts (models/fused_moe.py), at every tile height, with routing in one program or
    in two kernels (atomic slots): equal (bf16 precision on the GPU) to float32 torch experts on the routing they
    chose (recorded from the call, not routed again), and under the interpreter (float32, no near-tie flips) to the
    grouped-GEMM path; the shared expert counts are left zeroed."""
    from models.layers import MoE

    routings = []
    route_and_align = fused_moe.route_and_align

    def recorded(*args, **kwargs):
        routings.append(route_and_align(*args, **kwargs))
        return routings[-1]

    monkeypatch.setattr(fused_moe, "route_and_align", recorded)

    torch.manual_seed(0)
    moe = MoE(hidden, num_experts, top_k, inter, norm).to(DEV, DT).requires_grad_(False)
    for p in moe.parameters():
        p.normal_(0.0, 0.05)
    saved, saved_cells = fused_moe.MAX_TOKENS, fused_moe.SINGLE_PROGRAM_MAX_CELLS
    try:
        for tokens in (1, 7, 64, 200) if GPU else (1, 7, 24):
            x = torch.randn(tokens, hidden, device=DEV, dtype=DT)
            if not GPU:
                fused_moe.MAX_TOKENS = 0
                with torch_path():
                    grouped = moe(x).float()
                fused_moe.MAX_TOKENS = 1 << 20
                torch.testing.assert_close(moe(x).float(), grouped, rtol=3 * TOL, atol=3 * TOL)
            fused_moe.MAX_TOKENS = 1 << 20
            for block_m, cells in [(16, saved_cells), (32, saved_cells), (64, saved_cells), (16, 0), (64, 0)]:
                fused_moe.SINGLE_PROGRAM_MAX_CELLS = cells
                tiles = fused_moe.MoETiles(block_m, 32, 64, 64, 32)
                routings.clear()
                out = fused_moe.fused_moe(x, moe.gate.weight, moe.w13, moe.w2, top_k, norm, tiles).float().cpu()
                assert len(routings) == 1 and routings[0].sorted_ids.shape[0] % block_m == 0
                ref = experts_reference(x, moe, routings[0], top_k)
                torch.testing.assert_close(out, ref, rtol=3 * TOL, atol=3 * TOL * float(ref.abs().max()))
            assert not fused.expert_counts(x.device, num_experts).any()
    finally:
        fused_moe.MAX_TOKENS, fused_moe.SINGLE_PROGRAM_MAX_CELLS = saved, saved_cells


@pytest.mark.parametrize("model_name", ["tiny-dense", "tiny-moe", "tiny-dense+qk_norm"])
def test_model_forward_through_the_kernels_matches_the_torch_path(model_name):
    """The whole wiring: a forward over a paged cache (a prefill chunk, then a decode step with a padded row)
    through the kernels equals the torch path's forward on the CPU in float32 (bf16 precision on the GPU), and
    leaves the same K and V in the cache. ``+qk_norm``: Qwen3's per-head q/k norms (random weights)."""
    from models.attention import allocate_kv_cache
    from models.attention_metadata import AttentionMetadata
    from models.config import preset
    from models.transformer import build_model

    base, _, extra = model_name.partition("+")
    cfg = preset(base).with_(qk_norm=extra == "qk_norm")
    runs = {}
    for name, dev, dt in (("kernels", DEV, DT), ("torch", "cpu", torch.float32)):
        ctx = torch_path() if name == "torch" else contextlib.nullcontext()
        with ctx, torch.inference_mode():
            model = build_model(cfg, "cpu", torch.float32, seed=3)
            if cfg.qk_norm:
                gen = torch.Generator().manual_seed(5)
                for layer in model.layers:
                    layer.q_norm.weight.copy_(torch.rand(cfg.head_dim, generator=gen) + 0.5)
                    layer.k_norm.weight.copy_(torch.rand(cfg.head_dim, generator=gen) + 0.5)
            model = model.to(dev, dt)  # the same weights on every device
            model.rotary.cos, model.rotary.sin = model.rotary.cos.float(), model.rotary.sin.float()
            kv = allocate_kv_cache(cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim, dt, dev)
            table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32, device=dev)
            outs = []
            # step 1: request 0 prefills 6 tokens, request 1 prefills 3
            ids = torch.tensor([5, 9, 11, 3, 7, 8, 21, 22, 23], device=dev)
            pos = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2], device=dev)
            req = torch.tensor([0] * 6 + [1] * 3, dtype=torch.int32, device=dev)
            slots = table[req.long(), pos // 4].long() * 4 + pos % 4
            outs.append(model(ids, pos, kv, AttentionMetadata.from_tokens(slots, req, pos.int(), table)).float().cpu())
            # step 2: one decode token each, plus a padded row (slot -1, position -1)
            ids, pos = torch.tensor([30, 31, 0], device=dev), torch.tensor([6, 3, 0], device=dev)
            req = torch.tensor([0, 1, 0], dtype=torch.int32, device=dev)
            slots = (table[req.long(), pos // 4].long() * 4 + pos % 4)
            slots[2] = -1
            tpos = pos.int().clone()
            tpos[2] = -1
            meta = AttentionMetadata.from_tokens(slots, req, tpos, table)
            outs.append(model(ids, pos, kv, meta).float().cpu()[:2])
            runs[name] = (outs, [c[:, :8].float().cpu() for c in kv])  # real blocks only (not the dummy)
    for got, want in zip(runs["kernels"][0] + runs["kernels"][1], runs["torch"][0] + runs["torch"][1]):
        torch.testing.assert_close(got, want, rtol=5 * TOL, atol=5 * TOL * max(1.0, float(want.abs().max())))


@pytest.mark.gpu_skip_ok
@pytest.mark.skipif(GPU, reason="on a GPU, tests/test_runtime.py compares graph replay with this static path")
@pytest.mark.parametrize("model_name", ["tiny-dense", "tiny-moe"])
def test_static_padded_path_through_the_kernels_matches_eager(model_name):
    """The runtime's padded static closures (FULL, PIECEWISE pieces, adaptive verification) through the kernels give
    the unpadded eager forward's rows, and padded rows (slot -1) store nothing at all, not even in the dummy block."""
    import numpy as np
    from dispatcher.runtime.graphs import StepInputs
    from test_runtime import decode_batch, make_runtime, run_both

    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive_verification": True}
    cfg, rt, disp = make_runtime(model_name, DEV, DT, {}, spec, graphs=False)
    seen, padded = set(), 0
    for num_reqs, q, decode in [(3, 4, True), (5, 1, True), (2, 8, False), (7, 4, True)]:  # 28 rows pad to 32
        host = decode_batch(rt, num_reqs, q, ctx=11)
        desc, replayed, eager = run_both(rt, disp, host, decode, q)
        seen.add((desc.kind, desc.mode))
        padded += desc.num_tokens > host.shape[1]
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
    assert {("uniform_decode", "FULL"), ("mixed", "PIECEWISE")} <= seen and padded >= 2
    # capture's safe inputs (every row padded) for the widest graph of each kind: attention writes zeros
    for kind in {key.kind for key in rt.graphs}:
        key = max((k for k in rt.graphs if k.kind == kind), key=lambda k: rt.layouts[k][0])
        tokens, layout = rt.layouts[key][0], rt._reset_metadata(key)
        rt.bufs.attn_out.fill_(float("nan"))
        rt._attention_runner(tokens, None, layout)(0)
        assert rt.bufs.attn_out[:tokens].eq(0).all(), key
    host = decode_batch(rt, 7, 1, ctx=20)  # 7 requests pad to an 8-request graph
    desc = disp.dispatch(7, 7, 1, True)
    before = [c.clone() for c in rt.kv_caches]
    rt.execute(desc, StepInputs.from_host(host, rt.device))
    written = {int(s) // 8 for s in host[2]}
    for c, b in zip(rt.kv_caches, before):
        changed = {i for i in range(c.shape[1]) if not torch.equal(c[:, i], b[:, i])}
        assert changed and changed <= written, (changed, written)
    assert np.unique(host[2] // 8).size == len(written)


@pytest.mark.parametrize("rows,cols,group", [(5, 96, None), (3, 320, 128), (1, 64, 32)])
def test_fp8_activation_quantization_matches_torch(rows, cols, group):
    """Dynamic FP8 quantization per token (or per token and group of columns): the Triton kernel gives the torch
    path's scales and e4m3 values; dequantized, every value is within half an e4m3 step of the input."""
    from models.fp8 import quantize_rows

    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(DEV, DT) * 3
    q, s = quantize_rows(x, group)
    with torch_path():
        q_ref, s_ref = quantize_rows(x.float().cpu(), group)
    torch.testing.assert_close(s.float().cpu(), s_ref, rtol=1e-6, atol=0)
    got, want = q.float().cpu(), q_ref.float()
    if not GPU:  # Triton's interpreter rounds to e4m3 without carrying a mantissa overflow into the exponent
        # (125.6 -> 64, not 128): only there, a power of two may come out halved
        halved = (got * 2 == want) & (torch.frexp(want)[0].abs() == 0.5)
        got = torch.where(halved, want, got)
    assert torch.equal(got, want)
    back = got.view(rows, -1, group or cols) * s_ref.cpu()[:, :, None] if cols % (group or cols) == 0 else None
    if back is not None:
        x32 = x.float().cpu().view_as(back)
        assert ((back - x32).abs() <= x32.abs() / 16 + 2 ** -9 * s_ref.max()).all()


@pytest.mark.parametrize("residual", [False, True])
def test_fp8_norm_and_activation_quantize_in_their_own_kernels_as_two_steps_would(residual):
    """A norm or an MLP activation feeding a per-channel FP8 projection quantizes its rows in its own kernel
    (``rms_norm_quant``, ``act_mul_quant``): the same e4m3 values and scales as ``quantize_rows`` of the unfused
    kernel's output, the residual as ``rms_norm`` leaves it; the activation over a row wider than one block (its
    two passes) and with GELU too."""
    from models.fp8 import FP8, act_mul_quant, quantize_rows, rms_norm_quant

    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(5, 96, generator=gen) * 3).to(DEV, DT)
    w = (torch.rand(96, generator=gen) + 0.5).to(DEV, DT)
    res = (torch.randn(5, 96, generator=gen)).to(DEV, DT) if residual else None
    got = rms_norm_quant(x, w, 1e-6, res)
    want = fused.rms_norm(x, w, 1e-6, res)
    (got_q, got_res), (want_norm, want_res) = (got, want) if residual else ((got, None), (want, None))
    want_q, want_s = quantize_rows(want_norm)
    assert got_q.q.dtype == FP8 and got_q.scale.shape == (5, 1) and got_q.dtype == DT
    assert torch.equal(got_q.q.float(), want_q.float()) and torch.equal(got_q.scale, want_s)
    assert got_res is None or torch.equal(got_res, want_res)
    h = (torch.randn(3, 2 * 1100, generator=gen) * 2).to(DEV, DT)
    for act, block in (("silu", 2048), ("silu", 512), ("gelu_tanh", 512)):  # (512: three blocks a row)
        got = act_mul_quant(h, act, block=block)
        want_q, want_s = quantize_rows(fused.silu_mul(h, act))
        assert torch.equal(got.q.float(), want_q.float()) and torch.equal(got.scale, want_s), (act, block)


@pytest.mark.parametrize("residual", [False, True])
def test_a_norm_scales_an_fp8_projections_unit_product_as_the_rowwise_gemm_would(residual):
    """An FP8 o_proj or down_proj leaves its per-token and per-channel scales to the residual add and norm that
    read its output (``ScaledRows``): the norm's kernel, plain or quantizing, gives bit for bit what it gives on
    the scaled product (``ScaledRows.value``, the row-wise scaled GEMM's output), the residual too."""
    from models.fp8 import ScaledRows, rms_norm_quant

    gen = torch.Generator().manual_seed(11)
    unit = (torch.randn(6, 96, generator=gen) * 300).to(DEV, DT)
    row_scale, col_scale = torch.rand(6, 1, generator=gen) * 1e-3, torch.rand(96, generator=gen) * 0.02
    rows = ScaledRows(unit, row_scale.to(DEV), col_scale.to(DEV))
    w = (torch.rand(96, generator=gen) + 0.5).to(DEV, DT)
    res = torch.randn(6, 96, generator=gen).to(DEV, DT) if residual else None
    scales = (rows.row_scale, rows.col_scale)
    got, want = fused.rms_norm(unit, w, 1e-6, res, scales), fused.rms_norm(rows.value(), w, 1e-6, res)
    for a, b in zip(*((got, want) if residual else ((got,), (want,)))):
        assert torch.equal(a, b)
    got, want = rms_norm_quant(unit, w, 1e-6, res, scales), rms_norm_quant(rows.value(), w, 1e-6, res)
    (got_q, got_res), (want_q, want_res) = (got, want) if residual else ((got, None), (want, None))
    assert torch.equal(got_q.q.float(), want_q.q.float()) and torch.equal(got_q.scale, want_q.scale)
    assert got_res is None or torch.equal(got_res, want_res)


def test_an_fp8_model_with_its_quantization_and_scales_fused_gives_the_unfused_logits():
    """A whole per-channel FP8 model's forward (ragged prompts), its producers quantizing their rows and o_proj and
    down_proj leaving their scales to the norms (``CausalLM.fuse_fp8_quantization``, every activation row count
    fused): the logits of the same model with nothing fused, bit for bit once the scales are the projections' own;
    with the scales in the norm, within float32's rounding (in bf16 on the GPU, where o and down's output is
    rounded once more before its scales: closer than the model with the same weights unquantized)."""
    import sys

    from models.config import preset
    from models.fp8 import Fp8Scheme
    from models.transformer import CausalLM

    sys.path.insert(0, os.path.dirname(__file__))
    from test_models_real import ragged_logits

    zeros = torch.zeros(16, 16, device=DEV).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(zeros, zeros.t(), scale_a=torch.ones((), device=DEV), scale_b=torch.ones((), device=DEV))
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch._scaled_mm does not run here: {err}")
    model = CausalLM(preset("tiny-dense"), Fp8Scheme()).to(DEV, DT).init_random(0)
    prompts = [[1, 5, 9, 33, 2], [7] * 6]
    reference = ragged_logits(CausalLM(preset("tiny-dense")).to(DEV, DT).init_random(0), prompts, DEV)
    assert model.fuse_fp8_quantization() == 5 * model.cfg.num_layers
    for layer in model.layers:
        layer.mlp.ACT_QUANT_MIN_ROWS = 0
    fused_logits = ragged_logits(model, prompts, DEV)
    for m in model.modules():
        m.scale_out = False
    unscaled = ragged_logits(model, prompts, DEV)
    moved = float((fused_logits - unscaled).norm() / unscaled.norm())
    assert moved < (float((unscaled - reference).norm() / reference.norm()) if GPU else 1e-5)
    for m in model.modules():
        m.quant_out = m.quant_down = False
    assert torch.equal(ragged_logits(model, prompts, DEV), unscaled)


@pytest.mark.parametrize("rows,out,inp,block", [(3, 256, 320, (128, 128)), (20, 96, 64, (32, 32))])
def test_block_fp8_gemm_matches_the_dequantized_product(rows, out, inp, block):
    """The block-scaled FP8 GEMM (per-token-group activation scales times per-block weight scales, one
    block-wide step of the reduction at a time) equals the float32 product of the quantized activations and the
    dequantized weights, a partial last block included."""
    from models.fp8 import block_fp8_linear, dequantize, quantize_blocks, quantize_rows

    gen = torch.Generator().manual_seed(out)
    x = torch.randn(rows, inp, generator=gen).to(DEV, DT)
    w, ws = quantize_blocks(torch.randn(out, inp, generator=gen) * 0.05, block)
    bias = torch.randn(out, generator=gen).to(DEV, DT)
    got = block_fp8_linear(x, w.to(DEV), ws.to(DEV), block, bias).float().cpu()
    xq, xs = quantize_rows(x, block[1])
    xd = dequantize(xq.cpu(), xs.cpu(), (1, block[1]))
    want = xd @ dequantize(w, ws, block).t() + bias.float().cpu()
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL * float(want.abs().max()))


def test_rotary_kv_write_into_an_fp8_cache_and_geglu_match_torch():
    """The fused rotary + KV write into an e4m3 cache stores K / k_scale and V / v_scale as the torch path does
    (the interpreter's e4m3 rounding may halve a value that rounds up to a power of two: compared after
    dequantization, within one e4m3 step); the GeGLU variant of the SiLU-and-multiply kernel matches torch."""
    import torch.nn.functional as F

    from models.attention import write_kv
    from models.attention_metadata import LayerAttention
    from models.layers import RotaryEmbedding

    torch.manual_seed(1)
    rot = RotaryEmbedding(64, 512, 10000.0).to(DEV)
    qkv = torch.randn(9, 8 * 64, device=DEV, dtype=DT) * 4
    pos = torch.randint(0, 500, (9,), device=DEV)
    slots = torch.randperm(32, device=DEV)[:9]
    layer = LayerAttention(k_scale=0.5, v_scale=2.0)
    k_ref = fused.rotary_torch(pos, qkv[:, 4 * 64:6 * 64].reshape(9, 2, 64), rot.cos, rot.sin)
    kv_ref = torch.zeros(2, 3, 16, 2, 64, device=DEV, dtype=torch.float8_e4m3fn)
    write_kv(kv_ref, k_ref, qkv[:, 6 * 64:].reshape(9, 2, 64), slots, layer)
    kv = torch.zeros_like(kv_ref)
    fused.rotary_write_kv_(qkv, pos, rot.cos, rot.sin, kv, slots, 4, 2, 64, None, (layer.k_scale, layer.v_scale))
    got, want = kv.float(), kv_ref.float()
    assert ((got - want).abs() <= want.abs() / 2 + 1e-3).all() and (got == want).float().mean() > 0.95
    h = torch.randn(5, 2 * 96, device=DEV, dtype=DT)
    want = F.gelu(h[:, :96].float(), approximate="tanh") * h[:, 96:].float()
    torch.testing.assert_close(fused.silu_mul(h, "gelu_tanh").float(), want, rtol=TOL, atol=TOL)


@contextlib.contextmanager
def torch_sampler():
    """``sample_tokens`` on its torch path (the reference): the fused sampler off, wherever the logits are."""
    from models import sampling

    saved = sampling.use_triton
    sampling.use_triton = lambda t: False
    try:
        with torch_path():
            yield
    finally:
        sampling.use_triton = saved


def test_fused_sampler_draws_the_torch_paths_tokens():
    """The one-kernel sampler (``models.fused.sample``, what ``sample_tokens`` runs without top-k and top-p) against
    the op-by-op torch path: greedy rows the first argmax (a tie across tiles included), sampled rows the same seeded
    Gumbel-max draw (the same random bits and the same float32 values), min_p rows the same tokens left out; also
    with the parameters read from per-slot tables, q rows a slot (a fused decode step's rows). On the GPU at the
    default model's vocabulary over many rows (bf16 logits, and float32 ones as processed logits are)."""
    from models.fused import sample
    from models.sampling import RowParams, sample_tokens

    torch.manual_seed(3)
    rows, vocab = (1024, 49152) if GPU else (12, 9000)
    for dtype in (DT, torch.float32):
        logits = (torch.randn(rows, vocab, device=DEV) * 3).to(dtype)
        logits[1, 5000] = logits[1, 8999] = logits[1, 7] = 40.0  # a greedy tie across tiles: the first wins
        temp = torch.where(torch.arange(rows, device=DEV) % 3 == 0, 0.0, 0.5 + torch.rand(rows, device=DEV))
        temp[1], temp[2], temp[4] = 0.0, 1e-9, 100.0  # greedy; a temperature the torch path clamps; a flat one
        seeds = torch.randint(-2**62, 2**62, (rows,), device=DEV)
        positions = torch.randint(0, 100_000, (rows,), device=DEV)
        min_p = torch.where(torch.rand(rows, device=DEV) < 0.5, 0.0, torch.rand(rows, device=DEV) * 0.3)
        min_p[5] = 1.0  # only the largest logits stay
        for mp in (None, min_p):
            params = RowParams(temp, None, None, seeds, min_p=mp)
            got = sample_tokens(logits, params, positions)
            with torch_sampler():
                want = sample_tokens(logits, params, positions)
            greedy = temp == 0
            assert torch.equal(got[greedy], logits[greedy].float().argmax(dim=-1)) and got[1] == 7
            assert (got[~greedy] != logits[~greedy].float().argmax(dim=-1)).any()  # (draws, not argmaxes)
            if mp is not None:
                assert got[5] == logits[5].float().argmax()  # min_p 1: the largest logit alone
            assert torch.equal(got, want), (got != want).sum().item()
        # per-slot tables: 3 rows a slot, slot order permuted, a padded slot (the last: greedy, min_p 0)
        q, num_slots = 3, rows // 3
        table_temp = torch.cat([temp[:num_slots], torch.zeros(1, device=DEV)])
        table_seed = torch.cat([seeds[:num_slots], torch.zeros(1, dtype=torch.int64, device=DEV)])
        table_min_p = torch.cat([min_p[:num_slots], torch.zeros(1, device=DEV)])
        slots = torch.randperm(num_slots + 1, device=DEV)[: num_slots]
        rows_slot = slots[:, None].expand(-1, q).reshape(-1)
        got = sample(logits[: num_slots * q], table_temp, table_seed, positions[: num_slots * q], table_min_p, slots, q)
        with torch_sampler():
            want = sample_tokens(logits[: num_slots * q], RowParams(table_temp[rows_slot], None, None,
                                                                   table_seed[rows_slot],
                                                                   min_p=table_min_p[rows_slot]),
                                 positions[: num_slots * q])
        assert torch.equal(got, want), (got != want).sum().item()


def test_the_sampler_draws_among_the_tokens_a_bitmask_allows_as_the_torch_path():
    """A constrained fused step's sampling (``models.sampling.sample_by_slot`` with ``bitmask``: the sampler's
    kernel reads each row's packed bitmask beside its logits) against its torch path (``apply_packed_bitmask``,
    then the sampler): random packed bitmasks with bit 31 (a negative int32 word) set and clear, a row of all bits
    set (drawn as if unconstrained), rows allowing a single token (drawn whatever the logits), a vocabulary that is
    not a multiple of 32, logits with a padded row stride (the step's buffer), greedy, sampled and min_p rows, with
    the penalties on; every token drawn is one its row allows, and the logits are left as they were."""
    from dispatcher.runtime.grammar import unpack_bitmask
    from models.sampling import SlotPenalties, sample_by_slot

    torch.manual_seed(7)
    rows, vocab, padded = (256, 49155, 49408) if GPU else (6, 5000, 5056)
    words = -(-vocab // 32)
    base = (torch.randn(rows, padded, device=DEV) * 3).to(DT)
    bits = torch.randint(-2**31, 2**31 - 1, (rows, words), device=DEV, dtype=torch.int64).to(torch.int32)
    bits[1] = -1
    bits[2] = 0
    bits[2, 4999 // 32] = 1 << (4999 % 32)  # (token 4999 alone)
    bits[3] = 0
    bits[3, 0] = -2**31  # (bit 31 alone: token 31)
    slots = torch.arange(rows, device=DEV)
    temp = torch.where(torch.arange(rows, device=DEV) % 2 == 0, 0.0, 0.8)
    seeds = torch.randint(0, 2**40, (rows,), device=DEV)
    min_p = torch.where(torch.arange(rows, device=DEV) % 4 == 1, 0.1, 0.0)
    positions = torch.randint(0, 10_000, (rows,), device=DEV)
    pen = SlotPenalties(torch.arange(rows, device=DEV) % 3 == 0,
                        torch.tensor([[1.3, 0.5, 0.1]], device=DEV).expand(rows, 3).contiguous(),
                        torch.randint(0, 2, (rows, vocab + 1), device=DEV, dtype=torch.int32),
                        torch.rand(rows, vocab + 1, device=DEV) < 0.05, torch.zeros(rows, 0, dtype=torch.int64,
                                                                                    device=DEV))
    logits = base[:, :vocab]
    got = sample_by_slot(logits, slots, 1, positions, temp, seeds, min_p, pen, bitmask=bits)
    assert torch.equal(base[:, :vocab], logits) and got[2] == 4999 and got[3] == 31
    with torch_sampler():
        want = sample_by_slot(base.clone()[:, :vocab], slots, 1, positions, temp, seeds, min_p, pen, bitmask=bits)
        free = sample_by_slot(base.clone()[:, :vocab], slots, 1, positions, temp, seeds, min_p, pen)
    assert torch.equal(got, want), (got != want).sum().item()
    assert got[1] == free[1] and not torch.equal(got, free)
    allowed = torch.as_tensor(unpack_bitmask(bits.cpu().numpy(), vocab))
    assert allowed[torch.arange(rows), got.cpu()].all()


def test_fused_sampler_penalizes_and_counts_as_the_torch_path():
    """A fused decode step's sampling with the penalties (``models.sampling.sample_by_slot``: one kernel reading the
    slots' penalty tables and drafts) against its torch path (the penalties on a float32 copy, then the torch
    sampler), q rows a slot, penalized and plain slots, greedy and sampled; then the accepted tokens counted
    (``models.fused.count_accepted``) as ``SamplingExtras.count`` counts them on the torch path."""
    from models.fused import count_accepted
    from models.sampling import SlotPenalties, sample_by_slot

    torch.manual_seed(5)
    num_slots, q, vocab = (300, 4, 49152) if GPU else (6, 3, 3000)
    n = num_slots - 1  # requests; the last slot is padding's (no request: not penalized)
    counts = (torch.randint(0, 3, (num_slots, vocab + 1), device=DEV, dtype=torch.int32)
              * (torch.rand(num_slots, vocab + 1, device=DEV) < 0.02)).to(torch.int32)
    seen = torch.rand(num_slots, vocab + 1, device=DEV) < 0.02
    penalized = torch.rand(num_slots, device=DEV) < 0.6
    penalized[-1] = False
    values = torch.stack([torch.full((num_slots,), 1.4, device=DEV), torch.rand(num_slots, device=DEV),
                          torch.rand(num_slots, device=DEV) - 0.3], dim=1)
    drafts = torch.randint(0, vocab, (num_slots, q - 1), device=DEV)
    pen = SlotPenalties(penalized, values, counts, seen, drafts)
    temp = torch.where(torch.rand(num_slots, device=DEV) < 0.4, 0.0, 0.9)
    seeds = torch.randint(0, 2**40, (num_slots,), device=DEV)
    min_p = torch.where(torch.rand(num_slots, device=DEV) < 0.5, 0.0, 0.1)
    slots = torch.randperm(num_slots, device=DEV)[:n]
    slots[-1] = num_slots - 1  # padding's slot among them
    logits = (torch.randn(n * q, vocab, device=DEV) * 3).to(DT)
    for d in range(q - 1):  # make the drafts and counted tokens matter: they lead where they are counted
        logits.view(n, q, vocab)[torch.arange(n, device=DEV), d + 1, drafts[slots, d]] += 8.0
    positions = torch.randint(0, 10_000, (n * q,), device=DEV)
    args = (logits, slots, q, positions, temp, seeds, min_p, pen)
    got = sample_by_slot(*args)
    with torch_sampler():
        want = sample_by_slot(*args)
        plain = sample_by_slot(*args[:-1])
    assert torch.equal(got, want), (got != want).sum().item()
    assert not torch.equal(got, plain)  # (the penalties changed some tokens)
    accepted = torch.randint(0, q, (n,), device=DEV)
    tokens = got.view(n, q)
    counted = counts.clone()
    count_accepted(slots, tokens, accepted, penalized, counted)
    expected = torch.zeros_like(counts)
    keep = torch.arange(q, device=DEV)[None, :] <= accepted[:, None]
    take = (penalized[slots][:, None] & keep).to(torch.int32)
    expected.index_put_((slots[:, None].expand(n, q), tokens), take, accumulate=True)
    assert torch.equal(counted, counts + expected)


def test_decode_inputs_and_their_advance_pack_what_the_torch_paths_pack(monkeypatch):
    """A fused decode step's inputs for n requests x q tokens (``FusedDecode._load``: per row its token, position,
    KV slot, block-table row and token position; per request its query start, sequence length and block-table row)
    and a proposing runtime's move to its next one-token step (``GraphRuntime._advance_inputs``), one kernel each
    (``models.fused.decode_inputs``, ``advance_inputs``), against their torch paths: real and padded requests, KV
    slots through a random block table, a real row that writes no KV, the buffer past the step untouched."""
    from types import SimpleNamespace

    from dispatcher.runtime import decode_step, graphs

    block_size, width, n = 16, 8, 7
    gen = torch.Generator().manual_seed(3)
    table = torch.randint(0, 500, (10, width), generator=gen, dtype=torch.int32).to(DEV)
    valid = torch.tensor([1, 1, 0, 1, 1, 0, 1], dtype=torch.bool, device=DEV)
    block_rows = torch.where(valid, torch.randperm(10, generator=gen)[:n].to(DEV), 0)
    fd = SimpleNamespace(_arange=torch.arange(64, device=DEV))

    def runtime(num_tokens: int, proposals: torch.Tensor):
        bufs = SimpleNamespace(inputs=torch.full((graphs.input_length(num_tokens, n) + 5,), 777, dtype=torch.int64,
                                                 device=DEV), block_table=table, aux=None, proposals=(proposals,))
        bufs.rows = lambda t: graphs.StaticBuffers.rows(bufs, t)
        bufs.requests = lambda t, r: graphs.StaticBuffers.requests(bufs, t, r)
        rt = SimpleNamespace(bufs=bufs, block_size=block_size)
        rt.kv_slots = lambda rows, positions: graphs.GraphRuntime.kv_slots(rt, rows, positions)
        return rt

    for q in (4, 1):
        computed = torch.randint(0, width * block_size - q - 3, (n,), generator=gen).to(DEV)
        positions = computed[:, None] + torch.arange(q, device=DEV)[None, :]
        ids = torch.randint(0, 1000, (n, q), generator=gen).to(DEV)
        proposals = torch.randint(0, 1000, (n * q,), generator=gen).to(DEV)
        packed = []
        for kernel in (True, False):
            monkeypatch.setattr(decode_step, "use_triton", lambda t, k=kernel: k and fused.use_triton(t))
            monkeypatch.setattr(graphs, "use_triton", lambda t, k=kernel: k and fused.use_triton(t))
            rt = runtime(n * q, proposals)
            decode_step.FusedDecode._load(fd, rt, block_rows, valid, ids, positions)
            steps = [rt.bufs.inputs.clone()]
            if q == 1:  # (one-token steps: the drafter's runtime moves on, twice; row 3 writes no KV)
                rt.bufs.rows(n)[2, 3] = -1
                for _ in range(2):
                    graphs.GraphRuntime._advance_inputs(rt, n, n)
                    steps.append(rt.bufs.inputs.clone())
            packed.append(steps)
        got, want = packed
        for a, b in zip(got, want):
            assert torch.equal(a, b), (a != b).nonzero().flatten().tolist()
        rows = got[-1][:5 * n * q].view(5, n * q)
        assert (rows[2][~valid.repeat_interleave(q)] == -1).all() and (got[-1][-5:] == 777).all()
    assert torch.equal(rows[1][valid], (positions[:, 0] + 2)[valid])  # (two steps on)


@pytest.mark.parametrize("q,given", [(4, False), (4, True), (1, False)], ids=["verify", "fixed", "no-drafts"])
def test_accept_drafts_verifies_and_advances_the_state_as_the_torch_path(q, given):
    """A fused step's verification in one kernel (``models.fused.accept_drafts``) against ``FusedDecode._finish``'s
    torch path: the leading drafts equal to the tokens drawn are accepted (``models.sampling.accepted_drafts``; or
    the fixed-acceptance mode's counts, given), the tokens up to them land after each slot's computed ones, the
    computed counts move past them, and each result row holds the count and the tokens (the last repeated to the
    width); padded requests write only the dummy slot's row."""
    from models.sampling import accepted_drafts

    gen = torch.Generator().manual_seed(7)
    n, width, num_slots, max_len = 9, 6, 12, 64
    dummy = num_slots - 1
    slots = torch.randperm(num_slots - 1, generator=gen)[:n]
    slots[-2:] = dummy  # (two padded requests)
    computed = torch.randint(0, max_len - q - 1, (n,), generator=gen)
    computed[-2:] = 0
    drafts = torch.randint(0, 5, (n, q - 1), generator=gen)
    tokens = torch.randint(0, 5, (n, q), generator=gen)
    if q > 1:  # (most drafts match: long accepted runs)
        tokens = torch.where(torch.rand(n, q, generator=gen) < 0.7, torch.cat([drafts, drafts[:, :1]], dim=1), tokens)
    token_ids = torch.randint(0, 1000, (num_slots, max_len), generator=gen)
    num_computed = torch.randint(0, 50, (num_slots,), generator=gen)
    fixed = torch.randint(0, q, (n,), generator=gen) if given else None
    want_acc = fixed if given else accepted_drafts(tokens, drafts, torch.full((n,), q - 1)) if q > 1 \
        else torch.zeros(n, dtype=torch.int64)
    want_ids, want_num = token_ids.clone(), num_computed.clone()
    cols = computed[:, None] + 1 + torch.arange(q)[None, :]
    keep = torch.arange(q)[None, :] <= want_acc[:, None]
    real = slots != dummy
    want_ids[slots[real][:, None].expand(-1, q)[keep[real]], cols[real][keep[real]]] = tokens[real][keep[real]]
    want_num[slots[real]] = (computed + 1 + want_acc)[real]
    out = torch.full((n + 2, 1 + width + 3), -7, dtype=torch.int32)
    args = [t.to(DEV) for t in (tokens, drafts, slots, computed, token_ids, num_computed, out)]
    acc = fused.accept_drafts(*args, width, fixed.to(DEV) if given else None)
    assert torch.equal(acc.cpu(), want_acc)
    assert torch.equal(args[4].cpu()[:dummy], want_ids[:dummy]) and torch.equal(args[5].cpu()[:dummy], want_num[:dummy])
    got_out = args[6].cpu()
    assert torch.equal(got_out[:n, 0], want_acc.int())
    assert torch.equal(got_out[:n, 1:1 + width], tokens[:, torch.arange(width).clamp(max=q - 1)].int())
    assert (got_out[n:] == -7).all() and (got_out[:n, 1 + width:] == -7).all()
    if q > 1 and not given:
        assert 0 < int(want_acc.sum()) < n * (q - 1)  # (some accepted, not all)
