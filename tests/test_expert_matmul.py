"""``expert_matmul``: the grouped expert GEMM with the LoRA fold (docs/expert_matmul.md).

Each backend is held to a float64 NumPy reference:

- the GEMM alone: every row of a group is ``round(xs[r] @ w[e])`` within the
  dtype's relative error; rows past the last group (and rows whose token is
  outside ``x`` with ``x_gather=1``) are exactly zero;
- with LoRA: rows without an adapter are bit-identical to the same backend's
  GEMM without LoRA, and the folded rows equal the reference fold
  (``grouped_down_ref``) applied to that backend's own GEMM output (CPU/jnp:
  within the ulp criterion of docs/semantics.md §6);
- gradients w.r.t. ``x``, ``w``, the pools and the scales match jnp autodiff
  of an independent per-row formulation.

``impl="fast"`` (CUTLASS grouped GEMM on sm90) carries the ``gpu`` marker and
is checked against ``impl="jnp"``. ``Case.run`` folds after the GEMM
(``lora_in_gemm=False``); tests/test_lora_in_gemm.py checks the fold inside it.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moelora as ml
from conftest import HAS_GPU
from _fold_cases import (DELTA_RTOL, DTYPE_IDS, DTYPES, assert_ulp_close, bits, make_route,
                         on_platform, random_row_adapter, route_folds, run_with_graphs_off,
                         to_device)
from jax_moelora.ops import GATHER_MAX_ROWS
from jax_moelora.reference import grouped_down_ref, round_to

GPU = pytest.mark.gpu
IMPLS = ["cpu", "jnp", pytest.param("fast", marks=GPU)]
# Relative error (by norm) of the GEMM against the float64 product.
GEMM_RTOL = {jnp.dtype(jnp.bfloat16): 8e-3, jnp.dtype(jnp.float16): 1e-3,
             jnp.dtype(jnp.float32): 1e-5}

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
impls = pytest.mark.parametrize("impl", IMPLS)
x_gathers = pytest.mark.parametrize("x_gather", [0, 1], ids=["xg0", "xg1"])


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# ------------------------------------------------------------------ cases

@dataclasses.dataclass
class Case:
    x: np.ndarray                   # [M or num_tokens, K]
    ws: tuple[np.ndarray, ...]      # one or two [E, K, N]
    group_sizes: np.ndarray         # int32 [E]
    sorted_token_ids: np.ndarray | None
    row_adapter: np.ndarray | None
    routes: tuple                   # one or two MoeExpertRoute / None
    x_gather: int

    @property
    def M(self) -> int:
        return self.x.shape[0] if not self.x_gather else self.sorted_token_ids.shape[0]

    @property
    def offsets(self) -> np.ndarray:
        ends = np.minimum(np.cumsum(np.maximum(self.group_sizes.astype(np.int64), 0)), self.M)
        return np.concatenate([[0], ends]).astype(np.int32)

    def xs(self) -> np.ndarray:
        """The rows the GEMM reads (zero rows for tokens outside x)."""
        if not self.x_gather:
            return self.x
        t = self.sorted_token_ids.astype(np.int64)
        ok = (t >= 0) & (t < self.x.shape[0])
        return np.where(ok[:, None], self.x[np.clip(t, 0, self.x.shape[0] - 1)], 0).astype(
            self.x.dtype)

    def gemm_ref(self, w) -> np.ndarray:
        """float64 ``xs @ w[e]`` rounded to the dtype; zero outside the groups."""
        xs, offs = self.xs().astype(np.float64), self.offsets
        out = np.zeros((self.M, w.shape[2]), np.float64)
        for e in range(w.shape[0]):
            lo, hi = offs[e], offs[e + 1]
            out[lo:hi] = xs[lo:hi] @ w[e].astype(np.float64)
        return round_to(out, self.x.dtype).astype(self.x.dtype)

    def fold_ref(self, base: np.ndarray, route) -> np.ndarray:
        """The reference fold applied to ``base`` (a backend's GEMM output)."""
        stids = (np.arange(self.M, dtype=np.int32) if self.sorted_token_ids is None
                 else self.sorted_token_ids)
        ra = self.row_adapter
        if self.x_gather and ra is None:
            ra = np.zeros((self.x.shape[0],), np.int32)
        return grouped_down_ref(self.xs(), base, self.offsets, stids, route, ra, x_gather=0)

    def fold_rows(self, route) -> np.ndarray:
        """bool [M]: rows the fold must change (by the skip rule)."""
        offs, M = self.offsets, self.M
        e = np.full(M, -1)
        for i in range(len(offs) - 1):
            e[offs[i]:offs[i + 1]] = i
        stids = (np.arange(M) if self.sorted_token_ids is None
                 else self.sorted_token_ids.astype(np.int64))
        limit = self.x.shape[0] if (self.x_gather or self.row_adapter is None) else \
            self.row_adapter.shape[0]
        tok_ok = (stids >= 0) & (stids < limit)
        if self.row_adapter is None:
            adapter = np.zeros(M, np.int64)
        else:
            adapter = self.row_adapter[np.clip(stids, 0, limit - 1)].astype(np.int64)
        return route_folds(route, adapter, e) & tok_ok & (e >= 0)

    def run(self, impl: str, *, lora: bool = True, glu: bool = False, stacked: bool = False,
            jit: bool = True, gather_max_rows: int | None = None, schedule: str = "auto",
            lora_in_gemm: bool | None = False, packs: bool = False):
        with on_platform(impl):
            pair = len(self.ws) == 2
            w = tuple(to_device(self.ws)) if pair else to_device(self.ws[0])
            routes = to_device(self.routes) if lora else None
            lo = None if routes is None else (routes if pair else routes[0])
            args = to_device((self.x, self.group_sizes, self.sorted_token_ids, self.row_adapter))

            def f(x, w, gs, stids, ra, lo):
                lp = None  # packs: each route's pack_lora_in_gemm, passed as lora_packs
                if packs:
                    lp = jax.tree.map(lambda r: None if r is None else ml.pack_lora_in_gemm(r),
                                      lo, is_leaf=lambda r: r is None or
                                      isinstance(r, ml.MoeExpertRoute))
                return ml.expert_matmul(x, w, gs, lora=lo, row_adapter=ra,
                                        sorted_token_ids=stids, x_gather=self.x_gather,
                                        glu=glu, stacked=stacked, impl=impl,
                                        gather_max_rows=gather_max_rows, schedule=schedule,
                                        lora_in_gemm=lora_in_gemm, lora_packs=lp)

            f = jax.jit(f) if jit else f
            out = f(args[0], w, args[1], args[2], args[3], lo)
            return jax.tree.map(np.asarray, out)


def make_case(rng, *, dtype=jnp.bfloat16, num_loras: int = 1, pair: bool = False,
              x_gather: int = 0, E: int = 6, K: int = 64, N: int = 48, M: int = 56,
              ranks=(8, 16), max_rank: int = 16, with_map: bool = True,
              group_sizes=None, tail: int = 5, poison: bool = True) -> Case:
    """Random inputs: groups of random sizes (one empty) that end ``tail``
    rows before ``M``; with ``x_gather=1`` tokens in ``[0, M // 2)`` plus a
    few out of range; the routes' tables cover ``E - 1`` experts (the last
    expert is never adapted)."""
    dt = jnp.dtype(dtype)
    if group_sizes is None:
        cuts = np.sort(rng.integers(0, M - tail + 1, E - 1))
        group_sizes = np.diff(np.concatenate([[0], cuts, [M - tail]]))
        group_sizes[rng.integers(E)] = 0
        group_sizes[-1] += 0
        # keep the total at M - tail after emptying one group
        group_sizes[np.argmax(group_sizes)] += (M - tail) - group_sizes.sum()
    group_sizes = np.asarray(group_sizes, np.int32)
    num_tokens = M if not x_gather else max(2, M // 2)
    x = rng.normal(0.0, 1.0, (num_tokens, K)).astype(dt)
    ws = tuple(rng.normal(0.0, K ** -0.5, (E, K, N)).astype(dt) for _ in range(2 if pair else 1))
    stids = None
    if x_gather:
        stids = rng.integers(0, num_tokens, M).astype(np.int32)
        bad = rng.random(M) < 0.1
        stids[bad] = rng.choice([-1, num_tokens, num_tokens + 3], bad.sum())
    elif with_map:
        stids = rng.permutation(M).astype(np.int32)
    routes = tuple(
        None if num_loras == 0 else
        make_route(rng, dtype=dt, num_loras=num_loras, n_experts=E - 1, k_in=K, n_out=N,
                   ranks=ranks, max_rank=max_rank, poison=poison)
        for _ in ws)
    ra = None
    if num_loras and with_map:
        ra = random_row_adapter(rng, num_tokens, num_loras)
    return Case(x, ws, group_sizes, stids, ra, routes, x_gather)


def _rel(out, ref) -> float:
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))


