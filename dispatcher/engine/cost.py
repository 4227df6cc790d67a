"""Step-cost curves: milliseconds a forward of t tokens takes, per execution mode.

Used by adaptive verification to pick each step's verify budget, and by ``twogrid simulate`` and ``replay`` as the
GPU. A curve interpolates measured (tokens, ms) points linearly and extends the last segment beyond them. The
presets are SPEC section 1's H200 measurements (bf16, random weights, grouped-GEMM MoE, 24 layers, attention left
out); their PIECEWISE column is an estimate (FULL plus one eager attention launch a layer), not a measurement.
``load_cost_table`` reads measured per-size step times instead (``replay --cost-table``): a table, a runtime
benchmark's JSON, or the step traces of a real run.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

from dispatcher.engine.trace import read_traces
from dispatcher.plan import autotier
from dispatcher.plan.config import ConfigError, load_json_file
from dispatcher.plan.dispatch import MODE_EAGER, MODE_FULL, MODE_PIECEWISE

_TOKENS = (1, 8, 64, 256, 512, 1024, 2048, 4096, 8192)
PRESETS: dict[str, dict[str, tuple[float, ...]]] = {
    # Granite-1B-A400M-shaped MoE: host-bound up to ~2048 tokens.
    "bench-moe": {
        MODE_EAGER: (22.3, 21.2, 20.8, 23.6, 20.7, 23.8, 23.6, 23.9, 40.9),
        MODE_FULL: (2.6, 3.4, 4.2, 4.8, 6.0, 8.9, 13.4, 21.8, 39.4),
    },
    # Qwen3-30B-A3B-shaped MoE: GPU-bound above a few hundred tokens.
    "bench-moe-large": {
        MODE_EAGER: (11.2, 10.5, 14.3, 15.7, 17.4, 22.1, 33.3, 51.8, 93.7),
        MODE_FULL: (3.5, 7.3, 13.3, 14.5, 16.1, 20.8, 32.1, 50.3, 92.5),
    },
}
PIECEWISE_OVERHEAD_MS_PER_LAYER = 0.05
"""Estimated host cost of running attention eagerly between PIECEWISE pieces, per layer."""


@dataclass(frozen=True)
class CostCurve:
    """Piecewise-linear interpolation over sorted (tokens, ms) points."""

    tokens: tuple[int, ...]
    ms: tuple[float, ...]

    def __post_init__(self):
        if len(self.tokens) != len(self.ms) or len(self.tokens) < 2:
            raise ValueError("a cost curve needs at least two (tokens, ms) points")
        if list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError("cost curve tokens must be strictly increasing")

    def __call__(self, num_tokens):
        """ms at ``num_tokens`` (an int, or a numpy array of them): linear between points, the first and last
        segments extended beyond them, never below 0."""
        t, ms = self.tokens, self.ms
        if isinstance(num_tokens, np.ndarray):
            x = num_tokens.astype(np.float64)
            y = np.interp(x, t, ms)
            lo, hi = x < t[0], x > t[-1]
            y[lo] = ms[0] + (ms[1] - ms[0]) * (x[lo] - t[0]) / (t[1] - t[0])
            y[hi] = ms[-1] + (ms[-1] - ms[-2]) * (x[hi] - t[-1]) / (t[-1] - t[-2])
            return np.maximum(y, 0.0)
        i = bisect.bisect_left(t, num_tokens)
        if i < len(t) and t[i] == num_tokens:
            return ms[i]
        i = min(max(i, 1), len(t) - 1)
        x0, x1, y0, y1 = t[i - 1], t[i], ms[i - 1], ms[i]
        return max(0.0, y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0))


@dataclass(frozen=True)
class StepCostModel:
    """ms per step by mode; PIECEWISE defaults to FULL plus eager attention launches."""

    full: CostCurve
    eager: CostCurve
    piecewise: CostCurve | None = None
    num_layers: int = 24
    name: str = "custom"
    """Where the curves come from: a preset's name, or the table file (and model) they were read from."""
    whole_steps: bool = False
    """The curves are whole steps' device time, a drafter's forwards included (step traces of a real run): a
    simulation adds nothing for the drafter."""

    @classmethod
    def preset(cls, name: str) -> "StepCostModel":
        if name not in PRESETS:
            raise ValueError(f"cost model must be one of {', '.join(PRESETS)}; got {name!r}")
        p = PRESETS[name]
        return cls(CostCurve(_TOKENS, p[MODE_FULL]), CostCurve(_TOKENS, p[MODE_EAGER]), name=name)

    def step_ms(self, mode: str, num_tokens):
        """ms of a step (``num_tokens`` an int or a numpy array)."""
        if mode == MODE_FULL:
            return self.full(num_tokens)
        if mode == MODE_PIECEWISE:
            if self.piecewise is not None:
                return self.piecewise(num_tokens)
            return self.full(num_tokens) + PIECEWISE_OVERHEAD_MS_PER_LAYER * self.num_layers
        return np.maximum(self.eager(num_tokens), self.full(num_tokens))


