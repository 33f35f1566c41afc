"""The two folds and ``moe_lora_fold`` against the float64 reference (docs/semantics.md §5, §6).

Every backend is run on the same random cases (``_fold_cases``): rows that
must fold next to every kind of row that must be skipped, poisoned so that a
stray read or write shows. ``check_fold`` holds each result to docs/semantics.md §6: skipped
rows bit-identical, every folded row written, no NaN where the reference is
finite, the delta within the dtype's relative error, and for the simple kernels
and CPU handlers the ulp criterion. Backends ``simple`` and ``fast`` (the CUDA
kernels) carry the ``gpu`` marker; ``cpu`` runs on the CPU on any machine.
"""

from __future__ import annotations

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _fold_cases import (DELTA_RTOL, DTYPE_IDS, DTYPES, assert_ulp_close, bits, check_fold,
                         concrete_impl, delta_rel_error, graph_program, is_ulp_strict,
                         make_gather_case, make_grouped_case, make_route, on_platform,
                         random_expert_ids,
                         run_with_graphs_off, stack_routes, to_device)
from conftest import HAS_GPU, assert_pure_device
from jax_moelora.ops import sort_rows_by_expert
from jax_moelora.ops.folds import plan_rows
from jax_moelora.ops.jnp_fold import grouped_rows

GPU = pytest.mark.gpu
CUDA_IMPLS = [pytest.param("simple", marks=GPU), pytest.param("fast", marks=GPU)]
IMPLS = ["cpu", "jnp", *CUDA_IMPLS]
# The backends that must agree with the CPU handlers within the ulp tolerance
# of docs/semantics.md §6.
ULP_STRICT_GPU = CUDA_IMPLS

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
x_gathers = pytest.mark.parametrize("x_gather", [0, 1], ids=["xg0", "xg1"])
loras = pytest.mark.parametrize("num_loras", [1, 4], ids=["L1", "L4"])
maps = pytest.mark.parametrize("with_map", [False, True], ids=["no_map", "map"])
impls = pytest.mark.parametrize("impl", IMPLS)


