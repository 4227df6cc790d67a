"""Building blocks: RMSNorm (with fused residual add), rotary embeddings, SwiGLU MLP and a capturable MoE."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from models import fused_moe
from models.config import RopeScaling
from models.fp8 import Fp8Linear, Fp8Scheme, ScaledRows, act_mul_quant, rms_norm_quant
from models.parallel import TensorParallel
from models.fused import (moe_combine, moe_combine_add_norm, moe_route, rms_norm, rotary_torch, rotate_prepared,
                          silu_mul, use_triton)


class RMSNorm(nn.Module):
    quant_out = False
    """Its output feeds a projection held in FP8 per output channel: on the GPU the norm's kernel quantizes it per
    token (``models.fp8.rms_norm_quant``) for the projection (``CausalLM.fuse_fp8_quantization`` sets it)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor | ScaledRows, residual: torch.Tensor | None = None):
        """norm(x), or (norm(x + residual), x + residual) when a residual is given; the norm as ``QuantRows`` where
        ``quant_out`` and on the GPU. x may be an FP8 projection's ``ScaledRows``: its scales applied in the norm's
        kernel."""
        scales = None
        if isinstance(x, ScaledRows):
            x, scales = x.unit, (x.row_scale, x.col_scale)
        if self.quant_out and use_triton(x) and x.shape[0]:
            return rms_norm_quant(x, self._parameters["weight"], self.eps, residual, scales)
        return rms_norm(x, self._parameters["weight"], self.eps, residual, scales)  # (not self.weight: nn.Module's
        # attribute fallback costs a microsecond, and a CPU decode step norms 61 times)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embeddings from a precomputed cos/sin cache indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None = None,
                 freq_factors: torch.Tensor | None = None, context_len: int | None = None,
                 local: "RotaryEmbedding | None" = None):
        """``context_len``: the longest sequence served (max_model_len; default max_positions): LongRoPE's choice of
        factors. ``local``: the rotary of sliding-window layers, where it differs (Gemma 3)."""
        super().__init__()
        inv_freq, mscale = rope_frequencies(head_dim, theta, scaling, context_len or max_positions)
        if freq_factors is not None:  # a GGUF's rope_freqs tensor: llama.cpp's form of Llama 3 scaling
            inv_freq = inv_freq / freq_factors.to(torch.float64)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", (freqs.cos() * mscale).float(), persistent=False)
        self.register_buffer("sin", (freqs.sin() * mscale).float(), persistent=False)
        self.local = local

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: (tokens, heads, head_dim)."""
        return rotary_torch(positions, x, self.cos, self.sin)

    def at(self, positions: torch.Tensor) -> "RotaryRows":
        """This rotary with ``positions``' cos and sin rows looked up once, for every layer of one forward."""
        c, s = self.cos[positions], self.sin[positions]
        return RotaryRows(self.cos, self.sin, positions, torch.cat([c, c], -1)[:, None],
                          torch.cat([-s, s], -1)[:, None], self.local.at(positions) if self.local else None)


