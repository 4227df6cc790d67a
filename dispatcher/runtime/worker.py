"""The model worker: owns the model, the KV cache, the graphs and every request's state on one device, and turns
each ``messages.Step`` into a ``messages.StepResult`` (SPEC section 7).

A step is ``submit`` then ``collect``. ``submit`` queues everything on the device without waiting for it: one
host-to-device copy of the step's columns, the inputs built on the device from the request state (tokens, computed
counts, drafts), the target forward, verification and sampling, the state update, the drafter (its forwards, or the
n-gram lookup over the token histories), and one device-to-host copy of the sampled tokens (and the drafts'
confidences). ``collect`` waits for that copy (the step's one synchronization). So the engine can submit step t + 1
before it collects step t, and the device never waits for the host in between.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from dispatcher.messages import F32, CaptureProgress, Step, StepResult, bitmask_words, pack, unpack
from dispatcher.plan.acceptance import fixed_acceptance_rate
from dispatcher.plan.config import HEAD_METHODS, capture_first_reason
from dispatcher.plan.capture_plan import (DRAFT_MODEL, EAGLE_LIKE, FULL_VARLEN, FUSED_STEP, MODEL_DRAFTERS,
                                          is_next_steps, model_runners)
from dispatcher.plan.dispatch import MODE_EAGER, padded_up
from dispatcher.runtime.capture import BackgroundCapture, DeferredWarmUp
from dispatcher.runtime.decode_step import FusedDecode, FusedKey
from dispatcher.runtime.drafting import BlockDrafter, DraftModelDrafter, EagleDrafter, NgramDrafter
from dispatcher.runtime.grammar import WorkerGrammars, import_xgrammar_in_background
from dispatcher.runtime.graphs import CaptureReport, GraphRuntime, StepInputs
from dispatcher.runtime.jit import JitWatch
from dispatcher.runtime.sampling_state import SamplingExtras
from dispatcher.runtime.staging import Download, Upload, as_f32, f32_words
from models.attention import allocate_kv_cache, kv_cache_dtype
from models.config import PRESETS, ModelConfig
from models.default_model import shipped_head
from models.eagle import EagleHead, build_draft_head, load_draft_head
from models.fused import argmax_prob, count_accepted, penalize, sample
from models.loader import load_model
from models.sampling import RowParams, accepted_drafts, fixed_accepted, sample_tokens
from models.transformer import build_model

log = logging.getLogger("twogrid.worker")

PROMPT_LOGPROB_CHUNK_ROWS = 512
"""Prompt rows whose log-probabilities are computed at once (their logits are rows x vocabulary floats)."""
DELAYED_WARM_UP_MAX_TOKENS = 1024
"""Delayed capture warms eager forwards of up to this many tokens, and eager attention over sequences of up to this
many, at start-up (the first steps' sizes: every kernel variant below the fused MoE's 1024-token limit, the split
contexts' merges of up to 4 splits); the wider ones are warmed between steps."""
DRAFT_ROLES = ("draft", "draft_next")
"""A step's drafter forwards (``Step.draft``, ``Step.draft_next``), on ``draft_runtimes[0]`` and ``[1]``."""


class InjectedFault(RuntimeError):
    """A step failure injected by a test (``ModelWorker.fail_steps``)."""


@dataclass(frozen=True)
class WorkerConfig:
    model: ModelConfig | str
    """A model shape (random weights from ``seed``), a preset name, or a checkpoint directory."""
    device: str
    dtype: torch.dtype
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_blocks_per_seq: int
    """Block-table width, the scheduler's (SchedulerConfig.max_blocks_per_seq)."""
    seed: int = 0
    use_cuda_graphs: bool = True
    """False: run every graph's closure eagerly on the padded static buffers (the CPU backend, on any device)."""
    fixed_acceptance: float | None = None
    """Benchmarks only: after verification, accept a seeded number of drafts per request so that the mean
    acceptance length (tokens a verify step yields) is this value, whatever the drafter proposed. None: off."""
    fuse_decode_steps: bool = True
    """Capture each uniform-decode step whole (``dispatcher.runtime.decode_step``) where it can run so; False: every
    step op by op around the runners' graphs."""
    quantization: str | None = None
    """``"fp8"``: the weights quantized to FP8 at load (``models.fp8``); None: as the checkpoint holds them."""
    kv_cache_dtype: str = "auto"
    """``"auto"`` (the model's dtype) or ``"fp8"`` (e4m3 with per-layer scales: ``models.attention.kv_cache_dtype``)."""
    structured_outputs: bool = False
    """Steps may carry grammar bitmasks (the engine has a tokenizer): load and warm up xgrammar's kernel at
    capture, not in the first constrained step."""
    steps_in_flight: int = 2
    """Steps the engine submits at once (``EngineArgs.steps_in_flight``): a request's positions past max_model_len
    (its drafts in each) and the result buffers that take turns (``Download``)."""


class RequestState:
    """Every slot's request on the device: its tokens by position, how many are computed, its drafts, and its
    sampling parameters (with host copies of the parameters, to choose the sampler without a device read; those
    beyond temperature, top-k and top-p in ``extras``). One row more than slots, ``dummy``: no request owns it, so
    that a fused step's padded requests read and write there."""

    def __init__(self, max_num_seqs: int, max_len: int, max_drafts: int, device: torch.device, vocab_size: int):
        rows = max_num_seqs + 1
        z = lambda *shape, dt=torch.int64: torch.zeros(*shape, dtype=dt, device=device)  # noqa: E731
        self.dummy = max_num_seqs
        self.token_ids = z(rows, max_len)
        self.num_computed = z(rows)
        self.drafts = z(rows, max(max_drafts, 1))
        self.draft_conf = z(rows, max(max_drafts, 1), dt=torch.float32)
        self.temperature = z(rows, dt=torch.float32)
        self.top_k = z(rows)
        self.top_p = z(rows, dt=torch.float32)
        self.seed = z(rows)
        self.host_temperature = np.zeros(max_num_seqs, np.float64)
        self.host_top_k = np.zeros(max_num_seqs, np.int64)
        self.host_top_p = np.ones(max_num_seqs, np.float64)
        self.host_num_logprobs = np.full(max_num_seqs, -1, np.int64)
        self.host_num_prompt_logprobs = np.zeros(max_num_seqs, np.int64)
        self.extras = SamplingExtras(max_num_seqs, vocab_size, device)

    def plain_greedy(self, host_slots: np.ndarray) -> bool:
        """Every one of these slots' requests takes the argmax of its raw logits (temperature 0 and no parameter
        that changes the logits): the sampler is one argmax. From host copies only."""
        return not (self.host_temperature[host_slots] > 0).any() and not self.extras.host_processed[host_slots].any()

    def fused_sampling(self, host_slots: np.ndarray) -> bool:
        """Every one of these slots' requests draws with its temperature, seed, min_p and penalties alone (no top-k,
        no top-p, no other parameter that changes the logits): what a fused decode step samples
        (``models.sampling.sample_by_slot``). From host copies only."""
        return not (self.host_top_k[host_slots].any() or (self.host_top_p[host_slots] < 1).any()
                    or self.extras.host_masked[host_slots].any())

    def row_params(self, slots: torch.Tensor, host_slots: np.ndarray, positions: torch.Tensor, drafts,
                   tail) -> RowParams:
        """Sampling parameters of rows drawing at ``positions`` for these slots (top-k / top-p None when no row uses
        them: no sort at all; the logits' processing None when no row changes its logits). ``drafts()`` and
        ``tail(width)``: the rows' drafts before them and last tokens, when needed (``SamplingExtras.processing``)."""
        processing, min_p = self.extras.processing(slots, host_slots, positions, drafts, tail)
        if not (self.host_temperature[host_slots] > 0).any():  # the argmax of the processed logits, nothing else
            return RowParams(None, None, None, None, all_greedy=True, min_p=min_p, processing=processing)
        return RowParams(self.temperature[slots],
                         self.top_k[slots] if self.host_top_k[host_slots].any() else None,
                         self.top_p[slots] if (self.host_top_p[host_slots] < 1).any() else None,
                         self.seed[slots], min_p=min_p, processing=processing)

    def tail(self, slots: torch.Tensor, first_pos: torch.Tensor, positions: torch.Tensor,
             drafts: torch.Tensor | None, width: int) -> torch.Tensor:
        """(n, width) each row's last ``width`` tokens before its own ``positions`` (-2 before the sequence's
        start): known tokens before ``first_pos``, then the row's ``drafts`` (n, K) being verified (None: none)."""
        at = positions[:, None] - width + torch.arange(width, device=slots.device)[None, :]
        known = self.token_ids[slots[:, None], at.clamp(min=0)]
        if drafts is not None and drafts.shape[1]:
            drafted = drafts.gather(1, (at - first_pos[:, None]).clamp(0, drafts.shape[1] - 1))
            known = torch.where(at < first_pos[:, None], known, drafted)
        return torch.where(at >= 0, known, -2)


class ModelWorker:
    def __init__(self, wcfg: WorkerConfig, plan, model=None):
        """``plan``: the capture plan (its config names the speculative method and the model runners); ``model``: an
        already loaded model (else loaded from ``wcfg.model``)."""
        method, k_max = plan.config.method, plan.config.num_speculative_tokens
        self.config = plan.config
        self.wcfg = wcfg
        self.device = torch.device(wcfg.device)
        if wcfg.structured_outputs:  # (started by build_worker already, before the weights: a no-op then)
            import_xgrammar_in_background()
        if model is not None:
            self.model = model
        elif isinstance(wcfg.model, str):
            self.model = load_model(wcfg.model, self.device, wcfg.dtype, wcfg.seed, wcfg.quantization,
                                    wcfg.max_model_len)
        else:
            self.model = build_model(wcfg.model, self.device, wcfg.dtype, wcfg.seed)
        self.method, self.k_max = method, k_max
        head = self._draft_head(plan.config) if method in MODEL_DRAFTERS else None
        if isinstance(head, EagleHead) and head.shape.eagle3:
            self.model.aux_layers = head.shape.aux_layers  # the target's graphs also write the features it reads
        cfg = self.model.cfg
        kv_dtype = kv_cache_dtype(wcfg.kv_cache_dtype, wcfg.dtype)
        self.kv_caches = allocate_kv_cache(cfg.num_layers, wcfg.num_kv_blocks, wcfg.block_size, cfg.num_kv_heads,
                                           cfg.head_dim, kv_dtype, self.device)
        self.runtime = GraphRuntime(
            self.model, self.kv_caches, plan.for_runner("target"),
            max_num_tokens=wcfg.max_num_batched_tokens, max_num_reqs=wcfg.max_num_seqs,
            max_blocks_per_seq=wcfg.max_blocks_per_seq, use_cuda_graphs=wcfg.use_cuda_graphs,
        )
        self.drafter: EagleDrafter | BlockDrafter | DraftModelDrafter | NgramDrafter | None = None
        self.draft_runtimes: list[GraphRuntime] = []
        if method == "ngram":
            self.drafter = NgramDrafter(plan.config.prompt_lookup_min, plan.config.prompt_lookup_max)
        elif head is not None:
            draft_kv = allocate_kv_cache(head.cfg.num_layers, wcfg.num_kv_blocks, wcfg.block_size,
                                         head.cfg.num_kv_heads, head.cfg.head_dim, kv_dtype, self.device)
            widest = max(wcfg.max_num_batched_tokens, wcfg.max_num_seqs * (k_max + 1))
            step0_aux = head.step0_aux_size if isinstance(head, EagleHead) else None
            self.draft_runtimes = [
                GraphRuntime(head, draft_kv, plan.for_runner(r), max_num_tokens=widest, max_num_reqs=wcfg.max_num_seqs,
                             max_blocks_per_seq=wcfg.max_blocks_per_seq, runner=r, use_cuda_graphs=wcfg.use_cuda_graphs,
                             proposes=is_next_steps(r), aux_size=None if is_next_steps(r) else step0_aux,
                             block_table=self.runtime.bufs.block_table)
                for r in model_runners(plan.config)[1:]
            ]
            kind = (EagleDrafter if method in EAGLE_LIKE
                    else DraftModelDrafter if method == DRAFT_MODEL else BlockDrafter)
            self.drafter = kind(head, self.draft_runtimes, method, wcfg.block_size)
        in_flight = max(wcfg.steps_in_flight, 2)  # (as SchedulerConfig.extra_tokens counts them: two at least)
        max_len = wcfg.max_model_len + in_flight * (k_max + 1) + 2
        self.state = RequestState(wcfg.max_num_seqs, max_len, k_max, self.device, self.model.cfg.vocab_size)
        self.upload, self.download = Upload(self.device), Download(self.device, buffers=in_flight)
        self.grammar_upload = Upload(self.device, capacity=1 << 12)
        """The bitmask of a constrained step run op by op (structured outputs), uploaded apart: it is filled once
        the step's forward is queued."""
        self.grammars = WorkerGrammars(self.model.cfg.vocab_size, self.device, wcfg.max_num_seqs + 1)
        """Structured outputs' matchers (the engine's grammars): each constrained step's bitmask."""
        self.fixed_alpha = torch.zeros((), dtype=torch.float32, device=self.device)
        """Fixed acceptance's per-draft probability (a device scalar: fused graphs read it where it lies)."""
        self.fixed_acceptance_on = False
        self.set_fixed_acceptance(wcfg.fixed_acceptance)
        self.fused = FusedDecode(self, plan) if wcfg.use_cuda_graphs and wcfg.fuse_decode_steps else None
        """Uniform-decode steps captured whole (None: every step op by op)."""
        self.fail_steps: frozenset[int] = frozenset()
        """A test hook (the worker process sets it from $TWOGRID_FAIL_STEPS; empty otherwise): these steps raise
        InjectedFault after their state changes, where a failing kernel would, so that tests see what a step error
        does to the requests in it and to the rest."""
        self.jit = JitWatch() if self.device.type == "cuda" else None
        """Triton compiles while this worker serves (each step reports its own)."""
        self.capture_seconds = 0.0
        """What ``capture`` spent capturing (the graph memory estimate included; its eager warm-up left out)."""
        self.delayed: BackgroundCapture | None = None
        """Delayed capture (``start_delayed_capture``): the graphs still to capture between steps; None once every
        graph is captured (and with capture at start-up). Kept after a capture error ended it, so that steps keep
        running without the graphs it left uncaptured."""

    def set_fixed_acceptance(self, mean_length: float | None) -> None:
        """Benchmarks' fixed acceptance on or off (None: the model's own verification). It acts after the graphs,
        so the same captured engine measures real and fixed acceptance."""
        if mean_length is not None and not self.k_max:
            raise ValueError("fixed_acceptance needs speculative decoding (num_speculative_tokens > 0)")
        self.fixed_acceptance_on = mean_length is not None
        if mean_length is not None:
            self.fixed_alpha.fill_(fixed_acceptance_rate(mean_length, self.k_max))

    def _draft_head(self, cfg):
        """The drafter's model: the draft LM (draft_model); an EAGLE head from its checkpoint ("model"), else the one
        shipped for the target (the default model's EAGLE-3 head); random weights only for a preset target (its
        outputs are random too). A real target with no head is refused: a random head would accept nothing."""
        method, path = cfg.method, cfg.draft_model
        if method == DRAFT_MODEL:
            return self._draft_model(path)
        target_is_real = isinstance(self.wcfg.model, str) and self.wcfg.model not in PRESETS
        if path is None and target_is_real:
            path = shipped_head(self.wcfg.model, method)
        if path is not None:
            head = load_draft_head(path, self.model, method)
            log.info("speculative decoding: %s head %s (%s, %s features, %s vocabulary)", method, path,
                     "EAGLE-3" if head.shape.eagle3 else "EAGLE-1/2",
                     f"layer boundaries {list(head.shape.aux_layers)}" if head.shape.eagle3 else "final hidden state",
                     f"{head.shape.draft_vocab_size}-token draft" if head.shape.draft_vocab_size else "the target's")
            return head
        if target_is_real:
            need = ('--speculative-config \'{"method": "%s", "model": DIR, ...}\' (an %s head: config.json + '
                    'safetensors)' % (method, "EAGLE-3" if method == "eagle3" else "EAGLE-1/2")
                    if method in HEAD_METHODS else "a preset target (random heads, for benchmarks), or method eagle3, "
                    "eagle, ngram or draft_model")
            raise ValueError(f"{method} needs a draft head for {self.wcfg.model!r}: {need}. twogrid does not draft "
                             f"with random weights on a real model (nothing would be accepted)")
        log.warning("speculative decoding: %s head with random weights (preset target %s: benchmarks only)", method,
                    self.wcfg.model if isinstance(self.wcfg.model, str) else "shape")
        return build_draft_head(self.model, self.wcfg.seed + 1, method)

    def _draft_model(self, name: str):
        """The draft LM of method draft_model: loaded like the target; its vocabulary must be the target's."""
        draft = load_model(name, self.device, self.wcfg.dtype, self.wcfg.seed, self.wcfg.quantization)
        if draft.cfg.vocab_size != self.model.cfg.vocab_size:
            raise ValueError(f"speculative model {name!r} has a vocabulary of {draft.cfg.vocab_size} tokens, the "
                             f"target {self.model.cfg.vocab_size}: a draft model must share the target's tokenizer")
        limit = self.wcfg.max_model_len + 2 * self.k_max + 2
        if draft.cfg.max_position_embeddings < limit:
            raise ValueError(f"speculative model {name!r} holds {draft.cfg.max_position_embeddings} positions, fewer "
                             f"than max_model_len = {self.wcfg.max_model_len} plus drafts: lower max_model_len")
        return draft

    def capture(self, progress: bool = True) -> CaptureReport:
        """Capture every runner's graphs, then compile what eager steps launch (``GraphRuntime.warm_up_eager``), so
        that serving meets no Triton compile."""
        t0 = time.perf_counter()
        report = self.runtime.capture(progress=progress)
        for rt in self.draft_runtimes:
            report.kinds += rt.capture(progress=progress).kinds
        if self.fused is not None:
            report.kinds += self.fused.capture(progress=progress)
        self.capture_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        launches = sum(rt.warm_up_eager() for rt in self.runtimes) + self._warm_up_sampling()
        if self.wcfg.structured_outputs:
            launches += self.warm_up_grammar()
        if launches and self.jit is not None:
            count, _, _ = self.jit.take()
            log.info("warmed up eager steps: %d launches, %d Triton kernel variants compiled or loaded from the disk "
                     "cache, %.1f s", launches, count, time.perf_counter() - t0)
        return report

    def capture_or_delay(self, progress: bool = False, hook=None) -> CaptureReport | None:
        """``capture`` now (its report), or under ``delayed_cudagraph_capture`` ``start_delayed_capture`` (None),
        unless the configuration times its graphs at start-up (``capture_first_reason``: a warning, then
        ``capture``)."""
        refused = capture_first_reason(self.config)
        if self.config.delayed_capture and refused is None:
            self.start_delayed_capture(hook)
            return None
        if refused is not None:
            log.warning("delayed_cudagraph_capture is off: %s, so every graph is captured first", refused)
        return self.capture(progress=progress)

    def start_delayed_capture(self, hook=None) -> int:
        """Serve before capture (``delayed_cudagraph_capture``): warm the eager forwards and attention of the first
        sizes (steps and sequences of up to DELAYED_WARM_UP_MAX_TOKENS) and the samplers now, leave the wider
        warm-ups and every graph to ``capture_between_steps``. ``hook``: BackgroundCapture's test hook. Returns the
        graphs left to capture."""
        t0 = time.perf_counter()
        later: dict[int, DeferredWarmUp] = {}
        launches = self._warm_up_sampling()
        for i, rt in enumerate(self.runtimes):
            tokens, first = rt.eager_warm_up_tokens(), rt.eager_attention_shapes(DELAYED_WARM_UP_MAX_TOKENS)
            launches += rt.warm_up_eager([n for n in tokens if n <= DELAYED_WARM_UP_MAX_TOKENS], first)
            later[i] = DeferredWarmUp([n for n in tokens if n > DELAYED_WARM_UP_MAX_TOKENS],
                                      [s for s in rt.eager_attention_shapes() if s not in first])
            if rt.cuda_graphs and rt.graph_sets:
                rt.prime_capture_stream()
        if launches and self.jit is not None:
            count, _, _ = self.jit.take()
            log.info("warmed up eager steps of up to %d tokens: %d launches, %d Triton kernel variants compiled or "
                     "loaded from the disk cache, %.1f s", DELAYED_WARM_UP_MAX_TOKENS, launches, count,
                     time.perf_counter() - t0)
        self.delayed = BackgroundCapture(self, later if self.device.type == "cuda" else None, hook)
        if self.delayed.done:
            self.delayed = None
            return 0
        return sum(self.delayed.totals.values())

    def capture_between_steps(self, budget_s: float | None, stop=lambda: False) -> CaptureProgress | None:
        """Delayed capture's share of a gap between steps (``BackgroundCapture.run``): the progress when graphs were
        captured (or capture ended), else None. Called by the thread that submits steps, never during one."""
        delayed = self.delayed
        if not self.capture_pending:
            return None
        with self.jit.set_aside() if self.jit is not None else contextlib.nullcontext():  # (no step's compiles)
            if delayed is None or delayed.done:  # (what is left: the constrained steps' graphs asked for)
                self.fused.capture_demanded_constrained()
                return None
            count = delayed.run(budget_s, stop)
        if delayed.done and not delayed.error:  # (after an error its graphs left stay uncaptured: steps check)
            self.delayed = None
        return delayed.progress() if count or delayed.done else None

    @property
    def capture_pending(self) -> bool:
        """Delayed capture has graphs left to capture (not after an error ended it), or a constrained step asked for
        its two graphs (``FusedDecode.constrained_ready``)."""
        delayed = self.delayed is not None and not self.delayed.done
        return delayed or bool(self.fused and self.fused.constrained_demand)

    @torch.inference_mode()
    def _warm_up_sampling(self) -> int:
        """Compile the greedy sampler and the drafters' proposal kernel (``argmax_prob``, with and without the
        probability) on each model's logits, outside the graphs too, the greedy sampler on processed (float32)
        logits, the penalties' kernel with and without drafts, the sampler (``sample``, with and without min_p, per
        row on raw and processed logits; over the slots' tables with the penalties on raw ones, as fused steps run
        it, and reading a grammar's bitmask where fused constrained steps run: their graphs are captured between
        steps, which a compile would hold up) and the fused steps' token counting. The number of launches (0 on the
        CPU)."""
        if self.device.type != "cuda":
            return 0
        heads = [self.model] + ([self.drafter.head] if self.drafter is not None and self.drafter.head is not None
                                else [])
        for head in heads:
            hidden = torch.zeros(1, head.cfg.hidden_size, dtype=self.wcfg.dtype, device=self.device)
            for with_prob in (False, True):
                argmax_prob(head.compute_logits(hidden), with_prob=with_prob)
        st, ex = self.state, self.state.extras
        work = torch.zeros(1, ex.vocab_size + 1, dtype=torch.float32, device=self.device)
        argmax_prob(work[:, :-1], with_prob=False)
        slot, one = torch.zeros(1, dtype=torch.int64, device=self.device), torch.ones(1, device=self.device)
        for k in sorted({0, self.k_max}):
            drafts = torch.full((1, k), -1, dtype=torch.int64, device=self.device) if k else None
            penalize(work, slot, ex.output_counts, ex.prompt_seen, one * 2, one, one, drafts)
        # the sampler: per row (sample_tokens, on raw and processed logits) and over the slots' tables (fused steps)
        raw = self.model.compute_logits(torch.zeros(1, self.model.cfg.hidden_size, dtype=self.wcfg.dtype,
                                                    device=self.device))
        for logits in (raw, work[:, :-1]):
            for min_p in (None, ex.min_p):
                sample(logits, st.temperature[:1], st.seed[:1], slot, None if min_p is None else min_p[:1])
        tables = (ex.penalized, ex.penalties, ex.output_counts, ex.prompt_seen, st.drafts)
        sample(raw, st.temperature, st.seed, slot, ex.min_p, slot, 1 + self.k_max, tables)
        masking = self.fused is not None and bool(self.fused.constrained)
        if masking:  # (fused constrained steps: their buffer's row stride is what the kernel specializes on)
            sample(self.fused.logits_rows(1), st.temperature, st.seed, slot, ex.min_p, slot, 1, tables,
                   bitmask=self.fused.bitmask[:1])
        count_accepted(slot, slot[:, None], slot, ex.penalized, ex.output_counts)  # (slot 0 is not penalized)
        return 2 * len(heads) + 1 + len({0, self.k_max}) + 6 + masking

    @torch.inference_mode()
    def warm_up_grammar(self) -> int:
        """Structured outputs' bitmask kernel (xgrammar's; Triton on the GPU) loaded, and compiled for 1, 2 and 16
        rows (Triton specializes a row count on == 1 and on divisibility by 16) and both alignments of the bitmask,
        here rather than in a served step (the fused constrained steps' sampler: ``_warm_up_sampling``): by
        ``capture``, or under delayed capture in a gap between steps once xgrammar's background import is done
        (``capture._units``), so that start-up does not wait for that import.
        Without xgrammar: a warning, and constrained steps fail (the engine refuses structured requests then)."""
        try:
            import xgrammar
        except ImportError as exc:
            log.warning("structured outputs: xgrammar cannot be imported (%s): grammar bitmasks cannot be applied", exc)
            return 0
        for rows in (1, 2, 16):
            hidden = torch.zeros(rows, self.model.cfg.hidden_size, dtype=self.wcfg.dtype, device=self.device)
            logits = self.model.compute_logits(hidden)[torch.arange(rows, device=self.device)]
            words = bitmask_words(logits.shape[1])
            full = torch.full((rows * words + 2,), -1, dtype=torch.int32, device=self.device)
            for start in (0, 2):  # (the step's bitmask follows its int64 row ids in one upload: an odd count of
                # rows leaves it 8 bytes off a 16-byte boundary, which Triton specializes on)
                bits = full[start: start + rows * words].view(rows, words)
                xgrammar.apply_token_bitmask_inplace(logits, bits, vocab_size=logits.shape[1])
        return 6

    @property
    def runtimes(self) -> list[GraphRuntime]:
        return [self.runtime, *self.draft_runtimes]

    @property
    def model_config(self) -> ModelConfig:
        """The whole model's shape (a tensor-parallel rank's ``model.cfg`` is its shard's)."""
        return getattr(self.model, "full_cfg", self.model.cfg)

    @property
    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    def measure_av_curve(self) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
        """Replay times of the adaptive-verification graphs (its step-cost curve), or None without them."""
        return self.runtime.measure_step_ms(FULL_VARLEN)

    def measure_decode_costs(self) -> dict[str, dict[int, list[tuple[int, float]]]]:
        """Replay times of every runner's FULL decode graphs, {runner: {q: [(requests, ms), ...]}}: what ``"auto"``
        speculative tiers weigh (``dispatcher.plan.autotier.decode_step_costs``)."""
        costs = {rt.runner: rt.measure_decode_ms() for rt in self.runtimes}
        if self.fused is not None and self.fused.graphs and self.device.type == "cuda":
            costs[FUSED_STEP] = self.fused.measure_ms()
        return costs

    # -- a step ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def submit(self, step: Step) -> "_Pending":
        """Queue a step on the device; nothing here waits for the device. A uniform decode that a fused graph holds
        runs as one replay (``_submit_fused``), any other step op by op."""
        not_captured = None
        self.grammars.admit(step)
        ready = pack(self.grammars.ready()) if self.grammars.reading else b""
        if self.fused is not None:
            slots = unpack(step.slots)
            key = self.fused.key_for(step, slots)
            if key is not None and step.constrained and not self.fused.constrained_ready(key):
                key = None  # (op by op this time: its two graphs are captured in the next gap, on demand)
            if key is not None:
                if self.delayed is None or key in self.fused.captured:
                    return self._submit_fused(step, key, slots, ready)
                self.delayed.note(FUSED_STEP, key)
                not_captured = [FUSED_STEP]
        stand_in, timed = 0, None
        if self.delayed is not None:
            step, not_captured, stand_in, timed = self._without_uncaptured(step, not_captured or [])
        plan = _StepPlan.of(step, self.k_max)
        self._note_requests(step)
        if plan.num_sampling:
            plan.num_logprobs = int(self.state.host_num_logprobs[plan.host_sampling_slots].max())
        if len(plan.prompt_rows):
            asking = plan.slots[unpack(step.prompt_logprob_rows) > 0]
            plan.num_prompt_logprobs = int(self.state.host_num_prompt_logprobs[asking].max())
        clock = plan.clock = _Clock(self.device)  # (after the host-only work: an idle device's, not this step's)
        dev = self._upload(step, plan)
        self._apply_state_changes(step, plan, dev)
        if step.step_id in self.fail_steps:
            raise InjectedFault(f"step {step.step_id} failed on purpose ($TWOGRID_FAIL_STEPS)")
        inputs, first_pos, positions = self._target_inputs(plan, dev)
        hidden = self.runtime.execute(step.target, inputs)
        prompt_lp = self._prompt_logprobs(plan, dev, inputs, hidden) if len(plan.prompt_rows) else []
        tokens, accepted, logits = self._verify(plan, dev, hidden, first_pos, positions)
        if step.constrained:
            self.grammars.note_sampled(plan.host_sampling_slots, tokens[:, 0])
        self._advance(plan, dev, tokens, accepted, first_pos)
        drafts = bool(self.drafter is not None and step.num_new_drafts and plan.num_sampling)
        if drafts or step.draft is not None:  # (step 0 writes the drafter's KV every step: drafting.py)
            features = self.runtime.features(inputs.num_tokens) if self.model.aux_layers else hidden
            self.drafter.propose(step, plan, dev, inputs, features, tokens, accepted, first_pos, self.state)
        # The one copy back: accepted (m), tokens (m, width), [draft confidences (m, k)], [logprobs (m, width, 1 + N),
        # their ids (m, width, N)], [prompt logprobs (p, 1 + N'), their ids (p, N'), ranks (p)], all as int32 words.
        out = [accepted.to(torch.int32), tokens.to(torch.int32).flatten()]
        if drafts:
            out.append(self.state.draft_conf[dev.sampling_slots, : step.num_new_drafts].flatten().view(torch.int32))
        if plan.num_logprobs >= 0 and plan.num_sampling:
            values, ids = self._logprobs(plan, dev, logits, tokens)
            out += [values.flatten().view(torch.int32), ids.to(torch.int32).flatten()]
        out += prompt_lp
        clock.stop()
        jit = self._jit_compiles(step.step_id)
        return _Pending(step, plan, self.download.start(torch.cat(out)), clock, drafts, *jit,
                        not_captured=not_captured, grammars_ready=ready, stand_in=stand_in, timed=timed)

    def _without_uncaptured(self, step: Step, not_captured: list[str]):
        """Delayed capture: the step with each forward whose graph is not captured yet (that graph demanded first)
        set to run eagerly, or the target on a larger captured graph where a stand-in costs less
        (``StandIns.pick``); the forwards run eagerly, after ``not_captured`` (None: none); the stand-in's size (0:
        none); and what the step's time measures for the stand-ins (None: no target graph planned)."""
        planned = step.target.graph
        num_tokens = int(unpack(step.num_scheduled).sum()) if planned is not None else 0
        changes = {}
        for role, rt in zip(("target",) + DRAFT_ROLES, self.runtimes):
            desc = getattr(step, role)
            if desc is None or desc.graph is None or desc.graph in rt.captured:
                continue
            self.delayed.note(rt.runner, desc.graph)
            larger = self.delayed.stand_ins.pick(desc.graph, num_tokens) if role == "target" else 0
            if larger:
                changes[role] = padded_up(desc, larger, self.config.max_num_seqs)
            else:
                changes[role] = desc._replace(mode=MODE_EAGER, graph=None)
                not_captured.append(role)
        step = msgspec.structs.replace(step, **changes) if changes else step
        ran = step.target.graph
        stand_in = ran.size if ran is not None and ran != planned else 0
        timed = (planned, ran, num_tokens) if planned is not None else None
        return step, not_captured or None, stand_in, timed

    def _submit_fused(self, step: Step, key: FusedKey, slots: np.ndarray, ready: bytes = b"") -> "_Pending":
        """A uniform decode as one graph replay: its slots padded to the graph's requests with the dummy slot, in
        one copy with the step's state changes; the result rows copied back as they lie."""
        padded = np.full(key.target.size, self.state.dummy, np.int64)
        padded[: len(slots)] = slots
        clock = _Clock(self.device)
        dev_slots, freed, updates = self.upload(padded, unpack(step.freed_slots).astype(np.int64),
                                                unpack(step.block_updates).astype(np.int64))
        self._release_and_map(step, freed, updates)
        if step.step_id in self.fail_steps:
            raise InjectedFault(f"step {step.step_id} failed on purpose ($TWOGRID_FAIL_STEPS)")
        grammar = (lambda host: clock.idle(lambda: self.grammars.fill(slots, host))) if step.constrained else None
        self.fused.run(key, dev_slots, step.max_seq_len, slots, grammar)
        rows = self.fused.out[: len(slots)]
        if step.constrained:
            self.grammars.note_sampled(slots, rows[:, 1])
        clock.stop()
        jit = self._jit_compiles(step.step_id)
        return _Pending(step, None, self.download.start(rows.flatten()), clock, bool(key.num_new_drafts), *jit,
                        fused=True, grammars_ready=ready)

    def _collect_fused(self, pending: "_Pending") -> StepResult:
        """A fused step's result from its rows: accepted drafts, the tokens at the step width, the confidences."""
        step, width = pending.step, 1 + self.k_max
        rows = self.download.wait(pending.ticket).reshape(step.num_reqs, -1)
        conf = pack(rows[:, 1 + width : 1 + width + step.num_new_drafts].view(np.float32), F32) if pending.drafted \
            else b""
        return StepResult(step.step_id, pack(rows[:, 1 : 1 + width]), pack(rows[:, 0]), width, conf,
                          pending.clock.ms(), jit_compiles=pending.jit_compiles, jit_ms=pending.jit_ms, fused=True,
                          grammars_ready=pending.grammars_ready, bitmask_wait_ms=pending.clock.idle_ms())

    def _jit_compiles(self, step_id: int) -> tuple[int, float]:
        """Triton compiles during this step's launches (count, ms), logged with the kernels that needed them."""
        if self.jit is None or not self.jit.count:
            return 0, 0.0
        count, seconds, kernels = self.jit.take()
        log.warning("step %d waited %.2f s for %d Triton compile(s) of kernel variants not met at warm-up: %s",
                    step_id, seconds, count, "; ".join(kernels))
        return count, seconds * 1e3

    def collect(self, pending: "_Pending") -> StepResult:
        """Wait for a submitted step's result (its one synchronization) and return it."""
        if pending.fused:
            return self._collect_fused(pending)
        step, plan = pending.step, pending.plan
        flat = self.download.wait(pending.ticket)
        m, width, n, k_new = plan.num_sampling, plan.width, step.num_reqs, step.num_new_drafts
        sections = _Sections(flat)
        accepted_s = sections.take(m)
        tokens_s = sections.take(m * width).reshape(m, width)
        conf = b""
        if pending.drafted:
            conf = pack(_per_request(sections.take(m * k_new).view(np.float32).reshape(m, k_new), plan, n), F32)
        lp = lp_ids = b""
        top = max(plan.num_logprobs, 0)
        if plan.num_logprobs >= 0 and m:
            lp = pack(_per_request(sections.take(m * width * (1 + top)).view(np.float32).reshape(m, width, 1 + top),
                                   plan, n), F32)
            lp_ids = pack(_per_request(sections.take(m * width * top).reshape(m, width, top), plan, n))
        prompt = {}
        if (rows := len(plan.prompt_rows)) > 0:
            ptop = plan.num_prompt_logprobs
            prompt = dict(prompt_logprobs=sections.take(rows * (1 + ptop)).tobytes(),
                          prompt_logprob_ids=sections.take(rows * ptop).tobytes(),
                          prompt_logprob_ranks=sections.take(rows).tobytes(), num_prompt_top_logprobs=ptop)
        device_ms = pending.clock.ms()
        delayed = self.delayed  # (read once: the submitting thread sets it to None when capture ends)
        if pending.timed is not None and delayed is not None:
            delayed.stand_ins.observe(*pending.timed, device_ms)
        return StepResult(step.step_id, pack(_per_request(tokens_s, plan, n)), pack(_per_request(accepted_s, plan, n)),
                          width, conf, device_ms, lp, lp_ids, top, pending.jit_compiles, pending.jit_ms,
                          not_captured=pending.not_captured or [], grammars_ready=pending.grammars_ready,
                          bitmask_wait_ms=pending.clock.idle_ms(), stand_in=pending.stand_in, **prompt)

    def _prompt_logprobs(self, plan: "_StepPlan", dev: "_DeviceStep", inputs: StepInputs, hidden: torch.Tensor):
        """Per prompt row the step asks for (``Step.prompt_logprob_rows``): the log-probability of the prompt token
        after it (the model's distribution, as vLLM reports it), its rank (1: the most likely), then the top N and
        their ids; as int32 words for the download. In chunks of rows, so that a long prefill's rows never hold a
        (tokens x vocabulary) tensor at once."""
        rows, top = dev.prompt_rows, plan.num_prompt_logprobs
        st = self.state
        after = st.token_ids[dev.token_slot[rows], inputs.tokens[1][rows] + 1]
        values, ids, ranks = [], [], []
        for at in range(0, rows.numel(), PROMPT_LOGPROB_CHUNK_ROWS):
            part = slice(at, at + PROMPT_LOGPROB_CHUNK_ROWS)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows[part]]).float(), dim=-1)
            chosen = logprobs.gather(1, after[part, None])
            ranks.append((logprobs > chosen).sum(dim=1) + 1)
            best = torch.topk(logprobs, top, dim=-1)
            values.append(torch.cat([chosen, best.values], dim=1))
            ids.append(best.indices)
        return [torch.cat(values).flatten().view(torch.int32), torch.cat(ids).to(torch.int32).flatten(),
                torch.cat(ranks).to(torch.int32)]

    def _logprobs(self, plan: "_StepPlan", dev: "_DeviceStep", logits: torch.Tensor, tokens: torch.Tensor):
        """Per verified position: the log-probability of the token produced there (the model's distribution, before
        temperature, top-k and top-p, as vLLM reports it), then the N most likely; and those N tokens' ids."""
        m, width, top = plan.num_sampling, plan.width, max(plan.num_logprobs, 0)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        produced = tokens.flatten()[dev.verify_cells]  # the token produced at each logit row
        chosen = logprobs.gather(1, produced[:, None])
        best = torch.topk(logprobs, top, dim=-1) if top else None
        values = torch.cat([chosen, best.values], dim=1) if top else chosen
        grid = dev.grid.view(m, width)
        ids = best.indices[grid] if top else torch.zeros(m, width, 0, dtype=torch.int64, device=self.device)
        return values[grid], ids

    def execute(self, step: Step) -> StepResult:
        return self.collect(self.submit(step))

    # -- the step's columns on the device -------------------------------------------------------------------
    def _upload(self, step: Step, plan: "_StepPlan") -> "_DeviceStep":
        """Every host-side column of the step in one host-to-device copy, with the columns the host derives from
        them (``_DeviceStep``), so that the device computes none of them."""
        new = step.new_requests
        s, width = plan.sampling_rows, plan.width
        advance = plan.num_scheduled.copy()
        advance[s] -= plan.num_drafts[s]  # (a sampling request's accepted drafts are added on the device)
        drafted = np.nonzero(plan.token_draft >= 0)[0]
        cell_request, cell_index = plan.verify_cells // width, plan.verify_cells % width
        lookup = [plan.token_slot, plan.slots, plan.slots[s], plan.slots[s][cell_request]]
        columns = dict(
            lookup_slots=np.concatenate(lookup),
            lookup_offsets=np.concatenate([plan.token_offset, plan.num_scheduled, advance[s],
                                           advance[s][cell_request] + cell_index]),
            query_start=plan.query_start, logit_rows=plan.logit_rows, verify_cells=plan.verify_cells,
            grid=plan.grid.reshape(-1), advance=advance, draft_rows=drafted, draft_slots=plan.token_slot[drafted],
            draft_index=plan.token_draft[drafted], sampling_drafts=plan.num_drafts[s],
            sampling_first_row=plan.logit_rows[plan.grid[:, 0]], cell_request=cell_request, cell_index=cell_index,
            prefill_rows=plan.prefill_rows, prefill_slots=plan.slots[plan.prefill_rows],
            step0_sources=self._step0_sources(plan) if self.method in EAGLE_LIKE else np.zeros(0, np.int64),
            freed_slots=unpack(step.freed_slots).astype(np.int64),
            block_updates=unpack(step.block_updates).astype(np.int64), **_admission_columns(new))
        extras = self.state.extras.columns(new)
        cols = self.upload(*columns.values(), *extras, *([plan.prompt_rows] if len(plan.prompt_rows) else []))
        dev = dict(zip(columns, cols))
        token_slot, slots, sampling_slots, cell_slot = _Sections(dev["lookup_slots"]).split([len(x) for x in lookup])
        return _DeviceStep(**dev, token_slot=token_slot, slots=slots, sampling_slots=sampling_slots,
                           cell_slot=cell_slot, extras=cols[len(columns):len(columns) + len(extras)],
                           prompt_rows=cols[-1] if len(plan.prompt_rows) else None)

    @staticmethod
    def _step0_sources(plan: "_StepPlan") -> np.ndarray:
        """Per token row, where an EAGLE-style drafter's step 0 reads its token (the one after the row's): in
        [the target's input ids (n) | each mid-prefill request's next prompt token | the step's sampled tokens
        (m x width)]: the next row's id, but at a mid-prefill request's last row its next prompt token, and at a
        verify row the token sampled there (``EagleDrafter._step0_inputs``)."""
        n, p = len(plan.token_slot), len(plan.prefill_rows)
        sources = np.arange(1, n + 1)
        sources[plan.last_rows[plan.prefill_rows]] = n + np.arange(p)
        sources[plan.logit_rows] = n + p + plan.verify_cells
        return sources

    def _release_and_map(self, step: Step, freed_slots: torch.Tensor, block_updates: torch.Tensor) -> None:
        """Freed slots' block-table rows cleared, new KV blocks entered, in the block table every runner shares (the
        drafter's KV sits in the target's blocks)."""
        table = self.runtime.bufs.block_table
        if len(step.freed_slots):
            table.index_fill_(0, freed_slots, -1)  # (x[idx] = -1 copies -1 from the host: a sync)
        updates = block_updates.view(3, -1)
        if updates.shape[1]:
            table[updates[0], updates[1]] = updates[2].to(torch.int32)

    def _apply_state_changes(self, step: Step, plan: "_StepPlan", dev: "_DeviceStep") -> None:
        """Freed slots forgotten, new KV blocks entered, admitted requests set up."""
        st = self.state
        self._release_and_map(step, dev.freed_slots, dev.block_updates)
        if step.new_requests:
            slots, k = dev.new_slots, len(step.new_requests)
            rows, cols = dev.new_token_rows, dev.new_token_cols
            st.token_ids[rows, cols] = dev.new_tokens
            st.num_computed[slots] = dev.new_num_computed  # (its cached prefix's tokens; 0 without one)
            floats = as_f32(dev.new_floats)
            st.temperature[slots] = floats[:k]
            st.top_k[slots] = dev.new_top_k
            st.top_p[slots] = floats[k : 2 * k]
            st.seed[slots] = dev.new_seed
            st.extras.admit(dev.extras, rows, cols, dev.new_tokens)

    def _note_requests(self, step: Step) -> None:
        """The host's copies of the admitted requests' parameters."""
        st = self.state
        for r in step.new_requests:
            s = r.sampling
            st.host_temperature[r.slot], st.host_top_k[r.slot], st.host_top_p[r.slot] = s.temperature, s.top_k, s.top_p
            st.host_num_logprobs[r.slot] = s.num_logprobs
            st.host_num_prompt_logprobs[r.slot] = max(s.num_prompt_logprobs, 0)

    def _target_inputs(self, plan: "_StepPlan", dev: "_DeviceStep") -> tuple[StepInputs, torch.Tensor, torch.Tensor]:
        """The target's inputs from the request state: each request's query reads its tokens from position
        num_computed on, then its drafts. With them, from the same gather of the computed counts
        (``_DeviceStep.lookup_slots``), each sampling request's first verified position and each logit row's
        position: -> (inputs, first positions (m,), logit rows' positions)."""
        st = self.state
        counts = st.num_computed[dev.lookup_slots] + dev.lookup_offsets
        pos, seq_lens, first_pos, positions = _Sections(counts).split(
            [len(c) for c in (dev.token_slot, dev.slots, dev.sampling_slots, dev.cell_slot)])
        ids = st.token_ids[dev.token_slot, pos]
        if len(dev.draft_rows):  # (the drafts' rows read the drafts)
            ids[dev.draft_rows] = st.drafts[dev.draft_slots, dev.draft_index]
        inputs = self.runtime.inputs(ids, pos, dev.token_slot, dev.query_start, seq_lens, dev.slots,
                                     plan.max_query_len, plan.max_seq_len)
        return inputs, first_pos, positions

    # -- verification and sampling --------------------------------------------------------------------------
    def _verify(self, plan: "_StepPlan", dev: "_DeviceStep", hidden: torch.Tensor, first_pos: torch.Tensor,
                positions: torch.Tensor):
        """Per sampling request: the target's token drawn at each verified position (its argmax, or its seeded
        sample there: models.sampling), and the drafts accepted while they equal those. ``first_pos``: each
        request's first verified position; ``positions``: each logit row's (``_target_inputs``).
        -> (tokens (m, 1 + K), accepted (m,), logits)."""
        st, m, width = self.state, plan.num_sampling, plan.width
        if m == 0:
            return (torch.zeros(0, width, dtype=torch.int64, device=self.device),
                    torch.zeros(0, dtype=torch.int64, device=self.device), None)
        slots_s, nd = dev.sampling_slots, dev.sampling_drafts
        if width == 1:  # no speculative decoding: a request's one logit row, no drafts (fewer small ops: each
            # costs a CPU decode step tens of microseconds)
            return self._verify_one(plan, dev, hidden, first_pos)
        with torch.profiler.record_function("twogrid.logits"):
            logits = self.model.compute_logits(hidden[dev.logit_rows])
        self._apply_grammar_bitmask(logits, plan)
        request, rows_s = dev.cell_request, dev.cell_slot
        drafts = st.drafts[slots_s, : width - 1]
        before = lambda: torch.where(  # noqa: E731 (each row's drafts before it)
            self.runtime.iota(width - 1)[None, :] < dev.cell_index[:, None], drafts[request], -1)
        params = st.row_params(rows_s, plan.host_sampling_slots[plan.verify_cells // width], positions, before,
                               lambda w: st.tail(rows_s, first_pos[request], positions, drafts[request], w))
        tokens = sample_tokens(logits, params, positions)[dev.grid.view(m, width)]
        if self.fixed_acceptance_on:
            accepted = fixed_accepted(st.seed[slots_s], first_pos, nd, width - 1, self.fixed_alpha)
            head = tokens[:, :-1]  # (the accepted drafts stand as the tokens there; tokens is the step's own)
            torch.where(self.runtime.iota(width - 1)[None, :] < accepted[:, None], drafts, head, out=head)
        else:
            accepted = accepted_drafts(tokens, drafts, nd)
        return tokens, accepted, logits

    def _verify_one(self, plan: "_StepPlan", dev: "_DeviceStep", hidden: torch.Tensor, first_pos: torch.Tensor):
        """``_verify`` at width 1 (m > 0): logit row r is sampling request r's (the grid and the verify cells are the
        identity), its token drawn at first_pos, nothing accepted."""
        m, st, slots_s = plan.num_sampling, self.state, dev.sampling_slots
        with torch.profiler.record_function("twogrid.logits"):
            logits = self.model.compute_logits(hidden[dev.logit_rows])
        self._apply_grammar_bitmask(logits, plan)
        host_slots = plan.host_sampling_slots
        if st.plain_greedy(host_slots):  # the argmax alone (sample_tokens' greedy path, without gathering unused
            tokens = argmax_prob(logits, with_prob=False)[0]  # parameters)
        else:
            params = st.row_params(slots_s, host_slots, first_pos, lambda: None,
                                   lambda w: st.tail(slots_s, first_pos, first_pos, None, w))
            tokens = sample_tokens(logits, params, first_pos)
        return tokens.view(m, 1), self.runtime.iota(1).expand(m), logits  # (nothing accepted: zeros, a view)

    def _apply_grammar_bitmask(self, logits: torch.Tensor, plan: "_StepPlan") -> None:
        """Structured outputs: in each constrained request's logit row, the tokens its grammar forbids get -inf
        before sampling (and logprobs), by xgrammar's kernel on the device (the bitmask: ``WorkerGrammars.fill``,
        while the step's forward runs)."""
        rows = plan.grammar_logit_rows
        if not len(rows):
            return
        import xgrammar

        words = bitmask_words(logits.shape[1])
        host = torch.empty((len(rows), words), dtype=torch.int32)
        plan.clock.idle(lambda: self.grammars.fill(plan.grammar_slots, host))
        bits = host.numpy().reshape(-1)
        if bits.size % 2:  # (uploaded as int64 words: int32 pairs, in the step's one copy of the bitmask)
            bits = np.concatenate([bits, np.zeros(1, np.int32)])
        bits = bits.view(np.int64)
        dev_rows, dev_bits = self.grammar_upload(rows, bits)
        masked = logits[dev_rows]
        xgrammar.apply_token_bitmask_inplace(masked, dev_bits.view(torch.int32)[: len(rows) * words].view(-1, words),
                                             vocab_size=logits.shape[1])
        logits[dev_rows] = masked

    def _advance(self, plan: "_StepPlan", dev: "_DeviceStep", tokens, accepted, first_pos) -> None:
        """The request state after the step: new tokens stored at their positions, computed counts advanced (a
        sampling request by its known tokens and accepted drafts)."""
        st = self.state
        st.num_computed.index_add_(0, dev.slots, dev.advance)  # (a sampling request's accepted drafts below)
        if plan.num_sampling == 0:
            return
        slots_s = dev.sampling_slots
        counted = st.extras.counts_tokens(plan.host_sampling_slots)  # (the penalties' token counts)
        if plan.width == 1:  # no drafts: each request's one token stored, no count to take back
            st.token_ids.index_put_((slots_s, first_pos), tokens.view(-1))
            if counted:
                st.extras.count(slots_s, tokens.view(-1, 1), None)
            return
        st.num_computed.index_add_(0, slots_s, accepted)
        iota = self.runtime.iota(plan.width)[None, :]
        kept = torch.minimum(iota, accepted[:, None])  # (m, width): the cells past the kept ones repeat the last
        # kept one (the same token to the same place), so that nothing past it is written
        st.token_ids[slots_s[:, None].expand_as(kept), first_pos[:, None] + kept] = tokens.gather(1, kept)
        if counted:
            st.extras.count(slots_s, tokens, iota <= accepted[:, None])


@dataclass
class _Pending:
    step: Step
    plan: "_StepPlan"
    ticket: tuple
    clock: "_Clock"
    drafted: bool
    """The step's download holds draft confidences."""
    jit_compiles: int = 0
    jit_ms: float = 0.0
    fused: bool = False
    """A fused decode step (``_submit_fused``): its download is the result rows."""
    not_captured: list[str] | None = None
    """Delayed capture: the step's graphs it ran without (``StepResult.not_captured``)."""
    stand_in: int = 0
    """Delayed capture: ``StepResult.stand_in``."""
    timed: tuple | None = None
    """Delayed capture: (planned target graph, the graph it ran or None, real tokens) for ``StandIns.observe``."""
    grammars_ready: bytes = b""
    """``StepResult.grammars_ready``."""


class _Sections:
    """Consecutive sections of a flat array or tensor, taken in order (a step's download; the upload's joined
    columns): views, at less host time than a torch split."""

    def __init__(self, flat: np.ndarray | torch.Tensor):
        self.flat, self.at = flat, 0

    def take(self, size: int) -> np.ndarray | torch.Tensor:
        part = self.flat[self.at : self.at + size]
        self.at += size
        return part

    def split(self, sizes: list[int]) -> list:
        return [self.take(n) for n in sizes]


_NO_ROWS = np.zeros(0, np.int64)
_ADMISSION = ("new_slots", "new_token_rows", "new_token_cols", "new_tokens", "new_floats", "new_top_k", "new_seed",
              "new_num_computed")


def _admission_columns(new: list) -> dict[str, np.ndarray]:
    """The upload's columns that admit ``new`` requests (``_DeviceStep.new_slots`` on), all empty without any."""
    if not new:
        return dict.fromkeys(_ADMISSION, _NO_ROWS)
    tokens = [unpack(r.token_ids) for r in new]
    lens = np.asarray([len(t) for t in tokens], np.int64)
    slots = np.asarray([r.slot for r in new], np.int64)
    sp = [r.sampling for r in new]
    return dict(zip(_ADMISSION, (
        slots, np.repeat(slots, lens), np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens),
        np.concatenate(tokens).astype(np.int64), f32_words([x.temperature for x in sp] + [x.top_p for x in sp]),
        np.asarray([x.top_k for x in sp], np.int64), np.asarray([x.seed for x in sp], np.int64),
        np.asarray([r.num_computed for r in new], np.int64))))


