"""``load_peft_adapter``: sort a PEFT adapter file's keys into the layout readers.

Keys are ``<prefix>layers.{L}.<block>.<module>.lora_{A,B}[.<adapter>].weight``
with any prefix, ``<block>`` one of ``mlp``, ``block_sparse_moe``,
``feed_forward``. Under the block:

- ``gate`` / ``router``: the router (``layouts.read_router``);
- ``experts.{e}.<name>``: per-expert modules (``layouts.read_per_expert``);
- ``experts`` with any number of ``.base_layer``: fused expert parameters
  (``layouts.read_fused_experts``);
- ``shared_experts.<name>`` / ``shared_expert.<name>``: the shared expert MLP
  (``layouts.read_shared_expert``).

Everything else (attention, dense MLPs, embeddings...) is listed in
``PeftAdapter.skipped_keys``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

import numpy as np

from jax_moelora._optional import needs_extra

from jax_moelora.peft import layouts
from jax_moelora.peft.adapter import (
    PROJECTIONS,
    SHARED_PROJECTIONS,
    AdapterFormatError,
    PeftAdapter,
    ProjectionLoRA,
)
from jax_moelora.peft.config import CONFIG_NAME, read_config
from jax_moelora.peft.layouts import Pair, Widths

WEIGHTS_NAME = "adapter_model.safetensors"

_BLOCKS = ("mlp", "block_sparse_moe", "feed_forward")
_ROUTERS = ("gate", "router")
_SHARED = ("shared_experts", "shared_expert")
_KEY = re.compile(
    r"^(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.(?P<module>.+?)"
    r"\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[A-Za-z_][\w-]*))?\.(?P<param>weight|bias)$")
_FLOAT_KINDS = ("float16", "bfloat16", "float32", "float64")
_MODEL_PREFIX = "base_model.model."


def _moe_rest(module: str) -> str | None:
    """``mlp.experts.3.gate_proj`` -> ``experts.3.gate_proj``; ``None`` outside an MoE block."""
    head, _, rest = module.partition(".")
    if head not in _BLOCKS or not rest:
        return None
    first = rest.split(".", 1)[0]
    if rest in _ROUTERS or first == "experts" or first in _SHARED:
        return rest
    return None


def _read_tensors(path: Path) -> tuple[dict[str, np.ndarray | None], np.dtype | None]:
    """Every key of the file; the MoE LoRA tensors as float32, the others ``None``."""
    with needs_extra("peft", "reading PEFT adapters"):
        from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise AdapterFormatError(f"missing weights: {path} does not exist")
    tensors: dict[str, np.ndarray | None] = {}
    first_dtype = None
    try:
        with safe_open(str(path), framework="np") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None or _moe_rest(m["module"]) is None:
                    tensors[key] = None
                    continue
                t = f.get_tensor(key)
                if np.dtype(t.dtype).name not in _FLOAT_KINDS:
                    raise AdapterFormatError(
                        f"non-float tensor: key {key!r} has dtype {np.dtype(t.dtype).name}; "
                        "LoRA factors must be float16, bfloat16, float32 or float64")
                if first_dtype is None:
                    first_dtype = np.dtype(t.dtype)
                tensors[key] = np.asarray(t, np.float32)
    except SafetensorError as err:
        raise AdapterFormatError(f"malformed weights {path}: {err}") from err
    return tensors, first_dtype


def _weight_name(module_path: str, config) -> str:
    """The name peft matched ``rank_pattern`` against: ``<module>.weight`` when the module's
    weight is a ``target_parameters`` entry, else the module path."""
    for t in config.get("target_parameters") or []:
        if t.endswith(".weight") and (f"{module_path}.weight" == t
                                      or f"{module_path}.weight".endswith("." + t)):
            return f"{module_path}.weight"
    return module_path


def load_peft_adapter(path: str | os.PathLike, *, name: str | None = None,
                      num_experts: int | None = None, hidden_size: int | None = None,
                      intermediate_size: int | None = None,
                      gate_up_split: Literal["halves", "interleaved"] = "halves",
                      lora_a_reads: Literal["auto", "input", "output"] = "auto") -> PeftAdapter:
    """Read the MoE LoRA pairs of a PEFT adapter folder.

    Args:
      path: a folder holding ``adapter_config.json`` and
        ``adapter_model.safetensors``.
      name: the adapter's name (default: the folder name).
      num_experts, hidden_size, intermediate_size: the model's widths (the
        routed experts' ``moe_intermediate_size``), if known: every pair is
        checked against them, and they decide the fused layouts the shapes
        alone cannot (``layouts.read_fused_experts``).
      gate_up_split: how a fused ``gate_up_proj`` stacks its outputs:
        ``"halves"`` (gate rows first: Qwen3-MoE, Mixtral, DeepSeek, Llama 4)
        or ``"interleaved"`` (gate on even rows: gpt-oss).
      lora_a_reads: ``"auto"`` (decide from the shapes), or ``"input"`` /
        ``"output"``: which side of a fused expert parameter ``lora_A`` reads
        (``"output"`` for peft <= 0.19.0 on ``[E, out, in]`` parameters).

    Returns:
      A :class:`PeftAdapter`: ``layers`` (router and routed experts),
      ``shared_experts``, and the keys outside the MoE blocks in
      ``skipped_keys``.

    Raises:
      AdapterFormatError: naming the file or key, for a missing or malformed
        config, a file with no MoE LoRA pair, an unknown projection, a shape
        or rank mismatch, a non-float tensor, an expert id out of range, or
        fused keys whose reading the shapes cannot decide (the message says
        which argument to pass).
    """
    if gate_up_split not in ("halves", "interleaved"):
        raise ValueError(f"gate_up_split must be 'halves' or 'interleaved', got {gate_up_split!r}")
    if lora_a_reads not in ("auto", "input", "output"):
        raise ValueError(f"lora_a_reads must be 'auto', 'input' or 'output', got {lora_a_reads!r}")
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterFormatError(f"missing adapter: {folder} is not a folder")
    config = read_config(folder)
    weights = folder / WEIGHTS_NAME
    tensors, dtype = _read_tensors(weights)
    widths = Widths(num_experts, hidden_size, intermediate_size)
    pairs, skipped = _pairs(tensors)
    if not pairs:
        raise AdapterFormatError(
            f"no LoRA pair: {weights} holds no lora_A/lora_B tensor of an MoE block (router, "
            f"experts or shared experts) ({len(tensors)} key(s), e.g. {sorted(tensors)[:3]}); "
            "it would serve the base model under the adapter's name")
    found = _Found(num_experts)
    fused = _read_modules(pairs, config, widths, found)
    _read_fused(fused, config, widths, lora_a_reads, gate_up_split, found)
    layers, shared = found.projections()
    return PeftAdapter(name=name or folder.name, path=str(folder), config=config, layers=layers,
                       skipped_keys=tuple(sorted(skipped)), dtype=dtype, shared_experts=shared,
                       layout="+".join(sorted(found.layouts)))


PairKey = tuple[int, str, str]  # (layer, block path, module under the block)


def _pairs(tensors: dict[str, np.ndarray | None]) -> tuple[dict[PairKey, Pair], list[str]]:
    """The MoE LoRA tensors matched into ``lora_A`` / ``lora_B`` pairs by
    module, and the keys skipped (outside the MoE blocks)."""
    skipped: list[str] = []
    pairs: dict[PairKey, Pair] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if t is None or m is None:
            if "lora_magnitude_vector" in key and ".experts" in key:
                raise AdapterFormatError(f"key {key!r} is a DoRA magnitude; DoRA cannot be folded")
            skipped.append(key)
            continue
        if m["param"] == "bias":
            raise AdapterFormatError(f"key {key!r} is a LoRA bias; LoRA biases cannot be folded")
        block = m["module"].split(".", 1)[0]
        block_path = f"{m['prefix']}layers.{m['layer']}.{block}".removeprefix(_MODEL_PREFIX)
        pair = pairs.setdefault((int(m["layer"]), block_path, _moe_rest(m["module"])), Pair())
        if m["kind"] == "lora_A":
            pair.key_a, pair.a = key, t
        else:
            pair.key_b, pair.b = key, t
    return pairs, skipped


class _Found:
    """The pairs read so far: ``(layer, projection) -> {expert: (A, B, scale,
    key)}`` of the routed experts and router, and of the shared experts; the
    layouts seen."""

    def __init__(self, num_experts: int | None):
        self.num_experts = num_experts
        self.routed: dict[tuple[int, str], dict[int, tuple]] = {}
        self.shared: dict[tuple[int, str], dict[int, tuple]] = {}
        self.layouts: set[str] = set()

    def add(self, layer: int, proj: str, expert: int, factors, *, shared: bool = False) -> None:
        a, b, scale, key = factors
        if (not shared and self.num_experts is not None and proj != "router"
                and not 0 <= expert < self.num_experts):
            raise AdapterFormatError(f"expert id out of range: key {key!r} adapts expert "
                                     f"{expert}, the model has {self.num_experts} experts")
        slot = (self.shared if shared else self.routed).setdefault((layer, proj), {})
        if expert in slot:
            raise AdapterFormatError(f"key {key!r} adapts layer {layer} {proj} expert {expert}, "
                                     f"which {slot[expert][3]!r} already adapts")
        slot[expert] = (np.ascontiguousarray(a), np.ascontiguousarray(b), scale, key)

    def projections(self) -> tuple[dict, dict]:
        """``(layers, shared_experts)`` as ``{layer: {projection: ProjectionLoRA}}``."""
        layers: dict[int, dict[str, ProjectionLoRA]] = {}
        for (layer, proj), slot in sorted(self.routed.items(), key=lambda kv: (
                kv[0][0], PROJECTIONS.index(kv[0][1]))):
            n = 1 if proj == "router" else self.num_experts
            layers.setdefault(layer, {})[proj] = ProjectionLoRA.from_pairs(slot, n_experts=n)
        shared: dict[int, dict[str, ProjectionLoRA]] = {}
        for (layer, proj), slot in sorted(self.shared.items(), key=lambda kv: (
                kv[0][0], SHARED_PROJECTIONS.index(kv[0][1]))):
            shared.setdefault(layer, {})[proj] = ProjectionLoRA.from_pairs(slot, n_experts=1)
        return layers, shared


def _read_modules(pairs: dict[PairKey, Pair], config, widths: Widths,
                  found: _Found) -> dict[tuple[int, str], list[tuple[int, Pair]]]:
    """Each pair through its layout's reader (router, shared expert, per-expert
    module) into ``found``; returns the fused experts' pairs by ``(layer,
    experts path)`` with their ``base_layer`` depth, read together later."""
    fused: dict[tuple[int, str], list[tuple[int, Pair]]] = {}
    for (layer, block_path, rest), pair in sorted(pairs.items(), key=lambda kv: kv[0]):
        if pair.a is None or pair.b is None:
            have = pair.key_a or pair.key_b
            missing = "lora_B" if pair.a is not None else "lora_A"
            raise AdapterFormatError(f"key {have!r} has no matching {missing} tensor")
        module_path = f"{block_path}.{rest}"
        parts = rest.split(".")
        if rest in _ROUTERS:
            found.add(layer, "router", 0, layouts.read_router(
                pair, config, _weight_name(module_path, config), widths))
            found.layouts.add("router")
        elif parts[0] in _SHARED:
            if len(parts) != 2:
                raise AdapterFormatError(f"unknown projection: key {pair.key_a!r} is under "
                                         f"{parts[0]} but matches no known layout")
            proj, factors = layouts.read_shared_expert(
                pair, config, _weight_name(module_path, config), parts[1], widths.hidden)
            found.add(layer, proj, 0, factors, shared=True)
            found.layouts.add("shared_expert")
        elif len(parts) == 3 and parts[1].isdigit():
            proj, factors = layouts.read_per_expert(pair, config, module_path, parts[2], widths)
            found.add(layer, proj, int(parts[1]), factors)
            found.layouts.add("per_expert")
        elif all(p == "base_layer" for p in parts[1:]):
            fused.setdefault((layer, f"{block_path}.experts"), []).append((len(parts) - 1, pair))
        else:
            raise AdapterFormatError(f"unknown projection: key {pair.key_a!r} is under experts "
                                     "but matches no known layout")
    return fused


def _read_fused(fused, config, widths: Widths, lora_a_reads: str, gate_up_split: str,
                found: _Found) -> None:
    """The fused expert parameters of each layer (``layouts.read_fused_experts``)
    into ``found``, a fused ``gate_up_proj`` split into gate and up."""
    for (layer, experts_path), group in fused.items():
        for param, a3, b3, scale, key in layouts.read_fused_experts(
                group, config, experts_path, widths, lora_a_reads):
            b_key = key.replace("lora_A", "lora_B")
            for e in range(a3.shape[0]):
                if param == "gate_up_proj":
                    bg, bu = layouts.split_gate_up(b3[e], b_key, gate_up_split)
                    found.add(layer, "gate", e, (a3[e], bg, scale, key))
                    found.add(layer, "up", e, (a3[e], bu, scale, key))
                else:
                    found.add(layer, "down", e, (a3[e], b3[e], scale, key))
        found.layouts.add("fused_experts")


__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "load_peft_adapter"]
