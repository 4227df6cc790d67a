"""Join engine benchmark runs (benchmarks/bench_engine_gpu.py, one device call each) into one table, and check it
against issue 11's targets.

    python scripts/merge_engine.py docs/bench/engine_parts/*.json --out docs/bench/engine_h200.json

A cell (workload, acceptance, concurrency) keeps every policy's row from one run, so that each ratio is taken
within one run; a later file on the command line that measured the same cell replaces it (a rerun with more
waves), and the replaced rows stay under ``superseded_rows``. Each row names its run (``run``: an index into
``runs``, which keeps every run's command and commit)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

from _common import write_json  # noqa: E402

SHARED = ("device", "model", "output_len")
"""Fields every run must agree on."""


def cell(row: dict) -> tuple:
    return row["workload"], row["acceptance"], row["concurrency"]


def merge(paths: list[str], out: str) -> dict:
    runs, cells, superseded = [], {}, []
    for path in paths:
        with open(path) as fh:
            part = json.load(fh)
        if runs and any(part[k] != runs[0][k] for k in SHARED):
            raise SystemExit(f"{path}: {', '.join(SHARED)} differ from {runs[0]['file']}'s")
        run = len(runs)
        runs.append({"file": os.path.basename(path), "command": part["command"], "commit": part["commit"],
                     **{k: part[k] for k in (*SHARED, "torch", "prompt_tokens_mean")}})
        measured: dict[tuple, list[dict]] = {}
        for row in part["rows"]:
            measured.setdefault(cell(row), []).append({**row, "run": run})
        for key, rows in measured.items():
            superseded += cells.get(key, [])
            cells[key] = rows
    order = {"no-sd": 0, "eagle3-k3": 1, "eagle3-k7": 2}
    rows = [r for key in sorted(cells, key=lambda k: (order.get(k[0], 9), k[1], k[2])) for r in cells[key]]
    return {"command": shlex.join(["python", "scripts/merge_engine.py", *paths, "--out", out]),
            **{k: runs[0][k] for k in SHARED}, "runs": runs, "rows": rows, "superseded_rows": superseded}


def check(rows: list[dict]) -> list[str]:
    """Issue 11's targets for separate grids against vllm-default; one line per cell, failures marked."""
    lines = [f"{'workload':10s} {'accept':9s} {'conc':>5s} {'ratio':>6s} {'paired':>6s} {'bound':>6s} "
             f"{'of bound':>8s}  verdict"]
    for r in rows:
        if r["policy"] != "separate":
            continue
        ratio, paired, bound = r["tok_s_ratio"], r.get("tok_s_ratio_paired"), r["bound_ratio"]
        misses = []
        if ratio < 0.9 * bound:
            misses.append("< 90% of bound")
        if r["concurrency"] in (1, 16) and ratio < 0.98:
            misses.append("< 0.98x")
        lines.append(f"{r['workload']:10s} {r['acceptance']:9s} {r['concurrency']:5d} {ratio:6.3f} "
                     f"{paired or 0:6.3f} {bound:6.3f} {ratio / bound:8.2f}  {'; '.join(misses) or 'ok'}")
    return lines


def markdown(rows: list[dict]) -> str:
    """One table per workload and acceptance: output tok/s per policy and concurrency; other policies than
    vllm-default show (ratio to it / bound); eager steps where there were more than one."""
    out, groups = [], {}
    for r in rows:
        groups.setdefault((r["workload"], r["acceptance"]), []).append(r)
    for (workload, acceptance), group in groups.items():
        concs = sorted({r["concurrency"] for r in group})
        out += [f"| {workload}, {acceptance} | " + " | ".join(map(str, concs)) + " |", "|---" * (len(concs) + 1) + "|"]
        for policy in dict.fromkeys(r["policy"] for r in group):
            by_conc = {r["concurrency"]: r for r in group if r["policy"] == policy}
            cells = []
            for c in concs:
                r = by_conc.get(c)
                if r is None:
                    cells.append("")
                    continue
                text = f"{r['output_tok_s']:.0f}"
                if policy != "vllm-default":
                    text += f" ({r['tok_s_ratio']:.2f}x / {r['bound_ratio']:.2f})"
                if r["eager_steps"] > 1 and policy != "eager":
                    text += f", {r['eager_steps']} eager"
                cells.append(text)
            name = f"**{policy}**" if policy == "separate" else policy
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="+", help="bench_engine_gpu.py JSON files, later ones replacing earlier cells")
    parser.add_argument("--out", required=True)
    parser.add_argument("--markdown", action="store_true", help="also print the tables for docs/engine.md")
    args = parser.parse_args()
    merged = merge(args.parts, args.out)
    write_json(args.out, merged)
    print("\n".join(check(merged["rows"])))
    if args.markdown:
        print(markdown(merged["rows"]))


if __name__ == "__main__":
    main()