def _per_request(values: np.ndarray, plan: "_StepPlan", n: int) -> np.ndarray:
    """Rows of the sampling requests spread over all n requests of the step (zeros for the others)."""
    full = np.zeros((n,) + values.shape[1:], values.dtype)
    full[plan.sampling_rows] = values
    return full


class _Clock:
    """A step's device time: CUDA events around its work (read once the step is done), or wall time on the CPU;
    less a wait for the host inside the step (a constrained step's bitmask, filled after its forward), which is
    idle time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.wait: tuple | None = None
        self.waited_s = 0.0
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start_s = time.perf_counter()

    def idle(self, wait):
        """``wait()``, not counted: on the GPU the time from the work queued before it to the work queued after it
        (zero when the device was still busy with the former)."""
        if not self.cuda:
            t0 = time.perf_counter()
            out = wait()
            self.waited_s += time.perf_counter() - t0
            return out
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        out = wait()
        after.record()
        self.wait = before, after
        return out

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.elapsed = (time.perf_counter() - self.start_s - self.waited_s) * 1e3

    def ms(self) -> float:
        if not self.cuda:
            return self.elapsed
        return self.start.elapsed_time(self.end) - self.idle_ms()

    def idle_ms(self) -> float:
        """The device's time idle in ``idle``'s wait (the wall time of it on the CPU)."""
        if not self.cuda:
            return self.waited_s * 1e3
        return self.wait[0].elapsed_time(self.wait[1]) if self.wait else 0.0


@dataclass
class _StepPlan:
    """A step's host-side columns, derived once from the message (numpy)."""

    slots: np.ndarray
    num_scheduled: np.ndarray
    num_drafts: np.ndarray
    token_slot: np.ndarray
    """Per token: its request's slot."""
    token_offset: np.ndarray
    """Per token: its place in its request's query."""
    token_draft: np.ndarray
    """Per token: which draft it is (-1: a known token)."""
    query_start: np.ndarray
    sampling_rows: np.ndarray
    """Rows (requests) of the step that sample."""
    prefill_rows: np.ndarray
    """Rows (requests) of the step that do not (mid-prefill)."""
    logit_rows: np.ndarray
    """Per sampling request, its verify rows (its last 1 + drafts tokens), concatenated."""
    verify_cells: np.ndarray
    """Per logit row, its cell in the (m, 1 + K) grid of sampled tokens (request * width + verify index)."""
    grid: np.ndarray
    """(m, 1 + K) indices into the logits rows: cell j of a request is its j-th verify row (its last one repeated)."""
    last_rows: np.ndarray
    """Per request, the row of its last token."""
    width: int
    max_query_len: int
    max_seq_len: int
    num_logprobs: int
    """The most logprobs a sampling request of the step asks for (-1: none asks)."""
    prompt_rows: np.ndarray
    """Token rows whose next prompt token's log-probability the step returns (``Step.prompt_logprob_rows``)."""
    num_prompt_logprobs: int = 0
    """The most top log-probabilities a request of the step asks for per prompt token."""
    step_id: int = 0
    grammar_logit_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """The logit row of each constrained request (structured outputs), in the step's bitmask order."""
    grammar_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Their slots."""
    clock: "_Clock | None" = None

    @property
    def num_sampling(self) -> int:
        return len(self.sampling_rows)

    @property
    def host_sampling_slots(self) -> np.ndarray:
        return self.slots[self.sampling_rows]

    @classmethod
    def of(cls, step: Step, k_max: int) -> "_StepPlan":
        slots = unpack(step.slots).astype(np.int64)
        sched = unpack(step.num_scheduled).astype(np.int64)
        drafts = unpack(step.num_drafts).astype(np.int64)
        samples = unpack(step.samples, np.uint8).astype(bool)
        n, total = len(slots), int(sched.sum())
        starts = np.cumsum(sched) - sched
        req = np.repeat(np.arange(n), sched)
        offset = np.arange(total) - starts[req]
        known = sched - drafts
        sampling = np.nonzero(samples)[0]
        nver = drafts[sampling] + 1
        ends = starts + sched
        first = ends[sampling] - nver
        logit_rows = np.repeat(first, nver) + (np.arange(nver.sum()) - np.repeat(np.cumsum(nver) - nver, nver))
        width = 1 + max(k_max, int(drafts.max()) if n else 0)
        grid = (np.cumsum(nver) - nver)[:, None] + np.minimum(np.arange(width)[None, :], nver[:, None] - 1)
        cells = np.repeat(np.arange(len(sampling)) * width, nver) + (logit_rows - np.repeat(first, nver))
        prompt_rows = np.zeros(0, np.int64)
        if step.prompt_logprob_rows:  # each request's first rows
            count = unpack(step.prompt_logprob_rows).astype(np.int64)
            within = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
            prompt_rows = np.repeat(starts, count) + within
        # a constrained request verifies no drafts: its one logit row is the first of its verify rows
        constrained = unpack(step.grammar_rows)
        grammar_rows = (np.cumsum(nver) - nver)[np.searchsorted(sampling, constrained)]
        return cls(slots, sched, drafts, slots[req], offset, offset - known[req],
                   np.concatenate([[0], np.cumsum(sched)]), sampling, np.nonzero(~samples)[0], logit_rows, cells,
                   grid, ends - 1, width, int(sched.max()) if n else 0, step.max_seq_len, -1, prompt_rows,
                   step_id=step.step_id, grammar_logit_rows=grammar_rows.astype(np.int64),
                   grammar_slots=slots[constrained])


@dataclass
class _DeviceStep:
    """The step's columns on the device (views of one upload, ``ModelWorker._upload``): the host's columns and what
    the host derives from them, so that the device indexes one with another nowhere."""

    lookup_slots: torch.Tensor
    """The slots whose computed counts the step reads, in one gather (``_target_inputs``): ``token_slot``, ``slots``,
    ``sampling_slots``, ``cell_slot``; ``lookup_offsets`` the offsets added to them: per token its place in its
    request's query (its position), per request its scheduled tokens (its sequence length), per sampling request its
    tokens known before the drafts (its first verified position), per logit row that plus its verify index."""
    lookup_offsets: torch.Tensor
    query_start: torch.Tensor
    logit_rows: torch.Tensor
    verify_cells: torch.Tensor
    grid: torch.Tensor
    advance: torch.Tensor
    """Per request: its computed count's increase before acceptance (scheduled tokens less drafts)."""
    draft_rows: torch.Tensor
    """The step's tokens that are drafts; their slots and which draft each is:"""
    draft_slots: torch.Tensor
    draft_index: torch.Tensor
    sampling_drafts: torch.Tensor
    """Per sampling request: its drafts and its first verify row."""
    sampling_first_row: torch.Tensor
    cell_request: torch.Tensor
    """Per logit row: its sampling request, and its index among that request's verify rows."""
    cell_index: torch.Tensor
    prefill_rows: torch.Tensor
    """The requests mid-prefill (they do not sample) and their slots."""
    prefill_slots: torch.Tensor
    step0_sources: torch.Tensor
    """Per token row, where an EAGLE-style drafter's step 0 reads its token (``ModelWorker._step0_sources``)."""
    freed_slots: torch.Tensor
    block_updates: torch.Tensor
    new_slots: torch.Tensor
    new_token_rows: torch.Tensor
    """The admitted requests' tokens' places in ``RequestState.token_ids`` (slot, position)."""
    new_token_cols: torch.Tensor
    new_tokens: torch.Tensor
    new_floats: torch.Tensor
    """The admitted requests' temperatures then top-p's (``staging.f32_words``)."""
    new_top_k: torch.Tensor
    new_seed: torch.Tensor
    new_num_computed: torch.Tensor
    token_slot: torch.Tensor
    """Views of ``lookup_slots``: per token its request's slot, per request its slot, per sampling request its slot,
    per logit row its request's slot."""
    slots: torch.Tensor
    sampling_slots: torch.Tensor
    cell_slot: torch.Tensor
    extras: list[torch.Tensor]
    """The admitted requests' ``SamplingExtras.columns`` (empty on the fast path)."""
    prompt_rows: torch.Tensor | None
    """The token rows whose next prompt token's log-probability the step returns (None: none)."""
