"""The OpenAI-compatible HTTP front end (aiohttp.web) over the async engine.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (server-sent events with ``"stream": true``),
``GET /v1/models``, ``GET /health`` (200 when the engine is ready and alive, 503 with the reason otherwise) and
``GET /metrics`` (Prometheus text). With an API key every route but ``/health`` wants ``Authorization: Bearer
<key>``, compared in constant time.

A request is checked completely before it costs engine work: the body size (413), the schema (400, naming the
field), the model name (404), the prompt against ``max_model_len`` and ``max_tokens`` against the room left (400),
the sampling fields. A client that goes away, streaming or not, aborts its request in the engine, which frees its
KV blocks at once: the server runs with aiohttp's handler cancellation on (``start_http``), so a closed connection
cancels its handler, and a failed write ends a stream. An engine failure ends the request with a 500 error (in a
stream: an error event, then ``[DONE]``), never a silent cut.

Request logs carry ids, token counts, finish reasons and times (at DEBUG; aborts, refusals and failures at INFO and
up), never prompt text; with ``log_requests`` each request's prompt and sampling parameters and its result are
logged at INFO.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from dispatcher.serve import protocol as P
from dispatcher.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from dispatcher.serve.metrics import EngineMetrics, RequestTimer
from dispatcher.serve.protocol import ApiError
from dispatcher.serve.tokenizing import Tokenizing
from dispatcher.serve.tools import (DEFAULT_FORCED_PARSER, PARSERS, NamedCall, ToolParser, ToolStream,
                                    parameters_schema)
from models.text import bad_words_token_ids
from scheduler.request import RequestError, SamplingParams
from scheduler.structured import StructuredOutputError, StructuredOutputsParams

log = logging.getLogger("twogrid.serve")

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
"""Request bodies above this get 413: 4 MiB holds a 128k-token prompt as token ids or as escaped text, and refuses
the 10 MB bodies of a hostile client before they are buffered."""
DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's (and vLLM's) ``max_tokens`` when a completion request leaves it out."""
LOG_PROMPT_CHARS = 4096
"""With ``log_requests``, a prompt is logged up to this many characters."""
MAX_REQUEST_ID_CHARS = 256
"""A client's X-Request-Id at most (it becomes the response's id, the engine's, and every log line's)."""
TOKENIZE_IN_THREAD_CHARS = 16384
"""Conversations longer than this are rendered through the chat template in a thread, so the event loop keeps
streaming other requests (prompts are tokenized off the loop always: ``Tokenizing``)."""

SERVER_KEY: web.AppKey[Server] = web.AppKey("twogrid_server")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("twogrid")
    except PackageNotFoundError:  # (run from a source tree without installing it)
        return "unknown"


VERSION = _version()
"""What /version answers (vLLM's answers its own)."""


def build_app(engine, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              log_requests: bool = False, cors: P.Cors | None = None, tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False) -> web.Application:
    """The application over ``engine`` (an EngineClient, or any object with its attributes and methods). Serve it
    with ``start_http`` (or an AppRunner with ``handler_cancellation=True``: disconnects abort requests).
    ``tool_call_parser``: the model's tool-call format (``dispatcher.serve.tools``); ``enable_auto_tool_choice``:
    serve ``tool_choice: "auto"`` with it (vLLM's flags)."""
    if max_body_bytes < 1024:
        raise ValueError(f"max_body_bytes = {max_body_bytes} is below 1024; no request would fit")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
    server = Server(engine, api_key, max_body_bytes, log_requests, tool_call_parser, enable_auto_tool_choice)
    app = web.Application(client_max_size=max_body_bytes, middlewares=[server.errors, server.auth])
    app[SERVER_KEY] = server
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/health", server.health)
    app.router.add_get("/ping", server.ping)
    app.router.add_post("/ping", server.ping)
    app.router.add_get("/metrics", server.metrics_text)
    app.router.add_get("/version", server.version)
    app.router.add_post("/tokenize", server.tokenize)
    app.router.add_post("/detokenize", server.detokenize)
    if cors is not None and cors.allowed_origins:
        _allow_cross_origin(app, cors)
    return app


def _allow_cross_origin(app: web.Application, cors: P.Cors) -> None:
    """CORS headers on every route and answers to browsers' preflight requests (aiohttp-cors; vLLM uses
    Starlette's CORSMiddleware with the same four settings)."""
    import aiohttp_cors

    def star(values: tuple[str, ...]):
        return "*" if "*" in values else values

    options = aiohttp_cors.ResourceOptions(allow_credentials=cors.allow_credentials, expose_headers="*",
                                           allow_headers=star(cors.allowed_headers),
                                           allow_methods=star(cors.allowed_methods))
    setup = aiohttp_cors.setup(app, defaults={origin: options for origin in cors.allowed_origins})
    for route in list(app.router.routes()):
        setup.add(route)


def stop_accepting(app: web.Application, reason: str = "the server is shutting down") -> None:
    """From now on new generation requests get 503 and ``/health`` reports ``reason`` (a draining server); requests
    in flight go on."""
    app[SERVER_KEY].closing = reason


async def drain(app: web.Application, timeout_s: float, reason: str = "the server is shutting down") -> int:
    """SIGTERM's first half: stop accepting, then wait up to ``timeout_s`` for the requests in flight to finish.
    Returns how many are still running. The caller then fails those in the engine (their outputs end with finish
    reason 'abort', or their iterators raise EngineError: each client gets an error, in a stream an error event)
    and only then stops the HTTP server (``runner.cleanup()``), which would otherwise cut their connections."""
    server = app[SERVER_KEY]
    server.closing = reason
    deadline = time.monotonic() + timeout_s
    while server.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return server.in_flight


