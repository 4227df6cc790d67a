"""What one step costs the engine process's host at a large batch, on this machine's CPU: the serving engine's step
loop (``EngineService.run``: schedule, the scheduler's update, each front end's deltas encoded and sent) over
``--requests`` decoding requests, with the worker process replaced by one that answers each step at once with
random tokens (no model runs; with ``--speculative-config``, 1 + K of them a request, the drafts accepted at
``--acceptance-rate``), and the front ends by sockets that take the frames. Reported: the step period's
median and p90 in steady state (``--steps`` steps after ``--warmup``); the time from a step's result taken to the
next step sent (``result_to_submit_ms``: with asynchronous scheduling a step runs on the device meanwhile, and once
the host sets the pace the device waits for whatever of this exceeds that step); and the garbage collector's work
meanwhile (collections per generation and their ms), with the collector as ``twogrid serve`` sets it
(``freeze_startup_heap``) or as CPython leaves it (``--python-gc``). By default no request ends; ``--churn
OUTPUT_LEN`` gives each OUTPUT_LEN tokens and replaces each one that ends at once (a serving client's steady state,
the requests' ends staggered), and reports the steps that admitted requests: how many, their schedule time against
a decode step's, and the cost a request admitted (on the path from a result to the next step sent: at 1,024 streams
under speculative decoding the GPU waits mostly there, docs/headline.md); ``--eos`` has them end at EOS too, every
new token checked as a client's request has it.

    python benchmarks/bench_engine_host_cpu.py --requests 1024 --front-ends 4 --out result.json
    python benchmarks/bench_engine_host_cpu.py --requests 1024 --churn 256 --prompt-len 600 \
        --speculative-config '{"method": "eagle3", "num_speculative_tokens": 3}'
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from collections import deque
from typing import Callable

import numpy as np
from _common import commit, write_json

from dispatcher.child import freeze_startup_heap
from dispatcher.engine.engine_core import EngineArgs, EngineCore
from dispatcher.engine.protocol import AddRequest, decode_to_front, pack_prompt
from dispatcher.engine.protocol import encode as encode_core
from dispatcher.engine.service import EngineService
from dispatcher.messages import StepResult, decode_to_worker
from dispatcher.messages import encode as encode_step
from dispatcher.plan.config import resolve
from models.config import preset
from scheduler.block_hash import prompt_block_hashes
from scheduler.request import SamplingParams


class Done:
    """An awaitable already resolved, as a ZeroMQ socket's send, poll and recv are when nothing blocks them:
    awaiting it does not yield to the event loop (the worst case the step loop must survive)."""

    def __init__(self, value):
        self.value = value

    def __await__(self):
        return self.value
        yield  # (a generator: never reached)


class InstantSockets:
    """The worker process's two sockets, answered in-process: a step sent is answered at once by ``answer`` (a step
    to its StepResult or WorkerError), its result waits to be received."""

    def __init__(self, answer: Callable):
        self.to_worker = self.to_engine = self
        self.results: deque[bytes] = deque()
        self._answer = answer
        self.sent_at: list[float] = []
        self.taken_at: list[float] = []

    def send(self, frame: bytes) -> Done:
        self.sent_at.append(time.perf_counter())
        self.results.append(encode_step(self._answer(decode_to_worker(frame))))
        return Done(None)

    def poll(self, timeout_ms: float) -> Done:
        return Done(bool(self.results))

    def recv(self) -> Done:
        self.taken_at.append(time.perf_counter())
        return Done(self.results.popleft())

    def result_to_submit_ms(self, first: int) -> np.ndarray:
        """From each result taken (the ``first``-th on) to the next step sent: on a GPU, what a step queued behind
        the running one must wait for once the host sets the pace (the device idles if it is longer than that
        step)."""
        taken, sent = np.array(self.taken_at[first:]), np.array(self.sent_at)
        after = np.searchsorted(sent, taken)
        ok = after < len(sent)
        return (sent[after[ok]] - taken[ok]) * 1e3

    def alive(self) -> bool:
        return True


class InstantWorker(InstantSockets):
    """Each step answered with random tokens, each request's drafts accepted one after the other at
    ``acceptance_rate`` (a speculative step: 1 + K columns); no model runs."""

    def __init__(self, vocab_size: int, acceptance_rate: float):
        super().__init__(self.answer)
        self.vocab_size, self.acceptance_rate = vocab_size, acceptance_rate
        self.rng = np.random.default_rng(0)

    def answer(self, step) -> StepResult:
        n = step.num_reqs
        drafts = np.frombuffer(step.num_drafts, np.int32)
        width = 1 + int(drafts.max(initial=0))
        sampled = self.rng.integers(3, self.vocab_size, (n, width), dtype=np.int32)
        right = np.cumprod(self.rng.random((n, width - 1)) < self.acceptance_rate, axis=1)
        accepted = np.minimum(right.sum(axis=1), drafts).astype(np.int32)
        return StepResult(step.step_id, sampled.tobytes(), accepted.tobytes(), width, device_ms=1.0)


class FrontEndSink:
    """A front end's socket: counts the frames and bytes the engine sends it."""

    def __init__(self):
        self.frames = self.bytes = 0
        self.last = b""

    def send(self, frame: bytes) -> Done:
        self.frames += 1
        self.bytes += len(frame)
        self.last = frame
        return Done(None)

    def refusal(self) -> str | None:
        """The reason of a refusal in the last frame, if it held one."""
        refused = decode_to_front(self.last).refused if self.last else []
        return refused[0].message if refused else None


