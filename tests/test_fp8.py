"""FP8 checkpoints and --quantization fp8 (models/fp8.py): tiny FP8 checkpoints written here from a transformers
model (per-tensor scales as AutoFP8 writes them, 128x128 block scales as Qwen3-FP8 and DeepSeek ship them,
compressed-tensors per-channel scales) load to exactly their dequantized weights and give logits within FP8's
error of the original; every other quantization method is refused with one error naming it; the FP8 GEMM path
(Fp8Linear) runs on the GPU."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from dispatcher.engine.engine_core import EngineArgs, EngineCore  # noqa: E402
from dispatcher.plan.config import resolve  # noqa: E402
from models.checkpoint import CheckpointError  # noqa: E402
from models.fp8 import FP8, FP8_MAX, dequantize, quantize_per_channel  # noqa: E402
from models.loader import load_checkpoint, load_model  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402
from test_models_real import PROMPTS, assert_graphs_match_eager, hf_model, ragged_logits  # noqa: E402

FP8_LOGIT_ERROR = 0.12
"""Relative (norm) error of the logits of a 2-layer random model whose every projection is rounded to e4m3 (3
mantissa bits: up to 1/16 relative error a weight); measured 0.06 for per-tensor and per-channel scales. Loading
FP8 weights without their scales (the bug this guards against) is off by orders of magnitude."""
FP8_W8A8_LOGIT_ERROR = 0.18
"""The same on the GPU, where the GEMMs also round each activation row to e4m3 (``torch._scaled_mm``, dynamic
per-token scales) and the reference runs in bf16: measured 0.125-0.133 on the H200 (per-tensor, block-128,
compressed-tensors), about sqrt(2) times the weights-only error, as two independent roundings give."""
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _per_tensor(w):
    s = w.abs().max().float() / FP8_MAX
    return (w / s).to(FP8), s.reshape(())


def _blocks(w, block=(128, 128)):
    from models.fp8 import quantize_blocks

    return quantize_blocks(w, block)


def _per_channel(w):
    q, s = quantize_per_channel(w)
    return q, s[:, None]


def write_fp8(src: str, dst: str, quantize, quantization_config: dict, scale_suffix: str) -> None:
    """``src``'s checkpoint with every projection weight in FP8 beside its scale."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS:
            out[name], scale = quantize(t)
            out[name.removesuffix("weight") + scale_suffix] = scale
        else:
            out[name] = t
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as fh:
        config = json.load(fh)
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump({**config, "quantization_config": quantization_config}, fh)


SCHEMES = {
    "per-tensor": (_per_tensor, {"quant_method": "fp8", "activation_scheme": "static"}, "weight_scale"),
    "block-128": (_blocks, {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                            "weight_block_size": [128, 128]}, "weight_scale_inv"),
    "compressed-tensors": (_per_channel, {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}}},
        "weight_scale"),
}


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """A Qwen2 (biases on Q/K/V) of hidden size 256, intermediate 320 (not a multiple of the 128 block: the last
    block column is partial) saved by transformers."""
    from test_models_real import ARCHS

    ARCHS.setdefault("qwen2-256", ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=256, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2)))
    path = str(tmp_path_factory.mktemp("orig"))
    hf_model("qwen2-256").save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(SCHEMES))
