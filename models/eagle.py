"""EAGLE draft heads (EAGLE-1/2 and EAGLE-3): their shape, their checkpoints, and the target's features they read.

A head is one decoder layer that reads the target's features and proposes the next token; it runs in the graph
runtime like a model (``CausalLM``'s forward, pieces and KV cache), with two differences: its first input is a
feature as well as a token (``needs_aux``), and its output is the *pre-norm* feature, which is both what the next
draft step reads and what ``compute_logits`` norms and projects.

- **EAGLE-3** (``LlamaForCausalLMEagle3``, as SpecForge trains it and vLLM and SGLang load it): the target's
  residual stream at three layer boundaries (``aux_layers``; boundary i is the input to layer i, so 0 is the
  embedding and L the last layer's output; the config's ``eagle_aux_hidden_state_layer_ids``, read as vLLM reads
  it, else vLLM's default 2, L // 2, L - 3), concatenated (3H) and projected by ``fc`` to H; later steps read the
  head's own H-wide output instead (no ``fc``: told apart by width, as vLLM does). The layer attends over
  cat(input_layernorm(token embedding), hidden_norm(feature)), 2H wide; the residual is the feature. Its own
  vocabulary: ``lm_head`` has ``draft_vocab_size`` rows and ``d2t`` maps a draft id d to the target id d + d2t[d].
- **EAGLE-1/2** (the EAGLE authors' heads, ``LlamaForCausalLM`` with one layer, converted to safetensors):
  fc(cat(token embedding, the target's final hidden state)) (2H -> H, with a bias in the authors' checkpoints), one
  Llama layer whose input norm is absent, no final norm, the target's LM head.

The embedding is the target's unless the checkpoint has its own (as vLLM does). Random heads of either shape serve
presets (benchmarks); a real target needs a checkpoint (``load_draft_head``).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from models.attention import allocate_kv_cache
from models.attention_metadata import AttentionMetadata
from models.checkpoint import check_finite_weights, part_rows
from models.config import ModelConfig
from models.fused import argmax_prob
from models.layers import RMSNorm, RotaryEmbedding
from models.transformer import CausalLM, DecoderLayer, no_default_init, padded_vocab

log = logging.getLogger("twogrid")

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE1_ARCHITECTURES = ("LlamaForCausalLM", "LlamaForCausalLMEagle", "EagleLlamaForCausalLM")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 feature boundaries: 2, L // 2, L - 3 (inputs to those layers), each kept within
    0..L (a target of fewer than 5 layers: the tiny presets)."""
    return tuple(min(max(b, 0), num_layers) for b in (2, num_layers // 2, num_layers - 3))


@dataclass(frozen=True)
class HeadShape:
    """What kind of EAGLE head: which target features it reads and which parts it has."""

    aux_layers: tuple[int, ...] = ()
    """EAGLE-3: the target's boundaries it reads (at least two); () for EAGLE-1 (the target's final hidden
    state)."""
    draft_vocab_size: int | None = None
    """Rows of its own LM head (EAGLE-3); None: the target's LM head."""
    fc_bias: bool = False
    fc_norm: bool = False
    """SpecForge's ``fc_norm``: each of the target's features RMS-normed before ``fc``."""
    input_norm: bool = True
    """The layer's input norm (EAGLE-1's authors leave it out of their one layer)."""
    final_norm: bool = True
    """The norm before the LM head (EAGLE-1 has none: its output stands for the target's normed state)."""
    own_embedding: bool = False

    @property
    def eagle3(self) -> bool:
        return bool(self.aux_layers)


class ResidualOnly(nn.Module):
    """A norm that is not there: the identity, with the residual add a norm would fuse."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return x
        s = x + residual
        return s, s


class EagleHead(CausalLM):
    needs_aux = True

    def __init__(self, target: CausalLM, cfg: ModelConfig, shape: HeadShape):
        nn.Module.__init__(self)
        cfg.validate()
        self.cfg, self.shape = cfg, shape
        self._target = [target]  # not a submodule: its weights stay the target's
        h, th = cfg.hidden_size, target.cfg.hidden_size
        self.fc = nn.Linear(len(shape.aux_layers) * th if shape.eagle3 else 2 * h, h, bias=shape.fc_bias)
        self.fc_norm = nn.ModuleList(RMSNorm(th, cfg.rms_norm_eps) for _ in shape.aux_layers) if shape.fc_norm \
            else None
        layer = DecoderLayer(cfg)
        if shape.eagle3:
            layer.qkv_proj = nn.Linear(2 * h, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
            layer.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        if not shape.input_norm:
            layer.input_layernorm = ResidualOnly()
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(h, cfg.rms_norm_eps) if shape.final_norm else None
        self._no_norm = ResidualOnly()
        self.lm_head = nn.Linear(h, shape.draft_vocab_size, bias=False) if shape.draft_vocab_size else None
        self.own_embed = nn.Embedding(padded_vocab(cfg.vocab_size), h) if shape.own_embedding else None
        if shape.draft_vocab_size:
            self.register_buffer("draft_to_target", torch.arange(shape.draft_vocab_size), persistent=False)
        else:
            self.draft_to_target = None
        same_rope = (cfg.rope_theta, cfg.rope_scaling, cfg.head_dim) == \
            (target.cfg.rope_theta, target.cfg.rope_scaling, target.cfg.head_dim)
        rotary = target.rotary if same_rope else RotaryEmbedding(
            cfg.head_dim, target.cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling).to(
            target.rotary.cos.device)
        object.__setattr__(self, "rotary", rotary)  # not a submodule: .to(dtype) leaves the float32 tables alone
        self.scale = cfg.head_dim ** -0.5
        self.mask_token_id = cfg.vocab_size - 1

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.own_embed if self.own_embed is not None else self._target[0].embed_tokens

    @property
    def step0_aux_size(self) -> int:
        """Width of the features step 0 reads (the target's: 3H for EAGLE-3, H for EAGLE-1)."""
        return self.fc.in_features if self.shape.eagle3 else self.cfg.hidden_size

    def begin(self, input_ids: torch.Tensor, aux: torch.Tensor | None = None):
        emb = self.embed_tokens(input_ids)
        layer = self.layers[0]
        if not self.shape.eagle3:
            feature = self.fc(torch.cat([emb, aux], dim=-1))
            return layer.input_layernorm(feature), feature
        feature = aux
        if aux.shape[-1] == self.fc.in_features:  # step 0: the target's features
            if self.fc_norm is not None:
                aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], -1)
            feature = self.fc(aux)
        return torch.cat([layer.input_layernorm(emb), layer.hidden_norm(feature)], dim=-1), feature

    def next_norms(self):
        return [self._no_norm]  # the output stays pre-norm: the next step's feature

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, draft vocabulary) logits of pre-norm features: the target's vocabulary without a draft one."""
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.lm_head is None:
            return self._target[0].compute_logits(hidden)
        return self.lm_head(hidden)

    def propose(self, hidden: torch.Tensor, out=None):
        ids, prob = argmax_prob(self.compute_logits(hidden), out=out)
        if self.draft_to_target is None:
            return ids, prob
        mapped = self.draft_to_target[ids]
        if out is None:
            return mapped, prob
        out[0].copy_(mapped)
        return out[0], prob


