"""Hostile and edge-case tests of the prompt paths that front ends' block hashes and int32 prompt bytes take into
the engine (``AddRequest.block_hashes``, ``EngineCore.make_requests`` / ``_sent_hashes``, ``Request.prompt_int32``
and its lazy ``prompt_token_ids``), on the CPU with the tiny preset of test_prefix_cache (blocks of 4 tokens).

What a user relies on: a request served from a front end's bytes and hashes gets exactly the tokens, cache hits,
prompt log-probabilities and refusals that the same request sent as a list without hashes gets, whatever its length
around the block borders, whatever the hashes' shape (malformed ones are set aside, never fatal), through
preemption, aborts, n > 1 and a drafter that keys blocks by the next token."""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_prefix_cache import BLOCK, check_pool, make_engine, prompt_of

from dispatcher.engine.protocol import AddRequest, EngineStarted, decode_to_core, encode, pack_prompt
from scheduler.block_hash import HASH_BYTES, extend_block_hashes, num_lookup_blocks, prompt_block_hashes, split_hashes
from scheduler.request import Request, RequestError, SamplingParams

EAGLE = {"method": "eagle3", "num_speculative_tokens": 2}
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
WARNING = "hashes such prompts itself"
B = BLOCK
BORDER_LENGTHS = (1, B - 1, B, B + 1, 2 * B - 1, 2 * B, 2 * B + 1, 3 * B + 1)


def own_hashes(engine, prompt: list[int]) -> list[bytes]:
    """The lookup blocks' hashes the engine's scheduler computes itself for ``prompt``."""
    c = engine.scheduler.config
    n = num_lookup_blocks(len(prompt), c.block_size)
    return extend_block_hashes([], lambda s, e: prompt[s:e], n, c.block_size, c.next_token_key) if n > 0 else []


def front_end_hashes(engine, prompt: list[int]) -> bytes:
    c = engine.scheduler.config
    return prompt_block_hashes(pack_prompt(prompt), c.block_size, c.next_token_key)


def drain(engine) -> dict[str, dict]:
    """Run to the end; per request its tokens, finish reason, cached tokens and prompt logprobs (pool checked after
    every step)."""
    outs: dict[str, dict] = {}
    for step_outs in engine.run():
        for o in step_outs:
            d = outs.setdefault(o.request_id, {"tokens": [], "reason": None, "cached": None, "plp": None})
            d["tokens"] += o.new_token_ids
            if o.finish_reason is not None:
                d["reason"] = o.finish_reason
            if o.num_cached_tokens is not None and d["cached"] is None:
                d["cached"] = o.num_cached_tokens
            if o.prompt_logprobs is not None:
                d["plp"] = o.prompt_logprobs
        check_pool(engine)
    assert not engine.has_unfinished()
    assert engine.scheduler.kv.num_free == engine.scheduler.config.num_kv_blocks
    return outs


def submit(engine, prompt, rid, params, mode: str, hashes: bytes | None = None):
    """Queue ``prompt`` as ``mode`` sends it: "list" (no hashes), "bytes" (int32, no hashes), "hashes" (int32 with
    the front end's hashes, or ``hashes`` as given). Returns the requests made."""
    if mode == "list":
        requests = engine.make_requests(list(prompt), params, rid)
    elif mode == "bytes":
        requests = engine.make_requests(pack_prompt(prompt), params, rid)
    else:
        sent = front_end_hashes(engine, prompt) if hashes is None else hashes
        requests = engine.make_requests(pack_prompt(prompt), params, rid, sent)
    engine.queue_all(requests)
    return requests


