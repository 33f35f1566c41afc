"""``jax.ffi.ffi_call`` wrappers of the two custom calls (C++ on cpu, CUDA on
GPU; one target name per op). Inputs are validated by ``folds.py``; the
operand and attribute layout is documented in ``ffi_src/moelora_handlers.h``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moelora import _ext
from jax_moelora.ops.backend import FFI_VARIANT
from jax_moelora.tables import MoeExpertRoute

__all__ = ["gather_bgmv_ffi", "grouped_down_ffi"]


def _optional_operand(v):
    """An optional int32 operand and its ``has_*`` attribute (``[1]`` zeros when absent)."""
    if v is None:
        return jnp.zeros((1,), jnp.int32), 0
    return v, 1


def _call(target, base_outs, route: MoeExpertRoute, operands, rows: int, pdl: bool, **attrs):
    """The custom call; ``base_outs``: the operands (indices into
    ``operands``) each result aliases, in result order; ``rows``: the rows of
    the xa result (the folded rows, twice them where the call keeps xa).
    Returns the folded results, then the xa result."""
    _ext.register()
    out_types = tuple(jax.ShapeDtypeStruct(operands[i].shape, operands[i].dtype)
                      for i in base_outs)
    out_types += (jax.ShapeDtypeStruct((rows, route.max_rank), operands[base_outs[0]].dtype),)
    # Batching is ops/batching.py's custom_vmap (one launch over the flattened
    # rows); "sequential" only backs a vmap that would bypass it.
    call = jax.ffi.ffi_call(target, out_types, vmap_method="sequential",
                            input_output_aliases={i: j for j, i in enumerate(base_outs)})
    outs = call(*operands, route.a_pool, route.b_pool, route.a_table, route.b_table,
                route.scale_table, pdl=np.int64(pdl),
                **{k: np.int64(v) for k, v in attrs.items()})
    return outs


def gather_bgmv_ffi(x, base_out, indices, route, row_adapter, *, top_k: int, x_gather: int,
                    impl: str, pdl: bool = True, base2=None, dense_tokens: int = 0,
                    dense_experts: int = 0, keep_xa: bool = False):
    """The gather custom call. Flat layout (``dense_tokens == 0``): returns
    ``base_out`` folded, or with ``keep_xa`` ``(base_out folded, xa)``: ``xa
    [n_slots, R]`` holds each folding row's ``round(x A^T)`` at its row (the
    rows that fold nothing hold no value). Dense expert layout
    (``ops/dense_fold.py``): returns ``(base_out, base2)`` folded (``base2``:
    the second member's ``[dense_experts * dense_tokens, N]``, or ``None``
    for one member)."""
    ra, has_ra = _optional_operand(row_adapter)
    b2 = base2 if base2 is not None else jnp.zeros((0, base_out.shape[1]), base_out.dtype)
    n_slots = indices.shape[0]
    out, out2, xa = _call(_ext.GATHER_BGMV_TARGET, (1, 2), route,
                          (x, base_out, b2, indices, ra), n_slots * (2 if keep_xa else 1),
                          top_k=top_k, pdl=pdl, x_gather=x_gather, has_row_adapter=has_ra,
                          dense_tokens=dense_tokens, dense_experts=dense_experts,
                          variant=FFI_VARIANT[impl], keep_xa=keep_xa)
    if keep_xa:
        return out, xa[:n_slots]
    if dense_tokens == 0:
        return out
    return out, (out2 if base2 is not None else None)


def grouped_down_ffi(x, base_out, expert_offsets, sorted_token_ids, route, row_adapter,
                     out_rows=None, *, row_offset: int, row_end: int, x_gather: int, impl: str,
                     pdl: bool = True):
    ra, has_ra = _optional_operand(row_adapter)
    orows, has_orows = _optional_operand(out_rows)
    out, _ = _call(_ext.GROUPED_DOWN_TARGET, (1,), route,
                   (x, base_out, expert_offsets, sorted_token_ids, ra, orows),
                   sorted_token_ids.shape[0], pdl=pdl, row_offset=row_offset, row_end=row_end,
                   x_gather=x_gather, has_row_adapter=has_ra, has_out_rows=has_orows,
                   variant=FFI_VARIANT[impl])
    return out
