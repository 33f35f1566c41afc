"""``MoEBlock`` on a ``jax.sharding.Mesh``: expert, tensor and data parallelism.

A block built with ``mesh=`` (or put on one with :func:`shard_block`) holds
a :class:`BlockSharding` and runs every call as one ``shard_map`` over the
mesh (:func:`sharded_call`): routing, dispatch, expert GEMMs, folds and
combine are one jitted program, with no host sync. The axes:

- **expert axis** (``D_e`` devices): device ``d`` owns experts ``[d * E /
  D_e, (d + 1) * E / D_e)``: their weights ``[E, K, N]`` are split on ``E``,
  and the LoRA pools of gate, up and down are laid out in ``D_e`` shards
  (``MoELoRA(expert_shards=D_e)``: shard ``d`` holds the pool slots of
  device ``d``'s experts, for every adapter), split on their slot axis. The
  tokens are split over this axis too. Each device routes its tokens, sends
  each row ``t * top_k + k`` to the owner of its expert and gets the expert
  outputs back (``ops/dispatch.py``: an all-to-all over a capacity-bounded
  layout, exact by default), then combines them with the routing weights.
- **data axis** (one or more names): tokens split, weights replicated.
- **tensor axis** (``D_t`` devices): the intermediate dimension ``I`` of
  the routed experts (and ``I_s`` of the shared experts) split: gate and up
  (and their LoRA ``B`` pools) on their output columns, down (and its LoRA
  ``A`` pool) on its input rows; every device computes a partial output
  (the down fold's delta from its rows of ``h`` and ``A``, as a
  row-parallel layer does), summed with one ``psum``.

Replicated everywhere: the router (kernel, bias, DeepSeek-V3's correction
bias), its LoRA, the tables (tiny; they hold global pool slots, which each
device maps to its shard), the shared experts' LoRA ``A`` of gate and up
and ``B`` of down. Tokens: ``x [T, H]`` split over ``data_axis + (expert_axis,)``
(``T`` must divide), replicated over the tensor axis and any other mesh axis.

Exactness: without a tensor axis every row is computed as on one device, by
the same code on the same values, so expert- and data-parallel results are
the unsharded block's bits (the per-device batch can pick another fold path:
the same bits on every backend but ``impl="fast"``, ``docs/semantics.md``).
One caveat: with ``expert_path="auto"`` the experts' owners run the ragged
path (grouped GEMM), where the unsharded block takes the dense path for
decode-sized batches; the two GEMMs agree bit for bit at the tests' sizes
on the CPU, and within one rounding of the activation dtype otherwise (an
explicit ``expert_path`` runs the same path everywhere). With a tensor axis
the partial sums round differently: within a few roundings of the
activation dtype (``docs/scaling.md``).

Gradients: ``jax.grad`` / ``nnx.grad`` through the call; the gradient of
each variable comes back with that variable's sharding (replicated ones
summed over the devices that share them).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_moelora.ops import dispatch
from jax_moelora.ops.sharding import put_global, shard_map
from jax_moelora.ops.stacked import StackedRoute
from jax_moelora.tables import MoeExpertRoute

if TYPE_CHECKING:  # pragma: no cover
    from jax_moelora.nnx.block import MoEBlock
    from jax_moelora.nnx.lora import MoELoRA, MoELoRARoutes

__all__ = ["BlockSharding", "block_partition_specs", "place_block", "shard_block",
           "sharded_call"]

Array = jax.Array

#: A variable's spec by its path in the block: "E" stands for the expert axis,
#: "T" for the tensor axis; any variable not listed is replicated.
_SPECS: dict[tuple[str, ...], tuple[str | None, ...]] = {
    ("experts", "gate_proj"): ("E", None, "T"),
    ("experts", "up_proj"): ("E", None, "T"),
    ("experts", "gate_up_proj"): ("E", None, "T"),
    ("experts", "gate_up_proj_bias"): ("E", "T"),
    ("experts", "down_proj"): ("E", "T", None),
    ("experts", "down_proj_bias"): ("E", None),
    ("shared_experts", "gate_proj", "kernel"): (None, "T"),
    ("shared_experts", "up_proj", "kernel"): (None, "T"),
    ("shared_experts", "down_proj", "kernel"): ("T", None),
    ("lora", "gate_up", "a_pool"): (None, "E", None, None),
    ("lora", "gate_up", "b_pool"): (None, "E", "T", None),
    ("lora", "down", "a_pool"): ("E", None, "T"),
    ("lora", "down", "b_pool"): ("E", None, None),
    ("lora", "shared_gate_up", "b_pool"): (None, None, "T", None),
    ("lora", "shared_down", "a_pool"): (None, None, "T"),
}


def _names(axes: str | Sequence[str] | None) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


@dataclasses.dataclass(frozen=True)
class BlockSharding:
    """How a block lies on a mesh (a static, hashable attribute of the block).

    Fields: ``mesh``; ``expert_axis``, ``tensor_axis`` (a mesh axis name or
    None); ``data_axis`` (a tuple of names, maybe empty); ``capacity_factor``
    and ``exchange`` (the expert-parallel dispatch, ``ops/dispatch.py``);
    ``dispatch_chunks``: a device's tokens dispatched in that many
    independent pieces (each with its own exchanges and expert work, so
    that one piece's exchange can run while another's experts compute; the
    capacity and the drop rule apply per piece). Build it with
    :meth:`make`, which validates.
    """

    mesh: Mesh
    expert_axis: str | None = None
    data_axis: tuple[str, ...] = ()
    tensor_axis: str | None = None
    capacity_factor: float | None = None
    exchange: str = "all_to_all"
    dispatch_chunks: int = 1

    @classmethod
    def make(cls, mesh: Mesh, *, expert_axis: str | None = None,
             data_axis: str | Sequence[str] | None = None, tensor_axis: str | None = None,
             capacity_factor: float | None = None, exchange: str = "all_to_all",
             dispatch_chunks: int = 1) -> "BlockSharding":
        """Validated: every axis a name of ``mesh``, no axis used twice."""
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        data = _names(data_axis)
        used = [a for a in (expert_axis, tensor_axis) if a is not None] + list(data)
        for name, a in (("expert_axis", expert_axis), ("tensor_axis", tensor_axis)):
            if a is not None and not isinstance(a, str):
                raise TypeError(f"{name} must be a mesh axis name, got {a!r}")
        for a in used:
            if a not in mesh.shape:
                raise ValueError(f"axis {a!r} is not an axis of the mesh {dict(mesh.shape)}")
        if len(set(used)) != len(used):
            raise ValueError(f"expert_axis, data_axis and tensor_axis must be distinct, got "
                             f"{expert_axis!r}, {data!r}, {tensor_axis!r}")
        if capacity_factor is not None and not float(capacity_factor) > 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {capacity_factor!r}")
        if exchange not in dispatch.EXCHANGES:
            raise ValueError(f"exchange must be one of {dispatch.EXCHANGES}, got {exchange!r}")
        if (not isinstance(dispatch_chunks, int) or isinstance(dispatch_chunks, bool)
                or dispatch_chunks < 1):
            raise ValueError(f"dispatch_chunks must be a positive int, got {dispatch_chunks!r}")
        cf = None if capacity_factor is None else float(capacity_factor)
        return cls(mesh, expert_axis, data, tensor_axis, cf, exchange, dispatch_chunks)

    def _size(self, axis: str | None) -> int:
        return 1 if axis is None else int(self.mesh.shape[axis])

    @property
    def expert_shards(self) -> int:
        """``D_e``: devices of the expert axis (1 without one)."""
        return self._size(self.expert_axis)

    @property
    def tensor_shards(self) -> int:
        """``D_t``: devices of the tensor axis (1 without one)."""
        return self._size(self.tensor_axis)

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The axes that split the tokens: the data axes, then the expert axis."""
        return self.data_axis + _names(self.expert_axis)

    @property
    def token_shards(self) -> int:
        return math.prod(self._size(a) for a in self.token_axes)

    def token_spec(self, ndim: int) -> P:
        """The spec of a ``[T, ...]`` token array of rank ``ndim``."""
        return P(self.token_axes or None, *([None] * (ndim - 1)))

    def spec(self, path: Sequence[str], ndim: int) -> P:
        """The spec of the block's variable at ``path`` (names) of rank ``ndim``."""
        template = _SPECS.get(tuple(path))
        if template is None:
            return P()
        axes = {"E": self.expert_axis, "T": self.tensor_axis, None: None}
        assert len(template) == ndim, (path, ndim)
        return P(*(axes[t] for t in template))

    def check_sizes(self, num_experts: int, intermediate: int, shared: int) -> None:
        """Raise ``ValueError`` when the axes do not divide the block's sizes."""
        if num_experts % self.expert_shards:
            raise ValueError(f"num_experts {num_experts} is not a multiple of the "
                             f"{self.expert_shards} devices of expert_axis {self.expert_axis!r}")
        for name, size in (("intermediate_size", intermediate),
                           ("the shared experts' width", shared)):
            if size % self.tensor_shards:
                raise ValueError(f"{name} {size} is not a multiple of the {self.tensor_shards} "
                                 f"devices of tensor_axis {self.tensor_axis!r}")


