"""Structured outputs and tool calls (issue 31), without a server: the request fields as the API reads them, the
limits that refuse hostile constraints, the engine's grammars (xgrammar on the default model's tokenizer: compiled
once, refused when they fail or take too long, a bitmask that allows exactly the grammar's tokens), the engine and
worker path of a constrained step (a grammar whose mask depends on the previous token, so that a bitmask filled
before that token is in would show; constrained steps never fused; the prefix cache under real matchers), and the
tool-call parsers. tests/test_structured_serve.py runs them through
a real server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import msgspec
import numpy as np
import pytest

from dispatcher.serve import protocol as P
from dispatcher.serve.protocol import ApiError
from dispatcher.serve.tools import PARSERS, NamedCall, parameters_schema
from scheduler.request import RequestError, SamplingParams
from scheduler.structured import (MAX_GRAMMAR_RULES, MAX_REGEX_REPEAT, MAX_SCHEMA_DEPTH, MAX_SCHEMA_PROPERTIES,
                                  MAX_SCHEMA_VALUES, MAX_SPEC_CHARS, StructuredOutputsParams)

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# ---------------------------------------------------------------------------------------------------------------
# the request fields
# ---------------------------------------------------------------------------------------------------------------


def chat(**fields) -> P.ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return P.decode_request(json.dumps(body).encode(), P.ChatCompletionRequest)


def test_response_format_and_structured_outputs_as_vllm_reads_them():
    assert P.structured_outputs(chat(response_format={"type": "text"})) is None
    assert P.structured_outputs(chat()) is None
    assert P.structured_outputs(chat(response_format={"type": "json_object"})).json_object is True
    so = P.structured_outputs(chat(response_format={"type": "json_schema", "json_schema": {"name": "p",
                                                                                            "schema": PERSON}}))
    assert json.loads(so.json) == PERSON and list(json.loads(so.json)["properties"]) == ["name", "age"]  # (order)
    assert so.where == "response_format"
    for field, value in [("json", PERSON), ("regex", r"\d+"), ("choice", ["a", "b"]), ("grammar", 'root ::= "x"'),
                         ("json_object", True)]:
        so = P.structured_outputs(chat(structured_outputs={field: value}))
        assert so.kind == field and so.where == "structured_outputs"
    # vLLM's older top-level names, and the completions endpoint
    assert P.structured_outputs(chat(guided_choice=["x", "y"])).choice == ("x", "y")
    assert P.structured_outputs(chat(guided_json=json.dumps(PERSON))).json == json.dumps(PERSON)
    comp = P.decode_request(json.dumps({"prompt": "x", "guided_regex": "a+", "guided_decoding_backend": "xgrammar"})
                            .encode(), P.CompletionRequest)
    assert P.structured_outputs(comp).regex == "a+"
    st = P.structured_outputs(chat(response_format={"type": "structural_tag", "format": {"type": "const_string",
                                                                                          "value": "hi"}}))
    assert json.loads(st.structural_tag)["format"]["value"] == "hi"


@pytest.mark.parametrize("fields,param,words", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "only one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs", "JSON schema"),
    ({"structured_outputs": {"regex": "[a-z]{1,100000}"}}, "structured_outputs", f"at most {MAX_REGEX_REPEAT}"),
    ({"structured_outputs": {"choice": ["x"] * (MAX_SCHEMA_VALUES + 1)}}, "structured_outputs",
     f"at most {MAX_SCHEMA_VALUES}"),
    ({"structured_outputs": {"grammar": "root ::= " + '"a" | ' * MAX_SPEC_CHARS + '"b"'}}, "structured_outputs",
     f"at most {MAX_SPEC_CHARS}"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(ab){2000}"}}}}}}, "response_format",
     "pattern"),
    ({"response_format": {"type": "json_object"}, "guided_json": PERSON}, "guided_json", "only one"),
])
def test_malformed_or_hostile_constraints_get_400_naming_the_field(fields, param, words):
    with pytest.raises(ApiError) as err:
        P.structured_outputs(chat(**fields))
    assert err.value.status == 400 and err.value.param == param and words in err.value.message, err.value.message


def nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_sent_again_is_walked_once_and_a_refused_one_every_time(monkeypatch):
    """An application sends the same schema with every request, and each is validated by its front end and three
    times in the engine's loop: the walk (``check_schema``) runs once per text that passes; a text that failed is
    checked, and refused, every time it comes (errors are not kept)."""
    from scheduler import structured
    from scheduler.structured import StructuredOutputError

    walked = []
    real = structured.check_schema
    monkeypatch.setattr(structured, "check_schema", lambda field, doc: (walked.append(field), real(field, doc)))
    schema = json.dumps({"type": "object", "properties": {"walked-once": {"type": "integer"}}})
    for _ in range(4):
        StructuredOutputsParams(json=schema).validate()
    assert walked == ["structured_outputs.json"]
    bad = json.dumps({"type": "object", "not": {"type": "integer"}, "title": "walked-every-time"})
    for _ in range(3):
        with pytest.raises(StructuredOutputError, match="'not' is not supported"):
            StructuredOutputsParams(json=bad).validate()
    assert len(walked) == 4
    StructuredOutputsParams(json=schema, where="response_format").validate()  # (another field: its own errors)
    assert len(walked) == 5


def test_schema_limits_are_counted_without_recursion():
    """Nesting (iteratively: 100 000 levels raise no RecursionError), enumerated values and properties over the
    whole schema; what is under the limits passes."""
    ok = StructuredOutputsParams(json=json.dumps(nested(MAX_SCHEMA_DEPTH // 2 - 1)))
    ok.validate()
    for schema, words in [(nested(MAX_SCHEMA_DEPTH), "about 32 nested objects at most"),
                          ({"anyOf": [{"enum": list(range(MAX_SCHEMA_VALUES // 2 + 1))}] * 2}, "enumerates"),
                          ({"type": "object", "properties": {str(i): {} for i in range(MAX_SCHEMA_PROPERTIES + 1)}},
                           "more than 256 object properties"),
                          ({"anyOf": [{"type": "object", "properties": {str(i): {} for i in range(20)}}] * 13},
                           "more than 256 object properties")]:
        with pytest.raises(ValueError, match=words):
            StructuredOutputsParams(json=json.dumps(schema)).validate()
    chain = "\n".join(["root ::= r0"] + [f'r{i} ::= r{i + 1} | r{i + 1} "x"' for i in range(MAX_GRAMMAR_RULES)]
                      + [f'r{MAX_GRAMMAR_RULES} ::= "a"'])
    with pytest.raises(ValueError, match=f"has {MAX_GRAMMAR_RULES + 2} rules; at most {MAX_GRAMMAR_RULES}"):
        StructuredOutputsParams(grammar=chain).validate()
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValueError):
        StructuredOutputsParams(structural_tag=deep).validate()
    with pytest.raises(RequestError, match="structured_outputs"):
        SamplingParams(structured_outputs=StructuredOutputsParams()).validate()


def test_structured_params_travel_to_the_engine_as_msgpack():
    params = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(choice=("a", "b"),
                                                                                     where="tools"))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert back == params and back.structured_outputs.key == ("choice", ("a", "b"), False)


# ---------------------------------------------------------------------------------------------------------------
# the engine's grammars (xgrammar, the default model's tokenizer)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from models.default_model import default_model_path
    from models.text import load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def grammars(tokenizer):
    from dispatcher.engine.structured import StructuredOutputs

    g = StructuredOutputs(tokenizer, 49152, [tokenizer.eos_token_id], in_processes=True)  # (the server's)
    g.start()
    yield g
    g.close()


def test_a_vocabulary_xgrammar_misreads_turns_structured_outputs_off(grammars, tokenizer, monkeypatch):
    """xgrammar's table of token texts is checked against the tokenizer's decoding: the default model's agrees
    (byte-level, read right); read as RAW (what xgrammar falls back to when it cannot tell the type) most tokens
    differ, and a server with such a table refuses every constraint with a 400 saying why, not grammars that allow
    the wrong tokens."""
    import xgrammar as xgr

    from dispatcher.engine.structured import StructuredOutputs, vocabulary_misread

    assert grammars.misread is None
    vocab = [t for t, _ in sorted(tokenizer.backend.get_vocab().items(), key=lambda kv: kv[1])]
    raw = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=49152, stop_token_ids=[2])
    why = vocabulary_misread(raw.decoded_vocab, tokenizer, raw.special_token_ids)
    assert why is not None and "structured outputs are off" in why and re.search(r"token \d+ is '.+', xgrammar", why)
    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", lambda *a, **k: raw)
    misread = StructuredOutputs(tokenizer, 49152, [tokenizer.eos_token_id], in_processes=False)
    try:
        with pytest.raises(RequestError, match="response_format: xgrammar reads this tokenizer's vocabulary"):
            misread.compile_future(StructuredOutputsParams(json_object=True, where="response_format"))
    finally:
        misread.close()


def on_worker(grammars, so, slot: int = 0):
    """A worker's grammars (``WorkerGrammars`` on the CPU) holding the engine's compile of ``so``, with a matcher
    at ``slot``."""
    import torch

    from dispatcher.messages import GrammarDef
    from dispatcher.runtime.grammar import WorkerGrammars

    compiled = grammars.compile(so)
    worker = WorkerGrammars(grammars.vocab_size, torch.device("cpu"), 8)
    worker.define(GrammarDef(compiled.grammar_id, compiled.serialized, grammars.tokenizer_info_json))
    worker.start(slot, compiled.grammar_id, [])
    return worker


def allowed(worker, slots) -> np.ndarray:
    import torch

    from dispatcher.runtime.grammar import unpack_bitmask

    out = torch.empty((len(slots), worker.words), dtype=torch.int32)
    worker.fill(np.asarray(slots), out)
    return unpack_bitmask(out.numpy(), worker.vocab_size)


def sampled(worker, slot: int, tokens) -> None:
    """``tokens`` as the worker's steps sample them, one a step, for ``slot``."""
    import torch

    for t in tokens:
        worker.note_sampled(np.asarray([slot]), torch.tensor([t]))


