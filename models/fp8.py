"""FP8 (e4m3) weights: checkpoints that ship them, and ``--quantization fp8``.

What loads:

- ``quantization_config.quant_method == "fp8"`` (vLLM's ``Fp8Config``): each quantized ``*.weight`` is float8_e4m3fn
  beside its scale, per tensor (``*.weight_scale``, AutoFP8 / llm-compressor's older format) or per 128x128 block
  (``*.weight_scale_inv`` of shape (ceil(out / 128), ceil(in / 128)), with ``weight_block_size``: Qwen3-FP8 and
  DeepSeek). The value is ``weight * scale`` (the block scale despite its name too).
- ``quant_method == "compressed-tensors"`` whose weights are 8-bit floats (llm-compressor's FP8 schemes): scales
  ``*.weight_scale`` per tensor, per output channel (out, 1) or per block.
- ``--quantization fp8`` (vLLM's name) on a checkpoint that is not quantized: each projection is quantized at load,
  one scale per output channel (amax / 448).

Every other method (AWQ, GPTQ, bitsandbytes, GGUF-in-safetensors, compressed-tensors int4, ...) is refused by
``checkpoint_scheme`` with one error naming it. A float8 tensor in a checkpoint that does not say how it is scaled
is refused too. Activations are always quantized per token (or per 1x128 group for block weights) at run time,
as vLLM's "dynamic" activation scheme does; a checkpoint's static ``input_scale`` is not needed for that.

How it runs: on the CPU, and on GPUs without FP8 tensor cores (compute capability below 8.9), the weights are
dequantized at load to the serving dtype (the model computes with the FP8 checkpoint's values, no memory saved).
On Hopper and Ada the projections stay FP8 (``Fp8Linear``): per-channel weights through ``torch._scaled_mm`` with
row-wise scales (cuBLASLt), block weights through a Triton GEMM in the design of vLLM's and SGLang's
``w8a8_block_fp8_matmul`` (per-token-group activation scales times per-block weight scales, applied per 128-wide
step of the reduction); the activation quantization is one Triton kernel, and before a per-channel projection
none of its own: the norm or the MLP activation that feeds it quantizes its output in its kernel (``QuantRows``,
``CausalLM.fuse_fp8_quantization``). The attention's output projection and the MLP's down projection, whose output
goes straight into a residual add and RMSNorm, run cuBLASLt's tensor-wise FP8 GEMM with unit scales instead, the
norm's kernel applying the per-token and per-channel scales (``ScaledRows``, ``Fp8Linear.scale_out``): on the H200 at
256 rows the row-wise GEMM took 22.2 us at bench-dense's down shape against 11.3 for the tensor-wise one (it splits
no reduction). Shapes are static and nothing reads
back to the host, so both run inside CUDA graphs. The LM head, the embedding, norms and MoE routers stay in the
serving dtype (vLLM does the same); MoE experts are dequantized at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from models.fused import launch_options, rms_norm, silu_mul, triton, use_triton

if triton is not None:
    import triton.language as tl

    from models.fused import act_mul_cols, pdl_enter, rms_norm_row

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""The largest e4m3 value."""
QUANTIZATIONS = ("fp8",)
"""``--quantization`` values (vLLM's names)."""
UNSUPPORTED_HINT = ("supported: quant_method fp8 (per-tensor or 128x128 block scales), compressed-tensors with FP8 "
                    "weights, or an unquantized checkpoint (optionally served with --quantization fp8)")


class QuantizationError(ValueError):
    """A quantized checkpoint or a --quantization value that cannot be served (the message names the field)."""


@dataclass(frozen=True)
class Fp8Scheme:
    """How FP8 weights are scaled: ``block`` (rows, columns) for block scales, None for per-tensor or per-channel
    scales (a per-tensor scale is a per-channel one repeated); ``scale_suffix`` names the scale tensor beside each
    weight; ``online``: quantized at load from a checkpoint that is not quantized (``--quantization fp8``)."""

    block: tuple[int, int] | None = None
    scale_suffix: str = "weight_scale"
    online: bool = False

    def describe(self) -> str:
        if self.online:
            return "fp8 (quantized at load, per output channel)"
        return f"fp8 ({'%dx%d block' % self.block if self.block else 'per-tensor / per-channel'} scales)"


