"""docs/semantics.md §3: packed expert tables, MoeExpertRoute and its constructors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_moelora as jm
from conftest import assert_pure_device
from jax_moelora import ExpertTables, MoeExpertRoute
from jax_moelora.geometry import padded_rank
from jax_moelora.reference import gather_bgmv_ref

SETTINGS = settings(max_examples=40, deadline=None)


def naive_pack(entries, n=None):
    """docs/semantics.md §3 as a dict: later entries overwrite earlier ones."""
    last = {}
    for eid, a, b, s in entries:
        last[eid] = (a, b, s)
    n = max(last) + 1 if n is None else n
    a_t, b_t, s_t = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.float32)
    for eid, (a, b, s) in last.items():
        a_t[eid], b_t[eid], s_t[eid] = a, b, s
    return a_t, b_t, s_t


entry_st = st.tuples(st.integers(0, 12), st.integers(1, 40), st.integers(1, 40),
                     st.floats(-4, 4, allow_nan=False, width=32))


# --------------------------------------------------------------------------
# ExpertTables / pack_expert_tables (host)
# --------------------------------------------------------------------------

@SETTINGS
@given(entries=st.lists(entry_st, min_size=1, max_size=16))
def test_pack_matches_spec(entries):
    t = jm.pack_expert_tables(entries)
    a, b, s = naive_pack(entries)
    assert isinstance(t, ExpertTables)
    assert t.n_experts == max(e[0] for e in entries) + 1 == t.a.shape[0]
    assert t.a.dtype == np.int32 and t.b.dtype == np.int32 and t.scale.dtype == np.float32
    np.testing.assert_array_equal(t.a, a)
    np.testing.assert_array_equal(t.b, b)
    np.testing.assert_array_equal(t.scale, s)
    # unadapted ids are 0 / 0 / 0.0
    unadapted = np.setdiff1d(np.arange(t.n_experts), [e[0] for e in entries])
    assert not t.a[unadapted].any() and not t.b[unadapted].any() and not t.scale[unadapted].any()


def test_pack_duplicate_keeps_last_entry():
    rng = np.random.default_rng(0)
    eid = int(rng.integers(0, 6))
    first = (eid, int(rng.integers(1, 9)), int(rng.integers(1, 9)), float(rng.random()))
    last = (eid, first[1] + 10, first[2] + 10, first[3] + 1.0)
    other = (eid + 1, int(rng.integers(1, 9)), int(rng.integers(1, 9)), float(rng.random()))
    t = jm.pack_expert_tables([first, other, last])
    assert (t.a[eid], t.b[eid]) == (last[1], last[2])
    assert t.scale[eid] == np.float32(last[3])
    assert t.a[eid + 1] == other[1]


def test_pack_empty_is_none_and_unpacks():
    assert jm.pack_expert_tables([]) is None
    assert jm.pack_expert_tables(iter(())) is None
    assert jm.pack_expert_tables([], n_experts=4) is None
    rng = np.random.default_rng(1)
    entries = [(int(i), int(rng.integers(1, 9)), int(rng.integers(1, 9)), float(rng.random()))
               for i in rng.choice(8, size=3, replace=False)]
    a, b, s, n = jm.pack_expert_tables(entries)
    assert n == max(e[0] for e in entries) + 1 == a.shape[0] == b.shape[0] == s.shape[0]


def test_pack_numpy_scalars_and_given_length():
    rng = np.random.default_rng(2)
    ids = rng.choice(6, size=4, replace=False)
    entries = [(np.int64(i), np.int32(rng.integers(1, 9)), np.int16(rng.integers(1, 9)),
                np.float32(rng.random())) for i in ids]
    t = jm.pack_expert_tables(entries, n_experts=9)
    assert t.n_experts == 9 and t.a.shape == (9,)
    want = naive_pack([(int(e), int(a), int(b), float(s)) for e, a, b, s in entries], 9)
    for got, w in zip((t.a, t.b, t.scale), want):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("entries, kw, err", [
    ([(-1, 1, 1, 1.0)], {}, ValueError),                 # negative id
    ([(0, -1, 1, 1.0)], {}, ValueError),                 # negative a slot
    ([(0, 1, -2, 1.0)], {}, ValueError),                 # negative b slot
    ([(2**31, 1, 1, 1.0)], {}, ValueError),              # id beyond int32
    ([(0, 2**31, 1, 1.0)], {}, ValueError),              # slot beyond int32
    ([(3, 1, 1, 1.0)], {"n_experts": 3}, ValueError),    # id >= n_experts
    ([(0, 1, 1, 1.0)], {"n_experts": 0}, ValueError),
    ([(0, 1, 1, 1.0)], {"n_experts": 2.0}, TypeError),
    ([(0, 1, 1)], {}, ValueError),                       # malformed entry
    ([5], {}, ValueError),
    ([(0.0, 1, 1, 1.0)], {}, TypeError),                 # float id
    ([(True, 1, 1, 1.0)], {}, TypeError),                # bool id
    ([(0, 1.0, 1, 1.0)], {}, TypeError),                 # float slot
    ([(0, 1, 1, "x")], {}, TypeError),                   # non-real scale
    ([(0, 1, 1, True)], {}, TypeError),
    ([(0, 1, 1, float("nan"))], {}, ValueError),         # non-finite scale
    ([(0, 1, 1, float("inf"))], {}, ValueError),
])
def test_pack_invalid(entries, kw, err):
    with pytest.raises(err):
        jm.pack_expert_tables(entries, **kw)


# --------------------------------------------------------------------------
# traced twin
# --------------------------------------------------------------------------

def split(entries):
    ids = np.array([e[0] for e in entries], np.int32)
    a = np.array([e[1] for e in entries], np.int32)
    b = np.array([e[2] for e in entries], np.int32)
    s = np.array([e[3] for e in entries], np.float32)
    return ids, a, b, s


@SETTINGS
@given(entries=st.lists(st.tuples(st.integers(-3, 14), st.integers(1, 40), st.integers(1, 40),
                                  st.floats(-4, 4, allow_nan=False, width=32)),
                        min_size=1, max_size=16),
       n=st.integers(1, 12))
def test_traced_pack_agrees_with_host_under_jit(entries, n):
    fn = jax.jit(jm.pack_expert_tables_traced, static_argnums=4)
    tables, valid = fn(*map(jnp.asarray, split(entries)), n)
    kept = [e for e in entries if 0 <= e[0] < n]
    assert bool(valid) == (len(kept) == len(entries))
    assert tables.n_experts == n and isinstance(tables.n_experts, int)
    host = jm.pack_expert_tables(kept, n_experts=n)
    want = (np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.float32)) \
        if host is None else (host.a, host.b, host.scale)
    for got, w, dt in zip((tables.a, tables.b, tables.scale), want,
                          (jnp.int32, jnp.int32, jnp.float32)):
        assert got.dtype == dt and got.shape == (n,)
        np.testing.assert_array_equal(got, w)
    if host is not None and len(kept) == len(entries):
        # the host path raises where the traced path only flags
        assert jm.pack_expert_tables(entries, n_experts=n) is not None
    elif len(kept) < len(entries) and all(e[0] >= 0 for e in entries):
        with pytest.raises(ValueError):
            jm.pack_expert_tables(entries, n_experts=n)


def test_traced_pack_last_wins_is_deterministic_and_compiles_once():
    rng = np.random.default_rng(3)
    traces = []

    def f(ids, a, b, s):
        traces.append(1)
        return jm.pack_expert_tables_traced(ids, a, b, s, 8)

    jf = jax.jit(f)
    for _ in range(5):
        m = 64  # many duplicates among 8 ids
        ids = rng.integers(0, 8, size=m).astype(np.int32)
        a = rng.integers(1, 1000, size=m).astype(np.int32)
        b = rng.integers(1, 1000, size=m).astype(np.int32)
        s = rng.standard_normal(m).astype(np.float32)
        args = tuple(map(jnp.asarray, (ids, a, b, s)))
        (t1, v1), (t2, v2) = jf(*args), jf(*args)
        host = jm.pack_expert_tables(list(zip(ids.tolist(), a.tolist(), b.tolist(), s.tolist())),
                                     n_experts=8)
        for x1, x2, h in zip((t1.a, t1.b, t1.scale), (t2.a, t2.b, t2.scale),
                             (host.a, host.b, host.scale)):
            np.testing.assert_array_equal(x1, x2)
            np.testing.assert_array_equal(x1, h)
        assert bool(v1) and bool(v2)
    assert len(traces) == 1
    assert_pure_device(f, *args)


def test_traced_pack_empty_and_host_inputs():
    t, v = jm.pack_expert_tables_traced([], [], [], [], 5)
    assert bool(v) and t.n_experts == 5
    assert not np.asarray(t.a).any() and not np.asarray(t.b).any() and not np.asarray(t.scale).any()
    rng = np.random.default_rng(4)
    ids = rng.choice(5, size=3, replace=False)
    a, b = rng.integers(1, 9, size=3), rng.integers(1, 9, size=3)
    s = rng.random(3)
    t, v = jm.pack_expert_tables_traced(ids, a, b, s, 5)
    host = jm.pack_expert_tables(list(zip(ids.tolist(), a.tolist(), b.tolist(), s.tolist())),
                                 n_experts=5)
    np.testing.assert_array_equal(t.a, host.a)
    np.testing.assert_array_equal(t.scale, host.scale)


def test_expert_tables_is_pytree_with_static_length():
    rng = np.random.default_rng(5)
    ids = jnp.asarray(rng.permutation(6)[:4].astype(np.int32))
    out = jax.jit(lambda i: jm.pack_expert_tables_traced(i, i + 1, i + 2, i * 0.5, 6)[0])(ids)
    assert isinstance(out, ExpertTables) and out.n_experts == 6
    leaves, treedef = jax.tree_util.tree_flatten(out)
    assert len(leaves) == 3
    assert jax.tree_util.tree_unflatten(treedef, leaves).n_experts == 6


@pytest.mark.parametrize("args, err", [
    (([0], [1], [1], [1.0], 0), ValueError),          # n_experts < 1
    (([0], [1], [1], [1.0], 2.5), TypeError),         # n_experts not int
    (([0], [1], [1], [1.0], True), TypeError),
    (([0, 1], [1], [1], [1.0], 4), ValueError),       # lengths differ
    (([0], [1], [1, 2], [1.0], 4), ValueError),
    (([0], [1], [1], [1.0, 2.0], 4), ValueError),
    (([0.0], [1], [1], [1.0], 4), TypeError),         # float ids
    (([0], [1.0], [1], [1.0], 4), TypeError),
    (([0], [1], [1], [True], 4), TypeError),          # bool scales
    (([[0]], [[1]], [[1]], [[1.0]], 4), ValueError),  # 2-D
])
def test_traced_pack_invalid(args, err):
    with pytest.raises(err):
        jm.pack_expert_tables_traced(*args)


# --------------------------------------------------------------------------
# MoeExpertRoute
# --------------------------------------------------------------------------

def make_pools(rng, P=4, R=16, K=12, N=10, dtype=np.float32):
    a = rng.standard_normal((P, R, K)).astype(dtype)
    b = rng.standard_normal((P, N, R)).astype(dtype)
    return a, b


def test_route_properties_and_1d_tables():
    rng = np.random.default_rng(6)
    P, R, K, N, E = 5, 16, 12, 10, 7
    a, b = make_pools(rng, P, R, K, N)
    at = rng.integers(0, P, size=E)
    r = MoeExpertRoute(a_pool=a, b_pool=b, a_table=at, b_table=at[::-1].copy(),
                       scale_table=rng.random(E))
    assert (r.n_experts, r.k_in, r.n_out, r.max_rank, r.max_loras, r.pool_size) == (E, K, N, R, 1, P)
    assert r.a_table.shape == (1, E) and r.a_table.dtype == np.int32
    assert r.scale_table.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(r.a_table)[0], at)
    assert "n_experts=7" in repr(r)


def test_route_2d_tables_and_pytree_through_jit():
    rng = np.random.default_rng(7)
    L, E = 3, 5
    a, b = make_pools(rng)
    t = jnp.asarray(rng.integers(0, 4, size=(L, E)), jnp.int32)
    r = MoeExpertRoute(a_pool=jnp.asarray(a), b_pool=jnp.asarray(b), a_table=t, b_table=t,
                       scale_table=jnp.asarray(rng.random((L, E)), jnp.float32))
    assert r.max_loras == L and r.n_experts == E
    out = jax.jit(lambda route: route)(r)
    assert isinstance(out, MoeExpertRoute) and out.max_loras == L
    np.testing.assert_array_equal(out.a_table, t)
    r2 = r.replace(scale_table=jnp.zeros((L, E)))
    assert not np.asarray(r2.scale_table).any() and r2.a_pool is r.a_pool


@pytest.mark.parametrize("change, err", [
    ({"a_pool": "pool"}, TypeError),
    ({"a_pool": np.zeros((4, 16), np.float32)}, ValueError),          # not 3-D
    ({"b_pool": np.zeros((4, 10), np.float32)}, ValueError),
    ({"a_pool": np.zeros((4, 16, 12), np.int32)}, TypeError),         # int pool
    ({"b_pool": np.zeros((4, 10, 16), np.float16)}, TypeError),       # dtype mismatch
    ({"b_pool": np.zeros((3, 10, 16), np.float32)}, ValueError),      # P mismatch
    ({"b_pool": np.zeros((4, 10, 8), np.float32)}, ValueError),       # rank mismatch
    ({"a_pool": np.zeros((4, 12, 12), np.float32),
      "b_pool": np.zeros((4, 10, 12), np.float32)}, ValueError),      # rank not multiple of 8
    ({"a_table": np.zeros((2, 5), np.float32)}, TypeError),           # float a_table
    ({"b_table": np.zeros((2, 5), np.float32)}, TypeError),
    ({"scale_table": np.array(["x"] * 5)}, TypeError),
    ({"a_table": np.zeros((2, 2, 5), np.int32)}, ValueError),         # 3-D table
    ({"a_table": np.zeros((2, 4), np.int32)}, ValueError),            # shapes differ
    ({"a_table": np.zeros((0, 5), np.int32), "b_table": np.zeros((0, 5), np.int32),
      "scale_table": np.zeros((0, 5), np.float32)}, ValueError),      # empty tables
])
def test_route_invalid(change, err):
    rng = np.random.default_rng(8)
    a, b = make_pools(rng)
    fields = dict(a_pool=a, b_pool=b, a_table=np.ones((2, 5), np.int32),
                  b_table=np.ones((2, 5), np.int32), scale_table=np.ones((2, 5), np.float32))
    fields.update(change)
    with pytest.raises(err):
        MoeExpertRoute(**fields)


# --------------------------------------------------------------------------
# route_from_dense
# --------------------------------------------------------------------------

def dense(rng, L, E, r, K, N, dtype=np.float32):
    a = rng.standard_normal((L, E, r, K)).astype(dtype)
    b = rng.standard_normal((L, E, N, r)).astype(dtype)
    s = (rng.random((L, E)) + 0.5).astype(np.float32)
    return a, b, s


def check_dense_route(route, a, b, s, mask, ranks):
    L, E, r, K = a.shape
    N = b.shape[2]
    R = padded_rank(r)
    ap, bp = np.asarray(route.a_pool), np.asarray(route.b_pool)
    at, bt, st_ = map(np.asarray, (route.a_table, route.b_table, route.scale_table))
    assert (route.max_loras, route.n_experts, route.k_in, route.n_out, route.max_rank) == \
        (L, E, K, N, R)
    assert route.pool_size == int(mask.sum()) + 1
    assert not ap[0].any() and not bp[0].any()          # slot 0 reserved, zero
    assert not ap[:, r:, :].any() and not bp[:, :, r:].any()   # rank padding is zero
    used = at[mask]
    assert sorted(used.tolist()) == list(range(1, route.pool_size))  # each pair its own slot
    assert not at[~mask].any() and not bt[~mask].any() and not st_[~mask].any()
    np.testing.assert_array_equal(at, bt)
    for l in range(L):
        for e in range(E):
            if not mask[l, e]:
                continue
            k = ranks[l, e]
            slot = at[l, e]
            np.testing.assert_array_equal(ap[slot, :k], a[l, e, :k])
            np.testing.assert_array_equal(bp[slot, :, :k], b[l, e, :, :k])
            assert not ap[slot, k:].any() and not bp[slot, :, k:].any()
            assert st_[l, e] == np.float32(s[l, e])


@SETTINGS
@given(L=st.integers(1, 3), E=st.integers(1, 5), r=st.integers(1, 17), seed=st.integers(0, 2**16),
       use_mask=st.booleans(), use_ranks=st.booleans())
def test_route_from_dense(L, E, r, seed, use_mask, use_ranks):
    rng = np.random.default_rng(seed)
    K, N = int(rng.integers(1, 9)), int(rng.integers(1, 9))
    a, b, s = dense(rng, L, E, r, K, N)
    mask = rng.random((L, E)) < 0.6 if use_mask else np.ones((L, E), bool)
    ranks = rng.integers(1, r + 1, size=(L, E)) if use_ranks else np.full((L, E), r)
    route = jm.route_from_dense(a, b, s, mask if use_mask else None,
                                ranks=ranks if use_ranks else None)
    check_dense_route(route, a, b, s, mask, ranks)
    same = MoeExpertRoute.from_dense(a, b, s, mask if use_mask else None,
                                     ranks=ranks if use_ranks else None)
    np.testing.assert_array_equal(same.a_pool, route.a_pool)
    np.testing.assert_array_equal(same.scale_table, route.scale_table)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_route_from_dense_dtype_and_scale_forms(dtype):
    rng = np.random.default_rng(9)
    L, E, r, K, N = 2, 3, 6, 8, 5
    a, b, s = dense(rng, L, E, r, K, N)
    a, b = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
    per_adapter = rng.random(L).astype(np.float32) + 0.1
    route = jm.route_from_dense(a, b, per_adapter)
    assert route.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(route.scale_table, np.repeat(per_adapter[:, None], E, axis=1))
    scalar = float(rng.random()) + 0.1
    route = jm.route_from_dense(a, b, scalar)
    np.testing.assert_allclose(route.scale_table, np.full((L, E), scalar, np.float32))


def test_route_from_dense_traced_weights():
    rng = np.random.default_rng(10)
    a, b, s = dense(rng, 2, 4, 8, 6, 5)
    mask = rng.random((2, 4)) < 0.7
    mask[0, 0] = True
    route = jax.jit(lambda a, b, s: jm.route_from_dense(a, b, s, mask))(a, b, s)
    check_dense_route(route, a, b, s, mask, np.full((2, 4), 8))


def test_route_from_dense_folds_like_the_dense_formula():
    """Tables point at the right blocks: the reference fold over the route
    equals ``base + scale * B (A x)`` computed from the dense layout."""
    rng = np.random.default_rng(11)
    L, E, r, K, N, T, top_k = 3, 5, 5, 7, 6, 6, 2
    a, b, s = dense(rng, L, E, r, K, N)
    mask = rng.random((L, E)) < 0.7
    ranks = rng.integers(1, r + 1, size=(L, E))
    route = jm.route_from_dense(a, b, s, mask, ranks=ranks)
    x = rng.standard_normal((T * top_k, K)).astype(np.float32)
    base = rng.standard_normal((T * top_k, N)).astype(np.float32)
    idx = rng.integers(0, E, size=T * top_k).astype(np.int32)
    ra = rng.integers(-1, L + 1, size=T).astype(np.int32)
    got = gather_bgmv_ref(x, base, idx, route, ra, top_k=top_k, x_gather=0)
    want = base.astype(np.float64)
    for row in range(T * top_k):
        l, e = int(ra[row // top_k]), int(idx[row])
        if 0 <= l < L and mask[l, e]:
            k = ranks[l, e]
            A = a[l, e, :k].astype(np.float64)
            B = b[l, e, :, :k].astype(np.float64)
            want[row] += s[l, e] * (B @ (A @ x[row]))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not np.array_equal(got, base)


@pytest.mark.parametrize("case, err", [
    ("a_3d", ValueError),
    ("b_3d", ValueError),
    ("a_list", TypeError),
    ("int_dtype", TypeError),
    ("dtype_mismatch", TypeError),
    ("le_mismatch", ValueError),
    ("rank_mismatch", ValueError),
    ("empty", ValueError),
    ("scales_shape", ValueError),
    ("scales_str", TypeError),
    ("scales_bool", TypeError),
    ("mask_shape", ValueError),
    ("mask_dtype", TypeError),
    ("mask_traced", TypeError),
    ("ranks_zero", ValueError),
    ("ranks_big", ValueError),
    ("ranks_shape", ValueError),
    ("ranks_float", TypeError),
])
def test_route_from_dense_invalid(case, err):
    rng = np.random.default_rng(12)
    L, E, r, K, N = 2, 3, 4, 5, 6
    a, b, s = dense(rng, L, E, r, K, N)
    kw = dict(a=a, b=b, scales=s, mask=None, ranks=None)
    if case == "a_3d":
        kw["a"] = a[0]
    elif case == "b_3d":
        kw["b"] = b[0]
    elif case == "a_list":
        kw["a"] = a.tolist()
    elif case == "int_dtype":
        kw["a"], kw["b"] = a.astype(np.int32), b.astype(np.int32)
    elif case == "dtype_mismatch":
        kw["b"] = b.astype(np.float16)
    elif case == "le_mismatch":
        kw["b"] = b[:, :2]
    elif case == "rank_mismatch":
        kw["b"] = b[..., :3]
    elif case == "empty":
        kw["a"], kw["b"], kw["scales"] = a[:, :0], b[:, :0], s[:, :0]
    elif case == "scales_shape":
        kw["scales"] = s[:, :2]
    elif case == "scales_str":
        kw["scales"] = np.array([["x"] * E] * L)
    elif case == "scales_bool":
        kw["scales"] = True
    elif case == "mask_shape":
        kw["mask"] = np.ones((L, E + 1), bool)
    elif case == "mask_dtype":
        kw["mask"] = np.ones((L, E), np.int32)
    elif case == "ranks_zero":
        kw["ranks"] = np.zeros((L, E), np.int32)
    elif case == "ranks_big":
        kw["ranks"] = r + 1
    elif case == "ranks_shape":
        kw["ranks"] = np.ones((L, E + 1), np.int32)
    elif case == "ranks_float":
        kw["ranks"] = np.ones((L, E))
    if case == "mask_traced":
        with pytest.raises(err, match="concrete"):
            jax.jit(lambda m: jm.route_from_dense(a, b, s, m))(jnp.ones((L, E), bool))
        return
    with pytest.raises(err):
        jm.route_from_dense(kw.pop("a"), kw.pop("b"), kw.pop("scales"), kw.pop("mask"), **kw)


# --------------------------------------------------------------------------
# router route
# --------------------------------------------------------------------------

def test_router_route_single():
    rng = np.random.default_rng(13)
    r, hidden, num_experts = 5, 12, 9
    a = rng.standard_normal((r, hidden)).astype(np.float32)
    b = rng.standard_normal((num_experts, r)).astype(np.float32)
    scale = float(rng.random()) + 0.1
    route = jm.router_route(a, b, scale)
    assert (route.n_experts, route.k_in, route.n_out, route.max_loras) == (1, hidden,
                                                                          num_experts, 1)
    assert route.max_rank == padded_rank(r)
    slot = int(np.asarray(route.a_table)[0, 0])
    assert slot >= 1 and int(np.asarray(route.b_table)[0, 0]) == slot
    np.testing.assert_array_equal(np.asarray(route.a_pool)[slot, :r], a)
    np.testing.assert_array_equal(np.asarray(route.b_pool)[slot, :, :r], b)
    np.testing.assert_allclose(route.scale_table, [[scale]])
    # as docs/semantics.md §3 folds it: gather kernel, zero indices, top_k 1, x_gather 0
    x = rng.standard_normal((4, hidden)).astype(np.float32)
    logits = rng.standard_normal((4, num_experts)).astype(np.float32)
    got = gather_bgmv_ref(x, logits, np.zeros(4, np.int32), route, top_k=1, x_gather=0)
    np.testing.assert_allclose(got, logits + scale * (x @ a.T) @ b.T, rtol=1e-4, atol=1e-4)
    same = MoeExpertRoute.router(a, b, scale)
    np.testing.assert_array_equal(same.a_pool, route.a_pool)


def test_router_route_multi_adapter_with_mask():
    rng = np.random.default_rng(14)
    L, r, hidden, num_experts = 3, 8, 10, 6
    a = rng.standard_normal((L, r, hidden)).astype(np.float32)
    b = rng.standard_normal((L, num_experts, r)).astype(np.float32)
    scale = rng.random(L).astype(np.float32) + 0.1
    mask = np.array([True, False, True])
    route = jm.router_route(a, b, scale, mask)
    assert (route.max_loras, route.n_experts, route.k_in, route.n_out) == (L, 1, hidden,
                                                                          num_experts)
    at = np.asarray(route.a_table)[:, 0]
    assert at[1] == 0 and float(np.asarray(route.scale_table)[1, 0]) == 0.0
    for l in (0, 2):
        np.testing.assert_array_equal(np.asarray(route.a_pool)[at[l]], a[l])
        np.testing.assert_array_equal(np.asarray(route.b_pool)[at[l]], b[l])
        assert np.asarray(route.scale_table)[l, 0] == scale[l]
    shared = jm.router_route(a, b, 0.5)
    np.testing.assert_allclose(shared.scale_table, np.full((L, 1), 0.5))


@pytest.mark.parametrize("case, err", [
    ("a_1d", ValueError),
    ("ndim_mismatch", ValueError),
    ("a_list", TypeError),
    ("rank_mismatch", ValueError),
    ("L_mismatch", ValueError),
    ("scale_shape", ValueError),
    ("scale_bool", TypeError),
    ("mask_shape", ValueError),
    ("mask_dtype", TypeError),
    ("dtype", TypeError),
])
def test_router_route_invalid(case, err):
    rng = np.random.default_rng(15)
    L, r, hidden, ne = 2, 4, 6, 5
    a = rng.standard_normal((L, r, hidden)).astype(np.float32)
    b = rng.standard_normal((L, ne, r)).astype(np.float32)
    scale, mask = np.ones(L, np.float32), None
    if case == "a_1d":
        a, b = a[0, 0], b[0, 0]
    elif case == "ndim_mismatch":
        a = a[0]
    elif case == "a_list":
        a = a.tolist()
    elif case == "rank_mismatch":
        b = b[..., :3]
    elif case == "L_mismatch":
        b = b[:1]
    elif case == "scale_shape":
        scale = np.ones(L + 1)
    elif case == "scale_bool":
        scale = True
    elif case == "mask_shape":
        mask = np.ones(L + 1, bool)
    elif case == "mask_dtype":
        mask = np.ones(L, np.int32)
    elif case == "dtype":
        a, b = a.astype(np.int32), b.astype(np.int32)
    with pytest.raises(err):
        jm.router_route(a, b, scale, mask)
