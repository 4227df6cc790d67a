"""``TWOGRID_GPU_NO_SKIPS=1`` on a GPU machine (tests/gpu_skips.py): a GPU or kernels test that skips fails, naming
why it skipped; a skip marked ``gpu_skip_ok``, an expected failure and any other test's skip stay as they are; off
the GPU, or without the variable, nothing changes."""

from __future__ import annotations

import types

import gpu_skips


def _report(skipped=True, reason="Skipped: the default model is not available", **more):
    return types.SimpleNamespace(skipped=skipped, outcome="skipped" if skipped else "passed",
                                 longrepr=("tests/x.py", 3, reason) if skipped else None, **more)


def test_a_gpu_tests_skip_fails_with_its_reason():
    for marks in ({"gpu"}, {"kernels"}):
        report = _report()
        gpu_skips.skip_as_failure(report, marks)
        assert report.outcome == "failed"
        assert "the default model is not available" in report.longrepr and gpu_skips.ENV in report.longrepr


def test_skips_by_design_other_tests_and_passes_are_left_alone():
    for report, marks in ((_report(), {"gpu", "gpu_skip_ok"}), (_report(), {"slow"}),
                          (_report(wasxfail="known"), {"gpu"}), (_report(skipped=False), {"gpu"})):
        before = (report.outcome, report.longrepr)
        gpu_skips.skip_as_failure(report, marks)
        assert (report.outcome, report.longrepr) == before


def test_only_on_a_gpu_and_only_when_asked(monkeypatch):
    monkeypatch.delenv(gpu_skips.ENV, raising=False)
    assert not gpu_skips.enabled(True)
    monkeypatch.setenv(gpu_skips.ENV, "1")
    assert gpu_skips.enabled(True) and not gpu_skips.enabled(False)
