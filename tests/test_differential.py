"""Differential fuzzing of the fold backends (docs/semantics.md §5, §6 and
docs/malformed_metadata.md).

Hypothesis draws the shape of a case (dtype, adapters, experts, widths, rank,
tokens, ``top_k``, ``x_gather``, window, row-adapter map) and how it breaks the
contract (expert ids negative, past the table or at the int32 edges, adapter
values ``-1`` and ``>= L``, table cells outside the pool, decreasing, negative
or overflowing ``expert_offsets``, token ids out of range, NaN and inf in
``x`` or ``base_out``, zero-padded ranks); NumPy draws the values from a seed.
Every available backend (``cpu`` and ``jnp`` on any machine; ``simple`` and
``fast`` join on a GPU) must then

- leave every row the rules skip bit-identical to ``base_out`` (NaN payloads
  and ``-0.0`` included), the rules restated here independently;
- on the folded rows, be non-finite exactly where the float64 reference is,
  and elsewhere within a few roundings of the activation dtype of it (a
  per-element form of the §6 tolerance that cannot be dodged by
  cancellation: ``8 u (|base| + |s| sum_j |B_nj| sum_k |x_k A_jk|)``).

Runs are reproducible: ``derandomize=True`` and no example database. CI runs
``FUZZ_EXAMPLES`` examples per test (default 12); set ``MOELORA_FUZZ_EXAMPLES``
for a longer run (the GPU run uses 500).
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _fold_cases import (INT32_MAX, INT32_MIN, FoldCase, bits, make_route, random_expert_ids,
                         random_row_adapter, route_folds)
from conftest import HAS_GPU

FUZZ_EXAMPLES = int(os.environ.get("MOELORA_FUZZ_EXAMPLES", "12"))
SETTINGS = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)
IMPLS = ["cpu", "jnp"] + (["simple", "fast"] if HAS_GPU else [])
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# unit roundoff of the activation dtype (f32 has no intermediate rounding)
UNIT = {"f32": 0.0, "bf16": 2.0**-8, "f16": 2.0**-11}
# NaN and inf inputs are the point: the reference's NumPy warnings are expected
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
OFFSET_KINDS = ("sorted", "sorted", "sorted", "decreasing", "negative", "past_te", "int32_max")


@dataclasses.dataclass(frozen=True)
class Shape:
    dtype: str
    num_loras: int
    n_experts: int
    k_in: int
    n_out: int
    ranks: tuple[int, ...]
    max_rank: int
    out_of_pool: int
    seed: int


shapes = st.builds(
    Shape,
    dtype=st.sampled_from(sorted(DTYPES)),
    num_loras=st.integers(1, 3),
    n_experts=st.integers(1, 6),
    k_in=st.integers(1, 40),
    n_out=st.integers(1, 24),
    ranks=st.sampled_from([(8,), (1, 8), (3, 16), (16,)]),
    max_rank=st.sampled_from([8, 16, 24]),
    out_of_pool=st.integers(0, 1),
    seed=st.integers(0, 2**32 - 1),
)
poison = st.fixed_dictionaries({
    "x_nan": st.floats(0, 0.2), "x_inf": st.floats(0, 0.1),
    "base_nan": st.floats(0, 0.2), "base_inf": st.floats(0, 0.1),
})


def _route(shape: Shape, rng):
    ranks = tuple(min(r, shape.max_rank) for r in shape.ranks)
    L, E = shape.num_loras, shape.n_experts
    out_of_pool = shape.out_of_pool if L * E >= 3 else 0
    return make_route(rng, dtype=DTYPES[shape.dtype], num_loras=L, n_experts=E,
                      k_in=shape.k_in, n_out=shape.n_out, ranks=ranks,
                      max_rank=shape.max_rank, unadapted=0.3 if E > 1 else 0.0,
                      out_of_pool=out_of_pool)


def _unit(shape: Shape) -> float:
    """The dtype's unit roundoff plus the fp32 summation error of the two dots."""
    return UNIT[shape.dtype] + 2.0**-24 * (shape.k_in + shape.max_rank + 2)


def _expert_ids(rng, n: int, n_experts: int, bad: float, dtype=np.int32) -> np.ndarray:
    return random_expert_ids(rng, max(n, 2), n_experts, bad=bad, dtype=dtype)[:n]


def _poisoned(rng, v: np.ndarray, nan: float, inf: float) -> np.ndarray:
    v = v.astype(np.float64)
    v[rng.random(v.shape) < nan] = np.nan
    v[rng.random(v.shape) < inf] = np.inf
    v[rng.random(v.shape) < inf] = -np.inf
    return v


