"""The adapter pool: a name -> slot registry over the LoRA state of a model's layers.

Slots have fixed shapes (``MoELoRA``'s pool layout), so loading, replacing
and unloading an adapter rewrite a block of the pools and a row of the
tables in place: a jitted step that takes the model state as an argument
keeps its one compiled program across every change, and tokens on other
slots keep their bits.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from jax_moelora.nnx.block import MoEBlock
from jax_moelora.nnx.lora import MoELoRA
from jax_moelora.peft import AdapterFormatError, PeftAdapter, ProjectionLoRA, load_peft_adapter

__all__ = ["AdapterPool"]


class AdapterPool:
    """Name -> slot registry of the adapters installed in a model's layers.

    Args:
      layers: the ``MoELoRA`` of each layer (layer ``i`` of an adapter goes to
        ``layers[i]``), or the ``MoEBlock``\\ s.
      gate_up_split: how a fused ``gate_up_proj`` adapter read from a folder
        stacks gate and up (``"halves"`` or ``"interleaved"``); default: the
        blocks' family (interleaved for gpt-oss), else ``"halves"``.

    ``load`` puts an adapter (a :class:`PeftAdapter` or a PEFT folder) in a
    free slot (or a given one, or the least recently used one's with
    ``evict=True``), ``replace`` overwrites a slot, ``unload`` zeroes it. A
    load is validated against every layer before anything is written, so a
    rejected adapter leaves the pool unchanged.
    """

    def __init__(self, layers: Sequence[MoELoRA | MoEBlock], *,
                 gate_up_split: str | None = None):
        found, splits = [], set()
        for i, lay in enumerate(layers):
            lora = lay.lora if isinstance(lay, MoEBlock) else lay
            if isinstance(lay, MoEBlock):
                splits.add(lay.family.gate_up_split)
            if not isinstance(lora, MoELoRA):
                raise TypeError(f"AdapterPool: layer {i} has no MoELoRA state")
            found.append(lora)
        if not found:
            raise ValueError("AdapterPool: no layers")
        if len({lay.max_loras for lay in found}) != 1:
            raise ValueError("AdapterPool: layers differ in max_loras")
        if gate_up_split is None:
            if len(splits) > 1:
                raise ValueError("AdapterPool: the blocks' families stack gate_up_proj "
                                 "differently; pass gate_up_split")
            gate_up_split = splits.pop() if splits else "halves"
        self.gate_up_split = gate_up_split
        self.layers: list[MoELoRA] = found
        self.max_loras = found[0].max_loras
        self._slots: dict[str, int] = {}
        self._adapters: dict[int, PeftAdapter] = {}
        self._last_used: dict[int, int] = {}  # slot -> tick of its last load or ids() use
        self._tick = 0

    # -- queries ----------------------------------------------------------
    @property
    def names(self) -> dict[str, int]:
        """``{name: slot}`` of the installed adapters."""
        return dict(self._slots)

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def adapter(self, name_or_slot: str | int) -> PeftAdapter:
        return self._adapters[self.slot_of(name_or_slot)]

    def slot_of(self, name_or_slot: str | int) -> int:
        if isinstance(name_or_slot, (int, np.integer)):
            if int(name_or_slot) not in self._adapters:
                raise KeyError(f"no adapter in slot {name_or_slot}")
            return int(name_or_slot)
        if name_or_slot not in self._slots:
            raise KeyError(f"no adapter named {name_or_slot!r}; installed: {sorted(self._slots)}")
        return self._slots[name_or_slot]

    def free_slots(self) -> list[int]:
        return [s for s in range(self.max_loras) if s not in self._adapters]

    def ids(self, names: Sequence[str | None]) -> np.ndarray:
        """Per-token adapter ids: ``None`` (or ``"base"``) -> -1, names -> slots.
        The adapters named count as used (see ``load(..., evict=True)``)."""
        out = np.asarray([-1 if n is None or n == "base" else self.slot_of(n) for n in names],
                         np.int32)
        for slot in sorted(set(out[out >= 0].tolist())):
            self._touch(slot)
        return out

    def least_recently_used(self) -> str | None:
        """The installed adapter whose last load or ``ids()`` use is oldest."""
        if not self._adapters:
            return None
        return self._adapters[min(self._adapters, key=self._last_used.__getitem__)].name

    def _touch(self, slot: int) -> None:
        self._tick += 1
        self._last_used[slot] = self._tick

    # -- changes ----------------------------------------------------------
    def _resolve(self, adapter: PeftAdapter | str | os.PathLike) -> PeftAdapter:
        if isinstance(adapter, PeftAdapter):
            return adapter
        lay = self.layers[0]
        return load_peft_adapter(adapter, num_experts=lay.num_experts,
                                 hidden_size=lay.hidden_size,
                                 intermediate_size=lay.intermediate_size,
                                 gate_up_split=self.gate_up_split)

    def _check(self, adapter: PeftAdapter) -> None:
        n = len(self.layers)
        for layer, projs in _layer_projections(adapter).items():
            if layer >= n:
                lora = next(iter(projs.values()))
                raise AdapterFormatError(
                    f"layer out of range: key {lora.key(int(np.argmax(lora.present)))!r} adapts "
                    f"layer {layer}, the model has {n} MoE layers")
            self.layers[layer].check_adapter(projs, where=f"layer {layer} ")

    def _write(self, slot: int, adapter: PeftAdapter) -> None:
        projections = _layer_projections(adapter)
        for i, lay in enumerate(self.layers):
            lay.set_adapter(slot, projections.get(i, {}), where=f"layer {i} ")

    def load(self, adapter: PeftAdapter | str | os.PathLike, name: str | None = None, *,
             slot: int | None = None, evict: bool = False) -> int:
        """Install an adapter in a free slot (the lowest, or ``slot``); returns it.

        With ``evict=True`` and every slot taken, the least recently used
        adapter (:meth:`least_recently_used`) is evicted and its slot
        overwritten; a rejected adapter evicts nothing."""
        adapter = self._resolve(adapter)
        name = adapter.name if name is None else name
        if name in self._slots:
            raise ValueError(f"an adapter named {name!r} is installed (slot "
                             f"{self._slots[name]}); use replace() or another name")
        if slot is None:
            free = self.free_slots()
            if not free and evict:
                victim = self.least_recently_used()
                self._check(adapter)
                return self.replace(victim, adapter, name)
            if not free:
                raise ValueError(f"all {self.max_loras} adapter slots are taken "
                                 f"({sorted(self._slots)}); unload one first, or pass "
                                 f"evict=True")
            slot = free[0]
        elif not 0 <= slot < self.max_loras:
            raise ValueError(f"slot must be in [0, {self.max_loras}), got {slot}")
        elif slot in self._adapters:
            raise ValueError(f"slot {slot} holds {self._adapters[slot].name!r}; use replace()")
        self._check(adapter)
        self._write(slot, adapter)
        self._slots[name] = slot
        self._adapters[slot] = _renamed(adapter, name)
        self._touch(slot)
        return slot

    def replace(self, name_or_slot: str | int, adapter: PeftAdapter | str | os.PathLike,
                name: str | None = None) -> int:
        """Overwrite an installed adapter's slot with another adapter."""
        slot = self.slot_of(name_or_slot)
        adapter = self._resolve(adapter)
        new_name = adapter.name if name is None else name
        old_name = self._adapters[slot].name
        if new_name != old_name and new_name in self._slots:
            raise ValueError(f"an adapter named {new_name!r} is installed in another slot")
        self._check(adapter)
        self._write(slot, adapter)
        del self._slots[old_name]
        self._slots[new_name] = slot
        self._adapters[slot] = _renamed(adapter, new_name)
        self._touch(slot)
        return slot

    def unload(self, name_or_slot: str | int) -> int:
        """Zero an adapter's slot (tables and pools) and forget it; returns the slot."""
        slot = self.slot_of(name_or_slot)
        for lay in self.layers:
            lay.clear_adapter(slot)
        del self._slots[self._adapters.pop(slot).name]
        del self._last_used[slot]
        return slot


def _layer_projections(adapter: PeftAdapter) -> dict[int, dict[str, ProjectionLoRA]]:
    """``{layer: {projection: ProjectionLoRA}}`` in ``MoELoRA``'s names: the
    adapter's layers, plus the pairs of its shared expert MLP (an adapter's
    ``shared_experts``, ``{layer: {"gate" | "up" | "down": ...}}``) as
    ``shared_gate``, ``shared_up`` and ``shared_down``."""
    out = {layer: dict(projs) for layer, projs in adapter.layers.items()}
    for layer, projs in getattr(adapter, "shared_experts", {}).items():
        out.setdefault(layer, {}).update({f"shared_{p}": lora for p, lora in projs.items()})
    return out


def _renamed(adapter: PeftAdapter, name: str) -> PeftAdapter:
    return adapter if adapter.name == name else dataclasses.replace(adapter, name=name)
