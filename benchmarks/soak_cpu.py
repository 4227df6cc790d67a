"""The soak of issue 15: ``--streams`` concurrent streams (1024), ``--rounds`` rounds (3), against one ``twogrid
serve`` on the CPU with the tiny random-weight preset (tiny-dense), short seeded outputs.

    python benchmarks/soak_cpu.py [--streams 1024] [--rounds 3] [--max-tokens 32] [--out docs/bench/soak_cpu.json]

The server runs 256 requests at a time (the rest wait) on a KV cache of 1024 blocks, less than 256 requests can
hold at their longest, so the scheduler also preempts. Each stream asks for logprobs, so every chunk names its
token ids; a round counts, per stream: completed (a finish reason, ``[DONE]``, exactly the offline engine's tokens
for its prompt and seed, usage equal to them), failed (an error), lost (anything else: a missing or wrong token,
no ``[DONE]``), and duplicated chunks (tokens beyond the reference). After each round, once the server is idle:
the free KV blocks against the cache's size, the requests the server counted as ended (each exactly once), and
the RSS of the server and of its worker. The JSON (``--out``) has the commit, the settings, the rounds and the
load average at each round's start (the machine is shared: load slows a round, it does not change its counts).
Exit status 1 when any round lost, duplicated or failed a stream, leaked a block, or the RSS grew.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

from _common import commit, write_json  # noqa: E402  (puts the repository on sys.path)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from serverutil import (OfflineReference, Server, count_round, finished_requests, request_body, rss_bytes,  # noqa: E402
                        run_streams, token_prompts, wait_idle)

MODEL, VOCAB, MAX_MODEL_LEN = "tiny-dense", 512, 256
RSS_GROWTH_LIMIT = 0.05
"""The RSS after the last round may exceed the RSS after the first by this fraction (plus 16 MiB) at most."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--out", default=None, help="write the result here (e.g. docs/bench/soak_cpu.json)")
    args = p.parse_args()

    bodies = [request_body(prompt, args.max_tokens, seed=i)
              for i, prompt in enumerate(token_prompts(args.streams, VOCAB, 4, 64, seed=15))]
    t0 = time.perf_counter()
    reference = OfflineReference(MODEL, MAX_MODEL_LEN)(bodies)
    reference_s = time.perf_counter() - t0
    server_args = ["--model", MODEL, "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs",
                   str(args.max_num_seqs), "--num-kv-blocks", str(args.num_kv_blocks), "--log-level", "warning"]
    server = Server(server_args, os.path.join(tempfile.mkdtemp(prefix="soak-"), "server.log")).wait_healthy()
    rounds = []
    try:
        wait_idle(server)
        rss0 = {"server_rss_mib": _mib(rss_bytes(server.proc.pid)),
                "worker_rss_mib": _mib(rss_bytes(server.worker_pid()))}
        for r in range(args.rounds):
            load = os.getloadavg()[0]
            before = wait_idle(server)
            streams, wall_s = run_streams(server.base, bodies)
            figures = count_round(streams, reference, wall_s)
            end = wait_idle(server)
            rounds.append({
                "round": r + 1, **figures.__dict__,
                "server_counted_ended": finished_requests(end) - finished_requests(before),
                "output_tokens": sum(len(s.tokens) for s in streams),
                "preemptions": end["twogrid:num_preemptions_total"] - before["twogrid:num_preemptions_total"],
                "kv_free_blocks_start": before["twogrid:kv_cache_free_blocks"],
                "kv_free_blocks_end": end["twogrid:kv_cache_free_blocks"], "kv_blocks": end["twogrid:kv_cache_blocks"],
                "kv_usage_end": end["twogrid:kv_cache_usage_perc"],
                "server_rss_mib": _mib(rss_bytes(server.proc.pid)),
                "worker_rss_mib": _mib(rss_bytes(server.worker_pid())),
                "load_average_at_start": round(load, 2)})
            print(f"round {r + 1}: " + ", ".join(f"{k} {v}" for k, v in rounds[-1].items() if k != "round"), flush=True)
    finally:
        server.signal()
        code = server.wait(60)
        server.stop()
    problems = _problems(rounds, args.streams)
    result = {
        "commit": commit(), "machine": {"cpu": platform.machine(), "cores": os.cpu_count(),
                                        "python": platform.python_version()},
        "settings": {"model": MODEL, "streams": args.streams, "rounds": args.rounds, "max_tokens": args.max_tokens,
                     "prompt_tokens": "4..64", "sampling": "temperature 0.8, seed = stream index, ignore_eos",
                     "server_args": server_args},
        "reference_s": round(reference_s, 1), "rss_before_rounds": rss0, "rounds": rounds,
        "server_exit_code_after_sigterm": code, "problems": problems, "ok": not problems and code == 0}
    write_json(args.out, result)
    print("OK" if result["ok"] else f"FAILED: {problems}")
    return 0 if result["ok"] else 1


def _problems(rounds: list[dict], streams: int) -> list[str]:
    out = []
    for r in rounds:
        if (r["completed"], r["failed"], r["lost"], r["duplicated_chunks"]) != (streams, 0, 0, 0):
            out.append(f"round {r['round']}: {r['completed']} completed, {r['failed']} failed, {r['lost']} lost, "
                       f"{r['duplicated_chunks']} duplicated chunks")
        if r["server_counted_ended"] != streams:
            out.append(f"round {r['round']}: the server counted {r['server_counted_ended']} requests ended")
        if r["kv_free_blocks_end"] != r["kv_blocks"] or r["kv_usage_end"] != 0.0:
            out.append(f"round {r['round']}: {r['kv_free_blocks_end']} of {r['kv_blocks']} KV blocks free at the end")
    for key in ("server_rss_mib", "worker_rss_mib"):
        if rounds and rounds[-1][key] > rounds[0][key] * (1 + RSS_GROWTH_LIMIT) + 16:
            out.append(f"{key} grew from {rounds[0][key]} to {rounds[-1][key]} after the first round")
    return out


def _mib(n: int) -> float:
    return round(n / 2**20, 1)


if __name__ == "__main__":
    sys.exit(main())
