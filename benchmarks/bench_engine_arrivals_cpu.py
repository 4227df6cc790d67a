"""What a burst of arrivals costs the engine's event loop, on this machine's CPU: ``EngineCore.make_requests`` (the
prompt's checks) and ``queue_all`` (the scheduler's queue, the prefix cache's block hashes) for ``--burst``
prompts of ``--prompt-len`` token ids, as the engine service runs them for each ``AddRequest`` before its step loop
goes on. Reported: ms an arrival and ms the burst, the median of ``--repeat`` bursts (each into a fresh engine).

    python benchmarks/bench_engine_arrivals_cpu.py --burst 256 --prompt-len 2000 --out result.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from _common import commit, write_json

import torch

from dispatcher.engine.engine_core import EngineArgs, EngineCore
from dispatcher.plan.config import resolve
from models.config import preset
from scheduler.request import SamplingParams


def burst_ms(args, rng: np.random.Generator) -> float:
    cfg = resolve({}, None, platform="sm100", max_num_seqs=args.burst, max_num_batched_tokens=2048)
    blocks = args.burst * (args.prompt_len // 16 + 2)
    core = EngineCore(cfg, EngineArgs(preset("tiny-dense"), device="cpu", dtype=torch.float32, num_kv_blocks=blocks,
                                      block_size=16, max_model_len=args.prompt_len + 64, seed=0,
                                      enable_prefix_caching=True))
    vocab = core.model_config.vocab_size
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.burst)]  # (plain ints, as decoded)
    params = SamplingParams(max_tokens=16)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        core.queue_all(core.make_requests(ids, params, f"r{i}"))
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    burst_ms(args, rng)  # (warm-up)
    runs = [round(burst_ms(args, rng), 2) for _ in range(args.repeat)]
    median = statistics.median(runs)
    result = {"benchmark": "engine_arrivals_cpu", "commit": commit(), "burst": args.burst,
              "prompt_len": args.prompt_len, "burst_ms": median, "ms_per_arrival": round(median / args.burst, 4),
              "runs_ms": runs}
    print(result)
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
