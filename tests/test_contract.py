"""Bad input, as a new user would give it: docs/malformed_metadata.md.

Each backend must skip the same rows bit for bit on malformed routing metadata
(decreasing or overflowing ``expert_offsets``, token ids out of range); the
opt-in ``validate=True`` mode turns the same breaches into errors; integers
that do not fit int32 and shapes int32 indices cannot address are refused
before anything runs, with errors that name the argument and the value.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_moelora as ml
from _fold_cases import bits, check_fold, is_ulp_strict, make_grouped_case, make_gather_case, \
    on_platform, to_device
from jax_moelora.int_range import Int32RangeError
from jax_moelora.ops.contract import offsets_well_formed
from jax_moelora.tables import MoeExpertRoute, pack_expert_tables_traced

GPU = pytest.mark.gpu
IMPLS = ["cpu", "jnp", pytest.param("simple", marks=GPU), pytest.param("fast", marks=GPU)]
impls = pytest.mark.parametrize("impl", IMPLS)


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def on_cpu():
    """Computations on the CPU (``impl="cpu"`` needs it on a GPU machine too)."""
    with on_platform("cpu"):
        yield


def _small_grouped(rng, **kw):
    return make_grouped_case(rng, dtype=jnp.float32, num_loras=1, n_experts=4, k_in=16, n_out=8,
                             ranks=(8,), max_rank=8, extra_experts=0, lead=0, tail=0,
                             rows_per_expert=3, bad_tokens=0.0, **kw)


# ------------------------------------------------- offsets that are not well formed

def test_offsets_well_formed_rule():
    te = 9
    for o, want in [([0, 2, 5, 9], True), ([3, 3, 3, 3], True), ([0, 0, 0, 9], True),
                    ([1, 4, 4, 8], True), ([5, 5, 2, 9], False), ([-1, 2, 5, 9], False),
                    ([0, 2, 5, 10], False), ([0, 6, 5, 9], False), ([0, 2, 5, 2**31 - 1], False)]:
        assert bool(offsets_well_formed(jnp.asarray(o, jnp.int32), te)) is want, o


MALFORMED = {
    "decreasing": lambda te: [5, 5, 2, 2, te],          # the case, scaled to te
    "negative_first": lambda te: [-3, 2, 4, 6, te],
    "past_te": lambda te: [0, 2, 4, 6, te + 1],
    "int32_max_last": lambda te: [0, 2, 4, 6, 2**31 - 1],
    "dip_in_middle": lambda te: [0, 4, 3, 6, te],
}


@impls
@pytest.mark.parametrize("kind", sorted(MALFORMED))
@pytest.mark.parametrize("x_gather", [0, 1], ids=["xg0", "xg1"])
def test_malformed_offsets_fold_no_row_on_every_backend(rng, impl, kind, x_gather):
    case = _small_grouped(rng, x_gather=x_gather, row_adapter=False)
    te = case.base_out.shape[0]
    offsets = np.asarray(MALFORMED[kind](te), np.int32)
    assert offsets.shape == case.ids["expert_offsets"].shape
    out = case.run(impl, expert_offsets=offsets)
    np.testing.assert_array_equal(bits(out), bits(case.base_out))
    # the same case with its own (well-formed) offsets does fold: the test can fail
    assert (bits(case.run(impl)) != bits(case.base_out)).any()


@impls
def test_well_formed_offsets_with_lead_gap_and_short_tail_fold_their_spans(rng, impl):
    case = _small_grouped(rng, x_gather=0, row_adapter=False)
    te = case.base_out.shape[0]
    offsets = np.array([2, 4, 4, te - 3, te - 1], np.int32)   # rows 0-1 and te-1 in no span
    ref = case.reference(expert_offsets=offsets)
    out = case.run(impl, expert_offsets=offsets)
    for r in (0, 1, te - 1):
        np.testing.assert_array_equal(bits(out[r]), bits(case.base_out[r]))
    folded = (bits(ref) != bits(case.base_out)).any(axis=1)
    assert folded.any()
    np.testing.assert_array_equal(folded, (bits(out) != bits(case.base_out)).any(axis=1))


@impls
def test_vmap_applies_the_offsets_rule_per_example(rng, impl):
    case = _small_grouped(rng, x_gather=0, row_adapter=False)
    te = case.base_out.shape[0]
    good = case.ids["expert_offsets"]
    bad = np.asarray(MALFORMED["decreasing"](te), np.int32)
    offs = np.stack([good, bad, good])
    with on_platform(impl):
        x, base, _, stid, route, _ = to_device(case.operands())

        def one(o):
            return ml.moe_lora_grouped_down(x, base, o, stid, route, x_gather=0, impl=impl)

        out = np.asarray(jax.jit(jax.vmap(one))(jnp.asarray(offs)))
        alone = np.asarray(jax.jit(one)(jnp.asarray(good)))
    np.testing.assert_array_equal(bits(out[1]), bits(case.base_out))
    np.testing.assert_array_equal(bits(out[0]), bits(alone))
    np.testing.assert_array_equal(bits(out[2]), bits(alone))
    assert (bits(alone) != bits(case.base_out)).any()


def test_reference_follows_the_offsets_rule(rng):
    case = _small_grouped(rng, x_gather=0, row_adapter=False)
    bad = np.asarray(MALFORMED["decreasing"](case.base_out.shape[0]), np.int32)
    np.testing.assert_array_equal(bits(case.reference(expert_offsets=bad)), bits(case.base_out))


# ----------------------------------------------------------------- checked mode

def _grouped_args(case):
    return to_device(case.operands())


@pytest.mark.usefixtures("on_cpu")
def test_validate_accepts_well_formed_metadata_and_gives_the_same_bits(rng):
    case = make_grouped_case(rng, dtype=jnp.bfloat16, x_gather=1, bad_tokens=0.0)
    x, base, offs, stid, route, ra = _grouped_args(case)
    plain = ml.moe_lora_grouped_down(x, base, offs, stid, route, ra, x_gather=1, impl="cpu")
    checked = ml.moe_lora_grouped_down(x, base, offs, stid, route, ra, x_gather=1, impl="cpu",
                                       validate=True)
    np.testing.assert_array_equal(bits(plain), bits(checked))


@pytest.mark.parametrize("impl", ["cpu", "jnp"])
def test_validate_raises_on_malformed_offsets_eagerly(rng, impl):
    case = _small_grouped(rng, x_gather=0, row_adapter=False)
    with on_platform(impl):
        x, base, _, stid, route, _ = _grouped_args(case)
        bad = jnp.asarray(MALFORMED["decreasing"](base.shape[0]), jnp.int32)
        with pytest.raises(checkify.JaxRuntimeError, match="expert_offsets must satisfy"):
            ml.moe_lora_grouped_down(x, base, bad, stid, route, x_gather=0, impl=impl,
                                     validate=True)
        # without validate: the documented skip
        out = ml.moe_lora_grouped_down(x, base, bad, stid, route, x_gather=0, impl=impl)
    np.testing.assert_array_equal(bits(out), bits(case.base_out))


@pytest.mark.usefixtures("on_cpu")
def test_validate_under_jit_with_checkify_names_the_token(rng):
    case = _small_grouped(rng, x_gather=1, row_adapter=False)
    x, base, offs, stid, route, _ = _grouped_args(case)
    n = x.shape[0]
    stid = stid.at[3].set(n + 7)

    def fold(x, base, offs, stid, route):
        return ml.moe_lora_grouped_down(x, base, offs, stid, route, x_gather=1, impl="cpu",
                                        validate=True)

    err, _ = jax.jit(checkify.checkify(fold, errors=checkify.user_checks))(x, base, offs, stid,
                                                                          route)
    with pytest.raises(checkify.JaxRuntimeError, match=rf"row 3 holds {n + 7}"):
        err.throw()
    good = case.operands()[3]
    err, _ = jax.jit(checkify.checkify(fold, errors=checkify.user_checks))(
        x, base, offs, jnp.asarray(good), route)
    err.throw()  # no error on good metadata


@pytest.mark.parametrize("impl", ["cpu", "jnp"])
@pytest.mark.parametrize("stacked", [False, True], ids=["route", "stacked"])
@pytest.mark.parametrize("x_gather", [1, 0], ids=["bound_x_rows", "bound_row_adapter"])
def test_validate_bounds_read_tokens_by_num_tokens_itself(rng, impl, stacked, x_gather):
    """A token id that is read must lie in ``[0, num_tokens)``, ``num_tokens``
    being ``x``'s rows with ``x_gather=1``, else the row-adapter map's length
    (neither is ``te``): ``num_tokens`` itself and ``-1`` raise, naming the
    row and the value; ``0`` and ``num_tokens - 1`` pass. The same with a
    ``StackedRoute``."""
    case = _small_grouped(rng, x_gather=x_gather, row_adapter=not x_gather)
    x, base, offs, stid, route, ra = case.operands()
    n = x.shape[0] if x_gather else ra.shape[0]
    assert n != stid.shape[0]
    row = 3
    with on_platform(impl):
        x, base, offs, route, ra = to_device((x, base, offs, route, ra))
        if stacked:
            route, base = ml.stack_routes(route, route), jnp.stack([base, base])

        def fold(token):
            return ml.moe_lora_grouped_down(x, base, offs, jnp.asarray(stid).at[row].set(token),
                                            route, ra, x_gather=x_gather, impl=impl,
                                            validate=True)

        for token in (n, -1):
            with pytest.raises(checkify.JaxRuntimeError,
                               match=rf"sorted_token_ids must be in \[0, {n}\) .* "
                                     rf"row {row} holds {token} "):
                fold(token)
        for token in (0, n - 1):
            fold(token)


@pytest.mark.usefixtures("on_cpu")
def test_validate_ignores_tokens_that_are_never_read(rng):
    case = _small_grouped(rng, x_gather=0, row_adapter=False)
    x, base, offs, stid, route, _ = _grouped_args(case)
    stid = stid.at[0].set(-5)     # x_gather=0 and no map: sorted_token_ids is not read
    ml.moe_lora_grouped_down(x, base, offs, stid, route, x_gather=0, impl="cpu", validate=True)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("op", ["gather", "grouped"])
def test_validate_raises_on_table_cells_outside_the_pool(rng, op):
    make = make_gather_case if op == "gather" else make_grouped_case
    extra = {"bad_tokens": 0.0} if op == "grouped" else {}
    case = make(rng, dtype=jnp.float32, out_of_pool=1, **extra)
    args = to_device(case.operands())
    fn = ml.moe_lora_gather_bgmv if op == "gather" else ml.moe_lora_grouped_down
    with pytest.raises(checkify.JaxRuntimeError, match=r"route\.[ab]_table has 1 cells outside"):
        fn(*args, impl="cpu", validate=True, **case.keywords())
    fn(*args, impl="cpu", **case.keywords())   # the documented skip, no error


@pytest.mark.usefixtures("on_cpu")
def test_validate_does_not_flag_ordinary_skips(rng):
    # negative and foreign expert ids, adapters -1 and >= L, unadapted cells
    case = make_gather_case(rng, dtype=jnp.float32, num_loras=3)
    args = to_device(case.operands())
    out = ml.moe_lora_gather_bgmv(*args, impl="cpu", validate=True, **case.keywords())
    check_fold(case, out, strict=is_ulp_strict("cpu"))


@pytest.mark.usefixtures("on_cpu")
def test_validate_must_be_a_static_bool(rng):
    case = make_gather_case(rng, dtype=jnp.float32)
    with pytest.raises(TypeError, match="validate must be a static bool"):
        ml.moe_lora_gather_bgmv(*to_device(case.operands()), impl="cpu", validate=1,
                                **case.keywords())


# ------------------------------------------------------------ int32 narrowing

BIG = 2**32 + 1   # wraps to 1: a silent wrong adapter if cast unchecked


def _pools(P=3, R=8, K=4, N=4):
    return jnp.ones((P, R, K), jnp.float32), jnp.ones((P, N, R), jnp.float32)


@pytest.mark.parametrize("which", ["a_table", "b_table"])
def test_route_refuses_table_cells_outside_int32(which):
    a_pool, b_pool = _pools()
    tables = {"a_table": np.array([[1, 2]], np.int64), "b_table": np.array([[1, 2]], np.int64)}
    tables[which] = np.array([[1, BIG]], np.int64)
    with pytest.raises(Int32RangeError, match=rf"{which} holds {BIG} at index \(0, 1\)"):
        MoeExpertRoute(a_pool=a_pool, b_pool=b_pool, scale_table=np.ones((1, 2)), **tables)
    with pytest.raises(OverflowError):
        MoeExpertRoute(a_pool=a_pool, b_pool=b_pool, scale_table=np.ones((1, 2)), **tables)


def test_route_refuses_uint32_cells_past_int32_max():
    a_pool, b_pool = _pools()
    cells = np.array([1, 2**31 + 1], np.uint32)
    with pytest.raises(ValueError, match=rf"a_table holds {2**31 + 1} at index 1"):
        MoeExpertRoute(a_pool=a_pool, b_pool=b_pool, a_table=cells, b_table=np.array([1, 2]),
                       scale_table=np.ones(2))


def test_route_accepts_int64_cells_inside_int32():
    a_pool, b_pool = _pools()
    r = MoeExpertRoute(a_pool=a_pool, b_pool=b_pool, a_table=np.array([1, 2], np.int64),
                       b_table=np.array([2, 1], np.int64), scale_table=np.ones(2))
    np.testing.assert_array_equal(np.asarray(r.a_table), [[1, 2]])
    assert r.a_table.dtype == jnp.int32


@pytest.mark.parametrize("name", ["expert_ids", "a_slots", "b_slots"])
def test_traced_table_packer_refuses_host_values_outside_int32(name):
    args = {"expert_ids": np.array([0, 1], np.int64), "a_slots": np.array([1, 2], np.int64),
            "b_slots": np.array([1, 2], np.int64)}
    args[name] = np.array([1, BIG], np.int64)
    with pytest.raises(Int32RangeError, match=rf"pack_expert_tables_traced: {name} holds {BIG}"):
        pack_expert_tables_traced(scales=np.ones(2), n_experts=4, **args)


def test_routing_helpers_name_the_value_outside_int32():
    with pytest.raises(Int32RangeError, match=rf"adapter_slot holds {-2**40}"):
        ml.resolve_moe_lora_route(np.array([0, -2**40]), 0, True)


# ---------------------------------------------------------- x_gather traced

@pytest.mark.parametrize("op", ["gather", "grouped", "fold"])
def test_traced_x_gather_is_named(rng, op):
    case = make_gather_case(rng, dtype=jnp.float32, op="fold") if op == "fold" else (
        make_gather_case(rng, dtype=jnp.float32) if op == "gather"
        else make_grouped_case(rng, dtype=jnp.float32))
    fn = {"gather": ml.moe_lora_gather_bgmv, "grouped": ml.moe_lora_grouped_down,
          "fold": ml.moe_lora_fold}[op]
    kw = case.keywords()
    kw.pop("x_gather")

    @jax.jit
    def run(xg, *args):
        return fn(*args, x_gather=xg, impl="jnp", **kw)

    with pytest.raises(TypeError, match="x_gather must be a static int 0 or 1.*traced value"):
        run(jnp.int32(0), *to_device(case.operands()))


# --------------------------------------------------- shapes beyond int32 rows

def _abstract_route(K=8, N=8, R=8, P=3, E=4, dt=jnp.bfloat16):
    return MoeExpertRoute(a_pool=jax.ShapeDtypeStruct((P, R, K), dt),
                          b_pool=jax.ShapeDtypeStruct((P, N, R), dt),
                          a_table=np.ones((1, E), np.int32), b_table=np.ones((1, E), np.int32),
                          scale_table=np.ones((1, E), np.float32))


def _sds(shape, dt=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dt)


ROWS_2_31 = 2**31


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("impl", ["jnp", "cpu"])
def test_gather_refuses_rows_int32_cannot_address(impl):
    route = _abstract_route()
    n = ROWS_2_31
    with pytest.raises(ValueError, match=rf"base_out has {n} rows; int32 row indices"):
        jax.eval_shape(lambda x, b, i: ml.moe_lora_gather_bgmv(x, b, i, route, top_k=1,
                                                               x_gather=0, impl=impl),
                       _sds((n, 8)), _sds((n, 8)), _sds((n,), jnp.int32))


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("impl", ["jnp", "cpu"])
def test_grouped_refuses_rows_int32_cannot_address(impl):
    route = _abstract_route()
    te = ROWS_2_31 + 64
    with pytest.raises(ValueError, match=rf"base_out has {te} rows; int32 row indices"):
        jax.eval_shape(lambda x, b, o, s: ml.moe_lora_grouped_down(
            x, b, o, s, route, x_gather=1, row_offset=2**31 + 1, impl=impl),
            _sds((16, 8)), _sds((te, 8)), _sds((5,), jnp.int32), _sds((te,), jnp.int32))


def test_grouped_refuses_x_rows_int32_cannot_address():
    route = _abstract_route()
    with pytest.raises(ValueError, match=rf"x has {ROWS_2_31} rows"):
        jax.eval_shape(lambda x, b, o, s: ml.moe_lora_grouped_down(
            x, b, o, s, route, x_gather=1, impl="jnp"),
            _sds((ROWS_2_31, 8)), _sds((16, 8)), _sds((5,), jnp.int32), _sds((16,), jnp.int32))


def test_fold_refuses_flat_rows_int32_cannot_address():
    route = _abstract_route()
    T, k = 2**28, 8     # T * top_k = 2**31
    with pytest.raises(ValueError, match=rf"moe_lora_fold: base_out has {T * k} rows"):
        jax.eval_shape(lambda x, b, i: ml.moe_lora_fold(x, b, i, route, x_gather=1, impl="jnp"),
                       _sds((T, 8)), _sds((T * k, 8)), _sds((T, k), jnp.int32))


def test_largest_addressable_row_count_is_accepted():
    route = _abstract_route()
    n = ROWS_2_31 - 1
    out = jax.eval_shape(lambda x, b, i, r: ml.moe_lora_gather_bgmv(x, b, i, r, top_k=1,
                                                                    x_gather=0, impl="jnp"),
                         _sds((n, 8)), _sds((n, 8)), _sds((n,), jnp.int32), route)
    assert out.shape == (n, 8)


@pytest.mark.parametrize("op", ["gather", "grouped"])
def test_vmap_refuses_batches_whose_flat_rows_int32_cannot_address(op):
    """vmap folds all examples in one call over batch * rows flat rows."""
    route = _abstract_route()
    rows = 2**20

    def one(x, b, i, r):
        if op == "gather":
            return ml.moe_lora_gather_bgmv(x, b, i, r, top_k=1, x_gather=0, impl="jnp")
        return ml.moe_lora_grouped_down(x, b, jnp.zeros((5,), jnp.int32), i, r, x_gather=0,
                                        impl="jnp")

    def shapes(batch):
        return (_sds((batch, rows, 8)), _sds((batch, rows, 8)),
                _sds((batch, rows), jnp.int32), route)

    batched = jax.vmap(one, in_axes=(0, 0, 0, None))
    with pytest.raises(ValueError, match=rf"under vmap: base_out \(batch \* rows\) has {2**31}"):
        jax.eval_shape(batched, *shapes(2**11))          # 2**31 flat rows
    assert jax.eval_shape(batched, *shapes(4)).shape == (4, rows, 8)
