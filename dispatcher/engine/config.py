"""Engine-side configuration: ``EngineArgs``, and the scheduler's limits from a resolved dispatcher configuration and
its plan. No torch here: the server's front end builds EngineArgs without importing the engine core (which imports
the runtime, torch and Triton)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from dispatcher.engine.structured import COMPILE_TIMEOUT_S
from dispatcher.plan import autotier, grids
from dispatcher.plan.capture_plan import EAGLE_LIKE, MODEL_DRAFTERS
from dispatcher.plan.config import ConfigError, ResolvedConfig
from models.config import ModelConfig
from scheduler.scheduler import SchedulerConfig

if TYPE_CHECKING:
    import torch


@dataclass
class EngineArgs:
    model: ModelConfig | str
    """A model shape, a preset name (random weights from ``seed``), a checkpoint directory or a .gguf file."""
    device: str = "cpu"
    dtype: torch.dtype | None = None
    """Default: ``models.loader.default_dtype`` (bfloat16 on CUDA; on the CPU bfloat16 for a 4-bit GGUF, else
    float32)."""
    num_kv_blocks: int = 2048
    block_size: int = 16
    max_model_len: int = 2048
    seed: int = 0
    """Random weights of presets, and the seeds of requests that bring none (so identical runs sample alike)."""
    use_cuda_graphs: bool = True
    fuse_decode_steps: bool = True
    """Capture whole uniform-decode steps (``dispatcher.runtime.decode_step``); False: op by op."""
    step_trace: str | None = None
    """Append one JSON record per step to this file."""
    async_scheduling: bool | None = None
    """Schedule and submit step t + 1 before step t's result is back (None: wherever the method allows)."""
    steps_in_flight: int = 2
    """With asynchronous scheduling, steps submitted at once (``--steps-in-flight``, ``check_steps_in_flight``): 2
    schedules each step while the one before runs; 3 keeps one more queued, so that the host's turn from a result to
    the next step sent (the scheduler's update, admissions, the next schedule) may take two steps' device time (on an
    H100 at 256-1024 streams it ran 0.95-1.05x of 2: the engine's work a step, not the depth, set the pace)."""
    fixed_acceptance: float | None = None
    """Benchmarks only: accept drafts so that the mean acceptance length is this (see WorkerConfig)."""
    quantization: str | None = None
    """``"fp8"`` (vLLM's ``--quantization``): the weights quantized to FP8 at load."""
    kv_cache_dtype: str = "auto"
    """``"auto"`` or ``"fp8"`` (vLLM's ``--kv-cache-dtype``)."""
    eos_token_ids: tuple[int, ...] | None = None
    """Token ids that end a request (unless ignore_eos); default: the model's (config and generation_config)."""
    av_cost_table: str | None = None
    """Adaptive verification's step-cost curve ({"tokens": [...], "ms": [...]}). Default: measured on this runtime
    once, then kept under $TWOGRID_CACHE (default ~/.cache/twogrid) and reused, so that runs of one setup choose
    the same verify lengths (and so sample the same tokens)."""
    spec_cost_table: str | None = None
    """``"auto"`` speculative tiers' step costs by (requests, q): a ``StepCostTable`` JSON file or step traces (.jsonl).
    Default: every runner's FULL decode graphs timed on this runtime once, then kept under $TWOGRID_CACHE/spec_cost
    and reused (so that runs of one setup start from the same tiers), then corrected by the served steps' device time
    (``autotier.MeasuredCosts``); a table given here is taken as it is."""
    auto_tier_interval: int = autotier.RECHOOSE_INTERVAL_STEPS
    """``"auto"`` tiers: steps between two re-choices from the measured acceptance."""
    enable_prefix_caching: bool = True
    """Automatic prefix caching (on by default, as vLLM's): a request reuses the KV of the full blocks of its prefix
    that another request computed (``scheduler.kv_blocks``)."""
    tokenizer: str | None = None
    """The checkpoint (directory or .gguf) whose tokenizer structured outputs compile grammars against; default:
    the model's (a preset has none, nor a checkpoint without tokenizer.json: they refuse structured requests)."""
    structured_compile_timeout_s: float = COMPILE_TIMEOUT_S
    """A structured request whose grammar has not compiled this long after it arrived is refused."""
    admission_wait_steps: int | None = None
    """While every running request decodes, arrivals wait up to this many steps (``--admission-wait-steps``,
    ``SchedulerConfig.admission_wait_steps``); None: ``SD_ADMISSION_WAIT_STEPS`` under speculative decoding, else 0."""


SD_ADMISSION_WAIT_STEPS = 4
"""The admission wait under speculative decoding when none is given: drafting staggers the finishes, so arrivals
come a few at a time, and each batch of them costs a mixed step off the decode graphs. Served on the H200 it made
eagle3 and n-gram faster at 16-1024 streams (docs/headline.md, "The admission wait, served"); without drafting the
streams finish in lockstep and a wait gains nothing, so it stays 0 there."""


SD_ADMISSION_WAIT_MS = 25.0
"""The default wait's bound in time: by the recent steps' pace (``AdmissionPace``) it holds an arrival no more steps
than this many ms take. On the default model on the H200 that is the 4 steps up to 256 streams (steps of 2-4.5
ms) and 2 at 1024 (12 ms steps: there wait 2 measured 1.38x no SD, wait 4 1.35x); where steps take tens of ms an
arrival's mixed step is a smaller share of a step and the wait a larger part of its time to first token, and it
waits one step or none."""
PACE_STEPS = 64.0
"""Steps the pace averages over (an exponential average of the steps' periods)."""
PACE_MARGIN = 0.1
"""The pace must pass a step count's border by this share before the wait changes (no flapping at a border)."""


