"""``moe_lora_fold`` at prefill: the sorted rows index ``base_out`` (and ``x``)
through the sort (docs/semantics.md §5, docs/design.md).

Above ``gather_max_rows`` flat rows the fold sorts the rows by expert and
adapter and runs the grouped fold, whose sorted row ``r`` reads ``x`` and
reads and writes ``base_out`` at flat row ``plan.order[r]``: nothing is
copied into sorted order or back. The contract:

- the result is the gather fold's (bit for bit, except ``fast``, which sums
  sorted rows on the tensor cores) and the float64 reference's, for both
  layouts of ``x``, with and without a row-adapter map, for a
  ``StackedRoute``, under ``vmap`` and ``grad``;
- the jitted program holds no gather or scatter of ``base_out``-sized (or,
  with ``x_gather=0``, ``x``-sized) arrays;
- the grouped fold's internal output-row index: a sorted row whose target
  lies outside ``base_out``'s rows folds nothing, rows no folding row targets
  come back bit-identical, and a row gets the bits it gets without the
  index, on every backend.
"""

from __future__ import annotations

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _fold_cases import (DTYPE_IDS, DTYPES, INT32_MAX, INT32_MIN, bits, check_fold,
                         concrete_impl, is_ulp_strict, make_gather_case, make_grouped_case,
                         make_route, on_platform, to_device)
from _transform_cases import make_case
from jax_moelora import moe_lora_fold, stack_routes
from jax_moelora.ops import autodiff, folds, jnp_fold
from jax_moelora.ops.folds import fold_planned, gather_rows_limit, plan_rows

GPU = pytest.mark.gpu
CUDA_IMPLS = [pytest.param("simple", marks=GPU), pytest.param("fast", marks=GPU)]
IMPLS = ["cpu", "jnp", *CUDA_IMPLS]
FFI_IMPLS = ["cpu", *CUDA_IMPLS]  # the custom calls (jnp may gather and scatter rows)

impls = pytest.mark.parametrize("impl", IMPLS)
x_gathers = pytest.mark.parametrize("x_gather", [0, 1], ids=["xg0", "xg1"])
maps = pytest.mark.parametrize("with_map", [False, True], ids=["no_map", "map"])

# Prefill sizes: several 64-row tiles of the sorted rows, forced onto the
# sorted path with a small gather_max_rows.
TOKENS, TOP_K, GATHER_MAX_ROWS = 160, 4, 64


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _prefill_case(rng, **kw):
    kw.setdefault("n_experts", 8)
    return make_gather_case(rng, op="fold", num_tokens=TOKENS, top_k=TOP_K, **kw)


def _same_as_gather_fold(case, impl, sorted_, gathered):
    """The sorted path gives the gather fold's bits (``fast``: the same skipped
    rows, both within the reference's tolerance)."""
    if concrete_impl(impl) == "fast" and case.dtype != jnp.dtype(jnp.float32):
        np.testing.assert_array_equal(bits(sorted_[~case.fold_rows]),
                                      bits(gathered[~case.fold_rows]))
    else:
        np.testing.assert_array_equal(bits(sorted_), bits(gathered))


# ----------------------------------------------------------- moe_lora_fold at prefill

@maps
@x_gathers
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@impls
def test_prefill_fold_equals_gather_fold_and_reference(rng, impl, dtype, x_gather, with_map):
    case = _prefill_case(rng, dtype=dtype, num_loras=4, x_gather=x_gather, row_adapter=with_map)
    sorted_ = case.run(impl, gather_max_rows=GATHER_MAX_ROWS)
    _same_as_gather_fold(case, impl, sorted_, case.run(impl))
    check_fold(case, sorted_, strict=is_ulp_strict(impl))


@x_gathers
@impls
def test_prefill_fold_of_a_stacked_route_equals_single_folds(rng, impl, x_gather):
    common = dict(dtype=jnp.bfloat16, num_loras=2, n_experts=8, pool_size=2 * 8 + 3)
    case = _prefill_case(rng, x_gather=x_gather, **common)
    routes = [case.route, make_route(rng, **common)]
    bases = np.stack([case.base_out, rng.normal(size=case.base_out.shape).astype(case.dtype)])
    with on_platform(impl):
        x, ids, ra = to_device((case.x, case.ids["topk_ids"], case.row_adapter))
        rs = [to_device(r) for r in routes]
        fold = lambda b, r: moe_lora_fold(x, b, ids, r, ra, x_gather=x_gather, impl=impl,  # noqa: E731
                                          gather_max_rows=GATHER_MAX_ROWS)
        got = np.asarray(jax.jit(fold)(jnp.asarray(bases), stack_routes(*rs)))
        for s in range(2):
            want = np.asarray(jax.jit(fold)(jnp.asarray(bases[s]), rs[s]))
            assert (bits(want) != bits(bases[s])).any(), "a projection folded nothing"
            np.testing.assert_array_equal(bits(got[s]), bits(want))


