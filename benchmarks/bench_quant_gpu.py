"""FP8 on the H200 (issue 32): bench-moe and bench-dense served by ``twogrid serve`` in bf16, with FP8 weights
(``--quantization fp8``) and with an FP8 KV cache (``--kv-cache-dtype fp8``), driven by ``twogrid bench`` with the
ShareGPT prompts at 256 and 1024 streams (256 output tokens, EOS ignored). Per model and setting: output tok/s per
concurrency, the KV tokens that fit (blocks x block size, from the server's start-up line; every server gets the
same --gpu-memory-utilization), and the first-divergence check of greedy output against bf16: for each of
``--check-prompts`` prompts, the first position where the setting's greedy tokens differ from bf16's, and whether
the setting's token there is among bf16's top 5 at that position (greedy decoding of a rounded model may take
another of the near-tied tokens; a token outside the top 5 means a broken path).

The presets have random weights; they serve text with SmolLM2's tokenizer (``--tokenizer``; both vocabularies
hold its 49,152 tokens). A model's servers (one a setting) are started one after another and stay up together;
per concurrency, ``--rounds`` rounds of one run each, the servers' order reversed every other round, and each
setting's speed-up is the median of its round-by-round ratios to bf16. Each server has four front ends (before
this, one: at 256 streams it was the front end, not the GEMMs, that set the pace, so c847bba's FP8 weights ran 7%
shorter decode steps (TPOT) for 0.99x the tok/s).

    PYTHONPATH=. python benchmarks/bench_quant_gpu.py --data .gpu_data/sharegpt.json \\
        --tokenizer .gpu_data/smollm2-tokenizer --out $OUT/quant_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import urllib.request

from _common import commit, write_json  # (importing _common puts the repository on sys.path)
from bench_headline_gpu import launch, run_bench

SETTINGS = {
    "bf16": [],
    "fp8-weights": ["--quantization", "fp8"],
    "fp8-kv": ["--kv-cache-dtype", "fp8"],
    "fp8-both": ["--quantization", "fp8", "--kv-cache-dtype", "fp8"],
}
"""Flags per setting, added to the same server command."""


def serve_command(model: str, setting: str, port: int, args) -> list[str]:
    cmd = [sys.executable, "-m", "dispatcher", "serve", "--model", model, "--tokenizer", args.tokenizer,
           "--served-model-name", model, "--platform", "sm100", "--port", str(port), "--max-num-seqs", "1024",
           "--max-num-batched-tokens", "16384", "--max-model-len", str(args.max_model_len),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--block-size", "16",
           "--api-server-count", "4", "--stream-interval", str(args.stream_interval), "--no-delayed-cudagraph-capture"]
    return cmd + SETTINGS[setting]


def kv_tokens(log_path: str) -> int | None:
    """KV blocks x 16 from the server's "worker ready ... N KV blocks" line."""
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        found = re.findall(r"(\d+) KV blocks", fh.read())
    return int(found[-1]) * 16 if found else None


