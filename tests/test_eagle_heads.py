"""EAGLE draft heads from published checkpoints: an EAGLE-3 head written by SpecForge's own class
(``specforge.modeling.draft.llama3_eagle.LlamaForCausalLMEagle3``, saved with ``save_pretrained``) loads and gives
SpecForge's draft logits, its chain of draft tokens as served, and its training-time-test logits (the trainer's);
an EAGLE-1 head in the EAGLE authors' format matches a plain reference forward; heads that do not fit are refused
with the field and both values; greedy output with a head equals greedy output without one.

SpecForge (pip ``specforge``, Apache-2.0) pins torch, transformers and sglang, so it is not a test dependency: its
wheel is fetched once (``pip download --no-deps``) into ``${TWOGRID_CACHE:-~/.cache/twogrid}`` and imported from
there, its modeling code being plain PyTorch over transformers.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dispatcher.engine.engine_core import EngineArgs, EngineCore  # noqa: E402
from dispatcher.plan.config import resolve  # noqa: E402
from models.attention import allocate_kv_cache  # noqa: E402
from models.attention_metadata import AttentionMetadata  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.eagle import (DraftHeadError, EagleHead, HeadShape, build_draft_head, default_aux_layers,  # noqa: E402
                          load_draft_head, save_eagle3_head, target_features)
from models.transformer import build_model  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402

SPECFORGE = "specforge==0.2.0"
TARGET = ModelConfig(vocab_size=512, hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=128, rms_norm_eps=1e-5, max_position_embeddings=256, eos_token_ids=(2,))
DRAFT_VOCAB = 128


@pytest.fixture(scope="module")
def specforge():
    try:
        import specforge  # noqa: F401
    except ImportError:
        from models.default_model import cache_dir

        folder = os.path.join(cache_dir(), "specforge")
        wheels = glob.glob(os.path.join(folder, "specforge-*.whl"))
        if not wheels:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                                   "-d", folder, SPECFORGE], capture_output=True, text=True, timeout=600)
            wheels = glob.glob(os.path.join(folder, "specforge-*.whl"))
            if not wheels:
                pytest.skip(f"SpecForge's wheel could not be fetched ({proc.stderr.strip()[-200:]}): "
                            f"`pip install --no-deps {SPECFORGE}` runs these tests")
        sys.path.insert(0, wheels[0])
    torch._dynamo.config.disable = True  # (SpecForge compiles its RMSNorm; eager here)
    from specforge.modeling.draft import llama3_eagle

    return llama3_eagle


@pytest.fixture(scope="module")
def target():
    return build_model(TARGET, "cpu", torch.float32, seed=0)


def specforge_head(sf, tmp_path, seed: int = 5):
    """A random SpecForge EAGLE-3 head for TARGET (norms and the draft vocabulary random too), saved with
    save_pretrained -> (the SpecForge module, its directory)."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=TARGET.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=TARGET.rms_norm_eps,
                         max_position_embeddings=256, rope_theta=TARGET.rope_theta, hidden_act="silu",
                         pad_token_id=0, tie_word_embeddings=False)
    config.draft_vocab_size = DRAFT_VOCAB
    config.architectures = ["LlamaForCausalLMEagle3"]
    torch.manual_seed(seed)
    model = sf.LlamaForCausalLMEagle3(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() > 1 else 0.2) + (p.dim() == 1))
        ids = torch.sort(torch.randperm(TARGET.vocab_size, generator=gen)[:DRAFT_VOCAB]).values
        model.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
        model.t2d.zero_()
        model.t2d[ids] = True
    path = tmp_path / "sf-head"
    model.save_pretrained(str(path))
    return model, str(path)


def head_forward(head: EagleHead, ids: list[int], positions: list[int], aux: torch.Tensor) -> torch.Tensor:
    """The head's own forward (paged attention) over one sequence of rows -> pre-norm output features."""
    n = len(ids)
    kv = allocate_kv_cache(1, 8, 64, head.cfg.num_kv_heads, head.cfg.head_dim, torch.float32, "cpu")
    table = torch.arange(8, dtype=torch.int32).view(1, 8)
    pos = torch.tensor(positions)
    meta = AttentionMetadata.from_tokens(pos.clone(), torch.zeros(n, dtype=torch.int64), pos, table)
    with torch.inference_mode():
        return head(torch.tensor(ids), pos, kv, meta, aux)