# -- lengths around the block borders ---------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [None, EAGLE], ids=["plain", "eagle3-next-token-key"])
def test_prompts_around_block_borders_are_served_alike_from_list_bytes_and_hashes(spec, caplog):
    """Prompts of 1, B - 1, B, B + 1, ... tokens, each served, then continued by one token, then served again
    (its lookup blocks cached): as a list, as int32 bytes, and as bytes with the front end's hashes, the same tokens
    and the same cached tokens; the sent hashes are taken (no warning) and are the engine's own; a prompt of one
    block or less sends none."""
    results = {}
    for mode in ("list", "bytes", "hashes"):
        engine = make_engine(spec, 64, 64, True)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="twogrid.engine"):
            outs = {}
            for length in BORDER_LENGTHS:
                base = prompt_of(length, salt=length)
                for tag, prompt in (("a", base), ("b", base + [7]), ("c", base)):
                    rid = f"{length}{tag}"
                    (req,) = submit(engine, prompt, rid, GREEDY, mode)
                    if mode == "hashes":
                        want = own_hashes(engine, prompt)
                        assert req.block_hashes == want, f"{rid}: the front end's hashes were not taken"
                        assert (want != []) == (len(prompt) > B)
                    outs.update(drain(engine))
        assert not any(WARNING in r.getMessage() for r in caplog.records)
        results[mode] = {rid: (o["tokens"], o["cached"], o["reason"]) for rid, o in outs.items()}
        stats = engine.scheduler.stats
        results[mode]["stats"] = (stats.prefix_cache_queries, stats.prefix_cache_hits)
    assert results["bytes"] == results["list"]
    assert results["hashes"] == results["list"]
    assert results["list"]["stats"][1] > 0
    # the served-again prompt finds its lookup blocks: (length - 1) // B blocks
    for length in BORDER_LENGTHS:
        assert results["hashes"][f"{length}c"][1] == num_lookup_blocks(length, B) * B


# -- malformed hashes -------------------------------------------------------------------------------------------
def test_malformed_hashes_are_set_aside_and_the_request_is_served_as_without(caplog):
    """Hashes bytes that are not whole hashes (31, 33, 95, 97 bytes), of the wrong count, whose first is not the
    engine's, or sent for a prompt that has no lookup block: the request is neither refused nor served with them;
    the engine hashes its prompt itself (its own hashes once queued) and it gets the tokens and cache hits of one
    sent without hashes; one warning for all of them."""
    prompt = prompt_of(3 * B + 2, salt=3)  # (3 lookup blocks: 96 bytes)
    assert num_lookup_blocks(len(prompt), B) == 3
    short = [9, 10]
    reference = make_engine(None, 64, 64, True)
    submit(reference, prompt, "warm", GREEDY, "list")
    drain(reference)
    submit(reference, prompt, "x", GREEDY, "list")
    submit(reference, short, "y", GREEDY, "list")
    want = drain(reference)

    good = prompt_block_hashes(pack_prompt(prompt), B, False)
    bad = [good[:31], good[:33], good[:95], good + b"\x00", good[:64], good + good[:32], bytes(96),
           b"\xff" + good[1:], good[32:64] + good[:32] + good[64:]]
    for i, hashes in enumerate(bad):
        engine = make_engine(None, 64, 64, True)
        submit(engine, prompt, "warm", GREEDY, "list")
        drain(engine)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="twogrid.engine"):
            (req,) = engine.make_requests(pack_prompt(prompt), GREEDY, "x", hashes)
            assert req.block_hashes == [], f"case {i}: malformed hashes taken"
            engine.queue_all([req])
            assert req.block_hashes == own_hashes(engine, prompt)
            (other,) = engine.make_requests(pack_prompt(short), GREEDY, "y", good[:32])  # (no lookup block)
            assert other.block_hashes == []
            engine.queue_all([other])
        assert sum(WARNING in r.getMessage() for r in caplog.records) == 1, f"case {i}"
        got = drain(engine)
        assert {k: (v["tokens"], v["cached"]) for k, v in got.items()} == \
            {k: (v["tokens"], v["cached"]) for k, v in want.items() if k in ("x", "y")}, f"case {i}"


def test_hashes_sent_to_an_engine_without_prefix_caching_are_ignored():
    """An engine with prefix caching off keeps no hashes a front end sends (it never looks them up or registers them)
    and serves the request as one without."""
    prompt = prompt_of(3 * B + 1, salt=5)
    engine = make_engine(None, 64, 64, False)
    (req,) = submit(engine, prompt, "h", GREEDY, "hashes", prompt_block_hashes(pack_prompt(prompt), B, False))
    assert req.block_hashes == []
    got = drain(engine)["h"]["tokens"]
    plain = make_engine(None, 64, 64, False)
    submit(plain, prompt, "h", GREEDY, "list")
    assert got == drain(plain)["h"]["tokens"] and len(got) == GREEDY.max_tokens


