"""Capture plans per runner and speculative method (SPEC section 4)."""

from dispatcher.plan.config import resolve
from dispatcher.plan.capture_plan import (FULL, FULL_DECODE, FULL_VARLEN, PIECEWISE, baseline_plan, build_plan,
                                          model_runners)

SM100 = dict(platform="sm100", max_num_seqs=1024, max_num_batched_tokens=16384)


def summary(plan):
    return {(g.runner, g.kind, g.q): (len(g.sizes), g.largest) for g in plan.graph_sets}


def test_eagle3_k3_runners():
    plan = build_plan(resolve({}, {"method": "eagle3", "num_speculative_tokens": 3}, **SM100))
    assert summary(plan) == {
        ("target", PIECEWISE, None): (39, 8192),
        ("target", FULL_DECODE, 4): (64, 1024),
        ("eagle3", PIECEWISE, None): (39, 8192),
        ("eagle3", FULL_DECODE, 4): (64, 1024),
        ("eagle3_next_steps", FULL_DECODE, 1): (64, 1024),
    }


def test_eagle_k1_has_no_later_steps():
    plan = build_plan(resolve({}, {"method": "eagle", "num_speculative_tokens": 1}, **SM100))
    assert "eagle_next_steps" not in plan.runners


def test_block_drafters_use_their_own_q_within_budget():
    dspark = summary(build_plan(resolve({}, {"method": "dspark", "num_speculative_tokens": 7}, **SM100)))
    assert dspark[("dspark", FULL_DECODE, 7)] == (50, 576)  # n * 7 <= 4096
    dflash = summary(build_plan(resolve({}, {"method": "dflash", "num_speculative_tokens": 7}, **SM100)))
    assert dflash[("dflash", FULL_DECODE, 8)] == (48, 512)
    multi = summary(build_plan(resolve({}, {"method": "mtp_multi", "num_speculative_tokens": 3}, **SM100)))
    assert multi[("mtp_multi", FULL_DECODE, 4)] == multi[("target", FULL_DECODE, 4)] == (64, 1024)


def test_ngram_runs_no_model_and_gets_no_graphs():
    cfg = resolve({}, {"method": "ngram", "num_speculative_tokens": 3}, **SM100)
    assert build_plan(cfg).runners == model_runners(cfg) == ("target",)


DRAFT_MODEL_SPEC = {"method": "draft_model", "model": "tiny-dense"}


def test_draft_model_mirrors_the_target_then_runs_k_one_token_steps():
    """The draft LM's forward over the target's rows gets the target's own sets; its K one-token steps get EAGLE's
    later-step set (FULL q = 1 over the request grid), already at K = 1 (it proposes nothing in step 0)."""
    cfg = resolve({}, {**DRAFT_MODEL_SPEC, "num_speculative_tokens": 3}, **SM100)
    plan = build_plan(cfg)
    assert model_runners(cfg) == plan.runners == ("target", "draft_model", "draft_model_next_steps")
    s = summary(plan)
    assert s[("draft_model", PIECEWISE, None)] == s[("target", PIECEWISE, None)] == (39, 8192)
    assert s[("draft_model", FULL_DECODE, 4)] == s[("target", FULL_DECODE, 4)] == (64, 1024)
    assert s[("draft_model_next_steps", FULL_DECODE, 1)] == (64, 1024) and len(s) == 5
    eagle = build_plan(resolve({}, {"method": "eagle3", "num_speculative_tokens": 3}, **SM100))
    renamed = lambda p, m: {(g.runner.replace(m, "drafter"), g.kind, g.q): g.sizes for g in p.graph_sets}  # noqa: E731
    assert renamed(plan, "draft_model") == renamed(eagle, "eagle3")
    k1 = build_plan(resolve({}, {**DRAFT_MODEL_SPEC, "num_speculative_tokens": 1}, **SM100))
    assert summary(k1)[("draft_model_next_steps", FULL_DECODE, 1)] == (64, 1024)


def test_draft_model_one_token_steps_serve_every_drafting_tier():
    spec = {**DRAFT_MODEL_SPEC, "num_speculative_tokens": 7,
            "num_speculative_tokens_per_batch_size": [[1, 7], [65, 3], [257, 1]]}
    plan = build_plan(resolve({}, spec, **SM100))
    dec = {g.q: g.sizes for g in plan.for_runner("draft_model") if g.kind == FULL_DECODE}
    assert dec == {g.q: g.sizes for g in plan.for_runner("target") if g.kind == FULL_DECODE}
    nxt = plan.for_runner("draft_model_next_steps")
    assert [(g.kind, g.q, g.largest) for g in nxt] == [(FULL_DECODE, 1, 1024)]  # the K = 1 tier drafts once too


def test_draft_model_graphs_follow_the_mode_and_the_lists():
    spec = {**DRAFT_MODEL_SPEC, "num_speculative_tokens": 3}
    pw = summary(build_plan(resolve({"cudagraph_mode": "PIECEWISE"}, spec, **SM100)))
    assert pw[("draft_model", PIECEWISE, None)] == (39, 8192)
    assert pw[("draft_model_next_steps", PIECEWISE, None)] == (12, 1024)  # the prefill grid through max_num_seqs
    full = summary(build_plan(resolve({"cudagraph_mode": "FULL"}, spec, **SM100)))
    assert {k for _, k, _ in full} == {FULL} and full[("draft_model", FULL, None)] == (39, 8192)
    assert build_plan(resolve({"cudagraph_mode": "NONE"}, spec, **SM100)).graph_sets == ()
    off = summary(build_plan(resolve({"decode_cudagraph_capture_request_sizes": []}, spec, **SM100)))
    assert off[("draft_model", FULL_DECODE, 4)] == off[("draft_model_next_steps", FULL_DECODE, 1)] == (0, 0)


