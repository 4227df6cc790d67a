"""``twogrid replay``: a step trace re-dispatched under another configuration."""

import json

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
