"""The serving engine's step loop (``dispatcher.engine.service.EngineService``) against a worker that keeps up, behind
sockets whose awaits resolve at once when a frame is waiting (a stub: pyzmq's poll yields even then, so this is the
worst case the loop must survive). A request that arrives while others run must join them within a step or two,
not wait until they finish."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import numpy as np

from dispatcher.engine.engine_core import EngineArgs, EngineCore
from dispatcher.engine.protocol import Abort, AddRequest, Drain, Outputs, decode_to_front
from dispatcher.engine.protocol import encode as encode_core
from dispatcher.engine.service import EngineService
from dispatcher.messages import WorkerError
from dispatcher.plan.config import resolve
from models.config import preset
from scheduler.request import SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_engine_host_cpu import Done, Inbox, InstantSockets  # noqa: E402  (the sockets' stand-ins, shared)


class _InstantWorker(InstantSockets):
    """A step sent is run at once by the in-process worker, its result waits."""

    def __init__(self, core: EngineCore):
        super().__init__(self.answer)  # (a subclass's own answer, where it has one)
        self.core = core

    def answer(self, step):
        return self.core.worker.collect(self.core.worker.submit(step))


class _Outbox:
    def __init__(self):
        self.sent: list[Outputs] = []

    def send(self, frame: bytes) -> Done:
        self.sent.append(decode_to_front(frame))
        return Done(None)


def test_a_request_arriving_mid_run_joins_the_running_ones_at_once():
    cfg = resolve({}, None, platform="sm100", max_num_seqs=8, max_num_batched_tokens=64)
    core = EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=64, block_size=8, max_model_len=128))
    inbox, outbox = Inbox(), _Outbox()
    service = EngineService(None, _InstantWorker(core), inbox, [outbox])
    service.core = core
    params = SamplingParams(max_tokens=48, ignore_eos=True)

    def tokens_of(request_id: str) -> list[int]:
        """The index (in messages sent) of each token of ``request_id``."""
        return [i for i, out in enumerate(outbox.sent) for d in out.deltas if d.request_id == request_id
                for _ in d.new_token_ids]

    async def scenario():
        receiver = asyncio.get_running_loop().create_task(service.receive())
        runner = asyncio.get_running_loop().create_task(service.run())
        inbox.queue.put_nowait(encode_core(AddRequest("first", [5, 6, 7, 8], params)))
        while len(tokens_of("first")) < 4:  # the first request is decoding
            await asyncio.sleep(0)
        inbox.queue.put_nowait(encode_core(AddRequest("second", [9, 10, 11], params)))
        sent_when_queued = len(outbox.sent)
        while len(tokens_of("second")) < 48:
            await asyncio.sleep(0)
        inbox.queue.put_nowait(encode_core(Drain()))  # (as the front end stops it: the step task ends)
        await asyncio.wait_for(runner, 30)
        receiver.cancel()
        return sent_when_queued

    sent_when_queued = asyncio.run(asyncio.wait_for(scenario(), 120))
    first, second = tokens_of("first"), tokens_of("second")
    assert len(first) == len(second) == 48
    # The second request's first token comes within three steps of its arrival (one may be in flight), while the
    # first still runs.
    assert second[0] - sent_when_queued <= 3, (sent_when_queued, second[:3])
    assert second[0] < first[-1], (second[0], first[-1])


def test_a_steps_outputs_go_out_after_the_step_its_result_scheduled_is_sent():
    """With asynchronous scheduling, step k + 1 is sent before step k's result is taken, and step k + 2 is
    scheduled from that result: step k's deltas are built and sent after step k + 2 goes to the worker (the device,
    running step k + 1, need not wait for them when the host sets the pace), in step order; the last steps' go out
    though no step follows, and every token arrives."""
    events: list[str] = []

    class Worker(_InstantWorker):
        def send(self, frame):
            events.append("step")
            return super().send(frame)

    class Outbox(_Outbox):
        def send(self, frame):
            events.append("outputs")
            return super().send(frame)

    service, inbox, _ = _service(Worker)
    outbox = Outbox()
    service.outboxes, service.outbox = [outbox], outbox
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    async def script(put):
        for i in range(3):
            put(encode_core(AddRequest(f"r{i}", [5 + i, 6, 7], params)))

    _drive(service, inbox, script)
    assert service.core.async_scheduling
    tokens = {f"r{i}": [t for out in outbox.sent for d in out.deltas if d.request_id == f"r{i}"
                        for t in d.new_token_ids] for i in range(3)}
    assert all(len(t) == 12 for t in tokens.values()), tokens
    steps = [i for i, e in enumerate(events) if e == "step"]
    sent = [i for i, e in enumerate(events) if e == "outputs"]
    with_tokens = [i for i, out in zip(sent, outbox.sent) if out.deltas]
    assert len(with_tokens) == len(steps)  # one Outputs a step
    assert all(steps[k + 2] < with_tokens[k] for k in range(len(steps) - 2)), events
    assert with_tokens[-2] > steps[-1] and with_tokens == sorted(with_tokens)


def test_a_burst_of_arrivals_is_taken_in_turns_while_the_steps_go_on():
    """A burst of arrivals waiting on the socket (a few hundred chat turns at once) is taken in turns of about
    ARRIVAL_TURN_S with the step task scheduling between them: the running requests' steps keep going to the worker
    while the burst is checked, hashed and queued; taken in one turn (as before), no step went out until it was
    taken, and on a GPU the device idled meanwhile (40 ms on the H100's host). Run by the benchmark's harness
    (``bench_engine_arrivals_cpu.served_burst``: the engine's step loop over an instant worker)."""
    import types

    from bench_engine_arrivals_cpu import served_burst

    from dispatcher.engine.service import ARRIVAL_TURN_S

    args = types.SimpleNamespace(burst=400, prompt_len=1500, running=8, engine_hashes=False,
                                 python_gc=True)
    rng = np.random.default_rng(0)
    _, burst_ms, steps = served_burst(args, rng, ARRIVAL_TURN_S)
    turns = burst_ms / 1e3 / ARRIVAL_TURN_S
    assert turns > 10, burst_ms  # (the burst takes many turns on any machine: ~100 us an arrival)
    assert steps >= min(5, turns // 4), (steps, turns)
    assert served_burst(args, rng, float("inf"))[2] == 0  # (one turn: the loop before)


# -- the engine's part of each TTFT (queue_s, prefill_s on a request's first delta) ----------------------------------

def _service(worker=_InstantWorker, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64):
    cfg = resolve({}, None, platform="sm100", max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    core = EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=num_kv_blocks, block_size=8,
                                      max_model_len=128))
    inbox, outbox = Inbox(), _Outbox()
    service = EngineService(None, worker(core), inbox, [outbox])
    service.core = core
    return service, inbox, outbox


def _drive(service, inbox, script) -> None:
    """``script(put)`` sends the front end's messages while the service runs; then the service drains."""
    async def scenario():
        loop = asyncio.get_running_loop()
        receiver, runner = loop.create_task(service.receive()), loop.create_task(service.run())
        await script(inbox.queue.put_nowait)
        while service.core.has_unfinished() or service._in_flight:
            await asyncio.sleep(0)
        inbox.queue.put_nowait(encode_core(Drain()))
        await asyncio.wait_for(runner, 60)
        receiver.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 120))


