"""Checkpoints round-trip through the Hugging Face-format loader, and bad ones get clear errors."""

import json
import os
import re

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
    from_shape = EngineCore(cfg, EngineArgs(SHAPES["mixtral"], num_kv_blocks=64, block_size=8, max_model_len=64,
                                            seed=3))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert from_dir.generate(prompts, params) == from_shape.generate(prompts, params)


def _tiny_config(tmp_path) -> dict:
    save_checkpoint(build_model(preset("tiny-dense"), "cpu", torch.float32), str(tmp_path), "llama")
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("edit, words", [
    ({"hidden_size": "64"}, "hidden_size must be an integer, got '64'"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer, got True"),  # (served 1 layer)
    ({"intermediate_size": -128}, "intermediate_size must be >= 1, got -128"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be >= 1, got 0"),  # (0 was read as "absent")
    ({"head_dim": 0}, "head_dim must be >= 1, got 0"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a number, got nan"),  # (all-zero tokens, no error)
    ({"rms_norm_eps": -1}, "rms_norm_eps must be > 0, got -1.0"),
    ({"rms_norm_eps": [1e-6]}, r"rms_norm_eps must be a number, got \[1e-06\]"),  # (a TypeError traceback)
    ({"rope_theta": 0}, "rope_theta must be > 0, got 0.0"),  # (0 was replaced by 10000)
    ({"rope_theta": "1e4"}, "rope_theta must be a number, got '1e4'"),
    ({"rope_scaling": "linear"}, "rope_scaling must be an object, got 'linear'"),  # (an AttributeError traceback)
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, r"rope_scaling \(linear\): factor must be a finite "
                                                              r"number > 0, got 0.0"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 4,
                       "original_max_position_embeddings": 64}}, "high_freq_factor .4.0. must be above"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0] * 8,
                       "original_max_position_embeddings": 64}}, "short_factor has 1 entries, expected head_dim / 2"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be >= 1, got 0"),  # (every request refused)
    ({"max_position_embeddings": 10 ** 12}, "max_position_embeddings must be at most 4,194,304"),  # (out of memory)
    ({"vocab_size": 10 ** 13}, "vocab_size must be at most 4,194,304"),
    ({"eos_token_id": "2"}, "eos_token_id must be an integer or a list of integers, got '2'"),  # (never stopped)
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),  # (read as true)
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),  # (transformers applies it)
    ({"architectures": ["LlamaForSequenceClassification"]}, "'LlamaForSequenceClassification' is not a causal "
                                                             "language model"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_a_config_value_of_a_wrong_type_or_range_is_refused_naming_its_key(tmp_path, edit, words):
    """Each value a probe found loaded silently wrong (NaN or negative epsilons and rope bases gave all-zero tokens;
    0 and "false" read as absent or true) or failing under a traceback: one CheckpointError naming config.json's
    key, its value and the limit."""
    from models.loader import read_hf_config

    cfg = _tiny_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(CheckpointError, match=f"config.json: .*{words}"):
        read_hf_config(str(tmp_path))


def _tiny_tensors(tmp_path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    cfg = _tiny_config(tmp_path)
    return cfg, load_file(str(tmp_path / "model.safetensors"))


def _rewrite(tmp_path, shards: dict[str, dict], index: dict | None = None) -> None:
    from safetensors.torch import save_file

    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    for name, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / name))
    if index is not None:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))


def test_tensors_the_model_would_drop_are_refused(tmp_path):
    """A tensor nothing reads means the checkpoint is not the model the loader would build (a bias, a q/k norm or a
    layer that config.json does not declare, all dropped without a word before): refused, naming it. Rotary
    frequencies, which the config determines, are not."""
    cfg, tensors = _tiny_tensors(tmp_path)
    _rewrite(tmp_path, {"model.safetensors": {**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq":
                                              torch.ones(8)}})
    load_checkpoint(str(tmp_path))
    for extra in ("model.layers.0.self_attn.o_proj.bias", "model.layers.2.self_attn.q_proj.weight", "foo.bar"):
        _rewrite(tmp_path, {"model.safetensors": {**tensors, extra: torch.ones(64)}})
        with pytest.raises(CheckpointError, match=f"has tensors this model does not use: '{re.escape(extra)}'"):
            load_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))  # (served one layer)
    _rewrite(tmp_path, {"model.safetensors": tensors})
    with pytest.raises(CheckpointError, match="'model.layers.1.input_layernorm.weight', .* and 6 more"):
        load_checkpoint(str(tmp_path))


def test_a_tensor_in_two_shards_or_against_its_index_is_refused(tmp_path):
    """Which of two copies the model got was an accident of file order, and the index's weight_map was not read:
    a tensor in two shards, a shard the index places elsewhere or outside the directory are refused."""
    _, tensors = _tiny_tensors(tmp_path)
    norm = {"model.norm.weight": torch.full((64,), 100.0)}
    rest = {k: v for k, v in tensors.items() if k != "model.norm.weight"}
    _rewrite(tmp_path, {"a.safetensors": tensors, "zz_stale.safetensors": norm})
    with pytest.raises(CheckpointError, match="'model.norm.weight' is in both a.safetensors and zz_stale"):
        load_checkpoint(str(tmp_path))
    index = {**{k: "a.safetensors" for k in rest}, "model.norm.weight": "a.safetensors"}
    _rewrite(tmp_path, {"a.safetensors": rest, "b.safetensors": norm}, index)
    with pytest.raises(CheckpointError, match="maps tensor 'model.norm.weight' to a.safetensors, but no shard has "
                                              "it"):  # (the shards it names; before: a missing tensor, unexplained)
        load_checkpoint(str(tmp_path))
    _rewrite(tmp_path, {"a.safetensors": rest, "b.safetensors": norm},
             {**index, "model.norm.weight": "../b.safetensors"})
    with pytest.raises(CheckpointError, match="names shard '../b.safetensors', which is not a file name"):
        load_checkpoint(str(tmp_path))
    _rewrite(tmp_path, {"a.safetensors": rest, "b.safetensors": norm}, {**index, "model.norm.weight": "b.safetensors"})
    assert torch.equal(load_checkpoint(str(tmp_path)).norm.weight, norm["model.norm.weight"])


