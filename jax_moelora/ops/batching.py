"""``jax.vmap`` of the two folds: one launch for the whole batch.

The folds' primal functions are ``jax.custom_batching.custom_vmap`` functions
(``gather_op(cfg)``, ``grouped_op(cfg)``): under ``vmap`` their rule folds the
flattened rows of every batch element in ONE call of the same op, for any
combination of batched operands:

- inputs (``x``, ``base_out``, ids, offsets, ``row_adapter``) batched over a
  leading axis: rows are flattened ``[B, rows, ...] -> [B * rows, ...]``;
  token indices (``x_gather=1``, the row-adapter map) are offset by
  ``b * tokens``; unbatched operands are broadcast.
- the route batched (per-example pools and/or tables): the tables become
  "virtual experts" ``[L, B * E]`` (column ``b * E + e`` holds example ``b``'s
  expert ``e``), batched pools are stacked ``[B * P, ...]`` with example
  ``b``'s slots offset by ``b * P`` (cells outside ``(0, P)`` stay 0, so they
  still fold nothing), and each row's expert id becomes ``b * E + e``.
- the grouped fold always uses virtual experts: example ``b``'s expert ``e``
  owns flat rows ``b * te + clip(offsets_b[e], row_offset, row_end)`` up to the
  next start, and one extra unadapted expert per example covers the rows
  outside its window, so the call folds ``[0, B * te)`` and leaves exactly the
  same rows untouched as ``B`` separate calls. With an output-row index
  (``out_rows``, ``moe_lora_fold`` at prefill) example ``b``'s targets are
  offset by ``b * M`` (``M`` its ``base_out`` rows); targets outside ``[0, M)``
  become ``-1`` and still fold nothing.

Results are bit-identical to a Python loop of unbatched calls (the skip rules
and per-row arithmetic do not depend on the other rows). Nested ``vmap`` applies
the rule once per level.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_moelora import _ext
from jax_moelora.int_range import check_rows
from jax_moelora.ops import backend, ffi_fold, jnp_fold
from jax_moelora.ops.contract import offsets_well_formed
from jax_moelora.tables import MoeExpertRoute

__all__ = ["GatherCfg", "GroupedCfg", "gather_op", "grouped_op", "match_varying", "varying_axes",
           "virtual_ids", "sequential", "map_batch", "ragged_dot"]


class GatherCfg(NamedTuple):
    """Static configuration of one gather fold."""

    top_k: int
    x_gather: int
    impl: str  # "auto" (picked per lowering platform) or a concrete backend
    pdl: bool = True  # programmatic dependent launch (ops/launch.py)


class GroupedCfg(NamedTuple):
    """Static configuration of one grouped fold."""

    row_offset: int
    row_end: int
    x_gather: int
    impl: str  # "auto" (picked per lowering platform) or a concrete backend
    pdl: bool = True  # programmatic dependent launch (ops/launch.py)


def varying_axes(v) -> frozenset:
    """Mesh axes ``v`` varies over inside ``shard_map`` (empty outside)."""
    aval = jax.typeof(v)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", frozenset())
    return frozenset(vma)


def match_varying(args, floats_only: bool = True):
    """Inside ``shard_map``, mark the operands (only the float ones with
    ``floats_only``) as varying over every mesh axis any operand varies over
    (as the fold's result does). The custom VJP needs it so that cotangents
    have their primals' types (the cast's transpose sums the cotangent of a
    replicated operand over those axes); the custom call needs operands of
    one type. A no-op outside ``shard_map``."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    axes = frozenset().union(*(varying_axes(v) for v in leaves))
    if not axes:
        return args

    def cast(v):
        missing = tuple(sorted(axes - varying_axes(v)))
        if not missing or (floats_only and not jnp.issubdtype(v.dtype, jnp.inexact)):
            return v
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(v, missing, to="varying")
        return jax.lax.pvary(v, missing)  # pragma: no cover (older JAX)

    return jax.tree_util.tree_unflatten(tree, [cast(v) for v in leaves])


