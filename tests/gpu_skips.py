"""On the GPU machine a GPU test that skips fails instead, naming the skip's reason, where the GPU scripts ask for
it (``TWOGRID_GPU_NO_SKIPS=1``, set by scripts/gpu_session.sh and scripts/gpu_check.sh): a skipped test is not a
passing test (the default model's GPU test skipped on the device for two rounds because its GGUF never travelled,
and the runs read as green). A test whose skip on a GPU is its design (a second GPU it needs, a path only the CPU
runs) carries ``@pytest.mark.gpu_skip_ok``."""

from __future__ import annotations

import os

ENV = "TWOGRID_GPU_NO_SKIPS"


def enabled(has_cuda: bool) -> bool:
    return has_cuda and os.environ.get(ENV) == "1"


def skip_as_failure(report, keywords) -> None:
    """Turn ``report`` (a test phase's, as ``pytest_runtest_makereport`` makes it) into a failure where it is a GPU
    or kernels test's skip that is not marked ``gpu_skip_ok``."""
    if not report.skipped or hasattr(report, "wasxfail") or "gpu_skip_ok" in keywords:
        return
    if "gpu" not in keywords and "kernels" not in keywords:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"a GPU test skipped on the GPU ({ENV}=1 makes that a failure): {reason}"
