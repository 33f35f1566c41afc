"""``expert_matmul``: the grouped expert GEMM over expert-sorted rows, with the
LoRA fold applied to its result (docs/semantics.md §5, docs/expert_matmul.md).

Row ``r`` of the output belongs to expert ``e`` when ``offsets[e] <= r <
offsets[e + 1]``, where ``offsets`` are the prefix sums of ``group_sizes``
(negative sizes count as 0, and the sums are clipped at ``M``, so a group that
runs past row ``M`` is cut there). Such a row is::

    base[r] = round(xs[r] @ w[e])                    (fp32 accumulation)
    out[r]  = round(base[r] + scale * round(round(xs[r] A^T) B^T))   (adapted rows)
    out[r]  = base[r]                                                 (other rows)

with ``xs[r] = x[r]`` (``x_gather=0``) or ``x[sorted_token_ids[r]]``
(``x_gather=1``; a token outside ``[0, num_tokens)`` reads a zero row and
folds nothing). Rows ``r >= offsets[E]`` (past the last group) are zero. The
fold is exactly ``moe_lora_grouped_down`` on ``base`` with ``x_gather=0``
over ``xs``: same skip rules, same roundings, and rows without an adapter are
bit-identical to the same backend's GEMM without LoRA.

Where the CUTLASS kernel folds inside its K loop (``lora_in_gemm``), an adapted
row is instead ``round(xs[r] @ w[e] + round(xs[r] A^T) @ round(scale * B^T))``:
one fp32 accumulation, one rounding of the output (the same skip rules; rows
without an adapter still bit-identical to the GEMM without LoRA). Its
``round(scale * B^T)`` blocks are packed in the call, or read from
``lora_packs`` made beforehand by ``pack_lora_in_gemm`` (the same bits).

Backends: ``"jnp"`` and ``"cpu"`` run ``jax.lax.ragged_dot`` and the fold
with that impl; ``"fast"`` runs one custom call (CUTLASS grouped GEMM on sm90,
then the fast grouped fold in the same handler) for bf16/f16 when the
extension holds the kernel and ``K`` and ``N`` are multiples of 8, else the
``"jnp"`` path. ``"auto"`` is decided when the computation is lowered, as
for the folds (``ops/backend.py``): ``"fast"`` for CUDA, ``"cpu"`` for the
CPU, ``"jnp"`` for any other platform. Up
to ``gather_max_rows`` sorted rows the fold is the gather fold instead (one
flat row per sorted row, after the GEMM; with ``"fast"`` the GEMM's custom
call, then the gather fold's; ``gather_max_rows=None`` takes
``gather_rows_limit(E)``): the same fold, whose kernels suit few rows per
(adapter, expert) cell.

Gradients (``jax.grad`` w.r.t. ``x``, ``w`` and the LoRA pools and scales)
come from one ``custom_vjp``, with the roundings treated as the identity.
Where the CUTLASS kernel runs the forward, the backward runs on the grouped
GEMMs of ``ops/grouped_matmul.py`` (docs/design.md, "Backward"): ``dx = g
w[e]^T`` with the weights read transposed in place, the folds' terms over
the rows' (adapter, expert) cells (``ops/grouped_vjp.py``), ``dw[e] =
xs_e^T g_e`` only when ``w`` is differentiated. The forward's kernels
compute each folding row's ``xa = round(x A^T)``: the one folding inside the
K loop and the gather fold's leave it, and the training forward keeps it for
the backward, which then reads no ``A`` block to make it again. Every other
backend takes
``ragged_dot``'s transposes in fp32 and the fold VJP (``ops/autodiff.py``).
``jax.vmap`` batches every backend (the custom calls and ``ragged_dot`` one
element at a time).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jax_moelora import _ext
from jax_moelora.ops import (autodiff, backend, batching, expert_matmul_ffi, ffi_fold, grouped_vjp,
                             jnp_fold, launch, lora_pack)
from jax_moelora.ops import grouped_matmul as gm
from jax_moelora.ops.folds import gather_rows_limit
from jax_moelora.ops.jnp_fold import rounded
from jax_moelora.ops.take_rows import take_rows
from jax_moelora.tables import FLOAT_DTYPES, MoeExpertRoute

__all__ = ["expert_matmul", "expert_offsets", "uses_kernel", "gemm_schedule", "lora_ext_k",
           "lora_in_gemm_default", "EXPERT_MATMUL_IMPLS", "EXPERT_MATMUL_SCHEDULES",
           "PINGPONG_MAX_K", "LORA_IN_GEMM_K_FRACTION"]

EXPERT_MATMUL_IMPLS = ("auto", "fast", "cpu", "jnp")
Impl = Literal["auto", "fast", "cpu", "jnp"]
#: The CUTLASS kernel's schedules (``ffi_src/expert_matmul/expert_matmul_config.cuh``):
#: ``"cooperative"`` (two warpgroups on one tile, the epilogue after the
#: mainloop) or ``"pingpong"`` (a tile per warpgroup, one's epilogue under the
#: other's mainloop); ``"auto"`` takes :func:`gemm_schedule`.
EXPERT_MATMUL_SCHEDULES = ("auto", "cooperative", "pingpong")
Schedule = Literal["auto", "cooperative", "pingpong"]
#: ``schedule="auto"`` takes the pingpong kernel up to this ``K`` (docs/expert_matmul.md).
PINGPONG_MAX_K = 1024
#: ``lora_in_gemm=None`` folds inside the GEMM while every route's extension of
#: the K loop (:func:`lora_ext_k`) is at most ``K / LORA_IN_GEMM_K_FRACTION``
#: (docs/expert_matmul.md, "The LoRA inside the GEMM").
LORA_IN_GEMM_K_FRACTION = 8

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


def expert_offsets(group_sizes: jax.Array, rows: int) -> jax.Array:
    """int32 ``[E + 1]`` row offsets of the groups: ``0``, then the prefix sums
    of ``max(group_sizes, 0)`` clipped at ``rows`` (traced jnp)."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes, dtype=jnp.int32), rows)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])


