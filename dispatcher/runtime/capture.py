"""Delayed capture (``delayed_cudagraph_capture``): the worker serves from the moment its weights and KV cache are on
the device, and captures its graphs between steps.

The unit is one size: a runner's graph of one size (every piece of a PIECEWISE size), or a fused decode step's
graph with its n-gram lookup graphs; besides them, the eager warm-ups left out of start-up (forwards of the larger
token counts, attention's wider split merges: start-up warms the first sizes only). A unit is captured whole before
a step may replay it (its key joins the runtime's ``captured`` set last), so that no step ever replays a graph that
is half captured; each is captured once. Order: the largest graph of each kind first (``anchors``: it sizes the
shared memory pool), then the units the steps met uncaptured (``note``: demand, oldest first), then the plan's order
(the warm-ups, then per runner its kinds widest first and each kind's sizes largest first, the fused steps last;
a unit not ready yet, the structured outputs' warm-up before xgrammar's import ends, lets the later ones go first).

``run`` is called by the worker's main thread, the one that submits steps, so a capture never overlaps one: with a
step still in flight it captures for at most ``budget_s`` (the unit that crosses the budget finishes), then rests
(``REST_PER_UNIT``: no unit for three times as long, except the anchors), while idle until a step arrives
(``stop``) or nothing is left. A unit taken with a step in flight delays the next step by up to its whole length:
on a host-bound model that is several eager steps (the default model on the H200: 40-75 ms a unit, median, against
18-24 ms eager steps), on a device-bound one it overlaps the step in flight (bench-moe). A step that finds its
graph uncaptured runs without it (``ModelWorker.submit``: op by op instead of fused, or that forward eagerly) and
says so in its result; or, for the target's forward, replays a larger captured graph of its kind padded up, where
that was measured to cost less than eager (``StandIns``: on a host-bound model a graph of thousands of tokens
replays in less time than an eager step of a few launches takes).

On the CPU (no CUDA graphs) a unit's capture is only the mark, so the mechanism is the same for the static backend;
``hook`` (tests) runs inside each unit's capture, before the mark.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from dispatcher.messages import CaptureProgress, GraphCount
from dispatcher.plan.capture_plan import FULL_DECODE, FUSED_STEP
from dispatcher.runtime.decode_step import KIND as FUSED_KIND
from dispatcher.runtime.graphs import CaptureOOMError, gc_off
from dispatcher.runtime.grammar import xgrammar_imported

log = logging.getLogger("twogrid.worker")

WARM_UP = "eager_warm_up"
"""The kind of the deferred eager warm-up units (not graphs: left out of the counts)."""
GRAMMAR = "grammar"
"""The runner of the structured outputs' warm-up unit (``ModelWorker.warm_up_grammar``)."""
NOT_READY_WAIT_S = 0.002
"""An idle gap whose units left are not ready yet (``Unit.ready``) checks again after this long."""
GAP_BUDGET_S = 0.002
"""Capture time a gap between two steps may take while a step is in flight (the unit that crosses it finishes):
a later step waits for at most this plus one unit."""
REST_PER_UNIT = 3.0
"""With a step in flight, after a gap that captured a graph other than an anchor for u seconds, the gaps of the
next REST_PER_UNIT * u seconds capture nothing: at most a quarter of a loaded worker's time goes to capture, so
that most steps wait for no unit (a unit costs a host-bound model several eager steps). Idle gaps capture back to
back as before."""
REQUEST_KINDS = (FULL_DECODE, FUSED_KIND)
"""Unit kinds sized in requests (the others in tokens)."""
PROGRESS_EVERY = 0.1
"""Share of the graphs between two progress log lines."""


@dataclass
class Unit:
    runner: str
    """The runtime's runner, ``"step"`` (FUSED_STEP) for a fused decode step."""
    kind: str
    q: int | None
    size: int
    key: object
    """The GraphKey or FusedKey captured ((WARM_UP, tokens) for a warm-up)."""
    capture: Callable[[], None]
    """Captures it and marks it captured."""
    ready: Callable[[], bool] = lambda: True
    """Whether it can run now: the structured outputs' warm-up waits for xgrammar's import (``GRAMMAR``), and
    meanwhile the units after it go first."""


def _warm_up_grammar(worker) -> None:
    """The structured outputs' warm-up unit: one that fails is logged and does not end delayed capture (no graph
    depends on it; a constrained step then loads the kernel itself, or fails as it would have)."""
    try:
        worker.warm_up_grammar()
    except Exception as exc:
        log.error("structured outputs' bitmask warm-up failed (%s: %s): delayed capture goes on; a constrained step "
                  "loads the kernel itself", type(exc).__name__, exc)


