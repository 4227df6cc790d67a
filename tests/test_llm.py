"""The offline API (``from dispatcher import LLM, SamplingParams``) on a tiny random Llama with a real byte-level BPE
tokenizer and chat template: outputs carry text, token ids and finish reasons in prompt order; streamed chunks
concatenate to the generated text; a stop string split over two tokens stops generation (finish reason 'stop',
KV freed at once) and is cut from the text; stop token ids and EOS are left out of the text; presets take token
ids only. Importing the package stays light."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dispatcher import LLM, SamplingParams  # noqa: E402
from dispatcher.engine.config import SD_ADMISSION_WAIT_STEPS, AdmissionPace  # noqa: E402
from models.checkpoint import CheckpointError  # noqa: E402
from dispatcher.plan.config import ConfigError  # noqa: E402
from scheduler.request import RequestError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS = dict(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=256, block_size=8, max_model_len=480)


@pytest.fixture(scope="module")
def model_dir(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, **OPTIONS)


def test_generate_and_chat_return_text_token_ids_and_finish_reasons(llm, texts):
    tok = llm.get_tokenizer()
    prompts = [texts[0], texts[4], "한국어 🙂"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.prompt for o in outs] == prompts
    for o, p in zip(outs, prompts):
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "length" and len(c.token_ids) == 12
        assert o.prompt_token_ids == tok.encode(p)
        assert c.text == tok.decode(o.prompt_token_ids + c.token_ids)[len(tok.decode(o.prompt_token_ids)):]
    # the same prompt alone gives the same tokens (batching changes nothing under greedy sampling)
    alone = llm.generate({"prompt_token_ids": outs[1].prompt_token_ids}, SamplingParams(max_tokens=12,
                                                                                         ignore_eos=True))
    assert alone[0].outputs[0].token_ids == outs[1].outputs[0].token_ids and alone[0].prompt is None
    chat = llm.chat([{"role": "user", "content": texts[2]}], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert chat.prompt.endswith("<|im_start|>assistant\n") and len(chat.outputs[0].token_ids) == 5
    assert chat.prompt_token_ids == tok.encode_chat([{"role": "user", "content": texts[2]}])
    assert llm.engine.eos_token_ids == (tok.token_id("<|im_end|>"),)  # tokenizer_config.json's eos_token
    partial = [{"role": "user", "content": texts[2]}, {"role": "assistant", "content": "Well, the"}]
    going_on = llm.chat(partial, SamplingParams(max_tokens=2), add_generation_prompt=False,
                        continue_final_message=True)[0]
    assert going_on.prompt.endswith("<|im_start|>assistant\nWell, the")  # (no end of turn after it)
    with pytest.raises(ValueError, match="add_generation_prompt must be false"):
        llm.chat(partial, continue_final_message=True)
    assert not llm.engine.scheduler.has_unfinished()


def test_streamed_chunks_concatenate_to_the_generated_text(llm, texts):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in (texts[7], "Party 🎉 time"):
        full = llm.generate(prompt, params)[0].outputs[0]
        chunks = list(llm.stream(prompt, params))
        assert "".join(c.text for c in chunks) == full.text
        assert [t for c in chunks for t in c.token_ids] == full.token_ids
        assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])


def _split_stop(llm, prompt):
    """From a free run: a stop string made of the last two characters of one output token and the first two of
    the next, the token index where it completes, and where the text is cut."""
    free = llm.generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True))[0].outputs[0]
    tok = llm.get_tokenizer()
    p_ids = tok.encode(prompt)
    texts_upto = [tok.decode(p_ids + free.token_ids[:i])[len(tok.decode(p_ids)):] for i in range(49)]
    for k in range(1, 47):
        a, b = texts_upto[k][len(texts_upto[k - 1]):], texts_upto[k + 1][len(texts_upto[k]):]
        if len(a) >= 2 and len(b) >= 2 and not (a + b).isspace():
            stop = a[-2:] + b[:2]
            if texts_upto[k + 1].index(stop) == len(texts_upto[k]) - 2:  # its first occurrence
                return free, stop, k, len(texts_upto[k]) - 2
    pytest.skip("no two adjacent multi-character tokens in the free run")


def test_a_stop_string_split_over_two_tokens_stops_generation_and_is_cut(llm, texts):
    prompt = texts[11]
    free, stop, k, cut = _split_stop(llm, prompt)
    kv = llm.engine.scheduler.kv
    free_blocks = kv.num_free
    outs = llm.generate([prompt, texts[12]], [SamplingParams(max_tokens=48, ignore_eos=True, stop=[stop]),
                                              SamplingParams(max_tokens=20, ignore_eos=True)])
    got = outs[0].outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.text == free.text[:cut] and stop not in got.text
    assert got.token_ids == free.token_ids[:k + 1]  # up to the token that completed the stop string
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 20
    assert kv.num_free == free_blocks and not llm.engine.scheduler.has_unfinished()
    kept = llm.generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True, stop=stop,
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == free.text[:cut + len(stop)]


def test_the_request_stops_in_the_scheduler_the_step_its_stop_string_appears(llm, texts):
    prompt = texts[11]
    free, stop, k, cut = _split_stop(llm, prompt)
    rid = llm._add(prompt, SamplingParams(max_tokens=48, ignore_eos=True, stop=[stop]))
    steps, first = 0, None
    while llm.engine.scheduler.has_unfinished():
        outs = llm.processor.process(llm.engine.step())
        steps += 1
        if first is None and any(o.outputs[0].token_ids for o in outs):
            first = steps  # (after the prefill steps: fewer when the prefix cache holds the prompt)
        if any(o.finished for o in outs):
            break
    # output token k (0-based) comes from step first + k: the request ends there, not at max_tokens
    assert first is not None and steps == first + k and not llm.engine.scheduler.has_unfinished()
    assert rid not in llm.processor.requests


def test_stop_token_ids_and_eos_are_left_out_of_the_text(llm, texts):
    free = llm.generate(texts[5], SamplingParams(max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop_id = free.token_ids[9]
    first = free.token_ids.index(stop_id)
    got = llm.generate(texts[5], SamplingParams(max_tokens=30, stop_token_ids=[stop_id]))[0].outputs[0]
    tok = llm.get_tokenizer()
    p_ids = tok.encode(texts[5])
    assert got.token_ids == free.token_ids[:first + 1] and got.finish_reason == "stop"
    assert got.stop_reason == stop_id
    assert got.text == tok.decode(p_ids + free.token_ids[:first])[len(tok.decode(p_ids)):]


def test_stats_count_speculative_decoding_as_vllm_does():
    """``LLM.stats``: verify events, drafts verified and accepted, per position, and the mean acceptance length
    (random draft heads accept little, but every decode step verifies K drafts per request)."""
    llm = LLM("tiny-dense", speculative_config={"method": "eagle3", "num_speculative_tokens": 3}, **OPTIONS)
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=8, ignore_eos=True))
    s = llm.stats
    assert s.num_drafts > 0 and s.num_draft_tokens == 3 * s.num_drafts
    assert len(s.accepted_per_pos) == 3 and sum(s.accepted_per_pos) == s.num_accepted_tokens
    assert s.mean_acceptance_length == 1 + s.num_accepted_tokens / s.num_drafts
    plain = LLM("tiny-dense", **OPTIONS)
    plain.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert plain.stats.num_drafts == 0 and plain.stats.mean_acceptance_length is None


def test_admission_wait_defaults_to_four_steps_under_speculative_decoding_only():
    """Unset, arrivals wait up to 4 steps when a drafter is configured (its staggered finishes make arrivals come a
    few at a time) and are admitted at once without one; a wait given, 0 included, is the one in force."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    waits = [LLM("tiny-dense", **kw, **OPTIONS).engine.scheduler.config.admission_wait_steps
             for kw in ({}, {"speculative_config": ngram}, {"speculative_config": ngram, "admission_wait_steps": 0},
                        {"admission_wait_steps": 2})]
    assert waits == [0, SD_ADMISSION_WAIT_STEPS, 0, 2] and SD_ADMISSION_WAIT_STEPS == 4


