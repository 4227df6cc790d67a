"""Tensor parallelism on the default model (SmolLM2-135M's GGUF, Q4_1): three gloo ranks through EngineCore, with
its shipped EAGLE-3 head, give one worker's greedy tokens."""

import pytest

pytest.importorskip("torch")

from scheduler.request import SamplingParams  # noqa: E402
from tests.test_tensor_parallel_engine import _engine  # noqa: E402


def test_the_default_model_split_three_ways_gives_its_greedy_tokens():
    """SmolLM2-135M (9 heads, 3 KV heads: 3 is the smallest size that splits it; 2 is refused) on three gloo ranks,
    its Q4_1 projections kept 4-bit in bfloat16, with its shipped EAGLE-3 head replicated on every rank: the greedy
    tokens of one worker."""
    from models.default_model import default_model_path
    from models.text import load_tokenizer

    model = default_model_path()
    tok = load_tokenizer(model)
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
    spec = {"method": "eagle3", "num_speculative_tokens": 2}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one, _ = _engine(model, spec, max_num_seqs=4)
    want = one.generate(prompts, params)
    three, worker = _engine(model, spec, tp=3, max_num_seqs=4)
    try:
        got = three.generate(prompts, params)
        accepted = three.stats.num_accepted_tokens
    finally:
        worker.close()
    assert got == want
    assert accepted > 0  # (the head drafts on every rank alike)

