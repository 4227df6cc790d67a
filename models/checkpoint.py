"""What every checkpoint format shares: ``CheckpointError`` (defined in ``models.config``, which imports no torch),
the map from our parameters to Hugging Face tensor names (``hf_names``), and ``fill_model``, which sets a model's
parameters from any ``TensorSource`` (a safetensors directory, ``models.loader``; a GGUF file,
``models.gguf_loader``). Both loaders import this module; it imports neither."""

from __future__ import annotations

import logging
from typing import Iterator, Protocol

import torch
from torch import nn

from models.config import CheckpointError, ModelConfig
from models.fp8 import FP8, Fp8Scheme, dequantize, fake_quantize_, quantize_blocks, quantize_per_channel
from models.parallel import param_pieces, take_pieces
from models.transformer import VOCAB_PARAMS, CausalLM

log = logging.getLogger("twogrid.loader")


def serving_dtype(device: str | torch.device, weights_4bit: bool = False) -> torch.dtype:
    """The serving dtype when none is given: bfloat16 on CUDA; on the CPU bfloat16 for weights held 4-bit (a GGUF
    whose projections are Q4: decode is bound by memory bandwidth, and the default model decodes 1.8x as fast as in
    float32 on a 2-core AVX2 CPU), float32 for everything else."""
    if torch.device(device).type == "cuda" or weights_4bit:
        return torch.bfloat16
    return torch.float32


