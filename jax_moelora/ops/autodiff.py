"""Reverse-mode autodiff of the two folds (``jax.custom_vjp``, every ``impl``).

Per folded row with pair ``(a, b)`` and scale ``s`` (its table cell
``(l, e)``), the forward is ``xa = x A_a^T``, ``delta = xa B_b^T``,
``out = base + s * delta``. For a cotangent ``g [rows, N]`` the backward is::

    d_base  = g                                 (every row, folded or not)
    gB      = g B_b                             [rows, R]
    d_xa    = s * gB                            [rows, R]
    dx      += d_xa A_a                         (scatter-add to x's row)
    dA_a    += d_xa^T x                         [R, K]
    dB_b    += s * g^T xa                       [N, R]
    ds[l,e] += sum(g * delta) = sum(xa * gB)    (per row, to its table cell)

For the grouped fold with an output-row index ``out_rows`` (``moe_lora_fold``
at prefill), sorted row ``r``'s output row, and so its ``g``, is
``out_rows[r]``.

The three roundings of the forward (``xa``, ``delta``, ``out`` to the
activation dtype) are treated as the identity in the backward (straight-through
estimator); ``xa`` is recomputed and rounded as in the forward, every product
accumulates in float32, and the cotangents come back in their primal dtypes
(``scale_table``: float32). Skipped rows contribute nothing to the weight and
scale gradients and pass ``g`` through to ``base_out``. Integer operands (ids,
offsets, tables, the row-adapter map) get no cotangent (``None``; ``float0``
from ``jax.vjp``). Reverse mode only: ``jax.jvp`` of a ``custom_vjp`` is not
defined. Composes with ``jax.vmap`` (``ops/batching.py``) and ``shard_map``.

The backward runs on the device for every ``impl``; it never gathers one A
or B block per row. Three formulations (``fold_rows_vjp``):

- ``"grouped"``: rows sorted by (adapter, expert) cell, then grouped matmuls
  over the cells (``ops/grouped_vjp.py``). Where the fold runs on CUDA
  (``impl`` ``"fast"``/``"simple"``, or ``"auto"`` lowered for CUDA) and the
  grouped-GEMM kernels take the operands (a Hopper GPU, bf16/f16, ``K``,
  ``N``, ``R`` multiples of 8), they are CUTLASS kernels
  (``ops/grouped_matmul.py``): a few launches for the whole backward, and
  one for all the projections of a ``StackedRoute`` (the ``custom_vmap``
  rule of ``_grouped_op``).
- everywhere else traced ``jnp``, picked statically by size
  (``backward_mode``):

  - ``"tiled"``: rows are sorted by table cell and laid out in tiles of ``T``
    rows that each hold rows of ONE cell (``T`` from the row count and the
    number of cells); one A and one B block is gathered per tile and all the
    per-row work becomes batched matmuls ``[tiles, T, .] x [tiles, ., .]``;
    per-tile weight gradients are segment-summed into the pools. At most
    ``ceil(rows / T) + min(cells, rows)`` tiles.
  - ``"dense"``: for few rows, products against the whole pool
    (``einsum('mk,prk->mpr')``) selected with one-hot slot masks: no gathers,
    sorts or scatters of blocks at all; costs ``rows * P`` rank-vectors.

``FORCE_MODE`` forces one formulation (``"grouped"`` in its jnp form off
the GPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_moelora.ops import backend, batching, grouped_vjp, jnp_fold, launch
from jax_moelora.ops.batching import GatherCfg, GroupedCfg
from jax_moelora.ops.jnp_fold import rounded
from jax_moelora.ops.search import searchsorted
from jax_moelora.tables import MoeExpertRoute

__all__ = ["gather_bgmv", "grouped_down", "backward_mode", "tile_rows", "fold_rows_vjp",
           "gather_fold_vjp", "route_cotangent"]

_HI = jax.lax.Precision.HIGHEST
_F32 = jnp.float32

# The dense formulation is used while rows * pool_size is at most this many
# rank-vectors (or at most what the tiled one would pad to).
DENSE_MAX = 1 << 14
# "dense", "tiled" or "grouped" forces one formulation (tests; read at trace time).
FORCE_MODE: str | None = None


def tile_rows(rows: int, cells: int, rank: int) -> int:
    """Rows per tile of the tiled backward: ``sqrt(2 * R * rows / cells)``
    (balances padded rows against gathered blocks), a power of two in
    ``[8, 128]``."""
    groups = max(1, min(cells, rows))
    t = math.sqrt(2.0 * rank * rows / groups)
    return int(min(128, max(8, 2 ** round(math.log2(max(t, 1.0))))))


def _n_tiles(rows: int, cells: int, t: int) -> int:
    return -(-rows // t) + min(cells, rows)


def backward_mode(rows: int, route: MoeExpertRoute) -> str:
    """``"dense"`` or ``"tiled"``: the backward formulation used for ``rows``
    folded rows (static; see the module docstring)."""
    if FORCE_MODE is not None:
        return FORCE_MODE
    cells, P, R = route.max_loras * route.n_experts, route.pool_size, route.max_rank
    t = tile_rows(rows, cells, R)
    tiled_cost = _n_tiles(rows, cells, t) * (t + 2 * R)
    return "dense" if rows * P <= max(DENSE_MAX, 2 * tiled_cost) else "tiled"


def _cells(route: MoeExpertRoute, adapter, expert):
    """Flat table cell ``l * E + e`` per row and whether the row folds."""
    _, _, _, ok = jnp_fold.resolve_pairs(route, adapter, expert)
    L, E = route.max_loras, route.n_experts
    l = jnp.zeros_like(adapter) if L == 1 else adapter
    cell = jnp.clip(l, 0, L - 1) * E + jnp.clip(expert, 0, E - 1)
    return cell.astype(jnp.int32), ok


def _dot(spec, a, b):
    """einsum of f32-widened operands at full precision: exact products of
    bf16/f16 values, f32 sums, on every platform (the CPU dot thunks lack
    mixed-precision kernels)."""
    return jnp.einsum(spec, a.astype(_F32), b.astype(_F32), precision=_HI,
                      preferred_element_type=_F32)


def _bwd_dense(x, route, g_rows, xi, cell, ok):
    """Products against every pool slot, selected by one-hot masks."""
    dt, P = route.dtype, route.pool_size
    okf = ok.astype(_F32)[:, None]
    a_slot = route.a_table.reshape(-1)[cell]
    b_slot = route.b_table.reshape(-1)[cell]
    s = route.scale_table.reshape(-1)[cell][:, None] * okf           # [m, 1]
    hot_a = jax.nn.one_hot(a_slot, P, dtype=_F32) * okf              # [m, P]
    hot_b = jax.nn.one_hot(b_slot, P, dtype=_F32) * okf
    xr = x[xi]                                                        # [m, K]
    xa = jnp.einsum("mpr,mp->mr", _dot("mk,prk->mpr", xr, route.a_pool), hot_a, precision=_HI)
    xa = rounded(xa, dt).astype(_F32)                                 # forward rounding
    gB = jnp.einsum("mpr,mp->mr", _dot("mn,pnr->mpr", g_rows, route.b_pool), hot_b,
                    precision=_HI)
    d_xa = s * gB                                                     # [m, R]
    ds_rows = jnp.sum(xa * gB, axis=1) * okf[:, 0]
    sel_a = rounded(hot_a[:, :, None] * d_xa[:, None, :], dt)         # [m, P, R]
    sel_b = rounded(hot_b[:, :, None] * (s * xa)[:, None, :], dt)
    dx_rows = _dot("mpr,prk->mk", sel_a, route.a_pool)
    da = _dot("mpr,mk->prk", sel_a, xr)
    db = _dot("mpr,mn->pnr", sel_b, g_rows)
    return dx_rows, xi, da, db, ds_rows, cell


def _bwd_tiled(x, route, g_rows, xi, cell, ok):
    """Rows sorted by cell into single-cell tiles; batched matmuls per tile."""
    dt, (m, _) = route.dtype, g_rows.shape
    G = route.max_loras * route.n_experts
    T = tile_rows(m, G, route.max_rank)
    n_tiles = _n_tiles(m, G, T)
    n_pad = n_tiles * T
    key = jnp.where(ok, cell, G)
    counts = jnp.zeros((G + 1,), jnp.int32).at[key].add(1)[:G]
    tiles_per = (counts + T - 1) // T
    tile_end = jnp.cumsum(tiles_per)
    tile_begin = tile_end - tiles_per
    row_begin = jnp.cumsum(counts) - counts
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    skey = key[order]
    kc = jnp.clip(skey, 0, G - 1)
    pos = tile_begin[kc] * T + jnp.arange(m, dtype=jnp.int32) - row_begin[kc]
    pos = jnp.where(skey < G, pos, n_pad)
    src = jnp.full((n_pad,), m, jnp.int32).at[pos].set(order, mode="drop")  # slot -> row
    live = src < m
    srcc = jnp.where(live, src, 0)
    tile_cell = searchsorted(tile_end, jnp.arange(n_tiles, dtype=jnp.int32), side="right")
    tile_live = tile_cell < G
    tcc = jnp.clip(tile_cell, 0, G - 1).astype(jnp.int32)
    a_t = jnp.where(tile_live, route.a_table.reshape(-1)[tcc], 0)
    b_t = jnp.where(tile_live, route.b_table.reshape(-1)[tcc], 0)
    s_t = jnp.where(tile_live, route.scale_table.reshape(-1)[tcc], 0.0)[:, None, None]
    x_idx = xi[srcc]
    X = jnp.where(live[:, None], x[x_idx], 0).reshape(n_tiles, T, -1)       # [t, T, K]
    Gp = jnp.where(live[:, None], g_rows[srcc], 0).reshape(n_tiles, T, -1)  # [t, T, N]
    A = route.a_pool[a_t]                                                   # [t, R, K]
    B = route.b_pool[b_t]                                                   # [t, N, R]
    xa = rounded(_dot("tik,tjk->tij", X, A), dt)                            # forward rounding
    gB = _dot("tin,tnj->tij", Gp, B)
    d_xa = rounded(s_t * gB, dt)
    ds_t = jnp.sum(xa.astype(_F32) * gB, axis=(1, 2))                      # [t]
    dx_rows = _dot("tij,tjk->tik", d_xa, A).reshape(n_pad, -1)
    da_t = _dot("tij,tik->tjk", d_xa, X)
    db_t = _dot("tin,tij->tnj", Gp, xa) * s_t
    P = route.pool_size
    da = jnp.zeros((P,) + A.shape[1:], _F32).at[a_t].add(da_t)
    db = jnp.zeros((P,) + B.shape[1:], _F32).at[b_t].add(db_t)
    x_idx = jnp.where(live, x_idx, x.shape[0])                               # dropped
    tile_cell = jnp.where(tile_live, tcc, G)
    return dx_rows, x_idx, da, db, ds_t, tile_cell


def _grouped_members(kernels: bool, x, specs, g, xi, cell, ok):
    """The grouped formulation for the projections ``specs`` (``(route,
    pools, plane)``: its tables, its pools ``[S, P, ...]`` read at ``plane``
    or None for the route's own) folded over the same rows: rows sorted by
    cell, then the grouped matmuls of ``ops/grouped_vjp.py`` (the CUDA kernels
    with ``kernels``, else their jnp form), one launch of each for all
    projections. ``g [S or 1, m, N]``: the rows' cotangents, projection ``s``
    reading plane ``s`` (or 0). Returns ``(dx, d_a_pool, d_b_pool, d_scale)``
    per projection."""
    route = specs[0][0]
    L, E = route.max_loras, route.n_experts
    key = jnp.where(ok, (cell % E) * L + cell // E, L * E).astype(jnp.int32)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    xo = xi[order]
    gs = g[:, order]
    members = [grouped_vjp.member(r, gs, plane=pl, g_plane=min(i, gs.shape[0] - 1), pools=p)
               for i, (r, p, pl) in enumerate(specs)]
    skey = key[order]
    dxs, grads = grouped_vjp.lora_grads(x[xo], members, skey,
                                        grouped_vjp.expert_offsets_of(skey, L, E),
                                        impl="fast" if kernels else "jnp", separate=True,
                                        rows_by_cell=True)
    out = []
    for dx_rows, gr, (r, _, _) in zip(dxs, grads, specs):
        dx = jnp.zeros(x.shape, _F32).at[xo].add(dx_rows.astype(_F32))
        out.append((dx.astype(x.dtype), gr.d_a_pool, gr.d_b_pool, gr.d_scale.reshape(E, L).T))
    return out


@functools.cache
def _grouped_op(kernels: bool):
    """The grouped formulation of one projection, ``(x, route, g_rows, xi,
    cell, ok) -> (dx, d_a_pool, d_b_pool, d_scale)``, as a ``custom_vmap``
    function: a batch over the projection (a ``StackedRoute``'s members,
    per-example cotangents) with shared rows runs as one call for all of them,
    pools stacked ``[S, P, ...]`` read in place; any other batch runs one
    element at a time."""

    @jax.custom_batching.custom_vmap
    def op(x, route, g_rows, xi, cell, ok):
        return _grouped_members(kernels, x, [(route, None, 0)], g_rows[None], xi, cell, ok)[0]

    @op.def_vmap
    def rule(size, in_batched, x, route, g_rows, xi, cell, ok):
        xb, rb, gb, ib, cb, ob = in_batched
        if xb or ib or cb:  # rows differ per element
            return batching.map_batch(op, in_batched, x, route, g_rows, xi, cell, ok)
        pools_b = (rb.a_pool, rb.b_pool)
        specs = []
        for s in range(size):
            r = jax.tree_util.tree_map(lambda v, b: v[s] if b else v, route, rb)
            if all(pools_b):
                specs.append((r, (route.a_pool, route.b_pool), s))
            else:  # shared pools (plane 0), or one side batched: the member's own slices
                specs.append((r, None if not any(pools_b) else (r.a_pool[None], r.b_pool[None]),
                              0))
        g = g_rows if gb else g_rows[None]
        rows_ok = jnp.any(ok, axis=0) if ob else ok  # a row folds for one member or another
        outs = _grouped_members(kernels, x, specs, g, xi, cell, rows_ok)
        return tuple(jnp.stack(v) for v in zip(*outs)), (True, True, True, True)

    return op


def _vjp_in_mode(mode: str, x, route, g_rows, xi, cell, ok, kernels: bool = False):
    if mode == "grouped":
        return _grouped_op(kernels)(x, route, g_rows, xi, cell, ok)
    fn = {"dense": _bwd_dense, "tiled": _bwd_tiled}[mode]
    dx_rows, x_idx, da, db, ds, ds_cell = fn(x, route, g_rows, xi, cell, ok)
    dx = jnp.zeros(x.shape, _F32).at[x_idx].add(dx_rows, mode="drop")
    L, E = route.max_loras, route.n_experts
    dscale = jnp.zeros((L * E,), _F32).at[ds_cell].add(ds, mode="drop").reshape(L, E)
    return dx.astype(x.dtype), da.astype(route.dtype), db.astype(route.dtype), dscale


def _grouped_runs(route: MoeExpertRoute, k_in: int) -> bool:
    """Whether the grouped formulation's CUDA kernels take this route's folds."""
    return backend.cutlass_takes(route.dtype, k_in, route.n_out, route.max_rank)


def fold_rows_vjp(x, route: MoeExpertRoute, g_rows, xi, cell, ok, mode: str | None = None,
                  impl: str = "jnp"):
    """Cotangents of the folded rows' deltas.

    Args:
      x: ``[X, K]`` the fold's input; row ``xi[i]`` feeds folded row ``i``.
      route: the projection's route.
      g_rows: ``[m, N]`` cotangent of each row's output.
      xi: int32 ``[m]`` x row per row; cell: int32 ``[m]`` flat table cell
        ``l * E + e``; ok: bool ``[m]``, whether the row folds.
      mode: ``"dense"``, ``"tiled"``, ``"grouped"`` or ``None``: the
        formulation. ``None`` takes ``"grouped"`` where the fold runs on CUDA
        and the grouped-GEMM kernels take the operands (``impl`` ``"fast"``
        or ``"simple"``, or ``"auto"`` lowered for CUDA), else
        :func:`backward_mode`'s choice.
      impl: the fold's backend (``"auto"``: decided per lowering platform).

    Returns:
      ``(dx [X, K] x.dtype, d_a_pool, d_b_pool (pool dtype), d_scale_table f32 [L, E])``.
    """
    m = g_rows.shape[0]
    args = (x, route, g_rows.astype(route.dtype), xi, cell, ok)
    grouped = _grouped_runs(route, x.shape[1])
    mode = FORCE_MODE if mode is None else mode
    if mode is not None:  # the kernels where computations go to a GPU that runs them
        return _vjp_in_mode(mode, *args, kernels=grouped and backend.gpu_now())
    fallback = backward_mode(m, route)
    if impl in ("fast", "simple") and grouped:  # (the fold checked that it runs on a GPU)
        return _vjp_in_mode("grouped", *args, kernels=True)
    if impl == "auto" and grouped:
        jnp_mode = functools.partial(_vjp_in_mode, fallback)
        return backend.per_platform(
            *args, cpu=jnp_mode, cuda=lambda *a: _vjp_in_mode("grouped", *a, kernels=True),
            default=jnp_mode)
    return _vjp_in_mode(fallback, *args)


def route_cotangent(route: MoeExpertRoute, da, db, dscale) -> MoeExpertRoute:
    """``route``'s cotangent: the pools', the scales' and None for the tables."""
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(route),
                                        [da, db, None, None, dscale])