def _values(rng, route, x_rows: int, rows: int, p: dict):
    dt = route.dtype
    x = _poisoned(rng, rng.normal(size=(x_rows, route.k_in)), p["x_nan"], p["x_inf"])
    base = rng.normal(size=(rows, route.n_out))
    base[rng.random(base.shape) < 0.05] = -0.0
    base = _poisoned(rng, base, p["base_nan"], p["base_inf"])
    return x.astype(dt), base.astype(dt)


def _offsets(rng, kind: str, num_experts: int, te: int) -> np.ndarray:
    cuts = np.sort(rng.integers(0, te + 1, num_experts + 1))
    if kind == "sorted":
        return cuts.astype(np.int32)
    o = cuts.astype(np.int64)
    if kind == "decreasing":
        i = rng.integers(0, num_experts)
        o[i], o[i + 1] = max(o[i + 1], 1), min(o[i], max(o[i + 1], 1) - 1)
    elif kind == "negative":
        o[0] = -int(rng.integers(1, 5))
    elif kind == "past_te":
        o[-1] = te + int(rng.integers(1, 5))
    else:
        o[-1] = INT32_MAX
    return o.astype(np.int32)


# ------------------------------------------------------ the rules, restated

def _gather_mask(route, indices, row_adapter, top_k):
    n = indices.shape[0]
    tok = np.arange(n) // top_k
    adapter = np.zeros(n, np.int64) if row_adapter is None else row_adapter[tok]
    return route_folds(route, adapter, np.asarray(indices).astype(np.uint32).view(np.int32))


def _grouped_mask(route, offsets, stid, row_adapter, *, x_rows, x_gather, row_offset, row_end):
    te = stid.shape[0]
    o = offsets.astype(np.int64)
    fold = np.zeros(te, bool)
    if o[0] < 0 or (np.diff(o) < 0).any() or o[-1] > te:
        return fold
    for r in range(row_offset, row_end):
        owners = [e for e in range(o.shape[0] - 1) if o[e] <= r < o[e + 1]]
        if not owners:
            continue
        t = int(stid[r])
        limit = x_rows if x_gather else (None if row_adapter is None else row_adapter.shape[0])
        if limit is not None and not 0 <= t < limit:
            continue
        adapter = 0 if row_adapter is None else int(row_adapter[t])
        fold[r] = route_folds(route, np.array([adapter]), np.array([owners[0]]))[0]
    return fold


# ------------------------------------------------------------------ checks

def _error_bound(case: FoldCase, unit: float) -> np.ndarray:
    """Per element of the folded rows: 8 u (|base| + |s| sum_j |B_nj| sum_k |x_k A_jk|)."""
    r = case.route
    at, bt = np.asarray(r.a_table), np.asarray(r.b_table)
    st_ = np.asarray(r.scale_table, np.float64)
    A = np.abs(np.asarray(r.a_pool, np.float64))
    B = np.abs(np.asarray(r.b_pool, np.float64))
    x = np.abs(case.x.astype(np.float64))
    base = np.abs(case.base_out.astype(np.float64))
    bound = np.zeros_like(base)
    L = at.shape[0]
    for row in np.nonzero(case.fold_rows)[0]:
        xr, l, e = _row_pair(case, row)
        lc = 0 if L == 1 else l
        a, b, s = at[lc, e], bt[lc, e], abs(st_[lc, e])
        with np.errstate(invalid="ignore", over="ignore"):
            mag = B[b] @ (A[a] @ x[xr])
        bound[row] = base[row] + s * mag
    return 8 * unit * bound


def _row_pair(case: FoldCase, row: int):
    """(x row, adapter value, expert) of a folded row."""
    ra = case.row_adapter
    if case.op in ("gather", "fold"):
        top_k = case.kw["top_k"]
        ids = case.ids["indices"] if case.op == "gather" else case.ids["topk_ids"].reshape(-1)
        t = row // top_k
        return (t if case.kw["x_gather"] else row), (0 if ra is None else int(ra[t])), int(
            np.asarray(ids).astype(np.uint32).view(np.int32)[row])
    o, stid = case.ids["expert_offsets"], case.ids["sorted_token_ids"]
    e = int(np.searchsorted(o, row, side="right") - 1)
    t = int(stid[row])
    return (t if case.kw["x_gather"] else row), (0 if ra is None else int(ra[t])), e


def _check_backends(case: FoldCase, unit: float) -> None:
    ref = case.reference()
    base = case.base_out
    fold = case.fold_rows
    np.testing.assert_array_equal(bits(ref[~fold]), bits(base[~fold]),
                                  err_msg="the reference breaks the restated rule")
    bound = _error_bound(case, unit)[fold]
    want = ref[fold].astype(np.float64)
    for impl in IMPLS:
        out = case.run(impl)
        moved = np.nonzero((bits(out[~fold]) != bits(base[~fold])).any(axis=1))[0]
        assert moved.size == 0, f"{impl}: skipped rows written: {np.nonzero(~fold)[0][moved]}"
        got = out[fold].astype(np.float64)
        finite = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(got), finite,
                                      err_msg=f"{impl}: non-finite where the reference is not")
        err = np.abs(got - want)[finite]
        excess = err > bound[finite]
        assert not excess.any(), (
            f"{impl}: {int(excess.sum())} folded values off by more than the bound "
            f"(worst {float(np.max(err - bound[finite])):.3g} over)")


