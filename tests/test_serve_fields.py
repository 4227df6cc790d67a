"""What clients written for vLLM send, against the HTTP front end over a fake engine (tests/test_serve_app.py's):
n choices (whole and streamed), echo and prompt logprobs in vLLM's shape, the sampling fields reaching the engine,
OpenAI fields that change nothing (accepted, logged once), X-Request-Id, the error ``code`` as the HTTP status,
/tokenize, /detokenize, /version, /ping, CORS, and a chat message without content."""

from __future__ import annotations

import asyncio
import logging

from test_serve_app import KEY, WORDS, FakeEngine, error_of, run, served, sse, token_of

from dispatcher.serve.protocol import Cors


def choice_text(c: int, n: int) -> str:
    """Choice c's text of n tokens (the fake engine shifts each choice's words by its index)."""
    return "".join(WORDS[(i + c) % len(WORDS)] for i in range(n))


def test_n_choices():
    async def go():
        async with served() as c:
            r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "n": 3, "temperature": 1,
                                                      "logprobs": 0})
            body = await r.json()
            assert r.status == 200, body
            assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
            assert [ch["text"] for ch in body["choices"]] == [choice_text(i, 3) for i in range(3)]
            assert all(len(ch["logprobs"]["tokens"]) == 3 for ch in body["choices"])
            assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}  # prompt once
            assert c.engine.requests[body["id"]][2].n == 3
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "max_tokens": 2, "n": 2, "temperature": 0.5})
            body = await r.json()
            assert [(ch["index"], ch["message"]["content"]) for ch in body["choices"]] == [
                (0, choice_text(0, 2)), (1, choice_text(1, 2))]
            # no temperature anywhere (the request's, the checkpoint's): vLLM's 1.0 for n > 1, greedy for n = 1
            r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 2})
            body = await r.json()
            assert r.status == 200 and len(body["choices"]) == 2, body
            assert c.engine.requests[body["id"]][2].temperature == 1.0
            r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert c.engine.requests[(await r.json())["id"]][2].temperature == 0.0

    run(go())


def test_n_choices_streamed():
    async def go():
        async with served() as c:
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2, "temperature": 1,
                "stream": True, "stream_options": {"include_usage": True}})
            events = (await sse(r))[:-1]
            roles = [e["choices"][0]["index"] for e in events if e["choices"] and e["choices"][0]["delta"].get("role")]
            assert roles == [0, 1]  # a role chunk per choice first, as vLLM's
            text = {0: "", 1: ""}
            finish = {}
            for e in events[:-1]:
                ch = e["choices"][0]
                text[ch["index"]] += ch["delta"].get("content") or ""
                if ch["finish_reason"]:
                    finish[ch["index"]] = ch["finish_reason"]
            assert text == {0: choice_text(0, 3), 1: choice_text(1, 3)} and finish == {0: "length", 1: "length"}
            assert events[-1]["usage"]["completion_tokens"] == 6

    run(go())


def test_sampling_fields_reach_the_engine():
    async def go():
        async with served() as c:
            body = {"prompt": "Hi", "max_tokens": 8, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                    "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 4, "logit_bias": {"65": 5, "66": -100},
                    "allowed_token_ids": [65, 66, 67], "bad_words": ["ab"], "prompt_logprobs": 2,
                    "best_of": 1, "top_k": 5}
            r = await c.post("/v1/completions", json=body)
            out = await r.json()
            assert r.status == 200, out
            params = c.engine.requests[out["id"]][2]
            assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_p,
                    params.min_tokens) == (0.5, -0.5, 1.2, 0.1, 4)
            assert params.logit_bias == {65: 5.0, 66: -100.0} and params.allowed_token_ids == (65, 66, 67)
            # bad words tokenized as vLLM does: the word (with a leading space only where that is as many tokens)
            assert params.bad_words == ("ab",) and params.bad_words_token_ids == ((97, 98),)
            assert params.prompt_logprobs == 2

    run(go())


