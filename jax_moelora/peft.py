"""PEFT LoRA adapters for Mixture-of-Experts layers: read and write them.

``load_peft_adapter(path)`` reads a PEFT adapter folder (``adapter_config.json``
and ``adapter_model.safetensors``) with the ``safetensors`` library and keeps
only what an MoE layer folds: per layer, the LoRA pairs of the router and of
every expert's gate, up and down projections, as :class:`ProjectionLoRA`
(zero-padded to a rank that is a multiple of 8, docs/semantics.md §4, with the
PEFT scale ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
``use_rslora``). ``save_peft_adapter`` writes the same files, in any layout
below; the demo and the tests use it to create real PEFT adapters.

Key layouts read (any prefix before ``.layers.``; the block may be named
``mlp``, ``block_sparse_moe`` or ``feed_forward``):

- per expert: ``layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.lora_{A,B}.weight``
  (also Mixtral's ``w1``/``w3``/``w2``), ``lora_A [r, in]``, ``lora_B [out, r]``;
- per expert, fused: ``experts.{E}.gate_up_proj``: one ``lora_A [r, hidden]``
  shared by gate and up, ``lora_B [2 * inter, r]`` (gate rows first, or
  interleaved with ``gate_up_split="interleaved"``);
- router: ``layers.{L}.mlp.gate.lora_{A,B}.weight`` (``feed_forward.router``
  for Llama 4), ``lora_A [r, hidden]``, ``lora_B [num_experts, r]``;
- 3-D expert parameters targeted with ``target_parameters`` (PEFT's
  ``ParamWrapper``, for fused experts such as Qwen3-MoE in transformers v5,
  gpt-oss and Llama 4), described below.

What PEFT writes for ``target_parameters`` (facts read from
``peft/tuners/lora/layer.py``, class ``ParamWrapper``, and PEFT's tests):

- a 3-D parameter is ``(num_experts, in_features, out_features)`` to PEFT;
  ``lora_A`` is ``nn.Linear(in_features, r * num_experts)``, saved as
  ``[E * r, in]``, and ``lora_B`` is ``nn.Linear(r * num_experts,
  out_features)``, saved as ``[out, E * r]``;
- the delta is ``einsum("o r e, e r i -> e i o", B.reshape(out, r, E),
  A.reshape(E, r, in)) * scaling``: ``A``'s rows are expert-major
  (row ``e * r + j``), ``B``'s columns rank-major (column ``j * E + e``);
- ``scaling`` is ``lora_alpha / r`` with ``r`` the per-expert rank (a
  ``rank_pattern`` entry such as ``"experts.gate_up_proj"`` sets it);
- since PEFT 0.19 (``_did_swap_in_out_features``), for ``gate_up_proj`` and
  ``down_proj`` of transformers-v5 experts stored ``[E, out, in]`` the wrapper
  swaps ``in_features``/``out_features`` so that ``lora_A`` still reads the
  projection's input; older releases wrote the two factors the other way
  round (``lora_A [E * r, out]``, ``lora_B [in, E * r]``). Given the model
  widths, the loader recognises that transposed form by its shapes;
- several parameters of one module nest wrappers: the parameter listed last
  in ``target_parameters`` is outermost (``experts.lora_A.weight``), the one
  before it ``experts.base_layer.lora_A.weight``, and so on. The loader takes
  that order from the config, and checks it against the shapes;
- the same tensors reshaped to 3-D (``lora_A [E, r, in]``, ``lora_B
  [out, r, E]``), as some converters write them, are read too.

``rank_pattern`` / ``alpha_pattern`` follow PEFT's ``get_pattern_key``: the
first pattern ``p`` (in insertion order) for which
``re.match(rf"(.*\\.)?({p})$", module_name)`` matches.

Every malformed input raises :class:`AdapterFormatError` (a ``ValueError``)
naming the file or key: a missing or malformed config, an unknown projection,
a shape or rank mismatch, a non-float tensor, an expert id out of range.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from jax_moelora._optional import needs_extra
from jax_moelora.geometry import padded_rank

__all__ = [
    "AdapterFormatError",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "LAYOUTS",
    "PROJECTIONS",
    "PeftAdapter",
    "ProjectionLoRA",
    "load_peft_adapter",
    "save_peft_adapter",
]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

#: The four projections of an MoE layer that carry LoRA pairs.
PROJECTIONS = ("router", "gate", "up", "down")

#: Layouts ``save_peft_adapter`` writes (``load_peft_adapter`` reads them all).
LAYOUTS = ("experts", "gate_up", "target_parameters", "target_parameters_3d",
           "target_parameters_transposed")

_BLOCKS = ("mlp", "block_sparse_moe", "feed_forward")
_ROUTERS = ("gate", "router")
# per-expert module names -> projection (gate_up is split into gate and up)
_EXPERT_MODULES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                   "down_proj": "down", "w2": "down", "gate_up_proj": "gate_up"}
# 3-D expert parameters (target_parameters) -> projection
_EXPERT_PARAMS = {"gate_up_proj": "gate_up", "gate_proj": "gate", "up_proj": "up",
                  "down_proj": "down"}

_KEY = re.compile(
    r"^(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.(?P<module>.+?)"
    r"\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[A-Za-z_][\w-]*))?\.(?P<param>weight|bias)$")


class AdapterFormatError(ValueError):
    """A PEFT adapter that cannot be read or does not fit; names the key."""


@dataclasses.dataclass(frozen=True, eq=False)
class ProjectionLoRA:
    """One projection's LoRA pairs in one layer, dense over expert ids.

    Attributes:
      a: float32 ``[E_t, R, K]``, ``lora_A`` of each expert zero-padded to
        ``R`` (a multiple of 8); zeros where no pair.
      b: float32 ``[E_t, N, R]``, ``lora_B``, zero-padded the same way.
      scale: float32 ``[E_t]``, ``lora_alpha / r`` (or ``/ sqrt(r)``); 0
        where no pair.
      present: bool ``[E_t]``, which experts carry a pair.
      ranks: int32 ``[E_t]``, each pair's rank before padding.
      keys: the ``lora_A`` key each expert's pair was read from (``None``
        where absent), for error messages.

    ``E_t`` is the largest adapted expert id + 1 (1 for the router); ``K``
    is the projection's input width and ``N`` its output width.
    """

    a: np.ndarray
    b: np.ndarray
    scale: np.ndarray
    present: np.ndarray
    ranks: np.ndarray
    keys: tuple[str | None, ...]

    @property
    def n_experts(self) -> int:
        return int(self.a.shape[0])

    @property
    def max_rank(self) -> int:
        return int(self.a.shape[1])

    @property
    def k_in(self) -> int:
        return int(self.a.shape[2])

    @property
    def n_out(self) -> int:
        return int(self.b.shape[1])

    def delta(self, expert: int) -> np.ndarray:
        """``scale * B @ A`` of one expert, float64 ``[N, K]`` (zeros if absent)."""
        return (float(self.scale[expert]) * self.b[expert].astype(np.float64)
                @ self.a[expert].astype(np.float64))

    def key(self, expert: int) -> str:
        k = self.keys[expert] if expert < len(self.keys) else None
        return k if k is not None else f"<expert {expert}>"

    @classmethod
    def from_pairs(cls, pairs: Mapping[int, tuple[np.ndarray, np.ndarray, float, str]],
                   *, n_experts: int | None = None) -> "ProjectionLoRA":
        """Pack ``{expert: (A [r, K], B [N, r], scale, key)}`` densely."""
        if not pairs:
            raise AdapterFormatError("no LoRA pairs to pack")
        ks = {a.shape[1] for a, _, _, _ in pairs.values()}
        ns = {b.shape[0] for _, b, _, _ in pairs.values()}
        if len(ks) != 1 or len(ns) != 1:
            keys = sorted(k for _, _, _, k in pairs.values())
            raise AdapterFormatError(
                f"shape mismatch: the experts of one projection have different widths "
                f"(in {sorted(ks)}, out {sorted(ns)}); keys {keys[:4]}...")
        e_t = max(pairs) + 1 if n_experts is None else n_experts
        R = padded_rank(max(a.shape[0] for a, _, _, _ in pairs.values()))
        (K,), (N,) = ks, ns
        a = np.zeros((e_t, R, K), np.float32)
        b = np.zeros((e_t, N, R), np.float32)
        scale = np.zeros(e_t, np.float32)
        present = np.zeros(e_t, bool)
        ranks = np.zeros(e_t, np.int32)
        keys: list[str | None] = [None] * e_t
        for e, (ae, be, s, key) in pairs.items():
            r = ae.shape[0]
            a[e, :r] = ae
            b[e, :, :r] = be
            scale[e], present[e], ranks[e], keys[e] = s, True, r, key
        return cls(a=a, b=b, scale=scale, present=present, ranks=ranks, keys=tuple(keys))


@dataclasses.dataclass(frozen=True, eq=False)
class PeftAdapter:
    """The MoE part of one PEFT LoRA adapter.

    Attributes:
      name: the adapter's name (the folder name unless given).
      path: the folder it was read from, or ``None``.
      config: the parsed ``adapter_config.json``.
      layers: ``{layer: {projection: ProjectionLoRA}}``, projections from
        ``PROJECTIONS``; a layer or projection without pairs is absent.
      skipped_keys: keys outside the MoE layers (attention, shared experts,
        embeddings...), which this library does not fold.
      dtype: the tensors' dtype in the file (the first one read).
    """

    name: str
    path: str | None
    config: dict[str, Any]
    layers: dict[int, dict[str, ProjectionLoRA]]
    skipped_keys: tuple[str, ...] = ()
    dtype: np.dtype | None = None

    @property
    def num_layers(self) -> int:
        """The largest adapted layer id + 1 (0 if none)."""
        return max(self.layers) + 1 if self.layers else 0

    @property
    def num_experts(self) -> int:
        """The largest adapted expert id + 1 over gate, up and down."""
        return max((p.n_experts for lay in self.layers.values() for name, p in lay.items()
                    if name != "router"), default=0)

    @property
    def max_rank(self) -> int:
        """The largest padded rank over all projections."""
        return max((p.max_rank for lay in self.layers.values() for p in lay.values()), default=0)

    @property
    def projections(self) -> tuple[str, ...]:
        """The projections adapted in some layer, in ``PROJECTIONS`` order."""
        seen = {name for lay in self.layers.values() for name in lay}
        return tuple(p for p in PROJECTIONS if p in seen)


# --------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------

def _read_config(folder: Path) -> dict[str, Any]:
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


def _pattern_value(patterns: Mapping[str, Any] | None, name: str, default):
    """PEFT's ``get_pattern_key`` lookup: the first matching pattern wins."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return value
    return default


