"""The gather fold on the dense expert layout of a decode-sized batch.

``MoEBlock``'s dense path runs every expert on every token: each projection's
base output is ``[E, T, N]`` (row ``(e, t)`` is expert ``e`` on token ``t``),
and the block reads a token's chosen rows out of it afterwards. Folding
those rows with the gather fold would first gather them into flat rows
``[T * top_k, N]`` (and interleave gate and up per token) and, for the
block, read them from there: a copy kernel per projection and per layer.
:func:`fold_dense_experts` folds them where they are instead: flat row
``t * top_k + k`` of expert ``e = topk_ids[t, k]`` reads and writes row
``(e, t)`` of its projection's ``[E, T, N]`` in place (the gather custom
call's dense expert layout, ``ffi_src/moelora_handlers.h``), with the same
rows, skip rules and per-row arithmetic as the gather fold: bit for bit the
gather fold of the gathered rows, on every backend. The down projection's
input can be read in that layout too (``x_gather=2``: ``x [E, T, I]``, the
scattered rows its dense GEMM multiplies), so the block never gathers it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_moelora import _ext
from jax_moelora.int_range import check_rows
from jax_moelora.ops import autodiff, batching, ffi_fold, launch
from jax_moelora.ops.batching import GatherCfg, match_varying, virtual_ids
from jax_moelora.ops.backend import check_impl
from jax_moelora.ops.folds import _check_common, _check_x_gather, _int_array
from jax_moelora.ops.stacked import StackedRoute
from jax_moelora.tables import MoeExpertRoute

__all__ = ["fold_dense_experts"]


class DenseCfg(NamedTuple):
    """Static configuration: the gather fold's, plus the layout ``[E, T, N]``."""

    gather: GatherCfg  # top_k: rows per token (S * top_k for S members)
    experts: int       # E
    tokens: int        # T
    x_dense: bool = False  # x is [E * T, k_in] in the outputs' layout (gather.x_gather 0)


def _targets(cfg: DenseCfg, indices):
    """Per flat row: its member (0 for a (virtual) expert in ``[0, E)``, 1
    from ``E`` on), its row of that member's flattened ``[E * T, N]``
    (clamped) and whether its expert id is ``>= 0``. A row whose member has
    no base (ids ``>= S * E``) names no route expert and folds nothing."""
    E, T = cfg.experts, cfg.tokens
    rows = jnp.arange(indices.shape[0], dtype=jnp.int32)
    tok = rows // cfg.gather.top_k
    member = jnp.where(indices >= E, 1, 0)
    target = jnp.clip(indices - member * E, 0, E - 1) * T + tok
    return member, target, indices >= 0


def _take(cfg: DenseCfg, flats, indices):
    """Each flat row's row of ``flats`` (one ``[E * T, N]`` per member)."""
    member, target, _ = _targets(cfg, indices)
    rows = flats[0][target]
    for s in range(1, len(flats)):
        rows = jnp.where((member == s)[:, None], flats[s][target], rows)
    return rows


def _via_rows(cfg: DenseCfg, x, bases, indices, route, row_adapter):
    """The fold as gather, gather fold, scatter (``impl="jnp"``, and under
    ``vmap``, where the gather fold's rule makes it one launch)."""
    E, T = cfg.experts, cfg.tokens
    flats = [b.reshape(E * T, -1) for b in bases]
    if cfg.x_dense:
        x = _take(cfg, [x], indices)
    folded = batching.gather_op(cfg.gather)(x, _take(cfg, flats, indices), indices, route,
                                            row_adapter)
    member, target, has = _targets(cfg, indices)
    outs = []
    for s, flat in enumerate(flats):
        where = jnp.where(has & (member == s), target, E * T)  # E * T: dropped
        outs.append(flat.at[where].set(folded, mode="drop").reshape(bases[s].shape))
    return tuple(outs)


def _impl(cfg: DenseCfg, x, bases, indices, route, row_adapter):
    impl = cfg.gather.impl
    if impl == "auto":
        return batching._per_platform(
            lambda i, *a: _impl(cfg._replace(gather=cfg.gather._replace(impl=i)), *a),
            (x, bases, indices, route, row_adapter))
    if impl == "jnp":
        return _via_rows(cfg, x, bases, indices, route, row_adapter)
    args = match_varying((x, bases, indices, route, row_adapter), floats_only=False)
    x, bases, indices, route, row_adapter = args
    E, T = cfg.experts, cfg.tokens
    flats = [b.reshape(E * T, -1) for b in bases]
    out, out2 = ffi_fold.gather_bgmv_ffi(
        x, flats[0], indices, route, row_adapter, top_k=cfg.gather.top_k,
        x_gather=_ext.X_DENSE if cfg.x_dense else cfg.gather.x_gather, impl=impl,
        pdl=cfg.gather.pdl,
        base2=flats[1] if len(flats) > 1 else None,
        dense_tokens=T, dense_experts=E)
    outs = (out,) if out2 is None else (out, out2)
    outs = tuple(o.reshape(b.shape) for o, b in zip(outs, bases))
    return batching._typed_like(outs, args)


