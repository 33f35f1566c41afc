"""The LoRA backward as grouped matmuls over (adapter, expert) cells.

For rows folded with pair ``(A, B)`` and scale ``s`` of their table cell, the
fold's backward (``ops/autodiff.py``) is::

    xa   = round(x A^T)            u    = round(g B)        d_xa = round(s * u)
    dx  += d_xa A                  dA   = sum_rows d_xa^T x
    dB   = s * sum_rows g^T xa     ds   = sum_rows xa . u

With the rows of each cell contiguous, every term is a grouped matmul whose
groups are the cells (``ops/grouped_matmul.py``): ``xa``, ``u`` and ``dx``
are ``gmm`` s reading each cell's ``A`` or ``B`` in place at its pool slot,
and the two sums are ``tgmm`` s writing each cell's sum at its pool slot
(``groups_of``), ``dB``'s scale applied in the kernel's epilogue; ``d_xa``
is elementwise over ``[M, R]`` and ``ds`` the trace of each cell's ``[R,
R]`` sum of ``xa^T u`` (a third ``tgmm``). On a Hopper GPU that is five
launches of the CUTLASS grouped GEMM for any number of projections sharing
the rows (gate and up: one launch each for ``xa``, ``u``, the pool sums and
the scale sums, one ``dx`` launch each), and nothing is allocated in
proportion to the pools beyond their cotangents.

The rows' layout: expert ``e``'s rows (``offsets``) hold first those that
fold nothing, then cell ``e * L``'s, ``e * L + 1``'s, ... (what
``sort_rows_by_expert`` with ``row_adapter`` gives, and how the folds sort
theirs: :func:`expert_offsets_of`). Group ``e * (L + 1) + i`` of the matmuls
is expert ``e``'s rows that fold nothing (``i = 0``, skipped) or cell ``e *
L + i - 1``'s. Rows in any other order are sorted into that layout first
(one permutation of ``x``, the cotangents and ``dx``); so are the rows of
tables where two cells share a pool slot, whose per-cell sums are then added
into fp32 pools. One ``lax.cond`` a call decides (on a GPU its predicate is
read by the host once per call); with ``rows_by_cell`` the caller promises
the layout and the predicate reads the tables only.

The stacked form (``stacked``; by default where cells hold few rows,
:func:`stacked_default`) takes the three wide terms by expert instead, one
group an expert: ``spread(v) [M, L * R]`` puts each row's ``v [M, R]`` in
its adapter's ``R`` columns (zeros elsewhere), ``A_e [L * R, K]`` stacks
expert ``e``'s cells' ``A`` blocks (gathered from the pool), and::

    dx  += spread(d_xa) A_e
    dA_e = sum_rows spread(d_xa)^T x        dB_e = sum_rows g^T spread(xa)

the ``[L * R, K]`` and ``[N, L * R]`` sums then moved to the cells' slots
(``dB`` scaled on the way). A tile spans an expert's rows of every adapter
where the cells' own tiles would each hold a cell's few rows: ``L`` times
fewer tiles for the price of a gather of the ``A`` blocks and a copy of the
sums. It adds products by the spread's zeros, exact for finite values, so
it runs only where ``x``, the cotangents and the gathered ``A`` are finite
(the same ``cond``, then a ``switch``, reads them); elsewhere the cells'
own tiles keep a non-finite value in its cell.

Where the forward already made ``xa`` (``expert_matmul``'s kernel folding
inside its K loop leaves it spread by adapter, the gather fold by row), the
caller passes it (``lora_grads(xa=...)``) and the first ``gmm`` is not run:
the backward then reads no ``A`` block to make it again.

Numerics: every product accumulates in fp32; ``xa`` and ``u`` are rounded to
the activation dtype, ``d_xa`` once more after the scale (exact for a scale
that is a power of two), ``dx`` once per term it accumulates, the sums once
to the pools' dtype (the stacked form's ``dB`` once more after its scale).
Every kernel writes each output element from one CTA in a fixed order, and a
pool slot used by one cell receives one sum: the pool and scale cotangents
are the same bits on every run, in either form. (When several
cells share a pool slot, the slot's sum is a scatter-add whose order is not
fixed.)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_moelora import _ext
from jax_moelora.ops import grouped_matmul as gm
from jax_moelora.ops.jnp_fold import rounded
from jax_moelora.tables import MoeExpertRoute

__all__ = ["Member", "member", "cell_keys", "group_keys", "expert_offsets_of", "lora_grads",
           "ProjectionGrads", "stacked_default", "STACKED_MAX_ROWS", "STACKED_MAX_RANK"]

_F32 = jnp.float32

STACKED_MAX_ROWS = 32
"""Mean rows per cell at or below which :func:`stacked_default` takes the stacked form."""
STACKED_MAX_RANK = 32
"""Largest rank :func:`stacked_default` takes the stacked form at."""


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


def _rank(m: Member) -> int:
    """The rank ``R`` of a member's pools."""
    return int(m.a_pool.shape[-2])


