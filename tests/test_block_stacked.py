"""The block folds gate and up in one launch, from stacked state.

``MoELoRA`` keeps gate and up (and the shared experts' gate and up) in one
:class:`StackedExpertLoRA`; ``routes().gate_up`` is its ``StackedRoute``, the
stored arrays as they are. Specification by example: the block's output has
the bits of separate gate and up folds; the lowered program has one fold
custom call for gate and up, and the pools reach it untouched (parameters and
bitcasts only, no concatenate or copy); adapter loads, unloads and writes
through the per-projection views land in the right member and slot; LoRA
gradients reach both members.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import _block_cases
import jax_moelora.nnx.block as block_mod
from jax_moelora import MoeExpertRoute, StackedRoute
from jax_moelora.nnx import AdapterPool, DeepSeekV3, MoEBlock, StackedExpertLoRA
from jax_moelora.ops.dense_fold import fold_dense_experts
from jax_moelora.peft import PeftAdapter

E, H, I, K, T, L, R = 8, 32, 16, 2, 24, 3, 8
FAMILIES = {"qwen3": "qwen3", "gpt-oss": "gpt-oss",
            "deepseek-v3": DeepSeekV3(n_group=2, topk_group=1, n_shared=1)}
GROUPED = {"gather": 4096, "grouped": 8}  # gather_max_rows: flat rows vs sorted rows


def cpu():
    return jax.default_device(jax.devices("cpu")[0])


def make_block(family="qwen3", gather_max_rows=4096, seed=0) -> MoEBlock:
    return MoEBlock(H, I, E, K, family=FAMILIES[family], max_loras=L, max_rank=R,
                    gather_max_rows=gather_max_rows, rngs=nnx.Rngs(seed))


def random_adapter(rng, block: MoEBlock, name: str, rank: int) -> PeftAdapter:
    return _block_cases.random_adapter(rng, block, name, rank, alpha=1.5, skip_expert=3)


def loaded(family="qwen3", gather_max_rows=4096):
    block = make_block(family, gather_max_rows)
    pool = AdapterPool([block])
    rng = np.random.default_rng(7)
    for i, rank in enumerate((4, 8, 6)):
        pool.load(random_adapter(rng, block, f"a{i}", rank))
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    ids = jnp.asarray(np.arange(T) % (L + 2) - 1, jnp.int32)  # base, every slot, past L
    return block, pool, x, ids


def split_stacked(fold):
    """``fold`` with a ``StackedRoute`` (argument 3) run as one fold per route."""
    def call(x, base, third, route, *rest, **kw):
        if isinstance(route, StackedRoute):
            return jnp.stack([fold(x, base[s], third, route.route(s), *rest, **kw)
                              for s in range(route.num_routes)])
        return fold(x, base, third, route, *rest, **kw)
    return call


def split_token_projections(x, bases, topk_ids, route, row_adapter=None, *, impl, **kw):
    """``fold_token_projections`` as one gather fold per projection."""
    return tuple(block_mod.moe_lora_gather_bgmv(x, b, topk_ids.reshape(-1), route.route(s),
                                                row_adapter, top_k=topk_ids.shape[1], x_gather=1,
                                                impl=impl, **kw)
                 for s, b in enumerate(bases))


def split_dense(x, bases, topk_ids, route, row_adapter=None, **kw):
    """``fold_dense_experts`` as one fold per projection."""
    if not isinstance(route, StackedRoute):
        return fold_dense_experts(x, bases, topk_ids, route, row_adapter, **kw)
    return tuple(fold_dense_experts(x, (b,), topk_ids, route.route(s), row_adapter, **kw)[0]
                 for s, b in enumerate(bases))


def split_all(mp):
    """Every fold the block calls, with gate and up folded one by one."""
    mp.setattr(block_mod, "fold_planned", split_stacked(block_mod.fold_planned))
    mp.setattr(block_mod, "moe_lora_gather_bgmv", split_stacked(block_mod.moe_lora_gather_bgmv))
    mp.setattr(block_mod, "fold_token_projections", split_token_projections)
    mp.setattr(block_mod, "fold_dense_experts", split_dense)


def run(block, x, ids, impl):
    graphdef, state = nnx.split(block)
    return np.asarray(jax.jit(lambda s, x, i: nnx.merge(graphdef, s)(x, i, impl=impl))(
        state, x, ids))


@pytest.mark.parametrize("grouped", list(GROUPED))
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("impl", ["cpu", "jnp"])
def test_stacked_gate_up_has_the_bits_of_separate_folds(monkeypatch, impl, family, grouped):
    with cpu():
        block, _, x, ids = loaded(family, GROUPED[grouped])
        got = run(block, x, ids, impl)
        split_all(monkeypatch)
        want = run(block, x, ids, impl)
        base = run(block, x, None, impl)
    np.testing.assert_array_equal(got, want)
    live = (np.asarray(ids) >= 0) & (np.asarray(ids) < L)
    assert (got != base)[live].any(axis=-1).all()  # the adapters fold
    np.testing.assert_array_equal(got[~live], base[~live])  # base ids and ids past L do not


def _fold_calls(text: str) -> dict[str, int]:
    calls = re.findall(r"stablehlo\.custom_call @(moe_lora_\w+)", text)
    return {name: calls.count(name) for name in sorted(set(calls))}


def _stacked_shapes(stack: StackedExpertLoRA) -> set[tuple[int, ...]]:
    """The stacked pools' shapes, and the ``[S * P, ...]`` the folds flatten them to."""
    out = set()
    for var in (stack.a_pool, stack.b_pool):
        s = tuple(var.shape)
        out |= {s, (s[0] * s[1],) + s[2:]}
    return out


