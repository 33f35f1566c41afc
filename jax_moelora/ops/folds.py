"""The two MoE LoRA folds and ``moe_lora_fold`` (docs/semantics.md §5).

Each function validates shapes and dtypes at trace time (``ValueError`` /
``TypeError`` before any launch), then runs one backend:

- ``"auto"``: the fastest on the platform the computation is lowered for
  (``"fast"`` for CUDA when the CUDA kernels were built, ``"cpu"`` for the CPU,
  ``"jnp"`` elsewhere), chosen at lowering time, so one function lowered for
  the CPU and for CUDA gets each platform's kernels;
- ``"fast"``: the tuned CUDA kernels; ``"simple"``: the CUDA kernels with the
  simple geometry (a shrink into ``xa``, then an expand-and-fold,
  docs/semantics.md §4); ``"cpu"``: the C++ FFI handlers; ``"jnp"``: pure JAX.
  (``"seed"``, the old name of ``"simple"``, still runs it and warns.)

Every backend folds in place (the result replaces ``base_out``; donate it to
avoid a copy) and skips the same rows, bit-identically.

Every backend is differentiable (``jax.grad`` w.r.t. ``x``, ``base_out``, the
pools and ``scale_table``: ``ops/autodiff.py``, straight-through roundings) and
batches under ``jax.vmap`` into one call (``ops/batching.py``).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_moelora import _ext
from jax_moelora.int_range import check_rows
from jax_moelora.ops import autodiff, contract
from jax_moelora.ops.backend import IMPLS, check_impl, resolve_impl
from jax_moelora.ops.batching import virtual_ids
from jax_moelora.ops.search import searchsorted
from jax_moelora.ops.stacked import StackedRoute, fold_stacked
from jax_moelora.tables import MoeExpertRoute

__all__ = ["moe_lora_gather_bgmv", "moe_lora_grouped_down", "moe_lora_fold", "resolve_impl",
           "IMPLS", "GATHER_MAX_ROWS", "GATHER_ROWS_PER_EXPERT", "gather_rows_limit", "RowPlan",
           "plan_rows", "fold_planned", "sort_rows_by_expert", "fold_token_projections"]

Impl = Literal["auto", "fast", "simple", "cpu", "jnp"]

# moe_lora_fold and expert_matmul use the gather fold up to
# gather_rows_limit(num_experts) rows, else the grouped fold on rows sorted by
# expert: up to GATHER_MAX_ROWS rows, or GATHER_ROWS_PER_EXPERT rows an expert
# on average where that is more (docs/design.md, "Which fold runs").
GATHER_MAX_ROWS = 2048
GATHER_ROWS_PER_EXPERT = 96


def gather_rows_limit(num_experts: int, gather_max_rows: int | None = None) -> int:
    """The largest batch, in rows, that the gather fold folds:
    ``gather_max_rows`` when it is not None, else ``max(GATHER_MAX_ROWS,
    GATHER_ROWS_PER_EXPERT * num_experts)``. Where the (adapter, expert) cells
    hold few rows the gather kernels spread the rows over the GPU, while a
    tile of the grouped fold walks tens of cells one after the other; with
    many rows a cell the grouped fold reads each cell's A and B blocks once
    (docs/design.md, "Which fold runs").

    Raises:
      TypeError: ``gather_max_rows`` is neither None nor an int.
    """
    if gather_max_rows is not None:
        if isinstance(gather_max_rows, (bool, np.bool_)) or not isinstance(gather_max_rows,
                                                                            (int, np.integer)):
            raise TypeError(f"gather_max_rows must be an int or None, got {gather_max_rows!r}")
        return int(gather_max_rows)
    return max(GATHER_MAX_ROWS, GATHER_ROWS_PER_EXPERT * int(num_experts))


def _shape(name: str, v) -> tuple[int, ...]:
    shape = getattr(v, "shape", None)
    if shape is None or getattr(v, "dtype", None) is None:
        raise TypeError(f"{name} must be an array, got {type(v).__name__}")
    return tuple(shape)


def _int_array(name: str, v, ndim: int = 1, allow_uint32: bool = False):
    shape = _shape(name, v)
    dt = jnp.dtype(v.dtype)
    ok = dt == jnp.int32 or (allow_uint32 and dt == jnp.uint32)
    if not ok:
        want = "int32 or uint32" if allow_uint32 else "int32"
        raise TypeError(f"{name} must be {want}, got {dt}")
    if len(shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {shape}")
    return shape


def _check_x_gather(fn: str, x_gather) -> int:
    if isinstance(x_gather, jax.Array):
        what = "a traced value" if isinstance(x_gather, jax.core.Tracer) else "a jax.Array"
        raise TypeError(f"{fn}: x_gather must be a static int 0 or 1 (it picks x's layout at "
                        f"trace time), got {what}")
    if not isinstance(x_gather, (int, np.integer)) or x_gather not in (0, 1):
        raise ValueError(f"{fn}: x_gather must be 0 or 1, got {x_gather!r}")
    return int(x_gather)


def _check_validate(fn: str, validate) -> bool:
    if not isinstance(validate, (bool, np.bool_)):
        raise TypeError(f"{fn}: validate must be a static bool, got {type(validate).__name__}")
    return bool(validate)


def reads_narrow_x(x_dtype, pool_dtype) -> bool:
    """Whether the folds read ``x`` of ``x_dtype`` under pools of
    ``pool_dtype`` as it is, narrower than the pools: bf16 or f16 ``x``
    under float32 pools, widened (exactly) as it is read."""
    return (jnp.dtype(pool_dtype) == jnp.float32
            and jnp.dtype(x_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def _check_common(fn: str, x, base_out, route, narrow_x: bool = False) -> tuple[int, int]:
    """Shapes and dtypes shared by the folds: x in base_out's dtype, which is
    the pools'; with ``narrow_x``, also narrower (:func:`reads_narrow_x`)."""
    if not isinstance(route, MoeExpertRoute):
        raise TypeError(f"{fn}: route must be a MoeExpertRoute, got {type(route).__name__}")
    xs, bs = _shape("x", x), _shape("base_out", base_out)
    if len(bs) != 2:
        raise ValueError(f"{fn}: base_out must be 2-D [rows, n_out], got shape {bs}")
    if len(xs) != 2:
        raise ValueError(f"{fn}: x must be 2-D [rows, k_in], got shape {xs}")
    if bs[0] == 0:
        raise ValueError(f"{fn}: base_out has no rows")
    check_rows(fn, "base_out", bs[0])
    check_rows(fn, "x", xs[0])
    dt = jnp.dtype(base_out.dtype)
    if dt != route.dtype:
        raise TypeError(f"{fn}: base_out dtype {dt} differs from the route's pools ({route.dtype})")
    xdt = jnp.dtype(x.dtype)
    if xdt != dt and not (narrow_x and reads_narrow_x(xdt, dt)):
        also = " (x may be bf16 or f16 only with float32 pools)" if narrow_x else ""
        raise TypeError(f"{fn}: x dtype {xdt} differs from base_out dtype {dt}{also}")
    if bs[1] != route.n_out:
        raise ValueError(f"{fn}: base_out has {bs[1]} columns but the route's n_out is {route.n_out}")
    if xs[1] != route.k_in:
        raise ValueError(f"{fn}: x has {xs[1]} columns but the route's k_in is {route.k_in}")
    if route.max_rank > _ext.MAX_RANK:
        raise ValueError(f"{fn}: max_rank {route.max_rank} exceeds the kernels' limit {_ext.MAX_RANK}")
    return xs[0], bs[0]


