"""The front end's handle on the engine process (``dispatcher.engine.service``): what the HTTP app calls.

``generate`` sends a request once and returns its stream of ``RequestOutput``s; ``abort`` ends it. One task
receives the engine's per-step ``Outputs``: it turns token ids into text (``OutputProcessor``: detokenization and
stop strings, here in the front end's process, so that the engine never waits on streaming), feeds each request's
queue and records the step in the metrics. A stop string that matches sends ``Abort(finish_reason='stop')`` so
that the engine frees the request's KV blocks at once. The engine process's death (or its ``EngineDead``, when its
worker died) fails every request in flight and sets ``dead``, which /health reports.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import AsyncIterator

import zmq
import zmq.asyncio

from dispatcher.child import parent_gone
from dispatcher.engine.ipc import ChildProcess, bind_pair, spawn_engine
from dispatcher.engine.output import CompletionOutput, OutputProcessor, RequestOutput
from dispatcher.engine.protocol import (Abort, AddRequest, Delta, Drain, EngineDead,
                                        EngineInit, EngineStarted, Outputs, decode_to_front, encode,
                                        front_end_sockets, pack_prompt)
from dispatcher.messages import CaptureProgress, WorkerReady, decode_or_refuse
from scheduler.block_hash import prompt_block_hashes
from scheduler.request import FinishReason, RequestError, SamplingParams
from scheduler.scheduler import RequestOutput as StepOutput

log = logging.getLogger("twogrid.serve")

LIVENESS_S = 0.25
"""How often the front end checks that the engine process is alive while no output comes."""
MAX_QUEUED_STEPS = 64
"""At most this many of the engine's messages that queued up are taken at once, before the streams run: a front end
behind the engine then writes each request one chunk for all those steps (and decodes its text once), where taking
them one by one wrote a chunk a step and fell further behind (1024 single-token streams on the H200)."""
BEHIND_WINDOW_S = 30.0
BEHIND_SHARE = 0.25
"""A front end that read more than this share of the engine's steps (those with outputs) merged with the steps
before them, over a window of BEHIND_WINDOW_S, says so in a warning: it, not the engine, sets the streams' pace."""


def log_capture_done(progress: CaptureProgress, cuda_graphs: bool = True) -> None:
    """The log line that ends delayed capture (of CUDA graphs, else of the static-buffer backend's sizes)."""
    noun = "graphs" if cuda_graphs else "static-buffer sizes"
    if progress.error:
        log.error("delayed capture stopped after %d of %d %s (%.1f s): %s; the others' steps run eagerly",
                  progress.num_captured, progress.num_total, noun, progress.seconds, progress.error)
    else:
        log.info("delayed capture done: %d %s captured between steps in %.1f s (%s)", progress.num_total, noun,
                 progress.seconds, ", ".join(f"{g.runner} {g.kind} {g.total}" for g in progress.graphs))


class EngineError(RuntimeError):
    """The engine could not finish a request (its step failed, or the engine or its worker died)."""


