"""Automatic prefix caching (issue 30) on the CPU, end to end through EngineCore: random runs with shared prefixes,
multi-turn continuations (a prompt that holds an earlier request's prompt and output), aborts at every point of
the step cycle, a KV cache small enough to preempt and evict, every speculative method, one step or two in flight;
run with prefix caching on and off, every request that neither run aborted must get exactly the same tokens (greedy
and seeded sampled), and after every step the block pool must add up: plain free + evictable (free, cached) + in
use = all blocks, each block's reference count = the block-table rows holding it. Then the cases one at a time: a
second request computes only its uncached suffix, a fully cached prompt still computes its last token, an evicted
prefix is recomputed, seeded sampling repeats over a cached prefix, a drafter's own KV for a cached prefix is there
(equal to what the request computes alone), and a failed step takes its blocks back out of the cache."""

from __future__ import annotations

import json
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from dispatcher.engine.engine_core import EngineArgs, EngineCore  # noqa: E402
from dispatcher.plan.config import resolve  # noqa: E402
from models.config import preset  # noqa: E402
from scheduler.request import FinishReason, RequestError, SamplingParams  # noqa: E402
from test_engine_random import PHASES, SPEC_COSTS, SPECS, phase_aborts, run_out, take_outputs  # noqa: E402

BLOCK = 4
MAX_MODEL_LEN = 64
ALL_SPECS = SPECS + [{"method": "draft_model", "model": "tiny-dense", "num_speculative_tokens": 2}]


@pytest.fixture(scope="module")
def cost_tables(tmp_path_factory) -> tuple[str, str]:
    """Adaptive verification's step-cost curve and "auto" tiers' step costs (test_engine_random's)."""
    folder = tmp_path_factory.mktemp("costs")
    (folder / "curve.json").write_text(json.dumps({"tokens": [1, 16, 64, 256], "ms": [1.0, 1.2, 2.0, 5.0]}))
    (folder / "spec_costs.json").write_text(json.dumps(SPEC_COSTS))
    return str(folder / "curve.json"), str(folder / "spec_costs.json")


def make_engine(spec, budget: int, num_blocks: int, caching: bool, max_num_seqs: int = 4,
                cost_tables: tuple[str, str] | None = None) -> EngineCore:
    cfg = resolve({}, spec, platform="sm100", max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    av, spec_costs = cost_tables or (None, None)
    return EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=num_blocks, block_size=BLOCK,
                                      max_model_len=MAX_MODEL_LEN, seed=5, enable_prefix_caching=caching,
                                      av_cost_table=av, spec_cost_table=spec_costs, auto_tier_interval=3))


def check_pool(engine: EngineCore) -> None:
    """Plain free + evictable + in use = every block, each exactly once; reference counts = the live rows."""
    kv, sched = engine.scheduler.kv, engine.scheduler
    held = [kv.block_table[s, : kv.num_held[s]] for s in sched.order]
    ids = np.concatenate(held) if held else np.zeros(0, np.int32)
    assert (ids >= 0).all()
    assert (np.bincount(ids, minlength=kv.num_blocks) == kv.ref_count).all(), "reference counts != block tables"
    plain = set(kv._free_stack[: kv.num_plain_free].tolist())
    order = list(kv._evictable)
    evictable = set(order)
    assert len(order) == len(evictable) == kv.num_evictable, "the eviction order lost or repeated a block"
    assert all(b in kv._evictable for b in order)
    in_use = set(np.nonzero(kv.ref_count)[0].tolist())
    assert len(plain) == kv.num_plain_free and not (plain & evictable) and not (in_use & (plain | evictable))
    assert kv.num_plain_free + kv.num_evictable + len(in_use) == kv.num_blocks, "blocks leaked"
    assert all(kv._registered[b] for b in evictable) and not any(kv._registered[b] for b in plain)
    free_slots = set(range(sched.config.max_num_seqs)) - set(sched.order)
    assert all(kv.num_held[s] == 0 for s in free_slots)


