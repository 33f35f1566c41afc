"""Which kernels run: the one place that decides it, for every op.

A backend choice has two parts, kept apart:

- the **platform** a computation is lowered for (``"cpu"``, ``"cuda"`` or
  another). With ``impl="auto"`` XLA decides at lowering
  (:func:`per_platform`, ``jax.lax.platform_dependent``): one function
  lowered for several platforms gets each one's kernels, whatever the
  default device. An explicit ``impl`` pins its kernels and is checked at
  trace time against the platform computations go to (:func:`check_impl`).
- the **kernels** on that platform. For the folds, ``impl`` names the kernel
  family: ``"fast"`` (the tuned CUDA kernels), ``"simple"`` (CUDA kernels
  with the simple launch geometry of ``docs/semantics.md`` §4: a shrink into
  ``xa``, then an expand-and-fold), ``"cpu"`` (the C++ handlers), ``"jnp"``
  (pure JAX, any platform). The other ops follow from the platform and their
  operands (:data:`KERNELS`). ``impl="seed"``, the old name of ``"simple"``,
  is a deprecated alias (:data:`DEPRECATED_IMPLS`).

================================  ==========================  ===========================================  ==================
op                                lowered for CPU             lowered for CUDA                             any other platform
================================  ==========================  ===========================================  ==================
folds (``moe_lora_*``)            C++ handlers (``"cpu"``)    tuned CUDA kernels (``"fast"``)              jnp
the folds' backward               jnp (dense or tiled)        grouped GEMMs where :func:`cutlass_takes`     jnp
``expert_matmul``'s GEMM          ``ragged_dot``, fp32        CUTLASS where :func:`cutlass_takes`          ``ragged_dot``
its backward                      ``ragged_dot``'s VJP        grouped GEMMs where its CUTLASS GEMM runs     ``ragged_dot``'s VJP
``MoEBlock``'s grouped GEMM       ``ragged_dot``              ``expert_matmul`` where its kernel runs      ``ragged_dot``
``take_rows``                     ``x[ids]``                  32-bit words (bf16/f16, even ``K``)          ``x[ids]``
================================  ==========================  ===========================================  ==================

:func:`backends` (``python -m jax_moelora info``) reads the same table.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jax_moelora import _ext

__all__ = ["IMPLS", "DEPRECATED_IMPLS", "AUTO", "KERNELS", "FFI_VARIANT", "check_impl",
           "resolve_impl", "per_platform", "cutlass_built", "cutlass_takes", "gpu_now", "backends"]

#: The fold backends ``impl=`` names.
IMPLS = ("auto", "fast", "simple", "cpu", "jnp")
#: Old fold backend names still accepted, each with the name it runs as:
#: :func:`check_impl` warns (``DeprecationWarning``) and returns the new name.
DEPRECATED_IMPLS = {"seed": "simple"}
#: What ``impl="auto"`` runs, by the platform the computation is lowered for
#: (``"jnp"`` on any other; CUDA only when the CUDA kernels were built).
AUTO = {"cpu": "cpu", "cuda": "fast"}
#: The kernels of each op by lowering platform (the module docstring's table).
KERNELS: dict[str, dict[str, str]] = {
    "folds": {"cpu": "C++ handlers", "cuda": "fast CUDA kernels", "other": "jnp"},
    "fold backward": {"cpu": "jnp (dense or tiled)", "cuda": "grouped GEMMs (CUTLASS)",
                      "other": "jnp (dense or tiled)"},
    "expert_matmul": {"cpu": "ragged_dot (fp32)", "cuda": "CUTLASS grouped GEMM",
                      "other": "ragged_dot (fp32)"},
    "expert_matmul backward": {"cpu": "ragged_dot VJP", "cuda": "grouped GEMMs (CUTLASS)",
                               "other": "ragged_dot VJP"},
    "MoEBlock grouped GEMM": {"cpu": "ragged_dot", "cuda": "expert_matmul",
                              "other": "ragged_dot"},
    "take_rows": {"cpu": "x[ids]", "cuda": "32-bit words", "other": "x[ids]"},
}
#: The custom calls' ``variant`` attribute of each FFI backend (the C++
#: handlers run one loop whatever its value).
FFI_VARIANT = {"fast": _ext.VARIANT_FAST, "simple": _ext.VARIANT_SIMPLE,
               "cpu": _ext.VARIANT_SIMPLE}


def gpu_now() -> bool:
    """The CUDA kernels were built and computations go to a GPU now (the
    default device, or a ``jax.default_device`` context's)."""
    return _ext.cuda_available()


def check_impl(impl: str) -> str:
    """``impl`` checked at trace time: a known name, and an explicit backend
    that runs where computations go now. ``"auto"`` is returned as is (decided
    at lowering by :func:`per_platform`). The one place a fold's ``impl`` is
    validated: a deprecated name (:data:`DEPRECATED_IMPLS`, ``"seed"``) warns
    and is checked and returned as its new name (``"simple"``).

    Raises:
      ValueError: ``impl`` is not one of :data:`IMPLS` (or
        :data:`DEPRECATED_IMPLS`), or names a backend that cannot run on the
        platform computations go to.
    """
    if isinstance(impl, str) and impl in DEPRECATED_IMPLS:
        new = DEPRECATED_IMPLS[impl]
        warnings.warn(f"impl={impl!r} is deprecated; use impl={new!r} (the same kernels)",
                      DeprecationWarning, stacklevel=3)
        impl = new
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    backend = _ext.current_platform()
    if impl in ("fast", "simple") and not gpu_now():
        why = ("the extension was built without CUDA (no nvcc at build time)" if not _ext.HAS_CUDA
               else f"computations go to {backend!r}, not 'gpu'")
        raise ValueError(f"impl={impl!r} needs the CUDA kernels on a GPU: {why}")
    if impl == "cpu" and backend != "cpu":
        raise ValueError(f"impl='cpu' runs the C++ handlers on the CPU; computations go to "
                         f"{backend!r} (use `with jax.default_device(jax.devices('cpu')[0])`)")
    return impl


def resolve_impl(impl: str) -> str:
    """The concrete backend ``impl`` names for computations on the platform
    they go to now (``"auto"``: :data:`AUTO`'s choice there), checked as
    :func:`check_impl` does."""
    impl = check_impl(impl)
    if impl != "auto":
        return impl
    if gpu_now():
        return AUTO["cuda"]
    return AUTO["cpu"] if _ext.current_platform() == "cpu" else "jnp"


def per_platform(*args: Any, cpu: Callable, cuda: Callable | None, default: Callable) -> Any:
    """``branch(*args)`` for the platform the computation is lowered for: the
    one place the library calls ``jax.lax.platform_dependent``. ``cuda=None``:
    CUDA takes ``default`` (the CUDA kernels were not built)."""
    branches = {"cpu": cpu}
    if cuda is not None:
        branches["cuda"] = cuda
    return jax.lax.platform_dependent(*args, default=default, **branches)


@functools.cache
def cutlass_built() -> bool:
    """The CUTLASS kernels (``expert_matmul``, ``grouped_matmul``) were built
    and the first GPU is a Hopper (sm_90): what a computation lowered for CUDA
    can run."""
    if not (_ext.HAS_EXPERT_MATMUL and _ext.HAS_CUDA):
        return False
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return False
    return bool(gpus) and str(getattr(gpus[0], "compute_capability", "")) == "9.0"


def cutlass_takes(dtype: Any, *dims: int) -> bool:
    """The CUTLASS kernels are built (:func:`cutlass_built`) and take operands
    of ``dtype`` (bf16 or f16) whose ``K`` and ``N`` are ``dims`` (multiples of
    ``EXPERT_MATMUL_ALIGN``)."""
    return (cutlass_built() and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and all(d % _ext.EXPERT_MATMUL_ALIGN == 0 for d in dims))


def backends() -> dict[str, Any]:
    """What was built, what JAX sees, and which fold backends can run now.

    Returns a dict with:

    - ``gpu_visible`` (bool) and ``gpus`` (JAX's GPU devices);
    - ``default_backend``: where computations go now (JAX's default backend,
      or the ``jax.default_device`` context's platform);
    - ``ffi_platforms_built``: the platforms the extension holds handlers for
      (``"cpu"``, and ``"CUDA"`` when the kernels were compiled);
    - ``ffi_platforms_usable``: those that can run on this machine now
      (``"CUDA"`` only with a visible GPU);
    - ``cuda_kernels_built``, ``cuda_kernels_usable`` (bool), ``cuda_architectures``;
    - ``impls``: the fold backends that run on the default backend now, and
      ``auto``: the one ``impl="auto"`` runs there (:data:`AUTO`);
    - ``kernels``: :data:`KERNELS`, each op's kernels by lowering platform;
    - ``expert_matmul_kernel``: the CUTLASS kernels were built;
    - ``xla_ffi_api`` (the FFI API version the extension was built against)
      and ``MLG_M_TILE``.
    """
    platforms = _ext.register()
    gpus = _ext.gpu_devices()
    backend = _ext.current_platform()
    usable = [p for p in platforms if p == "cpu" or (p == "CUDA" and gpus)]
    impls = [i for i in IMPLS[1:] if _runs_now(i)]
    return {
        "gpu_visible": bool(gpus),
        "gpus": gpus,
        "default_backend": backend,
        "ffi_platforms_built": list(platforms),
        "ffi_platforms_usable": usable,
        "cuda_kernels_built": _ext.HAS_CUDA,
        "cuda_kernels_usable": _ext.HAS_CUDA and bool(gpus),
        "cuda_architectures": _ext.ext.CUDA_ARCHITECTURES,
        "impls": impls,
        "auto": resolve_impl("auto"),
        "kernels": KERNELS,
        "expert_matmul_kernel": _ext.HAS_EXPERT_MATMUL,
        "xla_ffi_api": tuple(_ext.ext.XLA_FFI_API_VERSION),
        "MLG_M_TILE": _ext.MLG_M_TILE,
    }


def _runs_now(impl: str) -> bool:
    try:
        check_impl(impl)
    except ValueError:
        return False
    return True