def test_echo_and_prompt_logprobs_in_vllms_shape():
    async def go():
        async with served() as c:
            r = await c.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 2, "echo": True, "logprobs": 1})
            body = await r.json()
            ch = body["choices"][0]
            ids = [1] + [ord(x) for x in "Hey"]  # the fake tokenizer's BOS, then characters
            assert ch["text"] == "Hey" + choice_text(0, 2)
            lp = ch["logprobs"]
            assert lp["tokens"][:4] == ["\x01", "H", "e", "y"] and len(lp["tokens"]) == 6
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first prompt token
            assert lp["token_logprobs"][1] == -1 - ids[1] / 1000 and lp["token_logprobs"][4] == -0.25
            # the choice's prompt_logprobs: vLLM's {token id: {logprob, rank, decoded_token}}
            pl = ch["prompt_logprobs"]
            assert pl[0] is None and len(pl) == 4
            assert pl[1][str(ids[1])] == {"logprob": -1 - ids[1] / 1000, "rank": ids[1], "decoded_token": "H"}
            assert pl[1][str(token_of(200))] == {"logprob": -0.5, "rank": 1, "decoded_token": chr(token_of(200))}
            assert c.engine.requests[body["id"]][2].prompt_logprobs == 1  # echo with logprobs asks for them
            # max_tokens 0 with echo: the prompt alone
            r = await c.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 0, "echo": True})
            body = await r.json()
            assert body["choices"][0]["text"] == "Hey"
            assert c.engine.requests[body["id"]][2].max_tokens == 1
            assert body["usage"]["completion_tokens"] == 0 and body["usage"]["total_tokens"] == 4  # (the one left out)
            r = await c.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 0, "echo": True, "stream": True,
                                                      "stream_options": {"include_usage": True}})
            events = (await sse(r))[:-1]
            assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "Hey"
            assert events[-1]["usage"]["completion_tokens"] == 0
            # streamed: the first chunk carries the prompt
            r = await c.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 2, "echo": True, "stream": True})
            events = (await sse(r))[:-1]
            assert [e["choices"][0]["text"] for e in events] == ["Hey" + WORDS[0], WORDS[1]]
            # chat: prompt_logprobs at the top
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "max_tokens": 1, "prompt_logprobs": 0})
            body = await r.json()
            assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) > 1

    run(go())


def test_ignored_openai_fields_are_accepted_and_logged_once(caplog):
    async def go():
        async with served() as c:
            for _ in range(2):
                r = await c.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "metadata": {"k": "v"},
                    "store": False, "service_tier": "auto", "user": "u1", "safety_identifier": "s",
                    "prediction": {"type": "content", "content": "Hello"}, "modalities": ["text"]})
                assert r.status == 200, await r.text()
            # audio output is not text: refused naming the field; OpenAI's deprecated function calling: refused,
            # saying what to send instead; reasoning_effort goes to the chat template, as vLLM passes it
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "modalities": ["text", "audio"]})
            assert (await error_of(r, 400))["param"].startswith("modalities")
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "functions": [{"name": "f"}]})
            assert "send 'tools'" in (await error_of(r, 400))["message"]
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "max_tokens": 1, "reasoning_effort": "low"})
            body = await r.json()
            assert r.status == 200, body
            assert c.engine.requests[body["id"]][0] == "<user>Hi{reasoning_effort=low}<assistant>"

    with caplog.at_level(logging.WARNING, logger="twogrid.serve"):
        from dispatcher.serve import protocol

        protocol._warned.clear()
        run(go())
    warned = [rec.getMessage() for rec in caplog.records if "accepted and ignored" in rec.getMessage()]
    for field in ("metadata", "store", "service_tier", "user", "safety_identifier", "prediction", "modalities"):
        assert sum(f"'{field}'" in m for m in warned) == 1, (field, warned)


def test_x_request_id_is_the_request_id():
    async def go():
        engine = FakeEngine(delay_s=0.01)
        async with served(engine) as c:
            async def post():
                return await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                                    headers={"X-Request-Id": "client-7"})
            import asyncio

            r1, r2 = await asyncio.gather(post(), post())  # the same id twice at once: both served
            b1, b2 = await r1.json(), await r2.json()
            assert r1.status == r2.status == 200
            assert b1["id"] == b2["id"] == "cmpl-client-7"
            assert r1.headers["X-Request-Id"] == r2.headers["X-Request-Id"] == "client-7"
            assert len([rid for rid in engine.requests if rid.startswith("cmpl-client-7")]) == 2
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "max_tokens": 1, "stream": True},
                             headers={"X-Request-Id": "s-1"})
            events = await sse(r)
            assert r.headers["X-Request-Id"] == "s-1" and events[0]["id"] == "chatcmpl-s-1"
            # an id of 5,000 characters would be every log line's and the engine's: refused, naming the header
            r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                             headers={"X-Request-Id": "x" * 5000})
            err = await error_of(r, 400)
            assert err["param"] == "X-Request-Id" and "at most 256" in err["message"]
            r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                             headers={"X-Request-Id": "y" * 256})
            assert (await r.json())["id"] == "cmpl-" + "y" * 256

    run(go())


