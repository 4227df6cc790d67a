"""What one front-end process of ``twogrid serve`` costs per streamed event, on this machine's CPU.

The real front end (dispatcher/serve/app.py over ``EngineClient``: HTTP, tokenization, detokenization, SSE
chunks, metrics) with the engine process replaced by a step loop in the same process: every ``--step-ms`` it hands
``EngineClient`` one ``Outputs`` message (msgpack-encoded and decoded, as from the engine) with ``--tokens-per-step``
new token ids for every running request (3 is K = 7 at a mean acceptance length of 3). Clients in other processes
(``twogrid bench``'s client) stream ShareGPT prompts as text, ``--concurrency`` at a time in a closed loop, over
connections opened before the clock starts. Reported: the front end's CPU per streamed event and per token, the
events a second one process could stream at that cost, and whether it kept up (the achieved step period against
``--step-ms``: a saturated front end delays the step loop that shares its event loop). Median of ``--repeat`` runs
after ``--warmup``. The collector is set as ``twogrid serve``'s front ends set it (``freeze_startup_heap``), or left
as CPython sets it with ``--python-gc``.

    python benchmarks/bench_serve_frontend.py --tokenizer .gpu_data/smollm2-tokenizer --data sharegpt.json \\
        --concurrency 256 --step-ms 40 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import types
import zlib

import numpy as np
from _common import commit, conversations_file, write_json

from dispatcher.child import freeze_startup_heap
from dispatcher.engine.protocol import (Abort, AddRequest, Delta, Outputs, QueueState, StepRecord, decode_to_front,
                                        encode)
from dispatcher.serve.client import EngineClient
from dispatcher.serve.metrics import EngineMetrics
from scheduler.request import SamplingParams


class SimulatedEngine(EngineClient):
    """``EngineClient`` with its engine process replaced by a step loop here: requests are taken where they would
    be sent, and every step feeds ``_take`` the message the engine would send."""

    def __init__(self, tokenizer, step_s: float, tokens_per_step: int, token_ids: list[int], stream_interval: int = 1,
                 prefix_block_size: int = 16):
        init = types.SimpleNamespace(worker=types.SimpleNamespace(max_model_len=1 << 20), num_front_ends=1)
        super().__init__(init, tokenizer, "bench-moe", SamplingParams(), EngineMetrics("bench-moe"),
                         stream_interval=stream_interval)
        self.ready = True
        self.prefix_block_size = prefix_block_size  # (as EngineStarted sets it: the front end hashes each prompt)
        self.step_s, self.tokens_per_step, self.token_ids = step_s, tokens_per_step, token_ids
        self.preprocess_s: list[float] = []
        """Each request's front-end part before the engine (its arrival here to its send: what the metric
        ``request_preprocess_time_seconds`` observes)."""
        self.metrics.on_sent_to_engine = self.preprocess_s.append
        self.running: dict[str, list[int]] = {}
        self.step_times: list[tuple[float, int]] = []
        self.added_at: dict[str, float] = {}
        """When each request reached the engine (its ``AddRequest`` sent)."""
        self.first_at: dict[str, float] = {}
        """When the step that made each request's first token ran."""

    def _send(self, message) -> None:
        if isinstance(message, AddRequest):
            # (each request's answer read from its own place in the text: no two answers alike)
            offset = zlib.crc32(message.request_id.encode()) % len(self.token_ids)
            self.running[message.request_id] = [message.params.max_tokens, 0, offset]
            self.added_at[message.request_id] = time.perf_counter()
        elif isinstance(message, Abort):
            for rid in message.request_ids:
                self.running.pop(rid, None)

    async def loop(self, stop: asyncio.Event) -> None:
        next_at = time.perf_counter()
        while not stop.is_set():
            next_at = max(next_at + self.step_s, time.perf_counter())
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            self.step_times.append((time.perf_counter(), len(self.running)))
            if self.running:
                self._take(decode_to_front(encode(self._step())))

    def _step(self) -> Outputs:
        deltas = []
        now = time.perf_counter()
        for rid, state in list(self.running.items()):
            left, produced, offset = state
            if produced == 0:
                self.first_at[rid] = now
            n = min(self.tokens_per_step, left)
            start = (offset + produced) % (len(self.token_ids) - n)
            state[0], state[1] = left - n, produced + n
            done = state[0] == 0
            deltas.append(Delta(rid, self.token_ids[start:start + n], "length" if done else None))
            if done:
                del self.running[rid]
        record = StepRecord("uniform_decode", "FULL", None, 0, len(deltas), 0, self.step_s)
        return Outputs(deltas, [record], QueueState(len(self.running), 0, 1000, 1000))


