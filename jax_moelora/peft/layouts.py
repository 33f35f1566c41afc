"""One reader per PEFT key layout of an MoE layer's LoRA pairs.

Every reader takes the pairs of one module (:class:`Pair`: the ``lora_A``
and ``lora_B`` tensors of one key stem, float32) and returns per-expert factors
``(A [r, K], B [N, r])`` in the usual LoRA sense (``delta = scale * B @ A``
maps the projection's ``K`` inputs to its ``N`` outputs), with PEFT's scale.
``load_peft_adapter`` (``reader.py``) sorts the keys of a file into these
readers.

Model widths: ``H`` hidden size, ``I`` expert intermediate size, ``E``
experts, ``r`` the rank of the pair (``rank_pattern`` applied).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jax_moelora.peft.adapter import AdapterFormatError
from jax_moelora.peft.config import FIXED_FACTOR_ORDER, peft_version, rank_and_scale

#: per-expert module names of transformers 4 MoE blocks -> projection
EXPERT_MODULES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                  "down_proj": "down", "w2": "down"}
#: 3-D expert parameters of transformers 5 fused experts (and gpt-oss, Llama 4)
FUSED_PARAMS = ("gate_up_proj", "down_proj")
#: shared expert MLP module names -> projection
SHARED_MODULES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

Factors = tuple[np.ndarray, np.ndarray, float, str]  # A [r, K], B [N, r], scale, lora_A key


@dataclasses.dataclass
class Pair:
    """The ``lora_A`` / ``lora_B`` tensors (float32) of one key stem, with their keys."""

    key_a: str | None = None
    key_b: str | None = None
    a: np.ndarray | None = None
    b: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Widths:
    """The model widths the caller gave (``None``: unknown)."""

    num_experts: int | None = None
    hidden: int | None = None
    inter: int | None = None


def _linear_pair(pair: Pair, config: Mapping[str, Any], name: str) -> Factors:
    """A 2-D ``lora_A [r, in]``, ``lora_B [out, r]`` pair with its config rank and scale."""
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
    r, scale = rank_and_scale(config, name)
    if a.shape[0] != r:
        raise AdapterFormatError(f"rank mismatch: key {pair.key_a!r} has rank {a.shape[0]}, the "
                                 f"config gives {name!r} rank {r}")
    return a, b, scale, pair.key_a


def split_gate_up(b: np.ndarray, key: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(B_gate, B_up)`` of a fused ``gate_up`` ``B [2I, r]``: halves or interleaved rows."""
    if b.shape[0] % 2:
        raise AdapterFormatError(f"shape mismatch: fused gate_up key {key!r} has an odd number of "
                                 f"outputs ({b.shape[0]})")
    if split == "interleaved":
        return b[0::2], b[1::2]
    half = b.shape[0] // 2
    return b[:half], b[half:]


def check_widths(proj: str, a: np.ndarray, b: np.ndarray, key_a: str, key_b: str,
                 widths: Widths) -> None:
    want_in, want_out = {"gate": (widths.hidden, widths.inter), "up": (widths.hidden, widths.inter),
                         "down": (widths.inter, widths.hidden)}[proj]
    if want_in is not None and a.shape[-1] != want_in:
        raise AdapterFormatError(f"shape mismatch: {proj} key {key_a!r} reads {a.shape[-1]} "
                                 f"inputs, the model's {proj} projection reads {want_in}")
    if want_out is not None and b.shape[-2] != want_out:
        raise AdapterFormatError(f"shape mismatch: {proj} key {key_b!r} writes {b.shape[-2]} "
                                 f"outputs, the model's {proj} projection writes {want_out}")


# --------------------------------------------------------------------------
# router
# --------------------------------------------------------------------------