def moe_lora_gather_bgmv(x: jax.Array, base_out: jax.Array, indices: jax.Array,
                         route: MoeExpertRoute, row_adapter: jax.Array | None = None, *,
                         top_k: int, x_gather: int, impl: Impl = "auto",
                         validate: bool = False) -> jax.Array:
    """Fold ``out[row] += scale_e * (x[x_row] @ A_e^T) @ B_e^T`` over unsorted flat rows.

    Args:
      x: ``[n_slots, k_in]`` (``x_gather=0``: row ``row`` is read) or
        ``[num_tokens, k_in]`` (``x_gather=1``: row ``row // top_k``), the
        activation dtype (bf16, f16 or f32); with float32 pools also bf16
        or f16, widened (exactly) as it is read: a router's fold over the
        activations (docs/semantics.md §5).
      base_out: ``[n_slots, n_out]``, flat token-major rows ``t * top_k + k``.
      indices: int32 (or uint32) ``[n_slots]``, the expert id of each row.
      route: the projection's ``MoeExpertRoute``, or a ``StackedRoute`` of
        ``S`` projections that share ``x`` and the ids (gate and up): then
        ``base_out`` and the result are ``[S, n_slots, n_out]``, one launch.
      row_adapter: int32 ``[num_tokens]`` adapter value per token (``< 0``:
        no fold; with ``L > 1`` it picks the table row, ``>= L`` folds
        nothing), or ``None`` to fold every row with table row 0.
      top_k: experts per token; ``n_slots`` must be a multiple of it.
      x_gather: 0 or 1 (a static int), see ``x``.
      impl: backend, see the module docstring.
      validate: when True, a breach of docs/malformed_metadata.md (a table
        cell outside the pool) raises instead of skipping the row: eagerly
        ``checkify.JaxRuntimeError``; under ``jit`` wrap the caller in
        ``jax.experimental.checkify.checkify``.

    Returns:
      ``[n_slots, n_out]``: ``base_out`` with every adapted row folded.
    """
    fn = "moe_lora_gather_bgmv"
    if isinstance(route, StackedRoute):
        return fold_stacked(fn, lambda b, r: moe_lora_gather_bgmv(
            x, b, indices, r, row_adapter, top_k=top_k, x_gather=x_gather, impl=impl,
            validate=validate), base_out, route)
    x_rows, n_slots = _check_common(fn, x, base_out, route, narrow_x=True)
    x_gather = _check_x_gather(fn, x_gather)
    validate = _check_validate(fn, validate)
    if not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"{fn}: top_k must be a positive int, got {top_k!r}")
    top_k = int(top_k)
    if n_slots % top_k:
        raise ValueError(f"{fn}: n_slots {n_slots} is not a multiple of top_k {top_k}")
    num_tokens = n_slots // top_k
    want_x = num_tokens if x_gather else n_slots
    if x_rows != want_x:
        raise ValueError(f"{fn}: x has {x_rows} rows; x_gather={x_gather} needs {want_x}")
    (ni,) = _int_array("indices", indices, allow_uint32=True)
    if ni != n_slots:
        raise ValueError(f"{fn}: indices has {ni} entries, base_out has {n_slots} rows")
    if row_adapter is not None:
        (nr,) = _int_array("row_adapter", row_adapter)
        if nr != num_tokens:
            raise ValueError(f"{fn}: row_adapter has {nr} entries, the batch has {num_tokens} tokens")
    impl = check_impl(impl)
    if jnp.dtype(indices.dtype) == jnp.uint32:
        indices = jax.lax.bitcast_convert_type(indices, jnp.int32)
    if validate:
        contract.check_gather_metadata(fn, route)
    return autodiff.gather_bgmv(x, base_out, indices, route, row_adapter, top_k=top_k,
                                x_gather=x_gather, impl=impl)


