"""The device ops of the sampling parameters (models/sampling.py: ``process_logits``, ``apply_min_p``) against a
plain per-row reference written from vLLM's definitions: allowed_token_ids, bad_words (prefix within the output),
min_tokens (EOS and stop ids masked below prompt + min_tokens), logit_bias, then the repetition penalty over prompt
and output and the frequency and presence penalties over the output; min_p after the temperature."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from models.sampling import (LogitsProcessing, Penalties, RowParams, apply_min_p, process_logits,  # noqa: E402
                             sample_tokens)

NEG = -math.inf


def reference_row(logits: list[float], row: dict) -> list[float]:
    """One row, plain Python, vLLM's order."""
    out = list(logits)
    ctx, prompt_len = row["context"], row["prompt_len"]
    output = ctx[prompt_len:]
    if row.get("allowed") is not None:
        out = [v if t in row["allowed"] else NEG for t, v in enumerate(out)]
    for word in row.get("bad_words", ()):
        prefix, last = word[:-1], word[-1]
        if len(prefix) <= len(output) and (not prefix or output[len(output) - len(prefix):] == prefix):
            out[last] = NEG
    if len(ctx) < prompt_len + row.get("min_tokens", 0):
        for t in row.get("stop_ids", ()):
            out[t] = NEG
    for t, b in row.get("bias", {}).items():
        out[t] += b
    rep, pres, freq = row.get("repetition", 1.0), row.get("presence", 0.0), row.get("frequency", 0.0)
    for t in range(len(out)):
        if t in ctx and rep != 1.0:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        count = output.count(t)
        out[t] -= freq * count + pres * (count > 0)
    return out


def padded(lists: list[list[int]], width: int | None = None) -> torch.Tensor:
    width = max([len(x) for x in lists] + [0]) if width is None else width
    return torch.tensor([list(x) + [-1] * (width - len(x)) for x in lists], dtype=torch.int64).reshape(len(lists),
                                                                                                       width)


def penalties(rows: list[dict], vocab: int) -> Penalties:
    """The rows' penalties as the worker keeps them: row i in slot 2 i + 1 of count tables (output counts, prompt
    tokens), but for its last ``drafts`` output tokens, which are its verification's drafts before it."""
    slots = torch.arange(len(rows)) * 2 + 1
    counts = torch.zeros(2 * len(rows) + 1, vocab + 1, dtype=torch.int32)
    seen = torch.zeros(2 * len(rows) + 1, vocab + 1, dtype=torch.bool)
    drafts = []
    for slot, r in zip(slots.tolist(), rows):
        ctx, k = r["context"], r.get("drafts", 0)
        for t in ctx[:r["prompt_len"]]:
            seen[slot, t] = True
        for t in ctx[r["prompt_len"]:len(ctx) - k]:
            counts[slot, t] += 1
        drafts.append(ctx[len(ctx) - k:] if k else [])
    width = max(len(d) for d in drafts)
    return Penalties(slots, counts, seen, torch.tensor([r.get("repetition", 1.0) for r in rows]),
                     torch.tensor([r.get("presence", 0.0) for r in rows]),
                     torch.tensor([r.get("frequency", 0.0) for r in rows]), padded(drafts) if width else None)


def batch(rows: list[dict], vocab: int) -> LogitsProcessing:
    """The rows as the worker gathers them (features of no row left None)."""
    n = len(rows)
    pos = torch.tensor([len(r["context"]) for r in rows])
    p = LogitsProcessing(pos, torch.tensor([r["prompt_len"] for r in rows]))
    if any(r.get("repetition", 1.0) != 1.0 or r.get("presence", 0.0) or r.get("frequency", 0.0) for r in rows):
        p.penalties = penalties(rows, vocab)
    if any(r.get("allowed") is not None for r in rows):
        p.allowed_ids = padded([sorted(r["allowed"]) if r.get("allowed") is not None else [] for r in rows])
    if any(r.get("bias") for r in rows):
        p.bias_ids = padded([list(r.get("bias", {})) for r in rows])
        p.bias = torch.tensor([list(r.get("bias", {}).values()) + [0.0] * (p.bias_ids.shape[1] - len(r.get("bias", {})))
                               for r in rows], dtype=torch.float32)
    if any(r.get("min_tokens", 0) for r in rows):
        p.min_len = torch.tensor([r["prompt_len"] + r.get("min_tokens", 0) if r.get("min_tokens") else 0
                                  for r in rows])
        p.stop_ids = padded([r.get("stop_ids", []) for r in rows])
    if any(r.get("bad_words") for r in rows):
        words = [r.get("bad_words", []) for r in rows]
        num = max(len(w) for w in words)
        width = max([len(x) - 1 for w in words for x in w] + [0])
        prefix = torch.full((n, num, width), -1, dtype=torch.int64)
        plen = torch.zeros(n, num, dtype=torch.int64)
        last = torch.full((n, num), -1, dtype=torch.int64)
        for i, w in enumerate(words):
            for j, x in enumerate(w):
                if len(x) > 1:
                    prefix[i, j, width - len(x) + 1:] = torch.tensor(x[:-1])
                plen[i, j], last[i, j] = len(x) - 1, x[-1]
        p.bad_prefix, p.bad_prefix_len, p.bad_last = prefix, plen, last
        p.tail = torch.tensor([([-2] * width + r["context"])[-width:] if width else [] for r in rows],
                              dtype=torch.int64).reshape(n, width)  # (the last tokens, -2 before the start)
    return p