def _rank_and_scale(config: Mapping[str, Any], module_name: str) -> tuple[int, float]:
    r = int(_pattern_value(config.get("rank_pattern"), module_name, config["r"]))
    alpha = float(_pattern_value(config.get("alpha_pattern"), module_name, config["lora_alpha"]))
    scale = alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r
    return r, scale


# --------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------

_FLOAT_KINDS = ("float16", "bfloat16", "float32", "float64")


def _read_tensors(path: Path) -> tuple[dict[str, np.ndarray], np.dtype | None]:
    with needs_extra("peft", "reading PEFT adapters"):
        from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise AdapterFormatError(f"missing weights: {path} does not exist")
    tensors: dict[str, np.ndarray] = {}
    first_dtype = None
    try:
        with safe_open(str(path), framework="np") as f:
            for key in f.keys():
                if not _is_moe_lora_key(key):
                    tensors[key] = None  # skipped: read lazily never
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


def _moe_module(module: str) -> tuple[str, str] | None:
    """Split ``mlp.experts.3.gate_proj`` into ``("mlp", "experts.3.gate_proj")``."""
    head, _, rest = module.partition(".")
    if head in _BLOCKS and rest:
        return head, rest
    return None


def _is_moe_lora_key(key: str) -> bool:
    m = _KEY.match(key)
    if m is None:
        return False
    split = _moe_module(m["module"])
    if split is None:
        return False
    rest = split[1]
    return rest in _ROUTERS or rest == "experts" or rest.startswith("experts.")


