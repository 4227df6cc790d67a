"""Regression tests for the scheduler and engine defects of issue 9, one (or more) per defect, on the CPU."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dispatcher.cli import main as cli_main  # noqa: E402
from dispatcher.engine.config import scheduler_config  # noqa: E402
from dispatcher.engine.engine_core import EngineArgs, EngineCore  # noqa: E402
from dispatcher.engine.simulate import FakeModel, simulate  # noqa: E402
from dispatcher.engine.trace import read_trace  # noqa: E402
from dispatcher.engine.workload import PromptSpec  # noqa: E402
from dispatcher.plan.capture_plan import build_plan  # noqa: E402
from dispatcher.plan.config import ConfigError, resolve  # noqa: E402
from dispatcher.plan.dispatch import MODE_FULL, UNIFORM_DECODE, dispatchers_for_plan  # noqa: E402
from models.config import preset  # noqa: E402
from scheduler.kv_blocks import KVBlockManager  # noqa: E402
from scheduler.request import Request, RequestError, SamplingParams  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402

BLOCK = 8


def engine(spec=None, cc=None, max_num_seqs=8, budget=32, num_blocks=200, **kw) -> EngineCore:
    cfg = resolve(cc or {}, spec, platform="sm100", max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=num_blocks, block_size=BLOCK,
                                      max_model_len=128, **kw))


def prompts(n, seed=0, lo=4, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


# 1 -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, prompt_len", [(None, 32), ({"method": "ngram", "num_speculative_tokens": 3}, 29)])
def test_a_one_token_prompt_tail_is_a_prefill_not_a_decode(spec, prompt_len):
    """Beside a decoding request of q tokens, a prompt of budget - q + 1 tokens ends with a one-token chunk: a
    prefill (the request has sampled nothing), so the step is not a decode and the worker never reads an output
    token it does not have."""
    e = engine(spec)
    decoding = e.add_request([5, 6, 7] * 3, SamplingParams(max_tokens=20, ignore_eos=True))
    first = e.step()  # the first request decodes from here on (ngram: 1 + 3 tokens a step)
    tail = e.add_request(prompts(1, 2, prompt_len, prompt_len)[0], GREEDY)
    tail_steps, outputs = 0, {decoding: first[0].new_token_ids, tail: []}
    while e.has_unfinished():
        step = e.schedule()
        for req, n in zip(step.out.requests, step.out.num_scheduled.tolist()):
            if req.request_id == tail and n == 1 and not req.output_token_ids:  # the prompt's one-token tail
                tail_steps += 1
                assert not step.out.shape.is_decode
        for o in e.update(step, e.execute(step)):
            outputs[o.request_id] += o.new_token_ids
    assert tail_steps == 1
    assert len(outputs[tail]) == 8 and len(outputs[decoding]) == 20


def test_budget_plus_one_prompt_alone_generates_like_eager():
    p = prompts(1, 3, 33, 33)
    assert engine().generate(p, GREEDY) == engine(cc={"cudagraph_mode": "NONE"}).generate(p, GREEDY)


# 2 -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [2, 6], ids=["would-finish", "would-go-on"])
def test_abort_between_schedule_and_update_is_safe(max_tokens):
    """Aborted while its step runs: the step's result for it is dropped (no KeyError when it would have finished,
    no tokens, no output, no counters advanced), its blocks are free, the other request goes on."""
    e = engine()
    a = e.add_request(prompts(1, 4, 10, 10)[0], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    b = e.add_request(prompts(1, 5, 10, 10)[0], SamplingParams(max_tokens=6, ignore_eos=True))
    e.step()
    step = e.schedule()
    result = e.execute(step)
    req_a = e.scheduler.requests[a]
    tokens_before = list(req_a.output_token_ids)
    assert e.abort(a)
    outputs = e.update(step, result)
    assert [o.request_id for o in outputs] == [b]
    assert req_a.output_token_ids == tokens_before and req_a.finish_reason.value == "abort"
    while e.has_unfinished():
        e.step()
    assert e.scheduler.kv.num_free == e.scheduler.config.num_kv_blocks
    assert e.scheduler.stats.finished == 1 and e.scheduler.stats.aborted == 1


def test_abort_after_schedule_before_execute_is_safe():
    e = engine({"method": "eagle3", "num_speculative_tokens": 2})
    ids = [e.add_request(p, GREEDY) for p in prompts(3, 6)]
    e.step()
    step = e.schedule()
    e.abort(ids[1])
    outputs = e.update(step, e.execute(step))
    assert ids[1] not in {o.request_id for o in outputs}
    while e.has_unfinished():
        e.step()
    assert e.scheduler.kv.num_free == e.scheduler.config.num_kv_blocks


# 3 -------------------------------------------------------------------------------------------------------------
def test_a_seeded_request_samples_alike_alone_beside_others_and_twice_in_a_batch():
    p = prompts(2, 7)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine().generate([p[0]], seeded)[0]
    beside = engine().generate([p[1], p[0]], seeded)[1]
    twice = engine().generate([p[0], p[0]], seeded)
    assert alone == beside == twice[0] == twice[1]
    assert engine().generate([p[0]], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))[0] \
        != alone


def test_sampled_generation_with_speculative_decoding_is_reproducible():
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=50, seed=5, ignore_eos=True)
    p = prompts(4, 8)
    assert engine(spec).generate(p, params) == engine(spec).generate(p, params)


# 4 -------------------------------------------------------------------------------------------------------------
def test_adaptive_verification_runs_are_reproducible_whatever_the_timings(tmp_path, monkeypatch):
    """Start-up timings move between runs; the cost curve they give is kept and reused, so two identical runs
    verify the same drafts and sample the same tokens."""
    from dispatcher.runtime.graphs import GraphRuntime

    monkeypatch.setenv("TWOGRID_CACHE", str(tmp_path))
    measure = GraphRuntime.measure_step_ms
    rng = np.random.default_rng(0)

    def noisy(self, kind, repeats=5):  # timings that differ from run to run
        sizes, ms = measure(self, kind, repeats)
        return sizes, tuple(m * float(rng.uniform(0.2, 5.0)) + float(rng.uniform(0, 3)) for m in ms)

    monkeypatch.setattr(GraphRuntime, "measure_step_ms", noisy)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive_verification": True}
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    p = [[5, 6, 7, 5, 6, 7, 5, 6] * 3] * 6
    first, second = engine(spec, max_num_seqs=16, budget=256), engine(spec, max_num_seqs=16, budget=256)
    assert first.scheduler.config.step_ms == second.scheduler.config.step_ms
    assert first.generate(p, params) == second.generate(p, params)
    assert list(tmp_path.glob("av_cost/*.json"))


def test_measured_step_costs_are_kept_apart_per_kv_cache_dtype_and_parallel_size(tmp_path, monkeypatch):
    """A step-cost curve measured with an FP8 KV cache (or FP8 weights, or another tensor-parallel size) is not the
    default setup's: each setup measures and keeps its own, and a rerun of one reads its own back."""
    monkeypatch.setenv("TWOGRID_CACHE", str(tmp_path))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive_verification": True}
    plain = engine(spec, max_num_seqs=16, budget=256)
    assert len(list(tmp_path.glob("av_cost/*.json"))) == 1
    fp8_kv = engine(spec, max_num_seqs=16, budget=256, kv_cache_dtype="fp8")
    assert len(list(tmp_path.glob("av_cost/*.json"))) == 2
    assert engine(spec, max_num_seqs=16, budget=256).scheduler.config.step_ms == plain.scheduler.config.step_ms
    assert len(list(tmp_path.glob("av_cost/*.json"))) == 2
    key = plain._cache_key(["sizes"])
    plain.worker.tensor_parallel_size = 2  # (a WorkerGroup's RemoteWorker says its ranks)
    assert plain._cache_key(["sizes"]) not in (key, fp8_kv._cache_key(["sizes"]))


