"""Start-up (issue 33): the worker's phases (``WorkerReady.startup``: imports, settings, weights, grid_fit, kv_sizing,
kv_allocation, kernels, capture, measure), what is kept across restarts under $TWOGRID_CACHE (the step cost fitted
grids come from; Triton's kernels), and the messages and metrics that carry capture progress. CPU, tiny presets."""

from __future__ import annotations

import importlib
import os
import time

import pytest

pytest.importorskip("torch")

from dispatcher.child import seconds_since_start  # noqa: E402
from dispatcher.messages import (CaptureProgress, GraphCount, StepResult, WorkerInit, decode_to_engine,  # noqa: E402
                                 encode, resolve_init)
from dispatcher.plan.capture_plan import build_plan  # noqa: E402
from dispatcher.runtime.process import STARTUP_PHASES, build_worker  # noqa: E402


def init_for(compilation: dict, max_num_batched_tokens: int = 64) -> WorkerInit:
    return WorkerInit("tiny-dense", "cpu", "float32", "sm100", 4, max_num_batched_tokens, compilation, {}, 16, 64, 5,
                      32, 0.9, 0, True)


def test_fitted_grids_are_measured_once_then_read_back_and_the_engine_agrees(tmp_path, monkeypatch):
    """fit_cudagraph_capture_sizes: the first start measures the step cost (phase grid_fit) and keeps it under
    $TWOGRID_CACHE/grid_cost; a restart reads it back (no measurement) and so fits the same grids; the engine,
    resolving from WorkerReady.grid_cost, builds exactly the worker's plan."""
    monkeypatch.setenv("TWOGRID_CACHE", str(tmp_path))
    init = init_for({"fit_cudagraph_capture_sizes": True}, max_num_batched_tokens=16)
    worker, ready = build_worker(init)
    assert list(ready.startup) == list(STARTUP_PHASES) and ready.startup["grid_fit"] > 0
    assert ready.grid_cost["source"].startswith("measured (kept in ") and os.listdir(tmp_path / "grid_cost")
    engine_plan = build_plan(resolve_init(init, ready.grid_cost))
    assert worker.runtime.graph_sets == list(g for g in engine_plan.for_runner("target") if g.sizes)
    again, ready2 = build_worker(init)
    assert ready2.grid_cost["source"] == str(next((tmp_path / "grid_cost").iterdir()))
    assert build_plan(resolve_init(init, ready2.grid_cost)) == engine_plan
    assert [g.sizes for g in again.runtime.graph_sets] == [g.sizes for g in worker.runtime.graph_sets]
    assert ready2.startup["grid_fit"] < ready.startup["grid_fit"]


def test_delayed_capture_reports_what_is_left_and_capture_first_what_it_captured():
    worker, ready = build_worker(init_for({"delayed_cudagraph_capture": True}))
    progress = ready.capture_progress
    assert progress is not None and progress.num_captured == 0 and progress.num_total == 7 + 4 + 4
    assert ready.capture == [] and ready.startup["capture"] == 0.0 and worker.capture_pending
    worker2, ready2 = build_worker(init_for({}))
    assert ready2.capture_progress is None and not worker2.capture_pending
    assert sum(k["graphs"] for k in ready2.capture) == 7 + 4


def test_seconds_since_start_counts_from_the_process_start():
    age = seconds_since_start()
    with open("/proc/uptime", encoding="ascii") as fh:
        uptime = float(fh.read().split()[0])
    assert age is not None and 0 < age < uptime
    time.sleep(0.05)
    assert seconds_since_start() >= age