def check_gemm(case: Case, out: np.ndarray, w: np.ndarray) -> None:
    """The GEMM alone against the float64 product; zero rows exactly zero."""
    ref = case.gemm_ref(w)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    offs = case.offsets
    zero = np.ones(case.M, bool)
    zero[offs[0]:offs[-1]] = False
    if case.x_gather:
        t = case.sorted_token_ids
        zero |= (t < 0) | (t >= case.x.shape[0])
    np.testing.assert_array_equal(np.asarray(out[zero], np.float64), 0.0)
    err = _rel(out[~zero], ref[~zero])
    assert err <= GEMM_RTOL[out.dtype], f"GEMM relative error {err:.3g}"


def check_lora(case: Case, out: np.ndarray, base: np.ndarray, route, *, strict: bool) -> None:
    """Folded rows against the reference fold of this backend's own GEMM;
    every other row bit-identical to it."""
    fold = case.fold_rows(route)
    assert fold.any() and (~fold).any(), "the case must fold some rows and skip others"
    np.testing.assert_array_equal(bits(out[~fold]), bits(base[~fold]))
    ref = case.fold_ref(base, route)
    np.testing.assert_array_equal(bits(ref[~fold]), bits(base[~fold]))
    want = ref[fold].astype(np.float64) - base[fold].astype(np.float64)
    got = out[fold].astype(np.float64) - base[fold].astype(np.float64)
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert err <= DELTA_RTOL[out.dtype], f"delta relative error {err:.3g}"
    if strict and out.dtype != np.float32:
        assert_ulp_close(out[fold], ref[fold], "folded rows")


def check_gemm_close(case: Case, out: np.ndarray, want: np.ndarray) -> None:
    """The CUDA GEMM against the jnp backend: exact zeros, values within the
    dtype's relative error."""
    zero = np.all(np.asarray(want, np.float64) == 0, axis=1)
    np.testing.assert_array_equal(bits(out[zero]), bits(want[zero]))
    assert _rel(out, want) <= GEMM_RTOL[out.dtype]


# ------------------------------------------------------------------ forward

@pytest.mark.parametrize("num_loras", [0, 1, 4], ids=["L0", "L1", "L4"])
@x_gathers
@dtypes
@impls
def test_single_weight(rng, impl, dtype, x_gather, num_loras):
    case = make_case(rng, dtype=dtype, num_loras=num_loras, x_gather=x_gather,
                     ranks=(8, 16, 32, 64), max_rank=64)
    base = case.run(impl, lora=False)
    if impl == "fast":
        check_gemm_close(case, base, case.run("jnp", lora=False))
    else:
        check_gemm(case, base, case.ws[0])
    if num_loras:
        out = case.run(impl)
        # the ulp criterion holds for the CPU handlers; on a GPU XLA compiles the
        # jnp backend's dots as it chooses, and jnp and fast are held to §6's delta tolerance
        check_lora(case, out, base, case.routes[0], strict=impl == "cpu" or not HAS_GPU)


