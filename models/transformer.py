"""A decoder-only transformer (Llama / Qwen2 dense, Mixtral / Qwen-MoE) over a paged KV cache.

The LM head (the embedding, when tied) is stored with its vocabulary padded to a multiple of VOCAB_ALIGN rows (zero
rows past ``vocab_size``): cuBLAS has no fast kernel for an odd column count (bench-moe's 49,155), and the padded
GEMM's extra columns are sliced off before anything reads them.

The forward is written as layers of two halves, ``pre_attention`` (QKV, rotary, KV write) and ``post_attention``
(output projection, norm, MLP or MoE, then the residual add and the next layer's input norm, which the MoE
combine kernel does too), so that the graph runtime can capture the pieces between attention calls (PIECEWISE)
or the whole forward (FULL) from the same code.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from models.attention import paged_attention, prepare_paged_attention, write_kv, write_kv_rows
from models.attention_metadata import AttentionMetadata, LayerAttention
from models.config import ModelConfig
from models.fused import argmax_prob, rms_norm_torch, rotary_write_kv_, use_triton
from models.fp8 import FP8, Fp8Linear, Fp8Scheme, fake_quantize_, fp8_gemm_available
from models.layers import DenseMLP, MoE, RMSNorm, RotaryEmbedding, RotaryRows, linear
from models.parallel import (VOCAB_ALIGN, TensorParallel, VocabParallelEmbedding, padded_vocab, shard_config,
                             shard_model, vocab_rows)

__all__ = ["VOCAB_ALIGN", "padded_vocab"]  # (re-exported: where the vocabulary padding was defined first)
VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")
"""Parameters stored with padded vocabulary rows (``padded_vocab``); the first vocab_size rows are the model's
(under tensor parallelism each rank's slice of them: ``models.parallel.vocab_rows``)."""


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, fp8: Fp8Scheme | None = None, index: int = 0,
                 tp: TensorParallel | None = None):
        """``fp8``: the projections held in FP8 (``models.fp8.Fp8Linear``), scaled as the scheme says; ``index``:
        the layer's place (whether it is a sliding-window layer); ``tp``: a tensor-parallel rank's layer (``cfg`` is
        its shard's shape): the output projection's and the MLP's partial outputs are all-reduced."""
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        sliding = index in cfg.sliding_layers
        self.attn = LayerAttention(window=cfg.sliding_window if sliding else 0, softcap=cfg.attn_logit_softcap)
        """The layer's attention options; the loader sets an FP8 cache's k_scale and v_scale (default 1)."""
        self.local_rope = sliding and cfg.local_rope_theta > 0
        """Rotate with the model rotary's ``local`` tables (Gemma 3's sliding-window layers)."""
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias, fp8)
        self.o_proj = linear(cfg.q_size, cfg.hidden_size, False, fp8)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        """The MLP's input norm (Gemma's pre_feedforward_layernorm)."""
        self.attn_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        """Gemma's post_attention_layernorm: the attention output's norm, before the residual add."""
        self.mlp_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        """Gemma's post_feedforward_layernorm."""
        if cfg.is_moe:
            self.mlp = MoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size,
                           cfg.norm_topk_prob, cfg.shared_expert_intermediate_size, fp8, tp)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, fp8, cfg.hidden_act, tp)

    def pre_attention(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """x: this layer's input, already normed (by the previous layer's ``post_attention``, or ``CausalLM.begin``).
        QKV, rotary, and this step's K and V into ``kv_cache`` at ``slot_mapping`` (slot -1: not stored) -> q
        (tokens, heads, dim). Qwen3's per-head q/k norms come before rotary. On the GPU, the norms, rotary and
        the KV write are one kernel."""
        c = self.cfg
        qkv = self.qkv_proj.forward(x)  # (.forward here and below: nn.Module.__call__ adds 2 us, 7 calls a layer)
        n = qkv.shape[0]  # (x may be QuantRows: ``CausalLM.fuse_fp8_quantization``)
        if self.local_rope:
            rotary = rotary.local
        if use_triton(qkv) and n:
            norms = (self.q_norm.weight, self.k_norm.weight, c.rms_norm_eps) if c.qk_norm else None
            rotary_write_kv_(qkv, positions, rotary.cos, rotary.sin, kv_cache, slot_mapping, c.num_heads,
                             c.num_kv_heads, c.head_dim, norms, (self.attn.k_scale, self.attn.v_scale))
            return qkv[:, :c.q_size].view(n, c.num_heads, c.head_dim)
        if c.qk_norm:
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = rotary(positions, rms_norm_torch(q.view(n, c.num_heads, c.head_dim), self.q_norm.weight,
                                                 c.rms_norm_eps))
            k = rotary(positions, rms_norm_torch(k.view(n, c.num_kv_heads, c.head_dim), self.k_norm.weight,
                                                 c.rms_norm_eps))
        elif isinstance(rotary, RotaryRows) and positions is rotary.positions:  # the CPU forward: in place, then
            # K and V (adjacent in qkv) stored in one op
            rotary.rotate_(qkv[:, :c.q_size + c.kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim))
            write_kv_rows(kv_cache, qkv[:, c.q_size:], slot_mapping, self.attn)
            return qkv[:, :c.q_size].view(n, c.num_heads, c.head_dim)
        else:  # the query and key heads are adjacent in qkv: one rotary call for both
            qk = rotary(positions, qkv[:, :c.q_size + c.kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim))
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
            v = qkv[:, c.q_size + c.kv_size:]
        write_kv(kv_cache, k, v.view(n, c.num_kv_heads, c.head_dim), slot_mapping, self.attn)
        return q

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm):
        """Output projection, norm, MLP or MoE, the residual add and ``next_norm`` (the next layer's input norm,
        or the model's final norm) -> (the next input, normed; the residual)."""
        hidden = self.o_proj.forward(attn_out.reshape(attn_out.shape[0], -1))
        if self.tp is not None:
            hidden = self.tp.all_reduce(hidden)
        if self.attn_output_norm is not None:  # Gemma: norms on both sides of attention and of the MLP
            hidden, residual = self.post_attention_layernorm.forward(self.attn_output_norm.forward(hidden), residual)
            return next_norm.forward(self.mlp_output_norm.forward(self.mlp.forward(hidden)), residual)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward_add_norm(hidden, residual, next_norm)


