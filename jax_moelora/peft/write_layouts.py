"""The two layouts ``save_peft_adapter`` writes (``writer.py``), each as the
tensors of one layer and the config's targets.

- ``"target_parameters"``: transformers 5's fused experts, nested
  ``experts[.base_layer]`` keys with ``gate_up_proj`` innermost, ``lora_A``
  reading each projection's input; gate and up with different ``lora_A`` as
  peft fuses them (``A`` stacked along the rank, ``B`` block-diagonal, rank
  and alpha patterns of twice the rank that keep the scale).
- ``"experts"``: transformers 4's per-expert modules under the family's names
  (:data:`EXPERT_NAMES`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from jax_moelora.peft.config import pattern_value

__all__ = ["EXPERT_NAMES", "Put", "expert_factors", "block_diagonal", "write_fused_layer",
           "write_expert_layer", "fused_patterns", "fused_targets", "expert_targets"]

Put = Callable[[str, Any], None]  # writes one tensor under a key
Factors = dict[str, tuple[np.ndarray, np.ndarray]]

#: Per-expert module names (gate, up, down) and the MoE block's name, per name set.
EXPERT_NAMES = {"qwen3": (("gate_proj", "up_proj", "down_proj"), "mlp"),
                "mixtral": (("w1", "w3", "w2"), "block_sparse_moe")}

_GATE_UP = r".*\.gate_up_proj"
_PROJS = ("gate", "up", "down")


def as_3d(v, name: str, what: str) -> np.ndarray:
    """``v`` as ``[E, ...]`` (a 2-D factor is one expert's)."""
    v = np.asarray(v)
    if v.ndim == 2:
        v = v[None]
    if v.ndim != 3:
        raise ValueError(f"save_peft_adapter: {name} {what} must be 3-D [E, ...], got {v.shape}")
    return v


def expert_factors(projs: Mapping[str, tuple[Any, Any]]) -> Factors:
    """The expert projections' ``(A [E, r, K], B [E, N, r])`` of one layer."""
    return {p: tuple(as_3d(v, p, w) for v, w in zip(projs[p], ("A", "B")))
            for p in _PROJS if p in projs}


def _shares_a(mats: Factors) -> bool:
    (ag, _), (au, _) = mats["gate"], mats["up"]
    return ag.shape == au.shape and np.array_equal(ag, au)


def block_diagonal(layers: Mapping[int, Mapping[str, Any]]) -> bool:
    """Whether gate and up are fused block-diagonally: one fused rank for
    every layer, so where any layer's gate and up ``A`` differ."""
    return any("gate" in m and "up" in m and not _shares_a(m)
               for m in map(expert_factors, layers.values()))


def _fused_gate_up(ag, bg, au, bu, split: str, block: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(A [E, r', H], B [E, 2I, r'])`` of gate and up.

    ``block``: ``r' = 2r``, A stacked along the rank, B block-diagonal; else ``r' = r``, the
    shared A."""
    if not block:
        a, b_g, b_u = ag, bg, bu
    else:
        if ag.shape[1] != au.shape[1]:
            raise ValueError(f"save_peft_adapter: gate rank {ag.shape[1]} and up rank "
                             f"{au.shape[1]} differ; a fused gate_up needs one rank")
        a = np.concatenate([ag, au], axis=1)
        zeros = np.zeros_like(bg)
        b_g = np.concatenate([bg, zeros], axis=2)
        b_u = np.concatenate([zeros, bu], axis=2)
    if split == "interleaved":
        b = np.stack([b_g, b_u], axis=2).reshape(b_g.shape[0], -1, b_g.shape[2])
    else:
        b = np.concatenate([b_g, b_u], axis=1)
    return a, b


def write_fused_layer(put: Put, base: str, mats: Factors, split: str, block: bool) -> None:
    """One layer's fused experts under ``base`` (``...layers.{L}.mlp``): the
    module's parameters in peft's order, ``gate_up_proj`` innermost (the
    deepest ``base_layer``)."""
    if ("gate" in mats) != ("up" in mats):
        raise ValueError("save_peft_adapter: the fused gate_up_proj needs both gate and up")
    order = []
    if "gate" in mats:
        order.append(_fused_gate_up(*mats["gate"], *mats["up"], split, block))
    if "down" in mats:
        order.append(mats["down"])
    for i, (a, b) in enumerate(order):
        E, rank, _ = a.shape
        key = f"{base}.experts" + ".base_layer" * (len(order) - 1 - i)
        put(f"{key}.lora_A.weight", a.reshape(E * rank, -1))  # rows e * r + j
        put(f"{key}.lora_B.weight",
            np.transpose(b, (1, 2, 0)).reshape(b.shape[1], E * rank))  # columns j * E + e


def write_expert_layer(put: Put, base: str, mats: Factors, names: tuple[str, ...]) -> None:
    """One layer's per-expert modules ``experts.{e}.<name>`` under ``base``."""
    for p, name in zip(_PROJS, names):
        if p in mats:
            a, b = mats[p]
            for e in range(a.shape[0]):
                put(f"{base}.experts.{e}.{name}.lora_A.weight", a[e])
                put(f"{base}.experts.{e}.{name}.lora_B.weight", b[e])


def fused_patterns(rank_pattern: dict, alpha_pattern: dict, r: int, lora_alpha: float,
                   use_rslora: bool) -> tuple[dict, dict]:
    """The rank and alpha patterns of a block-diagonal ``gate_up_proj``: twice
    its rank, and an alpha that keeps ``alpha / r`` (or ``alpha / sqrt(r)``)."""
    name = "model.layers.0.mlp.experts.gate_up_proj"
    r_gu = int(pattern_value(rank_pattern, name, r))
    alpha_gu = float(pattern_value(alpha_pattern, name, lora_alpha))
    alpha_2r = alpha_gu * (math.sqrt(2) if use_rslora else 2)

    def others(pattern):
        return {k: v for k, v in pattern.items() if not re.match(rf"(.*\.)?({k})$", name)}

    return {_GATE_UP: 2 * r_gu} | others(rank_pattern), {_GATE_UP: alpha_2r} | others(alpha_pattern)


def fused_targets(has: set[str], router: str, shared_names: list[str]) -> list[str]:
    """``target_parameters`` of the fused layout."""
    return ((["experts.gate_up_proj"] if "gate" in has else [])
            + (["experts.down_proj"] if "down" in has else [])
            + ([f"{router}.weight"] if "router" in has else [])
            + [f"{n}.weight" for n in shared_names])


def expert_targets(has: set[str], names: tuple[str, ...], shared_names: list[str]) -> list[str]:
    """``target_modules`` of the per-expert layout."""
    return ((["gate"] if "router" in has else [])
            + [n for p, n in zip(_PROJS, names) if p in has] + shared_names)
