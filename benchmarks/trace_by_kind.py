"""Where a served run's device time went, by step kind, from step traces (``twogrid serve --step-trace``): per
(kind, q, fused) the steps, their summed and median device ms, their mean tokens and requests, and where steps
were queued behind one another (``period_ms``), the host's wait: the summed excess of the period over the device
time (the GPU idle between steps, waiting for the host), the share of steps with any, and the uniform decodes'
output tokens per ms of their periods (with the drafts accepted, in traces that have them); and the GPU's busy share
in runs of steps that admit requests against runs that do not (``_busy_by_admission``). Steps before the first
with ``--min-requests`` requests are left out (the warm-up's); ``--requests LO-HI`` keeps only the steps of that
many requests (one concurrency's steps, from a trace of a server that served several).

    PYTHONPATH=. python benchmarks/trace_by_kind.py trace-none.jsonl trace-eagle3.jsonl --min-requests 12 \\
        --out by_kind.json
    PYTHONPATH=. python benchmarks/trace_by_kind.py trace-eagle3-3.jsonl trace-eagle3-auto5.jsonl --requests 900-1024
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections import defaultdict

from _common import commit, write_json  # (importing _common puts the repository on sys.path)


def _host_wait(steps: list[dict]) -> dict:
    """Of the steps queued behind another (with ``period_ms``): how many, the summed ms the GPU waited for the host
    (a period past the step's device time), and the share of them that waited; for uniform decodes, the output
    tokens per ms of their periods (each request's token plus the drafts accepted, where the trace has them: what a
    K yields at the pace the host and device kept together)."""
    queued = [s for s in steps if s.get("period_ms") is not None]
    waits = [max(0.0, s["period_ms"] - s["device_ms"]) for s in queued]
    decodes = [s for s in queued if s["kind"] == "uniform_decode"]
    period_ms = sum(s["period_ms"] for s in decodes)
    return {"queued_steps": len(queued), "host_wait_s": round(sum(waits) / 1e3, 3),
            "waited_share": round(sum(w > 0 for w in waits) / len(queued), 3) if queued else None,
            "decode_tokens_per_ms": round(sum(s["requests"] + s.get("accepted", 0) for s in decodes) / period_ms, 2)
            if period_ms > 0 else None}


ADMITTING_SHARE = 0.1
"""A run of consecutive steps admits requests where at least this share of its steps is mixed."""


def _busy_by_admission(steps: list[dict]) -> dict | None:
    """The kept steps in runs of consecutive steps (at least 20: a concurrency's stretch between the warm-up and the
    tail), split by whether a run admits requests (at least ``ADMITTING_SHARE`` of its steps mixed, arrivals
    admitted as others end) or not: per side the steps, and the GPU's busy share of their wall time (their device ms
    over the time between their results, ``t_s``); the mixed steps' median schedule time (``host_ms``, on the path
    from a result to the next step); and the requests a step that admitted some admitted, on average (traces with
    ``admitted``). None for traces without ``t_s``."""
    if not steps or "t_s" not in steps[0]:
        return None
    runs, run = [], [steps[0]]
    for s in steps[1:]:
        if s["step"] != run[-1]["step"] + 1:
            runs.append(run)
            run = []
        run.append(s)
    runs.append(run)
    out = {}
    for name, admits in (("admitting", True), ("quiet", False)):
        chosen = [r for r in runs if len(r) >= 20
                  and (sum(s["kind"] == "mixed" for s in r) >= ADMITTING_SHARE * len(r)) == admits]
        wall = sum(r[-1]["t_s"] - r[0]["t_s"] for r in chosen)
        device = sum(s["device_ms"] for r in chosen for s in r[1:]) / 1e3
        out[name] = {"steps": sum(len(r) for r in chosen), "gpu_busy": round(device / wall, 3) if wall > 0 else None}
    mixed = [s["host_ms"] for s in steps if s["kind"] == "mixed" and "host_ms" in s]
    out["mixed_schedule_ms_median"] = round(statistics.median(mixed), 3) if mixed else None
    admitted = [s["admitted"] for s in steps if s.get("admitted")]  # (traces since 2026-12-05)
    out["admitted_per_admitting_step"] = round(statistics.mean(admitted), 1) if admitted else None
    return out


def by_kind(path: str, min_requests: int, requests: tuple[int, int] | None = None) -> dict:
    with open(path, encoding="utf-8") as fh:
        steps = [json.loads(line) for line in fh if line.strip()]
    start = next((i for i, s in enumerate(steps) if s["requests"] >= min_requests), 0)
    steps = steps[start:]
    if requests is not None:
        steps = [s for s in steps if requests[0] <= s["requests"] <= requests[1]]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for s in steps:
        groups[(s["kind"], s.get("q"), bool(s.get("fused")))].append(s)
    rows = []
    for (kind, q, fused), group in sorted(groups.items(), key=lambda kv: -sum(s["device_ms"] for s in kv[1])):
        ms = [s["device_ms"] for s in group]
        rows.append({"kind": kind, "q": q, "fused": fused, "steps": len(group), "device_s": round(sum(ms) / 1e3, 3),
                     "median_ms": round(statistics.median(ms), 3),
                     "mean_tokens": round(statistics.mean(s["tokens"] for s in group), 1),
                     "mean_requests": round(statistics.mean(s["requests"] for s in group), 1),
                     **_host_wait(group)})
    return {"trace": path, "steps": len(steps), "device_s": round(sum(s["device_ms"] for s in steps) / 1e3, 3),
            **_host_wait(steps), "by_kind": rows, "busy_by_admission": _busy_by_admission(steps)}


def _span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        span = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LO-HI (numbers of requests)") from None
    if span[0] > span[1]:
        raise argparse.ArgumentTypeError(f"{text!r} has LO above HI")
    return span


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--min-requests", type=int, default=1)
    parser.add_argument("--requests", type=_span, default=None, help="LO-HI: only the steps of that many requests")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = [by_kind(t, args.min_requests, args.requests) for t in args.traces]
    for r in results:
        print(f"{r['trace']}: {r['steps']} steps, {r['device_s']} s of device time, the GPU waited "
              f"{r['host_wait_s']} s for the host ({r['waited_share']} of {r['queued_steps']} queued steps); "
              f"uniform decodes {r['decode_tokens_per_ms']} output tokens per ms of their periods")
        busy = r["busy_by_admission"]
        if busy:
            print(f"  GPU busy {busy['admitting']['gpu_busy']} over {busy['admitting']['steps']} steps in runs that "
                  f"admit requests (mixed steps' schedule {busy['mixed_schedule_ms_median']} ms median"
                  + (f", {busy['admitted_per_admitting_step']} requests each" if busy["admitted_per_admitting_step"]
                     else "") + "), "
                  f"{busy['quiet']['gpu_busy']} over {busy['quiet']['steps']} in runs that do not")
        for row in r["by_kind"]:
            print(f"  {row['kind']:15s} q={row['q']!s:4s} fused={row['fused']!s:5s} {row['steps']:6d} steps "
                  f"{row['device_s']:8.3f} s  median {row['median_ms']:7.3f} ms  {row['mean_tokens']:7.1f} tokens  "
                  f"{row['mean_requests']:6.1f} requests  host wait {row['host_wait_s']:6.3f} s")
    write_json(args.out, {"command": "PYTHONPATH=. python benchmarks/trace_by_kind.py " + shlex.join(sys.argv[1:]),
                          "commit": commit(), "traces": results})


if __name__ == "__main__":
    main()
