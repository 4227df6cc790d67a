"""Shared by the benchmark scripts: make the repository importable and write results."""

from __future__ import annotations

import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def conversations_file(data: str, count: int, turns: int, tag: str, path: str) -> str:
    """``count`` conversations of ``turns`` user turns each, chained from the ShareGPT file's first turns (in file
    order, cycled), every turn led by a tag of its own (``tag``, the conversation's index and the turn's), written
    to ``path`` as ShareGPT JSON: no two conversations of any run share more than the chat template's head, and no
    turn's text is another's (the file's 500 prompts cycle; a front end that keeps the tokens of messages it saw,
    dispatcher/serve/tokenizing.py, would otherwise find a later conversation's turns among an earlier one's)."""
    with open(data, encoding="utf-8") as fh:
        entries = json.load(fh)
    prompts = [t["value"] for e in entries for t in e.get("conversations", ())
               if t.get("from") in ("human", "user") and isinstance(t.get("value"), str) and t["value"].strip()]
    convs = []
    for i in range(count):
        turns_json = []
        for j in range(turns):
            text = f"[{tag} conversation {i} turn {j}] {prompts[(i * turns + j) % len(prompts)]}"
            turns_json += [{"from": "human", "value": text}, {"from": "gpt", "value": ""}]
        convs.append({"id": f"{tag}-{i}", "conversations": turns_json})
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(convs, fh)
    return path


def write_json(path: str | None, result: dict) -> None:
    """Write ``result`` whole or not at all (a temporary file renamed over ``path``): scripts rewrite their JSON
    after every row and may be stopped by a time limit at any moment."""
    if path:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)


FRONT_END_SETUP = re.compile(r"front end set up ([0-9.]+) s after the server process started \(the engine process "
                             r"started at ([0-9.]+) s\)")
"""``twogrid serve``'s start-up log line (``dispatcher.serve.launch._start``)."""


def front_end_setup(log_text: str) -> dict:
    """From a server's log: its front end's own setup time and when it started the engine process, seconds after
    the server process started (None each where the line is missing)."""
    found = FRONT_END_SETUP.search(log_text)
    return {"front_end_setup_s": float(found.group(1)) if found else None,
            "engine_spawned_s": float(found.group(2)) if found else None}


LOOP_HELD = re.compile(r"^\S+ \S+ (.+?) WARNING the event loop was held ([0-9]+) ms"
                       r"(?: \(and ([0-9]+) more holds since the last line\))?, in: (.*)$", re.M)
"""A serving process's log line for a long hold of its event loop (``dispatcher.child.LoopWatch``)."""


def loop_holds(log_text: str, top: int = 3) -> dict:
    """From a server's log: its processes' event-loop holds of 20 ms or more (``LoopWatch``): how many, the longest,
    how many per process (its logger: the engine's ``twogrid.engine``, front end 0's ``twogrid``, the others'
    ``front end N``) and the places most often the longest of a line's holds (a line reports the longest of the
    holds since the one before)."""
    lines = LOOP_HELD.findall(log_text)
    per_process: dict[str, int] = {}
    places: dict[str, int] = {}
    for who, _, more, where in lines:
        per_process[who] = per_process.get(who, 0) + 1 + int(more or 0)
        place = where.split(" (")[0]
        places[place] = places.get(place, 0) + 1
    return {"loop_holds": sum(per_process.values()),
            "loop_held_ms_max": max((int(ms) for _, ms, _, _ in lines), default=0),
            "loop_holds_by_process": per_process,
            "loop_hold_places": sorted(places.items(), key=lambda kv: -kv[1])[:top]}


def stop_server(proc) -> None:
    """SIGTERM a server process (a ``subprocess.Popen``) and wait for it to drain and exit; SIGKILL after 60 s."""
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def commit() -> str | None:
    """The commit measured: $TWOGRID_COMMIT when set (a device machine's copy of .git can be older than the tree
    sent to it), else the tree's git HEAD, else None."""
    import subprocess

    if os.environ.get("TWOGRID_COMMIT"):
        return os.environ["TWOGRID_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def join_runs(parts: list[tuple[str, dict]], cell, shared: tuple[str, ...],
              run_fields: tuple[str, ...] = ()) -> tuple[list[dict], list[dict], list[dict]]:
    """Join benchmark runs (``(path, result)`` pairs, each with ``command``, ``commit`` and ``rows``) into
    ``(runs, rows, superseded_rows)``. A cell (``cell(row)``) keeps every row from one run, so that each ratio
    is taken within that run; a later part that measured the same cell replaces it whole, the replaced rows kept
    apart. Each row names its run (``run``: an index into ``runs``, which keeps every run's file, command,
    commit and ``run_fields``). SystemExit when a part differs from the first in a ``shared`` field."""
    runs, cells, superseded = [], {}, []
    for path, part in parts:
        if runs and any(part.get(k) != runs[0].get(k) for k in shared):
            raise SystemExit(f"{path}: {', '.join(shared)} differ from {runs[0]['file']}'s")
        run = len(runs)
        runs.append({"file": os.path.basename(path), "command": part["command"], "commit": part["commit"],
                     **{k: part.get(k) for k in (*shared, *run_fields)}})
        measured: dict[tuple, list[dict]] = {}
        for row in part["rows"]:
            measured.setdefault(cell(row), []).append({**row, "run": run})
        for key, rows in measured.items():
            lost = {r["policy"] for r in cells.get(key, [])} - {r["policy"] for r in rows}
            if lost:  # (a rerun cut short: replacing the cell would drop those policies' rows unseen)
                raise SystemExit(f"{path}: cell {key} lacks {', '.join(sorted(lost))}, which an earlier file "
                                 f"measured: a rerun replaces a whole cell (leave that file out, or rerun those)")
            superseded += cells.get(key, [])
            cells[key] = rows
    return runs, [r for rows in cells.values() for r in rows], superseded


