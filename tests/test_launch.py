"""Launch options of the CUDA kernels (``jax_moelora.ops.launch``): a static
attribute of each custom call, fixed when the call is traced; programmatic
dependent launch on or off gives the same bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _fold_cases import bits, make_route, to_device
from jax_moelora import moe_lora_fold, moe_lora_gather_bgmv
from jax_moelora.ops import launch


def _gather(impl="cpu"):
    rng = np.random.default_rng(31)
    route = to_device(make_route(rng, dtype=jnp.float32, num_loras=2, n_experts=4, k_in=32,
                                 n_out=16, poison=False))
    x = jnp.asarray(rng.normal(size=(8, 32)).astype(np.float32))
    ids = jnp.asarray(rng.integers(0, 4, 16).astype(np.int32))
    return lambda b: moe_lora_gather_bgmv(x, b, ids, route, top_k=2, x_gather=1, impl=impl)


def test_the_attribute_is_fixed_at_trace_time():
    fold, base = _gather(), jnp.zeros((16, 16), jnp.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        assert launch.programmatic_launch_enabled()
        traced_on = jax.jit(lambda b: fold(b))
        assert "pdl = 1 : i64" in traced_on.lower(base).as_text()
        with launch.programmatic_launch(False):
            assert not launch.programmatic_launch_enabled()
            assert "pdl = 0 : i64" in jax.jit(lambda b: fold(b)).lower(base).as_text()
            # a function traced before keeps its option
            assert "pdl = 1 : i64" in traced_on.lower(base).as_text()
        assert launch.programmatic_launch_enabled()


def test_programmatic_launch_takes_a_bool():
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with launch.programmatic_launch(0):
            pass


def _both_ways(fn, *args):
    outs = []
    for enabled in (True, False):
        with launch.programmatic_launch(enabled):
            outs.append(np.asarray(jax.jit(lambda *a: fn(*a))(*args)))
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["decode_plan", "prefill_split"])
def test_same_bits_with_and_without_programmatic_launch(path):
    """The kernels launched after a plan or shrink kernel (the decode cells
    kernel past 4,096 rows, the prefill expand) fold the same bits as
    ordinary launches."""
    rng = np.random.default_rng(32)
    route = to_device(make_route(rng, dtype=jnp.bfloat16, num_loras=2, n_experts=4, k_in=256,
                                 n_out=256, ranks=(16,), max_rank=16, unadapted=0.0,
                                 poison=False))
    T, k = 2048, 4
    x = jnp.asarray(rng.normal(size=(T, 256)).astype(jnp.bfloat16))
    base = jnp.asarray(rng.normal(size=(T * k, 256)).astype(jnp.bfloat16))
    topk = jnp.asarray(rng.integers(0, 4, (T, k)).astype(np.int32))
    ra = jnp.asarray(rng.integers(-1, 2, T).astype(np.int32))
    if path == "decode_plan":
        fn = lambda b: moe_lora_gather_bgmv(x, b, topk.reshape(-1), route, ra, top_k=k,  # noqa: E731
                                            x_gather=1, impl="fast")
    else:
        fn = lambda b: moe_lora_fold(x, b, topk, route, ra, x_gather=1, impl="fast",  # noqa: E731
                                     gather_max_rows=0)
    on, off = _both_ways(fn, base)
    assert not np.array_equal(bits(on), bits(np.asarray(base)))  # rows folded
    np.testing.assert_array_equal(bits(on), bits(off))
