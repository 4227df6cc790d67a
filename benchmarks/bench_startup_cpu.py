"""``twogrid serve``'s start-up on this machine's CPU, with no GPU (issue 33): per start, from the moment the process
is spawned, /health's first 200 and the first streamed token of a request sent then; the median of ``--runs``
starts per code tree. Several trees (``--trees``, comma-separated repository roots, e.g. a checkout of the base
commit beside this one) start in alternation, so that a machine whose load drifts weighs on each alike.

    python benchmarks/bench_startup_cpu.py --trees /tmp/base,. --runs 3 -- --model tiny-moe --num-kv-blocks 512 \\
        --delayed-cudagraph-capture

A preset has no tokenizer: the request's prompt is token ids, and its first streamed chunk counts as the first
token. The arguments after ``--`` go to ``twogrid serve`` (``--device cpu``, the port and the served name are
added).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from _common import front_end_setup, stop_server  # (importing _common puts the repository on sys.path)
from bench_headline_gpu import wait_healthy



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(tree: str, serve_args: list[str], log_path: str) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "dispatcher", "serve", "--device", "cpu", "--port", str(port),
           "--served-model-name", "m", *serve_args]
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tree,
                                env={**os.environ, "PYTHONPATH": os.path.abspath(tree)})
    proc.log_path = log_path
    try:
        wait_healthy(proc, tree, port, poll_s=0.02)
        health = time.monotonic() - t0
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = {"model": "m", "prompt": list(range(1, 9)), "max_tokens": 8, "stream": True, "ignore_eos": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        first = None
        for line in conn.getresponse():
            if line.startswith(b"data: ") and b'"text"' in line:
                first = time.monotonic() - t0
                break
        conn.close()
    finally:
        stop_server(proc)
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        setup = front_end_setup(fh.read())
    return {"health_s": round(health, 2), "first_token_s": round(first, 2) if first is not None else None, **setup}


def main() -> None:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", default=".", help="repository roots, comma-separated (default: this one)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    trees = args.trees.split(",")
    rows: dict[str, list[dict]] = {t: [] for t in trees}
    logs = tempfile.mkdtemp(prefix="twogrid-startup-cpu-")
    for i in range(args.runs):
        for j, tree in enumerate(trees):
            row = one_start(tree, serve_args, os.path.join(logs, f"server-{j}-{i}.log"))
            rows[tree].append(row)
            print(f"{tree} run {i}: {row}", flush=True)
    for tree, runs in rows.items():
        print(json.dumps({"tree": tree, "serve_args": serve_args, "runs": runs,
                          "median_health_s": statistics.median(r["health_s"] for r in runs),
                          "median_first_token_s": statistics.median(r["first_token_s"] for r in runs)}))
    print(f"server logs in {logs}")


if __name__ == "__main__":
    main()
