"""GPU benchmark of paged attention and the logits GEMM at serving shapes (issue 10), on one H200.

1. Decode, for the bench-moe and bench-moe-large head shapes (models/config.py PRESETS): one layer's attention call
   at 1 request x 8192 tokens (q = 1), 16 x 4096 (q = 8), 64 x 1024 (q = 8), 256 x 512 (q = 8), 256 x 2048
   (q = 4) and 1024 x 512 (q = 1). ``context`` is each request's sequence length, its q new tokens included (their
   K and V already in the cache). The layout is paged like the server's: blocks of 16 tokens, each request's blocks
   a random permutation of the cache's, the per-request metadata packed as a FULL decode graph packs it. Timed as
   CUDA-graph replays: one graph calls the kernel once per KV copy, over several copies of the cache (at least
   ROTATION_BYTES in all, more than the 50 MB L2 holds), so that every call reads its K and V from HBM; ms per call
   is the median replay over the calls it makes. ``kv_gb``: K and V read once (requests x context x KV heads x
   head_dim x 2 x 2 bytes); ``bw_fraction``: kv_gb over ms against 4.8 TB/s. ``ms_before``: the kernel before
   issue 10 (benchmarks/baseline_attention.py), same layout, same run. The outputs of the two kernels are compared.
2. Prefill: a chunk of 2048 new tokens over 6144 cached ones (one request), paged, the same way, beside torch's
   ``scaled_dot_product_attention`` on the flash backend over the same shape laid out contiguously (K and V
   expanded to every query head; causal aligned to the end, i.e. chunked prefill), same rotation. TFLOP/s count the
   causal work: 4 x heads x head_dim x (q x cached + q (q + 1) / 2).
3. Logits: the bench-moe LM head GEMM at 2048 rows x hidden 1024 over 49,155 columns and over 49,216 (padded),
   side by side, the model's ``compute_logits`` (padded GEMM, sliced), and the float32 conversion the old path paid.
4. ``--sweep``: per decode shape, the new kernel at forced split counts and a few tile shapes (ms each), for
   tuning ``models/triton_attention.py``'s constants; per prefill shape a few tile shapes.

The rows of ``rows`` carry exactly the fields model, kind, requests, context, q, ms, ms_before, kv_gb, bw_fraction,
sdpa_ms; ``details`` (same order) adds the launch (tiles, splits), TFLOP/s and the check against the old kernel.

    PYTHONPATH=.:benchmarks python benchmarks/bench_attention_gpu.py --out $OUT/attention_h200.json [--sweep]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import numpy as np
import torch

from _common import commit, write_json  # (importing _common puts the repository on sys.path)
from baseline_attention import prepare_baseline_attention
from models.attention import prepare_paged_attention
from models.attention_metadata import AttentionMetadata
from models.config import preset
from models.transformer import build_model
from models.triton_attention import AttentionTiles, plan_launch, sm_count

HBM_GBPS = 4800.0
BF16_DENSE_TFLOPS = 989.0
"""The H200's dense bf16 tensor-core peak (no sparsity)."""
DEVICE = "cuda"
DTYPE = torch.bfloat16
BLOCK = 16
ROTATION_BYTES = 256 << 20
"""Each timed graph cycles through at least this much K and V (at least 2 copies), over 5x the H200's L2."""
MAX_COPIES = 32
DECODE = ((1, 8192, 1), (16, 4096, 8), (64, 1024, 8), (256, 512, 8), (256, 2048, 4), (1024, 512, 1))
"""(requests, context, q)."""
PREFILL = (2048, 6144)
"""(new tokens, cached tokens) of one request's prefill chunk."""
MODELS = ("bench-moe", "bench-moe-large")
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64)
SWEEP_DECODE_TILES = ((64, 4, 2), (32, 4, 3), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 3))
"""(block_n, num_warps, num_stages); block_m stays the automatic one (the query x the group)."""
SWEEP_PREFILL_TILES = ((64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2))
"""(block_m, block_n, num_warps, num_stages)."""


