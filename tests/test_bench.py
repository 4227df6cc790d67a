"""``twogrid bench`` against a fake OpenAI-compatible server started inside the test (loopback only).

The fake streams ``max_tokens`` one-token events, the first after TTFT_S and the others GAP_S apart, counts the
requests in flight, and exports twogrid's Prometheus counters, which each request moves by known amounts.
"""

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from dispatcher.bench.client import sse_events
from dispatcher.bench.plot import plot_results
from dispatcher.bench.runner import arrival_offsets
from dispatcher.cli import main
from textdata import SHAREGPT

TTFT_S = 0.04
GAP_S = 0.01
MODEL = "fake-model"
VLLM_FIELDS = {
    "date", "endpoint_type", "backend", "label", "model_id", "num_prompts", "request_rate", "burstiness",
    "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "max_concurrent_requests",
    *(f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p50", "p90", "p99") for m in ("ttft", "tpot", "itl",
                                                                                            "e2el")),
}
HERE = os.path.dirname(os.path.abspath(__file__))


class FakeServer:
    """An OpenAI-compatible streaming server with twogrid's counters; runs its own event loop in a thread."""

    def __init__(self, usage=True, metrics=True, api_key=None, fail_after=None, silent=False, graphs=None):
        self.usage, self.metrics, self.api_key, self.fail_after = usage, metrics, api_key, fail_after
        self.silent = silent
        """Tokens without text (a server holds such events back): the finish event alone, then the usage."""
        self.in_flight_at_arrival: list[int] = []
        self.in_flight = 0
        self.requests: list[tuple[str, dict, dict]] = []
        self.health_peers: set = set()
        """The client ends (address, port) of the connections that asked for /health."""
        self.generate_peers: list = []
        self.registry = CollectorRegistry()
        self.eager = Counter("twogrid:eager_steps", "eager steps", ["reason"], registry=self.registry)
        self.padded = Counter("twogrid:padded_tokens", "padding", registry=self.registry)
        self.graph = Counter("twogrid:cudagraph_steps", "graph steps", ["kind", "mode"], registry=self.registry)
        self.other = Counter("vllm:other_thing", "a counter bench ignores", registry=self.registry)
        self.drafts = Counter("twogrid:spec_decode_num_drafts", "verify events", registry=self.registry)
        self.draft_tokens = Counter("twogrid:spec_decode_num_draft_tokens", "drafts", registry=self.registry)
        self.accepted = Counter("twogrid:spec_decode_num_accepted_tokens", "accepted", registry=self.registry)
        self.per_pos = Counter("twogrid:spec_decode_num_accepted_tokens_per_pos", "accepted per position",
                               ["position"], registry=self.registry)
        for position in "012":  # K = 3: every position from the start
            self.per_pos.labels(position=position)
        if graphs is not None:  # (captured, planned) of each of two kinds: a server that serves while it captures
            captured = Gauge("twogrid:cudagraphs_captured", "captured", ["runner", "kind"], registry=self.registry)
            planned = Gauge("twogrid:cudagraphs_planned", "planned", ["runner", "kind"], registry=self.registry)
            for kind in ("piecewise", "full_decode"):
                captured.labels(runner="target", kind=kind).set(graphs[0])
                planned.labels(runner="target", kind=kind).set(graphs[1])

    def authorized(self, request):
        return self.api_key is None or request.headers.get("Authorization") == f"Bearer {self.api_key}"

    async def models(self, request):
        if not self.authorized(request):
            return web.json_response({"error": "no key"}, status=401)
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def prometheus(self, request):
        if not self.metrics:
            raise web.HTTPNotFound()
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def health(self, request):
        self.health_peers.add(request.transport.get_extra_info("peername"))
        return web.Response(text="ok")

    async def generate(self, request):
        body = await request.json()
        self.generate_peers.append(request.transport.get_extra_info("peername"))
        self.requests.append((request.path, body, dict(request.headers)))
        if not self.authorized(request):
            return web.json_response({"error": "no key"}, status=401)
        if self.fail_after is not None and len(self.requests) > self.fail_after:
            return web.json_response({"error": {"message": "engine overloaded"}}, status=500)
        self.in_flight += 1
        self.in_flight_at_arrival.append(self.in_flight)
        try:
            return await self.stream(request, body)
        finally:
            self.in_flight -= 1

    async def stream(self, request, body):
        chat = request.path.endswith("/chat/completions")
        num_tokens = body["max_completion_tokens"] if chat else body["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(event):
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())

        if chat:  # a role-only event at once, as OpenAI servers send: not a token
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(TTFT_S)
        for i in range(num_tokens):
            if i:
                await asyncio.sleep(GAP_S)
            if self.silent:
                continue
            piece = f" w{i}"
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            await send({"choices": [choice]})
        await send({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        if self.usage and body.get("stream_options", {}).get("include_usage"):
            prompt = body["messages"][0]["content"] if chat else body["prompt"]
            await send({"choices": [], "usage": {"prompt_tokens": len(prompt.split()),
                                                 "completion_tokens": num_tokens}})
        await resp.write(b"data: [DONE]\n\n")
        self.graph.labels(kind="uniform_decode", mode="FULL").inc(num_tokens - 1)
        self.graph.labels(kind="mixed", mode="PIECEWISE").inc(1)
        self.eager.labels(reason="mixed_above_cap").inc(1)
        self.padded.inc(3)
        self.other.inc(1)
        # two verify events of K = 3 drafts: one accepts 2, one 1
        self.drafts.inc(2)
        self.draft_tokens.inc(6)
        self.accepted.inc(3)
        self.per_pos.labels(position="0").inc(2)
        self.per_pos.labels(position="1").inc(1)
        return resp


@pytest.fixture
def serve():
    """serve(**options) starts a FakeServer on a free loopback port; every one is stopped after the test."""
    started = []

    def start(**options):
        fake = FakeServer(**options)
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(loop)
            app = web.Application()
            app.router.add_get("/v1/models", fake.models)
            app.router.add_get("/metrics", fake.prometheus)
            app.router.add_get("/health", fake.health)
            app.router.add_post("/v1/completions", fake.generate)
            app.router.add_post("/v1/chat/completions", fake.generate)
            runner = web.AppRunner(app)
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            fake.url = "http://127.0.0.1:%d" % site._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert ready.wait(10)
        started.append((loop, thread))
        return fake

    yield start
    for loop, thread in started:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def bench(*args):
    return main(["bench", "--disable-tqdm", *args])


def saved(result_dir):
    files = sorted(os.listdir(result_dir))
    return [json.load(open(os.path.join(result_dir, f))) for f in files]


def test_two_concurrencies_against_a_server(serve, tmp_path, capsys):
    fake = serve()
    out_dir = tmp_path / "results"
    rc = bench("--base-url", fake.url, "--dataset-name", "random", "--random-input-len", "12",
               "--random-output-len", "6", "--num-prompts", "8", "--max-concurrency", "1,4", "--ignore-eos",
               "--save-result", "--result-dir", str(out_dir), "--label", "fake", "--plot", str(tmp_path / "p.png"))
    assert rc == 0
    names = sorted(os.listdir(out_dir))
    assert [n[: len("fake-infqps-concurrency1-fake-model-")] for n in names] == [
        "fake-infqps-concurrency1-fake-model-", "fake-infqps-concurrency4-fake-model-"]
    results = sorted(saved(out_dir), key=lambda r: r["max_concurrency"])
    assert [r["max_concurrency"] for r in results] == [1, 4]
    for r in results:
        assert VLLM_FIELDS <= set(r)
        assert r["model_id"] == MODEL and r["label"] == "fake" and r["request_rate"] == "inf"
        assert r["completed"] == 8 and r["failed"] == 0
        assert r["total_output_tokens"] == 8 * 6 and r["output_tokens_source"] == "usage"
        assert r["total_input_tokens"] == 8 * 12 and r["input_tokens_source"] == "usage"
        # timings: the server waits TTFT_S, then GAP_S between tokens
        assert TTFT_S * 1e3 <= r["mean_ttft_ms"] < TTFT_S * 1e3 + 40
        assert 0.8 * GAP_S * 1e3 <= r["mean_tpot_ms"] < GAP_S * 1e3 + 15
        assert 0.8 * GAP_S * 1e3 <= r["mean_itl_ms"] < GAP_S * 1e3 + 15
        assert r["mean_e2el_ms"] == pytest.approx(r["mean_ttft_ms"] + 5 * r["mean_tpot_ms"], rel=1e-6)
        assert r["p50_ttft_ms"] <= r["p90_ttft_ms"] <= r["p99_ttft_ms"]
        assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
        # the server's counters moved by exactly this run's requests (not the test request)
        assert r["eager_steps"] == 8 and r["eager_steps_by_reason"] == {"mixed_above_cap": 8}
        assert r["padded_tokens"] == 8 * 3
        assert r["cudagraph_steps"] == 8 * 6
        assert r["cudagraph_steps_by_kind_mode"] == {"mixed": {"PIECEWISE": 8}, "uniform_decode": {"FULL": 8 * 5}}
        assert (r["spec_decode_num_drafts"], r["spec_decode_num_draft_tokens"], r["spec_decode_num_accepted_tokens"],
                r["spec_decode_accepted_per_pos"]) == (8 * 2, 8 * 6, 8 * 3, [8 * 2, 8, 0])
        assert r["mean_acceptance_length"] == 2.5  # 1 + accepted / drafts
    assert results[0]["max_concurrent_requests"] == 1 and results[1]["max_concurrent_requests"] == 4
    # the server saw one test request, then 8 requests one at a time, then 8 at most 4 at a time
    assert fake.in_flight_at_arrival[:9] == [1] * 9
    assert max(fake.in_flight_at_arrival[9:]) == 4
    assert len(fake.requests) == 17
    for path, body, _ in fake.requests[1:]:
        assert path == "/v1/completions" and body["model"] == MODEL and body["max_tokens"] == 6
        assert body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True} and len(body["prompt"].split()) == 12
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Eager steps:" in out
    assert "Acceptance length:                       2.50" in out and "Position 1:" in out
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_several_client_processes_share_the_load(serve, tmp_path, capsys):
    """--num-clients 3: the same requests (saved in request order), every one completed, the concurrency cap split
    between the processes (4 = 2 + 1 + 1) and never exceeded, the timings those of one client."""
    fake = serve()
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": "w " * (3 + 2 * i)}]}
                                for i in range(9)]))
    runs = {}
    for clients in (1, 3):
        out_dir = tmp_path / f"c{clients}"
        rc = bench("--base-url", fake.url, "--dataset-path", str(data), "--sharegpt-output-len", "6",
                   "--num-prompts", "9", "--max-concurrency", "4", "--ignore-eos", "--num-clients", str(clients),
                   "--save-result", "--save-detailed", "--result-dir", str(out_dir))
        assert rc == 0
        runs[clients] = saved(out_dir)[0]
    one, three = runs[1], runs[3]
    assert three["completed"] == 9 and three["failed"] == 0 and three["num_clients"] == 3
    assert three["total_output_tokens"] == 9 * 6
    assert three["input_lens"] == one["input_lens"] and len(set(one["input_lens"])) == 9
    assert 1 <= three["max_concurrent_requests"] <= 4
    assert max(fake.in_flight_at_arrival[-9:]) <= 4
    assert TTFT_S * 1e3 <= three["mean_ttft_ms"] < TTFT_S * 1e3 + 40
    assert 0.8 * GAP_S * 1e3 <= three["mean_tpot_ms"] < GAP_S * 1e3 + 15
    assert 0 < three["client_cpu_fraction"] < 1


