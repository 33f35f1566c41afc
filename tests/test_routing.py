"""docs/semantics.md §2: the fold decision, refusing unservable batches, row-adapter maps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

import jax_moelora as jm
from conftest import assert_pure_device
from jax_moelora import Route, UnservableBatchError

SETTINGS = settings(max_examples=40, deadline=None)


def spec_route(slot: int, active: int, has: bool) -> Route:
    """docs/semantics.md §2, written out independently of the library."""
    if not has:
        return Route.FOLD
    if slot < 0:
        return Route.SKIP
    return Route.FOLD if slot == active else Route.REFUSE


def spec_route_multi(slot: int, installed: list[bool], has: bool) -> Route:
    if not has:
        return Route.FOLD
    if slot < 0:
        return Route.SKIP
    return Route.FOLD if slot < len(installed) and installed[slot] else Route.REFUSE


def spec_host_map(cu: list[int], slots: list[int]):
    """The prefill map's rules as a plain loop (None on the inputs they reject)."""
    if len(cu) < 2 or len(slots) != len(cu) - 1 or cu[0] != 0:
        return None
    for s, e in zip(cu[:-1], cu[1:]):
        if s < 0 or e < s:
            return None
    out = [-1] * cu[-1]
    for b, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        for t in range(s, e):
            out[t] = slots[b]
    return out


slots_st = st.integers(-3, 9)


# --------------------------------------------------------------------------
# Route and resolve_moe_lora_route
# --------------------------------------------------------------------------

def test_route_enum_values():
    assert issubclass(Route, int)
    assert [Route.FOLD, Route.SKIP, Route.REFUSE] == [0, 1, 2]
    assert issubclass(UnservableBatchError, ValueError)


@SETTINGS
@given(slot=slots_st, active=st.integers(-1, 9), has=st.booleans())
def test_resolve_python_ints_give_route(slot, active, has):
    got = jm.resolve_moe_lora_route(slot, active, has)
    assert type(got) is Route
    assert got == spec_route(slot, active, has)
    # NumPy scalars behave as Python ints
    assert jm.resolve_moe_lora_route(np.int64(slot), np.int32(active), np.bool_(has)) == got


def test_resolve_each_rule():
    rng = np.random.default_rng(0)
    active = int(rng.integers(1, 8))
    other = active + int(rng.integers(1, 5))
    assert jm.resolve_moe_lora_route(other, active, False) is Route.FOLD
    assert jm.resolve_moe_lora_route(-int(rng.integers(1, 5)), active, True) is Route.SKIP
    assert jm.resolve_moe_lora_route(active, active, True) is Route.FOLD
    assert jm.resolve_moe_lora_route(other, active, True) is Route.REFUSE
    assert jm.resolve_moe_lora_route(0, -1, True) is Route.REFUSE


@SETTINGS
@given(slots=st.lists(slots_st, min_size=1, max_size=12), active=st.integers(-1, 9),
       has=st.booleans())
def test_resolve_arrays_elementwise_and_jit(slots, active, has):
    want = np.array([spec_route(s, active, has) for s in slots], np.int32)
    eager = jm.resolve_moe_lora_route(np.array(slots), active, has)
    assert isinstance(eager, jax.Array) and eager.dtype == jnp.int32
    np.testing.assert_array_equal(eager, want)
    traced = jax.jit(jm.resolve_moe_lora_route)(jnp.array(slots, jnp.int32), jnp.int32(active),
                                                jnp.bool_(has))
    np.testing.assert_array_equal(traced, want)


def test_resolve_keeps_shape():
    rng = np.random.default_rng(1)
    slots = rng.integers(-2, 5, size=(3, 4))
    got = jm.resolve_moe_lora_route(slots, 2, True)
    assert got.shape == (3, 4)
    want = np.vectorize(lambda s: int(spec_route(int(s), 2, True)))(slots)
    np.testing.assert_array_equal(got, want)


