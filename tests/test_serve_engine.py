"""The HTTP front end over the real serving engine: the engine process (and its CPU worker process) with the default model
(SmolLM2-135M-Instruct), driven by the official ``openai`` client: sensible answers, streams with usage, logprobs, a
refused request while serving, and a client that disconnects mid-stream freeing its KV blocks (about 30 s: marked
slow). Then ``twogrid serve`` on a random preset with speculative decoding and fixed acceptance: its
``spec_decode_*`` counters agree with each other and with the tokens served (about 15 s)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from serverutil import Server, http_get, http_post

openai = pytest.importorskip("openai")

KEY = "sk-engine-test"
NAME = "smol"


async def start_engine():
    from dispatcher.engine.protocol import EngineInit
    from dispatcher.messages import WorkerInit
    from dispatcher.serve.client import EngineClient
    from dispatcher.serve.metrics import EngineMetrics
    from models.default_model import DefaultModelError, default_model_path
    from models.text import load_tokenizer
    from scheduler.request import SamplingParams

    try:
        model = default_model_path()
    except DefaultModelError as exc:
        pytest.skip(f"the default model is not available: {exc}")
    max_model_len, blocks = 1024, 512
    init = WorkerInit(model, "cpu", "float32", "default", 16, 512, {}, {}, 16, max_model_len, max_model_len // 16,
                      blocks, 0.9, 0, False)
    tok = load_tokenizer(model)
    engine = EngineClient(EngineInit(init, [tok.eos_token_id]), tok, NAME, SamplingParams(), EngineMetrics(NAME))
    await engine.start()
    return engine, blocks


@pytest.mark.slow
def test_openai_client_against_the_real_engine():
    from dispatcher.serve.app import build_app, start_http

    async def go():
        engine, blocks = await start_engine()
        runner = await start_http(build_app(engine, api_key=KEY), "127.0.0.1", 0, shutdown_timeout=5)
        port = runner.addresses[0][1]
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        try:
            r = await client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=20)
            assert "Paris" in r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 20

            stream = await client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=8,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            texts, usage = [], None
            async for chunk in stream:
                texts.extend(c.text for c in chunk.choices)
                usage = chunk.usage or usage
            assert "Paris" in "".join(texts) and usage.completion_tokens == 8

            r = await client.completions.create(model=NAME, prompt="Hello", max_tokens=3, logprobs=2,
                                                extra_body={"ignore_eos": True})
            lp = r.choices[0].logprobs
            assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
            assert all(2 <= len(top) <= 3 and max(top.values()) <= 0 for top in lp.top_logprobs)

            with pytest.raises(openai.BadRequestError):
                await client.completions.create(model=NAME, prompt="Hello", max_tokens=5000)

            stream = await client.completions.create(model=NAME, prompt="Count to a thousand:", max_tokens=500,
                                                     stream=True, extra_body={"ignore_eos": True})
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
            await stream.close()  # the client goes away mid-stream
            def gauge(name):
                return engine.metrics.registry.get_sample_value(f"twogrid:{name}", {"model_name": NAME})

            for _ in range(200):  # the engine process reports its queue after the abort
                if gauge("num_requests_running") == 0 and gauge("kv_cache_usage_perc") == 0.0:
                    break
                await asyncio.sleep(0.05)
            assert gauge("num_requests_running") == 0 and gauge("num_requests_waiting") == 0
            assert gauge("kv_cache_usage_perc") == 0.0  # every KV block is back
        finally:
            await client.close()
            await runner.cleanup()
            await engine.shutdown(5)

    asyncio.run(go())


def test_spec_decode_counters_of_a_served_run_agree_with_the_tokens(tmp_path):
    """tiny-dense, eagle3 with K = 3 and --fixed-acceptance 2.5 (a seeded number of drafts accepted): every draft
    position's series is there from the start at 0, with the model_name label; after requests served one at a time
    (each alone in its steps after its prefill, so each verify event verifies K drafts) the counters, as the bench
    reads them, agree: K drafts per verify event, positions summing to the accepted drafts, and one token of the
    target's own plus the accepted drafts per verify event (fewer only in a request's last step, cut at
    max_tokens)."""
    from dispatcher.bench.server_metrics import counter_deltas, parse_counters

    k, n, max_tokens = 3, 4, 30
    spec = json.dumps({"method": "eagle3", "num_speculative_tokens": k})
    srv = Server(["--model", "tiny-dense", "--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "8",
                  "--max-num-batched-tokens", "128", "--num-kv-blocks", "256", "--speculative-config", spec,
                  "--fixed-acceptance", "2.5"], str(tmp_path / "server.log"))
    try:
        srv.wait_healthy()
        text = http_get(srv.base + "/metrics")[1].decode()
        for j in range(k):
            assert re.search(r'^twogrid:spec_decode_num_accepted_tokens_per_pos_total\{model_name="tiny-dense",'
                             rf'position="{j}"\}} 0\.0$', text, re.M), j
        before = parse_counters(text)
        start = counter_deltas({}, before)
        assert (start["spec_decode_num_drafts"], start["spec_decode_accepted_per_pos"],
                start["mean_acceptance_length"]) == (0, [0] * k, None)
        served = 0
        for i in range(n):
            status, body = http_post(srv.base + "/v1/completions", json.dumps(
                {"prompt": [5, 6, 7, 8 + i], "max_tokens": max_tokens, "ignore_eos": True}).encode())
            assert status == 200, body
            served += body["usage"]["completion_tokens"]
        run = counter_deltas(before, parse_counters(http_get(srv.base + "/metrics")[1].decode()))
    finally:
        srv.stop()
    assert served == n * max_tokens
    drafts, accepted, per_pos = (run["spec_decode_num_drafts"], run["spec_decode_num_accepted_tokens"],
                                 run["spec_decode_accepted_per_pos"])
    assert drafts > 0 and run["spec_decode_num_draft_tokens"] == k * drafts
    assert len(per_pos) == k and sum(per_pos) == accepted and drafts >= per_pos[0] >= per_pos[1] >= per_pos[2]
    from_verify = served - n  # each request's first token came from its prefill, the others from verify events
    assert from_verify <= accepted + drafts <= from_verify + k * n
    assert run["mean_acceptance_length"] == round(1 + accepted / drafts, 4)
    assert 1.8 < run["mean_acceptance_length"] < 3.2


def test_the_engines_part_of_each_ttft_is_counted_once_a_request(tmp_path):
    """``request_queue_time_seconds`` and ``request_prefill_time_seconds`` (vLLM's names): once per request, n = 2
    included (its first choice's), on its first token; their sum, the engine's part, lies within the server's TTFT
    (arrival at the front end to the first token's send), so that a benchmark can tell how much of a TTFT the
    front end took; ``request_preprocess_time_seconds``, the front end's part before the engine, once an engine
    request."""
    from dispatcher.bench.server_metrics import counter_deltas, parse_counters

    srv = Server(["--model", "tiny-dense", "--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "8",
                  "--max-num-batched-tokens", "128", "--num-kv-blocks", "256"], str(tmp_path / "server.log"))
    try:
        srv.wait_healthy()
        before = parse_counters(http_get(srv.base + "/metrics")[1].decode())
        for body in ({"prompt": [5, 6, 7], "max_tokens": 4}, {"prompt": [5, 6, 8] * 20, "max_tokens": 2},
                     {"prompt": [9, 10], "max_tokens": 3, "n": 2, "temperature": 0.7}):
            status, out = http_post(srv.base + "/v1/completions", json.dumps(body).encode())
            assert status == 200, out
        run = counter_deltas(before, parse_counters(http_get(srv.base + "/metrics")[1].decode()))
    finally:
        srv.stop()
    assert run["server_engine_first_tokens"] == run["server_first_tokens"] == 3
    assert run["server_queue_ms_mean"] >= 0 and run["server_prefill_ms_mean"] > 0
    assert run["server_queue_ms_mean"] + run["server_prefill_ms_mean"] <= run["server_ttft_ms_mean"]
    # the front end's part before the engine: once a request sent (n = 2 goes as one; the engine fans it out)
    assert run["server_sent_requests"] == 3 and run["server_preprocess_ms_mean"] > 0
    assert (run["server_preprocess_ms_mean"] + run["server_queue_ms_mean"] + run["server_prefill_ms_mean"]
            <= run["server_ttft_ms_mean"])
