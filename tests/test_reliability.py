"""Reliability and security of ``twogrid serve`` (issue 15), CI-sized: the real server in subprocesses on the tiny
random-weight preset (tiny-dense, CPU worker processes), what production does to it, and what a user relies on
after each: every stream ends exactly once with exactly its tokens or with an error event (never a hang), the KV
cache is whole again, the server answers.

Three servers, each for the tests that need its settings (the destructive tests come last):

- ``tokens``: no tokenizer, token-id prompts; every chunk names its token ids (logprobs), so a stream is compared
  token for token with the offline engine (seeded sampling). A small KV cache and token budget: long prompts are
  prefilled in chunks and requests are preempted. Soak, abort storm, foreign frames on the engine's socket, SIGTERM.
- ``text``: a 500-token BPE with a ChatML template (and a branch that reaches for Python internals, for the
  sandbox), an API key: hostile HTTP input, costly requests refused, the security defaults.
- ``faulty``: $TWOGRID_FAIL_STEPS makes one step fail in the worker; then the worker is SIGKILLed.

Each test records its figures (requests sent / completed / failed / lost, KV blocks, detection times, malformed
inputs and their answers) in a JSON file: $TWOGRID_RELIABILITY_FIGURES, else reliability_figures.json in pytest's
base temporary directory. docs/reliability.md tabulates them; benchmarks/soak_cpu.py is the full-size soak.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import json
import os
import pathlib
import pickle
import random
import signal
import socket
import time
from collections import Counter
from dataclasses import asdict

import pytest

pytest.importorskip("torch")
aiohttp = pytest.importorskip("aiohttp")

from serverutil import (REPO, OfflineReference, Server, Stream, assert_ok_or_4xx, count_round,  # noqa: E402
                        finished_requests, http_get, http_post, process_state, raw_http, request_body, rss_bytes, run_streams, token_prompts,
                        wait_idle)

MODEL, VOCAB = "tiny-dense", 512
KEY = "sk-rel-15"
TOKENS_MAX_LEN = 1040
TOKENS_ARGS = ["--model", MODEL, "--device", "cpu", "--max-model-len", str(TOKENS_MAX_LEN), "--max-num-seqs", "64",
               "--max-num-batched-tokens", "256", "--num-kv-blocks", "160", "--shutdown-timeout", "1"]
SHUTDOWN_TIMEOUT_S = 1.0
FAIL_STEP = 40
FAULTY_SEQS = 4
FAULTY_ARGS = ["--model", MODEL, "--device", "cpu", "--max-model-len", "256", "--max-num-seqs", str(FAULTY_SEQS)]
TEXT_MAX_LEN = 64
STRUCTURED_TIMEOUT_S = 2.0
"""The text server's grammar compile timeout (``--structured-outputs-config``)."""
DETECT_LIMIT_S = 2.0
"""The issue's bound: a dead worker noticed, and every stream told, within this."""

FIGURES: dict[str, dict] = {}


def record(name: str, **figures) -> None:
    FIGURES[name] = figures
    print(name, json.dumps(figures))


@pytest.fixture(scope="module", autouse=True)
def figures_file(tmp_path_factory):
    yield
    path = os.environ.get("TWOGRID_RELIABILITY_FIGURES") or str(tmp_path_factory.getbasetemp() /
                                                               "reliability_figures.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(FIGURES, fh, indent=2)
        fh.write("\n")


def _serve(tmp_path_factory, name: str, args: list[str], key: str | None = None, env: dict | None = None):
    log = str(tmp_path_factory.mktemp(name) / "server.log")
    server = Server(args, log, key=key, env=env).wait_healthy()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tokens_server(tmp_path_factory):
    yield from _serve(tmp_path_factory, "tokens", TOKENS_ARGS)


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory):
    yield from _serve(tmp_path_factory, "faulty", FAULTY_ARGS, env={"TWOGRID_FAIL_STEPS": str(FAIL_STEP)})


SANDBOX_TRIGGER = "open sesame"


@pytest.fixture(scope="module")
def text_server(tmp_path_factory, texts):
    """tiny-dense with a 500-token BPE whose chat template, on SANDBOX_TRIGGER, reaches for ``os`` to make a
    directory (``server.escape_marker``): only outside a sandbox would it exist."""
    from textdata import CHATML, train_bpe

    marker = tmp_path_factory.mktemp("sandbox") / "escaped"
    trap = (f"{{% if messages[0]['content'] == '{SANDBOX_TRIGGER}' %}}"
            f"{{{{ cycler.__init__.__globals__.os.mkdir('{marker}') }}}}{{% endif %}}")
    tok = train_bpe(texts[:200], str(tmp_path_factory.mktemp("bpe500")), vocab_size=500, chat_template=trap + CHATML)
    args = ["--model", MODEL, "--tokenizer", tok, "--device", "cpu", "--max-model-len", str(TEXT_MAX_LEN),
            "--served-model-name", "tiny", "--structured-outputs-config",
            json.dumps({"compile_timeout_s": STRUCTURED_TIMEOUT_S})]
    for server in _serve(tmp_path_factory, "text", args, key=KEY):
        server.escape_marker = marker
        yield server


@pytest.fixture(scope="module")
def reference():
    return OfflineReference(MODEL, TOKENS_MAX_LEN)


def in_background(fn, *args, **kwargs) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(fn, *args, **kwargs)
    pool.shutdown(wait=False)
    return future


