"""Delayed capture (``delayed_cudagraph_capture``, dispatcher/runtime/capture.py): the engine serves before its graphs
are captured, steps whose graph is not captured yet run without it (op by op instead of fused, or that forward
eagerly: trace ``not_captured``, eager cause ``not_captured_yet``), and the worker captures the rest between steps,
demand first. On the CPU the static backend captures nothing: a graph's capture is its mark (``captured``), which a
test hook makes slow or failing, and dispatch follows the marks exactly as it follows real graphs on a GPU.

What a user relies on: the same tokens as a server that captured first; no step replays a graph that is not
captured whole; every graph is captured exactly once, the ones the steps need first; a capture that fails leaves
its graph's steps eager, not wrong; through ``twogrid serve``: /health 200 before capture ends, the graph gauges
rise to the plan's totals, and a worker killed mid-capture fails the server as any killed worker does."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

torch = pytest.importorskip("torch")

from dispatcher.engine.engine_core import EngineArgs, EngineCore  # noqa: E402
from dispatcher.plan.config import resolve  # noqa: E402
from dispatcher.plan.dispatch import MODE_EAGER, NOT_CAPTURED_YET  # noqa: E402
from dispatcher.runtime import capture as capture_mod  # noqa: E402
from dispatcher.runtime.decode_step import FusedDecode  # noqa: E402
from dispatcher.runtime.graphs import CaptureOOMError, GraphRuntime  # noqa: E402
from models.config import preset  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402

SPECS = [None, {"method": "eagle3", "num_speculative_tokens": 3}, {"method": "ngram", "num_speculative_tokens": 2}]
K0_TIER = {"method": "eagle3", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 2], [4, 0]]}
"""A tier of K = 0 under EAGLE-3: its steps still run the head's step 0 (its KV), on FULL decode graphs of their
own and fused (``drafting.py``), which delayed capture captures like the others."""
DRAFT_MODEL = {"method": "draft_model", "model": "tiny-dense", "num_speculative_tokens": 3}
"""A draft LM: its own runner's graphs, no fused decode steps."""


def engine_for(spec, delayed: bool, trace=None, device: str = "cpu") -> EngineCore:
    cc = {"delayed_cudagraph_capture": True} if delayed else {}
    cfg = resolve(cc, spec, platform="sm100", max_num_seqs=8, max_num_batched_tokens=64)
    return EngineCore(cfg, EngineArgs(preset("tiny-dense"), device=device, dtype=torch.float32, num_kv_blocks=256,
                                      block_size=4, max_model_len=96, seed=5, step_trace=trace))


def prompts(count: int = 5) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 500 + 3 for j in range(5 + 6 * i)] for i in range(count)]


@pytest.fixture
def slow_units(monkeypatch):
    """Each unit's capture takes 2 ms on the CPU, so that the 2 ms gap budget captures about one unit a step and
    capture spreads over the run (the order of every unit captured, with its step count, is recorded)."""
    order = []

    def hook(unit):
        order.append(unit)
        time.sleep(0.002)

    real = capture_mod.BackgroundCapture.__init__

    def init(self, worker, warm_ups=None, hook_=None):
        real(self, worker, warm_ups, hook)

    monkeypatch.setattr(capture_mod.BackgroundCapture, "__init__", init)
    return order


@pytest.mark.parametrize("spec", SPECS + [K0_TIER, DRAFT_MODEL],
                         ids=["no-sd", "eagle3", "ngram", "eagle3-k0-tier", "draft-model"])
