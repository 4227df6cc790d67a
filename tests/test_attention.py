"""Attention metadata and launches: per-request metadata packed from per-token rows (as the runtime does it, in the
same host-to-device copy), launch shapes that depend only on static sizes, and (GPU) one captured graph replayed
over different steps. The kernel's numbers against a float32 reference are in tests/test_kernels.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from dispatcher.runtime.graphs import StepInputs  # noqa: E402
from models.attention_metadata import pack_requests  # noqa: E402
from models.triton_attention import (  # noqa: E402
    MAX_KV_SPLITS, MIN_SPLIT_TOKENS, SPLIT_PROGRAMS_PER_SM, AttentionTiles, choose_kv_splits, plan_launch)


def packed(token_req, positions, num_tokens, num_reqs=None, max_query_len=None):
    out = np.full(64, -7, dtype=np.int64)
    reqs, real, longest, _ = pack_requests(np.asarray(token_req, np.int64), np.asarray(positions, np.int64), out,
                                           num_tokens, num_reqs, max_query_len)
    return (out[:reqs + 1].tolist(), out[reqs + 1:2 * reqs + 1].tolist(), out[2 * reqs + 1:3 * reqs + 1].tolist(),
            real, longest)


def test_requests_are_packed_from_token_rows():
    """Runs of equal block-table rows are requests: query starts, sequence lengths (last position + 1), rows;
    padded rows go to padded requests (sequence length 0), in runs of at most the query-length bound."""
    req, pos = [5, 5, 5, 2, 7, 7], [10, 11, 12, 0, 3, 4]
    assert packed(req, pos, 6) == ([0, 3, 4, 6], [13, 1, 5], [5, 2, 7], 3, 3)
    # eager with padded rows: one padded request holds them all
    assert packed(req, pos, 9) == ([0, 3, 4, 6, 9], [13, 1, 5, 0], [5, 2, 7, 0], 3, 3)
    # a varlen graph's 6 request slots over 12 rows: the padded rows in runs of at most 3
    assert packed(req, pos, 12, 6, 3) == ([0, 3, 4, 6, 9, 12, 12], [13, 1, 5, 0, 0, 0], [5, 2, 7, 0, 0, 0], 3, 3)
    # a uniform decode graph (5 requests x q = 2) holding 3 real requests: each padded request gets q rows
    qs, seq, rows, real, longest = packed([4, 4, 0, 0, 9, 9], [7, 8, 2, 3, 30, 31], 10, 5, 2)
    assert qs == [0, 2, 4, 6, 8, 10] and seq == [9, 4, 32, 0, 0] and rows == [4, 0, 9, 0, 0]
    # an all-padding step (capture): every slot padded
    assert packed([], [], 4, 2, 2) == ([0, 2, 4], [0, 0], [0, 0], 0, 0)


@pytest.mark.parametrize("req,pos,tokens,slots,bound,field", [
    ([1, 1, 1], [4, 6, 7], 3, None, None, "positions"),   # a gap inside a request
    ([1, 1], [-1, 0], 2, None, None, "positions"),        # a padded position among the real rows
    ([1, 2, 3], [0, 0, 0], 4, 3, 1, "num_reqs"),          # padded rows but no padded request slot left
    ([1, 2, 3, 4], [0, 0, 0, 0], 4, 3, 1, "num_reqs"),    # more requests than slots
    ([1, 1, 1], [0, 1, 2], 3, 2, 2, "max_query_len"),     # a query longer than the graph's bound
    ([1], [0], 0, None, None, "num_tokens"),
])
def test_bad_steps_are_named(req, pos, tokens, slots, bound, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        packed(req, pos, tokens, slots, bound)


def test_launch_depends_only_on_static_sizes():
    """Tiles, grid and split count come from sizes a graph fixes (rows, request slots, the query bound, the block
    table's width, the SM count): decode tiles hold the whole query (one program per request and KV head),
    longer queries search their request; contexts split only while the launch is too small for the GPU."""
    # bench-moe decode, 256 requests x q = 8: 16-row tiles (8 tokens x 2 heads), one per request, no split
    d = plan_launch(2048, 16, 8, 64, 256, 8, 4096, 132)
    assert d.tiles.block_m == 16 and d.block_q == 8 and d.one_qblock and d.grid0 == 256 and d.splits == 1
    # bench-moe-large at q = 16: 128 rows (16 tokens x 8 heads)
    assert plan_launch(64, 32, 4, 128, 4, 16, 4096, 132).tiles.block_m == 128
    # 1 request x 8192 tokens at q = 1: 8 programs, split into slices of 256 tokens
    one = plan_launch(1, 16, 8, 64, 1, 1, 8192, 132)
    assert one.splits == 8192 // MIN_SPLIT_TOKENS
    # a prefill chunk: searched grid, tokens // block_q + requests
    p = plan_launch(2048, 16, 8, 64, 3, 2048, 8192, 132)
    assert not p.one_qblock and p.grid0 == 2048 // p.block_q + 3
    # overrides
    assert plan_launch(8, 4, 2, 16, 2, 4, 64, 132, AttentionTiles(16, 16), 3).splits == 3
    with pytest.raises(ValueError, match="^head_dim"):
        plan_launch(8, 4, 2, 48, 2, 4, 64, 132)
    with pytest.raises(ValueError, match="^num_reqs"):
        plan_launch(8, 4, 2, 64, 0, 4, 64, 132)


def test_split_count_fills_the_gpu_within_its_bounds():
    sms = 132
    target = sms * SPLIT_PROGRAMS_PER_SM
    for programs in (1, 3, 8, 64, 128, 500, target - 1, target, 10 * target):
        for context in (64, 512, 4096, 131072):
            s = choose_kv_splits(programs, context, sms)
            assert 1 <= s <= MAX_KV_SPLITS
            if programs >= target:
                assert s == 1
            else:
                assert s <= max(1, context // MIN_SPLIT_TOKENS)
                assert s == max(1, min(-(-target // programs), context // MIN_SPLIT_TOKENS, MAX_KV_SPLITS))


def test_runtime_packs_request_metadata_into_its_one_copy():
    """The graph runtime's staging: a FULL decode graph of 8 requests holding 7 real ones at q = 4 (a padded
    request of 4 rows), and a PIECEWISE step (exact requests over the real rows), land in the static buffer
    right after the token rows; a step whose request's positions are not consecutive is refused by name."""
    from test_runtime import decode_batch, make_runtime

    _, rt, disp = make_runtime("tiny-dense", "cpu", torch.float32, {}, {"method": "ngram", "num_speculative_tokens": 3},
                               graphs=False)
    host = decode_batch(rt, 7, 4, ctx=11)
    desc = disp.dispatch(28, 7, 4, True)
    assert desc.mode == "FULL" and desc.num_reqs == 8
    rt.execute(desc, StepInputs.from_host(host, rt.device))
    qs, seq, rows = (t.tolist() for t in rt.bufs.requests(32, 8))
    assert qs == list(range(0, 33, 4)) and seq == [15] * 7 + [0] and rows == list(range(7)) + [0]
    assert rt.bufs.rows(32)[4, 28:].eq(-1).all()  # padded rows: position -1
    host = decode_batch(rt, 3, 8, ctx=11)
    desc = disp.dispatch(24, 3, 8, False)
    assert desc.mode == "PIECEWISE" and desc.num_tokens > 24
    rt.execute(desc, StepInputs.from_host(host, rt.device))
    qs, seq, rows = (t.tolist() for t in rt.bufs.requests(desc.num_tokens, 3))
    assert qs == [0, 8, 16, 24] and seq == [19] * 3 and rows == [0, 1, 2]
    host[1, 15] += 1  # request 1's last row: positions 11..17, 19
    with pytest.raises(ValueError, match="^positions: request 1"):
        StepInputs.from_host(host, rt.device)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, None])
