"""The worker's per-slot state for the sampling parameters beyond temperature, top-k and top-p: ``min_p``, the
repetition, presence and frequency penalties, ``min_tokens``, ``logit_bias``, ``allowed_token_ids`` and
``bad_words`` (``models.sampling.process_logits`` applies them).

Device tables indexed by slot hold each request's values (token-id lists padded with -1 to the limits of
``scheduler.request``); host copies of what each slot uses choose, per step, which operations run at all, so that
a batch in which no request uses a parameter runs none of them. A request's tables are written once, when it is
admitted (its ``SamplingSpec`` arrives in ``NewRequest``), from one more section of the step's single upload.

The penalties count tokens in per-slot tables on the device, as vLLM's GPU model runner does: each slot's output
token counts (int32) and its prompt's tokens (bool), both (slots x vocabulary + 1), built from the request's tokens
when it is admitted (a preempted request is admitted again with all its tokens) and counted on as its tokens are
accepted; a row's verification adds the drafts before it. One fused kernel then reads a row's counts where it
reads its logits. Counting each row's history in every step instead (a scatter into a fresh rows x vocabulary
tensor, then elementwise ops) measured ~15 passes over the logits' size, about the whole budget of a bench-moe
decode step at 256 streams (3.4 ms); the tables cost memory instead: 5 bytes x slots x vocabulary (250 MB at 1024
slots and SmolLM2's 49,152 tokens; 780 MB at 152K), allocated with the worker on a GPU (so that its KV cache is
sized after them), at the first penalized request on the CPU.
"""

from __future__ import annotations

import numpy as np
import torch

from dispatcher.messages import (F32, MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_BIAS,
                                 MAX_MIN_TOKENS_STOP_IDS, NewRequest, unpack)
from dispatcher.runtime.staging import as_float
from models.sampling import LogitsProcessing, Penalties


