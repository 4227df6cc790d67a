"""Every supported architecture against transformers: a tiny random model built and saved by transformers loads,
its logits on a ragged batch (three prompts in one step) match transformers' within float32 tolerance, and 32
greedy tokens through EngineCore (the CPU static-shape path, chunked prefill) equal transformers' generate."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dispatcher.engine.engine_core import EngineArgs, EngineCore  # noqa: E402
from dispatcher.plan.config import resolve  # noqa: E402
from models.attention import allocate_kv_cache  # noqa: E402
from models.attention_metadata import AttentionMetadata  # noqa: E402
from models.checkpoint import CheckpointError  # noqa: E402
from models.loader import load_checkpoint, read_hf_config  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402

COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.08, tie_word_embeddings=False)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),  # head_dim != hidden / heads
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=32)),
    "qwen2-yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3-yarn": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0, "original_max_position_embeddings": 32})),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=6.0, attention_multiplier=0.11, residual_multiplier=0.4, logits_scaling=0.25)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, embedding_multiplier=6.0,
        attention_multiplier=0.11, residual_multiplier=0.4, logits_scaling=0.25)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=4, attn_logit_softcapping=2.0,
        final_logit_softcapping=6.0, tie_word_embeddings=True, pad_token_id=0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=20, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        tie_word_embeddings=True, pad_token_id=0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=0, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=256, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.9 * i for i in range(8)]})),
}
MAX_MODEL_LEN = 128
"""What the tests serve (LongRoPE's short factors: Phi-3's original context here is 256)."""
PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [300, 2, 1]]


def hf_model(name: str, seed: int = 0):
    cfg_cls, model_cls, extra = ARCHS[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra}, attn_implementation="eager")
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # norms off 1 and biases off 0, so that loading them wrong shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.7, 1.3)
            elif n.endswith(".bias"):
                p.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module", params=list(ARCHS))
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = hf_model(request.param)
    model.save_pretrained(path)
    return request.param, str(path), model


def ragged_logits(model, prompts, device="cpu", kv_dtype=None):
    """Our forward over every prompt in one step (one request per prompt, its own KV blocks; the cache in
    ``kv_dtype``, default the model's)."""
    cfg = model.cfg
    ids, pos, req = [], [], []
    for r, p in enumerate(prompts):
        ids += p
        pos += list(range(len(p)))
        req += [r] * len(p)
    pos_t, req_t = torch.tensor(pos, device=device), torch.tensor(req, dtype=torch.int32, device=device)
    per_req = max(4, -(-max(len(p) for p in prompts) // 8))
    table = torch.arange(len(prompts) * per_req, dtype=torch.int32, device=device).view(len(prompts), per_req)
    dtype = next(model.parameters()).dtype
    kv = allocate_kv_cache(cfg.num_layers, len(prompts) * per_req, 8, cfg.num_kv_heads, cfg.head_dim, kv_dtype or dtype,
                           device)
    slots = table[req_t.long(), pos_t // 8].long() * 8 + pos_t % 8
    meta = AttentionMetadata.from_tokens(slots, req_t, pos_t.int(), table)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids, device=device), pos_t, kv, meta)).float().cpu()


def test_logits_on_a_ragged_batch_match_transformers(saved):
    name, path, hf = saved
    ours = load_checkpoint(path, "cpu", torch.float32, max_model_len=MAX_MODEL_LEN)
    got = ragged_logits(ours, PROMPTS)
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale)
    assert scale > 1.0  # logits that say something (not all near zero)


def test_greedy_tokens_through_the_engine_match_transformers(saved):
    name, path, hf = saved
    cfg = resolve({}, None, platform="default", max_num_seqs=4, max_num_batched_tokens=16)
    engine = EngineCore(cfg, EngineArgs(path, num_kv_blocks=64, block_size=8, max_model_len=128,
                                        use_cuda_graphs=False))
    ours = engine.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))
    for prompt, got in zip(PROMPTS, ours):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == want, name