def test_the_bitmask_allows_exactly_the_grammar_and_then_only_eos(grammars, tokenizer):
    """A choice grammar: the first token's mask holds every token that starts one of the choices and nothing
    else; after the whole choice only EOS is allowed; after EOS (terminated), or for a slot without a grammar,
    every token is."""
    eos = tokenizer.eos_token_id
    worker = on_worker(grammars, StructuredOutputsParams(choice=("yes", "no")))
    mask = allowed(worker, [0])[0]
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    texts = {i: tokenizer.decode([i]) for i in np.nonzero(mask)[0].tolist()}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts.values()), texts
    assert vocab["yes"] in texts and vocab["no"] in texts and not mask[eos]
    sampled(worker, 0, tokenizer.encode("yes", False))
    mask = allowed(worker, [0])[0]
    assert mask.sum() == 1 and mask[eos]
    sampled(worker, 0, [eos])
    assert allowed(worker, [0, 5]).all()


def test_json_schema_output_valid_token_by_token(grammars, tokenizer):
    """Feeding a valid object token by token, each token is in the mask the step before it had."""
    worker = on_worker(grammars, StructuredOutputsParams(json=json.dumps(PERSON)))
    for t in tokenizer.encode('{"name": "Bo", "age": 42}', False):
        assert allowed(worker, [0])[0][t], tokenizer.decode([t])
        sampled(worker, 0, [t])
    assert allowed(worker, [0])[0].sum() == 1  # EOS alone


