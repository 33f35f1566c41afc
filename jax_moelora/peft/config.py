"""``adapter_config.json``: read and check it, and PEFT's per-module rank and alpha.

``rank_pattern`` / ``alpha_pattern`` follow PEFT's ``get_pattern_key``: the
first pattern ``p`` (in insertion order) for which
``re.match(rf"(.*\\.)?({p})$", name)`` matches, where ``name`` is the module
path in the model (``model.layers.0.mlp.experts.0.gate_proj``) or, for a
``target_parameters`` entry, the module path and the parameter name
(``model.layers.0.mlp.experts.gate_up_proj``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jax_moelora.peft.adapter import AdapterFormatError

CONFIG_NAME = "adapter_config.json"

#: The first peft release whose ``target_parameters`` LoRA reads the input of
#: every 3-D expert parameter with ``lora_A`` (see ``layouts.read_fused_experts``).
FIXED_FACTOR_ORDER = (0, 19, 1)


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise AdapterFormatError(f"missing config: {path} does not exist")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AdapterFormatError(f"malformed config {path}: not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise AdapterFormatError(f"malformed config {path}: expected a JSON object, "
                                 f"got {type(config).__name__}")
    where = f"{path.name}"
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterFormatError(f"{where}: peft_type is {peft_type!r}; only LORA adapters fold")
    for field in ("r", "lora_alpha"):
        if field not in config:
            raise AdapterFormatError(f"malformed config {where}: missing {field!r}")
    r, alpha = config["r"], config["lora_alpha"]
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterFormatError(f"malformed config {where}: 'r' must be a positive int, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterFormatError(f"malformed config {where}: 'lora_alpha' must be a number, "
                                 f"got {alpha!r}")
    for field, kind in (("rank_pattern", int), ("alpha_pattern", (int, float))):
        pat = config.get(field) or {}
        if not isinstance(pat, dict):
            raise AdapterFormatError(f"malformed config {where}: {field!r} must be an object")
        for k, v in pat.items():
            ok = isinstance(v, kind) and not isinstance(v, bool) and v > 0
            if not ok:
                what = "int" if kind is int else "number"
                raise AdapterFormatError(f"malformed config {where}: {field}[{k!r}] must be a "
                                         f"positive {what}, got {v!r}")
            try:
                re.compile(k)
            except re.error as err:
                raise AdapterFormatError(f"malformed config {where}: {field} key {k!r} is not a "
                                         f"valid pattern ({err})") from err
    if not isinstance(config.get("use_rslora", False), bool):
        raise AdapterFormatError(f"malformed config {where}: 'use_rslora' must be true or false")
    tp = config.get("target_parameters")
    if tp is not None and (not isinstance(tp, list) or not all(isinstance(t, str) for t in tp)):
        raise AdapterFormatError(f"malformed config {where}: 'target_parameters' must be a list "
                                 f"of strings, got {tp!r}")
    if config.get("use_dora"):
        raise AdapterFormatError(f"{where}: use_dora is set; DoRA adapters cannot be folded")
    if config.get("lora_bias"):
        raise AdapterFormatError(f"{where}: lora_bias is set; LoRA biases cannot be folded")
    return config


def pattern_value(patterns: Mapping[str, Any] | None, name: str, default):
    """PEFT's ``get_pattern_key`` lookup: the first matching pattern wins."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return value
    return default


def rank_and_scale(config: Mapping[str, Any], module_name: str) -> tuple[int, float]:
    r = int(pattern_value(config.get("rank_pattern"), module_name, config["r"]))
    alpha = float(pattern_value(config.get("alpha_pattern"), module_name, config["lora_alpha"]))
    scale = alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r
    return r, scale


def peft_version(config: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The ``peft_version`` the config records (peft >= 0.18 writes it), as ints, or ``None``.

    A ``.dev`` or local suffix is dropped: ``"0.19.1.dev0"`` -> ``(0, 19, 1)``.
    """
    v = config.get("peft_version")
    if not isinstance(v, str):
        return None
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", v)
    if m is None:
        return None
    return tuple(int(g or 0) for g in m.groups())

