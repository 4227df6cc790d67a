"""scripts/merge_engine.py: the engine table joined from several device runs keeps each cell's policies from one run
(its ratios are taken within that run), a rerun replaces a cell whole, and the target check flags misses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from merge_engine import check, merge  # noqa: E402


def row(policy, conc, tok_s, ratio, bound, workload="eagle3-k7"):
    return {"policy": policy, "workload": workload, "acceptance": "fixed-3.0", "concurrency": conc,
            "output_tok_s": tok_s, "tok_s_ratio": ratio, "tok_s_ratio_paired": ratio, "bound_ratio": bound,
            "eager_steps": 0, "device_ms": 1.0}


def part(tmp_path, name, commit, rows):
    path = tmp_path / name
    path.write_text(json.dumps({"command": f"bench {name}", "commit": commit, "device": "H200", "model": "bench-moe",
                                "output_len": 256, "torch": "2.11", "prompt_tokens_mean": 88.0, "rows": rows}))
    return str(path)


def test_a_rerun_replaces_whole_cells_and_the_check_flags_misses(tmp_path):
    first = part(tmp_path, "a.json", "aaa", [
        row("vllm-default", 1, 100, 1.0, 1.0), row("separate", 1, 83, 0.83, 0.85),
        row("vllm-default", 256, 100, 1.0, 1.0), row("separate", 256, 150, 1.5, 2.0)])
    rerun = part(tmp_path, "b.json", "bbb", [row("vllm-default", 1, 100, 1.0, 1.0), row("separate", 1, 101, 1.01, 1.0)])
    merged = merge([first, rerun], "table.json")
    assert [r["commit"] for r in merged["runs"]] == ["aaa", "bbb"]
    assert merged["command"].endswith("b.json --out table.json")
    one = [r for r in merged["rows"] if r["concurrency"] == 1]
    assert {r["run"] for r in one} == {1} and {r["output_tok_s"] for r in one} == {100, 101}
    assert [r["output_tok_s"] for r in merged["superseded_rows"]] == [100, 83]
    verdicts = {line.split()[2]: line.split("  ")[-1] for line in check(merged["rows"])[1:]}
    assert verdicts == {"1": "ok", "256": "< 90% of bound"}
    floor = merge([part(tmp_path, "c.json", "ccc", [row("vllm-default", 16, 100, 1.0, 1.0),
                                                     row("separate", 16, 97, 0.97, 0.97)])], "table.json")
    assert check(floor["rows"])[1].endswith("< 0.98x")


def test_runs_of_different_models_are_refused(tmp_path):
    a = part(tmp_path, "a.json", "aaa", [row("vllm-default", 1, 100, 1.0, 1.0)])
    b = tmp_path / "b.json"
    b.write_text(json.dumps({**json.loads(open(a).read()), "model": "bench-dense"}))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "merge_engine.py"), a, str(b), "--out",
                           str(tmp_path / "out.json")], capture_output=True, text=True)
    assert proc.returncode != 0 and "device, model, output_len differ from a.json's" in proc.stderr
