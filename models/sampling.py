"""Sampling and verification, vectorized over a step's rows, each row with its own parameters.

Randomness is a pure function of (request seed, token position, purpose): a counter-based hash, not a generator's
state, so a seeded request draws the same numbers alone, beside any other request, twice in one batch, or in a
CUDA graph (vLLM's Model Runner V2 samples the same way). Sampling from softmax(logits / T) is the Gumbel-max
trick: the argmax of logits / T + Gumbel noise over the tokens top-k and top-p keep.

- ``sample_tokens``: greedy rows (temperature 0) take the argmax; the others sample as above (on the GPU without
  top-k and top-p one kernel, ``models.fused.sample``, drawing the same tokens). Before either, the
  logits go through the rows' processing (``process_logits``, in vLLM's order: ``allowed_token_ids``,
  ``bad_words``, ``min_tokens`` and ``logit_bias``, then the repetition, frequency and presence penalties over the
  prompt and the output so far); ``min_p`` acts after the temperature, before top-k and top-p. Greedy rows take the
  argmax of the processed logits, so a request's greedy output is the same whatever its batch and its drafts.
- ``accepted_drafts``: verification. The target's token is drawn at every verified position (its argmax, or its
  seeded sample), and a request's drafts are accepted while they equal those; the step yields the accepted drafts
  and the target's token after them. For drafters that propose deterministically (every drafter here: greedy heads
  and n-gram lookup, q one-hot) this is speculative sampling exactly: a draft x is accepted with probability p(x),
  and a rejected position yields a token drawn from p without x. Because every draw is keyed by (seed, position),
  a request's output tokens do not depend on its drafts at all: not on K, the drafter, adaptive verification or
  the batch; only how many tokens a step yields does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.fused import argmax_prob, penalize, sample, use_triton

# Purposes of a random draw at one position (salts of the hash).
SAMPLE = 1
"""The token sampled at a position."""
FIXED_ACCEPTANCE = 2
"""Benchmarks' fixed-acceptance draws (dispatcher.runtime.worker)."""
_M1, _M2, _M3 = 0x9E3779B97F4A7C15 - (1 << 64), 0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64)
"""splitmix64 constants as signed int64 (torch has no uint64 arithmetic; int64 products wrap the same way)."""


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors."""
    x = (x ^ _shr(x, 30)) * _M2
    x = (x ^ _shr(x, 27)) * _M3
    return x ^ _shr(x, 31)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, salt, width: int | None = None) -> torch.Tensor:
    """Uniform floats in (0, 1), a function of (seed, position, salt[, column]) only: (n,), or (n, width) with one
    number per column (a token id). ``salt``: an int or an (n,) tensor."""
    key = _mix(_long(seeds) * _M1 + _long(positions) * 0x632BE59BD9B4E019 + salt * 0x2545F4914F6CDD1D)
    if width is not None:
        key = key[:, None] + torch.arange(width, device=key.device, dtype=torch.int64)[None, :] * _M1
    return unit_interval(_shr(_mix(key), 40))  # 24 random bits


def _long(t: torch.Tensor) -> torch.Tensor:
    """``t`` as int64 (no conversion launched when it is)."""
    return t if t.dtype == torch.int64 else t.long()


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """24 random bits as a float32 in (0, 1), 1 excluded: (bits + 0.5) / 2^24 rounds to 1.0 for the largest
    pattern (float32 holds 24 significant bits), and u = 1 makes a Gumbel draw -log(-log u) infinite: that token
    would win every draw it is in (1 in 341 draws over a 49,152-token vocabulary), or turn a masked token's -inf
    into NaN, which argmax picks."""
    return ((bits.float() + 0.5) * (1.0 / (1 << 24))).clamp_(max=1.0 - 2.0**-24)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) the tokens each row's top-k (0: off) and top-p (1: off) leave out. logits (n, vocab) float."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    if top_k is not None:
        drop |= (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # keep the smallest prefix whose mass reaches top_p; a row at 1 keeps all (its float32 sum can pass 1)
        drop |= (top_p[:, None] < 1) & (probs.cumsum(dim=-1) - probs > top_p[:, None])
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


@dataclass
class Penalties:
    """The repetition, presence and frequency penalties of a batch's rows. Token counts come from per-slot tables
    (the worker keeps them as tokens are accepted), plus the drafts each row's verification puts before it."""

    slots: torch.Tensor
    """(n,) each row's slot: its row in ``output_counts`` and ``prompt_seen``."""
    output_counts: torch.Tensor
    """(slots, vocab + 1) int32: per slot, each token's count in the request's output so far (last column: none)."""
    prompt_seen: torch.Tensor
    """(slots, vocab + 1) bool: the tokens of each slot's prompt."""
    repetition: torch.Tensor
    """(n,) 1: off. Divides positive logits of tokens in the prompt or output, multiplies negative ones."""
    presence: torch.Tensor
    """(n,) subtracted from every token present in the output (0: off)."""
    frequency: torch.Tensor
    """(n,) subtracted once per occurrence of the token in the output (0: off)."""
    drafts: torch.Tensor | None = None
    """(n, K) the drafts before each row's position (its verification's earlier ones), -1 padded; None: none."""


