"""benchmarks/bench_spec_gpu.py without a GPU: its rows from fake ``twogrid bench`` results (the mean acceptance
length from the server's counters), the ratio to no speculation, the matrix loop (cells measured already are
skipped, a server that does not start is recorded and the rest go on) and the merge of split runs."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


@pytest.fixture
def spec(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    return importlib.import_module("bench_spec_gpu")


ARGS = argparse.Namespace(model="/cache/SmolLM2-135M-Instruct.Q4_1.gguf", waves=1, fixed_acceptance=None,
                          no_fuse_decode_steps=False)


def bench_result(tokens: int, duration: float, accepted: int | None = None, drafts: int | None = None,
                 per_pos: dict | None = None) -> dict:
    """The fields of a ``twogrid bench`` result that a row reads; the speculative counters only where given (a
    server that does not export one gives no field)."""
    out = {"total_output_tokens": tokens, "duration": duration, "output_throughput": tokens / duration,
           "mean_tpot_ms": 5.0, "p99_tpot_ms": 9.0, "mean_ttft_ms": 20.0, "eager_steps": 1, "padded_tokens": 3,
           "cudagraph_steps": 100, "step_device_seconds": 0.9 * duration, "completed": 16, "failed": 0}
    if accepted is not None:
        out["spec_decode_num_accepted_tokens"] = accepted
    if drafts is not None:  # (as dispatcher.bench.server_metrics derives them from the counters)
        out["spec_decode_num_drafts"] = drafts
        out["mean_acceptance_length"] = round(1 + (accepted or 0) / drafts, 4) if drafts else None
    if per_pos is not None:
        out["spec_decode_accepted_per_pos"] = [per_pos[p] for p in sorted(per_pos, key=int)]
    return out


def test_method_names(spec):
    assert spec.parse_method("none") == ("none", 0, None)
    assert spec.parse_method("eagle3:3") == ("eagle3", 3, {"method": "eagle3", "num_speculative_tokens": 3})
    assert spec.parse_method("ngram:2")[:2] == ("ngram", 2)
    for bad in ("eagle3", "eagle3:0", "eagle3:x", "medusa:2", "none:1"):
        with pytest.raises(ValueError):
            spec.parse_method(bad)
    assert [spec.label(*spec.parse_method(m)[:2]) for m in spec.METHODS.split(",")] == spec.METHODS.split(",")
    assert spec.parse_method("eagle3:3@/root/e3 new/head") == (
        "eagle3@e3_new-head", 3, {"method": "eagle3", "num_speculative_tokens": 3, "model": "/root/e3 new/head"})
    method, k, config = spec.parse_method("eagle3:auto5@heads/b/")
    assert (spec.label(method, k), config["model"]) == ("eagle3@heads-b:auto5", "heads/b/")
    assert spec.file_stem("separate", method, k) == "separate-eagle3.heads-b-kauto5"
    assert spec.file_stem("separate", "eagle3@e3_new-head", 3) == "separate-eagle3.e3_new-head-k3"
    assert spec.file_stem("vllm", "none", 0) == "vllm-none"
    for bad in ("ngram:3@/root/h", "eagle3:3@", "none@/root/h"):
        with pytest.raises(ValueError):
            spec.parse_method(bad)


def test_row_has_the_acceptance_length_and_the_rate_per_position(spec):
    bench = bench_result(4096, 2.0, accepted=600, drafts=400, per_pos={"1": 200, "0": 300, "2": 100})
    row = spec.spec_row("separate", "eagle3", 3, 16, bench, ARGS)
    assert (row["policy"], row["method"], row["k"], row["concurrency"]) == ("separate", "eagle3", 3, 16)
    assert row["output_tok_s"] == 2048.0 and row["tpot_ms_mean"] == 5.0 and row["ttft_ms_mean"] == 20.0
    assert row["eager_steps"] == 1 and row["steps"] == 100 and row["gpu_busy"] == 0.9
    assert row["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and "workload" not in row
    assert row["mean_acceptance_length"] == 2.5  # 1 + 600 / 400
    assert row["acceptance_rate_per_position"] == [0.75, 0.5, 0.25]


def test_no_drafts_no_acceptance_length(spec):
    plain = spec.spec_row("separate", "none", 0, 1, bench_result(256, 1.0, accepted=0, drafts=0), ARGS)
    assert plain["mean_acceptance_length"] is None and "acceptance_rate_per_position" not in plain
    # a server without the drafts counter: the accepted tokens are kept, the length is unknown
    old = spec.spec_row("separate", "ngram", 3, 1, bench_result(256, 1.0, accepted=40), ARGS)
    assert old["accepted_tokens"] == 40 and old["drafts"] is None and old["mean_acceptance_length"] is None


def row(policy: str, method: str, k: int, conc: int, tok_s: float, **extra) -> dict:
    return {"policy": policy, "method": method, "k": k, "concurrency": conc, "output_tok_s": tok_s,
            "eager_steps": 0, "mean_acceptance_length": None if method == "none" else 2.0, **extra}


def test_ratio_to_no_speculation_of_the_same_policy_and_concurrency(spec):
    rows = [row("separate", "none", 0, 1, 200.0), row("separate", "eagle3", 3, 1, 300.0),
            row("separate", "eagle3", 3, 16, 3000.0), row("vllm-default", "none", 0, 1, 100.0),
            row("vllm-default", "eagle3", 3, 1, 250.0)]
    spec.add_ratios(rows)
    assert [r.get("vs_no_sd") for r in rows] == [1.0, 1.5, None, 1.0, 2.5]  # no none row at 16 streams
    table = spec.markdown(rows)
    assert "| separate | 1 | 16 |" in table and "| eagle3:3 | 300 (1.50x, AL 2.00) | 3000 (AL 2.00) |" in table
    assert "| vllm-default | 1 |" in table and "| none | 100 |" in table


class FakeServer:
    pid = 0
    returncode = None
    stopped = False

    def poll(self):
        return None

    def send_signal(self, sig):
        self.stopped = True

    def wait(self, timeout=None):
        return 0


def test_matrix_skips_measured_cells_and_goes_on_past_a_server_that_fails(spec, monkeypatch, tmp_path):
    started, benched = [], []

    def launch(cmd, name, port, log_path, wait=True):
        server = FakeServer()
        server.cmd, server.log_path = cmd, log_path
        started.append((name, server))
        return server

    def wait_healthy(proc, name, port):
        if "eagle3" in " ".join(proc.cmd):
            raise RuntimeError(f"{name}: the server exited with 1 (log {proc.log_path})")

    def run_bench(base, conc, label, result_dir, args, server_pid=None, served_name=None):
        benched.append((label, conc))
        return bench_result(1000 * conc, 1.0, accepted=conc, drafts=conc)

    monkeypatch.setattr(spec, "launch", launch)
    monkeypatch.setattr(spec, "wait_healthy", wait_healthy)
    monkeypatch.setattr(spec, "run_bench", run_bench)
    monkeypatch.setattr(spec, "scrape", lambda base: "twogrid:fused_decode_steps_total{model_name=\"m\"} 7.0\n")
    args = argparse.Namespace(model="x.gguf", tokenizer=None, port=8123, max_model_len=4096, device="cpu",
                              api_server_count=1, waves=1, step_trace_dir=None, fixed_acceptance=None,
                              no_fuse_decode_steps=False)
    result = {"rows": [row("separate", "none", 0, 1, 1000.0), row("separate", "ngram", 3, 1, 1000.0),
                       row("separate", "ngram", 3, 16, 1000.0)], "servers": [], "errors": []}
    saves = []
    methods = [spec.parse_method(m) for m in ("none", "ngram:3", "eagle3:3")]
    spec.measure(result, methods, ["separate"], [1, 16], args, str(tmp_path), lambda: saves.append(1))
    assert [name for name, _ in started] == ["separate none", "separate eagle3:3"]  # ngram:3: measured already
    assert all(server.stopped for _, server in started)  # the one that failed to start too
    assert benched == [("separate-none", 16)]
    assert [spec.cell(r) for r in result["rows"][3:]] == [("separate", "none", 0, True, 16)]
    assert result["errors"][0]["method"] == "eagle3" and "exited with 1" in result["errors"][0]["error"]
    assert [s["method"] for s in result["servers"]] == ["none"] and saves



def test_together_rotates_the_servers_and_pairs_each_round_with_no_speculation(spec, monkeypatch, tmp_path):
    """``--together``: the servers run in rotating order each round (so a drift of the machine falls on every
    side of a ratio), a row's tok/s is the median of its rounds and ``vs_no_sd`` the median of the same rounds'
    ratios, which ``add_ratios`` leaves as measured; every server is stopped."""
    order, started = [], []
    rounds = {"none": [1000.0, 500.0, 1000.0], "ngram": [1500.0, 900.0, 1100.0]}

    def launch(cmd, name, port, log_path, wait=True):
        server = FakeServer()
        server.cmd = cmd
        started.append(server)
        return server

    def run_bench(base, conc, label, result_dir, args, server_pid=None, served_name=None, warmups=None):
        method = "ngram" if "ngram" in label else "none"
        rnd = int(label.rsplit("-r", 1)[1])
        order.append((rnd, method, warmups))
        return bench_result(int(rounds[method][rnd] * 10), 10.0)

    monkeypatch.setattr(spec, "launch", launch)
    monkeypatch.setattr(spec, "wait_healthy", lambda proc, name, port: None)
    monkeypatch.setattr(spec, "run_bench", run_bench)
    monkeypatch.setattr(spec, "kv_blocks", lambda model, gib: 123)
    args = argparse.Namespace(model="x.gguf", tokenizer=None, port=8123, max_model_len=4096, device="cpu",
                              api_server_count=1, waves=1, fixed_acceptance=None, no_fuse_decode_steps=False,
                              rounds=3, kv_gib=1.0, step_trace_dir=str(tmp_path / "traces"))
    result = {"rows": [], "servers": [], "errors": []}
    methods = [spec.parse_method(m) for m in ("none", "ngram:3")]
    spec.measure_together(result, methods, ["separate"], [16], args, str(tmp_path), lambda: None)
    traces = [s.cmd[s.cmd.index("--step-trace") + 1] for s in started]  # (each server its own trace)
    assert traces == [str(tmp_path / "traces" / f"trace-separate-{m}.jsonl") for m in ("none", "ngram-k3")]
    assert [(r, m) for r, m, _ in order] == [(0, "none"), (0, "ngram"), (1, "ngram"), (1, "none"),
                                             (2, "none"), (2, "ngram")]
    assert [w for _, _, w in order] == [None, None, 0, 0, 0, 0]  # a warm-up wave before each server's first run
    assert all("--num-kv-blocks" in s.cmd and "123" in s.cmd for s in started) and all(s.stopped for s in started)
    none, ngram = result["rows"]
    assert none["output_tok_s"] == 1000.0 and ngram["output_tok_s"] == 1100.0
    assert ngram["vs_no_sd_runs"] == [1.5, 1.8, 1.1] and ngram["vs_no_sd"] == 1.5
    spec.add_ratios(result["rows"])
    assert ngram["vs_no_sd"] == 1.5  # (not 1100 / 1000: the paired ratios stand)


def test_an_auto_server_is_paired_with_every_fixed_k_round_by_round(spec):
    """An ``"auto"`` row carries, per fixed-K server of its policy (no SD as K = 0), the median over rounds of its
    tok/s over that server's in the same round (``vs_fixed``), and the least of them (``vs_best_fixed``, issue 29's
    measure). Here the rounds of the cell move together (the first 20% low): by median tok/s auto is 0.95x of K = 5
    (95 against 100, from different rounds), paired round by round 0.988x (0.988, 0.99, 0.922); other policies'
    servers are not its baseline."""
    e3 = {"method": "eagle3"}
    servers = [("none", 0, None, "separate"), ("eagle3", 3, e3, "separate"), ("eagle3", 5, e3, "separate"),
               ("eagle3", -5, e3, "separate"), ("eagle3", 3, e3, "vllm")]
    tok_s = {0: [50, 62, 62], 1: [78, 97, 98], 2: [80, 100, 103], 3: [79, 99, 95], 4: [1, 1, 1]}
    runs = [[bench_result(10 * t, 10.0) for t in tok_s[i]] for i in range(len(servers))]
    out = spec.vs_fixed(servers, runs, 3)
    assert out == {"vs_fixed": {"none": 1.58, "eagle3:3": 1.013, "eagle3:5": 0.988}, "vs_best_fixed": 0.988,
                   "best_fixed": "eagle3:5"}
    row = spec.together_row(servers, runs, 3, 16, ARGS, chosen=5)
    assert row["tiers"] == "auto" and row["vs_best_fixed"] == 0.988 and row["chosen_k"] == 5
    assert row["output_tok_s"] == 95.0 and "vs_fixed" not in spec.together_row(servers, runs, 2, 16, ARGS)


def test_a_head_given_by_directory_is_paired_with_the_default_head_round_by_round(spec):
    """``eagle3:3@DIR``'s rows carry the median over rounds of its tok/s over the default head's at the same K and
    policy in the same round (``vs_default_head``): whether a retrained head beats the shipped one. No such row for
    the default head's own servers, nor where the run has no default-head server at that K."""
    e3 = {"method": "eagle3"}
    head = dict(e3, model="/root/e3n/head")
    servers = [("none", 0, None, "separate"), ("eagle3", 3, e3, "separate"),
               ("eagle3@e3n-head", 3, head, "separate"), ("eagle3@e3n-head", 5, head, "separate")]
    tok_s = {0: [50, 60, 62], 1: [80, 100, 90], 2: [84, 101, 99], 3: [85, 99, 97]}
    runs = [[bench_result(10 * t, 10.0) for t in tok_s[i]] for i in range(len(servers))]
    row = spec.together_row(servers, runs, 2, 16, ARGS)
    assert row["vs_default_head_runs"] == [1.05, 1.01, 1.1] and row["vs_default_head"] == 1.05
    assert row["method"] == "eagle3@e3n-head" and row["k"] == 3
    assert "vs_default_head" not in spec.together_row(servers, runs, 1, 16, ARGS)
    assert "vs_default_head" not in spec.together_row(servers, runs, 3, 16, ARGS)  # (no default head at K = 5)
    assert "1.05x default head" in spec.markdown([spec.together_row(servers, runs, i, 16, ARGS) for i in range(3)])


