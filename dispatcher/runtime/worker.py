"""The model worker: owns the model, the KV cache and the graphs of one device; turns a scheduled step and
its dispatch descriptor into sampled tokens, accepted-draft counts and next drafts (SPEC section 7)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dispatcher.plan.dispatch import BatchDescriptor, StepDescriptors
from dispatcher.plan.capture_plan import BLOCK_DRAFTERS, EAGLE_LIKE, block_query_len
from dispatcher.runtime.graphs import CaptureReport, GraphRuntime
from models.attention import allocate_kv_cache
from models.config import ModelConfig
from models.drafters import NgramDrafter, build_draft_head
from models.loader import load_model
from models.sampling import sample, target_probs, verify_greedy, verify_rejection
from models.transformer import build_model
from scheduler.scheduler import ModelResult, SchedulerOutput

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


class ModelWorker:
    def __init__(self, wcfg: WorkerConfig, plan, speculative_method: str | None = None, num_speculative_tokens: int = 0):
        if speculative_method == "draft_model":
            raise ValueError("speculative method 'draft_model' (a separate draft LM) has no drafter in the worker yet; "
                             "use ngram, an EAGLE-style method or a block drafter (or simulate, which models any method)")
        self.wcfg = wcfg
        self.device = torch.device(wcfg.device)
        if isinstance(wcfg.model, str):
            self.model = load_model(wcfg.model, self.device, wcfg.dtype, wcfg.seed)
        else:
            self.model = build_model(wcfg.model, self.device, wcfg.dtype, wcfg.seed)
        cfg = self.model.cfg
        self.kv_caches = allocate_kv_cache(cfg.num_layers, wcfg.num_kv_blocks, wcfg.block_size, cfg.num_kv_heads,
                                           cfg.head_dim, wcfg.dtype, self.device)
        self.max_blocks = wcfg.max_blocks_per_seq
        self.block_table = np.zeros((wcfg.max_num_seqs, self.max_blocks), dtype=np.int64)
        self.runtime = GraphRuntime(
            self.model, self.kv_caches, plan.for_runner("target"),
            max_num_tokens=wcfg.max_num_batched_tokens, max_num_reqs=wcfg.max_num_seqs,
            max_blocks_per_seq=self.max_blocks, use_cuda_graphs=wcfg.use_cuda_graphs,
        )
        self.method = speculative_method
        self.drafter = NgramDrafter(num_speculative_tokens) if speculative_method == "ngram" else None
        self.draft_runtimes: list[GraphRuntime] = []
        if speculative_method in EAGLE_LIKE + BLOCK_DRAFTERS:
            self.draft_head = build_draft_head(self.model, wcfg.seed + 1)
            self.draft_kv = allocate_kv_cache(1, wcfg.num_kv_blocks, wcfg.block_size, cfg.num_kv_heads, cfg.head_dim,
                                              wcfg.dtype, self.device)
            widest = max(wcfg.max_num_batched_tokens, wcfg.max_num_seqs * (num_speculative_tokens + 1))
            runners = [speculative_method] + ([f"{speculative_method}_next_steps"]
                                              if speculative_method in EAGLE_LIKE else [])
            self.draft_runtimes = [
                GraphRuntime(self.draft_head, self.draft_kv, plan.for_runner(r), max_num_tokens=widest,
                             max_num_reqs=wcfg.max_num_seqs, max_blocks_per_seq=self.max_blocks, runner=r,
                             use_cuda_graphs=wcfg.use_cuda_graphs)
                for r in runners
            ]
        self.generator = torch.Generator(device=self.device).manual_seed(wcfg.seed)

    def capture(self, progress: bool = True) -> CaptureReport:
        report = self.runtime.capture(progress=progress)
        for rt in self.draft_runtimes:
            report.kinds += rt.capture(progress=progress).kinds
        return report

    # -- inputs ----------------------------------------------------------------------------------------------
    def _inputs(self, out: SchedulerOutput) -> np.ndarray:
        """(4, tokens) int64: input ids, positions, KV slots, block-table rows of every scheduled token."""
        sched, drafts, computed = out.num_scheduled, out.num_drafts, out.num_computed
        if out.shape.is_decode:  # every request: its last sampled token, then its drafts
            grid = np.empty((len(sched), out.draft_tokens.shape[1] + 1), dtype=np.int64)
            grid[:, 0] = [req.output_token_ids[-1] for req in out.requests]
            grid[:, 1:] = out.draft_tokens
            ids = grid[np.arange(grid.shape[1])[None, :] < sched[:, None]]
            return self._with_positions(out, ids)
        ids: list[int] = []
        for i, req in enumerate(out.requests):
            c, known = int(computed[i]), int(sched[i] - drafts[i])
            prompt_len = len(req.prompt_token_ids)
            if known == 1 and c >= prompt_len:
                ids.append(req.output_token_ids[c - prompt_len])
            elif c + known <= prompt_len:
                ids.extend(req.prompt_token_ids[c : c + known])
            else:
                ids.extend(req.all_token_ids[c : c + known])
            if drafts[i]:
                ids.extend(out.draft_tokens[i, : drafts[i]].tolist())
        return self._with_positions(out, np.asarray(ids, np.int64))

    def _with_positions(self, out: SchedulerOutput, ids: np.ndarray) -> np.ndarray:
        sched, computed = out.num_scheduled, out.num_computed
        total = int(sched.sum())
        starts = np.cumsum(sched) - sched
        positions = np.repeat(computed, sched) + (np.arange(total) - np.repeat(starts, sched))
        rows = np.repeat(out.slots, sched)
        bs = self.wcfg.block_size
        slots = self.block_table[rows, positions // bs] * bs + positions % bs
        return np.stack([ids, positions, slots, rows])

    # -- a step ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, descs: StepDescriptors | BatchDescriptor) -> ModelResult:
        if isinstance(descs, BatchDescriptor):
            descs = StepDescriptors(descs)
        rows, cols, ids = out.block_updates
        if len(rows):
            self.block_table[rows, cols] = ids
            for rt in [self.runtime, *self.draft_runtimes]:
                rt.update_block_table(rows, cols, ids)
        host = self._inputs(out)
        hidden = self.runtime.execute(descs.target, host)
        result = self._sample(out, hidden)
        if self.draft_runtimes and descs.draft is not None and out.num_new_drafts and out.samples.any():
            self._draft(out, descs, host, hidden, result)
        return result

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
                histories.append(req.all_token_ids + new)
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

    # -- model-based drafting ----------------------------------------------------------------------------
    def _slots_of(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        bs = self.wcfg.block_size
        return self.block_table[rows, positions // bs] * bs + positions % bs

    def _propose(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts from the head's output rows, with the head's probability of each (its confidence; the
        softmax in float32 over the model-dtype logits)."""
        probs = torch.softmax(self.draft_head.compute_logits(hidden), dim=-1, dtype=torch.float32)
        conf, tokens = probs.max(dim=-1)
        return tokens, conf

    def _draft(self, out: SchedulerOutput, descs: StepDescriptors, host: np.ndarray, hidden: torch.Tensor,
               result: ModelResult) -> None:
        """Drafts for the next step of every sampling request, into ``result``."""
        k = out.num_new_drafts
        sampling = np.nonzero(out.samples)[0]
        n_s = len(sampling)
        ends = np.cumsum(out.num_scheduled)
        first = out.first_sample_positions
        accepted = result.num_accepted[sampling]
        last_pos = first[sampling] + accepted  # position of the last new token
        last_tok = result.sampled[sampling, accepted]
        nver = out.num_drafts + 1
        # Each request's row whose target output is its last new token (the verify row of its accepted count).
        last_row = torch.from_numpy(ends[sampling] - nver[sampling] + accepted).to(self.device)
        drafts = torch.zeros(n_s, k, dtype=torch.int64, device=self.device)
        conf = torch.zeros(n_s, k, dtype=torch.float32, device=self.device)
        if self.method in EAGLE_LIKE:
            # Step 0: the target's rows, one position on; sampling requests' verify rows read the sampled tokens.
            ids, positions, _, rows = host
            ids_d = np.empty_like(ids)
            ids_d[:-1] = ids[1:]
            for i, e in enumerate(ends.tolist()):
                if out.samples[i]:
                    ids_d[e - nver[i] : e] = result.sampled[i, : nver[i]]
                else:  # mid-prefill: the next prompt token
                    req = out.requests[i]
                    nxt = int(out.num_computed[i] + out.num_scheduled[i])
                    ids_d[e - 1] = req.all_token_ids[nxt]
            pos_d = positions + 1
            host_d = np.stack([ids_d, pos_d, self._slots_of(rows, pos_d), rows])
            h0 = self.draft_runtimes[0].execute(descs.draft, host_d, hidden)
            feature = h0[last_row]
            tokens, c = self._propose(feature)
            drafts[:, 0], conf[:, 0] = tokens, c
            srows = out.slots[sampling]
            for j in range(1, k):
                pos = last_pos + j
                host_j = np.stack([drafts[:, j - 1].cpu().numpy(), pos, self._slots_of(srows, pos), srows])
                feature = self.draft_runtimes[1].execute(descs.draft_next, host_j, feature).clone()
                tokens, c = self._propose(feature)
                drafts[:, j], conf[:, j] = tokens, c
        else:
            # Block: the last new token then mask tokens, all reading the target's feature at the last token.
            q = block_query_len(self.method, k)
            aux = hidden[last_row].repeat_interleave(q, dim=0)
            ids_b = np.full((n_s, q), self.draft_head.mask_token_id, dtype=np.int64)
            ids_b[:, 0] = last_tok
            pos_b = (last_pos[:, None] + np.arange(q)[None, :]).ravel()
            rows_b = np.repeat(out.slots[sampling], q)
            host_b = np.stack([ids_b.ravel(), pos_b, self._slots_of(rows_b, pos_b), rows_b])
            hb = self.draft_runtimes[0].execute(descs.draft, host_b, aux).view(n_s, q, -1)
            tokens, c = self._propose(hb[:, :k].reshape(n_s * k, -1))
            drafts[:], conf[:] = tokens.view(n_s, k), c.view(n_s, k)
        full = np.zeros((len(out.slots), k), dtype=np.int64)
        full_conf = np.zeros((len(out.slots), k), dtype=np.float64)
        full[sampling] = drafts.cpu().numpy()
        full_conf[sampling] = conf.cpu().numpy()
        result.draft_tokens, result.draft_confidences = full, full_conf

