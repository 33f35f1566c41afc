"""The NNX MoE block with multi-adapter LoRA, its state and the adapter pool.

Specification by example: the block equals a float64 dense reference; a mixed
batch equals running each adapter alone (bit for bit with the same backend);
base tokens are untouched; loading, replacing and unloading adapters behave;
it runs under ``nnx.jit``, as many layers in one program (Python loop or
``lax.scan`` over stacked layers), and ``nnx.Optimizer(..., wrt=nnx.LoRAParam)``
trains the LoRA pools with ``impl="jnp"``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_moelora import _ext
from jax_moelora.nnx import AdapterPool, AdapterTable, MoEBlock, MoELoRA
from jax_moelora.ops import resolve_impl
from jax_moelora.peft import AdapterFormatError, load_peft_adapter, save_peft_adapter

E, H, I, K = 8, 48, 16, 2  # experts, hidden, inter, top_k
IMPLS = ["jnp", "auto"]  # auto: the C++ handlers on CPU, the CUDA kernels on a GPU


def exact(impl: str) -> bool:
    """Backends whose per-row results depend neither on the rest of the batch
    nor on the program around them: the C++ handlers, and jnp on the CPU
    (XLA:GPU fuses jnp's folds into their neighbours, program by program)."""
    concrete = resolve_impl(impl)
    return concrete == "cpu" or (concrete == "jnp" and jax.default_backend() == "cpu")


def make_block(seed=0, **kw) -> MoEBlock:
    kw = dict(max_loras=3, max_rank=16, dtype=jnp.float32) | kw
    return MoEBlock(H, I, E, K, rngs=nnx.Rngs(seed), **kw)


def factors(rng, *, r=4, down_r=None, experts=E, layers=1, amp=0.6, shared_a=True):
    down_r = r if down_r is None else down_r

    def pair(e, rank, k, n):
        return (rng.standard_normal((e, rank, k)).astype(np.float32) / np.sqrt(k),
                amp * rng.standard_normal((e, n, rank)).astype(np.float32) / np.sqrt(rank))

    out = {}
    for layer in range(layers):
        p = {"router": pair(1, r, H, E), "gate": pair(experts, r, H, I),
             "up": pair(experts, r, H, I), "down": pair(experts, down_r, I, H)}
        if shared_a:
            p["up"] = (p["gate"][0], p["up"][1])
        out[layer] = p
    return out


LAYOUTS = [("experts", 4, {}), ("target_parameters", 8, {}), ("target_parameters", 4, {"down_proj": 12})]


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    """Three PEFT adapters for a 1-layer model, in three key layouts."""
    rng = np.random.default_rng(1234)
    root = tmp_path_factory.mktemp("adapters")
    paths = []
    for name, (layout, r, pattern) in zip(("a0", "a1", "a2"), LAYOUTS):
        w = factors(rng, r=r, down_r=pattern.get("down_proj"))
        paths.append(save_peft_adapter(root / name, w, r=r, lora_alpha=2 * r, layout=layout,
                                       rank_pattern=pattern, family="qwen3"))
    return paths


def loaded_block(adapter_dirs, seed=0, **kw):
    block = make_block(seed, **kw)
    pool = AdapterPool([block])
    for p in adapter_dirs:
        pool.load(p)
    return block, pool


def fwd(impl):
    return nnx.jit(lambda m, x, ids: m(x, ids, impl=impl))


def inputs(seed, T):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = rng.choice(np.array([-1, 0, 1, 2, 7], np.int32), T)  # 7 >= max_loras: no fold
    return jnp.asarray(x), jnp.asarray(ids)


# --------------------------------------------------------------------------
# float64 reference of the block
# --------------------------------------------------------------------------

def block_reference(block: MoEBlock, x, ids, adapters) -> np.ndarray:
    """Dense float64 Qwen3-MoE block with each token's adapter deltas."""
    x = np.asarray(x, np.float64)
    wr = np.asarray(block.router.kernel[...], np.float64)
    wg, wu, wd = (np.asarray(v[...], np.float64)
                  for v in (block.gate_proj, block.up_proj, block.down_proj))
    out = np.zeros_like(x)
    for t, l in enumerate(np.asarray(ids)):
        projs = adapters[l].layers.get(0, {}) if 0 <= l < len(adapters) else {}

        def delta(name, e, v):
            lora = projs.get(name)
            if lora is None or e >= lora.n_experts or not lora.present[e]:
                return 0.0
            return lora.delta(e) @ v

        logits = x[t] @ wr + delta("router", 0, x[t])
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:K]
        w = p[top] / p[top].sum()
        for e, wk in zip(top, w):
            g = x[t] @ wg[e] + delta("gate", e, x[t])
            u = x[t] @ wu[e] + delta("up", e, x[t])
            h = g / (1 + np.exp(-g)) * u
            out[t] += wk * (h @ wd[e] + delta("down", e, h))
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grouped", [False, True], ids=["gather", "grouped"])
def test_block_equals_dense_reference(adapter_dirs, impl, grouped):
    block, pool = loaded_block(adapter_dirs, gather_max_rows=8 if grouped else 2048)
    adapters = [pool.adapter(s) for s in range(3)]
    x, ids = inputs(1, 40)
    with jax.default_matmul_precision("highest"):
        y = np.asarray(fwd(impl)(block, x, ids), np.float64)
    ref = block_reference(block, x, ids, adapters)
    base = block_reference(block, x, np.full(40, -1), adapters)
    adapted = (np.asarray(ids) >= 0) & (np.asarray(ids) < 3)
    rel = np.linalg.norm(y[adapted] - ref[adapted]) / np.linalg.norm(ref[adapted] - base[adapted])
    assert rel < 1e-4, rel
    np.testing.assert_allclose(y[~adapted], base[~adapted], rtol=1e-4, atol=1e-5)
    assert np.linalg.norm(ref[adapted] - base[adapted]) > 0.1 * np.linalg.norm(base[adapted])


