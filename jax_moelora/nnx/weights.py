"""Base weights of a transformers MoE layer into an :class:`MoEBlock`, and back.

``load_transformers_weights(block, tensors, prefix)`` reads one layer's MoE
module tensors (numpy or torch-converted arrays, keys as in the transformers
5 state dict after ``prefix``, e.g. ``"model.layers.0.mlp."``) and writes the
block's parameters in its ``x @ W`` layouts:

- router: ``gate.weight [E, H]`` (Qwen3-MoE, Mixtral, DeepSeek) or
  ``router.weight [E, H]`` and ``router.bias [E]`` (gpt-oss); DeepSeek-V3's
  ``gate.e_score_correction_bias [E]``;
- routed experts, fused 3-D parameters: ``experts.gate_up_proj [E, 2I, H]``
  (gate rows first) and ``experts.down_proj [E, H, I]``; gpt-oss's
  ``experts.gate_up_proj [E, H, 2I]`` (gate on even columns),
  ``experts.gate_up_proj_bias [E, 2I]``, ``experts.down_proj [E, I, H]``,
  ``experts.down_proj_bias [E, H]``;
- routed experts, one module each (transformers 4): ``experts.{e}.gate_proj``,
  ``up_proj``, ``down_proj`` (Mixtral: ``w1``, ``w3``, ``w2``) ``.weight
  [out, in]``;
- shared experts (DeepSeek): ``shared_experts.{gate,up,down}_proj.weight``.

``transformers_weights(block, prefix)`` is the inverse: the block's base
weights as those tensors (fused experts), to load into a transformers model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_moelora.nnx.block import MoEBlock

__all__ = ["load_transformers_weights", "transformers_weights"]


def _get(tensors: Mapping[str, Any], prefix: str, key: str, shape: tuple[int, ...],
         used: list[str]) -> np.ndarray:
    full = prefix + key
    if full not in tensors:
        raise KeyError(f"load_transformers_weights: no tensor {full!r}")
    v = np.asarray(tensors[full], np.float32)
    if v.shape != shape:
        raise ValueError(f"load_transformers_weights: {full!r} has shape {v.shape}, the block "
                         f"needs {shape}")
    used.append(full)
    return v


def _set(var, value: np.ndarray) -> None:
    var[...] = jnp.asarray(value, var.dtype)


def _routed_per_expert(block: MoEBlock, tensors, prefix: str, used: list[str]):
    """``(gate [E, H, I], up [E, H, I], down [E, I, H])`` from per-expert modules."""
    E, H, I = block.num_experts, block.hidden_size, block.intermediate_size
    names = ("w1", "w3", "w2") if f"{prefix}experts.0.w1.weight" in tensors else (
        "gate_proj", "up_proj", "down_proj")
    g, u, d = (np.stack([_get(tensors, prefix, f"experts.{e}.{n}.weight", s, used).T
                         for e in range(E)])
               for n, s in zip(names, ((I, H), (I, H), (H, I))))
    return g, u, d


def load_transformers_weights(block: MoEBlock, tensors: Mapping[str, Any],
                              prefix: str = "") -> list[str]:
    """Write one transformers MoE layer's base weights into ``block``.

    Args:
      block: the block (its family says which tensors it reads).
      tensors: ``{key: array}`` (e.g. a safetensors file's tensors).
      prefix: the MoE module's key prefix, e.g. ``"model.layers.3.mlp."``.

    Returns:
      The keys read.

    Raises:
      KeyError: naming a missing tensor. ValueError: naming a tensor of the
        wrong shape.
    """
    E, H, I = block.num_experts, block.hidden_size, block.intermediate_size
    used: list[str] = []
    fam = block.family
    if fam.router_bias:
        _set(block.router.kernel, _get(tensors, prefix, "router.weight", (E, H), used).T)
        _set(block.router.bias, _get(tensors, prefix, "router.bias", (E,), used))
    else:
        _set(block.router.kernel, _get(tensors, prefix, "gate.weight", (E, H), used).T)
    if block.router.correction_bias is not None:
        _set(block.router.correction_bias,
             _get(tensors, prefix, "gate.e_score_correction_bias", (E,), used))
    ex = block.experts
    if fam.experts == "gpt_oss":
        _set(ex.gate_up_proj, _get(tensors, prefix, "experts.gate_up_proj", (E, H, 2 * I), used))
        _set(ex.gate_up_proj_bias,
             _get(tensors, prefix, "experts.gate_up_proj_bias", (E, 2 * I), used))
        _set(ex.down_proj, _get(tensors, prefix, "experts.down_proj", (E, I, H), used))
        _set(ex.down_proj_bias, _get(tensors, prefix, "experts.down_proj_bias", (E, H), used))
    else:
        if f"{prefix}experts.gate_up_proj" in tensors:
            gu = _get(tensors, prefix, "experts.gate_up_proj", (E, 2 * I, H), used)
            g, u = np.transpose(gu[:, :I], (0, 2, 1)), np.transpose(gu[:, I:], (0, 2, 1))
            d = np.transpose(_get(tensors, prefix, "experts.down_proj", (E, H, I), used),
                             (0, 2, 1))
        else:
            g, u, d = _routed_per_expert(block, tensors, prefix, used)
        _set(ex.gate_proj, g)
        _set(ex.up_proj, u)
        _set(ex.down_proj, d)
    if block.shared_experts is not None:
        s = block.shared_experts
        S = s.gate_proj.kernel.shape[1]
        for name, shape in (("gate_proj", (S, H)), ("up_proj", (S, H)), ("down_proj", (H, S))):
            w = _get(tensors, prefix, f"shared_experts.{name}.weight", shape, used)
            _set(getattr(s, name).kernel, w.T)
    return used


def transformers_weights(block: MoEBlock, prefix: str = "") -> dict[str, np.ndarray]:
    """The block's base weights as one transformers 5 MoE layer's tensors: the
    inverse of :func:`load_transformers_weights` (fused experts).

    Args:
      block: the block.
      prefix: the MoE module's key prefix, e.g. ``"model.layers.3.mlp."``.

    Returns:
      ``{prefix + key: float32 array}`` in the layouts of the module
      docstring (``gate.weight [E, H]``, ``experts.gate_up_proj [E, 2I, H]``,
      ``experts.down_proj [E, H, I]``, ...; gpt-oss's own layouts).
    """
    f = lambda v: np.asarray(v[...], np.float32)  # noqa: E731
    out: dict[str, np.ndarray] = {}
    if block.family.router_bias:
        out["router.weight"] = f(block.router.kernel).T
        out["router.bias"] = f(block.router.bias)
    else:
        out["gate.weight"] = f(block.router.kernel).T
    if block.router.correction_bias is not None:
        out["gate.e_score_correction_bias"] = f(block.router.correction_bias)
    ex = block.experts
    if block.family.experts == "gpt_oss":
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            out[f"experts.{name}"] = f(getattr(ex, name))
    else:
        out["experts.gate_up_proj"] = np.concatenate(
            [np.transpose(f(ex.gate_proj), (0, 2, 1)), np.transpose(f(ex.up_proj), (0, 2, 1))],
            axis=1)
        out["experts.down_proj"] = np.transpose(f(ex.down_proj), (0, 2, 1))
    if block.shared_experts is not None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"shared_experts.{name}.weight"] = f(
                getattr(block.shared_experts, name).kernel).T
    return {prefix + k: np.ascontiguousarray(v) for k, v in out.items()}