class EngineClient:
    """Built at once (``ready`` False, so that /health answers 503 while the engine starts); ``start`` starts the
    engine process and waits until its worker has captured."""

    def __init__(self, init: EngineInit, tokenizer, served_model_name: str, default_params: SamplingParams,
                 metrics=None, log_level: str = "info", front_end: int = 0, stream_interval: int = 1):
        self.init = init
        self.front_end = front_end
        """This front-end process's index (``--api-server-count``): 0 starts the engine, the others ``attach``."""
        self.stream_interval = stream_interval
        """``--stream-interval``: after a request's first output, its next goes out once this many new tokens are
        waiting (or it ended): fewer, larger chunks a request at high concurrency (vLLM's flag)."""
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = init.worker.max_model_len
        self.default_params = default_params
        self.metrics = metrics
        self.log_level = log_level
        self.processor = OutputProcessor(tokenizer, self._stopped)
        self.process: ChildProcess | None = None
        self.capture: WorkerReady | None = None
        self._ready = False
        self.gate: str | None = None
        """With several front ends: a file that exists once every one of them serves (none is ready before)."""
        self.dead: str | None = None
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._task: asyncio.Task | None = None
        self._behind = _Behind(front_end, init.num_front_ends, time.monotonic())
        self.prefix_block_size = 0
        self.next_token_key = False
        """The prefix cache's blocks (``EngineStarted``): this front end hashes each prompt's for the engine."""

    async def start(self, process: ChildProcess | None = None) -> WorkerReady:
        """Send the engine process (``process``, from ``spawn_engine``; by default started now) its init and wait
        for its worker (load, KV cache, capture). EngineError if it cannot."""
        self.process = process or spawn_engine(self.log_level, self.init.worker.tensor_parallel_size)
        self._send(self.init)
        while True:
            if await self.process.from_child.poll(LIVENESS_S * 1000):
                msg = decode_to_front(await self.process.from_child.recv())
                if isinstance(msg, EngineStarted):
                    break
                if isinstance(msg, EngineDead):
                    self.dead = msg.message
                    raise EngineError(msg.message)
            elif not self.process.alive():
                self.dead = f"the engine process {self.process.exit_description()} while starting"
                raise EngineError(self.dead)
        self._started(msg)
        if self.metrics is not None:
            self.metrics.set_capture(sum(k["seconds"] for k in self.capture.capture),
                                     int(sum(k["measured_gib"] for k in self.capture.capture) * 2**30))
            self.metrics.set_startup(self.capture.startup)
            self._graph_counts(self.capture.capture_progress)
            blocks = self.capture.num_kv_blocks
            self.metrics.set_queue(0, 0, blocks, blocks)  # an empty cache, until the engine reports its queue
            self.metrics.set_spec_tiers(msg.tiers)
        self._task = asyncio.get_running_loop().create_task(self._receive())
        self.ready = True
        return self.capture

    @property
    def ready(self) -> bool:
        """The engine has captured (and, with a ``gate``, every front end serves)."""
        if self._ready and self.gate is not None and os.path.exists(self.gate):
            self.gate = None
        return self._ready and self.gate is None

    @ready.setter
    def ready(self, value: bool) -> None:
        self._ready = value

    def _started(self, msg: EngineStarted) -> None:
        self.capture = msg.worker
        self.prefix_block_size, self.next_token_key = msg.prefix_block_size, msg.next_token_key

    def attach(self, ipc_dir: str, engine_pid: int) -> None:
        """Serve through the engine that front end 0 starts (its ipc directory): bind this front end's sockets, to
        which the engine connects; ready when the engine says it started (``EngineStarted`` goes to every front
        end)."""
        self.process = _AttachedEngine(ipc_dir, self.front_end, engine_pid)
        self._task = asyncio.get_running_loop().create_task(self._receive())

    def _send(self, message) -> None:
        """Queue a message for the engine, in order (an asyncio socket without a high-water mark: it leaves as soon
        as the engine is connected, and nothing here waits for it)."""
        self.process.to_child.send(encode(message))

    # -- requests --------------------------------------------------------------------------------------------
    def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival: float | None = None) -> AsyncIterator[RequestOutput]:
        """Send a request and stream its outputs. The engine checks it before it costs device time: a refusal
        (RequestError, naming the field and the limit) is raised by the stream. ``arrival``: when it reached the
        front end (``time.perf_counter``), for the metrics' front-end part of its TTFT, which ends at the send
        (stamped before it: the engine's queue time starts at its receipt, which can come before the caller runs
        again on a loaded host, and the two parts must not overlap)."""
        if self.dead is not None:
            raise EngineError(f"the engine cannot serve: {self.dead}")
        if self._stopping:
            raise EngineError("the server is shutting down")
        if not self.ready:
            raise EngineError("the engine is still starting (loading the model, capturing graphs)")
        packed = pack_prompt(prompt_token_ids)
        hashes = b""
        if self.prefix_block_size and isinstance(packed, bytes):  # (a list: ids the engine refuses)
            hashes = prompt_block_hashes(packed, self.prefix_block_size, self.next_token_key)
        self.processor.add_request(request_id, prompt, prompt_token_ids, params)
        stream = self._streams[request_id] = _Stream(self.stream_interval)
        if arrival is not None and self.metrics is not None:
            self.metrics.on_sent_to_engine(time.perf_counter() - arrival)
        try:
            self._send(AddRequest(request_id, packed, params, self.front_end, hashes))
        except BaseException:  # (a message that cannot be encoded: nothing left registered for a later Abort)
            self._streams.pop(request_id, None)
            self.processor.abort(request_id)
            raise
        return self._stream(request_id, stream)

    async def _stream(self, request_id: str, stream: "_Stream") -> AsyncIterator[RequestOutput]:
        """The request's outputs. Whatever arrived while its consumer was busy becomes one output, detokenized
        here, once: a loaded server writes fewer, larger chunks (and decodes fewer times) instead of falling
        further behind."""
        try:
            while True:
                await stream.ready.wait()
                items = stream.take()
                out, error = self._collect(request_id, items)
                if out is not None:
                    yield out
                    if out.finished:
                        self._streams.pop(request_id, None)
                        return
                if error is not None:
                    raise error
        finally:  # the consumer stopped early (a client gone): the request ends here
            if request_id in self._streams:
                await self.abort(request_id)
            else:  # (ended, or failed with deltas this consumer never took: nothing is left behind)
                self._abort_choices(request_id)
                self.processor.abort(request_id)

    def _collect(self, request_id: str, items: list) -> tuple[RequestOutput | None, Exception | None]:
        """The engine's deltas that queued up, as one output (through the output processor: text, stop strings);
        then the error that ended the request, if one did."""
        deltas = []
        for item in items:
            if isinstance(item, RequestOutput):  # the final output of an abort
                return item, None
            if isinstance(item, Exception):  # (``_fail`` left the request to be dropped here, after its deltas)
                out = self._merge(request_id, deltas)
                self.processor.abort(request_id)
                return out, item
            deltas.append(item)
        return self._merge(request_id, deltas), None

    def _merge(self, request_id: str, deltas: list) -> RequestOutput | None:
        """Deltas that queued up as one output of the request (each choice's merged, for n > 1)."""
        if not deltas:
            return None
        if deltas[0].request_id == request_id:  # n = 1: every delta is the request's own
            outs = self.processor.process([_step_output(request_id, deltas)])
        else:
            by_choice: dict[str, list] = {}
            for d in deltas:
                by_choice.setdefault(d.request_id, []).append(d)
            outs = self.processor.process([_step_output(rid, ds) for rid, ds in by_choice.items()])
        return outs[0] if outs else None

    async def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        self._abort_choices(request_id)
        final = self.processor.abort(request_id)
        if final is not None and stream is not None:  # (it was still running)
            stream.put(final)

    def _abort_choices(self, request_id: str) -> None:
        """Abort in the engine whatever of the request still runs there (its choices, for n > 1)."""
        ids = self.processor.engine_ids(request_id)
        if ids and self.dead is None and self.process is not None:
            self._send(Abort(ids))

    def _stopped(self, request_id: str, reason: FinishReason) -> None:
        """A stop string matched (the output processor's call): the engine ends the request now."""
        self._send(Abort([request_id], reason.value))

    def _fail(self, request_ids, error: Exception, tell_engine: bool = True) -> None:
        """End requests with ``error``. Deltas that reached a stream before the error still go to its client
        first (a request that finished just before its engine died gets its output): the consumer merges them,
        then drops the request from the output processor."""
        for rid in dict.fromkeys(self.processor.parent_of(r) or r for r in request_ids):
            stream = self._streams.pop(rid, None)
            if stream is None or not stream.items:
                if tell_engine:
                    self._abort_choices(rid)  # (the other choices of a request with n > 1)
                self.processor.abort(rid)
            if stream is not None:
                stream.put(error)

    # -- the engine's outputs ----------------------------------------------------------------------------------
    async def _receive(self) -> None:
        sock = self.process.from_child
        try:
            while True:
                if not await sock.poll(LIVENESS_S * 1000):
                    if not self.process.alive():
                        raise EngineError(f"the engine process {self.process.exit_description()}")
                    continue
                with_deltas = 0
                for raw in await _queued(sock, MAX_QUEUED_STEPS):
                    msg = decode_or_refuse(decode_to_front, raw, log, "the front end's socket")
                    if isinstance(msg, EngineDead):
                        raise EngineError(msg.message)
                    if isinstance(msg, Outputs):
                        self._take(msg)
                        with_deltas += bool(msg.deltas)
                    elif isinstance(msg, EngineStarted):  # (front ends 1..: front end 0 waits for it in start)
                        self._started(msg)
                        self.ready = True
                if with_deltas > 1 and self.metrics is not None:  # (steps whose deltas go out merged)
                    self.metrics.on_backlog(with_deltas - 1)
                warning = self._behind.add(with_deltas, time.monotonic())
                if warning is not None:
                    log.warning(warning)
        except EngineError as exc:
            self.dead = str(exc)
            log.error("the engine stopped: %s", exc)
        except Exception as exc:  # a defect: fail everything rather than hang every client
            self.dead = f"{type(exc).__name__}: {exc}"
            log.exception("the front end's output task failed")
        self._fail(list(self._streams), EngineError(self.dead))

    def _take(self, msg: Outputs) -> None:
        for r in msg.refused:
            self._fail([r.request_id], RequestError(r.message))
        for f in msg.failed:
            self._fail(f.request_ids, EngineError(f.message))
        streams = self._streams
        for d in msg.deltas:  # (per delta only a list append: the text is made when the consumer takes them)
            stream = streams.get(d.request_id)
            if stream is None:  # a choice of a request with n > 1
                stream = streams.get(self.processor.parent_of(d.request_id))
            if stream is not None:
                stream.put(d)
            if d.queue_s is not None and self.metrics is not None:
                self.metrics.on_engine_times(d.queue_s, d.prefill_s)
        for s in msg.steps:
            if self.metrics is not None:
                self.metrics.on_step(s.kind, s.mode, s.eager_cause, s.padded_tokens, s.accepted_tokens,
                                     s.num_preempted, s.device_s, s.num_drafts, s.draft_tokens, s.accepted_per_pos,
                                     s.prefix_cache_queries, s.prefix_cache_hits, s.fused)
                if s.tiers is not None:
                    self.metrics.set_spec_tiers(s.tiers)
        if msg.queue is not None and self.metrics is not None:
            q = msg.queue
            self.metrics.set_queue(q.num_running, q.num_waiting, q.num_free_blocks, q.num_blocks)
        if msg.capture is not None:
            self._graph_counts(msg.capture)
            if msg.capture.done:
                log_capture_done(msg.capture, self.capture is None or self.capture.cuda_graphs)

    def _graph_counts(self, progress: CaptureProgress | None) -> None:
        """The graphs-captured gauges: from delayed capture's ``progress``, or (None) from the capture at start-up."""
        if self.metrics is None:
            return
        if progress is not None:
            self.metrics.set_graph_counts([(g.runner, g.kind, g.captured, g.total) for g in progress.graphs],
                                          progress.seconds)
            return
        counts: dict[tuple[str, str], int] = {}
        for k in self.capture.capture:
            counts[(k["runner"], k["kind"])] = counts.get((k["runner"], k["kind"]), 0) + k["graphs"]
        self.metrics.set_graph_counts([(r, k, n, n) for (r, k), n in counts.items()])

    # -- shutdown ----------------------------------------------------------------------------------------------
    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests; the engine finishes those in flight for up to ``timeout_s`` (their outputs keep
        coming), then the rest fail with an error and the engine process (and its worker) are stopped."""
        self._stopping = True
        if self.process is None:
            return
        if self._ready and self.dead is None and self.front_end == 0:  # (front end 0 ends the engine, last)
            self._send(Drain())
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while self.process.alive() and self._streams and loop.time() < deadline:
                await asyncio.sleep(0.05)
        left = list(self._streams)
        running = [e for rid in left for e in self.processor.engine_ids(rid)]
        if running and self.dead is None:
            self._send(Abort(running))  # the engine ends them too, and exits once nothing is left
        self._fail(left, EngineError(f"the server shut down before the request finished ({timeout_s:.0f} s)"),
                   tell_engine=False)
        if self._task is not None:
            self._task.cancel()
        await self.process.aclose_with(None, 5.0)  # (the engine exits by itself once drained)


def _step_output(engine_id: str, deltas: list) -> StepOutput:
    """One choice's deltas as one scheduler output."""
    last = deltas[-1]
    tokens = [t for d in deltas for t in d.new_token_ids] if len(deltas) > 1 else last.new_token_ids
    logprobs = None if last.logprobs is None else [lp for d in deltas for lp in d.logprobs or ()]
    reason = FinishReason(last.finish_reason) if last.finish_reason else None
    first = deltas[0]
    cached = next((d.num_cached_tokens for d in deltas if d.num_cached_tokens is not None), None)
    return StepOutput(engine_id, tokens, reason, logprobs, cached, first.prompt_logprobs, first.prompt_logprob_ranks)


