import jax
import pytest


def _has_gpu() -> bool:
    try:
        from jax_moelora import _ext

        return _ext.cuda_available()
    except Exception:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and the CUDA kernels")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
