"""GGUF checkpoints: tiny models written with gguf.GGUFWriter (llama.cpp's layout: Llama-family Q/K rows permuted,
experts stacked) load to the same weights as their safetensors copy, exactly in F32 and within each type's
rounding error when quantized; transformers' own GGUF loader agrees on the logits (an independent check of the
name map and the Q/K unpermutation); K-quant tensors dequantize as transformers' torch kernels do; bad files get
one clear error each."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from models.config import preset  # noqa: E402
from models.gguf_file import GGUFFile  # noqa: E402
from models.gguf_loader import load_gguf, permute_qk, unpermute_qk, write_gguf  # noqa: E402
from models.checkpoint import CheckpointError  # noqa: E402
from models.loader import load_checkpoint, load_model, save_checkpoint  # noqa: E402
from models.transformer import build_model  # noqa: E402
from test_models_real import PROMPTS, ragged_logits  # noqa: E402

DENSE = preset("tiny-dense").with_(max_position_embeddings=512)
MOE = preset("tiny-moe").with_(max_position_embeddings=512, intermediate_size=32)
SHAPES = {
    "llama": DENSE,
    "qwen2": DENSE.with_(attention_bias=True, tie_word_embeddings=True),
    "qwen3": DENSE.with_(qk_norm=True, head_dim=128),  # transformers reads Qwen3 GGUFs at head_dim 128 only
    "mixtral": MOE.with_(moe_intermediate_size=32),
    "qwen2_moe": MOE.with_(attention_bias=True, norm_topk_prob=False, shared_expert_intermediate_size=64),
    "qwen3_moe": MOE.with_(qk_norm=True),
}
ERROR = {"Q8_0": 1 / 200, "Q4_0": 1 / 7.5, "Q4_1": 1 / 14}
"""Worst rounding error per 32-value block, as a fraction of the block's largest magnitude: half a step (Q4_0: a
whole step, for the clipped extreme) of 1/127, 1/8 and 1/15 of the range, plus the fp16 rounding of the scales."""


def random_model(model_type: str, seed: int = 5):
    model = build_model(SHAPES[model_type], "cpu", torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms and biases away from their init values, so that loading them wrong shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.mul_(4)
    return model


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tmp_path_factory):
    """(model type, the safetensors copy loaded, the directory)."""
    path = tmp_path_factory.mktemp(request.param)
    model = random_model(request.param)
    save_checkpoint(model, str(path / "hf"), request.param)
    return request.param, load_checkpoint(str(path / "hf")), model, path


def test_f32_gguf_loads_exactly_the_safetensors_weights(pair):
    model_type, from_st, model, path = pair
    write_gguf(model, str(path / "f32.gguf"), model_type)
    from_gguf = load_gguf(str(path / "f32.gguf"))
    assert from_gguf.cfg.rms_norm_eps == pytest.approx(from_st.cfg.rms_norm_eps, rel=1e-6)  # stored as float32
    assert from_gguf.cfg == from_st.cfg.with_(rms_norm_eps=from_gguf.cfg.rms_norm_eps)
    for (name, a), (_, b) in zip(from_st.named_parameters(), from_gguf.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_gguf_is_within_the_types_error(pair, qtype):
    model_type, from_st, model, path = pair
    file = str(path / f"{qtype}.gguf")
    write_gguf(model, file, model_type, qtype)
    from_gguf = load_model(file, "cpu", torch.float32)
    quantized = 0
    for (name, a), (_, b) in zip(from_st.named_parameters(), from_gguf.named_parameters()):
        if a.dim() == 1 or name.endswith("mlp.gate.weight"):  # norms, biases and routers stay F32
            assert torch.equal(a, b), name
            continue
        blocks = a.reshape(-1, 32)
        bound = blocks.abs().amax(dim=1, keepdim=True) * ERROR[qtype] + 1e-7
        assert ((b.reshape(-1, 32) - blocks).abs() <= bound).all(), name
        quantized += not torch.equal(a, b)
    assert quantized >= 5
    if qtype == "Q8_0" and not from_st.cfg.is_moe:  # close enough to serve: the logits move a little (MoE routing
        # amplifies small changes into other experts, so only dense models are compared)
        ref, got = ragged_logits(from_st, PROMPTS), ragged_logits(from_gguf, PROMPTS)
        assert float((got - ref).abs().max()) < 0.05 * float(ref.abs().max())


def test_default_dtype_follows_the_weights(pair, tmp_path):
    """On the CPU a 4-bit GGUF serves in bfloat16 (its weights hold less than that), an 8-bit one, a checkpoint
    directory and a preset in float32; on CUDA everything in bfloat16."""
    from models.loader import default_dtype

    model_type, from_st, model, path = pair
    for qtype, want in (("Q4_0", torch.bfloat16), ("Q4_1", torch.bfloat16), ("Q8_0", torch.float32)):
        file = str(path / f"dtype-{qtype}.gguf")
        write_gguf(model, file, model_type, qtype)
        assert default_dtype(file, "cpu") == want, qtype
        assert default_dtype(file, "cuda") == torch.bfloat16
    assert default_dtype("tiny-dense", "cpu") == torch.float32


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_4bit_projections_stay_4bit_on_the_cpu_in_bfloat16(pair, qtype, monkeypatch):
    """On the CPU in bfloat16, a Q4_0 / Q4_1 file's projections are served 4-bit (``Int4Linear`` over the file's
    own codes and scales, Q/K rows unpermuted): the weights they hold are the float32 dequantization's, and the
    served model's logits are the bfloat16-dequantized model's within bfloat16 rounding."""
    from models import gguf_loader
    from models.gguf_file import config_from_gguf, open_gguf
    from models.gguf_loader import keep_int4
    from models.int4 import Int4Linear, int4_available

    if not int4_available("cpu", torch.bfloat16):
        pytest.skip("this torch has no int4 CPU GEMM (torch >= 2.6)")
    model_type, _, model, path = pair
    file = str(path / f"int4-{qtype}.gguf")
    write_gguf(model, file, model_type, qtype)
    kind, cfg = config_from_gguf(open_gguf(file))
    dense = load_gguf(file, "cpu", torch.float32)
    exact = load_gguf(file, "cpu", torch.float32)  # float32 scales: the int4 layout's weights, unrounded
    assert keep_int4(exact, open_gguf(file), kind) == cfg.num_layers * (2 if cfg.is_moe else 4)
    for layer, want in zip(exact.layers, dense.layers):
        projections = [("qkv_proj", layer.qkv_proj, want.qkv_proj), ("o_proj", layer.o_proj, want.o_proj)]
        if not cfg.is_moe:
            projections += [("gate_up", layer.mlp.gate_up_proj, want.mlp.gate_up_proj),
                            ("down", layer.mlp.down_proj, want.mlp.down_proj)]
        for name, int4, linear in projections:
            assert isinstance(int4, Int4Linear), name
            scale = float(linear.weight.abs().max())
            torch.testing.assert_close(int4.dequantized(), linear.weight, rtol=0, atol=1e-6 * scale, msg=name)
    served = load_gguf(file, "cpu", torch.bfloat16)
    assert isinstance(served.layers[0].qkv_proj, Int4Linear)
    monkeypatch.setattr(gguf_loader, "int4_available", lambda device, dtype: False)
    dequantized = load_gguf(file, "cpu", torch.bfloat16)
    assert isinstance(dequantized.layers[0].qkv_proj, torch.nn.Linear)
    with pytest.raises(CheckpointError, match="4-bit"):  # saving needs the dense weights
        write_gguf(served, str(path / "resaved.gguf"), model_type)
    got, ref = ragged_logits(served, PROMPTS), ragged_logits(dequantized, PROMPTS)
    exact_logits = ragged_logits(dense, PROMPTS)
    scale = float(exact_logits.abs().max())
    assert float((got - exact_logits).abs().max()) < 0.05 * scale
    assert float((got - ref).abs().max()) < 0.05 * scale


def test_qk_permutation_round_trips():
    w = torch.arange(4 * 16 * 3, dtype=torch.float32).reshape(4 * 16, 3)
    assert torch.equal(unpermute_qk(permute_qk(w, 4), 4), w)
    assert not torch.equal(permute_qk(w, 4), w)
    # llama.cpp interleaves each head's halves: row 1 of a permuted head is row 8 (the second half's first)
    assert torch.equal(permute_qk(w, 4)[1], w[8])


@pytest.mark.parametrize("model_type,qtype", [("llama", "F32"), ("qwen2", "Q8_0"), ("qwen3", "F32")])
def test_transformers_reads_our_gguf_as_we_do(tmp_path, model_type, qtype):
    """transformers' GGUF loader (its own name map, dequantization and Q/K unpermutation) gives the logits ours
    gives for the same file."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    model = random_model(model_type, seed=9)
    write_gguf(model, str(tmp_path / "m.gguf"), model_type, qtype)
    ours = ragged_logits(load_gguf(str(tmp_path / "m.gguf")), PROMPTS)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * float(theirs.abs().max()))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_transformers_conversion_kept_in_the_cache_loads_back_as_converted(tmp_path, model_type, monkeypatch):
    """tests/hfgguf.py keeps transformers' float32 model of a GGUF in the cache for the real-model tests: read
    back, it is the model transformers converted, tensor for tensor (tied embeddings too: qwen2), with its config
    and generation config, and gives the same logits and greedy tokens."""
    pytest.importorskip("accelerate")
    from hfgguf import hf_model_from_gguf

    monkeypatch.setenv("TWOGRID_CACHE", str(tmp_path / "cache"))
    write_gguf(random_model(model_type, seed=9), str(tmp_path / "m.gguf"), model_type, "Q8_0")
    converted = hf_model_from_gguf(str(tmp_path / "m.gguf"))
    (folder,) = (tmp_path / "cache" / "hf_from_gguf").iterdir()
    kept = hf_model_from_gguf(str(tmp_path / "m.gguf"))
    assert kept.config._name_or_path == str(folder) and type(kept) is type(converted)
    want, got = converted.state_dict(), kept.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert all(p.dtype == torch.float32 for p in got.values())
    drop = ("_name_or_path", "quantization_config")
    assert ({k: v for k, v in kept.config.to_dict().items() if k not in drop}
            == {k: v for k, v in converted.config.to_dict().items() if k not in drop})
    assert kept.generation_config.to_dict() == converted.generation_config.to_dict()
    with torch.no_grad():
        for p in PROMPTS:
            assert torch.equal(kept(torch.tensor([p])).logits, converted(torch.tensor([p])).logits)
            greedy = [m.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                 pad_token_id=0) for m in (kept, converted)]
            assert torch.equal(*greedy)


