"""What a plan's grids cost in padding on recorded batches, priced on a measured step cost (``twogrid plan
--autotune``). Above ``dispatch`` (it dispatches each batch as the engine would) and ``gridfit`` (the curves)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from dispatcher.plan.dispatch import MODE_EAGER, Dispatcher
from dispatcher.plan.gridfit import DECODE_KIND, PREFILL_KIND, StepCost, step_time


def expected_padding(shapes: Sequence[tuple[int, int, int, bool]], plan, cost: StepCost) -> dict[str, Any]:
    """What ``plan``'s grids cost in padding on recorded batches ``shapes`` ((tokens, requests, max query length,
    is_decode) each), priced on ``cost``: per batch dispatched as the engine would (``Dispatcher``), T(its
    padded size) - T(its size) on the curve of the graph kind it lands on (PIECEWISE: tokens; FULL decode: requests
    at its q); batches on other graphs (adaptive verification, FULL mode) or none (eager) are counted, not priced.
    Returns the padding ms in all, the steps' ms unpadded (on the same curves) and their ratio."""
    cfg = plan.config
    dispatcher = Dispatcher(plan.for_runner("target"), cfg.max_num_seqs, cfg.max_num_batched_tokens,
                            1 + cfg.num_speculative_tokens)
    pw = step_time(cost.prefill) if len(cost.prefill) >= 2 else None
    dec: dict[int, Callable[[float], float] | None] = {}
    padding = unpadded = 0.0
    priced = eager = other = 0
    for tokens, reqs, max_q, is_decode in shapes:
        if tokens > cfg.max_num_batched_tokens or reqs > cfg.max_num_seqs or reqs < 1:
            continue
        desc = dispatcher.dispatch(tokens, reqs, max_q, is_decode)
        graph = desc.graph
        if desc.mode == MODE_EAGER:
            eager += 1
            continue
        if graph.kind == PREFILL_KIND and pw is not None:
            T, real, padded = pw, tokens, desc.num_tokens
        elif graph.kind == DECODE_KIND:
            if graph.q not in dec:
                pts = cost.decode_points(graph.q)
                dec[graph.q] = step_time(pts) if len(pts) >= 2 else None
            T, real, padded = dec[graph.q], reqs, graph.size
        else:
            T = None
        if T is None:
            other += 1
            continue
        priced += 1
        base = T(real)
        unpadded += base
        padding += T(padded) - base
    return {"priced_steps": priced, "eager_steps": eager, "other_steps": other,
            "padding_ms": round(padding, 3), "unpadded_ms": round(unpadded, 3),
            "padding_share": round(padding / unpadded, 5) if unpadded else None}
