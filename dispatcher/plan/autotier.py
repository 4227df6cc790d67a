"""Speculative tiers chosen automatically (``"num_speculative_tokens_per_batch_size": "auto"``).

The decision is pure and deterministic (no torch, no clock): given

- a step-cost table: ms per uniform decode step by (requests n, q = 1 + K), the drafter's forwards included, K = 0
  being a plain q = 1 step with no drafter at all (``StepCostTable``; linear between measured request counts, flat
  below the smallest, the last segment extended above the largest), and
- the acceptance per draft position: p_j, the share of verify events that accepted more than j drafts (vLLM's
  per-position counters), so that a request verifying K drafts yields 1 + sum_{j<K} p_j tokens a step,

it gives each batch size n the K among the candidates that maximizes the expected output tokens per second,
n * (1 + sum_{j<K} p_j) / step_ms(n, 1 + K), K allowed at n only where its q's costs (in the engine: its captured
FULL decode graphs) reach n; where none reaches, the smallest candidate; K falls as n grows and may rise again
(``valley``). Equal neighbours merge into tiers, returned in the configuration's ``[[min_batch, K], ...]`` form
(``TierChooser``).

At runtime ``AutoTiers`` re-chooses every ``RECHOOSE_INTERVAL_STEPS`` steps (and as soon as a K's switch-in steps
at a bucket have measured its served cost there: a K tried is judged at once) from the scheduler's counters: the
first position's acceptance, and each later position's given the one before it (its drafts accepted over the events
that reached it: verified it with every draft before it accepted), in a window whose counts halve in weight every
``WINDOW_HALF_LIFE_STEPS`` steps while steps verify the position, smoothed towards the prior with ``PRIOR_WEIGHT``
pseudo events (``estimate_acceptance``: a position reached by few events keeps the prior's ratio to the position
before it, so deep positions follow the first one when only a shallow tier runs; one measured before keeps its
measured ratio while no step reaches it). Hysteresis: a batch size changes its K only when the new K beats the one
in force there by more than ``HYSTERESIS``.

The table's costs are graph replays over empty contexts (no attention work, no prefills riding along); served steps
cost more, and not by the same factor at every q (on the H200 with the default model a K = 3 step measured 1.5x a
plain one in the table and 1.9x served at 16-256 streams). So ``AutoTiers`` also takes each served uniform decode
step's device time (``observe_step``) and keeps, per (K, batch-size bucket of powers of two), the ratio of served to
table cost as K's own factor times the bucket's drift (``MeasuredCosts``); each choice weighs the table's cost times
that ratio. The drift, which grows with the contexts through a run, follows every K that runs there; a K's own
factor is learnt once, over its first ``SWITCH_IN_STEPS`` steps at a bucket, and a bucket left unserved for long has
its drift re-anchored by its next step. A (K, bucket) never served is weighed at the least its step can cost given
the K's served there: its table cost plus each served K's overhead (served less table, in ms) times min(1, q' / q),
all of it for a K that drafts more, a share in proportion to the query rows for one that drafts less (an overhead
that grows with q, at most in proportion: the contexts' attention and the step's host work), so drafting less is
still tried where even that beats the K in force, measured where it runs (``by_batch``). (On the H200 at 16 streams,
where untried K's were weighed at factor 1 beside a served K = 3 at ~1.9, the tiers there moved among K = 2 to 5 and
ran 0.92x of fixed K = 3; weighed at the smaller K's factor, they priced the deeper K's high wherever the contexts'
attention made the overhead; with smaller K's at factor 1, 82f4592, one smaller K after another was tried and found
dear at every bucket, 0.91-0.96x the best fixed K.)
(With one ratio per (K, bucket), updated by its own steps only, a K measured early at short contexts looked cheaper
than the K in force at long ones: on the H200 at 1024 streams eagle3's tiers went from K = 2 (1.20x no SD) to K = 0
(0.99x) at a round's tail. With the drift held whenever a K came back to a bucket, two K's sharing it by turns never
moved it, and a K never served there looked ever cheaper: the same flip, 0.90x in a round.)

Where the host sets the pace (the GPU idle between steps: at 1024 streams of the default model on the H200 it was
busy 56% of a run without drafting, and a fixed K = 3 gave 1.26-1.30x no SD where device costs alone chose K = 0 or
1), each step's period, its result after the one before, exceeds its device time; ``HostFloor`` keeps what the host
needs a step per bucket, and a K's step is weighed at its device cost or that floor, whichever is longer, so a K
that yields more tokens a step for device time that hides behind the host's is chosen there. At a bucket whose pace
no step has shown yet (no floor weighs there, and fewer than ``PACE_KNOWN_STEPS`` steps ran there), K's within
``UNPACED_NEAR_TIE`` of the best count as tied and the tie goes to the larger K: a floor, once measured, can only
favour it, and without one the loss is the tie's margin (on the H200 at 256 streams of the default model, device
costs alone put K = 2, 3 and 4 within 0.5% at a bucket no step had reached; the tiers ran K = 2 for ~400 steps
until the bucket's floor, 3.3 ms a step, made K = 4 win, and ran 0.95x of fixed K = 4).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from dispatcher.plan.capture_plan import (BLOCK_DRAFTERS, FUSED_STEP, ONE_TOKEN_DRAFTERS, block_query_len,
                                          next_steps_runner, one_token_steps)
from dispatcher.plan.acceptance import PRIOR_WEIGHT, estimate_acceptance, expected_tokens
from dispatcher.plan.errors import ConfigError, check_known_fields

RECHOOSE_INTERVAL_STEPS = 64
"""Engine steps between two re-choices."""
HYSTERESIS = 0.05
"""A batch size changes its K only for more than 5 % more expected tokens per second."""
SWITCH_IN_STEPS = 16
"""A K's first steps at a batch-size bucket, whose median (against the drift) is its own cost factor there."""
DRIFT_MEMORY_STEPS = 16.0
"""Steps a bucket's cost drift averages over (an exponential average: contexts grow by a token a step)."""
STALE_STEPS = 256
"""A bucket nothing was served at in this many steps has an old drift: the next step re-anchors it."""
COST_RATIO_BOUNDS = (0.25, 8.0)
"""A served step's ratio to its table cost is clipped to these (a step that waited for a kernel's compile)."""
HOST_FLOOR_MIN_STEPS = 4
"""Host-bound steps a bucket needs before its floor weighs (one stalled step, a collection or a burst of
admissions, is no pace)."""
HOST_FLOOR_MAX_RATIO = 4.0
"""A host-bound step's period weighs at most this many times its device time."""
HOST_BOUND_MIN_SHARE = 0.5
"""A bucket's floor weighs only while at least this share of the steps that tested it was host-bound (an average
over DRIFT_MEMORY_STEPS steps; a step tests the floor when it was host-bound or its device time was below the
floor): where the device sets the pace of most steps, the stragglers that waited on the host measure a floor about
the running K's own step time, and weighing it would cost a shorter K as much as the running one (at 16 streams of
the default model on the H200, GPU busy 94%, auto tiers chose K = 5 over K = 3 and ran 0.96x of it)."""
PACE_KNOWN_STEPS = 16
"""Served steps at a batch-size bucket after which its pace is known: without HOST_FLOOR_MIN_STEPS host-bound ones
among them, the device sets it."""
UNPACED_NEAR_TIE = 0.01
"""At a bucket whose pace is not known yet, K's within this share of the best expected tokens/s count as tied, and
the tie goes to the larger K."""
HOST_BOUND_SLACK = 0.15
"""A served step whose period (its result after the one before) exceeds its device time by more than this share
waited on the host side: its period is what the host needs a step (``HostFloor``)."""
WINDOW_HALF_LIFE_STEPS = 128
"""Steps after which a count weighs half: the acceptance is that of the last few hundred steps. When nothing is
verified for a while (every tier at K = 0), the first position's estimate returns to the prior, and drafting is tried
again. A later position fades only while steps verify it: while a shallow K runs, its rate given the position before
stays what was measured (on bench-moe with acceptance fixed at 0.69 a draft, the prior's 0.6 makes K = 3 look 6%
poorer than it is: about the margin by which the tiers settled on K = 1 at 1024 streams where fixed K = 3 ran 3%
faster, 3bde152)."""


