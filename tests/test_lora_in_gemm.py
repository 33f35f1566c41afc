"""``expert_matmul(lora_in_gemm=...)``: the LoRA delta inside the CUTLASS GEMM's
K loop (docs/expert_matmul.md, "The LoRA inside the GEMM").

An adapted row is ``round(xs @ w[e] + round(xs A^T) @ round(scale * B^T))``,
one fp32 accumulation and one rounding; the rows the grouped fold's skip rules
leave alone keep the bits of the GEMM without LoRA. The kernel is held to:

- rows without an adapter bit-identical to the same kernel's GEMM alone;
- folded rows within the GEMM's relative error (by norm) of the float64
  ``xs @ w[e] + scale * (xs A^T) B^T``, their delta within the fold's delta
  tolerance of the float64 delta, and within that tolerance of the fold
  after the GEMM (``lora_in_gemm=False``; the roundings differ, so bits and
  ulps do not carry over);
- both kernel schedules giving the same bits.

Without a GPU only the heuristic, the validation and the other backends'
indifference to the option are checked.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moelora as ml
from _fold_cases import DELTA_RTOL, bits, make_route
from jax_moelora.ops.expert_matmul import (LORA_IN_GEMM_K_FRACTION, lora_ext_k,
                                           lora_in_gemm_default)
from test_expert_matmul import GEMM_RTOL, Case, make_case, rng  # noqa: F401  (rng: fixture)

GPU = pytest.mark.gpu
HALF = pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])


def _route(L: int, R: int, K: int = 64, N: int = 32):
    return make_route(np.random.default_rng(0), num_loras=L, n_experts=4, k_in=K, n_out=N,
                      ranks=(R,), max_rank=R)


# ------------------------------------------------------------------ anywhere

def test_default_folds_inside_when_the_extension_is_short():
    """``lora_in_gemm=None``: inside the K loop when every route adds at most
    ``K / LORA_IN_GEMM_K_FRACTION`` columns (``L * R``): Qwen3's down (K = 768)
    and gate/up (2048) with 4 adapters of rank 16 (64 columns); not 4 of rank
    64 at K = 768, nor without a route."""
    assert LORA_IN_GEMM_K_FRACTION == 8
    r16, r64 = _route(4, 16), _route(4, 64)
    assert lora_ext_k(r16) == 64 and lora_ext_k(r64) == 256
    assert lora_in_gemm_default(768, [r16]) and lora_in_gemm_default(2048, [r16, None])
    assert lora_in_gemm_default(512, [r16]) and not lora_in_gemm_default(504, [r16])
    assert not lora_in_gemm_default(768, [r64]) and lora_in_gemm_default(2048, [r64])
    assert not lora_in_gemm_default(768, [r16, r64])
    assert not lora_in_gemm_default(4096, [None, None]) and not lora_in_gemm_default(4096, [])


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_lora_in_gemm_must_be_a_bool_or_none(rng, bad):
    case = make_case(rng, num_loras=2)
    with pytest.raises(ValueError, match="lora_in_gemm"):
        ml.expert_matmul(case.x, case.ws[0], case.group_sizes, lora=case.routes[0],
                         row_adapter=case.row_adapter, sorted_token_ids=case.sorted_token_ids,
                         impl="jnp", lora_in_gemm=bad)


def test_scratch_holds_the_packed_b_and_the_marks():
    """After the GEMM's own, the scratch holds per route folded inside it the
    packed B ``[min(n_experts, E), L * R, N]`` (2-byte elements) and
    ``L * n_experts + 1`` int32 marks, each rounded up to
    ``EXPERT_MATMUL_SCRATCH_ALIGN`` (the handler's layout, one definition in
    ``moelora_constants.h``)."""
    from jax_moelora import _ext
    from jax_moelora.ops.expert_matmul_ffi import lora_in_gemm_scratch

    align = _ext.EXPERT_MATMUL_SCRATCH_ALIGN
    assert align == 256
    route = _route(4, 16)  # 4 table rows, 4 experts, rank 16
    packed = 3 * 64 * 2048 * 2  # E = 3 < n_experts: the GEMM's 3 experts
    marks = -(-(4 * 4 + 1) * 4 // align) * align
    assert lora_in_gemm_scratch([route], 3, 2048) == packed + marks
    assert lora_in_gemm_scratch([route, None, route], 3, 2048) == 2 * (packed + marks)
    assert lora_in_gemm_scratch([None], 3, 2048) == 0
    # w has 5 experts, the tables 4: only the tables' are packed
    assert lora_in_gemm_scratch([route], 5, 24) == -(-(4 * 64 * 24 * 2) // align) * align + marks


@pytest.mark.parametrize("impl", ["cpu", "jnp"])
def test_other_backends_ignore_it(rng, impl):
    """Only the CUDA kernel folds inside its K loop: the CPU and jnp backends
    give the same bits whatever ``lora_in_gemm`` says."""
    case = make_case(rng, num_loras=4, K=64, ranks=(8,), max_rank=8)
    outs = [case.run(impl, lora_in_gemm=v) for v in (None, True, False)]
    for o in outs[1:]:
        np.testing.assert_array_equal(bits(o), bits(outs[0]))


# ------------------------------------------------------------------ the kernel

def _rows(case: Case):
    """Each sorted row's expert (-1 outside the groups) and row-adapter value."""
    M, offs = case.M, case.offsets
    expert = np.full(M, -1)
    for e in range(len(offs) - 1):
        expert[offs[e]:offs[e + 1]] = e
    stids = (np.arange(M) if case.sorted_token_ids is None
             else case.sorted_token_ids.astype(np.int64))
    if case.row_adapter is None:
        return expert, np.zeros(M, np.int64)
    ra = case.row_adapter
    return expert, ra[np.clip(stids, 0, ra.shape[0] - 1)].astype(np.int64)


