"""Tensor parallelism on two H200s (issue 34): bench-dense and bench-moe-large served by ``twogrid serve`` at
``--tensor-parallel-size`` 1 and 2 (separate grids, the sm100 defaults), driven by ``twogrid bench`` with the
ShareGPT prompts at 1, 64, 256 and 1024 streams (256 output tokens, EOS ignored). Per model and size: output tok/s
and median TPOT per concurrency, the eager steps each run added (``twogrid:eager_steps_total``: none is expected
within 8192 tokens), the KV tokens that fit, and the first-divergence check of TP = 2's greedy output against
TP = 1's (``bench_quant_gpu.divergence``: equal, or TP = 2's token within TP = 1's top 5 where they first differ;
the all-reduce sums partial products in another order).

The presets have random weights; they serve text with SmolLM2's tokenizer (``--tokenizer``). NVLink multicast stays
off (NCCL_NVLS_ENABLE=0, set here unless the environment sets it: the device README says why).

    PYTHONPATH=. python benchmarks/bench_tp_gpu.py --data .gpu_data/sharegpt.json \\
        --tokenizer .gpu_data/smollm2-tokenizer --out $OUT/tp_h200x2.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import urllib.request

from _common import commit, write_json  # (importing _common puts the repository on sys.path)
from bench_headline_gpu import launch, run_bench
from bench_quant_gpu import divergence, greedy, kv_tokens


def serve_command(model: str, tp: int, port: int, args) -> list[str]:
    return [sys.executable, "-m", "dispatcher", "serve", "--model", model, "--tokenizer", args.tokenizer,
            "--served-model-name", model, "--platform", "sm100", "--port", str(port), "--max-num-seqs", "1024",
            "--max-num-batched-tokens", "16384", "--max-model-len", str(args.max_model_len),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--block-size", "16",
            "--tensor-parallel-size", str(tp), "--no-delayed-cudagraph-capture"]


def eager_steps(port: int) -> float:
    """The server's ``twogrid:eager_steps_total`` over every reason."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("twogrid:eager_steps_total"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="ShareGPT JSON (the bench's prompts)")
    p.add_argument("--tokenizer", required=True, help="SmolLM2's tokenizer (a directory or its GGUF)")
    p.add_argument("--models", default="bench-dense,bench-moe-large")
    p.add_argument("--sizes", default="1,2", help="tensor-parallel sizes")
    p.add_argument("--concurrencies", default="1,64,256,1024")
    p.add_argument("--waves", type=int, default=2, help="requests per run: waves x concurrency")
    p.add_argument("--min-prompts", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--check-prompts", type=int, default=16, help="prompts of the first-divergence check")
    p.add_argument("--check-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=8400)
    p.add_argument("--out", default=None)
    p.add_argument("--log-dir", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    with open(args.data, encoding="utf-8") as fh:
        data = json.load(fh)
    prompts = [d["conversations"][0]["value"][:2000] for d in data[:args.check_prompts]]
    result = {"command": "PYTHONPATH=. python benchmarks/bench_tp_gpu.py " + shlex.join(sys.argv[1:]),
              "commit": commit(), "bench": "tp_h200x2", "concurrencies": concurrencies,
              "nccl_nvls_enable": os.environ["NCCL_NVLS_ENABLE"], "rows": []}
    for model in args.models.split(","):
        reference = None
        for tp in (int(s) for s in args.sizes.split(",")):
            log_path = os.path.join(args.log_dir, f"tp-{model}-tp{tp}.log")
            proc = launch(serve_command(model, tp, args.port, args), f"{model} tp={tp}", args.port, log_path)
            try:
                row = {"model": model, "tensor_parallel_size": tp, "kv_tokens": kv_tokens(log_path)}
                checked = greedy(args.port, model, prompts, args.check_tokens)
                if tp == 1:
                    reference = checked
                elif reference is not None:
                    row["vs_tp1"] = divergence(reference, checked)
                for conc in concurrencies:
                    before = eager_steps(args.port)
                    bench = run_bench(f"http://127.0.0.1:{args.port}", conc, f"{model}-tp{tp}",
                                      os.path.join(args.log_dir, "tp-bench"), args, proc.pid, served_name=model)
                    row[f"output_tok_s_c{conc}"] = round(bench["output_throughput"], 1)
                    row[f"tpot_ms_median_c{conc}"] = round(bench.get("median_tpot_ms", 0.0), 3)
                    row[f"eager_steps_c{conc}"] = eager_steps(args.port) - before
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=120)
            write_json(args.out, result)
    base = {r["model"]: r for r in result["rows"] if r["tensor_parallel_size"] == 1}
    for r in result["rows"]:
        b = base.get(r["model"])
        if b and r is not b:
            for conc in concurrencies:
                r[f"speedup_c{conc}"] = round(r[f"output_tok_s_c{conc}"] / b[f"output_tok_s_c{conc}"], 3)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