def _typed_like(out, args):
    """``out`` (a custom call's result, typed as replicated) marked varying
    like its operands: a type-only cast."""
    return match_varying((out, args), floats_only=False)[0]


def _per_platform(impl_fn, args):
    """``impl="auto"``: ``impl_fn(impl, *args)`` with the backend ``backend.AUTO``
    names for the platform the computation is lowered for (``backend.per_platform``).
    Each branch's result is typed like the operands inside ``shard_map``, so
    the branches agree."""
    def branch(impl):
        return lambda *a: _typed_like(impl_fn(impl, *a), a)

    return backend.per_platform(*args, cpu=branch(backend.AUTO["cpu"]),
                                cuda=branch(backend.AUTO["cuda"]) if _ext.HAS_CUDA else None,
                                default=branch("jnp"))


def _gather_impl(cfg: GatherCfg, x, base_out, indices, route, row_adapter):
    if cfg.impl == "auto":
        return _per_platform(lambda impl, *a: _gather_impl(cfg._replace(impl=impl), *a),
                             (x, base_out, indices, route, row_adapter))
    if cfg.impl == "jnp":
        return jnp_fold.gather_bgmv_jnp(x, base_out, indices, route, row_adapter,
                                        top_k=cfg.top_k, x_gather=cfg.x_gather)
    args = match_varying((x, base_out, indices, route, row_adapter), floats_only=False)
    out = ffi_fold.gather_bgmv_ffi(*args, top_k=cfg.top_k, x_gather=cfg.x_gather, impl=cfg.impl,
                                   pdl=cfg.pdl)
    return _typed_like(out, args)


def _grouped_impl(cfg: GroupedCfg, x, base_out, expert_offsets, sorted_token_ids, route,
                  row_adapter, out_rows):
    if cfg.impl == "auto":
        return _per_platform(lambda impl, *a: _grouped_impl(cfg._replace(impl=impl), *a),
                             (x, base_out, expert_offsets, sorted_token_ids, route, row_adapter,
                              out_rows))
    kw = dict(row_offset=cfg.row_offset, row_end=cfg.row_end, x_gather=cfg.x_gather)
    if cfg.impl == "jnp":
        return jnp_fold.grouped_down_jnp(x, base_out, expert_offsets, sorted_token_ids, route,
                                         row_adapter, out_rows, **kw)
    args = match_varying((x, base_out, expert_offsets, sorted_token_ids, route, row_adapter,
                          out_rows), floats_only=False)
    out = ffi_fold.grouped_down_ffi(*args, impl=cfg.impl, pdl=cfg.pdl, **kw)
    return _typed_like(out, args)


def _bcast(v, batched: bool, size: int):
    """``v`` with a leading batch axis of ``size`` (broadcast when unbatched)."""
    return v if batched else jnp.broadcast_to(v, (size,) + tuple(v.shape))


def _flat(v):
    return v.reshape((v.shape[0] * v.shape[1],) + tuple(v.shape[2:]))


def _virtual_route(route: MoeExpertRoute, batched: MoeExpertRoute, size: int,
                   cols: int) -> MoeExpertRoute:
    """Route whose tables are ``[L, size * cols]``: column ``b * cols + e`` is
    example ``b``'s expert ``e`` (zero for ``e >= E_t``). Batched pools are
    stacked ``[size * P, ...]`` and example ``b``'s slots offset by ``b * P``."""
    # Per-example sizes (batched leaves carry a leading batch axis).
    P, E = route.a_pool.shape[-3], route.a_table.shape[-1]
    pools_batched = bool(batched.a_pool) or bool(batched.b_pool)
    if pools_batched:
        a_pool = _flat(_bcast(route.a_pool, batched.a_pool, size))
        b_pool = _flat(_bcast(route.b_pool, batched.b_pool, size))
        offset = (jnp.arange(size, dtype=jnp.int32) * P)[:, None, None]
    else:
        a_pool, b_pool, offset = route.a_pool, route.b_pool, 0

    def table(t, is_batched, slots: bool):
        t = _bcast(t, is_batched, size)                        # [B, L, E]
        if slots:
            t = jnp.where((t > 0) & (t < P), t + offset, 0).astype(jnp.int32)
        t = jnp.pad(t, ((0, 0), (0, 0), (0, cols - E)))        # [B, L, cols]
        return jnp.transpose(t, (1, 0, 2)).reshape(t.shape[1], size * cols)

    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(route), [
        a_pool, b_pool,
        table(route.a_table, batched.a_table, True),
        table(route.b_table, batched.b_table, True),
        table(route.scale_table, batched.scale_table, False),
    ])