def read_router(pair: Pair, config: Mapping[str, Any], name: str, widths: Widths) -> Factors:
    """The router's pair: ``mlp.gate`` (``router`` for gpt-oss and Llama 4).

    ``lora_A [r, H]``, ``lora_B [E, r]``. Written by every peft release with
    LoRA: on transformers 4 the router is an ``nn.Linear`` (``target_modules``
    ``"gate"``); on transformers 5 it is a router module with a 2-D ``weight``
    that peft >= 0.17 adapts through ``target_parameters`` (``"gate.weight"``,
    ``"mlp.router.weight"``; peft 0.21 writes ``"gate.weight"`` for the recipe
    ``target_modules=[..., "gate"]``). Both write the same keys and factors.
    """
    a, b, scale, key = _linear_pair(pair, config, name)
    if widths.num_experts is not None and b.shape[0] != widths.num_experts:
        raise AdapterFormatError(f"shape mismatch: router key {pair.key_b!r} has {b.shape[0]} "
                                 f"outputs, the model has {widths.num_experts} experts")
    if widths.hidden is not None and a.shape[1] != widths.hidden:
        raise AdapterFormatError(f"shape mismatch: router key {pair.key_a!r} reads {a.shape[1]} "
                                 f"inputs, hidden_size is {widths.hidden}")
    return a, b, scale, key


# --------------------------------------------------------------------------
# per-expert modules (transformers 4)
# --------------------------------------------------------------------------

def read_per_expert(pair: Pair, config: Mapping[str, Any], name: str, module: str,
                    widths: Widths) -> tuple[str, Factors]:
    """One expert's ``nn.Linear`` pair: ``experts.{e}.{gate,up,down}_proj`` or ``w1/w3/w2``.

    ``lora_A [r, in]``, ``lora_B [out, r]``; Mixtral's ``w1`` is gate, ``w3``
    up, ``w2`` down (block ``block_sparse_moe``). Written by peft (any release)
    on transformers <= 4.57, whose MoE blocks hold one ``nn.Linear`` per expert
    and projection. Returns ``(projection, factors)``.
    """
    proj = EXPERT_MODULES.get(module)
    if proj is None:
        raise AdapterFormatError(f"unknown projection: key {pair.key_a!r} adapts expert module "
                                 f"{module!r}; known: {sorted(EXPERT_MODULES)}")
    a, b, scale, key = _linear_pair(pair, config, name)
    check_widths(proj, a, b, pair.key_a, pair.key_b, widths)
    return proj, (a, b, scale, key)


# --------------------------------------------------------------------------
# shared experts
# --------------------------------------------------------------------------

def read_shared_expert(pair: Pair, config: Mapping[str, Any], name: str, module: str,
                       hidden: int | None) -> tuple[str, Factors]:
    """A shared expert MLP's pair: ``shared_experts.{gate,up,down}_proj`` (DeepSeek-V2/V3).

    ``lora_A [r, in]``, ``lora_B [out, r]``, the shared MLP's width being
    ``moe_intermediate_size * n_shared_experts``. peft writes these keys for an
    ``nn.Linear`` module (``target_modules``; peft 0.18 on transformers 5, any
    peft on transformers 4) and for its 2-D weight (``target_parameters``
    ``"shared_experts.gate_proj.weight"``; peft 0.21 on transformers 5, whose
    ``target_modules`` rewrite maps every name ending in ``gate_proj``,
    ``up_proj`` or ``down_proj`` to the routed experts). Qwen2-MoE's
    ``shared_expert`` reads the same way.
    """
    proj = SHARED_MODULES.get(module)
    if proj is None:
        raise AdapterFormatError(f"unknown projection: key {pair.key_a!r} adapts shared expert "
                                 f"module {module!r}; known: {sorted(SHARED_MODULES)}")
    a, b, scale, key = _linear_pair(pair, config, name)
    if hidden is not None:
        got = a.shape[1] if proj != "down" else b.shape[0]
        if got != hidden:
            side = "reads" if proj != "down" else "writes"
            raise AdapterFormatError(f"shape mismatch: shared {proj} key {key!r} {side} {got}, "
                                     f"hidden_size is {hidden}")
    return proj, (a, b, scale, key)


# --------------------------------------------------------------------------
# fused experts (target_parameters)
# --------------------------------------------------------------------------

def fused_params_of(config: Mapping[str, Any]) -> list[str]:
    """The fused expert parameters ``target_parameters`` names, bare or dotted, once each."""
    out: list[str] = []
    for t in config.get("target_parameters") or []:
        module, _, param = t.rpartition(".")
        if param not in FUSED_PARAMS:
            continue
        if module and not (module == "experts" or module.endswith(".experts")):
            continue
        if param not in out:
            out.append(param)
    return out


@dataclasses.dataclass(frozen=True)
class _Reading:
    params: tuple[str, ...]  # the parameter of each pair
    lora_a_reads_input: bool
    experts: int
    hidden: int
    inter: int