@st.composite
def workloads(draw):
    spec = draw(st.sampled_from(ALL_SPECS))
    budget = draw(st.sampled_from([8, 16, 24]))
    bases = [draw(st.lists(st.integers(3, 499), min_size=40, max_size=40)) for _ in range(2)]
    request = st.fixed_dictionaries({
        "base": st.integers(0, 1),
        "prefix_len": st.integers(0, 40),
        "suffix": st.lists(st.integers(3, 499), min_size=0, max_size=6),
        "max_tokens": st.integers(1, 8),
        "sampled": st.booleans(),
        "seed": st.integers(0, 2**31),
    })
    ops = draw(st.lists(st.one_of(
        st.tuples(st.just("add"), request), st.tuples(st.just("add"), request),
        st.tuples(st.just("continue"), st.integers(0, 20), st.lists(st.integers(3, 499), min_size=1, max_size=5),
                  st.integers(1, 6)),
        st.tuples(st.just("step")), st.tuples(st.just("step")), st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 20), st.sampled_from(PHASES)),
    ), min_size=6, max_size=28))
    per_request = -(-(MAX_MODEL_LEN + 2 * 4 + 4) // BLOCK)
    num_blocks = draw(st.integers(per_request, 3 * per_request))  # one to three requests' worth: preempt, evict
    depth = draw(st.sampled_from([1, 2]))
    return spec, budget, num_blocks, bases, ops, depth


def play(engine: EngineCore, bases, ops, depth: int, turns: dict[int, list[int]]):
    """Play the ops with ``depth`` steps in flight (2: step t + 1 scheduled before step t's result is taken);
    checks the pool after every step. A later turn's prompt holds an earlier request's output so far, which
    depends on how far the run got: the first run records each in ``turns`` (by op), a second run replays them.
    Returns (tokens by request, finish reasons, aborted request ids)."""
    tokens: dict[str, list[int]] = {}
    prompts: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    aborted: set[str] = set()
    pending, abort = phase_aborts(engine, reasons, aborted)
    ids: list[str] = []
    in_flight: deque = deque()

    def take(step):
        result = engine.wait(step)
        abort("after_execute")
        take_outputs(engine, step, result, tokens, reasons)
        check_pool(engine)

    def step():
        abort("before_schedule")
        scheduled = engine.schedule(len(in_flight))
        if scheduled is not None:
            abort("after_schedule")
            engine.submit(scheduled)
            in_flight.append(scheduled)
        if in_flight and (len(in_flight) == depth or scheduled is None):
            take(in_flight.popleft())

    def add(prompt, max_tokens, sampled=False, seed=0):
        prompt = prompt[: MAX_MODEL_LEN - max_tokens] or [3]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0 if sampled else 0.0,
                                seed=seed if sampled else None)
        try:
            rid = engine.add_request(prompt, params)
        except RequestError:
            raise AssertionError(f"a request within max_model_len was refused: {len(prompt)} + {max_tokens}")
        ids.append(rid)
        tokens[rid], prompts[rid] = [], prompt

    for i, op in enumerate(ops):
        if op[0] == "add":
            r = op[1]
            add(bases[r["base"]][: r["prefix_len"]] + r["suffix"], r["max_tokens"], r["sampled"], r["seed"])
        elif op[0] == "continue" and ids:  # a later turn: an earlier prompt, its output so far, new tokens
            rid = ids[op[1] % len(ids)]
            add(turns.setdefault(i, prompts[rid] + tokens[rid] + op[2]), op[3])
        elif op[0] == "abort" and ids:
            pending[op[2]].append(ids[op[1] % len(ids)])
        elif op[0] == "step":
            step()
    run_out(engine, step, ids, reasons, lambda: bool(in_flight))
    return tokens, reasons, aborted


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_cached_runs_equal_uncached(cost_tables, workload):
    spec, budget, num_blocks, bases, ops, depth = workload
    if spec and spec.get("adaptive_verification"):
        depth = 1  # (adaptive verification chooses from the last step's result: no step in flight)
    cached_engine, turns = make_engine(spec, budget, num_blocks, True, cost_tables=cost_tables), {}
    cached = play(cached_engine, bases, ops, depth, turns)
    plain = play(make_engine(spec, budget, num_blocks, False, cost_tables=cost_tables), bases, ops, depth, turns)
    stats = cached_engine.scheduler.stats
    event(f"prefix cache hits: {'some' if stats.prefix_cache_hits else 'none'}")
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries
    for rid, out in cached[0].items():
        if rid not in cached[2] and rid not in plain[2]:
            assert out == plain[0][rid], f"{rid}: prefix caching changed the tokens ({spec}, depth {depth})"
            assert cached[1][rid] == plain[1][rid]


