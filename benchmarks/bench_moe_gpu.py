"""One MoE layer on the GPU: torch's grouped GEMM path against the Triton path (models/fused_moe.py) with a few
tile shapes, per token count, for the bench-moe and bench-moe-large layer shapes. Each variant runs inside a CUDA
graph of 20 layers (router included), so host launches do not count; median of 10 replays after 3 warm-ups. The
output of every Triton variant is checked against the grouped path (bf16 tolerance). This sets
``models.fused_moe.MAX_TOKENS`` and ``tiles_for``.

    PYTHONPATH=. python benchmarks/bench_moe_gpu.py --out $OUT/moe_h200.json
"""

from __future__ import annotations

import argparse
import statistics

import torch

from _common import commit, write_json
from models import fused_moe
from models.config import preset
from models.layers import MoE

TOKENS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TILES = {  # name: (gate_up_n, gate_up_k, down_n, down_k, num_warps, num_stages); block_m from tiles_for
    "n64k64": (64, 64, 64, 64, 4, 3),
    "n32k64": (32, 64, 32, 64, 4, 3),
    "n32k128": (32, 128, 64, 128, 4, 3),
    "n64k128s4": (64, 128, 128, 64, 4, 4),
    "n128k64w8": (128, 64, 128, 64, 8, 3),
    "n32k64w2s4": (32, 64, 64, 64, 2, 4),
}
LAYERS = 20


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAYERS)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--models", default="bench-moe,bench-moe-large")
    args = parser.parse_args()
    result = {"command": "PYTHONPATH=. python benchmarks/bench_moe_gpu.py --out $OUT/moe_h200.json",
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
              "method": f"one MoE layer (router, experts, combine) inside a CUDA graph of {LAYERS} layers; "
                        "median of 10 replays after 3; microseconds per layer", "models": []}
    saved_max = fused_moe.MAX_TOKENS
    for name in args.models.split(","):
        cfg = preset(name)
        torch.manual_seed(0)
        moe = MoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size,
                  cfg.norm_topk_prob).to("cuda", torch.bfloat16).requires_grad_(False)
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
        rows = []
        with torch.inference_mode():
            for t in TOKENS:
                x = torch.randn(t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
                fused_moe.MAX_TOKENS = 0
                grouped = graph_us(lambda: moe(x))
                ref = moe(x).float()
                fused_moe.MAX_TOKENS = saved_max
                base = fused_moe.tiles_for(t, cfg.num_experts_per_token, cfg.num_experts, cfg.hidden_size)
                row = {"tokens": t, "grouped_us": round(grouped, 2), "block_m": base.block_m, "triton_us": {},
                       "max_abs_err": {}}
                for tname, (n1, k1, n2, k2, warps, stages) in TILES.items():
                    tiles = fused_moe.MoETiles(base.block_m, n1, k1, n2, k2, warps, stages)
                    run = lambda: fused_moe.fused_moe(x, moe.gate.weight, moe.w13, moe.w2,  # noqa: E731
                                                      cfg.num_experts_per_token, cfg.norm_topk_prob, tiles)
                    row["triton_us"][tname] = round(graph_us(run), 2)
                    out = fused_moe.fused_moe(x, moe.gate.weight, moe.w13, moe.w2, cfg.num_experts_per_token,
                                              cfg.norm_topk_prob, tiles).float()
                    row["max_abs_err"][tname] = round(float((out - ref).abs().max()), 5)
                best = min(row["triton_us"], key=row["triton_us"].get)
                row["best"], row["best_over_grouped"] = best, round(row["triton_us"][best] / grouped, 3)
                rows.append(row)
                print(f"{name:16s} T={t:5d} grouped {grouped:7.2f} us  " + "  ".join(
                    f"{k} {v:7.2f}" for k, v in row["triton_us"].items()) + f"  best {best} "
                    f"x{row['best_over_grouped']:.2f}  err {max(row['max_abs_err'].values()):.4f}", flush=True)
        result["models"].append({"model": name, "rows": rows})
        write_json(args.out, result)
    fused_moe.MAX_TOKENS = saved_max


if __name__ == "__main__":
    main()