def greedy(port: int, model: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """Greedy completions with their top-5 log-probabilities: per prompt, (tokens, top-5 token texts a position)."""
    out = []
    for prompt in prompts:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "logprobs": 5, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            lp = json.load(r)["choices"][0]["logprobs"]
        out.append({"tokens": lp["tokens"], "top5": [list(t) for t in lp["top_logprobs"]]})
    return out


def divergence(reference: list[dict], got: list[dict]) -> dict:
    """Per prompt, the first position where ``got``'s greedy tokens leave ``reference``'s, and whether the token
    there is in the reference's top 5 at that position."""
    first, inside = [], []
    for ref, out in zip(reference, got):
        pos = next((i for i, (a, b) in enumerate(zip(ref["tokens"], out["tokens"])) if a != b), None)
        first.append(pos)
        if pos is not None:
            inside.append(out["tokens"][pos] in ref["top5"][pos])
    diverged = [p for p in first if p is not None]
    return {"prompts": len(first), "identical": first.count(None), "first_divergence": first,
            "median_first_divergence": sorted(diverged)[len(diverged) // 2] if diverged else None,
            "within_bf16_top5": sum(inside), "outside_bf16_top5": len(inside) - sum(inside),
            "ok": all(inside)}


def paired_summary(runs: dict[str, list[float]], reference: str = "bf16") -> dict[str, dict]:
    """Per setting, from its runs' output tok/s (one a round, the settings' servers alternated within each round):
    the median, and against ``reference``'s runs the median of the round-by-round ratios (a round's load on the
    host is shared by every setting in it) with the ratios themselves."""
    out = {}
    for setting, tok_s in runs.items():
        row = {"median": round(statistics.median(tok_s), 1), "runs": [round(t, 1) for t in tok_s]}
        if setting != reference and reference in runs:
            ratios = [a / b for a, b in zip(tok_s, runs[reference])]
            row.update(speedup=round(statistics.median(ratios), 3), speedups=[round(r, 3) for r in ratios])
        out[setting] = row
    return out


def measure_model(model: str, settings: list[str], concurrencies: list[int], prompts: list[str], args) -> list[dict]:
    """Every setting's server of one model, started one after another (each sizes its KV cache from what it took:
    the same share of the device each), then per concurrency ``--rounds`` rounds of one run per server, the order
    reversed every other round; the greedy check against bf16's server."""
    procs: dict[str, subprocess.Popen] = {}
    rows: dict[str, dict] = {}
    try:
        for i, setting in enumerate(settings):
            log_path = os.path.join(args.log_dir, f"quant-{os.path.basename(model)}-{setting}.log")
            procs[setting] = launch(serve_command(model, setting, args.port + i, args), f"{model} {setting}",
                                    args.port + i, log_path)
            rows[setting] = {"model": model, "setting": setting, "flags": SETTINGS[setting],
                             "kv_tokens": kv_tokens(log_path)}
        checked = {s: greedy(args.port + i, model, prompts, args.check_tokens) for i, s in enumerate(settings)}
        for setting in settings:
            if setting != "bf16" and "bf16" in checked:
                rows[setting]["vs_bf16"] = divergence(checked["bf16"], checked[setting])
        for conc in concurrencies:
            tok_s: dict[str, list[float]] = {s: [] for s in settings}
            tpot: dict[str, list[float]] = {s: [] for s in settings}
            for rnd in range(args.rounds):
                for setting in settings if rnd % 2 == 0 else settings[::-1]:
                    i = settings.index(setting)
                    bench = run_bench(f"http://127.0.0.1:{args.port + i}", conc,
                                      f"{os.path.basename(model)}-{setting}-r{rnd}",
                                      os.path.join(args.log_dir, "quant-bench"), args, procs[setting].pid,
                                      served_name=model)
                    tok_s[setting].append(bench["output_throughput"])
                    tpot[setting].append(bench.get("median_tpot_ms", 0.0))
            for setting, summary in paired_summary(tok_s).items():
                row = rows[setting]
                row[f"output_tok_s_c{conc}"] = summary["median"]
                row[f"output_tok_s_runs_c{conc}"] = summary["runs"]
                row[f"tpot_ms_median_c{conc}"] = round(statistics.median(tpot[setting]), 3)
                if "speedup" in summary:
                    row[f"speedup_c{conc}"], row[f"speedup_runs_c{conc}"] = summary["speedup"], summary["speedups"]
            print(json.dumps({s: rows[s].get(f"speedup_c{conc}") for s in settings}), flush=True)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=60)
    base = rows.get("bf16")
    for row in rows.values():
        if base is not None and row is not base and row["kv_tokens"] and base["kv_tokens"]:
            row["kv_tokens_vs_bf16"] = round(row["kv_tokens"] / base["kv_tokens"], 3)
    return list(rows.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="ShareGPT JSON (the bench's prompts)")
    p.add_argument("--tokenizer", required=True, help="SmolLM2's tokenizer (a directory or its GGUF)")
    p.add_argument("--models", default="bench-dense,bench-moe", help="presets or checkpoints (a GGUF path: the default "
                   "model's real weights)")
    p.add_argument("--settings", default="bf16,fp8-weights,fp8-kv", help=f"of {', '.join(SETTINGS)}")
    p.add_argument("--concurrencies", default="256,1024")
    p.add_argument("--rounds", type=int, default=3, help="runs of each server per concurrency, alternated")
    p.add_argument("--waves", type=int, default=2, help="requests per run: waves x concurrency")
    p.add_argument("--min-prompts", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="each server's share of the device (default: 0.8 over the settings' count: they run at once)")
    p.add_argument("--stream-interval", type=int, default=1, help="the servers' --stream-interval")
    p.add_argument("--check-prompts", type=int, default=16, help="prompts of the first-divergence check")
    p.add_argument("--check-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=8300, help="the first setting's port (the next ones follow)")
    p.add_argument("--out", default=None)
    p.add_argument("--log-dir", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or args.rounds < 1:
        p.error(f"--settings: {unknown} not of {list(SETTINGS)}" if unknown else "--rounds must be >= 1")
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = round(0.8 / len(settings), 3)
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    with open(args.data, encoding="utf-8") as fh:
        data = json.load(fh)
    prompts = [d["conversations"][0]["value"][:2000] for d in data[:args.check_prompts]]
    result = {"command": "PYTHONPATH=. python benchmarks/bench_quant_gpu.py " + shlex.join(sys.argv[1:]),
              "commit": commit(), "bench": "quant_h200", "concurrencies": concurrencies, "rounds": args.rounds,
              "rows": []}
    for model in args.models.split(","):
        result["rows"] += measure_model(model, settings, concurrencies, prompts, args)
        write_json(args.out, result)


if __name__ == "__main__":
    main()
