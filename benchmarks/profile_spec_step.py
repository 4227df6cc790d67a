"""Where a decode step's wall time goes at low concurrency, per speculative method: the host's phases of each step
(the scheduler, the worker's submit, the wait for the result, the scheduler's update), the device's time, and the
PyTorch operators a step launches outside the graph replays (each costs the host a few microseconds on a GPU).

Offline (``EngineCore.run``, asynchronous scheduling as it runs by default), greedy, one engine per method and
variant (``--variants``: fused decode steps, the default, and op by op, ``--no-fuse-decode-steps``); after
``--warm-steps`` steps, ``--steps`` steady decode steps are timed; one more is counted operator by operator.

    PYTHONPATH=.:benchmarks python benchmarks/profile_spec_step.py --model DEFAULT --methods none,eagle3:3,ngram:3 \\
        --concurrency 1,16 --out $OUT/profile_spec_step.json

``--mixed-steps M`` times, instead, the step a request's arrival brings (issue 28: served at 16 streams, such mixed
steps were 30% of eagle3's device time, 4.8 ms each against 1.4 ms for a fused decode): synchronous steps, each
arrival's mixed step run alone, its wall time against its kernels' time (far above it: the step waits for the
host's launches) and its operators launched outside graph replays, beside a decode step's:

    PYTHONPATH=.:benchmarks python benchmarks/profile_spec_step.py --model DEFAULT --methods none,eagle3:3,ngram:3 \
        --concurrency 16 --mixed-steps 8 --out $OUT/profile_mixed_step.json

``--compilation-config '{"cudagraph_mode": "FULL"}'`` runs the same on FULL graphs over the token grid, where a
mixed step's attention is inside the graph (what a FULL graph for small mixed steps would save; on the H200 at
8b70614 it saved the forward's host time but not the step's: docs/headline.md). On the CPU's static backend FULL
leaves only the glue around one replay to count (eagle3 K = 3: 113 operators at b19b0a6, 218 before; PIECEWISE
pieces run there as plain code and count too).

``--model DEFAULT`` is the default model (its GGUF installed or cached); a preset name or a JSON ModelConfig works
too (``--fixed-acceptance`` then sets the acceptance, as random heads accept nothing).
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from _common import commit, write_json  # (importing _common puts the repository on sys.path)
from dispatcher.engine.engine_core import EngineArgs, EngineCore
from dispatcher.plan.config import resolve
from dispatcher.runtime import graphs
from scheduler.request import SamplingParams

VIEWS = {"aten.slice.Tensor", "aten.view.default", "aten.select.int", "aten.unsqueeze.default", "aten.t.default",
         "aten.alias.default", "aten.detach.default", "aten.expand.default", "aten.expand_as.default",
         "aten.squeeze.dim", "aten.flatten.using_ints", "aten.lift_fresh.default", "aten.resolve_conj.default",
         "aten.resolve_neg.default", "aten.split_with_sizes.default", "aten._unsafe_view.default",
         "aten.transpose.int", "aten.reshape.default", "aten.as_strided.default"}
"""Operators that launch nothing on the device (views and metadata)."""


class OpCounter(TorchDispatchMode):
    """Counts operators dispatched outside graph replays (a replay runs with the mode disabled)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


_replay = graphs.Replayable.replay


def _replay_uncounted(self) -> None:
    with _disable_current_modes():
        _replay(self)


graphs.Replayable.replay = _replay_uncounted


class Timed:
    """Wraps an object's method, keeping each call's wall time."""

    def __init__(self, obj, name: str):
        self.calls: list[float] = []
        inner = getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            with torch.profiler.record_function(f"phase.{name.strip('_')}"):  # (a range only while profiling)
                out = inner(*a, **kw)
            self.calls.append((time.perf_counter() - t0) * 1e3)
            return out

        setattr(obj, name, timed)


KERNEL_KINDS = (("gemm", ("nvjet", "gemm", "cutlass", "sm90_xmma", "_scaled_mm")),
                ("attention", ("_paged_attention_kernel", "_merge_splits_kernel")),
                ("norm_rope_act", ("_rms_norm", "_rotary_write_kv_kernel", "_silu_mul_kernel", "_act_mul_quant")),
                ("sample", ("_argmax_prob_kernel", "_sample_kernel", "_count_kernel", "_penalize_kernel")),
                ("step_kernels", ("_decode_inputs_kernel", "_advance_inputs_kernel", "_accept_kernel")))
