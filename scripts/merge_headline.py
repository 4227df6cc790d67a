"""Join headline runs (benchmarks/bench_headline_gpu.py, one device call each: scripts/headline_rest.sh's parts,
scripts/headline_two_gpus.sh's halves) into one headline JSON and its plots (every row; bench-moe at K = 7, the
README's), and check it against issue 14's targets.

    python scripts/merge_headline.py RUN1.json RUN2.json ... --out docs/bench/headline_h200.json [--markdown]

Ratios are computed within each run (a policy against vllm-default measured in the same run): ``bound_ratio``
(vllm-default's step device time over the policy's) and ``tok_s_ratio``; a run stopped by its time limit still has
its rows. A cell (model, workload, acceptance, concurrency) keeps every policy's row from one run; a later file on
the command line that measured the same cell replaces it (a rerun), the replaced rows kept under
``superseded_rows``. Each row names its run (``run``: an index into ``runs``, with its command and commit).

``--repeats RUN.json ...`` adds runs that measured cells again only to compare separate grids with the other
engines' lists where one run is too noisy to say (the server that runs later in a call tends to run faster): they
stay out of the table (``repeat_rows``, ``run`` naming ``repeat_runs``), and the check takes the median of
separate's tok/s over the rival's across every run that measured both."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

from bench_headline_gpu import add_ratios, plot_headline, print_table  # noqa: E402
from _common import check_targets, join_runs, markdown_tables, write_json  # noqa: E402

RIVALS = ("sglang", "trtllm")
"""The other engines' lists: separate grids should be at or above them in every cell."""


def cell(row: dict) -> tuple:
    return row["model"], row["workload"], row["acceptance"], row["concurrency"]


def group(row: dict) -> tuple:
    return row["model"], row["workload"], row["acceptance"]


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        part = json.load(fh)
    add_ratios(part["rows"])  # (again: a run stopped by its time limit never computed them)
    return part


def merge(paths: list[str], out: str, repeats: list[str] = ()) -> dict:
    parts = [(path, load(path)) for path in paths]
    runs, rows, superseded = join_runs(parts, cell, ("output_len",), ("model", "api_server_count"))
    rows.sort(key=lambda r: (r["model"] != "bench-moe", r["model"], r["workload"], r["acceptance"], r["concurrency"]))
    overhead = [{**o, "run": i} for i, (_, part) in enumerate(parts) for o in part.get("serve_overhead", [])]
    repeat_runs, repeat_rows = [], []
    for i, path in enumerate(repeats):
        part = load(path)
        if part.get("output_len") != runs[0]["output_len"]:
            raise SystemExit(f"{path}: output_len {part.get('output_len')} differs from the table's "
                             f"{runs[0]['output_len']}")
        repeat_runs.append({"file": os.path.basename(path), "command": part["command"], "commit": part["commit"]})
        repeat_rows += [{**r, "run": f"repeat {i}"} for r in part["rows"]]
    command = ["python", "scripts/merge_headline.py", *paths, "--out", out]
    command += ["--repeats", *repeats] if repeats else []
    return {"command": shlex.join(command), "output_len": runs[0]["output_len"], "runs": runs, "rows": rows,
            "superseded_rows": superseded, "serve_overhead": overhead, "repeat_runs": repeat_runs,
            "repeat_rows": repeat_rows}


def check(rows: list[dict], repeat_rows: list[dict] = ()) -> list[str]:
    """Issue 14's targets for separate grids: 90% of the bound, 0.98x at 1 and 16, at or above SGLang's and
    TensorRT-LLM's lists (the median over the runs that measured both); one line per cell, misses named."""
    return check_targets(rows, lambda r: f"{r['model']:15s} {r['workload']:18s} {r['acceptance']:9s}",
                         f"{'model':15s} {'workload':18s} {'accept':9s}", RIVALS, tuple(repeat_rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="bench_headline_gpu.py JSON files, later ones replacing earlier cells")
    parser.add_argument("--out", required=True)
    parser.add_argument("--markdown", action="store_true", help="also print the tables for docs/headline.md")
    parser.add_argument("--repeats", nargs="+", default=[], metavar="RUN",
                        help="runs that measured cells again, for the check against SGLang's and TensorRT-LLM's "
                             "lists only (the median over runs); not in the table")
    args = parser.parse_args()
    merged = merge(args.runs, args.out, args.repeats)
    write_json(args.out, merged)
    plot_headline(merged, args.out.removesuffix(".json") + ".png")
    k7 = [r for r in merged["rows"] if r["model"] == "bench-moe" and r["workload"] == "eagle3-k7"]
    if k7:  # the README's plot: every list at K = 7
        plot_headline({"rows": k7}, args.out.removesuffix(".json") + "_eagle3-k7.png")
    print_table(merged)
    print("\n".join(check(merged["rows"], merged["repeat_rows"])))
    if args.markdown:
        print(markdown_tables(merged["rows"], group))


if __name__ == "__main__":
    main()