class Inbox:
    """The engine's request socket: what the front ends sent, in order."""

    def __init__(self):
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()

    async def recv(self) -> bytes:
        return await self.queue.get()  # (no yield when a frame is waiting, as ZeroMQ's)


class GcWatch:
    """The collector's collections and their time per generation, once ``on`` (a ``gc.callbacks`` hook)."""

    def __init__(self):
        self.on = False
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t0 = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.count[g] += 1
            self.seconds[g] += time.perf_counter() - self._t0


def front_end_prompts(args, core: EngineCore, rng: np.random.Generator, drafts: int):
    """The prompts to send, each (token ids, block hashes) as a front end sends them: int32 bytes with their prefix
    cache block hashes (``--list-prompts``: lists of ints, no hashes, which the engine then lists and hashes
    itself). Made before the clock starts, as many as the run can take (every request replaced as it ends), since
    in a server the front ends do that work; then made as they are asked for."""
    sched = core.scheduler.config
    vocab = core.model_config.vocab_size

    def one():
        ids = rng.integers(3, vocab, args.prompt_len).tolist()
        if args.list_prompts:
            return ids, b""
        packed = pack_prompt(ids)
        hashes = prompt_block_hashes(packed, sched.block_size, sched.next_token_key) if sched.enable_prefix_caching \
            else b""
        return packed, hashes

    ends = (args.warmup + args.steps + 64) * args.requests * (1 + drafts) // args.churn if args.churn else 0
    made = [one() for _ in range(args.requests + ends)]
    yield from made
    while True:
        yield one()