@st.composite
def rows(draw, vocab: int):
    """A batch of rows, each with some of the parameters (few tokens, so that contexts repeat and words match)."""
    tokens = st.integers(0, vocab - 1)
    out = []
    for _ in range(draw(st.integers(1, 5))):
        ctx = draw(st.lists(st.integers(0, min(vocab, 6) - 1) | tokens, min_size=1, max_size=14))
        row = {"context": ctx, "prompt_len": draw(st.integers(1, len(ctx)))}
        row["drafts"] = draw(st.integers(0, min(3, len(ctx) - row["prompt_len"])))  # (verified before the row)
        if draw(st.booleans()):
            row["repetition"] = draw(st.sampled_from([0.5, 1.0, 1.3, 2.0]))
        if draw(st.booleans()):
            row["presence"] = draw(st.sampled_from([-1.0, 0.0, 0.7, 2.0]))
            row["frequency"] = draw(st.sampled_from([-0.5, 0.0, 0.3, 1.5]))
        if draw(st.booleans()):
            row["allowed"] = set(draw(st.lists(tokens, min_size=1, max_size=vocab)))
        if draw(st.booleans()):
            row["bias"] = draw(st.dictionaries(tokens, st.floats(-100, 100, width=32), max_size=4))
        if draw(st.booleans()):
            row["min_tokens"] = draw(st.integers(1, 8))
            row["stop_ids"] = sorted(set(draw(st.lists(tokens, min_size=1, max_size=3))))
        if draw(st.booleans()):
            row["bad_words"] = draw(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), max_size=4))
        out.append(row)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), vocab=st.integers(6, 40))
def test_process_logits_matches_the_reference(data, vocab):
    batch_rows = data.draw(rows(vocab))
    logits = torch.tensor(data.draw(st.lists(st.lists(st.floats(-8, 8, width=32), min_size=vocab, max_size=vocab),
                                             min_size=len(batch_rows), max_size=len(batch_rows))))
    got = process_logits(logits, batch(batch_rows, vocab))
    assert got.shape == logits.shape and got.dtype == torch.float32
    want = torch.tensor([reference_row(logits[i].tolist(), r) for i, r in enumerate(batch_rows)])
    assert torch.equal(torch.isinf(got), torch.isinf(want)), (batch_rows, got, want)
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], atol=1e-4), (batch_rows, got, want)


def test_each_parameter_changes_the_greedy_token_as_vllm_defines_it():
    """One row per parameter, on logits where token 0 leads: the argmax moves as each parameter says."""
    logits = torch.tensor([[3.0, 2.5, 1.0, -1.0, 0.5]] * 6)
    rows_ = [{"context": [4, 0], "prompt_len": 1, "presence": 1.0},  # 0 in the output: 3 - 1 < 2.5
             {"context": [0, 4], "prompt_len": 2, "repetition": 2.0},  # 0 in the prompt: 3 / 2 < 2.5
             {"context": [4], "prompt_len": 1, "allowed": {2, 3}},
             {"context": [4, 1], "prompt_len": 1, "bad_words": [[1, 0]]},  # output ends with 1: 0 banned
             {"context": [4], "prompt_len": 1, "min_tokens": 3, "stop_ids": [0, 1]},
             {"context": [4], "prompt_len": 1, "bias": {3: 10.0}}]
    greedy = process_logits(logits, batch(rows_, 5)).argmax(dim=-1).tolist()
    assert greedy == [1, 1, 2, 1, 2, 3]
    # the same rows, each alone: the batch does not change a row
    for i, r in enumerate(rows_):
        assert process_logits(logits[i:i + 1], batch([r], 5)).argmax(dim=-1).item() == greedy[i]


@given(st.lists(st.floats(-20, 20, width=32), min_size=2, max_size=30), st.floats(0.0, 1.0),
       st.floats(0.1, 2.0))
@settings(max_examples=200, deadline=None)
def test_min_p_keeps_the_tokens_at_least_min_p_times_the_most_likely(values, min_p, temperature):
    scaled = torch.tensor([values]) / temperature
    kept = torch.isfinite(apply_min_p(scaled, torch.tensor([min_p]))).squeeze(0)
    probs = torch.softmax(scaled.double(), dim=-1).squeeze(0)
    want = probs >= min_p * probs.max()
    edge = (probs - min_p * probs.max()).abs() < 1e-6 * probs.max()  # (float32 vs float64 at the threshold)
    assert torch.equal(kept[~edge], want[~edge])
    assert kept[probs.argmax()]


def test_sampling_draws_only_what_the_parameters_leave():
    """Seeded sampling with allowed_token_ids and min_p never draws a masked token; min_p 1 is greedy."""
    n, vocab = 4000, 10
    logits = torch.log(torch.tensor([0.3, 0.25, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02, 0.005, 0.005])).expand(n, vocab)
    proc = batch([{"context": [1], "prompt_len": 1, "allowed": {2, 5, 8, 9}}] * n, vocab)
    params = RowParams(torch.ones(n), None, None, torch.arange(n), processing=proc)
    drawn = sample_tokens(logits, params, torch.zeros(n, dtype=torch.long))
    assert set(drawn.tolist()) == {2, 5, 8, 9}
    freq = torch.bincount(drawn, minlength=vocab).float() / n
    assert abs(freq[2] - 0.2 / 0.26) < 0.03
    params = RowParams(torch.ones(n), None, None, torch.arange(n), min_p=torch.full((n,), 0.5))
    drawn = sample_tokens(logits, params, torch.zeros(n, dtype=torch.long))
    assert set(drawn.tolist()) == {0, 1, 2}  # p >= 0.15
    params = RowParams(torch.ones(n), None, None, torch.arange(n), min_p=torch.ones(n))
    assert set(sample_tokens(logits, params, torch.zeros(n, dtype=torch.long)).tolist()) == {0}
