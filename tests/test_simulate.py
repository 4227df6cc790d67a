"""``twogrid simulate`` as a user runs it: the reference's decode coverage claims on the real scheduler and
dispatcher, the JSON summary and the step trace."""

import json

import pytest

from dispatcher.cli import main
from dispatcher.plan.config import ConfigError, resolve
from dispatcher.engine.simulate import ClosedLoop, drafter_ms, simulate
from dispatcher.engine.trace import read_trace
from dispatcher.engine.workload import load_sharegpt, make_prompts
from textdata import SHAREGPT

K7 = {"method": "eagle3", "num_speculative_tokens": 7}


def run_k7(compilation, tmp_path):
    cfg = resolve(compilation, K7, platform="sm100", max_num_seqs=1024, max_num_batched_tokens=16384)
    trace = tmp_path / "trace.jsonl"
    result = simulate(cfg, make_prompts(512, seed=1), concurrency=256, output_len=128, step_trace=str(trace))
    return result.summary, read_trace(str(trace))


def test_sm100_defaults_have_no_eager_decode_at_256(tmp_path):
    summary, trace = run_k7({}, tmp_path)
    decode = summary["by_kind"]["uniform_decode"]
    assert decode["steps"] > 50 and decode["eager"] == 0 and decode["full"] == decode["steps"]
    assert max(r["requests"] for r in trace if r["kind"] == "uniform_decode") == 256
    assert all(r["q"] == 8 for r in trace if r["kind"] == "uniform_decode")


def test_legacy_list_runs_decode_above_128_requests_eagerly(tmp_path):
    summary, trace = run_k7({"max_cudagraph_capture_size": 1024}, tmp_path)
    decode = [r for r in trace if r["kind"] == "uniform_decode"]
    above = [r for r in decode if r["requests"] > 128]
    below = [r for r in decode if r["requests"] <= 128]
    assert above and all(r["mode"] == "NONE" for r in above)
    assert all(r["mode"] == "FULL" for r in below)
    assert summary["by_kind"]["uniform_decode"]["eager"] == len(above)


def test_trace_records_have_the_spec_fields(tmp_path):
    _, trace = run_k7({}, tmp_path)
    fields = {"step", "kind", "requests", "tokens", "mode", "padded_tokens", "padded_requests", "host_ms", "device_ms",
              "t_s"}
    for rec in trace:
        assert fields <= set(rec)
        assert ("q" in rec) != ("query_len_hist" in rec)
        assert rec["padded_tokens"] >= rec["tokens"] if rec["mode"] != "NONE" else rec["padded_tokens"] == rec["tokens"]
    assert [r["step"] for r in trace] == list(range(1, len(trace) + 1))
    times = [r["t_s"] for r in trace]  # a timeline: gaps between steps are visible
    assert times == sorted(times) and times[0] >= 0


def test_simulate_json_summary(capsys):
    rc = main(["simulate", "--platform", "sm100", "--num-prompts", "64", "--concurrency", "16", "--output-len", "32",
               "--speculative-config",
               '{"method": "dspark", "num_speculative_tokens": 5, "adaptive_verification": true}',
               "--json"])
    assert rc == 0
    s = json.loads(capsys.readouterr().out)
    assert {"steps", "eager_steps", "padded_tokens", "real_tokens", "by_kind"} <= set(s)
    assert set(s["by_kind"]) == {"uniform_decode", "mixed", "adaptive_verification"}
    for v in s["by_kind"].values():
        assert set(v) == {"steps", "full", "piecewise", "eager"}
        assert v["steps"] == v["full"] + v["piecewise"] + v["eager"]
    assert s["by_kind"]["adaptive_verification"]["full"] > 0
    assert s["requests"] == 64 and s["output_tokens"] == 64 * 32
    by_kind = s["device_ms_by_kind"]  # (every step's device time, the drafter's included, by its kind)
    assert set(by_kind) == set(s["by_kind"]) and by_kind["uniform_decode"] > 0 and by_kind["mixed"] > 0
    total = sum(s["device_ms_by_mode"].values()) + s["draft_device_ms"]
    assert abs(sum(by_kind.values()) - total) < 0.5