@pytest.mark.gpu
def test_gpu_bf16_through_the_kernels_and_graphs(saved):
    """On the GPU in bf16 (Triton attention, fused rotary with Qwen3's q/k norms, MoE kernels): the logits stay
    within bf16 error of transformers' float32, and greedy tokens through captured graphs equal the same closures
    run eagerly on the same padded buffers."""
    name, path, hf = saved
    got = ragged_logits(load_checkpoint(path, "cuda", torch.bfloat16, max_model_len=MAX_MODEL_LEN), PROMPTS, "cuda")
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    assert float((got - want).norm() / want.norm()) < 3e-2, name
    assert_graphs_match_eager(path, name)


def assert_graphs_match_eager(path: str, name: str, **engine_args) -> None:
    """On the GPU: 16 greedy tokens a prompt through captured graphs equal the same closures run eagerly."""
    cfg = resolve({}, None, platform="default", max_num_seqs=4, max_num_batched_tokens=64)
    args = dict(device="cuda", num_kv_blocks=64, block_size=8, max_model_len=128, **engine_args)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    graphs = EngineCore(cfg, EngineArgs(path, use_cuda_graphs=True, **args)).generate(PROMPTS, params)
    eager = EngineCore(cfg, EngineArgs(path, use_cuda_graphs=False, **args)).generate(PROMPTS, params)
    assert graphs == eager, name


def test_config_reads_what_the_checkpoint_says(saved):
    name, path, hf = saved
    _, cfg = read_hf_config(path)
    c = hf.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads)
    assert cfg.head_dim == (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    assert cfg.qk_norm == name.startswith(("qwen3", "gemma3")) and cfg.attention_bias == name.startswith("qwen2")
    assert cfg.is_moe == (name in ("mixtral", "qwen2_moe", "qwen3_moe", "granitemoe"))
    assert (cfg.rope_scaling is not None) == (name in ("llama3-rope", "qwen2-yarn", "qwen3-yarn", "gemma3", "phi3"))
    assert cfg.sliding_layers == {"gemma2": (0,), "gemma3": (0,)}.get(name, ())
    assert cfg.sandwich_norms == name.startswith("gemma") and (cfg.hidden_act == "gelu_tanh") == cfg.sandwich_norms


def test_sharded_checkpoint_with_an_index_loads_the_same(tmp_path):
    model = hf_model("qwen3_moe", seed=3)
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    files = os.listdir(tmp_path / "sharded")
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    one = load_checkpoint(str(tmp_path / "one"))
    sharded = load_checkpoint(str(tmp_path / "sharded"))
    for (n, a), (_, b) in zip(one.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), n
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[0]
    os.remove(tmp_path / "sharded" / missing)
    with pytest.raises(CheckpointError, match=f"names shard '{missing}', which is not in"):
        load_checkpoint(str(tmp_path / "sharded"))


def test_generation_config_eos_ids_are_all_used(tmp_path):
    """config.json's EOS and every id of generation_config.json's list end generation: the second id of the list
    (a token the free-running output reaches) stops it there."""
    model = hf_model("llama", seed=1)
    model.save_pretrained(tmp_path)
    args = dict(num_kv_blocks=64, block_size=8, max_model_len=128, use_cuda_graphs=False)
    sched = resolve({}, None, platform="default", max_num_seqs=4, max_num_batched_tokens=64)
    free = EngineCore(sched, EngineArgs(str(tmp_path), **args)).generate(
        [PROMPTS[1]], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    stop_at = next(i for i in range(5, 32) if free[i] not in free[:i])
    unused = [t for t in range(COMMON["vocab_size"]) if t not in free]
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": unused[0]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [unused[1], free[stop_at]]}))
    _, cfg = read_hf_config(str(tmp_path))
    assert cfg.eos_token_ids == (unused[0], unused[1], free[stop_at])
    engine = EngineCore(sched, EngineArgs(str(tmp_path), **args))
    out = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=32))[0]
    assert out == free[:stop_at + 1]


