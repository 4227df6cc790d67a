"""What the child processes of ``twogrid serve`` (the engine process, its worker) share: how they notice that
their parent is gone, their stop signals, a profiling switch, the garbage collector kept off start-up's objects, the
event loop's long holds logged."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter


PARENT_PID_ENV = "TWOGRID_PARENT_PID"
"""The parent's process id, in each child's environment: a child whose parent is no longer that process has been
orphaned (its parent was killed) and exits."""


def parent_gone() -> bool:
    """This process's parent (the one that started it, named in $TWOGRID_PARENT_PID) has exited."""
    return os.getppid() != int(os.environ.get(PARENT_PID_ENV) or os.getppid())


def seconds_since_start() -> float | None:
    """Seconds since this process started (Linux: its start time in /proc/self/stat against the system's uptime),
    so that a start-up's first phase (the interpreter and its imports) can be told; None elsewhere."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))


def ignore_stop_signals() -> None:
    """A child's parent decides when it stops (a message, once drained): a SIGTERM sent to every process of the
    service (systemd's default KillMode) or a terminal's SIGINT must not end it under the requests being drained."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


GC_YOUNG_THRESHOLD = 50_000
"""Container objects allocated and not yet freed before the collector runs a young collection (CPython's: 700).
Above what a step leaves alive at once (the engine: an output and a delta per request, ~3,000 objects at 1,024
requests; a front end: its events' chunks), so a step's objects go by reference counting alone and none is promoted
to the older generations. With 700, the engine at 1,024 decoding requests ran four young collections a step, each
promoting the step's live objects, until a full collection (every request's token lists walked: 8 ms on the CI
machine) came every ~26 steps: 0.81 ms a step of a 3.2 ms step (``benchmarks/bench_engine_host_cpu.py``)."""


def freeze_startup_heap() -> None:
    """Collect once, then move every object that exists now (modules, the model, graphs, tokenizer) out of the
    collector's reach, as vLLM does after start-up: a full collection otherwise walks them all, and one in the
    worker stalled a step of 256 requests for ~100 ms on the H200 (same step index under every policy); and raise
    the young generation's threshold to ``GC_YOUNG_THRESHOLD``. Called by each process of ``twogrid serve`` once it
    is ready to serve."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    if _log_long_collection not in gc.callbacks:
        gc.callbacks.append(_log_long_collection)


LONG_COLLECTION_MS = 5.0
"""A garbage collection longer than this, while serving, is logged (a warning naming its generation): it paused the
process (a step, a front end's responses) as long."""

_collection_started = [0.0]


def _log_long_collection(phase: str, info: dict) -> None:
    """``gc.callbacks``' hook: a collection of LONG_COLLECTION_MS or more logged with its generation and the objects
    it collected."""
    if phase == "start":
        _collection_started[0] = time.perf_counter()
        return
    ms = (time.perf_counter() - _collection_started[0]) * 1e3
    if ms >= LONG_COLLECTION_MS:
        logging.getLogger("twogrid").warning(
            "a garbage collection of generation %d paused this process %.1f ms (%d objects collected)",
            info.get("generation", -1), ms, info.get("collected", 0))


LOOP_HELD_MS_ENV = "TWOGRID_LOOP_HELD_MS"
LOOP_HELD_MS = 20.0
"""A serving process's event loop that went this long without a turn (default; ``$TWOGRID_LOOP_HELD_MS``, 0: not
watched) is logged, with where its thread was meanwhile: every step the engine did not schedule, and every stream a
front end did not write, waited as long."""
LOOP_HELD_LOG_S = 1.0
"""At most one such line a second (the holds between two lines are counted in the next)."""


class LoopWatch:
    """Notices the running event loop's long holds: a callback every ``period_s`` stamps the loop's last turn; a
    thread samples where the loop's thread is (its innermost frames) while that stamp is older than the threshold;
    the first turn after a hold logs it with the places sampled (none where the holding call kept the GIL), at most
    a line every LOOP_HELD_LOG_S (the holds meanwhile counted in the next). A hold is measured from when the tick
    was due (so up to ``period_s`` short). ``stop``, or the loop's closing, logs the holds not yet logged and ends
    the thread."""

    MAX_SAMPLES = 200
    """Places kept per hold (a hold of seconds is sampled every few ms)."""

    def __init__(self, held_ms: float, period_s: float = 0.005, log=None):
        self.loop = asyncio.get_running_loop()
        self.held_s, self.period_s = held_ms / 1e3, period_s
        self.log = log or logging.getLogger("twogrid")
        self.thread_id = threading.get_ident()
        self.turn = time.perf_counter()
        self.samples: list[tuple[float, str]] = []
        """(the turn the loop was held after, where its thread was): the watch thread appends, the tick takes those
        of the hold it ends (a sample taken as the lists are swapped is dropped, never given to another hold)."""
        self.holds: list[tuple[float, Counter]] = []
        """Holds not yet logged: (ms, places)."""
        self.logged_at = float("-inf")
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self.loop.call_soon(self._tick)
        threading.Thread(target=self._watch, daemon=True, name="loop-watch").start()

    def stop(self) -> None:
        """End the watch; the holds not yet logged are logged now."""
        self.stopped.set()
        self._flush()

    def _tick(self) -> None:
        now = time.perf_counter()
        turn, self.turn = self.turn, now
        held = now - turn - self.period_s
        samples, self.samples = self.samples, []
        if held >= self.held_s:
            with self._lock:
                self.holds.append((held * 1e3, Counter(place for t, place in samples if t == turn)))
        if self.holds and now - self.logged_at >= LOOP_HELD_LOG_S:
            self._flush(now)
        if not self.stopped.is_set():
            self.loop.call_later(self.period_s, self._tick)

    def _flush(self, now: float | None = None) -> None:
        with self._lock:
            holds, self.holds = self.holds, []
        if not holds:
            return
        ms, places = max(holds, key=lambda h: h[0])
        where = "; ".join(f"{place} ({n})" for place, n in places.most_common(2)) or "not sampled"
        more = f" (and {len(holds) - 1} more holds since the last line)" if len(holds) > 1 else ""
        self.log.warning("the event loop was held %.0f ms%s, in: %s", ms, more, where)
        self.logged_at = time.perf_counter() if now is None else now

    def _watch(self) -> None:
        while not self.stopped.wait(max(self.period_s, self.turn + self.held_s - time.perf_counter())):
            if self.loop.is_closed():
                self._flush()
                return
            turn = self.turn
            if time.perf_counter() - turn >= self.held_s and len(self.samples) < self.MAX_SAMPLES:
                frame = sys._current_frames().get(self.thread_id)
                if frame is not None:
                    self.samples.append((turn, frame_place(frame)))


def frame_place(frame, depth: int = 4) -> str:
    """A stack's innermost ``depth`` frames, innermost first: ``func file:line < caller file:line ...``; the import
    system's own frames are left out, an import among them said first (``importing: <module> x.py:3 < ...``: the
    module being imported and the code that imported it)."""
    parts, importing = [], False
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib"):
            importing = True
        else:
            parts.append(f"{code.co_name} {os.path.basename(code.co_filename)}:{frame.f_lineno}")
        frame = frame.f_back
    return ("importing: " if importing else "") + " < ".join(parts)


def watch_event_loop(log=None) -> LoopWatch | None:
    """Start a ``LoopWatch`` on the running loop at ``$TWOGRID_LOOP_HELD_MS`` (``LOOP_HELD_MS`` unset; None at 0),
    logging to ``log`` (default: the ``twogrid`` logger). Called by each asyncio process of ``twogrid serve`` (the
    engine, the front ends) once it serves."""
    value = os.environ.get(LOOP_HELD_MS_ENV, "")
    try:
        held_ms = float(value) if value else LOOP_HELD_MS
    except ValueError:
        logging.getLogger("twogrid").warning("%s=%r is not a number of ms: the default %g used", LOOP_HELD_MS_ENV,
                                             value, LOOP_HELD_MS)
        held_ms = LOOP_HELD_MS
    return LoopWatch(held_ms, log=log) if held_ms > 0 else None


def start_serving(log=None) -> LoopWatch | None:
    """An asyncio process of ``twogrid serve`` (the engine, a front end) starts serving: its start-up heap frozen out
    of the collector (``freeze_startup_heap``; the worker, which has no event loop, calls that alone) and its event
    loop watched (``watch_event_loop``, whose watch it returns)."""
    freeze_startup_heap()
    return watch_event_loop(log)


def profiled(role: str, fn, *args):
    """``fn(*args)``, under cProfile when ``TWOGRID_PROFILE_DIR`` is set (a diagnostic: each process of the server
    writes ``<dir>/<role>.txt``, its functions by own time and by cumulative time, and ``<dir>/<role>.prof``, the
    whole profile for ``pstats``, when it exits normally)."""
    out_dir = os.environ.get("TWOGRID_PROFILE_DIR")
    if not out_dir:
        return fn(*args)
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn, *args)
    finally:
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(45)
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"{role}.txt"), "w", encoding="utf-8") as fh:
            fh.write(text.getvalue())
        prof.dump_stats(os.path.join(out_dir, f"{role}.prof"))  # (the whole profile, for pstats elsewhere)