# ---- validation ------------------------------------------------------------------------------

def _array(name: str, v) -> tuple[tuple[int, ...], np.dtype]:
    shape, dtype = getattr(v, "shape", None), getattr(v, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"expert_matmul: {name} must be an array, got {type(v).__name__}")
    return tuple(shape), jnp.dtype(dtype)


def _int_vector(name: str, v) -> int:
    shape, dt = _array(name, v)
    if dt != jnp.int32:
        raise TypeError(f"expert_matmul: {name} must be int32, got {dt}")
    if len(shape) != 1:
        raise ValueError(f"expert_matmul: {name} must be 1-D, got shape {shape}")
    return shape[0]


def _weights(w, dtype) -> tuple[tuple[Any, ...], bool]:
    """``w`` as a tuple of ``[E, K, N]`` arrays and whether it is a gate/up pair."""
    if isinstance(w, (tuple, list)):
        if len(w) != 2:
            raise ValueError(f"expert_matmul: w as a sequence must be (w_gate, w_up), got "
                             f"{len(w)} arrays")
        ws, pair = tuple(w), True
    else:
        shape, _ = _array("w", w)
        if len(shape) == 4:
            if shape[0] != 2:
                raise ValueError(f"expert_matmul: a 4-D w must be stacked [2, E, K, N] "
                                 f"(gate, up), got shape {shape}")
            ws, pair = (w[0], w[1]), True
        else:
            ws, pair = (w,), False
    shapes = []
    for i, wi in enumerate(ws):
        name = "w" if not pair else ("w_gate", "w_up")[i]
        shape, dt = _array(name, wi)
        if len(shape) != 3:
            raise ValueError(f"expert_matmul: {name} must be [E, K, N], got shape {shape}")
        if dt != dtype:
            raise TypeError(f"expert_matmul: {name} dtype {dt} differs from x dtype {dtype}")
        shapes.append(shape)
    if pair and shapes[0] != shapes[1]:
        raise ValueError(f"expert_matmul: w_gate {shapes[0]} and w_up {shapes[1]} differ in shape")
    return ws, pair


def _per_set(value, pair: bool, name: str, single: type, pair_form: str) -> tuple[Any, ...]:
    """``value``, one ``single`` or for a gate/up pair a pair of them, as a
    tuple with one entry a weight set; errors name the argument ``name``."""
    if isinstance(value, single):
        if pair:
            raise TypeError(f"expert_matmul: with a gate/up pair of weights, {name} must be a "
                            f"pair {pair_form}; either may be None")
        return (value,)
    if isinstance(value, (tuple, list)):
        if not pair:
            raise TypeError(f"expert_matmul: {name} is a sequence but w is one weight set; pass "
                            f"one {single.__name__}")
        if len(value) != 2:
            raise ValueError(f"expert_matmul: {name} must be {pair_form}, got {len(value)} "
                             f"entries")
        return tuple(value)
    raise TypeError(f"expert_matmul: {name} must be a {single.__name__}, a pair of them or None, "
                    f"got {type(value).__name__}")


def _set_name(name: str, pair: bool, i: int) -> str:
    """How errors name weight set ``i``'s entry of the argument ``name``."""
    return name if not pair else (f"{name}[0] (gate)", f"{name}[1] (up)")[i]


def _routes(lora, pair: bool, dtype, E: int, K: int, N: int) -> tuple[Any, ...]:
    if lora is None:
        return (None,) * (2 if pair else 1)
    routes = _per_set(lora, pair, "lora", MoeExpertRoute, "(route_gate, route_up)")
    for i, r in enumerate(routes):
        name = _set_name("lora", pair, i)
        if r is None:
            continue
        if not isinstance(r, MoeExpertRoute):
            raise TypeError(f"expert_matmul: {name} must be a MoeExpertRoute or None, got "
                            f"{type(r).__name__}")
        if r.dtype != dtype:
            raise TypeError(f"expert_matmul: {name} pools are {r.dtype}, x is {dtype}")
        if r.k_in != K:
            raise ValueError(f"expert_matmul: {name} has k_in {r.k_in}, x has {K} columns")
        if r.n_out != N:
            raise ValueError(f"expert_matmul: {name} has n_out {r.n_out}, w has {N} columns")
        if r.n_experts > E:
            raise ValueError(f"expert_matmul: {name} has {r.n_experts} experts, w has {E}")
        if r.max_rank > _ext.MAX_RANK:
            raise ValueError(f"expert_matmul: {name} max_rank {r.max_rank} exceeds the kernels' "
                             f"limit {_ext.MAX_RANK}")
    return routes


