"""Real speculative decoding served: ``twogrid serve`` on the default model (SmolLM2-135M-Instruct's GGUF, its own
tokenizer) per speculative method and capture policy, driven by ``twogrid bench`` with the ShareGPT prompts, 256
output tokens each with EOS ignored, at several concurrencies, the drafts accepted as the model accepts them (no
``--fixed-acceptance``).

Methods (``--methods``): ``none`` (no speculative config) or ``METHOD:K`` (``--speculative-config '{"method":
METHOD, "num_speculative_tokens": K}'``; eagle3 without a "model" is the default model's own head;
``METHOD:K@HEAD_DIR`` the head in HEAD_DIR, its rows' method ``METHOD@NAME``: two heads side by side). Policies
(``--policies``): the headline's names and ``--compilation-config``s (bench_headline_gpu.POLICIES). One server per
(method, policy), every concurrency run against it after a warm-up wave of as many requests, as the headline's
(``--waves`` x N requests at N streams, at least ``--min-prompts``), the server's flags the headline's but the model.

Per row: the bench's output tok/s, TPOT and TTFT; from the server's /metrics (deltas over the measured requests,
read by ``twogrid bench``): eager steps, steps, the steps' device time and GPU busy (as the headline's rows), and
the mean acceptance length, 1 + accepted draft tokens / drafts (``twogrid:spec_decode_num_accepted_tokens_total``,
``twogrid:spec_decode_num_drafts_total``; null without drafts or without the drafts counter), with the acceptance
rate per draft position where the server exports ``twogrid:spec_decode_num_accepted_tokens_per_pos_total``;
``vs_no_sd`` is the row's tok/s over the ``none`` row's of the same policy and concurrency (of the same run where
merged runs have one).

``--together``: every (method, policy)'s server up at once, each with a KV cache of ``--kv-gib`` GiB (a memory
fraction would count the others' memory as used), and at each concurrency ``--rounds`` runs of every server in
rotating order (A B C, B C A, C A B, ...), the first round after a warm-up wave each: a row's ``output_tok_s`` is
the median of its runs (``round_tok_s``), its ``vs_no_sd`` the median of its runs' ratios to the ``none`` server's
run of the same round and policy (``vs_no_sd_runs``), so that the machine's drift falls on both sides of a ratio
(run to run, one server at a time, the 16-stream cells spread by 25%). An ``auto`` server's row adds the same
paired ratio to every fixed-K server of its policy (``vs_fixed``, no SD included) and the least of them
(``vs_best_fixed``, ``best_fixed``): auto against the best fixed K, round by round.

The JSON (``--out``) is rewritten after every row; ``--resume`` keeps the rows of an existing ``--out`` and
measures only the missing cells (no server for a (method, policy) whose concurrencies are all done). A server that
does not start, or dies, is recorded under ``errors`` and the matrix goes on. Split the matrix over device calls
with ``--methods`` / ``--policies`` subsets and join the parts with ``--merge A.json B.json --out ALL.json``.

    PYTHONPATH=.:benchmarks python benchmarks/bench_spec_gpu.py --data .gpu_data/sharegpt.json \\
        --policies separate --out $OUT/separate/spec_h200.json     # and --policies vllm-default in a second call
    python3 scripts/pack_gpu_out.py $OUT/separate                  # bench/ and the server logs as two archives
    python benchmarks/bench_spec_gpu.py --merge separate/spec_h200.json vllm-default/spec_h200.json --out ALL.json

The bench results (``bench/``) and server logs (``server-*.log``) go beside ``--out``. The GGUF must be installed
or cached on the machine that runs this (``models.default_model``; ``$TWOGRID_CACHE``), or given with ``--model``.

A CPU dry run (the default model makes ~30 tok/s there): ``HEADLINE_OUTPUT_LEN=8`` (shared with the headline),
``--device cpu --api-server-count 1 --min-prompts 2 --concurrency 1,2``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

# (importing _common puts the repository on sys.path)
from _common import commit, join_runs, kv_blocks, markdown_grid, stop_server, write_json
from bench_headline_gpu import OUTPUT_LEN, POLICIES, launch, make_row, run_bench, serve_command, wait_healthy
from dispatcher.plan.acceptance import fixed_acceptance_rate
from dispatcher.plan.config import SPEC_METHODS

METHODS = "none,ngram:3,eagle3:1,eagle3:3,eagle3:5"
SERVED_NAME = "smollm2"
"""The model name the servers serve and the bench sends."""
T0 = time.monotonic()


def log(msg: str) -> None:
    """A progress line with the time of day and the seconds since the script started."""
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def parse_method(text: str) -> tuple[str, int, dict | None]:
    """``none`` -> (none, 0, None); ``eagle3:3`` -> (eagle3, 3, its speculative config); ``eagle3:auto7`` ->
    (eagle3, -7, K up to 7 with ``"auto"`` tiers): a negative K stands for auto tiers up to -K. ``eagle3:3@DIR``:
    the draft head in DIR (``"model"``), its method named ``eagle3@NAME`` in the rows (NAME: DIR's last two path
    components), so that two heads are measured side by side. A ``+sN`` suffix (``none+s3``, ``eagle3:3+s3``): the
    server keeps N steps in flight (``--steps-in-flight N``), its method named with the suffix (``eagle3+s3``)."""
    text, plus, steps = text.partition("+s")
    if plus:
        if not steps.isdigit():
            raise ValueError(f"{text}+s{steps}: +sN takes a step count (--steps-in-flight N)")
        method, k, spec = parse_method(text)
        return f"{method}+s{steps}", k, spec
    if text == "none":
        return "none", 0, None
    text, at, head_dir = text.partition("@")
    if at:
        method, k, spec = parse_method(text)
        if method not in ("eagle", "eagle3", "mtp") or not head_dir:
            raise ValueError(f"{text}@{head_dir}: a draft head's directory goes after a head method's K "
                             f"(eagle:K@DIR, eagle3:K@DIR, mtp:K@DIR)")
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", "-".join(os.path.normpath(head_dir).split(os.sep)[-2:]).strip("-"))
        return f"{method}@{name}", k, dict(spec, model=head_dir)
    method, sep, k = text.partition(":")
    auto = k.startswith("auto")
    digits = k[4:] if auto else k
    if method not in SPEC_METHODS or not sep or not digits.isdigit() or int(digits) < 1:
        raise ValueError(f"{text!r}: give none, METHOD:K or METHOD:autoK, METHOD one of {', '.join(SPEC_METHODS)}, "
                         f"K >= 1")
    spec = {"method": method, "num_speculative_tokens": int(digits)}
    if auto:
        spec["num_speculative_tokens_per_batch_size"] = "auto"
    return method, -int(digits) if auto else int(digits), spec


def label(method: str, k: int) -> str:
    return "none" if method == "none" else f"{method}:auto{-k}" if k < 0 else f"{method}:{k}"


def file_stem(policy: str, method: str, k: int) -> str:
    """A server's name in its log, trace and bench files: ``separate-eagle3-k3``, ``separate-eagle3.e3n-head-k3``
    for a head by directory (letters, digits, '.', '_' and '-' only: the device tool brings no other name back)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{policy}-{label(method, k).replace(':', '-k').replace('@', '.')}")


