"""Where one step's time goes on the GPU (a diagnostic for the runtime's targets, not a benchmark table):

- FULL decode at q = 1 for a few request counts: the CUDA kernels of one padded step in order (name, microseconds;
  profiled eagerly without programmatic dependent launch), their count per layer, and replay time against their
  sum, for graphs captured with PDL and, side by side in the same run, without it.
- PIECEWISE at a few token counts: host time of one replayed step (no synchronization) split into input
  staging, graph replays and eager attention launches, against the step's GPU time.

    PYTHONPATH=. python benchmarks/profile_step.py [--model bench-moe] [--out $OUT/profile_step.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from _common import commit, write_json
from bench_runtime_gpu import BLOCK, CTX, decode_host, time_steps
from dispatcher.plan.dispatch import BatchDescriptor, GraphKey
from dispatcher.plan.capture_plan import FULL_DECODE, PIECEWISE, GraphSet
from dispatcher.runtime.graphs import GraphRuntime, StepInputs
from models.attention import allocate_kv_cache
from models.config import preset
from models.fused import pdl_available, programmatic_launch
from models.transformer import build_model

FULL_REQS = (1, 8, 64)
PW_TOKENS = (1, 64, 512)


def kernels_of(fn) -> list[tuple[str, float]]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evts = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    evts.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in evts]


def host_ms(fn, reps: int = 30) -> float:
    """Median host time of fn without waiting for the GPU (synchronized before each call)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bench-moe")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cfg = preset(args.model)
    model = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    blocks_per_req = -(-(CTX + 8) // BLOCK)
    kv = allocate_kv_cache(cfg.num_layers, 64 * blocks_per_req, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                           torch.bfloat16, "cuda")
    sets = [GraphSet("target", PIECEWISE, None, PW_TOKENS), GraphSet("target", FULL_DECODE, 1, FULL_REQS)]
    import numpy as np

    table = np.arange(64 * blocks_per_req).reshape(64, blocks_per_req)
    r, c = np.nonzero(np.ones_like(table))

    def runtime(sets):
        rt = GraphRuntime(model, kv, sets, max_num_tokens=max(PW_TOKENS), max_num_reqs=64,
                          max_blocks_per_seq=blocks_per_req)
        rt.update_block_table(r, c, table[r, c])
        rt.capture(progress=False, estimate=False)
        return rt

    pdl = pdl_available(torch.device("cuda"))
    result = {"model": args.model, "device": torch.cuda.get_device_name(), "commit": commit(), "pdl": pdl,
              "full": [], "piecewise": []}
    with torch.inference_mode():
        rt = runtime(sets)
        with programmatic_launch(False):
            rt_plain = runtime([s for s in sets if s.kind == FULL_DECODE])
        for n in FULL_REQS:
            host = StepInputs.from_host(decode_host(n, 1, blocks_per_req), "cuda")
            desc = BatchDescriptor("FULL", "bench", n, n, 1, GraphKey(FULL_DECODE, 1, n))
            piece = rt.graphs[desc.graph][0]
            with programmatic_launch(False):
                kern = kernels_of(lambda: (rt.load_inputs(host, *rt.layouts[desc.graph]), piece.fn()))
            replay = time_steps(lambda: rt.execute(desc, host))
            only_graph = time_steps(piece.replay)
            replay_plain = time_steps(lambda: rt_plain.execute(desc, host))
            names = Counter(name for name, _ in kern)
            ksum = sum(us for _, us in kern) / 1e3
            row = {"num_reqs": n, "kernels": len(kern), "kernels_per_layer": round(len(kern) / cfg.num_layers, 1),
                   "kernel_sum_ms": round(ksum, 3), "replay_ms": round(replay, 3),
                   "graph_only_ms": round(only_graph, 3), "replay_ms_without_pdl": round(replay_plain, 3),
                   "by_name_us": {k: round(sum(us for nm, us in kern if nm == k), 1) for k in names},
                   "count_by_name": dict(names)}
            result["full"].append(row)
            print(f"FULL q=1 n={n}: {len(kern)} kernels ({len(kern) / cfg.num_layers:.1f}/layer), sum {ksum:.3f} ms, "
                  f"replay {replay:.3f} ms (graph alone {only_graph:.3f}), ratio {replay / ksum:.3f}; captured "
                  f"without PDL: replay {replay_plain:.3f} ms, ratio {replay_plain / ksum:.3f} (PDL available: {pdl})")
            for k, cnt in names.most_common():
                print(f"    {cnt:4d} x {sum(us for nm, us in kern if nm == k) / cnt:7.2f} us  {k[:110]}")
        for t in PW_TOKENS:
            nreq = -(-t // 8)
            host = StepInputs.from_host(decode_host(nreq, min(t, 8), blocks_per_req)[:, :t], "cuda")
            desc = BatchDescriptor("PIECEWISE", "bench", t, nreq, 8, GraphKey(PIECEWISE, None, t))
            pieces = rt.graphs[desc.graph]
            attention = rt._attention_runner(t, None, rt.load_inputs(host, t))
            step_host = host_ms(lambda: rt.execute(desc, host))
            load = host_ms(lambda: rt.load_inputs(host, t))
            replays = host_ms(lambda: [p.replay() for p in pieces])
            attn = host_ms(lambda: [attention(i) for i in range(cfg.num_layers)])
            gpu = time_steps(lambda: rt.execute(desc, host))
            row = {"tokens": t, "step_host_ms": round(step_host, 3), "load_inputs_host_ms": round(load, 3),
                   "piece_replays_host_ms": round(replays, 3), "attention_launches_host_ms": round(attn, 3),
                   "step_gpu_ms": round(gpu, 3), "pieces": len(pieces)}
            result["piecewise"].append(row)
            print(f"PIECEWISE {t} tokens: host {step_host:.3f} ms (inputs {load:.3f}, {len(pieces)} replays "
                  f"{replays:.3f}, {cfg.num_layers} attention launches {attn:.3f}); timed step {gpu:.3f} ms")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