"""Kernel names by kind (a name containing one of the fragments); the rest, PyTorch's own kernels and copies
between the forwards, is ``glue``."""


def kernel_kind(name: str) -> str:
    return next((kind for kind, parts in KERNEL_KINDS if any(p in name for p in parts)), "glue")


def kernel_ms_per_step(steps, num_steps: int, top: int = 0) -> tuple[float | None, list, dict]:
    """The summed duration of the CUDA kernels ``num_steps`` more steps ran, per step (the device's busy time,
    without the gaps where it waited for the host; kernels inside graph replays included), and the ``top`` kernel
    names of most time: [name, launches a step, us a step] each, and every kernel by kind (``kernel_kind``:
    launches and us a step)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        done = sum(1 for _ in zip(range(num_steps), steps))
        torch.cuda.synchronize()
    if not done:
        return None, [], {}
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith("twogrid.")]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for k in kernels:
        by_name[k.name[:120]].append(k.time_range.elapsed_us())
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for name, us in by_name.items():
        kind = kinds[kernel_kind(name)]
        kind[0] += len(us) / done
        kind[1] += sum(us) / done
    return (round(sum(sum(us) for us in by_name.values()) / 1e3 / done, 4),
            [[name, round(len(us) / done, 2), round(sum(us) / done, 2)] for name, us in ranked],
            {kind: [round(n, 1), round(us, 1)] for kind, (n, us) in sorted(kinds.items())})


def model_arg(text: str):
    if text == "DEFAULT":
        from models.default_model import default_model_path

        return default_model_path()
    if text.startswith("{"):
        from models.config import ModelConfig

        return ModelConfig(**json.loads(text))
    return text


def profile(args, method: str, concurrency: int, fused: bool) -> dict:
    k = 0 if method == "none" else int(method.split(":")[1])
    spec = None if method == "none" else {"method": method.split(":")[0], "num_speculative_tokens": k}
    cfg = resolve(json.loads(args.compilation_config), spec, platform="sm100", max_num_seqs=max(concurrency, 8),
                  max_num_batched_tokens=4096)
    engine = EngineCore(cfg, EngineArgs(model_arg(args.model), device=args.device, num_kv_blocks=4096,
                                        max_model_len=2048, fuse_decode_steps=fused,
                                        fixed_acceptance=args.fixed_acceptance if k else None), progress=False)
    prompt = list(range(100, 100 + args.prompt_len))
    for i in range(concurrency):
        engine.add_request([t + i for t in prompt], SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    timers = {name: Timed(engine, name) for name in ("schedule", "submit", "wait", "update")}
    worker_submit = Timed(engine.worker, "submit")
    steps = engine.run()
    for _ in zip(range(args.warm_steps), steps):
        pass
    for t in (*timers.values(), worker_submit):
        t.calls.clear()
    stats0 = (engine.stats.steps, engine.stats.device_ms)
    t0 = time.perf_counter()
    tokens = 0
    for outputs in (o for _, o in zip(range(args.steps), steps)):
        tokens += sum(len(o.new_token_ids) for o in outputs)
    wall = time.perf_counter() - t0
    n = engine.stats.steps - stats0[0]
    device_ms = (engine.stats.device_ms - stats0[1]) / max(n, 1)
    with OpCounter() as counter:
        next(steps, None)
    kernel_ms, top_kernels, kernel_kinds = (kernel_ms_per_step(steps, args.profiled_steps, args.kernel_top)
                                            if args.device == "cuda" else (None, [], {}))
    for _ in steps:
        pass
    launched = {op: c for op, c in counter.counts.items() if op not in VIEWS}
    med = lambda xs: round(statistics.median(xs), 4) if xs else None  # noqa: E731
    row = {"method": method, "fused": fused, "concurrency": concurrency, "steps": n,
           "fused_steps": engine.stats.fused_steps,
           "wall_ms_per_step": round(wall * 1e3 / max(n, 1), 4), "tokens_per_step": round(tokens / max(n, 1), 3),
           "ms_per_token": round(wall * 1e3 / max(tokens, 1), 4), "device_ms_per_step": round(device_ms, 4),
           **{f"{name}_ms": med(t.calls) for name, t in timers.items()},
           "worker_submit_ms": med(worker_submit.calls),
           "kernel_ms_per_step": kernel_ms, "ops_outside_graphs": sum(counter.counts.values()),
           "launching_ops_outside_graphs": sum(launched.values()),
           "top_launching_ops": collections.Counter(launched).most_common(args.top),
           **({"top_kernels": top_kernels, "kernels_by_kind": kernel_kinds} if args.kernel_top else {})}
    print(json.dumps(row), flush=True)
    del engine, steps
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return row


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def kernel_ms(fn, device: str) -> tuple[float, float | None]:
    """``fn()`` run alone (the device idle before and after): its wall ms, and on the GPU the summed duration of
    the kernels it ran (the device's busy time; wall much above it: the step waited for the host's launches)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    sync(device)
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, None
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = (time.perf_counter() - t0) * 1e3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith("twogrid.")]
    return wall, sum(k.time_range.elapsed_us() for k in kernels) / 1e3


