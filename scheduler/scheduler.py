"""Continuous batching: each step, running requests first (in arrival order), then waiting ones, under
``max_num_batched_tokens`` and ``max_num_seqs``, with chunked prefill and preemption by recompute.

A running request sits in a slot; its counters live in numpy arrays indexed by slot, so one step over 1024
running requests costs a few vectorized operations, not 1024 Python iterations. The step's output names
every scheduled request's query length and the batch shape the dispatcher classifies; nothing here decides
padding.

Token accounting per request: ``num_tokens`` = prompt + output tokens so far; ``num_computed`` = tokens whose
KV is in the cache. A request is *decoding* once it has sampled a token and only that last token is uncomputed
(a prompt's one-token tail is still a prefill). It verifies ``d`` drafts: it schedules 1 + d tokens and, when a of
them are accepted, advances num_computed by 1 + a and gains a + 1 tokens; the KV blocks of the rejected drafts
are released (rolled back).

Prefix caching (``enable_prefix_caching``): a request starts at the longest prefix of full blocks the cache holds
(``num_computed`` there, the blocks shared), and always computes at least its last known token. A block is offered
to the cache (registered under its hash, ``scheduler.block_hash``) when a step is scheduled that computes its last
position, and only when every token in it is known: prompt tokens and sampled ones, never drafts (the rejected
drafts' KV never becomes a cached block). A block registered by a step is right once that step has run (steps run
in order on the worker, and a later step, or a request of the same step, reads it after it is written); a step that
fails takes its registrations back (``fail_step``).

Batch kinds and graph modes are the dispatcher's (``dispatcher.plan.dispatch``): the scheduler says only whether
every request of a step is decoding (``BatchShape.is_decode``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

import msgspec
import numpy as np

from scheduler.block_hash import extend_block_hashes, num_lookup_blocks
from scheduler.kv_blocks import KVBlockManager
from scheduler.request import FinishReason, Request, RequestError, RequestStatus
from scheduler.spec_policy import choose_verify_lengths, tier_table

def _DEFAULT_STEP_MS(num_tokens: np.ndarray) -> np.ndarray:
    """Without a measured curve: a fitted host-bound shape, flat below about 1K tokens, linear above."""
    return 1.0 + num_tokens / 1024


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    """Requests per step at most."""
    max_num_batched_tokens: int
    """Tokens per step at most."""
    num_kv_blocks: int
    """KV cache capacity, in blocks."""
    block_size: int = 16
    """Tokens per KV block."""
    max_model_len: int = 8192
    """Prompt plus output tokens a request may hold."""
    tiers: tuple[tuple[int, int, int], ...] = ()
    """Speculative tiers (min_batch, max_batch, K; K = 0: the tier's steps draft nothing); () without speculative
    decoding."""
    adaptive_verification: bool = False
    av_sizes: tuple[int, ...] = ()
    """Captured adaptive-verification sizes (tokens) a step's total should land on."""
    step_ms: Callable[[np.ndarray], np.ndarray] | None = None
    """Step-cost curve for adaptive verification: ms of a FULL step, for an array of token counts."""
    lookahead_tokens: int = 0
    """KV slots held past a step's last token: a model drafter writes up to K + 1 positions ahead."""
    k_limit: int = 0
    """The largest K tiers may be switched to (``Scheduler.set_tiers``: ``"auto"`` tiers); the tiers' own largest K
    when that is more."""
    enable_prefix_caching: bool = False
    """Reuse the KV of full blocks whose prefix another request computed (vLLM's automatic prefix caching)."""
    next_token_key: bool = False
    """A block's KV depends on the token after it too (an EAGLE-style drafter's entry at position p holds token
    p + 1): its hash carries that token, and it is cached only once that token is known."""
    admission_wait_steps: int = 0
    """While every running request decodes, a request that arrived waits up to this many steps before it is
    admitted, so that arrivals one or two steps apart start in one mixed step rather than one each (0: admitted at
    the first step with room). A mixed step runs op by op around PIECEWISE graphs where a uniform decode replays one
    graph, and speculative decoding staggers the finishes (each request accepts its own drafts), so that without a
    wait nearly every other step at 256 streams is mixed (``_hold_arrivals``)."""
    steps_in_flight: int = 2
    """Steps the engine keeps submitted at once (asynchronous scheduling: a step is scheduled while those before
    it run): a request's positions past prompt + max_tokens are bounded by theirs (``extra_tokens``)."""

    @property
    def max_speculative_tokens(self) -> int:
        return max(self.k_limit, max((k for _, _, k in self.tiers), default=0))

    @property
    def extra_tokens(self) -> int:
        """Positions a request may hold past prompt + max_tokens: with drafts, those of the steps in flight (its last
        sampled token and K drafts each: asynchronous scheduling plans a step before the last ones' results; two at
        least), else one a step past the first; and the drafter's lookahead."""
        k, steps = self.max_speculative_tokens, max(self.steps_in_flight, 2)
        return (steps * (k + 1) if k else steps - 1) + self.lookahead_tokens

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table width: a request's prompt and output and its ``extra_tokens``."""
        return -(-(self.max_model_len + self.extra_tokens) // self.block_size)


@dataclass(frozen=True)
class BatchShape:
    """What the dispatcher classifies: four numbers."""

    num_tokens: int
    num_reqs: int
    max_query_len: int
    is_decode: bool
    """No request is prefilling."""


@dataclass
class SchedulerOutput:
    """One step, in scheduling order (running requests first, then newly admitted ones)."""

    step_id: int
    slots: np.ndarray
    """Slot of each scheduled request (its block-table row)."""
    requests: list[Request]
    num_scheduled: np.ndarray
    """Query length of each scheduled request (tokens this step)."""
    num_computed: np.ndarray
    """Tokens in the KV cache before this step (the query's first position), as the scheduler sees them: exact,
    except for a request whose previous step is still running (asynchronous scheduling), where it assumes that
    step's drafts all accepted (an upper bound; the worker holds the exact count)."""
    num_drafts: np.ndarray
    """Drafts verified per request (the query's last tokens); 0 for prefill chunks."""
    samples: np.ndarray
    """Whether the step reaches the request's last known token and so samples."""
    num_new_drafts: int
    """Drafts the drafter proposes for each sampling request after this step (the step's tier K)."""
    new_requests: list[Request]
    """Requests admitted this step (the worker sets up their state)."""
    block_updates: tuple[np.ndarray, np.ndarray, np.ndarray]
    """New block-table entries: (slot, block index, block id)."""
    freed_slots: list[int]
    """Slots whose requests left since the previous step (finished, aborted or preempted)."""
    shape: BatchShape
    epochs: np.ndarray
    """Each request's slot's epoch when the step was scheduled (``Scheduler.slot_epoch``): a row whose slot's epoch
    moved since is not live (its request left, and may have started again: a preempted one)."""
    num_preempted: int = 0
    prefix_cache_queries: int = 0
    """Tokens of the requests started for the first time this step (vLLM's prefix-cache queries); 0 without prefix
    caching."""
    prefix_cache_hits: int = 0
    """Of those, the tokens found in the prefix cache."""
    registered: list[tuple[str, int, bytes]] = field(default_factory=list)
    """Blocks this step offered to the prefix cache: (request id, block, hash)."""

    @property
    def num_tokens(self) -> int:
        return self.shape.num_tokens

    @property
    def first_sample_positions(self) -> np.ndarray:
        """Per request, the position of the first token the step samples: its last known token's position + 1
        (the drafts being verified come after the known tokens)."""
        return self.num_computed + self.num_scheduled - self.num_drafts

    def query_len_histogram(self) -> dict[int, int]:
        values, counts = np.unique(self.num_scheduled, return_counts=True)
        return {int(v): int(c) for v, c in zip(values, counts)}


@dataclass
class ModelResult:
    """What the worker returns for a step, rows aligned with SchedulerOutput."""

    sampled: np.ndarray
    """(n, 1 + K_max) int: row i's first num_accepted[i] + 1 entries are its new tokens (sampling rows only)."""
    num_accepted: np.ndarray
    """Accepted drafts per request (0 for rows that verify none)."""
    draft_confidences: np.ndarray | None = None
    """(n, num_new_drafts) the drafter's probabilities, for adaptive verification."""
    logprobs: np.ndarray | None = None
    """(n, 1 + K, 1 + N) float: per verified position, the produced token's log-probability, then the top N."""
    logprob_ids: np.ndarray | None = None
    """(n, 1 + K, N) int: the top N tokens' ids."""


class RequestOutput(msgspec.Struct, array_like=True):
    """A request's new tokens from one step (and its end, where it ended). A msgspec struct rather than a dataclass:
    the scheduler makes one for every request a step samples for (1,024 a step at 1,024 streams), and a struct is
    built in a third of the time; laid out as the serving engine's ``Delta`` to its front ends (the same fields in
    the same order, the finish reason as its string), so that the engine sends it as it is, without a second object
    a request a step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[dict[int, float]] | None = None
    """Per new token (requests that ask): its log-probability and the top ``SamplingParams.logprobs`` others."""
    num_cached_tokens: int | None = None
    """On a request's first output: its prompt tokens found in the prefix cache (``Request.num_cached_tokens``)."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """On a request's first output (``prompt_logprobs``): per prompt token, its log-probability and the top
    others' (the first token has none: None); set by the engine."""
    prompt_logprob_ranks: list[int | None] | None = None
    """Each prompt token's rank (1: the most likely)."""
    queue_s: float | None = None
    """On a request's first output, set by the serving engine: seconds from the engine taking it to its first step."""
    prefill_s: float | None = None
    """On a request's first output, set by the serving engine: seconds from its first step to this output."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodeStep(NamedTuple):
    """What one step's verification added to the speculative-decoding counters (vLLM's ``SpecDecodingStats`` of a
    step): verify events (requests that verified at least one draft), drafts verified, drafts accepted, and per
    draft position j the verify events that accepted more than j drafts (empty when no draft was verified)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()


NO_DRAFTS = SpecDecodeStep()

RISE_AFTER_STEPS = 16
"""Steps, the fall's own included, during which a uniform decode does not let K rise again after it fell
(``_new_drafts``)."""


def mean_acceptance_length(num_drafts: int, num_accepted_tokens: int) -> float | None:
    """vLLM's mean acceptance length: the tokens a verify event yields, 1 + accepted / drafts (the target's own
    token counted); None without drafts."""
    return 1.0 + num_accepted_tokens / num_drafts if num_drafts else None


def acceptance_rate_per_pos(num_drafts: int, accepted_per_pos) -> list[float]:
    """vLLM's per-position acceptance rates: per draft position, the share of verify events that accepted it
    ([] without drafts)."""
    return [n / num_drafts for n in accepted_per_pos] if num_drafts else []


class SpecDecodeSummary:
    """vLLM's summary of speculative-decoding counters, for a class with ``num_drafts``, ``num_accepted_tokens``
    and ``accepted_per_pos``."""

    num_drafts: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]

    @property
    def mean_acceptance_length(self) -> float | None:
        return mean_acceptance_length(self.num_drafts, self.num_accepted_tokens)

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return acceptance_rate_per_pos(self.num_drafts, self.accepted_per_pos)


