"""Random PEFT adapters for MoEBlock tests (hot swap, stacked gate+up)."""

from __future__ import annotations

import numpy as np

from jax_moelora.nnx import MoEBlock
from jax_moelora.peft import PeftAdapter, ProjectionLoRA


def random_adapter(rng: np.random.Generator, block: MoEBlock, name: str, rank: int, *,
                   alpha: float = 2.0, skip_expert: int | None = None) -> PeftAdapter:
    """A one-layer adapter for every LoRA projection of ``block``: factors
    scaled by 1/sqrt(fan-in), scale ``alpha / rank``; ``skip_expert`` stays
    unadapted."""
    projs = {}
    for proj in block.lora.projections:
        p = block.lora.projection(proj)
        pairs = {e: (rng.standard_normal((rank, p.k_in)).astype(np.float32) / np.sqrt(p.k_in),
                     rng.standard_normal((p.n_out, rank)).astype(np.float32) / np.sqrt(rank),
                     alpha / rank, f"{proj}.{e}")
                 for e in range(p.n_experts) if e != skip_expert}
        projs[proj] = ProjectionLoRA.from_pairs(pairs, n_experts=p.n_experts)
    return PeftAdapter(name=name, path=None, config={}, layers={0: projs})
