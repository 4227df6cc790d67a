"""The HTTP front end (dispatcher/serve/app.py) against a fake engine: OpenAI's shapes for completions and chat,
streamed and not, usage, logprobs, every error status with its message, API keys, body limits, /health, /metrics,
and aborts when a client goes away. The official ``openai`` client drives the app on a local port at the end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.bench.server_metrics import parse_counters
from dispatcher.engine.output import CompletionOutput, RequestOutput
from dispatcher.serve.app import SERVER_KEY, build_app, drain, start_http, stop_accepting
from dispatcher.serve.metrics import EngineMetrics
from dispatcher.serve.protocol import MAX_STOP_STRINGS
from scheduler.request import RequestError, SamplingParams

MODEL = "fake-model"
KEY = "sk-test-123"


# ---------------------------------------------------------------------------------------------------------------
# the fake engine: EngineClient's interface, canned outputs
# ---------------------------------------------------------------------------------------------------------------


class EngineError(RuntimeError):
    pass


class FakeTokenizer:
    """Characters are tokens: id = code point (BOS = 1); a chat renders as <role>content... <assistant>."""

    vocab_size = 4096

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [min(ord(c), self.vocab_size - 1) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != 1 or not skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode()

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, continue_final_message: bool = False,
                            tools=None, variables=None) -> str:
        """(the request's chat_template_kwargs written after the turns as ``{name=value}``, and ``{tools=N}`` with
        N tools, but with ``continue_final_message``: then the last message's text ends the prompt)"""
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        scope = {**(variables or {}), **({"tools": len(tools)} if tools else {})}
        text += "".join(f"{{{k}={v}}}" for k, v in sorted(scope.items())) if not continue_final_message else ""
        return text + ("<assistant>" if add_generation_prompt else "")


WORDS = ["Hello", " world", ",", " how", " are", " you", "?"]


def token_of(i: int) -> int:
    return 2000 + i


class FakeEngine:
    """Output token i is 2000 + i with the text WORDS[i % 7]; one token per output, ``delay_s`` apart. Records
    what it was asked and which requests were aborted."""

    def __init__(self, delay_s: float = 0.0, fail_after: int | None = None, max_model_len: int = 128):
        self.served_model_name = MODEL
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.engine_max_model_len = max_model_len
        """What the engine itself checks (tests set it apart from what the app is told)."""
        self.default_params = SamplingParams()
        self.ready = True
        self.dead: str | None = None
        self.metrics = EngineMetrics(MODEL)
        self.delay_s = delay_s
        self.fail_after = fail_after
        self.abort_after: int | None = None
        self.without_logprobs = False
        self.requests: dict[str, tuple] = {}
        self.aborted: list[str] = []
        self.live: set[str] = set()

    def generate(self, request_id, prompt, prompt_token_ids, params: SamplingParams, arrival=None):
        params.validate(self.tokenizer.vocab_size)
        if len(prompt_token_ids) + params.max_tokens > self.engine_max_model_len:
            raise RequestError(f"max_tokens {params.max_tokens} with the prompt exceeds max_model_len")
        self.requests[request_id] = (prompt, list(prompt_token_ids), params)
        self.live.add(request_id)
        return self._outputs(request_id, prompt, list(prompt_token_ids), params)

    async def _outputs(self, rid, prompt, ids, params):
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(self.delay_s)
                if rid not in self.live:
                    return
                if self.fail_after is not None and i == self.fail_after:
                    raise EngineError("the worker process died (SIGKILL)")
                if self.abort_after is not None and i == self.abort_after:  # the engine's shutdown aborts it
                    yield RequestOutput(rid, prompt, ids, [CompletionOutput(0, "", [], "abort")], True)
                    return
                tid = token_of(i)
                lp = None
                if params.logprobs is not None and not self.without_logprobs:
                    lp = [{tid: -0.25, **{token_of(100 + k): -1.0 - k for k in range(params.logprobs)}}]
                done = "length" if i == params.max_tokens - 1 else None
                if self.metrics is not None:
                    self.metrics.on_step("uniform_decode", "FULL", None, 3, 0, 0)
                outs = [CompletionOutput(c, WORDS[(i + c) % len(WORDS)], [tid + 1000 * c], done, None, lp)
                        for c in range(params.n)]  # (choice c: its words shifted by c)
                prompt_lp = ranks = None
                if i == 0 and params.prompt_logprobs is not None:  # the prompt token t at -1 - t/1000, rank t
                    prompt_lp = [None] + [{t: -1 - t / 1000, **{token_of(200 + k): -0.5 - k
                                                          for k in range(params.prompt_logprobs)}} for t in ids[1:]]
                    ranks = [None] + list(ids[1:])
                yield RequestOutput(rid, prompt, ids, outs, done is not None, prompt_logprobs=prompt_lp,
                                    prompt_logprob_ranks=ranks)
        finally:
            self.live.discard(rid)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.live.discard(request_id)


def text_of(n: int) -> str:
    return "".join(WORDS[i % len(WORDS)] for i in range(n))


@contextlib.asynccontextmanager
async def served(engine: FakeEngine | None = None, **kwargs):
    engine = engine or FakeEngine()
    async with TestClient(TestServer(build_app(engine, **kwargs))) as client:
        client.engine = engine
        yield client


def run(coro):
    return asyncio.run(coro)


async def sse(response) -> list:
    """The JSON events of a stream, then the string '[DONE]'."""
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"].startswith("text/event-stream")
    raw = (await response.read()).decode()
    events = []
    for block in raw.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def error_of(response, status: int) -> dict:
    assert response.status == status, await response.text()
    body = await response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


# ---------------------------------------------------------------------------------------------------------------
# completions
# ---------------------------------------------------------------------------------------------------------------


def test_completion():
    async def go():
        async with served() as c:
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Say hi", "max_tokens": 5})
            assert r.status == 200
            body = await r.json()
            assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
            assert body["model"] == MODEL and isinstance(body["created"], int)
            choice = body["choices"][0]
            assert choice["index"] == 0 and choice["text"] == text_of(5) and choice["finish_reason"] == "length"
            assert choice["logprobs"] is None
            assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
            prompt, ids, params = c.engine.requests[body["id"]]
            assert prompt == "Say hi" and ids == [1] + [ord(ch) for ch in "Say hi"] and params.max_tokens == 5
            assert r.headers["X-Request-Id"] == body["id"]

    run(go())


def test_completion_defaults_and_sampling_fields():
    async def go():
        async with served() as c:
            r = await c.post("/v1/completions", json={
                "prompt": [5, 6, 7], "temperature": 0.7, "top_p": 0.9, "top_k": -1, "seed": 3, "stop": "\n",
                "ignore_eos": True, "stop_token_ids": [9], "user": "someone", "n": 1, "frequency_penalty": 0})
            body = await r.json()
            assert r.status == 200, body
            prompt, ids, params = c.engine.requests[body["id"]]
            assert prompt is None and ids == [5, 6, 7]
            assert params.max_tokens == 16  # OpenAI's default for completions
            assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, 0, 3)
            assert params.stop == ("\n",) and params.ignore_eos and params.stop_token_ids == (9,)
            assert body["usage"]["prompt_tokens"] == 3
            # a list of one string is that string
            r = await c.post("/v1/completions", json={"prompt": ["ab"], "max_tokens": 1})
            assert c.engine.requests[(await r.json())["id"]][0] == "ab"

    run(go())


