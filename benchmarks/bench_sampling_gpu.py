"""What the sampling parameters cost when every request uses them (issue 31): one ``twogrid serve`` of bench-moe
(separate grids, the headline's server flags: benchmarks/bench_headline_gpu.py), driven by ``twogrid bench`` with
the ShareGPT prompts at 256 streams, 256 output tokens each with EOS ignored, in rounds that alternate the
variants against the same server (so that a drift of the machine falls on all of them alike):

  greedy     temperature 0, nothing else
  sampled    temperature 0.8 (the baseline of the figure: min_p acts on sampled requests only, as in vLLM)
  penalized  temperature 0.8 plus a presence penalty, a repetition penalty and min_p on every request (the
             penalties count each request's prompt and output tokens on the device, every step), and
             ``--extra-body``'s fields where given (issue 31's target: penalties, min_p and a JSON schema)
  penalties  the penalized variant's flags without ``--extra-body``'s fields
  structured temperature 0.8 with ``--extra-body``'s fields alone (a schema without the penalties)

(``penalties`` and ``structured`` beside ``penalized`` split what a schema costs from what the penalties cost, in
one run.)

Per variant the output tok/s over all its rounds, TPOT and TTFT (medians), the server's step device time and GPU
busy, and how many of its steps ran as one fused graph (``fused_steps`` of ``steps``: sampled and penalized
decodes fuse; a structured-output schema's run op by op); then ``penalized_over_sampled`` (issue 31's target:
>= 0.9), ``sampled_over_greedy`` and, where they ran, ``penalties_over_sampled`` and ``structured_over_sampled``.
``--extra-body`` adds fields to the penalized and structured variants' requests (a structured-output schema, for
one). A row's ``round_tok_s`` shows the spread.

    PYTHONPATH=. python benchmarks/bench_sampling_gpu.py --data .gpu_data/sharegpt.json \\
        --tokenizer .gpu_data/smollm2-tokenizer --out $OUT/sampling_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys

import numpy as np

from _common import commit, loop_holds, write_json  # (importing _common puts the repository on sys.path)
from bench_headline_gpu import OUTPUT_LEN, make_row, prime_triton_cache, run_bench, start_server
from models.config import PRESETS

VARIANTS = {
    "greedy": ["--temperature", "0"],
    "sampled": ["--temperature", "0.8"],
    "penalized": ["--temperature", "0.8", "--presence-penalty", "0.5", "--repetition-penalty", "1.1",
                  "--min-p", "0.05"],
}
VARIANTS["penalties"] = VARIANTS["penalized"]
VARIANTS["structured"] = VARIANTS["sampled"]
EXTRA_BODY_VARIANTS = ("penalized", "structured")
"""The variants whose requests carry ``--extra-body``'s fields."""


