"""Drafters on the device: they read the target's step from device tensors and write the drafts (and their
confidences) into the request state, with no host round trip between them.

- n-gram prompt lookup (ngram): no model; a batched search of each request's token history on the device
  (``models.drafters.propose_ngram``), right after the step's new tokens are stored.

- EAGLE-style (eagle, eagle3, mtp): step 0 runs the head over the target's rows at their positions (each row reads
  the token after it and the target's feature at it: its final hidden state, or for an EAGLE-3 head its residual
  stream at three layer boundaries, ``GraphRuntime.features``); the row of each request's last new token proposes
  draft 1. Steps 1..K-1 run one token a request, each reading the previous draft and the head's own output feature.
- Block (dspark, dflash, mtp_multi): one forward of q rows a request, its last new token then mask tokens, every row
  reading the target's feature at the last new token; row i proposes draft i + 1.
- A draft model (draft_model): the target's rows as they are (same tokens, same positions) into its own KV cache,
  on graphs mirroring the target's, then K one-token steps from the last new token, each reading the draft before it
  (FULL q = 1 graphs that propose inside them, as EAGLE's steps 1..K-1).

The drafter's KV (EAGLE-style and draft model): step 0 (the catch-up) runs on every step, whether the step drafts or
not (nothing samples in a prefill chunk; a tier may have K = 0), so every position the target computes the drafter
computes too, in the same blocks. A block shared from the prefix cache therefore holds the drafter's KV for its
prefix as well, and nothing is recomputed for it: a draft model's entry at p depends on tokens 0..p only, an
EAGLE-style head's also on token p + 1, which the block's hash carries (``scheduler.block_hash``). Entries past a
request's verified tokens (rejected drafts, the one-token steps' lookahead) are never in a cached block. A block
drafter (dspark, dflash, mtp_multi) writes its KV only at the positions it drafts from, cached prefix or not.
"""

from __future__ import annotations

import torch

from dispatcher.plan.capture_plan import block_query_len
from dispatcher.plan.dispatch import MODE_FULL
from dispatcher.runtime.graphs import StepInputs
from models.drafters import propose_ngram


