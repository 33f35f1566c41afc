"""jax_moelora: many LoRA adapters on Mixture-of-Experts models in JAX.

Folds per-expert LoRA deltas into MoE expert outputs with XLA FFI custom
calls (C++ on CPU, CUDA on GPU), with routing and table packing in traced
``jnp`` so a whole decode step compiles into one static XLA program.
"""

from jax_moelora.ops.backend import backends
from jax_moelora.geometry import (
    MLG_M_TILE,
    gather_bgmv_grids,
    gather_row_token,
    grouped_down_wc,
    grouped_down_windows,
    padded_rank,
)
from jax_moelora.ops import (
    LoraInGemmPack,
    expert_matmul,
    moe_lora_fold,
    moe_lora_gather_bgmv,
    moe_lora_grouped_down,
    pack_lora_in_gemm,
    sort_rows_by_expert,
)
from jax_moelora.ops.stacked import StackedRoute, stack_routes
from jax_moelora.ops.sharding import (
    moe_lora_fold_data_parallel,
    moe_lora_fold_expert_parallel,
    moe_lora_fold_tensor_parallel,
    shard_expert_parallel,
    shard_tensor_parallel,
)
from jax_moelora.routing import (
    Route,
    UnservableBatchError,
    build_moe_row_adapter,
    build_moe_row_adapter_decode,
    build_moe_row_adapter_decode_multi,
    build_moe_row_adapter_host,
    checkify_decode_route_servable,
    decode_route_servable,
    ensure_decode_route_servable,
    resolve_moe_lora_route,
    resolve_moe_lora_route_multi,
)
from jax_moelora.tables import (
    ExpertTables,
    MoeExpertRoute,
    pack_expert_tables,
    pack_expert_tables_traced,
    route_from_dense,
    router_route,
)

__version__ = "0.1.0"

__all__ = [
    "LoraInGemmPack",
    "StackedRoute",
    "stack_routes",
    "ExpertTables",
    "MLG_M_TILE",
    "MoeExpertRoute",
    "Route",
    "UnservableBatchError",
    "build_moe_row_adapter",
    "build_moe_row_adapter_decode",
    "build_moe_row_adapter_decode_multi",
    "build_moe_row_adapter_host",
    "checkify_decode_route_servable",
    "decode_route_servable",
    "ensure_decode_route_servable",
    "pack_expert_tables",
    "pack_expert_tables_traced",
    "resolve_moe_lora_route",
    "resolve_moe_lora_route_multi",
    "route_from_dense",
    "router_route",
    "backends",
    "expert_matmul",
    "gather_bgmv_grids",
    "gather_row_token",
    "grouped_down_wc",
    "grouped_down_windows",
    "moe_lora_fold",
    "moe_lora_fold_data_parallel",
    "moe_lora_fold_expert_parallel",
    "moe_lora_fold_tensor_parallel",
    "moe_lora_gather_bgmv",
    "moe_lora_grouped_down",
    "pack_lora_in_gemm",
    "padded_rank",
    "shard_expert_parallel",
    "shard_tensor_parallel",
    "sort_rows_by_expert",
]
