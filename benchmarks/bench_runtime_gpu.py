"""GPU benchmark of the graph runtime on one H200 (issue 3):

1. Step time, eager vs replay, for PIECEWISE sizes 1..8192 tokens and FULL decode 1..1024 requests at q = 1, 4,
   8, on bench-moe and bench-moe-large (bf16, random weights). Every batch is decode-shaped: requests of q
   tokens over a 64-token context (PIECEWISE: q = 8), so attention stays small, as in SPEC section 1.
   Eager runs the forward unpadded; replay runs the captured graph (PIECEWISE: pieces plus eager attention).
   Each: 5 warm-up runs, then the median of 15 repetitions of 10 back-to-back steps timed with CUDA events.
2. Kernel sum: one eager run of the same padded closures under torch.profiler, without programmatic dependent
   launch (so that no kernel's time includes waiting for the one before); the sum of its CUDA kernel
   durations against the replay time (launch gaps gone when replay is within 10% of it; the graphs use PDL
   where the GPU has it, ``pdl`` in the JSON), and the gap that is left per kernel (microseconds: the GPU's own
   latency between dependent graph nodes, when the host keeps up).
   The kernels of a profiled replay are recorded too (a cross-check: the same kernels, timed inside the graph).
3. Longer contexts (``--contexts``, default 64,512,2048: every context past the first): the same FULL decode and
   PIECEWISE cases over 512- and 2048-token contexts, replay only (the median of 15 x 10 steps), where attention
   is no longer free; cases whose requests x context exceed LONG_CONTEXT_TOKENS are left out (their KV would not
   fit beside the graphs). The block table is as wide as the longest context, for every row (a server's
   max_model_len), so the attention kernel's split choice is the same at every context.
4. Capture of the sm100 default plan (1024 requests, 16384 tokens: 39 PIECEWISE + 64 FULL at q = 1) on
   bench-moe: seconds and pool GiB per kind, estimate vs measured.

    PYTHONPATH=. python benchmarks/bench_runtime_gpu.py --out $OUT/runtime_h200.json [--contexts 64,512,2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from _common import commit, write_json  # (importing _common puts the repository on sys.path)
from dispatcher.plan.config import resolve
from dispatcher.plan.dispatch import BatchDescriptor, GraphKey
from dispatcher.plan.capture_plan import FULL_DECODE, PIECEWISE, GraphSet, build_plan
from dispatcher.runtime.graphs import GraphRuntime, StepInputs
from models.attention import allocate_kv_cache
from models.config import preset
from models.fused import pdl_available, programmatic_launch
from models.transformer import build_model

BLOCK = 16
CTX = 64
PW_SIZES = (1, 8, 64, 256, 512, 1024, 2048, 4096, 8192)
DECODE_REQS = (1, 8, 64, 256, 512, 1024)
DECODE_Q = (1, 4, 8)
LONG_CONTEXT_TOKENS = 600_000
"""Longer-context rows run while requests x (context + q) stays within this (about 28 GiB of bench-moe KV)."""


def decode_host(num_reqs: int, q: int, blocks_per_req: int, ctx: int = CTX) -> np.ndarray:
    """Requests 0..num_reqs - 1 (block-table rows), each at q tokens after ctx cached ones, request r's blocks
    r * blocks_per_req onward."""
    positions = (np.arange(q)[None, :] + ctx).repeat(num_reqs, 0).ravel()
    reqs = np.repeat(np.arange(num_reqs), q)
    slots = (reqs * blocks_per_req + positions // BLOCK) * BLOCK + positions % BLOCK
    ids = np.random.default_rng(0).integers(3, 30000, size=num_reqs * q)
    return np.stack([ids, positions, slots, reqs]).astype(np.int64)


def time_steps(fn, reps: int = 15, inner: int = 10, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def kernel_sum_ms(fn) -> tuple[float, int]:
    """(sum of the CUDA kernel and copy durations of one run of fn, their count), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    durations = [evt.time_range.elapsed_us() for evt in prof.events()
                 if evt.device_type == torch.autograd.DeviceType.CUDA]
    return sum(durations) / 1e3, len(durations)


