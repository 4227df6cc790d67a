"""benchmarks/bench_prefix_cache_gpu.py without a GPU: with ``--rounds`` each round draws fresh prompts (its own
seed, its own conversation tags, the same for both servers), and the summary's ratios are the medians of the
rounds' own on / off ratios, which decide the targets."""

from __future__ import annotations

import argparse
import importlib
import os

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture
def pc(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    return importlib.import_module("bench_prefix_cache_gpu")


def row(workload: str, caching: bool, rnd: int, tok_s: float, ttft: float, conc: int = 256) -> dict:
    return {"model": "bench-moe", "workload": workload, "concurrency": conc, "prefix_caching": caching, "round": rnd,
            "output_tok_s": tok_s, "ttft_ms_p50": ttft, "ttft_ms_p99": 2 * ttft,
            "prefix_cache_hit_rate": 0.5 if caching else None, "eager_steps": 0}


def test_rounds_draw_fresh_prompts_for_both_servers_alike(pc, texts, tmp_path):
    from textdata import SHAREGPT

    args = argparse.Namespace(data=SHAREGPT, min_prompts=4, turns=2, output_len=8, prefix_len=16, suffix_len=4,
                              random_len=16)
    seed = lambda cmd: cmd[cmd.index("--seed") + 1]  # noqa: E731
    a0 = pc.bench_command("prefix-repetition", 16, "http://a", args, str(tmp_path), 0)
    b0 = pc.bench_command("prefix-repetition", 16, "http://b", args, str(tmp_path), 0)
    a1 = pc.bench_command("prefix-repetition", 16, "http://a", args, str(tmp_path), 1)
    assert seed(a0) == seed(b0) != seed(a1)
    m0 = pc.bench_command("multi-turn", 16, "http://a", args, str(tmp_path), 0)
    m1 = pc.bench_command("multi-turn", 16, "http://a", args, str(tmp_path), 1)
    path = lambda cmd: cmd[cmd.index("--dataset-path") + 1]  # noqa: E731
    assert path(m0) != path(m1)
    with open(path(m0), encoding="utf-8") as f0, open(path(m1), encoding="utf-8") as f1:
        first0, first1 = f0.read(), f1.read()
    # (no prefix shared across rounds; every turn tagged, so that no turn's text is another's)
    assert "[c16 conversation 0 turn 0]" in first0 and "[c16r1 conversation 0 turn 0]" in first1


def test_the_summary_takes_the_median_of_the_rounds_ratios(pc):
    rows = [row("no-prefix", True, 0, 98.0, 10.0), row("no-prefix", False, 0, 100.0, 10.0),
            row("no-prefix", False, 1, 100.0, 10.0), row("no-prefix", True, 1, 90.0, 12.0),
            row("no-prefix", True, 2, 101.0, 9.0), row("no-prefix", False, 2, 100.0, 10.0),
            row("multi-turn", True, 0, 100.0, 50.0), row("multi-turn", False, 0, 100.0, 110.0)]
    summary = pc.summarize(rows)
    nop = next(p for p in summary["pairs"] if p["workload"] == "no-prefix")
    assert nop["rounds"] == 3 and nop["tok_s_on_over_off_rounds"] == [0.98, 0.9, 1.01]
    assert nop["tok_s_on_over_off"] == 0.98 and nop["ttft_p50_off_over_on"] == 1.0
    assert summary["no_prefix_at_most_2pct_slower"] is True and summary["no_prefix_worst_tok_s_ratio"] == 0.98
    assert summary["multi_turn_256_ttft_p50_at_least_2x"] is True  # (one round: 110 / 50)
    mt = next(p for p in summary["pairs"] if p["workload"] == "multi-turn")
    assert "rounds" not in mt and mt["ttft_p50_off_over_on"] == 2.2
    assert "ttft_p50_off_over_on_by_turn" not in mt  # (rows without turns)
    table = pc.markdown(rows)
    assert "caching on, round 1" in table and "caching off, round 2" in table


def test_the_summary_gives_each_turns_ttft_ratio(pc):
    """Multi-turn: each turn's TTFT p50 off / on, the median over rounds turn by turn (a turn a side lacks: None)."""
    def mt(caching, rnd, by_turn):
        return {**row("multi-turn", caching, rnd, 100.0, 50.0), "ttft_ms_p50_by_turn": by_turn}

    rows = [mt(True, 0, [40.0, 20.0, 10.0]), mt(False, 0, [40.0, 60.0, 50.0]),
            mt(True, 1, [50.0, 10.0, None]), mt(False, 1, [40.0, 50.0, 70.0]),
            mt(True, 2, [40.0, 25.0, 20.0]), mt(False, 2, [44.0, 50.0, 40.0])]
    (pair,) = pc.summarize(rows)["pairs"]
    assert pair["ttft_p50_off_over_on_by_turn"] == [1.0, 3.0, 3.5]  # medians of [1, .8, 1.1], [3, 5, 2], [5, 2]


def test_a_multi_turn_row_says_when_the_last_turn_outgrew_the_kv_pool(pc):
    """A pool smaller than what the last turn's requests hold together evicts the histories the next turns come back
    for (LRU over a cycle longer than the cache): the row, its log line and the summary say so, so that a low hit
    rate is read as the pool's, not the cache's."""
    run = {"output_throughput": 100.0, "p50_ttft_ms": 50.0, "p99_ttft_ms": 90.0, "mean_ttft_ms": 55.0,
           "mean_tpot_ms": 3.0, "completed": 8, "failed": 0, "total_input_tokens": 1000, "total_output_tokens": 64,
           "duration": 1.0, "prompt_tokens_by_turn": [100, 300], "prefix_cache_hit_rate_by_turn": [0.1, 0.05]}
    short = pc.make_row("bench-moe", "multi-turn", 4, True, run, 0, kv_pool_tokens=320, output_len=8,
                        conversations=4)
    assert short["last_turn_kv_tokens"] == 300 + 4 * (8 + 15) and short["prefix_cache_hit_rate_by_turn"] == [0.1, 0.05]
    assert "exceeds the pool (320)" in pc.pool_note(short)
    roomy = pc.make_row("bench-moe", "multi-turn", 4, True, run, 1, kv_pool_tokens=392, output_len=8,
                        conversations=4)
    assert pc.pool_note(roomy) == ""  # (exactly the pool: everything fits)
    # (8 conversations on 4 streams: half of them live at once, so half the last turn's prompts)
    half = pc.make_row("bench-moe", "multi-turn", 4, True, run, 0, kv_pool_tokens=320, output_len=8,
                       conversations=8)
    assert half["last_turn_kv_tokens"] == 150 + 4 * (8 + 15) and pc.pool_note(half) == ""
    single = pc.make_row("bench-moe", "no-prefix", 4, True, {k: v for k, v in run.items() if "by_turn" not in k}, 0,
                         kv_pool_tokens=10, output_len=8)
    assert single["last_turn_kv_tokens"] is None and pc.pool_note(single) == ""
    off = {**short, "prefix_caching": False, "prefix_cache_hit_rate": None}
    (pair,) = pc.summarize([{**short, "prefix_cache_hit_rate": 0.07}, off])["pairs"]
    assert pair["kv_pool_short_rounds"] == 1
    (pair,) = pc.summarize([{**roomy, "round": 0, "prefix_cache_hit_rate": 0.07}, off])["pairs"]
    assert "kv_pool_short_rounds" not in pair


def test_each_servers_kv_cache_defaults_to_a_third_of_the_gpu_at_most_48_gib(pc):
    """Two servers share the GPU: without --kv-gib each gets a third of its memory, so that the default fits an H100
    (80 GiB: ~26 each) as it fits an H200 (48, the runs' size); without a GPU, 48 (a CPU dry run gives its own)."""
    assert pc.default_kv_gib("cuda", total_bytes=80 * 2**30) == 26.7
    assert pc.default_kv_gib("cuda", total_bytes=141 * 2**30) == 47.0
    assert pc.default_kv_gib("cuda", total_bytes=192 * 2**30) == 48.0
    assert pc.default_kv_gib("cpu") == 48.0