@pytest.fixture
def rng(request):
    """Fresh random inputs per test, reproducible from the test's id."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _check(case, out, impl, **kw):
    check_fold(case, out, strict=is_ulp_strict(impl), **kw)


# ------------------------------------------------------------------- gather

@maps
@loras
@x_gathers
@dtypes
@impls
def test_gather_fold_matches_reference(rng, impl, dtype, x_gather, num_loras, with_map):
    case = make_gather_case(rng, dtype=dtype, num_loras=num_loras, x_gather=x_gather,
                            row_adapter=with_map)
    _check(case, case.run(impl), impl)


@x_gathers
@impls
def test_gather_reads_uint32_indices_as_int32(rng, impl, x_gather):
    """uint32 ids >= 2**31 are negative as int32: skipped; the rest as int32."""
    case = make_gather_case(rng, num_loras=4, x_gather=x_gather, index_dtype=np.uint32)
    idx = case.ids["indices"]
    assert idx.dtype == np.uint32 and (idx >= 2**31).any() and (idx < case.route.n_experts).any()
    out = case.run(impl)
    _check(case, out, impl)
    as_int32 = case.run(impl, indices=idx.view(np.int32))
    np.testing.assert_array_equal(bits(out), bits(as_int32))


@dtypes
@impls
def test_router_one_entry_route_folds_every_mapped_row(rng, impl, dtype):
    """docs/semantics.md §3: the router pair is expert 0 of a one-entry route, k_in = hidden,
    n_out = num_experts, folded with all-zero indices, top_k=1, x_gather=0."""
    route = make_route(rng, dtype=dtype, n_experts=1, k_in=64, n_out=16, unadapted=0.0)
    T = 20
    case = make_gather_case(rng, route=route, top_k=1, num_tokens=T, x_gather=0,
                            indices=np.zeros(T, np.int32), row_adapter=True)
    np.testing.assert_array_equal(case.fold_rows, case.row_adapter >= 0)
    _check(case, case.run(impl), impl)


@impls
def test_single_adapter_route_folds_any_nonnegative_value_with_row_0(rng, impl):
    """L == 1 (single-active): every row-adapter value >= 0 selects table row 0."""
    case = make_gather_case(rng, num_loras=1, x_gather=1, row_adapter=False)
    T = case.base_out.shape[0] // case.kw["top_k"]
    big = rng.integers(0, 2**31 - 1, T).astype(np.int32)
    big[:2] = [1, 2**31 - 1]
    out = case.run(impl, row_adapter=big)
    np.testing.assert_array_equal(bits(out), bits(case.run(impl)))
    _check(case, out, impl)


@impls
def test_multi_adapter_route_skips_values_at_or_above_L(rng, impl):
    """L > 1: a row-adapter value >= L folds nothing (its rows stay bit-identical)."""
    L = 4
    case = make_gather_case(rng, num_loras=L, x_gather=1, row_adapter=False)
    assert case.fold_rows.any()  # with table row 0 these rows would fold
    T = case.base_out.shape[0] // case.kw["top_k"]
    ra = rng.integers(L, 2**31 - 1, T).astype(np.int32)
    ra[0] = L
    out = case.run(impl, row_adapter=ra)
    np.testing.assert_array_equal(bits(out), bits(case.base_out))


@impls
def test_unadapted_experts_fold_nothing(rng, impl):
    """A cell 0 in a_table or b_table (either, or both) means "not adapted",
    even when the other cell names a real slot (pool slot 0 is NaN here)."""
    route = make_route(rng, num_loras=2, n_experts=8, unadapted=1.0)
    at, bt = np.asarray(route.a_table), np.asarray(route.b_table)
    assert ((at == 0) & (bt > 0)).any() and ((at > 0) & (bt == 0)).any()
    case = make_gather_case(rng, route=route, x_gather=0)
    assert not case.fold_rows.any()
    np.testing.assert_array_equal(bits(case.run(impl)), bits(case.base_out))


@impls
def test_table_cells_outside_the_pool_fold_nothing(rng, impl):
    """A table cell naming a slot >= pool size is skipped, never read."""
    route = make_route(rng, num_loras=2, out_of_pool=3, unadapted=0.1)
    case = make_gather_case(rng, route=route, x_gather=1)
    P = route.pool_size
    cells = (np.asarray(route.a_table) >= P) | (np.asarray(route.b_table) >= P)
    assert cells.sum() == 3
    _check(case, case.run(impl), impl)


@pytest.mark.parametrize("ranks,max_rank", [((8, 16), 24), ((8, 24, 64), 64), ((16,), 16)],
                         ids=["8+16_in_24", "8+24+64_in_64", "16_in_16"])
@impls
def test_mixed_ranks_in_one_pool(rng, impl, ranks, max_rank):
    """Adapters of different ranks share one pool, zero-padded to max_rank."""
    case = make_gather_case(rng, num_loras=4, x_gather=1, ranks=ranks, max_rank=max_rank)
    _check(case, case.run(impl), impl)


# ------------------------------------------------------------------ grouped

@maps
@loras
@x_gathers
@dtypes
@impls
def test_grouped_fold_matches_reference(rng, impl, dtype, x_gather, num_loras, with_map):
    case = make_grouped_case(rng, dtype=dtype, num_loras=num_loras, x_gather=x_gather,
                             row_adapter=with_map)
    _check(case, case.run(impl), impl)


@pytest.mark.parametrize("split", [1, 37, 64, 129])
@impls
def test_grouped_windows_compose_bit_for_bit(rng, impl, split):
    """Folding (0, a) then (a, te) equals one fold of (0, te), bit for bit."""
    case = make_grouped_case(rng, num_loras=4, x_gather=1, rows_per_expert=30)
    te = case.base_out.shape[0]
    assert split < te
    full = case.run(impl)
    first = case.run(impl, row_offset=0, row_end=split)
    both = case.run(impl, base_out=first, row_offset=split, row_end=te)
    np.testing.assert_array_equal(bits(both), bits(full))
    _check(case, full, impl)


@pytest.mark.parametrize("window", [(23, 101), (64, 128), (0, 1)])
@impls
def test_grouped_window_folds_only_its_rows(rng, impl, window):
    """Rows outside [row_offset, row_end) stay bit-identical; rows inside get
    the same bits as in a fold of all rows."""
    lo, hi = window
    case = make_grouped_case(rng, num_loras=2, x_gather=0, rows_per_expert=20, lead=0)
    te = case.base_out.shape[0]
    inside = np.zeros(te, bool)
    inside[lo:hi] = True
    out = case.run(impl, row_offset=lo, row_end=hi)
    np.testing.assert_array_equal(bits(out[~inside]), bits(case.base_out[~inside]))
    np.testing.assert_array_equal(bits(out[inside]), bits(case.run(impl)[inside]))
    fold = case.fold_rows & inside
    if fold.any():
        _check(case, out, impl, fold_rows=fold, ref=case.reference(row_offset=lo, row_end=hi))


@impls
def test_grouped_rows_outside_the_route_experts_spans_skip(rng, impl):
    """expert_offsets may be longer than n_experts + 1: rows of experts >= E_t,
    rows before offsets[0] and rows at or after offsets[-1] fold nothing."""
    case = make_grouped_case(rng, num_loras=2, x_gather=1, extra_experts=4, lead=9, tail=11)
    offs = case.ids["expert_offsets"]
    E = case.route.n_experts
    te = case.base_out.shape[0]
    outside = np.zeros(te, bool)
    outside[:offs[0]] = True
    outside[offs[E]:] = True
    assert offs[0] > 0 and offs[-1] < te and offs[-1] > offs[E]
    out = case.run(impl)
    np.testing.assert_array_equal(bits(out[outside]), bits(case.base_out[outside]))
    _check(case, out, impl)


@impls
def test_grouped_empty_expert_spans(rng, impl):
    """Experts with empty spans (the first included) own no rows; the rows of
    the others are found across them."""
    case = make_grouped_case(rng, num_loras=2, x_gather=1, n_experts=10, extra_experts=2,
                             empty_spans=6, lead=0)
    offs = case.ids["expert_offsets"]
    assert (np.diff(offs) == 0).sum() >= 4
    _check(case, case.run(impl), impl)


@maps
@x_gathers
@impls
def test_grouped_token_ids_out_of_range_skip_only_where_read(rng, impl, x_gather, with_map):
    """A sorted_token_ids entry outside [0, num_tokens) skips its row when the
    token is read (x_gather=1 or a row-adapter map); otherwise the row folds."""
    T = 48
    case = make_grouped_case(rng, num_loras=2, num_tokens=T, x_gather=x_gather,
                             row_adapter=with_map, bad_tokens=0.3)
    stid = case.ids["sorted_token_ids"]
    bad = (stid < 0) | (stid >= T)
    out = case.run(impl)
    if x_gather or with_map:
        np.testing.assert_array_equal(bits(out[bad]), bits(case.base_out[bad]))
    else:
        assert case.fold_rows[bad].sum() >= 1  # some row whose token is out of range folds
    _check(case, out, impl)


# ------------------------------------------------------------ moe_lora_fold

@maps
@x_gathers
@dtypes
@pytest.mark.parametrize("impl", ["cpu", "jnp", "auto", *CUDA_IMPLS])
def test_fold_gather_and_sorted_paths_give_the_same_bits(rng, impl, dtype, x_gather, with_map):
    """moe_lora_fold: the gather fold and sort -> grouped fold -> unsort
    (forced by gather_max_rows=0) give the same bits, matching the reference.
    Exception: "fast" folds decode rows on CUDA cores and sorted rows on the
    tensor cores, which sum in other orders: there both paths must match the
    reference (and skip the same rows bit for bit)."""
    case = make_gather_case(rng, op="fold", dtype=dtype, num_loras=4, x_gather=x_gather,
                            row_adapter=with_map)
    gathered = case.run(impl)
    sorted_ = case.run(impl, gather_max_rows=0)
    if concrete_impl(impl) == "fast" and jnp.dtype(dtype) != jnp.float32:
        np.testing.assert_array_equal(bits(sorted_[~case.fold_rows]),
                                      bits(gathered[~case.fold_rows]))
        _check(case, sorted_, impl)
    else:
        np.testing.assert_array_equal(bits(sorted_), bits(gathered))
    _check(case, gathered, impl)


@impls
def test_fold_accepts_uint32_topk_ids(rng, impl):
    case = make_gather_case(rng, op="fold", num_loras=2, x_gather=1, index_dtype=np.uint32)
    assert (case.ids["topk_ids"] >= 2**31).any()
    gathered = case.run(impl)
    np.testing.assert_array_equal(bits(case.run(impl, gather_max_rows=0)), bits(gathered))
    _check(case, gathered, impl)


@pytest.mark.parametrize("op", ["gather", "grouped"])
def test_auto_is_the_platform_default(rng, op):
    """impl="auto" is "fast" on a GPU with the CUDA kernels, "cpu" on the CPU."""
    assert concrete_impl("auto") == ("fast" if HAS_GPU else "cpu")
    make = make_gather_case if op == "gather" else make_grouped_case
    case = make(rng, num_loras=2, x_gather=1)
    out = case.run("auto")
    np.testing.assert_array_equal(bits(out), bits(case.run(concrete_impl("auto"))))
    _check(case, out, "auto")


# ---------------------------------------------------------------------- jit

def _case(rng, op, **kw):
    if op == "grouped":
        return make_grouped_case(rng, **kw)
    return make_gather_case(rng, op="fold" if op.startswith("fold") else "gather", **kw)


@pytest.mark.parametrize("op", ["gather", "grouped", "fold_sorted"])
@impls
def test_jit_gives_the_eager_bits(rng, impl, op):
    case = _case(rng, op, num_loras=4, x_gather=1)
    over = {"gather_max_rows": 0} if op == "fold_sorted" else {}
    jitted = case.run(impl, jit=True, **over)
    eager = case.run(impl, jit=False, **over)
    if concrete_impl(impl) == "jnp" and jax.default_backend() != "cpu":
        # XLA:GPU may sum jnp's dots in another fp32 order once they are fused
        # under jit: both runs match the reference and skip the same rows
        np.testing.assert_array_equal(bits(jitted[~case.fold_rows]), bits(eager[~case.fold_rows]))
        _check(case, eager, impl)
    else:
        np.testing.assert_array_equal(bits(jitted), bits(eager))
    _check(case, jitted, impl)


@pytest.mark.parametrize("loop", ["scan", "fori_loop"])
@pytest.mark.parametrize("op", ["gather", "grouped", "fold_sorted"])
@impls
def test_jitted_loop_over_layers_equals_layer_by_layer(rng, impl, op, loop):
    """Several layers' routes stacked and folded in one jitted loop (the carry
    is base_out) give the bits of folding layer by layer."""
    n_layers, L, E = 3, 2, 6
    common = dict(dtype=jnp.bfloat16, num_loras=L, n_experts=E, pool_size=L * E + 3,
                  poison=False)
    case = _case(rng, op, x_gather=1, **common)
    routes = [case.route] + [make_route(rng, **common) for _ in range(n_layers - 1)]
    xs = [case.x] + [rng.normal(size=case.x.shape).astype(case.dtype)
                     for _ in range(n_layers - 1)]
    over = {"gather_max_rows": 0} if op == "fold_sorted" else {}
    fold = case.fn(impl, **over)

    def layers(base, xs, routes, ids, ra):
        def one(out, x, route):
            return fold(x, out, *ids, route, ra)

        if loop == "scan":
            return jax.lax.scan(lambda out, layer: (one(out, *layer), None), base,
                                (xs, routes))[0]
        pick = lambda i, tree: jax.tree.map(lambda v: v[i], tree)  # noqa: E731
        return jax.lax.fori_loop(0, n_layers, lambda i, out: one(out, pick(i, xs),
                                                                 pick(i, routes)), base)

    x0, base, *ids, _, ra = case.operands()
    with on_platform(impl):
        looped = np.asarray(jax.jit(layers)(*to_device((base, np.stack(xs), stack_routes(routes),
                                                        ids, ra))))
    want = base
    for x, route in zip(xs, routes):
        layer = case.run(impl, x=x, base_out=want, route=route, **over)
        assert (bits(layer) != bits(want)).any(), "a layer folded nothing"
        want = layer
    np.testing.assert_array_equal(bits(looped), bits(want))


# ----------------------------------------------------------------- in place

def _param_copies(hlo: str, index: int) -> list[str]:
    """Instructions of the entry computation copying parameter ``index``."""
    m = re.search(rf"%(\S+) = \S+ parameter\({index}\)", hlo)
    assert m, f"parameter({index}) not found in the HLO"
    return re.findall(rf"^.*copy(?:-start)?\(%{re.escape(m.group(1))}\).*$", hlo, re.M)


@pytest.mark.parametrize("op", ["gather", "grouped"])
@pytest.mark.parametrize("impl", ["cpu", *CUDA_IMPLS])
def test_donated_base_out_is_folded_in_place(rng, impl, op):
    """With base_out donated, the compiled program has no copy of it: the
    custom call's output aliases the parameter, which is the program's output."""
    case = _case(rng, op, num_loras=2, x_gather=1)
    fn = case.fn(impl)
    with on_platform(impl):
        args = to_device(case.operands())
        kept = jax.jit(fn).lower(*args).compile().as_text()
        donated = jax.jit(fn, donate_argnums=1).lower(*args).compile().as_text()
        out = jax.jit(fn, donate_argnums=1)(*args)
        assert args[1].is_deleted()
    # without donation XLA must copy base_out: the check below can see a copy
    assert _param_copies(kept, 1), "no copy of an undonated base_out: the HLO check is blind"
    assert not _param_copies(donated, 1), _param_copies(donated, 1)
    assert re.search(r"input_output_alias=\{ \{\}: \(1, \{\}", donated), donated[:400]
    assert re.search(r"custom_call_target=\"moe_lora_\w+\".*output_to_operand_aliasing="
                     r"\{\{0\}: \(1, \{\}\)[,}]", donated)
    _check(case, np.asarray(out), impl)


# --------------------------------------------------------------------- GPU

@pytest.mark.parametrize("op", ["gather", "grouped"])
@x_gathers
@dtypes
@pytest.mark.parametrize("impl", ULP_STRICT_GPU)
def test_gpu_matches_the_cpu_handlers(rng, impl, dtype, x_gather, op):
    """The CUDA kernels equal the C++ CPU handlers within the ulp tolerance
    (bf16/f16: 2 ulp, 99 % within 1 ulp; f32: the delta norm criterion)."""
    case = _case(rng, op, dtype=dtype, num_loras=4, x_gather=x_gather)
    gpu, cpu = case.run(impl), case.run("cpu")
    fold = case.fold_rows
    np.testing.assert_array_equal(bits(gpu[~fold]), bits(cpu[~fold]))
    if jnp.dtype(dtype) == jnp.float32:
        assert delta_rel_error(gpu[fold], cpu[fold], case.base_out[fold]) <= DELTA_RTOL[
            jnp.dtype(dtype)]
    else:
        assert_ulp_close(gpu[fold], cpu[fold], "GPU vs CPU handler")


@pytest.mark.parametrize("op", ["gather", "grouped"])
@pytest.mark.parametrize("dtype", DTYPES[:2], ids=DTYPE_IDS[:2])
@pytest.mark.parametrize("impl", CUDA_IMPLS)
def test_gpu_large_shapes_match_reference(rng, impl, dtype, op):
    """Shapes that span many tiles: K=2048, N=768, rank up to 64, 512 gather
    rows or ~4096 sorted rows."""
    big = dict(dtype=dtype, num_loras=4, k_in=2048, n_out=768, ranks=(8, 16, 64),
               max_rank=64, n_experts=16, x_gather=1)
    if op == "gather":
        case = make_gather_case(rng, top_k=8, num_tokens=64, **big)
    else:
        case = make_grouped_case(rng, num_tokens=1024, rows_per_expert=215, **big)
    _check(case, case.run(impl), impl)


@pytest.mark.parametrize("x_gather", [0, 1], ids=["xg0", "xg1"])
@pytest.mark.parametrize("impl", ["cpu", *CUDA_IMPLS])
def test_f32_long_gather_matches_reference_and_its_halves(rng, impl, x_gather):
    """An fp32 gather fold of >= 2048 rows (the router's fold at prefill; on
    ``fast`` the tiled kernel, which folds the rows of one adapter together)
    meets the fp32 criterion, and each row has the bits it gets in a batch of
    half the length (on ``fast`` the kernel of one CTA a row)."""
    tokens, top_k = 1100, 2
    case = make_gather_case(rng, dtype=jnp.float32, num_loras=4, top_k=top_k, num_tokens=tokens,
                            x_gather=x_gather, k_in=256, n_out=136, ranks=(8, 16), max_rank=16)
    out = case.run(impl)
    _check(case, out, impl)
    t2, r2 = tokens // 2, tokens * top_k // 2
    half = case.run(impl, x=case.x[:t2 if x_gather else r2], base_out=case.base_out[:r2],
                    indices=case.ids["indices"][:r2], row_adapter=case.row_adapter[:t2])
    np.testing.assert_array_equal(bits(half), bits(out[:r2]))


@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("impl", ["cpu", *CUDA_IMPLS])
def test_f32_short_gather_has_the_bits_of_a_longer_batch(rng, impl, rows):
    """A short fp32 gather fold (the router's fold at decode) gives each row
    the bits it gets in a batch of 400 rows, and meets the fp32 criterion:
    the batch length never changes a row (rank 16 or 32: ``fast`` sums all 16
    ranks of a pass at once, rank 32 in two passes)."""
    case = make_gather_case(rng, dtype=jnp.float32, num_loras=4, top_k=1, num_tokens=400,
                            x_gather=0, k_in=2048, n_out=128, ranks=(16, 32), max_rank=32)
    out = case.run(impl)
    _check(case, out, impl)
    short = case.run(impl, x=case.x[:rows], base_out=case.base_out[:rows],
                     indices=case.ids["indices"][:rows], row_adapter=case.row_adapter[:rows])
    np.testing.assert_array_equal(bits(short), bits(out[:rows]))


@pytest.mark.parametrize("op, tokens", [("gather", 40), ("gather", 1100), ("fold", 1100),
                                        ("grouped", 48)])
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_f32_fold_reads_bf16_or_f16_x_with_the_bits_of_x_in_f32(rng, impl, x_dtype, op, tokens):
    """Under float32 pools the folds take bf16 or f16 ``x`` (the router's fold
    over the activations): on the custom calls every row gets the bits of the
    same fold over ``x`` widened to float32, in short and long gather batches
    (on ``fast`` the one-CTA-a-row and the tiled kernels), through
    ``moe_lora_fold``'s grouped path and in the grouped fold; ``jnp`` meets
    the float32 criterion (XLA may fuse the widening into its products)."""
    shape = dict(dtype=jnp.float32, num_loras=4, k_in=256, n_out=136, ranks=(8, 16),
                 max_rank=16)
    if op == "grouped":
        case = make_grouped_case(rng, x_gather=1, **shape)
    else:
        case = make_gather_case(rng, top_k=2, num_tokens=tokens, x_gather=1, op=op, **shape)
    x = case.x.astype(x_dtype)
    wide = x.astype(np.float32)
    out = case.run(impl, x=x)
    if impl != "jnp":
        np.testing.assert_array_equal(bits(out), bits(case.run(impl, x=wide)))
    _check(case, out, impl, ref=case.reference(x=wide))


@pytest.mark.parametrize("impl", IMPLS)
def test_narrow_x_needs_f32_pools(rng, impl):
    """bf16 ``x`` with f16 pools, or f32 ``x`` with bf16 pools, is refused
    before any launch; f16 ``x`` under float32 pools is taken."""
    case = make_gather_case(rng, dtype=jnp.float16, num_loras=1, x_gather=1)
    with pytest.raises(TypeError, match="x dtype bfloat16 differs from base_out dtype float16 "
                                        r"\(x may be bf16 or f16 only with float32 pools\)"):
        case.run(impl, x=case.x.astype(jnp.bfloat16))
    case = make_gather_case(rng, dtype=jnp.bfloat16, num_loras=1, x_gather=1)
    with pytest.raises(TypeError, match="x dtype float32 differs from base_out dtype bfloat16"):
        case.run(impl, x=case.x.astype(np.float32))


@pytest.mark.parametrize("impl", CUDA_IMPLS)
def test_cuda_graphs_on_and_off_give_the_same_bits(tmp_path, impl):
    """A jitted multi-layer program run with CUDA graphs (the default) and in a
    subprocess with XLA_FLAGS=--xla_gpu_enable_command_buffer= (graphs off)
    gives identical bits. (XLA 0.11 forms command buffers after HLO, so the
    compiled HLO text cannot show them; the custom calls declare
    kCmdBufferCompatible and the program has enough of them in a row.)"""
    seed = 1234
    on = graph_program(seed, impl)
    off = run_with_graphs_off(tmp_path, "_fold_cases", f"graph_program({seed}, {impl!r})")
    np.testing.assert_array_equal(bits(off), bits(on))


@pytest.mark.parametrize("shape", [
    dict(num_loras=1, k_in=512, n_out=320),                       # split kernels
    dict(num_loras=3, k_in=1024, n_out=520),                      # cells mixed in tiles
    dict(num_loras=3, k_in=1416, n_out=136),                      # K % 256 != 0: a short chunk
    dict(num_loras=4, k_in=512, n_out=136, rows_per_expert=3000),  # CTAs of 96 rows
    dict(num_loras=3, k_in=256, n_out=264, ranks=(24, 40), max_rank=40),   # 32-row shrink tiles
    dict(num_loras=4, k_in=512, n_out=392, ranks=(48, 64), max_rank=64),   # expand of 4 rank steps
    dict(num_loras=2, k_in=256, n_out=136, ranks=(72, 128), max_rank=128),  # rank passes
    dict(num_loras=3, k_in=260, n_out=320),                       # K % 8 != 0: simple kernels
    dict(num_loras=3, k_in=256, n_out=202),                       # N % 8 != 0: simple kernels
    dict(num_loras=2, k_in=256, n_out=136, n_experts=64, extra_experts=1100,  # offsets
         rows_per_expert=4),
], ids=["L1", "L3", "K1416", "L4-rows20k", "L3-R40", "L4-R64", "L2-R128", "K260-simple", "N202-simple",
        "E1106"])
@pytest.mark.parametrize("x_gather", [0, 1])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("impl", [pytest.param("fast", marks=GPU)])
def test_fast_grouped_kernels_match_reference(rng, impl, dtype, x_gather, shape):
    """The fast grouped fold (launch_grouped_fast: the shrink and expand
    kernels, or the simple kernels for shapes they cannot read in 16-byte
    vectors), whole and in a window that cuts tiles, against the reference.
    The shrink's CTAs own 32-row runs of the window in the small cases, more
    in rows20k (64-row tiles and shorter ones at the runs' and experts' ends;
    264 CTAs on 132 SMs); K1416 ends in a short chunk.
    E1106: more expert_offsets than the expand keeps in shared memory (1024)."""
    shape = dict(shape)
    kw = dict(ranks=shape.pop("ranks", (8, 16)), max_rank=shape.pop("max_rank", 16),
              rows_per_expert=shape.pop("rows_per_expert", 150),
              n_experts=shape.pop("n_experts", 6))
    case = make_grouped_case(rng, dtype=dtype, num_tokens=512, x_gather=x_gather, **kw, **shape)
    _check(case, case.run(impl), impl)
    te = case.base_out.shape[0]
    fold = np.nonzero(case.fold_rows)[0]  # a window that starts and ends among folding rows
    lo, hi = int(fold[len(fold) // 3]) + 1, int(fold[2 * len(fold) // 3]) + 1
    out = case.run(impl, row_offset=lo, row_end=hi)
    inside = np.zeros(te, bool)
    inside[lo:hi] = True
    np.testing.assert_array_equal(bits(out[~inside]), bits(case.base_out[~inside]))
    _check(case, out, impl, fold_rows=case.fold_rows & inside,
           ref=case.reference(row_offset=lo, row_end=hi))


# launch_gather_fast takes the rows kernels when the rows' A/B reads, rows * R *
# (K + N) * 2, are <= 48 MiB, or <= 96 MiB with rows < 2 * min(rows, L * E_t),
# else the cells kernels: the "cells" shapes are several rows per cell and
# 100-190 MB of per-row A/B reads. Of the rows kernels (H200, 132 SMs), the
# staged one takes R <= 32, N <= 2048 and at least 264 rows (the "staged"
# shapes: runs of 4, 8 and 16 rows a CTA, a shorter last run); the other
# gives a CTA 4 rows from 370 (R = 40, one CTA an SM), 2 from 185, else 1.
_CELLS_KN = dict(k_in=2048, n_out=1028)


@pytest.mark.parametrize("shape", [
    dict(num_tokens=8, top_k=2, n_experts=64, num_loras=4),     # ~1 row per cell: rows kernel
    dict(num_tokens=1, top_k=8, n_experts=64, num_loras=1),     # T = 1
    dict(num_tokens=8, top_k=2, n_experts=64, num_loras=4, ranks=(24, 40), max_rank=40),
    dict(num_tokens=64, top_k=2, n_experts=4, num_loras=2),     # few rows, 16 per cell: rows
    dict(num_tokens=171, top_k=3, n_experts=64, num_loras=4),   # 513 rows: staged, 4 a CTA
    dict(num_tokens=477, top_k=2, n_experts=64, num_loras=4),   # 954 rows: staged, 8 a CTA
    dict(num_tokens=1050, top_k=2, n_experts=64, num_loras=4),  # 2100 rows: staged, 16 a CTA
    dict(num_tokens=101, top_k=3, n_experts=64, num_loras=4, ranks=(24, 40), max_rank=40),
    dict(num_tokens=201, top_k=2, n_experts=64, num_loras=4, ranks=(24, 40), max_rank=40),
    dict(num_tokens=512, top_k=2, n_experts=4, num_loras=2, **_CELLS_KN),  # cells kernel
    dict(num_tokens=160, top_k=4, n_experts=8, num_loras=3, ranks=(24, 40), max_rank=48,
         **_CELLS_KN),
], ids=["rows", "rows-T1", "rows-R40", "rows-L2-small", "staged-4", "staged-8", "staged-16",
        "rows-2-R40", "rows-4-R40", "cells", "cells-R48"])
@pytest.mark.parametrize("x_gather", [0, 1])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("impl", [pytest.param("fast", marks=GPU)])
def test_fast_gather_kernels_match_reference(rng, impl, dtype, x_gather, shape):
    """Every fast decode kernel (launch_gather_fast picks rows or cells by the
    rows per (adapter, expert) cell and the rows' A/B bytes; of the rows
    kernels, the staged one from two rows an SM, the other giving a CTA 1, 2
    or 4 rows by the number of rows), with output widths that are not a
    multiple of the 16-byte vectors, against the reference."""
    shape = dict(shape)
    kw = dict(ranks=shape.pop("ranks", (8, 16)), max_rank=shape.pop("max_rank", 16),
              k_in=shape.pop("k_in", 256), n_out=shape.pop("n_out", 200))
    case = make_gather_case(rng, dtype=dtype, x_gather=x_gather, **kw, **shape)
    _check(case, case.run(impl), impl)


@pytest.mark.parametrize("kind", ["skewed", "past-scan"])
@pytest.mark.parametrize("impl", [pytest.param("fast", marks=GPU)])
def test_fast_cells_kernels_with_long_cells_and_many_rows(rng, impl, kind):
    """The decode cells kernels where one cell holds most rows (skewed: its
    batches outnumber its CTAs, so a CTA folds several of them one after the
    other) and past the rows one CTA keys itself (past-scan: 4,200 rows, so a
    plan kernel groups them first), against the reference."""
    num_tokens = 512 if kind == "skewed" else 2100
    n = num_tokens * 2
    ids = random_expert_ids(rng, n, 4)
    if kind == "skewed":
        ids = np.where(rng.random(n) < 0.7, 0, ids).astype(np.int32)
    case = make_gather_case(rng, dtype=jnp.bfloat16, num_tokens=num_tokens, top_k=2, n_experts=4,
                            num_loras=2, x_gather=int(kind == "skewed"), indices=ids,
                            ranks=(8, 16), max_rank=16, **_CELLS_KN)
    _check(case, case.run(impl), impl)


# a shape for each kernel of launch_gather_fast (the comment above): rows,
# staged rows, cells, cells after a plan kernel (past 4,096 rows)
_KEEP_XA_SHAPES = {
    "rows": dict(num_tokens=8, top_k=2, n_experts=64, num_loras=4),
    "staged": dict(num_tokens=171, top_k=3, n_experts=64, num_loras=4),
    "cells": dict(num_tokens=512, top_k=2, n_experts=4, num_loras=2, **_CELLS_KN),
    "plan": dict(num_tokens=2100, top_k=2, n_experts=4, num_loras=2, **_CELLS_KN),
}


@pytest.mark.parametrize("shape", list(_KEEP_XA_SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("impl", ["cpu", *CUDA_IMPLS])
def test_gather_fold_keeps_each_folding_rows_xa(rng, impl, dtype, shape):
    """``keep_xa`` (what ``expert_matmul``'s training forward asks of the
    gather custom call): the folded output is the same bits as without it,
    and each folding row's kept ``xa`` is ``round(x A^T)`` (an fp32 sum
    rounded to the dtype): every kernel of the fast backend (fp32 through
    the simple kernels), the simple kernels and the CPU handler."""
    from jax_moelora.ops import ffi_fold
    from jax_moelora.ops.jnp_fold import resolve_pairs

    shape = dict(_KEEP_XA_SHAPES[shape])
    case = make_gather_case(rng, dtype=dtype, ranks=(8, 16), max_rank=16,
                            **{"k_in": 256, "n_out": 200, **shape})
    top_k, x_gather = case.kw["top_k"], case.kw["x_gather"]
    with on_platform(impl):
        args = to_device(case.operands())

        def call(keep):
            return jax.jit(lambda *a: ffi_fold.gather_bgmv_ffi(
                *a, top_k=top_k, x_gather=x_gather, impl=impl, keep_xa=keep))(*args)

        plain, (out, xa) = call(False), call(True)
        np.testing.assert_array_equal(bits(np.asarray(out)), bits(np.asarray(plain)))
        x, _, ids, route, ra = case.operands()
        rows = np.arange(ids.shape[0])
        adapter = np.zeros_like(rows) if ra is None else ra[rows // top_k]
        a, _, _, ok = (np.asarray(v) for v in resolve_pairs(
            jax.tree.map(jnp.asarray, route), jnp.asarray(adapter), jnp.asarray(ids)))
    np.testing.assert_array_equal(ok, case.fold_rows)
    xrow = rows if x_gather == 0 else rows // top_k
    want = np.einsum("rk,rjk->rj", x[xrow[ok]].astype(np.float64),
                     np.asarray(route.a_pool, np.float64)[a[ok]])
    got = np.asarray(xa, np.float64)[ok]
    assert np.abs(want).max() > 0
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel <= DELTA_RTOL[jnp.dtype(dtype)], rel


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("with_adapters", [False, True])
def test_sort_rows_by_expert_and_adapter(rng, with_adapters, L):
    """Rows sorted by expert keep each expert's span whatever the adapters;
    with ``row_adapter`` the rows of a span are grouped by the table row they
    fold with (those that fold nothing first: a slot < 0, or ``>= L`` when
    ``L > 1``; with ``L == 1`` every slot >= 0 is row 0), each group in flat
    order; ids outside ``[0, E)`` land outside every span."""
    T, k, E = 40, 3, 6
    topk = rng.integers(-2, E + 2, size=(T, k)).astype(np.int32)
    ra = rng.integers(-2, L + 2, size=T).astype(np.int32)
    order, offsets, stok = sort_rows_by_expert(jnp.asarray(topk), E,
                                               jnp.asarray(ra) if with_adapters else None, L)
    order, offsets, stok = map(np.asarray, (order, offsets, stok))
    flat = topk.reshape(-1)
    np.testing.assert_array_equal(np.sort(order), np.arange(T * k))
    np.testing.assert_array_equal(stok, order // k)
    want = np.searchsorted(np.sort(flat, kind="stable"), np.arange(E + 1), side="left")
    np.testing.assert_array_equal(offsets, want)
    assert (flat[order[:offsets[0]]] < 0).all() and (flat[order[offsets[-1]:]] >= E).all()
    for e in range(E):
        rows = order[offsets[e]:offsets[e + 1]]
        assert (flat[rows] == e).all()
        slot = ra[rows // k]
        row = np.minimum(slot, 0) if L == 1 else slot
        group = np.where((row >= 0) & (row < L), row + 1, 0) if with_adapters else 0 * slot
        key = group * (T * k) + rows  # slot group first, then flat order
        np.testing.assert_array_equal(key, np.sort(key))


def test_sort_rows_by_expert_checks_row_adapter():
    topk = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"row_adapter must be \[T\] = \[4\]"):
        sort_rows_by_expert(topk, 3, jnp.zeros((8,), jnp.int32), 2)
    with pytest.raises(TypeError, match="row_adapter must be integers"):
        sort_rows_by_expert(topk, 3, jnp.zeros((4,), jnp.float32), 2)
    with pytest.raises(ValueError, match="num_adapters must be an int >= 0"):
        sort_rows_by_expert(topk, 3, jnp.zeros((4,), jnp.int32), -1)


def test_row_sort_and_grouped_rows_have_no_host_round_trip(rng):
    """What a layer runs before its grouped folds (the row sort and its expert
    offsets, each sorted row's expert and adapter) is traced jnp with no host
    callback, no custom call and no while loop, whose every step the GPU
    reads back to the host."""
    T, k, E, L = 512, 8, 128, 4
    topk = jnp.asarray(rng.integers(0, E, size=(T, k)).astype(np.int32))
    ra = jnp.asarray(rng.integers(-1, L, size=T).astype(np.int32))
    assert_pure_device(lambda t, r: sort_rows_by_expert(t, E, r, L), topk, ra)
    _, offsets, stok = sort_rows_by_expert(topk, E, ra, L)
    assert_pure_device(lambda o, s, r: grouped_rows(o, s, r, x_rows=T, row_offset=0,
                                                    row_end=T * k, x_gather=1), offsets, stok, ra)


def test_row_sort_by_adapter_adds_only_elementwise_work_to_the_expert_sort(rng):
    """Sorting by adapter within an expert costs the expert sort's one argsort
    and search, plus elementwise work on the key: each token's slot reaches its
    top_k rows by a broadcast, with no cumulative sum, scatter or gather."""
    T, k, E, L = 512, 8, 128, 4
    topk = jnp.asarray(rng.integers(0, E, size=(T, k)).astype(np.int32))
    ra = jnp.asarray(rng.integers(-1, L, size=T).astype(np.int32))

    def ops(row_adapter):
        jaxpr = str(jax.make_jaxpr(lambda t: sort_rows_by_expert(t, E, row_adapter, L))(topk))
        return {p: jaxpr.count(p + "[") for p in ("cumsum", "scatter", "scatter-add", "gather",
                                                  "sort", "reduce_window_sum")}

    assert ops(ra) == ops(None)


def test_plan_permutations_have_the_inverse_permutation_as_gradient():
    """A grouped plan's ``to_plan_order`` and ``to_flat_order`` permute rows;
    their gradients are the inverse permutations (the values of indexing's
    scatter-add gradient), taken without a scatter."""
    rng = np.random.default_rng(7)
    topk = jnp.asarray(rng.integers(0, 6, (40, 2)), jnp.int32)
    plan = plan_rows(topk, 6, gather_max_rows=0)
    assert plan.grouped
    rows = jnp.asarray(rng.normal(size=(80, 5)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(80, 5)), jnp.float32)
    order = np.asarray(plan.order)
    for fn, ref in ((plan.to_plan_order, lambda v: v[order]),
                    (plan.to_flat_order, lambda v: v[np.argsort(order)])):
        np.testing.assert_array_equal(fn(rows), ref(rows))
        got = jax.grad(lambda v: jnp.sum(fn(v) * cot))(rows)
        want = jax.grad(lambda v: jnp.sum(ref(v) * cot))(rows)
        np.testing.assert_array_equal(got, want)
        assert "scatter-add" in str(jax.make_jaxpr(jax.grad(lambda v: jnp.sum(ref(v) * cot)))(rows))
        assert "scatter-add" not in str(jax.make_jaxpr(jax.grad(lambda v: jnp.sum(fn(v) * cot)))(rows))
