"""The sampling parameters through the engine and its worker (the offline API on the tiny presets, eager on the
CPU): speculative decoding stays lossless for greedy requests with any parameter (n-gram and EAGLE-3 drafts checked
against the same modified distribution), a batch without parameters runs none of their ops, a row's tokens do not
depend on its batch or on preemption, n > 1 fans out into seeded choices with the prompt computed once before them,
prompt logprobs agree with the logprobs of each prefix (over chunked prefill), min_tokens holds EOS back."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dispatcher import LLM, SamplingParams  # noqa: E402
from scheduler.request import RequestError, child_request_id  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8], [100, 101, 102, 100, 101, 102, 100], [3, 4, 3, 4, 3, 4, 3, 4, 3]]
PARAMETERS = {  # each with a value that makes the greedy output loop, so that n-gram drafts get accepted
    "presence_penalty": dict(presence_penalty=-1.5),
    "penalties": dict(repetition_penalty=0.6, frequency_penalty=-0.4, presence_penalty=0.2),
    "repetition_penalty": dict(repetition_penalty=1.8),
    "bad_words": dict(bad_words=("x",), bad_words_token_ids=((7,), (8, 9), (101, 102, 100))),
    "min_tokens": dict(min_tokens=10, logit_bias={2: 8.0}),
    "allowed_token_ids": dict(allowed_token_ids=tuple(range(0, 512, 3)), presence_penalty=-1.0),
    "logit_bias": dict(logit_bias={3: 3.0, 4: 2.5, 100: -50.0}),
}
OPTIONS = dict(device="cpu", max_model_len=256, max_num_seqs=8, enforce_eager=True)


@pytest.fixture(scope="module")
def plain():
    return LLM("tiny-dense", **OPTIONS)


def tokens(llm, params, prompts=PROMPTS):
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def spec_config(method: str) -> dict:
    """K = 3 of ``method`` (n-gram matching from one token, so that it drafts on short prompts)."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    return spec


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_speculative_decoding_is_lossless_with_every_parameter(plain, method):
    """Greedy output with a parameter and speculative decoding equals it without: the verifier draws each position's
    token from the processed logits, its context counting the drafts before it."""
    spec = spec_config(method)
    sd = LLM("tiny-dense", **OPTIONS, speculative_config=spec)
    for name, kw in PARAMETERS.items():
        params = SamplingParams(max_tokens=40, ignore_eos=True, **kw)
        before = sd.stats.num_accepted_tokens
        assert tokens(sd, params) == tokens(plain, params), name
        if method == "ngram" and name != "repetition_penalty":  # (drafts are accepted: the drafts' context counts)
            assert sd.stats.num_accepted_tokens > before, name


def test_a_batch_without_parameters_runs_none_of_their_ops(plain, monkeypatch):
    """The fast path: no request of the batch uses a parameter, so nothing of them runs (no upload section, no
    processing, no min_p), and the greedy sampler stays one argmax."""
    import models.sampling as sampling
    from dispatcher.runtime import sampling_state

    def boom(*args, **kwargs):
        raise AssertionError("a parameter's op ran in a batch without parameters")

    for name in ("process_logits", "apply_min_p", "apply_penalties", "bad_words_banned"):
        monkeypatch.setattr(sampling, name, boom)
    monkeypatch.setattr(sampling_state.SamplingExtras, "processing",
                        lambda self, *a: boom() if self.host_used.any() else (None, None))
    monkeypatch.setattr(sampling_state.SamplingExtras, "count", boom)  # (no token counted)
    tokens(plain, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=1, top_k=5))
    tokens(plain, SamplingParams(max_tokens=6, ignore_eos=True))
    state = plain.engine.worker.state
    assert not state.extras.host_used.any() and state.plain_greedy(list(range(8)))


def test_the_cpu_allocates_the_count_tables_at_the_first_penalty():
    """5 bytes x slots x vocabulary: on the CPU only once a request uses a penalty."""
    llm = LLM("tiny-dense", **OPTIONS)
    tokens(llm, SamplingParams(max_tokens=4, ignore_eos=True, min_p=0.1, temperature=1.0, logit_bias={3: 1.0}))
    extras = llm.engine.worker.state.extras
    assert extras.output_counts is None and extras.prompt_seen is None
    tokens(llm, SamplingParams(max_tokens=4, ignore_eos=True, presence_penalty=0.5))
    assert extras.output_counts.shape == (8, 513) and extras.output_counts.sum() > 0