class AdmissionPace:
    """The default admission wait under speculative decoding, in steps, from the recent pace of the steps where
    every request decodes (arrivals are held across those only: a burst's prefill steps are no pace of a wait): at
    most ``SD_ADMISSION_WAIT_STEPS``, and no more steps than ``SD_ADMISSION_WAIT_MS`` takes at the pace."""

    def __init__(self):
        self.ms: float | None = None
        """The pace: an exponential average of the steps' periods (None before the first)."""
        self.steps = SD_ADMISSION_WAIT_STEPS

    @staticmethod
    def _fit(ms: float) -> int:
        return min(SD_ADMISSION_WAIT_STEPS, int(SD_ADMISSION_WAIT_MS // ms))  # (ms > 0: only positive steps observed)

    def observe(self, step_ms: float) -> int | None:
        """One step's period (or, where none was measured, its device time), in ms; the wait in steps when it
        changes, else None."""
        if not (step_ms > 0 and math.isfinite(step_ms)):
            return None
        self.ms = step_ms if self.ms is None else self.ms + (step_ms - self.ms) / PACE_STEPS
        steps = self._fit(self.ms)
        if steps == self.steps:
            return None
        if self._fit(self.ms * (1 + PACE_MARGIN if steps > self.steps else 1 - PACE_MARGIN)) != steps:
            return None  # (not past the border by the margin yet)
        self.steps = steps
        return steps


def admission_pace_for(cfg: ResolvedConfig, admission_wait_steps: int | None) -> AdmissionPace | None:
    """The pace of the default wait (``admission_wait_for``'s under speculative decoding); None where a wait was
    given or nothing drafts (the wait stays as it is)."""
    return AdmissionPace() if admission_wait_steps is None and cfg.method else None


def admission_wait_for(cfg: ResolvedConfig, admission_wait_steps: int | None) -> int:
    """The admission wait in force: the one given, else ``SD_ADMISSION_WAIT_STEPS`` with a drafter, 0 without.
    ConfigError below 0."""
    if admission_wait_steps is None:
        return SD_ADMISSION_WAIT_STEPS if cfg.method else 0
    if not isinstance(admission_wait_steps, int) or admission_wait_steps < 0:
        raise ConfigError(f"admission_wait_steps must be a step count >= 0, got {admission_wait_steps!r}")
    return admission_wait_steps


def scheduler_config(cfg: ResolvedConfig, num_kv_blocks: int, block_size: int = 16, max_model_len: int = 8192,
                     step_ms: Callable[[np.ndarray], np.ndarray] | None = None,
                     enable_prefix_caching: bool = False, admission_wait_steps: int | None = None,
                     steps_in_flight: int = 2) -> SchedulerConfig:
    """The scheduler's configuration for a resolved config: its speculative tiers, adaptive-verification sizes
    and, for a model drafter, the KV lookahead (the drafter writes up to K + 1 positions past a step). Tiers with K = 0
    stay (their steps draft nothing); K_max bounds what ``Scheduler.set_tiers`` may switch to (``"auto"`` tiers).
    With prefix caching, an EAGLE-style drafter's blocks are keyed by the token after them too (its KV entry at
    position p holds token p + 1: ``scheduler.block_hash``). ``admission_wait_steps``: ``admission_wait_for``;
    ``steps_in_flight``: ``EngineArgs.steps_in_flight``."""
    tiers = tuple((t.min_batch, t.max_batch, t.num_speculative_tokens) for t in cfg.tiers) if cfg.method else ()
    av = grids.av_grid(cfg.av_cap_tokens()) if cfg.adaptive_verification else ()
    model_drafter = cfg.method in MODEL_DRAFTERS
    return SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, num_kv_blocks, block_size, max_model_len,
                           tiers, cfg.adaptive_verification, tuple(av), step_ms,
                           cfg.num_speculative_tokens + 1 if model_drafter else 0, cfg.num_speculative_tokens,
                           enable_prefix_caching, enable_prefix_caching and cfg.method in EAGLE_LIKE,
                           admission_wait_for(cfg, admission_wait_steps), check_steps_in_flight(steps_in_flight))


MAX_STEPS_IN_FLIGHT = 4
"""The most steps ``--steps-in-flight`` may keep submitted at once."""


def check_steps_in_flight(steps: int) -> int:
    """``steps_in_flight`` as given; ConfigError naming the flag and its range otherwise."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS_IN_FLIGHT:
        raise ConfigError(f"--steps-in-flight must be a step count in 1..{MAX_STEPS_IN_FLIGHT}, got {steps!r}")
    return steps


def max_model_len_limit(cfg: ResolvedConfig, max_position_embeddings: int, block_size: int = 16,
                        steps_in_flight: int = 2) -> tuple[int, int]:
    """(the longest max_model_len the model's positions allow, the positions past it a request may hold: drafts of
    the steps in flight and the drafter's lookahead, ``SchedulerConfig.extra_tokens``)."""
    extra = scheduler_config(cfg, 1, block_size, 1, steps_in_flight=steps_in_flight).extra_tokens
    return max_position_embeddings - extra, extra