def _packs(lora_packs, routes: tuple, pair: bool) -> tuple | None:
    """``lora_packs`` checked against the routes: per weight set its pack
    (None where the route is None), or None when no packs are given."""
    if lora_packs is None:
        return None
    if all(r is None for r in routes):
        raise ValueError("expert_matmul: lora_packs is given without lora")
    packs = _per_set(lora_packs, pair, "lora_packs", lora_pack.LoraInGemmPack,
                     "(pack_gate, pack_up), matching lora")
    for i, (p, r) in enumerate(zip(packs, routes)):
        name = _set_name("lora_packs", pair, i)
        if r is None:
            if p is not None:
                raise ValueError(f"expert_matmul: {name} is given for a weight set without "
                                 f"a route")
            continue
        lora_pack.check_pack(p, r, name)
    return packs


# ---- forward backends ------------------------------------------------------------------------

class _Cfg(NamedTuple):
    impl: str          # "auto" (decided at lowering), "jnp", "cpu" or "fast"
    has_ra: bool       # a row-adapter map is passed
    pdl: bool = True   # programmatic dependent launch of the fold (ops/launch.py)
    gather: bool = False  # the LoRA folded by the gather fold (M <= gather_max_rows)
    schedule: str = "cooperative"  # the CUTLASS kernel's schedule (resolved)
    lora_in_gemm: bool = False  # the kernel folds inside its K loop (lora_in_gemm resolved)


def _ragged(xs, w, offsets):
    """``round(ragged_dot(xs, w))`` in xs's dtype, fp32 accumulation; rows past
    ``offsets[-1]`` are zero."""
    sizes = jnp.diff(offsets)
    # operands widened to f32: exact products, f32 sums on every platform (the
    # CPU dot thunks lack mixed-precision kernels)
    acc = jax.lax.ragged_dot(xs.astype(_F32), w.astype(_F32), sizes, precision=_HI)
    return rounded(acc, xs.dtype)


# ragged_dot batches over a leading group axis only: under vmap, one element at a time
_ragged_seq = batching.sequential(_ragged)


def _fold(impl: str, xs, base, offsets, stids, route, ra):
    if route is None:
        return base
    return autodiff.grouped_down(xs, base, offsets, stids, route, ra, row_offset=0,
                                 row_end=base.shape[0], x_gather=0, impl=impl)


def _gather_rows(xs, offsets, stids, ra):
    """Each sorted row's expert (-1 where the grouped fold's rules skip it) and
    adapter, for the gather fold of :func:`_forward` (one flat row per sorted
    row, ``top_k`` 1, ``x_gather`` 0): the same fold as :func:`_fold`. The
    fold of few rows per (adapter, expert) cell: the gather kernels spread its
    rows over the GPU, where the grouped kernels walk a tile's cells one after
    the other."""
    expert, _, adapter, ok_tok = jnp_fold.grouped_rows(offsets, stids, ra, x_rows=xs.shape[0],
                                                       row_offset=0, row_end=xs.shape[0],
                                                       x_gather=0)
    return jnp.where(ok_tok, expert, -1), adapter


def uses_kernel(dtype, K: int, N: int) -> bool:
    """Whether ``impl="fast"`` runs the CUTLASS kernel for these operands now
    (else it runs ``ragged_dot`` and the fast fold): computations go to a GPU
    and ``backend.cutlass_takes`` them (built, sm_90, bf16 or f16, ``K`` and
    ``N`` multiples of ``EXPERT_MATMUL_ALIGN``)."""
    return backend.gpu_now() and backend.cutlass_takes(dtype, K, N)


def _per_platform(cfg: _Cfg, fn, *args):
    """``impl="auto"``: ``fn(cfg with the backend of the lowering platform,
    *args)`` (``backend.AUTO``)."""
    def branch(impl):
        return lambda *a: fn(cfg._replace(impl=impl), *a)

    return backend.per_platform(*args, cpu=branch(backend.AUTO["cpu"]),
                                cuda=branch(backend.AUTO["cuda"]) if _ext.HAS_CUDA else None,
                                default=branch("jnp"))


def lora_ext_k(route: MoeExpertRoute) -> int:
    """Columns the LoRA inside the GEMM adds to the K loop for ``route``:
    ``max_loras * max_rank`` (each adapter's shrink in its own ``R`` columns)."""
    return route.max_loras * route.max_rank


def lora_in_gemm_default(K: int, routes: Sequence[MoeExpertRoute | None]) -> bool:
    """What ``lora_in_gemm=None`` takes: fold inside the GEMM's K loop when
    every route's :func:`lora_ext_k` is at most ``K / LORA_IN_GEMM_K_FRACTION``,
    i.e. the extension costs at most that share of the tile's MMA steps (4
    adapters of rank 16 add 64 columns: one 64-wide K step against Qwen3's
    12 for the down projection, 32 for gate/up)."""
    live = [r for r in routes if r is not None]
    return bool(live) and all(lora_ext_k(r) * LORA_IN_GEMM_K_FRACTION <= K for r in live)