def hf_names(cfg: ModelConfig, kind: str) -> Iterator[tuple[str, list[str], int]]:
    """(our parameter, its Hugging Face tensors, the dim they are concatenated along)."""
    yield "embed_tokens.weight", ["model.embed_tokens.weight"], 0
    yield "norm.weight", ["model.norm.weight"], 0
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", ["lm_head.weight"], 0
    for i in range(cfg.num_layers):
        p, ours = f"model.layers.{i}", f"layers.{i}"
        yield f"{ours}.input_layernorm.weight", [f"{p}.input_layernorm.weight"], 0
        if cfg.sandwich_norms:  # Gemma's names: our MLP input norm is its pre_feedforward_layernorm
            yield f"{ours}.post_attention_layernorm.weight", [f"{p}.pre_feedforward_layernorm.weight"], 0
            yield f"{ours}.attn_output_norm.weight", [f"{p}.post_attention_layernorm.weight"], 0
            yield f"{ours}.mlp_output_norm.weight", [f"{p}.post_feedforward_layernorm.weight"], 0
        else:
            yield f"{ours}.post_attention_layernorm.weight", [f"{p}.post_attention_layernorm.weight"], 0
        if kind == "phi3":  # fused in the checkpoint as in our layout
            yield f"{ours}.qkv_proj.weight", [f"{p}.self_attn.qkv_proj.weight"], 0
        else:
            yield f"{ours}.qkv_proj.weight", [f"{p}.self_attn.{x}_proj.weight" for x in "qkv"], 0
        if cfg.attention_bias:
            yield f"{ours}.qkv_proj.bias", [f"{p}.self_attn.{x}_proj.bias" for x in "qkv"], 0
        if cfg.qk_norm:
            yield f"{ours}.q_norm.weight", [f"{p}.self_attn.q_norm.weight"], 0
            yield f"{ours}.k_norm.weight", [f"{p}.self_attn.k_norm.weight"], 0
        yield f"{ours}.o_proj.weight", [f"{p}.self_attn.o_proj.weight"], 0
        if kind == "phi3":
            yield f"{ours}.mlp.gate_up_proj.weight", [f"{p}.mlp.gate_up_proj.weight"], 0
            yield f"{ours}.mlp.down_proj.weight", [f"{p}.mlp.down_proj.weight"], 0
        elif not cfg.is_moe:
            yield f"{ours}.mlp.gate_up_proj.weight", [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"], 0
            yield f"{ours}.mlp.down_proj.weight", [f"{p}.mlp.down_proj.weight"], 0
        elif kind == "granitemoe":  # experts stacked in the checkpoint as in our layout (gate then up)
            m = f"{p}.block_sparse_moe"
            yield f"{ours}.mlp.gate.weight", [f"{m}.router.layer.weight"], 0
            yield f"{ours}.mlp.w13", [f"{m}.input_linear.weight"], 0
            yield f"{ours}.mlp.w2", [f"{m}.output_linear.weight"], 0
        elif kind == "mixtral":
            m = f"{p}.block_sparse_moe"
            yield f"{ours}.mlp.gate.weight", [f"{m}.gate.weight"], 0
            for e in range(cfg.num_experts):
                yield f"{ours}.mlp.w13[{e}]", [f"{m}.experts.{e}.w1.weight", f"{m}.experts.{e}.w3.weight"], 0
                yield f"{ours}.mlp.w2[{e}]", [f"{m}.experts.{e}.w2.weight"], 0
        else:
            m = f"{p}.mlp"
            yield f"{ours}.mlp.gate.weight", [f"{m}.gate.weight"], 0
            for e in range(cfg.num_experts):
                yield (f"{ours}.mlp.w13[{e}]",
                       [f"{m}.experts.{e}.gate_proj.weight", f"{m}.experts.{e}.up_proj.weight"], 0)
                yield f"{ours}.mlp.w2[{e}]", [f"{m}.experts.{e}.down_proj.weight"], 0
            if cfg.shared_expert_intermediate_size:
                yield (f"{ours}.mlp.shared_expert.gate_up_proj.weight",
                       [f"{m}.shared_expert.gate_proj.weight", f"{m}.shared_expert.up_proj.weight"], 0)
                yield f"{ours}.mlp.shared_expert.down_proj.weight", [f"{m}.shared_expert.down_proj.weight"], 0
                yield f"{ours}.mlp.shared_expert_gate.weight", [f"{m}.shared_expert_gate.weight"], 0


def param_target(model: CausalLM, name: str) -> torch.Tensor:
    """Our parameter (a view) that a checkpoint tensor fills: an expert's slice, or the vocabulary rows of the LM
    head and embedding, which are stored padded (``models.transformer.padded_vocab``; the padding stays zero)."""
    if name.endswith("]"):
        base, index = name[:-1].split("[")
        return model.get_parameter(base)[int(index)]
    if name in VOCAB_PARAMS:
        return model.get_parameter(name)[:model.vocab_rows_here()]
    from models.int4 import Int4Linear

    if isinstance(model.get_submodule(name.rpartition(".")[0]), Int4Linear):
        raise CheckpointError(f"{name}: this model holds it 4-bit (a GGUF's Q4 projection, loaded on the CPU in "
                              f"bfloat16); load the file in float32 to save or convert it")
    return model.get_parameter(name)


class TensorSource(Protocol):
    """Where a loader reads tensors by their Hugging Face names (a safetensors directory, a GGUF file)."""

    where: str

    def get(self, name: str) -> torch.Tensor:
        """The tensor (raises CheckpointError naming it when it is missing)."""

    def describe(self, name: str) -> str:
        """How the checkpoint itself names ``name`` (for errors)."""


class Fp8Source:
    """A TensorSource whose float8 tensors come with their scales (``models.fp8``): ``get`` dequantizes them to
    float32 (for parameters held in the serving dtype), ``get_fp8`` hands the FP8 tensor and its scale over as
    they are (for ``Fp8Linear``). A float8 tensor without a scheme (config.json does not say how it is scaled) or
    without its scale tensor is a CheckpointError."""

    def __init__(self, source: TensorSource, scheme: Fp8Scheme | None):
        self.source, self.scheme, self.where = source, scheme, source.where

    def describe(self, name: str) -> str:
        return self.source.describe(name)

    def get_fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = self.source.get(name)
        if not t.dtype.is_floating_point:  # (integer codes: a quantization whose config this loader did not read)
            raise CheckpointError(f"{self.where}: tensor {self.describe(name)!r} is {t.dtype}, not a float: a "
                                  f"quantized checkpoint whose method is not supported (only FP8 is; its "
                                  f"quantization_config says which method it uses)")
        if t.dtype != FP8:
            if t.itemsize == 1:
                raise CheckpointError(f"{self.where}: tensor {name!r} is {t.dtype}, which is not supported (FP8 "
                                      f"weights are float8_e4m3fn)")
            return t, None
        if self.scheme is None or self.scheme.online:
            raise CheckpointError(f"{self.where}: tensor {name!r} is float8_e4m3fn but config.json has no "
                                  f"quantization_config saying how it is scaled")
        scale_name = name.removesuffix("weight") + self.scheme.scale_suffix
        try:
            scale = self.source.get(scale_name)
        except CheckpointError:
            raise CheckpointError(f"{self.where}: FP8 tensor {name!r} has no scale {scale_name!r} "
                                  f"({self.scheme.describe()})") from None
        self._check_scale(scale_name, scale, tuple(t.shape))
        return t, scale

    def _check_scale(self, name: str, scale: torch.Tensor, shape: tuple[int, ...]) -> None:
        """An FP8 weight's scale: finite and >= 0 (0: a block of zeros), one per tensor or per row, or one per block
        of the scheme's block size ((ceil(rows / b0), ceil(cols / b1))); a grid of another size would be cropped or
        repeated into the wrong rows."""
        block, rows = self.scheme.block, shape[0] if shape else 1
        if block is not None and len(shape) == 2:
            want = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
            ok, what = tuple(scale.shape) == want, f"shape {want} ({block[0]}x{block[1]} blocks)"
        else:
            ok, what = scale.numel() in (1, rows) and scale.dim() <= 2, f"1 or {rows} values (per tensor or row)"
        if not ok:
            raise CheckpointError(f"{self.where}: FP8 scale {name!r} has shape {tuple(scale.shape)}, expected {what} "
                                  f"for its weight of shape {shape} ({self.scheme.describe()})")
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise CheckpointError(f"{self.where}: FP8 scale {name!r} has values that are not finite numbers >= 0")

    def get(self, name: str) -> torch.Tensor:
        t, scale = self.get_fp8(name)
        return t if scale is None else dequantize(t, scale, self.scheme.block)

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole tensor's shape (read from the header where the source can, else from the tensor)."""
        shape = getattr(self.source, "shape", None)
        return shape(name) if shape is not None else tuple(self.source.get(name).shape)

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` along ``dim`` of a tensor in a float dtype, read alone where the source can (a
        tensor-parallel rank's shard: ``models.parallel``); FP8 tensors are not split."""
        read = getattr(self.source, "get_slice", None)
        t = read(name, dim, start, stop) if read is not None else self.source.get(name).narrow(dim, start,
                                                                                              stop - start)
        if t.dtype.is_floating_point and t.itemsize == 1:
            raise CheckpointError(f"{self.where}: tensor {name!r} is {t.dtype}: FP8 checkpoints are not split across "
                                  f"tensor-parallel ranks yet (serve them with tensor_parallel_size 1)")
        return t


def _fill_fp8(model: CausalLM, ours: str, theirs: list[str], source: Fp8Source) -> str:
    """An ``Fp8Linear``'s weight and scale from the checkpoint's parts (fused along rows): FP8 parts copied with
    their scales (a per-tensor scale repeated per row; block scales as they are when every part starts on a block
    row), parts in a float dtype quantized (``--quantization fp8``); block parts that do not start on a block row
    are dequantized and requantized as one. A projection the checkpoint leaves unquantized stays so
    (``_keep_unquantized``). Returns the name of the parameter set beside the weight (its scale, or the weight)."""
    module = model.get_submodule(ours.rpartition(".")[0])
    weight, scale, block = module.weight, module.weight_scale, module.block
    parts = [source.get_fp8(key) for key in theirs]
    rows = [w.shape[0] for w, _ in parts]
    _check_shapes(source, ours, theirs, [tuple(w.shape) for w, _ in parts], weight, model.full_cfg)
    if not source.scheme.online and any(sc is None for _, sc in parts):
        return _keep_unquantized(model, ours, theirs, parts, source)
    starts = [sum(rows[:i]) for i in range(len(rows))]
    aligned = block is None or source.scheme.block == block and all(
        s % block[0] == 0 and sc is not None for s, (_, sc) in zip(starts, parts))
    if not aligned:
        full = torch.cat([w.float() if sc is None else dequantize(w, sc, source.scheme.block) for w, sc in parts])
        q, s = quantize_blocks(full, block)
        weight.copy_(q)
        scale.copy_(s)
    else:
        for start, (w, sc) in zip(starts, parts):
            if sc is None:
                w, sc = quantize_per_channel(w) if block is None else quantize_blocks(w, block)
            elif block is None:
                if sc.numel() not in (1, w.shape[0]):
                    raise CheckpointError(f"{source.where}: the scale of {ours}'s part has {sc.numel()} values, "
                                          f"expected 1 or {w.shape[0]} (per tensor or per channel)")
                sc = sc.float().reshape(-1).expand(w.shape[0])
            weight.narrow(0, start, w.shape[0]).copy_(w)
            if block is None:
                scale.narrow(0, start, w.shape[0]).copy_(sc)
            else:
                scale.narrow(0, start // block[0], sc.shape[0]).copy_(sc)
    return ours.removesuffix("weight") + "weight_scale"


def _keep_unquantized(model: CausalLM, ours: str, theirs: list[str], parts, source: Fp8Source) -> str:
    """A projection the FP8 checkpoint leaves unquantized (its ``modules_to_not_convert`` / ``ignore``), served as
    the checkpoint holds it, as vLLM does: the ``Fp8Linear`` built for it becomes an ``nn.Linear`` in the serving
    dtype, its bias kept, its weight the parts' values (an FP8 part of a fused projection dequantized beside an
    unquantized one). Returns the weight's name."""
    from models.transformer import no_default_init

    path = ours.rpartition(".")[0]
    parent, _, child = path.rpartition(".")
    old = model.get_submodule(path)
    dtype = model.embed_tokens.weight.dtype
    with no_default_init():
        plain = nn.Linear(old.in_features, old.out_features, bias=False, device=old.weight.device, dtype=dtype)
    plain.requires_grad_(False)
    plain.weight.copy_(torch.cat([w.float() if sc is None else dequantize(w, sc, source.scheme.block)
                                  for w, sc in parts]))
    plain.bias = old.bias  # (the loader sets it by its own name, before or after)
    setattr(model.get_submodule(parent), child, plain)
    log.info("%s: %s kept in %s, unquantized as the checkpoint holds it (its quantization_config ignores it)",
             source.where, " + ".join(source.describe(k) for k in theirs), str(dtype).removeprefix("torch."))
    return ours


def fold_residual_scale(model: CausalLM) -> None:
    """Granite's residual_multiplier folded into the layers' output projections (attention's o_proj, the MLP's
    down projection or the experts' w2): their outputs are what the residual adds, so the forward needs no extra
    multiply. An FP8 projection takes it in its scales."""
    scale = model.cfg.residual_scale
    for layer in model.layers:
        mlp = layer.mlp
        for module in (layer.o_proj, getattr(mlp, "down_proj", None)):
            if module is not None:
                (module.weight_scale if module.weight.dtype == FP8 else module.weight).mul_(scale)
        if hasattr(mlp, "w2"):
            mlp.w2.mul_(scale)


def part_rows(cfg: ModelConfig, num_parts: int, rows: int) -> list[int] | None:
    """The rows each of a fused parameter's checkpoint parts holds: q, k and v (``num_parts`` 3), or two equal halves
    (gate and up); None for a parameter of one part."""
    if num_parts == 3:
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    return [rows // num_parts] * num_parts if num_parts > 1 else None


def _check_shapes(source, ours: str, theirs: list[str], shapes: list[tuple], target: torch.Tensor,
                  cfg: ModelConfig | None = None) -> None:
    """CheckpointError unless the parts' shapes concatenated along dim 0 are ``target``'s, each part with its own
    rows (``part_rows``, where ``cfg`` is given: a sum alone would take q and k swapped, or gate and up uneven)."""
    rows = part_rows(cfg, len(theirs), target.shape[0]) if cfg is not None else None
    if any(len(s) != target.dim() or s[1:] != tuple(target.shape[1:]) for s in shapes) or sum(
            s[0] for s in shapes) != target.shape[0] or (rows is not None and [s[0] for s in shapes] != rows):
        names = " + ".join(source.describe(k) for k in theirs)
        got = " + ".join(str(s) for s in shapes)
        want = " + ".join(str((r, *target.shape[1:])) for r in rows) if rows else str(tuple(target.shape))
        raise CheckpointError(f"{source.where}: {names} has shape {got}, expected {want} for {ours}")


def _meta_model(model: CausalLM) -> CausalLM:
    """The whole (unsplit) model on the meta device: the shapes a tensor-parallel rank's checkpoint holds."""
    with torch.device("meta"):
        return CausalLM(model.full_cfg)


def fill_model(model: CausalLM, kind: str, source: TensorSource, scheme: Fp8Scheme | None = None) -> CausalLM:
    """Set every parameter of ``model`` from ``source``, checking each shape; a parameter left unset is an error.
    ``scheme``: the checkpoint's FP8 scheme, or ``--quantization fp8`` (``models.fp8``): FP8 tensors are
    dequantized into parameters in the serving dtype, or kept in ``Fp8Linear`` projections; with online
    quantization and no ``Fp8Linear`` (no FP8 GEMMs) the projections get their FP8 rounding. A tensor-parallel
    rank's model (``model.tp``) reads its slices of each tensor only (``models.parallel.param_pieces``), after
    checking the whole tensor's shape."""
    cfg = model.full_cfg
    done: set[str] = set()
    source = Fp8Source(source, scheme)
    whole = _meta_model(model) if model.tp is not None else model
    with torch.no_grad():
        for ours, theirs, dim in hf_names(cfg, kind):
            target = param_target(model, ours)
            if target.dtype == FP8:
                done.add(_fill_fp8(model, ours, theirs, source))
                done.add(ours)
                continue
            pieces = param_pieces(ours, len(theirs), cfg, model.tp) if model.tp is not None else None
            if pieces is None:
                parts = [source.get(key) for key in theirs]
                _check_shapes(source, ours, theirs, [tuple(p.shape) for p in parts], param_target(whole, ours), cfg)
            else:  # a tensor-parallel rank: the whole tensors' shapes checked, then only its slices read
                _check_shapes(source, ours, theirs, [source.shape(key) for key in theirs], param_target(whole, ours),
                              cfg)
                parts = [take_pieces(lambda dim, start, stop, key=key: source.get_slice(key, dim, start, stop), p)
                         for key, p in zip(theirs, pieces)]
                _check_shapes(source, ours, theirs, [tuple(p.shape) for p in parts], target)
            start = 0
            for part in parts:  # straight into the fused parameter's rows (no concatenated copy)
                target.narrow(dim, start, part.shape[dim]).copy_(part)
                start += part.shape[dim]
            done.add(ours.split("[")[0])
        if scheme is not None and scheme.online and model.fp8 is None:
            for _, module in model.projections():
                fake_quantize_(module.weight)
        if cfg.residual_scale != 1.0:
            fold_residual_scale(model)
    unset = [n for n, _ in model.named_parameters() if n not in done]
    if unset:
        raise CheckpointError(f"{source.where}: the loader set no value for {unset[0]} ({kind})")
    model.fuse_fp8_quantization()  # (the projections are final: some may have been left unquantized)
    return model


FINITE_CHECKED = (torch.float16, torch.bfloat16, torch.float32)


def check_finite_weights(model: torch.nn.Module, source: str, error: type[Exception] = CheckpointError) -> None:
    """``error`` naming the first weight (as loaded: decoded, dequantized or scaled) that holds a NaN or an
    infinity: a corrupt checkpoint would otherwise load and generate garbage. One pass over the floating-point
    parameters and buffers, one synchronization (an FP8 weight's scales are checked, its 8-bit values not)."""
    names, flags = [], []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.dtype in FINITE_CHECKED and t.numel():
            names.append(name)
            flags.append(torch.isfinite(t).all())
    if not flags:
        return
    finite = torch.stack(flags).cpu()
    if not bool(finite.all()):
        bad = [names[i] for i in (~finite).nonzero().flatten().tolist()]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise error(f"{source}: weight {bad[0]}{more} holds a NaN or an infinity: the checkpoint is corrupt (or was "
                    f"saved after training diverged); refusing to serve it")
