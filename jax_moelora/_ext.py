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
from jaxlib import xla_client


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
VARIANT_SIMPLE: int = ext.VARIANT_SIMPLE
VARIANT_FAST: int = ext.VARIANT_FAST
# The gather fold's x layouts (its `x_gather` attribute): flat rows, tokens,
# the dense expert layout of the outputs.
X_ROWS: int = ext.X_ROWS
X_TOKENS: int = ext.X_TOKENS
X_DENSE: int = ext.X_DENSE
GATHER_BGMV_TARGET: str = ext.GATHER_BGMV_TARGET
GROUPED_DOWN_TARGET: str = ext.GROUPED_DOWN_TARGET
HAS_CUDA: bool = ext.HAS_CUDA
EXPERT_MATMUL_TARGET: str = ext.EXPERT_MATMUL_TARGET
EXPERT_MATMUL_ALIGN: int = ext.EXPERT_MATMUL_ALIGN
EXPERT_MATMUL_SCRATCH_ALIGN: int = ext.EXPERT_MATMUL_SCRATCH_ALIGN
EXPERT_MATMUL_MAX_WEIGHTS: int = ext.EXPERT_MATMUL_MAX_WEIGHTS
# expert_matmul's CUTLASS kernel schedules (its `schedule` attribute).
EXPERT_MATMUL_COOPERATIVE: int = ext.EXPERT_MATMUL_COOPERATIVE
EXPERT_MATMUL_PINGPONG: int = ext.EXPERT_MATMUL_PINGPONG
# The CUTLASS grouped GEMM kernel was built (CUDA and the CUTLASS headers found).
HAS_EXPERT_MATMUL: bool = ext.HAS_EXPERT_MATMUL
# grouped_matmul (the backward's grouped GEMMs): target, operand sets a call
# takes, and its `mode` attribute's values.
GROUPED_MATMUL_TARGET: str = ext.GROUPED_MATMUL_TARGET
GROUPED_MATMUL_MAX_SETS: int = ext.GROUPED_MATMUL_MAX_SETS
GMM: int = ext.GMM
GMM_RHS_T: int = ext.GMM_RHS_T
TGMM: int = ext.TGMM
TGMM_ROUNDED: int = ext.TGMM_ROUNDED


@functools.cache
def register() -> tuple[str, ...]:
    """Register every FFI target the extension holds; returns the platforms.

    The CUDA targets are registered command-buffer compatible, as their C++
    handlers declare (``kCmdBufferCompatible``: no allocation, no host sync,
    every launch on XLA's stream). The trait the handler symbols carry is not
    read through this registration path, so without it here XLA would launch
    every fold from the host, outside its CUDA graphs."""
    platforms = ext.registrations()
    for platform, targets in platforms.items():
        traits = (xla_client.CustomCallTargetTraits.DEFAULT if platform == "cpu"
                  else xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE)
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform, traits=traits)
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


def gpu_devices() -> list[str]:
    """The GPUs JAX sees (``[]`` when its GPU backend is absent or finds none)."""
    try:
        return [str(d) for d in jax.devices("gpu")]
    except RuntimeError:
        return []


def cuda_available() -> bool:
    """True when the CUDA kernels were built and computations go to a GPU."""
    return HAS_CUDA and current_platform() == "gpu"


def backends() -> dict[str, Any]:
    """``jax_moelora.backends()``: the registry's report (``ops/backend.py``)."""
    from jax_moelora.ops.backend import backends as report

    return report()
