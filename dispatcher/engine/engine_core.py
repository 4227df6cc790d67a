"""The engine core: scheduler -> dispatcher -> worker -> outputs, one step at a time, in one process.

``twogrid serve`` wraps this loop in an engine process talking to worker processes; offline generation and
the GPU tests use it directly. A step is three calls, so that a caller can interleave aborts anywhere in the cycle:
``schedule()`` (the scheduler's step and the dispatcher's descriptors), ``execute(step)`` (the worker) and
``update(step, result)`` (tokens appended, requests finished); ``step()`` runs the three.
"""

from __future__ import annotations

import copy
import json
import logging
import numbers
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterator

import msgspec
import numpy as np

from dispatcher.engine.config import SD_ADMISSION_WAIT_MS, EngineArgs, admission_pace_for, scheduler_config
from dispatcher.engine.cost import CostCurve, load_step_costs
from dispatcher.engine.structured import StructuredOutputs
from dispatcher.engine.trace import TraceWriter, step_record
from dispatcher.messages import F32, I32, NewRequest, SamplingSpec, Step, StepResult, pack, unpack
from dispatcher.plan import autotier
from dispatcher.plan.capture_plan import FULL_DECODE, FULL_VARLEN, build_plan
from dispatcher.plan.config import ConfigError, ResolvedConfig
from dispatcher.plan.dispatch import (UNIFORM_DECODE, StepDescriptors, dispatch_step, dispatchers_for_plan,
                                      eager_reason, not_captured_reason, padded_up, without_graphs)
from dispatcher.runtime.cache import cached_json
from dispatcher.runtime.capture import GAP_BUDGET_S
from dispatcher.runtime.worker import ModelWorker, WorkerConfig
from models.config import ModelConfig
from models.loader import default_dtype
from scheduler.block_hash import HASH_BYTES, extend_block_hashes, num_lookup_blocks, split_hashes
from scheduler.request import FinishReason, Request, RequestError, SamplingParams, child_params, child_request_id
from scheduler.scheduler import (ModelResult, RequestOutput, Scheduler, SchedulerOutput, SpecDecodeStep,
                                 SpecDecodeSummary, add_per_pos)

log = logging.getLogger("twogrid.engine")


@dataclass
class EngineStats(SpecDecodeSummary):
    """Counters over the engine's life (benchmarks read and reset them); ``mean_acceptance_length`` and
    ``acceptance_rate_per_pos`` follow from the speculative-decoding ones."""

    steps: int = 0
    device_ms: float = 0.0
    """Sum of the steps' device times: the device's busy time."""
    wait_s: float = 0.0
    """Time the host spent waiting for step results."""
    host_ms: float = 0.0
    """Time the host spent scheduling and dispatching steps."""
    eager_steps: int = 0
    fused_steps: int = 0
    """Steps that ran as one fused decode-step graph."""
    eager_by_reason: dict[str, int] = field(default_factory=dict)
    """Eager steps by cause (dispatcher.plan.dispatch.EAGER_CAUSES)."""
    stand_in_steps: int = 0
    """Delayed capture: steps whose target replayed a larger captured graph than its own (``StandIns``)."""
    padded_tokens: int = 0
    num_drafts: int = 0
    """Speculative decoding, as vLLM counts it: verify events (a request in a step that verified >= 1 draft)."""
    num_draft_tokens: int = 0
    """Drafts verified."""
    num_accepted_tokens: int = 0
    """Drafts accepted."""
    accepted_per_pos: list[int] = field(default_factory=list)
    """Per draft position j: verify events that accepted more than j drafts (K_max entries once drafts ran)."""

    def record_drafts(self, spec: SpecDecodeStep) -> None:
        """A step's verification (the scheduler's ``last_spec_decode``)."""
        if not spec.num_drafts:
            return
        self.num_drafts += spec.num_drafts
        self.num_draft_tokens += spec.num_draft_tokens
        self.num_accepted_tokens += spec.num_accepted_tokens
        add_per_pos(self.accepted_per_pos, spec.accepted_per_pos)

    def record(self, step: "ScheduledStep", device_ms: float, wait_s: float, eager_cause: str | None,
               fused: bool = False) -> None:
        self.steps += 1
        self.fused_steps += fused
        self.device_ms += device_ms
        self.wait_s += wait_s
        self.host_ms += step.host_ms
        target = step.descs.target
        if eager_cause is not None:
            self.eager_steps += 1
            self.eager_by_reason[eager_cause] = self.eager_by_reason.get(eager_cause, 0) + 1
        self.padded_tokens += target.num_tokens - step.out.shape.num_tokens


@dataclass
class ScheduledStep:
    """One step between ``schedule`` and ``update``: the scheduler's output, every forward's descriptor, and the
    message the worker gets."""

    out: SchedulerOutput
    descs: StepDescriptors
    message: Step
    host_ms: float
    pending: object = None
    """The worker's handle while the step runs."""
    submitted_at: float = 0.0
    """When it went to the worker (time.perf_counter; 0: not recorded)."""
    eager_cause: str | None = None
    """Why the target ran eagerly (dispatch.EAGER_CAUSES), set when the result is taken; None on a graph."""
    prompt_rows: np.ndarray | None = None
    """Per request, its query's first rows whose prompt log-probabilities the step returns (None: none)."""
    prompt_logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    """Those rows' (log-probabilities (p, 1 + N), top ids (p, N), ranks (p,)), set when the result is taken."""
    trace_record: dict | None = None
    """With a step trace: the step's record, made when the result is taken and written once the scheduler has
    taken it (with the drafts it accepted)."""


