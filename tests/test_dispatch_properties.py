"""Property tests (hypothesis): over random configurations and batches, dispatch picks the smallest covering
graph of the batch's kind, never a FULL graph for a mixed batch but a token-keyed one (mode FULL's, or FULL mixed
graphs below the PIECEWISE ones), and never a decode graph over the budget."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher.plan.config import ConfigError, resolve
from dispatcher.plan.dispatch import (ADAPTIVE_VERIFICATION, MIXED, UNIFORM_DECODE, Dispatcher, dispatch_step,
                                      dispatchers_for_plan)
from dispatcher.plan.capture_plan import FULL, FULL_DECODE, FULL_VARLEN, PIECEWISE, build_plan
from scheduler.scheduler import BatchShape

METHODS = ["eagle", "eagle3", "mtp", "mtp_multi", "dspark", "dflash", "ngram", "draft_model"]
MODES = ["FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "FULL", "NONE"]
sorted_sizes = lambda hi: st.lists(st.integers(1, hi), min_size=0, max_size=12)  # noqa: E731


@st.composite
def configs(draw, methods=METHODS, ks=(0, 1, 2, 3, 5, 7, 15)):
    platform = draw(st.sampled_from(["sm100", "default"]))
    max_num_seqs = draw(st.sampled_from([1, 3, 8, 50, 72, 128, 256, 300, 512, 1024]))
    max_num_batched_tokens = draw(st.sampled_from([t for t in (64, 512, 2048, 4000, 8192, 16384) if t >= max_num_seqs]))
    k = draw(st.sampled_from(ks))
    spec = None
    if k:
        spec = {"method": draw(st.sampled_from(methods)), "num_speculative_tokens": k}
        if spec["method"] == "draft_model":
            spec["model"] = "tiny-dense"
        if k >= 2 and draw(st.booleans()):
            bounds = sorted(draw(st.sets(st.integers(2, 1200), min_size=1, max_size=3)))
            ks = sorted(draw(st.lists(st.integers(1, k), min_size=len(bounds) + 1, max_size=len(bounds) + 1)),
                        reverse=True)
            spec["num_speculative_tokens_per_batch_size"] = [[1, ks[0]]] + [[b, kk] for b, kk in zip(bounds, ks[1:])]
    cc: dict = {}
    sizing = draw(st.sampled_from(["default", "caps", "lists", "legacy_max", "legacy_list", "empty"]))
    if sizing == "caps":
        cc["max_prefill_cudagraph_capture_tokens"] = draw(st.integers(1, 16384))
        cc["max_decode_cudagraph_capture_requests"] = draw(st.integers(1, 1024))
    elif sizing == "lists":
        cc["prefill_cudagraph_capture_token_sizes"] = draw(sorted_sizes(16384))
        cc["decode_cudagraph_capture_request_sizes"] = draw(sorted_sizes(1024))
    elif sizing == "legacy_max":
        cc["max_cudagraph_capture_size"] = draw(st.integers(1, 8192))
    elif sizing == "legacy_list":
        cc["cudagraph_capture_sizes"] = draw(sorted_sizes(8192))
    elif sizing == "empty":
        cc[draw(st.sampled_from(["prefill_cudagraph_capture_token_sizes", "decode_cudagraph_capture_request_sizes"]))] = []
    budget = draw(st.sampled_from(["unset", None, 256, 4096]))
    if budget != "unset":
        cc["max_decode_cudagraph_capture_tokens"] = budget
    mode = draw(st.sampled_from(MODES))
    cc["cudagraph_mode"] = mode
    if mode == "FULL_AND_PIECEWISE" and sizing in ("default", "caps") and draw(st.booleans()):
        cc["max_full_mixed_cudagraph_capture_tokens"] = draw(st.sampled_from([1, 8, 200, 512, 16384]))
    if spec and mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY") and sizing != "empty" and draw(st.booleans()):
        spec["adaptive_verification"] = True
    limits = dict(platform=platform, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    try:
        return resolve(cc, spec, **limits)
    except ConfigError as exc:  # random lists can leave adaptive verification without graphs: a tested error
        assert "adaptive_verification" in str(exc)
        spec.pop("adaptive_verification")
        return resolve(cc, spec, **limits)


def smallest_at_least(sizes, n):
    return min((s for s in sizes if s >= n), default=None)


def sets_of(plan, runner="target"):
    return {(g.kind, g.q): g.sizes for g in plan.for_runner(runner)}


def target_of(cfg):
    """The target's graph sets by (kind, q), and its dispatcher."""
    plan = build_plan(cfg)
    return sets_of(plan), dispatchers_for_plan(plan)["target"]