@dataclass
class DeferredWarmUp:
    """A runtime's eager warm-ups that start-up left to the gaps between steps (``GraphRuntime.warm_up_eager``)."""

    forwards: list[int]
    """Token counts of whole eager forwards."""
    attention: list[tuple[int, int, bool]]
    """Eager attention launches (``eager_attention_shapes``)."""


def _units(worker, warm_ups: dict[int, DeferredWarmUp]) -> list[Unit]:
    """Every unit in the plan's order: the structured outputs' warm-up (where the worker has them), the deferred
    eager warm-ups (forwards, then attention launches), each runtime's graphs (``capture_order``), the fused steps
    (``FusedDecode.capture_order``)."""
    units: list[Unit] = []
    if worker.wcfg.structured_outputs:
        units.append(Unit(GRAMMAR, WARM_UP, None, 0, (WARM_UP, GRAMMAR), lambda: _warm_up_grammar(worker),
                          xgrammar_imported))
    for i, rt in enumerate(worker.runtimes):
        later = warm_ups.get(i, DeferredWarmUp([], []))
        for tokens in later.forwards:
            units.append(Unit(rt.runner, WARM_UP, None, tokens, (WARM_UP, tokens),
                              lambda rt=rt, tokens=tokens: rt.warm_up_eager([tokens], attention=[])))
        for shape in later.attention:
            units.append(Unit(rt.runner, WARM_UP, None, shape[0], (WARM_UP, shape),
                              lambda rt=rt, shape=shape: rt.warm_up_eager([], attention=[shape])))
    for rt in worker.runtimes:
        for key in rt.capture_order():
            units.append(Unit(rt.runner, key.kind, key.q, key.size, key,
                              lambda rt=rt, key=key: rt.capture_key(key, between_steps=True)))
    if worker.fused is not None:
        for key in worker.fused.capture_order():
            units.append(Unit(FUSED_STEP, FUSED_KIND, key.target.q, key.target.size, key,
                              lambda key=key: worker.fused.capture_key(key, between_steps=True)))
    return units


class StandIns:
    """Delayed capture's stand-ins (``BackgroundCapture.stand_ins``): a target forward whose graph is not captured
    yet replays, padded up (``dispatch.padded_up``), the smallest captured graph of its kind and q that holds it,
    where the step times measured so far say that this costs less than running it eagerly, and runs eagerly
    otherwise: the larger graph's latest replay time, or where it has none the least of the larger graphs' of its
    kind (a graph costs at most what a larger one costs; each kind's largest graph is timed once, over padding,
    right after its capture, the others as steps replay them), against a lower bound of the eager forward, the
    least time of the eager steps planned on the same kind and q with as many tokens, to a power of two, or
    fewer. Times are the steps' device times (``StepResult.device_ms``), each credited to the step's target
    graph or eager forward. On a host-bound model (the default model: eager steps 17-24 ms, a graph of 8,192
    tokens a few ms) every step soon has a stand-in; on a device-bound one only where padding costs less than
    eager launches. Until both times are known a forward runs eagerly, as without stand-ins."""

    def __init__(self, rt):
        self.rt = rt
        """The target's GraphRuntime (its ``captured`` set, its graphs)."""
        self.sizes = {(g.kind, g.q): sorted(g.sizes) for g in rt.graph_sets}
        self.replay_ms: dict[tuple, float] = {}
        """GraphKey -> the device time of its latest replay (a step's, or the anchor's timing)."""
        self.eager_ms: dict[tuple, float] = {}
        """(kind, q, tokens rounded down to a power of two) of the planned graph -> the least device time of an
        eager step there."""
        self.timing: list[tuple] = []
        """Anchors' replays queued with CUDA events, read once done (``_read_timings``)."""
        self.picked = 0
        """Stand-ins chosen so far (the log's last line says how many steps ran on one)."""
        self.observed: deque = deque()
        """Steps' times not yet taken in (``observe``; a deque's append and popleft are thread-safe)."""

    def pick(self, key, num_tokens: int) -> int:
        """The size of the captured graph that stands in for ``key`` (not captured) over ``num_tokens`` real
        tokens, or 0: run it eagerly. (The thread that submits steps: it takes in the observations first.)"""
        while self.observed:
            self._take(*self.observed.popleft())
        self._read_timings()
        captured = self.rt.captured
        larger = next((s for s in self.sizes.get((key.kind, key.q), ()) if s > key.size
                       and (key.kind, key.q, s) in captured), 0)
        if not larger:
            return 0
        replay = self.replay_ms.get((key.kind, key.q, larger))
        if replay is None:
            replay = min((ms for k, ms in self.replay_ms.items() if k[:2] == key[:2] and k[2] > larger), default=None)
        band = _band(num_tokens)
        eager = max((ms for (kind, q, b), ms in self.eager_ms.items() if (kind, q) == key[:2] and b <= band),
                    default=None)
        if replay is None or eager is None or replay >= eager:
            return 0
        self.picked += 1
        return larger

    def observe(self, planned, ran, num_tokens: int, device_ms: float) -> None:
        """A step planned on ``planned`` (a GraphKey) ran ``ran`` (its own graph or a stand-in; None: eagerly) over
        ``num_tokens`` real tokens in ``device_ms``. Called by the thread that collects results (the worker
        process's result thread), so only queued here: ``pick`` takes it in on the thread that reads the times
        (found in review: a dict growing under ``pick``'s loop raised mid-step)."""
        self.observed.append((planned, ran, num_tokens, device_ms))

    def _take(self, planned, ran, num_tokens: int, device_ms: float) -> None:
        if ran is not None:
            self.replay_ms[tuple(ran)] = device_ms
            return
        band = (planned.kind, planned.q, _band(num_tokens))
        self.eager_ms[band] = min(self.eager_ms.get(band, device_ms), device_ms)

    def time_anchor(self, key) -> None:
        """Queue one replay of a just-captured largest graph over padding between CUDA events (read later: nothing
        waits for it). On the CPU nothing (steps' times only)."""
        if not self.rt.cuda_graphs:
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        replay = self.rt.padded_replay(key)
        start.record()
        replay.replay()
        end.record()
        self.timing.append((tuple(key), start, end))

    def _read_timings(self) -> None:
        waiting = []
        for key, start, end in self.timing:
            if end.query():
                self.replay_ms.setdefault(key, start.elapsed_time(end))
            else:
                waiting.append((key, start, end))
        self.timing = waiting


