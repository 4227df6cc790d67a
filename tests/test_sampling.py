"""Sampling, verification and the n-gram drafter."""

import random

import pytest

torch = pytest.importorskip("torch")

from models.drafters import NGRAM_MATCH_CONFIDENCE, propose_ngram  # noqa: E402
from models.sampling import RowParams, accepted_drafts, apply_top_k_top_p, sample_tokens, uniform  # noqa: E402


def params(n, temperature=1.0, top_k=None, top_p=None, seed=7):
    full = lambda v, dt: None if v is None else torch.full((n,), v, dtype=dt)  # noqa: E731
    return RowParams(torch.full((n,), float(temperature)), full(top_k, torch.int64), full(top_p, torch.float32),
                     torch.full((n,), seed, dtype=torch.int64))


def test_top_k_and_top_p_masks_per_row():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 4))
    kept = torch.isfinite(apply_top_k_top_p(logits, torch.tensor([2, 0, 0, 0]), torch.tensor([1.0, 0.6, 0.4, 1.0])))
    # top-p keeps the smallest prefix whose mass reaches it: 0.6 -> 0.5 + 0.2
    assert kept.tolist() == [[True, True, False, False, False], [True, True, False, False, False],
                             [True, False, False, False, False], [True] * 5]


def test_uniform_depends_on_seed_position_and_salt_only():
    seeds, pos = torch.tensor([1, 1, 2, 1]), torch.tensor([5, 5, 5, 6])
    u = uniform(seeds, pos, 1)
    assert u[0] == u[1] and u[0] != u[2] and u[0] != u[3]
    assert ((u > 0) & (u < 1)).all()
    assert uniform(seeds[:1], pos[:1], 1) == u[0] and uniform(seeds[:1], pos[:1], 2) != u[0]
    grid = uniform(torch.arange(64), torch.zeros(64, dtype=torch.long), 1, 1000)
    assert abs(grid.mean().item() - 0.5) < 0.01 and abs(grid.var().item() - 1 / 12) < 0.005


def test_greedy_and_seeded_sampling_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    positions = torch.tensor([3, 9, 9, 4])
    assert torch.equal(sample_tokens(logits, params(4, 0.0), positions), logits.argmax(-1))
    a = sample_tokens(logits, params(4), positions)
    alone = torch.cat([sample_tokens(logits[i : i + 1], params(1), positions[i : i + 1]) for i in range(4)])
    assert torch.equal(a, alone)
    assert torch.equal(sample_tokens(logits, params(4, top_k=1), positions), logits.argmax(-1))
    seeds_differ = RowParams(torch.ones(4), None, None, torch.tensor([1, 2, 3, 4]))
    draws = torch.stack([sample_tokens(logits[:1].expand(4, -1), seeds_differ, torch.full((4,), p)) for p in range(50)])
    assert len(set(draws.flatten().tolist())) > 5  # different seeds and positions draw different tokens


def test_top_p_one_drops_nothing_beside_a_row_that_uses_top_p():
    """A row at top_p 1 keeps every token, also in a batch where another row's top_p makes a top_p tensor (the
    float32 running sum of its sorted probabilities can pass 1 and dropped the least likely tokens), so its seeded
    sample does not depend on the batch."""
    logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(12)) * 1.5
    assert not torch.isinf(apply_top_k_top_p(logits, None, torch.tensor([1.0]))).any()
    seed, pos = torch.tensor([2980520]), torch.tensor([9])
    alone = sample_tokens(logits, RowParams(torch.tensor([1.0]), None, None, seed), pos)
    batch = RowParams(torch.tensor([1.0, 1.0]), None, torch.tensor([1.0, 0.9]), seed.repeat(2))
    assert int(sample_tokens(logits.repeat(2, 1), batch, pos.repeat(2))[0]) == int(alone[0])


def test_sampled_frequencies_follow_softmax_with_top_k_and_top_p():
    vocab, n = 6, 20000
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.04, 0.01])).expand(n, vocab)
    rp = RowParams(torch.ones(n), torch.full((n,), 4), torch.full((n,), 0.9), torch.arange(n))
    freq = torch.bincount(sample_tokens(logits, rp, torch.zeros(n, dtype=torch.long)), minlength=vocab) / n
    # top-k 4 keeps 0.4, 0.3, 0.15, 0.1; top-p 0.9 then keeps 0.4 + 0.3 + 0.15 (0.85 < 0.9 needs 0.1 too)
    expect = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.0, 0.0]) / 0.95
    assert (freq - expect).abs().max() < 0.015, freq


def test_accepted_drafts_counts_leading_matches():
    target = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4]])
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 2, 3]])
    assert accepted_drafts(target, drafts, torch.tensor([3, 3, 2])).tolist() == [3, 1, 2]


