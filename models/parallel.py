"""Tensor parallelism (``--tensor-parallel-size``, Megatron's split, as vLLM and nano-vllm do it): each rank holds
a shard of every layer and the ranks' partial results are summed (all-reduce) or joined (all-gather).

- Attention: the QKV projection is split by heads (column-parallel): rank r computes query heads
  ``[r H/N, (r + 1) H/N)`` and their key/value heads, and its KV cache holds only those. With fewer KV heads than
  ranks (N a multiple of them), each rank keeps the one KV head its query heads read (replicated). The output
  projection is split along its input (row-parallel); its partial outputs are all-reduced.
- MLP: gate/up split by intermediate columns, down by the same rows, one all-reduce. MoE: every expert split the
  same way by its intermediate size (the router replicated); a shared expert too; one all-reduce after the
  combine.
- Vocabulary: the embedding and the LM head are split by vocabulary rows (padded to ``VOCAB_ALIGN`` x N, so that
  every rank holds as many). An embedding lookup masks the ids outside the rank's rows and all-reduces (every row
  has one nonzero contribution: exact); the LM head's partial logits are all-gathered, so that every rank has the
  whole row and samples the same token from it (each rank runs the whole step; rank 0's result is returned).

``shard_config`` is the rank's model shape (a ModelConfig: the forward code is the same one), ``param_pieces``
the slices of each checkpoint tensor a rank reads, ``shard_model`` a rank's model cut from a full one (random
presets). Collectives are ``torch.distributed``'s: NCCL on CUDA (capturable in CUDA graphs), gloo on the CPU.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from models.config import ModelConfig

VOCAB_ALIGN = 64
"""LM head rows are padded to a multiple of this (times the tensor-parallel size)."""


class TensorParallelError(ValueError):
    """A tensor-parallel size that cannot split the model (the message names the field and both values)."""


@dataclass(frozen=True)
class TensorParallel:
    """A rank's place in its tensor-parallel group and the group's collectives."""

    rank: int
    size: int
    group: Any = None
    """The torch.distributed process group (None: the default one)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, cols) on each rank -> (rows, size * cols): rank r's columns at [r cols, (r + 1) cols)."""
        x = x.contiguous()
        out = x.new_empty(self.size * x.shape[0], x.shape[1])
        _all_gather(out, x, group=self.group)
        return out.view(self.size, x.shape[0], x.shape[1]).permute(1, 0, 2).reshape(x.shape[0], -1)


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""(torch 2.14 renamed all_gather_into_tensor.)"""


def padded_vocab(vocab_size: int, tp_size: int = 1) -> int:
    """Vocabulary rows as stored: ``vocab_size`` rounded up to a multiple of VOCAB_ALIGN x ``tp_size``."""
    align = VOCAB_ALIGN * tp_size
    return -(-vocab_size // align) * align


def kv_heads_here(cfg: ModelConfig, tp_size: int) -> int:
    """KV heads a rank holds: its share, or one (replicated) when there are fewer than ranks."""
    return max(cfg.num_kv_heads // tp_size, 1)


def check_tensor_parallel(cfg: ModelConfig, tp_size: int, what: str = "the model") -> None:
    """TensorParallelError unless ``tp_size`` splits ``cfg``: it must divide the attention heads, the MLP's (or each
    expert's, and the shared expert's) intermediate size, and the KV heads, or be a multiple of them (each rank then
    keeps one KV head, replicated)."""
    if tp_size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if tp_size == 1:
        return
    name = f"tensor_parallel_size = {tp_size}"
    if cfg.num_heads % tp_size:
        raise TensorParallelError(f"{name} does not divide {what}'s num_attention_heads = {cfg.num_heads}")
    kv = cfg.num_kv_heads
    if kv % tp_size and tp_size % kv:
        raise TensorParallelError(f"{name} neither divides {what}'s num_key_value_heads = {kv} nor is a multiple of "
                                  f"it (then each rank would keep one KV head)")
    sizes = [("moe_intermediate_size", cfg.moe_intermediate_size)] if cfg.is_moe else \
        [("intermediate_size", cfg.intermediate_size)]
    if cfg.shared_expert_intermediate_size:
        sizes.append(("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size))
    for field, size in sizes:
        if size % tp_size:
            raise TensorParallelError(f"{name} does not divide {what}'s {field} = {size}")


def shard_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """A rank's shape: its heads, KV heads and intermediate sizes (hidden size and vocabulary unchanged)."""
    check_tensor_parallel(cfg, tp_size)
    if tp_size == 1:
        return cfg
    return cfg.with_(num_heads=cfg.num_heads // tp_size, num_kv_heads=kv_heads_here(cfg, tp_size),
                     intermediate_size=cfg.intermediate_size // tp_size if not cfg.is_moe else cfg.intermediate_size,
                     moe_intermediate_size=cfg.moe_intermediate_size // tp_size,
                     shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp_size)