# ---------------------------------------------------------------------------------------------------------------
# Random heads (presets) and checkpoints
# ---------------------------------------------------------------------------------------------------------------


def head_config(target: ModelConfig) -> ModelConfig:
    """A one-layer dense config of the target's attention shape (random heads)."""
    return target.with_(num_layers=1, num_experts=0, num_experts_per_token=0, moe_intermediate_size=0,
                        shared_expert_intermediate_size=0,
                        intermediate_size=target.intermediate_size or 4 * target.hidden_size)


def build_draft_head(target: CausalLM, seed: int, method: str = "eagle") -> EagleHead:
    """A random head for a preset target: EAGLE-3's shape for eagle3 (the target's LM head), else EAGLE-1's with an
    input and a final norm (eagle, mtp and the block drafters)."""
    shape = HeadShape(aux_layers=default_aux_layers(target.cfg.num_layers)) if method == "eagle3" else HeadShape()
    whole = getattr(target, "full_cfg", target.cfg)  # (a tensor-parallel target's head is the whole one, replicated)
    return _place(target, head_config(whole), shape).init_random(seed).eval().requires_grad_(False)


def _place(target: CausalLM, cfg: ModelConfig, shape: HeadShape) -> EagleHead:
    param = next(target.parameters())
    with torch.device(param.device), no_default_init():
        return EagleHead(target, cfg, shape).to(param.dtype)