def step_message(out: SchedulerOutput, descs: StepDescriptors, grammar_rows: np.ndarray,
                 prompt_rows: np.ndarray | None = None, grammars: tuple | None = None) -> Step:
    """The scheduler's step as the worker sees it: new requests once, then slots and counts, the rows a grammar
    constrains (the worker fills their bitmask), the grammars it gets and drops (``grammars``:
    ``StructuredOutputs.for_step``'s) and the prompt rows whose log-probabilities are asked for."""
    first = len(out.slots) - len(out.new_requests)
    new_slots, new_computed = out.slots[first:].tolist(), out.num_computed[first:].tolist()
    grammar_ids, defs, drops = grammars or ([-1] * len(new_slots), [], b"")
    new = [NewRequest(slot, _token_bytes(req), req.num_prompt_tokens, sampling_spec(req), computed, gid)
           for req, slot, computed, gid in zip(out.new_requests, new_slots, new_computed, grammar_ids)]
    return Step(out.step_id, new, pack(out.freed_slots), pack(out.slots), pack(out.num_scheduled),
                pack(out.num_drafts), pack(out.samples, np.uint8), out.num_new_drafts,
                int((out.num_computed + out.num_scheduled).max()),
                pack(np.stack(out.block_updates) if len(out.block_updates[0]) else np.zeros((3, 0))),
                descs.target, descs.draft, descs.draft_next,
                prompt_logprob_rows=pack(prompt_rows) if prompt_rows is not None else b"",
                grammar_rows=pack(grammar_rows), grammars=defs, dropped_grammars=drops)


def _token_bytes(req: Request) -> bytes:
    """A request's tokens as int32, for its admission: the prompt as the engine kept it when it checked it (a
    request admitted again, preempted, is packed then with its output)."""
    if req.prompt_int32 is not None and not req.output_token_ids:
        return req.prompt_int32
    return pack(req.all_token_ids)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    """``params`` with ``seed``, a copy (the caller's object may serve other requests): ``dataclasses.replace``
    without its second pass over the fields, which the copy's were through already (timed alone: 6 -> 2 us)."""
    params = copy.copy(params)
    object.__setattr__(params, "seed", seed)
    return params


def sampling_spec(req: Request) -> SamplingSpec:
    """What the worker keeps of a request's sampling parameters (sent once, when it is admitted)."""
    p = req.params
    spec = SamplingSpec(float(p.temperature), int(p.top_k), float(p.top_p), int(p.seed or 0),
                        -1 if p.logprobs is None else int(p.logprobs), min_p=float(p.min_p),
                        num_prompt_logprobs=-1 if p.prompt_logprobs is None else int(p.prompt_logprobs))
    if not p.processes_logits:
        return spec
    words = p.bad_words_token_ids
    bias = p.logit_bias or {}
    return msgspec.structs.replace(
        spec, repetition_penalty=float(p.repetition_penalty), presence_penalty=float(p.presence_penalty),
        frequency_penalty=float(p.frequency_penalty), min_tokens=int(p.min_tokens),
        min_tokens_stop_ids=pack(sorted(set(p.stop_token_ids) | set(req.eos_token_ids))) if p.min_tokens else b"",
        allowed_token_ids=pack(p.allowed_token_ids) if p.allowed_token_ids is not None else b"",
        logit_bias_ids=pack(list(bias)), logit_bias=pack(list(bias.values()), F32),
        bad_words=pack([t for w in words for t in w]), bad_word_lens=pack([len(w) for w in words]))


def model_result(result: StepResult, out: SchedulerOutput) -> ModelResult:
    n = len(out.slots)
    conf = None
    if result.draft_confidences:
        conf = unpack(result.draft_confidences, F32, (n, out.num_new_drafts))
    logprobs = ids = None
    if result.logprobs:
        top = result.num_top_logprobs
        logprobs = unpack(result.logprobs, F32, (n, result.width, 1 + top))
        ids = unpack(result.logprob_ids, I32, (n, result.width, top))
    return ModelResult(unpack(result.sampled, I32, (n, result.width)).astype(np.int64),
                       unpack(result.num_accepted).astype(np.int64), conf, logprobs, ids)


def checked_token_ids(prompt_token_ids, vocab: int) -> tuple[list[int] | None, bytes | None]:
    """The prompt's token ids as a list of ints (None for a front end's int32 bytes: the request makes the list
    where a use asks for it), and packed as native int32 where the check made them an array (None otherwise);
    RequestError names the first one that is not an integer token id of the vocabulary 0..vocab-1 (a bool is
    not). Checked with numpy where every id is a plain int (a front end's prompts: a Python loop took about
    1 ms a 2,000-token prompt, on the engine's event loop, which a burst of arrivals held for hundreds of ms);
    anything else, or a failure, by the loop that names the token."""
    if isinstance(prompt_token_ids, (bytes, bytearray, memoryview)):  # a front end's (``protocol.pack_prompt``)
        return _checked_packed(bytes(prompt_token_ids), vocab)
    ids = prompt_token_ids.tolist() if isinstance(prompt_token_ids, np.ndarray) else list(prompt_token_ids)
    if not ids:
        return ids, None
    if set(map(type, ids)) == {int}:
        try:
            a = np.fromiter(ids, np.int64, len(ids))
        except OverflowError:
            a = None
        if a is not None and a.min() >= 0 and a.max() < vocab:
            return ids, a.astype(np.int32).tobytes()
    for t in ids:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
            raise RequestError(f"prompt token {t!r} is not an integer token id")
        if not 0 <= t < vocab:
            raise RequestError(f"prompt token {int(t)} is outside the vocabulary 0..{vocab - 1}")
    return [int(t) for t in ids], None