def _band(num_tokens: int) -> int:
    """``num_tokens`` rounded down to a power of two (eager times are compared within and below a band)."""
    return 1 << (max(num_tokens, 1).bit_length() - 1)


class BackgroundCapture:
    """The worker's graphs still to capture (``ModelWorker.delayed``)."""

    def __init__(self, worker, warm_ups: dict[int, DeferredWarmUp] | None = None, hook=None):
        """``warm_ups``: per runtime index, the eager warm-ups left for later; ``hook(unit)``: called inside each
        unit's capture (tests: a slow or failing capture on the CPU)."""
        self.worker = worker
        self.hook = hook
        units = _units(worker, warm_ups or {})
        graphs = [u for u in units if u.kind != WARM_UP]
        self.pending: dict[tuple[str, object], Unit] = {(u.runner, u.key): u for u in units}
        largest: dict[tuple[str, str, int | None], tuple[str, object]] = {}
        for u in graphs:
            largest.setdefault((u.runner, u.kind, u.q), (u.runner, u.key))
        self.anchors = dict.fromkeys(largest.values())
        """The largest graph of each runner, kind and q (the first of its set in the plan's order): captured before
        any demand, because it sizes the shared pool that the smaller ones then reuse, as the memory estimate
        that sized the KV cache assumes (smaller graphs first would fragment the pool)."""
        self.demand: dict[tuple[str, object], None] = {}
        self.totals: dict[tuple[str, str], int] = {}
        for u in graphs:
            self.totals[(u.runner, u.kind)] = self.totals.get((u.runner, u.kind), 0) + 1
        self.captured = dict.fromkeys(self.totals, 0)
        self.captured_keys: list[tuple[str, object]] = []
        """Every unit captured, in order (tests: each exactly once)."""
        self.seconds = 0.0
        self.error = ""
        self._next_log = PROGRESS_EVERY
        self.noun = ("graphs" if any(rt.cuda_graphs for rt in worker.runtimes) else
                     f"static-buffer sizes (no CUDA graphs on {worker.runtimes[0].device.type})")
        """What it captures, for its log lines: CUDA graphs, or on the static-buffer backend its padded sizes."""
        self.unit_seconds: dict[tuple[str, str], list[float]] = {}
        """Each graph unit's capture time by (runner, kind), in seconds (the start-up log's summary)."""
        self.stand_ins = StandIns(worker.runtime)
        self.rest_until = 0.0
        """With a step in flight no unit starts before this time (``REST_PER_UNIT``)."""

    @property
    def done(self) -> bool:
        return not self.pending or bool(self.error)

    def note(self, runner: str, key) -> None:
        """A step needed this graph and found it uncaptured: capture it before the plan's order."""
        if (runner, key) in self.pending:
            self.demand[(runner, key)] = None

    def _next(self) -> tuple[tuple, Unit] | None:
        """The next unit to capture, or None where every unit left is not ready (``Unit.ready``)."""
        for key in self.anchors:
            if key in self.pending:
                return key, self.pending[key]
        while self.demand:
            key = next(iter(self.demand))
            del self.demand[key]
            if key in self.pending:
                return key, self.pending[key]
        return next(((key, unit) for key, unit in self.pending.items() if unit.ready()), None)

    @torch.inference_mode()
    def run(self, budget_s: float | None, stop: Callable[[], bool] = lambda: False) -> int:
        """Capture units until ``stop()`` (a step is waiting) or, with ``budget_s``, that many seconds are spent (at
        least one unit: the unit is never cut), or nothing is left; with ``budget_s``, nothing while resting after
        the last such gap (``REST_PER_UNIT``); where only units not ready yet (``Unit.ready``) are left, a gap with
        ``budget_s`` ends and an idle one waits for them. Returns the graphs captured. A capture that fails (out of
        memory, or refused by the device) ends delayed capture (``error``): the rest stay uncaptured and their steps
        run without them."""
        start = time.perf_counter()
        if budget_s is not None and start < self.rest_until:
            return 0
        count = attempted = 0
        paced = False
        while not self.done and not stop():
            if budget_s is not None and attempted and time.perf_counter() - start >= budget_s:
                break
            picked = self._next()
            if picked is None:  # (only units not ready are left: a gap with a budget ends; an idle one waits)
                if budget_s is not None:
                    break
                time.sleep(NOT_READY_WAIT_S)
                continue
            key, unit = picked
            attempted += 1
            unit_start = time.perf_counter()
            try:
                with gc_off():
                    if self.hook is not None:
                        self.hook(unit)
                    unit.capture()
            except Exception as exc:  # out of memory (CaptureOOMError), or a capture the device refused
                self.error = str(exc) if isinstance(exc, CaptureOOMError) else f"{type(exc).__name__}: {exc}"
                log.error("delayed capture stopped at the %s %s graph for %d %s: %s; the %d graphs left run without "
                          "graphs", unit.runner, unit.kind, unit.size, "requests" if unit.kind in REQUEST_KINDS
                          else "tokens", self.error, len(self.pending), exc_info=not isinstance(exc, CaptureOOMError))
                break
            del self.pending[key]
            if key in self.anchors and unit.runner == "target":
                try:
                    self.stand_ins.time_anchor(unit.key)
                except Exception as exc:  # (a measurement only: steps' own times take its place)
                    log.warning("could not time the %s %s graph for %d after its capture (%s: %s); stand-ins wait "
                                "for the steps' times", unit.runner, unit.kind, unit.size, type(exc).__name__, exc)
            paced = paced or key not in self.anchors
            if unit.kind != WARM_UP:
                self.unit_seconds.setdefault((unit.runner, unit.kind), []).append(time.perf_counter() - unit_start)
                self.captured[(unit.runner, unit.kind)] += 1
                self.captured_keys.append(key)
                count += 1
        if attempted:
            spent = time.perf_counter() - start
            self.seconds += spent
            if budget_s is not None and paced:
                self.rest_until = start + spent * (1 + REST_PER_UNIT)
            self._log()
        return count

    def _log(self) -> None:
        done, total = sum(self.captured.values()), sum(self.totals.values())
        if total and (done / total >= self._next_log or self.done):
            while self._next_log <= done / total:
                self._next_log += PROGRESS_EVERY
            what = ", ".join(f"{r} {k} {self.captured[(r, k)]}/{n}" for (r, k), n in self.totals.items())
            log.info("delayed capture: %d of %d %s captured (%s) in %.1f s of gaps between steps%s", done, total,
                     self.noun, what, self.seconds, "; done" if not self.pending else "")
            if not self.pending:
                log.info("delayed capture's units, ms a graph (median / max): %s; %d steps meanwhile ran on a larger "
                         "captured graph than their own (stand-ins)", ", ".join(
                             f"{r} {k} {statistics.median(s) * 1e3:.1f} / {max(s) * 1e3:.1f}"
                             for (r, k), s in self.unit_seconds.items()), self.stand_ins.picked)

    def progress(self) -> CaptureProgress:
        return CaptureProgress([GraphCount(r, k, self.captured[(r, k)], n) for (r, k), n in self.totals.items()],
                               round(self.seconds, 3), self.done, self.error)
