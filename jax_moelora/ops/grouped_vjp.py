"""The LoRA backward as grouped matmuls over (adapter, expert) cells.

For rows folded with pair ``(A, B)`` and scale ``s`` of their table cell, the
fold's backward (``ops/autodiff.py``) is::

    xa   = round(x A^T)            d_xa = round(s * (g B))
    dx  += d_xa A                  dA   = sum_rows d_xa^T x
    dB   = s * sum_rows g^T xa     ds   = sum_rows xa . (g B) = <sum_rows g^T xa, B>

With rows grouped by expert, every term is a grouped matmul whose groups are
the experts (``ops/grouped_matmul.py``): ``xa``, ``d_xa`` and ``dx`` are
``gmm`` s, and the two sums are ``tgmm`` s, added into the pools by slot;
``ds`` comes from the second sum and the cell's ``B``. An expert's matrices
are its cells' side by side (``A`` blocks stacked to ``[L * R, K]``, ``s *
B`` blocks to ``[N, L * R]``; with one table row, the cell's own read in
place, the scale applied in the kernel's epilogue), and each row keeps only
its own cell's ``R`` columns of ``xa`` and ``d_xa`` (none for a row that
folds nothing). The products are the cells' with zeros beside them: the rows
need no order within an expert, and the tiles of the ``R``-wide matmuls do
not grow with the number of adapters (``d_xa`` is then ``round(g round(s
B))``). On a Hopper GPU that is four launches of the CUTLASS grouped GEMM for
any number of projections sharing the rows (gate and up: one launch each for
``xa``, ``d_xa`` and the sums, one ``dx`` launch each), reading the weights
in place; nothing is allocated in proportion to ``rows * pool_size``.

Cells are numbered expert-major, ``g = e * L + l`` (``L`` table rows,
``E_t`` experts). ``expert_matmul``'s rows are grouped by expert already;
the folds sort theirs by cell (:func:`expert_offsets_of`). No branch depends
on the rows: the one ``lax.cond`` of a call picks how the pool cotangents
are summed from the tables alone (:func:`_pool_sums`).

Numerics: every product accumulates in fp32; ``xa`` and ``d_xa`` are rounded
to the activation dtype as in the jnp backward, ``dx`` is rounded once per
term it accumulates, the sums are rounded once to the pools' dtype: where
no two cells share a slot, the kernel writes the ``d_xa^T x`` sums rounded
(half the bytes; the ``g^T xa`` sums stay fp32 for ``ds`` and the scale),
else every sum is added in fp32 first.
Every kernel writes each output element from one CTA in a fixed order, and a
pool slot used by one cell receives one sum: the pool and scale cotangents
are the same bits on every run. (When several cells share a pool slot, the
slot's sum is a scatter-add whose order is not fixed.)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_moelora.ops import grouped_matmul as gm
from jax_moelora.tables import MoeExpertRoute

__all__ = ["Member", "member", "cell_keys", "expert_offsets_of", "lora_grads", "ProjectionGrads"]

_F32 = jnp.float32


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["a_pool", "b_pool", "a_slot", "b_slot", "scale", "g"],
                   meta_fields=["plane", "g_plane", "loras"])
@dataclasses.dataclass(frozen=True)
class Member:
    """One projection of the rows: its pools and per-cell tables, and its cotangent.

    ``a_pool [..., P, R, K]`` and ``b_pool [..., P, N, R]`` are read at plane
    ``plane`` of their leading dimensions; ``a_slot``, ``b_slot`` int32
    ``[G]`` are cell ``g``'s pool slots (-1: the cell folds nothing),
    ``scale`` f32 ``[G]``; ``g [..., M, N]`` is the rows' cotangent, at plane
    ``g_plane``; ``loras`` is the tables' ``L`` (``G = E_t * L``). A pytree
    whose planes and ``loras`` are static.
    """

    a_pool: jax.Array
    b_pool: jax.Array
    plane: int
    a_slot: jax.Array
    b_slot: jax.Array
    scale: jax.Array
    g: jax.Array
    g_plane: int = 0
    loras: int = 1

    @property
    def pool_size(self) -> int:
        return int(self.a_pool.shape[-3])

    def g_rows(self) -> jax.Array:
        return self.g.reshape((-1,) + self.g.shape[-2:])[self.g_plane]


class ProjectionGrads(NamedTuple):
    """A member's cotangents: ``d_a_pool [P, R, K]``, ``d_b_pool [P, N, R]``
    (the pools' dtype, rounded once from fp32 sums) and ``d_scale`` f32
    ``[G]`` per cell."""

    d_a_pool: jax.Array
    d_b_pool: jax.Array
    d_scale: jax.Array


def member(route: MoeExpertRoute, g: jax.Array, *, plane: int = 0, g_plane: int = 0,
           pools: tuple[jax.Array, jax.Array] | None = None) -> Member:
    """A :class:`Member` of ``route`` (tables ``[L, E_t]``): cell ``g = e * L
    + l``'s slots, ``-1`` where the cell folds nothing (a slot 0 or outside
    the pool on either side). ``pools`` replaces the route's pools (a stacked
    ``[S, P, ...]`` pair read at ``plane``)."""
    a_pool, b_pool = pools if pools is not None else (route.a_pool, route.b_pool)
    P = route.pool_size
    a = route.a_table.T.reshape(-1)
    b = route.b_table.T.reshape(-1)
    ok = (a > 0) & (a < P) & (b > 0) & (b < P)
    scale = jnp.where(ok, route.scale_table.T.reshape(-1), 0.0).astype(_F32)
    return Member(a_pool, b_pool, plane, jnp.where(ok, a, -1).astype(jnp.int32),
                  jnp.where(ok, b, -1).astype(jnp.int32), scale, g, g_plane, route.max_loras)


def cell_keys(L: int, E: int, adapter: jax.Array, expert: jax.Array, ok: jax.Array) -> jax.Array:
    """int32 ``[M]``: each row's cell ``e * L + l``, or ``L * E`` for a row
    that folds with no cell (``ok`` false, an adapter ``< 0`` or a row ``>= L``
    when ``L > 1``, an expert outside ``[0, E)``). With ``L == 1`` every
    adapter ``>= 0`` is table row 0 (docs/semantics.md §3)."""
    l = jnp.zeros_like(adapter) if L == 1 else adapter
    valid = ok & (adapter >= 0) & (l < L) & (expert >= 0) & (expert < E)
    key = jnp.clip(expert, 0, E - 1) * L + jnp.clip(l, 0, L - 1)
    return jnp.where(valid, key, L * E).astype(jnp.int32)


def _pool(pool: jax.Array, plane: int) -> jax.Array:
    """Plane ``plane`` of a pool's leading dimensions: ``[P, R, K]`` or ``[P, N, R]``."""
    return pool.reshape((-1,) + pool.shape[-3:])[plane]


