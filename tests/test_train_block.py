"""Training ``MoEBlock``'s LoRA state with ``jax.grad``, base weights frozen.

Gradients w.r.t. the ``nnx.LoRAParam`` pools only (``nnx.DiffState(0,
nnx.LoRAParam)``, or ``nnx.split`` + ``jax.grad``), through the default fold
backend (the C++ handlers on the CPU, the CUDA kernels on a GPU), for every
family, with LoRA on the router, gate, up, down and (DeepSeek) the shared
experts, two adapters and base tokens in one batch:

- along random directions of each pool, the gradient equals the central
  difference of the float64 reference block (``nnx.reference``), on the
  decode path (flat rows, gather folds) and the prefill path (rows sorted by
  expert, grouped folds); it equals the gradient of the same block on
  ``impl="jnp"`` (f32: summation order only);
- an adapter slot absent from the batch (and the reserved pool slot 0) gets
  an exactly zero gradient;
- two adapters in one batch each get the gradient of a batch holding only
  their own tokens (the loss is a sum over tokens);
- the gradient holds the LoRA pools and nothing else, and an optax step
  changes nothing else.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_moelora.nnx import DeepSeekV2, DeepSeekV3, GptOss, Mixtral, MoEBlock, Qwen3MoE
from jax_moelora.nnx.reference import block_params, moe_block_reference

H, I, E, RANK, SLOTS = 16, 8, 4, 4, 3

#: family config, top_k
FAMILIES = {
    "qwen3": (Qwen3MoE(), 2),
    "mixtral": (Mixtral(), 2),
    "gpt-oss": (GptOss(limit=2.0), 2),  # a small limit: the clamps act on some rows
    "deepseek-v2": (DeepSeekV2(topk_method="group_limited_greedy", n_group=2, topk_group=1,
                               routed_scaling_factor=1.5, n_shared=1), 2),
    "deepseek-v3": (DeepSeekV3(n_group=2, topk_group=1, routed_scaling_factor=2.0,
                               n_shared=1), 2),
}
#: projection -> (its pool's module in MoELoRA, member index in a stacked module)
POOLS = {"router": ("router", None), "gate": ("gate_up", 0), "up": ("gate_up", 1),
         "down": ("down", None), "shared_gate": ("shared_gate_up", 0),
         "shared_up": ("shared_gate_up", 1), "shared_down": ("shared_down", None)}
#: the batch: adapters 0 and 1 (5 tokens each) and base tokens; slot 2 holds an
#: adapter that no token uses
IDS = (0, 1, -1, 1, 0, 0, 1, -1, 1, 0, 1, 0)
#: f32 gradients against the jnp folds' (summation order only), by norm
TOL_JNP = 1e-5
#: f32 directional derivatives against the float64 reference's central
#: difference: docs/semantics.md §6 allows 1e-5 per f32 fold, a block chains three
TOL_REF = 3e-5


def make_block(family: str, *, grouped: bool = False, seed: int = 0) -> MoEBlock:
    """A block with ``SLOTS`` trainable adapters of rank ``RANK`` (random ``A``
    and ``B``, so that both factors get a gradient)."""
    fam, top_k = FAMILIES[family]
    normal = nnx.initializers.normal(0.5)
    block = MoEBlock(H, I, E, top_k, family=fam, max_loras=SLOTS, max_rank=8,
                     gather_max_rows=0 if grouped else None, bias_init=normal,
                     router_bias_init=normal, lora_b_initializer=nnx.initializers.normal(0.4),
                     rngs=nnx.Rngs(seed))
    for slot in range(SLOTS):
        block.lora.init_adapter(slot, rngs=nnx.Rngs(seed + 10 + slot), rank=RANK, alpha=8.0)
    return block


def inputs(seed: int, ids=IDS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(x [T, H], adapter ids int32 [T], loss weights w [T, H])``, float32."""
    rng = np.random.default_rng(seed)
    ids = np.asarray(ids, np.int32)
    x = rng.standard_normal((len(ids), H)).astype(np.float32)
    w = rng.standard_normal((len(ids), H)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w)


