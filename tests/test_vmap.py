"""``jax.vmap`` of the folds (``ops/batching.py``).

The contract: for any combination of batched operands (inputs, ids, offsets,
the row-adapter map, the route's pools and tables), ``vmap`` of a fold equals
a Python loop of unbatched calls (bit for bit for the custom calls; the
``jnp`` backend may sum in another order), and it is ONE custom call over the
flattened rows (no loop of launches).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _transform_cases import make_case, make_route, sorted_layout
from jax_moelora import backends, moe_lora_fold, moe_lora_gather_bgmv, moe_lora_grouped_down
from jax_moelora.tables import MoeExpertRoute

IMPLS = backends()["impls"]
FFI_IMPL = IMPLS[0]  # "cpu" on a CPU, "fast" on a GPU
B = 3


def _stack(trees):
    return jax.tree_util.tree_map(lambda *v: jnp.stack(v), *trees)


def _batch(rng, **kw):
    """B independent cases (same shapes) and their stacked operands."""
    cases = [make_case(rng, **kw) for _ in range(B)]
    return cases, _stack(cases)


def _per_leaf(f, arg, ax):
    """``f(leaf, axis)`` over an argument whose in_axes may be a route of axes."""
    if isinstance(ax, MoeExpertRoute):
        return MoeExpertRoute.tree_unflatten(None, [
            f(v, a) for v, a in zip(arg.tree_flatten()[0], ax.tree_flatten()[0])])
    return jax.tree_util.tree_map(lambda v: f(v, ax), arg)


def _unbatch(stacked, in_axes):
    """Drop the batch axis of the operands that in_axes does not batch."""
    return tuple(_per_leaf(lambda v, a: v if a is not None else v[0], arg, ax)
                 for arg, ax in zip(stacked, in_axes))


def _assert_vmap_equals_loop(fn, stacked, in_axes, n_launches=1, impl=FFI_IMPL):
    """``vmap(fn, in_axes)`` == loop over the batch, bit for bit; one launch."""
    sliced = lambda i: [_per_leaf(lambda v, a: v if a is None else jnp.take(v, i, axis=a),
                                  arg, ax) for arg, ax in zip(stacked, in_axes)]
    want = jnp.stack([fn(*sliced(i)) for i in range(B)])
    got = jax.jit(jax.vmap(fn, in_axes=in_axes))(*stacked)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if impl == "jnp":  # XLA's dot may sum in another order for another row count
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)
    if impl != "jnp":  # the program lowered for this platform (impl="auto" picks there)
        vfn = jax.vmap(fn, in_axes=in_axes)
        text = jax.jit(vfn).lower(*stacked).as_text()
        assert text.count("stablehlo.custom_call @moe_lora") == n_launches
        assert "while" not in str(jax.make_jaxpr(vfn)(*stacked))  # no sequential loop of launches


def _route_axes(batched: bool, pools: bool = True, tables: bool = True):
    """in_axes for a MoeExpertRoute: pools and/or tables batched."""
    p, t = (0 if batched and pools else None), (0 if batched and tables else None)
    return MoeExpertRoute.tree_unflatten(None, (p, p, t, t, t))


# (x, base_out, ids, route, row_adapter) batched?
GATHER_AXES = {
    "inputs": (0, 0, 0, None, 0),
    "base_only": (None, 0, None, None, None),
    "ids_only": (None, None, 0, None, None),
    "route_only": (None, None, None, "route", None),
    "tables_only": (None, None, None, "tables", None),
    "all": (0, 0, 0, "route", 0),
}


def _axes(spec):
    return tuple(_route_axes(True) if a == "route" else
                 _route_axes(True, pools=False) if a == "tables" else a for a in spec)


@pytest.mark.parametrize("x_gather", [0, 1])
@pytest.mark.parametrize("name", list(GATHER_AXES))
@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_gather_equals_loop(impl, name, x_gather):
    rng = np.random.default_rng(hash((name, x_gather)) % 2**32)
    cases, st = _batch(rng, T=5, top_k=2, x_gather=x_gather)
    fn = lambda x, base, ids, route, ra: moe_lora_gather_bgmv(
        x, base, ids.reshape(-1), route, ra, top_k=2, x_gather=x_gather, impl=impl)
    stacked = (st.x, st.base_out, st.topk_ids, st.route, st.row_adapter)
    axes = _axes(GATHER_AXES[name])
    stacked = _unbatch(stacked, axes)
    _assert_vmap_equals_loop(fn, stacked, axes, impl=impl)


@pytest.mark.parametrize("window", [None, (3, 9)])
@pytest.mark.parametrize("x_gather", [0, 1])
@pytest.mark.parametrize("name", ["inputs", "offsets_only", "route_only", "all"])
@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_grouped_equals_loop(impl, name, x_gather, window):
    rng = np.random.default_rng(hash((name, x_gather, window)) % 2**32)
    cases, st = _batch(rng, T=6, top_k=2, x_gather=x_gather)
    E = cases[0].route.n_experts
    layouts = [sorted_layout(c.topk_ids, E) for c in cases]
    offsets = jnp.stack([lay[1] for lay in layouts])
    stid = jnp.stack([lay[2] for lay in layouts])
    lo, hi = window or (0, st.base_out.shape[1])
    fn = lambda x, base, offs, tok, route, ra: moe_lora_grouped_down(
        x, base, offs, tok, route, ra, row_offset=lo, row_end=hi, x_gather=x_gather, impl=impl)
    stacked = (st.x, st.base_out, offsets, stid, st.route, st.row_adapter)
    axes = {"inputs": (0, 0, 0, 0, None, 0),
            "offsets_only": (None, None, 0, 0, None, None),
            "route_only": (None, None, None, None, _route_axes(True), None),
            "all": (0, 0, 0, 0, _route_axes(True), 0)}[name]
    stacked = _unbatch(stacked, axes)
    _assert_vmap_equals_loop(fn, stacked, axes, impl=impl)


def test_vmap_moe_lora_fold_both_paths():
    rng = np.random.default_rng(1)
    cases, st = _batch(rng, T=8, top_k=2, x_gather=1, with_row_adapter=False)
    for gather_max_rows in (0, 4096):
        fn = lambda x, base, ids: moe_lora_fold(x, base, ids, cases[0].route, x_gather=1,
                                                gather_max_rows=gather_max_rows)
        _assert_vmap_equals_loop(fn, (st.x, st.base_out, st.topk_ids), (0, 0, 0))


def test_vmap_non_leading_axes_and_nested_vmap():
    rng = np.random.default_rng(2)
    cases, st = _batch(rng, T=4, top_k=2, x_gather=0)
    route = cases[0].route
    fn = lambda x, base, ids: moe_lora_gather_bgmv(x, base, ids.reshape(-1), route, top_k=2,
                                                   x_gather=0)
    # Batch axis 1 on base_out.
    base_t = jnp.moveaxis(st.base_out, 0, 1)
    got = jax.vmap(fn, in_axes=(0, 1, 0))(st.x, base_t, st.topk_ids)
    want = jax.vmap(fn)(st.x, st.base_out, st.topk_ids)
    np.testing.assert_array_equal(got, want)
    # vmap of vmap: [2, B, ...] folds as 2 * B examples in one launch.
    x2, b2, i2 = (jnp.stack([v, v[::-1]]) for v in (st.x, st.base_out, st.topk_ids))
    nested = jax.vmap(jax.vmap(fn))
    got = jax.jit(nested)(x2, b2, i2)
    np.testing.assert_array_equal(got[1], jax.vmap(fn)(st.x[::-1], st.base_out[::-1],
                                                       st.topk_ids[::-1]))
    assert jax.jit(nested).lower(x2, b2, i2).as_text().count("stablehlo.custom_call @moe_lora") == 1


def test_vmap_of_grad_equals_loop_of_grads():
    rng = np.random.default_rng(3)
    cases, st = _batch(rng, T=6, top_k=2, x_gather=1)
    route = cases[0].route

    def loss(x, base, ids, ra, a_pool):
        out = moe_lora_fold(x, base, ids, route.replace(a_pool=a_pool), ra, x_gather=1)
        return jnp.sum(out ** 2)

    g = jax.grad(loss, argnums=(0, 4))
    got = jax.jit(jax.vmap(g, in_axes=(0, 0, 0, 0, None)))(
        st.x, st.base_out, st.topk_ids, st.row_adapter, route.a_pool)
    for i, c in enumerate(cases):
        want = g(c.x, c.base_out, c.topk_ids, c.row_adapter, route.a_pool)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-5)
    # grad of a vmapped loss: the per-example weight gradients add up.
    total = jax.grad(lambda p: jnp.sum(jax.vmap(lambda *a: loss(*a, p))(
        st.x, st.base_out, st.topk_ids, st.row_adapter)))(route.a_pool)
    want = sum(g(c.x, c.base_out, c.topk_ids, c.row_adapter, route.a_pool)[1] for c in cases)
    np.testing.assert_allclose(total, want, rtol=1e-5, atol=1e-5)


def test_vmapped_route_keeps_out_of_range_cells_unfolded():
    """Stacking pools offsets slots by b * P: a cell >= P must stay a no-fold
    (not land in the next example's pool)."""
    rng = np.random.default_rng(4)
    routes = [make_route(rng, P=5, E=3, L=1) for _ in range(B)]
    routes = [r.replace(a_table=jnp.array([[1, 5, 6]]), b_table=jnp.array([[1, 2, 3]]))
              for r in routes]
    x = jnp.asarray(rng.normal(size=(B, 4, routes[0].k_in)), jnp.float32)
    base = jnp.asarray(rng.normal(size=(B, 4, routes[0].n_out)), jnp.float32)
    ids = jnp.asarray(np.tile([0, 1, 2, 1], (B, 1)), jnp.int32)
    fn = lambda x, base, r: moe_lora_gather_bgmv(x, base, ids[0], r, top_k=1, x_gather=0)
    out = jax.vmap(fn)(x, base, _stack(routes))
    np.testing.assert_array_equal(out[:, 1:], base[:, 1:])
    assert not np.array_equal(out[:, 0], base[:, 0])


@pytest.mark.parametrize("expert_gemm", ["ragged_dot", "expert_matmul"])
def test_vmap_of_the_block_on_the_ragged_path(expert_gemm):
    """``MoEBlock(expert_path="ragged")`` (grouped GEMMs on sorted rows) under
    ``vmap`` over examples equals a loop, forward and gradients w.r.t. the
    LoRA state and x (``ragged_dot`` and ``expert_matmul`` run one element at
    a time)."""
    from flax import nnx

    from jax_moelora.nnx import MoEBlock

    block = MoEBlock(32, 16, num_experts=4, top_k=2, family="qwen3", max_loras=2, max_rank=8,
                     expert_path="ragged", expert_gemm=expert_gemm, rngs=nnx.Rngs(0))
    for slot in range(2):
        block.lora.init_adapter(slot, rngs=nnx.Rngs(slot + 5), rank=8, alpha=16)
        block.lora.gate.b_pool[...] = jax.random.normal(jax.random.key(slot),
                                                       block.lora.gate.b_pool.shape) * 0.1
    g, lora, rest = nnx.split(block, nnx.LoRAParam, ...)
    x = jax.random.normal(jax.random.key(1), (B, 12, 32))
    ids = jax.random.randint(jax.random.key(2), (B, 12), -1, 2)

    def loss(lora, x, ids):
        return jnp.sum(nnx.merge(g, lora, rest)(x, ids) ** 2)

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, 0, 0)))(lora, x, ids)
    ys = jax.jit(jax.vmap(lambda x, ids: nnx.merge(g, lora, rest)(x, ids)))(x, ids)
    for b in range(B):
        one = jax.jit(jax.grad(loss, argnums=(0, 1)))(lora, x[b], ids[b])
        np.testing.assert_allclose(ys[b], jax.jit(lambda x, i: nnx.merge(g, lora, rest)(x, i))(
            x[b], ids[b]), rtol=1e-5, atol=1e-6)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(one)):
            np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-5)
