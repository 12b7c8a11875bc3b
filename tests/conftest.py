import importlib.util

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_triton = pytest.mark.skip(reason="needs triton")
    has_triton = importlib.util.find_spec("triton") is not None
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if "triton" in item.keywords and not has_triton:
            item.add_marker(skip_triton)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
