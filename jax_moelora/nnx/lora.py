"""LoRA state of an MoE layer: pools and tables per projection, for many adapters.

- :class:`ExpertLoRA`: one projection's pools (``nnx.LoRAParam``, trainable)
  and tables (:class:`AdapterTable`, not trainable) for ``max_loras`` adapter
  slots. Pool layout is fixed: adapter slot ``l``, expert ``e`` lives in pool
  slot ``1 + l * E_t + e`` (slot 0 is the reserved "not adapted" slot), so
  loading, replacing or unloading an adapter rewrites one contiguous block of
  the pools and one row of the tables, and shapes never change. With
  ``expert_shards = D`` (experts split over ``D`` devices of a mesh) the
  pools are ``D`` shards of ``P_d = 1 + L * E_t / D`` slots, shard ``d``
  holding experts ``[d * E_t / D, (d + 1) * E_t / D)``: expert ``e = d *
  E_t / D + j`` of adapter ``l`` lives in slot ``d * P_d + 1 + l * E_t / D +
  j``, and slot ``d * P_d`` is shard ``d``'s reserved slot (``D = 1`` is the
  layout above). The tables hold these global slots; an adapter's pairs are
  one contiguous block of each shard.
- :class:`StackedExpertLoRA`: ``S`` projections of equal shapes (gate and
  up) in one set of arrays with a leading axis ``S``; :meth:`route` is their
  ``StackedRoute`` (the stored arrays themselves, no copy), which the folds
  fold in one launch. Each projection is an :class:`ExpertLoRAView` with the
  :class:`ExpertLoRA` interface.
- :class:`MoELoRA`: the LoRA state of one MoE layer: ``router`` and ``down``
  (:class:`ExpertLoRA`), ``gate_up`` (:class:`StackedExpertLoRA`, viewed as
  ``gate`` and ``up``), plus ``shared_gate_up`` (``shared_gate``,
  ``shared_up``) and ``shared_down`` when the layer has shared experts;
  :meth:`MoELoRA.routes` gives their routes.

The tables are :class:`AdapterTable` variables, outside ``nnx.Param``, so no
filter on parameters ever selects them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_moelora.geometry import padded_rank
from jax_moelora.peft import PROJECTIONS, AdapterFormatError, ProjectionLoRA
from jax_moelora.ops.lora_pack import LoraInGemmPack, pack_lora_in_gemm
from jax_moelora.ops.sharding import update_block, write_shard_blocks
from jax_moelora.ops.stacked import StackedRoute, stored_cells
from jax_moelora.tables import MoeExpertRoute

__all__ = [
    "AdapterTable",
    "ExpertLoRA",
    "ExpertLoRAView",
    "MoELoRA",
    "MoELoRAPacks",
    "MoELoRARoutes",
    "SHARED_PROJECTIONS",
    "StackedExpertLoRA",
    "compact_rank",
    "default_a_initializer",
]

Array = jax.Array

#: The projections of a layer's shared-expert MLP (one "expert", ``E_t = 1``).
SHARED_PROJECTIONS = ("shared_gate", "shared_up", "shared_down")

#: PEFT's init of ``lora_A`` (``kaiming_uniform_(a=sqrt(5))``: uniform with
#: bound ``1 / sqrt(K)``) on ``[E, r, K]`` factors.
default_a_initializer = nnx.initializers.variance_scaling(
    1.0 / 3.0, "fan_in", "uniform", in_axis=-1, out_axis=-2, batch_axis=(0,))


def _starts(*lead: int, ndim: int) -> tuple[np.int32, ...]:
    return tuple(np.int32(i) for i in lead) + (np.int32(0),) * (ndim - len(lead))


def _check_shards(who: str, n_experts: int, expert_shards: Any) -> int:
    if (not isinstance(expert_shards, (int, np.integer)) or isinstance(expert_shards, bool)
            or expert_shards < 1 or n_experts % expert_shards):
        raise ValueError(f"{who}: expert_shards must be a positive int that divides n_experts "
                         f"{n_experts}, got {expert_shards!r}")
    return int(expert_shards)


def shard_slots(n_experts: int, max_loras: int, expert_shards: int, slot: Any,
                expert: Any) -> Any:
    """The pool slot of adapter ``slot``'s ``expert`` in the layout of
    ``expert_shards`` shards (numpy broadcasting): ``d * P_d + 1 + slot * E_d
    + j`` with ``E_d = n_experts / expert_shards``, ``P_d = 1 + max_loras *
    E_d``, ``(d, j) = divmod(expert, E_d)``."""
    e_d = n_experts // expert_shards
    d, j = np.divmod(expert, e_d)
    return d * (1 + max_loras * e_d) + 1 + slot * e_d + j


def _relaid(pool: np.ndarray, table: np.ndarray, slots: np.ndarray,
            new_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A pool ``[P, ...]`` and its table ``[L, E_t]`` in another layout whose
    slot for cell ``(l, e)`` is ``slots[l, e]``: each pair copied to its new
    slot; cells 0 stay 0, cells outside the pool become -1 (neither folds)."""
    inside = (table > 0) & (table < pool.shape[0])
    new = np.zeros((new_size,) + pool.shape[1:], pool.dtype)
    new[slots[inside]] = pool[table[inside]]
    cells = np.where(table == 0, 0, np.where(inside, slots, -1)).astype(np.int32)
    return new, cells