# ---- gather fold ----------------------------------------------------------------------------

def _gather_rows(cfg: GatherCfg, indices, route, row_adapter):
    n_slots = indices.shape[0]
    rows = jnp.arange(n_slots, dtype=jnp.int32)
    tok = rows // cfg.top_k
    adapter = jnp.zeros_like(rows) if row_adapter is None else row_adapter[tok]
    cell, ok = _cells(route, adapter, indices)
    return (tok if cfg.x_gather else rows), cell, ok


def gather_fold_vjp(op, cfg: GatherCfg, rows_cotangent=None, x_index=None):
    """``op(x, base, indices, route, row_adapter)``, a gather fold of flat rows
    configured by ``cfg``, with its ``custom_vjp``. ``base`` is any pytree of
    the folded outputs; ``rows_cotangent(g, indices)`` gives each flat row's
    cotangent ``[n_slots, N]`` from the outputs' ``g`` (default: ``g`` itself,
    ``base`` being the flat rows); ``x_index(indices)`` each flat row's x row
    (default: ``cfg.x_gather``'s). ``base``'s cotangent is ``g``."""

    @jax.custom_vjp
    def fold(x, base, indices, route, row_adapter):
        return op(x, base, indices, route, row_adapter)

    def fwd(x, base, indices, route, row_adapter):
        return op(x, base, indices, route, row_adapter), (x, indices, route, row_adapter)

    def bwd(res, g):
        x, indices, route, row_adapter = res
        xi, cell, ok = _gather_rows(cfg, indices, route, row_adapter)
        if x_index is not None:
            xi = x_index(indices)
        g_rows = g if rows_cotangent is None else rows_cotangent(g, indices)
        # a bf16/f16 x under f32 pools: the backward of x widened, then dx
        # rounded to x's dtype (what x.astype(float32) would pass back)
        dx, da, db, ds = fold_rows_vjp(x.astype(route.dtype), route, g_rows, xi, cell, ok,
                                       impl=cfg.impl)
        return dx.astype(x.dtype), g, None, route_cotangent(route, da, db, ds), None

    fold.defvjp(fwd, bwd)
    return fold