@dataclass
class LogitsProcessing:
    """Per-row inputs of ``process_logits``; a feature no row of the batch uses is None (no op at all). Token-id
    tables are padded with -1 (no token)."""

    positions: torch.Tensor
    """(n,) the position of the token each row draws: its context is positions 0 .. positions - 1."""
    prompt_len: torch.Tensor
    """(n,) the request's prompt length: the context from there on is its output."""
    penalties: Penalties | None = None
    tail: torch.Tensor | None = None
    """(n, P) each row's last P tokens before its position (-2 before the sequence's start); for the bad words."""
    allowed_ids: torch.Tensor | None = None
    """(n, A) the only tokens a row may draw; a row of -1 only may draw any."""
    bias_ids: torch.Tensor | None = None
    """(n, B) tokens whose logit ``bias`` is added to."""
    bias: torch.Tensor | None = None
    """(n, B) float."""
    min_len: torch.Tensor | None = None
    """(n,) prompt length + min_tokens: below it a row may not draw its ``stop_ids``."""
    stop_ids: torch.Tensor | None = None
    """(n, S) the EOS and stop token ids that ``min_tokens`` holds back."""
    bad_prefix: torch.Tensor | None = None
    """(n, W, P) each bad word's tokens but its last, right-aligned (-1 before them: any token)."""
    bad_prefix_len: torch.Tensor | None = None
    """(n, W) tokens in each bad word's prefix."""
    bad_last: torch.Tensor | None = None
    """(n, W) each bad word's last token (-1: no word); it is banned where the output ends with the prefix."""


@dataclass
class RowParams:
    """Per-row sampling parameters on the device, and what the host knows of them (so that choosing the sampler
    reads nothing back from the device)."""

    temperature: torch.Tensor | None
    """0 is greedy. None with ``all_greedy`` (as ``seeds``: the argmax reads neither)."""
    top_k: torch.Tensor | None
    """0: off; None when no row uses it (no sort at all)."""
    top_p: torch.Tensor | None
    """1: off; None when no row uses it."""
    seeds: torch.Tensor | None
    all_greedy: bool = False
    """Every row has temperature 0: the argmax, and nothing else."""
    min_p: torch.Tensor | None = None
    """(n,) 0: off; None when no row uses it. Tokens less likely than min_p times the most likely one (after the
    temperature) are left out."""
    processing: LogitsProcessing | None = None
    """The logits' processing before sampling (None: the raw logits)."""


def gumbel_argmax(log_weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, salt) -> torch.Tensor:
    """A sample from softmax(log_weights) per row (-inf never drawn), keyed by (seed, position, salt)."""
    u = uniform(seeds, positions, salt, log_weights.shape[-1])
    return (log_weights - torch.log(-torch.log(u))).argmax(dim=-1)


def sample_tokens(logits: torch.Tensor, params: RowParams, positions: torch.Tensor) -> torch.Tensor:
    """logits (n, vocab) -> token ids (n,): argmax for temperature 0, else a seeded sample at ``positions``."""
    if params.processing is not None:
        logits = process_logits(logits, params.processing)
    if params.all_greedy:
        return argmax_prob(logits, with_prob=False)[0]
    if use_triton(logits) and params.top_k is None and params.top_p is None:  # one kernel: the same tokens
        return sample(logits, params.temperature, params.seeds, positions, params.min_p)
    greedy = argmax_prob(logits, with_prob=False)[0]
    scaled = logits.float() / params.temperature.clamp(min=1e-6)[:, None]
    if params.min_p is not None:
        scaled = apply_min_p(scaled, params.min_p)
    scaled = apply_top_k_top_p(scaled, params.top_k, params.top_p)
    drawn = gumbel_argmax(scaled, params.seeds, positions, SAMPLE)
    return torch.where(params.temperature > 0, drawn, greedy)


@dataclass
class SlotPenalties:
    """The penalties' per-slot tables (``dispatcher.runtime.sampling_state.SamplingExtras``) as a fused decode step
    reads them: the flags and values have a row for every slot a step names (padding's included)."""

    penalized: torch.Tensor
    """(slots,) bool: the slot's request uses a penalty."""
    values: torch.Tensor
    """(slots, 3) float32: its repetition, presence and frequency penalties."""
    output_counts: torch.Tensor
    """(requests' slots, vocab + 1) int32, as ``Penalties.output_counts``."""
    prompt_seen: torch.Tensor
    """(requests' slots, vocab + 1) bool, as ``Penalties.prompt_seen``."""
    drafts: torch.Tensor
    """(slots, K) the drafts each slot's step verifies: row j of a slot counts its first j."""