def test_a_specforge_head_loads_and_gives_its_draft_logits(specforge, target, tmp_path):
    sf, path = specforge_head(specforge, tmp_path)
    head = load_draft_head(path, target, "eagle3")
    assert head.shape.eagle3 and head.shape.aux_layers == default_aux_layers(TARGET.num_layers) == (2, 4, 5)
    assert head.shape.draft_vocab_size == DRAFT_VOCAB and head.own_embed is not None  # SpecForge saves embed_tokens
    assert torch.equal(head.draft_to_target, torch.arange(DRAFT_VOCAB) + sf.d2t)
    seq = list(np.random.default_rng(1).integers(3, TARGET.vocab_size, 24))
    _, aux = target_features(target, [seq], head.shape.aux_layers)
    ours = head.compute_logits(head_forward(head, seq[1:], list(range(len(seq) - 1)), aux[:-1]))
    with torch.no_grad():
        normed = sf(aux[:-1][None], sf.embed_input_ids(torch.tensor(seq[1:])[None]))
        theirs = sf.lm_head(normed)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_served_drafts_are_specforges_chain(specforge, target, tmp_path):
    """The worker's three drafts after a prefill are SpecForge's greedy chain from the same prefix: each step feeds
    its own output feature and its last draft, and attends over step 0's keys and its own earlier steps' (TTT)."""
    sf, path = specforge_head(specforge, tmp_path, seed=7)
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, TARGET.vocab_size, 14)]
    cfg = resolve({}, {"method": "eagle3", "model": path, "num_speculative_tokens": 3}, platform="sm100",
                  max_num_seqs=4, max_num_batched_tokens=64)
    core = EngineCore(cfg, EngineArgs(TARGET, num_kv_blocks=64, block_size=16, max_model_len=128))
    core.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    first = core.step()[0].new_token_ids[0]
    served = core.worker.state.drafts[0, :3].tolist()

    seq = prompt + [first]
    _, aux = target_features(target, [prompt], default_aux_layers(TARGET.num_layers))
    n = len(prompt)
    with torch.no_grad():
        hidden = sf.project_hidden_states(aux[None])
        mask = specforge.prepare_decoder_attention_mask(torch.ones(1, n, dtype=torch.bool), (1, n), hidden, 0)
        cache, tokens, chain = [[], []], seq[1:], []
        for _ in range(3):
            hidden = sf.backbone(sf.embed_input_ids(torch.tensor(tokens)[None]), hidden, cache, mask,
                                 torch.arange(n)[None])
            draft = int(sf.compute_logits(hidden)[0, -1].argmax())
            chain.append(draft + int(sf.d2t[draft]))
            tokens = tokens[1:] + [chain[-1]]
    assert served == chain


def test_the_trainers_ttt_is_specforges(specforge, target, tmp_path):
    """scripts/train_eagle3.py's training-time test gives SpecForge's logits at every step and position."""
    spec = importlib.util.spec_from_file_location("train_eagle3", os.path.join(
        os.path.dirname(__file__), "..", "scripts", "train_eagle3.py"))
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    sf, path = specforge_head(specforge, tmp_path, seed=9)
    head = load_draft_head(path, target, "eagle3")
    seq = [int(t) for t in np.random.default_rng(3).integers(3, TARGET.vocab_size, 20)]
    _, aux = target_features(target, [seq], head.shape.aux_layers)
    ids = torch.tensor(seq)[None]
    with torch.no_grad():
        ours = trainer.ttt_logits(head, aux[None].clone(), ids, 4)
        hidden = sf.project_hidden_states(aux[None])
        t = len(seq)
        mask = specforge.prepare_decoder_attention_mask(torch.ones(1, t, dtype=torch.bool), (1, t), hidden, 0)
        cache, tokens = [[], []], ids
        for k in range(4):
            tokens = torch.cat([tokens[:, 1:], torch.zeros(1, 1, dtype=torch.int64)], 1)
            hidden = sf.backbone(sf.embed_input_ids(tokens), hidden, cache, mask, torch.arange(t)[None])
            torch.testing.assert_close(ours[k], sf.compute_logits(hidden), rtol=1e-4, atol=1e-4)


