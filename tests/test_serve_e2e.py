"""``twogrid serve`` as users run it: the real server in a subprocess (the default model, SmolLM2-135M-Instruct, in
a CPU worker process), driven by the official ``openai`` client and raw HTTP: answers, streams, 64 concurrent
streams, disconnects that free their KV blocks, /metrics, bad requests answered with 4xx while the server keeps
serving, and SIGTERM: exit 0, no ipc directory left (issue 13)."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import sys
import tempfile
import time

import pytest
from serverutil import Server, http_get, http_post, metrics

openai = pytest.importorskip("openai")
pytest.importorskip("torch")

KEY = "sk-e2e"
pytestmark = pytest.mark.slow


def _get(url: str, key: str | None = KEY) -> tuple[int, bytes]:
    return http_get(url, key)


def _post(url: str, body: bytes, key: str | None = KEY) -> tuple[int, dict]:
    return http_post(url, body, key)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from models.default_model import DefaultModelError, default_model_path

    try:
        default_model_path()
    except DefaultModelError as exc:
        pytest.skip(f"the default model is not available: {exc}")
    tmp = _private_tmp()
    logs = tmp_path_factory.mktemp("e2e")
    srv = Server(["--device", "cpu", "--max-num-seqs", "64", "--max-num-batched-tokens", "2048", "--max-model-len",
                  "512", "--served-model-name", "smol", "--shutdown-timeout", "5", "--step-trace",
                  str(logs / "trace.jsonl")], str(logs / "server.log"), key=KEY, env={"TMPDIR": tmp})
    srv.trace_path = str(logs / "trace.jsonl")
    try:
        srv.wait_healthy(180)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield srv, srv.base
    srv.stop()
    leftover = set(glob.glob(os.path.join(tmp, "twogrid-ipc-*")))
    assert not leftover, leftover
    os.rmdir(tmp)  # (empty: nothing else was left either)


def _client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _metric(base: str, name: str) -> float:
    return metrics(base, KEY)[name]


def test_the_step_trace_is_on_disk_while_the_server_runs(server):
    """Once the engine is idle every step it ran is in the trace file, while the server keeps running (the records
    sat in the file's buffer until the server stopped: ``tail -f`` showed nothing, a killed server lost them). The
    module's first test: no earlier test's steps fill the buffer."""
    srv, base = server

    def on_disk() -> list[dict]:
        with open(srv.trace_path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh]

    before = len(on_disk())
    status, _ = _post(base + "/v1/completions", json.dumps({"model": "smol", "prompt": "The trace test",
                                                            "max_tokens": 5, "ignore_eos": True}).encode())
    assert status == 200
    deadline = time.monotonic() + 5
    while len(records := on_disk()) < before + 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(records) >= before + 5 and all("t_s" in r for r in records)


def test_answers_streams_and_chat(server):
    _, base = server

    async def go():
        client = _client(base)
        try:
            r = await client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=24)
            assert "Paris" in r.choices[0].message.content and r.usage.completion_tokens <= 24
            stream = await client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": "Name a primary color."}], max_tokens=12,
                stream=True, stream_options={"include_usage": True})
            text, usage = "", None
            async for chunk in stream:
                text += "".join(c.delta.content or "" for c in chunk.choices)
                usage = chunk.usage or usage
            assert text.strip() and usage.completion_tokens <= 12
            r = await client.completions.create(model="smol", prompt="The capital of France is", max_tokens=6,
                                                extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 6 and "Paris" in r.choices[0].text
        finally:
            await client.close()

    asyncio.run(go())


def test_64_concurrent_streams_complete_and_disconnects_free_their_blocks(server):
    _, base = server

    async def one(client, i: int) -> int:
        stream = await client.completions.create(model="smol", prompt=f"Story number {i}:", max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def abandon(client) -> None:
        stream = await client.completions.create(model="smol", prompt="Count to a thousand:", max_tokens=400,
                                                 stream=True, extra_body={"ignore_eos": True})
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.close()

    async def go():
        client = _client(base)
        try:
            counts = await asyncio.gather(*(one(client, i) for i in range(64)), abandon(client), abandon(client))
            assert counts[:64] == [8] * 64
        finally:
            await client.close()

    asyncio.run(go())
    for _ in range(100):
        if _metric(base, "twogrid:kv_cache_usage_perc") == 0.0 and _metric(base, "twogrid:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert _metric(base, "twogrid:kv_cache_usage_perc") == 0.0
    assert _metric(base, "twogrid:num_requests_running") == 0
    assert _metric(base, "twogrid:cudagraph_steps_total") > 0  # CPU: STATIC_FULL / STATIC_PIECEWISE steps
    assert _metric(base, "twogrid:request_success_total") >= 66


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "JSON"),
    (json.dumps({"model": "smol", "prompt": "hi", "max_tokens": "many"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "smol", "prompt": "hi", "max_tokens": -3}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "smol", "prompt": "hi", "max_tokens": 10**9}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "smol", "prompt": "word " * 600, "max_tokens": 4}).encode(), 400, "512"),
    (json.dumps({"model": "nope", "prompt": "hi"}).encode(), 404, "nope"),
    (json.dumps({"model": "smol", "prompt": "hi", "unknown_field": 1}).encode(), 400, "unknown_field"),
])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, body, status, needle):
    _, base = server
    got, payload = _post(base + "/v1/completions", body)
    assert got == status and needle in payload["error"]["message"], payload
    assert set(payload["error"]) >= {"message", "type", "param", "code"}
    body = json.dumps({"model": "smol", "prompt": "Hi", "max_tokens": 2}).encode()
    ok, answer = _post(base + "/v1/completions", body)
    assert ok == 200 and answer["usage"]["completion_tokens"] <= 2


def test_api_key_is_required_except_on_health(server):
    _, base = server
    assert _get(base + "/health", None)[0] == 200
    assert _get(base + "/v1/models", None)[0] == 401
    assert _get(base + "/v1/models", "wrong")[0] == 401
    status, body = _get(base + "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "smol"


def test_sigterm_stops_cleanly(server):
    srv, _ = server
    srv.signal(signal.SIGTERM)
    assert srv.wait(60) == 0
    output = srv.log()
    assert "capture plan" in output and "stopped" in output, output[-2000:]


def test_several_front_end_processes_share_the_port_and_the_metrics(tmp_path):
    """--api-server-count 3 (and --stream-interval 4, which every front end takes): two more front-end processes
    serve the same port through the one engine; 48 concurrent
    requests (streamed and not, many connections, so the kernel spreads them) all complete with their token
    counts; every /metrics scrape, whichever process answers it, shows the whole server's totals and the queue
    back at 0; a disconnect frees its blocks; SIGTERM ends every process and leaves no ipc or metrics directory."""
    import aiohttp

    tmp = _private_tmp()
    srv = _multi_front_end_server(tmp_path, 3, "--max-num-seqs", "64", "--shutdown-timeout", "5",
                                  "--stream-interval", "4", tmpdir=tmp)  # (which the other front ends get too)
    try:
        assert len(_children(srv)) == 3  # the engine and two front ends

        async def one(session, i: int) -> int:
            body = {"model": "smol", "prompt": f"Story number {i}:", "max_tokens": 6, "ignore_eos": True}
            if i % 2:
                body.update(stream=True, stream_options={"include_usage": True})
            headers = {"Authorization": f"Bearer {KEY}"}
            async with session.post(srv.base + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                if not i % 2:
                    return (await r.json())["usage"]["completion_tokens"]
                usage = None
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        usage = json.loads(line[6:]).get("usage") or usage
                return usage["completion_tokens"]

        async def leave(session) -> None:
            body = {"model": "smol", "prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            async with session.post(srv.base + "/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {KEY}"}) as r:
                async for _ in r.content:
                    break

        async def go():
            connector = aiohttp.TCPConnector(force_close=True)  # a connection per request
            async with aiohttp.ClientSession(connector=connector) as session:
                counts = await asyncio.gather(*(one(session, i) for i in range(48)), leave(session))
            assert counts[:48] == [6] * 48

        asyncio.run(go())
        for _ in range(100):
            m = metrics(srv.base, KEY)
            if m["twogrid:num_requests_running"] == 0 and m["twogrid:kv_cache_usage_perc"] == 0.0:
                break
            time.sleep(0.1)
        for _ in range(6):  # new connections each: they land on any of the three processes
            m = metrics(srv.base, KEY)
            assert m["twogrid:generation_tokens_total"] >= 48 * 6
            assert m["twogrid:request_success_total"] == 49
            assert m["twogrid:num_requests_running"] == 0 and m["twogrid:kv_cache_usage_perc"] == 0.0
        srv.signal(signal.SIGTERM)
        assert srv.wait(60) == 0
    finally:
        srv.stop()
    assert not _leftovers(tmp)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT balancing is Linux's")
def test_front_ends_get_even_shares_of_a_burst_of_connections_and_the_port_is_theirs(tmp_path):
    """--api-server-count 4 and 512 connections opened at once (as `twogrid bench` primes its pool): each front end
    accepts close to a quarter (each its own socket of one SO_REUSEPORT group; on one shared socket the first to
    wake took up to a hundred at a time: 153 / 185 / 53 / 122 here). A second server on the same port is refused
    with one line before it starts an engine, rather than silently taking a share of the first one's connections."""
    import subprocess

    import aiohttp

    srv = _multi_front_end_server(tmp_path, 4, "--num-kv-blocks", "64")  # (no tokens generated: not 4 GiB of KV)
    try:
        before = len(srv.log().splitlines())

        async def burst():
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512)) as session:
                async def one():
                    async with session.get(srv.base + "/health?burst") as r:  # (named apart in the access log)
                        await r.read()
                await asyncio.gather(*(one() for _ in range(512)))

        asyncio.run(burst())
        deadline = time.monotonic() + 30  # (the access log lines come after the responses)
        while True:
            lines = [line for line in srv.log().splitlines()[before:] if '"GET /health?burst' in line]
            if len(lines) >= 512 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        shares = {name: sum(name in line for line in lines) for name in
                  ("aiohttp.access", "front end 1", "front end 2", "front end 3")}
        assert sum(shares.values()) == 512 and min(shares.values()) >= 90, shares
        second = subprocess.run([sys.executable, "-m", "dispatcher", "serve", "--port", str(srv.port), "--device",
                                 "cpu", "--api-server-count", "2"], capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [  # (alone: no engine started, nothing else logged)
            f"twogrid serve: error: --host/--port: cannot listen on 127.0.0.1:{srv.port}: address already in use "
            f"(another server there? give another --port)"]
    finally:
        srv.stop()


@pytest.mark.parametrize("victim", ["engine", "front end"])
def test_several_front_ends_fail_fast_when_the_engine_or_a_front_end_dies(tmp_path, victim):
    """--api-server-count 2 with 8 long streams in flight: SIGKILL the engine process, or front end 1. The server
    exits with code 1 within seconds (not after --shutdown-timeout 60), every stream ends (none hangs), and no ipc
    or metrics directory is left."""
    import aiohttp

    tmp = _private_tmp()
    srv = _multi_front_end_server(tmp_path, 2, "--max-num-seqs", "16", "--shutdown-timeout", "60", tmpdir=tmp)
    try:
        cmdlines = {pid: open(f"/proc/{pid}/cmdline", "rb").read() for pid in _children(srv)}
        engine = next(pid for pid, c in cmdlines.items() if b"dispatcher.engine.service" in c)
        front_end = next(pid for pid, c in cmdlines.items() if b"dispatcher.serve.frontend" in c)

        async def one(session, streaming: asyncio.Event) -> str:
            body = {"model": "smol", "prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            try:
                async with session.post(srv.base + "/v1/completions", json=body,
                                        headers={"Authorization": f"Bearer {KEY}"}) as r:
                    async for _ in r.content:
                        streaming.set()
                return "ended"
            except aiohttp.ClientError:
                return "ended"
            finally:
                streaming.set()

        async def go():
            connector = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=connector) as session:
                streaming = [asyncio.Event() for _ in range(8)]
                tasks = [asyncio.create_task(one(session, s)) for s in streaming]
                # every stream in flight (its first chunk in): 400 tokens each take far longer than the kill
                await asyncio.wait_for(asyncio.gather(*(s.wait() for s in streaming)), 60)
                os.kill(engine if victim == "engine" else front_end, signal.SIGKILL)
                t0 = time.monotonic()
                ends = await asyncio.wait_for(asyncio.gather(*tasks), 30)
                return ends, time.monotonic() - t0

        ends, took = asyncio.run(go())
        assert ends == ["ended"] * 8 and took < 20
        assert srv.wait(20) == 1
    finally:
        srv.stop()
    assert not _leftovers(tmp)


def _private_tmp() -> str:
    """A temporary directory for one server alone (its $TMPDIR): what it leaves there is its own, whatever other
    processes (another test run on the machine) do in the shared one meanwhile. Short, as socket paths must be."""
    return tempfile.mkdtemp(prefix="tg-")


def _leftovers(tmp: str) -> set[str]:
    """The server's private directories left in its temporary directory (ipc, multiprocess metrics); the directory
    itself is removed when they are none."""
    left = set(glob.glob(os.path.join(tmp, "twogrid-ipc-*")) + glob.glob(os.path.join(tmp, "twogrid-metrics-*")))
    if not left:
        os.rmdir(tmp)  # (empty, or this fails: anything else left counts too)
    return left


def _multi_front_end_server(tmp_path, count: int, *args: str, tmpdir: str | None = None) -> Server:
    """The default model on the CPU behind ``count`` front-end processes, healthy (skips without the model)."""
    from models.default_model import DefaultModelError, default_model_path

    try:
        default_model_path()
    except DefaultModelError as exc:
        pytest.skip(f"the default model is not available: {exc}")
    srv = Server(["--device", "cpu", "--max-model-len", "512", "--served-model-name", "smol", "--api-server-count",
                  str(count), *args], str(tmp_path / "server.log"), key=KEY,
                 env={"TMPDIR": tmpdir} if tmpdir else None)
    try:
        return srv.wait_healthy(180)
    except RuntimeError as exc:
        pytest.fail(str(exc))


def _children(srv: Server) -> list[int]:
    with open(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children", encoding="ascii") as fh:
        return [int(p) for p in fh.read().split()]
