"""``twogrid replay TRACE``: re-dispatch a recorded step trace under another configuration.

Each record's batch shape (tokens, requests, q or query-length histogram, decode or not) goes through the new
configuration's dispatcher; the report counts eager steps and padding and estimates device time on step-cost
curves (a preset, or per-size times measured on a GPU: ``--cost-table``), for the recorded run and the new plan
side by side, and says why each eager step was eager.

Under ``"auto"`` speculative tiers (``k_of_batch``: the K the chosen tiers give each batch size) every uniform
decode of n requests is re-dispatched at q = 1 + K(n), as the engine would run it, and the K of each step is
reported. The step sequence stays the recorded one: another K would change how many steps a run takes, which
replay does not model (``twogrid simulate`` does).

With a prefix-cache hit rate (``--prefix-cache-hit-rate R``, for a trace recorded without prefix caching, or with
less reuse than expected) every prefill chunk of a mixed step keeps a share 1 - R of its tokens (at least one), an
estimate of the steps prefix caching would leave: the eager steps and padding of smaller prefills. The chunks are
the queries longer than a decode's (1 + K); ``twogrid simulate --dataset-name prefix_repetition`` runs the
scheduler with the cache itself.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from dispatcher.plan.dispatch import MIXED, MODE_EAGER, UNIFORM_DECODE, Dispatcher, eager_reason
from dispatcher.plan.capture_plan import CapturePlan
from dispatcher.engine.trace import StepTally
from dispatcher.engine.cost import StepCostModel


def record_shape(rec: dict[str, Any]) -> tuple[int, int, int, bool]:
    """(num_tokens, num_reqs, max_query_len, is_decode) of a trace record."""
    if "q" in rec:
        max_q = int(rec["q"])
    else:
        max_q = max(int(k) for k in rec["query_len_hist"])
    is_decode = rec.get("is_decode", rec["kind"] != MIXED)
    return int(rec["tokens"]), int(rec["requests"]), max_q, bool(is_decode)


def cached_shape(rec: dict[str, Any], hit_rate: float, decode_q: int) -> tuple[int, int, int, bool]:
    """A record's batch shape with each prefill chunk (a query longer than ``decode_q``) cut to a share 1 -
    ``hit_rate`` of its tokens, at least one."""
    tokens, reqs, max_q, is_decode = record_shape(rec)
    if "q" in rec or not hit_rate:
        return tokens, reqs, max_q, is_decode
    lens = [(int(q), n) for q, n in rec["query_len_hist"].items()]
    cut = [(q if q <= decode_q else max(1, round(q * (1.0 - hit_rate))), n) for q, n in lens]
    return sum(q * n for q, n in cut), reqs, max(q for q, _ in cut), is_decode


def replay(records: list[dict[str, Any]], plan: CapturePlan, dispatcher: Dispatcher,
           costs: StepCostModel | str = "bench-moe", k_of_batch=None, prefix_cache_hit_rate: float = 0.0
           ) -> dict[str, Any]:
    """Re-dispatch ``records`` under ``plan``; device time on ``costs`` (a StepCostModel, such as a measured
    table from ``load_cost_table``, or a preset's name), for the recorded modes and sizes and for the new ones.
    ``k_of_batch`` (``"auto"`` tiers: K per batch size): uniform decodes re-shaped to q = 1 + K(requests).
    ``prefix_cache_hit_rate``: prefill chunks cut as that share of their tokens were cached (``cached_shape``)."""
    if isinstance(costs, str):
        costs = StepCostModel.preset(costs)
    cfg = plan.config
    before, after = StepTally(), StepTally()
    totals = Counter()
    reasons: dict[str, list[int]] = {}
    over_limit = 0
    k_per_step: list[int | None] = []
    decode_q = 1 + cfg.num_speculative_tokens
    for rec in records:
        tokens, reqs, max_q, is_decode = cached_shape(rec, prefix_cache_hit_rate, decode_q)
        if k_of_batch is not None and rec["kind"] == UNIFORM_DECODE and 1 <= reqs < len(k_of_batch):
            k = int(k_of_batch[reqs])
            max_q, tokens = 1 + k, reqs * (1 + k)
            k_per_step.append(k)
        elif k_of_batch is not None:
            k_per_step.append(None)
        if tokens > cfg.max_num_batched_tokens or reqs > cfg.max_num_seqs:
            over_limit += 1
            continue
        desc = dispatcher.dispatch(tokens, reqs, max_q, is_decode)
        old_mode, old_padded = rec["mode"], int(rec["padded_tokens"])
        before.add(rec["kind"], old_mode, int(rec["tokens"]), old_padded)  # (as recorded, whatever the new shape)
        after.add(desc.kind, desc.mode, tokens, desc.num_tokens)
        totals["ms_before"] += costs.step_ms(old_mode, old_padded)
        totals["ms_after"] += costs.step_ms(desc.mode, desc.num_tokens)
        totals["real_tokens"] += tokens
        if desc.mode == MODE_EAGER:
            reasons.setdefault(eager_reason(desc, plan)[1], []).append(tokens)
    recorded, replayed = before.summary(), after.summary()
    steps = replayed.pop("steps")
    recorded.pop("steps")
    auto = {}
    if k_of_batch is not None:
        by_k = Counter(k for k in k_per_step if k is not None)
        auto = {"auto_tiers": {"steps_by_k": {str(k): n for k, n in sorted(by_k.items())}, "k_per_step": k_per_step}}
    return {
        "steps": steps,
        "steps_over_new_limits": over_limit,
        "real_tokens": totals["real_tokens"],
        "recorded": {**recorded, "estimated_device_seconds": round(totals["ms_before"] / 1e3, 4)},
        "replayed": {**replayed, "estimated_device_seconds": round(totals["ms_after"] / 1e3, 4)},
        "eager_reasons": [{"reason": r, "steps": len(t), "min_tokens": min(t), "max_tokens": max(t)}
                          for r, t in sorted(reasons.items(), key=lambda kv: -len(kv[1]))],
        "cost_model": costs.name,
        "prefix_cache_hit_rate": prefix_cache_hit_rate,
        "config": plan.to_dict()["config"],
        **auto,
    }
