"""Join headline halves (scripts/headline_two_gpus.sh: one file per GPU) into one headline JSON and its plot.

    python scripts/merge_headline.py OUT/k7/headline_h200.json OUT/other/headline_h200.json \\
        --out docs/bench/headline_h200.json

Ratios are recomputed within each file (a file is one GPU's run, so a policy is compared with vllm-default measured
on the same GPU): ``bound_ratio`` (vllm-default's step device time over the policy's) and ``tok_s_ratio``. A half
stopped by its time limit still has its rows; its serve_overhead rows may be missing."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

from bench_headline_gpu import add_ratios, plot_headline, print_table  # noqa: E402
from _common import write_json  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("halves", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    merged = {"command": "bash scripts/headline_two_gpus.sh (nvidia-h200-x2); python scripts/merge_headline.py "
                         + " ".join(args.halves), "commands": [], "rows": [], "serve_overhead": []}
    for gpu, path in enumerate(args.halves):
        with open(path, encoding="utf-8") as fh:
            half = json.load(fh)
        for key in ("commit", "model", "output_len"):
            merged.setdefault(key, half.get(key))
            if half.get(key) != merged[key]:
                raise SystemExit(f"{path}: {key} {half.get(key)!r} differs from the first half's {merged[key]!r}")
        merged["commands"].append(half["command"])
        rows = [dict(r, gpu=gpu) for r in half["rows"]]
        add_ratios(rows)  # (again: a half stopped by its time limit never computed them)
        merged["rows"] += rows
        merged["serve_overhead"] += half.get("serve_overhead", [])
    write_json(args.out, merged)
    plot_headline(merged, args.out.removesuffix(".json") + ".png")
    print_table(merged)


if __name__ == "__main__":
    main()