@pytest.mark.parametrize("pair", [False, True], ids=["single", "pair"])
@pytest.mark.parametrize("with_map", [True, False], ids=["map", "no_map"])
@x_gathers
@dtypes
@impls
def test_gather_and_grouped_folds_agree(rng, impl, dtype, x_gather, with_map, pair):
    """Up to ``gather_max_rows`` sorted rows the LoRA is folded by the gather
    fold, above by the grouped fold: the same rows fold and skip, and on the
    CPU backends (jnp, cpu) the two give the same bits; the CUDA kernels are
    each held to the reference fold."""
    case = make_case(rng, dtype=dtype, num_loras=4, pair=pair, x_gather=x_gather,
                     with_map=with_map or bool(x_gather), ranks=(8, 16, 32, 64), max_rank=64)
    assert case.M <= GATHER_MAX_ROWS
    gathered = case.run(impl)
    grouped = case.run(impl, gather_max_rows=case.M - 1)
    base = case.run(impl, lora=False)
    for i in range(len(case.ws)):
        g, s, b = ((gathered[i], grouped[i], base[i]) if pair else (gathered, grouped, base))
        if impl == "fast":
            for out in (g, s):
                check_lora(case, out, b, case.routes[i], strict=False)
        else:
            np.testing.assert_array_equal(bits(g), bits(s))
            check_lora(case, g, b, case.routes[i], strict=impl == "cpu")


def test_gather_max_rows_must_be_an_int_or_none(rng):
    case = make_case(rng)
    with pytest.raises(TypeError, match="gather_max_rows must be an int or None"):
        case.run("jnp", gather_max_rows=2.0)
    case.run("jnp", gather_max_rows=None)  # the default: gather_rows_limit(E)


@pytest.mark.parametrize("dtype, x_gather, num_loras", [
    (jnp.bfloat16, 0, 0), (jnp.bfloat16, 1, 4), (jnp.float16, 0, 1), (jnp.float16, 1, 4)],
    ids=["bf16-xg0-L0", "bf16-xg1-L4", "f16-xg0-L1", "f16-xg1-L4"])
@impls
def test_gate_up_pair(rng, impl, dtype, x_gather, num_loras):
    """Gate and up in one call equal two single calls; the GLU is
    round(silu(gate) * up)."""
    case = make_case(rng, dtype=dtype, num_loras=num_loras, pair=True, x_gather=x_gather)
    # on a GPU, XLA compiles each program's jnp dots its own way: 2 ulp there
    same = (lambda a, b, what: assert_ulp_close(a, b, what)) if impl == "jnp" and HAS_GPU else (
        lambda a, b, what: np.testing.assert_array_equal(bits(a), bits(b), err_msg=what))
    g, u = case.run(impl)
    for i, out in enumerate((g, u)):
        single = dataclasses.replace(case, ws=(case.ws[i],), routes=(case.routes[i],))
        same(out, single.run(impl), f"projection {i} of the pair against one call")
    glu = case.run(impl, glu=True)
    want = (jax.nn.silu(g.astype(np.float32)) * u.astype(np.float32)).astype(dtype)
    same(glu, np.asarray(want), "glu")
    gu = case.run(impl, stacked=True)
    assert gu.shape == (2,) + g.shape
    same(gu[0], g, "stacked gate")
    same(gu[1], u, "stacked up")


def test_stacked_weights_and_one_sided_lora(rng):
    """w stacked [2, E, K, N] equals the tuple; lora=(None, route) folds only up."""
    case = make_case(rng, pair=True, num_loras=1)
    with on_platform("cpu"):
        x, gs = jnp.asarray(case.x), jnp.asarray(case.group_sizes)
        stids, ra = jnp.asarray(case.sorted_token_ids), jnp.asarray(case.row_adapter)
        stacked = jnp.stack([jnp.asarray(w) for w in case.ws])
        route = to_device(case.routes[1])
        g, u = ml.expert_matmul(x, stacked, gs, lora=(None, route), row_adapter=ra,
                                sorted_token_ids=stids, impl="cpu")
        g0, u0 = ml.expert_matmul(x, tuple(jnp.asarray(w) for w in case.ws), gs,
                                  sorted_token_ids=stids, impl="cpu")
    np.testing.assert_array_equal(bits(g), bits(g0))
    check_lora(case, np.asarray(u), np.asarray(u0), case.routes[1], strict=True)


@impls
def test_group_sizes_edge_cases(rng, impl):
    """Negative sizes count as 0, a total past M is cut at M, empty groups and
    an all-empty batch (every row zero)."""
    M = 40
    for sizes in ([10, -3, 0, 20, 30, 5], [0, 0, 0, 0, 0, 0], [40, 0, 0, 0, 0, 0],
                  [0, 0, 0, 0, 0, 41]):
        case = make_case(rng, M=M, group_sizes=sizes, num_loras=0)
        out = case.run(impl, lora=False)
        if impl == "fast":
            check_gemm_close(case, out, case.run("jnp", lora=False))
        else:
            check_gemm(case, out, case.ws[0])


def test_backends_agree_bitwise_on_skipped_rows(rng):
    """cpu and jnp give the same GEMM rows and skip the same rows."""
    case = make_case(rng, num_loras=4, ranks=(8, 16, 32, 64), max_rank=64)
    out_cpu, out_jnp = case.run("cpu"), case.run("jnp")
    fold = case.fold_rows(case.routes[0])
    assert _rel(out_cpu[~fold], out_jnp[~fold]) <= GEMM_RTOL[out_cpu.dtype]
    np.testing.assert_array_equal(bits(case.run("cpu", lora=False)[~fold]), bits(out_cpu[~fold]))


def test_eager_equals_jit(rng):
    case = make_case(rng, num_loras=1)
    np.testing.assert_array_equal(bits(case.run("cpu", jit=False)), bits(case.run("cpu")))


# ------------------------------------------------------------------ backward