def test_random_runs_hit_the_cache():
    """The workloads above do share prefixes: a fixed one of them hits the cache, evicts and preempts."""
    bases = [[(11 * i) % 400 + 3 for i in range(40)], [(17 * i) % 400 + 3 for i in range(40)]]
    add = lambda base, n, suffix: ("add", {"base": base, "prefix_len": n, "suffix": suffix, "max_tokens": 6,  # noqa
                                           "sampled": False, "seed": 0})
    ops = [add(0, 36, [5]), ("step",), add(0, 36, [6, 7]), add(1, 30, [8]), ("step",), ("continue", 0, [9], 4),
           ("step",), add(1, 40, []), add(0, 12, [4]), ("step",)] + [("step",)] * 6
    engine, turns = make_engine(None, 16, 22, True), {}
    cached = play(engine, bases, ops, 2, turns)
    assert play(make_engine(None, 16, 22, False), bases, ops, 2, turns)[0] == cached[0]
    stats = engine.scheduler.stats
    assert stats.prefix_cache_hits >= 32 and stats.preemptions >= 1


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(29 * i + salt) % 450 + 3 for i in range(n)]


def test_second_request_computes_only_its_suffix():
    engine = make_engine(None, 64, 64, True)
    shared = prompt_of(40)
    engine.generate([shared + [7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request(shared + [9, 10, 11], SamplingParams(max_tokens=4, ignore_eos=True), "second")
    step = engine.schedule()
    (req,) = step.out.new_requests
    assert step.out.num_computed.tolist() == [40] and step.out.num_scheduled.tolist() == [3]
    assert step.message.new_requests[0].num_computed == 40 and req.num_cached_tokens == 40
    assert step.out.prefix_cache_queries == 43 and step.out.prefix_cache_hits == 40
    engine.update(step, engine.execute(step))
    stats = engine.scheduler.stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (42 + 43, 40)


def test_fully_cached_prompt_computes_its_last_token():
    """A prompt whose every block is cached still computes its last token (it samples there), into a block of its
    own: the shared blocks stop one block short."""
    engine = make_engine(None, 64, 64, True)
    prompt = prompt_of(16)  # four full blocks
    first = engine.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True), "again")
    step = engine.schedule()
    assert step.out.num_computed.tolist() == [12] and step.out.num_scheduled.tolist() == [4]
    out = engine.update(step, engine.execute(step))
    rest = [t for outs in engine.run() for o in outs for t in o.new_token_ids]
    assert out[0].new_token_ids + rest == first[0]


def test_a_steps_blocks_are_offered_once_it_is_sent_and_before_anything_changes():
    """``schedule`` leaves offering the blocks a decode step fills to the prefix cache for after the step is sent
    (``EngineCore.sent``: the device need not wait for the hashing); they are offered, into that step's own
    ``registered``, by then, or by whatever next changes the scheduler: an abort of the request that fills them
    included, so that its blocks are cached when they are freed and a later request finds them."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt = prompt_of(30)  # 7 full blocks of 4 (offered as it is admitted) and 2 tokens
    for offer in ("sent", "abort"):
        engine = make_engine(None, 64, 64, True)
        kv = engine.scheduler.kv
        engine.add_request(prompt, params, "a")
        req = engine.scheduler.requests["a"]
        while True:  # decode until a step computes block 8's last token (tokens 28-31: the step that samples 33)
            step = engine.schedule()
            if step.out.num_computed[0] + step.out.num_scheduled[0] >= 32:
                break
            engine.update(step, engine.execute(step))
        assert kv.num_registered.sum() == 7 and step.out.registered == []
        if offer == "sent":
            engine.submit(step)
            assert len(step.out.registered) == 1 and kv.num_registered.sum() == 8
            engine.update(step, engine.wait(step))
        else:
            engine.worker.collect(engine.worker.submit(step.message))  # (the step ran)
            engine.abort("a")
            assert len(step.out.registered) == 1 and kv.num_evictable == 8
        check_pool(engine)
        engine.add_request((req.prompt_token_ids + req.output_token_ids)[:32] + [9], params, "b")
        assert engine.schedule().out.num_computed.tolist()[-1] == 32  # (b, after a where a still runs)


def test_evicted_prefix_is_recomputed():
    """A prefix whose blocks were evicted (allocations took them) is computed again, and right."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prefix = prompt_of(32)
    others = [prompt_of(40, salt) for salt in (1, 2, 3)]
    outputs = []
    for caching in (True, False):
        engine = make_engine(None, 64, 24, caching, max_num_seqs=1)
        engine.generate([prefix + [5]], params)
        registered = engine.scheduler.kv.num_evictable
        engine.generate(others, params)  # 3 x 11 blocks through a 24-block pool: the prefix's blocks go
        engine.add_request(prefix + [6], params, "back")
        step = engine.schedule()
        outputs.append([t for o in engine.update(step, engine.execute(step)) for t in o.new_token_ids]
                       + [t for outs in engine.run() for o in outs for t in o.new_token_ids])
        if caching:
            assert registered == 8 and step.out.num_computed.tolist() == [0], "the prefix was not evicted"
        check_pool(engine)
    assert outputs[0] == outputs[1]


def test_seeded_sampling_repeats_over_a_cached_prefix():
    engine = make_engine(None, 32, 64, True)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=1234)
    prompt = prompt_of(30)
    first = engine.generate([prompt], params)
    again = engine.generate([prompt, prompt], params)
    assert engine.scheduler.stats.prefix_cache_hits >= 2 * 28
    assert again == [first[0], first[0]]