def test_draft_model_baseline_is_the_shared_list_for_each_runner():
    cfg = resolve({}, {**DRAFT_MODEL_SPEC, "num_speculative_tokens": 7}, **SM100)
    main = summary(baseline_plan(cfg))
    assert main[("draft_model", PIECEWISE, None)] == main[("target", PIECEWISE, None)] == (83, 1024)
    assert main[("draft_model", FULL_DECODE, 8)] == main[("target", FULL_DECODE, 8)] == (80, 128)
    assert main[("draft_model_next_steps", FULL_DECODE, 1)] == (83, 1024)
    assert {r for r, _, _ in main} == set(build_plan(cfg).runners)


def test_dynamic_tiers_hold_only_reachable_sizes():
    spec = {"method": "eagle3", "num_speculative_tokens": 7,
            "num_speculative_tokens_per_batch_size": [[1, 7], [65, 3], [257, 1]]}
    plan = build_plan(resolve({}, spec, **SM100))
    dec = {g.q: g.sizes for g in plan.for_runner("target") if g.kind == FULL_DECODE}
    assert dec[8][0] == 1 and dec[8][-1] == 64          # K=7: batches 1..64
    assert dec[4][0] == 72 and dec[4][-1] == 256        # K=3: 65..256, from the first size >= 65
    assert dec[2][0] == 272 and dec[2][-1] == 1024      # K=1: 257..1024
    assert sum(len(s) for s in dec.values()) == 64      # one grid split over the tiers
    nxt = {g.q: g.sizes for g in plan.for_runner("eagle3_next_steps")}
    assert nxt[1][-1] == 256                            # only tiers drafting 2+ tokens run later steps


def test_adaptive_verification_is_exempt_from_the_budget():
    spec = {"method": "dflash", "num_speculative_tokens": 7, "adaptive_verification": True}
    plan = build_plan(resolve({}, spec, **SM100))
    s = summary(plan)
    assert s[("target", FULL_DECODE, 8)] == (48, 512)
    assert s[("target", FULL_VARLEN, None)][1] == 8192  # min(1024 * 8, 16384) > the 4096 budget


def test_modes():
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    pw = summary(build_plan(resolve({"cudagraph_mode": "PIECEWISE"}, spec, **SM100)))
    assert {k for _, k, _ in pw} == {PIECEWISE}
    full = summary(build_plan(resolve({"cudagraph_mode": "FULL"}, spec, **SM100)))
    assert {k for _, k, _ in full} == {FULL} and full[("target", FULL, None)] == (39, 8192)
    fdo = summary(build_plan(resolve({"cudagraph_mode": "FULL_DECODE_ONLY"}, spec, **SM100)))
    assert {k for _, k, _ in fdo} == {FULL_DECODE}
    assert build_plan(resolve({"cudagraph_mode": "NONE"}, spec, **SM100)).graph_sets == ()


def test_plan_json_schema():
    plan = build_plan(resolve({}, {"method": "eagle3", "num_speculative_tokens": 7}, **SM100)).to_dict()
    assert set(plan) == {"platform", "config", "runners", "warnings"}
    assert plan["platform"] == "sm100"
    for entry in plan["runners"]:
        assert set(entry) == {"runner", "kind", "unit", "q", "sizes"}
        assert entry["unit"] == ("requests" if entry["kind"] == FULL_DECODE else "tokens")
    assert plan["config"]["max_decode_cudagraph_capture_tokens"] == 4096
    assert plan["config"]["prefill_cudagraph_capture_token_sizes"][-1] == 8192


def test_sm100_defaults_capture_fewer_graphs_than_main_and_reach_further():
    """The reference's headline: at K=7 the target decode reaches 512 requests (main 128) with fewer graphs."""
    cfg = resolve({}, {"method": "eagle3", "num_speculative_tokens": 7}, **SM100)
    new, main = summary(build_plan(cfg)), summary(baseline_plan(cfg))
    assert main[("target", FULL_DECODE, 8)] == (80, 128) and new[("target", FULL_DECODE, 8)] == (48, 512)
    assert main[("target", PIECEWISE, None)] == (83, 1024) and new[("target", PIECEWISE, None)] == (39, 8192)
    assert build_plan(cfg).num_graphs < baseline_plan(cfg).num_graphs


def test_full_mixed_graphs_mirror_the_prefill_grid_up_to_their_cap_for_the_target_and_step_0():
    """max_full_mixed_cudagraph_capture_tokens: the target and an EAGLE head's step 0 (which mirrors it) capture
    FULL graphs at the prefill grid's sizes up to the cap, beside their PIECEWISE sets; the one-token steps, the
    decode graphs and vLLM's shared list are unchanged; 0 (the default) captures none."""
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    off = build_plan(resolve({}, spec, **SM100))
    on = build_plan(resolve({"max_full_mixed_cudagraph_capture_tokens": 256}, spec, **SM100))
    grid = next(g.sizes for g in off.graph_sets if g.kind == PIECEWISE)
    full = {g.runner: g.sizes for g in on.graph_sets if g.kind == FULL}
    assert full == {"target": tuple(s for s in grid if s <= 256), "eagle3": tuple(s for s in grid if s <= 256)}
    assert [g for g in on.graph_sets if g.kind != FULL] == list(off.graph_sets)
    assert baseline_plan(on.config).graph_sets == baseline_plan(off.config).graph_sets
    assert on.config.to_dict()["max_full_mixed_cudagraph_capture_tokens"] == 256
    assert resolve({"max_full_mixed_cudagraph_capture_tokens": 0}, spec, **SM100).full_mixed_token_sizes == ()
