"""Grids fitted to the measured step cost against the sm100 defaults and SGLang's lists, through the server (issue 33):
``fit_cudagraph_capture_sizes`` (the server measures e(n) at start-up, or reads it from $TWOGRID_CACHE/grid_cost,
and captures the grids the padding-cost rule gives), ``separate`` (the default grids) and ``sglang`` (SGLang's
decode and prefill lists, bench_headline_gpu.POLICIES).

Per workload the three servers are up at once (each a third of the memory, ``--gpu-memory-utilization``), and at
each concurrency ``--rounds`` bench runs a server in rotating order (A B C, B C A, C A B, ...), one warm-up wave per
server and concurrency first: per cell the median output tok/s of its runs and, run by run, the fitted server's over
each other's (the median of those paired ratios decides); a run is ``--waves`` x concurrency prompts. Per server
its graphs by runner and kind (``twogrid:cudagraphs_planned``) and the fitted grids' sizes (its log). Workloads:
eagle3 at K = 7 with fixed acceptance 3.0 (bench-moe's head is random), and no speculative decoding. With four waves
a run (the default since the runs of dc20fbe), one workload at 16-1024 streams and four rounds takes about 6 minutes
of an H100 after its servers' start (1-3 minutes).

    PYTHONPATH=.:benchmarks python benchmarks/bench_grid_fit_gpu.py --data .gpu_data/sharegpt.json \\
        --tokenizer .gpu_data/smollm2-tokenizer --workloads eagle3-k7 --out $OUT/grid_fit_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import sys
import urllib.request

from _common import commit, markdown_grid, stop_server, write_json  # (puts the repository on sys.path)
from bench_headline_gpu import OUTPUT_LEN, POLICIES, run_bench, wait_healthy
from bench_startup_gpu import bench_args, launch, log

FITTED = "fitted"
GRID_POLICIES = {"separate": POLICIES["separate"], "sglang": POLICIES["sglang"],
                 FITTED: {"fit_cudagraph_capture_sizes": True}}
WORKLOADS = {"eagle3-k7": ({"method": "eagle3", "num_speculative_tokens": 7}, 3.0), "no-sd": (None, None)}
PLANNED = re.compile(r'twogrid:cudagraphs_planned\{([^}]*)\} ([0-9.e+-]+)')
LABEL = re.compile(r'(\w+)="([^"]*)"')


def serve_command(policy: str, workload: str, port: int, args) -> list[str]:
    spec, fixed = WORKLOADS[workload]
    cmd = [sys.executable, "-m", "dispatcher", "serve", "--model", args.model, "--platform", "sm100", "--port",
           str(port), "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-model-len",
           str(args.max_model_len), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--served-model-name", "m", "--device", args.device, "--api-server-count", str(args.api_server_count),
           "--compilation-config", json.dumps(GRID_POLICIES[policy]), "--no-delayed-cudagraph-capture"]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec), "--fixed-acceptance", str(fixed)]
    if args.step_trace_dir:  # (benchmarks/trace_by_kind.py says where each server's device time went)
        cmd += ["--step-trace", os.path.join(args.step_trace_dir, f"trace-gridfit-{workload}-{policy}.jsonl")]
    return cmd


def planned_graphs(port: int) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for labels, value in PLANNED.findall(text):
        d = dict(LABEL.findall(labels))
        out[f"{d['runner']} {d['kind']}"] = int(float(value))
    return out


def fitted_plan(log_path: str) -> str | None:
    """The fitted plan's table the server logs (``fitted grids ...``), or None."""
    text = open(log_path, encoding="utf-8", errors="replace").read()
    at = text.find("fitted grids (fit_cudagraph_capture_sizes, from")
    return text[at:text.find("total:", at) + 40].strip() if at >= 0 else None


