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

      out[q] = alpha[g] * sum over the rows r of g of lhs[r]^T rhs[r]   f32 [Q, K, N]

  with ``g = groups_of[q]`` (``Q`` matrices; without ``groups_of``, ``Q =
  G`` and ``g = q``) and ``alpha[g]`` (or 1), in fp32; a matrix of no group
  (a value outside ``[0, G)``) or of a group without rows is zeros. With
  ``rounded=True`` the sums are rounded once to ``lhs``' dtype (half the
  bytes written). ``groups_of`` writes each group's sum where its consumer
  wants it (a pool slot) with no copy after the call.

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

__all__ = ["GmmSet", "TgmmSet", "gmm", "tgmm", "group_offsets", "row_groups"]

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
    (planes as :class:`GmmSet`), ``offsets`` int32 ``[G + 1]``; ``groups_of``
    int32 ``[Q]`` or None; ``alpha`` f32 ``[G]`` or None."""

    lhs: jax.Array
    rhs: jax.Array
    offsets: jax.Array
    lhs_plane: int = 0
    rhs_plane: int = 0
    groups_of: jax.Array | None = None
    alpha: jax.Array | None = None


def group_offsets(counts: jax.Array) -> jax.Array:
    """int32 ``[G + 1]`` offsets of groups of ``counts [G]`` rows laid out in turn."""
    return jnp.concatenate([jnp.zeros((1,), jnp.int32),
                            jnp.cumsum(counts.astype(jnp.int32), dtype=jnp.int32)])


def _plane(a: jax.Array, index: int, rank: int) -> jax.Array:
    """Plane ``index`` of ``a``'s leading dimensions (flattened): ``[rank dims]``."""
    a = a.reshape((-1,) + a.shape[a.ndim - rank:])
    return a[index]