@pytest.mark.parametrize("clients", [1, 2])
def test_measured_requests_reuse_connections_opened_before_the_clock(serve, tmp_path, clients):
    """The pool is filled to the concurrency cap before the measured run starts: every measured request goes over
    a connection that was open (and asked for /health) before it, never more connections than the cap."""
    fake = serve()
    rc = bench("--base-url", fake.url, "--dataset-name", "random", "--random-input-len", "8",
               "--random-output-len", "3", "--num-prompts", "12", "--max-concurrency", "4", "--num-warmups", "0",
               "--num-clients", str(clients))
    assert rc == 0
    measured = fake.generate_peers[-12:]
    assert set(measured) <= fake.health_peers
    assert len(set(measured)) <= 4


def test_structured_output_flags_go_with_every_request(serve):
    """--response-format and --structured-outputs (the structured-output benchmark's) are sent as they are, with
    every request of the run and the test request."""
    fake = serve()
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert bench("--base-url", fake.url, "--dataset-name", "random", "--random-input-len", "4", "--random-output-len",
                 "2", "--num-prompts", "3", "--response-format", json.dumps(schema), "--structured-outputs",
                 '{"regex": "[0-9]+"}') == 0
    assert len(fake.requests) == 4
    for _, body, _ in fake.requests:
        assert body["response_format"] == schema and body["structured_outputs"] == {"regex": "[0-9]+"}


