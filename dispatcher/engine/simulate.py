"""``twogrid simulate``: the real scheduler and dispatcher, driven by a workload, against a cost model.

A deterministic fake model stands in for the GPU: the greedy token at position p of a request is a hash of
(request, p), so any token lost, repeated or reordered by the scheduler shows in the output. Its drafter
proposes the right token with probability ``acceptance_rate`` (per draft, given the previous one was right; or, with
an ``acceptance`` profile, draft j is right with p_j / p_{j-1} given draft j - 1 was), decided by a hash too, and
reports a confidence that adaptive verification can use. Step time comes from the cost model at the dispatched mode
and padded token count: the target forward, plus a model drafter's forwards at one decoder layer's share each (a
draft model's at its layers' share).

Prompts are the fake model's tokens too, a function of the request (and of its shared prefix's index for a
``prefix_repetition`` prompt, so that prompts of one prefix share its blocks): with prefix caching on (as the engine
defaults) the real scheduler finds them in its cache, and the steps show what that does to the graphs (fewer
prefill tokens, other sizes, other eager steps).

Under ``"auto"`` speculative tiers the run does what the engine does: tiers chosen from the cost model's price of a
uniform decode per (requests, q) (``auto_step_costs``) and the prior acceptance, then re-chosen every
``auto_tier_interval`` steps from the scheduler's counters; the summary reports the tiers and the K of every step.
"""

from __future__ import annotations

import math
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np

from dispatcher.plan import autotier
from dispatcher.plan.capture_plan import DRAFT_MODEL, FULL_DECODE, build_plan, one_token_steps
from dispatcher.plan.dispatch import (BATCH_KINDS, MODE_EAGER, MODE_FULL, MODE_PIECEWISE, UNIFORM_DECODE,
                                      StepDescriptors, dispatch_step, dispatchers_for_plan)
from dispatcher.plan.config import ConfigError
from dispatcher.engine.trace import StepTally, TraceWriter, step_record
from dispatcher.engine.workload import PromptSpec
from dispatcher.engine.cost import StepCostModel
from scheduler.request import Request, SamplingParams
from dispatcher.engine.config import admission_pace_for, scheduler_config
from scheduler.scheduler import BatchShape, ModelResult, Scheduler, SchedulerOutput

_M1, _M2, _M3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, elementwise on uint64."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M2
    x = x ^ (x >> np.uint64(27))
    x = x * _M3
    return x ^ (x >> np.uint64(31))


def request_seed(request_id: str) -> int:
    return zlib.crc32(request_id.encode())