@functools.cache
def _gather_vjp(cfg: GatherCfg):
    return gather_fold_vjp(batching.gather_op(cfg), cfg)


def gather_bgmv(x, base_out, indices, route: MoeExpertRoute, row_adapter, *, top_k: int,
                x_gather: int, impl: str) -> jax.Array:
    """Differentiable, vmappable gather fold on validated inputs (``impl``
    resolved, ``indices`` int32); see ``folds.moe_lora_gather_bgmv``."""
    route = jax.tree_util.tree_map(jnp.asarray, route)  # NumPy tables: index with tracers
    args = batching.match_varying((x, base_out, indices, route, row_adapter))
    cfg = GatherCfg(top_k, x_gather, impl, launch.programmatic_launch_enabled())
    return _gather_vjp(cfg)(*args)


# ---- grouped fold ---------------------------------------------------------------------------

def _grouped_rows(cfg: GroupedCfg, x_rows: int, expert_offsets, sorted_token_ids, route,
                  row_adapter):
    """Per window row: ``(xi, cell, ok)``, the same rules as ``grouped_down_jnp``."""
    e, tok, adapter, ok_tok = jnp_fold.grouped_rows(
        expert_offsets, sorted_token_ids, row_adapter, x_rows=x_rows, row_offset=cfg.row_offset,
        row_end=cfg.row_end, x_gather=cfg.x_gather)
    cell, ok = _cells(route, adapter, e)
    xi = tok if cfg.x_gather else jnp.arange(cfg.row_offset, cfg.row_end, dtype=jnp.int32)
    return xi, cell, ok & ok_tok