class AdapterTable(nnx.Variable):
    """Adapter bookkeeping that is state but never trained: the int32 pool-slot
    tables ``[L, E_t]`` and the float32 scales ``[L, E_t]`` of a projection."""


class MoELoRAPacks(NamedTuple):
    """The routed experts' ``pack_lora_in_gemm`` packs of one MoE layer
    (:meth:`MoELoRA.in_gemm_packs`): ``gate``, ``up`` and ``down``, each a
    ``LoraInGemmPack``."""

    gate: LoraInGemmPack
    up: LoraInGemmPack
    down: LoraInGemmPack


class MoELoRARoutes(NamedTuple):
    """The routes of one MoE layer.

    Fields: ``router`` and ``down`` (``MoeExpertRoute``), ``gate_up`` (a
    ``StackedRoute`` of gate then up: the block folds both in one launch);
    with shared experts ``shared_gate_up`` (``StackedRoute``) and
    ``shared_down``, else ``None``; ``packs``: the routed experts'
    :class:`MoELoRAPacks` made beforehand, or ``None``. The properties
    ``gate``, ``up``, ``shared_gate`` and ``shared_up`` give the stacked
    projections one by one (slices of the stacked arrays).
    """

    router: MoeExpertRoute
    gate_up: StackedRoute
    down: MoeExpertRoute
    shared_gate_up: StackedRoute | None = None
    shared_down: MoeExpertRoute | None = None
    packs: MoELoRAPacks | None = None

    @property
    def gate(self) -> MoeExpertRoute:
        return self.gate_up.route(0)

    @property
    def up(self) -> MoeExpertRoute:
        return self.gate_up.route(1)

    @property
    def shared_gate(self) -> MoeExpertRoute | None:
        return None if self.shared_gate_up is None else self.shared_gate_up.route(0)

    @property
    def shared_up(self) -> MoeExpertRoute | None:
        return None if self.shared_gate_up is None else self.shared_gate_up.route(1)


def _check_sizes(who: str, **sizes: Any) -> None:
    for name, v in sizes.items():
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{who}: {name} must be a positive int, got {v!r}")


def compact_rank(lora: ProjectionLoRA) -> ProjectionLoRA:
    """The same deltas at the smallest rank: per expert, the rank components
    ``j`` whose ``A[e, j]`` or ``B[e, :, j]`` is all zero (they add exactly
    nothing) dropped and the others moved to the front, the rank zero-padded
    to a multiple of 8.

    peft stores gate and up with different ``A`` as one fused parameter of
    rank ``2r``, ``A`` stacked, ``B`` block-diagonal: read back, gate and up
    each have ``r`` live components of ``2r``, and fit a pool of rank ``r``.
    """
    live = (lora.a != 0).any(axis=2) & (lora.b != 0).any(axis=1)  # [E_t, R]
    counts = live.sum(axis=1).astype(np.int32)
    E = live.shape[0]
    R2 = padded_rank(max(int(counts.max(initial=0)), 1))
    a = np.zeros((E, R2, lora.k_in), np.float32)
    b = np.zeros((E, lora.n_out, R2), np.float32)
    for e in range(E):
        keep = np.flatnonzero(live[e])
        a[e, :len(keep)] = lora.a[e, keep]
        b[e, :, :len(keep)] = lora.b[e][:, keep]
    return dataclasses.replace(lora, a=a, b=b, ranks=counts)