def _hlo_ops_of_shape(fn, args, ops: tuple[str, ...], shape: tuple[int, ...]) -> int:
    """The ops named ``ops`` in ``fn``'s lowered StableHLO whose result is an
    array of ``shape``."""
    text = jax.jit(fn).lower(*args).as_text()
    dims = "x".join(map(str, shape))
    names = "|".join(re.escape(f"stablehlo.{op}") for op in ops)
    return len(re.findall(rf"(?:{names}).*-> tensor<{dims}x[a-z0-9]+>$", text, re.M))


@x_gathers
@pytest.mark.parametrize("impl", FFI_IMPLS)
def test_prefill_fold_moves_no_base_out_rows(rng, impl, x_gather):
    """The jitted sorted path holds no gather, scatter or dynamic slice whose
    result has base_out's shape (nor, with x_gather=0, x's): the grouped fold
    indexes the flat rows in place. The same count finds the copies of a fold
    that sorts base_out (and x) and unsorts the result."""
    case = _prefill_case(rng, num_loras=2, x_gather=x_gather)
    n_slots, n_out, k_in = case.base_out.shape + (case.x.shape[1],)
    assert len({n_out, k_in, TOKENS}) == 3 and n_slots not in (n_out, k_in)
    moves = ("gather", "scatter", "dynamic_slice", "dynamic_update_slice", "concatenate")

    def copying(x, base, ids, route, ra):  # sort, fold in sorted order, unsort
        plan = plan_rows(ids, route.n_experts, gather_max_rows=0, row_adapter=ra,
                         num_adapters=route.max_loras)
        xs = x if x_gather else plan.to_plan_order(x)
        return plan.to_flat_order(fold_planned(xs, plan.to_plan_order(base), plan, route, ra,
                                               x_gather=x_gather, impl=impl))

    with on_platform(impl):
        args = to_device(case.operands())
        fold = case.fn(impl, gather_max_rows=GATHER_MAX_ROWS)
        for shape in [(n_slots, n_out)] + ([] if x_gather else [(n_slots, k_in)]):
            assert _hlo_ops_of_shape(copying, args, moves, shape) >= 1  # the count can fail
            assert _hlo_ops_of_shape(fold, args, moves, shape) == 0, shape


@x_gathers
@pytest.mark.parametrize("impl", FFI_IMPLS)
def test_prefill_fold_under_vmap_equals_a_loop(rng, impl, x_gather):
    """vmap of the sorted path over examples with their own base_out, x and
    ids: each example's rows are folded into its own base_out rows (one
    launch; bits of a loop of unbatched folds)."""
    cases = [_prefill_case(rng, num_loras=2, x_gather=x_gather) for _ in range(3)]
    st = [np.stack(v) for v in zip(*(c.operands()[:3] for c in cases))]
    ra = cases[0].row_adapter
    fold = lambda x, b, ids, r: moe_lora_fold(x, b, ids, r, ra, x_gather=x_gather,  # noqa: E731
                                              impl=impl, gather_max_rows=GATHER_MAX_ROWS)
    with on_platform(impl):
        x, base, ids, route = to_device((*st, cases[0].route))
        got = np.asarray(jax.jit(jax.vmap(fold, in_axes=(0, 0, 0, None)))(x, base, ids, route))
        text = jax.jit(jax.vmap(fold, in_axes=(0, 0, 0, None))).lower(x, base, ids, route).as_text()
        assert text.count("stablehlo.custom_call @moe_lora") == 1
        for i in range(3):
            want = np.asarray(jax.jit(fold)(x[i], base[i], ids[i], route))
            assert (bits(want) != bits(base[i])).any()
            np.testing.assert_array_equal(bits(got[i]), bits(want))


@maps
@x_gathers
@pytest.mark.parametrize("impl", ["cpu", "jnp", *CUDA_IMPLS])
def test_prefill_fold_grads_equal_autodiff_of_the_jnp_gather_fold(impl, x_gather, with_map):
    """jax.grad of the sorted path (f32) equals autodiff of the pure-JAX gather
    fold: the cotangent of sorted row r is that of flat row plan.order[r]."""
    rng = np.random.default_rng(40 + 2 * x_gather + with_map)
    case = make_case(rng, T=40, top_k=3, x_gather=x_gather, with_row_adapter=with_map)
    w = jnp.asarray(rng.normal(size=case.base_out.shape), jnp.float32)

    def loss(fold):
        def f(x, base, a_pool, b_pool, scale):
            route = case.route.replace(a_pool=a_pool, b_pool=b_pool, scale_table=scale)
            return jnp.sum(fold(x, base, route).astype(jnp.float32) * w)
        return f

    sorted_fold = lambda x, b, r: moe_lora_fold(  # noqa: E731
        x, b, case.topk_ids, r, case.row_adapter, x_gather=x_gather, impl=impl,
        gather_max_rows=16)
    ref_fold = lambda x, b, r: jnp_fold.gather_bgmv_jnp(  # noqa: E731
        x, b, case.topk_ids.reshape(-1), r, case.row_adapter, top_k=case.top_k,
        x_gather=x_gather)
    r = case.route
    args = (case.x, case.base_out, r.a_pool, r.b_pool, r.scale_table)
    with on_platform(impl):
        got = jax.jit(jax.grad(loss(sorted_fold), argnums=range(5)))(*args)
        want = jax.jit(jax.grad(loss(ref_fold), argnums=range(5)))(*args)
    for name, g, ref in zip(("x", "base_out", "a_pool", "b_pool", "scale_table"), got, want):
        g, ref = np.asarray(g, np.float64), np.asarray(ref, np.float64)
        assert np.abs(ref).max() > 0, name
        assert np.abs(g - ref).max() <= 1e-5 * np.abs(ref).max(), name