def test_an_x_request_id_that_is_not_printable_utf8_is_refused_naming_it():
    """The id is sent to the engine as UTF-8 and written in every log line: a header byte that is not UTF-8 (the
    server decodes headers with surrogate escapes) or a control character is refused with a 400 naming the header,
    for completions and chat alike, nothing reaches the engine, and the server goes on."""
    import json

    async def raw_post(c, path: str, body: dict, request_id: bytes) -> tuple[int, dict]:
        """The request written as bytes (an HTTP client would re-encode the header's value)."""
        data = json.dumps(body).encode()
        reader, writer = await asyncio.open_connection(c.server.host, c.server.port)
        writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Request-Id: " + request_id + b"\r\nContent-Length: " + str(len(data)).encode()
                     + b"\r\nConnection: close\r\n\r\n" + data)
        response = await reader.read()
        writer.close()
        head, _, payload = response.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(payload)

    async def go():
        engine = FakeEngine()
        async with served(engine) as c:
            for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 1})):
                for given, word in ((b"caf\xe9", "UTF-8"), (b"a\tb", "control character")):
                    status, payload = await raw_post(c, path, body, given)
                    err = payload["error"]
                    assert status == 400 and err["param"] == "X-Request-Id" and word in err["message"], payload
            assert not engine.requests
            r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": "ok"})
            assert r.status == 200

    run(go())


def test_error_code_is_the_http_status():
    async def go():
        async with served(api_key=KEY) as c:
            r = await c.post("/v1/completions", json={"prompt": "Hi"})
            assert (await error_of(r, 401))["code"] == 401
            auth = {"Authorization": f"Bearer {KEY}"}
            r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": -1}, headers=auth)
            assert (await error_of(r, 400))["code"] == 400
            r = await c.get("/nope", headers=auth)
            assert (await error_of(r, 404))["code"] == 404

    run(go())


def test_chat_messages_missing_what_openai_requires_are_400():
    async def go():
        async with served() as c:
            for role in ("user", "system"):
                r = await c.post("/v1/chat/completions", json={"messages": [{"role": role}]})
                err = await error_of(r, 400)
                assert err["param"] == "messages[0].content" and role in err["message"]
            # OpenAI's rules: an assistant message has content or tool calls, a part list is not empty, a tool
            # message names the call it answers (all three answered 200 before)
            call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            for messages, param in (([{"role": "user", "content": "Hi"}, {"role": "assistant"}], "messages[1].content"),
                                    ([{"role": "user", "content": []}], "messages[0].content"),
                                    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [call]},
                                      {"role": "tool", "content": "42"}], "messages[2].tool_call_id")):
                r = await c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
                assert (await error_of(r, 400))["param"] == param
            r = await c.post("/v1/chat/completions", json={"messages": [
                {"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}], "max_tokens": 1})
            assert r.status == 200  # (an assistant message with tool calls needs no content)

    run(go())


def test_tokenize_detokenize_version_ping():
    async def go():
        async with served(api_key=KEY) as c:
            auth = {"Authorization": f"Bearer {KEY}"}
            r = await c.post("/tokenize", json={"prompt": "Hi", "return_token_strs": False}, headers=auth)
            assert await r.json() == {"count": 3, "max_model_len": 128, "tokens": [1, 72, 105], "token_strs": None}
            r = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, headers=auth)
            body = await r.json()
            assert body["tokens"] == [ord(x) for x in "<user>Hi<assistant>"]  # (add_special_tokens false)
            # tools go to the chat template, as a chat request's (refused as an unknown field before)
            tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            r = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}], "tools": [tool]},
                             headers=auth)
            assert (await r.json())["tokens"] == [ord(x) for x in "<user>Hi{tools=1}<assistant>"]
            r = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}],
                                                "reasoning_effort": "high"}, headers=auth)
            assert (await r.json())["tokens"] == [ord(x) for x in "<user>Hi{reasoning_effort=high}<assistant>"]
            r = await c.post("/detokenize", json={"tokens": [72, 105]}, headers=auth)
            assert await r.json() == {"prompt": "Hi"}
            r = await c.post("/detokenize", json={"tokens": [72, 99999]}, headers=auth)
            assert (await error_of(r, 400))["param"] == "tokens"
            r = await c.post("/tokenize", json={"prompt": "Hi", "model": "other"}, headers=auth)
            await error_of(r, 404)
            r = await c.post("/tokenize", json={"promt": "Hi"}, headers=auth)
            assert (await error_of(r, 400))["param"] == "promt"
            # both forms at once: said so (it was "unknown field 'prompt'", a field the route takes)
            r = await c.post("/tokenize", json={"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]},
                             headers=auth)
            err = await error_of(r, 400)
            assert err["param"] == "prompt" and "not both" in err["message"], err
            version = await (await c.get("/version", headers=auth)).json()
            assert set(version) == {"version"} and version["version"]
            for method in (c.get, c.post):  # /ping as /health, with no key
                assert (await method("/ping")).status == 200

    run(go())


def test_the_token_strings_of_a_real_tokenizer(bpe):
    from models.text import load_tokenizer

    async def go():
        engine = FakeEngine()
        engine.tokenizer = load_tokenizer(bpe)
        async with served(engine) as c:
            body = await (await c.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})).json()
            assert "".join(body["token_strs"]).replace("\u0120", " ") == "hello world"
            assert body["count"] == len(body["tokens"]) == len(body["token_strs"])

    run(go())