def loss(model: MoEBlock, x, ids, w, impl: str | None = None) -> jax.Array:
    """``sum_t <model(x, ids)[t], w[t]>``: a sum over tokens."""
    return jnp.sum(model(x, ids, impl=impl).astype(jnp.float32) * w)


#: d loss / d (LoRA pools): an ``nnx.State`` of the ``nnx.LoRAParam`` variables
lora_grad = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam)),
                    static_argnames="impl")


def leaves(state: nnx.State) -> dict[str, np.ndarray]:
    """``{"router/a_pool": array, ...}`` (float64) of a LoRA state."""
    return {"/".join(map(str, path[1:])): np.asarray(v[...], np.float64)
            for path, v in nnx.to_flat_state(state)}


def rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def slot_block(block: MoEBlock, name: str, pool: np.ndarray, slot: int) -> np.ndarray:
    """Adapter ``slot``'s pool slots in pool ``name`` (``leaves``' names);
    slot -1 is the reserved pool slot 0."""
    module = getattr(block.lora, name.split("/")[0])
    lo, hi = (0, 1) if slot < 0 else (1 + slot * module.n_experts,
                                      1 + (slot + 1) * module.n_experts)
    return pool[..., lo:hi, :, :]


@functools.cache
def decode_case(family: str) -> tuple[MoEBlock, dict[str, np.ndarray]]:
    """The block and its LoRA gradients on the mixed batch (default backend)."""
    block = make_block(family)
    return block, leaves(lora_grad(block, *inputs(1)))


# --- the float64 reference as a function of the pools ---------------------------------------

