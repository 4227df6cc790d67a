"""Render docs/runtime.md from docs/bench/runtime_h200.json (the GPU benchmark's output).

    python benchmarks/render_runtime_doc.py
"""

from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    with open(os.path.join(ROOT, "docs/bench/runtime_h200.json"), encoding="utf-8") as fh:
        d = json.load(fh)
    out = ["# Graph runtime on one H200", "",
           f"Measured on one {d['device']}, torch {d['torch']}, bf16, random weights, with `bash scripts/gpu_check.sh "
           "bench` (it runs `PYTHONPATH=.:benchmarks python3 benchmarks/bench_runtime_gpu.py --out "
           "$OUT/runtime_h200.json`); full numbers in `docs/bench/runtime_h200.json`, this page by "
           "`python benchmarks/render_runtime_doc.py`." + (f" Measured at commit {d['commit']}." if d.get("commit") else ""),
           "",
           "Method: " + d["method"] + ". Every batch is decode-shaped (requests of q tokens over a 64-token context; "
           "PIECEWISE rows are requests of 8 tokens), so attention stays small, as in SPEC section 1. Eager runs the "
           "forward unpadded, one launch per kernel; replay runs the captured graph (PIECEWISE: the pieces with eager "
           "attention between them, so its small sizes stay sensitive to host speed). Eager and replay of a row come "
           "from the same run. Eager times are host-bound and vary by up to 2x between rows on this VM.", ""]
    for m in d["models"]:
        out += [f"## {m['model']}", "",
                "| kind | q | size | tokens | eager ms | replay ms | eager / replay | kernel sum ms | replay / kernel sum |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in m["steps"]:
            q = r["q"] if r["q"] is not None else "-"
            out.append(f"| {r['kind']} | {q} | {r['size']} | {r['tokens']} | {r['eager_ms']:.2f} | {r['replay_ms']:.2f} "
                       f"| {r['speedup']:.2f} | {r['kernel_sum_ms']:.2f} | {r['replay_over_kernel_sum']:.3f} |")
        out.append("")
    p = d["default_plan_capture"]
    out += [f"## Capturing the sm100 default plan ({p['model']}: {p['plan']})", "",
            "| kind | q | graphs | seconds | measured GiB | estimated GiB | estimate samples GiB (largest, per graph) |",
            "|---|---|---|---|---|---|---|"]
    for k in p["kinds"]:
        q = k["q"] if k["q"] is not None else "-"
        samples = ", ".join(f"{x:.4f}" for x in k["estimate_samples_gib"])
        out.append(f"| {k['kind']} | {q} | {k['graphs']} | {k['seconds']:.2f} | {k['measured_gib']:.3f} | "
                   f"{k['estimated_gib']:.3f} | {samples} |")
    out += ["", f"{sum(k['graphs'] for k in p['kinds'])} graphs captured in {p['capture_seconds']:.1f} s (the estimate "
            f"took {p['estimate_seconds']:.1f} s more); measured {p['measured_gib']:.3f} GiB, estimated "
            f"{p['estimated_gib']:.3f} GiB ({p['estimate_error'] * 100:+.1f}%); static buffers "
            f"{p['static_buffers_gib']:.3f} GiB.", ""]
    with open(os.path.join(ROOT, "docs/runtime.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(out))


if __name__ == "__main__":
    main()
