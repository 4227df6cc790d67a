"""Prefix caching served (issue 30): ``twogrid serve`` with ``--enable-prefix-caching`` and with
``--no-enable-prefix-caching``, driven by ``twogrid bench``, per model, workload and concurrency: output tok/s, TTFT
p50 and p99, the prefix cache's hit rate (``twogrid:prefix_cache_hits_total`` / ``queries_total`` over the run),
eager steps (by reason) and graph steps by kind and mode (the prefill grid's mixed steps, the decode grid's uniform
decodes), padded tokens.

Models (``--models``): ``bench-moe`` (random weights, Granite-3.0-1B-A400M's shape, SmolLM2's tokenizer:
``--tokenizer``) and ``default`` (SmolLM2-135M-Instruct's GGUF, its own tokenizer). Per model both servers (caching
on and off) are started together, each with a KV cache of ``--kv-gib`` GiB (``--num-kv-blocks``: a memory fraction
would count the other server's memory as used; the headline's flags otherwise: separate grids, sm100, 1024
requests and 16384 tokens a step), and each cell runs on one, then the other. Workloads (``--workloads``):

  multi-turn         ShareGPT conversations through /v1/chat/completions (``twogrid bench --multi-turn``): each
                     turn sent with the conversation so far, the model's own answers in it. The ShareGPT file at
                     hand holds first turns only, so the script chains ``--turns`` of its prompts into each
                     conversation (a file per run, every turn led by a tag of its own, so that no run finds
                     another's in the cache, nor a front end a turn's text among those it tokenized); N
                     conversations at N streams.
  prefix-repetition  vLLM's prefix_repetition dataset through /v1/completions: ``--prefix-len`` words (about a token
                     each) shared by each of N / 16 prefixes (at least 2), ``--suffix-len`` of each prompt's own; 2N
                     prompts at N streams (a seed per concurrency: fresh prefixes per run).
  no-prefix          the random dataset (``--random-len`` words, no shared prefix): what hashing costs where the
                     cache finds nothing; 2N prompts at N streams.

``--rounds R`` runs every cell R times, on and off alternated, each round with fresh prompts (its own seed and
conversation tags): the summary's ratios are the medians of the rounds' (the 2% target needs more than one run).
Every run: ``--output-len`` tokens a request, EOS ignored, a warm-up of min(N, 256) synthetic requests (not
measured; they share nothing with the measured ones), ``--num-clients`` as the headline's. ``summary`` holds, per
model, workload and concurrency, the TTFT p50 ratio (off / on), the tok/s ratio (on / off) and the targets: on
multi-turn at 256 streams TTFT p50 at least 2x lower with caching on; on no-prefix no concurrency more than 2% slower.
Multi-turn rows hold each turn's prompt tokens and cached share (``twogrid bench``'s, from the responses' usage) and
the KV the last turn's requests hold together against the pool's tokens: a run whose last turn outgrew the pool (its
histories evicted before the next turn came back) is flagged in its log line and counted in the summary's
``kv_pool_short_rounds``; its hit rate is the pool's, not the cache's (bench-moe's fourth turn at 8 GiB a server).

    PYTHONPATH=.:benchmarks python benchmarks/bench_prefix_cache_gpu.py --data .gpu_data/sharegpt.json \\
        --tokenizer .gpu_data/smollm2-tokenizer --max-num-batched-tokens 4096 --out $OUT/prefix_cache_h100.json

(about 8 minutes on an H200; the default model's half 2.7 minutes on an H100 at 2fabc49,
``docs/bench/prefix_cache_h100.json``: two pairs of servers, 24 cells, 48 bench runs; under a 10-minute limit per call,
run ``--models bench-moe`` then ``--models default --resume``, about 4 minutes each: ``--resume`` keeps the rows of an
existing ``--out`` and measures only the missing cells). A CPU dry run: ``--device cpu --models default --concurrency 2
--turns 2 --output-len 4 --prefix-len 64 --suffix-len 8 --random-len 32 --api-server-count 1 --min-prompts 4
--max-model-len 1024 --kv-gib 0.25``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time

# (importing _common puts the repository on sys.path)
from _common import conversations_file, commit, kv_blocks, loop_holds, markdown_grid, stop_server as stop, write_json
from bench_headline_gpu import launch, num_clients, serve_command, wait_healthy
from bench_spec_gpu import log, log_tail

from scheduler.scheduler import SchedulerConfig

WORKLOADS = ("multi-turn", "prefix-repetition", "no-prefix")
MODELS = ("bench-moe", "default")
SERVED_NAME = "served"
BLOCK_SIZE = SchedulerConfig.block_size
"""The servers' KV block size (twogrid serve's default)."""


def cell(row: dict) -> tuple:
    return row["model"], row["workload"], row["concurrency"], row["prefix_caching"], row.get("round", 0)


def bench_command(workload: str, conc: int, base: str, args, work_dir: str, rnd: int = 0) -> list[str]:
    """``twogrid bench``'s command for one run (a seed of the concurrency and round: fresh prompts per run, the same
    for the two servers)."""
    seed = 1000 + conc + 100_000 * rnd
    cmd = [sys.executable, "-m", "dispatcher", "bench", "--base-url", base, "--model", SERVED_NAME, "--ignore-eos",
           "--max-concurrency", str(conc), "--num-warmups", str(min(conc, 256)), "--num-clients",
           str(num_clients(conc)), "--metric-percentiles", "50,99", "--seed", str(seed), "--disable-tqdm"]
    if workload == "multi-turn":
        tag = f"c{conc}" + (f"r{rnd}" if rnd else "")
        path = conversations_file(args.data, max(conc, args.min_prompts), args.turns, tag,
                                  os.path.join(work_dir, f"conversations-{tag}.json"))
        return cmd + ["--endpoint", "chat", "--dataset-name", "sharegpt", "--dataset-path", path, "--multi-turn",
                      "--max-turns", str(2 * args.turns), "--num-prompts", str(max(conc, args.min_prompts)),
                      "--sharegpt-output-len", str(args.output_len)]
    prompts = str(max(2 * conc, args.min_prompts))
    if workload == "prefix-repetition":
        return cmd + ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
                      "--prefix-repetition-suffix-len", str(args.suffix_len), "--prefix-repetition-num-prefixes",
                      str(max(2, conc // 16)), "--prefix-repetition-output-len", str(args.output_len),
                      "--num-prompts", prompts]
    return cmd + ["--dataset-name", "random", "--random-input-len", str(args.random_len), "--random-output-len",
                  str(args.output_len), "--num-prompts", prompts]


def run_bench(workload: str, conc: int, base: str, args, work_dir: str, name: str, rnd: int = 0) -> dict:
    out_dir = os.path.join(work_dir, "bench")
    cmd = bench_command(workload, conc, base, args, work_dir, rnd)
    cmd += ["--save-result", "--result-dir", out_dir, "--result-filename", f"{name}.json", "--label", name]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, f"{name}.json"), encoding="utf-8") as fh:
        return json.load(fh)


def make_row(model: str, workload: str, conc: int, caching: bool, b: dict, rnd: int = 0,
             kv_pool_tokens: int | None = None, output_len: int = 0, conversations: int | None = None) -> dict:
    """One run's row. Multi-turn rows also hold each turn's prompt tokens and hit rate, and the KV that the last
    turn's requests hold at once beside the server's pool (``kv_pool_tokens``): ``conc`` of the ``conversations``
    (one a stream, each holding its stream through its turns), their prompts plus ``output_len`` each and a block's
    rounding: a pool short of it evicts, in LRU order, the histories the next turns come back for."""
    turn_tokens = b.get("prompt_tokens_by_turn")
    live = min(1.0, conc / conversations) if conversations else 1.0
    last_turn_kv = (round(turn_tokens[-1] * live) + conc * (output_len + BLOCK_SIZE - 1)) if turn_tokens else None
    return {"model": model, "workload": workload, "concurrency": conc, "prefix_caching": caching, "round": rnd,
            "prefix_cache_hit_rate_by_turn": b.get("prefix_cache_hit_rate_by_turn"),
            "prompt_tokens_by_turn": turn_tokens, "last_turn_kv_tokens": last_turn_kv, "kv_pool_tokens": kv_pool_tokens,
            "output_tok_s": round(b["output_throughput"], 1), "ttft_ms_p50": round(b["p50_ttft_ms"], 2),
            "ttft_ms_p99": round(b["p99_ttft_ms"], 2), "ttft_ms_mean": round(b["mean_ttft_ms"], 2),
            "tpot_ms_mean": round(b["mean_tpot_ms"], 3), "prefix_cache_hit_rate": b.get("prefix_cache_hit_rate"),
            "server_ttft_ms_mean": b.get("server_ttft_ms_mean"), "server_queue_ms_mean": b.get("server_queue_ms_mean"),
            "server_prefill_ms_mean": b.get("server_prefill_ms_mean"),
            "server_preprocess_ms_mean": b.get("server_preprocess_ms_mean"),
            "ttft_ms_p50_by_turn": b.get("median_ttft_ms_by_turn"),
            "prefix_cache_queries": b.get("prefix_cache_queries"), "prefix_cache_hits": b.get("prefix_cache_hits"),
            "eager_steps": b.get("eager_steps"), "eager_steps_by_reason": b.get("eager_steps_by_reason"),
            "cudagraph_steps_by_kind_mode": b.get("cudagraph_steps_by_kind_mode"),
            "padded_tokens": b.get("padded_tokens"), "step_device_seconds": b.get("step_device_seconds"),
            "completed": b["completed"], "failed": b["failed"], "total_input_tokens": b["total_input_tokens"],
            "total_output_tokens": b["total_output_tokens"], "duration_s": round(b["duration"], 3),
            "num_clients": b.get("num_clients")}


def default_kv_gib(device: str, total_bytes: int | None = None) -> float:
    """Each server's KV cache when ``--kv-gib`` is not given: a third of the GPU's memory (two servers, their weights
    and graphs beside them), at most 48 GiB (the H200 runs'); 48 without a GPU to ask (a CPU dry run sets its own)."""
    if total_bytes is None:
        if not device.startswith("cuda"):
            return 48.0
        import torch

        if not torch.cuda.is_available():
            return 48.0
        total_bytes = torch.cuda.get_device_properties(0).total_memory
    return min(48.0, round(total_bytes / 3 / 2**30, 1))


def pool_note(row: dict) -> str:
    """Where a multi-turn run's last turn held more KV than the server's pool: what that does to its hit rate."""
    need, pool = row.get("last_turn_kv_tokens"), row.get("kv_pool_tokens")
    if need is None or pool is None or need <= pool:
        return ""
    return (f"the last turn's KV ({need} tokens) exceeds the pool ({pool}): a history can be evicted before its "
            "next turn comes back for it (a larger --kv-gib keeps them)")


def _by_turn_ratio(off: dict, on: dict) -> list | None:
    """Multi-turn rows: each turn's TTFT p50 off / on (None where a side has no such turn)."""
    a, b = off.get("ttft_ms_p50_by_turn"), on.get("ttft_ms_p50_by_turn")
    if not a or not b:
        return None
    return [x / y if x is not None and y else None for x, y in zip(a, b)]


def summarize(rows: list[dict]) -> dict:
    """Per model, workload and concurrency with both servers measured: TTFT p50 off / on, tok/s on / off (with
    ``--rounds``: the medians of the rounds' ratios, each round's in ``*_rounds``), and for multi-turn each turn's
    TTFT p50 off / on (``ttft_p50_off_over_on_by_turn``, the median of the rounds' turn by turn: a first turn has
    nothing to find in the cache); the targets where their cells were measured (None where not)."""
    by = {cell(r): r for r in rows}
    ratios: dict[tuple, list[tuple]] = {}
    for (model, workload, conc, caching, rnd), on in sorted(by.items(), key=lambda kv: kv[0][4]):
        off = by.get((model, workload, conc, False, rnd))
        if caching and off is not None:
            ratios.setdefault((model, workload, conc), []).append((
                off["ttft_ms_p50"] / on["ttft_ms_p50"] if on["ttft_ms_p50"] else None,
                on["output_tok_s"] / off["output_tok_s"] if off["output_tok_s"] else None,
                on["prefix_cache_hit_rate"], _by_turn_ratio(off, on), bool(pool_note(on))))

    def median(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    pairs = []
    for (model, workload, conc), runs in ratios.items():
        ttft, tok_s, hits, turns, short = zip(*runs)
        pair = {"model": model, "workload": workload, "concurrency": conc,
                "ttft_p50_off_over_on": None if median(ttft) is None else round(median(ttft), 3),
                "tok_s_on_over_off": None if median(tok_s) is None else round(median(tok_s), 4),
                "hit_rate": median(hits)}
        if any(short):
            pair["kv_pool_short_rounds"] = sum(short)  # (see pool_note: the hit rate is the pool's, not the cache's)
        turns = [t for t in turns if t is not None]
        if turns:
            by_turn = [median([t[i] for t in turns if i < len(t)]) for i in range(max(map(len, turns)))]
            pair["ttft_p50_off_over_on_by_turn"] = [None if x is None else round(x, 3) for x in by_turn]
        if len(runs) > 1:
            pair["rounds"] = len(runs)
            pair["ttft_p50_off_over_on_rounds"] = [None if x is None else round(x, 3) for x in ttft]
            pair["tok_s_on_over_off_rounds"] = [None if x is None else round(x, 4) for x in tok_s]
        pairs.append(pair)
    mt = [p["ttft_p50_off_over_on"] for p in pairs if p["workload"] == "multi-turn" and p["concurrency"] == 256]
    nop = [p["tok_s_on_over_off"] for p in pairs if p["workload"] == "no-prefix"]
    return {"pairs": pairs,
            "multi_turn_256_ttft_p50_at_least_2x": all(x is not None and x >= 2.0 for x in mt) if mt else None,
            "no_prefix_at_most_2pct_slower": all(x is not None and x >= 0.98 for x in nop) if nop else None,
            "no_prefix_worst_tok_s_ratio": min(nop) if nop else None}


def markdown(rows: list[dict]) -> str:
    """A table per model and workload: caching on and off per concurrency, each cell tok/s, TTFT p50 / p99 (ms),
    the hit rate and eager steps."""
    def fmt(r: dict) -> str:
        hit = r["prefix_cache_hit_rate"]
        return (f"{r['output_tok_s']:.0f} tok/s, TTFT {r['ttft_ms_p50']:.0f}/{r['ttft_ms_p99']:.0f} ms"
                + (f", hit {hit:.0%}" if hit is not None and r["prefix_caching"] else "")
                + f", {r['eager_steps']} eager")

    return markdown_grid(rows, lambda r: f"{r['model']} {r['workload']}",
                         lambda r: ("caching on" if r["prefix_caching"] else "caching off")
                         + (f", round {r['round']}" if r.get("round") else ""), fmt)


def serve_pair(model: str, args, work_dir: str, num_kv_blocks: int) -> dict[bool, tuple[subprocess.Popen, int]]:
    """Both servers of a model (caching on at ``--port``, off at ``--port`` + 1), started together, ready;
    ``args.model`` and ``args.tokenizer`` set to the model's."""
    procs = {}
    for caching, port in ((True, args.port), (False, args.port + 1)):
        cmd = serve_command("separate", None, port, args, SERVED_NAME)
        cmd += ["--num-kv-blocks", str(num_kv_blocks)]
        if not caching:
            cmd.append("--no-enable-prefix-caching")
        if args.max_num_batched_tokens:  # (argparse keeps the last: this one over serve_command's 16384)
            cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if args.compilation_config:  # (likewise over the separate policy's)
            cmd += ["--compilation-config", args.compilation_config]
        side = "on" if caching else "off"
        if args.step_trace_dir:
            os.makedirs(args.step_trace_dir, exist_ok=True)
            cmd += ["--step-trace", os.path.join(args.step_trace_dir, f"trace-{model}-{side}.jsonl")]
        log_path = os.path.join(work_dir, f"server-{model}-{side}.log")
        procs[caching] = (launch(cmd, f"{model} caching {caching}", port, log_path, wait=False), port)
    try:
        for caching, (proc, port) in procs.items():
            wait_healthy(proc, f"{model} caching {caching}", port)
    except RuntimeError:  # (the other one is stopped too)
        for proc, _ in procs.values():
            stop(proc)
        raise
    return procs


def measure(result: dict, models: list[str], workloads: list[str], concs: list[int], args, work_dir: str,
            save) -> None:
    done = {cell(r) for r in result["rows"]}
    for model in models:
        todo = [(w, c, rnd) for w in workloads for c in concs for rnd in range(args.rounds)
                if (model, w, c, True, rnd) not in done or (model, w, c, False, rnd) not in done]
        if not todo:
            continue
        t0 = time.monotonic()
        log(f"{model}: starting both servers")
        args.model, args.tokenizer = (("bench-moe", args.moe_tokenizer) if model == "bench-moe"
                                      else (args.default_model, None))
        num_kv_blocks = kv_blocks(args.model, args.kv_gib, BLOCK_SIZE)
        try:
            procs = serve_pair(model, args, work_dir, num_kv_blocks)
        except RuntimeError as exc:
            result["errors"].append({"model": model, "error": str(exc)})
            save()
            continue
        pool_tokens = num_kv_blocks * BLOCK_SIZE
        result["servers"].append({"model": model, "start_s": round(time.monotonic() - t0, 1),
                                  "kv_pool_tokens": pool_tokens})
        try:
            for i, (workload, conc, rnd) in enumerate(todo):
                order = (True, False) if i % 2 == 0 else (False, True)  # (neither side always runs first)
                for caching in order:
                    if (model, workload, conc, caching, rnd) in done:
                        continue
                    proc, port = procs[caching]
                    name = f"{model}-{workload}-c{conc}-{'on' if caching else 'off'}" + (f"-r{rnd}" if rnd else "")
                    try:
                        b = run_bench(workload, conc, f"http://127.0.0.1:{port}", args, work_dir, name, rnd)
                    except subprocess.CalledProcessError as exc:
                        result["errors"].append({"model": model, "workload": workload, "concurrency": conc,
                                                 "prefix_caching": caching, "error": f"bench exited {exc.returncode}",
                                                 "server_alive": proc.poll() is None,
                                                 "log_tail": log_tail(proc.log_path)})
                        save()
                        continue
                    row = make_row(model, workload, conc, caching, b, rnd, pool_tokens, args.output_len,
                                   max(conc, args.min_prompts))
                    result["rows"].append(row)
                    save()
                    note = pool_note(row)
                    log(f"{name}: {row['output_tok_s']:.0f} tok/s, TTFT p50 {row['ttft_ms_p50']:.1f} ms p99 "
                        f"{row['ttft_ms_p99']:.1f} ms, hit rate {row['prefix_cache_hit_rate']}, "
                        f"{row['eager_steps']} eager"
                        + (f", TTFT p50 by turn {row['ttft_ms_p50_by_turn']}" if row["ttft_ms_p50_by_turn"] else "")
                        + (f", hit rate by turn {row['prefix_cache_hit_rate_by_turn']}" if caching
                           and row["prefix_cache_hit_rate_by_turn"] else "")
                        + (f"; {note}" if note else ""))
        finally:
            for proc, _ in procs.values():
                stop(proc)
            for caching, (proc, _) in procs.items():
                try:
                    with open(proc.log_path, encoding="utf-8", errors="replace") as fh:
                        result["servers"].append({"model": model, "prefix_caching": caching,
                                                  **loop_holds(fh.read())})
                except OSError as exc:
                    result["errors"].append({"model": model, "error": f"server log: {exc}"})
            save()


def main() -> None:
    parser = argparse.ArgumentParser(description="prefix caching served: caching on vs off per model, workload and "
                                                 "concurrency")
    parser.add_argument("--data", required=True, help="ShareGPT JSON (the headline's)")
    parser.add_argument("--tokenizer", dest="moe_tokenizer", required=True, help="SmolLM2's tokenizer, for bench-moe")
    parser.add_argument("--out", default=None)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--concurrency", default="16,64,256,1024")
    parser.add_argument("--turns", type=int, default=4, help="multi-turn: user turns per conversation")
    parser.add_argument("--output-len", type=int, default=128, help="tokens per request (EOS ignored)")
    parser.add_argument("--prefix-len", type=int, default=1024, help="prefix-repetition: shared prefix, words")
    parser.add_argument("--suffix-len", type=int, default=64, help="prefix-repetition: each prompt's own, words")
    parser.add_argument("--random-len", type=int, default=512, help="no-prefix: prompt words")
    parser.add_argument("--min-prompts", type=int, default=32, help="prompts (conversations) per run at least")
    parser.add_argument("--resume", action="store_true", help="keep the rows of an existing --out")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each cell, on and off alternated, each round "
                        "with fresh prompts (the summary's ratios: the rounds' medians)")
    parser.add_argument("--default-model", default=None, help="default: the default model's GGUF")
    parser.add_argument("--port", type=int, default=8123, help="caching on's port (off's: the next)")
    parser.add_argument("--api-server-count", type=int, default=4)
    parser.add_argument("--stream-interval", type=int, default=1, help="the servers' --stream-interval (tokens a "
                        "chunk after the first)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-gib", type=float, default=None, help="each server's KV cache, GiB (two run at once; "
                        "default: a third of the GPU's memory, at most 48: 48 on an H200, ~26 on an H100)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the servers' token budget a step (default: the headline's 16384)")
    parser.add_argument("--compilation-config", default=None, metavar="JSON",
                        help="both servers' compilation config (default: separate grids' defaults), e.g. "
                        "'{\"max_full_mixed_cudagraph_capture_tokens\": 4096}': a burst's mixed steps on FULL graphs")
    parser.add_argument("--step-trace-dir", default=None, help="each server writes its step trace here "
                        "(trace-MODEL-on.jsonl, trace-MODEL-off.jsonl: every round of the cells run on it)")
    args = parser.parse_args()
    models, workloads = args.models.split(","), args.workloads.split(",")
    if bad := (set(models) - set(MODELS)) | (set(workloads) - set(WORKLOADS)):
        parser.error(f"unknown {', '.join(sorted(bad))} (models {', '.join(MODELS)}; workloads {', '.join(WORKLOADS)})")
    concs = [int(c) for c in args.concurrency.split(",")]
    if args.kv_gib is None:
        args.kv_gib = default_kv_gib(args.device)
    if "default" in models and args.default_model is None:
        from models.default_model import DefaultModelError, default_model_path

        try:
            args.default_model = default_model_path()
        except DefaultModelError as exc:
            raise SystemExit(f"--default-model: {exc}") from None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (a timeout's SIGTERM: stop the servers on the way out)
    work_dir = os.path.dirname(args.out) if args.out else "."
    os.makedirs(work_dir or ".", exist_ok=True)
    result = {"command": "PYTHONPATH=.:benchmarks python benchmarks/bench_prefix_cache_gpu.py "
                         + shlex.join(sys.argv[1:]),
              "commit": commit(), "device": args.device, "output_len": args.output_len, "turns": args.turns,
              "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "random_len": args.random_len,
              "max_num_batched_tokens": args.max_num_batched_tokens or 16384, "kv_gib": args.kv_gib,
              "models": models, "workloads": workloads, "concurrency": concs, "rows": [], "servers": [],
              "errors": []}
    if args.resume and args.out and os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as fh:
            old = json.load(fh)
        result["rows"], result["servers"], result["errors"] = old["rows"], old["servers"], old["errors"]
        result["resumed_from"] = {"command": old["command"], "commit": old["commit"]}

    def save() -> None:
        result["summary"] = summarize(result["rows"])
        write_json(args.out, result)

    t0 = time.monotonic()
    measure(result, models, workloads, concs, args, work_dir, save)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    save()
    print(markdown(result["rows"]))
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