def virtual_ids(ids: jax.Array, member: jax.Array, n_experts: int) -> jax.Array:
    """Expert ids ``e`` of member ``member`` (example or projection, broadcast
    against ``ids``) as virtual experts ``member * n_experts + e``; ids
    outside ``[0, n_experts)`` become ``-1`` (they fold nothing)."""
    return jnp.where((ids >= 0) & (ids < n_experts), ids + member * n_experts, -1)


@functools.cache
def gather_op(cfg: GatherCfg):
    """The gather fold for ``cfg`` as a ``custom_vmap`` function of
    ``(x, base_out, indices, route, row_adapter)`` (validated inputs,
    ``indices`` int32)."""

    @jax.custom_batching.custom_vmap
    def op(x, base_out, indices, route, row_adapter):
        return _gather_impl(cfg, x, base_out, indices, route, row_adapter)

    @op.def_vmap
    def rule(size, in_batched, x, base_out, indices, route, row_adapter):
        xb, bb, ib, rb, ab = in_batched
        base = _bcast(base_out, bb, size)                     # [B, S, N]
        check_rows("moe_lora_gather_bgmv under vmap", "base_out (batch * rows)",
                   size * base.shape[1])
        check_rows("moe_lora_gather_bgmv under vmap", "x (batch * rows)", size * x.shape[-2])
        ids = _bcast(indices, ib, size)                       # [B, S]
        if any(jax.tree_util.tree_leaves(rb)):
            E = route.a_table.shape[-1]
            ids = virtual_ids(ids, jnp.arange(size, dtype=jnp.int32)[:, None], E)
            route = _virtual_route(route, rb, size, E)
        ra = None if row_adapter is None else _flat(_bcast(row_adapter, ab, size))
        out = op(_flat(_bcast(x, xb, size)), _flat(base), _flat(ids), route, ra)
        return out.reshape(base.shape), True

    return op