def _path_names(path) -> tuple[str, ...]:
    """Key path of a leaf of ``nnx.split``'s state -> the variable's names."""
    out = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", None))
        if name is not None and name != "value":
            out.append(str(name))
    return tuple(out)


def block_partition_specs(block: "MoEBlock", sharding: BlockSharding | None = None) -> nnx.State:
    """The ``PartitionSpec`` of each variable of ``block`` (an ``nnx.State``
    of specs with the structure of ``nnx.state(block)``), under ``sharding``
    (default: the block's)."""
    sharding = block.sharding if sharding is None else sharding
    if sharding is None:
        raise ValueError("block_partition_specs: the block has no sharding; pass one")
    state = nnx.state(block)
    return jax.tree_util.tree_map_with_path(
        lambda path, v: sharding.spec(_path_names(path), v.ndim), state)


def place_block(block: "MoEBlock") -> None:
    """Put every variable of ``block`` on its mesh with its spec, in place.

    Eagerly, from values every process holds in full (``put_global``);
    traced (building the block inside ``nnx.jit`` for experts too large for
    one device), as a sharding constraint, so that XLA creates each shard on
    its device."""
    sharding = block.sharding
    for path, var in nnx.to_flat_state(nnx.state(block)):
        value = var[...]
        spec = sharding.spec(tuple(str(p) for p in path), value.ndim)
        if isinstance(value, jax.core.Tracer):
            target = NamedSharding(sharding.mesh, spec)
            var.set_value(jax.lax.with_sharding_constraint(value, target))
        else:
            var.set_value(put_global(value, sharding.mesh, spec))