def test_verification_by_seeded_sampling_is_speculative_sampling():
    """A deterministic drafter proposes token 2 everywhere: it is accepted with probability p(2), the first emitted
    token is distributed as p, and a rejected position yields p without the draft."""
    vocab, n = 6, 40000
    p = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(0)), -1)
    logits = torch.log(p).expand(n, vocab)
    rp = RowParams(torch.ones(n), None, None, torch.arange(n))
    first = sample_tokens(logits, rp, torch.zeros(n, dtype=torch.long))
    accepted = accepted_drafts(torch.stack([first, first], 1), torch.full((n, 1), 2), torch.ones(n, dtype=torch.long))
    assert abs(accepted.float().mean().item() - p[2].item()) < 0.01
    freq = torch.bincount(first, minlength=vocab).float() / n
    assert (freq - p).abs().max() < 0.01
    rejected = first[accepted == 0]
    expect = p.clone()
    expect[2] = 0
    assert (torch.bincount(rejected, minlength=vocab).float() / len(rejected) - expect / expect.sum()).abs().max() < 0.01


def reference_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[list[int], list[float]]:
    """Prompt lookup in plain Python, one request: the longest n first, then the most recent occurrence of the last
    n tokens that ends before the last token; the K tokens after it, the last token repeated past the end."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        hits = [s for s in range(length - n) if tokens[s : s + n] == tokens[length - n :]]
        if hits:
            found = tokens[hits[-1] + n : hits[-1] + n + k]
            pad = k - len(found)
            return found + [tokens[-1]] * pad, [NGRAM_MATCH_CONFIDENCE] * len(found) + [0.0] * pad
    return [tokens[-1]] * k, [0.0] * k


def batched(histories: list[list[int]], width: int, k: int, min_n: int, max_n: int, rng: random.Random):
    """propose_ngram over the histories padded to ``width`` with junk past each one's last token."""
    rows = [h + [rng.randrange(0, 6) for _ in range(width - len(h))] for h in histories]
    drafts, conf = propose_ngram(torch.tensor(rows), torch.tensor([len(h) - 1 for h in histories]), k, min_n, max_n)
    assert drafts.dtype == torch.int64 and conf.dtype == torch.float32 and drafts.shape == conf.shape == (len(rows), k)
    return drafts.tolist(), conf.tolist()


def test_ngram_drafter_matches_the_reference():
    """Random histories over a few tokens (many matches and ties), each with a planted repeat of one of its earlier
    segments at its end, a few shorter than n, every (min_n, max_n) in 1..5, K past the history's end."""
    rng = random.Random(5)
    for trial in range(60):
        histories = []
        for _ in range(rng.randint(1, 12)):
            h = [rng.randrange(0, rng.choice([3, 6, 50])) for _ in range(rng.randint(1, 30))]
            if len(h) > 2 and rng.random() < 0.7:
                start = rng.randrange(len(h) - 1)
                h += h[start : start + rng.randint(1, 6)]
            histories.append(h)
        width = max(map(len, histories)) + rng.randint(0, 4)
        k = rng.randint(1, 8)
        for min_n in range(1, 6):
            for max_n in range(min_n, 6):
                drafts, conf = batched(histories, width, k, min_n, max_n, rng)
                for h, d, c in zip(histories, drafts, conf):
                    want_d, want_c = reference_ngram(h, k, min_n, max_n)
                    assert d == want_d and c == pytest.approx(want_c), (trial, h, k, min_n, max_n)


def test_ngram_drafter_proposes_what_followed():
    rng = random.Random(0)
    drafts, conf = batched([[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [4]], 9, 3, 1, 3, rng)
    assert drafts[0] == [4, 5, 1] and conf[0] == pytest.approx([0.8] * 3)
    assert drafts[1] == [9, 9, 9] and conf[1] == [0.0] * 3  # no match: the last token, confidence 0
    assert drafts[2] == [4, 4, 4] and conf[2] == [0.0] * 3  # one token: nothing earlier
    # ties: the most recent occurrence of the longest n (vLLM's takes the earliest: 9, 1, 2)
    drafts, _ = batched([[1, 2, 9, 1, 2, 7, 1, 2]], 8, 3, 2, 2, rng)
    assert drafts[0] == [7, 1, 2]
    # the longest n wins over a more recent shorter one; K runs past the end: the last token, confidence 0
    drafts, conf = batched([[5, 6, 7, 8, 0, 7, 3, 6, 7]], 10, 4, 1, 3, rng)
    assert drafts[0] == [8, 0, 7, 3] and conf[0] == pytest.approx([0.8] * 4)
    drafts, conf = batched([[5, 6, 7, 5, 6]], 5, 4, 1, 3, rng)
    assert drafts[0] == [7, 5, 6, 6] and conf[0] == pytest.approx([0.8, 0.8, 0.8, 0.0])


def test_ngram_drafter_launches_the_same_few_ops_at_any_batch():
    """No per-request loop and no work that grows with the history on the host: the same ops (three per n-gram
    length) for 2 requests of 20 tokens and 256 of 2000, each a handful of device kernels."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] not in ("slice", "select", "view", "expand", "unsqueeze", "alias"):
                self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    counts = []
    for m, length, max_n in ((2, 20, 3), (256, 2000, 3), (256, 2000, 5)):
        history = torch.randint(0, 9, (m, length), generator=torch.Generator().manual_seed(m))
        with Count() as c:
            propose_ngram(history, torch.full((m,), length - 1), 4, 1, max_n)
        counts.append(len(c.ops))
    assert counts[0] == counts[1] and counts[2] == counts[1] + 2 * 3, counts  # (eq, and, add per n)
    assert counts[1] <= 30, counts