def test_simulate_rejects_bad_flags(capsys):
    assert main(["simulate", "--concurrency", "0"]) == 2
    assert "--concurrency must be >= 1, got 0" in capsys.readouterr().err
    assert main(["simulate", "--dataset", "/nonexistent.json"]) == 2
    assert "--dataset: cannot read '/nonexistent.json'" in capsys.readouterr().err


def test_preemption_in_simulate_loses_no_request():
    cfg = resolve({}, K7, platform="sm100", max_num_seqs=64, max_num_batched_tokens=2048)
    result = simulate(cfg, make_prompts(128, seed=3), concurrency=64, output_len=64, num_kv_blocks=900,
                      keep_outputs=True)
    s = result.summary
    assert s["preemptions"] > 0
    assert s["requests"] == 128 and s["output_tokens"] == 128 * 64
    assert all(len(tokens) == 64 for tokens in result.outputs.values())


def test_sharegpt_workload():
    prompts = load_sharegpt(SHAREGPT)
    assert len(prompts) == 500
    specs = make_prompts(600, seed=0, dataset=SHAREGPT)
    assert len(specs) == 600 and all(s.num_tokens >= 1 for s in specs)


def test_a_sharegpt_prompt_is_the_first_human_turn_as_twogrid_bench_reads_it(tmp_path):
    """simulate took each conversation's first turn whatever its role (an assistant's text as the prompt); it reads
    the first human (or user) turn, as twogrid bench does, and refuses a file with none, naming it."""
    import json

    from dispatcher.plan.config import ConfigError

    data = tmp_path / "sg.json"
    data.write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "I am the assistant"},
                                                   {"from": "human", "value": "the question"}]},
                                {"conversations": [{"from": "user", "value": "another"}]}]))
    assert load_sharegpt(str(data)) == ["the question", "another"]
    data.write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "hi"}]}]))
    with pytest.raises(ConfigError, match="no conversation with a non-empty human turn"):
        load_sharegpt(str(data))


def test_model_drafters_are_charged_and_traced(tmp_path):
    trace = tmp_path / "t.jsonl"
    prompts = make_prompts(64, seed=4)
    eagle = resolve({}, K7, platform="sm100", max_num_seqs=256, max_num_batched_tokens=4096)
    s = simulate(eagle, prompts, concurrency=32, output_len=32, step_trace=str(trace)).summary
    assert s["draft_device_ms"] > 0
    decode = [r for r in read_trace(str(trace)) if r["kind"] == "uniform_decode"]
    assert decode and all([d["graph"][0] for d in r["draft"]] == ["full_decode", "full_decode"] for r in decode)
    ngram = resolve({}, {"method": "ngram", "num_speculative_tokens": 7}, platform="sm100", max_num_seqs=256,
                    max_num_batched_tokens=4096)
    assert simulate(ngram, prompts, concurrency=32, output_len=32).summary["draft_device_ms"] == 0


def test_a_draft_model_runs_on_its_graphs_and_is_charged_its_layers_k_times(tmp_path):
    """draft_model: the catch-up forward on the target's decode graph, K one-token forwards on its own FULL q = 1
    graphs (EAGLE runs K - 1), each at the draft LM's layers' share of the cost model's stack (tiny-dense: 2)."""
    from dispatcher.engine.cost import StepCostModel
    from dispatcher.plan.dispatch import MODE_FULL, UNIFORM_DECODE, BatchDescriptor, StepDescriptors

    trace = tmp_path / "t.jsonl"
    spec = {"method": "draft_model", "model": "tiny-dense", "num_speculative_tokens": 3}
    cfg = resolve({}, spec, platform="sm100", max_num_seqs=256, max_num_batched_tokens=4096)
    s = simulate(cfg, make_prompts(64, seed=4), concurrency=32, output_len=32, step_trace=str(trace)).summary
    assert s["draft_device_ms"] > 0
    decode = [r for r in read_trace(str(trace)) if r["kind"] == "uniform_decode"]
    assert decode and all([d["graph"][:2] for d in r["draft"]] == [["full_decode", 4], ["full_decode", 1]]
                          for r in decode)
    costs = StepCostModel.preset("bench-moe")
    one = BatchDescriptor(MODE_FULL, UNIFORM_DECODE, 8, 8, 1, ("full_decode", 1, 8))
    descs = StepDescriptors(one, one, one)
    layer = costs.step_ms(MODE_FULL, 8) / costs.num_layers
    assert drafter_ms(costs, descs, 3, "eagle3") == pytest.approx(3 * layer)  # step 0, then 2 one-token steps
    assert drafter_ms(costs, descs, 3, "draft_model", 2) == pytest.approx(2 * 4 * layer)  # catch-up, then 3


