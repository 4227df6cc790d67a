"""GGUF checkpoints: Llama-family (Llama, Mistral, SmolLM, Mixtral), Qwen2, Qwen3, Qwen2-MoE and Qwen3-MoE
tensors in any type the ``gguf`` package dequantizes (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_*, the K-quants, ...),
dequantized at load to the serving dtype; on the CPU in bfloat16, Q4_0 and Q4_1 projections stay 4-bit
(``keep_int4``: the int4 CPU GEMM reads a quarter of the bytes).

The header (metadata and tensor table) and the model's shape are ``models.gguf_file``'s (it imports no torch); the
format's constants come from the ``gguf`` package, and so does every dequantization but Q8_0's, Q4_0's and Q4_1's,
which ``models.gguf_file.decode_blocks`` does with torch on the device the weights go to.

llama.cpp's converter reorders the rows of Llama-family Q and K projections (each head's rotary halves
interleaved, for its GPT-J-style rotary); ``unpermute_qk`` undoes that, so that these weights serve the
Neox-style rotary the Hugging Face layout uses. Qwen GGUFs are stored unpermuted.

Tensors are mapped to their Hugging Face names and assembled by ``models.loader.fill_model``, the same code the
safetensors path uses. The tokenizer and chat template in the metadata are read by ``models.text``.
"""

from __future__ import annotations

import os
import re

import logging

import numpy as np
import torch
from torch import nn

from models.config import ModelConfig
from models.gguf_file import GGUFFile, config_from_gguf, open_gguf
from models.fp8 import QuantizationError, checkpoint_scheme
from models.int4 import Int4Linear, int4_available
from models.checkpoint import CheckpointError, fill_model, hf_names, param_target, serving_dtype
from models.layers import RotaryEmbedding
from models.parallel import TensorParallel, param_pieces
from models.transformer import CausalLM, build_model

log = logging.getLogger(__name__)

PERMUTED = ("llama", "mixtral", "granite", "granitemoe")
"""Model types whose Q and K rows llama.cpp's converter permutes (its LlamaModel and the classes built on it)."""

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
    """A GGUF file's tensors under their Hugging Face names, dequantized (float32, then the model's dtype) on
    ``device`` (``GGUFFile.tensor``)."""

    def __init__(self, f: GGUFFile, kind: str, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.file, self.where, self.cfg, self.dtype, self.kind, self.device = f, f.path, cfg, dtype, kind, device
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
            self._stacked[g] = self.file.tensor(g, self.dtype, self.device)
        stacked = self._stacked[g]
        if expert >= stacked.shape[0]:
            raise CheckpointError(f"{self.where}: {g} holds {stacked.shape[0]} experts, expected "
                                  f"{self.cfg.num_experts}")
        return stacked[expert]

    def get_named(self, g: str, name: str) -> torch.Tensor:
        """GGUF tensor ``g`` (which holds Hugging Face tensor ``name``), dequantized, in the Hugging Face layout."""
        if g not in self.file.tensors:
            raise CheckpointError(f"{self.where}: tensor {g!r} is missing (needed for {name})")
        t = self.file.tensor(g, self.dtype, self.device)
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
            if kind in PERMUTED:
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


EXTRA_READ = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
"""Tensors read besides the parameters: Llama 3's rope factors (``load_gguf``), Phi-3's LongRoPE factors
(``models.gguf_file.config_from_gguf``, which refuses one without the other)."""


def tensors_read(kind: str, cfg: ModelConfig) -> set[str]:
    """The GGUF tensors a model of ``cfg`` reads (``fill_model``'s parameters by their GGUF names)."""
    out = set(EXTRA_READ)
    for _, theirs, _ in hf_names(cfg, kind):
        for hf in theirs:
            if hf.endswith("block_sparse_moe.input_linear.weight"):  # Granite-MoE: gate and up experts stacked
                layer = hf.split(".")[2]
                out.update(f"blk.{layer}.ffn_{x}_exps.weight" for x in ("gate", "up"))
            else:
                out.add(gguf_name(hf, kind)[0])
    return out


def check_all_tensors_read(f: GGUFFile, kind: str, cfg: ModelConfig) -> None:
    """Refuse a file with a tensor the model would not read (a bias or a norm this loader does not serve; a block
    past block_count is refused before, by ``config_from_gguf``): serving without it would compute something other
    than the file describes."""
    unread = sorted(set(f.tensors) - tensors_read(kind, cfg))
    if not unread:
        return
    name = unread[0]
    if name.endswith("attn_k_norm.weight") and not cfg.qk_norm:
        why = "q/k norms are read only where the file has attn_q_norm as well"
    else:
        why = f"the {kind} model this metadata describes has no such tensor"
    raise CheckpointError(f"{f.path}: tensor {name!r} ({len(unread)} unread in all) is not read by the loader: "
                          f"{why}; refusing rather than serving the model without it")


def load_gguf(path: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
              quantization: str | None = None, max_model_len: int | None = None,
              tp: TensorParallel | None = None) -> CausalLM:
    """A GGUF file as a CausalLM, every tensor dequantized to ``dtype`` (default: ``models.checkpoint.serving_dtype``);
    on the CPU in bfloat16, Q4_0 and Q4_1 projections stay 4-bit instead (``keep_int4``, ``models.int4``).
    ``quantization`` "fp8": the dequantized projections requantized to FP8 (``models.fp8``)."""
    f = open_gguf(path)
    kind, cfg = config_from_gguf(f)
    check_all_tensors_read(f, kind, cfg)
    dtype = dtype or serving_dtype(device, is_4bit(f))
    try:
        scheme = checkpoint_scheme({}, path, quantization)
    except QuantizationError as exc:
        raise CheckpointError(str(exc)) from None
    model = fill_model(build_model(cfg, device, dtype, seed=None, fp8=scheme, max_model_len=max_model_len, tp=tp),
                       kind, GGUFSource(f, kind, cfg, dtype, device), scheme)
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