def wait_until(predicate, timeout_s: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def steps_run(m: dict[str, float]) -> float:
    return m.get("twogrid:cudagraph_steps_total", 0.0)  # (absent until the first step)


def mib(n: int) -> float:
    return round(n / 2**20, 1)


# ---------------------------------------------------------------------------------------------------------------
# load: the soak and the abort storm
# ---------------------------------------------------------------------------------------------------------------


def test_soak_every_stream_exactly_once_and_the_cache_whole_after_each_round(tokens_server, reference):
    """128 concurrent streams (64 run, 64 queue), two rounds: each stream ends once, with exactly the offline
    engine's tokens (nothing lost, nothing twice); after each round every KV block is free again and the server's
    RSS does not grow round over round. benchmarks/soak_cpu.py runs the full 1024 x 3."""
    server = tokens_server
    bodies = [request_body(p, 16, seed=i) for i, p in enumerate(token_prompts(128, VOCAB, 4, 32, seed=1))]
    ref = reference(bodies)
    start = wait_idle(server)
    blocks = start["twogrid:kv_cache_blocks"]
    assert start["twogrid:kv_cache_free_blocks"] == blocks
    rounds = []
    for _ in range(2):
        streams, wall_s = run_streams(server.base, bodies)
        figures = count_round(streams, ref, wall_s)
        end = wait_idle(server)
        rounds.append({**asdict(figures), "server_counted_ended": finished_requests(end) - finished_requests(start),
                       "kv_free_blocks_start": start["twogrid:kv_cache_free_blocks"],
                       "kv_free_blocks_end": end["twogrid:kv_cache_free_blocks"], "kv_blocks": blocks,
                       "kv_usage_end": end["twogrid:kv_cache_usage_perc"],
                       "server_rss_mib": mib(rss_bytes(server.proc.pid)),
                       "worker_rss_mib": mib(rss_bytes(server.worker_pid()))})
        start = end
    record("soak", streams=len(bodies), max_tokens=16, rounds=rounds)
    for r in rounds:
        assert (r["completed"], r["failed"], r["lost"], r["duplicated_chunks"]) == (len(bodies), 0, 0, 0), r
        assert r["server_counted_ended"] == len(bodies), r  # each request ended once, by the server's count too
        assert r["kv_free_blocks_end"] == blocks and r["kv_usage_end"] == 0.0, r
    for key in ("server_rss_mib", "worker_rss_mib"):  # flat: the second round holds no more than the first did
        assert rounds[-1][key] <= rounds[0][key] * 1.05 + 16, rounds


def test_abort_storm_leaves_the_other_streams_unchanged(tokens_server, reference):
    """64 streams, a quarter with prompts of 300-400 tokens (prefilled in 256-token chunks), on a KV cache too small
    for all (requests are preempted); half the clients go away at a random point: after a random delay (queued,
    prefilling, preempted or streaming by then) or after a random number of chunks. Every other stream gets
    exactly its seeded tokens, what a leaver got before leaving is a prefix of its tokens, every block comes back,
    and the same 64 requests undisturbed afterwards give the same tokens."""
    server = tokens_server
    rng = random.Random(15)
    prompts = token_prompts(64, VOCAB, 4, 32, seed=2)
    for i in range(0, 64, 4):
        prompts[i] = [rng.randrange(3, VOCAB) for _ in range(rng.randint(300, 400))]
    bodies = [request_body(p, 24, seed=1000 + i) for i, p in enumerate(prompts)]
    ref = reference(bodies)
    leave: list[dict] = [{} for _ in bodies]
    for i in rng.sample(range(64), 32):
        leave[i] = ({"leave_after_s": rng.uniform(0.0, 0.25)} if rng.random() < 0.5 else
                    {"leave_after_chunks": rng.randint(0, 20)})
    before = wait_idle(server)
    streams, wall_s = run_streams(server.base, bodies, leave=leave)
    storm = count_round(streams, ref, wall_s)
    after = wait_idle(server)
    again, again_s = run_streams(server.base, bodies)
    undisturbed = count_round(again, ref, again_s)
    end = wait_idle(server)
    leavers = [s for s in streams if s.left]
    record("abort_storm", streams=len(bodies), **asdict(storm),
           left_before_first_token=sum(not s.tokens for s in leavers),
           left_mid_stream=sum(bool(s.tokens) for s in leavers),
           preemptions=after["twogrid:num_preemptions_total"] - before["twogrid:num_preemptions_total"],
           kv_free_blocks_start=before["twogrid:kv_cache_free_blocks"],
           kv_free_blocks_end=after["twogrid:kv_cache_free_blocks"], kv_blocks=after["twogrid:kv_cache_blocks"],
           undisturbed_rerun=asdict(undisturbed))
    assert storm.lost == 0 and storm.failed == 0 and storm.duplicated_chunks == 0, storm
    assert storm.completed == len(bodies) - storm.left and storm.left >= 16, storm
    assert any(not s.tokens for s in leavers) and any(s.tokens for s in leavers)  # both kinds of leaving happened
    assert after["twogrid:num_preemptions_total"] > before["twogrid:num_preemptions_total"]  # the cache was short
    assert after["twogrid:kv_cache_free_blocks"] == after["twogrid:kv_cache_blocks"]
    assert (after["twogrid:num_requests_running"], after["twogrid:num_requests_waiting"]) == (0, 0)
    assert undisturbed.completed == len(bodies), undisturbed
    assert end["twogrid:kv_cache_free_blocks"] == end["twogrid:kv_cache_blocks"]


# ---------------------------------------------------------------------------------------------------------------
# frames that are not messages, on both sides of the process boundary
# ---------------------------------------------------------------------------------------------------------------


class _Unpickled:
    """Unpickling this makes a directory: evidence that someone unpickled it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _garbage_frames(marker: str) -> list[bytes]:
    from dispatcher import messages

    result = messages.encode(messages.StepResult(7, b"\x00" * 16, b"\x00" * 4, 4))
    step_like = messages.encode(messages.Shutdown())
    rng = random.Random(7)
    return [b"", b"\x00", b"\xc1", b"\xff" * 64, result[:-3], result[:5], step_like[:-1], b"\x93\xa4step\x01\x02",
            pickle.dumps(_Unpickled(marker)), b'{"step_id": 1}', bytes(rng.randrange(256) for _ in range(1 << 20)),
            *(bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))) for _ in range(20))]


@pytest.mark.parametrize("socket", ["to_engine", "to_front"])
def test_foreign_frames_on_the_engines_socket_are_refused(tokens_server, reference, tmp_path, socket):
    """A process of the server's user pushes malformed, truncated, random and pickled frames into a socket the
    server reads (the engine's from its worker, the front end's from the engine) while 32 streams run: each frame is
    refused with a warning, none is unpickled, every stream is exact."""
    import zmq

    server = tokens_server
    address = f"{server.worker_ipc_dir()}/to_engine" if socket == "to_engine" else f"{server.ipc_dir()}/to_front"
    marker = str(tmp_path / "unpickled")
    frames = _garbage_frames(marker)
    bodies = [request_body(p, 24, seed=2000 + i) for i, p in enumerate(token_prompts(32, VOCAB, 4, 32, seed=3))]
    ref = reference(bodies)
    refused_before = server.log().count("refused a malformed frame")
    running = in_background(run_streams, server.base, bodies)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{address}")
    try:
        wait_until(lambda: server.metrics()["twogrid:generation_tokens_total"] > 0 or running.done(), what="tokens")
        for frame in frames:
            push.send(frame)
        push.send_multipart([b"\x00", b"\xc1"])  # two more frames
        streams, wall_s = running.result(timeout=120)
    finally:
        push.close(linger=1000)
        ctx.term()
    figures = count_round(streams, ref, wall_s)
    wait_until(lambda: server.log().count("refused a malformed frame") - refused_before >= len(frames) + 2,
               timeout_s=10, what="every frame refused")
    record(f"{socket}_socket_frames", frames_sent=len(frames) + 2,
           frames_refused=server.log().count("refused a malformed frame") - refused_before, **asdict(figures),
           unpickled=os.path.exists(marker), server_alive=http_get(server.base + "/health")[0] == 200)
    assert figures.completed == len(bodies) and figures.lost == 0, figures
    assert not os.path.exists(marker)
    assert http_get(server.base + "/health")[0] == 200


def test_the_worker_refuses_malformed_frames_and_goes_on(reference):
    """The worker's socket: every frame that is not a message (truncated, random, pickled, before and between the
    steps) is answered with a refusal and the worker runs the engine's steps to the offline engine's tokens."""
    from dispatcher.engine.config import scheduler_config
    from dispatcher.engine.engine_core import EngineArgs, EngineCore
    from dispatcher.engine.ipc import RemoteWorker, WorkerProcess
    from dispatcher.messages import WorkerError, WorkerInit, decode_to_engine
    from dispatcher.plan.config import resolve
    from scheduler.request import SamplingParams

    max_len, blocks, seqs, budget = 256, 128, 8, 256
    cfg = resolve(None, None, platform="default", max_num_seqs=seqs, max_num_batched_tokens=budget)
    sched = scheduler_config(cfg, blocks, 16, max_len)
    init = WorkerInit(MODEL, "cpu", "float32", "default", seqs, budget, {}, {}, 16, max_len, sched.max_blocks_per_seq,
                      blocks, 0.9, 0, False)
    process = WorkerProcess(init)
    marker = os.path.join(process.dir, "unpickled")
    frames = _garbage_frames(marker)
    try:
        process.start(timeout_s=120)
        for frame in frames:
            process.to_worker.send(frame)
        refusals = []
        for _ in frames:
            assert process.to_engine.poll(10_000), "the worker did not answer a malformed frame"
            refusals.append(decode_to_engine(process.to_engine.recv()))
        assert all(isinstance(r, WorkerError) and r.step_id == -2 and "malformed" in r.message for r in refusals)
        worker = RemoteWorker(process)
        submit, between = worker.submit, iter(frames * 10)

        def noisy_submit(step):  # a malformed frame before every step
            process.to_worker.send(next(between))
            return submit(step)

        worker.submit = noisy_submit
        core = EngineCore(cfg, EngineArgs(MODEL, num_kv_blocks=blocks, max_model_len=max_len, use_cuda_graphs=False),
                          worker=worker)
        prompts = token_prompts(8, VOCAB, 4, 32, seed=4)
        got = core.generate(prompts, SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True))
        want = reference([request_body(p, 12, seed=5) for p in prompts])
        alive = process.alive()
    finally:
        process.close()
    record("worker_socket_frames", frames_sent=len(frames) + core.stats.steps, refused=len(refusals) + core.stats.steps,
           requests=len(prompts), exact=sum(g == w for g, w in zip(got, want)), worker_alive=alive)
    assert got == want and alive
    assert not os.path.exists(marker) and not os.path.exists(process.dir)


# ---------------------------------------------------------------------------------------------------------------
# failures: a step that raises, a worker that is killed
# ---------------------------------------------------------------------------------------------------------------


def test_a_failing_step_fails_its_requests_not_the_server(faulty_server, reference):
    """Step FAIL_STEP raises in the worker ($TWOGRID_FAIL_STEPS). Of 8 streams on a server of 4 slots, those in
    that step end with an error event after a prefix of their tokens; those waiting for a slot then run to their
    exact tokens; requests before and after are exact, every block comes back, /health stays 200."""
    server = faulty_server
    start = wait_idle(server)
    first = [request_body(p, 8, seed=3000 + i) for i, p in enumerate(token_prompts(4, VOCAB, 4, 16, seed=5))]
    during = [request_body(p, FAIL_STEP, seed=3100 + i) for i, p in enumerate(token_prompts(8, VOCAB, 4, 16, seed=6))]
    later = [request_body(p, 8, seed=3200 + i) for i, p in enumerate(token_prompts(8, VOCAB, 4, 16, seed=7))]
    ref_first, ref_during, ref_later = reference(first), reference(during), reference(later)
    a = count_round(run_streams(server.base, first)[0], ref_first)
    assert steps_run(server.metrics()) < FAIL_STEP - 10  # the next batch's first requests span the failing step
    streams, wall_s = run_streams(server.base, during)
    b = count_round(streams, ref_during, wall_s)
    c = count_round(run_streams(server.base, later)[0], ref_later)
    end = wait_idle(server)
    record("step_failure", sent=len(first) + len(during) + len(later),
           completed=a.completed + b.completed + c.completed,
           failed=a.failed + b.failed + c.failed, lost=a.lost + b.lost + c.lost, failed_step=FAIL_STEP,
           requests_in_the_step=b.failed, waiting_then_completed=b.completed,
           kv_free_blocks_start=start["twogrid:kv_cache_free_blocks"],
           kv_free_blocks_end=end["twogrid:kv_cache_free_blocks"],
           server_alive=http_get(server.base + "/health")[0] == 200)
    assert a.completed == len(first) and c.completed == len(later), (a, c)
    # the step held the requests in the 4 slots (all 4 unless the client was too slow to fill them by then)
    assert 1 <= b.failed <= FAULTY_SEQS and b.completed == len(during) - b.failed and b.lost == 0, b
    for s, ref in zip(streams, ref_during):
        if s.error is not None:
            assert f"step {FAIL_STEP} failed on purpose" in s.error and s.done, s
            assert s.tokens == ref[:len(s.tokens)] and 0 < len(s.tokens) < len(ref), s
    assert end["twogrid:kv_cache_free_blocks"] == end["twogrid:kv_cache_blocks"]
    assert http_get(server.base + "/health")[0] == 200


def test_a_killed_worker_fails_every_stream_and_the_server_exits_nonzero(faulty_server):
    """SIGKILL to the worker while 4 streams run: /health turns 503 and every stream gets an error event within
    DETECT_LIMIT_S, new requests get 503, the worker is reaped (no zombie), the server exits with code 1 (for its
    supervisor to restart it) and leaves no ipc directory."""
    server = faulty_server
    worker, ipc = server.worker_pid(), server.ipc_dir()
    bodies = [request_body(p, 200, seed=4000 + i) for i, p in enumerate(token_prompts(4, VOCAB, 4, 16, seed=8))]
    tokens_before = server.metrics()["twogrid:generation_tokens_total"]
    running = in_background(run_streams, server.base, bodies)
    wait_until(lambda: server.metrics()["twogrid:generation_tokens_total"] >= tokens_before + 4 * 8,
               what="every stream under way")
    killed_at = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    while http_get(server.base + "/health", timeout_s=2)[0] == 200:
        assert time.monotonic() - killed_at < 10, "the dead worker was not noticed"
        time.sleep(0.01)
    detect_s = time.monotonic() - killed_at
    worker_state = process_state(worker)
    try:
        refused = http_post(server.base + "/v1/completions", b'{"prompt": [5, 6], "max_tokens": 2}')[0]
    except OSError:  # it has exited already
        refused = None
    streams, _ = running.result(timeout=30)
    code = server.wait(30)
    errors_s = max(s.ended_at for s in streams) - killed_at
    record("worker_sigkill", sent=len(bodies), completed=sum(s.completed for s in streams),
           failed=sum(s.error is not None for s in streams),
           lost=sum(s.error is None and not s.completed for s in streams), detect_s=round(detect_s, 3),
           all_streams_told_s=round(errors_s, 3), new_request_status=refused, exit_code=code,
           worker_zombie=worker_state == "Z", ipc_dir_left=os.path.exists(ipc))
    assert detect_s <= DETECT_LIMIT_S and errors_s <= DETECT_LIMIT_S, (detect_s, errors_s)
    for s in streams:
        assert s.error is not None and "SIGKILL" in s.error and s.done and s.tokens, s
    assert worker_state is None  # reaped by the time /health said 503
    assert refused in (503, None)
    assert code == 1
    assert not os.path.exists(ipc)
    assert process_state(worker) is None


ENGINE_SCRIPT = """
import time
from dispatcher.engine.ipc import WorkerProcess
from dispatcher.messages import WorkerInit
p = WorkerProcess(WorkerInit("tiny-dense", "cpu", "float32", "default", 4, 64, {}, {}, 16, 64, 5, 32, 0.9, 0, False))
p.start(120)
print(p.pid, p.dir, flush=True)
time.sleep(600)
"""


def test_a_killed_engine_takes_its_worker_along():
    """The engine process itself is SIGKILLed (the OOM killer: nothing of it runs again): its orphaned worker
    notices within ENGINE_CHECK_S, removes the ipc directory and exits, instead of holding its memory (on a GPU,
    the device) forever."""
    import subprocess
    import sys

    from dispatcher.runtime.process import ENGINE_CHECK_S

    engine = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        line = engine.stdout.readline().split()
        assert len(line) == 2, f"the engine did not start its worker (exit {engine.poll()})"
        worker, ipc = int(line[0]), line[1]
        assert process_state(worker) not in (None, "Z") and os.path.isdir(ipc)
        os.kill(engine.pid, signal.SIGKILL)
        engine.wait()
        killed_at = time.monotonic()
        wait_until(lambda: process_state(worker) in (None, "Z") and not os.path.exists(ipc), timeout_s=10,
                   what="the orphaned worker to exit")
        gone_s = time.monotonic() - killed_at
    finally:
        engine.kill()
        engine.wait()
    record("engine_sigkill", worker_exited_s=round(gone_s, 3), ipc_dir_left=os.path.exists(ipc))
    assert gone_s <= 2 * ENGINE_CHECK_S + 1.0, gone_s


@pytest.mark.parametrize("victim", ["engine", "front_end"])
def test_a_killed_server_process_leaves_nothing_behind(tmp_path, victim):
    """The real server's processes SIGKILLed. The engine process: the front end notices within DETECT_LIMIT_S
    (/health 503), exits 1 and removes the ipc directory; the orphaned worker exits. The front end (the server
    itself): its orphaned engine stops the worker, removes the ipc directory and exits."""
    server = Server(["--model", MODEL, "--device", "cpu", "--max-model-len", "128"], str(tmp_path / "server.log"))
    server.wait_healthy()
    try:
        engine, worker, ipc = server.engine_pid(), server.worker_pid(), server.ipc_dir()
        killed_at = time.monotonic()
        if victim == "engine":
            os.kill(engine, signal.SIGKILL)
            status = 200
            while status == 200 and time.monotonic() - killed_at < 10:
                time.sleep(0.01)
                try:
                    status = http_get(server.base + "/health", timeout_s=2)[0]
                except OSError:  # it noticed and has already exited
                    status = "gone"
            detect_s = time.monotonic() - killed_at
            code = server.wait(30)
        else:
            server.proc.kill()
            code, status, detect_s = server.wait(30), None, None
        wait_until(lambda: all(process_state(p) in (None, "Z") for p in (engine, worker)) and not os.path.exists(ipc),
                   timeout_s=10, what="the other processes to exit and the ipc directory to go")
        gone_s = time.monotonic() - killed_at
    finally:
        server.stop()
    record(f"server_{victim}_sigkill", detect_s=None if detect_s is None else round(detect_s, 3), health=status,
           exit_code=code, others_gone_s=round(gone_s, 3), ipc_dir_left=os.path.exists(ipc))
    if victim == "engine":
        assert status in (503, "gone") and detect_s <= DETECT_LIMIT_S and code == 1, (status, detect_s, code)
    assert gone_s <= 5.0, gone_s


# ---------------------------------------------------------------------------------------------------------------
# hostile input
# ---------------------------------------------------------------------------------------------------------------


def _raw_request(path: str, headers: list[bytes], body: bytes = b"", method: bytes = b"POST") -> bytes:
    return (method + b" " + path.encode() + b" HTTP/1.1\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n"
            + body)


def _header_abuse() -> dict[str, bytes]:
    """Requests whose headers or request line are broken, oversized or contradictory."""
    body = b'{"prompt": "hi", "max_tokens": 2}'
    auth, host, cl = f"Authorization: Bearer {KEY}".encode(), b"Host: x", b"Content-Length: %d" % len(body)
    ok = [host, auth, b"Content-Type: application/json"]

    def post(headers, data=body, path="/v1/completions", method=b"POST"):
        return _raw_request(path, headers, data, method)

    return {
        "header of 100 KB": post(ok + [b"X-Big: " + b"a" * 100_000, cl]),
        "5000 headers": post(ok + [b"X-%d: v" % i for i in range(5000)] + [cl]),
        "Content-Length not a number": post(ok + [b"Content-Length: abc"]),
        "Content-Length negative": post(ok + [b"Content-Length: -1"]),
        "Content-Length beyond 64 bits": post(ok + [b"Content-Length: 99999999999999999999"]),
        "two Content-Lengths": post(ok + [cl, b"Content-Length: 3"]),
        "Content-Length and chunked": post(ok + [cl, b"Transfer-Encoding: chunked"]),
        "bad chunk size": post(ok + [b"Transfer-Encoding: chunked"], b"zz\r\nabc\r\n0\r\n\r\n"),
        "unknown Transfer-Encoding": post(ok + [b"Transfer-Encoding: gzip"]),
        "non-ASCII header name": post(ok + [b"X-\xff\xfe: v", cl]),
        "NUL in a header value": post(ok + [b"X-A: a\x00b", cl]),
        "header without a colon": post(ok + [b"NoColonHere", cl]),
        "space before the colon": post(ok + [b"Content-Length : %d" % len(body)]),
        "folded header": post(ok + [b"X-A: a", b" folded", cl]),
        "non-Latin-1 API key": post([host, b"Authorization: Bearer \xff\xfe\x00", cl]),
        "API key of 8 KB": post([host, b"Authorization: Bearer " + b"k" * 8000, cl]),
        "unknown method": post(ok + [cl], method=b"FOO"),
        "HTTP/9.9": _raw_request("/v1/completions", ok + [cl], body).replace(b"HTTP/1.1", b"HTTP/9.9", 1),
        "binary request line": b"\x00\x01\x02 garbage\r\n\r\n",
        "path of 100 KB": post(ok + [cl], path="/" + "a" * 100_000),
        "bare LF line ends": post(ok + [cl]).replace(b"\r\n", b"\n"),
    }


def test_hostile_http_requests_get_4xx_with_a_message(text_server):
    """At least 200 malformed requests (hypothesis over the request schema: wrong types, huge numbers, NaN,
    negative counts, unicode edge cases, deep JSON, unknown fields, empty and invalid UTF-8 bodies), 10 MB bodies
    and header abuse against the live server: each is answered 2xx or 4xx, every 4xx with a message (OpenAI's
    JSON from the app; aiohttp's parser answers broken HTTP in plain text), and the server keeps serving."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from serverutil import hostile_bodies

    server = text_server
    statuses: Counter = Counter()
    loop = asyncio.new_event_loop()
    session = loop.run_until_complete(_session())

    async def send(path: str, body: bytes, content_type: str | None) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {KEY}", **({"Content-Type": content_type} if content_type else {})}
        async with session.post(server.base + path, data=body, headers=headers) as r:
            return r.status, await r.read()

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=hostile_bodies(),
           content_type=st.sampled_from([None, "application/json", "text/plain", "application/json; charset=latin1"]))
    def check(path, body, content_type):
        status, payload = loop.run_until_complete(send(path, body, content_type))
        statuses[status] += 1
        assert_ok_or_4xx(status, payload)

    try:
        check()
    finally:
        loop.run_until_complete(session.close())
        loop.close()
    schema_4xx = sum(v for k, v in statuses.items() if 400 <= k < 500)

    ten_mb = json.dumps({"prompt": "x" * 10_000_000}).encode()
    head_only = _raw_request("/v1/completions", [b"Host: x", f"Authorization: Bearer {KEY}".encode(),
                                                 b"Content-Length: %d" % len(ten_mb)])
    answers: dict[str, tuple[int | None, bytes]] = {}

    async def abuse():
        answers["10 MB body"] = await raw_http(server.port, head_only)  # refused on its Content-Length
        async with aiohttp.ClientSession() as s:
            async def chunks():
                for i in range(0, len(ten_mb), 1 << 16):
                    yield ten_mb[i:i + (1 << 16)]
            try:
                async with s.post(server.base + "/v1/completions", data=chunks(),
                                  headers={"Authorization": f"Bearer {KEY}"}) as r:
                    answers["10 MB body, chunked"] = r.status, await r.read()
            except aiohttp.ClientError as exc:  # the server may close while the client still writes
                answers["10 MB body, chunked"] = None, repr(exc).encode()
        for name, request in _header_abuse().items():
            answers[name] = await raw_http(server.port, request)

    asyncio.run(abuse())
    bad = {k: v for k, v in answers.items() if v[0] is None or not 400 <= v[0] < 500 or not v[1].strip()}
    ok, answer = http_post(server.base + "/v1/completions", b'{"prompt": "Hello", "max_tokens": 3}', KEY)
    alive = http_get(server.base + "/health")[0] == 200 and ok == 200 and answer["usage"]["completion_tokens"] == 3
    record("hostile_http", schema_requests=sum(statuses.values()), schema_4xx=schema_4xx,
           schema_2xx=statuses[200], header_and_size_abuse=len(answers),
           header_and_size_abuse_4xx=len(answers) - len(bad), statuses=dict(sorted(statuses.items())),
           abuse_statuses={k: v[0] for k, v in answers.items()}, server_alive=alive)
    assert schema_4xx >= 200, statuses
    assert answers["10 MB body"][0] == 413 and b"too large" in answers["10 MB body"][1]
    assert not bad, bad
    assert alive


