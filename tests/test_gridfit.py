"""Grids fitted to a measured step cost (dispatcher/plan/gridfit.py, ``fit_cudagraph_capture_sizes``, ``twogrid plan
--autotune``): the padding-cost rule of SPEC section 3 applied to a measured curve. Pure: no torch."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispatcher.plan import gridfit, grids
from dispatcher.plan.padding import expected_padding
from dispatcher.plan.capture_plan import build_plan
from dispatcher.plan.config import ConfigError, resolve

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNTIME_H200 = os.path.join(REPO, "docs", "bench", "runtime_h200.json")
TRACE = os.path.join(REPO, "docs", "bench", "traces", "headline_e818375_separate_256.jsonl")


def mean_padding_share(sizes: tuple[int, ...], T) -> float:
    """The mean over every batch n in 1..cap of (T(padded) - T(n)) / T(n): what the rule bounds by eps."""
    shares, j = [], 0
    for n in range(1, sizes[-1] + 1):
        while sizes[j] < n:
            j += 1
        shares.append((T(sizes[j]) - T(n)) / T(n))
    return sum(shares) / len(shares)


def h200_cost(model: str = "bench-moe") -> gridfit.StepCost:
    with open(RUNTIME_H200, encoding="utf-8") as fh:
        return gridfit.StepCost.from_json(json.load(fh), RUNTIME_H200, model)


def test_the_rule_on_its_limits():
    """A flat curve (padding free: e = 0) gives the powers of two; a linear one (e = 1) the rule's densest stride,
    2 * eps * n rounded down to a power of two, which is the default prefill grid with its knee at 1 token."""
    flat = ((1, 5.0), (8192, 5.0))
    assert gridfit.fitted_grid(8192, flat, 0.035) == tuple(1 << i for i in range(14))
    linear = ((1, 1.0), (8192, 8192.0))
    assert gridfit.fitted_grid(8192, linear, 0.035) == grids.prefill_grid(8192, knee_tokens=1)
    assert abs(gridfit.elasticity(linear)(100) - 1.0) < 1e-9 and gridfit.elasticity(flat)(100) == 0.0


@given(st.lists(st.floats(0.01, 50.0), min_size=2, max_size=9), st.floats(0.5, 20.0), st.integers(16, 4096))
def test_a_fitted_grid_is_a_grid_and_bounds_the_mean_padding(increments, base, cap):
    """On any non-decreasing curve: sorted sizes from 1 to the cap, every power of two below it, and the mean padding
    cost over the batches 1..cap within eps (twice eps: the rule bounds it to first order, and the strides round
    down)."""
    sizes = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536][:len(increments)]
    ms = [base]
    for inc in increments[1:]:
        ms.append(ms[-1] + inc)
    points = tuple(zip(sizes, ms))
    grid = gridfit.fitted_grid(cap, points, 0.05)
    assert grid[0] == 1 and grid[-1] == cap and list(grid) == sorted(set(grid))
    assert all(p in grid for p in (1 << i for i in range(cap.bit_length())) if p < cap)
    assert mean_padding_share(grid, gridfit.step_time(points)) <= 2 * 0.05


def test_h200_curve_fits_sparse_decode_and_denser_prefill():
    """bench-moe on the H200 (docs/bench/runtime_h200.json): its FULL decode curve is flat to a few hundred tokens,
    so the fitted decode grid holds far fewer sizes than the default; its PIECEWISE curve turns linear near 512
    tokens, not 4096 as the default rule assumes, so the fitted prefill grid is denser. Both keep their mean padding
    cost within eps on the measured curve, which the default prefill grid does not."""
    cost = h200_cost()
    decode = gridfit.fit_decode(1024, cost, 1)
    prefill = gridfit.fit_prefill(8192, cost)
    assert len(decode) == 21 < len(grids.decode_grid(1024)) == 64
    assert len(prefill) == 71 > len(grids.prefill_grid(8192)) == 39
    T_pw, T_dec = gridfit.step_time(cost.prefill), gridfit.step_time(cost.decode_points(1))
    assert mean_padding_share(prefill, T_pw) <= grids.PREFILL_EPS
    assert mean_padding_share(decode, T_dec) <= grids.DECODE_EPS
    assert mean_padding_share(grids.prefill_grid(8192), T_pw) > grids.PREFILL_EPS


def test_decode_curve_at_an_unmeasured_q_is_the_nearest_at_equal_tokens():
    cost = h200_cost()
    assert cost.decode_points(8)[0] == (1, 1.435)
    at6 = dict(cost.decode_points(6))  # (nearest measured q: 4 and 8 tie at 2 away: the larger, 8)
    assert at6[round(64 * 8 / 6)] == 3.48  # (64 requests at q = 8: 512 tokens, as 85 at q = 6)


def test_resolve_fits_the_grids_within_the_caps_and_refuses_size_lists():
    cost = h200_cost()
    spec = {"method": "eagle3", "num_speculative_tokens": 7}
    plain = resolve({"fit_cudagraph_capture_sizes": True}, spec, platform="sm100")
    fitted = resolve({"fit_cudagraph_capture_sizes": True}, spec, platform="sm100", step_cost=cost)
    assert plain.prefill_token_sizes == grids.prefill_grid(8192) and plain.grid_cost_source is None
    assert fitted.prefill_token_sizes == gridfit.fit_prefill(8192, cost)
    assert fitted.decode_request_sizes == gridfit.fit_decode(1024, cost, 8)
    # the one-token draft steps' grid: fitted at q = 1, with every size of the q = 8 grid (a uniform decode step
    # runs as one fused graph only where the drafter's one-token graphs have its size: on the H200 a fitted grid
    # without them fused 13 of 27 decode sizes and lost 2-3% to the default grids)
    one = set(gridfit.fit_decode(1024, cost, 1))
    assert fitted.one_token_request_sizes == tuple(sorted(one | set(fitted.decode_request_sizes)))
    assert fitted.grid_cost_source == cost.source and fitted.to_dict()["fit_cudagraph_capture_sizes"] is True
    sets = {(g.runner, g.kind): g.sizes for g in build_plan(fitted).graph_sets}
    assert set(sets[("target", "full_decode")]) <= set(sets[("eagle3_next_steps", "full_decode")])
    assert one <= set(sets[("eagle3_next_steps", "full_decode")])
    assert max(sets[("target", "full_decode")]) == 512  # (the 4096-token budget at q = 8)
    # the head's step 0: the powers of two of the target's token grid, and its largest (gridfit.head_token_grid)
    assert sets[("eagle3", "piecewise")] == tuple(1 << i for i in range(14))
    assert set(sets[("eagle3", "piecewise")]) < set(sets[("target", "piecewise")])
    assert dict(((g.runner, g.kind), g.sizes) for g in build_plan(plain).graph_sets)[("eagle3", "piecewise")] == \
        plain.prefill_token_sizes  # (the default grids, until a cost is measured: the target's)
    capped = resolve({"fit_cudagraph_capture_sizes": True, "max_prefill_cudagraph_capture_tokens": 2048}, None,
                     platform="sm100", step_cost=cost)
    assert capped.prefill_token_sizes == gridfit.fit_prefill(2048, cost)
    for field, value in (("prefill_cudagraph_capture_token_sizes", [1, 2]),
                         ("decode_cudagraph_capture_request_sizes", [4]), ("max_cudagraph_capture_size", 512)):
        with pytest.raises(ConfigError, match=f"{field} cannot be set with it"):
            resolve({"fit_cudagraph_capture_sizes": True, field: value}, None, platform="sm100")
    for field in ("fit_cudagraph_capture_sizes", "delayed_cudagraph_capture"):
        with pytest.raises(ConfigError, match=f"{field} must be true or false"):
            resolve({field: "yes"}, None)
    assert resolve({"delayed_cudagraph_capture": True}, None).delayed_capture is True


@pytest.mark.parametrize("data, message", [
    ({"prefill_ms": [[1, 2.0], [1, 3.0]]}, "size 1 appears more than once"),
    ({"prefill_ms": [[0, 2.0]]}, r"prefill_ms\[0\]: \[0, 2.0\] is not \[size >= 1, finite ms > 0\]"),
    ({"prefill_ms": [[1, float("inf")], [2, 1.0]]}, r"prefill_ms\[0\]: \[1, inf\] is not \[size >= 1, finite"),
    ({"prefill_ms": [[1, 2.0]], "bogus": 1},
     r"unknown field 'bogus'; known fields: prefill_ms, decode_ms, source, key"),
    ({"decode_ms": {"x": [[1, 2.0]]}}, "key 'x' is not a query length"),
    ({"decode_ms": [[1, 2.0]]}, "decode_ms: must be an object"),
    ([1, 2], "not a step-cost table"),
    ({"models": [{"model": "a", "steps": []}, {"model": "b", "steps": []}]}, "holds models a, b: name one"),
])
def test_bad_cost_tables_are_refused_naming_the_field(data, message):
    with pytest.raises(ConfigError, match=message):
        gridfit.StepCost.from_json(data, "cost.json")


def test_a_cost_table_reads_back_and_traces_give_curves():
    cost = h200_cost()
    again = gridfit.StepCost.from_json(json.loads(json.dumps(cost.to_json())), "x")
    assert (again.prefill, again.decode, again.source) == (cost.prefill, cost.decode, cost.source)
    # the server's cache file (runtime.cache.cached_json adds its key), which plan --autotune reads as it is
    cached = gridfit.StepCost.from_json({**cost.to_json(), "key": ["cpu", "model", "float32"]}, "x")
    assert cached.prefill == cost.prefill
    records = [json.loads(line) for line in open(TRACE, encoding="utf-8")]
    traced = gridfit.StepCost.from_trace(records, TRACE)
    assert len(traced.prefill) >= 2 and traced.decode and all(ms > 0 for _, ms in traced.prefill)
    with pytest.raises(ConfigError, match="nothing to fit"):
        gridfit.StepCost.from_trace([{"graph": None, "device_ms": 1.0}], "t.jsonl")


def test_measurement_sizes():
    assert gridfit.measurement_sizes(8192) == (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    assert gridfit.measurement_sizes(48) == (1, 4, 16, 48) and gridfit.measurement_sizes(1) == (1,)


def test_expected_padding_prices_each_batch_on_its_graph():
    """A uniform decode of 3 requests on a grid holding 4: T(4) - T(3) on the decode curve; an eager step is counted,
    not priced."""
    cost = gridfit.StepCost(((1, 1.0), (64, 1.0)), ((1, ((1, 1.0), (8, 8.0))),), "t")
    cfg = resolve({"decode_cudagraph_capture_request_sizes": [4, 8], "prefill_cudagraph_capture_token_sizes": [8]},
                  None, platform="sm100", max_num_seqs=8, max_num_batched_tokens=64)
    out = expected_padding([(3, 3, 1, True), (40, 2, 39, False)], build_plan(cfg), cost)
    T = gridfit.step_time(((1, 1.0), (8, 8.0)))
    assert out["priced_steps"] == 1 and out["eager_steps"] == 1
    assert math.isclose(out["padding_ms"], round(T(4) - T(3), 3))


def test_plan_autotune_prints_both_grids_counts_memory_and_padding(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dispatcher", "plan", "--platform", "sm100", "--autotune",
                          RUNTIME_H200, "--cost-model", "bench-moe", "--speculative-config",
                          '{"method": "eagle3", "num_speculative_tokens": 7}', "--padding-trace", TRACE],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "total: 238 graphs by default, 186 fitted (-21.8%)" in text  # (the head's step 0: 14 sizes, not 71)
    assert "target             full_decode  8       48      31" in text
    assert "target graph memory (estimated from the measured capture's samples)" in text
    assert text.count(f"expected padding on {TRACE}") == 2
    js = subprocess.run([sys.executable, "-m", "dispatcher", "plan", "--platform", "sm100", "--autotune",
                         RUNTIME_H200, "--cost-model", "bench-moe", "--json"], capture_output=True, text=True,
                        cwd=REPO, timeout=60)
    data = json.loads(js.stdout)
    assert data["graphs"] == {"default": 103, "fitted": 92} and data["decode_fitted_at_q"] == 1
    assert data["notes"] == []
    # off sm100 the decode grid is the legacy token list, kept: the output says so and how to fit it
    js = subprocess.run([sys.executable, "-m", "dispatcher", "plan", "--autotune", RUNTIME_H200, "--cost-model",
                         "bench-moe", "--json"], capture_output=True, text=True, cwd=REPO, timeout=60)
    notes = json.loads(js.stdout)["notes"]
    assert len(notes) == 1 and "off sm100 (platform default)" in notes[0]
    assert "max_decode_cudagraph_capture_requests" in notes[0]
    bad = subprocess.run([sys.executable, "-m", "dispatcher", "plan", "--cost-model", "x"], capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert bad.returncode != 0 and "--cost-model is for --autotune" in bad.stderr
    for content, words in [("", "holds no step records"),  # (0 steps, exit 0 before)
                           ('{"step": 1, "kind": "mixed", "tokens": 5}\n', "mode is missing (one of")]:  # (KeyError)
        trace = tmp_path / "t.jsonl"
        trace.write_text(content)
        bad = subprocess.run([sys.executable, "-m", "dispatcher", "plan", "--platform", "sm100", "--autotune",
                              RUNTIME_H200, "--cost-model", "bench-moe", "--padding-trace", str(trace)],
                             capture_output=True, text=True, cwd=REPO, timeout=60)
        assert bad.returncode == 2 and words in bad.stderr and "--padding-trace" in bad.stderr, bad.stderr


@pytest.mark.parametrize("platform, cc, spec, measured", [
    ("default", {}, None, []),  # off sm100, no cap: the legacy decode list stands, no decode measured
    ("default", {"max_decode_cudagraph_capture_requests": 64}, None, [1]),  # a cap: its grid is fitted
    ("sm100", {}, None, [1]),
    ("sm100", {}, {"method": "eagle3", "num_speculative_tokens": 7}, [1, 8]),  # q = 8's grid, the drafter's q = 1
    ("sm100", {}, {"method": "eagle3", "num_speculative_tokens": 5,
                   "num_speculative_tokens_per_batch_size": "auto"}, [1, 6]),  # not every candidate K's q
    ("sm100", {}, {"method": "ngram", "num_speculative_tokens": 3}, [4]),  # a host drafter: no one-token steps
    ("default", {}, {"method": "eagle3", "num_speculative_tokens": 3}, [1]),  # only the one-token steps' grid
])
def test_fit_start_up_measures_only_the_decode_steps_the_fit_uses(platform, cc, spec, measured):
    """``fit_cudagraph_capture_sizes`` measures the decode step cost at the q its grids are fitted at: 1 + K for
    the decode grid where it is fitted (sm100's, or one with a cap) and 1 for the one-token draft steps' grid; a
    decode list fitting leaves alone is not measured (it cost ~6 s of a CPU server's start), nor is every candidate
    K's q under auto tiers."""
    from dispatcher.runtime.process import fitted_query_lens

    cfg = resolve({"fit_cudagraph_capture_sizes": True, **cc}, spec, platform=platform)
    assert fitted_query_lens(cfg) == measured
    fitted = resolve({"fit_cudagraph_capture_sizes": True, **cc}, spec, platform=platform, step_cost=h200_cost())
    assert fitted.fits_decode_grid == cfg.fits_decode_grid == (1 + cfg.num_speculative_tokens in measured)
    if not cfg.fits_decode_grid:  # (the list stands: the fit changed nothing of it)
        assert (fitted.decode_request_sizes, fitted.decode_token_sizes) == (cfg.decode_request_sizes,
                                                                            cfg.decode_token_sizes)