def tiers_of(k: int) -> str | int:
    """A row's ``tiers``: ``auto`` or the fixed K (0: no speculation)."""
    return "auto" if k < 0 else k


def cell(row: dict) -> tuple:
    """What a row measured: one server's (policy, method, K, fused or not) at one concurrency."""
    return row["policy"], row["method"], row["k"], row.get("fused", True), row["concurrency"]


def fixed_mean_length(args, k: int) -> float:
    """The ``--fixed-acceptance`` of a server drafting up to k tokens: ``args.fixed_acceptance`` itself, or with
    ``--fixed-acceptance-of K0`` the mean length at k of the per-draft rate that gives ``args.fixed_acceptance`` at
    K0 (so that every server's drafter accepts alike: 3.0 of 7 is rate 0.68, 2.47 at K = 3)."""
    if not args.fixed_acceptance_of:
        return args.fixed_acceptance
    rate = fixed_acceptance_rate(args.fixed_acceptance, args.fixed_acceptance_of)
    return round(1.0 + sum(rate ** j for j in range(1, k + 1)), 4)


def scrape(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        return resp.read().decode()


def fused_steps(metrics: str) -> float:
    """``twogrid:fused_decode_steps_total`` summed over its series."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("twogrid:fused_decode_steps_total"))


def chosen_k(metrics: str, concurrency: int) -> int | None:
    """The K of the speculative tier in force for ``concurrency`` requests (``twogrid:spec_decode_tier_k``; a
    retired tier reads -1), or None."""
    for line in metrics.splitlines():
        m = re.match(r'twogrid:spec_decode_tier_k\{(.*)\} (\S+)', line)
        if m and float(m.group(2)) >= 0:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if int(labels["min_batch"]) <= concurrency <= int(labels["max_batch"]):
                return int(float(m.group(2)))
    return None


def spec_row(policy: str, method: str, k: int, conc: int, bench: dict, args) -> dict:
    """A row from one ``twogrid bench`` result: the headline's row fields (tok/s, TPOT, TTFT, eager steps, steps,
    device time, GPU busy, ...) led by the method and K, with the acceptance counters and the mean acceptance length
    (null without drafts, or when the server exports no drafts counter)."""
    acceptance = "real" if args.fixed_acceptance is None else f"fixed-{fixed_mean_length(args, abs(k))}"
    head = make_row(policy, label(method, k), acceptance, conc, [bench], args)
    del head["workload"]
    row = {"policy": policy, "method": method, "k": k, "tiers": tiers_of(k), "fused": not args.no_fuse_decode_steps,
           "steps_in_flight": steps_in_flight(method) or 2, **head}
    accepted, drafts = bench.get("spec_decode_num_accepted_tokens"), bench.get("spec_decode_num_drafts")
    row["accepted_tokens"], row["drafts"] = accepted, drafts
    row["mean_acceptance_length"] = bench.get("mean_acceptance_length")
    per_pos = bench.get("spec_decode_accepted_per_pos")
    if per_pos and drafts:
        row["acceptance_rate_per_position"] = [round(n / drafts, 4) for n in per_pos]
    return row


def add_ratios(rows: list[dict]) -> None:
    """Each row's ``vs_no_sd``: its tok/s over the ``none`` row's of the same policy and concurrency, in place; in
    merged rows (each with ``run``) the same run's ``none`` row where there is one, else another run's
    (``vs_no_sd_run`` names it)."""
    base: dict[tuple, dict] = {}
    for r in rows:
        if r["method"] == "none":
            base.setdefault((r["policy"], r.get("fused", True), r["concurrency"]), {})[r.get("run")] = r
    for r in rows:
        if "vs_no_sd_runs" in r:  # (--together: the median of paired ratios, measured as such)
            continue
        r.pop("vs_no_sd", None)
        r.pop("vs_no_sd_run", None)
        runs = base.get((r["policy"], r.get("fused", True), r["concurrency"]))
        if not runs:
            continue
        b = runs.get(r.get("run")) or next(iter(runs.values()))
        if b["output_tok_s"]:
            r["vs_no_sd"] = round(r["output_tok_s"] / b["output_tok_s"], 3)
        if b.get("run") != r.get("run"):
            r["vs_no_sd_run"] = b["run"]


def markdown(rows: list[dict]) -> str:
    """One table per policy: a line per method and K, a column per concurrency; each cell output tok/s, then its
    ratio to no speculation and the mean acceptance length where there are they, eager steps where more than one."""
    def cell(r: dict) -> str:
        notes = []
        if r["method"] != "none" and "vs_no_sd" in r:
            notes.append(f"{r['vs_no_sd']:.2f}x")
        if r.get("mean_acceptance_length") is not None:
            notes.append(f"AL {r['mean_acceptance_length']:.2f}")
        if r.get("tiers") == "auto" and r.get("chosen_k") is not None:
            notes.append(f"K {r['chosen_k']}")
        if r.get("vs_best_fixed") is not None:
            notes.append(f"{r['vs_best_fixed']:.2f}x {r['best_fixed']}")
        if r.get("vs_default_head") is not None:
            notes.append(f"{r['vs_default_head']:.2f}x default head")
        text = f"{r['output_tok_s']:.0f}" + (f" ({', '.join(notes)})" if notes else "")
        return text + (f", {r['eager_steps']} eager" if r["eager_steps"] > 1 else "")

    return markdown_grid(rows, lambda r: r["policy"],
                         lambda r: label(r["method"], r["k"]) + ("" if r.get("fused", True) else ", op by op"), cell)


def merge(paths: list[str], out: str | None) -> dict:
    """Join runs of this script into one result: a later file's row replaces an earlier one of the same cell (the
    replaced rows kept under ``superseded_rows``); each row names its run (an index into ``runs``); rows in the
    files' order of policies, then no SD first, then by method, K and concurrency; the runs' errors and servers are
    kept, each naming its run. SystemExit when the runs differ in model or output length."""
    parts = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            parts.append((path, json.load(fh)))
    runs, rows, superseded = join_runs(parts, cell, ("model", "output_len"), ("device", "api_server_count"))
    order = {p: i for i, p in enumerate(dict.fromkeys(r["policy"] for _, part in parts for r in part["rows"]))}
    rows.sort(key=lambda r: (order[r["policy"]], r["method"] != "none", r["method"], r["k"], r["concurrency"]))
    add_ratios(rows)
    merged = {"command": "PYTHONPATH=.:benchmarks python benchmarks/bench_spec_gpu.py --merge "
                         + shlex.join(paths) + (f" --out {shlex.quote(out)}" if out else ""),
              "commit": runs[0]["commit"], "model": runs[0]["model"], "output_len": runs[0]["output_len"],
              "runs": runs, "rows": rows, "superseded_rows": superseded,
              "servers": [{**s, "run": i} for i, (_, part) in enumerate(parts) for s in part.get("servers", [])],
              "errors": [{**e, "run": i} for i, (_, part) in enumerate(parts) for e in part.get("errors", [])]}
    write_json(out, merged)
    return merged


TIER_CHANGE = "speculative tiers changed"
"""The engine's log line at each change of ``"auto"`` tiers (the acceptance, host floor and each K's weighed step)."""
TIER_LINES_KEPT = 12


def tier_changes(path: str, seen: int) -> tuple[list[str], int]:
    """An auto server's tier changes logged after its first ``seen`` (the last ``TIER_LINES_KEPT`` of them, each cut
    to 600 characters), and how many it has logged: a row's record of why its tiers moved."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = [line.strip()[:600] for line in fh if TIER_CHANGE in line]
    except OSError:
        return [], seen
    return lines[seen:][-TIER_LINES_KEPT:], len(lines)


