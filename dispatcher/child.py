"""What every child process of ``twogrid serve`` (the engine process, the worker) does first."""

from __future__ import annotations

import os
import signal
import sys


def set_parent_death_signal() -> None:
    """Linux: SIGKILL this process when its parent exits, so that no child outlives the server (even one that was
    SIGKILLed). Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent exited before the call took effect
        os._exit(1)


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
