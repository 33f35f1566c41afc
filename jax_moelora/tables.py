"""Per-expert adapter tables and the device route of one projection (docs/semantics.md §3).

``MoeExpertRoute`` holds one projection's (gate, up, down or router) LoRA
pools and the tables that map ``(table row l, expert id e)`` to pool slots:

- ``a_pool`` ``[P, R, K]`` and ``b_pool`` ``[P, N, R]``, the activation dtype
  (bf16, f16 or f32); pool slot 0 is reserved and never holds an adapter.
- ``a_table``, ``b_table`` int32 ``[L, E_t]`` and ``scale_table`` f32
  ``[L, E_t]``; a cell 0 means "not adapted".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_moelora._ext import RANK_ALIGN
from jax_moelora.geometry import padded_rank
from jax_moelora.int_range import check_int32_values

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

__all__ = [
    "MoeExpertRoute",
    "FLOAT_DTYPES",
    "ExpertTables",
    "pack_expert_tables",
    "pack_expert_tables_traced",
    "route_from_dense",
    "router_route",
]

_I32 = np.iinfo(np.int32)


def _shape_dtype(v: Any) -> tuple[tuple[int, ...], np.dtype] | None:
    shape, dtype = getattr(v, "shape", None), getattr(v, "dtype", None)
    if shape is None or dtype is None:
        return None
    return tuple(shape), jnp.dtype(dtype)


class SlotsPytree:
    """The pytree protocol of a class whose ``__slots__`` are its leaves, in
    order. Unflattening bypasses ``__init__`` and its validation (leaves may
    be tracers, None or sentinels inside transformations)."""

    __slots__ = ()

    def tree_flatten(self):
        return tuple(getattr(self, name) for name in self.__slots__), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        for name, value in zip(cls.__slots__, children):
            object.__setattr__(obj, name, value)
        return obj


@jax.tree_util.register_pytree_node_class
class MoeExpertRoute(SlotsPytree):
    """Device tables for one projection's expert LoRA pairs (a pytree).

    Build it as ``MoeExpertRoute(a_pool=..., b_pool=..., a_table=...,
    b_table=..., scale_table=...)``. Tables may be ``[L, E_t]`` or 1-D
    ``[E_t]`` (meaning ``L = 1``, the single-active model); they are stored
    as ``[L, E_t]``. Integer tables are cast to int32 (a concrete value
    outside int32 raises ``int_range.Int32RangeError``, an ``OverflowError``
    and ``ValueError``), scales to float32.

    Properties: ``n_experts`` (``E_t``, the table length), ``k_in`` (``K``),
    ``n_out`` (``N``), ``max_rank`` (``R``), ``max_loras`` (``L``),
    ``pool_size`` (``P``) and ``dtype``.
    """

    __slots__ = ("a_pool", "b_pool", "a_table", "b_table", "scale_table")

    def __init__(self, *, a_pool: Any, b_pool: Any, a_table: Any, b_table: Any,
                 scale_table: Any) -> None:
        a_table, b_table, scale_table = (
            self._table(a_table, "a_table", int),
            self._table(b_table, "b_table", int),
            self._table(scale_table, "scale_table", float),
        )
        self.a_pool, self.b_pool = a_pool, b_pool
        self.a_table, self.b_table, self.scale_table = a_table, b_table, scale_table
        self.validate()

    @staticmethod
    def _table(t: Any, name: str, kind: type) -> Any:
        if _shape_dtype(t) is None:
            t = np.asarray(t)
        dtype = jnp.dtype(t.dtype)
        if kind is int:
            if not jnp.issubdtype(dtype, jnp.integer):
                raise TypeError(f"MoeExpertRoute: {name} must be an integer array, got {dtype}")
            check_int32_values(t, name, "MoeExpertRoute")
            target = jnp.int32
        else:
            if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
                raise TypeError(f"MoeExpertRoute: {name} must be a float array, got {dtype}")
            target = jnp.float32
        if t.ndim == 1:
            t = t.reshape(1, -1)
        if t.ndim != 2:
            raise ValueError(f"MoeExpertRoute: {name} must be [L, E_t] or [E_t], got shape {tuple(t.shape)}")
        if dtype != jnp.dtype(target):
            t = t.astype(target)
        return t

    def validate(self) -> None:
        """Check shapes and dtypes; raises ``ValueError``/``TypeError``."""
        a, b = _shape_dtype(self.a_pool), _shape_dtype(self.b_pool)
        if a is None or b is None:
            raise TypeError("MoeExpertRoute: a_pool and b_pool must be arrays")
        (ashape, adt), (bshape, bdt) = a, b
        if len(ashape) != 3:
            raise ValueError(f"MoeExpertRoute: a_pool must be [P, R, K], got shape {ashape}")
        if len(bshape) != 3:
            raise ValueError(f"MoeExpertRoute: b_pool must be [P, N, R], got shape {bshape}")
        if adt not in FLOAT_DTYPES:
            raise TypeError(f"MoeExpertRoute: a_pool dtype must be bf16, f16 or f32, got {adt}")
        if bdt != adt:
            raise TypeError(f"MoeExpertRoute: b_pool dtype {bdt} differs from a_pool dtype {adt}")
        p, r, k = ashape
        pb, n, rb = bshape
        if pb != p:
            raise ValueError(f"MoeExpertRoute: a_pool has {p} slots but b_pool has {pb}")
        if rb != r:
            raise ValueError(f"MoeExpertRoute: a_pool rank {r} differs from b_pool rank {rb}")
        if p < 1 or k < 1 or n < 1:
            raise ValueError(f"MoeExpertRoute: empty pool (a_pool {ashape}, b_pool {bshape})")
        if r < 1 or r % RANK_ALIGN:
            raise ValueError(
                f"MoeExpertRoute: max_rank {r} must be a positive multiple of {RANK_ALIGN}; "
                "pad ranks with zeros (geometry.padded_rank)")
        at, bt, st = self.a_table.shape, self.b_table.shape, self.scale_table.shape
        if not (tuple(at) == tuple(bt) == tuple(st)):
            raise ValueError(
                f"MoeExpertRoute: table shapes differ: a_table {tuple(at)}, b_table {tuple(bt)}, "
                f"scale_table {tuple(st)}")
        if at[0] < 1 or at[1] < 1:
            raise ValueError(f"MoeExpertRoute: tables must be non-empty [L, E_t], got {tuple(at)}")

    @classmethod
    def from_dense(cls, a: Any, b: Any, scales: Any, mask: Any = None, *,
                   ranks: Any = None) -> "MoeExpertRoute":
        """Same as :func:`route_from_dense`."""
        return route_from_dense(a, b, scales, mask, ranks=ranks)

    @classmethod
    def router(cls, a: Any, b: Any, scale: Any, mask: Any = None) -> "MoeExpertRoute":
        """Same as :func:`router_route`."""
        return router_route(a, b, scale, mask)

    def replace(self, **changes: Any) -> "MoeExpertRoute":
        """A copy with some fields replaced (validated)."""
        fields = {name: getattr(self, name) for name in self.__slots__}
        fields.update(changes)
        return MoeExpertRoute(**fields)

    @property
    def n_experts(self) -> int:
        return int(self.a_table.shape[1])

    @property
    def max_loras(self) -> int:
        return int(self.a_table.shape[0])

    @property
    def pool_size(self) -> int:
        return int(self.a_pool.shape[0])

    @property
    def max_rank(self) -> int:
        return int(self.a_pool.shape[1])

    @property
    def k_in(self) -> int:
        return int(self.a_pool.shape[2])

    @property
    def n_out(self) -> int:
        return int(self.b_pool.shape[1])

    @property
    def dtype(self) -> np.dtype:
        return jnp.dtype(self.a_pool.dtype)

    def __repr__(self) -> str:
        return (f"MoeExpertRoute(n_experts={self.n_experts}, k_in={self.k_in}, n_out={self.n_out}, "
                f"max_rank={self.max_rank}, max_loras={self.max_loras}, pool_size={self.pool_size}, "
                f"dtype={self.dtype})")


# ---------------------------------------------------------------------------
# Packed per-expert tables
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class ExpertTables:
    """Dense per-expert tables of one adapter (one row of a route's tables).

    ``a``, ``b``: int32 ``[n_experts]`` pool slots (0: not adapted);
    ``scale``: float32 ``[n_experts]`` (0.0 where not adapted);
    ``n_experts``: the table length (static; pytree metadata, so the tables
    can be returned from ``jit``). Unpacks as ``a, b, scale, n_experts``.
    """

    a: Any
    b: Any
    scale: Any
    n_experts: int

    def __iter__(self) -> Iterator[Any]:
        return iter((self.a, self.b, self.scale, self.n_experts))


jax.tree_util.register_dataclass(ExpertTables, data_fields=["a", "b", "scale"],
                                 meta_fields=["n_experts"])


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _entry_int(v: Any, what: str, i: int, lo: int) -> int:
    if not _is_int(v):
        raise TypeError(f"pack_expert_tables: entry {i}: {what} must be an int, got {v!r}")
    v = int(v)
    if v < lo or v > _I32.max:
        raise ValueError(f"pack_expert_tables: entry {i}: {what} must be in [{lo}, {_I32.max}], "
                         f"got {v}")
    return v


def pack_expert_tables(entries: Iterable[tuple[int, int, int, float]],
                       n_experts: int | None = None) -> ExpertTables | None:
    """Pack ``(expert_id, a_slot, b_slot, scale)`` entries into dense tables
    indexed by expert id (host, NumPy).

    Unadapted ids hold ``0 / 0 / 0.0``; a duplicate expert id keeps its LAST
    entry. ``n_experts`` is ``max expert_id + 1`` unless given, in which case
    the tables are that long and an id ``>= n_experts`` raises.

    Returns:
      ``ExpertTables`` of NumPy arrays (int32, int32, float32), or ``None``
      when ``entries`` is empty.

    Raises:
      ValueError: a malformed entry, a negative id or slot, a slot or id
        outside int32, a non-finite scale, or an id ``>= n_experts``.
      TypeError: non-integer ids/slots, non-real scales.
    """
    if n_experts is not None:
        if not _is_int(n_experts):
            raise TypeError(f"pack_expert_tables: n_experts must be an int, got {n_experts!r}")
        if n_experts < 1:
            raise ValueError(f"pack_expert_tables: n_experts must be >= 1, got {n_experts}")
    ids, a_slots, b_slots, scales = [], [], [], []
    for i, entry in enumerate(entries):
        try:
            eid, a, b, s = entry
        except (TypeError, ValueError):
            raise ValueError(f"pack_expert_tables: entry {i} must be (expert_id, a_slot, b_slot, "
                             f"scale), got {entry!r}") from None
        ids.append(_entry_int(eid, "expert_id", i, 0))
        a_slots.append(_entry_int(a, "a_slot", i, 0))
        b_slots.append(_entry_int(b, "b_slot", i, 0))
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, float, np.integer, np.floating)):
            raise TypeError(f"pack_expert_tables: entry {i}: scale must be a real number, got {s!r}")
        if not math.isfinite(float(s)):
            raise ValueError(f"pack_expert_tables: entry {i}: scale must be finite, got {s!r}")
        scales.append(float(s))
    if not ids:
        return None
    id_arr = np.asarray(ids, np.int64)
    n = int(id_arr.max()) + 1 if n_experts is None else int(n_experts)
    if n_experts is not None and id_arr.max() >= n:
        i = int(np.argmax(id_arr >= n))
        raise ValueError(f"pack_expert_tables: entry {i}: expert_id {ids[i]} >= n_experts {n}")
    # the last entry of each id: first occurrence in the reversed list
    uniq, first_rev = np.unique(id_arr[::-1], return_index=True)
    last = len(ids) - 1 - first_rev
    a_t = np.zeros(n, np.int32)
    b_t = np.zeros(n, np.int32)
    s_t = np.zeros(n, np.float32)
    a_t[uniq] = np.asarray(a_slots, np.int64)[last]
    b_t[uniq] = np.asarray(b_slots, np.int64)[last]
    s_t[uniq] = np.asarray(scales, np.float64)[last]
    return ExpertTables(a=a_t, b=b_t, scale=s_t, n_experts=n)


def _vec(v: Any, name: str, integer: bool) -> jax.Array:
    if not isinstance(v, jax.Array):
        v = np.asarray(v)
        if v.size == 0 and v.dtype.kind == "f" and integer:
            v = v.astype(np.int32)
    dt = jnp.dtype(v.dtype)
    if integer and not jnp.issubdtype(dt, jnp.integer):
        raise TypeError(f"pack_expert_tables_traced: {name} must be integers, got {dt}")
    if not integer and not (jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer)):
        raise TypeError(f"pack_expert_tables_traced: {name} must be real numbers, got {dt}")
    if v.ndim != 1:
        raise ValueError(f"pack_expert_tables_traced: {name} must be 1-D, got shape {tuple(v.shape)}")
    if integer:
        check_int32_values(v, name, "pack_expert_tables_traced")
    return jnp.asarray(v).astype(jnp.int32 if integer else jnp.float32)


def pack_expert_tables_traced(expert_ids: Any, a_slots: Any, b_slots: Any, scales: Any,
                              n_experts: int) -> tuple[ExpertTables, jax.Array]:
    """Traceable twin of :func:`pack_expert_tables` with a static table length.

    Args:
      expert_ids, a_slots, b_slots: int ``[M]`` (host or traced).
      scales: real ``[M]``.
      n_experts: static Python int ``>= 1``, the table length.

    Returns:
      ``(tables, valid)``: ``ExpertTables`` of ``jnp`` arrays (int32, int32,
      float32 ``[n_experts]``) and a bool scalar, False when some id was
      ``< 0`` or ``>= n_experts``; those entries are dropped. A duplicate id
      keeps its last entry, deterministically (a scatter-max of the entry
      index, then a gather). Slots and scales are copied as given. With no
      entries (``M == 0``) the tables are all zero and ``valid`` is True.
    """
    if not _is_int(n_experts):
        raise TypeError(f"pack_expert_tables_traced: n_experts must be a static int, got "
                        f"{type(n_experts).__name__}")
    n = int(n_experts)
    if n < 1:
        raise ValueError(f"pack_expert_tables_traced: n_experts must be >= 1, got {n}")
    ids = _vec(expert_ids, "expert_ids", True)
    a = _vec(a_slots, "a_slots", True)
    b = _vec(b_slots, "b_slots", True)
    s = _vec(scales, "scales", False)
    m = ids.shape[0]
    if not (a.shape[0] == b.shape[0] == s.shape[0] == m):
        raise ValueError(f"pack_expert_tables_traced: lengths differ: expert_ids {m}, a_slots "
                         f"{a.shape[0]}, b_slots {b.shape[0]}, scales {s.shape[0]}")
    if m == 0:
        zi, zf = jnp.zeros((n,), jnp.int32), jnp.zeros((n,), jnp.float32)
        return ExpertTables(a=zi, b=zi, scale=zf, n_experts=n), jnp.bool_(True)
    in_range = (ids >= 0) & (ids < n)
    target = jnp.where(in_range, ids, n)  # out-of-range entries land in a spare cell
    winner = jnp.full((n + 1,), -1, jnp.int32).at[target].max(jnp.arange(m, dtype=jnp.int32))[:n]
    has = winner >= 0
    w = jnp.clip(winner, 0, m - 1)
    tables = ExpertTables(a=jnp.where(has, a[w], 0), b=jnp.where(has, b[w], 0),
                          scale=jnp.where(has, s[w], jnp.float32(0)), n_experts=n)
    return tables, jnp.all(in_range)


# ---------------------------------------------------------------------------
# Route constructors
# ---------------------------------------------------------------------------

def _concrete_np(v: Any, fn: str, name: str) -> np.ndarray:
    try:
        return np.asarray(v)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"{fn}: {name} decides the pool size, so it must be concrete "
                        "(not traced)") from None


def _build_route(fn: str, a: Any, b: Any, scales: Any, mask: Any, ranks: Any) -> MoeExpertRoute:
    """``a [L, E, r, K]``, ``b [L, E, N, r]``, ``scales`` ``()``/``[L]``/``[L, E]``."""
    sa, sb = _shape_dtype(a), _shape_dtype(b)
    if sa is None or sb is None:
        raise TypeError(f"{fn}: a and b must be arrays")
    (ashape, adt), (bshape, bdt) = sa, sb
    if adt not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: a dtype must be bf16, f16 or f32, got {adt}")
    if bdt != adt:
        raise TypeError(f"{fn}: b dtype {bdt} differs from a dtype {adt}")
    L, E, r, K = ashape
    Lb, Eb, N, rb = bshape
    if (Lb, Eb) != (L, E):
        raise ValueError(f"{fn}: a and b disagree on adapters/experts: a {ashape}, b {bshape}")
    if rb != r:
        raise ValueError(f"{fn}: a rank {r} differs from b rank {rb} (a {ashape}, b {bshape})")
    if min(L, E, r, K, N) < 1:
        raise ValueError(f"{fn}: empty dimension in a {ashape} or b {bshape}")

    ssd = _shape_dtype(scales)
    if ssd is None:
        if isinstance(scales, (bool, np.bool_)):
            raise TypeError(f"{fn}: scales must be real numbers, got bool")
        scales = np.asarray(scales)
        ssd = _shape_dtype(scales)
    sshape, sdt = ssd
    if not (jnp.issubdtype(sdt, jnp.floating) or jnp.issubdtype(sdt, jnp.integer)):
        raise TypeError(f"{fn}: scales must be real numbers, got {sdt}")
    if sshape == ():
        scales = jnp.full((L, E), scales, jnp.float32)
    elif sshape == (L,):
        scales = jnp.broadcast_to(jnp.asarray(scales, jnp.float32)[:, None], (L, E))
    elif sshape == (L, E):
        scales = jnp.asarray(scales, jnp.float32)
    else:
        raise ValueError(f"{fn}: scales must be a scalar, [L]=({L},) or [L, E]=({L}, {E}), "
                         f"got {sshape}")

    if mask is None:
        mask_np = np.ones((L, E), np.bool_)
    else:
        mask_np = _concrete_np(mask, fn, "mask")
        if mask_np.dtype != np.bool_:
            raise TypeError(f"{fn}: mask must be bool, got {mask_np.dtype}")
        if mask_np.shape != (L, E):
            raise ValueError(f"{fn}: mask must be [L, E]=({L}, {E}), got {mask_np.shape}")

    a = jnp.asarray(a)
    b = jnp.asarray(b)
    if ranks is not None:
        rk = _concrete_np(ranks, fn, "ranks")
        if rk.dtype.kind not in "iu":
            raise TypeError(f"{fn}: ranks must be integers, got {rk.dtype}")
        try:
            rk = np.broadcast_to(rk, (L, E))
        except ValueError:
            raise ValueError(f"{fn}: ranks must broadcast to [L, E]=({L}, {E}), got "
                             f"{rk.shape}") from None
        if rk.min() < 1 or rk.max() > r:
            raise ValueError(f"{fn}: ranks must be in [1, {r}], got values in "
                             f"[{int(rk.min())}, {int(rk.max())}]")
        keep = np.arange(r)[None, None, :] < rk[:, :, None]          # [L, E, r]
        a = jnp.where(keep[:, :, :, None], a, jnp.zeros((), a.dtype))
        b = jnp.where(keep[:, :, None, :], b, jnp.zeros((), b.dtype))

    li, ei = np.nonzero(mask_np)                                       # adapter-major order
    R = padded_rank(r)
    a_pool = jnp.concatenate([jnp.zeros((1, r, K), adt), a[li, ei]], axis=0)
    b_pool = jnp.concatenate([jnp.zeros((1, N, r), adt), b[li, ei]], axis=0)
    a_pool = jnp.pad(a_pool, ((0, 0), (0, R - r), (0, 0)))
    b_pool = jnp.pad(b_pool, ((0, 0), (0, 0), (0, R - r)))
    slots = np.zeros((L, E), np.int32)
    slots[li, ei] = np.arange(1, li.shape[0] + 1, dtype=np.int32)
    scale_table = jnp.where(jnp.asarray(mask_np), scales, jnp.float32(0))
    return MoeExpertRoute(a_pool=a_pool, b_pool=b_pool, a_table=jnp.asarray(slots),
                          b_table=jnp.asarray(slots), scale_table=scale_table)


def route_from_dense(a: Any, b: Any, scales: Any, mask: Any = None, *,
                     ranks: Any = None) -> MoeExpertRoute:
    """A :class:`MoeExpertRoute` from the dense per-expert layout.

    Args:
      a: ``A [L, E, r, K]`` (bf16, f16 or f32): adapter ``l``'s expert ``e``
        down-projection to rank ``r``.
      b: ``B [L, E, N, r]``, same dtype.
      scales: ``[L, E]``, ``[L]`` (one per adapter) or a scalar.
      mask: optional concrete bool ``[L, E]``: the adapted experts (default:
        all). Unadapted cells get table value 0 and scale 0.0 and take no
        pool slot.
      ranks: optional concrete ints broadcastable to ``[L, E]``, each pair's
        true rank in ``[1, r]``; A rows / B columns past it are zeroed.

    Returns:
      A route with ``max_loras = L``, ``n_experts = E``, pool slot 0 zero and
      slots ``1..`` holding the adapted pairs in adapter-major order (A and B
      of a pair share a slot), the rank zero-padded to ``padded_rank(r)``.
      ``a``, ``b`` and ``scales`` may be traced; ``mask`` and ``ranks`` may not.
    """
    for name, v in (("a", a), ("b", b)):
        sd = _shape_dtype(v)
        if sd is not None and len(sd[0]) != 4:
            want = "[L, E, r, K]" if name == "a" else "[L, E, N, r]"
            raise ValueError(f"route_from_dense: {name} must be {want}, got shape {sd[0]}")
    return _build_route("route_from_dense", a, b, scales, mask, ranks)


def router_route(a: Any, b: Any, scale: Any, mask: Any = None) -> MoeExpertRoute:
    """The router's one-entry route: expert 0 is the router LoRA pair.

    Args:
      a: ``[r, hidden]``, or ``[L, r, hidden]`` for ``L`` adapters.
      b: ``[num_experts, r]``, or ``[L, num_experts, r]``.
      scale: a scalar, or ``[L]`` (a scalar is shared by all adapters).
      mask: optional concrete bool ``[L]``: adapters that have a router LoRA.

    Returns:
      A route with ``n_experts = 1``, ``k_in = hidden``, ``n_out =
      num_experts`` and ``max_loras = L`` (1 for the 2-D form). Fold it with
      the gather kernel, all-zero ``indices``, ``top_k = 1``, ``x_gather = 0``.
    """
    sa, sb = _shape_dtype(a), _shape_dtype(b)
    if sa is None or sb is None:
        raise TypeError("router_route: a and b must be arrays")
    if len(sa[0]) not in (2, 3) or len(sb[0]) != len(sa[0]):
        raise ValueError(f"router_route: a and b must be [r, hidden] and [num_experts, r], or "
                         f"[L, r, hidden] and [L, num_experts, r]; got {sa[0]} and {sb[0]}")
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.ndim == 2:
        a, b = a[None], b[None]
    L = a.shape[0]
    ssd = _shape_dtype(scale)
    sshape = ssd[0] if ssd is not None else np.shape(scale)
    if sshape not in ((), (L,)):
        raise ValueError(f"router_route: scale must be a scalar or [L]=({L},), got {sshape}")
    if sshape == ():
        if isinstance(scale, (bool, np.bool_)):
            raise TypeError("router_route: scale must be a real number, got bool")
        scale = jnp.broadcast_to(jnp.asarray(scale), (L,))
    if mask is not None:
        m = _concrete_np(mask, "router_route", "mask")
        if m.shape != (L,):
            raise ValueError(f"router_route: mask must be [L]=({L},), got {m.shape}")
        mask = m[:, None]
    return _build_route("router_route", a[:, None], b[:, None], jnp.asarray(scale)[:, None],
                        mask, None)
