"""What the HTTP front end costs the engine's event loop: N concurrent streams through dispatcher/serve/app.py over
an engine stub that steps every ``--step-ms`` (one token for every running request a step, as a decode-only
engine does), with the client in another process.

The stub's step loop shares the event loop with the HTTP handlers, as the engine's does in ``twogrid serve``:
whatever time the front end takes between two steps delays the next one. So ``step_efficiency`` = target step
period / achieved step period is the fraction of the engine's throughput the front end leaves (the issue's target:
output tok/s through HTTP at least 90% of the offline engine's), and ``server_cpu_us_per_token`` is the front end's
own cost per streamed token. Repetitions after a warm-up; the median is reported.

    python benchmarks/bench_serve_frontend.py --concurrency 256 --output-len 256 --step-ms 20 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time

from _common import commit, write_json

from dispatcher.engine.output import CompletionOutput, RequestOutput
from dispatcher.serve.app import build_app, start_http
from dispatcher.serve.metrics import EngineMetrics
from scheduler.request import SamplingParams


class StepEngine:
    """EngineClient's interface over a step loop: every ``step_s`` each running request gets one token."""

    served_model_name = "stub"
    tokenizer = None
    max_model_len = 1 << 20
    default_params = SamplingParams()
    ready = True
    dead = None

    def __init__(self, step_s: float):
        self.metrics = EngineMetrics("stub")
        self.step_s = step_s
        self.running: dict[str, list] = {}
        self.steps = 0
        self.step_times: list[float] = []

    def generate(self, request_id, prompt, prompt_token_ids, params):
        params.validate()
        queue: asyncio.Queue = asyncio.Queue()
        self.running[request_id] = [queue, params.max_tokens, prompt_token_ids]
        return self._outputs(request_id, queue)

    async def _outputs(self, rid, queue):
        while True:
            delta = await queue.get()
            yield delta
            if delta.finished:
                return

    async def abort(self, request_id):
        self.running.pop(request_id, None)

    async def loop(self, stop: asyncio.Event):
        """Steps back to back: a step's "device time" is a sleep until its deadline, as a GPU step would run while
        the host is free; a late start (the loop was busy) delays every step after it."""
        next_at = time.perf_counter()
        while not stop.is_set():
            next_at = max(next_at + self.step_s, time.perf_counter())
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            self.step_times.append(time.perf_counter())
            if not self.running:
                continue
            self.steps += 1
            for rid, state in list(self.running.items()):
                queue, left, ids = state
                state[1] = left - 1
                done = "length" if left == 1 else None
                out = CompletionOutput(0, " tok", [7], done)
                queue.put_nowait(RequestOutput(rid, None, ids, [out], done is not None))
                if done:
                    del self.running[rid]


def client(port: int, concurrency: int, output_len: int, result: mp.Queue) -> None:
    """Runs in another process: ``concurrency`` streams at once, each for ``output_len`` tokens."""
    import aiohttp

    async def one(session):
        body = {"prompt": [1, 2, 3, 4], "max_tokens": output_len, "ignore_eos": True, "stream": True}
        events = 0
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for chunk in r.content.iter_any():
                events += chunk.count(b"data: ")
        return events - 1  # [DONE]

    async def main():
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            start = time.perf_counter()
            counts = await asyncio.gather(*(one(session) for _ in range(concurrency)))
            result.put((time.perf_counter() - start, sum(counts)))

    asyncio.run(main())


async def one_run(args, engine: StepEngine, port: int) -> dict:
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    stop = asyncio.Event()
    loop_task = asyncio.create_task(engine.loop(stop))
    cpu0, steps0, n0 = time.process_time(), engine.steps, len(engine.step_times)
    proc = ctx.Process(target=client, args=(port, args.concurrency, args.output_len, result))
    proc.start()
    while proc.is_alive() and result.empty():
        await asyncio.sleep(0.05)
    wall_s, tokens = result.get()
    cpu_s = time.process_time() - cpu0
    stop.set()
    await loop_task
    proc.join()
    times = engine.step_times[n0:]
    busy = [b - a for a, b in zip(times, times[1:])]
    # the steady part: every stream running (leave out the ramp-up and the drain)
    steady = busy[len(busy) // 10: -len(busy) // 10 or None]
    period = statistics.median(steady) if steady else float("nan")
    return {"wall_s": wall_s, "output_tokens": tokens, "output_tok_s": tokens / wall_s,
            "steps": engine.steps - steps0, "step_period_ms": period * 1e3,
            "step_efficiency": args.step_ms / (period * 1e3), "server_cpu_s": cpu_s,
            "server_cpu_us_per_token": cpu_s / tokens * 1e6}


async def main_async(args) -> dict:
    engine = StepEngine(args.step_ms / 1e3)
    runner = await start_http(build_app(engine), "127.0.0.1", 0, shutdown_timeout=1)
    port = runner.addresses[0][1]
    try:
        runs = []
        for i in range(args.warmup + args.repeat):
            r = await one_run(args, engine, port)
            print(f"{'warm-up' if i < args.warmup else 'run'} {i}: {r['output_tok_s']:.0f} tok/s, step period "
                  f"{r['step_period_ms']:.2f} ms (target {args.step_ms}), "
                  f"{r['server_cpu_us_per_token']:.1f} us CPU/token", file=sys.stderr)
            if i >= args.warmup:
                runs.append(r)
    finally:
        await runner.cleanup()
    keys = ("output_tok_s", "step_period_ms", "step_efficiency", "server_cpu_us_per_token")
    return {"benchmark": "serve_frontend", "commit": commit(), "concurrency": args.concurrency,
            "output_len": args.output_len, "step_ms": args.step_ms, "ideal_output_tok_s":
            args.concurrency * 1e3 / args.step_ms, "event_loop": type(asyncio.get_running_loop()).__module__,
            "cpus": os.cpu_count(), **{f"median_{k}": statistics.median(r[k] for r in runs) for k in keys},
            "runs": runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=20.0, help="the stub engine's step period")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-uvloop", action="store_true", help="the default asyncio loop instead of uvloop")
    p.add_argument("--out", default=None, help="result JSON")
    args = p.parse_args()
    if args.no_uvloop:
        result = asyncio.run(main_async(args))
    else:
        import uvloop

        result = uvloop.run(main_async(args))
    print(f"median: {result['median_output_tok_s']:.0f} tok/s of {result['ideal_output_tok_s']:.0f} ideal, step "
          f"efficiency {result['median_step_efficiency']:.3f}, {result['median_server_cpu_us_per_token']:.1f} us "
          f"server CPU per token")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
