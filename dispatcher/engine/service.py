"""The engine process: ``python -m dispatcher.engine.service [NUM_RANKS] IPC_DIR``, started by ``twogrid serve``'s
front end as its first act: it starts its worker's NUM_RANKS processes at once, before it imports torch and
before the front end's settings (``EngineInit``) arrive, so that the worker's imports (torch, Triton) overlap the
front end's start-up (its tokenizer, its plan).

It owns EngineCore's scheduler and dispatcher and drives them from an asyncio loop (uvloop where installed); its
child, the worker process, owns the model, the KV cache and the graphs. One task runs the steps: it submits step
t + 1 before it awaits step t's result (where the method allows), and per step it sends the front end one
``Outputs`` (every request's new token ids, the step's record, the queue after it). Another task takes the front
end's requests and aborts as they come. With several front-end processes (``--api-server-count``) each request's
outputs go back to the one that sent it, and the step records and queue to the first (its metrics are the
server's). Detokenization, stop strings and HTTP are the front end's, in its own
process, so that streaming to thousands of clients never holds up a step.

A failed step fails the requests in it, the engine goes on; a dead worker ends the engine: ``EngineDead`` to the
front end, exit code 1, noticed at once (through a pidfd) whether a step was running or not. A killed front end
leaves its engine orphaned: within a second it stops its worker, removes the ipc directory and exits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from dispatcher.child import ignore_stop_signals, parent_gone, profiled, start_serving
from dispatcher.engine.ipc import (WorkerDied, WorkerGroup, WorkerInfo, WorkerProcess, check_ranks_ready,
                                  spawn_workers, worker_processes)
from dispatcher.engine.protocol import (TO_CORE, Abort, AddRequest, Drain, EngineDead, EngineInit,
                                        EngineStarted, Failure, Outputs, QueueState, Refusal, StepRecord,
                                        decode_to_core, encode, front_end_sockets)
from dispatcher.messages import (CaptureProgress, StepResult, WorkerError, WorkerReady, decode_or_refuse,
                                 decode_to_engine, resolve_init)
from dispatcher.messages import encode as encode_step
from scheduler.request import FinishReason, RequestError

if TYPE_CHECKING:
    from dispatcher.engine.engine_core import EngineCore, ScheduledStep
    from scheduler.scheduler import RequestOutput

log = logging.getLogger("twogrid.engine")

LIVENESS_S = 0.25
"""How often the engine checks that the worker process is alive while it waits for it (a dead worker is noticed
within this)."""
RANK_EXIT_GRACE_S = 0.5
"""How long a tensor-parallel step that failed on rank 0 waits to see whether another rank died (and caused it)."""
ARRIVAL_TURN_S = 0.002
"""The front ends' messages are taken for at most about this long before the step task gets a turn (``receive``):
a step's own host work at 1,024 streams is ~1.5-2 ms, so a burst of arrivals delays a step by about as much."""


