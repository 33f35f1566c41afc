"""PEFT LoRA adapters for Mixture-of-Experts layers: read every layout peft writes, write what
peft loads.

- ``load_peft_adapter(path)`` (``reader.py``) reads an adapter folder
  (``adapter_config.json`` and ``adapter_model.safetensors``) and keeps what an
  MoE layer folds: per layer, the LoRA pairs of the router and of every
  expert's gate, up and down projections as :class:`ProjectionLoRA`
  (zero-padded to a rank that is a multiple of 8, docs/semantics.md §4,
  with PEFT's scale ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
  ``use_rslora``), and the shared experts' pairs.
- ``layouts.py`` holds one reader per key layout, each naming the
  peft/transformers releases that write it: the router, transformers-4
  per-expert modules, transformers-5 fused experts through
  ``target_parameters`` (both factor orders: peft <= 0.19.0 and >= 0.19.1),
  shared experts.
- ``save_peft_adapter`` (``writer.py``) writes the layout peft 0.21 loads
  into a transformers 5 model (default), or transformers-4 per-expert modules
  under the model family's names (``family=``); ``write_layouts.py`` holds
  the tensors and targets of each.

Every malformed input raises :class:`AdapterFormatError` (a ``ValueError``)
naming the file or key. ``tests/fixtures/peft/`` holds adapters made by real
peft with the torch reference deltas and outputs (``scripts/make_peft_fixtures.py``).
"""

from jax_moelora.peft.adapter import (
    PROJECTIONS,
    SHARED_PROJECTIONS,
    AdapterFormatError,
    PeftAdapter,
    ProjectionLoRA,
)
from jax_moelora.peft.config import CONFIG_NAME
from jax_moelora.peft.reader import WEIGHTS_NAME, load_peft_adapter
from jax_moelora.peft.writer import EXPERT_NAMES, LAYOUTS, PEFT_FORMAT_VERSION, save_peft_adapter

__all__ = [
    "AdapterFormatError",
    "CONFIG_NAME",
    "EXPERT_NAMES",
    "LAYOUTS",
    "PEFT_FORMAT_VERSION",
    "PROJECTIONS",
    "SHARED_PROJECTIONS",
    "WEIGHTS_NAME",
    "PeftAdapter",
    "ProjectionLoRA",
    "load_peft_adapter",
    "save_peft_adapter",
]