def test_an_auto_servers_tier_changes_go_into_each_rows_record(spec, tmp_path):
    """``tier_changes``: the log's "speculative tiers changed" lines after those already in a row (each row the changes
    of its own concurrency), at most ``TIER_LINES_KEPT`` of the newest; a missing log gives none."""
    log = tmp_path / "server.log"
    change = "INFO speculative tiers changed (auto, measured acceptance 0.70/0.49): [[1, {k}]]\n"
    log.write_text("INFO ready\n" + change.format(k=3) + "INFO step\n" + change.format(k=1))
    lines, seen = spec.tier_changes(str(log), 0)
    assert seen == 2 and [line.endswith(f"[[1, {k}]]") for k, line in zip((3, 1), lines)] == [True, True]
    with open(log, "a", encoding="utf-8") as fh:
        fh.write("".join(change.format(k=k) for k in range(20)))
    lines, seen = spec.tier_changes(str(log), seen)
    assert seen == 22 and len(lines) == spec.TIER_LINES_KEPT and lines[-1].endswith("[[1, 19]]")
    assert spec.tier_changes(str(tmp_path / "none.log"), 5) == ([], 5)


def write(path, rows: list[dict], commit: str, model: str = "SmolLM2-135M-Instruct.Q4_1.gguf") -> str:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"command": f"bench_spec_gpu.py ({commit})", "commit": commit, "model": model, "output_len": 256,
                   "device": "cuda", "api_server_count": 4, "rows": rows, "servers": [{"policy": rows[0]["policy"]}],
                   "errors": []}, fh)
    return str(path)


