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

The tensors of each layout are written by ``write_layouts.py``.
``scripts/check_peft_writer.py`` loads what this writes with real peft and
compares the deltas.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jax_moelora._optional import needs_extra

from jax_moelora.peft.adapter import PROJECTIONS
from jax_moelora.peft.config import CONFIG_NAME
from jax_moelora.peft.reader import WEIGHTS_NAME
from jax_moelora.peft.write_layouts import (EXPERT_NAMES, Put, as_3d, block_diagonal,
                                            expert_factors, expert_targets, fused_patterns,
                                            fused_targets, write_expert_layer, write_fused_layer)

#: Layouts ``save_peft_adapter`` writes (``load_peft_adapter`` reads them and more).
LAYOUTS = ("target_parameters", "experts")

#: The peft release whose files the ``target_parameters`` layout matches (recorded as the
#: config's ``peft_version``: a reader takes it to mean ``lora_A`` reads the input).
PEFT_FORMAT_VERSION = "0.21.2"

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
      weights: ``{layer: {projection: (A, B)}}`` of unscaled factors: ``A [E, r,
        K]``, ``B [E, N, r]`` for gate, up and down (expert ``e`` is row ``e``),
        ``A [r, hidden]``, ``B [num_experts, r]`` (or with a leading 1) for the router.
      r, lora_alpha, use_rslora, rank_pattern, alpha_pattern: written to the
        config (the caller keeps them consistent with the factors' ranks; the
        patterns match peft's names, e.g. ``"down_proj"``).
      layout: ``"target_parameters"`` (default) or ``"experts"`` (module docstring).
      dtype: the file's tensor dtype (a numpy float dtype, ``ml_dtypes.bfloat16``).
      prefix: key prefix before ``layers.``.
      family: the model family (a name of ``FAMILY_LAYOUTS``: ``"qwen3"``,
        ``"mixtral"``, ``"deepseek-v2"``, ``"deepseek-v3"``, ``"gpt-oss"``, or a
        family config, ``block.family``): it gives ``expert_names``, ``router``
        and ``gate_up_split``, which must agree with it where given as well.
      expert_names: ``"qwen3"`` or ``"mixtral"``: the ``"experts"`` layout's
        module and block names (``layout="experts"`` needs it or ``family``).
      router: the router module's name (``"gate"``, ``"router"`` for gpt-oss).
      gate_up_split: ``"halves"`` or ``"interleaved"`` (gpt-oss): how the fused
        ``gate_up_proj`` stacks gate and up.
      shared_experts: ``{layer: {"gate" | "up" | "down": (A [r, K], B [N, r])}}``
        of a shared expert MLP (DeepSeek-V2/V3): ``mlp.shared_experts.*_proj``,
        targeted as ``target_parameters`` ``"shared_experts.gate_proj.weight"``
        ... (peft 0.21 rewrites such ``target_modules`` into the routed
        experts'), or as ``target_modules`` in the ``"experts"`` layout.
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
    tensors: dict[str, np.ndarray] = {}

    def put(key: str, v) -> None:
        tensors[key] = np.ascontiguousarray(np.asarray(v, np.float32).astype(dtype))

    names, block = EXPERT_NAMES[expert_names] if layout == "experts" else (None, "mlp")
    fused_block = layout == "target_parameters" and block_diagonal(weights)
    for layer, projs in sorted(weights.items()):
        _write_layer(put, f"{prefix}layers.{layer}.{block}", projs, layout, names, router,
                     gate_up_split, fused_block, layer)
    shared_names = _write_shared(put, prefix, shared_experts or {})
    for key, v in (extra_tensors or {}).items():
        tensors[key] = np.ascontiguousarray(np.asarray(v))
    has = {p for projs in weights.values() for p in projs}
    patterns = (dict(rank_pattern or {}), dict(alpha_pattern or {}))
    if fused_block:
        patterns = fused_patterns(*patterns, r, lora_alpha, use_rslora)
    if layout == "experts":
        targets = {"target_modules": expert_targets(has, names, shared_names)}
    else:
        targets = {"target_parameters": fused_targets(has, router, shared_names),
                   "peft_version": PEFT_FORMAT_VERSION}
    config = _config(r, lora_alpha, use_rslora, *patterns, base_model_name_or_path)
    return _write_folder(Path(path), tensors, config | targets | dict(config_overrides or {}))


def _write_layer(put: Put, base: str, projs: Mapping[str, Any], layout: str, names, router: str,
                 split: str, fused_block: bool, layer: int) -> None:
    """One layer's router and expert pairs under ``base`` (``...layers.{L}.<block>``)."""
    unknown = set(projs) - set(PROJECTIONS)
    if unknown:
        raise ValueError(f"save_peft_adapter: unknown projection(s) {sorted(unknown)} in "
                         f"layer {layer}; known: {PROJECTIONS}")
    if "router" in projs:
        a, b = (as_3d(v, "router", w) for v, w in zip(projs["router"], ("A", "B")))
        put(f"{base}.{router}.lora_A.weight", a[0])
        put(f"{base}.{router}.lora_B.weight", b[0])
    mats = expert_factors(projs)
    if layout == "experts":
        write_expert_layer(put, base, mats, names)
    else:
        write_fused_layer(put, base, mats, split, fused_block)


def _write_shared(put: Put, prefix: str, shared: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """The shared expert pairs, as ``mlp.shared_experts.{p}_proj``; returns
    the module names written (``shared_experts.gate_proj`` ...)."""
    written: set[str] = set()
    for layer, projs in sorted(shared.items()):
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
            written.add(p)
    return [f"shared_experts.{p}_proj" for p in ("gate", "up", "down") if p in written]


def _config(r: int, lora_alpha: float, use_rslora: bool, rank_pattern: dict,
            alpha_pattern: dict, base_model_name_or_path: str | None) -> dict[str, Any]:
    """``adapter_config.json`` without its targets."""
    return {
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
        "target_modules": [],
        "target_parameters": None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "inference_mode": True,
    }


def _write_folder(folder: Path, tensors: dict[str, np.ndarray], config: dict[str, Any]) -> Path:
    with needs_extra("peft", "writing PEFT adapters"):
        from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return folder
