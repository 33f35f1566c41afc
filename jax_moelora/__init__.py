"""jax_moelora: many LoRA adapters on Mixture-of-Experts models in JAX.

Folds per-expert LoRA deltas into MoE expert outputs with XLA FFI custom
calls (C++ on CPU, CUDA on GPU), with routing and table packing in traced
``jnp`` so a whole decode step compiles into one static XLA program.
"""

from jax_moelora._ext import backends
from jax_moelora.geometry import (
    MLG_M_TILE,
    gather_bgmv_grids,
    gather_row_token,
    grouped_down_wc,
    grouped_down_windows,
    padded_rank,
)
from jax_moelora.ops import (
    moe_lora_fold,
    moe_lora_gather_bgmv,
    moe_lora_grouped_down,
    sort_rows_by_expert,
)
from jax_moelora.tables import MoeExpertRoute

__version__ = "0.1.0"

__all__ = [
    "MLG_M_TILE",
    "MoeExpertRoute",
    "backends",
    "gather_bgmv_grids",
    "gather_row_token",
    "grouped_down_wc",
    "grouped_down_windows",
    "moe_lora_fold",
    "moe_lora_gather_bgmv",
    "moe_lora_grouped_down",
    "padded_rank",
    "sort_rows_by_expert",
]
