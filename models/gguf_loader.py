"""GGUF checkpoints: Llama-family (Llama, Mistral, SmolLM, Mixtral), Qwen2, Qwen3, Qwen2-MoE and Qwen3-MoE
tensors in any type the ``gguf`` package dequantizes (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_*, the K-quants, ...),
dequantized at load to the serving dtype; on the CPU in bfloat16, Q4_0 and Q4_1 projections stay 4-bit
(``keep_int4``: the int4 CPU GEMM reads a quarter of the bytes).

The header (metadata and tensor table) is parsed here with ``struct`` over a memory map: the ``gguf`` package's
GGUFReader builds a numpy view per metadata string and takes about 7 s on the 49K-token vocabulary of
SmolLM2-135M, longer than the whole load may take. The format's constants and every dequantization come from the
``gguf`` package.

llama.cpp's converter reorders the rows of Llama-family Q and K projections (each head's rotary halves
interleaved, for its GPT-J-style rotary); ``unpermute_qk`` undoes that, so that these weights serve the
Neox-style rotary the Hugging Face layout uses. Qwen GGUFs are stored unpermuted.

Tensors are mapped to their Hugging Face names and assembled by ``models.loader.fill_model``, the same code the
safetensors path uses. The tokenizer and chat template in the metadata are read by ``models.text``.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from dataclasses import dataclass

import logging

import numpy as np
import torch
from torch import nn

from models.config import ModelConfig, RopeScaling
from models.fp8 import QuantizationError, checkpoint_scheme
from models.int4 import INT4_TYPES, Int4Linear, ggml_int4_groups, int4_available
from models.checkpoint import CheckpointError, fill_model, hf_names, param_target, serving_dtype
from models.layers import RotaryEmbedding
from models.parallel import TensorParallel, param_pieces
from models.transformer import CausalLM, build_model

log = logging.getLogger(__name__)

GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                      "qwen3moe": "qwen3_moe", "granite": "granite", "granitemoe": "granitemoe", "gemma2": "gemma2",
                      "gemma3": "gemma3_text", "phi3": "phi3"}
PERMUTED = ("llama", "mixtral", "granite", "granitemoe")
"""Model types whose Q and K rows llama.cpp's converter permutes (its LlamaModel and the classes built on it)."""
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
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-end // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, ggml_type, offset in tensors:
            try:
                qtype = GGMLQuantizationType(ggml_type)
            except ValueError:
                raise CheckpointError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            count = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if dims and dims[0] % block:
                raise CheckpointError(f"{path}: tensor {name!r} has rows of {dims[0]} values, not a multiple of "
                                      f"{qtype.name}'s block of {block}")
            info = TensorInfo(name, tuple(reversed(dims)), ggml_type, data_start + offset, count // block * type_size)
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
    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor dequantized to float32 by the ``gguf`` package, then cast to ``dtype``."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.start)
        if qtype == GGMLQuantizationType.F32:
            return torch.from_numpy(raw.view(np.float32).reshape(info.shape).copy()).to(dtype)
        if qtype == GGMLQuantizationType.F16:
            return torch.from_numpy(raw.view(np.float16).reshape(info.shape).copy()).to(dtype)
        if qtype == GGMLQuantizationType.BF16:
            return torch.from_numpy(raw.view(np.int16).reshape(info.shape).copy()).view(torch.bfloat16).to(dtype)
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_values = info.shape[-1] if info.shape else 1
        rows = raw.reshape(-1, row_values // block * type_size)
        try:
            values = dequantize(rows, qtype)
        except NotImplementedError:
            raise CheckpointError(f"{self.path}: tensor {name!r} is {qtype.name}, which the gguf package cannot "
                                  f"dequantize") from None
        return torch.from_numpy(values.reshape(info.shape)).to(dtype)

    def int4_groups(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A Q4_0 / Q4_1 matrix as (codes, scale, zero) (``models.int4.ggml_int4_groups``); None for other types."""
        from gguf.constants import GGMLQuantizationType

        info = self.tensors[name]
        type_name = GGMLQuantizationType(info.ggml_type).name
        if type_name not in INT4_TYPES or len(info.shape) != 2:
            return None
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.start)
        return tuple(torch.from_numpy(a) for a in ggml_int4_groups(raw, type_name, info.shape))


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


# ---------------------------------------------------------------------------------------------------------------
# metadata -> ModelConfig
# ---------------------------------------------------------------------------------------------------------------


def config_from_gguf(f: GGUFFile) -> tuple[str, ModelConfig]:
    """(the Hugging Face model_type its tensors map to, the model's shape) from the metadata and tensor table."""
    md, t = f.metadata, f.tensors
    arch = md.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{f.path}: GGUF architecture {arch!r} is not supported; supported: "
                              f"{', '.join(GGUF_ARCHITECTURES)}")

    def need(key):
        value = md.get(f"{arch}.{key}")
        if value is None:
            raise CheckpointError(f"{f.path}: metadata {arch}.{key} is missing")
        if isinstance(value, list):
            raise CheckpointError(f"{f.path}: metadata {arch}.{key} varies per layer, which is not supported")
        return value

    if "token_embd.weight" not in t:
        raise CheckpointError(f"{f.path}: tensor 'token_embd.weight' is missing")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(md.get(f"{arch}.attention.key_length") or md.get(f"{arch}.rope.dimension_count") or
                   hidden // heads)
    experts = int(md.get(f"{arch}.expert_count") or 0)
    kind = GGUF_ARCHITECTURES[arch] if not (arch == "llama" and experts) else "mixtral"
    scaling = None
    scaling_type = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear" or arch == "gemma3" and md.get(f"{arch}.rope.scaling.factor"):
        scaling = RopeScaling("linear", float(need("rope.scaling.factor")))
    elif scaling_type == "yarn":
        factor = float(need("rope.scaling.factor"))
        scaling = RopeScaling("yarn", factor, original_max_position_embeddings=int(
            need("rope.scaling.original_context_length")), attention_factor=0.1 * math.log(factor) + 1.0)
    elif scaling_type not in ("none", None):
        raise CheckpointError(f"{f.path}: rope scaling type {scaling_type!r} is not supported (none, linear or yarn)")
    if "rope_factors_long.weight" in t:  # Phi-3's LongRoPE, as llama.cpp's converter writes it
        original = int(need("rope.scaling.original_context_length"))
        scaling = RopeScaling("longrope", int(need("context_length")) / original,
                              original_max_position_embeddings=original,
                              attention_factor=float(md.get(f"{arch}.rope.scaling.attn_factor", 1.0)),
                              short_factor=tuple(f.tensor("rope_factors_short.weight").tolist()),
                              long_factor=tuple(f.tensor("rope_factors_long.weight").tolist()))
    eos = [md.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    cfg = dict(
        vocab_size=t["token_embd.weight"].shape[0], hidden_size=hidden, num_layers=int(need("block_count")),
        num_heads=heads, num_kv_heads=int(md.get(f"{arch}.attention.head_count_kv") or heads), head_dim=head_dim,
        intermediate_size=int(md.get(f"{arch}.feed_forward_length") or 0),
        rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)), rope_scaling=scaling,
        rms_norm_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in t,
        max_position_embeddings=int(md.get(f"{arch}.context_length", 8192)),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        attention_bias="blk.0.attn_q.bias" in t, qk_norm="blk.0.attn_q_norm.weight" in t,
    )
    cfg.update(_arch_extras(f, arch, cfg))
    if experts:
        moe_inter = md.get(f"{arch}.expert_feed_forward_length")
        if moe_inter is None and "blk.0.ffn_up_exps.weight" in t:
            moe_inter = t["blk.0.ffn_up_exps.weight"].shape[1]
        shared = md.get(f"{arch}.expert_shared_feed_forward_length")
        if shared is None and "blk.0.ffn_up_shexp.weight" in t:
            shared = t["blk.0.ffn_up_shexp.weight"].shape[0]
        norm_topk = md.get(f"{arch}.expert_weights_norm", kind != "qwen2_moe")  # llama.cpp's defaults
        cfg.update(num_experts=experts, num_experts_per_token=int(need("expert_used_count")),
                   moe_intermediate_size=int(moe_inter or cfg["intermediate_size"]), norm_topk_prob=bool(norm_topk),
                   shared_expert_intermediate_size=int(shared or 0) if kind == "qwen2_moe" else 0)
    try:
        out = ModelConfig(**cfg)
        out.validate()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{f.path}: {exc}") from None
    return kind, out


def _arch_extras(f: GGUFFile, arch: str, cfg: dict) -> dict:
    """What Granite, Gemma and Phi-3 add to the config, from their metadata and llama.cpp's own rules where the
    converter writes none (Gemma 2 and 3: the sliding-window pattern, Gemma 3's local rope base, the attention
    scale of the 27B models, as llama.cpp's llama-model.cpp sets them)."""
    md, layers, hidden, heads = f.metadata, cfg["num_layers"], cfg["hidden_size"], cfg["num_heads"]
    if arch in ("granite", "granitemoe"):
        logit = float(md.get(f"{arch}.logit_scale", 1.0))
        return dict(embedding_scale=float(md.get(f"{arch}.embedding_scale", 1.0)),
                    residual_scale=float(md.get(f"{arch}.residual_scale", 1.0)), logit_scale=1.0 / logit,
                    attention_scale=float(md.get(f"{arch}.attention.scale", 0.0)))
    if arch in ("gemma2", "gemma3"):
        big = layers == (46 if arch == "gemma2" else 62)  # the 27B models scale by hidden / heads
        window = int(md.get(f"{arch}.attention.sliding_window") or 0)
        pattern = int(md.get(f"{arch}.attention.sliding_window_pattern") or (2 if arch == "gemma2" else 6))
        sliding = tuple(i for i in range(layers) if (i + 1) % pattern) if arch == "gemma3" else tuple(
            range(0, layers, 2))
        return dict(hidden_act="gelu_tanh", embedding_scale=float(hidden) ** 0.5, sandwich_norms=True,
                    attention_scale=(hidden / heads if big else cfg["head_dim"]) ** -0.5,
                    final_logit_softcap=float(md.get(f"{arch}.final_logit_softcapping") or 0.0),
                    attn_logit_softcap=float(md.get(f"{arch}.attn_logit_softcapping") or 0.0),
                    sliding_window=window, sliding_layers=sliding if window else (),
                    local_rope_theta=float(md.get(f"{arch}.rope.freq_base_swa", 10000.0)) if arch == "gemma3"
                    else 0.0)
    if arch == "phi3":
        if cfg["head_dim"] != int(md.get("phi3.rope.dimension_count") or cfg["head_dim"]):
            raise CheckpointError(f"{f.path}: phi3.rope.dimension_count below the head size (partial rotary) is not "
                                  f"supported")
        window = int(md.get("phi3.attention.sliding_window") or 0)
        if window and window < cfg["max_position_embeddings"]:
            return dict(sliding_window=window, sliding_layers=tuple(range(layers)))
    return {}


# ---------------------------------------------------------------------------------------------------------------
# tensors by Hugging Face name
# ---------------------------------------------------------------------------------------------------------------

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")
_EXPERT_TENSOR = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                  "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


_GEMMA_NORMS = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
"""Gemma's names (its post_attention_layernorm is the attention output's norm, not the MLP's input norm)."""
_FUSED_NAMES = {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
                "block_sparse_moe.router.layer.weight": "ffn_gate_inp.weight",
                "block_sparse_moe.output_linear.weight": "ffn_down_exps.weight"}
"""Phi-3's fused projections (llama.cpp keeps them fused: ffn_up holds gate then up), Granite-MoE's router and
stacked down experts."""


def gguf_name(hf_name: str, kind: str = "llama") -> tuple[str, int | None]:
    """The GGUF tensor holding a Hugging Face tensor, and the expert index within it (None: the whole tensor)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name], None
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if m is None:
        raise KeyError(hf_name)
    layer, rest = m.groups()
    if kind in ("gemma2", "gemma3_text") and rest in _GEMMA_NORMS:
        return f"blk.{layer}.{_GEMMA_NORMS[rest]}", None
    if rest in _FUSED_NAMES:
        return f"blk.{layer}.{_FUSED_NAMES[rest]}", None
    proj = re.fullmatch(r"self_attn\.([qkv])_proj\.(weight|bias)", rest)
    if proj:
        return f"blk.{layer}.attn_{proj.group(1)}.{proj.group(2)}", None
    expert = _EXPERT.fullmatch(rest)
    if expert:
        return f"blk.{layer}.{_EXPERT_TENSOR[expert.group(2)]}.weight", int(expert.group(1))
    return f"blk.{layer}.{_LAYER_NAMES[rest]}", None


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter permutation of a Q or K projection (rows, ...) of ``num_heads`` heads: it
    interleaves each head's two rotary halves; this puts them back one after the other."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter permutation (the inverse of ``unpermute_qk``), for writing Llama-family GGUFs."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFSource:
    """A GGUF file's tensors under their Hugging Face names, dequantized (float32, then the model's dtype)."""

    def __init__(self, f: GGUFFile, kind: str, cfg: ModelConfig, dtype: torch.dtype):
        self.file, self.where, self.cfg, self.dtype, self.kind = f, f.path, cfg, dtype, kind
        self.permuted = kind in PERMUTED
        self._stacked: dict[str, torch.Tensor] = {}

    def describe(self, name: str) -> str:
        if name.endswith("block_sparse_moe.input_linear.weight"):
            return name.replace("model.layers.", "blk.").replace(".block_sparse_moe.input_linear.weight",
                                                                 ".ffn_gate_exps.weight + ffn_up_exps.weight")
        try:
            g, expert = gguf_name(name, self.kind)
        except KeyError:
            return name
        return g if expert is None else f"{g}[{expert}]"

    def get(self, name: str) -> torch.Tensor:
        if name.endswith("block_sparse_moe.input_linear.weight"):  # Granite-MoE: gate and up experts stacked
            layer = name.split(".")[2]
            return torch.cat([self.get_named(f"blk.{layer}.ffn_{x}_exps.weight", name) for x in ("gate", "up")], 1)
        try:
            g, expert = gguf_name(name, self.kind)
        except KeyError:
            raise CheckpointError(f"{self.where}: no GGUF tensor corresponds to {name!r}") from None
        if expert is None:
            return self.get_named(g, name)
        if g not in self.file.tensors:
            raise CheckpointError(f"{self.where}: tensor {g!r} is missing (needed for {name})")
        if g not in self._stacked:  # one expert of a stacked tensor
            if len(self._stacked) >= 3:  # one layer's gate, up and down experts at a time
                self._stacked.clear()
            self._stacked[g] = self.file.tensor(g, self.dtype)
        stacked = self._stacked[g]
        if expert >= stacked.shape[0]:
            raise CheckpointError(f"{self.where}: {g} holds {stacked.shape[0]} experts, expected "
                                  f"{self.cfg.num_experts}")
        return stacked[expert]

    def get_named(self, g: str, name: str) -> torch.Tensor:
        """GGUF tensor ``g`` (which holds Hugging Face tensor ``name``), dequantized, in the Hugging Face layout."""
        if g not in self.file.tensors:
            raise CheckpointError(f"{self.where}: tensor {g!r} is missing (needed for {name})")
        t = self.file.tensor(g, self.dtype)
        if g.endswith("ffn_gate_inp_shexp.weight"):
            t = t.reshape(1, -1)  # (hidden,) in GGUF, (1, hidden) in the Hugging Face layout
        if self.permuted and (g.endswith("attn_q.weight") or g.endswith("attn_k.weight")):
            heads = self.cfg.num_heads if g.endswith("attn_q.weight") else self.cfg.num_kv_heads
            if t.shape[0] % (2 * heads):
                raise CheckpointError(f"{self.where}: {g} has {t.shape[0]} rows, not {heads} heads of even size")
            t = unpermute_qk(t, heads)
        return t


def is_4bit(f: GGUFFile) -> bool:
    """Whether the file's first layer's attention projections are all 4-bit (Q4_0, Q4_1, Q4_K): how a 4-bit file
    (dense or MoE) is made."""
    from gguf.constants import GGMLQuantizationType

    names = [f"blk.0.{t}.weight" for t in ("attn_q", "attn_k", "attn_v", "attn_output")]
    infos = [f.tensors.get(n) for n in names]
    return all(i is not None and GGMLQuantizationType(i.ggml_type).name in ("Q4_0", "Q4_1", "Q4_K") for i in infos)


_INT4_PROJECTIONS = (("qkv_proj", ("attn_q", "attn_k", "attn_v")), ("o_proj", ("attn_output",)),
                     ("mlp.gate_up_proj", ("ffn_gate", "ffn_up")), ("mlp.down_proj", ("ffn_down",)))
"""Our dense projections and the GGUF tensors each concatenates (MoE experts stay dequantized)."""


def keep_int4(model: CausalLM, f: GGUFFile, kind: str) -> int:
    """Replace each projection whose GGUF tensors are all Q4_0 / Q4_1 by an ``Int4Linear`` read from the file's
    blocks (Llama-family Q and K rows unpermuted like the dequantized ones); its dequantized copy is dropped.
    Returns how many were replaced."""
    cfg, dtype, count = model.full_cfg, model.embed_tokens.weight.dtype, 0
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    for i, layer in enumerate(model.layers):
        for attr, sources in _INT4_PROJECTIONS:
            parent, _, leaf = attr.rpartition(".")
            owner = layer.get_submodule(parent) if parent else layer
            dense = getattr(owner, leaf, None)
            names = [f"blk.{i}.{t}.weight" for t in sources]
            if not isinstance(dense, nn.Linear) or not Int4Linear.fits(*dense.weight.shape) or any(
                    n not in f.tensors for n in names):
                continue
            groups = [f.int4_groups(n) for n in names]
            if any(g is None for g in groups):
                continue
            if kind in ("llama", "mixtral"):
                groups = [tuple(unpermute_qk(a, heads[t]) for a in g) if t in heads else g
                          for t, g in zip(sources, groups)]
            if model.tp is not None:  # a tensor-parallel rank's rows or whole groups of columns
                groups = _int4_shard(groups, param_pieces(f"layers.{i}.{attr}.weight", len(sources), cfg, model.tp))
                if groups is None:
                    log.info("layer %d %s: its shard splits a 4-bit group: kept dequantized", i, attr)
                    continue
            codes, scale, zero = (torch.cat(parts) for parts in zip(*groups))
            setattr(owner, leaf, Int4Linear(codes, scale, zero, dense.bias, dtype))
            count += 1
    return count


def _int4_shard(groups: list[tuple[torch.Tensor, ...]], pieces) -> list[tuple[torch.Tensor, ...]] | None:
    """Each part's (codes, scale, zero) cut to its pieces (``models.parallel.param_pieces``): rows as they are,
    columns in whole groups of GROUP_SIZE (None where a piece would split a group)."""
    from models.int4 import GROUP_SIZE

    out = []
    for group, part_pieces in zip(groups, pieces):
        cut = []
        for dim, start, stop in part_pieces:
            if dim == 0:
                cut.append(tuple(a[start:stop] for a in group))
            elif start % GROUP_SIZE or stop % GROUP_SIZE:
                return None
            else:
                codes, scale, zero = group
                g0, g1 = start // GROUP_SIZE, stop // GROUP_SIZE
                cut.append((codes[:, start:stop], scale[:, g0:g1], zero[:, g0:g1]))
        out.append(tuple(torch.cat(a, dim=part_pieces[0][0]) for a in zip(*cut)))
    return out


def load_gguf(path: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
              quantization: str | None = None, max_model_len: int | None = None,
              tp: TensorParallel | None = None) -> CausalLM:
    """A GGUF file as a CausalLM, every tensor dequantized to ``dtype`` (default: ``models.checkpoint.serving_dtype``);
    on the CPU in bfloat16, Q4_0 and Q4_1 projections stay 4-bit instead (``keep_int4``, ``models.int4``).
    ``quantization`` "fp8": the dequantized projections requantized to FP8 (``models.fp8``)."""
    f = open_gguf(path)
    kind, cfg = config_from_gguf(f)
    dtype = dtype or serving_dtype(device, is_4bit(f))
    try:
        scheme = checkpoint_scheme({}, path, quantization)
    except QuantizationError as exc:
        raise CheckpointError(str(exc)) from None
    model = fill_model(build_model(cfg, device, dtype, seed=None, fp8=scheme, max_model_len=max_model_len, tp=tp),
                       kind, GGUFSource(f, kind, cfg, dtype), scheme)
    if scheme is None and int4_available(device, dtype):
        kept = keep_int4(model, f, kind)
        if kept:
            log.info("%s: %d projections kept 4-bit (int4 CPU GEMM)", os.path.basename(path), kept)
    if "rope_freqs.weight" in f.tensors:  # llama.cpp's form of Llama 3 rope scaling: per-frequency divisors
        factors = f.tensor("rope_freqs.weight")
        if factors.shape != (cfg.head_dim // 2,):
            raise CheckpointError(f"{path}: rope_freqs.weight has shape {tuple(factors.shape)}, expected "
                                  f"({cfg.head_dim // 2},)")
        with torch.device(device):
            model.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                           cfg.rope_scaling, factors)
    return model


# ---------------------------------------------------------------------------------------------------------------
# writing (tests and tools)
# ---------------------------------------------------------------------------------------------------------------


def add_metadata(writer, metadata: dict) -> None:
    """GGUF key-value metadata (tokenizer fields and the like) onto a ``gguf.GGUFWriter``: bools, ints as uint32,
    strings, everything else as an array."""
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)


def write_gguf(model: CausalLM, path: str, model_type: str, qtype: str = "F32",
               tokenizer_metadata: dict | None = None) -> None:
    """Write ``model`` as a GGUF file the way llama.cpp's converter lays it out (Llama-family Q/K rows
    permuted; norms, biases and routers in F32, every other matrix in ``qtype``, quantized by the gguf
    package). ``tokenizer_metadata``: extra keys such as ``tokenizer.ggml.tokens`` (values typed by GGUFWriter)."""
    import gguf

    arch = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
            "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[model_type]
    cfg = model.cfg
    quant = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_layers)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.eos_token_ids:
        w.add_eos_token_id(cfg.eos_token_ids[0])
    if cfg.is_moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_token)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    add_metadata(w, tokenizer_metadata or {})
    tensors: dict[str, np.ndarray] = {}
    stacks: dict[str, list[np.ndarray]] = {}
    for ours, theirs, dim in hf_names(cfg, model_type):
        value = param_target(model, ours).detach().float().cpu()
        if ours.endswith("qkv_proj.weight") or ours.endswith("qkv_proj.bias"):
            parts = value.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim)
        else:
            parts = value.chunk(len(theirs), dim)
        for hf, part in zip(theirs, parts):
            g, expert = gguf_name(hf)
            if arch == "llama" and (g.endswith("attn_q.weight") or g.endswith("attn_k.weight")):
                part = permute_qk(part, cfg.num_heads if g.endswith("attn_q.weight") else cfg.num_kv_heads)
            if g.endswith("ffn_gate_inp_shexp.weight"):
                part = part.reshape(-1)
            if expert is None:
                tensors[g] = part.contiguous().numpy()
            else:
                stacks.setdefault(g, []).append(part.contiguous().numpy())
    tensors.update({g: np.stack(parts) for g, parts in stacks.items()})
    for g, array in tensors.items():
        keep_f32 = array.ndim == 1 or g.endswith("ffn_gate_inp.weight") or quant == gguf.GGMLQuantizationType.F32
        if keep_f32:
            w.add_tensor(g, array.astype(np.float32))
        else:
            w.add_tensor(g, gguf.quants.quantize(array.astype(np.float32), quant), raw_dtype=quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

