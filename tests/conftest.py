import os

import pytest
from hypothesis import settings

# CI runs the same examples every time (a submission must not fail on a newly drawn example); set
# HYPOTHESIS_PROFILE=explore (or run locally) to draw new ones.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "explore"))

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # the planning and scheduling tests need no torch
    HAS_CUDA = False


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter runs the kernels on the CPU (tests/test_kernels_interpreted.py sets it for a subprocess)."""


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_kernels = pytest.mark.skip(reason="needs a CUDA GPU or TRITON_INTERPRET=1 (tests/test_kernels_interpreted.py)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        elif "kernels" in item.keywords and not INTERPRETED:
            item.add_marker(skip_kernels)