def test_each_part_of_a_fused_projection_has_its_own_shape(tmp_path):
    """q and k swapped, or gate and up of uneven sizes, add up to the fused shape: each part is checked."""
    _, tensors = _tiny_tensors(tmp_path)
    p = "model.layers.0"
    q, k = tensors[f"{p}.self_attn.q_proj.weight"], tensors[f"{p}.self_attn.k_proj.weight"]
    _rewrite(tmp_path, {"model.safetensors": {**tensors, f"{p}.self_attn.q_proj.weight": k.repeat(1, 1)[:32],
                                              f"{p}.self_attn.k_proj.weight": q}})
    with pytest.raises(CheckpointError, match=r"has shape \(32, 64\) \+ \(64, 64\) \+ \(32, 64\), expected "
                                              r"\(64, 64\) \+ \(32, 64\) \+ \(32, 64\)"):
        load_checkpoint(str(tmp_path))
    gate, up = tensors[f"{p}.mlp.gate_proj.weight"], tensors[f"{p}.mlp.up_proj.weight"]
    _rewrite(tmp_path, {"model.safetensors": {**tensors, f"{p}.mlp.gate_proj.weight": torch.cat([gate, up[:64]]),
                                              f"{p}.mlp.up_proj.weight": up[64:]}})
    with pytest.raises(CheckpointError, match=r"expected \(128, 64\) \+ \(128, 64\)"):
        load_checkpoint(str(tmp_path))


def test_an_fp8_kv_cache_scale_of_zero_or_nan_is_refused(tmp_path):
    _, tensors = _tiny_tensors(tmp_path)
    scales = {f"model.layers.{i}.self_attn.{x}_scale": torch.tensor(v) for i in range(2)
              for x, v in (("k", 0.0), ("v", float("nan")))}
    _rewrite(tmp_path, {"model.safetensors": {**tensors, **scales}})
    with pytest.raises(CheckpointError, match=r"k_scale must be one finite number > 0, got \[0.0\]"):
        load_checkpoint(str(tmp_path))


def test_a_config_that_is_not_utf8_text_is_refused_naming_the_file(tmp_path):
    """A UnicodeDecodeError traceback before (config.json, generation_config.json, tokenizer_config.json)."""
    from models.loader import read_hf_config

    cfg = _tiny_config(tmp_path)
    (tmp_path / "config.json").write_bytes(json.dumps(cfg).encode("utf-16"))
    with pytest.raises(CheckpointError, match=r"config.json: the model config is not UTF-8 text \(byte 0: invalid"):
        read_hf_config(str(tmp_path))


def test_fp8_kv_scales_under_their_older_names_are_read_and_rotary_caches_ignored(tmp_path):
    """vLLM reads a KV cache's scales as k_scale / v_scale, AutoFP8's k_proj / v_proj output_scale and the older
    shared kv_scale (a key scale without a value scale: 1.0 for the values); ColossalAI's cached rotary cos / sin are
    derived from the config. Each was refused as an unread tensor by the first version of that check."""
    _, tensors = _tiny_tensors(tmp_path)
    a = "model.layers.{}.self_attn"
    for extra, want in [({a.format(0) + ".kv_scale": torch.tensor(0.5)}, (0.5, 0.5)),
                        ({a.format(0) + ".k_proj.output_scale": torch.tensor(0.25),
                          a.format(0) + ".v_proj.output_scale": torch.tensor(2.0)}, (0.25, 2.0)),
                        ({a.format(0) + ".k_scale": torch.tensor(3.0)}, (3.0, 1.0)),
                        ({a.format(0) + ".rotary_emb.cos_cached": torch.ones(4, 8)}, (1.0, 1.0))]:
        _rewrite(tmp_path, {"model.safetensors": {**tensors, **extra}})
        attn = load_checkpoint(str(tmp_path)).layers[0].attn
        assert (attn.k_scale, attn.v_scale) == want, extra


def test_a_weight_holding_a_nan_or_an_infinity_is_refused_naming_it(tmp_path):
    """A corrupt checkpoint (a NaN in one weight, an infinity in another) would load and generate garbage: the load
    refuses it, naming the first such weight as the model holds it."""
    from models.loader import load_model

    _, tensors = _tiny_tensors(tmp_path)
    load_model(str(tmp_path), "cpu", torch.float32)  # (the checkpoint as written loads)
    bad = dict(tensors)
    bad["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"].clone()
    bad["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    bad["model.norm.weight"] = tensors["model.norm.weight"].clone()
    bad["model.norm.weight"][0] = float("inf")
    _rewrite(tmp_path, {"model.safetensors": bad})
    with pytest.raises(CheckpointError, match=r"weight layers\.1\.mlp\.down_proj\.weight \(and 1 more\) holds a NaN "
                                              r"or an infinity"):
        load_model(str(tmp_path), "cpu", torch.float32)
