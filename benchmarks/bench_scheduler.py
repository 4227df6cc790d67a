"""CPU benchmark of the scheduler (issue 4's targets: at most 1 ms of host time to schedule one step with 1024
running requests at K = 7 on a 2-core machine; ``simulate`` of 1024 prompts at concurrency 1024 with 1024
output tokens in under 60 s).

    python benchmarks/bench_scheduler.py [--dataset ../shared/data/sharegpt_v3_filtered_500.json] \
        [--out docs/bench/scheduler_cpu.json]

Step timing: 1024 requests are admitted and prefilled, then 60 steady decode steps are run; each step's
schedule(), dispatch and update() are timed separately (perf_counter) and the median over the last 50 is
reported. Simulation: one run per configuration, wall-clock seconds.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from _common import write_json  # noqa: E402  (puts the repository on sys.path)

from dispatcher.plan.config import resolve  # noqa: E402
from dispatcher.plan.dispatch import dispatchers_for_plan  # noqa: E402
from dispatcher.plan.capture_plan import build_plan  # noqa: E402
from dispatcher.engine.simulate import FakeModel, simulate  # noqa: E402
from dispatcher.engine.workload import make_prompts  # noqa: E402
from scheduler.request import Request, SamplingParams  # noqa: E402
from dispatcher.engine.config import scheduler_config  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402

SPECS = {
    "no SD": None,
    "eagle3 K=7": {"method": "eagle3", "num_speculative_tokens": 7},
    "eagle3 tiers 7/3/1": {"method": "eagle3", "num_speculative_tokens": 7,
                           "num_speculative_tokens_per_batch_size": [[1, 7], [65, 3], [257, 1]]},
    "dspark K=5 + AV": {"method": "dspark", "num_speculative_tokens": 5, "adaptive_verification": True},
}


def time_steps(spec, warm_steps: int = 10, timed_steps: int = 50) -> dict:
    cfg = resolve({}, spec, platform="sm100", max_num_seqs=1024, max_num_batched_tokens=16384)
    sched = Scheduler(scheduler_config(cfg, num_kv_blocks=1024 * 160, block_size=16, max_model_len=2048))
    dispatcher = dispatchers_for_plan(build_plan(cfg))["target"]
    model = FakeModel(32000, 0.7, 1024)
    for i in range(1024):
        sched.add_request(Request(f"r{i}", [1] * 200, SamplingParams(max_tokens=1500, ignore_eos=True)))
    while sched.waiting or any(sched.num_tokens[s] - sched.num_computed[s] > 1 for s in sched.order):
        out = sched.schedule()
        sched.update(out, model.run(out))
    t_sched, t_disp, t_update, reqs = [], [], [], []
    for i in range(warm_steps + timed_steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        s = out.shape
        dispatcher.dispatch(s.num_tokens, s.num_reqs, s.max_query_len, s.is_decode)
        t2 = time.perf_counter()
        result = model.run(out)
        t3 = time.perf_counter()
        sched.update(out, result)
        t4 = time.perf_counter()
        if i >= warm_steps:
            t_sched.append((t1 - t0) * 1e3)
            t_disp.append((t2 - t1) * 1e3)
            t_update.append((t4 - t3) * 1e3)
            reqs.append(s.num_reqs)
    return {"running_requests": int(statistics.median(reqs)), "step_kind": out.kind,
            "schedule_ms_median": round(statistics.median(t_sched), 4),
            "schedule_ms_p90": round(sorted(t_sched)[int(0.9 * len(t_sched))], 4),
            "dispatch_ms_median": round(statistics.median(t_disp), 4),
            "update_ms_median": round(statistics.median(t_update), 4), "timed_steps": timed_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default=None, help="ShareGPT JSON for the simulate runs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    steps = {name: time_steps(spec) for name, spec in SPECS.items()}
    sims = {}
    prompts = make_prompts(1024, seed=0, dataset=args.dataset)
    for name, spec in SPECS.items():
        cfg = resolve({}, spec, platform="sm100", max_num_seqs=1024, max_num_batched_tokens=16384)
        t0 = time.perf_counter()
        s = simulate(cfg, prompts, concurrency=1024, output_len=1024).summary
        sims[name] = {"wall_seconds": round(time.perf_counter() - t0, 2), "steps": s["steps"],
                      "eager_steps": s["eager_steps"], "output_tokens": s["output_tokens"],
                      "simulated_output_tok_per_s": s["output_tokens_per_second"]}
    result = {
        "command": "python benchmarks/bench_scheduler.py --dataset ../shared/data/sharegpt_v3_filtered_500.json "
                   "--out docs/bench/scheduler_cpu.json",
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count()},
        "dataset": os.path.basename(args.dataset) if args.dataset else "synthetic lognormal, mean 230 tokens",
        "step_1024_running": steps, "schedule_target_ms": 1.0,
        "simulate_1024x1024x1024": sims, "simulate_target_seconds": 60.0,
    }
    print(f"{'config':22s} {'running':>8s} {'schedule ms':>12s} {'p90':>8s} {'dispatch ms':>12s} {'update ms':>10s}")
    for name, r in steps.items():
        print(f"{name:22s} {r['running_requests']:8d} {r['schedule_ms_median']:12.3f} {r['schedule_ms_p90']:8.3f} "
              f"{r['dispatch_ms_median']:12.4f} {r['update_ms_median']:10.3f}")
    print(f"{'simulate 1024/1024/1024':22s} {'wall s':>8s} {'steps':>8s} {'eager':>6s}")
    for name, r in sims.items():
        print(f"{name:22s} {r['wall_seconds']:8.2f} {r['steps']:8d} {r['eager_steps']:6d}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