# --------------------------------------------------------------------------
# mixed batches
# --------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grouped", [False, True], ids=["gather", "grouped"])
def test_mixed_batch_equals_each_adapter_alone(adapter_dirs, impl, grouped):
    block, _ = loaded_block(adapter_dirs, gather_max_rows=8 if grouped else 2048)
    x, ids = inputs(2, 48)
    f = fwd(impl)
    mixed = np.asarray(f(block, x, ids))
    ids_np = np.asarray(ids)
    check = np.testing.assert_array_equal if exact(impl) else (
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6))
    for slot in range(3):
        alone = np.asarray(f(block, x, jnp.full_like(ids, slot)))
        check(mixed[ids_np == slot], alone[ids_np == slot])
        assert not np.allclose(alone, np.asarray(block(x, None)))  # the adapter does something
    # base tokens bit-identical to the same program with every token on the
    # base model, and (custom calls, or the CPU) to the program without LoRA
    all_base = np.asarray(f(block, x, jnp.full_like(ids, -1)))
    plain = (ids_np < 0) | (ids_np >= 3)
    np.testing.assert_array_equal(mixed[plain], all_base[plain])
    base = np.asarray(f(block, x, None))
    (np.testing.assert_array_equal if exact(impl) or resolve_impl(impl) != "jnp" else check)(
        all_base, base)


def test_paths_agree(adapter_dirs):
    """Gather (decode) and sort-then-grouped (prefill) folds, dense and ragged
    base matmuls: the same block output."""
    x, ids = inputs(3, 40)
    outs = {}
    for grouped in (False, True):
        for path in ("dense", "ragged"):
            block, _ = loaded_block(adapter_dirs, gather_max_rows=8 if grouped else 2048,
                                    expert_path=path)
            outs[grouped, path] = np.asarray(fwd("auto")(block, x, ids))
    first = outs[False, "dense"]
    for key, y in outs.items():
        np.testing.assert_allclose(y, first, rtol=1e-5, atol=1e-5, err_msg=str(key))


def test_leading_dims_and_bad_ids(adapter_dirs):
    block, _ = loaded_block(adapter_dirs)
    x, ids = inputs(4, 12)
    y = fwd("jnp")(block, x, ids)
    y3 = fwd("jnp")(block, x.reshape(3, 4, H), ids.reshape(3, 4))
    np.testing.assert_array_equal(np.asarray(y3).reshape(12, H), np.asarray(y))
    with pytest.raises(ValueError, match="adapter_ids has shape"):
        block(x, ids[:5])
    with pytest.raises(TypeError, match="adapter_ids must be integers"):
        block(x, ids.astype(jnp.float32))
    with pytest.raises(ValueError, match="hidden_size"):
        block(x[:, :5], ids)


# --------------------------------------------------------------------------
# state and the adapter pool
# --------------------------------------------------------------------------

