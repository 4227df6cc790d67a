"""The step pipeline (issue 11): the engine and the worker share only msgspec messages; the worker keeps request
state on its device; asynchronous scheduling (step t + 1 submitted before step t's result is back) gives exactly
the synchronous path's tokens; fixed acceptance for benchmarks; one synchronization a step on the GPU."""

from __future__ import annotations

import random

import msgspec
import pytest

torch = pytest.importorskip("torch")

from dispatcher import messages  # noqa: E402
from dispatcher.engine.engine_core import EngineArgs, EngineCore, model_result  # noqa: E402
from dispatcher.plan.config import resolve  # noqa: E402
from models.config import preset  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402

SPECS = [None, {"method": "eagle3", "num_speculative_tokens": 3}, {"method": "dflash", "num_speculative_tokens": 2},
         {"method": "eagle", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 4], [4, 2]]},
         {"method": "ngram", "num_speculative_tokens": 3}]


def engine(spec, device="cpu", model="tiny-dense", num_blocks=400, max_num_seqs=8, budget=64, cc_none=False,
           **kw) -> EngineCore:
    cfg = resolve({"cudagraph_mode": "NONE"} if cc_none else {}, spec, platform="sm100", max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=budget)
    return EngineCore(cfg, EngineArgs(preset(model), device=device, num_kv_blocks=num_blocks, block_size=8,
                                      max_model_len=128, **kw))


def prompts(n, seed, vocab=500):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 70))] for _ in range(n)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["method"] if s else "none")
def test_asynchronous_scheduling_gives_the_synchronous_tokens(spec):
    """Greedy and seeded sampled requests, chunked prefills, a KV cache that preempts: the pipelined engine (one
    step in flight while the next is scheduled) produces the synchronous engine's tokens exactly."""
    p = prompts(10, 1)
    greedy = SamplingParams(max_tokens=14, ignore_eos=True)
    sampled = SamplingParams(max_tokens=14, temperature=0.9, top_k=40, seed=17, ignore_eos=True)
    runs = []
    for overlap in (True, False):
        e = engine(spec, num_blocks=30, async_scheduling=overlap)
        assert e.async_scheduling is overlap
        runs.append((e.generate(p, greedy), e.generate(p, sampled), e.scheduler.stats.preemptions))
    assert runs[0][:2] == runs[1][:2]
    assert runs[0][2] > 0  # the small cache did preempt
    assert all(len(o) == 14 for o in runs[0][0] + runs[0][1])


def test_only_adaptive_verification_runs_synchronously():
    assert engine({"method": "ngram", "num_speculative_tokens": 3}).async_scheduling  # its drafter is on the device
    assert not engine({"method": "ngram", "num_speculative_tokens": 3, "adaptive_verification": True}).async_scheduling
    assert engine({"method": "eagle3", "num_speculative_tokens": 3}).async_scheduling
    assert not engine({"method": "eagle3", "num_speculative_tokens": 3}, async_scheduling=False).async_scheduling


def test_steps_round_trip_through_their_wire_format():
    """Every step message and result survives msgpack encoding unchanged, and a worker fed decoded messages
    produces the same results."""
    e = engine(SPECS[1])
    p = prompts(4, 2)
    for prompt in p:
        e.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    twin = engine(SPECS[1])
    while e.has_unfinished():
        step = e.schedule()
        wire = messages.encode(step.message)
        decoded = messages.decode_to_worker(wire)
        assert decoded == step.message
        result = e.worker.execute(step.message)
        same_timing = msgspec.structs.replace(twin.worker.execute(decoded), device_ms=result.device_ms)
        assert same_timing == result
        assert messages.decode_to_engine(messages.encode(result)) == result
        e.scheduler.update(step.out, model_result(result, step.out))


@pytest.mark.parametrize("frame", [b"", b"\x00", b"\xc1", messages.encode(messages.StepResult(1, b"", b"", 1)),
                                   b"\x93\xa4step\x01\x02", b"\x81\xa3bad\x01" * 100])