def test_av_cost_table_file_is_used_and_bad_ones_are_clear_errors(tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive_verification": True}
    table = tmp_path / "curve.json"
    table.write_text(json.dumps({"tokens": [1, 64, 256], "ms": [1.0, 2.0, 4.0]}))
    e = engine(spec, max_num_seqs=16, budget=256, av_cost_table=str(table))
    assert e.scheduler.config.step_ms.tokens == (1, 64, 256)
    table.write_text('{"tokens": [1]}')
    with pytest.raises(ValueError, match="not a step-cost curve"):
        engine(spec, max_num_seqs=16, budget=256, av_cost_table=str(table))


# 5 -------------------------------------------------------------------------------------------------------------
def test_decodes_over_the_budget_run_the_uniform_decode_that_fits_on_full_graphs_fairly():
    """q = 3, budget 256, 100 running requests: each steady-state decode step schedules the whole requests that
    fit (85 at q = 3) and replays a FULL q = 3 graph; running requests left out go first next step, so none
    waits 2 steps."""
    spec = {"method": "eagle3", "num_speculative_tokens": 2}
    cfg = resolve({}, spec, platform="sm100", max_num_seqs=128, max_num_batched_tokens=256)
    sched = Scheduler(scheduler_config(cfg, num_kv_blocks=100 * 20, block_size=16, max_model_len=200))
    target = dispatchers_for_plan(build_plan(cfg))["target"]
    model = FakeModel(1000, 0.5, 128)
    for i in range(100):
        sched.add_request(Request(f"r{i}", [7, 8], SamplingParams(max_tokens=60, ignore_eos=True)))  # all admitted
    decode_steps, waits = 0, {}
    for _ in range(30):
        out = sched.schedule()
        s = out.shape
        if s.is_decode and (out.num_drafts == 2).all():
            decode_steps += 1
            desc = target.dispatch(s.num_tokens, s.num_reqs, s.max_query_len, s.is_decode)
            assert desc.kind == UNIFORM_DECODE and desc.mode == MODE_FULL and desc.q == 3, desc
            assert s.num_reqs == 85
        scheduled = {r.request_id for r in out.requests}
        for slot in sched.order:  # running requests left out wait at most one step
            rid = sched.slot_request[slot].request_id
            waits[rid] = 0 if rid in scheduled else waits.get(rid, 0) + 1
            assert waits[rid] <= 1, f"{rid} waited {waits[rid]} steps"
        sched.update(out, model.run(out))
    assert decode_steps >= 10


# 6 -------------------------------------------------------------------------------------------------------------
def test_generate_is_atomic():
    e = engine()
    with pytest.raises(RequestError, match="outside the vocabulary"):
        e.generate([[5, 6, 7], [8, 9], [10, 10**6]], GREEDY)
    assert not e.has_unfinished() and not e.scheduler.waiting
    assert e.generate([[5, 6, 7]], GREEDY) == engine().generate([[5, 6, 7]], GREEDY)


# 7 -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--num-kv-blocks", "0"], "--num-kv-blocks must be >= 1, got 0"),
    (["--num-kv-blocks", "-4"], "--num-kv-blocks must be >= 1, got -4"),
    (["--num-kv-blocks", "3"], "--num-kv-blocks = 3 cannot hold the longest request"),
    (["--step-trace", "/nonexistent/dir/trace.jsonl"], "--step-trace: step trace '/nonexistent/dir/trace.jsonl'"),
    (["--dataset", "DATASET"], "'conversations' must be a list of turns, got str"),
    (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], "max_num_seqs = 64 exceeds max_num_batched_tokens"),
])
def test_simulate_bad_inputs_are_one_line_errors(args, message, tmp_path, capsys):
    dataset = tmp_path / "bad.json"
    dataset.write_text('[{"conversations": "hello"}]')
    args = [str(dataset) if a == "DATASET" else a for a in args]
    assert cli_main(["simulate", "--platform", "sm100", "--num-prompts", "4", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("twogrid simulate: error: ") and message in err and err.count("\n") == 1
    assert "Traceback" not in err


# 8 -------------------------------------------------------------------------------------------------------------
def test_simulate_default_kv_holds_the_drafter_lookahead():
    cfg = resolve({}, {"method": "eagle3", "num_speculative_tokens": 7}, platform="sm100", max_num_seqs=32)
    same_length = [PromptSpec(None, 310)] * 64  # requests in lockstep: every slot reaches its longest together
    result = simulate(cfg, same_length, concurrency=32, output_len=128, acceptance_rate=0.0)
    assert result.summary["preemptions"] == 0


# 9 -------------------------------------------------------------------------------------------------------------
def test_a_step_that_preempts_admits_nothing():
    model = FakeModel(1000, 0.6, 4)
    sched = Scheduler(scheduler_config(resolve({}, {"method": "eagle3", "num_speculative_tokens": 3},
                                               platform="sm100", max_num_seqs=4, max_num_batched_tokens=64),
                                       num_kv_blocks=60, block_size=4, max_model_len=120))
    for i in range(6):
        sched.add_request(Request(f"q{i}", [3] * 30, SamplingParams(max_tokens=60, ignore_eos=True)))
    preempting_steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        if out.num_preempted:
            preempting_steps += 1
            assert not out.new_requests
        sched.update(out, model.run(out))
    assert preempting_steps > 0 and sched.kv.num_free == 60


# 10 ------------------------------------------------------------------------------------------------------------
def test_token_ids_numpy_integers_pass_and_booleans_do_not():
    e = engine()
    rid = e.add_request(np.array([5, 6, 7], dtype=np.int32), GREEDY)
    assert e.scheduler.requests[rid].prompt_token_ids == [5, 6, 7]
    for bad, message in [([5, True], "prompt token True is not an integer token id"),
                         ([5, 6.0], "prompt token 6.0 is not an integer token id"),
                         ([5, -1], "prompt token -1 is outside the vocabulary 0..511"),
                         ([5, 512], "prompt token 512 is outside the vocabulary 0..511"),
                         ([2**70, 5], f"prompt token {2**70} is outside the vocabulary 0..511"),
                         (np.array([5, 600]), "prompt token 600 is outside the vocabulary 0..511"),
                         (np.array([True, False]), "prompt token True is not an integer token id"),
                         ([5, np.int64(-3)], "prompt token -3 is outside the vocabulary 0..511")]:
        with pytest.raises(RequestError) as info:
            e.add_request(bad, GREEDY)
        assert str(info.value) == message
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 512, 100)]
    rid = e.add_request(ids, GREEDY)  # (plain ints: checked with numpy, the list kept as given)
    assert e.scheduler.requests[rid].prompt_token_ids == ids
    assert all(type(t) is int for t in e.scheduler.requests[rid].prompt_token_ids)


