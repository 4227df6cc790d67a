"""Tensor-parallel tests' harness: run a function on N gloo ranks, each in its own process, forked from a server
process that imported torch and ran nothing (multiprocessing's forkserver): a rank forked from the test process
itself inherits whatever its threads held at the fork (the test has run torch's intra-op thread pool just before:
CI's run once hung a rank in its rendezvous until the 120 s timeout). ``fn`` and its arguments go by pickle: a
module-level function."""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import sys
import time
import traceback
import uuid


def _rank_main(fn, rank: int, size: int, init_file: str, queue, args) -> None:
    import torch

    from models.parallel import init_distributed

    torch.set_num_threads(1)
    try:
        tp = init_distributed(rank, size, f"file://{init_file}", torch.device("cpu"))
        queue.put((rank, "ok", _portable(fn(tp, *args))))
    except BaseException as exc:  # the test sees every rank's failure, not a hang
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _portable(value):
    """Tensors as numpy arrays (torch's queue pickler would pass a file descriptor that dies with the rank)."""
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", value.detach().float().numpy().copy())
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(v) for v in value)
    return value


def _restored(value):
    import torch

    if isinstance(value, tuple) and len(value) == 2 and value[0] == "tensor":
        return torch.from_numpy(value[1])
    if isinstance(value, (list, tuple)):
        return type(value)(_restored(v) for v in value)
    return value


def _context(module: str):
    """The forkserver context, its server importing torch and the calling test module once (``module``: what each
    rank would import to find its function; the server starts at the first call, with the first caller's). The
    server is started here with this process's import path in PYTHONPATH: Python 3.11-3.13's forkserver ignores the
    path it is sent, so pytest's additions (the tests folder, the repository) would be missing there and the
    preload would fail silently, leaving every rank to import the module again."""
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "models.parallel", module])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + ([old] if old else []))
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return ctx


def run_ranks(fn, size: int, tmp_dir: str, *args, timeout_s: float = 120.0) -> list:
    """``fn(tp, *args)`` on ranks 0..size-1 (gloo, CPU); each rank's return value, by rank. A rank's exception
    is re-raised here as a RuntimeError carrying its traceback."""
    ctx = _context(fn.__module__)
    queue = ctx.Queue()
    # (a rendezvous file of its own each call: two runs of one function in one test shared one, and the second
    # group's rank 0 could read the first group's rank 1 address from it, gone by then: refused, then a timeout)
    init_file = os.path.join(tmp_dir, f"tp-init-{uuid.uuid4().hex}")
    procs = [ctx.Process(target=_rank_main, args=(fn, r, size, init_file, queue, args)) for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < size:
            # (ranks gone before this wait: what they sent is in the pipe by then (a process flushes its queue
            # before it exits), so one without a result after the wait never sent one: a signal, a crash in native
            # code, a result that did not pickle; it fails the test now, by name)
            exited = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode is not None}
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [f"rank {r} exited with {code} without a result" for r, code in exited.items()
                        if r not in results]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError("; ".join(dead) or f"no result from ranks "
                                       f"{sorted(set(range(size)) - set(results))} in {timeout_s:.0f} s") from None
                continue
            if status == "error":
                errors.append(f"rank {rank}: {value}")
            results[rank] = _restored(value)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(size)]