@dataclasses.dataclass
class _Pair:
    key_a: str | None = None
    key_b: str | None = None
    a: np.ndarray | None = None
    b: np.ndarray | None = None


def _expert_param_order(config: Mapping[str, Any], where: str) -> list[str]:
    """The expert parameters of ``target_parameters`` in config order."""
    names: list[str] = []
    for t in config.get("target_parameters") or []:
        module, _, param = t.rpartition(".")
        if not (module == "experts" or module.endswith(".experts")):
            continue
        if param not in _EXPERT_PARAMS:
            raise AdapterFormatError(f"unknown projection: target_parameters entry {t!r} names "
                                     f"{param!r}; known: {sorted(_EXPERT_PARAMS)}")
        if param not in names:
            names.append(param)
    if not names:
        raise AdapterFormatError(
            f"key {where!r} is a target_parameters LoRA pair, but adapter_config.json lists no "
            "expert parameter in 'target_parameters', so it cannot tell which one it adapts")
    return names


def load_peft_adapter(path: str | os.PathLike, *, name: str | None = None,
                      num_experts: int | None = None, hidden_size: int | None = None,
                      intermediate_size: int | None = None,
                      gate_up_split: Literal["halves", "interleaved"] = "halves") -> PeftAdapter:
    """Read the MoE LoRA pairs of a PEFT adapter folder.

    Args:
      path: a folder holding ``adapter_config.json`` and
        ``adapter_model.safetensors``.
      name: the adapter's name (default: the folder name).
      num_experts, hidden_size, intermediate_size: the model's widths, if
        known: every pair is checked against them (expert ids, in/out
        widths), and transposed ``target_parameters`` factors are recognised.
      gate_up_split: how a fused ``gate_up_proj`` stacks its outputs:
        ``"halves"`` (gate rows first, Qwen3-MoE / Llama 4) or
        ``"interleaved"`` (gate on even rows, gpt-oss).

    Returns:
      A :class:`PeftAdapter`; keys outside the MoE layers are listed in
      ``skipped_keys``.

    Raises:
      AdapterFormatError: naming the file or key, for a missing or malformed
        config, an unknown projection, a shape or rank mismatch, a non-float
        tensor or an expert id out of range.
    """
    if gate_up_split not in ("halves", "interleaved"):
        raise ValueError(f"gate_up_split must be 'halves' or 'interleaved', got {gate_up_split!r}")
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterFormatError(f"missing adapter: {folder} is not a folder")
    config = _read_config(folder)
    tensors, dtype = _read_tensors(folder / WEIGHTS_NAME)

    skipped: list[str] = []
    pairs: dict[tuple[int, str, str], _Pair] = {}  # (layer, module path, slot) -> pair
    infos: dict[tuple[int, str, str], tuple[str, str, str]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if t is None or m is None:
            if "lora_magnitude_vector" in key and ".experts" in key:
                raise AdapterFormatError(f"key {key!r} is a DoRA magnitude; DoRA cannot be folded")
            skipped.append(key)
            continue
        if m["param"] == "bias":
            raise AdapterFormatError(f"key {key!r} is a LoRA bias; LoRA biases cannot be folded")
        layer = int(m["layer"])
        block, rest = _moe_module(m["module"])  # type: ignore[misc]
        module_name = f"{m['prefix']}layers.{layer}.{m['module']}"
        ident = (layer, m["prefix"] + block, rest)
        pair = pairs.setdefault(ident, _Pair())
        if m["kind"] == "lora_A":
            pair.key_a, pair.a = key, t
        else:
            pair.key_b, pair.b = key, t
        infos[ident] = (module_name, block, m["prefix"])

    builders: dict[tuple[int, str], dict[int, tuple]] = {}

    def add(layer: int, proj: str, expert: int, a, b, scale: float, key: str) -> None:
        if num_experts is not None and proj != "router" and not 0 <= expert < num_experts:
            raise AdapterFormatError(f"expert id out of range: key {key!r} adapts expert "
                                     f"{expert}, the model has {num_experts} experts")
        slot = builders.setdefault((layer, proj), {})
        if expert in slot:
            raise AdapterFormatError(f"key {key!r} adapts layer {layer} {proj} expert {expert}, "
                                     f"which {slot[expert][3]!r} already adapts")
        slot[expert] = (np.ascontiguousarray(a), np.ascontiguousarray(b), scale, key)

    target_groups: dict[tuple[int, str], list[tuple[int, _Pair, str]]] = {}
    for ident, pair in sorted(pairs.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        layer, _, rest = ident
        module_name, block, prefix = infos[ident]
        if pair.a is None or pair.b is None:
            have = pair.key_a or pair.key_b
            missing = "lora_B" if pair.a is not None else "lora_A"
            raise AdapterFormatError(f"key {have!r} has no matching {missing} tensor")
        if rest in _ROUTERS:
            a, b = _check_pair_2d(pair, config, module_name)
            r, scale = _rank_and_scale(config, module_name)
            if num_experts is not None and b.shape[0] != num_experts:
                raise AdapterFormatError(f"shape mismatch: router key {pair.key_b!r} has "
                                         f"{b.shape[0]} outputs, the model has {num_experts} "
                                         "experts")
            if hidden_size is not None and a.shape[1] != hidden_size:
                raise AdapterFormatError(f"shape mismatch: router key {pair.key_a!r} reads "
                                         f"{a.shape[1]} inputs, hidden_size is {hidden_size}")
            add(layer, "router", 0, a, b, scale, pair.key_a)
            continue
        parts = rest.split(".")
        if parts[0] != "experts":
            raise AssertionError(rest)  # filtered by _is_moe_lora_key
        if len(parts) == 3 and parts[1].isdigit():
            expert, mod = int(parts[1]), parts[2]
            proj = _EXPERT_MODULES.get(mod)
            if proj is None:
                raise AdapterFormatError(f"unknown projection: key {pair.key_a!r} adapts expert "
                                         f"module {mod!r}; known: {sorted(_EXPERT_MODULES)}")
            a, b = _check_pair_2d(pair, config, module_name)
            _, scale = _rank_and_scale(config, module_name)
            for p, bp in _split_gate_up(proj, b, pair.key_b, gate_up_split):
                _check_widths(p, a, bp, pair, hidden_size, intermediate_size)
                add(layer, p, expert, a, bp, scale, pair.key_a)
            continue
        depth = 0
        while len(parts) > 1 and parts[-1] == "base_layer":
            parts.pop()
            depth += 1
        if len(parts) == 1:
            experts_path = f"{prefix}layers.{layer}.{block}.experts"
            target_groups.setdefault((layer, experts_path), []).append((depth, pair, module_name))
            continue
        if len(parts) == 2 and depth == 0:
            param = parts[1]
            if param not in _EXPERT_PARAMS:
                raise AdapterFormatError(f"unknown projection: key {pair.key_a!r} adapts expert "
                                         f"parameter {param!r}; known: {sorted(_EXPERT_PARAMS)}")
            _add_target_param(add, layer, param, pair, module_name.rsplit(".", 1)[0], config,
                              num_experts, hidden_size, intermediate_size, gate_up_split)
            continue
        raise AdapterFormatError(f"unknown projection: key {pair.key_a!r} is under experts but "
                                 f"matches no known layout")

    for (layer, module_path), group in target_groups.items():
        order = _expert_param_order(config, group[0][1].key_a)
        params = _assign_nested(group, order, hidden_size, intermediate_size)
        for (depth, pair, _), param in zip(group, params):
            _add_target_param(add, layer, param, pair, module_path, config, num_experts,
                              hidden_size, intermediate_size, gate_up_split)

    layers: dict[int, dict[str, ProjectionLoRA]] = {}
    for (layer, proj), slot in sorted(builders.items()):
        n = 1 if proj == "router" else num_experts
        layers.setdefault(layer, {})[proj] = ProjectionLoRA.from_pairs(slot, n_experts=n)
    for lay in layers.values():
        for proj in [p for p in PROJECTIONS if p in lay]:
            lay[proj] = lay.pop(proj)  # keep PROJECTIONS order
    return PeftAdapter(name=name or folder.name, path=str(folder), config=config, layers=layers,
                       skipped_keys=tuple(sorted(skipped)), dtype=dtype)


def _check_pair_2d(pair: _Pair, config, module_name: str) -> tuple[np.ndarray, np.ndarray]:
    a, b = pair.a, pair.b
    if a.ndim != 2:
        raise AdapterFormatError(f"shape mismatch: key {pair.key_a!r} must be 2-D [r, in], "
                                 f"got {a.shape}")
    if b.ndim != 2:
        raise AdapterFormatError(f"shape mismatch: key {pair.key_b!r} must be 2-D [out, r], "
                                 f"got {b.shape}")
    if a.shape[0] != b.shape[1]:
        raise AdapterFormatError(f"rank mismatch: key {pair.key_a!r} has rank {a.shape[0]} but "
                                 f"{pair.key_b!r} has rank {b.shape[1]}")
    r, _ = _rank_and_scale(config, module_name)
    if a.shape[0] != r:
        raise AdapterFormatError(f"rank mismatch: key {pair.key_a!r} has rank {a.shape[0]}, the "
                                 f"config gives {module_name!r} rank {r}")
    return a, b


def _split_gate_up(proj: str, b: np.ndarray, key: str, split: str):
    if proj != "gate_up":
        return [(proj, b)]
    if b.shape[0] % 2:
        raise AdapterFormatError(f"shape mismatch: fused gate_up key {key!r} has an odd number of "
                                 f"outputs ({b.shape[0]})")
    if split == "interleaved":
        return [("gate", b[0::2]), ("up", b[1::2])]
    half = b.shape[0] // 2
    return [("gate", b[:half]), ("up", b[half:])]


def _check_widths(proj: str, a, b, pair: _Pair, hidden: int | None, inter: int | None) -> None:
    want_in, want_out = {"gate": (hidden, inter), "up": (hidden, inter),
                         "down": (inter, hidden)}[proj]
    if want_in is not None and a.shape[-1] != want_in:
        raise AdapterFormatError(f"shape mismatch: {proj} key {pair.key_a!r} reads {a.shape[-1]} "
                                 f"inputs, the model's {proj} projection reads {want_in}")
    if want_out is not None and b.shape[-2] != want_out:
        raise AdapterFormatError(f"shape mismatch: {proj} key {pair.key_b!r} writes "
                                 f"{b.shape[-2]} outputs, the model's {proj} projection "
                                 f"writes {want_out}")


def _target_factors(pair: _Pair, r: int, num_experts: int | None):
    """``(A [E, r, in], B [E, out, r])`` of a ``target_parameters`` pair."""
    a, b = pair.a, pair.b
    if a.ndim == 3 and b.ndim == 3:
        E, ra, _ = a.shape
        if b.shape[1] != ra or b.shape[2] != E:
            raise AdapterFormatError(f"shape mismatch: 3-D key {pair.key_b!r} {b.shape} does not "
                                     f"pair with {pair.key_a!r} {a.shape} ([out, r, E] after "
                                     "[E, r, in])")
        b3 = np.transpose(b, (2, 0, 1))
    elif a.ndim == 2 and b.ndim == 2:
        if a.shape[0] != b.shape[1]:
            raise AdapterFormatError(f"rank mismatch: key {pair.key_a!r} has {a.shape[0]} rows but "
                                     f"{pair.key_b!r} has {b.shape[1]} columns (both E * r)")
        if a.shape[0] % r:
            raise AdapterFormatError(f"rank mismatch: key {pair.key_a!r} has {a.shape[0]} rows, "
                                     f"not a multiple of the configured rank {r}")
        E = a.shape[0] // r
        a = a.reshape(E, r, a.shape[1])
        b3 = np.transpose(b.reshape(b.shape[0], r, E), (2, 0, 1))
        ra = r
    else:
        raise AdapterFormatError(f"shape mismatch: keys {pair.key_a!r} {a.shape} and "
                                 f"{pair.key_b!r} {b.shape} must both be 2-D or both 3-D")
    if ra != r:
        raise AdapterFormatError(f"rank mismatch: key {pair.key_a!r} has rank {ra}, the config "
                                 f"gives rank {r}")
    if num_experts is not None and E != num_experts:
        raise AdapterFormatError(f"shape mismatch: key {pair.key_a!r} holds {E} experts, the "
                                 f"model has {num_experts}")
    return a, b3


def _io_widths(param: str, hidden: int | None, inter: int | None):
    if hidden is None or inter is None:
        return None
    return {"gate_up_proj": (hidden, 2 * inter), "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter), "down_proj": (inter, hidden)}[param]


def _flat_in_out(pair: _Pair) -> tuple[int, int]:
    if pair.a.ndim == 3:
        return pair.a.shape[2], pair.b.shape[0]
    return pair.a.shape[-1], pair.b.shape[0]


def _assign_nested(group, order: Sequence[str], hidden, inter) -> list[str]:
    """Which parameter each nested pair (by ``base_layer`` depth) adapts."""
    n = len(order)
    by_order = []
    for depth, pair, _ in group:
        if depth >= n:
            raise AdapterFormatError(
                f"key {pair.key_a!r} is nested {depth} wrappers deep, but target_parameters "
                f"lists only {n} expert parameter(s): {list(order)}")
        by_order.append(order[n - 1 - depth])
    if hidden is None or inter is None or len(group) < 2:
        return by_order

    def fits(param, pair):
        want = _io_widths(param, hidden, inter)
        got = _flat_in_out(pair)
        return got == want or got == want[::-1]

    if all(fits(p, pair) for p, (_, pair, _) in zip(by_order, group)):
        return by_order
    # the config order contradicts the shapes: a unique fit by shapes wins
    import itertools

    fits_all = [perm for perm in itertools.permutations(order, len(group))
                if all(fits(p, pair) for p, (_, pair, _) in zip(perm, group))]
    if len(fits_all) == 1:
        return list(fits_all[0])
    keys = [g[1].key_a for g in group]
    raise AdapterFormatError(f"shape mismatch: the nested expert keys {keys} "
                             f"do not fit the parameters {list(order)} of target_parameters")


def _add_target_param(add, layer: int, param: str, pair: _Pair, module_path: str, config,
                      num_experts, hidden, inter, split: str) -> None:
    name = f"{module_path}.{param}"
    r, scale = _rank_and_scale(config, name)
    a3, b3 = _target_factors(pair, r, num_experts)
    want = _io_widths(param, hidden, inter)
    if want is not None:
        got = (a3.shape[2], b3.shape[1])
        if got != want and got == want[::-1] and want[0] != want[1]:
            # factors written the other way round (PEFT < 0.19 on [E, out, in]
            # parameters): x @ B_e  @ A_e, so A' = B_e^T and B' = A_e^T.
            a3, b3 = np.transpose(b3, (0, 2, 1)), np.transpose(a3, (0, 2, 1))
        elif got != want:
            raise AdapterFormatError(f"shape mismatch: {param} key {pair.key_a!r} maps {got[0]} "
                                     f"inputs to {got[1]} outputs, the model's {param} maps "
                                     f"{want[0]} to {want[1]}")
    proj = _EXPERT_PARAMS[param]
    for e in range(a3.shape[0]):
        for p, bp in _split_gate_up(proj, b3[e], pair.key_b, split):
            add(layer, p, e, a3[e], bp, scale, pair.key_a)


# --------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------

def _as_3d(v, name: str, what: str) -> np.ndarray:
    v = np.asarray(v)
    if v.ndim == 2:
        v = v[None]
    if v.ndim != 3:
        raise ValueError(f"save_peft_adapter: {name} {what} must be 3-D [E, ...], got {v.shape}")
    return v


def save_peft_adapter(path: str | os.PathLike,
                      weights: Mapping[int, Mapping[str, tuple[Any, Any]]], *,
                      r: int, lora_alpha: float, layout: str = "experts",
                      use_rslora: bool = False, rank_pattern: Mapping[str, int] | None = None,
                      alpha_pattern: Mapping[str, float] | None = None,
                      dtype: Any = np.float32, prefix: str = "base_model.model.model.",
                      block: str = "mlp", gate_up_split: str = "halves",
                      base_model_name_or_path: str | None = None,
                      extra_tensors: Mapping[str, Any] | None = None,
                      config_overrides: Mapping[str, Any] | None = None) -> Path:
    """Write a PEFT LoRA adapter folder for MoE layers.

    Args:
      path: the folder to create (or overwrite files in).
      weights: ``{layer: {projection: (A, B)}}`` of unscaled factors:
        ``A [E, r, K]`` and ``B [E, N, r]`` for gate, up and down (expert
        ``e`` is row ``e``), ``A [r, hidden]`` / ``B [num_experts, r]`` (or
        with a leading 1) for the router.
      r, lora_alpha, use_rslora, rank_pattern, alpha_pattern: written to the
        config as they are (the caller keeps them consistent with the
        factors' ranks).
      layout: ``"experts"`` (per-expert ``gate_proj``/``up_proj``/
        ``down_proj``), ``"gate_up"`` (per-expert fused ``gate_up_proj``,
        gate and up must share A), ``"target_parameters"`` (PEFT's
        ``ParamWrapper`` keys for ``experts.gate_up_proj`` and
        ``experts.down_proj``, 2-D), ``"target_parameters_3d"`` (the same
        reshaped to 3-D) or ``"target_parameters_transposed"`` (2-D with the
        two factors swapped, as PEFT < 0.19 wrote them for ``[E, out, in]``
        parameters).
      dtype: tensor dtype in the file (numpy float dtype, or
        ``ml_dtypes.bfloat16``).
      prefix, block: key prefix before ``layers.`` and the MoE block's name.
      gate_up_split: ``"halves"`` or ``"interleaved"``, for fused layouts.
      extra_tensors: more tensors to write as they are (e.g. attention LoRA).
      config_overrides: more config entries (override the defaults).

    Returns:
      The folder.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    fused = layout != "experts"

    def put(key: str, v) -> None:
        tensors[key] = np.ascontiguousarray(np.asarray(v, np.float32).astype(dtype))

    for layer, projs in sorted(weights.items()):
        unknown = set(projs) - set(PROJECTIONS)
        if unknown:
            raise ValueError(f"save_peft_adapter: unknown projection(s) {sorted(unknown)} in "
                             f"layer {layer}; known: {PROJECTIONS}")
        base = f"{prefix}layers.{layer}.{block}"
        if "router" in projs:
            a, b = (_as_3d(v, "router", w) for v, w in zip(projs["router"], ("A", "B")))
            put(f"{base}.gate.lora_A.weight", a[0])
            put(f"{base}.gate.lora_B.weight", b[0])
        mats = {p: tuple(_as_3d(v, p, w) for v, w in zip(projs[p], ("A", "B")))
                for p in ("gate", "up", "down") if p in projs}
        if fused and ("gate" in mats) != ("up" in mats):
            raise ValueError("save_peft_adapter: fused layouts need both gate and up")
        if fused and "gate" in mats:
            (ag, bg), (au, bu) = mats["gate"], mats["up"]
            if ag.shape != au.shape or not np.array_equal(ag, au):
                raise ValueError("save_peft_adapter: a fused gate_up layout needs gate and up to "
                                 "share lora_A")
            if gate_up_split == "interleaved":
                b_gu = np.stack([bg, bu], axis=2).reshape(bg.shape[0], -1, bg.shape[2])
            else:
                b_gu = np.concatenate([bg, bu], axis=1)
            mats["gate_up"] = (ag, b_gu)
            del mats["gate"], mats["up"]
        if layout in ("experts", "gate_up"):
            names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj",
                     "gate_up": "gate_up_proj"}
            for p, (a, b) in mats.items():
                for e in range(a.shape[0]):
                    put(f"{base}.experts.{e}.{names[p]}.lora_A.weight", a[e])
                    put(f"{base}.experts.{e}.{names[p]}.lora_B.weight", b[e])
            continue
        # target_parameters: gate_up_proj is listed first (inner), down_proj last (outer)
        order = [p for p in ("gate_up", "down") if p in mats]
        for i, p in enumerate(order):
            a, b = mats[p]  # [E, r, K], [E, N, r]
            E, rank, _ = a.shape
            nest = ".base_layer" * (len(order) - 1 - i)
            key = f"{base}.experts{nest}"
            b_ore = np.transpose(b, (1, 2, 0))  # [N, r, E]
            if layout == "target_parameters_3d":
                put(f"{key}.lora_A.weight", a)
                put(f"{key}.lora_B.weight", b_ore)
            elif layout == "target_parameters":
                put(f"{key}.lora_A.weight", a.reshape(E * rank, -1))
                put(f"{key}.lora_B.weight", b_ore.reshape(b.shape[1], E * rank))
            else:  # transposed: lora_A carries B^T, lora_B carries A^T
                bt = np.transpose(b, (0, 2, 1))  # [E, r, N]
                at = np.transpose(a, (2, 1, 0))  # [K, r, E]
                put(f"{key}.lora_A.weight", bt.reshape(E * rank, -1))
                put(f"{key}.lora_B.weight", at.reshape(a.shape[2], E * rank))
    for key, v in (extra_tensors or {}).items():
        tensors[key] = np.ascontiguousarray(np.asarray(v))

    has = {p for projs in weights.values() for p in projs}
    target_modules = (["gate"] if "router" in has else [])
    target_parameters = None
    if layout == "experts":
        target_modules += [n for p, n in (("gate", "gate_proj"), ("up", "up_proj"),
                                          ("down", "down_proj")) if p in has]
    elif layout == "gate_up":
        target_modules += (["gate_up_proj"] if "gate" in has else []) + (
            ["down_proj"] if "down" in has else [])
    else:
        target_parameters = (["experts.gate_up_proj"] if "gate" in has else []) + (
            ["experts.down_proj"] if "down" in has else [])
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
        "rank_pattern": dict(rank_pattern or {}),
        "alpha_pattern": dict(alpha_pattern or {}),
        "inference_mode": True,
    }
    config.update(config_overrides or {})
    with needs_extra("peft", "writing PEFT adapters"):
        from safetensors.numpy import save_file

    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return folder