class EngineService:
    """The scheduler's side of ``twogrid serve``: requests from ``inbox``, per step one ``Outputs`` to each front
    end in ``outboxes`` that has requests in it (and always to the first, with the step's record)."""

    def __init__(self, init: EngineInit, process: WorkerProcess, inbox, outboxes: list):
        self.init, self.process, self.inbox, self.outboxes = init, process, inbox, outboxes
        self.outbox = outboxes[0]
        self._front_end: dict[str, int] = {}
        """Each running request's front end (only with several)."""
        self.core: EngineCore | None = None
        self._wake = asyncio.Event()
        self._draining = False
        self._in_flight: deque[ScheduledStep] = deque()
        self._tier_version = 0
        """The engine's ``tier_version`` the front end last heard of."""
        self._cuda_graphs = True
        """The worker replays CUDA graphs (else the static-buffer backend)."""
        self.capturing = False
        """Delayed capture under way in the worker: its progress may come while no step runs."""
        self.loop_watch = None
        """The event loop's watch (``dispatcher.child.LoopWatch``) once serving; stopped when serving ends."""
        self._compiling: dict[str, asyncio.Task] = {}
        """Structured requests whose grammar compiles, by each of their engine request ids (they join the scheduler
        when it is ready)."""
        self._times: dict[str, list] = {}
        """Requests before their first token, by their first engine request id: [arrival here, first scheduled or
        None] (``time.perf_counter``): their first delta carries the queue and prefill times (vLLM's
        ``request_queue_time_seconds`` and ``request_prefill_time_seconds``)."""

    async def start(self) -> WorkerReady:
        """Wait for the worker (load, KV cache, capture), then build the scheduler. WorkerDied if it cannot. The
        engine's own heavy imports (torch, through the engine core) run while the worker starts (``serve`` started
        them), not before."""
        loop = asyncio.get_running_loop()
        await self.process.to_worker.send(encode_step(self.process.init))
        from dispatcher.engine.engine_core import EngineArgs, EngineCore

        w = self.init.worker
        args = EngineArgs(w.model, device=w.device, num_kv_blocks=1, block_size=w.block_size,
                          max_model_len=w.max_model_len, seed=w.seed, step_trace=self.init.step_trace,
                          fixed_acceptance=w.fixed_acceptance, eos_token_ids=tuple(self.init.eos_token_ids),
                          tokenizer=self.init.tokenizer,
                          structured_compile_timeout_s=self.init.structured_compile_timeout_s,
                          enable_prefix_caching=self.init.enable_prefix_caching,
                          admission_wait_steps=self.init.admission_wait_steps,
                          quantization=w.quantization, kv_cache_dtype=w.kv_cache_dtype)
        structured = loop.run_in_executor(None, self._structured_outputs, args)  # (while the worker loads)
        try:
            ready = await _await_ready(self.process)
        except BaseException:
            structured.add_done_callback(lambda f: f.cancelled() or f.exception())  # (its error is not the story)
            raise
        self._cuda_graphs = ready.cuda_graphs
        args = dataclasses.replace(args, num_kv_blocks=ready.num_kv_blocks)
        self.core = EngineCore(resolve_init(w, ready.grid_cost), args, worker=WorkerInfo(ready),
                               structured=await structured)
        self.capturing = ready.capture_progress is not None and not ready.capture_progress.done
        self.loop_watch = start_serving(log)
        self._tier_version = self.core.tier_version
        self.core.structured.start_compilers()  # (seconds of CPU in the background, once the worker is ready)
        sched = self.core.scheduler.config
        await _tell_all(self.outboxes, EngineStarted(ready, self.core.async_scheduling,
                                                     [list(t) for t in self.core.tiers],
                                                     sched.block_size if sched.enable_prefix_caching else 0,
                                                     sched.next_token_key))
        return ready

    def _structured_outputs(self, args):
        """The engine's structured outputs, built while the worker loads (none of it waits for the worker): the
        tokenizer, and where the server has one, xgrammar imported and its vocabulary table built (a second or
        two)."""
        from dispatcher.engine.engine_core import structured_outputs
        from models.loader import read_model_config

        w = self.init.worker
        structured = structured_outputs(resolve_init(w), args, read_model_config(w.model, w.quantization).vocab_size)
        if w.structured_outputs and structured.tokenizer is not None and _import_xgrammar():
            structured.start()
        return structured

    # -- the front end's messages --------------------------------------------------------------------------------
    async def receive(self) -> None:
        """Take requests and aborts as they come (a frame that is not one is logged and dropped), in turns of at
        most ARRIVAL_TURN_S: a socket's receive of a frame that waits already does not yield, so a burst of arrivals
        (a few hundred chat turns at once, ~0.1-0.2 ms each to check, hash and queue) held the event loop for all
        of them (40 ms on the H100's host, ``LoopWatch``), and the device idled with every running request
        meanwhile; between turns the step task schedules and sends."""
        turn_started = time.perf_counter()
        while True:
            msg = decode_or_refuse(decode_to_core, await self.inbox.recv(), log, "the engine's request socket")
            if isinstance(msg, AddRequest):
                await self._add(msg)
            elif isinstance(msg, Abort):
                await self._abort(msg)
            elif isinstance(msg, Drain):
                self._draining = True
                self._wake.set()
            if not self._draining and time.perf_counter() - turn_started >= ARRIVAL_TURN_S:
                await asyncio.sleep(0)  # (none once draining: what came after the Drain is refused in this pass)
                turn_started = time.perf_counter()

    async def _add(self, msg: AddRequest) -> None:
        arrival = time.perf_counter()
        if not 0 <= msg.front_end < len(self.outboxes):
            log.warning("request %s names front end %d of %d: dropped", msg.request_id, msg.front_end,
                        len(self.outboxes))
            return
        try:
            if self._draining:
                raise RequestError("the server is shutting down")
            requests = self.core.make_requests(msg.prompt_token_ids, msg.params, msg.request_id, msg.block_hashes)
            if msg.params.structured_outputs is not None:  # its grammar compiles first, off the step loop
                task = asyncio.get_running_loop().create_task(self._add_compiled(msg, requests, arrival))
                for r in requests:
                    self._compiling[r.request_id] = task
                return
            self._queue(msg, requests, arrival)
        except RequestError as exc:  # checked again here, before the request costs any device time
            await self._refuse(msg, exc)

    def _queue(self, msg: AddRequest, requests: list, arrival: float, grammar=None) -> None:
        """``make_requests``' requests into the scheduler (``EngineCore.queue_all``: the first now, the other
        choices once its prompt is computed); ``arrival``: when the engine took the request."""
        self.core.queue_all(requests, grammar)
        self._times[requests[0].request_id] = [arrival, None]
        if len(self.outboxes) > 1:
            for r in requests:
                self._front_end[r.request_id] = msg.front_end
        self._wake.set()

    async def _refuse(self, msg: AddRequest, exc: RequestError) -> None:
        await self.outboxes[msg.front_end].send(encode(Outputs(refused=[Refusal(msg.request_id, str(exc))])))

    async def _add_compiled(self, msg: AddRequest, requests: list, arrival: float) -> None:
        """A structured request once its grammar has compiled (in the pool, ``StructuredOutputs.compile_async``);
        refused when it does not compile in time. Aborted meanwhile (its first choice): dropped."""
        first = requests[0].request_id
        try:
            grammar = await self.core.structured.compile_async(msg.params.structured_outputs)
            if first not in self._compiling:
                return
            if self._draining:
                raise RequestError("the server is shutting down")
            self._queue(msg, requests, arrival, grammar)
        except RequestError as exc:
            if first in self._compiling:
                await self._refuse(msg, exc)
        finally:
            for r in requests:
                self._compiling.pop(r.request_id, None)
            self._wake.set()

    async def _abort(self, msg: Abort) -> None:
        for rid in msg.request_ids:
            self._front_end.pop(rid, None)
            self._times.pop(rid, None)
            self._compiling.pop(rid, None)  # (its compile goes on for the cache; the request is dropped)
            if msg.finish_reason == FinishReason.STOP.value:
                self.core.finish_request(rid, FinishReason.STOP)
            else:
                self.core.abort(rid)
        if not self._in_flight:  # no step will report the freed blocks soon: report them now
            await self.outbox.send(encode(Outputs(queue=self._queue_state())))

    # -- the step task ---------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Steps until drained (or the worker dies: WorkerDied). A step that a grammar constrains goes out like any
        other: the worker fills its bitmask (``dispatcher.runtime.grammar``). A finished step's outputs go to the
        front ends once the step scheduled after its result is sent (at once when none is), in step order
        (``_finish``)."""
        core, in_flight = self.core, self._in_flight
        depth = core.depth
        outputs = None  # the last finished step's, sent once the next step is on its way
        while not self._draining or in_flight or core.has_unfinished() or self._compiling or outputs:
            if not core.has_unfinished() and not in_flight and not outputs:
                core.trace.flush()  # (the trace whole on disk while nothing runs)
                self._wake.clear()
                await (self._idle_while_capturing() if self.capturing else self._wake.wait())
                continue
            step = core.schedule(len(in_flight)) if len(in_flight) < depth else None
            if step is not None:
                if self._times and step.out.new_requests:
                    self._scheduled(step.out.new_requests)
                step.submitted_at = time.perf_counter()
                await self.process.to_worker.send(encode_step(step.message))
                core.sent(step)
                in_flight.append(step)
            if outputs:
                await self._send_outputs(*outputs)
                outputs = None
            # Let receive() take what the front ends sent, once a step, whatever the sockets do (a socket whose
            # await resolves at once would leave requests that arrive mid-run waiting for the running ones to
            # finish), here, before the next result is taken, not between it and the step scheduled from it: at
            # 1,024 streams ~10 requests arrive a step, ~50 us each to check and queue, which the device would wait
            # for there once the host sets the pace.
            await asyncio.sleep(0)
            if in_flight and (len(in_flight) == depth or step is None):
                outputs = await self._finish(in_flight.popleft())

    def _scheduled(self, requests: list) -> None:
        """Requests a step admits: the first admission ends a request's queue time."""
        now = time.perf_counter()
        for req in requests:
            t = self._times.get(req.request_id)
            if t is not None and t[1] is None:
                t[1] = now

    async def _finish(self, step: ScheduledStep) -> tuple[list, StepRecord] | None:
        """Take a step's result: the scheduler's update; returns its outputs and record for ``_send_outputs`` (None
        for a failed step, whose failures it sends). ``run`` sends them once the step scheduled from this result
        is on its way: when the host sets the pace, building and sending every running request's delta (1,024 at
        1,024 streams) would otherwise come between a result and the next step, and the device wait for it."""
        core = self.core
        result = await self._receive(step)
        if isinstance(result, WorkerError) and isinstance(self.process, WorkerGroup):
            # (the group cannot go on: the other ranks wait in the step's collectives, and the next step would pair
            # with this one there, silently wrong. Rank 0's collective fails as soon as another rank dies, often
            # before that rank's exit is seen: a short wait names the rank that died, the cause)
            try:
                await asyncio.wait_for(self.process.wait_exit(0.01), RANK_EXIT_GRACE_S)
                cause = f"the worker process {self.process.exit_description()}; "
            except asyncio.TimeoutError:
                cause = ""
            raise WorkerDied(f"{cause}step {result.step_id} failed on rank 0 of the tensor-parallel group, whose "
                             f"ranks can no longer be kept in step: {result.message}")
        if isinstance(result, WorkerError):  # (with the requests that found its blocks in the prefix cache)
            ids = core.fail_step(step, [s.out for s in self._in_flight])
            message = f"step failed: {result.message}"
            await self._send_by_front_end(ids, lambda fe_ids: Outputs(failed=[Failure(fe_ids, message)]),
                                          Outputs(queue=self._queue_state()))
            for rid in ids:
                self._front_end.pop(rid, None)
                self._times.pop(rid, None)
            return None
        outputs = core.update(step, core.finish(step, result))
        target, spec = step.descs.target, core.scheduler.last_spec_decode
        out = step.out
        record = StepRecord(target.kind, self._mode(target.mode), step.eager_cause,
                            target.num_tokens - out.shape.num_tokens, spec.num_accepted_tokens, out.num_preempted,
                            result.device_ms / 1e3, spec.num_drafts, spec.num_draft_tokens,
                            list(spec.accepted_per_pos), self._tiers_changed(), out.prefix_cache_queries,
                            out.prefix_cache_hits, result.fused)
        return outputs, record

    async def _send_outputs(self, outputs: list, record: StepRecord) -> None:
        """A finished step's outputs, one Outputs to each front end with requests among them (the first one with
        the step's record and the queue)."""
        await self._send_grouped(self._deltas(outputs), Outputs, Outputs(steps=[record], queue=self._queue_state()))

    def _deltas(self, outputs: list[RequestOutput]) -> dict[int, list[RequestOutput]]:
        """The step's outputs, grouped by the front end each request came from (a finished request's is forgotten),
        sent as they are (a scheduler ``RequestOutput`` is laid out as a ``Delta``); a request's first one gets its
        queue and prefill times. One pass, every step, over every running request (1,024 a step at 1,024
        streams)."""
        now = time.perf_counter()
        times, front_end, groups = self._times, self._front_end, {}
        for o in outputs:
            rid = o.request_id
            if times and o.num_cached_tokens is not None:  # (a request's first output)
                t = times.pop(rid, None)
                if t is not None and t[1] is not None:
                    o.queue_s, o.prefill_s = t[1] - t[0], now - t[1]
            index = (front_end.pop(rid, 0) if o.finish_reason is not None else front_end.get(rid, 0)) \
                if front_end else 0
            group = groups.get(index)
            if group is None:
                groups[index] = [o]
            else:
                group.append(o)
        return groups

    async def _send_by_front_end(self, request_ids: list[str], per_front_end, first: Outputs) -> None:
        """``per_front_end(ids)`` to each front end with requests among ``request_ids``, merged with ``first``
        (the step's record and queue) for the first front end, which gets ``first`` alone otherwise."""
        groups: dict[int, list[str]] = {}
        for rid in request_ids:
            groups.setdefault(self._front_end.get(rid, 0), []).append(rid)
        await self._send_grouped(groups, per_front_end, first)

    async def _send_grouped(self, groups: dict[int, list], per_front_end, first: Outputs) -> None:
        """``per_front_end(items)`` to each front end of ``groups`` (front end -> its requests' items), merged with
        ``first`` for the first front end, which gets ``first`` alone otherwise."""
        for index, items in sorted(groups.items()):
            out = per_front_end(items)
            if index == 0:
                out = Outputs(out.deltas, first.steps, first.queue, out.refused, out.failed)
            await self.outboxes[index].send(encode(out))
        if 0 not in groups:
            await self.outbox.send(encode(first))

    def _mode(self, mode: str) -> str:
        """A step's graph mode for the metrics: on the static-buffer backend (the CPU: no CUDA graphs) FULL and
        PIECEWISE steps ran their closures eagerly on the padded buffers, and say so (STATIC_FULL,
        STATIC_PIECEWISE)."""
        return mode if self._cuda_graphs or mode == "NONE" else f"STATIC_{mode}"
    async def _idle_while_capturing(self) -> None:
        """Wait for work (``_wake``) while the worker captures in the background: pass its progress on as it comes
        (nothing else comes from the worker while no step runs); work ends the wait at once."""
        sock = self.process.to_engine
        wake = asyncio.ensure_future(self._wake.wait())
        while not wake.done() and self.capturing:
            poll = asyncio.ensure_future(sock.poll(LIVENESS_S * 1000))
            await asyncio.wait({wake, poll}, return_when=asyncio.FIRST_COMPLETED)
            if not poll.done():
                poll.cancel()
                break
            if not poll.result():
                if not self.process.alive():
                    wake.cancel()
                    raise WorkerDied(f"the worker process {self.process.exit_description()}")
                continue
            msg = _decode(await sock.recv())
            if isinstance(msg, CaptureProgress):
                await self._capture_progress(msg)
            elif isinstance(msg, WorkerError) and msg.step_id < 0:
                log.warning("worker: %s", msg.message)
            elif msg is not None:
                wake.cancel()
                raise WorkerDied(f"the worker sent {type(msg).__name__} while no step was running")
        await wake

    async def _capture_progress(self, progress: CaptureProgress) -> None:
        """Delayed capture's progress, to the first front end (its metrics, and its log when done)."""
        self.capturing = not progress.done
        await self.outbox.send(encode(Outputs(capture=progress)))

    def _tiers_changed(self) -> list[list[int]] | None:
        """The tiers in force when ``"auto"`` tiers changed since the last step record, else None."""
        if self.core.tier_version == self._tier_version:
            return None
        self._tier_version = self.core.tier_version
        return [list(t) for t in self.core.tiers]

    def _queue_state(self) -> QueueState:
        sched = self.core.scheduler
        return QueueState(len(sched.order), len(sched.waiting) + self.core.num_parked, sched.kv.num_free,
                          sched.kv.num_blocks)

    async def _receive(self, step: ScheduledStep) -> StepResult | WorkerError:
        sock = self.process.to_engine
        while True:
            if await sock.poll(LIVENESS_S * 1000):
                msg = _decode(await sock.recv())
                if msg is None:
                    continue
                if isinstance(msg, CaptureProgress):
                    await self._capture_progress(msg)
                    continue
                if isinstance(msg, WorkerError) and msg.step_id < 0:
                    log.warning("worker: %s", msg.message)  # a refused frame: not this step's
                    continue
                if isinstance(msg, (StepResult, WorkerError)) and msg.step_id == step.out.step_id:
                    return msg
                raise WorkerDied(f"expected the result of step {step.out.step_id}, got {type(msg).__name__}")
            if not self.process.alive():
                raise WorkerDied(f"the worker process {self.process.exit_description()}")