def _slot_index(slot: jax.Array, P: int) -> jax.Array:
    """Each cell's pool slot, ``P`` (one past the pool) for a slot of -1."""
    return jnp.where(slot >= 0, slot, P)


def _shared(slot: jax.Array, P: int) -> jax.Array:
    """Whether two cells of ``slot`` (int32 ``[G]``, -1: none) share a pool slot."""
    return jnp.any(jnp.zeros((P + 1,), jnp.int32).at[_slot_index(slot, P)].add(1)[:P] > 1)


def _gather_sum(cells: jax.Array, slot: jax.Array, P: int, dtype) -> jax.Array:
    """The pool cotangent of cells whose slots are distinct: each slot takes its
    cell's sum (0 for a slot of no cell), written in ``dtype``."""
    G = slot.shape[0]
    owner = jnp.full((P + 1,), G, jnp.int32).at[_slot_index(slot, P)].set(
        jnp.arange(G, dtype=jnp.int32))[:P]
    got = jnp.take(cells, jnp.minimum(owner, G - 1), axis=0)
    own = (owner < G).reshape((P,) + (1,) * (cells.ndim - 1))
    return jnp.where(own, got, 0.0).astype(dtype)


def _scatter_sum(cells: jax.Array, slot: jax.Array, P: int, dtype) -> jax.Array:
    """The pool cotangent of cells in any slots: their sums added into an fp32
    pool by slot (a slot of -1 dropped), then cast to ``dtype``."""
    return jnp.zeros((P,) + cells.shape[1:], _F32).at[_slot_index(slot, P)].add(
        cells, mode="drop").astype(dtype)