def test_state_types_and_routes():
    block = make_block()
    lora = block.lora
    assert isinstance(lora, MoELoRA)
    # gate and up share stacked variables; lora.gate / lora.up view one member
    assert isinstance(lora.gate_up.a_pool, nnx.LoRAParam)
    assert isinstance(lora.gate_up.a_cells, AdapterTable) and not isinstance(
        lora.gate_up.a_cells, nnx.Param)
    assert lora.gate_up.a_cells.shape == (3, 2 * E)  # [L, S * E]: the fold's layout
    assert lora.gate_up.a_pool.shape == (2, 1 + 3 * E, 16, H)
    assert lora.gate_up.b_pool.shape == (2, 1 + 3 * E, I, 16)
    assert lora.gate_up.scale_table.shape == (2, 3, E)
    assert lora.gate.a_pool.shape == (1 + 3 * E, 16, H) and lora.up.b_pool.shape == (1 + 3 * E,
                                                                                     I, 16)
    assert isinstance(lora.down.a_pool, nnx.LoRAParam)
    assert lora.down.b_pool.shape == (1 + 3 * E, H, 16)
    assert lora.router.a_pool.shape == (1 + 3, 16, H) and lora.router.a_pool.dtype == jnp.float32
    routes = lora.routes()
    assert routes.router.n_experts == 1 and routes.router.n_out == E
    assert (routes.gate.k_in, routes.gate.n_out, routes.down.k_in) == (H, I, I)
    assert routes.gate.max_loras == 3 and routes.gate.max_rank == 16
    assert routes.gate_up.num_routes == 2 and routes.gate_up.a_pool is lora.gate_up.a_pool[...]
    lora_leaves = jax.tree.leaves(nnx.state(block, nnx.LoRAParam))
    assert len(lora_leaves) == 6  # a_pool and b_pool of router, gate_up and down


def test_initializers_and_param_dtype_are_constructor_arguments():
    zeros = nnx.initializers.zeros_init()
    block = MoEBlock(H, I, E, K, kernel_init=zeros, router_kernel_init=zeros,
                     param_dtype=jnp.bfloat16, max_loras=2, max_rank=8,
                     lora_a_initializer=nnx.initializers.ones_init(),
                     lora_b_initializer=nnx.initializers.constant(0.5), rngs=nnx.Rngs(0))
    assert block.gate_proj.dtype == jnp.bfloat16 and block.router.kernel.dtype == jnp.float32
    assert not np.asarray(block.gate_proj[...], np.float32).any()
    assert not np.asarray(block.router.kernel[...]).any()
    x, _ = inputs(12, 8)
    y = block(x, None)
    assert y.dtype == jnp.float32 and not np.asarray(y).any()  # zero experts: zero output
    block.lora.init_adapter(1, rngs=nnx.Rngs(1), rank=4, projections=("gate",))
    gate = block.lora.gate
    np.testing.assert_array_equal(np.asarray(gate.a_pool[...])[gate.pool_slot(1, 3)][:4], 1.0)
    np.testing.assert_array_equal(np.asarray(gate.b_pool[...])[gate.pool_slot(1, 3)][:, :4],
                                  0.5)
    assert not np.asarray(gate.a_pool[...])[gate.pool_slot(1, 3)][4:].any()  # rank padding


def test_tables_follow_the_fixed_pool_layout(adapter_dirs):
    block, pool = loaded_block(adapter_dirs)
    gate = block.lora.gate
    at = np.asarray(gate.a_table[...])
    np.testing.assert_array_equal(at, 1 + np.arange(3)[:, None] * E + np.arange(E))
    np.testing.assert_array_equal(np.asarray(gate.b_table[...]), at)
    np.testing.assert_allclose(np.asarray(gate.scale_table[...])[:, 0], [2, 2, 2])
    ad = pool.adapter("a1")
    np.testing.assert_allclose(np.asarray(gate.a_pool[...])[gate.pool_slot(1, 5)][:8],
                               ad.layers[0]["gate"].a[5][:8])
    assert not np.asarray(gate.a_pool[...])[0].any()  # reserved slot stays zero
    assert (np.asarray(block.lora.router.a_table[...]) == [[1], [2], [3]]).all()


