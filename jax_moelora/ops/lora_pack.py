"""``pack_lora_in_gemm``: a route's ``scale * B`` blocks in the layout the
CUTLASS kernel reads when it folds the LoRA inside its K loop, made once per
adapter change instead of in every ``expert_matmul`` call
(docs/expert_matmul.md, "Packs made once").

The packs depend on the B pool and the tables only, not on the tokens: a
server makes them when it installs adapters and passes them to every step's
``expert_matmul(..., lora_packs=...)``. Traced ``jnp``: they run wherever the
route lives, inside or outside ``jit``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_moelora.ops.jnp_fold import resolve_pairs
from jax_moelora.tables import MoeExpertRoute

__all__ = ["LoraInGemmPack", "PACK_DTYPES", "pack_lora_in_gemm", "check_pack"]

#: The pool dtypes the kernel folding inside its K loop packs (and so
#: ``pack_lora_in_gemm`` takes).
PACK_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class LoraInGemmPack(NamedTuple):
    """One route's packs (a pytree; ``L`` table rows, ``E_t`` experts, rank ``R``).

    Fields:
      b_ext: ``[E_t, L * R, N]`` in the pools' dtype: expert ``e``'s rows
        ``l * R + r`` hold ``round(scale[l, e] * B[:, r])`` of pair ``(l,
        e)``'s B slot (fp32 product, one rounding); zero for the pairs the
        fold's skip rules reject and in place of each value that is not
        finite.
      marks: int32 ``[L * E_t + 1]``: entry ``l * E_t + e`` is 1 where pair
        ``(l, e)``'s packed values are not all finite (a NaN or inf in its B
        slot, or ``scale * B`` past the dtype's range); the last entry is 1
        when any pair is marked. The kernel folds a marked pair's rows after
        the GEMM, so that its non-finite values reach its rows only.
    """

    b_ext: jax.Array
    marks: jax.Array


def pack_lora_in_gemm(route: MoeExpertRoute) -> LoraInGemmPack:
    """The packs of ``route`` (traced ``jnp``): what ``expert_matmul`` would
    make in each call that folds ``route`` inside the GEMM, bit for bit.

    Args:
      route: a ``MoeExpertRoute`` with bf16 or f16 pools (``b_pool [P, N, R]``).

    Returns:
      a :class:`LoraInGemmPack`. It holds the route's values of now: after
      the route's B pool, tables or scales change, make it again.
    """
    if not isinstance(route, MoeExpertRoute):
        raise TypeError(f"pack_lora_in_gemm: route must be a MoeExpertRoute, got "
                        f"{type(route).__name__}")
    dt = jnp.dtype(route.dtype)
    if dt not in PACK_DTYPES:
        raise TypeError(f"pack_lora_in_gemm: the kernel packs bf16 or f16 pools, got {dt}")
    route = jax.tree_util.tree_map(jnp.asarray, route)
    L, E, R, N = route.max_loras, route.n_experts, route.max_rank, route.n_out
    table_row = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[:, None], (L, E))
    expert = jnp.broadcast_to(jnp.arange(E, dtype=jnp.int32)[None, :], (L, E))
    _, b, scale, ok = resolve_pairs(route, table_row, expert)  # each [L, E]
    f32 = jnp.float32
    packed = (scale[..., None, None] * route.b_pool[b].astype(f32)).astype(dt)
    finite = jnp.isfinite(packed.astype(f32))  # [L, E, N, R]
    bad = ok & ~finite.all(axis=(2, 3))
    packed = jnp.where(ok[..., None, None] & finite, packed, jnp.zeros((), dt))
    b_ext = packed.transpose(1, 0, 3, 2).reshape(E, L * R, N)
    marks = jnp.concatenate([bad.reshape(-1), bad.any()[None]]).astype(jnp.int32)
    return LoraInGemmPack(b_ext, marks)


def check_pack(pack, route: MoeExpertRoute, name: str) -> None:
    """Raise naming ``name`` unless ``pack`` has the shapes and dtypes of
    ``pack_lora_in_gemm(route)``."""
    if not isinstance(pack, LoraInGemmPack):
        raise TypeError(f"expert_matmul: {name} must be a LoraInGemmPack (pack_lora_in_gemm), "
                        f"got {type(pack).__name__}")
    L, E, R, N = route.max_loras, route.n_experts, route.max_rank, route.n_out
    want = ((E, L * R, N), jnp.dtype(route.dtype)), ((L * E + 1,), jnp.dtype(jnp.int32))
    for field, (shape, dtype) in zip(("b_ext", "marks"), want):
        v = getattr(pack, field)
        if not (hasattr(v, "shape") and hasattr(v, "dtype")):
            raise TypeError(f"expert_matmul: {name}.{field} must be an array, got "
                            f"{type(v).__name__}")
        if (tuple(v.shape), jnp.dtype(v.dtype)) != (shape, dtype):
            raise ValueError(f"expert_matmul: {name}.{field} is {jnp.dtype(v.dtype)} "
                             f"{list(v.shape)}, its route's pack is {dtype} {list(shape)}")
