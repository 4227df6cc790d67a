"""Hugging Face-format checkpoints: ``config.json`` plus ``*.safetensors`` in a local directory, for Llama and
Qwen2 (dense) and Mixtral and Qwen2-MoE. Separate Q/K/V and gate/up projections are concatenated into the
fused layouts; expert weights are stacked. Every problem is a CheckpointError naming the file, the tensor and
the expected shape. ``save_checkpoint`` writes the same format (for tests and tools)."""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch

from models.config import ModelConfig, preset
from models.transformer import VOCAB_PARAMS, CausalLM, build_model

SUPPORTED = ("llama", "qwen2", "mixtral", "qwen2_moe")


class CheckpointError(ValueError):
    pass


def config_from_hf(hf: dict, path: str = "config.json") -> ModelConfig:
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise CheckpointError(f"{path}: model_type {kind!r} is not supported (one of {', '.join(SUPPORTED)})")

    def need(key):
        if key not in hf:
            raise CheckpointError(f"{path}: missing {key!r} (needed for model_type {kind})")
        return hf[key]

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    eos = hf.get("eos_token_id")
    cfg = dict(
        vocab_size=need("vocab_size"), hidden_size=hidden, num_layers=need("num_hidden_layers"), num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", heads), head_dim=hf.get("head_dim") or hidden // heads,
        intermediate_size=need("intermediate_size"), rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        eos_token_id=eos[0] if isinstance(eos, list) else eos, attention_bias=kind in ("qwen2", "qwen2_moe"),
    )
    if kind == "mixtral":
        cfg.update(num_experts=need("num_local_experts"), num_experts_per_token=need("num_experts_per_tok"),
                   moe_intermediate_size=need("intermediate_size"), norm_topk_prob=True)
    elif kind == "qwen2_moe":
        cfg.update(num_experts=need("num_experts"), num_experts_per_token=need("num_experts_per_tok"),
                   moe_intermediate_size=need("moe_intermediate_size"),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                   shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 0)))
    out = ModelConfig(**cfg)
    try:
        out.validate()
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return out


def _hf_names(cfg: ModelConfig, kind: str) -> Iterator[tuple[str, list[str], int]]:
    """(our parameter, its Hugging Face tensors, the dim they are concatenated along)."""
    yield "embed_tokens.weight", ["model.embed_tokens.weight"], 0
    yield "norm.weight", ["model.norm.weight"], 0
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", ["lm_head.weight"], 0
    for i in range(cfg.num_layers):
        p, ours = f"model.layers.{i}", f"layers.{i}"
        yield f"{ours}.input_layernorm.weight", [f"{p}.input_layernorm.weight"], 0
        yield f"{ours}.post_attention_layernorm.weight", [f"{p}.post_attention_layernorm.weight"], 0
        yield f"{ours}.qkv_proj.weight", [f"{p}.self_attn.{x}_proj.weight" for x in "qkv"], 0
        if cfg.attention_bias:
            yield f"{ours}.qkv_proj.bias", [f"{p}.self_attn.{x}_proj.bias" for x in "qkv"], 0
        yield f"{ours}.o_proj.weight", [f"{p}.self_attn.o_proj.weight"], 0
        if not cfg.is_moe:
            yield f"{ours}.mlp.gate_up_proj.weight", [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"], 0
            yield f"{ours}.mlp.down_proj.weight", [f"{p}.mlp.down_proj.weight"], 0
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


def _target(model: CausalLM, name: str) -> torch.Tensor:
    """Our parameter (a view) that a checkpoint tensor fills: an expert's slice, or the vocabulary rows of the LM
    head and embedding, which are stored padded (``models.transformer.padded_vocab``; the padding stays zero)."""
    if name.endswith("]"):
        base, index = name[:-1].split("[")
        return model.get_parameter(base)[int(index)]
    if name in VOCAB_PARAMS:
        return model.get_parameter(name)[:model.cfg.vocab_size]
    return model.get_parameter(name)


def load_checkpoint(path: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> CausalLM:
    from safetensors import safe_open

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face-format checkpoint directory)")
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            hf = json.load(fh)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    cfg = config_from_hf(hf, cfg_path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    where: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(os.path.join(path, f), framework="pt") as st:
                for key in st.keys():
                    where[key] = f
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{os.path.join(path, f)}: unreadable safetensors file ({exc})") from None
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    model = build_model(cfg, device, dtype, seed=0)
    handles: dict[str, object] = {}
    try:
        for ours, theirs, dim in _hf_names(cfg, hf["model_type"]):
            parts = []
            for key in theirs:
                if key not in where:
                    raise CheckpointError(f"{path}: tensor {key!r} is missing (needed for {ours})")
                if where[key] not in handles:
                    handles[where[key]] = safe_open(os.path.join(path, where[key]), framework="pt")
                parts.append(handles[where[key]].get_tensor(key))
            tensor = torch.cat(parts, dim) if len(parts) > 1 else parts[0]
            target = _target(model, ours)
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(f"{path}: {' + '.join(theirs)} has shape {tuple(tensor.shape)}, expected "
                                      f"{tuple(target.shape)} for {ours}")
            with torch.no_grad():
                target.copy_(tensor.to(target.dtype))
    finally:
        handles.clear()
    return model


def save_checkpoint(model: CausalLM, path: str, model_type: str) -> None:
    """Write ``model`` as a Hugging Face checkpoint of ``model_type`` (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    cfg = model.cfg
    os.makedirs(path, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for ours, theirs, dim in _hf_names(cfg, model_type):
        chunks = _target(model, ours).detach().cpu().contiguous()
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
          "eos_token_id": cfg.eos_token_id}
    if model_type == "mixtral":
        hf.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_token)
    elif model_type == "qwen2_moe":
        hf.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_token,
                  moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                  shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(hf, fh, indent=2)


def load_model(name_or_path: str, device: str | torch.device, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """A preset name (random weights from ``seed``) or a checkpoint directory."""
    if os.path.isdir(name_or_path):
        return load_checkpoint(name_or_path, device, dtype)
    return build_model(preset(name_or_path), device, dtype, seed)