TABLE_MODES = (MODE_FULL, MODE_PIECEWISE, MODE_EAGER)
DEFAULT_TABLE_MODEL = "bench-moe"


def _median_curve(points: list[tuple[int, float]]) -> CostCurve:
    """A curve through the median ms of each token count."""
    by_tokens: dict[int, list[float]] = {}
    for tokens, ms in points:
        by_tokens.setdefault(tokens, []).append(ms)
    tokens = tuple(sorted(by_tokens))
    return CostCurve(tokens, tuple(float(statistics.median(by_tokens[t])) for t in tokens))


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _is_ms(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 and x == x and x != float("inf")


def _mode_table(data: dict[str, Any], path: str) -> StepCostModel:
    """``{"FULL": [[tokens, ms], ...], "NONE": [...], "PIECEWISE": [...]}``; PIECEWISE may be left out."""
    unknown = sorted(set(data) - set(TABLE_MODES))
    if unknown:
        raise ConfigError(f"--cost-table: {path!r} has unknown key {unknown[0]!r}; a table holds "
                          f"{', '.join(TABLE_MODES)} (lists of [tokens, ms]) or is a runtime benchmark's JSON")
    curves: dict[str, CostCurve] = {}
    for mode, points in data.items():
        where = f"--cost-table: {path!r} {mode}"
        if not isinstance(points, list) or len(points) < 2:
            raise ConfigError(f"{where}: needs a list of at least two [tokens, ms] points")
        for i, point in enumerate(points):
            if not (isinstance(point, list) and len(point) == 2 and _is_count(point[0]) and _is_ms(point[1])):
                raise ConfigError(f"{where}[{i}]: {point!r} is not [tokens >= 1, ms >= 0]")
        tokens = [p[0] for p in points]
        repeated = sorted({t for t in tokens if tokens.count(t) > 1})
        if repeated:
            raise ConfigError(f"{where}: {repeated[0]} tokens appears more than once")
        points = sorted(points)
        curves[mode] = CostCurve(tuple(p[0] for p in points), tuple(float(p[1]) for p in points))
    for mode in (MODE_FULL, MODE_EAGER):
        if mode not in curves:
            raise ConfigError(f"--cost-table: {path!r} has no {mode} curve; a table holds FULL and NONE (eager) "
                              f"[tokens, ms] lists, and PIECEWISE optionally")
    return StepCostModel(curves[MODE_FULL], curves[MODE_EAGER], curves.get(MODE_PIECEWISE), name=f"table {path}")


def _runtime_table(data: dict[str, Any], path: str, model: str | None) -> StepCostModel:
    """A runtime benchmark's JSON (benchmarks/bench_runtime_gpu.py): per model, steps {kind, tokens, eager_ms,
    replay_ms}. FULL: the replay times of every FULL kind (all q, the median where token counts meet); PIECEWISE:
    the piecewise replay times; NONE: every step's eager time (median per token count)."""
    models = data["models"]
    if not isinstance(models, list) or not all(isinstance(m, dict) and "model" in m for m in models):
        raise ConfigError(f"--cost-table: {path!r} 'models' must be a list of {{model, steps}} objects")
    names = [str(m["model"]) for m in models]
    if model is None:
        if len(names) == 1:
            model = names[0]
        elif DEFAULT_TABLE_MODEL in names:
            model = DEFAULT_TABLE_MODEL
        else:
            raise ConfigError(f"--cost-table: {path!r} holds models {', '.join(names)}: choose one with --cost-model")
    if model not in names:
        raise ConfigError(f"--cost-model: {path!r} holds no model {model!r}; it holds {', '.join(names)}")
    steps = models[names.index(model)].get("steps")
    if not isinstance(steps, list):
        raise ConfigError(f"--cost-table: {path!r} model {model!r} has no 'steps' list")
    full, piecewise, eager = [], [], []
    for i, step in enumerate(steps):
        ok = (isinstance(step, dict) and isinstance(step.get("kind"), str) and _is_count(step.get("tokens"))
              and _is_ms(step.get("eager_ms")) and _is_ms(step.get("replay_ms")))
        if not ok:
            raise ConfigError(f"--cost-table: {path!r} model {model!r} step {i} is not {{kind, tokens >= 1, "
                              f"eager_ms >= 0, replay_ms >= 0}}")
        (piecewise if step["kind"] == "piecewise" else full).append((step["tokens"], step["replay_ms"]))
        eager.append((step["tokens"], step["eager_ms"]))
    return _median_model({MODE_FULL: full, MODE_PIECEWISE: piecewise, MODE_EAGER: eager},
                         f"--cost-table: {path!r} model {model!r} has fewer than two token counts of {{mode}} steps",
                         f"table {path} ({model})")


def _median_model(points: dict[str, list[tuple[int, float]]], missing: str, name: str,
                  whole_steps: bool = False) -> StepCostModel:
    """Each mode's median curve through its (tokens, ms) points; ConfigError ``missing`` (with ``{mode}``) when
    FULL or NONE has fewer than two token counts (PIECEWISE may be left out)."""
    curves = {}
    for mode, pts in points.items():
        if len({t for t, _ in pts}) >= 2:
            curves[mode] = _median_curve(pts)
        elif mode != MODE_PIECEWISE:
            raise ConfigError(missing.replace("{mode}", mode))
    return StepCostModel(curves[MODE_FULL], curves[MODE_EAGER], curves.get(MODE_PIECEWISE), name=name,
                         whole_steps=whole_steps)


def trace_table(records: list[Any], path: str) -> StepCostModel:
    """Step times from step traces (``--step-trace`` records of a real run): per mode, the median ``device_ms`` of
    each padded token count (drafter forwards included, as the trace records them). Records without a device time
    (a trace of ``simulate``) are skipped; ConfigError when FULL or NONE has fewer than two token counts."""
    points: dict[str, list[tuple[int, float]]] = {mode: [] for mode in TABLE_MODES}
    for rec in records:
        if (isinstance(rec, dict) and rec.get("mode") in points and _is_count(rec.get("padded_tokens"))
                and _is_ms(rec.get("device_ms"))):
            points[rec["mode"]].append((rec["padded_tokens"], float(rec["device_ms"])))
    return _median_model(points, f"--cost-table: the step traces {path} have fewer than two token counts of {{mode}} "
                                 f"steps with a device time: add a trace that has them (a run under another policy)",
                         f"step traces {path}", whole_steps=True)


def load_cost_table(path: str, model: str | None = None) -> StepCostModel:
    """Step times measured on a GPU, from ``path``: a ``{"FULL", "PIECEWISE", "NONE"}`` table of [tokens, ms]
    points, a runtime benchmark's JSON, of which ``model`` (default: its only model, else bench-moe) is read, or
    step traces (``.jsonl``; several joined with commas: ``trace_table``). ConfigError naming the file and the
    field for anything else."""
    if path.endswith(".jsonl"):
        if model is not None:
            raise ConfigError(f"--cost-model {model!r} picks a model of a runtime benchmark's JSON; {path!r} are "
                              f"step traces")
        return trace_table(read_traces(path, "--cost-table"), path)
    data = load_json_file(path, "--cost-table")
    if isinstance(data, dict) and "models" in data:
        return _runtime_table(data, path, model)
    if not isinstance(data, dict):
        raise ConfigError(f"--cost-table: {path!r} holds a JSON {type(data).__name__}, not a table object")
    if model is not None:
        raise ConfigError(f"--cost-model {model!r} picks a model of a runtime benchmark's JSON; {path!r} is a "
                          f"per-mode table")
    return _mode_table(data, path)


def load_step_costs(path: str, flag: str = "--auto-tiers") -> "autotier.StepCostTable":
    """A step-cost table file (``autotier.StepCostTable``'s JSON), or step traces (``.jsonl``, several joined by
    commas). Here, not in the pure ``dispatcher.plan``: reading traces is the engine's."""
    return read_step_costs(path, flag)[0]


def read_step_costs(path: str, flag: str = "--auto-tiers") -> tuple["autotier.StepCostTable", list | None]:
    """``load_step_costs``' table and, from step traces, their records (None from a table file), for what else the
    traces tell (``autotier.trace_host_floor``) without reading them again."""
    records = read_traces(path, flag) if path.endswith(".jsonl") else None
    if records is not None:
        table = autotier.trace_step_costs(records, f"{flag}: {path!r}")
    else:
        table = autotier.StepCostTable.from_json(load_json_file(path, flag), f"{flag}: {path!r}")
    table.source = path
    return table, records