def test_an_eagle3_head_round_trips_through_save(target, tmp_path):
    """save_eagle3_head writes SpecForge's format (midlayer names, d2t, t2d, no embedding) and loads back the same
    head; greedy output with it equals greedy output without speculation."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.sort(torch.randperm(TARGET.vocab_size, generator=gen)[:DRAFT_VOCAB]).values
    with torch.no_grad():
        head = EagleHead(target, TARGET.with_(num_layers=1), HeadShape((2, 4, 5), DRAFT_VOCAB)).init_random(4)
        head.draft_to_target.copy_(ids)
    save_eagle3_head(head, str(tmp_path / "h"), dtype=torch.float32)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "h" / "model.safetensors"), framework="pt") as st:
        names = set(st.keys())
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "d2t", "t2d",
            "lm_head.weight", "norm.weight"} <= names and "embed_tokens.weight" not in names
    config = json.load(open(tmp_path / "h" / "config.json"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    loaded = load_draft_head(str(tmp_path / "h"), target, "eagle3")
    for (name, a), (_, b) in zip(sorted(head.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name
    assert lossless(str(tmp_path / "h"), "eagle3")


def lossless(path: str, method: str) -> bool:
    prompts = [[int(t) for t in np.random.default_rng(s).integers(3, TARGET.vocab_size, 5 + 7 * s)] for s in range(4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    out = []
    for spec in (None, {"method": method, "model": path, "num_speculative_tokens": 3}):
        cfg = resolve({}, spec, platform="sm100", max_num_seqs=4, max_num_batched_tokens=64)
        out.append(EngineCore(cfg, EngineArgs(TARGET, num_kv_blocks=64, block_size=16, max_model_len=128))
                   .generate(prompts, params))
    return out[0] == out[1]


def eagle1_checkpoint(target, path) -> dict[str, torch.Tensor]:
    """A random EAGLE-1 head in the EAGLE authors' layout (their tensor names, converted to safetensors): fc (and its
    bias) and one Llama layer without an input norm; config.json a one-layer LlamaConfig."""
    gen = torch.Generator().manual_seed(11)
    h, q, kv, inter = TARGET.hidden_size, TARGET.q_size, TARGET.kv_size, 96
    shapes = {"fc.weight": (h, 2 * h), "fc.bias": (h,), "layers.0.self_attn.q_proj.weight": (q, h),
              "layers.0.self_attn.k_proj.weight": (kv, h), "layers.0.self_attn.v_proj.weight": (kv, h),
              "layers.0.self_attn.o_proj.weight": (h, q), "layers.0.post_attention_layernorm.weight": (h,),
              "layers.0.mlp.gate_proj.weight": (inter, h), "layers.0.mlp.up_proj.weight": (inter, h),
              "layers.0.mlp.down_proj.weight": (h, inter)}
    tensors = {k: torch.randn(s, generator=gen) * 0.1 + (k.endswith("norm.weight")) for k, s in shapes.items()}
    os.makedirs(path, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, os.path.join(path, "model.safetensors"))
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
               "intermediate_size": inter, "num_attention_heads": TARGET.num_heads,
               "num_key_value_heads": TARGET.num_kv_heads, "num_hidden_layers": 1, "rms_norm_eps": TARGET.rms_norm_eps,
               "rope_theta": TARGET.rope_theta, "vocab_size": TARGET.vocab_size, "max_position_embeddings": 256,
               "hidden_act": "silu"}, open(os.path.join(path, "config.json"), "w"))
    return tensors


def reference_eagle1(target, t: dict[str, torch.Tensor], ids: list[int], feats: torch.Tensor) -> torch.Tensor:
    """EAGLE-1's forward written out densely: fc(cat(embedding, feature)) + bias, causal attention with rotary (no
    input norm), the residual, post-attention norm, SwiGLU, the residual; the target's LM head on the output."""
    c = TARGET
    emb = target.embed_tokens.weight[torch.tensor(ids)]
    x = torch.cat([emb, feats], -1) @ t["fc.weight"].t() + t["fc.bias"]
    n = len(ids)
    pos = torch.arange(n)
    p = "layers.0."

    def rope(v, heads):
        v = v.view(n, heads, c.head_dim)
        cos, sin = target.rotary.cos[pos][:, None], target.rotary.sin[pos][:, None]
        a, b = v.chunk(2, -1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    q = rope(x @ t[p + "self_attn.q_proj.weight"].t(), c.num_heads).transpose(0, 1)
    k = rope(x @ t[p + "self_attn.k_proj.weight"].t(), c.num_kv_heads).transpose(0, 1)
    v = (x @ t[p + "self_attn.v_proj.weight"].t()).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
    rep = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    h = x + att.transpose(0, 1).reshape(n, -1) @ t[p + "self_attn.o_proj.weight"].t()
    w = t[p + "post_attention_layernorm.weight"]
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w
    g, u = normed @ t[p + "mlp.gate_proj.weight"].t(), normed @ t[p + "mlp.up_proj.weight"].t()
    out = h + (torch.nn.functional.silu(g) * u) @ t[p + "mlp.down_proj.weight"].t()
    return target.compute_logits(out)


def test_an_eagle1_head_matches_the_reference_forward(target, tmp_path):
    tensors = eagle1_checkpoint(target, str(tmp_path / "e1"))
    head = load_draft_head(str(tmp_path / "e1"), target, "eagle")
    assert not head.shape.eagle3 and head.shape.fc_bias and not head.shape.input_norm and not head.shape.final_norm
    seq = [int(t) for t in np.random.default_rng(4).integers(3, TARGET.vocab_size, 18)]
    with torch.inference_mode():
        hidden, _ = target_features(target, [seq], ())
    ours = head.compute_logits(head_forward(head, seq[1:], list(range(len(seq) - 1)), hidden[:-1]))
    torch.testing.assert_close(ours, reference_eagle1(target, tensors, seq[1:], hidden[:-1]), rtol=1e-4, atol=1e-4)
    assert lossless(str(tmp_path / "e1"), "eagle")


def rewrite(path, *, config: dict | None = None, drop: str | None = None, add: str | None = None, edit=None,
            extra_file: dict | None = None):
    cfg_path = os.path.join(path, "config.json")
    if config:
        data = json.load(open(cfg_path))
        data.update(config)
        json.dump(data, open(cfg_path, "w"))
    if drop or add:
        from safetensors.torch import load_file, save_file

        st = os.path.join(path, "model.safetensors")
        tensors = load_file(st)
        if drop:
            del tensors[drop]
        if add:
            tensors[add] = torch.zeros(3)
        save_file(tensors, st)
    if edit:
        from safetensors.torch import load_file, save_file

        st = os.path.join(path, "model.safetensors")
        save_file({k: v.contiguous() for k, v in edit(load_file(st)).items()}, st)
    if extra_file:
        from safetensors.torch import save_file

        save_file(extra_file, os.path.join(path, "zz-extra.safetensors"))


@pytest.mark.parametrize("change,message", [
    ({"config": {"vocab_size": 500}}, "vocab_size = 500, the target's is 512"),
    ({"config": {"hidden_size": 96, "head_dim": 24}}, "hidden_size = 96, the target's hidden_size is 64"),
    ({"config": {"rope_theta": 500000.0}}, "rope_theta 500000.0 / rope_scaling None, the target's are 10000.0 / None"),
    ({"config": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 9]}}},
     r"eagle_aux_hidden_state_layer_ids = \[1, 9\]: at least two boundaries in 0..8"),
    ({"config": {"num_hidden_layers": 2}}, "num_hidden_layers = 2: only one-layer heads"),
    ({"drop": "fc.weight"}, "tensor 'fc.weight' is missing"),
    ({"add": "midlayer.extra.weight"}, "tensor 'layers.0.extra.weight' .* is not part of an EAGLE head"),
    ({"config": {"draft_vocab_size": 100}}, "lm_head.weight has 128 rows, draft_vocab_size is 100"),
    # loaded silently wrong, or under a traceback, before (the checkpoint probe)
    ({"edit": lambda t: {**t, "midlayer.self_attn.q_proj.weight": t["midlayer.self_attn.k_proj.weight"],
                         "midlayer.self_attn.k_proj.weight": t["midlayer.self_attn.q_proj.weight"]}},
     "q_proj.weight .* have 32 \\+ 64 \\+ 32 rows, expected 64 \\+ 32 \\+ 32"),
    ({"edit": lambda t: {**t, "fc.weight": t["fc.weight"].to(torch.int8)}}, "'fc.weight' is torch.int8; a head's "
                                                                              "weights are floats"),  # (cast)
    ({"edit": lambda t: {**t, "d2t": t["d2t"].float() + 0.5}}, "d2t is torch.float32, expected integer offsets"),
    ({"extra_file": {"fc.weight": torch.zeros(3)}}, "tensor 'fc.weight' is in two files"),  # (the last one won)
    ({"config": {"draft_vocab_size": "x"}}, "draft_vocab_size must be an integer, got 'x'"),
    ({"edit": lambda t: {**t, "fc.weight": t["fc.weight"].index_fill(0, torch.tensor([2]), float("nan"))}},
     "weight fc.weight holds a NaN or an infinity"),
    ({"config": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ["a", "b"]}}},
     "eagle_aux_hidden_state_layer_ids must be a list of layer indices"),
])
def test_heads_that_do_not_fit_are_refused(target, tmp_path, change, message):
    with torch.no_grad():
        head = EagleHead(target, TARGET.with_(num_layers=1), HeadShape((2, 4, 5), DRAFT_VOCAB)).init_random(4)
        head.draft_to_target.copy_(torch.arange(DRAFT_VOCAB) * 2)
    path = str(tmp_path / "h")
    save_eagle3_head(head, path, dtype=torch.float32)
    rewrite(path, **change)
    with pytest.raises(DraftHeadError, match=message):
        load_draft_head(path, target, "eagle3")


