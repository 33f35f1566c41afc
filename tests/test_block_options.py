"""Every ``MoEBlock`` option against an independent float64 reference.

The reference is written here from the block's documented math (router
logits + router LoRA delta -> softmax -> top-k, renormalised only with
``norm_topk_prob`` -> per expert ``down(silu(gate(x)) * up(x))``, each
projection plus ``scale * (x A^T) B^T`` of the token's adapter), reading only
the block's weights and tables, never the library's folds. Every option
(``norm_topk_prob``, ``expert_path``, ``expert_gemm``, ``gather_max_rows``,
``impl``, ``max_loras``, ``lora``, ``use_lora``, ``dtype``, ``router_dtype``) is run
with LoRA deltas large enough that a wrong choice shows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_moelora import _ext
from jax_moelora.nnx import MoEBlock, experts

H, I, E, TOP_K, RANK = 16, 24, 8, 3, 8
T = 10
GPU = pytest.mark.gpu


def _impls():
    return ["cpu", "jnp", pytest.param("fast", marks=GPU), pytest.param("simple", marks=GPU)]


def _platform(impl):
    import contextlib
    if impl == "cpu":
        return jax.default_device(jax.devices("cpu")[0])
    return contextlib.nullcontext()


def _install(block: MoEBlock, seed: int, slots) -> None:
    """Random adapters with non-zero B in ``slots`` (every projection; a few
    experts left unadapted)."""
    rng = np.random.default_rng(seed)
    for slot in slots:
        for name in ("router", "gate", "up", "down"):
            proj = block.lora.projection(name)
            e, k, n = proj.n_experts, proj.k_in, proj.n_out
            a = rng.normal(0, k**-0.5, (e, RANK, k))
            b = rng.normal(0, RANK**-0.5, (e, n, RANK)) * (2.0 if name == "router" else 0.5)
            present = rng.random(e) < 0.8
            present[0] = True
            scale = rng.uniform(0.5, 1.5, e) * rng.choice([-1, 1], e)
            proj.write_slot(slot, a, b, scale, present)


def _np(v):
    return np.asarray(jnp.asarray(v).astype(jnp.float32), np.float64)


def _delta(proj, xin, e: int, adapter: int) -> np.ndarray:
    """``scale * (xin A^T) B^T`` of the token's adapter for expert ``e`` (0 when it skips)."""
    at, bt = np.asarray(proj.a_table[...]), np.asarray(proj.b_table[...])
    st = np.asarray(proj.scale_table[...])
    L, P = at.shape[0], proj.pool_size
    if adapter < 0:
        return 0.0
    l = 0 if L == 1 else adapter
    if l >= L:
        return 0.0
    a, b = int(at[l, e]), int(bt[l, e])
    if not (0 < a < P and 0 < b < P):
        return 0.0
    A, B = _np(proj.a_pool[...])[a], _np(proj.b_pool[...])[b]
    return float(st[l, e]) * (B @ (A @ xin))


def reference(block: MoEBlock, x, adapter_ids, *, use_lora: bool = True) -> np.ndarray:
    x = _np(jnp.asarray(x).astype(block.dtype))
    wr = _np(block.router.kernel[...])
    wg, wu, wd = _np(block.gate_proj[...]), _np(block.up_proj[...]), _np(block.down_proj[...])
    lora = block.lora if (use_lora and adapter_ids is not None) else None
    ids = np.full(x.shape[0], -1) if adapter_ids is None else np.asarray(adapter_ids)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        xt, l = x[t], int(ids[t])
        logits = xt @ wr
        if lora is not None:
            logits = logits + _delta(lora.router, xt, 0, l)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:block.top_k]
        w = p[top]
        if block.norm_topk_prob:
            w = w / w.sum()
        for wk, e in zip(w, top):
            g, u = xt @ wg[e], xt @ wu[e]
            if lora is not None:
                g = g + _delta(lora.gate, xt, e, l)
                u = u + _delta(lora.up, xt, e, l)
            h = g / (1 + np.exp(-g)) * u
            d = h @ wd[e]
            if lora is not None:
                d = d + _delta(lora.down, h, e, l)
            y[t] += wk * d
    return y


def _block(seed=0, **kw) -> MoEBlock:
    kw.setdefault("max_rank", RANK)
    block = MoEBlock(H, I, E, TOP_K, rngs=nnx.Rngs(seed), **kw)
    if block.lora is not None:
        _install(block, seed + 1, range(block.lora.max_loras))
    return block


def _inputs(seed, max_loras):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(T, H)).astype(np.float32)
    ids = rng.integers(0, max_loras, T)
    ids[:3] = [-1, max_loras, 2**31 - 1]      # base model, past the slots
    return x, ids.astype(np.int32)


