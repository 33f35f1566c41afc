"""``ops.search.searchsorted``: numpy's answer, with no while loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moelora.ops.search import searchsorted


@pytest.mark.parametrize("side", ["left", "right"])
def test_matches_numpy_with_repeats_and_values_outside(side):
    rng = np.random.default_rng(3)
    a = np.sort(rng.integers(-3, 20, size=33)).astype(np.int32)  # repeats, negatives
    v = rng.integers(-10, 30, size=200).astype(np.int32)          # below, inside, above
    got = searchsorted(jnp.asarray(a), jnp.asarray(v), side=side)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.searchsorted(a, v, side=side))


def test_lowers_without_a_while_loop():
    a, v = jnp.arange(129, dtype=jnp.int32), jnp.arange(4096, dtype=jnp.int32)
    assert "stablehlo.while" not in jax.jit(searchsorted).lower(a, v).as_text()
    # the default method of jnp.searchsorted does loop
    assert "stablehlo.while" in jax.jit(jnp.searchsorted).lower(a, v).as_text()