class SamplingExtras:
    """Per-slot device tables and their host copies (see the module's docstring)."""

    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device):
        def table(*shape, fill=-1, dt=torch.int32):
            return torch.full((max_num_seqs, *shape), fill, dtype=dt, device=device)

        self.vocab_size, self.max_num_seqs, self.device = vocab_size, max_num_seqs, device
        self.output_counts: torch.Tensor | None = None
        """Per slot with penalties: each token's count in its output so far (last column: padding's)."""
        self.prompt_seen: torch.Tensor | None = None
        """Per slot with penalties: the tokens of its prompt."""
        if device.type == "cuda":  # (with the worker, so that the KV cache is sized after them; on the CPU at the
            self._count_tables()  # first penalized request: 250 MB at 1024 slots, 2.5x the default model's size)
        self.penalized = torch.zeros(max_num_seqs + 1, dtype=torch.bool, device=device)
        """The slot's request uses a penalty: its tokens are counted. (One row more, as ``min_p``'s.)"""

        self.prompt_len = table(fill=0, dt=torch.int64)
        self.min_len = table(fill=0, dt=torch.int64)
        self.min_p = torch.zeros(max_num_seqs + 1, dtype=torch.float32, device=device)
        """One row more, ``RequestState.dummy``'s (0): a fused decode step's padded rows read it."""
        self.penalties = torch.zeros(max_num_seqs + 1, 3, dtype=torch.float32, device=device)
        """Repetition, presence and frequency penalty. (One row more, as ``min_p``'s.)"""
        self.allowed_ids = table(MAX_ALLOWED_TOKEN_IDS)
        self.bias_ids = table(MAX_LOGIT_BIAS)
        self.bias = table(MAX_LOGIT_BIAS, fill=0.0, dt=torch.float32)
        self.stop_ids = table(MAX_MIN_TOKENS_STOP_IDS)
        self.bad_prefix = table(MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS - 1)
        self.bad_prefix_len = table(MAX_BAD_WORDS, fill=0, dt=torch.int64)
        self.bad_last = table(MAX_BAD_WORDS)
        n = max_num_seqs
        self.host_min_p = np.zeros(n)
        self.host_penalized = np.zeros(n, bool)
        """A repetition, presence or frequency penalty (all three are applied)."""
        self.host_min_tokens = np.zeros(n, np.int64)
        self.host_num_allowed = np.zeros(n, np.int64)
        self.host_num_bias = np.zeros(n, np.int64)
        self.host_num_stop = np.zeros(n, np.int64)
        self.host_num_bad = np.zeros(n, np.int64)
        self.host_bad_width = np.zeros(n, np.int64)
        """The longest bad-word prefix of the slot's request."""
        self.host_processed = np.zeros(n, bool)
        """The slot's request changes its logits before sampling (any table above but min_p)."""
        self.host_masked = np.zeros(n, bool)
        """The slot's request changes its logits otherwise than by penalties (allowed tokens, logit bias,
        min_tokens, bad words): what a fused decode step does not do."""
        self.host_used = np.zeros(n, bool)
        """The slot's request uses any parameter of this class (min_p included)."""
        self._shapes: tuple[int, ...] = ()
        """The table widths of the last ``columns``' admission (its ``admit`` reads them)."""
        self._counts_tokens = False
        """That admission has a penalized request (its tokens are counted)."""

    # -- admission ----------------------------------------------------------------------------------------------
    def columns(self, new: list[NewRequest]) -> list[np.ndarray]:
        """The host side of admitting ``new``: host copies set, and the upload's columns for the device tables
        (none when no new request uses a parameter and none takes a slot whose last request did: the fast path)."""
        if not new:
            return []
        specs = [r.sampling for r in new]
        slots = np.asarray([r.slot for r in new], np.int64)
        if not any(_uses(s) for s in specs) and not self.host_used[slots].any():
            return []
        lists = [[unpack(s.allowed_token_ids) for s in specs], [unpack(s.logit_bias_ids) for s in specs],
                 [unpack(s.min_tokens_stop_ids) for s in specs]]
        allowed, bias_ids, stops = (_dense(rows) for rows in lists)
        bias = _dense([unpack(s.logit_bias, F32).astype(np.float64) for s in specs], 0.0)
        words = [_bad_words(s) for s in specs]
        num_words = max(len(w) for w in words)
        width = max((len(p) for w in words for p, _ in w), default=0)
        prefix = np.full((len(new), num_words, width), -1, np.int64)
        prefix_len = np.zeros((len(new), num_words), np.int64)
        last = np.full((len(new), num_words), -1, np.int64)
        for i, w in enumerate(words):
            for j, (pre, tok) in enumerate(w):
                prefix[i, j, width - len(pre):] = pre
                prefix_len[i, j], last[i, j] = len(pre), tok
        prompt = np.asarray([r.num_prompt_tokens for r in new], np.int64)
        min_tokens = np.asarray([s.min_tokens for s in specs], np.int64)
        h = self
        h.host_min_p[slots] = [s.min_p for s in specs]
        h.host_penalized[slots] = [_penalizes(s) for s in specs]
        h.host_min_tokens[slots] = min_tokens
        h.host_num_allowed[slots], h.host_num_bias[slots] = [len(x) for x in lists[0]], [len(x) for x in lists[1]]
        h.host_num_stop[slots] = [len(x) for x in lists[2]]
        h.host_num_bad[slots], h.host_bad_width[slots] = [len(w) for w in words], prefix_len.max(1, initial=0)
        h.host_processed[slots] = [_processes(s) for s in specs]
        h.host_masked[slots] = [_masks(s) for s in specs]
        h.host_used[slots] = h.host_processed[slots] | (h.host_min_p[slots] > 0)
        self._shapes = (allowed.shape[1], bias_ids.shape[1], stops.shape[1], num_words, width)
        self._counts_tokens = bool(h.host_penalized[slots].any())
        return [slots, prompt, np.where(min_tokens > 0, prompt + min_tokens, 0),
                np.asarray([s.min_p for s in specs], np.float64),
                np.asarray([[s.repetition_penalty, s.presence_penalty, s.frequency_penalty] for s in specs],
                           np.float64).reshape(-1),
                allowed.reshape(-1), bias_ids.reshape(-1), bias.reshape(-1), stops.reshape(-1), prefix.reshape(-1),
                prefix_len.reshape(-1), last.reshape(-1)]

    def admit(self, cols: list[torch.Tensor], token_rows: torch.Tensor, token_cols: torch.Tensor,
              tokens: torch.Tensor) -> None:
        """The device side: the admitted slots' tables reset and written (``cols``: ``columns``' on the device), and
        their token counts from their tokens (``tokens`` at (``token_rows``, ``token_cols``): slot, position)."""
        if not cols:
            return
        slots, prompt, min_len, min_p, penalties, allowed, bias_ids, bias, stops, prefix, prefix_len, last = cols
        n = slots.numel()
        num_allowed, num_bias, num_stop, num_words, width = self._shapes
        self.prompt_len[slots] = prompt
        self.min_len[slots] = min_len
        self.min_p[slots] = as_float(min_p)
        self.penalties[slots] = as_float(penalties).view(n, 3)
        values = self.penalties[slots]
        self.penalized[slots] = (values[:, 0] != 1.0) | (values[:, 1] != 0.0) | (values[:, 2] != 0.0)
        if self._counts_tokens:
            self._count_admitted(slots, token_rows, token_cols, tokens)
        for table, block, cols_used in ((self.allowed_ids, allowed, num_allowed), (self.bias_ids, bias_ids, num_bias),
                                        (self.stop_ids, stops, num_stop), (self.bad_last, last, num_words)):
            table.index_fill_(0, slots, -1)
            table[slots, :cols_used] = block.view(n, cols_used).to(table.dtype)
        self.bias[slots, :num_bias] = as_float(bias).view(n, num_bias)
        self.bad_prefix_len[slots, :num_words] = prefix_len.view(n, num_words)
        self.bad_prefix.index_fill_(0, slots, -1)
        p = self.bad_prefix.shape[-1]
        self.bad_prefix[slots, :num_words, p - width:] = prefix.view(n, num_words, width).to(torch.int32)

    def _count_tables(self) -> None:
        shape = (self.max_num_seqs, self.vocab_size + 1)
        self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.prompt_seen = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def _count_admitted(self, slots, token_rows, token_cols, tokens) -> None:
        """The admitted penalized slots' counts from their tokens: the prompt's into ``prompt_seen``, the output's
        into ``output_counts`` (other tokens land in the padding column)."""
        if self.output_counts is None:
            self._count_tables()
        pad = self.vocab_size
        self.output_counts.index_fill_(0, slots, 0)
        self.prompt_seen.index_fill_(0, slots, False)
        counted = self.penalized[token_rows]
        in_prompt = token_cols < self.prompt_len[token_rows]
        self.prompt_seen[token_rows, torch.where(counted & in_prompt, tokens, pad)] = True
        out = counted & ~in_prompt
        self.output_counts.index_put_((token_rows, torch.where(out, tokens, pad)), out.to(torch.int32),
                                      accumulate=True)

    def counts_tokens(self, host_slots: np.ndarray) -> bool:
        """Some slot among these counts its tokens (a step's accepted tokens go to ``count``)."""
        return bool(self.host_penalized[host_slots].any())

    def count(self, slots: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor | None) -> None:
        """A step's new tokens (m, width), those ``keep`` marks (None: all), into the counts of the penalized
        slots among ``slots`` (m,)."""
        take = self.penalized[slots][:, None].expand_as(tokens)
        if keep is not None:
            take = take & keep
        rows = slots[:, None].expand_as(tokens)
        self.output_counts.index_put_((rows, torch.where(take, tokens, self.vocab_size)), take.to(torch.int32),
                                      accumulate=True)

    # -- a step -------------------------------------------------------------------------------------------------
    def processing(self, slots: torch.Tensor, host_slots: np.ndarray, positions: torch.Tensor,
                   drafts, tail) -> tuple[LogitsProcessing | None, torch.Tensor | None]:
        """The rows' ``LogitsProcessing`` (None when no row changes its logits) and ``min_p`` (None when no row uses
        it). ``slots``: each row's slot (``host_slots`` the same on the host); ``positions``: the position each
        row draws; ``drafts()``: the drafts before each row's position (n, K), -1 padded, or None without drafts;
        ``tail(width)``: each row's last ``width`` tokens (``RequestState.tail``). Both are called only when
        needed (penalties, bad words)."""
        min_p = self.min_p[slots] if (self.host_min_p[host_slots] > 0).any() else None
        if not self.host_processed[host_slots].any():
            return None, min_p
        h = self
        p = LogitsProcessing(positions, self.prompt_len[slots])
        if h.host_penalized[host_slots].any():
            values = self.penalties[slots]
            p.penalties = Penalties(slots, self.output_counts, self.prompt_seen, values[:, 0], values[:, 1],
                                    values[:, 2], drafts())
        if (num := int(h.host_num_allowed[host_slots].max())) > 0:
            p.allowed_ids = self.allowed_ids[slots, :num]
        if (num := int(h.host_num_bias[host_slots].max())) > 0:
            p.bias_ids, p.bias = self.bias_ids[slots, :num], self.bias[slots, :num]
        if (h.host_min_tokens[host_slots] > 0).any():
            num = int(h.host_num_stop[host_slots].max())
            p.min_len, p.stop_ids = self.min_len[slots], self.stop_ids[slots, :num]
        if (num := int(h.host_num_bad[host_slots].max())) > 0:
            width = int(h.host_bad_width[host_slots].max())
            full = self.bad_prefix.shape[-1]
            p.bad_prefix = self.bad_prefix[slots, :num, full - width:]
            p.bad_prefix_len, p.bad_last = self.bad_prefix_len[slots, :num], self.bad_last[slots, :num]
            p.tail = tail(width)
        return p, min_p


def _uses(s) -> bool:
    return s.min_p > 0 or _processes(s)


def _penalizes(s) -> bool:
    return s.repetition_penalty != 1 or s.presence_penalty != 0 or s.frequency_penalty != 0


def _processes(s) -> bool:
    """The spec changes the logits before sampling."""
    return _penalizes(s) or _masks(s)


def _masks(s) -> bool:
    """The spec changes the logits otherwise than by penalties."""
    return s.min_tokens > 0 or bool(s.allowed_token_ids) or bool(s.logit_bias_ids) or bool(s.bad_words)


def _dense(rows: list[np.ndarray], fill=-1) -> np.ndarray:
    """Rows of different lengths as one (n, longest) array padded with ``fill``."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), fill, np.float64 if isinstance(fill, float) else np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _bad_words(spec) -> list[tuple[np.ndarray, int]]:
    """A spec's bad words as (prefix, last token) pairs."""
    tokens, lens = unpack(spec.bad_words), unpack(spec.bad_word_lens)
    ends = np.cumsum(lens)
    return [(tokens[end - n:end - 1], int(tokens[end - 1])) for n, end in zip(lens.tolist(), ends.tolist())]
