"""4-bit weights kept 4-bit on the CPU: a GGUF's Q4_0 and Q4_1 projections served by torch's int4 CPU GEMM.

A 4-bit GGUF dequantized to bfloat16 is four times its size in memory, and a one-request decode step on a CPU is
bound by reading the weights: SmolLM2-135M's projections take about 26 ms a token in bfloat16 on a 2-core AVX2
CPU, about 11 ms kept 4-bit (llama.cpp serves them 4-bit too). Both formats are groups of 32 values
``scale * code + offset`` with a 4-bit code: Q4_1 stores scale ``d`` and offset ``m`` (fp16) per group, Q4_0 scale
``d`` with the codes centred on 8. torch's int4 layout computes ``(code - 8) * scale + zero`` per group, so a
group's ``zero`` is ``m + 8 d`` (Q4_1) or 0 (Q4_0): the same weights, with the scales rounded to the activations'
dtype (bfloat16: 8 bits of mantissa, where the bfloat16 dequantization rounds every weight instead).
"""

from __future__ import annotations

import torch
from torch import nn

GROUP_SIZE = 32
"""Values a GGUF Q4_0 / Q4_1 block holds, one scale and zero each: the int4 GEMM's group size."""


def int4_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether 4-bit projections can be served: the CPU in bfloat16 with torch's int4 CPU GEMM (torch >= 2.6).
    In float32 that GEMM is several times slower than dense (no fast path), so float32 dequantizes, exactly."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu"))


class Int4Linear(nn.Module):
    """y = x W^T (+ bias) with W held as 4-bit codes in groups of GROUP_SIZE along the input dimension; W's
    values are ``(code - 8) * scale + zero`` per group. Serves 2-D and batched inputs in ``dtype``."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        if not self.fits(self.out_features, self.in_features):
            raise ValueError(f"Int4Linear: a ({self.out_features}, {self.in_features}) weight; the int4 GEMM needs "
                             f"output rows in multiples of 16 and inputs in multiples of {GROUP_SIZE}")
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2))
        self.register_buffer("scale_zero", torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        """Whether the int4 GEMM takes a (out_features, in_features) weight."""
        return out_features % 16 == 0 and in_features % GROUP_SIZE == 0

    def dequantized(self) -> torch.Tensor:
        """W (out, in) in float32 (tests, tools)."""
        eye = torch.eye(self.in_features, dtype=self.scale_zero.dtype)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP_SIZE, self.scale_zero).t().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.bias is None and x.is_contiguous():  # a forward's rows: the GEMM alone (buffers
            # read from their dict: nn.Module's attribute fallback costs a microsecond, 8 a layer)
            buffers = self._buffers
            return torch._weight_int4pack_mm_for_cpu(x, buffers["packed"], GROUP_SIZE, buffers["scale_zero"])
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features).contiguous(), self.packed, GROUP_SIZE,
                                              self.scale_zero)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={GROUP_SIZE}"