def test_delayed_capture_gives_the_tokens_of_capture_first(spec, slow_units, tmp_path):
    """Greedy and seeded-sampled requests: the same tokens and acceptance as an engine that captured first. The
    first steps run without graphs, counted under eager cause not_captured_yet and named in the trace; once idle
    the worker captures every graph left, and later steps replay them (uniform decodes fused)."""
    params = [SamplingParams(max_tokens=10, temperature=0.0), SamplingParams(max_tokens=6, temperature=0.8, seed=3)]
    first = engine_for(spec, False)
    trace = str(tmp_path / "trace.jsonl")
    delayed = engine_for(spec, True, trace)
    assert delayed.worker.delayed is not None and delayed.capture_report is None
    for p in params:
        assert delayed.generate(prompts(), p) == first.generate(prompts(), p)
    s, f = delayed.stats, first.stats
    assert (s.num_drafts, s.num_accepted_tokens) == (f.num_drafts, f.num_accepted_tokens)
    assert f.eager_by_reason == {} and s.eager_by_reason.get(NOT_CAPTURED_YET, 0) >= 1
    delayed.worker.capture_between_steps(None)  # the rest, as the worker process does once idle
    assert delayed.worker.delayed is None
    for rt in delayed.worker.runtimes:
        assert rt.captured == set(rt.layouts)
    assert delayed.worker.fused.captured == set(delayed.worker.fused.graphs)
    fused, not_captured = s.fused_steps, s.eager_by_reason[NOT_CAPTURED_YET]
    assert delayed.generate(prompts(), params[0]) == first.generate(prompts(), params[0])
    assert (s.fused_steps > fused) == (spec is not DRAFT_MODEL)  # (a draft model's steps are not fused)
    assert s.eager_by_reason[NOT_CAPTURED_YET] == not_captured
    delayed.close()
    records = [json.loads(line) for line in open(trace, encoding="utf-8")]
    missing = [r for r in records if "not_captured" in r]
    assert missing and missing[0]["step"] == records[0]["step"]
    for r in missing:
        if "target" in r["not_captured"]:
            assert r["mode"] == MODE_EAGER and r["padded_tokens"] == r["tokens"]
            assert "was not captured yet" in r["eager_reason"]


def test_no_step_replays_a_graph_not_captured_whole_and_each_is_captured_once(slow_units, monkeypatch):
    """Every forward that replays a graph (a runner's FULL or PIECEWISE graph, a fused step) finds it in its
    runtime's ``captured`` set, and no step is submitted while a unit is being captured; each unit is captured
    once; after the largest graph of each kind (it sizes the memory pool) comes the graph the first step needed
    (demand before the plan's order)."""
    violations, capturing = [], [False]
    execute, execute_next, fused_run = GraphRuntime.execute, GraphRuntime.execute_next, FusedDecode.run

    def checked_execute(self, desc, inputs, aux=None):
        if desc.graph is not None and desc.graph not in self.captured:
            violations.append((self.runner, desc.graph))
        return execute(self, desc, inputs, aux)

    def checked_next(self, desc, num_real):
        if desc.graph not in self.captured:
            violations.append((self.runner, desc.graph))
        return execute_next(self, desc, num_real)

    def checked_fused(self, key, *args):
        if key not in self.captured:
            violations.append(("step", key))
        return fused_run(self, key, *args)

    monkeypatch.setattr(GraphRuntime, "execute", checked_execute)
    monkeypatch.setattr(GraphRuntime, "execute_next", checked_next)
    monkeypatch.setattr(FusedDecode, "run", checked_fused)
    engine = engine_for({"method": "eagle3", "num_speculative_tokens": 3}, True)
    real_hook = engine.worker.delayed.hook

    def hook(unit):
        capturing[0] = True
        real_hook(unit)
        capturing[0] = False

    engine.worker.delayed.hook = hook
    submit = engine.worker.submit
    engine.worker.submit = lambda step: (violations.append("submitted during a capture") if capturing[0] else None,
                                         submit(step))[1]
    delayed = engine.worker.delayed
    total = sum(delayed.totals.values())
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=16, temperature=0.0))  # (a 4-token graph: not a largest)
    first_step = engine.schedule()
    engine.update(first_step, engine.execute(first_step))
    while any(key in delayed.pending for key in delayed.anchors):  # (each kind's largest first: the pool's size)
        engine.capture_gap()
    anchors = len(delayed.anchors)
    assert delayed.captured_keys == list(delayed.anchors)
    for p in prompts():
        engine.add_request(p, SamplingParams(max_tokens=16, temperature=0.0))
    for _ in engine.run():
        pass
    assert delayed.captured_keys[anchors] == ("target", first_step.message.target.graph)
    assert violations == []
    assert 0 < len(delayed.captured_keys) < total, "capture should have been under way throughout the run"
    engine.worker.capture_between_steps(None)
    assert engine.worker.delayed is None
    assert len(delayed.captured_keys) == len(set(delayed.captured_keys)) == total
    assert len(slow_units) == total  # (the CPU has no warm-up units: one hook call a graph)