def test_malformed_frames_are_rejected(frame):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        messages.decode_to_worker(frame)


def test_the_worker_reads_no_scheduler_object():
    import ast
    import pathlib

    for path in pathlib.Path("dispatcher/runtime").glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(m and m.startswith(("scheduler", "dispatcher.engine")) for m in imported), path


def test_fixed_acceptance_hits_the_configured_mean():
    """Random-weight heads accept almost nothing; fixed acceptance makes the mean acceptance length (tokens a
    verify step yields) the configured one."""
    e = engine({"method": "eagle3", "num_speculative_tokens": 7}, budget=128, fixed_acceptance=3.0)
    e.generate([p[:20] for p in prompts(8, 3)], SamplingParams(max_tokens=90, ignore_eos=True))
    stats = e.scheduler.stats
    steps_verifying = stats.drafts_verified / 7
    mean_length = 1 + stats.drafts_accepted / steps_verifying
    assert 2.6 < mean_length < 3.4, mean_length
    with pytest.raises(ValueError, match=r"fixed_acceptance = 9.0 must be in \[1, 1 \+ K\] = \[1, 8\]"):
        engine({"method": "eagle3", "num_speculative_tokens": 7}, fixed_acceptance=9.0)


def test_fixed_acceptance_switches_on_a_captured_engine():
    """The engine benchmark measures real and fixed acceptance on one captured engine: switching it off gives the
    model's own tokens back (the same as an engine built without it), switching it on gives the configured mean."""
    spec = {"method": "eagle3", "num_speculative_tokens": 7}
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    batch = [p[:20] for p in prompts(6, 5)]
    e = engine(spec, budget=128, fixed_acceptance=3.0)
    e.worker.set_fixed_acceptance(None)
    assert e.generate(batch, params) == engine(spec, budget=128).generate(batch, params)
    e.worker.set_fixed_acceptance(4.0)
    before = (e.scheduler.stats.drafts_verified, e.scheduler.stats.drafts_accepted)
    e.generate(batch, SamplingParams(max_tokens=90, ignore_eos=True))
    verified, accepted = (e.scheduler.stats.drafts_verified - before[0], e.scheduler.stats.drafts_accepted - before[1])
    assert 3.5 < 1 + accepted / (verified / 7) < 4.5
    with pytest.raises(ValueError, match="needs speculative decoding"):
        engine(None).worker.set_fixed_acceptance(3.0)


