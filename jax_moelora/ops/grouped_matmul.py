"""Grouped matmuls over row groups: the building blocks of the backward passes.

Rows of an ``[M, K]`` operand are split into ``G`` contiguous groups by
``offsets`` (int32 ``[G + 1]``, non-decreasing; group ``g`` holds rows
``offsets[g] .. offsets[g + 1]``, clipped into ``[0, M]``). In megablox's words:

- ``gmm``: each group's rows times one matrix of ``rhs``::

      out[r] = round(alpha[g] * lhs[r] @ rhs[slot(g)] (+ acc[r]))     rhs [P, K, N]
      out[r] = round(alpha[g] * lhs[r] @ rhs[slot(g)]^T (+ acc[r]))   rhs [P, N, K], transpose_rhs

  with ``slot(g) = slots[g]`` (or ``g`` without slots) and ``alpha[g]`` (or
  1); a group whose slot is outside ``[0, P)`` is skipped. Rows no group
  multiplies are ``acc[r]`` (or 0). fp32 accumulation and arithmetic, one
  rounding to ``lhs``' dtype.
- ``tgmm``: each group's rows reduced to one matrix (the transposed grouped
  matmul of a weight gradient)::

      out[g] = sum over the rows r of g of lhs[r]^T rhs[r]   f32 [G, K, N]

  in fp32, a group without rows gives zeros; with ``rounded=True`` the sums
  are rounded once to ``lhs``' dtype (half the bytes written).

Several independent operand sets run in one call (:class:`GmmSet`,
:class:`TgmmSet`; one kernel launch on the GPU). ``impl="fast"`` runs the
``grouped_matmul`` custom call (a CUTLASS grouped GEMM on sm90, bf16/f16,
``K`` and ``N`` multiples of ``EXPERT_MATMUL_ALIGN``: ``backend.cutlass_takes``);
``impl="jnp"`` computes the same with ``jax.lax.ragged_dot_general`` on
f32-widened operands (every platform; the reference the kernel is tested
against). Neither is differentiated: they are used inside ``custom_vjp``
backward passes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_moelora import _ext
from jax_moelora.ops import batching, expert_matmul_ffi
from jax_moelora.ops.jnp_fold import rounded

__all__ = ["GmmSet", "TgmmSet", "gmm", "tgmm", "group_offsets"]

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


class GmmSet(NamedTuple):
    """One operand set of :func:`gmm`.

    ``lhs [..., M, K]`` and ``rhs [..., P, K, N]`` (``[..., P, N, K]`` with
    ``transpose_rhs``): plane ``lhs_plane`` / ``rhs_plane`` of their leading
    dimensions is used (a stacked pool is read in place). ``offsets`` int32
    ``[G + 1]``; ``slots`` int32 ``[G]`` or None; ``alpha`` f32 ``[G]`` or None.
    """

    lhs: jax.Array
    rhs: jax.Array
    offsets: jax.Array
    slots: jax.Array | None = None
    lhs_plane: int = 0
    rhs_plane: int = 0
    alpha: jax.Array | None = None


class TgmmSet(NamedTuple):
    """One operand set of :func:`tgmm`: ``lhs [..., M, K]``, ``rhs [..., M, N]``
    (planes as :class:`GmmSet`), ``offsets`` int32 ``[G + 1]``."""

    lhs: jax.Array
    rhs: jax.Array
    offsets: jax.Array
    lhs_plane: int = 0
    rhs_plane: int = 0


def group_offsets(counts: jax.Array) -> jax.Array:
    """int32 ``[G + 1]`` offsets of groups of ``counts [G]`` rows laid out in turn."""
    return jnp.concatenate([jnp.zeros((1,), jnp.int32),
                            jnp.cumsum(counts.astype(jnp.int32), dtype=jnp.int32)])


def _plane(a: jax.Array, index: int, rank: int) -> jax.Array:
    """Plane ``index`` of ``a``'s leading dimensions (flattened): ``[rank dims]``."""
    a = a.reshape((-1,) + a.shape[a.ndim - rank:])
    return a[index]


def _rows(offsets: jax.Array, m: int):
    """Each group's clipped ``(lo, hi)`` and each row's group (``G`` for none)."""
    G = offsets.shape[0] - 1
    lo = jnp.clip(offsets[:-1], 0, m)
    hi = jnp.clip(offsets[1:], lo, m)
    # group of row r: the groups that end at or before r (no search loop)
    ends = jnp.zeros((m + 1,), jnp.int32).at[hi].add(1)
    group = jnp.cumsum(ends, dtype=jnp.int32)[:m]
    inside = (jnp.arange(m, dtype=jnp.int32) >= lo[0]) & (group < G)
    return lo, hi, jnp.where(inside, group, G)


