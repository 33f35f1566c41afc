"""The LoRA backward as grouped matmuls over (adapter, expert) cells
(``ops/grouped_vjp.py``, docs/design.md "Backward").

In f32 its cotangents equal the other formulations' (``"dense"``,
``"tiled"``) up to the order of fp32 sums, for rows grouped by expert in any
order within an expert, for one projection or several read from a stacked
pool, with rows that fold nothing contributing nothing. No branch depends on
the rows.
The jnp form of the grouped matmuls runs everywhere; the CUDA kernels are
checked against it in bf16 on the GPU.
"""

from __future__ import annotations

import zlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from _transform_cases import make_route
from jax_moelora.ops import autodiff, backend, grouped_vjp, jnp_fold
from jax_moelora.ops import grouped_matmul as gm
from jax_moelora.ops.stacked import stack_routes

GPU = pytest.mark.gpu


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _rows(rng, route, M: int, *, sort: bool):
    """Random rows of ``route``: adapter and expert per row (some outside the
    tables), their flat cells ``l * E + e`` and whether each folds. ``sort``:
    rows grouped by expert (experts outside the tables first and last), in a
    random order within an expert."""
    L, E = route.max_loras, route.n_experts
    adapter = rng.integers(-1, L + 1, M).astype(np.int32)
    expert = rng.integers(-1, E + 1, M).astype(np.int32)
    if sort:
        order = np.lexsort((rng.random(M), expert))
        adapter, expert = adapter[order], expert[order]
    _, _, _, ok = jnp_fold.resolve_pairs(route, jnp.asarray(adapter), jnp.asarray(expert))
    l = np.zeros_like(adapter) if L == 1 else adapter
    cell = (np.clip(l, 0, L - 1) * E + np.clip(expert, 0, E - 1)).astype(np.int32)
    return jnp.asarray(adapter), jnp.asarray(expert), jnp.asarray(cell), ok