def _dense_loss(case: Case, x, w, route, cot, *, lora: bool):
    """An independent formulation: per row, ``xs @ w[e] + s * (xs A^T) B^T``
    with the skip mask, fp32, no rounding (the VJP's straight-through rule)."""
    M, offs = case.M, case.offsets
    e = np.full(M, -1)
    for i in range(len(offs) - 1):
        e[offs[i]:offs[i + 1]] = i
    rows_in = jnp.asarray(e >= 0)
    ec = jnp.asarray(np.clip(e, 0, w.shape[0] - 1))
    if case.x_gather:
        t = case.sorted_token_ids
        ok = (t >= 0) & (t < case.x.shape[0])
        xs = jnp.where(jnp.asarray(ok)[:, None],
                       x[jnp.asarray(np.clip(t, 0, case.x.shape[0] - 1))], 0.0)
    else:
        xs = x
    out = jnp.einsum("mk,mkn->mn", xs, w[ec], precision="highest")
    out = jnp.where(rows_in[:, None], out, 0.0)
    if lora:
        fold = jnp.asarray(case.fold_rows(case.routes[0]))
        stids = (np.arange(M) if case.sorted_token_ids is None
                 else case.sorted_token_ids.astype(np.int64))
        L = route.max_loras
        if case.row_adapter is None:
            l = np.zeros(M, np.int64)
        else:
            limit = case.row_adapter.shape[0]
            l = case.row_adapter[np.clip(stids, 0, limit - 1)].astype(np.int64)
        l = np.clip(np.zeros_like(l) if L == 1 else l, 0, L - 1)
        ecl = np.clip(e, 0, route.n_experts - 1)
        a = np.asarray(route.a_table)[l, ecl]
        b = np.asarray(route.b_table)[l, ecl]
        a, b = np.where(np.asarray(fold), a, 0), np.where(np.asarray(fold), b, 0)
        s = route.scale_table[jnp.asarray(l), jnp.asarray(ecl)]
        xa = jnp.einsum("mk,mrk->mr", xs, route.a_pool[jnp.asarray(a)], precision="highest")
        delta = jnp.einsum("mr,mnr->mn", xa, route.b_pool[jnp.asarray(b)], precision="highest")
        out = out + jnp.where(fold[:, None], s[:, None] * delta, 0.0)
    return jnp.sum(out * cot)


@pytest.mark.parametrize("num_loras", [0, 1, 4], ids=["L0", "L1", "L4"])
@x_gathers
@pytest.mark.parametrize("impl", ["cpu", "jnp", pytest.param("fast", marks=GPU)])
def test_grad_matches_jnp_autodiff(rng, impl, x_gather, num_loras):
    case = make_case(rng, dtype=jnp.float32, num_loras=num_loras, x_gather=x_gather,
                     ranks=(8, 16), max_rank=16, poison=False)
    cot = rng.normal(size=(case.M, case.ws[0].shape[2])).astype(np.float32)
    lora = num_loras > 0
    with on_platform(impl):
        x, w, cot_j = jnp.asarray(case.x), jnp.asarray(case.ws[0]), jnp.asarray(cot)
        gs = jnp.asarray(case.group_sizes)
        stids = None if case.sorted_token_ids is None else jnp.asarray(case.sorted_token_ids)
        ra = None if case.row_adapter is None else jnp.asarray(case.row_adapter)
        route = to_device(case.routes[0]) if lora else None

        def with_pools(p):
            return None if p is None else jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(route),
                [p[0], p[1], route.a_table, route.b_table, p[2]])

        def loss(x, w, p):
            out = ml.expert_matmul(x, w, gs, lora=with_pools(p), row_adapter=ra,
                                   sorted_token_ids=stids, x_gather=case.x_gather, impl=impl)
            return jnp.sum(out * cot_j)

        pools = (route.a_pool, route.b_pool, route.scale_table) if lora else None
        got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, pools)
        want = jax.grad(lambda x, w, p: _dense_loss(case, x, w, with_pools(p), cot_j, lora=lora),
                        argnums=(0, 1, 2))(x, w, pools)
    for name, g, h in (("x", got[0], want[0]), ("w", got[1], want[1])):
        assert _rel(g, h) <= 1e-5, f"d{name}: {_rel(g, h):.3g}"
    if lora:
        for name, g, h in zip(("a_pool", "b_pool", "scale_table"), got[2], want[2]):
            assert np.abs(np.asarray(h)).max() > 0, f"d{name} is zero: the test could not fail"
            assert _rel(g, h) <= 1e-5, f"d{name}: {_rel(g, h):.3g}"


@pytest.mark.parametrize("impl", ["cpu", pytest.param("fast", marks=GPU)])
def test_grad_bf16_close(rng, impl):
    """bf16 (the CUDA kernel's forward on a GPU): gradients within bf16 error
    of the fp32 formulation."""
    case = make_case(rng, dtype=jnp.bfloat16, num_loras=1, poison=False)
    with on_platform(impl):
        x, w = jnp.asarray(case.x), jnp.asarray(case.ws[0])
        gs, stids = jnp.asarray(case.group_sizes), jnp.asarray(case.sorted_token_ids)
        ra, route = jnp.asarray(case.row_adapter), to_device(case.routes[0])

        def fwd(x, w):
            return ml.expert_matmul(x, w, gs, lora=route, row_adapter=ra,
                                    sorted_token_ids=stids, impl=impl)

        dx, dw = jax.grad(lambda x, w: jnp.sum(fwd(x, w).astype(jnp.float32) ** 2),
                          argnums=(0, 1))(x, w)
        assert dx.dtype == x.dtype and dw.dtype == w.dtype
        out = fwd(x, w).astype(jnp.float32)
        r32 = jax.tree.map(lambda v: v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v,
                           route)
        want = jax.grad(lambda x, w: _dense_loss(case, x, w, r32, 2 * out, lora=True),
                        argnums=(0, 1))(x.astype(jnp.float32), w.astype(jnp.float32))
    assert _rel(dx, want[0]) <= 2e-2 and _rel(dw, want[1]) <= 2e-2


# ------------------------------------------------------------------ validation

