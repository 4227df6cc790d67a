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
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from dispatcher.serve import protocol as P
from dispatcher.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from dispatcher.serve.metrics import EngineMetrics, RequestTimer
from dispatcher.serve.protocol import ApiError
from dispatcher.serve.tools import DEFAULT_FORCED_PARSER, PARSERS, ToolParser, ToolStream
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
TOKENIZE_IN_THREAD_CHARS = 16384
"""Prompts longer than this are tokenized in a thread, so the event loop keeps streaming other requests."""

SERVER_KEY: web.AppKey[Server] = web.AppKey("twogrid_server")


def build_app(engine, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              log_requests: bool = False, tool_call_parser: str | None = None,
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
    app.router.add_get("/metrics", server.metrics_text)
    return app


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
class _Request:
    """One generation request between the checks and its last byte."""

    request_id: str
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
    completion_tokens: int = 0
    text_offset: int = 0
    finished: bool = False
    """The engine finished it (or failed it): nothing to abort."""
    num_cached_tokens: int | None = None
    """Prompt tokens the prefix cache held (usage's ``prompt_tokens_details.cached_tokens``), once it started."""
    tools: "_ToolUse | None" = None
    """Chat with tools whose calls are parsed out of the output (tool_choice auto with a parser, required, named)."""
    tool_stream: ToolStream | None = None
    num_tool_calls: int = 0


@dataclasses.dataclass(frozen=True)
class _ToolUse:
    """How a chat request uses its tools: the parser that reads the calls, the choice (auto, required, or the
    forced function's name), and for a forced call the grammar that makes the model write one."""

    parser: ToolParser
    choice: str
    forced: StructuredOutputsParams | None


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
        if self._auth is not None and request.path != "/health":
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, self._auth):
                raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
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
            return web.Response(body=ApiError(503, reason, code="unavailable").body(), status=503,
                                content_type="application/json")
        return web.Response(status=200)

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
            raise ApiError(503, reason, code="unavailable")
        body = await self._read_body(request)
        req = P.decode_request(body, P.ChatCompletionRequest if chat else P.CompletionRequest)
        if req.model is not None and req.model != self.engine.served_model_name:
            raise ApiError(404, f"the model '{req.model}' does not exist; this server serves "
                                f"'{self.engine.served_model_name}'", param="model", code="model_not_found")
        structured = P.structured_outputs(req)
        tools = self._tool_use(req, structured) if chat else None
        prompt, ids = await self._tokenize(req, chat)
        params = self._sampling_params(req, len(ids), chat, tools.forced if tools is not None and tools.forced
                                       else structured)
        r = _Request(P.new_id("chatcmpl" if chat else "cmpl"), chat, self.engine.served_model_name, int(time.time()),
                     prompt, ids, params, _num_top_logprobs(req), bool(req.stream),
                     bool(req.stream_options and req.stream_options.include_usage),
                     bool(req.stream_options and req.stream_options.continuous_usage_stats),
                     RequestTimer(self.metrics, len(ids), arrival), tools=tools,
                     tool_stream=tools.parser.stream() if tools is not None else None)
        if self.log_requests:
            shown = prompt if prompt is not None else str(ids)
            log.info("%s: prompt %r, %s", r.request_id, shown[:LOG_PROMPT_CHARS], params)
        outputs = self._run(r)
        self.in_flight += 1
        try:
            first = await anext(outputs)  # validation errors surface here, before the response starts
            if r.stream:
                return await self._stream(request, r, first, outputs)
            return await self._collect(r, first, outputs)
        finally:
            self.in_flight -= 1
            await self._end(r, outputs)

    async def _read_body(self, request: web.Request) -> bytes:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise _too_large(request.content_length, self.max_body_bytes)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(None, self.max_body_bytes) from None

    def _tool_use(self, req: P.ChatCompletionRequest, structured) -> _ToolUse | None:
        """Check ``tools`` and ``tool_choice`` as vLLM does; None when no call is to be parsed (no tools, or
        tool_choice "none")."""
        choice = req.tool_choice
        if not req.tools:
            if choice in (None, "none") or (choice == "required" and req.tools is not None):
                return None  # ("required" with an empty list: none, as OpenAI)
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
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
        parser = self.tool_parser or PARSERS[DEFAULT_FORCED_PARSER]
        tools = [msgspec.to_builtins(t) for t in req.tools]
        forced = StructuredOutputsParams(structural_tag=parser.structural_tag(tools, name, req.parallel_tool_calls
                                                                              is not False), where="tools")
        try:
            forced.validate()
        except StructuredOutputError as exc:
            raise ApiError(400, str(exc), param="tools") from None
        return _ToolUse(parser, choice if name is None else name, forced)

    async def _tokenize(self, req, chat: bool) -> tuple[str | None, list[int]]:
        tok = self.engine.tokenizer
        if chat:
            messages = P.chat_messages(req)
            if tok is None:
                raise ApiError(400, "this model has no tokenizer or chat template (a preset with random weights): "
                                    "use /v1/completions with token ids", param="messages")
            tools = {"tools": [msgspec.to_builtins(t) for t in req.tools]} if req.tools else {}
            prompt = await self._in_thread("messages", sum(len(m["content"]) for m in messages),
                                           tok.apply_chat_template, messages, add_generation_prompt=True, **tools)
            return prompt, await self._in_thread("messages", len(prompt), tok.encode, prompt, False)
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
        return prompt, await self._in_thread("prompt", len(prompt), tok.encode, prompt)

    @staticmethod
    async def _in_thread(param: str, size: int, fn, *args, **kwargs):
        """``fn(*args)``; in a worker thread for inputs of more than TOKENIZE_IN_THREAD_CHARS characters. A
        ValueError (models.text.TemplateError: a template that fails on these messages) is the client's: 400."""
        try:
            if size > TOKENIZE_IN_THREAD_CHARS:
                return await asyncio.to_thread(fn, *args, **kwargs)
            return fn(*args, **kwargs)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=param) from None

    def _sampling_params(self, req, prompt_len: int, chat: bool, structured=None) -> SamplingParams:
        max_tokens = self._max_tokens(req, prompt_len, chat)
        d = self.engine.default_params
        top_k = d.top_k if req.top_k is None else max(req.top_k, 0)
        params = dataclasses.replace(
            d, max_tokens=max_tokens,
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_p=d.top_p if req.top_p is None else req.top_p, top_k=top_k,
            seed=req.seed if req.seed is not None else d.seed, stop=P.stop_strings(req.stop),
            stop_token_ids=tuple(dict.fromkeys((*(req.stop_token_ids or ()), *d.stop_token_ids))),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
            logprobs=_num_top_logprobs(req), structured_outputs=structured)
        try:
            params.validate(self.engine.tokenizer.vocab_size if self.engine.tokenizer is not None else None)
        except RequestError as exc:
            raise _request_error(exc) from None
        return params

    def _max_tokens(self, req, prompt_len: int, chat: bool) -> int:
        limit = self.engine.max_model_len
        where = "messages" if chat else "prompt"
        if prompt_len == 0:
            raise ApiError(400, f"'{where}' has no tokens", param=where)
        if prompt_len >= limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens and the {where} has "
                                f"{prompt_len}: at most {limit - 1} leave room for one output token", param=where,
                           code="context_length_exceeded")
        room = limit - prompt_len
        name, asked = "max_tokens", req.max_tokens
        if chat and req.max_completion_tokens is not None:
            name, asked = "max_completion_tokens", req.max_completion_tokens
        if asked is None:  # completions: OpenAI's 16; chat: the checkpoint's max_new_tokens, else the room left
            default = _server_max_tokens(self.engine.default_params) if chat else DEFAULT_COMPLETION_MAX_TOKENS
            return room if default is None else min(default, room)
        if asked > room:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens; the {where} has "
                                f"{prompt_len} and '{name}' asks for {asked} more: '{name}' can be at most {room}",
                           param=name, code="context_length_exceeded")
        return asked

    # -- running a request --------------------------------------------------------------------------------------
    async def _run(self, r: _Request) -> AsyncIterator[Any]:
        """The engine's outputs (CompletionOutput) for ``r``; engine refusals as 400, failures as 500."""
        try:
            deltas = self.engine.generate(r.request_id, r.prompt, r.prompt_token_ids, r.params)
        except RequestError as exc:  # refused before it was queued: not a request that ran
            r.finished = True
            r.timer.discard()
            raise _request_error(exc) from None
        except Exception as exc:  # EngineError: dead, or shutting down
            r.finished = True
            r.timer.discard()
            raise ApiError(503, str(exc), code="unavailable") from None
        try:
            async for delta in deltas:
                out = delta.outputs[0]
                r.num_cached_tokens = delta.num_cached_tokens
                if out.finish_reason is not None:
                    r.finished = True
                    if out.finish_reason == "abort":  # the engine dropped it (a shutdown): an error, not a result
                        r.timer.finish("abort", time.perf_counter())
                        raise ApiError(503, "the server aborted the request (it is shutting down)", code="aborted")
                if r.num_top_logprobs is not None and out.token_ids and getattr(out, "logprobs", None) is None:
                    r.finished = True
                    await self.engine.abort(r.request_id)
                    raise ApiError(500, "the engine returned no logprobs for this request", code="engine_error")
                yield out
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
            raise ApiError(500, f"the engine failed: {exc}", code="engine_error") from None
        finally:  # the engine's stream, closed early (a client gone) or not
            close = getattr(deltas, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception:  # the request is over for the client either way
                    log.exception("%s: closing the engine's stream failed", r.request_id)
        r.finished = True
        raise ApiError(500, "the engine ended the request without a finish reason", code="engine_error")

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

    async def _collect(self, r: _Request, first, outputs) -> web.Response:
        text, token_ids, entries = [], [], []
        out = first
        while True:
            text.append(out.text)
            token_ids.extend(out.token_ids)
            if r.num_top_logprobs is not None and out.logprobs:
                entries.extend(out.logprobs)
            r.timer.output(len(out.token_ids), time.perf_counter())
            if out.finish_reason is not None:
                break
            out = await anext(outputs)
        r.completion_tokens = len(token_ids)
        self._finished(r, out)
        usage = P.usage(len(r.prompt_token_ids), len(token_ids), r.num_cached_tokens)
        if r.chat:
            lp = (P.chat_logprobs(token_ids, entries, r.num_top_logprobs, self.token_text)
                  if r.num_top_logprobs is not None else None)
            message, finish_reason = P.ChatMessageOut("assistant", "".join(text)), out.finish_reason
            if r.tools is not None:
                content, calls = r.tools.parser.parse(message.content)
                if calls:
                    message = P.ChatMessageOut("assistant", content, [
                        P.ToolCallOut(c.id, P.FunctionCallOut(c.name, c.arguments)) for c in calls])
                    finish_reason = _tool_finish_reason(r, finish_reason)
            choice = P.ChatChoice(0, message, lp, finish_reason, out.stop_reason)
            body: Any = P.ChatCompletion(r.request_id, r.created, r.model, [choice], usage)
        else:
            lp = (P.completion_logprobs(token_ids, entries, r.num_top_logprobs, self.token_text, 0)
                  if r.num_top_logprobs is not None else None)
            choice = P.CompletionChoice(0, "".join(text), lp, out.finish_reason, out.stop_reason)
            body = P.Completion(r.request_id, r.created, r.model, [choice], usage)
        return _json(body, headers={"X-Request-Id": r.request_id})

    async def _stream(self, request: web.Request, r: _Request, first, outputs) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": r.request_id})
        await response.prepare(request)
        pending = [self._role_chunk(r)] if r.chat else []
        out = first
        try:
            while True:
                chunk = self._chunk(r, out)
                if chunk is not None:
                    pending.append(chunk)
                if pending:
                    await response.write(b"".join(pending))
                    pending.clear()
                r.timer.output(len(out.token_ids), time.perf_counter())
                if out.finish_reason is not None:
                    break
                out = await anext(outputs)
        except ApiError as exc:  # the engine failed mid-stream: say so, then end the stream
            with contextlib.suppress(ConnectionError):  # unless the client is gone already
                await response.write(P.sse(P.ErrorResponse(P.ErrorInfo(exc.message, exc.type, exc.param, exc.code)))
                                     + P.SSE_DONE)
                await response.write_eof()
            return response
        self._finished(r, out)
        tail = P.SSE_DONE
        if r.include_usage:
            tail = self._usage_chunk(r) + tail
        await response.write(tail)
        await response.write_eof()
        return response

    def _finished(self, r: _Request, last) -> None:
        now = time.perf_counter()
        r.timer.finish(last.finish_reason, now)
        log.log(logging.INFO if self.log_requests else logging.DEBUG, "%s: %s, %d prompt + %d output tokens, %.3f s",
                r.request_id, last.finish_reason, len(r.prompt_token_ids), r.completion_tokens, now - r.timer.arrival)

    # -- stream chunks ------------------------------------------------------------------------------------------
    def _chunk_usage(self, r: _Request) -> P.Usage | None:
        if r.continuous_usage:
            return P.usage(len(r.prompt_token_ids), r.completion_tokens, r.num_cached_tokens)
        return None

    def _role_chunk(self, r: _Request) -> bytes:
        choice = P.ChatChunkChoice(0, P.ChatDelta(role="assistant", content=""), None, None)
        return P.sse(P.ChatCompletionChunk(r.request_id, r.created, r.model, [choice], self._chunk_usage(r)))

    def _chunk(self, r: _Request, out) -> bytes | None:
        """The event for one engine output; None when it carries nothing to send (tokens whose text is held back,
        without logprobs)."""
        r.completion_tokens += len(out.token_ids)
        want_logprobs = r.num_top_logprobs is not None and bool(out.token_ids)
        if not out.text and not want_logprobs and out.finish_reason is None:
            return None
        entries = (out.logprobs or []) if want_logprobs else []
        if r.chat:
            lp = (P.chat_logprobs(out.token_ids, entries, r.num_top_logprobs, self.token_text)
                  if want_logprobs else None)
            delta = self._tool_delta(r, out) if r.tool_stream is not None else (
                P.ChatDelta(content=out.text) if out.text else P.ChatDelta())
            if delta == P.ChatDelta() and not want_logprobs and out.finish_reason is None:
                return None  # (text the tool parser holds back)
            finish_reason = out.finish_reason
            if finish_reason is not None and r.num_tool_calls:
                finish_reason = _tool_finish_reason(r, finish_reason)
            choice = P.ChatChunkChoice(0, delta, lp, finish_reason, out.stop_reason)
            return P.sse(P.ChatCompletionChunk(r.request_id, r.created, r.model, [choice], self._chunk_usage(r)))
        lp = None
        if want_logprobs:
            lp = P.completion_logprobs(out.token_ids, entries, r.num_top_logprobs, self.token_text, r.text_offset)
            r.text_offset += sum(len(t) for t in lp.tokens)
        choice = P.CompletionChoice(0, out.text, lp, out.finish_reason, out.stop_reason)
        return P.sse(P.Completion(r.request_id, r.created, r.model, [choice], self._chunk_usage(r)))

    @staticmethod
    def _tool_delta(r: _Request, out) -> P.ChatDelta:
        """A chunk's delta with the tool parser in the way: the content that is final and the calls that parsed
        (each sent whole, once: its index, id, name and arguments)."""
        content, calls = r.tool_stream.feed(out.text) if out.text else ("", [])
        if out.finish_reason is not None:
            tail, more = r.tool_stream.finish()
            content, calls = content + tail, calls + more
        deltas = []
        for call in calls:
            deltas.append(P.DeltaToolCall(r.num_tool_calls, call.id, "function",
                                          P.FunctionCallOut(call.name, call.arguments)))
            r.num_tool_calls += 1
        return P.ChatDelta(content=content or None, tool_calls=deltas or None)

    def _usage_chunk(self, r: _Request) -> bytes:
        usage = P.usage(len(r.prompt_token_ids), r.completion_tokens, r.num_cached_tokens)
        if r.chat:
            return P.sse(P.ChatCompletionChunk(r.request_id, r.created, r.model, [], usage))
        return P.sse(P.Completion(r.request_id, r.created, r.model, [], usage))

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
                    code="request_too_large")


def _http_error(exc: web.HTTPException, request: web.Request, max_body_bytes: int) -> ApiError:
    if exc.status == 413:
        return _too_large(None, max_body_bytes)
    if exc.status == 404:
        return ApiError(404, f"no route {request.path}", code="not_found")
    if exc.status == 405:
        return ApiError(405, f"{request.method} is not allowed on {request.path}", code="method_not_allowed")
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
