"""CPU benchmark of prefix caching on the default model (issue 30): time to first token of a 1,520-token prompt,
of a second one that shares its first 1,500 tokens, and of an unrelated one of the same length, with prefix caching
on and off, through the offline API.

    python benchmarks/bench_prefix_cache_cpu.py [--out docs/bench/prefix_cache_cpu.json] [--repeats 5]

Prompts are token ids of ShareGPT text (the default model's tokenizer): per repetition a fresh 1,500-token prefix
(a later window of the text, so no repetition finds an earlier one's blocks), the first request that prefix and 20
tokens, the second the prefix and 20 other tokens, the third 1,520 tokens of other text. TTFT is the wall time of
``generate`` with ``max_tokens=1`` (the prefill step and the first token's sampling), after one warm-up of each
kind. Each engine runs ``--repeats`` rounds; medians reported, and the speedup, the first request's TTFT over the
second's (of the medians, and the median of each round's; the target: at least 5x with caching on). The load average at the start is recorded: other processes on
a shared machine slow every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from _common import commit, write_json  # noqa: E402  (puts the repository on sys.path)
from bench_default_model_cpu import SHAREGPT, load_average

PREFIX_LEN, SUFFIX_LEN = 1500, 20


def corpus_ids(tokenizer, min_tokens: int) -> list[int]:
    """The ShareGPT file's text, tokenized, at least ``min_tokens`` tokens of it."""
    with open(SHAREGPT, encoding="utf-8") as fh:
        data = json.load(fh)
    ids: list[int] = []
    for entry in data:
        for turn in entry["conversations"]:
            ids += tokenizer.encode(turn["value"] + "\n\n", add_special_tokens=False)
        if len(ids) >= min_tokens:
            return ids
    raise SystemExit(f"{SHAREGPT} holds fewer than {min_tokens} tokens")


def rounds(ids: list[int], repeats: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Per round (the warm-up first): the first prompt, the second (same prefix), an unrelated one."""
    n = PREFIX_LEN + SUFFIX_LEN
    out = []
    for r in range(repeats + 1):
        base = ids[r * 2 * n : r * 2 * n + PREFIX_LEN]
        other = ids[r * 2 * n + n : r * 2 * n + 2 * n]
        out.append((base + other[:SUFFIX_LEN], base + other[SUFFIX_LEN : 2 * SUFFIX_LEN], other))
    return out


def run(caching: bool, prompts, threads: int) -> dict:
    import torch

    from dispatcher import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(max_num_seqs=4, device="cpu", enforce_eager=True, max_model_len=2048,
              enable_prefix_caching=caching)
    params = SamplingParams(max_tokens=1)
    rows = []
    for i, triple in enumerate(prompts):
        row = {}
        for name, ids in zip(("first", "second", "unrelated"), triple):
            t0 = time.perf_counter()
            (out,) = llm.generate([ids], params)
            row[name] = time.perf_counter() - t0
            row[f"{name}_cached_tokens"] = out.num_cached_tokens
        if i:  # (round 0 warms up)
            rows.append(row)
    median = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {
        "enable_prefix_caching": caching,
        "ttft_ms": {k: round(median(k) * 1e3, 1) for k in ("first", "second", "unrelated")},
        "cached_tokens": {k: rows[0][f"{k}_cached_tokens"] for k in ("first", "second", "unrelated")},
        "speedup_second_vs_first": round(median("first") / median("second"), 2),
        "speedup_per_round_median": round(statistics.median(r["first"] / r["second"] for r in rows), 2),
        "rounds_ms": [{k: round(r[k] * 1e3, 1) for k in ("first", "second", "unrelated")} for r in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the result JSON here")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: %(default)s)")
    args = ap.parse_args()
    from models.text import load_tokenizer
    from models.default_model import default_model_path

    tok = load_tokenizer(default_model_path())
    ids = corpus_ids(tok, (args.repeats + 1) * 2 * (PREFIX_LEN + SUFFIX_LEN))
    prompts = rounds(ids, args.repeats)
    result = {
        "benchmark": "prefix_cache_cpu",
        "command": "python " + " ".join([os.path.relpath(__file__, os.getcwd()), *sys.argv[1:]]),
        "commit": commit(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "load_average_at_start": load_average(),
        "prompt_tokens": PREFIX_LEN + SUFFIX_LEN,
        "shared_prefix_tokens": PREFIX_LEN,
        "runs": [run(True, prompts, args.threads), run(False, prompts, args.threads)],
    }
    on = result["runs"][0]
    result["target_met"] = on["speedup_second_vs_first"] >= 5.0
    print(json.dumps(result, indent=2))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