def blocks_for(ctx: int) -> int:
    return -(-(ctx + 8) // BLOCK)


def fits(num_reqs: int, ctx: int) -> bool:
    return num_reqs * (ctx + 8) <= LONG_CONTEXT_TOKENS


def bench_model(name: str, contexts: tuple[int, ...] = (CTX,)) -> dict:
    cfg = preset(name)
    t0 = time.perf_counter()
    model = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    build_s = time.perf_counter() - t0
    max_reqs = 1024
    width = max(blocks_for(ctx) for ctx in contexts)
    cases = [(PIECEWISE, None, t, -(-t // 8), min(t, 8)) for t in PW_SIZES]
    cases += [(FULL_DECODE, q, n, n, q) for q in DECODE_Q for n in DECODE_REQS if n * q <= 8192]
    num_blocks = max(max(n for *_, n, _ in cases if ctx == contexts[0] or fits(n, ctx)) * blocks_for(ctx)
                     for ctx in contexts)
    kv = allocate_kv_cache(cfg.num_layers, num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
    rows = []
    sets = [GraphSet("target", PIECEWISE, None, PW_SIZES)] + [
        GraphSet("target", FULL_DECODE, q, tuple(n for n in DECODE_REQS if n * q <= 8192)) for q in DECODE_Q]
    rt = GraphRuntime(model, kv, sets, max_num_tokens=8192, max_num_reqs=max_reqs, max_blocks_per_seq=width)
    blocks_per_req = blocks_for(contexts[0])
    set_table(rt, min(max_reqs, num_blocks // blocks_per_req), blocks_per_req)
    with torch.inference_mode():
        t0 = time.perf_counter()
        rt.capture(progress=False, estimate=False)
        capture_s = time.perf_counter() - t0
        for kind, q, size, num_reqs, qlen in cases:
            tokens = size * q if kind == FULL_DECODE else size
            host = StepInputs.from_host(decode_host(num_reqs, qlen, blocks_per_req)[:, :tokens], "cuda")
            mode = "FULL" if kind == FULL_DECODE else "PIECEWISE"
            desc = BatchDescriptor(mode, "bench", tokens, num_reqs, q, GraphKey(kind, q, size))
            eager = BatchDescriptor("NONE", "bench", tokens, num_reqs, q, None)
            eager_ms = time_steps(lambda: rt.execute(eager, host))
            replay_ms = time_steps(lambda: rt.execute(desc, host))
            pieces = rt.graphs[desc.graph]
            saved = [p.graph for p in pieces]

            def static_run():
                for p in pieces:
                    p.graph = None
                try:
                    rt.execute(desc, host)
                finally:
                    for p, g in zip(pieces, saved):
                        p.graph = g

            with programmatic_launch(False):
                ksum, nkern = kernel_sum_ms(static_run)
            replay_ksum, replay_nkern = kernel_sum_ms(lambda: rt.execute(desc, host))
            gap_us = (replay_ms - ksum) * 1e3 / nkern
            rows.append({"kind": kind, "q": q, "size": size, "tokens": tokens, "context": contexts[0],
                         "eager_ms": round(eager_ms, 3),
                         "replay_ms": round(replay_ms, 3), "speedup": round(eager_ms / replay_ms, 2),
                         "kernel_sum_ms": round(ksum, 3), "kernels": nkern,
                         "replay_over_kernel_sum": round(replay_ms / ksum, 3), "gap_us_per_kernel": round(gap_us, 2),
                         "replay_profiled_kernel_sum_ms": round(replay_ksum, 3),
                         "replay_profiled_kernels": replay_nkern})
            print(f"{name:16s} {kind:12s} q={q!s:4s} size={size:5d} tokens={tokens:5d} eager {eager_ms:8.3f} ms "
                  f"replay {replay_ms:8.3f} ms x{eager_ms / replay_ms:5.2f} kernels {ksum:8.3f} ms "
                  f"({nkern}, gap {gap_us:.2f} us each; in replay {replay_ksum:.3f} ms, {replay_nkern})", flush=True)
        rows += long_context_rows(name, rt, cases, contexts, num_blocks, rows)
    del rt, kv, model
    torch.cuda.empty_cache()
    return {"model": name, "build_seconds": round(build_s, 1), "bench_capture_seconds": round(capture_s, 1),
            "block_table_tokens": width * BLOCK, "steps": rows}


def set_table(rt: GraphRuntime, num_reqs: int, blocks_per_req: int) -> None:
    """Block-table row r: blocks r * blocks_per_req onward (as ``decode_host`` writes its slots)."""
    table = np.arange(num_reqs * blocks_per_req).reshape(num_reqs, blocks_per_req)
    r, c = np.nonzero(np.ones_like(table))
    rt.update_block_table(r, c, table[r, c])


def long_context_rows(name: str, rt: GraphRuntime, cases: list, contexts: tuple[int, ...], num_blocks: int,
                      first_rows: list[dict]) -> list[dict]:
    """Replay times of the cases at every context past the first (the cases that fit LONG_CONTEXT_TOKENS), beside
    the same case's replay at the first context."""
    at_first = {(r["kind"], r["q"], r["size"]): r["replay_ms"] for r in first_rows}
    rows = []
    for ctx in contexts[1:]:
        blocks_per_req = blocks_for(ctx)
        set_table(rt, min(rt.max_num_reqs, num_blocks // blocks_per_req), blocks_per_req)
        for kind, q, size, num_reqs, qlen in cases:
            if not fits(num_reqs, ctx):
                continue
            tokens = size * q if kind == FULL_DECODE else size
            host = StepInputs.from_host(decode_host(num_reqs, qlen, blocks_per_req, ctx)[:, :tokens], "cuda")
            mode = "FULL" if kind == FULL_DECODE else "PIECEWISE"
            desc = BatchDescriptor(mode, "bench", tokens, num_reqs, q, GraphKey(kind, q, size))
            replay_ms = time_steps(lambda: rt.execute(desc, host))
            base = at_first[(kind, q, size)]
            rows.append({"kind": kind, "q": q, "size": size, "tokens": tokens, "context": ctx,
                         "replay_ms": round(replay_ms, 3), "replay_ms_at_first_context": base,
                         "over_first_context": round(replay_ms / base, 2)})
            print(f"{name:16s} {kind:12s} q={q!s:4s} size={size:5d} tokens={tokens:5d} context={ctx:5d} replay "
                  f"{replay_ms:8.3f} ms (x{replay_ms / base:5.2f} the {contexts[0]}-token context)", flush=True)
    return rows


def bench_default_plan(name: str = "bench-moe") -> dict:
    """Capture the sm100 default plan (no SD): 39 PIECEWISE + 64 FULL decode at q = 1."""
    cfg_model = preset(name)
    cfg = resolve({}, None, platform="sm100", max_num_seqs=1024, max_num_batched_tokens=16384)
    plan = build_plan(cfg)
    model = build_model(cfg_model, "cuda", torch.bfloat16, seed=0)
    kv = allocate_kv_cache(cfg_model.num_layers, 4096, BLOCK, cfg_model.num_kv_heads, cfg_model.head_dim,
                           torch.bfloat16, "cuda")
    rt = GraphRuntime(model, kv, plan.for_runner("target"), max_num_tokens=16384, max_num_reqs=1024,
                      max_blocks_per_seq=128)
    t0 = time.perf_counter()
    report = rt.capture(progress=True, estimate=True, trace_memory=True)
    wall = time.perf_counter() - t0
    kinds = [{"kind": k.kind, "q": k.q, "graphs": k.graphs, "seconds": round(k.seconds, 2),
              "measured_gib": round(k.measured_gib, 4),
              "estimated_gib": round(k.estimated_gib, 4) if k.estimated_gib is not None else None,
              "estimate_samples_gib": [round(x, 4) for x in k.estimate_samples_gib],
              "pool_gib": round(k.pool_gib, 4) if k.pool_gib is not None else None,
              "size_growth_gib": [round(x, 5) for x in k.size_growth_gib]} for k in report.kinds]
    out = {"model": name, "plan": "sm100 defaults, 1024 seqs, 16384 tokens, no SD; capture seconds include a "
           "free-memory reading after every size (size_growth_gib)", "kinds": kinds,
           "capture_seconds": round(report.seconds, 2), "estimate_seconds": round(report.estimate_seconds, 2),
           "wall_seconds_with_estimate": round(wall, 2), "measured_gib": round(report.measured_gib, 4),
           "estimated_gib": round(report.estimated_gib, 4),
           "estimate_error": round(report.estimated_gib / report.measured_gib - 1, 4) if report.measured_gib else None,
           "static_buffers_gib": round(report.buffers_gib, 4)}
    print(out, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="graph runtime on the GPU")
    parser.add_argument("--out", default=None)
    parser.add_argument("--models", default="bench-moe,bench-moe-large")
    parser.add_argument("--skip-plan", action="store_true")
    parser.add_argument("--contexts", default="64,512,2048",
                        help="tokens cached before the step: full rows at the first context, replay rows at the rest")
    args = parser.parse_args()
    contexts = tuple(int(c) for c in args.contexts.split(","))
    result = {
        "command": "PYTHONPATH=. python benchmarks/bench_runtime_gpu.py --out $OUT/runtime_h200.json",
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
        "method": f"decode-shaped batches over a {contexts[0]}-token context (replay rows also at "
                  f"{list(contexts[1:])}); median of 15 x 10 steps after 5 warm-ups (CUDA events); kernel sum from one "
                  "profiled eager run of the same padded closures, without PDL",
        "contexts": list(contexts),
        "pdl": pdl_available(torch.device("cuda")),
    }
    if not args.skip_plan:
        result["default_plan_capture"] = bench_default_plan()
        write_json(args.out, result)
    result["models"] = []
    for name in args.models.split(","):
        result["models"].append(bench_model(name, contexts))
        write_json(args.out, result)


if __name__ == "__main__":
    main()