async def _queued(sock, limit: int) -> list[bytes]:
    """The messages waiting on ``sock``: at least one (waited for), at most ``limit``, the rest taken without
    yielding to the event loop, so that every delta they hold is in its stream before the streams run. The rest
    are taken only where ``zmq.EVENTS`` says one is there, by the plain socket's ``recv``: zmq.asyncio's
    non-blocking receive of nothing raised ``zmq.Again`` through a future, a reference cycle (~27 objects) every
    step, which made the front ends' young collections (~50,000 objects, 20-46 ms) pause them every few seconds."""
    messages = [await sock.recv()]
    while len(messages) < limit and sock.get(zmq.EVENTS) & zmq.POLLIN:
        messages.append(zmq.Socket.recv(sock, zmq.NOBLOCK))
    return messages


class _AttachedEngine:
    """A front end's link to an engine it did not start (front ends 1.. of ``--api-server-count``): its own pair
    of sockets in front end 0's ipc directory. The engine counts as alive while its process and front end 0 (this
    process's parent, which runs it) are."""

    def __init__(self, ipc_dir: str, index: int, engine_pid: int):
        self.engine_pid = engine_pid
        self.ctx = zmq.asyncio.Context()
        self.to_child, self.from_child = bind_pair(self.ctx, ipc_dir, *front_end_sockets(index))

    def alive(self) -> bool:
        return not parent_gone() and os.path.exists(f"/proc/{self.engine_pid}")

    def exit_description(self) -> str:
        return "is gone (or front end 0, which ran it, is)"

    async def aclose_with(self, goodbye: bytes | None, timeout_s: float) -> None:
        self.to_child.close(linger=1000)  # (an Abort for what was left still leaves)
        self.from_child.close(linger=0)
        self.ctx.term()


