"""Bit-exact folds and gradients on dyadic inputs (docs/semantics.md §5, §6).

Inputs are small multiples of 1/4 (``x``, the pools, ``base_out``, the
cotangent) and scales are dyadic (0.75, -0.625, ...), with sizes small enough
that every fp32 sum and product of the fold is exact, in any summation order.
The only inexact steps left are the three roundings to the activation dtype,
so every backend must equal the float64 reference BIT FOR BIT, not within a
tolerance. Each case also checks that it can see the roundings: the same
reference without the rounding of ``xa`` (or of ``delta``) gives other bits.

The backward is held to a float64 reference built from the ROUNDED ``xa``
(the straight-through rule of ``ops/autodiff.py``), in dense and tiled mode:
with power-of-two scales and a small integer cotangent the ``b_pool`` gradient is
exact (bit for bit), and the ``scale_table`` gradient is within fp32 summation
error, far closer than the gradient of the unrounded ``xa`` would be.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _fold_cases import (assert_ulp_close, bits, make_gather_case, make_grouped_case, on_platform,
                         to_device)
from jax_moelora import MoeExpertRoute, moe_lora_gather_bgmv, moe_lora_grouped_down
from jax_moelora.ops import autodiff
from jax_moelora.reference import round_to

GPU = pytest.mark.gpu
IMPLS = ["cpu", "jnp", pytest.param("simple", marks=GPU), pytest.param("fast", marks=GPU)]
LOW = [jnp.bfloat16, jnp.float16]
LOW_IDS = ["bf16", "f16"]
FOLD_SCALES = np.array([0.75, -0.625, 1.25, -1.5], np.float32)
GRAD_SCALES = np.array([0.5, -2.0, 1.0, -0.25], np.float32)   # s * xa exact in the dtype
# Quarter steps k / 4: |x|, |A| <= 8 and |B| <= 2 (representable in bf16 and f16).
Q_XA, Q_B = 32, 8
K_IN, N_OUT, RANK = 48, 24, 16


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _quarters(rng, shape, qmax):
    return rng.integers(-qmax, qmax + 1, shape).astype(np.float64) / 4


def _dyadic(case, rng, scales):
    """``case`` with dyadic x, base_out, pools (rank padding kept zero) and scales."""
    dt = case.dtype
    r = case.route
    a0, b0 = np.asarray(r.a_pool, np.float64), np.asarray(r.b_pool, np.float64)
    a_pool = np.where(a0 != 0, _quarters(rng, a0.shape, Q_XA), 0.0)
    b_pool = np.where(b0 != 0, _quarters(rng, b0.shape, Q_B), 0.0)
    st = rng.choice(scales, np.asarray(r.scale_table).shape).astype(np.float32)
    route = MoeExpertRoute(a_pool=a_pool.astype(dt), b_pool=b_pool.astype(dt),
                           a_table=r.a_table, b_table=r.b_table, scale_table=st)
    x = _quarters(rng, case.x.shape, Q_XA).astype(dt)
    base = _quarters(rng, case.base_out.shape, 4).astype(dt)
    import dataclasses
    return dataclasses.replace(case, x=x, base_out=base, route=route)


def _case(rng, op, dtype, x_gather, num_loras, scales):
    kw = dict(dtype=dtype, num_loras=num_loras, n_experts=5, k_in=K_IN, n_out=N_OUT,
              ranks=(8, RANK), max_rank=RANK, x_gather=x_gather, poison=False)
    make = make_gather_case if op == "gather" else make_grouped_case
    if op == "grouped":
        kw.update(rows_per_expert=6, extra_experts=1, lead=2, tail=2)
    else:
        kw.update(num_tokens=10, top_k=3)
    return _dyadic(make(rng, **kw), rng, scales)


def _pairs(case):
    """(row, x_row, a, b, scale, cell) of every folded row, from the rule in the case."""
    r = case.route
    at, bt, st = (np.asarray(t) for t in (r.a_table, r.b_table, r.scale_table))
    L = at.shape[0]
    ra = case.row_adapter
    out = []
    if case.op == "gather":
        top_k = case.kw["top_k"]
        for row in np.nonzero(case.fold_rows)[0]:
            t = row // top_k
            l = 0 if (L == 1 or ra is None) else int(ra[t])
            e = int(case.ids["indices"][row])
            out.append((row, t if case.kw["x_gather"] else row, at[l, e], bt[l, e], st[l, e],
                        (l, e)))
    else:
        offs, stid = case.ids["expert_offsets"], case.ids["sorted_token_ids"]
        for row in np.nonzero(case.fold_rows)[0]:
            e = int(np.searchsorted(offs, row, side="right") - 1)
            t = int(stid[row])
            l = 0 if (L == 1 or ra is None) else int(ra[t])
            out.append((row, t if case.kw["x_gather"] else row, at[l, e], bt[l, e], st[l, e],
                        (l, e)))
    return out


def _forward64(case, round_xa=True, round_delta=True):
    """float64 fold of the folded rows, optionally without a rounding."""
    dt = case.dtype
    a_pool = np.asarray(case.route.a_pool, np.float64)
    b_pool = np.asarray(case.route.b_pool, np.float64)
    x = case.x.astype(np.float64)
    out = case.base_out.copy()
    for row, xr, a, b, s, _ in _pairs(case):
        xa = a_pool[a] @ x[xr]
        xa = round_to(xa, dt) if round_xa else xa
        delta = b_pool[b] @ xa
        delta = round_to(delta, dt) if round_delta else delta
        out[row] = (out[row].astype(np.float64) + np.float64(s) * delta).astype(dt)
    return out


def _assert_exact_in_fp32(case):
    """Every partial sum of the forward is a multiple of 2**-6 below 2**15, so
    fp32 (24-bit significand) holds it exactly in any order, and no value
    overflows f16."""
    a_pool = np.abs(np.asarray(case.route.a_pool, np.float64))
    b_pool = np.abs(np.asarray(case.route.b_pool, np.float64))
    x = np.abs(case.x.astype(np.float64))
    for _, xr, a, b, s, _ in _pairs(case):
        xa_bound = a_pool[a] @ x[xr]
        assert xa_bound.max() < 2**15
        assert (b_pool[b] @ round_to(xa_bound, case.dtype)).max() < 2**15


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("op", ["gather", "grouped"])
@pytest.mark.parametrize("x_gather", [0, 1], ids=["xg0", "xg1"])
def test_fold_equals_the_float64_reference_bit_for_bit(rng, impl, dtype, op, x_gather):
    case = _case(rng, op, dtype, x_gather, num_loras=3, scales=FOLD_SCALES)
    _assert_exact_in_fp32(case)
    want = case.reference()
    np.testing.assert_array_equal(bits(_forward64(case)), bits(want))
    fold = case.fold_rows
    # the case sees both roundings: without either one, folded rows change
    for drop in ({"round_xa": False}, {"round_delta": False}):
        changed = (bits(_forward64(case, **drop)) != bits(want)).any(axis=1)
        assert changed[fold].mean() > 0.3, (drop, changed[fold].mean())
    out = case.run(impl)
    if impl == "jnp" and jax.default_backend() == "gpu":
        # XLA:GPU compiles the jnp fold's dots and adds as it chooses (fusions,
        # contractions); there jnp is held to the 2-ulp criterion of §6
        assert_ulp_close(out, want, "jnp fold on the GPU")
        return
    diff = np.argwhere(bits(out) != bits(want))
    assert diff.size == 0, f"{len(diff)} values differ from the reference, first at {diff[:5]}"


# ------------------------------------------------------------------- backward

def _backward64(case, g, round_xa=True):
    """float64 gradients of sum(out * g) w.r.t. b_pool and scale_table
    (straight-through roundings, ``xa`` rounded as in the forward)."""
    dt = case.dtype
    a_pool = np.asarray(case.route.a_pool, np.float64)
    b_pool = np.asarray(case.route.b_pool, np.float64)
    x = case.x.astype(np.float64)
    db = np.zeros_like(b_pool)
    ds = np.zeros(np.asarray(case.route.scale_table).shape)
    for row, xr, a, b, s, (l, e) in _pairs(case):
        xa = a_pool[a] @ x[xr]
        xa = round_to(xa, dt) if round_xa else xa
        gB = g[row] @ b_pool[b]                       # [R]
        db[b] += np.float64(s) * np.outer(g[row], xa)
        ds[l, e] += xa @ gB
    return db.astype(dt), ds.astype(np.float32)


def _grads(case, impl, g):
    with on_platform(impl):
        x, base, *ids, route, ra = to_device(case.operands())
        fn = {"gather": moe_lora_gather_bgmv, "grouped": moe_lora_grouped_down}[case.op]
        kw = case.keywords()

        def loss(b_pool, scale):
            r = route.replace(b_pool=b_pool, scale_table=scale)
            out = fn(x, base, *ids, r, ra, impl=impl, **kw)
            return jnp.sum(out.astype(jnp.float32) * g)

        db, ds = jax.jit(jax.grad(loss, argnums=(0, 1)))(route.b_pool, route.scale_table)
        return np.asarray(db), np.asarray(ds)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["dense", "tiled"])
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("op", ["gather", "grouped"])
def test_backward_uses_the_rounded_xa(rng, monkeypatch, impl, mode, dtype, op):
    monkeypatch.setattr(autodiff, "FORCE_MODE", mode)
    case = _case(rng, op, dtype, x_gather=1, num_loras=2, scales=GRAD_SCALES)
    g = rng.integers(-3, 4, case.base_out.shape).astype(np.float32)
    db_want, ds_want = _backward64(case, g)
    db_raw, ds_raw = _backward64(case, g, round_xa=False)
    ds_tol = 32 * float(np.spacing(np.abs(ds_want).max()))   # fp32 summation error
    # the case can tell the two apart
    assert (bits(db_want) != bits(db_raw)).sum() >= 5
    assert np.abs(ds_raw - ds_want).max() > 10 * ds_tol
    db, ds = _grads(case, impl, jnp.asarray(g))
    np.testing.assert_array_equal(bits(db), bits(db_want), err_msg="b_pool gradient")
    np.testing.assert_allclose(ds, ds_want, rtol=0, atol=ds_tol, err_msg="scale_table gradient")