# -- preemption and recompute -----------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [None, EAGLE], ids=["plain", "eagle3-next-token-key"])
def test_requests_from_bytes_and_hashes_preempted_and_recomputed_get_the_tokens_of_lists(spec):
    """A KV pool too small for every running request preempts (recompute): requests made from int32 bytes with
    their front end's hashes, sharing prefixes, get the tokens that the same requests sent as lists without hashes
    get in the same pool, and the tokens of a pool large enough never to preempt."""
    shared = prompt_of(2 * B + 1, salt=11)
    prompts = [shared + prompt_of(k, salt=20 + k) for k in (1, 2, 3, 4)] + [prompt_of(3 * B, salt=40)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    def serve(mode, num_blocks):
        engine = make_engine(spec, 16, num_blocks, True)
        for i, p in enumerate(prompts):
            submit(engine, p, f"r{i}", params, mode)
        outs = drain(engine)
        return {k: v["tokens"] for k, v in outs.items()}, engine.scheduler.stats.preemptions

    small = 14
    hashed, preempted = serve("hashes", small)
    listed, preempted_too = serve("list", small)
    roomy, none = serve("list", 200)
    assert preempted > 0 and preempted_too == preempted and none == 0
    assert all(len(t) == params.max_tokens for t in hashed.values())
    assert hashed == listed
    assert hashed == roomy


# -- aborts -----------------------------------------------------------------------------------------------------
def test_aborts_before_admission_and_between_schedule_and_execute_leave_no_trace():
    """A request with its front end's hashes aborted while it waits, an n = 2 request's held child aborted before it
    is queued, and a request aborted after its step is scheduled but before it runs (its blocks offered to the cache
    at admission): the others are served as if they never came, the pool adds up, and the same prompts sent again
    with their hashes (one of them under the aborted request's id) get the tokens of a fresh engine."""
    a, b, c = prompt_of(3 * B + 1, salt=1), prompt_of(3 * B + 2, salt=2), prompt_of(4 * B + 1, salt=3)

    def fresh(prompt):
        engine = make_engine(None, 64, 64, True)
        submit(engine, prompt, "f", GREEDY, "list")
        return drain(engine)["f"]["tokens"]

    engine = make_engine(None, 8, 64, True)  # (a budget of 8: prompts prefill in chunks)
    submit(engine, a, "a", GREEDY, "hashes")
    submit(engine, b, "b", GREEDY, "hashes")
    kids = submit(engine, c, "n2", SamplingParams(max_tokens=5, ignore_eos=True, n=2, seed=3, temperature=1.0),
                  "hashes")
    assert engine.abort("b")
    assert engine.abort(kids[1].request_id)  # (held until the first child's prompt is computed)
    step = engine.schedule()
    assert [r.request_id for r in step.out.requests] == ["a"]
    assert engine.abort("a")  # (scheduled, not run: the blocks it registered must not be found)
    engine.update(step, engine.execute(step))
    check_pool(engine)
    outs = drain(engine)
    assert set(outs) == {kids[0].request_id}
    assert len(outs[kids[0].request_id]["tokens"]) == 5

    for rid, prompt in (("a", a), ("b", b), ("again", a)):
        submit(engine, prompt, rid, GREEDY, "hashes")
        assert drain(engine)[rid]["tokens"] == fresh(prompt), rid


# -- n > 1 ------------------------------------------------------------------------------------------------------
def test_n_children_with_hashes_sample_as_without_and_find_the_first_childs_prompt():
    """n = 3 seeded sampling from bytes with hashes: each child gets its own copy of the hashes (growing one leaves
    the others), the same tokens as without hashes, and children 2 and 3 find the first's computed prompt blocks."""
    prompt = prompt_of(4 * B + 2, salt=9)
    params = SamplingParams(max_tokens=6, ignore_eos=True, n=3, seed=17, temperature=1.0)
    runs = {}
    for mode in ("list", "hashes"):
        engine = make_engine(None, 64, 64, True)
        kids = submit(engine, prompt, "p", params, mode)
        if mode == "hashes":
            want = own_hashes(engine, prompt)
            assert all(k.block_hashes == want for k in kids)
            assert len({id(k.block_hashes) for k in kids}) == 3
            kids[0].block_hashes.append(b"\x00" * HASH_BYTES)  # (a child's own blocks grow its list only)
            assert kids[1].block_hashes == kids[2].block_hashes == want
            kids[0].block_hashes.pop()
        runs[mode] = {k: (v["tokens"], v["cached"]) for k, v in drain(engine).items()}
    assert runs["hashes"] == runs["list"]
    cached = sorted(v[1] for v in runs["hashes"].values())
    assert cached == [0, num_lookup_blocks(len(prompt), B) * B, num_lookup_blocks(len(prompt), B) * B]
    assert len({tuple(v[0]) for v in runs["hashes"].values()}) > 1  # (the seeds differ)


# -- prompt logprobs --------------------------------------------------------------------------------------------
def test_prompt_logprobs_with_hashes_over_a_cached_prefix_are_every_prompt_tokens():
    """A request that asks for its prompt's log-probabilities, sent with its hashes after the same prompt was served
    (its blocks cached): it skips the cache (computes every prompt token: 0 cached), and gets one entry a prompt
    token (None for the first), each holding its token, equal to those of a fresh engine's list-sent request."""
    prompt = prompt_of(3 * B + 3, salt=13)
    params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    engine = make_engine(None, 64, 64, True)
    submit(engine, prompt, "warm", GREEDY, "hashes")
    drain(engine)
    submit(engine, prompt, "plp", params, "hashes")
    got = drain(engine)["plp"]
    fresh = make_engine(None, 64, 64, True)
    submit(fresh, prompt, "plp", params, "list")
    want = drain(fresh)["plp"]
    assert got["cached"] == 0 and got["tokens"] == want["tokens"]
    plp = got["plp"]
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    assert all(entry is not None and tok in entry for tok, entry in zip(prompt[1:], plp[1:]))
    for g, w in zip(plp[1:], want["plp"][1:]):
        assert g.keys() == w.keys()
        assert all(abs(g[t] - w[t]) < 1e-4 for t in g)


# -- vocabulary edges, empty and refused prompts ----------------------------------------------------------------
def test_ids_at_the_vocabulary_edge_are_served_and_past_it_refused_with_hashes_sent():
    """Ids 0 and vocab - 1 in an int32 prompt with its hashes: taken, served as the list; vocab, -1, 2**31 - 1 and
    -2**31 refused naming the id (the hashes sent with them change nothing), leaving nothing live: the id is free
    for the next request."""
    engine = make_engine(None, 64, 64, True)
    vocab = engine.model_config.vocab_size
    edge = [0, vocab - 1] * (B + 1) + [vocab - 1]
    (req,) = submit(engine, edge, "edge", GREEDY, "hashes")
    assert req.block_hashes == own_hashes(engine, edge) != []
    got = drain(engine)["edge"]["tokens"]
    plain = make_engine(None, 64, 64, True)
    submit(plain, edge, "edge", GREEDY, "list")
    assert got == drain(plain)["edge"]["tokens"]
    for bad in (vocab, -1, 2**31 - 1, -(2**31)):
        prompt = prompt_of(2 * B + 1) + [bad]
        with pytest.raises(RequestError, match=f"prompt token {bad} is outside the vocabulary 0..{vocab - 1}"):
            engine.make_requests(pack_prompt(prompt), GREEDY, "edge", front_end_hashes(engine, prompt))
        assert not engine.has_unfinished()
    submit(engine, edge, "edge", GREEDY, "hashes")
    assert drain(engine)["edge"]["tokens"] == got


def test_an_empty_prompt_is_refused_with_or_without_hashes():
    """Empty int32 bytes (with no hashes, or with a hash sent anyway) are refused as an empty prompt, not a crash,
    and leave nothing live."""
    engine = make_engine(None, 64, 64, True)
    for hashes in (b"", bytes(HASH_BYTES), bytes(5)):
        with pytest.raises(RequestError, match="prompt must hold at least 1 token"):
            engine.make_requests(b"", GREEDY, "empty", hashes)
        with pytest.raises(RequestError, match="prompt must hold at least 1 token"):
            engine.make_requests(b"", SamplingParams(max_tokens=2, n=2), "empty-n", hashes)
    assert not engine.has_unfinished() and not engine.scheduler.requests


def test_a_live_request_id_sent_again_with_hashes_is_refused_and_the_live_one_unharmed():
    engine = make_engine(None, 64, 64, True)
    prompt = prompt_of(2 * B + 2, salt=21)
    submit(engine, prompt, "dup", GREEDY, "hashes")
    other = prompt_of(2 * B + 2, salt=22)
    with pytest.raises(RequestError, match="already live"):
        engine.make_requests(pack_prompt(other), GREEDY, "dup", front_end_hashes(engine, other))
    got = drain(engine)["dup"]["tokens"]
    fresh = make_engine(None, 64, 64, True)
    submit(fresh, prompt, "dup", GREEDY, "list")
    assert got == drain(fresh)["dup"]["tokens"]


# -- the lazy prompt list ---------------------------------------------------------------------------------------
def test_a_bytes_requests_every_token_span_equals_a_list_requests():
    """``token_ids(start, end)`` for every span of prompt + output, ``num_tokens``, ``all_token_ids`` and
    ``prompt_token_ids`` of a request made from int32 bytes equal those of one made from the list, at prompt lengths
    around the block borders, before and after its prompt list is made."""
    for length in (1, B - 1, B, B + 1, 2 * B + 1):
        prompt = [(37 * i + 5) % 512 for i in range(length)]
        lazy = Request("l", None, GREEDY, prompt_int32=np.asarray(prompt, np.int32).tobytes())
        listed = Request("p", prompt, GREEDY)
        for r in (lazy, listed):
            r.output_token_ids += [500, 501, 502]
        total = length + 3
        for listed_now in (False, True):
            if listed_now:
                assert lazy.prompt_token_ids == prompt
            for start in range(total + 1):
                for end in range(start, total + 2):
                    assert lazy.token_ids(start, end) == listed.token_ids(start, end), (length, start, end)
            assert lazy.num_tokens == listed.num_tokens == total
            assert lazy.num_prompt_tokens == length and lazy.all_token_ids == listed.all_token_ids


# -- through the front end's message ----------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [None, EAGLE], ids=["plain", "eagle3-next-token-key"])
def test_a_real_front_ends_message_gets_its_hashes_taken(spec, caplog):
    """The front end (``EngineClient``), told the engine's blocks by ``EngineStarted`` as the serving engine sends
    it, hashes prompts around the block borders; the message, encoded and decoded as on the socket, gives requests
    whose hashes the engine takes (no warning) and which are the engine's own."""
    import types

    from dispatcher.messages import WorkerReady
    from dispatcher.serve.client import EngineClient

    engine = make_engine(spec, 64, 64, True)
    sched = engine.scheduler.config
    init = types.SimpleNamespace(worker=types.SimpleNamespace(max_model_len=512), num_front_ends=1)
    client = EngineClient(init, None, "m", SamplingParams())
    sent = []
    client._send = sent.append
    client._started(EngineStarted(WorkerReady({}, 64, [], 0.0, "cpu"), True, [],
                                  sched.block_size if sched.enable_prefix_caching else 0, sched.next_token_key))
    client.ready = True
    with caplog.at_level(logging.WARNING, logger="twogrid.engine"):
        for length in BORDER_LENGTHS:
            prompt = prompt_of(length, salt=length)
            client.generate(f"r{length}", None, prompt, SamplingParams(max_tokens=2, n=2, seed=1, temperature=1.0))
            msg = decode_to_core(encode(sent[-1]))
            assert isinstance(msg, AddRequest) and msg.block_hashes == sent[-1].block_hashes
            requests = engine.make_requests(msg.prompt_token_ids, msg.params, msg.request_id, msg.block_hashes)
            want = own_hashes(engine, prompt)
            assert all(r.block_hashes == want for r in requests) and len(msg.block_hashes) == HASH_BYTES * len(want)
            assert split_hashes(msg.block_hashes) == want
    assert not any(WARNING in r.getMessage() for r in caplog.records)