def test_chat_without_usage_or_metrics(serve, tmp_path, capsys):
    fake = serve(usage=False, metrics=False)
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "first prompt here"},
                                      {"from": "gpt", "value": "an answer"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "second prompt"}]},
    ]))
    rc = bench("--base-url", fake.url, "--endpoint", "chat", "--dataset-path", str(data), "--num-prompts", "5",
               "--sharegpt-output-len", "4", "--max-concurrency", "2", "--request-rate", "100", "--save-result",
               "--result-dir", str(tmp_path / "r"))
    assert rc == 0
    (r,) = saved(tmp_path / "r")
    assert r["backend"] == "openai-chat" and r["dataset_name"] == "sharegpt" and r["request_rate"] == 100.0
    assert r["duration"] >= arrival_offsets(5, 100.0, 0)[-1]
    assert r["completed"] == 5 and r["total_output_tokens"] == 5 * 4
    assert r["output_tokens_source"] == "chunks" and r["input_tokens_source"] == "estimate"
    assert r["mean_ttft_ms"] >= TTFT_S * 1e3  # the role-only event is not a token
    assert not any(k.startswith(("eager_steps", "padded_tokens", "cudagraph_steps", "spec_decode")) for k in r)
    assert "mean_acceptance_length" not in r
    prompts = {body["messages"][0]["content"] for _, body, _ in fake.requests[1:]}
    assert prompts == {"first prompt here", "second prompt"}
    for path, body, _ in fake.requests[1:]:
        assert path == "/v1/chat/completions" and body["max_completion_tokens"] == 4 and "ignore_eos" not in body
    assert max(fake.in_flight_at_arrival) <= 2
    assert "1 of 3 entries" in capsys.readouterr().err


