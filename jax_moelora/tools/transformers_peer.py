"""The transformers + peft peer of a stack of :class:`MoEBlock`\\ s: the same MoE
layers in a transformers 5 model, a PEFT folder loaded into it by peft.

Needs ``torch``, ``transformers`` (>= 5: fused experts) and ``peft`` (>= 0.21),
none of which this package depends on: :func:`peer_missing` says what is
missing, and the rest raises ``ImportError`` without them.

- :func:`transformers_config`: a tiny transformers config of the family with
  the blocks' shapes and routing options (attention sublayers tiny and unused);
- :func:`transformers_model`: that model in float32 with every MoE layer's
  base weights set from the blocks (``nnx.transformers_weights``);
- :func:`peft_block_outputs`: each MoE layer's output, in that model with a
  PEFT folder loaded by ``PeftModel.from_pretrained``, on given inputs.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_moelora.nnx.block import MoEBlock
from jax_moelora.nnx.families import DeepSeekV2, DeepSeekV3, GptOss, Mixtral, MoEFamily, Qwen3MoE
from jax_moelora.nnx.weights import transformers_weights

__all__ = ["block_forward", "moe_module", "peer_missing", "peft_block_outputs",
           "transformers_config", "transformers_model"]


def peer_missing() -> str | None:
    """``None`` when torch, transformers >= 5 and peft >= 0.21 import, else why not."""
    for name in ("torch", "transformers", "peft"):
        try:
            importlib.import_module(name)
        except ImportError as err:
            return f"{name} is not installed ({err})"
    import peft
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return f"transformers {transformers.__version__} < 5 (no fused experts)"
    if tuple(int(v) for v in peft.__version__.split(".")[:2]) < (0, 21):
        return f"peft {peft.__version__} < 0.21"
    return None


def _family_config(family: MoEFamily, inter: int, experts: int,
                   top_k: int) -> tuple[str, dict[str, Any]]:
    """The config class name and its MoE keyword arguments."""
    if isinstance(family, Qwen3MoE):
        return "Qwen3MoeConfig", dict(
            intermediate_size=inter, moe_intermediate_size=inter, num_experts=experts,
            num_experts_per_tok=top_k, norm_topk_prob=family.norm_topk_prob,
            num_key_value_heads=1, head_dim=8)
    if isinstance(family, Mixtral):
        return "MixtralConfig", dict(intermediate_size=inter, num_local_experts=experts,
                                     num_experts_per_tok=top_k, num_key_value_heads=1,
                                     head_dim=8)
    if isinstance(family, GptOss):
        return "GptOssConfig", dict(intermediate_size=inter, num_local_experts=experts,
                                    num_experts_per_tok=top_k, swiglu_limit=family.limit,
                                    swiglu_alpha=family.alpha, num_key_value_heads=1,
                                    head_dim=8)
    if isinstance(family, (DeepSeekV2, DeepSeekV3)):
        kw = dict(intermediate_size=inter, moe_intermediate_size=inter, n_routed_experts=experts,
                  n_shared_experts=family.n_shared, num_experts_per_tok=top_k,
                  first_k_dense_replace=0, n_group=family.n_group,
                  topk_group=family.topk_group, norm_topk_prob=family.norm_topk_prob,
                  routed_scaling_factor=family.routed_scaling_factor, num_key_value_heads=2,
                  kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
        if isinstance(family, DeepSeekV2):
            return "DeepseekV2Config", dict(kw, q_lora_rank=None, topk_method=family.topk_method)
        return "DeepseekV3Config", dict(kw, q_lora_rank=8)
    raise ValueError(f"family: no transformers peer for {family!r}")


def transformers_config(family: MoEFamily, *, hidden: int, inter: int, experts: int,
                        top_k: int, layers: int) -> Any:
    """A transformers 5 config of ``family`` whose ``layers`` decoder layers
    all hold an MoE block of these shapes (vocabulary and attention tiny: only
    the MoE blocks are run)."""
    import transformers

    name, kw = _family_config(family, inter, experts, top_k)
    return getattr(transformers, name)(vocab_size=32, hidden_size=hidden,
                                       num_hidden_layers=layers, num_attention_heads=2,
                                       **kw)


def moe_module(model: Any, layer: int) -> Any:
    """The MoE module of decoder layer ``layer`` (of a peft model's base model too)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model.model.layers[layer].mlp


def transformers_model(blocks: Sequence[MoEBlock]) -> Any:
    """A float32 transformers model of the blocks' family whose MoE layer ``i``
    has ``blocks[i]``'s base weights (every other weight random)."""
    import torch
    import transformers

    b0 = blocks[0]
    config = transformers_config(b0.family, hidden=b0.hidden_size, inter=b0.intermediate_size,
                                 experts=b0.num_experts, top_k=b0.top_k, layers=len(blocks))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    state = model.state_dict()
    tensors = {}
    for i, block in enumerate(blocks):
        tensors |= transformers_weights(block, f"model.layers.{i}.mlp.")
    for key, value in tensors.items():
        if key not in state or tuple(state[key].shape) != value.shape:
            found = tuple(state[key].shape) if key in state else "no such tensor"
            raise ValueError(f"transformers_model: {key} {value.shape} does not fit the "
                             f"{type(model).__name__}: {found}")
        state[key] = torch.from_numpy(np.array(value, np.float32))
    model.load_state_dict(state)
    return model


def block_forward(model: Any, layer: int, x: np.ndarray) -> np.ndarray:
    """MoE layer ``layer`` of ``model`` on ``x [T, H]`` -> float32 ``[T, H]``."""
    import torch

    with torch.no_grad():
        out = moe_module(model, layer)(torch.from_numpy(np.array(x, np.float32))[None])
    if isinstance(out, tuple):
        out = out[0]
    return out[0].float().numpy()


def peft_block_outputs(blocks: Sequence[MoEBlock], folder: str | os.PathLike,
                       xs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Load the PEFT folder with ``PeftModel.from_pretrained`` into
    :func:`transformers_model` ``(blocks)`` and run MoE layer ``i`` on ``xs[i]
    [T, H]``; returns the float32 outputs ``[T, H]``, one per layer."""
    from peft import PeftModel

    if len(xs) != len(blocks):
        raise ValueError(f"peft_block_outputs: {len(xs)} inputs for {len(blocks)} blocks")
    with warnings.catch_warnings():
        # peft 0.21 checks rank_pattern and alpha_pattern keys against the targeted
        # modules only, and warns that a pattern for the fused ``gate_up_proj``
        # parameter (the rank 2r of a gate and up with different A) matched none,
        # though it applies it to the parameter (the outputs compared here say so).
        warnings.filterwarnings("ignore", message=".*_pattern keys did not match any targeted",
                                category=RuntimeWarning)
        # transformers 5 deprecates a method peft 0.21 still calls
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        model = PeftModel.from_pretrained(transformers_model(blocks), os.fspath(folder)).eval()
    return [block_forward(model, i, x) for i, x in enumerate(xs)]