def test_completion_stream_with_usage():
    async def go():
        async with served() as c:
            r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "stream": True,
                                                      "stream_options": {"include_usage": True}})
            events = await sse(r)
            assert events[-1] == "[DONE]"
            chunks, usage_chunk = events[:-2], events[-2]
            assert all(e["object"] == "text_completion" and e["id"] == chunks[0]["id"] for e in chunks)
            assert chunks[0]["id"].startswith("cmpl-")
            assert "".join(e["choices"][0]["text"] for e in chunks) == text_of(4)
            assert [e["choices"][0]["finish_reason"] for e in chunks] == [None, None, None, "length"]
            assert all(e["usage"] is None for e in chunks)
            assert usage_chunk["choices"] == []
            assert usage_chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}

    run(go())


def test_continuous_usage_stats():
    async def go():
        async with served() as c:
            r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True,
                                                      "stream_options": {"continuous_usage_stats": True}})
            events = await sse(r)
            assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [1, 2, 3]

    run(go())


def test_completion_logprobs():
    async def go():
        async with served() as c:
            r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "logprobs": 2})
            body = await r.json()
            lp = body["choices"][0]["logprobs"]
            assert c.engine.requests[body["id"]][2].logprobs == 2
            assert lp["tokens"] == [chr(token_of(i)) for i in range(3)]
            assert lp["token_logprobs"] == [-0.25] * 3
            assert lp["text_offset"] == [0, 1, 2]
            for i, top in enumerate(lp["top_logprobs"]):
                assert top == {chr(token_of(i)): -0.25, chr(token_of(100)): -1.0}  # the top 2 (sampled first)
            # streamed: one entry per chunk, offsets continuing
            r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "logprobs": 0,
                                                      "stream": True})
            events = (await sse(r))[:-1]
            assert [e["choices"][0]["logprobs"]["text_offset"] for e in events] == [[0], [1], [2]]
            assert all(e["choices"][0]["logprobs"]["top_logprobs"][0] == {
                chr(token_of(i)): -0.25} for i, e in enumerate(events))

    run(go())


# ---------------------------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------------------------


def test_chat():
    async def go():
        async with served() as c:
            r = await c.post("/v1/chat/completions", json={
                "model": MODEL, "max_completion_tokens": 3, "max_tokens": 50,
                "messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                          {"type": "text", "text": "there"}]}]})
            body = await r.json()
            assert r.status == 200, body
            assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
            choice = body["choices"][0]
            assert choice["message"] == {"role": "assistant", "content": text_of(3)}
            assert choice["finish_reason"] == "length" and choice["logprobs"] is None
            prompt, ids, params = c.engine.requests[body["id"]]
            assert prompt == "<system>Be brief.<user>Hi\nthere<assistant>"
            assert ids == [ord(ch) for ch in prompt]  # the template's text, no BOS added
            assert params.max_tokens == 3  # max_completion_tokens wins
            assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 3, "total_tokens": len(ids) + 3}

    run(go())


def test_chat_default_max_tokens_fills_the_context():
    async def go():
        async with served() as c:
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
            body = await r.json()
            prompt_tokens = body["usage"]["prompt_tokens"]
            assert body["usage"]["completion_tokens"] == 128 - prompt_tokens  # vLLM's default: the room left

    run(go())


def test_chat_stream():
    async def go():
        async with served() as c:
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}})
            events = await sse(r)
            assert events[-1] == "[DONE]"
            chunks = events[:-2]
            assert all(e["object"] == "chat.completion.chunk" and e["id"].startswith("chatcmpl-") for e in chunks)
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert "".join(e["choices"][0]["delta"].get("content", "") for e in chunks) == text_of(3)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 3

    run(go())


