"""The LoRA backward as grouped matmuls over (adapter, expert) cells
(``ops/grouped_vjp.py``, docs/design.md "Backward").

In f32 its cotangents equal the other formulations' (``"dense"``,
``"tiled"``) up to the order of fp32 sums, for rows grouped by expert in any
order within an expert (the cell layout or not), for tables with a slot a
cell or shared slots, for one projection or several read from a stacked
pool, with rows that fold nothing contributing nothing. One branch a call.
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
from jax_moelora.ops.folds import sort_rows_by_expert
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


def _own_slots(L: int, E: int, rng=None) -> np.ndarray:
    """int32 ``[L, E]`` tables giving every cell its own pool slot, ``1 + l *
    E + e``; with ``rng``, about a fifth of the cells folding nothing (0)."""
    cells = (1 + np.arange(L)[:, None] * E + np.arange(E)[None, :]).astype(np.int32)
    if rng is not None:
        cells[rng.random(cells.shape) < 0.2] = 0
    return cells


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


@pytest.mark.parametrize("stacked", [False, True], ids=["cells", "stacked"])
@pytest.mark.parametrize("sort", [True, False], ids=["by_cell", "by_expert"])
def test_a_value_not_finite_stays_in_its_cells_rows(rng, sort, stacked):
    """A NaN in one cell's A reaches that cell's rows' ``dx`` and its B
    cotangent (through ``xa``), as in the reference; every other row keeps
    the ``dx`` bits it has with a finite A, in either row order and whichever
    form is asked for (the stacked form, whose zeros would carry the NaN to
    the expert's other cells, gives way to the cells' own)."""
    route = make_route(rng, P=11, R=8, K=16, N=24, L=3, E=4)
    M = 80
    adapter, expert, _, ok = _rows(rng, route, M, sort=True)
    key = grouped_vjp.cell_keys(3, 4, adapter, expert, ok)
    if sort:  # the cell layout: within an expert, rows that fold nothing first
        k = np.asarray(key)
        order = np.lexsort((np.where(k < 12, k, -1), np.asarray(expert)))
        adapter, expert, key = adapter[order], expert[order], key[order]
    k = np.asarray(key)
    first = int(k[k < 12][0])  # a cell with rows: e * L + l
    e0, l0 = divmod(first, 3)
    slot = int(np.asarray(route.a_table)[l0, e0])
    a_pool = np.array(route.a_pool)
    a_pool[slot, 0, 0] = np.nan
    bad = route.replace(a_pool=jnp.asarray(a_pool))
    x = jnp.asarray(rng.normal(size=(M, 16)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(M, 24)), jnp.float32)
    run = jax.jit(lambda x, m, k, o: grouped_vjp.lora_grads(x, [m], k, o, impl="jnp",
                                                            stacked=stacked))
    off = _offsets(expert, 4)
    dx, _ = run(x, grouped_vjp.member(route, g), key, off)
    dx_bad, (grads,) = run(x, grouped_vjp.member(bad, g), key, off)
    cells = np.asarray(route.a_table).T.reshape(-1)  # cell e * L + l's A slot
    own = (k < 12) & (cells[np.minimum(k, 11)] == slot)
    assert np.isnan(np.asarray(dx_bad)[own]).any()
    assert np.isfinite(np.asarray(dx_bad)[~own]).all() and (~own & (k < 12)).any()
    np.testing.assert_array_equal(np.asarray(dx_bad)[~own], np.asarray(dx)[~own])
    b_slot = int(np.asarray(route.b_table)[l0, e0])
    assert np.isnan(np.asarray(grads.d_b_pool)[b_slot]).any()


@pytest.mark.parametrize("where", ["x", "g"])
@pytest.mark.parametrize("stacked", [False, True], ids=["cells", "stacked"])
def test_a_row_not_finite_reaches_its_own_cells_sums_only(rng, stacked, where):
    """An inf in one folding row's ``x`` (or ``g``) reaches the ``A`` (or
    ``B``) cotangent of that row's cell; the other cells of its expert keep
    finite sums, whichever form is asked for."""
    L, E = 3, 4
    route = make_route(rng, P=14, R=8, K=16, N=24, L=L, E=E)
    cells = _own_slots(L, E)
    route = route.replace(a_table=jnp.asarray(cells), b_table=jnp.asarray(cells))
    M = 90
    adapter, expert, _, ok = _rows(rng, route, M, sort=True)
    key = grouped_vjp.cell_keys(L, E, adapter, expert, ok)
    o = _by_cell(key, expert, L, E)
    expert, key = expert[o], key[o]
    k = np.asarray(key)
    row = int(np.flatnonzero(k < L * E)[0])
    x = np.asarray(rng.normal(size=(M, 16)), np.float32)
    g = np.asarray(rng.normal(size=(M, 24)), np.float32)
    (x if where == "x" else g)[row, 3] = np.inf
    dx, (gr,) = jax.jit(lambda x, m, k, o: grouped_vjp.lora_grads(
        x, [m], k, o, impl="jnp", stacked=stacked))(
        jnp.asarray(x), grouped_vjp.member(route, jnp.asarray(g)), key, _offsets(expert, E))
    pool = np.asarray(gr.d_a_pool if where == "x" else gr.d_b_pool)
    e0, l0 = divmod(int(k[row]), L)
    assert not np.isfinite(pool[cells[l0, e0]]).all()
    others = [cells[l, e0] for l in range(L) if l != l0 and (k == e0 * L + l).any()]
    assert others and all(np.isfinite(pool[s]).all() for s in others)


def test_stacked_form_where_cells_hold_few_rows():
    """``stacked=None`` takes the stacked form for several adapters, few rows
    a cell on average and a small rank (Qwen3-30B-A3B at 512 tokens, 4
    adapters of rank 16: 8 rows a cell), the cells' own tiles otherwise."""
    rows = grouped_vjp.STACKED_MAX_ROWS * 128 * 4
    assert grouped_vjp.stacked_default(4096, 128, 4, 16)
    assert grouped_vjp.stacked_default(rows, 128, 4, grouped_vjp.STACKED_MAX_RANK)
    assert not grouped_vjp.stacked_default(rows + 1, 128, 4, 16)
    assert not grouped_vjp.stacked_default(4096, 128, 4, grouped_vjp.STACKED_MAX_RANK + 1)
    assert not grouped_vjp.stacked_default(4096, 128, 1, 16)