def _args(rng, **kw):
    case = make_case(rng, num_loras=1, **kw)
    return (jnp.asarray(case.x), jnp.asarray(case.ws[0]), jnp.asarray(case.group_sizes),
            to_device(case.routes[0]))


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda a: dict(x=a["x"][None]), ValueError, "x must be 2-D"),
    (lambda a: dict(x=a["x"].astype(jnp.int32)), TypeError, "x dtype"),
    (lambda a: dict(w=a["w"][:, :-1]), ValueError, "x has 64 columns but w has K = 63"),
    (lambda a: dict(w=a["w"].astype(jnp.float16)), TypeError, "w dtype float16"),
    (lambda a: dict(w=a["w"][None].repeat(3, 0)), ValueError, "stacked"),
    (lambda a: dict(w=(a["w"], a["w"], a["w"])), ValueError, "w_gate, w_up"),
    (lambda a: dict(w=(a["w"], a["w"][:, :, :8])), ValueError, "differ in shape"),
    (lambda a: dict(group_sizes=a["group_sizes"][:-1]), ValueError, "group_sizes has 5"),
    (lambda a: dict(group_sizes=a["group_sizes"].astype(jnp.int64)
                    if jax.config.jax_enable_x64 else a["group_sizes"].astype(jnp.float32)),
     TypeError, "group_sizes must be int32"),
    (lambda a: dict(x_gather=2), ValueError, "x_gather must be 0 or 1"),
    (lambda a: dict(x_gather=1), ValueError, "needs sorted_token_ids"),
    (lambda a: dict(sorted_token_ids=jnp.zeros((3,), jnp.int32)), ValueError,
     "sorted_token_ids has 3 entries"),
    (lambda a: dict(row_adapter=jnp.zeros((3,), jnp.int32)), ValueError,
     "row_adapter has 3 entries"),
    (lambda a: dict(lora=(a["lora"], a["lora"])), TypeError, "one weight set"),
    (lambda a: dict(w=(a["w"], a["w"])), TypeError, "must be a pair"),
    (lambda a: dict(lora=a["lora"].replace(a_pool=a["lora"].a_pool.astype(jnp.float16),
                                           b_pool=a["lora"].b_pool.astype(jnp.float16))),
     TypeError, "lora pools are float16"),
    (lambda a: dict(w=a["w"][:, :, :16]), ValueError, "lora has n_out 48, w has 16"),
    (lambda a: dict(w=a["w"][:3], group_sizes=a["group_sizes"][:3]), ValueError,
     "lora has 5 experts, w has 3"),
    (lambda a: dict(glu=True), ValueError, "glu=True needs a gate/up pair"),
    (lambda a: dict(stacked=True), ValueError, "stacked=True needs a gate/up pair"),
    (lambda a: dict(w=(a["w"], a["w"]), lora=None, glu=True, stacked=True), ValueError,
     "and glu=False"),
    (lambda a: dict(impl="simple"), ValueError, "impl must be one of"),
    (lambda a: dict(schedule="warp"), ValueError, "schedule must be one of"),
    (lambda a: dict(lora="route"), TypeError, "lora must be a MoeExpertRoute"),
])
def test_validation_names_the_argument(rng, mutate, exc, match):
    x, w, gs, route = _args(rng)
    kw = dict(x=x, w=w, group_sizes=gs, lora=route, impl="jnp")
    kw.update(mutate(dict(kw)))
    with pytest.raises(exc, match=match):
        ml.expert_matmul(kw.pop("x"), kw.pop("w"), kw.pop("group_sizes"), **kw)


@pytest.mark.skipif(HAS_GPU, reason="a GPU with the CUDA kernels is present")
def test_fast_without_a_gpu_is_refused(rng):
    """impl='fast' off a GPU is refused with the reason, before any launch."""
    x, w, gs, _ = _args(rng)
    with pytest.raises(ValueError, match="impl='fast' needs the CUDA kernels on a GPU"):
        ml.expert_matmul(x, w, gs, impl="fast")


# ------------------------------------------------------------------ CUDA kernel

@GPU
def test_fast_runs_the_cutlass_kernel(rng):
    """On an sm_90 GPU with the kernel built, impl='fast' lowers to the
    expert_matmul custom call (so the gpu tests above exercise it)."""
    from jax_moelora.ops.expert_matmul import uses_kernel

    assert ml.backends()["expert_matmul_kernel"], "the CUTLASS kernel was not built"
    assert uses_kernel(jnp.bfloat16, 64, 48) and uses_kernel(jnp.float16, 64, 48)
    x, w, gs, route = _args(rng)
    hlo = jax.jit(lambda x, w, gs: ml.expert_matmul(x, w, gs, lora=route, impl="fast")).lower(
        x, w, gs).as_text()
    assert "expert_matmul" in hlo


@GPU
def test_kernel_use_follows_the_default_device():
    """Whether impl='fast' runs the CUTLASS kernel is decided per call: a CPU
    default-device context on a machine with a GPU does not use it, and later
    calls outside the context do again."""
    from jax_moelora.ops.expert_matmul import uses_kernel

    assert uses_kernel(jnp.bfloat16, 64, 48)
    with jax.default_device(jax.devices("cpu")[0]):
        assert not uses_kernel(jnp.bfloat16, 64, 48)
    assert uses_kernel(jnp.bfloat16, 64, 48)


def test_kernel_not_used_off_the_gpu():
    from jax_moelora.ops.expert_matmul import uses_kernel

    with jax.default_device(jax.devices("cpu")[0]):
        assert not uses_kernel(jnp.bfloat16, 64, 48)


@GPU
@pytest.mark.parametrize("pair", [False, True], ids=["down", "gate_up"])
def test_fast_model_shapes(pair):
    """Qwen3-30B-A3B-shaped experts (128 experts, K = 2048, N = 768), 4096
    routed rows, 4 adapters of rank 16, the fold in the GEMM's custom call
    (``gather_max_rows=0``): the CUDA path against jnp (GEMM within bf16
    error, rows without adapter bit-identical to the GEMM alone)."""
    rng = np.random.default_rng(7)
    E, K, N, M = 128, 2048, 768, 4096
    sizes = np.bincount(rng.integers(0, E, M - 37), minlength=E).astype(np.int32)
    case = make_case(rng, E=E, K=K, N=N, M=M, group_sizes=sizes, num_loras=4, pair=pair,
                     ranks=(16,), max_rank=16)
    base = case.run("fast", lora=False)
    want = case.run("jnp", lora=False)
    for b, wnt in zip(base if pair else (base,), want if pair else (want,)):
        check_gemm_close(case, b, wnt)
    out = case.run("fast", gather_max_rows=0)
    for i, (o, b) in enumerate(zip(out if pair else (out,), base if pair else (base,))):
        check_lora(case, o, b, case.routes[i], strict=False)