def test_cors_as_vllms_flags_set_it():
    origin = "https://app.example"

    async def go():
        async with served(api_key=KEY) as c:  # no --allowed-origins: no cross-origin access
            r = await c.options("/v1/completions", headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
            assert "Access-Control-Allow-Origin" not in r.headers
        cors = Cors(allowed_origins=(origin,), allowed_methods=("GET", "POST"), allow_credentials=True)
        async with served(api_key=KEY, cors=cors) as c:
            preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                         "Access-Control-Request-Headers": "authorization,content-type"}
            r = await c.options("/v1/completions", headers=preflight)  # a preflight carries no key
            assert r.status == 200
            assert r.headers["Access-Control-Allow-Origin"] == origin
            assert r.headers["Access-Control-Allow-Credentials"] == "true"
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                             headers={"Origin": origin, "Authorization": f"Bearer {KEY}"})
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == origin
            r = await c.get("/v1/models", headers={"Origin": "https://other.example", "Authorization": f"Bearer {KEY}"})
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
            r = await c.options("/v1/completions", headers={**preflight, "Access-Control-Request-Method": "DELETE"})
            assert "DELETE" in (await error_of(r, 400))["message"]  # (vLLM's Starlette: 400; aiohttp-cors: 403)
            r = await c.options("/v1/completions", headers={**preflight, "Origin": "https://other.example"})
            assert "other.example" in (await error_of(r, 400))["message"]
        async with served(cors=Cors(allowed_origins=("*",))) as c:
            r = await c.get("/v1/models", headers={"Origin": origin})
            assert r.headers["Access-Control-Allow-Origin"] in ("*", origin)

    run(go())


QWEN3_THINKING = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                  "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                  "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
                  "{% endif %}{% endif %}")