def test_a_front_ends_packed_prompt_gives_the_request_its_list_gives_and_bad_bytes_are_refused():
    """A front end sends a prompt as little-endian int32 bytes (``protocol.pack_prompt``), through the engine's
    socket: the request is the one its list makes (ids as plain ints, the same packed bytes for the block hashes);
    bytes that are not whole int32s, or an id outside the vocabulary, are refused naming it; an id past int32 stays
    a list, which the engine's check names."""
    from dispatcher.engine.protocol import AddRequest, decode_to_core, encode, pack_prompt

    e = engine()
    ids = [int(t) for t in np.random.default_rng(1).integers(0, 512, 100)]
    sent = decode_to_core(encode(AddRequest("r", pack_prompt(ids), GREEDY)))
    assert isinstance(sent.prompt_token_ids, bytes) and len(sent.prompt_token_ids) == 4 * len(ids)
    packed, plain = e.make_request(sent.prompt_token_ids, GREEDY, "p"), e.make_request(ids, GREEDY, "l")
    assert packed.prompt_token_ids == plain.prompt_token_ids == ids
    assert all(type(t) is int for t in packed.prompt_token_ids)
    assert packed.prompt_int32 == plain.prompt_int32 == np.asarray(ids, np.int32).tobytes()
    for bad, message in [(b"\x05\x00\x00", "prompt token ids: 3 bytes is not a whole number of int32 ids"),
                         (pack_prompt([5, -1]), "prompt token -1 is outside the vocabulary 0..511"),
                         (pack_prompt([5, 512]), "prompt token 512 is outside the vocabulary 0..511")]:
        with pytest.raises(RequestError) as info:
            e.make_request(bad, GREEDY, "bad")
        assert str(info.value) == message
    assert pack_prompt([5, 2**40]) == [5, 2**40]
    with pytest.raises(RequestError, match=f"prompt token {2**40} is outside the vocabulary"):
        e.make_request(decode_to_core(encode(AddRequest("big", pack_prompt([5, 2**40]), GREEDY))).prompt_token_ids,
                       GREEDY, "big")



