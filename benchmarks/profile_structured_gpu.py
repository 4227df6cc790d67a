"""Where a constrained decode step's extra device time goes (issue 31): bench-moe with SmolLM2's tokenizer in one
process (EngineCore, no server), ``--concurrency`` requests with ShareGPT prompt lengths, temperature 0.8, 256 output
tokens with EOS ignored, no speculative decoding; the same wave plain and with a JSON schema on every request
(``--schema``, OpenAI's ``response_format`` body as ``bench_sampling_gpu.py --extra-body`` takes it). Per mode:
the fused uniform decodes' device time (median, from the step trace: what the server's traces show), then a window
of steady decode steps under torch.profiler, every kernel and copy summed by name per step.

    PYTHONPATH=. python benchmarks/profile_structured_gpu.py --data .gpu_data/sharegpt.json \\
        --tokenizer .gpu_data/smollm2-tokenizer --schema "$(cat schema.json)" --out $OUT/profile_structured.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shlex
import sys
import tempfile

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from _common import commit, write_json  # (importing _common puts the repository on sys.path)
from bench_engine_gpu import BLOCK, OUTPUT_LEN, prompt_lengths
from dispatcher.engine.engine_core import EngineArgs, EngineCore
from dispatcher.plan.config import resolve
from models.config import preset
from scheduler.request import SamplingParams
from scheduler.structured import StructuredOutputsParams


def profile_mode(args, schema: str | None, lengths: list[int]) -> dict:
    """One engine, one wave: ``args.warm_steps`` steps, then ``args.steps`` under the profiler, then the rest."""
    cfg = resolve({}, None, platform="sm100", max_num_seqs=1024, max_num_batched_tokens=16384)
    blocks = sum(-(-(n + OUTPUT_LEN + 4) // BLOCK) for n in lengths) + 64
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.jsonl")
        engine = EngineCore(cfg, EngineArgs(preset(args.model), device=args.device, num_kv_blocks=blocks,
                                            block_size=BLOCK, max_model_len=max(lengths) + OUTPUT_LEN,
                                            tokenizer=args.tokenizer, step_trace=trace), progress=False)
        vocab = engine.model_config.vocab_size
        rng = random.Random(0)
        so = StructuredOutputsParams(json=schema) if schema else None
        for i, n in enumerate(lengths):
            engine.add_request([rng.randrange(3, vocab) for _ in range(n)],
                               SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True, temperature=0.8, seed=i,
                                              structured_outputs=so))
        steps = engine.run()
        for _ in zip(range(args.warm_steps), steps):
            pass
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        sync()
        with profile(activities=[ProfilerActivity.CUDA if args.device == "cuda" else ProfilerActivity.CPU]) as prof:
            num_steps = sum(1 for _ in zip(range(args.steps), steps))
            sync()
        for _ in steps:
            pass
        engine.trace.close()
        with open(trace, encoding="utf-8") as fh:
            records = [json.loads(line) for line in fh]
    decodes = [r for r in records if r.get("fused") and r["kind"] == "uniform_decode"
               and r["requests"] >= len(lengths) * 3 // 4]
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("twogrid.") \
                or args.device == "cpu" and e.name.startswith("aten::"):
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    total_us = sum(sum(v) for v in by_name.values())
    del engine, steps, prof
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {
        "mode": "json_schema" if schema else "plain",
        "fused_decodes": len(decodes),
        "constrained_decodes": sum(1 for r in decodes if r.get("constrained")),
        "device_ms_p50": round(float(np.median([r["device_ms"] for r in decodes])), 4) if decodes else None,
        "period_ms_p50": round(float(np.median([r["period_ms"] for r in decodes if "period_ms" in r])), 4)
        if any("period_ms" in r for r in decodes) else None,
        "profiled_steps": num_steps,
        "gpu_ms_per_step": round(total_us / 1e3 / max(num_steps, 1), 4),
        # (name, ms a step, launches a step)
        "top_ms_per_step": [(name[:90], round(sum(us) / 1e3 / max(num_steps, 1), 4), round(len(us) / num_steps, 1))
                            for name, us in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:args.top]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="a constrained decode step's device time, kernel by kernel")
    parser.add_argument("--data", default=None, help="ShareGPT JSON (prompt lengths)")
    parser.add_argument("--tokenizer", required=True, help="SmolLM2's tokenizer (the grammar's vocabulary)")
    parser.add_argument("--schema", required=True, metavar="JSON",
                        help="a request body's response_format (as bench_sampling_gpu --extra-body), or a bare schema")
    parser.add_argument("--out", default=None)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--warm-steps", type=int, default=60)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--model", default="bench-moe", help="a preset (a CPU dry run: tiny-dense --device cpu)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    body = json.loads(args.schema)
    schema = body.get("response_format", {}).get("json_schema", {}).get("schema", body)
    lengths = prompt_lengths(args.data, args.concurrency)
    runs = [profile_mode(args, s, lengths) for s in (None, json.dumps(schema))]
    result = {"command": "PYTHONPATH=. python benchmarks/profile_structured_gpu.py " + shlex.join(sys.argv[1:]),
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "commit": commit(), "model": f"{args.model} (random weights) with SmolLM2's tokenizer",
              "concurrency": args.concurrency,
              "runs": runs,
              "constrained_over_plain_device_ms": round(runs[1]["device_ms_p50"] / runs[0]["device_ms_p50"], 4)
              if runs[0]["device_ms_p50"] and runs[1]["device_ms_p50"] else None}
    write_json(args.out, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