class DraftHeadError(ValueError):
    """A draft head that does not load or does not fit its target: the message names the field and both values."""


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from models.loader import safetensors_keys

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        out: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                safetensors_keys(f)  # (a truncated or corrupt file named, not safetensors' own error)
            except ValueError as exc:
                raise DraftHeadError(str(exc)) from None
            for key, tensor in load_file(f).items():
                if key in out:
                    raise DraftHeadError(f"draft head {path!r}: tensor {key!r} is in two files (which one is the "
                                         f"head's is an accident of order)")
                floating = tensor.dtype.is_floating_point
                if (not floating and key not in ("d2t", "t2d")) or (floating and tensor.itemsize == 1):
                    raise DraftHeadError(f"draft head {path!r}: tensor {key!r} is {tensor.dtype}; a head's weights "
                                         f"are floats of 16 or 32 bits (a quantized head is not supported)")
                out[key] = tensor
        return out
    if glob.glob(os.path.join(path, "pytorch_model*.bin")):
        raise DraftHeadError(
            f"{path}: pytorch_model.bin is a pickle, which twogrid never loads; convert the head to safetensors once "
            f"(python -c \"import torch, safetensors.torch as st; st.save_file(torch.load('pytorch_model.bin', "
            f"weights_only=True), 'model.safetensors')\" in {path})")
    raise DraftHeadError(f"{path}: no *.safetensors with the draft head's weights")


def _strip(name: str) -> str:
    for prefix in ("model.", "draft_model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.replace("midlayer.", "layers.0.")


def read_head_config(path: str, target: ModelConfig, method: str) -> tuple[ModelConfig, tuple[int, ...], dict]:
    """The head's config.json, checked against the target's config and the method -> (its ModelConfig, the target
    boundaries it reads (() for EAGLE-1), the raw config). ``twogrid serve`` calls it before anything starts."""
    from models.checkpoint import CheckpointError
    from models.config import read_json
    from models.loader import config_from_hf

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise DraftHeadError(f"--speculative-config model {path!r}: no config.json (a draft head is a directory with "
                             f"config.json and *.safetensors)")
    try:
        hf = read_json(cfg_path, "the draft head's config")
        archs = hf.get("architectures") or [""]
        arch = archs[0] if isinstance(archs, list) and isinstance(archs[0], str) else None
        if arch is None:
            raise CheckpointError(f"{cfg_path}: architectures must be a list of class names, got {archs!r}")
        for key in ("num_hidden_layers", "draft_vocab_size", "target_hidden_size"):
            if hf.get(key) is not None and (isinstance(hf[key], bool) or not isinstance(hf[key], int)):
                raise CheckpointError(f"{cfg_path}: {key} must be an integer, got {hf[key]!r}")
    except CheckpointError as exc:
        raise DraftHeadError(str(exc)) from None
    eagle3 = arch in EAGLE3_ARCHITECTURES or ("draft_vocab_size" in hf and arch not in EAGLE1_ARCHITECTURES)
    if method == "eagle3" and not eagle3:
        raise DraftHeadError(f"{cfg_path}: architectures {arch!r} is not an EAGLE-3 head (one of "
                             f"{', '.join(EAGLE3_ARCHITECTURES)}); an EAGLE-1/2 head loads with method eagle")
    if method == "eagle" and eagle3:
        raise DraftHeadError(f"{cfg_path}: {arch!r} is an EAGLE-3 head: use method eagle3")
    if int(hf.get("num_hidden_layers", 1)) != 1:
        raise DraftHeadError(f"{cfg_path}: num_hidden_layers = {hf['num_hidden_layers']}: only one-layer heads are "
                             f"supported")
    try:
        cfg = config_from_hf({**hf, "model_type": hf.get("model_type") or "llama"}, cfg_path)
    except CheckpointError as exc:
        raise DraftHeadError(str(exc)) from None
    t = target
    name = f"draft head {path!r}"
    if cfg.vocab_size != t.vocab_size:
        raise DraftHeadError(f"{name}: vocab_size = {cfg.vocab_size}, the target's is {t.vocab_size}: a head must "
                             f"share the target's tokenizer")
    target_hidden = int(hf.get("target_hidden_size") or cfg.hidden_size)
    if target_hidden != t.hidden_size:
        raise DraftHeadError(f"{name}: target_hidden_size / hidden_size = {target_hidden}, the target's hidden_size "
                             f"is {t.hidden_size}")
    if (cfg.rope_theta, cfg.rope_scaling) != (t.rope_theta, t.rope_scaling):
        raise DraftHeadError(f"{name}: rope_theta {cfg.rope_theta} / rope_scaling {cfg.rope_scaling}, the target's "
                             f"are {t.rope_theta} / {t.rope_scaling}: a head is trained at its target's RoPE")
    aux = ()
    if eagle3:
        ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or \
            hf.get("eagle_aux_hidden_state_layer_ids")
        if ids and (not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)):
            raise DraftHeadError(f"{name}: eagle_aux_hidden_state_layer_ids must be a list of layer indices, got "
                                 f"{ids!r}")
        aux = tuple(ids) if ids else default_aux_layers(t.num_layers)
        if len(aux) < 2 or any(not 0 <= i <= t.num_layers for i in aux):
            raise DraftHeadError(f"{name}: eagle_aux_hidden_state_layer_ids = {list(aux)}: at least two boundaries in "
                                 f"0..{t.num_layers} (the target's layers)")
    return cfg, aux, hf


