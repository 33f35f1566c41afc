"""``ops.grouped_matmul``: ``gmm`` and ``tgmm`` over row groups, the building
blocks of the backward passes (docs/design.md, "Backward").

Each impl is held to a float64 NumPy loop over the groups:

- ``gmm``: rows of a group that is not skipped are ``round(lhs[r] @ rhs[slot]
  (+ acc[r]))``; rows of skipped groups (a slot outside ``[0, P)``) and rows
  outside every group are exactly ``acc[r]`` (or 0); planes of stacked
  operands are read in place;
- ``tgmm``: each group's ``lhs^T rhs`` in f32 (times its ``alpha``), a group
  without rows exactly 0; with ``groups_of`` output matrix ``q`` is group
  ``groups_of[q]``'s, exactly 0 for a value outside the groups.

``impl="fast"`` (the CUTLASS kernels) carries the ``gpu`` marker and is
checked against the reference with the dtype's error, its exact zeros and
passed-through rows bit for bit, and the same bits on a second run.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moelora.ops import grouped_matmul as gm

GPU = pytest.mark.gpu
IMPLS = ["jnp", pytest.param("fast", marks=GPU)]
RTOL = {jnp.dtype(jnp.float32): 1e-6, jnp.dtype(jnp.bfloat16): 8e-3,
        jnp.dtype(jnp.float16): 1e-3}


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _offsets(rng, G: int, M: int, *, start: int = 0, tail: int = 3) -> np.ndarray:
    """Non-decreasing offsets from ``start`` to ``M - tail`` with empty groups."""
    cuts = np.sort(rng.integers(start, M - tail + 1, G - 1))
    offs = np.concatenate([[start], cuts, [M - tail]]).astype(np.int32)
    offs[1 + rng.integers(G - 1)] = offs[rng.integers(G)]  # an empty group somewhere
    return np.maximum.accumulate(offs).astype(np.int32)


def _gmm_ref(lhs, rhs, offsets, slots, acc, transpose):
    M, N = lhs.shape[0], rhs.shape[-2] if transpose else rhs.shape[-1]
    out = np.zeros((M, N)) if acc is None else acc.astype(np.float64)
    done = np.zeros(M, bool)
    for g in range(len(offsets) - 1):
        lo, hi = offsets[g], offsets[g + 1]
        slot = g if slots is None else slots[g]
        if not 0 <= slot < rhs.shape[0] or hi <= lo:
            continue
        mat = rhs[slot].astype(np.float64)
        mat = mat.T if transpose else mat
        base = 0.0 if acc is None else acc[lo:hi].astype(np.float64)
        out[lo:hi] = lhs[lo:hi].astype(np.float64) @ mat + base
        done[lo:hi] = True
    return out, done


def _case(rng, dtype, *, M=77, K=24, N=40, P=5, G=6, transpose=False, start=0):
    dt = jnp.dtype(dtype)
    lhs = rng.normal(size=(M, K)).astype(dt)
    rhs = rng.normal(size=(P, N, K) if transpose else (P, K, N)).astype(dt)
    offsets = _offsets(rng, G, M, start=start)
    slots = rng.integers(0, P, G).astype(np.int32)
    slots[rng.integers(G)] = -1
    slots[rng.integers(G)] = P  # outside the pool: skipped
    return lhs, rhs, offsets, slots


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("transpose", [False, True], ids=["nn", "nt"])
@pytest.mark.parametrize("with_acc", [False, True], ids=["out", "acc"])
def test_gmm_matches_the_loop(rng, impl, dtype, transpose, with_acc):
    if impl == "fast" and dtype == jnp.float32:
        pytest.skip("the kernels take bf16 and f16")
    lhs, rhs, offsets, slots = _case(rng, dtype, transpose=transpose, start=2)
    acc = rng.normal(size=(lhs.shape[0], rhs.shape[1] if transpose else rhs.shape[2])).astype(
        lhs.dtype) if with_acc else None
    want, done = _gmm_ref(lhs, rhs, offsets, slots, acc, transpose)
    out = jax.jit(lambda l, r, o, s, a: gm.gmm(
        [gm.GmmSet(l, r, o, s)], transpose_rhs=transpose, acc=None if a is None else [a],
        impl=impl)[0])(lhs, rhs, offsets, slots, acc)
    out = np.asarray(out)
    assert out.dtype == lhs.dtype and out.shape == want.shape
    assert done.any() and (~done).any()
    kept = np.zeros_like(out) if acc is None else acc
    np.testing.assert_array_equal(out[~done].view(np.uint8), kept[~done].view(np.uint8))
    assert _rel(out[done], want[done]) <= RTOL[out.dtype]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_tgmm_matches_the_loop(rng, impl, dtype):
    if impl == "fast" and dtype == jnp.float32:
        pytest.skip("the kernels take bf16 and f16")
    M, K, N, G = 90, 16, 24, 7
    lhs = rng.normal(size=(M, K)).astype(jnp.dtype(dtype))
    rhs = rng.normal(size=(M, N)).astype(jnp.dtype(dtype))
    offsets = _offsets(rng, G, M, start=4)
    out = np.asarray(jax.jit(lambda l, r, o: gm.tgmm([gm.TgmmSet(l, r, o)], impl=impl)[0])(
        lhs, rhs, offsets))
    assert out.dtype == np.float32 and out.shape == (G, K, N)
    for g in range(G):
        lo, hi = offsets[g], offsets[g + 1]
        want = lhs[lo:hi].astype(np.float64).T @ rhs[lo:hi].astype(np.float64)
        if hi == lo:
            np.testing.assert_array_equal(out[g], 0.0)
        else:
            assert _rel(out[g], want) <= 1e-5


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_tgmm_rounded_is_the_fp32_sums_rounded_once(rng, impl, dtype):
    """``rounded=True``: the sums in ``lhs``' dtype, each the fp32 sum of the
    same call without it rounded to nearest (a group without rows: 0), for
    two sets in one call."""
    M, K, N, G = 90, 16, 24, 7
    dt = jnp.dtype(dtype)
    sets = []
    for start in (4, 0):
        lhs = jnp.asarray(rng.normal(size=(M, K)).astype(dt))
        rhs = jnp.asarray(rng.normal(size=(M, N)).astype(dt))
        sets.append((lhs, rhs, jnp.asarray(_offsets(rng, G, M, start=start))))
    run = jax.jit(lambda ss, rounded: gm.tgmm([gm.TgmmSet(*s) for s in ss], impl=impl,
                                              rounded=rounded), static_argnums=1)
    exact, rounded = run(sets, False), run(sets, True)
    for e, r in zip(exact, rounded):
        assert e.dtype == np.float32 and r.dtype == dt and r.shape == (G, K, N)
        np.testing.assert_array_equal(np.asarray(r).view(np.uint16),
                                      np.asarray(e.astype(dt)).view(np.uint16))
    assert (np.asarray(exact[0]) != 0).any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rounded", [False, True], ids=["f32", "rounded"])
def test_tgmm_writes_each_groups_scaled_sum_where_groups_of_says(rng, impl, rounded):
    """``groups_of [Q]``: matrix ``q`` holds ``alpha[g] * lhs_g^T rhs_g`` of
    group ``g = groups_of[q]``, zeros for a value outside ``[0, G)`` or a
    group without rows; two sets in one call, one of them without
    ``groups_of`` and alpha (its ``[G, K, N]`` sums as before)."""
    dt = jnp.dtype(jnp.bfloat16)
    M, K, N, G, Q = 90, 16, 24, 7, 11
    lhs = rng.normal(size=(M, K)).astype(dt)
    rhs = rng.normal(size=(M, N)).astype(dt)
    offsets = _offsets(rng, G, M, start=4)
    groups_of = rng.permutation(np.concatenate([np.arange(G), [-1, G, 99, -5]]))[:Q]
    groups_of = groups_of.astype(np.int32)
    alpha = rng.uniform(-2, 2, G).astype(np.float32)
    run = jax.jit(lambda *a: gm.tgmm([gm.TgmmSet(a[0], a[1], a[2], groups_of=a[3], alpha=a[4]),
                                      gm.TgmmSet(a[1], a[0], a[2])], impl=impl, rounded=rounded))
    out, plain = (np.asarray(v, np.float32) for v in run(lhs, rhs, offsets, groups_of, alpha))
    assert out.shape == (Q, K, N) and plain.shape == (G, N, K)
    for q, g in enumerate(groups_of):
        lo, hi = (offsets[g], offsets[g + 1]) if 0 <= g < G else (0, 0)
        if hi == lo:
            np.testing.assert_array_equal(out[q], 0.0)
            continue
        want = alpha[g] * (lhs[lo:hi].astype(np.float64).T @ rhs[lo:hi].astype(np.float64))
        assert _rel(out[q], want) <= (RTOL[dt] if rounded else 1e-5)
        plain_want = rhs[lo:hi].astype(np.float64).T @ lhs[lo:hi].astype(np.float64)
        assert _rel(plain[g], plain_want) <= (RTOL[dt] if rounded else 1e-5)
    assert (groups_of < 0).any() and (groups_of >= G).any()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_value_not_finite_stays_in_its_groups_rows(rng, impl):
    """An inf in one slot's matrix reaches only the rows of the groups that
    read that slot; every other row has the bits it has without it."""
    lhs, rhs, offsets, slots = _case(rng, jnp.bfloat16)
    live = (slots >= 0) & (slots < rhs.shape[0]) & (np.diff(offsets) > 0)
    bad_slot = int(slots[live][0])
    bad = np.array(rhs)
    bad[bad_slot, 0, 0] = np.inf
    run = jax.jit(lambda r: gm.gmm([gm.GmmSet(lhs, r, offsets, slots)], impl=impl)[0])
    out, out_bad = np.asarray(run(rhs), np.float32), np.asarray(run(bad), np.float32)
    rows = np.zeros(lhs.shape[0], bool)
    for g in np.flatnonzero(slots == bad_slot):
        rows[offsets[g]:offsets[g + 1]] = True
    assert rows.any() and not np.isfinite(out_bad[rows]).all()
    np.testing.assert_array_equal(out_bad[~rows], out[~rows])


@pytest.mark.parametrize("impl", IMPLS)
def test_sets_read_planes_in_place(rng, impl):
    """Two sets in one call: planes of a stacked lhs and of a stacked pool,
    each with its own offsets and slots, equal two calls of one set."""
    dt = jnp.dtype(jnp.bfloat16)
    M, K, N, P, G = 64, 32, 16, 4, 5
    lhs = rng.normal(size=(2, M, K)).astype(dt)
    rhs = rng.normal(size=(2, P, K, N)).astype(dt)
    offs = [_offsets(rng, G, M), _offsets(rng, G, M)]
    slots = [rng.integers(-1, P, G).astype(np.int32) for _ in range(2)]
    both = gm.gmm([gm.GmmSet(lhs, rhs, offs[i], slots[i], i, i) for i in range(2)], impl=impl)
    for i in range(2):
        one = gm.gmm([gm.GmmSet(lhs[i], rhs[i], offs[i], slots[i])], impl=impl)[0]
        np.testing.assert_array_equal(np.asarray(both[i]).view(np.uint16),
                                      np.asarray(one).view(np.uint16))
    t_both = gm.tgmm([gm.TgmmSet(lhs, lhs, offs[i], i, 1 - i) for i in range(2)], impl=impl)
    for i in range(2):
        one = gm.tgmm([gm.TgmmSet(lhs[i], lhs[1 - i], offs[i])], impl=impl)[0]
        np.testing.assert_array_equal(np.asarray(t_both[i]), np.asarray(one))


def test_jnp_form_batches_under_vmap(rng):
    lhs, rhs, offsets, slots = _case(rng, jnp.float32)
    batch = np.stack([lhs, 2 * lhs])
    out = jax.vmap(lambda l: gm.gmm([gm.GmmSet(l, rhs, offsets, slots)])[0])(batch)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(out[i]),
                                      np.asarray(gm.gmm([gm.GmmSet(batch[i], rhs, offsets,
                                                                   slots)])[0]))


def test_set_count_and_offsets_are_checked(rng):
    lhs, rhs, offsets, slots = _case(rng, jnp.float32)
    with pytest.raises(ValueError, match="operand sets"):
        gm.gmm([], impl="jnp")
    with pytest.raises(ValueError, match="offsets must be int32"):
        gm.gmm([gm.GmmSet(lhs, rhs, offsets.astype(np.int64))], impl="jnp")
    with pytest.raises(ValueError, match="accumulators"):
        gm.gmm([gm.GmmSet(lhs, rhs, offsets)], acc=[], impl="jnp")


@pytest.mark.parametrize("impl", ["jnp", "fast"])
def test_planes_are_static_ints_within_the_operands(rng, impl):
    """A set's planes are static: one passed through ``jit`` as an argument
    (a tracer) or past its operand's leading dimensions is refused before
    any launch, the same for every impl."""
    lhs, rhs, offsets, _ = _case(rng, jnp.float32)
    with pytest.raises(TypeError, match="lhs_plane must be a Python int"):
        jax.jit(lambda s: gm.tgmm([s], impl=impl))(gm.TgmmSet(lhs, lhs, offsets))
    with pytest.raises(ValueError, match="rhs_plane 1 outside the 1 plane"):
        gm.gmm([gm.GmmSet(lhs, rhs, offsets, rhs_plane=1)], impl=impl)
    with pytest.raises(ValueError, match="lhs_plane 2 outside the 2 plane"):
        gm.tgmm([gm.TgmmSet(jnp.stack([lhs, lhs]), lhs, offsets, lhs_plane=2)], impl=impl)


@GPU
def test_fast_kernel_shapes_of_the_backward(rng):
    """The shapes the backward runs: rank 16 as the reduction (K = 16) and as
    the output (N = 16), groups of one row, a thousand groups; the same bits
    on a second run."""
    dt = jnp.dtype(jnp.bfloat16)
    M, R, K, P, G = 3000, 16, 2048, 300, 1024
    x = rng.normal(size=(M, K)).astype(dt)
    a_pool = rng.normal(size=(P, R, K)).astype(dt)
    d_xa = rng.normal(size=(M, R)).astype(dt)
    offsets = np.sort(rng.integers(0, M + 1, G + 1)).astype(np.int32)
    offsets[0] = 0
    slots = rng.integers(-1, P, G).astype(np.int32)
    for transpose, lhs in ((True, x), (False, d_xa)):
        run = jax.jit(lambda l, r, o, s: gm.gmm([gm.GmmSet(l, r, o, s)], transpose_rhs=transpose,
                                                impl="fast")[0])
        out = np.asarray(run(lhs, a_pool, offsets, slots))
        want = np.asarray(gm.gmm([gm.GmmSet(lhs, a_pool, offsets, slots)],
                                 transpose_rhs=transpose, impl="jnp")[0])
        np.testing.assert_array_equal(out[want == 0].view(np.uint16),
                                      want[want == 0].view(np.uint16))
        assert _rel(out, want) <= RTOL[dt]
        np.testing.assert_array_equal(np.asarray(run(lhs, a_pool, offsets, slots)).view(np.uint16),
                                      out.view(np.uint16))
    red = jax.jit(lambda l, r, o: gm.tgmm([gm.TgmmSet(l, r, o)], impl="fast")[0])
    out = np.asarray(red(d_xa, x, offsets))
    want = np.asarray(gm.tgmm([gm.TgmmSet(d_xa, x, offsets)], impl="jnp")[0])
    assert _rel(out, want) <= 1e-5
    np.testing.assert_array_equal(np.asarray(red(d_xa, x, offsets)), out)
