"""``twogrid replay TRACE --execute``: every recorded step shape run, with dummy data, through the new
configuration's graphs (or eagerly, where its dispatcher says so) and timed, instead of estimated.

A trace records each step's batch (tokens, requests, q or the query-length histogram), not its contexts: a request
whose query is at most ``MAX_DECODE_QUERY_LEN`` tokens (a decode, or a verification) is given ``context_len`` cached
tokens before it, a longer one (a prefill chunk) none. Token ids are random, KV blocks are shared between
requests where the cache would not hold them all (timing only: the outputs are not read). The target model's
forward is what runs; model drafters' forwards are not executed (their estimate stays in ``replay``'s report).
Identical shapes run once (``repeats`` timed runs after a warm-up, the median) and count as often as they occur.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Any

import numpy as np

from dispatcher.engine.replay import record_shape
from dispatcher.plan.capture_plan import CapturePlan
from dispatcher.plan.dispatch import Dispatcher

MAX_DECODE_QUERY_LEN = 16
"""Queries of up to this many tokens are decodes or verifications: they get ``context_len`` cached tokens."""


def query_lens(rec: dict[str, Any]) -> list[int]:
    """Each request's query length in a trace record (uniform decode: q each; else from the histogram)."""
    if "q" in rec:
        return [int(rec["q"])] * int(rec["requests"])
    return [int(q) for q, n in sorted(rec["query_len_hist"].items(), key=lambda kv: int(kv[0])) for _ in range(n)]


def _context(query_len: int, context_len: int) -> int:
    """Cached tokens before a query: ``context_len`` for a decode or a verification, none for a prefill chunk."""
    return context_len if query_len <= MAX_DECODE_QUERY_LEN else 0


def dummy_rows(lens: list[int], context_len: int, block_size: int, num_blocks: int, vocab: int,
               seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(host rows (4, tokens): ids, positions, KV slots, block-table rows; the block table (requests, width)) for
    requests of these query lengths, request r in block-table row r, its blocks numbered on from the previous
    request's (modulo ``num_blocks``)."""
    contexts = [_context(q, context_len) for q in lens]
    width = max(-(-(c + q) // block_size) for c, q in zip(contexts, lens))
    table = np.zeros((len(lens), width), dtype=np.int64)
    positions, slots, rows = [], [], []
    next_block = 0
    for r, (ctx, q) in enumerate(zip(contexts, lens)):
        need = -(-(ctx + q) // block_size)
        table[r, :need] = (next_block + np.arange(need)) % num_blocks
        next_block += need
        pos = np.arange(ctx, ctx + q)
        positions.append(pos)
        slots.append(table[r, pos // block_size] * block_size + pos % block_size)
        rows.append(np.full(q, r))
    rng = np.random.default_rng(seed)
    n = sum(lens)
    host = np.stack([rng.integers(3, vocab, size=n), np.concatenate(positions), np.concatenate(slots),
                     np.concatenate(rows)]).astype(np.int64)
    return host, table


def execute_trace(records: list[dict[str, Any]], plan: CapturePlan, dispatcher: Dispatcher, model: str,
                  device: str = "cuda", context_len: int = 512, repeats: int = 3, block_size: int = 16,
                  max_kv_blocks: int = 65536, progress: bool = True) -> dict[str, Any]:
    """Capture ``plan``'s target graphs for ``model`` (a preset, a checkpoint directory or a .gguf file) on
    ``device``, run each distinct step shape of ``records`` that fits the plan's limits, and total the measured
    times over the records."""
    import torch

    from dispatcher.runtime.graphs import GraphRuntime, StepInputs
    from models.attention import allocate_kv_cache
    from models.loader import default_dtype, load_model

    cfg = plan.config
    shapes: Counter = Counter()
    for rec in records:
        shape = record_shape(rec)
        if shape[0] > cfg.max_num_batched_tokens or shape[1] > cfg.max_num_seqs:
            continue
        key = (shape, tuple(query_lens(rec)))
        shapes[key] += 1
    dtype = default_dtype(model, device)
    net = load_model(model, device, dtype)
    mcfg = net.cfg
    width = -(-(context_len + cfg.max_num_batched_tokens) // block_size)
    need = max((sum(-(-(_context(q, context_len) + q) // block_size) for q in lens) for (_, lens) in shapes),
               default=1)
    num_blocks = max(1, min(need, max_kv_blocks))
    kv = allocate_kv_cache(mcfg.num_layers, num_blocks, block_size, mcfg.num_kv_heads, mcfg.head_dim, dtype, device)
    runtime = GraphRuntime(net, kv, plan.for_runner("target"), max_num_tokens=cfg.max_num_batched_tokens,
                           max_num_reqs=cfg.max_num_seqs, max_blocks_per_seq=width,
                           use_cuda_graphs=device.startswith("cuda"))
    t0 = time.perf_counter()
    runtime.capture(progress=progress)
    capture_s = time.perf_counter() - t0
    if device.startswith("cuda"):
        runtime.warm_up_eager()
    by_mode: Counter = Counter()
    steps_by_mode: Counter = Counter()
    timed = []
    with torch.inference_mode():
        for (shape, lens), count in shapes.items():
            tokens, reqs, max_q, is_decode = shape
            desc = dispatcher.dispatch(tokens, reqs, max_q, is_decode)
            host, table = dummy_rows(list(lens), context_len, block_size, num_blocks, mcfg.vocab_size)
            rows, cols = np.nonzero(np.ones_like(table))
            runtime.update_block_table(rows, cols, table[rows, cols])
            inputs = StepInputs.from_host(host, device)
            ms = _median_ms(lambda: runtime.execute(desc, inputs), repeats, device)
            by_mode[desc.mode] += ms * count
            steps_by_mode[desc.mode] += count
            timed.append({"tokens": tokens, "requests": reqs, "max_query_len": max_q, "mode": desc.mode,
                          "padded_tokens": desc.num_tokens, "steps": count, "ms": round(ms, 4)})
    recorded = [r.get("device_ms") for r in records]
    return {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "model": model, "context_len": context_len, "repeats": repeats, "capture_seconds": round(capture_s, 2),
        "distinct_shapes": len(shapes), "steps": sum(shapes.values()),
        "executed_device_seconds": round(sum(by_mode.values()) / 1e3, 4),
        "by_mode": {m: {"steps": steps_by_mode[m], "seconds": round(by_mode[m] / 1e3, 4)} for m in by_mode},
        "recorded_device_seconds": round(sum(recorded) / 1e3, 4) if all(v is not None for v in recorded) else None,
        "slowest_shapes": sorted(timed, key=lambda t: -t["ms"] * t["steps"])[:10],
    }


def _median_ms(fn, repeats: int, device: str) -> float:
    """The median time of ``fn`` over ``repeats`` runs after one warm-up (CUDA events on a GPU)."""
    import torch

    fn()
    times = []
    for _ in range(max(1, repeats)):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