def test_merge_joins_split_runs_and_a_rerun_replaces_its_cell(spec, tmp_path):
    a = write(tmp_path / "a.json", [row("separate", "none", 0, 1, 200.0), row("separate", "eagle3", 3, 1, 300.0)],
              "aaa")
    b = write(tmp_path / "b.json", [row("vllm-default", "none", 0, 1, 100.0),
                                    row("vllm-default", "eagle3", 3, 1, 150.0),
                                    row("separate", "eagle3", 3, 1, 400.0)], "bbb")
    merged = spec.merge([a, b], str(tmp_path / "all.json"))
    assert json.load(open(tmp_path / "all.json")) == merged
    assert [r["commit"] for r in merged["runs"]] == ["aaa", "bbb"]
    got = {spec.cell(r): r for r in merged["rows"]}
    assert len(got) == 4 and [r["policy"] for r in merged["rows"]] == ["separate"] * 2 + ["vllm-default"] * 2
    rerun = got["separate", "eagle3", 3, True, 1]
    assert rerun["output_tok_s"] == 400.0 and rerun["run"] == 1
    assert rerun["vs_no_sd"] == 2.0 and rerun["vs_no_sd_run"] == 0  # no SD measured in the other run only
    assert got["vllm-default", "eagle3", 3, True, 1]["vs_no_sd"] == 1.5 and "vs_no_sd_run" not in got[
        "vllm-default", "eagle3", 3, True, 1]
    assert [r["output_tok_s"] for r in merged["superseded_rows"]] == [300.0]
    assert [s["run"] for s in merged["servers"]] == [0, 1]
    other = write(tmp_path / "c.json", [row("separate", "none", 0, 1, 1.0)], "ccc", model="bench-moe")
    with pytest.raises(SystemExit, match="model"):
        spec.merge([a, other], None)


