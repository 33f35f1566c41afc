"""MoE LoRA fold ops and the grouped expert GEMM: validation, backends and custom calls."""

from jax_moelora.ops.expert_matmul import expert_matmul
from jax_moelora.ops.lora_pack import LoraInGemmPack, pack_lora_in_gemm
from jax_moelora.ops.folds import (
    GATHER_MAX_ROWS,
    GATHER_ROWS_PER_EXPERT,
    IMPLS,
    gather_rows_limit,
    moe_lora_fold,
    moe_lora_gather_bgmv,
    moe_lora_grouped_down,
    resolve_impl,
    sort_rows_by_expert,
)
from jax_moelora.ops.sharding import (
    moe_lora_fold_data_parallel,
    moe_lora_fold_expert_parallel,
    moe_lora_fold_tensor_parallel,
    shard_expert_parallel,
    shard_tensor_parallel,
)

__all__ = [
    "GATHER_MAX_ROWS",
    "GATHER_ROWS_PER_EXPERT",
    "IMPLS",
    "LoraInGemmPack",
    "expert_matmul",
    "gather_rows_limit",
    "moe_lora_fold",
    "moe_lora_fold_data_parallel",
    "moe_lora_fold_expert_parallel",
    "moe_lora_fold_tensor_parallel",
    "moe_lora_gather_bgmv",
    "moe_lora_grouped_down",
    "pack_lora_in_gemm",
    "resolve_impl",
    "shard_expert_parallel",
    "shard_tensor_parallel",
    "sort_rows_by_expert",
]
