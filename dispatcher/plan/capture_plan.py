"""Capture plans: per runner and kind, the exact sizes captured (SPEC section 4).

A plan is data. ``build_plan`` turns a ResolvedConfig into GraphSets; ``baseline_plan`` gives what the legacy
shared token list ("main") would capture for the same engine, so that plans can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dispatcher.plan import gridfit, grids
from dispatcher.plan.config import CUDAGraphMode, ResolvedConfig, Tier

# Graph kinds (the "kind" field of a plan entry).
PIECEWISE = "piecewise"
"""Tokens. The forward split at attention; every batch that is not a uniform decode, and uniform decodes no
FULL graph covers."""
FULL_DECODE = "full_decode"
"""Requests at one q. The whole forward for a uniform decode (every request has q tokens)."""
FULL_VARLEN = "full_varlen"
"""Tokens. The whole forward for an adaptive-verification step (per-request query lengths 1..1 + K)."""
FULL = "full"
"""Tokens. The whole forward on the prefill grid: every batch in cudagraph_mode FULL; in FULL_AND_PIECEWISE the
mixed steps up to max_full_mixed_cudagraph_capture_tokens (beside the PIECEWISE set, which takes larger ones)."""

KIND_UNIT = {PIECEWISE: "tokens", FULL_DECODE: "requests", FULL_VARLEN: "tokens", FULL: "tokens"}
FUSED_STEP = "step"
"""The runner name of fused decode-step graphs (``dispatcher.runtime.decode_step``: a whole uniform-decode step,
the target's forward and the drafter's, in one graph per FULL decode size) in capture reports and measured step
costs. Not a plan entry: a fused step replays the kernels of the plan's FULL decode graphs."""
EAGLE_LIKE = ("eagle", "eagle3", "mtp")
"""Single-module drafters: step 0 mirrors the target, later steps run one token a request."""


