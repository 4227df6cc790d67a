"""Granite, Granite-MoE, Gemma 2, Gemma 3 and Phi-3 GGUFs written the way llama.cpp's converter writes them (from
the transformers model's own tensors: Gemma's norms stored as 1 + w, Granite's Q/K rows permuted and its
multipliers as metadata, Granite-MoE's experts split into gate and up, Phi-3's fused projections and LongRoPE
factor tensors) load to exactly the weights of the safetensors checkpoint, with the same config."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from models.gguf_loader import gguf_name, load_gguf, permute_qk  # noqa: E402
from models.loader import load_checkpoint  # noqa: E402
from test_models_real import MAX_MODEL_LEN, PROMPTS, hf_model, ragged_logits  # noqa: E402

ARCHS = {"granite": "granite", "granitemoe": "granitemoe", "gemma2-gguf": "gemma2", "gemma3-gguf": "gemma3",
         "phi3": "phi3"}
"""Our test model name -> the GGUF architecture. llama.cpp's Gemma GGUFs carry no query_pre_attn_scalar (it scales
by head_dim, by hidden / heads for the 27B models): the Gemma models here have query_pre_attn_scalar = head_dim."""


def _register_gemma_variants():
    from test_models_real import ARCHS as HF_ARCHS

    for name in ("gemma2", "gemma3"):
        cfg_cls, model_cls, extra = HF_ARCHS[name]
        HF_ARCHS.setdefault(f"{name}-gguf", (cfg_cls, model_cls, {**extra, "query_pre_attn_scalar": extra["head_dim"]}))


_register_gemma_variants()


def write_like_llama_cpp(hf, saved: str, path: str, arch: str, attention_qtype: str = "F32") -> None:
    """The GGUF llama.cpp's converter would write from the checkpoint saved in ``saved`` (the attention
    projections in ``attention_qtype``)."""
    from safetensors.torch import load_file

    c = hf.config
    kind = {"gemma3": "gemma3_text"}.get(arch, arch)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if arch.startswith("granite"):
        w.add_attention_scale(c.attention_multiplier)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
    if arch == "granitemoe":
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if arch.startswith("gemma"):
        w.add_sliding_window(c.sliding_window)
        if c.final_logit_softcapping:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        if c.attn_logit_softcapping:
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        if arch == "gemma3":  # (llama.cpp has no key for a pattern other than 6; the tiny model's is 2)
            w.add_uint32("gemma3.attention.sliding_window_pattern", 2)
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        scale = c.max_position_embeddings / rope["original_max_position_embeddings"]
        original = rope["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for name, t in load_file(f"{saved}/model.safetensors").items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.float()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1
        if name.endswith("block_sparse_moe.input_linear.weight"):
            layer = name.split(".")[2]
            gate, up = t.chunk(2, dim=1)
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", gate.contiguous().numpy())
            w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", up.contiguous().numpy())
            continue
        g, _ = gguf_name(name, kind)
        if arch.startswith("granite") and g.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if g.endswith("attn_q.weight") else c.num_key_value_heads
            t = permute_qk(t, heads)
        quant = gguf.GGMLQuantizationType[attention_qtype]
        if g.startswith("blk.") and g.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight",
                                                "attn_output.weight")) and attention_qtype != "F32":
            w.add_tensor(g, gguf.quants.quantize(t.contiguous().numpy(), quant), raw_dtype=quant)
        else:
            w.add_tensor(g, t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", list(ARCHS))
def test_llama_cpp_layout_gguf_loads_the_safetensors_weights(name, tmp_path):
    hf = hf_model(name, seed=4)
    hf.save_pretrained(tmp_path / "hf")
    write_like_llama_cpp(hf, str(tmp_path / "hf"), str(tmp_path / "m.gguf"), ARCHS[name])
    from_st = load_checkpoint(str(tmp_path / "hf"), "cpu", torch.float32, max_model_len=MAX_MODEL_LEN)
    from_gguf = load_gguf(str(tmp_path / "m.gguf"), "cpu", torch.float32, max_model_len=MAX_MODEL_LEN)
    differ = {k for k, v in vars(from_st.cfg).items() if v != getattr(from_gguf.cfg, k)}
    assert differ <= {"rms_norm_eps", "eos_token_ids", "rope_scaling", "logit_scale", "attention_scale",
                      "embedding_scale", "residual_scale", "final_logit_softcap", "attn_logit_softcap"}, differ
    for key in differ - {"eos_token_ids", "rope_scaling"}:  # float32 metadata
        assert getattr(from_gguf.cfg, key) == pytest.approx(getattr(from_st.cfg, key), rel=1e-6), key
    for (n, a), (_, b) in zip(from_st.named_parameters(), from_gguf.named_parameters()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), n
    torch.testing.assert_close(ragged_logits(from_gguf, PROMPTS), ragged_logits(from_st, PROMPTS), rtol=1e-4,
                               atol=1e-4)


def test_granites_4bit_attention_is_unpermuted_like_its_dequantized_one(tmp_path):
    """On the CPU in bfloat16 a Q4_0 Granite GGUF keeps its attention projections 4-bit: their Q and K rows are
    taken out of llama.cpp's order as the dequantized ones are (they were not: the rotary halves came scrambled)."""
    from models.int4 import Int4Linear, int4_available

    if not int4_available("cpu", torch.bfloat16):
        pytest.skip("no int4 CPU GEMM in this torch")
    hf = hf_model("granite", seed=4)
    hf.save_pretrained(tmp_path / "hf")
    write_like_llama_cpp(hf, str(tmp_path / "hf"), str(tmp_path / "m.gguf"), "granite", "Q4_0")
    dense = load_gguf(str(tmp_path / "m.gguf"), "cpu", torch.float32, max_model_len=MAX_MODEL_LEN)
    kept = load_gguf(str(tmp_path / "m.gguf"), "cpu", torch.bfloat16, max_model_len=MAX_MODEL_LEN)
    qkv = kept.layers[0].qkv_proj
    assert isinstance(qkv, Int4Linear)
    torch.testing.assert_close(qkv.dequantized().float(), dense.layers[0].qkv_proj.weight, atol=2e-2, rtol=2e-2)