def test_chat_echo_puts_the_assistants_last_message_before_each_choice():
    """vLLM's chat ``echo``: where the last message is the assistant's (the one continue_final_message goes on with),
    each choice's content starts with its text (text parts joined by newlines), streamed in the first chunk; after
    a user's message nothing is put before it. A completion's ``echo`` (the prompt) is not involved."""
    partial = [{"role": "user", "content": "Tell a story"},
               {"role": "assistant", "content": [{"type": "text", "text": "Once"}, {"type": "text", "text": "upon"}]}]
    cont = {"add_generation_prompt": False, "continue_final_message": True, "max_tokens": 3}

    async def go():
        async with served() as c:
            r = await c.post("/v1/chat/completions", json={"messages": partial, "echo": True, "n": 2,
                                                           "temperature": 0.5, **cont})
            body = await r.json()
            assert r.status == 200, body
            contents = [ch["message"]["content"] for ch in body["choices"]]
            assert len(contents) == 2 and all(t.startswith("Once\nupon") and len(t) > 9 for t in contents)
            assert contents[0] == "Once\nupon" + text_of(3)
            prompt, _, params = c.engine.requests[body["id"]]
            assert prompt.endswith("upon") and params.prompt_logprobs is None  # (no completion-style echo)
            r = await c.post("/v1/chat/completions", json={"messages": partial, "echo": True, "stream": True,
                                                           **cont})
            chunks = (await sse(r))[:-1]
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Once\nupon"}
            assert "".join(e["choices"][0]["delta"].get("content", "") for e in chunks) == "Once\nupon" + text_of(3)
            r = await c.post("/v1/chat/completions", json={"messages": partial[:1], "echo": True, "max_tokens": 3})
            assert (await r.json())["choices"][0]["message"]["content"] == text_of(3)

    run(go())


def test_chat_logprobs():
    async def go():
        async with served() as c:
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True,
                "top_logprobs": 3})
            body = await r.json()
            assert c.engine.requests[body["id"]][2].logprobs == 3
            content = body["choices"][0]["logprobs"]["content"]
            assert len(content) == 2
            for i, entry in enumerate(content):
                assert entry["token"] == chr(token_of(i)) and entry["logprob"] == -0.25
                assert entry["bytes"] == list(chr(token_of(i)).encode())
                assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.25, -1.0, -2.0]
                assert set(entry["top_logprobs"][0]) == {"token", "logprob", "bytes"}
            # logprobs without top_logprobs: the sampled token's, no alternatives
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "logprobs": True, "stream": True})
            events = await sse(r)
            entry = events[1]["choices"][0]["logprobs"]["content"][0]
            assert entry["logprob"] == -0.25 and entry["top_logprobs"] == []

    run(go())


def test_models_health_metrics():
    async def go():
        async with served() as c:
            models = await (await c.get("/v1/models")).json()
            assert models["object"] == "list"
            assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [(MODEL, "model", 128)]
            r = await c.get("/health")
            assert r.status == 200
            for _ in range(2):
                await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
            r = await c.get("/metrics")
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for f in text_string_to_metric_families(text) for s in f.samples}

            def value(name, **labels):
                return samples[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]

            assert value("twogrid:request_success_total", finished_reason="length") == 2
            assert value("twogrid:request_success_total", finished_reason="stop") == 0
            assert value("twogrid:prompt_tokens_total") == 6
            assert value("twogrid:generation_tokens_total") == 8
            assert value("twogrid:time_to_first_token_seconds_count") == 2
            assert value("twogrid:inter_token_latency_seconds_count") == 6
            assert value("twogrid:e2e_request_latency_seconds_count") == 2
            assert value("twogrid:cudagraph_steps_total", kind="uniform_decode", mode="FULL") == 8
            # the counters twogrid bench reads
            counters = parse_counters(text)
            assert counters["twogrid:padded_tokens_total"][()] == 24
            assert counters["twogrid:cudagraph_steps_total"][("uniform_decode", "FULL")] == 8

    run(go())


def test_engine_metrics_hooks():
    m = EngineMetrics("m")
    m.on_step("mixed", "NONE", "mixed_above_cap", padded_tokens=0, accepted_tokens=5, preemptions=2)
    m.on_step("uniform_decode", "FULL", None, padded_tokens=7)
    m.set_queue(running=3, waiting=4, kv_free_blocks=20, kv_blocks=40)
    m.set_capture(12.5, 3 * 2**30)
    samples = {s.name: s.value for f in text_string_to_metric_families(m.render().decode()) for s in f.samples
               if s.labels.get("reason", "mixed_above_cap") == "mixed_above_cap"}
    assert samples["twogrid:eager_steps_total"] == 1
    assert samples["twogrid:padded_tokens_total"] == 7
    assert samples["twogrid:spec_decode_num_accepted_tokens_total"] == 5
    assert samples["twogrid:num_preemptions_total"] == 2
    assert (samples["twogrid:num_requests_running"], samples["twogrid:num_requests_waiting"]) == (3, 4)
    assert samples["twogrid:kv_cache_usage_perc"] == 0.5
    assert (samples["twogrid:kv_cache_free_blocks"], samples["twogrid:kv_cache_blocks"]) == (20, 40)
    assert samples["twogrid:capture_seconds"] == 12.5 and samples["twogrid:cudagraph_memory_bytes"] == 3 * 2**30
    counters = parse_counters(m.render().decode())
    assert counters["twogrid:eager_steps_total"] == {("mixed_above_cap",): 1.0}
    assert counters["twogrid:cudagraph_steps_total"] == {("mixed", "NONE"): 1.0, ("uniform_decode", "FULL"): 1.0}


def spec_decode_samples(m: EngineMetrics) -> dict:
    """{(sample name, position label or None): value} of the spec_decode_* series."""
    return {(s.name, s.labels.get("position")): s.value for f in text_string_to_metric_families(m.render().decode())
            for s in f.samples if s.name.startswith("twogrid:spec_decode_") and s.name.endswith("_total")}