def fold_token_projections(x: jax.Array, bases: tuple[jax.Array, ...], topk_ids: jax.Array,
                           route: StackedRoute, row_adapter: jax.Array | None = None, *,
                           impl: Impl = "auto", validate: bool = False) -> tuple[jax.Array, ...]:
    """Fold ``S`` projections that read the same tokens (gate and up) in one
    gather fold, without copying ``x``.

    The rows of the ``S`` projections are interleaved per token, ``(t, s, k)``
    (one stacking of ``bases``, as ``jnp.stack`` would make), so that row ``r``
    still reads token ``r // (S * top_k)``; projection ``s``'s expert ``e`` is
    the virtual expert ``s * E_t + e`` of one route (``ops/batching.py``'s
    virtual experts). Bit-identical to :func:`moe_lora_gather_bgmv` with the
    ``StackedRoute`` and ``base_out`` stacked ``[S, T * top_k, n_out]``, which
    ``jax.vmap``s over ``S`` and so reads ``x`` broadcast to ``[S, T, k_in]``.

    Args:
      x: ``[T, k_in]`` tokens.
      bases: ``S`` arrays ``[T * top_k, n_out]``, flat token-major rows.
      topk_ids: int32 (or uint32) ``[T, top_k]`` expert ids.
      route: the ``S`` projections' ``StackedRoute``.
      row_adapter, impl, validate: as for :func:`moe_lora_gather_bgmv`.

    Returns:
      ``S`` arrays ``[T * top_k, n_out]``: each base with its projection folded.
    """
    fn = "fold_token_projections"
    if not isinstance(route, StackedRoute):
        raise TypeError(f"{fn}: route must be a StackedRoute, got {type(route).__name__}")
    S = route.num_routes
    bases = tuple(bases)
    if len(bases) != S:
        raise ValueError(f"{fn}: {len(bases)} bases for a StackedRoute of {S} routes")
    ts = _shape("topk_ids", topk_ids)
    if len(ts) != 2 or ts[1] < 1:
        raise ValueError(f"{fn}: topk_ids must be [T, top_k], got shape {ts}")
    _int_array("topk_ids", topk_ids, ndim=2, allow_uint32=True)
    t, k = ts
    first = _shape("bases[0]", bases[0])
    for i, b in enumerate(bases):
        bs = _shape(f"bases[{i}]", b)
        if len(bs) != 2 or bs[0] != t * k or bs != first or b.dtype != bases[0].dtype:
            raise ValueError(f"{fn}: bases[{i}] is {b.dtype}{list(bs)}; every base must be "
                             f"[T * top_k, n_out] = [{t * k}, n_out] of one shape and dtype")
    if _check_validate(fn, validate):
        for s in range(S):
            contract.check_gather_metadata(fn, route.route(s))
    E = route.n_experts
    ids = topk_ids
    if jnp.dtype(ids.dtype) == jnp.uint32:
        ids = jax.lax.bitcast_convert_type(ids, jnp.int32)
    ids = virtual_ids(ids.astype(jnp.int32)[:, None, :],                      # [T, S, k]
                      jnp.arange(S, dtype=jnp.int32)[None, :, None], E)
    n = bases[0].shape[-1]
    # [T, S, k, N] written as a select on the member index, which XLA emits as
    # one loop fusion with the producers of the bases (a concatenate gets its
    # own, slower, emitter)
    member = jax.lax.broadcasted_iota(jnp.int32, (t, S, k, n), 1)
    base = jnp.broadcast_to(bases[-1].reshape(t, 1, k, n), (t, S, k, n))
    for s in range(S - 2, -1, -1):
        base = jnp.where(member == s, bases[s].reshape(t, 1, k, n), base)
    out = moe_lora_gather_bgmv(x, base.reshape(t * S * k, n), ids.reshape(-1),
                               route.virtual(), row_adapter, top_k=S * k, x_gather=1,
                               impl=impl)
    out = out.reshape(t, S, k, n)
    return tuple(out[:, s].reshape(t * k, n) for s in range(S))