def test_the_cpu_rms_norm_is_torchs():
    """The CPU path's RMSNorm (a layer norm of [x, -x], for speed) gives F.rms_norm's values to the dtype's rounding
    (in bfloat16 almost all bit for bit), with the residual add, and follows a weight changed in place (it keeps a
    doubled copy)."""
    import torch.nn.functional as F

    from models.fused import rms_norm_torch

    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        for shape in ((1, 576), (37, 96), (5, 9, 64), (0, 64)):
            x = (torch.randn(shape, generator=gen) * 4 + 1).to(dtype)
            r = torch.randn(shape, generator=gen).to(dtype)
            w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
            for _ in range(2):
                want = F.rms_norm(x + r, (shape[-1],), w, 1e-6)
                got, residual = rms_norm_torch(x, w, 1e-6, r)
                assert torch.equal(residual, x + r)
                rtol = 2 ** -8 if dtype == torch.bfloat16 else 1e-6
                torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6)
                if dtype == torch.bfloat16:
                    assert (got != want).sum() <= max(1, want.numel() // 1000), shape
                w.mul_(-2)  # in place: the next round must use the new weight
    with torch.inference_mode():  # inference tensors keep no version counter
        x, w = torch.randn(3, 64), torch.rand(64) + 0.5
        for _ in range(2):
            torch.testing.assert_close(rms_norm_torch(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6), rtol=1e-6, atol=1e-6)
            w.mul_(-2)


def test_the_cpu_rotary_rows_are_the_reference_rotation():
    """The CPU forward's rotary (rows prepared once a forward: [c, c] and [-s, s], halves swapped by a roll) gives
    the plain rotation's values bit for bit, in bfloat16 and float32."""
    from models.fused import rotary_torch
    from models.layers import RotaryEmbedding

    rotary = RotaryEmbedding(64, 512, 10000.0)
    positions = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1))
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(37, 12, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
        assert torch.equal(rotary.at(positions)(positions, x), rotary_torch(positions, x, rotary.cos, rotary.sin))


def test_longrope_uses_its_long_factors_past_the_original_context(tmp_path):
    """Phi-3's LongRoPE: served with max_model_len past original_max_position_embeddings (256 here) the long
    factors apply (vLLM's and llama.cpp's rule), which is what transformers computes for a 300-token sequence;
    within it, the short ones (the other tests)."""
    hf = hf_model("phi3", seed=2)
    hf.save_pretrained(tmp_path)
    prompt = [(7 * i) % 380 + 3 for i in range(300)]
    ours = load_checkpoint(str(tmp_path), "cpu", torch.float32, max_model_len=512)
    got = ragged_logits(ours, [prompt])
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


# ---------------------------------------------------------------------------------------------------------------
# configs that change the forward: read as transformers reads them, or refused (never loaded silently wrong)
# ---------------------------------------------------------------------------------------------------------------


def _saved_and_edited(tmp_path, name: str, extra: dict, edit=None):
    """``ARCHS[name]`` with ``extra``, saved by transformers, config.json then changed by ``edit``; the reference
    model transformers loads back from it."""
    cfg_cls, model_cls, base = ARCHS[name]
    ARCHS[f"{name}+"] = (cfg_cls, model_cls, {**base, **extra})
    try:
        model = hf_model(f"{name}+")
    finally:
        del ARCHS[f"{name}+"]
    model.save_pretrained(tmp_path)
    if edit is not None:
        path = tmp_path / "config.json"
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))
    return getattr(transformers, model_cls).from_pretrained(tmp_path, attn_implementation="eager",
                                                            dtype=torch.float32).eval()


def _without(*keys):
    return lambda config: [config.pop(k, None) for k in keys]