def _checked_packed(packed: bytes, vocab: int) -> tuple[None, bytes]:
    """``checked_token_ids`` for little-endian int32 bytes: no list, and the native int32 bytes (the same bytes on
    a little-endian host); RequestError for a length that is not whole int32s, and, from the ids' own check, for an
    id outside the vocabulary."""
    if len(packed) % 4:
        raise RequestError(f"prompt token ids: {len(packed)} bytes is not a whole number of int32 ids")
    a = np.frombuffer(packed, dtype="<i4")
    if not len(a) or a.min() < 0 or a.max() >= vocab:  # (the list's check names the first id outside)
        return checked_token_ids(a.tolist(), vocab)
    return None, packed if sys.byteorder == "little" else a.astype(np.int32).tobytes()


class EngineCore:
    """The step loop over a worker: an in-process ModelWorker (built here), or any object with the same ``submit``,
    ``collect``, ``model_config``, ``device_name`` and ``measure_av_curve`` (the serving engine's worker process)."""

    def __init__(self, cfg: ResolvedConfig, args: EngineArgs, capture: bool = True, progress: bool = False,
                 worker=None, structured: StructuredOutputs | None = None):
        """``structured``: the structured outputs, built already (``structured_outputs``; the serving engine builds
        them while its worker loads); by default built here."""
        self.cfg = cfg
        self.args = args
        self.plan = build_plan(cfg)
        self.dispatchers = dispatchers_for_plan(self.plan)
        sched_cfg = scheduler_config(cfg, args.num_kv_blocks, args.block_size, args.max_model_len,
                                     enable_prefix_caching=args.enable_prefix_caching,
                                     admission_wait_steps=args.admission_wait_steps,
                                     steps_in_flight=args.steps_in_flight)
        if sched_cfg.admission_wait_steps:
            log.info("arrivals wait up to %d steps while every running request decodes (--admission-wait-steps%s)",
                     sched_cfg.admission_wait_steps, "" if args.admission_wait_steps is not None else
                     f": the default under speculative decoding, no more than {SD_ADMISSION_WAIT_MS:.0f} ms of steps")
        self.capture_report = None
        tokenizer = structured.tokenizer if structured is not None else _tokenizer(args)
        if worker is None:
            dtype = args.dtype or default_dtype(args.model, args.device)
            worker = ModelWorker(
                WorkerConfig(args.model, args.device, dtype, args.num_kv_blocks, args.block_size, args.max_model_len,
                             cfg.max_num_seqs, cfg.max_num_batched_tokens, sched_cfg.max_blocks_per_seq, args.seed,
                             args.use_cuda_graphs, args.fixed_acceptance, args.fuse_decode_steps,
                             args.quantization, args.kv_cache_dtype, tokenizer is not None,
                             steps_in_flight=args.steps_in_flight),
                self.plan,
            )
            if capture:
                self.capture_report = worker.capture_or_delay(progress)
        self.worker = worker
        self.scheduler = Scheduler(sched_cfg)
        reach = args.max_model_len + sched_cfg.extra_tokens
        if reach > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len = {args.max_model_len} plus {sched_cfg.extra_tokens} positions for drafts and "
                f"lookahead exceeds the model's max_position_embeddings = "
                f"{self.model_config.max_position_embeddings}: lower max_model_len")
        if capture and cfg.adaptive_verification:
            curve = self._av_cost_curve()
            if curve is not None:
                self.scheduler = Scheduler(replace(sched_cfg, step_ms=curve))
        self.auto_tiers: autotier.AutoTiers | None = None
        """``"auto"`` speculative tiers: the decision and its state (None with fixed K or hand-written tiers)."""
        self.admission_pace = admission_pace_for(cfg, args.admission_wait_steps)
        """The default admission wait under speculative decoding, following the steps' pace (None: a wait given)."""
        self._last_result_at = 0.0
        """When the last step's result was taken (``finish``, ``fail_step``): the next one's period starts there."""
        self.tier_version = 0
        """Counts the tier changes (``"auto"``), so that a caller can tell when to report them."""
        if cfg.auto_tiers:
            costs = self._spec_step_costs(capture)
            self.auto_tiers = autotier.AutoTiers(autotier.chooser_for_plan(costs, self.plan), cfg.acceptance_prior,
                                                 args.auto_tier_interval, served_costs=not args.spec_cost_table)
            self.scheduler.set_tiers(self.auto_tiers.tiers)
            log.info("speculative tiers (auto, from %s, prior acceptance %s): %s", costs.source,
                     ", ".join(f"{p:.2f}" for p in cfg.acceptance_prior), self.auto_tiers.choice.text())
        self.trace = TraceWriter(args.step_trace)
        self.stats = EngineStats(accepted_per_pos=[0] * self.scheduler.k_max)
        self._next_id = 0
        self._held: dict[str, tuple[list[Request], object]] = {}
        """n > 1: the children after the first, by the first's id, until a step schedules the rest of its prompt:
        queued then, so that the next step admits them and they find the prompt's KV blocks (prefix caching: blocks
        a step registers serve the steps after it) instead of computing them again; with the first's compiled
        grammar (None: none, or the offline engine's, compiled when they are queued)."""
        self._parked: dict[int, list[Request]] = {}
        """Structured requests by grammar id, while the worker reads their grammar, sent ahead so that no step waits
        for it (``StructuredOutputs.send_ahead``): they join the scheduler when a step result says it is read."""
        self._prompt_logprobs: dict[str, PromptLogprobs] = {}
        """Requests with ``prompt_logprobs`` until their first output, which carries them."""
        self._seeds = np.random.default_rng(args.seed)
        self.eos_token_ids = (self.model_config.eos_token_ids if args.eos_token_ids is None
                              else tuple(args.eos_token_ids))
        self.structured = structured or StructuredOutputs(tokenizer, self.model_config.vocab_size,
                                                          self.eos_token_ids, args.structured_compile_timeout_s)
        """Structured outputs' grammars (xgrammar, loaded at the first structured request or by
        ``structured.start()``; the worker keeps the matchers)."""
        self._said_no_drafts = False
        self._said_hash_mismatch = False

    def capture_gap(self) -> None:
        """Delayed capture's share of the gap after a submitted step (``ModelWorker.capture_between_steps``, at
        most GAP_BUDGET_S); nothing once every graph is captured, or for a worker in another process (its own loop
        captures)."""
        if getattr(self.worker, "capture_pending", False):
            self.worker.capture_between_steps(GAP_BUDGET_S)

    @property
    def model_config(self) -> ModelConfig:
        return self.worker.model_config

    # -- requests --------------------------------------------------------------------------------------------
    def make_request(self, prompt_token_ids, params: SamplingParams, request_id: str | None = None,
                     block_hashes: bytes = b"") -> Request:
        """A validated request (nothing queued yet): RequestError names the field and the limit. ``block_hashes``:
        its prompt's block hashes as its front end computed them (``AddRequest.block_hashes``)."""
        vocab = self.model_config.vocab_size
        ids, packed = checked_token_ids(prompt_token_ids, vocab)
        params.validate(vocab, self.eos_token_ids)
        rid = request_id if request_id is not None else f"req-{self._next_id}"
        request = Request(rid, ids, params, self.eos_token_ids, prompt_int32=packed)
        if block_hashes:
            request.block_hashes = self._sent_hashes(block_hashes, request, rid)
        self.scheduler.check_request(request, params_checked=True)
        return request

    def _sent_hashes(self, joined: bytes, request: Request, request_id: str) -> list[bytes]:
        """A front end's prompt block hashes, where they are as many as this engine's prefix cache looks up and the
        first is this engine's own (one SHA-256: a front end hashing with another block size or key would fail it);
        else none (the scheduler hashes the prompt itself when it queues the request) and a warning: a front end and
        an engine that disagree on the cache's blocks are a defect, not a reason to lose the request."""
        c = self.scheduler.config
        num_tokens = request.num_prompt_tokens
        num_blocks = num_lookup_blocks(num_tokens, c.block_size) if c.enable_prefix_caching else 0
        expected = num_blocks * HASH_BYTES
        if len(joined) == expected and joined[:HASH_BYTES] == extend_block_hashes(
                [], request.token_ids, 1, c.block_size, c.next_token_key, request.prompt_int32)[0]:
            return split_hashes(joined)
        if not self._said_hash_mismatch:
            self._said_hash_mismatch = True
            log.warning("request %s came with %d bytes of prompt block hashes where this engine's prefix cache "
                        "(%s) looks up %d blocks (%d bytes), or with a first hash not its own: the engine hashes "
                        "such prompts itself (said once)", request_id, len(joined),
                        f"blocks of {c.block_size} tokens" if c.enable_prefix_caching else "off", num_blocks,
                        expected)
        return []

    def make_requests(self, prompt_token_ids, params: SamplingParams, request_id: str,
                      block_hashes: bytes = b"") -> list[Request]:
        """``make_request``, fanned out for n > 1 into n child requests (vLLM's parallel sampling: ids
        ``child_request_id(request_id, i)``, seeds seed + i, the prompt's log-probabilities on the first only; the
        prompt's block hashes, where sent, each its copy)."""
        first = self.make_request(prompt_token_ids, params, request_id, block_hashes)
        if params.n == 1:
            return [first]
        ids = None if first.prompt_int32 is not None else first.prompt_token_ids  # (the bytes, shared: immutable)
        children = [Request(child_request_id(request_id, i), ids, child_params(params, i), self.eos_token_ids,
                            prompt_int32=first.prompt_int32) for i in range(params.n)]
        for child in children:
            child.block_hashes = list(first.block_hashes)
        return children

    def add_request(self, prompt_token_ids, params: SamplingParams, request_id: str | None = None) -> str:
        rid = request_id if request_id is not None else f"req-{self._next_id}"
        self.queue_all(self.make_requests(prompt_token_ids, params, rid))
        return rid

    def queue_all(self, requests: list[Request], grammar=None) -> None:
        """Queue ``make_requests``' requests: the first now, the other children once a step computes its prompt
        (``grammar``: their compiled grammar, as ``queue`` takes it; the children's comes from the cache)."""
        self.queue(requests[0], grammar)
        if len(requests) > 1:
            self._held[requests[0].request_id] = (requests[1:], grammar)

    def queue(self, request: Request, grammar=None) -> None:
        """Queue a request made by ``make_request``. A structured request needs its compiled grammar: ``grammar``
        (the serving engine compiles it off the loop first, ``structured.compile_async``) or compiled here
        (RequestError when it does not compile)."""
        so = request.params.structured_outputs
        if so is not None:
            self.structured.add(request.request_id, grammar if grammar is not None else self.structured.compile(so))
            if self.scheduler.k_max and not self._said_no_drafts:
                self._said_no_drafts = True
                log.info("structured outputs: requests with a grammar verify no drafts (speculative decoding is off "
                         "for them; the others keep it)")
        if request.params.seed is None:  # from the engine's seed: identical runs draw alike
            request.params = _with_seed(request.params, int(self._seeds.integers(0, 2**63 - 1)))
        if request.params.prompt_logprobs is not None:
            self._prompt_logprobs[request.request_id] = PromptLogprobs(request.num_prompt_tokens)
        self._next_id += 1
        if so is not None and self._park(request):
            return
        self.scheduler.add_request(request, params_checked=True)  # (``make_request`` validated them)

    def _park(self, request: Request) -> bool:
        """Whether ``request`` waits for the worker to read its grammar: not while no request holds a slot (a step
        that reads it stalls no one running), nor once the worker holds it."""
        compiled = self.structured.requests[request.request_id]
        gid = compiled.grammar_id
        if gid not in self._parked and (self.structured.worker_has(compiled) or not self.scheduler.order):
            return False
        self.structured.send_ahead(compiled)
        self._parked.setdefault(gid, []).append(request)
        return True

    def _unpark(self, grammar_ids) -> None:
        """The requests waiting for these grammars into the scheduler."""
        for gid in grammar_ids:
            self.structured.ready(gid)
            for request in self._parked.pop(gid, ()):
                self.scheduler.add_request(request, params_checked=True)

    def abort(self, request_id: str) -> bool:
        """Abort a live request at any point of the step cycle; False when it is not live."""
        self._prompt_logprobs.pop(request_id, None)
        self.structured.remove(request_id)
        self._release(request_id)
        waiting = [*self._parked.values(), *(held for held, _ in self._held.values())]
        return _remove_request(waiting, request_id) or self.scheduler.abort(request_id)

    def _release(self, first_id: str) -> None:
        """Queue the children held back for ``first_id``, with the first's grammar (a compile here would hold the
        step loop)."""
        held, grammar = self._held.pop(first_id, ((), None))
        for request in held:
            self.queue(request, grammar)

    def finish_request(self, request_id: str, reason: FinishReason = FinishReason.STOP) -> bool:
        """End a live request from outside the step loop (a stop string matched): ``Scheduler.finish_request``."""
        self.structured.remove(request_id)
        return self.scheduler.finish_request(request_id, reason)

    def fail_step(self, step: ScheduledStep, later: list[SchedulerOutput] = ()) -> list[str]:
        """A step the worker failed: ``Scheduler.fail_step`` (its requests and those sharing a block it registered
        end, and the other choices held for a first choice among them), their grammars dropped, and the grammars it
        sent taken as not received (sent again when needed). Returns the ids of the requests it ends."""
        self._last_result_at = time.perf_counter()
        ids = self.scheduler.fail_step(step.out, later)
        for rid in list(ids):
            ids += [r.request_id for r in self._held.pop(rid, ((), None))[0]]
        for rid in ids:
            self.structured.remove(rid)
        self.structured.step_failed(step.message)
        self._unpark(list(self._parked))  # (a grammar it carried may be lost, a notice that one was read too)
        for rid in ids:
            self._prompt_logprobs.pop(rid, None)
        return ids

    @property
    def num_parked(self) -> int:
        """Requests waiting for the worker to read their grammar (they count as waiting)."""
        return sum(len(requests) for requests in self._parked.values())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._held) or bool(self._parked)

    # -- a step ----------------------------------------------------------------------------------------------
    @property
    def async_scheduling(self) -> bool:
        """Whether the next step is scheduled and submitted before the last one's result is back. Not with adaptive
        verification (it chooses verify lengths from the drafter's confidences, after the result); every drafter,
        n-gram included, runs on the device inside the step."""
        if self.args.async_scheduling is not None:
            return self.args.async_scheduling and self._can_overlap
        return self._can_overlap

    @property
    def depth(self) -> int:
        """Steps submitted at once: ``EngineArgs.steps_in_flight`` with asynchronous scheduling, else 1."""
        return self.args.steps_in_flight if self.async_scheduling else 1

    @property
    def _can_overlap(self) -> bool:
        return not self.cfg.adaptive_verification

    def schedule(self, in_flight: int = 0) -> ScheduledStep | None:
        """The next step and its descriptors; None when nothing can be scheduled (nothing is live, or every live
        request is in a step still running, ``in_flight`` of them)."""
        t0 = time.perf_counter()
        if self._parked and not self.scheduler.order:  # (no request holds a slot: the step may read it)
            self._unpark(list(self._parked))
        out = self.scheduler.schedule()
        if len(out.slots) == 0:
            if self.scheduler.has_unfinished() and not in_flight:
                raise RuntimeError("the scheduler made no progress with requests waiting (KV cache too small?)")
            return None
        descs = dispatch_step(self.dispatchers, self.cfg.method, out)
        if self._held:
            self._release_computed(out)
        rows = self._prompt_logprob_rows(out) if self._prompt_logprobs else None
        grammar_rows = np.nonzero(self.scheduler.structured[out.slots] & out.samples)[0]
        message = step_message(out, descs, grammar_rows, rows, self.structured.for_step(out))
        if self._parked:  # (grammars this step's own requests use go in line: theirs wait no more)
            self._unpark([gid for gid in self._parked if not self.structured.awaiting(gid)])
        return ScheduledStep(out, descs, message, (time.perf_counter() - t0) * 1e3, prompt_rows=rows)

    def _release_computed(self, out: SchedulerOutput) -> None:
        """Queue the children held for a first child whose prompt this step computes to its end."""
        known = out.num_computed + out.num_scheduled - out.num_drafts
        for row, req in enumerate(out.requests):  # (only while children are held)
            if req.request_id in self._held and known[row] >= req.num_prompt_tokens:
                self._release(req.request_id)

    def _prompt_logprob_rows(self, out: SchedulerOutput) -> np.ndarray | None:
        """Per request of the step, how many of its query's first rows predict a prompt token whose
        log-probability it asked for (None: no request of the step asks)."""
        counts = np.zeros(len(out.slots), np.int64)
        known = out.num_scheduled - out.num_drafts
        for row, req in enumerate(out.requests):  # (only while some request waits for its prompt logprobs)
            if req.request_id in self._prompt_logprobs:
                start = int(out.num_computed[row])
                counts[row] = max(0, min(start + int(known[row]), req.num_prompt_tokens - 1) - start)
        return counts if counts.any() else None

    def submit(self, step: ScheduledStep) -> None:
        """Queue a step on the worker (returns before it has run)."""
        step.submitted_at = time.perf_counter()
        step.pending = self.worker.submit(step.message)
        self.sent(step)
        self.capture_gap()

    def sent(self, step: ScheduledStep) -> None:
        """A step is on its way to the worker: what its scheduling left for after that, the blocks it fills offered
        to the prefix cache (``Scheduler.register_blocks``), is done now."""
        self.scheduler.register_blocks()

    def wait(self, step: ScheduledStep) -> ModelResult:
        """The submitted step's result (waits for it)."""
        t0 = time.perf_counter()
        result = self.worker.collect(step.pending)
        return self.finish(step, result, time.perf_counter() - t0)

    def finish(self, step: ScheduledStep, result: StepResult, wait_s: float = 0.0) -> ModelResult:
        """A step's result as the scheduler takes it, counted in the stats and the step trace."""
        if result.grammars_ready:
            self._unpark(unpack(result.grammars_ready).tolist())
        planned = step.descs.target
        if result.stand_in:  # delayed capture: the target on a larger captured graph
            step.descs = replace(step.descs, target=padded_up(planned, result.stand_in, self.plan.config.max_num_seqs))
            self.stats.stand_in_steps += 1
        if result.not_captured:  # delayed capture: what ran without its graph
            step.descs = without_graphs(step.descs, result.not_captured, step.out.shape.num_tokens,
                                        step.out.shape.num_reqs)
        target = step.descs.target
        reason = None
        if target.graph is None:
            reason = not_captured_reason(planned) if planned.graph is not None else eager_reason(target, self.plan)
        step.eager_cause = reason[0] if reason else None
        period_ms = self._period_ms(step)
        if self.admission_pace is not None and step.out.shape.is_decode:  # (arrivals are held across decodes only)
            self._pace_admission(period_ms if period_ms is not None else result.device_ms)
        if self.auto_tiers is not None and target.kind == UNIFORM_DECODE and target.graph is not None:
            self.auto_tiers.observe_step(target.num_reqs, target.q, result.device_ms, period_ms)  # (served costs)
        self.stats.record(step, result.device_ms, wait_s, step.eager_cause, result.fused)
        if self.trace.enabled:
            step.trace_record = self.trace.stamped(step_record(
                step.out.step_id, step.out, target, step.host_ms, result.device_ms, step.descs.drafts(),
                reason[1] if reason else None, result.jit_compiles, result.jit_ms,
                step.out.num_new_drafts if self.auto_tiers is not None else None, result.fused, result.not_captured,
                period_ms, planned.graph if result.stand_in else None))
            if step.message.constrained:
                step.trace_record["constrained"] = len(unpack(step.message.grammar_rows))
                if result.bitmask_wait_ms:
                    step.trace_record["bitmask_wait_ms"] = round(result.bitmask_wait_ms, 4)
        if result.prompt_logprobs:
            top = result.num_prompt_top_logprobs
            values = unpack(result.prompt_logprobs, F32, (-1, 1 + top))
            step.prompt_logprobs = (values, unpack(result.prompt_logprob_ids, I32, (len(values), top)),
                                    unpack(result.prompt_logprob_ranks, I32))  # (top may be 0: no ids)
        return model_result(result, step.out)

    def _pace_admission(self, step_ms: float) -> None:
        """The default admission wait: a step's period into the pace, and the wait in steps changed (with a log
        line) where the pace moved it."""
        steps = self.admission_pace.observe(step_ms)
        if steps is not None:
            self.scheduler.set_admission_wait(steps)
            log.info("arrivals wait up to %d steps while the batch decodes (steps of %.1f ms: the default under "
                     "speculative decoding holds them at most %.0f ms; --admission-wait-steps sets a fixed wait)",
                     steps, self.admission_pace.ms, SD_ADMISSION_WAIT_MS)

    def _period_ms(self, step: ScheduledStep) -> float | None:
        """The step's period: from the last step's result to its own, the pace the whole pipeline kept, host and
        device, where it was submitted before that result was taken (queued behind it: its host work overlapped the
        last step's); None otherwise (submitted after it, the pipeline empty or synchronous: its period would add the
        host's work to the device's, not overlap them) or where its submission was not recorded."""
        now = time.perf_counter()
        queued = 0.0 < step.submitted_at < self._last_result_at
        period_ms = (now - self._last_result_at) * 1e3 if queued else None
        self._last_result_at = now
        return period_ms

    def execute(self, step: ScheduledStep) -> ModelResult:
        self.submit(step)
        return self.wait(step)

    def _take_prompt_logprobs(self, step: ScheduledStep) -> None:
        """A step's prompt log-probabilities into their requests' entries (by position: a request preempted
        before its first output computes them again, over the same entries)."""
        values, ids, ranks = step.prompt_logprobs
        at = 0
        for row in np.nonzero(step.prompt_rows)[0].tolist():
            req, count = step.out.requests[row], int(step.prompt_rows[row])
            pl = self._prompt_logprobs.get(req.request_id)
            if pl is not None:
                start = int(step.out.num_computed[row]) + 1
                pl.take(req.prompt_token_ids, start, values[at:at + count], ids[at:at + count], ranks[at:at + count])
            at += count

    def update(self, step: ScheduledStep, result: ModelResult) -> list[RequestOutput]:
        outputs = self.scheduler.update(step.out, result)
        if step.prompt_logprobs is not None:
            self._take_prompt_logprobs(step)
        if self._prompt_logprobs:
            for o in outputs:  # (only while a request waits for its first output)
                pl = self._prompt_logprobs.pop(o.request_id, None)
                if pl is not None:
                    o.prompt_logprobs, o.prompt_logprob_ranks = pl.entries, pl.ranks
        if self.structured.requests:
            for o in outputs:
                if o.finished:
                    self.structured.remove(o.request_id)
        spec = self.scheduler.last_spec_decode
        self.stats.record_drafts(spec)
        if step.trace_record is not None:
            if spec.num_drafts:
                step.trace_record["accepted"] = spec.num_accepted_tokens
            self.trace.write(step.trace_record)
        if self.auto_tiers is not None:
            self._rechoose_tiers()
        return outputs

    @property
    def tiers(self) -> tuple[tuple[int, int, int], ...]:
        """The speculative tiers in force, (min_batch, max_batch, K) each (() without speculative decoding)."""
        return self.scheduler.tiers

    def _rechoose_tiers(self) -> None:
        """``"auto"`` tiers: count the step; every ``auto_tier_interval`` steps choose again from the scheduler's
        per-position counters, and switch (with a log line) when the tiers change."""
        stats, auto = self.scheduler.stats, self.auto_tiers
        if auto.observe(stats.accepted_per_pos, stats.reached_per_pos):
            self.scheduler.set_tiers(auto.tiers)
            self.tier_version += 1
            why = "".join(f"; {part}" for part in (auto.host.describe(), auto.describe_batch()) if part)
            log.info("speculative tiers changed (auto, measured acceptance %s%s): %s",
                     ", ".join(f"{p:.2f}" for p in auto.choice.acceptance), why, auto.choice.text())

    def step(self) -> list[RequestOutput]:
        """One step, synchronously: schedule, run, update."""
        step = self.schedule()
        if step is None:
            return []
        return self.update(step, self.execute(step))

    def run(self) -> Iterator[list[RequestOutput]]:
        """Steps until nothing is live, each step's outputs as it completes. With asynchronous scheduling the next
        step is submitted before the last one's result is waited for, so the device runs them back to back (a step
        that a grammar constrains too: the worker fills its bitmask once the step before has sampled)."""
        depth = self.depth
        in_flight: deque[ScheduledStep] = deque()
        while self.has_unfinished() or in_flight:
            step = self.schedule(len(in_flight)) if len(in_flight) < depth else None
            if step is not None:
                self.submit(step)
                in_flight.append(step)
            if in_flight and (len(in_flight) == depth or step is None):
                done = in_flight.popleft()
                yield self.update(done, self.wait(done))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Offline: run every prompt to completion; outputs in prompt order. Every prompt is validated before any
        is queued: a bad one raises and leaves the engine as it was."""
        requests = [self.make_request(p, params, f"req-{self._next_id + i}") for i, p in enumerate(prompts)]
        for request in requests:
            self.queue(request)
        outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
        for step_outputs in self.run():
            for o in step_outputs:
                if o.request_id in outputs:
                    outputs[o.request_id].extend(o.new_token_ids)
        return [outputs[r.request_id] for r in requests]

    def close(self) -> None:
        """Flush and close the step trace; stop the grammar compiles."""
        self.trace.close()
        self.structured.close()

    def __enter__(self) -> "EngineCore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- measured step costs (adaptive verification's curve, auto tiers' table) -----------------------------------
    def _cached(self, name: str, parts: list, measure, what: str) -> dict | None:
        """``cache.cached_json`` keyed by device, model, dtype and ``parts`` (so that a rerun of one setup reuses
        the measurement), and what else changes a step's cost where it is not the default: the tensor-parallel
        size, FP8 weights, an FP8 KV cache."""
        return cached_json(name, self._cache_key(parts), measure, what)

    def _cache_key(self, parts: list) -> list:
        key = [self.worker.device_name, str(self.model_config), str(self.args.dtype), *parts]
        tp = getattr(self.worker, "tensor_parallel_size", 1)
        extra = {"tensor_parallel_size": tp if tp != 1 else None, "quantization": self.args.quantization,
                 "kv_cache_dtype": self.args.kv_cache_dtype if self.args.kv_cache_dtype != "auto" else None}
        extra = {k: v for k, v in extra.items() if v is not None}
        return key + [extra] if extra else key  # (the default setup's key as before: its cached files stay valid)

    def _av_cost_curve(self) -> CostCurve | None:
        """The curve adaptive verification steers by: from ``av_cost_table``, else measured on this runtime once
        and kept in the cache, keyed by device, model, dtype and graph sizes (so that a rerun reuses it)."""
        if self.args.av_cost_table:
            return _read_curve(self.args.av_cost_table)
        av_sizes = next((g.sizes for g in self.plan.for_runner("target") if g.kind == FULL_VARLEN), ())

        def measure():
            measured = self.worker.measure_av_curve()
            return None if measured is None else {"tokens": list(measured[0]), "ms": list(measured[1])}

        data = self._cached("av_cost", [list(av_sizes)], measure, "adaptive verification's measured step costs")
        return None if data is None else _curve(data, data["source"])

    def _spec_step_costs(self, capture: bool) -> autotier.StepCostTable:
        """``"auto"`` tiers' step costs by (requests, q): from ``spec_cost_table``, else every runner's FULL decode
        graphs timed once on this runtime (``ModelWorker.measure_decode_costs``, combined per candidate K by
        ``autotier.decode_step_costs``) and kept in the cache. Without FULL decode graphs (or capture): a host-bound
        default shape, 1 + n * q / 1024 ms, the target's alone (a warning says so)."""
        cfg = self.cfg
        if self.args.spec_cost_table:
            return load_step_costs(self.args.spec_cost_table, "spec_cost_table")
        sets = [[g.runner, g.q, list(g.sizes)] for g in self.plan.graph_sets if g.kind == FULL_DECODE and g.sizes]
        measure_fn = getattr(self.worker, "measure_decode_costs", None)

        def measure():
            tables = measure_fn() if measure_fn is not None else None
            if not tables:
                return None
            costs = autotier.decode_step_costs(cfg.method, cfg.tier_candidates, tables)
            return costs.to_json() if costs.by_q else None

        data = self._cached("spec_cost", [cfg.method, cfg.draft_model, sets], measure,
                            "speculative tiers' measured step costs") if capture and sets else None
        if data is not None:
            try:
                return autotier.StepCostTable.from_json(data, data["source"])
            except ConfigError as exc:
                raise ValueError(f"the cached step costs are unreadable ({exc}): remove {data['source']}") from None
        top = cfg.max_num_seqs
        log.warning("speculative tiers (auto): no FULL decode graphs to time; choosing on a default host-bound step "
                    "cost (1 + tokens / 1024 ms, drafter forwards left out)")
        return autotier.StepCostTable({1 + k: [(1, 1 + (1 + k) / 1024), (top, 1 + top * (1 + k) / 1024)]
                                       if top > 1 else [(1, 1 + (1 + k) / 1024)] for k in cfg.tier_candidates},
                                      "a default host-bound shape")


