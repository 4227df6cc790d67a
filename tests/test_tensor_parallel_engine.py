"""Tensor parallelism through the engine: EngineCore over a group of worker processes (one per gloo rank, on the
CPU's static graph backend) gives the greedy tokens of one in-process worker, with and without speculative
decoding, on presets (the default model: tests/test_tensor_parallel_default_model.py); ``LLM(tensor_parallel_size=2)``
too, and ``close`` leaves no rank behind. (A killed rank under a running server: tests/test_tensor_parallel_serve.py.)"""

import os

import pytest

torch = pytest.importorskip("torch")

from dispatcher.engine.engine_core import EngineArgs, EngineCore  # noqa: E402
from dispatcher.engine.ipc import tensor_parallel_worker  # noqa: E402
from dispatcher.plan.config import resolve  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402
from tests.serverutil import token_prompts  # noqa: E402

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _engine(model, spec=None, tp=1, max_num_seqs=8, **kw):
    cfg = resolve(None, spec, platform="default", max_num_seqs=max_num_seqs, max_num_batched_tokens=128)
    args = EngineArgs(model, num_kv_blocks=96, max_model_len=256, **kw)
    worker = tensor_parallel_worker(cfg, args, None, spec, tp) if tp > 1 else None
    return EngineCore(cfg, args, worker=worker), worker


@pytest.mark.parametrize("model,spec", [
    ("tiny-dense", None),
    ("tiny-moe", {"method": "eagle3", "num_speculative_tokens": 2}),
    ("tiny-dense", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
])
def test_two_ranks_give_one_workers_greedy_tokens(model, spec):
    prompts = token_prompts(6, 512, 4, 40, seed=3)
    if spec and spec["method"] == "ngram":  # repetitive prompts: the n-gram drafter finds matches
        prompts = [p[:6] * 4 for p in prompts]
    one, _ = _engine(model, spec)
    want = one.generate(prompts, GREEDY)
    two, worker = _engine(model, spec, tp=2)
    try:
        got = two.generate(prompts, GREEDY)
        assert two.stats.steps > 0 and two.stats.eager_steps < two.stats.steps  # (the static graph backend ran)
        if spec:
            assert two.stats.num_draft_tokens > 0
    finally:
        worker.close()
    assert got == want


def test_the_offline_api_splits_the_model_and_stops_its_ranks():
    from dispatcher import LLM
    from dispatcher.plan.config import ConfigError

    prompts = [{"prompt_token_ids": p} for p in token_prompts(3, 512, 4, 20, seed=5)]
    want = [o.outputs[0].token_ids for o in LLM("tiny-moe", device="cpu", max_model_len=256).generate(prompts, GREEDY)]
    with LLM("tiny-moe", device="cpu", max_model_len=256, tensor_parallel_size=2) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        ranks = llm._worker.process.ranks
        assert llm._worker.tensor_parallel_size == 2  # (what keys its cached step costs apart from one rank's)
    assert got == want
    assert not any(r.alive() for r in ranks) and not any(os.path.exists(r.dir) for r in ranks)
    with pytest.raises(ConfigError, match="tensor_parallel_size: tensor_parallel_size = 3 does not divide"):
        LLM("tiny-moe", device="cpu", max_model_len=256, tensor_parallel_size=3)


def test_two_ranks_hold_the_grammars_and_give_one_workers_constrained_tokens(tmp_path):
    """Structured outputs under tensor parallelism: every rank gets the engine's grammars and keeps its own
    matchers (dispatcher/runtime/grammar.py), so both ranks mask alike and the constrained greedy tokens are one
    worker's, each output whole and valid (real xgrammar matchers; tiny-dense given the default model's
    vocabulary and tokenizer)."""
    import dataclasses
    import re

    from models.config import preset
    from models.default_model import default_model_path
    from models.loader import save_checkpoint
    from models.text import load_tokenizer
    from models.transformer import build_model
    from scheduler.structured import StructuredOutputsParams

    tok = load_tokenizer(default_model_path())
    model = str(tmp_path)  # (a checkpoint: each rank loads its shard)
    save_checkpoint(build_model(dataclasses.replace(preset("tiny-dense"), vocab_size=49152), "cpu", torch.float32,
                                seed=1), model, "llama")
    email = r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)"
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=email))
    prompts = [tok.encode(f"Write e-mail address number {i}.") for i in range(4)]
    kw = dict(eos_token_ids=(tok.eos_token_id,), tokenizer=default_model_path())
    one, _ = _engine(model, **kw)
    want = one.generate(prompts, params)
    two, worker = _engine(model, tp=2, **kw)
    try:
        got = two.generate(prompts, params)
    finally:
        worker.close()
    assert got == want
    for out in got:
        assert out[-1] == tok.eos_token_id and re.fullmatch(email, tok.decode(out[:-1])), tok.decode(out)