def log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return ""


def measure(result: dict, methods: list[tuple[str, int, dict | None]], policies: list[str], concurrencies: list[int],
            args, out_dir: str, save) -> None:
    """Every (method, policy)'s server in turn, each through the concurrencies not yet in ``result["rows"]``."""
    done = {cell(r) for r in result["rows"]}
    fused = not args.no_fuse_decode_steps
    base = f"http://127.0.0.1:{args.port}"
    todo = [(m, k, spec, p) for m, k, spec in methods for p in policies]
    for i, (method, k, spec, policy) in enumerate(todo, 1):
        name = f"{policy} {label(method, k)}"
        concs = [c for c in concurrencies if (policy, method, k, fused, c) not in done]
        if not concs:
            log(f"server {i}/{len(todo)} {name}: measured already")
            continue
        stem = file_stem(policy, method, k)
        log_path = os.path.join(out_dir, f"server-{stem}.log")
        cmd = serve_command(policy, spec, args.port, args, SERVED_NAME) + server_flags(args, spec, k, stem, method)
        log(f"server {i}/{len(todo)} {name}: starting (concurrency {','.join(map(str, concs))})")
        t0 = time.monotonic()
        proc = launch(cmd, name, args.port, log_path, wait=False)
        server = None
        try:  # (whatever happens, a SIGTERM's exit included, the server is stopped)
            try:
                wait_healthy(proc, name, args.port)
            except RuntimeError as exc:
                log(f"server {name}: {exc}")
                result["errors"].append({"policy": policy, "method": method, "k": k, "error": str(exc),
                                         "log_tail": log_tail(log_path)})
                continue
            server = {"policy": policy, "method": method, "k": k, "start_s": round(time.monotonic() - t0, 1)}
            seen = 0  # (tier changes already in a row)
            result["servers"].append(server)
            log(f"server {name}: ready in {server['start_s']:.1f} s")
            for conc in concs:
                try:
                    fused0 = fused_steps(scrape(base))
                    bench = run_bench(base, conc, stem, os.path.join(out_dir, "bench"), args, proc.pid, SERVED_NAME)
                except subprocess.CalledProcessError as exc:
                    alive = proc.poll() is None
                    log(f"server {name}: twogrid bench at {conc} streams failed (exit {exc.returncode})"
                        + ("" if alive else f"; the server exited with {proc.returncode}"))
                    result["errors"].append({"policy": policy, "method": method, "k": k, "concurrency": conc,
                                             "error": f"twogrid bench exited with {exc.returncode}",
                                             "server_alive": alive, "log_tail": log_tail(log_path)})
                    save()
                    if not alive:
                        break
                    continue
                row = spec_row(policy, method, k, conc, bench, args)
                metrics = scrape(base)
                row["fused_steps"] = round(fused_steps(metrics) - fused0)  # (the bench's warm-up wave included)
                if spec:
                    row["chosen_k"] = chosen_k(metrics, conc) if k < 0 else k
                if k < 0:
                    row["tier_changes"], seen = tier_changes(log_path, seen)
                result["rows"].append(row)
                save()
                al = row["mean_acceptance_length"]
                log(f"{name} c={conc}: {row['output_tok_s']:.0f} tok/s"
                    + (f" ({row['vs_no_sd']:.2f}x no SD)" if "vs_no_sd" in row and method != "none" else "")
                    + (f", acceptance length {al:.2f}" if al is not None else "")
                    + f", TPOT {row['tpot_ms_mean']:.2f} ms, TTFT {row['ttft_ms_mean']:.1f} ms, "
                      f"{row['eager_steps']} eager, GPU busy {row['gpu_busy']:.2f}")
        finally:
            t1 = time.monotonic()
            stop_server(proc)
            if server is not None:
                server["measured_s"] = round(t1 - t0 - server["start_s"], 1)
                server["stop_s"] = round(time.monotonic() - t1, 1)
            save()


