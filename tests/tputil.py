"""Tensor-parallel tests' harness: run a function on N gloo ranks, each in its own (forked) process."""

from __future__ import annotations

import multiprocessing
import os
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


def run_ranks(fn, size: int, tmp_dir: str, *args, timeout_s: float = 120.0) -> list:
    """``fn(tp, *args)`` on ranks 0..size-1 (gloo, CPU); each rank's return value, by rank. A rank's exception
    is re-raised here as a RuntimeError carrying its traceback."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    # (a rendezvous file of its own each call: two runs of one function in one test shared one, and the second
    # group's rank 0 could read the first group's rank 1 address from it, gone by then: refused, then a timeout)
    init_file = os.path.join(tmp_dir, f"tp-init-{uuid.uuid4().hex}")
    procs = [ctx.Process(target=_rank_main, args=(fn, r, size, init_file, queue, args)) for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(size):
            rank, status, value = queue.get(timeout=timeout_s)
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
