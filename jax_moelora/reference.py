"""Float64 NumPy reference of the two folds (docs/semantics.md §5, §6).

The arithmetic is float64 with the three roundings of the spec applied in the
activation dtype: ``xa``, ``delta``, and ``out = base + scale * delta``. Every
backend is tested against these functions; they are slow and host-only.
"""

from __future__ import annotations

import numpy as np

from jax_moelora.tables import MoeExpertRoute

__all__ = ["gather_bgmv_ref", "grouped_down_ref", "round_to"]


def round_to(v: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round float64 values to ``dtype`` and back to float64."""
    return np.asarray(v, dtype=np.float64).astype(dtype).astype(np.float64)


def _np_route(route: MoeExpertRoute):
    return (np.asarray(route.a_pool).astype(np.float64), np.asarray(route.b_pool).astype(np.float64),
            np.asarray(route.a_table), np.asarray(route.b_table),
            np.asarray(route.scale_table, dtype=np.float32))


def _pair(tables, L: int, E: int, P: int, adapter: int, expert: int):
    a_table, b_table, scale_table = tables
    if adapter < 0:
        return None
    l = 0 if L == 1 else adapter
    if l >= L or expert < 0 or expert >= E:
        return None
    a, b = int(a_table[l, expert]), int(b_table[l, expert])
    if a <= 0 or b <= 0 or a >= P or b >= P:
        return None
    return a, b, float(scale_table[l, expert])


def _fold_row(out: np.ndarray, row: int, xrow: np.ndarray, A: np.ndarray, B: np.ndarray,
              scale: float, dtype: np.dtype) -> None:
    xa = round_to(A @ xrow, dtype)                # [R]
    delta = round_to(B @ xa, dtype)               # [N]
    out[row] = (out[row].astype(np.float64) + np.float64(scale) * delta).astype(dtype)


def gather_bgmv_ref(x, base_out, indices, route: MoeExpertRoute, row_adapter=None, *,
                    top_k: int, x_gather: int) -> np.ndarray:
    """Reference of ``moe_lora_gather_bgmv``; returns the new ``base_out`` (NumPy)."""
    dtype = np.asarray(base_out).dtype
    out = np.array(base_out, copy=True)
    x64 = np.asarray(x).astype(np.float64)
    # uint32 ids are read as int32 (ids >= 2**31 become negative: skipped).
    idx = np.asarray(indices).astype(np.uint32).view(np.int32).astype(np.int64)
    a_pool, b_pool, *tables = _np_route(route)
    L, E, P = route.max_loras, route.n_experts, route.pool_size
    ra = None if row_adapter is None else np.asarray(row_adapter).astype(np.int64)
    for row in range(out.shape[0]):
        t = row // top_k
        adapter = 0 if ra is None else int(ra[t])
        pair = _pair(tables, L, E, P, adapter, int(idx[row]))
        if pair is None:
            continue
        a, b, s = pair
        _fold_row(out, row, x64[row if not x_gather else t], a_pool[a], b_pool[b], s, dtype)
    return out


def grouped_down_ref(x, base_out, expert_offsets, sorted_token_ids, route: MoeExpertRoute,
                     row_adapter=None, *, row_offset: int = 0, row_end: int | None = None,
                     x_gather: int) -> np.ndarray:
    """Reference of ``moe_lora_grouped_down``; returns the new ``base_out`` (NumPy)."""
    dtype = np.asarray(base_out).dtype
    out = np.array(base_out, copy=True)
    te = out.shape[0]
    row_end = te if row_end is None else row_end
    x64 = np.asarray(x).astype(np.float64)
    offs = np.asarray(expert_offsets).astype(np.int64)
    stid = np.asarray(sorted_token_ids).astype(np.int64)
    a_pool, b_pool, *tables = _np_route(route)
    L, E, P = route.max_loras, route.n_experts, route.pool_size
    ra = None if row_adapter is None else np.asarray(row_adapter).astype(np.int64)
    num_experts = offs.shape[0] - 1
    # docs/malformed_metadata.md: offsets that are not 0 <= o[0] <= ... <= o[-1] <= te fold no row.
    if offs[0] < 0 or np.any(np.diff(offs) < 0) or offs[-1] > te:
        return out
    for r in range(max(0, row_offset), min(row_end, te)):
        owners = [e for e in range(num_experts) if offs[e] <= r < offs[e + 1]]
        if not owners:
            continue
        e = owners[-1]
        tok = int(stid[r])
        if x_gather or ra is not None:
            # With both, the fold validates len(row_adapter) == x.shape[0].
            limit = x64.shape[0] if x_gather else ra.shape[0]
            if tok < 0 or tok >= limit:
                continue
        adapter = 0 if ra is None else int(ra[tok])
        pair = _pair(tables, L, E, P, adapter, e)
        if pair is None:
            continue
        a, b, s = pair
        _fold_row(out, r, x64[tok if x_gather else r], a_pool[a], b_pool[b], s, dtype)
    return out
