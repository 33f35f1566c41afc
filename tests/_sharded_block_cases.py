"""Blocks and batches for the sharded ``MoEBlock`` checks (8 CPU devices) and
the multi-process worker.

Imported by subprocesses that set ``XLA_FLAGS`` first: nothing here touches
JAX's backends at import time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_moelora.nnx import DeepSeekV2, DeepSeekV3, GptOss, Mixtral, MoEBlock, Qwen3MoE

H, I, E, TOP_K, SLOTS, RANK = 16, 16, 8, 2, 4, 4

#: every family, with the options that change its arithmetic switched on
FAMILIES = {
    "qwen3": Qwen3MoE(),
    "mixtral": Mixtral(),
    "gpt-oss": GptOss(limit=2.0),  # a small limit: the clamps act on some rows
    "deepseek-v2": DeepSeekV2(topk_method="group_limited_greedy", n_group=2, topk_group=1,
                              routed_scaling_factor=1.5, n_shared=1),
    "deepseek-v3": DeepSeekV3(n_group=2, topk_group=1, routed_scaling_factor=2.0, n_shared=1),
}


def make_block(family: str, *, dtype=jnp.bfloat16, adapters: int = SLOTS, seed: int = 0,
               **kw) -> MoEBlock:
    """A block with ``adapters`` trainable adapters installed (random ``A``
    and ``B``) in slots ``0 .. adapters - 1`` of ``SLOTS``; biases random."""
    normal = nnx.initializers.normal(0.5)
    block = MoEBlock(H, I, E, TOP_K, family=FAMILIES[family], max_loras=SLOTS, max_rank=8,
                     dtype=dtype, bias_init=normal, router_bias_init=normal,
                     lora_b_initializer=nnx.initializers.normal(0.4), rngs=nnx.Rngs(seed),
                     **kw)
    for slot in range(adapters):
        block.lora.init_adapter(slot, rngs=nnx.Rngs(seed + 10 + slot), rank=RANK, alpha=8.0)
    return block


def inputs(seed: int, tokens: int, adapters: int, dtype=jnp.bfloat16):
    """``(x [T, H], adapter ids int32 [T])``: ids in ``[-1, adapters)``, -1
    (the base model) on every fourth token at least."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    ids = rng.integers(0, adapters, tokens).astype(np.int32)
    ids[::4] = -1
    return jnp.asarray(x, dtype), jnp.asarray(ids)


@nnx.jit(static_argnames="use_lora")
def forward(block: MoEBlock, x, ids, use_lora: bool = True):
    return block(x, ids, use_lora=use_lora)


def loss(block: MoEBlock, x, ids, w):
    """``sum_t <block(x, ids)[t], w[t]>`` in float32."""
    return jnp.sum(block(x, ids).astype(jnp.float32) * w)


#: d loss / d (LoRA pools), an ``nnx.State`` of the ``nnx.LoRAParam`` variables
lora_grad = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))


def host(v) -> np.ndarray:
    return np.asarray(jax.device_get(v), np.float32)
