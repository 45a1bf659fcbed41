import os

import pytest


# DELTASERVE_TEST_AS_CPU=avx2 runs the suite as on an AVX2-only CPU (AMD Zen 3): the CPU flags name no AVX-512
# or AMX (so only the avx2 kernels are executable and chosen), and oneDNN has no bf16 (torch's
# _is_mkldnn_bf16_supported is false there: weights the compiled linear cannot take stay on F.linear). Forcing
# --cpu-isa avx2 on an AVX-512 CPU is not the same: oneDNN keeps its bf16 paths. Servers the tests start in
# another process get the avx2 kernels (DELTASERVE_CPU_ISA) but keep this CPU's oneDNN.
AS_CPU = os.environ.get("DELTASERVE_TEST_AS_CPU", "")

# Each pytest-xdist worker gets its share of the cores: two workers of two threads each on two cores oversubscribe
# them, and OpenMP's spin-waits then take time from the other worker (the default suite on 2 cores: about 10% less
# time with one thread a worker). Set before torch loads; the servers the tests start inherit it. An explicit
# OMP_NUM_THREADS wins.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # Linux: ours
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // _WORKERS))


def pytest_configure(config):
    if AS_CPU in ("", "native"):
        return
    if AS_CPU != "avx2":
        raise pytest.UsageError(f"DELTASERVE_TEST_AS_CPU={AS_CPU!r}: the choices are avx2 and native")
    from deltaserve.model import qwen3_5
    from deltaserve.model.ops import cpu_kernels, fp8, packed

    base = {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "aes", "pclmulqdq", "xsave"}
    flags = frozenset(base | cpu_kernels.ISA_NEEDS["avx2"])
    for mod in (cpu_kernels, fp8):
        mod.cpu_flags = lambda flags=flags: flags
    for mod in (packed, qwen3_5):
        mod.can_prepack = lambda dtype, device: False
    os.environ["DELTASERVE_CPU_ISA"] = "avx2"


def pytest_report_header(config):
    return f"CPU as run: {AS_CPU or 'native'} (DELTASERVE_TEST_AS_CPU)"


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