def _k_quant_bytes(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Random K-quant blocks with finite fp16 scales (random bytes there can be NaN or inf)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scale_bytes = {gguf.GGMLQuantizationType.Q4_K: [0, 2], gguf.GGMLQuantizationType.Q6_K: [size - 2]}[qtype]
    for at in scale_bytes:
        raw[:, at:at + 2] = (rng.random((raw.shape[0], 1)) * 0.05).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, cols // block * size)


def test_k_quants_dequantize_as_transformers_does(tmp_path):
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    raws = {}
    for qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
        raws[qtype.name] = _k_quant_bytes(qtype, 6, 512, rng)
        w.add_tensor(qtype.name, raws[qtype.name], raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(str(tmp_path / "k.gguf"))
    for name, raw in raws.items():
        got = f.tensor(name)
        want = hf_dequantize(torch.from_numpy(raw.copy()), int(gguf.GGMLQuantizationType[name])).reshape(6, 512)
        assert got.shape == (6, 512) and torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.bfloat16().shape == (6, 512)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_block_types_decode_exactly_as_the_gguf_package_on_the_load_device(tmp_path, qtype):
    """Q8_0 / Q4_0 / Q4_1 are decoded by torch where the weights go (the GPU at a server's start): the same float32
    values, bit for bit, as the gguf package's numpy dequantization, for a matrix and for stacked experts (3-D);
    and the 4-bit types' int4 groups give those values back as (code - 8) * scale + zero."""
    rng = np.random.default_rng(3)
    kind = gguf.GGMLQuantizationType[qtype]
    arrays = {"matrix": rng.standard_normal((48, 96)).astype(np.float32) * 0.1,
              "experts": rng.standard_normal((3, 16, 64)).astype(np.float32)}
    arrays["matrix"][5, :32] = 0.0  # a block of zeros (scale 0)
    raws = {name: gguf.quants.quantize(a, kind) for name, a in arrays.items()}
    w = gguf.GGUFWriter(str(tmp_path / "b.gguf"), "llama")
    for name, raw in raws.items():
        w.add_tensor(name, raw, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(str(tmp_path / "b.gguf"))
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for name, a in arrays.items():
        want = torch.from_numpy(gguf.quants.dequantize(raws[name], kind).reshape(a.shape))
        for device in devices:
            got = f.tensor(name, device=device)
            assert got.device.type == device and got.dtype == torch.float32 and got.shape == a.shape
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, msg=f"{name} on {device}")
        assert f.tensor(name, torch.bfloat16).dtype == torch.bfloat16
    groups = f.int4_groups("matrix")
    if qtype == "Q8_0":
        assert groups is None
    else:
        codes, scale, zero = groups
        assert codes.shape == (48, 96) and scale.shape == zero.shape == (48, 3) and int(codes.max()) <= 15
        values = (codes.float() - 8).reshape(48, 3, 32) * scale[..., None] + zero[..., None]
        want = torch.from_numpy(gguf.quants.dequantize(raws["matrix"], kind))
        torch.testing.assert_close(values.reshape(48, 96), want, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# bad files
# ---------------------------------------------------------------------------------------------------------------


def _write(path, model_type="llama", edit=None, drop=(), add=None):
    """A GGUF of the tiny llama, optionally with metadata replaced or added (``edit``: key -> value, None to leave
    it out, or (gguf.GGUFValueType, value)), tensors left out (``drop``) or added (``add``: name -> float32 array)."""
    model = random_model(model_type)
    write_gguf(model, str(path) + ".full", model_type)
    full = GGUFFile(str(path) + ".full")
    w = gguf.GGUFWriter(str(path), (edit or {}).get("general.architecture", full.metadata["general.architecture"]))
    edit = edit or {}
    for key, value in [*full.metadata.items(), *((k, v) for k, v in edit.items() if k not in full.metadata)]:
        if key.startswith("GGUF.") or key == "general.architecture" or key == "general.alignment" and key not in edit:
            continue
        value = edit.get(key, value)
        if isinstance(value, tuple):  # (gguf.GGUFValueType, value): a type of one's choosing
            w.add_key_value(key, value[1], value[0])
        elif isinstance(value, int) and not isinstance(value, bool):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
    for name in full.tensors:
        if name not in drop:
            w.add_tensor(name, full.tensor(name).numpy())
    for name, array in (add or {}).items():
        w.add_tensor(name, np.asarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_bad_gguf_files_get_one_clear_error_each(tmp_path):
    good = _write(tmp_path / "good.gguf")
    load_gguf(good)
    data = open(good, "rb").read()
    (tmp_path / "cut_data.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"truncated GGUF file: tensor '.*' ends at byte \d+, the file has"):
        load_model(str(tmp_path / "cut_data.gguf"), "cpu", torch.float32)
    (tmp_path / "cut_header.gguf").write_bytes(data[:300])
    with pytest.raises(CheckpointError, match="truncated or corrupt GGUF header"):
        load_model(str(tmp_path / "cut_header.gguf"), "cpu", torch.float32)
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_model(str(tmp_path / "not.gguf"), "cpu", torch.float32)
    with pytest.raises(CheckpointError, match=r"GGUF architecture 'gpt2' is not supported; supported: llama, qwen2"):
        load_gguf(_write(tmp_path / "gpt2.gguf", edit={"general.architecture": "gpt2"}))
    with pytest.raises(CheckpointError, match=r"tensor 'blk.1.ffn_up.weight' is missing \(needed for "
                                              r"model.layers.1.mlp.up_proj.weight\)"):
        load_gguf(_write(tmp_path / "missing.gguf", drop={"blk.1.ffn_up.weight"}))
    with pytest.raises(CheckpointError, match=r"token_embd.weight has shape \(512, 64\), expected \(512, 96\)"):
        load_gguf(_write(tmp_path / "shape.gguf", edit={"llama.embedding_length": 96}))
    with pytest.raises(CheckpointError, match="metadata llama.block_count is missing"):
        load_gguf(_write(tmp_path / "nolayers.gguf", edit={"llama.block_count": None}))
    with pytest.raises(CheckpointError, match="no such directory or file, and not a preset"):
        load_model(str(tmp_path / "absent.gguf"), "cpu", torch.float32)
    assert not os.path.exists(tmp_path / "absent.gguf")


def _raw_gguf(path, table: list[tuple[str, int, int, int]], data_bytes: int) -> str:
    """A GGUF of F32/F16 vectors written byte by byte from its tensor table, (name, values, ggml type, offset) each,
    no metadata (the default alignment, 32), ``data_bytes`` of zeros after the header: a table gguf.GGUFWriter would
    never write."""
    import struct

    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(table), 0))
    for name, values, ggml_type, offset in table:
        out += struct.pack("<Q", len(name)) + name.encode() + struct.pack("<IQIQ", 1, values, ggml_type, offset)
    out += bytes(-len(out) % 32) + bytes(data_bytes)
    path.write_bytes(bytes(out))
    return str(path)


F32, F16 = 0, 1


@pytest.mark.parametrize("table,message", [
    ([("a", 16, F32, 0), ("b", 16, F32, 0), ("c", 8, F32, 128)], r"'b' has its data at offset 0 .*expected 64 "
     r"\(right after 'a'"),  # (b points at a's data)
    ([("a", 16, F32, 0), ("b", 16, F32, 72), ("c", 8, F32, 136)], "'b' has its data at offset 72"),  # (misaligned)
    ([("a", 16, F32, 0), ("b", 16, F32, 96), ("c", 8, F32, 160)], "'b' has its data at offset 96"),  # (a gap)
    ([("a", 16, F16, 0), ("b", 16, F32, 64), ("c", 8, F32, 128)], r"'b' .*expected 32 \(right after 'a'"),
    ([("a", 16, F32, 0), ("a", 16, F32, 64), ("c", 8, F32, 128)], "'a' appears twice"),
], ids=["overlap", "misaligned", "gap", "type-of-the-one-before", "duplicate"])
def test_a_tensor_table_that_does_not_lay_out_its_data_in_order_is_refused(tmp_path, table, message):
    """ggml's rule: each tensor's data right after the one before it in the table, padded to the alignment. A table
    that breaks it (a tensor pointing at another's data, a misaligned offset, a type whose size does not match the
    bytes, a name twice) loaded before and gave garbage; it is refused, naming the tensors."""
    good = [("a", 16, F32, 0), ("b", 16, F32, 64), ("c", 8, F32, 128)]
    assert set(GGUFFile(_raw_gguf(tmp_path / "good.gguf", good, 160)).tensors) == {"a", "b", "c"}
    with pytest.raises(CheckpointError, match=message):
        GGUFFile(_raw_gguf(tmp_path / "bad.gguf", table, 192))


def test_attention_biases_a_gguf_architecture_has_not_are_refused(tmp_path):
    """llama.cpp writes a Llama with attention biases (q/k permuted like their weights, an output bias): the loader
    would read them wrong, so it refuses them, naming the tensor."""
    from models.checkpoint import CheckpointError

    cfg = preset("tiny-dense").with_(attention_bias=True)
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    write_gguf(model, str(tmp_path / "biased.gguf"), "llama")
    with pytest.raises(CheckpointError, match=r"attention biases \(blk.0.attn_q.bias\) are not supported for llama"):
        load_gguf(str(tmp_path / "biased.gguf"))


@pytest.mark.parametrize("add, edit, layer", [({"blk.2.attn_norm.weight": np.ones(64)}, None, 2),
                                               ({}, {"llama.block_count": 1}, 1)])
def test_a_layer_past_block_count_is_refused_before_the_weights_load(tmp_path, add, edit, layer):
    """Tensors of a layer past block_count are refused by config_from_gguf (torch-free: what serve checks before it
    starts), naming the first and the block count (they were dropped and the first block_count layers served)."""
    from models.gguf_file import config_from_gguf

    path = _write(tmp_path / "past.gguf", edit=edit, add=add)
    with pytest.raises(CheckpointError, match=rf"tensor 'blk.{layer}.\w+.weight' \(\d+ in all\) is in layer {layer}, "
                                              rf"past llama.block_count {layer}: refusing"):
        config_from_gguf(GGUFFile(path))


@pytest.mark.parametrize("add, edit, name, why", [
    ({"blk.0.ffn_down.bias": np.ones(64)}, None, "blk.0.ffn_down.bias", "has no such tensor"),
    ({"output_norm.bias": np.ones(64)}, None, "output_norm.bias", "has no such tensor"),
    ({f"blk.{i}.attn_k_norm.weight": np.ones(16) for i in range(2)}, None, "blk.0.attn_k_norm.weight",
     "q/k norms are read only where the file has attn_q_norm as well"),
])
def test_a_tensor_the_model_does_not_read_is_refused(tmp_path, add, edit, name, why):
    """A tensor the loader would leave unread (a bias or norm it does not serve, a block past block_count) is refused,
    named: the model served without it would not be the file's (they were dropped silently)."""
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' \(\d+ unread in all\) is not read by the loader: "
                                              rf".*{why}"):
        load_gguf(_write(tmp_path / "extra.gguf", edit=edit, add=add))


def test_llama3_rope_freqs_are_read(tmp_path):
    """rope_freqs.weight (llama.cpp's form of Llama 3 rope scaling) is read, not refused: it divides the rotary
    frequencies."""
    plain = load_gguf(_write(tmp_path / "plain.gguf"))
    scaled = load_gguf(_write(tmp_path / "freqs.gguf", add={"rope_freqs.weight": np.full(8, 4.0)}))
    assert not torch.equal(plain.rotary.cos, scaled.rotary.cos)
    torch.testing.assert_close(scaled.rotary.cos[4, :], plain.rotary.cos[1, :])  # 4 positions at 1/4 the frequency


def test_a_rope_scaling_factor_without_a_type_is_linear_as_in_llama_cpp(tmp_path):
    """llama.cpp's load_hparams defaults rope.scaling.type to "linear" and reads the factor from rope.scaling.factor
    or the older rope.scale_linear: so does the loader (the factor was ignored)."""
    for key in ("llama.rope.scaling.factor", "llama.rope.scale_linear"):
        model = load_gguf(_write(tmp_path / f"{key}.gguf", edit={key: 4.0}))
        assert (model.cfg.rope_scaling.rope_type, model.cfg.rope_scaling.factor) == ("linear", 4.0), key
    assert load_gguf(_write(tmp_path / "none.gguf")).cfg.rope_scaling is None
    for edit in ({"llama.rope.scaling.type": "linear"}, {"llama.rope.scaling.factor": 0.0}):  # (llama.cpp: unscaled)
        assert load_gguf(_write(tmp_path / "unscaled.gguf", edit=edit)).cfg.rope_scaling is None, edit


def test_metadata_of_the_wrong_kind_is_refused_naming_the_key(tmp_path):
    """A string for a number, a per-layer array whose entries differ, a general.alignment of 0 or not a multiple of 8
    (the GGUF specification) get one clear error naming the key (they raised TypeError, ValueError or
    ZeroDivisionError, or with alignment 7 loaded the tensors from the wrong bytes); a per-layer array of one value
    is that value."""
    T = gguf.GGUFValueType
    plain = load_gguf(_write(tmp_path / "plain.gguf")).cfg
    for key, field in (("llama.attention.head_count_kv", "num_kv_heads"),
                       ("llama.feed_forward_length", "intermediate_size")):
        model = load_gguf(_write(tmp_path / f"{key}.gguf", edit={key: [getattr(plain, field)] * 2}))
        assert model.cfg == plain, key
        with pytest.raises(CheckpointError, match=rf"metadata {key} varies per layer \(\[2, 4\]\), which is not "
                                                  rf"supported"):
            load_gguf(_write(tmp_path / f"{key}-differ.gguf", edit={key: [2, 4]}))
    cases = {"llama.block_count": ((T.STRING, "two"), "'two', expected an integer"),
             "llama.attention.layer_norm_rms_epsilon": ((T.STRING, "abc"), "'abc', expected a number"),
             "llama.context_length": (512.5, "512.5, expected an integer")}
    for key, (value, why) in cases.items():
        with pytest.raises(CheckpointError, match=rf"metadata {key} is {why}"):
            load_gguf(_write(tmp_path / f"{key}.gguf", edit={key: value}))
    for value in (0, 7, (T.STRING, "32")):
        with pytest.raises(CheckpointError, match=r"metadata general.alignment is .*, expected a positive multiple "
                                                  r"of 8 \(the GGUF specification\)"):
            load_gguf(_write(tmp_path / "align.gguf", edit={"general.alignment": value}))


def test_metadata_that_changes_the_heads_or_the_context_is_read_or_refused(tmp_path):
    """A value length unlike the key length (ignored before), a head_count_kv of 0 (read as "absent": all heads),
    a missing context_length (8192 assumed; llama.cpp requires it) are refused naming the key; a sliding window
    below the context (Mistral's) bounds the context served, as models.loader does for config.json."""
    plain = load_gguf(_write(tmp_path / "plain.gguf")).cfg
    cases = {"llama.attention.value_length": (plain.head_dim * 2, "value_length 32 differs from the key length 16"),
             "llama.attention.head_count_kv": (0, r"llama.attention.head_count_kv \(num_kv_heads\) must be >= 1, "
                                                  r"got 0"),  # (the file's key named, ours beside it)
             "llama.context_length": (None, "metadata llama.context_length is missing")}
    for key, (value, words) in cases.items():
        with pytest.raises(CheckpointError, match=words):
            load_gguf(_write(tmp_path / f"{key}.gguf", edit={key: value}))
    windowed = load_gguf(_write(tmp_path / "window.gguf", edit={"llama.attention.sliding_window": 64})).cfg
    assert windowed.max_position_embeddings == 64 and plain.max_position_embeddings > 64


TOKENS = ["<unk>", "<s>", "</s>", "\u2581a", "\u2581b", "\u2581ab"]
TOKEN_MD = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": TOKENS, "tokenizer.ggml.scores": [0.0] * 6,
            "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1], "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}


@pytest.mark.parametrize("edit, message", [
    ({"tokenizer.ggml.unknown_token_id": 99}, r"tokenizer.ggml.unknown_token_id is 99, outside the vocabulary of 6 "
                                              r"tokens \(0..5\)"),
    ({"tokenizer.ggml.bos_token_id": 6}, r"tokenizer.ggml.bos_token_id is 6, outside the vocabulary of 6 tokens"),
    ({"tokenizer.ggml.padding_token_id": "1"}, r"tokenizer.ggml.padding_token_id is '1', outside the vocabulary"),
    ({"tokenizer.ggml.merges": ["\u2581a", "\u2581a b"]},
     r"tokenizer.ggml.merges\[0\] is '\u2581a', expected two tokens separated by a space"),
    ({"tokenizer.ggml.merges": [3]}, r"tokenizer.ggml.merges\[0\] is 3, expected two tokens separated by a space"),
    ({"tokenizer.ggml.merges": ["\u2581a b", "zz yy"]}, r"tokenizer.ggml.merges\[0\] '\u2581a b': 'b' is not in "
                                                       r"the vocabulary \(tokenizer.ggml.tokens\)"),
    ({"tokenizer.ggml.merges": ["\u2581a \u2581b"]}, r"tokenizer.ggml.merges\[0\] '\u2581a \u2581b': '\u2581a\u2581b' "
                                                    r"is not in the vocabulary"),
    ({"tokenizer.ggml.tokens": TOKENS[:5] + ["\u2581a"]},
     r"tokenizer.ggml.tokens has '\u2581a' twice \(ids 3 and 5\); each token must appear once"),
    ({"tokenizer.ggml.scores": [0.0] * 4}, r"tokenizer.ggml.scores has 4 entries for 6 tokens "
                                           r"\(tokenizer.ggml.tokens\); expected one per token"),
    ({"tokenizer.ggml.token_type": [1] * 7}, r"tokenizer.ggml.token_type has 7 entries for 6 tokens"),
])
def test_a_bad_gguf_vocabulary_is_refused_naming_the_key(edit, message):
    """Special token ids outside the vocabulary (unknown: IndexError; BOS: silently not added), malformed merges
    (a TypeError from tokenizers), a token twice (the later id shadowed the earlier) and per-token arrays of another
    length than the tokens (scores: silently cut short) are refused, naming the file and the key."""
    from models.text import tokenizer_from_gguf_metadata

    tokenizer_from_gguf_metadata(TOKEN_MD, "good.gguf")
    with pytest.raises(CheckpointError, match=rf"^bad.gguf: {message}"):
        tokenizer_from_gguf_metadata({**TOKEN_MD, **edit}, "bad.gguf")


def test_one_longrope_factor_tensor_without_the_other_is_refused(tmp_path):
    """Phi-3's LongRoPE needs rope_factors_long and rope_factors_short: one alone is refused, named (the short one
    alone was ignored, the long one alone raised KeyError)."""
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        with pytest.raises(CheckpointError, match=rf"tensor '{name}' without its pair: LongRoPE needs both"):
            load_gguf(_write(tmp_path / f"{name}.gguf", add={name: np.ones(8)}))
