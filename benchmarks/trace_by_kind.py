"""Where a served run's device time went, by step kind, from step traces (``twogrid serve --step-trace``): per
(kind, q, fused) the steps, their summed and median device ms, their mean tokens and requests. Steps before the
first with ``--min-requests`` requests are left out (the warm-up's).

    PYTHONPATH=. python benchmarks/trace_by_kind.py trace-none.jsonl trace-eagle3.jsonl --min-requests 12 \\
        --out by_kind.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections import defaultdict

from _common import commit, write_json  # (importing _common puts the repository on sys.path)


def by_kind(path: str, min_requests: int) -> dict:
    with open(path, encoding="utf-8") as fh:
        steps = [json.loads(line) for line in fh if line.strip()]
    start = next((i for i, s in enumerate(steps) if s["requests"] >= min_requests), 0)
    steps = steps[start:]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for s in steps:
        groups[(s["kind"], s.get("q"), bool(s.get("fused")))].append(s)
    rows = []
    for (kind, q, fused), group in sorted(groups.items(), key=lambda kv: -sum(s["device_ms"] for s in kv[1])):
        ms = [s["device_ms"] for s in group]
        rows.append({"kind": kind, "q": q, "fused": fused, "steps": len(group), "device_s": round(sum(ms) / 1e3, 3),
                     "median_ms": round(statistics.median(ms), 3),
                     "mean_tokens": round(statistics.mean(s["tokens"] for s in group), 1),
                     "mean_requests": round(statistics.mean(s["requests"] for s in group), 1)})
    return {"trace": path, "steps": len(steps), "device_s": round(sum(s["device_ms"] for s in steps) / 1e3, 3),
            "by_kind": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--min-requests", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = [by_kind(t, args.min_requests) for t in args.traces]
    for r in results:
        print(f"{r['trace']}: {r['steps']} steps, {r['device_s']} s of device time")
        for row in r["by_kind"]:
            print(f"  {row['kind']:15s} q={row['q']!s:4s} fused={row['fused']!s:5s} {row['steps']:6d} steps "
                  f"{row['device_s']:8.3f} s  median {row['median_ms']:7.3f} ms  {row['mean_tokens']:7.1f} tokens  "
                  f"{row['mean_requests']:6.1f} requests")
    write_json(args.out, {"command": "PYTHONPATH=. python benchmarks/trace_by_kind.py " + shlex.join(sys.argv[1:]),
                          "commit": commit(), "traces": results})


if __name__ == "__main__":
    main()
