"""The serving engine: EngineCore's scheduler and dispatcher driven by an asyncio loop, the worker in its own process.

One task runs the steps. It submits step t + 1 before it awaits step t's result (where the method allows), and
while it awaits, the event loop serves HTTP: new requests, streamed text, aborts. Each request's outputs reach its
stream through an asyncio queue; a stream that is closed early (a client gone) aborts its request, which frees its
KV blocks at once. A failed step fails the requests in it, the server goes on; a dead worker fails every request,
turns ``dead`` into the reason, and ends the step task. A second task watches the worker process (its pidfd): an
exit is noticed within milliseconds, idle or not, even while the step task is blocked sending to the dead worker.
Frames on the engine's socket that are not messages are refused with a warning, never decoded further.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import replace
from typing import AsyncIterator

import msgspec

from dispatcher.engine.engine_core import EngineArgs, EngineCore, ScheduledStep
from dispatcher.engine.ipc import WorkerDied, WorkerProcess
from dispatcher.engine.output import CompletionOutput, OutputProcessor, RequestOutput, merge_outputs
from dispatcher.messages import StepResult, WorkerError, WorkerReady, decode_to_engine, encode
from dispatcher.plan.config import ResolvedConfig
from models.config import ModelConfig
from scheduler.request import RequestError, SamplingParams

log = logging.getLogger("twogrid.engine")

LIVENESS_S = 0.5
"""How often the engine checks that the worker process is alive while it waits for it."""


class EngineError(RuntimeError):
    """The engine could not finish a request (its step failed, or the worker died)."""


class _RemoteWorkerInfo:
    """What EngineCore asks of its worker, from the worker process's WorkerReady (steps travel separately)."""

    def __init__(self, ready: WorkerReady):
        self.ready = ready
        self.model_config = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v
                                           for k, v in ready.model_config.items()})
        self.device_name = ready.device_name

    def measure_av_curve(self):
        return self.ready.av_curve


