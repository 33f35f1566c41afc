"""Sharded folds with ``jax.shard_map`` (the custom calls only ever see local
shards; never ``ffi_call`` on a sharded array directly).

Three layouts over a ``jax.sharding.Mesh`` axis ``axis`` (D devices):

- **expert-parallel** (``shard_expert_parallel`` + ``moe_lora_fold_expert_parallel``):
  device ``d`` holds experts ``[d * E_loc, (d + 1) * E_loc)``: their table
  columns and only the pool slots those cells use (re-packed per device, slot 0
  reserved on each). Each device folds the rows routed to its experts (ids
  remapped to local, other rows untouched) and the owner's rows are combined
  with one ``psum`` in which every other device contributes ``-0.0`` (the exact
  additive identity), so the result is bit-identical to the unsharded fold.
- **tensor-parallel** (``shard_tensor_parallel`` + ``moe_lora_fold_tensor_parallel``):
  ``n_out`` sharded: ``b_pool [P, N, R]`` and ``base_out`` split on ``N``,
  ``a_pool`` and the tables replicated; every device recomputes ``xa`` and
  folds its columns; the output stays column-sharded, no communication.
- **data-parallel** (``moe_lora_fold_data_parallel``): tokens (and their flat
  rows) split over the axis, the route replicated; no communication.

The expert- and tensor-parallel folds also take ``row_axis``: mesh axes over
which tokens are split at the same time (rows ``t * top_k + k`` stay with
their token). Every function is differentiable and jit-able; call it inside
``jax.jit`` (the shard_map needs the mesh, not a context).

Writes into sharded adapter state (``nnx.MoELoRA`` on a mesh, ``AdapterPool``
loads): :func:`update_block` (a block of a replicated table) and
:func:`write_shard_blocks` (one adapter's pool rows, each device writing its
own shard: the output sharded as the input, no collective, one compile per
shape and sharding).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_moelora.ops.folds import moe_lora_fold
from jax_moelora.tables import MoeExpertRoute

__all__ = ["shard_map", "shard_expert_parallel", "shard_tensor_parallel",
           "moe_lora_fold_expert_parallel", "moe_lora_fold_tensor_parallel",
           "moe_lora_fold_data_parallel", "put_global", "update_block", "write_shard_blocks"]

AxisNames = str | Sequence[str] | None


def shard_map(f, *, mesh: Mesh, in_specs, out_specs):
    """``jax.shard_map`` (or ``jax.experimental.shard_map.shard_map`` on
    older JAX)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map as _sm  # pragma: no cover

    return _sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)  # pragma: no cover


def _axis_size(mesh: Mesh, axes: AxisNames) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([mesh.shape[a] for a in names]))


def _put(value, mesh: Mesh, spec: P) -> jax.Array:
    """A global array placed as ``spec``: ``device_put`` in one process; in
    several, from host data every process holds in full."""
    sharding = NamedSharding(mesh, spec)
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    value = np.asarray(jax.device_get(value))
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def put_global(value, mesh: Mesh, spec: P) -> jax.Array:
    """``value`` (host data, or an array every process holds in full) as a
    global array on ``mesh`` placed as ``spec``; in a multi-process run every
    process passes the same value."""
    return _put(value, mesh, spec)