def measure(workload: str, args, result: dict, out_dir: str, save) -> None:
    policies = args.policies.split(",")
    procs = {}
    try:
        # one after another, the fitted server first: it measures the step cost at start-up (unless cached), which
        # the others' captures would disturb, and a server sizes its KV cache from its own share of the memory
        # (--gpu-memory-utilization), which another's start-up would blur
        for policy in sorted(policies, key=lambda p: p != FITTED):
            i = policies.index(policy)
            procs[policy] = launch(serve_command(policy, workload, args.port + i, args),
                                   os.path.join(out_dir, f"server-gridfit-{workload}-{policy}.log"))
            wait_healthy(procs[policy], policy, args.port + i)
        servers = {p: {"graphs": planned_graphs(args.port + i)} for i, p in enumerate(policies)}
        for p in servers:
            servers[p]["total_graphs"] = sum(servers[p]["graphs"].values())
        if FITTED in procs:
            servers[FITTED]["plan"] = fitted_plan(procs[FITTED].log_path)
        result["servers"][workload] = servers
        log(f"{workload}: graphs " + ", ".join(f"{p} {s['total_graphs']}" for p, s in servers.items()))
        save()
        run_args = bench_args(args, args.waves)
        for conc in args.concurrency:
            runs: dict[str, list[dict]] = {p: [] for p in policies}
            for rnd in range(args.rounds):
                order = policies[rnd % len(policies):] + policies[:rnd % len(policies)]
                for policy in order:
                    port = args.port + policies.index(policy)
                    bench = run_bench(f"http://127.0.0.1:{port}", conc, f"gridfit-{workload}-{policy}",
                                      os.path.join(out_dir, "bench"), run_args, None, "m",
                                      warmups=conc if rnd == 0 else 0)
                    runs[policy].append(bench)
            for policy in policies:
                tok_s = [round(b["output_throughput"], 1) for b in runs[policy]]
                row = {"workload": workload, "policy": policy, "concurrency": conc,
                       "output_tok_s": round(statistics.median(tok_s), 1), "round_tok_s": tok_s,
                       "graphs": servers[policy]["total_graphs"],
                       "padded_tokens": [int(b.get("padded_tokens", 0)) for b in runs[policy]],
                       "eager_steps": [int(b.get("eager_steps", 0)) for b in runs[policy]],
                       "tpot_ms_median": round(statistics.median(b["mean_tpot_ms"] for b in runs[policy]), 3),
                       "ttft_ms_median": round(statistics.median(b["mean_ttft_ms"] for b in runs[policy]), 3)}
                if policy == FITTED:
                    for other in policies:
                        if other != FITTED:
                            ratios = [f["output_throughput"] / o["output_throughput"]
                                      for f, o in zip(runs[FITTED], runs[other])]
                            row[f"vs_{other}"] = round(statistics.median(ratios), 4)
                            row[f"vs_{other}_runs"] = [round(r, 4) for r in ratios]
                result["rows"] = [r for r in result["rows"] if (r["workload"], r["policy"], r["concurrency"])
                                  != (workload, policy, conc)] + [row]
            fitted = next((r for r in result["rows"] if (r["workload"], r["policy"], r["concurrency"]) ==
                           (workload, FITTED, conc)), None)
            log(f"{workload} c={conc}: " + ", ".join(f"{p} {statistics.median(b['output_throughput'] for b in rs):.0f}"
                                                    for p, rs in runs.items())
                + (", fitted vs " + ", ".join(f"{k[3:]} {v:.4f}" for k, v in fitted.items()
                                              if k.startswith("vs_") and not k.endswith("_runs")) if fitted else ""))
            save()
    finally:
        for proc in procs.values():
            stop_server(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description="fitted grids vs the sm100 defaults and SGLang's lists, served")
    parser.add_argument("--data", required=True, help="ShareGPT JSON (the headline's)")
    parser.add_argument("--tokenizer", default=None, help="SmolLM2's tokenizer directory, for the bench-moe preset")
    parser.add_argument("--model", default="bench-moe")
    parser.add_argument("--workloads", default="eagle3-k7")
    parser.add_argument("--policies", default="separate,sglang,fitted")
    parser.add_argument("--concurrency", default="16,64,256,1024")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--waves", type=int, default=4,
                        help="prompts per run = waves x concurrency (one wave of 64 streams lasts about a second, and "
                             "one-wave runs spread 3-15%% a cell; four-wave runs paired round by round are within 2%%)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--port", type=int, default=8170, help="the first server's; the others count up")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.28, help="each of the three servers'")
    parser.add_argument("--api-server-count", type=int, default=4)
    parser.add_argument("--step-trace-dir", default=None, help="each server writes its step trace here")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    from models.config import PRESETS

    if args.model in PRESETS and not args.tokenizer:
        parser.error("a preset model serves text only with --tokenizer (SmolLM2's: .gpu_data/smollm2-tokenizer)")
    if unknown := set(args.policies.split(",")) - set(GRID_POLICIES):
        parser.error(f"--policies: unknown {', '.join(sorted(unknown))} (known: {', '.join(GRID_POLICIES)})")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.step_trace_dir:
        os.makedirs(args.step_trace_dir, exist_ok=True)
    out_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else os.getcwd()
    result = {"rows": [], "servers": {}}
    if args.out and os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as fh:
            result = json.load(fh)
    result.update(commit=commit(), model=args.model, output_len=OUTPUT_LEN, policies=GRID_POLICIES, waves=args.waves)
    result.setdefault("commands", []).append("PYTHONPATH=.:benchmarks python benchmarks/bench_grid_fit_gpu.py "
                                             + shlex.join(sys.argv[1:]))

    def save() -> None:
        result["table"] = markdown_grid(
            result["rows"], lambda r: f"{r['workload']}: output tok/s (median of {args.rounds} alternated runs)",
            lambda r: f"{r['policy']} ({r['graphs']} graphs)",
            lambda r: f"{r['output_tok_s']:.0f}" + (f" ({r['vs_separate']:.3f}x sep, {r['vs_sglang']:.3f}x sgl)"
                                                    if "vs_separate" in r and "vs_sglang" in r else ""))
        write_json(args.out, result)

    try:
        for workload in args.workloads.split(","):
            measure(workload, args, result, out_dir, save)
    finally:
        save()


if __name__ == "__main__":
    main()
