"""The LoRA backward as grouped matmuls over (adapter, expert) cells.

For rows folded with pair ``(A, B)`` and scale ``s`` of their table cell, the
fold's backward (``ops/autodiff.py``) is::

    xa   = round(x A^T)            d_xa = round(s * (g B))
    dx  += d_xa A                  dA   = sum_rows d_xa^T x
    dB   = s * sum_rows g^T xa     ds   = sum_rows xa . (g B) = <sum_rows g^T xa, B>

With rows sorted by cell, every term is a grouped matmul over the cells
(``ops/grouped_matmul.py``): ``xa``, ``d_xa`` (the cell's scale applied in
the kernel's epilogue) and ``dx`` are ``gmm`` s whose groups are the cells
(the cell's pool slot picks the matrix; a cell that folds nothing is
skipped), and the two sums are ``tgmm`` s, one ``[R, K]`` and one ``[N, R]``
matrix per cell, added into the pools by slot; ``ds`` comes from the second
sum and the cell's ``B``. On a Hopper GPU that is four launches of the
CUTLASS grouped GEMM for any number of projections sharing the rows (gate
and up: one launch each for ``xa``, ``d_xa`` and the sums, one ``dx``
launch each), reading the weights in place; nothing is allocated in
proportion to ``rows * pool_size``.

With several table rows (``L > 1``) the groups are the experts instead: an
expert's ``L`` cells side by side (``A`` blocks stacked to ``[L * R, K]``,
``s * B`` blocks to ``[N, L * R]``), each row keeping its own cell's ``R``
columns of ``xa`` and ``d_xa``. The products are the cells' with zeros
beside them, in ``L`` times fewer groups: the tiles of the ``R``-wide
matmuls do not grow with the number of adapters (``d_xa`` is then
``round(g round(s B))``).

Cells are numbered expert-major, ``g = e * L + l`` (``L`` table rows,
``E_t`` experts): rows sorted by expert and, within an expert, by adapter
(the order ``sort_rows_by_expert`` and ``MoEBlock`` use) are sorted by cell.
:func:`lora_grads` checks that on the device and sorts the rows (a
permutation of ``x`` and ``g``) only when they are not.

Numerics: every product accumulates in fp32; ``xa`` and ``d_xa`` are rounded
to the activation dtype as in the jnp backward, ``dx`` is rounded once per
term it accumulates, the sums stay fp32 until the pools' cotangents are cast
to the pools' dtype.
Every kernel writes each output element from one CTA in a fixed order, and a
pool slot used by one cell receives one sum: the pool and scale cotangents
are the same bits on every run. (When several cells share a pool slot, the
slot's sum is a scatter-add whose order is not fixed.)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_moelora.ops import grouped_matmul as gm
from jax_moelora.tables import MoeExpertRoute

__all__ = ["Member", "member", "cell_keys", "lora_grads", "lora_grads_sorted", "ProjectionGrads"]

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


def _pool_sum(cells: jax.Array, slot: jax.Array, P: int, dtype) -> jax.Array:
    """``[G, ...]`` per-cell sums as a ``[P, ...]`` pool cotangent in
    ``dtype``: each slot the sum of its cells' (0 for a slot of no cell; a
    slot of -1 is dropped). Where no two cells share a slot (the tables of
    distinct adapters and experts) every slot takes its cell's sum by a
    gather; otherwise the sums are added into an fp32 pool first. The two give
    the same values."""
    G = slot.shape[0]
    idx = jnp.where(slot >= 0, slot, P)
    users = jnp.zeros((P + 1,), jnp.int32).at[idx].add(1)[:P]
    owner = jnp.full((P + 1,), G, jnp.int32).at[idx].set(jnp.arange(G, dtype=jnp.int32))[:P]

    def gather(c):
        got = jnp.take(c, jnp.minimum(owner, G - 1), axis=0)
        own = (owner < G).reshape((P,) + (1,) * (c.ndim - 1))
        return jnp.where(own, got, 0.0).astype(dtype)

    def scatter(c):
        return jnp.zeros((P,) + c.shape[1:], _F32).at[idx].add(c, mode="drop").astype(dtype)

    return jax.lax.cond(jnp.any(users > 1), scatter, gather, cells)


class _Groups(NamedTuple):
    """The groups of the LoRA matmuls and each member's matrices.

    By cell: a group per cell, the pools read at the cells' slots, the scale
    as the per-group alpha of ``d_xa``. By expert: a group per expert whose
    matrices hold its ``L`` cells side by side (``a [E, L * R, K]``, ``b [E,
    N, L * R]`` with the cell's scale applied, zero for a cell that folds
    nothing); ``xa`` and ``d_xa`` are then ``[M, L * R]`` and each row keeps
    only its own cell's ``R`` columns (``masks``), so every product is the
    by-cell one with zeros beside it. ``dx = d_xa A`` runs over all ``L``
    blocks of ``a``, so its copy has the values that are not finite set to 0
    (``0 * inf`` would reach the other cells' rows): such a value of a cell's
    A reaches that cell's pool cotangents, not any row's ``dx``.
    """

    offsets: jax.Array
    a: list        # per member: (rhs, rhs_plane, slots) of xa (transposed)
    a_dx: list     # per member: (rhs, rhs_plane, slots) of dx
    b: list        # per member: (rhs, rhs_plane, slots, alpha) of d_xa
    masks: list | None  # per member: bool [M, L * R] (by expert), or None (by cell)


def _by_cell(members: Sequence[Member], key: jax.Array) -> _Groups:
    G = members[0].a_slot.shape[0]
    counts = jnp.zeros((G + 1,), jnp.int32).at[key].add(1)[:G]
    a = [(m.a_pool, m.plane, m.a_slot) for m in members]
    return _Groups(gm.group_offsets(counts), a, a,
                   [(m.b_pool, m.plane, m.b_slot, m.scale) for m in members], None)


def _by_expert(members: Sequence[Member], key: jax.Array) -> _Groups:
    L, G = members[0].loras, members[0].a_slot.shape[0]
    E = G // L
    counts = jnp.zeros((E + 1,), jnp.int32).at[jnp.minimum(key // L, E)].add(1)[:E]
    cell = jnp.where(key < G, key % L, -1)[:, None]
    a, a_dx, b, masks = [], [], [], []
    for m in members:
        ap, bp = _pool(m.a_pool, m.plane), _pool(m.b_pool, m.plane)  # [P, R, K], [P, N, R]
        (P, R, K), N = ap.shape, bp.shape[1]
        ok = (m.a_slot >= 0)[:, None, None]
        a_cells = jnp.where(ok, ap[jnp.clip(m.a_slot, 0, P - 1)], 0)
        b_cells = jnp.where(ok, bp[jnp.clip(m.b_slot, 0, P - 1)].astype(_F32)
                            * m.scale[:, None, None], 0.0).astype(bp.dtype)
        a_cells = a_cells.reshape(E, L * R, K)
        a.append((a_cells, 0, None))
        a_dx.append((jnp.where(jnp.isfinite(a_cells), a_cells, 0), 0, None))
        b.append((b_cells.reshape(E, L, N, R).transpose(0, 2, 1, 3).reshape(E, N, L * R), 0,
                  None, None))
        masks.append(jnp.arange(L * R, dtype=jnp.int32)[None, :] // R == cell)
    return _Groups(gm.group_offsets(counts), a, a_dx, b, masks)


def _cells(red: jax.Array, L: int, rank_last: bool) -> jax.Array:
    """A by-expert sum (``[E, L * R, K]``, or ``[E, N, L * R]`` with
    ``rank_last``) as per-cell sums ``[G, R, K]`` (``[G, N, R]``)."""
    if not rank_last:
        E, LR, K = red.shape
        return red.reshape(E * L, LR // L, K)
    E, N, LR = red.shape
    return red.reshape(E, N, L, LR // L).transpose(0, 2, 1, 3).reshape(E * L, N, LR // L)


def lora_grads_sorted(x_rows: jax.Array, members: Sequence[Member], key: jax.Array, *,
                      impl: str, acc: jax.Array | None = None, separate: bool = False
                      ) -> tuple[jax.Array | list[jax.Array], list[ProjectionGrads]]:
    """The backward of the members' folds over rows sorted by cell.

    Args:
      x_rows: ``[M, K]``, row ``r``'s input.
      members: the projections folded over these rows (gate and up: two).
      key: int32 ``[M]`` non-decreasing cells (:func:`cell_keys`); rows with
        key ``G`` fold nothing.
      impl: ``"fast"`` (the grouped_matmul kernels) or ``"jnp"``.
      acc: ``[M, K]`` to add the rows' ``dx`` to, or None.
      separate: return each member's ``dx`` (one launch for all of them)
        instead of their sum (one launch each, accumulating); ``acc`` unused.

    Returns:
      ``(dx_rows [M, K] in x's dtype (a list of them with separate),
      [ProjectionGrads per member])``.
    """
    L = members[0].loras
    grp = _by_expert(members, key) if L > 1 else _by_cell(members, key)
    xa = gm.gmm([gm.GmmSet(x_rows, r, grp.offsets, sl, 0, pl) for r, pl, sl in grp.a],
                transpose_rhs=True, impl=impl)
    # d_xa = round(s * (g B)): the cell's scale applied to the fp32 product
    # (by expert: round(g round(s B)))
    d_xa = gm.gmm([gm.GmmSet(m.g, r, grp.offsets, sl, m.g_plane, pl, al)
                   for m, (r, pl, sl, al) in zip(members, grp.b)], impl=impl)
    if grp.masks is not None:
        xa = [jnp.where(mk, v, jnp.zeros((), v.dtype)) for mk, v in zip(grp.masks, xa)]
        d_xa = [jnp.where(mk, v, jnp.zeros((), v.dtype)) for mk, v in zip(grp.masks, d_xa)]
    sets = []
    for m, xa_m, dxa in zip(members, xa, d_xa):
        sets += [gm.TgmmSet(dxa, x_rows, grp.offsets),
                 gm.TgmmSet(m.g, xa_m, grp.offsets, m.g_plane)]
    red = gm.tgmm(sets, impl=impl)
    dx_sets = [gm.GmmSet(dxa, r, grp.offsets, sl, 0, pl)
               for dxa, (r, pl, sl) in zip(d_xa, grp.a_dx)]
    if separate:
        dx = gm.gmm(dx_sets, impl=impl)
    else:
        dx = acc
        for dx_set in dx_sets:
            dx = gm.gmm([dx_set], acc=None if dx is None else [dx], impl=impl)[0]
    grads = []
    for i, m in enumerate(members):
        da, gxa = red[2 * i:2 * i + 2]  # [G, R, K] and [G, N, R]: sums of d_xa^T x and g^T xa
        if grp.masks is not None:
            da, gxa = _cells(da, L, False), _cells(gxa, L, True)
        P = m.pool_size
        b_pool = _pool(m.b_pool, m.plane)
        # ds = sum_rows xa . (g B) = <g^T xa, B>, from the fp32 sums
        b_cells = b_pool[jnp.clip(m.b_slot, 0, P - 1)].astype(_F32)
        ds = jnp.where(m.b_slot >= 0, jnp.sum(gxa * b_cells, axis=(1, 2)), 0.0)
        grads.append(ProjectionGrads(
            _pool_sum(da, m.a_slot, P, m.a_pool.dtype),
            _pool_sum(gxa * m.scale[:, None, None], m.b_slot, P, m.b_pool.dtype), ds))
    return dx, grads


def lora_grads(x_rows: jax.Array, members: Sequence[Member], key: jax.Array, *, impl: str,
               acc: jax.Array | None = None) -> tuple[jax.Array, list[ProjectionGrads]]:
    """:func:`lora_grads_sorted` for rows in any order: rows already sorted by
    cell (checked on the device) are used in place, others are sorted first
    (``x_rows`` and the cotangents permuted, ``dx`` permuted back)."""

    def in_place(x_rows, members, key, acc):
        return lora_grads_sorted(x_rows, members, key, impl=impl, acc=acc)

    def permuted(x_rows, members, key, acc):
        order = jnp.argsort(key, stable=True).astype(jnp.int32)
        ms = [dataclasses.replace(m, g=m.g_rows()[order], g_plane=0) for m in members]
        dx, grads = lora_grads_sorted(x_rows[order], ms, key[order], impl=impl,
                                      acc=None if acc is None else acc[order])
        return jnp.zeros_like(dx).at[order].set(dx, unique_indices=True), grads

    is_sorted = jnp.all(key[1:] >= key[:-1])
    return jax.lax.cond(is_sorted, in_place, permuted, x_rows, list(members), key, acc)
