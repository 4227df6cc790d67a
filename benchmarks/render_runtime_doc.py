"""Render docs/runtime.md from docs/bench/runtime_h200.json, moe_h200.json and profile_step_h200.json (the GPU
benchmarks' outputs).

    python benchmarks/render_runtime_doc.py
"""

from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str) -> dict | None:
    path = os.path.join(ROOT, "docs/bench", name)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _moe_section(m: dict) -> list[str]:
    tiles = list(m["models"][0]["rows"][0]["triton_us"])
    out = ["## One MoE layer: grouped GEMM vs the Triton path", "",
           f"`{m['command']}` (commit {m.get('commit', '?')}): {m['method']}. Triton tile shapes are named by the "
           "gate/up GEMM's output columns (n) and reduction step (k); the tile height comes from "
           "`models.fused_moe.tiles_for`. The path and shapes the runtime uses (`MAX_TOKENS`, `tiles_for`) were "
           "chosen from this table.", "",
           "| model | tokens | grouped µs | " + " | ".join(tiles) + " | best / grouped |",
           "|---|---|---|" + "---|" * len(tiles) + "---|"]
    for model in m["models"]:
        for r in model["rows"]:
            out.append(f"| {model['model']} | {r['tokens']} | {r['grouped_us']:.1f} | "
                       + " | ".join(f"{r['triton_us'][t]:.1f}" for t in tiles) + f" | {r['best_over_grouped']:.2f} |")
    return out + [""]


def _profile_section(p: dict) -> list[str]:
    out = [f"## Where a step's time goes ({p['model']}, `python benchmarks/profile_step.py`, commit "
           f"{p.get('commit', '?')})", "",
           f"Graphs captured with programmatic dependent launch: {p.get('pdl', False)}; the last column's were captured "
           "without it, in the same run.", "",
           "| FULL q = 1, requests | kernels | per layer | kernel sum ms | replay ms | graph alone ms | replay / kernel "
           "sum | replay ms without PDL |",
           "|---|---|---|---|---|---|---|---|"]
    for r in p["full"]:
        out.append(f"| {r['num_reqs']} | {r['kernels']} | {r['kernels_per_layer']} | {r['kernel_sum_ms']:.3f} | "
                   f"{r['replay_ms']:.3f} | {r['graph_only_ms']:.3f} | {r['replay_ms'] / r['kernel_sum_ms']:.3f} | "
                   f"{r.get('replay_ms_without_pdl', '-')} |")
    out += ["", "| PIECEWISE tokens | host ms per step | inputs | piece replays | attention launches | GPU ms per step |",
            "|---|---|---|---|---|---|"]
    for r in p["piecewise"]:
        out.append(f"| {r['tokens']} | {r['step_host_ms']:.3f} | {r['load_inputs_host_ms']:.3f} | "
                   f"{r['piece_replays_host_ms']:.3f} | {r['attention_launches_host_ms']:.3f} | {r['step_gpu_ms']:.3f} |")
    return out + ["", "Kernel names and times per row are in `docs/bench/profile_step_h200.json`.", ""]