def row_groups(offsets: jax.Array, m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each group's clipped ``(lo, hi)`` and each of the ``m`` rows' group
    (``G`` for a row outside every group)."""
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
    _, _, row_group = row_groups(offsets, m)
    # group by group, each row keeping its own group's product: a value that
    # is not finite stays in its group's rows (ragged_dot's lowering off the
    # TPU masks the rows by multiplication, where 0 times inf reaches every
    # row), in memory of one [M, N] product
    lhs32 = lhs.astype(_F32)

    def one(g, prod):
        mat = rhs[jnp.clip(slots[g], 0, P - 1)].astype(_F32)
        return jnp.where((row_group == g)[:, None],
                         jnp.dot(lhs32, mat, precision=_HI), prod)

    prod = jax.lax.fori_loop(0, G, one, jnp.zeros((m, rhs.shape[-1]), _F32))
    if alpha is not None:
        scale = jnp.concatenate([alpha.astype(_F32), jnp.zeros((1,), _F32)])
        prod = prod * scale[row_group][:, None]
    row_ok = jnp.concatenate([valid, jnp.zeros((1,), bool)])[row_group][:, None]
    if acc is None:
        return jnp.where(row_ok, rounded(prod, lhs.dtype), jnp.zeros((), lhs.dtype))
    return jnp.where(row_ok, rounded(prod + acc.astype(_F32), lhs.dtype), acc)


def _tgmm_jnp(lhs, rhs, offsets, groups_of, alpha):
    """One set of :func:`tgmm` on ``lhs [M, K]``, ``rhs [M, N]``."""
    m, G = lhs.shape[0], offsets.shape[0] - 1
    lo, hi, row_group = row_groups(offsets, m)
    inside = (row_group < G)[:, None]
    lhs = jnp.where(inside, lhs.astype(_F32), 0.0)  # rows outside every group add nothing
    sizes = jnp.concatenate([lo[:1], hi - lo])
    dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    sums = jax.lax.ragged_dot_general(lhs, rhs.astype(_F32), sizes, dn, precision=_HI,
                                      preferred_element_type=_F32)[1:]
    if alpha is not None:
        sums = sums * alpha.astype(_F32)[:, None, None]
    if groups_of is None:
        return sums
    ok = ((groups_of >= 0) & (groups_of < G))[:, None, None]
    return jnp.where(ok, sums[jnp.clip(groups_of, 0, G - 1)], 0.0)


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
    """The ``grouped_matmul`` custom call over ``sets`` with result types
    ``outs`` (a set's slots: ``slots`` of a :class:`GmmSet`, ``groups_of`` of
    a :class:`TgmmSet`)."""
    _ext.register()
    sm = expert_matmul_ffi.device_sm_count()
    tgmm_ = mode in (_ext.TGMM, _ext.TGMM_ROUNDED)
    problems = sum(o.shape[0] if tgmm_ else s.offsets.shape[0] - 1 for s, o in zip(sets, outs))
    scratch = int(_ext.ext.grouped_matmul_scratch_bytes(mode, problems, sm))
    operands = []
    for s in sets:  # absent slots and alpha: any int32 / f32 array (not read)
        sl = s.groups_of if tgmm_ else s.slots
        operands += [s.lhs, s.rhs, s.offsets, sl if sl is not None else s.offsets[:1],
                     s.alpha if s.alpha is not None else jnp.zeros((1,), _F32)]
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
    sets, slots, alpha = _call_wide(sets, "slots")
    mode = _ext.GMM_RHS_T if transpose_rhs else _ext.GMM
    return _ffi(mode, sets, outs, acc, slots, alpha)


def _call_wide(sets, field: str):
    """``(sets, has_slots, has_alpha)``: the custom call's has_slots and
    has_alpha hold for all its sets, so where one set has ``field`` (its
    slots) or alpha, the others get the identity ``0 .. G - 1`` and ones."""
    slots = any(getattr(s, field) is not None for s in sets)
    alpha = any(s.alpha is not None for s in sets)
    G = [s.offsets.shape[0] - 1 for s in sets]
    return [s._replace(**{
        field: getattr(s, field) if getattr(s, field) is not None or not slots else
        jnp.arange(g, dtype=jnp.int32),
        "alpha": s.alpha if s.alpha is not None or not alpha else jnp.ones((g,), _F32)})
        for s, g in zip(sets, G)], slots, alpha


def tgmm(sets: Sequence[TgmmSet], *, impl: str = "jnp", rounded: bool = False
         ) -> list[jax.Array]:
    """Transposed grouped matmul of each operand set: one ``[Q, K, N]`` per
    set (module docstring; ``Q = G`` without ``groups_of``), f32, or with
    ``rounded`` the fp32 sums rounded once to ``lhs``' dtype; ``impl`` as
    :func:`gmm`."""
    _check_sets("tgmm", sets, 2)
    for i, s in enumerate(sets):
        _check_vector(f"tgmm: set {i}: groups_of", s.groups_of, jnp.int32, None)
        _check_vector(f"tgmm: set {i}: alpha", s.alpha, _F32, s.offsets.shape[0] - 1)
    if impl == "jnp":
        out = [_tgmm_ref(_plane(s.lhs, s.lhs_plane, 2), _plane(s.rhs, s.rhs_plane, 2), s.offsets,
                         s.groups_of, s.alpha) for s in sets]
        return [o.astype(s.lhs.dtype) for o, s in zip(out, sets)] if rounded else out
    outs = [jax.ShapeDtypeStruct(
        ((s.offsets.shape[0] - 1) if s.groups_of is None else s.groups_of.shape[0],
         s.lhs.shape[-1], s.rhs.shape[-1]), s.lhs.dtype if rounded else _F32) for s in sets]
    sets, slots, alpha = _call_wide(sets, "groups_of")
    return _ffi(_ext.TGMM_ROUNDED if rounded else _ext.TGMM, sets, outs, None, slots, alpha)


def _check_vector(name: str, v, dtype, n: int | None) -> None:
    """``v`` is None or a ``dtype`` vector (of ``n`` entries when given)."""
    if v is None:
        return
    if v.dtype != dtype or v.ndim != 1 or v.shape[0] < 1 or (n is not None and v.shape[0] != n):
        want = f"[{n}]" if n is not None else "[Q], Q >= 1"
        raise ValueError(f"{name} must be {jnp.dtype(dtype).name} {want}, got "
                         f"{v.dtype} {tuple(v.shape)}")