@pytest.mark.parametrize("L", [1, 2])
def test_rows_need_no_order_within_an_expert(rng, L):
    """Rows grouped by expert in a random order within each expert (rows that
    fold nothing among them) give the cotangents of the same rows sorted by
    cell; rows that fold nothing keep ``acc``."""
    route = make_route(rng, P=9, R=8, K=16, N=24, L=L, E=4)
    cells = _own_slots(L, 4)
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


def _predicate_inputs(fn, args, names) -> set:
    """The names of ``args`` (flattened) the one ``cond`` of ``fn``'s jaxpr reads."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    conds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("cond", "while")]
    assert [e.primitive.name for e in conds] == ["cond"]
    need, producers = {conds[0].invars[0]}, {v: e for e in jaxpr.jaxpr.eqns for v in e.outvars}
    frontier = list(need)
    while frontier:
        e = producers.get(frontier.pop())
        for v in (e.invars if e is not None else []):
            if isinstance(v, jax.extend.core.Var) and v not in need:
                need.add(v)
                frontier.append(v)
    return {n for n, v in zip(names, jaxpr.jaxpr.invars) if v in need}


@pytest.mark.parametrize("stacked", [False, True], ids=["cells", "stacked"])
def test_one_branch_on_the_tables_and_the_row_layout(rng, stacked):
    """The backward of gate and up has one ``cond``. Its predicate reads the
    slot tables (do two cells share a slot) and the rows' keys and offsets (are
    the rows in the cell layout); with ``rows_by_cell`` the caller vouches for
    the layout and it reads the tables alone. The stacked form's predicate
    also reads the values its zeros multiply: ``x``, the cotangents and the
    ``A`` pools (are they finite)."""
    route = make_route(rng, P=9, R=8, K=16, N=24, L=2, E=4)
    M = 40
    adapter, expert, _, ok = _rows(rng, route, M, sort=True)
    key = grouped_vjp.cell_keys(2, 4, adapter, expert, ok)
    x = jnp.asarray(rng.normal(size=(M, 16)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(M, 24)), jnp.float32)
    members = [grouped_vjp.member(route, g), grouped_vjp.member(route, 2 * g)]
    leaves = jax.tree_util.tree_leaves_with_path(members)
    names = ["x", "key", "offsets"] + [jax.tree_util.keystr(p) for p, _ in leaves]
    args = (x, key, _offsets(expert, 4), members)
    values = {"x", "[0].g", "[1].g", "[0].a_pool", "[1].a_pool"} if stacked else set()
    for by_cell in (False, True):
        used = _predicate_inputs(lambda x, k, o, ms: grouped_vjp.lora_grads(
            x, ms, k, o, impl="jnp", rows_by_cell=by_cell, stacked=stacked), args, names)
        tables = {n for n in used if n.endswith(("a_slot", "b_slot"))}
        layout = set() if by_cell else {"key", "offsets"}
        assert tables and used - tables == layout | values, used


def _by_cell(key, expert, L: int, E: int):
    """The order of rows grouped by expert that puts them in the cell layout:
    within an expert, the rows that fold nothing first, then cell by cell."""
    k = np.asarray(key)
    return np.lexsort((np.where(k < L * E, k, -1), np.asarray(expert)))


@pytest.mark.parametrize("stacked", [False, True], ids=["cells", "stacked"])
@pytest.mark.parametrize("order", ["by_cell", "by_expert"])
@pytest.mark.parametrize("tables", ["distinct", "shared"])
def test_each_branch_equals_the_dense_formulation(rng, order, tables, stacked):
    """Rows in the cell layout with a slot a cell (the branch that writes each
    sum at its slot, by cell or stacked), rows in another order or cells
    sharing slots (the branch that sorts the rows and adds the sums by slot):
    the cotangents of the dense formulation either way."""
    L, E, P = 3, 4, 14
    route = make_route(rng, P=P, R=8, K=16, N=24, L=L, E=E)
    if tables == "distinct":
        cells = _own_slots(L, E, rng)
        route = route.replace(a_table=jnp.asarray(cells), b_table=jnp.asarray(cells[::-1]))
    M = 90
    adapter, expert, cell, ok = _rows(rng, route, M, sort=True)
    key = grouped_vjp.cell_keys(L, E, adapter, expert, ok)
    if order == "by_cell":
        o = _by_cell(key, expert, L, E)
        adapter, expert, cell, ok, key = adapter[o], expert[o], cell[o], ok[o], key[o]
    k2 = np.asarray(grouped_vjp.group_keys(key, _offsets(expert, E), L))
    assert (np.diff(k2) >= 0).all() == (order == "by_cell")
    x = jnp.asarray(rng.normal(size=(M, 16)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(M, 24)), jnp.float32)
    want = autodiff.fold_rows_vjp(x, route, g, jnp.arange(M, dtype=jnp.int32), cell, ok,
                                  mode="dense")
    dx, (gr,) = jax.jit(lambda x, m, k, o: grouped_vjp.lora_grads(
        x, [m], k, o, impl="jnp", stacked=stacked))(x, grouped_vjp.member(route, g), key,
                                                     _offsets(expert, E))
    got = (dx, gr.d_a_pool, gr.d_b_pool, gr.d_scale.reshape(E, L).T)
    for name, a, b in zip(("dx", "d_a_pool", "d_b_pool", "d_scale"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert np.abs(np.asarray(b)).max() > 0, f"{name} is zero: the test could not fail"
        assert _rel(a, b) <= 1e-5, f"{name}: {_rel(a, b):.3g}"


def _spread_xa(x, m: grouped_vjp.Member, key, L: int, by_row: bool = False):
    """The rows' ``x A^T`` spread by adapter, ``[M, L * R]`` (the layout
    ``expert_matmul``'s kernel leaves): zeros outside the row's adapter and
    for a row whose cell folds nothing; ``by_row``, each row's own ``[M, R]``
    (the gather fold's)."""
    x, key = np.asarray(x, np.float64), np.asarray(key)
    a_pool = np.asarray(m.a_pool, np.float64)
    slot = np.asarray(m.a_slot)
    M, R = x.shape[0], a_pool.shape[1]
    out = np.zeros((M, L, R))
    for r in np.flatnonzero(key < slot.shape[0]):
        if slot[key[r]] >= 0:
            out[r, key[r] % L] = a_pool[slot[key[r]]] @ x[r]
    if by_row:
        return jnp.asarray(out.sum(axis=1), jnp.float32)
    return jnp.asarray(out.reshape(M, L * R), jnp.float32)


@pytest.mark.parametrize("layout", ["spread", "by_row"])
@pytest.mark.parametrize("stacked", [False, True], ids=["cells", "stacked"])
@pytest.mark.parametrize("order", ["by_cell", "by_expert"])
def test_the_forwards_xa_is_read_in_place_of_its_gmm(rng, order, stacked, layout):
    """``xa=`` (each row's ``x A^T`` as the forward made it, spread by
    adapter or by row) gives the cotangents computed without it, in either
    form and row order; and it is what the ``xa`` terms read: twice it
    doubles ``dB`` and ``d_scale`` and leaves ``dx`` and ``dA`` as they are."""
    L, E, P = 3, 4, 14
    route = make_route(rng, P=P, R=8, K=16, N=24, L=L, E=E)
    cells = _own_slots(L, E, rng)
    route = route.replace(a_table=jnp.asarray(cells), b_table=jnp.asarray(cells[::-1]))
    M = 90
    adapter, expert, _, ok = _rows(rng, route, M, sort=True)
    key = grouped_vjp.cell_keys(L, E, adapter, expert, ok)
    if order == "by_cell":
        o = _by_cell(key, expert, L, E)
        expert, key = expert[o], key[o]
    x = jnp.asarray(rng.normal(size=(M, 16)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(M, 24)), jnp.float32)
    m, off = grouped_vjp.member(route, g), _offsets(expert, E)
    run = jax.jit(lambda x, m, k, o, xa: grouped_vjp.lora_grads(
        x, [m], k, o, impl="jnp", stacked=stacked, xa=xa))
    xa = _spread_xa(x, m, key, L, by_row=layout == "by_row")
    want = run(x, m, key, off, None)
    got = run(x, m, key, off, [xa])
    twice = run(x, m, key, off, [2 * xa])
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert np.abs(np.asarray(b)).max() > 0
        assert _rel(a, b) <= 1e-5
    (dx, (gr,)), (dx2, (gr2,)) = got, twice
    assert _rel(dx2, dx) <= 1e-6 and _rel(gr2.d_a_pool, gr.d_a_pool) <= 1e-6
    assert _rel(gr2.d_b_pool, 2 * gr.d_b_pool) <= 1e-6
    assert _rel(gr2.d_scale, 2 * gr.d_scale) <= 1e-6


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
@pytest.mark.parametrize("stacked", [False, True], ids=["cells", "stacked"])
@pytest.mark.parametrize("order", ["by_cell", "by_expert"])
@pytest.mark.parametrize("L", [1, 4])
def test_kernels_match_the_jnp_form(rng, L, order, stacked):
    """bf16 on the CUDA kernels against the same formulation in jnp, rows in
    the cell layout or only grouped by expert: equal within bf16 error, the
    pool and scale cotangents the same bits on a second run."""
    dt = jnp.bfloat16
    route = make_route(rng, P=33, R=16, K=256, N=128, L=L, E=8, dtype=dt)
    # every cell its own slot (the layout whose pool gradients are deterministic)
    cells = _own_slots(L, 8, rng)
    route = route.replace(a_table=jnp.asarray(cells), b_table=jnp.asarray(cells))
    M = 1500
    adapter, expert, _, ok = _rows(rng, route, M, sort=True)
    key = grouped_vjp.cell_keys(L, 8, adapter, expert, ok)
    if order == "by_cell":
        o = _by_cell(key, expert, L, 8)
        expert, key = expert[o], key[o]
    x = jnp.asarray(rng.normal(size=(M, 256)), dt)
    g = jnp.asarray(rng.normal(size=(M, 128)), dt)
    run = jax.jit(lambda x, m, k, o, impl: grouped_vjp.lora_grads(x, [m], k, o, impl=impl,
                                                                  stacked=stacked),
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


@pytest.mark.parametrize("L", [1, 4])
def test_rows_sorted_with_their_adapters_are_in_the_cell_layout(rng, L):
    """``sort_rows_by_expert`` with the row-adapter map and ``L`` (what the
    block and the training benchmark do) gives the layout of the fast side
    of the backward's ``cond``: the rows' group keys never decrease."""
    T, top_k, E = 200, 4, 6
    topk = jnp.asarray(rng.integers(-1, E + 1, (T, top_k)), jnp.int32)
    row_adapter = jnp.asarray(rng.integers(-1, L + 1, T), jnp.int32)
    _, offsets, stids = sort_rows_by_expert(topk, E, row_adapter, L)
    M = T * top_k
    expert, _, adapter, ok = jnp_fold.grouped_rows(offsets, stids, row_adapter, x_rows=T,
                                                   row_offset=0, row_end=M, x_gather=1)
    key = np.asarray(grouped_vjp.cell_keys(L, E, adapter, expert, ok))
    k2 = np.asarray(grouped_vjp.group_keys(jnp.asarray(key), offsets, L))
    assert (np.diff(k2) >= 0).all()
    assert (key < L * E).any() and (key == L * E).any()