def test_a_capture_that_fails_leaves_its_steps_eager_and_right(monkeypatch):
    """Out of memory while capturing a unit (here the PIECEWISE graphs: on the CPU by the hook) ends delayed
    capture with an error: that graph and the rest stay uncaptured, their steps run eagerly (cause
    not_captured_yet) with the tokens of an engine that captured first, and the engine goes on."""
    engine = engine_for(None, True)

    def hook(unit):
        if unit.kind == "piecewise":
            raise CaptureOOMError(f"out of GPU memory capturing the target piecewise graph for {unit.size} tokens")

    engine.worker.delayed.hook = hook
    delayed = engine.worker.delayed
    p = SamplingParams(max_tokens=12, temperature=0.0)
    assert engine.generate(prompts(), p) == engine_for(None, False).generate(prompts(), p)
    assert delayed.error.startswith("out of GPU memory") and not engine.worker.capture_pending
    assert engine.worker.runtime.captured == set()  # (the first unit failed: nothing after it ran)
    progress = delayed.progress()
    assert progress.done and progress.error and progress.num_captured == 0
    assert engine.stats.eager_by_reason[NOT_CAPTURED_YET] == engine.stats.steps - engine.stats.fused_steps


def test_each_graph_unit_is_timed_and_the_last_log_line_gives_each_kinds_unit_time(slow_units, caplog):
    """What a unit costs decides how much a step waits for one: every graph unit's capture time is kept by runner
    and kind, and the line that ends delayed capture gives each kind's median and longest."""
    engine = engine_for({"method": "eagle3", "num_speculative_tokens": 3}, True)
    delayed = engine.worker.delayed
    with caplog.at_level("INFO", logger="twogrid.worker"):
        engine.worker.capture_between_steps(None)
    assert {kind: len(s) for kind, s in delayed.unit_seconds.items()} == delayed.totals
    assert min(min(s) for s in delayed.unit_seconds.values()) >= 0.002  # (each unit sleeps 2 ms in the hook)
    line = next(r.getMessage() for r in caplog.records if "units, ms a graph" in r.getMessage())
    for runner, kind in delayed.totals:
        assert f"{runner} {kind} " in line


