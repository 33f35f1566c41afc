"""MoE LoRA fold ops: validation, backends and custom calls."""

from jax_moelora.ops.folds import (
    GATHER_MAX_ROWS,
    IMPLS,
    moe_lora_fold,
    moe_lora_gather_bgmv,
    moe_lora_grouped_down,
    resolve_impl,
    sort_rows_by_expert,
)

__all__ = [
    "GATHER_MAX_ROWS",
    "IMPLS",
    "moe_lora_fold",
    "moe_lora_gather_bgmv",
    "moe_lora_grouped_down",
    "resolve_impl",
    "sort_rows_by_expert",
]