def test_a_head_of_the_other_method_or_none_is_refused(target, tmp_path):
    eagle1_checkpoint(target, str(tmp_path / "e1"))
    with pytest.raises(DraftHeadError, match="is not an EAGLE-3 head"):
        load_draft_head(str(tmp_path / "e1"), target, "eagle3")
    head = EagleHead(target, TARGET.with_(num_layers=1), HeadShape((2, 4, 5), None)).init_random(4)
    save_eagle3_head(head, str(tmp_path / "e3"))
    with pytest.raises(DraftHeadError, match="is an EAGLE-3 head: use method eagle3"):
        load_draft_head(str(tmp_path / "e3"), target, "eagle")
    with pytest.raises(DraftHeadError, match="no config.json"):
        load_draft_head(str(tmp_path), target, "eagle3")
    os.rename(tmp_path / "e1" / "model.safetensors", tmp_path / "e1" / "pytorch_model.bin")
    with pytest.raises(DraftHeadError, match="pytorch_model.bin is a pickle, which twogrid never loads; convert"):
        load_draft_head(str(tmp_path / "e1"), target, "eagle")


def test_a_real_target_without_a_head_is_refused_and_a_preset_gets_a_random_one(tmp_path, caplog):
    from models.loader import save_checkpoint

    save_checkpoint(build_model(TARGET, "cpu", torch.float32, seed=1), str(tmp_path / "ckpt"), "llama")
    for method, hint in (("eagle3", 'model": DIR'), ("dspark", "a preset target")):
        cfg = resolve({}, {"method": method, "num_speculative_tokens": 2}, platform="sm100", max_num_seqs=4,
                      max_num_batched_tokens=64)
        with pytest.raises(ValueError, match=f"{method} needs a draft head for .*{hint}"):
            EngineCore(cfg, EngineArgs(str(tmp_path / "ckpt"), num_kv_blocks=64, block_size=16, max_model_len=128))
    cfg = resolve({}, {"method": "eagle3", "num_speculative_tokens": 2}, platform="sm100", max_num_seqs=4,
                  max_num_batched_tokens=64)
    with caplog.at_level("WARNING"):
        EngineCore(cfg, EngineArgs("tiny-dense", num_kv_blocks=64, block_size=16, max_model_len=128))
    assert "eagle3 head with random weights (preset target tiny-dense: benchmarks only)" in caplog.text