class FakeModel:
    """Deterministic target and drafter, vectorized over a step."""

    def __init__(self, vocab_size: int = 32000, acceptance_rate: float = 0.7, max_num_seqs: int = 1024,
                 acceptance: Sequence[float] | None = None):
        self.vocab_size = vocab_size
        self.acceptance_rate = acceptance_rate
        self.slot_seed = np.zeros(max_num_seqs, np.uint64)
        self.conditional = None
        """With a per-position ``acceptance`` profile: the chance draft j is right given draft j - 1 was."""
        if acceptance is not None:
            p = np.asarray(acceptance, np.float64)
            prev = np.concatenate(([1.0], p[:-1]))
            self.conditional = np.divide(p, prev, out=np.zeros_like(p), where=prev > 0)

    def token(self, seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
        h = _mix(seeds * _M1 + positions.astype(np.uint64))
        return (h % np.uint64(self.vocab_size)).astype(np.int64)

    def _uniform(self, seeds: np.ndarray, positions: np.ndarray, salt: int) -> np.ndarray:
        h = _mix(seeds * _M1 + positions.astype(np.uint64) + np.uint64((salt * 0xBF58476D1CE4E5B9) % (1 << 64)))
        return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)

    def greedy_reference(self, request_id: str, prompt_len: int, num_tokens: int) -> list[int]:
        """The output a request must produce: the greedy tokens at positions prompt_len .. + num_tokens."""
        seeds = np.full(num_tokens, request_seed(request_id), np.uint64)
        return self.token(seeds, np.arange(prompt_len, prompt_len + num_tokens)).tolist()

    def draft(self, seeds: np.ndarray, positions: np.ndarray, index: np.ndarray | None = None) -> tuple[np.ndarray,
                                                                                                   np.ndarray]:
        """The drafter's proposal for each position and its confidence: the right token with probability
        ``acceptance_rate`` (with a profile: its conditional rate at the draft's ``index`` in the step), decided by a
        hash of (request, position)."""
        right = self.token(seeds, positions)
        rate = self.acceptance_rate
        if self.conditional is not None and index is not None:
            rate = self.conditional[np.minimum(index, len(self.conditional) - 1)] if len(self.conditional) else 0.0
        ok = self._uniform(seeds, positions, 1) < rate
        v = self._uniform(seeds, positions, 2)
        return np.where(ok, right, (right + 1) % self.vocab_size), np.where(ok, 0.5 + 0.5 * v, 0.5 * v)

    def run(self, out: SchedulerOutput) -> ModelResult:
        for req, slot in zip(out.new_requests, out.slots[len(out.slots) - len(out.new_requests):].tolist()):
            self.slot_seed[slot] = request_seed(req.request_id)
        k = int(out.num_drafts.max()) if len(out.num_drafts) else 0
        seeds = self.slot_seed[out.slots][:, None]
        first = out.first_sample_positions[:, None]
        target = self.token(seeds, first + np.arange(k + 1)[None, :])
        drafts = self.draft(seeds, first + np.arange(k)[None, :], np.arange(k)[None, :])[0]
        match = (drafts == target[:, :k]) & (np.arange(k)[None, :] < out.num_drafts[:, None])
        accepted = np.cumprod(match, axis=1).sum(axis=1)  # leading matches
        conf = None
        if out.num_new_drafts:  # what it proposes for the next step, after the new tokens
            nxt = np.arange(out.num_new_drafts)[None, :]
            conf = self.draft(seeds, first + accepted[:, None] + 1 + nxt, nxt)[1]
        return ModelResult(target, accepted.astype(np.int64), conf)


def drafter_ms(costs: StepCostModel, descs: StepDescriptors, num_drafts: int, method: str | None,
               draft_layers: int = 1) -> float:
    """A model drafter's share of a step: ``draft_layers`` decoder layers of the cost model's stack per forward (a
    head's one; a draft model's its own count): step 0 (EAGLE, draft model) or one block forward, then the
    one-token steps (EAGLE's K - 1, a draft model's K: ``one_token_steps``)."""
    if costs.whole_steps:  # (step traces' times hold the drafter's forwards)
        return 0.0
    share = min(draft_layers, costs.num_layers) / costs.num_layers
    ms = 0.0
    if descs.draft is not None:
        ms += costs.step_ms(descs.draft.mode, descs.draft.num_tokens) * share
    if descs.draft_next is not None:
        steps = one_token_steps(method, num_drafts)
        ms += steps * costs.step_ms(descs.draft_next.mode, descs.draft_next.num_tokens) * share
    return float(ms)


def draft_layers(cfg) -> int:
    """Decoder layers of a drafter's forward: a draft model's own (read from its config, not its weights); 1 for a
    head."""
    if cfg.method != DRAFT_MODEL:
        return 1
    from models.config import PRESETS

    if cfg.draft_model in PRESETS:  # (no torch import for a preset)
        return PRESETS[cfg.draft_model].num_layers
    from models.loader import read_model_config

    try:
        return read_model_config(cfg.draft_model).num_layers
    except (OSError, ValueError) as exc:  # (a CheckpointError is a ValueError)
        raise ConfigError(f"--speculative-config: the draft model {cfg.draft_model!r} (its layer count prices its "
                          f"forwards): {exc}") from None