AUTO7 = {"method": "eagle3", "num_speculative_tokens": 7, "num_speculative_tokens_per_batch_size": "auto",
         "auto_tier_candidates": [0, 1, 3, 7]}


def test_auto_tiers_in_simulate_learn_the_acceptance_and_report_k_per_step(tmp_path):
    """The drafter's true acceptance is far above the prior: the re-choice moves the tiers towards more drafting; the
    summary says the tiers, their changes and the steps at each K, and every trace record its k (the K of its
    tier at its batch size), which is also what the step's uniform decode verifies once the drafts exist."""
    cfg = resolve({}, AUTO7, platform="sm100", max_num_seqs=1024, max_num_batched_tokens=16384)
    trace = tmp_path / "trace.jsonl"
    s = simulate(cfg, make_prompts(512, seed=1), concurrency=256, output_len=128, step_trace=str(trace),
                 acceptance=(0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65), keep_outputs=True).summary
    a = s["auto_tiers"]
    assert a["initial"] == [[1, 3], [153, 1]]  # the bench-moe curves and the 0.6 prior, near ties to the larger K
    assert a["changes"] and a["final"] != a["initial"]
    k_at_256 = {tuple(t) for t in a["final"]}
    assert max(k for lo, k in k_at_256 if lo <= 256) >= 1  # drafting pays at 256 requests at this acceptance
    records = read_trace(str(trace))
    assert sum(a["steps_by_k"].values()) == len(records) == s["steps"]
    assert {str(k) for k in {r["k"] for r in records}} == set(a["steps_by_k"])
    assert a["measured_acceptance"][0] == pytest.approx(0.95, abs=0.03)
    # the same run again: the same tiers, the same steps
    again = simulate(cfg, make_prompts(512, seed=1), concurrency=256, output_len=128,
                     acceptance=(0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65)).summary
    assert again["auto_tiers"] == a and again["steps"] == s["steps"]