def test_chat_template_fields_as_vllm_takes_them(bpe):
    """chat_template_kwargs reach the template (Qwen3's enable_thinking); continue_final_message ends the prompt
    with the last message's text, without its end of turn, in chat and /tokenize; add_special_tokens adds the
    tokenizer's own; each misuse is a 400 naming the field."""
    from models.text import tokenizer_from_dir

    tok = tokenizer_from_dir(bpe)
    tok.chat_template = QWEN3_THINKING
    engine = FakeEngine(max_model_len=4096)
    engine.tokenizer = tok
    ask = [{"role": "user", "content": "What is 2 + 2?"}]
    partial = [*ask, {"role": "assistant", "content": "The answer is"}]

    async def prompt_of(c, **body):
        r = await c.post("/v1/chat/completions", json={"max_tokens": 1, **body})
        out = await r.json()
        assert r.status == 200, out
        return engine.requests[out["id"]][0]

    async def go():
        async with served(engine) as c:
            assert (await prompt_of(c, messages=ask)).endswith("<|im_start|>assistant\n")
            thinking_off = await prompt_of(c, messages=ask, chat_template_kwargs={"enable_thinking": False})
            assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
            continued = await prompt_of(c, messages=partial, add_generation_prompt=False, continue_final_message=True)
            assert continued.endswith("<|im_start|>assistant\nThe answer is")
            r = await c.post("/tokenize", json={"messages": partial, "add_generation_prompt": False,
                                                "continue_final_message": True})
            assert (await r.json())["tokens"] == tok.encode(continued, False)
            for body, param in [({"messages": partial, "continue_final_message": True}, "continue_final_message"),
                                ({"messages": ask, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
                                 "chat_template_kwargs"),
                                ({"messages": ask, "chat_template_kwargs": {"add_generation_prompt": False}},
                                 "chat_template_kwargs"),
                                ({"messages": [{"role": "user", "content": " "}], "add_generation_prompt": False,
                                  "continue_final_message": True}, "messages"),
                                ({"messages": ask, "chat_template_kwargs": ["enable_thinking"]},
                                 "chat_template_kwargs")]:
                r = await c.post("/v1/chat/completions", json={"max_tokens": 1, **body})
                assert (await error_of(r, 400))["param"] == param, body
            r = await c.post("/tokenize", json={"messages": partial, "continue_final_message": True})
            assert (await error_of(r, 400))["param"] == "continue_final_message"
            # variables named as the code's own arguments are the template's alone (they were a 500)
            names = {k: 1 for k in ("self", "fn", "size", "param", "template", "variables", "scope", "kwargs")}
            assert (await prompt_of(c, messages=ask, chat_template_kwargs=names)).endswith("assistant\n")
            r = await c.post("/tokenize", json={"messages": ask, "chat_template_kwargs": names})
            assert r.status == 200
            # a short text to continue ends the prompt, not a piece of the end-of-turn markup that contains it
            for short in ("d", "e", "<", "|"):
                got = await prompt_of(c, messages=[*ask, {"role": "assistant", "content": short}],
                                      add_generation_prompt=False, continue_final_message=True)
                assert got.endswith("<|im_start|>assistant\n" + short), (short, got[-30:])

    run(go())


def test_chat_add_special_tokens_adds_the_tokenizers_own():
    async def go():
        async with served() as c:
            for add, first in ((False, ord("<")), (True, 1)):  # (the fake tokenizer's BOS is 1)
                r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                               "max_tokens": 1, "add_special_tokens": add})
                body = await r.json()
                assert c.engine.requests[body["id"]][1][0] == first

    run(go())


def test_a_named_tool_call_opens_in_the_prompt_and_the_output_is_its_arguments():
    """tool_choice naming a function: the parser's opening of its call follows the generation prompt, the grammar
    is the function's parameters' schema, and the output (the arguments as far as written, here cut off at
    max_tokens) comes back as that one call, whole and streamed; with continue_final_message it is refused."""
    import json

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [weather], "max_tokens": 3,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}

    async def go():
        async with served(FakeEngine(max_model_len=4096), tool_call_parser="hermes") as c:
            r = await c.post("/v1/chat/completions", json=body)
            out = await r.json()
            assert r.status == 200, out
            prompt, ids, params = c.engine.requests[out["id"]]
            assert prompt.startswith("<user>Weather?{tools=")  # (the fake template writes its variables)
            assert prompt.endswith('}<assistant><tool_call>\n{"name": "get_weather", "arguments": ')
            assert ids == [ord(ch) for ch in prompt]
            assert json.loads(params.structured_outputs.json) == weather["function"]["parameters"]
            choice = out["choices"][0]
            assert choice["message"]["content"] is None and choice["finish_reason"] == "length"
            [call] = choice["message"]["tool_calls"]
            assert call["function"] == {"name": "get_weather", "arguments": "".join(WORDS[:3]).strip()}
            events = await sse(await c.post("/v1/chat/completions", json={**body, "stream": True}))
            deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
            calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
            assert [(tc["index"], tc["function"]["name"]) for tc in calls] == [(0, "get_weather")]
            assert calls[0]["function"]["arguments"] == call["function"]["arguments"]
            assert not any(d.get("content") for d in deltas)
            r = await c.post("/v1/chat/completions", json={**body, "messages": [
                *body["messages"], {"role": "assistant", "content": "Let me"}], "add_generation_prompt": False,
                "continue_final_message": True})
            assert (await error_of(r, 400))["param"] == "tool_choice"
            r = await c.post("/v1/chat/completions", json={**body, "add_generation_prompt": False})
            assert (await error_of(r, 400))["param"] == "tool_choice"

    run(go())


