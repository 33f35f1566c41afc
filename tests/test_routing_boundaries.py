"""Explicit boundary cases of the routing helpers (docs/semantics.md §2).

Every helper is checked at the edges of its ranges, on the host path and on
the traced path (under ``jit``), with inputs chosen so that an off-by-one
changes the answer: e.g. ``installed`` all True, so that counting
``slot == len(installed)`` as installed would FOLD instead of REFUSE.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moelora as jm
from jax_moelora import Route

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
FOLD, SKIP, REFUSE = int(Route.FOLD), int(Route.SKIP), int(Route.REFUSE)


def _multi_traced(slots, installed, has=True):
    fn = jax.jit(lambda s, i, h: jm.resolve_moe_lora_route_multi(s, i, h))
    return np.asarray(fn(jnp.asarray(slots, jnp.int32), jnp.asarray(installed, jnp.bool_),
                         jnp.bool_(has))).tolist()


N = 4
ALL = [True] * N
# (slot, installed, want): the edges of [0, len(installed)) and of int32
MULTI_CASES = [
    (N - 1, ALL, FOLD),             # last slot
    (N, ALL, REFUSE),               # one past the end, though every slot is installed
    (N + 1, ALL, REFUSE),
    (I32_MAX, ALL, REFUSE),
    (0, ALL, FOLD),
    (-1, ALL, SKIP),
    (I32_MIN, ALL, SKIP),
    (N - 1, [True, True, True, False], REFUSE),
    (0, [False, True, True, True], REFUSE),
]


@pytest.mark.parametrize("slot, installed, want", MULTI_CASES)
def test_resolve_multi_edges_host(slot, installed, want):
    assert jm.resolve_moe_lora_route_multi(slot, installed, True) == want


@pytest.mark.parametrize("slot, installed, want", MULTI_CASES)
def test_resolve_multi_edges_traced(slot, installed, want):
    assert _multi_traced([slot], installed) == [want]


def test_resolve_multi_traced_vector_around_the_end():
    got = _multi_traced([N - 2, N - 1, N, N + 1, -1], ALL)
    assert got == [FOLD, FOLD, REFUSE, REFUSE, SKIP]


def test_resolve_multi_one_slot_installed_list():
    assert _multi_traced([0, 1, -1], [True]) == [FOLD, REFUSE, SKIP]
    assert jm.resolve_moe_lora_route_multi(1, [True], True) == Route.REFUSE


def test_resolve_multi_no_moe_lora_folds_every_slot():
    assert _multi_traced([N, -1, 0], ALL, has=False) == [FOLD, FOLD, FOLD]


def test_resolve_single_active_edges():
    fn = jax.jit(lambda s, a, h: jm.resolve_moe_lora_route(s, a, h))
    slots = jnp.asarray([2, 1, 3, -1, 0, I32_MAX], jnp.int32)
    got = np.asarray(fn(slots, jnp.int32(2), jnp.bool_(True))).tolist()
    assert got == [FOLD, REFUSE, REFUSE, SKIP, REFUSE, REFUSE]
    for s, want in zip([2, 1, 3, -1, 0, I32_MAX], got):
        assert jm.resolve_moe_lora_route(s, 2, True) == want


def test_decode_map_padding_starts_exactly_at_the_batch_end():
    got = jax.jit(lambda s: jm.build_moe_row_adapter_decode_multi(s, 5, jnp.asarray(ALL)))(
        jnp.asarray([N - 1, N, -1], jnp.int32))
    assert np.asarray(got).tolist() == [N - 1, -1, -1, -1, -1]
    full = jm.build_moe_row_adapter_decode_multi(np.arange(N), N, ALL)
    assert np.asarray(full).tolist() == list(range(N))


def test_decode_map_single_active_edges():
    got = jm.build_moe_row_adapter_decode(np.array([1, 2, 1, -1]), 6, 1, True)
    assert np.asarray(got).tolist() == [1, -1, 1, -1, -1, -1]
    with pytest.raises(ValueError, match="more than padded_n=3"):
        jm.build_moe_row_adapter_decode(np.array([1, 1, 1, 1]), 3, 1, True)


@pytest.mark.parametrize("num_tokens, valid", [(6, True), (5, False), (7, True)])
def test_prefill_map_last_boundary_against_num_tokens(num_tokens, valid):
    m, ok = jax.jit(lambda c, s: jm.build_moe_row_adapter(c, s, num_tokens))(
        jnp.asarray([0, 2, 2, 6], jnp.int32), jnp.asarray([7, 8, 9], jnp.int32))
    assert bool(ok) is valid
    want = ([7, 7, 9, 9, 9, 9] + [-1] * (num_tokens - 6)) if valid else [-1] * num_tokens
    assert np.asarray(m).tolist() == want
    host = jm.build_moe_row_adapter_host([0, 2, 2, 6], [7, 8, 9])
    assert host.tolist() == [7, 7, 9, 9, 9, 9]
