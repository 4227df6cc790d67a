"""Fused decode steps: a whole uniform-decode step in one CUDA graph.

A uniform decode step (every request runs q = 1 + K tokens: its last token and K drafts) does the same work at a
given padded request count n': the target's inputs gathered from the request state, the target's forward, the
tokens drawn and verified, the state advanced, the drafter (an EAGLE head's step 0 over the target's rows and its K - 1
one-token steps, or n-gram lookup) and the results laid out for the one copy back. Run op by op around the
runners' graphs, that is about 40 (no drafter) to 170 (EAGLE-3, K = 3) PyTorch launches a step, each costing the
host microseconds; on the H200 with the default model the host then sets the step time (1.6 ms of host time for
0.96 ms of kernels without drafting, 6.4 ms for 1.37 ms with an EAGLE-3 head at K = 3:
``benchmarks/profile_spec_step.py``). Captured whole, a step costs the host one graph launch; inside it, where
there is Triton, the inputs' packing (``_load``), a one-token step's advance and the verification (``_finish``) are
one kernel each (``models.fused.decode_inputs``, ``advance_inputs``, ``accept_drafts``; the torch paths run on the
CPU).

One graph per (q, n') of the target's FULL decode graphs (and the drafter's FULL graphs at the same n'), over
static buffers: ``slots`` in (the step's request slots, padded with ``RequestState.dummy``, a row no request
owns), ``out`` rows out (per request: accepted drafts, the tokens at the step width, the drafts' confidences as
int32 bits; the first n rows are the step's, so the copy back takes them as they lie). Inside, each runner's own
FULL closure runs (the kernels its separate graph holds), so a fused step computes exactly what the unfused step
computes. n-gram lookup searches a history whose length the step bounds: it is a small graph of its own per
(n', history length bucket), replayed after the step's.

The graph samples every row as its request says: ``models.fused.sample``, one kernel, reads each slot's
temperature, seed, min_p and penalties from the request state and draws output column j of a request at position
computed + 1 + j (as the op-by-op ``ModelWorker._verify``): a penalized slot's logits get its repetition, presence
and frequency penalties first (its output counts plus its first j drafts, as ``models.fused.penalize``), then the
argmax at temperature 0 (hashing nothing), else the seeded Gumbel-max sample: the same tokens as the op-by-op
sampler. Drafts are accepted while they equal those (``accepted_drafts``), and the accepted tokens of penalized
slots go into their counts (``models.fused.count_accepted``, as ``SamplingExtras.count``). One graph serves every
batch: a greedy unpenalized row costs what the plain argmax cost plus one flag read, and the counting one small
kernel a step (a graph per variant would double the capture time and memory).

A step runs fused (``FusedDecode.key_for``) when it is a uniform decode on a FULL graph, every request samples
with temperature, seed, min_p and the penalties alone (no top-k, no top-p, no other processing of the logits:
logit bias, allowed tokens, bad words, min_tokens), without logprobs, the drafter proposes as many drafts as it
verified (K = q - 1; no tier change mid-step) with FULL graphs at n', and the fixed-acceptance mode is the one
captured; any other step runs op by op (``ModelWorker.submit``). A draft model and the block drafters always run op
by op.

A step that a grammar constrains (structured outputs) needs its bitmask, which the worker fills
(``dispatcher.runtime.grammar``) once the step before has sampled, while this one's forward runs. Without a
drafter (q = 1) it runs as two graphs (``FusedDecode.constrained``): the forward, its LM head writing the logits
into a static buffer; then, the bitmask uploaded into ``bitmask`` on a side stream (every bit set for an
unconstrained row), the sampling among the tokens it allows (the sampler's kernel reads the bitmask beside the
logits: ``sample_by_slot``'s ``bitmask``) and the rest of the step as above. The pair of a size is captured
on demand: the first constrained step of that size runs op by op and asks for it, the next gap between steps
captures it, so a server that never sees a structured request captures nothing more. With a drafter constrained
steps run op by op.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from dispatcher.messages import bitmask_words
from dispatcher.plan.capture_plan import EAGLE_LIKE, FULL_DECODE, FUSED_STEP, next_steps_runner, one_token_steps
from dispatcher.plan.dispatch import MODE_FULL, UNIFORM_DECODE, GraphKey, dispatchers_for_plan
from dispatcher.runtime.graphs import (CaptureOOMError, KindReport, Replayable, capture_stream,
                                       estimate_kind_memory, free_device_bytes, frozen_gc, gc_off, input_length,
                                       progress_bar, replay_ms, shared_pool)
from models.drafters import propose_ngram
from models.fused import accept_drafts, count_accepted, decode_inputs, use_triton
from models.sampling import SlotPenalties, accepted_drafts, fixed_accepted, sample_by_slot

log = logging.getLogger("twogrid.runtime")

KIND = "fused_decode"
NGRAM_TIMED_LENGTH = 1024
"""The history length whose n-gram lookup graph ``measure_ms`` adds to a step's cost."""
NGRAM_LENGTHS = (256, 1024, 4096, 16384)
"""History lengths n-gram lookup graphs are captured at (the state's width caps them): a step searches the
smallest that holds its longest sequence."""