def test_json_mode_gives_an_object_with_any_keys_never_an_array(grammars, tokenizer):
    """response_format json_object (OpenAI's JSON mode) allows any object, nested values and keys the client
    never named included, and no other JSON value: an array, a string or a number is not an object."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(grammars.tokenizer_info_json)
    so = StructuredOutputsParams(json_object=True, where="response_format")
    compiled = lambda: xgr.GrammarMatcher(  # noqa: E731
        xgr.CompiledGrammar.deserialize_json(grammars.compile(so).serialized, info))
    m = compiled()
    assert m.accept_string('{"city": "Oslo", "days": [1, {"t": null}], "ok": true}')
    assert m.accept_token(tokenizer.eos_token_id) and m.is_terminated()
    for text in ("[", '"text"', "42"):
        assert not compiled().accept_string(text), text


def test_a_token_sampled_before_a_slot_changed_hands_is_never_accepted(grammars, tokenizer):
    """A request admitted again (preempted, then back with its output so far) or a new one in a freed slot starts
    its matcher from what the engine sends: a token the worker sampled for the slot before that is dropped, even
    though its copy to the host is read after."""
    so = StructuredOutputsParams(json=json.dumps(PERSON))
    worker = on_worker(grammars, so)
    prefix = tokenizer.encode('{"name": "Bo"', False)
    sampled(worker, 0, prefix)
    gid = grammars.compile(so).grammar_id
    worker.start(0, gid, prefix[:2])  # (re-admitted with two of them: the engine dropped the rest)
    mask = allowed(worker, [0])[0]
    assert mask[prefix[2]] and not mask[tokenizer.encode("{", False)[0]]


def test_the_engine_sends_each_grammar_once_and_drops_idle_ones(grammars, monkeypatch):
    """``for_step``: a grammar goes to the worker with the first request it constrains (the tokenizer's table with
    the very first), not again while the worker holds it; once no slot uses it, it stays for the next request
    until ``WORKER_IDLE_GRAMMARS`` others wait behind it, then the worker is told to drop it."""
    from types import SimpleNamespace

    from dispatcher.engine import structured as S
    from dispatcher.messages import unpack

    monkeypatch.setattr(S, "WORKER_IDLE_GRAMMARS", 1)
    regexes = [grammars.compile(StructuredOutputsParams(regex=f"a{{{i}}}")) for i in (1, 2, 3)]

    def step(new: dict, freed=()):
        reqs = [SimpleNamespace(request_id=rid) for rid in new]
        for rid, (_, c) in new.items():
            grammars.add(rid, c)
        out = SimpleNamespace(new_requests=reqs, slots=np.asarray([slot for slot, _ in new.values()], np.int64),
                              freed_slots=np.asarray(freed, np.int64))
        ids, defs, drops = grammars.for_step(out)
        return ids, [d.grammar_id for d in defs], unpack(drops).tolist() if drops else [], defs

    r0, r1, r2 = regexes
    ids, defined, dropped, defs = step({"a": (0, r0), "b": (1, r0), "c": (2, None)})
    assert ids == [r0.grammar_id] * 2 + [-1] and defined == [r0.grammar_id] and not dropped
    assert defs[0].tokenizer_info == grammars.tokenizer_info_json != ""
    ids, defined, dropped, defs = step({"d": (3, r1)}, freed=(0,))
    assert defined == [r1.grammar_id] and defs[0].tokenizer_info == ""  # (r0: one slot still uses it)
    assert step({"e": (0, r0)}, freed=(1,))[1] == []  # (held)
    assert step({}, freed=(0, 3))[2] == [r0.grammar_id]  # (two idle, one kept: the last used)
    assert step({"f": (0, r1)})[1] == [] and step({"g": (1, r0)})[1] == [r0.grammar_id]
    for rid in "abcdefg":
        grammars.remove(rid)


def test_the_worker_keeps_idle_grammars_within_a_byte_limit(tokenizer, monkeypatch):
    """Idle grammars are dropped by bytes too (a schema within the limits can compile to tens of MB): with room for
    one, the second to go idle pushes the first out, though the count limit allows many."""
    from types import SimpleNamespace

    from dispatcher.engine import structured as S
    from dispatcher.messages import unpack

    grammars = S.StructuredOutputs(tokenizer, 49152, [tokenizer.eos_token_id])
    grammars.start()

    small = grammars.compile(StructuredOutputsParams(regex="x{1,3}"))
    large = grammars.compile(StructuredOutputsParams(regex="y{1,3}"))
    monkeypatch.setattr(S, "WORKER_IDLE_BYTES", max(len(small.serialized), len(large.serialized)))

    def step(new: dict, freed=()):
        for rid, (_, c) in new.items():
            grammars.add(rid, c)
        out = SimpleNamespace(new_requests=[SimpleNamespace(request_id=rid) for rid in new],
                              slots=np.asarray([slot for slot, _ in new.values()], np.int64),
                              freed_slots=np.asarray(freed, np.int64))
        drops = grammars.for_step(out)[2]
        return unpack(drops).tolist() if drops else []

    assert step({"s": (0, small), "l": (1, large)}) == []
    assert step({}, freed=(0,)) == []  # (one idle: within the bytes)
    assert step({}, freed=(1,)) == [small.grammar_id]
    for rid in "sl":
        grammars.remove(rid)
    assert list(grammars._worker_idle) == [large.grammar_id]
    grammars.close()


def test_the_bitmask_fill_keeps_the_faster_thread_count(monkeypatch):
    """Until a thread count is chosen, fills of 32 live rows or more take turns between one thread and xgrammar's
    pool and are timed; after 32 of each the faster a row is kept (one thread here: the stand-in's pool is slow),
    and every mask is the same whichever filled it. ``$TWOGRID_GRAMMAR_FILL_THREADS`` fixes the count, and a bad
    value is refused naming it."""
    import torch

    from dispatcher.messages import GrammarDef
    from dispatcher.runtime import grammar as G

    class SlowPool(Successor):
        class BatchGrammarMatcher(Successor.BatchGrammarMatcher):
            def __init__(self, threads):
                self.threads = threads

            def batch_fill_next_token_bitmask(self, matchers, out, rows):
                if self.threads > 1:
                    time.sleep(0.002)
                super().batch_fill_next_token_bitmask(matchers, out, rows)

    monkeypatch.setattr(G, "xgrammar_threads", lambda: 4)
    monkeypatch.delenv(G.FILL_THREADS_ENV, raising=False)
    worker = G.WorkerGrammars(512, torch.device("cpu"), 40)
    worker.backend(SlowPool)
    worker.define(GrammarDef(0, "", "stand-in"))
    for slot in range(40):
        worker.start(slot, 0, [])
    out = torch.empty((40, worker.words), dtype=torch.int32)
    masks = []
    for _ in range(2 * G.TRIAL_FILLS):
        assert worker.fill_threads is None
        worker.fill(np.arange(40), out)
        masks.append(out.clone())
    assert worker.fill_threads == 1 and all(torch.equal(m, masks[0]) for m in masks)
    monkeypatch.setenv(G.FILL_THREADS_ENV, "3")
    assert G.fill_thread_counts() == (3,)
    monkeypatch.setenv(G.FILL_THREADS_ENV, "many")
    with pytest.raises(ValueError, match="TWOGRID_GRAMMAR_FILL_THREADS: 'many'"):
        G.fill_thread_counts()


def test_a_grammar_compiles_once_and_errors_name_the_field(grammars):
    so = StructuredOutputsParams(json=json.dumps({"type": "object", "properties": {"k": {"enum": list(range(900))}}}))
    first = grammars.compile_future(so)
    assert grammars.compile_future(so) is first or first.done()  # one compile per constraint in flight
    first.result()
    t0 = time.perf_counter()
    grammars.compile(StructuredOutputsParams(json=so.json, where="response_format"))  # (xgrammar's LRU cache)
    assert time.perf_counter() - t0 < 0.05
    for bad, words in [(StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
                       (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex"),
                       (StructuredOutputsParams(json='{"type": "nonsense"}', where="response_format"),
                        "response_format")]:
        with pytest.raises(RequestError, match=words) as err:
            grammars.compile(bad)
        assert "does not compile" in str(err.value) and "/project/" not in str(err.value)


def test_a_compile_done_before_its_callback_is_registered_does_not_deadlock(grammars, monkeypatch):
    """A cached grammar compiles at once: its future can be done before ``compile_future`` registers the callback
    that forgets it, which then runs in the caller (once, under the lock: the event loop hung)."""
    from concurrent.futures import Future

    def done_at_once(fn, *args):
        fut = Future()
        fut.set_result(fn(*args))
        return fut

    monkeypatch.setattr(grammars._pool, "submit", done_at_once)
    worker = threading.Thread(target=grammars.compile, args=(StructuredOutputsParams(regex="[ab]+"),), daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and not grammars._compiling


def test_a_slow_compile_is_refused_after_the_timeout_and_never_blocks_the_loop(grammars, monkeypatch):
    """A compile runs in the pool: the event loop keeps turning (the engine keeps stepping) while it runs, and a
    request whose grammar takes longer than the timeout is refused with a message naming the limit."""
    grammars.compile(StructuredOutputsParams(regex="warm+"))  # (ready: before it, a request also waits for the start)
    gate = threading.Event()
    real = grammars._compile

    def slow(params, submitted):
        gate.wait(5)  # (a compile waits for its process, as this wait does)
        return real(params, submitted)

    monkeypatch.setattr(grammars, "_compile", slow)
    monkeypatch.setattr(grammars, "timeout_s", 0.3)

    async def go():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.get_running_loop().create_task(ticker())
        with pytest.raises(RequestError, match=r"did not compile within 0\.3 s \(the server.s limit for one "
                                               r"constraint, compile_timeout_s of ") as err:
            await grammars.compile_async(StructuredOutputsParams(regex="slow+", where="response_format"))
        task.cancel()
        return ticks, err.value

    ticks, err = asyncio.run(go())
    gate.set()
    assert ticks >= 10 and str(err).startswith("response_format")


def test_a_refused_compile_that_has_not_started_is_cancelled(grammars, monkeypatch):
    """Requests refused at the compile timeout stop holding the pool: a compile nobody waits for any more is
    cancelled if it has not started (one that runs is stopped at its deadline), so an ordinary request after
    them compiles in time. A cached grammar is answered at once, without a pool thread."""
    from dispatcher.engine import structured as S

    started, release = [], threading.Event()
    real = grammars._compile

    def slow(params, submitted):
        started.append(params.regex)
        if params.regex.startswith("slow"):
            release.wait(5)
        return real(params, submitted)

    monkeypatch.setattr(grammars, "_compile", slow)
    monkeypatch.setattr(grammars, "timeout_s", 0.3)
    cached = grammars.compile(StructuredOutputsParams(regex="cached+"))
    errors = []

    def refused(regex):
        with pytest.raises(RequestError, match="did not compile within"):
            grammars.compile(StructuredOutputsParams(regex=regex))
        errors.append(regex)

    hostile = [threading.Thread(target=refused, args=(f"slow{i}+",)) for i in range(S.COMPILE_WORKERS + 2)]
    for t in hostile:
        t.start()
    for t in hostile:
        t.join(10)
    assert len(errors) == len(hostile)
    t0 = time.perf_counter()
    assert grammars.compile(StructuredOutputsParams(regex="cached+")) is cached  # (while the pool is busy)
    assert time.perf_counter() - t0 < 0.1
    release.set()
    assert grammars.compile(StructuredOutputsParams(regex="ordinary+")).grammar_id >= 0
    assert len([r for r in started if r.startswith("slow")]) == S.COMPILE_WORKERS  # (the queued two: cancelled)
    deadline = time.monotonic() + 5
    while grammars._compiling and time.monotonic() < deadline:  # (the two that ran finish after the release)
        time.sleep(0.01)
    assert not grammars._compiling and not grammars._waiters


def _slow_schema() -> str:
    """Under every static limit, seconds to compile (4000 long enum values: 2.7 s here), little memory."""
    return json.dumps({"type": "object", "properties": {"k": {"enum": [f"value 1 number {i} of many"
                                                                        for i in range(4000)]}}, "required": ["k"]})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_compile_past_its_timeout_is_stopped_and_frees_its_slot(grammars, monkeypatch):
    """xgrammar cannot stop a compile: at the timeout its process is killed, so a slow constraint holds a compile
    slot (and its memory) no longer than the timeout, and the next constraint compiles at once in a new process."""
    from dispatcher.engine import structured as S

    grammars.compile(StructuredOutputsParams(regex="warm+"))  # (the compile processes started and ready)
    limit = grammars.timeout_s
    monkeypatch.setattr(grammars, "timeout_s", 0.5)
    pids = {p.pid for p in grammars._all_processes}
    t0 = time.monotonic()
    with pytest.raises(RequestError, match=r"did not compile within 0\.5 s"):
        grammars.compile(StructuredOutputsParams(json=_slow_schema(), where="response_format"))
    deadline = time.monotonic() + 5
    while grammars._compiling and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not grammars._compiling and time.monotonic() - t0 < 2  # (not the 2.7 s the compile takes)
    killed = pids - {p.pid for p in grammars._all_processes}
    assert len(killed) == 1 and not any(map(_alive, killed))
    monkeypatch.setattr(grammars, "timeout_s", limit)  # (a new process's start under CI's load took more than 0.5 s)
    for _ in range(2 * S.COMPILE_WORKERS):  # (every slot: the killed one's too)
        assert grammars.compile(StructuredOutputsParams(regex=f"after{_}+")).grammar_id >= 0


def test_a_compile_that_outgrows_its_memory_is_refused_and_the_next_compiles(tokenizer, monkeypatch):
    """A constraint whose compile needs more than ``COMPILE_MEMORY_BYTES`` is refused naming the limit (its process
    held to it: a schema of this kind once took the engine down); the compile after it runs."""
    from dispatcher.engine import grammar_process as GP
    from dispatcher.engine import structured as S

    monkeypatch.setattr(GP, "COMPILE_MEMORY_BYTES", 256 << 20)
    grammars = S.StructuredOutputs(tokenizer, 49152, [tokenizer.eos_token_id], in_processes=True)
    grammars.start()
    try:
        wide = {"type": "object", "properties": {f"o{i}": {
            "type": "object", "properties": {f"p{j}": {"type": "integer"} for j in range(50)},
            "required": [f"p{j}" for j in range(50)]} for i in range(20)}, "required": [f"o{i}" for i in range(20)]}
        with pytest.raises(RequestError, match=r"response_format does not compile: compiling it needs more than "
                                               r"0.25 GiB of memory \(the limit for one constraint\)"):
            grammars.compile(StructuredOutputsParams(json=json.dumps(wide), where="response_format"))
        assert grammars.compile(StructuredOutputsParams(json=json.dumps(PERSON))).grammar_id >= 0
    finally:
        grammars.close()


def test_a_compile_whose_process_dies_is_refused_and_the_next_compiles(tokenizer, monkeypatch):
    """A constraint whose compile process is killed (the kernel's OOM killer) is refused saying so; the compiles
    after it run. (Under the default memory limit: under a low one, glibc's malloc arenas, which a busy host's
    threads multiply, can end the slow compile with the memory error first.)"""
    import threading

    from dispatcher.engine import grammar_process as GP
    from dispatcher.engine import structured as S

    taken, answer = threading.Event(), GP.CompileProcess._answer

    def answer_and_tell(self, deadline, starting=False, taking=False):
        reply = answer(self, deadline, starting, taking)
        if taking:  # (killed before this, the job would go to a new process: no verdict on the constraint)
            taken.set()
        return reply

    monkeypatch.setattr(GP.CompileProcess, "_answer", answer_and_tell)
    grammars = S.StructuredOutputs(tokenizer, 49152, [tokenizer.eos_token_id], in_processes=True)
    grammars.start()
    try:
        victim = grammars.compile_future(StructuredOutputsParams(json=_slow_schema()))
        assert taken.wait(30)
        busy = [p.pid for p in grammars._all_processes if p.pid is not None]
        for pid in busy:  # (the idle one too: its next compile starts another)
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(RequestError, match=r"does not compile: its compile process died \(signal SIGKILL\)"):
            grammars.result(StructuredOutputsParams(json=_slow_schema()), victim)
        for i in range(2 * S.COMPILE_WORKERS):
            assert grammars.compile(StructuredOutputsParams(regex=f"alive{i}+")).grammar_id >= 0
    finally:
        grammars.close()
    assert not any(map(_alive, busy))


def test_a_constraint_sent_while_the_compile_processes_start_waits_for_them_not_for_its_timeout(tokenizer,
                                                                                                  monkeypatch):
    """The serving engine starts its compile processes once it is ready (seconds of CPU it does not spend beside its
    worker's load): a constraint arriving meanwhile is compiled once they are up, its timeout counted from then."""
    from dispatcher.engine import grammar_process as GP
    from dispatcher.engine import structured as S

    real = GP.CompileProcess.start

    def slow_start(self, deadline):
        time.sleep(1.0)  # (twice the timeout below)
        real(self, deadline)

    monkeypatch.setattr(GP.CompileProcess, "start", slow_start)
    grammars = S.StructuredOutputs(tokenizer, 49152, [tokenizer.eos_token_id], timeout_s=0.5, in_processes=True)
    grammars.start()
    try:
        grammars.start_compilers()
        t0 = time.monotonic()
        assert grammars.compile(StructuredOutputsParams(json=json.dumps(PERSON))).grammar_id >= 0
        assert time.monotonic() - t0 >= 1.0  # (it waited for them, and was not refused at 0.5 s)
    finally:
        grammars.close()


def test_a_compile_process_that_cannot_start_is_a_400_saying_so_and_the_slot_recovers(tokenizer, monkeypatch):
    """A fork that fails (out of memory, a fork server gone) is the request's 400 naming a server error, not a
    request left without an answer or a slot lost for good (a review found both); the next compile starts its
    process again. A failure of any other kind is a 400 too."""
    from dispatcher.engine import grammar_process as GP
    from dispatcher.engine import structured as S

    def no_fork():
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(GP, "start_fork_server", no_fork)
    grammars = S.StructuredOutputs(tokenizer, 49152, [tokenizer.eos_token_id], timeout_s=5, in_processes=True)
    grammars.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(RequestError, match=r"structured_outputs.regex does not compile: no compile process could "
                                               r"start \(OSError: \[Errno 12\] Cannot allocate memory\); a server "
                                               r"error"):
            grammars.compile(StructuredOutputsParams(regex="a+"))
        assert time.monotonic() - t0 < 3  # (not the start-up wait)
        monkeypatch.undo()
        for i in range(2 * S.COMPILE_WORKERS):  # (every slot starts its process again)
            assert grammars.compile(StructuredOutputsParams(regex=f"b{i}+")).grammar_id >= 0
        monkeypatch.setattr(GP.CompileProcess, "compile", lambda *a: (_ for _ in ()).throw(BrokenPipeError(32, "x")))
        with pytest.raises(RequestError, match="structured_outputs.regex could not be compiled: BrokenPipeError"):
            grammars.compile(StructuredOutputsParams(regex="c+"))
    finally:
        grammars.close()


def test_a_compile_process_whose_memory_grew_retires_after_its_answer(grammars):
    """Memory a compile leaves mapped would leave the next compile less room under the process's limit: past
    ``retire_bytes`` of growth the process answers, then exits, and the next compile runs in a fresh one (the engine
    closes it on that answer, so its exit is never taken for a constraint's failure)."""
    from dispatcher.engine import grammar_process as GP
    from dispatcher.engine.grammar_process import CompileProcess

    process = CompileProcess(grammars.tokenizer_info_json, 1, retire_bytes=0)  # (retire after every compile)
    try:
        pids = []
        for i in range(3):
            assert process.compile("regex", f"r{i}+", True, time.monotonic() + 30)
            pids.append(process.pid)
        assert pids == [None] * 3  # (closed after each answer)
        keep = CompileProcess(grammars.tokenizer_info_json, 1)  # (the default: 1 GiB of growth)
        keep.compile("regex", "a+", True, time.monotonic() + 30)
        first = keep.pid
        keep.compile("regex", "b+", True, time.monotonic() + 30)
        assert first is not None and keep.pid == first
        # (a compile yields the cores to serving: its process is niced, this one is not)
        niced = min(19, os.getpriority(os.PRIO_PROCESS, 0) + GP.COMPILE_NICENESS)
        assert os.getpriority(os.PRIO_PROCESS, first) == niced
        if hasattr(os, "SCHED_IDLE"):
            assert os.sched_getscheduler(first) == os.SCHED_IDLE
        keep.close()
    finally:
        process.close()


def test_an_offline_script_without_a_main_guard_compiles_its_constraints(tmp_path):
    """The offline engine compiles in threads of its own process: a user's script need not guard its main module
    (a compile process would import it again, running the script twice, and fail)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "unguarded.py"
    script.write_text('print("script body")\n'
                      "from dispatcher import LLM, SamplingParams\n"
                      "from scheduler.structured import StructuredOutputsParams\n"
                      "params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams("
                      "choice=['red', 'blue']))\n"
                      "out = LLM(max_model_len=256).generate(['Name a color.'], params)\n"
                      "print('answer', out[0].outputs[0].text)\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("script body") == 1 and re.search(r"^answer (red|blue)$", proc.stdout, re.M), proc.stdout


def test_grammars_sent_with_a_failed_step_are_sent_again_and_still_dropped(grammars, tokenizer, monkeypatch):
    """A step can fail after the worker read its grammars (a kernel error) or before: the engine sends them again
    with their next use, and keeps them in its account, so that the worker, which may hold them, is told to drop
    them once idle. Six define-fail-free cycles leave the worker with no more than the idle limit."""
    from types import SimpleNamespace

    import torch

    from dispatcher.engine import structured as S
    from dispatcher.messages import NewRequest, SamplingSpec, pack
    from dispatcher.runtime.grammar import WorkerGrammars

    monkeypatch.setattr(S, "WORKER_IDLE_GRAMMARS", 2)
    engine = S.StructuredOutputs(tokenizer, 49152, [tokenizer.eos_token_id])
    engine.start()
    worker = WorkerGrammars(49152, torch.device("cpu"), 4)

    def step(new=None, freed=(), read=True):
        reqs, slots = [], []
        if new:
            engine.add(new[0], engine.compile(new[1]))
            reqs, slots = [SimpleNamespace(request_id=new[0])], [0]
        out = SimpleNamespace(new_requests=reqs, slots=np.asarray(slots, np.int64),
                              freed_slots=np.asarray(freed, np.int64))
        gids, defs, drops = engine.for_step(out)
        msg = SimpleNamespace(grammars=defs, dropped_grammars=drops, freed_slots=pack(list(freed)),
                              new_requests=[NewRequest(0, pack([1, 2, 3]), 3, SamplingSpec(0.0, 0, 1.0, 0, -1), 0, g)
                                            for g in gids])
        if read:
            worker.admit(msg)
        return msg

    for k in range(6):
        msg = step((f"r{k}", StructuredOutputsParams(regex=f"a{{{k + 1}}}")))
        engine.remove(f"r{k}")  # (EngineCore.fail_step ends the request)
        engine.step_failed(msg)
        step(freed=(0,))  # (its slot comes back freed)
    assert len(worker.compiled) <= S.WORKER_IDLE_GRAMMARS, sorted(worker.compiled)
    # A step that failed before the worker read it: the grammar goes again with the next use.
    so = StructuredOutputsParams(regex="b{3}")
    lost = step(("x", so), read=False)
    assert [d.grammar_id for d in lost.grammars] == [engine.compile(so).grammar_id]
    engine.remove("x")
    engine.step_failed(lost)
    step(freed=(0,))
    again = step(("y", so))
    assert [d.grammar_id for d in again.grammars] == [d.grammar_id for d in lost.grammars]
    assert worker.matchers[0] is not None
    engine.close()


def test_without_a_tokenizer_structured_requests_are_refused():
    from dispatcher.engine.structured import StructuredOutputs

    with pytest.raises(RequestError, match="tokenizer"):
        StructuredOutputs(None, 512, [2]).compile(StructuredOutputsParams(choice=("a",)))


def test_a_checkpoint_without_a_tokenizer_runs_on_token_ids_and_refuses_structured_requests(tmp_path):
    """An engine on a checkpoint without tokenizer.json generates from token ids as before; only a structured
    request is refused, naming its field and the missing tokenizer."""
    import torch

    from dispatcher.engine.engine_core import EngineArgs, EngineCore
    from dispatcher.plan.config import resolve
    from models.config import preset
    from models.loader import save_checkpoint
    from models.transformer import build_model

    save_checkpoint(build_model(preset("tiny-dense"), "cpu", torch.float32, seed=1), str(tmp_path), "llama")
    cfg = resolve({}, None, platform="sm100", max_num_seqs=4, max_num_batched_tokens=64)
    core = EngineCore(cfg, EngineArgs(str(tmp_path), device="cpu", num_kv_blocks=32, block_size=8,
                                      max_model_len=64), capture=False)
    assert [len(t) for t in core.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))] == [3]
    with pytest.raises(RequestError, match="response_format: .*tokenizer.json"):
        core.add_request([5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(
            json_object=True, where="response_format")))
    core.close()


def test_tool_call_grammars_take_each_parsers_format(grammars, tokenizer):
    """A required call's structural tag accepts the parser's format for any tool (several with parallel calls) and
    nothing else; the parser reads back what the grammar let through. A named call opens in the prompt with the
    parser's text for it: the output is its arguments, under their schema."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(grammars.tokenizer_info_json)
    matcher = lambda so: xgr.GrammarMatcher(  # noqa: E731 (the grammar as the worker reads it)
        xgr.CompiledGrammar.deserialize_json(grammars.compile(so).serialized, info))
    tools = [WEATHER, {"type": "function", "function": {"name": "get_time"}}]
    for parser, text in [(PARSERS["hermes"], '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                             '</tool_call>'),
                         (PARSERS["llama3_json"], '{"name": "get_weather", "parameters": {"city": "Oslo"}}')]:
        for parallel in (False, True):
            so = StructuredOutputsParams(structural_tag=parser.structural_tag(tools, parallel), where="tools")
            so.validate()
            m = matcher(so)
            assert m.accept_string(text), (parser.name, parallel)
            assert m.accept_token(tokenizer.eos_token_id) and m.is_terminated()
            content, calls = parser.parse(text)
            assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
                ("get_weather", {"city": "Oslo"})]
            assert not matcher(so).accept_string("Sure, " + text)
            assert not matcher(so).accept_string(text.replace("get_weather", "get_wetter"))
        opening = parser.opening("get_weather")
        assert text.startswith(opening) and text.endswith(parser.call_end)
        arguments = text[len(opening):-len(parser.call_end)]
        named = StructuredOutputsParams(json=json.dumps(parameters_schema(WEATHER)), where="tools")
        m = matcher(named)
        assert m.accept_string(arguments) and m.accept_token(tokenizer.eos_token_id) and m.is_terminated()
        assert not matcher(named).accept_string(arguments + parser.call_end)  # (the arguments end the output)
        assert not matcher(named).accept_string('{"town": "Oslo"}')
        assert NamedCall("get_weather").parse(arguments)[1][0].arguments == arguments


# ---------------------------------------------------------------------------------------------------------------
# the engine and the worker: a constrained step (a stand-in grammar on tiny-dense)
# ---------------------------------------------------------------------------------------------------------------


FIRST = 100
"""The stand-in grammar's first token."""


class Successor:
    """A stand-in for xgrammar (its matcher and batch calls, as ``WorkerGrammars`` uses them): a constrained
    request's first token is ``FIRST``, each next one its last token + 1 (mod the vocabulary). Its mask depends on
    the previous step's token, as a real grammar's does: a bitmask filled before that token is accepted allows the
    wrong token."""

    class TokenizerInfo:
        stop_token_ids = ()

        @classmethod
        def deserialize_json(cls, text):
            return cls()

    class CompiledGrammar:
        @staticmethod
        def deserialize_json(text, info):
            return text

    class GrammarMatcher:
        def __init__(self, compiled):
            self.next = FIRST

        def is_terminated(self):
            return False

        def accept_token(self, token):
            ok, self.next = token == self.next, (token + 1) % 512
            return ok

    class BatchGrammarMatcher:
        def __init__(self, threads):
            pass

        @staticmethod
        def batch_accept_token(matchers, tokens):
            return [m.accept_token(t) for m, t in zip(matchers, tokens)]

        def batch_fill_next_token_bitmask(self, matchers, out, rows):
            words = out.numpy().view(np.uint32)
            for m, row in zip(matchers, rows):
                words[row] = 0
                words[row, m.next // 32] = 1 << (m.next % 32)


class StandInGrammars:
    """The engine's side of the stand-in: every constraint compiles to grammar 0."""

    def __new__(cls, vocab: int):
        from dispatcher.engine.structured import Compiled, StructuredOutputs

        engine = StructuredOutputs(None, vocab, [])
        engine.tokenizer_info_json = "stand-in"
        engine.compile = lambda params: Compiled(0, "successor")
        return engine


def use_stand_in(core) -> None:
    """``core`` (and its in-process worker) on the ``Successor`` stand-in."""
    from dispatcher.runtime.grammar import WorkerGrammars

    core.structured = StandInGrammars(core.model_config.vocab_size)
    worker = core.worker
    worker.grammars = WorkerGrammars(core.model_config.vocab_size, worker.device, worker.wcfg.max_num_seqs + 1)
    worker.grammars.backend(Successor)


def constrained_engine(spec=None, overlap=True, device="cpu", fuse_decode_steps=True, step_trace=None):
    """tiny-dense with the ``Successor`` stand-in for xgrammar; its worker set up as a server with a tokenizer
    sets it up (structured outputs on: the fused decode steps have their constrained pairs)."""

    import dataclasses

    from dispatcher.engine.engine_core import EngineArgs, EngineCore
    from dispatcher.plan.config import resolve
    from dispatcher.runtime.decode_step import FusedDecode
    from models.config import preset

    cfg = resolve({}, spec, platform="sm100", max_num_seqs=8, max_num_batched_tokens=64)
    core = EngineCore(cfg, EngineArgs(preset("tiny-dense"), device=device, num_kv_blocks=400, block_size=8,
                                      max_model_len=128, async_scheduling=overlap,
                                      fuse_decode_steps=fuse_decode_steps, step_trace=step_trace))
    use_stand_in(core)
    worker = core.worker
    worker.wcfg = dataclasses.replace(worker.wcfg, structured_outputs=True)
    if worker.fused is not None:
        worker.fused = FusedDecode(worker, core.plan)
        worker.fused.capture(progress=False)
    return core


def run_mixed(core, prompts, constrained_every=2, temperature=0.0, **more):
    """Every ``constrained_every``-th request under the stand-in grammar; ``more``: SamplingParams fields for all."""
    so = StructuredOutputsParams(choice=("stand-in",))
    ids = []
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=temperature, seed=i,
                                structured_outputs=so if i % constrained_every == 0 else None, **more)
        ids.append(core.add_request(p, params))
    out = {rid: [] for rid in ids}
    for step in core.run():
        for o in step:
            out[o.request_id].extend(o.new_token_ids)
    return [out[rid] for rid in ids]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}], ids=["no-sd", "ngram"])