def _offsets(expert, E: int):
    """The expert groups of rows grouped by expert: int32 ``[E + 1]``."""
    return jnp.asarray(np.searchsorted(np.asarray(expert), np.arange(E + 1)), jnp.int32)


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("L", [1, 3])
def test_grouped_equals_dense_formulation(rng, sort, L):
    route = make_route(rng, P=11, R=8, K=24, N=16, L=L, E=5)
    M = 70
    _, _, cell, ok = _rows(rng, route, M, sort=sort)
    x = jnp.asarray(rng.normal(size=(40, route.k_in)), jnp.float32)
    xi = jnp.asarray(rng.integers(0, 40, M), jnp.int32)
    g = jnp.asarray(rng.normal(size=(M, route.n_out)), jnp.float32)
    want = autodiff.fold_rows_vjp(x, route, g, xi, cell, ok, mode="dense")
    got = jax.jit(lambda *a: autodiff.fold_rows_vjp(*a, mode="grouped"))(x, route, g, xi, cell, ok)
    for name, a, b in zip(("dx", "d_a_pool", "d_b_pool", "d_scale"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert np.abs(np.asarray(b)).max() > 0, f"{name} is zero: the test could not fail"
        assert _rel(a, b) <= 1e-5, f"{name}: {_rel(a, b):.3g}"


def test_by_expert_a_value_not_finite_stays_in_its_cells_cotangents(rng):
    """With several table rows the matmuls run by expert, an expert's cells
    side by side: a NaN in one cell's A reaches its B cotangent (through
    ``xa``) and no row's ``dx``; the rows of the expert's other cells keep the
    bits they have with a finite A."""
    route = make_route(rng, P=11, R=8, K=16, N=24, L=3, E=4)
    M = 80
    adapter, expert, _, ok = _rows(rng, route, M, sort=True)
    key = grouped_vjp.cell_keys(3, 4, adapter, expert, ok)
    k = np.asarray(key)
    first = int(k[k < 12][0])  # a cell with rows: e * L + l
    e0, l0 = divmod(first, 3)
    slot = int(np.asarray(route.a_table)[l0, e0])
    a_pool = np.array(route.a_pool)
    a_pool[slot, 0, 0] = np.nan
    bad = route.replace(a_pool=jnp.asarray(a_pool))
    x = jnp.asarray(rng.normal(size=(M, 16)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(M, 24)), jnp.float32)
    run = jax.jit(lambda x, m, k, o: grouped_vjp.lora_grads(x, [m], k, o, impl="jnp"))
    off = _offsets(expert, 4)
    dx, _ = run(x, grouped_vjp.member(route, g), key, off)
    dx_bad, (grads,) = run(x, grouped_vjp.member(bad, g), key, off)
    assert np.isfinite(np.asarray(dx_bad)).all()
    cells = np.asarray(route.a_table).T.reshape(-1)  # cell e * L + l's A slot
    other = (k < 12) & (cells[np.minimum(k, 11)] != slot)
    assert other.any()
    np.testing.assert_array_equal(np.asarray(dx_bad)[other], np.asarray(dx)[other])
    # xa = x A^T carries it into the cell's B and scale cotangents
    b_slot = int(np.asarray(route.b_table)[l0, e0])
    assert np.isnan(np.asarray(grads.d_b_pool)[b_slot]).any()


@pytest.mark.parametrize("L", [1, 2])
def test_rows_need_no_order_within_an_expert(rng, L):
    """Rows grouped by expert in a random order within each expert (rows that
    fold nothing among them) give the cotangents of the same rows sorted by
    cell; rows that fold nothing keep ``acc``."""
    route = make_route(rng, P=9, R=8, K=16, N=24, L=L, E=4)
    cells = (1 + np.arange(L)[:, None] * 4 + np.arange(4)[None, :]).astype(np.int32)
    cells[0, 1] = 0  # expert 1's first cell folds nothing
    route = route.replace(a_table=jnp.asarray(cells), b_table=jnp.asarray(cells[:, ::-1]))
    M = 50
    adapter, expert, _, ok = _rows(rng, route, M, sort=True)
    key = grouped_vjp.cell_keys(L, 4, adapter, expert, ok)
    x = jnp.asarray(rng.normal(size=(M, 16)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(M, 24)), jnp.float32)
    acc = jnp.asarray(rng.normal(size=(M, 16)), jnp.float32)
    run = jax.jit(lambda x, m, k, o, a: grouped_vjp.lora_grads(x, [m], k, o, impl="jnp", acc=a))
    dx, (grads,) = run(x, grouped_vjp.member(route, g), key, _offsets(expert, 4), acc)
    order = np.argsort(np.asarray(key), kind="stable")
    assert (order != np.arange(M)).any()
    skey = key[order]
    dx_s, (grads_s,) = run(x[order], grouped_vjp.member(route, g[order]), skey,
                           grouped_vjp.expert_offsets_of(skey, L, 4), acc[order])
    np.testing.assert_allclose(np.asarray(dx)[order], np.asarray(dx_s), rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, grads_s):
        assert np.abs(np.asarray(b)).max() > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    skipped = np.asarray(key) == L * 4
    assert skipped.any() and (np.asarray(expert)[skipped] >= 0).any()  # some inside a group
    np.testing.assert_array_equal(np.asarray(dx)[skipped], np.asarray(acc)[skipped])


def test_one_branch_and_it_reads_the_tables_only(rng):
    """The backward of gate and up has one ``cond`` (how the pool cotangents
    are summed), whose predicate depends on the tables, not on the rows."""
    route = make_route(rng, P=9, R=8, K=16, N=24, L=2, E=4)
    M = 40
    adapter, expert, _, ok = _rows(rng, route, M, sort=True)
    key = grouped_vjp.cell_keys(2, 4, adapter, expert, ok)
    x = jnp.asarray(rng.normal(size=(M, 16)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(M, 24)), jnp.float32)
    members = [grouped_vjp.member(route, g), grouped_vjp.member(route, 2 * g)]
    jaxpr = jax.make_jaxpr(lambda x, k, o, ms: grouped_vjp.lora_grads(x, ms, k, o, impl="jnp"))(
        x, key, _offsets(expert, 4), members)
    conds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("cond", "while")]
    assert [e.primitive.name for e in conds] == ["cond"]
    # the inputs the predicate depends on: the members' slot tables only
    need, producers = {conds[0].invars[0]}, {v: e for e in jaxpr.jaxpr.eqns for v in e.outvars}
    frontier = list(need)
    while frontier:
        e = producers.get(frontier.pop())
        for v in (e.invars if e is not None else []):
            if isinstance(v, jax.extend.core.Var) and v not in need:
                need.add(v)
                frontier.append(v)
    leaves = jax.tree_util.tree_leaves_with_path(members)
    names = ["x", "key", "offsets"] + [jax.tree_util.keystr(p) for p, _ in leaves]
    used = {n for n, v in zip(names, jaxpr.jaxpr.invars) if v in need}
    assert used and all(n.endswith(("a_slot", "b_slot")) for n in used), used


def test_stacked_members_equal_separate_calls(rng):
    """Gate and up from one stacked pool (two planes, one call of each
    grouped matmul) equal two single-projection backwards."""
    r0 = make_route(rng, P=9, R=8, K=16, N=24, L=2, E=4)
    r1 = make_route(rng, P=9, R=8, K=16, N=24, L=2, E=4)
    st = stack_routes(r0, r1)
    M = 60
    adapter, expert, _, ok = _rows(rng, r0, M, sort=True)
    key = grouped_vjp.cell_keys(2, 4, adapter, expert, ok)
    x = jnp.asarray(rng.normal(size=(M, 16)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(2, M, 24)), jnp.float32)
    pools = (st.a_pool, st.b_pool)
    members = [grouped_vjp.member(st.route(s), g, plane=s, g_plane=s, pools=pools)
               for s in range(2)]
    off = _offsets(expert, 4)
    dx, grads = grouped_vjp.lora_grads(x, members, key, off, impl="jnp")
    want_dx = 0.0
    for s, r in enumerate((r0, r1)):
        d, (gr,) = grouped_vjp.lora_grads(x, [grouped_vjp.member(r, g[s])], key, off, impl="jnp")
        want_dx = want_dx + np.asarray(d, np.float64)
        for a, b in zip(grads[s], gr):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5)


