"""The grids and plans reproduce SPEC section 3's acceptance figures exactly."""

import pytest

from dispatcher.plan import grids
from dispatcher.plan.config import resolve
from dispatcher.plan.capture_plan import FULL_DECODE, FULL_VARLEN, PIECEWISE, build_plan

SM100 = dict(platform="sm100", max_num_seqs=1024, max_num_batched_tokens=16384)


def target_set(plan, kind, q=None):
    (found,) = [g for g in plan.graph_sets if g.runner == "target" and g.kind == kind and (q is None or g.q == q)]
    return found


def test_prefill_grid_at_8192():
    g = grids.prefill_grid(8192)
    assert len(g) == 39
    assert g[:9] == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert g[9:-1] == tuple(range(512, 7681, 256))
    assert g[-1] == 8192


def test_decode_grid_at_1024():
    g = grids.decode_grid(1024)
    assert len(g) == 64
    assert g[:8] == (1, 2, 3, 4, 5, 6, 8, 10)
    assert g[-2:] == (992, 1024)


def test_cap_is_always_a_size():
    for cap in (1, 3, 100, 1000, 5000):
        assert grids.prefill_grid(cap)[-1] == cap
        assert grids.decode_grid(cap)[-1] == cap
        assert grids.av_grid(cap)[-1] == cap


def test_every_power_of_two_is_a_size():
    assert {1 << i for i in range(14)} <= set(grids.prefill_grid(8192))
    assert {1 << i for i in range(11)} <= set(grids.decode_grid(1024))


def test_eps_is_a_parameter():
    """A smaller padding bound gives a denser grid; a larger one a coarser grid."""
    assert len(grids.prefill_grid(8192, eps=0.01)) > 39 > len(grids.prefill_grid(8192, eps=0.1))
    assert len(grids.decode_grid(1024, eps=0.03)) > 64 > len(grids.decode_grid(1024, eps=0.2))


@pytest.mark.parametrize("k,count,largest", [(0, 64, 1024), (1, 64, 1024), (2, 64, 1024), (3, 64, 1024),
                                             (5, 53, 672), (7, 48, 512), (15, 37, 256)])
def test_target_full_decode_within_budget(k, count, largest):
    spec = {"method": "eagle3", "num_speculative_tokens": k} if k else None
    plan = build_plan(resolve({}, spec, **SM100))
    dec = target_set(plan, FULL_DECODE, 1 + k)
    assert (len(dec.sizes), dec.largest) == (count, largest)
    assert all(n * (1 + k) <= 4096 for n in dec.sizes)


def test_target_piecewise_39_sizes():
    pw = target_set(build_plan(resolve({}, None, **SM100)), PIECEWISE)
    assert (len(pw.sizes), pw.largest) == (39, 8192)


def test_interactivity_gives_65_piecewise_sizes():
    pw = target_set(build_plan(resolve({"interactivity": True}, None, **SM100)), PIECEWISE)
    assert len(pw.sizes) == 65
    assert set(range(1, 33)) <= set(pw.sizes)


def test_adaptive_verification_grid_k5():
    spec = {"method": "dspark", "num_speculative_tokens": 5, "adaptive_verification": True}
    av = target_set(build_plan(resolve({}, spec, **SM100)), FULL_VARLEN)
    assert (len(av.sizes), av.largest) == (64, 6144)
    assert av.sizes[:12] == (1, 2, 4, 8, 10, 12, 14, 16, 20, 24, 28, 32)


def test_legacy_list_and_decode_reach():
    tokens = grids.legacy_token_list(1024)
    assert len(tokens) == 83
    reach = {k: max(grids.legacy_decode_sizes(tokens, 1 + k)) for k in (0, 1, 2, 3, 5, 7)}
    assert reach == {0: 1024, 1: 512, 2: 336, 3: 256, 5: 168, 7: 128}


def test_legacy_field_reproduces_main():
    """max_cudagraph_capture_size 1024 on sm100: 83 PIECEWISE sizes, decode 128 requests at K = 7, no budget."""
    cfg = resolve({"max_cudagraph_capture_size": 1024}, {"method": "eagle", "num_speculative_tokens": 7}, **SM100)
    plan = build_plan(cfg)
    assert len(target_set(plan, PIECEWISE).sizes) == 83
    assert target_set(plan, FULL_DECODE, 8).largest == 128
    assert cfg.max_decode_tokens is None
    assert any("deprecated" in w for w in cfg.warnings)


def test_default_platform_keeps_legacy_defaults():
    """Off sm100 the defaults are main's: 51 PIECEWISE sizes to 512; K=3: 49 to 128; K=7: 48 to 64."""
    base = dict(platform="default", max_num_seqs=1024, max_num_batched_tokens=8192)
    plan = build_plan(resolve({}, {"method": "eagle3", "num_speculative_tokens": 3}, **base))
    assert (len(target_set(plan, PIECEWISE).sizes), target_set(plan, PIECEWISE).largest) == (51, 512)
    dec = target_set(plan, FULL_DECODE, 4)
    assert (len(dec.sizes), dec.largest) == (49, 128)
    dec = target_set(build_plan(resolve({}, {"method": "eagle3", "num_speculative_tokens": 7}, **base)), FULL_DECODE, 8)
    assert (len(dec.sizes), dec.largest) == (48, 64)