def fp8_checkpoint(request, original, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    write_fp8(original, path, *SCHEMES[request.param])
    return request.param, path


def test_fp8_checkpoint_loads_its_dequantized_weights(fp8_checkpoint, original):
    """Each projection holds weight x scale (the scales applied per tensor, per channel or per block), the other
    tensors as saved, and the logits are within FP8's error of the unquantized original."""
    name, path = fp8_checkpoint
    quantize, config, suffix = SCHEMES[name]
    model = load_checkpoint(path, "cpu", torch.float32)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    block = tuple(config.get("weight_block_size") or ()) or None
    q = dequantize(tensors["model.layers.1.self_attn.q_proj.weight"],
                   tensors["model.layers.1.self_attn.q_proj." + suffix], block)
    assert torch.equal(model.layers[1].qkv_proj.weight[:q.shape[0]], q)
    down = dequantize(tensors["model.layers.0.mlp.down_proj.weight"], tensors["model.layers.0.mlp.down_proj." + suffix],
                      block)
    assert torch.equal(model.layers[0].mlp.down_proj.weight, down)
    want = ragged_logits(load_checkpoint(original, "cpu", torch.float32), PROMPTS)
    got = ragged_logits(model, PROMPTS)
    assert float((got - want).norm() / want.norm()) < FP8_LOGIT_ERROR, name


def test_online_fp8_quantization_rounds_each_projection_per_channel(original):
    """--quantization fp8 on an unquantized checkpoint: every projection is its per-channel e4m3 rounding (the
    embedding and the norms are untouched), the logits within FP8's error; an FP8 checkpoint refuses it."""
    base = load_checkpoint(original, "cpu", torch.float32)
    quant = load_model(original, "cpu", torch.float32, quantization="fp8")
    w = base.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(quant.layers[0].mlp.gate_up_proj.weight, dequantize(*quantize_per_channel(w), None))
    assert not torch.equal(quant.layers[0].mlp.gate_up_proj.weight, w)
    assert torch.equal(quant.embed_tokens.weight, base.embed_tokens.weight)
    want, got = ragged_logits(base, PROMPTS), ragged_logits(quant, PROMPTS)
    assert 0 < float((got - want).norm() / want.norm()) < FP8_LOGIT_ERROR
    with pytest.raises(ValueError, match="--quantization 'int8' is not supported"):
        load_model(original, "cpu", torch.float32, quantization="int8")


def test_online_fp8_on_a_preset_serves_through_the_engine():
    """A preset with --quantization fp8 runs through EngineCore (random weights rounded per channel)."""
    cfg = resolve({}, None, platform="default", max_num_seqs=4, max_num_batched_tokens=16)
    args = dict(num_kv_blocks=32, block_size=8, max_model_len=64, use_cuda_graphs=False)
    out = EngineCore(cfg, EngineArgs("tiny-dense", quantization="fp8", **args)).generate(
        PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o) for o in out] == [4, 4, 4]


def test_an_fp8_checkpoint_refuses_online_quantization(fp8_checkpoint):
    with pytest.raises(CheckpointError, match="already quantized"):
        load_checkpoint(fp8_checkpoint[1], "cpu", torch.float32, quantization="fp8")


@pytest.mark.parametrize("config, named", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "gguf"}, "'gguf'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}, "'int' 4-bit"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    # fields that change what the weights are, loaded as if absent before (the checkpoint probe)
    *[({**SCHEMES["compressed-tensors"][1], **extra}, named) for extra, named in [
        ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
        ({"transform_config": {"config_groups": {"u": {"type": "hadamard"}}}}, "transform_config"),
        ({"kv_cache_scheme": {"num_bits": 8, "type": "int"}}, "kv_cache_scheme"),
        ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                              "symmetric": False}}}}, "asymmetric weights, zero points"),
        ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                  "input_activations": {"num_bits": 8, "type": "int"}}}}, "input_activations is 'int'"),
        ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}},
         "without a block_structure"),
        ({"format": "pack-quantized"}, "format 'pack-quantized'")]],
    ({"quant_method": "fp8", "activation_scheme": "per-token-asym"}, "activation_scheme 'per-token-asym'"),
])
def test_other_quantization_methods_are_refused_by_name(original, tmp_path, config, named):
    """An AWQ or GPTQ checkpoint used to fail with "tensor ... is missing"; now one error names the method and
    what is supported, before any tensor is read."""
    import shutil

    shutil.copytree(original, tmp_path / "q")
    cfg_path = tmp_path / "q" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "quantization_config": config}))
    with pytest.raises(CheckpointError, match="is not supported") as err:
        load_checkpoint(str(tmp_path / "q"))
    assert named in str(err.value) and "config.json" in str(err.value)
    if "supported:" in str(err.value):
        assert "fp8" in str(err.value).split("supported:")[1]


