"""Sampling, verification and the n-gram drafter."""

import pytest

torch = pytest.importorskip("torch")

from models.drafters import NgramDrafter  # noqa: E402
from models.sampling import apply_top_k_top_p, sample, verify_greedy, verify_rejection  # noqa: E402


def test_top_k_and_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.isfinite(apply_top_k_top_p(logits, 2, 1.0)).tolist() == [[True, True, False, False, False]]
    # top-p 0.6 keeps the smallest prefix reaching 0.6: 0.5 + 0.2
    assert torch.isfinite(apply_top_k_top_p(logits, 0, 0.6)).tolist() == [[True, True, False, False, False]]
    assert torch.isfinite(apply_top_k_top_p(logits, 0, 0.4)).tolist() == [[True, False, False, False, False]]


def test_greedy_and_seeded_sampling():
    logits = torch.randn(4, 50)
    assert torch.equal(sample(logits), logits.argmax(-1))
    a = sample(logits, 1.0, generator=torch.Generator().manual_seed(3))
    b = sample(logits, 1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert torch.equal(sample(logits, 1.0, top_k=1), logits.argmax(-1))


def test_verify_greedy_counts_leading_matches():
    target = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4]])
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 2, 3]])
    assert verify_greedy(target, drafts, torch.tensor([3, 3, 2])).tolist() == [3, 1, 2]


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(with_q):
    """The first emitted token is distributed as the target's p, whatever the drafter proposed."""
    gen = torch.Generator().manual_seed(0)
    vocab, n = 6, 40000
    p = torch.softmax(torch.randn(vocab, generator=gen), -1)
    q_dist = torch.softmax(torch.randn(vocab, generator=gen), -1)
    if with_q:
        drafts = torch.multinomial(q_dist, n, replacement=True, generator=gen).view(n, 1)
        q = q_dist.expand(n, 1, vocab)
    else:
        drafts = torch.full((n, 1), 2)  # a deterministic drafter always proposes token 2
        q = None
    probs = p.expand(n, 2, vocab)
    tokens, accepted = verify_rejection(probs, drafts, torch.ones(n, dtype=torch.long), q, gen)
    first = tokens[:, 0]
    freq = torch.bincount(first, minlength=vocab).float() / n
    assert (freq - p).abs().max() < 0.01, (freq, p)
    if not with_q:
        assert abs(accepted.float().mean().item() - p[2].item()) < 0.01


def test_ngram_drafter_proposes_what_followed():
    drafter = NgramDrafter(3)
    drafts, conf = drafter.propose([[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9]], 3)
    assert drafts[0].tolist() == [4, 5, 1] and conf[0].tolist() == [0.8, 0.8, 0.8]
    assert drafts[1].tolist() == [9, 9, 9] and conf[1].tolist() == [0.0, 0.0, 0.0]  # no match: repeat, confidence 0