@dataclass(frozen=True)
class FusedKey:
    """Names one fused step graph: the graphs its forwards replay and the drafts it proposes."""

    target: GraphKey
    draft: GraphKey | None
    draft_next: GraphKey | None
    num_new_drafts: int


class FusedDecode:
    """The fused decode-step graphs of one worker (``ModelWorker.fused``)."""

    def __init__(self, worker, plan):
        self.worker, self.state = worker, worker.state
        self.target = worker.runtime
        self.device = self.target.device
        self.width = 1 + worker.k_max
        drafter = worker.drafter
        self.method = plan.config.method if drafter is not None else None
        self.keys = self._keys(plan) if self.method in (None, "ngram") + EAGLE_LIKE else {}
        cap = max((k.target.size for k in self.keys), default=0)
        z = lambda *shape, dt=torch.int64: torch.zeros(*shape, dtype=dt, device=self.device)  # noqa: E731
        self.slots = torch.full((max(cap, 1),), self.state.dummy, dtype=torch.int64, device=self.device)
        self.out = z(max(cap, 1), 1 + self.width + worker.k_max, dt=torch.int32)
        """Per request: accepted drafts, tokens (width), draft confidences (k_max, float32 bits)."""
        self._arange = torch.arange(max(cap, self.width) + 1, device=self.device)
        self.samples = use_triton(self.slots) or not self.target.cuda_graphs
        """Steps with sampled requests fuse: the graphs sample with ``models.fused.sample`` (with Triton), or the
        closures run eagerly (the host tells them when every row is greedy: ``greedy_only``)."""
        self.greedy_only = True
        """Every request of the step running is greedy and unpenalized (read by eager closures without Triton)."""
        self.penalized = False
        """A request of the step running uses a penalty (read by eager closures without Triton)."""
        self.fixed = worker.fixed_acceptance_on
        """The fixed-acceptance mode the graphs were built in (a step in the other runs op by op)."""
        self.graphs: dict[FusedKey, Replayable] = {k: Replayable(self._step(k)) for k in self.keys}
        self.constrained: dict[FusedKey, tuple[Replayable, Replayable]] = {
            k: tuple(Replayable(fn) for fn in self._constrained_step(k)) for k in self.keys
            if worker.wcfg.structured_outputs and self.method is None and worker.model.tp is None}
        """Structured outputs without a drafter: a step that a grammar constrains as two graphs, the forward to the
        logits, then (once the worker's bitmask is in ``bitmask``) the masked sampling and the rest. Not with tensor
        parallelism: they are captured between steps on demand, and ranks capture only in step."""
        vocab = worker.model.cfg.vocab_size
        words = bitmask_words(vocab) if self.constrained else 0
        self.bitmask = torch.full((max(cap, 1), words), -1, dtype=torch.int32, device=self.device)
        """Per request: the grammar's packed bitmask of the step running (every bit set: unconstrained)."""
        self._host_bitmask = torch.full((max(cap, 1), words), -1, dtype=torch.int32,
                                        pin_memory=self.device.type == "cuda")
        cuda = self.device.type == "cuda" and words
        self._bitmask_copied = torch.cuda.Event() if cuda else None
        """After the last copy of ``_host_bitmask`` to the device (the next fill waits for it; so does the sampling
        graph that reads it)."""
        self._bitmask_read = torch.cuda.Event() if cuda else None
        """After the last constrained sampling graph (the next upload into ``bitmask`` waits for it)."""
        self._upload_stream = torch.cuda.Stream(self.device) if cuda else None
        """The bitmask's upload, off the step's stream: it overlaps the forward where the fill ends first."""
        self._logits = self._logits_buffer(max(cap, 1) * self.width) if self.constrained else None
        """The constrained step's logits between its two graphs, (rows, the LM head's padded vocabulary) in its
        dtype, allocated here (the KV sizing's probe counts it): the forward's LM head writes into it."""
        self.constrained_captured: set[FusedKey] = set()
        self.constrained_demand: dict[FusedKey, None] = {}
        """Constrained steps' graph pairs asked for (a constrained step found its pair uncaptured and ran op by op):
        captured between steps, oldest first (``capture_demanded_constrained``). Only what structured requests use
        is captured: a server that never sees one captures nothing more (it holds the buffers above: the logits,
        n' x vocabulary, allocated at start so that the KV sizing counts them)."""
        self._constrained_failed: set[FusedKey] = set()
        lengths = sorted({min(n, self.state.token_ids.shape[1]) for n in NGRAM_LENGTHS})
        self.ngram_lengths = np.asarray(lengths) if self.method == "ngram" else np.zeros(0, np.int64)
        self.ngram: dict[tuple[int, int, int], Replayable] = {
            (k.target.size, length, k.num_new_drafts): Replayable(self._ngram(k.target.size, length, k.num_new_drafts))
            for k in self.keys if k.num_new_drafts for length in self.ngram_lengths}
        self.report: list[KindReport] = []
        self.captured: set[FusedKey] = set()
        """Step graphs captured (with their n-gram lookup graphs): what delayed capture lets a step replay."""

    # -- which steps ---------------------------------------------------------------------------------------------
    def _keys(self, plan) -> dict[FusedKey, None]:
        """A key per target FULL decode size whose drafter forwards (at the same n') are FULL graphs: an EAGLE-style
        head's step 0 at every q (it writes the head's KV on every step, drafting or not: ``drafting.py``), its
        one-token steps where the step drafts."""
        keys: dict[FusedKey, None] = {}
        dispatchers = dispatchers_for_plan(plan)
        for g in plan.for_runner("target"):
            if g.kind != FULL_DECODE:
                continue
            k = g.q - 1 if self.method is not None else 0
            for n in g.sizes:
                draft = nxt = None
                if self.method in EAGLE_LIKE:  # (step 0 runs every step: its KV follows the target's)
                    draft = dispatchers[self.method].dispatch(n * g.q, n, g.q, True)
                    if k and one_token_steps(self.method, k):
                        nxt = dispatchers[next_steps_runner(self.method)].dispatch(n, n, 1, True)
                    if any(d is not None and (d.mode != MODE_FULL or d.num_reqs != n) for d in (draft, nxt)):
                        continue
                keys[FusedKey(GraphKey(FULL_DECODE, g.q, n), draft and draft.graph, nxt and nxt.graph, k)] = None
        return keys

    def key_for(self, step, slots: np.ndarray) -> FusedKey | None:
        """The fused graph that runs this step, or None (the step runs op by op); host-side checks only."""
        t = step.target
        if t.mode != MODE_FULL or t.kind != UNIFORM_DECODE or step.new_requests or not len(slots):
            return None
        key = FusedKey(t.graph, step.draft.graph if step.draft is not None else None,
                       step.draft_next.graph if step.draft_next is not None else None, step.num_new_drafts)
        if key not in self.graphs or self.worker.fixed_acceptance_on != self.fixed:
            return None
        if step.constrained and key not in self.constrained:  # (with a drafter a grammar's steps run op by op)
            return None
        st = self.state
        samples = st.fused_sampling(slots) if self.samples else st.plain_greedy(slots)
        if not samples or (st.host_num_logprobs[slots] >= 0).any():  # (the graph computes no logprobs)
            return None
        return key

    # -- a step --------------------------------------------------------------------------------------------------
    def run(self, key: FusedKey, slots: torch.Tensor, max_seq_len: int, host_slots: np.ndarray,
            grammar=None) -> None:
        """Replay ``key``'s graph for ``slots`` (the step's slots padded to n' with the dummy slot, on the device;
        ``host_slots`` the step's own, on the host), then the n-gram lookup's for the step's longest sequence.
        Without Triton the closure runs eagerly and skips work by what the host knows of the requests
        (``greedy_only``, ``penalized``); with it a graph samples and counts every row as the request state says.
        ``grammar``: a constrained step's function that fills its packed bitmask, int32 (n', words) on the host
        (``WorkerGrammars.fill``, once the step before has sampled): the forward's graph is queued first, the
        sampling's once the bitmask is uploaded."""
        n = key.target.size
        self.slots[:n].copy_(slots)
        if not use_triton(self.slots):
            self.greedy_only = self.state.plain_greedy(host_slots)
            self.penalized = self.state.extras.counts_tokens(host_slots)
        if grammar is not None:
            forward, sample = self.constrained[key]
            forward.replay()
            self._upload_bitmask(n, grammar)
            sample.replay()
            if self._bitmask_read is not None:
                self._bitmask_read.record()
            return
        self.graphs[key].replay()
        if self.method == "ngram" and key.num_new_drafts:
            bucket = int(np.searchsorted(self.ngram_lengths, max_seq_len + 1))
            length = int(self.ngram_lengths[min(bucket, len(self.ngram_lengths) - 1)])
            self.ngram[(n, length, key.num_new_drafts)].replay()

    def _upload_bitmask(self, n: int, grammar) -> None:
        """The step's bitmask filled on the host (``grammar``) while its forward runs, then copied to ``bitmask`` on
        a side stream, which the sampling graph's stream waits for: the copy overlaps the forward instead of
        queuing behind it."""
        if self._upload_stream is None:
            grammar(self._host_bitmask[:n])
            self.bitmask[:n].copy_(self._host_bitmask[:n])
            return
        self._bitmask_copied.synchronize()  # (the last constrained step's copy out of the host buffer)
        host = self._host_bitmask[:n]
        grammar(host)
        with torch.cuda.stream(self._upload_stream):
            self._upload_stream.wait_event(self._bitmask_read)  # (the last sampling graph has read ``bitmask``)
            self.bitmask[:n].copy_(host, non_blocking=True)
            self._bitmask_copied.record()
        torch.cuda.current_stream(self.device).wait_event(self._bitmask_copied)

    def _step(self, key: FusedKey):
        """The closure a fused graph captures (see the module's docstring)."""
        n, q = key.target.size, key.target.q

        def run() -> None:
            inputs = self._inputs(n, q)
            self._finish(key, inputs, self._forward(key, inputs))

        return run

    def _constrained_step(self, key: FusedKey):
        """The two closures of a constrained step: the forward, its LM head writing the logits into ``_logits``;
        then (the grammar's bitmask uploaded into ``bitmask`` between them) the sampling among the tokens it allows
        and the rest of the step as ``_step``'s."""
        n, q = key.target.size, key.target.q

        def forward() -> None:
            self._forward(key, self._inputs(n, q), self._logits[: n * q])

        def sample() -> None:  # (q = 1: a bitmask row a logits row)
            self._finish(key, self._inputs(n, q), self.logits_rows(n * q), self.bitmask[:n])

        return forward, sample

    def logits_rows(self, rows: int) -> torch.Tensor:
        """The constrained steps' logits buffer's first ``rows`` rows, (rows, vocab) as the sampler reads them."""
        return self._logits[:rows, : self.worker.model.cfg.vocab_size]

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        """(rows, padded vocab) in ``compute_logits``' dtype: float32 on the CPU, else the LM head's."""
        model = self.worker.model
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        dtype = torch.float32 if self.device.type == "cpu" else head.dtype
        return torch.empty(rows, head.shape[0], dtype=dtype, device=self.device)

    def _inputs(self, n: int, q: int) -> tuple[torch.Tensor, ...]:
        """The step's requests as the state holds them before it runs: slots, which are real, their computed
        tokens, their drafts, their block-table rows."""
        st = self.state
        slots = self.slots[:n]
        valid = slots != st.dummy
        computed = torch.where(valid, st.num_computed[slots], 0)
        return slots, valid, computed, st.drafts[slots, : q - 1], torch.where(valid, slots, 0)

    def _forward(self, key: FusedKey, inputs, out: torch.Tensor | None = None) -> torch.Tensor:
        """The target's forward over the step's tokens (each request's last token and its drafts) -> logits (into
        ``out``'s rows, padded vocabulary wide, if given: ``CausalLM.compute_logits``)."""
        st, tgt = self.state, self.target
        q = key.target.q
        slots, valid, computed, drafts, block_rows = inputs
        positions = computed[:, None] + self._arange[None, :q]
        ids = st.token_ids[slots, computed][:, None]
        if q > 1:
            ids = torch.cat([ids, drafts], dim=1)
        self._load(tgt, block_rows, valid, ids, positions)
        tgt.graphs[key.target][0].fn()
        return self.worker.model.compute_logits(tgt.bufs.hidden_out[: key.target.size * q], out=out)

    def _finish(self, key: FusedKey, inputs, logits: torch.Tensor, bitmask: torch.Tensor | None = None) -> None:
        """From the logits: the tokens drawn (among those ``bitmask`` allows, if given) and verified, the state
        advanced, the drafter, the result rows."""
        st, worker = self.state, self.worker
        n, q, k = key.target.size, key.target.q, key.num_new_drafts
        slots, valid, computed, drafts, block_rows = inputs
        cols = computed[:, None] + 1 + self._arange[None, :q]  # (the positions of the tokens drawn)
        ex = st.extras
        penalties = SlotPenalties(ex.penalized, ex.penalties, ex.output_counts, ex.prompt_seen, st.drafts) \
            if ex.output_counts is not None else None  # (on the CPU: none before the first penalized request)
        tokens = sample_by_slot(logits, slots, q, cols.flatten(), st.temperature, st.seed, ex.min_p, penalties,
                                self.greedy_only, self.penalized, bitmask)
        tokens = tokens.view(n, q)
        out = self.out[:n]
        given = None
        if q > 1 and self.fixed:
            given = fixed_accepted(st.seed[slots], computed + 1, torch.full_like(computed, q - 1), q - 1,
                                   worker.fixed_alpha)
            tokens = torch.where(self._arange[None, :q] < given[:, None], torch.cat([drafts, drafts[:, :1]], dim=1),
                                 tokens)
        keep = None
        if use_triton(tokens):  # (one kernel: the verification, the state's tokens and counts, the result rows)
            accepted = accept_drafts(tokens, drafts, slots, computed, st.token_ids, st.num_computed, out, self.width,
                                     given)
        else:
            if given is not None:
                accepted = given
            elif q == 1:
                accepted = torch.zeros_like(computed)
            else:
                accepted = accepted_drafts(tokens, drafts, torch.full_like(computed, q - 1))
            rows = slots[:, None].expand_as(cols)
            keep = self._arange[None, :q] <= accepted[:, None]
            st.token_ids[rows, cols] = torch.where(keep, tokens, st.token_ids[rows, cols])
            st.num_computed[slots] = computed + 1 + accepted
            out[:, 0].copy_(accepted)
            out[:, 1 : 1 + self.width].copy_(tokens[:, self._arange[: self.width].clamp(max=q - 1)])
        if penalties is not None:
            self._count(slots, block_rows, valid, tokens, accepted, keep)
        if self.method in EAGLE_LIKE:
            conf = self._eagle(key, slots, block_rows, valid, tokens, accepted, computed + 1 + accepted)
            if k:
                out[:, 1 + self.width : 1 + self.width + k].copy_(conf.view(torch.int32))

    def _count(self, slots, block_rows, valid, tokens, accepted, keep) -> None:
        """The step's accepted tokens into the penalized requests' output counts (``SamplingExtras.count``): one
        kernel with Triton (a request whose slot is not penalized reads one flag), else when the host says a
        request is penalized."""
        ex = self.state.extras
        if use_triton(tokens):
            count_accepted(slots, tokens, accepted, ex.penalized, ex.output_counts)
        elif self.penalized:
            ex.count(block_rows, tokens, keep & valid[:, None])

    def _load(self, rt, block_rows, valid, ids, positions) -> None:
        """A runner's FULL decode inputs for n requests of q tokens (ids and positions (n, q)), in the static
        buffers where its graph reads them; padded requests (``valid`` False) as ``GraphRuntime.load_inputs`` pads:
        slot -1, token position -1, sequence length 0. With Triton one kernel (about 15 launches otherwise: at 16
        requests on the H200, in a fixed-acceptance profile, a K = 3 step's glue between its forwards took 176 us
        more than a plain step's)."""
        if use_triton(ids):
            decode_inputs(rt.bufs.inputs, ids, positions, valid, block_rows, rt.bufs.block_table, rt.block_size)
            return
        n, q = ids.shape
        live = valid[:, None].expand(n, q)
        table_rows = block_rows[:, None].expand(n, q)
        kv = torch.where(live, rt.kv_slots(table_rows, positions), -1)
        token_pos = torch.where(live, positions, -1)
        rt.bufs.rows(n * q).copy_(torch.stack([torch.where(live, ids, 0), torch.where(live, positions, 0), kv,
                                               table_rows, token_pos]).view(5, n * q))
        starts, seq_lens, req_rows = rt.bufs.requests(n * q, n)
        torch.mul(self._arange[: n + 1], q, out=starts)
        seq_lens.copy_(torch.where(valid, positions[:, -1] + 1, 0))
        req_rows.copy_(block_rows)

    def _eagle(self, key, slots, block_rows, valid, tokens, accepted, last_pos) -> torch.Tensor | None:
        """An EAGLE head's drafts for the step (as ``EagleDrafter.propose``): step 0 over the target's rows, each
        reading the token produced after it; then, when the step drafts, K - 1 one-token steps from the last new
        token. Writes the drafts into the request state; returns their confidences (n, K) (None: no drafts)."""
        st, tgt, drafter = self.state, self.target, self.worker.drafter
        n, q, k = key.target.size, key.target.q, key.num_new_drafts
        step0 = drafter.runtimes[0]
        step0.bufs.inputs[: input_length(n * q, n)].copy_(tgt.bufs.inputs[: input_length(n * q, n)])
        step0.bufs.rows(n * q)[0].copy_(tokens.flatten())
        features = tgt.features(n * q) if tgt.model.aux_layers else tgt.bufs.hidden_out[: n * q]
        step0.bufs.aux[: n * q].copy_(features)
        step0.graphs[key.draft][0].fn()
        if not k:
            return None
        feature = step0.bufs.hidden_out[: n * q].view(n, q, -1)[self._arange[:n], accepted]
        drafts = torch.empty(n, k, dtype=torch.int64, device=self.device)
        conf = torch.empty(n, k, dtype=torch.float32, device=self.device)
        drafts[:, 0], conf[:, 0] = drafter.head.propose(feature)
        if k > 1:
            nxt = drafter.runtimes[1]
            self._load(nxt, block_rows, valid, drafts[:, :1], last_pos[:, None])
            nxt.bufs.aux[:n].copy_(feature)
            run_next = nxt.graphs[key.draft_next][0].fn  # proposes, then advances its own inputs
            for j in range(1, k):
                run_next()
                drafts[:, j], conf[:, j] = nxt.proposals(n)
        st.drafts[slots, :k] = drafts
        st.draft_conf[slots, :k] = conf
        return conf

    def _ngram(self, n: int, length: int, k: int):
        """n-gram lookup for n requests over their first ``length`` tokens, after a fused step advanced them (as
        ``NgramDrafter.propose``): drafts into the request state, confidences into ``out``."""
        st = self.state

        def run() -> None:
            slots = self.slots[:n]
            last_pos = torch.where(slots != st.dummy, st.num_computed[slots], 0)
            history = st.token_ids[:, :length].index_select(0, slots)
            drafts, conf = propose_ngram(history, last_pos, k, self.worker.drafter.min_n, self.worker.drafter.max_n)
            st.drafts[slots, :k] = drafts
            st.draft_conf[slots, :k] = conf
            self.out[:n, 1 + self.width : 1 + self.width + k].copy_(conf.view(torch.int32))

        return run

    # -- capture -------------------------------------------------------------------------------------------------
    def _all(self) -> list[tuple[str, int, list]]:
        """(label, q, [(size, graph), ...]) per set of graphs, widest first within each."""
        sets: dict[int, list] = {}
        for key, graph in self.graphs.items():
            sets.setdefault(key.target.q, []).append((key.target.size, graph))
        out = [(KIND, q, sorted(items, key=lambda x: -x[0])) for q, items in sorted(sets.items())]
        if self.ngram:
            out.append(("ngram_lookup", None, sorted(((n * length, g) for (n, length, _), g in self.ngram.items()),
                                                     key=lambda x: -x[0])))
        return out

    def _reset(self) -> None:
        """Every slot padded: what a capture's warm-up and capture read (no request's state is touched)."""
        self.slots.fill_(self.state.dummy)

    def estimate_memory(self) -> float:
        """GiB the fused graphs will take (``graphs.estimate_kind_memory`` per set, in a throwaway pool)."""
        if not self.target.cuda_graphs or not self.graphs:
            return 0.0
        self._reset()
        pool, keep, total = torch.cuda.graph_pool_handle(), [], 0.0
        with frozen_gc():
            for _, _, items in self._all():
                copies = [lambda pool, stream, fn=g.fn: Replayable.captured(fn, pool, stream) for _, g in items]
                total += estimate_kind_memory(self.device, copies, pool, keep)
        del keep, pool
        free_device_bytes(self.device)
        return total / 2**30

    def constrained_ready(self, key: FusedKey) -> bool:
        """A constrained step of ``key`` can run as its two graphs; if not, they are asked for (once)."""
        if key in self.constrained_captured:
            return True
        if key in self.constrained and key not in self._constrained_failed:
            self.constrained_demand[key] = None
        return False

    @torch.inference_mode()
    def capture_demanded_constrained(self) -> None:
        """Capture the oldest asked-for constrained pair into the shared pool, between steps (as delayed capture
        does: no synchronization, thread-local capture mode, no garbage collection), then mark it; on the CPU only
        the mark. A capture that fails (out of memory, or refused) leaves that size's constrained steps op by op,
        with a warning."""
        key = next(iter(self.constrained_demand))
        del self.constrained_demand[key]
        start = time.perf_counter()
        if self.target.cuda_graphs:
            pool, stream = shared_pool(self.device), capture_stream(self.device)
            self._reset()
            try:
                with gc_off():
                    for graph in self.constrained[key]:
                        graph.capture(pool, stream, between_steps=True)
            except Exception as exc:  # (out of memory, or a capture the device refused: never the server's end)
                self._constrained_failed.add(key)
                log.warning("capturing the constrained decode step for %d requests failed (%s: %s): its structured "
                            "requests' steps stay op by op", key.target.size, type(exc).__name__, exc,
                            exc_info=not isinstance(exc, torch.cuda.OutOfMemoryError))
                return
        self.constrained_captured.add(key)
        log.info("captured the constrained decode step (structured outputs) for %d requests in %.0f ms",
                 key.target.size, (time.perf_counter() - start) * 1e3)

    def capture_order(self) -> list[FusedKey]:
        """Every step graph, by q, widest first (as ``capture``)."""
        return sorted(self.graphs, key=lambda k: (k.target.q, -k.target.size))

    def unit_graphs(self, key: FusedKey) -> list[Replayable]:
        """What delayed capture captures as one unit: the step graph, then its n-gram lookup graphs."""
        n, k = key.target.size, key.num_new_drafts
        return [self.graphs[key]] + [self.ngram[(n, int(length), k)] for length in self.ngram_lengths if k]

    @torch.inference_mode()
    def capture_key(self, key: FusedKey, between_steps: bool = False) -> None:
        """Capture one step graph and its n-gram lookup graphs into the shared pool, and mark the step captured
        (``captured``): delayed capture's unit. On the CPU only the mark."""
        if self.target.cuda_graphs:
            pool, stream = shared_pool(self.device), capture_stream(self.device)
            self._reset()
            for graph in self.unit_graphs(key):
                try:
                    graph.capture(pool, stream, between_steps)
                except torch.cuda.OutOfMemoryError:
                    raise CaptureOOMError(f"out of GPU memory capturing the fused decode step for "
                                          f"{key.target.size} requests at q = {key.target.q}: leave more memory "
                                          f"(a smaller KV cache or max_num_seqs)") from None
        self.captured.add(key)

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> list[KindReport]:
        """Capture every fused graph (after the runners' own: they share the pool the widest grew)."""
        if not self.target.cuda_graphs or not self.graphs:
            self.captured = set(self.graphs)
            return []
        pool, stream = shared_pool(self.device), capture_stream(self.device)
        self._reset()
        bar = progress_bar(len(self.graphs) + len(self.ngram), "capturing fused decode steps", progress)
        with frozen_gc():
            for label, q, items in self._all():
                free0, start = free_device_bytes(self.device), time.perf_counter()
                for size, graph in items:
                    try:
                        graph.capture(pool, stream)
                    except torch.cuda.OutOfMemoryError:
                        raise CaptureOOMError(f"out of GPU memory capturing the fused decode step for {size} "
                                              f"requests at q = {q}: leave more memory (a smaller KV cache or "
                                              f"max_num_seqs)") from None
                    bar.update(1)
                used = (free0 - free_device_bytes(self.device)) / 2**30
                kr = KindReport(FUSED_STEP, label, q, len(items), time.perf_counter() - start, used)
                self.report.append(kr)
                log.info("captured %d %s graphs%s in %.1f s, %.3f GiB", kr.graphs, label,
                         f" at q={q}" if q else "", kr.seconds, kr.measured_gib)
        bar.close()
        self.captured = set(self.graphs)
        return self.report

    @torch.inference_mode()
    def measure_ms(self, repeats: int = 5) -> dict[int, list[tuple[int, float]]]:
        """The median replay time (ms) of every fused step graph over padded slots, by q: {q: [(requests, ms)]}:
        the whole step's cost (target, drafter, glue; with n-gram, the lookup over NGRAM_TIMED_LENGTH tokens) that
        ``"auto"`` tiers weigh. Attention has no context here."""
        self._reset()
        lookup = self.ngram_lengths[min(np.searchsorted(self.ngram_lengths, NGRAM_TIMED_LENGTH),
                                        len(self.ngram_lengths) - 1)] if len(self.ngram_lengths) else 0
        out: dict[int, list[tuple[int, float]]] = {}
        for key, graph in self.graphs.items():
            ms = replay_ms(graph, self.device, repeats)
            if key.num_new_drafts and self.ngram:
                ms += replay_ms(self.ngram[(key.target.size, int(lookup), key.num_new_drafts)], self.device, repeats)
            out.setdefault(key.target.q, []).append((key.target.size, ms))
        return {q: sorted(points) for q, points in out.items()}
