"""``take_rows``: rows of a matrix by index, moved as 32-bit words.

``x[ids]`` on a ``[T, K]`` bf16/f16 matrix lowers to an XLA gather that copies
one 16-bit element per step. Lowered for CUDA, :func:`take_rows` bitcasts
each pair of elements to one ``uint32`` first (``K`` even), gathers those
words and bitcasts back: the same bits, half the elements to move (H200,
32,768 rows of 2,048 bf16 from 4,096: 86-87 µs -> 55-58 µs). On other
platforms it is ``x[ids]`` (XLA:CPU copies the words more slowly). Its
gradient is ``x[ids]``'s: the cotangent rows added into their source rows in
x's dtype. Where ids repeat, XLA leaves the order of those adds unspecified
(on a GPU they are atomic), so such rows may differ from ``x[ids]``'s
gradient by the rounding of another order (an ulp of f16); the forward is
bit-identical. With ``zero_outside=True`` an id outside ``[0, T)`` reads a
row of zeros and passes no gradient (the sorted rows of ``expert_matmul``'s
``x_gather=1``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_moelora.ops import backend

__all__ = ["take_rows"]


def _words(x: jax.Array) -> bool:
    return x.ndim == 2 and x.dtype.itemsize == 2 and x.shape[1] % 2 == 0


def _inside(x: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(ok, safe)``: which ids lie in ``[0, T)``, and the ids with the others at 0."""
    ok = (ids >= 0) & (ids < x.shape[0])
    return ok, jnp.where(ok, ids, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _take_words(x: jax.Array, ids: jax.Array, zero_outside: bool = False) -> jax.Array:
    t, k = x.shape
    words = jax.lax.bitcast_convert_type(x.reshape(t, k // 2, 2), jnp.uint32)
    if zero_outside:  # one pass: the gather and the select
        ok, safe = _inside(x, ids)
        rows = jnp.where(ok[:, None], words[safe], jnp.uint32(0))
    else:
        rows = words[ids]
    return jax.lax.bitcast_convert_type(rows, x.dtype).reshape(ids.shape[0], k)


def _take_words_fwd(x, ids, zero_outside=False):
    return _take_words(x, ids, zero_outside), (x, ids)


def _take_words_bwd(zero_outside, res, g):
    x, ids = res
    if not zero_outside:
        return jnp.zeros_like(x).at[ids].add(g.astype(x.dtype)), None
    dest = jnp.where(_inside(x, ids)[0], ids, x.shape[0])  # past the end: dropped
    return jnp.zeros_like(x).at[dest].add(g.astype(x.dtype), mode="drop"), None


_take_words.defvjp(_take_words_fwd, _take_words_bwd)


def _take(x: jax.Array, ids: jax.Array, zero_outside: bool = False) -> jax.Array:
    if not zero_outside:
        return x[ids]
    ok, safe = _inside(x, ids)
    return jnp.where(ok[:, None], x[safe], jnp.zeros((), x.dtype))


def take_rows(x: jax.Array, ids: jax.Array, *, zero_outside: bool = False) -> jax.Array:
    """``x[ids]``: rows ``ids`` (int ``[M]``, in ``[0, T)``) of ``x [T, K]``.

    Lowered for CUDA, bf16/f16 with an even ``K`` gather 32-bit words (pairs
    of elements bitcast); everything else takes ``x[ids]``. Returns ``[M,
    K]`` in x's dtype, bit-identical to ``x[ids]``. ``zero_outside``: an id
    outside ``[0, T)`` reads a row of zeros (no gradient reaches ``x`` from
    it) instead of being out of contract.
    """
    plain = functools.partial(_take, zero_outside=zero_outside)
    if not _words(x):
        return plain(x, ids)
    words = functools.partial(_take_words, zero_outside=zero_outside)
    return backend.per_platform(x, ids, cpu=plain, cuda=words, default=plain)