def gemm_schedule(K: int) -> str:
    """The kernel schedule ``schedule="auto"`` takes for a ``[*, K] x [E, K,
    N]`` GEMM: ``"pingpong"`` up to :data:`PINGPONG_MAX_K`, where a tile's
    mainloop is short and its epilogue (rounding and storing a 128 x 128
    tile) a large share of its time, which the pingpong kernel hides under
    the other warpgroup's mainloop; ``"cooperative"`` above."""
    return "pingpong" if K <= PINGPONG_MAX_K else "cooperative"


def _forward(cfg: _Cfg, xs, ws, offsets, stids, routes, ra, xt=None, packs=None):
    """``[len(ws), M, N]``: weight set ``i``'s folded output is plane ``i``.
    ``xt``: the tokens ``xs`` was gathered from (``x_gather=1``) or None; the
    custom call's shrinks read them there (same values, fewer bytes).
    ``packs``: the routes' packs made beforehand (:func:`_packs`) or None;
    only the kernel folding inside its K loop reads them."""
    if cfg.impl == "auto":
        return _per_platform(cfg, _forward, xs, ws, offsets, stids, routes, ra, xt, packs)
    ra = ra if cfg.has_ra else None
    kernel = cfg.impl == "fast" and backend.cutlass_takes(xs.dtype, ws[0].shape[1], ws[0].shape[2])
    gather = cfg.gather and any(r is not None for r in routes)
    if kernel and not gather:  # the GEMM and the grouped fold in one custom call
        return expert_matmul_ffi.expert_matmul_ffi(xs, ws, offsets, stids, routes, ra, cfg.pdl,
                                                   cfg.schedule, cfg.lora_in_gemm, xt, packs)[0]
    if kernel:
        bases = _gemm_alone(cfg, xs, ws, offsets, stids)
    else:
        bases = [_ragged_seq(xs, w, offsets) for w in ws]
    fold_impl = "cpu" if cfg.impl == "cpu" else ("fast" if cfg.impl == "fast" else "jnp")
    if not gather:
        return jnp.stack([_fold(fold_impl, xs, b, offsets, stids, r, ra)
                          for b, r in zip(bases, routes)])
    ids, adapter = _gather_rows(xs, offsets, stids, ra)  # shared by both weight sets
    return jnp.stack([b if r is None else
                      autodiff.gather_bgmv(xs, b, ids, r, adapter, top_k=1, x_gather=0,
                                           impl=fold_impl)
                      for b, r in zip(bases, routes)])


def _kept_xa_shapes(cfg: _Cfg, xs, ws, routes) -> tuple | None:
    """Per weight set, the shape of the rows' shrinks ``xa`` the training
    forward keeps for the backward, in the form ``grouped_vjp.lora_grads``
    reads (None for a weight set without LoRA); None where no kernel leaves
    them. The gather fold (``cfg.gather``) leaves them by row, ``[M, R]``; the
    CUTLASS kernel folding inside its K loop spread by adapter, ``[M, L *
    R]`` (``expert_matmul_ffi``'s ``xa``). Both only where the backward runs
    on the kernels (:func:`_bwd`)."""
    if not (any(r is not None for r in routes) and cfg.impl in ("fast", "auto")
            and (cfg.gather or cfg.lora_in_gemm)
            and backend.cutlass_takes(xs.dtype, ws[0].shape[1], ws[0].shape[2])):
        return None
    M = xs.shape[0]
    return tuple(None if r is None else
                 (M, r.max_rank if cfg.gather else r.max_loras * r.max_rank) for r in routes)


def _gemm_alone(cfg: _Cfg, xs, ws, offsets, stids) -> jax.Array:
    """``[len(ws), M, N]``: the CUTLASS grouped GEMM of each weight set, no LoRA."""
    return expert_matmul_ffi.expert_matmul_ffi(xs, ws, offsets, stids, (None,) * len(ws), None,
                                               cfg.pdl, cfg.schedule)[0]


def _forward_keeping_xa(cfg: _Cfg, shapes, xs, ws, offsets, stids, routes, ra, xt, packs):
    """``(the forward, xa)``: ``xa`` per weight set the kernels' rows' shrinks
    of ``shapes`` (:func:`_kept_xa_shapes`; zeros on the other platforms'
    branches, which never read them), None where ``shapes`` is None."""
    if shapes is None:
        return _forward(cfg, xs, ws, offsets, stids, routes, ra, xt, packs), None
    if cfg.impl == "auto":
        return _per_platform(cfg, lambda c, *a: _forward_keeping_xa(c, shapes, *a),
                             xs, ws, offsets, stids, routes, ra, xt, packs)
    if cfg.impl != "fast":
        return (_forward(cfg, xs, ws, offsets, stids, routes, ra, xt, packs),
                tuple(None if sh is None else jnp.zeros(sh, xs.dtype) for sh in shapes))
    ra = ra if cfg.has_ra else None
    if cfg.gather:
        return _gather_keeping_xa(cfg, xs, ws, offsets, stids, routes, ra)
    out, xa = expert_matmul_ffi.expert_matmul_ffi(xs, ws, offsets, stids, routes, ra, cfg.pdl,
                                                  cfg.schedule, True, xt, packs)
    # plane i starts with weight set i's [M, L * R] (its own row stride)
    return out, tuple(None if sh is None else xa[i].reshape(-1)[:sh[0] * sh[1]].reshape(sh)
                      for i, sh in enumerate(shapes))