def test_auto_tiers_at_no_acceptance_stop_drafting_and_beat_a_fixed_k(capsys):
    args = ["simulate", "--platform", "sm100", "--num-prompts", "256", "--concurrency", "128", "--output-len", "64",
            "--acceptance", "0.02"]
    assert main([*args, "--speculative-config", json.dumps(AUTO7), "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["auto_tiers"]["final"] == [[1, 0]]
    assert main([*args, "--speculative-config", json.dumps({"method": "eagle3", "num_speculative_tokens": 7}),
                 "--json"]) == 0
    fixed = json.loads(capsys.readouterr().out)
    assert auto["output_tokens_per_second"] > fixed["output_tokens_per_second"]
    assert main([*args, "--speculative-config", json.dumps(AUTO7)]) == 0
    out = capsys.readouterr().out
    assert "auto tiers: [[1, 3], [153, 1]] at start" in out and "steps by K (the tier's K" in out
    assert main(["simulate", "--acceptance", "0.5"]) == 2
    assert "--acceptance needs a speculative method" in capsys.readouterr().err


def test_simulate_admission_wait_batches_arrivals_into_fewer_mixed_steps(capsys):
    """``--admission-wait-steps``: under speculation (staggered finishes) the arrivals start in fewer mixed steps, every
    request still served in full; a negative count is refused naming the flag."""
    spec = '{"method": "eagle3", "num_speculative_tokens": 3}'
    mixed = []
    for wait in ("0", "6"):
        assert main(["simulate", "--platform", "sm100", "--num-prompts", "96", "--concurrency", "16", "--output-len",
                     "48", "--speculative-config", spec, "--admission-wait-steps", wait, "--json"]) == 0
        s = json.loads(capsys.readouterr().out)
        assert s["requests"] == 96 and s["output_tokens"] == 96 * 48
        mixed.append(s["by_kind"]["mixed"]["steps"])
    assert mixed[1] < mixed[0] * 0.7, mixed
    assert main(["simulate", "--admission-wait-steps", "-1"]) == 2
    assert "--admission-wait-steps must be a step count >= 0, got -1" in capsys.readouterr().err


def test_simulate_paces_the_default_admission_wait_as_the_engine_does(capsys):
    """Under speculative decoding with no ``--admission-wait-steps``, arrivals are held as the engine holds them: up
    to 4 steps, and no more than 25 ms of its decode steps (bench-moe at 512 streams: ~14 ms steps, one step); a wait
    given stays as given; without drafting none; the text names the changes."""
    spec = '{"method": "eagle3", "num_speculative_tokens": 3}'
    base = ["simulate", "--platform", "sm100", "--concurrency", "512", "--num-prompts", "512", "--output-len", "48"]
    waits = []
    for extra in (["--speculative-config", spec], ["--speculative-config", spec, "--admission-wait-steps", "3"], []):
        assert main(base + extra + ["--json"]) == 0
        s = json.loads(capsys.readouterr().out)
        waits.append((s["admission_wait_steps"], [c["steps"] for c in s["admission_wait_changes"]]))
        if s["admission_wait_changes"]:
            assert 12.5 < s["admission_wait_changes"][-1]["pace_ms"] < 25.0  # (25 ms: one step of it)
    assert waits == [(1, [1]), (3, []), (0, [])]
    assert main(base + ["--speculative-config", spec]) == 0
    assert "arrivals held up to 1 steps while the batch decodes at the end (the default's pace: 4 at start, 1 after" \
        in capsys.readouterr().out


def test_simulate_priced_by_step_traces_adds_nothing_for_the_drafter(tmp_path, capsys):
    """``--cost-table TRACE.jsonl``: each step is priced at the traces' median device time of its mode and padded size
    (a real run's times hold the drafter's forwards: no drafter share is added), and the summary names the traces."""
    trace = tmp_path / "t.jsonl"
    lines = [{"mode": "FULL", "padded_tokens": n, "device_ms": 1.0 + n / 100} for n in (4, 8, 16, 32, 64)]
    lines += [{"mode": "PIECEWISE", "padded_tokens": n, "device_ms": 5.0 + n / 100} for n in (64, 512, 2048, 8192)]
    lines += [{"mode": "NONE", "padded_tokens": n, "device_ms": 20.0} for n in (1, 16384)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in lines))
    spec = '{"method": "eagle3", "num_speculative_tokens": 3}'
    base = ["simulate", "--platform", "sm100", "--num-prompts", "32", "--concurrency", "8", "--output-len", "16",
            "--speculative-config", spec, "--json"]
    assert main(base + ["--cost-table", str(trace)]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["draft_device_ms"] == 0.0 and s["cost_model"] == f"step traces {trace}"
    decode = s["by_kind"]["uniform_decode"]
    assert decode["full"] > 0 and s["device_ms_by_mode"]["FULL"] >= decode["full"] * 1.04  # (at least 4 tokens)
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out)["draft_device_ms"] > 0  # (a preset charges the head's forwards)
    assert main(base + ["--cost-table", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    # flags that were ignored at exit 0 (the CLI probe): refused, naming both
    assert main(base + ["--cost-table", str(trace), "--cost-model", "bench-moe-large"]) == 2  # (as replay)
    assert "--cost-model 'bench-moe-large' picks a model of a runtime benchmark's JSON" in capsys.readouterr().err
    assert main(["simulate", "--num-prompts", "4", "--acceptance-rate", "0.3"]) == 2  # (no drafter: it was ignored)
    assert "--acceptance-rate needs a speculative method" in capsys.readouterr().err
    assert main(base + ["--dataset-name", "random", "--dataset", str(trace)]) == 2
    assert "--dataset (a ShareGPT file) is for --dataset-name sharegpt, not random" in capsys.readouterr().err
    assert main(base + ["--prefix-repetition-num-prefixes", "3"]) == 2
    assert "--prefix-repetition-num-prefixes is for --dataset-name prefix_repetition" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--decode-overhead-us", "--decode-overhead-per-token-us"],
                         ids=["per-request", "per-token"])
def test_served_decode_overhead_prices_each_uniform_decode_and_auto_tiers_weigh_it(tmp_path, flag):
    """``--decode-overhead-us X``: each uniform decode step costs X us a request more than the cost model (what
    serving adds to empty-context replays); ``--decode-overhead-per-token-us X``: X us a query token (requests
    times q: the part that grows with the rows verified). ``"auto"`` tiers are fed those served costs as the
    engine's are (``AutoTiers.observe_step``): on the bench-moe curves with 4 us (a request: about 1 ms a step at
    256 requests, the default model's on the H200) and a head accepting 0.7 / 0.48 / 0.34 / 0.24 / 0.17, auto up to
    K = 5 gives at least 0.97x the best of no SD and fixed K = 1, 3, 5 at 64 streams (issue 29's bound, on the
    CPU's model of the step; 1.00x either way, and per request 0.99-1.03x at 16-1024 streams with 4-8 us and 25%
    noise a step in a trial run: the served runs' shortfall is not in this model), a K that drafts less than the
    one served weighed with that K's overhead in proportion to its rows (``MeasuredCosts.by_batch``)."""
    acceptance = (0.7, 0.48, 0.34, 0.24, 0.17)
    prompts = make_prompts(192, seed=3)
    per_token = flag == "--decode-overhead-per-token-us"

    def run(spec, overhead, trace=None):
        k = 0 if spec is None else spec["num_speculative_tokens"]
        cfg = resolve({}, spec, platform="sm100", max_num_seqs=64, max_num_batched_tokens=8192)
        priced = {"decode_overhead_per_token_us" if per_token else "decode_overhead_us": overhead}
        return simulate(cfg, prompts, concurrency=64, output_len=128, acceptance=acceptance[:k] or None,
                        step_trace=trace, **priced).summary

    k3 = {"method": "eagle3", "num_speculative_tokens": 3}
    trace = tmp_path / "t.jsonl"
    plain, served = run(k3, 0.0), run(k3, 4.0, str(trace))
    decodes = [r for r in read_trace(str(trace)) if r["kind"] == "uniform_decode"]
    priced_units = sum(r["requests"] * (r["q"] if per_token else 1) for r in decodes)
    added = served["device_ms_by_kind"]["uniform_decode"] - plain["device_ms_by_kind"]["uniform_decode"]
    assert added == pytest.approx(4e-3 * priced_units, abs=0.1)  # (the summary rounds to 0.1 ms)
    assert served["steps"] == plain["steps"]
    fixed = [run(spec, 4.0)["output_tokens_per_second"] for spec in
             (None, {"method": "eagle3", "num_speculative_tokens": 1}, k3,
              {"method": "eagle3", "num_speculative_tokens": 5})]
    auto = run({"method": "eagle3", "num_speculative_tokens": 5, "num_speculative_tokens_per_batch_size": "auto"}, 4.0)
    assert auto["output_tokens_per_second"] >= 0.97 * max(fixed), (auto["output_tokens_per_second"], fixed)
    with pytest.raises(ConfigError, match=f"{flag} must be a number >= 0, got nan"):
        run(k3, float("nan"))


class Recorder:
    """A scheduler stand-in for ``ClosedLoop``: the requests it was given, in order."""

    def __init__(self):
        self.added = []

    def add_request(self, request):
        self.added.append(request)


def test_a_conversations_next_turn_carries_the_conversation_so_far_and_starts_when_the_turn_before_ends():
    """``ClosedLoop`` with three conversations of two turns, two in flight: the first turns of two conversations go
    out; when one ends its next turn goes out at once, its prompt the turn's prompt, the answer, then its own new
    tokens; a conversation starts only when another one ends, and the requests are numbered in order."""
    prompts = make_prompts(6, seed=2)
    loop = ClosedLoop(prompts, turns=2, concurrency=2, output_len=3, ignore_eos=True, vocab_size=500)
    sched = Recorder()
    assert loop.send(sched) == ["req-0", "req-1"] and loop.pending()
    first = sched.added[0].prompt_token_ids
    assert len(first) == prompts[0].num_tokens and loop.send(sched) == []
    loop.output("req-0", [7, 8], finished=False)
    loop.output("req-0", [9], finished=True)
    assert loop.send(sched) == ["req-2"]
    second = sched.added[2].prompt_token_ids
    assert second[:len(first) + 3] == first + [7, 8, 9] and len(second) == len(first) + 3 + prompts[1].num_tokens
    loop.output("req-2", [1, 2, 3], finished=True)  # (conversation 0 is done: conversation 2 starts)
    assert loop.send(sched) == ["req-3"]
    assert sched.added[3].prompt_token_ids[:5] != second[:5]
    assert loop.longest() == max(prompts[2 * i].num_tokens + prompts[2 * i + 1].num_tokens for i in range(3)) + 6


def test_multi_turn_conversations_find_their_history_in_the_prefix_cache(capsys):
    """``simulate --multi-turn 4``: 64 conversations of four turns at 64 streams, every turn answered; with caching
    on, the later turns find the conversation so far (70% of the prompt tokens hit) and the time to first token
    falls at least 1.5x against caching off (2.15x: one 16,384-token mixed step of bench-moe's H200 costs against
    two; at the H200 benchmark's shape, 256 streams of four ShareGPT turns and 128 output tokens, it gives 2.0x,
    where the served runs gave 0.9-1.1x: docs/reference.md)."""
    base = ["simulate", "--platform", "sm100", "--multi-turn", "4", "--num-prompts", "64", "--concurrency", "64",
            "--output-len", "256", "--json"]
    runs = []
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        assert main(base + [flag]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    on, off = runs
    assert on["requests"] == off["requests"] == 256 and on["turns"] == 4 and on["output_tokens"] == 256 * 256
    assert on["prefix_cache_hit_rate"] > 0.6 and off["prefix_cache_queries"] == 0
    assert off["p50_ttft_ms"] > 1.5 * on["p50_ttft_ms"], (off["p50_ttft_ms"], on["p50_ttft_ms"])
    assert main(base[:-1] + ["--multi-turn", "0"]) == 2
    assert "--multi-turn must be >= 1, got 0" in capsys.readouterr().err
    assert main(base[:-1]) == 0
    assert "256 requests (64 conversations of 4 turns)" in capsys.readouterr().out


def test_multi_turn_simulation_shows_each_turns_hits_and_a_pool_too_small_for_the_histories(capsys):
    """``simulate --multi-turn``: each turn's TTFT p50 and prefix-cache hit share; with ``--num-kv-blocks`` too few
    for every conversation's history at once, the last turn finds its history evicted (LRU: each admission evicts
    what the conversations after it come back for), as bench-moe's fourth turn did on an H100 with 8 GiB of KV
    (0.79 -> 0.09); with room for them it finds it as the turn before did."""
    base = ["simulate", "--platform", "sm100", "--multi-turn", "4", "--num-prompts", "64", "--concurrency", "64",
            "--output-len", "128", "--max-num-batched-tokens", "4096", "--json", "--num-kv-blocks"]
    runs = {}
    for blocks in (4000, 8000):  # (the fourth turn's 64 requests hold ~5,700 blocks at once, the third's ~4,300)
        assert main(base + [str(blocks)]) == 0
        runs[blocks] = json.loads(capsys.readouterr().out)
    short, roomy = runs[4000]["prefix_cache_hit_rate_by_turn"], runs[8000]["prefix_cache_hit_rate_by_turn"]
    assert len(short) == len(roomy) == len(runs[8000]["p50_ttft_ms_by_turn"]) == 4
    assert roomy[0] == 0.0 and roomy[3] >= roomy[2] > 0.6  # (a first turn has no history; each later one more)
    assert short[2] > 0.6 and short[3] < 0.2, (short, roomy)  # (the third turn's history found, the fourth's gone)
    assert runs[4000]["p50_ttft_ms_by_turn"][3] > 3 * runs[8000]["p50_ttft_ms_by_turn"][3]
    assert main(base[:-2] + ["--num-kv-blocks", "8000"]) == 0
    assert "by turn: TTFT p50" in capsys.readouterr().out


def test_a_synthetic_mean_the_clip_would_bend_is_refused():
    """--input-len 5000 gave a mean of about 3,100 (the lengths are clipped at 4,096) and 10^8 ran at exit 0 (the
    CLI probe): refused above 1,024, naming the flag and what gives longer prompts; up to it the mean holds."""
    from dispatcher.engine.workload import SYNTHETIC_MEAN_MAX

    with pytest.raises(ConfigError, match=r"--input-len must be in 1\.\.1024 .* got 5000; longer prompts"):
        make_prompts(8, seed=0, input_len_mean=5000)
    lens = [p.num_tokens for p in make_prompts(4000, seed=0, input_len_mean=SYNTHETIC_MEAN_MAX)]
    assert 0.9 * SYNTHETIC_MEAN_MAX < sum(lens) / len(lens) < 1.1 * SYNTHETIC_MEAN_MAX