def test_spec_decode_metrics_as_vllm_names_them():
    """Verify events, drafts verified, accepted, and accepted per draft position (every position 0..K-1 from the
    start, at 0), with the model_name label; a step's per-position counts add to its accepted drafts."""
    m = EngineMetrics("m", num_speculative_tokens=3)
    per_pos = "twogrid:spec_decode_num_accepted_tokens_per_pos_total"
    assert spec_decode_samples(m) == {("twogrid:spec_decode_num_drafts_total", None): 0,
                                      ("twogrid:spec_decode_num_draft_tokens_total", None): 0,
                                      ("twogrid:spec_decode_num_accepted_tokens_total", None): 0,
                                      (per_pos, "0"): 0, (per_pos, "1"): 0, (per_pos, "2"): 0}
    # two requests verify 3 drafts each, accepting 2 and 0; then one accepts all 3
    m.on_step("uniform_decode", "FULL", accepted_tokens=2, num_drafts=2, draft_tokens=6, accepted_per_pos=[1, 1, 0])
    m.on_step("uniform_decode", "FULL", accepted_tokens=3, num_drafts=1, draft_tokens=3, accepted_per_pos=[1, 1, 1])
    m.on_step("mixed", "NONE", "mixed_above_cap")  # a step without drafts moves none of them
    got = spec_decode_samples(m)
    assert got[("twogrid:spec_decode_num_drafts_total", None)] == 3
    assert got[("twogrid:spec_decode_num_draft_tokens_total", None)] == 9
    assert got[("twogrid:spec_decode_num_accepted_tokens_total", None)] == 5
    assert [got[(per_pos, str(j))] for j in range(3)] == [2, 2, 1]
    assert m.registry.get_sample_value(per_pos, {"model_name": "m", "position": "2"}) == 1
    assert not any(name.startswith(per_pos) for name, _ in spec_decode_samples(EngineMetrics("m")))  # no K: none


def test_the_cudagraph_metrics_line_reports_acceptance():
    """--cudagraph-metrics' periodic line: graph and eager steps, padding, and with speculative decoding the
    totals, vLLM's mean acceptance length (1 + accepted / drafts) and per-position acceptance rates."""
    from dispatcher.serve.launch import cudagraph_metrics_line

    m = EngineMetrics("m", num_speculative_tokens=2)
    line, _ = cudagraph_metrics_line(m.render().decode())
    assert line == ("cudagraph metrics: 0 steps, 0 eager (none), 0 padded tokens; spec decode: 0 drafts, 0 draft "
                    "tokens, 0 accepted, mean acceptance length n/a, per-position acceptance rate n/a")
    m.on_step("uniform_decode", "FULL", padded_tokens=3, accepted_tokens=5, num_drafts=4, draft_tokens=8,
              accepted_per_pos=[3, 2])
    m.on_step("mixed", "NONE", "mixed_above_cap")
    assert cudagraph_metrics_line(m.render().decode())[0] == (
        "cudagraph metrics: 2 steps, 1 eager (mixed_above_cap 1), 3 padded tokens; spec decode: 4 drafts, 8 draft "
        "tokens, 5 accepted, mean acceptance length 2.25, per-position acceptance rate 0.750, 0.500")
    plain = EngineMetrics("m")
    plain.on_step("uniform_decode", "FULL")
    assert cudagraph_metrics_line(plain.render().decode()) == (
        "cudagraph metrics: 1 steps, 0 eager (none), 0 padded tokens", 0.0)


def test_the_cudagraph_metrics_line_says_how_busy_the_device_was_since_the_line_before():
    """With the period since the line before, the line adds the share of it the device spent in steps (from the
    steps' device seconds since then), and hands back the total for the next line; a period without steps, or the
    first line of none, says nothing of it."""
    from dispatcher.serve.launch import cudagraph_metrics_line

    m = EngineMetrics("m")
    m.on_step("uniform_decode", "FULL", device_seconds=2.5)
    line, total = cudagraph_metrics_line(m.render().decode(), 0.0, 10.0)
    assert line.endswith("0 padded tokens, device busy 25% of the last 10 s") and total == 2.5
    m.on_step("uniform_decode", "FULL", device_seconds=5.6)
    line, total = cudagraph_metrics_line(m.render().decode(), total, 10.0)
    assert line.endswith("device busy 56% of the last 10 s") and total == pytest.approx(8.1)
    assert "busy" not in cudagraph_metrics_line(m.render().decode(), total, 10.0)[0]  # (no step since)


def test_sampling_params_logprobs():
    SamplingParams(logprobs=None).validate()
    SamplingParams(logprobs=0).validate()
    SamplingParams(logprobs=20).validate()
    for bad in (-1, 21, True, 1.5, "3"):
        with pytest.raises(RequestError, match="logprobs must be an integer in 0..20"):
            SamplingParams(logprobs=bad).validate()


# ---------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------