def moe_lora_grouped_down(x: jax.Array, base_out: jax.Array, expert_offsets: jax.Array,
                          sorted_token_ids: jax.Array, route: MoeExpertRoute,
                          row_adapter: jax.Array | None = None, *, row_offset: int = 0,
                          row_end: int | None = None, x_gather: int,
                          impl: Impl = "auto", validate: bool = False) -> jax.Array:
    """Fold the expert-sorted rows ``r`` in ``[row_offset, row_end)``.

    Args:
      x: ``[te, k_in]`` sorted (``x_gather=0``: row ``r`` read) or
        ``[num_tokens, k_in]`` (``x_gather=1``: row ``sorted_token_ids[r]``),
        in ``base_out``'s dtype, or bf16/f16 with float32 pools (widened
        first).
      base_out: ``[te, n_out]`` in sorted order.
      expert_offsets: int32 ``[num_experts + 1]`` prefix sums, well formed
        when ``0 <= o[0] <= ... <= o[-1] <= te``: expert ``e`` owns sorted
        rows ``expert_offsets[e] .. expert_offsets[e+1]``;
        ``num_experts >= route.n_experts``. Rows in no span fold nothing;
        offsets that are not well formed fold no row at all
        (docs/malformed_metadata.md).
      sorted_token_ids: int32 ``[te]``, the token of each sorted row (a
        token outside ``[0, num_tokens)`` folds nothing where it is read).
      route: the projection's ``MoeExpertRoute``, or a ``StackedRoute`` (then
        ``base_out`` and the result are ``[S, te, n_out]``).
      row_adapter: int32 ``[num_tokens]``, read at ``sorted_token_ids[r]``
        (a token outside it folds nothing), or ``None``.
      row_offset, row_end: the window (static ints; default all rows). A
        row's result does not depend on the window that holds it.
      x_gather: 0 or 1 (a static int), see ``x``.
      impl: backend, see the module docstring.
      validate: when True, a breach of docs/malformed_metadata.md (offsets
        not well formed, a token outside its bound in the window, a table
        cell outside the pool) raises instead of the documented skip:
        eagerly ``checkify.JaxRuntimeError``; under ``jit`` wrap the caller
        in ``jax.experimental.checkify.checkify``.

    Returns:
      ``[te, n_out]``: ``base_out`` with the window's adapted rows folded.
    """
    return _grouped_down(x, base_out, expert_offsets, sorted_token_ids, route, row_adapter,
                         row_offset=row_offset, row_end=row_end, x_gather=x_gather, impl=impl,
                         validate=validate)


