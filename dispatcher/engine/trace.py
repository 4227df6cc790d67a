"""Step traces (``--step-trace FILE``): one JSON line per engine step (SPEC section 7)."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import IO, Any

from dispatcher.plan.dispatch import BATCH_KINDS, MODE_EAGER, MODE_FULL, MODE_PIECEWISE, UNIFORM_DECODE

_MODE_COLUMN = {MODE_FULL: "full", MODE_PIECEWISE: "piecewise", MODE_EAGER: "eager"}


class StepTally:
    """Steps per batch kind and mode, and their padding: the by_kind summary of simulate and replay."""

    def __init__(self):
        self.rows = {k: Counter() for k in BATCH_KINDS}

    def add(self, kind: str, mode: str, real_tokens: int, padded_tokens: int) -> None:
        row = self.rows[kind]
        row["steps"] += 1
        row[_MODE_COLUMN[mode]] += 1
        row["padded_tokens"] += padded_tokens - real_tokens

    def summary(self) -> dict[str, Any]:
        rows = self.rows.values()
        return {
            "steps": sum(r["steps"] for r in rows),
            "eager_steps": sum(r["eager"] for r in rows),
            "padded_tokens": sum(r["padded_tokens"] for r in rows),
            "by_kind": {k: {f: v[f] for f in ("steps", "full", "piecewise", "eager")} for k, v in self.rows.items()},
        }


def _brief(desc) -> dict[str, Any]:
    return {"mode": desc.mode, "padded_tokens": desc.num_tokens, "padded_requests": desc.num_reqs,
            "graph": list(desc.graph) if desc.graph is not None else None}


def step_record(step_id: int, out, desc, host_ms: float, device_ms: float, drafts=(),
                eager_reason: str | None = None, jit_compiles: int = 0, jit_ms: float = 0.0,
                k: int | None = None, fused: bool = False, not_captured=(),
                period_ms: float | None = None, stand_in_for=None) -> dict[str, Any]:
    """kind, requests, tokens, q (uniform decode) or query-length histogram, mode, padded tokens and requests, graph,
    host and device milliseconds; why it ran eagerly, when it did; with a model drafter, its forwards' descriptors under
    "draft"; Triton compiles the step waited for (``jit_compiles``, ``jit_ms``), when any; under ``"auto"`` tiers ``k``,
    the K of the step's tier (drafts proposed after it); ``admitted``, on a step that started requests, how many (their
    admission is on the path from a result to this step); with prefix caching, on a step that started requests,
    ``prefix_cache_queries`` and ``prefix_cache_hits`` (their tokens, and those of them found in the cache: the step
    computes the rest); ``"fused": true`` when the whole step ran as one graph (``dispatcher.runtime.decode_step``);
    under delayed capture ``"not_captured"``, the graphs the step ran without because they were not captured yet
    (``"step"``: its fused graph, so it ran op by op; ``"target"``, ``"draft"``, ``"draft_next"``: that forward ran
    eagerly) and ``"stand_in_for"``, the target's own graph where, not captured yet, a larger captured one stood in for
    it (``graph`` and the padded counts are the larger one's); ``period_ms``, the step's result after the last one's
    where it was queued behind that one (``EngineCore._period_ms``): above ``device_ms``, the GPU waited for the host.
    (The engine adds ``accepted``, on a step that verified drafts, the drafts its requests accepted, as the scheduler
    counts them: the step's output tokens are its sampling requests plus these; and ``constrained``, on a step with
    structured-output requests, how many of its rows a grammar's bitmask masks, and ``bitmask_wait_ms`` where the device
    waited inside the step for that bitmask, not counted in ``device_ms``.)"""
    rec: dict[str, Any] = {
        "step": step_id,
        "kind": desc.kind,
        "requests": out.shape.num_reqs,
        "tokens": out.shape.num_tokens,
        "is_decode": out.shape.is_decode,
    }
    if desc.q is not None:
        rec["q"] = desc.q
    else:
        rec["query_len_hist"] = {str(k): v for k, v in out.query_len_histogram().items()}
    rec.update(
        mode=desc.mode,
        padded_tokens=desc.num_tokens,
        padded_requests=desc.num_reqs,
        graph=list(desc.graph) if desc.graph is not None else None,
        host_ms=round(host_ms, 4),
        device_ms=round(device_ms, 4),
    )
    if period_ms is not None:
        rec["period_ms"] = round(period_ms, 4)
    if eager_reason is not None:
        rec["eager_reason"] = eager_reason
    if drafts:
        rec["draft"] = [_brief(d) for d in drafts]
    if jit_compiles:
        rec.update(jit_compiles=jit_compiles, jit_ms=round(jit_ms, 1))
    if k is not None:
        rec["k"] = k
    if out.new_requests:
        rec["admitted"] = len(out.new_requests)
    if out.prefix_cache_queries:
        rec.update(prefix_cache_queries=out.prefix_cache_queries, prefix_cache_hits=out.prefix_cache_hits)
    if fused:
        rec["fused"] = True
    if not_captured:
        rec["not_captured"] = list(not_captured)
    if stand_in_for is not None:
        rec["stand_in_for"] = list(stand_in_for)
    return rec


class TraceError(ValueError):
    pass


def check_step_records(records: list[Any], source: str) -> None:
    """TraceError naming the record and the field for one that is not a step record ``step_record`` writes: its
    kind and mode known, its counts positive integers, its query lengths (``q``, or a histogram) at least 1."""
    if not records:
        raise TraceError(f"{source} holds no step records")
    for i, rec in enumerate(records, 1):
        problem = _step_record_problem(rec)
        if problem is not None:
            raise TraceError(f"record {i} of {source} is not a step record: {problem}")


def _step_record_problem(rec: Any) -> str | None:
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object"
    modes = (MODE_FULL, MODE_PIECEWISE, MODE_EAGER)
    for field, want, ok in (("kind", f"one of {', '.join(BATCH_KINDS)}", lambda v: v in BATCH_KINDS),
                            ("mode", f"one of {', '.join(modes)}", lambda v: v in modes),
                            ("requests", "an integer >= 1", lambda v: _count(v, 1)),
                            ("tokens", "an integer >= requests", lambda v: _count(v, rec["requests"])),
                            ("padded_tokens", "an integer >= tokens (the graph's size, or tokens when eager)",
                             lambda v: _count(v, rec["tokens"]))):
        if not ok(rec.get(field)):  # (in order: each compared with the one before once that passed)
            return f"{field} must be {want}, got {rec[field]!r}" if field in rec else f"{field} is missing ({want})"
    if "k" in rec and not _count(rec["k"], 0):
        return f"k must be an integer >= 0 (the speculative tokens a request drafted), got {rec['k']!r}"
    if "q" in rec:
        if not _count(rec["q"], 1):
            return f"q must be an integer >= 1, got {rec['q']!r}"
        if rec["kind"] == UNIFORM_DECODE and rec["tokens"] != rec["requests"] * rec["q"]:
            return (f"a uniform decode's tokens must be requests x q = {rec['requests']} x {rec['q']}, got "
                    f"{rec['tokens']}")
        return None
    hist = rec.get("query_len_hist")
    if not (isinstance(hist, dict) and hist
            and all(k.isdigit() and int(k) >= 1 and _count(n, 1) for k, n in hist.items())):
        return f"query_len_hist must map query lengths >= 1 to counts >= 1 (or q be given), got {hist!r}"
    return None


def _count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


FLUSH_EVERY_S = 0.5
"""A step trace reaches its file at least this often while the engine runs (``tail -f`` follows it; a killed
server loses at most this much of it), not at every step (a write call a step at thousands of steps a second)."""


class TraceWriter:
    """Appends step records to a file (SPEC section 7: every step appends one record), each stamped with ``t_s``:
    seconds since the writer opened when the step's result came back (gaps between steps show as gaps in t_s)."""

    def __init__(self, path: str | None):
        self._t0 = time.perf_counter()
        self._flushed_s = 0.0
        try:
            self._fh: IO[str] | None = open(path, "a", encoding="utf-8") if path else None
        except OSError as exc:
            raise TraceError(f"step trace {path!r}: cannot open for appending ({exc.strerror})") from None

    @property
    def enabled(self) -> bool:
        """A file is open: records are written (the engine builds none otherwise)."""
        return self._fh is not None

    def stamped(self, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` with its ``t_s`` now (for a record written later)."""
        record["t_s"] = round(time.perf_counter() - self._t0, 6)
        return record

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is not None:
            if "t_s" not in record:
                self.stamped(record)
            self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
            if record["t_s"] - self._flushed_s >= FLUSH_EVERY_S:
                self._fh.flush()
                self._flushed_s = record["t_s"]

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_traces(paths: str, flag: str) -> list[Any]:
    """The records of step traces joined by commas, as a flag names them; ConfigError naming ``flag`` and the file
    for one that cannot be read or is not a trace."""
    from dispatcher.plan.config import ConfigError

    records: list[Any] = []
    for one in paths.split(","):
        try:
            records += read_trace(one)
        except OSError as exc:
            raise ConfigError(f"{flag}: cannot read {one!r}: {exc.strerror}") from None
        except TraceError as exc:
            raise ConfigError(f"{flag}: {exc}") from None
    return records


def read_trace(path: str) -> list[dict[str, Any]]:
    """The records of a step trace; TraceError naming the line for one that is not JSON."""
    records = []
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise TraceError(f"{path!r} line {number}: not UTF-8 text, so not a JSON step record") from None
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{path!r} line {number}: not a JSON step record ({exc.msg})") from None
    return records