def test_merge_from_the_command_line_prints_the_table(tmp_path):
    a = write(tmp_path / "a.json", [row("separate", "none", 0, 1, 200.0), row("separate", "ngram", 3, 1, 260.0)],
              "aaa")
    out = tmp_path / "all.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "bench_spec_gpu.py"), "--merge", a, "--out",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| ngram:3 | 260 (1.30x, AL 2.00) |" in proc.stdout
    assert json.load(open(out))["rows"][1]["vs_no_sd"] == 1.3


def test_auto_tiers_methods_and_the_chosen_k(spec):
    """``eagle3:auto7`` is K up to 7 with auto tiers; the chosen K is read from the tier gauge whose range holds the
    concurrency (a retired tier reads -1)."""
    method, k, cfg = spec.parse_method("eagle3:auto7")
    assert (method, k, spec.label(method, k), spec.tiers_of(k)) == ("eagle3", -7, "eagle3:auto7", "auto")
    assert cfg == {"method": "eagle3", "num_speculative_tokens": 7, "num_speculative_tokens_per_batch_size": "auto"}
    assert spec.tiers_of(spec.parse_method("ngram:3")[1]) == 3
    with pytest.raises(ValueError, match="autoK"):
        spec.parse_method("eagle3:autox")
    metrics = ('twogrid:spec_decode_tier_k{max_batch="10",min_batch="1",model_name="m"} 7.0\n'
               'twogrid:spec_decode_tier_k{max_batch="99",min_batch="11",model_name="m"} -1.0\n'
               'twogrid:spec_decode_tier_k{max_batch="227",min_batch="11",model_name="m"} 3.0\n'
               'twogrid:spec_decode_tier_k{max_batch="1024",min_batch="228",model_name="m"} 0.0\n'
               'twogrid:fused_decode_steps_total{model_name="m"} 12.0\n')
    assert [spec.chosen_k(metrics, c) for c in (1, 64, 1024, 2000)] == [7, 3, 0, None]
    assert spec.fused_steps(metrics) == 12.0


