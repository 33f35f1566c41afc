"""Expert-parallel dispatch: rows to the devices that own their experts, and back.

Used inside a ``shard_map`` over a mesh axis of ``D`` devices, each of which
owns a contiguous range of experts. Every device holds ``n`` flat rows (its
tokens' ``t * top_k + k``), each bound for one destination device. The rows
travel in a **capacity-bounded layout**: a send buffer ``[D * C, ...]`` of
``D`` blocks of ``C`` rows, block ``j`` holding the rows bound for device
``j`` (in flat row order, zero-padded); after the exchange block ``j`` holds
the rows that came from device ``j``. The results come back the same way
and are read out into flat row order.

- :func:`plan_dispatch`: each row's position in the send buffer (traced jnp:
  a stable sort by destination, no host sync).
- :func:`exchange`: the buffer over the axis, one of :data:`EXCHANGES`:
  ``"all_to_all"`` (``jax.lax.all_to_all``: every block moves, padding
  included; runs on every backend) or ``"ragged_all_to_all"``
  (``jax.lax.ragged_all_to_all``: only each block's rows move; the same
  layout at both ends. XLA:CPU does not implement it, so it is for GPUs).

**Capacity and the drop rule.** ``C = n`` (the default of
:func:`capacity`) holds every row a device can send to one destination, so
no row is ever dropped and the result is exact. A smaller ``C`` (a capacity
factor ``f``: ``C = ceil(f * n / D)``) cuts the bytes of ``all_to_all`` and
the receive buffers by ``D / f``; a device then sends at most ``C`` rows to
each destination, the first ``C`` in flat row order (its earlier tokens
first), and the rows past them are **dropped**: they contribute zero to
their token's output, as if their routing weight were 0.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["EXCHANGES", "Dispatch", "capacity", "plan_dispatch", "exchange", "take_rows"]

Array = jax.Array

#: The collectives :func:`exchange` can use.
EXCHANGES = ("all_to_all", "ragged_all_to_all")


class Dispatch(NamedTuple):
    """Where each row goes (:func:`plan_dispatch`).

    Fields: ``slot`` int32 ``[n]``, each flat row's position in the send
    buffer ``[D * C]`` (``D * C`` for a dropped row); ``source`` int32 ``[D *
    C]``, each buffer position's flat row (``n`` for padding); ``counts``
    int32 ``[D]``, the rows sent to each destination (at most ``C``);
    ``kept`` bool ``[n]``, the rows not dropped.
    """

    slot: Array
    source: Array
    counts: Array
    kept: Array


def capacity(rows: int, devices: int, capacity_factor: float | None) -> int:
    """Rows of one destination's block: ``rows`` with ``capacity_factor``
    None (exact: no row is ever dropped), else ``min(rows, ceil(factor *
    rows / devices))`` (at least 1)."""
    if capacity_factor is None:
        return int(rows)
    return max(1, min(int(rows), math.ceil(float(capacity_factor) * rows / devices)))


def plan_dispatch(dest: Array, devices: int, capacity: int) -> Dispatch:
    """Positions of ``n`` rows in the send buffer ``[devices * capacity]``.

    Args:
      dest: int32 ``[n]``, each row's destination in ``[0, devices)``.
      devices: ``D``, the axis size.
      capacity: ``C``, rows of one block; a row whose rank among the rows
        bound for its destination (flat order) is ``>= C`` is dropped.

    Returns:
      A :class:`Dispatch`. Traced jnp (one stable sort), no host sync.
    """
    n = dest.shape[0]
    dest = dest.astype(jnp.int32)
    order = jnp.argsort(dest, stable=True).astype(jnp.int32)
    per_dest = jnp.zeros((devices,), jnp.int32).at[dest].add(1, mode="drop")
    starts = jnp.cumsum(per_dest) - per_dest
    rank_sorted = jnp.arange(n, dtype=jnp.int32) - starts[dest[order]]
    rank = jnp.zeros((n,), jnp.int32).at[order].set(rank_sorted)
    kept = rank < capacity
    slot = jnp.where(kept, dest * capacity + rank, devices * capacity).astype(jnp.int32)
    source = jnp.full((devices * capacity,), n, jnp.int32).at[slot].set(
        jnp.arange(n, dtype=jnp.int32), mode="drop")
    return Dispatch(slot, source, jnp.minimum(per_dest, capacity), kept)


def take_rows(values: Array, index: Array, fill=0) -> Array:
    """``values[index]`` along axis 0, ``fill`` where ``index`` is out of range."""
    return jnp.take(values, index, axis=0, mode="fill", fill_value=fill)


def exchange(buf: Array, send_counts: Array | None, recv_counts: Array | None, *,
             axis: str, how: str, fill=0) -> Array:
    """Block ``j`` of ``buf [D * C, ...]`` to device ``j``; returns ``[D * C,
    ...]`` whose block ``j`` came from device ``j``.

    Args:
      buf: the send buffer, ``D`` blocks of ``C`` rows (any dtype).
      send_counts, recv_counts: int32 ``[D]``, the rows at the head of each
        block sent and received (``"ragged_all_to_all"`` only; the rest of a
        received block is ``fill``). Unused by ``"all_to_all"``, which moves
        whole blocks (padding as sent).
      axis: the mesh axis (inside ``shard_map``).
      how: one of :data:`EXCHANGES`.
      fill: the value of rows not received (ragged), broadcast to a row.
    """
    if how == "all_to_all":
        return jax.lax.all_to_all(buf, axis, 0, 0, tiled=True)
    if how != "ragged_all_to_all":
        raise ValueError(f"exchange: how must be one of {EXCHANGES}, got {how!r}")
    devices = send_counts.shape[0]
    c = buf.shape[0] // devices
    offsets = jnp.arange(devices, dtype=jnp.int32) * c
    # every block lands at the sender's index in the receiver's buffer
    mine = jnp.full((devices,), jax.lax.axis_index(axis) * c, jnp.int32)
    out = jnp.broadcast_to(jnp.asarray(fill, buf.dtype), buf.shape)
    return jax.lax.ragged_all_to_all(buf, out, offsets, send_counts, mine, recv_counts,
                                     axis_name=axis)