def test_spec_decode_counters_add_up_as_vllm_counts_them():
    """Fixed K = 3 and fixed acceptance (a seeded number of drafts accepted): the engine's verify events, drafts
    and per-position acceptances agree with the worker's per-row results, with the scheduler's totals and with the
    tokens the verify steps produced (accepted + 1 each, fewer only in a request's last step, cut at max_tokens)."""
    k, max_tokens = 3, 40
    e = engine({"method": "eagle3", "num_speculative_tokens": k}, budget=128, fixed_acceptance=2.5)
    batch = [p[:20] for p in prompts(6, 7)]
    for p in batch:  # (all admitted in the first step: every later step is a uniform decode of K drafts each)
        e.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    verify_events, accepted, produced = 0, [], 0
    while e.has_unfinished():
        step = e.schedule()
        result = e.execute(step)
        outputs = {o.request_id: o for o in e.update(step, result)}
        out = step.out
        for i, req in enumerate(out.requests):
            if out.num_drafts[i] == 0:
                continue
            assert out.num_drafts[i] == k
            verify_events += 1
            a = min(int(result.num_accepted[i]), k)
            accepted.append(a)
            got = len(outputs[req.request_id].new_token_ids)
            produced += got
            assert got == a + 1 if not outputs[req.request_id].finished else 1 <= got <= a + 1
    s = e.stats
    assert s.num_drafts == verify_events == e.scheduler.stats.num_drafts > 0
    assert s.num_draft_tokens == k * s.num_drafts == e.scheduler.stats.drafts_verified
    assert s.num_accepted_tokens == sum(accepted) == e.scheduler.stats.drafts_accepted
    assert s.accepted_per_pos == [sum(a > j for a in accepted) for j in range(k)]
    assert sum(s.accepted_per_pos) == s.num_accepted_tokens
    assert s.acceptance_rate_per_pos == [n / s.num_drafts for n in s.accepted_per_pos]
    # every output token but each request's first (its prefill's) came from a verify event
    assert produced == len(batch) * (max_tokens - 1)
    assert produced <= s.num_accepted_tokens + s.num_drafts <= produced + k * len(batch)
    assert s.mean_acceptance_length == 1 + s.num_accepted_tokens / s.num_drafts
    assert 2.0 < s.mean_acceptance_length < 3.0  # fixed_acceptance = 2.5, over about a hundred verify events
    none = engine(None)
    none.generate(batch[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert (none.stats.num_drafts, none.stats.accepted_per_pos, none.stats.mean_acceptance_length) == (0, [], None)


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------


VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "as_strided", "expand", "t", "transpose", "unsqueeze",
            "squeeze", "alias", "unbind", "split", "split_with_sizes", "permute", "reshape", "detach", "narrow",
            "lift_fresh"}


def test_a_decode_step_launches_few_kernels_outside_its_graphs():
    """At small batches a GPU step waits for its host to enqueue the eager work around the graphs (input build,
    verification, state update, the draft loop's glue: docs/engine.md), so that work is counted: every torch op
    that is not a view, outside graph replays, in steady-state EAGLE K = 7 decode steps of 16 requests. 195 a
    step now: 243 before the draft loop's one-token steps 2..K-1 became bare replays of a graph that advances its
    own inputs (``GraphRuntime.execute_next``); the bound catches a regression."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dispatcher.runtime import graphs

    counted = {"on": False, "in_graph": 0, "ops": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if counted["on"] and not counted["in_graph"] and func.__name__.split(".")[0] not in VIEW_OPS:
                counted["ops"] += 1
            return func(*args, **(kwargs or {}))

    replay = graphs.Replayable.replay

    def counting_replay(self):
        counted["in_graph"] += 1
        try:
            replay(self)
        finally:
            counted["in_graph"] -= 1

    e = engine({"method": "eagle3", "num_speculative_tokens": 7}, model="tiny-moe", num_blocks=2000,
               max_num_seqs=64, budget=2048, fixed_acceptance=3.0, async_scheduling=False)
    for prompt in prompts(16, 9):
        e.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    steps = e.run()
    graphs.Replayable.replay = counting_replay
    try:
        with Count():
            for _ in range(6):  # prefills
                next(steps)
            counted["on"] = True
            for _ in range(10):
                next(steps)
            counted["on"] = False
    finally:
        graphs.Replayable.replay = replay
    for _ in steps:
        pass
    assert counted["ops"] / 10 <= 210, counted["ops"] / 10


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS[:3] + SPECS[-1:], ids=lambda s: s["method"] if s else "none")
def test_steady_state_steps_never_synchronize_implicitly(spec):
    """With CUDA graphs, a decode step's only synchronization is the wait for its result: torch's sync debug mode
    raises on any implicit one (.item(), .cpu(), a pageable copy, nonzero, ...)."""
    e = engine(spec, device="cuda", model="tiny-moe", max_num_seqs=32, budget=256)
    e.generate(prompts(8, 4), SamplingParams(max_tokens=4, ignore_eos=True))  # warm everything up
    for prompt in prompts(24, 5):
        e.add_request(prompt, SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, ignore_eos=True))
    steps = e.run()
    for _ in range(6):  # prefills
        next(steps)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            next(steps)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for _ in steps:
        pass


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["method"] if s else "none")
def test_gpu_asynchronous_equals_synchronous_and_graphs_equal_static(spec):
    p = prompts(40, 6, vocab=preset("tiny-moe").vocab_size)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outs = [engine(spec, device="cuda", model="tiny-moe", max_num_seqs=64, budget=512, async_scheduling=a,
                   use_cuda_graphs=g).generate(p, params) for a, g in ((True, True), (False, True), (False, False))]
    assert outs[0] == outs[1] == outs[2]


def test_logprobs_of_each_new_token_and_the_top_n():
    """A request asking for logprobs gets, per new token, its own log-probability (the model's distribution) and the
    top N others; greedy tokens are the most likely; requests not asking get none; speculative steps too."""
    e = engine({"method": "eagle3", "num_speculative_tokens": 2}, async_scheduling=False)
    ask = e.add_request([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3))
    plain = e.add_request([9, 10, 11], SamplingParams(max_tokens=6, ignore_eos=True))
    got: dict[str, list] = {ask: [], plain: []}
    tokens: dict[str, list] = {ask: [], plain: []}
    while e.has_unfinished():
        for o in e.step():
            tokens[o.request_id] += o.new_token_ids
            if o.logprobs is not None:
                got[o.request_id] += o.logprobs
    assert not got[plain] and len(got[ask]) == len(tokens[ask]) == 6
    for token, lp in zip(tokens[ask], got[ask]):
        assert token in lp and 3 <= len(lp) <= 4 and all(v <= 0 for v in lp.values())
        assert lp[token] == pytest.approx(max(lp.values()))  # greedy: the produced token is the most likely
    # the first token's numbers are a plain log_softmax over the model's logits at the prompt's last position
    from test_models_real import ragged_logits

    ref = torch.log_softmax(ragged_logits(e.worker.model, [[5, 6, 7, 8]])[-1], -1)
    top = torch.topk(ref, 3)
    assert got[ask][0] == pytest.approx({tokens[ask][0]: float(ref[tokens[ask][0]]),
                                         **{int(i): float(v) for i, v in zip(top.indices, top.values)}}, abs=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# draft_model: a second LM as the drafter
# ---------------------------------------------------------------------------------------------------------------


def _draft_modes(e: EngineCore) -> dict:
    """Counts, over a run, of each draft-model forward's mode: the catch-up ("draft", by mode), the one-token steps
    ("next", by mode) and which of those were bare replays (``execute_next``)."""
    from collections import Counter

    seen = {"draft": Counter(), "next": Counter(), "replays": 0}
    catch_up, one_token = e.worker.draft_runtimes
    assert (catch_up.runner, one_token.runner) == ("draft_model", "draft_model_next_steps")
    assert one_token.bufs.proposals is not None and catch_up.bufs.proposals is None
    for rt, key in ((catch_up, "draft"), (one_token, "next")):
        def execute(desc, *args, _run=rt.execute, _key=key):
            seen[_key][desc.mode] += 1
            return _run(desc, *args)
        rt.execute = execute
    run_next = one_token.execute_next

    def execute_next(desc, num_real):
        seen["replays"] += 1
        return run_next(desc, num_real)
    one_token.execute_next = execute_next
    return seen


def test_a_draft_model_keeps_the_targets_greedy_output_and_a_twin_is_always_accepted(tmp_path):
    """Greedy output with a draft LM equals greedy output without speculation: on its graphs (the catch-up forward
    over the target's rows PIECEWISE or FULL decode, its K one-token steps FULL q = 1 with in-graph proposals) and in
    mode NONE; for the target's twin (always accepted), a preset of another shape and another seed's weights."""
    from models.loader import save_checkpoint
    from models.transformer import build_model

    p = prompts(6, 21)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    alone = engine(None).generate(p, params)
    assert engine(None, cc_none=True).generate(p, params) == alone
    twin = engine({"method": "draft_model", "model": "tiny-dense", "num_speculative_tokens": 3})  # same weights
    modes = _draft_modes(twin)
    assert twin.generate(p, params) == alone
    stats = twin.scheduler.stats
    assert stats.drafts_verified > 0 and stats.drafts_accepted >= 0.9 * stats.drafts_verified
    assert modes["draft"]["FULL"] and modes["draft"]["PIECEWISE"] and not modes["draft"]["NONE"]
    assert modes["next"] == {"FULL": modes["next"]["FULL"]} and modes["replays"] == 2 * modes["next"]["FULL"]
    save_checkpoint(build_model(preset("tiny-dense"), "cpu", torch.float32, seed=9), str(tmp_path), "llama")
    other = engine({"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2})
    assert other.generate(p, params) == alone  # another model's drafts: other acceptance, the same tokens
    assert other.scheduler.stats.drafts_accepted < other.scheduler.stats.drafts_verified
    for cc_none in (False, True):
        moe = engine({"method": "draft_model", "model": "tiny-moe", "num_speculative_tokens": 4}, cc_none=cc_none)
        modes = _draft_modes(moe)
        assert moe.generate(p, params) == alone  # a preset draft of another shape for a preset target
        assert moe.scheduler.stats.drafts_accepted < moe.scheduler.stats.drafts_verified
        if cc_none:
            assert set(modes["draft"]) == set(modes["next"]) == {"NONE"} and not modes["replays"]
        else:
            assert modes["replays"] == 3 * modes["next"]["FULL"] > 0
    eager = engine({"method": "draft_model", "model": "tiny-dense", "num_speculative_tokens": 3},
                   cc_none=True, async_scheduling=False)
    assert eager.generate(p, params) == alone


def test_draft_model_tiers_and_piecewise_one_token_steps_keep_greedy_output():
    """Dynamic tiers (K = 3 up to 3 requests, 1 above: a tier drafting once still runs a one-token step) and mode
    PIECEWISE (one-token steps on the prefill grid, no replay advancing its inputs)."""
    p = prompts(8, 23)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = engine(None).generate(p, params)
    tiers = {"method": "draft_model", "model": "tiny-moe", "num_speculative_tokens": 3,
             "num_speculative_tokens_per_batch_size": [[1, 3], [4, 1]]}
    e = engine(tiers)
    modes = _draft_modes(e)
    assert e.generate(p, params) == alone
    assert modes["next"]["FULL"] and not modes["next"]["NONE"]
    cfg = resolve({"cudagraph_mode": "PIECEWISE"}, {"method": "draft_model", "model": "tiny-moe",
                                                    "num_speculative_tokens": 3},
                  platform="sm100", max_num_seqs=8, max_num_batched_tokens=64)
    pw = EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=400, block_size=8, max_model_len=128))
    modes = _draft_modes(pw)
    assert pw.generate(p, params) == alone
    assert set(modes["draft"]) == set(modes["next"]) == {"PIECEWISE"} and not modes["replays"]


def test_draft_model_errors_are_clear(tmp_path):
    from dispatcher.plan.config import ConfigError

    with pytest.raises(ConfigError, match='method draft_model needs "model"'):
        resolve({}, {"method": "draft_model", "num_speculative_tokens": 2}, platform="sm100")
    with pytest.raises(ConfigError, match='"model" is for methods draft_model, eagle, eagle3, not \'dspark\''):
        resolve({}, {"method": "dspark", "model": "x", "num_speculative_tokens": 2}, platform="sm100")
    with pytest.raises(ConfigError, match='"model" must be a path'):
        resolve({}, {"method": "eagle3", "model": 3, "num_speculative_tokens": 2}, platform="sm100")
    with pytest.raises(ValueError, match="vocabulary of 512 tokens, the target 49155"):
        cfg = resolve({}, {"method": "draft_model", "model": "tiny-dense", "num_speculative_tokens": 2},
                      platform="sm100", max_num_seqs=8, max_num_batched_tokens=64)
        EngineCore(cfg, EngineArgs(preset("tiny-dense").with_(vocab_size=49155), num_kv_blocks=100, block_size=8,
                                   max_model_len=64))