# ------------------------------------------------ the grouped fold's output-row index

def _scattered(rng, case, extra_rows: int = 5):
    """The case's sorted rows placed at distinct random rows of a base_out of
    ``te + extra_rows`` rows (the others poisoned: -0.0 and NaN), some sorted
    rows given targets outside it. Returns ``(out_rows, base, valid)``."""
    te, n = case.base_out.shape
    m = te + extra_rows
    out_rows = rng.permutation(m)[:te].astype(np.int64)
    folds = np.nonzero(case.fold_rows)[0]
    bad = rng.choice(folds, min(5, folds.size - 1), replace=False)  # keep one row folding
    out_rows[bad] = rng.choice([-1, m, m + 7, INT32_MIN, INT32_MAX], bad.size)
    valid = (out_rows >= 0) & (out_rows < m)
    base = rng.normal(size=(m, n)).astype(case.dtype)
    base[out_rows[valid]] = case.base_out[valid]
    untargeted = np.setdiff1d(np.arange(m), out_rows[valid])
    assert untargeted.size >= extra_rows
    base[untargeted, 0] = -0.0
    base[untargeted, 1] = np.nan
    return out_rows.astype(np.int32), base, valid


@x_gathers
@maps
@impls
def test_out_rows_fold_each_sorted_row_into_its_target_and_skip_the_rest(rng, impl, x_gather,
                                                                          with_map):
    case = make_grouped_case(rng, num_loras=2, x_gather=x_gather, row_adapter=with_map)
    out_rows, base, valid = _scattered(rng, case)
    identity = case.run(impl)  # the sorted rows folded in place, row r into row r
    with on_platform(impl):
        x, _, offsets, stid, route, ra = to_device(case.operands())
        got = np.asarray(jax.jit(lambda b, o: folds._grouped_down(
            x, b, offsets, stid, route, ra, x_gather=x_gather, impl=impl, out_rows=o))(
                jnp.asarray(base), jnp.asarray(out_rows)))
    want = base.copy()
    want[out_rows[valid]] = identity[valid]
    np.testing.assert_array_equal(bits(got), bits(want))
    assert (case.fold_rows & valid).any() and (case.fold_rows & ~valid).any()


def test_out_rows_is_not_public():
    """Targets that repeat would make the result depend on the fold order:
    the public grouped fold and fold_planned take no output-row index."""
    import inspect

    from jax_moelora import moe_lora_grouped_down

    for fn in (moe_lora_grouped_down, fold_planned, autodiff.grouped_down):
        assert ("out_rows" in inspect.signature(fn).parameters) is (fn is autodiff.grouped_down)


@pytest.mark.parametrize("num_experts, gather_max_rows, n_rows, grouped", [
    (128, None, 96 * 128, False),   # Qwen3: up to 96 rows an expert on average
    (128, None, 96 * 128 + 8, True),
    (64, None, 96 * 64, False),     # DeepSeek-V2-Lite
    (8, None, 2048, False),         # Mixtral: the 2,048-row floor
    (8, None, 2056, True),
    (128, 0, 8, True),              # an explicit limit replaces the rule
    (8, 4096, 4096, False),
])
def test_which_fold_runs(num_experts, gather_max_rows, n_rows, grouped):
    """docs/design.md, "Which fold runs": the gather fold up to
    ``max(GATHER_MAX_ROWS, GATHER_ROWS_PER_EXPERT * E)`` flat rows, or up to
    ``gather_max_rows`` when it is given; the grouped fold above."""
    assert (folds.GATHER_MAX_ROWS, folds.GATHER_ROWS_PER_EXPERT) == (2048, 96)
    top_k = 8
    ids = jnp.zeros((n_rows // top_k, top_k), jnp.int32)
    plan = plan_rows(ids, num_experts, gather_max_rows=gather_max_rows)
    assert plan.grouped is grouped
    limit = gather_rows_limit(num_experts, gather_max_rows)
    assert (n_rows > limit) is grouped


@pytest.mark.parametrize("bad", [2.0, True, "8"])
def test_gather_max_rows_must_be_an_int_or_none(bad):
    with pytest.raises(TypeError, match="gather_max_rows must be an int or None"):
        plan_rows(jnp.zeros((4, 2), jnp.int32), 8, gather_max_rows=bad)
