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
                   meta_fields=["plane", "g_plane"])
@dataclasses.dataclass(frozen=True)
class Member:
    """One projection of the rows: its pools and per-cell tables, and its cotangent.

    ``a_pool [..., P, R, K]`` and ``b_pool [..., P, N, R]`` are read at plane
    ``plane`` of their leading dimensions; ``a_slot``, ``b_slot`` int32
    ``[G]`` are cell ``g``'s pool slots (-1: the cell folds nothing),
    ``scale`` f32 ``[G]``; ``g [..., M, N]`` is the rows' cotangent, at plane
    ``g_plane``. A pytree whose planes are static.
    """

    a_pool: jax.Array
    b_pool: jax.Array
    plane: int
    a_slot: jax.Array
    b_slot: jax.Array
    scale: jax.Array
    g: jax.Array
    g_plane: int = 0

    @property
    def pool_size(self) -> int:
        return int(self.a_pool.shape[-3])

    def g_rows(self) -> jax.Array:
        return self.g.reshape((-1,) + self.g.shape[-2:])[self.g_plane]


class ProjectionGrads(NamedTuple):
    """A member's cotangents: ``d_a_pool [P, R, K]``, ``d_b_pool [P, N, R]``
    (f32) and ``d_scale`` f32 ``[G]`` per cell."""

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
                  jnp.where(ok, b, -1).astype(jnp.int32), scale, g, g_plane)


def cell_keys(L: int, E: int, adapter: jax.Array, expert: jax.Array, ok: jax.Array) -> jax.Array:
    """int32 ``[M]``: each row's cell ``e * L + l``, or ``L * E`` for a row
    that folds with no cell (``ok`` false, an adapter ``< 0`` or a row ``>= L``
    when ``L > 1``, an expert outside ``[0, E)``). With ``L == 1`` every
    adapter ``>= 0`` is table row 0 (docs/semantics.md §3)."""
    l = jnp.zeros_like(adapter) if L == 1 else adapter
    valid = ok & (adapter >= 0) & (l < L) & (expert >= 0) & (expert < E)
    key = jnp.clip(expert, 0, E - 1) * L + jnp.clip(l, 0, L - 1)
    return jnp.where(valid, key, L * E).astype(jnp.int32)


def _pool_sum(cells: jax.Array, slot: jax.Array, P: int) -> jax.Array:
    """``[G, ...]`` per-cell sums added into ``[P, ...]`` at each cell's slot
    (a slot of -1 is dropped)."""
    return jnp.zeros((P,) + cells.shape[1:], _F32).at[jnp.where(slot >= 0, slot, P)].add(
        cells, mode="drop")


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
    G = members[0].a_slot.shape[0]
    counts = jnp.zeros((G + 1,), jnp.int32).at[key].add(1)[:G]
    offsets = gm.group_offsets(counts)
    xa = gm.gmm([gm.GmmSet(x_rows, m.a_pool, offsets, m.a_slot, 0, m.plane) for m in members],
                transpose_rhs=True, impl=impl)
    # d_xa = round(s * (g B)): the cell's scale applied to the fp32 product
    d_xa = gm.gmm([gm.GmmSet(m.g, m.b_pool, offsets, m.b_slot, m.g_plane, m.plane, m.scale)
                   for m in members], impl=impl)
    sets = []
    for m, xa_m, dxa in zip(members, xa, d_xa):
        sets += [gm.TgmmSet(dxa, x_rows, offsets), gm.TgmmSet(m.g, xa_m, offsets, m.g_plane)]
    red = gm.tgmm(sets, impl=impl)
    dx_sets = [gm.GmmSet(dxa, m.a_pool, offsets, m.a_slot, 0, m.plane)
               for m, dxa in zip(members, d_xa)]
    if separate:
        dx = gm.gmm(dx_sets, impl=impl)
    else:
        dx = acc
        for dx_set in dx_sets:
            dx = gm.gmm([dx_set], acc=None if dx is None else [dx], impl=impl)[0]
    grads = []
    for i, m in enumerate(members):
        da, gxa = red[2 * i:2 * i + 2]  # [G, R, K] and [G, N, R]: sums of d_xa^T x and g^T xa
        P = m.pool_size
        b_pool = m.b_pool.reshape((-1,) + m.b_pool.shape[-3:])[m.plane]
        # ds = sum_rows xa . (g B) = <g^T xa, B>, from the fp32 sums
        b_cells = b_pool[jnp.clip(m.b_slot, 0, P - 1)].astype(_F32)
        ds = jnp.where(m.b_slot >= 0, jnp.sum(gxa * b_cells, axis=(1, 2)), 0.0)
        grads.append(ProjectionGrads(_pool_sum(da, m.a_slot, P),
                                     _pool_sum(gxa * m.scale[:, None, None], m.b_slot, P), ds))
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
