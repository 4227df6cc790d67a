"""What the child processes of ``twogrid serve`` (the engine process, its worker) share: how they notice that
their parent is gone, their stop signals, a profiling switch, the garbage collector kept off start-up's objects."""

from __future__ import annotations

import gc
import logging
import os
import signal
import time


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


def profiled(role: str, fn, *args):
    """``fn(*args)``, under cProfile when ``TWOGRID_PROFILE_DIR`` is set (a diagnostic: each process of the server
    writes ``<dir>/<role>.txt``, its functions by own time, when it exits normally)."""
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