def test_fixed_acceptance_at_one_rate_for_every_k(spec):
    """``--fixed-acceptance 3.0 --fixed-acceptance-of 7``: every server's drafter accepts at the rate that gives 3.0
    at K = 7; a K = 3 server gets that rate's mean length at 3, a K = 7 (or auto up to 7) server 3.0."""
    args = argparse.Namespace(fixed_acceptance=3.0, fixed_acceptance_of=7)
    rate = 0.6823  # 1 + sum of rate^j for j = 1..7 is 3.0
    assert spec.fixed_mean_length(args, 7) == pytest.approx(3.0, abs=1e-3)
    assert spec.fixed_mean_length(args, 3) == pytest.approx(1 + rate + rate**2 + rate**3, abs=0.01)
    assert spec.fixed_mean_length(argparse.Namespace(fixed_acceptance=3.0, fixed_acceptance_of=None), 3) == 3.0


def test_a_plus_s_suffix_names_a_server_with_more_steps_in_flight(spec):
    """``eagle3:3+s3``: the same speculative config, the server started with ``--steps-in-flight 3`` and named apart
    (its own row, file names and flags); a bad count is refused."""
    import argparse

    import pytest

    method, k, config = spec.parse_method("eagle3:3+s3")
    assert (method, k, config) == ("eagle3+s3", 3, {"method": "eagle3", "num_speculative_tokens": 3})
    assert spec.parse_method("none+s3")[:2] == ("none+s3", 0)
    args = argparse.Namespace(fixed_acceptance=None, no_fuse_decode_steps=False, step_trace_dir=None)
    stem = spec.file_stem("separate", method, k)
    assert spec.server_flags(args, config, k, stem, method) == ["--steps-in-flight", "3"]
    assert spec.server_flags(args, config, k, "separate-eagle3-k3", "eagle3") == []
    with pytest.raises(ValueError, match=r"\+sN takes a step count"):
        spec.parse_method("eagle3:3+sx")


