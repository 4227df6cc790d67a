"""The server's Prometheus counters around a run: eager steps by reason, padded tokens, graph steps by kind and mode,
the steps' device time (over the run's duration: how busy the GPU was), the decode steps that ran as one fused graph,
the engine steps that reached a front end while it was behind (its outputs merged: the serving path, not the GPU, was
the limit), and speculative decoding's counters as vLLM names them (verify events, drafts verified, accepted in all and
per position; the mean acceptance length follows), the prefix cache's queries and hits in tokens (the hit rate
follows), and the server's own time to first token (from a request's arrival at a front end to its first token's
send: its mean beside the client's tells the client's share of a TTFT).

A twogrid server exports them on ``/metrics``; other servers do not, and then the result simply has no such fields.
"""

from __future__ import annotations

import asyncio
import sys
from collections import defaultdict
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from scheduler.scheduler import mean_acceptance_length

TRACKED: dict[str, tuple[str, tuple[str, ...]]] = {
    "eager_steps": ("twogrid:eager_steps_total", ("reason",)),
    "padded_tokens": ("twogrid:padded_tokens_total", ()),
    "cudagraph_steps": ("twogrid:cudagraph_steps_total", ("kind", "mode")),
    "step_device_seconds": ("twogrid:step_device_seconds_total", ()),
    "fused_decode_steps": ("twogrid:fused_decode_steps_total", ()),
    "front_end_backlog_steps": ("twogrid:front_end_backlog_steps_total", ()),
    "spec_decode_num_drafts": ("twogrid:spec_decode_num_drafts_total", ()),
    "spec_decode_num_draft_tokens": ("twogrid:spec_decode_num_draft_tokens_total", ()),
    "spec_decode_num_accepted_tokens": ("twogrid:spec_decode_num_accepted_tokens_total", ()),
    "spec_decode_accepted_per_pos": ("twogrid:spec_decode_num_accepted_tokens_per_pos_total", ("position",)),
    "prefix_cache_queries": ("twogrid:prefix_cache_queries_total", ()),
    "prefix_cache_hits": ("twogrid:prefix_cache_hits_total", ()),
    "server_ttft_seconds": ("twogrid:time_to_first_token_seconds_sum", ()),
    "server_first_tokens": ("twogrid:time_to_first_token_seconds_count", ()),
    "server_preprocess_seconds": ("twogrid:request_preprocess_time_seconds_sum", ()),
    "server_sent_requests": ("twogrid:request_preprocess_time_seconds_count", ()),
    "server_queue_seconds": ("twogrid:request_queue_time_seconds_sum", ()),
    "server_prefill_seconds": ("twogrid:request_prefill_time_seconds_sum", ()),
    "server_engine_first_tokens": ("twogrid:request_prefill_time_seconds_count", ()),
}
"""Result field -> (Prometheus sample name, labels it is broken down by)."""
PER_POSITION = "spec_decode_accepted_per_pos"
"""The field that is a list by draft position (0..K-1), not a total and a breakdown."""
CAPTURED, PLANNED = "twogrid:cudagraphs_captured", "twogrid:cudagraphs_planned"
"""The gauges of the graphs captured so far and planned (a server that serves while it captures them)."""

Samples = dict[str, dict[tuple[str, ...], float]]
"""Sample name -> values summed by the tracked labels' values."""


def parse_counters(text: str) -> Samples:
    """The tracked counters of a Prometheus text exposition, summed over every label but the tracked ones."""
    wanted = {**dict(TRACKED.values()), CAPTURED: (), PLANNED: ()}
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = wanted.get(sample.name)
            if labels is None:
                continue
            key = tuple(sample.labels.get(name, "") for name in labels)
            row = out.setdefault(sample.name, defaultdict(float))
            row[key] += sample.value
    return out