class _SlotWriter:
    """The adapter-slot logic of one projection, shared by :class:`ExpertLoRA`
    and :class:`ExpertLoRAView`: the fixed pool layout, slot writes and the
    checks of a loaded adapter.

    Subclasses set ``n_experts``, ``k_in``, ``n_out``, ``max_loras``,
    ``max_rank``, ``dtype`` and ``expert_shards``, give ``a_pool``,
    ``b_pool``, ``a_table``, ``b_table`` and ``scale_table`` (read with
    ``[...]``), and implement ``_write(name, block, start)`` (a table row
    ``block`` written from row ``start``) and ``_write_pool(name, block,
    start)`` (``block [E_t, ...]``: shard ``d``'s experts written into its
    shard from row ``start``), host-side.
    """

    @property
    def experts_per_shard(self) -> int:
        """``E_d = E_t / expert_shards``: the experts of one shard."""
        return self.n_experts // self.expert_shards

    @property
    def slots_per_shard(self) -> int:
        """``P_d = 1 + L * E_d``: the pool slots of one shard."""
        return 1 + self.max_loras * self.experts_per_shard

    @property
    def pool_size(self) -> int:
        return self.expert_shards * self.slots_per_shard

    def pool_slot(self, slot: int, expert: int) -> int:
        """The pool slot of adapter ``slot``'s expert ``expert`` (``1 + slot *
        E_t + expert`` with one shard; :func:`shard_slots`)."""
        return int(shard_slots(self.n_experts, self.max_loras, self.expert_shards, slot, expert))

    def route(self) -> MoeExpertRoute:
        """The projection's ``MoeExpertRoute`` (traceable)."""
        return MoeExpertRoute(a_pool=self.a_pool[...], b_pool=self.b_pool[...],
                              a_table=self.a_table[...], b_table=self.b_table[...],
                              scale_table=self.scale_table[...])

    def _write(self, name: str, block: np.ndarray, start: int) -> None:
        raise NotImplementedError

    def _write_pool(self, name: str, block: np.ndarray, start: int) -> None:
        raise NotImplementedError

    def _check_slot(self, slot: int) -> int:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.max_loras:
            raise ValueError(f"adapter slot must be in [0, {self.max_loras}), got {slot!r}")
        return int(slot)

    def write_slot(self, slot: int, a: Any, b: Any, scale: Any, present: Any) -> None:
        """Install factors into adapter slot ``slot`` (host-side, not traced).

        Args:
          a: ``[e, r, K]`` with ``e <= E_t`` and ``r <= max_rank`` (zero-padded
            here); numpy or jax.
          b: ``[e, N, r]``.
          scale: ``[e]`` float scales.
          present: bool ``[e]``: experts that fold (table cells 0 elsewhere).
        """
        slot = self._check_slot(slot)
        e, r, k = a.shape
        if e > self.n_experts or k != self.k_in or r > self.max_rank or b.shape != (
                e, self.n_out, r):
            raise ValueError(f"write_slot: a {tuple(a.shape)} / b {tuple(b.shape)} do not fit "
                             f"[<= {self.n_experts}, <= {self.max_rank}, {self.k_in}] / "
                             f"[., {self.n_out}, .]")
        R, E = self.max_rank, self.n_experts
        a_blk = np.zeros((E, R, self.k_in), self.dtype)
        a_blk[:e, :r] = np.asarray(a, np.float32)
        b_blk = np.zeros((E, self.n_out, R), self.dtype)
        b_blk[:e, :, :r] = np.asarray(b, np.float32)
        start = 1 + slot * self.experts_per_shard  # within each shard
        self._write_pool("a_pool", a_blk, start)
        self._write_pool("b_pool", b_blk, start)
        present = np.zeros(E, bool) if present is None else np.asarray(present, bool)
        cells = np.zeros(E, np.int32)
        cells[:e] = np.where(present[:e], [self.pool_slot(slot, i) for i in range(e)], 0)
        scales = np.zeros(E, np.float32)
        scales[:e] = np.where(present[:e], np.asarray(scale, np.float32), 0.0)
        self._write("a_table", cells[None], slot)
        self._write("b_table", cells[None], slot)
        self._write("scale_table", scales[None], slot)

    def clear_slot(self, slot: int) -> None:
        """Zero adapter slot ``slot``: its table cells and its pool block."""
        slot = self._check_slot(slot)
        self.write_slot(slot, np.zeros((self.n_experts, self.max_rank, self.k_in), np.float32),
                        np.zeros((self.n_experts, self.n_out, self.max_rank), np.float32),
                        np.zeros(self.n_experts, np.float32), np.zeros(self.n_experts, bool))

    def check(self, lora: ProjectionLoRA, what: str) -> None:
        """Raise ``AdapterFormatError`` (naming the key) if ``lora`` does not fit."""
        if lora.n_experts > self.n_experts:
            bad = [e for e in range(self.n_experts, lora.n_experts) if lora.present[e]]
            if bad:
                raise AdapterFormatError(
                    f"expert id out of range: key {lora.key(bad[0])!r} adapts {what} expert "
                    f"{bad[0]}, the layer has {self.n_experts} experts")
        first = int(np.argmax(lora.present))
        if lora.k_in != self.k_in or lora.n_out != self.n_out:
            raise AdapterFormatError(
                f"shape mismatch: key {lora.key(first)!r} maps {lora.k_in} -> {lora.n_out} "
                f"for {what}, the layer's {what} maps {self.k_in} -> {self.n_out}")
        lora = self._fitted(lora)
        if int(lora.ranks.max(initial=0)) > self.max_rank:
            e = int(np.argmax(lora.ranks))
            raise AdapterFormatError(
                f"rank mismatch: key {lora.key(e)!r} has rank {int(lora.ranks[e])}, above the "
                f"pool's max_rank {self.max_rank} for {what}")

    def set_lora(self, slot: int, lora: ProjectionLoRA | None, what: str = "projection") -> None:
        """Install a loaded ``ProjectionLoRA`` (``None`` clears the slot)."""
        if lora is None:
            self.clear_slot(slot)
            return
        self.check(lora, what)
        lora = self._fitted(lora)
        e = min(lora.n_experts, self.n_experts)  # ids past E_t carry no pair (check)
        r = min(lora.max_rank, self.max_rank)  # ranks past r are zero padding (check)
        self.write_slot(slot, lora.a[:e, :r], lora.b[:e, :, :r], lora.scale[:e], lora.present[:e])

    def _fitted(self, lora: ProjectionLoRA) -> ProjectionLoRA:
        """``lora``, its rank components with a zero factor dropped
        (:func:`compact_rank`) when its rank is above the pool's."""
        if int(lora.ranks.max(initial=0)) <= self.max_rank:
            return lora
        return compact_rank(lora)

    def get_lora(self, slot: int, what: str = "projection") -> ProjectionLoRA | None:
        """Adapter ``slot``'s pairs as the tables and pools hold them now (a
        trained adapter's too): the inverse of :meth:`set_lora`.

        Returns:
          A ``ProjectionLoRA`` over the ``E_t`` experts, float32 ``a [E_t, R,
          K]`` and ``b [E_t, N, R]`` at the pool rank ``R``, ``present`` where
          the table cell is a pool slot, ``ranks`` each pair's used rank (its
          last rank row of A or column of B that is not zero, + 1), zeros and
          scale 0 where absent; ``None`` when the slot adapts no expert.
        """
        slot = self._check_slot(slot)
        cells = np.asarray(self.a_table[slot], np.int32)
        present = cells > 0
        if not present.any():
            return None
        keep = present.astype(np.float32)
        a = np.asarray(self.a_pool[cells]).astype(np.float32) * keep[:, None, None]
        b = np.asarray(self.b_pool[np.asarray(self.b_table[slot], np.int32)]).astype(
            np.float32) * keep[:, None, None]
        scale = np.where(present, np.asarray(self.scale_table[slot], np.float32), 0.0)
        used = (a != 0).any(axis=2) | (b != 0).any(axis=1)  # [E_t, R]
        ranks = np.where(used.any(axis=1), used.shape[1] - np.argmax(used[:, ::-1], axis=1), 0)
        keys = tuple(f"slot {slot} {what} expert {e}" if present[e] else None
                     for e in range(len(cells)))
        return ProjectionLoRA(a=a, b=b, scale=scale.astype(np.float32), present=present,
                              ranks=ranks.astype(np.int32), keys=keys)