def _gmm_jnp(lhs, rhs, offsets, slots, alpha, acc, *, transpose_rhs: bool):
    """One set of :func:`gmm` on ``lhs [M, K]``, ``rhs [P, K, N]`` (``[P, N, K]``)."""
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, -1, -2)
    m, P = lhs.shape[0], rhs.shape[0]
    G = offsets.shape[0] - 1
    slots = jnp.arange(G, dtype=jnp.int32) if slots is None else slots
    valid = (slots >= 0) & (slots < P)
    lo, hi, row_group = _rows(offsets, m)
    # ragged_dot's groups start at row 0: a leading zero group takes rows [0, lo[0])
    mats = jnp.concatenate([jnp.zeros((1,) + rhs.shape[1:], _F32),
                            rhs[jnp.clip(slots, 0, P - 1)].astype(_F32)])
    sizes = jnp.concatenate([lo[:1], hi - lo])
    prod = jax.lax.ragged_dot(lhs.astype(_F32), mats, sizes, precision=_HI)
    if alpha is not None:
        scale = jnp.concatenate([alpha.astype(_F32), jnp.zeros((1,), _F32)])
        prod = prod * scale[row_group][:, None]
    row_ok = jnp.concatenate([valid, jnp.zeros((1,), bool)])[row_group][:, None]
    if acc is None:
        return jnp.where(row_ok, rounded(prod, lhs.dtype), jnp.zeros((), lhs.dtype))
    return jnp.where(row_ok, rounded(prod + acc.astype(_F32), lhs.dtype), acc)


def _tgmm_jnp(lhs, rhs, offsets):
    """One set of :func:`tgmm` on ``lhs [M, K]``, ``rhs [M, N]``."""
    m = lhs.shape[0]
    lo, hi, row_group = _rows(offsets, m)
    inside = (row_group < offsets.shape[0] - 1)[:, None]
    lhs = jnp.where(inside, lhs.astype(_F32), 0.0)  # rows outside every group add nothing
    sizes = jnp.concatenate([lo[:1], hi - lo])
    dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(lhs, rhs.astype(_F32), sizes, dn, precision=_HI,
                                      preferred_element_type=_F32)[1:]


# ragged_dot batches over a leading group axis only: under vmap, one set per element
_gmm_ref = {t: batching.sequential(functools.partial(_gmm_jnp, transpose_rhs=t))
            for t in (False, True)}
_tgmm_ref = batching.sequential(_tgmm_jnp)


def _check_sets(name: str, sets: Sequence, rhs_rank: int) -> None:
    if not 1 <= len(sets) <= _ext.GROUPED_MATMUL_MAX_SETS:
        raise ValueError(f"{name}: 1 to {_ext.GROUPED_MATMUL_MAX_SETS} operand sets, got "
                         f"{len(sets)}")
    for i, s in enumerate(sets):
        if s.lhs.ndim < 2 or s.rhs.ndim < rhs_rank:
            raise ValueError(f"{name}: set {i}: lhs must be [..., M, K] and rhs at least "
                             f"{rhs_rank}-D, got {s.lhs.shape} and {s.rhs.shape}")
        if s.offsets.dtype != jnp.int32 or s.offsets.ndim != 1 or s.offsets.shape[0] < 2:
            raise ValueError(f"{name}: set {i}: offsets must be int32 [G + 1], G >= 1")
        for field, a, rank in (("lhs_plane", s.lhs, 2), ("rhs_plane", s.rhs, rhs_rank)):
            plane = getattr(s, field)
            if isinstance(plane, bool) or not isinstance(plane, (int, np.integer)):
                raise TypeError(f"{name}: set {i}: {field} must be a Python int (static), got "
                                f"{type(plane).__name__}; build the set inside the traced "
                                f"function instead of passing it as an argument of jit")
            planes = int(np.prod(a.shape[:a.ndim - rank], dtype=np.int64))
            if not 0 <= plane < planes:
                raise ValueError(f"{name}: set {i}: {field} {plane} outside the {planes} "
                                 f"plane(s) of its operand's leading dimensions")