def test_a_packed_prompt_is_listed_only_where_a_use_asks():
    """A request made from a front end's int32 bytes keeps them and makes no list of its prompt at arrival (~20 us
    of the engine's thread for 1,500 tokens): its length, its tokens at any span of prompt + output (the block
    hashes read them) and the step that admits it come from the bytes; ``prompt_token_ids`` makes the list, the
    same as a list-made request's; n = 2's children share the bytes."""
    from dispatcher.engine.protocol import pack_prompt

    e = engine()
    ids = [int(t) for t in np.random.default_rng(2).integers(0, 512, 40)]
    req = e.make_request(pack_prompt(ids), GREEDY, "p")
    req.output_token_ids += [7, 8, 9]
    assert req.num_prompt_tokens == 40 and req.num_tokens == 43 and req.max_total_tokens == 40 + GREEDY.max_tokens
    seq = ids + [7, 8, 9]
    for start, end in ((0, 16), (16, 32), (32, 43), (38, 42), (40, 43), (0, 43)):
        assert req.token_ids(start, end) == seq[start:end]
    assert req._prompt_ids is None  # (none of that made the list)
    assert req.all_token_ids == seq and req.prompt_token_ids == ids and all(type(t) is int for t in ids)
    children = e.make_requests(pack_prompt(ids), SamplingParams(max_tokens=3, n=2), "n2")
    assert all(c.prompt_int32 is children[0].prompt_int32 and c.prompt_token_ids == ids for c in children)
    with pytest.raises(ValueError, match="needs its prompt"):
        Request("none", None)


