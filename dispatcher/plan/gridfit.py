"""Grids fitted to a measured step cost (SPEC section 3; the reference's Appendix A).

A batch of n rows runs on the smallest graph that holds it; padding it by d rows costs about e(n) * d / n of its
step time T(n), where e(n) = n * T'(n) / T(n) = d ln T / d ln n is the step time's elasticity. Bounding the mean
padding cost by eps gives the local step 2 * eps * n / e(n); ``grids.padding_bounded_grid`` turns a local step into
sizes (the stride rounded down to a power of two, so that every power of two is a size, the cap always last). The
default grids use one e(n) fitted over many models; here e(n) is estimated from *this* model's step times on
*this* GPU: sparse sizes where padding is nearly free (a flat curve: e near 0, the stride doubles), dense ones
where it costs (a linear curve: e near 1, the stride 2 * eps * n).

e(n) is read over one octave around n, (ln T(n * sqrt 2) - ln T(n / sqrt 2)) / ln 2, on the measured points made
non-decreasing (a running maximum: noise never makes a larger batch cheaper) and interpolated log-log; below the
first point the curve is flat, above the last it goes on linearly. The PIECEWISE grid is fitted to the PIECEWISE
curve in tokens, the FULL decode grid to the FULL decode curve of the largest q in use, in requests (the densest
of the q's: a larger q reaches the linear regime at fewer requests, so its grid bounds the padding of the others).

Pure and deterministic: a ``StepCost`` in, sizes out. ``StepCost`` reads the measured curves from a runtime
benchmark's JSON (benchmarks/bench_runtime_gpu.py), from step traces' records, or from its own JSON form (what the
server keeps under $TWOGRID_CACHE/grid_cost after it measured them at start-up).
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from dispatcher.plan import grids
from dispatcher.plan.errors import ConfigError, check_known_fields

Points = tuple[tuple[int, float], ...]
"""(size, ms) pairs, sizes strictly increasing."""

MIN_ELASTICITY = 1e-3
"""e(n) is taken as at least this, so that a flat stretch gives a finite (huge) local step."""
PREFILL_KIND, DECODE_KIND = "piecewise", "full_decode"


@dataclass(frozen=True)
class StepCost:
    """Measured step times: PIECEWISE steps by tokens, FULL uniform decodes by requests at each q."""

    prefill: Points
    decode: tuple[tuple[int, Points], ...]
    """(q, points in requests) per measured q, q increasing."""
    source: str = ""
    capture_gib: tuple[tuple[str, float, float], ...] = ()
    """Per graph kind, (kind, the largest graph's growth, a further graph's growth) in GiB, as a capture measured
    them (a runtime benchmark's ``default_plan_capture``): what ``capture_memory`` extrapolates from."""

    def capture_memory(self, kind: str, num_graphs: int) -> float | None:
        """GiB ``num_graphs`` graphs of ``kind`` take by ``capture_gib`` (the estimate's rule,
        ``graphs.estimate_kind_memory``: the largest's growth plus the others at the per-graph growth); None
        without a sample of that kind."""
        for k, largest, per_graph in self.capture_gib:
            if k == kind:
                return largest + max(num_graphs - 1, 0) * per_graph if num_graphs else 0.0
        return None

    def decode_points(self, query_len: int) -> Points:
        """The FULL decode curve at q in requests: the measured one, else the nearest measured q's (the larger on a
        tie) at equal tokens (n requests at q cost what n * q / q' requests cost at q'). () without any."""
        if not self.decode:
            return ()
        by_q = dict(self.decode)
        if query_len in by_q:
            return by_q[query_len]
        near = min(by_q, key=lambda q: (abs(q - query_len), -q))
        scaled: dict[int, float] = {}
        for n, ms in by_q[near]:
            reqs = max(1, round(n * near / query_len))
            scaled.setdefault(reqs, ms)
        return tuple(sorted(scaled.items()))

    def to_json(self) -> dict[str, Any]:
        return {"prefill_ms": [[t, ms] for t, ms in self.prefill],
                "decode_ms": {str(q): [[n, ms] for n, ms in pts] for q, pts in self.decode}, "source": self.source}

    @classmethod
    def from_json(cls, data: Any, where: str, model: str | None = None) -> "StepCost":
        """From its own form ``{"prefill_ms": [[tokens, ms], ...], "decode_ms": {"q": [[requests, ms], ...]}}`` or
        a runtime benchmark's JSON (``{"models": [{"model", "steps": [{kind, q, tokens, replay_ms}, ...]}]}``, of
        which ``model``, default its only one). ConfigError naming ``where`` and the field otherwise."""
        if isinstance(data, dict) and "models" in data:
            return _from_runtime_bench(data, where, model)
        if model is not None:
            raise ConfigError(f"{where}: a model name picks a model of a runtime benchmark's JSON; this is a step-cost "
                              f"table")
        if not isinstance(data, dict) or "prefill_ms" not in data and "decode_ms" not in data:
            raise ConfigError(f"{where}: not a step-cost table {{\"prefill_ms\": [[tokens, ms], ...], \"decode_ms\": "
                              f"{{\"q\": [[requests, ms], ...]}}}} nor a runtime benchmark's JSON {{\"models\": ...}}")
        check_known_fields(data, ("prefill_ms", "decode_ms", "source", "key"), where)  # (the last two: the cache's)
        prefill = _points(data.get("prefill_ms", []), f"{where} prefill_ms")
        decode_raw = data.get("decode_ms", {})
        if not isinstance(decode_raw, dict):
            raise ConfigError(f"{where} decode_ms: must be an object {{\"q\": [[requests, ms], ...]}}")
        decode = []
        for q, pts in decode_raw.items():
            if not (isinstance(q, str) and q.isdigit() and int(q) >= 1):
                raise ConfigError(f"{where} decode_ms: key {q!r} is not a query length >= 1")
            decode.append((int(q), _points(pts, f"{where} decode_ms[{q}]")))
        return cls(prefill, tuple(sorted(decode)), str(data.get("source") or where))

    @classmethod
    def from_trace(cls, records: Iterable[Any], where: str) -> "StepCost":
        """From step traces' records: the median ``device_ms`` of the steps on each PIECEWISE size (tokens) and each
        FULL decode graph (q, requests). Device times there include attention over the requests' context and the
        drafter's forwards: the cost the engine met."""
        pw: dict[int, list[float]] = {}
        dec: dict[int, dict[int, list[float]]] = {}
        for rec in records:
            graph = rec.get("graph") if isinstance(rec, dict) else None
            ms = rec.get("device_ms") if isinstance(rec, dict) else None
            if not (isinstance(graph, list) and len(graph) == 3 and isinstance(ms, (int, float)) and ms > 0):
                continue
            kind, q, size = graph
            if kind == PREFILL_KIND and isinstance(size, int):
                pw.setdefault(size, []).append(float(ms))
            elif kind == DECODE_KIND and isinstance(q, int) and isinstance(size, int):
                dec.setdefault(q, {}).setdefault(size, []).append(float(ms))
        med = lambda d: tuple((s, statistics.median(v)) for s, v in sorted(d.items()))  # noqa: E731
        cost = cls(med(pw), tuple((q, med(d)) for q, d in sorted(dec.items())), where)
        if len(cost.prefill) < 2 and not any(len(p) >= 2 for _, p in cost.decode):
            raise ConfigError(f"{where}: the step traces hold fewer than two sizes of PIECEWISE steps and of FULL "
                              f"decode steps at any q (with a device time): nothing to fit")
        return cost


def _points(raw: Any, where: str) -> Points:
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: must be a list of [size, ms] pairs")
    out: dict[int, float] = {}
    for i, p in enumerate(raw):
        ok = (isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool)
              and p[0] >= 1 and isinstance(p[1], (int, float)) and not isinstance(p[1], bool)
              and math.isfinite(p[1]) and p[1] > 0)
        if not ok:
            raise ConfigError(f"{where}[{i}]: {p!r} is not [size >= 1, finite ms > 0]")
        if p[0] in out:
            raise ConfigError(f"{where}: size {p[0]} appears more than once")
        out[p[0]] = float(p[1])
    return tuple(sorted(out.items()))