def exact(case: Case, w: np.ndarray, route) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``xs @ w[e] + scale * (xs A^T) B^T`` of every row (no
    intermediate rounding), and the bool mask of the rows that fold."""
    xs = case.xs().astype(np.float64)
    out = np.zeros((case.M, w.shape[2]))
    expert, adapter = _rows(case)
    for e in range(w.shape[0]):
        rows = expert == e
        out[rows] = xs[rows] @ w[e].astype(np.float64)
    folds = case.fold_rows(route) if route is not None else np.zeros(case.M, bool)
    if route is None:
        return out, folds
    L = route.a_table.shape[0]
    table_row = np.zeros_like(adapter) if L == 1 else adapter
    a_pool = np.asarray(route.a_pool, np.float64)
    b_pool = np.asarray(route.b_pool, np.float64)
    for l, e in {(int(l), int(e)) for l, e in zip(table_row[folds], expert[folds])}:
        rows = folds & (table_row == l) & (expert == e)
        a, b, s = route.a_table[l, e], route.b_table[l, e], route.scale_table[l, e]
        out[rows] += float(s) * (xs[rows] @ a_pool[a].T) @ b_pool[b].T
    return out, folds


def check_in_gemm(case: Case, fused: np.ndarray, base: np.ndarray, after: np.ndarray,
                  w: np.ndarray, route) -> None:
    """The criteria of the module docstring for one weight set's output."""
    ref, folds = exact(case, w, route)
    np.testing.assert_array_equal(bits(fused[~folds]), bits(base[~folds]))
    if route is None or not folds.any():
        return
    f64 = fused[folds].astype(np.float64)
    rel = np.linalg.norm(f64 - ref[folds]) / np.linalg.norm(ref[folds])
    assert rel <= GEMM_RTOL[fused.dtype], f"relative error {rel:.3g}"
    gemm64, _ = exact(case, w, None)
    delta_want = ref[folds] - gemm64[folds]
    delta_got = f64 - gemm64[folds]
    drel = np.linalg.norm(delta_got - delta_want) / np.linalg.norm(delta_want)
    assert drel <= DELTA_RTOL[fused.dtype], f"delta relative error {drel:.3g}"
    o, a = fused[folds].astype(np.float64), after[folds].astype(np.float64)
    arel = np.linalg.norm(o - a) / np.linalg.norm(a)
    assert arel <= DELTA_RTOL[fused.dtype], f"relative difference to the fold after {arel:.3g}"


def _planes(out, pair: bool):
    return out if pair else (out,)


@GPU
@HALF
@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
@pytest.mark.parametrize("pair", [False, True], ids=["single", "gate_up"])
@pytest.mark.parametrize("shape", [(5, 136, 200, 300, 4, 16), (6, 64, 48, 56, 1, 8),
                                   (7, 512, 264, 700, 3, 16)],
                         ids=["partial_k_tile", "one_adapter", "three_adapters"])