@dataclass
class SchedulerStats(SpecDecodeSummary):
    steps: int = 0
    preemptions: int = 0
    aborted: int = 0
    finished: int = 0
    prefix_cache_queries: int = 0
    """Tokens of requests started for the first time with prefix caching on (vLLM's ``prefix_cache_queries``)."""
    prefix_cache_hits: int = 0
    """Of those, tokens whose KV was found in the prefix cache (vLLM's ``prefix_cache_hits``)."""
    drafts_verified: int = 0
    """Draft tokens verified (vLLM's ``num_draft_tokens``)."""
    drafts_accepted: int = 0
    """Draft tokens accepted (vLLM's ``num_accepted_tokens``)."""
    num_drafts: int = 0
    """Verify events: a request in a step that verified at least one draft (vLLM's ``num_drafts``)."""
    accepted_per_pos: list[int] = field(default_factory=list)
    """K_max entries: at position j, the verify events that accepted more than j drafts (vLLM's
    ``num_accepted_tokens_per_pos``); they sum to ``drafts_accepted``."""
    reached_per_pos: list[int] = field(default_factory=list)
    """K_max entries: at position j, the verify events that verified more than j drafts and accepted every draft
    before j (so reached the draft at j): accepted_per_pos[j] / reached_per_pos[j] is the draft at j's acceptance
    given the ones before it were accepted, however many drafts each step verified (tiers). Auto tiers estimate
    from these conditional rates: the unconditional ones of deep positions, measured only when a tier verified
    that deep, go stale when the first position's acceptance moves (an n-gram drafter's as outputs repeat)."""

    @property
    def num_accepted_tokens(self) -> int:
        """``drafts_accepted`` by vLLM's name."""
        return self.drafts_accepted

    def observe_drafts(self, drafts: np.ndarray, accepted: np.ndarray) -> SpecDecodeStep:
        """Count a step's verification: drafts verified and accepted per request (accepted <= drafts <= K_max).
        Returns what it added. (Every step with drafts runs this: a few numpy calls, the rest on K Python ints.)"""
        num_draft_tokens = int(drafts.sum())
        if not num_draft_tokens:
            return NO_DRAFTS
        k = len(self.accepted_per_pos)
        per_pos = _at_least_per_pos(accepted, k)
        step = SpecDecodeStep(int(np.count_nonzero(drafts)), num_draft_tokens, sum(per_pos), tuple(per_pos))
        self.num_drafts += step.num_drafts
        self.drafts_verified += num_draft_tokens
        self.drafts_accepted += step.num_accepted_tokens
        add_per_pos(self.accepted_per_pos, per_pos)
        add_per_pos(self.reached_per_pos, _reached_per_pos(drafts, accepted, k))
        return step


