"""Comparing capture plans: two plans per runner and kind (``plan --diff``), and a sweep of many configs
against the legacy shared-list baseline (``plan --matrix``)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterator

from dispatcher.plan.config import ConfigError, resolve
from dispatcher.plan.capture_plan import DRAFT_MODEL, CapturePlan, GraphSet, baseline_plan, build_plan, coverage

IDENTICAL, GAINS, LOSES, REGRID = "identical", "gains coverage", "loses coverage", "same reach, other sizes"
STATUSES = (IDENTICAL, GAINS, LOSES, REGRID)


@dataclass(frozen=True)
class SetDiff:
    runner: str
    kind: str
    q: int | None
    before: tuple[int, ...]
    after: tuple[int, ...]
    serves: tuple[tuple[int, int], ...] | None = None
    """Batch ranges these graphs can be asked for; coverage outside them is unreachable and does not count."""

    def _reach(self, sizes: tuple[int, ...]) -> int:
        return coverage(sizes, self.serves)

    @property
    def status(self) -> str:
        if self.before == self.after:
            return IDENTICAL
        reach_a, reach_b = self._reach(self.before), self._reach(self.after)
        if reach_b > reach_a:
            return GAINS
        if reach_b < reach_a:
            return LOSES
        return REGRID

    @property
    def graph_delta(self) -> int:
        return len(self.after) - len(self.before)

    def to_dict(self) -> dict[str, Any]:
        return {
            "runner": self.runner,
            "kind": self.kind,
            "q": self.q,
            "status": self.status,
            "graphs_before": len(self.before),
            "graphs_after": len(self.after),
            "graph_delta": self.graph_delta,
            "covered_before": self._reach(self.before),
            "covered_after": self._reach(self.after),
        }


def _keyed(sets) -> dict[tuple, GraphSet]:
    out: dict[tuple, GraphSet] = {}
    for g in sets:
        if not isinstance(g, GraphSet):  # a plan entry loaded from JSON
            g = GraphSet(g["runner"], g["kind"], g.get("q"), tuple(g["sizes"]))
        out[(g.runner, g.kind, g.q)] = g
    return out


def diff_sets(before, after) -> list[SetDiff]:
    """Per (runner, kind, q): the sizes before and after; a set missing on one side counts as empty.
    Coverage is compared up to the widest batch the set can serve, where the plan knows it."""
    a, b = _keyed(before), _keyed(after)
    out = []
    for key in dict.fromkeys([*a, *b]):
        ga, gb = a.get(key), b.get(key)
        serves = next((g.serves for g in (gb, ga) if g is not None and g.serves is not None), None)
        out.append(SetDiff(*key, ga.sizes if ga else (), gb.sizes if gb else (), serves))
    return out


def diff_plans(before: CapturePlan | dict, after: CapturePlan | dict) -> list[SetDiff]:
    sets = lambda p: p.graph_sets if isinstance(p, CapturePlan) else p["runners"]  # noqa: E731
    return diff_sets(sets(before), sets(after))


# ----------------------------------------------------------------------------------------------------------
# Matrix sweep
# ----------------------------------------------------------------------------------------------------------

MATRIX_PLATFORMS = ("sm100", "default")
MATRIX_MAX_NUM_SEQS = (1, 8, 72, 128, 256, 512, 1024)
MATRIX_K = (0, 1, 3, 5, 7, 15)
MATRIX_TIERS = ("none", "7/3/1")
MATRIX_MAX_NUM_BATCHED_TOKENS = (2048, 8192, 16384)
MATRIX_SIZING: dict[str, dict[str, Any]] = {
    "default": {},
    "legacy max 1024": {"max_cudagraph_capture_size": 1024},
    "legacy max 8192": {"max_cudagraph_capture_size": 8192},
    "legacy pow2 list": {"cudagraph_capture_sizes": [1 << i for i in range(10)]},
}
MATRIX_DRAFT_MODEL = "tiny-dense"
"""The draft LM named for method draft_model (required there; plans do not depend on which LM it is)."""


def _tiers(k: int) -> list[list[int]] | None:
    """The 7/3/1 ladder clipped to K: [[1, K], [65, min(K, 3)], [257, 1]], equal neighbours merged."""
    tiers: list[list[int]] = []
    for lo, tk in ((1, k), (65, min(k, 3)), (257, 1)):
        if not tiers or tiers[-1][1] != tk:
            tiers.append([lo, tk])
    return tiers if len(tiers) > 1 else None


def matrix_configs(methods: tuple[str, ...] = ("eagle3",)) -> Iterator[dict[str, Any]]:
    """Every point of the sweep (duplicates skipped: no SD ignores method and tiers)."""
    for platform, mns, k, tiers, mnbt, sizing in itertools.product(
        MATRIX_PLATFORMS, MATRIX_MAX_NUM_SEQS, MATRIX_K, MATRIX_TIERS, MATRIX_MAX_NUM_BATCHED_TOKENS, MATRIX_SIZING
    ):
        for method in methods if k else (None,):
            spec = None
            if k:
                spec = {"method": method, "num_speculative_tokens": k}
                if method == DRAFT_MODEL:
                    spec["model"] = MATRIX_DRAFT_MODEL
                if tiers != "none":
                    ladder = _tiers(k)
                    if ladder is None:
                        continue
                    spec["num_speculative_tokens_per_batch_size"] = ladder
            elif tiers != "none":
                continue
            yield {
                "platform": platform,
                "max_num_seqs": mns,
                "max_num_batched_tokens": mnbt,
                "compilation_config": MATRIX_SIZING[sizing],
                "speculative_config": spec,
                "sizing": sizing,
                "tiers": tiers,
            }


def run_matrix(methods: tuple[str, ...] = ("eagle3",)) -> dict[str, Any]:
    """Sweep the matrix; per (runner, kind): how many configs are identical / gain / lose / regrid against
    the legacy shared-list baseline, and graph counts."""
    summary: dict[tuple[str, str], dict[str, Any]] = defaultdict(
        lambda: {**{s: 0 for s in STATUSES}, "graphs_before": 0, "graphs_after": 0, "sets": 0}
    )
    configs = errors = 0
    losses: list[dict[str, Any]] = []
    for point in matrix_configs(methods):
        configs += 1
        try:
            cfg = resolve(
                point["compilation_config"],
                point["speculative_config"],
                platform=point["platform"],
                max_num_seqs=point["max_num_seqs"],
                max_num_batched_tokens=point["max_num_batched_tokens"],
            )
        except ConfigError:
            errors += 1
            continue
        for d in diff_plans(baseline_plan(cfg), build_plan(cfg)):
            runner = d.runner if d.runner == "target" else ("drafter" + d.runner[len(cfg.method or "") :])
            row = summary[(runner, d.kind)]
            row[d.status] += 1
            row["sets"] += 1
            row["graphs_before"] += len(d.before)
            row["graphs_after"] += len(d.after)
            if d.status == LOSES and len(losses) < 20:
                losses.append({**{k: v for k, v in point.items() if k != "compilation_config"}, **d.to_dict()})
    rows = [
        {"runner": r, "kind": k, **v, "graph_delta": v["graphs_after"] - v["graphs_before"]}
        for (r, k), v in sorted(summary.items())
    ]
    return {"configs": configs, "invalid_configs": errors, "methods": list(methods), "summary": rows,
            "loss_examples": losses}
