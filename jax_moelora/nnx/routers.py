"""Routers: a linear map to expert logits, then a family's choice of experts.

:func:`select_experts` turns float32 logits ``[T, E]`` into the weights
(float32 ``[T, top_k]``) and expert ids (int32 ``[T, top_k]``) of each token,
with the rule of a family (``families.py``); ties go to the lower expert id
(``jax.lax.top_k``). :class:`Router` is an ``nnx.Linear`` (kernel ``[H, E]``,
bias for gpt-oss) that also holds DeepSeek-V3's score-correction bias. The
LoRA delta of the router is folded into the logits by the block, between
:meth:`Router.__call__` and :meth:`Router.select`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_moelora.nnx.families import DeepSeekV2, DeepSeekV3, MoEFamily

__all__ = ["Router", "ScoreCorrectionBias", "select_experts", "group_limited_topk"]

Array = jax.Array


class ScoreCorrectionBias(nnx.Variable):
    """DeepSeek-V3's ``e_score_correction_bias [E]`` (float32): state that
    load balancing updates outside gradients, so not an ``nnx.Param``."""


def _normalise(weights: Array) -> Array:
    return weights / jnp.sum(weights, axis=-1, keepdims=True)


def group_limited_topk(choice: Array, top_k: int, n_group: int, topk_group: int, *,
                       group_score: str) -> Array:
    """Expert ids ``[T, top_k]`` chosen inside the best ``topk_group`` groups.

    Args:
      choice: float32 ``[T, E]`` scores the choice ranks (``E`` split into
        ``n_group`` contiguous groups).
      group_score: ``"max"`` (a group's best score, DeepSeek-V2) or
        ``"top2_sum"`` (the sum of its two best, DeepSeek-V3).

    Scores outside the kept groups are replaced by 0.0 before the top-k, as
    the transformers model code does (so with negative scores a 0.0 outside
    the kept groups can outrank them).
    """
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)
    if group_score == "max":
        scores = jnp.max(grouped, axis=-1)
    else:
        scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, kept = jax.lax.top_k(scores, topk_group)
    keep = jnp.any(kept[:, :, None] == jnp.arange(n_group)[None, None, :], axis=1)
    mask = jnp.repeat(keep, e // n_group, axis=1)
    return jax.lax.top_k(jnp.where(mask, choice, 0.0), top_k)[1]


def select_experts(family: MoEFamily, logits: Array, top_k: int,
                   correction_bias: Array | None = None) -> tuple[Array, Array]:
    """``(weights f32 [T, top_k], ids int32 [T, top_k])`` from float32 logits ``[T, E]``.

    ``correction_bias`` (float32 ``[E]``) is DeepSeek-V3's
    ``e_score_correction_bias``; other families ignore it.
    """
    logits = logits.astype(jnp.float32)
    rule = family.router
    if rule == "softmax_topk":
        weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
        if family.norm_topk_prob:
            weights = _normalise(weights)
    elif rule == "topk_softmax":
        top, ids = jax.lax.top_k(logits, top_k)
        weights = jax.nn.softmax(top, axis=-1)
    elif rule == "deepseek_v2":
        assert isinstance(family, DeepSeekV2)
        scores = jax.nn.softmax(logits, axis=-1)
        if family.topk_method == "greedy":
            ids = jax.lax.top_k(scores, top_k)[1]
        else:
            ids = group_limited_topk(scores, top_k, family.n_group, family.topk_group,
                                     group_score="max")
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        if top_k > 1 and family.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        else:
            weights = weights * family.routed_scaling_factor
    elif rule == "deepseek_v3":
        assert isinstance(family, DeepSeekV3)
        scores = jax.nn.sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias[None, :]
        ids = group_limited_topk(choice, top_k, family.n_group, family.topk_group,
                                 group_score="top2_sum")
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        if family.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        weights = weights * family.routed_scaling_factor
    else:
        raise ValueError(f"unknown routing rule {rule!r}")
    return weights, ids.astype(jnp.int32)


class Router(nnx.Linear):
    """The router of an MoE layer: ``logits = x @ kernel (+ bias)``, then
    :meth:`select`.

    Args:
      hidden_size: ``H``.
      num_experts: ``E``.
      family: the family config (bias, choice rule).
      top_k: experts per token.
      dtype: the logits' dtype (inputs are cast to it).
      param_dtype: the kernel's and bias's dtype.
      kernel_init, bias_init: initializers (``nnx.Linear``'s defaults).
      rngs: initialisation keys.

    State: ``kernel [H, E]``, ``bias [E]`` (gpt-oss) or ``None``;
    ``correction_bias`` (:class:`ScoreCorrectionBias` float32 ``[E]``, zeros)
    for DeepSeek-V3, else ``None``.
    """

    def __init__(self, hidden_size: int, num_experts: int, *, family: MoEFamily, top_k: int,
                 dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                 kernel_init: Any = None, bias_init: Any = None, rngs: nnx.Rngs):
        kw = {}
        if kernel_init is not None:
            kw["kernel_init"] = kernel_init
        if bias_init is not None:
            kw["bias_init"] = bias_init
        super().__init__(hidden_size, num_experts, use_bias=family.router_bias, dtype=dtype,
                         param_dtype=param_dtype, rngs=rngs, **kw)
        self.family, self.top_k = family, int(top_k)
        self.correction_bias = (ScoreCorrectionBias(jnp.zeros((num_experts,), jnp.float32))
                                if isinstance(family, DeepSeekV3) else None)

    def select(self, logits: Array) -> tuple[Array, Array]:
        """Logits ``[T, E]`` -> ``(weights f32 [T, top_k], ids int32 [T, top_k])``."""
        bias = None if self.correction_bias is None else self.correction_bias[...]
        return select_experts(self.family, logits, self.top_k, bias)