def _at_least_per_pos(counts: np.ndarray, k: int) -> list[int]:
    """Per position j in 0..k-1, the entries of ``counts`` (0..k each) above j."""
    hist = np.bincount(counts, minlength=k + 1).tolist()
    per_pos, more = [0] * k, 0
    for j in range(k, 0, -1):  # position j - 1: the entries of j or more
        more += hist[j]
        per_pos[j - 1] = more
    return per_pos


def _reached_per_pos(drafts: np.ndarray, accepted: np.ndarray, k: int) -> list[int]:
    """Per position j in 0..k-1, the verify events with more than j drafts and at least j accepted."""
    deep_enough = np.minimum(drafts - 1, accepted)  # the deepest position each event reached (-1: none)
    return _at_least_per_pos(deep_enough + 1, k)


def add_per_pos(total: list[int], per_pos) -> None:
    """Add one step's per-position counts into a running total (grown to their length)."""
    total.extend([0] * (len(per_pos) - len(total)))
    for j, n in enumerate(per_pos):
        total[j] += n


@dataclass
class _RunningPick:
    """Stage 1's choice among running requests: rows into ``slots`` (priority order) and what each computes."""

    slots: np.ndarray
    num_scheduled: np.ndarray
    num_computed: np.ndarray
    num_drafts: np.ndarray
    decoding: np.ndarray