@GPU
@pytest.mark.parametrize("L", [1, 4])
def test_kernels_match_the_jnp_form(rng, L):
    """bf16 on the CUDA kernels against the same formulation in jnp: equal
    within bf16 error, the pool and scale cotangents the same bits on a
    second run."""
    dt = jnp.bfloat16
    route = make_route(rng, P=33, R=16, K=256, N=128, L=L, E=8, dtype=dt)
    # every cell its own slot (the layout whose pool gradients are deterministic)
    cells = (1 + np.arange(L)[:, None] * 8 + np.arange(8)[None, :]).astype(np.int32)
    cells[rng.random(cells.shape) < 0.2] = 0
    route = route.replace(a_table=jnp.asarray(cells), b_table=jnp.asarray(cells))
    M = 1500
    adapter, expert, _, ok = _rows(rng, route, M, sort=True)
    key = grouped_vjp.cell_keys(L, 8, adapter, expert, ok)
    x = jnp.asarray(rng.normal(size=(M, 256)), dt)
    g = jnp.asarray(rng.normal(size=(M, 128)), dt)
    run = jax.jit(lambda x, m, k, o, impl: grouped_vjp.lora_grads(x, [m], k, o, impl=impl),
                  static_argnums=4)
    m, off = grouped_vjp.member(route, g), _offsets(expert, 8)
    dx, (grads,) = run(x, m, key, off, "fast")
    dx_j, (grads_j,) = run(x, m, key, off, "jnp")
    assert _rel(dx, dx_j) <= 1e-2
    for a, b in zip(grads, grads_j):
        assert _rel(a, b) <= 1e-2
    dx2, (grads2,) = run(x, m, key, off, "fast")
    np.testing.assert_array_equal(np.asarray(dx2).view(np.uint16), np.asarray(dx).view(np.uint16))
    for a, b in zip(grads, grads2):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert backend.gpu_now() and backend.cutlass_takes(dt, 256, 128, 16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("slots", [[3, -1, 5, 1, 7, 2], [3, 3, 5, -1, 1, 5]],
                         ids=["distinct", "shared"])
def test_pool_cotangent_sums_each_slots_cells(rng, dtype, slots):
    """Each pool slot receives the sum of its cells' sums, rounded once to the
    pool's dtype; a slot of no cell gets 0 and a cell of slot -1 is dropped,
    whether the slots are distinct (taken by a gather) or shared (then every
    part of the call is summed by slot: a second part of distinct slots gets
    the same values either way)."""
    P = 9
    parts = [(np.asarray(slots), rng.normal(size=(len(slots), 2, 3)).astype(np.float32)),
             (np.asarray([0, 4, 8]), rng.normal(size=(3, 2, 3)).astype(np.float32))]
    got = jax.jit(lambda cs, ss: grouped_vjp._pool_sums(
        lambda exact: cs, [(s, P, dtype) for s in ss]))(
        [jnp.asarray(c) for _, c in parts], [jnp.asarray(s, jnp.int32) for s, _ in parts])
    for (sl, cells), out in zip(parts, got):
        want = np.zeros((P, 2, 3), np.float32)
        for g, s in enumerate(sl):
            if s >= 0:
                want[s] += cells[g]
        assert out.dtype == dtype and out.shape == (P, 2, 3)
        np.testing.assert_array_equal(np.asarray(out, np.float32),
                                      np.asarray(jnp.asarray(want).astype(dtype), np.float32))


@pytest.mark.parametrize("slots", [[3, -1, 5, 1, 7, 2], [3, 3, 5, -1, 1, 5]],
                         ids=["distinct", "shared"])
def test_pool_cotangent_of_sums_made_in_the_branch(rng, slots):
    """A part's sums may be made inside the branch that takes them: fp32 for
    the fp32 pool of shared slots, rounded to the pool's dtype for the gather
    of distinct ones (what the backward's A sums do). The cotangent has the
    values of the fp32 sums given outright."""
    P, dt = 9, jnp.bfloat16
    cells = jnp.asarray(rng.normal(size=(len(slots), 2, 3)).astype(np.float32))
    sl = jnp.asarray(slots, jnp.int32)
    asked = []

    def lazy(c, s):
        def sums(exact):
            asked.append(exact)
            return [c if exact else c.astype(dt)]
        return grouped_vjp._pool_sums(sums, [(s, P, dt)])[0]

    got = jax.jit(lazy)(cells, sl)
    want = jax.jit(lambda c, s: grouped_vjp._pool_sums(lambda exact: [c], [(s, P, dt)])[0])(
        cells, sl)
    assert sorted(asked) == [False, True]  # one call a branch
    assert got.dtype == dt
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("pool_dtype", [jnp.bfloat16, jnp.float32])
def test_a_sums_are_rounded_only_outside_the_exact_branch(rng, pool_dtype):
    """The backward's ``sum d_xa^T x``: fp32 for the exact branch; for the
    gather, rounded to the pool's dtype by the kernel when that is the
    operands' (else fp32 too)."""
    route = make_route(rng, P=9, R=8, K=16, N=24, L=2, E=4, dtype=pool_dtype)
    M = 40
    adapter, expert, _, ok = _rows(rng, route, M, sort=True)
    d_xa = jnp.asarray(rng.normal(size=(M, 16)), jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(M, 16)), jnp.bfloat16)
    m = grouped_vjp.member(route, jnp.zeros((M, 24), jnp.bfloat16))
    sums = grouped_vjp._a_sums([gm.TgmmSet(d_xa, x, _offsets(expert, 4))], [m], "jnp")
    exact, gathered = sums(True)[0], sums(False)[0]
    assert exact.dtype == jnp.float32 and exact.shape == (8, 8, 16)
    rounded = jnp.dtype(pool_dtype) == jnp.bfloat16
    assert gathered.dtype == (jnp.bfloat16 if rounded else jnp.float32)
    np.testing.assert_array_equal(np.asarray(gathered, np.float32),
                                  np.asarray(exact.astype(gathered.dtype), np.float32))