def test_an_unseeded_request_gets_its_own_seed_and_the_callers_parameters_stay_as_given():
    """A request without a seed draws one from the engine's (identical runs draw alike) into its own copy of the
    parameters: two requests sharing one ``SamplingParams`` get different seeds, the caller's object keeps None, and
    another engine of the same seed draws the same ones."""
    shared = SamplingParams(max_tokens=4, temperature=0.7)

    def seeds() -> list[int]:
        e = engine()
        rids = [e.add_request([5, 6, 7], shared), e.add_request([5, 6, 8], shared)]
        return [e.scheduler.requests[r].params.seed for r in rids]

    first = seeds()
    assert shared.seed is None and None not in first and first[0] != first[1] and seeds() == first

# 11 ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [{"method": "eagle3", "num_speculative_tokens": 3},
                                  {"method": "dflash", "num_speculative_tokens": 2},
                                  {"method": "ngram", "num_speculative_tokens": 2}], ids=lambda s: s["method"])
def test_every_method_runs_with_graphs_off(spec):
    p = prompts(5, 9)
    eager = engine(spec, cc={"cudagraph_mode": "NONE"})
    assert eager.generate(p, GREEDY) == engine(spec).generate(p, GREEDY) == engine().generate(p, GREEDY)
    assert eager.scheduler.stats.drafts_verified > 0


