"""One streamed request to an OpenAI-compatible server, timed as ``vllm bench serve`` times it.

The request asks for a server-sent-event stream with ``stream_options: {include_usage: true}``. Every event that
carries text is a token event: the first sets TTFT, each later one adds an inter-token latency (ITL; under
speculative decoding one event can carry several tokens, as in vLLM's measurement), and the last ends the
request's end-to-end latency. Output tokens come from the final ``usage`` event; a server that sends none gets
its token events counted instead (an undercount where an event carries several tokens), and the result says so.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from dispatcher.bench import BenchError
from dispatcher.bench.datasets import Conversation, SampleRequest
from dispatcher.engine.workload import approx_num_tokens

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BACKEND_NAMES = {"completions": "openai", "chat": "openai-chat"}
"""vLLM's ``--backend`` names for the two endpoints (its results' ``backend`` field and default label)."""


@dataclass(frozen=True)
class Endpoint:
    kind: str
    """``completions`` or ``chat``."""
    base_url: str
    model: str
    headers: dict[str, str]
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINT_PATHS[self.kind]


@dataclass
class RequestOutput:
    """One request's timing. Times in seconds from ``time.perf_counter``."""

    success: bool = False
    error: str = ""
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    """From sending to the last token event."""
    output_tokens: int = 0
    output_tokens_from_usage: bool = False
    prompt_len: int = 0
    prompt_len_from_usage: bool = False
    cached_tokens: int | None = None
    """The server's ``usage.prompt_tokens_details.cached_tokens`` (None where it reports none)."""
    generated_text: str = ""


