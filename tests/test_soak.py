"""Soak test: many decode steps in ONE jitted program (``lax.fori_loop``).

Every step derives a fresh case from ``fold_in(key, step)``: expert ids (some
negative or past the table), per-token adapters (some ``-1`` or ``>= L``),
adapter pools and tables (cells 0, negative or past the pool among them),
scales, ``x`` and ``base_out``. It runs the gather fold (decode, ``x_gather =
1``) and the grouped fold on the same rows sorted by expert (``x_gather = 0``)
with the backend under test and with ``impl="jnp"``, and counts the rows where
they disagree: a skipped row (by the rules of docs/semantics.md §5, restated
here) that either leaves other than bit-identical to ``base_out``, or a folded row with a value
farther from the jnp fold than a few roundings of the activation dtype
(``8 u (|base| + |s| |B| |A| |x|)`` per element). The count must be 0.

On a GPU: 10,000 steps, ``impl="fast"`` (and ``"simple"``). On any machine: a
short run of ``impl="cpu"``, so CI exercises the same program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _fold_cases import on_platform
from jax_moelora import MoeExpertRoute, moe_lora_gather_bgmv, moe_lora_grouped_down
from jax_moelora.ops import sort_rows_by_expert

T, TOP_K, E, L, K, N, R = 32, 4, 8, 3, 64, 48, 16
P = 1 + L * E + 2
UNIT = {jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float16): 2.0**-11,
        jnp.dtype(jnp.float32): 0.0}


def _step_case(key, dt):
    ks = jax.random.split(key, 10)
    rank = jax.random.randint(ks[0], (P, 1), 1, R + 1)        # zero-padded ranks per slot
    keep = jnp.arange(R)[None, :] < rank                     # [P, R]
    a_pool = jax.random.normal(ks[1], (P, R, K)) * K**-0.5 * keep[:, :, None]
    b_pool = jax.random.normal(ks[2], (P, N, R)) * R**-0.5 * keep[:, None, :]
    cells = jax.random.randint(ks[3], (2, L, E), -2, P + 2)   # 0: unadapted; < 0, >= P: skip
    scale = jax.random.uniform(ks[4], (L, E), minval=0.5, maxval=1.5) * jnp.where(
        jax.random.bernoulli(ks[5], 0.5, (L, E)), 1.0, -1.0)
    route = MoeExpertRoute(a_pool=a_pool.astype(dt), b_pool=b_pool.astype(dt),
                           a_table=cells[0], b_table=cells[1], scale_table=scale)
    ids = jax.random.randint(ks[6], (T, TOP_K), -1, E + 2)
    ra = jax.random.randint(ks[7], (T,), -1, L + 1)
    x = jax.random.normal(ks[8], (T, K)).astype(dt)
    base = jax.random.normal(ks[9], (T * TOP_K, N)).astype(dt)
    return route, ids, ra, x, base


def _rule(route, adapter, expert):
    """docs/semantics.md §5 skip rule, restated: (fold?, a, b, scale) per row."""
    ok = (adapter >= 0) & (adapter < L) & (expert >= 0) & (expert < E)
    lc, ec = jnp.clip(adapter, 0, L - 1), jnp.clip(expert, 0, E - 1)
    a, b = route.a_table[lc, ec], route.b_table[lc, ec]
    ok &= (a > 0) & (b > 0) & (a < P) & (b < P)
    return ok, jnp.clip(a, 0, P - 1), jnp.clip(b, 0, P - 1), route.scale_table[lc, ec]


def _mismatches(out, ref, base, xr, route, adapter, expert, unit):
    """Rows where ``out`` or ``ref`` breaks the soak's criterion: skipped rows
    of both bit-identical to ``base``, folded rows of ``out`` close to ``ref``."""
    ok, a, b, s = _rule(route, adapter, expert)
    ubits = {2: jnp.uint16, 4: jnp.uint32}[out.dtype.itemsize]
    base_bits = jax.lax.bitcast_convert_type(base, ubits)
    same = ((jax.lax.bitcast_convert_type(out, ubits) == base_bits)
            & (jax.lax.bitcast_convert_type(ref, ubits) == base_bits))
    f32 = jnp.float32
    A = jnp.abs(route.a_pool[a].astype(f32))                  # [rows, R, K]
    B = jnp.abs(route.b_pool[b].astype(f32))                  # [rows, N, R]
    hi = jax.lax.Precision.HIGHEST
    mag = jnp.einsum("rnj,rj->rn", B, jnp.einsum("rjk,rk->rj", A, jnp.abs(xr.astype(f32)),
                                                 precision=hi), precision=hi)
    bound = 8 * unit * (jnp.abs(base.astype(f32)) + jnp.abs(s)[:, None] * mag)
    close = jnp.abs(out.astype(f32) - ref.astype(f32)) <= bound
    bad = jnp.where(ok, ~jnp.all(close, axis=1), ~jnp.all(same, axis=1))
    return jnp.sum(bad), jnp.sum(ok)


@functools.partial(jax.jit, static_argnames=("steps", "impl", "dtype"))
def soak(key, *, steps: int, impl: str, dtype=jnp.bfloat16):
    """``(mismatched rows, folded rows)`` over ``steps`` steps of both folds."""
    dt = jnp.dtype(dtype)
    unit = UNIT[dt] + 2.0**-24 * (K + R + 2)

    def body(step, carry):
        bad, folded = carry
        route, ids, ra, x, base = _step_case(jax.random.fold_in(key, step), dt)
        flat = ids.reshape(-1)
        tok = jnp.arange(T * TOP_K) // TOP_K
        # decode: the gather fold on flat rows, x read per token
        kw = dict(top_k=TOP_K, x_gather=1)
        got = moe_lora_gather_bgmv(x, base, flat, route, ra, impl=impl, **kw)
        want = moe_lora_gather_bgmv(x, base, flat, route, ra, impl="jnp", **kw)
        b1, f1 = _mismatches(got, want, base, x[tok], route, ra[tok], flat, unit)
        # the same rows sorted by expert, x read per sorted row
        order, offsets, stok = sort_rows_by_expert(ids, E)
        xs, bs = jnp.tanh(base[order][:, :1]) * x[stok], base[order]
        got = moe_lora_grouped_down(xs, bs, offsets, stok, route, ra, x_gather=0, impl=impl)
        want = moe_lora_grouped_down(xs, bs, offsets, stok, route, ra, x_gather=0, impl="jnp")
        sorted_ids = jnp.where((flat[order] >= 0) & (flat[order] < E), flat[order], -1)
        b2, f2 = _mismatches(got, want, bs, xs, route, ra[stok], sorted_ids, unit)
        return bad + b1 + b2, folded + f1 + f2

    zero = jnp.int32(0)
    return jax.lax.fori_loop(0, steps, body, (zero, zero))


def _run(impl: str, steps: int, dtype=jnp.bfloat16):
    with on_platform(impl):
        bad, folded = soak(jax.random.key(20260113), steps=steps, impl=impl, dtype=dtype)
        return int(bad), int(folded)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32],
                         ids=["bf16", "f16", "f32"])
def test_soak_cpu(dtype):
    steps = 24
    bad, folded = _run("cpu", steps, dtype)
    assert folded > steps * 10, folded    # the program folds rows every step
    assert bad == 0, f"{bad} mismatched rows over {steps} steps ({folded} folded)"


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["fast", "simple"])
def test_soak_gpu_10000_steps(impl):
    steps = 10_000
    bad, folded = _run(impl, steps)
    print(f"soak {impl}: {steps} steps, {folded} folded rows, {bad} mismatched rows")
    assert folded > steps * 10, folded
    assert bad == 0, f"{bad} mismatched rows over {steps} steps ({folded} folded)"