class ExpertLoRA(_SlotWriter, nnx.Module):
    """LoRA pools and tables of one projection for ``max_loras`` adapters.

    Args:
      n_experts: ``E_t``, the table length (the layer's expert count; 1 for
        the router).
      k_in: ``K``, the projection's input width.
      n_out: ``N``, its output width.
      max_loras: ``L``, adapter slots.
      max_rank: the pools' rank ``R``, rounded up to a multiple of 8.
      dtype: the pools' dtype (the activation dtype of the fold).
      param_type: the pools' variable type (``nnx.LoRAParam``).
      expert_shards: ``D``, the pool layout's expert shards (1: unsharded;
        see the module docstring), which must divide ``n_experts``.

    State: ``a_pool [P, R, K]`` and ``b_pool [P, N, R]`` with
    ``P = D * (1 + L * E_t / D)``; ``a_table``/``b_table`` int32 ``[L, E_t]``
    and ``scale_table`` float32 ``[L, E_t]`` (:class:`AdapterTable`).
    """

    def __init__(self, n_experts: int, k_in: int, n_out: int, *, max_loras: int,
                 max_rank: int, dtype: Any = jnp.float32,
                 param_type: type[nnx.Variable] = nnx.LoRAParam, expert_shards: int = 1):
        _check_sizes("ExpertLoRA", n_experts=n_experts, k_in=k_in, n_out=n_out,
                     max_loras=max_loras, max_rank=max_rank)
        self.n_experts, self.k_in, self.n_out = int(n_experts), int(k_in), int(n_out)
        self.max_loras, self.max_rank = int(max_loras), padded_rank(int(max_rank))
        self.expert_shards = _check_shards("ExpertLoRA", self.n_experts, expert_shards)
        self.dtype = jnp.dtype(dtype)
        P, R, L = self.pool_size, self.max_rank, self.max_loras
        self.a_pool = param_type(jnp.zeros((P, R, self.k_in), self.dtype))
        self.b_pool = param_type(jnp.zeros((P, self.n_out, R), self.dtype))
        self.a_table = AdapterTable(jnp.zeros((L, self.n_experts), jnp.int32))
        self.b_table = AdapterTable(jnp.zeros((L, self.n_experts), jnp.int32))
        self.scale_table = AdapterTable(jnp.zeros((L, self.n_experts), jnp.float32))

    def _write(self, name: str, block: np.ndarray, start: int) -> None:
        var = getattr(self, name)
        var[...] = update_block(var[...], block, _starts(start, ndim=block.ndim))

    def _write_pool(self, name: str, block: np.ndarray, start: int) -> None:
        var = getattr(self, name)
        var[...] = write_shard_blocks(var[...], block, (), start,
                                      shard_slots=self.slots_per_shard)

    def set_expert_shards(self, expert_shards: int) -> None:
        """Re-lay the pools out in ``expert_shards`` shards (host-side; the
        arrays must be fully addressable): every pair moves to its slot in
        the new layout and the tables follow; cells outside the pool become
        -1. The folds of the route give the same bits before and after."""
        D = _check_shards("set_expert_shards", self.n_experts, expert_shards)
        L, E = self.max_loras, self.n_experts
        slots = shard_slots(E, L, D, np.arange(L)[:, None], np.arange(E)[None, :])
        new_size = D * (1 + L * (E // D))
        tables = {}
        for pool, table in (("a_pool", "a_table"), ("b_pool", "b_table")):
            new, tables[table] = _relaid(np.asarray(jax.device_get(getattr(self, pool)[...])),
                                         np.asarray(jax.device_get(getattr(self, table)[...])),
                                         slots, new_size)
            getattr(self, pool).set_value(jnp.asarray(new))
        for table, cells in tables.items():
            getattr(self, table).set_value(jnp.asarray(cells))
        self.expert_shards = D


class StackedExpertLoRA(nnx.Module):
    """LoRA pools and tables of ``S`` projections of equal shapes (a layer's
    gate and up), stacked on a leading axis.

    Args:
      names: the projections' names, in stacking order (``("gate", "up")``).
      n_experts, k_in, n_out, max_loras, max_rank, dtype, param_type,
        expert_shards: as :class:`ExpertLoRA`, common to the ``S``
        projections.

    State, in the layout of a ``StackedRoute`` (``ops/stacked.py``), which
    the decode fold reads as stored: ``a_pool [S, P, R, K]``, ``b_pool [S, P,
    N, R]`` (``param_type``; member ``s`` has the pool layout of an
    :class:`ExpertLoRA` in ``[s]``), ``a_cells``/``b_cells`` int32 ``[L, S *
    E_t]`` and ``scales`` float32 ``[L, S * E_t]`` (:class:`AdapterTable`;
    column ``s * E_t + e`` is member ``s``'s expert ``e``, a pair in its pool
    slot ``c`` stored as ``s * P + c``). ``a_table``, ``b_table`` and
    ``scale_table`` are the per-member view ``[S, L, E_t]`` (computed).
    :meth:`route` hands the stored arrays to the folds as one
    ``StackedRoute`` (no copy); :meth:`view` gives one projection with the
    interface of an :class:`ExpertLoRA` (its writes land in the stacked
    arrays).
    """

    def __init__(self, names: Sequence[str], n_experts: int, k_in: int, n_out: int, *,
                 max_loras: int, max_rank: int, dtype: Any = jnp.float32,
                 param_type: type[nnx.Variable] = nnx.LoRAParam, expert_shards: int = 1):
        names = tuple(names)
        if not names or len(set(names)) != len(names) or not all(
                isinstance(n, str) for n in names):
            raise ValueError(f"StackedExpertLoRA: names must be distinct strings, got {names!r}")
        _check_sizes("StackedExpertLoRA", n_experts=n_experts, k_in=k_in, n_out=n_out,
                     max_loras=max_loras, max_rank=max_rank)
        self.names = names
        self.n_experts, self.k_in, self.n_out = int(n_experts), int(k_in), int(n_out)
        self.max_loras, self.max_rank = int(max_loras), padded_rank(int(max_rank))
        self.expert_shards = _check_shards("StackedExpertLoRA", self.n_experts, expert_shards)
        self.dtype = jnp.dtype(dtype)
        S, P = len(names), self.pool_size
        R, L, E = self.max_rank, self.max_loras, self.n_experts
        self.a_pool = param_type(jnp.zeros((S, P, R, self.k_in), self.dtype))
        self.b_pool = param_type(jnp.zeros((S, P, self.n_out, R), self.dtype))
        self.a_cells = AdapterTable(jnp.zeros((L, S * E), jnp.int32))
        self.b_cells = AdapterTable(jnp.zeros((L, S * E), jnp.int32))
        self.scales = AdapterTable(jnp.zeros((L, S * E), jnp.float32))

    @property
    def num_projections(self) -> int:
        return len(self.names)

    @property
    def slots_per_shard(self) -> int:
        """``P_d = 1 + L * E_t / expert_shards``: the pool slots of one shard."""
        return 1 + self.max_loras * (self.n_experts // self.expert_shards)

    @property
    def pool_size(self) -> int:
        """``P``, each member's pool slots."""
        return self.expert_shards * self.slots_per_shard

    def set_expert_shards(self, expert_shards: int) -> None:
        """Re-lay every member's pools out in ``expert_shards`` shards, as
        :meth:`ExpertLoRA.set_expert_shards` does (host-side)."""
        D = _check_shards("set_expert_shards", self.n_experts, expert_shards)
        L, E, S = self.max_loras, self.n_experts, len(self.names)
        slots = shard_slots(E, L, D, np.arange(L)[:, None], np.arange(E)[None, :])
        new_size = D * (1 + L * (E // D))
        route = jax.tree.map(lambda v: np.asarray(jax.device_get(v)), self.route())
        pools, cells = {"a_pool": [], "b_pool": []}, {"a_cells": [], "b_cells": []}
        for s in range(S):
            for pool, table, stored in (("a_pool", "a_table", "a_cells"),
                                        ("b_pool", "b_table", "b_cells")):
                new, tab = _relaid(getattr(route, pool)[s], np.asarray(
                    getattr(route, table)[s]), slots, new_size)
                pools[pool].append(new)
                cells[stored].append(np.asarray(stored_cells(tab, s, new_size)))
        for name, members in pools.items():
            getattr(self, name).set_value(jnp.asarray(np.stack(members)))
        for name, members in cells.items():  # [S, L, E] -> columns s * E + e of [L, S * E]
            getattr(self, name).set_value(jnp.asarray(np.concatenate(members, axis=1)))
        self.expert_shards = D

    def route(self) -> StackedRoute:
        """The ``S`` projections' ``StackedRoute``: the stored arrays, as they
        are (traceable; no stacking, no copy)."""
        return StackedRoute.tree_unflatten(None, [
            getattr(self, n)[...] for n in StackedRoute.__slots__])

    # the per-member tables [S, L, E_t] (computed from the stored layout)
    @property
    def a_table(self) -> Array:
        return self.route().a_table

    @property
    def b_table(self) -> Array:
        return self.route().b_table

    @property
    def scale_table(self) -> Array:
        return self.route().scale_table

    def view(self, projection: str | int) -> "ExpertLoRAView":
        """Projection ``projection`` (a name or an index into ``names``)."""
        if isinstance(projection, str):
            if projection not in self.names:
                raise KeyError(f"no projection {projection!r} in {self.names}")
            projection = self.names.index(projection)
        if not isinstance(projection, (int, np.integer)) or not (
                0 <= projection < len(self.names)):
            raise IndexError(f"projection index must be in [0, {len(self.names)}), got "
                             f"{projection!r}")
        return ExpertLoRAView(self, int(projection))


class StackedSlice:
    """Member ``index`` of a stacked variable: ``[idx]`` reads ``variable[index][idx]``,
    ``[idx] = v`` writes it (the stacked variable gets the new array)."""

    __slots__ = ("variable", "index")

    def __init__(self, variable: nnx.Variable, index: int):
        self.variable, self.index = variable, int(index)

    def __getitem__(self, idx: Any) -> Array:
        return self.variable[...][self.index][idx]

    def __setitem__(self, idx: Any, value: Any) -> None:
        full = self.variable[...]
        self.variable[...] = full.at[self.index].set(full[self.index].at[idx].set(value))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.variable.shape[1:])

    @property
    def dtype(self) -> Any:
        return self.variable.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return (f"StackedSlice({type(self.variable).__name__}[{self.index}], "
                f"{self.dtype}{list(self.shape)})")


class MemberTable:
    """Member ``index``'s table ``[L, E_t]`` of a :class:`StackedExpertLoRA`
    (``name``: ``"a_table"``, ``"b_table"`` or ``"scale_table"``), read with
    ``[idx]`` from the stored columns ``index * E_t ...`` (pool slots shifted
    back to the member's own). Writes go through
    :meth:`ExpertLoRAView.write_slot`."""

    __slots__ = ("stack", "name", "index")

    def __init__(self, stack: "StackedExpertLoRA", name: str, index: int):
        self.stack, self.name, self.index = stack, name, int(index)

    def __getitem__(self, idx: Any) -> Array:
        return getattr(self.stack.route(), self.name)[self.index][idx]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.stack.max_loras, self.stack.n_experts)

    @property
    def dtype(self) -> Any:
        return jnp.dtype(jnp.float32 if self.name == "scale_table" else jnp.int32)

    @property
    def ndim(self) -> int:
        return 2

    def __repr__(self) -> str:
        return f"MemberTable({self.name}[{self.index}], {self.dtype}{list(self.shape)})"


#: A member's table name -> the stacked variable that stores it.
_STORED_TABLE = {"a_table": "a_cells", "b_table": "b_cells", "scale_table": "scales"}


class ExpertLoRAView(_SlotWriter):
    """One projection of a :class:`StackedExpertLoRA`, with the interface of
    an :class:`ExpertLoRA` (``write_slot``, ``clear_slot``, ``set_lora``,
    ``get_lora``, ``check``, ``route``, ``pool_slot``, the shape attributes).

    ``a_pool`` and ``b_pool`` are :class:`StackedSlice`\\ s (``[...]`` reads
    or writes member ``index`` of the stacked variable); ``a_table``,
    ``b_table`` and ``scale_table`` are :class:`MemberTable`\\ s (``[...]``
    reads the member's ``[L, E_t]`` table).
    """

    def __init__(self, stack: StackedExpertLoRA, index: int):
        self.stack, self.index, self.name = stack, int(index), stack.names[index]
        self.n_experts, self.k_in, self.n_out = stack.n_experts, stack.k_in, stack.n_out
        self.max_loras, self.max_rank, self.dtype = stack.max_loras, stack.max_rank, stack.dtype
        self.expert_shards = stack.expert_shards
        self.a_pool = StackedSlice(stack.a_pool, self.index)
        self.b_pool = StackedSlice(stack.b_pool, self.index)
        for n in _STORED_TABLE:
            setattr(self, n, MemberTable(stack, n, self.index))

    def _write(self, name: str, block: np.ndarray, start: int) -> None:
        if name in _STORED_TABLE:  # one table row [1, E_t] at row `start` (the slot)
            if name != "scale_table":  # the member's slot c stored as index * P + c
                block = stored_cells(block, self.index, self.pool_size)
            var = getattr(self.stack, _STORED_TABLE[name])
            var[...] = update_block(var[...], block, _starts(start, self.index * self.n_experts,
                                                             ndim=2))
            return
        raise ValueError(f"ExpertLoRAView: {name!r} is a pool; write it with _write_pool")

    def _write_pool(self, name: str, block: np.ndarray, start: int) -> None:
        var = getattr(self.stack, name)
        var[...] = write_shard_blocks(var[...], block[None], (self.index,), start,
                                      shard_slots=self.slots_per_shard)

    def __repr__(self) -> str:
        return (f"ExpertLoRAView({self.name!r}: E_t={self.n_experts}, K={self.k_in}, "
                f"N={self.n_out}, L={self.max_loras}, R={self.max_rank}, {self.dtype})")


class MoELoRA(nnx.Module):
    """Per-layer LoRA state of an MoE layer.

    Args:
      hidden_size: the model width ``H``.
      intermediate_size: each routed expert's width ``I``.
      num_experts: ``E``.
      shared_intermediate_size: the shared-expert MLP's width ``I_s`` (0:
        no shared experts).
      max_loras: adapter slots ``L`` (a token's adapter id picks one).
      max_rank: pool rank, rounded up to a multiple of 8.
      dtype: the expert pools' dtype (the block's activation dtype).
      router_dtype: the router pools' dtype (the router runs in it).
      param_type: the pools' variable type.
      a_initializer, b_initializer: initializers of a fresh adapter's
        ``A [E_t, r, K]`` and ``B [E_t, N, r]`` (:meth:`init_adapter`);
        PEFT's by default (``B`` zero, so a fresh adapter is the base model).
      expert_shards: the routed experts' pool layout (gate, up, down): ``D``
        shards, one per device of an expert-parallel mesh axis (module
        docstring); the router and shared experts keep one.

    State: ``router`` (:class:`ExpertLoRA`, ``E_t = 1``, ``K = H``, ``N =
    E``), ``gate_up`` (:class:`StackedExpertLoRA` of gate and up, ``K = H``,
    ``N = I``), ``down`` (:class:`ExpertLoRA`, ``K = I``, ``N = H``); with
    shared experts ``shared_gate_up`` (stacked shared gate and up, ``E_t =
    1``, ``K = H``, ``N = I_s``) and ``shared_down`` (``K = I_s``, ``N =
    H``). Gate and up share one set of arrays so that :meth:`routes` hands
    them to the block's fold as one ``StackedRoute`` without a copy.

    Projections by name (``projections`` lists this layer's, in PEFT's
    names): ``router``, ``down``, ``shared_down`` are the modules; ``gate``,
    ``up``, ``shared_gate``, ``shared_up`` are :class:`ExpertLoRAView`\\ s of
    the stacked modules (same interface).
    """

    def __init__(self, *, hidden_size: int, intermediate_size: int, num_experts: int,
                 shared_intermediate_size: int = 0, max_loras: int = 4, max_rank: int = 16,
                 dtype: Any = jnp.float32, router_dtype: Any = jnp.float32,
                 param_type: type[nnx.Variable] = nnx.LoRAParam,
                 a_initializer: Any = default_a_initializer,
                 b_initializer: Any = nnx.initializers.zeros_init(), expert_shards: int = 1):
        kw = dict(max_loras=max_loras, max_rank=max_rank, param_type=param_type)
        H, I, E, S = hidden_size, intermediate_size, num_experts, int(shared_intermediate_size)
        if S < 0:
            raise ValueError(f"MoELoRA: shared_intermediate_size must be >= 0, got {S}")
        self.hidden_size, self.intermediate_size, self.num_experts = H, I, E
        self.shared_intermediate_size = S
        self.max_loras, self.max_rank = int(max_loras), padded_rank(int(max_rank))
        self.a_initializer, self.b_initializer = a_initializer, b_initializer
        self.router = ExpertLoRA(1, H, E, dtype=router_dtype, **kw)
        self.gate_up = StackedExpertLoRA(("gate", "up"), E, H, I, dtype=dtype,
                                         expert_shards=expert_shards, **kw)
        self.down = ExpertLoRA(E, I, H, dtype=dtype, expert_shards=expert_shards, **kw)
        if S:
            self.shared_gate_up = StackedExpertLoRA(SHARED_PROJECTIONS[:2], 1, H, S,
                                                    dtype=dtype, **kw)
            self.shared_down = ExpertLoRA(1, S, H, dtype=dtype, **kw)
        self.projections = PROJECTIONS + (SHARED_PROJECTIONS if S else ())

    @property
    def expert_shards(self) -> int:
        """The routed experts' pool layout: shards of experts (1: unsharded)."""
        return self.down.expert_shards

    def set_expert_shards(self, expert_shards: int) -> None:
        """Re-lay gate, up and down out in ``expert_shards`` shards
        (:meth:`ExpertLoRA.set_expert_shards`, host-side)."""
        self.gate_up.set_expert_shards(expert_shards)
        self.down.set_expert_shards(expert_shards)

    # gate and up (and the shared ones) as projections of their own
    @property
    def gate(self) -> ExpertLoRAView:
        return self.gate_up.view(0)

    @property
    def up(self) -> ExpertLoRAView:
        return self.gate_up.view(1)

    def _shared_gate_up(self) -> StackedExpertLoRA:
        if not self.shared_intermediate_size:
            raise AttributeError("this layer has no shared experts")
        return self.shared_gate_up

    @property
    def shared_gate(self) -> ExpertLoRAView:
        return self._shared_gate_up().view(0)

    @property
    def shared_up(self) -> ExpertLoRAView:
        return self._shared_gate_up().view(1)

    def projection(self, name: str) -> ExpertLoRA | ExpertLoRAView:
        """Projection ``name``: an :class:`ExpertLoRA`, or the
        :class:`ExpertLoRAView` of a stacked one."""
        if name not in self.projections:
            raise AdapterFormatError(
                f"unknown projection {name!r} for this layer; known: {self.projections}")
        return getattr(self, name)

    def routes(self) -> MoELoRARoutes:
        """The layer's routes (traceable): gate and up as one ``StackedRoute``
        of the stored arrays (and the shared gate and up, if any)."""
        shared = bool(self.shared_intermediate_size)
        return MoELoRARoutes(
            router=self.router.route(), gate_up=self.gate_up.route(), down=self.down.route(),
            shared_gate_up=self.shared_gate_up.route() if shared else None,
            shared_down=self.shared_down.route() if shared else None)

    def in_gemm_packs(self) -> MoELoRAPacks:
        """The routed experts' gate, up and down routes packed for the expert
        GEMM's K loop (``pack_lora_in_gemm``, traceable): pass them to
        :class:`MoEBlock` as ``lora_packs`` while the adapters stay as they
        are now, and make them again after any change (a slot written or
        cleared, a training step)."""
        routes = self.routes()
        return MoELoRAPacks(pack_lora_in_gemm(routes.gate), pack_lora_in_gemm(routes.up),
                            pack_lora_in_gemm(routes.down))

    def check_adapter(self, projections: Mapping[str, ProjectionLoRA], where: str = "") -> None:
        """Raise ``AdapterFormatError`` naming the key if a projection does not fit."""
        for name, lora in projections.items():
            if name not in self.projections:
                raise AdapterFormatError(
                    f"unknown projection: key {lora.key(int(np.argmax(lora.present)))!r} adapts "
                    f"{where}{name}, the layer has {self.projections}")
            self.projection(name).check(lora, f"{where}{name}")

    def set_adapter(self, slot: int, projections: Mapping[str, ProjectionLoRA],
                    where: str = "") -> None:
        """Install one layer of an adapter into ``slot``; projections it lacks
        are cleared (they fold nothing for this adapter)."""
        self.check_adapter(projections, where)
        for name in self.projections:
            self.projection(name).set_lora(slot, projections.get(name), f"{where}{name}")

    def get_adapter(self, slot: int, where: str = "") -> dict[str, ProjectionLoRA]:
        """One layer of the adapter in ``slot`` as it is now (trained or
        loaded): ``{projection: ProjectionLoRA}`` (:meth:`_SlotWriter.get_lora`)
        of the projections that adapt some expert; the inverse of
        :meth:`set_adapter`."""
        out = {}
        for name in self.projections:
            lora = self.projection(name).get_lora(slot, f"{where}{name}")
            if lora is not None:
                out[name] = lora
        return out

    def clear_adapter(self, slot: int) -> None:
        """Unload ``slot``: every table cell 0 and the pool blocks zeroed."""
        for name in self.projections:
            self.projection(name).clear_slot(slot)

    def init_adapter(self, slot: int, *, rngs: nnx.Rngs, rank: int | None = None,
                     alpha: float | None = None,
                     projections: Sequence[str] | None = None) -> None:
        """A fresh trainable adapter in ``slot`` (every projection by default):
        ``A`` from ``a_initializer``, ``B`` from ``b_initializer``, scale
        ``alpha / rank`` (default ``alpha = rank``), every expert adapted."""
        rank = self.max_rank if rank is None else int(rank)
        if not 1 <= rank <= self.max_rank:
            raise ValueError(f"init_adapter: rank must be in [1, {self.max_rank}], got {rank}")
        scale = (rank if alpha is None else alpha) / rank
        for name in self.projections if projections is None else projections:
            proj = self.projection(name)
            E, K, N = proj.n_experts, proj.k_in, proj.n_out
            a = self.a_initializer(rngs.params(), (E, rank, K), jnp.float32)
            b = self.b_initializer(rngs.params(), (E, N, rank), jnp.float32)
            proj.write_slot(slot, a, b, np.full(E, scale, np.float32), np.ones(E, bool))