class RotaryRows(NamedTuple):
    """A RotaryEmbedding for one forward's positions: called like it (with those positions), the rows looked up
    once (as ``rotate_prepared`` takes them); ``cos`` / ``sin`` are the whole tables, as the fused GPU kernel reads
    them."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    cos_rows: torch.Tensor
    sin_rows: torch.Tensor
    local: "RotaryRows | None" = None
    """The sliding-window layers' rows, where their rotary differs."""

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if positions is not self.positions:
            return rotary_torch(positions, x, self.cos, self.sin)
        return rotate_prepared(x, self.cos_rows, self.sin_rows)

    def rotate_(self, x: torch.Tensor) -> torch.Tensor:
        """x (this forward's tokens, heads, head_dim) rotated in place, the same values as calling this."""
        return rotate_prepared(x, self.cos_rows, self.sin_rows, out=x)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                     context_len: int = 0) -> tuple[torch.Tensor, float]:
    """The rotary frequencies (head_dim / 2,) in float64, scaled as ``scaling`` says (see RopeScaling), and the
    factor cos and sin are multiplied by (YaRN's and LongRoPE's attention factor; 1 otherwise)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    kind = scaling.rope_type if scaling is not None else "default"
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if kind == "longrope":
        long = context_len > scaling.original_max_position_embeddings
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float64)
        return inv_freq / factors, scaling.attention_factor
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling), scaling.attention_factor
    # llama3: long wavelengths slowed by ``factor``, short ones kept, the band between interpolated
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * slowed / scaling.factor + smooth * slowed
    medium = (wavelen >= old_len / scaling.high_freq_factor) & (wavelen <= old_len / scaling.low_freq_factor)
    return torch.where(medium, blended, slowed), 1.0


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's frequencies (the paper's, as Hugging Face and vLLM compute them): dimensions that turn more than
    ``beta_fast`` times over the original context keep their frequency, those that turn fewer than ``beta_slow``
    times are interpolated (divided by ``factor``), with a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    return inv_freq / scaling.factor * (1 - keep) + inv_freq * keep


def linear(in_features: int, out_features: int, bias: bool, fp8: Fp8Scheme | None = None) -> nn.Module:
    """A projection: nn.Linear, or ``Fp8Linear`` scaled as ``fp8`` says."""
    if fp8 is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return Fp8Linear(in_features, out_features, bias, fp8.block, torch.get_default_dtype())


class DenseMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (GeGLU with ``act`` gelu_tanh), gate and up in one matrix."""

    def __init__(self, hidden_size: int, intermediate_size: int, fp8: Fp8Scheme | None = None, act: str = "silu",
                 tp: TensorParallel | None = None):
        """``tp``: a tensor-parallel rank's share of the intermediate columns; its partial output is all-reduced."""
        super().__init__()
        self.gate_up_proj = linear(hidden_size, 2 * intermediate_size, False, fp8)
        self.down_proj = linear(intermediate_size, hidden_size, False, fp8)
        self.act = act
        self.tp = tp

    quant_down = False
    """``down_proj`` is held in FP8 per output channel: on the GPU the activation's kernel quantizes its output per
    token (``models.fp8.act_mul_quant``; ``CausalLM.fuse_fp8_quantization`` sets it) in steps of at least
    ``ACT_QUANT_MIN_ROWS`` rows."""

    ACT_QUANT_MIN_ROWS = 512
    """On the H200 at bench-dense's width (8192), ``act_mul_quant`` (one program a row) took 5.66 us at 256 rows
    against 5.06 for the activation and the quantization as two kernels, and 17.25 against 18.8 us at 1024 rows
    (docs/bench/fp8_gemm_h200.json): fewer rows quantize in a kernel of their own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj.forward(x)  # (.forward: no hooks)
        if self.quant_down and use_triton(h) and h.shape[0] >= self.ACT_QUANT_MIN_ROWS:
            act = act_mul_quant(h, self.act)
        else:
            act = silu_mul(h, self.act)
        out = self.down_proj.forward(act)
        return out if self.tp is None else self.tp.all_reduce(out)

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm):
        """norm(self(x) + residual) -> (normed, self(x) + residual): the layer's output into the next norm."""
        return norm.forward(self.forward(x), residual)


def _grouped_mm_supported(a: torch.Tensor) -> bool:
    return hasattr(torch, "_grouped_mm") and (a.is_cuda or a.dtype == torch.float32)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """rows offs[e-1]:offs[e] of a (sorted by expert) times b[e]: one grouped GEMM, offsets on the device (no host
    synchronization). Falls back to a loop over experts (eager only) where torch has no grouped GEMM."""
    if _grouped_mm_supported(a):
        return torch._grouped_mm(a, b, offs)
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[e]
        start = end
    return out


class MoE(nn.Module):
    """Top-k routed experts (Mixtral / Qwen-MoE): softmax over the top-k router logits. Tokens are sorted by
    expert and run through two grouped GEMMs (small steps on the GPU: ``models.fused_moe``, two Triton GEMMs);
    combining is deterministic (no atomics), so replayed and eager outputs of one shape match bit for bit."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool = True, shared_intermediate_size: int = 0, fp8: Fp8Scheme | None = None,
                 tp: TensorParallel | None = None):
        """``tp``: a tensor-parallel rank's share of every expert's intermediate size (and the shared expert's); the
        partial output (routed and shared summed) is all-reduced once."""
        super().__init__()
        self.tp = tp
        self.num_experts, self.top_k, self.intermediate_size = num_experts, top_k, intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.shared_expert = DenseMLP(hidden_size, shared_intermediate_size, fp8) if shared_intermediate_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_intermediate_size else None
        # Stored as Hugging Face keeps experts (out x in); used transposed.
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def routed(self, x: torch.Tensor):
        """The routed experts before the combine: (y, inv, weights) as ``moe_combine`` takes them."""
        if fused_moe.supported(x):  # small steps on the GPU: two Triton GEMMs, SiLU in the first's epilogue
            return fused_moe.experts(x, self.gate.weight, self.w13, self.w2, self.top_k, self.norm_topk_prob)
        xs, offs, inv, weights = moe_route(x, self.gate(x), self.top_k, self.norm_topk_prob)
        h = grouped_mm(xs, self.w13.transpose(1, 2), offs)
        return grouped_mm(silu_mul(h), self.w2.transpose(1, 2), offs), inv, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = moe_combine(*self.routed(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm):
        """norm(self(x) + residual) -> (normed, self(x) + residual); without a shared expert, the combine, the add
        and the norm are one kernel on the GPU."""
        if self.shared_expert is not None or self.tp is not None:  # (tensor parallel: the sum before the norm)
            return norm(self(x), residual)
        return moe_combine_add_norm(*self.routed(x), residual, norm.weight, norm.eps)