def graph_ms(calls: list[Callable[[], None]], reps: int = 20, warmup: int = 3) -> float:
    """Median ms of one call, from replays of one CUDA graph that makes every call in turn (after an eager warm-up
    that compiles the kernels)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return statistics.median(times)


def copies_for(nbytes: int) -> int:
    return min(MAX_COPIES, max(2, -(-ROTATION_BYTES // nbytes)))


class Layout:
    """One step's paged attention inputs: caches of the same shape to rotate through, a random block table as wide as
    the context (so the split choice sees the context as its bound, as a graph of a server whose max_model_len is
    the context would), the metadata packed as a FULL graph of exactly these requests packs it, and the query."""

    def __init__(self, name: str, num_reqs: int, context: int, q_len: int, seed: int):
        cfg = preset(name)
        self.heads, self.kv_heads, self.dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_reqs, self.context, self.q_len = num_reqs, context, q_len
        blocks_per_req = -(-context // BLOCK)
        num_blocks = num_reqs * blocks_per_req
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        table = torch.randperm(num_blocks, device=DEVICE, generator=gen).view(num_reqs, blocks_per_req).int()
        pos = np.tile(np.arange(context - q_len, context), num_reqs)
        req = np.repeat(np.arange(num_reqs), q_len)
        tokens = num_reqs * q_len
        slots = torch.full((tokens,), -1, device=DEVICE)
        self.meta = AttentionMetadata.from_tokens(slots, torch.from_numpy(req).to(DEVICE),
                                                  torch.from_numpy(pos).to(DEVICE), table, num_reqs, q_len)
        shape = (2, num_blocks + 1, BLOCK, self.kv_heads, self.dim)
        self.kv_bytes = 2 * num_reqs * context * self.kv_heads * self.dim * 2  # K and V, bf16, read once
        self.kv = [torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_(generator=gen)
                   for _ in range(copies_for(self.kv_bytes))]
        self.q = torch.empty(tokens, self.heads, self.dim, dtype=DTYPE, device=DEVICE).normal_(generator=gen)
        self.scale = self.dim ** -0.5

    def time(self, prepare, **options) -> tuple[float, torch.Tensor]:
        out = torch.empty_like(self.q)
        run = prepare(self.q, self.kv[0], self.meta, self.scale, out, **options)
        ms = graph_ms([lambda cache=cache: run(cache) for cache in self.kv])
        return ms, out  # out: the last copy's

    def launch(self, **options):
        return plan_launch(self.q.shape[0], self.heads, self.kv_heads, self.dim, self.num_reqs, self.q_len,
                           self.meta.block_table.shape[1] * BLOCK, sm_count(self.q.device), **options)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def causal_flops(heads: int, dim: int, q_len: int, cached: int) -> float:
    return 4.0 * heads * dim * (q_len * cached + q_len * (q_len + 1) / 2)


def sdpa_prefill_ms(heads: int, dim: int, q_len: int, context: int, seed: int) -> tuple[float, str]:
    """torch's SDPA on the flash backend, K and V contiguous (1, heads, context, dim), causal aligned to the end."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.empty(1, heads, q_len, dim, dtype=DTYPE, device=DEVICE).normal_(generator=gen)
    nbytes = 2 * heads * context * dim * 2
    kvs = [(torch.empty(1, heads, context, dim, dtype=DTYPE, device=DEVICE).normal_(generator=gen),
            torch.empty(1, heads, context, dim, dtype=DTYPE, device=DEVICE).normal_(generator=gen))
           for _ in range(copies_for(nbytes))]
    mask = causal_lower_right(q_len, context)

    def call(k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    ms = graph_ms([lambda k=k, v=v: call(k, v) for k, v in kvs])
    return ms, "flash (torch.nn.attention.bias.causal_lower_right)"


def bench_decode(name: str, num_reqs: int, context: int, q_len: int, sweep: bool) -> tuple[dict, dict, list[dict]]:
    layout = Layout(name, num_reqs, context, q_len, seed=num_reqs + context)
    ms, out = layout.time(prepare_paged_attention)
    ms_before, out_before = layout.time(prepare_baseline_attention)
    kv_gb = layout.kv_bytes / 1e9
    launch = layout.launch()
    row = {"model": name, "kind": "decode", "requests": num_reqs, "context": context, "q": q_len,
           "ms": round(ms, 4), "ms_before": round(ms_before, 4), "kv_gb": round(kv_gb, 4),
           "bw_fraction": round(kv_gb / ms / HBM_GBPS * 1e3, 4), "sdpa_ms": None}
    detail = {"tiles": launch.tiles._asdict(), "splits": launch.splits, "grid": [launch.grid0, layout.kv_heads,
                                                                                launch.splits],
              "kv_copies": len(layout.kv), "bw_fraction_before": round(kv_gb / ms_before / HBM_GBPS * 1e3, 4),
              "speedup": round(ms_before / ms, 2), "rel_diff_vs_before": round(rel_diff(out, out_before), 5)}
    sweeps = []
    if sweep:
        for splits in SWEEP_SPLITS:
            t, o = layout.time(prepare_paged_attention, num_kv_splits=splits)
            sweeps.append({"model": name, "kind": "decode", "requests": num_reqs, "context": context, "q": q_len,
                           "splits": splits, "tiles": launch.tiles._asdict(), "ms": round(t, 4),
                           "rel_diff": round(rel_diff(o, out_before), 5)})
        for block_n, warps, stages in SWEEP_DECODE_TILES:
            tiles = AttentionTiles(launch.tiles.block_m, block_n, warps, stages)
            t, o = layout.time(prepare_paged_attention, tiles=tiles)
            sweeps.append({"model": name, "kind": "decode", "requests": num_reqs, "context": context, "q": q_len,
                           "splits": layout.launch(tiles=tiles).splits, "tiles": tiles._asdict(), "ms": round(t, 4),
                           "rel_diff": round(rel_diff(o, out_before), 5)})
    del layout
    torch.cuda.empty_cache()
    return row, detail, sweeps


def bench_prefill(name: str, sweep: bool) -> tuple[dict, dict, list[dict]]:
    new, cached = PREFILL
    context = new + cached
    layout = Layout(name, 1, context, new, seed=7)
    ms, out = layout.time(prepare_paged_attention)
    ms_before, out_before = layout.time(prepare_baseline_attention)
    sdpa_ms, backend = sdpa_prefill_ms(layout.heads, layout.dim, new, context, seed=8)
    flops = causal_flops(layout.heads, layout.dim, new, cached)
    kv_gb = layout.kv_bytes / 1e9
    launch = layout.launch()
    row = {"model": name, "kind": "prefill", "requests": 1, "context": context, "q": new, "ms": round(ms, 4),
           "ms_before": round(ms_before, 4), "kv_gb": round(kv_gb, 4),
           "bw_fraction": round(kv_gb / ms / HBM_GBPS * 1e3, 4), "sdpa_ms": round(sdpa_ms, 4)}
    detail = {"tiles": launch.tiles._asdict(), "splits": launch.splits, "grid": [launch.grid0, layout.kv_heads,
                                                                                launch.splits],
              "kv_copies": len(layout.kv), "tflops": round(flops / ms / 1e9, 1),
              "tflops_before": round(flops / ms_before / 1e9, 1), "sdpa_tflops": round(flops / sdpa_ms / 1e9, 1),
              "over_sdpa": round(ms / sdpa_ms, 3), "sdpa_backend": backend, "speedup": round(ms_before / ms, 2),
              "rel_diff_vs_before": round(rel_diff(out, out_before), 5)}
    sweeps = []
    if sweep:
        for block_m, block_n, warps, stages in SWEEP_PREFILL_TILES:
            tiles = AttentionTiles(block_m, block_n, warps, stages)
            for splits in (1, 2):
                t, o = layout.time(prepare_paged_attention, tiles=tiles, num_kv_splits=splits)
                sweeps.append({"model": name, "kind": "prefill", "requests": 1, "context": context, "q": new,
                               "splits": splits, "tiles": tiles._asdict(), "ms": round(t, 4),
                               "tflops": round(flops / t / 1e9, 1), "rel_diff": round(rel_diff(o, out_before), 5)})
    del layout
    torch.cuda.empty_cache()
    return row, detail, sweeps


def bench_logits(rows: int = 2048) -> dict:
    """bench-moe's LM head: the GEMM over the logical vocabulary and over the padded one, side by side; the model's
    compute_logits (the padded GEMM, sliced to the vocabulary); the float32 conversion the old path added."""
    cfg = preset("bench-moe")
    model = build_model(cfg.with_(num_layers=1), DEVICE, DTYPE, seed=0)
    padded = model.embed_tokens.weight
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    hidden = torch.empty(rows, cfg.hidden_size, dtype=DTYPE, device=DEVICE).normal_(generator=gen)
    unpadded = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=DTYPE, device=DEVICE).normal_(
        generator=gen)
    copies = 4  # calls a graph, the same for all four (the 100 MB weight does not fit the L2 anyway)
    ms_unpadded = graph_ms([lambda: hidden @ unpadded.t()] * copies)
    ms_padded = graph_ms([lambda: hidden @ padded.t()] * copies)
    ms_model = graph_ms([lambda: model.compute_logits(hidden)] * copies)
    logits = hidden @ unpadded.t()
    ms_float = graph_ms([lambda: logits.float()] * copies)
    flops = 2.0 * rows * cfg.hidden_size * cfg.vocab_size
    return {"rows": rows, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "padded_vocab": padded.shape[0],
            "ms_unpadded": round(ms_unpadded, 4), "ms_padded": round(ms_padded, 4),
            "ms_compute_logits": round(ms_model, 4), "ms_float32_conversion": round(ms_float, 4),
            "tflops_unpadded": round(flops / ms_unpadded / 1e9, 1),
            "tflops_compute_logits": round(flops / ms_model / 1e9, 1),
            "compute_logits_fraction_of_peak": round(flops / ms_model / 1e9 / BF16_DENSE_TFLOPS, 3),
            "compute_logits_over_padded_gemm": round(ms_model / ms_padded, 3),
            "unpadded_over_compute_logits": round(ms_unpadded / ms_model, 2)}


