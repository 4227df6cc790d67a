"""Scheduler properties (hypothesis) over random arrivals, aborts and lengths, with a small KV cache so that
preemption happens: budgets hold, no KV block leaks or is shared, outputs come out complete and in order
(equal to the deterministic fake model's greedy tokens, preempted or not), and every step's kind matches the
dispatcher's classification."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dispatcher.plan.config import resolve
from dispatcher.plan.dispatch import dispatchers_for_plan
from dispatcher.plan.capture_plan import build_plan
from dispatcher.engine.simulate import FakeModel
from scheduler.request import FinishReason, Request, RequestStatus, SamplingParams
from dispatcher.engine.config import scheduler_config
from scheduler.scheduler import Scheduler, SchedulerConfig

VOCAB = 1000


@st.composite
def setups(draw):
    max_num_seqs = draw(st.integers(1, 8))
    mnbt = draw(st.integers(max(8, max_num_seqs), 96))
    k = draw(st.sampled_from([0, 0, 1, 3]))
    spec = None
    if k:
        spec = {"method": "eagle3", "num_speculative_tokens": k}
        if k == 3 and max_num_seqs >= 3 and draw(st.booleans()):
            spec["num_speculative_tokens_per_batch_size"] = [[1, 3], [3, 1]]
        elif draw(st.booleans()):
            spec["adaptive_verification"] = True
    cfg = resolve({}, spec, platform="sm100", max_num_seqs=max_num_seqs, max_num_batched_tokens=mnbt)
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_prompt, max_out = 40, 24
    per_request = -(-(max_prompt + max_out + scheduler_config(cfg, 1).extra_tokens) // block_size)  # the most one
    # request holds: drafts of two steps in flight and the drafter's lookahead past prompt + max_tokens
    num_blocks = draw(st.integers(per_request, per_request * 3 // 2))
    acceptance = draw(st.sampled_from([0.0, 0.5, 1.0]))
    wait = draw(st.sampled_from([0, 0, 2, 5]))  # admission_wait_steps
    add = st.tuples(st.just("add"), st.integers(1, max_prompt), st.integers(1, max_out), st.booleans())
    ops = draw(st.lists(st.one_of(
        add, add, st.tuples(st.just("step")), st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ), min_size=6, max_size=40))
    return cfg, block_size, num_blocks, acceptance, wait, ops


def check_step(sched: Scheduler, out, dispatcher) -> None:
    c = sched.config
    assert out.shape.num_tokens <= c.max_num_batched_tokens
    assert out.shape.num_reqs <= c.max_num_seqs
    assert (out.num_scheduled >= 1).all() and int(out.num_scheduled.sum()) == out.shape.num_tokens
    assert len(set(out.slots.tolist())) == len(out.slots)
    desc = dispatcher.dispatch(out.shape.num_tokens, out.shape.num_reqs, out.shape.max_query_len, out.shape.is_decode)
    if desc.mode != "NONE":
        assert desc.num_tokens >= out.shape.num_tokens and desc.num_reqs >= out.shape.num_reqs
    # Every scheduled token has a KV slot.
    held = sched.kv.num_held[out.slots]
    assert (held * c.block_size >= out.num_computed + out.num_scheduled).all()


def check_blocks(sched: Scheduler) -> None:
    kv = sched.kv
    live = [s for s in sched.order]
    ids = np.concatenate([kv.block_table[s, : kv.num_held[s]] for s in live]) if live else np.zeros(0)
    assert len(set(ids.tolist())) == len(ids), "a KV block is shared by two live requests"
    assert (ids >= 0).all()
    assert kv.num_free + len(ids) == kv.num_blocks, "KV blocks leaked"
    free_slots = set(range(sched.config.max_num_seqs)) - set(live)
    assert all(kv.num_held[s] == 0 for s in free_slots)


def check_spec_decode(spec, out, outputs, k_max: int) -> None:
    """A step's speculative-decoding counters, as vLLM counts them: verify events are the requests that verified
    a draft, position j counts those that accepted more than j (so the positions sum to the accepted drafts and
    never grow with j), and a verify event yields its accepted drafts and one token of the target's own (fewer
    only for a request that ended in the step)."""
    verifying = out.num_drafts > 0
    assert spec.num_drafts == int(verifying.sum()) and spec.num_draft_tokens == int(out.num_drafts.sum())
    if not spec.num_drafts:
        assert spec.num_accepted_tokens == 0 and spec.accepted_per_pos == ()
        return
    per_pos = spec.accepted_per_pos
    assert len(per_pos) == k_max and sum(per_pos) == spec.num_accepted_tokens <= spec.num_draft_tokens
    assert spec.num_drafts >= per_pos[0] and all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    ids = {r.request_id for r, v in zip(out.requests, verifying.tolist()) if v}
    produced = sum(len(o.new_token_ids) for o in outputs if o.request_id in ids)
    if any(o.finished for o in outputs if o.request_id in ids):
        assert produced <= spec.num_accepted_tokens + spec.num_drafts
    else:
        assert produced == spec.num_accepted_tokens + spec.num_drafts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups())
def test_scheduler_invariants(setup):
    cfg, block_size, num_blocks, acceptance, wait, ops = setup
    sc = scheduler_config(cfg, num_blocks, block_size, max_model_len=80, admission_wait_steps=wait)
    sched = Scheduler(sc)
    model = FakeModel(VOCAB, acceptance, cfg.max_num_seqs)
    dispatcher = dispatchers_for_plan(build_plan(cfg))["target"]
    requests: list[Request] = []
    streamed: dict[str, list[int]] = {}

    def step():
        out = sched.schedule()
        check_step(sched, out, dispatcher)
        outputs = sched.update(out, model.run(out))
        for o in outputs:
            assert not o.finished or o.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
        check_spec_decode(sched.last_spec_decode, out, outputs, sched.k_max)
        check_blocks(sched)

    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, use_stop = op
            rid = f"r{len(requests)}"
            prompt = model.greedy_reference(rid + "p", 0, prompt_len)
            stop = (model.greedy_reference(rid, prompt_len, max_tokens)[max_tokens // 2],) if use_stop else ()
            req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, stop_token_ids=stop, ignore_eos=True))
            sched.add_request(req)
            requests.append(req)
        elif op[0] == "abort" and requests:
            req = requests[op[1] % len(requests)]
            was_live = req.status.is_live
            assert sched.abort(req.request_id) == was_live
            check_blocks(sched)
        elif sched.has_unfinished():
            step()
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        step()
    assert not sched.has_unfinished()
    event(f"preempted: {sched.stats.preemptions > 0}")
    event(f"drafts accepted: {sched.stats.drafts_accepted > 0}")
    stats = sched.stats
    assert len(stats.accepted_per_pos) == sched.k_max and sum(stats.accepted_per_pos) == stats.drafts_accepted
    assert stats.num_drafts <= stats.drafts_verified <= sched.k_max * stats.num_drafts
    assert sched.kv.num_free == num_blocks and sched.order == [] and not sched.waiting
    for req in requests:
        if req.status is RequestStatus.ABORTED:
            continue
        assert req.status is RequestStatus.FINISHED
        ref = model.greedy_reference(req.request_id, len(req.prompt_token_ids), req.params.max_tokens)
        if req.params.stop_token_ids:
            stop_at = ref.index(req.params.stop_token_ids[0])
            ref = ref[: stop_at + 1]
        assert req.output_token_ids == ref, "output lost, repeated or reordered a token"
        assert streamed.get(req.request_id, []) == req.output_token_ids
        assert req.finish_reason == (FinishReason.STOP if len(ref) < req.params.max_tokens else FinishReason.LENGTH) \
            or ref[-1] in req.params.stop_token_ids


def run_to_end(sched, model, requests):
    for req in requests:
        sched.add_request(req)
    for _ in range(5000):
        if not sched.has_unfinished():
            return
        out = sched.schedule()
        sched.update(out, model.run(out))
    raise AssertionError("did not finish")


def test_preempted_requests_produce_the_same_greedy_output():
    """Four long requests in a cache that holds two: preemption by recompute must not change any output."""
    model = FakeModel(VOCAB, 0.6, 4)

    def make():
        return [Request(f"q{i}", model.greedy_reference(f"q{i}p", 0, 30), SamplingParams(max_tokens=50))
                for i in range(4)]

    tight = Scheduler(SchedulerConfig(4, 64, num_kv_blocks=2 * 21, block_size=4, max_model_len=80,
                                      tiers=((1, 4, 3),)))
    roomy = Scheduler(SchedulerConfig(4, 64, num_kv_blocks=4 * 21, block_size=4, max_model_len=80,
                                      tiers=((1, 4, 3),)))
    a, b = make(), make()
    run_to_end(tight, model, a)
    run_to_end(roomy, model, b)
    assert tight.stats.preemptions > 0 and roomy.stats.preemptions == 0
    assert [r.output_token_ids for r in a] == [r.output_token_ids for r in b]
    assert all(len(r.output_token_ids) == 50 for r in a)


def test_abort_frees_blocks_at_once():
    sched = Scheduler(SchedulerConfig(4, 64, num_kv_blocks=64, block_size=4, max_model_len=80))
    model = FakeModel(VOCAB, 0.0, 4)
    req = Request("a", list(range(30)), SamplingParams(max_tokens=40))
    sched.add_request(req)
    out = sched.schedule()
    sched.update(out, model.run(out))
    assert sched.kv.num_free < 64
    assert sched.abort("a") and req.status is RequestStatus.ABORTED
    assert sched.kv.num_free == 64 and not sched.has_unfinished()
    assert not sched.abort("a")


def test_chunked_prefill_respects_the_budget_and_running_go_first():
    sched = Scheduler(SchedulerConfig(4, 32, num_kv_blocks=100, block_size=4, max_model_len=120))
    model = FakeModel(VOCAB, 0.0, 4)
    sched.add_request(Request("long", list(range(70)), SamplingParams(max_tokens=4)))
    sched.add_request(Request("short", list(range(5)), SamplingParams(max_tokens=4)))
    chunks = []
    for _ in range(4):
        out = sched.schedule()
        chunks.append([(r.request_id, int(n)) for r, n in zip(out.requests, out.num_scheduled)])
        sched.update(out, model.run(out))
    assert chunks[0] == [("long", 32)]
    assert chunks[1] == [("long", 32)]
    assert chunks[2] == [("long", 6), ("short", 5)]  # the running request first, then the new one
    assert chunks[3] == [("long", 1), ("short", 1)]  # both decoding


def test_bad_requests_get_clear_errors():
    import pytest

    from scheduler.request import RequestError

    sched = Scheduler(SchedulerConfig(4, 32, num_kv_blocks=10, block_size=4, max_model_len=64))
    cases = [
        (Request("a", [], SamplingParams()), "prompt must hold at least 1 token"),
        (Request("b", [1] * 60, SamplingParams(max_tokens=10)),
         "prompt (60 tokens) + max_tokens (10) = 70 exceeds max_model_len = 64"),
        (Request("c", [1] * 40, SamplingParams(max_tokens=10)),
         "prompt + max_tokens = 50 tokens needs 13 KV blocks, more than the cache holds (num_kv_blocks = 10)"),
        (Request("d", [1], SamplingParams(max_tokens=0)), "max_tokens must be an integer >= 1, got 0"),
        (Request("e", [1], SamplingParams(top_p=0.0)), "top_p must be in (0, 1], got 0.0"),
    ]
    for req, message in cases:
        with pytest.raises(RequestError) as info:
            sched.add_request(req)
        assert str(info.value) == message
    sched.add_request(Request("ok", [1, 2], SamplingParams(max_tokens=2)))
    with pytest.raises(RequestError, match="already live"):
        sched.add_request(Request("ok", [1], SamplingParams()))
    assert sched.has_unfinished()


def _started_at(sched, model, adds: dict[int, list[Request]], steps: int) -> dict[str, int]:
    """Run ``steps`` steps, adding ``adds[i]`` before step i; the step at which each request first ran."""
    started: dict[str, int] = {}
    for i in range(steps):
        for req in adds.get(i, []):
            sched.add_request(req)
        out = sched.schedule()
        for req in out.requests:
            started.setdefault(req.request_id, i)
        sched.update(out, model.run(out))
    return started


def test_arrivals_wait_for_one_mixed_step_while_the_batch_decodes():
    """admission_wait_steps = 4: requests arriving one step apart while the running one decodes start together,
    four steps after the first of them arrived; with nothing running, or 0, a request starts at once."""
    model = FakeModel(VOCAB, 0.0, 4)

    def req(name, max_tokens=30):
        return Request(name, model.greedy_reference(name + "p", 0, 6), SamplingParams(max_tokens=max_tokens))

    held = Scheduler(SchedulerConfig(4, 64, num_kv_blocks=64, block_size=4, max_model_len=80, admission_wait_steps=4))
    started = _started_at(held, model, {0: [req("a")], 3: [req("b")], 4: [req("c")]}, 12)
    assert started == {"a": 0, "b": 7, "c": 7}  # (b waits steps 3-6: four steps; c joins its step)
    plain = Scheduler(SchedulerConfig(4, 64, num_kv_blocks=64, block_size=4, max_model_len=80))
    assert _started_at(plain, model, {0: [req("a")], 3: [req("b")], 4: [req("c")]}, 12) == {"a": 0, "b": 3, "c": 4}


def test_a_backlog_and_a_preempted_request_are_not_held():
    """A request the last admission left waiting (no slot was free) starts as soon as a slot frees, and a preempted
    request back in line is not held: the wait only batches arrivals."""
    model = FakeModel(VOCAB, 0.0, 4)
    sched = Scheduler(SchedulerConfig(2, 64, num_kv_blocks=64, block_size=4, max_model_len=80, admission_wait_steps=8))
    reqs = [Request(f"r{i}", model.greedy_reference(f"r{i}p", 0, 10), SamplingParams(max_tokens=n))
            for i, n in enumerate((3, 20, 20))]
    started = _started_at(sched, model, {0: reqs}, 6)
    assert started == {"r0": 0, "r1": 0, "r2": 3}  # (r0's third token ends it in step 2; r1 decodes on)
    tight = Scheduler(SchedulerConfig(4, 64, num_kv_blocks=2 * 21, block_size=4, max_model_len=80,
                                      admission_wait_steps=1000))
    long = [Request(f"q{i}", model.greedy_reference(f"q{i}p", 0, 30), SamplingParams(max_tokens=50)) for i in range(4)]
    run_to_end(tight, model, long)  # (would never end if a preempted request were held behind decoding ones)
    assert tight.stats.preemptions > 0 and all(len(r.output_token_ids) == 50 for r in long)


def test_eos_ends_a_request_at_its_first_eos_among_a_steps_tokens():
    """A decode step of 1 + K tokens a request: a request that checks EOS ends at the first EOS among the tokens it
    takes (the rest dropped), one that ignores EOS keeps them all, one whose EOS comes only past its max_tokens ends
    by length, and a stop id of its own ends one as EOS does."""
    from scheduler.scheduler import ModelResult

    eos = 2
    sched = Scheduler(SchedulerConfig(8, 256, num_kv_blocks=200, block_size=4, max_model_len=64, tiers=((1, 8, 3),)))
    reqs = [Request("eos", [5, 6, 7], SamplingParams(max_tokens=20), eos),
            Request("ignores", [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True), eos),
            Request("short", [5, 6, 7], SamplingParams(max_tokens=3), eos),
            Request("stop_id", [5, 6, 7], SamplingParams(max_tokens=20, stop_token_ids=(9,)), eos),
            Request("plain", [5, 6, 7], SamplingParams(max_tokens=20), eos)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()  # (the prompts: one token each)
    sched.update(out, ModelResult(np.full((5, 1), 11), np.zeros(5, np.int64)))
    out = sched.schedule()  # (decodes: 1 + 3 tokens each, every draft accepted)
    assert out.shape.is_decode and (out.num_drafts == 3).all()
    rows = {r.request_id: i for i, r in enumerate(out.requests)}
    sampled = np.full((5, 4), 11)
    sampled[rows["eos"]] = [12, eos, 13, eos]
    sampled[rows["ignores"]] = [12, eos, 13, 14]
    sampled[rows["short"]] = [12, 13, eos, 14]  # (two tokens left: the EOS is past max_tokens)
    sampled[rows["stop_id"]] = [12, 9, 13, 14]
    ends = {o.request_id: o for o in sched.update(out, ModelResult(sampled, np.full(5, 3, np.int64)))}
    assert ends["eos"].new_token_ids == [12, eos] and ends["eos"].finish_reason is FinishReason.STOP
    assert ends["ignores"].new_token_ids == [12, eos, 13, 14] and not ends["ignores"].finished
    assert ends["short"].new_token_ids == [12, 13] and ends["short"].finish_reason is FinishReason.LENGTH
    assert ends["stop_id"].new_token_ids == [12, 9] and ends["stop_id"].finish_reason is FinishReason.STOP
    assert ends["plain"].new_token_ids == [11] * 4 and not ends["plain"].finished
    assert reqs[0].output_token_ids == [11, 12, eos] and reqs[1].output_token_ids == [11, 12, eos, 13, 14]