def _import_xgrammar() -> bool:
    """Structured outputs' library, imported while the worker starts; False (logged) where it cannot be: the
    engine serves, and refuses structured requests naming why."""
    try:
        importlib.import_module("xgrammar")
        return True
    except ImportError as exc:
        log.error("structured outputs are unavailable: xgrammar cannot be imported (%s)", exc)
        return False


async def _await_ready(process: "WorkerProcess | WorkerGroup", group: "WorkerGroup | None" = None) -> WorkerReady:
    """The worker's WorkerReady (its init sent already); a tensor-parallel group's once every rank is ready, with
    the same plan (rank 0's)."""
    if isinstance(process, WorkerGroup):
        readies = [await _await_ready(rank, process) for rank in process.ranks]
        process.ready = check_ranks_ready(readies)
        return process.ready
    while True:
        if await process.to_engine.poll(LIVENESS_S * 1000):
            msg = _decode(await process.to_engine.recv())
            if isinstance(msg, WorkerReady):
                process.ready = msg
                return msg
            if isinstance(msg, WorkerError):
                raise WorkerDied(f"the worker failed to start: {msg.message}")
        if not (group or process).alive():
            raise WorkerDied(f"the worker process {(group or process).exit_description()} while starting"
                             f"{await _rank_error(group)}")