@pytest.mark.parametrize("name, extra, keys", [
    ("mixtral", {}, ("rope_theta", "rope_parameters")),
    ("mixtral", {}, ("rms_norm_eps",)),
    ("phi3", {"rope_parameters": None}, ("rms_norm_eps",)),
    ("gemma2", {}, ("attn_logit_softcapping", "final_logit_softcapping")),
    ("gemma2", {}, ("query_pre_attn_scalar",)),
    ("gemma2", {}, ("hidden_activation", "hidden_act")),
    ("gemma3", {"rope_parameters": None}, ("rope_parameters",)),
    ("granite", {}, ("attention_multiplier",)),
    ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": None,
                                   "original_max_position_embeddings": 64}}, ()),
    ("qwen2_moe", {"qkv_bias": False}, ()),
], ids=["mixtral theta", "mixtral eps", "phi3 eps", "gemma2 softcaps", "gemma2 query scalar", "gemma2 activation",
        "gemma3 theta", "granite attention", "yarn factor from the context", "qwen2-moe no qkv bias"])
def test_a_key_left_out_means_what_transformers_makes_of_it(tmp_path, name, extra, keys):
    """A config.json without a key that changes the forward gets transformers' default for that architecture
    (Mixtral's rope_theta 1e6, Gemma 2's soft-capping 50 / 30, ...), not the Llama default."""
    ref = _saved_and_edited(tmp_path, name, {k: v for k, v in extra.items() if v is not None}, _without(*keys))
    ours = load_checkpoint(str(tmp_path), "cpu", torch.float32, max_model_len=MAX_MODEL_LEN)
    with torch.no_grad():
        want = torch.cat([ref(torch.tensor([p])).logits[0] for p in PROMPTS])
    torch.testing.assert_close(ragged_logits(ours, PROMPTS), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name, extra, edit, words", [
    ("gemma3", {"use_bidirectional_attention": True}, None, "use_bidirectional_attention"),
    ("phi3", {"partial_rotary_factor": 0.5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                "partial_rotary_factor": 0.5}},
     _without("partial_rotary_factor"), "partial_rotary_factor 0.5"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}},
     None, "sliding_attention.rope_type 'linear'"),
], ids=["bidirectional gemma", "partial rotary in rope_parameters", "sliding layers' rope scaling"])
def test_a_config_that_changes_the_forward_unsupported_is_refused(tmp_path, name, extra, edit, words):
    _saved_and_edited(tmp_path, name, extra, edit)
    with pytest.raises(CheckpointError, match=words):
        load_checkpoint(str(tmp_path), "cpu", torch.float32, max_model_len=MAX_MODEL_LEN)


def test_a_tied_config_with_a_different_stored_head_is_refused(tmp_path):
    """tie_word_embeddings, and an lm_head.weight that differs from the embedding: transformers serves the stored
    head, vLLM the embedding; refused, naming the key."""
    from safetensors.torch import load_file, save_file

    _saved_and_edited(tmp_path, "qwen2", {"tie_word_embeddings": True})
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="tie_word_embeddings"):
        load_checkpoint(str(tmp_path), "cpu", torch.float32)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # (the same: tied, loads)
    save_file(tensors, path, metadata={"format": "pt"})
    load_checkpoint(str(tmp_path), "cpu", torch.float32)


@pytest.mark.parametrize("declared", [False, True], ids=["undeclared", "compression_config"])
def test_integer_weights_are_never_read_as_floats(tmp_path, declared):
    """int8 codes where a float weight belongs (a quantized checkpoint whose config this loader does not read, or
    one under compressed-tensors' older key ``compression_config``) are refused, not copied in as floats."""
    from safetensors.torch import load_file, save_file

    _saved_and_edited(tmp_path, "llama", {})
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = (tensors[name] * 500).round().clamp(-127, 127).to(torch.int8)
    save_file(tensors, path, metadata={"format": "pt"})
    if declared:
        config = json.loads((tmp_path / "config.json").read_text())
        config["compression_config"] = {"quant_method": "compressed-tensors", "format": "int-quantized",
                                        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                            "type": "int", "num_bits": 8, "strategy": "channel"}}}}
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'int' 8-bit" if declared else "is torch.int8, not a float"):
        load_checkpoint(str(tmp_path), "cpu", torch.float32)