def test_constrained_requests_produce_only_what_their_grammar_allows(spec):
    """Mixed batches (every other request constrained), greedy and sampled, with and without speculative decoding
    and asynchronous scheduling: each constrained output is its successor chain exactly (so each step's bitmask
    came after the previous step's token); with ngram drafts the constrained requests verified none while the
    others did; the unconstrained outputs equal an unconstrained engine's."""
    from test_pipeline import prompts

    p = [q + q[-4:] * 3 for q in prompts(6, 3)]  # (repeats: n-gram lookup finds drafts)
    results = []
    for overlap in (True, False):
        core = constrained_engine(spec, overlap)
        for temperature in (0.0, 0.8):
            outs = run_mixed(core, p, temperature=temperature)
            for i, (prompt, out) in enumerate(zip(p, outs)):
                if i % 2 == 0:
                    assert out == [(FIRST + k) % 512 for k in range(12)], (i, out)
            results.append(outs)
        if spec is not None:
            assert core.stats.num_draft_tokens > 0  # (the unconstrained ones drafted)
    assert results[0] == results[2] and results[1] == results[3]  # overlapped = synchronous
    plain = constrained_engine(spec)
    free = run_mixed(plain, p, constrained_every=10**6)
    assert [o for i, o in enumerate(results[0]) if i % 2] == [o for i, o in enumerate(free) if i % 2]