def test_random_eagle3_heads_read_three_target_features(target):
    head = build_draft_head(target, seed=1, method="eagle3")
    assert head.shape.aux_layers == (2, 4, 5) and head.fc.in_features == 3 * TARGET.hidden_size
    assert head.layers[0].qkv_proj.in_features == 2 * TARGET.hidden_size
    assert target.rotary.cos.dtype == torch.float32 and head.rotary is target.rotary


def _trainer_and_continuations(seed: int, num_prompts: int):
    """scripts/train_eagle3.py as a module, and the tiny target's greedy continuations of random prompts, as the
    trainer takes them ((token ids, prompt length) each)."""
    spec = importlib.util.spec_from_file_location("train_eagle3", os.path.join(
        os.path.dirname(__file__), "..", "scripts", "train_eagle3.py"))
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(3, TARGET.vocab_size, 6)] for _ in range(num_prompts)]
    cfg = resolve({}, None, platform="sm100", max_num_seqs=16, max_num_batched_tokens=256)
    outs = EngineCore(cfg, EngineArgs(TARGET, num_kv_blocks=64, block_size=16, max_model_len=128)).generate(
        prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    return trainer, [(p + o, len(p)) for p, o in zip(prompts, outs)]


def test_the_trainer_learns_a_targets_continuations(target):
    """scripts/train_eagle3.py's loop on the tiny target: after a few hundred steps over the target's own greedy
    continuations, the head's first draft agrees with the target's greedy token far more often than at the start."""
    import argparse

    trainer, seqs = _trainer_and_continuations(5, 12)
    draft_ids = trainer.draft_vocabulary(seqs, 256, TARGET.vocab_size)
    head = trainer.build_head(target, draft_ids, torch.device("cpu"))
    args = argparse.Namespace(lr=3e-3, ttt=2, tokens_per_batch=400, feature_cache_gib=1.0, train_seconds=0.0, seed=0,
                              validate_seconds=0.0)
    in_draft = torch.zeros(TARGET.vocab_size, dtype=torch.bool)
    in_draft[draft_ids] = True
    before = trainer.evaluate(head, target, seqs, draft_ids, in_draft, args, torch.device("cpu"))
    args.train_seconds = 12.0  # (60-100 steps on a 2-core CPU: the first draft agrees ~0.6 of the time, from ~0)
    report = trainer.train(head, target, seqs, seqs, draft_ids, args, torch.device("cpu"))
    assert report["feature_cache"] is not None  # (the trainer's default: the target's features kept)
    assert report["steps"] >= 20 and report["history"][-1]["loss"] < report["history"][0]["loss"]
    assert report["held_out_acc"][0] > before[0] + 0.3, (before, report["held_out_acc"])


def test_the_trainers_kept_features_give_the_batches_the_target_gives(target, capsys):
    """``--feature-cache-gib``: the target's features of the training sequences, computed once in chunks of
    consecutive sequences, give every batch (sequences in any order) the inputs and labels that running the target
    over that batch gives; features beyond the limit are not kept (logged), and the target runs every batch."""
    import argparse
    import random

    trainer, seqs = _trainer_and_continuations(3, 10)
    draft_ids = trainer.draft_vocabulary(seqs, 256, TARGET.vocab_size)
    aux_layers = (2, 4, 5)
    cache = trainer.TargetFeatures(target, seqs, aux_layers, tokens_per_chunk=100)  # (two sequences a chunk)
    assert cache.hidden.shape == (sum(len(s) for s, _ in seqs), TARGET.hidden_size)
    for batch in trainer.batches(seqs, 150, random.Random(1)) + [[9, 0, 4]]:
        chosen = [seqs[i] for i in batch]
        ran = trainer.batch_targets(target, chosen, aux_layers, draft_ids, torch.device("cpu"))
        kept = trainer.batch_targets(target, chosen, aux_layers, draft_ids, torch.device("cpu"), cache.rows(batch))
        for a, b in zip(ran, kept):
            torch.testing.assert_close(a, b)
    need = trainer.TargetFeatures.nbytes(target, seqs, aux_layers)
    assert need == cache.hidden.nbytes + cache.aux.nbytes
    small = argparse.Namespace(feature_cache_gib=need / 2 / (1 << 30), tokens_per_batch=400)
    assert trainer.feature_cache(target, seqs, aux_layers, small) is None
    assert "beyond --feature-cache-gib" in capsys.readouterr().out
    assert trainer.feature_cache(target, seqs, aux_layers, argparse.Namespace(feature_cache_gib=0.0,
                                                                              tokens_per_batch=400)) is None
    assert trainer.feature_cache(target, seqs, aux_layers, argparse.Namespace(feature_cache_gib=1.0,
                                                                              tokens_per_batch=400)) is not None


def test_the_trainer_drops_its_kept_features_when_a_batch_runs_out_of_device_memory(target, capsys, monkeypatch):
    """A batch that runs out of device memory with the target's features kept drops them (logged, in the report)
    and training goes on, the target running every batch; out of memory without them is the error it is."""
    import argparse

    trainer, seqs = _trainer_and_continuations(5, 8)
    draft_ids = trainer.draft_vocabulary(seqs, 256, TARGET.vocab_size)
    head = trainer.build_head(target, draft_ids, torch.device("cpu"))
    real = trainer.ttt_logits

    def out_of_memory_at(*failing: int):
        """ttt_logits, raising CUDA's out-of-memory error at the ``failing`` calls (1-based)."""
        calls = []

        def ttt_logits(*args):
            calls.append(1)
            if len(calls) in failing:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (a stand-in)")
            return real(*args)
        return ttt_logits, calls

    args = argparse.Namespace(lr=3e-3, ttt=2, tokens_per_batch=400, feature_cache_gib=1.0, train_seconds=2.0,
                              seed=0, validate_seconds=0.0)
    stand_in, calls = out_of_memory_at(3)
    monkeypatch.setattr(trainer, "ttt_logits", stand_in)
    report = trainer.train(head, target, seqs, seqs, draft_ids, args, torch.device("cpu"))
    assert report["feature_cache"]["dropped_at_step"] == 2 and report["steps"] >= 4
    assert "out of device memory at step 2 with the target's features kept" in capsys.readouterr().out
    stand_in, calls = out_of_memory_at(3, 6)
    monkeypatch.setattr(trainer, "ttt_logits", stand_in)
    args.train_seconds = 300.0
    with pytest.raises(torch.cuda.OutOfMemoryError):  # (the second, with nothing left to drop)
        trainer.train(head, target, seqs, seqs, draft_ids, args, torch.device("cpu"))
    assert len(calls) == 6


def test_the_trainer_keeps_the_head_that_scored_best_on_its_validation_prompts(target):
    """``--validation-prompts N --validate-seconds S``: the head is measured on prompts kept out of training every S
    seconds and at the end, and the one that scored best (top-1 agreement per TTT step weighed as the loss weighs
    them) is the head the trainer returns, whichever step it came from."""
    import argparse

    trainer, seqs = _trainer_and_continuations(7, 14)
    train_seqs, val_seqs = seqs[:10], seqs[10:]
    draft_ids = trainer.draft_vocabulary(seqs, 256, TARGET.vocab_size)
    head = trainer.build_head(target, draft_ids, torch.device("cpu"))
    args = argparse.Namespace(lr=3e-3, ttt=2, tokens_per_batch=400, feature_cache_gib=0.0, train_seconds=6.0, seed=0,
                              validate_seconds=1.5)
    report = trainer.train(head, target, train_seqs, val_seqs, draft_ids, args, torch.device("cpu"), val_seqs)
    checks = report["validation"]
    assert len(checks) >= 3 and checks[0]["step"] < checks[-1]["step"] == report["steps"]
    best = max(checks, key=lambda c: trainer.validation_score(c["acc"]))
    assert report["kept_step"] == best["step"]
    assert report["held_out_acc"] == best["acc"]  # (held out = the validation prompts here: the kept head's scores)
    in_draft = torch.zeros(TARGET.vocab_size, dtype=torch.bool)
    in_draft[draft_ids] = True
    assert trainer.evaluate(head, target, val_seqs, draft_ids, in_draft, args, torch.device("cpu")) == best["acc"]


def test_the_trainer_saves_its_sequences_and_trains_them_again_from_a_saved_head(target, tmp_path):
    """``--save-data`` / ``--load-data``: the sequences come back as they were generated, split by split, with what
    made them (a file that is not one is refused by name). ``--init-head``: a head the trainer saved trains further
    from where it stopped (its draft vocabulary kept, float32, every parameter trainable: its agreement does not
    start over), and a head of another shape is refused naming both shapes."""
    import argparse

    trainer, seqs = _trainer_and_continuations(5, 12)
    splits = {"train": seqs[:8], "validation": seqs[8:10], "held_out": seqs[10:]}
    meta = {"target": "tiny", "command": "train_eagle3.py ...", "train_prompts": 8, "validation_prompts": 2,
            "held_out_prompts": 2}
    path = str(tmp_path / "seqs.npz")
    trainer.save_sequences(path, splits, meta, TARGET.vocab_size)
    loaded, loaded_meta = trainer.load_sequences(path)
    assert loaded == splits and loaded_meta == meta
    trainer.save_sequences(str(tmp_path / "bare"), splits, meta, TARGET.vocab_size)  # (the name as given)
    assert trainer.load_sequences(str(tmp_path / "bare"))[0] == splits
    (tmp_path / "bad.npz").write_bytes(b"not an npz")
    np.save(tmp_path / "array.npy", np.arange(4))
    np.savez(tmp_path / "other.npz", meta=np.asarray(json.dumps({"target": "tiny"})))
    for bad in ("bad.npz", "array.npy", "other.npz"):
        with pytest.raises(SystemExit, match=f"{bad}: not a file --save-data wrote"):
            trainer.load_sequences(str(tmp_path / bad))

    draft_ids = trainer.draft_vocabulary(seqs, 256, TARGET.vocab_size)
    head = trainer.build_head(target, draft_ids, torch.device("cpu"))
    args = argparse.Namespace(lr=3e-3, ttt=2, tokens_per_batch=400, feature_cache_gib=0.0, train_seconds=8.0, seed=0,
                              validate_seconds=0.0)
    first = trainer.train(head, target, seqs, seqs, draft_ids, args, torch.device("cpu"))["held_out_acc"]
    assert first[0] > 0.3, first
    save_eagle3_head(head, str(tmp_path / "head"))
    resumed = trainer.resume_head(target, str(tmp_path / "head"))
    assert torch.equal(resumed.draft_to_target, draft_ids)
    params = list(resumed.parameters())
    assert params and all(p.dtype == torch.float32 and p.requires_grad for p in params)
    in_draft = torch.zeros(TARGET.vocab_size, dtype=torch.bool)
    in_draft[draft_ids] = True
    again = trainer.evaluate(resumed, target, seqs, draft_ids, in_draft, args, torch.device("cpu"))
    assert again[0] > first[0] - 0.05, (first, again)  # (bfloat16 on disk: nearly the same head)
    args.train_seconds = 3.0
    report = trainer.train(resumed, target, seqs, seqs, draft_ids, args, torch.device("cpu"))
    assert report["steps"] >= 5 and report["held_out_acc"][0] > first[0] - 0.05

    other = EagleHead(target, head.cfg, HeadShape(aux_layers=(1, 2, 3), draft_vocab_size=256)).init_random(0)
    save_eagle3_head(other, str(tmp_path / "other"))
    with pytest.raises(SystemExit, match="its shape .* is not the one this trainer trains"):
        trainer.resume_head(target, str(tmp_path / "other"))
    whole = EagleHead(target, head.cfg, HeadShape(aux_layers=head.shape.aux_layers)).init_random(0)
    save_eagle3_head(whole, str(tmp_path / "whole"))
    with pytest.raises(SystemExit, match="no draft vocabulary of its own"):
        trainer.resume_head(target, str(tmp_path / "whole"))


@pytest.fixture(scope="module")
def llama8(bpe, tmp_path_factory) -> str:
    """A tiny random 8-layer Llama checkpoint with the ``bpe`` tokenizer and its chat template (an EAGLE-3 head's
    three layer boundaries need more layers than the session's 2-layer ``tiny_llama``)."""
    from textdata import write_tiny_llama

    pytest.importorskip("transformers")
    return write_tiny_llama(bpe, tmp_path_factory.mktemp("llama8"), num_layers=8)


def test_the_trainer_runs_end_to_end_and_again_from_its_saved_sequences_and_head(llama8, texts, tmp_path):
    """scripts/train_eagle3.py as a user runs it, on the CPU: prompts in, the target's answers generated and saved
    (--save-data), a head trained, saved and served (its report); then a second run trains that head further on
    the saved sequences (--load-data --init-head) without generating, and its report says so. Bad combinations are
    refused naming the flags."""
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": t[:200]}]}
                                for i, t in enumerate(texts[:20])]))
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "train_eagle3.py")
    common = ["--model", llama8, "--device", "cpu", "--max-tokens", "24", "--max-model-len", "256", "--ttt", "2",
              "--tokens-per-batch", "2048", "--draft-vocab", "128", "--eval-tokens", "16", "--train-seconds", "3",
              "--validation-prompts", "2", "--validate-seconds", "1"]

    def run(*args):
        return subprocess.run([sys.executable, script, *common, *args], capture_output=True, text=True, timeout=600)

    first = run("--data", str(data), "--out", str(tmp_path / "a"), "--samples", "2",
                "--save-data", str(tmp_path / "data" / "seqs.npz"))  # (its directory made: not there yet)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    a = json.loads((tmp_path / "a" / "train_eagle3.json").read_text())
    assert a["data"]["train_prompts"] == 16 and a["data"]["held_out_prompts"] == 2 and a["served"]
    assert "the target's features of" in first.stdout  # (kept on the device: the default)
    second = run("--load-data", str(tmp_path / "data" / "seqs.npz"), "--out", str(tmp_path / "b"),
                 "--init-head", str(tmp_path / "a" / "head"))
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    b = json.loads((tmp_path / "b" / "train_eagle3.json").read_text())
    assert b["data"]["source"] == "seqs.npz" and b["data"]["init_head"].endswith("head")
    assert "load_seconds" in b["data"] and "generate_seconds" in a["data"]
    assert b["data"]["train_sequences"] == a["data"]["train_sequences"] and b["served"]
    assert "training sequences from" in second.stdout and "held-out prompts" not in second.stdout  # (none made)
    both = run("--data", str(data), "--load-data", str(tmp_path / "data" / "seqs.npz"), "--out", str(tmp_path / "c"))
    assert both.returncode == 2 and "--data SHAREGPT.json) or the sequences" in both.stderr
    (tmp_path / "file").write_text("")
    nowhere = run("--data", str(data), "--out", str(tmp_path / "c"), "--save-data", str(tmp_path / "file" / "s.npz"))
    assert nowhere.returncode == 2 and "--save-data: cannot create" in nowhere.stderr  # (before generating)
    other = subprocess.run([sys.executable, script, *common[:-4], "--load-data", str(tmp_path / "data" / "seqs.npz"),
                            "--out", str(tmp_path / "d")], capture_output=True, text=True, timeout=600)
    assert other.returncode == 2 and "holds 2 validation prompts: pass --validation-prompts 2" in other.stderr


