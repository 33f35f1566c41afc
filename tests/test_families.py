"""Every model family's block equals its float64 NumPy reference.

For Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V2 and DeepSeek-V3, with LoRA on
every projection (router, experts, shared experts) and without: a mixed batch
of base tokens and three adapters through the decode path (flat rows, gather
fold) and the prefill path (rows sorted by expert, grouped fold), with the
pure-JAX folds and the default backend (the C++ handlers on the CPU, the CUDA
kernels on a GPU), against ``jax_moelora.nnx.reference``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_moelora.nnx import (
    DeepSeekV2,
    DeepSeekV3,
    GptOss,
    Mixtral,
    MoEBlock,
    Qwen3MoE,
    family_config,
)
from jax_moelora.nnx.reference import (
    adapter_deltas,
    block_params,
    moe_block_reference,
    route_reference,
)
from jax_moelora.nnx.routers import select_experts
from jax_moelora.nnx.weights import load_transformers_weights
from jax_moelora.peft import PeftAdapter, ProjectionLoRA

E, H, I, T = 8, 32, 16, 40

#: family config, top_k
CASES = {
    "qwen3": (Qwen3MoE(norm_topk_prob=False), 2),
    "mixtral": (Mixtral(), 2),
    "gpt-oss": (GptOss(limit=1.0), 2),  # a small limit: both clamps act on unit-scale inputs
    "deepseek-v2": (DeepSeekV2(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                               routed_scaling_factor=2.0, n_shared=2), 3),
    "deepseek-v3": (DeepSeekV3(n_group=4, topk_group=2, routed_scaling_factor=2.5,
                               n_shared=1), 3),
}
IMPLS = ["jnp", "auto"]  # auto: the C++ handlers on CPU, the CUDA kernels on a GPU


def random_adapter(rng: np.random.Generator, block: MoEBlock, name: str, rank: int,
                   experts: np.ndarray) -> PeftAdapter:
    """Every projection of ``block.lora`` adapted, routed experts only where
    ``experts`` is True; non-zero random factors."""
    projs = {}
    for proj in block.lora.projections:
        p = block.lora.projection(proj)
        pairs = {}
        for e in range(p.n_experts):
            if p.n_experts > 1 and not experts[e]:
                continue
            a = rng.standard_normal((rank, p.k_in)).astype(np.float32) / np.sqrt(p.k_in)
            b = rng.standard_normal((p.n_out, rank)).astype(np.float32) / np.sqrt(rank)
            pairs[e] = (a, 0.8 * b, 2.0 / rank, f"layers.0.{proj}.{e}.lora_A.weight")
        projs[proj] = ProjectionLoRA.from_pairs(pairs, n_experts=p.n_experts)
    return PeftAdapter(name=name, path=None, config={}, layers={0: projs})


def make_block(family, top_k, *, grouped: bool, seed: int = 0) -> tuple[MoEBlock, list]:
    normal = nnx.initializers.normal(0.5)
    block = MoEBlock(H, I, E, top_k, family=family, max_loras=3, max_rank=8,
                     gather_max_rows=8 if grouped else 2048, bias_init=normal,
                     router_bias_init=normal, rngs=nnx.Rngs(seed))
    if block.router.correction_bias is not None:
        rng = np.random.default_rng(seed + 100)
        block.router.correction_bias[...] = jnp.asarray(0.3 * rng.standard_normal(E),
                                                        jnp.float32)
    rng = np.random.default_rng(seed + 1)
    adapters = []
    for slot, rank in enumerate((4, 8, 6)):
        experts = np.ones(E, bool) if slot < 2 else rng.random(E) < 0.5
        ad = random_adapter(rng, block, f"a{slot}", rank, experts)
        for layer in (block.lora,):
            layer.set_adapter(slot, ad.layers[0])
        adapters.append(adapter_deltas(ad.layers[0]))
    return block, adapters


def inputs(seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = rng.choice(np.array([-1, 0, 1, 2, 5], np.int32), T)  # 5 >= max_loras: base model
    return x, ids


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grouped", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("name", list(CASES))
def test_block_matches_family_reference(name, grouped, impl):
    family, top_k = CASES[name]
    block, adapters = make_block(family, top_k, grouped=grouped)
    x, ids = inputs(7)
    f = nnx.jit(lambda m, x, ids: m(x, ids, impl=impl))
    with jax.default_matmul_precision("highest"):
        y = np.asarray(f(block, jnp.asarray(x), jnp.asarray(ids)), np.float64)
    params = block_params(block)
    ref = moe_block_reference(family, params, x, top_k, ids, adapters)
    base = moe_block_reference(family, params, x, top_k)
    adapted = (ids >= 0) & (ids < 3)
    scale = np.abs(ref).max()
    # base tokens: the family's block without LoRA
    assert np.abs(y[~adapted] - base[~adapted]).max() <= 2e-5 * scale
    # adapted tokens: the LoRA deltas of every projection, relative to their size
    err = np.linalg.norm(y[adapted] - ref[adapted])
    assert err <= 1e-4 * np.linalg.norm(ref[adapted] - base[adapted]), err
    assert np.abs(y - ref).max() <= 2e-5 * scale
    # the adapters matter, and so do the family's own features
    assert np.linalg.norm(ref[adapted] - base[adapted]) > 0.1 * np.linalg.norm(base[adapted])


def test_families_differ_from_each_other():
    """The family features change the output: a reference with the feature
    removed is far from the block (so the tests above can fail)."""
    x, ids = inputs(8)
    for name, swap in (("qwen3", dict(norm_topk_prob=True)),
                       ("gpt-oss", dict(limit=50.0)),
                       ("deepseek-v2", dict(routed_scaling_factor=1.0)),
                       ("deepseek-v3", dict(n_group=1, topk_group=1))):
        family, top_k = CASES[name]
        block, adapters = make_block(family, top_k, grouped=False)
        params = block_params(block)
        ref = moe_block_reference(family, params, x, top_k, ids, adapters)
        other = moe_block_reference(dataclasses.replace(family, **swap), params, x, top_k,
                                    ids, adapters)
        assert np.abs(ref - other).max() > 1e-2 * np.abs(ref).max(), name


def test_gpt_oss_clamps_act():
    family, top_k = CASES["gpt-oss"]
    block, _ = make_block(family, top_k, grouped=False)
    x, _ = inputs(9)
    p = block_params(block)
    gu = np.einsum("th,ehn->etn", x, p["gate_up_proj"]) + p["gate_up_proj_bias"][:, None]
    assert (gu[..., 0::2] > family.limit).mean() > 0.05
    assert (np.abs(gu[..., 1::2]) > family.limit).mean() > 0.05


@pytest.mark.parametrize("given_by", ["init", "load"])
def test_gpt_oss_router_adds_the_bias_it_is_given(given_by):
    """gpt-oss's router logits are ``x @ W + b``. The test gives ``W`` and a
    non-zero ``b`` to the block (as its initializers, or as transformers
    tensors through ``load_transformers_weights``) and derives the logits,
    the chosen experts, their weights and the block's output from those
    values, never from the block's router state: a block that dropped the
    bias (no bias parameter, a zero one, logits without it) chooses other
    experts for most tokens here."""
    family, top_k = CASES["gpt-oss"]
    rng = np.random.default_rng(12)
    w = (rng.standard_normal((H, E)) / np.sqrt(H)).astype(np.float32)
    b = (2.0 * rng.standard_normal(E)).astype(np.float32)
    if given_by == "init":
        block = MoEBlock(H, I, E, top_k, family=family, lora=False, rngs=nnx.Rngs(0),
                         router_kernel_init=lambda key, shape, dtype: jnp.asarray(w, dtype),
                         router_bias_init=lambda key, shape, dtype: jnp.asarray(b, dtype))
    else:
        block = MoEBlock(H, I, E, top_k, family=family, lora=False, rngs=nnx.Rngs(0))
        prefix = "model.layers.0.mlp."
        t = transformers_tensors(rng, "gpt-oss", block, prefix)
        t |= {prefix + "router.weight": w.T.copy(), prefix + "router.bias": b}
        load_transformers_weights(block, t, prefix)
    assert block.router.bias is not None, "gpt-oss's router has no bias"
    x, _ = inputs(13)
    logits = x.astype(np.float64) @ w + b
    want = [route_reference(family, logits[t], top_k) for t in range(T)]
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(np.asarray(block.router(jnp.asarray(x)), np.float64), logits,
                                   rtol=1e-5, atol=1e-5)
        weights, ids = (np.asarray(v) for v in block.route(jnp.asarray(x), None, None, "jnp"))
        y = np.asarray(block(jnp.asarray(x)), np.float64)
    for t, (rw, rids) in enumerate(want):
        np.testing.assert_array_equal(ids[t], rids)
        np.testing.assert_allclose(weights[t], rw, rtol=1e-5)
    ref = moe_block_reference(family, {**block_params(block), "router": w, "router_bias": b},
                              x, top_k)
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    # without the bias most tokens take other experts: each check above can fail
    unbiased = [route_reference(family, lt - b, top_k)[1] for lt in logits]
    assert sum(set(u) != set(r) for u, (_, r) in zip(unbiased, want)) > T // 2

def test_deepseek_v3_correction_bias_chooses_but_does_not_weigh():
    family = DeepSeekV3(n_group=4, topk_group=2, routed_scaling_factor=1.0)
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((64, E)).astype(np.float32)
    bias = np.zeros(E, np.float32)
    bias[5] = 10.0  # expert 5 always chosen, with its own sigmoid score as weight
    w, ids = (np.asarray(v) for v in select_experts(family, jnp.asarray(logits), 3,
                                                   jnp.asarray(bias)))
    assert (ids == 5).any(axis=1).all()
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    np.testing.assert_allclose(w, np.take_along_axis(s, ids, 1)
                               / np.take_along_axis(s, ids, 1).sum(1, keepdims=True),
                               rtol=1e-6)
    for t in range(64):
        rw, rids = route_reference(family, logits[t], 3, bias)
        np.testing.assert_array_equal(np.sort(ids[t]), np.sort(rids))


@pytest.mark.parametrize("name", ["deepseek-v2", "deepseek-v3"])
def test_group_limited_choice_stays_in_kept_groups(name):
    family, top_k = CASES[name]
    rng = np.random.default_rng(4)
    logits = 3 * rng.standard_normal((200, E)).astype(np.float32)
    w, ids = (np.asarray(v) for v in select_experts(family, jnp.asarray(logits), top_k))
    groups = ids // (E // family.n_group)
    assert all(len(set(g)) <= family.topk_group for g in groups)
    assert max(len(set(g)) for g in groups) == family.topk_group  # groups do split choices
    for t in range(200):
        rw, rids = route_reference(family, logits[t], top_k)
        np.testing.assert_array_equal(ids[t], rids)
        np.testing.assert_allclose(w[t], rw, rtol=1e-6)


def test_family_options_are_checked():
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match="n_group=3 must divide num_experts=8"):
        MoEBlock(H, I, E, 2, family=DeepSeekV3(n_group=3), rngs=rngs)
    with pytest.raises(ValueError, match="top_k=5 exceeds the 4 experts"):
        MoEBlock(H, I, E, 5, family=DeepSeekV2(n_group=4, topk_group=2), rngs=rngs)
    with pytest.raises(ValueError, match="groups of 1 experts"):
        MoEBlock(H, I, E, 2, family=DeepSeekV3(n_group=8, topk_group=2), rngs=rngs)
    with pytest.raises(ValueError, match="norm_topk_prob: the gpt-oss family"):
        MoEBlock(H, I, E, 2, family="gpt-oss", norm_topk_prob=True, rngs=rngs)
    with pytest.raises(ValueError, match="family must be"):
        family_config("llama")
    assert MoEBlock(H, I, E, 2, norm_topk_prob=False, rngs=rngs).family == Qwen3MoE(False)
    assert family_config("deepseek") == DeepSeekV3()


def test_group_mask_fills_zero_as_transformers_does():
    """Experts outside the kept groups score 0.0 for the choice (not -inf): with
    corrected scores all negative, the choice lands outside the kept groups,
    lowest ids first, as in transformers' DeepSeek-V3 router."""
    family = DeepSeekV3(n_group=4, topk_group=2)
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((16, E)).astype(np.float32)
    bias = np.full(E, -5.0, np.float32)
    _, ids = select_experts(family, jnp.asarray(logits), 3, jnp.asarray(bias))
    for t in range(16):
        _, rids = route_reference(family, logits[t], 3, bias)
        np.testing.assert_array_equal(np.asarray(ids[t]), rids)
    s = 1 / (1 + np.exp(-logits.astype(np.float64))) + bias
    top2 = np.sort(s.reshape(16, 4, 2), axis=-1).sum(-1)
    kept = np.argsort(-top2, axis=1, kind="stable")[:, :2]
    for t in range(16):
        assert not np.isin(np.asarray(ids[t]) // 2, kept[t]).any()


@pytest.mark.parametrize("grouped", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_block_stays_near_the_reference(name, grouped):
    """bf16 activations and weights (the default backend's folds: the fast
    CUDA kernels on a GPU): within the roundings of bf16 of the float64
    reference on the bf16 inputs."""
    family, top_k = CASES[name]
    normal = nnx.initializers.normal(0.5)
    block = MoEBlock(H, I, E, top_k, family=family, max_loras=3, max_rank=8,
                     dtype=jnp.bfloat16, bias_init=normal, router_bias_init=normal,
                     gather_max_rows=8 if grouped else 2048, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    adapters = []
    for slot, rank in enumerate((4, 8, 6)):
        ad = random_adapter(rng, block, f"a{slot}", rank, np.ones(E, bool))
        block.lora.set_adapter(slot, ad.layers[0])
        adapters.append(adapter_deltas(ad.layers[0]))
    x, ids = inputs(7)
    y = nnx.jit(lambda m, x, ids: m(x, ids))(block, jnp.asarray(x), jnp.asarray(ids))
    assert y.dtype == jnp.bfloat16
    y = np.asarray(y, np.float64)
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    ref = moe_block_reference(family, block_params(block), xb, top_k, ids, adapters)
    assert np.linalg.norm(y - ref) <= 1.5e-2 * np.linalg.norm(ref)
    assert np.abs(y - ref).max() <= 3e-2 * np.abs(ref).max()


def transformers_tensors(rng, name: str, block: MoEBlock, prefix: str) -> dict:
    """Random tensors with transformers 5's key names and layouts for ``block``."""
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    t = {}
    if name == "gpt-oss":
        t |= {"router.weight": r(E, H), "router.bias": r(E),
              "experts.gate_up_proj": r(E, H, 2 * I), "experts.gate_up_proj_bias": r(E, 2 * I),
              "experts.down_proj": r(E, I, H), "experts.down_proj_bias": r(E, H)}
    else:
        t |= {"gate.weight": r(E, H), "experts.gate_up_proj": r(E, 2 * I, H),
              "experts.down_proj": r(E, H, I)}
    if name == "deepseek-v3":
        t["gate.e_score_correction_bias"] = r(E)
    if block.shared_experts is not None:
        S = block.family.n_shared_experts * I
        t |= {"shared_experts.gate_proj.weight": r(S, H), "shared_experts.up_proj.weight": r(S, H),
              "shared_experts.down_proj.weight": r(H, S)}
    return {prefix + k: v for k, v in t.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_transformers_weights_load_into_the_block(name):
    family, top_k = CASES[name]
    block = MoEBlock(H, I, E, top_k, family=family, lora=False, rngs=nnx.Rngs(0))
    prefix = "model.layers.0.mlp."
    t = transformers_tensors(np.random.default_rng(6), name, block, prefix)
    used = load_transformers_weights(block, t, prefix)
    assert sorted(used) == sorted(t)
    p = block_params(block)
    # one token through one expert, written the way the torch modules compute it
    x = np.random.default_rng(7).standard_normal(H)
    if name == "gpt-oss":
        gu = x @ t[prefix + "experts.gate_up_proj"][3] + t[prefix + "experts.gate_up_proj_bias"][3]
        np.testing.assert_allclose(x @ p["gate_up_proj"][3] + p["gate_up_proj_bias"][3], gu,
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(x @ p["router"] + p["router_bias"],
                                   t[prefix + "router.weight"] @ x + t[prefix + "router.bias"],
                                   rtol=1e-5, atol=1e-5)
    else:
        gate, up = np.split(t[prefix + "experts.gate_up_proj"][3] @ x, 2)  # chunk(2, -1)
        np.testing.assert_allclose(x @ p["gate_proj"][3], gate, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(x @ p["up_proj"][3], up, rtol=1e-5, atol=1e-5)
        h = np.random.default_rng(8).standard_normal(I)
        np.testing.assert_allclose(h @ p["down_proj"][3], t[prefix + "experts.down_proj"][3] @ h,
                                   rtol=1e-5, atol=1e-5)
    if block.shared_experts is not None:
        np.testing.assert_allclose(x @ p["shared_gate"],
                                   t[prefix + "shared_experts.gate_proj.weight"] @ x,
                                   rtol=1e-5, atol=1e-5)
    with jax.default_matmul_precision("highest"):
        y = np.asarray(block(jnp.asarray(x[None], jnp.float32)), np.float64)
    np.testing.assert_allclose(y, moe_block_reference(family, p, x[None], top_k),
                               rtol=1e-4, atol=1e-4 * np.abs(y).max())
    bad = dict(t)
    bad[prefix + "experts.down_proj"] = bad[prefix + "experts.down_proj"][:, :, :-1]
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts.down_proj' has shape"):
        load_transformers_weights(block, bad, prefix)
    del bad[prefix + "experts.down_proj"]
    with pytest.raises(KeyError, match="no tensor 'model.layers.0.mlp.experts.down_proj'"):
        load_transformers_weights(block, bad, prefix)


def test_per_expert_modules_load_like_fused_experts():
    rng = np.random.default_rng(9)
    fused = MoEBlock(H, I, E, 2, family="mixtral", lora=False, rngs=nnx.Rngs(0))
    t = transformers_tensors(rng, "mixtral", fused, "")
    load_transformers_weights(fused, t)
    per = {"gate.weight": t["gate.weight"]}
    for e in range(E):
        per[f"experts.{e}.w1.weight"] = t["experts.gate_up_proj"][e, :I]
        per[f"experts.{e}.w3.weight"] = t["experts.gate_up_proj"][e, I:]
        per[f"experts.{e}.w2.weight"] = t["experts.down_proj"][e]
    block = MoEBlock(H, I, E, 2, family="mixtral", lora=False, rngs=nnx.Rngs(1))
    load_transformers_weights(block, per)
    for k, v in block_params(fused).items():
        np.testing.assert_array_equal(block_params(block)[k], v)
