"""``--plot FILE.png``: output tok/s and mean TPOT against concurrency, one line per ``label``, from saved results.

Results of different servers or policies, saved with different ``--label``s, overlay on one figure. A point is
the median over the results of one label and concurrency (repeated runs); a run without a concurrency cap is
plotted at its ``num_prompts`` (every request in flight at once).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any, Iterable, Sequence

from dispatcher.bench import BenchError

NEEDED = ("label", "max_concurrency", "num_prompts", "output_throughput", "mean_tpot_ms")


def is_result(data: Any) -> bool:
    return isinstance(data, dict) and "output_throughput" in data and "max_concurrency" in data


def read_result_file(path: str) -> list[dict[str, Any]]:
    """The results in one file: a result object, or a list of them."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise BenchError(f"--plot: cannot read {path!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise BenchError(f"--plot: {path!r} is not JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError as exc:
        raise BenchError(f"--plot: {path!r} is not UTF-8 text (byte {exc.start}), so not JSON") from None
    items = data if isinstance(data, list) else [data]
    for item in items:
        missing = [f for f in NEEDED if not isinstance(item, dict) or f not in item]
        if missing:
            raise BenchError(f"--plot: {path!r} is not a bench result (no {', '.join(missing)})")
    return items


def load_results(sources: Iterable[str]) -> list[dict[str, Any]]:
    """Results from files, and from every ``*.json`` in the folders given (where files that are not bench
    results are skipped with a note)."""
    results: list[dict[str, Any]] = []
    for source in sources:
        if not os.path.isdir(source):
            results += read_result_file(source)
            continue
        for name in sorted(os.listdir(source)):
            path = os.path.join(source, name)
            if not name.endswith(".json") or not os.path.isfile(path):
                continue
            try:
                results += read_result_file(path)
            except BenchError:
                print(f"note: {path} is not a bench result; left out of the plot", file=sys.stderr)
    return results


def series(results: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, float, float]]]:
    """label -> [(concurrency, output tok/s, mean TPOT ms)] sorted by concurrency, medians over repeats."""
    points: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for r in results:
        concurrency = r["max_concurrency"] if r["max_concurrency"] is not None else r["num_prompts"]
        label = str(r["label"])
        points.setdefault(label, {}).setdefault(int(concurrency), []).append(
            (float(r["output_throughput"]), float(r["mean_tpot_ms"])))
    return {label: [(c, statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals))
                    for c, vals in sorted(by_c.items())]
            for label, by_c in sorted(points.items())}


def pyplot():
    """matplotlib.pyplot, drawing to files only (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def concurrency_axis(ax, ticks: Sequence[int], xlabel: str = "concurrency (requests in flight, at most)") -> None:
    """A panel against concurrency: the measured concurrencies as ticks (a log scale when they span 8x or more),
    a grid, the y axis from 0."""
    ax.set_xlabel(xlabel)
    if len(ticks) > 1 and ticks[-1] / ticks[0] >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.grid(True, alpha=0.3)
    ax.set_ylim(bottom=0)


def draw(lines: dict[str, list[tuple[int, float, float]]], path: str) -> None:
    plt = pyplot()
    fig, (ax_tok, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2 + 0.25 * max(0, len(lines) - 6)),
                                          constrained_layout=True)
    ticks = sorted({c for pts in lines.values() for c, _, _ in pts})
    cmap = plt.get_cmap("tab10" if len(lines) <= 10 else "tab20")  # (distinct colours up to 20 labels)
    for i, (label, pts) in enumerate(lines.items()):
        xs = [c for c, _, _ in pts]
        style = {"marker": "o", "color": cmap(i % cmap.N), "label": label}
        ax_tok.plot(xs, [t for _, t, _ in pts], **style)
        ax_tpot.plot(xs, [m for _, _, m in pts], **style)
    for ax, title in ((ax_tok, "output throughput (tok/s)"), (ax_tpot, "mean TPOT (ms)")):
        ax.set_title(title)
        concurrency_axis(ax, ticks)
    if len(lines) <= 6:
        ax_tok.legend(title="label")
    else:  # (more would cover the data: below both panels)
        fig.legend(*ax_tok.get_legend_handles_labels(), title="label", loc="outside lower center", ncols=3)
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise BenchError(f"--plot: cannot write {path!r}: {exc.strerror}") from None
    finally:
        plt.close(fig)


def plot_results(sources: Sequence[str], path: str, extra: Sequence[dict[str, Any]] = ()) -> dict:
    """Plot the results in ``sources`` (files or folders) and ``extra`` to ``path``; returns the plotted lines."""
    lines = series(load_results(sources) + list(extra))
    if not lines:
        raise BenchError(f"--plot: no bench results in {', '.join(sources) or 'this run'}")
    draw(lines, path)
    print(f"plot: {path} ({len(lines)} label(s): {', '.join(lines)})")
    return lines