def test_a_shallow_targets_eagle3_head_reads_boundaries_within_its_layers_and_round_trips(tmp_path):
    """vLLM's default boundaries (2, L // 2, L - 3) kept within 0..L: a 2-layer target (the tiny presets) reads
    boundaries 2, 1 and 0, every feature column written (none left as the buffer's garbage), and its head saves and
    loads back."""
    assert default_aux_layers(2) == (2, 1, 0) and default_aux_layers(1) == (1, 0, 0)
    assert default_aux_layers(30) == (2, 15, 27)
    cfg = ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, tie_word_embeddings=False)
    shallow = build_model(cfg, "cpu", torch.float32, seed=0)
    head = build_draft_head(shallow, seed=1, method="eagle3")
    assert head.shape.aux_layers == (2, 1, 0)
    seqs = [[5, 6, 7, 8], [9, 10]]
    hidden, aux = target_features(shallow, seqs, head.shape.aux_layers)
    again = target_features(shallow, seqs, head.shape.aux_layers)[1]
    assert torch.isfinite(aux).all() and torch.equal(aux, again)
    emb = shallow.embed_tokens(torch.tensor([5, 6, 7, 8, 9, 10]))
    assert torch.equal(aux[:, 2 * 64:], emb)  # (boundary 0: the embedding)
    _, twice = target_features(shallow, seqs, (0, 0))
    assert torch.equal(twice[:, :64], emb) and torch.equal(twice[:, 64:], emb)
    save_eagle3_head(head, str(tmp_path / "head"))
    assert load_draft_head(str(tmp_path / "head"), shallow, "eagle3").shape.aux_layers == (2, 1, 0)