def test_stand_ins_pad_up_only_where_a_larger_graph_is_captured_and_measured_cheaper_than_eager():
    """``StandIns.pick``: no stand-in until a larger graph of the same kind and q is captured and both times are
    known; then the smallest captured one that holds the step, where its replay time (its own latest, else the
    least of a larger graph of the kind) is below the eager forward's lower bound (the least eager time of the same
    planned kind, as many tokens to a power of two or fewer); a measured slow replay withdraws it."""
    from dispatcher.plan.dispatch import GraphKey

    engine = engine_for(None, True)
    rt = engine.worker.runtime
    stand_ins = engine.worker.delayed.stand_ins
    sizes = stand_ins.sizes[("piecewise", None)]
    small, mid, large = sizes[1], sizes[len(sizes) // 2], sizes[-1]
    key = GraphKey("piecewise", None, small)
    assert stand_ins.pick(key, small) == 0  # (nothing captured)
    rt.captured.add(GraphKey("piecewise", None, large))
    assert stand_ins.pick(key, small) == 0  # (no times yet)
    stand_ins.observe(key, None, small, 20.0)  # an eager step of `small` tokens: 20 ms
    assert stand_ins.pick(key, small) == 0  # (the larger graph's replay not measured)
    stand_ins.observe(GraphKey("piecewise", None, large), GraphKey("piecewise", None, large), large, 5.0)
    assert stand_ins.pick(key, small) == large
    assert stand_ins.pick(key, 1) == 0  # (no eager time at or below 1 token's band)
    rt.captured.add(GraphKey("piecewise", None, mid))  # a smaller captured graph that holds it: padded less
    assert stand_ins.pick(key, small) == mid  # (its replay bounded by the larger one's 5 ms)
    stand_ins.observe(key, GraphKey("piecewise", None, mid), small, 30.0)  # it ran slower than eager
    assert stand_ins.pick(key, small) == 0
    decode = stand_ins.sizes[("full_decode", 1)]
    rt.captured.add(GraphKey("full_decode", 1, decode[-1]))  # (captured, but its kind has no times of its own:
    stand_ins.observe(GraphKey("piecewise", None, 1), None, 1, 50.0)  # the piecewise ones do not count for it)
    assert stand_ins.pick(GraphKey("full_decode", 1, decode[0]), decode[0]) == 0


@pytest.mark.parametrize("spec", [None, SPECS[1]], ids=["no-sd", "eagle3"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_step_on_a_stand_in_gives_the_same_tokens_and_its_trace_names_the_graph_it_stood_in_for(device, spec,
                                                                                                   tmp_path):
    """Once each kind's largest graph is captured and a stand-in is measured cheaper than eager, steps whose own
    graph is not captured yet replay the larger one, padded up: the same greedy tokens as an engine that captured
    first, counted in ``stand_in_steps``, and the trace's ``graph`` and padded counts are the larger graph's with
    ``stand_in_for`` naming the step's own; no step replays a graph not captured whole. With a drafter whose own
    forwards run eagerly in the same step (found in review: they reset the step's stand-in to none)."""
    trace = str(tmp_path / "trace.jsonl")
    engine = engine_for(spec, True, trace, device)
    delayed = engine.worker.delayed
    while any(key in delayed.pending for key in delayed.anchors):
        delayed.run(0.0)
    for runner, key in delayed.anchors:
        if runner == "target":
            delayed.stand_ins.replay_ms[tuple(key)] = 0.0  # (the largest graphs cost nothing: every stand-in wins)
    engine.worker.capture_between_steps = lambda *a, **k: None  # (the rest stays uncaptured for this run)
    p = SamplingParams(max_tokens=12, temperature=0.0)
    assert engine.generate(prompts(), p) == engine_for(spec, False, device=device).generate(prompts(), p)
    assert engine.stats.stand_in_steps >= 1
    assert engine.stats.stand_in_steps == delayed.stand_ins.picked  # (what the worker ran is what the engine counts)
    engine.close()
    records = [json.loads(line) for line in open(trace, encoding="utf-8")]
    stood = [r for r in records if "stand_in_for" in r]
    assert len(stood) == engine.stats.stand_in_steps
    captured = engine.worker.runtime.captured
    for r in stood:
        own, graph = r["stand_in_for"], r["graph"]
        assert graph[:2] == own[:2] and graph[2] > own[2] and tuple(graph) in captured
        assert r["mode"] != MODE_EAGER and "eager_reason" not in r and "target" not in r.get("not_captured", [])
        assert r["padded_tokens"] >= r["tokens"]


def test_a_loaded_worker_rests_after_a_unit_and_an_idle_one_does_not(slow_units):
    """With a step in flight (a budget), a gap that captured a graph other than an anchor for u seconds keeps the
    next REST_PER_UNIT * u seconds' gaps from capturing (most steps then wait for no unit); an idle gap (no
    budget) captures at once."""
    engine = engine_for(None, True)
    delayed = engine.worker.delayed
    while any(key in delayed.pending for key in delayed.anchors):
        delayed.run(0.0)
    assert delayed.rest_until == 0.0  # (anchors set no rest)
    hook = delayed.hook
    delayed.hook = lambda unit: (hook(unit), time.sleep(0.05))  # (a 50 ms unit: a rest of 150 ms)
    start = time.perf_counter()
    assert delayed.run(0.0) == 1
    assert delayed.rest_until >= start + 0.05 * (1 + capture_mod.REST_PER_UNIT)
    delayed.hook = hook
    assert delayed.run(0.0) == 0  # (resting)
    assert delayed.run(None, stop=lambda: len(slow_units) > 10) >= 1  # (idle: no rest)
    delayed.rest_until = time.perf_counter() - 1
    assert delayed.run(0.0) == 1


def structured_worker():
    """A CPU worker with structured outputs, its capture delayed (tiny-dense, 8 requests, 64 tokens a step)."""
    from dispatcher.plan.capture_plan import build_plan
    from dispatcher.runtime.worker import ModelWorker, WorkerConfig

    cfg = resolve({"delayed_cudagraph_capture": True}, None, platform="sm100", max_num_seqs=8,
                  max_num_batched_tokens=64)
    return ModelWorker(WorkerConfig(preset("tiny-dense"), "cpu", torch.float32, num_kv_blocks=64, block_size=4,
                                    max_model_len=96, max_num_seqs=8, max_num_batched_tokens=64,
                                    max_blocks_per_seq=24, structured_outputs=True), build_plan(cfg))


def test_start_up_does_not_wait_for_xgrammar_and_its_warm_up_runs_in_a_gap_once_imported(monkeypatch):
    """Structured outputs: xgrammar's import (transformers' with it, 1-3 s) runs in a thread; under delayed capture
    the worker serves without waiting for it, the graphs' units go first while it runs (a gap with a budget does
    not wait for it; an idle gap waits without capturing it), and its bitmask kernel is warmed up in the first gap
    after it, exactly once."""
    import threading

    from dispatcher.runtime import grammar as grammar_mod
    from dispatcher.runtime.worker import ModelWorker

    release = threading.Event()
    importing = threading.Thread(target=release.wait, daemon=True)  # (an import still running)
    importing.start()
    monkeypatch.setattr(grammar_mod, "_xgrammar_import", importing)
    warmed = []
    monkeypatch.setattr(ModelWorker, "warm_up_grammar", lambda self: warmed.append(1) or 6)
    worker = structured_worker()
    try:
        assert worker.capture_or_delay() is None and not warmed  # (serving: the import still runs)
        delayed = worker.delayed
        grammar_key = (capture_mod.GRAMMAR, (capture_mod.WARM_UP, capture_mod.GRAMMAR))
        assert grammar_key in delayed.pending
        while len(delayed.pending) > 1:
            delayed.run(0.0)
            delayed.rest_until = 0.0
        assert list(delayed.pending) == [grammar_key] and not warmed  # every graph first
        assert sum(delayed.captured.values()) == sum(delayed.totals.values())
        assert delayed.run(0.0) == 0 and not warmed  # (a gap with a budget: nothing ready, it ends)
        start = time.perf_counter()
        assert delayed.run(None, stop=lambda: time.perf_counter() - start > 0.05) == 0 and not warmed  # (idle)
        assert worker.capture_pending
        release.set()
        importing.join()
        worker.capture_between_steps(capture_mod.GAP_BUDGET_S)
        assert warmed == [1] and worker.delayed is None and not worker.capture_pending
    finally:
        release.set()


def test_a_failed_grammar_warm_up_is_logged_and_the_graphs_are_still_captured(monkeypatch, caplog):
    """The structured outputs' warm-up unit comes before the graphs; one that fails (a broken kernel) is an error in
    the log, not the end of delayed capture: every graph is still captured."""
    from dispatcher.runtime import grammar as grammar_mod
    from dispatcher.runtime.worker import ModelWorker

    monkeypatch.setattr(grammar_mod, "_xgrammar_import", None)  # (none in flight: the unit is ready)

    def broken(self):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(ModelWorker, "warm_up_grammar", broken)
    worker = structured_worker()
    assert worker.capture_or_delay() is None
    delayed = worker.delayed
    with caplog.at_level("ERROR", logger="twogrid.worker"):
        worker.capture_between_steps(None)
    assert not delayed.error and not delayed.pending and worker.delayed is None
    assert sum(delayed.captured.values()) == sum(delayed.totals.values())
    assert "bitmask warm-up failed (RuntimeError: no kernel)" in caplog.text


def test_the_worker_imports_xgrammar_in_a_thread_of_its_own():
    """``import_xgrammar_in_background``: the import runs beside the caller (which goes on at once), once a
    process, and xgrammar is imported when it ends."""
    pytest.importorskip("xgrammar")
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys, threading
        from dispatcher.runtime import grammar
        assert "xgrammar" not in sys.modules
        grammar.import_xgrammar_in_background()
        first = grammar._xgrammar_import
        grammar.import_xgrammar_in_background()
        assert grammar._xgrammar_import is first and first.daemon and first is not threading.current_thread()
        first.join(120)
        assert grammar.xgrammar_imported() and "xgrammar" in sys.modules
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS, ids=["no-sd", "eagle3", "ngram"])
def test_delayed_capture_on_cuda_graphs(spec):
    """On CUDA (float32): units captured between steps (thread-local capture, no device synchronization) replay what
    graphs captured first replay: the same greedy tokens; once every graph is captured, each one holds a CUDA graph
    and uniform decodes run fused."""
    p = SamplingParams(max_tokens=16, temperature=0.0)
    delayed = engine_for(spec, True, device="cuda")
    assert delayed.generate(prompts(), p) == engine_for(spec, False, device="cuda").generate(prompts(), p)
    assert delayed.stats.eager_by_reason.get(NOT_CAPTURED_YET, 0) >= 1
    delayed.worker.capture_between_steps(None)
    assert delayed.worker.delayed is None
    for rt in delayed.worker.runtimes:
        assert all(piece.graph is not None for pieces in rt.graphs.values() for piece in pieces)
    delayed.stats = type(delayed.stats)()
    assert delayed.generate(prompts(), p) == engine_for(spec, False, device="cuda").generate(prompts(), p)
    assert delayed.stats.fused_steps >= 1 and not delayed.stats.eager_by_reason


def test_delayed_capture_starts_on_a_cpu_without_triton():
    """Triton is a test extra (Linux x86_64 only): a CPU install without it starts with delayed capture as with
    capture first (found in review: the deferred attention warm-ups imported the Triton kernels on the CPU too)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # `import triton` raises ImportError, as where it is not installed
        import torch
        from dispatcher.engine.engine_core import EngineArgs, EngineCore
        from dispatcher.plan.config import resolve
        from models.config import preset
        from scheduler.request import SamplingParams

        for delayed in (False, True):
            cfg = resolve({"delayed_cudagraph_capture": delayed}, None, platform="sm100", max_num_seqs=8,
                          max_num_batched_tokens=64)
            core = EngineCore(cfg, EngineArgs(preset("tiny-dense"), device="cpu", dtype=torch.float32,
                                              num_kv_blocks=64, block_size=4, max_model_len=96, seed=5))
            print(delayed, core.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0)))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    first, second = run.stdout.split("\n")[:2]
    assert first.split(" ", 1)[1] == second.split(" ", 1)[1]  # (the same tokens)


@pytest.mark.gpu
def test_delayed_capture_leaves_wide_attention_warm_ups_to_the_gaps_and_warms_every_one():
    """On CUDA, a delayed start warms eager attention for sequences of up to DELAYED_WARM_UP_MAX_TOKENS only (the
    first steps'); the wider split merges are units between steps, and once capture ends no eager attention variant
    is left for a served step to compile."""
    from dispatcher.runtime.worker import DELAYED_WARM_UP_MAX_TOKENS

    cfg = resolve({"delayed_cudagraph_capture": True}, None, platform="sm100", max_num_seqs=8,
                  max_num_batched_tokens=64)
    core = EngineCore(cfg, EngineArgs(preset("tiny-dense"), device="cuda", dtype=torch.float32, num_kv_blocks=1024,
                                      block_size=16, max_model_len=4096, seed=5))
    worker, rt = core.worker, core.worker.runtimes[0]
    deferred = {key[1] for _, key in worker.delayed.pending
                if isinstance(key, tuple) and key[0] == capture_mod.WARM_UP and isinstance(key[1], tuple)}
    wide = set(rt.eager_attention_shapes()) - set(rt.eager_attention_shapes(DELAYED_WARM_UP_MAX_TOKENS))
    assert deferred and deferred == wide
    worker.capture_between_steps(None)
    assert worker.delayed is None
    worker.jit.take()
    rt.warm_up_eager([], attention=None)
    count, _, kernels = worker.jit.take()
    assert count == 0, kernels


@pytest.mark.gpu
def test_serve_on_cuda_captures_while_streams_run(tmp_path):
    """Through twogrid serve on CUDA: 16 streams sent as /health turns 200 all complete while the worker captures
    between their steps (its result thread waiting on CUDA events meanwhile), capture then ends, and steps replay
    graphs (a plain greedy request's decodes fused), no step eagerly."""
    from serverutil import Server, http_post, request_body, run_streams, token_prompts

    args = ["--model", "tiny-dense", "--device", "cuda", "--platform", "sm100", "--max-model-len", "256",
            "--max-num-seqs", "64", "--max-num-batched-tokens", "512", "--gpu-memory-utilization", "0.3",
            "--delayed-cudagraph-capture"]
    # (each graph's capture slowed to 0.1 s: on the H200 the whole plan is otherwise captured before a stream starts)
    server = Server(args, str(tmp_path / "server.log"), env={"TWOGRID_CAPTURE_DELAY_S": "0.1"}).wait_healthy()
    try:
        bodies = [request_body(p, 48, seed=i) for i, p in enumerate(token_prompts(16, 512, 4, 64, seed=3))]
        streams, _ = run_streams(server.base, bodies)
        assert all(s.error is None and s.completed and len(s.tokens) == 48 for s in streams)
        assert server.metrics()["twogrid:eager_steps_total"] >= 1
        deadline = time.monotonic() + 120
        while gauges(server, "cudagraphs_captured") < gauges(server, "cudagraphs_planned"):
            assert time.monotonic() < deadline, "delayed capture did not finish"
            time.sleep(0.2)
        eager, graphs = gauges(server, "eager_steps_total"), gauges(server, "cudagraph_steps_total")
        streams, _ = run_streams(server.base, [dict(b, temperature=0.0) for b in bodies])
        assert all(s.error is None and s.completed for s in streams)
        assert gauges(server, "eager_steps_total") == eager and gauges(server, "cudagraph_steps_total") > graphs
        # (the streams ask for logprobs, which a fused step's argmax does not give: a plain greedy request's
        # uniform decodes replay the fused step graphs)
        fused = gauges(server, "fused_decode_steps_total")
        status, _ = http_post(server.base + "/v1/completions",
                              json.dumps(dict(bodies[0], temperature=0.0, stream=False)).encode())
        assert status == 200 and gauges(server, "fused_decode_steps_total") >= fused + 40
    finally:
        server.stop()


def test_capture_first_where_the_start_up_times_graphs(caplog):
    """Adaptive verification and "auto" tiers time their graphs at start-up: delayed capture is refused with a
    warning and every graph is captured first."""
    cfg = resolve({"delayed_cudagraph_capture": True}, {"method": "ngram", "num_speculative_tokens": 2,
                                                        "adaptive_verification": True},
                  platform="sm100", max_num_seqs=4, max_num_batched_tokens=32)
    with caplog.at_level("WARNING"):
        engine = EngineCore(cfg, EngineArgs(preset("tiny-dense"), device="cpu", dtype=torch.float32,
                                            num_kv_blocks=64, block_size=4, max_model_len=64, seed=1))
    assert engine.worker.delayed is None and engine.capture_report is not None
    assert "delayed_cudagraph_capture is off: adaptive verification" in caplog.text


def test_serve_captures_in_the_background_by_default_where_it_can():
    """``twogrid serve`` serves while its CUDA graphs are captured unless told otherwise, except where there are no
    CUDA graphs, start-up times them, or tensor parallelism captures them on every rank at start-up; either flag
    reaches the worker's compilation config as given, and the CPU's default adds nothing to it."""
    from dispatcher.cli import build_parser
    from dispatcher.configure import delayed_capture_by_default
    from dispatcher.serve.launch import _check_flags, _setup
    from serverutil import free_port

    common = dict(platform="sm100", max_num_seqs=8, max_num_batched_tokens=64)
    plain = resolve({}, None, **common)
    assert plain.delayed_capture is False  # (the field's own default, the offline LLM's: capture first)
    assert delayed_capture_by_default(plain, "cuda:0", 1)
    assert not delayed_capture_by_default(plain, "cpu", 1)
    assert not delayed_capture_by_default(plain, "cuda:0", 2)
    for no_graphs in ({"cudagraph_mode": "NONE"},
                      {"cudagraph_mode": "PIECEWISE", "prefill_cudagraph_capture_token_sizes": []},
                      {"cudagraph_mode": "FULL_DECODE_ONLY", "decode_cudagraph_capture_request_sizes": []}):
        assert not delayed_capture_by_default(resolve(no_graphs, None, **common), "cuda:0", 1), no_graphs
    for spec in ({"method": "ngram", "num_speculative_tokens": 2, "adaptive_verification": True},
                 {"method": "eagle3", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": "auto"}):
        assert not delayed_capture_by_default(resolve({}, spec, **common), "cuda:0", 1), spec
    assert delayed_capture_by_default(resolve({}, {"method": "ngram", "num_speculative_tokens": 2}, **common),
                                      "cuda:0", 1)
    for flag, given in (([], None), (["--delayed-cudagraph-capture"], True), (["--no-delayed-cudagraph-capture"],
                                                                             False)):
        args = build_parser().parse_args(["serve", "--model", "tiny-dense", "--device", "cpu", "--port",
                                          str(free_port()), *flag])
        _check_flags(args)
        cfg, _, init, *_ = _setup(args)
        assert init.compilation_config.get("delayed_cudagraph_capture") is given and cfg.delayed_capture is bool(given)


# -- through twogrid serve -------------------------------------------------------------------------------------------

SERVE_ARGS = ["--model", "tiny-dense", "--device", "cpu", "--platform", "sm100", "--max-model-len", "128",
              "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--num-kv-blocks", "32",
              "--delayed-cudagraph-capture", "--shutdown-timeout", "2"]
PLANNED = 9
"""5 PIECEWISE sizes (1..16 tokens), 2 FULL decode sizes (1, 2 requests) and their 2 fused steps."""


def gauges(server, name: str) -> float:
    return server.metrics().get(f"twogrid:{name}", 0.0)


def test_serve_answers_before_capture_ends_then_captures_everything(tmp_path):
    """/health turns 200 with every graph left to capture; the graph gauges rise to the plan's total and the log
    says when capture ends."""
    from serverutil import Server

    server = Server(SERVE_ARGS, str(tmp_path / "server.log"), env={"TWOGRID_CAPTURE_DELAY_S": "0.25"})
    try:
        server.wait_healthy()
        assert gauges(server, "cudagraphs_planned") == PLANNED
        deadline = time.monotonic() + 60
        while gauges(server, "cudagraphs_captured") < PLANNED:
            assert time.monotonic() < deadline, "delayed capture did not finish"
            time.sleep(0.1)
        assert gauges(server, "capture_seconds") >= 0.25 * PLANNED
        log = server.log()
        # (the CPU's static-buffer backend: no CUDA graph to serve before, which the log says, not that graphs were
        # captured)
        assert (f"--delayed-cudagraph-capture: no CUDA graphs on cpu, so nothing to serve before; the static-buffer "
                f"backend sets its {PLANNED} padded sizes up between steps") in log
        assert f"delayed capture done: {PLANNED} static-buffer sizes captured between steps" in log
        assert not re.search(r"\d+ of \d+ graphs captured|graphs captured between steps", log)
    finally:
        server.stop()


def test_serve_runs_steps_without_their_graphs_then_a_worker_killed_mid_capture_fails_the_server(tmp_path):
    """Every unit's capture slowed to 1.5 s: a request served meanwhile runs its steps without the graphs not
    captured yet (eager steps, cause not_captured_yet); then the worker is SIGKILLed while it captures: the server
    fails as with any killed worker: /health 503 within 2 s, exit code 1."""
    from serverutil import Server, http_get, http_post

    server = Server(SERVE_ARGS, str(tmp_path / "server.log"), env={"TWOGRID_CAPTURE_DELAY_S": "1.5"})
    try:
        server.wait_healthy()
        status, body = http_post(server.base + "/v1/completions", b'{"prompt": [5, 6, 7], "max_tokens": 3}')
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        m = server.metrics()
        assert m["twogrid:eager_steps_total"] >= 1 and m["twogrid:cudagraphs_captured"] < PLANNED
        assert "not_captured_yet" in http_get(server.base + "/metrics")[1].decode()
        worker = server.worker_pid()
        killed_at = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        while http_get(server.base + "/health", timeout_s=2)[0] == 200:
            assert time.monotonic() - killed_at < 10, "the dead worker was not noticed"
            time.sleep(0.01)
        assert time.monotonic() - killed_at <= 2.0
        assert server.wait(30) == 1
        assert "SIGKILL" in server.log()
    finally:
        server.stop()


def test_delayed_capture_reads_the_graph_memory_estimate_capture_first_cached():
    """The estimate is keyed by the graphs, not by when they are captured: a delayed-capture restart of a setup that
    captured first reads the cached estimate instead of capturing samples again (3.3 s of a 10.6 s start on the
    H200)."""
    from dispatcher.plan.capture_plan import build_plan
    from dispatcher.runtime.process import graph_memory_plan_key

    common = dict(platform="sm100", max_num_seqs=4, max_num_batched_tokens=32)
    first, delayed = (build_plan(resolve({"delayed_cudagraph_capture": d}, None, **common)) for d in (False, True))
    assert first.to_dict() != delayed.to_dict()
    assert graph_memory_plan_key(first) == graph_memory_plan_key(delayed)
    other = build_plan(resolve({"delayed_cudagraph_capture": True}, None, **dict(common, max_num_seqs=8)))
    assert graph_memory_plan_key(other) != graph_memory_plan_key(delayed)