def _gather_keeping_xa(cfg: _Cfg, xs, ws, offsets, stids, routes, ra):
    """:func:`_forward`'s gather branch on the kernels, each fold keeping its
    rows' ``xa``: ``(out [n, M, N], xa)``, ``xa`` per weight set its rows'
    ``[M, R]``, zeros for the rows that fold nothing (None without LoRA)."""
    ids, adapter = _gather_rows(xs, offsets, stids, ra)
    outs, kept = [], []
    for b, r in zip(_gemm_alone(cfg, xs, ws, offsets, stids), routes):
        xa = None
        if r is not None:
            args = batching.match_varying((xs, b, ids, r, adapter), floats_only=False)
            b, xa = ffi_fold.gather_bgmv_ffi(*args, top_k=1, x_gather=0, impl="fast",
                                             pdl=cfg.pdl, keep_xa=True)
            xa = jnp.where(jnp_fold.resolve_pairs(r, adapter, ids)[3][:, None], xa, 0)
        outs.append(b)
        kept.append(xa)
    # typed varying like the operands (inside shard_map), as the folds' results are
    return batching.match_varying(((jnp.stack(outs), tuple(kept)), (xs, ws, routes)),
                                  floats_only=False)[0]


def _route_ct(route: MoeExpertRoute, grads: grouped_vjp.ProjectionGrads) -> MoeExpertRoute:
    E, L = route.n_experts, route.max_loras
    return autodiff.route_cotangent(route, grads.d_a_pool, grads.d_b_pool,
                                    grads.d_scale.reshape(E, L).T)


def _lora_bwd_kernel(xs, gs, offsets, stids, routes, ra, impl: str = "fast", xa=None):
    """dx of the folds (or None without LoRA) and the routes' cotangents, by
    the grouped matmuls of ``ops/grouped_vjp.py`` over (adapter, expert)
    cells: gate and up together where their tables have one shape. ``xa``:
    per weight set the rows' shrinks the forward kept (:func:`_kept_xa_shapes`),
    or None."""
    M = xs.shape[0]
    live = [i for i, r in enumerate(routes) if r is not None]
    droutes: list = [None] * len(routes)
    dx = None
    if not live:
        return dx, droutes
    shapes: dict = {}
    for i in live:  # routes whose tables share (L, E_t) share the rows' cells
        shapes.setdefault((routes[i].max_loras, routes[i].n_experts), []).append(i)
    expert, _, adapter, ok = jnp_fold.grouped_rows(offsets, stids, ra, x_rows=M, row_offset=0,
                                                   row_end=M, x_gather=0)
    E = offsets.shape[0] - 1
    for (L, Et), idx in shapes.items():
        key = grouped_vjp.cell_keys(L, Et, adapter, expert, ok)
        members = [grouped_vjp.member(routes[i], gs, g_plane=i) for i in idx]
        # the tables' experts: the GEMM's first E_t groups (none past its E)
        lora_offsets = jnp.concatenate([offsets[:Et + 1],
                                        jnp.broadcast_to(offsets[E:], (max(Et - E, 0),))])
        kept = None if xa is None else [xa[i] for i in idx]
        dx, grads = grouped_vjp.lora_grads(xs, members, key, lora_offsets, impl=impl, acc=dx,
                                           xa=kept)
        for i, gr in zip(idx, grads):
            droutes[i] = _route_ct(routes[i], gr)
    return dx, droutes


def _bwd_kernel(args, gs, need_x: bool, need_w: bool, impl: str = "fast", xa=None):
    """The backward on the grouped-GEMM kernels: ``dx = sum_i g_i w_i^T`` (the
    weights read transposed in place) plus the folds' ``dx``; ``dw_i[e] =
    xs_e^T g_i`` only when the weights are differentiated."""
    xs, ws, offsets, stids, routes, ra = args
    dx, droutes = _lora_bwd_kernel(xs, gs, offsets, stids, routes, ra, impl, xa)
    if need_x:
        for i, w in enumerate(ws):
            dx = gm.gmm([gm.GmmSet(gs, w, offsets, None, i, 0)], transpose_rhs=True,
                        acc=None if dx is None else [dx], impl=impl)[0]
    dws = None
    if need_w:
        sets = [gm.TgmmSet(xs, gs, offsets, 0, i) for i in range(len(ws))]
        dws = tuple(d.astype(w.dtype) for d, w in zip(gm.tgmm(sets, impl=impl), ws))
    return (dx if need_x else None), dws, droutes


