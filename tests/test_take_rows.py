"""``ops.take_rows``: ``x[ids]`` moved as 32-bit words, same bits and gradient."""

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
    if fn is _take_words and dtype == jnp.float32:
        pytest.skip("the word gather takes 16-bit rows")
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(6, 8)).astype(np.float32)).astype(dtype)
    ids = jnp.asarray([0, 3, 3, 5, 0, 0], jnp.int32)
    w = jnp.asarray(rng.normal(size=(6, 8)).astype(np.float32)).astype(dtype)

    def loss(f):
        return lambda x: jnp.sum((f(x, ids) * w).astype(jnp.float32))

    got = jax.grad(loss(fn))(x)
    want = jax.grad(loss(lambda x, i: x[i]))(x)
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