@pytest.mark.parametrize("spec", [{"method": "eagle3", "num_speculative_tokens": 2},
                                  {"method": "draft_model", "model": "tiny-dense", "num_speculative_tokens": 2}],
                         ids=["eagle3", "draft_model"])
def test_drafter_kv_of_a_cached_prefix_is_there(spec):
    """The drafter's own KV for a cached prefix: a request that shares another's blocks finds in them the
    drafter's entries for every position of its prefix (written, and equal to those it computes alone), though
    the prefix was prefilled in chunks that sampled nothing and diverges right after a block (an EAGLE head's
    entry at a block's last position holds the next token: such a block is not shared)."""
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    shared = prompt_of(24)  # six blocks, prefilled in three 8-token chunks
    second = shared + [7, 8, 9]

    def drafter_kv(engine, prompt) -> tuple[torch.Tensor, int]:
        engine.add_request(prompt, params, "b")
        step = engine.schedule()
        cached, slot = int(step.out.num_computed[0]), int(step.out.slots[0])
        engine.update(step, engine.execute(step))
        blocks = engine.scheduler.kv.block_table[slot].copy()
        while engine.has_unfinished():  # (the prefill's later chunks get their blocks as they go)
            blocks = engine.scheduler.kv.block_table[slot].copy()
            engine.step()
        blocks = blocks[: -(-len(prompt) // BLOCK)]
        assert (blocks >= 0).all()
        kv = engine.worker.draft_runtimes[0].kv_caches[0]  # (2, blocks + 1, block, heads, dim)
        return kv[:, torch.as_tensor(blocks, dtype=torch.long)].flatten(1, 2)[:, : len(prompt) - 1], cached

    cached_engine = make_engine(spec, 8, 64, True, max_num_seqs=1)
    cached_engine.generate([shared + [5, 6]], params)
    got, cached = drafter_kv(cached_engine, second)
    alone, none = drafter_kv(make_engine(spec, 8, 64, False, max_num_seqs=1), second)
    assert none == 0
    assert cached == (20 if spec["method"] == "eagle3" else 24)  # (the head's last shared block continues with 5)
    written = got.flatten(2).abs().sum(-1) > 0
    assert written.all(), f"the drafter's KV is missing at positions {torch.nonzero(~written.all(0)).flatten()}"
    torch.testing.assert_close(got, alone, rtol=1e-4, atol=1e-5)


def test_failed_step_takes_its_blocks_back():
    """A step the worker fails registered blocks it never wrote: they leave the cache, and a request of the next
    step (scheduled before the failure was known) that found them in the cache fails with it."""
    engine = make_engine(None, 64, 64, True)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    shared = prompt_of(20)
    engine.add_request(shared + [5], params, "first")
    failing = engine.schedule()
    assert failing.out.registered
    engine.add_request(shared + [6], params, "hit")
    engine.add_request(prompt_of(9, 3), params, "bystander")
    later = engine.schedule(1)
    assert later.out.num_computed.tolist() == [21, 20, 0]  # "hit" found the failing step's blocks
    ids = engine.scheduler.fail_step(failing.out, [later.out])
    assert sorted(ids) == ["first", "hit"]
    kv = engine.scheduler.kv
    assert kv.lookup(failing.out.requests[0].block_hashes) == [] and kv.num_evictable == 0
    assert len(kv.lookup(engine.scheduler.requests["bystander"].block_hashes)) == 2  # (its own step is fine)
    engine.update(later, engine.execute(later))
    for _ in engine.run():
        pass
    check_pool(engine)
    engine.add_request(shared + [6], params, "retry")
    step = engine.schedule()
    assert step.out.num_computed.tolist() == [0], "a block the failed step never wrote was found in the cache"


@pytest.mark.parametrize("client_abort", [False, True], ids=["failed with it", "aborted before"])
def test_blocks_computed_over_a_failed_steps_blocks_leave_the_cache(client_abort):
    """Asynchronous scheduling: the step after a failing one admits B = P + Q, which found P's blocks (registered
    by the failing step, never written) and registers Q's, computed over them. B ends with the failure (or its
    client aborted it before); Q's blocks must leave the cache too: once P is computed again and cached, a request
    P + Q + x would otherwise find P's good blocks, then Q's bad ones, and read wrong KV without an error."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    P, Q = prompt_of(8), prompt_of(8, 5)
    engine = make_engine(None, 64, 64, True)
    engine.add_request(P + [5], params, "first")
    failing = engine.schedule()
    engine.add_request(P + Q + [6], params, "hit")
    later = engine.schedule(1)
    assert later.out.num_computed.tolist() == [9, 8]  # ("hit" found the failing step's blocks)
    if client_abort:
        assert engine.abort("hit")
    ended = engine.scheduler.fail_step(failing.out, [later.out])
    assert sorted(ended) == (["first"] if client_abort else ["first", "hit"])
    engine.update(later, engine.execute(later))  # (the worker runs the step in flight)
    for _ in engine.run():
        pass
    check_pool(engine)
    engine.generate([P + Q + [7]], params)  # (computes P again: its blocks cached again)
    got = engine.generate([P + Q + [8]], params)[0]
    assert got == make_engine(None, 64, 64, False).generate([P + Q + [8]], params)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [None, {"method": "eagle3", "num_speculative_tokens": 3}], ids=["no-sd", "eagle3"])
def test_cached_equals_uncached_through_graphs_on_gpu(spec):
    """On the GPU through the graphs (bfloat16, tiny-moe): 48 requests of 6 shared prefixes (prompts up to 600
    tokens, prefilled in chunks, shared prefixes found while their first request still runs), with caching on and
    off; by vLLM's convention (test_runtime's), where two outputs first differ each token is in the other run's
    top 5, and most are identical. The cache held most of the prompts' tokens."""
    import random

    from test_runtime import _next_logits

    rng = random.Random(3)
    vocab = preset("tiny-moe").vocab_size
    bases = [[rng.randrange(3, vocab) for _ in range(rng.choice([40, 200, 500]))] for _ in range(6)]
    prompts = [bases[i % 6] + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 90))] for i in range(48)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    cfg = resolve({}, spec, platform="sm100", max_num_seqs=32, max_num_batched_tokens=512)
    runs = {}
    for caching in (True, False):
        args = EngineArgs(preset("tiny-moe"), device="cuda", num_kv_blocks=4096, block_size=16, max_model_len=1024,
                          enable_prefix_caching=caching)
        engine = EngineCore(cfg, args)
        runs[caching] = engine.generate(prompts, params)
        if caching:
            stats = engine.scheduler.stats
            assert stats.prefix_cache_hits > 0.5 * stats.prefix_cache_queries
            cached_engine = engine
    exact = sum(a == b for a, b in zip(runs[True], runs[False]))
    for c, u, prompt in zip(runs[True], runs[False], prompts):
        if c != u:
            i = next(j for j, (x, y) in enumerate(zip(c, u)) if x != y)
            top5 = set(torch.topk(_next_logits(cached_engine, prompt + c[:i]), 5).indices.tolist())
            assert c[i] in top5 and u[i] in top5
    assert exact >= 24, f"only {exact} of 48 outputs identical with and without prefix caching"


