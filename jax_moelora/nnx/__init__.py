"""Flax NNX modules: MoE blocks of several model families with per-token LoRA adapters.

- ``families``: one frozen config per family (:class:`Qwen3MoE`,
  :class:`Mixtral`, :class:`GptOss`, :class:`DeepSeekV2`, :class:`DeepSeekV3`).
- ``lora``: per-layer LoRA state (:class:`ExpertLoRA` pools and tables per
  projection, gate and up stacked in one :class:`StackedExpertLoRA`,
  :class:`MoELoRA` per layer).
- ``routers``: :class:`Router` (logits) and each family's choice of experts.
- ``experts``: the expert MLPs (:class:`GluExperts`, :class:`GptOssExperts`,
  :class:`SharedExperts`).
- ``block``: :class:`MoEBlock`, router -> experts -> weighted sum (+ shared
  experts), LoRA deltas folded by the library's folds with a per-token
  adapter id (``-1`` = base model).
- ``pool``: :class:`AdapterPool`, load, replace and unload adapters in a
  fixed-capacity pool without recompiling the model's step.
- ``weights``: :func:`load_transformers_weights`, a transformers MoE layer's
  base weights into a block (:func:`transformers_weights`, back).
- ``stack``: :class:`MoEStack`, layers of RMSNorm -> :class:`MoEBlock` ->
  residual on hidden states.
- ``export``: :func:`save_adapter_slot`, an adapter slot as it is now
  (trained) as a PEFT folder (:func:`slot_adapter`, as a ``PeftAdapter``).
- ``reference``: the float64 NumPy reference of each family's block.
- ``sharded``: :class:`MoEBlock` on a ``jax.sharding.Mesh`` (``mesh=`` and
  its expert, data and tensor axes, or :func:`shard_block`): experts and
  their adapters' pool slots split over devices, tokens dispatched to their
  experts' owners with an all-to-all, one ``shard_map`` per call.

Train LoRA weights with ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``, or
``nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))``, or ``nnx.split(model,
nnx.LoRAParam, ...)`` and ``jax.grad`` w.r.t. the LoRA state: every fold backend
is differentiable (custom VJPs, ``ops/autodiff.py``; on a Hopper GPU the
backward runs on grouped GEMM kernels); base weights and adapter tables are
outside the filter.
Tokens of several adapters train in one batch, each adapter on its own tokens
(``python -m jax_moelora train``).
"""

from jax_moelora._optional import needs_extra

with needs_extra("nnx", "jax_moelora.nnx"):
    import flax.nnx  # noqa: F401  (the modules below import it; fail here with the extra's name)

from jax_moelora.nnx.block import MoEBlock
from jax_moelora.nnx.export import save_adapter_slot, slot_adapter
from jax_moelora.nnx.experts import ExpertRows, GluExperts, GptOssExperts, SharedExperts
from jax_moelora.nnx.families import (
    FAMILIES,
    DeepSeekV2,
    DeepSeekV3,
    GptOss,
    Mixtral,
    MoEFamily,
    Qwen3MoE,
    family_config,
)
from jax_moelora.nnx.lora import (
    SHARED_PROJECTIONS,
    AdapterTable,
    ExpertLoRA,
    ExpertLoRAView,
    MoELoRA,
    MoELoRAPacks,
    MoELoRARoutes,
    StackedExpertLoRA,
)
from jax_moelora.nnx.pool import AdapterPool
from jax_moelora.nnx.routers import Router, ScoreCorrectionBias, select_experts
from jax_moelora.nnx.sharded import BlockSharding, block_partition_specs, shard_block
from jax_moelora.nnx.stack import MoEStack
from jax_moelora.nnx.weights import load_transformers_weights, transformers_weights

__all__ = [
    "AdapterPool",
    "AdapterTable",
    "BlockSharding",
    "DeepSeekV2",
    "DeepSeekV3",
    "ExpertLoRA",
    "ExpertLoRAView",
    "ExpertRows",
    "FAMILIES",
    "GluExperts",
    "GptOss",
    "GptOssExperts",
    "Mixtral",
    "MoEBlock",
    "MoEFamily",
    "MoELoRA",
    "MoELoRAPacks",
    "MoELoRARoutes",
    "MoEStack",
    "Qwen3MoE",
    "Router",
    "SHARED_PROJECTIONS",
    "ScoreCorrectionBias",
    "SharedExperts",
    "StackedExpertLoRA",
    "block_partition_specs",
    "family_config",
    "load_transformers_weights",
    "save_adapter_slot",
    "select_experts",
    "shard_block",
    "slot_adapter",
    "transformers_weights",
]