def decodes_by_constraint(trace_path: str) -> dict:
    """The server's fused uniform decodes of 200 requests or more, with constrained rows and without: their count
    and median device ms and period ms (a period above the device time is the GPU waiting for the host), and how
    many waited inside the step for their bitmask (``bitmask_wait_ms``: the host's fill outlasted the forward) and
    for how long on average."""
    groups: dict[str, list[dict]] = {"constrained": [], "unconstrained": []}
    with open(trace_path, encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            if rec.get("fused") and rec["kind"] == "uniform_decode" and rec["requests"] >= 200:
                groups["constrained" if rec.get("constrained") else "unconstrained"].append(rec)
    out = {}
    for name, recs in groups.items():
        periods = [r["period_ms"] for r in recs if "period_ms" in r]
        out[name] = {"steps": len(recs),
                     "device_ms_p50": round(float(np.median([r["device_ms"] for r in recs])), 3) if recs else None,
                     "period_ms_p50": round(float(np.median(periods)), 3) if periods else None,
                     "host_ms_p50": round(float(np.median([r["host_ms"] for r in recs])), 3) if recs else None,
                     "bitmask_waits": sum(1 for r in recs if r.get("bitmask_wait_ms", 0) > 0.005),
                     "bitmask_wait_ms_mean": round(sum(r.get("bitmask_wait_ms", 0) for r in recs) / len(recs), 4)
                     if recs else None}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="the sampling parameters' cost: one server, alternating rounds")
    parser.add_argument("--data", required=True, help="ShareGPT JSON")
    parser.add_argument("--tokenizer", required=True, help="SmolLM2's tokenizer (bench-moe serves text with it)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--concurrency", default="256")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every variant, in alternating order")
    parser.add_argument("--variants", default="greedy,sampled,penalized")
    parser.add_argument("--extra-body", default=None, metavar="JSON",
                        help="more fields for the penalized and structured variants' requests")
    parser.add_argument("--workload", default="no-sd", help="a speculative config of bench_headline_gpu.WORKLOADS")
    parser.add_argument("--fixed-acceptance", type=float, default=0.0, help="with a speculative workload (0: real)")
    parser.add_argument("--waves", type=int, default=2, help="prompts per run = waves x concurrency")
    parser.add_argument("--min-prompts", type=int, default=16)
    parser.add_argument("--port", type=int, default=8133)
    parser.add_argument("--api-server-count", type=int, default=4)
    parser.add_argument("--model", default="bench-moe")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--no-prime-cache", dest="prime_cache", action="store_false")
    parser.add_argument("--step-trace-dir", default=None,
                        help="keep the server's step trace there; the result then compares the fused decodes with "
                             "constrained rows and without (device and period ms: where a schema's cost lies)")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"--variants: unknown {', '.join(sorted(unknown))} (known: {', '.join(VARIANTS)})")
    if args.extra_body:
        json.loads(args.extra_body)  # (a bad one fails here, not after the server started)
    elif "structured" in variants:
        parser.error("--variants structured: needs --extra-body (the structured-output fields its requests carry)")
    # what bench_headline_gpu's helpers read
    args.policies, args.workloads = "separate", args.workload
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out_dir = os.path.dirname(args.out) if args.out else "."
    os.makedirs(out_dir or ".", exist_ok=True)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    with_body = " + --extra-body" if args.extra_body else ""
    model = f"{args.model} (random weights) with SmolLM2's tokenizer" if args.model in PRESETS else args.model
    result = {"command": "PYTHONPATH=. python benchmarks/bench_sampling_gpu.py " + shlex.join(sys.argv[1:]),
              "commit": commit(), "model": model, "output_len": OUTPUT_LEN,
              "variants": {v: shlex.join(VARIANTS[v]) + (with_body if v in EXTRA_BODY_VARIANTS else "")
                           for v in variants},
              "extra_body": args.extra_body, "rows": [], "ratios": []}
    if args.prime_cache:
        prime_triton_cache(args, concurrencies, out_dir)
    fixed = args.fixed_acceptance or None
    proc = start_server("separate", args.workload, fixed, args.port, args, os.path.join(out_dir, "server-sampling.log"))
    base = f"http://127.0.0.1:{args.port}"
    try:
        for conc in concurrencies:
            benches: dict[str, list[dict]] = {v: [] for v in variants}
            for r in range(args.rounds):
                order = variants if r % 2 == 0 else variants[::-1]
                for v in order:
                    extra = VARIANTS[v] + (["--extra-body", args.extra_body]
                                           if v in EXTRA_BODY_VARIANTS and args.extra_body else [])
                    benches[v].append(run_bench(base, conc, f"{v}-r{r}", os.path.join(out_dir, "bench-sampling"),
                                                args, proc.pid, bench_args=tuple(extra)))
            acceptance = f"fixed-{fixed}" if fixed else "real"
            rows = {v: dict(make_row("separate", args.workload, acceptance, conc, b, args), variant=v)
                    for v, b in benches.items()}
            result["rows"] += rows.values()
            ratio = {"concurrency": conc}
            for a, b in (("penalized", "sampled"), ("sampled", "greedy"), ("penalized", "greedy"),
                         ("penalties", "sampled"), ("structured", "sampled")):
                if a in rows and b in rows:
                    ratio[f"{a}_over_{b}"] = round(rows[a]["output_tok_s"] / rows[b]["output_tok_s"], 3)
            result["ratios"].append(ratio)
            print(json.dumps(ratio), flush=True)
            write_json(args.out, result)
    finally:
        proc.terminate()
        proc.wait(60)
    with open(os.path.join(out_dir, "server-sampling.log"), encoding="utf-8", errors="replace") as fh:
        result["server"] = loop_holds(fh.read())
    print(json.dumps(result["server"]), flush=True)
    write_json(args.out, result)
    if args.step_trace_dir:
        result["decodes_by_constraint"] = decodes_by_constraint(
            os.path.join(args.step_trace_dir, f"trace-separate-{args.workload}.jsonl"))
        print(json.dumps(result["decodes_by_constraint"]), flush=True)
        write_json(args.out, result)
    for row in result["rows"]:
        print(f"{row['variant']:>10} c={row['concurrency']:<4} {row['output_tok_s']:>9.1f} tok/s  TPOT "
              f"{row['tpot_ms_mean']:.2f} ms  TTFT {row['ttft_ms_mean']:.1f} ms  GPU busy {row['gpu_busy']:.2f}  "
              f"fused steps {row['fused_steps']} of {row['steps']}  rounds {row.get('round_tok_s')}")


if __name__ == "__main__":
    main()