def _pool_sums(cells: Callable[[bool], list[jax.Array]],
               tables: Sequence[tuple[jax.Array, int, Any]]) -> list[jax.Array]:
    """Per-cell sums as pool cotangents: for part ``i`` of ``tables`` (``(slot
    int32 [G], P, dtype)``) a ``[P, ...]`` array in ``dtype`` whose slot holds
    the sum of its cells' (0 for a slot of no cell; a slot of -1 is dropped).
    ``cells(exact)`` gives every part's ``[G, ...]`` sums, once per branch:
    fp32 where ``exact``, else sums already rounded to the part's dtype will do.

    Where no two cells of any part share a slot (the tables of distinct
    adapters and experts) every slot takes its cell's sum by a gather (from
    sums that may be rounded: one rounding either way); otherwise every
    part's fp32 sums are added into fp32 pools first. The two give the same
    values. One ``lax.cond`` decides for all parts: on a GPU its predicate is
    read by the host once per call."""
    shared = functools.reduce(jnp.logical_or, [_shared(s, P) for s, P, _ in tables])

    def branch(exact: bool, fn):
        return lambda: [fn(c, s, P, dt) for c, (s, P, dt) in zip(cells(exact), tables)]

    return jax.lax.cond(shared, branch(True, _scatter_sum), branch(False, _gather_sum))


class _Groups(NamedTuple):
    """Each member's matrices of the LoRA matmuls, whose groups are the experts.

    With one table row (``L == 1``) an expert's matrices are its cell's own,
    read in place at the cell's pool slot, the scale the per-group alpha of
    ``d_xa``. With several, an expert's ``L`` cells stand side by side (``a
    [E, L * R, K]``, ``b [E, N, L * R]`` with the cell's scale applied, zero
    for a cell that folds nothing). Either way ``xa`` and ``d_xa`` are masked
    to each row's own cell's ``R`` columns (``masks``; none for a row that
    folds nothing), so every product is the by-cell one with zeros beside it.

    ``dx = d_xa A`` reads a copy of the cells' A with the values that are not
    finite set to 0 (``0 * inf`` would reach the rows of other cells and the
    rows that fold nothing); with several table rows ``xa`` reads the same
    copy, and the rows of a cell whose A holds such a value get NaN in their
    ``xa`` columns (``nan_rows``). Such a value reaches its cell's pool
    cotangents, not any row's ``dx``.
    """

    a: list        # per member: (rhs, rhs_plane, slots) of xa (transposed)
    a_dx: list     # per member: (rhs, rhs_plane, slots) of dx
    b: list        # per member: (rhs, rhs_plane, slots, alpha) of d_xa
    masks: list    # per member: bool [M, L * R]
    nan_rows: list  # per member: bool [M, 1], or None (L == 1)