@GPU
@pytest.mark.parametrize("max_rank, ranks", [
    (8, (8,)), (24, (8, 24)), (48, (16, 40, 48)), (64, (32, 64)), (128, (72, 128))],
    ids=["r8", "r24", "r48", "r64", "r128"])
@pytest.mark.parametrize("pair", [False, True], ids=["single", "one_sided_pair"])
@pytest.mark.parametrize("gather_max_rows", [GATHER_MAX_ROWS, 0], ids=["gather", "grouped"])
@dtypes
def test_fast_lora_ranks_and_partial_tiles(rng, dtype, pair, max_rank, ranks, gather_max_rows):
    """The CUDA path with LoRA at ranks 8 to 128 (zero-padded ranks included),
    over 5 experts with partial 128-row tiles, N = 200 (a partial 128-column
    GEMM tile), 4 adapters mixed within every 16-row slab, adapted and
    unadapted cells: rows without an adapter bit-identical to the GEMM alone,
    folded rows within the delta tolerance of the reference fold of that
    output. As a gate/up pair with only up adapted, gate is the GEMM alone,
    bit for bit. Both folds: the gather fold after the GEMM (300 rows, the
    default) and the grouped fold in the GEMM's custom call."""
    if dtype == jnp.float32:
        pytest.skip("the CUDA GEMM takes bf16 and f16")
    case = make_case(rng, dtype=dtype, num_loras=4, pair=pair, E=5, K=96, N=200, M=300,
                     ranks=ranks, max_rank=max_rank)
    if pair:
        case = dataclasses.replace(case, routes=(None, case.routes[1]))
    base = case.run("fast", lora=False)
    out = case.run("fast", gather_max_rows=gather_max_rows)
    if pair:
        np.testing.assert_array_equal(bits(out[0]), bits(base[0]))
        out, base = out[1], base[1]
    check_lora(case, out, base, case.routes[-1], strict=False)


def test_schedule_heuristic():
    """``schedule="auto"``: the pingpong kernel up to ``PINGPONG_MAX_K``
    (Qwen3's down projection, K = 768), the cooperative one above (every
    gate/up, DeepSeek-V2-Lite's and Mixtral's down)."""
    from jax_moelora.ops.expert_matmul import PINGPONG_MAX_K, gemm_schedule

    assert gemm_schedule(768) == gemm_schedule(PINGPONG_MAX_K) == "pingpong"
    assert gemm_schedule(PINGPONG_MAX_K + 8) == gemm_schedule(1408) == "cooperative"
    assert gemm_schedule(2048) == gemm_schedule(4096) == gemm_schedule(14336) == "cooperative"


@GPU
@pytest.mark.parametrize("schedule, K, value", [("auto", 64, 1), ("auto", 2048, 0),
                                                ("cooperative", 64, 0), ("pingpong", 2048, 1)])
def test_schedule_reaches_the_custom_call(rng, schedule, K, value):
    """The resolved schedule is the custom call's ``schedule`` attribute
    (``EXPERT_MATMUL_COOPERATIVE`` 0, ``EXPERT_MATMUL_PINGPONG`` 1)."""
    import re

    from jax_moelora import _ext

    assert (_ext.EXPERT_MATMUL_COOPERATIVE, _ext.EXPERT_MATMUL_PINGPONG) == (0, 1)
    x, w, gs = jnp.zeros((32, K), jnp.bfloat16), jnp.zeros((4, K, 16), jnp.bfloat16), \
        jnp.asarray([8, 8, 8, 8], jnp.int32)
    hlo = jax.jit(lambda x, w, gs: ml.expert_matmul(x, w, gs, impl="fast", schedule=schedule)
                  ).lower(x, w, gs).as_text()
    assert re.findall(r"schedule = (\d+)", hlo) == [str(value)]


@GPU
@pytest.mark.parametrize("E, K, N, M", [(5, 96, 200, 300), (128, 768, 2048, 4096)],
                         ids=["partial_tiles", "qwen_down"])
@pytest.mark.parametrize("pair", [False, True], ids=["single", "pair"])
@dtypes
def test_schedules_give_the_same_bits(rng, dtype, pair, E, K, N, M):
    """The cooperative and pingpong kernels give the same bits, GEMM alone and
    with 4 adapters folded by the grouped fold in the same custom call."""
    if dtype == jnp.float32:
        pytest.skip("the CUDA GEMM takes bf16 and f16")
    case = make_case(rng, dtype=dtype, num_loras=4, pair=pair, E=E, K=K, N=N, M=M,
                     ranks=(16,), max_rank=16)
    planes = lambda out: out if pair else (out,)  # noqa: E731
    for lora in (False, True):
        coop, ping = (planes(case.run("fast", lora=lora, gather_max_rows=0, schedule=s))
                      for s in ("cooperative", "pingpong"))
        for c, p in zip(coop, ping):
            np.testing.assert_array_equal(bits(c), bits(p))
        if not lora:
            for c, want in zip(coop, planes(case.run("jnp", lora=False))):
                check_gemm_close(case, c, want)