def auth_headers(api_key: str | None) -> dict[str, str]:
    """A bearer token from ``--api-key``, else $OPENAI_API_KEY (vLLM's convention), else none."""
    key = api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def request_body(endpoint: Endpoint, req: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": endpoint.model, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.kind == "chat":
        # max_completion_tokens is the current name, max_tokens the one older servers read: send both.
        body.update(messages=[*req.history, {"role": "user", "content": req.prompt}],
                    max_completion_tokens=req.output_len, max_tokens=req.output_len)
    else:
        body.update(prompt=req.prompt, max_tokens=req.output_len)
    if endpoint.ignore_eos:
        body["ignore_eos"] = True
    body.update(endpoint.extra_body)
    return body


def first_choice(event: dict[str, Any]) -> dict[str, Any]:
    """A stream event's first choice ({} for usage-only events and malformed ones)."""
    choices = event.get("choices") or []
    return choices[0] if choices and isinstance(choices[0], dict) else {}


def event_text(kind: str, event: dict[str, Any]) -> str:
    """The text a stream event carries ('' for role-only, usage-only and finish events)."""
    choice = first_choice(event)
    if kind == "chat":
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
    return choice.get("text") or ""


async def sse_events(response: aiohttp.ClientResponse):
    """The ``data`` payloads (bytes) of a server-sent-event stream, one per event, ``[DONE]`` ending it. Reads
    whatever has arrived at once and splits it here (aiohttp's line reader costs more than the parsing)."""
    pending = b""
    data: list[bytes] = []
    async for chunk in response.content.iter_any():
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if line.startswith(b"data:"):
                data.append(line[6:] if line.startswith(b"data: ") else line[5:])
            elif not line and data:
                payload, data = b"\n".join(data), []
                if payload == b"[DONE]":
                    return
                yield payload
    if pending.startswith(b"data:"):
        data.append(pending[6:] if pending.startswith(b"data: ") else pending[5:])
    if data and b"\n".join(data) != b"[DONE]":
        yield b"\n".join(data)


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def send_request(session: aiohttp.ClientSession, endpoint: Endpoint, req: SampleRequest) -> RequestOutput:
    """Stream one request and time it; failures come back as ``success=False`` with a one-line ``error``."""
    out = RequestOutput(prompt_len=req.prompt_len)
    body = request_body(endpoint, req)
    token_events = 0
    finished_at = None
    text: list[str] = []
    start = last = time.perf_counter()
    out.start_time = start
    try:
        async with session.post(endpoint.url, json=body, headers=endpoint.headers) as response:
            if response.status != 200:
                out.error = f"HTTP {response.status}: {one_line(await response.text())}"
                return out
            async for payload in sse_events(response):
                now = time.perf_counter()
                event = json.loads(payload)
                if not isinstance(event, dict):
                    shown = one_line(payload.decode(errors="replace"), 100)
                    out.error = f"a stream event is not a JSON object: {shown}"
                    return out
                if isinstance(event.get("error"), (dict, str)) and not event.get("choices"):
                    out.error = f"server error in the stream: {one_line(json.dumps(event['error']))}"
                    return out
                piece = event_text(endpoint.kind, event)
                if finished_at is None and first_choice(event).get("finish_reason") in ("stop", "length"):
                    finished_at = now
                if piece:
                    if token_events == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    token_events += 1
                    text.append(piece)
                usage = event.get("usage")
                if isinstance(usage, dict):
                    if isinstance(usage.get("completion_tokens"), int):
                        out.output_tokens, out.output_tokens_from_usage = usage["completion_tokens"], True
                    if isinstance(usage.get("prompt_tokens"), int):
                        out.prompt_len, out.prompt_len_from_usage = usage["prompt_tokens"], True
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                        out.cached_tokens = details["cached_tokens"]
            await response.read()  # the rest after [DONE] (the chunked end): the connection goes back to the pool
    except json.JSONDecodeError as exc:
        out.error = f"a stream event is not JSON ({exc.msg})"
        return out
    except Exception as exc:  # noqa: BLE001 - a load generator records a failed request and goes on (as vLLM's)
        kind = "timed out" if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__
        out.error = one_line(f"{kind}: {exc}")
        return out
    if token_events == 0 and finished_at is not None and out.output_tokens_from_usage and out.output_tokens:
        # Tokens whose text is empty (special tokens skipped, a random model's byte pieces): a request that ran,
        # timed to its finish event as vLLM's client times it to its first chunk
        out.ttft, token_events, last = finished_at - start, 1, finished_at
    if token_events == 0:
        out.error = "the stream ended without a token"
        return out
    if not out.output_tokens_from_usage:
        out.output_tokens = token_events
    out.latency = last - start
    out.generated_text = "".join(text)
    out.success = True
    return out


async def send_conversation(session: aiohttp.ClientSession, endpoint: Endpoint,
                            conv: Conversation) -> list[RequestOutput]:
    """A conversation's turns in order, each request holding the earlier turns and the model's answers to them
    (the streamed text); one timed output per turn sent. A failed turn ends the conversation."""
    history: list[dict[str, str]] = []
    outputs = []
    for turn in conv.turns:
        req = SampleRequest(turn, approx_num_tokens("".join(m["content"] for m in history) + turn), conv.output_len,
                            tuple(history))
        out = await send_request(session, endpoint, req)
        outputs.append(out)
        if not out.success:
            break
        history += [{"role": "user", "content": turn}, {"role": "assistant", "content": out.generated_text}]
    return outputs


async def send(session: aiohttp.ClientSession, endpoint: Endpoint,
               item: SampleRequest | Conversation) -> list[RequestOutput]:
    """A request's timed output, or a conversation's (one per turn)."""
    if isinstance(item, Conversation):
        return await send_conversation(session, endpoint, item)
    return [await send_request(session, endpoint, item)]


def unreachable(url: str, exc: BaseException) -> BenchError:
    os_error = getattr(exc, "os_error", exc)
    if isinstance(os_error, OSError) and os_error.errno and os_error.errno > 0:
        reason = os.strerror(os_error.errno)  # "Connection refused", not asyncio's "Connect call failed (...)"
    elif isinstance(os_error, OSError) and os_error.strerror:
        reason = os_error.strerror  # name resolution: "Name or service not known"
    else:
        reason = one_line(str(exc))
    return BenchError(f"cannot reach the server at {url} ({reason or type(exc).__name__}); is it running?")


async def list_models(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> list[str] | None:
    """The model ids the server's ``/v1/models`` lists; None when the server has no such route (HTTP 404).
    BenchError for a server that cannot be reached or refuses (a one-line message naming the URL)."""
    url = base_url + "/v1/models"
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as response:
            if response.status == 404:
                return None
            if response.status in (401, 403):
                raise BenchError(f"{url}: HTTP {response.status} (the server wants a key: --api-key or "
                                 f"$OPENAI_API_KEY)")
            if response.status != 200:
                raise BenchError(f"{url}: HTTP {response.status}: {one_line(await response.text())}")
            data = await response.json(content_type=None)
    except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
        raise unreachable(base_url, exc) from None
    except (aiohttp.ClientError, json.JSONDecodeError) as exc:
        raise BenchError(f"{url}: not an OpenAI model list ({one_line(str(exc))})") from None
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise BenchError(f"{url}: not an OpenAI model list (no 'data' list)")
    return [m["id"] for m in entries if isinstance(m, dict) and isinstance(m.get("id"), str)]