async def start_http(app: web.Application, host: str = "127.0.0.1", port: int = 8000,
                     shutdown_timeout: float = 30.0, socks=None) -> web.AppRunner:
    """Serve ``app`` on ``host:port`` (or on the listening sockets ``socks``, which several front-end processes
    share) with handler cancellation on (a client's disconnect cancels its handler, which aborts its request).
    ``await runner.cleanup()`` stops it, waiting up to ``shutdown_timeout`` seconds for requests in flight."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    sites = [web.SockSite(runner, sock) for sock in socks] if socks else [web.TCPSite(runner, host, port)]
    for site in sites:
        await site.start()
    return runner


@dataclasses.dataclass
class _Choice:
    """One choice of a request as it reaches the client."""

    index: int
    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    text_offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    echoed: bool = False
    """A stream sent its prompt (``echo``) already."""
    tool_stream: ToolStream | None = None
    """Its output's tool calls as they stream (a chat request with tools)."""
    num_tool_calls: int = 0


@dataclasses.dataclass
class _Request:
    """One generation request between the checks and its last byte."""

    request_id: str
    """The engine's id."""
    response_id: str
    """The response's ``id``: cmpl- / chatcmpl- and the client's X-Request-Id, or a fresh one."""
    header_id: str
    """What the response's X-Request-Id header says: the client's, else ``response_id``."""
    chat: bool
    model: str
    created: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    num_top_logprobs: int | None
    """Top log-probabilities per token to return (None: no logprobs)."""
    stream: bool
    include_usage: bool
    continuous_usage: bool
    timer: RequestTimer
    echo: bool = False
    """Completions' ``echo``: the prompt before each choice's text."""
    echo_only: bool = False
    """``echo`` with ``max_tokens`` 0: the prompt alone (one token is generated and left out, as vLLM does)."""
    echo_text: str | None = None
    """Chat's ``echo``: the text before each choice's content (``P.chat_echo``)."""
    completion_tokens: int = 0
    choices: list[_Choice] = dataclasses.field(default_factory=list)
    prompt_logprobs: tuple[list, list] | None = None
    """(entries, ranks) once the engine sent them."""
    finished: bool = False
    """The engine finished it (or failed it): nothing to abort."""
    num_cached_tokens: int | None = None
    """Prompt tokens the prefix cache held (usage's ``prompt_tokens_details.cached_tokens``), once it started."""
    tools: "_ToolUse | None" = None
    """Chat with tools whose calls are parsed out of each choice's output (tool_choice auto with a parser, required,
    named)."""

    def usage(self) -> P.Usage:
        """The request's usage so far: an echo alone (``echo_only``) completed no tokens, whatever it generated."""
        return P.usage(len(self.prompt_token_ids), 0 if self.echo_only else self.completion_tokens,
                       self.num_cached_tokens)


@dataclasses.dataclass(frozen=True)
class _ToolUse:
    """How a chat request uses its tools: the parser that reads the calls, the choice (auto, required, or the
    forced function's name), for a forced call the grammar that makes the model write one, and for a named one the
    call's opening, written after the prompt (``tools.NamedCall``)."""

    parser: ToolParser | NamedCall
    choice: str
    forced: StructuredOutputsParams | None
    opening: str = ""


