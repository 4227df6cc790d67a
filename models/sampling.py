"""Sampling and verification.

- ``sample``: greedy (temperature 0), or temperature with optional top-k and top-p, per row.
- ``verify_greedy``: a request's drafts are accepted while they equal the target's argmax; the step yields
  the accepted drafts plus the target's token after them.
- ``verify_rejection``: probabilistic verification (speculative sampling): draft x is accepted with probability
  min(1, p(x) / q(x)); at the first rejection a token is drawn from normalize(max(0, p - q)); if every draft
  is accepted, a bonus token is drawn from p. This keeps the output distribution equal to the target's.
"""

from __future__ import annotations

import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sampling probabilities in float32, from logits of any dtype (the model's: bf16 on the GPU)."""
    return torch.softmax(apply_top_k_top_p(logits.float() / temperature, top_k, top_p), dim=-1)


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (rows, vocab), any float dtype -> token ids (rows,): greedy reads them as they are, sampling converts
    them to float32 (``target_probs``)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = target_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def verify_greedy(target_tokens: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """target_tokens (n, 1 + K): argmax at each verified position; drafts (n, K). -> accepted drafts (n,)."""
    k = drafts.shape[1]
    if k == 0:
        return torch.zeros(target_tokens.shape[0], dtype=torch.int64, device=target_tokens.device)
    valid = torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]
    match = (target_tokens[:, :k] == drafts) & valid
    return torch.cumprod(match.long(), dim=1).sum(dim=1)


def verify_rejection(p: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, q: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """p (n, 1 + K, vocab) target probabilities; drafts (n, K); q (n, K, vocab) draft probabilities or None for
    deterministic drafters (q one-hot). -> (tokens (n, 1 + K): accepted drafts then the next token, accepted (n,))."""
    n, k = drafts.shape
    dev = p.device
    p_draft = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    u = torch.rand(n, k, device=dev, generator=generator)
    valid = torch.arange(k, device=dev)[None, :] < num_drafts[:, None]
    ok = (u * q_draft <= p_draft) & valid
    accepted = torch.cumprod(ok.long(), dim=1).sum(dim=1)
    rows = torch.arange(n, device=dev)
    p_next = p[rows, accepted]
    rejected = accepted < num_drafts
    if k:
        q_at = torch.zeros_like(p_next)
        d_at = drafts.gather(1, accepted.clamp(max=k - 1).unsqueeze(1)).squeeze(1)
        if q is None:
            q_at[rows, d_at] = 1.0
        else:
            q_at = q[rows, accepted.clamp(max=k - 1)]
        residual = (p_next - q_at).clamp(min=0)
        residual = residual / residual.sum(-1, keepdim=True).clamp(min=1e-20)
        p_next = torch.where(rejected[:, None], residual, p_next)
    nxt = torch.multinomial(p_next, 1, generator=generator).squeeze(-1)
    tokens = torch.cat([drafts, drafts.new_zeros(n, 1)], dim=1) if k else drafts.new_zeros(n, 1)
    tokens[rows, accepted] = nxt
    return tokens, accepted