def test_one_captured_attention_serves_different_steps(splits):
    """Capture the attention of a fixed layout (16 request slots x q = 4, bench-moe heads) once, then replay it over
    steps with different real request counts, contexts and block tables written into the same buffers: each replay
    equals the float32 reference for that step. The launch never read the metadata's values."""
    from models.attention import paged_attention, reference_paged_attention
    from models.attention_metadata import AttentionMetadata

    dev, dt, block, width = "cuda", torch.bfloat16, 16, 64
    num_reqs, q_len, heads, kv_heads, dim = 16, 4, 16, 8, 64
    tokens = num_reqs * q_len
    kv = torch.randn(2, 2049, block, kv_heads, dim, device=dev, dtype=dt)
    table = torch.zeros(num_reqs, width, dtype=torch.int32, device=dev)
    packed_meta = torch.zeros(3 * num_reqs + 1, dtype=torch.int64, device=dev)
    token_rows = torch.zeros(2, tokens, dtype=torch.int64, device=dev)
    q = torch.randn(tokens, heads, dim, device=dev, dtype=dt)
    out = torch.empty_like(q)
    meta = AttentionMetadata(torch.full((tokens,), -1, device=dev), token_rows[0], token_rows[1], table,
                             packed_meta[:num_reqs + 1], packed_meta[num_reqs + 1:2 * num_reqs + 1],
                             packed_meta[2 * num_reqs + 1:], q_len)
    rng = np.random.default_rng(0)

    def load_step(real):
        ctx = rng.integers(q_len, width * block, size=real)
        pos = np.concatenate([np.arange(c - q_len, c) for c in ctx] + [np.full(tokens - real * q_len, -1)])
        req = np.concatenate([np.repeat(np.arange(real), q_len), np.zeros(tokens - real * q_len, np.int64)])
        host = np.empty(3 * num_reqs + 1, np.int64)
        pack_requests(req[:real * q_len], pos[:real * q_len], host, tokens, num_reqs, q_len)
        packed_meta.copy_(torch.from_numpy(host))
        token_rows.copy_(torch.from_numpy(np.stack([req, pos])))
        table.copy_(torch.from_numpy(rng.permutation(2048)[:num_reqs * width].reshape(num_reqs, width)))
        q.normal_()

    load_step(num_reqs)
    run = lambda: paged_attention(q, kv, meta, dim ** -0.5, out, num_kv_splits=splits)  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for real in (16, 3, 11, 1):
        load_step(real)
        out.fill_(float("nan"))
        graph.replay()
        ref = reference_paged_attention(q.float(), kv.float(), meta, dim ** -0.5)
        got = out.float()
        assert torch.equal(got[real * q_len:], torch.zeros_like(got[real * q_len:]))
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2