BAD_REQUESTS = [
    # (what, body bytes or JSON, expected param, a word the message must contain)
    ("bad JSON", b'{"prompt": "hi",', None, "JSON"),
    ("not an object", b'[1, 2]', None, "object"),
    ("empty body", b"", None, "empty"),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', None, "UTF-8"),
    ("deep JSON", b'{"prompt": "a", "stop": ' + b"[" * 100000 + b"]" * 100000 + b"}", "stop[0]", "Expected"),
    ("wrong type", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens", "int"),
    ("wrong type nested", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage", "bool"),
    ("unknown field", {"prompt": "hi", "max_tokenz": 3}, "max_tokenz", "unknown"),
    ("unknown nested field", {"prompt": "hi", "stream": True, "stream_options": {"x": 1}}, "stream_options.x",
     "unknown"),
    ("missing prompt", {"max_tokens": 3}, "prompt", "required"),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -1}, "max_tokens", ">= 0"),
    ("zero max_tokens", {"prompt": "hi", "max_tokens": 0}, "max_tokens", ">= 1"),
    ("huge max_tokens", {"prompt": "hi", "max_tokens": 10**30}, "max_tokens", "context length"),
    ("max_tokens beyond the context", {"prompt": "hi", "max_tokens": 126}, "max_tokens", "at most 125"),
    ("prompt over max_model_len", {"prompt": "x" * 200, "max_tokens": 1}, "prompt", "maximum context length"),
    ("prompt ids over max_model_len", {"prompt": list(range(3, 131))}, "prompt", "maximum context length"),
    ("token id outside the vocabulary", {"prompt": [5, 99999]}, "prompt", "vocabulary"),
    ("negative token id", {"prompt": [5, -1]}, "prompt", ">= 0"),
    ("a batch with an empty prompt", {"prompt": ["a", ""]}, "prompt[1]", "empty"),
    ("a batch with a prompt over max_model_len", {"prompt": ["a", "x" * 200], "max_tokens": 1}, "prompt[1]",
     "maximum context length"),
    ("a batch mixing ids and text", {"prompt": [5, "b"]}, "prompt[0]", "token ids"),
    ("a batch of 257 prompts", {"prompt": ["a"] * 257}, "prompt", "at most 256"),
    ("empty prompt", {"prompt": ""}, "prompt", "empty"),
    ("temperature infinite", b'{"prompt": "hi", "temperature": 1e999}', "temperature", "range"),
    ("temperature NaN", b'{"prompt": "hi", "temperature": NaN}', None, "JSON"),
    ("temperature too high", {"prompt": "hi", "temperature": 2.5}, "temperature", "<= 2.0"),
    ("top_p zero", {"prompt": "hi", "top_p": 0}, "top_p", "> 0.0"),
    ("seed beyond int64", {"prompt": "hi", "seed": 2**64}, "seed", "<="),
    ("top_k beyond int32", {"prompt": "hi", "top_k": 2**63, "temperature": 1}, "top_k", "<= 2147483647"),
    ("top_k beyond uint64", {"prompt": "hi", "top_k": 2**64 + 5, "temperature": 1}, "top_k", "<="),
    ("logprobs too many", {"prompt": "hi", "logprobs": 21}, "logprobs", "<= 20"),
    ("n = 2 greedy", {"prompt": "hi", "n": 2, "temperature": 0}, "n", "greedy"),
    ("n = 0", {"prompt": "hi", "n": 0}, "n", ">= 1"),
    ("n too large", {"prompt": "hi", "n": 1000, "temperature": 1}, "n", "<= 256"),
    ("best_of beyond n", {"prompt": "hi", "best_of": 3, "temperature": 1}, "best_of", "vLLM"),
    ("suffix", {"prompt": "hi", "suffix": "x"}, "suffix", "not supported"),
    ("presence_penalty out of range", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", "<= 2.0"),
    ("frequency_penalty out of range", {"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty", ">= -2.0"),
    ("repetition_penalty zero", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "> 0.0"),
    ("min_p above 1", {"prompt": "hi", "min_p": 1.5}, "min_p", "<= 1.0"),
    ("min_tokens over max_tokens", {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens", "max_tokens"),
    ("logit_bias key not an id", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ("logit_bias key that int() would take", {"prompt": "hi", "logit_bias": {"1_0": 1}}, "logit_bias", "digits"),
    ("logit_bias key with a space", {"prompt": "hi", "logit_bias": {" 42": 1}}, "logit_bias", "digits"),
    ("logit_bias value", {"prompt": "hi", "logit_bias": {"5": 150}}, "logit_bias", "[-100, 100]"),
    ("logit_bias outside the vocabulary", {"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias", "vocabulary"),
    ("allowed_token_ids empty", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids", "1..1024"),
    ("allowed_token_ids outside the vocabulary", {"prompt": "hi", "allowed_token_ids": [5, 99999]},
     "allowed_token_ids", "vocabulary"),
    ("bad_words empty word", {"prompt": "hi", "bad_words": [""]}, "bad_words", "no token"),
    ("prompt_logprobs streamed", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     "stream"),
    ("prompt_logprobs too many", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "<= 20"),
    ("stop with an empty string", {"prompt": "hi", "stop": ["a", ""]}, "stop", "empty"),
    ("too many stop strings", {"prompt": "hi", "stop": [str(i) for i in range(MAX_STOP_STRINGS + 1)]}, "stop",
     f"at most {MAX_STOP_STRINGS}"),
    ("stop of a wrong type", {"prompt": "hi", "stop": [1]}, "stop[0]", "str"),
    ("stream_options without stream", {"prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options", "stream"),
    ("min_tokens beside a grammar", {"prompt": "hi", "min_tokens": 10, "guided_json": {"type": "string",
                                                                                     "maxLength": 2}},
     "min_tokens", "guided_json"),
    ("allowed_token_ids beside a grammar", {"prompt": "hi", "allowed_token_ids": [5], "guided_choice": ["yes"]},
     "allowed_token_ids", "structured outputs (guided_choice)"),
]


@pytest.mark.parametrize("what,body,param,word", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_completion_requests_get_400(what, body, param, word):
    async def go():
        async with served() as c:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await c.post("/v1/completions", data=data, headers={"Content-Type": "application/json"})
            err = await error_of(r, 400)
            assert err["type"] == "invalid_request_error"
            assert err["param"] == param, err
            assert word.lower() in err["message"].lower(), err
            assert not c.engine.requests, "a refused request reached the engine"
            # the server keeps serving
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status == 200

    run(go())


BAD_CHAT = [
    ("no messages", {"messages": []}, "messages", "length"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "wizard"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "only text"),
    ("a text part without its text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text", "is required"),
    ("top_logprobs without logprobs", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs", "logprobs"),
    ("max_completion_tokens beyond the context", {"messages": [{"role": "user", "content": "hi"}],
                                                  "max_completion_tokens": 1000}, "max_completion_tokens", "at most"),
    ("tool_choice without tools", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"},
     "tool_choice", "tools"),
    ("auto tool choice without the server's flags", {"messages": [{"role": "user", "content": "hi"}],
                                                     "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice", "--enable-auto-tool-choice"),
    ("a named tool that is not among the tools", {"messages": [{"role": "user", "content": "hi"}],
                                                  "tools": [{"type": "function", "function": {"name": "f"}}],
                                                  "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "'g'"),
    ("a forced call and a response format", {"messages": [{"role": "user", "content": "hi"}],
                                             "tools": [{"type": "function", "function": {"name": "f"}}],
                                             "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "response_format"),
    ("tool calls on a user message", {"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls", "assistant"),
    ("a call id on a user message", {"messages": [{"role": "user", "content": "hi", "tool_call_id": "1"}]},
     "messages[0].tool_call_id", "tool messages"),
    ("a forced call with an empty list of tools", {"messages": [{"role": "user", "content": "hi"}], "tools": [],
                                                   "tool_choice": "required"}, "tool_choice", "empty list"),
    ("a named call with an empty list of tools", {"messages": [{"role": "user", "content": "hi"}], "tools": [],
                                                  "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", "the function 'f'"),
    ("a text part carrying an image", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "image_url": {"url": "x"}}]}]}, "messages[0].content[0].image_url", "text"),
    ("a part with a key no part has", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "foo": 1}]}]}, "messages[0].content[0].foo", "unknown"),
]


@pytest.mark.parametrize("what,body,param,word", BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_bad_chat_requests_get_400(what, body, param, word):
    async def go():
        async with served() as c:
            err = await error_of(await c.post("/v1/chat/completions", json=body), 400)
            assert err["param"] == param, err
            assert word.lower() in err["message"].lower(), err

    run(go())


def test_an_empty_list_of_tools_with_no_call_forced_is_served_as_none():
    """Clients that always send ``tools`` send ``[]`` when they have none: with tool_choice left out, "none" or "auto"
    the request is served as if ``tools`` were left out (a forced call is refused: BAD_CHAT)."""
    async def go():
        async with served() as c:
            for extra in ({}, {"tool_choice": "none"}, {"tool_choice": "auto"}):
                body = {"messages": [{"role": "user", "content": "hi"}], "tools": [], "max_tokens": 2, **extra}
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status == 200, (extra, await r.text())
                assert (await r.json())["choices"][0]["message"].get("tool_calls") in (None, [])

    run(go())


def test_a_cache_control_hint_on_a_content_part_is_accepted_and_ignored():
    """Clients written for prompt caching put ``cache_control`` on parts (vLLM ignores it); the prefix cache here is
    automatic, so the part is served as plain text (any other unknown key on a part is refused: BAD_CHAT)."""
    async def go():
        async with served() as c:
            part = {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}],
                                                           "max_tokens": 2})
            assert r.status == 200, await r.text()
            plain = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 2})
            assert (await r.json())["choices"][0]["message"] == (await plain.json())["choices"][0]["message"]

    run(go())


def test_a_body_its_content_encoding_does_not_decode_is_400(caplog):
    """A body sent with ``Content-Encoding: gzip`` (or deflate) that is not compressed: 400 in the API's error shape
    (it was a 500 with a traceback in the log), on every route that reads a body; the server goes on."""
    caplog.set_level(logging.INFO, logger="twogrid")

    async def go():
        async with served() as c:
            for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                               ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
                for encoding in ("gzip", "deflate"):
                    r = await c.post(path, data=json.dumps(body).encode(), headers={
                        "Content-Type": "application/json", "Content-Encoding": encoding,
                        "Connection": "close"})  # (the server closes a connection whose body it could not read)
                    err = await error_of(r, 400)
                    assert "body could not be read" in err["message"] and err["code"] == 400, (path, err)
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status == 200

    run(go())
    assert not [r for r in caplog.records if r.name.startswith("twogrid") and r.levelno >= logging.ERROR]


def test_engine_refusal_is_400():
    """A RequestError from engine.generate (its own checks) is the client's error, with the field named."""
    async def go():
        engine = FakeEngine()
        engine.max_model_len = 1000  # the app lets 155 tokens through; the engine's own check stops them

        async with served(engine) as c:
            err = await error_of(await c.post("/v1/completions", json={"prompt": "x" * 150, "max_tokens": 5}), 400)
            assert err["param"] == "max_tokens" and "max_model_len" in err["message"]

    run(go())


def test_unknown_model_is_404():
    async def go():
        async with served() as c:
            for path, body in (("/v1/completions", {"prompt": "hi"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                err = await error_of(await c.post(path, json={"model": "gpt-9", **body}), 404)
                assert err["param"] == "model" and err["code"] == 404 and "gpt-9" in err["message"]
            err = await error_of(await c.get("/v2/nothing"), 404)

    run(go())


def test_api_key():
    async def go():
        async with served(api_key=KEY) as c:
            good = {"Authorization": f"Bearer {KEY}"}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Bearer {KEY}x"}):
                for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics"),
                                     ("GET", "/nowhere")):
                    r = await c.request(method, path, json={"prompt": "hi"}, headers=headers)
                    err = await error_of(r, 401)
                    assert err["code"] == 401
            assert (await c.get("/health")).status == 200  # open: probes carry no key
            assert (await c.get("/v1/models", headers=good)).status == 200
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=good)
            assert r.status == 200
            assert (await c.get("/metrics", headers=good)).status == 200

    run(go())


def test_body_over_the_limit_is_413():
    async def go():
        async with served(max_body_bytes=64 * 1024) as c:
            big = json.dumps({"prompt": "x" * 100_000}).encode()
            err = await error_of(await c.post("/v1/completions", data=big), 413)
            assert "65536" in err["message"]

            async def chunks():  # no Content-Length: the limit holds while reading
                for _ in range(20):
                    yield b" " * 8192

            err = await error_of(await c.post("/v1/completions", data=chunks()), 413)
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert r.status == 200

    run(go())


def test_engine_refusing_at_generate_is_503():
    """An EngineError from generate itself (dead, shutting down: nothing was queued) is 503, not a failure."""
    async def go():
        engine = FakeEngine()

        def refuse(*args):
            raise EngineError("the server is shutting down")

        engine.generate = refuse
        async with served(engine) as c:
            err = await error_of(await c.post("/v1/completions", json={"prompt": "hi"}), 503)
            assert "shutting down" in err["message"]
            text = await (await c.get("/metrics")).text()
            assert sum(parse_metric(text, "twogrid:request_success_total").values()) == 0

    run(go())


def test_engine_without_metrics():
    async def go():
        engine = FakeEngine()
        engine.metrics = None
        async with served(engine) as c:
            assert (await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status == 200
            text = await (await c.get("/metrics")).text()
            assert parse_metric(text, "twogrid:request_success_total")[("length",)] == 1

    run(go())


def test_health_and_requests_when_not_serving():
    async def go():
        engine = FakeEngine()
        engine.ready = False
        async with served(engine, api_key=KEY) as c:
            err = await error_of(await c.get("/health"), 503)
            assert "starting" in err["message"]
            engine.ready = True
            assert (await c.get("/health")).status == 200
            engine.dead = "the worker process exited with signal 9"
            err = await error_of(await c.get("/health"), 503)
            assert "signal 9" in err["message"]
            r = await c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {KEY}"})
            err = await error_of(r, 503)
            assert "signal 9" in err["message"] and err["type"] == "server_error"

    run(go())


def test_stop_accepting():
    async def go():
        async with served() as c:
            stop_accepting(c.server.app)
            err = await error_of(await c.post("/v1/completions", json={"prompt": "hi"}), 503)
            assert "shutting down" in err["message"]
            assert (await c.get("/health")).status == 503

    run(go())


def test_drain():
    """SIGTERM's drain: new requests are refused at once, requests in flight finish, drain returns when none is
    left (or at its timeout, with the count still running)."""
    async def go():
        engine = FakeEngine(delay_s=0.01)
        async with served(engine) as c:
            running = asyncio.create_task(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 20}))
            await wait_for(lambda: engine.requests)
            draining = asyncio.create_task(drain(c.server.app, timeout_s=5))
            await asyncio.sleep(0.02)
            err = await error_of(await c.post("/v1/completions", json={"prompt": "hi"}), 503)
            assert "shutting down" in err["message"]
            assert await draining == 0
            r = await running
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 20
            slow = FakeEngine(delay_s=1.0)
            c.server.app[SERVER_KEY].engine = slow
            c.server.app[SERVER_KEY].closing = None
            late = asyncio.create_task(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 20}))
            await wait_for(lambda: slow.requests)
            assert await drain(c.server.app, timeout_s=0.1) == 1
            late.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await late

    run(go())


def test_requests_the_engine_aborts_get_an_error():
    """At shutdown the engine ends what is left with finish reason 'abort': the client hears it, never silence."""
    async def go():
        engine = FakeEngine()
        engine.abort_after = 2
        async with served(engine) as c:
            err = await error_of(await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5}), 503)
            assert "aborted" in err["message"]
            events = await sse(await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5,
                                                                     "stream": True}))
            assert events[-1] == "[DONE]" and "aborted" in events[-2]["error"]["message"]
            assert "".join(e["choices"][0]["text"] for e in events[:-2]) == text_of(2)
            assert not engine.aborted  # the engine ended them itself: nothing to abort

    run(go())