@pytest.mark.parametrize("fp8_checkpoint", ["per-tensor"], indirect=True)  # (one scheme is enough)
def test_fp8_tensors_without_a_scheme_or_a_scale_are_refused(fp8_checkpoint, tmp_path):
    import shutil

    name, path = fp8_checkpoint
    shutil.copytree(path, tmp_path / "noconfig")
    cfg_path = tmp_path / "noconfig" / "config.json"
    config = json.loads(cfg_path.read_text())
    config.pop("quantization_config")
    cfg_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="float8_e4m3fn but config.json has no quantization_config"):
        load_checkpoint(str(tmp_path / "noconfig"))
    shutil.copytree(path, tmp_path / "noscale")
    tensors = load_file(str(tmp_path / "noscale" / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(tensors, str(tmp_path / "noscale" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp.up_proj.weight' has no scale "
                                              "'model.layers.0.mlp.up_proj.weight_scale'"):
        load_checkpoint(str(tmp_path / "noscale"))


@pytest.mark.parametrize("scheme, edit, words", [
    ("block-128", lambda s: s[:1], r"has shape \(1, 2\), expected shape \(2, 2\) \(128x128 blocks\)"),  # (cropped)
    ("block-128", lambda s: torch.ones(3, 2), r"has shape \(3, 2\), expected shape \(2, 2\)"),
    ("block-128", lambda s: s.max().reshape(()), r"has shape \(\), expected shape"),  # (a per-tensor scale, taken)
    ("per-tensor", lambda s: torch.ones(2, 2), r"has shape \(2, 2\), expected 1 or 256 values"),  # (a traceback)
    ("per-tensor", lambda s: s * float("nan"), "has values that are not finite numbers >= 0"),  # (all-zero tokens)
    ("per-tensor", lambda s: -s, "has values that are not finite numbers >= 0"),
])
def test_an_fp8_scale_of_the_wrong_layout_or_value_is_refused(original, tmp_path, scheme, edit, words):
    """An FP8 weight's scales must be one per tensor or row, or the scheme's grid of blocks: a grid of another size
    was cropped or repeated into the wrong rows, a scalar taken for a block scheme (wrong tokens, no error)."""
    write_fp8(original, str(tmp_path / "bad"), *SCHEMES[scheme])
    tensors = load_file(str(tmp_path / "bad" / "model.safetensors"))
    key = f"model.layers.0.self_attn.q_proj.{SCHEMES[scheme][2]}"
    tensors[key] = edit(tensors[key]).contiguous()
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"FP8 scale '{key}' {words}"):
        load_checkpoint(str(tmp_path / "bad"))


def test_norms_and_activations_feeding_per_channel_fp8_projections_quantize_their_rows():
    """``CausalLM.fuse_fp8_quantization``: a norm before an ``Fp8Linear`` of per-channel scales (the attention's
    qkv, the MLP's gate_up) and the activation before the down projection quantize their output in their own
    kernel on the GPU; nothing before a block-scaled or an unquantized projection does (the model's last norm
    feeds the LM head, in the serving dtype), and marking again after a projection was left unquantized unmarks
    its producer. The per-channel o_proj and down_proj leave their scales to the residual add and norm that read
    them (``scale_out``); under Gemma's norms after attention and the MLP they do not."""
    from torch import nn

    from models.config import preset
    from models.fp8 import Fp8Linear, Fp8Scheme
    from models.transformer import CausalLM

    cfg = preset("tiny-dense")
    with torch.device("meta"):
        per_channel, blocks, plain = (CausalLM(cfg, s) for s in (Fp8Scheme(), Fp8Scheme(block=(32, 32)), None))
    assert isinstance(per_channel.layers[0].qkv_proj, Fp8Linear)
    assert per_channel.fuse_fp8_quantization() == 5 * cfg.num_layers
    assert all(layer.o_proj.scale_out and layer.mlp.down_proj.scale_out for layer in per_channel.layers)
    assert not any(layer.qkv_proj.scale_out or layer.mlp.gate_up_proj.scale_out for layer in per_channel.layers)
    assert blocks.fuse_fp8_quantization() == 0 and plain.fuse_fp8_quantization() == 0
    assert not per_channel.norm.quant_out
    layer = per_channel.layers[1]
    with torch.device("meta"):
        layer.mlp.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
    assert per_channel.fuse_fp8_quantization() == 5 * cfg.num_layers - 1
    assert not layer.post_attention_layernorm.quant_out and layer.mlp.quant_down and layer.input_layernorm.quant_out
    with torch.device("meta"):
        gemma = CausalLM(dataclasses.replace(cfg, sandwich_norms=True), Fp8Scheme())
    assert gemma.fuse_fp8_quantization() == 3 * cfg.num_layers
    assert not any(layer.o_proj.scale_out or layer.mlp.down_proj.scale_out for layer in gemma.layers)


@pytest.mark.gpu
def test_gpu_fp8_gemms_inside_graphs(fp8_checkpoint, original):
    """On the H200 the projections stay FP8 (Fp8Linear: torch._scaled_mm per channel, the Triton block GEMM for
    128x128 scales): logits within FP8's error of the bf16 original, and greedy tokens through captured graphs
    equal the same closures run eagerly."""
    from models.fp8 import Fp8Linear

    name, path = fp8_checkpoint
    model = load_checkpoint(path, "cuda", torch.bfloat16)
    assert isinstance(model.layers[0].qkv_proj, Fp8Linear) and model.layers[0].qkv_proj.weight.dtype == FP8
    assert (model.layers[0].qkv_proj.block is not None) == (name == "block-128")
    want = ragged_logits(load_checkpoint(original, "cuda", torch.bfloat16), PROMPTS, "cuda")
    got = ragged_logits(model, PROMPTS, "cuda")
    assert float((got - want).norm() / want.norm()) < FP8_W8A8_LOGIT_ERROR, name
    flags = ("quant_out", "quant_down", "scale_out")
    marked = [m for m in model.modules() if any(getattr(m, flag, False) for flag in flags)]
    # (norms and activations quantizing; o_proj and down_proj leaving their scales to the norm)
    assert len(marked) == (0 if name == "block-128" else 5 * len(model.layers))
    for m in marked:  # every projection scaling its own output (the row-wise GEMM)
        m.scale_out = False
    unscaled = ragged_logits(model, PROMPTS, "cuda")
    # o and down's output rounded to bf16 once more (before its scales) moves the logits by less than FP8 itself
    # does (measured: 0.057 and 0.061 against 0.13; a rounding moved may round the next e4m3 activation the other
    # way; tests/test_kernels.py checks the two paths equal in float32)
    assert float((unscaled - got).norm() / got.norm()) < float((unscaled - want).norm() / want.norm()), name
    for m in marked:  # each projection also quantizing its input itself: the same logits, bit for bit
        m.quant_out = m.quant_down = False
    assert torch.equal(ragged_logits(model, PROMPTS, "cuda"), unscaled), name
    assert_graphs_match_eager(path, name)
    assert_graphs_match_eager(path, name + " with an FP8 KV cache", kv_cache_dtype="fp8")


def test_fp8_kv_cache_holds_twice_the_tokens_within_fp8_error(original, tmp_path):
    """--kv-cache-dtype fp8: a block takes half the bytes (the sizing of the worker and of LLM), the logits over
    an e4m3 cache stay within FP8's error, per-layer k/v scales from the checkpoint are used (a cache written
    and read with scale 4 gives what scale 1 gives, within rounding), and the engine serves from it."""
    import shutil

    from dispatcher.llm import _kv_blocks
    from dispatcher.runtime.process import kv_bytes_per_block
    from models.attention import kv_cache_dtype
    from models.loader import read_model_config

    cfg = read_model_config(original)
    fp8 = kv_cache_dtype("fp8", torch.bfloat16)
    assert fp8 == FP8 and kv_bytes_per_block(cfg, 16, torch.bfloat16) == 2 * kv_bytes_per_block(cfg, 16, fp8)
    assert _kv_blocks(cfg, "cpu", fp8, 16, 64, 10**6, 0.01) == 2 * _kv_blocks(cfg, "cpu", torch.bfloat16, 16, 64,
                                                                                10**6, 0.01)
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int8' is not supported"):
        kv_cache_dtype("int8", torch.bfloat16)
    model = load_checkpoint(original, "cpu", torch.float32)
    want = ragged_logits(model, PROMPTS)
    got = ragged_logits(model, PROMPTS, kv_dtype=FP8)
    assert 0 < float((got - want).norm() / want.norm()) < FP8_LOGIT_ERROR
    shutil.copytree(original, tmp_path / "scaled")
    tensors = load_file(str(tmp_path / "scaled" / "model.safetensors"))
    for i in range(cfg.num_layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(4.0)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(4.0)
    save_file(tensors, str(tmp_path / "scaled" / "model.safetensors"))
    scaled = load_checkpoint(str(tmp_path / "scaled"), "cpu", torch.float32)
    assert scaled.layers[1].attn.k_scale == 4.0
    assert torch.equal(ragged_logits(scaled, PROMPTS), want)  # a cache in the model's dtype ignores the scales
    assert float((ragged_logits(scaled, PROMPTS, kv_dtype=FP8) - want).norm() / want.norm()) < FP8_LOGIT_ERROR
    sched = resolve({}, None, platform="default", max_num_seqs=4, max_num_batched_tokens=16)
    engine = EngineCore(sched, EngineArgs(original, num_kv_blocks=32, block_size=8, max_model_len=64,
                                          use_cuda_graphs=False, kv_cache_dtype="fp8"))
    assert engine.worker.kv_caches[0].dtype == FP8
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o) for o in out] == [8, 8, 8]


def test_a_projection_an_fp8_checkpoint_leaves_unquantized_stays_unquantized(tmp_path, monkeypatch, caplog):
    """An FP8 checkpoint whose config leaves a projection unquantized (``modules_to_not_convert``), loaded where FP8
    GEMMs run: that projection is served as the checkpoint holds it (vLLM keeps it in bf16), the others in FP8;
    a fused projection with one unquantized part (q_proj beside FP8 k_proj and v_proj) stays unquantized whole,
    its FP8 parts dequantized; the log names them; the logits match the checkpoint's values loaded without FP8
    GEMMs (dequantized everywhere)."""
    import logging

    import models.transformer as T
    from models.config import preset
    from models.fp8 import Fp8Linear
    from models.loader import load_checkpoint, save_checkpoint
    from models.transformer import build_model

    model = build_model(preset("tiny-dense"), "cpu", torch.float32, seed=0)
    save_checkpoint(model, str(tmp_path), "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    kept = ("model.layers.1.self_attn.o_proj.weight", "model.layers.0.self_attn.q_proj.weight")
    for name in list(tensors):
        if name.endswith("_proj.weight") and name not in kept:
            w = tensors[name].float()
            scale = w.abs().max() / 448
            tensors[name], tensors[name + "_scale"] = (w / scale).to(torch.float8_e4m3fn), scale.reshape(())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "modules_to_not_convert": [k.removesuffix(".weight") for k in kept]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    want = load_checkpoint(str(tmp_path), "cpu", torch.float32)  # (no FP8 GEMMs here: every projection dequantized)
    monkeypatch.setattr(T, "fp8_gemm_available", lambda device: True)
    with caplog.at_level(logging.INFO, logger="twogrid.loader"):
        got = load_checkpoint(str(tmp_path), "cpu", torch.float32)
    plain = {n for n, m in got.projections() if not isinstance(m, Fp8Linear)}
    assert plain == {"layers.1.o_proj", "layers.0.qkv_proj"}, plain
    assert all(isinstance(m, Fp8Linear) for n, m in got.projections() if n not in plain)
    for name in plain:
        assert got.get_submodule(name).weight.dtype == torch.float32
        assert torch.equal(got.get_submodule(name).weight, want.get_submodule(name).weight)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert all(k in said for k in kept) and "unquantized" in said
    logits, expected = ragged_logits(got, PROMPTS), ragged_logits(want, PROMPTS)
    assert float((logits - expected).norm() / expected.norm()) < FP8_LOGIT_ERROR