def test_a_batch_of_prompts_answers_each_in_order_whole_and_streamed():
    """vLLM's batched completions: prompt i's choice j is choice i * n + j, each prompt an engine request of its
    own (all queued before any output), the usage summed; streamed, every chunk names its choice; a prompt the
    engine refuses fails the request before any output."""
    prompts = ["Hi", [72, 105, 33], "Hey you"]

    async def go():
        async with served() as c:
            r = await c.post("/v1/completions", json={"prompt": prompts, "max_tokens": 2, "n": 2, "temperature": 1,
                                                      "logprobs": 0})
            body = await r.json()
            assert r.status == 200, body
            assert [ch["index"] for ch in body["choices"]] == list(range(6))
            assert [ch["text"] for ch in body["choices"]] == [choice_text(j, 2) for _ in prompts for j in range(2)]
            asked = [c.engine.requests[f"{body['id']}-{i}"] for i in range(3)]
            assert [ids for _, ids, _ in asked] == [[1, 72, 105], [72, 105, 33], [1, *map(ord, "Hey you")]]
            assert body["usage"] == {"prompt_tokens": 3 + 3 + 8, "completion_tokens": 12, "total_tokens": 26}
            events = await sse(await c.post("/v1/completions", json={
                "prompt": prompts, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}))
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 9
            texts = {}
            for e in events[:-2]:
                [ch] = e["choices"]
                texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            assert texts == {i: choice_text(0, 3) for i in range(3)}
            r = await c.post("/v1/completions", json={"prompt": ["Hi", "x" * 200], "max_tokens": 2})
            assert (await error_of(r, 400))["param"] == "prompt[1]"
        # two batches at once with one X-Request-Id: each engine request live at once has an id of its own
        async with served(FakeEngine(delay_s=0.05)) as c:
            same = {"X-Request-Id": "dup"}
            answers = await asyncio.gather(*(c.post("/v1/completions", headers=same, json={
                "prompt": ["hello", "world"], "max_tokens": 2}) for _ in range(2)))
            assert [a.status for a in answers] == [200, 200] and len(c.engine.requests) == 4

    run(go())


def test_a_batch_prompt_the_engine_refuses_is_named():
    """The engine's own refusal of one prompt of a batch names it (``prompt[i]``)."""
    async def go():
        engine = FakeEngine(max_model_len=1000)
        engine.engine_max_model_len = 128
        async with served(engine) as c:
            r = await c.post("/v1/completions", json={"prompt": ["hi", "x" * 150], "max_tokens": 5})
            err = await error_of(r, 400)
            assert err["param"] == "prompt[1]" and err["message"].startswith("'prompt[1]': "), err

    run(go())


def test_a_batch_fails_or_goes_away_as_a_whole():
    """An engine failure in a batch: 500 whole, an error event then [DONE] streamed; a client gone mid-stream
    aborts every prompt still running."""
    from test_serve_app import wait_for

    async def go():
        async with served(FakeEngine(fail_after=2)) as c:
            err = await error_of(await c.post("/v1/completions", json={"prompt": ["hi", "yo"], "max_tokens": 5}), 500)
            assert "worker process died" in err["message"]
            events = await sse(await c.post("/v1/completions", json={"prompt": ["hi", "yo"], "max_tokens": 5,
                                                                     "stream": True}))
            assert events[-1] == "[DONE]" and "worker process died" in events[-2]["error"]["message"]
        engine = FakeEngine(delay_s=0.02)
        async with served(engine) as c:
            r = await c.post("/v1/completions", json={"prompt": ["hi", "yo", "hey"], "max_tokens": 100,
                                                      "stream": True})
            await r.content.readuntil(b"\n\n")
            r.close()
            await wait_for(lambda: sorted(engine.aborted) == sorted(engine.requests))
            assert len(engine.aborted) == 3 and not engine.live

    run(go())