@functools.cache
def _grouped_vjp(cfg: GroupedCfg):
    op = batching.grouped_op(cfg)

    @jax.custom_vjp
    def fold(x, base_out, expert_offsets, sorted_token_ids, route, row_adapter, out_rows):
        return op(x, base_out, expert_offsets, sorted_token_ids, route, row_adapter, out_rows)

    def fwd(x, base_out, expert_offsets, sorted_token_ids, route, row_adapter, out_rows):
        out = op(x, base_out, expert_offsets, sorted_token_ids, route, row_adapter, out_rows)
        return out, (x, expert_offsets, sorted_token_ids, route, row_adapter, out_rows)

    def bwd(res, g):
        x, expert_offsets, sorted_token_ids, route, row_adapter, out_rows = res
        xi, cell, ok = _grouped_rows(cfg, x.shape[0], expert_offsets, sorted_token_ids,
                                     route, row_adapter)
        if out_rows is None:
            g_rows = g[cfg.row_offset:cfg.row_end]
        else:  # each sorted row's cotangent is that of the base_out row it wrote
            rows, ok = jnp_fold.window_out_rows(out_rows, g.shape[0], cfg.row_offset,
                                                cfg.row_end, ok)
            g_rows = g[rows]
        dx, da, db, ds = fold_rows_vjp(x, route, g_rows, xi, cell, ok, impl=cfg.impl)
        return dx, g, None, None, route_cotangent(route, da, db, ds), None, None

    fold.defvjp(fwd, bwd)
    return fold


def grouped_down(x, base_out, expert_offsets, sorted_token_ids, route: MoeExpertRoute,
                 row_adapter, out_rows=None, *, row_offset: int, row_end: int, x_gather: int,
                 impl: str) -> jax.Array:
    """Differentiable, vmappable grouped fold on validated inputs (non-empty
    window, ``impl`` resolved); see ``folds.moe_lora_grouped_down`` and, for
    ``out_rows`` (sorted row -> ``base_out`` row, or ``None``), ``folds._grouped_down``."""
    cfg = GroupedCfg(row_offset, row_end, x_gather, impl, launch.programmatic_launch_enabled())
    route = jax.tree_util.tree_map(jnp.asarray, route)
    args = batching.match_varying((x, base_out, expert_offsets, sorted_token_ids, route,
                                   row_adapter, out_rows))
    return _grouped_vjp(cfg)(*args)