@pytest.mark.parametrize("grouped", list(GROUPED))
@pytest.mark.parametrize("family", ["qwen3", "deepseek-v3"])
def test_one_fold_call_for_gate_and_up_and_no_pool_copy(family, grouped):
    with cpu():
        block, _, x, ids = loaded(family, GROUPED[grouped])
        graphdef, state = nnx.split(block)
        lowered = jax.jit(lambda s, x, i: nnx.merge(graphdef, s)(x, i, impl="cpu")).lower(
            state, x, ids)
        calls = _fold_calls(lowered.as_text())
        compiled = lowered.compile().as_text()
    shared = 2 if family == "deepseek-v3" else 0  # shared gate+up, shared down
    if grouped == "grouped":  # router (gather); gate+up, down (grouped)
        assert calls == {"moe_lora_gather_bgmv": 1 + shared, "moe_lora_grouped_down": 2}
    else:  # router, gate+up, down
        assert calls == {"moe_lora_gather_bgmv": 3 + shared}
    # the pools reach the fold as they are stored: parameters and bitcasts only
    stacks = [block.lora.gate_up] + ([block.lora.shared_gate_up] if shared else [])
    shapes = set().union(*map(_stacked_shapes, stacks))
    seen = set()
    for dtype, dims, op in re.findall(r"= (\w+)\[([\d,]*)\]\{[\d,]*\} ([\w-]+)\(", compiled):
        if dims and tuple(map(int, dims.split(","))) in shapes:
            seen.add(op)
    assert seen and seen <= {"parameter", "bitcast"}, seen


def test_separate_folds_lower_to_one_more_call():
    """The counting above sees the difference: gate and up folded one by one
    are two calls."""
    with cpu(), pytest.MonkeyPatch.context() as mp:
        split_all(mp)
        block, _, x, ids = loaded()
        graphdef, state = nnx.split(block)
        text = jax.jit(lambda s, x, i: nnx.merge(graphdef, s)(x, i, impl="cpu")).lower(
            state, x, ids).as_text()
    assert _fold_calls(text) == {"moe_lora_gather_bgmv": 4}


