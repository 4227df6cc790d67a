"""The LM head stored with its vocabulary padded to a multiple of 64 rows (cuBLAS's fast kernels need aligned
columns): logits equal the unpadded GEMM, padded columns are never sampled (target and drafter), checkpoints keep
the logical vocabulary, and generation is unchanged."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from models.config import preset  # noqa: E402
from models.eagle import build_draft_head  # noqa: E402
from models.sampling import RowParams, sample_tokens  # noqa: E402
from models.transformer import VOCAB_ALIGN, build_model, padded_vocab  # noqa: E402

VOCAB = 500  # not a multiple of 64: padded to 512


def head_weight(model):
    return model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight


@pytest.mark.parametrize("tied", [True, False])
def test_logits_equal_the_unpadded_gemm(tied):
    model = build_model(preset("tiny-dense").with_(vocab_size=VOCAB, tie_word_embeddings=tied), "cpu",
                        torch.float32, seed=2)
    weight = head_weight(model)
    assert padded_vocab(VOCAB) == 512 and weight.shape[0] == 512 and padded_vocab(512) == 512
    assert model.embed_tokens.weight.shape[0] % VOCAB_ALIGN == 0
    assert not weight[VOCAB:].any()  # padding rows are zero
    hidden = torch.randn(9, model.cfg.hidden_size)
    logits = model.compute_logits(hidden)
    assert logits.shape == (9, VOCAB) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden @ weight[:VOCAB].t(), rtol=1e-6, atol=1e-6)


def test_padded_columns_are_never_sampled():
    """Even when the padding rows would win every row (here: filled with huge weights), logits, argmax, sampling
    at any temperature and the drafter's proposals stay inside the vocabulary."""
    model = build_model(preset("tiny-dense").with_(vocab_size=VOCAB, tie_word_embeddings=True), "cpu", torch.float32,
                        seed=2)
    hidden = torch.randn(12, model.cfg.hidden_size)
    with torch.no_grad():
        model.embed_tokens.weight[VOCAB:] = 100.0 * hidden  # padding row 500 + j would win row j
    assert (hidden @ model.embed_tokens.weight.t()).argmax(-1).ge(VOCAB).all()
    logits = model.compute_logits(hidden)
    assert logits.shape[-1] == VOCAB and int(logits.argmax(-1).max()) < VOCAB
    n = logits.shape[0]
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (2.0, 50, 0.9), (0.0, 0, 1.0)]:
        params = RowParams(torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p),
                           torch.arange(n), all_greedy=temperature == 0)
        draws = torch.stack([sample_tokens(logits, params, torch.full((n,), p)) for p in range(20)])
        assert int(draws.max()) < VOCAB
    head = build_draft_head(model, seed=3)
    assert head.compute_logits(hidden).shape == (12, VOCAB)


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("qwen2", True)])
def test_checkpoints_keep_the_logical_vocabulary(tmp_path, model_type, tied):
    from safetensors import safe_open

    from models.loader import load_checkpoint, save_checkpoint

    cfg = preset("tiny-dense").with_(vocab_size=VOCAB, tie_word_embeddings=tied, attention_bias=model_type == "qwen2")
    model = build_model(cfg, "cpu", torch.float32, seed=4)
    save_checkpoint(model, str(tmp_path), model_type)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as st:
        assert st.get_slice("model.embed_tokens.weight").get_shape() == [VOCAB, cfg.hidden_size]
        if not tied:
            assert st.get_slice("lm_head.weight").get_shape() == [VOCAB, cfg.hidden_size]
    loaded = load_checkpoint(str(tmp_path), "cpu", torch.float32)
    assert loaded.cfg.vocab_size == VOCAB
    assert torch.equal(head_weight(loaded), head_weight(model)) and not head_weight(loaded)[VOCAB:].any()
    hidden = torch.randn(3, cfg.hidden_size)
    assert torch.equal(loaded.compute_logits(hidden), model.compute_logits(hidden))


def test_generation_with_an_unaligned_vocabulary_matches_eager():
    from dispatcher.engine.engine_core import EngineArgs, EngineCore
    from dispatcher.plan.config import resolve
    from scheduler.request import SamplingParams
    from test_runtime import random_prompts

    args = EngineArgs(preset("tiny-moe").with_(vocab_size=VOCAB), num_kv_blocks=200, block_size=8, max_model_len=128)
    cc = dict(platform="sm100", max_num_seqs=8, max_num_batched_tokens=128)
    spec = {"method": "eagle3", "num_speculative_tokens": 2}
    prompts = random_prompts(6, 11, vocab=VOCAB)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    graphs = EngineCore(resolve({}, spec, **cc), args).generate(prompts, params)
    eager = EngineCore(resolve({"cudagraph_mode": "NONE"}, None, **cc), args).generate(prompts, params)
    assert graphs == eager and all(t < VOCAB for out in graphs for t in out)


@pytest.mark.gpu
def test_bench_moe_logits_stay_bf16_and_match_the_unpadded_gemm():
    """bench-moe's 49,155-token head on the GPU: one bf16 GEMM over 49,216 rows, sliced; equal (bf16 precision) to
    the GEMM over the unpadded weight."""
    model = build_model(preset("bench-moe"), "cuda", torch.bfloat16, seed=0)
    hidden = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.bfloat16 and logits.shape == (64, 49155)
    assert model.embed_tokens.weight.shape[0] == 49216
    ref = hidden.float() @ model.embed_tokens.weight[:49155].float().t()
    torch.testing.assert_close(logits.float(), ref, rtol=2e-2, atol=2e-2)
