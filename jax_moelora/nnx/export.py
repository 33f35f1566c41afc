"""An adapter slot of a model's layers, as it is now (trained), as a PEFT folder.

``slot_adapter(blocks, slot)`` reads adapter ``slot`` of every block back
from the pools (``MoELoRA.get_adapter``) as a :class:`PeftAdapter`;
``save_adapter_slot(path, blocks, slot)`` writes it with
``save_peft_adapter`` in the layout peft 0.21 loads into the family's
transformers 5 model (fused experts through ``target_parameters``; gpt-oss's
router ``router`` and interleaved ``gate_up_proj``; DeepSeek's shared
experts). ``load_peft_adapter`` or an :class:`AdapterPool` reads it back.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jax_moelora.nnx.block import MoEBlock
from jax_moelora.peft import PeftAdapter, ProjectionLoRA, save_peft_adapter

__all__ = ["save_adapter_slot", "slot_adapter"]


def _check_blocks(blocks: Sequence[MoEBlock], slot: int, who: str) -> None:
    if not blocks:
        raise ValueError(f"{who}: blocks is empty")
    for i, b in enumerate(blocks):
        if not isinstance(b, MoEBlock) or b.lora is None:
            raise TypeError(f"{who}: blocks[{i}] is not an MoEBlock with LoRA state")
        if type(b.family) is not type(blocks[0].family):
            raise ValueError(f"{who}: blocks[{i}] is a {b.family.name} block, blocks[0] a "
                             f"{blocks[0].family.name} one")
    if not isinstance(slot, (int, np.integer)) or not 0 <= slot < blocks[0].lora.max_loras:
        raise ValueError(f"{who}: slot must be in [0, {blocks[0].lora.max_loras}), got {slot!r}")


def slot_adapter(blocks: Sequence[MoEBlock], slot: int, name: str | None = None) -> PeftAdapter:
    """Adapter ``slot`` of every block (layer ``i`` is ``blocks[i]``) as it is now.

    Returns:
      A :class:`PeftAdapter` (``path=None``): ``layers[i]`` the router, gate,
      up and down pairs of block ``i`` that adapt some expert
      (:class:`ProjectionLoRA`, float32, at the pools' rank), and
      ``shared_experts[i]`` its shared experts' ``"gate"``, ``"up"``,
      ``"down"`` pairs (DeepSeek).
    """
    _check_blocks(blocks, slot, "slot_adapter")
    layers: dict[int, dict[str, ProjectionLoRA]] = {}
    shared: dict[int, dict[str, ProjectionLoRA]] = {}
    for i, block in enumerate(blocks):
        projs = block.lora.get_adapter(slot, where=f"layer {i} ")
        routed = {p: v for p, v in projs.items() if not p.startswith("shared_")}
        own = {p.removeprefix("shared_"): v for p, v in projs.items() if p.startswith("shared_")}
        if routed:
            layers[i] = routed
        if own:
            shared[i] = own
    return PeftAdapter(name=f"slot{slot}" if name is None else name, path=None, config={},
                       layers=layers, shared_experts=shared)


def _rank_and_scale(adapter: PeftAdapter) -> tuple[int, float]:
    """The adapter's rank (the largest used rank, >= 1) and its one scale."""
    loras = [v for group in (adapter.layers, adapter.shared_experts)
             for projs in group.values() for v in projs.values()]
    if not loras:
        raise ValueError(f"save_adapter_slot: adapter {adapter.name!r} adapts nothing")
    rank = max(1, max(int(v.ranks.max(initial=0)) for v in loras))
    scales = np.concatenate([v.scale[v.present] for v in loras])
    if not np.allclose(scales, scales[0], rtol=1e-6, atol=0):
        raise ValueError(f"save_adapter_slot: adapter {adapter.name!r} has scales "
                         f"{sorted(set(scales.tolist()))}; a PEFT config holds one "
                         f"lora_alpha / r")
    return rank, float(scales[0])


def _factors(lora: ProjectionLoRA, r: int) -> tuple[np.ndarray, np.ndarray]:
    """``(A [E_t, r, K], B [E_t, N, r])``; rank rows past ``r`` must be zero."""
    if lora.a[:, r:].any() or lora.b[:, :, r:].any():
        raise ValueError(f"save_adapter_slot: {lora.key(0)} uses more than rank {r}")
    return lora.a[:, :r], lora.b[:, :, :r]


def save_adapter_slot(path: str | os.PathLike, blocks: Sequence[MoEBlock], slot: int, *,
                      base_model_name_or_path: str | None = None,
                      dtype: Any = np.float32) -> Path:
    """Write adapter ``slot`` of ``blocks`` (layer ``i`` is ``blocks[i]``) as a
    PEFT LoRA folder that peft loads into the family's transformers 5 model.

    The rank ``r`` is the largest used rank of any pair (the rows past it are
    zero); ``lora_alpha = scale * r`` with the adapter's one scale (a
    ``ValueError`` names the scales when projections differ). Gate and up
    with different ``A`` are written as peft fuses them (``save_peft_adapter``).

    Args:
      path: the folder to write.
      blocks: the model's MoE blocks, one family.
      slot: the adapter slot.
      base_model_name_or_path: recorded in ``adapter_config.json``.
      dtype: the tensors' dtype in the file.

    Returns:
      The folder.
    """
    _check_blocks(blocks, slot, "save_adapter_slot")
    adapter = slot_adapter(blocks, slot)
    r, scale = _rank_and_scale(adapter)
    weights = {i: {p: _factors(v, r) for p, v in projs.items()}
               for i, projs in adapter.layers.items()}
    shared = {i: {p: tuple(m[0] for m in _factors(v, r)) for p, v in projs.items()}
              for i, projs in adapter.shared_experts.items()}
    family = blocks[0].family
    return save_peft_adapter(path, weights, r=r, lora_alpha=scale * r, dtype=dtype,
                             family=family, shared_experts=shared or None,
                             base_model_name_or_path=base_model_name_or_path)
