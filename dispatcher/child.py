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