def shard_block(block: "MoEBlock", mesh: Mesh, *, expert_axis: str | None = None,
                data_axis: str | Sequence[str] | None = None, tensor_axis: str | None = None,
                capacity_factor: float | None = None, exchange: str = "all_to_all",
                dispatch_chunks: int = 1) -> "MoEBlock":
    """Put an existing block on ``mesh``, in place (``nnx.clone`` it first to
    keep the original); returns it.

    The LoRA pools are re-laid out for the expert axis (host-side,
    ``MoELoRA.set_expert_shards``: every installed adapter keeps its bits),
    every variable placed with its spec, and later calls run sharded. In a
    multi-process run every process passes the same block. Arguments as
    ``MoEBlock``'s."""
    sharding = BlockSharding.make(mesh, expert_axis=expert_axis, data_axis=data_axis,
                                  tensor_axis=tensor_axis, capacity_factor=capacity_factor,
                                  exchange=exchange, dispatch_chunks=dispatch_chunks)
    shared = block.shared_experts.gate_proj.out_features if block.shared_experts else 0
    sharding.check_sizes(block.num_experts, block.intermediate_size, shared)
    if block.lora is not None and block.lora.expert_shards != sharding.expert_shards:
        block.lora.set_expert_shards(sharding.expert_shards)
    block.sharding = sharding
    place_block(block)
    return block