def tables(block: MoEBlock) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{projection: (pool slots int [L, E_t], scales float64 [L, E_t])}``."""
    lora = block.lora
    return {n: (np.asarray(lora.projection(n).a_table[...]),
                np.asarray(lora.projection(n).scale_table[...], np.float64))
            for n in lora.projections}


def reference_deltas(pools: dict[str, np.ndarray], cells: dict, slot: int) -> dict:
    """``{projection: scale * B @ A [E_t, N, K]}`` of adapter ``slot``, from
    the float64 ``pools`` (``leaves``' names) and the tables."""
    out = {}
    for name, (slots, scales) in cells.items():
        module, member = POOLS[name]
        a, b = pools[f"{module}/a_pool"], pools[f"{module}/b_pool"]
        if member is not None:
            a, b = a[member], b[member]
        out[name] = np.stack([s * (b[c] @ a[c]) if c > 0 else np.zeros((b.shape[1], a.shape[2]))
                              for c, s in zip(slots[slot], scales[slot])])
    return out


def reference_loss(block: MoEBlock, params, cells, pools, x, ids, w) -> float:
    deltas = [reference_deltas(pools, cells, s) for s in range(SLOTS)]
    out = moe_block_reference(block.family, params, np.asarray(x), block.top_k,
                              np.asarray(ids), deltas)
    return float(np.sum(out * np.asarray(w, np.float64)))


def check_against_reference(block: MoEBlock, grads: dict[str, np.ndarray], x, ids, w,
                            seed: int) -> None:
    """Along a random direction ``v`` of each pool, ``<grad, v>`` equals the
    float64 reference's ``(L(p + eps v) - L(p - eps v)) / (2 eps)``."""
    rng = np.random.default_rng(seed)
    pools = leaves(nnx.state(block, nnx.LoRAParam))
    params, cells, eps = block_params(block), tables(block), 1e-4
    for name, p in pools.items():
        v = rng.standard_normal(p.shape) * np.abs(p).max()
        plus, minus = (reference_loss(block, params, cells, pools | {name: p + s * eps * v},
                                      x, ids, w) for s in (1, -1))
        want = (plus - minus) / (2 * eps)
        got = float(np.sum(grads[name] * v))
        assert abs(got - want) <= TOL_REF * abs(want), (name, got, want)


# --- tests ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_grads_equal_the_float64_reference(family):
    """Decode path: every LoRA pool of the family (router, gate and up
    stacked, down, shared gate/up and down) gets the reference's gradient."""
    block, got = decode_case(family)
    expected = {f"{POOLS[p][0]}/{f}" for p in block.lora.projections for f in ("a_pool", "b_pool")}
    assert set(got) == expected
    for name, g in got.items():
        assert np.isfinite(g).all() and np.abs(g).max() > 0, name
    check_against_reference(block, got, *inputs(1), seed=2)


def test_lora_grads_on_the_sorted_path():
    """Prefill path (every batch sorted by expert, grouped folds, the ragged
    expert GEMMs): the decode path's gradients, and the reference's."""
    block = make_block("deepseek-v3", grouped=True)
    got = leaves(lora_grad(block, *inputs(1)))
    _, decode = decode_case("deepseek-v3")
    for name in got:
        assert rel(got[name], decode[name]) <= TOL_JNP, name
    check_against_reference(block, got, *inputs(1), seed=3)


def test_lora_grads_equal_those_of_the_jnp_folds():
    block, got = decode_case("deepseek-v3")
    want = leaves(lora_grad(block, *inputs(1), impl="jnp"))
    assert sorted(got) == sorted(want)
    for name in got:
        assert rel(got[name], want[name]) <= TOL_JNP, name


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss", "deepseek-v3"])
def test_an_adapter_absent_from_the_batch_gets_zero_gradient(family):
    """Slot 2 holds an adapter that no token uses: its pool slots (and the
    reserved pool slot 0) get exact zeros; slots 0 and 1 do not."""
    block, got = decode_case(family)
    for name, g in got.items():
        assert not slot_block(block, name, g, 2).any(), name
        assert not slot_block(block, name, g, -1).any(), name
        for slot in (0, 1):
            assert slot_block(block, name, g, slot).any(), (name, slot)


def test_two_adapters_in_one_batch_each_get_their_own_gradient():
    """The mixed batch's gradient on adapter ``l``'s pool slots equals the
    gradient of a batch of only adapter ``l``'s tokens, and the mixed
    gradient is the sum of the two single-adapter ones."""
    block, mixed = decode_case("deepseek-v3")
    x, ids, w = inputs(1)
    alone = {}
    for slot in (0, 1):
        keep = np.asarray(ids) == slot
        alone[slot] = leaves(lora_grad(block, x[keep], ids[keep], w[keep]))
    for name, g in mixed.items():
        for slot, other in ((0, 1), (1, 0)):
            own = slot_block(block, name, alone[slot][name], slot)
            assert rel(slot_block(block, name, g, slot), own) <= TOL_JNP, (name, slot)
            assert not slot_block(block, name, alone[slot][name], other).any(), (name, slot)
        assert rel(g, alone[0][name] + alone[1][name]) <= TOL_JNP, name


def test_split_and_jax_grad_train_the_lora_pools_only():
    """``nnx.split(model, nnx.LoRAParam, ...)`` + ``jax.grad`` w.r.t. the LoRA
    state: the gradient of ``nnx.grad``; an optax step changes the LoRA pools
    and leaves the base weights and the adapter tables bit for bit."""
    block, want = decode_case("deepseek-v3")
    graphdef, lora_state, rest = nnx.split(block, nnx.LoRAParam, ...)
    tx = optax.adam(1e-2)
    opt_state = tx.init(lora_state)
    x, ids, w = inputs(1)

    @jax.jit
    def step(lora_state, opt_state, rest):
        def f(lora_state):
            return loss(nnx.merge(graphdef, lora_state, rest), x, ids, w)

        grads = jax.grad(f)(lora_state)
        updates, opt_state = tx.update(grads, opt_state, lora_state)
        return optax.apply_updates(lora_state, updates), opt_state, grads

    new_lora, _, grads = step(lora_state, opt_state, rest)
    got = leaves(grads)
    assert sorted(got) == sorted(want)
    for name in got:
        assert rel(got[name], want[name]) <= TOL_JNP, name
    before, after = leaves(lora_state), leaves(new_lora)
    assert all(not np.array_equal(before[n], after[n]) for n in before)
    trained = nnx.merge(graphdef, new_lora, rest)
    frozen = nnx.to_flat_state(nnx.state(block, nnx.Not(nnx.LoRAParam)))
    kept = dict(nnx.to_flat_state(nnx.state(trained, nnx.Not(nnx.LoRAParam))))
    assert len(frozen) == len(kept) and len(frozen) > 0
    for path, v in frozen:
        assert not isinstance(v, nnx.LoRAParam)
        np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(kept[path][...]))