async def _rank_error(group: "WorkerGroup | None", first: int = 0) -> str:
    """The error a tensor-parallel rank (from rank ``first`` on) sent before it exited (': message'), or ''."""
    for rank in group.ranks[first:] if group is not None else []:
        while await rank.to_engine.poll(0):
            msg = _decode(await rank.to_engine.recv())
            if isinstance(msg, WorkerError):
                return f": {msg.message}"
    return ""


def _decode(frame: bytes) -> StepResult | WorkerReady | WorkerError | None:
    return decode_or_refuse(decode_to_engine, frame, log, "the engine's socket")


async def serve(ipc_dir: str, num_ranks: int = 1) -> int:
    """The engine's life: its worker's ``num_ranks`` processes start first (their imports overlap the front end's
    start-up; 0: the worker starts once the init says how many ranks), then the front end's ``EngineInit`` (or its
    ``Drain``: its start-up failed, so the worker is stopped unused and the engine exits 0)."""
    process = spawn_workers(num_ranks, asyncio=True, parent_dir=ipc_dir) if num_ranks else None
    # The engine core's imports (torch among them) while the front end sets up; ``EngineService.start``'s import
    # of it waits for this one. (A daemon thread: an engine stopped meanwhile exits without waiting for it.)
    threading.Thread(target=importlib.import_module, args=("dispatcher.engine.engine_core",), daemon=True,
                     name="import-engine-core").start()
    ctx = zmq.asyncio.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(f"ipc://{ipc_dir}/{TO_CORE}")
    try:
        init = await _first_message(inbox, process, ipc_dir)
        if init is not None and process is not None:
            process.set_init(init.worker)
        elif init is not None:
            process = worker_processes(init.worker, asyncio=True, parent_dir=ipc_dir)
    except BaseException:
        if process is not None:
            process.kill()
        raise
    if init is None:  # (silently: the front end's error is the one line its user reads)
        if process is not None:
            process.kill()
            await process.aclose(5.0)
        inbox.close(linger=0)
        ctx.term()
        logging.shutdown()
        os._exit(0)  # (not through the interpreter's exit, which a daemon thread still importing torch can upset)
    outboxes = []
    for index in range(max(1, init.num_front_ends)):
        to_core, to_front = front_end_sockets(index)
        if index:  # (the first front end's socket is connected already)
            inbox.connect(f"ipc://{ipc_dir}/{to_core}")
        outbox = ctx.socket(zmq.PUSH)
        outbox.setsockopt(zmq.SNDHWM, 0)  # no high-water mark: outputs are never dropped or held back
        outbox.connect(f"ipc://{ipc_dir}/{to_front}")
        outboxes.append(outbox)
    service = EngineService(init, process, inbox, outboxes)
    loop = asyncio.get_running_loop()
    watchers = [loop.create_task(_worker_exit(process)), loop.create_task(_front_end_exit(process, ipc_dir))]
    code = 0
    try:
        await _first_done(service.start(), *watchers)
        receiver = loop.create_task(service.receive())
        await _first_done(service.run(), *watchers)
        receiver.cancel()
    except WorkerDied as exc:
        log.error("%s", exc)
        await _tell_all(outboxes, EngineDead(str(exc)))
        code = 1
    except Exception as exc:  # a defect: say so, rather than leave every client hanging
        if isinstance(exc, ValueError) and service.core is None:  # (refused on purpose at start-up, a setting or a
            log.error("the engine failed to start: %s", exc)  # file its message names: no trace, as the worker's)
        else:
            log.exception("the engine failed")
        await _tell_all(outboxes, EngineDead(f"{type(exc).__name__}: {exc}"))
        code = 1
    finally:
        if service.loop_watch is not None:  # (what shutting down holds the loop for is not a stall)
            service.loop_watch.stop()
        for task in watchers:
            task.cancel()
        if service.core is not None:
            service.core.close()
        await process.aclose(5.0)
        for outbox in outboxes:
            outbox.close(linger=2000)
        inbox.close(linger=0)
        ctx.term()
    return code


