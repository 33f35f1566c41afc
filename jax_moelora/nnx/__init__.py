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
  base weights into a block.
- ``reference``: the float64 NumPy reference of each family's block.

Train LoRA weights with ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``: every
fold backend is differentiable (a custom VJP whose backward is traced ``jnp``,
``ops/autodiff.py``).
"""

from jax_moelora._optional import needs_extra

with needs_extra("nnx", "jax_moelora.nnx"):
    import flax.nnx  # noqa: F401  (the modules below import it; fail here with the extra's name)

from jax_moelora.nnx.block import MoEBlock
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
    MoELoRARoutes,
    StackedExpertLoRA,
)
from jax_moelora.nnx.pool import AdapterPool
from jax_moelora.nnx.routers import Router, ScoreCorrectionBias, select_experts
from jax_moelora.nnx.weights import load_transformers_weights

__all__ = [
    "AdapterPool",
    "AdapterTable",
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
    "MoELoRARoutes",
    "Qwen3MoE",
    "Router",
    "SHARED_PROJECTIONS",
    "ScoreCorrectionBias",
    "SharedExperts",
    "StackedExpertLoRA",
    "family_config",
    "load_transformers_weights",
    "select_experts",
]