def test_full_mode_token_graphs_generate_as_eager():
    """cudagraph_mode FULL: prefill and mixed steps run in token-keyed FULL graphs too (request slots
    min(S, max_num_reqs + 1), the query bound S), and greedy generation equals eager."""
    from dispatcher.engine.engine_core import EngineArgs, EngineCore
    from dispatcher.plan.config import resolve
    from models.config import preset
    from scheduler.request import SamplingParams
    from test_runtime import random_prompts

    args = EngineArgs(preset("tiny-dense"), num_kv_blocks=300, block_size=8, max_model_len=128)
    cc = dict(platform="sm100", max_num_seqs=8, max_num_batched_tokens=128)
    prompts = random_prompts(10, 4, vocab=300)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    full = EngineCore(resolve({"cudagraph_mode": "FULL"}, None, **cc), args)
    assert any(k[0] == "full" for k in full.worker.runtime.layouts)
    eager = EngineCore(resolve({"cudagraph_mode": "NONE"}, None, **cc), args)
    assert full.generate(prompts, params) == eager.generate(prompts, params)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_full_mixed_graphs_generate_as_piecewise_with_an_eagle3_head(device, tmp_path):
    """max_full_mixed_cudagraph_capture_tokens: mixed steps up to the cap replay FULL graphs over tokens, for the
    target and the EAGLE-3 head's step 0, larger ones PIECEWISE; uniform decodes keep their fused FULL graphs; and
    greedy speculative generation gives the tokens the PIECEWISE engine gives (on the GPU: under CUDA graphs)."""
    import dataclasses
    import json

    from dispatcher.engine.engine_core import EngineArgs, EngineCore
    from dispatcher.plan.config import resolve
    from models.config import preset
    from scheduler.request import SamplingParams
    from test_runtime import random_prompts

    args = EngineArgs(preset("tiny-dense"), num_kv_blocks=300, block_size=8, max_model_len=160, device=device)
    cc = dict(platform="sm100", max_num_seqs=8, max_num_batched_tokens=256)
    spec = {"method": "eagle3", "num_speculative_tokens": 2}
    prompts = random_prompts(10, 4, vocab=300) + [list(range(5, 105))]  # (a 100-token prompt: above the cap)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    trace = tmp_path / "trace.jsonl"
    on = EngineCore(resolve({"max_full_mixed_cudagraph_capture_tokens": 64}, spec, **cc),
                    dataclasses.replace(args, step_trace=str(trace)))
    off = EngineCore(resolve({}, spec, **cc), args)
    assert on.generate(prompts, params) == off.generate(prompts, params)
    on.close()
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    mixed = {(r["mode"], r["graph"][0] if r["graph"] else None, r["tokens"] <= 64) for r in steps
             if r["kind"] == "mixed"}
    assert ("FULL", "full", True) in mixed and ("PIECEWISE", "piecewise", False) in mixed
    assert {m for m in mixed if m[2]} == {("FULL", "full", True)}  # (every mixed step within the cap)
    assert any(r["kind"] == "mixed" and r["mode"] == "FULL" and r["draft"][0]["graph"][0] == "full" for r in steps)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_full_mixed_graphs_over_cached_prefixes_generate_as_piecewise(device, tmp_path):
    """A multi-turn burst on FULL mixed graphs: requests whose prompts continue a cached prefix (their query a few
    tokens, their context the cached blocks, several in one step beside decodes) give the greedy tokens the
    PIECEWISE engine gives, and the trace shows FULL mixed steps that found cached tokens."""
    import dataclasses
    import json

    from dispatcher.engine.engine_core import EngineArgs, EngineCore
    from dispatcher.plan.config import resolve
    from models.config import preset
    from scheduler.request import SamplingParams
    from test_runtime import random_prompts

    args = EngineArgs(preset("tiny-dense"), num_kv_blocks=400, block_size=8, max_model_len=256, device=device)
    cc = dict(platform="sm100", max_num_seqs=8, max_num_batched_tokens=256)
    history = random_prompts(6, 11, vocab=300)  # (each conversation's first turn)
    turns = [h + list(range(7, 7 + 3 + i)) for i, h in enumerate(history)]  # (the next turn: its history and more)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    trace = tmp_path / "trace.jsonl"
    got = {}
    for name, config, engine_args in (("full", {"max_full_mixed_cudagraph_capture_tokens": 128},
                                        dataclasses.replace(args, step_trace=str(trace))),
                                       ("piecewise", {}, args)):
        engine = EngineCore(resolve(config, None, **cc), engine_args)
        got[name] = engine.generate(history, params), engine.generate(turns, params)
        engine.close()
    assert got["full"] == got["piecewise"]
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    cached = [r for r in steps if r["kind"] == "mixed" and r["mode"] == "FULL" and r.get("prefix_cache_hits")]
    assert cached and max(r["admitted"] for r in cached) >= 2  # (several continuations in one FULL mixed step)


