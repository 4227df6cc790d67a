"""The worker process: ``python -m dispatcher.runtime.process IPC_DIR``. It connects to the engine's two ZeroMQ
sockets in IPC_DIR, builds its ModelWorker from a ``WorkerInit`` (sizing the KV cache from free memory when asked),
answers ``WorkerReady``, then runs steps until ``Shutdown``.

Two threads: the main thread receives each step and submits it (queues its work on the device), a result thread
waits for submitted steps in order and sends their results. So a step arriving while the last one runs is queued
on the device at once, and a result leaves as soon as it is ready. Every frame is decoded into the message types of
``dispatcher.messages`` (msgpack, no pickle); a frame that is not one is refused with a ``WorkerError`` and the
worker goes on. The engine owns the worker's life: the worker ignores SIGTERM (the engine sends ``Shutdown`` once
it has drained) and exits by itself, removing the ipc directory, when its engine process is gone.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import shutil
import sys
import threading
import time
import traceback
from dataclasses import replace

import msgspec
import torch
import zmq

from dispatcher.child import freeze_startup_heap, ignore_stop_signals, parent_gone, profiled
from dispatcher.messages import (TO_ENGINE, TO_WORKER, GrammarBitmask, Shutdown, WorkerError, WorkerInit, WorkerReady,
                                 decode_init, decode_to_worker, encode, resolve_init)
from dispatcher.plan.capture_plan import DRAFT_MODEL, FULL_VARLEN, MODEL_DRAFTERS, build_plan
from dispatcher.runtime.worker import ModelWorker, WorkerConfig
from models.attention import kv_cache_dtype
from models.loader import load_model, read_model_config

log = logging.getLogger("twogrid.worker")

ENGINE_CHECK_S = 1.0
"""How often a worker waiting for its next message checks that its engine is alive."""
FAIL_STEPS_ENV = "TWOGRID_FAIL_STEPS"
"""A test hook, off unless set: comma-separated step ids that fail in the worker (``ModelWorker.fail_steps``)."""


def kv_bytes_per_block(model_cfg, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """Bytes of one KV block across ``num_layers`` layers (default: all of the model's), in the cache's ``dtype``
    (one byte a value with ``--kv-cache-dtype fp8``)."""
    layers = model_cfg.num_layers if num_layers is None else num_layers
    return layers * 2 * block_size * model_cfg.num_kv_heads * model_cfg.head_dim * \
        torch.tensor([], dtype=dtype).element_size()


def build_worker(init: WorkerInit) -> tuple[ModelWorker, WorkerReady]:
    """Load the model, size the KV cache (from free memory when init.num_kv_blocks is 0), capture the graphs."""
    cfg = resolve_init(init)
    plan = build_plan(cfg)
    dtype = getattr(torch, init.dtype)
    device = torch.device(init.device)
    start = time.perf_counter()
    model = load_model(init.model, device, dtype, init.seed, init.quantization, init.max_model_len)
    wcfg = WorkerConfig(init.model, init.device, dtype, init.num_kv_blocks or 256, init.block_size,
                        init.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens, init.max_blocks_per_seq,
                        init.seed, init.use_cuda_graphs, init.fixed_acceptance, init.fuse_decode_steps,
                        init.quantization, init.kv_cache_dtype, init.structured_outputs)
    if not init.num_kv_blocks:
        wcfg = replace(wcfg, num_kv_blocks=_size_kv_cache(wcfg, plan, model, init.gpu_memory_utilization))
    worker = ModelWorker(wcfg, plan, model=model)
    report = worker.capture(progress=False)
    av = worker.runtime.measure_step_ms(FULL_VARLEN) if init.measure_av_curve else None
    decode_costs = worker.measure_decode_costs() if init.measure_decode_costs else None
    capture = [{"runner": k.runner, "kind": k.kind, "q": k.q, "graphs": k.graphs, "seconds": round(k.seconds, 3),
                "measured_gib": round(k.measured_gib, 4),
                "estimated_gib": None if k.estimated_gib is None else round(k.estimated_gib, 4)} for k in report.kinds]
    ready = WorkerReady(model.cfg.to_dict(), wcfg.num_kv_blocks, capture, round(time.perf_counter() - start, 2),
                        worker.device_name, av, decode_costs)
    return worker, ready


def _size_kv_cache(wcfg: WorkerConfig, plan, model, utilization: float) -> int:
    """KV blocks that fit in ``utilization`` of the device's memory once the weights, the static buffers and the
    graphs (estimated by capturing samples into a throwaway pool) are counted. On the CPU: enough for every slot's
    longest request, capped at 4 GiB."""
    kv_dtype = kv_cache_dtype(wcfg.kv_cache_dtype, wcfg.dtype)
    per_block = kv_bytes_per_block(model.cfg, wcfg.block_size, kv_dtype)
    method = plan.config.method
    if method == DRAFT_MODEL:  # the draft LM's own cache
        per_block += kv_bytes_per_block(read_model_config(plan.config.draft_model), wcfg.block_size, kv_dtype)
    elif method in MODEL_DRAFTERS:  # a one-layer head with the target's KV heads
        per_block += kv_bytes_per_block(model.cfg, wcfg.block_size, kv_dtype, 1)
    if wcfg.device.startswith("cpu"):
        return max(1, min(wcfg.max_num_seqs * wcfg.max_blocks_per_seq, (4 << 30) // per_block))
    probe = ModelWorker(wcfg, plan, model=model)  # wcfg.num_kv_blocks is small here
    graphs = 0.0
    if wcfg.use_cuda_graphs:
        graphs = sum(rt.estimate_memory() for rt in probe.runtimes) * 2**30
        graphs += probe.fused.estimate_memory() * 2**30 if probe.fused is not None else 0.0
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    budget = utilization * total - (total - free) - graphs + wcfg.num_kv_blocks * per_block
    del probe
    gc.collect()
    torch.cuda.empty_cache()
    blocks = int(budget // per_block)
    if blocks < wcfg.max_blocks_per_seq:
        raise RuntimeError(
            f"gpu_memory_utilization = {utilization} leaves room for {max(blocks, 0)} KV blocks of {wcfg.block_size} "
            f"tokens, fewer than one request of max_model_len = {wcfg.max_model_len} needs "
            f"({wcfg.max_blocks_per_seq}); raise --gpu-memory-utilization or lower --max-model-len")
    return blocks


def fail_steps_from_env() -> frozenset[int]:
    """$TWOGRID_FAIL_STEPS as step ids (empty when unset); ValueError names a malformed one."""
    text = os.environ.get(FAIL_STEPS_ENV, "").strip()
    if not text:
        return frozenset()
    try:
        steps = frozenset(int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(f"${FAIL_STEPS_ENV} must be comma-separated step ids, got {text!r}") from None
    log.warning("TEST HOOK: steps %s will fail on purpose ($%s)", sorted(steps), FAIL_STEPS_ENV)
    return steps


def serve(ipc_dir: str) -> int:
    ignore_stop_signals()  # the engine stops its worker (Shutdown), once it has drained
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(f"ipc://{ipc_dir}/{TO_WORKER}")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{ipc_dir}/{TO_ENGINE}")
    try:
        init = decode_init(_receive(pull, ipc_dir))
        worker, ready = build_worker(init)
        worker.fail_steps = fail_steps_from_env()
    except Exception as exc:  # the engine reports it and exits
        push.send(encode(WorkerError(-1, f"{type(exc).__name__}: {exc}")))
        log.error("worker start-up failed:\n%s", traceback.format_exc())
        return 1
    push.send(encode(ready))
    push.close(linger=1000)
    freeze_startup_heap()
    results: queue.Queue = queue.Queue()
    sender = threading.Thread(target=_send_results, args=(worker, results, ctx, ipc_dir), daemon=True)
    sender.start()
    inbox = _Inbox(pull, ipc_dir, results)
    worker.receive_grammar = inbox.grammar
    while True:
        message = inbox.next()
        if message is None:
            continue
        if isinstance(message, Shutdown):
            results.put(None)
            sender.join(timeout=30)
            return 0
        if isinstance(message, GrammarBitmask):  # (its step failed before it took it)
            log.debug("dropped the grammar bitmask of step %d", message.step_id)
            continue
        try:
            results.put(worker.submit(message))
        except Exception as exc:
            log.error("step %d failed:\n%s", message.step_id, traceback.format_exc())
            results.put(WorkerError(message.step_id, f"{type(exc).__name__}: {exc}"))


class _Inbox:
    """The engine's messages in order, with room to put one back: a constrained step whose bitmask follows it
    (``ModelWorker.receive_grammar``) takes the next message in the middle of its submit."""

    def __init__(self, pull: zmq.Socket, ipc_dir: str, results: queue.Queue):
        self.pull, self.ipc_dir, self.results = pull, ipc_dir, results
        self._back = None

    def next(self):
        """The next message; None for a malformed frame (refused with a WorkerError)."""
        if self._back is not None:
            message, self._back = self._back, None
            return message
        frame = _receive(self.pull, self.ipc_dir)
        try:
            return decode_to_worker(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.results.put(WorkerError(-2, f"refused a malformed frame of {len(frame)} bytes: {exc}"))
            return None

    def grammar(self, step_id: int) -> GrammarBitmask:
        """The bitmask of step ``step_id``, which the engine sends right after it; RuntimeError (the step fails)
        for anything else, which stays for the main loop."""
        message = self.next()
        if isinstance(message, GrammarBitmask):
            return message
        self._back = message
        raise RuntimeError(f"step {step_id} waited for its grammar bitmask and got "
                           f"{type(message).__name__ if message is not None else 'a malformed frame'}")


def _receive(pull: zmq.Socket, ipc_dir: str) -> bytes:
    """The next frame from the engine. An engine that died without stopping its worker (SIGKILL, the OOM killer)
    leaves it orphaned: within ENGINE_CHECK_S the worker removes the ipc directory and exits, instead of holding
    its memory and device forever."""
    while not pull.poll(ENGINE_CHECK_S * 1000):
        if parent_gone():
            log.error("the engine process is gone: exiting")
            shutil.rmtree(ipc_dir, ignore_errors=True)
            os._exit(1)
    return pull.recv()


def _send_results(worker: ModelWorker, results: queue.Queue, ctx: zmq.Context, ipc_dir: str) -> None:
    """In submission order: wait for each step's result and send it (errors as WorkerError). This thread's own
    socket: ZeroMQ sockets are not shared between threads."""
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{ipc_dir}/{TO_ENGINE}")
    while True:
        item = results.get()
        if item is None:
            push.close(linger=1000)
            return
        if isinstance(item, WorkerError):
            push.send(encode(item))
            continue
        try:
            push.send(encode(worker.collect(item)))
        except Exception as exc:
            push.send(encode(WorkerError(item.step.step_id, f"{type(exc).__name__}: {exc}")))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    sys.exit(profiled("worker", serve, sys.argv[1]))
