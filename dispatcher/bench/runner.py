"""``twogrid bench``: runs at each ``--max-concurrency`` in turn against one server, then saves and plots.

Per concurrency, on one pool of kept-alive connections: ``--num-warmups`` requests (not measured), a scrape of the
server's ``/metrics``, the pool filled to the concurrency cap (so that no measured request waits on a TCP
handshake), the measured run (every prompt once: Poisson arrivals at ``--request-rate``, at most
``--max-concurrency`` in flight), a second scrape, then vLLM's result fields plus the server's counter deltas. One
test request goes first of all, so that a wrong model, endpoint or key fails at once with the server's answer.

With ``--multi-turn`` the items sent are ShareGPT conversations (``--num-prompts`` of them): a conversation sends
its user turns one after the other, each with the conversation so far, and ``--max-concurrency`` caps the
conversations in flight (each has one request in flight at a time); every turn is one timed request.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import queue
import subprocess
import sys
import time
from datetime import datetime
from typing import Any, Sequence

import aiohttp
import numpy as np

from dispatcher.bench import BenchError
from dispatcher.bench.client import (BACKEND_NAMES, ENDPOINT_PATHS, Endpoint, RequestOutput, auth_headers,
                                     list_models, send, send_request)
from dispatcher.bench.datasets import (Conversation, SampleRequest, prefix_repetition_requests, random_requests,
                                       sharegpt_conversations, sharegpt_requests)
from dispatcher.bench.results import (PERCENTILE_METRICS, cache_by_turn, compute_result, summary_lines,
                                      ttft_by_turn)
from dispatcher.bench.server_metrics import capture_unfinished, counter_deltas, scrape
from dispatcher.engine.workload import fill_prefix_repetition_flags

REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)
"""A request's limit, as vLLM's (long outputs at high concurrency take minutes)."""
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
CLIENT_BUSY = 0.9
"""Above this share of a run's wall time spent on this process's CPU, the client is the bottleneck: warn."""


def parse_concurrencies(text: str | None) -> list[int | None]:
    """'1,16,64' -> [1, 16, 64]; None -> [None] (no cap)."""
    if text is None:
        return [None]
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise BenchError(f"--max-concurrency: {part!r} is not a positive integer (give one value or a "
                             f"comma-separated list, such as 1,16,64)")
        values.append(int(part))
    return values


def parse_percentile_metrics(text: str) -> list[str]:
    metrics = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in metrics if m not in PERCENTILE_METRICS]
    if bad or not metrics:
        raise BenchError(f"--percentile-metrics: {bad[0] if bad else text!r} is not one of "
                         f"{','.join(PERCENTILE_METRICS)}")
    return metrics


def parse_percentiles(text: str) -> list[float]:
    values = []
    for part in text.split(","):
        try:
            p = float(part)
        except ValueError:
            p = math.nan
        if not 0.0 < p <= 100.0:
            raise BenchError(f"--metric-percentiles: {part.strip()!r} is not a percentile in (0, 100]")
        values.append(p)
    return values


def validate(args: argparse.Namespace) -> None:
    """One BenchError naming the flag and its limit for any bad flag (before the server is contacted). Fills in
    --dataset-name: sharegpt when --dataset-path is given, else random."""
    if args.dataset_name is None:
        args.dataset_name = "sharegpt" if args.dataset_path else "random"
    for flag in ("num_prompts", "random_input_len", "random_output_len", "sharegpt_output_len"):
        if getattr(args, flag) < 1:
            raise BenchError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.num_clients < 1:
        raise BenchError(f"--num-clients must be >= 1, got {args.num_clients}")
    if args.num_warmups < 0:
        raise BenchError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if not args.request_rate > 0:
        raise BenchError(f"--request-rate must be > 0 requests/s (inf sends every request at once), got "
                         f"{args.request_rate}")
    if not args.base_url.startswith(("http://", "https://")):
        raise BenchError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise BenchError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
    if args.dataset_name in ("random", "prefix_repetition") and args.dataset_path:
        raise BenchError(f"--dataset-path is for --dataset-name sharegpt; the {args.dataset_name} dataset reads no "
                         f"file")
    fill_prefix_repetition_flags(args, BenchError)
    if args.multi_turn and (args.dataset_name != "sharegpt" or args.endpoint != "chat"):
        raise BenchError("--multi-turn sends ShareGPT conversations as chat messages: give --dataset-name sharegpt "
                         "--dataset-path FILE --endpoint chat")
    if args.max_turns is not None and (not args.multi_turn or args.max_turns < 1):
        raise BenchError(f"--max-turns is for --multi-turn and must be >= 1, got {args.max_turns}")
    if args.plot and not args.plot.lower().endswith(PLOT_SUFFIXES):
        raise BenchError(f"--plot: {args.plot!r} must end with one of {', '.join(PLOT_SUFFIXES)}")
    if args.temperature is not None and args.temperature < 0:
        raise BenchError(f"--temperature must be >= 0, got {args.temperature}")
    sampling_body(args)
    for item in args.metadata or []:
        if "=" not in item or not item.partition("=")[0].strip():
            raise BenchError(f"--metadata: {item!r} is not KEY=VALUE")


def structured_body(args: argparse.Namespace) -> dict[str, Any]:
    """``--response-format`` and ``--structured-outputs`` as request fields (sent with every request); BenchError
    naming the flag for text that is not a JSON object."""
    body = {}
    for flag, field in (("response_format", "response_format"), ("structured_outputs", "structured_outputs")):
        text = getattr(args, flag, None)
        if text is None:
            continue
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise BenchError(f"--{flag.replace('_', '-')}: not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise BenchError(f"--{flag.replace('_', '-')} must be a JSON object, got {text!r}")
        body[field] = value
    return body


SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                  "repetition_penalty")
"""vllm bench serve's sampling flags: each one given is sent in every request's body."""


def sampling_body(args: argparse.Namespace) -> dict[str, Any]:
    """The fields the sampling flags, ``--response-format`` / ``--structured-outputs`` and ``--extra-body`` add to
    every request (``--extra-body`` last, as vLLM's bench merges them); BenchError when ``--extra-body`` is not a
    JSON object."""
    body = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name, None) is not None}
    body.update(structured_body(args))
    if getattr(args, "extra_body", None):
        try:
            extra = json.loads(args.extra_body)
        except ValueError as exc:
            raise BenchError(f"--extra-body is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise BenchError(f"--extra-body must be a JSON object, got {args.extra_body!r}")
        body.update(extra)
    return body


def build_requests(args: argparse.Namespace) -> list[SampleRequest] | list[Conversation]:
    if args.multi_turn:
        return sharegpt_conversations(args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed,
                                      args.max_turns)
    if args.dataset_name == "sharegpt":
        return sharegpt_requests(args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed)
    if args.dataset_name == "prefix_repetition":
        return prefix_repetition_requests(args.num_prompts, args.prefix_repetition_prefix_len,
                                          args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                                          args.prefix_repetition_output_len, args.seed)
    return random_requests(args.num_prompts, args.random_input_len, args.random_output_len, args.seed)


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> np.ndarray:
    """Seconds after the start at which each request arrives: all at 0 for an infinite rate, else a Poisson
    process (exponential gaps with mean 1 / rate) from a seeded generator."""
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def bench_commit() -> str | None:
    """$TWOGRID_COMMIT, else this checkout's git HEAD, else None (as the benchmark scripts record it)."""
    if os.environ.get("TWOGRID_COMMIT"):
        return os.environ["TWOGRID_COMMIT"]
    try:
        return subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--short",
                               "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def raise_open_file_limit() -> None:
    """Each in-flight request holds a socket: lift the soft open-file limit to the hard one (1024 concurrent
    requests exceed the usual soft limit of 1024)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    except (ImportError, ValueError, OSError):
        pass


def open_session(max_concurrency: int | None) -> aiohttp.ClientSession:
    """One client's session: at most ``max_concurrency`` connections, kept alive between requests (the warm-up's
    connections carry the measured run's requests, as a real client's pool does)."""
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT, read_bufsize=1 << 20)


async def prime_connections(session: aiohttp.ClientSession, endpoint: Endpoint, count: int) -> None:
    """Open ``count`` connections before the clock starts (concurrent ``GET /health``, read to the end so that each
    connection goes back to the pool), so that the measured run's first requests do not each pay a TCP handshake:
    256 fresh connections stretched the admission of a wave of 256 over ~0.4 s on the H200's host. A server without
    /health still answers (404): the connection is kept either way; one that cannot be reached is the measured
    run's error to report, not this one's."""
    async def one() -> None:
        try:
            async with session.get(endpoint.base_url + "/health", headers=endpoint.headers) as response:
                await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass

    await asyncio.gather(*(one() for _ in range(count)))


async def run_requests(session: aiohttp.ClientSession, endpoint: Endpoint, requests: Sequence[SampleRequest],
                       max_concurrency: int | None, offsets: np.ndarray, desc: str,
                       disable_tqdm: bool) -> tuple[list[list[RequestOutput]], float]:
    """Send every request (or conversation) at its arrival offset, at most ``max_concurrency`` in flight; outputs
    in request order (a list each: a conversation's turns) and the wall time from the first send to the last
    completion."""
    from tqdm.asyncio import tqdm

    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    with tqdm(total=len(requests), desc=desc, disable=disable_tqdm, leave=False) as bar:
        async def one(req: SampleRequest) -> list[RequestOutput]:
            if gate is None:
                out = await send(session, endpoint, req)
            else:
                async with gate:
                    out = await send(session, endpoint, req)
            bar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        for req, offset in zip(requests, offsets):
            wait = start + offset - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(req)))
        outputs = await asyncio.gather(*tasks)
        return list(outputs), time.perf_counter() - start


def pool_size(num_requests: int, max_concurrency: int | None) -> int:
    """The connections to open before a run: as many as its concurrency cap lets it use at once (none without a
    cap: it could be one per request)."""
    return min(num_requests, max_concurrency) if max_concurrency else 0


def split_load(requests: Sequence[SampleRequest], offsets: np.ndarray, max_concurrency: int | None,
               num_clients: int) -> list[tuple[list[SampleRequest], np.ndarray, int | None]]:
    """Each client's share: requests (and arrival offsets) dealt round robin, the concurrency cap split as evenly
    as it goes (every client keeps at least one in flight); clients past the number of requests get none."""
    clients = max(1, min(num_clients, len(requests), max_concurrency or num_clients))
    shares = []
    for i in range(clients):
        cap = None if max_concurrency is None else max_concurrency // clients + (i < max_concurrency % clients)
        shares.append((list(requests[i::clients]), offsets[i::clients], cap))
    return shares


def _client_process(index: int, endpoint: Endpoint, share: list[SampleRequest], offsets: np.ndarray,
                    cap: int | None, ready, go, results) -> None:
    """Client process ``index``: imports what it runs with, opens its share's connections, says it is ready, waits
    for the common start, runs its share and sends back (index, outputs, first send, last completion
    (perf_counter: one system-wide clock), CPU seconds of the run)."""
    import tqdm.asyncio  # noqa: F401  (before the clocks start)

    raise_open_file_limit()

    async def main():
        async with open_session(cap) as session:
            await prime_connections(session, endpoint, pool_size(len(share), cap))
            ready.put(index)
            await asyncio.get_running_loop().run_in_executor(None, go.wait)
            cpu = time.process_time()
            outputs, duration = await run_requests(session, endpoint, share, cap, offsets, "", True)
            end = time.perf_counter()
            return outputs, end - duration, end, time.process_time() - cpu

    try:
        results.put((index, *asyncio.run(main())))
    except BaseException as exc:  # (the parent turns it into one clear error)
        results.put((index, None, f"{type(exc).__name__}: {exc}", 0.0, 0.0))


async def run_split(session: aiohttp.ClientSession, endpoint: Endpoint, requests: Sequence[SampleRequest],
                    max_concurrency: int | None, offsets: np.ndarray, desc: str, disable_tqdm: bool,
                    num_clients: int = 1) -> tuple[list[list[RequestOutput]], float, float, int]:
    """``run_requests`` over ``num_clients`` processes started together: outputs in request order, the wall time
    from the first send to the last completion, the busiest client's CPU time over that wall time, and the number
    of clients that ran (no more than the requests or the concurrency cap). One client runs here, on ``session``
    (its pool primed first); more open their own sessions, primed, before the common start."""
    if num_clients <= 1:
        await prime_connections(session, endpoint, pool_size(len(requests), max_concurrency))
        cpu = time.process_time()
        outputs, duration = await run_requests(session, endpoint, requests, max_concurrency, offsets, desc,
                                               disable_tqdm)
        return outputs, duration, (time.process_time() - cpu) / max(duration, 1e-9), 1
    import multiprocessing as mp

    from tqdm import tqdm

    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    shares = split_load(requests, offsets, max_concurrency, num_clients)
    procs = [ctx.Process(target=_client_process, args=(i, endpoint, reqs, offs, cap, ready, go, results),
                         daemon=True) for i, (reqs, offs, cap) in enumerate(shares)]
    loop = asyncio.get_running_loop()

    async def take(source, limit_s: float | None):
        """The next item from a client, polling each second so that a client that died is noticed at once."""
        waited = 0.0
        while True:
            try:
                return await loop.run_in_executor(None, source.get, True, 1.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise BenchError(f"--num-clients: a client process died (exit code {dead[0]})") from None
                waited += 1.0
                if limit_s is not None and waited >= limit_s:
                    raise BenchError(f"--num-clients: the client processes did not start within {limit_s:.0f} s") \
                        from None

    done = {}
    try:
        for proc in procs:
            proc.start()
        for _ in procs:
            await take(ready, 120.0)
        go.set()
        with tqdm(total=len(requests), desc=f"{desc} ({len(procs)} clients)", disable=disable_tqdm,
                  leave=False) as bar:
            while len(done) < len(procs):
                index, *rest = await take(results, None)
                if rest[0] is None:
                    raise BenchError(f"--num-clients: client {index} failed: {rest[1]}")
                done[index] = rest
                bar.update(len(shares[index][0]))
    finally:
        if len(done) < len(procs):  # an error: stop the others at once rather than wait for their shares
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    outputs: list[list[RequestOutput]] = [[RequestOutput()]] * len(requests)
    for i, (outs, _, _, _) in done.items():  # client i held requests i, i + n, i + 2n, ...
        outputs[i::len(shares)] = outs
    start, end = min(d[1] for d in done.values()), max(d[2] for d in done.values())
    return outputs, end - start, max(d[3] for d in done.values()) / max(end - start, 1e-9), len(shares)


async def resolve_model(session: aiohttp.ClientSession, args: argparse.Namespace, headers: dict[str, str]) -> str:
    """``--model``, else the first model the server lists; either way the server must answer."""
    models = await list_models(session, args.base_url, headers)
    if args.model:
        return args.model
    if models is None:
        raise BenchError(f"--model: {args.base_url}/v1/models does not exist on this server; name the model")
    if not models:
        raise BenchError(f"--model: {args.base_url}/v1/models lists no model; name one")
    print(f"model not given; using the server's first model: {models[0]}")
    return models[0]


def fresh_like(requests: Sequence[SampleRequest], count: int, seed: int) -> list[SampleRequest]:
    """``count`` synthetic requests with the prompt and output lengths of the first ``count`` requests (cycled),
    so that warm-ups leave nothing of the measured prompts in a server's prefix cache."""
    shapes = [requests[i % len(requests)] for i in range(count)]
    return [random_requests(1, max(1, r.prompt_len), r.output_len, seed + i)[0] for i, r in enumerate(shapes)]


async def check_endpoint(endpoint: Endpoint, req: SampleRequest) -> None:
    """One request before the runs: a wrong model, endpoint or key fails here with the server's answer."""
    async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
        out = await send_request(session, endpoint, req)
    if not out.success:
        raise BenchError(f"the test request to {endpoint.url} failed: {out.error}")


def run_metadata(args: argparse.Namespace, model: str, max_concurrency: int | None) -> dict[str, Any]:
    """The fields before the metrics (vLLM's order and names, then this tool's own)."""
    meta = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": BACKEND_NAMES[args.endpoint],
        "backend": BACKEND_NAMES[args.endpoint],
        "label": args.label or BACKEND_NAMES[args.endpoint],
        "model_id": model,
        "tokenizer_id": None,
        "num_prompts": args.num_prompts,
    }
    for item in args.metadata or []:
        key, _, value = item.partition("=")
        meta[key.strip()] = value.strip()
    meta.update(
        request_rate=args.request_rate if not math.isinf(args.request_rate) else "inf",
        burstiness=1.0,
        max_concurrency=max_concurrency,
        base_url=args.base_url,
        endpoint=ENDPOINT_PATHS[args.endpoint],
        dataset_name=args.dataset_name,
        dataset_path=args.dataset_path,
        random_input_len=args.random_input_len if args.dataset_name == "random" else None,
        output_len={"random": args.random_output_len, "prefix_repetition": args.prefix_repetition_output_len}.get(
            args.dataset_name, args.sharegpt_output_len),
        multi_turn=args.multi_turn,
        ignore_eos=args.ignore_eos,
        sampling=sampling_body(args) or None,
        seed=args.seed,
        num_warmups=args.num_warmups,
        commit=bench_commit(),
    )
    return meta