@pytest.mark.parametrize("next_token_key", [False, True])
def test_a_prompts_hashes_from_its_packed_bytes_equal_those_from_its_tokens(next_token_key):
    """The engine keeps a checked prompt as int32 bytes; hashing its blocks reads them in place of packing its
    tokens again. The hashes are the same, from the first block or from some already hashed, and where the blocks
    reach past the packed prompt (into the output) the tokens are packed as before."""
    import numpy as np

    from scheduler.block_hash import extend_block_hashes

    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 2**31 - 1, 100).tolist()
    output = rng.integers(0, 50_000, 40).tolist()
    seq = prompt + output
    packed = np.asarray(prompt, np.int32).tobytes()

    def tokens(start, end):
        return seq[start:end]

    for first in (0, 2):
        want = extend_block_hashes(extend_block_hashes([], tokens, first, 16, next_token_key), tokens, 6, 16,
                                   next_token_key)
        got = extend_block_hashes(extend_block_hashes([], tokens, first, 16, next_token_key, packed), tokens, 6,
                                  16, next_token_key, packed)
        assert got == want and len(got) == 6
    longer = extend_block_hashes([], tokens, 8, 16, next_token_key, packed)  # (past the prompt: packed tokens)
    assert longer == extend_block_hashes([], tokens, 8, 16, next_token_key)
    assert extend_block_hashes([], tokens, 6, 16, next_token_key, packed)[:6] != \
        extend_block_hashes([], lambda s, e: (seq[:5] + [seq[5] + 1] + seq[6:])[s:e], 6, 16, next_token_key)