def test_the_step_trace_counts_each_steps_constrained_rows(tmp_path):
    """A reader of ``--step-trace`` sees which steps waited for a grammar's bitmask: ``constrained``, the rows
    masked, and ``bitmask_wait_ms``, on exactly the steps that sample a constrained request (two of four requests
    here), absent elsewhere."""
    import json

    from test_pipeline import prompts

    trace = tmp_path / "trace.jsonl"
    core = constrained_engine(overlap=False, step_trace=str(trace))
    run_mixed(core, [q[:10] for q in prompts(4, 3)])
    core.trace.close()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(records) >= 12
    assert all(r.get("constrained") == 2 for r in records), [(r["kind"], r.get("constrained")) for r in records]
    assert all(r["bitmask_wait_ms"] > 0 for r in records)  # (on the CPU the device is the host: it waits for the fill)
    core = constrained_engine(overlap=False, step_trace=str(tmp_path / "free.jsonl"))
    for q in prompts(4, 3):
        core.add_request(q[:10], SamplingParams(max_tokens=12, ignore_eos=True))
    for _ in core.run():
        pass
    core.trace.close()
    records = [json.loads(line) for line in (tmp_path / "free.jsonl").read_text().splitlines()]
    assert len(records) >= 12 and not any("constrained" in r or "bitmask_wait_ms" in r for r in records)


def test_constrained_requests_verify_no_drafts():
    core = constrained_engine({"method": "ngram", "num_speculative_tokens": 3})
    so = StructuredOutputsParams(choice=("x",))
    core.add_request([5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True, structured_outputs=so))
    seen = 0
    while core.has_unfinished():
        step = core.schedule()
        assert not step.out.num_drafts.any()
        seen += int(step.message.constrained)
        core.update(step, core.execute(step))
    assert seen == 8 and core.stats.num_draft_tokens == 0


def test_constrained_decode_steps_fuse_once_their_graphs_are_captured():
    constrained_decodes_fuse("cpu")


