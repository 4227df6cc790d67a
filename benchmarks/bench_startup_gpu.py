"""Start-up and delayed capture on the GPU (issue 33): where the time before serving goes, and what serving while
capturing costs.

``--part startup``: per model and workload, ``twogrid serve`` started fresh four times: capturing first with empty
caches (Triton's kernels, the graph memory estimate: a first start on a machine) and again with them warm, then with
``--delayed-cudagraph-capture`` warm and cold (``--starts`` picks others, e.g. ``delayed:cold,delayed:warm``). Per
start, from the moment the process is spawned: /health's first 200 (``health_s``), the first token of a streamed request
sent then (``first_token_s``), the worker's phases (``twogrid:startup_phase_seconds{phase}``: imports, settings,
weights, grid_fit, kv_sizing, kv_allocation, kernels, capture, measure), the front end's own view (its log's "serving N
s after the server process started"; its own setup and when it started the engine process, from "front end set up N s
... (the engine process started at M s)"), the graphs captured when /health turned 200 and, delayed, when the last one
was (``capture_done_s``).

``--part capture``: (a) during delayed capture: a server with ``--enforce-eager`` and a delayed one, each started
fresh and sent one wave of ``--concurrency-during`` streams at once, their step traces compared: per step kind and
token count (rounded up to a power of two), the median wall time between two steps' results while the delayed server
still captured (its steps up to the last one that ran without a graph) over the eager server's; (b) after capture:
a capture-first and a delayed server up side by side (the delayed one once it has captured everything), ``--rounds``
bench runs each at 256 and 1024 streams in alternating order, output tok/s per run and the median ratio.
``--no-after`` / ``--no-during`` run one of them; (a)'s row also counts the delayed server's target forwards that
ran eagerly for want of their graph and those that replayed a larger captured graph instead (``stand_in_steps``).
``--server-tree DIR`` runs the servers from another checkout (an earlier commit's ``git archive``: an A/B in one
lease; give it its own ``--out``).

The model is bench-moe (random weights) with SmolLM2's tokenizer, or the default model's GGUF (``--models default``);
``--workloads`` no-sd and eagle3-k7 (bench-moe: fixed acceptance 3.0, its random head accepts nothing). Each part
fits ~8 minutes of an H200 for one model (``--models``) and both workloads; rows are added to ``--out`` (a rerun
replaces the rows of the cells it measures).

    PYTHONPATH=.:benchmarks python benchmarks/bench_startup_gpu.py --part startup --models bench-moe \\
        --data .gpu_data/sharegpt.json --tokenizer .gpu_data/smollm2-tokenizer --out $OUT/startup_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from _common import commit, front_end_setup, stop_server, write_json  # (puts the repository on sys.path)
from bench_headline_gpu import OUTPUT_LEN, run_bench, wait_healthy
from dispatcher.bench.server_metrics import graph_totals, parse_counters

WORKLOADS = {"no-sd": None, "eagle3-k7": {"method": "eagle3", "num_speculative_tokens": 7}}
FIXED_ACCEPTANCE = 3.0
MODES = ("capture-first", "delayed")
MODE_FLAGS = {"capture-first": "--no-delayed-cudagraph-capture", "delayed": "--delayed-cudagraph-capture"}
"""Each mode's flag, given either way (a server on CUDA captures in the background by default since cdf42a4;
``mode_flags`` leaves the first out for a ``--server-tree`` from before, whose parser has no such flag)."""
PHASE = re.compile(r'twogrid:startup_phase_seconds\{[^}]*phase="(\w+)"[^}]*\} ([0-9.e+-]+)')
SERVING_AFTER = re.compile(r"serving ([0-9.]+) s after the server process started")


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def model_path(name: str) -> str:
    """A preset's name as it is, ``default``: the default model's GGUF (resolved before any start changes
    $TWOGRID_CACHE, so that a cold start does not fetch it again)."""
    if name != "default":
        return name
    from models.default_model import default_model_path

    return default_model_path()


def mode_flags(mode: str) -> list[str]:
    """``MODE_FLAGS[mode]``, but none for capture-first on a ``--server-tree`` from before serve's default changed
    (its parser refuses --no-delayed-cudagraph-capture, and it captures first anyway)."""
    if mode == "capture-first" and SERVER_TREE:
        with open(os.path.join(SERVER_TREE, "dispatcher", "serve", "launch.py"), encoding="utf-8") as fh:
            if "BooleanOptionalAction, default=None" not in fh.read():
                return []
    return [MODE_FLAGS[mode]]


def serve_command(model: str, workload: str, port: int, args, extra: list[str] = ()) -> list[str]:
    """``twogrid serve`` as the headline runs it (sm100, 1024 requests and 16384 tokens a step), KV cache by
    ``--gpu-memory-utilization``; bench-moe with SmolLM2's tokenizer; eagle3-k7 at fixed acceptance 3.0 on
    bench-moe (its head is random)."""
    cmd = [sys.executable, "-m", "dispatcher", "serve", "--model", model, "--platform", "sm100", "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-model-len", str(args.max_model_len),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--served-model-name", "m",
           "--device", args.device, "--api-server-count", str(args.api_server_count), *extra]
    if not model.endswith(".gguf") and args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    spec = WORKLOADS[workload]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
        if not model.endswith(".gguf"):
            cmd += ["--fixed-acceptance", str(FIXED_ACCEPTANCE)]
    return cmd


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def graph_counts(metrics: str) -> dict[str, int]:
    """The graphs captured and planned (``/metrics`` text), every runner and kind summed."""
    captured, planned = graph_totals(parse_counters(metrics)) or (0, 0)
    return {"captured": captured, "planned": planned}


async def first_token_at(port: int, prompt: str) -> float:
    """time.monotonic() when a streamed completion's first token arrives."""
    import aiohttp

    body = {"model": "m", "prompt": prompt, "max_tokens": 16, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if line.startswith(b"data: ") and b'"text"' in line:
                    return time.monotonic()
    raise RuntimeError("the stream ended without a token")


def one_start(model: str, workload: str, mode: str, temperature: str, cache: str, args, out_dir: str) -> dict:
    """Start a server, time /health and the first token from the spawn, read its start-up from /metrics and its
    log; delayed: wait until every graph is captured. ``cache``: the $TWOGRID_CACHE it runs with, ``temperature``
    (cold or warm) what it holds."""
    extra = mode_flags(mode)
    log_path = os.path.join(out_dir, f"server-startup-{os.path.basename(model)}-{workload}-{mode}-{temperature}.log")
    env = {**os.environ, "TWOGRID_CACHE": cache}
    env.pop("TRITON_CACHE_DIR", None)  # (under $TWOGRID_CACHE: cold means no kernel either)
    t0 = time.monotonic()
    proc = subprocess.Popen(serve_command(model, workload, args.port, args, extra), stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, env=env)
    proc.log_path = log_path
    try:
        wait_healthy(proc, f"{mode} ({temperature})", args.port, poll_s=0.05)
        health = time.monotonic()
        first = asyncio.run(first_token_at(args.port, "Explain CUDA graphs in one paragraph."))
        metrics = scrape(args.port)
        at_health = graph_counts(metrics)
        done = None
        while mode == "delayed":
            counts = graph_counts(scrape(args.port))
            if counts["captured"] >= counts["planned"]:
                done = time.monotonic()
                break
            if time.monotonic() - health > 300:
                break
            time.sleep(0.05)
        text = open(log_path, encoding="utf-8", errors="replace").read()
        after = SERVING_AFTER.search(text)
        row = {"part": "startup", "model": os.path.basename(model), "workload": workload, "mode": mode,
               "cache": temperature, "health_s": round(health - t0, 2), "first_token_s": round(first - t0, 2),
               "front_end_serving_after_s": float(after.group(1)) if after else None,
               **front_end_setup(text),
               "worker_phases_s": {k: float(v) for k, v in PHASE.findall(metrics)},
               "graphs_planned": int(at_health["planned"]), "graphs_captured_at_health": int(at_health["captured"]),
               "capture_done_s": round(done - t0, 2) if done else None}
        return row
    finally:
        stop_server(proc)


STARTS = ("capture-first:cold", "capture-first:warm", "delayed:warm", "delayed:cold")
"""Per model and workload, the starts ``--starts`` names by default, in order (MODE:CACHE): a cold start runs on a
fresh, empty $TWOGRID_CACHE (Triton's kernels, the graph memory estimate), a warm one on the cache of the start
before it."""


def start_plan(starts: str, scratch: str) -> list[tuple[str, str, str]]:
    """``--starts`` -> [(mode, cold or warm, its $TWOGRID_CACHE)]; a warm start first, or an unknown mode, is an
    error naming it."""
    plan: list[tuple[str, str, str]] = []
    for i, start in enumerate(starts.split(",")):
        mode, _, temperature = start.partition(":")
        if mode not in ("capture-first", "delayed") or temperature not in ("cold", "warm"):
            raise ValueError(f"--starts: {start!r} is not MODE:CACHE with MODE capture-first or delayed and CACHE "
                             f"cold or warm")
        if temperature == "warm" and not plan:
            raise ValueError(f"--starts: {start!r} comes first, so no start before it warmed a cache")
        cache = os.path.join(scratch, f"cache-{i}") if temperature == "cold" else plan[-1][2]
        plan.append((mode, temperature, cache))
    return plan


def part_startup(args, result: dict, out_dir: str, save) -> None:
    for name in args.models.split(","):
        model = model_path(name)
        for workload in args.workloads.split(","):
            for mode, temperature, cache_dir in args.start_plan:
                if temperature == "cold":
                    shutil.rmtree(cache_dir, ignore_errors=True)
                    os.makedirs(cache_dir)
                row = one_start(model, workload, mode, temperature, cache_dir, args, out_dir)
                replace_row(result, row, ("part", "model", "workload", "mode", "cache"))
                log(f"{name} {workload} {mode} ({temperature}): /health {row['health_s']} s, first token "
                    f"{row['first_token_s']} s, phases {row['worker_phases_s']}"
                    + (f", all {row['graphs_planned']} graphs by {row['capture_done_s']} s" if mode == "delayed"
                       else ""))
                save()


def replace_row(result: dict, row: dict, key: tuple[str, ...]) -> None:
    result["rows"] = [r for r in result["rows"] if tuple(r.get(k) for k in key) != tuple(row[k] for k in key)]
    result["rows"].append(row)


# -- during and after delayed capture ---------------------------------------------------------------------------------

def trace_records(trace_path: str, during_only: bool) -> list[dict]:
    """A server's step records; ``during_only``: those up to the last one that ran without its own graph, eagerly or
    on a larger one (delayed capture still under way)."""
    recs = [json.loads(line) for line in open(trace_path, encoding="utf-8") if line.strip()]
    if during_only:
        last = max((i for i, r in enumerate(recs) if r.get("not_captured") or r.get("stand_in_for")), default=-1)
        recs = recs[:last + 1]
    return recs


def step_intervals(recs: list[dict]) -> dict[str, list[float]]:
    """ms between consecutive steps' results, by (kind, tokens rounded up to a power of two)."""
    out: dict[str, list[float]] = {}
    for prev, rec in zip(recs, recs[1:]):
        key = f"{rec['kind']}:{1 << (max(rec['tokens'], 1) - 1).bit_length()}"
        out.setdefault(key, []).append((rec["t_s"] - prev["t_s"]) * 1e3)
    return out


def during_counts(recs: list[dict]) -> dict[str, int]:
    """Of a delayed server's steps while it captured: those whose target ran eagerly for want of its graph, and those
    whose target replayed a larger captured graph instead (a stand-in)."""
    return {"target_eager_steps": sum("target" in r.get("not_captured", ()) for r in recs),
            "stand_in_steps": sum("stand_in_for" in r for r in recs)}


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def part_capture(args, result: dict, out_dir: str, save) -> None:
    for name in args.models.split(","):
        model = model_path(name)
        for workload in args.workloads.split(","):
            stem = f"{os.path.basename(model)}-{workload}"
            if not args.no_during:
                during(args, result, out_dir, save, name, model, workload, stem)
            if not args.no_after:
                after(args, result, out_dir, save, name, model, workload, stem)


def during(args, result: dict, out_dir: str, save, name: str, model: str, workload: str, stem: str) -> None:
    """(a) during capture: an eager server and a delayed one, each a fresh start sent one wave at once."""
    base_port = args.port
    traces, tok_s = {}, {}
    for mode, extra in (("eager", ["--enforce-eager"]), ("delayed", ["--delayed-cudagraph-capture"])):
        trace = os.path.join(out_dir, f"trace-during-{stem}-{mode}.jsonl")
        if os.path.exists(trace):
            os.remove(trace)
        proc = launch(serve_command(model, workload, base_port, args, extra + ["--step-trace", trace]),
                      os.path.join(out_dir, f"server-during-{stem}-{mode}.log"))
        try:
            wait_healthy(proc, mode, base_port)
            bench = run_bench(f"http://127.0.0.1:{base_port}", args.concurrency_during, f"during-{mode}",
                              os.path.join(out_dir, "bench"), bench_args(args), None, "m")
            tok_s[mode] = round(bench["output_throughput"], 1)
            log(f"{name} {workload} during capture, {mode}: {bench['output_throughput']:.0f} tok/s")
        finally:
            stop_server(proc)
        traces[mode] = trace
    during_recs = trace_records(traces["delayed"], during_only=True)
    delayed = step_intervals(during_recs)
    eager = step_intervals(trace_records(traces["eager"], during_only=False))
    groups = []
    for key, ms in sorted(delayed.items()):
        if len(ms) >= 5 and len(eager.get(key, [])) >= 5:
            groups.append({"step": key, "steps": len(ms), "delayed_median_ms": round(statistics.median(ms), 3),
                           "eager_median_ms": round(statistics.median(eager[key]), 3),
                           "ratio": round(statistics.median(ms) / statistics.median(eager[key]), 3),
                           "p90_ratio": round(p90(ms) / p90(eager[key]), 3)})
    row = {"part": "during_capture", "model": os.path.basename(model), "workload": workload,
           "concurrency": args.concurrency_during, "groups": groups,
           "worst_ratio": max((g["ratio"] for g in groups), default=None),
           "worst_p90_ratio": max((g["p90_ratio"] for g in groups), default=None),
           "steps_during_capture": sum(len(v) for v in delayed.values()) + 1, "tok_s": tok_s,
           **during_counts(during_recs)}
    replace_row(result, row, ("part", "model", "workload"))
    save()


def after(args, result: dict, out_dir: str, save, name: str, model: str, workload: str, stem: str) -> None:
    """(b) after capture: capture-first and delayed servers, alternated runs."""
    base_port = args.port
    # (started one after the other: a server sizes its KV cache from the memory it took since it started, so
    # another's load meanwhile would count as its own: kv_cache_bytes)
    first, second = args.after_modes
    names = (first, second if second != first else f"{second}-2")  # (an A/A control: the second named apart)
    procs = {}
    try:
        for i, (label, mode) in enumerate(zip(names, args.after_modes)):
            extra = mode_flags(mode)
            procs[label] = launch(serve_command(model, workload, base_port + i, args, extra),
                                  os.path.join(out_dir, f"server-after-{stem}-{label}.log"))
            wait_healthy(procs[label], label, base_port + i)
        for i in range(2):  # a delayed server first captures everything
            while (counts := graph_counts(scrape(base_port + i)))["captured"] < counts["planned"]:
                time.sleep(0.2)
        for conc in args.concurrency_after:
            runs: dict[str, list[float]] = {m: [] for m in procs}
            for rnd in range(args.rounds):
                order = list(procs) if rnd % 2 == 0 else list(reversed(procs))
                for label in order:
                    port = base_port + list(procs).index(label)
                    bench = run_bench(f"http://127.0.0.1:{port}", conc, f"after-{label}",
                                      os.path.join(out_dir, "bench"), bench_args(args), None, "m")
                    runs[label].append(round(bench["output_throughput"], 1))
            ratios = [b / a for b, a in zip(runs[names[1]], runs[names[0]])]
            row = {"part": "after_capture", "model": os.path.basename(model), "workload": workload,
                   "concurrency": conc, "modes": list(names), "tok_s": runs,
                   "ratio_median": round(statistics.median(ratios), 4), "ratios": [round(r, 4) for r in ratios]}
            replace_row(result, row, ("part", "model", "workload", "concurrency", "modes"))
            log(f"{name} {workload} after capture, {conc} streams: {names[1]} / {names[0]} "
                f"{row['ratio_median']:.4f} (runs {row['ratios']})")
            save()
    finally:
        for proc in procs.values():
            stop_server(proc)


def bench_args(args, waves: int = 1) -> argparse.Namespace:
    """``run_bench``'s settings: ``waves`` waves of prompts per run (after a warm-up wave)."""
    return argparse.Namespace(data=args.data, waves=waves, min_prompts=16)


SERVER_TREE: str | None = None
"""``--server-tree``: the checkout the servers run from (None: this one)."""


def launch(cmd: list[str], log_path: str) -> subprocess.Popen:
    env = None
    if SERVER_TREE:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([SERVER_TREE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=SERVER_TREE, env=env)
    proc.log_path = log_path
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description="start-up phases and delayed capture on the GPU")
    parser.add_argument("--part", required=True, choices=["startup", "capture"])
    parser.add_argument("--data", required=True, help="ShareGPT JSON (the headline's)")
    parser.add_argument("--tokenizer", default=None, help="SmolLM2's tokenizer directory, for the bench-moe preset")
    parser.add_argument("--models", default="bench-moe", help="bench-moe and/or default (the default model's GGUF)")
    parser.add_argument("--workloads", default="no-sd,eagle3-k7")
    parser.add_argument("--starts", default=",".join(STARTS),
                        help="--part startup: MODE:CACHE in order, MODE capture-first or delayed, CACHE cold (a fresh "
                             "cache) or warm (the previous start's) (default: %(default)s)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--port", type=int, default=8150)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="each server's (default: serve's 0.9 for part startup; 0.4 for part capture, which runs "
                             "two at once)")
    parser.add_argument("--api-server-count", type=int, default=4)
    parser.add_argument("--concurrency-during", type=int, default=256)
    parser.add_argument("--concurrency-after", default="256,1024")
    parser.add_argument("--rounds", type=int, default=3, help="alternated bench runs per server and concurrency")
    parser.add_argument("--no-after", action="store_true", help="--part capture: (a) only")
    parser.add_argument("--no-during", action="store_true", help="--part capture: (b) only")
    parser.add_argument("--after-modes", default="capture-first,delayed", metavar="A,B",
                        help="--part capture (b): the two servers compared, B / A, each capture-first or delayed, "
                             "started in that order (capture-first,capture-first: the A/A control of the pair's "
                             "order and ports)")
    parser.add_argument("--server-tree", default=None, metavar="DIR",
                        help="run the servers from this checkout (an earlier commit's, for an A/B in one lease: use "
                             "another --out); the benchmark's own code stays this one's")
    args = parser.parse_args()
    global SERVER_TREE
    SERVER_TREE = os.path.abspath(args.server_tree) if args.server_tree else None
    args.data = os.path.abspath(args.data)
    args.tokenizer = os.path.abspath(args.tokenizer) if args.tokenizer else None
    args.concurrency_after = [int(c) for c in args.concurrency_after.split(",")]
    args.after_modes = tuple(args.after_modes.split(","))
    if len(args.after_modes) != 2 or not set(args.after_modes) <= set(MODES):
        parser.error(f"--after-modes: two of {', '.join(MODES)}, comma-separated")
    from models.config import PRESETS

    if any(m in PRESETS for m in args.models.split(",")) and not args.tokenizer:
        parser.error("a preset model serves text only with --tokenizer (SmolLM2's: .gpu_data/smollm2-tokenizer)")
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = 0.9 if args.part == "startup" else 0.4
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else os.getcwd()
    result = {"rows": []}
    if args.out and os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as fh:
            result = json.load(fh)
    result.update(device=os.environ.get("TWOGRID_DEVICE_NAME") or device_name(), commit=commit(),
                  output_len=OUTPUT_LEN, fixed_acceptance_eagle3_bench_moe=FIXED_ACCEPTANCE)
    result.setdefault("commands", []).append("PYTHONPATH=.:benchmarks python benchmarks/bench_startup_gpu.py "
                                             + shlex.join(sys.argv[1:]))
    try:
        start_plan(args.starts, "")  # (checked before the scratch folder exists)
    except ValueError as exc:
        parser.error(str(exc))
    scratch = tempfile.mkdtemp(prefix="twogrid-startup-")
    args.start_plan = start_plan(args.starts, scratch)

    def save() -> None:
        write_json(args.out, result)

    try:
        (part_startup if args.part == "startup" else part_capture)(args, result, out_dir, save)
    finally:
        save()
        shutil.rmtree(scratch, ignore_errors=True)


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.strip().splitlines()
        return out[0] if out else "cpu"
    except (OSError, subprocess.SubprocessError):
        return "cpu"


if __name__ == "__main__":
    main()