async def _session():
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))


def test_costly_requests_are_refused_before_any_step(text_server):
    """Oversize prompts, max_tokens beyond the model's length and bad stop lists get 400 naming the field, and
    not one step runs for them (the step and prompt-token counters do not move)."""
    server = text_server
    long_text = "word " * 200  # well over TEXT_MAX_LEN tokens
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ("/v1/completions", {"prompt": long_text, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": list(range(3, 3 + TEXT_MAX_LEN)), "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [5] * 10**5, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": TEXT_MAX_LEN}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": [str(i) for i in range(1000)]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": [1, 2]}, "stop[0]"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": {"a": 1}}, "stop"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}, "messages"),
        ("/v1/chat/completions", {"messages": msgs, "max_completion_tokens": TEXT_MAX_LEN}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "stop": ["ok", None]}, "stop[1]"),
    ]
    before = wait_idle(server)
    answers = [http_post(server.base + path, json.dumps(body).encode(), KEY) for path, body, _ in cases]
    after = server.metrics()
    record("costly_refused", requests=len(cases), answered_400=sum(s == 400 for s, _ in answers),
           steps_run=steps_run(after) - steps_run(before),
           prompt_tokens=after["twogrid:prompt_tokens_total"] - before["twogrid:prompt_tokens_total"])
    for (path, body, param), (status, payload) in zip(cases, answers):
        assert status == 400 and payload["error"]["param"] == param and payload["error"]["message"], (body, payload)
    assert steps_run(after) == steps_run(before)
    assert after["twogrid:prompt_tokens_total"] == before["twogrid:prompt_tokens_total"]


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _slow_enum(seed: int) -> dict:
    """A schema under every static limit whose compile takes seconds (4000 long enum values: 12 s here on the
    500-token vocabulary, 0.24 s at 2000)."""
    return {"type": "object", "properties": {"k": {"enum": [f"value {seed} number {i} of many" for i in range(4000)]}},
            "required": ["k"]}


