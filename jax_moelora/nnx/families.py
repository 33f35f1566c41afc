"""The MoE conventions of the model families the block implements.

One frozen dataclass per family holds what differs between them: the routing
rule, expert biases and activation, shared experts. Sizes (hidden, expert
width, expert count, top-k) are the block's arguments, common to all.

Each family follows the sparse MoE block of its transformers 5 model
definition:

- :class:`Qwen3MoE`: softmax over the router logits, top-k, renormalised to
  sum 1 when ``norm_topk_prob``; bias-free SiLU-GLU experts.
- :class:`Mixtral`: the same with the renormalisation always on.
- :class:`GptOss`: router with a bias; top-k on the logits, softmax over the
  chosen k; fused ``gate_up_proj [E, H, 2I]`` (gate on even columns, up on
  odd ones) and ``down_proj [E, I, H]``, both with biases; the clamped gated
  activation ``(clip(u, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
  ``g = min(gate, limit)``.
- :class:`DeepSeekV2`: softmax scores, greedy or group-limited greedy top-k
  (groups ranked by their best expert), ``routed_scaling_factor``; shared
  experts added to every token.
- :class:`DeepSeekV3`: sigmoid scores; the choice adds
  ``e_score_correction_bias`` and keeps the ``topk_group`` groups with the
  largest sum of their two best experts; weights are the uncorrected scores,
  renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``;
  shared experts.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

__all__ = [
    "DeepSeekV2",
    "DeepSeekV3",
    "FAMILIES",
    "GptOss",
    "Mixtral",
    "MoEFamily",
    "Qwen3MoE",
    "family_config",
]


@dataclasses.dataclass(frozen=True)
class MoEFamily:
    """Base of the family configs.

    Class attributes: ``name`` (the command-line name), ``router`` (the
    routing rule, see ``routers.select_experts``), ``experts`` (``"glu"``:
    separate bias-free gate/up/down; ``"gpt_oss"``: fused, biased, clamped),
    ``router_bias`` and ``gate_up_split`` (how a PEFT ``gate_up_proj``
    adapter stacks gate and up: ``"halves"`` or ``"interleaved"``).
    """

    name: ClassVar[str] = ""
    router: ClassVar[str] = "softmax_topk"
    experts: ClassVar[str] = "glu"
    router_bias: ClassVar[bool] = False
    gate_up_split: ClassVar[str] = "halves"

    @property
    def n_shared_experts(self) -> int:
        """Shared experts folded into one MLP of width ``n * intermediate``."""
        return 0

    def check(self, num_experts: int, top_k: int) -> None:
        """Raise ``ValueError`` if the family's options do not fit the layer."""
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")


@dataclasses.dataclass(frozen=True)
class Qwen3MoE(MoEFamily):
    """Qwen3-MoE (also Qwen2-MoE's routed part, OLMoE): ``norm_topk_prob``
    renormalises the top-k softmax probabilities."""

    name: ClassVar[str] = "qwen3"
    norm_topk_prob: bool = True


