"""Binary search over small sorted tables without a while loop.

``jnp.searchsorted``'s default method is a ``fori_loop`` of ``log2(n)`` steps,
which XLA runs as a while loop; on the GPU each step of a while loop reads its
predicate back to the host, a round trip of several microseconds per step in
the middle of a layer. Every search in this library has a small side (the
``E + 1`` expert offsets, the tiles of a cell table, a batch's streams), so it
compares every pair instead: one fused compare-and-count, O(len(a) * len(v))
work, no loop and no host round trip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["searchsorted"]


def searchsorted(a: jax.Array, v: jax.Array, *, side: str = "left") -> jax.Array:
    """``jnp.searchsorted(a, v, side=side)`` (int32, same results), computed by
    comparing every element of the sorted 1-D ``a`` with every query of ``v``
    (no while loop: see the module docstring)."""
    return jnp.searchsorted(a, v, side=side, method="compare_all").astype(jnp.int32)
