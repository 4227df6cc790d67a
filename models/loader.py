"""Checkpoints: a Hugging Face directory (``config.json``, ``*.safetensors`` single or sharded with
``model.safetensors.index.json``, ``generation_config.json``), a ``.gguf`` file (``models.gguf_loader``), or a
preset name (random weights, for benchmarks and tests only).

Architectures: Llama / Mistral, Qwen2, Qwen3 (per-head q/k norms), Mixtral, Qwen2-MoE, Qwen3-MoE. Separate Q/K/V
and gate/up projections are concatenated into the fused layouts; expert weights are stacked. Every problem is a
CheckpointError naming the file, the tensor and the expected shape. ``save_checkpoint`` writes the Hugging Face
format (for tests and tools).
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch

from models.checkpoint import CheckpointError, check_finite_weights, fill_model, hf_names, param_target, serving_dtype
from models.config import ModelConfig, RopeScaling, checked_config, model_kind, preset, read_json
from models.fp8 import Fp8Scheme, QuantizationError, checkpoint_scheme
from models.gguf_file import config_from_gguf, open_gguf
from models.gguf_loader import is_4bit, load_gguf
from models.parallel import TensorParallel
from models.transformer import CausalLM, build_model

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "granite", "granitemoe",
                 "gemma2", "gemma3_text", "phi3")
"""Hugging Face ``model_type`` values this loader reads."""
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "granitemoe")
ARCH_DEFAULTS = {
    "mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5},
    "phi3": {"rms_norm_eps": 1e-5},
    "gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256,
               "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3_text": {"rope_theta": 1e6, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh"},
    "granite": {"attention_multiplier": 1.0},
    "granitemoe": {"attention_multiplier": 1.0},
}
"""transformers' defaults (its config classes) for keys a config.json leaves out, where they are not the Llama
defaults (rope_theta 10000, rms_norm_eps 1e-6, silu) this loader otherwise assumes."""
GEMMA_TYPES = ("gemma2", "gemma3_text")


# ---------------------------------------------------------------------------------------------------------------
# config.json -> ModelConfig
# ---------------------------------------------------------------------------------------------------------------


def _eos_ids(path: str, **values) -> tuple[int, ...]:
    """The union of eos_token_id values (an int, a list of ints or None; ``values`` by the file that gives each), in
    first-seen order; CheckpointError for anything else (a string id would leave generation without its EOS)."""
    out: list[int] = []
    for where, v in values.items():
        for t in ([] if v is None else v if isinstance(v, list) else [v]):
            if isinstance(t, bool) or not isinstance(t, int):
                raise CheckpointError(f"{path}: {where} eos_token_id must be an integer or a list of integers, got "
                                      f"{v!r}")
            if t not in out:
                out.append(t)
    return tuple(out)


_ABSENT = object()


def _flag(d: dict, key: str, where: str, default: bool) -> bool:
    """``d[key]``, a JSON boolean (``default`` where absent or null); CheckpointError naming it otherwise ("false"
    as a string would read as true)."""
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _number(d: dict, key: str, where: str, default=_ABSENT, integer: bool = False):
    """``d[key]`` as a float (a finite number) or, ``integer``, an int (a whole number, not a bool; 64.0 passes as
    64), ``default`` where it is absent or null; CheckpointError naming ``where`` and the key otherwise."""
    return _as_number(d.get(key), key, where, default, integer)


def _as_number(value, key: str, where: str, default=_ABSENT, integer: bool = False):
    """``_number`` of a value already read (``key``: its name, for errors)."""
    if value is None:
        if default is _ABSENT:
            raise CheckpointError(f"{where}: missing {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CheckpointError(f"{where}: {key} must be a {'whole ' if integer else ''}number, got {value!r}")
    if integer:
        if value != int(value):
            raise CheckpointError(f"{where}: {key} must be a whole number, got {value!r}")
        return int(value)
    return float(value)


def _object(d: dict, key: str, where: str) -> dict:
    """``d[key]``, a JSON object ({} where absent or null); CheckpointError naming it otherwise."""
    value = d.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: {key} must be an object, got {value!r}")
    return value


def _rope(hf: dict, path: str) -> tuple[float, RopeScaling | None, float]:
    """(rope_theta, its scaling, the sliding-window layers' own base or 0) from ``rope_theta`` / ``rope_scaling``
    (and Gemma 3's ``rope_local_base_freq``) or (transformers 5) ``rope_parameters``, per layer type for Gemma 3."""
    params = _object(hf, "rope_parameters", path)
    local = 0.0
    if "full_attention" in params or "sliding_attention" in params:  # per layer type (Gemma 3)
        sliding = _object(params, "sliding_attention", f"{path}: rope_parameters")
        if sliding.get("rope_type", sliding.get("type", "default")) != "default":
            raise CheckpointError(f"{path}: rope_parameters.sliding_attention.rope_type "
                                  f"{sliding.get('rope_type', sliding.get('type'))!r} is not supported (the "
                                  f"sliding-window layers' rope must be 'default')")
        local = _number(sliding, "rope_theta", f"{path}: rope_parameters.sliding_attention", 0.0)
        params = _object(params, "full_attention", f"{path}: rope_parameters")
    if hf.get("model_type") == "gemma3_text":
        local = _number(hf, "rope_local_base_freq", path, local or 10000.0)
    default_theta = ARCH_DEFAULTS.get(hf.get("model_type"), {}).get("rope_theta", 10000.0)
    theta = _number(hf, "rope_theta", path, _number(params, "rope_theta", f"{path}: rope_parameters", default_theta))
    scaling = _object(hf, "rope_scaling", path) or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None, local
    if kind not in ("linear", "llama3", "yarn", "longrope", "su"):
        raise CheckpointError(f"{path}: rope scaling type {kind!r} is not supported (default, linear, llama3, yarn or "
                              f"longrope)")
    where = f"{path}: rope scaling {kind!r}"
    num = lambda key, default=_ABSENT: _number(scaling, key, where, default)  # noqa: E731
    original = scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    original = _as_number(original, "original_max_position_embeddings", where, None, integer=True)
    if kind == "linear":
        return theta, RopeScaling("linear", num("factor")), local
    if original is None:
        raise CheckpointError(f"{where} is missing 'original_max_position_embeddings'")
    if kind == "llama3":
        return theta, RopeScaling("llama3", num("factor"), num("low_freq_factor"), num("high_freq_factor"),
                                  original), local
    max_pos = _number(hf, "max_position_embeddings", path, integer=True)
    if kind == "yarn":
        if scaling.get("mscale") or scaling.get("mscale_all_dim"):
            raise CheckpointError(f"{path}: yarn rope scaling with mscale / mscale_all_dim is not supported")
        factor = num("factor", max_pos / original)  # (transformers: the context over the original, if absent)
        attention = num("attention_factor", 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
        return theta, RopeScaling("yarn", factor, original_max_position_embeddings=original,
                                  beta_fast=num("beta_fast", 32.0), beta_slow=num("beta_slow", 1.0),
                                  attention_factor=attention, truncate=bool(scaling.get("truncate", True))), local
    factor = num("factor", max_pos / original)
    attention = num("attention_factor", math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if not isinstance(values, list):
            raise CheckpointError(f"{where}: {key} must be a list of numbers, got {values!r}")
        factors[key] = tuple(_as_number(v, key, where) for v in values)
    return theta, RopeScaling("longrope", factor, original_max_position_embeddings=original,
                              attention_factor=attention, **factors), local


def _sliding_layers(hf: dict, kind: str, num_layers: int, path: str) -> tuple[int, ...]:
    """The sliding-window layers: ``layer_types`` where given, else Gemma 2's every other layer (from 0), Gemma 3's
    five of six (every sixth is global), Phi-3's all (with a window)."""
    types = hf.get("layer_types")
    if types:
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if kind == "gemma2":
        return tuple(range(0, num_layers, 2))
    if kind == "gemma3_text":
        pattern = _number(hf, "sliding_window_pattern", path, 6, integer=True)
        if pattern < 1:
            raise CheckpointError(f"{path}: sliding_window_pattern must be >= 1, got {pattern}")
        return tuple(i for i in range(num_layers) if (i + 1) % pattern)
    return tuple(range(num_layers))


HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
           "num_experts_per_token": "num_experts_per_tok"}
"""ModelConfig's fields as config.json names them, where they differ (for errors)."""


def _head_dim(hf: dict, hidden, heads):
    """config.json's head_dim, hidden_size / num_attention_heads where it is absent or null (0 is refused by
    ModelConfig.validate, not replaced)."""
    if hf.get("head_dim") is not None:
        return hf["head_dim"]
    return hidden // heads if type(hidden) is int and type(heads) is int and heads > 0 else 0


def _pre_attn_scale(hf: dict, path: str, head_dim) -> float:
    """Gemma's attention scale: query_pre_attn_scalar ** -0.5 (head_dim's where absent)."""
    scalar = _number(hf, "query_pre_attn_scalar", path, 0.0) or head_dim
    if not isinstance(scalar, (int, float)) or scalar <= 0:
        raise CheckpointError(f"{path}: query_pre_attn_scalar must be > 0, got {scalar!r}")
    return float(scalar) ** -0.5


def config_from_hf(hf: dict, path: str = "config.json", generation: dict | None = None) -> ModelConfig:
    """A ModelConfig from a ``config.json`` dict (and ``generation_config.json``'s, for its EOS ids)."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        arch = (hf.get("architectures") or [None])[0]
        named = f"model_type {kind!r}" + (f" ({arch})" if arch else "")
        raise CheckpointError(f"{path}: {named} is not supported; supported model types: {', '.join(ARCHITECTURES)}")
    archs = hf.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise CheckpointError(f"{path}: architectures must be a list of class names, got {archs!r}")
    other = [a for a in archs or () if "ForCausalLM" not in a]
    if other:  # (a classifier's or a base model's weights: no LM head, or one for another task)
        raise CheckpointError(f"{path}: architectures {other[0]!r} is not a causal language model (a ...ForCausalLM "
                              f"class); this server serves those only")

    hf = {**{k: v for k, v in ARCH_DEFAULTS.get(kind, {}).items() if k != "rope_theta"}, **hf}

    def need(key, *alternatives):
        for k in (key, *alternatives):
            if hf.get(k) is not None:
                return hf[k]
        raise CheckpointError(f"{path}: missing {key!r} (needed for model_type {kind})")

    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise CheckpointError(f"{path}: hidden_act {act!r} is not supported (silu, gelu_pytorch_tanh)")
    partial = hf.get("partial_rotary_factor") or _object(hf, "rope_parameters", path).get("partial_rotary_factor")
    if partial is not None and partial != 1.0:  # (transformers applies it to any model type)
        raise CheckpointError(f"{path}: partial_rotary_factor {partial!r} is not supported (1.0: rotary over the whole "
                              f"head, as Phi-3 and Phi-4 14B have)")
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError(f"{path}: use_bidirectional_attention = true (an encoder, such as EmbeddingGemma) is "
                              f"not supported: this server runs causal language models")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{path}: mlp_bias = true is not supported")
    if hf.get("shared_intermediate_size"):
        raise CheckpointError(f"{path}: shared_intermediate_size (GraniteMoeShared's shared expert) is not supported")
    if hf.get("attention_bias") and kind not in ("qwen2", "qwen2_moe"):
        raise CheckpointError(f"{path}: attention_bias = true is not supported for model_type {kind} (its output "
                              f"projection would need a bias)")
    if kind in MOE_TYPES and (hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers")):
        raise CheckpointError(f"{path}: decoder_sparse_step {hf.get('decoder_sparse_step')} / mlp_only_layers "
                              f"{hf.get('mlp_only_layers')}: only models whose every layer is MoE are supported")
    heads, hidden = need("num_attention_heads"), need("hidden_size")
    theta, scaling, local_theta = _rope(hf, path)
    max_pos = _number(hf, "max_position_embeddings", path, 8192, integer=True)
    window = _number(hf, "sliding_window", path, 0, integer=True)
    if window and (kind in ("mistral", "mixtral") or hf.get("use_sliding_window")) and window < max_pos:
        max_pos = window  # full attention is exact up to the window: serve no further
    cfg = dict(
        vocab_size=need("vocab_size"), hidden_size=hidden, num_layers=need("num_hidden_layers"), num_heads=heads,
        num_kv_heads=heads if hf.get("num_key_value_heads") is None else hf["num_key_value_heads"],
        head_dim=_head_dim(hf, hidden, heads),
        intermediate_size=need("intermediate_size"), rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=_number(hf, "rms_norm_eps", path, 1e-6),
        tie_word_embeddings=_flag(hf, "tie_word_embeddings", path, False),
        max_position_embeddings=max_pos, eos_token_ids=_eos_ids(path, **{"config.json's": hf.get("eos_token_id"),
                                                                  "generation_config.json's": (generation or {}).get(
                                                                      "eos_token_id")}),
        attention_bias=kind == "qwen2" or (kind == "qwen2_moe" and _flag(hf, "qkv_bias", path, True)),
        qk_norm=kind in ("qwen3", "qwen3_moe", "gemma3_text"),
        hidden_act="gelu_tanh" if act == "gelu_pytorch_tanh" else "silu",
    )
    if kind in ("granite", "granitemoe"):
        logits_scaling = _number(hf, "logits_scaling", path, 1.0)
        if logits_scaling <= 0:
            raise CheckpointError(f"{path}: logits_scaling must be > 0, got {logits_scaling}")
        cfg.update(embedding_scale=_number(hf, "embedding_multiplier", path, 1.0),
                   residual_scale=_number(hf, "residual_multiplier", path, 1.0), logit_scale=1.0 / logits_scaling,
                   attention_scale=_number(hf, "attention_multiplier", path, 0.0))
    if kind in GEMMA_TYPES:
        cfg.update(embedding_scale=float(hidden) ** 0.5, sandwich_norms=True,
                   attention_scale=_pre_attn_scale(hf, path, cfg["head_dim"]),
                   final_logit_softcap=_number(hf, "final_logit_softcapping", path, 0.0),
                   attn_logit_softcap=_number(hf, "attn_logit_softcapping", path, 0.0),
                   tie_word_embeddings=_flag(hf, "tie_word_embeddings", path, True), local_rope_theta=local_theta)
    if (kind in GEMMA_TYPES or kind == "phi3") and window and window < max_pos:
        cfg.update(sliding_window=window, sliding_layers=_sliding_layers(hf, kind, cfg["num_layers"], path))
    if kind in ("mixtral", "granitemoe"):
        cfg.update(num_experts=need("num_local_experts"), num_experts_per_token=need("num_experts_per_tok"),
                   moe_intermediate_size=need("intermediate_size"), norm_topk_prob=True)
    elif kind in ("qwen2_moe", "qwen3_moe"):
        cfg.update(num_experts=need("num_experts", "num_local_experts"),
                   num_experts_per_token=need("num_experts_per_tok"),
                   moe_intermediate_size=need("moe_intermediate_size"),
                   norm_topk_prob=_flag(hf, "norm_topk_prob", path, False),
                   shared_expert_intermediate_size=_number(hf, "shared_expert_intermediate_size", path, 0,
                                                           integer=True)
                   if kind == "qwen2_moe" else 0)
    return checked_config(cfg, path, {**HF_KEYS, **({"num_experts": "num_local_experts",
                                                      "moe_intermediate_size": "intermediate_size"}
                                                     if kind in ("mixtral", "granitemoe") else {})})


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face directories
# ---------------------------------------------------------------------------------------------------------------

INDEX_FILE = "model.safetensors.index.json"
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".rotary_emb.cos_cached", ".rotary_emb.sin_cached", ".input_scale",
                    ".q_scale")
"""Tensors a checkpoint may hold that the served model does without: rotary frequencies and cached cos / sin
(computed from the config), an FP8 checkpoint's static activation scales (activations are quantized per token,
dynamically, as vLLM does for dynamic schemes) and its query scales (the queries stay in the serving dtype). Any
other tensor nothing reads is refused: a checkpoint with weights this loader would drop (biases, norms, layers past
num_hidden_layers) is not the model it would serve."""


def safetensors_keys(path: str) -> list[str]:
    """The tensor names of a safetensors file, after checking that its header parses and that the file holds
    every byte the header points at (a truncated download fails here, not inside a read)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > size - 8:
                raise ValueError(f"its header claims {header_len} bytes")
            header = json.loads(fh.read(header_len))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None
    if 8 + header_len + end > size:
        raise CheckpointError(f"{path}: truncated safetensors file: its header places tensor data up to byte "
                              f"{8 + header_len + end}, the file has {size} bytes")
    return [k for k in header if k != "__metadata__"]


class SafetensorsDir:
    """A Hugging Face checkpoint's tensors: the shards its index names, or every ``*.safetensors`` file."""

    def __init__(self, path: str, norm_shift: float = 0.0):
        """``norm_shift``: added to every ``*norm.weight`` read (Gemma stores norm weights as w for 1 + w)."""
        from safetensors import safe_open

        self.where, self.norm_shift = path, norm_shift
        index_path = os.path.join(path, INDEX_FILE)
        weight_map = None
        if os.path.isfile(index_path):
            weight_map = read_json(index_path, "the shard index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path}: no 'weight_map' object naming each tensor's shard")
            files = sorted(set(weight_map.values()))
            for f in files:
                if not isinstance(f, str) or os.path.basename(f) != f or f.startswith("."):
                    raise CheckpointError(f"{index_path}: names shard {f!r}, which is not a file name in {path}")
                if not os.path.isfile(os.path.join(path, f)):
                    raise CheckpointError(f"{index_path}: names shard {f!r}, which is not in {path}")
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors files")
        self.file_of: dict[str, str] = {}
        for f in files:
            for key in safetensors_keys(os.path.join(path, f)):
                if key in self.file_of:  # (which one the model would get is an accident of order)
                    raise CheckpointError(f"{path}: tensor {key!r} is in both {self.file_of[key]} and {f}")
                self.file_of[key] = f
        for key, f in (weight_map or {}).items():
            if self.file_of.get(key) != f:
                raise CheckpointError(f"{index_path}: maps tensor {key!r} to {f}, but "
                                      + (f"it is in {self.file_of[key]}" if key in self.file_of else "no shard has it"))
        self.read: set[str] = set()
        """The tensors read so far (``unread``: what the model never used)."""
        self._handles = {}
        self._open = lambda f: safe_open(os.path.join(path, f), framework="pt")

    def unread(self) -> list[str]:
        """The checkpoint's tensors nothing has read, less those a served model does without (``IGNORED_SUFFIXES``)."""
        return sorted(k for k in self.file_of if k not in self.read and not k.endswith(IGNORED_SUFFIXES))

    def _handle(self, name: str):
        f = self.file_of.get(name)
        if f is None:
            raise CheckpointError(f"{self.where}: tensor {name!r} is missing")
        self.read.add(name)
        if f not in self._handles:
            try:
                self._handles[f] = self._open(f)
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{os.path.join(self.where, f)}: unreadable safetensors file ({exc})") from None
        return self._handles[f]

    def get(self, name: str) -> torch.Tensor:
        t = self._handle(name).get_tensor(name)
        return t.float() + self.norm_shift if self.norm_shift and name.endswith("norm.weight") else t

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """``start:stop`` along ``dim`` of a tensor, read alone (a tensor-parallel rank's shard; never a norm)."""
        return self._handle(name).get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]

    def describe(self, name: str) -> str:
        return name

    def close(self) -> None:
        self._handles.clear()


def read_hf_config(path: str) -> tuple[dict, ModelConfig]:
    """(config.json as a dict, the ModelConfig) of a checkpoint directory, with generation_config.json's EOS ids.
    A quantization the loader cannot serve is refused here (``quantization_scheme``)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face-format checkpoint directory)")
    hf = read_json(cfg_path, "the model config")
    cfg = config_from_hf(hf, cfg_path, generation_config(path))
    quantization_scheme(hf, cfg_path)
    return hf, cfg


def quantization_scheme(hf: dict, path: str, quantization: str | None = None) -> Fp8Scheme | None:
    """The checkpoint's FP8 scheme (``models.fp8.checkpoint_scheme``) as a CheckpointError when refused."""
    try:
        return checkpoint_scheme(hf, path, quantization)
    except QuantizationError as exc:
        raise CheckpointError(str(exc)) from None


def generation_config(path: str) -> dict:
    """``generation_config.json`` of a checkpoint directory ({} when it has none)."""
    gen_path = os.path.join(path, "generation_config.json")
    return read_json(gen_path, "the generation config") if os.path.isfile(gen_path) else {}


def load_checkpoint(path: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    quantization: str | None = None, max_model_len: int | None = None,
                    tp: TensorParallel | None = None) -> CausalLM:
    """A Hugging Face checkpoint directory as a CausalLM (float32 on the CPU, bfloat16 on CUDA by default). FP8
    checkpoints and ``quantization`` ("fp8": quantize at load) as ``models.fp8`` describes; ``max_model_len``: the
    longest sequence served (LongRoPE's factors). Gemma's norms, stored as w for (1 + w), load as 1 + w; an FP8 KV
    cache's ``self_attn.k_scale`` / ``v_scale`` are read where present (1.0 otherwise, as vLLM)."""
    hf, cfg = read_hf_config(path)
    scheme = quantization_scheme(hf, os.path.join(path, "config.json"), quantization)
    source = SafetensorsDir(path, norm_shift=1.0 if hf["model_type"] in GEMMA_TYPES else 0.0)
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    try:
        _check_tied_head(cfg, source)
        model = fill_model(build_model(cfg, device, dtype, seed=None, fp8=scheme, max_model_len=max_model_len,
                                       tp=tp), hf["model_type"], source, scheme)
        for i, layer in enumerate(model.layers):  # an FP8 KV cache's per-layer scales, where the checkpoint has them
            scales = [_kv_scale(source, f"model.layers.{i}.self_attn", x) for x in "kv"]
            if scales != [None, None]:
                k_scale, v_scale = (1.0 if x is None else x for x in scales)
                layer.attn = layer.attn._replace(k_scale=k_scale, v_scale=v_scale)
        unread = source.unread()
        if unread:
            more = f" and {len(unread) - 3} more" if len(unread) > 3 else ""
            raise CheckpointError(f"{path}: the checkpoint has tensors this model does not use: "
                                  f"{', '.join(map(repr, unread[:3]))}{more} (weights the loader would drop: an "
                                  f"architecture or a setting config.json does not declare)")
        return model
    finally:
        source.close()


KV_SCALE_NAMES = ("{x}_scale", "{x}_proj.output_scale", "kv_scale")
"""Where checkpoints keep an FP8 KV cache's scale for keys (x = k) or values (v), under a layer's self_attn, in the
order read (vLLM's names, AutoFP8's output scales, the older shared kv_scale, as vLLM maps them)."""


def _kv_scale(source: SafetensorsDir, attn: str, x: str) -> float | None:
    """An FP8 KV cache's scale for keys or values (``x``: "k" or "v") under ``attn``, the first of KV_SCALE_NAMES
    present (None: none, 1.0 then, as vLLM): one finite number > 0 (0 or NaN would zero or poison every cached key
    or value). The other names present are read too (one value serves)."""
    names = [name for name in (f"{attn}.{n.format(x=x)}" for n in KV_SCALE_NAMES) if name in source.file_of]
    values = []
    for name in names:
        t = source.get(name).float().reshape(-1)
        if t.numel() != 1 or not math.isfinite(float(t[0])) or float(t[0]) <= 0:
            raise CheckpointError(f"{source.where}: {name} must be one finite number > 0, got {t.tolist()[:4]}")
        values.append(float(t[0]))
    return values[0] if values else None


def _check_tied_head(cfg: ModelConfig, source: SafetensorsDir) -> None:
    """A config that ties the LM head to the embedding, in a checkpoint whose own ``lm_head.weight`` differs from
    it, is refused: transformers serves the stored head, vLLM the embedding, and one of them is wrong."""
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if cfg.tie_word_embeddings and head in source.file_of and embed in source.file_of:
        if not torch.equal(source.get(head), source.get(embed)):
            raise CheckpointError(f"{source.where}: config.json sets tie_word_embeddings (the LM head is the "
                                  f"embedding), but the checkpoint's {head} differs from {embed}: set "
                                  f"tie_word_embeddings to false to serve the stored head")


def save_checkpoint(model: CausalLM, path: str, model_type: str) -> None:
    """Write ``model`` as a Hugging Face checkpoint of ``model_type`` (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    cfg = model.cfg
    os.makedirs(path, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for ours, theirs, dim in hf_names(cfg, model_type):
        chunks = param_target(model, ours).detach().cpu().contiguous()
        if len(theirs) == 1:
            tensors[theirs[0]] = chunks.clone()
        elif ours.endswith("qkv_proj.weight") or ours.endswith("qkv_proj.bias"):
            for key, part in zip(theirs, chunks.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim)):
                tensors[key] = part.clone()
        else:
            for key, part in zip(theirs, chunks.chunk(2, dim)):
                tensors[key] = part.clone()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    hf = {"model_type": model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
          "intermediate_size": cfg.moe_intermediate_size if model_type == "mixtral" else cfg.intermediate_size,
          "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
          "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position_embeddings,
          "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else
          (cfg.eos_token_ids[0] if cfg.eos_token_ids else None)}
    if cfg.rope_scaling is not None:
        hf["rope_scaling"] = {k: v for k, v in vars(cfg.rope_scaling).items()}
    if model_type == "mixtral":
        hf.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_token)
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        hf.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_token,
                  moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                  shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(hf, fh, indent=2)


# ---------------------------------------------------------------------------------------------------------------
# --model: a directory, a .gguf file or a preset
# ---------------------------------------------------------------------------------------------------------------


def read_model_config(name_or_path: str, quantization: str | None = None) -> ModelConfig:
    """The model's shape without loading its weights; ``quantization`` (``--quantization``) is checked against
    the checkpoint (CheckpointError when it cannot be served)."""
    kind = model_kind(name_or_path)
    if kind == "hf":
        hf, cfg = read_hf_config(name_or_path)
        quantization_scheme(hf, os.path.join(name_or_path, "config.json"), quantization)
        return cfg
    quantization_scheme({}, "--quantization", quantization)
    if kind == "gguf":
        return config_from_gguf(open_gguf(name_or_path))[1]
    return preset(name_or_path)


def default_dtype(model: "ModelConfig | str", device: str | torch.device) -> torch.dtype:
    """The serving dtype when none is given (``models.checkpoint.serving_dtype``): bfloat16 on CUDA and for a GGUF
    file whose projections are 4-bit on the CPU; float32 for everything else on the CPU (presets, Hugging Face
    checkpoints, 8-bit and wider GGUFs)."""
    return serving_dtype(device, torch.device(device).type == "cpu" and isinstance(model, str)
                         and model_kind(model) == "gguf" and is_4bit(open_gguf(model)))


def load_model(name_or_path: str, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
               quantization: str | None = None, max_model_len: int | None = None,
               tp: TensorParallel | None = None) -> CausalLM:
    """A checkpoint directory, a .gguf file, or a preset name (random weights from ``seed``). ``quantization``
    ("fp8", vLLM's ``--quantization``): the projections quantized to FP8 at load (``models.fp8``);
    ``max_model_len``: the longest sequence served (LongRoPE's choice of factors); ``tp``: a tensor-parallel
    rank's shard (``models.parallel``), read alone from a checkpoint."""
    kind = model_kind(name_or_path)
    if kind == "hf":
        model = load_checkpoint(name_or_path, device, dtype, quantization, max_model_len, tp)
    elif kind == "gguf":
        model = load_gguf(name_or_path, device, dtype, quantization, max_model_len, tp)
    else:
        scheme = quantization_scheme({}, "--quantization", quantization)
        model = build_model(preset(name_or_path), device, dtype, seed, scheme, max_model_len, tp)
    if kind != "preset":
        check_finite_weights(model, name_or_path)
    if torch.device(device).type == "cuda":  # the load's transients (a GGUF decoded on the device, FP8 quantized
        torch.cuda.empty_cache()  # at load) released: the KV cache's sizing counts what the allocator reserves
    return model