async def bench_all(args: argparse.Namespace, requests: list[SampleRequest],
                    concurrencies: list[int | None]) -> list[dict[str, Any]]:
    headers = auth_headers(args.api_key)
    extra = sampling_body(args)
    async with aiohttp.ClientSession() as probe:
        model = await resolve_model(probe, args, headers)
        endpoint = Endpoint(args.endpoint, args.base_url, model, {**headers, "Content-Type": "application/json"},
                            args.ignore_eos, extra)
        test = requests[0]
        await check_endpoint(endpoint, random_requests(1, 16, min(test.output_len, 16), args.seed + 10**6)[0])
        offsets = arrival_offsets(len(requests), args.request_rate, args.seed)
        results = []
        for cap in concurrencies:
            name = f"concurrency {cap}" if cap else "no concurrency cap"
            async with open_session(cap) as session:
                if args.num_warmups:
                    warm = fresh_like(requests, args.num_warmups, args.seed + 2 * 10**6)
                    await run_requests(session, endpoint, warm, cap, np.zeros(len(warm)), f"warm-up, {name}",
                                       args.disable_tqdm)
                before = await scrape(probe, args.base_url, headers)
                per_item, duration, client_busy, clients = await run_split(session, endpoint, requests, cap, offsets,
                                                                           name, args.disable_tqdm, args.num_clients)
            outputs = [o for item in per_item for o in item]
            after = await scrape(probe, args.base_url, headers)
            result = run_metadata(args, model, cap)
            result.update(compute_result(outputs, duration, args.percentile_metrics, args.metric_percentiles,
                                         args.save_detailed))
            if args.multi_turn:
                result.update(ttft_by_turn(per_item))
                result.update(cache_by_turn(per_item))
            result["client_cpu_fraction"] = client_busy  # (the busiest client process's)
            result["num_clients"] = clients
            result.update(counter_deltas(before, after))
            if (capturing := capture_unfinished(before)) is not None:
                result["cudagraphs_captured_at_start"], result["cudagraphs_planned"] = capturing
                print(f"warning: the server had captured {capturing[0]} of its {capturing[1]} CUDA graphs when this "
                      f"run started (it serves while it captures them): steps whose graph was not captured yet ran "
                      f"eagerly or on a larger graph; for its steady state wait until /metrics "
                      f"twogrid:cudagraphs_captured reaches twogrid:cudagraphs_planned (where it stays below, the "
                      f"server's log says why capture stopped), or start it with --no-delayed-cudagraph-capture",
                      file=sys.stderr)
            print("\n".join(summary_lines(result, args.percentile_metrics, args.metric_percentiles)))
            if result["client_cpu_fraction"] > CLIENT_BUSY:
                print(f"warning: a client process was busy {result['client_cpu_fraction']:.0%} of the run, so its "
                      f"timings include its own delays: split the load over more (--num-clients)",
                      file=sys.stderr)
            errors = [o.error for o in outputs if not o.success]
            for i, err in enumerate(errors[:10]):
                print(f"failed request {i + 1} of {len(errors)}: {err}", file=sys.stderr)
            results.append(result)
        return results