def run(args) -> dict:
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    cfg = resolve({}, spec, platform="sm100", max_num_seqs=args.requests, max_num_batched_tokens=16384)
    drafts = cfg.num_speculative_tokens or 0
    max_tokens = (args.warmup + args.steps + 64) * (1 + drafts)  # (room for every accepted draft: none ends)
    core = EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=args.requests * (16 + max_tokens // 16),
                                      block_size=16, max_model_len=args.prompt_len + max_tokens + 64,
                                      enable_prefix_caching=getattr(args, "prefix_caching", True)))
    inbox, sinks = Inbox(), [FrontEndSink() for _ in range(args.front_ends)]
    worker = InstantWorker(core.model_config.vocab_size, args.acceptance_rate)
    service = EngineService(None, worker, inbox, sinks)
    service.core = core
    rng = np.random.default_rng(1)
    prompts = front_end_prompts(args, core, rng, drafts)
    next(prompts)  # (the pool made now, before the collector freezes the heap)
    watch = GcWatch()
    if not args.python_gc:
        freeze_startup_heap()  # (as each process of twogrid serve does once it is ready)
    done_at: list[float] = []
    admitting: list[int] = []
    """Per step taken: the new requests it admitted (a mixed step: some)."""
    schedule_ms: list[float] = []
    finish = service._finish

    async def timed_finish(step):
        outputs = await finish(step)
        done_at.append(time.perf_counter())
        admitting.append(len(step.out.new_requests))
        schedule_ms.append(step.host_ms)
        if len(done_at) == args.warmup:
            watch.on = True
        return outputs

    service._finish = timed_finish

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(service.receive()), loop.create_task(service.run())]
        sent = 0

        def send(max_tokens: int) -> None:
            nonlocal sent
            prompt, hashes = next(prompts)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=not args.eos)
            inbox.queue.put_nowait(encode_core(AddRequest(f"r{sent}", prompt, params, sent % args.front_ends,
                                                          hashes)))
            sent += 1

        for _ in range(args.requests):  # (with --churn, the first ones' lengths spread: they end one after another)
            send(int(rng.integers(1, args.churn + 1)) if args.churn else max_tokens)
        while len(done_at) < args.warmup + args.steps:
            await asyncio.sleep(0)
            if args.churn:  # a client keeping --requests streams: each one that ends is replaced at once
                for _ in range(args.requests - len(core.scheduler.requests) - inbox.queue.qsize()):
                    send(args.churn)
            for task in tasks:
                if task.done():  # (the step loop failed: its error, not a hang)
                    task.result()
                    raise RuntimeError("the engine's step loop ended before the measured steps")
            if not core.has_unfinished() and inbox.queue.empty():  # (ended or refused: it would wait forever)
                reasons = [r for r in (sink.refusal() for sink in sinks) if r]
                raise RuntimeError("no request runs before the measured steps are done: "
                                   + (f"refused ({reasons[0]})" if reasons else "they ended (max_tokens)"))
        watch.on = False
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())
    periods = np.diff(done_at[args.warmup - 1:args.warmup + args.steps]) * 1e3
    to_submit = worker.result_to_submit_ms(args.warmup)
    measured = slice(args.warmup, args.warmup + args.steps)
    admitted, sched = np.array(admitting[measured]), np.array(schedule_ms[measured])
    mixed = admitted > 0
    churn = {} if not args.churn or not mixed.any() else {
        "admitting_steps": int(mixed.sum()),
        "admitted_per_admitting_step": round(float(admitted[mixed].mean()), 1),
        "schedule_ms_admitting_median": round(float(np.median(sched[mixed])), 3),
        "schedule_ms_admitting_p90": round(float(np.percentile(sched[mixed], 90)), 3),
        "schedule_ms_decode_median": round(float(np.median(sched[~mixed])), 3) if (~mixed).any() else None,
        "us_per_admitted_request": round(float((sched[mixed].sum() - np.median(sched[~mixed]) * mixed.sum())
                                               / admitted.sum() * 1e3), 1) if (~mixed).any() else None}
    return {"ms_per_step_median": round(float(np.median(periods)), 3),
            "result_to_submit_ms_median": round(float(np.median(to_submit)), 3),
            "result_to_submit_ms_p90": round(float(np.percentile(to_submit, 90)), 3),
            "ms_per_step_p90": round(float(np.percentile(periods, 90)), 3),
            "ms_per_step_mean": round(float(np.mean(periods)), 3),
            "ms_per_step_max": round(float(np.max(periods)), 3),
            "gc_collections": watch.count, "gc_ms": [round(s * 1e3, 1) for s in watch.seconds],
            "gc_ms_per_step": round(sum(watch.seconds) * 1e3 / args.steps, 3),
            "frames_per_step": round(sum(s.frames for s in sinks) / len(done_at), 2),
            "gc_threshold": list(gc.get_threshold()), **churn}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1024, help="decoding requests in every step")
    p.add_argument("--front-ends", type=int, default=4, help="front ends the deltas go to")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="as serve's (a drafter with K drafts a step: the worker answers K + 1 columns)")
    p.add_argument("--acceptance-rate", type=float, default=0.7,
                   help="with --speculative-config: a draft is accepted with this probability after the one before")
    p.add_argument("--warmup", type=int, default=100, help="steps before the measured ones (the prompts' included)")
    p.add_argument("--steps", type=int, default=1000, help="measured steps")
    p.add_argument("--churn", type=int, default=0, metavar="OUTPUT_LEN",
                   help="requests of OUTPUT_LEN tokens, each replaced by a new one as it ends (a serving client's "
                   "steady state: new prompts admitted every few steps); default: none end")
    p.add_argument("--eos", action="store_true",
                   help="with --churn: requests end at the model's EOS too (as a client's do: every new token is "
                   "checked), not only at OUTPUT_LEN")
    p.add_argument("--python-gc", action="store_true", help="leave the collector as CPython sets it (the "
                   "comparison): no start-up heap frozen, no raised young-generation threshold")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="the engine without prefix caching (its block hashes and cached blocks' bookkeeping)")
    p.add_argument("--list-prompts", action="store_true", help="send prompts as lists of ints without their block "
                   "hashes (by default as front ends send them: int32 bytes with their block hashes, made before the "
                   "clock starts)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.eos and not args.churn:
        p.error("--eos needs --churn (requests that end are replaced)")
    result = run(args)
    print(f"{args.requests} requests, {args.front_ends} front ends: {result['ms_per_step_median']:.3f} ms a step "
          f"(median; p90 {result['ms_per_step_p90']:.3f}, max {result['ms_per_step_max']:.1f}); a result to the "
          f"next step sent {result['result_to_submit_ms_median']:.3f} ms (median; p90 "
          f"{result['result_to_submit_ms_p90']:.3f}); collector "
          f"{result['gc_ms_per_step']:.3f} ms a step ({result['gc_collections']} collections by generation)")
    if "admitting_steps" in result:
        r = result
        print(f"churn: {r['admitting_steps']} of {args.steps} steps admitted new requests "
              f"({r['admitted_per_admitting_step']} each): their schedule {r['schedule_ms_admitting_median']} ms "
              f"(median; p90 {r['schedule_ms_admitting_p90']}), a decode's {r['schedule_ms_decode_median']} ms; "
              f"{r['us_per_admitted_request']} us a request admitted")
    write_json(args.out, {"benchmark": "engine_host_cpu", "commit": commit(),
                          "command": " ".join(["python", "benchmarks/bench_engine_host_cpu.py", *sys.argv[1:]]),
                          "requests": args.requests, "front_ends": args.front_ends, "steps": args.steps,
                          "speculative_config": args.speculative_config, "churn": args.churn, "eos": args.eos,
                          "python_gc": args.python_gc, "prefix_caching": args.prefix_caching, **result})


if __name__ == "__main__":
    main()