def sharded_call(block: "MoEBlock", x: Array, adapter_ids: Array | None, *, impl: str,
                 lora: bool) -> Array:
    """The block on its mesh: ``x [T, H]`` (``dtype``), ``adapter_ids`` int32
    ``[T]`` or None -> ``[T, H]``, both split over the token axes. One
    ``shard_map`` over the whole mesh (:func:`_local_call` on each device)."""
    sharding = block.sharding
    t = x.shape[0]
    if t % sharding.token_shards:
        raise ValueError(f"MoEBlock: {t} tokens do not split over the {sharding.token_shards} "
                         f"devices of the token axes {sharding.token_axes}")
    chunks = sharding.dispatch_chunks if sharding.expert_shards > 1 else 1
    if (t // sharding.token_shards) % chunks:
        raise ValueError(f"MoEBlock: a device's {t // sharding.token_shards} tokens do not "
                         f"split into dispatch_chunks={chunks} pieces")
    if lora and block.lora.expert_shards != sharding.expert_shards:
        raise ValueError(f"MoEBlock: the LoRA pools have {block.lora.expert_shards} expert "
                         f"shards, the mesh's expert axis {sharding.expert_shards} devices; "
                         "use shard_block")
    graphdef, state = nnx.split(block)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves = [v for _, v in flat]
    specs = [sharding.spec(_path_names(path), v.ndim) for path, v in flat]
    local = functools.partial(_local_call, graphdef, treedef, sharding, impl, lora)
    ids_spec = None if adapter_ids is None else sharding.token_spec(1)
    fn = shard_map(local, mesh=sharding.mesh,
                   in_specs=(specs, sharding.token_spec(2), ids_spec),
                   out_specs=sharding.token_spec(2))
    return fn(leaves, x, adapter_ids)


def _local_call(graphdef, treedef, sharding: BlockSharding, impl: str, lora: bool,
                leaves: list[Array], x: Array, adapter_ids: Array | None) -> Array:
    """One device's share of the block: its tokens ``x [T_d, H]``, its
    experts and shards (the ``leaves`` of ``nnx.split``'s state, local)."""
    block = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
    if sharding.tensor_shards > 1 and hasattr(block.experts, "down_proj_bias"):
        bias = block.experts.down_proj_bias  # added once: on the first tensor shard
        first = jax.lax.axis_index(sharding.tensor_axis) == 0
        bias.set_value(jnp.where(first, bias[...], jnp.zeros_like(bias[...])))
    routes = local_routes(block.lora, sharding) if lora else None
    ids = adapter_ids if lora else None
    weights, topk_ids = block.route(x, ids, routes, impl)
    if sharding.expert_shards > 1:
        rows = _chunked_rows(block, x, topk_ids, ids, routes, impl, sharding)
        weights = weights * rows.kept.reshape(weights.shape)
        d = rows.out
    else:
        d = block.routed_rows(x, topk_ids, ids, routes, impl)
    from jax_moelora.nnx.block import weighted_sum  # the block module imports this one

    routed = weighted_sum(weights, d)
    shared = None if block.shared_experts is None else block.shared(x, ids, routes, impl)
    return _combine(routed, shared, block.dtype, sharding)


def _combine(routed: Array, shared: Array | None, dtype: Any,
             sharding: BlockSharding) -> Array:
    """``routed`` (f32 ``[T, H]``) plus the shared experts' output: as the
    unsharded block adds them, or with a tensor axis the partial sums of
    both added up in one float32 ``psum``, then rounded."""
    if sharding.tensor_shards == 1:
        y = routed.astype(dtype)
        return y if shared is None else y + shared
    if shared is None:
        return jax.lax.psum(routed, sharding.tensor_axis).astype(dtype)
    total = jax.lax.psum(jnp.stack([routed, shared.astype(jnp.float32)]), sharding.tensor_axis)
    return total[0].astype(dtype) + total[1].astype(dtype)


def _local_cells(table: Array, device: Array, experts: int, slots: int) -> Array:
    """Global pool slots ``[..., L, E]`` -> the device's columns ``[..., L,
    experts]`` as slots of its shard of ``slots``: 0 stays 0 (no pair), a
    slot outside the shard becomes -1 (folds nothing)."""
    t = jax.lax.dynamic_slice_in_dim(table, device * experts, experts, axis=table.ndim - 1)
    lo = device * slots
    inside = (t > lo) & (t < lo + slots)
    return jnp.where(t == 0, 0, jnp.where(inside, t - lo, -1)).astype(jnp.int32)


def _member_slots(cells: Array, members: int, pool_size: int) -> Array:
    """A ``StackedRoute``'s stored cells ``[L, S * E]`` -> each member's own
    pool slots ``[S, L, E]`` (0: none, -1: outside the pool), for pools of
    ``pool_size`` slots (the global size: the local pools are one shard)."""
    L = cells.shape[0]
    t = jnp.transpose(cells.reshape(L, members, -1), (1, 0, 2))
    lo = (jnp.arange(members, dtype=jnp.int32) * pool_size)[:, None, None]
    own = jnp.where((t > lo) & (t < lo + pool_size), t - lo, -1)
    return jnp.where(t == 0, 0, own).astype(jnp.int32)


def local_routes(lora: "MoELoRA", sharding: BlockSharding) -> "MoELoRARoutes":
    """The layer's routes on one device (inside the ``shard_map``): gate, up
    and down over the device's experts and its shard of their pools (tables
    sliced and mapped to shard slots); the others as they are."""
    routes = lora.routes()
    if sharding.expert_shards == 1:
        return routes
    device = jax.lax.axis_index(sharding.expert_axis).astype(jnp.int32)
    e_d = lora.num_experts // sharding.expert_shards
    down = routes.down
    slots = lora.down.slots_per_shard
    cells = functools.partial(_local_cells, device=device, experts=e_d, slots=slots)
    local_down = MoeExpertRoute.tree_unflatten(None, (
        down.a_pool, down.b_pool, cells(down.a_table), cells(down.b_table),
        jax.lax.dynamic_slice_in_dim(down.scale_table, device * e_d, e_d, axis=1)))
    gu, S = routes.gate_up, routes.gate_up.num_routes
    pool = lora.gate_up.pool_size
    scales = jnp.transpose(gu.scales.reshape(gu.scales.shape[0], S, -1), (1, 0, 2))
    local_gu = StackedRoute.from_tables(
        gu.a_pool, gu.b_pool, cells(_member_slots(gu.a_cells, S, pool)),
        cells(_member_slots(gu.b_cells, S, pool)),
        jax.lax.dynamic_slice_in_dim(scales, device * e_d, e_d, axis=2))
    return routes._replace(gate_up=local_gu, down=local_down)


@dataclasses.dataclass
class _Rows:
    out: Array   # [T * top_k, H] expert outputs in flat order (0 where dropped)
    kept: Array  # bool [T * top_k]


def _chunked_rows(block: "MoEBlock", x: Array, topk_ids: Array, adapter_ids: Array | None,
                  routes: "MoELoRARoutes | None", impl: str, sharding: BlockSharding) -> _Rows:
    """:func:`_expert_parallel_rows` over ``dispatch_chunks`` consecutive
    pieces of the device's tokens, independent of each other (XLA may run
    one piece's exchange while another's experts compute)."""
    pieces = sharding.dispatch_chunks
    if pieces == 1:
        return _expert_parallel_rows(block, x, topk_ids, adapter_ids, routes, impl, sharding)
    step = x.shape[0] // pieces
    parts = [_expert_parallel_rows(
        block, x[i * step:(i + 1) * step], topk_ids[i * step:(i + 1) * step],
        None if adapter_ids is None else adapter_ids[i * step:(i + 1) * step],
        routes, impl, sharding) for i in range(pieces)]
    return _Rows(jnp.concatenate([p.out for p in parts]),
                 jnp.concatenate([p.kept for p in parts]))


def _expert_parallel_rows(block: "MoEBlock", x: Array, topk_ids: Array,
                          adapter_ids: Array | None, routes: "MoELoRARoutes | None",
                          impl: str, sharding: BlockSharding) -> _Rows:
    """Each local row through its expert on the expert's owner.

    ``x [T, H]`` this device's tokens, ``topk_ids`` int32 ``[T, k]`` global
    expert ids. Rows go out in the capacity-bounded layout of
    ``ops/dispatch.py`` with their local expert id and adapter id, the
    owner runs its experts on the ``D * C`` rows it receives (rows of no
    expert marked with id ``E_d``, which sort after every expert's span and
    which nothing folds; the grouped GEMM of ``expert_path="auto"``, whose
    kernel skips them), and the results come back the same way."""
    t, k = topk_ids.shape
    n, D, axis = t * k, sharding.expert_shards, sharding.expert_axis
    e_d = block.num_experts // D
    cap = dispatch.capacity(n, D, sharding.capacity_factor)
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    plan = dispatch.plan_dispatch(flat // e_d, D, cap)
    valid = plan.source < n
    owner = jnp.arange(D * cap, dtype=jnp.int32) // cap
    expert = jnp.where(valid, dispatch.take_rows(flat, plan.source) - owner * e_d, e_d)
    adapter = (jnp.full_like(expert, -1) if adapter_ids is None else
               jnp.where(valid, dispatch.take_rows(adapter_ids, plan.source // k), -1))
    recv_counts = None
    if sharding.exchange == "ragged_all_to_all":
        recv_counts = jax.lax.all_to_all(plan.counts, axis, 0, 0, tiled=True)
    send = functools.partial(dispatch.exchange, axis=axis, how=sharding.exchange)
    xr = send(dispatch.take_rows(x, plan.source // k), plan.counts, recv_counts)
    meta = send(jnp.stack([expert, adapter], axis=1), plan.counts, recv_counts,
                fill=jnp.asarray([e_d, -1], jnp.int32))
    ids = None if adapter_ids is None else meta[:, 1]
    # the received rows are D * C, most of them padding at the exact capacity:
    # the dense path would run every local expert on all of them
    path = "ragged" if block.expert_path == "auto" else block.expert_path
    out = block.routed_rows(xr, meta[:, :1], ids, routes, impl, num_experts=e_d,
                            expert_path=path)
    back = send(out, recv_counts, plan.counts)
    return _Rows(dispatch.take_rows(back, plan.slot), plan.kept)
