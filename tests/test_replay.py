"""``twogrid replay``: a step trace re-dispatched under another configuration."""

import json
import os
import statistics

import pytest

from dispatcher.cli import main
from dispatcher.plan.config import resolve
from dispatcher.engine.simulate import simulate
from dispatcher.engine.workload import make_prompts

K7 = '{"method": "eagle3", "num_speculative_tokens": 7}'
LEGACY = '{"max_cudagraph_capture_size": 1024}'


def make_trace(tmp_path, compilation):
    cfg = resolve(json.loads(compilation), json.loads(K7), platform="sm100")
    path = tmp_path / "trace.jsonl"
    simulate(cfg, make_prompts(384, seed=2), concurrency=256, output_len=64, step_trace=str(path))
    return str(path)


def run_replay(capsys, *args):
    assert main(["replay", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_replay_under_the_same_config_reproduces_the_run(tmp_path, capsys):
    trace = make_trace(tmp_path, LEGACY)
    r = run_replay(capsys, trace, "--platform", "sm100", "--speculative-config", K7, "--compilation-config", LEGACY)
    assert r["recorded"]["by_kind"] == r["replayed"]["by_kind"]
    assert r["recorded"]["padded_tokens"] == r["replayed"]["padded_tokens"]
    assert r["recorded"]["estimated_device_seconds"] == r["replayed"]["estimated_device_seconds"]


def test_replay_legacy_trace_under_separate_grids(tmp_path, capsys):
    trace = make_trace(tmp_path, LEGACY)
    r = run_replay(capsys, trace, "--platform", "sm100", "--speculative-config", K7)
    assert r["recorded"]["by_kind"]["uniform_decode"]["eager"] > 0
    assert r["replayed"]["by_kind"]["uniform_decode"]["eager"] == 0
    assert r["replayed"]["estimated_device_seconds"] < r["recorded"]["estimated_device_seconds"]
    assert all(x["reason"].startswith("mixed steps above the largest PIECEWISE size 8192") for x in r["eager_reasons"])
    back = run_replay(capsys, trace, "--platform", "sm100", "--speculative-config", K7, "--compilation-config", LEGACY)
    reasons = {x["reason"]: x for x in back["eager_reasons"]}
    decode = ("uniform decodes beyond the FULL decode graphs at q = 8 (largest 128 requests), and above the largest "
              "PIECEWISE size 1024")
    assert decode in reasons and reasons[decode]["min_tokens"] > 1024


TRACES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "bench", "traces")


def test_a_served_trace_under_vllms_list_predicts_the_separate_servers_eager_steps(capsys):
    """The H200 headline at 186936d, 256 streams (warm-up wave and two measured ones): the vllm-default server's
    trace replayed under separate grids predicts exactly the eager steps the separate server ran live (none; its
    trace is committed beside it)."""
    k7 = json.dumps({"method": "eagle3", "num_speculative_tokens": 7})
    r = run_replay(capsys, os.path.join(TRACES, "headline_186936d_vllm-default_256.jsonl"), "--platform", "sm100",
                   "--max-num-seqs", "1024", "--max-num-batched-tokens", "16384", "--speculative-config", k7)
    with open(os.path.join(TRACES, "headline_186936d_separate_256.jsonl"), encoding="utf-8") as fh:
        live = [json.loads(line) for line in fh]
    assert sum(v["eager"] for v in r["recorded"]["by_kind"].values()) == 284
    assert sum(v["eager"] for v in r["replayed"]["by_kind"].values()) == sum(x["mode"] == "NONE" for x in live) == 0


def test_replay_reports_steps_over_new_limits(tmp_path, capsys):
    trace = make_trace(tmp_path, "{}")
    r = run_replay(capsys, trace, "--platform", "sm100", "--speculative-config", K7, "--max-num-seqs", "64",
                   "--max-num-batched-tokens", "4096")
    assert r["steps_over_new_limits"] > 0 and r["steps"] + r["steps_over_new_limits"] > r["steps"]


def test_replay_rejects_a_file_that_is_not_a_trace(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "kind": "mixed"}\n')
    assert main(["replay", str(bad)]) == 2
    assert "record 1 of" in capsys.readouterr().err
    first_record = open(make_trace(tmp_path, "{}")).readline()
    bad.write_text(first_record + "not json\n")
    assert main(["replay", str(bad)]) == 2
    assert "line 2: not a JSON step record" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    rec = json.loads(first_record)
    for change, words in [({"mode": "TURBO"}, "mode must be one of FULL, PIECEWISE, NONE, got 'TURBO'"),
                          ({"tokens": -50}, "tokens must be an integer >= requests, got -50"),
                          ({"kind": "banana"}, "kind must be one of"),
                          ({"requests": None}, "requests must be an integer >= 1, got None"),
                          # (numbers that contradict each other: accepted before, "padded tokens -3 -> 0")
                          ({"padded_tokens": rec["tokens"] - 1}, "padded_tokens must be an integer >= tokens"),
                          ({"k": -3}, "k must be an integer >= 0"),
                          ({"kind": "uniform_decode", "q": 1, "requests": 4, "tokens": 9, "padded_tokens": 16},
                           "a uniform decode's tokens must be requests x q = 4 x 1, got 9")]:
        bad.write_text(first_record + json.dumps({**rec, **change}) + "\n")  # (tracebacks or nonsense before)
        assert main(["replay", str(bad)]) == 2
        assert f"record 2 of {str(bad)!r} is not a step record: {words}" in capsys.readouterr().err
    bad.write_text(first_record + json.dumps({k: v for k, v in rec.items() if k != "kind"}) + "\n")
    assert main(["replay", str(bad)]) == 2
    assert "is not a step record: kind is missing (one of uniform_decode" in capsys.readouterr().err
    bad.write_bytes(first_record.encode() + b"\x94\xff binary\n")  # (a traceback before)
    assert main(["replay", str(bad)]) == 2
    assert "line 2: not UTF-8 text" in capsys.readouterr().err


RUNTIME_JSON = os.path.join(os.path.dirname(__file__), "..", "docs", "bench", "runtime_h200.json")


def write_table(tmp_path, table, name="table.json"):
    path = tmp_path / name
    path.write_text(json.dumps(table))
    return str(path)


def test_cost_table_prices_each_step_at_its_padded_size(tmp_path, capsys):
    trace = make_trace(tmp_path, LEGACY)
    # linear curves with a distinct slope per mode: a step's cost is slope(mode) x its padded tokens
    slope = {"FULL": 0.001, "PIECEWISE": 0.002, "NONE": 0.01}
    table = write_table(tmp_path, {mode: [[1, s], [16384, 16384 * s]] for mode, s in slope.items()})
    r = run_replay(capsys, trace, "--platform", "sm100", "--speculative-config", K7, "--compilation-config", LEGACY,
                   "--cost-table", table)
    records = [json.loads(line) for line in open(trace)]
    expected_ms = sum(slope[rec["mode"]] * rec["padded_tokens"] for rec in records)
    assert r["recorded"]["estimated_device_seconds"] == pytest.approx(expected_ms / 1e3, abs=1e-4)
    assert r["replayed"]["estimated_device_seconds"] == r["recorded"]["estimated_device_seconds"]
    assert r["cost_model"] == f"table {table}"
    # flat curves: the estimate is steps x ms per mode, and separate grids trade eager steps for graph replays
    flat = write_table(tmp_path, {"FULL": [[1, 1.0], [8192, 1.0]], "NONE": [[1, 10.0], [8192, 10.0]],
                                  "PIECEWISE": [[1, 2.0], [8192, 2.0]]}, "flat.json")
    r = run_replay(capsys, trace, "--platform", "sm100", "--speculative-config", K7, "--cost-table", flat)
    for side in ("recorded", "replayed"):
        rows = r[side]["by_kind"].values()
        ms = sum(1.0 * k["full"] + 2.0 * k["piecewise"] + 10.0 * k["eager"] for k in rows)
        assert r[side]["estimated_device_seconds"] == pytest.approx(ms / 1e3, abs=1e-4)
    assert r["replayed"]["estimated_device_seconds"] < r["recorded"]["estimated_device_seconds"]


def test_cost_table_from_the_runtime_benchmark(tmp_path, capsys):
    from dispatcher.engine.cost import load_cost_table

    data = json.load(open(RUNTIME_JSON))
    for entry in data["models"]:
        costs = load_cost_table(RUNTIME_JSON, entry["model"])
        for step in entry["steps"]:
            same_tokens = [s for s in entry["steps"] if s["tokens"] == step["tokens"]]
            eager = statistics.median(s["eager_ms"] for s in same_tokens)
            assert costs.step_ms("NONE", step["tokens"]) == pytest.approx(max(eager, costs.full(step["tokens"])))
            if step["kind"] == "piecewise":
                assert costs.step_ms("PIECEWISE", step["tokens"]) == pytest.approx(step["replay_ms"])
            else:
                full = [s["replay_ms"] for s in same_tokens if s["kind"] != "piecewise"]
                assert costs.step_ms("FULL", step["tokens"]) == pytest.approx(statistics.median(full))
    trace = make_trace(tmp_path, LEGACY)
    base = [trace, "--platform", "sm100", "--speculative-config", K7, "--cost-table", RUNTIME_JSON]
    r = run_replay(capsys, *base)
    assert r["cost_model"] == f"table {RUNTIME_JSON} (bench-moe)"
    large = run_replay(capsys, *base, "--cost-model", "bench-moe-large")
    assert large["cost_model"].endswith("(bench-moe-large)")
    assert large["replayed"]["estimated_device_seconds"] != r["replayed"]["estimated_device_seconds"]


@pytest.mark.parametrize("table, extra, needle", [
    (None, [], "--cost-table: cannot read"),
    ([[1, 2]], [], "holds a JSON list, not a table object"),
    ({"FULL": [[1, 1.0], [8, 2.0]], "EAGER": [[1, 1.0], [8, 2.0]]}, [], "unknown key 'EAGER'"),
    ({"FULL": [[1, 1.0]], "NONE": [[1, 1.0], [8, 2.0]]}, [], "FULL: needs a list of at least two"),
    ({"FULL": [[1, 1.0], [0, 2.0]], "NONE": [[1, 1.0], [8, 2.0]]}, [], "FULL[1]: [0, 2.0] is not [tokens >= 1"),
    ({"FULL": [[1, 1.0], [8, -2.0]], "NONE": [[1, 1.0], [8, 2.0]]}, [], "FULL[1]: [8, -2.0] is not"),
    ({"FULL": [[8, 1.0], [8, 2.0]], "NONE": [[1, 1.0], [8, 2.0]]}, [], "FULL: 8 tokens appears more than once"),
    ({"FULL": [[1, 1.0], [8, 2.0]]}, [], "has no NONE curve"),
    ({"FULL": [[1, 1.0], [8, 2.0]], "NONE": [[1, 1.0], [8, 2.0]]}, ["--cost-model", "bench-moe"],
     "--cost-model 'bench-moe' picks a model of a runtime benchmark's JSON"),
    ("runtime", ["--cost-model", "bench-dense"], "--cost-model: '%s' holds no model 'bench-dense'; it holds "
                                                 "bench-moe, bench-moe-large"),
    ({"models": [{"model": "a", "steps": [{"kind": "piecewise", "tokens": 1}]}]}, [], "model 'a' step 0 is not"),
    ({"models": [{"model": "a", "steps": []}, {"model": "b", "steps": []}]}, [], "holds models a, b: choose one"),
])
def test_bad_cost_tables_are_one_line(table, extra, needle, tmp_path, capsys):
    trace = tmp_path / "one_step.jsonl"
    trace.write_text(json.dumps({"step": 1, "kind": "mixed", "requests": 1, "tokens": 10, "is_decode": False,
                                 "query_len_hist": {"10": 1}, "mode": "PIECEWISE", "padded_tokens": 16}) + "\n")
    trace = str(trace)
    if table == "runtime":
        path = RUNTIME_JSON
        needle = needle % RUNTIME_JSON
    else:
        path = write_table(tmp_path, table) if table is not None else str(tmp_path / "missing.json")
    assert main(["replay", trace, "--platform", "sm100", "--cost-table", path, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err


def test_cost_model_without_a_table_must_be_a_preset(tmp_path, capsys):
    assert main(["replay", make_trace(tmp_path, "{}"), "--cost-model", "bench-dense"]) == 2
    assert "--cost-model: 'bench-dense' is not a preset (bench-moe, bench-moe-large)" in capsys.readouterr().err


def engine_trace(tmp_path):
    """A step trace written by the engine itself (tiny-dense on the CPU, eagle3 K = 3): mixed and decode steps."""
    from dispatcher.engine.engine_core import EngineArgs, EngineCore
    from models.config import preset
    from scheduler.request import SamplingParams

    cfg = resolve({}, {"method": "eagle3", "num_speculative_tokens": 3}, platform="sm100", max_num_seqs=8,
                  max_num_batched_tokens=64)
    path = tmp_path / "engine_trace.jsonl"
    with EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=200, block_size=8, max_model_len=128,
                                    step_trace=str(path))) as e:
        e.generate([[5 + i] * (10 + 7 * i) for i in range(6)], SamplingParams(max_tokens=12, ignore_eos=True))
    return str(path)


def test_replay_execute_times_every_recorded_shape(tmp_path, capsys):
    trace = engine_trace(tmp_path)
    flags = ["--platform", "sm100", "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}',
             "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]
    r = run_replay(capsys, trace, *flags, "--execute", "--model", "tiny-dense", "--device", "cpu",
                   "--context-len", "32", "--repeats", "2")
    x = r["executed"]
    assert x["steps"] == r["steps"] > 0 and 0 < x["distinct_shapes"] <= x["steps"]
    assert x["executed_device_seconds"] > 0 and x["recorded_device_seconds"] > 0
    assert sum(m["steps"] for m in x["by_mode"].values()) == x["steps"]
    replayed = r["replayed"]["by_kind"]
    modes = {"FULL": sum(k["full"] for k in replayed.values()), "PIECEWISE": sum(k["piecewise"] for k in
             replayed.values()), "NONE": sum(k["eager"] for k in replayed.values())}
    assert {m: v["steps"] for m, v in x["by_mode"].items()} == {m: n for m, n in modes.items() if n}
    assert main(["replay", trace, *flags, "--execute", "--device", "cpu", "--context-len", "-1"]) == 2
    assert "--context-len must be >= 0, got -1" in capsys.readouterr().err
    assert main(["replay", trace, *flags, "--execute", "--device", "cpu", "--model", "no-such-model"]) == 2
    assert "--model: " in capsys.readouterr().err
    for flag, value in (("--model", "x"), ("--device", "tpu"), ("--repeats", "0"), ("--context-len", "-5")):
        assert main(["replay", trace, *flags, flag, value]) == 2  # (each was ignored at exit 0: the CLI probe)
        assert f"{flag} is for --execute" in capsys.readouterr().err


@pytest.mark.gpu
def test_replay_execute_on_the_gpu_replays_graphs(tmp_path, capsys):
    """On a GPU the recorded shapes replay the new plan's CUDA graphs: the FULL decodes take less time a step than
    the eager ones of a plan without graphs, measured the same way."""
    trace = engine_trace(tmp_path)
    flags = [trace, "--platform", "sm100", "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}',
             "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--execute", "--model", "tiny-moe",
             "--device", "cuda"]
    graphs = run_replay(capsys, *flags)["executed"]
    eager = run_replay(capsys, *flags, "--compilation-config", '{"cudagraph_mode": "NONE"}')["executed"]
    assert set(graphs["by_mode"]) <= {"FULL", "PIECEWISE"} and set(eager["by_mode"]) == {"NONE"}
    assert graphs["executed_device_seconds"] < eager["executed_device_seconds"]


def write_trace(tmp_path, records, name="costs.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def step(mode, padded, ms, kind="uniform_decode"):
    return {"step": 0, "kind": kind, "requests": 1, "tokens": padded, "q": 8, "mode": mode, "padded_tokens": padded,
            "device_ms": ms}


def test_cost_table_from_step_traces_is_each_modes_median_per_padded_size(tmp_path, capsys):
    from dispatcher.engine.cost import load_cost_table
    from dispatcher.plan.config import ConfigError

    a = write_trace(tmp_path, [step("FULL", 8, 1.0), step("FULL", 8, 3.0), step("FULL", 8, 2.5), step("FULL", 64, 4.0),
                               step("PIECEWISE", 16, 5.0), step("PIECEWISE", 32, 6.0)], "a.jsonl")
    b = write_trace(tmp_path, [step("NONE", 16, 20.0), step("NONE", 9000, 90.0),
                               {"mode": "FULL", "padded_tokens": 64}], "b.jsonl")  # (no device time: skipped)
    costs = load_cost_table(f"{a},{b}")
    assert costs.step_ms("FULL", 8) == 2.5 and costs.step_ms("FULL", 64) == 4.0
    assert costs.step_ms("FULL", 36) == pytest.approx(3.25)  # interpolated
    assert costs.step_ms("PIECEWISE", 32) == 6.0 and costs.step_ms("NONE", 16) == 20.0
    trace = make_trace(tmp_path, LEGACY)
    r = run_replay(capsys, trace, "--platform", "sm100", "--speculative-config", K7, "--cost-table", f"{a},{b}")
    assert r["cost_model"] == f"step traces {a},{b}" and r["replayed"]["estimated_device_seconds"] > 0
    with pytest.raises(ConfigError, match="fewer than two token counts of NONE"):
        load_cost_table(a)
    with pytest.raises(ConfigError, match="cannot read"):
        load_cost_table(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="line 2"):
        load_cost_table(_broken(tmp_path))


def _broken(tmp_path) -> str:
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(step("FULL", 8, 1.0)) + "\n{not json\n")
    return str(path)


def test_replay_of_the_h200_trace_predicts_the_live_separate_server(capsys):
    """docs/headline.md's claim: vLLM's list's trace at 256 streams (e818375), replayed under separate grids with
    step times from the separate server's other concurrencies of the same run, predicts the live separate server's
    eager steps exactly and its device time within 15%."""
    traces = os.path.join(os.path.dirname(RUNTIME_JSON), "traces")
    live = [json.loads(line) for line in open(os.path.join(traces, "headline_e818375_separate_256.jsonl"))]
    r = run_replay(capsys, os.path.join(traces, "headline_e818375_vllm-default_256.jsonl"), "--platform", "sm100",
                   "--max-num-seqs", "1024", "--max-num-batched-tokens", "16384", "--speculative-config", K7,
                   "--cost-table", os.path.join(traces, "headline_e818375_separate_not256.jsonl"))
    assert r["replayed"]["eager_steps"] == sum(rec["mode"] == "NONE" for rec in live) == 1
    live_s = sum(rec["device_ms"] for rec in live) / 1e3
    assert abs(r["replayed"]["estimated_device_seconds"] / live_s - 1) < 0.15


def test_replay_under_auto_tiers_reshapes_decodes_to_the_chosen_k(tmp_path, capsys):
    trace = make_trace(tmp_path, "{}")
    auto = json.dumps({**json.loads(K7), "num_speculative_tokens_per_batch_size": "auto",
                       "auto_tier_candidates": [0, 3, 7]})
    r = run_replay(capsys, trace, "--platform", "sm100", "--speculative-config", auto, "--acceptance", "0.6")
    a = r["auto_tiers"]
    # bench-moe's curves, the drafter's share, 0.6 decaying; K = 0 still pays the head's step 0 (it runs every step)
    assert a["initial"] == [[1, 3], [422, 0]]
    records = [json.loads(line) for line in open(trace, encoding="utf-8")]
    assert len(a["k_per_step"]) == len(records)
    for rec, k in zip(records, a["k_per_step"]):
        assert (k is None) == (rec["kind"] != "uniform_decode")
        if k is not None:
            assert k == next(kk for lo, kk in reversed(a["initial"]) if lo <= rec["requests"])
    assert sum(a["steps_by_k"].values()) == sum(k is not None for k in a["k_per_step"])
    assert r["replayed"]["by_kind"]["uniform_decode"]["eager"] == 0
    # --acceptance needs auto tiers
    assert main(["replay", trace, "--platform", "sm100", "--speculative-config", K7, "--acceptance", "0.5"]) == 2
    assert "--acceptance is for" in capsys.readouterr().err


def test_the_recorded_column_is_the_trace_whatever_the_replay_changes(tmp_path, capsys):
    """A prefix-cache hit rate cuts prefills and auto tiers reshape decodes in the replayed column only: the recorded
    column (eager steps, padded tokens, device time) stays the trace's own (it took the new shapes' tokens with the
    recorded padded sizes: padding negative or many times too large, found in review)."""
    trace = make_trace(tmp_path, "{}")
    plain = run_replay(capsys, trace, "--platform", "sm100", "--speculative-config", K7)
    cut = run_replay(capsys, trace, "--platform", "sm100", "--speculative-config", K7, "--prefix-cache-hit-rate", "0.5")
    auto = json.dumps({**json.loads(K7), "num_speculative_tokens_per_batch_size": "auto",
                       "auto_tier_candidates": [0, 3, 7]})
    tiers = run_replay(capsys, trace, "--platform", "sm100", "--speculative-config", auto, "--acceptance", "0.6")
    records = [json.loads(line) for line in open(trace, encoding="utf-8")]
    padding = sum(int(r["padded_tokens"]) - int(r["tokens"]) for r in records)
    for r in (plain, cut, tiers):
        assert r["recorded"] == plain["recorded"]
        assert r["recorded"]["padded_tokens"] == padding >= 0
    assert cut["replayed"] != plain["replayed"] and tiers["replayed"] != plain["replayed"]