def load_draft_head(path: str, target: CausalLM, method: str) -> EagleHead:
    """An EAGLE-3 (method eagle3) or EAGLE-1/2 (method eagle) head from ``path`` (config.json + *.safetensors; a
    pickled pytorch_model.bin is refused with the command that converts it), on the target's device and in its
    dtype. Its parts follow the tensors there (fc's bias, the input norm, its own embedding and LM head); every
    tensor the head needs must be there and every tensor there must be used: anything else is a DraftHeadError
    naming it."""
    cfg, aux, hf = read_head_config(path, target.cfg, method)
    tensors = {_strip(k): v for k, v in _read_tensors(path).items()}
    draft_vocab = None
    if aux:
        declared = hf.get("draft_vocab_size")
        if "lm_head.weight" in tensors:
            draft_vocab = int(tensors["lm_head.weight"].shape[0])
            if declared and int(declared) != draft_vocab:
                raise DraftHeadError(f"draft head {path!r}: lm_head.weight has {draft_vocab} rows, draft_vocab_size "
                                     f"is {declared}")
        elif declared and int(declared) != cfg.vocab_size:
            raise DraftHeadError(f"draft head {path!r}: draft_vocab_size = {declared} but no lm_head.weight")
        if not hf.get("norm_output", True):
            tensors.pop("norm.weight", None)  # SpecForge keeps the parameter and leaves it unused
    shape = HeadShape(aux, draft_vocab, fc_bias="fc.bias" in tensors, fc_norm=bool(hf.get("fc_norm", False)),
                      input_norm="layers.0.input_layernorm.weight" in tensors, final_norm="norm.weight" in tensors,
                      own_embedding="embed_tokens.weight" in tensors)
    head = _place(target, cfg, shape)
    _fill(head, tensors, path)
    check_finite_weights(head, f"draft head {path!r}", DraftHeadError)
    return head.eval().requires_grad_(False)