@dataclass(frozen=True)
class GraphSet:
    """The sizes one runner captures for one graph kind (and one q, for FULL decode)."""

    runner: str
    kind: str
    q: int | None
    sizes: tuple[int, ...]
    serves: tuple[tuple[int, int], ...] | None = None
    """Batch ranges (in the set's unit, inclusive) this set can ever be asked for; None: unknown. Not part of
    the JSON schema; plan comparisons count coverage inside these ranges only."""

    def coverage(self) -> int:
        """How many batch sizes of ``serves`` get a graph (all n <= the largest size); without ``serves``,
        the largest size."""
        return coverage(self.sizes, self.serves)

    @property
    def unit(self) -> str:
        return KIND_UNIT[self.kind]

    @property
    def largest(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def to_dict(self) -> dict[str, Any]:
        return {"runner": self.runner, "kind": self.kind, "unit": self.unit, "q": self.q, "sizes": list(self.sizes)}


@dataclass(frozen=True)
class CapturePlan:
    config: ResolvedConfig
    graph_sets: tuple[GraphSet, ...]

    @property
    def runners(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(g.runner for g in self.graph_sets))

    def for_runner(self, runner: str) -> tuple[GraphSet, ...]:
        return tuple(g for g in self.graph_sets if g.runner == runner)

    @property
    def num_graphs(self) -> int:
        return sum(len(g.sizes) for g in self.graph_sets)

    def to_dict(self) -> dict[str, Any]:
        return {
            "platform": self.config.platform.value,
            "config": self.config.to_dict(),
            "runners": [g.to_dict() for g in self.graph_sets],
            "warnings": list(self.config.warnings),
        }


def coverage(sizes: tuple[int, ...], serves: tuple[tuple[int, int], ...] | None) -> int:
    """Batch sizes in ``serves`` that some size covers; the largest size when ``serves`` is None."""
    largest = max(sizes, default=0)
    if serves is None:
        return largest
    return sum(max(0, min(hi, largest) - lo + 1) for lo, hi in serves)


BLOCK_DRAFTERS = ("dspark", "dflash", "mtp_multi")
"""Drafters that propose K tokens in one forward of q rows a request."""
DRAFT_MODEL = "draft_model"
"""A second, smaller LM: it reads the target's step (same tokens, same positions) into its own KV cache (graphs
mirroring the target's: PIECEWISE prefill grid, FULL decode at q = 1 + K), then proposes K tokens one at a time
(``<method>_next_steps``: FULL q = 1, as an EAGLE-style drafter's later steps)."""
MODEL_DRAFTERS = EAGLE_LIKE + BLOCK_DRAFTERS + (DRAFT_MODEL,)
"""Drafters that run a model on the worker (their KV writes reach past a step: the scheduler's lookahead)."""
ONE_TOKEN_DRAFTERS = EAGLE_LIKE + (DRAFT_MODEL,)
"""Drafters with a forward over the target's rows (step 0), then one-token steps on their own runner."""


def block_query_len(method: str, num_speculative_tokens: int) -> int:
    """Rows a block drafter runs per request: dspark proposes K tokens from K rows (q = K); dflash and
    mtp_multi run K + 1."""
    return num_speculative_tokens if method == "dspark" else 1 + num_speculative_tokens


def next_steps_runner(method: str) -> str:
    """The runner of an EAGLE-style drafter's or a draft model's one-token steps (every row of its forwards proposes
    a draft)."""
    return f"{method}_next_steps"


def one_token_steps(method: str | None, num_speculative_tokens: int) -> int:
    """One-token draft forwards a step drafting K tokens runs: an EAGLE-style drafter's steps 1..K-1 (its step 0
    proposes draft 1); a draft model's K (its forward over the target's rows only fills its KV cache)."""
    if method == DRAFT_MODEL:
        return num_speculative_tokens
    if method in EAGLE_LIKE:
        return max(num_speculative_tokens - 1, 0)
    return 0


def one_token_tiers(cfg: ResolvedConfig) -> list[Tier]:
    """The tiers whose steps run one-token draft forwards."""
    return [t for t in cfg.capture_tiers if one_token_steps(cfg.method, t.num_speculative_tokens) >= 1]


def drafting_tiers(cfg: ResolvedConfig) -> list[Tier]:
    """The tiers (those captured: ``ResolvedConfig.capture_tiers``) whose steps draft: K >= 1. A K = 0 tier's steps
    are q = 1 decodes with no drafts (a one-token drafter's step 0 still runs, for its KV; a block drafter runs
    nothing)."""
    return [t for t in cfg.capture_tiers if t.num_speculative_tokens >= 1]


def is_next_steps(runner: str) -> bool:
    return runner.endswith("_next_steps")


def model_runners(cfg: ResolvedConfig) -> tuple[str, ...]:
    """Every model forward a step of this configuration runs, whether or not it has graphs: the target, a model
    drafter, and its one-token steps (an EAGLE-style drafter's when some tier drafts 2 or more tokens, a draft
    model's when some tier drafts any)."""
    method = cfg.method
    if method in ONE_TOKEN_DRAFTERS:
        return ("target", method) + ((next_steps_runner(method),) if one_token_tiers(cfg) else ())
    if method in BLOCK_DRAFTERS:
        return ("target", method)
    return ("target",)


def _tier_decode_sizes(cfg: ResolvedConfig, tier: Tier, query_len: int) -> tuple[int, ...]:
    """Uniform-decode request sizes of one tier at q: within the token budget, from the first size at or above
    the tier's smallest batch through the first size at or above its widest batch (the only sizes a batch of
    this tier can be padded to; the widest batch is also bounded by max_num_batched_tokens / q). An explicit
    list without tiers is captured as given, within the budget."""
    budget = cfg.decode_token_limit()
    sizes = tuple(n for n in cfg.decode_sizes(query_len) if n * query_len <= budget)
    single = len(cfg.capture_tiers) == 1 or cfg.auto_tiers  # (auto: every candidate over every batch)
    if single and cfg.decode_sizes_explicit:
        return sizes
    widest = min(tier.max_batch, cfg.max_num_batched_tokens // query_len)
    if widest < 1:
        return ()
    reach = grids.up_to_first_covering(sizes, widest)
    if single:
        return reach
    below = sum(1 for n in reach if n < tier.min_batch)
    return reach[below:]


def _decode_sets(cfg: ResolvedConfig, runner: str, q_of_tier, tiers: list[Tier] | None = None) -> list[GraphSet]:
    """One FULL decode set per distinct q over the tiers (default: every captured tier; a drafter's: those that
    draft), tiers sharing a q sharing a set."""
    tiers = list(cfg.capture_tiers) if tiers is None else tiers
    by_q: dict[int, set[int]] = {}
    for tier in tiers:
        q = q_of_tier(tier)
        by_q.setdefault(q, set()).update(_tier_decode_sizes(cfg, tier, q))
    return [GraphSet(runner, FULL_DECODE, q, tuple(sorted(s)), _decode_serves(cfg, q, q_of_tier, tiers))
            for q, s in by_q.items()]


def _decode_serves(cfg: ResolvedConfig, query_len: int, q_of_tier, tiers: list[Tier]) -> tuple[tuple[int, int], ...]:
    """Uniform decodes at q: the batch ranges of those ``tiers`` using q, within the token limit."""
    top = cfg.max_num_batched_tokens // query_len
    return tuple(
        (t.min_batch, min(t.max_batch, top)) for t in tiers if q_of_tier(t) == query_len and t.min_batch <= top
    )


def _token_sets(cfg: ResolvedConfig, runner: str, sizes: tuple[int, ...] | None = None) -> list[GraphSet]:
    """The token-keyed set (the config's prefill sizes unless given): PIECEWISE in the piecewise modes, FULL
    (tokens) in mode FULL."""
    mode = cfg.cudagraph_mode
    sizes = cfg.prefill_token_sizes if sizes is None else sizes
    kind = PIECEWISE if mode.has_piecewise else FULL if mode is CUDAGraphMode.FULL else None
    return [GraphSet(runner, kind, None, sizes, ((1, cfg.max_num_batched_tokens),))] if kind else []


def _full_mixed_sets(cfg: ResolvedConfig, runner: str) -> list[GraphSet]:
    """FULL_AND_PIECEWISE with ``max_full_mixed_cudagraph_capture_tokens``: FULL graphs over the prefill grid's
    sizes up to it, for the mixed steps they cover (``Dispatcher.dispatch``)."""
    sizes = cfg.full_mixed_token_sizes
    return [GraphSet(runner, FULL, None, sizes, ((1, sizes[-1]),))] if sizes else []


def build_plan(cfg: ResolvedConfig) -> CapturePlan:
    """Graph sets per runner (SPEC section 4 table). Empty sets are kept, so that a disabled kind shows."""
    mode = cfg.cudagraph_mode
    sets: list[GraphSet] = []
    if mode is CUDAGraphMode.NONE:
        return CapturePlan(cfg, ())
    target_q = lambda t: 1 + t.num_speculative_tokens  # noqa: E731
    # Target
    sets += _token_sets(cfg, "target") + _full_mixed_sets(cfg, "target")
    if mode.has_full_decode:
        sets += _decode_sets(cfg, "target", target_q)
        if cfg.adaptive_verification:
            sets.append(GraphSet("target", FULL_VARLEN, None, grids.av_grid(cfg.av_cap_tokens()), _av_serves(cfg)))
    # Drafters
    method = cfg.method
    if method in ONE_TOKEN_DRAFTERS:  # step 0 over the target's rows mirrors the target (every step, a K = 0 tier's
        # too: its KV follows the target's, runtime/drafting.py), then one-token steps where a tier drafts
        sets += _token_sets(cfg, method, _step0_token_sizes(cfg)) + _full_mixed_sets(cfg, method)
        if mode.has_full_decode:
            sets += _decode_sets(cfg, method, target_q)
        one_token = one_token_tiers(cfg)
        if one_token:
            sets += _one_token_draft_sets(cfg, next_steps_runner(method), one_token)
    elif method in BLOCK_DRAFTERS:
        if mode.has_full_decode:
            sets += _decode_sets(cfg, method, lambda t: block_query_len(method, t.num_speculative_tokens),
                                 drafting_tiers(cfg))
        else:
            sets += _token_sets(cfg, method)
    return CapturePlan(cfg, tuple(sets))


def _step0_token_sizes(cfg: ResolvedConfig) -> tuple[int, ...] | None:
    """A drafter's step-0 token grid: the target's (None), except an EAGLE-style head's under grids fitted to a
    measured step cost, which takes the powers of two of the target's (``gridfit.head_token_grid``: its one layer
    pads cheaply)."""
    if cfg.method in EAGLE_LIKE and cfg.fit_sizes and cfg.grid_cost_source is not None:
        return gridfit.head_token_grid(cfg.prefill_token_sizes)
    return None


def _av_serves(cfg: ResolvedConfig) -> tuple[tuple[int, int], ...]:
    return ((1, min(cfg.max_num_seqs * (1 + cfg.num_speculative_tokens), cfg.max_num_batched_tokens)),)


def _one_token_draft_sets(cfg: ResolvedConfig, runner: str, one_token: list[Tier]) -> list[GraphSet]:
    """One-token draft steps (a single-module drafter's steps 1..K-1, a draft model's K steps): q = 1 over its own
    request grid up to max_num_seqs, within the budget, through the widest batch of any tier in ``one_token`` (the
    tiers that run them); ``[]`` for the decode list disables them. In the prefill-grid modes they use the prefill
    grid up to its first size covering max_num_seqs (a one-token step has a row a request; these graphs also hold
    the drafter's logits)."""
    mode = cfg.cudagraph_mode
    if not mode.has_full_decode:
        return _token_sets(cfg, runner, grids.up_to_first_covering(cfg.prefill_token_sizes, cfg.max_num_seqs))
    serves = _next_steps_serves(cfg, one_token)
    if cfg.decode_request_sizes == () or cfg.decode_token_sizes == ():
        return [GraphSet(runner, FULL_DECODE, 1, (), serves)]
    grid = cfg.one_token_request_sizes or grids.decode_grid(cfg.max_num_seqs)
    own = tuple(n for n in grid if n <= cfg.decode_token_limit())
    return [GraphSet(runner, FULL_DECODE, 1, grids.up_to_first_covering(own, serves[-1][1]), serves)]


def _next_steps_serves(cfg: ResolvedConfig, one_token: list[Tier]) -> tuple[tuple[int, int], ...]:
    """One-token draft steps run for the tiers in ``one_token`` (``one_token_tiers``)."""
    top = cfg.max_num_batched_tokens
    return tuple((t.min_batch, min(t.max_batch, top)) for t in one_token)


# ----------------------------------------------------------------------------------------------------------
# Baseline: the legacy shared token list ("main")
# ----------------------------------------------------------------------------------------------------------


def baseline_plan(cfg: ResolvedConfig) -> CapturePlan:
    """What one shared token list captures for the same engine: PIECEWISE = the list; FULL decode at q =
    entries divisible by q, over q (up to max_num_seqs); adaptive verification = the list up to
    max_num_seqs * q; one-token drafts = the list up to max_num_seqs. The list is the config's own legacy
    list when it uses the deprecated fields, else the legacy list up to 1024 (sm100) or 512 tokens."""
    if cfg.legacy:
        tokens = cfg.decode_token_sizes or ()
    else:
        default_max = 1024 if cfg.platform.value == "sm100" else grids.LEGACY_DEFAULT_MAX_TOKENS
        tokens = grids.legacy_token_list(min(default_max, cfg.max_num_batched_tokens))
    mode = cfg.cudagraph_mode
    if mode is CUDAGraphMode.NONE:
        return CapturePlan(cfg, ())
    prefill = tokens
    if cfg.interactivity and tokens:
        prefill = tuple(sorted(set(tokens) | set(range(1, min(32, tokens[-1]) + 1))))

    def token_sets(runner: str) -> list[GraphSet]:
        return _token_sets(cfg, runner, prefill)

    def decode_sets(runner: str, q_of_tier, tiers: list[Tier] | None = None) -> list[GraphSet]:
        tiers = list(cfg.capture_tiers) if tiers is None else tiers
        qs = dict.fromkeys(q_of_tier(t) for t in tiers)
        return [
            GraphSet(
                runner,
                FULL_DECODE,
                q,
                tuple(n for n in grids.legacy_decode_sizes(tokens, q) if n <= cfg.max_num_seqs),
                _decode_serves(cfg, q, q_of_tier, tiers),
            )
            for q in qs
        ]

    target_q = lambda t: 1 + t.num_speculative_tokens  # noqa: E731
    sets = token_sets("target")
    if mode.has_full_decode:
        sets += decode_sets("target", target_q)
        if cfg.adaptive_verification:
            cap = cfg.max_num_seqs * (1 + cfg.num_speculative_tokens)
            sets.append(GraphSet("target", FULL_VARLEN, None, tuple(t for t in tokens if t <= cap), _av_serves(cfg)))
    method = cfg.method
    if method in ONE_TOKEN_DRAFTERS:
        sets += token_sets(method)
        if mode.has_full_decode:
            sets += decode_sets(method, target_q)
        one_token = one_token_tiers(cfg)
        if one_token:
            runner = next_steps_runner(method)
            if mode.has_full_decode:
                one = tuple(t for t in tokens if t <= cfg.max_num_seqs)
                sets.append(GraphSet(runner, FULL_DECODE, 1, one, _next_steps_serves(cfg, one_token)))
            else:
                sets += token_sets(runner)
    elif method in BLOCK_DRAFTERS:
        if mode.has_full_decode:
            sets += decode_sets(method, lambda t: block_query_len(method, t.num_speculative_tokens),
                                drafting_tiers(cfg))
        else:
            sets += token_sets(method)
    return CapturePlan(cfg, tuple(sets))