def test_trace_by_kind_tells_the_gpu_busy_share_where_requests_are_admitted(monkeypatch):
    """Runs of consecutive steps that admit requests (mixed steps among them) against runs that do not: each side's
    GPU busy share is its device time over the wall time between its results."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    _busy_by_admission = importlib.import_module("trace_by_kind")._busy_by_admission

    quiet = [{"step": i, "kind": "uniform_decode", "device_ms": 5.0, "t_s": i * 0.005, "host_ms": 0.5}
             for i in range(30)]
    admitting = [{"step": 100 + i, "kind": "mixed" if i % 3 == 0 else "uniform_decode", "device_ms": 5.0,
                  "t_s": 1.0 + i * 0.010, "host_ms": 4.0 if i % 3 == 0 else 0.5} for i in range(30)]
    for i, s in enumerate(admitting[::3]):
        s["admitted"] = 10 + 2 * (i % 2)
    out = _busy_by_admission(quiet + admitting)
    assert out["quiet"] == {"steps": 30, "gpu_busy": 1.0}
    assert out["admitting"] == {"steps": 30, "gpu_busy": 0.5}
    assert out["mixed_schedule_ms_median"] == 4.0 and out["admitted_per_admitting_step"] == 11.0
    assert _busy_by_admission([{"step": 0, "kind": "mixed", "device_ms": 1.0}]) is None  # (no t_s: older traces)
