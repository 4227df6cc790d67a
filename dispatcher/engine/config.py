"""Engine-side configuration: the scheduler's limits from a resolved dispatcher configuration and its plan."""

from __future__ import annotations

from typing import Callable

import numpy as np

from dispatcher.plan import grids
from dispatcher.plan.capture_plan import EAGLE_LIKE, MODEL_DRAFTERS
from dispatcher.plan.config import ResolvedConfig
from scheduler.scheduler import SchedulerConfig


def scheduler_config(cfg: ResolvedConfig, num_kv_blocks: int, block_size: int = 16, max_model_len: int = 8192,
                     step_ms: Callable[[np.ndarray], np.ndarray] | None = None,
                     enable_prefix_caching: bool = False) -> SchedulerConfig:
    """The scheduler's configuration for a resolved config: its speculative tiers, adaptive-verification sizes
    and, for a model drafter, the KV lookahead (the drafter writes up to K + 1 positions past a step). Tiers with K = 0
    stay (their steps draft nothing); K_max bounds what ``Scheduler.set_tiers`` may switch to (``"auto"`` tiers).
    With prefix caching, an EAGLE-style drafter's blocks are keyed by the token after them too (its KV entry at
    position p holds token p + 1: ``scheduler.block_hash``)."""
    tiers = tuple((t.min_batch, t.max_batch, t.num_speculative_tokens) for t in cfg.tiers) if cfg.method else ()
    av = grids.av_grid(cfg.av_cap_tokens()) if cfg.adaptive_verification else ()
    model_drafter = cfg.method in MODEL_DRAFTERS
    return SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, num_kv_blocks, block_size, max_model_len,
                           tiers, cfg.adaptive_verification, tuple(av), step_ms,
                           cfg.num_speculative_tokens + 1 if model_drafter else 0, cfg.num_speculative_tokens,
                           enable_prefix_caching, enable_prefix_caching and cfg.method in EAGLE_LIKE)


def max_model_len_limit(cfg: ResolvedConfig, max_position_embeddings: int, block_size: int = 16) -> tuple[int, int]:
    """(the longest max_model_len the model's positions allow, the positions past it a request may hold: drafts of
    two steps in flight and the drafter's lookahead, ``SchedulerConfig.extra_tokens``)."""
    extra = scheduler_config(cfg, 1, block_size, 1).extra_tokens
    return max_position_embeddings - extra, extra
