"""Several projections that share ``x`` and routing, folded in one launch.

Gate and up read the same ``x`` rows with the same expert ids and adapters;
only their pools and tables differ. A :class:`StackedRoute` holds ``S`` such
routes with a leading axis on every array (build it once, with
:func:`stack_routes`, where the adapter state is built: stacking copies the
pools; ``nnx.MoELoRA`` stores gate and up stacked, and its
``routes().gate_up`` is a ``StackedRoute`` of the stored arrays). The folds accept it with ``base_out`` stacked the same way
(``[S, rows, n_out]``) and return ``[S, rows, n_out]``; under the hood they
``jax.vmap`` the single-route fold over ``S``, which the folds' batching rule
(``ops/batching.py``) turns into one launch over virtual experts, bit-identical
to ``S`` separate folds.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jax_moelora.tables import MoeExpertRoute, SlotsPytree

__all__ = ["StackedRoute", "stack_routes", "fold_stacked"]


@jax.tree_util.register_pytree_node_class
class StackedRoute(SlotsPytree):
    """``S`` projections' routes with equal shapes, stacked on a leading axis.

    Arrays: ``a_pool [S, P, R, K]``, ``b_pool [S, P, N, R]``, ``a_table``,
    ``b_table`` int32 ``[S, L, E_t]``, ``scale_table`` f32 ``[S, L, E_t]``.
    ``route(s)`` is projection ``s`` as a ``MoeExpertRoute``.
    """

    __slots__ = MoeExpertRoute.__slots__

    @property
    def num_routes(self) -> int:
        return int(self.a_pool.shape[0])

    @property
    def n_experts(self) -> int:
        """``E_t`` of every projection (the tables' length)."""
        return int(self.a_table.shape[-1])

    def route(self, s: int) -> MoeExpertRoute:
        """Projection ``s`` (a slice of every array)."""
        return _single(tuple(getattr(self, n)[s] for n in self.__slots__))

    def __repr__(self) -> str:
        return f"StackedRoute(S={self.num_routes}, {self.route(0)!r})"


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
        for name in StackedRoute.__slots__:
            a, b = getattr(first, name), getattr(r, name)
            if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
                raise ValueError(
                    f"stack_routes: route {i}'s {name} is {b.dtype}{list(b.shape)}, route 0's is "
                    f"{a.dtype}{list(a.shape)}; stacked routes need equal shapes (pad the pools and "
                    "tables to a common size)")
    return StackedRoute.tree_unflatten(
        None, [jnp.stack([getattr(r, n) for r in routes]) for n in StackedRoute.__slots__])


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
        base_out, tuple(getattr(route, n) for n in StackedRoute.__slots__))
