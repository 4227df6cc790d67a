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
from dataclasses import dataclass, replace

import msgspec
import torch
import zmq

from dispatcher.child import freeze_startup_heap, ignore_stop_signals, parent_gone, profiled, seconds_since_start
from dispatcher.configure import tensor_parallel_capture_conflict
from dispatcher.messages import (TO_ENGINE, TO_WORKER, TP_INIT_ENV, TP_RANK_ENV, Shutdown, WorkerError,
                                 WorkerInit, WorkerReady, decode_init, decode_to_worker, encode, resolve_init)
from dispatcher.plan.capture_plan import (DRAFT_MODEL, FULL_DECODE, FULL_VARLEN, MODEL_DRAFTERS, PIECEWISE, GraphSet,
                                          build_plan, one_token_tiers)
from dispatcher.plan.gridfit import StepCost, measurement_sizes
from dispatcher.runtime.cache import cached_json
from dispatcher.runtime.capture import GAP_BUDGET_S
from dispatcher.runtime.grammar import import_xgrammar_in_background
from dispatcher.runtime.graphs import GraphRuntime, free_device_bytes
from dispatcher.runtime.worker import ModelWorker, WorkerConfig
from models.attention import allocate_kv_cache, kv_cache_dtype
from models.loader import load_model, read_model_config
from models.parallel import TensorParallel, check_same_plan, init_distributed

log = logging.getLogger("twogrid.worker")

ENGINE_CHECK_S = 1.0
"""How often a worker waiting for its next message checks that its engine is alive."""
FAIL_STEPS_ENV = "TWOGRID_FAIL_STEPS"
"""A test hook, off unless set: comma-separated step ids that fail in the worker (``ModelWorker.fail_steps``)."""
CAPTURE_DELAY_ENV = "TWOGRID_CAPTURE_DELAY_S"
"""A test hook, off unless set: under delayed capture each unit's capture takes this many seconds more (a slow
capture on the CPU, whose static backend captures nothing)."""
RESULT_WAIT_S = 1.0
"""The most a constrained step's bitmask fill waits for the results before it to be sent (``_InFlight.wait_sent``)."""
IDLE_CHECK_S = 0.002
"""Delayed capture with a step in flight: after the gap's budget, how often the worker checks whether it has gone
idle (every step done and none waiting), when it captures without a budget."""
IDLE_AFTER_S = 0.02
"""Delayed capture: how long the worker must have had every step's result sent and no frame waiting before it
counts as idle and captures without a budget. A loaded engine sends its next step within a few ms of a result
(its update and schedule); a unit started in that window would delay that step by its whole length."""
STARTUP_PHASES = ("imports", "settings", "weights", "grid_fit", "kv_sizing", "kv_allocation", "kernels", "capture",
                  "measure")
"""The worker's start-up phases (``WorkerReady.startup``, seconds): the process's start to its imports' end
(interpreter and imports), waiting for the server's settings (``WorkerInit``: the front end sends them once its own
setup has read the model and planned; the worker starts before, so that its imports overlap that), loading the
weights, measuring the step cost for fitted grids
(``fit_cudagraph_capture_sizes``), sizing the KV cache from free memory (the graphs' memory estimate included),
allocating it and the static buffers, the first compile (or disk-cache load) of the kernels eager steps launch,
capturing the graphs (0 under delayed capture, which captures between steps), timing graphs for adaptive
verification or "auto" tiers."""


