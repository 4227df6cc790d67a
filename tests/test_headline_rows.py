"""The headline benchmark's rows from several runs of one server (``--interleave`` rounds, ``--alternate``
batches): throughput is all tokens over all the runs' time, the server's counters add up, and the paired ratio
compares batch with batch."""

from __future__ import annotations

import argparse
import importlib
import os

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture
def headline(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    return importlib.import_module("bench_headline_gpu")


def bench_result(tokens: int, duration: float, device_s: float, eager: int = 0) -> dict:
    """The fields of a ``twogrid bench`` result that a headline row reads."""
    return {"total_output_tokens": tokens, "duration": duration, "output_throughput": tokens / duration,
            "mean_tpot_ms": 1000 * duration / tokens, "p99_tpot_ms": 2000 * duration / tokens,
            "mean_ttft_ms": 10.0, "eager_steps": eager, "padded_tokens": 5, "cudagraph_steps": 100,
            "step_device_seconds": device_s, "completed": 4, "failed": 0}


def test_rounds_give_tokens_over_time_and_summed_counters(headline):
    args = argparse.Namespace(model="bench-moe", waves=1)
    fast, slow = bench_result(1000, 1.0, 0.9, eager=2), bench_result(1000, 4.0, 3.8, eager=1)
    fast["cudagraph_steps_by_kind_mode"] = {"mixed": {"PIECEWISE": 3, "NONE": 1}, "uniform_decode": {"FULL": 96}}
    row = headline.make_row("separate", "eagle3-k7", "fixed-3.0", 16, [fast, slow, fast], args)
    assert row["mixed_steps"] == 8  # (the arrivals' steps, every mode: the rounds that report them)
    assert row["output_tok_s"] == pytest.approx(3000 / 6.0, abs=0.1)  # not the median round's 1000 tok/s
    assert row["round_tok_s"] == [1000.0, 250.0, 1000.0] and row["rounds"] == 3
    assert (row["eager_steps"], row["padded_tokens"], row["steps"], row["completed"]) == (5, 15, 300, 12)
    assert row["gpu_busy"] == pytest.approx(5.6 / 6.0, abs=1e-3)
    assert row["tpot_ms_mean"] == pytest.approx(1.0)  # the rounds' median


def test_one_run_is_that_run(headline):
    args = argparse.Namespace(model="/models/x.gguf", waves=2)
    bench = bench_result(1000, 2.0, 1.5, eager=3)
    bench["failed"] = 1
    row = headline.make_row("separate", "no-sd", "real", 64, [bench], args)
    assert row["output_tok_s"] == bench["output_throughput"] == 500.0
    assert "rounds" not in row and row["model"] == "x.gguf"
    assert (row["completed"], row["failed"], row["num_prompts"], row["eager_steps"]) == (4, 1, 5, 3)


def test_paired_ratio_compares_each_batch_with_the_same_batch(headline):
    rows = [{"policy": "vllm-default", "workload": "eagle3-k7", "concurrency": 1, "device_s": 4.0,
             "output_tok_s": 100.0, "slot_seconds": [1.0, 2.0, 1.0]},
            {"policy": "separate", "workload": "eagle3-k7", "concurrency": 1, "device_s": 5.0,
             "output_tok_s": 80.0, "slot_seconds": [0.5, 4.0, 0.8]},
            {"policy": "sglang", "workload": "eagle3-k7", "concurrency": 1, "device_s": 4.0,
             "output_tok_s": 100.0, "slot_seconds": [1.0, 1.0]}]
    headline.add_ratios(rows)
    separate = rows[1]
    assert separate["bound_ratio"] == 0.8 and separate["tok_s_ratio"] == 0.8
    assert separate["paired_ratio_median"] == 1.25  # vllm-default's time over ours, batch by batch: 2.0, 0.5, 1.25
    assert rows[0]["paired_ratio_median"] == 1.0
    assert "paired_ratio_median" not in rows[2]  # batches that do not pair up are not compared


def test_the_served_benchmarks_pass_their_stream_interval_to_every_server(headline):
    """bench_spec_gpu / bench_prefix_cache_gpu --stream-interval N reaches each server's command line (1, serve's
    default, adds nothing: the commands of runs made before the flag stay comparable)."""
    args = argparse.Namespace(model="bench-moe", max_model_len=2048, device="cuda", api_server_count=4,
                              tokenizer=None, stream_interval=4)
    cmd = headline.serve_command("separate", None, 8100, args)
    assert cmd[cmd.index("--stream-interval") + 1] == "4"
    args.stream_interval = 1
    assert "--stream-interval" not in headline.serve_command("separate", None, 8100, args)
    del args.stream_interval  # (the benchmarks without the option)
    assert "--stream-interval" not in headline.serve_command("separate", None, 8100, args)


def test_the_quantization_benchmark_compares_settings_round_by_round(monkeypatch):
    """bench_quant_gpu's speed-up is the median of round-by-round ratios to bf16 (a round's host load is shared by
    the settings run in it), not a ratio of medians; bf16 has none."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    quant = importlib.import_module("bench_quant_gpu")
    out = quant.paired_summary({"bf16": [100.0, 80.0, 120.0], "fp8-weights": [110.0, 84.0, 120.0]})
    assert out["bf16"] == {"median": 100.0, "runs": [100.0, 80.0, 120.0]}
    assert out["fp8-weights"]["median"] == 110.0
    assert out["fp8-weights"]["speedups"] == [1.1, 1.05, 1.0] and out["fp8-weights"]["speedup"] == 1.05