def _groups(members: Sequence[Member], key: jax.Array) -> _Groups:
    L, G = members[0].loras, members[0].a_slot.shape[0]
    E = G // L
    cell = jnp.where(key < G, key % L, -1)[:, None]
    a, a_dx, b, masks, nan_rows = [], [], [], [], []
    for m in members:
        ap, bp = _pool(m.a_pool, m.plane), _pool(m.b_pool, m.plane)  # [P, R, K], [P, N, R]
        (P, R, K), N = ap.shape, bp.shape[1]
        ok = (m.a_slot >= 0)[:, None, None]
        raw = jnp.where(ok, ap[jnp.clip(m.a_slot, 0, P - 1)], 0)  # [G, R, K]
        finite = jnp.isfinite(raw)
        a_cells = jnp.where(finite, raw, 0).reshape(E, L * R, K)
        a_dx.append((a_cells, 0, None))
        masks.append(jnp.arange(L * R, dtype=jnp.int32)[None, :] // R == cell)
        if L == 1:
            a.append((m.a_pool, m.plane, m.a_slot))
            b.append((m.b_pool, m.plane, m.b_slot, m.scale))
            nan_rows.append(None)
            continue
        bad = ~jnp.all(finite, axis=(1, 2))  # [G]
        nan_rows.append((bad[jnp.minimum(key, G - 1)] & (key < G))[:, None])
        b_cells = jnp.where(ok, bp[jnp.clip(m.b_slot, 0, P - 1)].astype(_F32)
                            * m.scale[:, None, None], 0.0).astype(bp.dtype)
        a.append((a_cells, 0, None))
        b.append((b_cells.reshape(E, L, N, R).transpose(0, 2, 1, 3).reshape(E, N, L * R), 0,
                  None, None))
    return _Groups(a, a_dx, b, masks, nan_rows)


def _cells(red: jax.Array, L: int, rank_last: bool) -> jax.Array:
    """A by-expert sum (``[E, L * R, K]``, or ``[E, N, L * R]`` with
    ``rank_last``) as per-cell sums ``[G, R, K]`` (``[G, N, R]``)."""
    if not rank_last:
        E, LR, K = red.shape
        return red.reshape(E * L, LR // L, K)
    E, N, LR = red.shape
    return red.reshape(E, N, L, LR // L).transpose(0, 2, 1, 3).reshape(E * L, N, LR // L)


def expert_offsets_of(key: jax.Array, L: int, E: int) -> jax.Array:
    """int32 ``[E + 1]``: the expert groups of rows sorted by cell (``key``
    non-decreasing, the rows that fold nothing, key ``L * E``, last)."""
    counts = jnp.zeros((E + 1,), jnp.int32).at[jnp.minimum(key // L, E)].add(1)[:E]
    return gm.group_offsets(counts)


def lora_grads(x_rows: jax.Array, members: Sequence[Member], key: jax.Array,
               offsets: jax.Array, *, impl: str, acc: jax.Array | None = None,
               separate: bool = False
               ) -> tuple[jax.Array | list[jax.Array], list[ProjectionGrads]]:
    """The backward of the members' folds over rows grouped by expert.

    Args:
      x_rows: ``[M, K]``, row ``r``'s input.
      members: the projections folded over these rows (gate and up: two).
      key: int32 ``[M]``, each row's cell (:func:`cell_keys`); ``G`` for a
        row that folds nothing.
      offsets: int32 ``[E_t + 1]``, the rows of expert ``e`` are
        ``offsets[e] .. offsets[e + 1]`` (non-decreasing); each such row's
        key is a cell of expert ``e`` (``e * L .. e * L + L - 1``) or ``G``,
        in any order. Rows outside every group fold nothing.
      impl: ``"fast"`` (the grouped_matmul kernels) or ``"jnp"``.
      acc: ``[M, K]`` to add the rows' ``dx`` to, or None.
      separate: return each member's ``dx`` (one launch for all of them)
        instead of their sum (one launch each, accumulating); ``acc`` unused.

    Returns:
      ``(dx_rows [M, K] in x's dtype (a list of them with separate),
      [ProjectionGrads per member])``. A row that folds nothing has ``dx``
      ``acc`` (or 0).
    """
    L = members[0].loras
    grp = _groups(members, key)
    xa = gm.gmm([gm.GmmSet(x_rows, r, offsets, sl, 0, pl) for r, pl, sl in grp.a],
                transpose_rhs=True, impl=impl)
    # d_xa = round(s * (g B)): the cell's scale applied to the fp32 product
    # (L > 1: round(g round(s B)))
    d_xa = gm.gmm([gm.GmmSet(m.g, r, offsets, sl, m.g_plane, pl, al)
                   for m, (r, pl, sl, al) in zip(members, grp.b)], impl=impl)
    xa = [jnp.where(mk, v if nan is None else jnp.where(nan, jnp.nan, v).astype(v.dtype),
                    jnp.zeros((), v.dtype)) for mk, nan, v in zip(grp.masks, grp.nan_rows, xa)]
    d_xa = [jnp.where(mk, v, jnp.zeros((), v.dtype)) for mk, v in zip(grp.masks, d_xa)]
    gxa_sums = gm.tgmm([gm.TgmmSet(m.g, xa_m, offsets, m.g_plane)
                        for m, xa_m in zip(members, xa)], impl=impl)
    a_sums = _a_sums([gm.TgmmSet(dxa, x_rows, offsets) for dxa in d_xa], members, impl)
    dx_sets = [gm.GmmSet(dxa, r, offsets, sl, 0, pl) for dxa, (r, pl, sl) in zip(d_xa, grp.a_dx)]
    if separate:
        dx = gm.gmm(dx_sets, impl=impl)
    else:
        dx = acc
        for dx_set in dx_sets:
            dx = gm.gmm([dx_set], acc=None if dx is None else [dx], impl=impl)[0]
    d_scale, tables = [], []
    for i, m in enumerate(members):
        # [G, N, R]: sums of g^T xa (those of d_xa^T x: a_sums)
        gxa = _cells(gxa_sums[i], L, True)
        P = m.pool_size
        # ds = sum_rows xa . (g B) = <g^T xa, B>, from the fp32 sums
        b_cells = _pool(m.b_pool, m.plane)[jnp.clip(m.b_slot, 0, P - 1)].astype(_F32)
        d_scale.append(jnp.where(m.b_slot >= 0, jnp.sum(gxa * b_cells, axis=(1, 2)), 0.0))
        tables += [(m.a_slot, P, m.a_pool.dtype), (m.b_slot, P, m.b_pool.dtype)]

    def b_sums() -> list[jax.Array]:
        # s * sum g^T xa per cell, formed from the kernel's output inside the branch
        # that sums it into the pool (as ds forms its own view above): a lax.cond's
        # operands are buffers of their own, so no scaled fp32 copy is passed in
        return [_cells(r, L, True) * m.scale[:, None, None] for r, m in zip(gxa_sums, members)]

    pools = _pool_sums(lambda exact: [c for pair in zip(a_sums(exact), b_sums()) for c in pair],
                       tables)
    return dx, [ProjectionGrads(pools[2 * i], pools[2 * i + 1], ds)
                for i, ds in enumerate(d_scale)]


def _a_sums(sets: list, members: Sequence[Member], impl: str):
    """``sums(exact)``: each member's per-cell ``sum d_xa^T x`` ``[G, R, K]``
    from one ``tgmm`` of ``sets`` (one a member): fp32 where ``exact``, else
    rounded to the A pools' dtype by the kernel (half the bytes written) when
    that is ``d_xa``'s."""
    L = members[0].loras
    rounded_ok = all(jnp.dtype(m.a_pool.dtype) == jnp.dtype(s.lhs.dtype)
                     for m, s in zip(members, sets))

    def sums(exact: bool) -> list[jax.Array]:
        return [_cells(r, L, False)
                for r in gm.tgmm(sets, impl=impl, rounded=rounded_ok and not exact)]

    return sums
