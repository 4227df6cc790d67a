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


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