# ----------------------------------------------------------------------------------------------------------
# Step costs by (requests, q)
# ----------------------------------------------------------------------------------------------------------


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _is_ms(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _interp(points: Sequence[tuple[int, float]], n):
    """ms at n (int or array) through (requests, ms) points: linear between them, flat below the first, the last
    segment extended above the last (a single point: flat)."""
    xs = np.array([p[0] for p in points], np.float64)
    ys = np.array([p[1] for p in points], np.float64)
    x = np.asarray(n, np.float64)
    y = np.interp(x, xs, ys)
    if len(xs) >= 2:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        y = np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), y)
    y = np.maximum(y, ys.min() * 1e-3)
    return float(y) if np.ndim(y) == 0 else y


class StepCostTable:
    """ms per uniform decode step by q and request count; the JSON form is ``{"decode_step_ms": {"q": [[requests,
    ms], ...], ...}}`` (what the engine caches under $TWOGRID_CACHE/spec_cost, and ``plan --auto-tiers`` reads)."""

    def __init__(self, by_q: Mapping[int, Iterable[tuple[int, float]]], source: str = ""):
        self.by_q: dict[int, tuple[tuple[int, float], ...]] = {}
        for q, points in sorted(by_q.items()):
            pts = tuple(sorted((int(n), float(ms)) for n, ms in points))
            if pts:
                self.by_q[int(q)] = pts
        self.source = source

    def ms(self, num_reqs, q: int):
        """ms of a uniform decode of ``num_reqs`` (an int or an array) requests at q; KeyError without costs at q."""
        return _interp(self.by_q[q], num_reqs)

    def reach(self, q: int) -> int:
        """The largest request count measured at q (0: none)."""
        points = self.by_q.get(q)
        return points[-1][0] if points else 0

    def to_json(self) -> dict[str, Any]:
        return {"decode_step_ms": {str(q): [[n, round(ms, 5)] for n, ms in pts] for q, pts in self.by_q.items()}}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "StepCostTable":
        """From ``to_json``'s form; ConfigError naming ``where`` and the entry otherwise."""
        if not isinstance(data, dict) or "decode_step_ms" not in data:
            raise ConfigError(f"{where}: not a step-cost table {{\"decode_step_ms\": {{\"q\": [[requests, ms], ...]}}}}"
                              f" (nor step traces: .jsonl)")
        check_known_fields(data, ("decode_step_ms", "key", "source"), where)  # (the last two: the server's cache's)
        table = data["decode_step_ms"]
        if not isinstance(table, dict) or not table:
            raise ConfigError(f"{where}: \"decode_step_ms\" must map q to [[requests, ms], ...] lists")
        by_q: dict[int, list[tuple[int, float]]] = {}
        for key, points in table.items():
            try:
                q = int(key)
            except ValueError:
                q = 0
            if q < 1:
                raise ConfigError(f"{where}: decode_step_ms key {key!r} is not a query length q >= 1")
            if not isinstance(points, list) or not points:
                raise ConfigError(f"{where}: decode_step_ms[{key!r}] must be a non-empty list of [requests, ms]")
            for i, point in enumerate(points):
                if not (isinstance(point, list) and len(point) == 2 and _is_count(point[0]) and _is_ms(point[1])):
                    raise ConfigError(f"{where}: decode_step_ms[{key!r}][{i}] = {point!r} is not [requests >= 1, "
                                      f"ms > 0]")
            counts = [p[0] for p in points]
            if len(set(counts)) != len(counts):
                raise ConfigError(f"{where}: decode_step_ms[{key!r}] lists a request count more than once")
            by_q[q] = [(p[0], float(p[1])) for p in points]
        return cls(by_q, where)


def trace_step_costs(records: Iterable[Any], where: str) -> StepCostTable:
    """Step costs from step traces of a real run: the median device time of the FULL uniform decodes at each (q,
    padded requests) (a step's whole device time: the target, the drafter and sampling)."""
    points: dict[int, dict[int, list[float]]] = {}
    for rec in records:
        if (isinstance(rec, dict) and rec.get("kind") == "uniform_decode" and rec.get("mode") == "FULL"
                and _is_count(rec.get("q")) and _is_count(rec.get("padded_requests")) and _is_ms(rec.get("device_ms"))):
            points.setdefault(rec["q"], {}).setdefault(rec["padded_requests"], []).append(float(rec["device_ms"]))
    if not points:
        raise ConfigError(f"{where}: the step traces hold no FULL uniform decode with a device time")
    return StepCostTable({q: [(n, statistics.median(v)) for n, v in by_n.items()] for q, by_n in points.items()},
                         where)