class PromptLogprobs:
    """One request's prompt log-probabilities as they come: per prompt position (the first has none, None),
    {token id: log-probability} of the prompt token then the top N, and the prompt token's rank."""

    def __init__(self, prompt_len: int):
        self.entries: list[dict[int, float] | None] = [None] * prompt_len
        self.ranks: list[int | None] = [None] * prompt_len

    def take(self, prompt: list[int], start: int, values: np.ndarray, ids: np.ndarray, ranks: np.ndarray) -> None:
        """Positions start .. start + len(values) - 1."""
        for j, (v, top, rank) in enumerate(zip(values.tolist(), ids.tolist(), ranks.tolist())):
            self.entries[start + j] = {prompt[start + j]: v[0], **{t: x for t, x in zip(top, v[1:])
                                                                   if t != prompt[start + j]}}
            self.ranks[start + j] = rank


def structured_outputs(cfg: ResolvedConfig, args: EngineArgs, vocab_size: int) -> StructuredOutputs:
    """The serving engine's structured outputs for ``args``' tokenizer (``_tokenizer``) and a model of ``vocab_size``
    tokens, compiling in processes (its constraints come from anyone); the EOS ids are ``args.eos_token_ids``
    (given: nothing here waits for the model)."""
    return StructuredOutputs(_tokenizer(args), vocab_size, tuple(args.eos_token_ids),
                             args.structured_compile_timeout_s, in_processes=True)


