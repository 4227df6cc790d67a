"""What every checkpoint format shares: ``CheckpointError``, the map from our parameters to Hugging Face tensor names
(``hf_names``), and ``fill_model``, which sets a model's parameters from any ``TensorSource`` (a safetensors
directory, ``models.loader``; a GGUF file, ``models.gguf_loader``). Both loaders import this module; it imports
neither."""

from __future__ import annotations

import json
from typing import Iterator, Protocol

import torch

from models.config import ModelConfig
from models.transformer import VOCAB_PARAMS, CausalLM


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file, the field or tensor, and the expectation."""


def read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read {what} ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} must hold a JSON object")
    return data


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
        yield f"{ours}.post_attention_layernorm.weight", [f"{p}.post_attention_layernorm.weight"], 0
        yield f"{ours}.qkv_proj.weight", [f"{p}.self_attn.{x}_proj.weight" for x in "qkv"], 0
        if cfg.attention_bias:
            yield f"{ours}.qkv_proj.bias", [f"{p}.self_attn.{x}_proj.bias" for x in "qkv"], 0
        if cfg.qk_norm:
            yield f"{ours}.q_norm.weight", [f"{p}.self_attn.q_norm.weight"], 0
            yield f"{ours}.k_norm.weight", [f"{p}.self_attn.k_norm.weight"], 0
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


def param_target(model: CausalLM, name: str) -> torch.Tensor:
    """Our parameter (a view) that a checkpoint tensor fills: an expert's slice, or the vocabulary rows of the LM
    head and embedding, which are stored padded (``models.transformer.padded_vocab``; the padding stays zero)."""
    if name.endswith("]"):
        base, index = name[:-1].split("[")
        return model.get_parameter(base)[int(index)]
    if name in VOCAB_PARAMS:
        return model.get_parameter(name)[:model.cfg.vocab_size]
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


def fill_model(model: CausalLM, kind: str, source: TensorSource) -> CausalLM:
    """Set every parameter of ``model`` from ``source``, checking each shape; a parameter left unset is an error."""
    cfg = model.cfg
    done: set[str] = set()
    with torch.no_grad():
        for ours, theirs, dim in hf_names(cfg, kind):
            parts = [source.get(key) for key in theirs]
            target = param_target(model, ours)
            shapes = [tuple(p.shape) for p in parts]
            if any(len(s) != target.dim() or s[1:] != tuple(target.shape[1:]) for s in shapes) or sum(
                    s[0] for s in shapes) != target.shape[0]:
                names = " + ".join(source.describe(k) for k in theirs)
                got = " + ".join(str(s) for s in shapes)
                raise CheckpointError(f"{source.where}: {names} has shape {got}, expected {tuple(target.shape)} "
                                      f"for {ours}")
            start = 0
            for part in parts:  # straight into the fused parameter's rows (no concatenated copy)
                target.narrow(dim, start, part.shape[dim]).copy_(part)
                start += part.shape[dim]
            done.add(ours.split("[")[0])
    unset = [n for n, _ in model.named_parameters() if n not in done]
    if unset:
        raise CheckpointError(f"{source.where}: the loader set no value for {unset[0]} ({kind})")
    return model