def trace_host_floor(records: Iterable[Any], chooser: "TierChooser") -> "HostFloor":
    """The host floor (``HostFloor``) the served steps of step traces give: each FULL uniform decode's device time
    and period (``period_ms``), in the traces' order; traces without periods give none."""
    floor = HostFloor(chooser)
    for rec in records:
        if (isinstance(rec, dict) and rec.get("kind") == "uniform_decode" and rec.get("mode") == "FULL"
                and _is_count(rec.get("padded_requests")) and _is_ms(rec.get("device_ms"))
                and _is_ms(rec.get("period_ms"))):
            floor.observe(rec["padded_requests"], float(rec["device_ms"]), float(rec["period_ms"]))
    return floor


def decode_step_costs(method: str | None, candidates: Sequence[int],
                      tables: Mapping[str, Mapping[int, Sequence[tuple[int, float]]]],
                      source: str = "") -> StepCostTable:
    """A step's cost per candidate K from each runner's measured FULL decode replay times (``tables[runner][q]``:
    (requests, ms) points): where fused decode steps were timed (``tables[FUSED_STEP]``: the whole step, target,
    drafter and the glue between them, in one graph), those; else the target at q = 1 + K, plus the drafter's
    forwards: an EAGLE-style drafter's or a draft model's step 0 at q (every step, K = 0 too) and for K >= 1 its
    one-token steps (``one_token_steps``) at q = 1, a block drafter's forward at its q for K >= 1. A drafter forward
    with no measured graphs (disabled) adds nothing."""
    target, fused = tables.get("target", {}), tables.get(FUSED_STEP, {})
    by_q: dict[int, list[tuple[int, float]]] = {}
    for k in candidates:
        q = 1 + k
        if fused.get(q):
            by_q[q] = sorted(fused[q])
            continue
        points = target.get(q)
        if not points:
            continue
        extra: list[tuple[float, Sequence[tuple[int, float]]]] = []
        if method in ONE_TOKEN_DRAFTERS:  # step 0 on every step (K = 0 too: the drafter's KV), then one-token steps
            extra.append((1.0, tables.get(method, {}).get(q, ())))
            if k:
                extra.append((float(one_token_steps(method, k)), tables.get(next_steps_runner(method), {}).get(1, ())))
        elif k and method in BLOCK_DRAFTERS:
            extra.append((1.0, tables.get(method, {}).get(block_query_len(method, k), ())))
        pts = sorted(points)
        by_q[q] = [(n, ms + sum(times * _interp(sorted(p), n) for times, p in extra if p and times))
                   for n, ms in pts]
    return StepCostTable(by_q, source)


# ----------------------------------------------------------------------------------------------------------
# The decision
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierChoice:
    """Tiers chosen for one acceptance: ``tiers`` in the configuration's form ((min_batch, K), ...)."""

    tiers: tuple[tuple[int, int], ...]
    k_of_batch: np.ndarray
    """K for n requests, n in 0..max_num_seqs (entry 0 = entry 1)."""
    acceptance: tuple[float, ...]
    cost_ratio: np.ndarray | None = None
    """(candidates, n) the served-to-table cost ratios the choice weighed (None: the table's costs alone)."""
    floor_ms: np.ndarray | None = None
    """(n,) the host's time a step the choice weighed (None: none)."""

    def resolved(self, max_num_seqs: int) -> tuple[tuple[int, int, int], ...]:
        """(min_batch, max_batch, K) per tier, the scheduler's form."""
        return tuple((lo, (self.tiers[i + 1][0] - 1) if i + 1 < len(self.tiers) else max_num_seqs, k)
                     for i, (lo, k) in enumerate(self.tiers))

    def as_config(self) -> list[list[int]]:
        return [[lo, k] for lo, k in self.tiers]

    def text(self) -> str:
        return "[" + ", ".join(f"[{lo}, {k}]" for lo, k in self.tiers) + "]"


INVALID = -1e9
"""The score of a K at a batch size it cannot run (beyond its graphs): below any real one, finite for the sums."""


def staircase(score: np.ndarray) -> np.ndarray:
    """For a (candidates, n) score matrix, candidates in increasing K: the candidate index per column, never rising
    from one column to the next, that maximizes the total score; ties go to the smaller K (``_staircase``)."""
    return _staircase(score)[0]


