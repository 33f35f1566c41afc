"""Random fold inputs for the transformation tests (autodiff, vmap, sharding).

Imported by ``test_autodiff.py``, ``test_vmap.py`` and the subprocess
workers of ``test_sharding.py`` / ``test_distributed.py``; it must not
initialise JAX's backends at import time (the workers set ``XLA_FLAGS``
first).

Routes are drawn with ``L`` table rows over ``E`` experts: most cells adapted
(slots ``1 .. P-1``), a quarter 0 (not adapted), one ``a`` cell pointing
outside the pool. Ids and row-adapter values include out-of-range ones, so
every skip rule of docs/semantics.md §5 is exercised.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jax_moelora.tables import MoeExpertRoute


class Case(NamedTuple):
    x: object          # [T, K] (x_gather=1) or [T * top_k, K]
    base_out: object   # [T * top_k, N]
    topk_ids: object   # int32 [T, top_k]
    row_adapter: object  # int32 [T] or None
    route: MoeExpertRoute
    top_k: int
    x_gather: int


def make_route(rng: np.random.Generator, *, P: int = 9, R: int = 8, K: int = 24, N: int = 16,
               L: int = 2, E: int = 6, dtype=jnp.float32) -> MoeExpertRoute:
    a_table = rng.integers(1, P, (L, E))
    b_table = rng.integers(1, P, (L, E))
    a_table[rng.random((L, E)) < 0.25] = 0
    b_table[rng.random((L, E)) < 0.1] = 0
    a_table[-1, -1] = P  # outside the pool: folds nothing
    scale = rng.uniform(0.5, 2.0, (L, E)) * rng.choice([-1.0, 1.0], (L, E))
    return MoeExpertRoute(
        a_pool=jnp.asarray(rng.normal(size=(P, R, K)) / np.sqrt(K), dtype),
        b_pool=jnp.asarray(rng.normal(size=(P, N, R)) / np.sqrt(R), dtype),
        a_table=jnp.asarray(a_table, jnp.int32), b_table=jnp.asarray(b_table, jnp.int32),
        scale_table=jnp.asarray(scale, jnp.float32))


def make_case(rng: np.random.Generator, *, T: int = 7, top_k: int = 2, x_gather: int = 1,
              with_row_adapter: bool = True, dtype=jnp.float32, **route_kw) -> Case:
    route = make_route(rng, dtype=dtype, **route_kw)
    K, N, L, E = route.k_in, route.n_out, route.max_loras, route.n_experts
    x = jnp.asarray(rng.normal(size=(T if x_gather else T * top_k, K)), dtype)
    base = jnp.asarray(rng.normal(size=(T * top_k, N)), dtype)
    ids = jnp.asarray(rng.integers(-1, E + 1, (T, top_k)), jnp.int32)
    ra = None
    if with_row_adapter:
        ra = jnp.asarray(rng.integers(-1, L + 1, (T,)), jnp.int32)
    return Case(x, base, ids, ra, route, top_k, x_gather)


def sorted_layout(topk_ids, n_experts: int):
    """``(order, expert_offsets, sorted_token_ids)`` (int32) of the grouped fold
    (stable sort by expert; ids outside ``[0, n_experts)`` land in no span)."""
    ids = np.asarray(topk_ids)
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable").astype(np.int32)
    offsets = np.searchsorted(flat[order], np.arange(n_experts + 1), side="left").astype(np.int32)
    return jnp.asarray(order), jnp.asarray(offsets), jnp.asarray(order // top_k, jnp.int32)