def client(port: int, requests: list, cap: int, ready, go, results, extra_body: dict, kind: str) -> None:
    """One client process: ``twogrid bench``'s client (its session, pool priming and closed loop) on its requests,
    ``cap`` at a time."""
    from dispatcher.bench.client import Endpoint
    from dispatcher.bench.runner import open_session, prime_connections, run_requests

    endpoint = Endpoint(kind, f"http://127.0.0.1:{port}", "bench-moe", {}, ignore_eos=True,
                        extra_body=extra_body)

    async def main():
        async with open_session(cap) as session:
            await prime_connections(session, endpoint, cap)
            ready.put(1)
            await asyncio.get_running_loop().run_in_executor(None, go.wait)
            turns, duration = await run_requests(session, endpoint, requests, cap, np.zeros(len(requests)), "",
                                                 True)
            end = time.perf_counter()
            outputs = [o for request_turns in turns for o in request_turns]  # (a conversation's turns, in order)
            assert all(o.success for o in outputs), next(o.error for o in outputs if not o.success)
            results.put((end - duration, end, [(o.start_time, o.ttft) for o in outputs]))

    asyncio.run(main())


async def _next(queue, procs: list) -> object:
    """The queue's next item, waiting on the event loop (the front end shares it); a client process that ended
    without putting one (it failed: its traceback is above) ends the benchmark with an error."""
    while queue.empty():
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed:
            raise SystemExit(f"a client process failed (exit code {failed[0]})")
        await asyncio.sleep(0.02)
    return queue.get()


