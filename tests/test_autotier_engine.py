"""Auto speculative tiers through EngineCore on the CPU: greedy output with "auto" tiers (and hand-written tiers with
K = 0) is exactly the output without speculative decoding, whatever the tiers and however often they change; the
tiers follow the acceptance as it drifts (driven by fixed acceptance); the measured step costs are kept and reused."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from dispatcher.engine.engine_core import EngineArgs, EngineCore  # noqa: E402
from dispatcher.plan.config import resolve  # noqa: E402
from models.config import preset  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402

BLOCK = 4
MAX_MODEL_LEN = 96


def make_engine(spec, budget=32, num_blocks=200, max_num_seqs=4, **kw) -> EngineCore:
    cfg = resolve({}, spec, platform="sm100", max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=num_blocks, block_size=BLOCK,
                                      max_model_len=MAX_MODEL_LEN, seed=11, **kw))


def write_table(path, by_q) -> str:
    path.write_text(json.dumps({"decode_step_ms": {str(q): pts for q, pts in by_q.items()}}))
    return str(path)


@st.composite
def workloads(draw):
    """A drafter with "auto" tiers (or hand-written tiers with a K = 0 tier), a random step-cost table over 1..4
    requests (so that the tiers differ by batch size), a re-choice every 1 to 3 steps, prompts that repeat
    themselves (so that n-gram drafts get accepted), a budget that chunks and a KV cache that may preempt."""
    method = draw(st.sampled_from(["eagle3", "ngram", "dflash", "mtp"]))
    k = draw(st.integers(1, 3))
    if draw(st.booleans()):
        spec = {"method": method, "num_speculative_tokens": k, "num_speculative_tokens_per_batch_size": "auto"}
        if draw(st.booleans()):
            spec["acceptance_prior"] = draw(st.floats(0.0, 1.0))
    else:
        spec = {"method": method, "num_speculative_tokens": k,
                "num_speculative_tokens_per_batch_size": [[1, k], [draw(st.integers(2, 4)), 0]]}
    ms = st.floats(1.0, 20.0)
    table = {1 + j: [[1, draw(ms)], [4, draw(ms)]] for j in range(k + 1)}
    prompts = []
    for _ in range(draw(st.integers(1, 6))):
        base = draw(st.lists(st.integers(3, 499), min_size=1, max_size=5))
        prompts.append([base[i % len(base)] for i in range(draw(st.integers(1, 30)))])
    per_request = -(-(MAX_MODEL_LEN + 2 * 4 + 4) // BLOCK)
    return (spec, table, draw(st.integers(1, 3)), draw(st.sampled_from([16, 32])),
            draw(st.integers(per_request, 3 * per_request)), prompts, draw(st.integers(1, 40)))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_greedy_output_with_auto_tiers_is_the_output_without_speculation(tmp_path_factory, workload):
    spec, table, interval, budget, num_blocks, prompts, max_tokens = workload
    path = write_table(tmp_path_factory.mktemp("cost") / "cost.json", table)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    auto = make_engine(spec, budget, num_blocks, spec_cost_table=path, auto_tier_interval=interval)
    assert auto.async_scheduling
    got = auto.generate(prompts, params)
    want = make_engine(None, budget, num_blocks).generate(prompts, params)
    assert got == want, spec
    assert auto.scheduler.kv.num_free == auto.scheduler.config.num_kv_blocks, "KV blocks leaked"
    assert all(len(o) == max_tokens for o in got)


def test_auto_tiers_switch_mid_run_and_keep_greedy_output(tmp_path):
    """A table where K = 3 pays only at one request and K = 0 above, a re-choice every step from a random head's
    near-zero acceptance: the one request stops drafting, the tokens are still those of no speculation."""
    path = write_table(tmp_path / "cost.json", {1: [[1, 10.0], [4, 10.0]], 4: [[1, 16.0], [4, 60.0]]})
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": "auto",
            "auto_tier_candidates": [0, 3]}
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 3]
    e = make_engine(spec, spec_cost_table=path, auto_tier_interval=1)
    assert e.tiers == ((1, 1, 3), (2, 4, 0))
    out = e.generate(prompts, params)
    assert e.tier_version >= 1 and e.auto_tiers.changes == e.tier_version
    assert out == make_engine(None).generate(prompts, params)


def test_tiers_follow_fixed_acceptance_as_it_drifts(tmp_path, caplog):
    """Fixed acceptance (benchmarks only: drafts accepted by a seeded draw) sets what the counters measure: high, the
    tiers draft; then nothing accepted, they stop (a log line each change, the step trace's k says it per step)."""
    path = write_table(tmp_path / "cost.json", {1: [[1, 10.0], [4, 12.0]], 2: [[1, 12.0], [4, 14.5]],
                                               3: [[1, 13.0], [4, 16.0]], 4: [[1, 14.0], [4, 17.0]]})
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": "auto"}
    trace = tmp_path / "trace.jsonl"
    e = make_engine(spec, spec_cost_table=str(path), auto_tier_interval=4, fixed_acceptance=3.9,
                    step_trace=str(trace))
    assert e.tiers == ((1, 4, 3),)  # the prior 0.6 already pays for K = 3 here
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    prompts = [[5, 6, 7]] * 4
    e.generate(prompts, params)
    assert e.tiers == ((1, 4, 3),) and e.tier_version == 0  # measured high: no change
    e.worker.set_fixed_acceptance(1.0)  # nothing accepted from now on
    with caplog.at_level(logging.INFO, logger="twogrid.engine"):
        for _ in range(4):  # (the window forgets the high acceptance over a few hundred steps)
            e.generate(prompts, params)
            if e.tiers[-1][2] == 0:
                break
    assert e.tiers[-1] == (e.tiers[-1][0], 4, 0) and e.tier_version >= 1  # four requests: no drafts any more
    changes = [r.getMessage() for r in caplog.records if "speculative tiers changed (auto" in r.getMessage()]
    assert len(changes) == e.tier_version and changes[-1].endswith(json.dumps(e.auto_tiers.choice.as_config()))
    assert re.search(r"; at \d+ requests: K=0 [\d.]+ ms [\d.k]+ tok/s \*", changes[-1]), changes[-1]  # (why)
    e.close()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    ks = [r["k"] for r in records]
    assert ks[0] == 3 and ks[-1] == 0
    # a step queued behind the one before has its period beside its device time (where it is longer, the GPU waited
    # for the host); the first step, submitted with nothing before it, has none
    assert "period_ms" not in records[0] and sum("period_ms" in r for r in records) > len(records) // 2
    assert all(r["period_ms"] > 0 for r in records if "period_ms" in r)


def test_a_steps_period_runs_from_the_last_result_when_it_was_queued_behind_it(monkeypatch):
    """Two deep: a step submitted before the last step's result was taken runs from that result to its own; one
    submitted after it (the pipeline empty, or synchronous steps) or never recorded has no period, and a failed
    step's end starts the next one's."""
    import types

    from dispatcher.engine import engine_core

    clock = iter([5.0, 9.0, 15.0, 24.0, 25.0, 27.0, 30.0])
    monkeypatch.setattr(engine_core.time, "perf_counter", lambda: next(clock))
    core = engine_core.EngineCore.__new__(engine_core.EngineCore)
    core._last_result_at = 0.0
    step = lambda at: types.SimpleNamespace(submitted_at=at)  # noqa: E731
    assert core._period_ms(step(1.0)) is None  # (A: the first, nothing before it; its result at 5)
    assert core._period_ms(step(2.0)) == pytest.approx(4000.0)  # (B: queued behind A; 5 -> 9)
    assert core._period_ms(step(6.0)) == pytest.approx(6000.0)  # (C: queued behind B; 9 -> 15)
    assert core._period_ms(step(20.0)) is None  # (D: submitted after C's result, 15)
    assert core._period_ms(step(0.0)) is None  # (E: not recorded)
    core.scheduler = types.SimpleNamespace(fail_step=lambda out, later: [])
    core.structured = types.SimpleNamespace(remove=lambda rid: None, step_failed=lambda message: None)
    core._held, core._parked, core._prompt_logprobs = {}, {}, {}
    core.fail_step(types.SimpleNamespace(out=None, message=None))  # (failed at 27)
    assert core._period_ms(step(26.0)) == pytest.approx(3000.0)  # (27 -> 30)


def test_measured_step_costs_are_kept_and_reused(tmp_path, monkeypatch):
    from dispatcher.runtime.graphs import GraphRuntime

    monkeypatch.setenv("TWOGRID_CACHE", str(tmp_path))
    spec = {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": "auto"}
    first = make_engine(spec)
    files = list((tmp_path / "spec_cost").iterdir())
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert sorted(saved["decode_step_ms"]) == ["1", "2", "3"]  # every candidate q, over its captured sizes

    def refuse(self, repeats=5):
        raise AssertionError("measured again")

    monkeypatch.setattr(GraphRuntime, "measure_decode_ms", refuse)
    second = make_engine(spec)
    assert second.tiers == first.tiers
    assert second.auto_tiers.chooser.costs.by_q == first.auto_tiers.chooser.costs.by_q


def test_without_decode_graphs_the_default_shape_is_used(caplog):
    spec = {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": "auto"}
    cfg = resolve({"cudagraph_mode": "NONE"}, spec, platform="sm100", max_num_seqs=4, max_num_batched_tokens=32)
    with caplog.at_level(logging.WARNING, logger="twogrid.engine"):
        e = EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=100, block_size=BLOCK,
                                       max_model_len=MAX_MODEL_LEN))
    assert "no FULL decode graphs to time" in caplog.text
    assert e.auto_tiers.chooser.costs.source == "a default host-bound shape"
    assert e.tiers[0][2] >= 1  # a nearly flat host-bound cost: drafting pays at the prior


def test_a_served_engine_exports_the_tiers_in_force(tmp_path):
    """``twogrid serve`` with "auto" tiers: the worker process times its decode graphs, the engine process chooses,
    the front end's /metrics shows one spec_decode_tier_k series a tier, and the log says what was chosen."""
    from serverutil import Server, http_get, http_post

    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": "auto"})
    args = ["--model", "tiny-dense", "--device", "cpu", "--max-model-len", "128", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "64", "--num-kv-blocks", "128", "--speculative-config", spec]
    srv = Server(args, str(tmp_path / "server.log"), env={"TWOGRID_CACHE": str(tmp_path / "cache")})
    try:
        srv.wait_healthy()
        status, body = http_post(srv.base + "/v1/completions", json.dumps(
            {"prompt": [5, 6, 7, 5, 6, 7], "max_tokens": 8, "ignore_eos": True}).encode())
        assert status == 200 and body["usage"]["completion_tokens"] == 8
        text = http_get(srv.base + "/metrics")[1].decode()
    finally:
        srv.stop()
    import re

    found = re.findall(r'^twogrid:spec_decode_tier_k\{max_batch="(\d+)",min_batch="(\d+)",model_name="tiny-dense"\} '
                       r'(\S+)$', text, re.M)
    assert found, text[-2000:]
    ranges = sorted((int(lo), int(hi), float(k)) for hi, lo, k in found)
    assert ranges[0][0] == 1 and ranges[-1][1] == 4 and all(0 <= k <= 2 for *_, k in ranges)
    assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous tiers over 1..max_num_seqs
    assert "speculative tiers (auto, from measured" in (tmp_path / "server.log").read_text()
    (kept,) = (tmp_path / "cache" / "spec_cost").iterdir()
    # a kept measurement that cannot be read stops the next start with one line naming it (it was under a trace)
    kept.write_text("{not json")
    run = subprocess.run([sys.executable, "-m", "dispatcher", "serve", *args, "--port", str(srv.port)],
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "TWOGRID_CACHE": str(tmp_path / "cache")})
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert (f"the engine failed to start: the cached speculative tiers' measured step costs in {kept} are "
            f"unreadable") in out


def test_served_decode_steps_feed_the_tiers_cost_ratios_unless_a_table_was_given(tmp_path):
    """Without a given table the tiers weigh the served uniform decodes' time against their step costs (ratios
    kept for the K in force) and their periods (the host's floor); with ``spec_cost_table`` the table is taken as it
    is."""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": "auto"}
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10, 11]]
    served = make_engine(spec)
    seen = []
    observe = served.auto_tiers.observe_step
    served.auto_tiers.observe_step = lambda *args: seen.append(args) or observe(*args)
    served.generate(prompts, params)
    assert served.auto_tiers.costs.steps.sum() > 0
    # with its period where it was queued behind the step before (its result after that one's), None where not
    periods = [period for _, _, _, period in seen]
    assert seen and any(p is not None for p in periods) and all(p > 0 for p in periods if p is not None)
    given = make_engine(spec, spec_cost_table=write_table(tmp_path / "cost.json", {1: [[1, 5.0], [4, 5.0]],
                                                                                 2: [[1, 6.0], [4, 6.0]],
                                                                                 3: [[1, 7.0], [4, 7.0]]}))
    given.generate(prompts, params)
    assert given.auto_tiers.costs.steps.sum() == 0
