"""Configuration: what the user asks for (compilation and speculative configs, engine limits) and what it
resolves to (the exact size lists every capture plan is built from).

Resolution follows SPEC section 2: set a cap to get the default grid up to it, or a list to choose sizes;
``[]`` disables a kind; legacy fields initialize both kinds with a deprecation warning and must not be mixed
with the new ones. Every error names the field, the value and the limit; unknown fields are errors.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, fields
from typing import Any

from dispatcher.plan import gridfit, grids
from dispatcher.plan.acceptance import DEFAULT_ACCEPTANCE_RATE, acceptance_profile
from dispatcher.plan.errors import ConfigError, check_known_fields

MAX_SPECULATIVE_TOKENS = 63
"""Largest K accepted (q = 1 + K <= 64 tokens a request)."""
MAX_PROMPT_LOOKUP = 64
"""Largest n-gram length (prompt_lookup_max) accepted: each n costs the n-gram drafter a pass over the histories."""
NGRAM_DEFAULT_PROMPT_LOOKUP = (1, 3)
"""(prompt_lookup_min, prompt_lookup_max) when neither is given (vLLM's default is 5, 5)."""
SM100_MAX_PREFILL_TOKENS = 8192
"""sm100 default PIECEWISE cap, before min(., max_num_batched_tokens)."""
SM100_DECODE_TOKEN_BUDGET = 4096
"""sm100 default for max_decode_cudagraph_capture_tokens (an interim memory safeguard)."""


class CUDAGraphMode(str, enum.Enum):
    """vLLM's graph modes. FULL and PIECEWISE alone use the prefill grid for every batch."""

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    @property
    def has_piecewise(self) -> bool:
        return self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)

    @property
    def has_full_decode(self) -> bool:
        """Whether uniform decode (and adaptive verification) get their own FULL graphs."""
        return self in (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)


class Platform(str, enum.Enum):
    SM100 = "sm100"
    DEFAULT = "default"


SPEC_METHODS = ("eagle", "eagle3", "mtp", "mtp_multi", "dspark", "dflash", "ngram", "draft_model")


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()
"""A field the user did not set (distinct from ``None``, which for the decode token budget means 'no budget')."""


@dataclass(frozen=True)
class CompilationConfig:
    """``--compilation-config``: the CUDA-graph fields, with vLLM's names. A field left UNSET takes its
    platform default."""

    cudagraph_mode: Any = UNSET
    """One of NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE (default)."""
    max_prefill_cudagraph_capture_tokens: Any = UNSET
    """Tokens. Cap on PIECEWISE graphs (every batch that is not a uniform decode, and uniform decodes no FULL
    graph covers). Default: min(8192, max_num_batched_tokens) on sm100, else 512."""
    prefill_cudagraph_capture_token_sizes: Any = UNSET
    """Tokens. Exact token counts that get a PIECEWISE graph; ``[]`` disables PIECEWISE. Default: the prefill
    grid (sm100) or the legacy list (elsewhere) up to the cap."""
    max_decode_cudagraph_capture_requests: Any = UNSET
    """Requests. Cap on FULL uniform-decode graphs. Default: max_num_seqs (sm100), else floor(512 / q)."""
    decode_cudagraph_capture_request_sizes: Any = UNSET
    """Requests. Exact request counts that get a FULL decode graph (n requests are captured as n * q tokens);
    ``[]`` disables FULL decode. Default: the decode grid (sm100) or legacy request counts up to the cap."""
    max_decode_cudagraph_capture_tokens: Any = UNSET
    """Tokens. Capture uniform decode only when n * q <= this budget (q = 1 included); ``null`` means no
    budget. Adaptive verification is exempt. Default: 4096 on sm100, none elsewhere."""
    max_full_mixed_cudagraph_capture_tokens: Any = UNSET
    """Tokens (0: off, the default). In FULL_AND_PIECEWISE, mixed and prefill steps of up to this many tokens replay
    FULL graphs over the prefill grid's sizes up to it (attention inside the graph: one launch a step, where a
    PIECEWISE step launches a graph and an attention call per layer), larger ones PIECEWISE graphs as before. Meant
    for small models and low concurrency, where a mixed step's launches, not its kernels, set its time."""
    interactivity: Any = UNSET
    """Bool. Adds every token count up to 32 to the prefill grid (65 sizes at 8192)."""
    cudagraph_capture_sizes: Any = UNSET
    """Deprecated. One token list for both kinds (decode: entries divisible by q, divided by q)."""
    max_cudagraph_capture_size: Any = UNSET
    """Deprecated. The legacy list up to this many tokens, for both kinds."""
    delayed_cudagraph_capture: Any = UNSET
    """Bool. Serve as soon as the weights and the KV cache are on the device, and capture the graphs between steps
    (steps whose graph is not captured yet run eagerly). Default false: every graph is captured before serving;
    ``twogrid serve`` on CUDA sets it where it is not given (``configure.delayed_capture_by_default``). (vLLM's
    delayed-capture proposal named it ``use_cudagraph_delayed_capture``, RFC #20098.)"""
    fit_cudagraph_capture_sizes: Any = UNSET
    """Bool. Measure the step cost e(n) at start-up on a few sizes of each kind (and q), keep it under
    $TWOGRID_CACHE/grid_cost (per device, model, dtype and configuration), and capture the prefill and decode grids
    the padding-cost rule gives for that curve (``dispatcher.plan.gridfit``) instead of the default grids. Default
    false. Exclusive with the size lists and the deprecated fields (the caps still bound the grids)."""

    @classmethod
    def from_dict(cls, data: Any) -> "CompilationConfig":
        return cls(**_known_fields(cls, data, "--compilation-config"))


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config``: the drafter and how many tokens it proposes."""

    method: Any = UNSET
    """Drafter: eagle, eagle3, mtp, mtp_multi, dspark, dflash, ngram, draft_model."""
    num_speculative_tokens: Any = UNSET
    """K, drafts a request verifies per step (q = 1 + K). Default: the largest tier K when tiers are set."""
    num_speculative_tokens_per_batch_size: Any = UNSET
    """Dynamic SD tiers ``[[min_batch, K], ...]``: a uniform decode of n requests uses the K of the last
    tier whose min_batch <= n. The first min_batch is 1; min_batch strictly increases; 0 <= K <= K_max (K = 0: that
    tier does not draft). ``"auto"``: the engine chooses the tiers from the measured step cost per (requests, q) and
    the measured acceptance per draft position, among K in ``auto_tier_candidates`` (dispatcher.plan.autotier)."""
    adaptive_verification: Any = UNSET
    """Bool. Decode steps verify a per-request number of drafts (1..1 + K) on FULL varlen graphs."""
    model: Any = UNSET
    """method draft_model: the draft LM (a Hugging Face directory, a .gguf file or a preset name); eagle, eagle3: an
    EAGLE-1/2 or EAGLE-3 head's directory (config.json + safetensors)."""
    prompt_lookup_min: Any = UNSET
    """method ngram: the shortest n-gram (1..prompt_lookup_max) the drafter looks up. Default: prompt_lookup_max
    when that alone is given, else 1."""
    prompt_lookup_max: Any = UNSET
    """method ngram: the longest n-gram (prompt_lookup_min..64) the drafter looks up, tried first. Default:
    prompt_lookup_min when that alone is given, else 3."""

    acceptance_prior: Any = UNSET
    """``"auto"`` tiers only: the acceptance the first tiers are chosen by, before any is measured: a number r (the
    chance a draft is accepted given the one before it was: position j accepted by r^(j+1) of the verify events) or
    per-position rates [p_0, p_1, ...] (non-increasing, in [0, 1]; continued by their last ratio). Default 0.6."""
    auto_tier_candidates: Any = UNSET
    """``"auto"`` tiers only: the K the engine chooses among (0..num_speculative_tokens, the largest being
    num_speculative_tokens); each gets its FULL decode graphs over every batch size it can reach. Default: every K
    from 0 to num_speculative_tokens."""

    @classmethod
    def from_dict(cls, data: Any) -> "SpeculativeConfig":
        return cls(**_known_fields(cls, data, "--speculative-config"))