def test_logprobs_the_engine_does_not_return_are_an_error():
    async def go():
        engine = FakeEngine()
        engine.without_logprobs = True
        async with served(engine) as c:
            err = await error_of(await c.post("/v1/completions", json={"prompt": "hi", "logprobs": 1}), 500)
            assert "no logprobs" in err["message"]
            assert engine.aborted == list(engine.requests) and not engine.live

    run(go())


def test_engine_failure():
    async def go():
        async with served(FakeEngine(fail_after=2)) as c:
            err = await error_of(await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5}), 500)
            assert "worker process died" in err["message"] and err["type"] == "server_error"
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 5, "stream": True})
            events = await sse(r)
            assert events[-1] == "[DONE]"
            assert "worker process died" in events[-2]["error"]["message"]
            assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2]) == text_of(2)
            samples = parse_metric(await (await c.get("/metrics")).text(), "twogrid:request_success_total")
            assert samples[("error",)] == 2

    run(go())


def parse_metric(text: str, name: str) -> dict:
    return {tuple(v for k, v in sorted(s.labels.items()) if k != "model_name"): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


# ---------------------------------------------------------------------------------------------------------------
# disconnects
# ---------------------------------------------------------------------------------------------------------------


async def wait_for(predicate, timeout_s: float = 5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_disconnect_mid_stream_aborts():
    async def go():
        engine = FakeEngine(delay_s=0.02)
        async with served(engine) as c:
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100, "stream": True})
            assert r.status == 200
            await r.content.readuntil(b"\n\n")  # the first token arrived
            rid = next(iter(engine.requests))
            r.close()  # the client goes away
            await wait_for(lambda: engine.aborted == [rid])
            assert not engine.live
            await wait_for(lambda: parse_metric(engine.metrics.render().decode(),
                                                "twogrid:request_success_total")[("abort",)] == 1)

    run(go())


