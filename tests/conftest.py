import pytest

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