def constrained_decodes_fuse(device: str) -> None:
    """Without a drafter a constrained uniform decode runs as two graphs (``FusedDecode.constrained``: the forward,
    then, the engine's bitmask uploaded, the masked sampling and the rest), captured on demand: the first such step
    of a size runs op by op and asks for them, the gap after it captures them, the next ones fuse; the outputs
    follow the grammar, all constrained or one among unconstrained, greedy or sampled, and equal an engine's that
    never fuses; unconstrained steps fuse as always."""
    from dispatcher.plan.dispatch import MODE_FULL, UNIFORM_DECODE
    from test_pipeline import prompts

    so = StructuredOutputsParams(choice=("stand-in",))
    p = [q[:10] for q in prompts(4, 3)]  # (one prefill step)

    def run(core, constrained: list[bool], temperature: float) -> tuple[list[list[int]], list[tuple[bool, bool]]]:
        ids = [core.add_request(q, SamplingParams(max_tokens=8, ignore_eos=True, temperature=temperature, seed=i,
                                                  structured_outputs=so if c else None))
               for i, (q, c) in enumerate(zip(p, constrained))]
        out, decodes = {rid: [] for rid in ids}, []
        while core.has_unfinished():
            step = core.schedule()
            core.submit(step)
            result = core.worker.collect(step.pending)
            for o in core.update(step, core.finish(step, result)):
                out[o.request_id].extend(o.new_token_ids)
            target = step.descs.target
            if target.kind == UNIFORM_DECODE and target.mode == MODE_FULL:
                decodes.append((step.message.constrained, result.fused))
        return [out[rid] for rid in ids], decodes

    core = constrained_engine(overlap=False, device=device)
    plain = constrained_engine(overlap=False, device=device, fuse_decode_steps=False)
    assert core.worker.fused is not None and core.worker.fused.constrained
    first = True
    for temperature in (0.0, 0.8):
        for constrained in ([True] * 4, [False, True, False, False]):
            outs, decodes = run(core, constrained, temperature)
            assert outs == run(plain, constrained, temperature)[0]
            for q, c, out in zip(p, constrained, outs):
                if c:
                    assert out == [(FIRST + k) % 512 for k in range(8)]
            assert len(decodes) >= 5 and all(c for c, _ in decodes), decodes
            fused = [f for _, f in decodes]
            assert fused == ([False] + [True] * (len(fused) - 1) if first else [True] * len(fused)), decodes
            first = False
    assert core.worker.fused.constrained_captured and not core.worker.fused.constrained_demand
    fused_before = core.stats.fused_steps
    _, decodes = run(core, [False] * 4, 0.0)
    assert decodes and all(fused for _, fused in decodes) and core.stats.fused_steps > fused_before


def test_a_failed_step_drops_its_requests_grammars():
    """A step the worker failed ends its requests (``EngineCore.fail_step``: the scheduler's, with the registered
    prefix blocks taken back) and their matchers with them; the engine runs on with the next request."""
    core = constrained_engine(overlap=False)
    so = StructuredOutputsParams(choice=("stand-in",))
    rid = core.add_request(list(range(3, 23)), SamplingParams(max_tokens=4, ignore_eos=True, structured_outputs=so))
    step = core.schedule()
    assert core.fail_step(step) == [rid] and not core.structured.requests and not core.has_unfinished()
    assert core.scheduler.kv.num_free == core.scheduler.config.num_kv_blocks
    assert run_mixed(core, [[7, 8, 9]], constrained_every=1)[0][:3] == [FIRST, FIRST + 1, FIRST + 2]


def test_a_failed_first_chunk_ends_the_choices_held_behind_it():
    """n > 1: the other choices wait for the first one's prompt; a step that fails on its first chunk (a 100-token
    prompt over 64-token steps) ends them too, rather than leaving them held with nothing to schedule them."""
    core = constrained_engine(overlap=False)
    so = StructuredOutputsParams(choice=("stand-in",))
    rid = core.add_request(list(range(3, 103)), SamplingParams(max_tokens=4, n=2, temperature=1.0,
                                                               structured_outputs=so))
    step = core.schedule()
    ended = core.fail_step(step)
    assert len(ended) == 2 and all(rid in e for e in ended)
    assert not core.has_unfinished() and core.schedule() is None
    assert run_mixed(core, [[7, 8, 9]], constrained_every=1)[0][:3] == [FIRST, FIRST + 1, FIRST + 2]