def result_path(args: argparse.Namespace, result: dict[str, Any]) -> str:
    """vLLM's file name, {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json, or --result-filename (whose
    '{concurrency}' is replaced), inside --result-dir."""
    if args.result_filename:
        name = args.result_filename.replace("{concurrency}", str(result["max_concurrency"]))
    else:
        cap = f"-concurrency{result['max_concurrency']}" if result["max_concurrency"] is not None else ""
        name = (f"{result['label']}-{args.request_rate}qps{cap}-{result['model_id'].split('/')[-1]}-"
                f"{result['date']}.json")
    return os.path.join(args.result_dir, name) if args.result_dir else name


def save_results(args: argparse.Namespace, results: list[dict[str, Any]]) -> list[str]:
    """One JSON file per concurrency (as vLLM writes one per run)."""
    import json

    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
    paths = []
    for result in results:
        path = result_path(args, result)
        try:
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(result, fh, indent=2)
                fh.write("\n")
        except OSError as exc:
            raise BenchError(f"--save-result: cannot write {path!r}: {exc.strerror}") from None
        paths.append(path)
        print(f"saved {path}")
    return paths


def run(args: argparse.Namespace) -> int:
    """The ``bench`` subcommand: plot saved results when RESULT files are given, else run, save and plot."""
    from dispatcher.bench.plot import plot_results

    if args.results:
        if not args.plot:
            raise BenchError("result files were given without --plot (they are only read to be plotted)")
        validate(args)
        plot_results(args.results, args.plot)
        return 0
    validate(args)
    concurrencies = parse_concurrencies(args.max_concurrency)
    args.percentile_metrics = parse_percentile_metrics(args.percentile_metrics)
    args.metric_percentiles = parse_percentiles(args.metric_percentiles)
    if args.result_filename and len(concurrencies) > 1 and "{concurrency}" not in args.result_filename:
        raise BenchError(f"--result-filename {args.result_filename!r} would be written once per concurrency: put "
                         f"{{concurrency}} in it")
    requests = build_requests(args)
    raise_open_file_limit()
    gc.collect()
    gc.freeze()  # the prompts and the client's objects are long-lived: keep the collector off them (as vLLM)
    try:
        results = asyncio.run(bench_all(args, requests, concurrencies))
    except KeyboardInterrupt:
        print("twogrid bench: interrupted; nothing saved", file=sys.stderr)
        return 130
    finally:
        gc.unfreeze()
    if args.save_result:
        save_results(args, results)
    if args.plot:
        # every result in --result-dir, and this run's results where they were not saved there
        in_dir = bool(args.result_dir) and os.path.isdir(args.result_dir)
        plot_results([args.result_dir] if in_dir else [], args.plot,
                     extra=[] if in_dir and args.save_result else results)
    failed = sum(r["failed"] for r in results)
    if failed:
        print(f"twogrid bench: {failed} of {sum(r['failed'] + r['completed'] for r in results)} requests failed",
              file=sys.stderr)
    return 1 if failed else 0
