"""The HTTP front end over the real serving engine: the engine process (and its CPU worker process) with the default model
(SmolLM2-135M-Instruct), driven by the official ``openai`` client: sensible answers, streams with usage, logprobs, a
refused request while serving, and a client that disconnects mid-stream freeing its KV blocks (about 30 s: marked
slow)."""

from __future__ import annotations

import asyncio

import pytest

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