def test_a_new_grammar_is_read_ahead_while_the_others_run(monkeypatch):
    """Reading a grammar takes the worker time (xgrammar's ``deserialize_json``: 19 ms for a 0.36 MB JSON schema,
    seconds for a hostile one). While another request runs, a new grammar goes ahead with the next step, the worker
    reads it in a thread of its own, and its request waits in the engine until a step result says it is read: the
    running request's steps go on meanwhile without waiting for it. With nothing running, the step that admits the
    request reads it (it stalls no one)."""
    from dispatcher.engine.structured import Compiled

    core = constrained_engine(overlap=False)
    reading, release = threading.Event(), threading.Event()

    def slow_read(text, info):
        reading.set()
        assert release.wait(10)
        return text

    monkeypatch.setattr(Successor.CompiledGrammar, "deserialize_json", staticmethod(slow_read))
    so = StructuredOutputsParams(choice=("stand-in",))
    out: dict[str, list[int]] = {}
    carried, admitted = [], []

    def step() -> float:
        s = core.schedule()
        t0 = time.perf_counter()
        core.submit(s)
        result = core.worker.collect(s.pending)
        wall = time.perf_counter() - t0
        carried.extend(d.grammar_id for d in s.message.grammars)
        admitted.extend(r.grammar_id for r in s.message.new_requests if r.grammar_id >= 0)
        for o in core.update(s, core.finish(s, result)):
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return wall

    plain = core.add_request([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        step()
    rid = core.add_request([7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True, structured_outputs=so))
    assert 0 in core._parked and core.num_parked == 1 and not admitted
    before = len(out[plain])
    walls = [step() for _ in range(5)]
    assert reading.is_set() and carried == [0] and not admitted  # (sent ahead, read off the step's path)
    assert len(out[plain]) == before + 5 and max(walls) < 2.0, walls
    release.set()
    while core.has_unfinished():
        step()
    assert out[rid] == [FIRST, FIRST + 1, FIRST + 2, FIRST + 3] and len(out[plain]) == 100
    assert carried == [0] and admitted == [0]
    # Nothing running now: a new grammar goes with the step that admits its request.
    core.structured.compile = lambda params: Compiled(1, "successor")
    rid = core.add_request([9, 10], SamplingParams(max_tokens=2, ignore_eos=True, structured_outputs=so))
    assert not core._parked
    while core.has_unfinished():
        step()
    assert out[rid] == [FIRST, FIRST + 1] and carried == [0, 1] and admitted == [0, 1]


def test_choices_of_a_request_with_a_new_grammar_run_together():
    """n = 3 with a grammar the worker has not got, on an idle engine: the step that admits the first choice reads
    the grammar in line and computes the prompt, which releases the other two; they wait for nothing more (the
    worker has the grammar from that step on) and run beside the first, not after it."""
    core = constrained_engine(overlap=False)
    so = StructuredOutputsParams(choice=("stand-in",))
    requests = core.make_requests(list(range(3, 23)), SamplingParams(max_tokens=20, n=3, temperature=1.0,
                                                                     ignore_eos=True, structured_outputs=so), "r")
    core.queue_all(requests, core.structured.compile(so))
    admitted_at, first_done_at = {}, None
    for step_no in range(1, 100):
        if not core.has_unfinished():
            break
        step = core.schedule()
        admitted_at.update((r.request_id, step_no) for r in step.out.new_requests)
        for o in core.update(step, core.execute(step)):
            if o.finished and o.request_id == requests[0].request_id:
                first_done_at = step_no
    assert max(admitted_at.values()) <= 2 < first_done_at, (admitted_at, first_done_at)


def test_a_request_waiting_for_a_grammar_its_step_reads_in_line_waits_no_more():
    """A full engine (two slots): R_a (grammar 0) waits in the scheduler; R_c (grammar 0) arrives while another
    request runs and waits in the engine for the grammar to be read ahead. The step that would send it ahead admits
    R_a, so the grammar goes in line with R_a and the worker reads it there: R_c joins the scheduler at once."""
    import dataclasses

    from dispatcher.engine.engine_core import EngineArgs, EngineCore
    from dispatcher.plan.config import resolve
    from models.config import preset

    cfg = resolve({}, None, platform="sm100", max_num_seqs=2, max_num_batched_tokens=64)
    core = EngineCore(cfg, EngineArgs(preset("tiny-dense"), device="cpu", num_kv_blocks=400, block_size=8,
                                      max_model_len=128, async_scheduling=False))
    use_stand_in(core)
    core.worker.wcfg = dataclasses.replace(core.worker.wcfg, structured_outputs=True)
    so = StructuredOutputsParams(choice=("stand-in",))
    short = core.add_request([3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    core.add_request([5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True))
    core.add_request([7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True, structured_outputs=so))
    assert not core._parked  # (nothing ran yet)
    done = set()
    while short not in done:
        done |= {o.request_id for o in core.step() if o.finished}
    late = core.add_request([9, 9, 9], SamplingParams(max_tokens=3, ignore_eos=True, structured_outputs=so))
    assert 0 in core._parked
    step = core.schedule()
    assert [r.grammar_id for r in step.message.new_requests] == [0] and not core._parked
    assert [d.grammar_id for d in step.message.grammars] == [0]
    out = [t for o in core.update(step, core.execute(step)) for t in o.new_token_ids if o.request_id == late]
    while core.has_unfinished():
        out += [t for o in core.step() for t in o.new_token_ids if o.request_id == late]
    assert out == [FIRST, FIRST + 1, FIRST + 2]


def test_a_failed_step_does_not_lose_the_news_that_a_grammar_was_read(monkeypatch):
    """The worker says a grammar sent ahead is read in the next step's result; when that step fails, the news is
    lost with it: the requests waiting for the grammar join the scheduler anyway (the worker waits for a reading
    still under way when it sets them up), rather than waiting while anything else runs."""
    from dispatcher.runtime.worker import InjectedFault

    release = threading.Event()
    monkeypatch.setattr(Successor.CompiledGrammar, "deserialize_json",
                        staticmethod(lambda text, info: (release.wait(10), text)[1]))
    core = constrained_engine(overlap=True)
    so = StructuredOutputsParams(choice=("stand-in",))
    plain = core.add_request([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(2):
        core.step()
    rid = core.add_request([7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True, structured_outputs=so))
    s1 = core.schedule()
    assert [d.grammar_id for d in s1.message.grammars] == [0]  # (ahead)
    core.update(s1, core.execute(s1))
    release.set()
    core.worker.grammars._reading[0].result()  # (read now; the next submit takes the news)
    s2 = core.schedule()
    core.worker.fail_steps = frozenset({s2.out.step_id})
    with pytest.raises(InjectedFault):
        core.submit(s2)
    other = core.add_request([9, 9, 9], SamplingParams(max_tokens=60, ignore_eos=True))
    s3 = core.schedule(1)
    core.submit(s3)
    failed = core.fail_step(s2, [s3.out])  # (what the service does with the worker's error for s2)
    assert plain in failed and other not in failed and not core._parked
    out = [t for o in core.update(s3, core.wait(s3)) for t in o.new_token_ids if o.request_id == rid]
    for _ in range(6):
        out += [t for o in core.step() for t in o.new_token_ids if o.request_id == rid]
    assert out == [FIRST, FIRST + 1, FIRST + 2, FIRST + 3]  # (while "other" still runs)
    assert core.has_unfinished()


def test_held_choices_take_the_first_ones_grammar_without_compiling_on_the_loop():
    """The serving engine compiles a request's grammar off the step loop; its other choices, queued from
    ``schedule`` once the first one's prompt is computed, take that grammar: no compile (nor a wait for a compile
    thread that other requests hold) inside a step."""
    core = constrained_engine(overlap=False)
    so = StructuredOutputsParams(choice=("stand-in",))
    grammar = core.structured.compile(so)

    def no_compile(_):
        raise AssertionError("compiled on the step loop")

    core.structured.compile = no_compile
    requests = core.make_requests(list(range(3, 23)), SamplingParams(max_tokens=3, n=3, temperature=1.0,
                                                                     ignore_eos=True, structured_outputs=so), "r")
    core.queue_all(requests, grammar)
    done = {}
    while core.has_unfinished():
        step = core.schedule()
        for o in core.update(step, core.finish(step, core.worker.collect(core.worker.submit(step.message)))):
            done.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert sorted(done.values()) == [[FIRST, FIRST + 1, FIRST + 2]] * 3


def test_identical_constrained_requests_back_to_back_with_the_prefix_cache():
    """The second of two identical constrained requests finds the prompt in the prefix cache and computes only its
    last tokens; its grammar starts from the start (it sees generated tokens only), so its output is the first
    one's, whole and valid: real xgrammar matchers on tiny-dense given the default model's vocabulary."""
    import dataclasses

    from dispatcher.engine.engine_core import EngineArgs, EngineCore
    from dispatcher.plan.config import resolve
    from models.config import preset
    from models.default_model import default_model_path
    from models.text import load_tokenizer

    tok = load_tokenizer(default_model_path())
    cfg = resolve({}, None, platform="sm100", max_num_seqs=8, max_num_batched_tokens=64)
    core = EngineCore(cfg, EngineArgs(dataclasses.replace(preset("tiny-dense"), vocab_size=49152), device="cpu",
                                      num_kv_blocks=64, block_size=8, max_model_len=128,
                                      eos_token_ids=(tok.eos_token_id,), tokenizer=default_model_path()))
    prompt = tok.encode("Pick one of the colours, then write an e-mail address for it: red, green or blue? Only one.")
    email = r"[a-z]{2,5}@[a-z]{2,5}\.(com|org)"
    checks = [(StructuredOutputsParams(choice=("red", "green", "blue sky")), "red|green|blue sky"),
              (StructuredOutputsParams(regex=email), email)]
    for so, pattern in checks:
        texts = []
        for _ in range(2):
            rid = core.add_request(prompt, SamplingParams(max_tokens=24, structured_outputs=so))
            tokens, cached, reason = [], None, None
            for step in core.run():
                for o in step:
                    assert o.request_id == rid
                    tokens += o.new_token_ids
                    cached = o.num_cached_tokens if cached is None else cached
                    reason = o.finish_reason or reason
            assert reason is not None and reason.value == "stop" and tokens[-1] == tok.eos_token_id
            texts.append((tok.decode(tokens[:-1]), cached))
        (first, _), (second, cached) = texts
        assert re.fullmatch(pattern, first) and second == first, texts
        assert cached == (len(prompt) - 1) // 8 * 8 > 8, texts  # (its full blocks but the last token's)
    assert not core.structured.requests
    core.close()


def test_constrained_outputs_stay_whole_through_preemption_and_parallel_sampling():
    """More constrained requests than the KV cache holds at once, n = 3 each, sampled: requests are preempted mid-
    output and come back with their output so far (the worker's new matcher takes it again, and a token it sampled
    for the slot before is never taken), children share their parent's grammar; every output is whole and valid.
    Real xgrammar matchers on tiny-dense given the default model's vocabulary."""
    import dataclasses

    from dispatcher.engine.engine_core import EngineArgs, EngineCore
    from dispatcher.plan.config import resolve
    from models.config import preset
    from models.default_model import default_model_path
    from models.text import load_tokenizer

    tok = load_tokenizer(default_model_path())
    cfg = resolve({}, None, platform="sm100", max_num_seqs=8, max_num_batched_tokens=64)
    core = EngineCore(cfg, EngineArgs(dataclasses.replace(preset("tiny-dense"), vocab_size=49152), device="cpu",
                                      num_kv_blocks=12, block_size=8, max_model_len=80,
                                      eos_token_ids=(tok.eos_token_id,), tokenizer=default_model_path()))
    email = r"[a-z]{8,12}@[a-z]{8,12}\.(com|org)"
    so = StructuredOutputsParams(regex=email)
    ids = [core.add_request(tok.encode(f"Write an e-mail address number {i}, nothing else."),
                            SamplingParams(max_tokens=40, temperature=1.0, seed=i, n=3, structured_outputs=so))
           for i in range(3)]
    tokens: dict[str, list[int]] = {}
    for step in core.run():
        for o in step:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert len(tokens) == 9 and len(ids) == 3
    for rid, out in tokens.items():
        assert out[-1] == tok.eos_token_id and re.fullmatch(email, tok.decode(out[:-1])), (rid, tok.decode(out))
    assert core.scheduler.stats.preemptions > 0
    assert not core.structured.requests
    core.close()


def test_a_masked_token_is_never_sampled_even_at_an_extreme_draw():
    """Seed 272 at position 0 draws the largest 24-bit pattern for token 10900: before ``unit_interval`` kept u
    below 1, its Gumbel noise was infinite, -inf - -inf made its masked logit NaN, and argmax sampled it (found by
    the schema test: a JSON object broke after 70 newlines). Unmasked, that token won every such draw."""
    import torch

    from models.sampling import RowParams, sample_tokens, unit_interval

    assert unit_interval(torch.tensor([2**24 - 1])).item() < 1.0
    logits = torch.full((1, 16384), float("-inf"))
    logits[0, [5, 7]] = 0.0
    params = RowParams(torch.tensor([1.0]), None, None, torch.tensor([272]))
    assert sample_tokens(logits, params, torch.tensor([0])).item() in (5, 7)


# ---------------------------------------------------------------------------------------------------------------
# tool-call parsers
# ---------------------------------------------------------------------------------------------------------------


HERMES_OUT = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
LLAMA_OUT = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
             '{"name": "get_time", "parameters": {}}')


@pytest.mark.parametrize("name,text,content", [
    ("hermes", HERMES_OUT, "I will check.\n"),
    ("hermes", HERMES_OUT + "\n\nIt is sunny.\n\nAnything else?", "I will check.\n\n\nIt is sunny.\n\nAnything else?"),
    ("llama3_json", LLAMA_OUT, None)], ids=["hermes", "hermes, text after the calls", "llama3_json"])
def test_parsers_read_calls_whole_and_streamed_alike(name, text, content):
    parser = PARSERS[name]
    got_content, calls = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {})]
    assert len({c.id for c in calls}) == 2
    for size in (1, 3, 17):
        stream = parser.stream()
        text_out, streamed = "", []
        for i in range(0, len(text), size):
            delta, new = stream.feed(text[i:i + size])
            text_out += delta
            streamed += new
            assert "<tool" not in text_out
        tail, more = stream.finish()
        assert (text_out + tail or None) == content
        assert [(c.name, c.arguments) for c in streamed + more] == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("name,text,content,num_calls", [
    ("hermes", HERMES_OUT.removesuffix("{}}\n</tool_call>"), "I will check.\n", 2),
    ("hermes", HERMES_OUT.removesuffix('get_time", "arguments": {}}\n</tool_call>'), "I will check.\n", 1),
    ("hermes", HERMES_OUT.removesuffix('_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
     "I will check.\n", 1),
    ("llama3_json", LLAMA_OUT.removesuffix("{}}"), None, 2),
    ("llama3_json", LLAMA_OUT.removesuffix('me": "get_time", "parameters": {}}'), None, 1)],
    ids=["hermes, in the arguments", "hermes, in the name", "hermes, in the opening tag",
         "llama3_json, in the arguments", "llama3_json, in the name"])
def test_a_call_cut_off_is_the_call_so_far_once_its_name_is_whole(name, text, content, num_calls):
    """An output cut off at max_tokens inside its last call: once the name is whole, that call with its arguments
    as far as written (OpenAI's way with a cut-off call); before (in its opening tag or its name), a call after
    others is dropped: never the parser's markup as the message's text (it was, found in review)."""
    got, calls = PARSERS[name].parse(text, cut_off=True)
    assert got == content
    assert [c.name for c in calls] == ["get_weather", "get_time"][:num_calls]
    assert calls[-1].arguments == ("" if num_calls == 2 else '{"city": "Paris"}')
    # an output that ended otherwise (EOS) keeps an unclosed call that does not parse as content, as vLLM does
    ended = PARSERS[name].parse(text)
    assert [c.name for c in ended[1]] == ["get_weather"] and ended[0].endswith(text[-4:])


def test_an_output_cut_off_with_no_call_before_keeps_its_text():
    """Only a call after a parsed one is dropped when cut off before its name: a plain answer cut off at a '<' keeps
    it, and a first call cut off in its name stays content, as before (found in review)."""
    assert PARSERS["hermes"].parse("Answer: 3 <", cut_off=True) == ("Answer: 3 <", [])
    assert PARSERS["hermes"].parse('Let me see.\n<tool_call>\n{"na', cut_off=True) == (
        'Let me see.\n<tool_call>\n{"na', [])
    assert PARSERS["llama3_json"].parse('{"na', cut_off=True) == ('{"na', [])


@pytest.mark.parametrize("name,text", [("hermes", "Plain answer, no call."), ("hermes", "<tool_call>\nnot json"),
                                       ("llama3_json", "Plain answer {with braces}"),
                                       ("llama3_json", '{"city": "Paris"}'),
                                       ("llama3_json", '{"name": "Alice", "age": 30}')])
def test_text_that_is_not_a_call_stays_content(name, text):
    content, calls = PARSERS[name].parse(text)
    assert calls == [] and content == text


# ---------------------------------------------------------------------------------------------------------------
# the HTTP app (a fake engine that writes a given text)
# ---------------------------------------------------------------------------------------------------------------


def _fake_app_engine(text: str):
    """test_serve_app's fake engine, its chat template taking tools (recorded), its output ``text`` in pieces of 5
    characters, finished by EOS ("stop")."""
    from test_serve_app import FakeEngine, FakeTokenizer

    from dispatcher.engine.output import CompletionOutput, RequestOutput

    class Tokenizer(FakeTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
            self.seen = (messages, kwargs)
            return super().apply_chat_template(messages, add_generation_prompt)

    class Engine(FakeEngine):
        async def _outputs(self, rid, prompt, ids, params):
            pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
            for i, piece in enumerate(pieces):
                done = "stop" if i == len(pieces) - 1 else None
                yield RequestOutput(rid, prompt, ids, [CompletionOutput(0, piece, [2000 + i], done)], done is not None)

    engine = Engine()
    engine.tokenizer = Tokenizer()
    return engine


def test_the_app_passes_tools_to_the_template_and_forces_calls_with_a_grammar():
    from test_serve_app import run, served

    weather = WEATHER
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]

    async def go():
        engine = _fake_app_engine('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
        async with served(engine, tool_call_parser="hermes", enable_auto_tool_choice=True) as c:
            r = await c.post("/v1/chat/completions", json={"messages": history, "tools": [weather],
                                                           "tool_choice": "required", "max_tokens": 50})
            body = await r.json()
            assert r.status == 200, body
            messages, kwargs = engine.tokenizer.seen
            assert kwargs["tools"] == [weather]
            assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}  # (an object)
            assert messages[2]["tool_call_id"] == "c1" and messages[1]["content"] == ""
            (_, _, params), = engine.requests.values()
            so = params.structured_outputs
            assert so.where == "tools" and "<tool_call>" in json.loads(so.structural_tag)["format"]["tags"][0]["begin"]
            choice = body["choices"][0]
            assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
            call, = choice["message"]["tool_calls"]
            assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
            assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}

    run(go())


def test_the_app_streams_tool_calls_in_openais_shape():
    from test_serve_app import run, served, sse

    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'

    async def go():
        async with served(_fake_app_engine(text), tool_call_parser="hermes", enable_auto_tool_choice=True) as c:
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "tools": [WEATHER], "stream": True, "max_tokens": 50})
            events = await sse(r)
            assert events[-1] == "[DONE]"
            deltas = [e["choices"][0]["delta"] for e in events[:-1]]
            content = "".join(d.get("content") or "" for d in deltas)
            calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
            assert content == "Checking.\n" and "<tool" not in content
            assert calls == [{"index": 0, "id": calls[0]["id"], "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
            assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"

    run(go())


def test_the_app_sends_response_format_as_structured_outputs():
    from test_serve_app import run, served

    async def go():
        engine = _fake_app_engine('{"name": "Bo", "age": 3}')
        async with served(engine) as c:
            rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 9, "response_format": rf})
            assert r.status == 200
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "response_format": {"type": "text"}})
            assert r.status == 200
            (_, _, first), (_, _, second) = engine.requests.values()
            assert json.loads(first.structured_outputs.json) == PERSON and second.structured_outputs is None

    run(go())