async def one_run(args, engine: SimulatedEngine, port: int, requests: list) -> dict:
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    shares = [requests[i::args.clients] for i in range(args.clients)]
    procs = [ctx.Process(target=client, args=(port, share, args.concurrency // args.clients, ready, go, results,
                                              json.loads(args.extra_body or "{}"), args.endpoint))
             for share in shares]
    for proc in procs:
        proc.start()
    for _ in procs:
        await _next(ready, procs)
    n0, cpu0 = len(engine.step_times), time.process_time()
    engine.added_at.clear()
    engine.first_at.clear()
    engine.preprocess_s.clear()
    if args.garbage:  # (the run's reference cycles kept for the count below: none is collected during it)
        gc.collect()
        gc.disable()
    go.set()
    spans = []
    while len(spans) < len(procs):
        spans.append(await _next(results, procs))
    cpu_s = time.process_time() - cpu0
    garbage = cyclic_garbage(len(requests)) if args.garbage else {}
    for proc in procs:
        proc.join()
    start, end = min(s for s, _, _ in spans), max(e for _, e, _ in spans)
    ttfts = sorted(t for _, _, ts in spans for _, t in ts)
    # (TTFT's three parts as means over the run's requests: the clients' and the engine's clocks are one monotonic
    # clock, and the same requests are in each set, so no request needs matching across processes)
    sent = statistics.mean(s for _, _, ts in spans for s, _ in ts)
    first_out = statistics.mean(s + t for _, _, ts in spans for s, t in ts)
    added, first = statistics.mean(engine.added_at.values()), statistics.mean(engine.first_at.values())
    tokens = sum(len(getattr(r, "turns", (r,))) for r in requests) * args.output_len
    events = tokens / args.tokens_per_step
    steps = [t for t in engine.step_times[n0:] if start <= t[0] <= end]
    full = sorted(b[0] - a[0] for a, b in zip(steps, steps[1:]) if a[1] >= 0.9 * args.concurrency)
    period_ms = statistics.median(full) * 1e3 if full else float("nan")
    return {"wall_s": round(end - start, 3), "output_tok_s": round(tokens / (end - start)),
            "front_end_cpu_cores": round(cpu_s / (end - start), 3), "cpu_us_per_event": round(cpu_s / events * 1e6, 1),
            "cpu_us_per_token": round(cpu_s / tokens * 1e6, 1), "step_period_ms": round(period_ms, 2),
            "step_efficiency": round(args.step_ms / period_ms, 3),
            "ttft_ms_mean": round(statistics.mean(ttfts) * 1e3, 2),
            "ttft_ms_p50": round(ttfts[len(ttfts) // 2] * 1e3, 2),
            "ttft_in_ms": round((added - sent) * 1e3, 2),
            "ttft_in_front_end_ms": round(statistics.mean(engine.preprocess_s) * 1e3, 2),
            "ttft_engine_ms": round((first - added) * 1e3, 2),
            "ttft_out_ms": round((first_out - first) * 1e3, 2), **garbage}


def cyclic_garbage(num_requests: int) -> dict:
    """What the run left for the cycle collector (``--garbage``): objects in unreachable reference cycles per
    request, and the most common types among them. Every one is work for a collection that pauses the front end
    (with ``GC_YOUNG_THRESHOLD`` a young collection walks ~50,000 objects: 20-46 ms on the H100 machine's host)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = list(gc.garbage)
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
        gc.enable()
    types_ = collections.Counter(type(o).__qualname__ for o in found)
    del found
    return {"cyclic_objects_per_request": round(sum(types_.values()) / num_requests, 1),
            "cyclic_types": types_.most_common(8)}


async def main_async(args) -> dict:
    from dispatcher.bench.datasets import sharegpt_conversations, sharegpt_requests
    from dispatcher.serve.app import build_app, start_http
    from models.text import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    if args.whole_prompts:  # (the comparison: every prompt tokenized whole, nothing kept)
        tokenizer.added_token_split = None
    # (each run its own prompts, as long as the file has enough: the front end keeps the pieces of prompts it
    # tokenized, so a prompt sent again costs less than a new one)
    num_runs, per_run = args.warmup + args.repeat, args.waves * args.concurrency
    if args.multi_turn:  # (the prefix-caching benchmark's conversations: every turn's text its own)
        with tempfile.TemporaryDirectory() as tmp:
            path = conversations_file(args.data, num_runs * per_run, args.multi_turn, "fe", f"{tmp}/c.json")
            requests = sharegpt_conversations(path, num_runs * per_run, args.output_len, 0, None)
    else:
        requests = sharegpt_requests(args.data, num_runs * per_run, args.output_len, 0)
    if args.prompt_repeat > 1 and not args.multi_turn:  # (long prompts: what tokenizing a burst of arrivals costs)
        requests = [dataclasses.replace(r, prompt=" ".join([r.prompt] * args.prompt_repeat),
                                        prompt_len=r.prompt_len * args.prompt_repeat) for r in requests]
    token_ids = tokenizer.encode(" ".join(getattr(r, "prompt", None) or r.turns[0] for r in requests[:50]), False)
    engine = SimulatedEngine(tokenizer, args.step_ms / 1e3, args.tokens_per_step, token_ids, args.stream_interval,
                             0 if args.no_prefix_caching else 16)
    runner = await start_http(build_app(engine), "127.0.0.1", 0, shutdown_timeout=1)
    port = runner.addresses[0][1]
    if not args.python_gc:
        freeze_startup_heap()  # (as twogrid serve's front ends do once they serve)
    stop = asyncio.Event()
    loop_task = asyncio.create_task(engine.loop(stop))
    runs = []
    try:
        for i in range(args.warmup + args.repeat):
            r = await one_run(args, engine, port, requests[i * per_run:(i + 1) * per_run])
            print(f"{'warm-up' if i < args.warmup else 'run'} {i}: {r}", file=sys.stderr)
            if i >= args.warmup:
                runs.append(r)
    finally:
        stop.set()
        await loop_task
        await runner.cleanup()
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"benchmark": "serve_frontend", "commit": commit(), "command": " ".join(["python", *sys.argv]),
            "cpus": os.cpu_count(), "concurrency": args.concurrency, "step_ms": args.step_ms,
            "tokens_per_step": args.tokens_per_step, "stream_interval": args.stream_interval,
            "prompt_repeat": args.prompt_repeat, "multi_turn": args.multi_turn, "whole_prompts": args.whole_prompts,
            "python_gc": args.python_gc, "prefix_caching": not args.no_prefix_caching,
            "output_len": args.output_len, "clients": args.clients,
            "median": median, "events_per_s_at_one_core": round(1e6 / median["cpu_us_per_event"]), "runs": runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="a tokenizer directory or .gguf (SmolLM2's for bench-moe)")
    p.add_argument("--data", required=True, help="ShareGPT JSON")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=40.0, help="the simulated engine's step period")
    p.add_argument("--tokens-per-step", type=int, default=3, help="new tokens per request a step")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="serve's --stream-interval (an event is then a step's tokens for a request, not a chunk)")
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--prompt-repeat", type=int, default=1, help="each prompt this many times over (longer prompts)")
    p.add_argument("--multi-turn", type=int, default=0, metavar="TURNS",
                   help="send ShareGPT conversations of up to TURNS user turns, each turn with the conversation so far "
                   "(twogrid bench --multi-turn; needs --endpoint chat)")
    p.add_argument("--whole-prompts", action="store_true",
                   help="tokenize every prompt whole, keeping no pieces (the comparison for the kept pieces of "
                   "dispatcher/serve/tokenizing.py)")
    p.add_argument("--waves", type=int, default=2, help="prompts (conversations) = waves x concurrency")
    p.add_argument("--clients", type=int, default=1, help="client processes")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--python-gc", action="store_true", help="leave the collector as CPython sets it (the "
                   "comparison): no start-up heap frozen, no raised young-generation threshold")
    p.add_argument("--endpoint", default="completions", choices=("completions", "chat"))
    p.add_argument("--extra-body", default=None, metavar="JSON",
                   help="fields every request carries (sampling parameters, a response_format, ...)")
    p.add_argument("--garbage", action="store_true",
                   help="count the reference cycles each run leaves (the collector off during it: a diagnostic)")
    p.add_argument("--no-prefix-caching", action="store_true", help="the front end hashes no prompt blocks (a "
                   "server with --no-enable-prefix-caching; by default it hashes them for blocks of 16 tokens)")
    p.add_argument("--out", default=None, help="result JSON")
    args = p.parse_args()
    if args.multi_turn and args.endpoint != "chat":
        p.error("--multi-turn sends chat messages: give --endpoint chat")
    import uvloop

    result = uvloop.run(main_async(args))
    m = result["median"]
    print(f"median: {m['cpu_us_per_event']:.0f} us of front-end CPU per streamed event ({m['cpu_us_per_token']:.0f} "
          f"per token): one process streams ~{result['events_per_s_at_one_core']} events/s at one core; "
          f"{m['front_end_cpu_cores']:.2f} cores used here, step efficiency {m['step_efficiency']:.2f}, TTFT mean "
          f"{m['ttft_ms_mean']:.1f} ms = in {m['ttft_in_ms']:.1f} (client to engine; the front end's own part from "
          f"the request's arrival {m['ttft_in_front_end_ms']:.1f}) + engine "
          f"{m['ttft_engine_ms']:.1f} + out {m['ttft_out_ms']:.1f} (its first step to the client)")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
