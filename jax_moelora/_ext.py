"""The compiled extension: FFI target registration and shared constants.

Every constant the kernels are compiled with is read from here (it comes from
``ffi_src/moelora_constants.h`` through ``jax_moelora._moelora``); Python never
keeps a copy of its own.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import sys
from types import ModuleType
from typing import Any

import jax


def _load_extension() -> ModuleType:
    """Import the compiled module; from a source checkout (``python -m
    jax_moelora`` in the repository root shadows the installed package),
    load the one ``pip install .`` put in site-packages."""
    try:
        from jax_moelora import _moelora

        return _moelora
    except ImportError as err:
        try:
            files = importlib.metadata.distribution("jax_moelora").files or []
        except importlib.metadata.PackageNotFoundError:
            files = []
        for f in files:
            if f.name.startswith("_moelora.") and f.parent.name == "jax_moelora":
                spec = importlib.util.spec_from_file_location("jax_moelora._moelora",
                                                              f.locate())
                if spec is None or spec.loader is None:
                    continue
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                sys.modules["jax_moelora._moelora"] = module
                return module
        raise ImportError("jax_moelora's compiled extension is missing: install the package "
                          "with `pip install --no-build-isolation .` (see README)") from err


ext = _load_extension()

MLG_M_TILE: int = ext.MLG_M_TILE
GBGMV_THREADS: int = ext.GBGMV_THREADS
GBGMV_N_PER_BLOCK: int = ext.GBGMV_N_PER_BLOCK
GBGMV_THREADS_PER_OUTPUT: int = ext.GBGMV_THREADS_PER_OUTPUT
RANK_ALIGN: int = ext.RANK_ALIGN
MAX_RANK: int = ext.MAX_RANK
VARIANT_SEED: int = ext.VARIANT_SEED
VARIANT_FAST: int = ext.VARIANT_FAST
GATHER_BGMV_TARGET: str = ext.GATHER_BGMV_TARGET
GROUPED_DOWN_TARGET: str = ext.GROUPED_DOWN_TARGET
HAS_CUDA: bool = ext.HAS_CUDA
EXPERT_MATMUL_TARGET: str = ext.EXPERT_MATMUL_TARGET
EXPERT_MATMUL_ALIGN: int = ext.EXPERT_MATMUL_ALIGN
EXPERT_MATMUL_SCRATCH_ALIGN: int = ext.EXPERT_MATMUL_SCRATCH_ALIGN
EXPERT_MATMUL_MAX_WEIGHTS: int = ext.EXPERT_MATMUL_MAX_WEIGHTS
# The CUTLASS grouped GEMM kernel was built (CUDA and the CUTLASS headers found).
HAS_EXPERT_MATMUL: bool = ext.HAS_EXPERT_MATMUL


@functools.cache
def register() -> tuple[str, ...]:
    """Register every FFI target the extension holds; returns the platforms."""
    platforms = ext.registrations()
    for platform, targets in platforms.items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return tuple(platforms)


def current_platform() -> str:
    """The platform new computations go to: the ``jax.default_device``
    context's when one is set, else JAX's default backend (``"cpu"``,
    ``"gpu"``, ...)."""
    dev = jax.config.jax_default_device
    if dev is not None:
        platform = dev if isinstance(dev, str) else dev.platform
        return "gpu" if platform in ("cuda", "rocm") else platform
    return jax.default_backend()


def cuda_available() -> bool:
    """True when the CUDA kernels were built and computations go to a GPU."""
    return HAS_CUDA and current_platform() == "gpu"


def backends() -> dict[str, Any]:
    """What was built and registered.

    Returns a dict with ``platforms`` (the FFI platforms with handlers),
    ``cuda_kernels`` (bool), ``cuda_architectures``, ``xla_ffi_api``
    (the FFI API version the extension was built against), ``MLG_M_TILE``,
    ``default_backend`` (JAX's), and ``impls`` (the fold backends usable now).
    """
    platforms = register()
    impls = ["jnp"]
    backend = current_platform()
    if backend == "cpu":
        impls.insert(0, "cpu")
    if cuda_available():
        impls[:0] = ["fast", "seed"]
    return {
        "platforms": list(platforms),
        "cuda_kernels": HAS_CUDA,
        "cuda_architectures": ext.CUDA_ARCHITECTURES,
        "xla_ffi_api": tuple(ext.XLA_FFI_API_VERSION),
        "MLG_M_TILE": MLG_M_TILE,
        "expert_matmul_kernel": HAS_EXPERT_MATMUL,
        "default_backend": backend,
        "impls": impls,
    }
