"""CPU benchmark of the dispatcher's hot path and of the plan matrix sweep (issue 2's targets: at most 1 us
per dispatch call in CPython; the full ``plan --matrix`` in under 10 s on a 2-core machine).

    python benchmarks/bench_dispatch.py [--out docs/bench/dispatch_cpu.json]

Dispatch is timed over a fixed, shuffled stream of batches of every kind (uniform decode at the configured q,
adaptive verification, mixed, and batches that fall back to PIECEWISE or eager) for several configurations;
each configuration is timed in 7 repetitions after a warm-up, and the median per-call time is reported. The
matrix sweep is timed 3 times; the median is reported.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time

from _common import write_json  # noqa: E402  (puts the repository on sys.path)

from dispatcher.plan.config import resolve  # noqa: E402
from dispatcher.plan.dispatch import dispatchers_for_plan  # noqa: E402
from dispatcher.plan.capture_plan import build_plan  # noqa: E402
from dispatcher.plan.plandiff import run_matrix  # noqa: E402

CONFIGS = {
    "sm100, no SD": (None, {}),
    "sm100, eagle3 K=7": ({"method": "eagle3", "num_speculative_tokens": 7}, {}),
    "sm100, eagle3 tiers 7/3/1": ({"method": "eagle3", "num_speculative_tokens": 7,
                                   "num_speculative_tokens_per_batch_size": [[1, 7], [65, 3], [257, 1]]}, {}),
    "sm100, dspark K=5 + AV": ({"method": "dspark", "num_speculative_tokens": 5, "adaptive_verification": True}, {}),
    "sm100, legacy max 1024, K=7": ({"method": "eagle3", "num_speculative_tokens": 7},
                                    {"max_cudagraph_capture_size": 1024}),
}
STREAM_LEN = 20000


def batch_stream(cfg, rng: random.Random) -> list[tuple[int, int, int, bool]]:
    """(num_tokens, num_reqs, max_query_len, is_decode), a realistic mix: half uniform decodes."""
    out = []
    q_of = {n: 1 + t.num_speculative_tokens for t in cfg.tiers for n in range(t.min_batch, t.max_batch + 1)}
    for _ in range(STREAM_LEN):
        r = rng.random()
        if r < 0.5:
            n = rng.randint(1, cfg.max_num_seqs)
            q = q_of[n]
            n = min(n, cfg.max_num_batched_tokens // q)
            out.append((n * q, n, q, True))
        elif r < 0.65 and cfg.num_speculative_tokens:
            q_max = 1 + cfg.num_speculative_tokens
            n = rng.randint(2, min(cfg.max_num_seqs, cfg.max_num_batched_tokens // q_max))
            total = rng.randint(n + 1, n * q_max - 1) if n * q_max - 1 > n else n
            out.append((total, n, q_max, True))
        else:
            tokens = rng.randint(1, cfg.max_num_batched_tokens)
            reqs = rng.randint(1, min(tokens, cfg.max_num_seqs))
            out.append((tokens, reqs, tokens - reqs + 1, False))
    return out


def time_dispatch(name: str, spec, compilation) -> dict:
    cfg = resolve(compilation, spec, platform="sm100", max_num_seqs=1024, max_num_batched_tokens=16384)
    start = time.perf_counter()
    dispatcher = dispatchers_for_plan(build_plan(cfg))["target"]
    build_ms = (time.perf_counter() - start) * 1e3
    stream = batch_stream(cfg, random.Random(0))
    call = dispatcher.dispatch
    for args in stream:  # warm-up
        call(*args)
    reps = []
    for _ in range(7):
        t0 = time.perf_counter()
        for a, b, c, d in stream:
            call(a, b, c, d)
        reps.append((time.perf_counter() - t0) / len(stream) * 1e6)
    # The loop's own cost, to report the call alone too.
    noop = lambda a, b, c, d: None  # noqa: E731
    t0 = time.perf_counter()
    for a, b, c, d in stream:
        noop(a, b, c, d)
    loop_us = (time.perf_counter() - t0) / len(stream) * 1e6
    return {"config": name, "median_us_per_call": round(statistics.median(reps), 3),
            "min_us_per_call": round(min(reps), 3), "loop_overhead_us": round(loop_us, 3),
            "table_build_ms": round(build_ms, 2), "calls_per_rep": len(stream)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    dispatch_rows = [time_dispatch(name, *cfg) for name, cfg in CONFIGS.items()]
    matrix_runs = []
    configs = 0
    for _ in range(3):
        t0 = time.perf_counter()
        configs = run_matrix()["configs"]
        matrix_runs.append(time.perf_counter() - t0)
    result = {
        "command": "python benchmarks/bench_dispatch.py --out docs/bench/dispatch_cpu.json",
        "machine": {"python": platform.python_version(), "implementation": platform.python_implementation(),
                    "cpu_count": os.cpu_count(), "processor": platform.machine()},
        "dispatch": dispatch_rows,
        "dispatch_target_us": 1.0,
        "matrix": {"configs": configs, "median_seconds": round(statistics.median(matrix_runs), 3),
                   "runs_seconds": [round(s, 3) for s in matrix_runs], "target_seconds": 10.0},
    }
    print(f"{'configuration':32s} {'us/call (median of 7)':>22s} {'loop overhead us':>17s} {'table build ms':>15s}")
    for row in dispatch_rows:
        print(f"{row['config']:32s} {row['median_us_per_call']:22.3f} {row['loop_overhead_us']:17.3f} "
              f"{row['table_build_ms']:15.2f}")
    print(f"plan --matrix: {configs} configs in {result['matrix']['median_seconds']:.2f} s (median of 3)")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
