"""Structured outputs served (issue 31): output tok/s of ``twogrid serve`` with a JSON schema on every request
over the same run without one, on one server (the headline's flags: bench-moe with SmolLM2's tokenizer, separate
grids), driven by ``twogrid bench`` (ShareGPT prompts, 256 output tokens, EOS ignored) at ``--concurrency``
streams. The plain and the structured runs take turns for ``--rounds`` rounds (the order flips each round), so that
the server's drift over time falls on both alike; each run follows a warm-up wave.

The schema (``SCHEMA``) is an array of 16 to 64 objects (a bounded name, a number, up to 3 enum tags): at least
about 400 tokens of JSON, so that every one of the 256 output tokens is constrained (with EOS ignored a finished
grammar would leave the rest free). With bench-moe's random weights each token is the allowed one the random model
scores highest: the grammar's work per token (a matcher advanced, a bitmask row filled and applied) is what
a real model's would be. Separate from the sampling-parameter benchmark: only ``--response-format`` differs
between the two runs of a round.

Per round and mode: output tok/s, TPOT, TTFT, steps and their device time (the server's /metrics, read by
``twogrid bench``) and GPU busy; the result's ``ratio`` is the structured runs' tokens over their duration divided
by the plain runs'.

    PYTHONPATH=.:benchmarks python benchmarks/bench_structured_gpu.py --data .gpu_data/sharegpt.json \\
        --tokenizer .gpu_data/smollm2-tokenizer --concurrency 256 --rounds 2 --out $OUT/structured_h200.json

``--speculative-config`` serves with speculative decoding (structured requests then verify no drafts). A CPU dry
run: ``HEADLINE_OUTPUT_LEN=8 ... --device cpu --model <the default GGUF> --api-server-count 1 --concurrency 2
--min-prompts 2``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time

from _common import commit, write_json  # (importing _common puts the repository on sys.path)
from bench_headline_gpu import OUTPUT_LEN, launch, make_row, run_bench, serve_command, wait_healthy

SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "minItems": 16, "maxItems": 64, "items": {
        "type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24},
            "qty": {"type": "integer", "minimum": 0, "maximum": 1000},
            "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["new", "used", "sale"]}}},
        "required": ["name", "qty", "tags"]}}}, "required": ["items"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "inventory", "schema": SCHEMA}}
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def summary(rows: list[dict]) -> dict:
    """Per mode: all its runs' tokens over their summed durations; the ratio structured / plain."""
    out = {}
    for mode in ("plain", "structured"):
        mine = [r for r in rows if r["mode"] == mode]
        if mine:
            out[mode] = round(sum(r["output_tok_s"] * r["duration_s"] for r in mine)
                              / sum(r["duration_s"] for r in mine), 1)
    if len(out) == 2:
        out["ratio"] = round(out["structured"] / out["plain"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="structured outputs served: tok/s with a JSON schema on every "
                                                 "request over tok/s without")
    parser.add_argument("--data", required=True, help="ShareGPT JSON (the headline's)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--model", default="bench-moe")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer for a preset model (SmolLM2's for bench-moe)")
    parser.add_argument("--policy", default="separate")
    parser.add_argument("--speculative-config", default=None, help="JSON, as twogrid serve takes it")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--waves", type=int, default=2, help="prompts per run = waves x concurrency")
    parser.add_argument("--min-prompts", type=int, default=16)
    parser.add_argument("--port", type=int, default=8124)
    parser.add_argument("--api-server-count", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--step-trace-dir", default=None)
    args = parser.parse_args()
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (a timeout's SIGTERM: stop the server on the way out)
    out_dir = os.path.dirname(args.out) if args.out else "."
    os.makedirs(out_dir or ".", exist_ok=True)
    result = {"command": "PYTHONPATH=.:benchmarks python benchmarks/bench_structured_gpu.py "
                         + shlex.join(sys.argv[1:]),
              "commit": commit(), "model": os.path.basename(args.model), "tokenizer": args.tokenizer,
              "policy": args.policy, "speculative_config": spec, "device": args.device, "output_len": OUTPUT_LEN,
              "concurrency": args.concurrency, "api_server_count": args.api_server_count,
              "response_format": RESPONSE_FORMAT, "rows": [], "summary": {}}
    cmd = serve_command(args.policy, spec, args.port, args)
    if args.step_trace_dir:
        os.makedirs(args.step_trace_dir, exist_ok=True)
        cmd += ["--step-trace", os.path.join(args.step_trace_dir, "trace-structured.jsonl")]
    log_path = os.path.join(out_dir, "server-structured.log")
    proc = launch(cmd, args.policy, args.port, log_path, wait=False)
    base = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(proc, args.policy, args.port)
        log(f"server ready; {args.rounds} rounds at {args.concurrency} streams, {OUTPUT_LEN} output tokens")
        for rnd in range(args.rounds):
            order = ("plain", "structured") if rnd % 2 == 0 else ("structured", "plain")
            for mode in order:
                extra = ["--response-format", json.dumps(RESPONSE_FORMAT)] if mode == "structured" else []
                bench = run_bench(base, args.concurrency, f"{mode}-r{rnd}", os.path.join(out_dir, "bench"), args,
                                  proc.pid, bench_args=tuple(extra))
                row = {**make_row(args.policy, mode, "real", args.concurrency, [bench], args), "mode": mode,
                       "round": rnd, "duration_s": round(bench["duration"], 3)}
                result["rows"].append(row)
                result["summary"] = summary(result["rows"])
                write_json(args.out, result)
                log(f"round {rnd} {mode}: {row['output_tok_s']:.0f} tok/s, TPOT {row['tpot_ms_mean']:.2f} ms, "
                    f"GPU busy {row['gpu_busy']:.2f}, {row['failed']} failed")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except Exception:
            proc.kill()
    log(f"summary: {result['summary']}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