# smaller ones --------------------------------------------------------------------------------------------------
def test_drafts_past_max_tokens_are_not_verified_in_mixed_steps():
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    cfg = resolve({}, spec, platform="sm100", max_num_seqs=4, max_num_batched_tokens=64)
    sched = Scheduler(scheduler_config(cfg, num_kv_blocks=100, block_size=4, max_model_len=100,
                                       admission_wait_steps=0))  # ("new" admitted beside "short" at once)
    model = FakeModel(1000, 1.0, 4)
    sched.add_request(Request("short", [3] * 8, SamplingParams(max_tokens=3, ignore_eos=True)))
    out = sched.schedule()
    sched.update(out, model.run(out))  # 1 token; 2 left: at most 1 draft is useful
    sched.add_request(Request("new", [4] * 8, SamplingParams(max_tokens=3, ignore_eos=True)))
    out = sched.schedule()  # mixed: "short" decodes beside "new"'s prefill
    assert not out.shape.is_decode and out.num_drafts[0] == 1 and out.num_scheduled[0] == 2


def test_kv_grow_that_raises_changes_nothing():
    kv = KVBlockManager(num_blocks=10, block_size=4, max_num_seqs=2, max_blocks_per_seq=2)
    with pytest.raises(ValueError, match="outgrew max_blocks_per_seq"):
        kv.grow(np.array([0]), np.array([12]))
    assert kv.num_free == 10 and (kv.block_table == -1).all()


def test_max_num_seqs_above_the_token_budget_is_refused():
    with pytest.raises(ConfigError, match="max_num_seqs = 64 exceeds max_num_batched_tokens = 32"):
        resolve({}, None, platform="sm100", max_num_seqs=64, max_num_batched_tokens=32)


def test_step_trace_appends_and_engine_closes_it(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"step": 0, "note": "an earlier run"}\n')
    with engine(step_trace=str(trace)) as e:
        e.generate(prompts(2, 10), GREEDY)
    records = read_trace(str(trace))
    assert records[0]["note"] == "an earlier run" and len(records) > 2
    assert e.trace._fh is None


def test_step_trace_says_the_drafts_each_step_accepted(tmp_path):
    """Under speculative decoding each step that verified drafts records how many its requests accepted (a step's
    output tokens: its sampling requests plus these; ``trace_by_kind`` reads them): over the run they add up to the
    scheduler's accepted drafts. A step that verified none has no such field."""
    path = str(tmp_path / "t.jsonl")
    with engine({"method": "eagle3", "num_speculative_tokens": 3}, step_trace=path, fixed_acceptance=2.5) as e:
        e.generate(prompts(4, 12), SamplingParams(max_tokens=24, ignore_eos=True))
    records = read_trace(path)
    verified = [r for r in records if "accepted" in r]
    assert verified and all(r["accepted"] >= 0 for r in verified)
    assert sum(r["accepted"] for r in verified) == e.scheduler.stats.drafts_accepted > 0


def test_step_trace_says_how_many_requests_a_step_admitted(tmp_path):
    """A step that starts requests records how many (``admitted``: their admission is on the path from a result to
    that step); over a run they add up to the requests; a step that started none has no such field."""
    path = str(tmp_path / "t.jsonl")
    with engine(step_trace=path) as e:
        e.generate(prompts(6, 10), SamplingParams(max_tokens=8, ignore_eos=True))
    records = read_trace(path)
    admitting = [r for r in records if "admitted" in r]
    assert admitting and sum(r["admitted"] for r in admitting) == 6
    assert any("admitted" not in r for r in records)


def test_worker_block_table_starts_empty_and_forgets_freed_slots():
    e = engine({"method": "eagle3", "num_speculative_tokens": 2})
    tables = [rt.bufs.block_table for rt in e.worker.runtimes]
    assert len(tables) == 3 and all((t == -1).all() for t in tables)
    e.generate(prompts(3, 11), GREEDY)
    rid = e.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    e.step()  # this step carries the freed slots of the three finished requests
    live = {int(s) for s in e.scheduler.order}
    for t in tables:
        stale = [s for s in range(8) if s not in live and (t[s] != -1).any()]
        assert not stale and rid


