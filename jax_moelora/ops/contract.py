"""The contract for malformed routing metadata (docs/malformed_metadata.md).

Two halves, both traced ``jnp`` (no host sync):

- the skip rule every backend applies (``offsets_well_formed``): a grouped
  fold whose ``expert_offsets`` are not well formed folds no row;
- the opt-in checked mode (``validate=True`` on the public folds):
  ``jax.experimental.checkify.check`` calls that turn each breach of the
  contract into an error instead of the documented skip. Eagerly they raise
  ``checkify.JaxRuntimeError`` at once; under ``jit`` wrap the caller in
  ``checkify.checkify`` (``errors`` including ``checkify.user_checks``) and
  call ``err.throw()``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from jax_moelora.tables import MoeExpertRoute

__all__ = ["offsets_well_formed", "check_route_tables", "check_gather_metadata",
           "check_grouped_metadata"]


def offsets_well_formed(expert_offsets: jax.Array, te: int) -> jax.Array:
    """Bool scalar: ``0 <= o[0] <= o[1] <= ... <= o[-1] <= te``.

    ``expert_offsets``: int32 ``[num_experts + 1]``; ``te``: static number of
    sorted rows. The twin of ``offsets_well_formed`` in ``ffi_src/fold_common.h``.
    """
    o = expert_offsets
    return (o[0] >= 0) & jnp.all(o[1:] >= o[:-1]) & (o[-1] <= te)


def check_route_tables(fn: str, route: MoeExpertRoute) -> None:
    """Every ``a_table``/``b_table`` cell is a pool slot in ``[0, P)``."""
    P = route.pool_size
    for name in ("a_table", "b_table"):
        t = getattr(route, name)
        bad = jnp.sum((t < 0) | (t >= P))
        checkify.check(bad == 0, f"{fn}: route.{name} has {{bad}} cells outside the pool "
                                 f"[0, {P})", bad=bad)


def check_gather_metadata(fn: str, route: MoeExpertRoute) -> None:
    """The checked mode of the gather fold (its ids and adapters skip by rule)."""
    check_route_tables(fn, route)


def check_grouped_metadata(fn: str, expert_offsets: jax.Array, sorted_token_ids: jax.Array,
                           route: MoeExpertRoute, *, num_tokens: int | None, row_offset: int,
                           row_end: int) -> None:
    """The checked mode of the grouped fold.

    ``num_tokens``: the bound on ``sorted_token_ids`` values where they are
    read (``x``'s rows with ``x_gather=1``, else the row-adapter map's
    length), ``None`` when they are not read.
    """
    te = sorted_token_ids.shape[0]
    o = expert_offsets
    checkify.check(offsets_well_formed(o, te),
                   f"{fn}: expert_offsets must satisfy 0 <= o[0] <= ... <= o[-1] <= te = {te}; "
                   "got o[0] = {first}, o[-1] = {last}, {drops} decreasing steps",
                   first=o[0], last=o[-1], drops=jnp.sum(o[1:] < o[:-1]))
    if num_tokens is not None and row_end > row_offset:
        tok = sorted_token_ids[row_offset:row_end]
        bad = (tok < 0) | (tok >= num_tokens)
        first = jnp.argmax(bad).astype(jnp.int32) + row_offset
        checkify.check(~jnp.any(bad),
                       f"{fn}: sorted_token_ids must be in [0, {num_tokens}) inside the window "
                       f"[{row_offset}, {row_end}); row {{row}} holds {{tok}}",
                       row=first, tok=sorted_token_ids[first])
    check_route_tables(fn, route)