def expected_by_tokens(sets, mode_full, num_tokens, max_num_batched_tokens):
    """By tokens: FULL mixed graphs first where FULL_AND_PIECEWISE has them (max_full_mixed_...), else the mode's
    token set."""
    full_mixed = smallest_at_least(sets.get((FULL, None), ()), num_tokens) if (PIECEWISE, None) in sets else None
    if full_mixed is not None and num_tokens <= max_num_batched_tokens:
        return (FULL, full_mixed)
    kind = FULL if mode_full else PIECEWISE
    padded = smallest_at_least(sets.get((kind, None), ()), num_tokens) if num_tokens <= max_num_batched_tokens else None
    return (kind, padded)


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(cfg=configs(), data=st.data())
def test_uniform_decode_gets_smallest_covering_full_graph(cfg, data):
    sets, d = target_of(cfg)
    q = data.draw(st.integers(1, 1 + cfg.num_speculative_tokens + 1))
    top = min(cfg.max_num_seqs, cfg.max_num_batched_tokens // q)
    if top < 1:
        return
    n = data.draw(st.integers(1, top))
    desc = d.dispatch(n * q, n, q, True)
    assert desc.kind == UNIFORM_DECODE and desc.q == q
    full = smallest_at_least(sets.get((FULL_DECODE, q), ()), n)
    if full is not None:
        assert (desc.mode, desc.num_reqs, desc.num_tokens) == ("FULL", full, full * q)
        assert desc.graph == (FULL_DECODE, q, full)
        assert full * q <= cfg.decode_token_limit()
        return
    varlen = smallest_at_least(sets.get((FULL_VARLEN, None), ()), n * q)
    if varlen is not None and n * q <= cfg.max_num_batched_tokens:  # adaptive verification's graphs hold it
        assert desc.mode == "FULL" and desc.graph == (FULL_VARLEN, None, varlen) and desc.num_reqs >= n
        return
    kind, padded = expected_by_tokens(sets, cfg.cudagraph_mode.value == "FULL", n * q, cfg.max_num_batched_tokens)
    if padded is None:
        assert (desc.mode, desc.num_tokens, desc.num_reqs, desc.graph) == ("NONE", n * q, n, None)
    else:
        assert desc.graph == (kind, None, padded) and desc.num_tokens == padded


@SETTINGS
@given(cfg=configs(), data=st.data())
def test_mixed_batch_never_gets_a_decode_graph(cfg, data):
    sets, d = target_of(cfg)
    num_tokens = data.draw(st.integers(1, cfg.max_num_batched_tokens))
    num_reqs = data.draw(st.integers(1, min(num_tokens, cfg.max_num_seqs)))
    desc = d.dispatch(num_tokens, num_reqs, num_tokens - num_reqs + 1, False)
    assert desc.kind == MIXED
    mode_full = cfg.cudagraph_mode.value == "FULL"
    if not mode_full and not cfg.full_mixed_token_sizes:
        assert desc.mode != "FULL"
    kind, padded = expected_by_tokens(sets, mode_full, num_tokens, cfg.max_num_batched_tokens)
    if padded is None:
        assert (desc.mode, desc.num_tokens, desc.num_reqs) == ("NONE", num_tokens, num_reqs)
    else:
        assert desc.graph == (kind, None, padded) and desc.num_tokens == padded
        assert desc.num_reqs >= num_reqs


@SETTINGS
@given(cfg=configs(), data=st.data())
def test_adaptive_verification_gets_smallest_varlen_graph(cfg, data):
    if cfg.num_speculative_tokens == 0:
        return
    sets, d = target_of(cfg)
    q_max = 1 + cfg.num_speculative_tokens
    num_reqs = data.draw(st.integers(2, max(2, min(cfg.max_num_seqs, cfg.max_num_batched_tokens // q_max))))
    if num_reqs > cfg.max_num_seqs:
        return
    lens = data.draw(st.lists(st.integers(1, q_max), min_size=num_reqs, max_size=num_reqs))
    if len(set(lens)) == 1:
        return
    desc = d.dispatch_query_lens(lens, True)
    total = sum(lens)
    assert desc.kind == ADAPTIVE_VERIFICATION
    av = (FULL_VARLEN, None) if (FULL_VARLEN, None) in sets else (FULL, None)
    padded = smallest_at_least(sets.get(av, ()), total)
    if padded is not None:
        assert desc.mode == "FULL" and desc.num_tokens == padded and desc.graph == (av[0], None, padded)
        assert desc.num_reqs >= len(lens)
    else:  # by tokens: FULL only on a token-keyed FULL graph (mode FULL's, or a FULL mixed one)
        assert desc.mode != "FULL" or desc.graph.kind == FULL


@SETTINGS
@given(cfg=configs())
def test_plan_invariants(cfg):
    plan = build_plan(cfg)
    for g in plan.graph_sets:
        assert list(g.sizes) == sorted(set(g.sizes)) and all(s >= 1 for s in g.sizes)
        if g.kind == FULL_DECODE:  # the budget binds every uniform-decode graph, q = 1 included
            assert all(n * g.q <= cfg.decode_token_limit() for n in g.sizes)
            assert all(n <= cfg.max_num_seqs for n in g.sizes)
        if g.kind in (PIECEWISE, FULL):
            assert all(t <= cfg.max_num_batched_tokens for t in g.sizes)
    if cfg.cudagraph_mode.value == "NONE":
        assert plan.graph_sets == ()


@SETTINGS
@given(cfg=configs())
def test_each_tier_is_covered_by_its_own_q(cfg):
    """A tier's batches run FULL at the tier's q up to the widest batch its q's sizes (within the budget) can
    hold: no batch falls off while a wider graph exists."""
    if len(cfg.tiers) < 2 or not cfg.cudagraph_mode.has_full_decode:
        return
    plan = build_plan(cfg)
    d = dispatchers_for_plan(plan)["target"]
    for tier in cfg.tiers:
        q = 1 + tier.num_speculative_tokens
        possible = [n for n in cfg.decode_sizes(q) if n * q <= cfg.decode_token_limit()]
        for n in range(tier.min_batch, min(tier.max_batch, cfg.max_num_batched_tokens // q) + 1):
            if any(s >= n for s in possible):
                desc = d.dispatch(n * q, n, q, True)
                assert desc.mode == "FULL" and desc.q == q, (tier, n)


def expected_graph(sets, mode_full, num_tokens, num_reqs, q, limit):
    """The graph key a drafter's forward of this shape must replay (None: eager): the smallest FULL decode size at
    q (a uniform decode, q given), else the smallest token-keyed size."""
    if q is not None:
        full = smallest_at_least(sets.get((FULL_DECODE, q), ()), num_reqs)
        if full is not None:
            return (FULL_DECODE, q, full)
    kind, padded = expected_by_tokens(sets, mode_full, num_tokens, limit)
    return None if padded is None else (kind, None, padded)


@SETTINGS
@given(cfg=configs(methods=["draft_model"], ks=(1, 2, 3, 5, 7, 15)), data=st.data())
def test_draft_model_forwards_get_graphs_where_a_size_is_captured(cfg, data):
    """A draft-model step's two forwards (the catch-up over the target's rows, the one-token steps over its sampling
    requests) replay the smallest captured graph covering them, of the drafter's own runners; eager only where no
    size covers."""
    plan = build_plan(cfg)
    ds = dispatchers_for_plan(plan)
    assert set(ds) == {"target", "draft_model", "draft_model_next_steps"}
    tier = data.draw(st.sampled_from(cfg.tiers))
    q = 1 + tier.num_speculative_tokens
    top = min(cfg.max_num_seqs, tier.max_batch, cfg.max_num_batched_tokens // q)
    if top < tier.min_batch or not tier.num_speculative_tokens:
        return
    n = data.draw(st.integers(tier.min_batch, top))
    if data.draw(st.booleans()):  # a uniform decode: every request verifies K drafts
        shape, step_q = BatchShape(n * q, n, q, True), q
    else:  # mixed: one request prefills a chunk
        chunk = data.draw(st.integers(2, max(2, cfg.max_num_batched_tokens - (n - 1) * q)))
        if (n - 1) * q + chunk > cfg.max_num_batched_tokens:
            return
        shape, step_q = BatchShape((n - 1) * q + chunk, n, max(chunk, q), False), None
    n_s = data.draw(st.integers(1, n))
    out = SimpleNamespace(shape=shape, num_new_drafts=tier.num_speculative_tokens,
                          samples=np.r_[np.ones(n_s, bool), np.zeros(n - n_s, bool)])
    descs = dispatch_step(ds, "draft_model", out)
    mode_full = cfg.cudagraph_mode.value == "FULL"
    widest = ds["draft_model"].max_num_batched_tokens
    want = expected_graph(sets_of(plan, "draft_model"), mode_full, shape.num_tokens, n, step_q, widest)
    assert descs.draft.graph == want and (descs.draft.mode == "NONE") == (want is None)
    if want is not None:
        assert descs.draft.num_tokens >= shape.num_tokens
    want = expected_graph(sets_of(plan, "draft_model_next_steps"), mode_full, n_s, n_s, 1, widest)
    assert descs.draft_next.graph == want and (descs.draft_next.mode == "NONE") == (want is None)
    if want is not None and want[0] == FULL_DECODE:
        assert descs.draft_next.mode == "FULL" and descs.draft_next.q == 1 and descs.draft_next.num_reqs >= n_s
    if descs.target.graph is not None and descs.target.graph[0] == FULL_DECODE:
        assert descs.draft.graph == descs.target.graph  # the catch-up mirrors the target's decode graphs


@SETTINGS
@given(prefill=sorted_sizes(8192), decode=sorted_sizes(512), k=st.sampled_from([0, 1, 3, 7]))
def test_explicit_lists_are_honoured_exactly(prefill, decode, k):
    spec = {"method": "eagle3", "num_speculative_tokens": k} if k else None
    cfg = resolve({"prefill_cudagraph_capture_token_sizes": prefill, "decode_cudagraph_capture_request_sizes": decode,
                   "max_decode_cudagraph_capture_tokens": None}, spec, platform="sm100", max_num_seqs=512,
                  max_num_batched_tokens=8192)
    sets = sets_of(build_plan(cfg))
    if not prefill and not decode:
        assert sets == {}
        return
    assert sets[(PIECEWISE, None)] == tuple(sorted(set(prefill)))
    assert sets[(FULL_DECODE, 1 + k)] == tuple(sorted(set(decode)))


def test_empty_lists_disable_their_kind():
    cfg = resolve({"decode_cudagraph_capture_request_sizes": []}, None, platform="sm100")
    d = dispatchers_for_plan(build_plan(cfg))["target"]
    assert d.dispatch(64, 64, 1, True).mode == "PIECEWISE"
    cfg = resolve({"prefill_cudagraph_capture_token_sizes": []}, None, platform="sm100")
    d = dispatchers_for_plan(build_plan(cfg))["target"]
    assert d.dispatch(100, 3, 90, False).mode == "NONE"
    assert d.dispatch(64, 64, 1, True).mode == "FULL"


def test_full_decode_only_runs_mixed_steps_eagerly():
    cfg = resolve({"cudagraph_mode": "FULL_DECODE_ONLY"}, None, platform="sm100")
    d = dispatchers_for_plan(build_plan(cfg))["target"]
    assert d.dispatch(100, 3, 90, False).mode == "NONE"
    assert d.dispatch(7, 7, 1, True) == ("FULL", UNIFORM_DECODE, 8, 8, 1, (FULL_DECODE, 1, 8))


def test_out_of_range_batch_is_a_clear_error():
    d = Dispatcher((), max_num_seqs=8, max_num_batched_tokens=64)
    try:
        d.dispatch(65, 1, 65, False)
    except ValueError as exc:
        assert "max_num_batched_tokens = 64" in str(exc)
    else:
        raise AssertionError("expected ValueError")