def _run(block, x, ids, impl=None, **kw):
    with _platform(impl or block.impl):
        return np.asarray(jax.jit(lambda x, i: block(x, i, impl=impl, **kw))(
            jnp.asarray(x), None if ids is None else jnp.asarray(ids)), np.float64)


def _close(got, want, rtol=2e-4):
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("norm_topk_prob, expert_path",
                         [(True, "auto"), (True, "dense"), (True, "ragged"), (False, "auto")],
                         ids=["norm-auto", "norm-dense", "norm-ragged", "no_norm-auto"])
@pytest.mark.parametrize("gather_max_rows", [4096, 8], ids=["decode", "prefill"])
def test_block_matches_reference(impl, norm_topk_prob, expert_path, gather_max_rows):
    with _platform(impl):
        block = _block(norm_topk_prob=norm_topk_prob, expert_path=expert_path,
                       gather_max_rows=gather_max_rows, impl=impl, max_loras=3)
    x, ids = _inputs(1, 3)
    want = reference(block, x, ids)
    _close(_run(block, x, ids), want)
    # the adapters matter for this input
    assert np.abs(want - reference(block, x, None)).max() > 0.05 * np.abs(want).max()


def test_norm_topk_prob_false_keeps_the_softmax_weights():
    x, ids = _inputs(2, 3)
    normed = _block(norm_topk_prob=True, impl="jnp", max_loras=3)
    raw = _block(norm_topk_prob=False, impl="jnp", max_loras=3)
    y_n, y_r = _run(normed, x, ids), _run(raw, x, ids)
    _close(y_r, reference(raw, x, ids))
    # same weights, so the two differ by the top-k mass per token (< 1 with E = 8, k = 3)
    assert np.abs(y_n - y_r).max() > 0.1 * np.abs(y_n).max()


@pytest.mark.parametrize("max_loras", [1, 2])
def test_max_loras(max_loras):
    block = _block(max_loras=max_loras, impl="cpu")
    x, ids = _inputs(3, max_loras)
    ids[3:] = np.arange(T - 3) % 4           # values >= L fold nothing unless L == 1
    _close(_run(block, x, ids), reference(block, x, ids))


def test_block_without_lora_state_is_the_base_block():
    block = _block(lora=False, impl="cpu")
    assert block.lora is None
    x, ids = _inputs(4, 2)
    _close(_run(block, x, ids), reference(block, x, None))


def test_use_lora_false_and_no_adapter_ids_run_the_base_block():
    block = _block(impl="cpu", max_loras=3)
    x, ids = _inputs(5, 3)
    base = reference(block, x, None)
    _close(_run(block, x, ids, use_lora=False), base)
    _close(_run(block, x, None), base)
    assert np.abs(reference(block, x, ids) - base).max() > 0.05 * np.abs(base).max()


def test_call_impl_overrides_the_block_impl():
    block = _block(impl="cpu", max_loras=3)
    x, ids = _inputs(6, 3)
    want = reference(block, x, ids)
    _close(_run(block, x, ids, impl="jnp"), want)


@pytest.mark.parametrize("dtype, router_dtype, rtol",
                         [(jnp.bfloat16, jnp.float32, 4e-2), (jnp.float16, jnp.float32, 8e-3),
                          (jnp.float32, jnp.bfloat16, 4e-2)],
                         ids=["bf16", "f16", "bf16_router"])