def _bwd_ragged(cfg: _Cfg, args, gs):
    """The backward of every other backend: the GEMM through ``ragged_dot``'s
    transposes in fp32, the folds through their VJP (``ops/autodiff.py``)."""
    xs, ws, offsets, stids, routes, ra = args
    ra_ = ra if cfg.has_ra else None
    dxs = jnp.zeros(xs.shape, _F32)
    dws, droutes = [], []
    for w, r, g in zip(ws, routes, gs):  # gs [len(ws), M, N]: one plane a weight set
        dx_g, dw = _ragged_vjp(xs, w, offsets, g)
        dxs = dxs + dx_g
        dws.append(dw.astype(w.dtype))
        if r is None:
            droutes.append(None)
            continue
        # The fold's VJP (its forward is dead code here and is removed by XLA).
        fold = lambda x_, r_: _fold("jnp", x_, jnp.zeros(g.shape, g.dtype), offsets,  # noqa: E731
                                    stids, r_, ra_)
        _, vjp_f = jax.vjp(fold, xs, r)
        dx_f, dr = vjp_f(g)
        dxs = dxs + dx_f.astype(_F32)
        droutes.append(autodiff.route_cotangent(r, dr.a_pool, dr.b_pool, dr.scale_table))
    return dxs.astype(xs.dtype), tuple(dws), droutes


def _bwd(cfg: _Cfg, args, gs, need_x: bool, need_w: bool, xa=None):
    """The cotangents of ``(xs, ws, offsets, stids, routes, ra)``: on the
    kernels where the CUTLASS GEMM ran the forward (reading the rows' shrinks
    ``xa`` it kept, if any), else through ``ragged_dot``."""
    xs, ws = args[0], args[1]
    if cfg.impl == "fast" and backend.cutlass_takes(xs.dtype, ws[0].shape[1], ws[0].shape[2]):
        dx, dws, droutes = _bwd_kernel(args, gs, need_x, need_w, xa=xa)
    else:
        dx, dws, droutes = _bwd_ragged(cfg, args, gs)
    return (dx if need_x else None, dws if need_w else None, None, None, tuple(droutes), None,
            None, None)


def _is_primal(p) -> bool:
    return hasattr(p, "perturbed")


def _values(primals):
    return jax.tree_util.tree_map(lambda p: p.value, primals, is_leaf=_is_primal)


def _perturbed(primals) -> bool:
    return any(p.perturbed for p in jax.tree_util.tree_leaves(primals, is_leaf=_is_primal))


@functools.cache
def _op(cfg: _Cfg):
    # xt: the tokens xs was gathered from, or None. It only says where the
    # custom call's shrinks may read xs's values (xs[r] == xt[stids[r]] for
    # every row that folds), so it gets no cotangent: x's flows through xs.
    # packs: the routes' packed scale * B made beforehand, or None; values of
    # the routes' pools and scales, whose cotangents carry the gradient, so
    # the packs get none either.
    @jax.custom_vjp
    def op(xs, ws, offsets, stids, routes, ra, xt, packs):
        return _forward(cfg, xs, ws, offsets, stids, routes, ra, xt, packs)

    def fwd(xs, ws, offsets, stids, routes, ra, xt, packs):
        args = _values((xs, ws, offsets, stids, routes, ra))
        # which operands are differentiated, kept as the residuals' (static) structure
        need = tuple(() if _perturbed(p) else None for p in (xs, ws))
        shapes = _kept_xa_shapes(cfg, args[0], args[1], args[4])
        out, xa = _forward_keeping_xa(cfg, shapes, *args, _values(xt), _values(packs))
        return out, (args, need, xa)

    def bwd(res, gs):
        args, (need_x, need_w), xa = res
        if isinstance(gs, SymbolicZero):
            gs = jnp.zeros(gs.shape, gs.dtype)
        need = (need_x is not None, need_w is not None)
        if cfg.impl == "auto":
            return _per_platform(cfg, lambda c, a, g, x_: _bwd(c, a, g, *need, x_), args, gs, xa)
        return _bwd(cfg, args, gs, *need, xa)

    op.defvjp(fwd, bwd, symbolic_zeros=True)
    return op


def _ragged_f32_vjp(xs, w, offsets, g):
    """``(dx, dw)``, f32, of ``ragged_dot(xs, w)`` in fp32 for the cotangent ``g``."""
    def gemm(x_, w_):
        return jax.lax.ragged_dot(x_.astype(_F32), w_.astype(_F32), jnp.diff(offsets),
                                  precision=_HI)
    _, vjp = jax.vjp(gemm, xs, w)
    dx, dw = vjp(g.astype(_F32))
    return dx.astype(_F32), dw


# ragged_dot batches over a leading group axis only: under vmap, one element at a time
_ragged_vjp = batching.sequential(_ragged_f32_vjp)


