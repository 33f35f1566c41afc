"""``jax.ffi.ffi_call`` wrapper of the ``expert_matmul`` custom call (CUDA).

Inputs are validated by ``ops/expert_matmul.py``; the operand, result and
attribute layout is documented in ``ffi_src/expert_matmul/expert_matmul.h``.
The scratch result (pointer/shape arrays and CUTLASS's workspace) is sized
here at trace time from the extension's ``expert_matmul_scratch_bytes``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moelora import _ext
from jax_moelora.tables import MoeExpertRoute

__all__ = ["expert_matmul_ffi", "device_sm_count", "lora_in_gemm_scratch"]


@functools.cache
def device_sm_count() -> int:
    """SMs of the first GPU (the persistent grid and CUTLASS's workspace)."""
    dev = jax.devices("gpu")[0]
    count = getattr(dev, "core_count", None) or _ext.ext.cuda_sm_count(dev.local_hardware_id)
    if not count:
        raise RuntimeError(f"expert_matmul: cannot read the SM count of {dev}")
    return int(count)


def _absent_route(dtype) -> tuple:
    """Operands standing for a weight set without LoRA (never read)."""
    return (jnp.zeros((1, 1, 1), dtype), jnp.zeros((1, 1, 1), dtype),
            jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
            jnp.zeros((1, 1), jnp.float32))


def _route_operands(route: MoeExpertRoute | None, dtype) -> tuple:
    if route is None:
        return _absent_route(dtype)
    return (route.a_pool, route.b_pool, route.a_table, route.b_table, route.scale_table)


def _pack_operands(pack, dtype) -> tuple:
    """A route's packs made beforehand (``ops/lora_pack.py``), or operands
    standing for none (never read)."""
    if pack is None:
        return jnp.zeros((1, 1, 1), dtype), jnp.zeros((1,), jnp.int32)
    return pack.b_ext, pack.marks


# expert_matmul's schedule names -> the custom call's `schedule` attribute
_SCHEDULES = {"cooperative": _ext.EXPERT_MATMUL_COOPERATIVE,
              "pingpong": _ext.EXPERT_MATMUL_PINGPONG}


def lora_in_gemm_scratch(routes, E: int, N: int) -> int:
    """Bytes of expert_matmul's scratch after the GEMM's for the routes folded
    inside the GEMM: per route, the packed ``round(scale * B^T)`` blocks
    (``[min(n_experts, E), L * R, N]``) and the marks of the pairs whose
    packed values are not finite (``lora_ext_scratch_bytes`` of
    ``moelora_constants.h``, which the handler's layout uses)."""
    return sum(int(_ext.ext.lora_ext_scratch_bytes(r.max_loras, r.n_experts, E, r.max_rank, N))
               for r in routes if r is not None)


def expert_matmul_ffi(xs, ws, offsets, stids, routes, row_adapter, pdl: bool, schedule: str,
                      lora_in_gemm: bool = False, x_tokens=None, packs=None):
    """One custom call: the grouped GEMM of each weight set in ``ws`` (one or
    two ``[E, K, N]``) over ``xs [M, K]`` with the CUTLASS kernel of
    ``schedule`` (``"cooperative"`` or ``"pingpong"``), each output folded
    with its route: after the GEMM, or with ``lora_in_gemm`` inside its K
    loop. Returns ``(out, xa)``: ``out [len(ws), M, N]``, weight set ``i``'s
    output in plane ``i``; with ``lora_in_gemm``, ``xa [len(ws), M, X]``
    (``X`` the largest ``L * R``), whose plane ``i`` starts with weight set
    ``i``'s ``[M, L * R]``: each folding row's ``round(x A^T)`` in the ``R``
    columns of its table row, zeros elsewhere (what the backward reads, see
    ``ops/expert_matmul.py``); else the fold's scratch, of no meaning.

    ``x_tokens [num_tokens, K]``, when given, holds the tokens ``xs`` was
    gathered from (``xs[r] == x_tokens[stids[r]]`` for every row that folds):
    the folds' shrinks read it there, ``top_k`` rows sharing one token row.

    ``packs``, when given with ``lora_in_gemm``, holds per weight set its
    route's ``LoraInGemmPack`` (None for a weight set without a route): the
    kernel reads them instead of packing ``B`` itself."""
    _ext.register()
    M, _ = xs.shape
    E, _, N = ws[0].shape
    nw = len(ws)
    dt = xs.dtype
    sm = device_sm_count()
    scratch = int(_ext.ext.expert_matmul_scratch_bytes(nw * E, sm))
    live = [r for r in routes if r is not None]
    fuse = bool(lora_in_gemm and live)
    packed = fuse and packs is not None
    if fuse:  # xa: each weight set's [M, L * R] plane (row stride its own L * R)
        if not packed:
            scratch += lora_in_gemm_scratch(routes, E, N)
        xa_shape = (nw, M, max(r.max_loras * r.max_rank for r in live))
    else:  # xa: the fold's [M, R]
        xa_shape = (M if live else 1, max((r.max_rank for r in live), default=1))
    out_types = (jax.ShapeDtypeStruct((nw, M, N), dt),
                 jax.ShapeDtypeStruct((scratch,), jnp.uint8),
                 jax.ShapeDtypeStruct(xa_shape, dt))
    ra = row_adapter if row_adapter is not None else jnp.zeros((1,), jnp.int32)
    w1 = ws[1] if nw > 1 else ws[0]
    r0 = _route_operands(routes[0], dt)
    r1 = _route_operands(routes[1] if nw > 1 else None, dt)
    p0 = _pack_operands(packs[0] if packed else None, dt)
    p1 = _pack_operands(packs[1] if packed and nw > 1 else None, dt)
    call = jax.ffi.ffi_call(_ext.EXPERT_MATMUL_TARGET, out_types, vmap_method="sequential")
    lora_x = xs if x_tokens is None else x_tokens
    out, _scratch, xa = call(
        xs, offsets, ws[0], w1, stids, ra, lora_x, *r0, *r1, *p0, *p1,
        num_weights=np.int64(nw), has_lora0=np.int64(routes[0] is not None),
        has_lora1=np.int64(nw > 1 and routes[1] is not None),
        has_row_adapter=np.int64(row_adapter is not None), sm_count=np.int64(sm),
        pdl=np.int64(pdl), schedule=np.int64(_SCHEDULES[schedule]), lora_in_gemm=np.int64(fuse),
        lora_packed=np.int64(packed),
        lora_x_gather=np.int64(x_tokens is not None))
    return out, xa
