"""FP8 on the H200 (issue 32): bench-moe and bench-dense served by ``twogrid serve`` in bf16, with FP8 weights
(``--quantization fp8``) and with an FP8 KV cache (``--kv-cache-dtype fp8``), driven by ``twogrid bench`` with the
ShareGPT prompts at 256 and 1024 streams (256 output tokens, EOS ignored). Per model and setting: output tok/s per
concurrency, the KV tokens that fit (blocks x block size, from the server's start-up line; every server gets the
same --gpu-memory-utilization), and the first-divergence check of greedy output against bf16: for each of
``--check-prompts`` prompts, the first position where the setting's greedy tokens differ from bf16's, and whether
the setting's token there is among bf16's top 5 at that position (greedy decoding of a rounded model may take
another of the near-tied tokens; a token outside the top 5 means a broken path).

The presets have random weights; they serve text with SmolLM2's tokenizer (``--tokenizer``; both vocabularies
hold its 49,152 tokens). Each server is started once and every concurrency runs against it.

    PYTHONPATH=. python benchmarks/bench_quant_gpu.py --data .gpu_data/sharegpt.json \\
        --tokenizer .gpu_data/smollm2-tokenizer --out $OUT/quant_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import re
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
           "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--block-size", "16"]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="ShareGPT JSON (the bench's prompts)")
    p.add_argument("--tokenizer", required=True, help="SmolLM2's tokenizer (a directory or its GGUF)")
    p.add_argument("--models", default="bench-dense,bench-moe")
    p.add_argument("--settings", default="bf16,fp8-weights,fp8-kv", help=f"of {', '.join(SETTINGS)}")
    p.add_argument("--concurrencies", default="256,1024")
    p.add_argument("--waves", type=int, default=2, help="requests per run: waves x concurrency")
    p.add_argument("--min-prompts", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--check-prompts", type=int, default=16, help="prompts of the first-divergence check")
    p.add_argument("--check-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--out", default=None)
    p.add_argument("--log-dir", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    with open(args.data, encoding="utf-8") as fh:
        data = json.load(fh)
    prompts = [d["conversations"][0]["value"][:2000] for d in data[:args.check_prompts]]
    result = {"command": "PYTHONPATH=. python benchmarks/bench_quant_gpu.py " + shlex.join(sys.argv[1:]),
              "commit": commit(), "bench": "quant_h200", "concurrencies": concurrencies, "rows": []}
    for model in args.models.split(","):
        reference = None
        for setting in args.settings.split(","):
            log_path = os.path.join(args.log_dir, f"quant-{model}-{setting}.log")
            proc = launch(serve_command(model, setting, args.port, args), f"{model} {setting}", args.port, log_path)
            try:
                row = {"model": model, "setting": setting, "flags": SETTINGS[setting], "kv_tokens": kv_tokens(log_path)}
                checked = greedy(args.port, model, prompts, args.check_tokens)
                if setting == "bf16":
                    reference = checked
                elif reference is not None:
                    row["vs_bf16"] = divergence(reference, checked)
                for conc in concurrencies:
                    bench = run_bench(f"http://127.0.0.1:{args.port}", conc, f"{model}-{setting}",
                                      os.path.join(args.log_dir, "quant-bench"), args, proc.pid, served_name=model)
                    row[f"output_tok_s_c{conc}"] = round(bench["output_throughput"], 1)
                    row[f"tpot_ms_median_c{conc}"] = round(bench.get("median_tpot_ms", 0.0), 3)
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            write_json(args.out, result)
    base = {r["model"]: r for r in result["rows"] if r["setting"] == "bf16"}
    for r in result["rows"]:
        b = base.get(r["model"])
        if b and r is not b:
            r["kv_tokens_vs_bf16"] = round(r["kv_tokens"] / b["kv_tokens"], 3) if r["kv_tokens"] else None
            for conc in concurrencies:
                key = f"output_tok_s_c{conc}"
                r[f"speedup_c{conc}"] = round(r[key] / b[key], 3)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