class _Drafter:
    def __init__(self, head, runtimes, method: str, block_size: int):
        self.head, self.runtimes, self.method, self.block_size = head, runtimes, method, block_size
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    def _propose(self, feature: torch.Tensor, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts from the head's output rows, with the head's probability of each (its confidence), into
        ``out`` (ids, probabilities) if given."""
        with torch.profiler.record_function("twogrid.draft_logits"):
            return self.head.propose(feature, out=out)

    def _draft_buffers(self, m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(m, k) views of the drafter's buffers for a step's drafts and their confidences (allocated once), each
        draft's column contiguous: the head's proposal kernel and the graphs' proposals are copied there."""
        if self._scratch is None or self._scratch[0].shape[0] < k:
            rows = self.runtimes[0].max_num_reqs
            self._scratch = (torch.empty(k, rows, dtype=torch.int64, device=device),
                             torch.empty(k, rows, dtype=torch.float32, device=device))
        ids, conf = self._scratch
        return ids[:k, :m].t(), conf[:k, :m].t()

    @staticmethod
    def _last(dev, tokens, accepted, first_pos):
        """Per sampling request: the row of the target's output that is its last new token, that token, and its
        position."""
        last_tok = tokens.gather(1, accepted[:, None]).squeeze(1)
        return dev.sampling_first_row + accepted, last_tok, first_pos + accepted

    def _one_token_steps(self, step, plan, slots_s, token, first_pos, feature, drafts, conf, first: int) -> None:
        """Drafts ``first``..K-1 on the one-token runner (``runtimes[1]``), each reading the draft before it (the
        first reads ``token``) at positions ``first_pos``, ``first_pos`` + 1, ..., and (an EAGLE head) the previous
        step's output feature (``feature``, None for a draft LM); proposals are taken inside the graph. Every step's
        positions and KV slots are computed at once; after the first, a FULL graph has advanced its own inputs, so
        the later steps are bare replays (``execute_next``)."""
        m, n = plan.num_sampling, drafts.shape[1] - first
        rt = self.runtimes[1]
        one = rt.iota(m + 1)
        ends = (first_pos[:, None] + rt.iota(n + 1)[None, :]).t()  # (n + 1, m): step s's positions, then lengths
        pos, seq_lens = ends[:n], ends[1:]
        kv_slots = rt.kv_slots(slots_s[None, :].expand_as(pos), pos)
        for s in range(n):
            j = first + s
            if s >= 1 and step.draft_next.mode == MODE_FULL:  # the graph advanced its own inputs: replay it
                rt.execute_next(step.draft_next, m)
            else:
                tokens_s = (token if s == 0 else drafts[:, j - 1], pos[s], kv_slots[s], slots_s)
                inputs_s = StepInputs(tokens_s, one, seq_lens[s], slots_s, 1, plan.max_seq_len + s + 1)
                # (no copy of the feature: execute copies it into its aux buffer before the replay overwrites it)
                out = rt.execute(step.draft_next, inputs_s, feature)
                feature = out if feature is not None else None
            drafts[:, j], conf[:, j] = rt.proposals(m)  # (taken inside its graph)


class EagleDrafter(_Drafter):
    def propose(self, step, plan, dev, inputs, features, tokens, accepted, first_pos, state) -> None:
        k, m = step.num_new_drafts, plan.num_sampling
        out = self.runtimes[0].execute(step.draft, self._step0_inputs(plan, dev, inputs, tokens, state), features)
        if not k or not m:  # step 0 wrote the head's KV; no drafts this step
            return
        slots_s = dev.sampling_slots
        last_pos = first_pos + accepted
        feature = out[dev.sampling_first_row + accepted]  # (the row of each request's last new token)
        drafts, conf = self._draft_buffers(m, k, features.device)
        self._propose(feature, out=(drafts[:, 0], conf[:, 0]))
        if k > 1:  # draft j reads draft j - 1 at the head position of its feature, last_pos - 1 + j (_step0_inputs)
            self._one_token_steps(step, plan, slots_s, drafts[:, 0], last_pos, feature, drafts, conf, first=1)
        state.drafts[slots_s, :k] = drafts
        state.draft_conf[slots_s, :k] = conf

    def _step0_inputs(self, plan, dev, inputs, tokens, state):
        """The target's rows, each reading the token after it (a sampling request's verify rows the tokens the step
        produced there; a request mid-prefill its next prompt token) at the row's own position: the head's KV entry
        at position p holds (token p + 1, the target's feature at p), so that every position 0..p a head query
        attends to is written (SpecForge trains it so: index i pairs token i + 1 with feature i)."""
        t = inputs.tokens
        sources = [t[0], tokens.flatten()]
        if len(plan.prefill_rows):  # (a request mid-prefill reads its next prompt token, at its sequence length)
            sources.insert(1, state.token_ids[dev.prefill_slots, inputs.seq_lens[dev.prefill_rows]])
        ids_d = torch.cat(sources)[dev.step0_sources]
        # (the KV slots are the target's: the drafter's KV sits in the same blocks)
        return self.runtimes[0].inputs(ids_d, t[1], t[3], inputs.query_start, inputs.seq_lens, inputs.req_rows,
                                       inputs.max_query_len, inputs.max_seq_len, kv_slots=t[2])


class BlockDrafter(_Drafter):
    def propose(self, step, plan, dev, inputs, hidden, tokens, accepted, first_pos, state) -> None:
        k, m = step.num_new_drafts, plan.num_sampling
        q = block_query_len(self.method, k)
        slots_s = dev.sampling_slots
        last_row, last_tok, last_pos = self._last(dev, tokens, accepted, first_pos)
        ids = torch.full((m, q), self.head.mask_token_id, dtype=torch.int64, device=hidden.device)
        ids[:, 0] = last_tok
        pos = last_pos[:, None] + torch.arange(q, device=hidden.device)[None, :]
        rows = slots_s[:, None].expand(m, q).reshape(-1)  # (no repeat_interleave: it synchronizes)
        starts = torch.arange(0, m * q + 1, q, device=hidden.device)
        rt = self.runtimes[0]
        block_inputs = rt.inputs(ids.flatten(), pos.flatten(), rows, starts, last_pos + q, slots_s, q,
                                 plan.max_seq_len + q)
        aux = hidden[last_row][:, None].expand(m, q, hidden.shape[-1]).reshape(m * q, -1)
        out = rt.execute(step.draft, block_inputs, aux).view(m, q, -1)
        drafts, conf = self._propose(out[:, :k].reshape(m * k, -1))
        state.drafts[slots_s, :k] = drafts.view(m, k)
        state.draft_conf[slots_s, :k] = conf.view(m, k)


class DraftModelDrafter(_Drafter):
    def propose(self, step, plan, dev, inputs, hidden, tokens, accepted, first_pos, state) -> None:
        """The target's rows into the draft LM's KV cache (its step-0 runner, the target step's shape), then K one-token
        steps on its ``draft_model_next_steps`` runner: draft j reads draft j - 1 (draft 0 the last new token) at
        last_pos + j, proposed inside the graph (``GraphRuntime(proposes=True)``); after the first, a FULL graph
        has advanced its own inputs (``execute_next``)."""
        k, m = step.num_new_drafts, plan.num_sampling
        t = inputs.tokens
        catch_up = self.runtimes[0]
        catch_up.execute(step.draft, catch_up.inputs(t[0], t[1], t[3], inputs.query_start, inputs.seq_lens,
                                                     inputs.req_rows, inputs.max_query_len, inputs.max_seq_len,
                                                     kv_slots=t[2]))  # (its KV sits in the target's blocks)
        if not k or not m:  # the catch-up wrote the draft model's KV; no drafts this step
            return
        slots_s = dev.sampling_slots
        _, last_tok, last_pos = self._last(dev, tokens, accepted, first_pos)
        drafts, conf = self._draft_buffers(m, k, hidden.device)
        self._one_token_steps(step, plan, slots_s, last_tok, last_pos, None, drafts, conf, first=0)
        state.drafts[slots_s, :k] = drafts
        state.draft_conf[slots_s, :k] = conf


class NgramDrafter(_Drafter):
    """Prompt lookup over ``RequestState.token_ids``: each sampling request's tokens at positions 0..last_pos (the
    token just produced last), through the step's bound on their length (``plan.max_seq_len``)."""

    def __init__(self, min_n: int, max_n: int):
        super().__init__(None, [], "ngram", 0)
        self.min_n, self.max_n = min_n, max_n
        self._iota: torch.Tensor | None = None

    def propose(self, step, plan, dev, inputs, hidden, tokens, accepted, first_pos, state) -> None:
        k, slots_s = step.num_new_drafts, dev.sampling_slots
        length = min(plan.max_seq_len + 1, state.token_ids.shape[1])  # last_pos <= the step's sequence length
        history = state.token_ids[:, :length].index_select(0, slots_s)
        if self._iota is None or len(self._iota) <= max(length, self.max_n, k):  # (once: its aranges' buffer)
            self._iota = torch.arange(max(state.token_ids.shape[1], self.max_n, k) + 1, device=slots_s.device)
        drafts, conf = propose_ngram(history, first_pos + accepted, k, self.min_n, self.max_n, iota=self._iota)
        state.drafts[slots_s, :k] = drafts
        state.draft_conf[slots_s, :k] = conf