def _hf_tensors(head: EagleHead) -> list[tuple[str, list[str]]]:
    """(our parameter, the checkpoint's tensors concatenated into it), in SpecForge's / vLLM's names."""
    p = "layers.0"
    names = [("fc.weight", ["fc.weight"]),
             (f"{p}.qkv_proj.weight", [f"{p}.self_attn.{x}_proj.weight" for x in "qkv"]),
             (f"{p}.o_proj.weight", [f"{p}.self_attn.o_proj.weight"]),
             (f"{p}.post_attention_layernorm.weight", [f"{p}.post_attention_layernorm.weight"]),
             (f"{p}.mlp.gate_up_proj.weight", [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"]),
             (f"{p}.mlp.down_proj.weight", [f"{p}.mlp.down_proj.weight"])]
    s = head.shape
    names += [("fc.bias", ["fc.bias"])] if s.fc_bias else []
    names += [(f"fc_norm.{i}.weight", [f"fc_norm.{i}.weight"]) for i in range(len(s.aux_layers))] if s.fc_norm else []
    names += [(f"{p}.input_layernorm.weight", [f"{p}.input_layernorm.weight"])] if s.input_norm else []
    names += [(f"{p}.hidden_norm.weight", [f"{p}.hidden_norm.weight"])] if s.eagle3 else []
    names += [("norm.weight", ["norm.weight"])] if s.final_norm else []
    names += [("lm_head.weight", ["lm_head.weight"])] if s.draft_vocab_size else []
    names += [("own_embed.weight", ["embed_tokens.weight"])] if s.own_embedding else []
    return names


def _fill(head: EagleHead, tensors: dict[str, torch.Tensor], path: str) -> None:
    used = {"t2d", "d2t"}
    with torch.no_grad():
        for ours, theirs in _hf_tensors(head):
            missing = [t for t in theirs if t not in tensors]
            if missing:
                raise DraftHeadError(f"draft head {path!r}: tensor {missing[0]!r} is missing")
            param = head.get_parameter(ours)
            rows = part_rows(head.cfg, len(theirs), param.shape[0])
            if rows is not None and [tensors[t].shape[0] if tensors[t].dim() else 0 for t in theirs] != rows:
                raise DraftHeadError(f"draft head {path!r}: {' + '.join(theirs)} have "
                                     f"{' + '.join(str(tensors[t].shape[0]) for t in theirs)} rows, expected "
                                     f"{' + '.join(map(str, rows))}")
            value = torch.cat([tensors[t] for t in theirs], dim=0)
            if ours == "own_embed.weight":
                param = param[:head.cfg.vocab_size]
            if tuple(value.shape) != tuple(param.shape):
                raise DraftHeadError(f"draft head {path!r}: {' + '.join(theirs)} has shape {tuple(value.shape)}, "
                                     f"expected {tuple(param.shape)}")
            param.copy_(value)
            used.update(theirs)
        if head.own_embed is not None:
            head.own_embed.weight[head.cfg.vocab_size:].zero_()
        if head.draft_to_target is not None:
            d2t = tensors.get("d2t")
            if d2t is None and head.shape.draft_vocab_size == head.cfg.vocab_size:
                d2t = torch.zeros(head.cfg.vocab_size, dtype=torch.int64)  # the target's vocabulary, in order
            if d2t is None:
                raise DraftHeadError(f"draft head {path!r}: draft_vocab_size = {head.shape.draft_vocab_size} needs "
                                     f"d2t (draft id -> target id offsets)")
            if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
                raise DraftHeadError(f"draft head {path!r}: d2t is {d2t.dtype}, expected integer offsets")
            if d2t.shape != (head.shape.draft_vocab_size,):
                raise DraftHeadError(f"draft head {path!r}: d2t has shape {tuple(d2t.shape)}, expected "
                                     f"({head.shape.draft_vocab_size},)")
            ids = torch.arange(len(d2t)) + d2t.long()
            if int(ids.min()) < 0 or int(ids.max()) >= head.cfg.vocab_size or len(set(ids.tolist())) != len(ids):
                raise DraftHeadError(f"draft head {path!r}: d2t maps draft ids outside the target's vocabulary "
                                     f"0..{head.cfg.vocab_size - 1} or onto one id twice")
            head.draft_to_target.copy_(ids)
    unused = sorted(set(tensors) - used)
    if unused:
        raise DraftHeadError(f"draft head {path!r}: tensor {unused[0]!r} ({len(unused)} unused in all) is not part of "
                             f"an EAGLE head of this shape: refusing to load it partially")


def save_eagle3_head(head: EagleHead, path: str, extra_config: dict | None = None,
                     dtype: torch.dtype = torch.bfloat16) -> None:
    """Write an EAGLE-3 head as SpecForge saves one (config.json + model.safetensors in ``dtype``, ``midlayer.``
    names, d2t and t2d), so that vLLM, SGLang and twogrid load it alike. The embedding stays the target's (not
    written)."""
    from safetensors.torch import save_file

    if not head.shape.eagle3:
        raise ValueError("save_eagle3_head: not an EAGLE-3 head")
    os.makedirs(path, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in _hf_tensors(head):
        if ours == "own_embed.weight":
            continue
        value = head.get_parameter(ours).detach().cpu().to(dtype)
        sizes = [head.cfg.q_size, head.cfg.kv_size, head.cfg.kv_size] if len(theirs) == 3 else \
            [value.shape[0] // len(theirs)] * len(theirs)
        for name, part in zip(theirs, value.split(sizes, dim=0)):
            out[name.replace("layers.0.", "midlayer.")] = part.contiguous()
    vd = head.shape.draft_vocab_size or head.cfg.vocab_size
    ids = head.draft_to_target.cpu() if head.draft_to_target is not None else torch.arange(vd)
    out["d2t"] = ids - torch.arange(vd)
    t2d = torch.zeros(head.cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    out["t2d"] = t2d
    save_file(out, os.path.join(path, "model.safetensors"))
    c = head.cfg
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size, "draft_vocab_size": vd, "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(head.shape.aux_layers)},
        **(extra_config or {}),
    }
    if c.rope_scaling is not None:
        config["rope_scaling"] = {"rope_type": c.rope_scaling.rope_type, "factor": c.rope_scaling.factor,
                                  "low_freq_factor": c.rope_scaling.low_freq_factor,
                                  "high_freq_factor": c.rope_scaling.high_freq_factor,
                                  "original_max_position_embeddings": c.rope_scaling.original_max_position_embeddings}
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)


# ---------------------------------------------------------------------------------------------------------------
# The target's features for whole sequences (training, tests)
# ---------------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def target_features(target: CausalLM, sequences: list[list[int]], aux_layers: tuple[int, ...],
                    block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's forward over whole token sequences (a ragged prefill in a scratch KV cache) -> (final hidden
    states, normed (tokens, H); the residual stream at ``aux_layers`` concatenated (tokens, len(aux_layers) * H)),
    rows in the sequences' order."""
    device = next(target.parameters()).device
    cfg = target.cfg
    lens = [len(s) for s in sequences]
    width = -(-max(lens) // block_size)
    kv = allocate_kv_cache(cfg.num_layers, width * len(sequences), block_size, cfg.num_kv_heads, cfg.head_dim,
                           next(target.parameters()).dtype, device)
    table = torch.arange(width * len(sequences), dtype=torch.int32, device=device).view(len(sequences), width)
    rows = np.repeat(np.arange(len(sequences)), lens)
    pos = np.concatenate([np.arange(n) for n in lens])
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)  # noqa: E731
    slots = to(rows * width * block_size + pos)
    meta = AttentionMetadata.from_tokens(slots, to(rows), to(pos), table)
    meta.max_seq_len = max(lens)
    ids = to(np.concatenate([np.asarray(s, np.int64) for s in sequences]))
    aux = torch.empty(len(ids), len(aux_layers) * cfg.hidden_size, dtype=next(target.parameters()).dtype,
                      device=device)
    saved = target.aux_layers
    target.aux_layers = tuple(aux_layers)
    try:
        hidden = target(ids, to(pos), kv, meta, aux_out=aux)
    finally:
        target.aux_layers = saved
    return hidden, aux
