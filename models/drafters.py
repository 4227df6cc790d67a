"""Drafters that propose K tokens per request for the next step.

``NgramDrafter`` (prompt lookup): find the most recent earlier occurrence of the request's last n tokens
(n from ``max_n`` down to ``min_n``) and propose the tokens that followed it. A request always gets exactly K
proposals, so that uniform batches stay uniform; positions with no match repeat the last token with
confidence 0, which adaptive verification then leaves unverified.
"""

from __future__ import annotations

import numpy as np


class NgramDrafter:
    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 3, match_confidence: float = 0.8):
        self.k = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n
        self.match_confidence = match_confidence

    def propose_one(self, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
        arr = np.asarray(tokens, dtype=np.int64)
        length = len(arr)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = arr[length - n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
            hits = np.nonzero((windows == tail).all(axis=1))[0]
            if len(hits):
                start = int(hits[-1]) + n
                found = arr[start : start + k].tolist()
                conf = [self.match_confidence] * len(found)
                return found + [tokens[-1]] * (k - len(found)), conf + [0.0] * (k - len(found))
        return [tokens[-1]] * k, [0.0] * k

    def propose(self, histories: list[list[int]], k: int) -> tuple[np.ndarray, np.ndarray]:
        drafts = np.zeros((len(histories), k), dtype=np.int64)
        conf = np.zeros((len(histories), k), dtype=np.float64)
        for i, tokens in enumerate(histories):
            d, c = self.propose_one(tokens, k)
            drafts[i], conf[i] = d, c
        return drafts, conf


# ---------------------------------------------------------------------------------------------------------------
# Model-based drafters
# ---------------------------------------------------------------------------------------------------------------

import torch  # noqa: E402
from torch import nn  # noqa: E402

from models.transformer import CausalLM, DecoderLayer  # noqa: E402
from models.layers import RMSNorm  # noqa: E402


class DraftHead(CausalLM):
    """An EAGLE-style head: one dense decoder layer over fc(cat(token embedding, feature)), with its own KV
    cache (one layer) and the target's embedding and LM head.

    - EAGLE step 0 (eagle, eagle3, mtp): run over the target step's rows shifted by one position: the row at
      position p + 1 reads the token at p + 1 and the target's final hidden state at p. It catches the head's KV
      up to the accepted tokens, and the row of the last accepted token proposes draft 1.
    - EAGLE steps 1..K-1: one token a request, reading the previous draft and the head's own output feature.
    - Block drafting (dspark q = K, dflash and mtp_multi q = K + 1): one forward over the last accepted token and
      q - 1 mask tokens, every row reading the target's feature at the last accepted token; row i proposes draft
      i + 1. The head's KV for earlier positions is what earlier blocks wrote (a simplification of DFlash, which
      conditions on target features).
    """

    needs_aux = True

    def __init__(self, target: CausalLM):
        t = target.cfg
        cfg = t.with_(num_layers=1, num_experts=0, num_experts_per_token=0, moe_intermediate_size=0,
                      shared_expert_intermediate_size=0, intermediate_size=t.intermediate_size or 4 * t.hidden_size)
        nn.Module.__init__(self)
        cfg.validate()
        self.cfg = cfg
        self._target = [target]  # not a submodule: its weights stay the target's
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None
        self.rotary = target.rotary
        self.scale = cfg.head_dim ** -0.5
        self.mask_token_id = cfg.vocab_size - 1

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._target[0].embed_tokens

    def embed(self, input_ids: torch.Tensor, aux: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc(torch.cat([self.embed_tokens(input_ids), aux], dim=-1))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden)


def build_draft_head(target: CausalLM, seed: int) -> DraftHead:
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    with torch.device(device):
        head = DraftHead(target).to(dtype)
    return head.init_random(seed).eval().requires_grad_(False)
