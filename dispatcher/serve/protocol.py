"""OpenAI's request and response types for ``/v1/completions`` and ``/v1/chat/completions``, as msgspec Structs.

Requests decode with a strict schema: an unknown field, a wrong type or a value out of range is one ``ApiError``
(HTTP 400) whose message and ``param`` name the field and the limit. OpenAI's sampling fields are served (``n``,
``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``echo``, ``logprobs``), and so are vLLM's extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``allowed_token_ids``, ``bad_words``,
``prompt_logprobs``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``stream_options.continuous_usage_stats``). OpenAI fields that do not change the output (``IGNORED_FIELDS``:
``metadata``, ``store``, ``service_tier``, ``user``, ...) are accepted and logged once, as vLLM ignores them;
``best_of`` is refused beyond ``n`` (vLLM's V1 engine removed it).

Responses have OpenAI's shape: ids ``cmpl-...`` / ``chatcmpl-...``, ``object``, ``created``, ``model``,
``choices``, ``usage``; streamed chunks are ``text_completion`` / ``chat.completion.chunk`` objects, and errors are
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from scheduler.request import MAX_LOGPROBS, MAX_N, MAX_TOP_K
from scheduler.structured import StructuredOutputError, StructuredOutputsParams

log = logging.getLogger("twogrid.serve")

MAX_STOP_STRINGS = 16
"""Stop strings per request at most. OpenAI documents 4 and vLLM sets no limit; the bound keeps the per-token stop
matching cheap while leaving room for clients ported from vLLM."""
MAX_STOP_STRING_CHARS = 1024
"""Characters per stop string at most (the output processor holds back text while it may still start one)."""
LOGPROB_FLOOR = -9999.0
"""Log-probabilities below this (-inf included) are sent as this value: JSON has no infinities (vLLM does the same)."""

Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
TokenId = Annotated[int, Meta(ge=0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
IGNORED_FIELDS = ("metadata", "store", "service_tier", "user", "safety_identifier", "prompt_cache_key",
                  "prompt_cache_retention", "prediction", "modalities")
"""OpenAI fields that do not change the output: accepted and ignored, each logged once (vLLM ignores them too)."""
_warned: set[str] = set()


class Cors(Struct, frozen=True):
    """Cross-origin browser access, as vLLM's flags set it (``--allowed-origins`` ...); no origins: none."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


class ApiError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI's error fields (``code``: the HTTP status,
    as vLLM sends it; ``reason``: our finer cause, in the log)."""

    def __init__(self, status: int, message: str, param: str | None = None, reason: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.reason = reason
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def info(self) -> "ErrorInfo":
        return ErrorInfo(self.message, self.type, self.param, self.status)

    def body(self) -> bytes:
        return msgspec.json.encode(ErrorResponse(self.info()))


# ---------------------------------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------------------------------


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    """A last chunk with ``usage`` and no choices (every other chunk has ``usage: null``)."""
    continuous_usage_stats: bool = False
    """vLLM's extension: ``usage`` so far on every chunk."""


