"""The step layout's arithmetic in the forms the hot path computes it (views of constant buffers, fewer launches),
each against its plain definition: padded requests' query starts in a FULL graph, accepted drafts."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from dispatcher.runtime.graphs import GraphRuntime  # noqa: E402
from models.sampling import accepted_drafts  # noqa: E402


def test_padded_starts_equal_the_old_clamp_for_every_shape():
    """``GraphRuntime._padded_starts`` (views of ``_counts``) = the old ``clamp(j * max_query_len + n, max=num_tokens)``
    for j = 1..k with the last set to num_tokens, for every n, k, max_query_len, num_tokens up to 20."""
    rt = object.__new__(GraphRuntime)
    for num_tokens in range(1, 21):
        rt._counts = torch.arange(num_tokens + 1)  # (as short as the runtime's may be: max_num_tokens + 1)
        for n, k, mql in itertools.product(range(num_tokens + 1), range(1, 9), range(1, num_tokens + 2)):
            new = torch.cat(rt._padded_starts(n, k, mql, num_tokens))
            old = torch.clamp(torch.arange(1, k + 1) * mql + n, max=num_tokens)
            old[-1] = num_tokens
            assert torch.equal(new, old), (num_tokens, n, k, mql, new, old)


def test_accepted_drafts_equal_the_masked_cumprod():
    """min(leading matches, num_drafts) = the old cumprod of the matches masked to each row's drafts, dtype included."""
    g = torch.Generator().manual_seed(0)
    for k in range(1, 6):
        target = torch.randint(0, 3, (400, k + 1), generator=g)
        drafts = torch.randint(0, 3, (400, k), generator=g)
        nd = torch.randint(0, k + 1, (400,), generator=g)
        valid = torch.arange(k)[None, :] < nd[:, None]
        old = torch.cumprod(((target[:, :k] == drafts) & valid).long(), dim=1).sum(dim=1)
        new = accepted_drafts(target, drafts, nd)
        assert new.dtype == old.dtype == torch.int64 and torch.equal(new, old)