def _slot_index(slot: jax.Array, P: int) -> jax.Array:
    """Each cell's pool slot, ``P`` (one past the pool) for a slot of -1."""
    return jnp.where(slot >= 0, slot, P)


def _shared(slot: jax.Array, P: int) -> jax.Array:
    """Whether two cells of ``slot`` (int32 ``[G]``, -1: none) share a pool slot."""
    return jnp.any(jnp.zeros((P + 1,), jnp.int32).at[_slot_index(slot, P)].add(1)[:P] > 1)


def _owners(slot: jax.Array, P: int) -> jax.Array:
    """int32 ``[P]``: the group whose sum each pool slot takes (distinct
    ``slot`` s), -1 for a slot of no group."""
    return jnp.full((P + 1,), -1, jnp.int32).at[_slot_index(slot, P)].set(
        jnp.arange(slot.shape[0], dtype=jnp.int32))[:P]


def _scatter_sum(sums: jax.Array, slot: jax.Array, P: int, dtype) -> jax.Array:
    """The pool cotangent of groups in any slots: their fp32 sums added into an
    fp32 pool by slot (a slot of -1 dropped), then cast to ``dtype``."""
    return jnp.zeros((P,) + sums.shape[1:], _F32).at[_slot_index(slot, P)].add(
        sums, mode="drop").astype(dtype)