def test_disconnect_while_waiting_aborts():
    """Not streaming, and gone before the first token: the handler is cancelled and the request aborted."""
    async def go():
        engine = FakeEngine(delay_s=0.05)
        async with served(engine) as c:
            task = asyncio.create_task(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100}))
            await wait_for(lambda: engine.requests)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await wait_for(lambda: engine.aborted == list(engine.requests))
            assert not engine.live

    run(go())


def test_finished_requests_are_not_aborted():
    async def go():
        engine = FakeEngine()
        async with served(engine) as c:
            await sse(await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}))
            await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert engine.aborted == [] and not engine.live

    run(go())


def test_start_http_on_uvloop_aborts_on_disconnect():
    """start_http (what `twogrid serve` runs) on uvloop: a non-streaming client that gives up aborts its request."""
    uvloop = pytest.importorskip("uvloop")
    aiohttp = pytest.importorskip("aiohttp")

    async def go():
        engine = FakeEngine(delay_s=0.05)
        runner = await start_http(build_app(engine), "127.0.0.1", 0, shutdown_timeout=1)
        try:
            port = runner.addresses[0][1]
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{port}/v1/completions"
                async with session.post(url, json={"prompt": "hi", "max_tokens": 2}) as r:
                    assert (await r.json())["usage"]["completion_tokens"] == 2
                with pytest.raises(asyncio.TimeoutError):
                    await session.post(url, json={"prompt": "hi", "max_tokens": 100},
                                       timeout=aiohttp.ClientTimeout(total=0.3))
            await wait_for(lambda: len(engine.aborted) == 1)
            assert engine.aborted == list(engine.requests)[1:] and not engine.live
        finally:
            await runner.cleanup()

    uvloop.run(go())