class Scheduler:
    """Each step runs five stages, each a method: running requests under the budget (``_pick_running``), preemption
    while their KV blocks do not fit (``_fit_running``), admission of waiting requests (``_admit``), per-request
    verify lengths (``_verify_lengths``), and the step's output (``_output``)."""

    def __init__(self, config: SchedulerConfig):
        c = self.config = config
        self.k_max = c.max_speculative_tokens
        self._k_of_batch = tier_table(c.tiers, c.max_num_seqs) if c.tiers else np.zeros(c.max_num_seqs + 1, np.int64)
        self.tiers = c.tiers
        """The tiers in force (``set_tiers`` switches them)."""
        self._proposed = 0
        """The drafts the last step proposed (``_new_drafts``)."""
        self._fell_at = -RISE_AFTER_STEPS
        """The step at which the drafts proposed last fell (``_new_drafts``)."""
        self.kv = KVBlockManager(c.num_kv_blocks, c.block_size, c.max_num_seqs, c.max_blocks_per_seq)
        n = c.max_num_seqs
        self.num_computed = np.zeros(n, np.int64)
        self.num_tokens = np.zeros(n, np.int64)
        self.num_drafts = np.zeros(n, np.int64)
        self.prompt_len = np.zeros(n, np.int64)
        self.max_output = np.zeros(n, np.int64)
        """max_tokens of the request in each slot."""
        self.checks_eos = np.zeros(n, bool)
        """Whether the request in each slot stops at its EOS (it does not ignore it)."""
        self.has_stop_ids = np.zeros(n, bool)
        """Whether the request in each slot stops at stop token ids of its own."""
        self._eos_ids = np.zeros(0, np.int64)
        """Every EOS id of the requests started so far (their models' EOS: one set in practice): a step's tokens are
        tested against them at once, and only a row with one among its new tokens is scanned (``_append_tokens``)."""
        self._eos_set: set[int] = set()
        """``_eos_ids`` as a set (a request's start checks its own against it)."""
        self.structured = np.zeros(n, bool)
        """The slot's request has structured outputs: a grammar masks its tokens, so it verifies no drafts (they stay
        on the worker, where the engine cannot check them against the grammar)."""
        self.waited = np.zeros(n, bool)
        """The slot's request was running but left out of the last step (the budget was full): it goes first next."""
        self.pending_gain = np.zeros(n, np.int64)
        """Tokens the slot's steps still running may add at most (1 + drafts each); 0 when none is in flight."""
        self.pending_steps = np.zeros(n, np.int64)
        """The slot's steps still running that sample for it (each adds at least one token)."""
        self.draft_conf = np.ones((n, max(self.k_max, 1)), np.float64)
        """The drafter's confidence in each of the slot's drafts (adaptive verification's input; the drafts themselves
        stay on the worker)."""
        self.slot_request: list[Request | None] = [None] * n
        self.slot_epoch = np.zeros(n, np.int64)
        """Per slot, how many requests left it (finished, aborted, preempted): a step's row is live while its slot's
        epoch is the one it was scheduled in. (A request preempted while steps of it run may start again before
        their results are in, with three steps in flight: its own ``Request`` then, a new incarnation.)"""
        self._free_slots = list(range(n - 1, -1, -1))
        self.order: list[int] = []
        """Running slots, highest priority (earliest arrival) first."""
        self._order_arr = np.zeros(0, np.int64)
        self._order_dirty = False
        self.waiting: deque[Request] = deque()
        self._arrived_at: dict[str, int] = {}
        """Waiting requests' arrival step (``admission_wait_steps``); a preempted request has none (it is not held)."""
        self._backlog = False
        """The last admission left requests waiting (tokens, slots or KV blocks ran out): they are not held."""
        self.requests: dict[str, Request] = {}
        self._freed_slots: list[int] = []
        self._registered: list[tuple[str, int, bytes]] = []
        """Blocks registered while the step being scheduled is built."""
        self._unregistered: np.ndarray | None = None
        """The running slots of the last scheduled step whose full blocks ``register_blocks`` has yet to offer."""
        self._queries = self._hits = 0
        """Prefix-cache queries and hits (tokens) of the step being scheduled."""
        self._step = 0
        self.stats = SchedulerStats(accepted_per_pos=[0] * self.k_max, reached_per_pos=[0] * self.k_max)
        self.last_spec_decode = NO_DRAFTS
        """What the last ``update`` added to the speculative-decoding counters (the step's share, for metrics)."""
        self._av_sizes = np.asarray(c.av_sizes, dtype=np.int64)

    def set_tiers(self, tiers) -> None:
        """Switch the speculative tiers ((min_batch, max_batch, K) each, K = 0 allowed, K <= K_max) from the next
        step on (``"auto"`` tiers). A request keeps the drafts it has: a step verifies min(its drafts, the new K);
        where the new K drafts more, the next step proposes it (a switch, not a batch at a border: ``_new_drafts``
        does not wait)."""
        c = self.config
        tiers = tuple((int(lo), int(hi), int(k)) for lo, hi, k in tiers)
        for lo, hi, k in tiers:
            if not 0 <= k <= self.k_max:
                raise ValueError(f"tier {lo}..{hi}: K = {k} is outside 0..{self.k_max} (K_max)")
        self._k_of_batch = tier_table(tiers, c.max_num_seqs)
        self.tiers = tiers
        self._fell_at = -RISE_AFTER_STEPS

    def set_admission_wait(self, steps: int) -> None:
        """Hold arrivals up to ``steps`` steps from the next admission on (``admission_wait_steps``; the engine's
        default under speculative decoding follows the steps' pace). A request that arrived while it was 0 is not
        held."""
        if steps < 0:
            raise ValueError(f"admission_wait_steps must be a step count >= 0, got {steps}")
        self.config = replace(self.config, admission_wait_steps=int(steps))

    # -- requests ------------------------------------------------------------------------------------------
    def add_request(self, request: Request, params_checked: bool = False) -> None:
        """Queue a request; raises RequestError (naming the field and the limit) for one it can never serve.
        ``params_checked``: its sampling parameters were validated already (``check_request``)."""
        self.check_request(request, params_checked)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.config.admission_wait_steps:
            self._arrived_at[request.request_id] = self._step
        self._hash_prompt(request)

    def _hash_prompt(self, req: Request) -> list[bytes]:
        """The hashes of the request's blocks that a cache lookup may find (those before its last known token),
        computed when it is queued (where its front end did not send them: ``Request.block_hashes``): the serving
        engine queues requests while a step runs, so the hashing stays off the step's critical path. [] without
        prefix caching."""
        c = self.config
        if not c.enable_prefix_caching:
            return []
        n = num_lookup_blocks(req.num_tokens, c.block_size)
        return extend_block_hashes(req.block_hashes, req.token_ids, n, c.block_size, c.next_token_key,
                                   req.prompt_int32)[:n]

    def check_request(self, request: Request, params_checked: bool = False) -> None:
        """RequestError (naming the field and the limit) for a request this scheduler can never serve;
        ``params_checked``: its sampling parameters were validated by the caller (the engine validates them against
        the model's vocabulary first: a second and third pass cost ~10 us an arrival in the engine's loop)."""
        c = self.config
        if request.request_id in self.requests:
            raise RequestError(f"request_id {request.request_id!r} is already live")
        if not request.num_prompt_tokens:
            raise RequestError("prompt must hold at least 1 token")
        if not params_checked:
            request.params.validate()
        if request.max_total_tokens > c.max_model_len:
            raise RequestError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.params.max_tokens}) = "
                f"{request.max_total_tokens} exceeds max_model_len = {c.max_model_len}"
            )
        need = self.kv.blocks_for(request.max_total_tokens + c.extra_tokens)
        if need > c.num_kv_blocks:
            raise RequestError(
                f"prompt + max_tokens = {request.max_total_tokens} tokens needs {need} KV blocks, more than the "
                f"cache holds (num_kv_blocks = {c.num_kv_blocks})"
            )

    def abort(self, request_id: str) -> bool:
        """Abort a live request; its KV blocks are freed at once. False if it is not live. Safe at any point of the
        step cycle: ``update`` skips a request that left after its step was scheduled."""
        return self._end(request_id, RequestStatus.ABORTED, FinishReason.ABORT)

    def finish_request(self, request_id: str, reason: FinishReason = FinishReason.STOP) -> bool:
        """Finish a live request from outside the step loop (its text reached a stop string); its KV blocks are
        freed at once, as ``abort`` frees them, but it counts as finished. False if it is not live."""
        if reason is FinishReason.ABORT:
            return self.abort(request_id)
        return self._end(request_id, RequestStatus.FINISHED, reason)

    def _end(self, request_id: str, status: RequestStatus, reason: FinishReason) -> bool:
        self.register_blocks()  # (before a request's blocks are freed)
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self._remove_running(self._slot_of(req))
        else:
            self.waiting.remove(req)
            self._arrived_at.pop(request_id, None)
        req.status, req.finish_reason = status, reason
        if status is RequestStatus.ABORTED:
            self.stats.aborted += 1
        else:
            self.stats.finished += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _slot_of(self, req: Request) -> int:
        return self.slot_request.index(req)

    # -- slots ---------------------------------------------------------------------------------------------
    def _order_array(self) -> np.ndarray:
        if self._order_dirty:
            self._order_arr = np.asarray(self.order, dtype=np.int64)
            self._order_dirty = False
        return self._order_arr

    def _remove_running(self, slot: int) -> None:
        self.kv.release(slot)
        self.order.remove(slot)
        self._order_dirty = True
        self.slot_request[slot] = None
        self.slot_epoch[slot] += 1
        self.num_drafts[slot] = 0
        self.waited[slot] = False
        self._free_slots.append(slot)
        self._freed_slots.append(slot)

    def _preempt(self, slot: int) -> None:
        """Preemption by recompute: free the blocks, forget the KV, requeue first in line."""
        req = self.slot_request[slot]
        self._remove_running(slot)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _start(self, req: Request, num_computed: int) -> int:
        """Give a waiting request a slot; it computes from token ``num_computed`` (its cached prefix; a preempted one
        recomputes its output too)."""
        slot = self._free_slots.pop()
        self.slot_request[slot] = req
        req.status = RequestStatus.RUNNING
        self.num_computed[slot] = num_computed
        self.pending_gain[slot] = 0
        self.pending_steps[slot] = 0
        self.num_tokens[slot] = req.num_tokens
        self.prompt_len[slot] = req.num_prompt_tokens
        self.max_output[slot] = req.params.max_tokens
        self.has_stop_ids[slot] = bool(req.params.stop_token_ids)
        self.checks_eos[slot] = bool(req.eos_token_ids) and not req.params.ignore_eos
        if not self._eos_set.issuperset(req.eos_token_ids):
            self._eos_set.update(req.eos_token_ids)
            self._eos_ids = np.array(sorted(self._eos_set), np.int64)
        self.structured[slot] = req.params.structured_outputs is not None
        self.num_drafts[slot] = 0
        self.order.append(slot)
        self._order_dirty = True
        return slot

    # -- scheduling ----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.register_blocks()  # (the last step's, into its own ``registered``)
        preempted = 0
        self._registered, self._queries, self._hits = [], 0, 0
        while True:
            pick = self._pick_running()
            grown = self._fit_running(pick)
            if grown is not None:
                break
            self._preempt(self.order[-1])  # lowest priority first; then pick again
            preempted += 1
        budget = self.config.max_num_batched_tokens - int(pick.num_scheduled.sum())
        # A step that preempted admits nothing: the blocks it freed go to the running requests first (vLLM's rule),
        # so that a request is never preempted and re-admitted in one step.
        admit = not preempted and not self._hold_arrivals(pick)
        new, new_slots, new_chunks, new_updates = self._admit(budget) if admit else ([], [], [], [])
        return self._output(pick, new, new_slots, new_chunks, [grown, *new_updates], preempted)

    def _hold_arrivals(self, pick: _RunningPick) -> bool:
        """Whether the waiting requests wait this step (``admission_wait_steps``): every picked request decodes, the
        last admission left no request waiting (a backlog is admitted as fast as room allows), and the first in line
        arrived fewer than that many steps ago (a preempted one, back in line, never waits)."""
        wait = self.config.admission_wait_steps
        if not wait or self._backlog or not self.waiting or not len(pick.slots) or not pick.decoding.all():
            return False
        arrived = self._arrived_at.get(self.waiting[0].request_id)
        return arrived is not None and self._step - arrived < wait

    # -- prefix caching --------------------------------------------------------------------------------------
    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks of the request's longest cached prefix, short of its last known token (which it
        computes: it samples there); [] without prefix caching, and for a request that asks for its prompt's
        logprobs (they come from computing every prompt token, as vLLM skips the cache for it)."""
        if req.params.prompt_logprobs is not None:
            return []
        hashes = self._hash_prompt(req)  # (a preempted request's output too)
        return self.kv.lookup(hashes) if hashes else []

    def _register(self, slots: np.ndarray, num_blocks: np.ndarray) -> None:
        """Offer each slot's first ``num_blocks[i]`` blocks to the cache: full, and their KV right once the step being
        scheduled has run (known tokens only)."""
        c = self.config
        reqs = [self.slot_request[s] for s in slots.tolist()]
        for req, n in zip(reqs, num_blocks.tolist()):
            if len(req.block_hashes) < n:
                extend_block_hashes(req.block_hashes, req.token_ids, n, c.block_size, c.next_token_key)
        self.kv.register(slots, [r.block_hashes for r in reqs], num_blocks, [r.request_id for r in reqs],
                         self._registered)

    def _register_one(self, slot: int, req: Request, num_blocks: int) -> None:
        """``_register`` for one slot (an admission)."""
        c = self.config
        if len(req.block_hashes) < num_blocks:
            extend_block_hashes(req.block_hashes, req.token_ids, num_blocks, c.block_size, c.next_token_key)
        self.kv.register_one(slot, req.block_hashes, num_blocks, req.request_id, self._registered)

    def _full_blocks(self, num_computed, num_tokens):
        """Blocks whose KV is right after a step that computes up to ``num_computed`` of ``num_tokens`` known
        tokens (numpy arrays or ints): its full blocks of known tokens (with the token after them, where a block's
        key holds it)."""
        return np.minimum(num_computed, num_tokens - int(self.config.next_token_key)) // self.config.block_size

    def register_blocks(self) -> None:
        """The blocks the last scheduled step fills, offered to the prefix cache (``_register_running``). ``schedule``
        leaves this for after the step is sent, so that the device need not wait for it when the host sets the pace
        (~160 blocks hashed a step at 1,024 requests under speculative decoding, a fifth of the engine's step on the
        CI machine); it is done at the latest when the scheduler is next called on to change (``schedule``,
        ``update``, an abort, a finish, a failed step), with what the step's scheduling left: the same blocks."""
        slots, self._unregistered = self._unregistered, None
        if slots is not None:
            self._register_running(slots)

    def _register_running(self, slots: np.ndarray) -> None:
        """``_register`` for the scheduled slots that complete a block this step (vectorized pick; a decode step
        completes one block in every ``block_size`` tokens of a request)."""
        upto = self._full_blocks(self.num_computed[slots], self.num_tokens[slots])
        done = upto > self.kv.num_registered[slots]
        if done.any():
            self._register(slots[done], upto[done])

    def fail_step(self, out: SchedulerOutput, later: list[SchedulerOutput] = ()) -> list[str]:
        """A step the worker failed: its requests end (aborted), the blocks it registered are forgotten (their KV
        was never written), and so are those that the steps after it (``later``, scheduled before the failure was
        known) registered for its requests; a request that shares such a block (it found it in the cache) ends
        too. So do the blocks those steps registered after a suspect one in their request's chain (computed over
        KV never written, by a request that found it in the cache, or one its client aborted since): their hashes
        would pass that KV on to whoever finds them once the suspect block is computed again. Returns the ids of
        the requests the failure ends."""
        self.register_blocks()
        ids = [r.request_id for r in out.requests]
        failed = set(ids)
        suspect = [(b, h) for rid, b, h in out.registered]
        suspect += [(b, h) for step in later for rid, b, h in step.registered if rid in failed]
        self.kv.unregister(_chained_onto({h for _, h in suspect}, later))
        for rid in ids:
            self.abort(rid)
        for slot in self.kv.slots_holding(self.kv.unregister(suspect)).tolist():
            req = self.slot_request[slot]
            ids.append(req.request_id)
            self.abort(req.request_id)
        return ids

    def _pick_running(self) -> _RunningPick:
        """Stage 1: the running requests this step computes, under the token budget. Requests left out last step go
        first, then arrival order. A decoding request (it has sampled a token and has exactly that one token
        uncomputed) runs its last token and all its drafts, whole: when the next one does not fit, the step ends
        there, a uniform decode of the requests that fit, and those left out go first next step. A prefilling
        request that does not fit takes the budget left as a chunk."""
        c = self.config
        slots = self._order_array()
        if self.waited[slots].any():
            slots = slots[np.argsort(~self.waited[slots], kind="stable")]
        if self.pending_gain[slots].any():  # a request whose running steps surely end it gets no further step
            room = self.max_output[slots] - (self.num_tokens[slots] - self.prompt_len[slots])
            slots = slots[(self.pending_gain[slots] == 0) | (room > self.pending_steps[slots])]
        computed = self.num_computed[slots]
        known = self.num_tokens[slots] + self.pending_gain[slots]
        uncomputed = known - computed
        decoding = (uncomputed == 1) & (known > self.prompt_len[slots])
        k_step = self._tier_k(len(slots))
        drafts = np.where(decoding, np.minimum(self.num_drafts[slots], k_step), 0)
        demand = uncomputed + drafts
        count = int(np.searchsorted(np.cumsum(demand), c.max_num_batched_tokens, side="right"))
        sched = demand[:count]
        left = c.max_num_batched_tokens - int(sched.sum())
        if count < len(slots) and left > 0 and (not decoding[count] or count == 0):
            sched = np.append(sched, left)  # a prefill chunk in the budget left
            if decoding[count]:  # or a decode wider than the whole budget: it verifies fewer drafts
                drafts = drafts.copy()
                drafts[count] = left - 1
            count += 1
        self.waited[slots] = False
        self.waited[slots[count:]] = True
        return _RunningPick(slots[:count], sched, computed[:count], drafts[:count], decoding[:count])

    def _fit_running(self, pick: _RunningPick):
        """Stage 2: KV blocks for the picked requests' tokens (and the drafter's lookahead); None when the pool is
        short (the caller preempts and picks again)."""
        return self.kv.grow(pick.slots, pick.num_computed + pick.num_scheduled + self.config.lookahead_tokens)

    def _admit(self, budget: int) -> tuple[list[Request], list[int], list[int], list]:
        """Stage 3: waiting requests in order (preempted ones first), a prefill chunk each from their cached prefix
        on (its blocks shared), while tokens, slots and KV blocks last. Returns the requests, their slots, their
        chunks and their new block-table entries."""
        c = self.config
        new: list[Request] = []
        slots: list[int] = []
        chunks: list[int] = []
        updates = []
        while self.waiting and budget > 0 and self._free_slots:
            req = self.waiting[0]
            hit = self._cached_prefix(req)
            computed = len(hit) * c.block_size
            chunk = min(req.num_tokens - computed, budget)
            update = self.kv.start(self._free_slots[-1], hit, computed + chunk + c.lookahead_tokens)
            if update is None:  # (the pool is short)
                break
            self.waiting.popleft()
            self._arrived_at.pop(req.request_id, None)
            slot = self._start(req, computed)  # (the slot ``start`` filled: the last free one)
            updates.append(update)
            if c.enable_prefix_caching:  # at once: a request admitted after it in this step may share its blocks
                self._register_one(slot, req, self._full_blocks(computed + chunk, req.num_tokens))
            if req.num_cached_tokens is None:
                req.num_cached_tokens = computed
                if c.enable_prefix_caching:
                    self._queries += req.num_tokens
                    self._hits += computed
            new.append(req)
            slots.append(slot)
            chunks.append(chunk)
            budget -= chunk
        self._backlog = bool(self.waiting)
        return new, slots, chunks, updates

    def _verify_lengths(self, slots: np.ndarray, drafts: np.ndarray, is_decode: bool) -> np.ndarray:
        """Stage 4: drafts each request verifies. A uniform decode keeps every request's drafts (its shape is what the
        FULL graphs hold). Otherwise a request verifies no drafts past its max_tokens (a step yields at most drafts
        + 1 tokens), and with adaptive verification the drafts of largest expected gain, so that the step lands on
        a captured size."""
        c = self.config
        if not drafts.any():
            return drafts
        if c.adaptive_verification and len(self._av_sizes) and is_decode:
            drafts = choose_verify_lengths(self.draft_conf[slots, : self.k_max], drafts, self._av_sizes,
                                           c.max_num_batched_tokens, c.step_ms or _DEFAULT_STEP_MS)
        elif is_decode and (drafts == drafts[0]).all():
            return drafts
        room = self.max_output[slots] - (self.num_tokens[slots] - self.prompt_len[slots])
        return np.minimum(drafts, np.maximum(room - 1, 0))

    def _tier_k(self, num_reqs: int) -> int:
        """The K of the tier in force at a batch of ``num_reqs`` requests (0 without speculative decoding)."""
        return int(self._k_of_batch[min(num_reqs, self.config.max_num_seqs)]) if self.k_max else 0

    def _new_drafts(self, num_reqs: int, drafts: np.ndarray, is_decode: bool) -> int:
        """The drafts the drafter proposes after this step: its batch size's tier K, except that within
        ``RISE_AFTER_STEPS`` steps of a fall a uniform decode proposes what it verifies rather than more. A fused step
        graph proposes as many drafts as it verifies (q - 1), so each rise runs its step op by op, and a batch that
        hovers at a tier's border (a request ends, the next arrives a step or two later: at a concurrency equal to
        the border) would rise and fall every few steps. A batch that shrinks with no fall before (a run's tail
        through tiers that draft ever more) rises at once, and so does an arrival's step or one after a change of the
        tiers (``set_tiers``). Held only where the step verifies every draft the last one proposed (not where
        adaptive verification verified fewer: that cut is no border), and an empty step changes nothing."""
        k = self._tier_k(num_reqs)
        if num_reqs == 0:
            return k
        held = int(drafts[0])
        if (is_decode and held == self._proposed < k and (drafts == held).all()
                and self._step - self._fell_at < RISE_AFTER_STEPS):
            k = held
        if k < self._proposed:
            self._fell_at = self._step
        self._proposed = k
        return k

    def _output(self, pick: _RunningPick, new: list[Request], new_slots: list[int], new_chunks: list[int],
                updates: list, preempted: int) -> SchedulerOutput:
        """Stage 5: the step as the dispatcher and the worker see it."""
        c = self.config
        slots = np.concatenate([pick.slots, np.asarray(new_slots, np.int64)])
        computed = np.concatenate([pick.num_computed, self.num_computed[np.asarray(new_slots, np.int64)]])
        drafts = np.concatenate([pick.num_drafts, np.zeros(len(new), np.int64)])
        known = np.concatenate([pick.num_scheduled - pick.num_drafts, np.asarray(new_chunks, np.int64)])
        is_decode = len(slots) > 0 and not new and bool(pick.decoding.all())
        drafts = self._verify_lengths(slots, drafts, is_decode)
        sched = known + drafts
        samples = computed + known >= self.num_tokens[slots] + self.pending_gain[slots]
        # The step's tokens count as computed from now on (its drafts as accepted, until ``update`` says otherwise),
        # so that the next step can be scheduled before this one's result is back.
        self.num_computed[slots] += sched
        if c.enable_prefix_caching:
            self._unregistered = pick.slots  # (``register_blocks``, once the step is sent)
        self.pending_gain[slots] += np.where(samples, 1 + drafts, 0)
        self.pending_steps[slots] += samples
        num_new_drafts = self._new_drafts(len(slots), drafts, is_decode)
        # what the drafter proposes after this step (a structured request verifies none)
        self.num_drafts[slots] = np.where(samples & ~self.structured[slots], num_new_drafts, 0)
        rows, cols, ids = (np.concatenate(parts) for parts in zip(*updates))
        n = len(slots)
        if n:  # an empty step reaches no worker: it keeps the freed slots for the next
            self._step += 1
            self.stats.steps += 1
            self.stats.prefix_cache_queries += self._queries
            self.stats.prefix_cache_hits += self._hits
        freed, self._freed_slots = (self._freed_slots, []) if n else ([], self._freed_slots)
        return SchedulerOutput(
            step_id=self._step,
            slots=slots,
            requests=[self.slot_request[s] for s in slots.tolist()],
            num_scheduled=sched,
            num_computed=computed,
            num_drafts=drafts,
            samples=samples,
            num_new_drafts=num_new_drafts,
            new_requests=new,
            block_updates=(rows, cols, ids),
            freed_slots=freed,
            shape=BatchShape(int(sched.sum()), n, int(sched.max()) if n else 0, is_decode),
            num_preempted=preempted,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            registered=self._registered,
            epochs=self.slot_epoch[slots],
        )

    # -- results -------------------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: ModelResult) -> list[RequestOutput]:
        """Apply a step's results: advance KV, roll back rejected drafts, append tokens, finish requests. Rows of
        requests that left after the step was scheduled (aborted) are skipped."""
        self.register_blocks()
        rows = np.nonzero(self.slot_epoch[out.slots] == out.epochs)[0]  # (rows whose request has not left since)
        if len(rows) == 0:
            self.last_spec_decode = NO_DRAFTS
            return []
        slots, samples, drafts = out.slots[rows], out.samples[rows], out.num_drafts[rows]
        accepted = np.where(samples, np.minimum(result.num_accepted[rows], drafts), 0)
        self.num_computed[slots] -= drafts - accepted  # the rejected drafts' KV is rolled back
        self.pending_gain[slots] -= np.where(samples, 1 + drafts, 0)
        self.pending_steps[slots] -= samples
        self.kv.shrink(slots, self.num_computed[slots] + self.config.lookahead_tokens)  # keep the lookahead
        self.last_spec_decode = self.stats.observe_drafts(drafts, accepted)
        k_new, conf = out.num_new_drafts, result.draft_confidences
        if k_new and conf is not None:  # the drafts themselves stay on the worker
            self.draft_conf[slots[samples], :k_new] = conf[rows[samples], :k_new]
        return self._append_tokens(out, result, rows[samples], accepted[samples] + 1)

    def _append_tokens(self, out: SchedulerOutput, result: ModelResult, rows: np.ndarray,
                       counts: np.ndarray) -> list[RequestOutput]:
        """Append each sampling row's new tokens (up to max_tokens, through the first stop token) and finish the
        requests that are done."""
        slots = out.slots[rows]
        room = self.max_output[slots] - (self.num_tokens[slots] - self.prompt_len[slots])
        take = np.minimum(counts, room)
        self.num_tokens[slots] += take
        length_done = counts >= room
        sampled = result.sampled[rows]
        width = sampled.shape[1]
        # A row is scanned for a stop where it has stop ids of its own or one of its new tokens is an EOS id (of any
        # request: the scan checks its own), not every row that checks EOS (every request that does not ignore it)
        eos = (sampled[:, :, None] == self._eos_ids).any(2) & (np.arange(width) < take[:, None])  # (np.isin: 4x)
        check_stop = self.has_stop_ids[slots] | (self.checks_eos[slots] & eos.any(1))
        row_list = rows.tolist()
        reqs = [out.requests[r] for r in row_list]
        take_list = take.tolist()
        new_tokens = [t if n == width else t[:n] for t, n in zip(sampled.tolist(), take_list)]
        reasons: list[FinishReason | None] = [None] * len(reqs)
        finished_slots = []
        # (passes of plain Python over every sampling request, 1,024 a step at 1,024 streams, each as tight as it can
        # be; what only some requests need, the end by length and the stop checks, goes over those rows alone)
        for i in np.flatnonzero(length_done | check_stop).tolist():
            reason = FinishReason.LENGTH if length_done[i] else None
            if check_stop[i]:
                req = reqs[i]
                stops = req.params.stop_token_ids
                eos_ids = () if req.params.ignore_eos else req.eos_token_ids
                for j, t in enumerate(new_tokens[i]):
                    if t in eos_ids or t in stops:
                        self.num_tokens[slots[i]] -= take_list[i] - j - 1
                        new_tokens[i] = new_tokens[i][: j + 1]
                        reason = FinishReason.STOP
                        break
            if reason is not None:
                req = reqs[i]
                reasons[i], req.status, req.finish_reason = reason, RequestStatus.FINISHED, reason
                finished_slots.append(int(slots[i]))
                del self.requests[req.request_id]
                self.stats.finished += 1
        cached = [None if r.output_token_ids else r.num_cached_tokens for r in reqs]  # (set on a first output)
        for req, toks in zip(reqs, new_tokens):
            req.output_token_ids.extend(toks)
        if result.logprobs is not None:
            logprobs = [_token_logprobs(result, row, toks, req.params.logprobs)
                        for row, req, toks in zip(row_list, reqs, new_tokens)]
        else:
            logprobs = [None] * len(reqs)
        outputs = [RequestOutput(req.request_id, toks, reason, lp, c)
                   for req, toks, reason, lp, c in zip(reqs, new_tokens, reasons, logprobs, cached)]
        for slot in finished_slots:
            self._remove_running(slot)
        return outputs


def _token_logprobs(result: ModelResult, row: int, tokens: list[int], top: int | None) -> list[dict[int, float]] | None:
    """{token: log-probability} per new token of a row: the produced token's, then the top ``top`` others'."""
    if top is None or result.logprobs is None:
        return None
    values, ids = result.logprobs[row], result.logprob_ids[row]
    return [{t: float(values[j, 0]), **{int(i): float(v) for i, v in zip(ids[j, :top], values[j, 1 : 1 + top])}}
            for j, t in enumerate(tokens)]


def _chained_onto(bad: set, steps) -> list[tuple[int, bytes]]:
    """The (block, hash) registrations of ``steps`` that come after one of the ``bad`` hashes in their request's
    chain of block hashes (a block's hash covers every block before it, so these were computed over a bad one)."""
    out = []
    for step in steps:
        after: dict[str, set] = {}
        for req in step.requests:
            chain = req.block_hashes
            first = next((i for i, h in enumerate(chain) if h in bad), None)
            if first is not None:
                after[req.request_id] = set(chain[first + 1 :])
        out += [(b, h) for rid, b, h in step.registered if h in after.get(rid, ())]
    return out
