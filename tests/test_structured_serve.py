"""Structured outputs and tool calls through a real ``twogrid serve`` on the CPU with the default model
(SmolLM2-135M-Instruct), driven by the official ``openai`` client (issue 31): every constraint of a set of 24
(JSON schemas with nested objects, enums, arrays, required fields, patterns, $refs, unions; regexes; choices; an
EBNF grammar; any JSON) gives output that satisfies it, greedy and sampled, streamed and not, on both endpoints and
sent all at once (so that constrained steps overlap: their bitmasks follow the steps); and a forced tool call is
parsed, whole and streamed, for a Hermes template (``--tool-call-parser hermes``) and a Llama 3 one
(``llama3_json``), from the test templates in tests/data. Marked ``slow``: two servers of the real model."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re

import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serverutil import REPO, Server  # noqa: E402

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "16"]
HERMES = os.path.join(REPO, "tests", "data", "hermes_tools.jinja")
LLAMA3 = os.path.join(REPO, "tests", "data", "llama3_tools.jinja")

S = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "flat object": {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120}}, "required": ["name", "age"]},
    "string enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                    "required": ["color"]},
    "integer enum": {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}},
                     "required": ["level"]},
    "boolean": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    "bounded number": {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100}},
                       "required": ["price"]},
    "array of strings": {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1,
                                                                   "maxItems": 3}}, "required": ["tags"]},
    "array of bounded ints": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                              "minItems": 2, "maxItems": 4},
    "array of objects": {"type": "object", "properties": {"people": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"name": S}, "required": ["name"]}}}, "required": ["people"]},
    "nested object": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": S, "address": {"type": "object", "properties": {"city": S, "zip": {"type": "string",
                                                                                   "pattern": "[0-9]{5}"}},
                               "required": ["city", "zip"]}}, "required": ["name", "address"]}},
                      "required": ["user"]},
    "three levels": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "integer", "maximum": 99, "minimum": 0}}, "required": ["c"]}},
        "required": ["b"]}}, "required": ["a"]},
    "optional fields": {"type": "object", "properties": {"title": S, "subtitle": S}, "required": ["title"]},
    "pattern": {"type": "object", "properties": {"date": {"type": "string", "pattern": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}},
                "required": ["date"]},
    "const": {"type": "object", "properties": {"version": {"const": "v1"}, "name": S},
              "required": ["version", "name"]},
    "union": {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0,
                                                                 "maximum": 999}, S]}}, "required": ["id"]},
    "nullable": {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 12}},
                 "required": ["note"]},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                                         "maximum": 9},
                                                                   "y": {"type": "integer", "minimum": -9,
                                                                         "maximum": 9}},
                                 "required": ["x", "y"]}},
             "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
             "required": ["start", "end"]},
    "no extra properties": {"type": "object", "properties": {"k": S}, "required": ["k"],
                            "additionalProperties": False},
    "enum array": {"type": "object", "properties": {"days": {"type": "array", "maxItems": 3, "items": {
        "enum": ["mon", "tue", "wed"]}}}, "required": ["days"]},
}
OTHER = {  # (structured_outputs field, value, check); any JSON is asked for greedily (sampled, it rambles on)
    "regex phone": ("regex", r"\(\d{3}\) \d{3}-\d{4}", lambda text: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", text)),
    "regex word list": ("regex", r"(yes|no)(, (yes|no)){0,2}", lambda t: re.fullmatch(r"(yes|no)(, (yes|no)){0,2}",
                                                                                     t)),
    "choice": ("choice", ["positive", "negative", "neutral"], lambda t: t in ("positive", "negative", "neutral")),
    "json object": ("json_object", True, lambda t: isinstance(json.loads(t), dict)),
    "grammar": ("grammar", 'root ::= "SELECT " col " FROM " tbl\ncol ::= "id" | "name"\ntbl ::= "users" | "orders"',
                lambda t: re.fullmatch(r"SELECT (id|name) FROM (users|orders)", t)),
    "json via guided_json": ("guided_json", SCHEMAS["flat object"],
                             lambda t: jsonschema.validate(json.loads(t), SCHEMAS["flat object"]) is None),
}


@pytest.fixture(scope="module")
def hermes_server(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("hermes") / "server.log")
    server = Server([*SERVER_ARGS, "--chat-template", HERMES, "--tool-call-parser", "hermes",
                     "--enable-auto-tool-choice"], log).wait_healthy(600)
    yield server
    server.stop()


def client(server) -> tuple:
    c = openai.OpenAI(base_url=server.base + "/v1", api_key="none", timeout=300)
    return c, c.models.list().data[0].id


def _ask(c, model, name: str, case: int) -> tuple[str, str]:
    """One constrained request; (its text, its finish reason). Cases vary the endpoint, streaming and sampling."""
    if name in SCHEMAS:
        extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[name]}}}
        prompt = f"Reply with JSON ({name})."
    else:
        field, value, _ = OTHER[name]
        extra = {"extra_body": ({field: value} if field.startswith("guided") else {"structured_outputs":
                                                                                   {field: value}})}
        prompt = f"Answer ({name})."
    sampling = {"temperature": 0.7, "seed": case} if case % 3 == 1 else {}
    if case % 4 == 3:  # completions (response_format travels in the body)
        body = extra.get("extra_body", {}) | ({"response_format": extra["response_format"]}
                                              if "response_format" in extra else {})
        r = c.completions.create(model=model, prompt=prompt, max_tokens=160, extra_body=body, **sampling)
        return r.choices[0].text, r.choices[0].finish_reason
    messages = [{"role": "user", "content": prompt}]
    if case % 2:
        stream = c.chat.completions.create(model=model, messages=messages, max_tokens=160, stream=True, **extra,
                                           **sampling)
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=160, **extra, **sampling)
    return r.choices[0].message.content, r.choices[0].finish_reason


def test_every_constraint_gives_valid_output(hermes_server):
    """24 constraints sent at once (16 run together, so constrained steps overlap and their bitmasks follow them):
    each output satisfies its schema, regex, choice or grammar, and ends by EOS (finish reason stop)."""
    c, model = client(hermes_server)
    names = [*SCHEMAS, *OTHER]
    assert len(names) >= 24
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        answers = dict(zip(names, pool.map(lambda nc: _ask(c, model, *nc), [(n, i) for i, n in enumerate(names)])))
    bad = {}
    for name, (text, finish) in answers.items():
        try:
            if name == "json object" and finish == "length":  # an open object forces no end (SmolLM2 may
                assert text.lstrip().startswith("{")  # repeat keys until max_tokens): what it wrote so far
                continue
            if name in SCHEMAS:
                jsonschema.validate(json.loads(text), SCHEMAS[name])
            else:
                assert OTHER[name][2](text)
            assert finish == "stop"
        except Exception as exc:  # (collect every failure, not just the first)
            bad[name] = (text, finish, repr(exc)[:200])
    assert not bad, bad


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call, name: str) -> None:
    tool = WEATHER if name == "get_weather" else TIME
    assert call.type == "function" and call.function.name == name and call.id
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def _streamed_calls(stream) -> tuple[dict, str, str]:
    """OpenAI's streamed tool calls put together by index: {index: (id, name, arguments)}, the content, the finish
    reason."""
    calls, content, finish = {}, "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            cid, name, args = calls.get(tc.index, ("", "", ""))
            calls[tc.index] = (cid + (tc.id or ""), name + (tc.function.name or ""),
                               args + (tc.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return calls, content, finish


def _forced_calls(server, whole: bool = True) -> None:
    """Forced calls, streamed (named and required) and, with ``whole``, not streamed, then a history with a call
    and its result."""
    c, model = client(server)
    tools = [WEATHER, TIME]
    named = {"type": "function", "function": {"name": "get_weather"}}
    if whole:
        r = c.chat.completions.create(model=model, messages=ASK, tools=tools, tool_choice=named, max_tokens=80)
        msg = r.choices[0].message
        assert len(msg.tool_calls) == 1 and msg.content is None and r.choices[0].finish_reason == "stop", r
        _check_call(msg.tool_calls[0], "get_weather")
        r = c.chat.completions.create(model=model, messages=ASK, tools=tools, tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=80)
        assert len(r.choices[0].message.tool_calls) == 1 and r.choices[0].finish_reason == "tool_calls", r
        _check_call(r.choices[0].message.tool_calls[0], r.choices[0].message.tool_calls[0].function.name)
    for choice in (named, "required"):
        stream = c.chat.completions.create(model=model, messages=ASK, tools=tools, tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=80, stream=True)
        calls, content, finish = _streamed_calls(stream)
        assert list(calls) == [0] and not content.strip(), (calls, content)
        cid, name, args = calls[0]
        assert cid and (name == "get_weather" or choice == "required") and finish == (
            "stop" if choice is named else "tool_calls")
        jsonschema.validate(json.loads(args), (WEATHER if name == "get_weather" else TIME)["function"]["parameters"])
    if not whole:
        return
    # the call and its result in the history, rendered by the template, answered
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"}]
    r = c.chat.completions.create(model=model, messages=history, tools=tools, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.usage.prompt_tokens > 100


def test_forced_tool_calls_parse_whole_and_streamed_with_a_hermes_template(hermes_server):
    _forced_calls(hermes_server)
    c, model = client(hermes_server)
    r = c.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=40)  # auto: its choice
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for call in r.choices[0].message.tool_calls or []:
        json.loads(call.function.arguments)


def test_forced_tool_calls_parse_whole_and_streamed_with_a_llama3_template(tmp_path):
    server = Server([*SERVER_ARGS, "--chat-template", LLAMA3, "--tool-call-parser", "llama3_json"],
                    str(tmp_path / "server.log")).wait_healthy(600)
    try:
        _forced_calls(server, whole=False)  # (the whole responses take the hermes test's path)
        c, model = client(server)
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):  # auto needs the flag
            c.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=4)
    finally:
        server.stop()