def _readings(group: Sequence[Pair], params: Sequence[str], config, experts_path: str,
              widths: Widths, lora_a_reads: str) -> list[_Reading]:
    """Every (parameter per pair, factor order) that fits the shapes, ranks and widths."""
    version = peft_version(config)
    orders = {"input": (True,), "output": (False,), "auto": (True, False)}[lora_a_reads]
    if lora_a_reads == "auto" and version is not None and version >= FIXED_FACTOR_ORDER:
        orders = (True,)
    out = []
    for perm in itertools.permutations(params, len(group)):
        for reads_input in orders:
            hs, inters, es = set(), set(), set()
            ok = True
            for pair, param in zip(group, perm):
                r, _ = rank_and_scale(config, f"{experts_path}.{param}")
                rows, a_width, b_width = pair.a.shape[0], pair.a.shape[1], pair.b.shape[0]
                k_in, n_out = (a_width, b_width) if reads_input else (b_width, a_width)
                if rows % r:
                    ok = False
                    break
                es.add(rows // r)
                if param == "gate_up_proj":
                    hs.add(k_in)
                    ok &= n_out % 2 == 0
                    inters.add(n_out // 2)
                else:
                    inters.add(k_in)
                    hs.add(n_out)
            if not ok or len(hs) != 1 or len(inters) != 1 or len(es) != 1:
                continue
            (h,), (i,), (e,) = hs, inters, es
            if ((widths.hidden is not None and h != widths.hidden)
                    or (widths.inter is not None and i != widths.inter)):
                continue
            out.append(_Reading(tuple(perm), reads_input, e, h, i))
    return out


def read_fused_experts(group: Sequence[tuple[int, Pair]], config: Mapping[str, Any],
                       experts_path: str, widths: Widths,
                       lora_a_reads: str = "auto") -> list[tuple[str, np.ndarray, np.ndarray,
                                                                 float, str]]:
    """The pairs of one ``experts`` module's 3-D parameters (peft ``target_parameters``).

    Keys: ``experts.lora_{A,B}.weight`` and, when several parameters of the
    module are targeted, ``experts.base_layer.lora_{A,B}.weight`` (one
    ``base_layer`` per nesting level). peft nests the wrappers in the module's
    own parameter order (``gate_up_proj`` innermost, at the deepest
    ``base_layer``), whatever order ``target_parameters`` lists (peft 0.21
    keeps a rewritten list in a set, so its saved order follows the hash
    seed). The parameter of each pair is therefore decided from the shapes:
    ``gate_up_proj`` maps ``H`` inputs to ``2I`` outputs, ``down_proj`` ``I``
    to ``H``, and the ranks must divide the rows.

    Layout: ``lora_A [E * r, in]`` with expert-major rows (``e * r + j``),
    ``lora_B [out, E * r]`` with rank-major columns (``j * E + e``):
    ``delta_e = scale * B[:, j * E + e] @ A[e * r + j]``. Which side ``in``
    is differs between releases, for parameters stored ``[E, out, in]``
    (transformers 5 Qwen3-MoE, Mixtral, DeepSeek-V2/V3; ``is_transposed`` is
    False) and ``[E, in, out]`` (gpt-oss, ``is_transposed`` True):

    - peft 0.17.x - 0.18.x take ``(E, in, out)`` from the parameter's shape as
      it is: on ``[E, out, in]`` parameters ``lora_A`` reads the projection's
      *output* (``lora_A [E * r, out]``, ``lora_B [in, E * r]``); on gpt-oss
      it reads the input;
    - peft 0.19.0 swaps in and out when ``is_transposed`` is True: ``lora_A``
      reads the output on both kinds;
    - peft >= 0.19.1 (``peft/tuners/lora/layer.py``, ``ParamWrapper.update_layer``:
      swap when ``ndim == 3 and not is_transposed``): ``lora_A`` always reads
      the projection's input. peft 0.21 writes this layout.

    ``peft_version`` in the config (peft >= 0.18) tells a >= 0.19.1 file; an
    older version string proves nothing (peft 0.21 keeps the version of a
    transformers-4 adapter it converts, in the new layout). So the factor
    order is decided from the shapes: with both parameters, or with the
    caller's ``hidden_size`` / ``intermediate_size``. When they cannot decide,
    ``AdapterFormatError`` says what to pass. ``lora_a_reads`` (``"input"`` /
    ``"output"``) overrides the decision for square cases.

    Returns ``[(param, A [E, r, K], B [E, N, r], scale, lora_A key)]`` in the
    usual orientation.
    """
    pairs = [p for _, p in sorted(group, key=lambda dp: dp[0])]
    params = _fused_params(pairs, config)
    readings = _readings(pairs, params, config, experts_path, widths, lora_a_reads)
    rd = _one_reading(readings, pairs, params, widths)
    out = []
    for pair, param in zip(pairs, rd.params):
        r, scale = rank_and_scale(config, f"{experts_path}.{param}")
        E = rd.experts
        a3 = pair.a.reshape(E, r, pair.a.shape[1])  # [E, r, a_width]
        b3 = np.transpose(pair.b.reshape(pair.b.shape[0], r, E), (2, 0, 1))  # [E, b_width, r]
        if not rd.lora_a_reads_input:
            # delta_e = A_e^T B_e^T as a map from inputs to outputs: A' = B_e^T, B' = A_e^T
            a3, b3 = np.transpose(b3, (0, 2, 1)), np.transpose(a3, (0, 2, 1))
        out.append((param, a3, b3, scale, pair.key_a))
    return out


def _fused_params(pairs: Sequence[Pair], config: Mapping[str, Any]) -> list[str]:
    """The config's fused expert parameters, after checking the pairs are 2-D
    with matching ranks and as many as those parameters."""
    keys = [p.key_a for p in pairs]
    for p in pairs:
        if p.a.ndim != 2 or p.b.ndim != 2:
            raise AdapterFormatError(f"shape mismatch: keys {p.key_a!r} {p.a.shape} and "
                                     f"{p.key_b!r} {p.b.shape} must both be 2-D "
                                     "([E * r, in], [out, E * r])")
        if p.a.shape[0] != p.b.shape[1]:
            raise AdapterFormatError(f"rank mismatch: key {p.key_a!r} has {p.a.shape[0]} rows but "
                                     f"{p.key_b!r} has {p.b.shape[1]} columns (both E * r)")
    params = fused_params_of(config)
    if not params:
        raise AdapterFormatError(
            f"key {keys[0]!r} is a target_parameters LoRA pair, but adapter_config.json lists "
            f"no expert parameter ({' or '.join(FUSED_PARAMS)}) in 'target_parameters', so "
            "it cannot tell which one it adapts")
    if len(params) != len(pairs):
        raise AdapterFormatError(
            f"keys {keys} hold {len(pairs)} nested target_parameters pair(s), but "
            f"adapter_config.json lists {len(params)} expert parameter(s): {params}")
    return params


def _one_reading(readings: Sequence[_Reading], pairs: Sequence[Pair], params: Sequence[str],
                 widths: Widths) -> _Reading:
    """The one reading the shapes and widths allow, or the error that says
    what is missing (none fits; several do; the experts disagree)."""
    keys = [p.key_a for p in pairs]
    if not readings:
        shapes = [(p.a.shape, p.b.shape) for p in pairs]
        raise AdapterFormatError(
            f"shape mismatch: the target_parameters keys {keys} (lora_A, lora_B shapes "
            f"{shapes}) fit no reading of {params} with the config's ranks"
            + (f" and the model's widths (hidden_size={widths.hidden}, "
               f"intermediate_size={widths.inter})" if widths.hidden or widths.inter else ""))
    distinct = {(rd.params, rd.lora_a_reads_input) for rd in readings}
    if len(distinct) > 1:
        options = "; ".join(f"{dict(zip(keys, rd.params))} with lora_A reading the "
                            f"{'input' if rd.lora_a_reads_input else 'output'} "
                            f"(hidden {rd.hidden}, intermediate {rd.inter})" for rd in readings)
        raise AdapterFormatError(
            f"ambiguous target_parameters keys {keys}: the shapes fit several readings "
            f"({options}); pass hidden_size= and intermediate_size= (the model's widths), or "
            "lora_a_reads='input' (peft >= 0.19.1) / 'output' (peft <= 0.19.0 on [E, out, in] "
            "parameters) to load_peft_adapter")
    rd = readings[0]
    if widths.num_experts is not None and rd.experts != widths.num_experts:
        raise AdapterFormatError(f"shape mismatch: key {keys[0]!r} holds {rd.experts} experts, "
                                 f"the model has {widths.num_experts}")
    return rd