# ------------------------------------------------------------------- tests

@SETTINGS
@given(shape=shapes, top_k=st.integers(1, 3), num_tokens=st.integers(1, 12),
       x_gather=st.sampled_from([0, 1]), with_map=st.booleans(), bad=st.floats(0, 0.5),
       uint32=st.booleans(), p=poison)
def test_gather_backends_agree(shape, top_k, num_tokens, x_gather, with_map, bad, uint32, p):
    rng = np.random.default_rng(shape.seed)
    route = _route(shape, rng)
    n = num_tokens * top_k
    idx = _expert_ids(rng, n, route.n_experts, bad=bad,
                            dtype=np.uint32 if uint32 else np.int32)
    ra = random_row_adapter(rng, num_tokens, route.max_loras, bad=bad) if with_map else None
    x, base = _values(rng, route, num_tokens if x_gather else n, n, p)
    case = FoldCase("gather", x, base, {"indices": idx}, route, ra,
                    {"top_k": top_k, "x_gather": x_gather},
                    _gather_mask(route, idx, ra, top_k))
    _check_backends(case, _unit(shape))


@SETTINGS
@given(shape=shapes, num_tokens=st.integers(1, 16), te=st.integers(1, 40),
       extra_experts=st.integers(0, 3), kind=st.sampled_from(OFFSET_KINDS),
       x_gather=st.sampled_from([0, 1]), with_map=st.booleans(), bad=st.floats(0, 0.5),
       window=st.tuples(st.floats(0, 1), st.floats(0, 1)), p=poison)
def test_grouped_backends_agree(shape, num_tokens, te, extra_experts, kind, x_gather, with_map,
                                bad, window, p):
    rng = np.random.default_rng(shape.seed)
    route = _route(shape, rng)
    num_experts = route.n_experts + extra_experts
    offsets = _offsets(rng, kind, num_experts, te)
    stid = rng.integers(0, num_tokens, te)
    odd = rng.random(te) < bad
    stid[odd] = rng.choice([-1, num_tokens, num_tokens + 3, INT32_MIN, INT32_MAX], odd.sum())
    stid = stid.astype(np.int32)
    ra = random_row_adapter(rng, num_tokens, route.max_loras, bad=bad) if with_map else None
    x_rows = num_tokens if x_gather else te
    x, base = _values(rng, route, x_rows, te, p)
    lo, hi = sorted(int(round(w * te)) for w in window)
    if lo == hi:
        lo, hi = 0, te
    kw = {"x_gather": x_gather, "row_offset": lo, "row_end": hi}
    mask = _grouped_mask(route, offsets, stid, ra, x_rows=x_rows, x_gather=x_gather,
                         row_offset=lo, row_end=hi)
    case = FoldCase("grouped", x, base, {"expert_offsets": offsets, "sorted_token_ids": stid},
                    route, ra, kw, mask)
    _check_backends(case, _unit(shape))


@SETTINGS
@given(shape=shapes, top_k=st.integers(1, 3), num_tokens=st.integers(1, 12),
       x_gather=st.sampled_from([0, 1]), with_map=st.booleans(), bad=st.floats(0, 0.5),
       sort_path=st.booleans(), p=poison)
def test_fold_paths_agree(shape, top_k, num_tokens, x_gather, with_map, bad, sort_path, p):
    """``moe_lora_fold`` by the gather fold or by sort-then-grouped."""
    rng = np.random.default_rng(shape.seed)
    route = _route(shape, rng)
    n = num_tokens * top_k
    idx = _expert_ids(rng, n, route.n_experts, bad=bad)
    ra = random_row_adapter(rng, num_tokens, route.max_loras, bad=bad) if with_map else None
    x, base = _values(rng, route, num_tokens if x_gather else n, n, p)
    kw = {"top_k": top_k, "x_gather": x_gather, "gather_max_rows": 0 if sort_path else n}
    case = FoldCase("fold", x, base, {"topk_ids": idx.reshape(num_tokens, top_k)}, route, ra, kw,
                    _gather_mask(route, idx, ra, top_k))
    _check_backends(case, _unit(shape))


@pytest.mark.gpu
def test_gpu_joins_the_comparison():
    assert {"simple", "fast"} <= set(IMPLS)