def _grouped_down(x, base_out, expert_offsets, sorted_token_ids, route, row_adapter=None, *,
                  row_offset: int = 0, row_end: int | None = None, x_gather: int,
                  impl: Impl = "auto", validate: bool = False,
                  out_rows: jax.Array | None = None) -> jax.Array:
    """``moe_lora_grouped_down`` with the internal output-row index.

    ``out_rows``: ``None`` (sorted row ``r`` reads and writes ``base_out[r]``;
    ``base_out`` is ``[te, n_out]``), or int32 ``[te]``: sorted row ``r``
    reads and writes ``base_out[out_rows[r]]`` (``base_out`` is ``[M, n_out]``
    for any ``M``) and folds nothing when ``out_rows[r]`` lies outside
    ``[0, M)``. The targets of the rows that fold must be distinct
    (``moe_lora_fold`` passes a permutation), which is why this index is not
    public: repeated targets would make the result depend on the order the
    rows are folded in (docs/semantics.md §5).
    """
    fn = "moe_lora_grouped_down"
    if isinstance(route, StackedRoute):
        return fold_stacked(fn, lambda b, r: _grouped_down(
            x, b, expert_offsets, sorted_token_ids, r, row_adapter, row_offset=row_offset,
            row_end=row_end, x_gather=x_gather, impl=impl, validate=validate,
            out_rows=out_rows), base_out, route)
    x_rows, m = _check_common(fn, x, base_out, route, narrow_x=True)
    x_gather = _check_x_gather(fn, x_gather)
    validate = _check_validate(fn, validate)
    (no,) = _int_array("expert_offsets", expert_offsets)
    if no < route.n_experts + 1:
        raise ValueError(f"{fn}: expert_offsets has {no} entries; the route's "
                         f"{route.n_experts} experts need at least {route.n_experts + 1}")
    (te,) = _int_array("sorted_token_ids", sorted_token_ids)
    if out_rows is None and te != m:
        raise ValueError(f"{fn}: sorted_token_ids has {te} entries, base_out has {m} rows")
    if out_rows is not None and _int_array("out_rows", out_rows) != (te,):
        raise ValueError(f"{fn}: out_rows has {out_rows.shape[0]} entries, sorted_token_ids "
                         f"has {te}")
    check_rows(fn, "sorted_token_ids", te)
    if not x_gather and x_rows != te:
        raise ValueError(f"{fn}: x has {x_rows} rows; x_gather=0 needs one per sorted row ({te})")
    if x_gather and x_rows == 0:
        raise ValueError(f"{fn}: x has no rows")
    if row_adapter is not None:
        (nr,) = _int_array("row_adapter", row_adapter)
        if nr == 0:
            raise ValueError(f"{fn}: row_adapter is empty")
        if x_gather and nr != x_rows:
            raise ValueError(f"{fn}: row_adapter has {nr} entries but x has {x_rows} tokens")
    row_end = te if row_end is None else row_end
    for name, v in (("row_offset", row_offset), ("row_end", row_end)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise TypeError(f"{fn}: {name} must be a static int, got {type(v).__name__}")
    row_offset, row_end = int(row_offset), int(row_end)
    if not 0 <= row_offset <= row_end <= te:
        raise ValueError(f"{fn}: window [{row_offset}, {row_end}) is not inside [0, {te}]")
    impl = check_impl(impl)
    if validate:
        num_tokens = x_rows if x_gather else (None if row_adapter is None
                                              else row_adapter.shape[0])
        contract.check_grouped_metadata(fn, expert_offsets, sorted_token_ids, route,
                                        num_tokens=num_tokens, row_offset=row_offset,
                                        row_end=row_end)
    if row_offset == row_end:
        return base_out
    # The grouped kernels read x in the pools' dtype: widen a bf16/f16 x
    # first (exact, so the gather fold's bits).
    return autodiff.grouped_down(x.astype(base_out.dtype), base_out, expert_offsets,
                                 sorted_token_ids, route, row_adapter, out_rows,
                                 row_offset=row_offset, row_end=row_end, x_gather=x_gather,
                                 impl=impl)


def sort_rows_by_expert(topk_ids: jax.Array, n_experts: int,
                        row_adapter: jax.Array | None = None, num_adapters: int = 0):
    """Stable sort of the flat rows of ``topk_ids [T, top_k]`` by expert id
    and, with ``row_adapter``, by adapter within each expert.

    Args:
      topk_ids: int32 ``[T, top_k]`` expert ids.
      n_experts: the experts the offsets cover.
      row_adapter: optional int ``[T]``, each token's adapter slot. Within an
        expert the rows are then grouped by the table row they fold with
        (docs/semantics.md §3): the rows that fold nothing (a slot < 0, or
        ``>= num_adapters`` when that is above 1) first, then row 0, 1, ...;
        so that a tile of the grouped fold holds few (adapter, expert) cells
        and the backward finds each cell's rows together. The experts' spans
        are the same either way.
      num_adapters: the adapter slots (the route's ``max_loras``, L).

    Returns ``(order, expert_offsets, sorted_token_ids)``: ``order [n_slots]``
    maps sorted row -> flat row; ``expert_offsets`` int32 ``[n_experts + 1]``
    (ids outside ``[0, n_experts)`` land outside every span);
    ``sorted_token_ids = order // top_k``. Traced jnp, no host sync.
    """
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    if not isinstance(num_adapters, (int, np.integer)) or num_adapters < 0:
        raise ValueError(f"sort_rows_by_expert: num_adapters must be an int >= 0, got "
                         f"{num_adapters!r}")
    if row_adapter is not None:
        ra_shape = _shape("row_adapter", row_adapter)
        if ra_shape != (topk_ids.shape[0],):
            raise ValueError(f"sort_rows_by_expert: row_adapter must be [T] = "
                             f"[{topk_ids.shape[0]}] (one slot a token), got shape {ra_shape}")
        if not jnp.issubdtype(jnp.dtype(row_adapter.dtype), jnp.integer):
            raise TypeError(f"sort_rows_by_expert: row_adapter must be integers, got "
                            f"{row_adapter.dtype}")
    m = int(num_adapters) + 1  # keys per expert: base rows, then each slot
    if row_adapter is None or m < 2 or (n_experts + 2) * m >= 2**31:
        key, bounds = flat, jnp.arange(n_experts + 1, dtype=jnp.int32)
    else:
        ra = jnp.asarray(row_adapter).astype(jnp.int32)
        # with one table row every slot >= 0 folds with it
        row = jnp.minimum(ra, 0) if num_adapters == 1 else ra
        slot = jnp.where((row >= 0) & (row < num_adapters), row + 1, 0)
        # ids outside [0, n_experts) keep sorting before or after every span
        e = jnp.clip(flat, -1, n_experts)
        # a static repeat count: a broadcast (total_repeat_length would take
        # jnp.repeat's general path, two cumsums and a scatter)
        key = e * m + jnp.repeat(slot, top_k)
        bounds = jnp.arange(n_experts + 1, dtype=jnp.int32) * m
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    offsets = searchsorted(key[order], bounds, side="left")
    return order, offsets, order // top_k


class RowPlan(NamedTuple):
    """The row order ``moe_lora_fold`` folds a batch in, shared by every fold of a layer.

    ``grouped`` (a Python bool) says which fold runs: ``False``, the gather
    fold on flat token-major rows ``t * top_k + k``; ``True``, the grouped
    fold on rows stably sorted by expert (and by adapter within an expert
    when the plan was made with the rows' adapters). For a grouped plan
    ``order [n_slots]`` (sorted row -> flat row), ``expert_offsets
    [num_experts + 1]`` and ``sorted_token_ids [n_slots]`` are
    ``sort_rows_by_expert``'s; for a gather plan they are ``None``.
    ``topk_ids`` is the int32 ``[T, top_k]`` the plan was made from.
    """

    grouped: bool
    topk_ids: jax.Array
    order: jax.Array | None = None
    expert_offsets: jax.Array | None = None
    sorted_token_ids: jax.Array | None = None

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[1]

    def row_experts(self) -> jax.Array:
        """int32 ``[n_slots]``: the expert id of each row, in plan order."""
        flat = self.topk_ids.reshape(-1)
        return flat[self.order] if self.grouped else flat

    def _inverse(self) -> jax.Array:
        """int32 ``[n_slots]``: flat row -> sorted row, the inverse of ``order``."""
        n = self.order.shape[0]
        return jnp.zeros_like(self.order).at[self.order].set(jnp.arange(n, dtype=jnp.int32))

    def to_plan_order(self, rows: jax.Array) -> jax.Array:
        """Flat token-major rows ``[n_slots, ...]`` -> plan order."""
        return _permute_rows(rows, self.order, self._inverse()) if self.grouped else rows

    def to_flat_order(self, rows: jax.Array) -> jax.Array:
        """Rows in plan order ``[n_slots, ...]`` -> flat token-major order."""
        if not self.grouped:
            return rows
        return _permute_rows(rows, self._inverse(), self.order)


def plan_rows(topk_ids: jax.Array, num_experts: int, *,
              gather_max_rows: int | None = None, row_adapter: jax.Array | None = None,
              num_adapters: int = 0) -> RowPlan:
    """The plan ``moe_lora_fold`` uses for ``topk_ids`` (int32 ``[T, top_k]``).

    Batches of at most ``gather_rows_limit(num_experts, gather_max_rows)``
    flat rows keep flat order (gather fold); larger ones are sorted by expert
    over ``num_experts`` experts, and within an expert by ``row_adapter``'s
    slot when it is given (:func:`sort_rows_by_expert`; traced jnp, no host
    sync). ``num_experts``
    must cover every route folded with the plan (``>= route.n_experts``)."""
    n_slots = topk_ids.shape[0] * topk_ids.shape[1]
    if n_slots <= gather_rows_limit(num_experts, gather_max_rows):
        return RowPlan(False, topk_ids)
    order, offsets, sorted_tok = sort_rows_by_expert(topk_ids, num_experts, row_adapter,
                                                     num_adapters)
    return RowPlan(True, topk_ids, order, offsets, sorted_tok)


def fold_planned(x: jax.Array, base_out: jax.Array, plan: RowPlan,
                 route: MoeExpertRoute | StackedRoute, row_adapter: jax.Array | None = None, *,
                 x_gather: int, impl: Impl = "auto", validate: bool = False) -> jax.Array:
    """Fold rows kept in ``plan``'s order: the gather fold for a flat plan, the
    grouped fold for a sorted one.

    Args:
      x: ``[T, k_in]`` (``x_gather=1``) or ``[T * top_k, k_in]`` in plan
        order (``x_gather=0``).
      base_out: ``[T * top_k, n_out]`` in plan order (``[S, T * top_k, n_out]``
        with a ``StackedRoute`` of ``S`` projections: one launch).
      plan: from :func:`plan_rows`.
      route, row_adapter, impl, validate: as for ``moe_lora_gather_bgmv``.

    Returns:
      ``[T * top_k, n_out]`` (or ``[S, T * top_k, n_out]``) in plan order.
    """
    if plan.grouped:
        if plan.expert_offsets.shape[0] < route.n_experts + 1:
            raise ValueError(f"fold_planned: the plan sorts {plan.expert_offsets.shape[0] - 1} "
                             f"experts, the route has {route.n_experts}")
        return moe_lora_grouped_down(x, base_out, plan.expert_offsets, plan.sorted_token_ids,
                                     route, row_adapter, x_gather=x_gather, impl=impl,
                                     validate=validate)
    return moe_lora_gather_bgmv(x, base_out, plan.topk_ids.reshape(-1), route, row_adapter,
                                top_k=plan.top_k, x_gather=x_gather, impl=impl,
                                validate=validate)


def moe_lora_fold(x: jax.Array, base_out: jax.Array, topk_ids: jax.Array, route: MoeExpertRoute,
                  row_adapter: jax.Array | None = None, *, x_gather: int,
                  impl: Impl = "auto", gather_max_rows: int | None = None,
                  validate: bool = False) -> jax.Array:
    """Fold a layer's rows, choosing the gather fold or sort-then-grouped by size.

    Args:
      x: ``[T * top_k, k_in]`` (``x_gather=0``) or ``[T, k_in]`` (``x_gather=1``),
        in ``base_out``'s dtype, or bf16/f16 with float32 pools.
      base_out: ``[T * top_k, n_out]`` in flat token-major row order.
      topk_ids: int32 ``[T, top_k]`` expert ids.
      route, row_adapter, impl, validate: as for ``moe_lora_gather_bgmv`` (a
        ``StackedRoute`` takes and returns ``[S, T * top_k, n_out]``).
      gather_max_rows: batches of at most this many flat rows take the gather
        fold (None: :func:`gather_rows_limit` of ``route.n_experts``); larger
        ones are sorted by expert and adapter (stable, traced jnp) and folded
        by the grouped fold, whose sorted rows read ``x`` and read and write
        ``base_out`` in place through the sort's order
        (no row is copied into sorted order or back). Both give the same
        bits, except with ``impl="fast"`` (decode rows on CUDA cores, sorted
        rows on the tensor cores: other fp32 summation orders, same skipped
        rows).

    Returns:
      ``[T * top_k, n_out]`` in flat row order.
    """
    if isinstance(route, StackedRoute):
        return fold_stacked("moe_lora_fold", lambda b, r: moe_lora_fold(
            x, b, topk_ids, r, row_adapter, x_gather=x_gather, impl=impl,
            gather_max_rows=gather_max_rows, validate=validate), base_out, route)
    ts = _shape("topk_ids", topk_ids)
    if len(ts) != 2:
        raise ValueError(f"moe_lora_fold: topk_ids must be [T, top_k], got shape {ts}")
    top_k = ts[1]
    if top_k < 1:
        raise ValueError("moe_lora_fold: topk_ids has no slots")
    _int_array("topk_ids", topk_ids, ndim=2, allow_uint32=True)
    if jnp.dtype(topk_ids.dtype) == jnp.uint32:
        topk_ids = jax.lax.bitcast_convert_type(topk_ids, jnp.int32)
    n_slots = ts[0] * top_k
    check_rows("moe_lora_fold", "base_out", n_slots)
    bs = _shape("base_out", base_out)
    if len(bs) != 2 or bs[0] != n_slots:
        raise ValueError(f"moe_lora_fold: base_out must be [T * top_k = {n_slots}, n_out], got {bs}")
    # The sort path's gathers would hide a wrong x or row_adapter length: check here.
    x_gather = _check_x_gather("moe_lora_fold", x_gather)
    xs, want_x = _shape("x", x), ts[0] if x_gather else n_slots
    if len(xs) != 2 or xs[0] != want_x:
        raise ValueError(f"moe_lora_fold: x must be [{want_x}, k_in] with x_gather={x_gather}, "
                         f"got {xs}")
    if row_adapter is not None and _int_array("row_adapter", row_adapter)[0] != ts[0]:
        raise ValueError(f"moe_lora_fold: row_adapter has {row_adapter.shape[0]} entries, the "
                         f"batch has {ts[0]} tokens")
    plan = plan_rows(topk_ids, route.n_experts, gather_max_rows=gather_max_rows,
                     row_adapter=row_adapter, num_adapters=route.max_loras)
    if not plan.grouped:
        return fold_planned(x, base_out, plan, route, row_adapter, x_gather=x_gather, impl=impl,
                            validate=validate)
    # The sorted rows index base_out (and x [T * top_k, k_in] with x_gather=0,
    # read as a gather of one "token" per flat row) through plan.order: no
    # row is copied into sorted order and back.
    if x_gather:
        tokens, ra = plan.sorted_token_ids, row_adapter
    else:
        tokens = plan.order
        ra = None if row_adapter is None else jnp.repeat(row_adapter, top_k)
    return _grouped_down(x, base_out, plan.expert_offsets, tokens, route, ra, x_gather=1,
                         impl=impl, validate=validate, out_rows=plan.order)


def _take_rows(v, rows):
    return jnp.take(v, rows, axis=0, mode="clip")


@jax.custom_vjp
def _permute_rows(v: jax.Array, perm: jax.Array, inverse: jax.Array) -> jax.Array:
    """``v[perm]`` for a permutation ``perm`` of v's rows (``inverse`` its
    inverse). Its gradient takes the cotangent's rows by ``inverse``: the
    same values as the scatter-add of ``v[perm]``'s gradient, as a gather."""
    return _take_rows(v, perm)


def _permute_rows_fwd(v, perm, inverse):
    return _take_rows(v, perm), inverse


def _permute_rows_bwd(inverse, g):
    return _take_rows(g, inverse), None, None


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)