def _timed(outbox) -> list[str]:
    """The requests whose delta carried the engine's times, in order."""
    return [d.request_id for out in outbox.sent for d in out.deltas if d.queue_s is not None]


def test_each_request_gets_its_engine_times_once_and_none_are_left_behind():
    """Under preemption (a small KV cache), an n = 3 request (its first choice timed) and aborts before a first
    token (a waiting request, an n = 2 request by its choices): the times ride on each request's first delta only,
    that delta carries tokens, and nothing is left in the service's table once it drains."""
    service, inbox, outbox = _service(num_kv_blocks=20, max_num_seqs=8, max_num_batched_tokens=32)
    long = SamplingParams(max_tokens=40, ignore_eos=True)

    async def script(put):
        for i in range(12):
            put(encode_core(AddRequest(f"r{i}", list(range(5, 35)), long)))
        put(encode_core(AddRequest("n3", [5, 6, 7], SamplingParams(max_tokens=3, n=3, temperature=0.7))))
        put(encode_core(AddRequest("gone", [5, 6, 7], long)))
        put(encode_core(AddRequest("gone2", [5, 6, 8], SamplingParams(max_tokens=3, n=2, temperature=0.7))))
        await asyncio.sleep(0)
        put(encode_core(Abort(["gone", "0_gone2", "1_gone2"])))

    _drive(service, inbox, script)
    assert service.core.scheduler.stats.preemptions > 0
    assert service._times == {}
    assert sorted(_timed(outbox)) == sorted([f"r{i}" for i in range(12)] + ["0_n3"])
    for out in outbox.sent:
        for d in out.deltas:
            if d.queue_s is not None:
                assert d.queue_s >= 0 and d.prefill_s >= 0 and d.new_token_ids


