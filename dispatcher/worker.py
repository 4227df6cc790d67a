"""The model worker: owns the model, the KV cache and the graphs of one device; turns a scheduled step and
its dispatch descriptor into sampled tokens, accepted-draft counts and next drafts (SPEC section 7)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from dispatcher.dispatch import BatchDescriptor
from dispatcher.runtime import CaptureReport, GraphRuntime
from models.attention import allocate_kv_cache
from models.config import ModelConfig
from models.drafters import NgramDrafter
from models.loader import load_model
from models.sampling import sample, target_probs, verify_greedy, verify_rejection
from models.transformer import build_model
from scheduler.scheduler import ModelResult, SchedulerOutput

log = logging.getLogger("twogrid.worker")
MODEL_DRAFTERS_PENDING = ("eagle", "eagle3", "mtp", "mtp_multi", "dspark", "dflash", "draft_model")


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
    seed: int = 0
    use_cuda_graphs: bool = True
    """False: run every graph's closure eagerly on the padded static buffers (the CPU backend, on any device)."""


class ModelWorker:
    def __init__(self, wcfg: WorkerConfig, plan, speculative_method: str | None = None, num_speculative_tokens: int = 0):
        if speculative_method in MODEL_DRAFTERS_PENDING:
            raise ValueError(f"speculative method {speculative_method!r} has no drafter in the worker yet; "
                             f"use ngram (or simulate, which models any method)")
        self.wcfg = wcfg
        self.device = torch.device(wcfg.device)
        if isinstance(wcfg.model, str):
            self.model = load_model(wcfg.model, self.device, wcfg.dtype, wcfg.seed)
        else:
            self.model = build_model(wcfg.model, self.device, wcfg.dtype, wcfg.seed)
        cfg = self.model.cfg
        self.kv_caches = allocate_kv_cache(cfg.num_layers, wcfg.num_kv_blocks, wcfg.block_size, cfg.num_kv_heads,
                                           cfg.head_dim, wcfg.dtype, self.device)
        self.max_blocks = -(-(wcfg.max_model_len + num_speculative_tokens + 1) // wcfg.block_size)
        self.block_table = np.zeros((wcfg.max_num_seqs, self.max_blocks), dtype=np.int64)
        self.runtime = GraphRuntime(
            self.model, self.kv_caches, plan.for_runner("target"),
            max_num_tokens=wcfg.max_num_batched_tokens, max_num_reqs=wcfg.max_num_seqs,
            max_blocks_per_seq=self.max_blocks, use_cuda_graphs=wcfg.use_cuda_graphs,
        )
        self.drafter = NgramDrafter(num_speculative_tokens) if speculative_method == "ngram" else None
        self.generator = torch.Generator(device=self.device).manual_seed(wcfg.seed)

    def capture(self, progress: bool = True) -> CaptureReport:
        return self.runtime.capture(progress=progress)

    # -- inputs ----------------------------------------------------------------------------------------------
    def _inputs(self, out: SchedulerOutput) -> np.ndarray:
        """(4, tokens) int64: input ids, positions, KV slots, block-table rows of every scheduled token."""
        sched, drafts, computed = out.num_scheduled, out.num_drafts, out.num_computed
        ids: list[int] = []
        for i, req in enumerate(out.requests):
            c, known = int(computed[i]), int(sched[i] - drafts[i])
            prompt_len = len(req.prompt_token_ids)
            if known == 1 and c >= prompt_len:
                ids.append(req.output_token_ids[c - prompt_len])
            elif c + known <= prompt_len:
                ids.extend(req.prompt_token_ids[c : c + known])
            else:
                ids.extend((req.prompt_token_ids + req.output_token_ids)[c : c + known])
            if drafts[i]:
                ids.extend(out.draft_tokens[i, : drafts[i]].tolist())
        total = int(sched.sum())
        starts = np.cumsum(sched) - sched
        positions = np.repeat(computed, sched) + (np.arange(total) - np.repeat(starts, sched))
        rows = np.repeat(out.slots, sched)
        bs = self.wcfg.block_size
        slots = self.block_table[rows, positions // bs] * bs + positions % bs
        return np.stack([np.asarray(ids, np.int64), positions, slots, rows])

    # -- a step ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, desc: BatchDescriptor) -> ModelResult:
        rows, cols, ids = out.block_updates
        if len(rows):
            self.block_table[rows, cols] = ids
            self.runtime.update_block_table(rows, cols, ids)
        hidden = self.runtime.execute(desc, self._inputs(out))
        return self._sample(out, hidden)

    def _sample(self, out: SchedulerOutput, hidden: torch.Tensor) -> ModelResult:
        n = len(out.slots)
        k_max = out.draft_tokens.shape[1]
        sampled = np.zeros((n, k_max + 1), dtype=np.int64)
        accepted = np.zeros(n, dtype=np.int64)
        sampling = np.nonzero(out.samples)[0]
        if len(sampling):
            ends = np.cumsum(out.num_scheduled)
            nver = out.num_drafts[sampling] + 1
            first = ends[sampling] - nver
            row_idx = np.repeat(first, nver) + (np.arange(nver.sum()) - np.repeat(np.cumsum(nver) - nver, nver))
            logits = self.model.compute_logits(hidden[torch.from_numpy(row_idx).to(hidden.device)])
            # (requests, 1 + K) grid of logits rows; unused cells point at row 0 and are ignored.
            grid = np.zeros((len(sampling), k_max + 1), dtype=np.int64)
            offs = np.cumsum(nver) - nver
            for j in range(k_max + 1):
                grid[:, j] = offs + np.minimum(j, nver - 1)
            grid_t = torch.from_numpy(grid).to(logits.device)
            drafts = torch.from_numpy(out.draft_tokens[sampling, :k_max]).to(logits.device)
            nd = torch.from_numpy(out.num_drafts[sampling]).to(logits.device)
            temps = [out.requests[i].params.temperature for i in sampling.tolist()]
            if all(t == 0.0 for t in temps):
                target = logits.argmax(dim=-1)[grid_t]
                acc = verify_greedy(target, drafts, nd)
            else:
                target, acc = self._sample_stochastic(out, sampling, logits, grid_t, drafts, nd)
            sampled[sampling] = target.cpu().numpy()
            accepted[sampling] = acc.cpu().numpy()
        draft_tokens = draft_conf = None
        if out.num_new_drafts and self.drafter is not None:
            histories = []
            for i in range(n):
                req = out.requests[i]
                new = sampled[i, : accepted[i] + 1].tolist() if out.samples[i] else []
                histories.append(req.prompt_token_ids + req.output_token_ids + new)
            draft_tokens, draft_conf = self.drafter.propose(histories, out.num_new_drafts)
        return ModelResult(sampled, accepted, draft_tokens, draft_conf)

    def _sample_stochastic(self, out, sampling, logits, grid_t, drafts, nd):
        """Per request: greedy rows verify by argmax; sampled rows by rejection sampling at their own params."""
        target = logits.argmax(dim=-1)[grid_t]
        acc = verify_greedy(target, drafts, nd)
        for r, i in enumerate(sampling.tolist()):
            p = out.requests[i].params
            if p.temperature == 0.0:
                continue
            probs = target_probs(logits[grid_t[r]], p.temperature, p.top_k, p.top_p)
            if int(nd[r]) == 0:
                target[r, 0] = sample(logits[grid_t[r, :1]], p.temperature, p.top_k, p.top_p, self.generator)[0]
                acc[r] = 0
                continue
            toks, a = verify_rejection(probs[None], drafts[r : r + 1], nd[r : r + 1], None, self.generator)
            target[r] = toks[0]
            acc[r] = a[0]
        return target, acc
