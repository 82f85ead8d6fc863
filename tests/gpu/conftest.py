"""GPU checks: correctness on real CUDA devices, run on a GPU machine with `pytest -m gpu tests/gpu`.

Every test here is marked `gpu` and skips where torch sees no CUDA device (CI, laptops). What needs several GPUs
asks for them with the `gpus` fixture's count and skips on smaller machines."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest's hook signature
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)


def cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="session")
def gpus() -> int:
    """How many CUDA devices this machine has (the test skips where there is none)."""
    count = cuda_count()
    if count == 0:
        pytest.skip("needs a CUDA device")
    return count


@pytest.fixture(scope="session")
def several_gpus(gpus: int) -> int:
    if gpus < 2:
        pytest.skip("needs two or more CUDA devices")
    return gpus


@pytest.fixture(scope="module")
def no_tf32():
    """fp32 means fp32 for the comparisons: TF32 matmuls and cuDNN's TF32 convolutions alone differ by ~1e-3 between
    two call shapes (torch's defaults are restored afterwards)."""
    import torch

    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def frees_cuda_memory():
    """For a test that fills most of a GPU: at its teardown, passed or failed, the CUDA memory it left goes back to
    the driver, so later tests of the same process are not starved. pytest keeps a failed test's traceback
    (`sys.last_traceback`, for post-mortem debugging) and with it every frame's locals, tensors among them: those
    frames are cleared first."""
    yield
    import gc
    import sys
    import traceback

    import torch

    failed = getattr(sys, "last_traceback", None)
    if failed is not None:
        traceback.clear_frames(failed)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
