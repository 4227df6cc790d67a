"""CPU benchmark of the default model, SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized at load), through the offline
API (issue 12's targets on the 2-core CPU: load in under 10 s, at least 30 tok/s for one request).

    python benchmarks/bench_default_model_cpu.py [--out docs/bench/default_model_cpu.json] [--threads 1,2]
        [--dtypes auto,float32] [--max-tokens 128] [--repeats 5] [--device cuda]

Load: ``LLM()`` (the GGUF from the installed package or the cache: header, dequantization, model, tokenizer,
KV cache) timed in a fresh process per repetition, after ``import torch`` (timed separately); median of
``--load-repeats``. Generation: one chat request (a ShareGPT prompt, greedy, ``--max-tokens`` output tokens,
EOS ignored) after one warm-up run, ``--repeats`` times per (threads, dtype); tok/s = output tokens / wall time of
``generate`` (prefill included) and decode-only tok/s from the stream's token times; medians reported. The load
average at the start of each measurement is recorded: on a shared machine other processes' load slows every
number (and intra-op threads > 1 suffer most).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from _common import commit, write_json  # noqa: E402  (puts the repository on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAREGPT = os.path.join(ROOT, "..", "shared", "data", "sharegpt_v3_filtered_500.json")
if not os.path.isfile(SHAREGPT):  # a worktree beside the shared folder's parent
    SHAREGPT = os.path.join(ROOT, "..", "..", "shared", "data", "sharegpt_v3_filtered_500.json")
PROMPT = "Explain how a bicycle works, in a few sentences."


def child_load(threads: int, device: str) -> dict:
    """One load in this (fresh) process: import time, then LLM() time (on a GPU: with graph capture)."""
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(threads)
    t1 = time.perf_counter()
    from dispatcher import LLM

    llm = LLM(max_num_seqs=4, device=device, enforce_eager=device == "cpu")
    t2 = time.perf_counter()
    assert llm.tokenizer is not None
    return {"import_s": round(t1 - t0, 3), "load_s": round(t2 - t1, 3)}


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def prompt_text() -> str:
    try:
        with open(SHAREGPT, encoding="utf-8") as fh:
            data = json.load(fh)
        return next(c["value"] for d in data for c in d["conversations"] if 40 < len(c["value"]) < 200)
    except OSError:
        return PROMPT


def bench_generation(threads: int, dtype_name: str, max_tokens: int, repeats: int, device: str) -> dict:
    import torch

    from dispatcher import LLM, SamplingParams

    torch.set_num_threads(threads)
    dtype = None if dtype_name == "auto" else getattr(torch, dtype_name)  # auto: models.loader.default_dtype
    llm = LLM(max_num_seqs=4, device=device, enforce_eager=device == "cpu", dtype=dtype)
    dtype_name = str(llm.engine.worker.model.embed_tokens.weight.dtype).removeprefix("torch.") + (
        " (default)" if dtype is None else "")
    messages = [{"role": "user", "content": prompt_text()}]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.chat(messages, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    prompt_ids = llm.tokenizer.encode_chat(messages)
    runs, decode = [], []
    text = ""
    start_load = load_average()
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = llm.chat(messages, params)[0].outputs[0]
        runs.append(len(out.token_ids) / (time.perf_counter() - t0))
        times = []
        for _chunk in llm.stream({"prompt_token_ids": prompt_ids}, params):
            times.append(time.perf_counter())
        decode.append((len(times) - 1) / (times[-1] - times[0]))
        text = out.text
    model = llm.engine.worker.model
    # every decode step reads each weight matrix once (the tied embedding as the LM head; the lookup is one row),
    # 4-bit projections as their packed codes and scales (buffers of models.int4.Int4Linear)
    streamed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.dim() == 2
                   and (n != "embed_tokens.weight" or model.lm_head is None))
    streamed += sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                    if n.endswith(".packed") or n.endswith(".scale_zero"))
    decode_median = statistics.median(decode)
    return {"threads": threads, "dtype": dtype_name, "prompt_tokens": len(prompt_ids), "output_tokens": max_tokens,
            "weight_bytes_per_token": streamed,
            "implied_weight_gb_per_s": round(streamed * decode_median / 1e9, 2),
            "tok_per_s_median": round(statistics.median(runs), 2), "tok_per_s_runs": [round(r, 2) for r in runs],
            "decode_tok_per_s_median": round(decode_median, 2),
            "load_average_at_start": start_load, "sample_text": text[:200]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", default="1,2", help="torch intra-op thread counts to measure")
    ap.add_argument("--dtypes", default="auto,float32",
                    help="serving dtypes to measure (auto: the default, bfloat16 for this 4-bit GGUF on the CPU)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--load-repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu (the target machine) or cuda (bf16, CUDA graphs)")
    ap.add_argument("--child-load", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_load is not None:
        print(json.dumps(child_load(args.child_load, args.device)))
        return 0

    from models.default_model import default_model_path

    path = default_model_path()  # fetched (once) before anything is timed
    threads = [int(t) for t in args.threads.split(",")]
    loads = []
    for _ in range(args.load_repeats):
        before = load_average()
        proc = subprocess.run([sys.executable, __file__, "--child-load", str(threads[0]), "--device", args.device],
                              capture_output=True, text=True, cwd=ROOT, timeout=600)
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            return 1
        loads.append({**json.loads(proc.stdout.strip().splitlines()[-1]), "load_average_at_start": before})
    generation = [bench_generation(t, d, args.max_tokens, args.repeats, args.device)
                  for d in args.dtypes.split(",") for t in threads]
    load_s = statistics.median(r["load_s"] for r in loads)
    # The default: the default dtype at torch's default thread count (one per core), or the most threads measured
    defaults = [g for g in generation if g["dtype"].endswith("(default)")] or generation
    default = next((g for g in defaults if g["threads"] == os.cpu_count()), max(defaults, key=lambda g: g["threads"]))
    best = max(generation, key=lambda g: g["tok_per_s_median"])
    result = {
        "commit": commit(), "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                        "python": platform.python_version()},
        "device": args.device, "model": os.path.basename(path), "model_bytes": os.path.getsize(path),
        "load": {"median_load_s": load_s, "target_s": 10.0, "meets_target": load_s < 10.0, "runs": loads},
        "generation": generation,
        "summary": {"default_dtype": default["dtype"], "default_tok_per_s": default["tok_per_s_median"],
                    "default_decode_tok_per_s": default["decode_tok_per_s_median"], "best": {k: best[k] for k in (
            "threads", "dtype", "tok_per_s_median")}, "target_tok_per_s": 30.0,
            "meets_target": default["tok_per_s_median"] >= 30.0},
    }
    write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("load", "summary")}, indent=2))
    for g in generation:
        print(f"threads {g['threads']} {g['dtype']}: {g['tok_per_s_median']} tok/s (decode "
              f"{g['decode_tok_per_s_median']}; {g['weight_bytes_per_token'] / 1e6:.0f} MB of weights a token = "
              f"{g['implied_weight_gb_per_s']} GB/s), load average {g['load_average_at_start']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