class _Behind:
    """Whether this front end keeps up with the engine: the steps with outputs it read, and those that reached it
    while it was still streaming the ones before (read together, their tokens go out merged, later), over windows
    of BEHIND_WINDOW_S; ``add`` gives the warning for a window whose merged share exceeds BEHIND_SHARE."""

    __slots__ = ("front_end", "num_front_ends", "steps", "merged", "since")

    def __init__(self, front_end: int, num_front_ends: int, now: float):
        self.front_end, self.num_front_ends = front_end, num_front_ends
        self.steps, self.merged, self.since = 0, 0, now

    def add(self, num_steps: int, now: float) -> str | None:
        """``num_steps`` steps with outputs were read at once (more than one: all but the first merged)."""
        self.steps += num_steps
        self.merged += max(0, num_steps - 1)
        if now - self.since < BEHIND_WINDOW_S:
            return None
        steps, merged, window = self.steps, self.merged, now - self.since
        self.steps, self.merged, self.since = 0, 0, now
        if not steps or merged <= BEHIND_SHARE * steps:
            return None
        return (f"front end {self.front_end} is behind the engine: {merged} of the {steps} engine steps of the last "
                f"{window:.0f} s reached it while it was still streaming the ones before (their tokens went out "
                f"merged, later); the front ends set the pace here: more of them would keep up (--api-server-count, "
                f"now {self.num_front_ends}), and --stream-interval sends fewer chunks")


class _Stream:
    """A request's undelivered items (the engine's deltas, an abort's final output, an error) and the event that
    wakes its consumer: at once for the request's first tokens, its end, an abort or an error; else once
    ``interval`` new tokens are waiting (``--stream-interval``)."""

    __slots__ = ("items", "ready", "interval", "waiting_tokens", "delivered")

    def __init__(self, interval: int = 1):
        self.items: list = []
        self.ready = asyncio.Event()
        self.interval = interval
        self.waiting_tokens = 0
        self.delivered = False
        """Some tokens went out already (the first output is never held back: time to first token)."""

    def put(self, item) -> None:
        self.items.append(item)
        if self.interval > 1 and self.delivered and isinstance(item, Delta) and item.finish_reason is None:
            self.waiting_tokens += len(item.new_token_ids)
            if self.waiting_tokens < self.interval:
                return
        self.ready.set()

    def take(self) -> list:
        """What waits, for the consumer (which the event woke)."""
        items, self.items = self.items, []
        self.ready.clear()
        self.waiting_tokens = 0
        self.delivered = self.delivered or any(isinstance(i, Delta) and i.new_token_ids for i in items)
        return items


__all__ = ["EngineClient", "EngineError", "CompletionOutput", "RequestOutput", "RequestError"]