@pytest.mark.parametrize("next_token_key", [False, True])
def test_a_front_ends_prompt_hashes_are_those_the_engine_computes(next_token_key):
    """A front end hashes each prompt's lookup blocks (all full blocks before its last token) from the int32 bytes
    it sends; they are the hashes the scheduler computes from the prompt's tokens, for every length around the
    block borders, and none for a prompt of one block or less."""
    from dispatcher.engine.protocol import pack_prompt
    from scheduler.block_hash import extend_block_hashes, num_lookup_blocks, prompt_block_hashes, split_hashes

    rng = np.random.default_rng(7)
    for block_size in (4, 16):
        for length in range(1, 5 * block_size + 2):
            prompt = rng.integers(0, 2**31 - 1, length).tolist()
            joined = prompt_block_hashes(pack_prompt(prompt), block_size, next_token_key)
            n = num_lookup_blocks(length, block_size)
            want = extend_block_hashes([], lambda s, e: prompt[s:e], n, block_size, next_token_key) if n > 0 else []
            assert split_hashes(joined) == want and len(joined) == 32 * max(n, 0)


def test_a_request_with_its_front_ends_hashes_is_served_as_one_without(caplog):
    """The engine takes the prompt hashes a front end sent (``AddRequest.block_hashes``) in place of hashing the
    prompt: the same cache hits and tokens as a request without them; n = 2's children each get their own copy (each
    grows its list with its own output's blocks). Hashes of the wrong count, or whose first is not the engine's own (a
    front end that disagrees with the engine's block size or key: a defect), are set aside with one warning, and the
    engine hashes the prompt itself."""
    from dispatcher.engine.protocol import pack_prompt
    from scheduler.block_hash import prompt_block_hashes

    shared = prompt_of(30)
    prompts = [shared + [7, 8], shared + [9], prompt_of(21, 5)]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)

    def serve(hashes_of) -> tuple[list, tuple[int, int], list]:
        engine = make_engine(None, 64, 64, True)
        outs, made = [], []
        for i, prompt in enumerate(prompts):
            packed = pack_prompt(prompt)
            requests = engine.make_requests(packed, greedy, f"r{i}", hashes_of(packed))
            made.append([list(r.block_hashes) for r in requests])
            engine.queue_all(requests)
            outs.append([t for step_outs in engine.run() for o in step_outs for t in o.new_token_ids])
        stats = engine.scheduler.stats
        return outs, (stats.prefix_cache_queries, stats.prefix_cache_hits), made

    plain = serve(lambda packed: b"")
    sent = serve(lambda packed: prompt_block_hashes(packed, BLOCK, False))
    assert sent[0] == plain[0] and sent[1] == plain[1] and plain[1][1] > 0
    assert all(hashes for hashes, in sent[2]) and all(hashes == [] for hashes, in plain[2])
    for block_size, next_token_key in ((2 * BLOCK, False), (BLOCK, True)):  # (the second: the same count)
        caplog.clear()
        with caplog.at_level("WARNING", logger="twogrid.engine"):
            wrong = serve(lambda packed: prompt_block_hashes(packed, block_size, next_token_key))
        assert wrong[0] == plain[0] and wrong[1] == plain[1] and wrong[2] == plain[2]
        assert sum("hashes such prompts itself" in r.getMessage() for r in caplog.records) == 1

    engine = make_engine(None, 64, 64, True)
    packed = pack_prompt(shared)
    children = engine.make_requests(packed, SamplingParams(max_tokens=3, n=2), "n2",
                                    prompt_block_hashes(packed, BLOCK, False))
    assert children[0].block_hashes == children[1].block_hashes != []
    assert children[0].block_hashes is not children[1].block_hashes


