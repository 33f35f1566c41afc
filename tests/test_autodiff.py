"""``jax.grad`` through the folds (docs/semantics.md §5 + ``ops/autodiff.py``).

The contract: every ``impl`` is differentiable w.r.t. ``x``, ``base_out``,
``a_pool``, ``b_pool`` and ``scale_table``; integer operands get no cotangent;
the roundings are straight-through, so in f32 the gradients are those of the
exact bilinear fold; skipped rows contribute nothing to the weight and scale
gradients; the backward never gathers one A/B block per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

from _transform_cases import make_case, make_route, sorted_layout
from jax_moelora import backends, moe_lora_fold, moe_lora_gather_bgmv, moe_lora_grouped_down
from jax_moelora.ops import autodiff, jnp_fold

IMPLS = backends()["impls"]  # ["cpu", "jnp"] on a CPU, ["fast", "simple", "jnp"] on a GPU
MODES = ["dense", "tiled", "grouped"]
F32 = jnp.float32


@pytest.fixture
def force_mode(monkeypatch):
    def force(mode):
        monkeypatch.setattr(autodiff, "FORCE_MODE", mode)
    return force


def _loss(fold, case, w):
    """Scalar loss of the differentiable operands (x, base_out, a_pool, b_pool, scale)."""
    def loss(x, base, a_pool, b_pool, scale):
        route = case.route.replace(a_pool=a_pool, b_pool=b_pool, scale_table=scale)
        return jnp.sum(fold(x, base, route).astype(F32) * w)
    return loss


def _args(case):
    r = case.route
    return case.x, case.base_out, r.a_pool, r.b_pool, r.scale_table


def _grads(fold, case, w):
    return jax.jit(jax.grad(_loss(fold, case, w), argnums=range(5)))(*_args(case))


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _weights(rng, case):
    return jnp.asarray(rng.normal(size=case.base_out.shape), F32)


def _gather(case, impl, **kw):
    return lambda x, base, r: moe_lora_gather_bgmv(
        x, base, case.topk_ids.reshape(-1), r, case.row_adapter, top_k=case.top_k,
        x_gather=case.x_gather, impl=impl, **kw)


def _grouped(case, impl, offsets, stid, row_offset, row_end):
    return lambda x, base, r: moe_lora_grouped_down(
        x, base, offsets, stid, r, case.row_adapter, row_offset=row_offset, row_end=row_end,
        x_gather=case.x_gather, impl=impl)


# --- gradients equal autodiff of the pure-JAX fold (f32: exact up to summation order) --------

def _check_gather(case, impl, rng):
    w = _weights(rng, case)
    ref = _grads(lambda x, b, r: jnp_fold.gather_bgmv_jnp(
        x, b, case.topk_ids.reshape(-1), r, case.row_adapter, top_k=case.top_k,
        x_gather=case.x_gather), case, w)
    got = _grads(_gather(case, impl), case, w)
    for name, g, want in zip(("x", "base_out", "a_pool", "b_pool", "scale_table"), got, ref):
        assert g.dtype == want.dtype and g.shape == want.shape, name
        assert _rel_err(g, want) < 1e-5, name


def _check_grouped(case, impl, rng, window):
    order, offsets, stid = sorted_layout(case.topk_ids, case.route.n_experts)
    if not case.x_gather:  # x holds the sorted rows
        case = case._replace(x=case.x[order])
    lo, hi = window or (0, case.base_out.shape[0])
    w = _weights(rng, case)
    ref = _grads(lambda x, b, r: jnp_fold.grouped_down_jnp(
        x, b, offsets, stid, r, case.row_adapter, row_offset=lo, row_end=hi,
        x_gather=case.x_gather), case, w)
    got = _grads(_grouped(case, impl, offsets, stid, lo, hi), case, w)
    for name, g, want in zip(("x", "base_out", "a_pool", "b_pool", "scale_table"), got, ref):
        assert _rel_err(g, want) < 1e-5, name


@pytest.mark.parametrize("x_gather", [0, 1])
@pytest.mark.parametrize("impl", IMPLS)
def test_gather_grads_equal_autodiff_of_jnp_fold(impl, x_gather):
    rng = np.random.default_rng(10 + x_gather)
    _check_gather(make_case(rng, T=9, top_k=3, x_gather=x_gather), impl, rng)


@pytest.mark.parametrize("x_gather", [0, 1])
@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_grads_equal_autodiff_of_jnp_fold(impl, x_gather):
    rng = np.random.default_rng(20 + x_gather)
    _check_grouped(make_case(rng, T=8, top_k=2, x_gather=x_gather), impl, rng, (3, 11))


@pytest.mark.parametrize("mode", MODES)
def test_both_backward_formulations_are_exact(mode, force_mode):
    """The backward is the same traced code for every impl; both of its
    formulations (``autodiff.backward_mode``) give the exact gradients."""
    force_mode(mode)
    rng = np.random.default_rng(30)
    _check_gather(make_case(rng, T=9, top_k=3, x_gather=1), "jnp", rng)
    _check_grouped(make_case(rng, T=8, top_k=2, x_gather=0), "jnp", rng, None)


# --- numerical gradient checks (jax.test_util.check_grads, f32, order 1, reverse mode) ------

@pytest.mark.parametrize("impl", IMPLS)
def test_check_grads_gather(impl):
    rng = np.random.default_rng(1)
    case = make_case(rng, T=5, top_k=2, x_gather=1, K=8, N=8)
    w = _weights(rng, case)
    check_grads(jax.jit(_loss(_gather(case, impl), case, w)), _args(case), order=1,
                modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_check_grads_grouped(impl):
    rng = np.random.default_rng(2)
    case = make_case(rng, T=6, top_k=2, x_gather=1, K=8, N=8)
    _, offsets, stid = sorted_layout(case.topk_ids, case.route.n_experts)
    w = _weights(rng, case)
    check_grads(jax.jit(_loss(_grouped(case, impl, offsets, stid, 2, 10), case, w)),
                _args(case), order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_check_grads_moe_lora_fold_sorted_path(impl):
    rng = np.random.default_rng(3)
    case = make_case(rng, T=6, top_k=2, x_gather=0, K=8, N=8)
    w = _weights(rng, case)
    fold = lambda x, b, r: moe_lora_fold(x, b, case.topk_ids, r, case.row_adapter, x_gather=0,
                                         impl=impl, gather_max_rows=0)
    check_grads(jax.jit(_loss(fold, case, w)), _args(case), order=1, modes=["rev"],
                eps=1e-2, atol=2e-2, rtol=2e-2)


def test_moe_lora_fold_paths_have_equal_grads():
    rng = np.random.default_rng(4)
    case = make_case(rng, T=16, top_k=4, x_gather=1)
    w = _weights(rng, case)
    g = [_grads(lambda x, b, r: moe_lora_fold(x, b, case.topk_ids, r, case.row_adapter,
                                              x_gather=1, gather_max_rows=m), case, w)
         for m in (0, 4096)]
    for a, b in zip(*g):
        assert _rel_err(a, b) < 1e-5


# --- reduced precision: straight-through roundings, f32 accumulation ------------------------

@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("impl", IMPLS)
def test_low_precision_grads_close_to_f32(impl, dtype):
    rng = np.random.default_rng(5)
    case32 = make_case(rng, T=24, top_k=2, x_gather=1, K=32, N=32)
    r32 = case32.route
    route = r32.replace(a_pool=r32.a_pool.astype(dtype), b_pool=r32.b_pool.astype(dtype))
    case = case32._replace(x=case32.x.astype(dtype), base_out=case32.base_out.astype(dtype),
                           route=route)
    w = _weights(rng, case)
    want = _grads(_gather(case32, "jnp"), case32, w)
    got = _grads(_gather(case, impl), case, w)
    for name, g, ref in zip(("x", "base_out", "a_pool", "b_pool", "scale_table"), got, want):
        assert g.dtype == (F32 if name == "scale_table" else dtype), name
        err = np.linalg.norm(np.asarray(g, np.float64) - np.asarray(ref, np.float64))
        assert err <= 2e-2 * np.linalg.norm(np.asarray(ref, np.float64)), name


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("impl", IMPLS)
def test_narrow_x_under_f32_pools_has_the_grads_of_x_widened(impl, x_dtype):
    """The gather fold over bf16/f16 ``x`` with float32 pools differentiates
    as the fold over ``x.astype(float32)``: the same cotangents bit for bit,
    ``x``'s rounded to ``x``'s dtype."""
    rng = np.random.default_rng(11)
    case32 = make_case(rng, T=24, top_k=2, x_gather=1, K=32, N=32)
    case = case32._replace(x=case32.x.astype(x_dtype))
    w = _weights(rng, case)
    fold = _gather(case, impl)
    got = _grads(fold, case, w)
    want = _grads(lambda x, b, r: fold(x.astype(F32), b, r), case, w)
    assert got[0].dtype == x_dtype and float(jnp.abs(got[0].astype(F32)).max()) > 0
    for g, ref in zip(got, want):
        assert g.dtype == ref.dtype
        np.testing.assert_array_equal(np.asarray(g.astype(F32)), np.asarray(ref.astype(F32)))


# --- skip rules in the backward -------------------------------------------------------------

@pytest.mark.parametrize("impl, mode", list(zip(IMPLS, MODES)))
def test_skipped_rows_contribute_no_weight_grads(impl, mode, force_mode):
    force_mode(mode)
    rng = np.random.default_rng(6)
    case = make_case(rng, T=12, top_k=2, x_gather=0)
    rows = case.base_out.shape[0]
    folds = np.asarray(jnp.any(moe_lora_fold(case.x, case.base_out, case.topk_ids, case.route,
                                             case.row_adapter, x_gather=0) != case.base_out,
                               axis=1))
    assert 0 < folds.sum() < rows
    w = _weights(rng, case)
    fold = lambda x, b, r: moe_lora_fold(x, b, case.topk_ids, r, case.row_adapter, x_gather=0,
                                         impl=impl)
    dx, dbase, da, db, ds = _grads(fold, case, w)
    # Replacing the inputs of skipped rows changes no weight or scale gradient.
    x2 = jnp.where(folds[:, None], case.x, 100.0 * rng.normal(size=case.x.shape))
    _, _, da2, db2, ds2 = _grads(fold, case._replace(x=x2), w)
    np.testing.assert_array_equal(da, da2)
    np.testing.assert_array_equal(db, db2)
    np.testing.assert_array_equal(ds, ds2)
    np.testing.assert_array_equal(dx[~folds], 0.0)          # skipped rows: no dx
    np.testing.assert_array_equal(dbase, w)                 # d base_out = g everywhere
    # Unused pool slots and cells get exact zeros (slot 0 is never used).
    used_a = {int(a) for a in np.asarray(case.route.a_table).ravel()}
    for slot in set(range(case.route.pool_size)) - used_a:
        np.testing.assert_array_equal(da[slot], 0.0)
    np.testing.assert_array_equal(da[0], 0.0)


def test_integer_operands_get_no_cotangent():
    rng = np.random.default_rng(7)
    case = make_case(rng)
    out, vjp = jax.vjp(lambda x, ids, r, ra: moe_lora_fold(x, case.base_out, ids, r, ra,
                                                           x_gather=1),
                       case.x, case.topk_ids, case.route, case.row_adapter)
    dx, dids, droute, dra = vjp(jnp.ones_like(out))
    assert dx.shape == case.x.shape
    for ct in (dids, dra, droute.a_table, droute.b_table):
        assert ct.dtype == jax.dtypes.float0
    assert droute.scale_table.dtype == F32 and droute.a_pool.dtype == case.route.dtype


# --- the backward never materialises per-row A or B blocks ----------------------------------

def _shapes(jaxpr):
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield tuple(getattr(v.aval, "shape", ()))
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _shapes(getattr(inner, "jaxpr", inner))


@pytest.mark.parametrize("mode", MODES)
def test_backward_gathers_no_per_row_blocks(mode, force_mode):
    force_mode(mode)
    rng = np.random.default_rng(8)
    case = make_case(rng, T=300, top_k=2, x_gather=1, K=40, N=24, R=16)
    r, rows = case.route, case.base_out.shape[0]
    w = _weights(rng, case)
    fold = lambda x, b, r: moe_lora_gather_bgmv(x, b, case.topk_ids.reshape(-1), r,
                                                case.row_adapter, top_k=2, x_gather=1)
    jaxpr = jax.make_jaxpr(jax.grad(_loss(fold, case, w), argnums=range(5)))(*_args(case))
    shapes = set(_shapes(jaxpr.jaxpr))
    assert (rows, r.max_rank, r.k_in) not in shapes
    assert (rows, r.n_out, r.max_rank) not in shapes


def test_backward_mode_picks_dense_for_few_rows():
    route = make_route(np.random.default_rng(0), P=9, E=6, L=2)
    assert autodiff.backward_mode(16, route) == "dense"
    assert autodiff.backward_mode(1 << 16, route) == "tiled"


# --- training through the fold --------------------------------------------------------------

def test_adam_learns_a_teacher_adapter():
    """A student LoRA (A random, B zero, as usual) trained with optax through
    the fold's custom VJP matches a teacher's outputs on a toy MoE layer."""
    rng = np.random.default_rng(9)
    teacher = make_route(rng, P=5, R=8, K=16, N=16, L=1, E=4)
    teacher = teacher.replace(a_table=[[1, 2, 3, 4]], b_table=[[1, 2, 3, 4]],
                              scale_table=[[1.0, 1.0, 1.0, 1.0]])
    student = teacher.replace(a_pool=teacher.a_pool + 0.3 * rng.normal(size=teacher.a_pool.shape),
                              b_pool=jnp.zeros_like(teacher.b_pool))
    T, top_k = 64, 2
    x = jnp.asarray(rng.normal(size=(T, 16)), F32)
    ids = jnp.asarray(rng.integers(0, 4, (T, top_k)), jnp.int32)
    base = jnp.asarray(rng.normal(size=(T * top_k, 16)), F32)
    target = moe_lora_fold(x, base, ids, teacher, x_gather=1)
    opt = optax.adam(3e-2)
    params = (student.a_pool, student.b_pool)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        def loss(p):
            out = moe_lora_fold(x, base, ids, student.replace(a_pool=p[0], b_pool=p[1]),
                                x_gather=1)
            return jnp.mean((out - target) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for _ in range(150):
        params, state, value = step(params, state)
        losses.append(float(value))
    assert losses[-1] < 0.02 * losses[0], (losses[0], losses[-1])