class AsyncEngine:
    """Built at once (``ready`` False, so the HTTP server can answer /health with 503 while the worker starts);
    ``start`` waits for the worker and starts the step task."""

    def __init__(self, cfg: ResolvedConfig, args: EngineArgs, process: WorkerProcess, tokenizer,
                 served_model_name: str, default_params: SamplingParams, metrics=None):
        self.cfg, self.args, self.process = cfg, args, process
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = args.max_model_len
        self.default_params = default_params
        self.metrics = metrics
        self.core: EngineCore | None = None
        self.processor: OutputProcessor | None = None
        self.ready = False
        self.dead: str | None = None
        self.capture: WorkerReady | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._monitor: asyncio.Task | None = None
        self._stopping = False

    async def start(self) -> WorkerReady:
        """Start the worker (load, size the KV cache, capture), then the step task. WorkerDied if it cannot."""
        self._monitor = asyncio.get_running_loop().create_task(self._watch_worker())
        try:
            ready = await _await_ready(self.process)
        except WorkerDied as exc:
            self.dead = str(exc)
            raise
        self.core = EngineCore(self.cfg, replace(self.args, num_kv_blocks=ready.num_kv_blocks),
                               worker=_RemoteWorkerInfo(ready))
        self.processor = OutputProcessor(self.tokenizer, self.core.scheduler.finish_request)
        self.capture = ready
        if self.metrics is not None:
            self.metrics.set_capture(ready.capture_seconds, int(sum(k["measured_gib"] for k in ready.capture) * 2**30))
            sched = self.core.scheduler
            self.metrics.track_queue(lambda: len(sched.order), lambda: len(sched.waiting), lambda: sched.kv.num_free,
                                     sched.kv.num_blocks)
        self._task = asyncio.get_running_loop().create_task(self._run())
        self.ready = True
        return ready

    # -- requests --------------------------------------------------------------------------------------------
    def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Queue a request (validated now: RequestError names the field and the limit) and stream its outputs."""
        if self.dead is not None:
            raise EngineError(f"the engine cannot serve: {self.dead}")
        if self._stopping:
            raise EngineError("the server is shutting down")
        if not self.ready:
            raise EngineError("the engine is still starting (loading the model, capturing graphs)")
        request = self.core.make_request(prompt_token_ids, params, request_id)
        self.processor.add_request(request_id, prompt, request.prompt_token_ids, params)
        self.core.queue(request)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        self._wake.set()
        return self._stream(request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The request's outputs; the deltas that queued up while its consumer was busy come as one (so a loaded
        server writes fewer, larger chunks instead of falling further behind)."""
        try:
            while True:
                deltas = [await queue.get()]
                while not queue.empty() and not isinstance(deltas[-1], Exception) and not deltas[-1].finished:
                    deltas.append(queue.get_nowait())
                error = deltas.pop() if isinstance(deltas[-1], Exception) else None
                if deltas:
                    item = deltas[0] if len(deltas) == 1 else merge_outputs(deltas)
                    yield item
                    if item.finished:
                        return
                if error is not None:
                    raise error
        finally:  # the consumer stopped early (a client gone): the request ends here
            if request_id in self._streams:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        queue = self._streams.pop(request_id, None)
        if self.core is not None and self.core.abort(request_id):
            final = self.processor.abort(request_id)
            if queue is not None and final is not None:
                queue.put_nowait(final)

    def _fail(self, request_ids, message: str) -> None:
        if self.core is None:  # not started: no request was taken
            return
        for rid in request_ids:
            queue = self._streams.pop(rid, None)
            self.core.abort(rid)
            self.processor.abort(rid)
            if queue is not None:
                queue.put_nowait(EngineError(message))

    # -- the step task ---------------------------------------------------------------------------------------
    async def _run(self) -> None:
        core = self.core
        depth = 2 if core.async_scheduling else 1
        in_flight: deque[ScheduledStep] = deque()
        try:
            while not self._stopping or in_flight or core.has_unfinished():
                if not core.has_unfinished() and not in_flight:
                    if self._stopping:
                        break
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                step = core.schedule(len(in_flight)) if len(in_flight) < depth else None
                if step is not None:
                    step.submitted_at = time.perf_counter()
                    await self.process.to_worker.send(encode(step.message))
                    in_flight.append(step)
                if in_flight and (len(in_flight) == depth or step is None):
                    done = in_flight.popleft()
                    result = await self._receive(done)
                    if isinstance(result, WorkerError):
                        self._fail([r.request_id for r in done.out.requests], f"step failed: {result.message}")
                        continue
                    accepted = core.scheduler.stats.drafts_accepted
                    outputs = core.update(done, core.finish(done, result))
                    self._record(done, core.scheduler.stats.drafts_accepted - accepted, result.device_ms)
                    self._publish(outputs)
                await asyncio.sleep(0)  # let the loop run the handlers woken by this step's outputs
        except WorkerDied as exc:
            self._die(str(exc))
        except Exception as exc:  # a bug: fail everything rather than hang every client
            log.exception("engine step task failed")
            self._die(f"{type(exc).__name__}: {exc}")

    async def _watch_worker(self) -> None:
        """The worker process's sentinel: its exit, unless ``shutdown`` stopped it, ends the engine."""
        await self.process.wait_exit()
        if not self.process.stopping:
            self._die(f"the worker process {self.process.exit_description()}")

    def _die(self, reason: str) -> None:
        """The engine cannot go on: ``dead`` says why, the step task stops (it may be blocked on the dead worker's
        socket), every request in flight fails with ``reason``."""
        if self.dead is None:
            self.dead = reason
            log.error("engine stopped: %s", reason)
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._fail(list(self._streams), reason)

    async def _receive(self, step: ScheduledStep) -> StepResult | WorkerError:
        sock = self.process.to_engine
        while True:
            if await sock.poll(LIVENESS_S * 1000):
                msg = _decode(await sock.recv())
                if msg is None:
                    continue
                if isinstance(msg, WorkerError) and msg.step_id < 0:
                    log.warning("worker: %s", msg.message)  # a refused frame: not this step's
                    continue
                if isinstance(msg, (StepResult, WorkerError)) and msg.step_id == step.out.step_id:
                    return msg
                raise WorkerDied(f"expected the result of step {step.out.step_id}, got {type(msg).__name__}")
            if not self.process.alive():
                raise WorkerDied(f"the worker process {self.process.exit_description()}")

    def _publish(self, step_outputs) -> None:
        for out in self.processor.process(step_outputs):
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
                if out.finished:
                    del self._streams[out.request_id]

    def _record(self, step: ScheduledStep, accepted_tokens: int, device_ms: float) -> None:
        """The step in the metrics: its kind and mode, why it ran eagerly, padding, accepted drafts, preemptions
        (the queue's gauges read the scheduler at each scrape)."""
        if self.metrics is None:
            return
        target = step.descs.target
        self.metrics.on_step(target.kind, target.mode, step.eager_cause,
                             target.num_tokens - step.out.shape.num_tokens, accepted_tokens, step.out.num_preempted,
                             device_ms / 1e3)

    # -- shutdown ----------------------------------------------------------------------------------------------
    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``timeout_s``, fail the rest, stop the worker."""
        self._stopping = True
        self._wake.set()
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except asyncio.TimeoutError:
                self._fail(list(self._streams), "the server shut down before the request finished")
                self._task.cancel()
        if self._monitor is not None:
            self._monitor.cancel()
        await self.process.aclose()


async def _await_ready(process: WorkerProcess) -> WorkerReady:
    await process.to_worker.send(encode(process.init))
    while True:
        if await process.to_engine.poll(LIVENESS_S * 1000):
            msg = _decode(await process.to_engine.recv())
            if isinstance(msg, WorkerReady):
                process.ready = msg
                return msg
            if isinstance(msg, WorkerError):
                raise WorkerDied(f"the worker failed to start: {msg.message}")
        if not process.alive():
            raise WorkerDied(f"the worker process {process.exit_description()} while starting")


def _decode(frame: bytes) -> StepResult | WorkerReady | WorkerError | None:
    """A message from the worker; None (with a warning) for a frame that is not one, which is dropped: only the
    worker and processes of this user reach the socket (its directory is private), and a dropped frame costs a
    wait, where an exception would cost every request in flight."""
    try:
        return decode_to_engine(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("refused a malformed frame of %d bytes on the engine's socket: %s", len(frame), exc)
        return None


__all__ = ["AsyncEngine", "EngineError", "CompletionOutput", "RequestOutput", "RequestError"]