# ---------------------------------------------------------------------------------------------------------------
# logs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("log_requests", [False, True])
def test_prompt_text_is_logged_only_with_log_requests(caplog, log_requests):
    secret = "my secret prompt 7d1f"

    async def go():
        async with served(log_requests=log_requests) as c:
            await c.post("/v1/completions", json={"prompt": secret, "max_tokens": 2})
            await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": secret}],
                                                       "max_tokens": 2, "stream": True})
            await c.post("/v1/completions", json={"prompt": secret, "max_tokens": 9999})  # refused

    with caplog.at_level(logging.DEBUG):
        run(go())
    assert (secret in caplog.text) == log_requests
    assert "cmpl-" in caplog.text  # requests are logged, by id


# ---------------------------------------------------------------------------------------------------------------
# the official openai client, on a local port
# ---------------------------------------------------------------------------------------------------------------


def test_openai_client():
    openai = pytest.importorskip("openai")

    async def go():
        engine = FakeEngine()
        async with TestServer(build_app(engine, api_key=KEY), host="127.0.0.1") as server:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0)
            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]

            c = await client.completions.create(model=MODEL, prompt="Say hi", max_tokens=4, logprobs=1)
            assert c.choices[0].text == text_of(4) and c.choices[0].finish_reason == "length"
            assert c.usage.completion_tokens == 4 and len(c.choices[0].logprobs.tokens) == 4
            stream = await client.completions.create(model=MODEL, prompt="Say hi", max_tokens=4, stream=True,
                                                     stream_options={"include_usage": True})
            parts, usage = [], None
            async for chunk in stream:
                parts.extend(ch.text for ch in chunk.choices)
                usage = chunk.usage or usage
            assert "".join(parts) == text_of(4) and usage.total_tokens == 7 + 4

            messages = [{"role": "user", "content": "Hi"}]
            r = await client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3,
                                                     logprobs=True, top_logprobs=2)
            assert r.choices[0].message.content == text_of(3) and r.choices[0].message.role == "assistant"
            assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
            stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True)
            parts, reasons = [], []
            async for chunk in stream:
                parts.append(chunk.choices[0].delta.content or "")
                reasons.append(chunk.choices[0].finish_reason)
            assert "".join(parts) == text_of(3) and reasons[-1] == "length"

            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="nope", prompt="x")
            with pytest.raises(openai.BadRequestError) as exc:
                await client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
            assert exc.value.body["param"] == "max_tokens"
            bad = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
            failing = FakeEngine(fail_after=1)
            engine.generate = failing.generate  # the engine fails mid-stream: the client raises, never hangs
            stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True)
            with pytest.raises(openai.APIError, match="worker process died"):
                async for _ in stream:
                    pass
            await client.close()
            await bad.close()

    run(go())


# ---------------------------------------------------------------------------------------------------------------
# a real tokenizer and chat template (models/text.py), and hostile input
# ---------------------------------------------------------------------------------------------------------------


def test_real_tokenizer_chat_and_logprobs(bpe):
    """The app over models.text.Tokenizer: the ChatML template renders the conversation, the prompt's ids are
    encode_chat's, logprob tokens are decoded token texts."""
    from models.text import tokenizer_from_dir

    tok = tokenizer_from_dir(bpe)
    engine = FakeEngine(max_model_len=4096)
    engine.tokenizer = tok
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2? \U0001f642"}]

    async def go():
        async with served(engine) as c:
            r = await c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "logprobs": True,
                                                           "top_logprobs": 1})
            body = await r.json()
            assert r.status == 200, body
            prompt, ids, _ = engine.requests[body["id"]]
            assert prompt == tok.apply_chat_template(messages) and prompt.endswith("<|im_start|>assistant\n")
            assert ids == tok.encode_chat(messages)
            entry = body["choices"][0]["logprobs"]["content"][0]
            assert entry["token"] == tok.decode([token_of(0)], skip_special_tokens=False)
            assert entry["bytes"] == list(tok.token_bytes(token_of(0)))
            r = await c.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 1})
            assert engine.requests[(await r.json())["id"]][1] == tok.encode("Hello there")

    run(go())


def test_hostile_requests_get_4xx_and_the_server_keeps_serving():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from serverutil import assert_ok_or_4xx, hostile_bodies

    loop = asyncio.new_event_loop()
    engine = FakeEngine()
    client = loop.run_until_complete(_start_client(engine, max_body_bytes=64 * 1024))
    statuses: dict[int, int] = {}

    async def send(path: str, body: bytes, content_type: str | None):
        headers = {"Content-Type": content_type} if content_type else {}
        r = await client.post(path, data=body, headers=headers)
        return r.status, await r.read()

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
           body=hostile_bodies(),
           content_type=st.sampled_from([None, "application/json", "text/plain", "application/json; charset=latin1"]))
    def check(path, body, content_type):
        status, payload = loop.run_until_complete(send(path, body, content_type))
        statuses[status] = statuses.get(status, 0) + 1
        assert_ok_or_4xx(status, payload)

    try:
        check()
        assert sum(v for k, v in statuses.items() if k >= 400) >= 200, statuses  # mostly refused, each with 4xx
        ok, _ = loop.run_until_complete(send("/v1/completions", b'{"prompt": "hi", "max_tokens": 2}', None))
        assert ok == 200 and not engine.live
    finally:
        loop.run_until_complete(client.close())
        loop.close()


async def _start_client(engine, **kwargs) -> TestClient:
    client = TestClient(TestServer(build_app(engine, **kwargs)))
    await client.start_server()
    return client