def auto_step_costs(cfg, plan, dispatchers, costs: StepCostModel, layers: int) -> autotier.StepCostTable:
    """``"auto"`` tiers' step costs as this cost model prices a uniform decode of n requests at q = 1 + K: the
    target at its dispatched mode and padded size, plus the drafter's forwards (``drafter_ms``), at every request
    count the target's FULL decode set at q holds (without one: the decode grid's counts up to max_num_seqs)."""
    from dispatcher.plan import grids

    sets = {g.q: g.sizes for g in plan.for_runner("target") if g.kind == FULL_DECODE and g.sizes}
    by_q = {}
    for k in cfg.tier_candidates:
        q = 1 + k
        sizes = [n for n in sets.get(q, grids.decode_grid(cfg.max_num_seqs))
                 if n <= cfg.max_num_seqs and n * q <= cfg.max_num_batched_tokens]
        points = []
        for n in sizes:
            out = SimpleNamespace(shape=BatchShape(n * q, n, q, True), num_new_drafts=k, samples=np.ones(n, bool))
            descs = dispatch_step(dispatchers, cfg.method, out)
            ms = costs.step_ms(descs.target.mode, descs.target.num_tokens) + drafter_ms(costs, descs, k, cfg.method,
                                                                                      layers)
            points.append((n, float(ms)))
        if points:
            by_q[q] = points
    return autotier.StepCostTable(by_q, f"cost model {costs.name}")


def prompt_tokens(spec: PromptSpec, request_id: str, vocab_size: int) -> list[int]:
    """A simulated prompt's token ids: its shared prefix's (a function of the prefix's index), then its own (of the
    request)."""
    model = FakeModel(vocab_size)
    own = np.arange(spec.prefix_len, spec.num_tokens)
    ids = model.token(np.full(len(own), request_seed(request_id) ^ 0xABCD, np.uint64), own)
    if spec.prefix < 0:
        return ids.tolist()
    shared = model.token(np.full(spec.prefix_len, 0x5EED0000 + spec.prefix, np.uint64), np.arange(spec.prefix_len))
    return np.concatenate([shared, ids]).tolist()


class ClosedLoop:
    """The simulated clients: at most ``concurrency`` conversations in flight, each sending its turns one after the
    other (a single turn without ``turns``), the next at once when the one before finishes, with the conversation so
    far before its own tokens (the prompt and the answer of every turn before, as a chat client resends them; no
    template tokens between). Request ids ``req-0``, ``req-1``, ... in submission order."""

    def __init__(self, prompts: list[PromptSpec], turns: int, concurrency: int, output_len: int, ignore_eos: bool,
                 vocab_size: int):
        self.conversations = [prompts[i:i + turns] for i in range(0, len(prompts), turns)]
        self.concurrency, self.output_len = concurrency, output_len
        self.ignore_eos, self.vocab_size = ignore_eos, vocab_size
        self.next_conversation = 0
        self.in_flight = 0
        self.submitted = 0
        self.ready: list[tuple[int, int, list[int]]] = []
        """Next turns to send: (conversation, turn, the conversation so far)."""
        self.turn_of: dict[str, tuple[int, int, list[int]]] = {}
        """Each live request's (conversation, turn, prompt) while a later turn follows it."""
        self.answers: dict[str, list[int]] = defaultdict(list)
        self.live: dict[str, tuple[Request, int]] = {}
        """Each unfinished request and its turn (0: a conversation's first)."""
        self.finished: dict[str, tuple[int, int, int]] = {}
        """Each finished request's turn, prompt tokens and those its admission found in the prefix cache."""

    def longest(self) -> int:
        """The most tokens a request can hold: a conversation's every turn and answer."""
        return max(sum(p.num_tokens for p in c) + len(c) * self.output_len for c in self.conversations)

    def pending(self) -> bool:
        return self.next_conversation < len(self.conversations) or bool(self.ready)

    def send(self, scheduler: Scheduler) -> list[str]:
        """Queue the turns that are due; their request ids."""
        while self.next_conversation < len(self.conversations) and self.in_flight < self.concurrency:
            self.ready.append((self.next_conversation, 0, []))
            self.next_conversation += 1
            self.in_flight += 1
        sent = []
        for conv, turn, history in self.ready:
            rid = f"req-{self.submitted}"
            self.submitted += 1
            prompt = history + prompt_tokens(self.conversations[conv][turn], rid, self.vocab_size)
            req = Request(rid, prompt, SamplingParams(max_tokens=self.output_len, ignore_eos=self.ignore_eos),
                          eos_token_id=0)
            scheduler.add_request(req)
            self.live[rid] = req, turn
            if turn + 1 < len(self.conversations[conv]):
                self.turn_of[rid] = (conv, turn, prompt)
            sent.append(rid)
        self.ready.clear()
        return sent

    def output(self, request_id: str, new_token_ids, finished: bool) -> None:
        """A request's new tokens; when it finished, its conversation's next turn is due (or a new conversation)."""
        later = self.turn_of.get(request_id)
        if later is not None:
            self.answers[request_id].extend(new_token_ids)
        if not finished:
            return
        req, turn = self.live.pop(request_id)
        self.finished[request_id] = (turn, req.num_prompt_tokens, req.num_cached_tokens or 0)
        if later is None:
            self.in_flight -= 1
            return
        conv, turn, prompt = self.turn_of.pop(request_id)
        self.ready.append((conv, turn + 1, prompt + self.answers.pop(request_id, [])))

    def by_turn(self, ttft_ms: dict[str, float]) -> dict[str, list]:
        """Per turn, over its finished requests: the TTFT p50 (ms) and the share of prompt tokens found in the prefix
        cache (a later turn that finds little of its history had it evicted: the KV pool too small for the
        conversations in flight, ``--num-kv-blocks``)."""
        by_turn: dict[int, list[tuple[str, int, int]]] = defaultdict(list)
        for rid, (turn, prompt, cached) in self.finished.items():
            by_turn[turn].append((rid, prompt, cached))
        p50: list[float | None] = []
        hit_rate: list[float | None] = []
        for t in range(max(by_turn, default=-1) + 1):
            done = by_turn[t]
            ms = [ttft_ms[rid] for rid, _, _ in done if rid in ttft_ms]
            p50.append(round(float(np.percentile(ms, 50)), 3) if ms else None)
            prompt = sum(n for _, n, _ in done)
            hit_rate.append(round(sum(c for _, _, c in done) / prompt, 4) if prompt else None)
        return {"p50_ttft_ms_by_turn": p50, "prefix_cache_hit_rate_by_turn": hit_rate}


