"""``jax.ffi.ffi_call`` wrappers of the two custom calls (C++ on cpu, CUDA on
GPU; one target name per op). Inputs are validated by ``folds.py``; the
operand and attribute layout is documented in ``ffi_src/moelora_handlers.h``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moelora import _ext
from jax_moelora.tables import MoeExpertRoute

__all__ = ["gather_bgmv_ffi", "grouped_down_ffi", "VARIANTS"]

VARIANTS = {"seed": _ext.VARIANT_SEED, "fast": _ext.VARIANT_FAST, "cpu": _ext.VARIANT_SEED}


def _optional_operand(v):
    """An optional int32 operand and its ``has_*`` attribute (``[1]`` zeros when absent)."""
    if v is None:
        return jnp.zeros((1,), jnp.int32), 0
    return v, 1


def _call(target, base_out, route: MoeExpertRoute, operands, rows: int, **attrs):
    """The custom call; ``rows``: the folded rows, one row of the xa scratch each."""
    _ext.register()
    out_types = (jax.ShapeDtypeStruct(base_out.shape, base_out.dtype),
                 jax.ShapeDtypeStruct((rows, route.max_rank), base_out.dtype))
    # Batching is ops/batching.py's custom_vmap (one launch over the flattened
    # rows); "sequential" only backs a vmap that would bypass it.
    call = jax.ffi.ffi_call(target, out_types, input_output_aliases={1: 0},
                            vmap_method="sequential")
    out, _xa = call(*operands, route.a_pool, route.b_pool, route.a_table, route.b_table,
                    route.scale_table, **{k: np.int64(v) for k, v in attrs.items()})
    return out


def gather_bgmv_ffi(x, base_out, indices, route, row_adapter, *, top_k: int, x_gather: int,
                    impl: str):
    ra, has_ra = _optional_operand(row_adapter)
    return _call(_ext.GATHER_BGMV_TARGET, base_out, route,
                 (x, base_out, indices, ra), base_out.shape[0], top_k=top_k, x_gather=x_gather,
                 has_row_adapter=has_ra, variant=VARIANTS[impl])


def grouped_down_ffi(x, base_out, expert_offsets, sorted_token_ids, route, row_adapter,
                     out_rows=None, *, row_offset: int, row_end: int, x_gather: int, impl: str):
    ra, has_ra = _optional_operand(row_adapter)
    orows, has_orows = _optional_operand(out_rows)
    return _call(_ext.GROUPED_DOWN_TARGET, base_out, route,
                 (x, base_out, expert_offsets, sorted_token_ids, ra, orows),
                 sorted_token_ids.shape[0], row_offset=row_offset, row_end=row_end,
                 x_gather=x_gather, has_row_adapter=has_ra, has_out_rows=has_orows,
                 variant=VARIANTS[impl])
