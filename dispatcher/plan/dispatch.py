"""Dispatch: which graph runs a step (SPEC section 5). The hot path is O(1): tables indexed by size.

Each step the engine describes its batch by four numbers (tokens, requests, the longest query, whether
every request is a decode) and gets back a frozen BatchDescriptor:

- uniform decode (every request a decode with the same query length q): the FULL graph of the smallest
  decode size n' >= n at that q (sizes already within the token budget); else, with adaptive verification, the
  FULL varlen graph of the smallest size >= n * q (it holds any decode batch, and is already captured); else
  PIECEWISE by tokens; else eager.
- adaptive verification (a decode step whose requests verify different numbers of drafts): the FULL varlen
  graph of the smallest size >= the step's tokens; else PIECEWISE by tokens; else eager.
- mixed / prefill: the PIECEWISE graph of the smallest size >= tokens (FULL on the same grid in mode FULL);
  else eager. With ``max_full_mixed_cudagraph_capture_tokens`` (FULL_AND_PIECEWISE), every step that runs by
  tokens first takes the FULL graph of the smallest size >= tokens up to that cap.

Padding: padded rows write their KV to slot -1 and are never sampled; padded requests have sequence length 0.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from dataclasses import dataclass, replace

from dispatcher.plan.capture_plan import (FULL, FULL_DECODE, FULL_VARLEN, MODEL_DRAFTERS, ONE_TOKEN_DRAFTERS,
                                          PIECEWISE, GraphSet, block_query_len, model_runners,
                                          next_steps_runner, one_token_steps)

# Modes a step runs in.
MODE_FULL = "FULL"
MODE_PIECEWISE = "PIECEWISE"
MODE_EAGER = "NONE"
# Batch kinds.
UNIFORM_DECODE = "uniform_decode"
ADAPTIVE_VERIFICATION = "adaptive_verification"
MIXED = "mixed"
BATCH_KINDS = (UNIFORM_DECODE, ADAPTIVE_VERIFICATION, MIXED)


class GraphKey(NamedTuple):
    """Names one captured graph of a runner."""

    kind: str
    """piecewise / full_decode / full_varlen / full."""
    q: int | None
    """Query length of a FULL decode graph; None for token-keyed graphs."""
    size: int
    """Requests for full_decode, else tokens."""


class BatchDescriptor(NamedTuple):
    """How one step runs. Immutable and hashable: usable as a key."""

    mode: str
    """FULL, PIECEWISE or NONE (eager)."""
    kind: str
    """uniform_decode, adaptive_verification or mixed."""
    num_tokens: int
    """Padded token count: the rows the forward runs (real rows first)."""
    num_reqs: int
    """Padded request count: request slots in the attention metadata (padded ones have sequence length 0)."""
    q: int | None
    """Query length a request of a uniform decode; None otherwise."""
    graph: GraphKey | None
    """The graph replayed; None when eager."""


_new = tuple.__new__


def _padding_table(sizes: Iterable[int], limit: int) -> list[int]:
    """table[n] = smallest size >= n, or 0 where none covers n, for n in 0..limit."""
    table = [0] * (limit + 1)
    sizes = sorted(s for s in sizes if s >= 1)
    j = 0
    for n in range(1, limit + 1):
        while j < len(sizes) and sizes[j] < n:
            j += 1
        table[n] = sizes[j] if j < len(sizes) else 0
    return table


def graph_counts(kind: str, q: int | None, size: int, num_reqs: int, max_num_seqs: int) -> tuple[int, int]:
    """The padded (tokens, requests) of a batch of ``num_reqs`` requests on the graph (kind, q, size): FULL decode
    graphs are sized in requests of q tokens; PIECEWISE ones in tokens, attention over the batch's own requests; FULL
    graphs over tokens (varlen, FULL mixed) hold up to ``size`` request slots, at most max_num_seqs."""
    if kind == FULL_DECODE:
        return size * q, size
    if kind == PIECEWISE:
        return size, num_reqs
    return size, min(size, max_num_seqs)


class Dispatcher:
    """O(1) dispatch for one runner's graph sets.

    ``max_query_len`` bounds the uniform-decode q with precomputed rows (1 + K_max for the target); a larger
    uniform q is still dispatched correctly, by tokens.
    """

    def __init__(
        self,
        graph_sets: Iterable[GraphSet],
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_query_len: int = 1,
    ):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        sets = list(graph_sets)
        token_sets = [g for g in sets if g.kind in (PIECEWISE, FULL)]
        by_kind = {g.kind: g for g in token_sets}
        assert len(by_kind) == len(token_sets), "a runner has one token-keyed graph set of each kind"
        piecewise, full = by_kind.get(PIECEWISE), by_kind.get(FULL)
        self._token_kind = PIECEWISE if piecewise else FULL if full else None
        # Graphs can be wider than the batch limits (a budget-derived size); tables stop at the limits.
        piecewise_sizes = piecewise.sizes if piecewise else ()
        self._token_pad = _padding_table(piecewise_sizes, max_num_batched_tokens)
        self._token_keys = {s: GraphKey(PIECEWISE, None, s) for s in piecewise_sizes}
        varlen = [g for g in sets if g.kind == FULL_VARLEN]
        self._varlen: list[BatchDescriptor] | None = None
        if varlen:
            self._varlen = self._varlen_row(varlen[0].sizes, ADAPTIVE_VERIFICATION)
        elif self._token_kind == FULL:
            self._varlen = self._varlen_row(full.sizes, ADAPTIVE_VERIFICATION)
        self._full_tokens = self._varlen_row(full.sizes, MIXED) if full else None
        """FULL graphs by tokens, tried before the PIECEWISE ones: every batch's in mode FULL, the mixed steps' up to
        max_full_mixed_cudagraph_capture_tokens in FULL_AND_PIECEWISE."""
        decode_sizes = {g.q: g.sizes for g in sets if g.kind == FULL_DECODE}
        self._varlen_for_uniform = bool(varlen)
        self._uniform: dict[int, list[BatchDescriptor]] = {}
        for q in sorted(set(range(1, max_query_len + 1)) | set(decode_sizes)):
            self._uniform[q] = self._uniform_row(q, decode_sizes.get(q, ()))

    # -- precomputation ----------------------------------------------------------------------------------
    def _by_tokens(self, kind: str, num_tokens: int, num_reqs: int, q: int | None) -> BatchDescriptor:
        """By tokens: a FULL graph over tokens when one covers (mode FULL's, or FULL_AND_PIECEWISE's FULL mixed
        graphs), else PIECEWISE when a graph covers, else eager."""
        if num_tokens <= self.max_num_batched_tokens:
            full = self._full_tokens[num_tokens] if self._full_tokens is not None else None
            if full is not None:
                return full if kind == MIXED else full._replace(kind=kind, q=q)
            padded = self._token_pad[num_tokens]
            if padded:  # (graph_counts' PIECEWISE case, inline: every mixed step dispatches here)
                return _new(BatchDescriptor, (MODE_PIECEWISE, kind, padded, num_reqs, q, self._token_keys[padded]))
        return _new(BatchDescriptor, (MODE_EAGER, kind, num_tokens, num_reqs, q, None))

    def _uniform_row(self, q: int, sizes: tuple[int, ...]) -> list[BatchDescriptor]:
        pad = _padding_table(sizes, self.max_num_seqs)
        row = [self._by_tokens(UNIFORM_DECODE, 0, 0, q)]
        for n in range(1, self.max_num_seqs + 1):
            p = pad[n]
            if p:
                counts = graph_counts(FULL_DECODE, q, p, n, self.max_num_seqs)
                row.append(BatchDescriptor(MODE_FULL, UNIFORM_DECODE, *counts, q, GraphKey(FULL_DECODE, q, p)))
            else:
                row.append(self._uncovered_uniform(n * q, n, q))
        return row

    def _uncovered_uniform(self, num_tokens: int, num_reqs: int, q: int) -> BatchDescriptor:
        """A uniform decode no FULL decode graph covers: an adaptive-verification graph (it holds any decode
        batch), else by tokens."""
        if self._varlen_for_uniform and num_tokens <= self.max_num_batched_tokens:
            varlen = self._varlen[num_tokens]
            if varlen is not None:
                return varlen._replace(kind=UNIFORM_DECODE, q=q)
        return self._by_tokens(UNIFORM_DECODE, num_tokens, num_reqs, q)

    def _varlen_row(self, sizes: tuple[int, ...], kind: str) -> list[BatchDescriptor | None]:
        """FULL varlen descriptors by tokens; None where no graph covers (resolved per call)."""
        pad = _padding_table(sizes, self.max_num_batched_tokens)
        graph_kind = FULL_VARLEN if kind == ADAPTIVE_VERIFICATION and self._token_kind != FULL else FULL
        return [
            BatchDescriptor(MODE_FULL, kind, *graph_counts(graph_kind, None, p, p, self.max_num_seqs), None,
                            GraphKey(graph_kind, None, p))
            if p
            else None
            for p in pad
        ]

    # -- hot path ----------------------------------------------------------------------------------------
    def dispatch(self, num_tokens: int, num_reqs: int, max_query_len: int, is_decode: bool) -> BatchDescriptor:
        """Classify a batch and pick its graph. ``is_decode``: no request is prefilling (every request's query
        is its last sampled token plus its drafts)."""
        if num_tokens > self.max_num_batched_tokens or num_reqs > self.max_num_seqs or num_reqs < 1:
            raise ValueError(
                f"batch of {num_tokens} tokens / {num_reqs} requests is outside max_num_batched_tokens = "
                f"{self.max_num_batched_tokens}, max_num_seqs = {self.max_num_seqs}"
            )
        if is_decode:
            if num_tokens == num_reqs * max_query_len:
                row = self._uniform.get(max_query_len)
                if row is not None:
                    return row[num_reqs]
                return self._uncovered_uniform(num_tokens, num_reqs, max_query_len)
            if self._varlen is not None:
                found = self._varlen[num_tokens]
                if found is not None:
                    return found
            return self._by_tokens(ADAPTIVE_VERIFICATION, num_tokens, num_reqs, None)
        return self._by_tokens(MIXED, num_tokens, num_reqs, None)

    def dispatch_query_lens(self, query_lens: list[int], is_decode: bool) -> BatchDescriptor:
        """Convenience for tests and tools: dispatch from per-request query lengths."""
        return self.dispatch(sum(query_lens), len(query_lens), max(query_lens), is_decode)


def dispatchers_for_plan(plan) -> dict[str, Dispatcher]:
    """One Dispatcher per model runner of the configuration (``model_runners``), also for a runner the plan gives
    no graphs (graphs off: it dispatches every step eagerly). Drafters' block forwards run n * q tokens, which may
    exceed max_num_batched_tokens, so their tables reach max_num_seqs * (1 + K)."""
    cfg = plan.config
    q_max = 1 + cfg.num_speculative_tokens
    out = {"target": Dispatcher(plan.for_runner("target"), cfg.max_num_seqs, cfg.max_num_batched_tokens, q_max)}
    widest = max(cfg.max_num_batched_tokens, cfg.max_num_seqs * q_max)
    for runner in model_runners(cfg)[1:]:
        out[runner] = Dispatcher(plan.for_runner(runner), cfg.max_num_seqs, widest, q_max)
    return out


NOT_CAPTURED_YET = "not_captured_yet"
EAGER_CAUSES = ("graphs_off", "mixed_above_cap", "mixed_full_decode_only", "decode_above_cap", "av_above_cap",
                NOT_CAPTURED_YET)
"""Why a step ran eagerly, as a short label (metrics: ``eager_steps_total{reason}``); ``eager_reason`` gives the
sentence a user reads (``not_captured_reason`` for NOT_CAPTURED_YET: delayed capture had not captured its graph)."""


def not_captured_reason(desc: BatchDescriptor) -> tuple[str, str]:
    """Why a step whose graph ``desc`` names ran eagerly under delayed capture: (NOT_CAPTURED_YET, the sentence)."""
    g = desc.graph
    unit = "requests" if g.kind == FULL_DECODE else "tokens"
    at = f" at q = {g.q}" if g.q is not None else ""
    return NOT_CAPTURED_YET, (f"its {g.kind} graph for {g.size} {unit}{at} was not captured yet "
                              f"(delayed_cudagraph_capture captures it between steps)")


def padded_up(desc: BatchDescriptor, size: int, max_num_seqs: int) -> BatchDescriptor:
    """The same step on a larger graph of its graph's kind (and q): ``size`` requests (FULL decode) or tokens.
    Delayed capture's stand-in, where the step's own graph is not captured yet and the larger one is
    (``runtime.capture.StandIns``); worker and engine both build it here."""
    g = desc.graph
    num_tokens, num_reqs = graph_counts(g.kind, g.q, size, desc.num_reqs, max_num_seqs)
    return desc._replace(num_tokens=num_tokens, num_reqs=num_reqs, graph=GraphKey(g.kind, g.q, size))


def without_graphs(descs: "StepDescriptors", roles, num_tokens: int, num_reqs: int) -> "StepDescriptors":
    """The step's descriptors as it ran under delayed capture: each forward named in ``roles`` (``"target"``,
    ``"draft"``, ``"draft_next"``; others are ignored) eager, the target's over its ``num_tokens`` real tokens and
    ``num_reqs`` requests (no padding)."""
    changes = {}
    for role in roles:
        desc = getattr(descs, role, None) if role in ("target", "draft", "draft_next") else None
        if desc is not None:
            real = (num_tokens, num_reqs) if role == "target" else (desc.num_tokens, desc.num_reqs)
            changes[role] = desc._replace(mode=MODE_EAGER, num_tokens=real[0], num_reqs=real[1], graph=None)
    return replace(descs, **changes) if changes else descs


def eager_reason(desc: BatchDescriptor, plan) -> tuple[str, str]:
    """Why a step runs eagerly under ``plan`` (a CapturePlan): (a label of EAGER_CAUSES, the sentence in the terms a
    user tunes; steps of one cause share it). The one place that answers "why did this step run eagerly"."""
    cfg = plan.config
    if cfg.cudagraph_mode.value == MODE_EAGER:
        return "graphs_off", "cudagraph_mode is NONE (or both size lists are [])"
    sets = {(g.kind, g.q): g for g in plan.for_runner("target")}
    pw = sets.get((PIECEWISE, None))
    pw_text = f"the largest PIECEWISE size {pw.largest}" if pw and pw.sizes else "no PIECEWISE graphs"
    if desc.kind == MIXED:
        if cfg.cudagraph_mode.value == "FULL_DECODE_ONLY":
            return "mixed_full_decode_only", "cudagraph_mode FULL_DECODE_ONLY runs mixed steps eagerly"
        return "mixed_above_cap", f"mixed steps above {pw_text}"
    if desc.kind == UNIFORM_DECODE:
        dec = sets.get((FULL_DECODE, desc.q))
        if dec is None or not dec.sizes:
            why = f"no FULL decode graphs at q = {desc.q}"
        else:
            why = f"beyond the FULL decode graphs at q = {desc.q} (largest {dec.largest} requests"
            if cfg.max_decode_tokens is not None:
                why += f", max_decode_cudagraph_capture_tokens = {cfg.max_decode_tokens}"
            why += ")"
        return "decode_above_cap", f"uniform decodes {why}, and above {pw_text}"
    av = sets.get((FULL_VARLEN, None))
    av_text = f"the largest varlen size {av.largest}" if av and av.sizes else "no varlen graphs"
    return "av_above_cap", f"adaptive-verification steps above {av_text} and {pw_text}"


@dataclass(frozen=True)
class StepDescriptors:
    """The dispatcher's decisions for every forward of a step: the target's, and the drafter's."""

    target: BatchDescriptor
    draft: BatchDescriptor | None = None
    """EAGLE or draft-model step 0 (the target step's shape) or the block drafter's forward (n * q tokens)."""
    draft_next: BatchDescriptor | None = None
    """The one-token steps (one token a request): EAGLE's steps 1..K-1 (None below K = 2), a draft model's K
    steps."""

    def drafts(self) -> tuple[BatchDescriptor, ...]:
        return tuple(d for d in (self.draft, self.draft_next) if d is not None)