def test_sampling_flags_and_extra_body_reach_every_request(serve, tmp_path):
    """vllm bench serve's sampling flags, then --extra-body over them, in every request's body (and the results)."""
    fake = serve()
    rc = bench("--base-url", fake.url, "--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "2",
               "--temperature", "0.7", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05",
               "--presence-penalty", "0.5", "--frequency-penalty", "0.1", "--repetition-penalty", "1.1",
               "--extra-body", '{"min_tokens": 2, "top_k": 30}', "--save-result", "--result-dir", str(tmp_path))
    assert rc == 0
    want = {"temperature": 0.7, "top_p": 0.9, "top_k": 30, "min_p": 0.05, "presence_penalty": 0.5,
            "frequency_penalty": 0.1, "repetition_penalty": 1.1, "min_tokens": 2}
    assert all({k: body.get(k) for k in want} == want for _, body, _ in fake.requests[1:])
    assert saved(tmp_path)[0]["sampling"] == want


def test_api_key_and_failed_requests(serve, tmp_path, capsys):
    fake = serve(api_key="sekrit", fail_after=3)
    assert bench("--base-url", fake.url, "--num-prompts", "4") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "HTTP 401" in err and "--api-key" in err
    rc = bench("--base-url", fake.url, "--api-key", "sekrit", "--num-prompts", "4", "--random-input-len", "4",
               "--random-output-len", "3", "--save-result", "--result-dir", str(tmp_path),
               "--result-filename", "run-{concurrency}.json")
    assert rc == 1  # two of the four measured requests failed
    assert os.listdir(tmp_path) == ["run-None.json"]
    (r,) = saved(tmp_path)
    assert r["completed"] == 2 and r["failed"] == 2 and r["max_concurrency"] is None
    assert all(h.get("Authorization") == "Bearer sekrit" for _, _, h in fake.requests[1:])
    assert "HTTP 500: " in capsys.readouterr().err