def _rows(xshape, dtype, x_gather, wshape, group_sizes, sorted_token_ids) -> tuple[int, int]:
    """``(M, num_tokens)``, the sorted rows and the tokens, after checking
    ``x``, ``x_gather``, ``w``'s shape against ``x``, ``group_sizes`` and
    ``sorted_token_ids``."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"expert_matmul: x dtype must be bf16, f16 or f32, got {dtype}")
    if len(xshape) != 2:
        raise ValueError(f"expert_matmul: x must be 2-D [rows, K], got shape {xshape}")
    if x_gather not in (0, 1) or isinstance(x_gather, (bool, float)):
        raise ValueError(f"expert_matmul: x_gather must be 0 or 1, got {x_gather!r}")
    E, K, N = wshape
    if K != xshape[1]:
        raise ValueError(f"expert_matmul: x has {xshape[1]} columns but w has K = {K}")
    if E < 1 or N < 1:
        raise ValueError(f"expert_matmul: w has no experts or no columns (shape {wshape})")
    ng = _int_vector("group_sizes", group_sizes)
    if ng != E:
        raise ValueError(f"expert_matmul: group_sizes has {ng} entries, w has {E} experts")
    if x_gather:
        if sorted_token_ids is None:
            raise ValueError("expert_matmul: x_gather=1 needs sorted_token_ids")
        M, num_tokens = _int_vector("sorted_token_ids", sorted_token_ids), xshape[0]
    else:
        M = num_tokens = xshape[0]
        if sorted_token_ids is not None:
            ns = _int_vector("sorted_token_ids", sorted_token_ids)
            if ns != M:
                raise ValueError(f"expert_matmul: sorted_token_ids has {ns} entries, x has {M} rows")
    if M == 0 or num_tokens == 0:
        raise ValueError(f"expert_matmul: no rows (x shape {xshape}, {M} sorted rows)")
    return M, num_tokens


def _check_options(pair: bool, glu: bool, stacked: bool, impl: str, schedule: str,
                   lora_in_gemm) -> None:
    if glu and not pair:
        raise ValueError("expert_matmul: glu=True needs a gate/up pair of weights")
    if stacked and (not pair or glu):
        raise ValueError("expert_matmul: stacked=True needs a gate/up pair of weights and "
                         "glu=False")
    if impl not in EXPERT_MATMUL_IMPLS:
        raise ValueError(f"expert_matmul: impl must be one of {EXPERT_MATMUL_IMPLS}, got {impl!r}")
    if schedule not in EXPERT_MATMUL_SCHEDULES:
        raise ValueError(f"expert_matmul: schedule must be one of {EXPERT_MATMUL_SCHEDULES}, "
                         f"got {schedule!r}")
    if lora_in_gemm is not None and not isinstance(lora_in_gemm, bool):
        raise ValueError(f"expert_matmul: lora_in_gemm must be None, True or False, got "
                         f"{lora_in_gemm!r}")


def _check_row_adapter(row_adapter, num_tokens: int, per_token: bool) -> None:
    """``row_adapter`` int32 ``[num_tokens]`` when it is read per token."""
    if row_adapter is None:
        return
    nr = _int_vector("row_adapter", row_adapter)
    if nr == 0:
        raise ValueError("expert_matmul: row_adapter is empty")
    if per_token and nr != num_tokens:
        raise ValueError(f"expert_matmul: row_adapter has {nr} entries, there are "
                         f"{num_tokens} tokens")


def _sorted_rows(x, M: int, num_tokens: int, x_gather: int, sorted_token_ids, row_adapter,
                 has_lora: bool):
    """``(xs [M, K], stids int32 [M], row-adapter map or None, xt)``: the rows
    the GEMM reads (``x_gather=1``: gathered, zero for a token outside
    ``[0, num_tokens)``, which a map of zeros then keeps from folding), and
    the tokens they were gathered from where a LoRA shrink may read them
    there (``x_gather=1`` with LoRA), else None."""
    stids = (jnp.arange(M, dtype=jnp.int32) if sorted_token_ids is None
             else jnp.asarray(sorted_token_ids))
    xs = x
    if x_gather:
        xs = take_rows(x, stids, zero_outside=True)
        if row_adapter is None and has_lora:
            row_adapter = jnp.zeros((num_tokens,), jnp.int32)
    return (xs, stids, (row_adapter if (has_lora and row_adapter is not None) else None),
            x if (x_gather and has_lora) else None)


# ---- public op ---------------------------------------------------------------------------------

def expert_matmul(x: jax.Array, w: jax.Array | Sequence[jax.Array], group_sizes: jax.Array, *,
                  lora: MoeExpertRoute | Sequence[MoeExpertRoute | None] | None = None,
                  row_adapter: jax.Array | None = None,
                  sorted_token_ids: jax.Array | None = None, x_gather: int = 0,
                  glu: bool = False, stacked: bool = False, impl: Impl = "auto",
                  gather_max_rows: int | None = None, schedule: Schedule = "auto",
                  lora_in_gemm: bool | None = None,
                  lora_packs: lora_pack.LoraInGemmPack | Sequence[Any] | None = None):
    """Grouped expert GEMM over expert-sorted rows, with the LoRA delta folded in.

    Weights use ``ragged_dot``'s layout ``[E, K, N]`` (``out = x @ w[e]``): a
    HF/PyTorch ``nn.Linear`` weight ``[N, K]`` per expert is transposed. Gate
    and up projections have ``K = hidden``, ``N = intermediate``; the down
    projection ``K = intermediate``, ``N = hidden``.

    Args:
      x: ``[M, K]`` (``x_gather=0``: row ``r`` is read) or ``[num_tokens, K]``
        (``x_gather=1``: row ``sorted_token_ids[r]`` is read); bf16, f16 or f32.
      w: ``[E, K, N]`` in x's dtype, or a gate/up pair: ``(w_gate, w_up)`` or a
        stacked ``[2, E, K, N]``, multiplied with the same rows in one call.
      group_sizes: int32 ``[E]``, rows per expert in sorted order (see the
        module docstring for negative sizes and sums past ``M``).
      lora: a ``MoeExpertRoute`` (``k_in = K``, ``n_out = N``, ``n_experts <=
        E``), or for a pair ``(route_gate, route_up)`` (either may be None), or
        None for the GEMM alone.
      row_adapter: int32 ``[num_tokens]``, each token's adapter (``< 0``: base
        model), read at the row's token; None folds every row with table row 0.
        Ignored without ``lora``.
      sorted_token_ids: int32 ``[M]``, the token of each sorted row. Needed
        with ``x_gather=1``; with ``x_gather=0`` it defaults to ``arange(M)``
        (each row its own token).
      x_gather: 0 or 1, see ``x``.
      glu: with a gate/up pair, return ``round(silu(gate) * up)`` (from the
        rounded gate and up outputs, fp32 arithmetic) instead of the pair.
      stacked: with a gate/up pair, return one ``[2, M, N]`` array (gate, up)
        instead of two: the layout a ``StackedRoute`` fold takes, which the
        kernel writes in place (no copy).
      impl: ``"auto"``, ``"fast"``, ``"cpu"`` or ``"jnp"`` (module docstring).
      gather_max_rows: up to this many sorted rows (``M``) the LoRA is folded
        by the gather fold, one flat row per sorted row, after the GEMM; above,
        by the grouped fold (with ``"fast"``, in the GEMM's custom call). The
        same rows fold with the same roundings either way. None (default):
        ``gather_rows_limit(E)``, the rule of ``moe_lora_fold``.
      schedule: the CUTLASS kernel's schedule (:data:`EXPERT_MATMUL_SCHEDULES`;
        ``"auto"``: :func:`gemm_schedule`). Both give the same bits; other
        backends ignore it.
      lora_in_gemm: the CUTLASS kernel folds inside its K loop (``True``: one
        accumulation, the output written once, module docstring) or after the
        GEMM (``False``); ``None``: :func:`lora_in_gemm_default`. Other
        backends and the gather fold ignore it.
      lora_packs: ``pack_lora_in_gemm(route)`` of ``lora`` made beforehand
        (a pair as ``lora``), or None: the kernel folding inside its K loop
        reads them instead of packing ``scale * B`` in every call (the same
        bits; made again after any change to the adapters, docs/expert_matmul.md,
        "Packs made once"); elsewhere ignored. They get no cotangent.

    Returns:
      ``[M, N]`` in x's dtype; for a pair, ``(gate [M, N], up [M, N])``,
      ``[2, M, N]`` when ``stacked``, or the GLU ``[M, N]`` when ``glu``.
    """
    xshape, dtype = _array("x", x)
    ws, pair = _weights(w, dtype)
    E, K, N = ws[0].shape
    M, num_tokens = _rows(xshape, dtype, x_gather, ws[0].shape, group_sizes, sorted_token_ids)
    _check_options(pair, glu, stacked, impl, schedule, lora_in_gemm)
    routes, packs = _lora_operands(lora, lora_packs, pair, dtype, E, K, N)
    has_lora = any(r is not None for r in routes)
    _check_row_adapter(row_adapter, num_tokens, x_gather or sorted_token_ids is None)
    gather = gather_rows_limit(E, gather_max_rows) >= M
    impl = backend.check_impl(impl)  # "auto": decided at lowering
    xs, stids, ra, xt = _sorted_rows(x, M, num_tokens, x_gather, sorted_token_ids,
                                     row_adapter, has_lora)
    offsets = expert_offsets(group_sizes, M)
    cfg = _Cfg(impl, ra is not None, launch.programmatic_launch_enabled(), gather,
               gemm_schedule(K) if schedule == "auto" else schedule,
               lora_in_gemm_default(K, routes) if lora_in_gemm is None else lora_in_gemm)
    ra_arg = ra if ra is not None else jnp.zeros((1,), jnp.int32)
    out = _op(cfg)(xs, tuple(ws), offsets, stids, routes, ra_arg, xt, packs)  # [len(ws), M, N]
    return _result(out, pair, glu, stacked)


def _lora_operands(lora, lora_packs, pair: bool, dtype, E: int, K: int, N: int):
    """``(routes, packs)`` checked (:func:`_routes`, :func:`_packs`), their
    arrays as jax arrays."""
    routes = _routes(lora, pair, dtype, E, K, N)
    packs = _packs(lora_packs, routes, pair)
    routes = tuple(None if r is None else jax.tree_util.tree_map(jnp.asarray, r) for r in routes)
    if packs is not None:
        packs = tuple(None if p is None else lora_pack.LoraInGemmPack(*map(jnp.asarray, p))
                      for p in packs)
    return routes, packs


def _result(out, pair: bool, glu: bool, stacked: bool):
    """``expert_matmul``'s result from the weight sets' outputs ``out [len(ws), M, N]``."""
    if not pair:
        return out[0]
    if glu:
        g, u = out[0].astype(_F32), out[1].astype(_F32)
        return (jax.nn.silu(g) * u).astype(out.dtype)
    return out if stacked else (out[0], out[1])