async def scrape(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> Samples | None:
    """The server's tracked counters now; None when it serves no Prometheus ``/metrics``."""
    url = base_url + "/metrics"
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as response:
            if response.status != 200:
                return None
            text = await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None
    try:
        return parse_counters(text)
    except ValueError:
        print(f"note: {url} is not Prometheus text; server counters are left out", file=sys.stderr)
        return None


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def graph_totals(samples: Samples | None) -> tuple[int, int] | None:
    """(graphs captured, graphs planned) over every runner and kind; None from a server without the gauges."""
    if not samples or PLANNED not in samples:
        return None
    return int(sum(samples.get(CAPTURED, {}).values())), int(sum(samples[PLANNED].values()))


def capture_unfinished(samples: Samples | None) -> tuple[int, int] | None:
    """``graph_totals`` of a server still capturing its graphs between steps (twogrid serve's default on CUDA), else
    None (every graph captured, or a server that exports no such gauges)."""
    totals = graph_totals(samples)
    return totals if totals is not None and totals[0] < totals[1] else None


def counter_deltas(before: Samples | None, after: Samples | None) -> dict[str, Any]:
    """Result fields for the counters present in both scrapes: ``eager_steps`` and ``eager_steps_by_reason``,
    ``padded_tokens``, ``cudagraph_steps`` and ``cudagraph_steps_by_kind_mode`` ({kind: {mode: steps}}),
    ``step_device_seconds``, ``fused_decode_steps``, ``front_end_backlog_steps``, and with a server that counts
    verify events ``spec_decode_num_drafts``, ``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens``,
    ``spec_decode_accepted_per_pos`` ([accepted at position 0, 1, ...]) and ``mean_acceptance_length`` (1 +
    accepted / drafts; None without drafts), ``prefix_cache_queries``, ``prefix_cache_hits`` and
    ``prefix_cache_hit_rate`` (hits / queries; None without queries), ``server_ttft_seconds`` and
    ``server_first_tokens`` (the server's TTFT histogram's sum and count) and ``server_ttft_ms_mean`` (None without
    first tokens), and of it the engine's part: ``server_queue_ms_mean`` (waiting in the engine) and
    ``server_prefill_ms_mean`` (the prompt's steps), from ``server_queue_seconds``, ``server_prefill_seconds`` and
    ``server_engine_first_tokens``. ``before`` = {} gives the totals since the server started."""
    if before is None or after is None:
        return {}
    out: dict[str, Any] = {}
    if not any(name in after for name, _ in TRACKED.values()):
        return out  # not a twogrid server
    for field, (name, labels) in TRACKED.items():
        if field == PER_POSITION:
            continue
        if name not in after:  # a labelled counter nothing has incremented yet exports no sample: zero
            out[field] = 0
            if labels:
                out[f"{field}_by_{'_'.join(labels)}"] = {}
            continue
        old = before.get(name, {})
        moved = {key: value - old.get(key, 0.0) for key, value in after[name].items()}
        out[field] = _number(round(sum(moved.values()), 6))
        if labels:
            nested: dict[str, Any] = {}
            for key, value in sorted(moved.items()):
                node = nested
                for part in key[:-1]:
                    node = node.setdefault(part, {})
                node[key[-1]] = _number(value)
            out[f"{field}_by_{'_'.join(labels)}"] = nested
    _spec_decode_fields(out, before, after)
    queries = out.get("prefix_cache_queries")
    if queries is not None:
        out["prefix_cache_hit_rate"] = round(out["prefix_cache_hits"] / queries, 4) if queries else None
    for field, seconds, count in (("server_ttft_ms_mean", "server_ttft_seconds", "server_first_tokens"),
                                  ("server_preprocess_ms_mean", "server_preprocess_seconds", "server_sent_requests"),
                                  ("server_queue_ms_mean", "server_queue_seconds", "server_engine_first_tokens"),
                                  ("server_prefill_ms_mean", "server_prefill_seconds", "server_engine_first_tokens")):
        n = out.get(count)
        if n is not None:  # (a histogram's mean over the run: None where it observed nothing)
            out[field] = round(1e3 * out[seconds] / n, 3) if n else None
    return out


def _spec_decode_fields(out: dict[str, Any], before: Samples, after: Samples) -> None:
    """The per-position list and the mean acceptance length; no speculative-decoding fields at all from a server
    that does not count verify events (one older than these counters)."""
    if TRACKED["spec_decode_num_drafts"][0] not in after:
        for field in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
            out.pop(field, None)
        return
    name = TRACKED[PER_POSITION][0]
    old = before.get(name, {})
    moved = {int(key[0]): value - old.get(key, 0.0) for key, value in after.get(name, {}).items()}
    per_pos = [0] * (max(moved) + 1 if moved else 0)
    for position, value in moved.items():
        per_pos[position] = _number(value)
    out[PER_POSITION] = per_pos
    length = mean_acceptance_length(out["spec_decode_num_drafts"], out["spec_decode_num_accepted_tokens"])
    out["mean_acceptance_length"] = None if length is None else round(length, 4)