def test_unload_and_replace(adapter_dirs):
    block, pool = loaded_block(adapter_dirs)
    x, ids = inputs(5, 24)
    f = fwd("auto")
    base = np.asarray(f(block, x, None))
    assert pool.names == {"a0": 0, "a1": 1, "a2": 2} and pool.free_slots() == []
    np.testing.assert_array_equal(pool.ids(["a2", None, "base", "a0"]), [2, -1, -1, 0])
    with pytest.raises(ValueError, match="all 3 adapter slots are taken"):
        pool.load(adapter_dirs[0], name="again")
    with pytest.raises(ValueError, match="an adapter named 'a1' is installed"):
        pool.replace("a0", adapter_dirs[1])

    assert pool.unload("a0") == 0
    for proj in ("router", "gate", "up", "down"):
        p = getattr(block.lora, proj)
        assert not np.asarray(p.a_table[...])[0].any()
        assert not np.asarray(p.scale_table[...])[0].any()
    np.testing.assert_array_equal(np.asarray(f(block, x, jnp.zeros_like(ids))), base)
    with pytest.raises(KeyError, match="no adapter named 'a0'"):
        pool.slot_of("a0")

    # slot 1 now holds a2's weights under a new name; equal to a fresh model with it
    assert pool.replace("a1", adapter_dirs[2], name="a2-bis") == 1
    fresh = make_block()
    AdapterPool([fresh]).load(adapter_dirs[2], slot=1)
    ones = jnp.ones_like(ids)
    np.testing.assert_array_equal(np.asarray(f(block, x, ones)), np.asarray(f(fresh, x, ones)))
    assert pool.load(adapter_dirs[0]) == 0 and pool.names == {"a0": 0, "a2-bis": 1, "a2": 2}


def _state_copy(block):
    return [np.asarray(v) for v in jax.tree.leaves(nnx.state(block))]


def test_rejected_loads_leave_the_pool_unchanged(tmp_path, adapter_dirs):
    block, pool = loaded_block(adapter_dirs[:1])
    before = _state_copy(block)
    rng = np.random.default_rng(6)
    cases = [
        ("wide", dict(experts=E + 2), {}, r"expert id out of range: key '.*experts\.8\.\w+_proj"),
        ("deep", dict(layers=2), {}, r"layer out of range: key '.*layers\.1\..*' adapts layer 1"),
        ("rank", dict(r=24), {}, r"rank mismatch: key '.*' has rank 24, above the pool's "
                                 r"max_rank 16"),
    ]
    for name, kw, _, match in cases:
        path = save_peft_adapter(tmp_path / name, factors(rng, **kw), r=kw.get("r", 4),
                                 lora_alpha=4, layout="experts", family="qwen3")
        adapter = load_peft_adapter(path)  # widths unknown: the pool checks them
        with pytest.raises(AdapterFormatError, match=match):
            pool.load(adapter)
        for a, b in zip(before, _state_copy(block)):
            np.testing.assert_array_equal(a, b)
    assert pool.names == {"a0": 0}
    with pytest.raises(AdapterFormatError, match=r"expert id out of range"):
        pool.load(tmp_path / "wide")  # a path is read with the model's widths


def test_init_adapter_starts_at_the_base_model():
    """PEFT's init (B = 0): the fresh adapter's output is the base output, bit for bit."""
    block = make_block()
    block.lora.init_adapter(1, rngs=nnx.Rngs(3), rank=8)
    x, _ = inputs(7, 16)
    ids = jnp.ones((16,), jnp.int32)
    f = fwd("auto")
    np.testing.assert_array_equal(np.asarray(f(block, x, ids)), np.asarray(f(block, x, None)))
    assert np.asarray(block.lora.gate.a_pool[...])[block.lora.gate.pool_slot(1, 0)][:8].any()
    # the fresh adapter is live: once its B leaves zero, the same call leaves the base output
    gate = block.lora.gate
    first = gate.pool_slot(1, 0)
    gate.b_pool[...] = gate.b_pool[...].at[first:first + gate.n_experts].set(0.05)
    moved = np.asarray(f(block, x, ids)) != np.asarray(f(block, x, None))
    assert moved.any(axis=-1).all()


# --------------------------------------------------------------------------
# programs: many layers, scan, training
# --------------------------------------------------------------------------

def test_many_layers_in_one_program(adapter_dirs):
    blocks = nnx.List([loaded_block(adapter_dirs, seed=s)[0] for s in range(3)])
    x, ids = inputs(8, 16)

    def decode(blocks, x, ids):
        for b in blocks:
            x = x + b(x, ids)
        return x

    y = nnx.jit(decode)(blocks, x, ids)
    eager = x
    for b in blocks:
        eager = eager + fwd("auto")(b, eager, ids)
    np.testing.assert_allclose(np.asarray(y), np.asarray(eager), rtol=1e-5, atol=1e-5)
    graphdef, state = nnx.split(blocks)
    hlo = jax.jit(lambda s, x, ids: decode(nnx.merge(graphdef, s), x, ids)).lower(
        state, x, ids).as_text()
    assert hlo.count("func.func public @main") == 1
    if resolve_impl("auto") != "jnp":  # three folds per layer (gate and up in one), one program
        assert hlo.count(_ext.GATHER_BGMV_TARGET) == 3 * 3


