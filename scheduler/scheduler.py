"""Continuous batching: each step, running requests first (in arrival order), then waiting ones, under
``max_num_batched_tokens`` and ``max_num_seqs``, with chunked prefill and preemption by recompute.

A running request sits in a slot; its counters live in numpy arrays indexed by slot, so one step over 1024
running requests costs a few vectorized operations, not 1024 Python iterations. The step's output names
every scheduled request's query length and the batch shape the dispatcher classifies; nothing here decides
padding.

Token accounting per request: ``num_tokens`` = prompt + output tokens so far; ``num_computed`` = tokens whose
KV is in the cache. A decode request has num_tokens - num_computed = 1 (its last sampled token) and verifies
``d`` drafts: it schedules 1 + d tokens and, when a of them are accepted, advances num_computed by 1 + a and
gains a + 1 tokens; the KV blocks of the rejected drafts are released (rolled back).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from scheduler.kv_blocks import KVBlockManager
from scheduler.request import FinishReason, Request, RequestError, RequestStatus
from scheduler.spec_policy import choose_verify_lengths, tier_table

UNIFORM_DECODE, ADAPTIVE_VERIFICATION, MIXED = "uniform_decode", "adaptive_verification", "mixed"


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
    """Speculative tiers (min_batch, max_batch, K); () without speculative decoding."""
    adaptive_verification: bool = False
    av_sizes: tuple[int, ...] = ()
    """Captured adaptive-verification sizes (tokens) a step's total should land on."""
    step_ms: Callable[[np.ndarray], np.ndarray] | None = None
    """Step-cost curve for adaptive verification: ms of a FULL step, for an array of token counts."""
    lookahead_tokens: int = 0
    """KV slots held past a step's last token: a model drafter writes up to K + 1 positions ahead."""

    @property
    def max_speculative_tokens(self) -> int:
        return max((k for _, _, k in self.tiers), default=0)

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table width: a request's prompt and output, the drafts it verifies, its last sampled token and
        the drafter's lookahead."""
        return -(-(self.max_model_len + self.max_speculative_tokens + 1 + self.lookahead_tokens) // self.block_size)


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
    """Tokens already in the KV cache before this step (the query's first position)."""
    num_drafts: np.ndarray
    """Drafts verified per request (the query's last tokens); 0 for prefill chunks."""
    draft_tokens: np.ndarray
    """(n, K_max) draft tokens being verified; row i holds num_drafts[i] valid entries."""
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
    kind: str
    """uniform_decode, adaptive_verification or mixed: the scheduler's view of the step."""
    num_preempted: int = 0

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
    draft_tokens: np.ndarray | None = None
    """(n, num_new_drafts) drafts proposed for the next step."""
    draft_confidences: np.ndarray | None = None
    """(n, num_new_drafts) the drafter's probabilities, for adaptive verification."""


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    aborted: int = 0
    finished: int = 0
    drafts_verified: int = 0
    drafts_accepted: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        c = self.config = config
        self.k_max = c.max_speculative_tokens
        self._k_of_batch = tier_table(c.tiers, c.max_num_seqs) if c.tiers else np.zeros(c.max_num_seqs + 1, np.int64)
        self.extra_tokens = self.k_max + 1 + c.lookahead_tokens
        """Tokens a request may hold beyond prompt + max_tokens: drafts being verified, and the lookahead."""
        self.kv = KVBlockManager(c.num_kv_blocks, c.block_size, c.max_num_seqs, c.max_blocks_per_seq)
        n = c.max_num_seqs
        self.num_computed = np.zeros(n, np.int64)
        self.num_tokens = np.zeros(n, np.int64)
        self.num_drafts = np.zeros(n, np.int64)
        self.prompt_len = np.zeros(n, np.int64)
        self.max_output = np.zeros(n, np.int64)
        """max_tokens of the request in each slot."""
        self.checks_stop = np.zeros(n, bool)
        """Whether the request in each slot stops at stop tokens or EOS (else only at max_tokens)."""
        self.draft_tokens = np.zeros((n, max(self.k_max, 1)), np.int64)
        self.draft_conf = np.ones((n, max(self.k_max, 1)), np.float64)
        self.slot_request: list[Request | None] = [None] * n
        self._free_slots = list(range(n - 1, -1, -1))
        self.order: list[int] = []
        """Running slots, highest priority (earliest arrival) first."""
        self._order_arr = np.zeros(0, np.int64)
        self._order_dirty = False
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._freed_slots: list[int] = []
        self._step = 0
        self.stats = SchedulerStats()
        self._av_sizes = np.asarray(c.av_sizes, dtype=np.int64)

    # -- requests ------------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; raises RequestError (naming the field and the limit) for one it can never serve."""
        c = self.config
        if request.request_id in self.requests:
            raise RequestError(f"request_id {request.request_id!r} is already live")
        if not request.prompt_token_ids:
            raise RequestError("prompt must hold at least 1 token")
        request.params.validate()
        if request.max_total_tokens > c.max_model_len:
            raise RequestError(
                f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens ({request.params.max_tokens}) = "
                f"{request.max_total_tokens} exceeds max_model_len = {c.max_model_len}"
            )
        need = self.kv.blocks_for(request.max_total_tokens + self.extra_tokens)
        if need > c.num_kv_blocks:
            raise RequestError(
                f"prompt + max_tokens = {request.max_total_tokens} tokens needs {need} KV blocks, more than the "
                f"cache holds (num_kv_blocks = {c.num_kv_blocks})"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Abort a live request; its KV blocks are freed at once. False if it is not live."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self._remove_running(self._slot_of(req))
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.ABORTED
        req.finish_reason = FinishReason.ABORT
        self.stats.aborted += 1
        return True

    def finish_request(self, request_id: str, reason: FinishReason = FinishReason.STOP) -> bool:
        """Finish a live request from outside the step loop (its text reached a stop string); its KV blocks are
        freed at once, as ``abort`` frees them, but it counts as finished. False if it is not live."""
        if reason is FinishReason.ABORT:
            return self.abort(request_id)
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self._remove_running(self._slot_of(req))
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
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
        self.num_drafts[slot] = 0
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

    # -- scheduling ----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        c = self.config
        preempted = 0
        while True:
            slots = self._order_array()
            comp = self.num_computed[slots]
            uncomputed = self.num_tokens[slots] - comp
            decoding = uncomputed == 1
            k_step = int(self._k_of_batch[min(len(slots), c.max_num_seqs)]) if self.k_max else 0
            drafts = np.where(decoding, np.minimum(self.num_drafts[slots], k_step), 0)
            demand = uncomputed + drafts
            cum = np.cumsum(demand)
            count = int(np.searchsorted(cum, c.max_num_batched_tokens, side="right"))
            sched = demand[:count]
            left = c.max_num_batched_tokens - (int(cum[count - 1]) if count else 0)
            if count < len(slots) and left > 0:  # one more, partially: a prefill chunk or fewer drafts
                sched = np.append(sched, left)
                if decoding[count]:
                    drafts = drafts.copy()
                    drafts[count] = left - 1
                count += 1
            run_slots = slots[:count]
            grown = self.kv.grow(run_slots, comp[:count] + sched + c.lookahead_tokens)
            if grown is not None:
                break
            self._preempt(self.order[-1])  # lowest priority first; retry the whole running set
            preempted += 1
        drafts = drafts[:count]
        decoding = decoding[:count]
        updates = [grown]
        budget = c.max_num_batched_tokens - int(sched.sum())

        # Admit waiting requests (chunked prefill) while tokens, slots and blocks last.
        new: list[Request] = []
        new_slots: list[int] = []
        new_sched: list[int] = []
        while self.waiting and budget > 0 and self._free_slots:
            req = self.waiting[0]
            chunk = min(req.num_tokens, budget)
            if self.kv.blocks_for(chunk + c.lookahead_tokens) > self.kv.num_free:
                break
            self.waiting.popleft()
            slot = self._free_slots.pop()
            self.slot_request[slot] = req
            req.status = RequestStatus.RUNNING
            self.num_computed[slot] = 0
            self.num_tokens[slot] = req.num_tokens
            self.prompt_len[slot] = len(req.prompt_token_ids)
            self.max_output[slot] = req.params.max_tokens
            self.checks_stop[slot] = bool(req.params.stop_token_ids) or (
                bool(req.eos_token_ids) and not req.params.ignore_eos)
            self.num_drafts[slot] = 0
            self.order.append(slot)
            self._order_dirty = True
            updates.append(self.kv.grow(np.array([slot]), np.array([chunk + c.lookahead_tokens])))
            new.append(req)
            new_slots.append(slot)
            new_sched.append(chunk)
            budget -= chunk

        if new:
            all_slots = np.concatenate([run_slots, np.asarray(new_slots, np.int64)])
            sched = np.concatenate([sched, np.asarray(new_sched, np.int64)])
            drafts = np.concatenate([drafts, np.zeros(len(new), np.int64)])
            computed = np.concatenate([comp[:count], np.zeros(len(new), np.int64)])
        else:
            all_slots, computed = run_slots, comp[:count]
        n = len(all_slots)
        is_decode = n > 0 and not new and bool(decoding.all())
        kind = MIXED
        if is_decode and self.k_max:
            if c.adaptive_verification and len(self._av_sizes):
                verify = choose_verify_lengths(self.draft_conf[all_slots, : self.k_max], drafts, self._av_sizes,
                                               c.max_num_batched_tokens, c.step_ms or _DEFAULT_STEP_MS)
                sched = 1 + verify
                drafts = verify
        if is_decode:
            kind = UNIFORM_DECODE if bool((sched == sched[0]).all()) else ADAPTIVE_VERIFICATION
        rows, cols, ids = (np.concatenate(parts) for parts in zip(*updates)) if updates else (np.zeros(0),) * 3
        samples = computed + sched >= self.num_tokens[all_slots]
        shape = BatchShape(int(sched.sum()), n, int(sched.max()) if n else 0, is_decode)
        freed, self._freed_slots = self._freed_slots, []
        self._step += 1
        self.stats.steps += 1
        return SchedulerOutput(
            step_id=self._step,
            slots=all_slots,
            requests=[self.slot_request[s] for s in all_slots.tolist()],
            num_scheduled=sched,
            num_computed=computed,
            num_drafts=drafts,
            draft_tokens=self.draft_tokens[all_slots],
            samples=samples,
            num_new_drafts=int(self._k_of_batch[min(n, c.max_num_seqs)]) if self.k_max else 0,
            new_requests=new,
            block_updates=(rows, cols, ids),
            freed_slots=freed,
            shape=shape,
            kind=kind,
            num_preempted=preempted,
        )

    # -- results -------------------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: ModelResult) -> list[RequestOutput]:
        """Apply a step's results: advance KV, roll back rejected drafts, append tokens, finish requests."""
        slots = out.slots
        if len(slots) == 0:
            return []
        accepted = np.where(out.samples, np.minimum(result.num_accepted, out.num_drafts), 0)
        new_computed = out.first_sample_positions + accepted
        self.num_computed[slots] = new_computed
        self.kv.shrink(slots, new_computed + self.config.lookahead_tokens)  # rejected drafts; keep the lookahead
        self.stats.drafts_verified += int(out.num_drafts.sum())
        self.stats.drafts_accepted += int(accepted.sum())
        outputs: list[RequestOutput] = []
        sampling = np.nonzero(out.samples)[0]
        counts = accepted[sampling] + 1
        tokens = result.sampled[sampling].tolist()
        k_new = out.num_new_drafts
        if k_new and result.draft_tokens is not None:
            keep = sampling
            self.draft_tokens[slots[keep], :k_new] = result.draft_tokens[keep, :k_new]
            conf = result.draft_confidences
            self.draft_conf[slots[keep], :k_new] = conf[keep, :k_new] if conf is not None else 1.0
            self.num_drafts[slots[keep]] = k_new
        else:
            self.num_drafts[slots] = 0
        sampled_slots = slots[sampling]
        room = self.max_output[sampled_slots] - (self.num_tokens[sampled_slots] - self.prompt_len[sampled_slots])
        take = np.minimum(counts, room)
        self.num_tokens[sampled_slots] += take
        finished_slots = []
        length_done = (counts >= room).tolist()
        check_stop = self.checks_stop[sampled_slots].tolist()
        for i, (row, n, toks) in enumerate(zip(sampling.tolist(), take.tolist(), tokens)):
            req = out.requests[row]
            new_tokens = toks[:n]
            reason = FinishReason.LENGTH if length_done[i] else None
            if check_stop[i]:
                stops = req.params.stop_token_ids
                eos = () if req.params.ignore_eos else req.eos_token_ids
                for j, t in enumerate(new_tokens):
                    if t in eos or t in stops:
                        self.num_tokens[sampled_slots[i]] -= len(new_tokens) - j - 1
                        new_tokens = new_tokens[: j + 1]
                        reason = FinishReason.STOP
                        break
            req.output_token_ids.extend(new_tokens)
            if reason is not None:
                req.status = RequestStatus.FINISHED
                req.finish_reason = reason
                finished_slots.append(int(sampled_slots[i]))
                del self.requests[req.request_id]
                self.stats.finished += 1
            outputs.append(RequestOutput(req.request_id, new_tokens, reason is not None, reason))
        for slot in finished_slots:
            self._remove_running(slot)
        return outputs