@functools.cache
def grouped_op(cfg: GroupedCfg):
    """The grouped fold for ``cfg`` as a ``custom_vmap`` function of
    ``(x, base_out, expert_offsets, sorted_token_ids, route, row_adapter,
    out_rows)`` (``out_rows``: ``None`` or the sorted rows' ``base_out`` rows)."""

    @jax.custom_batching.custom_vmap
    def op(x, base_out, expert_offsets, sorted_token_ids, route, row_adapter, out_rows):
        return _grouped_impl(cfg, x, base_out, expert_offsets, sorted_token_ids, route,
                             row_adapter, out_rows)

    @op.def_vmap
    def rule(size, in_batched, x, base_out, expert_offsets, sorted_token_ids, route,
             row_adapter, out_rows):
        xb, bb, ob, sb, rb, ab, orb = in_batched
        base = _bcast(base_out, bb, size)                     # [B, M, N]
        te = sorted_token_ids.shape[-1]                       # sorted rows per example
        check_rows("moe_lora_grouped_down under vmap", "base_out (batch * rows)",
                   size * base.shape[1])
        check_rows("moe_lora_grouped_down under vmap", "sorted rows (batch * rows)", size * te)
        check_rows("moe_lora_grouped_down under vmap", "x (batch * rows)", size * x.shape[-2])
        b = jnp.arange(size, dtype=jnp.int32)[:, None]
        # Virtual experts: example b's expert e is b * V + e; e = V - 1 is an
        # unadapted filler that owns the rows outside b's window.
        offs = _bcast(expert_offsets, ob, size)               # [B, V]
        V = offs.shape[1]
        # An example whose offsets are not well formed folds no row: all its
        # rows go to its unadapted filler (docs/malformed_metadata.md).
        well = jax.vmap(lambda o: offsets_well_formed(o, te))(offs)[:, None]
        starts = b * te + jnp.where(well, jnp.clip(offs, cfg.row_offset, cfg.row_end),
                                    cfg.row_offset)
        offsets = jnp.concatenate([starts.reshape(-1),
                                   jnp.full((1,), size * te, jnp.int32)]).astype(jnp.int32)
        tok = _bcast(sorted_token_ids, sb, size)              # [B, te]
        limit = (x.shape[-2] if cfg.x_gather else
                 None if row_adapter is None else row_adapter.shape[-1])
        if limit is not None:  # tokens index x / row_adapter: offset per example
            tok = jnp.where((tok >= 0) & (tok < limit), tok + b * limit, -1)
        ra = None if row_adapter is None else _flat(_bcast(row_adapter, ab, size))
        if out_rows is not None:  # example b's rows of the flat base_out: b * M + row
            m = base.shape[1]
            o = _bcast(out_rows, orb, size)                   # [B, te]
            out_rows = _flat(jnp.where((o >= 0) & (o < m), o + b * m, -1))
        flat_cfg = cfg._replace(row_offset=0, row_end=size * te)
        out = grouped_op(flat_cfg)(_flat(_bcast(x, xb, size)), _flat(base), offsets,
                                   _flat(tok), _virtual_route(route, rb, size, V), ra, out_rows)
        return out.reshape(base.shape), True

    return op


def map_batch(fn, in_batched, *args):
    """``fn`` once per batch element (``jax.lax.map`` over the batched
    operands, the unbatched ones shared): a ``custom_vmap`` rule's result
    ``(out, out_batched)``."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    flags = jax.tree_util.tree_leaves(in_batched)
    batched = [v for v, b in zip(leaves, flags) if b]

    def one(elems):
        it = iter(elems)
        return fn(*jax.tree_util.tree_unflatten(
            tree, [next(it) if b else v for v, b in zip(leaves, flags)]))

    out = jax.lax.map(one, batched)
    return out, jax.tree_util.tree_map(lambda _: True, out)


def sequential(fn):
    """``fn`` (positional array pytrees) with a batching rule that runs it once
    per batch element (:func:`map_batch`): for computations whose primitives
    cannot be batched along every axis (``jax.lax.ragged_dot`` batches over a
    leading group axis only)."""
    op = jax.custom_batching.custom_vmap(fn)

    @op.def_vmap
    def rule(size, in_batched, *args):
        return map_batch(op, in_batched, *args)

    return op


def _ragged_dot_vjp(lhs, rhs, group_sizes, g):
    _, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, group_sizes), lhs, rhs)
    return vjp(g)


_ragged_dot_seq = sequential(jax.lax.ragged_dot)
_ragged_dot_vjp_seq = sequential(_ragged_dot_vjp)


@jax.custom_vjp
def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])`` (XLA's
    default precision, ``lhs``' dtype) that ``jax.vmap`` batches along any
    axis, forward and backward: a batch runs one element at a time, where
    ``ragged_dot``'s own rule batches a leading group axis only."""
    return _ragged_dot_seq(lhs, rhs, group_sizes)


def _ragged_dot_fwd(lhs, rhs, group_sizes):
    return _ragged_dot_seq(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _ragged_dot_bwd(res, g):
    lhs, rhs, group_sizes = res
    dl, dr = _ragged_dot_vjp_seq(lhs, rhs, group_sizes, g)
    return dl, dr, None


ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)