@dataclasses.dataclass(frozen=True)
class Mixtral(MoEFamily):
    """Mixtral: softmax, top-k, always renormalised."""

    name: ClassVar[str] = "mixtral"

    @property
    def norm_topk_prob(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class GptOss(MoEFamily):
    """gpt-oss: biased router, top-k then softmax, fused interleaved
    ``gate_up_proj`` with biases, clamped gated activation.

    Attributes:
      alpha: the sigmoid's slope in ``g * sigmoid(alpha * g)`` (1.702).
      limit: ``gate`` is clamped above at ``limit``, ``up`` to
        ``[-limit, limit]`` (7.0).
    """

    name: ClassVar[str] = "gpt-oss"
    router: ClassVar[str] = "topk_softmax"
    experts: ClassVar[str] = "gpt_oss"
    router_bias: ClassVar[bool] = True
    gate_up_split: ClassVar[str] = "interleaved"
    alpha: float = 1.702
    limit: float = 7.0

    def check(self, num_experts: int, top_k: int) -> None:
        super().check(num_experts, top_k)
        if not self.limit > 0:
            raise ValueError(f"GptOss: limit must be > 0, got {self.limit}")


def _check_groups(cfg, num_experts: int, top_k: int, min_group: int) -> None:
    name = type(cfg).__name__
    if cfg.n_group < 1 or num_experts % cfg.n_group:
        raise ValueError(f"{name}: n_group={cfg.n_group} must divide num_experts={num_experts}")
    if not 1 <= cfg.topk_group <= cfg.n_group:
        raise ValueError(f"{name}: topk_group must be in [1, n_group={cfg.n_group}], "
                         f"got {cfg.topk_group}")
    size = num_experts // cfg.n_group
    if size < min_group:
        raise ValueError(f"{name}: groups of {size} experts; the group score needs "
                         f"at least {min_group}")
    if top_k > cfg.topk_group * size:
        raise ValueError(f"{name}: top_k={top_k} exceeds the {cfg.topk_group * size} experts "
                         f"of the topk_group={cfg.topk_group} kept groups")
    if cfg.n_shared < 0:
        raise ValueError(f"{name}: n_shared must be >= 0, got {cfg.n_shared}")


@dataclasses.dataclass(frozen=True)
class DeepSeekV2(MoEFamily):
    """DeepSeek-V2 (and V2-Lite).

    Attributes:
      topk_method: ``"greedy"`` (top-k over all experts) or
        ``"group_limited_greedy"`` (keep the ``topk_group`` of ``n_group``
        groups with the largest best score, top-k inside them).
      n_group, topk_group: the groups.
      norm_topk_prob: with ``top_k > 1``, divide the top-k scores by their
        sum (+ 1e-20) instead of scaling them by ``routed_scaling_factor``
        (the DeepSeek-V2 model code; every released V2 checkpoint has it
        off, where transformers 5 agrees).
      routed_scaling_factor: scales the routed weights.
      n_shared: shared experts (their MLP is ``n_shared * intermediate``
        wide); 0 for none.
    """

    name: ClassVar[str] = "deepseek-v2"
    router: ClassVar[str] = "deepseek_v2"
    topk_method: Literal["greedy", "group_limited_greedy"] = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_shared: int = 2

    @property
    def n_shared_experts(self) -> int:
        return self.n_shared

    def check(self, num_experts: int, top_k: int) -> None:
        super().check(num_experts, top_k)
        if self.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeekV2: topk_method must be 'greedy' or "
                             f"'group_limited_greedy', got {self.topk_method!r}")
        _check_groups(self, num_experts, top_k, 1)


@dataclasses.dataclass(frozen=True)
class DeepSeekV3(MoEFamily):
    """DeepSeek-V3 (and R1, Kimi K2's MoE).

    Attributes:
      n_group, topk_group: the choice keeps the ``topk_group`` groups whose
        two best corrected scores sum highest (groups need >= 2 experts).
      norm_topk_prob: divide the chosen sigmoid scores by their sum + 1e-20.
      routed_scaling_factor: then scale them.
      n_shared: shared experts (``n_shared * intermediate`` wide); 0 for none.

    The router holds ``e_score_correction_bias [E]`` (float32, not trained by
    gradients): added to the scores for the choice only.
    """

    name: ClassVar[str] = "deepseek-v3"
    router: ClassVar[str] = "deepseek_v3"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_shared: int = 1

    @property
    def n_shared_experts(self) -> int:
        return self.n_shared

    def check(self, num_experts: int, top_k: int) -> None:
        super().check(num_experts, top_k)
        _check_groups(self, num_experts, top_k, 2)


#: Command-line names -> family config classes ("deepseek" is DeepSeek-V3).
FAMILIES: dict[str, type[MoEFamily]] = {
    "qwen3": Qwen3MoE,
    "mixtral": Mixtral,
    "gpt-oss": GptOss,
    "deepseek-v2": DeepSeekV2,
    "deepseek-v3": DeepSeekV3,
    "deepseek": DeepSeekV3,
}


def family_config(family: str | MoEFamily | None) -> MoEFamily:
    """A family config from a config (returned as is), a name in
    :data:`FAMILIES` (its defaults) or ``None`` (Qwen3-MoE's defaults)."""
    if family is None:
        return Qwen3MoE()
    if isinstance(family, MoEFamily):
        return family
    if isinstance(family, str) and family in FAMILIES:
        return FAMILIES[family]()
    raise ValueError(f"family must be a MoEFamily config or one of {sorted(FAMILIES)}, "
                     f"got {family!r}")