def kv_bytes_per_block(model_cfg, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """Bytes of one KV block across ``num_layers`` layers (default: all of the model's), in the cache's ``dtype``
    (one byte a value with ``--kv-cache-dtype fp8``)."""
    layers = model_cfg.num_layers if num_layers is None else num_layers
    return layers * 2 * block_size * model_cfg.num_kv_heads * model_cfg.head_dim * \
        torch.tensor([], dtype=dtype).element_size()


class _Phases:
    """Start-up phases' seconds, in STARTUP_PHASES order (``WorkerReady.startup``)."""

    def __init__(self, imported_s: float | None = None):
        """``imported_s``: the process's age when its imports were done (None: counted in the imports)."""
        self.seconds = dict.fromkeys(STARTUP_PHASES, 0.0)
        age = seconds_since_start() or 0.0
        self.seconds["imports"] = min(imported_s, age) if imported_s is not None else age
        self.seconds["settings"] = age - self.seconds["imports"]
        self._t = time.perf_counter()

    def done(self, phase: str, **known: float) -> None:
        """The time since the last call went to ``phase``, but for the ``known`` phases' seconds within it."""
        now = time.perf_counter()
        for other, seconds in known.items():
            self.seconds[other] += seconds
        self.seconds[phase] += now - self._t - sum(known.values())
        self._t = now

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.seconds.items()}


def join_tensor_parallel(init: WorkerInit) -> tuple[torch.device, TensorParallel | None, MemorySnapshot | None]:
    """A tensor-parallel rank (``init.tensor_parallel_size`` > 1): its device (``cuda:RANK`` on CUDA; on the CPU its
    share of the cores) and its group, joined through $TWOGRID_TP_INIT_METHOD as rank $TWOGRID_TP_RANK. Delayed
    capture and fitted grids are refused: the ranks must capture the same graphs in the same order, and a gap's
    budget or a measured grid would differ between them. With them, on CUDA, the device's memory before anything
    of this process's but its CUDA context (the communicator's buffers count against the server's share)."""
    device = torch.device(init.device)
    size = init.tensor_parallel_size
    if size == 1:
        return device, None, MemorySnapshot.take(device) if device.type == "cuda" else None
    rank, method = int(os.environ[TP_RANK_ENV]), os.environ[TP_INIT_ENV]
    cfg = resolve_init(init)
    if what := tensor_parallel_capture_conflict(cfg):
        raise ValueError(f"tensor_parallel_size = {size}: {what} is not supported with tensor parallelism (every "
                         f"rank must capture the same graphs in the same order)")
    if device.type == "cuda":
        if size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size = {size} needs {size} GPUs; {torch.cuda.device_count()} visible")
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    at_start = MemorySnapshot.take(device) if device.type == "cuda" else None
    tp = init_distributed(rank, size, method, device)
    log.info("tensor parallel rank %d of %d on %s (%s)", rank, size, device, "nccl" if device.type == "cuda" else
             "gloo")
    return device, tp, at_start