@pytest.mark.parametrize("contexts, rows", [((37, 37, 37), [0, 1, 2]), ((37, 37), [1, 0]), ((12, 30), [0, 1]),
                                            ((20, 20, -1), [0, 1, 0])])
def test_cpu_attention_matches_the_reference(contexts, rows):
    """The CPU path's shortcuts (one-token queries over equal contexts: no mask; in request order with no padding:
    no gather or scatter) give the reference's output, as its general path does (unequal contexts, requests out
    of row order, a padded row)."""
    from models.attention import paged_attention, reference_paged_attention
    from models.attention_metadata import AttentionMetadata

    block, heads, kv_heads, dim = 8, 6, 2, 16
    kv = torch.randn(2, 40, block, kv_heads, dim)
    table = torch.randperm(40)[:24].reshape(3, 8).int()
    pos = torch.tensor([c - 1 for c in contexts])
    req = torch.tensor(rows)
    q = torch.randn(len(contexts), heads, dim)
    slots = torch.where(pos >= 0, table[req, pos.clamp(min=0) // block].long() * block + pos.clamp(min=0) % block, -1)
    meta = AttentionMetadata.from_tokens(slots, req, pos, table)
    got = paged_attention(q, kv, meta, dim ** -0.5)
    ref = reference_paged_attention(q, kv, meta, dim ** -0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(16, 8, 64), (32, 4, 128), (9, 3, 64), (6, 2, 16)])
@pytest.mark.parametrize("bound", [None, 1024], ids=["every-step", "first-steps"])
def test_the_eager_warm_up_launches_every_variant_a_step_can_need(heads, kv_heads, head_dim, bound):
    """Every compiled variant of the attention kernels (tiles, one query block or not, split or not, the merge's
    padded split count, programmatic launch or not) that some eager step's sizes produce is among those
    ``eager_launch_shapes`` launches at start-up: a variant met first while serving stalls its step for Triton's
    compile. Delayed capture's start-up (``bound``) warms only the variants of steps and sequences of up to 1024
    tokens, fewer than all, and those cover every such step."""
    import triton

    from models.fused import PDL_MAX_TOKENS
    from models.triton_attention import eager_launch_shapes

    def variant(launch, pdl):
        return launch.tiles, launch.one_qblock, launch.splits > 1, triton.next_power_of_2(launch.splits), pdl

    sms, max_tokens, width = 132, 2048, 4096 + 32
    limit = bound or width
    shapes = eager_launch_shapes(heads, kv_heads, head_dim, min(max_tokens, limit), min(width, limit), sms)
    warmed = {variant(plan_launch(q, heads, kv_heads, head_dim, 1, q, width, sms, num_kv_splits=s), pdl)
              for q, s, pdl in shapes}
    if bound is not None:
        assert set(shapes) < set(eager_launch_shapes(heads, kv_heads, head_dim, max_tokens, width, sms))
    seen = set()
    for max_q in (1, 2, 3, 5, 8, 9, 12, 16, 17, 33, 64, 65, 100, 512, 1000, 1024, 2048):
        for reqs in (1, 2, 7, 64, 255):
            tokens = min(max_tokens, max_q * reqs)
            if tokens < max_q or tokens > limit:
                continue
            for context in (16, 300, 767, 768, 1000, 1024, 1280, 4096, width):
                if context >= max_q and context <= limit:
                    seen.add(variant(plan_launch(tokens, heads, kv_heads, head_dim, reqs, max_q, context, sms),
                                     tokens <= PDL_MAX_TOKENS))
    assert seen <= warmed, seen - warmed