@pytest.mark.parametrize("family", ["qwen3", "deepseek-v3"])
def test_pool_writes_land_in_the_right_member_and_slot(family):
    block = make_block(family)
    lora = block.lora
    pool = AdapterPool([block])
    rng = np.random.default_rng(3)
    ads = [random_adapter(rng, block, n, 8) for n in ("a", "b", "c")]
    for ad in ads[:2]:
        pool.load(ad)  # slots 0 and 1
    stacks = {"gate_up": ("gate", "up")}
    if family == "deepseek-v3":
        stacks["shared_gate_up"] = ("shared_gate", "shared_up")

    def member_rows(stack_name, s, slot):
        stack = getattr(lora, stack_name)
        first = 1 + slot * stack.n_experts
        return (np.asarray(stack.a_pool[...])[s, first:first + stack.n_experts],
                np.asarray(stack.b_pool[...])[s, first:first + stack.n_experts])

    for stack_name, names in stacks.items():
        stack = getattr(lora, stack_name)
        assert stack.names == names
        for s, proj in enumerate(names):
            for slot, ad in enumerate(ads[:2]):
                want = ad.layers[0][proj]
                a, b = member_rows(stack_name, s, slot)
                np.testing.assert_array_equal(a, want.a)
                np.testing.assert_array_equal(b, want.b)
                cells = np.asarray(stack.a_table[...])[s, slot]
                np.testing.assert_array_equal(
                    cells, np.where(want.present, 1 + slot * stack.n_experts
                                    + np.arange(stack.n_experts), 0))
                np.testing.assert_array_equal(np.asarray(stack.scale_table[...])[s, slot],
                                              want.scale)
                # the view reads its member
                view = lora.projection(proj)
                np.testing.assert_array_equal(np.asarray(view.a_table[...]), np.asarray(
                    stack.a_table[...])[s])
                np.testing.assert_array_equal(np.asarray(view.b_pool[...]), np.asarray(
                    stack.b_pool[...])[s])
        assert not np.asarray(stack.a_pool[...])[:, 0].any()  # reserved slot stays zero

    # replace slot 1: slot 0 keeps its bits in both members; unload slot 0: zero
    before = {n: [member_rows(n, s, 0) for s in range(2)] for n in stacks}
    pool.replace("b", ads[2])
    for stack_name, names in stacks.items():
        for s, proj in enumerate(names):
            for got, want in zip(member_rows(stack_name, s, 0), before[stack_name][s]):
                np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(member_rows(stack_name, s, 1)[0],
                                          ads[2].layers[0][proj].a)
    pool.unload("a")
    for stack_name in stacks:
        stack = getattr(lora, stack_name)
        for arr in (stack.a_pool, stack.b_pool):  # slot 0's block of the pools
            assert not np.asarray(arr[...])[:, 1:1 + stack.n_experts].any()
        for arr in (stack.a_table, stack.b_table, stack.scale_table):
            assert not np.asarray(arr[...])[:, 0].any()
        assert np.asarray(stack.a_table[...])[:, 1].any()

    # writes through one view leave the other member alone
    up_before = np.asarray(lora.up.a_pool[...])
    lora.gate.write_slot(2, np.ones((E, 4, H)), np.ones((E, I, 4)), np.ones(E), np.ones(E, bool))
    np.testing.assert_array_equal(np.asarray(lora.up.a_pool[...]), up_before)
    assert (np.asarray(lora.gate.a_pool[...])[lora.gate.pool_slot(2, 0)][:4] == 1).all()
    lora.gate.b_pool[...] = lora.gate.b_pool[...].at[0].set(0.5)  # slice assignment
    assert (np.asarray(lora.gate_up.b_pool[...])[0, 0] == 0.5).all()
    assert not np.asarray(lora.gate_up.b_pool[...])[1, 0].any()


def test_routes_are_the_stored_arrays():
    block = make_block()
    lora = block.lora
    lora.init_adapter(1, rngs=nnx.Rngs(2), rank=4)
    routes = lora.routes()
    assert isinstance(routes.gate_up, StackedRoute)
    for name in StackedRoute.__slots__:
        assert getattr(routes.gate_up, name) is getattr(lora.gate_up, name)[...]
    for s, proj in enumerate(("gate", "up")):
        single = getattr(routes, proj)
        view_route = lora.projection(proj).route()
        for name in MoeExpertRoute.__slots__:
            np.testing.assert_array_equal(np.asarray(getattr(single, name)),
                                          np.asarray(getattr(view_route, name)))
    # the stored tables are the virtual route the decode fold reads, as they are
    virtual = routes.gate_up.virtual()
    assert virtual.a_table is routes.gate_up.a_cells
    assert virtual.b_table is routes.gate_up.b_cells
    assert virtual.scale_table is routes.gate_up.scales
    assert routes.shared_gate_up is None and routes.shared_gate is None
    with pytest.raises(AttributeError, match="no shared experts"):
        lora.shared_gate  # noqa: B018


def test_lora_gradients_reach_both_members():
    with cpu():
        block, _, x, ids = loaded()

        def loss(m):
            return jnp.sum(m(x, ids, impl="cpu") ** 2)

        grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))(block)
    g = grads["lora"]["gate_up"]
    for name in ("a_pool", "b_pool"):
        arr = np.asarray(g[name][...])
        assert arr.shape == tuple(getattr(block.lora.gate_up, name).shape)
        assert arr[0].any() and arr[1].any(), name  # gate and up both trained
        assert not arr[:, 0].any()  # the reserved slot gets no gradient