def build_worker(init: WorkerInit, capture_hook=None, imported_s: float | None = None) -> tuple[ModelWorker,
                                                                                                  WorkerReady]:
    """Load the model, size the KV cache (from free memory when init.num_kv_blocks is 0), capture the graphs (or,
    with delayed capture, leave them to the gaps between steps). ``capture_hook``: delayed capture's test hook.
    A tensor-parallel rank loads its shard, checks that every rank resolved the same plan and takes the smallest
    KV cache any rank fits, before capturing (in step with the others). ``imported_s``: the process's age when its
    imports were done (the rest, to now, went to waiting for ``init``)."""
    phases = _Phases(imported_s)
    if init.structured_outputs:  # (its import, seconds, overlaps the loading: ModelWorker.warm_up_grammar waits)
        import_xgrammar_in_background()
    device, tp, at_start = join_tensor_parallel(init)
    cfg = resolve_init(init)
    dtype = getattr(torch, init.dtype)
    start = time.perf_counter()
    model = load_model(init.model, device, dtype, init.seed, init.quantization, init.max_model_len, tp)
    phases.done("weights")
    wcfg = WorkerConfig(init.model, str(device), dtype, init.num_kv_blocks or 256, init.block_size,
                        init.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens, init.max_blocks_per_seq,
                        init.seed, init.use_cuda_graphs, init.fixed_acceptance, init.fuse_decode_steps,
                        init.quantization, init.kv_cache_dtype, init.structured_outputs, init.steps_in_flight)
    grid_cost = None
    if cfg.fit_sizes and build_plan(cfg).graph_sets and init.use_cuda_graphs:
        grid_cost = measured_grid_cost(wcfg, cfg, model).to_json()
        cfg = resolve_init(init, grid_cost)
        phases.done("grid_fit")
    plan = build_plan(cfg)
    plan_hash = check_same_plan(tp, plan.to_dict()) if tp is not None else ""
    if not init.num_kv_blocks:
        blocks = _size_kv_cache(wcfg, plan, model, init.gpu_memory_utilization, at_start)
        if tp is not None:  # (the ranks' caches hold the same blocks: the smallest any rank fits)
            fewest = torch.tensor([blocks], device=device)
            torch.distributed.all_reduce(fewest, torch.distributed.ReduceOp.MIN, group=tp.group)
            blocks = int(fewest.item())
        wcfg = replace(wcfg, num_kv_blocks=blocks)
        phases.done("kv_sizing")
    worker = ModelWorker(wcfg, plan, model=model)
    phases.done("kv_allocation")
    report = worker.capture_or_delay(hook=capture_hook)
    phases.done("kernels", capture=worker.capture_seconds)
    progress = worker.delayed.progress() if worker.delayed is not None else None
    av = worker.runtime.measure_step_ms(FULL_VARLEN) if init.measure_av_curve else None
    decode_costs = worker.measure_decode_costs() if init.measure_decode_costs else None
    phases.done("measure")
    kinds = report.kinds if report is not None else []
    capture = [{"runner": k.runner, "kind": k.kind, "q": k.q, "graphs": k.graphs, "seconds": round(k.seconds, 3),
                "measured_gib": round(k.measured_gib, 4),
                "estimated_gib": None if k.estimated_gib is None else round(k.estimated_gib, 4)} for k in kinds]
    ready = WorkerReady(worker.model_config.to_dict(), wcfg.num_kv_blocks, capture,
                        round(report.seconds, 2) if report is not None else 0.0, worker.device_name, av,
                        decode_costs, worker.runtime.cuda_graphs, round(time.perf_counter() - start, 2),
                        phases.rounded(), progress, grid_cost, plan_hash, tp.rank if tp is not None else 0)
    log.info("worker start-up: %s", ", ".join(f"{k} {v:.2f} s" for k, v in phases.rounded().items() if v))
    return worker, ready


