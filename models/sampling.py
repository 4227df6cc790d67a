"""Sampling and verification, vectorized over a step's rows, each row with its own parameters.

Randomness is a pure function of (request seed, token position, purpose): a counter-based hash, not a generator's
state, so a seeded request draws the same numbers alone, beside any other request, twice in one batch, or in a
CUDA graph (vLLM's Model Runner V2 samples the same way). Sampling from softmax(logits / T) is the Gumbel-max
trick: the argmax of logits / T + Gumbel noise over the tokens top-k and top-p keep.

- ``sample_tokens``: greedy rows (temperature 0) take the argmax; the others sample as above.
- ``verify_greedy``: a request's drafts are accepted while they equal the target's argmax; the step yields the
  accepted drafts plus the target's token after them.
- ``verify_rejection``: probabilistic verification (speculative sampling): draft x is accepted with probability
  min(1, p(x) / q(x)); at the first rejection a token is drawn from normalize(max(0, p - q)); if every draft is
  accepted, a bonus token is drawn from p. This keeps the output distribution equal to the target's.
"""

from __future__ import annotations

import torch

# Purposes of a random draw at one position (salts of the hash).
SAMPLE, ACCEPT, RESIDUAL = 1, 2, 3
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
    bits = _shr(_mix(key), 40)  # 24 random bits
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


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


class RowParams:
    """Per-row sampling parameters on the device: temperature (0 = greedy), top_k (0 = off), top_p (1 = off),
    seed. ``top_k`` / ``top_p`` are None when no row uses them (no sort at all)."""

    def __init__(self, temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                 seeds: torch.Tensor):
        self.temperature, self.top_k, self.top_p, self.seeds = temperature, top_k, top_p, seeds

    def take(self, index: torch.Tensor) -> "RowParams":
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return RowParams(self.temperature[index], pick(self.top_k), pick(self.top_p), self.seeds[index])

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """softmax(logits / T) over the tokens top-k and top-p keep, in float32; rows of temperature 0 are one-hot
        at the argmax. logits (n, vocab) or (n, m, vocab), one parameter row per n."""
        flat = logits.reshape(-1, logits.shape[-1]).float()
        per = flat.shape[0] // self.temperature.shape[0]
        rep = lambda t: None if t is None else t.repeat_interleave(per)  # noqa: E731
        temp = self.temperature.repeat_interleave(per)
        scaled = apply_top_k_top_p(flat / temp.clamp(min=1e-6)[:, None], rep(self.top_k), rep(self.top_p))
        probs = torch.softmax(scaled, dim=-1)
        greedy = torch.nn.functional.one_hot(flat.argmax(dim=-1), flat.shape[-1]).to(probs.dtype)
        return torch.where((temp == 0)[:, None], greedy, probs).view(logits.shape)


def gumbel_argmax(log_weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, salt) -> torch.Tensor:
    """A sample from softmax(log_weights) per row (-inf never drawn), keyed by (seed, position, salt)."""
    u = uniform(seeds, positions, salt, log_weights.shape[-1])
    return (log_weights - torch.log(-torch.log(u))).argmax(dim=-1)


def sample_tokens(logits: torch.Tensor, params: RowParams, positions: torch.Tensor) -> torch.Tensor:
    """logits (n, vocab) -> token ids (n,): argmax for temperature 0, else a seeded sample at ``positions``."""
    greedy = logits.argmax(dim=-1)
    if not bool((params.temperature > 0).any()):
        return greedy
    scaled = apply_top_k_top_p(logits.float() / params.temperature.clamp(min=1e-6)[:, None], params.top_k,
                               params.top_p)
    drawn = gumbel_argmax(scaled, params.seeds, positions, SAMPLE)
    return torch.where(params.temperature > 0, drawn, greedy)


def verify_greedy(target_tokens: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """target_tokens (n, 1 + K): argmax at each verified position; drafts (n, K). -> accepted drafts (n,)."""
    k = drafts.shape[1]
    if k == 0:
        return torch.zeros(target_tokens.shape[0], dtype=torch.int64, device=target_tokens.device)
    valid = torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]
    match = (target_tokens[:, :k] == drafts) & valid
    return torch.cumprod(match.long(), dim=1).sum(dim=1)


def verify_rejection(p: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, seeds: torch.Tensor,
                     first_positions: torch.Tensor, q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """p (n, 1 + K, vocab) target probabilities at the verified positions; drafts (n, K); num_drafts (n,); q (n, K,
    vocab) draft probabilities, or None for deterministic drafters (q one-hot); ``first_positions``: the position of
    each row's first verified token. -> (tokens (n, 1 + K): accepted drafts then the next token, accepted (n,))."""
    n, k = drafts.shape
    dev = p.device
    rows = torch.arange(n, device=dev)
    cols = torch.arange(k, device=dev)
    if k:
        p_draft = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        q_draft = torch.ones_like(p_draft) if q is None else q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        u = uniform(seeds.repeat_interleave(k), (first_positions[:, None] + cols[None, :]).reshape(-1), ACCEPT)
        ok = (u.view(n, k) * q_draft <= p_draft) & (cols[None, :] < num_drafts[:, None])
        accepted = torch.cumprod(ok.long(), dim=1).sum(dim=1)
    else:
        accepted = torch.zeros(n, dtype=torch.int64, device=dev)
    p_next = p[rows, accepted]
    rejected = accepted < num_drafts
    if k:
        at = accepted.clamp(max=k - 1)
        if q is None:
            q_at = torch.zeros_like(p_next)
            q_at[rows, drafts[rows, at]] = 1.0
        else:
            q_at = q[rows, at]
        residual = (p_next - q_at).clamp(min=0)
        p_next = torch.where(rejected[:, None], residual, p_next)
    # A bonus token is drawn as sample_tokens would draw it at that position; a residual one with its own salt.
    salt = torch.where(rejected, RESIDUAL, SAMPLE)
    nxt = gumbel_argmax(torch.log(p_next), seeds, first_positions + accepted, salt)
    tokens = torch.cat([drafts, drafts.new_zeros(n, 1)], dim=1)
    tokens[rows, accepted] = nxt
    return tokens, accepted
