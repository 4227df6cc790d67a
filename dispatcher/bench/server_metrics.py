"""The server's Prometheus counters around a run: eager steps by reason, padded tokens, graph steps by kind and mode,
the steps' device time (over the run's duration: how busy the GPU was), the engine steps that reached a front
end while it was behind (its outputs merged: the serving path, not the GPU, was the limit), and speculative
decoding's accepted draft tokens, drafts (requests' verify steps) and accepted tokens by draft position (the mean
acceptance length is 1 + accepted / drafts).

A twogrid server exports them on ``/metrics``; other servers do not, and then the result simply has no such fields.
"""

from __future__ import annotations

import asyncio
import sys
from collections import defaultdict
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

TRACKED: dict[str, tuple[str, tuple[str, ...]]] = {
    "eager_steps": ("twogrid:eager_steps_total", ("reason",)),
    "padded_tokens": ("twogrid:padded_tokens_total", ()),
    "cudagraph_steps": ("twogrid:cudagraph_steps_total", ("kind", "mode")),
    "step_device_seconds": ("twogrid:step_device_seconds_total", ()),
    "front_end_backlog_steps": ("twogrid:front_end_backlog_steps_total", ()),
    "spec_decode_accepted_tokens": ("twogrid:spec_decode_num_accepted_tokens_total", ()),
    "spec_decode_drafts": ("twogrid:spec_decode_num_drafts_total", ()),
    "spec_decode_accepted_tokens_per_pos": ("twogrid:spec_decode_num_accepted_tokens_per_pos_total", ("position",)),
}
"""Result field -> (Prometheus sample name, labels it is broken down by)."""
LEFT_OUT_WHEN_ABSENT = ("spec_decode_accepted_tokens", "spec_decode_drafts", "spec_decode_accepted_tokens_per_pos")
"""Fields a twogrid server's result lacks (rather than reading 0) when it exports no such sample: a server from
before the counter was added, or (per position) one whose drafts never got past any position."""

Samples = dict[str, dict[tuple[str, ...], float]]
"""Sample name -> values summed by the tracked labels' values."""


def parse_counters(text: str) -> Samples:
    """The tracked counters of a Prometheus text exposition, summed over every label but the tracked ones."""
    wanted = dict(TRACKED.values())
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


def counter_deltas(before: Samples | None, after: Samples | None) -> dict[str, Any]:
    """Result fields for the counters present in both scrapes: ``eager_steps`` and ``eager_steps_by_reason``,
    ``padded_tokens``, ``cudagraph_steps`` and ``cudagraph_steps_by_kind_mode`` ({kind: {mode: steps}}),
    ``step_device_seconds``, ``front_end_backlog_steps``, ``spec_decode_accepted_tokens``, ``spec_decode_drafts``
    and ``spec_decode_accepted_tokens_per_pos`` with ``spec_decode_accepted_tokens_per_pos_by_position``
    ({position: tokens})."""
    if before is None or after is None:
        return {}
    out: dict[str, Any] = {}
    if not any(name in after for name, _ in TRACKED.values()):
        return out  # not a twogrid server
    for field, (name, labels) in TRACKED.items():
        if name not in after and field in LEFT_OUT_WHEN_ABSENT:
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
    return out
