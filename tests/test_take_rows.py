"""``ops.take_rows``: ``x[ids]`` moved as 32-bit words: same bits, and the gradient of indexing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moelora.ops.take_rows import _take_words, take_rows

# take_rows, and the word gather its CUDA lowering runs (callable on any platform)
FNS = pytest.mark.parametrize("fn", [take_rows, _take_words], ids=["take_rows", "words"])


@FNS
@pytest.mark.parametrize("dtype, k", [(jnp.bfloat16, 64), (jnp.float16, 34), (jnp.bfloat16, 33),
                                      (jnp.float32, 16)])
def test_same_bits_as_indexing(fn, dtype, k):
    if fn is _take_words and (k % 2 or dtype == jnp.float32):
        pytest.skip("the word gather takes 16-bit rows of even length")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(9, k)).astype(np.float32)).astype(dtype)
    x = x.at[2, 0].set(jnp.nan).at[3, 1].set(-0.0).at[4, 2].set(jnp.inf)
    ids = jnp.asarray(rng.integers(0, 9, 40), jnp.int32)
    got = jax.jit(fn)(x, ids)
    assert got.dtype == x.dtype and got.shape == (40, k)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(x[ids]).view(np.uint8))


@pytest.mark.parametrize("platform, words", [("cuda", True), ("cpu", False)])
def test_gather_moves_32_bit_words_on_cuda(platform, words):
    x, ids = jnp.zeros((8, 16), jnp.bfloat16), jnp.zeros((5,), jnp.int32)
    hlo = jax.jit(take_rows).trace(x, ids).lower(lowering_platforms=(platform,)).as_text()
    assert "gather" in hlo and ("ui32" in hlo) == words


@FNS
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_gradient_is_that_of_indexing(fn, dtype):
    """The gradient adds each cotangent row into its source row, in x's dtype.

    Rows with at most one source are exact. Where ids repeat, the sum is a
    scatter-add whose order XLA leaves unspecified (on a GPU, atomic adds in
    any order; an H200 gave 1 of 48 f16 values 1 ulp from ``x[ids]``'s
    gradient), so those rows are held to the bound of a sum of ``m`` terms in
    any order, ``|s' - s| <= gamma_(m-1) * sum |w_i|`` with ``gamma_n = n u /
    (1 - n u)``, ``u`` the dtype's unit roundoff (Higham, Accuracy and
    Stability of Numerical Algorithms, 4.2), against the exact float64 sum.
    On the CPU both scatter-adds run in the same order: the same bits as
    ``x[ids]``'s gradient."""
    if fn is _take_words and dtype == jnp.float32:
        pytest.skip("the word gather takes 16-bit rows")
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(6, 8)).astype(np.float32)).astype(dtype)
    ids = np.asarray([0, 3, 3, 5, 0, 0], np.int32)
    w = jnp.asarray(rng.normal(size=(6, 8)).astype(np.float32)).astype(dtype)

    def loss(f):
        return lambda x: jnp.sum((f(x, jnp.asarray(ids)) * w).astype(jnp.float32))

    got = jax.grad(loss(fn))(x)
    want = jax.grad(loss(lambda x, i: x[i]))(x)
    assert got.dtype == x.dtype
    # the cotangent of row j of f(x, ids) is w[j], exact in dtype
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    exact, abs_sum = np.zeros((6, 8)), np.zeros((6, 8))
    np.add.at(exact, ids, w64)
    np.add.at(abs_sum, ids, np.abs(w64))
    m = np.bincount(ids, minlength=6)[:, None]
    assert m.max() == 3                       # rows 0 and 3 repeat, rows 1, 2, 4 get none
    u = float(jnp.finfo(dtype).eps) / 2
    bound = np.where(m > 1, (m - 1) * u / (1 - (m - 1) * u) * abs_sum, 0.0)
    for g in (got, want):
        err = np.abs(np.asarray(g, np.float64) - exact)
        assert np.all(err <= bound), (err - bound).max()
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("fn", [lambda x, i: take_rows(x, i, zero_outside=True),
                                lambda x, i: _take_words(x, i, True)], ids=["take_rows", "words"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_zero_outside_reads_zero_rows_and_passes_no_gradient(fn, dtype):
    """``zero_outside=True``: ids outside ``[0, T)`` (negative ones included,
    which indexing would wrap) read rows of zeros and add nothing to ``x``'s
    gradient; the other rows are ``x[ids]``'s bits and gradient."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(7, 10)).astype(np.float32)).astype(dtype)
    ids = np.asarray([3, -1, 0, 7, 6, 10, 2, -7], np.int32)
    ok = (ids >= 0) & (ids < 7)
    got = np.asarray(jax.jit(fn)(x, jnp.asarray(ids)))
    np.testing.assert_array_equal(got[~ok].astype(np.float32), 0.0)
    np.testing.assert_array_equal(got[ok].view(np.uint16), np.asarray(x)[ids[ok]].view(np.uint16))
    w = jnp.asarray(rng.normal(size=(8, 10)).astype(np.float32)).astype(dtype)
    grad = jax.grad(lambda x: jnp.sum((fn(x, jnp.asarray(ids)) * w).astype(jnp.float32)))(x)
    want = np.zeros((7, 10))
    np.add.at(want, ids[ok], np.asarray(w.astype(jnp.float32), np.float64)[ok])
    np.testing.assert_array_equal(np.asarray(grad, np.float64), want)  # one term a row: exact