def graph_program(seed: int, impl: str = "fast", n_layers: int = 3) -> np.ndarray:
    """``n_layers`` MoE MLPs (gate/up with the GLU, then down, LoRA on all
    three) in one jitted program, run on two different routings with the same
    compiled program; the raw bits of both results, flattened. Used
    in-process and in a subprocess with command buffers (CUDA graphs) off."""
    rng = np.random.default_rng(seed)
    E, H, I, M = 8, 64, 48, 96
    gate_up = make_case(rng, E=E, K=H, N=I, M=M, pair=True, num_loras=2, poison=False)
    down = make_case(rng, E=E, K=I, N=H, M=M, num_loras=2, poison=False)
    sizes = [gate_up.group_sizes, np.asarray([M - 8, 0, 0, 0, 0, 0, 0, 8], np.int32)]

    def program(x, wgu, wd, gs, stids, ra, rgu, rd):
        for _ in range(n_layers):
            h = ml.expert_matmul(x, wgu, gs, lora=rgu, row_adapter=ra, sorted_token_ids=stids,
                                 glu=True, impl=impl)
            x = ml.expert_matmul(h, wd, gs, lora=rd, row_adapter=ra, sorted_token_ids=stids,
                                 impl=impl)
        return x

    with on_platform(impl):
        f = jax.jit(program)
        x = jnp.asarray(rng.normal(size=(M, H)).astype(jnp.bfloat16))
        args = to_device((gate_up.ws, down.ws[0]))
        rest = to_device((gate_up.sorted_token_ids, gate_up.row_adapter, gate_up.routes,
                          down.routes[0]))
        outs = [f(x, *args, jnp.asarray(s), *rest) for s in sizes]
        return np.concatenate([bits(np.asarray(o)).ravel() for o in outs])


@GPU
def test_fast_in_cuda_graphs_matches_graphs_off(tmp_path):
    """The same program with XLA's command buffers on (default) and off gives
    identical bits, on two routings replayed through one compiled program (the
    handler's problem arrays are rebuilt on the device every call)."""
    seed = 99
    on = graph_program(seed)
    off = run_with_graphs_off(tmp_path, "test_expert_matmul", f"graph_program({seed})")
    np.testing.assert_array_equal(off, on)
    # and the fast program agrees with jnp (three chained layers: 3x the bf16 bound)
    as_bf16 = lambda v: np.asarray(v).view(jnp.bfloat16).astype(np.float64)  # noqa: E731
    assert _rel(as_bf16(on), as_bf16(graph_program(seed, "jnp"))) <= 3 * GEMM_RTOL[
        jnp.dtype(jnp.bfloat16)]


# ------------------------------------------------------------------ backward on the kernels

def _train_case(rng, *, sort_by_adapter: bool, E: int = 8, K: int = 64, N: int = 48,
                T: int = 96, top_k: int = 2, L: int = 4):
    """bf16 gate/up pair, tokens routed to ``top_k`` experts, rows sorted by
    expert (and by adapter within an expert when ``sort_by_adapter``)."""
    dt = jnp.bfloat16
    topk = np.stack([rng.permutation(E)[:top_k] for _ in range(T)]).astype(np.int32)
    ra = rng.integers(-1, L, T).astype(np.int32)
    if sort_by_adapter:
        _, offsets, stids = ml.sort_rows_by_expert(jnp.asarray(topk), E, jnp.asarray(ra), L)
    else:
        _, offsets, stids = ml.sort_rows_by_expert(jnp.asarray(topk), E)
    gs = jnp.diff(offsets).astype(jnp.int32)
    x = jnp.asarray(rng.normal(size=(T, K)), dt)
    ws = tuple(jnp.asarray(rng.normal(0, K ** -0.5, (E, K, N)), dt) for _ in range(2))
    routes = tuple(to_device(make_route(rng, dtype=dt, num_loras=L, n_experts=E, k_in=K,
                                        n_out=N, ranks=(8, 16), max_rank=16, poison=False))
                   for _ in range(2))
    return x, ws, gs, stids, jnp.asarray(ra), routes


def _mlp_grads(impl, x, ws, gs, stids, ra, routes, cot, lora_in_gemm=None, gather_max_rows=0):
    """Gradients of ``sum(glu(gate, up) * cot)`` w.r.t. ``x``, the weights and
    each route's ``(a_pool, b_pool, scale_table)``."""
    def loss(x, ws, pools):
        lora = tuple(r.replace(a_pool=a, b_pool=b, scale_table=s)
                     for r, (a, b, s) in zip(routes, pools))
        h = ml.expert_matmul(x, ws, gs, lora=lora, row_adapter=ra, sorted_token_ids=stids,
                             x_gather=1, glu=True, impl=impl, gather_max_rows=gather_max_rows,
                             lora_in_gemm=lora_in_gemm)
        return jnp.sum(h.astype(jnp.float32) * cot)
    pools = tuple((r.a_pool, r.b_pool, r.scale_table) for r in routes)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, ws, pools)


@pytest.mark.parametrize("L", [1, 4])
@pytest.mark.parametrize("table_experts", [8, 5, 11], ids=["E_t=E", "E_t<E", "E_t>E"])
def test_kernel_backward_formulation_equals_the_ragged_backward(rng, L, table_experts):
    """The backward the GPU runs, with the jnp form of its grouped matmuls
    (every platform): f32 gate/up, rows sorted by expert only (rows of
    different adapters and rows that fold nothing interleaved within an
    expert), tables of as many, fewer or more experts than the weights; its
    dx, dw and routes' cotangents equal the ``ragged_dot`` backward's."""
    from jax_moelora.ops.expert_matmul import _bwd_kernel, _bwd_ragged, _Cfg

    E, K, N, T = 8, 32, 24, 60
    topk = np.stack([rng.permutation(E)[:2] for _ in range(T)]).astype(np.int32)
    ra = jnp.asarray(rng.integers(-1, L, T).astype(np.int32))
    _, offsets, stids = ml.sort_rows_by_expert(jnp.asarray(topk), E)
    xs = jnp.asarray(rng.normal(size=(stids.shape[0], K)), jnp.float32)
    ws = tuple(jnp.asarray(rng.normal(0, K ** -0.5, (E, K, N)), jnp.float32) for _ in range(2))
    routes = tuple(to_device(make_route(rng, dtype=jnp.float32, num_loras=L,
                                        n_experts=table_experts, k_in=K, n_out=N,
                                        ranks=(8, 16), max_rank=16, poison=False))
                   for _ in range(2))
    gs = jnp.asarray(rng.normal(size=(2, stids.shape[0], N)), jnp.float32)
    args = (xs, ws, offsets.astype(jnp.int32), stids, routes, ra)
    got = jax.jit(lambda a, g: _bwd_kernel(a, g, True, True, impl="jnp"))(args, gs)
    want = jax.jit(lambda a, g: _bwd_ragged(_Cfg("jnp", True), a, g))(args, gs)
    pairs = [("dx", got[0], want[0])] + [(f"dw{i}", got[1][i], want[1][i]) for i in range(2)]
    for i in range(2):
        for name in ("a_pool", "b_pool", "scale_table"):
            pairs.append((f"{name}{i}", getattr(got[2][i], name), getattr(want[2][i], name)))
    for name, g, w in pairs:
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert np.abs(np.asarray(w, np.float64)).max() > 0, f"d{name} is zero"
        assert _rel(g, w) <= 1e-5, f"d{name}: {_rel(g, w):.3g}"