def dispatch_step(dispatchers: dict[str, Dispatcher], method: str | None, out) -> StepDescriptors:
    """Every forward of a scheduled step (a SchedulerOutput): the target's, and a model drafter's, whose shapes
    are known before the step runs (the sampling requests, and the drafts each proposes). A drafter with a forward
    over the target's rows (step 0) runs it every step, drafting or not (a step that samples nothing, a tier of
    K = 0): its KV then holds every position the target's does, so that a later draft, or a request that finds
    the blocks in the prefix cache, reads it whole."""
    s = out.shape
    target = dispatchers["target"].dispatch(s.num_tokens, s.num_reqs, s.max_query_len, s.is_decode)
    k = out.num_new_drafts
    n_s = int(out.samples.sum())
    if method in ONE_TOKEN_DRAFTERS:  # the target step's shape, then one token a request (one_token_steps times)
        draft = dispatchers[method].dispatch(s.num_tokens, s.num_reqs, s.max_query_len, s.is_decode)
        drafting = k and n_s and one_token_steps(method, k)
        nxt = dispatchers[next_steps_runner(method)].dispatch(n_s, n_s, 1, True) if drafting else None
        return StepDescriptors(target, draft, nxt)
    if method not in MODEL_DRAFTERS or not k or not n_s:
        return StepDescriptors(target)
    q = block_query_len(method, k)
    return StepDescriptors(target, dispatchers[method].dispatch(n_s * q, n_s, q, True))