def vocab_rows(vocab_size: int, tp: TensorParallel | None) -> tuple[int, int, int]:
    """(first vocabulary row, rows stored, rows of the real vocabulary among them) of this rank."""
    if tp is None:
        return 0, padded_vocab(vocab_size), vocab_size
    per_rank = padded_vocab(vocab_size, tp.size) // tp.size
    start = tp.rank * per_rank
    return start, per_rank, max(0, min(per_rank, vocab_size - start))


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding vocabulary rows [start, start + rows): ids outside them look up zeros, and the ranks'
    lookups are summed (each id's row is nonzero on one rank only, so the sum is exact)."""

    def __init__(self, num_rows: int, dim: int, tp: TensorParallel):
        super().__init__(num_rows, dim)
        self.tp, self.start = tp, tp.rank * num_rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0))


def init_distributed(rank: int, size: int, init_method: str, device: torch.device) -> TensorParallel:
    """Join the group (NCCL on CUDA, gloo on the CPU) and run one all-reduce, so that the communicator exists
    before any graph is captured (NCCL creates it lazily, which a capture cannot hold)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    options = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, **options)
    tp = TensorParallel(rank, size)
    probe = torch.ones(1, device=device)
    tp.all_reduce(probe)
    if int(probe.item()) != size:
        raise RuntimeError(f"tensor parallel: the start-up all-reduce gave {probe.item()}, expected {size}")
    return tp


def check_same_plan(tp: TensorParallel, plan_dict: dict) -> str:
    """Every rank's capture plan must be the same one (the ranks capture and replay their graphs in step, each
    collective inside them matched by the others'): the plan's hash compared across ranks; RuntimeError naming
    the ranks that differ. Returns the hash."""
    digest = hashlib.sha256(json.dumps(plan_dict, sort_keys=True, default=str).encode()).hexdigest()[:16]
    if tp.size == 1:
        return digest
    hashes: list[str | None] = [None] * tp.size
    dist.all_gather_object(hashes, digest, group=tp.group)
    if len(set(hashes)) > 1:
        raise RuntimeError("tensor parallel: the ranks' capture plans differ (plan hash per rank: " +
                           ", ".join(f"rank {r} {h}" for r, h in enumerate(hashes)) +
                           "); every rank must resolve the same configuration")
    return digest


# ---------------------------------------------------------------------------------------------------------------
# Which slices of each full tensor a rank holds
# ---------------------------------------------------------------------------------------------------------------

Piece = tuple[int, int, int]
"""(dim, start, stop): a slice of a full tensor; a part's pieces are concatenated along their dim."""