class JsonSchemaFormat(Struct, forbid_unknown_fields=True):
    """``response_format.json_schema`` (OpenAI's)."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(Struct, forbid_unknown_fields=True):
    """OpenAI's ``response_format``: text (no constraint), any JSON object, a JSON schema; and vLLM's structural
    tag (``{"type": "structural_tag", "format": {...}}``, xgrammar's format)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None


class StructuredOutputsRequest(Struct, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` request field: one of json, regex, choice, grammar, json_object,
    structural_tag, with vLLM's options."""

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class _SamplingRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields both endpoints share."""

    model: str | None = None
    """The served model name; None (left out) means the one this server serves."""
    max_tokens: Annotated[int, Meta(ge=0)] | None = None
    """>= 1 (0 with ``echo``: the prompt alone)."""
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=MAX_TOP_K)] | None = None
    """vLLM's extension; -1 and 0 disable it."""
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    seed: Int64 | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = 1
    best_of: Annotated[int, Meta(ge=1)] | None = None
    """Refused beyond ``n`` (vLLM's V1 engine removed it)."""
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    logit_bias: dict[str, float] | None = None
    """Token ids (as strings, OpenAI's form) to a bias in [-100, 100]."""
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: TopLogprobs | None = None
    # OpenAI fields that do not change the output (IGNORED_FIELDS)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prediction: dict[str, Any] | None = None
    """OpenAI's predicted output: a latency hint, no change to the output."""
    modalities: list[Literal["text"]] | None = None
    """OpenAI's output modalities: text only here (audio is refused, naming the field)."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    """vLLM's older names (removed in vLLM 0.12, still sent by clients written for it): structured_outputs' json,
    regex, choice and grammar."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    """Accepted as "xgrammar" or "auto" (the only backend here)."""
    guided_whitespace_pattern: str | None = None


class CompletionRequest(_SamplingRequest, kw_only=True):
    prompt: str | list[int | str | list[int]]
    """Text, token ids, or a list of texts or token-id lists (a batch: ``batch_prompts``)."""
    logprobs: TopLogprobs | None = None
    """Top log-probabilities per output token (0..20); None for none."""
    echo: bool | None = False
    """The prompt before the output (its tokens' log-probabilities too, with ``logprobs``); with ``max_tokens``
    0, the prompt alone."""
    suffix: str | None = None


class ContentPart(Struct, forbid_unknown_fields=True):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served. The other kinds' payloads
    (OpenAI's and vLLM's) are decoded so that ``message_text`` refuses the part by its kind; a key no kind has is
    refused as an unknown field, and a text part carrying another kind's payload is refused naming it (an image
    must not be dropped without a word)."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    video_url: Any = None
    audio_url: Any = None
    refusal: Any = None
    cache_control: Any = None
    """A prompt-caching hint some clients put on parts (Anthropic's form): accepted and ignored, logged once (the
    prefix cache here is automatic; it does not change the output)."""


OTHER_PART_PAYLOADS = ("image_url", "input_audio", "file", "video_url", "audio_url", "refusal")


class FunctionCallIn(Struct, forbid_unknown_fields=True):
    name: str
    arguments: str
    """JSON text."""


class ToolCallIn(Struct, forbid_unknown_fields=True):
    """A tool call in an assistant message of the history."""

    function: FunctionCallIn
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessage(Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    """An assistant's calls (its content may then be null)."""
    tool_call_id: str | None = None
    """A tool message: the call it answers."""


class FunctionDefinition(Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments (an object); none: any object."""
    strict: bool | None = None


class ToolDefinition(Struct, forbid_unknown_fields=True, omit_defaults=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    """OpenAI's current name for ``max_tokens``; wins when both are given."""
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: "auto" with tools, as OpenAI's and vLLM's."""
    parallel_tool_calls: bool | None = True
    """False: at most one call (a forced call's grammar stops after one)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """The prompt ends with the last message's text, for the model to go on with it (vLLM's; needs
    ``add_generation_prompt`` false)."""
    add_special_tokens: bool = False
    """Special tokens (BOS) added to the rendered prompt by the tokenizer as well as the template's (vLLM's)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the chat template (e.g. Qwen3's ``enable_thinking``)."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    """OpenAI's; given to the chat template as the variable ``reasoning_effort``, as vLLM does (a template that
    reads it, gpt-oss's, says how long to think; others ignore it); one set in ``chat_template_kwargs`` wins."""
    echo: bool = False
    """vLLM's: each choice's content starts with the last message's text where that message is the assistant's (the
    message ``continue_final_message`` goes on with: ``chat_echo``)."""


def chat_echo(req: ChatCompletionRequest) -> str | None:
    """What ``echo`` puts before each choice's content: the last message's text (``message_text``, as the template
    reads it) where it is the assistant's, else "" (vLLM's rule); None without ``echo``."""
    if not req.echo:
        return None
    last = req.messages[-1]
    return message_text(len(req.messages) - 1, last) if last.role == "assistant" else ""


class TokenizeCompletionRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /tokenize with messages (rendered by the chat template)."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    """Passed to the chat template, as a chat request's are (vLLM's chat tokenize request takes them)."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    """As a chat request's: the template's variable ``reasoning_effort`` (so /tokenize renders what a chat request
    with it would)."""
    return_token_strs: bool | None = False


class DetokenizeRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Struct):
    prompt: str


_DECODERS = {cls: msgspec.json.Decoder(cls) for cls in (CompletionRequest, ChatCompletionRequest, DetokenizeRequest)}
_AT_PATH = re.compile(r" - at `\$\.?(.*)`$")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")
_MISSING = re.compile(r"Object missing required field `([^`]*)`")
_UNKNOWN_HINTS = {"functions": " (OpenAI's deprecated function calling: send 'tools')",
                  "function_call": " (OpenAI's deprecated function calling: send 'tool_choice')"}


def decode_tokenize(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A /tokenize body: with ``messages`` a chat one, else a prompt one."""
    data = _decode(body, None)
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", reason="invalid_type")
    if "messages" in data and "prompt" in data:
        raise ApiError(400, "a /tokenize request has 'prompt' or 'messages', not both", param="prompt")
    cls = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
    return _decode(body, cls, lambda _: msgspec.convert(data, cls))


def decode_detokenize(body: bytes) -> DetokenizeRequest:
    return _decode(body, DetokenizeRequest)


def decode_request(body: bytes, cls: type[CompletionRequest] | type[ChatCompletionRequest]):
    """The body as a request of type ``cls``, checked; ApiError (400) naming the field otherwise."""
    req = _decode(body, cls)
    _check_common(req)
    _note_ignored(req)
    return req


def _decode(body: bytes, cls, decode=None):
    """``body`` as ``cls`` (None: any JSON), by ``decode(body)`` if given; ApiError (400) naming the field."""
    if not body:
        raise ApiError(400, "the request body is empty; send a JSON object", reason="invalid_json")
    try:
        req = (decode or (_DECODERS[cls].decode if cls is not None else msgspec.json.decode))(body)
    except msgspec.ValidationError as exc:
        raise _schema_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", reason="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", reason="invalid_json") from None
    return req


def _note_ignored(req: _SamplingRequest) -> None:
    """Log each ignored OpenAI field once per process (the first request that sends it)."""
    for name in IGNORED_FIELDS:
        if getattr(req, name) is not None:
            _warn_once(name, f"requests send the OpenAI field '{name}': accepted and ignored (it does not change the "
                             f"output; vLLM ignores it too); logged once")


def _warn_once(key: str, message: str) -> None:
    """``message`` logged the first time ``key`` is met in this process."""
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)


def _schema_error(text: str) -> ApiError:
    at = _AT_PATH.search(text)
    path = at.group(1) if at else ""
    message = text[:at.start()] if at else text
    if (m := _UNKNOWN.match(message)) is not None:
        field = f"{path}.{m.group(1)}" if path else m.group(1)
        hint = _UNKNOWN_HINTS.get(field, "")
        return ApiError(400, f"unknown field '{field}'; this server does not support it{hint}", param=field,
                        reason="unknown_field")
    if (m := _MISSING.match(message)) is not None:
        field = f"{path}.{m.group(1)}" if path else m.group(1)
        return ApiError(400, f"'{field}' is required", param=field, reason="missing_field")
    if not path:
        return ApiError(400, f"the request body must be a JSON object ({message})", reason="invalid_type")
    return ApiError(400, f"'{path}': {message}", param=path, reason="invalid_value")


def logit_bias(req: _SamplingRequest) -> dict[int, float] | None:
    """``logit_bias`` with integer token ids (OpenAI sends them as strings)."""
    if not req.logit_bias:
        return None
    out = {}
    for key, value in req.logit_bias.items():
        if not (key.isascii() and key.isdigit()):  # (int() would take " 42", "+7" and "1_0" too)
            raise ApiError(400, f"'logit_bias' has the key {key!r}; keys are token ids (decimal digits)",
                           param="logit_bias")
        out[int(key)] = value
    return out


def _check_common(req: _SamplingRequest) -> None:
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise ApiError(400, f"'best_of' = {req.best_of} is not supported (only best_of = n): vLLM's V1 engine "
                            f"removed best_of (vLLM ignores the field); ask for 'n' choices with 'logprobs' and "
                            f"choose among them", param="best_of")
    if req.prompt_logprobs is not None and req.stream:
        raise ApiError(400, "'prompt_logprobs' are not available with 'stream': true (as in vLLM)",
                       param="prompt_logprobs")
    logit_bias(req)
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    stops = stop_strings(req.stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", param="stop")
    for i, s in enumerate(stops):
        if not s:
            raise ApiError(400, f"'stop[{i}]' is empty; stop strings must be non-empty", param="stop")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ApiError(400, f"'stop[{i}]' has {len(s)} characters; at most {MAX_STOP_STRING_CHARS} are allowed",
                           param="stop")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise ApiError(400, "'suffix' is not supported", param="suffix")
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(400, "'max_tokens' must be >= 1 (0 only with 'echo': the prompt alone)",
                           param="max_tokens")
    else:
        if req.max_tokens == 0:
            raise ApiError(400, "'max_tokens' must be >= 1", param="max_tokens")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")


_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


def structured_outputs(req: _SamplingRequest) -> StructuredOutputsParams | None:
    """The request's output constraint, from ``response_format`` (not "text"), ``structured_outputs`` or the older
    ``guided_*`` fields: one of them at most; ApiError (400) naming the field when it is malformed or over a
    limit (``scheduler.structured``). None without one."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        found.append(("response_format", _response_format(rf)))
    so = req.structured_outputs
    if so is not None:
        if so.whitespace_pattern is not None:
            raise ApiError(400, "'structured_outputs.whitespace_pattern' is not supported (xgrammar has no whitespace "
                                "patterns); 'disable_any_whitespace' is", param="structured_outputs.whitespace_pattern")
        found.append(("structured_outputs", StructuredOutputsParams(
            json=_schema_text(so.json, "structured_outputs.json"), regex=so.regex, choice=so.choice,
            grammar=so.grammar, json_object=so.json_object, structural_tag=so.structural_tag,
            disable_any_whitespace=so.disable_any_whitespace,
            disable_additional_properties=so.disable_additional_properties)))
    for name, kind in _GUIDED:
        value = getattr(req, name)
        if value is not None:
            value = _schema_text(value, name) if kind == "json" else value
            found.append((name, StructuredOutputsParams(**{kind: value, "where": name})))
    if req.guided_decoding_backend not in (None, "xgrammar", "auto"):
        raise ApiError(400, f"'guided_decoding_backend' {req.guided_decoding_backend!r} is not available; this "
                            f"server's backend is xgrammar", param="guided_decoding_backend")
    if req.guided_whitespace_pattern is not None:
        raise ApiError(400, "'guided_whitespace_pattern' is not supported (xgrammar has no whitespace patterns)",
                       param="guided_whitespace_pattern")
    if len(found) > 1:
        raise ApiError(400, f"only one output constraint per request; got {', '.join(f for f, _ in found)}",
                       param=found[1][0])
    if not found:
        return None
    field, params = found[0]
    try:
        params.validate()
    except StructuredOutputError as exc:
        raise ApiError(400, str(exc), param=field) from None
    return params


def _response_format(rf: ResponseFormat) -> StructuredOutputsParams:
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True, where="response_format")
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise ApiError(400, "'response_format.json_schema.schema' is required with type json_schema",
                           param="response_format.json_schema.schema")
        return StructuredOutputsParams(json=_schema_text(rf.json_schema.schema, "response_format"),
                                       where="response_format")
    if rf.format is None:
        raise ApiError(400, "'response_format.format' is required with type structural_tag",
                       param="response_format.format")
    return StructuredOutputsParams(structural_tag=_schema_text({"type": "structural_tag", "format": rf.format},
                                                               "response_format"), where="response_format")


def _schema_text(value, field: str) -> str | None:
    """A schema given as an object (or as JSON text) as JSON text, its keys in their order (the order the model
    writes the properties in)."""
    if value is None or isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (RecursionError, ValueError):
        raise ApiError(400, f"'{field}' is nested too deeply", param=field) from None


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


MAX_BATCH_PROMPTS = 256
"""Prompts in one completion request (vLLM sets none)."""


def is_prompt_batch(prompt) -> bool:
    """Several prompts: a list of two or more strings or token-id lists (a list of one string is one prompt)."""
    return isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(p, int) for p in prompt)


def batch_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """A batch's prompts, each a string or a list of token ids (each then checked as a prompt of its own)."""
    prompts = req.prompt
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise ApiError(400, f"'prompt' has {len(prompts)} prompts; at most {MAX_BATCH_PROMPTS} in one request",
                       param="prompt")
    for i, p in enumerate(prompts):
        if not (isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p))):
            raise ApiError(400, f"'prompt[{i}]' must be a string or a list of token ids, as the other prompts of a "
                                f"batch", param=f"prompt[{i}]")
    return list(prompts)


def sum_usage(usages: list[Usage]) -> Usage:
    """A batch's usage: its prompts' summed."""
    cached = [u.prompt_tokens_details.cached_tokens for u in usages if u.prompt_tokens_details is not None]
    return usage(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages),
                 sum(cached) if cached else None)


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: its text or its token ids."""
    p = req.prompt
    if isinstance(p, str):
        if not p:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        return p
    if p and all(isinstance(t, int) for t in p):
        bad = next((t for t in p if t < 0), None)
        if bad is not None:
            raise ApiError(400, f"'prompt' has token id {bad}; token ids are >= 0", param="prompt")
        return p  # type: ignore[return-value]
    if len(p) == 1 and isinstance(p[0], (str, list)):
        return completion_prompt(CompletionRequest(prompt=p[0]))
    if not p:
        raise ApiError(400, "'prompt' is an empty list", param="prompt")
    raise ApiError(400, f"'prompt' must be a string, a list of token ids, or a list of strings or token-id lists "
                        f"(a batch); got a list of {len(p)} items", param="prompt")


def chat_messages(req: ChatCompletionRequest | TokenizeChatRequest) -> list[dict]:
    """The messages as the chat template reads them: text parts joined by newlines; an assistant's tool calls with
    their arguments as objects (as vLLM and transformers hand them to templates, which write ``arguments |
    tojson``), a tool message's ``tool_call_id``. Every message but an assistant's needs its content, an
    assistant's its content or tool calls, a tool message its ``tool_call_id`` (OpenAI's rules)."""
    out = []
    for i, m in enumerate(req.messages):
        if m.content is None and m.role != "assistant":
            raise ApiError(400, f"'messages[{i}].content' is required for a message of role '{m.role}'",
                           param=f"messages[{i}].content")
        if isinstance(m.content, list) and not m.content:
            raise ApiError(400, f"'messages[{i}].content' is an empty list of parts: give at least one",
                           param=f"messages[{i}].content")
        if m.role == "assistant" and m.content is None and not m.tool_calls:
            raise ApiError(400, f"'messages[{i}]': an assistant message needs 'content' or 'tool_calls'",
                           param=f"messages[{i}].content")
        if m.role == "tool" and m.tool_call_id is None:
            raise ApiError(400, f"'messages[{i}].tool_call_id' is required for a message of role 'tool' (the call "
                                f"it answers)", param=f"messages[{i}].tool_call_id")
        msg: dict[str, Any] = {"role": m.role, "content": message_text(i, m)}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise ApiError(400, f"'messages[{i}].tool_calls': only assistant messages have tool calls",
                               param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = [{"id": c.id, "type": c.type,
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in m.tool_calls]
        if m.tool_call_id is not None:
            if m.role != "tool":
                raise ApiError(400, f"'messages[{i}].tool_call_id': only tool messages answer a call",
                               param=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


TEMPLATE_ARGUMENTS_SET_BY_REQUEST = ("messages", "tools", "add_generation_prompt", "continue_final_message",
                                     "chat_template")


def chat_template_options(req: ChatCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    """The chat template's arguments besides the messages (and tools): ``add_generation_prompt``,
    ``continue_final_message`` and ``variables`` (``chat_template_kwargs``). A variable the request sets otherwise, or
    ``chat_template`` (a template is the server's to choose), is refused."""
    if req.continue_final_message and req.add_generation_prompt:
        raise ApiError(400, "'continue_final_message' continues the last message: set 'add_generation_prompt' to "
                            "false with it", param="continue_final_message")
    extra = req.chat_template_kwargs or {}
    taken = sorted(set(extra) & set(TEMPLATE_ARGUMENTS_SET_BY_REQUEST))
    if taken:
        raise ApiError(400, f"'chat_template_kwargs' may not set {', '.join(map(repr, taken))} (the request's own "
                            f"fields, or the server's template)", param="chat_template_kwargs")
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None and "reasoning_effort" not in extra:
        extra = {**extra, "reasoning_effort": effort}
    return {"add_generation_prompt": req.add_generation_prompt, "continue_final_message": req.continue_final_message,
            "variables": extra}


def message_text(i: int, m: ChatMessage) -> str:
    """Message ``i``'s text: its content, text parts joined by newlines ("" for none); ApiError naming a part that
    is not text."""
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    texts = []
    for j, part in enumerate(m.content):
        if part.type != "text":
            raise ApiError(400, f"'messages[{i}].content[{j}]': only text parts are supported, got type "
                                f"{part.type!r}", param=f"messages[{i}].content[{j}]")
        if part.text is None:
            raise ApiError(400, f"'messages[{i}].content[{j}].text' is required for a text part",
                           param=f"messages[{i}].content[{j}].text")
        if part.cache_control is not None:
            _warn_once("cache_control", "requests send 'cache_control' on content parts: accepted and ignored "
                                        "(prefix caching is automatic); logged once")
        other = next((name for name in OTHER_PART_PAYLOADS if getattr(part, name) is not None), None)
        if other is not None:
            raise ApiError(400, f"'messages[{i}].content[{j}].{other}': a text part carries only its 'text' (only "
                                f"text parts are supported)", param=f"messages[{i}].content[{j}].{other}")
        texts.append(part.text)
    return "\n".join(texts)


def _arguments(text: str):
    """A call's arguments as an object for the template (the text itself when it is not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


# ---------------------------------------------------------------------------------------------------------------
# responses
# ---------------------------------------------------------------------------------------------------------------


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None
    code: int
    """The HTTP status (vLLM's ``code``)."""


class ErrorResponse(Struct):
    error: ErrorInfo


class PromptTokensDetails(Struct):
    cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache."""


class Usage(Struct, omit_defaults=True):
    """Without a count of cached tokens (an engine that reports none) ``prompt_tokens_details`` is left out."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Usage:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` once the request has started (as OpenAI reports it:
    0 without a cache hit)."""
    details = PromptTokensDetails(cached_tokens) if cached_tokens is not None else None
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, details)


class CompletionLogprobs(Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(Struct):
    """vLLM's ``Logprob`` of a prompt position's token."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's ``prompt_logprobs``: per prompt token (None for the first), {token id: PromptLogprob} of the prompt
token and the top N at its position."""


class CompletionChoice(Struct):
    """A choice of a streamed chunk (a whole response's is ``CompletionResponseChoice``)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    """vLLM's extension: the stop string or stop token id that ended the request."""


class CompletionResponseChoice(CompletionChoice):
    prompt_logprobs: PromptLogprobs | None = None


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    object: str = "text_completion"


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]


class FunctionCallOut(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class ChatMessageOut(Struct, omit_defaults=True):
    role: str
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    prompt_logprobs: PromptLogprobs | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    """A streamed tool call: its first delta has ``id``, ``type`` and the function's name (here also its whole
    arguments: a call is sent once it has parsed)."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallOut | None = None


class ChatDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "twogrid"
    root: str | None = None


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_ENCODER = msgspec.json.Encoder()
encode = _ENCODER.encode


def sse(obj) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + _ENCODER.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------------------------
# log-probabilities
# ---------------------------------------------------------------------------------------------------------------


def _floor(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf (and NaN) become the floor


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


def completion_logprobs(token_ids: list[int], entries: list[dict[int, float] | None], num_top: int, token_text,
                        text_offset: int) -> CompletionLogprobs:
    """OpenAI's completion ``logprobs`` for output tokens: ``entries[i]`` maps token ids to log-probabilities (the
    top ones and the sampled one); None for an echoed prompt's first token (null, as vLLM's); ``token_text(id)`` is
    a token's text; offsets start at ``text_offset``."""
    out = CompletionLogprobs([], [], [], [])
    for tid, entry in zip(token_ids, entries):
        text = token_text(tid)
        out.tokens.append(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(text_offset)
            text_offset += len(text)
            continue
        lp = entry.get(tid)
        out.token_logprobs.append(None if lp is None else _floor(lp))
        top = {token_text(t): _floor(v) for t, v in _top(entry, num_top)}
        if lp is not None:
            top.setdefault(text, _floor(lp))
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


def prompt_logprobs(prompt_ids: list[int], entries: list[dict[int, float] | None], ranks: list[int | None],
                    token_text) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first) the prompt token's log-probability and
    rank, and the top ones' (ranked by their values among the entry)."""
    out: PromptLogprobs = []
    for tid, entry, rank in zip(prompt_ids, entries, ranks):
        if entry is None:
            out.append(None)
            continue
        values = list(entry.values())
        out.append({str(t): PromptLogprob(_floor(v), rank if t == tid else 1 + sum(x > v for x in values),
                                          token_text(t)) for t, v in entry.items()})
    return out


def chat_logprobs(token_ids: list[int], entries: list[dict[int, float]], num_top: int, token_text,
                  token_bytes) -> ChatLogprobs:
    """OpenAI's chat ``logprobs.content`` for output tokens (``entries`` as in ``completion_logprobs``); ``bytes``
    each token's own (``token_bytes``: a piece of a character too)."""
    content = []
    for tid, entry in zip(token_ids, entries):
        top = [TopLogprob(token_text(t), _floor(v), list(token_bytes(t))) for t, v in _top(entry, num_top)]
        content.append(ChatTokenLogprob(token_text(tid), _floor(entry.get(tid, LOGPROB_FLOOR)), list(token_bytes(tid)),
                                        top))
    return ChatLogprobs(content)