def test_resolve_no_host_callback():
    assert_pure_device(jm.resolve_moe_lora_route, jnp.array([3, -1, 0], jnp.int32), jnp.int32(3),
                       jnp.bool_(True))


@pytest.mark.parametrize("slot, active, has, err", [
    (1.0, 1, True, TypeError),                       # float slot
    (True, 1, True, TypeError),                      # bool slot
    (np.array([1.5, 2.0]), 1, True, TypeError),      # float array
    (np.array([1, 2]), 1, 1, TypeError),             # has_moe_lora not bool
    (np.array([1, 2]), 1.0, True, TypeError),        # float active
    (np.array([1, 2]), np.array([1, 2]), True, ValueError),   # active not scalar
    (np.array([1, 2]), 1, np.array([True, False]), ValueError),  # has not scalar
    (np.array([2**40]), 1, True, ValueError),        # outside int32
    (jnp.array([1.0]), 1, True, TypeError),          # float jax array
])
def test_resolve_invalid(slot, active, has, err):
    with pytest.raises(err):
        jm.resolve_moe_lora_route(slot, active, has)


# --------------------------------------------------------------------------
# multi-adapter form
# --------------------------------------------------------------------------

installed_st = st.lists(st.booleans(), min_size=0, max_size=8)


@SETTINGS
@given(slot=slots_st, installed=installed_st, has=st.booleans())
def test_resolve_multi_python(slot, installed, has):
    got = jm.resolve_moe_lora_route_multi(slot, installed, has)
    assert type(got) is Route
    assert got == spec_route_multi(slot, installed, has)
    assert jm.resolve_moe_lora_route_multi(slot, np.array(installed, bool), has) == got


@SETTINGS
@given(slots=st.lists(slots_st, min_size=1, max_size=12), installed=installed_st,
       has=st.booleans())
def test_resolve_multi_arrays_and_jit(slots, installed, has):
    want = np.array([spec_route_multi(s, installed, has) for s in slots], np.int32)
    inst = np.array(installed, bool)
    eager = jm.resolve_moe_lora_route_multi(np.array(slots), inst, has)
    assert eager.dtype == jnp.int32
    np.testing.assert_array_equal(eager, want)
    traced = jax.jit(jm.resolve_moe_lora_route_multi)(jnp.array(slots, jnp.int32),
                                                      jnp.asarray(inst), jnp.bool_(has))
    np.testing.assert_array_equal(traced, want)


def test_resolve_multi_default_has_moe_lora_and_out_of_range():
    rng = np.random.default_rng(2)
    inst = rng.random(6) < 0.5
    inst[0], inst[1] = True, False
    assert jm.resolve_moe_lora_route_multi(0, inst) is Route.FOLD
    assert jm.resolve_moe_lora_route_multi(1, inst) is Route.REFUSE
    assert jm.resolve_moe_lora_route_multi(6 + int(rng.integers(0, 4)), inst) is Route.REFUSE
    assert jm.resolve_moe_lora_route_multi(-1, inst) is Route.SKIP
    # a concrete jax `installed` gives an array
    got = jm.resolve_moe_lora_route_multi(0, jnp.asarray(inst))
    assert isinstance(got, jax.Array) and int(got) == Route.FOLD


def test_resolve_multi_no_host_callback():
    assert_pure_device(jm.resolve_moe_lora_route_multi, jnp.array([3, -1, 0], jnp.int32),
                       jnp.array([True, False, True]), jnp.bool_(True))


@pytest.mark.parametrize("slot, installed, has, err", [
    (1, [1, 0], True, TypeError),                    # installed not bool
    (1, [[True], [False]], True, ValueError),        # installed 2-D
    (np.array([1]), np.array([[True]]), True, ValueError),
    (np.array([1]), np.array([1, 0]), True, TypeError),
    (1.5, [True], True, TypeError),
    (np.array([1]), [True], 1, TypeError),
])
def test_resolve_multi_invalid(slot, installed, has, err):
    with pytest.raises(err):
        jm.resolve_moe_lora_route_multi(slot, installed, has)


