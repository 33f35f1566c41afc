"""Per-expert adapter tables and the device route of one projection (SPEC §3).

``MoeExpertRoute`` holds one projection's (gate, up, down or router) LoRA
pools and the tables that map ``(table row l, expert id e)`` to pool slots:

- ``a_pool`` ``[P, R, K]`` and ``b_pool`` ``[P, N, R]``, the activation dtype
  (bf16, f16 or f32); pool slot 0 is reserved and never holds an adapter.
- ``a_table``, ``b_table`` int32 ``[L, E_t]`` and ``scale_table`` f32
  ``[L, E_t]``; a cell 0 means "not adapted".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_moelora._ext import RANK_ALIGN

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

__all__ = ["MoeExpertRoute", "FLOAT_DTYPES"]


def _shape_dtype(v: Any) -> tuple[tuple[int, ...], np.dtype] | None:
    shape, dtype = getattr(v, "shape", None), getattr(v, "dtype", None)
    if shape is None or dtype is None:
        return None
    return tuple(shape), jnp.dtype(dtype)


@jax.tree_util.register_pytree_node_class
class MoeExpertRoute:
    """Device tables for one projection's expert LoRA pairs (a pytree).

    Build it as ``MoeExpertRoute(a_pool=..., b_pool=..., a_table=...,
    b_table=..., scale_table=...)``. Tables may be ``[L, E_t]`` or 1-D
    ``[E_t]`` (meaning ``L = 1``, the single-active model); they are stored
    as ``[L, E_t]``. Integer tables are cast to int32, scales to float32.

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

    # pytree protocol: unflatten bypasses validation (leaves may be tracers,
    # None or sentinels inside transformations).
    def tree_flatten(self):
        return (self.a_pool, self.b_pool, self.a_table, self.b_table, self.scale_table), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        for name, value in zip(cls.__slots__, children):
            object.__setattr__(obj, name, value)
        return obj

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