def steps_in_flight(method: str) -> int | None:
    """The ``+sN`` of a method's name (``parse_method``), or None."""
    _, plus, steps = method.rpartition("+s")
    return int(steps) if plus and steps.isdigit() else None


def server_flags(args, spec: dict | None, k: int, stem: str, method: str = "") -> list[str]:
    """A server's flags from the run's options: its fixed acceptance, fused steps off, its step trace, its steps in
    flight (a method's ``+sN``)."""
    steps = steps_in_flight(method)
    flags = [] if steps is None else ["--steps-in-flight", str(steps)]
    if args.fixed_acceptance is not None and spec:
        flags += ["--fixed-acceptance", str(fixed_mean_length(args, abs(k)))]
    if args.no_fuse_decode_steps:
        flags += ["--no-fuse-decode-steps"]
    if args.step_trace_dir:
        flags += ["--step-trace", os.path.join(args.step_trace_dir, f"trace-{stem}.jsonl")]
    return flags


def measure_together(result: dict, methods: list[tuple[str, int, dict | None]], policies: list[str],
                     concurrencies: list[int], args, out_dir: str, save) -> None:
    """``--together``: every (method, policy)'s server at once (ports from ``--port`` up), then per concurrency
    ``--rounds`` rounds of one run a server in rotating order; a row per cell from its runs (see the docstring)."""
    servers = [(m, k, spec, p) for m, k, spec in methods for p in policies]
    blocks = kv_blocks(args.model, args.kv_gib)
    procs, logs = [], []
    seen = [0] * len(servers)  # (each auto server's tier changes already in a row)
    try:
        for i, (method, k, spec, policy) in enumerate(servers):
            stem = file_stem(policy, method, k)
            cmd = (serve_command(policy, spec, args.port + i, args, SERVED_NAME) + ["--num-kv-blocks", str(blocks)]
                   + server_flags(args, spec, k, stem, method))
            logs.append(os.path.join(out_dir, f"server-{stem}.log"))
            procs.append(launch(cmd, f"{policy} {label(method, k)}", args.port + i, logs[-1], wait=False))
        t0 = time.monotonic()
        for i, (proc, (method, k, _, policy)) in enumerate(zip(procs, servers)):
            wait_healthy(proc, f"{policy} {label(method, k)}", args.port + i)
            result["servers"].append({"policy": policy, "method": method, "k": k, "together": True,
                                      "ready_s": round(time.monotonic() - t0, 1)})
        log(f"{len(servers)} servers ready in {time.monotonic() - t0:.1f} s, {blocks} KV blocks each")
        save()
        for conc in concurrencies:
            runs: list[list[dict]] = [[] for _ in servers]
            for rnd in range(args.rounds):
                for i in [(rnd + j) % len(servers) for j in range(len(servers))]:
                    method, k, _, policy = servers[i]
                    base = f"http://127.0.0.1:{args.port + i}"
                    stem = f"{file_stem(policy, method, k)}-r{rnd}"
                    runs[i].append(run_bench(base, conc, stem, os.path.join(out_dir, "bench"), args, procs[i].pid,
                                             SERVED_NAME, warmups=None if rnd == 0 else 0))
            for i, (method, k, spec, policy) in enumerate(servers):
                result["rows"] = [r for r in result["rows"] if cell(r) != (policy, method, k, not
                                                                           args.no_fuse_decode_steps, conc)]
                chosen = chosen_k(scrape(f"http://127.0.0.1:{args.port + i}"), conc) if k < 0 else k
                result["rows"].append(together_row(servers, runs, i, conc, args, chosen))
                if k < 0:
                    result["rows"][-1]["tier_changes"], seen[i] = tier_changes(logs[i], seen[i])
            log(f"c={conc}: " + ", ".join(f"{label(r['method'], r['k'])} {r['output_tok_s']:.0f}"
                                         + (f" ({r['vs_no_sd']:.2f}x)" if "vs_no_sd" in r else "")
                                         for r in result["rows"] if r["concurrency"] == conc))
            save()
    finally:
        for proc in procs:
            stop_server(proc)


