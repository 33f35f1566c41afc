"""The compiled extension: FFI target registration and shared constants.

Every constant the kernels are compiled with is read from here (it comes from
``ffi_src/moelora_constants.h`` through ``jax_moelora._moelora``); Python never
keeps a copy of its own.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from jax_moelora import _moelora as ext

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


@functools.cache
def register() -> tuple[str, ...]:
    """Register every FFI target the extension holds; returns the platforms."""
    platforms = ext.registrations()
    for platform, targets in platforms.items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return tuple(platforms)


def cuda_available() -> bool:
    """True when the CUDA kernels were built and JAX's default backend is a GPU."""
    return HAS_CUDA and jax.default_backend() == "gpu"


def backends() -> dict[str, Any]:
    """What was built and registered.

    Returns a dict with ``platforms`` (the FFI platforms with handlers),
    ``cuda_kernels`` (bool), ``cuda_architectures``, ``xla_ffi_api``
    (the FFI API version the extension was built against), ``MLG_M_TILE``,
    ``default_backend`` (JAX's), and ``impls`` (the fold backends usable now).
    """
    platforms = register()
    impls = ["jnp"]
    backend = jax.default_backend()
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
        "default_backend": backend,
        "impls": impls,
    }