# found at stop 18 on the H200 (1024 ShareGPT requests, K = 7) ---------------------------------------------------
@pytest.mark.parametrize("fixed", [3.0, 8.0])
def test_requests_at_max_model_len_fit_their_block_table_with_two_steps_in_flight(fixed):
    """With asynchronous scheduling a request holds the positions of two steps in flight (1 + K each) beyond its
    known tokens, so one whose prompt + max_tokens is exactly max_model_len reaches past max_model_len + K + 1
    near its end: the block table must be that wide ("a request outgrew max_blocks_per_seq" was an engine crash)."""
    spec = {"method": "eagle3", "num_speculative_tokens": 7}
    cfg = resolve({}, spec, platform="sm100", max_num_seqs=8, max_num_batched_tokens=128)
    e = EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=400, block_size=BLOCK, max_model_len=64,
                                   fixed_acceptance=fixed))
    assert e.async_scheduling
    batch = [p[: 64 - 24] for p in prompts(8, seed=5, lo=40, hi=40)]
    outputs = e.generate(batch, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [len(o) for o in outputs] == [24] * 8
    assert e.scheduler.kv.num_free == 400


def test_a_failed_step_forgets_its_requests_prompt_logprobs():
    """A request that a failed step ends leaves nothing behind: its prompt log-probabilities collected so far (a
    dict per prompt position) are freed, as an abort frees them."""
    core = engine()
    rid = core.add_request(list(range(3, 83)), SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=5))
    s1 = core.schedule()  # (the prompt's first 32-token chunk)
    core.update(s1, core.execute(s1))
    assert rid in core._prompt_logprobs
    assert core.fail_step(core.schedule()) == [rid] and not core.has_unfinished()
    assert not core._prompt_logprobs


def test_a_top_k_beyond_the_workers_integers_is_refused_and_the_running_requests_go_on():
    """top_k = 2^63 passed the checks (>= 0) and failed the next step in the worker (an int64 table), with every
    request in it: found by a hostile-input probe of `twogrid serve`. Refused now, naming the field and its limit."""
    e = engine()
    running = e.add_request([5, 6, 7] * 3, SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, top_k=5))
    e.step()
    for top_k in (2**63, 2**31, -1):
        with pytest.raises(RequestError, match=r"top_k must be an integer in 0\.\.2147483647"):
            e.add_request([5, 6], SamplingParams(max_tokens=2, temperature=1.0, top_k=top_k))
    kept = e.add_request([5, 6], SamplingParams(max_tokens=2, temperature=1.0, top_k=2**31 - 1))  # keeps every token
    done = {}
    while e.has_unfinished():
        for out in e.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert len(done[running]) == 5 and len(done[kept]) == 2


def test_an_admitted_request_reaches_the_worker_with_its_tokens():
    """The step that admits a request sends its tokens: the prompt as the engine packed it when it checked it, and
    for a request preempted and started again its prompt and output so far (the worker recomputes both)."""
    from dispatcher.messages import unpack

    e = engine(max_num_seqs=2, num_blocks=7, budget=64)  # (two start, and cannot both grow: preemption)
    ps = prompts(3, lo=8, hi=10)
    sent: dict[str, list[list[int]]] = {}
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    rids = [e.add_request(p, params) for p in ps]
    reqs = [e.scheduler.requests[r] for r in rids]
    assert all(r.prompt_int32 is not None for r in reqs)
    while e.has_unfinished():
        step = e.schedule()
        if step is None:
            continue
        for req, new in zip(step.out.new_requests, step.message.new_requests):
            sent.setdefault(req.request_id, []).append(unpack(new.token_ids).tolist())
            assert sent[req.request_id][-1] == req.all_token_ids
        e.update(step, e.execute(step))
    assert e.scheduler.stats.preemptions > 0
    assert any(len(v) > 1 and len(v[-1]) > len(v[0]) for v in sent.values())  # (one started again with output)
    for rid, p in zip(rids, ps):
        assert sent[rid][0] == p
    # (each keeps its prompt as the int32 bytes it was checked as; the list is made only where a use asks for it)
    assert all(r.prompt_int32 is not None and r.prompt_token_ids == p for r, p in zip(reqs, ps))