def test_dtypes(dtype, router_dtype, rtol):
    block = _block(dtype=dtype, router_dtype=router_dtype, impl="cpu", max_loras=3)
    x, ids = _inputs(7, 3)
    out = _run(block, x, ids)
    with _platform("cpu"):
        assert block(jnp.asarray(x), jnp.asarray(ids)).dtype == jnp.dtype(dtype)
    _close(out, reference(block, x, ids), rtol=rtol)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_router_fold_reads_the_activations_as_they_are(dtype):
    """Under a float32 router the router's fold takes ``x`` in the activation
    dtype (no float32 copy of ``x`` is made for it: the gather custom call's
    ``x`` operand is ``[T, H]`` bf16/f16), and the routing has the bits of the
    fold over ``x`` in float32."""
    import re

    from jax_moelora import moe_lora_gather_bgmv

    block = _block(dtype=dtype, impl="cpu", max_loras=3)
    x, ids = _inputs(9, 3)
    xd, ids = jnp.asarray(x, dtype), jnp.asarray(ids)
    routes = block.lora.routes()
    route = jax.jit(lambda x, i: block.route(x, i, routes, "cpu"))

    def wide(x, i):
        xr = x.astype(jnp.float32)
        logits = moe_lora_gather_bgmv(xr, block.router(xr), jnp.zeros((T,), jnp.int32),
                                      routes.router, i, top_k=1, x_gather=0, impl="cpu")
        return block.router.select(logits)

    with _platform("cpu"):
        hlo = route.lower(xd, ids).as_text()
        calls = [ln for ln in hlo.splitlines()
                 if re.search(rf"custom_call @{_ext.GATHER_BGMV_TARGET}\b", ln)]
        got, want = route(xd, ids), jax.jit(wide)(xd, ids)
    name = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "f16"}[jnp.dtype(dtype)]
    assert len(calls) == 1 and f"(tensor<{T}x{H}x{name}>" in calls[0]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_leading_shape_is_kept():
    block = _block(impl="jnp", max_loras=3)
    x, ids = _inputs(8, 3)
    y = block(jnp.asarray(x).reshape(2, T // 2, H), jnp.asarray(ids).reshape(2, T // 2))
    assert y.shape == (2, T // 2, H)
    _close(np.asarray(y, np.float64).reshape(T, H), reference(block, x, ids))


def test_adapter_ids_outside_int32_are_refused():
    """A NumPy int64 adapter id that int32 cannot hold is an error naming it,
    never a silently wrapped slot (2**32 + 1 would wrap to slot 1)."""
    block = _block(max_loras=2)
    x, ids = _inputs(0, 2)
    ids = ids.astype(np.int64)
    ids[4] = 2**32 + 1
    with pytest.raises(OverflowError, match=r"MoEBlock: adapter_ids holds 4294967297 at index 4"):
        block(jnp.asarray(x), ids)


# ------------------------------------------------------------------ expert_gemm

GEMMS = ["auto", "ragged_dot", "expert_matmul"]


@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 2e-4), (jnp.bfloat16, 4e-2)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("gather_max_rows, expert_path",
                         [(8, "auto"), (4096, "ragged")], ids=["prefill", "decode-ragged"])
def test_expert_gemm_options_agree(dtype, rtol, gather_max_rows, expert_path):
    """The grouped GEMM of the ragged path (ragged_dot, expert_matmul, auto):
    the same block output, each against the reference; on the CPU ``auto`` is
    ``ragged_dot`` bit for bit."""
    x, ids = _inputs(9, 3)
    outs = {}
    for gemm in GEMMS:
        block = _block(expert_gemm=gemm, expert_path=expert_path,
                       gather_max_rows=gather_max_rows, dtype=dtype, max_loras=3)
        outs[gemm] = _run(block, x, ids)
        _close(outs[gemm], reference(block, x, ids), rtol=rtol)
    _close(outs["expert_matmul"], outs["ragged_dot"], rtol=rtol / 4)
    if not _ext.cuda_available():
        np.testing.assert_array_equal(outs["auto"], outs["ragged_dot"])


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("gather_max_rows, expert_path",
                         [(8, "auto"), (4096, "auto"), (4096, "ragged")],
                         ids=["prefill", "decode", "decode-ragged"])
def test_forward_has_no_while_loop(gemm, gather_max_rows, expert_path):
    """The block's forward (routing, row sort, GEMMs, folds) holds no while
    loop: on the GPU every step of one reads its predicate back to the host
    (a ``jnp.searchsorted`` in the row sort cost the prefill step 12 %)."""
    x, ids = _inputs(11, 3)
    for impl in ("cpu", "jnp"):
        block = _block(expert_gemm=gemm, expert_path=expert_path,
                       gather_max_rows=gather_max_rows, max_loras=3, impl=impl)
        with _platform(impl):  # impl="cpu" lowers for the CPU, also on a GPU machine
            hlo = jax.jit(lambda x, i: block(x, i)).lower(jnp.asarray(x),
                                                          jnp.asarray(ids)).as_text()
        assert "stablehlo.while" not in hlo, impl


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss"])
def test_expert_gemm_gradients_agree(family):
    """Training through the ragged path: the gradients w.r.t. the expert
    weights, the LoRA parameters and the input are those of ``ragged_dot``."""
    x, ids = _inputs(10, 3)

    def grads(gemm):
        block = _block(family=family, expert_gemm=gemm, gather_max_rows=8, max_loras=3)

        def loss(block, x):
            return jnp.sum(jnp.sin(block(x, jnp.asarray(ids))))

        return jax.jit(nnx.grad(loss, argnums=(0, 1)))(block, jnp.asarray(x))

    want = jax.tree.leaves(grads("ragged_dot"))
    got = jax.tree.leaves(grads("expert_matmul"))
    assert len(got) == len(want) and len(want) > 5
    for g, w in zip(got, want):
        w = np.asarray(w, np.float64)
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=0,
                                   atol=1e-4 * max(np.abs(w).max(), 1e-6))


def test_expert_gemm_auto_picks_the_kernel_per_lowering_platform(monkeypatch):
    """Where the kernel runs, ``auto`` is a ``platform_dependent``:
    ``expert_matmul`` when the program is lowered for CUDA, ``ragged_dot``
    for any other platform (exported here without a GPU, with a stand-in for
    the expert_matmul branch)."""
    monkeypatch.setattr(experts, "grouped_gemm_runs_kernel", lambda *a: True)
    def stand_in(xs, ws, sizes, stacked):
        outs = tuple(jnp.full((xs.shape[0], w.shape[2]), 1024.0, xs.dtype) for w in ws)
        return jnp.stack(outs) if stacked else outs

    monkeypatch.setattr(experts, "_expert_matmul", stand_in)
    block = _block(gather_max_rows=8, lora=False, dtype=jnp.bfloat16)
    x = jnp.asarray(_inputs(11, 2)[0])
    f = jax.jit(lambda x: block(x))
    cuda = jax.export.export(f, platforms=["cuda"])(x).mlir_module()
    cpu = jax.export.export(f, platforms=["cpu"])(x).mlir_module()
    assert "1.024000e+03" in cuda and "ragged_dot" not in cuda
    assert "1.024000e+03" not in cpu and "ragged_dot" in cpu
    # run on the CPU device (also where a GPU is present): the CPU lowering, ragged_dot
    ragged = _block(gather_max_rows=8, lora=False, dtype=jnp.bfloat16, expert_gemm="ragged_dot")
    np.testing.assert_array_equal(_run(block, x, None, impl="cpu"),
                                  _run(ragged, x, None, impl="cpu"))


def test_bad_expert_gemm_is_refused():
    with pytest.raises(ValueError, match="expert_gemm must be one of"):
        _block(expert_gemm="cutlass")


def _calls_kernel(block, x, ids) -> bool:
    """Whether the block's lowered program calls the expert_matmul custom call."""
    text = jax.jit(lambda x, i: block(x, i)).lower(jnp.asarray(x), jnp.asarray(ids)).as_text()
    return f"custom_call @{_ext.EXPERT_MATMUL_TARGET}(" in text


@GPU
@pytest.mark.parametrize("family", ["qwen3", "gpt-oss"])
def test_expert_gemm_auto_runs_the_cutlass_kernel_on_gpu(family):
    """bf16 prefill on an sm_90 GPU: ``auto`` lowers the ragged path's GEMMs
    to the expert_matmul custom call and matches ``ragged_dot`` and the
    reference; decode-sized batches keep the dense einsum path."""
    assert experts.grouped_gemm_runs_kernel(jnp.bfloat16, H, I), "the CUTLASS kernel does not run"
    x, ids = _inputs(12, 3)
    kw = dict(family=family, dtype=jnp.bfloat16, max_loras=3)
    prefill = _block(gather_max_rows=8, **kw)
    assert _calls_kernel(prefill, x, ids)
    ragged = _block(gather_max_rows=8, expert_gemm="ragged_dot", **kw)
    assert not _calls_kernel(ragged, x, ids)
    got, want = _run(prefill, x, ids), _run(ragged, x, ids)
    _close(got, want, rtol=1e-2)
    if family == "qwen3":  # the reference here is the GLU families' math
        _close(got, reference(prefill, x, ids), rtol=4e-2)
    decode = _block(gather_max_rows=4096, **kw)
    assert not _calls_kernel(decode, x, ids)


@GPU
def test_expert_gemm_kernel_gradients_on_gpu():
    """The kernel's custom VJP in a training step: the gradients of ``auto``
    (the kernel forward) equal those of ``ragged_dot`` within bf16 error."""
    x, ids = _inputs(13, 3)

    def grads(gemm):
        block = _block(expert_gemm=gemm, gather_max_rows=8, dtype=jnp.bfloat16, max_loras=3)

        def loss(block, x):
            return jnp.sum(jnp.sin(block(x, jnp.asarray(ids)).astype(jnp.float32)))

        return jax.jit(nnx.grad(loss, argnums=(0, 1)))(block, jnp.asarray(x))

    for g, w in zip(jax.tree.leaves(grads("auto")), jax.tree.leaves(grads("ragged_dot"))):
        w = np.asarray(w, np.float64)
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=0,
                                   atol=5e-2 * max(np.abs(w).max(), 1e-6))