def _from_runtime_bench(data: dict[str, Any], where: str, model: str | None) -> StepCost:
    models = data["models"]
    if not isinstance(models, list) or not all(isinstance(m, dict) and "model" in m for m in models):
        raise ConfigError(f"{where}: 'models' must be a list of {{model, steps}} objects")
    names = [str(m["model"]) for m in models]
    if model is None and len(names) != 1:
        raise ConfigError(f"{where}: holds models {', '.join(names)}: name one")
    model = names[0] if model is None else model
    if model not in names:
        raise ConfigError(f"{where}: holds no model {model!r}; it holds {', '.join(names)}")
    steps = models[names.index(model)].get("steps")
    if not isinstance(steps, list):
        raise ConfigError(f"{where}: model {model!r} has no 'steps' list")
    pw: dict[int, list[float]] = {}
    dec: dict[int, dict[int, list[float]]] = {}
    for i, s in enumerate(steps):
        ok = (isinstance(s, dict) and s.get("kind") in (PREFILL_KIND, DECODE_KIND) and isinstance(s.get("tokens"), int)
              and s["tokens"] >= 1 and isinstance(s.get("replay_ms"), (int, float)) and math.isfinite(s["replay_ms"])
              and s["replay_ms"] > 0)
        if not ok:
            continue  # (other kinds, and rows without a replay time)
        if s["kind"] == PREFILL_KIND:
            pw.setdefault(s["tokens"], []).append(float(s["replay_ms"]))
        else:
            q = s.get("q")
            if not isinstance(q, int) or q < 1 or s["tokens"] % q:
                raise ConfigError(f"{where}: model {model!r} step {i}: a full_decode step needs q >= 1 dividing its "
                                  f"tokens, got q = {q!r}, tokens = {s['tokens']}")
            dec.setdefault(q, {}).setdefault(s["tokens"] // q, []).append(float(s["replay_ms"]))
    med = lambda d: tuple((n, statistics.median(v)) for n, v in sorted(d.items()))  # noqa: E731
    memory = []
    plan_capture = data.get("default_plan_capture")
    if isinstance(plan_capture, dict) and plan_capture.get("model") == model:
        for k in plan_capture.get("kinds") or []:
            samples = k.get("estimate_samples_gib") if isinstance(k, dict) else None
            if isinstance(samples, list) and len(samples) >= 2 and k.get("kind") not in [m[0] for m in memory]:
                memory.append((str(k["kind"]), float(samples[0]), float(samples[1])))
    return StepCost(med(pw), tuple((q, med(d)) for q, d in sorted(dec.items())), f"{where} ({model})",
                    tuple(memory))


def step_time(points: Points) -> Callable[[float], float]:
    """T(n) through ``points``: made non-decreasing, log-log between points, flat below the first, linear above the
    last (its last segment's slope)."""
    sizes = [float(n) for n, _ in points]
    ms: list[float] = []
    for _, m in points:
        ms.append(max(m, ms[-1] if ms else m, 1e-9))
    log_n, log_ms = [math.log(n) for n in sizes], [math.log(m) for m in ms]
    slope = (ms[-1] - ms[-2]) / (sizes[-1] - sizes[-2]) if len(sizes) > 1 else 0.0

    def T(n: float) -> float:
        if n <= sizes[0]:
            return ms[0]
        if n >= sizes[-1]:
            return ms[-1] + slope * (n - sizes[-1])
        i = bisect.bisect_right(log_n, math.log(n))
        x0, x1, y0, y1 = log_n[i - 1], log_n[i], log_ms[i - 1], log_ms[i]
        return math.exp(y0 + (y1 - y0) * (math.log(n) - x0) / (x1 - x0))

    return T


def elasticity(points: Points) -> Callable[[float], float]:
    """e(n) = d ln T / d ln n over the octave [n / sqrt 2, n * sqrt 2] of ``step_time(points)``."""
    T = step_time(points)
    half = math.sqrt(2.0)
    return lambda n: (math.log(T(n * half)) - math.log(T(n / half))) / math.log(2.0)


def fitted_grid(cap: int, points: Points, eps: float) -> tuple[int, ...]:
    """Sizes up to ``cap`` with local step 2 * eps * n / e(n) on the curve ``points`` (at least two of them)."""
    if len(points) < 2:
        raise ConfigError(f"a grid fit needs at least two measured sizes, got {len(points)}")
    e = elasticity(points)
    return grids.padding_bounded_grid(cap, lambda n: 2 * eps * n / max(e(n), MIN_ELASTICITY))


def fit_prefill(cap_tokens: int, cost: StepCost, eps: float = grids.PREFILL_EPS) -> tuple[int, ...]:
    """The PIECEWISE grid (tokens) fitted to ``cost``'s PIECEWISE curve."""
    if len(cost.prefill) < 2:
        raise ConfigError(f"{cost.source}: fewer than two PIECEWISE step times: cannot fit the prefill grid")
    return fitted_grid(cap_tokens, cost.prefill, eps)


def fit_decode(cap_requests: int, cost: StepCost, query_len: int, eps: float = grids.DECODE_EPS) -> tuple[int, ...]:
    """The FULL decode grid (requests) fitted to ``cost``'s FULL decode curve at q (``StepCost.decode_points``)."""
    points = cost.decode_points(query_len)
    if len(points) < 2:
        raise ConfigError(f"{cost.source}: fewer than two FULL decode step times: cannot fit the decode grid")
    return fitted_grid(cap_requests, points, eps)


def head_token_grid(target_sizes: tuple[int, ...]) -> tuple[int, ...]:
    """An EAGLE-style head's step-0 token grid beside the target's fitted one: the target's sizes that are powers of
    two, and its largest. Step 0 runs the head (one decoder layer) over the target's rows; padded to the next power
    of two it costs at most one more head forward, a few percent of a step whose target runs all its layers (the
    fit's bound eps scaled by the step's cost over the head's, about the target's layer count L, gives a local step
    2 * eps * L * n / e(n) of an octave or more once eps * L >= 1/2: L >= 15 at ``grids.PREFILL_EPS``), while each
    size it leaves out is a graph fewer to capture and hold. The largest stays, so that every step the target's
    grid takes the head's takes too."""
    if not target_sizes:
        return ()
    return tuple(n for n in target_sizes if n & (n - 1) == 0 or n == target_sizes[-1])


def measurement_sizes(cap: int) -> tuple[int, ...]:
    """The sizes the server measures a curve at (``fit_cudagraph_capture_sizes``): 1, every power of four, the
    powers of two from 64 on, and the cap: where the curve bends (expert activation below ~100 tokens, the GEMMs'
    ridge at a few hundred) each octave has a point."""
    if cap < 1:
        return ()
    powers = [1 << i for i in range(cap.bit_length())]
    return tuple(sorted({n for n in powers if n >= 64 or n.bit_length() % 2 == 1} | {cap}))
