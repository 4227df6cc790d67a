"""Helpers for the tests (and benchmarks/soak_cpu.py) that run ``twogrid serve`` in a subprocess: start it and wait
for /health, find its worker process and ipc directory, plain HTTP calls, /metrics values, a process's RSS, and a
streaming client that records each chunk's token ids (a server without a tokenizer names every token
``token_id:N`` in its logprobs), so that a stream can be checked token by token: nothing lost, nothing twice."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gpu_server(args: list[str], timeout_s: float = 300, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """``twogrid serve`` with ``args`` on a free port (its output piped), once /health answers 200: (process, base
    URL); the test fails with the end of its output if it exits first, or if it is not up within ``timeout_s``."""
    import pytest

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dispatcher", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited: {proc.stdout.read()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            time.sleep(1)
    proc.kill()
    pytest.fail("the server did not start")


def greedy_logprobs(base: str, model: str, prompts: list[list[int]], max_tokens: int,
                    timeout_s: float = 300) -> list[dict]:
    """Every prompt at once (concurrent requests) to /v1/completions, greedy, ``max_tokens`` tokens with EOS
    ignored, top-5 logprobs: each choice's ``logprobs`` (``tokens``, ``top_logprobs``)."""
    import concurrent.futures

    def one(prompt):
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                           "temperature": 0, "logprobs": 5}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())["choices"][0]["logprobs"]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def http_get(url: str, key: str | None = None, timeout_s: float = 10) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_post(url: str, body: bytes, key: str | None = None, timeout_s: float = 60) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metrics(base: str, key: str | None = None) -> dict[str, float]:
    """/metrics as {sample name: value summed over its labels}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_get(base + "/metrics", key)
    assert status == 200, (status, body[:300])
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for process {pid}")


def process_state(pid: int) -> str | None:
    """The process's state letter (R, S, Z for a zombie, ...), None when there is no such process (gone before its
    stat file opened, or between the open and the read: ESRCH)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _only_child(pid: int, module: str) -> int:
    """``pid``'s one child running ``python -m module`` (the engine also starts multiprocessing's fork server and
    resource tracker, for its grammar compilers)."""
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as fh:
        kids = [int(p) for p in fh.read().split()]
    ours = [k for k in kids if module.encode() in open(f"/proc/{k}/cmdline", "rb").read().split(b"\0")]
    assert len(ours) == 1, (kids, ours)
    return ours[0]


def _last_arg(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().rstrip(b"\0").split(b"\0")[-1].decode()


class Server:
    """``twogrid serve ARGS`` in a subprocess on a free port of 127.0.0.1, its output in ``log_path`` (a file, not a
    pipe: a pipe nobody reads fills up and blocks the server's logging)."""

    def __init__(self, args: list[str], log_path: str, key: str | None = None, env: dict | None = None):
        self.port = free_port()
        self.key = key
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "dispatcher", "serve", "--port", str(self.port), *args]
        if key:
            cmd += ["--api-key", key]
        self._log = open(log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, **(env or {})})

    def wait_healthy(self, timeout_s: float = 180) -> "Server":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if http_get(self.base + "/health")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server was not healthy within {timeout_s:.0f} s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        if not self._log.closed:  # (closed by stop(): a server that never became healthy is stopped first)
            self._log.flush()
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def engine_pid(self) -> int:
        """The engine process (the server's one child)."""
        return _only_child(self.proc.pid, "dispatcher.engine.service")

    def worker_pid(self) -> int:
        """The worker process (the engine process's one child)."""
        return _only_child(self.engine_pid(), "dispatcher.runtime.process")

    def ipc_dir(self) -> str:
        """The server's ipc directory (the engine's command line's last argument); the worker's is inside it."""
        return _last_arg(self.engine_pid())

    def worker_ipc_dir(self) -> str:
        """The engine's ipc directory for its worker (the worker's command line's last argument)."""
        return _last_arg(self.worker_pid())

    def metrics(self) -> dict[str, float]:
        return metrics(self.base, self.key)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 60) -> int:
        return self.proc.wait(timeout_s)

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM, SIGKILL if it has not exited within ``timeout_s`` (its worker then exits by itself)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# ---------------------------------------------------------------------------------------------------------------
# streams
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Stream:
    """What one streamed completion delivered."""

    status: int = 0
    tokens: list[int] = field(default_factory=list)
    """Every chunk's token ids, in order (a chunk seen twice shows here twice)."""
    chunks: int = 0
    finish_reason: str | None = None
    usage_tokens: int | None = None
    """completion_tokens of the final usage chunk."""
    error: str | None = None
    """An error event's message, or the body of a refusal."""
    done: bool = False
    """``[DONE]`` arrived."""
    left: bool = False
    """The client went away on purpose before the end."""
    events_after_done: int = 0
    ended_at: float = 0.0
    """time.monotonic() when the client was done with the stream."""

    @property
    def completed(self) -> bool:
        return self.done and self.error is None and self.finish_reason is not None and not self.left


def token_id(name: str) -> int:
    assert name.startswith("token_id:"), name
    return int(name.removeprefix("token_id:"))


