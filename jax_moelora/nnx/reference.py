"""Float64 NumPy reference of each family's sparse MoE block, token by token.

Written from the transformers 5 model definitions (``Qwen3MoeSparseMoeBlock``,
``MixtralSparseMoeBlock``, ``GptOssMLP``, ``DeepseekV2Moe``,
``DeepseekV3MoE``), with no JAX: the tests hold :class:`MoEBlock` to it, and
it can score stored torch outputs.

Parameters are plain arrays in the layouts of ``block.py`` (``x @ W``):

- ``router [H, E]``; ``router_bias [E]`` (gpt-oss); ``correction_bias [E]``
  (DeepSeek-V3);
- GLU experts: ``gate_proj``, ``up_proj [E, H, I]``, ``down_proj [E, I, H]``;
- gpt-oss experts: ``gate_up_proj [E, H, 2I]`` (gate on even columns),
  ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``, ``down_proj_bias
  [E, H]``;
- shared experts: ``shared_gate``, ``shared_up [H, I_s]``, ``shared_down
  [I_s, H]``.

An adapter is ``{projection: delta [E_t, N, K]}`` of dense, scaled LoRA
deltas (``scale * B @ A``; experts past ``E_t`` are not adapted); projections
are those of ``MoELoRA`` (``router``, ``gate``, ``up``, ``down``,
``shared_gate``, ``shared_up``, ``shared_down``). For gpt-oss, ``gate`` and
``up`` are the even and odd output columns of ``gate_up_proj``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jax_moelora.nnx.families import DeepSeekV2, DeepSeekV3, GptOss, MoEFamily

__all__ = ["adapter_deltas", "block_params", "moe_block_reference", "route_reference"]

Deltas = Mapping[str, np.ndarray]


def _softmax(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max())
    return e / e.sum()


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def _topk(v: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest entries, ties to the lower index."""
    return np.argsort(-v, kind="stable")[:k]


def _group_limited(choice: np.ndarray, k: int, n_group: int, topk_group: int,
                   group_score: str) -> np.ndarray:
    groups = choice.reshape(n_group, -1)
    if group_score == "max":
        scores = groups.max(axis=1)
    else:
        scores = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
    keep = np.zeros(n_group, bool)
    keep[_topk(scores, topk_group)] = True
    masked = np.where(np.repeat(keep, groups.shape[1]), choice, 0.0)
    return _topk(masked, k)


def route_reference(family: MoEFamily, logits: np.ndarray, top_k: int,
                    correction_bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One token's logits ``[E]`` -> ``(weights [k], expert ids [k])``, float64."""
    logits = np.asarray(logits, np.float64)
    if family.router == "softmax_topk":  # Qwen3-MoE, Mixtral
        p = _softmax(logits)
        ids = _topk(p, top_k)
        w = p[ids]
        if family.norm_topk_prob:
            w = w / w.sum()
    elif family.router == "topk_softmax":  # gpt-oss
        ids = _topk(logits, top_k)
        w = _softmax(logits[ids])
    elif isinstance(family, DeepSeekV2):
        p = _softmax(logits)
        if family.topk_method == "greedy":
            ids = _topk(p, top_k)
        else:
            ids = _group_limited(p, top_k, family.n_group, family.topk_group, "max")
        w = p[ids]
        if top_k > 1 and family.norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        else:
            w = w * family.routed_scaling_factor
    elif isinstance(family, DeepSeekV3):
        s = _sigmoid(logits)
        choice = s if correction_bias is None else s + np.asarray(correction_bias, np.float64)
        ids = _group_limited(choice, top_k, family.n_group, family.topk_group, "top2_sum")
        w = s[ids]
        if family.norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        w = w * family.routed_scaling_factor
    else:
        raise ValueError(f"no reference for routing rule {family.router!r}")
    return w, ids


def _delta(deltas: Deltas | None, name: str, expert: int, v: np.ndarray):
    d = None if deltas is None else deltas.get(name)
    if d is None or expert >= d.shape[0]:
        return 0.0
    return d[expert] @ v


def moe_block_reference(family: MoEFamily, params: Mapping[str, np.ndarray], x: np.ndarray,
                        top_k: int, adapter_ids: Sequence[int] | None = None,
                        adapters: Sequence[Deltas] = ()) -> np.ndarray:
    """The block's output ``[T, H]`` (float64) for tokens ``x [T, H]``.

    ``adapter_ids[t]`` picks ``adapters[adapter_ids[t]]`` for token ``t``; a
    negative or out-of-range id (or ``adapter_ids=None``) is the base model.
    """
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        a = None
        if adapter_ids is not None and 0 <= adapter_ids[t] < len(adapters):
            a = adapters[adapter_ids[t]]
        xt = x[t]
        logits = xt @ p["router"] + p.get("router_bias", 0.0) + _delta(a, "router", 0, xt)
        w, ids = route_reference(family, logits, top_k, p.get("correction_bias"))
        for e, we in zip(ids, w):
            if isinstance(family, GptOss):
                gu = xt @ p["gate_up_proj"][e] + p["gate_up_proj_bias"][e]
                g = gu[0::2] + _delta(a, "gate", e, xt)
                u = gu[1::2] + _delta(a, "up", e, xt)
                g = np.minimum(g, family.limit)
                u = np.clip(u, -family.limit, family.limit)
                h = (u + 1.0) * (g * _sigmoid(family.alpha * g))
                d = h @ p["down_proj"][e] + p["down_proj_bias"][e] + _delta(a, "down", e, h)
            else:
                g = xt @ p["gate_proj"][e] + _delta(a, "gate", e, xt)
                u = xt @ p["up_proj"][e] + _delta(a, "up", e, xt)
                h = g * _sigmoid(g) * u
                d = h @ p["down_proj"][e] + _delta(a, "down", e, h)
            out[t] += we * d
        if "shared_gate" in p:
            g = xt @ p["shared_gate"] + _delta(a, "shared_gate", 0, xt)
            u = xt @ p["shared_up"] + _delta(a, "shared_up", 0, xt)
            h = g * _sigmoid(g) * u
            out[t] += h @ p["shared_down"] + _delta(a, "shared_down", 0, h)
    return out


def block_params(block: Any) -> dict[str, np.ndarray]:
    """An ``MoEBlock``'s parameters as float64 arrays in the layouts above."""
    f = lambda v: np.asarray(v[...], np.float64)  # noqa: E731
    p = {"router": f(block.router.kernel)}
    if block.router.bias is not None:
        p["router_bias"] = f(block.router.bias)
    if block.router.correction_bias is not None:
        p["correction_bias"] = f(block.router.correction_bias)
    ex = block.experts
    names = (("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
             if isinstance(block.family, GptOss) else ("gate_proj", "up_proj", "down_proj"))
    p.update({n: f(getattr(ex, n)) for n in names})
    if block.shared_experts is not None:
        s = block.shared_experts
        p.update(shared_gate=f(s.gate_proj.kernel), shared_up=f(s.up_proj.kernel),
                 shared_down=f(s.down_proj.kernel))
    return p


def adapter_deltas(layer: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``{projection: ProjectionLoRA}`` of one layer -> dense deltas ``[E_t, N, K]``."""
    return {name: np.stack([lora.delta(e) for e in range(lora.n_experts)])
            for name, lora in layer.items()}