def test_scan_over_stacked_layers(adapter_dirs):
    blocks = [loaded_block(adapter_dirs, seed=s)[0] for s in range(3)]
    graphdef, _ = nnx.split(blocks[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in blocks])
    x, ids = inputs(9, 16)

    @jax.jit
    def scan(stacked, x, ids):
        def body(h, layer_state):
            return h + nnx.merge(graphdef, layer_state)(h, ids), None

        return jax.lax.scan(body, x, stacked)[0]

    loop = x
    for b in blocks:
        loop = loop + b(loop, ids)
    np.testing.assert_allclose(np.asarray(scan(stacked, x, ids)), np.asarray(loop),
                               rtol=1e-5, atol=1e-5)


def test_optimizer_trains_lora_params_only(adapter_dirs):
    """A toy task: fit a teacher adapter's outputs from a fresh adapter (impl="jnp")."""
    teacher, _ = loaded_block(adapter_dirs[:1], max_loras=1)
    student = make_block(max_loras=1)
    student.lora.init_adapter(0, rngs=nnx.Rngs(1), rank=8)
    x, _ = inputs(10, 64)
    ids = jnp.zeros((64,), jnp.int32)
    target = fwd("jnp")(teacher, x, ids)
    frozen = [np.asarray(v) for v in jax.tree.leaves(nnx.state(student, nnx.Not(nnx.LoRAParam)))]
    opt = nnx.Optimizer(student, optax.adam(2e-2), wrt=nnx.LoRAParam)

    @nnx.jit
    def train_step(model, opt, x, ids, target):
        def loss_fn(m):
            return jnp.mean((m(x, ids, impl="jnp") - target) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        opt.update(model, grads)
        return loss

    losses = [float(train_step(student, opt, x, ids, target)) for _ in range(40)]
    assert losses[-1] < 0.3 * losses[0], losses[::8]
    after = [np.asarray(v) for v in jax.tree.leaves(nnx.state(student, nnx.Not(nnx.LoRAParam)))]
    for a, b in zip(frozen, after):  # base weights and adapter tables untouched
        np.testing.assert_array_equal(a, b)
    assert not np.asarray(student.lora.gate.a_pool[...])[0].any()  # reserved slot stays zero


@pytest.mark.parametrize("grouped", [False, True], ids=["gather", "grouped"])
def test_gradients_through_the_default_backend_match_jnp(adapter_dirs, grouped):
    """Once the custom calls are differentiable, their LoRA gradients equal the jnp ones."""
    if resolve_impl("auto") == "jnp":
        pytest.skip("the default backend is the jnp folds")
    block, _ = loaded_block(adapter_dirs, gather_max_rows=8 if grouped else 2048)
    x, ids = inputs(11, 24)

    def grads(impl):
        def loss(m):
            return jnp.sum(m(x, ids, impl=impl) ** 2)

        return nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))(block)

    try:
        got = grads("auto")
    except Exception as err:  # noqa: BLE001 - no VJP registered for the custom calls
        pytest.skip(f"the custom calls are not differentiable here: {type(err).__name__}")
    want = grads("jnp")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.linalg.norm(g - w) <= 1e-4 * np.linalg.norm(w)  # f32 summation order only
        assert np.abs(g - w).max() <= 1e-4 * np.abs(w).max()


@pytest.mark.parametrize("grouped", [False, True], ids=["gather", "grouped"])
def test_one_plan_serves_every_fold_of_a_layer(adapter_dirs, grouped):
    """The block's row plan (made once per call) folds exactly as
    ``moe_lora_fold`` does for each projection on its own."""
    from jax_moelora.ops.folds import fold_planned, moe_lora_fold, plan_rows

    block, _ = loaded_block(adapter_dirs)
    routes = block.lora.routes()
    rng = np.random.default_rng(13)
    topk = jnp.asarray(np.argsort(rng.random((40, E)), axis=1)[:, :K], jnp.int32)
    x, ids = inputs(13, 40)
    base = jnp.asarray(rng.standard_normal((40 * K, I)), jnp.float32)
    plan = plan_rows(topk, E, gather_max_rows=8 if grouped else 2048)
    assert plan.grouped == grouped
    got = plan.to_flat_order(fold_planned(x, plan.to_plan_order(base), plan, routes.gate, ids,
                                          x_gather=1))
    want = moe_lora_fold(x, base, topk, routes.gate, ids, x_gather=1,
                         gather_max_rows=8 if grouped else 2048)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(got), np.asarray(base))