def test_the_default_wait_follows_the_steps_pace_and_a_given_one_stays(caplog):
    """The default wait holds arrivals at most ``SD_ADMISSION_WAIT_MS`` (25 ms) by the steps' recent pace: steps of
    2 ms keep 4 steps, 12 ms ones give 2 (the default model at 1024 streams), 40 ms ones none, and a faster pace
    brings it back, each change a log line; near a border it does not flap; a wait given is never paced."""
    pace = AdmissionPace()
    assert all(pace.observe(2.0) is None for _ in range(200)) and pace.steps == 4
    assert [s for s in (pace.observe(12.0) for _ in range(400)) if s is not None] == [3, 2]  # (the pace rising)
    assert all(pace.observe(ms) is None for ms in [12.0, 13.0, 12.2, 12.8] * 100)  # (around 12.5 ms: 2 or 1)
    assert pace.observe(float("nan")) is None and pace.observe(0.0) is None
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    engine = LLM("tiny-dense", speculative_config=ngram, **OPTIONS).engine
    with caplog.at_level("INFO", logger="twogrid.engine"):
        for ms in [40.0] * 300:
            engine._pace_admission(ms)
    assert engine.scheduler.config.admission_wait_steps == 0 and "arrivals wait up to 0 steps" in caplog.text
    for ms in [3.0] * 300:
        engine._pace_admission(ms)
    assert engine.scheduler.config.admission_wait_steps == SD_ADMISSION_WAIT_STEPS
    with pytest.raises(ValueError, match="admission_wait_steps must be a step count >= 0, got -1"):
        engine.scheduler.set_admission_wait(-1)
    assert LLM("tiny-dense", speculative_config=ngram, admission_wait_steps=3, **OPTIONS).engine.admission_pace is None
    assert LLM("tiny-dense", **OPTIONS).engine.admission_pace is None