def group_keys(key: jax.Array, offsets: jax.Array, L: int) -> jax.Array:
    """int32 ``[M]``: each row's group of the cell layout (module docstring),
    ``e * (L + 1)`` for a row of expert ``e`` that folds nothing, ``e * (L +
    1) + l + 1`` for cell ``e * L + l``; -1 before every expert's rows and
    ``E * (L + 1)`` after. Rows in the layout have non-decreasing keys."""
    M, E = key.shape[0], offsets.shape[0] - 1
    _, _, expert = gm.row_groups(offsets, M)  # E outside every group
    first = jnp.clip(offsets[0], 0, M)
    folds = key < E * L
    k2 = jnp.where(folds, (key // L) * (L + 1) + key % L + 1, expert * (L + 1))
    return jnp.where(expert < E, k2, jnp.where(jnp.arange(M) < first, -1, E * (L + 1)))


def _group_offsets(k2: jax.Array, offsets: jax.Array, J: int) -> jax.Array:
    """int32 ``[J + 1]``: the groups of rows in the cell layout (``k2`` non-decreasing)."""
    M = k2.shape[0]
    inside = (k2 >= 0) & (k2 < J)
    counts = jnp.zeros((J,), jnp.int32).at[jnp.where(inside, k2, J)].add(1, mode="drop")
    return jnp.clip(offsets[0], 0, M) + gm.group_offsets(counts)


class _Tables(NamedTuple):
    """A member's per-group tables: ``a``, ``b`` int32 ``[J]`` pool slots (-1:
    the group folds nothing), ``scale`` f32 ``[J]``."""

    a: jax.Array
    b: jax.Array
    scale: jax.Array


def _tables(m: Member, E: int) -> _Tables:
    L = m.loras
    def by_group(v, fill):
        return jnp.concatenate([jnp.full((E, 1), fill, v.dtype), v.reshape(E, L)], 1).reshape(-1)
    return _Tables(by_group(m.a_slot, -1), by_group(m.b_slot, -1), by_group(m.scale, 0.0))


def _in_calls(fn, items: list) -> list:
    """``fn`` over ``items`` in calls of at most ``GROUPED_MATMUL_MAX_SETS``
    (the operand sets of one ``grouped_matmul``), its results in order."""
    step = _ext.GROUPED_MATMUL_MAX_SETS
    return [v for i in range(0, len(items), step) for v in fn(items[i:i + step])]


def _cell_values(per_group: jax.Array, L: int) -> jax.Array:
    """``[G]`` per cell (``e * L + l``) from ``[E * (L + 1)]`` per group."""
    return per_group.reshape(-1, L + 1)[:, 1:].reshape(-1)


def _sums(sets: list, pools: list, exact: bool, impl: str) -> list[jax.Array]:
    """One ``tgmm`` of ``sets`` (their ``groups_of`` the pool slots' owners
    unless ``exact``): each set's pool cotangent in its pool's dtype (``pools``:
    ``(dtype, slots, P)``), from sums rounded by the kernel where the dtypes
    allow, else from fp32 sums; with ``exact`` the fp32 per-group sums added
    by slot."""
    if exact:
        sums = gm.tgmm([s._replace(groups_of=None) for s in sets], impl=impl)
        return [_scatter_sum(v, sl, P, dt) for v, (dt, sl, P) in zip(sums, pools)]
    rounded = all(jnp.dtype(dt) == jnp.dtype(s.lhs.dtype) for s, (dt, _, _) in zip(sets, pools))
    return [v.astype(dt) for v, (dt, _, _) in
            zip(gm.tgmm(sets, impl=impl, rounded=rounded), pools)]


def expert_offsets_of(key: jax.Array, L: int, E: int) -> jax.Array:
    """int32 ``[E + 1]``: the expert groups of rows sorted by cell (``key``
    non-decreasing, the rows that fold nothing, key ``L * E``, last)."""
    counts = jnp.zeros((E + 1,), jnp.int32).at[jnp.minimum(key // L, E)].add(1)[:E]
    return gm.group_offsets(counts)


def stacked_default(rows: int, experts: int, loras: int, rank: int) -> bool:
    """What ``stacked=None`` takes: the stacked form (module docstring) when
    there are several adapters, a cell holds on average at most
    :data:`STACKED_MAX_ROWS` rows (``rows / (experts * loras)``) and the rank
    is at most :data:`STACKED_MAX_RANK`. There the cells' own tiles are mostly
    empty and their count, not bytes, bounds the wide terms, while the copies
    the stacked form adds (about three passes over the pools) stay small."""
    return (loras > 1 and rows <= STACKED_MAX_ROWS * experts * loras
            and rank <= STACKED_MAX_RANK)


def lora_grads(x_rows: jax.Array, members: Sequence[Member], key: jax.Array,
               offsets: jax.Array, *, impl: str, acc: jax.Array | None = None,
               separate: bool = False, rows_by_cell: bool = False,
               stacked: bool | None = None, xa: Sequence[jax.Array] | None = None
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
        in any order (the cell layout of the module docstring runs fastest).
        Rows outside every group fold nothing.
      impl: ``"fast"`` (the grouped_matmul kernels) or ``"jnp"``.
      acc: ``[M, K]`` to add the rows' ``dx`` to, or None.
      separate: return each member's ``dx`` (one launch for all of them)
        instead of their sum (one launch each, accumulating); ``acc`` unused.
      rows_by_cell: the caller's rows are in the cell layout (static).
      stacked: the wide terms by expert over the stacked cells (module
        docstring) where the values allow; None: :func:`stacked_default`.
      xa: per member, the rows' ``round(x A^T)`` as its forward computed
        them, zeros for a row that folds nothing: by row, ``[M, R]`` (what
        the gather fold leaves), or spread by adapter, ``[M, L * R]``, row
        ``r``'s in the ``R`` columns of its cell's adapter, zeros elsewhere
        (what ``expert_matmul``'s kernel leaves when it folds inside its K
        loop); the two are one with ``L == 1``. None: computed here (one
        ``gmm`` more).

    Returns:
      ``(dx_rows [M, K] in x's dtype (a list of them with separate),
      [ProjectionGrads per member])``. A row that folds nothing has ``dx``
      ``acc`` (or 0).
    """
    L, G = members[0].loras, members[0].a_slot.shape[0]
    E = G // L
    R = max(_rank(m) for m in members)
    if stacked is None:
        stacked = stacked_default(x_rows.shape[0], E, L, R)
    k2 = group_keys(key, offsets, L)
    shared = functools.reduce(jnp.logical_or, [_shared(m.a_slot, m.pool_size) |
                                               _shared(m.b_slot, m.pool_size) for m in members])
    fast = ~shared if rows_by_cell else ~shared & jnp.all(k2[1:] >= k2[:-1])
    tables = [_tables(m, E) for m in members]
    kw = dict(impl=impl, acc=None if separate else acc, separate=separate,
              xa=None if xa is None else list(xa))
    branches = [lambda: _cell_grads(x_rows, members, tables, key, k2, offsets, general=True,
                                    **kw),
                lambda: _cell_grads(x_rows, members, tables, key, k2, offsets, general=False,
                                    **kw)]
    if not stacked:
        return jax.lax.cond(fast, branches[1], branches[0])
    a_cells = [_a_cells(m, E) for m in members]
    finite = functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(v)) for v in
                                                [x_rows, *a_cells] + [m.g_rows() for m in members]])
    branches.append(lambda: _stacked_grads(x_rows, members, tables, a_cells, key, k2, offsets,
                                           **kw))
    return jax.lax.switch(jnp.where(fast, jnp.where(finite, 2, 1), 0), branches)


def _cell_terms(x, members, tables, key, goff, impl, kept=None):
    """``(xa, d_xa, d_scale)`` per member over the cells' groups ``goff``:
    ``xa [M, R]`` (taken from ``kept``, the ``xa`` of :func:`lora_grads`,
    when given) and ``d_xa [M, R]`` in the activation dtype, ``d_scale`` f32
    ``[G]``."""
    G = members[0].a_slot.shape[0]
    if kept is None:
        xa = gm.gmm([gm.GmmSet(x, m.a_pool, goff, t.a, 0, m.plane)
                     for m, t in zip(members, tables)], transpose_rhs=True, impl=impl)
    else:
        xa = [v if v.shape[1] == _rank(m) else _unspread(v, key, m.loras, G)
              for v, m in zip(kept, members)]
    u = gm.gmm([gm.GmmSet(m.g, m.b_pool, goff, t.b, m.g_plane, m.plane)
                for m, t in zip(members, tables)], impl=impl)
    d_xa = []
    for m, u_m in zip(members, u):
        s_row = jnp.concatenate([m.scale, jnp.zeros((1,), _F32)])[jnp.minimum(key, G)]
        d_xa.append(rounded(s_row[:, None] * u_m.astype(_F32), u_m.dtype))
    # ds = sum_rows xa . u: the trace of each group's fp32 sum of xa^T u (a
    # kernel's fixed order, where a scatter-add by cell would not be)
    sums_xu = _in_calls(lambda ss: gm.tgmm(ss, impl=impl),
                        [gm.TgmmSet(a, b, goff) for a, b in zip(xa, u)])
    d_scale = [_cell_values(jnp.trace(t, axis1=1, axis2=2), m.loras)
               for t, m in zip(sums_xu, members)]
    return xa, d_xa, d_scale


def _dx(dx_sets, acc, separate: bool, impl: str):
    """The ``gmm`` s of ``dx``: one launch of all sets (``separate``: one
    ``dx`` each) or one launch a set accumulating into ``acc``."""
    if separate:
        return gm.gmm(dx_sets, impl=impl)
    dx = acc
    for dx_set in dx_sets:
        dx = gm.gmm([dx_set], acc=None if dx is None else [dx], impl=impl)[0]
    return dx


def _cell_grads(x, members, tables, key, k2, offsets, *, impl, acc, separate, general, xa):
    """:func:`lora_grads` on rows in the cell layout, whose pool cotangents are
    written at the slots (``general``: the rows sorted into the layout first
    and the per-group sums added by slot)."""
    M = x.shape[0]
    J = tables[0].a.shape[0]
    if general:
        order = jnp.argsort(k2, stable=True).astype(jnp.int32)
        x, key, k2 = x[order], key[order], k2[order]
        members = [dataclasses.replace(m, g=jnp.take(m.g, order, axis=-2)) for m in members]
        acc = None if acc is None else acc[order]
        xa = None if xa is None else [v[order] for v in xa]
    goff = _group_offsets(k2, offsets, J)
    xa, d_xa, d_scale = _cell_terms(x, members, tables, key, goff, impl, xa)
    dx = _dx([gm.GmmSet(d, m.a_pool, goff, t.a, 0, m.plane)
              for d, m, t in zip(d_xa, members, tables)], acc, separate, impl)
    sets, pools = [], []
    for m, t, d, xa_m in zip(members, tables, d_xa, xa):
        P = m.pool_size
        sets += [gm.TgmmSet(d, x, goff, groups_of=_owners(t.a, P)),
                 gm.TgmmSet(m.g, xa_m, goff, m.g_plane, 0, _owners(t.b, P), t.scale)]
        pools += [(m.a_pool.dtype, t.a, P), (m.b_pool.dtype, t.b, P)]
    sums = _in_calls(lambda part: _sums([a for a, _ in part], [b for _, b in part], general,
                                        impl), list(zip(sets, pools)))
    if general:
        inverse = jnp.zeros((M,), jnp.int32).at[order].set(jnp.arange(M, dtype=jnp.int32))
        dx = [d[inverse] for d in dx] if separate else dx[inverse]
    return dx, [ProjectionGrads(sums[2 * i], sums[2 * i + 1], ds)
                for i, ds in enumerate(d_scale)]


def _a_cells(m: Member, E: int) -> jax.Array:
    """``[E, L * R, K]``: expert ``e``'s cells' ``A`` blocks stacked (zeros
    for a cell that folds nothing), the ``dx`` operand of the stacked form."""
    a = _pool(m.a_pool, m.plane)
    got = jnp.take(a, jnp.clip(m.a_slot, 0, a.shape[0] - 1), axis=0)
    got = jnp.where((m.a_slot >= 0)[:, None, None], got, jnp.zeros((), a.dtype))
    return got.reshape(E, -1, a.shape[-1])


def _unspread(v: jax.Array, key: jax.Array, L: int, G: int) -> jax.Array:
    """``[M, R]``: each row's columns of its cell's adapter in ``v [M, L *
    R]`` (:func:`_spread`'s inverse), zeros for a row that folds nothing."""
    M = v.shape[0]
    col = jnp.where(key < G, key % L, 0)
    got = jnp.take_along_axis(v.reshape(M, L, -1), col[:, None, None], axis=1)[:, 0]
    return jnp.where((key < G)[:, None], got, jnp.zeros((), v.dtype))


def _spread(v: jax.Array, key: jax.Array, L: int, G: int) -> jax.Array:
    """``[M, L * R]``: row ``r``'s ``v [M, R]`` in the columns of its cell's
    adapter (``key % L``), zeros elsewhere and for a row that folds nothing."""
    M, R = v.shape
    col = jnp.where(key < G, key % L, L)
    own = (jnp.arange(L, dtype=jnp.int32)[None, :] == col[:, None])[:, :, None]
    return jnp.where(own, v[:, None, :], jnp.zeros((), v.dtype)).reshape(M, L * R)


def _by_slot(cells: jax.Array, slot: jax.Array, P: int) -> jax.Array:
    """A pool cotangent ``[P, ...]`` from per-cell values ``cells [G, ...]``
    (distinct slots): each slot takes its cell's value, zeros for no cell."""
    owner = _owners(slot, P)
    got = jnp.take(cells, jnp.clip(owner, 0, cells.shape[0] - 1), axis=0)
    return jnp.where((owner >= 0).reshape((-1,) + (1,) * (cells.ndim - 1)), got,
                     jnp.zeros((), cells.dtype))


def _stacked_grads(x, members, tables, a_cells, key, k2, offsets, *, impl, acc, separate, xa):
    """:func:`lora_grads` on rows in the cell layout with distinct slots and
    finite values, its wide terms by expert: ``dx = spread(d_xa) a_cells``,
    the ``dA`` cells from ``spread(d_xa)^T x`` and the ``dB`` cells from
    ``g^T spread(xa)`` (one tgmm group an expert), then moved to the slots."""
    G, L = members[0].a_slot.shape[0], members[0].loras
    E = G // L
    goff = _group_offsets(k2, offsets, tables[0].a.shape[0])
    xa_rows, d_xa, d_scale = _cell_terms(x, members, tables, key, goff, impl, xa)
    xa_sp = [v if v.shape[1] == L * r.shape[1] else _spread(r, key, L, G)
             for v, r in zip(xa if xa is not None else xa_rows, xa_rows)]
    d_sp = [_spread(d, key, L, G) for d in d_xa]
    dx = _dx([gm.GmmSet(d, a, offsets) for d, a in zip(d_sp, a_cells)], acc, separate, impl)
    # the sums rounded by the kernel where the pools take the operands' dtype
    # (dB then rounded once more after its scale, in the copy to the slots)
    rounded_ok = all(jnp.dtype(m.a_pool.dtype) == jnp.dtype(x.dtype) and
                     jnp.dtype(m.b_pool.dtype) == jnp.dtype(m.g.dtype) for m in members)
    sets = [gm.TgmmSet(d, x, offsets) for d in d_sp]
    sets += [gm.TgmmSet(m.g, v, offsets, m.g_plane) for m, v in zip(members, xa_sp)]
    sums = _in_calls(lambda ss: gm.tgmm(ss, impl=impl, rounded=rounded_ok), sets)
    da, db = sums[:len(members)], sums[len(members):]
    grads = []
    for m, da_m, db_m, ds in zip(members, da, db, d_scale):
        P, R = m.pool_size, da_m.shape[1] // L
        da_cells = da_m.reshape(G, R, -1)
        n = db_m.shape[1]
        db_cells = jnp.swapaxes(db_m.reshape(E, n, L, R), 1, 2).reshape(G, n, R)
        db_cells = db_cells.astype(_F32) * m.scale[:, None, None]
        grads.append(ProjectionGrads(_by_slot(da_cells, m.a_slot, P).astype(m.a_pool.dtype),
                                     _by_slot(db_cells, m.b_slot, P).astype(m.b_pool.dtype),
                                     ds))
    return dx, grads
