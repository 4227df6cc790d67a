"""Sampling and verification, vectorized over a step's rows, each row with its own parameters.

Randomness is a pure function of (request seed, token position, purpose): a counter-based hash, not a generator's
state, so a seeded request draws the same numbers alone, beside any other request, twice in one batch, or in a
CUDA graph (vLLM's Model Runner V2 samples the same way). Sampling from softmax(logits / T) is the Gumbel-max
trick: the argmax of logits / T + Gumbel noise over the tokens top-k and top-p keep.

- ``sample_tokens``: greedy rows (temperature 0) take the argmax; the others sample as above.
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

from models.fused import argmax_prob

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
    key = _mix(seeds.long() * _M1 + positions.long() * 0x632BE59BD9B4E019 + salt * 0x2545F4914F6CDD1D)
    if width is not None:
        key = key[:, None] + torch.arange(width, device=key.device, dtype=torch.int64)[None, :] * _M1
    return unit_interval(_shr(_mix(key), 40))  # 24 random bits


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
        drop |= probs.cumsum(dim=-1) - probs > top_p[:, None]  # keep the smallest prefix whose mass reaches top_p
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


@dataclass
class RowParams:
    """Per-row sampling parameters on the device, and what the host knows of them (so that choosing the sampler
    reads nothing back from the device)."""

    temperature: torch.Tensor
    """0 is greedy."""
    top_k: torch.Tensor | None
    """0: off; None when no row uses it (no sort at all)."""
    top_p: torch.Tensor | None
    """1: off; None when no row uses it."""
    seeds: torch.Tensor
    all_greedy: bool = False
    """Every row has temperature 0: the argmax, and nothing else."""


def gumbel_argmax(log_weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, salt) -> torch.Tensor:
    """A sample from softmax(log_weights) per row (-inf never drawn), keyed by (seed, position, salt)."""
    u = uniform(seeds, positions, salt, log_weights.shape[-1])
    return (log_weights - torch.log(-torch.log(u))).argmax(dim=-1)


def sample_tokens(logits: torch.Tensor, params: RowParams, positions: torch.Tensor) -> torch.Tensor:
    """logits (n, vocab) -> token ids (n,): argmax for temperature 0, else a seeded sample at ``positions``."""
    greedy = argmax_prob(logits, with_prob=False)[0]
    if params.all_greedy:
        return greedy
    scaled = apply_top_k_top_p(logits.float() / params.temperature.clamp(min=1e-6)[:, None], params.top_k,
                               params.top_p)
    drawn = gumbel_argmax(scaled, params.seeds, positions, SAMPLE)
    return torch.where(params.temperature > 0, drawn, greedy)


def accepted_drafts(target_tokens: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Drafts accepted per request: the leading ones equal to the target's token at their position (its argmax, or
    its seeded sample there). target_tokens (n, 1 + K); drafts (n, K); num_drafts (n,) -> (n,). The step yields the
    accepted drafts and the target's token after them: target_tokens[:, :accepted + 1]."""
    k = drafts.shape[1]
    if k == 0:
        return torch.zeros(target_tokens.shape[0], dtype=torch.int64, device=target_tokens.device)
    valid = torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]
    match = (target_tokens[:, :k] == drafts) & valid
    return torch.cumprod(match.long(), dim=1).sum(dim=1)


def fixed_accepted(seeds: torch.Tensor, first_pos: torch.Tensor, num_drafts: torch.Tensor, k: int,
                   alpha: torch.Tensor | float) -> torch.Tensor:
    """Benchmarks' fixed acceptance: per request, a seeded count of drafts accepted (each with probability
    ``alpha`` if the one before was, at most ``num_drafts``), whatever they are. seeds, first_pos, num_drafts (n,)
    -> (n,). ``alpha`` may be a device scalar (a captured graph reads it where it lies)."""
    arange = torch.arange(k, device=seeds.device)
    u = uniform(seeds[:, None].expand(-1, k).reshape(-1),  # (repeat_interleave would sync)
                (first_pos[:, None] + arange[None, :]).reshape(-1), FIXED_ACCEPTANCE)
    ok = (u.view(-1, k) < alpha) & (arange[None, :] < num_drafts[:, None])
    return torch.cumprod(ok.long(), dim=1).sum(dim=1)