# --------------------------------------------------------------------------
# refusing a batch
# --------------------------------------------------------------------------

def test_ensure_servable_raises_on_refuse_and_names_path():
    path = f"decode_batch_{np.random.default_rng(3).integers(1000)}"
    with pytest.raises(UnservableBatchError) as info:
        jm.ensure_decode_route_servable(Route.REFUSE, path)
    msg = str(info.value)
    assert path in msg and "non-active adapter" in msg
    assert info.value.path == path and info.value.refused == 1
    with pytest.raises(ValueError):  # an UnservableBatchError is a ValueError
        jm.ensure_decode_route_servable(int(Route.REFUSE), path)


@pytest.mark.parametrize("route", [Route.FOLD, Route.SKIP, 0, 1, np.int32(1)])
def test_ensure_servable_passes_fold_and_skip(route):
    assert jm.ensure_decode_route_servable(route, "p") is None


@SETTINGS
@given(routes=st.lists(st.sampled_from(list(Route)), min_size=1, max_size=10),
       as_jax=st.booleans())
def test_ensure_servable_arrays(routes, as_jax):
    arr = np.array(routes, np.int32)
    arr = jnp.asarray(arr) if as_jax else arr
    refused = routes.count(Route.REFUSE)
    if refused:
        with pytest.raises(UnservableBatchError) as info:
            jm.ensure_decode_route_servable(arr, "mixed_forward")
        assert info.value.refused == refused and "mixed_forward" in str(info.value)
    else:
        jm.ensure_decode_route_servable(arr, "mixed_forward")


@pytest.mark.parametrize("route, path, err", [
    (3, "p", ValueError),                     # not a Route value
    (-1, "p", ValueError),
    (np.array([0, 7]), "p", ValueError),
    (True, "p", TypeError),
    (np.array([0.0, 2.0]), "p", TypeError),
    (Route.FOLD, 5, TypeError),               # path not a str
])
def test_ensure_servable_invalid(route, path, err):
    with pytest.raises(err):
        jm.ensure_decode_route_servable(route, path)


def test_ensure_servable_refuses_tracers():
    def f(r):
        jm.ensure_decode_route_servable(r, "p")
        return r

    with pytest.raises(TypeError, match="checkify"):
        jax.jit(f)(jnp.array([0, 1], jnp.int32))


