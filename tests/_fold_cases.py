"""Random fold cases and the docs/semantics.md §6 checks, shared by the fold tests.

A case is a random route (``L`` adapters, mixed ranks padded with zeros,
unadapted experts, spare pool slots) plus random activations and ids that
mix rows that must fold with every kind of row that must be skipped:
row-adapter values ``-1`` and ``>= L``, expert ids negative, ``>= n_experts``
or ``>= 2**31`` (uint32), unadapted cells; for the grouped fold also rows
before the first and after the last expert span, empty spans, experts
``>= E_t`` and token ids out of range.

Poison: pool slot 0 (reserved, never an adapter) is NaN, so a fold that
reads it shows; ``x`` rows that only skipped rows would read are NaN; the
``base_out`` rows that must be skipped hold ``-0.0`` and NaN entries, so any
write to them (even ``+ 0.0``) changes their bits. Pass ``poison=False`` for
gradient tests, where NaN would leak through ``where``.

Arrays are kept as NumPy; ``FoldCase.run`` converts them on the platform the
backend runs on (``impl="cpu"`` runs under ``jax.default_device(cpu)``, so
the suite also passes on a GPU machine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import subprocess
import sys
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_moelora import (MoeExpertRoute, moe_lora_fold, moe_lora_gather_bgmv,
                         moe_lora_grouped_down)
from jax_moelora.ops import resolve_impl
from jax_moelora.reference import gather_bgmv_ref, grouped_down_ref

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
DTYPE_IDS = ("bf16", "f16", "f32")
# docs/semantics.md §6: relative error of the delta out - base, by norm, for any backend.
DELTA_RTOL = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3,
              jnp.dtype(jnp.float32): 1e-5}

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


# ----------------------------------------------------------------- platform

def on_platform(impl: str):
    """Context in which ``impl`` runs: the CPU handlers need computations on
    the CPU even on a GPU machine; every other backend uses the default."""
    if impl == "cpu":
        return jax.default_device(jax.devices("cpu")[0])
    return contextlib.nullcontext()


def concrete_impl(impl: str) -> str:
    with on_platform(impl):
        return resolve_impl(impl)


def is_ulp_strict(impl: str) -> bool:
    """Backends held to the ulp criterion of docs/semantics.md §6 (simple kernels, CPU handlers)."""
    return concrete_impl(impl) in ("cpu", "simple")


def to_device(tree: Any) -> Any:
    """NumPy leaves -> arrays on the current default device (None stays None)."""
    return jax.tree.map(jnp.asarray, tree)


# -------------------------------------------------------------------- route

def make_route(rng: np.random.Generator, *, dtype=jnp.bfloat16, num_loras: int = 1,
               n_experts: int = 6, k_in: int = 64, n_out: int = 40,
               ranks: tuple[int, ...] = (8, 16), max_rank: int = 24, unadapted: float = 0.3,
               spare_slots: int = 2, pool_size: int | None = None, out_of_pool: int = 0,
               poison: bool = True) -> MoeExpertRoute:
    """A random ``MoeExpertRoute`` with NumPy leaves.

    Cells ``(l, e)`` are adapted with probability ``1 - unadapted``; every
    adapted cell gets its own A slot and its own B slot (two independent
    permutations, so a mix-up of the tables shows). An unadapted cell has
    its a cell, its b cell, or both 0 (the other a valid slot). Each pool
    slot has a rank drawn from ``ranks``, zero-padded to ``max_rank``.
    ``pool_size`` fixes ``P`` (routes of one shape, e.g. to stack layers);
    else ``P`` is the number of adapted cells + 1 + ``spare_slots``.
    ``out_of_pool`` adapted cells point past the pool (skipped).
    Scales are in ``±[0.5, 1.5]`` everywhere, unadapted cells included.
    With ``0 < unadapted < 1`` each table row has at least two adapted and
    one unadapted cell.
    """
    dt = jnp.dtype(dtype)
    L, E, K, N, R = num_loras, n_experts, k_in, n_out, max_rank
    assert max(ranks) <= R
    adapted = rng.random((L, E)) >= unadapted
    if 0 < unadapted < 1:  # every table row: >= 2 adapted cells, >= 1 unadapted
        for row in adapted:
            while row.sum() < min(2, E):
                row[rng.integers(E)] = True
            if row.all() and E >= 3:
                row[rng.integers(E)] = False
    n = int(adapted.sum())
    P = n + 1 + spare_slots if pool_size is None else pool_size
    assert P >= n + 1, (P, n)
    a_table = np.zeros((L, E), np.int32)
    b_table = np.zeros((L, E), np.int32)
    a_table[adapted] = rng.permutation(np.arange(1, P))[:n]
    b_table[adapted] = rng.permutation(np.arange(1, P))[:n]
    for l, e in zip(*np.nonzero(~adapted)):
        which = rng.integers(3)  # 0: only a is 0, 1: only b is 0, 2: both
        if which == 0:
            b_table[l, e] = rng.integers(1, P)
        elif which == 1:
            a_table[l, e] = rng.integers(1, P)
    if out_of_pool:
        cells = np.argwhere(adapted)[rng.permutation(n)[:out_of_pool]]
        for i, (l, e) in enumerate(cells):
            (a_table if i % 2 == 0 else b_table)[l, e] = P + i
    scale = (rng.uniform(0.5, 1.5, (L, E)) * rng.choice([-1.0, 1.0], (L, E))).astype(np.float32)
    slot_rank = rng.choice(ranks, P)
    a_pool = rng.normal(0.0, K**-0.5, (P, R, K))
    b_pool = np.empty((P, N, R))
    for s, r in enumerate(slot_rank):
        a_pool[s, r:, :] = 0.0
        b_pool[s] = 0.0
        b_pool[s, :, :r] = rng.normal(0.0, r**-0.5, (N, r))
    if poison:
        a_pool[0] = np.nan
        b_pool[0] = np.nan
    return MoeExpertRoute(a_pool=a_pool.astype(dt), b_pool=b_pool.astype(dt), a_table=a_table,
                          b_table=b_table, scale_table=scale)


def route_folds(route: MoeExpertRoute, adapter, expert) -> np.ndarray:
    """docs/semantics.md §5 skip rule, restated independently of the library: True where a
    row with this row-adapter value and expert id folds."""
    at, bt = np.asarray(route.a_table), np.asarray(route.b_table)
    L, E = at.shape
    P = route.pool_size
    adapter = np.asarray(adapter, np.int64)
    expert = np.asarray(expert, np.int64)
    l = np.zeros_like(adapter) if L == 1 else adapter
    ok = (adapter >= 0) & (l < L) & (expert >= 0) & (expert < E)
    lc, ec = np.clip(l, 0, L - 1), np.clip(expert, 0, E - 1)
    a, b = at[lc, ec], bt[lc, ec]
    return ok & (a > 0) & (b > 0) & (a < P) & (b < P)


def stack_routes(routes: list[MoeExpertRoute]) -> MoeExpertRoute:
    """Routes of identical shapes stacked on a leading layer axis (for scan)."""
    return jax.tree.map(lambda *v: np.stack(v), *routes)


def random_row_adapter(rng, num_tokens: int, num_loras: int, bad: float = 0.3) -> np.ndarray:
    """Per-token adapter values: mostly in ``[0, L)``, a fraction ``bad`` of
    ``-1``, other negatives and values ``>= L`` (which fold with row 0 when
    ``L == 1``)."""
    ra = rng.integers(0, num_loras, num_tokens)
    odd = rng.random(num_tokens) < bad
    ra[odd] = rng.choice([-1, -7, INT32_MIN, num_loras, num_loras + 2, INT32_MAX], odd.sum())
    return ra.astype(np.int32)


def random_expert_ids(rng, n: int, n_experts: int, bad: float = 0.2,
                      dtype=np.int32) -> np.ndarray:
    """Expert ids: mostly in ``[0, n_experts)`` (at least two distinct ones),
    a fraction ``bad`` negative or ``>= n_experts``. For uint32, the bad ids
    include values ``>= 2**31`` (negative when read as int32)."""
    ids = rng.integers(0, n_experts, n).astype(np.int64)
    ids[:2] = [0, n_experts - 1] if n_experts > 1 else [0, 0]
    ids = rng.permutation(ids)
    odd = rng.random(n) < bad
    if np.dtype(dtype) == np.uint32:
        pool = [n_experts, n_experts + 5, 2**31, 2**31 + 3, 2**32 - 1]
    else:
        pool = [-1, -n_experts - 1, INT32_MIN, n_experts, n_experts + 5, INT32_MAX]
    ids[odd] = rng.choice(pool, odd.sum())
    return ids.astype(dtype)


def _row_adapter(rng, row_adapter, num_tokens: int, num_loras: int):
    if row_adapter is True:
        return random_row_adapter(rng, num_tokens, num_loras)
    if row_adapter is False or row_adapter is None:
        return None
    return np.asarray(row_adapter, np.int32)


def _finish(rng, case: "FoldCase", x_rows_read: np.ndarray, poison: bool) -> "FoldCase":
    """Draw ``base_out`` of the folded rows with the sign of the reference
    delta and magnitudes in ``[0.5, 1.5]``, then poison.

    Same signs keep ``|out| >= |scale * delta|``: the ulp criterion of docs/semantics.md §6
    then measures the fold, not cancellation (a 1-ulp difference of
    ``delta``, which fp32 summation order may cause, would be many ulp of a
    near-zero ``out``).
    """
    dt = case.dtype
    sign = np.sign(case.reference(base_out=np.zeros_like(case.base_out)).astype(np.float64))
    sign = np.where(sign == 0, rng.choice([-1.0, 1.0], sign.shape), sign)
    base = case.base_out.astype(np.float64)
    fold = case.fold_rows
    base[fold] = sign[fold] * rng.uniform(0.5, 1.5, (int(fold.sum()), base.shape[1]))
    x = case.x.astype(np.float64)
    if poison:
        _poison(rng, base, x, fold, x_rows_read)
    return dataclasses.replace(case, base_out=base.astype(dt), x=x.astype(dt))


def _poison(rng, base_out: np.ndarray, x: np.ndarray, fold_rows: np.ndarray,
            x_rows_read: np.ndarray) -> None:
    """-0.0 and NaN in base_out rows that must not change; NaN in x rows no
    folded row reads."""
    skip = np.nonzero(~fold_rows)[0]
    for r in skip:
        cols = rng.choice(base_out.shape[1], 2, replace=False)
        base_out[r, cols[0]] = -0.0
        base_out[r, cols[1]] = np.nan
    unread = np.ones(x.shape[0], bool)
    unread[x_rows_read] = False
    x[unread] = np.nan


# --------------------------------------------------------------------- case

@dataclasses.dataclass
class FoldCase:
    """One call of a fold: NumPy operands, static keywords, the rows that
    must fold (by the rule of docs/semantics.md §5) and the reference."""

    op: str                       # "gather", "grouped" or "fold" (moe_lora_fold)
    x: np.ndarray
    base_out: np.ndarray
    ids: dict[str, np.ndarray]    # indices | expert_offsets, sorted_token_ids | topk_ids
    route: MoeExpertRoute
    row_adapter: np.ndarray | None
    kw: dict[str, Any]            # top_k / row_offset, row_end / x_gather
    fold_rows: np.ndarray         # bool [rows]

    @property
    def dtype(self) -> np.dtype:
        return jnp.dtype(self.base_out.dtype)

    def operands(self, **over) -> tuple:
        """(x, base_out, *ids, route, row_adapter) as NumPy, with overrides."""
        v = {"x": self.x, "base_out": self.base_out, "route": self.route,
             "row_adapter": self.row_adapter, **self.ids}
        v.update({k: o for k, o in over.items() if k in v})
        names = {"gather": ("indices",), "grouped": ("expert_offsets", "sorted_token_ids"),
                 "fold": ("topk_ids",)}[self.op]
        return (v["x"], v["base_out"], *(v[n] for n in names), v["route"], v["row_adapter"])

    def keywords(self, **over) -> dict[str, Any]:
        kw = dict(self.kw)
        kw.update({k: o for k, o in over.items() if k in ("top_k", "x_gather", "row_offset",
                                                          "row_end", "gather_max_rows")})
        if self.op == "fold":
            kw.pop("top_k", None)
        return kw

    def fn(self, impl: str, **over):
        """The public fold as a function of the operands (for jit)."""
        return _fold_fn(self.op, impl, tuple(sorted(self.keywords(**over).items())))

    def run(self, impl: str, *, jit: bool = True, **over) -> np.ndarray:
        """Run the fold with backend ``impl`` on its platform (jitted unless
        ``jit=False``); NumPy result."""
        with on_platform(impl):
            args = to_device(self.operands(**over))
            fn = self.fn(impl, **over)
            out = (_jitted(fn) if jit else fn)(*args)
            return np.asarray(out)

    def reference(self, **over) -> np.ndarray:
        x, base, *ids, route, ra = self.operands(**over)
        kw = self.keywords(**over)
        if self.op == "grouped":
            return grouped_down_ref(x, base, ids[0], ids[1], route, ra, **kw)
        if self.op == "fold":
            topk = ids[0]
            return gather_bgmv_ref(x, base, topk.reshape(-1), route, ra, top_k=topk.shape[1],
                                   x_gather=kw["x_gather"])
        return gather_bgmv_ref(x, base, ids[0], route, ra, **kw)


@functools.cache
def _fold_fn(op: str, impl: str, kw: tuple):
    fold = {"gather": moe_lora_gather_bgmv, "grouped": moe_lora_grouped_down,
            "fold": moe_lora_fold}[op]
    return lambda *args: fold(*args, impl=impl, **dict(kw))


@functools.cache
def _jitted(fn):
    return jax.jit(fn)


def _some_row_folds(builder):
    """Redraw a random case (up to 20 times) until at least one row folds, so
    that every test built on it can fail."""
    import functools

    @functools.wraps(builder)
    def build(rng, **kw):
        for _ in range(20):
            case = builder(rng, **kw)
            if case.fold_rows.any():
                break
        return case

    return build


@_some_row_folds
def make_gather_case(rng, *, dtype=jnp.bfloat16, num_loras: int = 1, top_k: int = 4,
                     num_tokens: int = 24, x_gather: int = 0,
                     row_adapter: bool | np.ndarray = True,
                     index_dtype=np.int32, indices: np.ndarray | None = None,
                     route: MoeExpertRoute | None = None, op: str = "gather",
                     poison: bool = True, **route_kw) -> FoldCase:
    """A ``moe_lora_gather_bgmv`` case (``op="fold"``: the same rows as a
    ``moe_lora_fold`` case, ids shaped ``[T, top_k]``). ``row_adapter``:
    True for a random map, False for none, or the map itself; ``indices``
    likewise overrides the random expert ids."""
    if route is None:
        route = make_route(rng, dtype=dtype, num_loras=num_loras, poison=poison, **route_kw)
    dt = route.dtype
    n_slots = num_tokens * top_k
    K, N = route.k_in, route.n_out
    if indices is None:
        indices = random_expert_ids(rng, n_slots, route.n_experts, dtype=index_dtype)
    ra = _row_adapter(rng, row_adapter, num_tokens, route.max_loras)
    tok = np.arange(n_slots) // top_k
    adapter = np.zeros(n_slots, np.int64) if ra is None else ra[tok]
    expert = np.asarray(indices).astype(np.uint32).view(np.int32)  # uint32 ids read as int32
    fold_rows = route_folds(route, adapter, expert)
    x = rng.normal(size=(num_tokens if x_gather else n_slots, K))
    base = rng.normal(size=(n_slots, N))
    ids = {"indices": indices} if op == "gather" else {"topk_ids": indices.reshape(num_tokens, top_k)}
    case = FoldCase(op, x.astype(dt), base.astype(dt), ids, route, ra,
                    {"top_k": top_k, "x_gather": x_gather}, fold_rows)
    return _finish(rng, case, (tok if x_gather else np.arange(n_slots))[fold_rows], poison)


@_some_row_folds
def make_grouped_case(rng, *, dtype=jnp.bfloat16, num_loras: int = 1, num_tokens: int = 48,
                      rows_per_expert: int = 14, extra_experts: int = 3, empty_spans: int = 1,
                      lead: int = 5, tail: int = 7, x_gather: int = 0,
                      row_adapter: bool | np.ndarray = True,
                      bad_tokens: float = 0.1, route: MoeExpertRoute | None = None,
                      poison: bool = True, **route_kw) -> FoldCase:
    """A ``moe_lora_grouped_down`` case.

    ``expert_offsets`` has ``E_t + extra_experts + 1`` entries (experts
    ``>= E_t`` own rows that must skip); ``lead`` rows precede the first
    span and ``tail`` rows follow the last; ``empty_spans`` experts (the
    first one ``< E_t`` always among them) own no rows; a fraction ``bad_tokens`` of ``sorted_token_ids`` is out of
    ``[0, num_tokens)`` (those rows skip when the token is needed: with
    ``x_gather=1`` or a row-adapter map).
    """
    if route is None:
        route = make_route(rng, dtype=dtype, num_loras=num_loras, poison=poison, **route_kw)
    dt = route.dtype
    E = route.n_experts
    num_experts = E + extra_experts
    lengths = rng.integers(1, 2 * rows_per_expert, num_experts)
    # an adapted expert keeps rows; another expert < E_t (adapted when there
    # is one more) and empty_spans - 1 random others own none; with extra
    # experts, the last one keeps rows.
    adapted = np.nonzero(route_folds(route, np.zeros(E, np.int64), np.arange(E)))[0]
    keep = rng.choice(adapted) if adapted.size else 0
    others = [e for e in (adapted if adapted.size > 1 else range(E)) if e != keep]
    first = rng.choice(others) if others else None
    empty = [e for e in rng.permutation(num_experts)
             if e not in (keep, first) and not (extra_experts and e == num_experts - 1)]
    if first is not None and empty_spans > 0:
        lengths[[first, *empty[:empty_spans - 1]]] = 0
    offsets = np.concatenate([[0], np.cumsum(lengths)]) + lead
    te = int(offsets[-1]) + tail
    stid = rng.integers(0, num_tokens, te)
    odd = rng.random(te) < bad_tokens
    stid[odd] = rng.choice([-1, num_tokens, num_tokens + 3, INT32_MIN, INT32_MAX], odd.sum())
    ra = _row_adapter(rng, row_adapter, num_tokens, route.max_loras)

    rows = np.arange(te)
    owner = np.searchsorted(offsets, rows, side="right") - 1
    in_span = (owner >= 0) & (owner < num_experts)
    in_span &= rows < offsets[np.clip(owner + 1, 0, num_experts)]
    tok_ok = (stid >= 0) & (stid < num_tokens)
    needs_tok = bool(x_gather) or ra is not None
    adapter = np.zeros(te, np.int64) if ra is None else ra[np.clip(stid, 0, num_tokens - 1)]
    fold_rows = in_span & (tok_ok | (not needs_tok)) & route_folds(
        route, adapter, np.where(in_span, owner, -1))
    x = rng.normal(size=(num_tokens if x_gather else te, route.k_in))
    base = rng.normal(size=(te, route.n_out))
    ids = {"expert_offsets": offsets.astype(np.int32), "sorted_token_ids": stid.astype(np.int32)}
    case = FoldCase("grouped", x.astype(dt), base.astype(dt), ids, route, ra,
                    {"x_gather": x_gather}, fold_rows)
    return _finish(rng, case, (stid if x_gather else rows)[fold_rows], poison)


# ------------------------------------------------------------------- checks

def bits(a) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(a))
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def ulp_distance(a, b) -> np.ndarray:
    """Distance in units in the last place of two arrays of one float dtype
    (the number of representable values between them; +0 and -0 are 0 apart)."""
    ia, ib = bits(a).astype(np.int64), bits(b).astype(np.int64)
    sign = 1 << (8 * np.asarray(a).dtype.itemsize - 1)

    def ordered(i):
        return np.where(i & sign, -(i & (sign - 1)), i)

    return np.abs(ordered(ia) - ordered(ib))


def assert_ulp_close(out, want, what: str = "output") -> None:
    """docs/semantics.md §6 for the simple kernels and CPU handlers in bf16/f16: every value
    within 2 ulp, at least 99 % within 1 ulp."""
    d = ulp_distance(out, want)
    assert d.max(initial=0) <= 2, (
        f"{what}: {int((d > 2).sum())} values more than 2 ulp off (max {d.max()} ulp)")
    frac = float((d <= 1).mean()) if d.size else 1.0
    assert frac >= 0.99, f"{what}: only {frac:.4f} of values within 1 ulp (need 0.99)"


def delta_rel_error(out, ref, base) -> float:
    o, r, b = (np.asarray(v, np.float64) for v in (out, ref, base))
    want = r - b
    return float(np.linalg.norm((o - b) - want) / np.linalg.norm(want))


def check_fold(case: FoldCase, out, *, strict: bool, ref: np.ndarray | None = None,
               base: np.ndarray | None = None, fold_rows: np.ndarray | None = None) -> None:
    """Every docs/semantics.md §6 check of one fold result against the reference.

    - skipped rows are bit-identical to ``base_out`` (NaN and -0.0 included);
    - every row that must fold was written (differs from ``base_out``);
    - no NaN where the reference is finite;
    - the delta ``out - base`` is within ``DELTA_RTOL`` of the reference's;
    - ``strict`` (simple kernels, CPU handlers): bf16/f16 outputs within 2 ulp,
      >= 99 % within 1 ulp. For f32 there is no intermediate rounding, so
      the result differs from the float64 reference by the fp32 summation
      error (many f32 ulp for long sums): the norm criterion applies.
    The reference itself must skip and fold exactly the rows of the rule.
    """
    base = case.base_out if base is None else base
    fold = case.fold_rows if fold_rows is None else fold_rows
    ref = case.reference() if ref is None else ref
    out = np.asarray(out)
    assert out.shape == base.shape and out.dtype == base.dtype, (out.shape, out.dtype)
    assert fold.any(), "the case folds no row: the test could not fail"

    # the reference follows the rule (a check of the case builder too)
    np.testing.assert_array_equal(bits(ref[~fold]), bits(base[~fold]))
    assert (bits(ref[fold]) != bits(base[fold])).any(axis=1).all()

    skipped = np.nonzero((bits(out[~fold]) != bits(base[~fold])).any(axis=1))[0]
    assert skipped.size == 0, (
        f"rows that must be skipped were written: {np.nonzero(~fold)[0][skipped][:10]}")
    unwritten = np.nonzero(~(bits(out[fold]) != bits(base[fold])).any(axis=1))[0]
    assert unwritten.size == 0, (
        f"rows that must fold were not written: {np.nonzero(fold)[0][unwritten][:10]}")
    bad_nan = np.isnan(out.astype(np.float64)) & np.isfinite(ref.astype(np.float64))
    assert not bad_nan.any(), f"NaN where the reference is finite at {np.argwhere(bad_nan)[:5]}"

    err = delta_rel_error(out[fold], ref[fold], base[fold])
    tol = DELTA_RTOL[case.dtype]
    assert err <= tol, f"delta relative error {err:.3g} > {tol:g} ({case.dtype})"
    if strict and case.dtype != jnp.dtype(jnp.float32):
        assert_ulp_close(out[fold], ref[fold], "folded rows vs reference")


# ------------------------------------------------------------- CUDA graphs

def graph_program(seed: int, impl: str, n_layers: int = 4) -> np.ndarray:
    """Run one jitted program of ``n_layers`` gather and grouped folds (enough
    custom calls in a row for XLA to capture them in a CUDA graph) on cases
    drawn from ``seed``. Returns the raw bits of both results, flattened. Used in-process and in a subprocess with
    ``--xla_gpu_enable_command_buffer=`` to compare graphs on and off."""
    rng = np.random.default_rng(seed)
    common = dict(dtype=jnp.bfloat16, num_loras=2, n_experts=8, pool_size=2 * 8 + 3,
                  poison=False)
    g = make_gather_case(rng, x_gather=1, **common)
    s = make_grouped_case(rng, x_gather=0, **common)
    routes = [g.route] + [make_route(rng, **common) for _ in range(n_layers - 1)]
    gather, grouped = g.fn(impl), s.fn(impl)

    def program(routes, g_ops, s_ops):
        gx, gb, gi, _, gra = g_ops
        sx, sb, so, st, _, sra = s_ops
        for r in routes:
            gb = gather(gx, gb, gi, r, gra)
            sb = grouped(sx, sb, so, st, r, sra)
        return gb, sb

    with on_platform(impl):
        args = to_device((routes, g.operands(), s.operands()))
        gb, sb = jax.jit(program)(*args)
        return np.concatenate([bits(gb).ravel(), bits(sb).ravel()])


def run_with_graphs_off(tmp_path, module: str, call: str) -> np.ndarray:
    """``call`` (an expression of ``graph_program`` imported from the tests'
    ``module``) evaluated in a subprocess with XLA's command buffers (CUDA
    graphs) off; its array."""
    out = str(tmp_path / "off.npy")
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from {module} import graph_program
        np.save({out!r}, {call})
    """)
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    # the calling process already holds most of the GPU memory (JAX preallocates)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return np.load(out)