def test_a_failed_step_drops_its_requests_times():
    """The worker fails the first step: its request fails without times and leaves no entry; a later one is timed."""

    class FailingFirst(_InstantWorker):
        failed = False

        def answer(self, step):
            if not self.failed:
                self.failed = True
                return WorkerError(step.step_id, "boom")
            return super().answer(step)

    service, inbox, outbox = _service(FailingFirst)
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def script(put):
        put(encode_core(AddRequest("a", [5, 6, 7], params)))
        while not any(out.failed for out in outbox.sent):
            await asyncio.sleep(0)
        put(encode_core(AddRequest("b", [5, 6, 7], params)))

    _drive(service, inbox, script)
    assert service._times == {}
    assert _timed(outbox) == ["b"]


def test_the_engines_steps_run_no_garbage_collection_with_the_collector_as_the_server_sets_it(tmp_path):
    """benchmarks/bench_engine_host_cpu.py (each run in its own process: the collector's settings are the
    process's): 512 decoding requests, 200 steady-state steps of the serving engine's loop over a worker that answers
    at once. With the collector as ``twogrid serve`` sets it (``freeze_startup_heap``: start-up's objects frozen, a
    young generation of ``GC_YOUNG_THRESHOLD``) no collection runs; with CPython's threshold of 700 a step's outputs
    set off young collections about every step and, by promoting them, full ones (on the CI machine at 1,024
    requests: 0.77 ms a step of a 3.6 ms step, full collections of 8 ms every ~26 steps; docs/bench/
    engine_host_cpu.json)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "benchmarks")]))
    runs = {}
    for name, extra in (("server", []), ("python", ["--python-gc"])):
        out = tmp_path / f"{name}.json"
        subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_engine_host_cpu.py"), "--requests",
                        "512", "--warmup", "40", "--steps", "200", "--out", str(out)] + extra, check=True, env=env,
                       capture_output=True, timeout=300)
        runs[name] = json.loads(out.read_text())
    assert runs["server"]["gc_collections"] == [0, 0, 0] and runs["server"]["gc_threshold"][0] == 50_000
    # (about one young collection a step: 182 of 200 steps since the outputs went out as the scheduler made them)
    assert runs["python"]["gc_collections"][0] >= 150 and runs["python"]["gc_threshold"][0] == 700


def test_a_long_garbage_collection_while_serving_is_logged_with_its_generation(caplog, monkeypatch):
    """A collection that pauses a serving process (a step of 256 requests waited 10-20 ms on a few in the H100's
    structured-output runs) is a warning naming its generation and duration; short ones are not logged."""
    import gc
    import logging

    from dispatcher import child

    saved = gc.get_threshold()
    try:
        child.freeze_startup_heap()
        child.freeze_startup_heap()  # (one hook, however often it is called)
        assert gc.callbacks.count(child._log_long_collection) == 1
        with caplog.at_level(logging.WARNING, logger="twogrid"):
            gc.collect(0)
            assert not caplog.records  # (a young collection of nothing: well under LONG_COLLECTION_MS)
            monkeypatch.setattr(child, "LONG_COLLECTION_MS", 0.0)
            gc.collect(2)
        assert any("garbage collection of generation 2 paused this process" in r.message for r in caplog.records)
    finally:
        gc.callbacks.remove(child._log_long_collection)
        gc.unfreeze()
        gc.set_threshold(*saved)


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # (a call that holds the event loop's thread, as a burst of arrivals would)


def test_a_held_event_loop_is_logged_with_where_it_was_held(caplog):
    """A serving process's event loop held past the threshold logs a line: how long, and the innermost frames its
    thread was in meanwhile (here the holding function); turns that come on time log nothing; a hold still waiting
    out the lines' rate limit is logged when the watch stops, and the watch's thread ends with its loop."""
    import logging

    from dispatcher import child

    async def main(hold_s: float, holds: int = 1, stop: bool = True) -> None:
        watch = child.LoopWatch(held_ms=80.0)
        await asyncio.sleep(0.05)  # (an idle loop: its ticks come on time)
        for _ in range(holds):
            _hold_the_loop(hold_s)
            await asyncio.sleep(0.02)  # (the first turn after a hold logs it, or counts it for the next line)
        if stop:
            watch.stop()

    def held(lines):
        return [float(line.split("held ")[1].split(" ms")[0]) for line in lines]

    with caplog.at_level(logging.WARNING, logger="twogrid"):
        asyncio.run(main(0.0))
        assert not [r for r in caplog.records if "held" in r.getMessage()]
        asyncio.run(main(0.3, holds=2))  # (the second hold within a second of the first: logged at stop)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("the event loop was held ")]
    assert len(lines) == 2, lines
    assert all(250 <= ms < 3000 for ms in held(lines)), lines
    assert all("_hold_the_loop test_engine_service.py" in line for line in lines), lines
    asyncio.run(main(0.0, holds=0, stop=False))  # (a serving process's watch is never stopped: its loop closes)
    assert _watch_threads_end()


def _watch_threads_end(timeout_s: float = 2.0) -> bool:
    """The watch threads of closed loops end within ``timeout_s`` (each checks its loop at its next wake-up)."""
    import threading

    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if not any(t.name == "loop-watch" and t.is_alive() for t in threading.enumerate()):
            return True
        time.sleep(0.02)
    return False


def test_a_place_sampled_inside_an_import_names_the_module_and_its_importer(tmp_path, monkeypatch):
    """A front end's first chat turns held its loop 100-140 ms importing jinja2: the logged place names the module
    imported and the code that imported it, not the import system's frames."""
    import importlib
    import sys as sys_module

    from dispatcher import child

    (tmp_path / "slow_module_xyz.py").write_text("import sys\nCAPTURED = sys._getframe()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        frame = importlib.import_module("slow_module_xyz").CAPTURED
        place = child.frame_place(frame, depth=3)
    finally:
        sys_module.modules.pop("slow_module_xyz", None)
    assert place.startswith("importing: <module> slow_module_xyz.py:2 < "), place
    assert "test_a_place_sampled_inside_an_import" in place and "<frozen" not in place, place


def test_the_loop_watch_is_off_at_zero_and_a_bad_value_keeps_the_default(monkeypatch, caplog):
    import logging

    from dispatcher import child

    async def started():
        watch = child.watch_event_loop()
        if watch is not None:
            watch.stop()
        return watch

    monkeypatch.setenv(child.LOOP_HELD_MS_ENV, "0")
    assert asyncio.run(started()) is None
    monkeypatch.setenv(child.LOOP_HELD_MS_ENV, "lots")
    with caplog.at_level(logging.WARNING, logger="twogrid"):
        watch = asyncio.run(started())
    assert watch is not None and watch.held_s == child.LOOP_HELD_MS / 1e3
    assert any("TWOGRID_LOOP_HELD_MS='lots' is not a number of ms" in r.getMessage() for r in caplog.records)


class _Rank:
    """A tensor-parallel rank's process as WorkerGroup sees it; ``kill`` makes it one SIGKILLed."""

    def __init__(self, pid: int):
        self.pid, self.killed = pid, False

    def alive(self) -> bool:
        return not self.killed

    def exit_description(self) -> str:
        return "killed by signal SIGKILL" if self.killed else "running"

    async def wait_exit(self, poll_s: float) -> None:
        while not self.killed:
            await asyncio.sleep(poll_s)


def _failing_group_run(rank_1_dies_after_s: float | None) -> tuple[str, float]:
    """A two-rank group whose rank 0 fails the first step (its collective broke) and whose rank 1 is killed
    ``rank_1_dies_after_s`` after rank 0's error is sent (None: never): the WorkerDied the engine's loop raises, and
    how long after the error it came."""
    from dispatcher.engine.ipc import WorkerDied, WorkerGroup

    class Group(WorkerGroup):
        def __init__(self, core):  # (no processes: rank 0's sockets answered in-process)
            self.ranks = [_Rank(100), _Rank(101)]
            self.sockets = InstantSockets(self.answer)
            self.to_worker = self.to_engine = self.sockets
            self.failed_at = None

        def answer(self, step):
            self.failed_at = time.monotonic()
            if rank_1_dies_after_s is not None:
                asyncio.get_running_loop().call_later(rank_1_dies_after_s, setattr, self.ranks[1], "killed", True)
            return WorkerError(step.step_id, "gloo: Connection closed by peer")

    service, inbox, _ = _service(Group)

    async def scenario():
        inbox.queue.put_nowait(encode_core(AddRequest("a", [5, 6, 7], SamplingParams(max_tokens=4))))
        receiver = asyncio.get_running_loop().create_task(service.receive())
        try:
            await service.run()
        except WorkerDied as exc:
            return str(exc), time.monotonic() - service.process.failed_at
        finally:
            receiver.cancel()
        raise AssertionError("the loop went on after rank 0 failed")

    return asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_tensor_parallel_step_that_failed_because_a_rank_died_names_that_rank():
    """Rank 0's collective fails as soon as another rank dies, often before the engine sees that rank's exit (CI
    saw it: the error named only rank 0's broken collective). The engine waits up to RANK_EXIT_GRACE_S for a rank's
    exit and names it, the cause; where none exits it fails with rank 0's error after that wait."""
    from dispatcher.engine.service import RANK_EXIT_GRACE_S

    message, waited_s = _failing_group_run(0.05)
    assert "rank 1 (pid 101) killed by signal SIGKILL" in message and "Connection closed by peer" in message
    assert waited_s < RANK_EXIT_GRACE_S
    message, waited_s = _failing_group_run(None)
    assert "rank 1" not in message and "failed on rank 0" in message and "Connection closed by peer" in message
    assert RANK_EXIT_GRACE_S <= waited_s < RANK_EXIT_GRACE_S + 1.0


def test_a_scheduler_output_goes_to_the_front_ends_as_a_delta():
    """The engine sends the scheduler's outputs as they are: a ``RequestOutput`` has a ``Delta``'s fields in its
    order, and every field (the finish reason as its string) reaches the front end as the Delta it decodes."""
    from dispatcher.engine.protocol import Delta
    from scheduler.request import FinishReason
    from scheduler.scheduler import RequestOutput

    assert RequestOutput.__struct_fields__ == Delta.__struct_fields__
    out = RequestOutput("r", [5, 6], FinishReason.STOP, [{5: -0.5, 9: -1.0}, {6: -0.25}], 16,
                        [None, {7: -2.0}], [None, 3], 0.125, 0.5)
    assert out.finished and not RequestOutput("q", [1]).finished
    (delta,) = decode_to_front(encode_core(Outputs([out]))).deltas
    assert delta == Delta("r", [5, 6], "stop", [{5: -0.5, 9: -1.0}, {6: -0.25}], 16, [None, {7: -2.0}], [None, 3],
                          0.125, 0.5)