def print_table(result: dict) -> None:
    print("\nmodel            kind     reqs  context   q        ms  ms_before  speedup  bw_frac  sdpa_ms")
    for r, d in zip(result["rows"], result["details"]):
        sdpa = f"{r['sdpa_ms']:8.4f}" if r["sdpa_ms"] is not None else "       -"
        print(f"{r['model']:16s} {r['kind']:8s} {r['requests']:4d} {r['context']:8d} {r['q']:3d} {r['ms']:9.4f} "
              f"{r['ms_before']:10.4f} {d['speedup']:7.2f}x {r['bw_fraction']:8.3f} {sdpa}")
    lg = result.get("logits")
    if lg:
        print(f"logits {lg['rows']} x {lg['hidden']}: vocab {lg['vocab']} {lg['ms_unpadded']:.4f} ms, padded "
              f"{lg['padded_vocab']} {lg['ms_padded']:.4f} ms, compute_logits {lg['ms_compute_logits']:.4f} ms "
              f"({lg['tflops_compute_logits']} TFLOP/s, {lg['compute_logits_fraction_of_peak']:.0%} of peak); "
              f"float32 conversion {lg['ms_float32_conversion']:.4f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description="paged attention and logits on the GPU")
    parser.add_argument("--out", default=None)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--sweep", action="store_true", help="also time forced split counts and tile shapes")
    args = parser.parse_args()
    import triton

    result = {"command": "PYTHONPATH=.:benchmarks python benchmarks/bench_attention_gpu.py --out "
                         "$OUT/attention_h200.json" + (" --sweep" if args.sweep else ""),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": commit(), "hbm_gbps": HBM_GBPS, "block_size": BLOCK,
              "method": "one layer's attention call as CUDA-graph replays over rotated KV copies (at least "
                        f"{ROTATION_BYTES >> 20} MiB a graph), median of 20 replays after 3; kv_gb = K and V read "
                        "once; bw_fraction = kv_gb / ms / 4.8 TB/s; ms_before = the pre-issue-10 kernel, same run",
              "rows": [], "details": [], "sweep": []}
    with torch.inference_mode():
        for name in args.models.split(","):
            for num_reqs, context, q_len in DECODE:
                row, detail, sweeps = bench_decode(name, num_reqs, context, q_len, args.sweep)
                result["rows"].append(row)
                result["details"].append(detail)
                result["sweep"] += sweeps
                print(row, detail, flush=True)
                write_json(args.out, result)
            row, detail, sweeps = bench_prefill(name, args.sweep)
            result["rows"].append(row)
            result["details"].append(detail)
            result["sweep"] += sweeps
            print(row, detail, flush=True)
            write_json(args.out, result)
        result["logits"] = bench_logits()
        print(result["logits"], flush=True)
    write_json(args.out, result)
    print_table(result)


if __name__ == "__main__":
    main()