def test_a_front_end_sends_each_prompts_hashes_once_the_engine_says_its_blocks():
    """``EngineStarted`` carries the prefix cache's block size (0 with caching off) and whether blocks are keyed by
    the next token; from then on a front end sends each prompt's block hashes with it (and none with caching off, or
    for a prompt whose ids the engine will refuse)."""
    import types

    from dispatcher.engine.protocol import EngineStarted, pack_prompt
    from dispatcher.messages import WorkerReady
    from dispatcher.serve.client import EngineClient
    from scheduler.block_hash import prompt_block_hashes

    init = types.SimpleNamespace(worker=types.SimpleNamespace(max_model_len=512), num_front_ends=1)
    ready = WorkerReady({}, 64, [], 0.0, "cpu")
    prompt = prompt_of(50)
    for block_size, next_token_key in ((16, False), (4, True), (0, False)):
        client = EngineClient(init, None, "m", SamplingParams())
        sent = []
        client._send = sent.append
        client._started(EngineStarted(ready, True, [], block_size, next_token_key))
        client.ready = True
        client.generate("a", None, prompt, SamplingParams(max_tokens=2))
        client.generate("b", None, [1, 2**40], SamplingParams(max_tokens=2))
        want = prompt_block_hashes(pack_prompt(prompt), block_size, next_token_key) if block_size else b""
        assert sent[0].block_hashes == want and (want != b"") == (block_size > 0)
        assert sent[1].block_hashes == b""


def test_eviction_takes_the_least_recently_freed_blocks_a_runs_tail_first():
    """The cached blocks are evicted least recently freed first, of one request's run its tail first (a chain is only
    found from its head); a block found again by a request leaves the order; nothing is lost or taken twice."""
    from scheduler.kv_blocks import KVBlockManager

    kv = KVBlockManager(num_blocks=8, block_size=4, max_num_seqs=2, max_blocks_per_seq=8)
    log: list = []
    for slot, tag in ((0, b"a"), (1, b"b")):
        kv.start(slot, [], 3 * 4)
        kv.register_one(slot, [tag + bytes([i]) for i in range(3)], 3, slot, log)
    a, b = kv.block_table[0, :3].tolist(), kv.block_table[1, :3].tolist()
    kv.release(0)
    kv.release(1)
    assert list(kv._evictable) == a[::-1] + b[::-1] and kv.num_evictable == 6 and kv.num_plain_free == 2
    found = kv.lookup([b"b\x00", b"b\x01"])
    assert found == b[:2]
    kv.start(0, found, 2 * 4)  # (b's first two blocks in use again: out of the order)
    assert list(kv._evictable) == a[::-1] + b[2:] and kv.num_evictable == 4
    grown = kv.grow(np.array([0]), np.array([8 * 4]))  # 6 more blocks: the 2 plain ones, then a's tail first
    taken = grown[2].tolist()
    assert taken[2:] == [a[2], a[1], a[0], b[2]] and list(kv._evictable) == [] and kv.num_free == 0
    assert kv.lookup([b"a\x00"]) == [] and kv.lookup([b"b\x00", b"b\x01"]) == b[:2]