@functools.cache
def _dense_op(cfg: DenseCfg):
    """The dense-layout fold for ``cfg``: ``custom_vmap`` (a batch is the gather
    fold of the gathered rows, one launch) inside ``custom_vjp`` (the gather
    fold's backward on the rows' cotangents)."""

    @jax.custom_batching.custom_vmap
    def op(x, bases, indices, route, row_adapter):
        return _impl(cfg, x, bases, indices, route, row_adapter)

    @op.def_vmap
    def rule(size, in_batched, x, bases, indices, route, row_adapter):
        axes = jax.tree_util.tree_map(lambda b: 0 if b else None, tuple(in_batched),
                                      is_leaf=lambda v: isinstance(v, bool))
        out = jax.vmap(functools.partial(_via_rows, cfg), in_axes=axes,
                       axis_size=size)(x, bases, indices, route, row_adapter)
        return out, tuple(True for _ in out)

    def rows_cotangent(g, indices):
        return _take(cfg, [gb.reshape(cfg.experts * cfg.tokens, -1) for gb in g], indices)

    def x_index(indices):  # x_dense: the x row of each flat row (folded rows name member 0)
        return _targets(cfg, indices)[1]

    return autodiff.gather_fold_vjp(op, cfg.gather, rows_cotangent,
                                    x_index if cfg.x_dense else None)


def _x_dense(fn: str, x_gather) -> bool:
    """Whether ``x_gather`` is 2 (x in the outputs' layout); 0 and 1 are
    checked by ``_check_x_gather``."""
    if isinstance(x_gather, (int, np.integer)) and not isinstance(x_gather, (bool, np.bool_)):
        if x_gather not in (0, 1, 2):
            raise ValueError(f"{fn}: x_gather must be 0, 1 or 2, got {x_gather!r}")
        return x_gather == 2
    return False


def fold_dense_experts(x: jax.Array, bases: tuple[jax.Array, ...], topk_ids: jax.Array,
                       route: MoeExpertRoute | StackedRoute,
                       row_adapter: jax.Array | None = None, *, x_gather: int,
                       impl: str = "auto") -> tuple[jax.Array, ...]:
    """Fold a decode batch's rows into the dense expert outputs they live in.

    Args:
      x: ``[T, k_in]`` tokens (``x_gather=1``), ``[T * top_k, k_in]`` flat
        rows (``x_gather=0``; a ``MoeExpertRoute`` only), or ``[E, T, k_in]``
        in the layout of ``bases`` (``x_gather=2``; a ``MoeExpertRoute``
        only): flat row ``t * top_k + k`` reads row ``(topk_ids[t, k], t)``.
      bases: one ``[E, T, n_out]`` per projection of ``route``: ``(base,)``
        for a ``MoeExpertRoute`` with ``n_experts == E``, ``(gate, up)`` for a
        ``StackedRoute`` of two (row ``(e, t)``: expert ``e`` on token ``t``).
      topk_ids: int32 ``[T, top_k]``; a token's ids must be distinct (each
        names one row of ``bases``; ids outside ``[0, E)`` fold nothing).
      route, row_adapter, impl: as for ``moe_lora_gather_bgmv``.

    Returns:
      ``bases`` with row ``(topk_ids[t, k], t)`` of each folded by flat row
      ``t * top_k + k``: bit for bit the gather fold of the gathered rows
      (``fold_token_projections`` for a ``StackedRoute``) written back.
    """
    fn = "fold_dense_experts"
    bases = tuple(bases)
    S = route.num_routes if isinstance(route, StackedRoute) else 1
    if not isinstance(route, (MoeExpertRoute, StackedRoute)):
        raise TypeError(f"{fn}: route must be a MoeExpertRoute or a StackedRoute, got "
                        f"{type(route).__name__}")
    if S > 2 or len(bases) != S:
        raise ValueError(f"{fn}: {len(bases)} bases for a route of {S} projections (at most 2)")
    _int_array("topk_ids", topk_ids, ndim=2)
    T, k = topk_ids.shape
    x_dense = _x_dense(fn, x_gather)
    x_gather = 0 if x_dense else _check_x_gather(fn, x_gather)
    if S > 1 and x_gather != 1:
        raise ValueError(f"{fn}: a StackedRoute's projections read the tokens: x_gather must be 1")
    single = route.route(0) if S > 1 else route
    E = single.n_experts
    for i, b in enumerate(bases):
        if b.ndim != 3 or b.shape[:2] != (E, T) or b.shape != bases[0].shape or (
                b.dtype != bases[0].dtype):
            raise ValueError(f"{fn}: bases[{i}] is {b.dtype}{list(b.shape)}; each must be "
                             f"[E, T, n_out] = [{E}, {T}, n_out] of one shape and dtype")
    check_rows(fn, "bases (E * T rows)", E * T)
    check_rows(fn, "rows (T * top_k * projections)", T * k * S)
    if x_dense:
        if x.ndim != 3 or x.shape[:2] != (E, T):
            raise ValueError(f"{fn}: x is {list(x.shape)}; x_gather=2 needs [E, T, k_in] = "
                             f"[{E}, {T}, k_in], the layout of bases")
        x = x.reshape(E * T, x.shape[2])
    _check_common(fn, x, bases[0][0], single)
    want_x = E * T if x_dense else T if x_gather else T * k
    if x.shape[0] != want_x:
        raise ValueError(f"{fn}: x has {x.shape[0]} rows; x_gather={x_gather} needs {want_x}")
    if row_adapter is not None and _int_array("row_adapter", row_adapter) != (T,):
        raise ValueError(f"{fn}: row_adapter has {row_adapter.shape[0]} entries, the batch has "
                         f"{T} tokens")
    impl = check_impl(impl)
    ids = topk_ids.astype(jnp.int32)
    if S > 1:
        ids = virtual_ids(ids[:, None, :], jnp.arange(S, dtype=jnp.int32)[None, :, None], E)
        route = route.virtual()
    cfg = DenseCfg(GatherCfg(S * k, x_gather, impl, launch.programmatic_launch_enabled()), E, T,
                   x_dense)
    route = jax.tree_util.tree_map(jnp.asarray, route)
    args = match_varying((x, bases, ids.reshape(-1), route, row_adapter))
    return _dense_op(cfg)(*args)