def test_parameters_do_not_depend_on_the_batch_or_on_slot_reuse(plain):
    """A request with parameters among others gives what it gives alone; requests without parameters that reuse
    its slot afterwards give what they gave before (the slot's tables are reset)."""
    base = tokens(plain, SamplingParams(max_tokens=20, ignore_eos=True))
    params = [SamplingParams(max_tokens=20, ignore_eos=True, **PARAMETERS["penalties"]),
              SamplingParams(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=20, ignore_eos=True, **PARAMETERS["bad_words"])]
    mixed = [list(o.outputs[0].token_ids) for o in plain.generate(PROMPTS, params)]
    alone = [tokens(plain, p, [prompt])[0] for p, prompt in zip(params, PROMPTS)]
    assert mixed == alone and mixed[1] == base[1] and mixed[0] != base[0]
    assert tokens(plain, SamplingParams(max_tokens=20, ignore_eos=True)) == base


def test_penalties_hold_through_preemption():
    """Preemption recomputes a request from its tokens: penalties count the same history afterwards."""
    params = SamplingParams(max_tokens=60, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5)
    prompts = [[10 + i, 20 + i, 30 + i] * 3 for i in range(6)]
    roomy = LLM("tiny-dense", **OPTIONS)
    tight = LLM("tiny-dense", **{**OPTIONS, "max_num_seqs": 6}, num_kv_blocks=14, block_size=8)
    assert tokens(tight, params, prompts) == tokens(roomy, params, prompts)
    assert tight.engine.scheduler.stats.preemptions > 0


def test_n_choices_are_seeded_children_with_the_prompt_computed_first(plain):
    """n = 3: three choices, choice i exactly a request with seed + i; the first choice alone computes the prompt
    in the first step, the others join in the step after the one that computes the rest of it (prefix caching then
    finds its blocks)."""
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=11, n=3, ignore_eos=True)
    out = plain.generate([PROMPTS[0]], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    for c in out.outputs:
        alone = tokens(plain, SamplingParams(max_tokens=8, temperature=0.9, seed=11 + c.index, ignore_eos=True),
                       [PROMPTS[0]])[0]
        assert list(c.token_ids) == alone
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    engine = plain.engine
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=4, temperature=1.0, n=2), "fan")
    first = engine.schedule()
    assert [r.request_id for r in first.out.requests] == [child_request_id("fan", 0)]
    engine.update(first, engine.execute(first))
    second = engine.schedule()
    assert child_request_id("fan", 1) in [r.request_id for r in second.out.requests]
    engine.update(second, engine.execute(second))
    while engine.has_unfinished():
        engine.step()


def test_n_children_wait_for_the_whole_prompt_over_chunked_prefill():
    """A prompt prefilled in chunks of 4 tokens: the other choices are admitted only in the step after the one
    that computes the prompt's last chunk (so that with prefix caching they find every block)."""
    llm = LLM("tiny-dense", **{**OPTIONS, "max_num_batched_tokens": 4, "max_num_seqs": 4})
    engine = llm.engine
    prompt = list(range(10, 21))  # 11 tokens: chunks of 4, 4, 3
    engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=1.0, n=3), "long")
    admitted = []
    while engine.has_unfinished():
        step = engine.schedule()
        admitted.append(sorted(r.request_id for r in step.out.new_requests))
        engine.update(step, engine.execute(step))
    assert admitted[:3] == [[child_request_id("long", 0)], [], []]
    assert child_request_id("long", 1) in admitted[3]


def test_n_above_one_needs_sampling_which_it_gets_by_default(plain):
    """``SamplingParams(n=2)`` samples two choices at vLLM's default temperature 1.0 (it refused, greedy by
    default here); greedy asked for with n > 1 is refused, as vLLM does."""
    assert SamplingParams(n=2).temperature == 1.0 and SamplingParams().temperature == 0.0
    (out,) = plain.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=4, seed=1))
    assert len(out.outputs) == 2
    with pytest.raises(RequestError, match="n must be 1 when using greedy sampling"):
        plain.generate([PROMPTS[0]], SamplingParams(n=2, temperature=0.0))


@pytest.mark.parametrize("chunk", [64, 4])
def test_prompt_logprobs_agree_with_each_prefix(chunk):
    """Each prompt token's log-probability and top tokens equal the output logprobs of a request on the prompt's
    prefix before it, also when the prompt is prefilled in chunks of 4 tokens over several steps."""
    llm = LLM("tiny-dense", **{**OPTIONS, "max_num_batched_tokens": chunk, "max_num_seqs": 4})
    prompt = [7, 3, 99, 250, 3, 17, 400, 12, 9]
    out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3))[0]
    entries, ranks = out.prompt_logprobs, out.prompt_logprob_ranks
    assert entries[0] is None and ranks[0] is None and len(entries) == len(prompt)
    for p in range(1, len(prompt)):
        ref = llm.generate([prompt[:p]], SamplingParams(max_tokens=1, logprobs=20))[0].outputs[0].logprobs[0]
        got = entries[p]
        assert prompt[p] in got
        for t, v in got.items():
            assert v == pytest.approx(ref.get(t, v), abs=1e-5)
        top3 = sorted(ref.items(), key=lambda kv: -kv[1])[:3]
        assert all(t in got for t, _ in top3) or prompt[p] in dict(top3)
        if prompt[p] in ref:  # its rank: 1 + the tokens more likely than it
            assert ranks[p] == 1 + sum(v > ref[prompt[p]] for v in ref.values())