@GPU
@pytest.mark.parametrize("fold", ["fold_after", "in_gemm", "gather"])
@pytest.mark.parametrize("sort_by_adapter", [True, False], ids=["by_adapter", "by_expert"])
def test_kernel_backward_matches_the_ragged_backward(rng, sort_by_adapter, fold):
    """bf16 gate/up with the GLU and 4 adapters (ranks 8 and 16 in one pool):
    the backward on the grouped GEMM kernels (dx with the weights read
    transposed, dw, the folds' pools and scales) equals the fp32
    ``ragged_dot`` backward within bf16 error, with the LoRA folded by the
    grouped fold after the GEMM, inside the GEMM or by the gather fold (the
    last two keep their rows' ``xa``, which the backward then reads)."""
    x, ws, gs, stids, ra, routes = _train_case(rng, sort_by_adapter=sort_by_adapter)
    cot = jnp.asarray(rng.normal(size=(stids.shape[0], ws[0].shape[2])), jnp.float32)
    got = _mlp_grads("fast", x, ws, gs, stids, ra, routes, cot, lora_in_gemm=fold == "in_gemm",
                     gather_max_rows=stids.shape[0] if fold == "gather" else 0)
    want = _mlp_grads("jnp", x, ws, gs, stids, ra, routes, cot)
    pairs = [("x", got[0], want[0])] + [(f"w{i}", got[1][i], want[1][i]) for i in range(2)]
    for i in range(2):
        for j, name in enumerate(("a_pool", "b_pool", "scale_table")):
            pairs.append((f"{name}{i}", got[2][i][j], want[2][i][j]))
    for name, g, w in pairs:
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert np.abs(np.asarray(w, np.float64)).max() > 0, f"d{name} is zero"
        assert _rel(g, w) <= 2e-2, f"d{name}: {_rel(g, w):.3g}"


@GPU
def test_kernel_backward_of_frozen_weights_computes_no_dw(rng):
    """Gradients w.r.t. the LoRA state only: the compiled backward has no
    weight-shaped reduction, and its pool gradients are the same bits on a
    second run."""
    x, ws, gs, stids, ra, routes = _train_case(rng, sort_by_adapter=True)
    cot = jnp.asarray(rng.normal(size=(stids.shape[0], ws[0].shape[2])), jnp.float32)

    def loss(pools):
        lora = tuple(r.replace(a_pool=a, b_pool=b, scale_table=s)
                     for r, (a, b, s) in zip(routes, pools))
        h = ml.expert_matmul(x, ws, gs, lora=lora, row_adapter=ra, sorted_token_ids=stids,
                             x_gather=1, glu=True, impl="fast", gather_max_rows=0)
        return jnp.sum(h.astype(jnp.float32) * cot)

    pools = tuple((r.a_pool, r.b_pool, r.scale_table) for r in routes)
    grad = jax.jit(jax.grad(loss))
    hlo = grad.lower(pools).compile().as_text()
    E, K, N = ws[0].shape
    assert "grouped_matmul" in hlo
    assert f"f32[{E},{K},{N}]" not in hlo, "a dw reduction ran for frozen weights"
    first, second = grad(pools), grad(pools)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("impl", ["jnp", "cpu", pytest.param("fast", marks=GPU)])
def test_vmap_forward_and_backward(rng, impl):
    """``jax.vmap`` over a batch of inputs equals a loop of single calls,
    forward and backward (``x`` and the pools)."""
    dtype = jnp.float32 if impl != "fast" else jnp.bfloat16
    case = make_case(rng, dtype=dtype, num_loras=2, x_gather=1, poison=False)
    with on_platform(impl):
        x, w, gs, stids, ra = to_device((case.x, case.ws[0], case.group_sizes,
                                         case.sorted_token_ids, case.row_adapter))
        route = to_device(case.routes[0])
        xb = jnp.stack([x, 0.5 * x])

        def f(x, pools):
            r = route.replace(a_pool=pools[0], b_pool=pools[1])
            return ml.expert_matmul(x, w, gs, lora=r, row_adapter=ra, sorted_token_ids=stids,
                                    x_gather=1, impl=impl)

        def grads(x, pools):
            return jax.grad(lambda x, p: jnp.sum(f(x, p).astype(jnp.float32) ** 2),
                            argnums=(0, 1))(x, pools)

        pools = (route.a_pool, route.b_pool)
        out = jax.jit(jax.vmap(f, in_axes=(0, None)))(xb, pools)
        batched = jax.jit(jax.vmap(grads, in_axes=(0, None)))(xb, pools)
        # f32: the same sums (cuBLAS may pick another algorithm for a batch);
        # bf16: x's gradient adds a token's rows in an order XLA does not fix
        tol = (1e-6, 1e-5) if dtype == jnp.float32 else (1e-6, 1e-2)
        for i in range(2):
            assert _rel(out[i], jax.jit(f)(xb[i], pools)) <= tol[0]
            one = jax.jit(grads)(xb[i], pools)
            for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(batched)):
                assert _rel(b[i], a) <= tol[1]