def _tokenizer(args: EngineArgs):
    """The tokenizer structured outputs compile against: ``args.tokenizer``'s (its errors raised), else the model's;
    None for a preset, or for a checkpoint without a usable tokenizer (the engine runs on token ids then, and
    refuses structured requests)."""
    from models.checkpoint import CheckpointError
    from models.text import load_tokenizer

    if args.tokenizer is not None:
        return load_tokenizer(args.tokenizer)
    if not isinstance(args.model, str):
        return None
    try:
        return load_tokenizer(args.model)
    except CheckpointError as exc:
        log.info("structured outputs are off (they need a tokenizer): %s", exc)
        return None


def _curve(data: dict, where: str) -> CostCurve:
    try:
        return CostCurve(tuple(int(t) for t in data["tokens"]), tuple(float(m) for m in data["ms"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"av_cost_table {where!r}: not a step-cost curve {{\"tokens\": [...], \"ms\": [...]}} "
                         f"({exc})") from None


def _read_curve(path: str) -> CostCurve:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ValueError(f"av_cost_table {path!r}: not a step-cost curve {{\"tokens\": [...], \"ms\": [...]}} "
                         f"({exc})") from None
    return _curve(data, path)


def _remove_request(groups: list[list[Request]], request_id: str) -> bool:
    """Remove the request ``request_id`` from whichever of ``groups`` holds it; whether one did."""
    for group in groups:
        for i, r in enumerate(group):
            if r.request_id == request_id:
                del group[i]
                return True
    return False
