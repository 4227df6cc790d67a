"""``twogrid serve``'s start-up order (issue 33): the engine process, and its worker, start before the front end
imports torch or reads the model, so that their imports overlap the front end's; a bad flag that needs nothing to
be told fails before any process starts; one found later (it needs the model) stops the engine and its worker
unused, and a front end killed while starting leaves nothing either: no process, no ipc directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from serverutil import REPO, free_port, process_state

PROBE = r"""
import json, os, sys, time

import dispatcher.serve.launch as launch


def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as fh:
        return [int(p) for p in fh.read().split()]


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().rstrip(b"\0").split(b"\0")
    except FileNotFoundError:
        return []


def probe(args, real=launch._setup):
    seen = {"torch_imported": "torch" in sys.modules}
    engines, workers, deadline = [], [], time.monotonic() + 60
    while not workers and time.monotonic() < deadline:  # (the engine has no init yet: it is sent after this)
        engines = engines or [p for p in children(os.getpid()) if b"dispatcher.engine.service" in cmdline(p)]
        workers = [p for e in engines for p in children(e) if b"dispatcher.runtime.process" in cmdline(p)]
        time.sleep(0.02)  # (a process's command line is empty until its exec is through)
    seen.update(engines=engines, workers=workers, ipc=cmdline(engines[0])[-1].decode() if engines else None)
    print(json.dumps(seen), flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), 9)
    return real(args)


launch._setup = probe
from dispatcher.cli import main

sys.exit(main(sys.argv[2:]))
"""


def run_probe(mode: str, *serve_args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``twogrid serve`` with its setup (``_setup``, the first thing that imports torch) probed: the processes it
    finds started then, and whether torch was imported before; ``mode`` kill: the server SIGKILLs itself there."""
    cmd = [sys.executable, "-c", PROBE, mode, "serve", "--port", str(free_port()), *serve_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=180)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"the probe printed nothing (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc, json.loads(lines[0])


def wait_gone(pids: list[int], ipc: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while any(process_state(p) not in (None, "Z") for p in pids) or os.path.exists(ipc):
        assert time.monotonic() - t0 < timeout_s, (
            f"left behind after {timeout_s} s: {[(p, process_state(p)) for p in pids]}, ipc {os.path.exists(ipc)}")
        time.sleep(0.02)
    return time.monotonic() - t0


def test_engine_and_worker_start_before_torch_and_a_late_bad_flag_leaves_nothing():
    """The engine process, and its worker, run before the front end imports torch (the worker waits for the
    front end's settings meanwhile). --max-model-len beyond the model's positions needs the model's config, so it
    is found after they started: still one line naming the flag, exit code 2, and neither process nor the ipc
    directory is left once the server has exited."""
    proc, seen = run_probe("run", "--model", "tiny-dense", "--device", "cpu", "--max-model-len", "100000")
    assert not seen["torch_imported"]
    assert len(seen["engines"]) == 1 and len(seen["workers"]) == 1, seen
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("twogrid serve: error: --max-model-len must be in 1.."), err
    wait_gone(seen["engines"] + seen["workers"], seen["ipc"], timeout_s=1.0)


def test_a_server_killed_while_starting_leaves_nothing():
    """The server SIGKILLed after it started its engine, before it sent the engine its settings: the engine
    notices (as it does later), kills its worker, removes the ipc directory and exits."""
    proc, seen = run_probe("kill", "--model", "tiny-dense", "--device", "cpu")
    assert proc.returncode == -signal.SIGKILL
    assert len(seen["engines"]) == 1 and len(seen["workers"]) == 1, seen
    wait_gone(seen["engines"] + seen["workers"], seen["ipc"], timeout_s=5.0)


@pytest.mark.parametrize("args", [
    ["--port", "0"],
    ["--block-size", "0"],
    ["--gpu-memory-utilization", "1.5"],
    ["--compilation-config", "{not json"],
    ["--speculative-config", "[1"],
    ["--enable-auto-tool-choice"],
], ids=["port", "block size", "memory", "compilation", "speculative", "tool choice"])
def test_a_bad_flag_that_needs_no_model_fails_before_any_process_starts(args, monkeypatch, capsys):
    """Exit code 2 with its one line, and the engine is never spawned."""
    import dispatcher.engine.ipc as ipc
    from dispatcher.cli import main

    def spawn(*_a, **_k):
        raise AssertionError("the engine process was started")

    monkeypatch.setattr(ipc, "spawn_engine", spawn)
    assert main(["serve", "--model", "tiny-dense", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("twogrid serve: error: --"), err


@pytest.mark.parametrize("size", ["0", "100000"])
def test_a_tensor_parallel_size_no_machine_serves_starts_no_worker(size, monkeypatch, capsys):
    """More ranks than cores (or none): the engine starts without pre-starting its worker, and the setup's check
    refuses the size with its one line (the engine is stopped: nothing is left)."""
    import dispatcher.engine.ipc as ipc
    from dispatcher.cli import main

    asked, engines, real = [], [], ipc.spawn_engine

    def spawn(log_level, num_ranks):
        asked.append(num_ranks)
        engines.append(real(log_level, num_ranks))
        return engines[-1]

    monkeypatch.setattr(ipc, "spawn_engine", spawn)
    assert main(["serve", "--model", "tiny-dense", "--device", "cpu", "--tensor-parallel-size", size]) == 2
    assert asked == [0] and not engines[0].alive() and not os.path.exists(engines[0].dir)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("twogrid serve: error: --tensor-parallel-size"), err


@pytest.mark.parametrize("tokenizer", ["directory", "gguf"])
def test_the_other_front_ends_import_no_torch(tokenizer, bpe):
    """Front ends 1..N start after front end 0's setup and gate /health (``FrontEnds.open_gate``): what they import
    and their tokenizer (a Hugging Face tokenizer directory, or the default model's GGUF, read by
    ``models.gguf_file``) leave torch out, so that they are up in a second or two, not the four that importing torch
    took them beside the engine and the worker (on the H200 /health turned 200 a second after the engine was ready,
    waiting for them)."""
    if tokenizer == "gguf":
        from models.default_model import default_model_path

        source = default_model_path()
    else:
        source = bpe
    code = ("import sys; import dispatcher.serve.frontend; from dispatcher.serve.app import build_app; "
            "from dispatcher.serve.client import EngineClient; from dispatcher.serve.metrics import EngineMetrics; "
            f"from models.text import load_tokenizer; tok = load_tokenizer({source!r}); assert tok.encode('hello'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