def _ffi(mode: int, sets, outs, acc, slots: bool, alpha: bool):
    """The ``grouped_matmul`` custom call over ``sets`` with result types ``outs``."""
    _ext.register()
    sm = expert_matmul_ffi.device_sm_count()
    groups = sum(s.offsets.shape[0] - 1 for s in sets)
    scratch = int(_ext.ext.grouped_matmul_scratch_bytes(mode, groups, sm))
    operands = []
    for s in sets:  # absent slots and alpha: any int32 / f32 array (not read)
        sl, al = getattr(s, "slots", None), getattr(s, "alpha", None)
        operands += [s.lhs, s.rhs, s.offsets, sl if sl is not None else s.offsets[:1],
                     al if al is not None else jnp.zeros((1,), _F32)]
    aliases = {}
    if acc is not None:
        aliases = {len(operands) + i: i for i in range(len(sets))}
        operands += list(acc)
    call = jax.ffi.ffi_call(_ext.GROUPED_MATMUL_TARGET,
                            tuple(outs) + (jax.ShapeDtypeStruct((scratch,), jnp.uint8),),
                            input_output_aliases=aliases, vmap_method="sequential")
    res = call(*operands, mode=np.int64(mode), has_slots=np.int64(slots),
               has_alpha=np.int64(alpha),
               has_acc=np.int64(acc is not None), sm_count=np.int64(sm),
               lhs_plane=np.asarray([s.lhs_plane for s in sets], np.int64),
               rhs_plane=np.asarray([s.rhs_plane for s in sets], np.int64))
    return list(res[:-1])


def gmm(sets: Sequence[GmmSet], *, transpose_rhs: bool = False,
        acc: Sequence[jax.Array] | None = None, impl: str = "jnp") -> list[jax.Array]:
    """Grouped matmul of each operand set (module docstring).

    Args:
      sets: :class:`GmmSet` s (at most ``GROUPED_MATMUL_MAX_SETS``), one dtype.
      transpose_rhs: multiply by each ``rhs`` matrix transposed (``rhs [..., P, N, K]``).
      acc: one ``[M, N]`` per set to add to (the outputs replace them: donate
        them and no copy is made), or None.
      impl: ``"fast"`` (the custom call) or ``"jnp"``.

    Returns:
      one ``[M, N]`` per set in ``lhs``' dtype.
    """
    _check_sets("gmm", sets, 3)
    if acc is not None and len(acc) != len(sets):
        raise ValueError(f"gmm: {len(acc)} accumulators for {len(sets)} sets")
    if impl == "jnp":
        return [_gmm_ref[transpose_rhs](_plane(s.lhs, s.lhs_plane, 2), _plane(s.rhs, s.rhs_plane, 3),
                                        s.offsets, s.slots, s.alpha, None if acc is None else acc[i])
                for i, s in enumerate(sets)]
    outs = []
    for s in sets:
        n = s.rhs.shape[-2] if transpose_rhs else s.rhs.shape[-1]
        outs.append(jax.ShapeDtypeStruct((s.lhs.shape[-2], n), s.lhs.dtype))
    # has_slots and has_alpha hold for the whole call: the other sets get 0 .. G - 1 and ones
    slots = any(s.slots is not None for s in sets)
    alpha = any(s.alpha is not None for s in sets)
    sets = [s._replace(
        slots=s.slots if s.slots is not None or not slots else
        jnp.arange(s.offsets.shape[0] - 1, dtype=jnp.int32),
        alpha=s.alpha if s.alpha is not None or not alpha else
        jnp.ones((s.offsets.shape[0] - 1,), _F32)) for s in sets]
    mode = _ext.GMM_RHS_T if transpose_rhs else _ext.GMM
    return _ffi(mode, sets, outs, acc, slots, alpha)


def tgmm(sets: Sequence[TgmmSet], *, impl: str = "jnp", rounded: bool = False
         ) -> list[jax.Array]:
    """Transposed grouped matmul of each operand set: one ``[G, K, N]`` per
    set (module docstring), f32, or with ``rounded`` the fp32 sums rounded
    once to ``lhs``' dtype; ``impl`` as :func:`gmm`."""
    _check_sets("tgmm", sets, 2)
    if impl == "jnp":
        out = [_tgmm_ref(_plane(s.lhs, s.lhs_plane, 2), _plane(s.rhs, s.rhs_plane, 2), s.offsets)
               for s in sets]
        return [o.astype(s.lhs.dtype) for o, s in zip(out, sets)] if rounded else out
    outs = [jax.ShapeDtypeStruct((s.offsets.shape[0] - 1, s.lhs.shape[-1], s.rhs.shape[-1]),
                                 s.lhs.dtype if rounded else _F32) for s in sets]
    return _ffi(_ext.TGMM_ROUNDED if rounded else _ext.TGMM, sets, outs, None, False, False)
