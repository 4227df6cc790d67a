"""What a burst of arrivals costs the engine's event loop, on this machine's CPU: ``EngineCore.make_requests`` (the
prompt's checks) and ``queue_all`` (the scheduler's queue, the prefix cache's block hashes) for ``--burst``
prompts of ``--prompt-len`` token ids, as the engine service runs them for each ``AddRequest`` before its step loop
goes on. Reported: ms an arrival and ms the burst, the median of ``--repeat`` bursts (each into a fresh engine).
``--packed`` (and ``--served``) sends the prompts as a front end does: int32 bytes with their block hashes, which
``--engine-hashes`` leaves out (the engine then hashes each prompt, as it did before the front ends sent them).

``--served``: the burst sent to the serving engine's step loop (``EngineService`` with an instant worker, no model)
while ``--running`` requests decode (the collector set as the serving engine sets it, ``--python-gc`` leaves it
as CPython does), taken in turns of ``ARRIVAL_TURN_S`` and, alternated with it, in one turn (the
loop before turns): the longest time between two steps sent to the worker while the burst is taken (what the device
idles on a GPU once its queued step is done) and the burst's duration, medians of ``--repeat`` each.

    python benchmarks/bench_engine_arrivals_cpu.py --burst 256 --prompt-len 2000 --out result.json
    python benchmarks/bench_engine_arrivals_cpu.py --served --burst 256 --prompt-len 760 --out result.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from _common import commit, write_json

import torch

from dispatcher.child import freeze_startup_heap
from dispatcher.engine.engine_core import EngineArgs, EngineCore
from dispatcher.engine.protocol import pack_prompt
from dispatcher.plan.config import resolve
from models.config import preset
from scheduler.block_hash import prompt_block_hashes
from scheduler.request import SamplingParams


def _core(max_num_seqs: int, blocks_per_seq: int, max_model_len: int) -> EngineCore:
    """A tiny-dense engine on the CPU with prefix caching, ``max_num_seqs`` requests of up to ``blocks_per_seq``
    blocks of 16 tokens each."""
    cfg = resolve({}, None, platform="sm100", max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    return EngineCore(cfg, EngineArgs(preset("tiny-dense"), device="cpu", dtype=torch.float32,
                                      num_kv_blocks=max_num_seqs * blocks_per_seq, block_size=16,
                                      max_model_len=max_model_len, seed=0, enable_prefix_caching=True))


def burst_ms(args, rng: np.random.Generator) -> float:
    core = _core(args.burst, args.prompt_len // 16 + 2, args.prompt_len + 64)
    vocab = core.model_config.vocab_size
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.burst)]  # (plain ints, as decoded)
    hashes = [b""] * len(prompts)
    if args.packed:  # (as a front end sends them: int32 bytes, with their block hashes)
        prompts = [pack_prompt(p) for p in prompts]
        hashes = front_end_hashes(args, core, prompts)
    params = SamplingParams(max_tokens=16)
    start = time.perf_counter()
    for i, (ids, joined) in enumerate(zip(prompts, hashes)):
        core.queue_all(core.make_requests(ids, params, f"r{i}", joined))
    return (time.perf_counter() - start) * 1e3


def front_end_hashes(args, core: EngineCore, packed: list[bytes]) -> list[bytes]:
    """The prompts' block hashes as a front end sends them, for ``core``'s prefix cache (none with
    ``--engine-hashes``: the engine hashes)."""
    if args.engine_hashes:
        return [b""] * len(packed)
    sched = core.scheduler.config
    return [prompt_block_hashes(p, sched.block_size, sched.next_token_key) for p in packed]


def served_burst(args, rng: np.random.Generator, turn_s: float) -> tuple[float, float, int]:
    """(longest ms between two steps sent while the burst was taken, the burst's ms, steps sent meanwhile) with the
    engine service's arrival turn at ``turn_s``."""
    import asyncio

    from bench_engine_host_cpu import FrontEndSink, Inbox, InstantWorker

    from dispatcher.engine import service as service_module
    from dispatcher.engine.protocol import AddRequest, encode
    from dispatcher.engine.service import EngineService

    core = _core(args.running + args.burst, args.prompt_len // 16 + 8, args.prompt_len + 1024)
    vocab = core.model_config.vocab_size
    worker = InstantWorker(vocab, 0.0)
    inbox = Inbox()
    service = EngineService(None, worker, inbox, [FrontEndSink()])
    service.core = core
    taken: list[float] = []
    add = service._add

    async def timed_add(msg):
        taken.append(time.perf_counter())
        await add(msg)

    service._add = timed_add
    if not args.python_gc:
        freeze_startup_heap()  # (as the serving engine sets its collector once it is ready)
    packed = [pack_prompt(rng.integers(0, vocab, args.prompt_len).tolist()) for _ in range(args.burst)]
    frames = [encode(AddRequest(f"b{i}", p, SamplingParams(max_tokens=16), 0, joined))  # (as a front end sends)
              for i, (p, joined) in enumerate(zip(packed, front_end_hashes(args, core, packed)))]

    async def scenario():
        loop = asyncio.get_running_loop()
        receiver, runner = loop.create_task(service.receive()), loop.create_task(service.run())
        for i in range(args.running):
            inbox.queue.put_nowait(encode(AddRequest(f"run{i}", [5 + i % 100, 6, 7],
                                                     SamplingParams(max_tokens=1000, ignore_eos=True))))
        while len(worker.sent_at) < 8:
            await asyncio.sleep(0)
        for frame in frames:
            inbox.queue.put_nowait(frame)
        while len(taken) < args.running + args.burst:
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        runner.cancel()
        receiver.cancel()
        await asyncio.gather(runner, receiver, return_exceptions=True)

    saved = service_module.ARRIVAL_TURN_S
    service_module.ARRIVAL_TURN_S = turn_s
    try:
        asyncio.run(scenario())
    finally:
        service_module.ARRIVAL_TURN_S = saved
    first, last = taken[args.running], taken[-1]
    sent = np.array(worker.sent_at)
    inside = sent[(sent > first) & (sent < last)]
    marks = np.concatenate([sent[sent <= first][-1:], inside, sent[sent >= last][:1]])
    longest = np.diff(marks).max() if len(marks) > 1 else float("nan")  # (nan: no step after the burst)
    return float(longest * 1e3), (last - first) * 1e3, len(inside)


def main_served(args) -> None:
    from dispatcher.engine.service import ARRIVAL_TURN_S

    rng = np.random.default_rng(0)
    served_burst(args, rng, ARRIVAL_TURN_S)  # (warm-up)
    runs: dict[str, list] = {"turns": [], "one_turn": []}
    for _ in range(args.repeat):
        for name, turn_s in (("turns", ARRIVAL_TURN_S), ("one_turn", float("inf"))):
            runs[name].append([round(v, 2) for v in served_burst(args, rng, turn_s)])
    result = {"benchmark": "engine_arrivals_served_cpu", "commit": commit(), "burst": args.burst,
              "prompt_len": args.prompt_len, "running": args.running, "arrival_turn_ms": ARRIVAL_TURN_S * 1e3,
              "engine_hashes": args.engine_hashes,
              "repeat": args.repeat,
              "command": "python benchmarks/bench_engine_arrivals_cpu.py --served --burst "
                         f"{args.burst} --prompt-len {args.prompt_len} --running {args.running} --repeat {args.repeat}"
                         + (" --engine-hashes" if args.engine_hashes else "")
                         + (" --python-gc" if args.python_gc else "")}
    for name, rows in runs.items():
        result[name] = {"longest_step_gap_ms": statistics.median(r[0] for r in rows),
                        "burst_ms": statistics.median(r[1] for r in rows),
                        "steps_during_burst": statistics.median(r[2] for r in rows), "runs": rows}
    print(result)
    if args.out:
        write_json(args.out, result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--served", action="store_true", help="the burst through the engine's step loop")
    parser.add_argument("--packed", action="store_true", help="prompts as a front end sends them (int32 bytes) "
                        "rather than lists of ints")
    parser.add_argument("--running", type=int, default=256, help="--served: requests decoding meanwhile")
    parser.add_argument("--python-gc", action="store_true", help="--served: leave the collector as CPython sets it "
                        "(by default as twogrid serve's engine sets it: freeze_startup_heap)")
    parser.add_argument("--engine-hashes", action="store_true", help="--packed, --served: the prompts without "
                        "their block hashes, which the engine then computes (as before the front ends sent them)")
    args = parser.parse_args()
    if args.served:
        if args.running < 1:
            parser.error("--running: at least 1 (the steps the burst must leave room for)")
        return main_served(args)
    rng = np.random.default_rng(0)
    burst_ms(args, rng)  # (warm-up)
    runs = [round(burst_ms(args, rng), 2) for _ in range(args.repeat)]
    median = statistics.median(runs)
    result = {"benchmark": "engine_arrivals_cpu", "commit": commit(), "burst": args.burst, "packed": args.packed,
              "engine_hashes": args.engine_hashes,
              "prompt_len": args.prompt_len, "burst_ms": median, "ms_per_arrival": round(median / args.burst, 4),
              "runs_ms": runs}
    print(result)
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