def test_each_choice_of_n_has_its_own_tool_calls():
    """n = 2 with tools: each choice's text goes through its own parser, whole and streamed (a call split across
    the two choices' interleaved pieces would mix them up)."""
    from test_serve_app import FakeEngine, run, served, sse

    from dispatcher.engine.output import CompletionOutput, RequestOutput

    texts = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
             'Rome then.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>']

    class Engine(FakeEngine):
        async def _outputs(self, rid, prompt, ids, params):
            pieces = [[t[i:i + 5] for i in range(0, len(t), 5)] for t in texts]
            last = max(len(p) for p in pieces) - 1
            for i in range(last + 1):
                outs = [CompletionOutput(c, p[i], [2000 + i], "stop" if i == len(p) - 1 else None)
                        for c, p in enumerate(pieces) if i < len(p)]
                yield RequestOutput(rid, prompt, ids, outs, i == last)

    async def go():
        engine = Engine()
        engine.tokenizer = _fake_app_engine("").tokenizer
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "n": 2, "temperature": 1.0,
                "max_tokens": 50}
        async with served(engine, tool_call_parser="hermes", enable_auto_tool_choice=True) as c:
            r = await c.post("/v1/chat/completions", json=body)
            choices = (await r.json())["choices"]
            assert [ch["message"]["tool_calls"][0]["function"]["arguments"] for ch in choices] == \
                ['{"city": "Oslo"}', '{"city": "Rome"}']
            assert [ch["message"]["content"] for ch in choices] == [None, "Rome then.\n"]
            events = await sse(await c.post("/v1/chat/completions", json={**body, "stream": True}))
            calls = {0: [], 1: []}
            for e in events[:-1]:
                for ch in e["choices"]:
                    calls[ch["index"]] += [tc["function"]["arguments"] for tc in ch["delta"].get("tool_calls", [])]
            assert calls == {0: ['{"city": "Oslo"}'], 1: ['{"city": "Rome"}']}

    run(go())


def test_the_graphs_bitmask_masks_as_xgrammars_kernel():
    """``apply_packed_bitmask`` (the constrained fused step's masking on the torch path, and the reference of its
    sampler's kernel, which masks as it reads) against xgrammar's kernel (the op
    by op path's): the same -inf cells for random packed bitmasks, bit 31 (a negative int32 word) and a vocabulary
    that is not a multiple of 32 included; a row of all bits set is untouched."""
    import xgrammar

    from models.sampling import apply_packed_bitmask

    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    words = -(-vocab // 32)
    logits = torch.randn(5, vocab, generator=gen)
    bits = torch.randint(-2**31, 2**31 - 1, (5, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[3] = -1
    ours, theirs = logits.clone(), logits.clone()
    apply_packed_bitmask(ours, bits)
    xgrammar.apply_token_bitmask_inplace(theirs, bits, vocab_size=vocab)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)) and torch.equal(ours[3], logits[3])
    assert 0 < int(torch.isinf(ours).sum()) < 4 * vocab


def test_schema_keywords_the_compiler_would_ignore_are_refused_not_dropped():
    """xgrammar compiles 'not', an 'allOf' of several schemas and a '$ref' outside the schema as if they were absent
    (any JSON passes there): found by a hostile-input probe, where such schemas got a 200 and output that ignored
    them. Refused, naming the keyword; the same words as property names, data or a one-schema allOf pass."""
    refused = [({"not": {"type": "string"}}, "'not' is not supported"),
               ({"type": "object", "properties": {"a": {"allOf": [{"type": "string"}, {"type": "integer"}]}}},
                "'allOf' of 2 schemas"),
               ({"anyOf": [{"$ref": "http://example.com/s.json"}]}, "only references within the schema")]
    for schema, words in refused:
        with pytest.raises(ValueError, match=words):
            StructuredOutputsParams(json=json.dumps(schema)).validate()
    fine = {"$defs": {"x": {"type": "integer"}}, "type": "object",
            "properties": {"not": {"type": "string"}, "allOf": {"allOf": [{"$ref": "#/$defs/x"}]},
                           "$ref": {"enum": [{"not": 1}, {"$ref": "http://x"}]}, "r": {"$ref": "#"}},
            "default": {"allOf": [1, 2]}}
    StructuredOutputsParams(json=json.dumps(fine)).validate()