def _known_fields(cls: type, data: Any, flag: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {type(data).__name__}: {data!r}")
    check_known_fields(data, [f.name for f in fields(cls)], flag)
    return dict(data)


def load_json_file(path: str, flag: str) -> Any:
    """A JSON file named by a flag; ConfigError naming the flag and the file when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag}: {path!r} is not JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{flag}: {path!r} is not UTF-8 text (byte {exc.start}), so not JSON") from None


def parse_json_arg(text: str | None, flag: str) -> dict[str, Any]:
    """Parse a ``--*-config`` value: inline JSON, or ``@path`` to a JSON file."""
    if text is None or text == "":
        return {}
    if text.startswith("@"):
        return load_json_file(text[1:], flag)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None


def fill_mode_flags(args, defaults: dict[str, Any], active: bool, needs: str, error=ConfigError) -> None:
    """The flags only one mode reads (``defaults``: attribute -> default; those ``args`` lacks skipped): each left out
    (None) filled in with its default; one given where the mode is not ``active`` refused (nothing would read it),
    ``error`` saying it is for ``needs``."""
    for attr, value in defaults.items():
        if not hasattr(args, attr):
            continue
        if getattr(args, attr) is None:
            setattr(args, attr, value)
        elif not active:
            raise error(f"--{attr.replace('_', '-')} is for {needs}")


# ----------------------------------------------------------------------------------------------------------
# Resolved configuration
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tier:
    """One dynamic-SD tier: uniform decodes of min_batch..max_batch requests draft K tokens."""

    min_batch: int
    max_batch: int
    num_speculative_tokens: int


@dataclass(frozen=True)
class ResolvedConfig:
    """Every size list a capture plan needs, after defaults, caps and validation."""

    platform: Platform
    max_num_seqs: int
    max_num_batched_tokens: int
    cudagraph_mode: CUDAGraphMode
    method: str | None
    """Speculative method, None without speculative decoding."""
    num_speculative_tokens: int
    """K_max (0 without speculative decoding)."""
    tiers: tuple[Tier, ...]
    """One tier per K in use, covering 1..max_num_seqs; a single tier under fixed K."""
    adaptive_verification: bool
    interactivity: bool
    max_prefill_tokens: int
    prefill_token_sizes: tuple[int, ...]
    max_decode_requests: int
    decode_request_sizes: tuple[int, ...] | None
    """Request sizes shared by every q (sm100 defaults and explicit lists); None when decode sizes come from
    ``decode_token_sizes`` instead."""
    decode_token_sizes: tuple[int, ...] | None
    """Legacy-derived: a token list whose entries divisible by q, over q, are the decode sizes at q."""
    decode_sizes_explicit: bool
    """The user listed the decode sizes: they are captured as given (within the budget), reachable or not."""
    decode_request_limit: int
    """Largest request count any decode list may hold: an explicit cap, else max_num_seqs."""
    max_decode_tokens: int | None
    """The decode capture budget in tokens (None: no budget)."""
    legacy: bool
    """Sized by the deprecated fields."""
    warnings: tuple[str, ...] = field(default=(), compare=False)
    draft_model: str | None = None
    """method draft_model: the draft LM (a Hugging Face directory, a .gguf file or a preset name); eagle, eagle3:
    the draft head's directory (None: the head shipped for the target, else random on a preset)."""
    prompt_lookup_min: int | None = None
    """method ngram: the shortest n-gram looked up (None for the other methods)."""
    prompt_lookup_max: int | None = None
    """method ngram: the longest n-gram looked up, tried first (None for the other methods)."""
    auto_tiers: bool = False
    """``"auto"`` tiers: ``tiers`` is where the engine starts before it has chosen (K_max for every batch); the plan
    captures every candidate K over its reachable batches (``capture_tiers``)."""
    tier_candidates: tuple[int, ...] = ()
    """``"auto"`` tiers: the K the engine chooses among (sorted, K_max last)."""
    acceptance_prior: tuple[float, ...] = ()
    """``"auto"`` tiers: the acceptance per draft position the first tiers are chosen by (K_max entries)."""
    delayed_capture: bool = False
    """``delayed_cudagraph_capture``: serve at once, capture the graphs between steps."""
    fit_sizes: bool = False
    """``fit_cudagraph_capture_sizes``: the prefill and decode grids come from a measured step cost."""
    fits_decode_grid: bool = False
    """``fit_sizes`` refits the decode grid (at q = 1 + K): it has a request cap (sm100's default, or one given);
    off sm100 without a cap the legacy list stands, and its step cost is not measured."""
    grid_cost_source: str | None = field(default=None, compare=False)
    """Where the fitted grids' step cost came from; None while ``fit_sizes`` waits for its measurement (the default
    grids stand in) or without ``fit_sizes``."""
    one_token_request_sizes: tuple[int, ...] | None = None
    """The one-token draft steps' own request grid (up to max_num_seqs) when fitted (the decode curve at q = 1);
    None: the default decode grid."""
    full_mixed_token_sizes: tuple[int, ...] = ()
    """``max_full_mixed_cudagraph_capture_tokens``: the prefill sizes up to it, captured FULL for mixed steps too
    (empty: off)."""

    @property
    def query_lens(self) -> tuple[int, ...]:
        """The uniform-decode q of each tier, widest batch last."""
        return tuple(1 + t.num_speculative_tokens for t in self.tiers)

    @property
    def capture_tiers(self) -> tuple[Tier, ...]:
        """The tiers the plan captures graphs for: ``tiers``, or under ``"auto"`` one tier a candidate K over every
        batch size (1..max_num_seqs), so that whatever the engine chooses later has its graphs."""
        if not self.auto_tiers:
            return self.tiers
        return tuple(Tier(1, self.max_num_seqs, k) for k in self.tier_candidates)

    def decode_sizes(self, query_len: int) -> tuple[int, ...]:
        """Uniform-decode request sizes at q tokens a request, before the token budget."""
        if self.decode_request_sizes is not None:
            return self.decode_request_sizes
        assert self.decode_token_sizes is not None
        cap = self.decode_request_limit
        return tuple(n for n in grids.legacy_decode_sizes(self.decode_token_sizes, query_len) if n <= cap)

    def decode_token_limit(self) -> int:
        """Largest n * q a FULL uniform-decode graph may hold: the budget, else unbounded."""
        return self.max_decode_tokens if self.max_decode_tokens is not None else 1 << 62

    def av_cap_tokens(self) -> int:
        """Adaptive-verification cap: min(decode cap * (1 + K), max_num_batched_tokens)."""
        return min(self.max_decode_requests * (1 + self.num_speculative_tokens), self.max_num_batched_tokens)

    def to_dict(self) -> dict[str, Any]:
        """The resolved fields, as the plan's ``"config"``."""
        return {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "cudagraph_mode": self.cudagraph_mode.value,
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_speculative_tokens_per_batch_size": "auto" if self.auto_tiers
            else [[t.min_batch, t.num_speculative_tokens] for t in self.tiers] if len(self.tiers) > 1
            else None,
            **({"auto_tier_candidates": list(self.tier_candidates), "acceptance_prior": list(self.acceptance_prior)}
               if self.auto_tiers else {}),
            "adaptive_verification": self.adaptive_verification,
            "interactivity": self.interactivity,
            "max_prefill_cudagraph_capture_tokens": self.max_prefill_tokens,
            "prefill_cudagraph_capture_token_sizes": list(self.prefill_token_sizes),
            "max_full_mixed_cudagraph_capture_tokens": self.full_mixed_token_sizes[-1]
            if self.full_mixed_token_sizes else 0,
            "max_decode_cudagraph_capture_requests": self.max_decode_requests,
            "decode_cudagraph_capture_request_sizes": list(self.decode_request_sizes)
            if self.decode_request_sizes is not None
            else {"per_q_from_tokens": list(self.decode_token_sizes or ())},
            "max_decode_cudagraph_capture_tokens": self.max_decode_tokens,
            "legacy_sizing": self.legacy,
            "prompt_lookup_min": self.prompt_lookup_min,
            "prompt_lookup_max": self.prompt_lookup_max,
            "delayed_cudagraph_capture": self.delayed_capture,
            "fit_cudagraph_capture_sizes": self.fit_sizes,
            **({"grid_cost_source": self.grid_cost_source} if self.fit_sizes else {}),
        }


def capture_first_reason(cfg) -> str | None:
    """Why a configuration (a ResolvedConfig) captures every graph before serving although it asks for delayed
    capture, or None: what times its graphs at start-up needs them captured."""
    if not cfg.delayed_capture:
        return None
    if cfg.adaptive_verification:
        return "adaptive verification times its graphs at start-up"
    if cfg.auto_tiers:
        return "\"auto\" speculative tiers time the decode graphs at start-up"
    return None


# ----------------------------------------------------------------------------------------------------------
# Validation helpers: each error names the field, the value and the limit.
# ----------------------------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(name: str, value: Any, limit: int | None = None, limit_name: str = "") -> int:
    if not _is_int(value):
        raise ConfigError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")
    if limit is not None and value > limit:
        raise ConfigError(f"{name} = {value} exceeds {limit_name} = {limit}")
    return value


def _size_list(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{name} must be a list of positive integers, got {value!r}")
    for i, v in enumerate(value):
        if not _is_int(v):
            raise ConfigError(f"{name}[{i}] must be an integer, got {v!r} ({type(v).__name__})")
        if v < 1:
            raise ConfigError(f"{name}[{i}] must be >= 1, got {v}")
    return tuple(sorted(set(value)))


def _bool(name: str, value: Any) -> bool:
    if value is UNSET:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def _drop_oversized(name: str, sizes: tuple[int, ...], limit: int, limit_name: str, warn: list[str]):
    kept = tuple(s for s in sizes if s <= limit)
    dropped = [s for s in sizes if s > limit]
    if dropped:
        shown = ", ".join(map(str, dropped[:8])) + (", ..." if len(dropped) > 8 else "")
        warn.append(f"{name}: dropped {len(dropped)} size(s) above {limit_name} = {limit} ({shown})")
    return kept


NEW_SIZING_FIELDS = (
    "max_prefill_cudagraph_capture_tokens",
    "prefill_cudagraph_capture_token_sizes",
    "max_decode_cudagraph_capture_requests",
    "decode_cudagraph_capture_request_sizes",
)
LEGACY_FIELDS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size")


def resolve(
    compilation: CompilationConfig | dict | None = None,
    speculative: SpeculativeConfig | dict | None = None,
    *,
    platform: Platform | str = Platform.DEFAULT,
    max_num_seqs: int = 1024,
    max_num_batched_tokens: int | None = None,
    step_cost=None,
) -> ResolvedConfig:
    """Resolve user settings into exact size lists (SPEC section 2). Raises ConfigError on bad input.
    ``step_cost`` (a ``gridfit.StepCost``): with ``fit_cudagraph_capture_sizes``, the measured curves the prefill
    and decode grids are fitted to (without one the default grids stand in, until it is measured)."""
    # (None only is "not given": a falsy value of another kind, [] or 0 or false, is refused as any non-object)
    cc = compilation if isinstance(compilation, CompilationConfig) else CompilationConfig.from_dict(
        {} if compilation is None else compilation)
    sc = speculative if isinstance(speculative, SpeculativeConfig) else SpeculativeConfig.from_dict(
        {} if speculative is None else speculative)
    try:
        platform = Platform(platform)
    except ValueError:
        raise ConfigError(f"platform must be one of sm100, default; got {platform!r}") from None
    if max_num_batched_tokens is None:
        max_num_batched_tokens = 16384 if platform is Platform.SM100 else 8192
    max_num_seqs = _positive_int("max_num_seqs", max_num_seqs, 1 << 20, "the limit")
    max_num_batched_tokens = _positive_int("max_num_batched_tokens", max_num_batched_tokens, 1 << 24, "the limit")
    if max_num_seqs > max_num_batched_tokens:
        raise ConfigError(f"max_num_seqs = {max_num_seqs} exceeds max_num_batched_tokens = {max_num_batched_tokens}: "
                          f"a step could never hold every running request's token; lower max_num_seqs or raise "
                          f"max_num_batched_tokens")
    warn: list[str] = []

    # --- speculative decoding --------------------------------------------------------------------------
    method, k_max, tiers, av, auto = _resolve_speculative(sc, max_num_seqs, warn)

    # --- graph mode ------------------------------------------------------------------------------------
    mode = CUDAGraphMode.FULL_AND_PIECEWISE
    if cc.cudagraph_mode is not UNSET:
        try:
            mode = CUDAGraphMode(cc.cudagraph_mode)
        except ValueError:
            allowed = ", ".join(m.value for m in CUDAGraphMode)
            raise ConfigError(f"cudagraph_mode must be one of {allowed}; got {cc.cudagraph_mode!r}") from None
    interactivity = _bool("interactivity", cc.interactivity)
    delayed = _bool("delayed_cudagraph_capture", cc.delayed_cudagraph_capture)
    fit = _bool("fit_cudagraph_capture_sizes", cc.fit_cudagraph_capture_sizes)

    # --- legacy vs new sizing --------------------------------------------------------------------------
    legacy_set = [f for f in LEGACY_FIELDS if getattr(cc, f) is not UNSET]
    new_set = [f for f in NEW_SIZING_FIELDS if getattr(cc, f) is not UNSET]
    if legacy_set and new_set:
        raise ConfigError(
            f"deprecated field {legacy_set[0]} cannot be mixed with {new_set[0]}: "
            f"set the prefill/decode fields alone (or only the deprecated ones)"
        )
    one_token = None
    budget = cc.max_decode_cudagraph_capture_tokens
    if budget is UNSET:
        budget = SM100_DECODE_TOKEN_BUDGET if platform is Platform.SM100 and not legacy_set else None
    elif budget is not None:
        budget = _positive_int("max_decode_cudagraph_capture_tokens", budget)

    if fit:
        given = [f for f in LEGACY_FIELDS + ("prefill_cudagraph_capture_token_sizes",
                                            "decode_cudagraph_capture_request_sizes") if getattr(cc, f) is not UNSET]
        if given:
            raise ConfigError(f"fit_cudagraph_capture_sizes fits the size lists to the measured step cost, so "
                              f"{given[0]} cannot be set with it: give caps (max_prefill_cudagraph_capture_tokens, "
                              f"max_decode_cudagraph_capture_requests) or leave fit_cudagraph_capture_sizes out")
    if legacy_set:
        sizing = _resolve_legacy(cc, max_num_seqs, max_num_batched_tokens, interactivity, warn)
    else:
        sizing = _resolve_new(cc, platform, max_num_seqs, max_num_batched_tokens, interactivity, warn)
        if fit and step_cost is not None:
            sizing = _fitted(sizing, step_cost, 1 + k_max, interactivity)
            if len(step_cost.decode_points(1)) >= 2:  # (with every size of the target's decode grid: a step
                # fuses where the drafter's one-token graphs have its size too, decode_step.FusedDecode._keys)
                one_token = tuple(sorted(set(gridfit.fit_decode(max_num_seqs, step_cost, 1))
                                         | set(sizing.decode.request_sizes or ())))
    dec = sizing.decode
    fits_decode = fit and _decode_fits(dec)  # (fit refuses the deprecated fields: the new sizing)
    q_max = 1 + k_max
    if dec.request_cap is not None:
        max_decode = dec.request_cap
    else:
        max_decode = min(max_num_seqs, max(dec.token_sizes or (0,)) // q_max)
    prefill_sizes = sizing.prefill_token_sizes
    decode_disabled = (dec.request_sizes or dec.token_sizes or ()) == ()
    if not prefill_sizes and decode_disabled:
        mode = CUDAGraphMode.NONE
    if av and mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        why = f"cudagraph_mode is {mode.value}"
        if cc.cudagraph_mode is UNSET or CUDAGraphMode(cc.cudagraph_mode) is not mode:
            why = "both size lists are [] (graphs disabled)"
        raise ConfigError(
            f"adaptive_verification needs FULL varlen graphs, but {why}: use cudagraph_mode "
            f"FULL_AND_PIECEWISE, FULL_DECODE_ONLY or FULL, or set adaptive_verification to false"
        )
    if av and decode_disabled and mode is not CUDAGraphMode.FULL:
        raise ConfigError(
            "adaptive_verification needs FULL varlen graphs, capped at the decode cap times (1 + K), but "
            "decode_cudagraph_capture_request_sizes is []: give it sizes or set adaptive_verification to false"
        )
    return ResolvedConfig(
        platform=platform,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        cudagraph_mode=mode,
        method=method,
        num_speculative_tokens=k_max,
        tiers=tiers,
        adaptive_verification=av,
        interactivity=interactivity,
        max_prefill_tokens=sizing.max_prefill_tokens,
        prefill_token_sizes=prefill_sizes,
        max_decode_requests=max_decode,
        full_mixed_token_sizes=_full_mixed_sizes(cc, mode, prefill_sizes),
        decode_request_sizes=dec.request_sizes,
        decode_token_sizes=dec.token_sizes,
        decode_sizes_explicit=cc.decode_cudagraph_capture_request_sizes is not UNSET,
        decode_request_limit=min(max_num_seqs, dec.request_cap or max_num_seqs),
        max_decode_tokens=budget,
        legacy=bool(legacy_set),
        warnings=tuple(warn),
        draft_model=_draft_model(sc, method),
        **_prompt_lookup(sc, method),
        **auto,
        delayed_capture=delayed,
        fit_sizes=fit,
        fits_decode_grid=fits_decode,
        grid_cost_source=step_cost.source if fit and step_cost is not None else None,
        one_token_request_sizes=one_token,
    )


HEAD_METHODS = ("eagle", "eagle3")
"""Methods whose draft head loads from a checkpoint (``"model"``: an EAGLE-3 or EAGLE-1/2 head directory)."""


def _draft_model(sc: SpeculativeConfig, method: str | None) -> str | None:
    """The draft LM of method draft_model (required there), or an EAGLE head's directory (eagle, eagle3: optional,
    the worker refuses a real target without one unless a head ships for it); refused elsewhere."""
    if sc.model is not UNSET and (not isinstance(sc.model, str) or not sc.model):
        raise ConfigError(f"--speculative-config: \"model\" must be a path (a non-empty string), got {sc.model!r}")
    if method == "draft_model":
        if sc.model is UNSET:
            raise ConfigError("--speculative-config: method draft_model needs \"model\": the draft LM (a Hugging "
                              "Face directory, a .gguf file or a preset name)")
        return sc.model
    if sc.model is not UNSET:
        if method not in HEAD_METHODS:
            raise ConfigError(f"--speculative-config: \"model\" is for methods draft_model, "
                              f"{', '.join(HEAD_METHODS)}, not {method!r}")
        return sc.model
    return None


def _prompt_lookup(sc: SpeculativeConfig, method: str | None) -> dict[str, int | None]:
    """method ngram's n-gram lengths, as vLLM resolves them: one given sets the other; refused for other methods."""
    lo, hi = sc.prompt_lookup_min, sc.prompt_lookup_max
    if method != "ngram":
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(sc, name) is not UNSET:
                raise ConfigError(f"--speculative-config: \"{name}\" is for method ngram, not {method!r}")
        return {}
    if lo is not UNSET:
        lo = _positive_int("prompt_lookup_min", lo, MAX_PROMPT_LOOKUP, "the limit")
    if hi is not UNSET:
        hi = _positive_int("prompt_lookup_max", hi, MAX_PROMPT_LOOKUP, "the limit")
    if lo is UNSET and hi is UNSET:
        lo, hi = NGRAM_DEFAULT_PROMPT_LOOKUP
    lo = hi if lo is UNSET else lo
    hi = lo if hi is UNSET else hi
    if lo > hi:
        raise ConfigError(f"prompt_lookup_min = {lo} exceeds prompt_lookup_max = {hi}")
    return {"prompt_lookup_min": lo, "prompt_lookup_max": hi}


AUTO_ONLY_FIELDS = ("acceptance_prior", "auto_tier_candidates")
"""Speculative fields that only ``"auto"`` tiers read."""


def _resolve_speculative(sc: SpeculativeConfig, max_num_seqs: int, warn: list[str]):
    """(method, K_max, tiers, adaptive verification, the ``"auto"`` fields of ResolvedConfig)."""
    given = {f.name for f in fields(sc) if getattr(sc, f.name) is not UNSET}
    if not given:
        return None, 0, (Tier(1, max_num_seqs, 0),), False, {}
    if sc.method is UNSET:
        raise ConfigError(f"--speculative-config: method is required (one of {', '.join(SPEC_METHODS)})")
    if sc.method not in SPEC_METHODS:
        raise ConfigError(f"method must be one of {', '.join(SPEC_METHODS)}; got {sc.method!r}")
    raw_tiers = sc.num_speculative_tokens_per_batch_size
    name = "num_speculative_tokens_per_batch_size"
    auto = raw_tiers == "auto"
    if isinstance(raw_tiers, str) and not auto:
        raise ConfigError(f"{name} must be a list of [min_batch, K] pairs or \"auto\", got {raw_tiers!r}")
    if not auto:
        for f in AUTO_ONLY_FIELDS:
            if getattr(sc, f) is not UNSET:
                raise ConfigError(f"--speculative-config: \"{f}\" is for \"{name}\": \"auto\", which is not set")
    k = sc.num_speculative_tokens
    if k is not UNSET:
        if not _is_int(k):
            raise ConfigError(f"num_speculative_tokens must be an integer, got {k!r} ({type(k).__name__})")
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got {k}")
    elif auto:
        raise ConfigError(f"num_speculative_tokens is required with \"{name}\": \"auto\" (the largest K the "
                          f"engine may choose)")
    elif raw_tiers is UNSET:
        raise ConfigError("num_speculative_tokens is required with a speculative method")
    av = _bool("adaptive_verification", sc.adaptive_verification)
    if auto:
        return sc.method, k, (Tier(1, max_num_seqs, k),), av, _resolve_auto(sc, k)
    if raw_tiers is UNSET or raw_tiers is None:
        return sc.method, k, (Tier(1, max_num_seqs, k),), av, {}

    if not isinstance(raw_tiers, list) or not raw_tiers:
        raise ConfigError(f"{name} must be a non-empty list of [min_batch, K] pairs or \"auto\", got {raw_tiers!r}")
    pairs: list[tuple[int, int]] = []
    for i, pair in enumerate(raw_tiers):
        if not (isinstance(pair, list) and len(pair) == 2 and all(_is_int(v) for v in pair)):
            raise ConfigError(f"{name}[{i}] must be a pair of integers [min_batch, K], got {pair!r}")
        pairs.append((pair[0], pair[1]))
    if pairs[0][0] != 1:
        raise ConfigError(f"{name}[0] must start at min_batch 1, got {pairs[0][0]}")
    k_limit = k if k is not UNSET else MAX_SPECULATIVE_TOKENS
    for i, (lo, tk) in enumerate(pairs):
        if i and lo <= pairs[i - 1][0]:
            raise ConfigError(
                f"{name}[{i}] min_batch {lo} must be greater than the previous tier's {pairs[i - 1][0]} "
                f"(tiers sorted, not overlapping)"
            )
        if not 0 <= tk <= k_limit:
            raise ConfigError(f"{name}[{i}] K = {tk} must be in 0..{k_limit} (num_speculative_tokens; 0: no drafts)")
    k_max = k if k is not UNSET else max(tk for _, tk in pairs)
    if not any(tk for _, tk in pairs):
        raise ConfigError(f"{name}: every tier has K = 0 (no drafts at any batch size): give a tier K >= 1, or "
                          f"leave --speculative-config out")
    reachable = [(lo, tk) for lo, tk in pairs if lo <= max_num_seqs]
    if len(reachable) < len(pairs):
        warn.append(
            f"{name}: {len(pairs) - len(reachable)} tier(s) start above max_num_seqs = {max_num_seqs} "
            f"and are never used"
        )
    tiers = tuple(
        Tier(lo, (reachable[i + 1][0] - 1) if i + 1 < len(reachable) else max_num_seqs, tk)
        for i, (lo, tk) in enumerate(reachable)
    )
    return sc.method, k_max, tiers, av, {}


def _resolve_auto(sc: SpeculativeConfig, k_max: int) -> dict[str, Any]:
    """The ``"auto"`` fields: the candidate K (0..K_max, K_max among them) and the prior acceptance."""
    name = "auto_tier_candidates"
    candidates = tuple(range(k_max + 1))
    if sc.auto_tier_candidates is not UNSET:
        raw = sc.auto_tier_candidates
        if not isinstance(raw, list) or not raw:
            raise ConfigError(f"{name} must be a non-empty list of K values (0..{k_max}), got {raw!r}")
        for i, v in enumerate(raw):
            if not _is_int(v):
                raise ConfigError(f"{name}[{i}] must be an integer, got {v!r} ({type(v).__name__})")
            if not 0 <= v <= k_max:
                raise ConfigError(f"{name}[{i}] K = {v} must be in 0..{k_max} (num_speculative_tokens)")
        candidates = tuple(sorted(set(raw)))
        if candidates[-1] != k_max:
            raise ConfigError(f"{name} {list(candidates)} must hold num_speculative_tokens = {k_max} (the largest K "
                              f"sizes the drafts and the KV lookahead): add it, or lower num_speculative_tokens")
    prior = DEFAULT_ACCEPTANCE_RATE if sc.acceptance_prior is UNSET else sc.acceptance_prior
    return {"auto_tiers": True, "tier_candidates": candidates,
            "acceptance_prior": acceptance_profile(prior, k_max, "acceptance_prior")}


def _full_mixed_sizes(cc, mode: CUDAGraphMode, prefill_sizes: tuple[int, ...]) -> tuple[int, ...]:
    """``max_full_mixed_cudagraph_capture_tokens``: the prefill sizes up to it (FULL graphs for mixed steps)."""
    name, cap = "max_full_mixed_cudagraph_capture_tokens", cc.max_full_mixed_cudagraph_capture_tokens
    if cap is UNSET or (_is_int(cap) and cap == 0):
        return ()
    cap = _positive_int(name, cap)
    if mode is not CUDAGraphMode.FULL_AND_PIECEWISE:
        raise ConfigError(f"{name} = {cap} needs cudagraph_mode FULL_AND_PIECEWISE, got {mode.value} (FULL already "
                          f"runs every mixed step in a FULL graph; the others capture no token-keyed FULL graphs): "
                          f"set it to 0 or change the mode")
    sizes = tuple(s for s in prefill_sizes if s <= cap)
    if not sizes:
        first = f"its smallest is {prefill_sizes[0]}" if prefill_sizes else "it is empty"
        raise ConfigError(f"{name} = {cap} covers no size of the prefill grid ({first}): FULL mixed graphs take "
                          f"the prefill grid's sizes up to it")
    return sizes


def _resolve_legacy(cc, max_num_seqs, max_num_batched_tokens, interactivity, warn):
    if cc.cudagraph_capture_sizes is not UNSET:
        tokens = _size_list("cudagraph_capture_sizes", cc.cudagraph_capture_sizes)
        if cc.max_cudagraph_capture_size is not UNSET:
            cap = _positive_int("max_cudagraph_capture_size", cc.max_cudagraph_capture_size)
            if tokens and tokens[-1] > cap:
                raise ConfigError(
                    f"cudagraph_capture_sizes has {tokens[-1]}, above max_cudagraph_capture_size = {cap}"
                )
        used = "cudagraph_capture_sizes"
    else:
        cap = _positive_int("max_cudagraph_capture_size", cc.max_cudagraph_capture_size)
        tokens = grids.legacy_token_list(cap)
        used = "max_cudagraph_capture_size"
    warn.append(
        f"{used} is deprecated: it sizes prefill (tokens) and decode (requests) alike; set "
        f"max_prefill_cudagraph_capture_tokens / max_decode_cudagraph_capture_requests (or their size lists)"
    )
    tokens = _drop_oversized("cudagraph_capture_sizes", tokens, max_num_batched_tokens, "max_num_batched_tokens", warn)
    prefill = _with_interactivity(tokens, interactivity)
    return _Sizing(tokens[-1] if tokens else 0, prefill, _DecodeSizing(None, None, tokens))


def _with_interactivity(sizes: tuple[int, ...], interactivity: bool) -> tuple[int, ...]:
    """``interactivity`` adds every token count up to 32 (up to the largest size) to a prefill list."""
    if not interactivity or not sizes:
        return sizes
    dense = range(1, min(grids.INTERACTIVITY_DENSE_THROUGH, sizes[-1]) + 1)
    return tuple(sorted(set(sizes) | set(dense)))


def _cap_and_list(cc, cap_field: str, list_field: str, limit: int, limit_name: str, warn: list[str]):
    """Validate one kind's cap and size list: the cap is clamped to the engine limit (with a warning), the
    list must fit within the cap, and list entries above the limit are dropped (one warning)."""
    cap, sizes = getattr(cc, cap_field), getattr(cc, list_field)
    if cap is not UNSET:
        cap = _positive_int(cap_field, cap)
        if cap > limit:
            warn.append(f"{cap_field} = {cap} exceeds {limit_name} = {limit}; capped")
            cap = limit
    if sizes is not UNSET:
        sizes = _size_list(list_field, sizes)
        if cap is not UNSET and sizes and sizes[-1] > cap:
            raise ConfigError(f"{list_field} has {sizes[-1]}, above {cap_field} = {cap}")
        sizes = _drop_oversized(list_field, sizes, limit, limit_name, warn)
    return cap, sizes


def _resolve_new(cc, platform, max_num_seqs, max_num_batched_tokens, interactivity, warn):
    sm100 = platform is Platform.SM100

    # Prefill (tokens)
    cap, sizes = _cap_and_list(cc, "max_prefill_cudagraph_capture_tokens", "prefill_cudagraph_capture_token_sizes",
                               max_num_batched_tokens, "max_num_batched_tokens", warn)
    if sizes is not UNSET:
        sizes = _with_interactivity(sizes, interactivity)
        prefill_cap = sizes[-1] if sizes else 0
    else:
        if cap is UNSET:
            cap = min(SM100_MAX_PREFILL_TOKENS if sm100 else grids.LEGACY_DEFAULT_MAX_TOKENS, max_num_batched_tokens)
        sizes = _with_interactivity(grids.prefill_grid(cap) if sm100 else grids.legacy_token_list(cap), interactivity)
        prefill_cap = cap

    # Decode (requests)
    dcap, dsizes = _cap_and_list(cc, "max_decode_cudagraph_capture_requests", "decode_cudagraph_capture_request_sizes",
                                 max_num_seqs, "max_num_seqs", warn)
    if dsizes is not UNSET:
        decode = _DecodeSizing(dsizes[-1] if dsizes else 0, dsizes, None)
    elif sm100:
        dcap = max_num_seqs if dcap is UNSET else dcap
        decode = _DecodeSizing(dcap, grids.decode_grid(dcap), None)
    elif dcap is UNSET:
        # Off sm100, nothing set: the legacy request counts, reaching floor(512 / q).
        tokens = grids.legacy_token_list(min(grids.LEGACY_DEFAULT_MAX_TOKENS, max_num_batched_tokens))
        decode = _DecodeSizing(None, None, tokens)
    else:
        # Off sm100 with a cap: the legacy request counts up to the cap (at any q <= 64).
        decode = _DecodeSizing(dcap, None, grids.legacy_token_list(dcap * (1 + MAX_SPECULATIVE_TOKENS)))
    return _Sizing(prefill_cap, sizes, decode)


def _fitted(sizing: "_Sizing", step_cost, query_len: int, interactivity: bool) -> "_Sizing":
    """``sizing`` with its prefill and decode grids fitted to ``step_cost`` (``dispatcher.plan.gridfit``) up to its
    caps; the decode grid at the largest q in use. A kind without a cap (off sm100, the legacy decode reach) or
    without a measured curve keeps its list."""
    prefill = sizing.prefill_token_sizes
    if prefill and len(step_cost.prefill) >= 2:
        prefill = _with_interactivity(gridfit.fit_prefill(sizing.max_prefill_tokens, step_cost), interactivity)
    dec = sizing.decode
    if _decode_fits(dec) and len(step_cost.decode_points(query_len)) >= 2:
        dec = _DecodeSizing(dec.request_cap, gridfit.fit_decode(dec.request_cap, step_cost, query_len), None)
    return _Sizing(sizing.max_prefill_tokens, prefill, dec)



def _decode_fits(dec: "_DecodeSizing") -> bool:
    """A decode grid that fitted grids replace: one with a request cap, not disabled (``[]``)."""
    return bool(dec.request_cap) and dec.request_sizes != ()


@dataclass(frozen=True)
class _DecodeSizing:
    request_cap: int | None
    """Explicit or default cap in requests; None: implied by the token list, floor(max token / q)."""
    request_sizes: tuple[int, ...] | None
    token_sizes: tuple[int, ...] | None


@dataclass(frozen=True)
class _Sizing:
    max_prefill_tokens: int
    prefill_token_sizes: tuple[int, ...]
    decode: _DecodeSizing
