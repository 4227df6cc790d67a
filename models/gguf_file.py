"""A GGUF file's header, read without torch: ``GGUFFile`` (the metadata and tensor table, parsed with ``struct`` over a
memory map; its tensors on demand, which import torch when asked for), ``open_gguf`` (one parse per file, shared by
the config, tokenizer and weight readers) and ``config_from_gguf`` (the model's shape from the metadata). The
tokenizer (``models.text``) and a model's shape (``models.loader.read_model_config``) read GGUFs through this module
alone, so that the front ends that tokenize import no torch; the weights are ``models.gguf_loader``'s.

The ``gguf`` package's GGUFReader builds a numpy view per metadata string and takes about 7 s on the 49K-token
vocabulary of SmolLM2-135M, longer than the whole load may take: hence this parser. The format's constants come from
the ``gguf`` package, and so does every dequantization but Q8_0's, Q4_0's and Q4_1's, which torch decodes on the device
the weights go to (``decode_blocks``: the gguf package's numpy took about 2 s of the default model's start on the H200
host; the tests check the two agree exactly).
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from models.config import CheckpointError, ModelConfig, RopeScaling, checked_config

if TYPE_CHECKING:
    import torch

GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                      "qwen3moe": "qwen3_moe", "granite": "granite", "granitemoe": "granitemoe", "gemma2": "gemma2",
                      "gemma3": "gemma3_text", "phi3": "phi3"}
"""general.architecture -> the Hugging Face model_type its tensors map to (llama with experts: mixtral)."""

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9



@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    """In torch order (GGUF lists dimensions fastest first)."""
    ggml_type: int
    start: int
    """Absolute byte offset of the data in the file."""
    nbytes: int


class GGUFFile:
    """A GGUF file's metadata and tensor table, and its tensors on demand (memory-mapped)."""

    def __init__(self, path: str):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        try:
            with open(path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot read the GGUF file ({exc})") from None
        size = len(self._map)
        try:
            self.metadata, tensors, end = self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, OverflowError, MemoryError) as exc:
            raise CheckpointError(f"{path}: truncated or corrupt GGUF header ({type(exc).__name__}: {exc})") from None
        align = self.metadata.get("general.alignment", 32)
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align % 8:
            raise CheckpointError(f"{path}: metadata general.alignment is {align!r}, expected a positive multiple of "
                                  f"8 (the GGUF specification)")
        data_start = -(-end // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        expected, previous = 0, None
        """Where the next tensor's data must start, relative to the data section: ggml's rule (each tensor right
        after the one before it in the table, padded to the alignment), which also catches a tensor that points at
        another's data, a type or a shape that does not match the bytes, and a misaligned offset."""
        for name, dims, ggml_type, offset in tensors:
            if name in self.tensors:
                raise CheckpointError(f"{path}: tensor {name!r} appears twice in the tensor table")
            try:
                qtype = GGMLQuantizationType(ggml_type)
            except ValueError:
                raise CheckpointError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            count = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if dims and dims[0] % block:
                raise CheckpointError(f"{path}: tensor {name!r} has rows of {dims[0]} values, not a multiple of "
                                      f"{qtype.name}'s block of {block}")
            if offset != expected:
                before = f"right after {previous!r}" if previous else "the data section's start"
                raise CheckpointError(f"{path}: tensor {name!r} has its data at offset {offset} of the data section, "
                                      f"expected {expected} ({before}, padded to {align} bytes): a corrupt tensor "
                                      f"table, or a type or shape of one of the two that does not match its data")
            info = TensorInfo(name, tuple(reversed(dims)), ggml_type, data_start + offset, count // block * type_size)
            expected, previous = offset + -(-info.nbytes // align) * align, name
            if info.start + info.nbytes > size:
                raise CheckpointError(f"{path}: truncated GGUF file: tensor {name!r} ends at byte "
                                      f"{info.start + info.nbytes}, the file has {size} bytes")
            self.tensors[name] = info

    # -- header ----------------------------------------------------------------------------------------------
    def _parse(self):
        buf = self._map
        if buf[:4] != b"GGUF":
            raise CheckpointError(f"{self.path}: not a GGUF file (no GGUF magic bytes)")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise CheckpointError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        pos = 24
        metadata = {}
        for _ in range(num_kv):
            key, pos = self._string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = self._value(pos + 4, vtype)
        tensors = []
        for _ in range(num_tensors):
            name, pos = self._string(pos)
            (ndims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{ndims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndims)
            pos += 4 + 8 * ndims + 12
            tensors.append((name, dims, ggml_type, offset))
        return metadata, tensors, pos

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._map, pos)
        end = pos + 8 + n
        if end > len(self._map):
            raise IndexError(f"a string of {n} bytes at byte {pos} runs past the end of the file")
        return self._map[pos + 8:end].decode("utf-8"), end

    def _value(self, pos: int, vtype: int):
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            return struct.unpack_from(fmt, self._map, pos)[0], pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._string(pos)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", self._map, pos)
            pos += 12
            if etype in _SCALARS:
                fmt = _SCALARS[etype]
                width = struct.calcsize(fmt)
                if pos + count * width > len(self._map):
                    raise IndexError(f"an array of {count} values at byte {pos} runs past the end of the file")
                values = np.frombuffer(self._map, dtype=np.dtype(fmt), count=count, offset=pos).tolist()
                return values, pos + count * width
            out = []
            for _ in range(count):
                v, pos = self._value(pos, etype)
                out.append(v)
            return out, pos
        raise ValueError(f"unknown GGUF metadata value type {vtype} at byte {pos}")

    # -- tensors ---------------------------------------------------------------------------------------------
    def tensor(self, name: str, dtype: "torch.dtype | None" = None,
               device: "torch.device | str | None" = None) -> "torch.Tensor":
        """The tensor in ``dtype`` (default float32) on ``device`` (default the CPU). Q8_0, Q4_0 and Q4_1 are decoded
        by torch where they will live (``decode_blocks``: on a GPU the file's bytes travel, not four times as many
        float32 values); every other quantized type is dequantized to float32 by the ``gguf`` package on the CPU."""
        import torch
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        dtype, device = dtype or torch.float32, device or "cpu"
        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.start)
        if qtype.name in TORCH_DECODED:
            values = decode_blocks(torch.from_numpy(raw.copy()).to(device), qtype.name, info.shape)
            return values.to(dtype)
        if qtype == GGMLQuantizationType.F32:
            return torch.from_numpy(raw.view(np.float32).reshape(info.shape).copy()).to(device, dtype)
        if qtype == GGMLQuantizationType.F16:
            return torch.from_numpy(raw.view(np.float16).reshape(info.shape).copy()).to(device, dtype)
        if qtype == GGMLQuantizationType.BF16:
            return torch.from_numpy(raw.view(np.int16).reshape(info.shape).copy()).view(torch.bfloat16).to(device,
                                                                                                            dtype)
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_values = info.shape[-1] if info.shape else 1
        rows = raw.reshape(-1, row_values // block * type_size)
        try:
            values = dequantize(rows, qtype)
        except NotImplementedError:
            raise CheckpointError(f"{self.path}: tensor {name!r} is {qtype.name}, which the gguf package cannot "
                                  f"dequantize") from None
        return torch.from_numpy(values.reshape(info.shape)).to(device, dtype)

    def int4_groups(self, name: str) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None":
        """A Q4_0 / Q4_1 matrix as torch's int4 layout wants it: (codes (rows, cols) uint8 in 0..15, scale and zero
        (rows, cols / 32) float32) with value = (code - 8) * scale + zero, so zero = m + 8 d (Q4_1) or 0 (Q4_0);
        None for other types."""
        import torch
        from gguf.constants import GGMLQuantizationType

        info = self.tensors[name]
        type_name = GGMLQuantizationType(info.ggml_type).name
        if type_name not in ("Q4_0", "Q4_1") or len(info.shape) != 2:
            return None
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.start)
        codes, scale, offset = block_fields(torch.from_numpy(raw.copy()), type_name, info.shape)
        zero = offset + 8 * scale if offset is not None else torch.zeros_like(scale)
        return codes.reshape(info.shape), scale, zero


TORCH_DECODED = ("Q8_0", "Q4_0", "Q4_1")
"""The block types ``decode_blocks`` reads (ggml's block_q8_0, block_q4_0, block_q4_1: 32 values, one fp16 scale
``d``, for Q4_1 an fp16 offset ``m``; their sizes are the gguf package's ``GGML_QUANT_SIZES``)."""


def block_fields(raw: "torch.Tensor", type_name: str, shape) -> tuple:
    """A Q8_0 / Q4_0 / Q4_1 tensor's bytes (uint8, on any device) -> (codes (..., groups, 32): int8 for Q8_0,
    uint8 0..15 for the 4-bit types; d (..., groups) float32; m (..., groups) float32 for Q4_1, else None).
    A 4-bit block's 16 bytes of codes hold values 0..15 in their low nibbles and 16..31 in their high ones."""
    import torch
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    cols = shape[-1] if shape else 1
    blocks = raw.reshape(-1, cols // block_values, block_bytes)
    half = lambda a, b: blocks[..., a:b].contiguous().view(torch.float16)[..., 0].float()  # noqa: E731
    d = half(0, 2)
    if type_name == "Q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8), d, None
    packed = blocks[..., -16:]
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1)
    return codes, d, half(2, 4) if type_name == "Q4_1" else None


def decode_blocks(raw: "torch.Tensor", type_name: str, shape) -> "torch.Tensor":
    """A Q8_0 / Q4_0 / Q4_1 tensor's bytes -> its float32 values in ``shape``, on ``raw``'s device, as ggml defines
    them (and the gguf package computes them): d * q (Q8_0), d * (q - 8) (Q4_0), d * q + m (Q4_1)."""
    codes, d, m = block_fields(raw, type_name, shape)
    q = codes.float() - 8 if type_name == "Q4_0" else codes.float()
    values = d[..., None] * q
    if m is not None:
        values = values + m[..., None]
    return values.reshape(tuple(shape))


_OPENED: dict[tuple, GGUFFile] = {}


def open_gguf(path: str) -> GGUFFile:
    """A parsed GGUFFile, shared by the config, tokenizer and weight readers of one load (the header of a 49K-token
    vocabulary takes a while to parse); a file changed since (mtime, size) is parsed again."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_mtime_ns, st.st_size)
    if key not in _OPENED:
        if len(_OPENED) >= 4:
            _OPENED.pop(next(iter(_OPENED)))
        _OPENED[key] = GGUFFile(path)
    return _OPENED[key]


_REQUIRED = object()


def meta_number(f: GGUFFile, key: str, cast: type = int, default=_REQUIRED):
    """Metadata ``key`` as an int (``cast`` int) or a float: a per-layer array whose entries are all equal stands for
    its value; a missing key is ``default`` (none given: an error); any other value is refused, naming the key."""
    value = f.metadata.get(key)
    if value is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{f.path}: metadata {key} is missing")
        return default
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            shown = value if len(value) <= 8 else [*value[:8], "..."]
            raise CheckpointError(f"{f.path}: metadata {key} varies per layer ({shown}), which is not supported "
                                  f"(one value for every layer is)")
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            cast is int and isinstance(value, float) and not value.is_integer()):
        raise CheckpointError(f"{f.path}: metadata {key} is {value!r}, expected "
                              f"{'an integer' if cast is int else 'a number'}")
    return cast(value)


def config_from_gguf(f: GGUFFile) -> tuple[str, ModelConfig]:
    """(the Hugging Face model_type its tensors map to, the model's shape) from the metadata and tensor table."""
    md, t = f.metadata, f.tensors
    arch = md.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{f.path}: GGUF architecture {arch!r} is not supported; supported: "
                              f"{', '.join(GGUF_ARCHITECTURES)}")

    def num(key, cast=int, default=_REQUIRED):
        return meta_number(f, f"{arch}.{key}", cast, default)

    if "token_embd.weight" not in t:
        raise CheckpointError(f"{f.path}: tensor 'token_embd.weight' is missing")
    hidden, heads = num("embedding_length"), num("attention.head_count")
    head_dim = num("attention.key_length", int, 0) or num("rope.dimension_count", int, 0) or hidden // max(heads, 1)
    experts = num("expert_count", int, 0)
    kind = GGUF_ARCHITECTURES[arch] if not (arch == "llama" and experts) else "mixtral"
    scaling = None
    # llama.cpp (src/llama-model.cpp, load_hparams): the type defaults to "linear", the factor is
    # rope.scaling.factor or the older rope.scale_linear, and absent (or 0) means no scaling
    factor_key = next((f"{arch}.{k}" for k in ("rope.scaling.factor", "rope.scale_linear") if f"{arch}.{k}" in md),
                      f"{arch}.rope.scaling.factor")
    scaling_type = md.get(f"{arch}.rope.scaling.type", "linear" if factor_key in md else "none")
    if scaling_type == "linear":
        factor = meta_number(f, factor_key, float, 0.0)
        scaling = RopeScaling("linear", factor) if factor not in (0.0, 1.0) else None  # (llama.cpp: 0, absent: none)
    elif scaling_type == "yarn":
        factor = num("rope.scaling.factor", float)
        scaling = RopeScaling("yarn", factor, original_max_position_embeddings=num(
            "rope.scaling.original_context_length"), attention_factor=0.1 * math.log(max(factor, 1e-30)) + 1.0)
    elif scaling_type not in ("none", None):
        raise CheckpointError(f"{f.path}: rope scaling type {scaling_type!r} is not supported (none, linear or yarn)")
    factors = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n in t]
    if len(factors) == 1:
        raise CheckpointError(f"{f.path}: tensor {factors[0]!r} without its pair: LongRoPE needs both "
                              f"rope_factors_long.weight and rope_factors_short.weight")
    if factors:  # Phi-3's LongRoPE, as llama.cpp's converter writes it
        original = num("rope.scaling.original_context_length")
        scaling = RopeScaling("longrope", num("context_length") / max(original, 1),
                              original_max_position_embeddings=original,
                              attention_factor=num("rope.scaling.attn_factor", float, 1.0),
                              short_factor=tuple(f.tensor("rope_factors_short.weight").tolist()),
                              long_factor=tuple(f.tensor("rope_factors_long.weight").tolist()))
    biased = [n for n in ("blk.0.attn_output.bias", "blk.0.attn_q.bias") if n in t]
    if biased and (biased[0] == "blk.0.attn_output.bias" or kind not in ("qwen2", "qwen2_moe")):
        raise CheckpointError(f"{f.path}: attention biases ({biased[0]}) are not supported for {arch} (only "
                              f"Qwen2's q/k/v biases are)")
    value_dim = num("attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise CheckpointError(f"{f.path}: metadata {arch}.attention.value_length {value_dim} differs from the key "
                              f"length {head_dim}: heads whose values and keys differ in size are not supported")
    eos = [meta_number(f, f"tokenizer.ggml.{k}_token_id", int, None) for k in ("eos", "eot", "eom")]
    cfg = dict(
        vocab_size=t["token_embd.weight"].shape[0], hidden_size=hidden, num_layers=num("block_count"),
        num_heads=heads, num_kv_heads=num("attention.head_count_kv", int, heads), head_dim=head_dim,
        intermediate_size=num("feed_forward_length", int, 0),
        rope_theta=num("rope.freq_base", float, 10000.0), rope_scaling=scaling,
        rms_norm_eps=num("attention.layer_norm_rms_epsilon", float, 1e-6),
        tie_word_embeddings="output.weight" not in t,
        max_position_embeddings=num("context_length"),  # (llama.cpp requires it too: n_ctx_train)
        eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
        attention_bias="blk.0.attn_q.bias" in t, qk_norm="blk.0.attn_q_norm.weight" in t,
    )
    past = sorted((int(m.group(1)), n) for n in t if (m := re.match(r"blk\.(\d+)\.", n)) and
                  int(m.group(1)) >= cfg["num_layers"])
    if past:  # (checked here, without torch, so that serve's check of the model finds it; models.gguf_loader
        # refuses every other tensor the model does not read)
        raise CheckpointError(f"{f.path}: tensor {past[0][1]!r} ({len(past)} in all) is in layer {past[0][0]}, past "
                              f"{arch}.block_count {cfg['num_layers']}: refusing rather than serving part of the file")
    cfg.update(_arch_extras(f, arch, cfg, num))
    if experts:
        moe_inter = num("expert_feed_forward_length", int, None)
        if moe_inter is None and "blk.0.ffn_up_exps.weight" in t:
            moe_inter = t["blk.0.ffn_up_exps.weight"].shape[1]
        shared = num("expert_shared_feed_forward_length", int, None)
        if shared is None and "blk.0.ffn_up_shexp.weight" in t:
            shared = t["blk.0.ffn_up_shexp.weight"].shape[0]
        norm_topk = md.get(f"{arch}.expert_weights_norm", kind != "qwen2_moe")  # llama.cpp's defaults
        if not isinstance(norm_topk, bool):
            raise CheckpointError(f"{f.path}: metadata {arch}.expert_weights_norm is {norm_topk!r}, expected a bool")
        cfg.update(num_experts=experts, num_experts_per_token=num("expert_used_count"),
                   moe_intermediate_size=int(moe_inter or cfg["intermediate_size"]), norm_topk_prob=bool(norm_topk),
                   shared_expert_intermediate_size=int(shared or 0) if kind == "qwen2_moe" else 0)
    return kind, checked_config(cfg, f.path, {ours: f"{theirs.format(arch=arch)} ({ours})"
                                              for ours, theirs in GGUF_KEYS.items()})


GGUF_KEYS = {"hidden_size": "{arch}.embedding_length", "num_layers": "{arch}.block_count",
             "num_heads": "{arch}.attention.head_count", "num_kv_heads": "{arch}.attention.head_count_kv",
             "head_dim": "{arch}.attention.key_length", "intermediate_size": "{arch}.feed_forward_length",
             "rope_theta": "{arch}.rope.freq_base", "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon",
             "max_position_embeddings": "{arch}.context_length", "num_experts_per_token": "{arch}.expert_used_count"}
"""ModelConfig's fields as a GGUF's metadata names them (for errors)."""


def _arch_extras(f: GGUFFile, arch: str, cfg: dict, num) -> dict:
    """What Granite, Gemma and Phi-3 add to the config, from their metadata and llama.cpp's own rules where the
    converter writes none (Gemma 2 and 3: the sliding-window pattern, Gemma 3's local rope base, the attention
    scale of the 27B models, as llama.cpp's llama-model.cpp sets them); ``num``: ``config_from_gguf``'s reader of
    ``arch``'s numbers (``meta_number``)."""
    layers, hidden, heads = cfg["num_layers"], cfg["hidden_size"], cfg["num_heads"]

    if arch in ("granite", "granitemoe"):
        logit = num("logit_scale", float, 1.0)
        if not logit > 0:
            raise CheckpointError(f"{f.path}: metadata {arch}.logit_scale is {logit}, expected a number > 0 (the "
                                  f"logits are divided by it)")
        return dict(embedding_scale=num("embedding_scale", float, 1.0),
                    residual_scale=num("residual_scale", float, 1.0), logit_scale=1.0 / logit,
                    attention_scale=num("attention.scale", float, 0.0))
    if arch in ("gemma2", "gemma3"):
        big = layers == (46 if arch == "gemma2" else 62)  # the 27B models scale by hidden / heads
        window = num("attention.sliding_window", int, 0)
        pattern = num("attention.sliding_window_pattern", int, 0) or (2 if arch == "gemma2" else 6)
        sliding = tuple(i for i in range(layers) if (i + 1) % pattern) if arch == "gemma3" else tuple(
            range(0, layers, 2))
        return dict(hidden_act="gelu_tanh", embedding_scale=float(hidden) ** 0.5, sandwich_norms=True,
                    attention_scale=(hidden / heads if big else cfg["head_dim"]) ** -0.5,
                    final_logit_softcap=num("final_logit_softcapping", float, 0.0),
                    attn_logit_softcap=num("attn_logit_softcapping", float, 0.0),
                    sliding_window=window, sliding_layers=sliding if window else (),
                    local_rope_theta=num("rope.freq_base_swa", float, 10000.0) if arch == "gemma3"
                    else 0.0)
    if arch == "phi3":
        if cfg["head_dim"] != (num("rope.dimension_count", int, 0) or cfg["head_dim"]):
            raise CheckpointError(f"{f.path}: phi3.rope.dimension_count below the head size (partial rotary) is not "
                                  f"supported")
        window = num("attention.sliding_window", int, 0)
        if window and window < cfg["max_position_embeddings"]:
            return dict(sliding_window=window, sliding_layers=tuple(range(layers)))
        return {}
    window = num("attention.sliding_window", int, 0) if arch == "llama" else 0  # (Mistral converts as llama)
    if window and window < cfg["max_position_embeddings"]:  # (full attention is exact up to the window, so serve
        return dict(max_position_embeddings=window)  # no further, as models.loader does for Mistral's config.json)
    return {}