async def _tell_all(outboxes: list, message) -> None:
    for outbox in outboxes:
        await outbox.send(encode(message))


async def _first_done(work, *watchers):
    """``work``'s value once it ends, unless a watcher ends first (a watcher raises why the engine must stop, or
    exits the process)."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    if task not in done:
        task.cancel()
        for w in done:
            w.result()  # raises
    return task.result()


async def _worker_exit(process: WorkerProcess) -> None:
    """Raise WorkerDied as soon as the worker exits unasked (at once through a pidfd), busy or idle."""
    await process.wait_exit()
    if not process.stopping:
        why = await _rank_error(process, first=1) if isinstance(process, WorkerGroup) else ""
        raise WorkerDied(f"the worker process {process.exit_description()}{why}")
    await asyncio.Event().wait()  # stopped on purpose: nothing to report


async def _front_end_exit(process: "WorkerProcess | WorkerGroup | None", ipc_dir: str) -> None:
    """A front end killed without stopping its engine leaves it orphaned: stop the worker, remove the front end's
    ipc directory (the worker's is inside it) and exit, within a second."""
    while not parent_gone():
        await asyncio.sleep(1.0)
    log.error("the front end is gone: stopping the worker and exiting")
    if process is not None:  # (None: gone before the engine started its worker)
        process.kill()
    shutil.rmtree(ipc_dir, ignore_errors=True)
    os._exit(1)


async def _first_message(inbox, process: "WorkerProcess | WorkerGroup | None", ipc_dir: str) -> EngineInit | None:
    """The front end's EngineInit, or None for its Drain (its start-up failed). Meanwhile a front end that is gone
    (killed while starting) ends the engine and its worker as one that is gone later does (a worker that exits
    meanwhile is noticed once the init is in, as it is later)."""
    front_end = asyncio.ensure_future(_front_end_exit(process, ipc_dir))
    try:
        while True:
            msg = decode_or_refuse(decode_to_core, await _first_done(inbox.recv(), front_end), log,
                                   "the engine's request socket")
            if isinstance(msg, (EngineInit, Drain)):
                return msg if isinstance(msg, EngineInit) else None
            if msg is not None:
                log.warning("expected EngineInit first, got %s: dropped", type(msg).__name__)
    finally:
        front_end.cancel()


MAX_TEMP_DIR_CHARS = 70
"""The longest ipc directory that holds the engine's temporary files: multiprocessing's fork server listens on
DIR/pymp-XXXXXXXX/listener-XXXXXXXX, and a Unix socket's path is at most 107 characters (past it, in the system's
temporary directory, which a killed engine leaves behind)."""


def main() -> int:
    ignore_stop_signals()  # the front end stops its engine (Drain), once it has drained
    logging.basicConfig(level=os.environ.get("TWOGRID_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is a Linux/macOS dependency; asyncio's own loop elsewhere
        runner = asyncio.run
    if len(sys.argv[-1]) <= MAX_TEMP_DIR_CHARS:  # (this process's temporary files, the grammar compilers' fork
        tempfile.tempdir = sys.argv[-1]  # server's socket among them, in its ipc directory: the server removes it
        # however the engine ends, a SIGKILL included; a longer path would leave no room for that socket's name)
    return profiled("engine", runner, serve(sys.argv[-1], int(sys.argv[1]) if len(sys.argv) > 2 else 1))


if __name__ == "__main__":
    sys.exit(main())
