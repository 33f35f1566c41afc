"""A stack of MoE layers on hidden states: ``layers`` x (RMSNorm -> :class:`MoEBlock` -> residual).

The MoE part of a decoder (the attention sublayers are left out: this library
folds the MoE part), as the demo and the fine-tuning example run it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_moelora.nnx.block import ExpertPathOption, MoEBlock
from jax_moelora.nnx.experts import ExpertGemm
from jax_moelora.nnx.families import MoEFamily
from jax_moelora.nnx.lora import MoELoRAPacks

__all__ = ["MoEStack"]


class MoEStack(nnx.Module):
    """``num_layers`` x (RMSNorm -> :class:`MoEBlock` -> residual) on ``[T, H]``.

    Args:
      hidden_size, intermediate_size, num_experts, top_k: every block's shape.
      num_layers: the layers (>= 1).
      family: the blocks' family (a config or its name; see :class:`MoEBlock`).
      max_loras, max_rank: the blocks' LoRA pools.
      dtype: activation and parameter dtype.
      impl, expert_path, expert_gemm, gather_max_rows: passed to every block.
      rngs: initialisation keys.

    State: ``norms`` and ``blocks`` (``nnx.List`` of ``nnx.RMSNorm`` and
    :class:`MoEBlock`, one per layer). A call runs every layer in one traced
    program.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 num_layers: int, *, family: MoEFamily | str | None = None, max_loras: int = 4,
                 max_rank: int = 16, dtype: Any = jnp.float32, impl: str = "auto",
                 expert_path: ExpertPathOption = "auto", expert_gemm: ExpertGemm = "auto",
                 gather_max_rows: int | None = None, rngs: nnx.Rngs):
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"MoEStack: num_layers must be an int >= 1, got {num_layers!r}")
        self.norms = nnx.List([nnx.RMSNorm(hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
                               for _ in range(num_layers)])
        self.blocks = nnx.List([
            MoEBlock(hidden_size, intermediate_size, num_experts, top_k, family=family,
                     max_loras=max_loras, max_rank=max_rank, dtype=dtype, impl=impl,
                     expert_path=expert_path, expert_gemm=expert_gemm,
                     gather_max_rows=gather_max_rows, rngs=rngs)
            for _ in range(num_layers)])

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def in_gemm_packs(self) -> list[MoELoRAPacks]:
        """Every block's ``lora.in_gemm_packs()`` (traceable), for ``lora_packs``."""
        return [block.lora.in_gemm_packs() for block in self.blocks]

    def layers(self, h: jax.Array, adapter_ids: jax.Array | None, *, impl: str | None = None,
               use_lora: bool = True, lora_packs: Sequence[MoELoRAPacks] | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``h [T, H]`` through every layer -> ``(h [T, H], block_inputs [L, T,
        H], block_outputs [L, T, H])`` (the blocks' dtype); ``adapter_ids``
        int32 ``[T]`` (-1: the base model), as :class:`MoEBlock` takes them;
        ``lora_packs``: :meth:`in_gemm_packs` made beforehand, or None."""
        if lora_packs is not None and len(lora_packs) != len(self.blocks):
            raise ValueError(f"MoEStack: lora_packs has {len(lora_packs)} entries, the stack "
                             f"{len(self.blocks)} layers")
        packs = [None] * len(self.blocks) if lora_packs is None else list(lora_packs)
        ins, outs = [], []
        for norm, block, pack in zip(self.norms, self.blocks, packs):
            z = norm(h)
            o = block(z, adapter_ids, impl=impl, use_lora=use_lora, lora_packs=pack)
            ins.append(z)
            outs.append(o)
            h = h + o
        return h, jnp.stack(ins), jnp.stack(outs)

    def __call__(self, h: jax.Array, adapter_ids: jax.Array | None = None, *,
                 impl: str | None = None, use_lora: bool = True,
                 lora_packs: Sequence[MoELoRAPacks] | None = None) -> jax.Array:
        """``h [T, H]`` -> the last layer's output ``[T, H]``."""
        return self.layers(h, adapter_ids, impl=impl, use_lora=use_lora,
                           lora_packs=lora_packs)[0]
