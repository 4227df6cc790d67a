"""bf16 ``F.linear`` against the FP8 GEMM paths at bench-dense's projection shapes (Llama-3.2-1B: qkv, o, gate_up,
down), 256 and 1024 rows: ``torch._scaled_mm`` with row-wise scales (per-token activation scales, per-channel weight
scales: what ``--quantization fp8`` runs for qkv and gate_up), with per-tensor scales (cuBLASLt's FP8 path: o and
down run it with unit scales, ``Fp8Linear.scale_out``), the per-token activation quantization alone, and
``fp8_unit_then_scale`` (the tensor-wise GEMM with unit scales, then the per-token and per-channel scales multiplied
in by two torch ops); then the kernels before a projection, the norm and the SiLU-and-multiply, alone, followed by
the quantization, and quantizing in their own kernels, and the norm applying an FP8 projection's scales
(``norm_scaled``) (``measure_producers``). Each is timed as a CUDA graph of 20 calls replayed 50 times, the median
of 5, in us a call. GPU only.

    PYTHONPATH=. python benchmarks/bench_fp8_gemm_gpu.py --out docs/bench/fp8_gemm_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from models.fp8 import quantize_per_channel, quantize_rows

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
"""bench-dense's projections, (out, in)."""
ROWS = (256, 1024)
CALLS_PER_GRAPH, REPLAYS, REPEATS = 20, 50, 5


def timed_us(fn) -> float:
    """us a call of ``fn``: CALLS_PER_GRAPH calls captured in one graph (after three eager ones on a side stream),
    replayed REPLAYS times; the median of REPEATS."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (REPLAYS * CALLS_PER_GRAPH) * 1e3)
    return round(statistics.median(times), 2)


def measure(num_rows: int, out_features: int, in_features: int) -> dict[str, float]:
    x = torch.randn(num_rows, in_features, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
    wq, ws = (t.cuda() for t in quantize_per_channel(w.float()))
    xq, xs = quantize_rows(x)
    one = torch.ones(1, device="cuda")
    return {
        "bf16": timed_us(lambda: torch.nn.functional.linear(x, w)),
        "fp8_rowwise": timed_us(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1),
                                                         out_dtype=torch.bfloat16)),
        "fp8_tensor": timed_us(lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                        out_dtype=torch.bfloat16)),
        "quant_rows": timed_us(lambda: quantize_rows(x)),
        "fp8_unit_then_scale": timed_us(lambda: unit_then_scale(xq, xs, wq, ws, one)),
    }


HIDDEN, INTERMEDIATE = 2048, 8192
"""bench-dense's widths: the norms' and the down projection's input."""
ACT_LAUNCHES = ((1024, 4), (2048, 8), (4096, 8), (8192, 16))
"""``act_mul_quant``'s (block, num_warps) choices timed."""


def measure_producers(num_rows: int) -> dict[str, float]:
    """The kernels before a per-channel FP8 projection: the norm (with the residual add) and the SiLU-and-multiply,
    each alone (what bf16 runs), followed by the per-token quantization (the two steps), and quantizing in its own
    kernel (``rms_norm_quant``, ``act_mul_quant`` at each of ACT_LAUNCHES)."""
    from models.fp8 import act_mul_quant, rms_norm_quant
    from models.fused import rms_norm, silu_mul

    x = torch.randn(num_rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5
    h = torch.randn(num_rows, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
    scales = (torch.rand(num_rows, 1, device="cuda") * 1e-3, torch.rand(HIDDEN, device="cuda") * 0.02)
    us = {"norm": timed_us(lambda: rms_norm(x, w, 1e-5, res)),
          "norm_scaled": timed_us(lambda: rms_norm(x, w, 1e-5, res, scales)),
          "norm_then_quant": timed_us(lambda: quantize_rows(rms_norm(x, w, 1e-5, res)[0])),
          "norm_quant": timed_us(lambda: rms_norm_quant(x, w, 1e-5, res)),
          "act": timed_us(lambda: silu_mul(h)),
          "act_then_quant": timed_us(lambda: quantize_rows(silu_mul(h)))}
    for block, warps in ACT_LAUNCHES:
        us[f"act_quant_{block}_{warps}w"] = timed_us(lambda b=block, nw=warps: act_mul_quant(h, block=b, num_warps=nw))
    return us


def unit_then_scale(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                    one: torch.Tensor) -> torch.Tensor:
    """The per-token x per-channel product as cuBLASLt's tensor-wise FP8 GEMM with unit scales (bf16 out: |values|
    up to 448^2 x K fit), then the per-token and the per-channel scales, two multiplies: whether scaling after a
    fast GEMM (an epilogue a consumer kernel could take over) beats the row-wise GEMM at these shapes."""
    y = torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return y.mul_(xs).mul_(ws.view(1, -1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for num_rows in ROWS:
        total: dict[str, float] = {}
        for name, (n, k) in SHAPES.items():
            us = measure(num_rows, n, k)
            print(num_rows, name, us, flush=True)
            rows.append({"rows": num_rows, "projection": name, "out_in": [n, k], "us": us})
            for path, v in us.items():
                total[path] = total.get(path, 0.0) + v
        total = {path: round(v, 1) for path, v in total.items()}
        print(num_rows, "sum us", total, flush=True)
        rows.append({"rows": num_rows, "projection": "sum", "us": total})
        producers = measure_producers(num_rows)
        print(num_rows, "producers us", producers, flush=True)
        rows.append({"rows": num_rows, "projection": "producers", "us": producers})
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"command": "PYTHONPATH=. python benchmarks/bench_fp8_gemm_gpu.py",
                       "commit": os.environ.get("TWOGRID_COMMIT"), "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
