"""The adapter data model: one projection's LoRA pairs, one adapter, the format error.

Shapes and dtypes are given on each class; every array is float32 numpy, dense
over expert ids and zero-padded to a rank that is a multiple of 8
(docs/semantics.md §4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from jax_moelora.geometry import padded_rank

#: The four projections of an MoE layer that carry LoRA pairs.
PROJECTIONS = ("router", "gate", "up", "down")

#: The projections of a shared expert MLP.
SHARED_PROJECTIONS = ("gate", "up", "down")


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
      skipped_keys: keys outside the MoE layers (attention, embeddings...),
        which this library does not fold.
      dtype: the tensors' dtype in the file (the first one read).
      shared_experts: ``{layer: {"gate" | "up" | "down": ProjectionLoRA}}`` of
        the always-applied shared expert MLP (DeepSeek ``shared_experts``,
        Qwen2-MoE ``shared_expert``), one "expert" each (``n_experts == 1``).
      layout: which layouts the expert pairs were read in (the names of
        ``jax_moelora.peft.layouts``' readers, joined by ``+``).
    """

    name: str
    path: str | None
    config: dict[str, Any]
    layers: dict[int, dict[str, ProjectionLoRA]]
    skipped_keys: tuple[str, ...] = ()
    dtype: np.dtype | None = None
    shared_experts: dict[int, dict[str, ProjectionLoRA]] = dataclasses.field(default_factory=dict)
    layout: str = ""

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