def _staircase(score: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``staircase`` and the best total of every prefix of the columns (index m: columns 0..m-1). A dynamic program over
    the candidates, from the largest K (the first columns) down, each step a few array operations over the columns:
    best[i][n], the best total of columns 1..n using candidates K_max..K_i, is the best of best[i + 1][n] and,
    for the last run of candidate i over columns m+1..n, max over m <= n of best[i + 1][m] + S_i[n] - S_i[m]
    (S_i the prefix sums of row i): a running maximum."""
    num, width = score.shape
    order = list(range(num - 1, -1, -1))  # largest K first: it takes the first columns
    prefix = np.concatenate((np.zeros((num, 1)), np.cumsum(score, axis=1)), axis=1)  # (num, width + 1)
    best = np.full(width + 1, -np.inf)
    best[0] = 0.0
    cols = np.arange(width + 1)
    starts, takes = [], []
    for i in order:
        arr = best - prefix[i]
        running = np.maximum.accumulate(arr)
        new_max = arr > np.concatenate(([-np.inf], running[:-1]))
        start = np.maximum.accumulate(np.where(new_max, cols, 0))  # the earliest m reaching the running max
        run = prefix[i] + running
        take = run >= best  # (ties: the smaller K, this one)
        starts.append(start)
        takes.append(take)
        best = np.where(take, run, best)
    out = np.empty(width, np.int64)
    n, step = width, num - 1
    while n > 0:
        i = order[step]
        if takes[step][n]:
            m = int(starts[step][n])
            out[m:n] = i
            n = m
        step -= 1
    return out, best


def valley(score: np.ndarray) -> np.ndarray:
    """Like ``staircase``, but the candidate may rise again after it fell: falling over the first columns, then
    never falling, whichever split maximizes the total score (on equal totals the fewest rising columns, so the
    staircase itself where rising gains nothing). Drafting pays at small batches, where the device has room, and
    again at large ones where the host sets each step's pace (``HostFloor``). The best falling total of every
    prefix and the best rising total of every suffix are two staircases' (the second over the columns reversed)."""
    width = score.shape[1]
    fall, down = _staircase(score)
    up = _staircase(score[:, ::-1])[1]  # up[j]: the last j columns, never falling
    totals = down + up[::-1]  # split m: columns :m fall, m: rise
    m = int(np.nonzero(totals >= totals.max() - 1e-9 * max(1, width))[0][-1])  # (scores are at most ~1 a column)
    if m == width:
        return fall
    return np.concatenate((staircase(score[:, :m]), staircase(score[:, m:][:, ::-1])[::-1]))


def merge_tiers(k_of_batch: np.ndarray) -> tuple[tuple[int, int], ...]:
    """((min_batch, K), ...) from K per batch size 1..max (entry 0 ignored): equal neighbours merged."""
    ks = k_of_batch[1:]
    starts = np.concatenate(([0], np.nonzero(np.diff(ks))[0] + 1))
    return tuple((int(s) + 1, int(ks[s])) for s in starts)


class TierChooser:
    """The decision for one cost table, candidate set and batch limit; the cost of every (K, n) is computed once, so
    a choice is a few array operations."""

    def __init__(self, costs: StepCostTable, candidates: Sequence[int], max_num_seqs: int,
                 reach: Mapping[int, int] | None = None):
        """``reach[K]``: the largest batch K may be chosen at (in the engine: its q's largest captured FULL decode
        graph); never past the largest request count the table measured at q (no extrapolation) or max_num_seqs."""
        self.costs, self.max_num_seqs = costs, max_num_seqs
        self.candidates = tuple(sorted(set(candidates)))
        if not self.candidates:
            raise ValueError("auto tiers need at least one candidate K")
        limit = dict(reach) if reach is not None else {}
        self.reach = {k: max(0, min(limit.get(k, max_num_seqs), costs.reach(1 + k), max_num_seqs))
                      for k in self.candidates}
        self.fallback = self.candidates[0]
        self.index = {k: i for i, k in enumerate(self.candidates)}
        """K -> its row among the candidates."""
        self._candidate_index = np.full(max(self.candidates) + 1, -1, np.int64)
        """``index`` as an array over 0..max K (-1: not a candidate), for a whole table of K's at once."""
        self._candidate_index[list(self.index)] = list(self.index.values())
        n = np.arange(max_num_seqs + 1, dtype=np.float64)
        self.ms = np.full((len(self.candidates), max_num_seqs + 1), np.inf)
        for i, k in enumerate(self.candidates):
            top = self.reach[k]
            if top >= 1:
                self.ms[i, 1 : top + 1] = costs.ms(n[1 : top + 1], 1 + k)
        self.valid = np.isfinite(self.ms)
        self._n = n
        self.num_buckets = (max(max_num_seqs, 1) - 1).bit_length() + 1
        """Batch-size buckets the served costs are kept by (``MeasuredCosts``, ``HostFloor``): ``bucket_of``."""
        self.bucket_of = np.zeros(max_num_seqs + 1, np.int64)
        """Each batch size's bucket (entry 0 unused): bucket b holds the padded request counts above 2^(b-1) up to
        2^b (1, 2, 3-4, 5-8, ..., 513-1024), so that a power of two shares its bucket with the counts just below
        it. The batch at N concurrent streams hovers at and a little below N (a request ends, the next one arrives a
        step or more later: held by the admission wait), and N is a power of two in most deployments and
        benchmarks: with buckets starting at the powers (1, 2-3, 4-7, ...) its steps fell in two buckets with
        their own measured costs and host floors, and the tiers split there, K at N other than just below it (on
        the H200 at c506f82, default model: ``[[563, 1], [1024, 3]]`` at 1024 streams, ``[[256, 1], [512, 3]]`` at
        256, ``[[4, 4], [16, 3]]`` at 16), a batch crossing the border every few steps."""
        self.bucket_of[1:] = [(n - 1).bit_length() for n in range(1, max_num_seqs + 1)]
        ends = [np.searchsorted(self.bucket_of[1:], np.arange(self.num_buckets), side).tolist()
                for side in ("left", "right")]
        self.bucket_spans = [(lo + 1, hi) for lo, hi in zip(*ends)]
        """Each bucket's smallest and largest batch size (``bucket_of`` rises with the batch size)."""

    def step_ms(self, cost_ratio: np.ndarray | None = None, floor_ms: np.ndarray | None = None) -> np.ndarray:
        """(candidates, 0..max_num_seqs) each K's step as a choice weighs it: the table's ms, times ``cost_ratio``
        (same shape) if given, no shorter than ``floor_ms`` (per batch size) if given; inf where K cannot run."""
        ms = self.ms if cost_ratio is None else self.ms * cost_ratio
        return ms if floor_ms is None else np.maximum(ms, floor_ms[None, :])

    def throughput(self, acceptance: Sequence[float], cost_ratio: np.ndarray | None = None,
                   floor_ms: np.ndarray | None = None) -> np.ndarray:
        """Expected output tokens per second for each candidate (rows) and batch size (columns, 0..max_num_seqs):
        n * (1 + sum_{j<K} p_j) / step_ms(n, 1 + K) * 1000, the step's ms times ``cost_ratio`` (same shape) if
        given, and no less than ``floor_ms`` (per batch size: what the host needs a step) if given; -inf where K
        cannot run n on its graphs."""
        tokens = np.array([expected_tokens(acceptance, k) for k in self.candidates])[:, None]
        ms = self.step_ms(cost_ratio, floor_ms)
        with np.errstate(divide="ignore", invalid="ignore"):
            tps = np.where(self.valid, self._n[None, :] * tokens / ms * 1e3, -np.inf)
        return tps

    def choose(self, acceptance: Sequence[float], current: np.ndarray | None = None,
               hysteresis: float = 0.0, cost_ratio: np.ndarray | None = None,
               floor_ms: np.ndarray | None = None, unpaced: np.ndarray | None = None) -> TierChoice:
        """K for every batch size, merged into tiers. Each batch size n scores each K by its expected tokens/s over
        the best K's there (1 for the best); K may only fall as n grows, then rise again where the host sets the
        pace (a valley: measured costs are noisy, and a per-size argmax would split a range into many tiers over
        differences of a fraction of a percent); the valley with the highest total score wins (``valley``), ties
        going to the smaller K and to fewer rising batch sizes. With ``current`` (K
        per batch size, a TierChoice's ``k_of_batch``) the K in force at n scores ``1 + hysteresis`` times more, so
        that it changes only for a K that beats it there by more than that (or where it can no longer run).
        ``cost_ratio``: served-to-table step costs (``MeasuredCosts.by_batch``); ``floor_ms``: the host's time a
        step (``HostFloor.by_batch``); ``unpaced``: per batch size, True where no step has shown the pace yet
        (``HostFloor.unpaced_by_batch``): there the K's within UNPACED_NEAR_TIE of the best tie, and the larger wins."""
        tps = self.throughput(acceptance, cost_ratio, floor_ms)
        best = tps.max(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            score = np.where(np.isfinite(tps) & (best > 0), tps / best, 0.0)
        if unpaced is not None:
            tied = unpaced[None, :] & (score >= 1.0 - UNPACED_NEAR_TIE)
            rank = np.arange(len(self.candidates), dtype=np.float64)[:, None]
            score = np.where(tied, 1.0 + 1e-6 * rank, score)  # (far below any margin; above the staircase's ties)
        score = np.where(np.isfinite(tps), score, INVALID)
        if current is not None:
            cur_i = self._candidate_index[np.clip(current, 0, len(self._candidate_index) - 1)]
            cur_i[(current < 0) | (current >= len(self._candidate_index))] = -1
            cols = np.nonzero(cur_i >= 0)[0]
            rows = cur_i[cols]
            ok = np.isfinite(tps[rows, cols])
            score[rows[ok], cols[ok]] *= 1.0 + hysteresis
        k_of = np.full(self.max_num_seqs + 1, self.fallback, np.int64)  # (past every K's reach: the smallest K)
        reach = int(np.nonzero(np.isfinite(tps).any(axis=0))[0].max(initial=0))
        if reach:
            k_of[1:reach + 1] = np.array(self.candidates)[valley(score[:, 1:reach + 1])]
        k_of[0] = k_of[1] if self.max_num_seqs >= 1 else 0
        return TierChoice(merge_tiers(k_of), k_of, tuple(float(p) for p in acceptance), cost_ratio, floor_ms)

    def explain(self, choice: TierChoice) -> list[dict[str, Any]]:
        """Per chosen tier: its batch range, its K, and each candidate's expected tokens/s at the range's ends (None
        where the candidate cannot run there)."""
        tps = self.throughput(choice.acceptance, choice.cost_ratio, choice.floor_ms)
        rows = []
        for lo, hi, k in choice.resolved(self.max_num_seqs):
            per_k = {}
            for i, c in enumerate(self.candidates):
                ends = [tps[i, lo], tps[i, hi]]
                per_k[c] = [round(float(v), 1) if np.isfinite(v) else None for v in ends]
            rows.append({"min_batch": lo, "max_batch": hi, "k": k, "tokens_per_s": per_k})
        return rows


class MeasuredCosts:
    """Served uniform decode steps' device time over the table's cost of the same (requests, q), per candidate K and
    batch-size bucket (``TierChooser.bucket_of``: 1, 2, 3-4, 5-8, ... padded requests), as K's own
    factor times the bucket's drift: ``ratio`` = ``own`` x ``drift``. The drift is what every K's served cost shares
    and moves with (contexts grow through a run and start short at the next): every step of a K whose own factor is
    known moves it. A K's own factor is learnt once a bucket, from its first ``SWITCH_IN_STEPS`` steps there (the
    median of their ratios over the drift, which the other K's running there keep moving, or which it holds
    meanwhile: a step that waited, for a kernel's compile say, does not move it), and kept: a K that comes back
    moves the drift at once. At a bucket nothing ran at for ``STALE_STEPS`` steps the drift is old (the contexts were
    other): there a K's first step sets the drift from its own factor (that of the K served there last, where it
    was never served there), and nothing is learnt about own factors.

    So a K measured long ago, at other contexts, is compared at today's, and two K's that share a bucket (tiers that
    split it, a batch that moves across their border) both keep its drift moving: with the drift held whenever a K
    came back (30997fb: each return learnt its own factor again), each K's own factor took the contexts' growth, and
    a K never served there kept its factor of 1 and looked ever cheaper (on the H200 at 1024 streams eagle3's tiers
    went to K = 0 at 873 requests and up, 0.90x no SD in a round where K = 3 gave 1.27x). A K never served at a bucket
    is weighed at the least its step can cost given the K's served there (``by_batch``)."""

    def __init__(self, chooser: TierChooser):
        self.chooser = chooser
        self.index = chooser.index
        num, buckets = len(chooser.candidates), chooser.num_buckets
        # Python lists, not arrays: ``observe`` runs on every served step, and a list's scalars cost a fraction of
        # an array's (``own``, ``drift`` and ``steps`` are their array views, for a choice).
        self._own = [[1.0] * buckets for _ in range(num)]
        self._drift = [1.0] * buckets
        self._steps = [[0] * buckets for _ in range(num)]
        self._window = [[0] * buckets for _ in range(num)]
        self._switch_in: list[list[list[float]]] = [[[] for _ in range(buckets)] for _ in range(num)]
        """Per (K, bucket), while its switch-in steps run: each one's ratio over the drift (its own factor is their
        median)."""
        self._clock = 0
        self._last_clock = [-1] * buckets
        """The clock (observed steps) at each bucket's last step (-1: none yet)."""
        self._last_k = [0] * buckets
        """The candidate index of each bucket's last step."""
        self._bucket_of = chooser.bucket_of.tolist()
        self._table_ms = chooser.ms.tolist()
        self._rows = 1.0 + np.array(chooser.candidates, np.float64)
        """Each candidate's query rows a request, q = 1 + K (``by_batch``)."""
        self.judged = False
        """A K's own factor at a bucket was learnt (its switch-in steps measured) since ``AutoTiers`` last chose:
        it chooses again at once (``AutoTiers.observe``)."""

    @property
    def own(self) -> np.ndarray:
        """(candidates, buckets) each K's own cost factor."""
        return np.array(self._own)

    @property
    def drift(self) -> np.ndarray:
        """(buckets,) each bucket's drift."""
        return np.array(self._drift)

    @property
    def steps(self) -> np.ndarray:
        """(candidates, buckets) served steps observed per (K, bucket)."""
        return np.array(self._steps, np.int64)

    @property
    def ratio(self) -> np.ndarray:
        """(candidates, buckets) each K's own factor times its bucket's drift: a K served at the bucket is weighed
        at it there (``by_batch`` weighs the others)."""
        return self.own * self.drift[None, :]

    def observe(self, num_reqs: int, q: int, device_ms: float) -> bool:
        """One served uniform decode of ``num_reqs`` (padded) requests at q that took ``device_ms``; False (nothing
        kept) where the table has no cost for it or the time is not a positive number."""
        i = self.index.get(q - 1)
        if i is None or not 1 <= num_reqs <= self.chooser.max_num_seqs or not _is_ms(device_ms):
            return False
        table_ms = self._table_ms[i][num_reqs]
        if not math.isfinite(table_ms):
            return False
        b = self._bucket_of[num_reqs]
        own, window = self._own[i], self._window[i]
        x = min(max(device_ms / table_ms, COST_RATIO_BOUNDS[0]), COST_RATIO_BOUNDS[1])
        self._clock += 1
        last_here = self._last_clock[b]
        if last_here >= 0 and self._clock - last_here > STALE_STEPS:  # an old drift: re-anchored, nothing learnt
            if not self._steps[i][b]:
                own[b] = self._own[self._last_k[b]][b]
                window[b] = SWITCH_IN_STEPS
            self._drift[b] = x / own[b]
        self._steps[i][b] += 1
        self._last_clock[b], self._last_k[b] = self._clock, i
        if window[b] < SWITCH_IN_STEPS:  # K's first steps here: its own factor, their median
            window[b] += 1
            samples = self._switch_in[i][b]
            samples.append(x / self._drift[b])
            own[b] = statistics.median(samples)
            if window[b] == SWITCH_IN_STEPS:
                self.judged = True
                samples.clear()
        else:
            self._drift[b] += (x / own[b] - self._drift[b]) / DRIFT_MEMORY_STEPS
        return True

    def by_batch(self) -> np.ndarray:
        """(candidates, 0..max_num_seqs) the served-to-table cost ratio each K is weighed at, per batch size: a K
        served at the size's bucket, its ``ratio``; one never served there, the least its step can cost given what
        the K's served there cost, as a ratio to its own table cost. A served step's overhead over its table (served
        less table, in ms) is the contexts' attention and the step's host work: a + b q with a, b >= 0 for q = 1 + K
        query rows a request (the fixed part, and the part that grows with the rows and the drafter's steps), so a
        K at q' costs at least its table plus each served K's overhead times min(1, q' / q): all of it for a K that
        drafts more, its share in proportion to the rows for one that drafts less (and never less than its table
        times the bucket's drift, what a K never served there was weighed at before). A K that drafts more never
        looks cheaper than what drafting less measured (on the H200 at 16 streams of the default model, K = 3 served
        at about 1.9x its table and K = 5 at 2.12x K = 3's table; at 1024 streams of bench-moe, weighed by K = 1's
        factor, K = 3 lost the choice to K = 1 and ran 3% faster when fixed), and one that drafts less is still tried
        where even its least cost beats the K in force. (Weighed at its table cost times the drift, a smaller K looked
        1.6-2x cheaper than it was wherever the served K's overhead was mostly the fixed part: on the H200 with the
        default model, 82f4592, the tiers tried one smaller K after another at every bucket, each found dear, and
        auto ran 0.91-0.96x the best fixed K at 16-1024 streams.)"""
        ratio = self.ratio[:, self._bucket_of]
        served = (self.steps > 0)[:, self._bucket_of] & self.chooser.valid
        table = np.where(self.chooser.valid, self.chooser.ms, 1.0)
        overhead = np.where(served, (ratio - 1.0) * table, -np.inf)  # (candidates, n): served ms less table
        share = np.minimum(1.0, self._rows[:, None] / self._rows[None, :])  # [i, s]: K_i's share of K_s's overhead
        least = (share[:, :, None] * overhead[None, :, :]).max(axis=1)  # (candidates, n); -inf where none served
        extend = ~served & np.isfinite(least) & self.chooser.valid
        return np.where(extend, np.maximum(ratio, 1.0 + least / table), ratio)


class HostFloor:
    """What the host needs a step, per batch-size bucket (``MeasuredCosts``'): where the host sets the pace (the
    engine, the worker's launches or the front ends' streaming: at 1024 streams of the default model on the H200 the
    GPU was busy 56% of a run without drafting), a step's period, its result after the one before, is longer than
    its device time, and a K that drafts more costs less than its device time says: its steps hide behind the
    host's and yield more tokens each. A step whose period exceeds its device time by more than
    ``HOST_BOUND_SLACK`` measures the floor (its period, at most ``HOST_FLOOR_MAX_RATIO`` times its device time: the
    plain mean of the first ``DRIFT_MEMORY_STEPS`` such steps, then an exponential average over as many); any other
    step only bounds it (the floor moves, by the same average, towards its period where it was above it), so that
    where the device sets the pace the floor stays below every step and weighs nothing. A bucket's floor weighs once
    ``HOST_FLOOR_MIN_STEPS`` host-bound steps measured it, and while at least ``HOST_BOUND_MIN_SHARE`` of the steps
    that tested it were host-bound (a bucket the device mostly paces has none: its stragglers are no pace); before,
    the nearest smaller bucket's that weighs (the host's work a step grows with its requests). The floor is the same
    for every K (the host's work a step does not depend much on how many tokens each request drafted), so a K never
    served at a host-bound bucket is weighed at its device cost or the floor, whichever is longer."""

    def __init__(self, chooser: TierChooser):
        self._spans = chooser.bucket_spans
        # (Python lists, as ``MeasuredCosts``': ``observe`` runs on every served step)
        self.floor_ms = [0.0] * chooser.num_buckets
        self.steps = [0] * chooser.num_buckets
        """Host-bound steps observed per bucket."""
        self.tested = [0] * chooser.num_buckets
        """Steps per bucket that tested its floor: those whose device time was below it (had the floor been the host's
        pace, they would have waited for it), host-bound or not. A host-bound step above the floor tests nothing:
        it straggled behind the floor too. (It used to count as host-bound: where the K in force ran above the floor,
        its stragglers alone then raised the share, from 0.13 to 0.77 at 256 streams on the H100 at 2389a42, and the
        floor, near that K's own step, weighed and priced the K's that draft less at that K's step.)"""
        self.seen = [0] * chooser.num_buckets
        """Served steps observed per bucket (``PACE_KNOWN_STEPS``)."""
        self.share = [0.0] * chooser.num_buckets
        """Per bucket, the host-bound share of the steps that tested its floor (the mean of the first
        DRIFT_MEMORY_STEPS, then an exponential average over as many)."""
        self._bucket_of = chooser.bucket_of.tolist()

    def observe(self, num_reqs: int, device_ms: float, period_ms: float) -> bool:
        """One served step of ``num_reqs`` (padded) requests: True when its period measured the floor (host-bound),
        False when it only bounded it or was not a valid pair of times."""
        if not (1 <= num_reqs < len(self._bucket_of) and _is_ms(device_ms) and _is_ms(period_ms)):
            return False
        b = self._bucket_of[num_reqs]
        self.seen[b] += 1
        floor = self.floor_ms[b]
        host_bound = period_ms > device_ms * (1.0 + HOST_BOUND_SLACK)
        if device_ms < floor:  # (a step whose device time is not below the floor says nothing of its pace)
            self.tested[b] += 1
            self.share[b] += (host_bound - self.share[b]) * max(1.0 / self.tested[b], 1.0 / DRIFT_MEMORY_STEPS)
        if not host_bound:  # (the floor is at most this period)
            self.floor_ms[b] = floor + (min(floor, period_ms) - floor) / DRIFT_MEMORY_STEPS
            return False
        self.steps[b] += 1
        weight = max(1.0 / self.steps[b], 1.0 / DRIFT_MEMORY_STEPS)
        self.floor_ms[b] = floor + (min(period_ms, device_ms * HOST_FLOOR_MAX_RATIO) - floor) * weight
        return True

    def by_bucket(self) -> np.ndarray:
        """Each bucket's floor as it weighs: before HOST_FLOOR_MIN_STEPS host-bound steps measured it, the nearest
        smaller bucket's that weighs (a bucket the batch has just reached starts from the floor below it), else 0;
        after, its own while at least HOST_BOUND_MIN_SHARE of the steps that tested it were host-bound, else 0 (the
        device paces the bucket: its host-bound steps were stragglers)."""
        out = np.zeros(len(self.floor_ms))
        below = 0.0
        for b, (ms, n, own) in enumerate(zip(self.floor_ms, self.steps, self._own_weighs())):
            if n < HOST_FLOOR_MIN_STEPS:
                out[b] = below
            elif own:
                below = out[b] = ms
        return out

    def _own_weighs(self) -> np.ndarray:
        """Per bucket: its own floor weighs (measured by HOST_FLOOR_MIN_STEPS host-bound steps, and host-bound in
        HOST_BOUND_MIN_SHARE of the steps that tested it)."""
        return (np.array(self.steps) >= HOST_FLOOR_MIN_STEPS) & (np.array(self.share) >= HOST_BOUND_MIN_SHARE)

    def by_batch(self) -> np.ndarray:
        """(0..max_num_seqs,) each batch size's floor, its bucket's (``by_bucket``)."""
        return self.by_bucket()[self._bucket_of]

    def unpaced_by_batch(self) -> np.ndarray:
        """(0..max_num_seqs,) True at the batch sizes whose bucket has no floor that weighs (``by_bucket``: its own
        or one below it) and saw fewer than PACE_KNOWN_STEPS served steps: nothing says yet whether the host or the
        device sets the pace there."""
        unpaced = (self.by_bucket() <= 0.0) & (np.array(self.seen) < PACE_KNOWN_STEPS)
        return unpaced[self._bucket_of]

    def describe(self) -> str:
        """The buckets host-bound steps were measured at, with their floors ("" where none): for the log line."""
        parts = [f"{lo}{f'-{hi}' if hi > lo else ''} requests {ms:.1f} ms"
                 for (lo, hi), ms, own in zip(self._spans, self.floor_ms, self._own_weighs()) if own and ms > 0]
        return "host floor a step: " + ", ".join(parts) if parts else ""


class AutoTiers:
    """The engine's (and simulate's) tiers under ``"auto"``: chosen from the prior at start, then every
    ``interval`` steps from the scheduler's per-position counters (``observe``), with hysteresis."""

    def __init__(self, chooser: TierChooser, prior: Sequence[float], interval: int = RECHOOSE_INTERVAL_STEPS,
                 hysteresis: float = HYSTERESIS, prior_weight: float = PRIOR_WEIGHT,
                 half_life_steps: float = WINDOW_HALF_LIFE_STEPS, served_costs: bool = True):
        """``served_costs``: weigh the served steps' cost against the table's and their periods (``observe_step``);
        False takes the table as it is, with no host floor (a table a user gave: the choice follows it alone)."""
        if interval < 1:
            raise ValueError(f"auto tiers: the re-choice interval must be >= 1 step, got {interval}")
        self.chooser, self.prior = chooser, tuple(prior)
        self.interval, self.hysteresis, self.prior_weight = interval, hysteresis, prior_weight
        self.half_life_steps = half_life_steps
        """Steps after which a count of the window weighs half."""
        self.costs = MeasuredCosts(chooser)
        """Served steps' cost against the table's (``observe_step``), weighed from the next re-choice on."""
        self.host = HostFloor(chooser)
        """What the host needs a step, from the served steps' periods (``observe_step``)."""
        self.served_costs = served_costs
        self.last_num_reqs = 0
        """The padded request count of the last served uniform decode step (0: none yet): ``describe_batch``'s."""
        self.choice = chooser.choose(self.prior, unpaced=self.host.unpaced_by_batch())
        self.changes = 0
        """Times the tiers changed after the first choice."""
        k = len(self.prior)
        self._steps = 0
        self._seen_accepted = [0] * k
        self._seen_reached = [0] * k
        self._accepted = [0.0] * k
        self._reached = [0.0] * k

    @property
    def tiers(self) -> tuple[tuple[int, int, int], ...]:
        """The tiers in force, (min_batch, max_batch, K) each."""
        return self.choice.resolved(self.chooser.max_num_seqs)

    def acceptance(self) -> tuple[float, ...]:
        """The acceptance per position the window's counts give (the prior before any)."""
        return estimate_acceptance(self._accepted, self._reached, self.prior, self.prior_weight)

    def observe_step(self, num_reqs: int, q: int, device_ms: float, period_ms: float | None = None) -> bool:
        """A served uniform decode step's device time (``num_reqs``: the padded request count its graph ran at) and
        its period (its result after the one before; None: unknown), for the next choices' costs (``MeasuredCosts``,
        ``HostFloor``); False when its device time was not kept."""
        self.last_num_reqs = num_reqs
        if not self.served_costs:
            return False
        if period_ms is not None:
            self.host.observe(num_reqs, device_ms, period_ms)
        return self.costs.observe(num_reqs, q, device_ms)

    def describe_batch(self, num_reqs: int | None = None) -> str:
        """Why the choice in force runs its K at ``num_reqs`` requests (default: the last served step's): each K's step
        as the choice weighed it (the table's ms times its served ratio, no shorter than the host floor) and its
        expected tokens/s there, the K in force marked; "" before any served step."""
        n = self.last_num_reqs if num_reqs is None else num_reqs
        if not 1 <= n <= self.chooser.max_num_seqs:
            return ""
        ch = self.choice
        ms = self.chooser.step_ms(ch.cost_ratio, ch.floor_ms)[:, n]
        tps = self.chooser.throughput(ch.acceptance, ch.cost_ratio, ch.floor_ms)[:, n]
        parts = [f"K={k} {m:.2f} ms {_short(t)} tok/s{' *' if k == ch.k_of_batch[n] else ''}"
                 for k, m, t in zip(self.chooser.candidates, ms, tps) if np.isfinite(t)]
        return f"at {n} requests: " + ", ".join(parts)

    def observe(self, accepted_per_pos: Sequence[int], reached_per_pos: Sequence[int], steps: int = 1) -> bool:
        """``steps`` more steps ran; the counters are cumulative (the scheduler's ``SchedulerStats.accepted_per_pos``
        and ``reached_per_pos``). Every ``interval`` steps, and as soon as a K's switch-in steps at a bucket have
        measured its cost there (``MeasuredCosts.judged``): the window takes what they added, its older counts
        fading by the steps since the last choice, the acceptance is estimated and the tiers chosen again. True when
        the tiers changed. (On the H200 with the default model, 82f4592, the served log showed smaller K's tried at
        one bucket after another, each weighed at its table cost, 1.6-2x below what served steps cost there, and
        each run until the next interval, 64 steps, before it was found dear: auto tiers ran 0.93-0.96x the best
        fixed K at 16-256 streams.)"""
        self._steps += steps
        if self._steps < self.interval and not self.costs.judged:
            return False
        decay_all = 0.5 ** (self._steps / self.half_life_steps)
        self._steps = 0
        self.costs.judged = False
        for j in range(len(self.prior)):
            a = accepted_per_pos[j] if j < len(accepted_per_pos) else 0
            v = reached_per_pos[j] if j < len(reached_per_pos) else 0
            # (a later position no step verified this interval keeps its counts: fading them would return its
            # rate, given the one before, to the prior's, and a shallow K in force would never measure it back)
            decay = 1.0 if j and v == self._seen_reached[j] else decay_all
            self._accepted[j] = decay * self._accepted[j] + (a - self._seen_accepted[j])
            self._reached[j] = decay * self._reached[j] + (v - self._seen_reached[j])
            self._seen_accepted[j], self._seen_reached[j] = a, v
        new = self.chooser.choose(self.acceptance(), self.choice.k_of_batch, self.hysteresis, self.costs.by_batch(),
                                  self.host.by_batch(), self.host.unpaced_by_batch())
        changed = new.tiers != self.choice.tiers
        self.choice = new
        self.changes += changed
        return changed


def chooser_for_plan(costs: StepCostTable, plan) -> TierChooser:
    """The decision for an ``"auto"`` plan: its candidates, each allowed up to its q's largest captured FULL decode
    size of the target (without FULL decode graphs: as far as the table goes)."""
    cfg = plan.config
    reach = {}
    sets = {g.q: g for g in plan.for_runner("target") if g.kind == "full_decode"}
    for k in cfg.tier_candidates:
        g = sets.get(1 + k)
        if g is not None:
            reach[k] = g.largest
    return TierChooser(costs, cfg.tier_candidates, cfg.max_num_seqs, reach or None)


def render_choice(chooser: TierChooser, choice: TierChoice, host_floor: str = "") -> str:
    """``plan --auto-tiers``' text: the host floor the choice weighed (``HostFloor.describe``, if any), the acceptance
    and tokens per step per K, then per tier the expected tokens/s of every K at the tier's ends, the chosen one
    marked."""
    host = [f"{host_floor} (each K's step weighed no shorter)"] if host_floor else []
    lines = host + ["acceptance per draft position: " + ", ".join(f"{p:.3f}" for p in choice.acceptance),
             "expected tokens a step: " + ", ".join(f"K={k}: {expected_tokens(choice.acceptance, k):.3f}"
                                                    for k in chooser.candidates)]
    missing = [k for k in chooser.candidates if not chooser.reach[k]]
    if missing:
        lines.append("no step costs at q = " + ", ".join(str(1 + k) for k in missing) + ": K = "
                     + ", ".join(map(str, missing)) + " never chosen")
    header = ["requests", "K"] + [f"K={k} tok/s" for k in chooser.candidates]
    rows = []
    for r in chooser.explain(choice):
        cells = [f"{r['min_batch']}..{r['max_batch']}", r["k"]]
        for k in chooser.candidates:
            lo, hi = r["tokens_per_s"][k]
            cell = "-" if lo is None and hi is None else f"{_short(lo)}..{_short(hi)}"
            cells.append(cell + (" *" if k == r["k"] else ""))
        rows.append(cells)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    lines += ["", fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    lines += ["", f"tiers: {json.dumps(choice.as_config())}  (* the K chosen; tok/s at the range's first..last batch)"]
    return "\n".join(lines)


def _short(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / 1e3:.1f}k" if v >= 1e4 else f"{v:.0f}"
