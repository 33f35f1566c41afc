"""Projections that share ``x`` and routing, folded in one launch
(``StackedRoute``, ``ops/stacked.py``).

The contract: a fold with ``stack_routes(r_0, ..., r_{S-1})`` and
``base_out [S, rows, N]`` equals the ``S`` single-route folds (bit for bit for
the custom calls; ``jnp`` may sum in another order under ``jit``), and it is
one custom call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from _fold_cases import (DTYPE_IDS, DTYPES, make_gather_case, make_route, on_platform,
                         to_device)
from jax_moelora import (StackedRoute, backends, moe_lora_fold, moe_lora_gather_bgmv,
                         moe_lora_grouped_down, sort_rows_by_expert, stack_routes)
from jax_moelora.ops.folds import fold_token_projections

IMPLS = backends()["impls"]
S = 2


def _stacked_case(rng, dtype, num_loras, x_gather, top_k=4, num_tokens=24):
    routes = [make_route(rng, dtype=dtype, num_loras=num_loras, pool_size=40, poison=False)
              for _ in range(S)]
    case = make_gather_case(rng, route=routes[0], top_k=top_k, num_tokens=num_tokens,
                            x_gather=x_gather, poison=False)
    bases = np.stack([case.base_out] + [rng.normal(size=case.base_out.shape).astype(case.dtype)
                                        for _ in range(S - 1)])
    return case, routes, bases


def _check(got, want, impl):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if impl == "jnp":
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("x_gather", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_stacked_gather_equals_single_folds(impl, dtype, x_gather):
    rng = np.random.default_rng(11)
    case, routes, bases = _stacked_case(rng, dtype, 3, x_gather)
    with on_platform(impl):
        x, idx, ra = to_device((case.x, case.ids["indices"], case.row_adapter))
        rs = [to_device(r) for r in routes]
        fold = lambda b, r: moe_lora_gather_bgmv(x, b, idx, r, ra, top_k=4, x_gather=x_gather,
                                                 impl=impl)
        stacked = stack_routes(*rs)
        got = jax.jit(fold)(jnp.asarray(bases), stacked)
        want = [fold(jnp.asarray(bases[s]), rs[s]) for s in range(S)]
        for s in range(S):
            _check(got[s], want[s], impl)
        if impl != "jnp":
            text = str(jax.make_jaxpr(fold)(jnp.asarray(bases), stacked))
            assert text.count("ffi_call") == 1


@pytest.mark.parametrize("ids_dtype", ["int32", "uint32"])
@pytest.mark.parametrize("with_map", [True, False], ids=["map", "nomap"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_token_projections_equal_single_folds(impl, dtype, with_map, ids_dtype):
    """fold_token_projections (the block's decode gate+up: rows interleaved
    per token, one launch, x read in place) gives each projection the bits
    of its own fold, expert ids outside the table included (skipped)."""
    rng = np.random.default_rng(13)
    case, routes, bases = _stacked_case(rng, dtype, 3, 1)
    topk = case.ids["indices"].reshape(24, 4).astype(np.int64)
    e_t = routes[0].a_table.shape[-1]
    topk[0, 0], topk[1, 1], topk[2, 2], topk[3, 3] = -1, e_t, e_t + 7, 2**31 - 1
    if ids_dtype == "uint32":
        topk[0, 0] = 2**32 - 1
    topk = topk.astype(ids_dtype)
    with on_platform(impl):
        x, ids = to_device((case.x, topk))
        ra = to_device(case.row_adapter) if with_map else None
        rs = [to_device(r) for r in routes]
        bs = tuple(jnp.asarray(b) for b in bases)
        fold = lambda b, r: fold_token_projections(x, b, ids, r, ra, impl=impl)  # noqa: E731
        got = jax.jit(fold)(bs, stack_routes(*rs))
        for s in range(S):
            want = moe_lora_gather_bgmv(x, bs[s], ids.reshape(-1), rs[s], ra, top_k=4,
                                        x_gather=1, impl=impl)
            _check(got[s], want, impl)
        if impl != "jnp":
            text = str(jax.make_jaxpr(fold)(bs, stack_routes(*rs)))
            assert text.count("ffi_call") == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_cells_outside_the_pool_stay_outside_after_stacking(impl):
    """A table cell outside its projection's pool, once stacked, still folds
    nothing (each projection keeps the bits of its own fold), still reads as
    outside the pool in the per-projection view (-1), and the checked mode
    still refuses it."""
    rng = np.random.default_rng(15)
    routes = [make_route(rng, dtype=jnp.bfloat16, num_loras=3, pool_size=40, poison=False,
                         out_of_pool=2) for _ in range(S)]
    case = make_gather_case(rng, route=routes[0], top_k=4, num_tokens=24, x_gather=1,
                            poison=False)
    bases = np.stack([case.base_out, case.base_out[::-1]])
    stacked = stack_routes(*routes)
    for s in range(S):
        for name in ("a_table", "b_table"):
            own = np.asarray(getattr(routes[s], name))
            want = np.where((own > 0) & (own < 40), own, np.where(own == 0, 0, -1))
            np.testing.assert_array_equal(np.asarray(getattr(stacked, name)[s]), want)
    topk = case.ids["indices"].reshape(24, 4)
    with on_platform(impl):
        x, ids, ra = to_device((case.x, topk, case.row_adapter))
        rs = [to_device(r) for r in routes]
        bs = tuple(jnp.asarray(b) for b in bases)
        got = fold_token_projections(x, bs, ids, stack_routes(*rs), ra, impl=impl)
        for s in range(S):
            want = moe_lora_gather_bgmv(x, bs[s], ids.reshape(-1), rs[s], ra, top_k=4,
                                        x_gather=1, impl=impl)
            _check(got[s], want, impl)
        with pytest.raises(checkify.JaxRuntimeError, match="outside the pool"):
            fold_token_projections(x, bs, ids, stack_routes(*rs), ra, impl=impl, validate=True)


def test_token_projections_check_their_arguments():
    rng = np.random.default_rng(14)
    case, routes, bases = _stacked_case(rng, jnp.float32, 2, 1)
    topk = jnp.asarray(case.ids["indices"].reshape(24, 4))
    x, stacked = jnp.asarray(case.x), stack_routes(*routes)
    bs = tuple(jnp.asarray(b) for b in bases)
    with pytest.raises(TypeError, match="StackedRoute"):
        fold_token_projections(x, bs, topk, routes[0])
    with pytest.raises(ValueError, match="2 routes"):
        fold_token_projections(x, bs[:1], topk, stacked)
    with pytest.raises(ValueError, match=r"bases\[1\]"):
        fold_token_projections(x, (bs[0], bs[1][:-4]), topk, stacked)
    with pytest.raises(ValueError, match="topk_ids"):
        fold_token_projections(x, bs, topk.reshape(-1), stacked)


@pytest.mark.parametrize("gather_max_rows", [0, 4096], ids=["sorted", "gather"])
@pytest.mark.parametrize("impl", IMPLS)
def test_stacked_moe_lora_fold_both_paths(impl, gather_max_rows):
    rng = np.random.default_rng(12)
    case, routes, bases = _stacked_case(rng, jnp.bfloat16, 4, 1)
    topk = case.ids["indices"].reshape(24, 4)
    with on_platform(impl):
        x, ids, ra = to_device((case.x, topk, case.row_adapter))
        rs = [to_device(r) for r in routes]
        fold = lambda b, r: moe_lora_fold(x, b, ids, r, ra, x_gather=1, impl=impl,
                                          gather_max_rows=gather_max_rows)
        got = jax.jit(fold)(jnp.asarray(bases), stack_routes(*rs))
        for s in range(S):
            _check(got[s], fold(jnp.asarray(bases[s]), rs[s]), impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_stacked_grouped_equals_single_folds(impl):
    rng = np.random.default_rng(13)
    case, routes, bases = _stacked_case(rng, jnp.float16, 2, 1)
    topk = case.ids["indices"].reshape(24, 4)
    order, offsets, sorted_tok = sort_rows_by_expert(jnp.asarray(topk), case.route.n_experts)
    order = np.asarray(order)
    with on_platform(impl):
        x, off, st, ra = to_device((case.x, np.asarray(offsets), np.asarray(sorted_tok),
                                    case.row_adapter))
        rs = [to_device(r) for r in routes]
        fold = lambda b, r: moe_lora_grouped_down(x, b, off, st, r, ra, row_offset=5,
                                                  row_end=70, x_gather=1, impl=impl)
        sorted_bases = jnp.asarray(bases[:, order])
        got = jax.jit(fold)(sorted_bases, stack_routes(*rs))
        for s in range(S):
            _check(got[s], fold(sorted_bases[s], rs[s]), impl)


def test_stack_routes_refuses_unequal_shapes():
    rng = np.random.default_rng(14)
    a = to_device(make_route(rng, num_loras=2, pool_size=40))
    b = to_device(make_route(rng, num_loras=3, pool_size=40))
    with pytest.raises(ValueError, match="a_table"):
        stack_routes(a, b)
    with pytest.raises(TypeError, match="argument 1"):
        stack_routes(a, "up")
    stacked = stack_routes(a, a)
    assert isinstance(stacked, StackedRoute) and stacked.num_routes == 2
    assert stacked.route(1).max_loras == 2


def test_stacked_base_out_shape_is_checked():
    rng = np.random.default_rng(15)
    case, routes, bases = _stacked_case(rng, jnp.float32, 1, 0)
    stacked = stack_routes(*[to_device(r) for r in routes])
    with pytest.raises(ValueError, match=r"base_out must be \[2, rows, n_out\]"):
        moe_lora_gather_bgmv(jnp.asarray(case.x), jnp.asarray(bases[0]),
                             jnp.asarray(case.ids["indices"]), stacked, top_k=4, x_gather=0,
                             impl="jnp")