def _routes(rng, n, refuse: bool):
    r = rng.integers(0, 2, size=n).astype(np.int32)
    if refuse:
        r[rng.integers(0, n, size=max(1, n // 3))] = Route.REFUSE
    return r


@pytest.mark.parametrize("refuse", [False, True])
def test_device_flag(refuse):
    rng = np.random.default_rng(4 + refuse)
    r = _routes(rng, 9, refuse)
    flag = jax.jit(jm.decode_route_servable)(jnp.asarray(r))
    assert flag.dtype == jnp.bool_ and bool(flag) == (not refuse)
    assert_pure_device(jm.decode_route_servable, jnp.asarray(r))


@pytest.mark.parametrize("refuse", [False, True])
def test_checkify_variant_in_jit(refuse):
    rng = np.random.default_rng(6 + refuse)
    r = _routes(rng, 11, refuse)
    path = "decode {step}"  # braces must not be taken as format fields

    def step(routes):
        jm.checkify_decode_route_servable(routes, path)
        return routes + 1

    checked = checkify.checkify(jax.jit(step))
    err, out = checked(jnp.asarray(r))
    np.testing.assert_array_equal(out, r + 1)
    if refuse:
        msg = err.get()
        assert msg is not None and path in msg and "non-active adapter" in msg
        assert str(int(np.count_nonzero(r == Route.REFUSE))) in msg
        with pytest.raises(Exception, match="non-active adapter"):
            err.throw()
    else:
        assert err.get() is None
        err.throw()
    # the functionalized check adds no host callback
    assert_pure_device(checkify.checkify(step), jnp.asarray(r))


def test_checkify_variant_invalid_path():
    with pytest.raises(TypeError):
        jm.checkify_decode_route_servable(jnp.array([0]), None)


# --------------------------------------------------------------------------
# prefill map (host)
# --------------------------------------------------------------------------

@st.composite
def prefill_batch(draw, valid_only=False):
    lengths = draw(st.lists(st.integers(0, 6), min_size=1, max_size=6))
    cu = [0] + list(np.cumsum(lengths).tolist())
    slots = draw(st.lists(slots_st, min_size=len(lengths), max_size=len(lengths)))
    if not valid_only:
        kind = draw(st.sampled_from(["ok", "ok", "first", "decrease", "negative", "short_slots",
                                     "long_slots", "one_boundary"]))
        if kind == "first":
            cu[0] = draw(st.integers(1, 3))
        elif kind == "decrease" and len(cu) > 2:
            i = draw(st.integers(1, len(cu) - 2))
            cu[i] = cu[i + 1] + draw(st.integers(1, 4))
        elif kind == "negative":
            cu[draw(st.integers(1, len(cu) - 1))] = -draw(st.integers(1, 4))
        elif kind == "short_slots":
            slots = slots[:-1]
        elif kind == "long_slots":
            slots = slots + [draw(slots_st)]
        elif kind == "one_boundary":
            cu = cu[:1]
    return cu, slots


@SETTINGS
@given(batch=prefill_batch())
def test_host_map_matches_the_spec_loop(batch):
    cu, slots = batch
    got = jm.build_moe_row_adapter_host(cu, slots)
    want = spec_host_map(cu, slots)
    if want is None:
        assert got is None
    else:
        assert isinstance(got, np.ndarray) and got.dtype == np.int32
        np.testing.assert_array_equal(got, np.array(want, np.int32).reshape(-1))


def test_host_map_none_cases():
    rng = np.random.default_rng(8)
    s = [int(v) for v in rng.integers(0, 5, size=3)]
    assert jm.build_moe_row_adapter_host([], []) is None
    assert jm.build_moe_row_adapter_host([0], []) is None
    assert jm.build_moe_row_adapter_host([0, 2, 5, 9], s[:2]) is None       # too few slots
    assert jm.build_moe_row_adapter_host([0, 2, 5], s) is None              # too many slots
    assert jm.build_moe_row_adapter_host([1, 2, 5, 9], s) is None           # first != 0
    assert jm.build_moe_row_adapter_host([0, 4, 2], s[:2]) is None          # decreasing
    assert jm.build_moe_row_adapter_host([0, -3, 2], s[:2]) is None         # negative
    # a later decrease is seen before the map is sized from the last boundary
    assert jm.build_moe_row_adapter_host([0, 6, 3, 8], s) is None


def test_host_map_empty_streams_and_numpy_input():
    rng = np.random.default_rng(9)
    slots = rng.integers(-1, 6, size=4)
    cu = np.array([0, 3, 3, 5, 5])
    got = jm.build_moe_row_adapter_host(cu, slots)
    np.testing.assert_array_equal(got, [slots[0]] * 3 + [slots[2]] * 2)
    assert jm.build_moe_row_adapter_host([0, 0], [int(slots[0])]).shape == (0,)


@pytest.mark.parametrize("cu, slots, err", [
    ([0.0, 2.0], [1], TypeError),
    ([0, 2], [1.5], TypeError),
    ([0, 2], [True], TypeError),
    (3, [1], TypeError),
    ([[0, 2]], [1], ValueError),
    ([0, 2], [[1]], ValueError),
    ([0, 2], [2**40], ValueError),
])
def test_host_map_invalid(cu, slots, err):
    with pytest.raises(err):
        jm.build_moe_row_adapter_host(cu, slots)


def test_host_map_refuses_tracers():
    with pytest.raises(TypeError, match="build_moe_row_adapter"):
        jax.jit(lambda c: jm.build_moe_row_adapter_host(c, [1]))(jnp.array([0, 2]))


# --------------------------------------------------------------------------
# prefill map (traced twin)
# --------------------------------------------------------------------------

def check_twin(cu, slots, num_tokens, got_map, got_valid):
    host = jm.build_moe_row_adapter_host(cu, slots)
    fits = host is not None and host.shape[0] <= num_tokens
    assert got_map.shape == (num_tokens,) and got_map.dtype == jnp.int32
    assert got_valid.dtype == jnp.bool_ and bool(got_valid) == fits
    want = np.full(num_tokens, -1, np.int32)
    if fits:
        want[: host.shape[0]] = host
    np.testing.assert_array_equal(got_map, want)


@SETTINGS
@given(batch=prefill_batch(), extra=st.integers(-3, 5))
def test_traced_map_agrees_with_host_under_jit(batch, extra):
    cu, slots = batch
    num_tokens = max(0, max(cu) + extra)
    fn = jax.jit(jm.build_moe_row_adapter, static_argnums=2)
    m, v = fn(jnp.array(cu, jnp.int32), jnp.array(slots, jnp.int32).reshape(-1), num_tokens)
    check_twin(cu, slots, num_tokens, m, v)
    # the same on host inputs, eagerly
    m2, v2 = jm.build_moe_row_adapter(cu, slots, num_tokens)
    check_twin(cu, slots, num_tokens, m2, v2)


def test_traced_map_compiles_once_and_has_no_callback():
    rng = np.random.default_rng(10)
    batch, num_tokens = 5, 40
    traces = []

    def f(cu, slots):
        traces.append(1)
        return jm.build_moe_row_adapter(cu, slots, num_tokens)

    jf = jax.jit(f)
    for _ in range(6):
        lengths = rng.integers(0, 9, size=batch)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        if rng.random() < 0.3:
            cu[rng.integers(1, batch)] -= 9
        slots = rng.integers(-2, 8, size=batch).astype(np.int32)
        m, v = jf(jnp.asarray(cu), jnp.asarray(slots))
        check_twin(cu.tolist(), slots.tolist(), num_tokens, m, v)
    assert len(traces) == 1
    assert_pure_device(f, jnp.asarray(cu), jnp.asarray(slots))


def test_traced_map_overflow_is_invalid():
    rng = np.random.default_rng(11)
    lengths = rng.integers(2, 6, size=3)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    m, v = jm.build_moe_row_adapter(cu, rng.integers(0, 4, size=3), int(cu[-1]) - 1)
    assert not bool(v) and bool(jnp.all(m == -1))


@pytest.mark.parametrize("cu, slots, n, err", [
    ([0, 2], [1], -1, ValueError),
    ([0, 2], [1], 2.0, TypeError),
    ([0, 2], [1], True, TypeError),
    ([0.0, 2.0], [1], 4, TypeError),
    ([0, 2], [1.0], 4, TypeError),
    ([[0, 2]], [1], 4, ValueError),
])
def test_traced_map_invalid(cu, slots, n, err):
    with pytest.raises(err):
        jm.build_moe_row_adapter(cu, slots, n)


# --------------------------------------------------------------------------
# decode maps
# --------------------------------------------------------------------------

def spec_decode(slots, padded_n, active, has):
    out = []
    for i in range(padded_n):
        if i < len(slots) and spec_route(slots[i], active, has) == Route.FOLD:
            out.append(active)
        else:
            out.append(-1)
    return out


def spec_decode_multi(slots, padded_n, installed, has):
    out = []
    for i in range(padded_n):
        if i < len(slots) and spec_route_multi(slots[i], installed, has) == Route.FOLD:
            out.append(slots[i])
        else:
            out.append(-1)
    return out


@SETTINGS
@given(slots=st.lists(slots_st, min_size=0, max_size=8), pad=st.integers(0, 4),
       active=st.integers(-1, 9), has=st.booleans())
def test_decode_map_matches_the_spec_loop_under_jit(slots, pad, active, has):
    if not has:
        active = -1  # the convention: no MoE LoRA means no active adapter
    padded_n = len(slots) + pad
    want = spec_decode(slots, padded_n, active, has)
    fn = jax.jit(jm.build_moe_row_adapter_decode, static_argnums=1)
    got = fn(jnp.array(slots, jnp.int32), padded_n, jnp.int32(active), jnp.bool_(has))
    assert got.shape == (padded_n,) and got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(jm.build_moe_row_adapter_decode(slots, padded_n, active, has),
                                  want)
    if not has:
        assert all(v == -1 for v in want)


def test_decode_map_each_row_kind():
    rng = np.random.default_rng(12)
    active = int(rng.integers(1, 6))
    slots = [active, -1, active + 1, active]
    got = jm.build_moe_row_adapter_decode(slots, 6, active, True)
    # FOLD rows carry active; SKIP, REFUSE and padding are -1
    np.testing.assert_array_equal(got, [active, -1, -1, active, -1, -1])


@SETTINGS
@given(slots=st.lists(slots_st, min_size=0, max_size=8), pad=st.integers(0, 4),
       installed=installed_st, has=st.booleans())
def test_decode_map_multi_matches_spec_under_jit(slots, pad, installed, has):
    padded_n = len(slots) + pad
    want = spec_decode_multi(slots, padded_n, installed, has)
    fn = jax.jit(jm.build_moe_row_adapter_decode_multi, static_argnums=1)
    got = fn(jnp.array(slots, jnp.int32), padded_n, jnp.array(installed, jnp.bool_),
             jnp.bool_(has))
    assert got.shape == (padded_n,) and got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        jm.build_moe_row_adapter_decode_multi(slots, padded_n, installed, has), want)


def test_decode_maps_compile_once_no_callback():
    rng = np.random.default_rng(13)
    traces = []

    def f(slots, active, installed):
        traces.append(1)
        return (jm.build_moe_row_adapter_decode(slots, 16, active, True),
                jm.build_moe_row_adapter_decode_multi(slots, 16, installed))

    jf = jax.jit(f)
    for _ in range(5):
        slots = rng.integers(-1, 6, size=12).astype(np.int32)
        active = np.int32(rng.integers(0, 6))
        inst = rng.random(6) < 0.6
        single, multi = jf(jnp.asarray(slots), jnp.asarray(active), jnp.asarray(inst))
        np.testing.assert_array_equal(single, spec_decode(slots.tolist(), 16, int(active), True))
        np.testing.assert_array_equal(multi, spec_decode_multi(slots.tolist(), 16, inst.tolist(),
                                                               True))
    assert len(traces) == 1
    assert_pure_device(f, jnp.asarray(slots), jnp.asarray(active), jnp.asarray(inst))


@pytest.mark.parametrize("slots, padded_n, err", [
    ([1, 2, 3], 2, ValueError),        # more sequences than rows
    ([1, 2], -1, ValueError),
    ([1, 2], 4.0, TypeError),
    ([1.0, 2.0], 4, TypeError),
    ([[1, 2]], 4, ValueError),
])
def test_decode_map_invalid(slots, padded_n, err):
    with pytest.raises(err):
        jm.build_moe_row_adapter_decode(slots, padded_n, 1, True)
    with pytest.raises(err):
        jm.build_moe_row_adapter_decode_multi(slots, padded_n, [True, True])


def test_decode_map_invalid_active_and_installed():
    with pytest.raises(ValueError):
        jm.build_moe_row_adapter_decode([1], 2, np.array([1, 2]), True)
    with pytest.raises(TypeError):
        jm.build_moe_row_adapter_decode([1], 2, 1, "yes")
    with pytest.raises(TypeError):
        jm.build_moe_row_adapter_decode_multi([1], 2, [1, 0])


def test_callback_detector_catches_callbacks():
    """The purity check above is able to fail."""
    def noisy(x):
        jax.debug.print("{}", x)
        return x + 1

    def host(x):
        return jax.pure_callback(lambda v: np.asarray(v) + 1, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    for fn in (noisy, host):
        with pytest.raises(AssertionError):
            assert_pure_device(fn, jnp.arange(3, dtype=jnp.int32))