async def stream_completion(session, base: str, body: dict, key: str | None = None,
                            leave_after_chunks: int | None = None, leave_after_s: float | None = None,
                            out: Stream | None = None) -> Stream:
    """POST a streamed completion with logprobs 0 and collect it (into ``out`` when given, which another thread
    may watch). The client goes away (closes the connection) after ``leave_after_chunks`` token chunks (0: once the
    response has started, before reading a token), or ``leave_after_s`` seconds after sending, whatever the
    request's state then (queued, prefilling, preempted, streaming)."""
    body = {**body, "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out = out if out is not None else Stream()

    async def consume():
        async with session.post(base + "/v1/completions", json=body, headers=headers) as r:
            out.status = r.status
            if r.status != 200:
                out.error = (await r.text())[:500]
                return
            if leave_after_chunks == 0:
                out.left = True
                return
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                _event(out, line[6:].strip())
                if leave_after_chunks is not None and out.chunks >= leave_after_chunks and out.finish_reason is None:
                    out.left = True
                    return  # leaving the block closes the connection mid-stream

    try:
        if leave_after_s is None:
            await consume()
        else:
            await asyncio.wait_for(consume(), leave_after_s)
    except asyncio.TimeoutError:
        out.left = True
    out.ended_at = time.monotonic()
    return out


def _event(out: Stream, data: bytes) -> None:
    if out.done:
        out.events_after_done += 1
        return
    if data == b"[DONE]":
        out.done = True
        return
    event = json.loads(data)
    if "error" in event:
        out.error = event["error"]["message"]
        return
    if event.get("usage"):
        out.usage_tokens = event["usage"]["completion_tokens"]
    for choice in event["choices"]:
        if choice.get("logprobs"):
            out.tokens.extend(token_id(t) for t in choice["logprobs"]["tokens"])
            out.chunks += 1
        out.finish_reason = choice.get("finish_reason") or out.finish_reason


def new_session(limit: int = 0):
    """An aiohttp session for many concurrent streams (no connection cap; long timeouts)."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=600, sock_read=120))


def token_prompts(n: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """``n`` distinct random token-id prompts (ids 3..vocab-1: no BOS or EOS)."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        p = [rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))]
        if tuple(p) not in seen:
            seen.add(tuple(p))
            out.append(p)
    return out


def request_body(prompt: list[int], max_tokens: int, seed: int, temperature: float = 0.8) -> dict:
    """A seeded sampling request with a fixed output length: its tokens are a function of the prompt and seed."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
            "ignore_eos": True}


class OfflineReference:
    """The offline engine (dispatcher.LLM) on the server's model and seed: ``ref(bodies)`` gives the tokens each
    request body must stream, token for token."""

    def __init__(self, model: str, max_model_len: int, seed: int = 0):
        from dispatcher.llm import LLM

        self.llm = LLM(model, device="cpu", max_model_len=max_model_len, max_num_seqs=256, seed=seed,
                       enforce_eager=True)

    def __call__(self, bodies: list[dict]) -> list[list[int]]:
        from scheduler.request import SamplingParams

        params = [SamplingParams(max_tokens=b["max_tokens"], temperature=b["temperature"], seed=b["seed"],
                                 ignore_eos=b["ignore_eos"]) for b in bodies]
        outs = self.llm.generate([{"prompt_token_ids": b["prompt"]} for b in bodies], params)
        return [list(o.outputs[0].token_ids) for o in outs]


def run_streams(base: str, bodies: list[dict], key: str | None = None, leave: list[dict] | None = None,
                outs: list[Stream] | None = None) -> tuple[list[Stream], float]:
    """All ``bodies`` as concurrent streams (``leave[i]``: stream i's ``leave_after_chunks`` / ``leave_after_s``;
    ``outs``: the Stream objects to fill); returns the streams and the wall time in seconds."""
    leave = leave or [{}] * len(bodies)
    outs = outs or [Stream() for _ in bodies]

    async def go():
        async with new_session() as session:
            return await asyncio.gather(*(stream_completion(session, base, b, key, out=out, **how)
                                          for b, how, out in zip(bodies, leave, outs)))

    t0 = time.perf_counter()
    streams = asyncio.run(go())
    return streams, time.perf_counter() - t0


def finished_requests(m: dict[str, float]) -> float:
    """Requests the server has counted as ended, whatever the reason (``request_success_total``)."""
    return m["twogrid:request_success_total"]


def wait_idle(server: Server, timeout_s: float = 10) -> dict[str, float]:
    """/metrics once no request runs or waits (aborts are processed asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        idle = m["twogrid:num_requests_running"] == 0 and m["twogrid:num_requests_waiting"] == 0
        if idle and m["twogrid:kv_cache_free_blocks"] == m["twogrid:kv_cache_blocks"] or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


@dataclass
class RoundFigures:
    """One round of streams, counted: a user relies on lost == 0 and duplicated == 0."""

    sent: int
    completed: int
    """Ended with a finish reason and [DONE], exactly its reference tokens."""
    failed: int
    """Ended with an error event or an error status."""
    lost: int
    """Anything else: wrong or missing tokens, no [DONE], no finish reason."""
    duplicated_chunks: int
    """Tokens beyond the reference's length (a chunk delivered twice)."""
    left: int = 0
    """Clients that went away on purpose."""
    wall_s: float = 0.0


def count_round(streams: list[Stream], reference: list[list[int]], wall_s: float = 0.0) -> RoundFigures:
    completed = failed = lost = dup = left = 0
    for s, ref in zip(streams, reference):
        dup += max(0, len(s.tokens) - len(ref))
        if s.left:
            left += 1
            lost += s.tokens != ref[:len(s.tokens)]  # what it got before leaving must still be right
        elif s.error is not None:
            failed += 1
        elif s.completed and s.tokens == ref and s.usage_tokens == len(ref) and not s.events_after_done:
            completed += 1
        else:
            lost += 1
    return RoundFigures(len(streams), completed, failed, lost, dup, left, round(wall_s, 2))


# ---------------------------------------------------------------------------------------------------------------
# hostile input
# ---------------------------------------------------------------------------------------------------------------


def hostile_bodies():
    """Request bodies a hostile or broken client sends: the schema's fields with values of any JSON type or at
    the edges of their ranges, unknown fields, unicode edge cases, broken JSON and bytes."""
    from hypothesis import strategies as st

    text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40) | st.sampled_from(
        ["", "\x00", "\u202e\u200d", "\U0001f469\u200d\U0001f4bb", "a" * 5000, "<|im_end|>", "\\u0000"])
    numbers = (st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
               | st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63) - 1, 1e308, -0.0, 0.5]))
    scalar = st.none() | st.booleans() | numbers | text
    json_value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=4)
                              | st.dictionaries(text, inner, max_size=4), max_leaves=12)
    fields = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
              "stop", "stop_token_ids", "seed", "ignore_eos", "logprobs", "top_logprobs", "stream", "stream_options",
              "n", "echo", "user", "frequency_penalty", "presence_penalty", "logit_bias", "include_stop_str_in_output",
              "skip_special_tokens", "suffix", "best_of", "repetition_penalty", "min_p", "min_tokens",
              "allowed_token_ids", "bad_words", "prompt_logprobs", "metadata", "store", "service_tier"]
    good = {
        "prompt": st.just("hi") | st.lists(st.integers(-5, 5000), min_size=0, max_size=5),
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool", "x"]),
                                                    "content": text | json_value}), max_size=3),
        "max_tokens": st.integers(-3, 300) | numbers, "stream": st.booleans(),
        "n": st.integers(-1, 300) | numbers, "temperature": st.floats(0, 2) | numbers,
        "logit_bias": st.dictionaries(st.integers(-5, 2**70).map(str) | text, numbers, max_size=4) | json_value,
        "allowed_token_ids": st.lists(st.integers(-5, 2**70), max_size=5) | json_value,
        "bad_words": st.lists(text, max_size=4) | json_value,
        "min_tokens": st.integers(-3, 400) | numbers, "prompt_logprobs": st.integers(-3, 30) | numbers,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_value,
    }
    field_values = st.sampled_from(fields).flatmap(lambda f: st.tuples(st.just(f), good.get(f, json_value)))
    documents = st.builds(dict, st.lists(field_values, max_size=8)) | st.dictionaries(text, json_value, max_size=3)
    as_json = documents.map(lambda d: json.dumps(d).encode())
    raw = st.binary(max_size=64) | st.sampled_from([
        b"{", b"null", b"[]", b'"x"', b"1e999", b'{"prompt": NaN}', b'{"prompt": "a", "max_tokens": Infinity}',
        b'{"prompt": "\xc3\x28"}', b'{"prompt": "\\ud800"}', b"\xef\xbb\xbf{}", b'{"prompt": "a"}' * 2,
        b'{"prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}", b'{"prompt": "a", "x": ' + b"{\"a\":" * 30000 + b"1"
        + b"}" * 30001, b'{"prompt": "' + b"a" * 70000 + b'"}'])
    return st.one_of(as_json, raw)


async def raw_http(port: int, request: bytes, timeout_s: float = 10) -> tuple[int | None, bytes]:
    """Send ``request`` as is on a new connection and read the answer: (status, body), status None when the server
    closed the connection without one."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(_read_response(reader), timeout_s)
    finally:
        writer.close()
    if not data:
        return None, b""
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def _read_response(reader) -> bytes:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:  # closed without (a whole) answer
        return exc.partial if b" " in exc.partial else b""
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    return head + await reader.readexactly(length)


def assert_ok_or_4xx(status: int, payload: bytes) -> None:
    """A hostile request's answer: 200, or a 4xx with a message in OpenAI's error shape (never a 5xx)."""
    import json as _json

    assert status == 200 or 400 <= status < 500, (status, payload[:300])
    if status != 200:
        error = _json.loads(payload)["error"]
        assert error["message"] and error["type"] == "invalid_request_error", error
