"""Offline engine throughput on the GPU (issue 11): EngineCore end to end, per capture policy, workload and
concurrency, with the per-step bound measured in the same run.

Workload: bench-moe (random weights, bf16), ShareGPT prompts (their lengths: characters / 4 tokens, random ids), 256
output tokens each with EOS ignored; ``--repeats`` waves of ``concurrency`` requests per row (the same prompts each
time; at small concurrencies enough waves for ``--min-requests``, except eager: ``--repeats``), after a warm-up wave
of 8; a row is the median wave by output tok/s, every wave's tok/s beside it. Every policy's engine is built
(captured) once per workload, real and fixed acceptance run on the same captures, and the policies' waves alternate (A
B B A ...), so that a drift of the host's speed during the run reaches every policy alike: at small batches a step
waits on the host, and separate runs of identical graphs differed by up to 25% (``tok_s_ratio_paired`` takes each
ratio within one such pair). (Engines for four policies at 1024 requests need about 30 GB of KV cache each.)
Policies (``--compilation-config`` each, every other limit equal: 1024 seqs, 16384 batched tokens):
  eager         graphs off
  vllm-default  the shared token list at vLLM's default cap for Hopper (max_cudagraph_capture_size 512)
  legacy-1024   the shared token list to 1024
  separate      this project's separate grids (sm100 defaults)
Workloads: no-sd; eagle3-k3 and eagle3-k7 (random-weight heads: real acceptance is near 0), and with fixed
acceptance (``--fixed-acceptance 3.0``: a seeded draw makes the mean acceptance length 3.0, labelled fixed-3.0).

Per row: output tok/s (tokens over wall time), steps, GPU busy (the steps' device time, CUDA events around each
step's work, over wall time), host ms per step (scheduling and dispatch), blocking waits per step, and
``bound_ratio``: the same workload's summed step device times under vllm-default over this policy's. The scheduler
does not depend on the graphs, so every policy runs the same steps: that ratio is what the graphs alone would give
if the host cost nothing, and output tok/s ratios are judged against it (issue 11: at least 90% of it).

    PYTHONPATH=. python benchmarks/bench_engine_gpu.py --data .gpu_data/sharegpt.json --out $OUT/engine_h200.json
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import shlex
import statistics
import sys
import time
import warnings

import torch

from _common import commit, write_json  # (importing _common puts the repository on sys.path)
from dispatcher.engine.engine_core import EngineArgs, EngineCore
from dispatcher.engine.workload import approx_num_tokens, load_sharegpt
from dispatcher.plan.config import resolve
from models.config import preset
from scheduler.request import SamplingParams

POLICIES = {
    "eager": {"cudagraph_mode": "NONE"},
    "vllm-default": {"max_cudagraph_capture_size": 512},
    "legacy-1024": {"max_cudagraph_capture_size": 1024},
    "separate": {},
}
WORKLOADS = {"no-sd": 0, "eagle3-k3": 3, "eagle3-k7": 7}
OUTPUT_LEN = 256
BLOCK = 16


def prompt_lengths(path: str | None, n: int, seed: int = 0) -> list[int]:
    if path:
        texts = load_sharegpt(path)
        random.Random(seed).shuffle(texts)
        return [min(approx_num_tokens(texts[i % len(texts)]), 2048) for i in range(n)]
    rng = random.Random(seed)
    return [max(1, min(2048, int(rng.lognormvariate(4.3, 0.9)))) for _ in range(n)]


def make_engine(policy: str, k: int, fixed: float | None, lengths: list[int], step_trace: str | None = None,
                max_model_len: int | None = None) -> EngineCore:
    """An engine with KV blocks for the widest wave (every request's prompt, output, drafts and lookahead);
    ``max_model_len`` defaults to the longest prompt plus the output (it sets the block table's width)."""
    spec = {"method": "eagle3", "num_speculative_tokens": k} if k else None
    cfg = resolve(POLICIES[policy], spec, platform="sm100", max_num_seqs=1024, max_num_batched_tokens=16384)
    blocks = sum(-(-(n + OUTPUT_LEN + 2 * (k + 1)) // BLOCK) for n in lengths) + 64
    max_len = max_model_len or max(lengths) + OUTPUT_LEN
    return EngineCore(cfg, EngineArgs(preset("bench-moe"), device="cuda", num_kv_blocks=blocks, block_size=BLOCK,
                                      max_model_len=max_len, fixed_acceptance=fixed, step_trace=step_trace),
                      progress=False)


def run_wave(engine: EngineCore, lengths: list[int], vocab: int, seed: int, k: int) -> dict:
    """One wave of len(lengths) requests to completion. Implicit synchronizations (.item(), .cpu(), pageable copies,
    ...) are counted with torch's sync debug mode; each step also waits once for its result, by design."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    params = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True)
    engine.stats = type(engine.stats)()
    spec = engine.scheduler.stats
    verified0, accepted0 = spec.drafts_verified, spec.drafts_accepted
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            t0 = time.perf_counter()
            outputs = engine.generate(prompts, params)
            wall = time.perf_counter() - t0
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    implicit = len(syncs)
    where = collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in syncs)
    s = engine.stats
    tokens = sum(len(o) for o in outputs)
    verify_rows = (spec.drafts_verified - verified0) / k if k else 0
    return {"output_tok_s": round(tokens / wall, 1), "output_tokens": tokens, "wall_s": round(wall, 3),
            "steps": s.steps, "device_ms": round(s.device_ms, 1), "gpu_busy": round(s.device_ms / 1e3 / wall, 3),
            "host_ms_per_step": round(s.host_ms / max(1, s.steps), 3),
            "syncs_per_step": round((s.steps + implicit) / max(1, s.steps), 3),
            "implicit_syncs": dict(where.most_common(5)),  # where they happen (file:line of the Python caller)
            "eager_steps": s.eager_steps, "padded_tokens": s.padded_tokens,
            "mean_acceptance_length": round(1 + (spec.drafts_accepted - accepted0) / verify_rows, 3)
            if verify_rows else None}


def add_ratios(rows: list[dict]) -> None:
    """Each row against vllm-default's row of the same workload, acceptance and concurrency: ``bound_ratio`` (summed
    step device time, theirs over ours), ``tok_s_ratio`` (median waves' output tok/s) and ``tok_s_ratio_paired``
    (the median over repetitions of the two policies' waves run back to back: a host drifting over the run moves
    both waves of a pair alike, which matters at 1 and 16 requests, where a step waits on the host)."""
    by_key = {(r["workload"], r["acceptance"], r["concurrency"], r["policy"]): r for r in rows}
    for r in rows:
        base = by_key.get((r["workload"], r["acceptance"], r["concurrency"], "vllm-default"))
        if base:
            r["bound_ratio"] = round(base["device_ms"] / r["device_ms"], 3) if r["device_ms"] else None
            r["tok_s_ratio"] = round(r["output_tok_s"] / base["output_tok_s"], 3)
            pairs = [a / b for a, b in zip(r["waves_tok_s"], base["waves_tok_s"]) if b]
            r["tok_s_ratio_paired"] = round(statistics.median(pairs), 3) if pairs else None


def main() -> None:
    parser = argparse.ArgumentParser(description="offline engine throughput per policy, workload and concurrency")
    parser.add_argument("--data", default=None, help="ShareGPT JSON (prompt lengths); default: lognormal lengths")
    parser.add_argument("--out", default=None)
    parser.add_argument("--policies", default="eager,vllm-default,legacy-1024,separate")
    parser.add_argument("--workloads", default="no-sd,eagle3-k3,eagle3-k7")
    parser.add_argument("--acceptance", default="real,fixed", help="real and/or fixed (K > 0 only)")
    parser.add_argument("--fixed-acceptance", type=float, default=3.0)
    parser.add_argument("--concurrency", default="1,16,64,256,512,1024")
    parser.add_argument("--repeats", type=int, default=3, help="waves per row; the row is the median wave")
    parser.add_argument("--min-requests", type=int, default=16, help="requests per row at least: small concurrencies "
                        "run more waves (a one-request wave lasts a third of a second)")
    parser.add_argument("--step-trace-dir", default=None,
                        help="write each engine's step trace here (WORKLOAD-POLICY.jsonl: every acceptance and wave)")
    args = parser.parse_args()
    if args.step_trace_dir:
        os.makedirs(args.step_trace_dir, exist_ok=True)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    policies = args.policies.split(",")
    lengths = prompt_lengths(args.data, max(concurrencies))
    result = {"command": "PYTHONPATH=. " + shlex.join(["python", "benchmarks/bench_engine_gpu.py", *sys.argv[1:]]),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
              "model": "bench-moe", "output_len": OUTPUT_LEN,
              "prompt_tokens_mean": round(statistics.mean(lengths), 1), "rows": []}
    vocab = preset("bench-moe").vocab_size
    for workload in args.workloads.split(","):
        k = WORKLOADS[workload]
        engines, capture_s = {}, {}
        for policy in policies:  # every policy's engine at once, so that their waves can alternate
            t0 = time.perf_counter()
            trace = os.path.join(args.step_trace_dir, f"{workload}-{policy}.jsonl") if args.step_trace_dir else None
            engines[policy] = make_engine(policy, k, None, lengths, trace)
            capture_s[policy] = time.perf_counter() - t0
            run_wave(engines[policy], lengths[:8], vocab, 99, k)  # warm-up: compiles the eager kernels too
        for acceptance in (args.acceptance.split(",") if k else ["real"]):
            fixed = args.fixed_acceptance if acceptance == "fixed" else None
            label = f"fixed-{fixed}" if fixed else "real"
            for engine in engines.values():  # after the graphs: the same captures serve both
                engine.worker.set_fixed_acceptance(fixed)
            for conc in concurrencies:
                waves: dict[str, list[dict]] = {policy: [] for policy in policies}
                for rep in range(max(args.repeats, -(-args.min_requests // conc))):
                    for policy in policies if rep % 2 == 0 else policies[::-1]:  # ABBA: drift cancels
                        if policy == "eager" and rep >= args.repeats:
                            continue  # far from every threshold, and its one-request waves last seconds
                        waves[policy].append(run_wave(engines[policy], lengths[:conc], vocab, conc, k))
                for policy in policies:
                    ranked = sorted(waves[policy], key=lambda w: w["output_tok_s"])
                    row = {"policy": policy, "workload": workload, "acceptance": label, "concurrency": conc,
                           "capture_s": round(capture_s[policy], 1), **ranked[len(ranked) // 2],
                           "waves_tok_s": [w["output_tok_s"] for w in waves[policy]]}
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
                add_ratios(result["rows"])
                write_json(args.out, result)  # after every concurrency: a run cut short keeps what it measured
        del engines
        gc.collect()
        torch.cuda.empty_cache()
    print(f"{'workload':10s} {'accept':9s} {'conc':>5s} {'policy':13s} {'tok/s':>9s} {'busy':>5s} "
          f"{'host ms':>7s} {'eager':>5s} {'vs vllm':>7s} {'paired':>6s} {'bound':>6s}")
    for r in result["rows"]:
        print(f"{r['workload']:10s} {r['acceptance']:9s} {r['concurrency']:5d} {r['policy']:13s} "
              f"{r['output_tok_s']:9.0f} {r['gpu_busy']:5.2f} {r['host_ms_per_step']:7.2f} {r['eager_steps']:5d} "
              f"{r.get('tok_s_ratio', 0):7.2f} {r.get('tok_s_ratio_paired') or 0:6.2f} "
              f"{r.get('bound_ratio') or 0:6.2f}")


if __name__ == "__main__":
    main()
