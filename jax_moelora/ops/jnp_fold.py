"""Pure-JAX folds (``impl="jnp"``): portable, differentiable, same skip rules
and roundings as the custom calls (docs/semantics.md §5,
docs/malformed_metadata.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moelora.ops.contract import offsets_well_formed
from jax_moelora.ops.search import searchsorted
from jax_moelora.tables import MoeExpertRoute

__all__ = ["resolve_pairs", "apply_rows", "gather_bgmv_jnp", "grouped_rows", "window_out_rows",
           "grouped_down_jnp", "rounded"]

# Rows folded per step of the chunked per-row gather (bounds the memory of
# the gathered A/B blocks: CHUNK * R * (K + N) elements).
CHUNK = 256

_HI = jax.lax.Precision.HIGHEST


def rounded(v: jax.Array, dtype) -> jax.Array:
    """``v`` rounded to ``dtype`` (round to nearest even), a rounding XLA keeps.

    XLA may drop a narrowing ``convert`` that a widening one follows
    (``xla_allow_excess_precision``, on by default, does on the GPU); the
    contract rounds xa, delta and the expert GEMM's output to the activation
    dtype, so a narrowed value passes through an optimization barrier.
    """
    v = v.astype(dtype)
    return v if v.dtype == jnp.float32 else jax.lax.optimization_barrier(v)


def resolve_pairs(route: MoeExpertRoute, adapter: jax.Array, expert: jax.Array):
    """Vectorised skip rule of ``fold_common.h``: ``(a, b, scale, ok)`` per row.

    ``adapter`` and ``expert`` are int32 ``[rows]``; ``a``/``b`` are clamped
    pool slots (only meaningful where ``ok``).
    """
    L, E, P = route.max_loras, route.n_experts, route.pool_size
    l = jnp.zeros_like(adapter) if L == 1 else adapter
    ok = (adapter >= 0) & (l < L) & (expert >= 0) & (expert < E)
    lc = jnp.clip(l, 0, L - 1)
    ec = jnp.clip(expert, 0, E - 1)
    a = route.a_table[lc, ec]
    b = route.b_table[lc, ec]
    s = route.scale_table[lc, ec]
    ok = ok & (a > 0) & (b > 0) & (a < P) & (b < P)
    a = jnp.where(ok, a, 0)
    b = jnp.where(ok, b, 0)
    return a, b, s, ok


def _fold_chunk(xr, base, a, b, s, ok, a_pool, b_pool):
    dt = base.dtype
    f32 = jnp.float32  # widened operands: exact products, f32 sums on every platform
    xa = rounded(jnp.einsum("rk,rjk->rj", xr.astype(f32), a_pool[a].astype(f32), precision=_HI,
                            preferred_element_type=f32), dt)
    delta = rounded(jnp.einsum("rj,rnj->rn", xa.astype(f32), b_pool[b].astype(f32), precision=_HI,
                               preferred_element_type=f32), dt)
    folded = (base.astype(jnp.float32) + s[:, None] * delta.astype(jnp.float32)).astype(dt)
    return jnp.where(ok[:, None], folded, base)


def apply_rows(xr, base, a, b, s, ok, route: MoeExpertRoute):
    """Fold rows: ``xr [rows, K]`` is each row's input, ``base [rows, N]``.

    Gathers each row's A and B block (in chunks of ``CHUNK`` rows), three
    roundings in the activation dtype, rows with ``ok == False`` unchanged.
    """
    rows = base.shape[0]
    if rows <= CHUNK:
        return _fold_chunk(xr, base, a, b, s, ok, route.a_pool, route.b_pool)
    n = -(-rows // CHUNK)
    pad = n * CHUNK - rows

    def chunked(v):
        v = jnp.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1))
        return v.reshape((n, CHUNK) + v.shape[1:])

    args = tuple(chunked(v) for v in (xr, base, a, b, s, ok))
    out = jax.lax.map(lambda c: _fold_chunk(*c, route.a_pool, route.b_pool), args)
    return out.reshape((n * CHUNK,) + base.shape[1:])[:rows]


def gather_bgmv_jnp(x, base_out, indices, route, row_adapter, *, top_k: int, x_gather: int):
    n_slots = base_out.shape[0]
    rows = jnp.arange(n_slots, dtype=jnp.int32)
    tok = rows // top_k
    adapter = jnp.zeros_like(rows) if row_adapter is None else row_adapter[tok]
    a, b, s, ok = resolve_pairs(route, adapter, indices.astype(jnp.int32))
    xr = x if not x_gather else x[tok]
    return apply_rows(xr.astype(base_out.dtype), base_out, a, b, s, ok, route)


def grouped_rows(expert_offsets, sorted_token_ids, row_adapter, *, x_rows: int,
                 row_offset: int, row_end: int, x_gather: int):
    """The grouped fold's per-row rules for the window ``[row_offset, row_end)``.

    Returns ``(expert, token, adapter, ok_token)``, int32/bool ``[window]``:
    the expert whose span holds each sorted row (-1 when none does, and for
    every row when ``expert_offsets`` is not well formed:
    docs/malformed_metadata.md), its token
    (clamped), its row-adapter value (0 without a map), and whether the token
    is inside ``[0, limit)`` where it is needed (``x_gather=1``: ``x_rows``;
    with a map: its length).
    """
    num_experts = expert_offsets.shape[0] - 1
    r = jnp.arange(row_offset, row_end, dtype=jnp.int32)
    e = searchsorted(expert_offsets, r, side="right") - 1
    ec = jnp.clip(e, 0, num_experts - 1)
    in_span = (e >= 0) & (e < num_experts) & (r < expert_offsets[ec + 1])
    in_span = in_span & offsets_well_formed(expert_offsets, sorted_token_ids.shape[0])
    e = jnp.where(in_span, e, -1)
    tok = sorted_token_ids[r]
    limit = x_rows if x_gather else (1 if row_adapter is None else row_adapter.shape[0])
    ok_tok = jnp.ones_like(in_span)
    if x_gather or row_adapter is not None:
        ok_tok = (tok >= 0) & (tok < limit)
    tokc = jnp.clip(tok, 0, limit - 1)
    adapter = jnp.zeros_like(r) if row_adapter is None else row_adapter[tokc]
    return e, tokc, adapter, ok_tok


def window_out_rows(out_rows, m: int, row_offset: int, row_end: int, ok):
    """The ``base_out`` row of each sorted row of the window ``[row_offset,
    row_end)`` (``out_rows[r]``, clamped into ``[0, m)``) and ``ok`` with the
    rows whose target lies outside ``[0, m)`` cleared (they fold nothing)."""
    rows = out_rows[row_offset:row_end]
    valid = (rows >= 0) & (rows < m)
    return jnp.clip(rows, 0, m - 1), ok & valid


def grouped_down_jnp(x, base_out, expert_offsets, sorted_token_ids, route, row_adapter,
                     out_rows=None, *, row_offset: int, row_end: int, x_gather: int):
    """The grouped fold; with ``out_rows`` (int32 ``[te]``) sorted row ``r``
    reads and writes ``base_out[out_rows[r]]`` (a gather and a scatter of
    the rows that fold), else ``base_out[r]``."""
    e, tok, adapter, ok_tok = grouped_rows(expert_offsets, sorted_token_ids, row_adapter,
                                           x_rows=x.shape[0], row_offset=row_offset,
                                           row_end=row_end, x_gather=x_gather)
    a, b, s, ok = resolve_pairs(route, adapter, e)
    ok = ok & ok_tok
    xr = x[tok] if x_gather else x[row_offset:row_end]
    if out_rows is None:
        folded = apply_rows(xr, base_out[row_offset:row_end], a, b, s, ok, route)
        return jax.lax.dynamic_update_slice_in_dim(base_out, folded, row_offset, axis=0)
    m = base_out.shape[0]
    rows, ok = window_out_rows(out_rows, m, row_offset, row_end, ok)
    folded = apply_rows(xr, base_out[rows], a, b, s, ok, route)
    # only the rows that fold are written (the others, dropped, keep their bits)
    return base_out.at[jnp.where(ok, rows, m)].set(folded, mode="drop")
