"""What the command line (``dispatcher.cli``), the offline API (``dispatcher.llm``) and the server
(``dispatcher.serve.launch``) share, in one place below all three (none of which it imports): the GPU platform,
the configuration from the engine flags, the capture plan as text, and a checkpoint's generation defaults. No
torch at import time (``twogrid plan`` stays fast)."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
from typing import Any, Sequence

from dispatcher.plan.capture_plan import CapturePlan, build_plan
from dispatcher.plan.config import (CUDAGraphMode, ConfigError, Platform, capture_first_reason, parse_json_arg,
                                    resolve)
from scheduler.request import RequestError, SamplingParams


def detect_platform() -> Platform:
    """sm100 (the separate grids' large-GPU defaults) when the first GPU is a Blackwell (compute capability 10.x)
    or a Hopper (9.x: measured on an H200, they serve 3.2-4.0x the shared list's tok/s at 16-256 streams and
    1.16x at one, docs/headline.md), else default. Asks nvidia-smi (not torch), so that planning stays fast; no
    GPU or no nvidia-smi means default."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return Platform.DEFAULT
    try:
        out = subprocess.run(
            [exe, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True, timeout=5
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return Platform.DEFAULT
    return platform_for_compute_capability(out[0] if out else "")


def resolve_device(device: str | None, name: str = "--device") -> str:
    """``device``, or cuda when a GPU is visible (else cpu); ConfigError naming ``name`` (the flag or argument)
    for a device that is not cpu, cuda or cuda:N, or a CUDA device without a GPU."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ConfigError(f"{name} must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{name} {device}: no CUDA GPU is visible to torch here; use {name} cpu (or leave it out: "
                          f"cuda when a GPU is visible)")
    return device


def check_tensor_parallel_size(size: int, model_cfg, device: str, name: str = "--tensor-parallel-size",
                               cfg=None) -> None:
    """ConfigError naming ``name`` unless ``size`` ranks can serve: at least 1, no more than the visible GPUs on
    CUDA, splitting the model (``models.parallel.check_tensor_parallel``: heads, intermediate sizes, KV heads), and
    with a configuration whose graphs every rank captures alike (no delayed capture, no fitted grids)."""
    import torch

    from models.parallel import TensorParallelError, check_tensor_parallel

    if size < 1:
        raise ConfigError(f"{name} must be >= 1, got {size}")
    if size == 1:
        return
    if device.startswith("cuda") and size > torch.cuda.device_count():
        raise ConfigError(f"{name} {size}: only {torch.cuda.device_count()} GPU(s) visible (CUDA_VISIBLE_DEVICES); "
                          f"one GPU per rank")
    try:
        check_tensor_parallel(model_cfg, size)
    except TensorParallelError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    if cfg is not None and (what := tensor_parallel_capture_conflict(cfg)):
        raise ConfigError(f"{name} {size}: {what} is not supported with tensor parallelism (every rank captures the "
                          f"same graphs in the same order, at start-up)")


def tensor_parallel_capture_conflict(cfg) -> str | None:
    """The capture setting of ``cfg`` that tensor parallelism refuses, or None: delayed capture (a gap's budget
    differs between ranks) and fitted grids (a measured grid would)."""
    return ("delayed_cudagraph_capture" if cfg.delayed_capture else
            "fit_cudagraph_capture_sizes" if cfg.fit_sizes else None)


def delayed_capture_by_default(cfg, device: str, tensor_parallel_size: int) -> bool:
    """``twogrid serve``'s default for ``delayed_cudagraph_capture`` where neither the flag nor the compilation
    config gives it: serve while the CUDA graphs are captured, unless there are none (the CPU, ``--enforce-eager``, a
    plan whose size lists are empty), start-up times them (``capture_first_reason``: adaptive verification, "auto"
    tiers) or tensor parallelism captures them on every rank alike. (Measured: docs/reference.md, delayed capture.)"""
    if not device.startswith("cuda") or cfg.cudagraph_mode is CUDAGraphMode.NONE or tensor_parallel_size > 1:
        return False
    if not any(g.sizes for g in build_plan(cfg).graph_sets):  # (a mode with every size list empty)
        return False
    return capture_first_reason(dataclasses.replace(cfg, delayed_capture=True)) is None


def platform_for_compute_capability(capability: str) -> Platform:
    """'9.0' (Hopper) and '10.0' (Blackwell) get the sm100 defaults; anything else (or nothing) the default."""
    return Platform.SM100 if capability.split(".")[0] in ("9", "10") else Platform.DEFAULT


MAX_BLOCK_SIZE = 1024
"""Tokens per KV block at most (vLLM's largest choice is 256): a larger block only wastes the cache, and one of
billions of tokens failed as an allocation in the worker, not naming the flag."""
MAX_SEED = 2**63 - 1
"""The largest seed: a request's own seed is a signed 64-bit integer (vLLM's range), and the engine's seed stands in
for it where a request has none."""


def check_seed(args: argparse.Namespace) -> None:
    """A subcommand's ``--seed``, if it has one, within 0..MAX_SEED; ConfigError naming the flag (it failed in the
    engine after the model loaded, or as msgpack's overflow)."""
    seed = getattr(args, "seed", None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"--seed must be in 0..{MAX_SEED}, got {seed}")


def add_prefix_caching_arg(group) -> None:
    """``--enable-prefix-caching`` / ``--no-enable-prefix-caching`` (vLLM's flag, on by default as vLLM's)."""
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV of the full blocks of a prompt's prefix that other requests computed "
                            "(automatic prefix caching; --no-enable-prefix-caching turns it off; default: on)")


def add_admission_wait_arg(group) -> None:
    """``--admission-wait-steps N``: arrivals wait up to N steps while every running request decodes
    (``SchedulerConfig.admission_wait_steps``)."""
    group.add_argument("--admission-wait-steps", type=int, default=None, metavar="N",
                       help="while every running request decodes, a new request waits up to N steps so that arrivals "
                            "a step or two apart start in one mixed step (fewer steps off the decode graphs, at up to "
                            "N steps of time to first token; default under speculative decoding: up to 4 steps and "
                            "25 ms by the steps' recent pace; without it 0)")


def check_admission_wait(args: argparse.Namespace) -> None:
    """ConfigError (one line naming the flag) for a negative ``--admission-wait-steps``."""
    if args.admission_wait_steps is not None and args.admission_wait_steps < 0:
        raise ConfigError(f"--admission-wait-steps must be a step count >= 0, got {args.admission_wait_steps}")


def config_from_args(args: argparse.Namespace):
    platform = detect_platform() if args.platform == "auto" else Platform(args.platform)
    return resolve(
        parse_json_arg(args.compilation_config, "--compilation-config"),
        parse_json_arg(args.speculative_config, "--speculative-config"),
        platform=platform,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )


def compact_sizes(sizes: Sequence[int]) -> str:
    """1, 2, 3, 4, 5, 6, 8, 10, 12 -> '1..6, 8..12/2': runs of three or more with one stride are folded."""
    parts: list[str] = []
    i = 0
    while i < len(sizes):
        j = i
        if i + 2 < len(sizes):
            stride = sizes[i + 1] - sizes[i]
            while j + 1 < len(sizes) and sizes[j + 1] - sizes[j] == stride:
                j += 1
            if j - i < 2:
                j = i
        if j == i:
            parts.append(str(sizes[i]))
            i += 1
        else:
            stride = sizes[i + 1] - sizes[i]
            parts.append(f"{sizes[i]}..{sizes[j]}" + (f"/{stride}" if stride != 1 else ""))
            i = j + 1
    return ", ".join(parts)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[bool] | None = None) -> str:
    cells = [[str(c) for c in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    right = right or [False] * len(headers)
    lines = []
    for r in cells:
        lines.append("  ".join(c.rjust(w) if rj else c.ljust(w) for c, w, rj in zip(r, widths, right)).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_plan(plan: CapturePlan) -> str:
    cfg = plan.config
    spec = "no speculative decoding"
    if cfg.method:
        spec = f"{cfg.method} K={cfg.num_speculative_tokens}"
        if cfg.auto_tiers:
            spec += " auto tiers (K in " + ", ".join(map(str, cfg.tier_candidates)) + ")"
        elif len(cfg.tiers) > 1:
            spec += " tiers " + " / ".join(f"{t.min_batch}-{t.max_batch}:K={t.num_speculative_tokens}"
                                           for t in cfg.tiers)
        if cfg.adaptive_verification:
            spec += " + adaptive verification"
    budget = cfg.max_decode_tokens if cfg.max_decode_tokens is not None else "none"
    head = (
        f"capture plan: platform {cfg.platform.value}, max_num_seqs {cfg.max_num_seqs}, max_num_batched_tokens "
        f"{cfg.max_num_batched_tokens}, mode {cfg.cudagraph_mode.value}, {spec}, decode token budget {budget}"
    )
    rows = [
        (g.runner, g.kind, g.unit, g.q, len(g.sizes), g.largest, compact_sizes(g.sizes) or "(disabled)")
        for g in plan.graph_sets
    ]
    out = [head, ""]
    if rows:
        out.append(format_table(["runner", "kind", "unit", "q", "graphs", "largest", "sizes"], rows,
                                [False, False, False, True, True, True, False]))
    else:
        out.append("no CUDA graphs: every step runs eagerly")
    out += ["", f"total: {plan.num_graphs} graphs"]
    out += [f"warning: {w}" for w in cfg.warnings]
    return "\n".join(out)


def generation_defaults(model: str) -> SamplingParams:
    """SamplingParams from a checkpoint directory's generation_config.json, as vLLM reads it: the temperature,
    top_k, top_p, min_p, repetition_penalty and max_new_tokens it sets (do_sample = false: greedy);
    SamplingParams() otherwise."""
    from models.loader import generation_config, model_kind

    if model_kind(model) != "hf":
        return SamplingParams()
    gen = generation_config(model)
    fields = {k: gen[k] for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
              if isinstance(gen.get(k), (int, float)) and not isinstance(gen.get(k), bool)}
    if gen.get("do_sample") is False:
        fields.pop("temperature", None)
    elif gen.get("do_sample") and "temperature" not in fields:
        fields["temperature"] = 1.0
    if isinstance(gen.get("max_new_tokens"), int):
        fields["max_tokens"] = gen["max_new_tokens"]
    params = SamplingParams(**fields)
    try:
        params.validate()
    except RequestError as exc:
        raise ConfigError(f"{model}/generation_config.json: {exc}") from None
    return params