class CausalLM(nn.Module):
    tp: TensorParallel | None = None
    """This rank's place in its tensor-parallel group (None: the whole model here)."""

    def __init__(self, cfg: ModelConfig, fp8: Fp8Scheme | None = None, tp: TensorParallel | None = None):
        """``tp``: one tensor-parallel rank's shard of the model (``models.parallel``); ``cfg`` is the whole model's
        shape (``full_cfg``), ``self.cfg`` the shard's."""
        super().__init__()
        cfg.validate()
        self.full_cfg = cfg
        """The whole model's shape (``cfg`` but under tensor parallelism)."""
        self.tp = tp if tp is not None and tp.size > 1 else None
        cfg = shard_config(cfg, tp.size) if self.tp is not None else cfg
        self.cfg = cfg
        self.fp8 = fp8
        """The scheme of the projections held in FP8 (None: every weight in the serving dtype)."""
        _, rows, _ = vocab_rows(cfg.vocab_size, self.tp)
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size) if self.tp is None else \
            VocabParallelEmbedding(rows, cfg.hidden_size, self.tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, fp8, i, self.tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, rows, bias=False)
        self.rotary = make_rotary(cfg)
        self.scale = cfg.attention_scale or cfg.head_dim ** -0.5

    aux_layers: tuple[int, ...] = ()
    """Layer boundaries whose residual stream a forward also writes out (``aux_out``): what an EAGLE-3 head reads.
    Boundary i is the input to layer i (0: the embedding; num_layers: the last layer's output, before the norm), as
    vLLM numbers them."""

    def keep_aux(self, aux_out: torch.Tensor | None, boundary: int, residual: torch.Tensor) -> None:
        """The residual stream at ``boundary`` into its columns of ``aux_out`` (when the boundary is kept)."""
        if aux_out is not None and boundary in self.aux_layers:
            h = self.cfg.hidden_size
            for j, b in enumerate(self.aux_layers):  # (a boundary named twice fills both its places)
                if b == boundary:
                    aux_out[:, j * h:(j + 1) * h].copy_(residual)

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def dtype(self) -> torch.dtype:
        """The serving dtype (of activations, and of the weights not held in FP8)."""
        return self.embed_tokens.weight.dtype

    def attention(self, layer: int, q, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention alone, over K and V already in the cache (with the layer's window, soft-cap and KV scales)."""
        return paged_attention(q, kv_caches[layer], meta, self.scale, out,
                               _for_cache(self.layers[layer].attn, kv_caches[layer]))

    def prepare_attention(self, q, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                          out: torch.Tensor) -> Callable[[int], None]:
        """A step's attention prepared once for every layer: call it with a layer index to write ``out``. The part
        PIECEWISE graphs leave out, run eagerly between pieces."""
        run = prepare_paged_attention(q, kv_caches[0], meta, self.scale, out)
        options = [_for_cache(layer.attn, kv_caches[0]) for layer in self.layers]
        return lambda layer: run(kv_caches[layer], options[layer])

    needs_aux = False
    """Whether the first piece reads a second input (a drafter's target features)."""

    def embed(self, input_ids: torch.Tensor, aux: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.cfg.embedding_scale != 1.0:  # (Gemma: sqrt(hidden_size) rounded to the dtype, as transformers does)
            hidden = hidden * torch.tensor(self.cfg.embedding_scale, dtype=hidden.dtype)
        return hidden

    def begin(self, input_ids: torch.Tensor, aux: torch.Tensor | None = None):
        """The embedding -> (layer 0's input, normed; the residual)."""
        hidden = self.embed(input_ids, aux)
        return self.layers[0].input_layernorm(hidden), hidden

    def fuse_fp8_quantization(self) -> int:
        """Where a norm or a dense MLP's activation feeds a projection held in FP8 per output channel
        (``Fp8Linear``), have its kernel quantize its output per token on the GPU (``RMSNorm.quant_out``,
        ``DenseMLP.quant_down``), so that the projection's activation quantization is no kernel of its own: on the
        H200 at 256 rows of bench-dense that kernel cost 6.9 us a layer beside 57 us of FP8 GEMMs
        (docs/bench/fp8_gemm_h200.json). And where such a projection's output goes straight into the residual add
        and RMSNorm (o_proj, a dense MLP's down_proj; not under tensor parallelism, Gemma's extra norms or a bias),
        have it leave its scales to that norm's kernel (``Fp8Linear.scale_out``). Called once the projections are
        final (a checkpoint may leave some unquantized); returns how many modules changed their output."""
        def per_channel(m: nn.Module) -> bool:
            return isinstance(m, Fp8Linear) and m.block is None

        def into_norm(m: nn.Module, layer: DecoderLayer) -> bool:
            return per_channel(m) and m.bias is None and self.tp is None and layer.attn_output_norm is None

        for layer in self.layers:
            layer.input_layernorm.quant_out = per_channel(layer.qkv_proj)
            layer.o_proj.scale_out = into_norm(layer.o_proj, layer)
            mlp = layer.mlp
            if isinstance(mlp, DenseMLP):
                layer.post_attention_layernorm.quant_out = per_channel(mlp.gate_up_proj)
                mlp.quant_down = per_channel(mlp.down_proj)
                mlp.down_proj.scale_out = into_norm(mlp.down_proj, layer)
        flags = ("quant_out", "quant_down", "scale_out")
        return sum(any(getattr(m, flag, False) for flag in flags) for m in self.modules())

    def next_norms(self) -> list[RMSNorm]:
        """The norm that ends each layer: the next layer's input norm, the final norm after the last layer."""
        return [layer.input_layernorm for layer in list(self.layers)[1:]] + [self.norm]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, aux: torch.Tensor | None = None,
                aux_out: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (tokens, hidden), normed: the FULL path, and eager. With ``aux_out``, the residual
        stream at each of ``aux_layers`` is written there too."""
        x, residual = self.begin(input_ids, aux)  # (x may be QuantRows: ``fuse_fp8_quantization``)
        rotary = self.rotary if use_triton(residual) else self.rotary.at(positions)  # (the torch path: rows looked up once)
        # (lists, not ModuleList indexing a layer: that costs a CPU decode step 0.1 ms)
        for i, (layer, next_norm) in enumerate(zip(list(self.layers), self.next_norms())):
            self.keep_aux(aux_out, i, residual)
            q = layer.pre_attention(x, positions, rotary, kv_caches[i], meta.slot_mapping)
            x, residual = layer.post_attention(self.attention(i, q, kv_caches, meta), residual, next_norm)
        self.keep_aux(aux_out, self.num_layers, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(rows, vocab_size) logits in the model's dtype on the GPU (bf16; the sampler converts the rows it does
        math on), float32 on the CPU with its most likely tokens exact (``_exact_top``): one GEMM over the padded
        LM head, its padding columns sliced off (a view, rows padded_vocab apart), so no padded column is ever
        sampled. ``out`` (rows, padded_vocab) in that dtype: the logits go there (the GEMM writes into it where
        nothing follows it; else they are copied) and the view of it is returned."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        c = self.cfg
        if out is not None and self.tp is None and weight.device.type != "cpu" and c.logit_scale == 1.0 \
                and not c.final_logit_softcap:
            return torch.mm(hidden, weight.t(), out=out)[:, :c.vocab_size]
        if out is not None:
            logits = self.compute_logits(hidden)
            view = out[:, :logits.shape[1]]
            view.copy_(logits)
            return view
        logits = hidden @ weight.t()
        if self.tp is None:
            logits = logits[:, :self.cfg.vocab_size]
        if weight.device.type == "cpu" and weight.dtype != torch.float32 and len(logits):
            logits = _exact_top(logits, hidden, weight)
        if self.tp is not None:  # every rank's vocabulary rows, then the padding columns sliced off
            logits = self.tp.all_gather_columns(logits)[:, :self.cfg.vocab_size]
        if c.logit_scale != 1.0:  # Granite's logits_scaling
            logits = logits * c.logit_scale
        if c.final_logit_softcap:  # Gemma 2
            logits = torch.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
        return logits

    def propose(self, hidden: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Greedy proposals from output rows: (token ids in the target's vocabulary, their probabilities), into
        ``out`` if given (a drafter's; an EAGLE head maps its own vocabulary's ids)."""
        return argmax_prob(self.compute_logits(hidden), out=out)

    @torch.no_grad()
    def init_random(self, seed: int, std: float = 0.02) -> "CausalLM":
        """Random weights from a seed (norms at 1), generated on the model's device."""
        device = next(self.parameters()).device
        dtype = self.embed_tokens.weight.dtype
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, p in self.named_parameters(remove_duplicate=True):
            if name.endswith("weight_scale"):
                continue
            if p.dtype == FP8:  # an Fp8Linear's weight: drawn as in the serving dtype (the same draws), quantized
                drawn = torch.empty(p.shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)
                self.get_submodule(name.rpartition(".")[0]).load_float(drawn)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name in VOCAB_PARAMS:  # the vocabulary's rows as unpadded (the same draws); padding rows zero
                real = self.vocab_rows_here()
                p[:real].normal_(0.0, std, generator=gen)
                p[real:].zero_()
            else:
                p.normal_(0.0, std, generator=gen)
        return self

    def vocab_rows_here(self) -> int:
        """Rows of the real vocabulary in this model's embedding and LM head (the first rows; the rest padding)."""
        return vocab_rows(self.cfg.vocab_size, self.tp)[2]

    def projections(self) -> list[tuple[str, nn.Module]]:
        """The projections that ``--quantization fp8`` holds in FP8 (attention and dense MLPs, a MoE's shared
        expert): (name, module). The embedding, the LM head, routers and routed experts stay in the serving dtype."""
        names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        return [(n, m) for n, m in self.named_modules() if n.rpartition(".")[2] in names and ".experts" not in n]


def _for_cache(attn: LayerAttention, kv_cache: torch.Tensor) -> LayerAttention:
    """A layer's attention options for its cache: KV scales apply to an FP8 cache only."""
    if kv_cache.dtype == torch.float8_e4m3fn or (attn.k_scale, attn.v_scale) == (1.0, 1.0):
        return attn
    return attn._replace(k_scale=1.0, v_scale=1.0)


def make_rotary(cfg: ModelConfig, context_len: int | None = None) -> RotaryEmbedding:
    """The model's rotary tables (float32), with the sliding-window layers' own (``local``) where their base differs
    (Gemma 3: unscaled, at local_rope_theta). ``context_len``: the longest sequence served (LongRoPE's choice)."""
    local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta) \
        if cfg.local_rope_theta else None
    return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                           context_len=context_len, local=local)


def build_model(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int | None = 0,
                fp8: Fp8Scheme | None = None, max_model_len: int | None = None,
                tp: TensorParallel | None = None) -> CausalLM:
    """The model with random weights from ``seed``; ``seed=None`` leaves them uninitialized (a loader sets every
    one). Modules skip their default initialization (every weight is set after); the rotary tables stay float32.
    ``fp8``: a checkpoint's FP8 scheme (or ``--quantization fp8``): where the device has FP8 GEMMs
    (``models.fp8.fp8_gemm_available``) the projections are built as ``Fp8Linear``; elsewhere they stay in
    ``dtype`` and the loader dequantizes into them. Random weights are quantized per channel after their draw.
    ``max_model_len``: the longest sequence served (LongRoPE's choice of factors; default the model's positions).
    ``tp``: a tensor-parallel rank's shard; random weights are the whole model's (drawn whole, then cut), so that
    every size serves the same model."""
    kept = fp8 if fp8 is not None and fp8_gemm_available(device) else None
    if tp is not None and tp.size > 1:
        if fp8 is not None:
            raise ValueError("FP8 weights (--quantization fp8 or an FP8 checkpoint) are not split across "
                             "tensor-parallel ranks yet: serve them with tensor_parallel_size 1")
        if seed is not None:
            return shard_model(build_model(cfg, device, dtype, seed, None, max_model_len),
                               build_model(cfg, device, dtype, None, None, max_model_len, tp), tp)
    with torch.device(device), no_default_init():
        model = CausalLM(cfg, kept, tp).to(dtype)
        model.rotary = make_rotary(cfg, max_model_len)
    if seed is not None:
        model.init_random(seed)
        if fp8 is not None and kept is None:  # no FP8 GEMMs here: the FP8 model's values, in dtype
            for _, module in model.projections():
                fake_quantize_(module.weight)
    else:  # a loader sets the vocabulary's rows; the padding rows stay zero (their logits are sliced off)
        with torch.no_grad():
            for name in VOCAB_PARAMS:
                if name != "lm_head.weight" or model.lm_head is not None:
                    model.get_parameter(name)[model.vocab_rows_here():].zero_()
    model.fuse_fp8_quantization()  # (a loader marks again once it has set the projections: fill_model)
    return model.eval().requires_grad_(False)


@contextmanager
def no_default_init():
    """nn.Linear and nn.Embedding constructed without their random initialization (as transformers'
    no_init_weights does): it would cost seconds on a real model whose weights are all loaded after."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


CPU_EXACT_TOP = 8
"""Tokens per row whose logits the CPU recomputes in float32 after a half-precision LM head."""


def _exact_top(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Half-precision logits as float32, the ``CPU_EXACT_TOP`` largest of each row recomputed in float32 (8 dot
    products a row). bf16 rounds logits near 20 to 1/8, which can tie the greedy choice between tokens float32
    tells apart (SmolLM2 answered "L'Étoile" for France's capital); the CPU has no half-precision GEMM with a
    float32 output, and a float32 copy of the head would double its memory traffic every decode step."""
    top = logits.topk(min(CPU_EXACT_TOP, logits.shape[1]), dim=-1).indices
    exact = torch.einsum("rh,rkh->rk", hidden.float(), weight[top].float())
    return logits.float().scatter_(1, top, exact)
