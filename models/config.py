"""Model shapes and presets (random weights of real models' shapes, so that timings transfer)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ACTIVATIONS = ("silu", "gelu_tanh")
"""The gated MLP's activation: SwiGLU (silu) or GeGLU with tanh-approximated GELU (Gemma's gelu_pytorch_tanh)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file, the field or tensor, and the expectation.
    (Here, with no torch to import, so that ``models.default_model`` and the server's start stay light.)"""


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling (Hugging Face's ``rope_scaling`` / ``rope_parameters``): ``linear`` divides every
    frequency by ``factor``; ``llama3`` (Llama 3.1+) divides the low frequencies by ``factor``, keeps the high ones
    and blends between ``low_freq_factor`` and ``high_freq_factor`` wavelengths; ``yarn`` (Qwen2.5 / Qwen3) blends
    interpolated and original frequencies between ``beta_fast`` and ``beta_slow`` rotations and scales cos and sin
    by ``attention_factor``; ``longrope`` (Phi-3 / Phi-4) divides each frequency by its own factor,
    ``short_factor`` while the served context (max_model_len) is within ``original_max_position_embeddings``,
    ``long_factor`` beyond (vLLM's and llama.cpp's rule), and scales cos and sin by ``attention_factor``."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def validate(self, head_dim: int) -> None:
        """ValueError naming the first field out of its range (the frequencies it gives would be NaN or wrong)."""
        where = f"rope_scaling ({self.rope_type})"
        for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{where}: {name} must be a finite number > 0, got {value!r}")
        if type(self.original_max_position_embeddings) is not int or self.original_max_position_embeddings < 1:
            raise ValueError(f"{where}: original_max_position_embeddings must be an integer >= 1, got "
                             f"{self.original_max_position_embeddings!r}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"{where}: high_freq_factor ({self.high_freq_factor}) must be above low_freq_factor "
                             f"({self.low_freq_factor})")
        if self.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                factors = getattr(self, name)
                if len(factors) != head_dim // 2:
                    raise ValueError(f"{where}: {name} has {len(factors)} entries, expected head_dim / 2 = "
                                     f"{head_dim // 2}")
                if not all(type(f) in (int, float) and math.isfinite(f) and f > 0 for f in factors):
                    raise ValueError(f"{where}: {name} must be finite numbers > 0")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer's shape."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    """Dense MLP width (ignored by MoE layers)."""
    num_experts: int = 0
    """0 for a dense model."""
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    """Renormalize the top-k routing weights (Mixtral); False: softmax over all experts, then top-k (Qwen2-MoE)."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE's shared expert (with a sigmoid gate) beside the routed ones; 0 for none."""
    attention_bias: bool = False
    """Bias on the Q, K and V projections (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm of the queries and keys before rotary embeddings (Qwen3)."""
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    eos_token_ids: tuple[int, ...] = ()
    """Every token id that ends generation (a checkpoint may have several: Llama 3's <|eot_id|> and
    <|end_of_text|>; ``generation_config.json`` adds its own)."""
    hidden_act: str = "silu"
    """The MLP's gate activation (ACTIVATIONS)."""
    embedding_scale: float = 1.0
    """The embedding's output is multiplied by this (Granite's embedding_multiplier; Gemma's sqrt(hidden_size))."""
    residual_scale: float = 1.0
    """Granite's residual_multiplier: each layer's attention and MLP outputs are multiplied by this before the
    residual add (the loader folds it into the output projections' weights)."""
    logit_scale: float = 1.0
    """The logits are multiplied by this (Granite: 1 / logits_scaling)."""
    final_logit_softcap: float = 0.0
    """Gemma 2: logits become cap * tanh(logits / cap) (0: none)."""
    attn_logit_softcap: float = 0.0
    """Gemma 2: attention scores become cap * tanh(scores / cap) (0: none)."""
    attention_scale: float = 0.0
    """The softmax scale of attention scores (0: head_dim ** -0.5; Granite's attention_multiplier, Gemma's
    query_pre_attn_scalar ** -0.5)."""
    sandwich_norms: bool = False
    """Gemma 2 / 3: norms after attention and after the MLP too (post_attention_layernorm, post_feedforward)."""
    sliding_window: int = 0
    """Tokens a sliding-window layer sees: its own position and the window - 1 before it (0: none)."""
    sliding_layers: tuple[int, ...] = ()
    """The layers that attend within ``sliding_window`` (Gemma: 5 of 6, Gemma 2: every other one)."""
    local_rope_theta: float = 0.0
    """Gemma 3: the rotary base of the sliding-window layers (unscaled); 0: they use rope_theta and rope_scaling."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def with_(self, **changes) -> "ModelConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self) -> None:
        """ValueError naming the first field of a wrong type or out of its range (a checkpoint's config read into
        this: ``models.loader``, ``models.gguf_file``)."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if type(value) is not int:  # (not a bool, nor a float that torch would refuse later)
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if type(value) not in (int, float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "max_position_embeddings") + (("moe_intermediate_size",) if self.is_moe else
                                                   ("intermediate_size",)):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name, limit in (("vocab_size", MAX_VOCAB_SIZE), ("max_position_embeddings", MAX_POSITIONS)):
            if getattr(self, name) > limit:
                raise ValueError(f"{name} must be at most {limit:,} (this server's limit), got {getattr(self, name):,}")
        for name in ("rms_norm_eps", "rope_theta", "embedding_scale", "residual_scale", "logit_scale"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("final_logit_softcap", "attn_logit_softcap", "attention_scale", "local_rope_theta",
                     "num_experts", "shared_expert_intermediate_size", "sliding_window"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.rope_scaling is not None:
            self.rope_scaling.validate(self.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.is_moe and not 1 <= self.num_experts_per_token <= self.num_experts:
            raise ValueError(f"num_experts_per_token must be in 1..num_experts ({self.num_experts}), "
                             f"got {self.num_experts_per_token}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        bad_eos = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if bad_eos:
            raise ValueError(f"eos_token_ids has {bad_eos[0]}, outside the vocabulary 0..{self.vocab_size - 1}")
        if self.rope_scaling is not None and self.rope_scaling.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(f"rope_scaling type {self.rope_scaling.rope_type!r} is not supported (one of "
                             f"{', '.join(ROPE_TYPES)})")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (one of {', '.join(ACTIVATIONS)})")
        if self.is_moe and self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r}: MoE layers serve silu only")
        bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        if bad or (self.sliding_layers and self.sliding_window < 1):
            raise ValueError(f"sliding_layers {list(self.sliding_layers)} need a sliding_window >= 1 and layer "
                             f"indices in 0..{self.num_layers - 1}")


def checked_config(fields: dict, where: str, names: dict[str, str]) -> ModelConfig:
    """A validated ModelConfig of ``fields``; CheckpointError prefixed with ``where``, each field named as the
    checkpoint names it (``names``: our field -> its key) where a ValueError from ``validate`` names it."""
    import re

    try:
        out = ModelConfig(**fields)
        out.validate()
    except (TypeError, ValueError) as exc:
        message = str(exc)
        for ours, theirs in names.items():
            message = re.sub(rf"\b{ours}\b", theirs, message)
        raise CheckpointError(f"{where}: {message}") from None
    return out


MAX_VOCAB_SIZE = 1 << 22
"""The largest vocabulary a config may declare (real ones stop near 262,144; the embedding is allocated from it)."""
MAX_POSITIONS = 1 << 22
"""The most positions a config may declare (the rotary table is allocated for all of them: 2 GiB at head_dim 128 in
float32; Qwen2.5-1M declares 1,010,000)."""

_INT_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
               "num_experts", "num_experts_per_token", "moe_intermediate_size", "shared_expert_intermediate_size",
               "max_position_embeddings", "sliding_window")
_FLOAT_FIELDS = ("rope_theta", "rms_norm_eps", "embedding_scale", "residual_scale", "logit_scale",
                 "final_logit_softcap", "attn_logit_softcap", "attention_scale", "local_rope_theta")


PRESETS: dict[str, ModelConfig] = {
    # CPU test models: seconds to build and run.
    "tiny-dense": ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=16, intermediate_size=128, eos_token_ids=(2,)),
    "tiny-moe": ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                            intermediate_size=128, num_experts=8, num_experts_per_token=2, moe_intermediate_size=32,
                            eos_token_ids=(2,)),
    # Granite-3.0-1B-A400M's shape: host-bound on an H200 (many small kernels), where graphs decide throughput.
    "bench-moe": ModelConfig(vocab_size=49155, hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=8,
                             head_dim=64, intermediate_size=512, num_experts=32, num_experts_per_token=8,
                             moe_intermediate_size=512, rope_theta=10000.0, tie_word_embeddings=True,
                             eos_token_ids=(0,)),
    # Qwen3-30B-A3B's layer shape with 24 layers: GPU-bound above a few hundred tokens.
    "bench-moe-large": ModelConfig(vocab_size=151936, hidden_size=2048, num_layers=24, num_heads=32, num_kv_heads=4,
                                   head_dim=128, intermediate_size=768, num_experts=128, num_experts_per_token=8,
                                   moe_intermediate_size=768, rope_theta=1000000.0, eos_token_ids=(151645,)),
    # Llama-3.2-1B's shape.
    "bench-dense": ModelConfig(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                               head_dim=64, intermediate_size=8192, rope_theta=500000.0, tie_word_embeddings=True,
                               eos_token_ids=(128001,)),
}


MODEL_FORMS = ("a Hugging Face checkpoint directory (config.json + *.safetensors), a .gguf file, or a preset name "
               f"({', '.join(PRESETS)}: random weights, for benchmarks only)")
"""What ``--model`` / ``model=`` accepts, for help texts and errors."""


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"model must be a Hugging Face checkpoint directory, a .gguf file or a preset "
                         f"({', '.join(PRESETS)}); got {name!r}")
    return PRESETS[name]


def read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: {what} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read {what} ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} must hold a JSON object")
    return data


def model_kind(name_or_path: str) -> str:
    """'hf' (a checkpoint directory), 'gguf' (a .gguf file) or 'preset'; CheckpointError for anything else."""
    if os.path.isdir(name_or_path):
        return "hf"
    if os.path.isfile(name_or_path):
        with open(name_or_path, "rb") as fh:
            magic = fh.read(4)
        if magic == b"GGUF":
            return "gguf"
        raise CheckpointError(f"{name_or_path}: not a GGUF file (it does not start with the GGUF magic bytes); "
                              f"--model takes {MODEL_FORMS}")
    if name_or_path in PRESETS:
        return "preset"
    raise CheckpointError(f"model {name_or_path!r}: no such directory or file, and not a preset; --model takes "
                          f"{MODEL_FORMS}")
