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

from _common import check_targets, join_runs, markdown_tables, write_json  # noqa: E402

SHARED = ("device", "model", "output_len")
"""Fields every run must agree on."""


def cell(row: dict) -> tuple:
    return row["workload"], row["acceptance"], row["concurrency"]


def merge(paths: list[str], out: str) -> dict:
    parts = []
    for path in paths:
        with open(path) as fh:
            parts.append((path, json.load(fh)))
    runs, rows, superseded = join_runs(parts, cell, SHARED, ("torch", "prompt_tokens_mean"))
    order = {"no-sd": 0, "eagle3-k3": 1, "eagle3-k7": 2}
    rows.sort(key=lambda r: (order.get(r["workload"], 9), r["acceptance"], r["concurrency"]))
    return {"command": shlex.join(["python", "scripts/merge_engine.py", *paths, "--out", out]),
            **{k: runs[0][k] for k in SHARED}, "runs": runs, "rows": rows, "superseded_rows": superseded}


def check(rows: list[dict]) -> list[str]:
    """Issue 11's targets for separate grids against vllm-default; one line per cell, failures marked."""
    return check_targets(rows, lambda r: f"{r['workload']:10s} {r['acceptance']:9s}", f"{'workload':10s} {'accept':9s}")


def markdown(rows: list[dict]) -> str:
    return markdown_tables(rows, lambda r: (r["workload"], r["acceptance"]))


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