def measured_grid_cost(wcfg: WorkerConfig, cfg, model) -> StepCost:
    """``fit_cudagraph_capture_sizes``: the target's step cost at a few sizes (``gridfit.measurement_sizes``) of each
    kind it fits, PIECEWISE by tokens up to the prefill cap, FULL decode by requests at the q its decode grid is
    fitted at (1 + K, where that grid is fitted: ``fits_decode_grid``) and at q = 1 (the one-token draft steps'
    grid, and the decode grid without speculation) up to the decode cap within the token budget: graphs captured
    into a throwaway pool and replayed over padded rows (``GraphRuntime.measure_sizes_ms``: no context). Measured
    once per device, model, dtype and these sizes, then read from $TWOGRID_CACHE/grid_cost."""
    sets = []
    if cfg.cudagraph_mode.has_piecewise and cfg.prefill_token_sizes:
        sets.append(GraphSet("target", PIECEWISE, None, measurement_sizes(cfg.max_prefill_tokens)))
    if cfg.cudagraph_mode.has_full_decode:
        for q in fitted_query_lens(cfg):
            cap = min(cfg.max_num_seqs if q == 1 else cfg.max_decode_requests, cfg.decode_token_limit() // q)
            if cap >= 2:
                sets.append(GraphSet("target", FULL_DECODE, q, measurement_sizes(cap)))
    key = [torch.cuda.get_device_name(wcfg.device) if wcfg.device.startswith("cuda") else "cpu", str(model.cfg),
           str(wcfg.dtype), wcfg.quantization, wcfg.kv_cache_dtype, torch.__version__,
           [[g.kind, g.q, list(g.sizes)] for g in sets]]

    def measure() -> dict:
        start = time.perf_counter()
        kv = allocate_kv_cache(model.cfg.num_layers, wcfg.num_kv_blocks, wcfg.block_size, model.cfg.num_kv_heads,
                               model.cfg.head_dim, kv_cache_dtype(wcfg.kv_cache_dtype, wcfg.dtype),
                               torch.device(wcfg.device))
        widest = max(size * (g.q or 1) for g in sets for size in g.sizes)
        rt = GraphRuntime(model, kv, sets, max_num_tokens=widest, max_num_reqs=cfg.max_num_seqs,
                          max_blocks_per_seq=wcfg.max_blocks_per_seq, use_cuda_graphs=wcfg.use_cuda_graphs)
        pool = torch.cuda.graph_pool_handle() if rt.cuda_graphs else None
        rt.capture(progress=False, estimate=False, pool=pool)
        times = rt.measure_sizes_ms(5 if rt.cuda_graphs else 1)  # (the CPU's static backend: no performance path)
        del rt, kv, pool
        gc.collect()
        if wcfg.device.startswith("cuda"):
            torch.cuda.empty_cache()
        log.info("measured the step cost for fitted grids at %d sizes in %.1f s",
                 sum(len(g.sizes) for g in sets), time.perf_counter() - start)
        pts = lambda kind, q: [[n, ms] for n, ms in times.get((kind, q), [])]  # noqa: E731
        return {"prefill_ms": pts(PIECEWISE, None),
                "decode_ms": {str(g.q): pts(FULL_DECODE, g.q) for g in sets if g.kind == FULL_DECODE}}

    data = cached_json("grid_cost", key, measure, "step cost for fitted grids")
    cost = StepCost.from_json({k: v for k, v in data.items() if k != "key"}, data["source"])
    log.info("fitted grids (fit_cudagraph_capture_sizes) from the step cost %s", cost.source)
    return cost


def fitted_query_lens(cfg) -> list[int]:
    """The q whose decode step cost fitted grids use (``plan.config.resolve``): 1 + K (K the largest) for the decode
    grid where it is fitted, and 1 for the one-token draft steps' own grid where a tier runs them."""
    qs = {1 + cfg.num_speculative_tokens} if cfg.fits_decode_grid else set()
    if one_token_tiers(cfg):
        qs.add(1)
    return sorted(qs)


def graph_memory_plan_key(plan) -> dict:
    """The plan as the graph-memory cache keys it: everything but when the graphs are captured (a delayed-capture
    server captures the same graphs as one that captures first, so it reads the estimate that one cached) and where
    fitted grids' step cost was read from (measured on the first start, the cache file after: the same sizes)."""
    data = plan.to_dict()
    left_out = ("delayed_cudagraph_capture", "grid_cost_source")
    return {**data, "config": {k: v for k, v in data["config"].items() if k not in left_out}}


def graph_memory_estimate(probe: ModelWorker, plan) -> float:
    """GiB the plan's graphs will take (every runtime's ``estimate_memory`` and the fused steps'), estimated once per
    device, driver, torch, model, dtype, plan and worker settings and then read from $TWOGRID_CACHE/graph_memory:
    the estimate captures samples of every kind, as long as a capture of a few dozen graphs, which a restart of the
    same setup need not pay again."""
    wcfg = probe.wcfg
    key = [probe.device_name, torch.__version__, torch.version.cuda, str(probe.model.cfg), str(wcfg.dtype),
           graph_memory_plan_key(plan),
           {k: str(v) for k, v in vars(wcfg).items() if k not in ("num_kv_blocks", "seed")}]

    def measure() -> dict:
        gib = sum(rt.estimate_memory() for rt in probe.runtimes)
        return {"gib": gib + (probe.fused.estimate_memory() if probe.fused is not None else 0.0)}

    if probe.model.tp is not None:  # the ranks capture the samples in step (their all-reduces matched): a cache
        return float(measure()["gib"])  # that one rank had and another not would leave one waiting for the other
    return float(cached_json("graph_memory", key, measure, "graph memory estimate")["gib"])


@dataclass(frozen=True)
class MemorySnapshot:
    """The device's memory at one moment, as this process sees it: free and total bytes, and what its torch
    allocator holds (the rest of the used memory is other processes' and this process's CUDA context and
    libraries)."""

    free: int
    total: int
    torch_reserved: int

    @property
    def non_torch(self) -> int:
        return self.total - self.free - self.torch_reserved

    @classmethod
    def take(cls, device: torch.device) -> "MemorySnapshot":
        free = free_device_bytes(device)
        return cls(free, torch.cuda.mem_get_info(device)[1], torch.cuda.memory_reserved(device))


def kv_cache_bytes(at_start: MemorySnapshot, now: MemorySnapshot, utilization: float, graph_bytes: float,
                   probe_kv_bytes: int) -> int:
    """Bytes for the KV cache. ``gpu_memory_utilization`` is this server's share of the device, as in vLLM: other
    processes' memory does not count against it (two servers at 0.45 share a GPU), what this process took since it
    started does (the torch allocator's growth: weights, static buffers; other growth of the memory in use:
    libraries' workspaces), and so do the graphs (estimated). ``probe_kv_bytes``: the sizing probe's small cache,
    held now, which the real one replaces. The rest of the device stays free (the eager steps' activations and the
    sampler's buffers come from it, as before). A share that other processes leave no room for is refused
    (RuntimeError naming the flag) rather than squeezed into what is free. Servers sharing a device start one after
    another: memory another process takes while this one loads counts as this one's growth (vLLM's sizing has the
    same limit)."""
    grown = max(0, now.non_torch - at_start.non_torch)  # (libraries' workspaces: this process's, it is assumed)
    own = now.torch_reserved - at_start.torch_reserved - probe_kv_bytes + grown
    share = int(utilization * now.total - own - graph_bytes)
    free = int(now.free + probe_kv_bytes - graph_bytes)
    if share > free:
        raise RuntimeError(
            f"gpu_memory_utilization = {utilization} asks {utilization * now.total / 2**30:.1f} GiB of this device "
            f"for this server, which would give its KV cache {share / 2**30:.1f} GiB, but {max(free, 0) / 2**30:.1f} "
            f"GiB is free (other processes and this one's CUDA context hold "
            f"{(now.non_torch - grown) / 2**30:.1f} GiB): lower --gpu-memory-utilization (servers sharing a GPU: "
            f"shares summing below 1)")
    return share


def _size_kv_cache(wcfg: WorkerConfig, plan, model, utilization: float, at_start: MemorySnapshot | None) -> int:
    """KV blocks that fit in this server's ``utilization`` share of the device once the weights, the static buffers
    and the graphs (estimated by capturing samples into a throwaway pool) are counted (``kv_cache_bytes``). On the
    CPU: enough for every slot's longest request, capped at 4 GiB."""
    kv_dtype = kv_cache_dtype(wcfg.kv_cache_dtype, wcfg.dtype)
    per_block = kv_bytes_per_block(model.cfg, wcfg.block_size, kv_dtype)
    method = plan.config.method
    if method == DRAFT_MODEL:  # the draft LM's own cache
        per_block += kv_bytes_per_block(read_model_config(plan.config.draft_model), wcfg.block_size, kv_dtype)
    elif method in MODEL_DRAFTERS:  # a one-layer head with the target's KV heads (all of them: replicated)
        per_block += kv_bytes_per_block(model.full_cfg, wcfg.block_size, kv_dtype, 1)
    if wcfg.device.startswith("cpu"):
        return max(1, min(wcfg.max_num_seqs * wcfg.max_blocks_per_seq, (4 << 30) // per_block))
    probe = ModelWorker(wcfg, plan, model=model)  # wcfg.num_kv_blocks is small here
    graphs = 0.0
    if wcfg.use_cuda_graphs:
        graphs = graph_memory_estimate(probe, plan) * 2**30
    now = MemorySnapshot.take(probe.device)
    budget = kv_cache_bytes(at_start, now, utilization, graphs, wcfg.num_kv_blocks * per_block)
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


def capture_delay_from_env():
    """Delayed capture's test hook from $TWOGRID_CAPTURE_DELAY_S (None when unset): each unit sleeps that long."""
    text = os.environ.get(CAPTURE_DELAY_ENV, "").strip()
    if not text:
        return None
    try:
        delay = float(text)
    except ValueError:
        raise ValueError(f"${CAPTURE_DELAY_ENV} must be a number of seconds, got {text!r}") from None
    log.warning("TEST HOOK: every delayed capture unit takes %.3f s more ($%s)", delay, CAPTURE_DELAY_ENV)
    return lambda unit: time.sleep(delay)


def serve(ipc_dir: str) -> int:
    imported_s = seconds_since_start()  # (this module's imports are done: the rest is waiting for the settings)
    ignore_stop_signals()  # the engine stops its worker (Shutdown), once it has drained
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(f"ipc://{ipc_dir}/{TO_WORKER}")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{ipc_dir}/{TO_ENGINE}")
    rank = int(os.environ.get(TP_RANK_ENV) or 0)
    try:
        init = decode_init(_receive(pull, ipc_dir))
        worker, ready = build_worker(init, capture_delay_from_env(), imported_s)
        worker.fail_steps = fail_steps_from_env()
    except Exception as exc:  # the engine reports it and exits
        push.send(encode(WorkerError(-1, f"{'' if not rank else f'rank {rank}: '}{type(exc).__name__}: {exc}")))
        if isinstance(exc, ValueError):  # (a checkpoint, head or setting refused, its message naming it: no trace)
            log.error("worker start-up failed: %s: %s", type(exc).__name__, exc)
        else:
            log.error("worker start-up failed:\n%s", traceback.format_exc())
        push.close(linger=2000)
        return 1
    push.send(encode(ready))
    freeze_startup_heap()
    results: queue.Queue = queue.Queue()
    steps = _InFlight()
    sender = threading.Thread(target=_send_results, args=(worker, results, ctx, ipc_dir, steps, rank), daemon=True)
    sender.start()
    inbox = _Inbox(pull, ipc_dir, results, steps, lambda: _next_frame(worker, pull, push, ipc_dir, steps))
    worker.grammars.before_fill = steps.wait_sent
    while True:
        message = inbox.next()
        if message is None:
            continue
        if isinstance(message, Shutdown):
            results.put(None)
            sender.join(timeout=30)
            push.close(linger=1000)
            return 0
        try:
            steps.put(results, worker.submit(message))
        except Exception as exc:
            log.error("step %d failed:\n%s", message.step_id, traceback.format_exc())
            if rank:
                _rank_failed(rank, ipc_dir)
            steps.put(results, WorkerError(message.step_id, f"{type(exc).__name__}: {exc}"))


class _InFlight:
    """Items handed to the result thread and not yet sent back: the main thread counts them in, the result thread
    out (each count written by one thread only)."""

    def __init__(self):
        self.queued = self.sent = 0
        self._sent = threading.Condition()

    def mark_sent(self) -> None:
        with self._sent:
            self.sent += 1
            self._sent.notify_all()

    def wait_sent(self) -> None:
        """Until every item handed over so far is sent (at most RESULT_WAIT_S). A constrained step's bitmask fill
        waits for this first: xgrammar holds the GIL for milliseconds, and the result thread needs it to send the
        previous step's result, which the engine's next step waits for."""
        with self._sent:
            self._sent.wait_for(lambda: self.sent >= self.queued, RESULT_WAIT_S)

    def put(self, results: queue.Queue, item) -> None:
        self.queued += 1
        results.put(item)

    @property
    def idle(self) -> bool:
        return self.sent == self.queued


def _next_frame(worker: ModelWorker, pull: zmq.Socket, push: zmq.Socket, ipc_dir: str, steps: _InFlight) -> bytes:
    """The engine's next frame; meanwhile delayed capture takes the gap (``ModelWorker.capture_between_steps``):
    at most GAP_BUDGET_S once a gap, then, once the worker has been idle for IDLE_AFTER_S, until a frame arrives.
    Each gap's progress goes to the engine (``CaptureProgress``)."""
    budget_spent, idle_since = False, None
    waiting = lambda: bool(pull.poll(0)) or parent_gone()  # noqa: E731
    while worker.capture_pending and not waiting():
        if steps.idle:
            idle_since = idle_since or time.perf_counter()
        else:
            idle_since = None
        idle = idle_since is not None and time.perf_counter() - idle_since >= IDLE_AFTER_S
        if idle or not budget_spent:
            progress = worker.capture_between_steps(None if idle else GAP_BUDGET_S, waiting)
            budget_spent = True
            if progress is not None:
                push.send(encode(progress))
        elif pull.poll(IDLE_CHECK_S * 1000):
            break
    return _receive(pull, ipc_dir)


class _Inbox:
    """The engine's messages in order (a malformed frame refused with a WorkerError)."""

    def __init__(self, pull: zmq.Socket, ipc_dir: str, results: queue.Queue, steps: "_InFlight", next_frame):
        self.pull, self.ipc_dir, self.results, self.steps = pull, ipc_dir, results, steps
        self.next_frame = next_frame
        """The main loop's next frame (``_next_frame``: delayed capture takes the gap before it)."""

    def next(self):
        """The next message; None for a malformed frame (refused with a WorkerError)."""
        return self._decode(self.next_frame())

    def _decode(self, frame: bytes):
        try:
            return decode_to_worker(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.steps.put(self.results, WorkerError(-2, f"refused a malformed frame of {len(frame)} bytes: {exc}"))
            return None


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


def _rank_failed(rank: int, ipc_dir: str) -> None:
    """A step failed on tensor-parallel rank ``rank`` > 0: its collectives can no longer be matched with the other
    ranks', so it exits; the engine, seeing a rank gone, fails every request and stops the group."""
    log.error("tensor parallel rank %d: a step failed, exiting (the group cannot go on without it)", rank)
    shutil.rmtree(ipc_dir, ignore_errors=True)
    os._exit(1)


def _send_results(worker: ModelWorker, results: queue.Queue, ctx: zmq.Context, ipc_dir: str,
                  steps: _InFlight, rank: int = 0) -> None:
    """In submission order: wait for each step's result and send it (errors as WorkerError). This thread's own
    socket: ZeroMQ sockets are not shared between threads. A tensor-parallel rank > 0 sends nothing (rank 0's
    result is the step's: every rank samples the same tokens from the same gathered logits); it waits for each
    step all the same, and a failed one ends it (``_rank_failed``)."""
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{ipc_dir}/{TO_ENGINE}")
    while True:
        item = results.get()
        if item is None:
            push.close(linger=1000)
            return
        if isinstance(item, WorkerError):
            if item.step_id >= 0 and rank:
                _rank_failed(rank, ipc_dir)
            push.send(encode(item))
        else:
            try:
                result = worker.collect(item)
                if not rank:
                    push.send(encode(result))
            except Exception as exc:
                if rank:
                    _rank_failed(rank, ipc_dir)
                push.send(encode(WorkerError(item.step.step_id, f"{type(exc).__name__}: {exc}")))
        steps.mark_sent()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    sys.exit(profiled("worker", serve, sys.argv[1]))
