"""Several projections that share ``x`` and routing, folded in one launch.

Gate and up read the same ``x`` rows with the same expert ids and adapters;
only their pools and tables differ. A :class:`StackedRoute` holds ``S`` such
routes, stored as the one route of "virtual experts" that a single launch
folds (column ``s * E_t + e`` of its tables is projection ``s``'s expert
``e``), so a fold converts nothing per call. Build it once, where the adapter
state is built: with :func:`stack_routes` (which copies the pools), or as
``nnx.MoELoRA`` does, which stores gate and up in this layout
(``routes().gate_up`` is a ``StackedRoute`` of the stored arrays).

The folds accept it with ``base_out`` stacked the same way (``[S, rows,
n_out]``) and return ``[S, rows, n_out]``: the gather fold of interleaved
token rows (``fold_token_projections``) reads the virtual route as stored;
the other folds ``jax.vmap`` the single-route fold over the per-projection
view, which the folds' batching rule (``ops/batching.py``) turns into one
launch over virtual experts. Both are bit-identical to ``S`` separate folds.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jax_moelora.tables import MoeExpertRoute, SlotsPytree

__all__ = ["StackedRoute", "stack_routes", "fold_stacked"]


@jax.tree_util.register_pytree_node_class
class StackedRoute(SlotsPytree):
    """``S`` projections' routes with equal shapes, stored as the one route of
    virtual experts that the folds read (so a fold converts nothing per call).

    Leaves (the stored layout):

    - ``a_pool [S, P, R, K]``, ``b_pool [S, P, N, R]``: projection ``s``'s
      pools in ``[s]`` (read by the folds as ``[S * P, ...]``, a reshape);
    - ``a_cells``, ``b_cells`` int32 ``[L, S * E_t]``: column ``s * E_t + e``
      is projection ``s``'s expert ``e``; a pair in pool slot ``c`` of
      projection ``s`` (``0 < c < P``) is stored as ``s * P + c``, no pair as
      0, and any other cell (outside the pool) as -1, which folds nothing and
      which the checked mode (``validate=True``) still reports;
    - ``scales`` f32 ``[L, S * E_t]``, the same columns.

    Build it with :func:`stack_routes` (from ``S`` routes) or
    :meth:`from_tables` (from ``[S, ...]`` arrays). The per-projection view
    is computed on request: ``a_table``, ``b_table``, ``scale_table`` (``[S,
    L, E_t]``, each projection's own pool slots, 0 for no pair, -1 for a
    cell outside the pool) and
    ``route(s)``; :meth:`virtual` is the stored arrays as one
    ``MoeExpertRoute``.
    """

    __slots__ = ("a_pool", "b_pool", "a_cells", "b_cells", "scales")

    @classmethod
    def from_tables(cls, a_pool: Any, b_pool: Any, a_table: Any, b_table: Any,
                    scale_table: Any) -> "StackedRoute":
        """From pools ``[S, P, ...]`` and per-projection tables ``[S, L, E_t]``."""
        a_pool, b_pool = jnp.asarray(a_pool), jnp.asarray(b_pool)
        S, P = a_pool.shape[0], a_pool.shape[1]

        def columns(t):  # [S, L, E] -> [L, S * E]
            t = jnp.asarray(t)
            return jnp.transpose(t, (1, 0, 2)).reshape(t.shape[1], S * t.shape[2])

        def cells(t):
            member = jnp.arange(S, dtype=jnp.int32)[:, None, None]
            return columns(stored_cells(jnp.asarray(t, jnp.int32), member, P))

        return cls.tree_unflatten(None, [a_pool, b_pool, cells(a_table), cells(b_table),
                                         columns(jnp.asarray(scale_table, jnp.float32))])

    @property
    def num_routes(self) -> int:
        return int(self.a_pool.shape[0])

    @property
    def pool_size(self) -> int:
        """``P``, the pool slots of each projection."""
        return int(self.a_pool.shape[1])

    @property
    def n_experts(self) -> int:
        """``E_t`` of every projection (the tables' length)."""
        return int(self.a_cells.shape[-1]) // self.num_routes

    @property
    def max_loras(self) -> int:
        return int(self.a_cells.shape[0])

    def _per_projection(self, t: jax.Array, slots: bool) -> jax.Array:
        S, E = self.num_routes, self.n_experts
        t = jnp.transpose(t.reshape(t.shape[0], S, E), (1, 0, 2))      # [S, L, E]
        if not slots:
            return t
        lo = (jnp.arange(S, dtype=jnp.int32) * self.pool_size)[:, None, None]
        own = jnp.where((t > lo) & (t < lo + self.pool_size), t - lo, -1)
        return jnp.where(t == 0, 0, own).astype(jnp.int32)

    @property
    def a_table(self) -> jax.Array:
        """int32 ``[S, L, E_t]``: each projection's A pool slots."""
        return self._per_projection(self.a_cells, True)

    @property
    def b_table(self) -> jax.Array:
        """int32 ``[S, L, E_t]``: each projection's B pool slots."""
        return self._per_projection(self.b_cells, True)

    @property
    def scale_table(self) -> jax.Array:
        """float32 ``[S, L, E_t]``."""
        return self._per_projection(self.scales, False)

    def route(self, s: int) -> MoeExpertRoute:
        """Projection ``s`` as a ``MoeExpertRoute`` (its own pool slots)."""
        return _single(tuple(getattr(self, n)[s] for n in MoeExpertRoute.__slots__))

    def virtual(self) -> MoeExpertRoute:
        """The ``S`` projections as one ``MoeExpertRoute`` of virtual experts:
        tables ``[L, S * E_t]``, pools ``[S * P, ...]`` (the stored arrays,
        pools reshaped)."""
        S, P = self.num_routes, self.pool_size
        return _single((self.a_pool.reshape((S * P,) + tuple(self.a_pool.shape[2:])),
                        self.b_pool.reshape((S * P,) + tuple(self.b_pool.shape[2:])),
                        self.a_cells, self.b_cells, self.scales))

    def __repr__(self) -> str:
        return f"StackedRoute(S={self.num_routes}, {self.route(0)!r})"


def stored_cells(cells: Any, member: Any, pool_size: int) -> jax.Array:
    """Member ``member``'s table cells (its own pool slots) as a
    ``StackedRoute`` stores them: ``member * pool_size + c`` for a slot ``c``
    in ``(0, pool_size)``, 0 for 0 (no pair), -1 for any other cell."""
    inside = (cells > 0) & (cells < pool_size)
    return jnp.where(cells == 0, 0, jnp.where(inside, cells + member * pool_size, -1)).astype(
        jnp.int32)


def _single(leaves) -> MoeExpertRoute:
    return MoeExpertRoute.tree_unflatten(None, list(leaves))


def stack_routes(*routes: MoeExpertRoute) -> StackedRoute:
    """Stack routes of equal shapes (pools, tables, dtype) into one.

    Raises ``ValueError`` naming the first field whose shape differs, or
    ``TypeError`` when an argument is not a ``MoeExpertRoute``.
    """
    if len(routes) < 1:
        raise ValueError("stack_routes: give at least one route")
    for i, r in enumerate(routes):
        if not isinstance(r, MoeExpertRoute):
            raise TypeError(f"stack_routes: argument {i} is a {type(r).__name__}, not a "
                            "MoeExpertRoute")
    first = routes[0]
    for i, r in enumerate(routes[1:], 1):
        for name in MoeExpertRoute.__slots__:
            a, b = getattr(first, name), getattr(r, name)
            if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
                raise ValueError(
                    f"stack_routes: route {i}'s {name} is {b.dtype}{list(b.shape)}, route 0's is "
                    f"{a.dtype}{list(a.shape)}; stacked routes need equal shapes (pad the pools and "
                    "tables to a common size)")
    return StackedRoute.from_tables(
        *[jnp.stack([getattr(r, n) for r in routes]) for n in MoeExpertRoute.__slots__])


def fold_stacked(fn: str, fold: Callable[[Any, MoeExpertRoute], jax.Array], base_out: Any,
                 route: StackedRoute) -> jax.Array:
    """``fold(base_out_s, route_s)`` for every ``s``, as one batched call.

    ``fold`` closes over the operands the projections share (``x``, ids,
    row-adapter map, static arguments)."""
    shape = getattr(base_out, "shape", None)
    if shape is None or len(shape) != 3 or shape[0] != route.num_routes:
        raise ValueError(f"{fn}: with a StackedRoute of {route.num_routes} routes, base_out must be "
                         f"[{route.num_routes}, rows, n_out], got shape "
                         f"{None if shape is None else tuple(shape)}")
    return jax.vmap(lambda b, leaves: fold(b, _single(leaves)))(
        base_out, tuple(getattr(route, n) for n in MoeExpertRoute.__slots__))