def test_hostile_structured_requests_are_refused_or_bounded(text_server):
    """Structured-output constraints that are huge, deeply nested or pathological get a 400 naming the field and
    the limit before any step (static limits, or a compile that fails); ones under the limits that compile slowly
    are refused after the compile timeout, and meanwhile another request streams on without a stall (the compile
    runs in the engine's pool, the step loop does not wait for it)."""
    server = text_server
    msgs = [{"role": "user", "content": "hi"}]
    json_schema = lambda schema: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}  # noqa: E731
    tool = {"type": "function", "function": {"name": "f", "parameters": _nested_schema(100)}}
    cases = [
        ({"response_format": json_schema({"type": "object", "properties": {
            f"p{i}": {"type": "string", "description": "x" * 40} for i in range(3000)}})}, "response_format",
         "characters; at most"),
        ({"response_format": json_schema(_nested_schema(100))}, "response_format", "nests JSON objects and arrays deeper than 64"),
        ({"response_format": json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in
                                                                           range(3000)},
                                          "required": [f"p{i}" for i in range(3000)]})},  # (the engine's OOM, once)
         "response_format", "more than 256 object properties"),
        ({"structured_outputs": {"choice": [str(i) for i in range(5000)]}}, "structured_outputs", "at most 4096"),
        ({"structured_outputs": {"regex": "[a-z]{1,100000}"}}, "structured_outputs", "at most 1000"),
        ({"guided_json": {"type": "object", "properties": {"a": {"pattern": "x{99999}"}}}}, "guided_json",
         "repetition"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "does not compile"),
        ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs", "does not compile"),
        ({"response_format": json_schema({"type": "nonsense"})}, "response_format", "does not compile"),
        ({"structured_outputs": {"structural_tag": '{"type": "structural_tag", "format": {"type": "bogus"}}'}},
         "structured_outputs", "does not compile"),
        ({"tools": [tool], "tool_choice": "required"}, "tools", "nests JSON objects"),
    ]
    before = wait_idle(server)
    answers = []
    for body, _, _ in cases:
        path = "/v1/chat/completions" if "tools" in body else "/v1/completions"
        request = {**body, "messages": msgs} if "tools" in body else {**body, "prompt": "hi"}
        answers.append(http_post(server.base + path, json.dumps({**request, "max_tokens": 2}).encode(), KEY))
    after = server.metrics()
    for (body, param, words), (status, payload) in zip(cases, answers):
        assert status == 400 and payload["error"]["param"] == param and words in payload["error"]["message"], (
            param, payload)
    assert steps_run(after) == steps_run(before)

    async def stall_test():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            async def slow(seed):
                body = {"prompt": "hi", "max_tokens": 4, "response_format": json_schema(_slow_enum(seed))}
                t0 = time.monotonic()
                async with s.post(server.base + "/v1/completions", json=body) as r:
                    return r.status, await r.json(), time.monotonic() - t0, time.monotonic()

            async def stream():
                await asyncio.sleep(0.3)  # (the compiles have started)
                body = {"prompt": "hi", "max_tokens": 40, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                arrivals, usage = [], None
                async with s.post(server.base + "/v1/completions", json=body) as r:
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            arrivals.append(time.monotonic())
                            usage = json.loads(line[6:]).get("usage") or usage
                return r.status, arrivals, usage

            return await asyncio.gather(slow(1), slow(2), stream())

    t0 = time.monotonic()
    first, second, (stream_status, arrivals, usage) = asyncio.run(stall_test())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    record("hostile_structured", refused=len(cases), refused_400=sum(s == 400 for s, _ in answers),
           steps_run=steps_run(after) - steps_run(before), slow_compiles=[first[0], second[0]],
           slow_answered_s=[round(first[2], 2), round(second[2], 2)], stream_chunks=len(arrivals),
           stream_max_gap_s=round(max(gaps), 3), wall_s=round(time.monotonic() - t0, 2))
    for status, payload, waited, _ in (first, second):
        if status == 400:  # (a fast machine may compile it in time: then it is answered)
            assert f"did not compile within {STRUCTURED_TIMEOUT_S:.0f} s" in payload["error"]["message"], payload
            assert waited < STRUCTURED_TIMEOUT_S + 2.0
        else:
            assert status == 200, payload
    # The stream got all its tokens (in however many chunks: a front end behind merges steps), and got them while
    # the compiles were still running: a compile holding the step loop would have held the stream for its seconds.
    assert stream_status == 200 and usage and usage["completion_tokens"] == 40, usage
    if first[0] == second[0] == 400:  # (refused at the timeout: the compiles ran all along)
        assert arrivals[-1] < min(first[3], second[3]), (arrivals[-1], first[3], second[3])
    assert max(gaps) < 1.0, gaps


# ---------------------------------------------------------------------------------------------------------------
# security defaults
# ---------------------------------------------------------------------------------------------------------------


def _listening_addresses(port: int) -> set[str]:
    """The local addresses sockets listen on at ``port`` (from /proc/net/tcp and tcp6)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as fh:
            for line in fh.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:  # LISTEN
                    raw = bytes.fromhex(address)
                    if len(raw) == 4:
                        out.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                    else:
                        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                        out.add(socket.inet_ntop(socket.AF_INET6, words))
    return out


def test_security_defaults(text_server):
    """Loopback only unless --host; the API key on every route but /health (compared in constant time); the ipc
    directory private; a chat template cannot reach Python internals; no prompt text in the log."""
    import dispatcher.serve.app as app_module
    from dispatcher.cli import build_parser

    server = text_server
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
    assert _listening_addresses(server.port) == {"127.0.0.1"}

    routes = [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
              ("POST", "/v1/chat/completions"), ("GET", "/nowhere"), ("DELETE", "/v1/models")]
    wrong = [None, "Bearer wrong", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"bearer {KEY}", KEY, f"Basic {KEY}"]
    statuses = Counter(_urlopen(server.base + path, method, {"Authorization": auth} if auth else {})
                       for method, path in routes for auth in wrong)
    assert statuses == Counter({401: len(routes) * len(wrong)}), statuses
    assert http_get(server.base + "/health")[0] == 200  # probes carry no key
    assert http_get(server.base + "/v1/models", KEY)[0] == 200
    assert "hmac.compare_digest" in pathlib.Path(app_module.__file__).read_text()

    ipc = server.ipc_dir()
    mode = os.stat(ipc).st_mode & 0o777
    assert mode == 0o700, oct(mode)

    trap, trap_answer = http_post(server.base + "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": SANDBOX_TRIGGER}], "max_tokens": 2}).encode(), KEY)
    assert trap == 400 and "unsafe" in trap_answer["error"]["message"], trap_answer
    assert not server.escape_marker.exists()
    chat, _ = http_post(server.base + "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "{{ 7 * 7 }} {% raw %}"}], "max_tokens": 2}).encode(), KEY)
    assert chat == 200  # message content is data, not template

    secret = "canary 5f3a prompt text"
    for path, body in [("/v1/completions", {"prompt": secret, "max_tokens": 2}),
                       ("/v1/completions", {"prompt": secret, "max_tokens": 2, "stream": True}),
                       ("/v1/completions", {"prompt": secret, "max_tokens": 10**6}),
                       ("/v1/completions", {"prompt": secret, "stop": [""]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": secret}], "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": secret}]})]:
        _urlopen(server.base + path, "POST", {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
                 json.dumps(body).encode())
    log = server.log()
    assert "POST /v1/completions" in log and secret not in log
    record("security_defaults", listen=sorted(_listening_addresses(server.port)),
           unauthorized_attempts=sum(statuses.values()), answered_401=statuses[401], ipc_dir_mode=oct(mode),
           sandbox_escape_refused=trap == 400, prompt_text_in_log=secret in log)


def _urlopen(url: str, method: str, headers: dict, body: bytes | None = None) -> int:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body if body is not None else (b"{}" if method == "POST" else None),
                                 headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "jsonpickle"}
PICKLE_CALLS = {"recv_pyobj", "send_pyobj", "loads", "load"}


def test_no_pickle_on_any_channel():
    """No module of the server imports a pickle-family module, calls ZeroMQ's pyobj methods or torch.load, or
    lets numpy unpickle: every frame and file it reads is msgpack (msgspec), JSON, safetensors or GGUF."""
    offenders = []
    for package in ("dispatcher", "models", "scheduler"):
        for path in sorted(pathlib.Path(REPO, package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module.split(".")[0]]
                if PICKLE_MODULES & set(names):
                    offenders.append(f"{path}:{node.lineno} imports {names}")
                if isinstance(node, ast.Attribute) and node.attr in ("recv_pyobj", "send_pyobj"):
                    offenders.append(f"{path}:{node.lineno} .{node.attr}")
                if isinstance(node, ast.Attribute) and node.attr == "load" and isinstance(node.value, ast.Name) \
                        and node.value.id in ("torch", "np", "numpy"):
                    offenders.append(f"{path}:{node.lineno} {node.value.id}.load")
                if isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                    offenders.append(f"{path}:{node.lineno} allow_pickle")
    assert not offenders, offenders


def test_a_worker_killed_while_idle_is_noticed(text_server):
    """No request runs when the worker is SIGKILLed (last of the text server's tests): the server still notices
    within DETECT_LIMIT_S (/health 503, for the orchestrator) and exits 1, leaving no ipc directory."""
    server = text_server
    worker, ipc = server.worker_pid(), server.ipc_dir()
    wait_idle(server)
    killed_at = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    status, body = 200, b""
    while status == 200 and time.monotonic() - killed_at < 10:
        time.sleep(0.01)
        status, body = http_get(server.base + "/health", timeout_s=2)
    detect_s = time.monotonic() - killed_at
    code = server.wait(30)
    record("worker_sigkill_idle", detect_s=round(detect_s, 3), health=status, exit_code=code,
           worker_zombie=process_state(worker) == "Z", ipc_dir_left=os.path.exists(ipc))
    assert status == 503 and b"SIGKILL" in body, body
    assert detect_s <= DETECT_LIMIT_S, detect_s
    assert code == 1 and not os.path.exists(ipc)


# ---------------------------------------------------------------------------------------------------------------
# graceful shutdown (last: it ends the tokens server)
# ---------------------------------------------------------------------------------------------------------------


LONG_TOKENS = TOKENS_MAX_LEN - 40
"""Longer than SHUTDOWN_TIMEOUT_S lasts at any step time above 1 ms (an idle 2-core machine takes ~3 ms a step here:
with a 3 s timeout the long streams finished first there); two of them and the short streams fit in the KV cache (no
preemption)."""


def test_sigterm_drains_in_flight_streams_then_exits_0(tokens_server, reference):
    """SIGTERM (to the server and to its worker) with 6 streams in flight: /health and new requests get 503 at
    once; the 4 short streams finish within --shutdown-timeout with their exact tokens; the 2 long ones end with an
    error event right at the timeout (never a cut or a hang); the server exits 0, the worker reaped, the ipc
    directory removed."""
    server = tokens_server
    worker, ipc = server.worker_pid(), server.ipc_dir()
    prompts = token_prompts(6, VOCAB, 4, 16, seed=9)
    short = [request_body(p, 16, seed=5000 + i) for i, p in enumerate(prompts[:4])]
    long = [request_body(p, LONG_TOKENS, seed=5100 + i) for i, p in enumerate(prompts[4:])]
    ref = reference(short)
    wait_idle(server)
    streams = [Stream() for _ in short + long]
    running = in_background(run_streams, server.base, short + long, outs=streams)
    # SIGTERM once the short streams are nearly done (they need a few more steps however slow the machine is) and
    # the long ones are under way
    wait_until(lambda: all(len(s.tokens) >= 12 for s in streams[:4]) and all(s.tokens for s in streams[4:])
               or running.done(), what="every stream under way")
    term_at = time.monotonic()
    server.signal(signal.SIGTERM)
    os.kill(worker, signal.SIGTERM)  # as systemd's default KillMode (control-group) does: the worker must go on
    wait_until(lambda: http_get(server.base + "/health")[0] == 503, timeout_s=SHUTDOWN_TIMEOUT_S, what="draining")
    refused, answer = http_post(server.base + "/v1/completions", b'{"prompt": [5, 6], "max_tokens": 2}')
    running.result(timeout=60)
    code = server.wait(30)
    exit_s = time.monotonic() - term_at
    done_short = count_round(streams[:4], ref)
    long_errors = [s for s in streams[4:] if s.error is not None and s.done]
    told_s = [round(s.ended_at - term_at, 2) for s in streams[4:]]
    record("sigterm_drain", sent=len(streams), completed=done_short.completed, failed=len(long_errors),
           lost=done_short.lost + sum(s.error is None for s in streams[4:]), new_request_status=refused,
           shutdown_timeout_s=SHUTDOWN_TIMEOUT_S, long_streams_told_s=max(told_s), exit_s=round(exit_s, 2),
           exit_code=code, ipc_dir_left=os.path.exists(ipc), worker_left=process_state(worker) is not None)
    assert refused == 503 and "shutting down" in answer["error"]["message"], answer
    assert done_short.completed == 4, (done_short, [(s.error, len(s.tokens), s.done) for s in streams[:4]])
    assert len(long_errors) == 2 and all("shut down" in s.error and len(s.tokens) < LONG_TOKENS for s in long_errors)
    assert all(SHUTDOWN_TIMEOUT_S * 0.9 <= t <= SHUTDOWN_TIMEOUT_S + 2 for t in told_s), told_s  # their time, no more
    assert code == 0
    assert SHUTDOWN_TIMEOUT_S <= exit_s <= SHUTDOWN_TIMEOUT_S + 20, exit_s
    assert not os.path.exists(ipc) and process_state(worker) is None


def test_a_worker_closed_before_it_connects_still_gets_its_shutdown():
    """``WorkerProcess.close`` right after the spawn, while the worker still imports (its socket not yet connected):
    the Shutdown waits for the connection instead of being refused and dropped, so the worker exits within a few
    seconds, long before the 30 s after which it would be SIGKILLed, and leaves nothing."""
    from dispatcher.engine.ipc import WorkerProcess
    from dispatcher.messages import WorkerInit

    process = WorkerProcess(WorkerInit("tiny-dense", "cpu", "float32", "default", 4, 64, {}, {}, 16, 64, 5, 32, 0.9,
                                       0, False))
    pid, ipc = process.pid, process.dir
    t0 = time.monotonic()
    process.close(timeout_s=30.0)
    assert time.monotonic() - t0 < 20.0
    assert process.proc.returncode is not None and process.proc.returncode >= 0, process.proc.returncode
    assert not os.path.exists(ipc) and process_state(pid) is None