def checkpoint_scheme(hf: dict, path: str, quantization: str | None = None) -> Fp8Scheme | None:
    """The FP8 scheme ``config.json`` declares (None: not quantized), or with ``quantization`` ("fp8") the online
    scheme for an unquantized checkpoint. QuantizationError for every method that is not FP8, naming it."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise QuantizationError(f"--quantization {quantization!r} is not supported (one of {', '.join(QUANTIZATIONS)})")
    q = hf.get("quantization_config") or hf.get("compression_config")  # (the older name; vLLM reads both)
    if not q:
        return Fp8Scheme(online=True) if quantization == "fp8" else None
    if not isinstance(q, dict):
        raise QuantizationError(f"{path}: quantization_config must be an object")
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise QuantizationError(f"{path}: quantization_config.fmt {q.get('fmt')!r} is not supported (e4m3)")
        if q.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise QuantizationError(f"{path}: quantization_config.activation_scheme {q.get('activation_scheme')!r} is "
                                    f"not supported (dynamic or static; activations are quantized per token either "
                                    f"way)")
        scheme = Fp8Scheme(_block(q.get("weight_block_size"), path, "weight_block_size"))
        if scheme.block:
            scheme = Fp8Scheme(scheme.block, "weight_scale_inv")
    elif method == "compressed-tensors":
        scheme = _compressed_tensors(q, path)
    else:
        raise QuantizationError(f"{path}: quantization_config.quant_method {method!r} is not supported; "
                                f"{UNSUPPORTED_HINT}")
    if quantization is not None:
        raise QuantizationError(f"--quantization {quantization}: {path} is already quantized ({scheme.describe()}); "
                                f"leave --quantization out")
    return scheme


def _block(value, path: str, field: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise QuantizationError(f"{path}: quantization_config.{field} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


CT_FORMATS = (None, "float-quantized", "naive-quantized")
"""compressed-tensors formats whose FP8 weights are stored as float8_e4m3fn tensors, one per weight."""


def _compressed_tensors(q: dict, path: str) -> Fp8Scheme:
    """compressed-tensors: every config group's weights must be symmetric 8-bit floats (tensor, channel or block
    strategy) in a format that stores them as such; what would change the weights' values or the activations and
    KV cache beyond that (zero points, transforms, sparsity, integer activations or KV) is refused, named."""
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError(f"{path}: compressed-tensors quantization_config has no config_groups")
    for key in ("sparsity_config", "transform_config"):
        if q.get(key):
            raise QuantizationError(f"{path}: compressed-tensors quantization_config.{key} is not supported (the "
                                    f"weights it describes are not the stored ones)")
    kv = q.get("kv_cache_scheme")
    if kv and (not isinstance(kv, dict) or kv.get("type") != "float" or kv.get("num_bits") != 8):
        raise QuantizationError(f"{path}: compressed-tensors kv_cache_scheme {kv!r} is not supported (an 8-bit float "
                                f"KV cache: --kv-cache-dtype fp8)")
    blocks = set()
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        where = f"config_groups.{name}"
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise QuantizationError(
                f"{path}: compressed-tensors {where}.weights is {w.get('type')!r} {w.get('num_bits')}-bit "
                f"(format {q.get('format')!r}), which is not supported; {UNSUPPORTED_HINT}")
        if w.get("symmetric", True) is not True:
            raise QuantizationError(f"{path}: compressed-tensors {where}.weights.symmetric {w.get('symmetric')!r} "
                                    f"(asymmetric weights, zero points) is not supported")
        act = (group or {}).get("input_activations")
        if act and (act.get("type") != "float" or act.get("num_bits") != 8):
            raise QuantizationError(f"{path}: compressed-tensors {where}.input_activations is {act.get('type')!r} "
                                    f"{act.get('num_bits')}-bit, which is not supported (8-bit float activations)")
        strategy = w.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise QuantizationError(f"{path}: compressed-tensors {where}.weights.strategy {strategy!r} is "
                                    f"not supported (tensor, channel or block)")
        if strategy == "block" and w.get("block_structure") is None:
            raise QuantizationError(f"{path}: compressed-tensors {where}.weights.strategy block without a "
                                    f"block_structure is not supported (the scales' block size)")
        blocks.add(_block(w.get("block_structure"), path, f"{where}.weights.block_structure")
                   if strategy == "block" else None)
    if q.get("format") not in CT_FORMATS:
        raise QuantizationError(f"{path}: compressed-tensors format {q.get('format')!r} is not supported (FP8 weights "
                                f"stored as float8: {', '.join(map(str, CT_FORMATS[1:]))})")
    if len(blocks) > 1:
        raise QuantizationError(f"{path}: compressed-tensors config_groups mix scale layouts "
                                f"{sorted(map(str, blocks))}")
    return Fp8Scheme(blocks.pop(), "weight_scale")


# ---------------------------------------------------------------------------------------------------------------
# scales
# ---------------------------------------------------------------------------------------------------------------


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """An FP8 weight (rows, cols) times its scale, in float32: a scalar (per tensor), one per row (per channel:
    (rows,) or (rows, 1)) or one per ``block`` (ceil(rows / b0), ceil(cols / b1))."""
    w = weight.float()
    scale = scale.float()
    if block is not None and scale.dim() == 2 and scale.shape != (w.shape[0], 1):  # a grid of block scales
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        return w * full[:w.shape[0], :w.shape[1]]
    if scale.numel() == 1:
        return w * scale.reshape(())
    return w * scale.reshape(-1, 1)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (rows, cols) -> (FP8 weight, float32 scale (rows,)): each row scaled so that its largest magnitude is
    448 (an all-zero row gets scale 1)."""
    w = weight.float()
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (rows, cols) -> (FP8 weight, float32 scale (ceil(rows / b0), ceil(cols / b1))), one scale a block."""
    rows, cols = weight.shape
    b0, b1 = block
    pr, pc = -(-rows // b0) * b0, -(-cols // b1) * b1
    padded = torch.zeros(pr, pc, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(pr // b0, b0, pc // b1, b1)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(pr, pc)[:rows, :cols]
    return q.to(FP8), scale


@torch.no_grad()
def fake_quantize_(weight: torch.Tensor) -> None:
    """weight (rows, cols) replaced in place by its per-channel FP8 rounding (quantized, then dequantized): what
    ``--quantization fp8`` serves where there are no FP8 GEMMs (the values of the FP8 model, in the serving dtype)."""
    weight.copy_(dequantize(*quantize_per_channel(weight), None))


def fp8_gemm_available(device: torch.device | str) -> bool:
    """FP8 tensor cores: an NVIDIA GPU of compute capability 8.9 (Ada) or newer, with Triton."""
    device = torch.device(device)
    return (device.type == "cuda" and triton is not None and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= (8, 9))


# ---------------------------------------------------------------------------------------------------------------
# activation quantization and the block GEMM (Triton)
# ---------------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _fp8_scale(amax):
        """The scale of values whose largest magnitude is ``amax``: amax / 448, at least 1e-10 / 448."""
        return tl.maximum(amax, 1e-10) / 448.0

    @triton.jit
    def _store_fp8(q_ptr, offs, mask, x, scale):
        tl.store(q_ptr + offs, tl.clamp(x / scale, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_s, cols, GROUP: tl.constexpr,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Program (row, group of GROUP columns): the group's scale (``_fp8_scale``) and its values divided by it,
        rounded to e4m3."""
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        offs = g * GROUP + tl.arange(0, BLOCK)
        mask = (tl.arange(0, BLOCK) < GROUP) & (offs < cols)
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        scale = _fp8_scale(tl.max(tl.abs(x), axis=0))
        _store_fp8(q_ptr + row * stride_q, offs, mask, x, scale)
        tl.store(s_ptr + row * stride_s + g, scale)

    @triton.jit
    def _rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, q_ptr, res_out_ptr, s_ptr, xs_ptr, cs_ptr, stride_x, stride_r,
                               stride_q, stride_ro, n, eps, HAS_RES: tl.constexpr, SCALED: tl.constexpr,
                               BLOCK: tl.constexpr, PDL: tl.constexpr):
        """``models.fused``'s RMSNorm of a row (and residual add), rounded to the row's dtype, then quantized to
        e4m3 with its per-row scale, as ``_quant_rows_kernel`` would quantize the norm's output."""
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols, mask, y = rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, xs_ptr, cs_ptr, row, stride_x, stride_r,
                                     stride_ro, n, eps, HAS_RES, SCALED, BLOCK)
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = _fp8_scale(tl.max(tl.abs(y), axis=0))
        _store_fp8(q_ptr + row * stride_q, cols, mask, y, scale)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _act_mul_quant_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, n, BLOCK: tl.constexpr, GELU: tl.constexpr,
                              PDL: tl.constexpr):
        """``models.fused``'s act(gate) * up of a row, rounded to the row's dtype, quantized to e4m3 with its
        per-row scale: one program a row, over its columns BLOCK at a time twice (the row's largest magnitude, then
        the values, computed again: cheaper than holding a row of intermediate width)."""
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            y = act_mul_cols(x_row, cols, cols < n, n, GELU).to(x_ptr.dtype.element_ty).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(y))
        scale = _fp8_scale(tl.max(amax, axis=0))
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            y = act_mul_cols(x_row, cols, cols < n, n, GELU).to(x_ptr.dtype.element_ty).to(tl.float32)
            _store_fp8(q_ptr + row * stride_q, cols, cols < n, y, scale)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _block_fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_asm,
                               stride_bn, stride_bsn, stride_cm, BLOCK_SCALE_N: tl.constexpr,
                               BLOCK_SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        """C[M, N] = sum over K steps of (A_fp8 @ B_fp8^T) * a_scale[m, k-step] * b_scale[n // BSN, k-step]: one
        output tile a program, one BLOCK_SCALE_K-wide step of the reduction at a time, accumulated in float32."""
        pdl_enter(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_SCALE_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
        as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
        bs_ptrs = bs_ptr + (offs_n // BLOCK_SCALE_N).to(tl.int64) * stride_bsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_SCALE_K)):
            k_mask = offs_k < K - kb * BLOCK_SCALE_K
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            a_s = tl.load(as_ptrs + kb, mask=m_mask, other=0.0)
            b_s = tl.load(bs_ptrs + kb, mask=n_mask, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            a_ptrs += BLOCK_SCALE_K
            b_ptrs += BLOCK_SCALE_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, cols) -> (FP8 x, float32 scales (rows, groups)): dynamic quantization per token (``group`` None:
    one group of all columns) or per token and group of ``group`` columns. One Triton kernel on the GPU."""
    rows, cols = x.shape
    group = group or cols
    groups = -(-cols // group)
    if not use_triton(x):
        pad = groups * group - cols
        xf = torch.nn.functional.pad(x.float(), (0, pad)).view(rows, groups, group)
        scale = xf.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
        q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(rows, -1)[:, :cols]
        return q.to(FP8), scale
    q = torch.empty(rows, cols, dtype=FP8, device=x.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        _quant_rows_kernel[(rows, groups)](x, q, scale, x.stride(0), q.stride(0), scale.stride(0), cols, GROUP=group,
                                           BLOCK=triton.next_power_of_2(group), num_warps=4 if group >= 1024 else 1,
                                           **launch_options(x))
    return q, scale


class ScaledRows(NamedTuple):
    """A per-channel FP8 projection's output left to its reader to scale (``Fp8Linear.scale_out``): ``unit`` the
    product of the e4m3 activations and weights with unit scales, in the output dtype (rows, out), times
    ``row_scale`` (rows, 1) and ``col_scale`` (out,), both float32. ``models.fused.rms_norm`` takes them as
    ``scales``."""

    unit: torch.Tensor
    row_scale: torch.Tensor
    col_scale: torch.Tensor

    def value(self) -> torch.Tensor:
        """The scaled product, as the row-wise scaled GEMM gives it."""
        return (self.unit.float() * self.row_scale * self.col_scale).to(self.unit.dtype)


class QuantRows(NamedTuple):
    """Activations already quantized per token for a per-channel ``Fp8Linear``, by the kernel that produced them
    (``rms_norm_quant``, ``act_mul_quant``): e4m3 values (rows, cols), float32 scales (rows, 1), and the dtype of
    the projection's output."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None):
    """``models.fused.rms_norm`` for a per-channel FP8 projection: its output quantized per token in the same
    kernel (``QuantRows``, bit for bit ``quantize_rows`` of ``rms_norm``'s output), the residual and ``scales`` as
    there. Elsewhere than on the GPU, the two steps."""
    if not use_triton(x) or x.shape[0] == 0:
        out = rms_norm(x, weight, eps, residual, scales)
        normed, res = (out, None) if residual is None else out
        quant = QuantRows(*quantize_rows(normed), x.dtype)
        return quant if residual is None else (quant, res)
    rows, n = x.shape
    q = torch.empty(rows, n, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    res_in = residual if residual is not None else x
    xs, cs = scales if scales is not None else (x, x)
    _rms_norm_quant_kernel[(rows,)](x, res_in, weight, q, res_out, scale, xs, cs, x.stride(0), res_in.stride(0),
                                    q.stride(0), res_out.stride(0), n, eps, HAS_RES=residual is not None,
                                    SCALED=scales is not None, BLOCK=triton.next_power_of_2(n), num_warps=4,
                                    **launch_options(x))
    quant = QuantRows(q, scale, x.dtype)
    return quant if residual is None else (quant, res_out)


def act_mul_quant(x: torch.Tensor, act: str = "silu", block: int = 2048, num_warps: int = 8) -> QuantRows:
    """``models.fused.silu_mul`` for a per-channel FP8 projection: act(x[:, :n]) * x[:, n:] quantized per token in
    the same kernel (``QuantRows``, bit for bit ``quantize_rows`` of ``silu_mul``'s output), one program a row over
    its columns ``block`` at a time (``benchmarks/bench_fp8_gemm_gpu.py`` times the choices). Elsewhere than on the
    GPU, the two steps."""
    if not use_triton(x) or x.shape[0] == 0:
        return QuantRows(*quantize_rows(silu_mul(x, act)), x.dtype)
    rows, n = x.shape[0], x.shape[-1] // 2
    q = torch.empty(rows, n, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    _act_mul_quant_kernel[(rows,)](x, q, scale, x.stride(0), q.stride(0), n,
                                   BLOCK=min(block, triton.next_power_of_2(n)), GELU=act == "gelu_tanh",
                                   num_warps=num_warps, **launch_options(x))
    return QuantRows(q, scale, x.dtype)


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, in) @ dequantized(weight (out, in), its block scales)^T: x quantized per token and group of
    block[1] columns, then the block-scaled FP8 GEMM (Triton), output in x's dtype."""
    rows, k = x.shape
    n = weight.shape[0]
    xq, xs = quantize_rows(x, block[1])
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = min(128, block[0]) if block[0] % min(128, block[0]) == 0 else 16
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    _block_fp8_gemm_kernel[grid](xq, xs, weight, weight_scale, bias if bias is not None else out, out, rows, n, k,
                                 xq.stride(0), xs.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
                                 BLOCK_SCALE_N=block[0], BLOCK_SCALE_K=block[1], BLOCK_M=block_m, BLOCK_N=block_n,
                                 HAS_BIAS=bias is not None, num_warps=4, num_stages=3, **launch_options(x))
    return out


def channel_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, in) @ (weight (out, in) * weight_scale (out,)[:, None])^T: x quantized per token, then one
    ``torch._scaled_mm`` with row-wise scales (scale_a per token, scale_b per output channel)."""
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    return rowwise_fp8_gemm(QuantRows(*quantize_rows(x), x.dtype), weight, weight_scale, bias)


def rowwise_fp8_gemm(x: QuantRows, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Rows quantized per token times an FP8 weight (out, in) scaled per output channel: one ``torch._scaled_mm``
    with row-wise scales (scale_a per token, scale_b per output channel), output in ``x.dtype``."""
    return torch._scaled_mm(x.q, weight.t(), scale_a=x.scale, scale_b=weight_scale.view(1, -1), bias=bias,
                            out_dtype=x.dtype)


def unit_fp8_gemm(x: QuantRows, weight: torch.Tensor, weight_scale: torch.Tensor) -> ScaledRows:
    """``rowwise_fp8_gemm`` with its scales left to the reader: cuBLASLt's tensor-wise FP8 GEMM with unit scales."""
    one = _UNIT_SCALES.get(x.q.device)
    if one is None:
        one = _UNIT_SCALES[x.q.device] = torch.ones((), dtype=torch.float32, device=x.q.device)
    unit = torch._scaled_mm(x.q, weight.t(), scale_a=one, scale_b=one, out_dtype=x.dtype)
    return ScaledRows(unit, x.scale, weight_scale)


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


class Fp8Linear(nn.Module):
    """A projection held in FP8: ``weight`` (out, in) float8_e4m3fn and ``weight_scale`` float32, per output
    channel (out,) or per ``block`` (ceil(out / b0), ceil(in / b1)); ``bias`` in the serving dtype."""

    scale_out = False
    """Per-channel, without a bias, and read only by a residual add and RMSNorm: on the GPU it returns
    ``ScaledRows`` (``unit_fp8_gemm``), that norm's kernel applying the scales (``CausalLM.fuse_fp8_quantization``
    sets it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int] | None,
                 dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        shape = (out_features,) if block is None else (-(-out_features // block[0]), -(-in_features // block[1]))
        self.weight_scale = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor | QuantRows) -> torch.Tensor | ScaledRows:
        if self.scale_out and not isinstance(x, QuantRows) and use_triton(x) and x.shape[0]:
            x = QuantRows(*quantize_rows(x), x.dtype)
        if isinstance(x, QuantRows):  # (quantized per token by the kernel before: per-channel weights only)
            if self.scale_out:
                return unit_fp8_gemm(x, self.weight, self.weight_scale)
            return rowwise_fp8_gemm(x, self.weight, self.weight_scale, self.bias)
        flat = x.reshape(-1, self.in_features)
        if self.block is None:
            y = channel_fp8_linear(flat, self.weight, self.weight_scale, self.bias)
        else:
            y = block_fp8_linear(flat, self.weight, self.weight_scale, self.block, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def load_float(self, weight: torch.Tensor) -> None:
        """Set the weight from a float tensor (out, in), quantized per channel or per block."""
        q, s = quantize_per_channel(weight) if self.block is None else quantize_blocks(weight, self.block)
        self.weight.copy_(q)
        self.weight_scale.copy_(s)

    def dequantized(self) -> torch.Tensor:
        """The weight (out, in) in float32 (tests, tools)."""
        return dequantize(self.weight, self.weight_scale, self.block)

    def extra_repr(self) -> str:
        scales = "per-channel" if self.block is None else f"{self.block[0]}x{self.block[1]} block"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 {scales} scales"

    def _apply(self, fn, recurse=True):
        """Device moves apply; dtype casts (``model.to(bfloat16)``) leave the FP8 weight and float32 scales as they
        are and reach the bias only."""
        for name in ("weight", "weight_scale"):
            p = self._parameters[name]
            moved = fn(torch.empty(0, dtype=torch.float32, device=p.device))
            if moved.device != p.device:
                self._parameters[name] = nn.Parameter(p.to(moved.device), requires_grad=False)
        if self.bias is not None:
            self._parameters["bias"] = nn.Parameter(fn(self.bias), requires_grad=False)
        return self