def _heads(cfg: ModelConfig, tp: TensorParallel) -> tuple[tuple[int, int], tuple[int, int]]:
    """(query rows, KV rows) of this rank in a Q and a K (or V) projection."""
    d, hq = cfg.head_dim, cfg.num_heads // tp.size
    hk = kv_heads_here(cfg, tp.size)
    k0 = tp.rank * cfg.num_kv_heads // tp.size if cfg.num_kv_heads < tp.size else tp.rank * hk
    return (tp.rank * hq * d, (tp.rank + 1) * hq * d), (k0 * d, (k0 + hk) * d)


def _inter(size: int, tp: TensorParallel) -> tuple[int, int]:
    per = size // tp.size
    return tp.rank * per, (tp.rank + 1) * per


def param_pieces(ours: str, num_parts: int, cfg: ModelConfig, tp: TensorParallel) -> list[list[Piece]] | None:
    """For our parameter ``ours`` filled from ``num_parts`` checkpoint tensors (``models.checkpoint.hf_names``),
    the slices of each part this rank reads (in the full model's shape ``cfg``); None: the whole tensors
    (replicated). One part holding what is elsewhere several (a fused QKV or gate/up, stacked experts) is read
    as several pieces."""
    leaf = ours.rpartition(".")[2].split("[")[0]
    base = ours.split("[")[0]
    if base in ("embed_tokens.weight", "lm_head.weight"):
        start, _, real = vocab_rows(cfg.vocab_size, tp)
        return [[(0, start, start + real)]]
    if leaf in ("weight", "bias") and ours.rpartition(".")[0].endswith("qkv_proj"):
        (q0, q1), (k0, k1) = _heads(cfg, tp)
        if num_parts == 3:
            return [[(0, q0, q1)], [(0, k0, k1)], [(0, k0, k1)]]
        q, kv = cfg.q_size, cfg.kv_size
        return [[(0, q0, q1), (0, q + k0, q + k1), (0, q + kv + k0, q + kv + k1)]]
    if ours.endswith("o_proj.weight"):
        (q0, q1), _ = _heads(cfg, tp)
        return [[(1, q0, q1)]]
    inter = cfg.shared_expert_intermediate_size if ".shared_expert." in ours else \
        cfg.moe_intermediate_size if cfg.is_moe else cfg.intermediate_size
    i0, i1 = _inter(inter, tp)
    if ours.endswith("gate_up_proj.weight") or leaf == "w13":
        dim = 1 if ours.endswith("mlp.w13") else 0  # (the experts stacked in one tensor: Granite-MoE)
        if num_parts == 2:
            return [[(dim, i0, i1)], [(dim, i0, i1)]]
        return [[(dim, i0, i1), (dim, inter + i0, inter + i1)]]
    if ours.endswith("down_proj.weight"):
        return [[(1, i0, i1)]]
    if leaf == "w2":
        return [[(2 if ours.endswith("mlp.w2") else 1, i0, i1)]]
    return None


def take_pieces(read, pieces: list[Piece]) -> torch.Tensor:
    """A part's pieces concatenated, each read by ``read(dim, start, stop)`` (a view of a full tensor, or a slice
    read alone from a checkpoint); one piece as it was read."""
    parts = [read(dim, start, stop) for dim, start, stop in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=pieces[0][0])


@torch.no_grad()
def shard_model(full: nn.Module, local: nn.Module, tp: TensorParallel) -> nn.Module:
    """``local`` (a rank's model, built for ``tp``) set from ``full`` (the same model unsplit): each parameter the
    slices ``param_pieces`` names, as the loader would read them from a checkpoint of ``full``."""
    full_params = dict(full.named_parameters())
    for name, p in local.named_parameters():
        source = full_params[name]
        pieces = param_pieces(name, 1, full.cfg, tp)
        if pieces is None:
            p.copy_(source)
            continue
        part = take_pieces(lambda dim, start, stop: source.narrow(dim, start, stop - start), pieces[0])
        if name in ("embed_tokens.weight", "lm_head.weight"):
            p.zero_()
            p[: part.shape[0]].copy_(part)
        else:
            p.copy_(part)
    return local
