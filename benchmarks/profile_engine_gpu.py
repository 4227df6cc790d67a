"""Where a decode step's GPU time goes through EngineCore (issue 10's end-to-end check): bench-moe, separate grids,
eagle3 K = 7 with fixed acceptance 3.0, 256 requests with ShareGPT prompt lengths, 256 output tokens. After the
prefills, a window of steady decode steps runs under torch.profiler; every CUDA kernel's time is summed by what it
does: paged attention (the attention and split-merge kernels, inside the graphs), the target's logits and the
drafter's (the GEMMs under the ``twogrid.logits`` / ``twogrid.draft_logits`` ranges), everything else.

    PYTHONPATH=. python benchmarks/profile_engine_gpu.py --data .gpu_data/sharegpt.json --out $OUT/profile_engine.json
"""

from __future__ import annotations

import argparse
import json
import gc
import random
import shlex
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from _common import commit, write_json  # (importing _common puts the repository on sys.path)
from bench_engine_gpu import OUTPUT_LEN, make_engine, prompt_lengths
from models import triton_attention
from models.config import preset
from scheduler.request import SamplingParams

ATTENTION_KERNELS = ("_paged_attention_kernel", "_merge_splits_kernel")
DEFAULT_MAX_KV_SPLITS = triton_attention.MAX_KV_SPLITS


def graph_split(prof) -> dict:
    """How much kernel time ran inside CUDA-graph replays: in the exported trace, a kernel's ``correlation`` is
    the id of the runtime call that launched it, and a replayed kernel's is its ``cudaGraphLaunch``'s."""
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        prof.export_chrome_trace(fh.name)
        with open(fh.name, encoding="utf-8") as trace:
            events = json.load(trace)["traceEvents"]
    launches = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e["name"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    in_graph, outside = 0.0, {}
    for k in kernels:
        launcher = launches.get(k.get("args", {}).get("correlation"), "?")
        if launcher.startswith("cudaGraphLaunch"):
            in_graph += k["dur"]
        else:
            outside[k["name"]] = outside.get(k["name"], 0.0) + k["dur"]
    total = in_graph + sum(outside.values())
    return {"in_graph_share": round(in_graph / total, 4) if total else None,
            "outside_graph_share": round(1 - in_graph / total, 4) if total else None,
            "outside_graph_top_us": sorted(((n, round(us, 1)) for n, us in outside.items()), key=lambda x: -x[1])[:12]}


def profile_run(args, policy: str, max_kv_splits: int | None) -> dict:
    """One engine: warm steps, then ``args.steps`` steps under the profiler; kernel time per step by kind."""
    triton_attention.MAX_KV_SPLITS = max_kv_splits or DEFAULT_MAX_KV_SPLITS
    lengths = prompt_lengths(args.data, args.concurrency)
    engine = make_engine(policy, args.k, 3.0 if args.k else None, lengths, max_model_len=args.max_model_len)
    vocab = preset("bench-moe").vocab_size
    rng = random.Random(0)
    for n in lengths:
        engine.add_request([rng.randrange(3, vocab) for _ in range(n)],
                           SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True))
    steps = engine.run()
    for _ in zip(range(args.warm_steps), steps):
        pass
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        num_steps = sum(1 for _ in zip(range(args.steps), steps))  # fewer if the requests finish first
        torch.cuda.synchronize()
    for _ in steps:
        pass
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith("twogrid.")]  # (the engine's record_function ranges are not kernels)
    total_us = sum(k.time_range.elapsed_us() for k in kernels)
    attention_us = sum(k.time_range.elapsed_us() for k in kernels if k.name.startswith(ATTENTION_KERNELS))

    def range_us(name: str) -> float:
        return sum(e.device_time_total for e in events if e.name == name)

    logits_us, draft_logits_us = range_us("twogrid.logits"), range_us("twogrid.draft_logits")
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        by_name.setdefault(k.name, []).append(k.time_range.elapsed_us())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:args.top]
    first, last = min(k.time_range.start for k in kernels), max(k.time_range.end for k in kernels)
    if not num_steps:
        raise SystemExit(f"{policy}: the requests finished within the {args.warm_steps} warm-up steps; "
                         "lower --warm-steps or raise --concurrency")
    max_model_len = engine.args.max_model_len
    del engine, steps
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "policy": policy, "max_model_len": max_model_len, "max_kv_splits": max_kv_splits,
        "steps": num_steps,
        "gpu_ms_per_step": round(total_us / 1e3 / num_steps, 3),
        "span_ms_per_step": round((last - first) / 1e3 / num_steps, 3),
        "kernels_per_step": round(len(kernels) / num_steps, 1),
        "attention_share": round(attention_us / total_us, 4),
        "logits_share": round(logits_us / total_us, 4),
        "draft_logits_share": round(draft_logits_us / total_us, 4),
        # (name, ms a step, launches a step)
        "top_kernels_ms_per_step": [(name[:90], round(sum(us) / 1e3 / num_steps, 4), round(len(us) / num_steps, 1))
                                    for name, us in top],
        **graph_split(prof),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--policy", default="separate",
                        help="one policy or a comma-separated list, profiled in turn (each its own engine)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engines' max_model_len (the block table's width); default: longest prompt + output")
    parser.add_argument("--max-kv-splits", default="0",
                        help="comma-separated caps on attention's context splits, one engine each per policy "
                             "(0: the default cap)")
    parser.add_argument("--warm-steps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    runs = [profile_run(args, policy, int(cap) or None)
            for policy in args.policy.split(",") for cap in args.max_kv_splits.split(",")]
    result = {
        "command": "PYTHONPATH=. python benchmarks/profile_engine_gpu.py " + shlex.join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
        "model": "bench-moe", "workload": f"eagle3-k{args.k}" if args.k else "no-sd",
        "acceptance": "fixed-3.0" if args.k else "real", "concurrency": args.concurrency,
        **(runs[0] if len(runs) == 1 else {"runs": runs}),
    }
    write_json(args.out, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
