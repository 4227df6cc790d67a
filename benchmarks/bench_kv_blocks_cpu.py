"""What admitting requests costs the KV block manager once the prefix cache holds the pool, per pool size, on this
machine's CPU: every slot's blocks registered and freed until cached prefixes fill the pool, then steps of
``--admissions`` requests of ``--blocks`` blocks each (a 600-token prompt is 38 blocks of 16), every block taken
from the cached ones (evicted: the steady state of a server whose cache is full), each request's last one released
first, its new blocks registered under fresh hashes (SHA-256, as ``scheduler.block_hash``). Reported: microseconds
a step, the median of ``--repeat`` runs, per ``--num-blocks`` (an H100's default 48 GiB of KV holds about 137,000
blocks of the default model), and the slowest step of each run with the count over 5 ms (a dictionary that
resizes as it churns stops the step for milliseconds).

    python benchmarks/bench_kv_blocks_cpu.py --num-blocks 20000,200000 --out result.json
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time

from _common import commit, write_json

from scheduler.kv_blocks import KVBlockManager


def one_run(num_blocks: int, blocks: int, admissions: int, slots: int, steps: int) -> tuple[float, list[float]]:
    kv = KVBlockManager(num_blocks, 16, slots, blocks + 1)
    counter = iter(range(1 << 62))
    log: list = []

    def admit(slot: int) -> None:
        if kv.num_held[slot]:
            kv.release(slot)
        kv.start(slot, [], blocks * 16)
        kv.register_one(slot, [hashlib.sha256(next(counter).to_bytes(8, "little")).digest() for _ in range(blocks)],
                        blocks, None, log)
        log.clear()

    for _ in range(num_blocks // (blocks * slots) + 2):  # (the pool full of cached prefixes)
        for slot in range(slots):
            admit(slot)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        for k in range(admissions):
            admit((step * admissions + k) % slots)
        times.append(time.perf_counter() - start)
    return statistics.mean(times) * 1e6, times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-blocks", default="20000,200000", help="pool sizes, comma-separated")
    p.add_argument("--blocks", type=int, default=37, help="blocks a request")
    p.add_argument("--admissions", type=int, default=2, help="requests admitted a step")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for num_blocks in (int(x) for x in args.num_blocks.split(",")):
        runs, slowest, over_5ms = [], [], 0
        for _ in range(args.repeat):
            mean_us, times = one_run(num_blocks, args.blocks, args.admissions, args.slots, args.steps)
            runs.append(round(mean_us, 1))
            slowest.append(round(max(times) * 1e3, 2))
            over_5ms += sum(t > 5e-3 for t in times)
        rows.append({"num_blocks": num_blocks, "us_per_step_median": statistics.median(runs), "runs": runs,
                     "slowest_step_ms": slowest, "steps_over_5ms": over_5ms})
        print(f"{num_blocks} blocks: {statistics.median(runs):.1f} us a step (runs {runs}); slowest steps {slowest} "
              f"ms, {over_5ms} of {args.repeat * args.steps} over 5 ms", file=sys.stderr)
    write_json(args.out, {"benchmark": "kv_blocks_cpu", "commit": commit(), "command": " ".join(["python", *sys.argv]),
                          "blocks": args.blocks, "admissions": args.admissions, "slots": args.slots, "rows": rows})


if __name__ == "__main__":
    main()
