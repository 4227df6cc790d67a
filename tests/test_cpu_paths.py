"""The CPU forward's shortcuts give the general path's values: rotary in place, K and V stored in one op, attention
over a lone request's consecutive cache slots read as a slice, and the argmax over bfloat16 logits taken in
float32."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_rotary_in_place_is_the_rotary_call():
    from models.layers import RotaryEmbedding

    rotary = RotaryEmbedding(64, 512, 10000.0)
    positions = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(1))
    rows = rotary.at(positions)
    for dtype in (torch.bfloat16, torch.float32):
        qkv = torch.randn(7, 16 * 64, generator=torch.Generator().manual_seed(2)).to(dtype)
        heads = qkv[:, :12 * 64].view(7, 12, 64)  # a view of the rows, as a forward's q and k are
        want = rows(positions, heads)
        rows.rotate_(heads)
        assert torch.equal(heads, want)


def test_kv_rows_are_stored_as_write_kv_stores_them():
    from models.attention import write_kv, write_kv_rows

    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(5, 2 * 2 * 16, generator=gen).to(torch.bfloat16)  # (tokens, K then V of 2 heads of 16)
    slots = torch.tensor([3, 17, -1, 0, 9])  # -1: a padded row, sent to the dummy block's last slot
    want = torch.zeros(2, 4, 8, 2, 16, dtype=torch.bfloat16)
    write_kv(want, kv[:, :32].view(5, 2, 16), kv[:, 32:].view(5, 2, 16), slots)
    got = torch.zeros_like(want)
    write_kv_rows(got, kv, slots)
    assert torch.equal(got, want)


@pytest.mark.parametrize("consecutive", [True, False])
def test_a_lone_requests_consecutive_slots_are_read_as_a_slice(consecutive):
    from models.attention import paged_attention, reference_paged_attention
    from models.attention_metadata import AttentionMetadata

    block, heads, kv_heads, dim, context = 8, 6, 2, 16, 29
    gen = torch.Generator().manual_seed(4)
    kv = torch.randn(2, 17, block, kv_heads, dim, generator=gen)
    blocks = torch.arange(3, 7) if consecutive else torch.tensor([5, 2, 9, 4])
    table = torch.full((2, 6), -1, dtype=torch.int32)
    table[1, :4] = blocks.int()
    pos = torch.tensor([context - 1])
    slots = blocks[pos // block] * block + pos % block
    meta = AttentionMetadata.from_tokens(slots, torch.tensor([1]), pos, table)
    q = torch.randn(1, heads, dim, generator=gen)
    got = paged_attention(q, kv, meta, dim ** -0.5)
    assert (meta.cpu_plan.first_slot is not None) == consecutive
    torch.testing.assert_close(got, reference_paged_attention(q, kv, meta, dim ** -0.5), rtol=1e-5, atol=1e-5)


def test_the_cpu_argmax_is_torchs_on_bfloat16():
    from models.fused import argmax_prob

    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    logits[1, 10] = logits[1, 700] = 50.0  # a tie: the first one wins, as torch.argmax has it
    ids, prob = argmax_prob(logits[:, :999])  # a view with rows apart, as the LM head's sliced logits are
    assert torch.equal(ids, logits[:, :999].argmax(dim=-1)) and int(ids[1]) == 10
    torch.testing.assert_close(prob, torch.softmax(logits[:, :999].float(), -1).max(-1).values)
    logits[2, 20] = logits[2, 30] = float("nan")  # NaN counts as a maximum, the first one
    logits[0] = float("-inf")
    ids, _ = argmax_prob(logits, with_prob=False)
    assert ids.dtype == torch.int64 and torch.equal(ids, logits.argmax(dim=-1)) and ids.tolist() == [0, 10, 20]


@pytest.mark.parametrize("consecutive", [True, False])
def test_a_lone_tokens_plan_is_the_general_plan(consecutive, monkeypatch):
    from models.attention import _CPUPlan, paged_attention
    from models.attention_metadata import AttentionMetadata

    block, context = 8, 21
    blocks = torch.tensor([7, 8, 9]) if consecutive else torch.tensor([4, 1, 6])
    table = torch.full((3, 5), -1, dtype=torch.int32)
    table[2, :3] = blocks.int()
    pos = torch.tensor([context - 1])
    meta = AttentionMetadata.from_tokens(blocks[pos // block] * block + pos % block, torch.tensor([2]), pos, table)
    got = _CPUPlan.build(meta, block)
    monkeypatch.setattr(_CPUPlan, "_lone_token", classmethod(lambda cls, meta, block_size: None))
    want = _CPUPlan.build(meta, block)
    for name in ("q_index", "q_valid", "rows", "pad_rows", "k_slots"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (got.mask, got.in_order, got.first_slot) == (want.mask, want.in_order, want.first_slot)
    assert (got.first_slot is not None) == consecutive
    # and the decode path's output is the general in-order path's, in bfloat16 as served
    gen = torch.Generator().manual_seed(6)
    kv = torch.randn(2, 11, block, 2, 16, generator=gen).to(torch.bfloat16)
    q = torch.randn(1, 6, 16, generator=gen).to(torch.bfloat16)
    meta.cpu_plan = got
    fast = paged_attention(q, kv, meta, 0.25)
    got.first_slot = None  # the gathered path
    assert torch.equal(fast, paged_attention(q, kv, meta, 0.25))