def test_admission_wait_reaches_the_scheduler_and_leaves_the_greedy_tokens_alone():
    """``admission_wait_steps`` (the offline API's): the scheduler holds arrivals by it, and every prompt gets the
    tokens it gets without it (prompts given together all arrive at once: none is held past the wait)."""
    prompts = [[5 + i, 6, 7 + i % 3] for i in range(10)]
    params = [SamplingParams(max_tokens=6 + 3 * (i % 4), ignore_eos=True) for i in range(10)]
    outs = []
    for wait in (0, 4):
        llm = LLM("tiny-dense", admission_wait_steps=wait, **OPTIONS)
        assert llm.engine.scheduler.config.admission_wait_steps == wait
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1] and all(len(o) == p.max_tokens for o, p in zip(outs[1], params))
    from dispatcher.plan.config import ConfigError

    with pytest.raises(ConfigError, match="admission_wait_steps must be a step count >= 0, got -1"):
        LLM("tiny-dense", admission_wait_steps=-1, **OPTIONS)


def test_presets_take_token_ids_only_and_bad_models_fail_clearly(tmp_path):
    llm = LLM("tiny-dense", **OPTIONS)
    out = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4] and out[0].outputs[0].text == ""
    with pytest.raises(RequestError, match="has no tokenizer"):
        llm.generate("text", SamplingParams())
    with pytest.raises(RequestError, match="stop strings need the model's tokenizer"):
        llm.generate([[5, 6]], SamplingParams(stop=["x"]))
    assert not llm.engine.scheduler.has_unfinished()
    with pytest.raises(CheckpointError, match="no such directory or file, and not a preset"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(RequestError, match="stop must be a string or a list of non-empty strings"):
        SamplingParams(stop=["ok", ""]).validate()


def test_importing_dispatcher_stays_light():
    code = ("import sys, dispatcher; from dispatcher import SamplingParams; "
            "assert 'torch' not in sys.modules and 'dispatcher.llm' not in sys.modules, sorted(sys.modules); "
            "print(SamplingParams(stop='x').stop)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "('x',)", proc.stderr


def test_twogrid_generate_command(model_dir, capsys):
    from dispatcher.cli import main

    assert main(["generate", "--model", model_dir, "--max-tokens", "5", "--device", "cpu", "-v", "Hello there"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "[5 tokens, finish reason length]" in err
    assert main(["generate", "--model", "tiny-dense", "--max-tokens", "3", "--device", "cpu", "5 6 7"]) == 0
    assert len(capsys.readouterr().out.split()) == 3
    assert main(["generate", "--model", "no/such/dir", "hi"]) == 2
    assert "no such directory or file, and not a preset" in capsys.readouterr().err


def test_twogrid_generate_says_when_the_model_has_no_chat_template(model_dir, tmp_path, capsys):
    """The help promises each prompt goes through the model's chat template; without one the prompts went as plain
    text without a word. They still do (as --no-chat), and stderr says so."""
    import json
    import shutil

    from dispatcher.cli import main

    bare = tmp_path / "no_template"
    shutil.copytree(model_dir, bare)
    for name in ("tokenizer_config.json",):
        config = json.loads((bare / name).read_text())
        config.pop("chat_template", None)
        (bare / name).write_text(json.dumps(config))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (bare / extra).unlink(missing_ok=True)
    assert main(["generate", "--model", str(bare), "--max-tokens", "2", "--device", "cpu", "Hello"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "the model has no chat template: the prompts go as plain text" in err
    assert main(["generate", "--model", model_dir, "--max-tokens", "2", "--device", "cpu", "Hello"]) == 0
    assert "no chat template" not in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_model_len=0), "max_model_len must be an integer >= 1"),  # (0 was taken, -1 named num_kv_blocks)
    (dict(max_model_len=-1), "max_model_len must be an integer >= 1"),
    (dict(block_size=0), "block_size must be an integer in 1..1024"),  # (a ZeroDivisionError)
    (dict(block_size=1 << 40), "block_size must be an integer in 1..1024"),  # (an allocation error)
    (dict(dtype="float16"), "dtype must be one of bfloat16, float32"),  # (torch's TypeError)
    (dict(dtype=torch.int8), "dtype must be one of bfloat16, float32"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching must be True or False"),  # (truthy: caching on)
    (dict(seed="x"), "seed must be an integer"),
    (dict(kv_cache_memory_gib=1.0), "num_kv_blocks and kv_cache_memory_gib both size the KV cache"),  # (one won)
])
def test_bad_arguments_are_named_before_anything_loads(kwargs, words):
    """Found by a hostile-input probe of the offline API: each raised a library's error that named nothing, or
    was taken as something else."""
    with pytest.raises(ConfigError, match=words):
        LLM("tiny-dense", **{**OPTIONS, **kwargs})


def test_dtype_by_name_and_a_non_boolean_ignore_eos():
    llm = LLM("tiny-dense", dtype="float32", **OPTIONS)
    assert llm.engine.args.dtype == torch.float32
    with pytest.raises(RequestError, match="ignore_eos must be true or false, got 'no'"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos="no"))
    with pytest.raises(RequestError, match="prompts must be a string, .* got NoneType"):  # (a TypeError before)
        llm.generate(None)


def test_a_tokenizer_given_apart_is_the_one_used(model_dir, bpe, tmp_path):
    """``LLM(tokenizer=...)`` (vLLM's argument; the way around a GGUF whose tokenizer twogrid refuses) takes the
    tokenizer, its chat template and its special tokens from there, not from the model."""
    import json
    import shutil

    other = str(tmp_path / "other")
    shutil.copytree(bpe, other)
    config_path = os.path.join(other, "tokenizer_config.json")
    config = json.load(open(config_path, encoding="utf-8"))
    config["chat_template"] = "{% for m in messages %}OTHER:{{ m['content'] }}{% endfor %}"
    json.dump(config, open(config_path, "w", encoding="utf-8"))
    llm = LLM(model_dir, tokenizer=other, **OPTIONS)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))[0]
    assert out.prompt == "OTHER:hi"
    for bad, words in ((str(tmp_path / "missing"), "is no such directory or file"), ("tiny-dense", "is a preset"),
                       (123, "got 123"), ("", "got ''")):
        with pytest.raises(ConfigError, match=f"tokenizer must be a Hugging Face checkpoint directory or a .gguf "
                                              f"file.*{words}"):
            LLM(model_dir, tokenizer=bad, **OPTIONS)