def check_targets(rows: list[dict], label, header: str, rivals: tuple[str, ...] = (),
                  repeat_rows: tuple[dict, ...] = ()) -> list[str]:
    """Separate grids against vllm-default (issues 11 and 14), one line per cell (``label(row)`` names it under
    ``header``), misses named: under 90% of the bound, under 0.98x at 1 and 16, under a ``rivals`` policy. Against
    a rival, separate's tok/s over the rival's is taken within each run that measured both in the cell: the
    table's run and any ``repeat_rows`` runs (rows measured again only to settle that comparison; their ``run``
    keys differ from the table's); the median decides, and every run's ratio is shown when there are several."""
    lines = [f"{header} {'conc':>5s} {'ratio':>6s} {'paired':>6s} {'bound':>6s} {'of bound':>8s}  verdict"]
    runs_of: dict[tuple, dict] = {}  # (label, concurrency) -> {run: {policy: row}}
    for o in (*rows, *repeat_rows):
        runs_of.setdefault((label(o), o["concurrency"]), {}).setdefault(o["run"], {})[o["policy"]] = o
    for r in rows:
        if r["policy"] != "separate":
            continue
        if "tok_s_ratio" not in r:
            lines.append(f"{label(r)} {r['concurrency']:5d}  no ratio: vllm-default not measured in this run")
            continue
        ratio, bound = r["tok_s_ratio"], r["bound_ratio"]
        paired = r.get("tok_s_ratio_paired", r.get("paired_ratio_median"))
        misses, notes = [], []
        if ratio < 0.9 * bound:
            misses.append("< 90% of bound")
        if r["concurrency"] in (1, 16) and ratio < 0.98:
            misses.append("< 0.98x")
        runs = runs_of[label(r), r["concurrency"]].values()
        for rival in rivals:
            ratios = [run["separate"]["output_tok_s"] / run[rival]["output_tok_s"] for run in runs
                      if "separate" in run and rival in run]
            if not ratios:
                continue
            median = statistics.median(ratios)
            runs = f" of {len(ratios)} runs: " + ", ".join(f"{x:.3f}" for x in ratios) if len(ratios) > 1 else ""
            if median < 1:
                misses.append(f"< {rival} ({median:.3f}{' median' + runs if runs else ''})")
            elif runs:
                notes.append(f"{rival} {median:.3f} median{runs}")
        paired = "-" if paired is None else f"{paired:.3f}"
        verdict = "; ".join(misses) or "ok" + (f" ({'; '.join(notes)})" if notes else "")
        lines.append(f"{label(r)} {r['concurrency']:5d} {ratio:6.3f} {paired:>6s} {bound:6.3f} "
                     f"{ratio / bound:8.2f}  {verdict}")
    return lines


def markdown_grid(rows: list[dict], table_of, line_of, cell) -> str:
    """Markdown tables of rows: one per ``table_of(row)`` (its title), a line per ``line_of(row)`` (its name), a
    column per concurrency, each cell ``cell(row)`` (empty where the line has no row at that concurrency); tables,
    lines and concurrencies in the rows' order of first appearance (concurrencies sorted)."""
    out, tables = [], {}
    for r in rows:
        tables.setdefault(table_of(r), {}).setdefault(line_of(r), {})[r["concurrency"]] = r
    for title, lines in tables.items():
        concs = sorted({c for by_conc in lines.values() for c in by_conc})
        out += [f"| {title} | " + " | ".join(map(str, concs)) + " |", "|---" * (len(concs) + 1) + "|"]
        for name, by_conc in lines.items():
            out.append(f"| {name} | " + " | ".join(cell(by_conc[c]) if c in by_conc else "" for c in concs) + " |")
        out.append("")
    return "\n".join(out)


def markdown_tables(rows: list[dict], group) -> str:
    """One table per ``group(row)`` (a tuple of names): output tok/s per policy and concurrency; other policies
    than vllm-default show (ratio to it / bound); eager steps where there were more than one."""
    def cell(r: dict) -> str:
        text = f"{r['output_tok_s']:.0f}"
        if r["policy"] != "vllm-default" and "tok_s_ratio" in r:
            text += f" ({r['tok_s_ratio']:.2f}x / {r['bound_ratio']:.2f})"
        if r["eager_steps"] > 1 and r["policy"] != "eager":
            text += f", {r['eager_steps']} eager"
        return text

    return markdown_grid(rows, lambda r: ", ".join(group(r)),
                         lambda r: f"**{r['policy']}**" if r["policy"] == "separate" else r["policy"], cell)


def kv_blocks(model: str, gib: float, block_size: int = 16) -> int:
    """KV blocks of ``block_size`` tokens that ``gib`` GiB hold for the model in bfloat16."""
    import torch

    from dispatcher.runtime.process import kv_bytes_per_block
    from models.loader import read_model_config

    return int(gib * 2**30 // kv_bytes_per_block(read_model_config(model), block_size, torch.bfloat16))