def test_triton_cache_defaults_under_twogrid_cache(tmp_path, monkeypatch):
    from dispatcher.serve.launch import default_triton_cache

    monkeypatch.setenv("TWOGRID_CACHE", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    default_triton_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    default_triton_cache()
    assert os.environ["TRITON_CACHE_DIR"] == "/elsewhere"


def test_capture_progress_and_not_captured_travel_to_the_engine():
    progress = CaptureProgress([GraphCount("target", "piecewise", 3, 39), GraphCount("step", "fused_decode", 0, 48)],
                               1.5, False)
    back = decode_to_engine(encode(progress))
    assert back == progress and (back.num_captured, back.num_total) == (3, 87)
    result = StepResult(7, b"", b"", 1, not_captured=["step", "target"])
    assert decode_to_engine(encode(result)).not_captured == ["step", "target"]
    assert decode_to_engine(encode(StepResult(8, b"", b"", 1))).not_captured == []


def test_graph_count_and_startup_gauges():
    from prometheus_client.parser import text_string_to_metric_families

    from dispatcher.serve.metrics import EngineMetrics

    m = EngineMetrics("m")
    m.set_graph_counts([("target", "piecewise", 3, 39), ("step", "fused_decode", 0, 48)], 2.5)
    m.set_startup({"imports": 1.25, "capture": 0.0})
    samples = {(s.name, s.labels.get("runner"), s.labels.get("kind"), s.labels.get("phase")): s.value
               for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert samples[("twogrid:cudagraphs_captured", "target", "piecewise", None)] == 3
    assert samples[("twogrid:cudagraphs_planned", "step", "fused_decode", None)] == 48
    assert samples[("twogrid:capture_seconds", None, None, None)] == 2.5
    assert samples[("twogrid:startup_phase_seconds", None, None, "imports")] == 1.25


def test_gpu_memory_utilization_is_this_servers_share_of_the_device():
    """As vLLM's: another process's memory does not shrink the KV cache (two servers at 0.45 share a GPU; the
    grid-fit benchmark runs three at 0.28, started one after another), what this process took since it started
    does (its weights, buffers, libraries' workspaces), the graphs do; a share that other processes leave no room
    for is refused, naming the flag, not squeezed into what is free (the eager steps' activations need the rest)."""
    from dispatcher.runtime.process import MemorySnapshot, kv_cache_bytes

    gib = 2**30
    start = MemorySnapshot(free=100 * gib, total=140 * gib, torch_reserved=0)  # 40 GiB: another server, our context
    now = MemorySnapshot(free=90 * gib, total=140 * gib, torch_reserved=10 * gib)  # our weights and buffers
    assert kv_cache_bytes(start, now, 0.5, 2 * gib, 0) == 70 * gib - 10 * gib - 2 * gib
    grew = MemorySnapshot(free=89 * gib, total=140 * gib, torch_reserved=10 * gib)  # +1 GiB of our workspaces
    assert kv_cache_bytes(start, grew, 0.5, 2 * gib, 0) == 57 * gib
    probe = gib // 4  # the sizing probe's cache, held now, replaced by the real one
    probed = MemorySnapshot(free=90 * gib - probe, total=140 * gib, torch_reserved=10 * gib + probe)
    assert kv_cache_bytes(start, probed, 0.5, 2 * gib, probe) == 58 * gib
    with pytest.raises(RuntimeError, match=r"gpu_memory_utilization = 0.9 asks 126.0 GiB .* KV cache 114.0 GiB, "
                                           r"but 88.0 GiB is free .* hold 40.0 GiB\): lower --gpu-memory-utilization"):
        kv_cache_bytes(start, now, 0.9, 2 * gib, 0)  # (126 - 10 - 2 GiB, where 140 - 40 - 10 - 2 are free)


def test_waiting_for_the_servers_settings_is_its_own_phase():
    """The worker starts before the front end has read the model and planned (``twogrid serve`` spawns it first):
    the time from its imports' end to its ``WorkerInit`` is ``settings``, not ``imports`` (on the H200 "imports"
    read 4.4 s, of which the wait for the front end's setup was an unknown share)."""
    imported = seconds_since_start() - 1.0  # (as if this process's imports had ended a second ago)
    _, ready = build_worker(init_for({}), imported_s=imported)
    assert list(ready.startup) == list(STARTUP_PHASES)
    assert ready.startup["settings"] >= 1.0 and abs(ready.startup["imports"] - imported) < 0.01


def test_startup_benchmark_starts_warm_on_the_cache_of_the_start_before(monkeypatch, tmp_path):
    """``bench_startup_gpu.py --starts``: a cold start gets a fresh cache, a warm one the previous start's; a warm
    start first or an unknown mode is refused naming it (a GPU session runs only the starts it has time for)."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                             "benchmarks"))
    bench = importlib.import_module("bench_startup_gpu")
    plan = bench.start_plan("delayed:cold,delayed:warm,capture-first:cold,capture-first:warm", str(tmp_path))
    assert [(m, t) for m, t, _ in plan] == [("delayed", "cold"), ("delayed", "warm"), ("capture-first", "cold"),
                                           ("capture-first", "warm")]
    assert plan[0][2] == plan[1][2] != plan[2][2] == plan[3][2]
    default = bench.start_plan(",".join(bench.STARTS), str(tmp_path))
    assert [c for _, _, c in default] == [default[0][2]] * 3 + [default[3][2]] and default[3][2] != default[0][2]
    for bad, named in (("delayed:warm", "comes first"), ("eager:cold", "'eager:cold'"), ("delayed", "'delayed'")):
        with pytest.raises(ValueError, match=named):
            bench.start_plan(bad, str(tmp_path))


def test_a_load_on_cuda_leaves_nothing_reserved_for_the_kv_sizing(monkeypatch, tmp_path):
    """The target's load and a draft model's (which the KV sizing probe loads before its memory snapshot) go through
    ``load_model``; on CUDA a GGUF's tensors are decoded on the device, and what the decoding left reserved in the
    allocator's cache would count as this server's weights and shrink the KV cache: ``load_model`` empties the cache
    after any load on CUDA, and only there."""
    import torch

    from models import loader

    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(12))
    events = []
    model = torch.nn.Linear(2, 2)  # (a module: the load checks its weights are finite)
    monkeypatch.setattr(loader, "load_gguf", lambda *args: events.append(("load", str(args[1]))) or model)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    assert loader.load_model(str(path), "cuda", torch.bfloat16) is model
    assert loader.load_model(str(path), torch.device("cuda", 1), torch.bfloat16) is model
    assert loader.load_model(str(path), "cpu", torch.float32) is model
    assert events == [("load", "cuda"), "empty_cache", ("load", "cuda:1"), "empty_cache", ("load", "cpu")]


def test_a_profiled_process_writes_its_summary_and_its_whole_profile(tmp_path, monkeypatch):
    """``TWOGRID_PROFILE_DIR`` (the start-up diagnostic): each role writes ``<role>.txt``, its functions by own and
    cumulative time, and ``<role>.prof``, which pstats reads whole (where the worker's start-up time went was found
    in it)."""
    import pstats

    from dispatcher.child import profiled

    monkeypatch.setenv("TWOGRID_PROFILE_DIR", str(tmp_path))

    def busy(n: int) -> int:
        return sum(i * i for i in range(n))

    assert profiled("worker", busy, 1000) == busy(1000)
    text = (tmp_path / "worker.txt").read_text()
    assert "Ordered by: internal time" in text and "Ordered by: cumulative time" in text
    stats = pstats.Stats(str(tmp_path / "worker.prof"))
    assert any(func[2] == "busy" for func in stats.stats)