def together_row(servers: list[tuple], runs: list[list[dict]], i: int, conc: int, args,
                 chosen: int | None = None) -> dict:
    """Server ``i``'s row at ``conc`` streams from its rounds: the median run's fields, the median tok/s, each
    round's tok/s, and against the ``none`` server of its policy the median of the same rounds' ratios;
    ``chosen``: the K in force (an ``"auto"`` server's tier at ``conc``, read from its metrics)."""
    method, k, spec, policy = servers[i]
    tok_s = [b["output_throughput"] for b in runs[i]]
    median_run = sorted(runs[i], key=lambda b: b["output_throughput"])[len(tok_s) // 2]
    row = spec_row(policy, method, k, conc, median_run, args)
    row.update(output_tok_s=round(statistics.median(tok_s), 1), round_tok_s=[round(t, 1) for t in tok_s],
               rounds=len(tok_s), together=True)
    if spec:
        row["chosen_k"] = chosen
    none = next((j for j, s in enumerate(servers) if s[0] == "none" and s[3] == policy), None)
    if none is not None and method != "none":
        ratios = paired_ratios(runs[i], runs[none])
        row["vs_no_sd_runs"] = [round(r, 3) for r in ratios]
        row["vs_no_sd"] = round(statistics.median(ratios), 3)
    if k < 0:
        row.update(vs_fixed(servers, runs, i))
    row.update(vs_default_head(servers, runs, i))
    return row


def paired_ratios(runs: list[dict], baseline_runs: list[dict]) -> list[float]:
    """Each round's tok/s over the baseline server's in the same round (the servers' runs, round by round)."""
    return [a["output_throughput"] / b["output_throughput"] for a, b in zip(runs, baseline_runs)]


def vs_default_head(servers: list[tuple], runs: list[list[dict]], i: int) -> dict:
    """A server of a head given by directory (``METHOD@NAME``): its paired ratios, round by round, to the server of
    the same method, K and policy with the default head (``vs_default_head_runs``, their median
    ``vs_default_head``): whether a retrained head beats the shipped one, measured as ``vs_no_sd`` is. {} for the
    others, or where that server is not in the run."""
    method, k, _, policy = servers[i]
    base = method.partition("@")[0]
    j = next((j for j, s in enumerate(servers) if (s[0], s[1], s[3]) == (base, k, policy)), None)
    if base == method or j is None:
        return {}
    paired = paired_ratios(runs[i], runs[j])
    return {"vs_default_head_runs": [round(r, 3) for r in paired],
            "vs_default_head": round(statistics.median(paired), 3)}


def vs_fixed(servers: list[tuple], runs: list[list[dict]], i: int) -> dict:
    """An ``"auto"`` server's paired ratios to every fixed-K server of its policy (no SD as K = 0, other methods'
    too): per fixed server the median over rounds of auto's tok/s over that server's in the same round
    (``vs_fixed``, by label), and the least of them (``vs_best_fixed``, issue 29's measure: auto against the best
    fixed K). Paired by round, as ``vs_no_sd``: the rounds of one cell move together (the host's load; at 256
    streams of the default model every server's first round ran 5-17% below its others, 82f4592), and the best of
    several medians, each noisy, sits above every true one."""
    policy = servers[i][3]
    ratios = {}
    for j, (method, k, _, pol) in enumerate(servers):
        if pol == policy and k >= 0 and j != i:
            ratios[label(method, k)] = round(statistics.median(paired_ratios(runs[i], runs[j])), 3)
    if not ratios:
        return {}
    best = min(ratios, key=ratios.get)
    return {"vs_fixed": ratios, "vs_best_fixed": ratios[best], "best_fixed": best}


def main() -> None:
    parser = argparse.ArgumentParser(description="real speculative decoding served: twogrid serve on the default "
                                                 "model per method and policy, twogrid bench per concurrency")
    parser.add_argument("--data", help="ShareGPT JSON (the headline's)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--methods", default=METHODS, help="none or METHOD:K, comma-separated (default: %(default)s)")
    parser.add_argument("--policies", default="separate,vllm-default",
                        help=f"of {', '.join(POLICIES)} (default: %(default)s)")
    parser.add_argument("--concurrency", default="1,16,64,256,1024")
    parser.add_argument("--waves", type=int, default=1, help="prompts per run = waves x concurrency")
    parser.add_argument("--min-prompts", type=int, default=16, help="prompts per run at least (small concurrencies "
                        "run more waves)")
    parser.add_argument("--resume", action="store_true", help="keep the rows of an existing --out and measure only "
                        "the missing cells")
    parser.add_argument("--merge", nargs="+", metavar="RUN.json", help="join runs of this script into --out; "
                        "nothing is measured")
    parser.add_argument("--model", default=None, help="default: the default model's GGUF "
                        "(models.default_model.default_model_path)")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--api-server-count", type=int, default=4, help="the servers' front-end processes")
    parser.add_argument("--stream-interval", type=int, default=1, help="the servers' --stream-interval (tokens a "
                        "chunk after the first)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--step-trace-dir", default=None, help="each server writes its step trace here")
    parser.add_argument("--tokenizer", default=None, help="the servers' --tokenizer (a preset --model serves text "
                        "with it; default: the model's own)")
    parser.add_argument("--fixed-acceptance", type=float, default=None,
                        help="the speculative servers' --fixed-acceptance (benchmarks of random heads)")
    parser.add_argument("--fixed-acceptance-of", type=int, default=None, metavar="K0",
                        help="--fixed-acceptance is the mean length at K0 drafts: every server accepts at that "
                             "per-draft rate (a K = 3 server at 3.0 of 7: 2.47)")
    parser.add_argument("--together", action="store_true", help="every server up at once, --rounds runs of each in "
                        "rotating order per concurrency (medians, paired ratios to no SD)")
    parser.add_argument("--rounds", type=int, default=3, help="--together: runs of each server per concurrency")
    parser.add_argument("--kv-gib", type=float, default=12.0, help="--together: each server's KV cache, GiB")
    parser.add_argument("--no-fuse-decode-steps", action="store_true",
                        help="servers with --no-fuse-decode-steps (uniform decodes op by op)")
    args = parser.parse_args()
    if args.merge:
        merged = merge(args.merge, args.out)
        print(markdown(merged["rows"]))
        return
    if not args.data:
        parser.error("--data is required (or --merge)")
    try:
        methods = [parse_method(m) for m in args.methods.split(",")]
    except ValueError as exc:
        parser.error(f"--methods: {exc}")
    policies = args.policies.split(",")
    if unknown := set(policies) - set(POLICIES):
        parser.error(f"--policies: unknown {', '.join(sorted(unknown))} (known: {', '.join(POLICIES)})")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if args.model is None:
        from models.default_model import DefaultModelError, default_model_path

        try:
            args.model = default_model_path()
        except DefaultModelError as exc:
            raise SystemExit(f"--model: {exc}") from None
    if args.step_trace_dir:
        os.makedirs(args.step_trace_dir, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (a timeout's SIGTERM: stop the server on the way out)
    out_dir = os.path.dirname(args.out) if args.out else "."
    os.makedirs(out_dir or ".", exist_ok=True)
    result = {"command": "PYTHONPATH=.:benchmarks python benchmarks/bench_spec_gpu.py " + shlex.join(sys.argv[1:]),
              "commit": commit(), "model": os.path.basename(args.model), "served_model_name": SERVED_NAME,
              "tokenizer": args.tokenizer or "the model's own", "device": args.device,
              "api_server_count": args.api_server_count, "output_len": OUTPUT_LEN,
              "acceptance": "real" if args.fixed_acceptance is None else f"fixed-{args.fixed_acceptance}",
              "fused": not args.no_fuse_decode_steps, "methods": [label(m, k) for m, k, _ in methods],
              "policies": policies, "concurrency": concurrencies, "rows": [], "servers": [], "errors": []}
    if args.resume and args.out and os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as fh:
            old = json.load(fh)
        for key in ("model", "output_len", "device"):
            if old.get(key) != result[key]:
                raise SystemExit(f"--resume: {args.out} has {key} {old.get(key)!r}, this run {result[key]!r}")
        result["rows"], result["servers"] = old["rows"], old.get("servers", [])
        result["errors"] = old.get("errors", [])
        result["resumed_from"] = {"command": old["command"], "commit": old["commit"]}
        log(f"resuming {args.out}: {len(result['rows'])} rows kept")

    def save() -> None:  # after every row: a run cut short keeps what it measured, with its ratios
        add_ratios(result["rows"])
        write_json(args.out, result)

    log(f"{len(methods)} methods x {len(policies)} policies = {len(methods) * len(policies)} servers, concurrency "
        f"{','.join(map(str, concurrencies))}, {OUTPUT_LEN} output tokens, model {args.model} on {args.device}")
    if args.together:
        if args.resume:
            parser.error("--together measures every cell again: no --resume")
        measure_together(result, methods, policies, concurrencies, args, out_dir, save)
    else:
        measure(result, methods, policies, concurrencies, args, out_dir, save)
    save()
    log(f"done: {len(result['rows'])} rows, {len(result['errors'])} errors" + (f" -> {args.out}" if args.out else ""))
    print(markdown(result["rows"]))


if __name__ == "__main__":
    main()
