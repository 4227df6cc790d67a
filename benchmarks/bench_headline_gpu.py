"""The headline benchmark (issue 14): ``twogrid serve`` per capture policy, driven by ``twogrid bench`` with the
ShareGPT prompts, 256 output tokens each with EOS ignored, at several concurrencies; and (issue 13) the serving
path's overhead against the offline engine on the same prompts.

The model is the bench-moe preset (random weights, Granite-3.0-1B-A400M's shape) given SmolLM2's tokenizer
(``--tokenizer``: the two vocabularies match) so that it serves text. Per policy and workload one server is
started (capture included) and every concurrency runs against it, each ``--waves`` x ``concurrency`` requests
kept ``concurrency`` in flight, after a warm-up wave of as many (synthetic prompts of the same lengths: a server's
first steps at a new size compile Triton kernels, which a single measured wave would count). Policies
(``--compilation-config`` each, every other flag equal):

  vllm-default  the shared token list at vLLM's default cap on Hopper (max_cudagraph_capture_size 512)
  legacy-1024   the shared token list to 1024
  separate      separate grids (this project's sm100 defaults)
  sglang        SGLang's decode and prefill lists under speculative decoding (H200, TP < 4)
  trtllm        TensorRT-LLM's decode list (1, 2, 4, 8..128 step 8), no prefill graphs
  vllm-default-twin  a second server of vllm-default: an A/A control, whose ratio to vllm-default is the run's
                noise between server instances (with --alternate, at 1-16 streams, where all lists replay the
                same graphs)
  separate-sglang-prefill  separate grids' decode grid with SGLang's prefill token list (58 sizes, 32-64 apart
                between 256 and 1024 tokens, where the prefill grid's are 256 apart): what a finer prefill list
                is worth

Per row: the bench's output tok/s, TPOT and TTFT, and from the server's /metrics (deltas over the run): eager
steps, padded tokens, steps, and the steps' device time; ``gpu_busy`` is that over the run's duration and
``bound_ratio`` is vllm-default's device time for the same workload and concurrency over this policy's (what the
graphs alone would give). ``serve_overhead`` rows compare the server's tok/s with the offline EngineCore's on the
same tokenized prompts (separate grids).

Small concurrencies (1-16 streams) measure the host as much as the graphs: the same step's time varies by up to 40%
from one span of requests to the next. There, ``--alternate SLOTS`` runs every policy's server at once and lets the
policies take turns batch by batch (the rows add each batch's seconds and ``paired_ratio_median``);
``--interleave ROUNDS`` does the same with whole ``twogrid bench`` runs, which proved too coarse
(docs/headline.md).

    PYTHONPATH=. python benchmarks/bench_headline_gpu.py --data .gpu_data/sharegpt.json \\
        --tokenizer .gpu_data/smollm2-tokenizer --out $OUT/headline_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from _common import commit, write_json  # (importing _common puts the repository on sys.path)
from models.config import PRESETS

OUTPUT_LEN = int(os.environ.get("HEADLINE_OUTPUT_LEN", "256"))  # (a CPU dry run sets it lower)
POLICIES = {
    "vllm-default": {"max_cudagraph_capture_size": 512},
    "legacy-1024": {"max_cudagraph_capture_size": 1024},
    "separate": {},
    "sglang": {"decode_cudagraph_capture_request_sizes": list(range(1, 9)) + list(range(10, 33, 2))
               + list(range(40, 65, 4)) + list(range(72, 257, 8)),
               "prefill_cudagraph_capture_token_sizes": list(range(4, 33, 4)) + list(range(48, 257, 16))
               + list(range(288, 513, 32)) + list(range(576, 1025, 64)) + list(range(1280, 4097, 256))
               + list(range(4608, 8193, 512)),
               "max_decode_cudagraph_capture_tokens": None},
    "trtllm": {"decode_cudagraph_capture_request_sizes": [1, 2, 4] + list(range(8, 129, 8)),
               "prefill_cudagraph_capture_token_sizes": [], "max_decode_cudagraph_capture_tokens": None},
}
POLICIES["separate-full-mixed"] = {"max_full_mixed_cudagraph_capture_tokens": 512}
"""Separate grids with mixed steps of up to 512 tokens on FULL graphs (attention inside: one launch a step)."""
POLICIES["vllm-default-twin"] = dict(POLICIES["vllm-default"])
POLICIES["separate-sglang-prefill"] = {"prefill_cudagraph_capture_token_sizes":
                                       POLICIES["sglang"]["prefill_cudagraph_capture_token_sizes"]}
POLICY_FLAGS = {f"separate-wait{n}": ["--admission-wait-steps", str(n)] for n in (0, 2, 4, 8)}
"""Policies that are separate grids with other server flags: arrivals held up to N steps
(``--admission-wait-steps``; ``separate`` itself holds them by the default under speculative decoding: up to 4
steps and 25 ms at the decode steps' pace)."""
POLICIES.update({name: {} for name in POLICY_FLAGS})
WORKLOADS = {"no-sd": None, "eagle3-k7": {"method": "eagle3", "num_speculative_tokens": 7},
             "eagle3-k3": {"method": "eagle3", "num_speculative_tokens": 3},
             "eagle3-tiers-7-3-1": {"method": "eagle3", "num_speculative_tokens": 7,
                                    "num_speculative_tokens_per_batch_size": [[1, 7], [65, 3], [257, 1]]}}
"""Speculative configs; the tiers: K = 7 up to 64 requests, 3 up to 256, 1 above (SPEC.md's example)."""
MAX_SIDE_BY_SIDE = 64
"""The largest concurrency --interleave / --alternate take: four bench-moe servers with KV caches for 64 requests of
4096 tokens hold about 54 GB of KV; at 256 they would need about 216 GB."""


SERVED_NAME = "bench-moe"
"""The model name the servers serve and the bench sends."""


def serve_command(policy: str, spec: dict | None, port: int, args, served_name: str = SERVED_NAME) -> list[str]:
    """``twogrid serve``'s command line for a policy (its ``--compilation-config``) and a speculative config (None:
    none), every other flag the same for every server: ``args.model`` (``args.tokenizer`` when set), sm100, 1024
    requests and 16384 tokens a step, ``--max-model-len``, the KV cache sized by ``--gpu-memory-utilization`` 0.8,
    ``--api-server-count`` front ends, every graph captured before serving (``--no-delayed-cudagraph-capture``:
    the rounds measure a server in its steady state, as they did before serve's default changed)."""
    cmd = [sys.executable, "-m", "dispatcher", "serve", "--model", args.model,
           "--platform", "sm100", "--port", str(port), "--max-num-seqs", "1024", "--max-num-batched-tokens", "16384",
           "--max-model-len", str(args.max_model_len), "--gpu-memory-utilization", "0.8", "--served-model-name",
           served_name, "--device", args.device, "--compilation-config", json.dumps(POLICIES[policy]),
           "--api-server-count", str(args.api_server_count), "--no-delayed-cudagraph-capture"]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    if getattr(args, "stream_interval", 1) != 1:  # (the benchmarks that offer --stream-interval)
        cmd += ["--stream-interval", str(args.stream_interval)]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd + POLICY_FLAGS.get(policy, [])


def launch(cmd: list[str], name: str, port: int, log_path: str, wait: bool = True) -> subprocess.Popen:
    """Start a server command, its output to ``log_path``; ready to serve unless ``wait`` is false (then
    ``wait_healthy``)."""
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    proc.log_path = log_path
    if wait:
        wait_healthy(proc, name, port)
    return proc


def start_server(policy: str, workload: str, fixed: float | None, port: int, args, log_path: str,
                 trace: bool = True, num_kv_blocks: int = 0, wait: bool = True) -> subprocess.Popen:
    """``twogrid serve`` for a policy and workload, its KV cache sized by ``--gpu-memory-utilization`` 0.8 or
    ``num_kv_blocks``; ready to serve unless ``wait`` is false (then ``wait_healthy``)."""
    cmd = serve_command(policy, WORKLOADS[workload], port, args)
    if fixed:
        cmd += ["--fixed-acceptance", str(fixed)]
    if args.step_trace_dir and trace:
        os.makedirs(args.step_trace_dir, exist_ok=True)
        name = f"trace-{policy}-{workload}.jsonl"
        cmd += ["--step-trace", os.path.join(args.step_trace_dir, name)]
    if num_kv_blocks:
        cmd += ["--num-kv-blocks", str(num_kv_blocks)]
    return launch(cmd, policy, port, log_path, wait)


def wait_healthy(proc: subprocess.Popen, policy: str, port: int, poll_s: float = 1.0) -> None:
    """Return once the server answers /health with 200 (asked every ``poll_s``); RuntimeError when it exits or
    takes more than 300 s."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{policy}: the server exited with {proc.returncode} (log {proc.log_path})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(poll_s)
    proc.kill()
    raise RuntimeError(f"{policy}: the server did not start within 300 s")


def process_cpu_s(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of ``root_pid`` and its descendants, by role: the server's front ends
    (the root and the processes of ``--api-server-count``), its engine process and its worker (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, cmdline)
    out, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        if pid not in stats:
            continue
        _, cpu, cmdline = stats[pid]
        role = ("front_end" if pid == root_pid or "dispatcher.serve.frontend" in cmdline
                else "engine" if "dispatcher.engine.service" in cmdline
                else "worker" if "dispatcher.runtime.process" in cmdline else "other")
        out[role] = out.get(role, 0.0) + cpu
        todo += [child for child, (ppid, _, _) in stats.items() if ppid == pid]
    return out


def num_clients(conc: int) -> int:
    """Bench client processes at a concurrency: one Python client saturates near 50K stream events a second (at
    256 fast streams one was busy 80% of the run; at 64 streams of the 135M default model, 85-91%), so one per 32
    streams, at most 8."""
    return min(8, max(1, conc // 32))


def run_bench(base: str, conc: int, label: str, result_dir: str, args, server_pid: int | None = None,
              served_name: str = SERVED_NAME, bench_args: tuple[str, ...] = (), warmups: int | None = None) -> dict:
    """One ``twogrid bench`` run (``--waves`` x ``conc`` prompts at concurrency ``conc``, at least
    ``--min-prompts``: a wave of one request is a third of a second, too short to time) and its result, saved
    with each request's send time, TTFT and latency (``--save-detailed``: where a run's wall time went); with
    ``server_pid``, ``cpu_core_share``: each process's CPU time over the run (the client's included) per second of
    the whole bench command (warm-ups included). ``bench_args``: more ``twogrid bench`` flags (sampling or
    structured-output ones). ``warmups``: unmeasured requests first (default: a wave of ``conc``)."""
    os.makedirs(result_dir, exist_ok=True)
    name = f"{label}-c{conc}.json"
    before = process_cpu_s(server_pid) if server_pid else {}
    client0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "dispatcher", "bench", "--base-url", base, "--model", served_name,
           "--dataset-name", "sharegpt", "--dataset-path", args.data, "--num-prompts",
           str(max(conc * args.waves, args.min_prompts)),
           "--sharegpt-output-len", str(OUTPUT_LEN), "--ignore-eos", "--max-concurrency", str(conc),
           "--num-warmups", str(conc if warmups is None else warmups), "--num-clients", str(num_clients(conc)),
           "--save-result", "--save-detailed",
           "--result-dir",
           result_dir,
           "--result-filename", name, "--label", label, "--disable-tqdm", *bench_args]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    client1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(os.path.join(result_dir, name), encoding="utf-8") as fh:
        result = json.load(fh)
    if server_pid:
        after = process_cpu_s(server_pid)
        share = {role: round((after[role] - before.get(role, 0.0)) / wall, 3) for role in after}
        share["bench_client"] = round((client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime)
                                      / wall, 3)
        result["cpu_core_share"] = share
    return result


def offline_tok_s(spec, fixed: float | None, args, conc: int, worker_process: bool = False) -> float:
    """The offline EngineCore's output tok/s on the bench's prompts (``--waves`` x ``conc`` of them, tokenized as
    the server does, kept ``conc`` in flight: a finished request's place goes to the next at once), separate
    grids; with ``worker_process``, its worker in a worker process as the server's is."""
    import torch

    from dispatcher.bench.datasets import sharegpt_requests
    from dispatcher.engine.engine_core import EngineArgs, EngineCore
    from dispatcher.plan.config import resolve
    from models.text import load_tokenizer
    from scheduler.request import SamplingParams

    tok = load_tokenizer(args.tokenizer)
    prompts = [tok.encode(r.prompt) for r in sharegpt_requests(args.data, conc * args.waves, OUTPUT_LEN, 0)]
    k = spec["num_speculative_tokens"] if spec else 0
    cfg = resolve({}, spec, platform="sm100", max_num_seqs=1024, max_num_batched_tokens=16384)
    blocks = sum(sorted((-(-(len(p) + OUTPUT_LEN + 2 * (k + 1)) // 16) for p in prompts), reverse=True)[:conc]) + 64
    worker = None
    if worker_process:  # the serving path's worker, without the engine process and the HTTP front end
        from dispatcher.engine.config import scheduler_config
        from dispatcher.engine.ipc import RemoteWorker, WorkerProcess
        from dispatcher.messages import WorkerInit
        from models.loader import default_dtype

        width = scheduler_config(cfg, blocks, 16, args.max_model_len).max_blocks_per_seq
        dtype = str(default_dtype(args.model, args.device)).removeprefix("torch.")  # (the server's)
        init = WorkerInit(args.model, args.device, dtype, "sm100",
                          1024, 16384, {}, spec or {}, 16, args.max_model_len, width, blocks, 0.9, 0, True,
                          fixed_acceptance=fixed)
        worker = RemoteWorker(WorkerProcess(init))
    engine = EngineCore(cfg, EngineArgs(args.model, device=args.device, num_kv_blocks=blocks, block_size=16,
                                        max_model_len=args.max_model_len, fixed_acceptance=fixed), worker=worker)
    params = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True)
    engine.generate(prompts[:8], params)  # warm-up
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = closed_loop(engine, prompts, params, conc)
    wall = time.perf_counter() - t0
    if worker is not None:
        worker.close()
    del engine
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return tokens / wall


def closed_loop(engine, prompts: list[list[int]], params, conc: int) -> int:
    """Run ``prompts`` with at most ``conc`` in flight, as a closed-loop client does; the output tokens."""
    waiting = list(reversed(prompts))
    for _ in range(min(conc, len(waiting))):
        engine.queue(engine.make_request(waiting.pop(), params))
    tokens = 0
    for outputs in engine.run():
        for o in outputs:
            tokens += len(o.new_token_ids)
            if o.finished and waiting:
                engine.queue(engine.make_request(waiting.pop(), params))
    return tokens


def make_row(policy: str, workload: str, acceptance: str, conc: int, benches: list[dict], args) -> dict:
    """A result row from one or more ``twogrid bench`` results of one server at one concurrency (interleaved
    rounds): output tok/s is all rounds' tokens over their summed durations (each round's tok/s beside it), TPOT
    and TTFT are the rounds' medians; the server's counters (eager steps, padded tokens, steps, fused steps, mixed
    steps, device time) are summed (and the engine steps that reached a front end still behind on earlier ones), and
    GPU busy is their device time over the runs' durations."""
    def median(key: str) -> float:
        return statistics.median(b.get(key, float("nan")) for b in benches)

    device_s = sum(b["step_device_seconds"] for b in benches)
    completed = sum(b["completed"] for b in benches)
    failed = sum(b.get("failed", 0) for b in benches)
    row = {"policy": policy, "model": os.path.basename(args.model), "workload": workload, "acceptance": acceptance,
           "concurrency": conc,
           "output_tok_s": round(sum(b["total_output_tokens"] for b in benches) / sum(b["duration"] for b in benches),
                                 1),
           "tpot_ms_mean": round(median("mean_tpot_ms"), 3), "tpot_ms_p99": round(median("p99_tpot_ms"), 3),
           "ttft_ms_mean": round(median("mean_ttft_ms"), 3),
           "eager_steps": int(sum(b.get("eager_steps", 0) for b in benches)),
           "padded_tokens": int(sum(b["padded_tokens"] for b in benches)),
           "steps": int(sum(b["cudagraph_steps"] for b in benches)),
           "fused_steps": int(sum(b.get("fused_decode_steps", 0) for b in benches)),
           "mixed_steps": int(sum(sum(b.get("cudagraph_steps_by_kind_mode", {}).get("mixed", {}).values())
                                  for b in benches)),
           "device_s": round(device_s, 3),
           "gpu_busy": round(device_s / sum(b["duration"] for b in benches), 3),
           "front_end_backlog_steps": int(sum(b.get("front_end_backlog_steps", 0) for b in benches)),
           "completed": completed, "failed": failed, "waves": args.waves, "num_prompts": completed + failed,
           "num_clients": benches[0].get("num_clients", 1),
           "client_cpu_fraction": round(median("client_cpu_fraction"), 3),
           "cpu_core_share": benches[0].get("cpu_core_share")}
    if len(benches) > 1:
        row["rounds"] = len(benches)
        row["round_tok_s"] = [round(b["output_throughput"], 1) for b in benches]
    return row


@contextlib.contextmanager
def policy_servers(workload: str, fixed: float | None, concurrencies: list[int], args, out_dir: str):
    """Every policy's server up at once, the i-th on ``--port`` + i, each with a KV cache for the largest
    concurrency; yields {policy: its process}, and stops every one started, whatever happens."""
    blocks = max(concurrencies) * -(-args.max_model_len // 16) + 64
    procs: dict[str, subprocess.Popen] = {}
    try:
        for i, p in enumerate(args.policies.split(",")):
            procs[p] = start_server(p, workload, fixed, args.port + i, args,
                                    os.path.join(out_dir, f"server-{workload}-{p}.log"), num_kv_blocks=blocks,
                                    wait=False)
        for i, (p, proc) in enumerate(procs.items()):
            wait_healthy(proc, p, args.port + i)
        yield procs
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def interleaved_rows(workload: str, fixed: float | None, acceptance: str, concurrencies: list[int], args,
                     out_dir: str) -> Iterator[list[dict]]:
    """Every policy's server up at once (each with a KV cache for the largest concurrency), and at each
    concurrency ``--interleave`` rounds of one bench run per policy, in alternating order (A B, B A, ...): a drift
    of the host's speed reaches every policy alike. At small batches a step waits on the host, and the same
    policy's sequential runs differ by more than the policies do."""
    policies = args.policies.split(",")
    with policy_servers(workload, fixed, concurrencies, args, out_dir) as procs:
        for conc in concurrencies:
            benches: dict[str, list[dict]] = {p: [] for p in policies}
            for r in range(args.interleave):
                for p in (policies if r % 2 == 0 else policies[::-1]):
                    base = f"http://127.0.0.1:{args.port + policies.index(p)}"
                    benches[p].append(run_bench(base, conc, f"{p}-{workload}-r{r}", os.path.join(out_dir, "bench"),
                                                args, procs[p].pid))
            yield [make_row(p, workload, acceptance, conc, benches[p], args) for p in policies]


def alternating_rows(workload: str, fixed: float | None, acceptance: str, concurrencies: list[int], args,
                     out_dir: str) -> Iterator[list[dict]]:
    """Every policy's server up at once; at each concurrency, ``--alternate`` batches a policy, each batch
    ``concurrency`` ShareGPT requests sent at once and run to completion (the same prompts for every policy in a
    batch; no refill, so a batch's tail runs below ``concurrency`` streams), and the policies take turns batch by
    batch (A B, B A, ...) after one unmeasured batch each. The client is ``twogrid bench``'s (its session,
    connection priming and request loop), in this process: no process start between batches, so a batch is a
    third of a second at one stream and the policies' samples are that close in time. At one stream the same
    graphs' step time varies by up to 40% between spans of requests, more than the policies differ; whole bench
    commands of a few seconds each (``--interleave``) left that in the ratio. A failed request stops the run."""
    import asyncio

    import numpy as np

    from dispatcher.bench.client import Endpoint
    from dispatcher.bench.datasets import sharegpt_requests
    from dispatcher.bench.results import compute_result
    from dispatcher.bench.runner import open_session, prime_connections, run_requests
    from dispatcher.bench.server_metrics import counter_deltas, scrape

    policies = args.policies.split(",")
    endpoints = {p: Endpoint("completions", f"http://127.0.0.1:{args.port + i}", SERVED_NAME, {}, ignore_eos=True)
                 for i, p in enumerate(policies)}

    def check(policy: str, outputs: list) -> list:
        """A batch's outputs, or an error naming the first failed request (a failure would shorten its batch)."""
        failed = [o for o in outputs if not o.success]
        if failed:
            raise RuntimeError(f"{policy}: {len(failed)} of {len(outputs)} requests failed: {failed[0].error}")
        return outputs

    async def one_concurrency(conc: int) -> list[dict]:
        prompts = sharegpt_requests(args.data, conc * (args.alternate + 1), OUTPUT_LEN, 0)
        slots = [prompts[i * conc:(i + 1) * conc] for i in range(args.alternate + 1)]  # slot 0: the warm-up
        sessions = {p: open_session(conc) for p in policies}
        outputs: dict[str, list] = {p: [] for p in policies}
        seconds = {p: [] for p in policies}
        try:
            for p in policies:
                await prime_connections(sessions[p], endpoints[p], conc)
                check(p, (await run_requests(sessions[p], endpoints[p], slots[0], conc, np.zeros(conc), "", True))[0])
            before = {p: await scrape(sessions[p], endpoints[p].base_url, {}) for p in policies}
            for i, slot in enumerate(slots[1:]):
                for p in (policies if i % 2 == 0 else policies[::-1]):
                    out, duration = await run_requests(sessions[p], endpoints[p], slot, conc, np.zeros(conc), "", True)
                    outputs[p] += check(p, out)
                    seconds[p].append(duration)
            after = {p: await scrape(sessions[p], endpoints[p].base_url, {}) for p in policies}
        finally:
            for session in sessions.values():
                await session.close()
        rows = []
        for p in policies:
            bench = compute_result(outputs[p], sum(seconds[p]), ["ttft", "tpot"], [99])
            bench.update(counter_deltas(before[p], after[p]))
            row = make_row(p, workload, acceptance, conc, [bench], args)
            row.update(client_cpu_fraction=None, slots=args.alternate, slot_seconds=[round(t, 4) for t in seconds[p]])
            rows.append(row)
        return rows

    with policy_servers(workload, fixed, concurrencies, args, out_dir):
        for conc in concurrencies:
            yield asyncio.run(one_concurrency(conc))


def prime_triton_cache(args, concurrencies: list[int], out_dir: str) -> None:
    """One unmeasured server (the first policy and workload) through every concurrency, so that kernel variants
    Triton compiles while serving land in its disk cache before any measured server: otherwise the first policy
    measured pays compile stalls (0.3-1.6 s a step, in the step trace's jit_ms) that the later ones load in
    milliseconds."""
    workload = args.workloads.split(",")[0]
    spec = WORKLOADS[workload]
    fixed = args.fixed_acceptance if spec and args.fixed_acceptance else None
    policy = args.policies.split(",")[0]
    proc = start_server(policy, workload, fixed, args.port, args, os.path.join(out_dir, "server-prime.log"),
                        trace=False)
    try:
        for conc in concurrencies:
            run_bench(f"http://127.0.0.1:{args.port}", conc, "prime", os.path.join(out_dir, "prime"), args)
    finally:
        proc.terminate()
        proc.wait(60)


def add_ratios(rows: list[dict]) -> None:
    """Each row's ``bound_ratio`` (vllm-default's step device time over this policy's, same workload and
    concurrency) and ``tok_s_ratio``, in place; rows must come from one run (one GPU)."""
    base = {(r["workload"], r["concurrency"]): r for r in rows if r["policy"] == "vllm-default"}
    for r in rows:
        b = base.get((r["workload"], r["concurrency"]))
        if b and r["device_s"]:
            r["bound_ratio"] = round(b["device_s"] / r["device_s"], 3)
            r["tok_s_ratio"] = round(r["output_tok_s"] / b["output_tok_s"], 3)
        if b and len(r.get("slot_seconds", ())) == len(b.get("slot_seconds", ())) > 0:  # slot by slot (--alternate)
            r["paired_ratio_median"] = round(statistics.median(
                base_s / this_s for base_s, this_s in zip(b["slot_seconds"], r["slot_seconds"])), 3)


def plot_headline(result: dict, path: str) -> None:
    """Output tok/s against concurrency, one line per policy. Rows of one workload and model: tok/s and mean TPOT
    side by side (twogrid bench's plot); rows of several: one tok/s panel per workload and model, each policy in
    the same colour in every panel."""
    from dispatcher.bench.plot import concurrency_axis, draw, pyplot, series

    groups: dict[str, list[dict]] = {}
    for r in result["rows"]:
        groups.setdefault(f"{r['model']}, {r['workload']}", []).append(
            {"label": r["policy"], "max_concurrency": r["concurrency"], "num_prompts": r["concurrency"],
             "output_throughput": r["output_tok_s"], "mean_tpot_ms": r["tpot_ms_mean"]})
    if len(groups) == 1:
        draw(series(next(iter(groups.values()))), path)
        return
    plt = pyplot()
    policies = list(dict.fromkeys(r["policy"] for r in result["rows"]))
    colours = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(policies)}
    cols = min(3, len(groups))
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False, constrained_layout=True)
    for ax, (name, points) in zip(axes.flat, sorted(groups.items())):
        lines = series(points)
        for policy, pts in lines.items():
            ax.plot([c for c, _, _ in pts], [t for _, t, _ in pts], marker="o", color=colours[policy], label=policy)
        ax.set_title(f"{name}: output tok/s", fontsize=10)
        concurrency_axis(ax, sorted({c for pts in lines.values() for c, _, _ in pts}), "concurrent streams")
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    fig.legend(handles=[plt.Line2D([], [], color=colours[p], marker="o", label=p) for p in policies],
               loc="outside lower center", ncols=min(len(policies), 6))
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def print_table(result: dict) -> None:
    """The rows (ratios where computed) and the serving-overhead lines, one line each."""
    print(f"{'workload':18s} {'conc':>5s} {'policy':17s} {'tok/s':>9s} {'tpot':>7s} {'ttft':>8s} {'eager':>5s} "
          f"{'busy':>5s} {'vs vllm':>7s} {'bound':>6s}")
    for r in result["rows"]:
        print(f"{r['workload']:18s} {r['concurrency']:5d} {r['policy']:17s} {r['output_tok_s']:9.0f} "
              f"{r['tpot_ms_mean']:7.2f} {r['ttft_ms_mean']:8.1f} {r['eager_steps']:5d} {r['gpu_busy']:5.2f} "
              f"{r.get('tok_s_ratio', 0):7.2f} {r.get('bound_ratio', 0):6.2f}")
    for o in result["serve_overhead"]:
        print(f"serve vs offline ({o['workload']}, {o['concurrency']}): {o['served_tok_s']:.0f} / "
              f"{o['offline_tok_s']:.0f} tok/s = {o['served_over_offline']:.2f}; GPU busy {o['served_gpu_busy']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description="the headline: twogrid serve per policy, twogrid bench per "
                                                 "concurrency")
    parser.add_argument("--data", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--out", default=None)
    parser.add_argument("--policies", default="vllm-default,separate,sglang,trtllm")
    parser.add_argument("--workloads", default="eagle3-k7")
    parser.add_argument("--fixed-acceptance", type=float, default=3.0, help="0: real acceptance")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--overhead-at", type=int, default=256, help="concurrency of the serve_overhead rows (0: none)")
    parser.add_argument("--waves", type=int, default=1, help="prompts per run = waves x concurrency (the served and "
                        "the offline runs alike)")
    parser.add_argument("--min-prompts", type=int, default=16, help="prompts per run at least (small concurrencies "
                        "run more waves)")
    parser.add_argument("--step-trace-dir", default=None, help="each server writes its step trace here")
    parser.add_argument("--no-prime-cache", dest="prime_cache", action="store_false",
                        help="skip the unmeasured first server that fills Triton's disk cache")
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="run every policy's server at once and alternate bench runs between them, ROUNDS per "
                        "concurrency (for small concurrencies, where host drift between sequential servers "
                        "exceeds the difference measured; 0: one server at a time)")
    parser.add_argument("--alternate", type=int, default=0, metavar="SLOTS",
                        help="every policy's server at once, and the policies take turns batch by batch (one batch of "
                        "`concurrency` requests a turn, SLOTS a policy), the client in this process: for 1-16 "
                        "streams, where the same step's time varies by up to 40%% (0: off)")
    parser.add_argument("--port", type=int, default=8123, help="(the first server's; interleaved ones count up)")
    parser.add_argument("--api-server-count", type=int, default=4, help="the servers' front-end processes (one "
                        "streams ~15-20K events a second: fewer than the GPU makes at 256+ streams)")
    parser.add_argument("--model", default="bench-moe", help="(a CPU dry run can give the default model's GGUF)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    if args.interleave and args.alternate:
        parser.error("--interleave and --alternate are two ways of doing one thing: give one")
    if unknown := set(args.policies.split(",")) - set(POLICIES):
        parser.error(f"--policies: unknown {', '.join(sorted(unknown))} (known: {', '.join(POLICIES)})")
    if (args.interleave or args.alternate) and max(int(c) for c in args.concurrency.split(",")) > MAX_SIDE_BY_SIDE:
        parser.error(f"--interleave / --alternate keep every policy's server up, each with a KV cache for the largest "
                     f"concurrency at --max-model-len: give concurrencies up to {MAX_SIDE_BY_SIDE}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (a timeout's SIGTERM: stop the servers on the way out)
    out_dir = os.path.dirname(args.out) if args.out else "."
    os.makedirs(out_dir or ".", exist_ok=True)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    result = {"command": "PYTHONPATH=. python benchmarks/bench_headline_gpu.py " + shlex.join(sys.argv[1:]),
              "commit": commit(), "api_server_count": args.api_server_count,
              "model": (f"{args.model} (random weights) with SmolLM2's tokenizer" if args.model in PRESETS
                        else args.model),
              "output_len": OUTPUT_LEN, "rows": [],
              "serve_overhead": []}

    def save() -> None:  # after every row: a run cut short keeps what it measured, with its ratios
        add_ratios(result["rows"])
        write_json(args.out, result)

    if args.prime_cache:
        prime_triton_cache(args, concurrencies, out_dir)
    for workload in args.workloads.split(","):
        spec = WORKLOADS[workload]
        fixed = args.fixed_acceptance if spec and args.fixed_acceptance else None
        acceptance = f"fixed-{fixed}" if fixed else "real"
        if args.interleave or args.alternate:
            rows_of = alternating_rows if args.alternate else interleaved_rows
            for rows in rows_of(workload, fixed, acceptance, concurrencies, args, out_dir):
                result["rows"] += rows
                for row in rows:
                    print(json.dumps(row), flush=True)
                save()
        for policy in ([] if args.interleave or args.alternate else args.policies.split(",")):
            log_path = os.path.join(out_dir, f"server-{workload}-{policy}.log")
            proc = start_server(policy, workload, fixed, args.port, args, log_path)
            base = f"http://127.0.0.1:{args.port}"
            try:
                for conc in concurrencies:  # (twogrid bench reads the server's counters after its warm-ups)
                    bench = run_bench(base, conc, f"{policy}-{workload}", os.path.join(out_dir, "bench"), args,
                                      proc.pid)
                    row = make_row(policy, workload, acceptance, conc, [bench], args)
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
                    save()
            finally:
                proc.terminate()
                proc.wait(60)
        if args.overhead_at:
            offline = offline_tok_s(spec, fixed, args, args.overhead_at)
            offline_remote = offline_tok_s(spec, fixed, args, args.overhead_at, worker_process=True)
            served = next((r for r in result["rows"] if r["workload"] == workload and r["policy"] == "separate"
                           and r["concurrency"] == args.overhead_at), None)
            if served:
                result["serve_overhead"].append({
                    "workload": workload, "acceptance": acceptance, "concurrency": args.overhead_at,
                    "offline_tok_s": round(offline, 1), "offline_worker_process_tok_s": round(offline_remote, 1),
                    "served_tok_s": served["output_tok_s"],
                    "served_over_offline": round(served["output_tok_s"] / offline, 3),
                    "served_gpu_busy": served["gpu_busy"], "waves": args.waves,
                    "cpu_core_share": served["cpu_core_share"]})
                print(json.dumps(result["serve_overhead"][-1]), flush=True)
    save()
    if args.out:
        plot_headline(result, args.out.removesuffix(".json") + ".png")
    print_table(result)

if __name__ == "__main__":
    main()