@dataclass
class SimulationResult:
    summary: dict[str, Any]
    outputs: dict[str, list[int]] = field(default_factory=dict)


def simulate(cfg, prompts: list[PromptSpec], *, concurrency: int, output_len: int, acceptance_rate: float = 0.7,
             num_kv_blocks: int | None = None, block_size: int = 16, cost_model: str | StepCostModel = "bench-moe",
             step_trace: str | None = None, ignore_eos: bool = True, keep_outputs: bool = False,
             vocab_size: int = 32000, acceptance: Sequence[float] | None = None,
             auto_tier_interval: int = autotier.RECHOOSE_INTERVAL_STEPS,
             enable_prefix_caching: bool = True, admission_wait_steps: int | None = None,
             decode_overhead_us: float = 0.0, decode_overhead_per_token_us: float = 0.0,
             turns: int = 1) -> SimulationResult:
    """Run the workload to completion with at most ``concurrency`` requests in flight (closed loop; with ``turns``
    > 1, conversations of ``turns`` of the prompts each, every turn sent with the conversation so far when the one
    before finishes: ``ClosedLoop``). ``acceptance``:
    the fake drafter's per-position acceptance (instead of ``acceptance_rate``). ``cost_model``: a preset's name or
    a ``StepCostModel`` (``load_cost_table``: a measured table, or step traces whose times hold the drafter's).
    ``decode_overhead_us``: microseconds a uniform decode step costs per request beyond the cost model's (what served
    steps add to graph replays over empty contexts: the contexts' attention, the host's work; on the H200 the default
    model's served plain decode took about 1.1 ms more than its table at 256 requests, whatever K); with it, ``"auto"``
    tiers weigh the served steps' costs as the engine's do (``AutoTiers.observe_step``).
    ``decode_overhead_per_token_us``: the same per query token (q a request), for the part of what serving adds that
    grows with the rows verified (attention over the contexts for each of them)."""
    for flag, value in (("--concurrency", concurrency), ("--output-len", output_len), ("--block-size", block_size),
                        ("--multi-turn", turns)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--decode-overhead-us", decode_overhead_us),
                        ("--decode-overhead-per-token-us", decode_overhead_per_token_us)):
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{flag} must be a number >= 0, got {value}")
    if num_kv_blocks is not None and num_kv_blocks < 1:
        raise ConfigError(f"--num-kv-blocks must be >= 1, got {num_kv_blocks}")
    plan = build_plan(cfg)
    dispatchers = dispatchers_for_plan(plan)
    costs = StepCostModel.preset(cost_model) if isinstance(cost_model, str) else cost_model
    layers = draft_layers(cfg)
    clients = ClosedLoop(prompts, turns, concurrency, output_len, ignore_eos, vocab_size)
    max_model_len = clients.longest()
    sched_cfg = scheduler_config(cfg, num_kv_blocks or 1, block_size, max_model_len,
                                 step_ms=lambda t: costs.step_ms(MODE_FULL, t),
                                 enable_prefix_caching=enable_prefix_caching,
                                 admission_wait_steps=admission_wait_steps)
    # A request holds at most max_blocks_per_seq blocks (prompt, output, drafts being verified, the drafter's
    # lookahead): by default every slot gets that many, so nothing is preempted.
    per_request = sched_cfg.max_blocks_per_seq
    if num_kv_blocks is None:
        sched_cfg = replace(sched_cfg, num_kv_blocks=cfg.max_num_seqs * per_request)
    elif num_kv_blocks < per_request:
        raise ConfigError(f"--num-kv-blocks = {num_kv_blocks} cannot hold the longest request ({max_model_len} "
                          f"tokens with drafts and lookahead: {per_request} blocks of {block_size} tokens); give at "
                          f"least {per_request}")
    scheduler = Scheduler(sched_cfg)
    pace = admission_pace_for(cfg, admission_wait_steps)  # (as the engine's)
    wait_changes: list[dict[str, Any]] = []
    auto = None
    tier_changes: list[dict[str, Any]] = []
    steps_by_k: Counter = Counter()
    if cfg.auto_tiers:
        table = auto_step_costs(cfg, plan, dispatchers, costs, layers)
        auto = autotier.AutoTiers(autotier.chooser_for_plan(table, plan), cfg.acceptance_prior, auto_tier_interval)
        scheduler.set_tiers(auto.tiers)
        initial_tiers = auto.choice.as_config()
    model = FakeModel(vocab_size, acceptance_rate, cfg.max_num_seqs, acceptance)
    trace = TraceWriter(step_trace)
    tally = StepTally()
    totals = Counter()
    clock_ms = 0.0
    host_ms_total = 0.0
    submitted: dict[str, float] = {}
    first_token: dict[str, float] = {}
    finished_at: dict[str, float] = {}
    out_tokens: dict[str, int] = defaultdict(int)
    outputs: dict[str, list[int]] = {}
    wall = time.perf_counter()

    try:
        while clients.pending() or scheduler.has_unfinished():
            for rid in clients.send(scheduler):
                submitted[rid] = clock_ms
            t0 = time.perf_counter()
            step = scheduler.schedule()
            if len(step.slots) == 0:
                raise RuntimeError("the scheduler made no progress (KV cache too small for any request)")
            s = step.shape
            descs = dispatch_step(dispatchers, cfg.method, step)
            desc = descs.target
            host_ms = (time.perf_counter() - t0) * 1e3
            target_ms = costs.step_ms(desc.mode, desc.num_tokens)
            draft_ms = drafter_ms(costs, descs, step.num_new_drafts, cfg.method, layers)
            device_ms = target_ms + draft_ms
            if desc.kind == UNIFORM_DECODE and (decode_overhead_us or decode_overhead_per_token_us):
                device_ms += 1e-3 * len(step.slots) * (decode_overhead_us + decode_overhead_per_token_us * desc.q)
                if auto is not None and desc.mode == MODE_FULL:
                    auto.observe_step(desc.num_reqs, desc.q, device_ms)
            result = model.run(step)
            clock_ms += device_ms
            if pace is not None and s.is_decode and (wait := pace.observe(device_ms)) is not None:
                scheduler.set_admission_wait(wait)
                wait_changes.append({"after_step": step.step_id, "steps": wait, "pace_ms": round(pace.ms, 3)})
            host_ms_total += host_ms
            for o in scheduler.update(step, result):
                if o.new_token_ids and o.request_id not in first_token:
                    first_token[o.request_id] = clock_ms
                out_tokens[o.request_id] += len(o.new_token_ids)
                if keep_outputs:
                    outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    finished_at[o.request_id] = clock_ms
                clients.output(o.request_id, o.new_token_ids, o.finished)
            tally.add(desc.kind, desc.mode, s.num_tokens, desc.num_tokens)
            totals["real_tokens"] += s.num_tokens
            totals["device_ms_" + desc.mode] += target_ms
            totals["draft_ms"] += draft_ms
            totals["device_ms_kind_" + desc.kind] += device_ms
            if auto is not None:
                steps_by_k[step.num_new_drafts] += 1
                stats = scheduler.stats
                if auto.observe(stats.accepted_per_pos, stats.reached_per_pos):
                    scheduler.set_tiers(auto.tiers)
                    tier_changes.append({"after_step": step.step_id, "tiers": auto.choice.as_config(),
                                         "acceptance": [round(p, 4) for p in auto.choice.acceptance]})
            trace.write(step_record(step.step_id, step, desc, host_ms, device_ms, descs.drafts(),
                                    k=step.num_new_drafts if auto is not None else None))
    finally:
        trace.close()
    counts = tally.summary()
    steps = counts["steps"]
    done = [r for r in finished_at]
    ttft = [first_token[r] - submitted[r] for r in done]
    tpot = [(finished_at[r] - first_token[r]) / (out_tokens[r] - 1) for r in done if out_tokens[r] > 1]
    total_out = sum(out_tokens.values())
    summary = {
        "steps": steps,
        "eager_steps": counts["eager_steps"],
        "padded_tokens": counts["padded_tokens"],
        "real_tokens": totals["real_tokens"],
        "by_kind": counts["by_kind"],
        "requests": len(done),
        "turns": turns,
        "output_tokens": total_out,
        "simulated_seconds": round(clock_ms / 1e3, 4),
        "output_tokens_per_second": round(total_out / (clock_ms / 1e3), 1) if clock_ms else 0.0,
        "mean_ttft_ms": round(float(np.mean(ttft)), 3) if ttft else None,
        "p50_ttft_ms": round(float(np.percentile(ttft, 50)), 3) if ttft else None,
        "p99_ttft_ms": round(float(np.percentile(ttft, 99)), 3) if ttft else None,
        "mean_tpot_ms": round(float(np.mean(tpot)), 3) if tpot else None,
        "device_ms_by_mode": {m: round(totals["device_ms_" + m], 1) for m in (MODE_FULL, MODE_PIECEWISE, MODE_EAGER)},
        "draft_device_ms": round(totals["draft_ms"], 1),
        "device_ms_by_kind": {k: round(totals["device_ms_kind_" + k], 1) for k in BATCH_KINDS},
        "preemptions": scheduler.stats.preemptions,
        "prefix_cache_queries": scheduler.stats.prefix_cache_queries,
        "prefix_cache_hits": scheduler.stats.prefix_cache_hits,
        "prefix_cache_hit_rate": round(scheduler.stats.prefix_cache_hits / scheduler.stats.prefix_cache_queries, 4)
        if scheduler.stats.prefix_cache_queries else None,
        "draft_acceptance_rate": round(scheduler.stats.drafts_accepted / max(1, scheduler.stats.drafts_verified), 4),
        "host_ms_per_step": round(host_ms_total / max(1, steps), 4),
        "wall_seconds": round(time.perf_counter() - wall, 3),
        "cost_model": costs.name,
        "config": plan.to_dict()["config"],
        "admission_wait_steps": scheduler.config.admission_wait_steps,
        "admission_wait_changes": wait_changes,
    }
    if turns > 1:
        summary.update(clients.by_turn({r: first_token[r] - submitted[r] for r in done if r in first_token}))
    if auto is not None:
        summary["auto_tiers"] = {"initial": initial_tiers, "final": auto.choice.as_config(), "changes": tier_changes,
                                 "steps_by_k": {str(k): v for k, v in sorted(steps_by_k.items())},
                                 "measured_acceptance": [round(p, 4) for p in auto.acceptance()]}
    return SimulationResult(summary, outputs)