def test_in_gemm_matches_the_exact_product(rng, dtype, schedule, pair, shape):
    """Partial tiles in M, N and K (K = 136: the base K loop ends in a partial
    64-wide step before the extension's), 1, 3 and 4 adapters (with and
    without a row-adapter map), unadapted cells, adapter values out of range,
    the last expert past the tables, NaN in the pools' slot 0 (never read)."""
    E, K, N, M, L, R = shape
    case = make_case(rng, dtype=dtype, num_loras=L, pair=pair, E=E, K=K, N=N, M=M,
                     ranks=(R // 2, R), max_rank=R, with_map=L > 1)
    base = _planes(case.run("fast", lora=False, schedule=schedule), pair)
    fused = _planes(case.run("fast", lora_in_gemm=True, schedule=schedule), pair)
    after = _planes(case.run("fast", lora_in_gemm=False, gather_max_rows=0, schedule=schedule),
                    pair)
    for i in range(len(case.ws)):
        check_in_gemm(case, fused[i], base[i], after[i], case.ws[i], case.routes[i])


@GPU
@pytest.mark.parametrize("pair", [False, True], ids=["down", "gate_up"])
def test_in_gemm_model_shapes(pair):
    """Qwen3-30B-A3B's experts (128, K = 768 down / 2048 gate/up), 4096 rows, 4
    adapters of rank 16 (the default takes the kernel's K loop here), both
    schedules giving the same bits."""
    rng = np.random.default_rng(11)
    E, M = 128, 4096
    K, N = (2048, 768) if pair else (768, 2048)
    sizes = np.bincount(rng.integers(0, E, M - 37), minlength=E).astype(np.int32)
    case = make_case(rng, E=E, K=K, N=N, M=M, group_sizes=sizes, num_loras=4, pair=pair,
                     ranks=(16,), max_rank=16)
    assert lora_in_gemm_default(K, case.routes)
    base = _planes(case.run("fast", lora=False), pair)
    fused = _planes(case.run("fast", lora_in_gemm=None), pair)
    after = _planes(case.run("fast", lora_in_gemm=False, gather_max_rows=0), pair)
    for i in range(len(case.ws)):
        check_in_gemm(case, fused[i], base[i], after[i], case.ws[i], case.routes[i])
    other = "pingpong" if K > 1024 else "cooperative"
    for f, o in zip(fused, _planes(case.run("fast", lora_in_gemm=None, schedule=other), pair)):
        np.testing.assert_array_equal(bits(f), bits(o))


@GPU
def test_one_sided_pair_and_zero_scales(rng):
    """A gate/up pair with only up adapted: gate keeps the GEMM's bits. Scales
    of zero fold zeros: every row keeps the GEMM's bits."""
    case = make_case(rng, num_loras=4, pair=True, E=5, K=128, N=64, M=200, ranks=(16,),
                     max_rank=16)
    one_sided = dataclasses.replace(case, routes=(None, case.routes[1]))
    base = one_sided.run("fast", lora=False)
    out = one_sided.run("fast", lora_in_gemm=True)
    np.testing.assert_array_equal(bits(out[0]), bits(base[0]))
    zero = case.routes[1].replace(scale_table=np.zeros_like(case.routes[1].scale_table))
    out = dataclasses.replace(case, routes=(zero, zero)).run("fast", lora_in_gemm=True)
    for o, b in zip(out, base):
        np.testing.assert_array_equal(bits(o), bits(b))


@GPU
def test_glu_in_gemm(rng):
    """``glu=True`` on the folded gate and up: within the GEMM's error of the
    float64 GLU of the exact products."""
    case = make_case(rng, num_loras=2, pair=True, E=5, K=256, N=96, M=300, ranks=(16,),
                     max_rank=16)
    out = case.run("fast", glu=True, lora_in_gemm=True)
    g, _ = exact(case, case.ws[0], case.routes[0])
    u, _ = exact(case, case.ws[1], case.routes[1])
    want = g / (1.0 + np.exp(-g)) * u
    rel = np.linalg.norm(out.astype(np.float64) - want) / np.linalg.norm(want)
    assert rel <= 2 * GEMM_RTOL[out.dtype], rel


@GPU
@pytest.mark.parametrize("option, value", [(True, 1), (False, 0), (None, 1)])
def test_option_reaches_the_custom_call(option, value):
    """The resolved option is the custom call's ``lora_in_gemm`` attribute."""
    route = jax.tree.map(jnp.asarray, _route(4, 16, K=768, N=64))
    x, w = jnp.zeros((64, 768), jnp.bfloat16), jnp.zeros((4, 768, 64), jnp.bfloat16)
    gs = jnp.asarray([16, 16, 16, 16], jnp.int32)
    hlo = jax.jit(lambda x, w, gs, r: ml.expert_matmul(
        x, w, gs, lora=r, impl="fast", gather_max_rows=0, lora_in_gemm=option)
    ).lower(x, w, gs, route).as_text()
    assert re.findall(r"lora_in_gemm = (\d+)", hlo) == [str(value)]


@GPU
@pytest.mark.parametrize("lora_in_gemm", [True, False], ids=["in_gemm", "after"])
@pytest.mark.parametrize("with_map", [True, False], ids=["map", "no_map"])
def test_token_rows_give_the_bits_of_the_sorted_rows(rng, lora_in_gemm, with_map):
    """With ``x_gather=1`` the custom call's shrinks read each row from its
    token, ``x[sorted_token_ids[r]]`` (the ``top_k`` rows of a token share one
    row of ``x``): the same bits as the rows gathered beforehand and passed
    with ``x_gather=0``, tokens out of range included."""
    case = make_case(rng, num_loras=4, pair=True, x_gather=1, E=6, K=136, N=200, M=300,
                     ranks=(8, 16), max_rank=16, with_map=with_map)
    ra = case.row_adapter
    if ra is None:  # what expert_matmul reads for x_gather=1 without a map
        ra = np.zeros((case.x.shape[0],), np.int32)
    gathered = dataclasses.replace(case, x=case.xs(), x_gather=0, row_adapter=ra)
    for got, want in zip(case.run("fast", lora_in_gemm=lora_in_gemm, gather_max_rows=0),
                         gathered.run("fast", lora_in_gemm=lora_in_gemm, gather_max_rows=0)):
        np.testing.assert_array_equal(bits(got), bits(want))


@GPU
@pytest.mark.parametrize("x_gather", [0, 1])
def test_token_rows_reach_the_custom_call(x_gather):
    """``x_gather=1`` with LoRA passes the tokens to the custom call
    (``lora_x_gather = 1``); ``x_gather=0`` reads the rows themselves."""
    route = jax.tree.map(jnp.asarray, _route(4, 16, K=768, N=64))
    T = 32 if x_gather else 64
    x, w = jnp.zeros((T, 768), jnp.bfloat16), jnp.zeros((4, 768, 64), jnp.bfloat16)
    gs = jnp.asarray([16, 16, 16, 16], jnp.int32)
    stids = jnp.arange(64, dtype=jnp.int32) % T
    hlo = jax.jit(lambda x, w, gs, r: ml.expert_matmul(
        x, w, gs, lora=r, sorted_token_ids=stids, x_gather=x_gather, impl="fast",
        gather_max_rows=0)).lower(x, w, gs, route).as_text()
    assert re.findall(r"lora_x_gather = (\d+)", hlo) == [str(x_gather)]


@GPU
def test_block_prefill_folds_in_the_gemm():
    """``MoEBlock``'s prefill on the GPU (sorted rows, the CUTLASS GEMM) folds
    gate/up and down inside the GEMMs' custom calls (``lora_in_gemm = 1``
    twice in the program) and agrees with the block folding after the GEMMs
    (``impl="simple"``) within bf16 error."""
    from flax import nnx

    from jax_moelora.nnx import MoEBlock

    block = MoEBlock(512, 256, 8, 2, max_loras=2, max_rank=16, dtype=jnp.bfloat16,
                     gather_max_rows=0, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    for slot in range(2):  # two adapters on every projection, one expert unadapted
        for name in ("router", "gate", "up", "down"):
            proj = block.lora.projection(name)
            e, k, n = proj.n_experts, proj.k_in, proj.n_out
            present = np.arange(e) != slot
            proj.write_slot(slot, rng.normal(0, k**-0.5, (e, 16, k)),
                            rng.normal(0, 0.05, (e, n, 16)), rng.uniform(0.5, 1.5, e), present)
    x = jnp.asarray(rng.normal(size=(96, 512)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(-1, 2, 96), jnp.int32)
    fused = jax.jit(lambda x, i: block(x, i))
    hlo = fused.lower(x, ids).as_text()
    assert re.findall(r"lora_in_gemm = (\d+)", hlo) == ["1", "1"]
    got = np.asarray(fused(x, ids), np.float64)
    want = np.asarray(jax.jit(lambda x, i: block(x, i, impl="simple"))(x, ids), np.float64)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel <= 2e-2, rel


@GPU
def test_gate_and_up_of_different_ranks(rng):
    """Gate and up routes of different ranks (and table shapes) take a shrink
    each instead of one shared pass: the same criteria per weight set."""
    case = make_case(rng, num_loras=2, pair=True, E=5, K=256, N=96, M=300, ranks=(8, 16),
                     max_rank=16)
    up = make_route(rng, dtype=jnp.bfloat16, num_loras=3, n_experts=4, k_in=256, n_out=96,
                    ranks=(8,), max_rank=8)
    ra = np.where(case.row_adapter >= 0, case.row_adapter % 2, case.row_adapter).astype(np.int32)
    case = dataclasses.replace(case, routes=(case.routes[0], up), row_adapter=ra)
    base = case.run("fast", lora=False)
    fused = case.run("fast", lora_in_gemm=True)
    after = case.run("fast", lora_in_gemm=False, gather_max_rows=0)
    for i in range(2):
        check_in_gemm(case, fused[i], base[i], after[i], case.ws[i], case.routes[i])


@GPU
@HALF
@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("pair", [False, True], ids=["single", "up_of_gate_up"])
def test_a_pair_whose_packed_b_is_not_finite_keeps_it_to_itself(rng, dtype, poison, pair):
    """Every row of an expert runs the extension's K steps over all of its
    packed B, so a NaN or inf in one pair's B slot (or a scale taking
    ``scale * B`` past the dtype's range) would reach the expert's other rows
    as ``0 * inf``. The pack marks that pair instead: the other pairs' rows
    keep the bits they have with a finite slot, the rows that fold nothing
    keep the GEMM's, and the marked pair's rows are folded after the GEMM:
    NaN and inf where the fold after the GEMM has them, the rest within the
    delta tolerance of it. In a gate/up pair the slot is up's (the second
    weight set of the one pack launch): gate keeps its bits."""
    case = make_case(rng, dtype=dtype, num_loras=3, pair=pair, E=5, K=128, N=96, M=400,
                     ranks=(16,), max_rank=16)
    route = case.routes[-1]
    expert, adapter = _rows(case)
    folds = case.fold_rows(route)
    table_row = adapter if route.a_table.shape[0] > 1 else np.zeros_like(adapter)
    slots = np.zeros(case.M, np.int64)
    slots[folds] = np.asarray(route.b_table)[table_row[folds], expert[folds]]
    slot = int(slots[np.flatnonzero(folds)[0]])
    marked = folds & (slots == slot)
    assert marked.any() and (folds & ~marked).any()
    b_pool = np.array(route.b_pool)
    b_pool[slot, 3, 5] = poison
    bad = dataclasses.replace(case, routes=case.routes[:-1] + (route.replace(b_pool=b_pool),))
    clean = _planes(case.run("fast", lora_in_gemm=True), pair)
    base = _planes(case.run("fast", lora=False), pair)
    got = _planes(bad.run("fast", lora_in_gemm=True), pair)
    after = _planes(bad.run("fast", lora_in_gemm=False, gather_max_rows=0), pair)
    if pair:
        np.testing.assert_array_equal(bits(got[0]), bits(clean[0]))
    clean, base, got, after = clean[-1], base[-1], got[-1], after[-1]
    np.testing.assert_array_equal(bits(got[~marked]), bits(clean[~marked]))
    np.testing.assert_array_equal(bits(got[~folds]), bits(base[~folds]))
    g, a = got[marked].astype(np.float64), after[marked].astype(np.float64)
    assert not np.isfinite(a).all()
    for kind in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(kind(g), kind(a))
    fin = np.isfinite(a)
    rel = np.linalg.norm(g[fin] - a[fin]) / np.linalg.norm(a[fin])
    assert rel <= DELTA_RTOL[got.dtype], rel


@GPU
@pytest.mark.parametrize("forward", ["in_gemm", "gather"])
@pytest.mark.parametrize("poison", [None, np.inf], ids=["finite", "inf"])
def test_the_backward_reads_the_kept_xa(rng, poison, forward):
    """The training forward keeps its kernels' ``xa`` for the backward (the
    kernel folding inside the GEMM, marked pairs' rows included: their
    ``xa`` is written after the GEMM; or the gather fold): the pools' and
    scales' cotangents equal those of the grouped fold after the GEMM (whose
    backward makes ``xa`` again) within bf16 error, with non-finite values in
    the same places. With an inf in a pair's ``B``, that slot's ``dB = scale
    * g^T xa`` stays finite and nonzero."""
    case = make_case(rng, num_loras=3, E=5, K=128, N=96, M=400, ranks=(16,), max_rank=16,
                     poison=False)
    route = case.routes[0]
    expert, adapter = _rows(case)
    first = np.flatnonzero(case.fold_rows(route))[0]
    slot = int(np.asarray(route.b_table)[adapter[first], expert[first]])
    if poison is not None:
        b_pool = np.array(route.b_pool)
        b_pool[slot, 3, 5] = poison
        route = route.replace(b_pool=b_pool)
    route = jax.tree.map(jnp.asarray, route)
    x, w, gsz, ra = (jnp.asarray(v) for v in (case.x, case.ws[0], case.group_sizes,
                                              case.row_adapter))
    cot = jnp.asarray(rng.normal(size=(case.M, case.ws[0].shape[2])), jnp.float32)

    def grads(fold):
        def loss(p):
            r = route.replace(a_pool=p[0], b_pool=p[1], scale_table=p[2])
            out = ml.expert_matmul(x, w, gsz, lora=r, row_adapter=ra, impl="fast",
                                   gather_max_rows=case.M if fold == "gather" else 0,
                                   lora_in_gemm=fold == "in_gemm")
            return jnp.sum(out.astype(jnp.float32) * cot)
        return jax.jit(jax.grad(loss))((route.a_pool, route.b_pool, route.scale_table))

    got, want = grads(forward), grads("after")
    for name, g, w_ in zip(("d_a_pool", "d_b_pool", "d_scale"), got, want):
        g, w_ = np.asarray(g, np.float64), np.asarray(w_, np.float64)
        np.testing.assert_array_equal(np.isfinite(g), np.isfinite(w_), err_msg=name)
        fin = np.isfinite(w_)
        assert np.abs(w_[fin]).max() > 0, name
        rel = np.linalg.norm(g[fin] - w_[fin]) / np.linalg.norm(w_[fin])
        assert rel <= 2e-2, f"{name}: {rel:.3g}"
    if poison is not None:
        d_b = np.asarray(got[1], np.float64)[slot]
        assert np.isfinite(d_b).all() and np.abs(d_b).max() > 0


# ------------------------------------------------------------------ packs made once

def _packed_reference(route) -> tuple[np.ndarray, np.ndarray]:
    """numpy ``(b_ext, marks)`` of the module docstring of ``ops/lora_pack.py``."""
    L, E = np.asarray(route.a_table).shape
    R, N = route.max_rank, route.n_out
    dt = np.dtype(route.dtype)
    b_pool = np.asarray(route.b_pool)
    a_t, b_t = np.asarray(route.a_table), np.asarray(route.b_table)
    scales = np.asarray(route.scale_table, np.float32)
    P = b_pool.shape[0]
    b_ext = np.zeros((E, L * R, N), dt)
    marks = np.zeros(L * E + 1, np.int32)
    for l in range(L):
        for e in range(E):
            a, b = a_t[l, e], b_t[l, e]
            if not (0 < a < P and 0 < b < P):
                continue
            blk = (np.float32(scales[l, e]) * b_pool[b].astype(np.float32)).astype(dt).T
            finite = np.isfinite(blk.astype(np.float32))
            if not finite.all():
                marks[l * E + e] = marks[-1] = 1
            b_ext[e, l * R:(l + 1) * R] = np.where(finite, blk, 0)
    return b_ext, marks


@HALF
def test_pack_holds_each_pairs_scaled_b(dtype):
    """Expert ``e``'s rows ``l * R + r`` hold ``round(scale * B[:, r])`` of pair
    ``(l, e)`` (fp32 product, one rounding), zeros for the pairs the skip
    rules reject (unadapted cells); no marks when every value is finite."""
    route = make_route(np.random.default_rng(1), dtype=dtype, num_loras=3, n_experts=5, k_in=64,
                       n_out=40, ranks=(8, 16), max_rank=16)
    pack = ml.pack_lora_in_gemm(route)
    want_b, want_m = _packed_reference(route)
    assert pack.b_ext.shape == (5, 48, 40) and pack.b_ext.dtype == dtype
    np.testing.assert_array_equal(bits(np.asarray(pack.b_ext)), bits(want_b))
    np.testing.assert_array_equal(np.asarray(pack.marks), want_m)
    assert not want_m.any()
    l, e = np.argwhere(np.asarray(route.b_table) == 0)[0]  # a cell no pair adapts
    assert not np.asarray(pack.b_ext)[e, l * 16:(l + 1) * 16].any()


def _poison_first_pair(route, poison: str):
    """``(route, l, e, slot)``: ``route`` with its first adapted pair ``(l, e)``
    (B slot ``slot``) made not finite when packed: ``"nan"`` or ``"inf"`` in
    the slot, or ``"overflow"``: a scale taking ``scale * B`` past f16's range."""
    l, e = np.argwhere(np.asarray(route.b_table) > 0)[0]
    slot = int(np.asarray(route.b_table)[l, e])
    if poison == "overflow":
        scales = np.array(route.scale_table)
        scales[l, e] = 1e9
        return route.replace(scale_table=scales), l, e, slot
    b_pool = np.array(route.b_pool)
    b_pool[slot, 2, 1] = np.nan if poison == "nan" else np.inf
    return route.replace(b_pool=b_pool), l, e, slot


@pytest.mark.parametrize("poison", ["nan", "inf", "overflow"])
def test_pack_marks_a_pair_that_is_not_finite(poison):
    """A NaN or inf in a pair's B slot, or a scale taking ``scale * B`` past
    f16's range: that pair's entry and the last entry of ``marks`` are 1 and
    ``b_ext`` holds zero in place of each value that is not finite."""
    route = make_route(np.random.default_rng(2), dtype=jnp.float16, num_loras=2, n_experts=4,
                       k_in=64, n_out=24, ranks=(8,), max_rank=8)
    route, l, e, slot = _poison_first_pair(route, poison)
    pack = ml.pack_lora_in_gemm(route)
    want_b, want_m = _packed_reference(route)
    marks = np.asarray(pack.marks)
    np.testing.assert_array_equal(marks, want_m)
    assert marks[l * 4 + e] == 1 and marks[-1] == 1
    if (np.asarray(route.b_table) == slot).sum() == 1:
        assert marks.sum() == 2
    np.testing.assert_array_equal(bits(np.asarray(pack.b_ext)), bits(want_b))
    assert np.isfinite(np.asarray(pack.b_ext, np.float32)).all()


def test_pack_takes_half_pools_only():
    route = make_route(np.random.default_rng(0), dtype=jnp.float32, num_loras=2, n_experts=4,
                       k_in=64, n_out=32, ranks=(8,), max_rank=8)
    with pytest.raises(TypeError, match="bf16 or f16"):
        ml.pack_lora_in_gemm(route)
    with pytest.raises(TypeError, match="MoeExpertRoute"):
        ml.pack_lora_in_gemm((route.a_pool, route.b_pool))


@pytest.mark.parametrize("impl", ["cpu", "jnp"])
@pytest.mark.parametrize("pair", [False, True], ids=["single", "gate_up"])
def test_other_backends_ignore_the_packs(rng, impl, pair):
    """Only the CUDA kernel folding inside its K loop reads the packs: the CPU
    and jnp backends give the same bits with and without them."""
    case = make_case(rng, num_loras=4, pair=pair, K=64, ranks=(8,), max_rank=8)
    for a, b in zip(_planes(case.run(impl, packs=True), pair), _planes(case.run(impl), pair)):
        np.testing.assert_array_equal(bits(a), bits(b))


def _pack_call(case: Case, lora_packs):
    lora = case.routes if len(case.ws) == 2 else case.routes[0]
    w = case.ws if len(case.ws) == 2 else case.ws[0]
    return ml.expert_matmul(case.x, w, case.group_sizes, lora=lora,
                            row_adapter=case.row_adapter, sorted_token_ids=case.sorted_token_ids,
                            impl="jnp", lora_packs=lora_packs)


def test_packs_are_checked_against_their_routes(rng):
    """Packs of another shape or dtype, a single pack for a pair (or the
    reverse), a pack for a weight set without a route and packs without
    ``lora`` are refused, naming ``lora_packs``."""
    case = make_case(rng, num_loras=2, K=64, ranks=(8,), max_rank=8)
    good = ml.pack_lora_in_gemm(case.routes[0])
    with pytest.raises(ValueError, match=r"lora_packs\.b_ext is bfloat16 \[6, 16, 40\]"):
        _pack_call(case, good._replace(b_ext=jnp.zeros((6, 16, 40), jnp.bfloat16)))
    with pytest.raises(ValueError, match=r"lora_packs\.marks is int32"):
        _pack_call(case, good._replace(marks=good.marks[:-1]))
    with pytest.raises(TypeError, match="LoraInGemmPack"):
        _pack_call(case, tuple(good))
    with pytest.raises(TypeError, match=r"lora_packs\.b_ext must be an array"):
        _pack_call(case, good._replace(b_ext=None))
    pair = make_case(rng, num_loras=2, pair=True, K=64, ranks=(8,), max_rank=8)
    gate = ml.pack_lora_in_gemm(pair.routes[0])
    with pytest.raises(TypeError, match="pair"):
        _pack_call(pair, gate)
    with pytest.raises(ValueError, match="without a route"):
        _pack_call(dataclasses.replace(pair, routes=(pair.routes[0], None)), (gate, gate))
    with pytest.raises(ValueError, match="without lora"):
        ml.expert_matmul(case.x, case.ws[0], case.group_sizes, impl="jnp", lora_packs=good)


def test_packs_get_no_cotangent(rng):
    """Gradients with packs passed (made inside the differentiated function
    from the same route) equal those without: the pools' and scales'
    cotangents carry them."""
    case = make_case(rng, num_loras=2, K=64, ranks=(8,), max_rank=8, poison=False)
    route = jax.tree.map(jnp.asarray, case.routes[0])
    x, w, gs, ra = (jnp.asarray(v) for v in (case.x, case.ws[0], case.group_sizes,
                                             case.row_adapter))

    def loss(p, packed):
        r = route.replace(b_pool=p[1], scale_table=p[2])
        out = ml.expert_matmul(p[0], w, gs, lora=r, row_adapter=ra, impl="jnp",
                               lora_packs=ml.pack_lora_in_gemm(r) if packed else None)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    p = (x, route.b_pool, route.scale_table)
    for g, h in zip(jax.grad(loss)(p, True), jax.grad(loss)(p, False)):
        np.testing.assert_array_equal(bits(np.asarray(g)), bits(np.asarray(h)))


def _adapted_block(max_loras: int = 2):
    """A bf16 ``MoEBlock`` (H 512, I 256, 8 experts, top 2) with ``max_loras``
    adapters of rank 16 on every projection, one expert unadapted in each."""
    from flax import nnx

    from jax_moelora.nnx import MoEBlock

    block = MoEBlock(512, 256, 8, 2, max_loras=max_loras, max_rank=16, dtype=jnp.bfloat16,
                     gather_max_rows=0, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(4)
    for slot in range(max_loras):
        for name in ("router", "gate", "up", "down"):
            proj = block.lora.projection(name)
            e, k, n = proj.n_experts, proj.k_in, proj.n_out
            proj.write_slot(slot, rng.normal(0, k**-0.5, (e, 16, k)),
                            rng.normal(0, 0.05, (e, n, 16)), rng.uniform(0.5, 1.5, e),
                            np.arange(e) != slot)
    x = jnp.asarray(rng.normal(size=(96, 512)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(-1, max_loras, 96), jnp.int32)
    return block, x, ids


def test_block_and_stack_take_packs():
    """``MoEBlock(..., lora_packs=block.lora.in_gemm_packs())`` gives the
    block's bits on every platform (here the CPU, which reads no pack);
    ``MoEStack`` wants one entry a layer."""
    from flax import nnx

    from jax_moelora.nnx import MoEStack

    block, x, ids = _adapted_block()
    packs = block.lora.in_gemm_packs()
    assert packs.gate.b_ext.shape == (8, 32, 256) and packs.down.b_ext.shape == (8, 32, 512)
    got = jax.jit(lambda x, i, p: block(x, i, lora_packs=p))(x, ids, packs)
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(block(x, ids))))
    stack = MoEStack(64, 32, 4, 2, 2, max_loras=2, max_rank=8, dtype=jnp.bfloat16,
                     rngs=nnx.Rngs(1))
    h = jnp.ones((8, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="lora_packs has 1 entries, the stack 2 layers"):
        stack(h, jnp.zeros((8,), jnp.int32), lora_packs=stack.in_gemm_packs()[:1])
    assert stack(h, jnp.zeros((8,), jnp.int32), lora_packs=stack.in_gemm_packs()).shape == (8, 64)


def test_a_sharded_block_refuses_packs():
    """A block on a mesh (here of one device) names ``lora_packs`` as what it
    does not take."""
    from flax import nnx
    from jax.sharding import Mesh

    from jax_moelora.nnx import MoEBlock

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    block = MoEBlock(64, 32, 4, 2, max_loras=2, max_rank=8, dtype=jnp.bfloat16, mesh=mesh,
                     data_axis="data", rngs=nnx.Rngs(0))
    x, ids = jnp.ones((8, 64), jnp.bfloat16), jnp.zeros((8,), jnp.int32)
    with pytest.raises(ValueError, match="lora_packs is not taken by a sharded block"):
        block(x, ids, lora_packs=block.lora.in_gemm_packs())


@GPU
@HALF
@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
@pytest.mark.parametrize("pair", [False, True], ids=["single", "gate_up"])
@pytest.mark.parametrize("x_gather", [0, 1])
def test_packs_give_the_bits_of_the_kernels_own(rng, dtype, schedule, pair, x_gather):
    """The kernel reading ``pack_lora_in_gemm`` packs writes the bits it
    writes packing ``scale * B`` itself: partial tiles, 3 adapters, the last
    expert past the tables, tokens out of range."""
    case = make_case(rng, dtype=dtype, num_loras=3, pair=pair, x_gather=x_gather, E=7, K=264,
                     N=200, M=500, ranks=(8, 16), max_rank=16)
    got = case.run("fast", lora_in_gemm=True, schedule=schedule, packs=True)
    want = case.run("fast", lora_in_gemm=True, schedule=schedule)
    for a, b in zip(_planes(got, pair), _planes(want, pair)):
        np.testing.assert_array_equal(bits(a), bits(b))


@GPU
@pytest.mark.parametrize("poison", ["nan", "overflow"])
def test_packed_marks_fold_their_rows_after_the_gemm(rng, poison):
    """A pair marked in the packs (NaN in its B slot, or ``scale * B`` past
    f16's range) gets the bits the kernel's own pack and marks give it: its
    rows folded after the GEMM, the other rows untouched by it."""
    case = make_case(rng, dtype=jnp.float16, num_loras=3, pair=True, E=5, K=128, N=96, M=400,
                     ranks=(16,), max_rank=16)
    route = _poison_first_pair(case.routes[1], poison)[0]
    bad = dataclasses.replace(case, routes=(case.routes[0], route))
    assert np.asarray(ml.pack_lora_in_gemm(route).marks)[-1] == 1
    for a, b in zip(bad.run("fast", lora_in_gemm=True, packs=True),
                    bad.run("fast", lora_in_gemm=True)):
        np.testing.assert_array_equal(bits(a), bits(b))


@GPU
def test_packs_reach_the_custom_call():
    """``lora_packs`` with the fold inside the K loop sets the custom call's
    ``lora_packed``; the fold after the GEMM ignores them."""
    route = jax.tree.map(jnp.asarray, _route(4, 16, K=768, N=64))
    pack = ml.pack_lora_in_gemm(route)
    x, w = jnp.zeros((64, 768), jnp.bfloat16), jnp.zeros((4, 768, 64), jnp.bfloat16)
    gs = jnp.asarray([16, 16, 16, 16], jnp.int32)
    for option, value in ((True, "1"), (False, "0")):
        hlo = jax.jit(lambda x, w, gs, r, p: ml.expert_matmul(
            x, w, gs, lora=r, impl="fast", gather_max_rows=0, lora_in_gemm=option,
            lora_packs=p)).lower(x, w, gs, route, pack).as_text()
        assert re.findall(r"lora_packed = (\d+)", hlo) == [value]


@GPU
def test_block_with_packs_gives_the_bits_without():
    """On the GPU the block's prefill folding inside the GEMMs reads the packs
    (``lora_packed = 1`` in both custom calls) and gives the block's bits."""
    block, x, ids = _adapted_block()
    packs = jax.jit(lambda: block.lora.in_gemm_packs())()
    packed = jax.jit(lambda x, i, p: block(x, i, lora_packs=p))
    assert re.findall(r"lora_packed = (\d+)", packed.lower(x, ids, packs).as_text()) == ["1", "1"]
    np.testing.assert_array_equal(bits(np.asarray(packed(x, ids, packs))),
                                  bits(np.asarray(jax.jit(lambda x, i: block(x, i))(x, ids))))
