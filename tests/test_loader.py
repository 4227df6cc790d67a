"""Checkpoints round-trip through the Hugging Face-format loader, and bad ones get clear errors."""

import json
import os

import pytest

torch = pytest.importorskip("torch")

from models.attention import allocate_kv_cache  # noqa: E402
from models.attention_metadata import AttentionMetadata  # noqa: E402
from models.config import preset  # noqa: E402
from models.checkpoint import CheckpointError  # noqa: E402
from models.loader import load_checkpoint, save_checkpoint  # noqa: E402
from models.transformer import build_model  # noqa: E402

SHAPES = {
    "llama": preset("tiny-dense"),
    "qwen2": preset("tiny-dense").with_(attention_bias=True, tie_word_embeddings=True),
    "mixtral": preset("tiny-moe").with_(intermediate_size=32),  # Mixtral: one intermediate size, the experts'
    "qwen2_moe": preset("tiny-moe").with_(attention_bias=True, norm_topk_prob=False,
                                          shared_expert_intermediate_size=48),
}
HF_KEYS = {
    "llama": "model.layers.1.mlp.gate_proj.weight",
    "qwen2": "model.layers.0.self_attn.k_proj.bias",
    "mixtral": "model.layers.1.block_sparse_moe.experts.7.w3.weight",
    "qwen2_moe": "model.layers.0.mlp.shared_expert_gate.weight",
}


def logits(model, tokens):
    cfg = model.cfg
    n = len(tokens)
    kv = allocate_kv_cache(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, model.dtype, "cpu")
    pos = torch.arange(n)
    meta = AttentionMetadata.from_tokens(pos.clone(), torch.zeros(n, dtype=torch.int32), pos.int(),
                                         torch.arange(4, dtype=torch.int32)[None])
    return model.compute_logits(model(torch.tensor(tokens), pos, kv, meta))


@pytest.mark.parametrize("model_type", list(SHAPES))
def test_checkpoint_round_trip(tmp_path, model_type):
    model = build_model(SHAPES[model_type], "cpu", torch.float32, seed=7)
    if model.cfg.attention_bias:
        with torch.no_grad():
            for layer in model.layers:
                layer.qkv_proj.bias.normal_(0, 0.1)
    save_checkpoint(model, str(tmp_path), model_type)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as st:
        assert HF_KEYS[model_type] in st.keys()
    loaded = load_checkpoint(str(tmp_path), "cpu", torch.float32)
    assert loaded.cfg == model.cfg
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name
    tokens = [5, 17, 3, 99, 42, 7]
    torch.testing.assert_close(logits(loaded, tokens), logits(model, tokens), rtol=0, atol=0)


def test_bad_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        load_checkpoint(str(tmp_path))
    model = build_model(preset("tiny-dense"), "cpu", torch.float32)
    save_checkpoint(model, str(tmp_path), "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "hidden_size": 96}))
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight has shape \(512, 64\), expected \(512, 96\)"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "vocab_size"}))
    with pytest.raises(CheckpointError, match="missing 'vocab_size'"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match="tensor 'model.layers.2.input_layernorm.weight' is missing"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="unreadable safetensors file"):
        load_checkpoint(str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        load_checkpoint(str(tmp_path))


def test_engine_serves_a_checkpoint_directory(tmp_path):
    from dispatcher.plan.config import resolve
    from dispatcher.engine.engine_core import EngineArgs, EngineCore
    from scheduler.request import SamplingParams

    model = build_model(SHAPES["mixtral"], "cpu", torch.float32, seed=3)
    save_checkpoint(model, str(tmp_path), "mixtral")
    cfg = resolve({}, None, platform="sm100", max_num_seqs=8, max_num_batched_tokens=128)
    from_dir = EngineCore(cfg, EngineArgs(str(tmp_path), num_kv_blocks=64, block_size=8, max_model_len=64))
    from_shape = EngineCore(cfg, EngineArgs(SHAPES["mixtral"], num_kv_blocks=64, block_size=8, max_model_len=64, seed=3))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert from_dir.generate(prompts, params) == from_shape.generate(prompts, params)
