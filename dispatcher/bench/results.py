"""A run's timed requests as ``vllm bench serve``'s result fields, and its printed summary.

Same names and definitions as vLLM where the metric is the same: TTFT from sending to the first token event, TPOT
per request (e2e latency - TTFT) / (output tokens - 1) over requests with more than one token, ITL every gap
between token events, E2EL from sending to the last token event; throughputs over the run's wall time; the
``mean_``, ``median_``, ``std_`` and ``pXX_`` statistics in milliseconds, with numpy's percentile (linear).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dispatcher.bench.client import RequestOutput
from scheduler.scheduler import acceptance_rate_per_pos

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
DETAILED_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "generated_texts",
                   "errors")
"""Per-request lists, saved only with --save-detailed (vLLM's names)."""


def percentile_word(p: float) -> str:
    """99 -> '99', 99.9 -> '99.9' (vLLM's field suffix)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def source(flags: Sequence[bool], yes: str, no: str) -> str | None:
    if not flags:
        return None
    return yes if all(flags) else no if not any(flags) else "mixed"


def peak_concurrency(outputs: Sequence[RequestOutput]) -> int:
    """Most requests in flight at once (half-open [start, end) intervals)."""
    events = sorted([(o.start_time, 1) for o in outputs] + [(o.start_time + o.latency, -1) for o in outputs])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def compute_result(outputs: Sequence[RequestOutput], duration_s: float, percentile_metrics: Sequence[str],
                   percentiles: Sequence[float], detailed: bool = False) -> dict[str, Any]:
    """The result fields of one run. mean/median/std are written for all four latency metrics, the ``pXX_`` ones
    for ``percentile_metrics`` (vLLM writes all of them only for the selected metrics)."""
    ok = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_tokens for o in ok)
    values = {
        "ttft": [o.ttft for o in ok],
        "tpot": [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1],
        "itl": [x for o in ok for x in o.itl],
        "e2el": [o.latency for o in ok],
    }
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_concurrent_requests": peak_concurrency(ok),
        "input_tokens_source": source([o.prompt_len_from_usage for o in ok], "usage", "estimate"),
        "output_tokens_source": source([o.output_tokens_from_usage for o in ok], "usage", "chunks"),
    }
    for metric in PERCENTILE_METRICS:
        ms = np.asarray(values[metric] or [0.0]) * 1000.0
        result[f"mean_{metric}_ms"] = float(np.mean(ms))
        result[f"median_{metric}_ms"] = float(np.median(ms))
        result[f"std_{metric}_ms"] = float(np.std(ms))
        if metric in percentile_metrics:
            for p in percentiles:
                result[f"p{percentile_word(p)}_{metric}_ms"] = float(np.percentile(ms, p))
    if detailed:
        result.update(
            input_lens=[o.prompt_len for o in outputs],
            output_lens=[o.output_tokens if o.success else 0 for o in outputs],
            ttfts=[o.ttft for o in outputs],
            itls=[o.itl for o in outputs],
            latencies=[o.latency for o in outputs],
            start_times=[o.start_time for o in outputs],
            generated_texts=[o.generated_text for o in outputs],
            errors=[o.error for o in outputs],
        )
    return result


def ttft_by_turn(per_item: Sequence[Sequence[RequestOutput]]) -> dict[str, list[float | None]]:
    """Multi-turn runs (``per_item``: each conversation's turns in order): the median and mean TTFT of each turn
    over the conversations that completed it, ms (None where none did). A first turn has no earlier turn to find in
    a prefix cache; the later ones show what caching the history gave."""
    turns = max((len(item) for item in per_item), default=0)
    medians: list[float | None] = []
    means: list[float | None] = []
    for t in range(turns):
        ms = [item[t].ttft * 1e3 for item in per_item if len(item) > t and item[t].success]
        medians.append(round(float(np.median(ms)), 2) if ms else None)
        means.append(round(float(np.mean(ms)), 2) if ms else None)
    return {"median_ttft_ms_by_turn": medians, "mean_ttft_ms_by_turn": means}


def cache_by_turn(per_item: Sequence[Sequence[RequestOutput]]) -> dict[str, list]:
    """Multi-turn runs: each turn's prompt tokens over the conversations that completed it, and the share of them
    the server found in its prefix cache (its ``usage.prompt_tokens_details.cached_tokens``, over the requests that
    report it; None where none did). A later turn that finds little of its history was evicted before it came back:
    the conversations' KV did not fit the cache together."""
    turns = max((len(item) for item in per_item), default=0)
    prompt_tokens: list[int] = []
    hit_rates: list[float | None] = []
    for t in range(turns):
        done = [item[t] for item in per_item if len(item) > t and item[t].success]
        prompt_tokens.append(sum(o.prompt_len for o in done))
        reported = [o for o in done if o.cached_tokens is not None]
        asked = sum(o.prompt_len for o in reported)
        hit_rates.append(round(sum(o.cached_tokens for o in reported) / asked, 4) if asked else None)
    return {"prompt_tokens_by_turn": prompt_tokens, "prefix_cache_hit_rate_by_turn": hit_rates}


def _row(name: str, value: Any, fmt: str = "") -> str:
    return f"{name:<40} {value:{fmt}}"


def summary_lines(result: dict[str, Any], percentile_metrics: Sequence[str],
                  percentiles: Sequence[float]) -> list[str]:
    """vLLM's printed summary of one run, then the server's counters when it exported them."""
    lines = ["{:=^50}".format(" Serving Benchmark Result "),
             _row("Successful requests:", result["completed"]),
             _row("Failed requests:", result["failed"])]
    if result.get("max_concurrency") is not None:
        lines.append(_row("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate") not in (None, "inf"):
        lines.append(_row("Request rate configured (RPS):", result["request_rate"], ".2f"))
    in_note = {"usage": "", "estimate": " (estimated)", "mixed": " (partly estimated)"}.get(
        result["input_tokens_source"], "")
    out_note = {"usage": "", "chunks": " (stream events counted)", "mixed": " (partly events counted)"}.get(
        result["output_tokens_source"], "")
    lines += [_row("Benchmark duration (s):", result["duration"], ".2f"),
              _row(f"Total input tokens{in_note}:", result["total_input_tokens"]),
              _row(f"Total generated tokens{out_note}:", result["total_output_tokens"]),
              _row("Request throughput (req/s):", result["request_throughput"], ".2f"),
              _row("Output token throughput (tok/s):", result["output_throughput"], ".2f"),
              _row("Peak concurrent requests:", result["max_concurrent_requests"]),
              _row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")]
    for metric in PERCENTILE_METRICS:
        if metric not in percentile_metrics:
            continue
        short, header = METRIC_NAMES[metric]
        lines += ["{:-^50}".format(header),
                  _row(f"Mean {short} (ms):", result[f"mean_{metric}_ms"], ".2f"),
                  _row(f"Median {short} (ms):", result[f"median_{metric}_ms"], ".2f")]
        lines += [_row(f"P{percentile_word(p)} {short} (ms):", result[f"p{percentile_word(p)}_{metric}_ms"], ".2f")
                  for p in percentiles]
    if result.get("median_ttft_ms_by_turn"):
        lines.append(_row("Median TTFT by turn (ms):", " / ".join("-" if v is None else f"{v:.1f}"
                                                                  for v in result["median_ttft_ms_by_turn"])))
    if any(v is not None for v in result.get("prefix_cache_hit_rate_by_turn") or ()):
        lines.append(_row("Prefix cache hit rate by turn:", " / ".join(
            "-" if v is None else f"{v:.0%}" for v in result["prefix_cache_hit_rate_by_turn"])))
    if "eager_steps" in result or "cudagraph_steps" in result or "padded_tokens" in result:
        lines.append("{:-^50}".format("Server counters (this run)"))
        if "cudagraph_steps" in result:
            lines.append(_row("Graph steps:", result["cudagraph_steps"]))
            for kind, modes in result.get("cudagraph_steps_by_kind_mode", {}).items():
                for mode, steps in modes.items():
                    lines.append(_row(f"  {kind} {mode}:", steps))
        if "eager_steps" in result:
            lines.append(_row("Eager steps:", result["eager_steps"]))
            for reason, steps in result.get("eager_steps_by_reason", {}).items():
                lines.append(_row(f"  {reason}:", steps))
        if "padded_tokens" in result:
            lines.append(_row("Padded tokens:", result["padded_tokens"]))
        if result.get("front_end_backlog_steps"):
            lines.append(_row("Front-end backlog steps:", result["front_end_backlog_steps"]))
    if result.get("prefix_cache_hit_rate") is not None:  # (the server's prefix cache, in tokens)
        lines += ["{:-^50}".format("Prefix Cache"),
                  _row("Queried tokens:", result["prefix_cache_queries"]),
                  _row("Hit tokens:", result["prefix_cache_hits"]),
                  _row("Hit rate (%):", 100 * result["prefix_cache_hit_rate"], ".2f")]
    if result.get("spec_decode_num_drafts"):  # from the server's speculative-decoding counters
        drafts = result["spec_decode_num_drafts"]
        lines += ["{:-^50}".format("Speculative Decoding"),
                  _row("Acceptance rate (%):", 100 * result["spec_decode_num_accepted_tokens"]
                       / max(1, result["spec_decode_num_draft_tokens"]), ".2f"),
                  _row("Acceptance length:", result["mean_acceptance_length"], ".2f"),
                  _row("Drafts:", drafts),
                  _row("Draft tokens:", result["spec_decode_num_draft_tokens"]),
                  _row("Accepted tokens:", result["spec_decode_num_accepted_tokens"]),
                  "Per-position acceptance (%):"]
        lines += [_row(f"  Position {j}:", 100 * rate, ".2f")
                  for j, rate in enumerate(acceptance_rate_per_pos(drafts, result["spec_decode_accepted_per_pos"]))]
    lines.append("=" * 50)
    return lines