@pytest.mark.parametrize("usage", [True, False])
def test_a_stream_of_tokens_without_text_counts_when_the_usage_does(serve, tmp_path, usage, capsys):
    """A random model can emit only tokens whose text is empty (skipped special tokens): the server sends the
    finish event and the usage alone. That request ran, and counts with the usage's tokens, timed to its finish
    event (as vLLM's client counts its first chunk); without a usage it has nothing to count and fails."""
    fake = serve(silent=True, usage=usage)
    rc = bench("--base-url", fake.url, "--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "5",
               "--save-result", "--result-dir", str(tmp_path))
    err = capsys.readouterr().err
    if usage:
        (r,) = saved(tmp_path)
        assert rc == 0 and r["completed"] == 3 and r["total_output_tokens"] == 15
        assert r["mean_ttft_ms"] >= (TTFT_S + 4 * GAP_S) * 1e3
    else:
        assert rc != 0 and "the stream ended without a token" in err


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, needle", [
    (["--max-concurrency", "0"], "--max-concurrency: '0' is not a positive integer"),
    (["--max-concurrency", "4,x"], "--max-concurrency: 'x'"),
    (["--metric-percentiles", "50,101"], "--metric-percentiles: '101'"),
    (["--percentile-metrics", "ttft,latency"], "--percentile-metrics: 'latency'"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path"),
    (["--plot", "out.jpg"], "--plot: 'out.jpg' must end with"),
    (["--metadata", "novalue"], "--metadata: 'novalue' is not KEY=VALUE"),
    (["--base-url", "localhost:8000"], "--base-url must start with http://"),
    (["--max-concurrency", "1,2", "--result-filename", "a.json"], "put {concurrency} in it"),
    (["--num-clients", "0"], "--num-clients must be >= 1"),
    (["--extra-body", "[1]"], "--extra-body must be a JSON object"),
    (["--extra-body", "{x"], "--extra-body is not JSON"),
    (["--response-format", "{json_schema"], "--response-format: not JSON"),
    (["--structured-outputs", "[1]"], "--structured-outputs must be a JSON object"),
    (["--prefix-repetition-prefix-len", "64"], "--prefix-repetition-prefix-len is for --dataset-name "
                                               "prefix_repetition, not random"),  # (it was ignored)
    (["--dataset-name", "prefix_repetition", "--prefix-repetition-output-len", "0"],
     "--prefix-repetition-output-len must be >= 1"),
])
def test_bad_flags_are_one_line(args, needle, capsys):
    base = [] if "--base-url" in args else ["--base-url", f"http://127.0.0.1:{free_port()}"]
    assert bench(*base, *args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err


def test_unreachable_server_is_one_line(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert bench("--base-url", url, "--num-prompts", "2") == 2
    err = capsys.readouterr().err.strip()
    assert err == f"twogrid bench: error: cannot reach the server at {url} (Connection refused); is it running?"


@pytest.mark.parametrize("content, needle", [
    (None, "cannot read"),
    ("[{not json", "is not JSON"),
    (b"\x94\xff[", "is not UTF-8 text"),
    ('{"conversations": []}', "holds a JSON dict, not a list"),
    ('[{"id": 1, "conversations": [{"from": "gpt", "value": "x"}]}, 3]', "none of its 2 entries"),
])
def test_bad_dataset_is_one_line(content, needle, tmp_path, capsys):
    path = tmp_path / "data.json"
    if content is not None:
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    assert bench("--base-url", f"http://127.0.0.1:{free_port()}", "--dataset-path", str(path)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and str(path) in err and "--dataset-path" in err


def result(label, concurrency, tok_s, tpot_ms):
    return {"label": label, "max_concurrency": concurrency, "num_prompts": 64, "output_throughput": tok_s,
            "mean_tpot_ms": tpot_ms}


def test_plot_overlays_labels_from_saved_results(tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    for i, r in enumerate([result("separate", 16, 900.0, 10.0), result("separate", 64, 2000.0, 20.0),
                           result("separate", 64, 2200.0, 22.0), result("separate", 64, 2100.0, 21.0),
                           result("vllm-default", 16, 850.0, 11.0), result("vllm-default", None, 1500.0, 30.0)]):
        (runs / f"{i}.json").write_text(json.dumps(r))
    (runs / "notes.json").write_text('{"something": "else"}')
    png = tmp_path / "plot.png"
    lines = plot_results([str(runs)], str(png))
    assert lines == {"separate": [(16, 900.0, 10.0), (64, 2100.0, 21.0)],
                     "vllm-default": [(16, 850.0, 11.0), (64, 1500.0, 30.0)]}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "notes.json is not a bench result" in capsys.readouterr().err
    assert main(["bench", "--plot", str(tmp_path / "again.png"), str(runs / "0.json"), str(runs / "4.json")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 0
    assert main(["bench", "--plot", str(png), str(runs / "notes.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a bench result (no label, max_concurrency" in err
    assert main(["bench", str(runs / "0.json")]) == 2
    assert "without --plot" in capsys.readouterr().err
    many = [result(f"policy-{i}", c, 100.0 * i + c, 1.0 + i) for i in range(12) for c in (16, 64)]
    lines = plot_results([], str(tmp_path / "many.png"), many)  # (12 labels: the legend goes below the panels)
    assert len(lines) == 12 and (tmp_path / "many.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_poisson_arrivals():
    assert not arrival_offsets(5, float("inf"), 0).any()
    offsets = arrival_offsets(20000, 50.0, seed=3)
    assert offsets[0] == 0 and np.all(np.diff(offsets) >= 0)
    assert np.mean(np.diff(offsets)) == pytest.approx(1 / 50.0, rel=0.03)
    assert np.array_equal(offsets, arrival_offsets(20000, 50.0, seed=3))


class FakeContent:
    """aiohttp's response.content as far as sse_events reads it: chunks as they arrived."""

    def __init__(self, chunks):
        self.chunks = chunks

    async def iter_any(self):
        for chunk in self.chunks:
            yield chunk


def test_sse_parsing():
    stream = (b": ping\n\ndata: {\"a\": 1}\r\n\r\nevent: x\ndata: {\"b\":\ndata: 2}\n\ndata:{\"c\": \"\xc3\xa9\"}\n\n"
              b"data: [DONE]\n\ndata: {\"late\": 1}\n\n")

    class Response:
        def __init__(self, chunks):
            self.content = FakeContent(chunks)

    async def collect(chunks):
        return [json.loads(p) async for p in sse_events(Response(chunks))]

    expected = [{"a": 1}, {"b": 2}, {"c": "\u00e9"}]
    assert asyncio.run(collect([stream])) == expected
    # split anywhere, even inside a UTF-8 character, one byte at a time
    assert asyncio.run(collect([stream[i:i + 1] for i in range(len(stream))])) == expected
    # a last event without its blank line still counts
    assert asyncio.run(collect([b"data: {\"x\": 1}\n\ndata: {\"y\": 2}"])) == [{"x": 1}, {"y": 2}]


def test_real_sharegpt_file_loads():
    from dispatcher.bench.datasets import sharegpt_requests

    reqs = sharegpt_requests(SHAREGPT, 600, 256, seed=0)
    assert len(reqs) == 600 and all(r.output_len == 256 and r.prompt_len >= 1 for r in reqs)
    distinct = {c["conversations"][0]["value"] for c in json.load(open(SHAREGPT))}
    assert {r.prompt for r in reqs} == distinct
    assert [r.prompt for r in sharegpt_requests(SHAREGPT, 10, 256, seed=0)] == [r.prompt for r in reqs[:10]]


def test_plan_does_not_import_the_bench_client():
    code = ("import contextlib, io, sys; from dispatcher.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()): main(['plan', '--platform', 'sm100'])\n"
            "print(sorted(m for m in ('aiohttp', 'matplotlib', 'prometheus_client', 'dispatcher.bench') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(HERE)).stdout
    assert out.strip() == "[]"


def test_bench_says_when_the_server_was_still_capturing_its_graphs(serve, tmp_path, capsys):
    """A server that serves while it captures its CUDA graphs (twogrid serve's default on CUDA): a run that starts
    before they are all captured says so (its numbers are not the steady state) and records how many were; a server
    done capturing, or one without the gauges, gets neither."""
    for graphs, warned in (((3, 10), True), ((10, 10), False), (None, False)):
        fake = serve(graphs=graphs)
        out_dir = tmp_path / f"results-{graphs}"
        assert bench("--base-url", fake.url, "--dataset-name", "random", "--random-input-len", "8",
                     "--random-output-len", "2", "--num-prompts", "2", "--ignore-eos", "--save-result",
                     "--result-dir", str(out_dir)) == 0
        (result,) = saved(out_dir)
        err = capsys.readouterr().err
        if warned:
            assert "the server had captured 6 of its 20 CUDA graphs when this run started" in err
            assert "--no-delayed-cudagraph-capture" in err
            assert (result["cudagraphs_captured_at_start"], result["cudagraphs_planned"]) == (6, 20)
        else:
            assert "CUDA graphs when this run started" not in err and "cudagraphs_planned" not in result


def test_a_twogrid_server_without_eager_steps_reports_zero():
    """A labelled counter nothing incremented exports no sample; a twogrid server's result still says 0 eager steps
    (and a server without twogrid's counters gets no such fields)."""
    from dispatcher.bench.server_metrics import counter_deltas, parse_counters

    registry = CollectorRegistry()
    Counter("twogrid:eager_steps", "eager steps", ["reason"], registry=registry)
    padded = Counter("twogrid:padded_tokens", "padding", registry=registry)
    before = parse_counters(generate_latest(registry).decode())
    padded.inc(5)
    deltas = counter_deltas(before, parse_counters(generate_latest(registry).decode()))
    assert deltas["eager_steps"] == 0 and deltas["eager_steps_by_reason"] == {}
    assert deltas["padded_tokens"] == 5
    other = CollectorRegistry()
    Counter("vllm:num_preemptions", "x", registry=other)
    text = generate_latest(other).decode()
    assert counter_deltas(parse_counters(text), parse_counters(text)) == {}


def test_bench_reports_the_servers_fused_decode_steps():
    """``fused_decode_steps``: the steps the server ran as one fused graph during the run (bench_sampling_gpu shows
    which variants fuse)."""
    from dispatcher.bench.server_metrics import counter_deltas, parse_counters
    from dispatcher.serve.metrics import EngineMetrics

    metrics = EngineMetrics("m", CollectorRegistry())
    metrics.on_step("uniform_decode", "FULL", fused=True)  # before the run: not counted
    before = parse_counters(metrics.render().decode())
    for fused in (True, False, True):
        metrics.on_step("uniform_decode", "FULL", fused=fused)
    deltas = counter_deltas(before, parse_counters(metrics.render().decode()))
    assert deltas["fused_decode_steps"] == 2 and deltas["cudagraph_steps"] == 3


def test_bench_reports_the_servers_own_time_to_first_token():
    """``server_ttft_ms_mean``: the server's TTFT (a request's arrival at a front end to its first token's send)
    over the run, from its histogram's sum and count; beside the client's TTFT it tells how much of a TTFT the
    client's own process took. None when the run produced no first token."""
    from dispatcher.bench.server_metrics import counter_deltas, parse_counters
    from dispatcher.serve.metrics import EngineMetrics

    metrics = EngineMetrics("m", CollectorRegistry())
    metrics.on_first_token(5.0, 10)  # before the run: not counted
    before = parse_counters(metrics.render().decode())
    assert counter_deltas(before, before)["server_ttft_ms_mean"] is None
    for ttft_s in (0.010, 0.030, 0.020):
        metrics.on_first_token(ttft_s, 100)
    deltas = counter_deltas(before, parse_counters(metrics.render().decode()))
    assert deltas["server_first_tokens"] == 3 and deltas["server_ttft_ms_mean"] == pytest.approx(20.0)
    assert deltas["server_queue_ms_mean"] is None and deltas["server_prefill_ms_mean"] is None
    for queue_s, prefill_s in ((0.002, 0.004), (0.006, 0.008)):  # the engine's part of two of them
        metrics.on_engine_times(queue_s, prefill_s)
    deltas = counter_deltas(before, parse_counters(metrics.render().decode()))
    assert deltas["server_queue_ms_mean"] == pytest.approx(4.0)
    assert deltas["server_prefill_ms_mean"] == pytest.approx(6.0)
    assert deltas["server_preprocess_ms_mean"] is None  # (no request sent to the engine in the run)
    for preprocess_s in (0.001, 0.003):
        metrics.on_sent_to_engine(preprocess_s)
    deltas = counter_deltas(before, parse_counters(metrics.render().decode()))
    assert deltas["server_sent_requests"] == 2 and deltas["server_preprocess_ms_mean"] == pytest.approx(2.0)


def test_spec_decode_fields_from_the_counters():
    """The speculative-decoding fields as deltas of a server's counters: the per-position list in position order,
    the mean acceptance length null without drafts; an older twogrid server without num_drafts gets none of them."""
    from dispatcher.bench.server_metrics import counter_deltas, parse_counters

    registry = CollectorRegistry()
    drafts = Counter("twogrid:spec_decode_num_drafts", "x", ["model_name"], registry=registry).labels("m")
    tokens = Counter("twogrid:spec_decode_num_draft_tokens", "x", ["model_name"], registry=registry).labels("m")
    accepted = Counter("twogrid:spec_decode_num_accepted_tokens", "x", ["model_name"], registry=registry).labels("m")
    per_pos = Counter("twogrid:spec_decode_num_accepted_tokens_per_pos", "x", ["model_name", "position"],
                      registry=registry)
    for position in ("1", "0", "2", "3"):
        per_pos.labels("m", position)
    scrape = lambda: parse_counters(generate_latest(registry).decode())  # noqa: E731
    drafts.inc(5)  # before the run: not counted
    per_pos.labels("m", "0").inc(5)
    before = scrape()
    idle = counter_deltas(before, scrape())
    assert (idle["spec_decode_num_drafts"], idle["spec_decode_num_draft_tokens"], idle["spec_decode_accepted_per_pos"],
            idle["mean_acceptance_length"]) == (0, 0, [0, 0, 0, 0], None)
    drafts.inc(3)
    tokens.inc(12)
    accepted.inc(4)
    for position, n in (("0", 2), ("1", 1), ("2", 1)):
        per_pos.labels("m", position).inc(n)
    run = counter_deltas(before, scrape())
    assert (run["spec_decode_num_drafts"], run["spec_decode_num_draft_tokens"], run["spec_decode_num_accepted_tokens"],
            run["spec_decode_accepted_per_pos"]) == (3, 12, 4, [2, 1, 1, 0])
    assert run["mean_acceptance_length"] == round(1 + 4 / 3, 4)
    assert counter_deltas({}, scrape())["spec_decode_accepted_per_pos"] == [7, 1, 1, 0]  # totals since start
    older = CollectorRegistry()
    Counter("twogrid:spec_decode_num_accepted_tokens", "x", registry=older).inc(3)
    Counter("twogrid:padded_tokens", "x", registry=older)
    text = generate_latest(older).decode()
    deltas = counter_deltas(parse_counters(text), parse_counters(text))
    assert deltas["padded_tokens"] == 0 and not any(k.startswith("spec_decode") or k == "mean_acceptance_length"
                                                    for k in deltas)


def test_the_front_end_benchmark_streams_through_the_real_front_end(bpe, tmp_path):
    """``benchmarks/bench_serve_frontend.py`` (the front end's CPU per streamed event, behind docs/bench's
    serve_frontend_cpu.json) runs end to end on a small load: its clients' requests all complete (it broke once when
    ``run_requests`` began returning each request's turns) and it reports a cost per event."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "frontend.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_serve_frontend.py"), "--tokenizer",
                           bpe, "--data", SHAREGPT, "--concurrency", "8", "--step-ms", "10", "--output-len", "8",
                           "--waves", "1", "--warmup", "0", "--repeat", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    median = json.loads(out.read_text())["median"]
    assert median["output_tok_s"] > 0 and median["cpu_us_per_event"] > 0
    # (the front end's part of TTFT, its arrival to its send, within the clients' view of it, client to engine)
    assert 0 < median["ttft_in_front_end_ms"] <= median["ttft_in_ms"]


def test_the_training_step_benchmark_times_both_ways_of_getting_the_targets_features(tmp_path):
    """``benchmarks/bench_train_step.py`` (docs/bench/train_step_cpu.json) runs the trainer's step end to end on a
    small target, with the target run for each batch and with its features kept, and reports both and their
    ratio."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "train_step.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_train_step.py"), "--model",
                           "tiny-dense", "--device", "cpu", "--sequences", "4", "--seq-len", "48",
                           "--tokens-per-batch", "128", "--draft-vocab", "64", "--ttt", "2", "--steps", "1", "--out",
                           str(out)], capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"target_runs", "features_kept"} and result["speedup"] > 0
    assert all(parts["step_s"] >= parts["head_s"] > 0 for parts in result["modes"].values())