def apply_packed_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Structured outputs: -inf in ``logits`` (rows, vocab) wherever ``bitmask`` (rows, ceil(vocab / 32)) int32,
    xgrammar's packed format (bit t % 32 of word t // 32 set allows token t), clears the token; a row of all bits set
    is left as it is: the torch path of a fused constrained step's sampling (``sample_by_slot``'s ``bitmask``;
    with Triton its kernel masks as it reads the logits) and its reference. No host synchronization (xgrammar's own
    kernel, which the op-by-op path uses, takes row indices and checks shapes on the host)."""
    vocab = torch.arange(logits.shape[1], device=logits.device)
    allowed = bitmask[:, vocab // 32]
    allowed.bitwise_right_shift_((vocab % 32).to(torch.int32)).bitwise_and_(1)
    logits.masked_fill_(allowed == 0, float("-inf"))


def sample_by_slot(logits: torch.Tensor, slots: torch.Tensor, rows_per_slot: int, positions: torch.Tensor,
                   temperature: torch.Tensor, seeds: torch.Tensor, min_p: torch.Tensor,
                   penalties: SlotPenalties | None = None, greedy_only: bool = False,
                   penalized: bool = True, bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """``sample_tokens`` with temperature, seed, min_p and the penalties alone (no top-k, top-p or other logits
    processing), the parameters read from per-slot tables (a fused decode step's sampler,
    ``dispatcher.runtime.decode_step``): row r draws with slot slots[r // rows_per_slot]'s parameters at
    positions[r], its slot's penalties (if ``penalties``) counting the slot's first r % rows_per_slot drafts. With
    Triton one kernel whatever the rows are (a captured graph serves greedy and sampled, penalized or plain batches
    alike); without, the host's knowledge skips work: ``greedy_only`` (every row greedy, none penalized) takes the
    argmax alone, ``penalized`` False (no row penalized) leaves the penalties out. ``bitmask``: a packed grammar
    bitmask row per logits row (structured outputs; ``apply_packed_bitmask``'s, on the torch path in place)."""
    if use_triton(logits):
        tables = None if penalties is None else (penalties.penalized, penalties.values, penalties.output_counts,
                                                 penalties.prompt_seen, penalties.drafts)
        return sample(logits, temperature, seeds, positions, min_p, slots, rows_per_slot, tables, bitmask=bitmask)
    if bitmask is not None:
        apply_packed_bitmask(logits, bitmask)
    if greedy_only:
        return argmax_prob(logits, with_prob=False)[0]
    rows = slots[:, None].expand(-1, rows_per_slot).reshape(-1)  # (repeat_interleave would sync)
    if penalties is not None and penalized:
        logits = _slot_penalized(logits, rows, rows_per_slot, penalties)
    return sample_tokens(logits, RowParams(temperature[rows], None, None, seeds[rows], min_p=min_p[rows]), positions)


def _slot_penalized(logits: torch.Tensor, rows: torch.Tensor, rows_per_slot: int, p: SlotPenalties) -> torch.Tensor:
    """``sample_by_slot``'s penalties on the torch path (the kernel's reference): rows of unpenalized slots get
    neutral values (padding's slot has no row in the count tables: it reads the first, to no effect)."""
    k = rows_per_slot - 1
    drafts = None
    if k:
        column = torch.arange(rows.shape[0], device=rows.device) % rows_per_slot
        drafts = torch.where(torch.arange(k, device=rows.device)[None, :] < column[:, None], p.drafts[rows, :k], -1)
    on = p.penalized[rows]
    values = torch.where(on[:, None], p.values[rows], torch.tensor([1.0, 0.0, 0.0], device=rows.device))
    count_rows = torch.where(on, rows, 0)
    work = padded_float(logits)
    apply_penalties(work, Penalties(count_rows, p.output_counts, p.prompt_seen, values[:, 0], values[:, 1],
                                    values[:, 2], drafts))
    return work[:, : logits.shape[1]]


def accepted_drafts(target_tokens: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Drafts accepted per request: the leading ones equal to the target's token at their position (its argmax, or
    its seeded sample there). target_tokens (n, 1 + K); drafts (n, K); num_drafts (n,) -> (n,). The step yields the
    accepted drafts and the target's token after them: target_tokens[:, :accepted + 1]."""
    k = drafts.shape[1]
    if k == 0:
        return torch.zeros(target_tokens.shape[0], dtype=torch.int64, device=target_tokens.device)
    leading = torch.cumprod(target_tokens[:, :k] == drafts, dim=1).sum(dim=1)  # (int64: the leading matches)
    return torch.minimum(leading, num_drafts)


def fixed_accepted(seeds: torch.Tensor, first_pos: torch.Tensor, num_drafts: torch.Tensor, k: int,
                   alpha: torch.Tensor | float) -> torch.Tensor:
    """Benchmarks' fixed acceptance: per request, a seeded count of drafts accepted (each with probability
    ``alpha`` if the one before was, at most ``num_drafts``), whatever they are. seeds, first_pos, num_drafts (n,)
    -> (n,). ``alpha`` may be a device scalar (a captured graph reads it where it lies)."""
    arange = torch.arange(k, device=seeds.device)
    u = uniform(seeds[:, None].expand(-1, k).reshape(-1),  # (repeat_interleave would sync)
                (first_pos[:, None] + arange[None, :]).reshape(-1), FIXED_ACCEPTANCE)
    return torch.minimum(torch.cumprod(u.view(-1, k) < alpha, dim=1).sum(dim=1), num_drafts)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens whose probability is below min_p times the row's largest (0: off): in logits,
    those more than -log(min_p) below the row's maximum (no softmax needed)."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


def process_logits(logits: torch.Tensor, p: LogitsProcessing) -> torch.Tensor:
    """The logits (n, vocab) as the rows' parameters make them, float32, in vLLM's order: tokens outside
    ``allowed_ids`` and bad words' last tokens masked, stop tokens masked below ``min_len``, ``bias`` added, then
    the penalties. Every table indexes one extra column, the vocabulary's size, where padding (-1) lands; it is cut
    off at the end."""
    n, vocab = logits.shape
    work = padded_float(logits)

    def col(ids: torch.Tensor) -> torch.Tensor:
        ids = ids.long()
        return torch.where(ids < 0, vocab, ids)

    if p.allowed_ids is not None:
        keep = torch.zeros(n, vocab + 1, dtype=torch.bool, device=logits.device).scatter_(1, col(p.allowed_ids), True)
        keep |= (p.allowed_ids < 0).all(dim=1, keepdim=True)
        work.masked_fill_(~keep, float("-inf"))
    if p.bad_last is not None:
        banned = bad_words_banned(p)
        work.scatter_(1, col(torch.where(banned, p.bad_last.long(), -1)), float("-inf"))
    if p.min_len is not None:
        early = (p.positions < p.min_len)[:, None]
        work.scatter_(1, col(torch.where(early, p.stop_ids.long(), -1)), float("-inf"))
    if p.bias_ids is not None:
        work.scatter_add_(1, col(p.bias_ids), p.bias.float())
    if p.penalties is not None:
        apply_penalties(work, p.penalties)
    return work[:, :vocab]


def padded_float(logits: torch.Tensor) -> torch.Tensor:
    """The logits (n, vocab) as float32 (n, vocab + 1), the last column 0: where the tables' padding (-1) lands."""
    n, vocab = logits.shape
    work = torch.empty(n, vocab + 1, dtype=torch.float32, device=logits.device)
    work[:, :vocab] = logits
    work[:, vocab] = 0.0
    return work


def apply_penalties(work: torch.Tensor, pen: Penalties) -> None:
    """vLLM's (and OpenAI's) penalties, in place on logits (n, vocab + 1) whose last column is padding: the
    repetition penalty over tokens of the prompt or the output, the frequency penalty times each token's count in
    the output, the presence penalty once per token present in the output. On the GPU one fused kernel
    (``models.fused.penalize``: one pass over the rows, the counts read from the slots' tables)."""
    if use_triton(work):
        penalize(work, pen.slots, pen.output_counts, pen.prompt_seen, pen.repetition, pen.presence, pen.frequency,
                 pen.drafts)
        return
    n, width = work.shape
    counts = pen.output_counts[pen.slots].float()
    if pen.drafts is not None:
        counts.scatter_add_(1, torch.where(pen.drafts < 0, width - 1, pen.drafts), (pen.drafts >= 0).float())
    counts[:, -1] = 0
    present = counts > 0
    scale = torch.where(present | pen.prompt_seen[pen.slots], pen.repetition.float()[:, None], 1.0)
    penalized = torch.where(work > 0, work / scale, work * scale)
    work.copy_(penalized - pen.frequency.float()[:, None] * counts - pen.presence.float()[:, None] * present)


def bad_words_banned(p: LogitsProcessing) -> torch.Tensor:
    """(n, W): the bad words whose last token a row may not draw: the row's output so far ends with the word's
    prefix (vLLM matches prefixes within the output only; a one-token word is always banned)."""
    tail = p.tail[:, p.tail.shape[1] - p.bad_prefix.shape[-1]:]
    prefix = p.bad_prefix.long()
    match = ((prefix == tail[:, None, :]) | (prefix < 0)).all(dim=-1)
    fits = p.positions[:, None] - p.bad_prefix_len >= p.prompt_len[:, None]
    return match & fits & (p.bad_last >= 0)