def test_prompt_logprobs_zero_gives_each_prompt_tokens_own_logprob_only(plain):
    """prompt_logprobs 0 (what ``echo`` with ``logprobs`` 0 asks): each prompt token's own log-probability and rank,
    no top tokens (the step's empty top-token section took the engine down)."""
    prompt = [7, 3, 99, 250, 3]
    out = plain.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert all(list(entry) == [t] for entry, t in zip(out.prompt_logprobs[1:], prompt[1:]))
    assert all(r >= 1 for r in out.prompt_logprob_ranks[1:])


def test_prompt_logprobs_skip_the_prefix_cache():
    """A prompt whose blocks the prefix cache holds is computed again for a request asking for its prompt's
    logprobs (as vLLM does): every entry is there, equal to a cold run's."""
    prompt = [(7 * i + 3) % 500 for i in range(40)]  # two full blocks of 16
    params = SamplingParams(max_tokens=2, prompt_logprobs=2)
    cold = LLM("tiny-dense", **OPTIONS).generate([prompt], params)[0]
    warm_llm = LLM("tiny-dense", **OPTIONS)
    assert warm_llm.generate([prompt], SamplingParams(max_tokens=2))[0].num_cached_tokens == 0
    assert warm_llm.generate([prompt], SamplingParams(max_tokens=2))[0].num_cached_tokens == 32  # cached
    warm = warm_llm.generate([prompt], params)[0]
    assert warm.num_cached_tokens == 0 and len(warm.prompt_logprobs) == len(prompt)
    for a, b in zip(cold.prompt_logprobs[1:], warm.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(a[t] == pytest.approx(b[t], abs=1e-5) for t in a)


def test_min_tokens_holds_eos_back(plain):
    """EOS (token 2, the preset's) biased to be certain: nothing ends the request before min_tokens output tokens;
    then EOS at once."""
    params = SamplingParams(max_tokens=40, min_tokens=20, logit_bias={2: 100.0})
    out = plain.generate([PROMPTS[0]], params)[0].outputs[0]
    assert len(out.token_ids) == 21 and 2 not in out.token_ids[:20] and out.token_ids[20] == 2
    assert out.finish_reason == "stop"


def test_sampling_params_n_in_the_offline_api(plain):
    assert SamplingParams(n=2, temperature=1.0).n == 2
    outs = plain.generate(PROMPTS[:2], SamplingParams(n=2, temperature=1.0, max_tokens=3))
    assert [len(o.outputs) for o in outs] == [2, 2]
    streamed = list(plain.stream(PROMPTS[0], SamplingParams(n=2, temperature=1.0, max_tokens=3, seed=4)))
    assert {c.index for c in streamed} == {0, 1} and sum(len(c.token_ids) for c in streamed) == 6


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_on_the_gpu_with_cuda_graphs(method):
    """On a GPU with its graphs captured (the fused penalties kernel, the count tables, the float32 argmax; the
    model in float32 so that near-ties break alike with and without drafts): speculative decoding stays lossless
    for greedy requests with every parameter, and a batch without parameters gives what it gave before any request
    with them ran."""
    opts = dict(device="cuda", max_model_len=256, max_num_seqs=8, dtype=torch.float32)
    plain = LLM("tiny-dense", **opts)
    before = tokens(plain, SamplingParams(max_tokens=24, ignore_eos=True))
    spec = spec_config(method)
    sd = LLM("tiny-dense", **opts, speculative_config=spec)
    for name, kw in PARAMETERS.items():
        params = SamplingParams(max_tokens=40, ignore_eos=True, **kw)
        assert tokens(sd, params) == tokens(plain, params), name
    assert tokens(plain, SamplingParams(max_tokens=24, ignore_eos=True)) == before


def test_a_seed_outside_int64_is_refused_before_it_reaches_a_step(plain):
    """The offline API's seed range is the HTTP API's (int64): one outside it is a RequestError naming it, and the
    request beside it is not taken down with a failed step."""
    bystander = SamplingParams(max_tokens=3, ignore_eos=True)
    for seed in (2**63, -2**63 - 1, 1.5, True):
        with pytest.raises(RequestError, match="seed must be an integer"):
            plain.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=3, temperature=1.0, seed=seed), bystander])
    assert len(plain.generate([[8, 9]], bystander)[0].outputs[0].token_ids) == 3