def _longer_contexts(m: dict) -> list[str]:
    """The replay-only rows at longer contexts (bench_runtime_gpu.py --contexts), where attention shows."""
    rows = [r for r in m["steps"] if "eager_ms" not in r]
    if not rows:
        return []
    out = [f"Replay over longer contexts (tokens cached before the step; the block table is "
           f"{m.get('block_table_tokens', '?')} tokens wide for every row of this model, the first table's too):", "",
           "| kind | q | size | tokens | context | replay ms | at the first context | ratio |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = r["q"] if r["q"] is not None else "-"
        out.append(f"| {r['kind']} | {q} | {r['size']} | {r['tokens']} | {r['context']} | {r['replay_ms']:.2f} | "
                   f"{r['replay_ms_at_first_context']:.2f} | {r['over_first_context']:.2f} |")
    return out + [""]


def main() -> None:
    d = _load("runtime_h200.json")
    out = ["# Graph runtime on one H200", "",
           f"Measured on one {d['device']}, torch {d['torch']}, bf16, random weights, with `bash scripts/gpu_check.sh "
           "bench` (it runs `PYTHONPATH=.:benchmarks python3 benchmarks/bench_runtime_gpu.py --out "
           "$OUT/runtime_h200.json`); full numbers in `docs/bench/runtime_h200.json`, this page by "
           "`python benchmarks/render_runtime_doc.py`." + (f" Measured at commit {d['commit']}." if d.get("commit") else "")
           + f" Graphs captured with programmatic dependent launch (PDL): {d.get('pdl', False)}.",
           "",
           "Method: " + d["method"] + ". Every batch is decode-shaped (requests of q tokens over a "
           f"{d.get('contexts', [64])[0]}-token context; PIECEWISE rows are requests of 8 tokens), so attention stays "
           "small in the main tables, as in SPEC section 1 (the longer-context tables show it). Eager runs the "
           "forward unpadded, one launch per kernel; replay runs the captured graph (PIECEWISE: the pieces with eager "
           "attention between them, so its small sizes stay sensitive to host speed). Eager and replay of a row come "
           "from the same run. Eager times are host-bound and vary by up to 2x between rows on this VM.", ""]
    for m in d["models"]:
        out += [f"## {m['model']}", "",
                "| kind | q | size | tokens | eager ms | replay ms | eager / replay | kernels | kernel sum ms "
                "| replay / kernel sum | gap µs per kernel |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in m["steps"]:
            if "eager_ms" not in r:
                continue
            q = r["q"] if r["q"] is not None else "-"
            out.append(f"| {r['kind']} | {q} | {r['size']} | {r['tokens']} | {r['eager_ms']:.2f} | {r['replay_ms']:.2f} "
                       f"| {r['speedup']:.2f} | {r.get('kernels', '-')} | {r['kernel_sum_ms']:.2f} | "
                       f"{r['replay_over_kernel_sum']:.3f} | {r.get('gap_us_per_kernel', '-')} |")
        out.append("")
        out += _longer_contexts(m)
    p = d["default_plan_capture"]
    out += [f"## Capturing the sm100 default plan ({p['model']}: {p['plan']})", "",
            "| kind | q | graphs | seconds | measured GiB | of it, pool GiB | estimated GiB | estimate samples GiB "
            "(largest, per graph, per graph in the pool) |",
            "|---|---|---|---|---|---|---|---|"]
    for k in p["kinds"]:
        q = k["q"] if k["q"] is not None else "-"
        samples = ", ".join(f"{x:.4f}" for x in k["estimate_samples_gib"])
        pool = f"{k['pool_gib']:.3f}" if k.get("pool_gib") is not None else "-"
        out.append(f"| {k['kind']} | {q} | {k['graphs']} | {k['seconds']:.2f} | {k['measured_gib']:.3f} | {pool} | "
                   f"{k['estimated_gib']:.3f} | {samples} |")
    out += ["", f"{sum(k['graphs'] for k in p['kinds'])} graphs captured in {p['capture_seconds']:.1f} s (the estimate "
            f"took {p['estimate_seconds']:.1f} s more); measured {p['measured_gib']:.3f} GiB, estimated "
            f"{p['estimated_gib']:.3f} GiB ({p['estimate_error'] * 100:+.1f}%); static buffers "
            f"{p['static_buffers_gib']:.3f} GiB. Memory per size, as captured: `size_growth_gib` in the JSON.", ""]
    moe, prof = _load("moe_h200.json"), _load("profile_step_h200.json")
    if moe:
        out += _moe_section(moe)
    if prof:
        out += _profile_section(prof)
    with open(os.path.join(ROOT, "docs/runtime.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(out))


if __name__ == "__main__":
    main()