def host_profile(engine, kinds: list, params, args) -> dict:
    """One more arrival's mixed step under the profiler (host and device): where its host time goes, by phase
    (``phase.*`` ranges, inclusive) and by the ``--host-top`` operators and runtime calls of most self time, and how
    often it waits for the device (synchronizations, blocking copies)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    engine.add_request([60 + (t * 11) % 400 for t in range(args.mixed_prompt_len)], params)
    kinds.clear()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    sync(args.device)
    with torch_profile(activities=activities) as prof:
        engine.step()
        sync(args.device)
    if "mixed" not in kinds:
        return {"mixed_host_profile": None}
    if args.host_trace:  # (the step's timeline, host threads and device: chrome://tracing or Perfetto)
        prof.export_chrome_trace(args.host_trace.replace("{method}", args.current_method.replace(":", "-")))
    table = prof.key_averages()
    host = [e for e in table if e.self_cpu_time_total > 0]
    top = sorted(host, key=lambda e: -e.self_cpu_time_total)[: args.host_top]
    phases = {e.name.removeprefix("phase."): round((e.time_range.end - e.time_range.start) / 1e3, 3)
              for e in prof.events() if e.name.startswith("phase.")}
    waits = {e.key: e.count for e in table if "Synchronize" in e.key or e.key in ("cudaMemcpy", "cudaStreamWaitEvent")
             or (e.key.startswith("aten::") and e.key.endswith(("item", "_local_scalar_dense", "nonzero")))}
    return {"mixed_phase_cpu_ms": phases, "mixed_waits": waits,
            "mixed_host_top": [[e.key, e.count, round(e.self_cpu_time_total / 1e3, 3)] for e in top]}


def profile_mixed(args, method: str, concurrency: int) -> dict:
    """``--mixed-steps M``: what a served step costs when a request arrives. ``concurrency`` requests decode
    (synchronous steps, fused as served); M times a request of ``--mixed-prompt-len`` tokens joins, and the step
    that prefills it beside everyone's decode (a mixed step, op by op around the PIECEWISE graphs) is run alone: its
    wall time, kernel time and operators launched outside graph replays; then as many steady decode steps, alike.
    2M arrivals: the even ones' steps timed plainly, the odd ones' profiled (kernels, operators counted)."""
    k = 0 if method == "none" else int(method.split(":")[1])
    spec = None if method == "none" else {"method": method.split(":")[0], "num_speculative_tokens": k}
    cfg = resolve(json.loads(args.compilation_config), spec, platform="sm100",
                  max_num_seqs=concurrency + args.mixed_steps + 8,
                  max_num_batched_tokens=4096)
    engine = EngineCore(cfg, EngineArgs(model_arg(args.model), device=args.device, num_kv_blocks=4096,
                                        max_model_len=2048, fixed_acceptance=args.fixed_acceptance if k else None),
                        progress=False)
    prompt = list(range(100, 100 + args.prompt_len))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request([t + i for t in prompt], params)
    kinds: list[str] = []
    submit = engine.worker.submit
    engine.worker.submit = lambda step: kinds.append(step.target.kind if step.target else "none") or submit(step)
    for _ in range(args.warm_steps):
        engine.step()
    w = engine.worker  # (each phase's host time in a timed mixed step: launches, no synchronization)
    phases = {"schedule": Timed(engine, "schedule"), "update": Timed(engine, "update"),
              "upload": Timed(w, "_upload"), "state": Timed(w, "_apply_state_changes"),
              "inputs": Timed(w, "_target_inputs"), "forward": Timed(w.runtime, "execute"),
              "verify": Timed(w, "_verify"), "advance": Timed(w, "_advance"), "collect": Timed(w, "collect")}
    if w.drafter is not None:
        phases["draft"] = Timed(w.drafter, "propose")
    host: dict[str, list[float]] = {name: [] for name in phases}
    walls: dict[str, list[float]] = {"mixed": [], "decode": []}
    counted: dict[str, list[tuple[float | None, int]]] = {"mixed": [], "decode": []}
    for i in range(2 * args.mixed_steps):  # (even arrivals timed alone; odd ones profiled and their ops counted,
        # whose dispatch hooks would inflate the wall time)
        engine.add_request([50 + (t * 7 + i) % 400 for t in range(args.mixed_prompt_len)], params)
        for cell in ("mixed", "decode"):
            if cell == "decode":  # (a few steps after the arrival: the newcomer has its drafts by then)
                for _ in range(4):
                    engine.step()
            kinds.clear()
            if i % 2 == 0:
                for t in phases.values():
                    t.calls.clear()
                sync(args.device)
                t0 = time.perf_counter()
                engine.step()
                sync(args.device)
                wall, kernels, launched = (time.perf_counter() - t0) * 1e3, None, 0
                if cell == "mixed" and "mixed" in kinds:
                    for name, t in phases.items():
                        host[name].append(sum(t.calls))
            else:
                with OpCounter() as counter:
                    _, kernels = kernel_ms(engine.step, args.device)
                launched = sum(c for op, c in counter.counts.items() if op not in VIEWS)
            kind = "mixed" if "mixed" in kinds else "decode" if "uniform_decode" in kinds else None
            if kind == cell:
                walls[cell].append(wall) if i % 2 == 0 else counted[cell].append((kernels, launched))
    med = lambda xs: round(statistics.median(xs), 4) if xs else None  # noqa: E731
    row = {"method": method, "concurrency": concurrency, "mixed_prompt_len": args.mixed_prompt_len,
           "compilation_config": json.loads(args.compilation_config)}
    for cell in walls:
        row.update({f"{cell}_steps": len(walls[cell]), f"{cell}_wall_ms": med(walls[cell]),
                    f"{cell}_kernel_ms": med([r[0] for r in counted[cell] if r[0] is not None]),
                    f"{cell}_launching_ops": med([r[1] for r in counted[cell]])})
    row["mixed_host_ms"] = {name: med(xs) for name, xs in host.items()}
    if args.host_top:
        row.update(host_profile(engine, kinds, params, args))
    print(json.dumps(row), flush=True)
    del engine
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="DEFAULT")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--methods", default="none,eagle3:3,ngram:3")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--fixed-acceptance", type=float, default=None)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--warm-steps", type=int, default=30)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--profiled-steps", type=int, default=20)
    parser.add_argument("--kernel-top", type=int, default=0, metavar="N",
                        help="per row, the N kernels of most device time a step (inside graph replays too)")
    parser.add_argument("--variants", default="fused,unfused",
                        help="fused (whole decode steps as one graph, the default) and/or unfused (op by op)")
    parser.add_argument("--mixed-steps", type=int, default=0,
                        help="instead of steady decode: this many arrivals, each one's mixed step timed alone "
                             "(and a decode step after it)")
    parser.add_argument("--mixed-prompt-len", type=int, default=130, help="an arrival's prompt tokens")
    parser.add_argument("--host-top", type=int, default=0, metavar="N",
                        help="with --mixed-steps: one more mixed step under the profiler: host time by phase, the N "
                             "operators and runtime calls of most self time, the waits for the device")
    parser.add_argument("--host-trace", default=None, metavar="PATH",
                        help="with --host-top: that step's timeline as a Chrome trace ({method} in PATH: each method's)")
    parser.add_argument("--compilation-config", default="{}", metavar="JSON",
                        help="the engine's compilation config, as serve's -O takes it (e.g. '{\"cudagraph_mode\": "
                             "\"FULL\"}': mixed steps on FULL graphs over the token grid)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.mixed_steps:
        rows = []
        for m in args.methods.split(","):
            args.current_method = m
            rows += [profile_mixed(args, m, c) for c in map(int, args.concurrency.split(","))]
    else:
        rows = [profile(args, m, c, v == "fused") for m in args.methods.split(",")
                for c in map(int, args.concurrency.split(",")) for v in args.variants.split(",")]
    result = {"command": "PYTHONPATH=.:benchmarks python benchmarks/profile_spec_step.py " + shlex.join(sys.argv[1:]),
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "commit": commit(), "rows": rows}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
