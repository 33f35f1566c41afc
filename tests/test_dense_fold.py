"""The gather fold on the dense expert layout (``ops/dense_fold.py``, the
block's decode path): flat row ``t * top_k + k`` folds row
``(topk_ids[t, k], t)`` of its projection's ``[E, T, N]`` in place.

The contract: bit for bit the gather fold of the gathered rows (the
interleaved gate+up fold for a ``StackedRoute``) written back, every other
row of the dense outputs untouched, one custom call; its gradients those of
gather, fold and scatter; under ``vmap`` one fold per example.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _fold_cases import (DTYPE_IDS, DTYPES, bits, make_route, on_platform,
                         random_row_adapter, to_device)
from jax_moelora import backends, moe_lora_gather_bgmv, stack_routes
from jax_moelora.ops.dense_fold import fold_dense_experts
from jax_moelora.ops.folds import fold_token_projections

IMPLS = backends()["impls"]
E, T, K_TOP, L = 6, 24, 3, 3


def _case(rng, dtype, members: int, k_in: int = 64, n_out: int = 40, E: int = E, T: int = T):
    routes = [make_route(rng, dtype=dtype, num_loras=L, n_experts=E, k_in=k_in, n_out=n_out,
                         pool_size=40, poison=False) for _ in range(members)]
    ids = np.stack([rng.permutation(E)[:K_TOP] for _ in range(T)]).astype(np.int32)
    ids[0, 0], ids[1, 1], ids[2, 2] = -1, E, E + 5  # fold nothing
    ra = random_row_adapter(rng, T, L)
    bases = [rng.normal(size=(E, T, n_out)).astype(dtype) for _ in range(members)]
    return routes, ids, ra, bases


def _flat(base, ids):
    """Rows ``(ids[t, k], t)`` of ``base [E, T, N]`` as flat rows (ids clamped)."""
    return base[np.clip(ids, 0, base.shape[0] - 1), np.arange(ids.shape[0])[:, None]].reshape(
        ids.size, -1)


def _check_layout(got, bases, want_rows, ids, impl):
    """Chosen rows: the flat fold's; every other row: the input's bits."""
    got, want_rows = np.asarray(got), np.asarray(want_rows)
    n_exp, n_tok = got.shape[:2]
    chosen = np.zeros((n_exp, n_tok), bool)
    for t in range(n_tok):
        for k in range(K_TOP):
            e = ids[t, k]
            if not 0 <= e < n_exp:
                continue
            chosen[e, t] = True
            g, w = got[e, t].astype(np.float32), want_rows[t * K_TOP + k].astype(np.float32)
            if impl == "jnp":
                np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2)
            else:
                np.testing.assert_array_equal(bits(got[e, t]), bits(want_rows[t * K_TOP + k]))
    np.testing.assert_array_equal(bits(got[~chosen]), bits(np.asarray(bases)[~chosen]))


# (E, T): the shapes of the tests below, and larger ones: 576 stacked gate+up
# rows and 288 down rows, which the fast backend folds with the staged rows
# kernel (from 264 rows, ffi_src/fast/decode_rows.cu) instead of the other.
SIZES = [pytest.param((E, T), id="small"), pytest.param((16, 96), id="staged")]


def _impls_of(size):
    return [i for i in IMPLS if size[0] == E or i in ("fast", "jnp")]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_stacked_gate_up_equals_the_token_rows_fold(impl, dtype, size):
    if impl not in _impls_of(size):
        pytest.skip("the larger shapes are for the fast kernels (jnp as a check)")
    n_exp, T = size
    rng = np.random.default_rng(21)
    routes, ids, ra, bases = _case(rng, dtype, 2, E=n_exp, T=T)
    with on_platform(impl):
        x = to_device(rng.normal(size=(T, 64)).astype(dtype))
        rs, ids_d, ra_d = [to_device(r) for r in routes], jnp.asarray(ids), jnp.asarray(ra)
        stacked = stack_routes(*rs)
        fold = jax.jit(lambda b: fold_dense_experts(x, b, ids_d, stacked, ra_d, x_gather=1,
                                                    impl=impl))
        got = fold(tuple(jnp.asarray(b) for b in bases))
        want = fold_token_projections(x, tuple(jnp.asarray(_flat(b, ids)) for b in bases),
                                      ids_d, stacked, ra_d, impl=impl)
        for s in range(2):
            _check_layout(got[s], bases[s], want[s], ids, impl)
        if impl != "jnp":
            text = str(jax.make_jaxpr(fold)(tuple(jnp.asarray(b) for b in bases)))
            assert text.count("ffi_call") == 1


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("x_gather", [0, 2], ids=["xrows", "xdense"])
@pytest.mark.parametrize("with_map", [True, False], ids=["map", "nomap"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_down_rows_equal_the_flat_fold(impl, dtype, with_map, x_gather, size):
    """One route, x in flat rows (x_gather=0) or in the layout of the outputs
    (x_gather=2, ``[E, T, k_in]``: flat row ``t * top_k + k`` reads row
    ``(topk_ids[t, k], t)``, the block's down fold): bit for bit the gather
    fold of the flat rows."""
    if impl not in _impls_of(size):
        pytest.skip("the larger shapes are for the fast kernels (jnp as a check)")
    n_exp, T = size
    rng = np.random.default_rng(22)
    routes, ids, ra, bases = _case(rng, dtype, 1, k_in=48, n_out=56, E=n_exp, T=T)
    with on_platform(impl):
        if x_gather == 2:
            h_all = rng.normal(size=(n_exp, T, 48)).astype(dtype)
            x, h = to_device(h_all), to_device(_flat(h_all, ids))
        else:
            x = h = to_device(rng.normal(size=(T * K_TOP, 48)).astype(dtype))
        r, ids_d = to_device(routes[0]), jnp.asarray(ids)
        ra_d = jnp.asarray(ra) if with_map else None
        (got,) = jax.jit(lambda b: fold_dense_experts(x, b, ids_d, r, ra_d, x_gather=x_gather,
                                                      impl=impl))((jnp.asarray(bases[0]),))
        want = moe_lora_gather_bgmv(h, jnp.asarray(_flat(bases[0], ids)), ids_d.reshape(-1), r,
                                    ra_d, top_k=K_TOP, x_gather=0, impl=impl)
        _check_layout(got, bases[0], want, ids, impl)


@pytest.mark.parametrize("impl", [i for i in IMPLS if i in ("jnp", "cpu", "fast")])
def test_gradients_are_those_of_gather_fold_scatter(impl):
    rng = np.random.default_rng(23)
    routes, ids, ra, bases = _case(rng, jnp.float32, 2)
    with on_platform(impl):
        x = to_device(rng.normal(size=(T, 64)).astype(np.float32))
        stacked = stack_routes(*[to_device(r) for r in routes])
        ids_d, ra_d = jnp.asarray(ids), jnp.asarray(ra)
        w = [jnp.asarray(rng.normal(size=b.shape).astype(np.float32)) for b in bases]
        valid = jnp.asarray((ids >= 0) & (ids < E))
        tok = jnp.arange(T)[:, None]

        def dense(x, bs, route):
            out = fold_dense_experts(x, bs, ids_d, route, ra_d, x_gather=1, impl=impl)
            return sum(jnp.sum(o * wi) for o, wi in zip(out, w))

        def reference(x, bs, route):
            e = jnp.clip(ids_d, 0, E - 1)
            flats = tuple(b[e, tok].reshape(T * K_TOP, -1) for b in bs)
            folded = fold_token_projections(x, flats, ids_d, route, ra_d, impl="jnp")
            outs = []
            for b, f in zip(bs, folded):
                where = jnp.where(valid, e, E)  # E: dropped
                outs.append(b.at[where, tok].set(f.reshape(T, K_TOP, -1), mode="drop"))
            return sum(jnp.sum(o * wi) for o, wi in zip(outs, w))

        bs = tuple(jnp.asarray(b) for b in bases)
        got = jax.grad(dense, argnums=(0, 1, 2), allow_int=True)(x, bs, stacked)
        want = jax.grad(reference, argnums=(0, 1, 2), allow_int=True)(x, bs, stacked)
        floats = [(g, wt) for g, wt in zip(jax.tree.leaves(got), jax.tree.leaves(want))
                  if jnp.issubdtype(g.dtype, jnp.floating)]
        assert len(floats) == 6  # x, the two bases, the pools and the scales
        for g, wt in floats:
            np.testing.assert_allclose(np.asarray(g), np.asarray(wt), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", [i for i in IMPLS if i in ("jnp", "cpu", "fast")])
def test_gradients_with_x_in_the_dense_layout(impl):
    """x_gather=2: x's cotangent is each folded row's, at its row ``(e, t)``
    of ``[E, T, k_in]`` (zero on rows no flat row reads); the rest as for the
    gather fold of the gathered rows."""
    rng = np.random.default_rng(26)
    routes, ids, ra, bases = _case(rng, jnp.float32, 1, k_in=48, n_out=56)
    with on_platform(impl):
        x = to_device(rng.normal(size=(E, T, 48)).astype(np.float32))
        r, ids_d, ra_d = to_device(routes[0]), jnp.asarray(ids), jnp.asarray(ra)
        w = jnp.asarray(rng.normal(size=bases[0].shape).astype(np.float32))
        valid = jnp.asarray((ids >= 0) & (ids < E))
        tok = jnp.arange(T)[:, None]
        e = jnp.clip(ids_d, 0, E - 1)

        def dense(x, b, route):
            (out,) = fold_dense_experts(x, (b,), ids_d, route, ra_d, x_gather=2, impl=impl)
            return jnp.sum(out * w)

        def reference(x, b, route):
            h = x[e, tok].reshape(T * K_TOP, -1)
            flat = b[e, tok].reshape(T * K_TOP, -1)
            folded = moe_lora_gather_bgmv(h, flat, ids_d.reshape(-1), route, ra_d, top_k=K_TOP,
                                          x_gather=0, impl="jnp")
            where = jnp.where(valid, e, E)  # E: dropped
            return jnp.sum(b.at[where, tok].set(folded.reshape(T, K_TOP, -1), mode="drop") * w)

        b = jnp.asarray(bases[0])
        got = jax.grad(dense, argnums=(0, 1, 2), allow_int=True)(x, b, r)
        want = jax.grad(reference, argnums=(0, 1, 2), allow_int=True)(x, b, r)
        floats = [(g, wt) for g, wt in zip(jax.tree.leaves(got), jax.tree.leaves(want))
                  if jnp.issubdtype(g.dtype, jnp.floating)]
        assert len(floats) == 5  # x, the base, the pools and the scales
        for g, wt in floats:
            np.testing.assert_allclose(np.asarray(g), np.asarray(wt), rtol=1e-4, atol=1e-5)
        assert np.any(np.asarray(got[0]) != 0)


@pytest.mark.parametrize("impl", [i for i in IMPLS if i in ("jnp", "cpu", "fast")])
def test_vmap_folds_each_example(impl):
    rng = np.random.default_rng(24)
    routes, ids, ra, bases = _case(rng, jnp.bfloat16, 1)
    with on_platform(impl):
        r, ids_d, ra_d = to_device(routes[0]), jnp.asarray(ids), jnp.asarray(ra)
        xs = jnp.asarray(rng.normal(size=(3, T, 64)).astype(jnp.bfloat16))
        bs = jnp.asarray(np.stack([bases[0]] * 3) + rng.normal(size=(3, E, T, 40)).astype(
            jnp.bfloat16))
        fold = lambda x, b: fold_dense_experts(x, (b,), ids_d, r, ra_d, x_gather=1,  # noqa: E731
                                               impl=impl)[0]
        got = jax.jit(jax.vmap(fold))(xs, bs)
        for i in range(3):
            np.testing.assert_array_equal(bits(got[i]), bits(jax.jit(fold)(xs[i], bs[i])))


def test_arguments_are_checked():
    rng = np.random.default_rng(25)
    routes, ids, ra, bases = _case(rng, jnp.float32, 2)
    x = jnp.zeros((T, 64), jnp.float32)
    stacked = stack_routes(*[to_device(r) for r in routes])
    bs = tuple(jnp.asarray(b) for b in bases)
    with pytest.raises(ValueError, match="2 bases for a route of 1"):
        fold_dense_experts(x, bs, jnp.asarray(ids), to_device(routes[0]), x_gather=1)
    with pytest.raises(ValueError, match=r"bases\[1\]"):
        fold_dense_experts(x, (bs[0], bs[1][:, :-1]), jnp.asarray(ids), stacked, x_gather=1)
    with pytest.raises(ValueError, match="x_gather must be 1"):
        fold_dense_experts(jnp.zeros((T * K_TOP, 64)), bs, jnp.asarray(ids), stacked,
                           x_gather=0)
    with pytest.raises(ValueError, match="x_gather must be 1"):
        fold_dense_experts(jnp.zeros((E, T, 64)), bs, jnp.asarray(ids), stacked, x_gather=2)
    with pytest.raises(ValueError, match=r"x_gather=2 needs \[E, T, k_in\]"):
        fold_dense_experts(jnp.zeros((E, T + 1, 64)), bs[:1], jnp.asarray(ids),
                           to_device(routes[0]), x_gather=2)
    with pytest.raises(ValueError, match="x_gather must be 0, 1 or 2"):
        fold_dense_experts(x, bs[:1], jnp.asarray(ids), to_device(routes[0]), x_gather=3)
    with pytest.raises(ValueError, match="row_adapter"):
        fold_dense_experts(x, bs, jnp.asarray(ids), stacked, jnp.asarray(ra[:-1]), x_gather=1)
    with pytest.raises(TypeError, match="topk_ids"):
        fold_dense_experts(x, bs, jnp.asarray(ids, jnp.float32), stacked, x_gather=1)
