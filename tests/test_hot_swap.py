"""Hot swap: the adapter pool loads, replaces and unloads adapters while one
jitted decode step keeps running, with no recompilation, and only the tokens
on the changed slot change their outputs (the others keep their bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_moelora.nnx import AdapterPool, DeepSeekV3, MoEBlock
from _block_cases import random_adapter
from jax_moelora.peft import AdapterFormatError, PeftAdapter

E, H, I, K, T = 8, 32, 16, 2, 24
#: families with router biases (gpt-oss) and shared-expert LoRA (DeepSeek-V3)
FAMILIES = {"qwen3": "qwen3", "gpt-oss": "gpt-oss",
            "deepseek-v3": DeepSeekV3(n_group=2, topk_group=1, n_shared=1)}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_pool_changes_do_not_recompile_the_decode_step(name):
    block = MoEBlock(H, I, E, K, family=FAMILIES[name], max_loras=3, max_rank=8,
                     rngs=nnx.Rngs(0))
    pool = AdapterPool([block])
    rng = np.random.default_rng(1)
    adapters = {n: random_adapter(rng, block, n, r)
                for n, r in (("a", 4), ("b", 8), ("c", 6), ("d", 8))}
    graphdef, _ = nnx.split(block)
    traces = []

    def decode_step(state, x, ids):
        traces.append(1)  # runs once per trace (compilation)
        return nnx.merge(graphdef, state)(x, ids)

    step = jax.jit(decode_step)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    slots = np.arange(T, dtype=np.int32) % 4 - 1  # -1 (base), 0, 1, 2 in turn
    ids = jnp.asarray(slots)

    def run():
        return step(nnx.state(block), x, ids)  # dispatched, not waited for

    outs = [run()]  # every slot empty: the base model
    pool.load(adapters["a"])  # slot 0
    outs.append(run())
    pool.load(adapters["b"])  # slot 1
    outs.append(run())
    pool.load(adapters["c"])  # slot 2
    outs.append(run())
    pool.replace("b", adapters["d"])  # slot 1 now holds d
    outs.append(run())
    pool.unload("a")  # slot 0 empty again
    outs.append(run())
    pool.load(adapters["b"])  # b back, in the free slot 0
    outs.append(run())
    changed = [None, 0, 1, 2, 1, 0, 0]  # the slot each operation rewrote

    assert len(traces) == 1 and step._cache_size() == 1
    assert pool.names == {"b": 0, "d": 1, "c": 2}
    outs = [np.asarray(o) for o in outs]
    for i in range(1, len(outs)):
        same = slots != changed[i]
        np.testing.assert_array_equal(outs[i][same], outs[i - 1][same], err_msg=str(i))
        assert (outs[i][~same] != outs[i - 1][~same]).any(axis=1).all(), i
    np.testing.assert_array_equal(outs[5][slots == 0], outs[0][slots == 0])  # unloaded = base
    np.testing.assert_array_equal(outs[5][slots == -1], outs[0][slots == -1])


def test_a_decode_loop_keeps_running_across_swaps():
    """Steps feed their output back; the pool changes between steps that are
    still in flight; one compilation for the whole loop."""
    block = MoEBlock(H, I, E, K, max_loras=2, max_rank=8, rngs=nnx.Rngs(2))
    pool = AdapterPool([block])
    rng = np.random.default_rng(3)
    graphdef, _ = nnx.split(block)
    traces = []

    @jax.jit
    def decode_step(state, h, ids):
        traces.append(1)
        return h + nnx.merge(graphdef, state)(h, ids)

    h = jnp.asarray(0.1 * rng.standard_normal((T, H)), jnp.float32)
    ids = jnp.asarray(np.arange(T) % 3 - 1, jnp.int32)
    for step in range(12):
        if step % 3 == 0:
            name = f"s{step}"
            if len(pool) == 2:
                pool.unload(sorted(pool.names, key=pool.names.get)[0])
            pool.load(random_adapter(rng, block, name, 4 + step % 5))
        h = decode_step(nnx.state(block), h, ids)
    assert np.isfinite(np.asarray(h)).all()
    assert len(traces) == 1 and decode_step._cache_size() == 1


def test_full_pool_evicts_the_least_recently_used_adapter():
    block = MoEBlock(H, I, E, K, max_loras=2, max_rank=8, rngs=nnx.Rngs(4))
    pool = AdapterPool([block])
    rng = np.random.default_rng(5)
    ads = {n: random_adapter(rng, block, n, 4) for n in "abcd"}
    pool.load(ads["a"])
    pool.load(ads["b"])
    with pytest.raises(ValueError, match="all 2 adapter slots are taken.*evict=True"):
        pool.load(ads["c"])
    pool.ids(["a", None])  # a used after b: b is the least recently used
    assert pool.least_recently_used() == "b"
    assert pool.load(ads["c"], evict=True) == 1 and pool.names == {"a": 0, "c": 1}
    assert pool.least_recently_used() == "a"
    wide = PeftAdapter(name="wide", path=None, config={}, layers={3: ads["d"].layers[0]})
    with pytest.raises(AdapterFormatError, match="layer out of range"):
        pool.load(wide, evict=True)  # rejected: nothing evicted
    assert pool.names == {"a": 0, "c": 1}
    # the evicted slot holds c exactly as a fresh pool would
    fresh = MoEBlock(H, I, E, K, max_loras=2, max_rank=8, rngs=nnx.Rngs(4))
    AdapterPool([fresh]).load(ads["c"], slot=1)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    ones = jnp.ones((T,), jnp.int32)
    np.testing.assert_array_equal(np.asarray(block(x, ones)), np.asarray(fresh(x, ones)))
