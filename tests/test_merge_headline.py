"""scripts/merge_headline.py: headline runs joined into one table keep each cell's policies from one run (ratios
computed within it), a rerun replaces a cell whole, other models are cells of their own, and the target check
names a cell where separate grids trail another engine's list."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from merge_headline import check, merge  # noqa: E402


def row(policy, conc, tok_s, device_s, model="bench-moe", workload="eagle3-k7"):
    return {"policy": policy, "model": model, "workload": workload, "acceptance": "fixed-3.0", "concurrency": conc,
            "output_tok_s": tok_s, "device_s": device_s, "eager_steps": 0, "tpot_ms_mean": 1.0, "ttft_ms_mean": 1.0,
            "gpu_busy": 1.0, "steps": 10, "padded_tokens": 0}


def run_file(tmp_path, name, commit, rows, model="bench-moe (random weights)"):
    path = tmp_path / name
    path.write_text(json.dumps({"command": f"bench {name}", "commit": commit, "model": model, "output_len": 256,
                                "api_server_count": 4, "rows": rows}))
    return str(path)


def test_reruns_replace_cells_ratios_stay_within_runs_and_rivals_are_checked(tmp_path):
    first = run_file(tmp_path, "lists.json", "aaa", [
        row("vllm-default", 64, 100, 2.0), row("separate", 64, 150, 1.3), row("sglang", 64, 170, 1.2),
        row("vllm-default", 512, 100, 2.0), row("separate", 512, 120, 1.0)])
    rerun = run_file(tmp_path, "rerun.json", "bbb", [row("vllm-default", 512, 200, 2.0),
                                                     row("separate", 512, 230, 1.8)])
    dense = run_file(tmp_path, "dense.json", "bbb", [row("vllm-default", 512, 50, 1.0, "bench-dense"),
                                                     row("separate", 512, 50, 1.0, "bench-dense")], "bench-dense")
    merged = merge([first, rerun, dense], "table.json")
    assert [r["commit"] for r in merged["runs"]] == ["aaa", "bbb", "bbb"]
    at512 = {(r["model"], r["policy"]): r for r in merged["rows"] if r["concurrency"] == 512}
    assert at512["bench-moe", "separate"]["run"] == 1 and at512["bench-moe", "separate"]["tok_s_ratio"] == 1.15
    assert at512["bench-moe", "separate"]["bound_ratio"] == round(2.0 / 1.8, 3)
    assert at512["bench-dense", "separate"]["tok_s_ratio"] == 1.0  # its own cell, not the rerun's
    assert sorted(r["output_tok_s"] for r in merged["superseded_rows"]) == [100, 120]
    verdicts = {(line.split()[0], line.split()[3]): line.split("  ")[-1] for line in check(merged["rows"])[1:]}
    assert verdicts == {("bench-moe", "64"): "< sglang (0.882)", ("bench-moe", "512"): "ok",
                        ("bench-dense", "512"): "ok"}


def test_repeats_settle_the_rival_check_by_the_median_and_stay_out_of_the_table(tmp_path):
    table = run_file(tmp_path, "lists.json", "aaa", [
        row("vllm-default", 64, 100, 2.0), row("separate", 64, 94, 2.0), row("sglang", 64, 100, 1.2),
        row("vllm-default", 256, 100, 2.0), row("separate", 256, 98, 2.0), row("sglang", 256, 100, 1.2)])
    again = run_file(tmp_path, "again.json", "bbb", [row("vllm-default", 64, 90, 2.0), row("separate", 64, 103, 1.3),
                                                     row("sglang", 64, 100, 1.2), row("separate", 256, 99, 1.3),
                                                     row("sglang", 256, 100, 1.2)])
    order = run_file(tmp_path, "order.json", "bbb", [row("sglang", 64, 100, 1.2), row("separate", 64, 101, 1.3),
                                                     row("separate", 256, 101, 1.3)])  # (no sglang at 256)
    merged = merge([table], "t.json", [again, order])
    assert [r["commit"] for r in merged["repeat_runs"]] == ["bbb", "bbb"]
    assert {(r["run"], r["output_tok_s"]) for r in merged["rows"] if r["policy"] == "separate"} == {(0, 94), (0, 98)}
    verdicts = {line.split()[3]: line.split("  ")[-1] for line in check(merged["rows"], merged["repeat_rows"])[1:]}
    assert verdicts["64"] == "ok (sglang 1.010 median of 3 runs: 0.940, 1.030, 1.010)"
    assert verdicts["256"] == "< sglang (0.985 median of 2 runs: 0.980, 0.990)"
    assert check(merged["rows"])[1].endswith("< sglang (0.940)")  # (the table's run alone)
    longer = tmp_path / "longer.json"
    longer.write_text(json.dumps({**json.loads(open(again).read()), "output_len": 512}))
    with pytest.raises(SystemExit, match="output_len 512 differs from the table's 256"):
        merge([table], "t.json", [str(longer)])


def test_the_command_line_writes_the_table_and_both_plots(tmp_path):
    a = run_file(tmp_path, "a.json", "aaa", [row("vllm-default", 16, 100, 1.0), row("separate", 16, 97, 1.0),
                                             row("vllm-default", 16, 90, 1.0, workload="no-sd")])  # (two panels)
    out = tmp_path / "headline.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "merge_headline.py"), a, "--out", str(out),
                           "--markdown"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "< 0.98x" in proc.stdout and "| **separate** | 97 (0.97x / 1.00) |" in proc.stdout
    again = run_file(tmp_path, "b.json", "bbb", [row("vllm-default", 16, 100, 1.0), row("separate", 16, 99, 1.0)])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "merge_headline.py"), a, "--out", str(out),
                           "--repeats", again], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["repeat_runs"][0]["file"] == "b.json"
    assert json.loads(out.read_text())["rows"][1]["tok_s_ratio"] == 0.97
    assert (tmp_path / "headline.png").stat().st_size and (tmp_path / "headline_eagle3-k7.png").stat().st_size


def test_a_rerun_cut_short_does_not_drop_the_policies_it_lacks(tmp_path):
    full = run_file(tmp_path, "full.json", "aaa", [row("vllm-default", 512, 100, 2.0), row("separate", 512, 120, 1.0)])
    cut = run_file(tmp_path, "cut.json", "bbb", [row("vllm-default", 512, 90, 2.0)])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "merge_headline.py"), full, cut, "--out",
                           str(tmp_path / "out.json")], capture_output=True, text=True)
    assert proc.returncode != 0 and "lacks separate" in proc.stderr
    alone = merge([run_file(tmp_path, "sep.json", "ccc", [row("separate", 64, 50, 1.0)])], "t.json")
    assert check(alone["rows"])[1].endswith("no ratio: vllm-default not measured in this run")
