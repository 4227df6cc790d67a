"""Speculative decoding on the real default model (SmolLM2-135M-Instruct) on the CPU: the EAGLE-3 head shipped
for it (models/heads/smollm2-135m-instruct-eagle3, trained by scripts/train_eagle3.py) accepts drafts on prompts it
was not trained on, and every drafter (that head, n-gram, the model drafting for itself) leaves greedy output as it
is without speculation. Marked ``slow`` (a minute or two): CI runs it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dispatcher.llm import LLM  # noqa: E402
from models.default_model import default_model_path  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

HELD_OUT = [i for i in range(500) if i % 10 == 9]
"""The ShareGPT conversations the shipped head never saw (scripts/train_eagle3.py --held-out-every 10)."""


def chat(llm: LLM, texts: list[str], indices: list[int]) -> list[dict]:
    return [{"prompt_token_ids": llm.tokenizer.encode_chat([{"role": "user", "content": texts[i]}])} for i in indices]


def test_the_shipped_head_accepts_drafts_on_held_out_prompts(texts):
    """Measured for this sample (8 prompts, 96 tokens, on the CPU): 1.95 (the heads before this one: 1.79, 1.74);
    on the 50 held-out prompts at 256 tokens, served on an H200, 2.40 (models/heads/.../README.md). A random head
    would give 1.0."""
    llm = LLM(max_num_seqs=16, speculative_config={"method": "eagle3", "num_speculative_tokens": 3})
    llm.generate(chat(llm, texts, HELD_OUT[:8]), SamplingParams(max_tokens=96))
    stats = llm.stats
    rates = stats.acceptance_rate_per_pos
    assert stats.mean_acceptance_length >= 1.85, (stats.mean_acceptance_length, rates)
    assert rates[0] > rates[1] > rates[2] > 0


EAGLE3 = {"method": "eagle3", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def plain_fp32() -> LLM:
    """The default model in float32 without speculation: one engine for the module's references (building one is
    several seconds on a 2-core CPU)."""
    return LLM(max_num_seqs=8, dtype=torch.float32)


@pytest.fixture(scope="module")
def eagle3_fp32() -> LLM:
    """The default model in float32 with the shipped EAGLE-3 head, shared by the tests that compare it with
    ``plain_fp32`` (each counts the drafts it accepted itself)."""
    return LLM(max_num_seqs=8, dtype=torch.float32, speculative_config=EAGLE3)


@pytest.fixture(scope="module")
def greedy_fp32(texts, plain_fp32):
    prompts = chat(plain_fp32, texts, HELD_OUT[8:12])
    return prompts, [list(o.outputs[0].token_ids) for o in plain_fp32.generate(prompts, SamplingParams(max_tokens=40))]


@pytest.mark.parametrize("spec", [
    EAGLE3,
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "draft_model", "num_speculative_tokens": 2, "model": "DEFAULT"},
], ids=["eagle3-shipped-head", "ngram", "draft_model-itself"])
def test_every_drafter_is_lossless_on_the_default_model(greedy_fp32, spec, request):
    """In float32 (bfloat16 verification of 1 + K rows can break near-ties otherwise than one-row steps, as on a
    GPU): the same greedy tokens with the drafter as without."""
    if spec.get("model") == "DEFAULT":
        spec = {**spec, "model": default_model_path()}
    prompts, reference = greedy_fp32
    llm = (request.getfixturevalue("eagle3_fp32") if spec is EAGLE3
           else LLM(max_num_seqs=8, dtype=torch.float32, speculative_config=spec))
    accepted = llm.stats.num_accepted_tokens
    out = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, SamplingParams(max_tokens=40))]
    assert out == reference
    assert llm.stats.num_accepted_tokens > accepted


def test_the_shipped_head_is_lossless_with_penalties_and_bad_words(texts, plain_fp32, eagle3_fp32):
    """Issue 31: greedy with a presence and a repetition penalty, a logit bias and bad words, with the EAGLE-3 head
    as without speculation (float32), drafts accepted: the verifier draws from the same processed logits, each
    position's counts and bad-word context including the drafts before it."""
    plain, sd = plain_fp32, eagle3_fp32
    prompts = chat(plain, texts, HELD_OUT[12:15])
    params = SamplingParams(max_tokens=40, presence_penalty=0.4, repetition_penalty=1.15,
                            logit_bias={plain.tokenizer.encode(" the", False)[0]: -2.0}, bad_words=("very", "just"))
    reference = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params)]
    accepted = sd.stats.num_accepted_tokens
    assert [list(o.outputs[0].token_ids) for o in sd.generate(prompts, params)] == reference
    assert sd.stats.num_accepted_tokens > accepted


def test_the_trainers_second_turns_carry_the_prompt_the_answer_and_a_follow_up():
    """scripts/train_eagle3.py --follow-ups: each training prompt's chat with the target's own answer and a generic
    follow-up, in the default model's template, ending where the assistant answers; follow-ups in turn; a chat
    longer than the limit left out."""
    import importlib.util
    import os

    from models.text import load_tokenizer

    spec = importlib.util.spec_from_file_location("train_eagle3", os.path.join(
        os.path.dirname(__file__), "..", "scripts", "train_eagle3.py"))
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    tok = load_tokenizer(default_model_path())
    answers = [tok.encode("Two plus two is four."), tok.encode("Blue. " * 300)]
    chats = trainer.follow_up_ids(tok, ["What is 2+2?", "Name a color."], answers, 2, 200)
    assert len(chats) == 2  # (the second prompt's answer makes its chats longer than 200 tokens)
    text = [tok.decode(c, skip_special_tokens=False) for c in chats]
    for t, ask in zip(text, trainer.FOLLOW_UPS[:2]):
        assert t.index("What is 2+2?") < t.index("Two plus two is four.") < t.index(ask)
        assert t == tok.decode(tok.encode_chat([{"role": "user", "content": "What is 2+2?"},
                                                {"role": "assistant", "content": "Two plus two is four."},
                                                {"role": "user", "content": ask}]), skip_special_tokens=False)