class Server:
    """The routes' state: the engine, the key, the limits."""

    def __init__(self, engine, api_key: str | None, max_body_bytes: int, log_requests: bool,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False):
        self.engine = engine
        self.tool_parser = PARSERS[tool_call_parser] if tool_call_parser is not None else None
        self.auto_tools = enable_auto_tool_choice
        self.metrics = engine.metrics if engine.metrics is not None else EngineMetrics(engine.served_model_name)
        """The engine's metrics (per-request ones are recorded here); a registry of its own for an engine without."""
        self._auth = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.log_requests = log_requests
        self.created = int(time.time())
        self.closing: str | None = None
        """Why new requests are refused (set by ``stop_accepting``), else None."""
        self.in_flight = 0
        """Generation requests past their checks and not yet answered."""
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}
        self._live: set[str] = set()
        """Engine ids of the generation requests in flight."""
        self.tokenizing = Tokenizing(engine.tokenizer) if engine.tokenizer is not None else None
        """Prompts arriving together, tokenized together off the event loop."""

    # -- middlewares --------------------------------------------------------------------------------------------
    @web.middleware
    async def errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error in OpenAI's shape: ours (ApiError), aiohttp's (unknown route, wrong method, body too large)
        and unexpected ones (500, logged with the traceback)."""
        try:
            return await handler(request)
        except ApiError as exc:
            return _error_response(exc)
        except ConnectionError:  # the client went away mid-response (its request is aborted already): aiohttp's
            raise
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error_response(_http_error(exc, request, self.max_body_bytes))
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return _error_response(ApiError(500, "internal server error (the server log has the details)"))

    @web.middleware
    async def auth(self, request: web.Request, handler) -> web.StreamResponse:
        """The API key on every route but the health checks (and browsers' CORS preflights, which carry none)."""
        if self._auth is not None and request.path not in ("/health", "/ping") and request.method != "OPTIONS":
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, self._auth):
                raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                               reason="invalid_api_key")
        return await handler(request)

    # -- plain routes -------------------------------------------------------------------------------------------
    def _unavailable(self) -> str | None:
        """Why the server cannot take requests now, or None."""
        if self.engine.dead:
            return f"the engine cannot serve: {self.engine.dead}"
        if self.closing is not None:
            return self.closing
        if not self.engine.ready:
            return "the engine is starting (loading the model and capturing graphs)"
        return None

    async def health(self, request: web.Request) -> web.Response:
        """200 with an empty body, as vLLM's; 503 with the reason (not logged: probes ask every few seconds)."""
        reason = self._unavailable()
        if reason is not None:
            return web.Response(body=ApiError(503, reason, reason="unavailable").body(), status=503,
                                content_type="application/json")
        return web.Response(status=200)

    async def ping(self, request: web.Request) -> web.Response:
        """vLLM's (SageMaker's) health check, GET or POST: /health's answer."""
        return await self.health(request)

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": VERSION})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt, or messages through the chat template -> {count, max_model_len, tokens,
        token_strs}."""
        req = P.decode_tokenize(await self._read_body(request))
        self._check_model(req.model)
        tok = self._tokenizer("/tokenize")
        text = await self._render_chat(req) if isinstance(req, P.TokenizeChatRequest) else req.prompt
        ids = await self._encode("prompt", text, req.add_special_tokens)
        strs = [tok.backend.id_to_token(t) for t in ids] if req.return_token_strs else None
        return _json(P.TokenizeResponse(len(ids), self.engine.max_model_len, ids, strs))

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: token ids -> {prompt}."""
        req = P.decode_detokenize(await self._read_body(request))
        self._check_model(req.model)
        tok = self._tokenizer("/detokenize")
        bad = next((t for t in req.tokens if t >= tok.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"'tokens' has token id {bad}, outside the vocabulary 0..{tok.vocab_size - 1}",
                           param="tokens")
        return _json(P.DetokenizeResponse(tok.decode(req.tokens)))

    def _tokenizer(self, route: str):
        if self.engine.tokenizer is None:
            raise ApiError(400, f"{route}: this model has no tokenizer (a preset with random weights)")
        return self.engine.tokenizer

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.engine.served_model_name:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                                f"'{self.engine.served_model_name}'", param="model", reason="model_not_found")

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        card = P.ModelCard(self.engine.served_model_name, self.created, self.engine.max_model_len)
        return _json(P.ModelList([card]))

    # -- generation ---------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrival = time.perf_counter()
        reason = self._unavailable()
        if reason is not None:
            raise ApiError(503, reason, reason="unavailable")
        given = _client_request_id(request)
        body = await self._read_body(request)
        req = P.decode_request(body, P.ChatCompletionRequest if chat else P.CompletionRequest)
        self._check_model(req.model)
        structured = P.structured_outputs(req)
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{given or uuid.uuid4().hex}"
        if not chat and P.is_prompt_batch(req.prompt):
            return await self._generate_batch(request, req, structured, response_id, given, arrival)
        tools = self._tool_use(req, structured) if chat else None
        prompt, ids = await self._tokenize(req, chat, tools.opening if tools is not None else "")
        params = self._sampling_params(req, len(ids), chat, tools.forced if tools is not None and tools.forced
                                       else structured)
        r = self._request(req, chat, self._engine_id(response_id), response_id, given, prompt, ids, params, arrival,
                          tools)
        outputs = self._run(r)
        self.in_flight += 1
        self._live.add(r.request_id)
        try:
            first = await anext(outputs)  # validation errors surface here, before the response starts
            if r.stream:
                return await self._stream(request, r, first, outputs)
            return await self._collect(r, first, outputs)
        finally:
            self.in_flight -= 1
            self._live.discard(r.request_id)
            await self._end(r, outputs)

    def _request(self, req, chat: bool, engine_id: str, response_id: str, given: str | None, prompt: str | None,
                 ids: list[int], params: SamplingParams, arrival: float, tools: "_ToolUse | None" = None,
                 first_choice: int = 0) -> _Request:
        """A checked request as it runs; its choices indexed from ``first_choice`` (a batch's prompts after the
        first)."""
        echo = not chat and bool(req.echo)  # (chat's echo is another thing: ``echo_text``)
        r = _Request(engine_id, response_id, given or response_id, chat,
                     self.engine.served_model_name, int(time.time()), prompt, ids, params, _num_top_logprobs(req),
                     bool(req.stream), bool(req.stream_options and req.stream_options.include_usage),
                     bool(req.stream_options and req.stream_options.continuous_usage_stats),
                     RequestTimer(self.metrics, len(ids), arrival), echo, echo and req.max_tokens == 0,
                     choices=[_Choice(first_choice + i, tool_stream=tools.parser.stream() if tools is not None
                                      else None) for i in range(params.n)], tools=tools,
                     echo_text=P.chat_echo(req) if chat else None)
        if self.log_requests:
            shown = prompt if prompt is not None else str(ids)
            log.info("%s: prompt %r, %s", r.request_id, shown[:LOG_PROMPT_CHARS], params)
        return r

    async def _generate_batch(self, request: web.Request, req: P.CompletionRequest, structured, response_id: str,
                              given: str | None, arrival: float) -> web.StreamResponse:
        """A completion request with several prompts (vLLM's; lm-evaluation-harness sends them): every prompt
        checked before any runs, then one engine request each, all at once; prompt i's choice j is choice
        ``i * n + j`` and the usage is their sum."""
        rs = []
        subs = [msgspec.structs.replace(req, prompt=one) for one in P.batch_prompts(req)]
        # (tokenized at once: the front end's tokenizing batches them into one call of the tokenizers library)
        tokenized = await asyncio.gather(*(self._tokenize(sub, False) for sub in subs), return_exceptions=True)
        # (no await from here until the engine ids are in ``_live``: another batch may have the same X-Request-Id)
        for i, (sub, got) in enumerate(zip(subs, tokenized)):
            try:
                if isinstance(got, BaseException):
                    raise got
                prompt, ids = got
                params = self._sampling_params(sub, len(ids), False, structured)
            except ApiError as exc:
                if exc.param not in ("prompt", "max_tokens"):
                    raise
                raise _for_prompt(i, exc) from None
            rs.append(self._request(sub, False, self._engine_id(f"{response_id}-{i}"), response_id, given, prompt,
                                    ids, params, arrival, first_choice=i * params.n))
        self._live.update(r.request_id for r in rs)
        outputs = [self._run(r) for r in rs]
        self.in_flight += len(rs)
        try:
            firsts = await _each(_naming_prompt(i, anext(o)) for i, o in enumerate(outputs))  # (all queued first)
            if req.stream:
                return await self._stream_batch(request, rs, firsts, outputs)
            await _each(self._gather(r, first, o) for r, first, o in zip(rs, firsts, outputs))
            for r in rs:
                self._finished(r)
            choices = [choice for r in rs for choice in self._completion_choices(r)]
            usage = P.sum_usage([r.usage() for r in rs])
            return _json(P.Completion(response_id, rs[0].created, rs[0].model, choices, usage),
                         headers={"X-Request-Id": rs[0].header_id})
        finally:
            self.in_flight -= len(rs)
            self._live.difference_update(r.request_id for r in rs)
            ends = await asyncio.shield(asyncio.gather(*(self._end(r, o) for r, o in zip(rs, outputs)),
                                                       return_exceptions=True))
            for r, end in zip(rs, ends):
                if isinstance(end, Exception):
                    log.error("%s: ending it failed: %r", r.request_id, end)

    async def _stream_batch(self, request: web.Request, rs: list[_Request], firsts: list, outputs: list
                            ) -> web.StreamResponse:
        """A batch's choices streamed as their outputs come, each chunk carrying one choice (its batch index)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": rs[0].header_id})
        await response.prepare(request)
        waiting: dict[asyncio.Future, int] = {}
        ready = list(enumerate(firsts))
        try:
            while ready or waiting:
                for i, delta in ready:
                    chunks = [self._chunk(rs[i], out) for out in delta.outputs]
                    rs[i].timer.output(sum(len(out.token_ids) for out in delta.outputs), time.perf_counter())
                    body = b"".join(c for c in chunks if c is not None)
                    if body:
                        await response.write(body)
                    if delta.finished:
                        self._finished(rs[i])
                    else:
                        waiting[asyncio.ensure_future(anext(outputs[i]))] = i
                ready = []
                if waiting:
                    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                    ready = [(waiting.pop(task), task.result()) for task in done]
        except ApiError as exc:  # one failed mid-stream: say so, then end the stream (the others are aborted)
            await _cancel(waiting)
            return await _end_with_error(response, exc)
        except BaseException:
            await _cancel(waiting)
            raise
        tail = P.SSE_DONE
        if rs[0].include_usage:
            tail = self._usage_chunk(rs[0], P.sum_usage([r.usage() for r in rs])) + tail
        await response.write_eof(tail)  # (one write with the stream's end)
        return response

    def _engine_id(self, response_id: str) -> str:
        """The engine's id for a request: its response id, made unique if a live request has it already (clients
        may send one X-Request-Id twice)."""
        return response_id if response_id not in self._live else f"{response_id}-{uuid.uuid4().hex[:8]}"

    async def _read_body(self, request: web.Request) -> bytes:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise _too_large(request.content_length, self.max_body_bytes)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(None, self.max_body_bytes) from None
        except web.RequestPayloadError as exc:  # (a body its Content-Encoding does not decode, or one cut short)
            raise ApiError(400, f"the request body could not be read: {exc}") from None

    def _tool_use(self, req: P.ChatCompletionRequest, structured) -> _ToolUse | None:
        """Check ``tools`` and ``tool_choice`` as vLLM does; None when no call is to be parsed (no tools, or
        tool_choice "none")."""
        choice = req.tool_choice
        if not req.tools:
            if choice in (None, "none") or (choice == "auto" and req.tools is not None):
                return None  # (an empty list with no call forced: as if left out, which clients that always send
                # the field rely on)
            raise ApiError(400, "'tool_choice' needs 'tools'" + (
                f" (an empty list has no tool to call, so {_choice_name(choice)} cannot be met)"
                if req.tools is not None else ""), param="tool_choice")
        choice = "auto" if choice is None else choice
        if choice == "none":
            return None
        names = [t.function.name for t in req.tools]
        if len(set(names)) < len(names):
            raise ApiError(400, "'tools' names a function twice", param="tools")
        if choice == "auto":
            if not self.auto_tools:
                raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
                                    'be set (tool_choice "required" or a named function works without them)',
                               param="tool_choice")
            return _ToolUse(self.tool_parser, "auto", None)
        name = None if choice == "required" else choice.function.name
        if name is not None and name not in names:
            raise ApiError(400, f"'tool_choice' names the function {name!r}, which is not among 'tools'",
                           param="tool_choice")
        if structured is not None:
            raise ApiError(400, "a required or named tool_choice constrains the output already: leave out "
                                "response_format / structured_outputs", param="tool_choice")
        if req.continue_final_message or not req.add_generation_prompt:
            raise ApiError(400, "a required or named tool_choice writes a new message: leave out "
                                "continue_final_message and keep add_generation_prompt", param="tool_choice")
        parser = self.tool_parser or PARSERS[DEFAULT_FORCED_PARSER]
        tools = [msgspec.to_builtins(t) for t in req.tools]
        if name is None:
            forced = StructuredOutputsParams(structural_tag=parser.structural_tag(tools, req.parallel_tool_calls
                                                                                  is not False), where="tools")
        else:
            tool = next(t for t in tools if t["function"]["name"] == name)
            forced = StructuredOutputsParams(json=json.dumps(parameters_schema(tool), ensure_ascii=False),
                                             where="tools")
        try:
            forced.validate()
        except StructuredOutputError as exc:
            raise ApiError(400, str(exc), param="tools") from None
        if name is None:
            return _ToolUse(parser, choice, forced)
        return _ToolUse(NamedCall(name), name, forced, parser.opening(name))

    async def _tokenize(self, req, chat: bool, opening: str = "") -> tuple[str | None, list[int]]:
        """The prompt's text and ids; ``opening``: text after a chat's rendered prompt (a named tool call's)."""
        tok = self.engine.tokenizer
        if chat:
            if tok is None:
                P.chat_messages(req)  # (a malformed message is named first, as before)
                raise ApiError(400, "this model has no tokenizer or chat template (a preset with random weights): "
                                    "use /v1/completions with token ids", param="messages")
            prompt = await self._render_chat(req) + opening
            return prompt, await self._encode("messages", prompt, req.add_special_tokens)
        prompt = P.completion_prompt(req)
        if isinstance(prompt, list):
            vocab = tok.vocab_size if tok is not None else None
            if vocab is not None and max(prompt) >= vocab:
                raise ApiError(400, f"'prompt' has token id {max(prompt)}, outside the vocabulary 0..{vocab - 1}",
                               param="prompt")
            return None, prompt
        if tok is None:
            raise ApiError(400, "this model has no tokenizer (a preset with random weights): send 'prompt' as token "
                                "ids", param="prompt")
        return prompt, await self._encode("prompt", prompt, True)

    async def _render_chat(self, req) -> str:
        """A chat request's (or a chat /tokenize request's) messages and tools through the chat template."""
        messages = P.chat_messages(req)
        tools = [msgspec.to_builtins(t) for t in req.tools] if req.tools else None
        return await self._in_thread("messages", sum(len(m["content"]) for m in messages),
                                     self.engine.tokenizer.apply_chat_template, messages, tools=tools,
                                     **P.chat_template_options(req))

    async def _encode(self, param: str, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids, batched with the other prompts of this turn of the loop (``Tokenizing``); a
        ValueError is the client's: 400 naming ``param``."""
        with _client_error(param):
            return await self.tokenizing.encode(text, add_special_tokens)

    @staticmethod
    async def _in_thread(param: str, size: int, fn, *args, **kwargs):
        """``fn(*args)``; in a worker thread for inputs of more than TOKENIZE_IN_THREAD_CHARS characters. A
        ValueError (models.text.TemplateError: a template that fails on these messages) is the client's: 400."""
        with _client_error(param):
            if size > TOKENIZE_IN_THREAD_CHARS:
                return await asyncio.to_thread(fn, *args, **kwargs)
            return fn(*args, **kwargs)

    def _sampling_params(self, req, prompt_len: int, chat: bool, structured=None) -> SamplingParams:
        max_tokens = self._max_tokens(req, prompt_len, chat)
        d = self.engine.default_params
        pick = lambda name: getattr(d, name) if getattr(req, name) is None else getattr(req, name)  # noqa: E731
        top_k = d.top_k if req.top_k is None else max(req.top_k, 0)
        num_top = _num_top_logprobs(req)
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is None and not chat and req.echo and num_top is not None:
            prompt_logprobs = num_top  # the echoed prompt's logprobs (vLLM's rule)
        # (no temperature from the request nor the checkpoint: None, which SamplingParams makes greedy, or vLLM's 1.0
        # for n > 1)
        temperature = req.temperature if req.temperature is not None else (d.temperature or None)
        params = dataclasses.replace(
            d, max_tokens=max_tokens, temperature=temperature, top_p=pick("top_p"), top_k=top_k,
            seed=req.seed if req.seed is not None else d.seed, stop=P.stop_strings(req.stop),
            stop_token_ids=tuple(dict.fromkeys((*(req.stop_token_ids or ()), *d.stop_token_ids))),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
            logprobs=num_top, n=req.n or 1, min_p=pick("min_p"), repetition_penalty=pick("repetition_penalty"),
            presence_penalty=pick("presence_penalty"), frequency_penalty=pick("frequency_penalty"),
            min_tokens=req.min_tokens, logit_bias=P.logit_bias(req),
            allowed_token_ids=tuple(req.allowed_token_ids) if req.allowed_token_ids is not None else None,
            bad_words=tuple(req.bad_words or ()), bad_words_token_ids=self._bad_words(req.bad_words),
            prompt_logprobs=prompt_logprobs, structured_outputs=structured)
        try:
            params.validate(self.engine.tokenizer.vocab_size if self.engine.tokenizer is not None else None)
        except RequestError as exc:
            raise _request_error(exc) from None
        return params

    def _bad_words(self, words: list[str] | None) -> tuple[tuple[int, ...], ...]:
        if not words:
            return ()
        if self.engine.tokenizer is None:
            raise ApiError(400, "'bad_words' need the model's tokenizer; this model (a preset) has none",
                           param="bad_words")
        try:
            return bad_words_token_ids(self.engine.tokenizer, words)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="bad_words") from None

    def _max_tokens(self, req, prompt_len: int, chat: bool) -> int:
        limit = self.engine.max_model_len
        where = "messages" if chat else "prompt"
        if prompt_len == 0:
            raise ApiError(400, f"'{where}' has no tokens", param=where)
        if prompt_len >= limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens and the {where} has "
                                f"{prompt_len}: at most {limit - 1} leave room for one output token", param=where,
                           reason="context_length_exceeded")
        room = limit - prompt_len
        name, asked = "max_tokens", req.max_tokens
        if asked == 0:  # (echo alone: one token, left out of the answer)
            asked = 1
        if chat and req.max_completion_tokens is not None:
            name, asked = "max_completion_tokens", req.max_completion_tokens
        if asked is None:  # completions: OpenAI's 16; chat: the checkpoint's max_new_tokens, else the room left
            default = _server_max_tokens(self.engine.default_params) if chat else DEFAULT_COMPLETION_MAX_TOKENS
            return room if default is None else min(default, room)
        if asked > room:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens; the {where} has "
                                f"{prompt_len} and '{name}' asks for {asked} more: '{name}' can be at most {room}",
                           param=name, reason="context_length_exceeded")
        return asked

    # -- running a request --------------------------------------------------------------------------------------
    async def _run(self, r: _Request) -> AsyncIterator[Any]:
        """The engine's outputs (RequestOutput: the choices with news) for ``r``; engine refusals as 400, failures
        as 500."""
        try:
            deltas = self.engine.generate(r.request_id, r.prompt, r.prompt_token_ids, r.params, r.timer.arrival)
        except RequestError as exc:  # refused before it was queued: not a request that ran
            r.finished = True
            r.timer.discard()
            raise _request_error(exc) from None
        except Exception as exc:  # EngineError: dead, or shutting down
            r.finished = True
            r.timer.discard()
            raise ApiError(503, str(exc), reason="unavailable") from None
        try:
            async for delta in deltas:
                if delta.num_cached_tokens is not None:
                    r.num_cached_tokens = delta.num_cached_tokens
                if delta.finished:
                    r.finished = True
                for out in delta.outputs:
                    if out.finish_reason == "abort":  # the engine dropped it (a shutdown): an error, not a result
                        r.finished = True
                        r.timer.finish("abort", time.perf_counter())
                        raise ApiError(503, "the server aborted the request (it is shutting down)", reason="aborted")
                    if r.num_top_logprobs is not None and out.token_ids and out.logprobs is None:
                        r.finished = True
                        await self.engine.abort(r.request_id)
                        raise ApiError(500, "the engine returned no logprobs for this request", reason="engine_error")
                if r.params.prompt_logprobs is not None and r.prompt_logprobs is None:
                    if delta.prompt_logprobs is None:
                        r.finished = True
                        await self.engine.abort(r.request_id)
                        raise ApiError(500, "the engine returned no prompt logprobs for this request",
                                       reason="engine_error")
                    r.prompt_logprobs = (delta.prompt_logprobs, delta.prompt_logprob_ranks)
                yield delta
                if r.finished:
                    return
        except RequestError as exc:  # an engine that validates when iterated
            r.finished = True
            r.timer.discard()
            raise _request_error(exc) from None
        except (ApiError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # the engine's EngineError (worker death, step error) or a defect
            r.finished = True
            log.error("%s: the engine failed: %s", r.request_id, exc, exc_info=not _is_engine_error(exc))
            raise ApiError(500, f"the engine failed: {exc}", reason="engine_error") from None
        finally:  # the engine's stream, closed early (a client gone) or not
            close = getattr(deltas, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception:  # the request is over for the client either way
                    log.exception("%s: closing the engine's stream failed", r.request_id)
        r.finished = True
        raise ApiError(500, "the engine ended the request without a finish reason", reason="engine_error")

    async def _end(self, r: _Request, outputs) -> None:
        """After the response (or its failure): abort the request if it still runs (the client went away), record
        how it ended."""
        now = time.perf_counter()
        try:
            if not r.finished:
                r.finished = True
                r.timer.finish("abort", now)
                await asyncio.shield(self.engine.abort(r.request_id))
                log.info("%s: aborted (the client went away) after %d tokens", r.request_id, r.completion_tokens)
        finally:
            await outputs.aclose()
            r.timer.finish("error", now)  # no-op when it finished normally or was aborted

    @staticmethod
    def _take(r: _Request, delta) -> int:
        """A delta's choices into ``r``; returns its new tokens."""
        num_tokens = 0
        for out in delta.outputs:
            c = r.choices[out.index]
            c.text.append(out.text)
            c.token_ids.extend(out.token_ids)
            if r.num_top_logprobs is not None and out.logprobs:
                c.logprobs.extend(out.logprobs)
            if out.finish_reason is not None:
                c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
            num_tokens += len(out.token_ids)
        r.completion_tokens += num_tokens
        return num_tokens

    async def _gather(self, r: _Request, first, outputs) -> None:
        """``r``'s outputs taken until it finishes."""
        delta = first
        while True:
            r.timer.output(self._take(r, delta), time.perf_counter())
            if delta.finished:
                return
            delta = await anext(outputs)

    async def _collect(self, r: _Request, first, outputs) -> web.Response:
        await self._gather(r, first, outputs)
        self._finished(r)
        usage = r.usage()
        prompt_lp = self._prompt_logprobs_json(r)
        if r.chat:
            choices = []
            for c in r.choices:
                lp = (P.chat_logprobs(c.token_ids, c.logprobs, r.num_top_logprobs, self.token_text,
                                        self.token_bytes)
                      if r.num_top_logprobs is not None else None)
                message, finish_reason = P.ChatMessageOut("assistant", "".join(c.text)), c.finish_reason
                if r.tools is not None:
                    content, calls = r.tools.parser.parse(message.content, c.finish_reason == "length")
                    if calls:
                        message = P.ChatMessageOut("assistant", content, [
                            P.ToolCallOut(t.id, P.FunctionCallOut(t.name, t.arguments)) for t in calls])
                        finish_reason = _tool_finish_reason(r, finish_reason)
                if r.echo_text is not None:
                    message = P.ChatMessageOut("assistant", r.echo_text + (message.content or ""),
                                               message.tool_calls)
                choices.append(P.ChatChoice(c.index, message, lp, finish_reason, c.stop_reason))
            body: Any = P.ChatCompletion(r.response_id, r.created, r.model, choices, usage, prompt_logprobs=prompt_lp)
        else:
            body = P.Completion(r.response_id, r.created, r.model, self._completion_choices(r), usage)
        return _json(body, headers={"X-Request-Id": r.header_id})

    def _completion_choices(self, r: _Request) -> list[P.CompletionResponseChoice]:
        prompt_lp = self._prompt_logprobs_json(r)
        choices = []
        for c in r.choices:
            text, ids, entries = self._completion_parts(r, c, "".join(c.text), c.token_ids, c.logprobs)
            lp = (P.completion_logprobs(ids, entries, r.num_top_logprobs, self.token_text, 0)
                  if r.num_top_logprobs is not None else None)
            choices.append(P.CompletionResponseChoice(c.index, text, lp, c.finish_reason, c.stop_reason, prompt_lp))
        return choices

    def _completion_parts(self, r: _Request, c: _Choice, text: str, token_ids: list[int], entries: list):
        """A completion choice's text, token ids and logprob entries, the prompt's first with ``echo`` (alone with
        ``max_tokens`` 0), as vLLM answers."""
        if not r.echo or c.echoed:
            return text, token_ids, entries
        c.echoed = True
        prompt_text = r.prompt if r.prompt is not None else self._prompt_text(r)
        prompt_entries = (r.prompt_logprobs[0] if r.prompt_logprobs is not None
                          else [None] * len(r.prompt_token_ids))
        if r.echo_only:
            return prompt_text, r.prompt_token_ids, prompt_entries
        return prompt_text + text, r.prompt_token_ids + token_ids, prompt_entries + entries

    def _prompt_text(self, r: _Request) -> str:
        tok = self.engine.tokenizer
        return "" if tok is None else tok.decode(r.prompt_token_ids, skip_special_tokens=False)

    def _prompt_logprobs_json(self, r: _Request) -> P.PromptLogprobs | None:
        if r.prompt_logprobs is None:
            return None
        return P.prompt_logprobs(r.prompt_token_ids, *r.prompt_logprobs, self.token_text)

    async def _stream(self, request: web.Request, r: _Request, first, outputs) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": r.header_id})
        await response.prepare(request)
        pending = [self._role_chunk(r, c.index) for c in r.choices] if r.chat else []
        delta = first
        try:
            while True:
                num_tokens = 0
                for out in delta.outputs:
                    num_tokens += len(out.token_ids)
                    chunk = self._chunk(r, out)
                    if chunk is not None:
                        pending.append(chunk)
                if pending:
                    await response.write(b"".join(pending))
                    pending.clear()
                r.timer.output(num_tokens, time.perf_counter())
                if delta.finished:
                    break
                delta = await anext(outputs)
        except ApiError as exc:  # the engine failed mid-stream: say so, then end the stream
            return await _end_with_error(response, exc)
        self._finished(r)
        tail = P.SSE_DONE
        if r.include_usage:
            tail = self._usage_chunk(r) + tail
        await response.write_eof(tail)  # (one write with the stream's end)
        return response

    def _finished(self, r: _Request) -> None:
        now = time.perf_counter()
        reasons = [c.finish_reason for c in r.choices]
        r.timer.finish(reasons[0], now)  # (the metrics count a request once: by its first choice)
        log.log(logging.INFO if self.log_requests else logging.DEBUG, "%s: %s, %d prompt + %d output tokens, %.3f s",
                r.request_id, ", ".join(map(str, reasons)), len(r.prompt_token_ids), r.completion_tokens,
                now - r.timer.arrival)

    # -- stream chunks ------------------------------------------------------------------------------------------
    def _chunk_usage(self, r: _Request) -> P.Usage | None:
        if r.continuous_usage:
            return r.usage()
        return None

    def _role_chunk(self, r: _Request, index: int) -> bytes:
        choice = P.ChatChunkChoice(index, P.ChatDelta(role="assistant", content=r.echo_text or ""), None, None)
        return P.sse(P.ChatCompletionChunk(r.response_id, r.created, r.model, [choice], self._chunk_usage(r)))

    def _chunk(self, r: _Request, out) -> bytes | None:
        """The event for one choice's output; None when it carries nothing to send (tokens whose text is held back,
        without logprobs)."""
        r.completion_tokens += len(out.token_ids)
        c = r.choices[out.index]
        c.finish_reason = out.finish_reason or c.finish_reason
        want_logprobs = r.num_top_logprobs is not None and bool(out.token_ids)
        echo = r.echo and not c.echoed
        if not out.text and not want_logprobs and out.finish_reason is None and not echo:
            return None
        entries = (out.logprobs or []) if want_logprobs else []
        if r.chat:
            lp = (P.chat_logprobs(out.token_ids, entries, r.num_top_logprobs, self.token_text,
                                        self.token_bytes)
                  if want_logprobs else None)
            delta = self._tool_delta(c, out) if c.tool_stream is not None else (
                P.ChatDelta(content=out.text) if out.text else P.ChatDelta())
            if delta == P.ChatDelta() and not want_logprobs and out.finish_reason is None:
                return None  # (text the tool parser holds back)
            finish_reason = out.finish_reason
            if finish_reason is not None and c.num_tool_calls:
                finish_reason = _tool_finish_reason(r, finish_reason)
            choice = P.ChatChunkChoice(out.index, delta, lp, finish_reason, out.stop_reason)
            return P.sse(P.ChatCompletionChunk(r.response_id, r.created, r.model, [choice], self._chunk_usage(r)))
        text, ids = out.text, out.token_ids
        if echo:
            text, ids, entries = self._completion_parts(r, c, text, ids, entries)
        lp = None
        if r.num_top_logprobs is not None and ids:
            lp = P.completion_logprobs(ids, entries, r.num_top_logprobs, self.token_text, c.text_offset)
            c.text_offset += sum(len(t) for t in lp.tokens)
        choice = P.CompletionChoice(c.index, text, lp, out.finish_reason, out.stop_reason)
        return P.sse(P.Completion(r.response_id, r.created, r.model, [choice], self._chunk_usage(r)))

    @staticmethod
    def _tool_delta(c: _Choice, out) -> P.ChatDelta:
        """A chunk's delta with the choice's tool parser in the way: the content that is final and the calls that
        parsed (each sent whole, once: its index, id, name and arguments)."""
        content, calls = c.tool_stream.feed(out.text) if out.text else ("", [])
        if out.finish_reason is not None:
            tail, more = c.tool_stream.finish(out.finish_reason == "length")
            content, calls = content + tail, calls + more
        deltas = []
        for call in calls:
            deltas.append(P.DeltaToolCall(c.num_tool_calls, call.id, "function",
                                          P.FunctionCallOut(call.name, call.arguments)))
            c.num_tool_calls += 1
        return P.ChatDelta(content=content or None, tool_calls=deltas or None)

    def _usage_chunk(self, r: _Request, usage: P.Usage | None = None) -> bytes:
        """The stream's usage chunk: ``r``'s usage, or ``usage`` (a batch's)."""
        usage = usage or r.usage()
        if r.chat:
            return P.sse(P.ChatCompletionChunk(r.response_id, r.created, r.model, [], usage))
        return P.sse(P.Completion(r.response_id, r.created, r.model, [], usage))

    def token_bytes(self, token_id: int) -> bytes:
        """A token's bytes for chat logprobs (``models.text.Tokenizer.token_bytes``; its text's UTF-8 for a model
        without a tokenizer)."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            tok = self.engine.tokenizer
            raw = self._token_bytes[token_id] = (self.token_text(token_id).encode() if tok is None
                                                 else tok.token_bytes(token_id))
        return raw

    def token_text(self, token_id: int) -> str:
        """A token's text for logprobs (``token_id:<id>`` for a model without a tokenizer, as vLLM writes it)."""
        text = self._token_text.get(token_id)
        if text is None:
            tok = self.engine.tokenizer
            text = f"token_id:{token_id}" if tok is None else tok.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------


async def _naming_prompt(i: int, first):
    """A batch's prompt ``i``'s first output; the engine's refusal of it names ``prompt[i]``."""
    try:
        return await first
    except ApiError as exc:
        if exc.status >= 500:
            raise
        raise _for_prompt(i, exc) from None


def _for_prompt(i: int, exc: ApiError) -> ApiError:
    """``exc`` as the refusal of a batch's prompt ``i``."""
    return ApiError(exc.status, f"'prompt[{i}]': {exc.message}", param=f"prompt[{i}]", reason=exc.reason)


async def _end_with_error(response: web.StreamResponse, exc: ApiError) -> web.StreamResponse:
    """A stream whose request failed: the error event, then its end (unless the client is gone already)."""
    with contextlib.suppress(ConnectionError):
        await response.write_eof(P.sse(P.ErrorResponse(exc.info())) + P.SSE_DONE)
    return response


async def _each(awaitables) -> list:
    """The awaitables' results, run at once; the first to fail cancels the others (awaited), then raises."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await _cancel(tasks)
        raise


async def _cancel(tasks) -> None:
    """Cancel ``tasks`` and wait for them to end (an engine stream's next output is not left running)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.contextmanager
def _client_error(param: str):
    """A ValueError raised inside (a prompt or conversation the tokenizer or the chat template refuses) is the
    client's: ApiError 400 naming ``param``."""
    try:
        yield
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param) from None


def _choice_name(choice) -> str:
    """A tool_choice as an error message names it."""
    return f"'{choice}'" if isinstance(choice, str) else f"the function '{choice.function.name}'"


def _client_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id, checked: it becomes the response's id, the engine's (sent as UTF-8) and every log
    line's, so at most MAX_REQUEST_ID_CHARS printable characters of valid UTF-8 (the header's bytes are decoded with
    surrogate escapes: a byte that is not UTF-8 would fail only where the id is sent on)."""
    given = request.headers.get("X-Request-Id")
    if given is None:
        return None
    if len(given) > MAX_REQUEST_ID_CHARS:
        raise ApiError(400, f"'X-Request-Id' has {len(given)} characters; at most {MAX_REQUEST_ID_CHARS}",
                       param="X-Request-Id")
    try:
        given.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "'X-Request-Id' is not valid UTF-8", param="X-Request-Id") from None
    if not given.isprintable():
        raise ApiError(400, "'X-Request-Id' has a control character; only printable characters are accepted",
                       param="X-Request-Id")
    return given


def _json(obj, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=P.encode(obj), status=status, content_type="application/json", headers=headers)


def _error_response(exc: ApiError) -> web.Response:
    if exc.status >= 500:
        log.warning("HTTP %d: %s", exc.status, exc.message)
    else:
        log.info("HTTP %d: %s", exc.status, exc.message)
    return web.Response(body=exc.body(), status=exc.status, content_type="application/json")


def _too_large(size: int | None, limit: int) -> ApiError:
    got = f" ({size} bytes)" if size is not None else ""
    return ApiError(413, f"the request body is too large{got}; at most {limit} bytes are accepted",
                    reason="request_too_large")


def _http_error(exc: web.HTTPException, request: web.Request, max_body_bytes: int) -> ApiError:
    if exc.status == 413:
        return _too_large(None, max_body_bytes)
    if exc.status == 404:
        return ApiError(404, f"no route {request.path}", reason="not_found")
    if exc.status == 405:
        return ApiError(405, f"{request.method} is not allowed on {request.path}", reason="method_not_allowed")
    if exc.status == 403 and request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        # (aiohttp-cors refuses a preflight with 403; vLLM's server, Starlette's CORS, with 400)
        return ApiError(400, exc.text or "CORS preflight refused", reason="cors_preflight_refused")
    return ApiError(exc.status, exc.reason or f"HTTP {exc.status}")


_FIELD = re.compile(r"^'?([a-z_]+)'?\b")
_PARAMS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | {
    "prompt", "prompt_token_ids", "messages", "response_format", "tools", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar"}


def _request_error(exc: RequestError) -> ApiError:
    """The engine's refusal as a 400; ``param`` is the field its message starts with, when it names one."""
    message = str(exc)
    m = _FIELD.match(message)
    return ApiError(400, message, param=m.group(1) if m and m.group(1) in _PARAMS else None)


def _tool_finish_reason(r: _Request, finish_reason: str | None) -> str | None:
    """"tool_calls" when the output called tools (tool_choice auto or required); a named choice keeps the engine's
    reason, as OpenAI's API and vLLM do."""
    return "tool_calls" if r.tools.choice in ("auto", "required") and finish_reason == "stop" else finish_reason


def _num_top_logprobs(req) -> int | None:
    if isinstance(req, P.ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def _server_max_tokens(defaults: SamplingParams) -> int | None:
    """The checkpoint's ``max_new_tokens`` (a chat request's default cap), or None when its generation config sets
    none: ``default_params.max_tokens`` differs from SamplingParams' own default only when the checkpoint set it."""
    own = SamplingParams.__dataclass_fields__["max_tokens"].default
    return defaults.max_tokens if defaults.max_tokens != own else None


def _is_engine_error(exc: BaseException) -> bool:
    """The engine's own failure type (its message says it all; no traceback needed)."""
    return type(exc).__name__ == "EngineError"
