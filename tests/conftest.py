import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("DELTASERVE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set DELTASERVE_SLOW=1 (make test-all)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
    gpu_skip = pytest.mark.skip(reason="needs a CUDA device")
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(gpu_skip)


@pytest.fixture(scope="session")
def fp8_tiny(tmp_path_factory):
    """The tiny preset written as a block-FP8 checkpoint (make-model --quantize fp8): the FP8 variants of the
    cache gates run on it."""
    from deltaserve.embedded.model import make_model

    return make_model("tiny", str(tmp_path_factory.mktemp("fp8") / "tiny-fp8"), quantize="fp8")
