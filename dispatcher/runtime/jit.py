"""Triton compiles seen by the worker: a kernel variant met for the first time while serving is compiled on the
spot, and the step that launched it waits (~0.5 s on an H200). ``JitWatch`` counts them through Triton's compile
hooks so that each step reports its own (``StepResult.jit_compiles`` / ``jit_ms``, the step trace's
``jit_compiles``), and the worker logs the kernel and its compile-time constants, which is what a warm-up needs.
Inert where Triton (or its hooks) is missing.
"""

from __future__ import annotations

import collections
import contextlib
import time


class JitWatch:
    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self.kernels: list[str] = []
        self.history: collections.deque[str] = collections.deque(maxlen=256)
        """Triton's description of every compile (the kernel, its launch options and each argument's
        specialization), newest last: what tells two variants with the same constants apart."""
        self._t0 = time.perf_counter()
        self.available = self._install()

    def _install(self) -> bool:
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        runtime.jit_cache_hook = self._before
        runtime.jit_post_compile_hook = self._after
        return True

    def _before(self, **kwargs) -> bool:
        self._t0 = time.perf_counter()
        return False  # (True would skip the compile)

    def _after(self, fn=None, compile=None, repr=None, key=None, **kwargs) -> bool:
        self.history.append(f"{repr} key={key!r}")  # (the key tells apart variants with the same constants)
        self.count += 1
        self.seconds += time.perf_counter() - self._t0
        self.kernels.append(_describe(fn, (compile or {}).get("constants") or {}))
        return False

    @contextlib.contextmanager
    def set_aside(self):
        """Compiles inside are no step's (delayed capture's units between steps, which load their kernels then):
        the counts that ``take`` returns next are those from before and after."""
        count, seconds, kernels = self.count, self.seconds, self.kernels
        self.count, self.seconds, self.kernels = 0, 0.0, []
        try:
            yield
        finally:
            self.count, self.seconds, self.kernels = count, seconds, kernels

    def take(self) -> tuple[int, float, list[str]]:
        """Compiles since the last call: (count, seconds, kernels)."""
        out = (self.count, self.seconds, self.kernels)
        self.count, self.seconds, self.kernels = 0, 0.0, []
        return out


def _describe(fn, constants: dict) -> str:
    """``kernel(NAME=value, ...)``: the kernel's name and its compile-time constants (by parameter name)."""
    name = getattr(fn, "name", "?")
    params = getattr(getattr(fn, "jit_function", None), "params", None) or []
    consts = []
    for path, value in constants.items():
        index = path[0] if isinstance(path, tuple) and path else path
        if isinstance(index, int) and index < len(params) and getattr(params[index], "is_constexpr", False):
            consts.append(f"{params[index].name}={value}")
        elif isinstance(index, str):
            consts.append(f"{index}={value}")
    return f"{name}({', '.join(consts)})"