def _mesh_sharding(array) -> NamedSharding | None:
    """``array``'s ``NamedSharding`` when it spans several devices, else None."""
    sharding = getattr(array, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
        return sharding
    return None


def _local_update(array, block, starts):
    return jax.lax.dynamic_update_slice(array, block.astype(array.dtype), tuple(starts))


_update_local = jax.jit(_local_update)


@functools.lru_cache(maxsize=None)
def _update_on_mesh(sharding: NamedSharding):
    return jax.jit(_local_update, out_shardings=sharding)


def update_block(array: jax.Array, block, starts: Sequence[int]) -> jax.Array:
    """``array`` with ``block`` (same rank, host data) written from index
    ``starts``, on ``array``'s devices and with its sharding (the adapter
    tables, replicated on a mesh). The starts are traced: one compile per
    shape and sharding, whatever the position."""
    starts = tuple(np.int32(i) for i in starts)
    sharding = _mesh_sharding(array)
    if sharding is None:
        return _update_local(array, block, starts)
    block = _put(np.asarray(block), sharding.mesh, P())
    return _update_on_mesh(sharding)(array, block, starts)


def _shard_blocks_local(array, block, lead, start, *, slot_axis: int, shard_slots: int):
    """The local form of :func:`write_shard_blocks` (any number of shards)."""
    n = array.shape[slot_axis] // shard_slots
    e = block.shape[slot_axis] // n
    a = array.reshape(array.shape[:slot_axis] + (n, shard_slots) + array.shape[slot_axis + 1:])
    b = block.reshape(block.shape[:slot_axis] + (n, e) + block.shape[slot_axis + 1:])
    zero = jnp.zeros((), jnp.int32)
    starts = tuple(lead) + (zero, start) + (zero,) * (array.ndim - slot_axis - 1)
    return _local_update(a, b, starts).reshape(array.shape)


@functools.lru_cache(maxsize=None)
def _shard_blocks_on_mesh(sharding: NamedSharding, slot_axis: int, shard_slots: int):
    spec = sharding.spec
    local = functools.partial(_shard_blocks_local, slot_axis=slot_axis, shard_slots=shard_slots)
    mapped = shard_map(local, mesh=sharding.mesh, in_specs=(spec, spec, P(), P()),
                       out_specs=spec)
    # Not donated: nnx.clone and nnx.state share the arrays, which a donation
    # would delete under them; the copy is one pool's shard, for the write.
    return jax.jit(mapped, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _shard_blocks_jit(slot_axis: int, shard_slots: int):
    return jax.jit(functools.partial(_shard_blocks_local, slot_axis=slot_axis,
                                     shard_slots=shard_slots))


def write_shard_blocks(array: jax.Array, block, lead: Sequence[int], start: int, *,
                       shard_slots: int) -> jax.Array:
    """Write one block of rows into each shard of a pool laid out in shards.

    Args:
      array: ``[*lead_dims, D * shard_slots, ...]``: ``D`` shards of
        ``shard_slots`` rows on axis ``len(lead)`` (an expert-sharded LoRA
        pool: shard ``d`` holds the slots of the experts device ``d`` owns).
        On a mesh, sharded with that axis split into whole shards.
      block: ``[1, ..., 1, D * e, ...]`` host data (the lead dims of size 1,
        the others as ``array``'s): rows ``[d * e, (d + 1) * e)`` go to shard
        ``d``, from its row ``start``.
      lead: the indices on the lead dims (a stacked pool's member).
      start: the row within each shard.
      shard_slots: the rows of one shard.

    Returns:
      The updated array, sharded as ``array``. On a mesh each device writes
      its own rows (``shard_map``: no collective, nothing gathered);
      ``lead`` and ``start`` are traced (one compile per shape and
      sharding).
    """
    slot_axis = len(lead)
    rows = array.shape[slot_axis]
    if rows % shard_slots:
        raise ValueError(f"write_shard_blocks: axis {slot_axis} of array {tuple(array.shape)} "
                         f"is not a whole number of shards of {shard_slots} rows")
    lead = tuple(np.int32(i) for i in lead)
    start = np.int32(start)
    sharding = _mesh_sharding(array)
    if sharding is None:
        return _shard_blocks_jit(slot_axis, shard_slots)(array, block, lead, start)
    spec = tuple(sharding.spec) + (None,) * (array.ndim - len(sharding.spec))
    if any(spec[:slot_axis]):
        raise ValueError(f"write_shard_blocks: the lead dims of array are sharded ({spec})")
    local_rows = rows // _axis_size(sharding.mesh, spec[slot_axis])
    if local_rows % shard_slots:
        raise ValueError(f"write_shard_blocks: a device holds {local_rows} rows of axis "
                         f"{slot_axis}, not whole shards of {shard_slots}")
    block = _put(np.asarray(block), sharding.mesh, sharding.spec)
    fn = _shard_blocks_on_mesh(sharding, slot_axis, shard_slots)
    return fn(array, block, lead, start)


def _route(a_pool, b_pool, a_table, b_table, scale_table) -> MoeExpertRoute:
    """A route (or a route-shaped pytree of specs) without validation."""
    return MoeExpertRoute.tree_unflatten(None, (a_pool, b_pool, a_table, b_table, scale_table))


def _route_specs(pool_a: P, pool_b: P, table: P) -> MoeExpertRoute:
    return _route(pool_a, pool_b, table, table, table)


def _host(v) -> np.ndarray:
    return np.asarray(jax.device_get(v))


def shard_expert_parallel(route: MoeExpertRoute, mesh: Mesh, axis: str) -> MoeExpertRoute:
    """Re-pack ``route`` so that each device of ``axis`` holds its own experts.

    A host-side load-time step (the route must be fully addressable; in a
    multi-process run every process passes the same route). With ``D`` devices
    and ``E_loc = ceil(E_t / D)``, device ``d`` owns experts
    ``[d * E_loc, (d + 1) * E_loc)``. Its pools hold only the slots its cells
    use, renumbered from 1 (slot 0 reserved and zero; a slot used by experts
    on two devices is copied to both); cells pointing outside the pool or at
    slot 0 become 0 (they folded nothing before either).

    Returns:
      A ``MoeExpertRoute`` of global arrays: ``a_pool [D * P_loc, R, K]`` and
      ``b_pool [D * P_loc, N, R]`` sharded on slots, tables ``[L, D * E_loc]``
      sharded on experts (``P_loc`` = 1 + the most slots a device needs).
      Use it with ``moe_lora_fold_expert_parallel`` (and train it in place:
      gradients w.r.t. its pools are per device).
    """
    D = mesh.shape[axis]
    L, E, Pg = route.max_loras, route.n_experts, route.pool_size
    e_loc = -(-E // D)
    pad = ((0, 0), (0, D * e_loc - E))
    at, bt = (np.pad(_host(t), pad) for t in (route.a_table, route.b_table))
    st = np.pad(_host(route.scale_table), pad)
    a_pool, b_pool = _host(route.a_pool), _host(route.b_pool)

    def local_slots(table):
        slots, cells = [], np.zeros_like(table)
        for d in range(D):
            cols = table[:, d * e_loc:(d + 1) * e_loc]
            used = np.unique(cols[(cols > 0) & (cols < Pg)])
            remap = np.zeros(Pg, np.int32)
            remap[used] = np.arange(1, used.size + 1, dtype=np.int32)
            valid = (cols > 0) & (cols < Pg)
            cells[:, d * e_loc:(d + 1) * e_loc] = np.where(valid, remap[np.clip(cols, 0, Pg - 1)], 0)
            slots.append(used)
        return slots, cells

    a_slots, a_cells = local_slots(at)
    b_slots, b_cells = local_slots(bt)
    p_loc = 1 + max(max(s.size for s in a_slots), max(s.size for s in b_slots))

    def pool(src, slots):
        out = np.zeros((D * p_loc,) + src.shape[1:], src.dtype)
        for d, used in enumerate(slots):
            out[d * p_loc + 1:d * p_loc + 1 + used.size] = src[used]
        return out

    return _route(_put(pool(a_pool, a_slots), mesh, P(axis)),
                  _put(pool(b_pool, b_slots), mesh, P(axis)),
                  _put(a_cells.astype(np.int32), mesh, P(None, axis)),
                  _put(b_cells.astype(np.int32), mesh, P(None, axis)),
                  _put(st.astype(np.float32), mesh, P(None, axis)))


def shard_tensor_parallel(route: MoeExpertRoute, mesh: Mesh, axis: str) -> MoeExpertRoute:
    """Place ``route`` for ``n_out`` sharding over ``axis``: ``b_pool`` split
    on ``N`` (which ``D`` must divide), everything else replicated. (In a
    multi-process run every process passes the same route.)"""
    D = mesh.shape[axis]
    if route.n_out % D:
        raise ValueError(f"shard_tensor_parallel: n_out {route.n_out} is not a multiple of the "
                         f"{D} devices of axis {axis!r}")
    specs = _route_specs(P(), P(None, axis, None), P())
    return _route(*(_put(v, mesh, s) for v, s in zip(route.tree_flatten()[0],
                                                     specs.tree_flatten()[0])))


def _check_rows(fn: str, topk_ids, mesh: Mesh, row_axis: AxisNames) -> None:
    n = _axis_size(mesh, row_axis)
    if topk_ids.ndim != 2:
        raise ValueError(f"{fn}: topk_ids must be [T, top_k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.shape[0] % n:
        raise ValueError(f"{fn}: {topk_ids.shape[0]} tokens do not split over the {n} devices "
                         f"of row_axis {row_axis!r}")


def _row_specs(row_axis: AxisNames, row_adapter, cols=None):
    rows = P(row_axis)
    return rows, P(row_axis, cols), rows, (None if row_adapter is None else rows)


def moe_lora_fold_expert_parallel(x: jax.Array, base_out: jax.Array, topk_ids: jax.Array,
                                  route: MoeExpertRoute, row_adapter: jax.Array | None = None,
                                  *, mesh: Mesh, axis: str, x_gather: int,
                                  row_axis: AxisNames = None, impl: str = "auto",
                                  gather_max_rows: int | None = None) -> jax.Array:
    """``moe_lora_fold`` with experts sharded over ``axis``.

    Args:
      x, base_out, topk_ids, row_adapter: as for ``moe_lora_fold`` (global
        ids), replicated over ``axis`` (split over ``row_axis`` if given).
      route: from ``shard_expert_parallel(route, mesh, axis)``.
      mesh, axis: the mesh and its expert axis.
      x_gather, impl, gather_max_rows: as for ``moe_lora_fold`` (per device).

    Returns:
      ``[T * top_k, n_out]``, bit-identical to the unsharded fold, replicated
      over ``axis``.
    """
    fn = "moe_lora_fold_expert_parallel"
    D = mesh.shape[axis]
    if route.n_experts % D or route.pool_size % D:
        raise ValueError(f"{fn}: route has {route.n_experts} experts and {route.pool_size} pool "
                         f"slots, not split over {D} devices; build it with shard_expert_parallel")
    _check_rows(fn, topk_ids, mesh, row_axis)
    if jnp.dtype(topk_ids.dtype) == jnp.uint32:  # ids >= 2**31 read as negative: skipped
        topk_ids = jax.lax.bitcast_convert_type(topk_ids, jnp.int32)
    e_loc = route.n_experts // D
    e_all = route.n_experts

    def local(x, base, ids, r, ra):
        lo = jax.lax.axis_index(axis).astype(jnp.int32) * e_loc
        mine = (ids >= lo) & (ids < lo + e_loc)
        out = moe_lora_fold(x, base, jnp.where(mine, ids - lo, -1), r, ra, x_gather=x_gather,
                            impl=impl, gather_max_rows=gather_max_rows)
        # One owner per row: -0.0 is the exact identity of IEEE addition.
        total = jax.lax.psum(jnp.where(mine.reshape(-1, 1), out, jnp.array(-0.0, out.dtype)),
                             axis)
        owned = ((ids >= 0) & (ids < e_all)).reshape(-1, 1)
        return jnp.where(owned, total, base)

    xs, bs, ids_s, ras = _row_specs(row_axis, row_adapter)
    rs = _route_specs(P(axis), P(axis), P(None, axis))
    return shard_map(local, mesh=mesh, in_specs=(xs, bs, ids_s, rs, ras),
                     out_specs=bs)(x, base_out, topk_ids, route, row_adapter)


def moe_lora_fold_tensor_parallel(x: jax.Array, base_out: jax.Array, topk_ids: jax.Array,
                                  route: MoeExpertRoute, row_adapter: jax.Array | None = None,
                                  *, mesh: Mesh, axis: str, x_gather: int,
                                  row_axis: AxisNames = None, impl: str = "auto",
                                  gather_max_rows: int | None = None) -> jax.Array:
    """``moe_lora_fold`` with ``n_out`` sharded over ``axis``.

    ``base_out`` and ``b_pool`` are split on their ``N`` dimension (place the
    route with ``shard_tensor_parallel``), ``x``, ``a_pool`` and the tables
    replicated over ``axis``. Returns ``[T * top_k, n_out]`` split on ``n_out``
    over ``axis``, bit-identical to the unsharded fold.
    """
    fn = "moe_lora_fold_tensor_parallel"
    D = mesh.shape[axis]
    if route.n_out % D or base_out.shape[-1] % D:
        raise ValueError(f"{fn}: n_out {route.n_out} is not a multiple of the {D} devices of "
                         f"axis {axis!r}")
    _check_rows(fn, topk_ids, mesh, row_axis)

    def local(x, base, ids, r, ra):
        return moe_lora_fold(x, base, ids, r, ra, x_gather=x_gather, impl=impl,
                             gather_max_rows=gather_max_rows)

    xs, bs, ids_s, ras = _row_specs(row_axis, row_adapter, axis)
    rs = _route_specs(P(), P(None, axis, None), P())
    return shard_map(local, mesh=mesh, in_specs=(xs, bs, ids_s, rs, ras),
                     out_specs=bs)(x, base_out, topk_ids, route, row_adapter)


def moe_lora_fold_data_parallel(x: jax.Array, base_out: jax.Array, topk_ids: jax.Array,
                                route: MoeExpertRoute, row_adapter: jax.Array | None = None,
                                *, mesh: Mesh, axis: AxisNames, x_gather: int,
                                impl: str = "auto",
                                gather_max_rows: int | None = None) -> jax.Array:
    """``moe_lora_fold`` with tokens split over ``axis`` (a name or names) and
    the route replicated: each device folds its own tokens' rows. Returns
    ``[T * top_k, n_out]`` split on rows, bit-identical to the unsharded fold
    (the per-device fold choice, gather or grouped, uses the local row count)."""
    _check_rows("moe_lora_fold_data_parallel", topk_ids, mesh, axis)

    def local(x, base, ids, r, ra):
        return moe_lora_fold(x, base, ids, r, ra, x_gather=x_gather, impl=impl,
                             gather_max_rows=gather_max_rows)

    xs, bs, ids_s, ras = _row_specs(axis, row_adapter)
    rs = _route_specs(P(), P(), P())
    return shard_map(local, mesh=mesh, in_specs=(xs, bs, ids_s, rs, ras),
                     out_specs=bs)(x, base_out, topk_ids, route, row_adapter)
