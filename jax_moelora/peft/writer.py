"""``save_peft_adapter``: write MoE LoRA factors as a PEFT adapter folder that peft loads.

Two layouts, each the one peft writes for a model family and release:

- ``"target_parameters"`` (default): the layout peft 0.21 writes, and loads,
  for transformers 5 MoE models with fused experts (Qwen3-MoE, Mixtral,
  DeepSeek-V2/V3; gpt-oss with ``gate_up_split="interleaved"``): the router
  through ``target_parameters`` entry ``"gate.weight"`` (``"router.weight"``
  with ``router="router"``), ``experts.gate_up_proj`` and
  ``experts.down_proj`` nested with ``gate_up_proj`` innermost, ``lora_A``
  reading each projection's input (``layouts.read_fused_experts``). Gate and
  up with different ``lora_A`` are written the way peft fuses them: ``A``
  stacked along the rank, ``B`` block-diagonal, ``rank_pattern`` and
  ``alpha_pattern`` ``".*\\.gate_up_proj"`` keeping their scale.
- ``"experts"``: per-expert ``nn.Linear`` modules of transformers 4, with the
  names of the model family's transformers 4 model (``family=``):
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` (Qwen3-MoE, DeepSeek-V2/V3)
  or Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``. peft loads these
  into transformers 4 models, and peft 0.21 converts them when loading into
  a transformers 5 Qwen3-MoE or Mixtral model. The two name sets are not
  interchangeable (peft loads a file of the other family's names without a
  warning, and applies wrong deltas), so this layout needs ``family=`` (or
  ``expert_names=``) and refuses the two when they disagree. gpt-oss has no
  per-expert layout (its transformers 4 experts are fused).

``scripts/check_peft_writer.py`` loads what this writes with real peft and
compares the deltas.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jax_moelora._optional import needs_extra

from jax_moelora.peft.adapter import PROJECTIONS
from jax_moelora.peft.config import CONFIG_NAME, pattern_value
from jax_moelora.peft.reader import WEIGHTS_NAME

#: Layouts ``save_peft_adapter`` writes (``load_peft_adapter`` reads them and more).
LAYOUTS = ("target_parameters", "experts")

#: The peft release whose files the ``target_parameters`` layout matches (recorded as the
#: config's ``peft_version``: a reader takes it to mean ``lora_A`` reads the input).
PEFT_FORMAT_VERSION = "0.21.2"

#: Per-expert module names (gate, up, down) and the MoE block's name, per name set.
EXPERT_NAMES = {"qwen3": (("gate_proj", "up_proj", "down_proj"), "mlp"),
                "mixtral": (("w1", "w3", "w2"), "block_sparse_moe")}

#: Per model family (the names of ``jax_moelora.nnx.families.FAMILIES``): the
#: ``EXPERT_NAMES`` set of its transformers 4 per-expert modules (``None``:
#: gpt-oss, whose transformers 4 experts are fused), the router module's name
#: and how its fused ``gate_up_proj`` stacks gate and up.
FAMILY_LAYOUTS = {
    "qwen3": ("qwen3", "gate", "halves"),
    "mixtral": ("mixtral", "gate", "halves"),
    "deepseek-v2": ("qwen3", "gate", "halves"),
    "deepseek-v3": ("qwen3", "gate", "halves"),
    "deepseek": ("qwen3", "gate", "halves"),
    "gpt-oss": (None, "router", "interleaved"),
}

_GATE_UP = r".*\.gate_up_proj"


def _as_3d(v, name: str, what: str) -> np.ndarray:
    v = np.asarray(v)
    if v.ndim == 2:
        v = v[None]
    if v.ndim != 3:
        raise ValueError(f"save_peft_adapter: {name} {what} must be 3-D [E, ...], got {v.shape}")
    return v


def _shares_a(mats) -> bool:
    (ag, _), (au, _) = mats["gate"], mats["up"]
    return ag.shape == au.shape and np.array_equal(ag, au)


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


def _family_choices(family, layout: str, expert_names: str | None, router: str | None,
                    gate_up_split: str | None) -> tuple[str | None, str, str]:
    """``(expert_names, router, gate_up_split)``: those given, the rest from
    ``family``; ``ValueError`` when a given one contradicts the family."""
    name = getattr(family, "name", family)
    if name is not None and name not in FAMILY_LAYOUTS:
        raise ValueError(f"save_peft_adapter: family must be one of {sorted(FAMILY_LAYOUTS)} "
                         f"(or a family config with such a name), got {family!r}")
    if expert_names is not None and expert_names not in EXPERT_NAMES:
        raise ValueError(f"expert_names must be one of {sorted(EXPERT_NAMES)}, "
                         f"got {expert_names!r}")
    if name is None:
        if layout == "experts" and expert_names is None:
            raise ValueError(
                "save_peft_adapter: layout='experts' writes the per-expert module names of the "
                "model family's transformers 4 model, which differ between families (gate_proj/"
                "up_proj/down_proj for Qwen3-MoE and DeepSeek, w1/w3/w2 for Mixtral); pass "
                f"family= (one of {sorted(FAMILY_LAYOUTS)})")
        return expert_names, router or "gate", gate_up_split or "halves"
    fam_names, fam_router, fam_split = FAMILY_LAYOUTS[name]
    if layout == "experts" and fam_names is None:
        raise ValueError(f"save_peft_adapter: family={name!r} has no layout='experts': its "
                         "transformers 4 experts are fused (gate_up_proj, down_proj), not "
                         "per-expert modules; write layout='target_parameters'")
    for arg, given, want in (("expert_names", expert_names, fam_names),
                             ("router", router, fam_router),
                             ("gate_up_split", gate_up_split, fam_split)):
        if given is not None and want is not None and given != want:
            raise ValueError(f"save_peft_adapter: {arg}={given!r} contradicts family={name!r}, "
                             f"whose models use {arg}={want!r}")
    return fam_names, fam_router, fam_split


def save_peft_adapter(path: str | os.PathLike,
                      weights: Mapping[int, Mapping[str, tuple[Any, Any]]], *,
                      r: int, lora_alpha: float, layout: str = "target_parameters",
                      use_rslora: bool = False, rank_pattern: Mapping[str, int] | None = None,
                      alpha_pattern: Mapping[str, float] | None = None,
                      dtype: Any = np.float32, prefix: str = "base_model.model.model.",
                      family: Any = None, expert_names: str | None = None,
                      router: str | None = None, gate_up_split: str | None = None,
                      shared_experts: Mapping[int, Mapping[str, tuple[Any, Any]]] | None = None,
                      base_model_name_or_path: str | None = None,
                      extra_tensors: Mapping[str, Any] | None = None,
                      config_overrides: Mapping[str, Any] | None = None) -> Path:
    """Write a PEFT LoRA adapter folder for MoE layers.

    Args:
      path: the folder to create (or overwrite files in).
      weights: ``{layer: {projection: (A, B)}}`` of unscaled factors:
        ``A [E, r, K]`` and ``B [E, N, r]`` float for gate, up and down (expert
        ``e`` is row ``e``), ``A [r, hidden]`` / ``B [num_experts, r]`` (or
        with a leading 1) for the router.
      r, lora_alpha, use_rslora, rank_pattern, alpha_pattern: written to the
        config (the caller keeps them consistent with the factors' ranks; the
        patterns match peft's names, e.g. ``"down_proj"``).
      layout: ``"target_parameters"`` (default) or ``"experts"`` (module
        docstring).
      dtype: tensor dtype in the file (numpy float dtype, or
        ``ml_dtypes.bfloat16``).
      prefix: key prefix before ``layers.``.
      family: the model family, a name in ``FAMILY_LAYOUTS`` (those of
        ``jax_moelora.nnx.families``: ``"qwen3"``, ``"mixtral"``,
        ``"deepseek-v2"``, ``"deepseek-v3"``, ``"gpt-oss"``) or a family
        config (``block.family``). It gives ``expert_names``, ``router`` and
        ``gate_up_split``; one of those given as well must agree with it.
        ``layout="experts"`` needs ``family`` or ``expert_names``.
      expert_names: ``"qwen3"`` or ``"mixtral"``: per-expert module and block
        names of the ``"experts"`` layout (default: the family's).
      router: the router module's name (default: the family's; ``"gate"``,
        or ``"router"`` for gpt-oss).
      gate_up_split: ``"halves"`` or ``"interleaved"`` (gpt-oss), for the
        fused ``gate_up_proj`` (default: the family's; ``"halves"``).
      shared_experts: ``{layer: {"gate" | "up" | "down": (A [r, K], B [N, r])}}``
        of a shared expert MLP (DeepSeek-V2/V3), written as
        ``mlp.shared_experts.{gate,up,down}_proj`` and targeted as
        ``target_parameters`` ``"shared_experts.gate_proj.weight"`` ... (peft
        0.21 rewrites ``target_modules`` ending in ``gate_proj``, ``up_proj``,
        ``down_proj`` into the routed experts' parameters), or as
        ``target_modules`` in the ``"experts"`` layout.
      extra_tensors: more tensors to write as they are (e.g. attention LoRA).
      config_overrides: more config entries (override the defaults).

    Returns:
      The folder.

    Raises:
      ValueError: ``layout="experts"`` without ``family`` or ``expert_names``,
        or for gpt-oss; ``expert_names``, ``router`` or ``gate_up_split``
        contradicting ``family``; an unknown name or malformed factors.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    expert_names, router, gate_up_split = _family_choices(family, layout, expert_names, router,
                                                          gate_up_split)
    if gate_up_split not in ("halves", "interleaved"):
        raise ValueError(f"gate_up_split must be 'halves' or 'interleaved', got {gate_up_split!r}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    rank_pattern = dict(rank_pattern or {})
    alpha_pattern = dict(alpha_pattern or {})
    names, block = EXPERT_NAMES[expert_names] if layout == "experts" else (None, "mlp")

    def put(key: str, v) -> None:
        tensors[key] = np.ascontiguousarray(np.asarray(v, np.float32).astype(dtype))

    def factors(projs) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        return {p: tuple(_as_3d(v, p, w) for v, w in zip(projs[p], ("A", "B")))
                for p in ("gate", "up", "down") if p in projs}

    # one fused rank for every layer: block-diagonal everywhere if any layer's gate and up differ
    block_diagonal = layout == "target_parameters" and any(
        "gate" in m and "up" in m and not _shares_a(m) for m in map(factors, weights.values()))
    for layer, projs in sorted(weights.items()):
        unknown = set(projs) - set(PROJECTIONS)
        if unknown:
            raise ValueError(f"save_peft_adapter: unknown projection(s) {sorted(unknown)} in "
                             f"layer {layer}; known: {PROJECTIONS}")
        base = f"{prefix}layers.{layer}.{block}"
        if "router" in projs:
            a, b = (_as_3d(v, "router", w) for v, w in zip(projs["router"], ("A", "B")))
            put(f"{base}.{router}.lora_A.weight", a[0])
            put(f"{base}.{router}.lora_B.weight", b[0])
        mats = factors(projs)
        if layout == "experts":
            for p, name in zip(("gate", "up", "down"), names):
                if p in mats:
                    a, b = mats[p]
                    for e in range(a.shape[0]):
                        put(f"{base}.experts.{e}.{name}.lora_A.weight", a[e])
                        put(f"{base}.experts.{e}.{name}.lora_B.weight", b[e])
            continue
        if ("gate" in mats) != ("up" in mats):
            raise ValueError("save_peft_adapter: the fused gate_up_proj needs both gate and up")
        order = []
        if "gate" in mats:
            a, b = _fused_gate_up(*mats["gate"], *mats["up"], gate_up_split, block_diagonal)
            order.append((a, b))
        if "down" in mats:
            order.append(mats["down"])
        # the module's parameter order: gate_up_proj innermost (deepest base_layer)
        for i, (a, b) in enumerate(order):
            E, rank, _ = a.shape
            key = f"{base}.experts" + ".base_layer" * (len(order) - 1 - i)
            put(f"{key}.lora_A.weight", a.reshape(E * rank, -1))  # rows e * r + j
            put(f"{key}.lora_B.weight",
                np.transpose(b, (1, 2, 0)).reshape(b.shape[1], E * rank))  # columns j * E + e
    shared_has: set[str] = set()
    for layer, projs in sorted((shared_experts or {}).items()):
        unknown = set(projs) - {"gate", "up", "down"}
        if unknown:
            raise ValueError(f"save_peft_adapter: unknown shared expert projection(s) "
                             f"{sorted(unknown)} in layer {layer}; known: gate, up, down")
        for p, (a, b) in projs.items():
            a, b = np.asarray(a), np.asarray(b)
            if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
                raise ValueError(f"save_peft_adapter: shared {p} factors must be A [r, K] and "
                                 f"B [N, r], got {a.shape} and {b.shape}")
            stem = f"{prefix}layers.{layer}.mlp.shared_experts.{p}_proj"
            put(f"{stem}.lora_A.weight", a)
            put(f"{stem}.lora_B.weight", b)
            shared_has.add(p)
    shared_names = [f"shared_experts.{p}_proj" for p in ("gate", "up", "down") if p in shared_has]
    for key, v in (extra_tensors or {}).items():
        tensors[key] = np.ascontiguousarray(np.asarray(v))

    has = {p for projs in weights.values() for p in projs}
    if block_diagonal:
        # gate and up fused at twice the rank: keep alpha / r (or alpha / sqrt(r))
        name = "model.layers.0.mlp.experts.gate_up_proj"
        r_gu = int(pattern_value(rank_pattern, name, r))
        alpha_gu = float(pattern_value(alpha_pattern, name, lora_alpha))
        alpha_2r = alpha_gu * (math.sqrt(2) if use_rslora else 2)
        rank_pattern = {_GATE_UP: 2 * r_gu} | {k: v for k, v in rank_pattern.items()
                                               if not re.match(rf"(.*\.)?({k})$", name)}
        alpha_pattern = {_GATE_UP: alpha_2r} | {k: v for k, v in alpha_pattern.items()
                                                if not re.match(rf"(.*\.)?({k})$", name)}
    target_modules: list[str] = []
    target_parameters = None
    if layout == "experts":
        target_modules = (["gate"] if "router" in has else []) + [
            n for p, n in zip(("gate", "up", "down"), names) if p in has] + shared_names
    else:
        target_parameters = (["experts.gate_up_proj"] if "gate" in has else []) + (
            ["experts.down_proj"] if "down" in has else []) + (
            [f"{router}.weight"] if "router" in has else []) + [
            f"{n}.weight" for n in shared_names]
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": int(r),
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "use_rslora": bool(use_rslora),
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": target_modules,
        "target_parameters": target_parameters,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "inference_mode": True,
    }
    if layout == "target_parameters":
        config["peft_version"] = PEFT_FORMAT_VERSION
    config.update(config_overrides or {})
    with needs_extra("peft", "writing PEFT adapters"):
        from safetensors.numpy import save_file

    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return folder
