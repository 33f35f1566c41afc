"""Flax NNX modules: per-layer MoE LoRA state and a Qwen3-MoE-style block.

- :class:`ExpertLoRA`: one projection's pools (``nnx.LoRAParam``, trainable)
  and tables (:class:`AdapterTable`, not trainable) for ``max_loras`` adapter
  slots. Pool layout is fixed: adapter slot ``l``, expert ``e`` lives in pool
  slot ``1 + l * E_t + e`` (slot 0 is the reserved "not adapted" slot), so
  loading, replacing or unloading an adapter rewrites one contiguous block of
  the pools and one row of the tables, and shapes never change.
- :class:`MoELoRA`: the four :class:`ExpertLoRA` of one MoE layer (router,
  gate, up, down); :meth:`MoELoRA.routes` gives the four ``MoeExpertRoute``.
- :class:`MoEBlock`: router -> softmax -> top-k (renormalised as Qwen3-MoE
  does with ``norm_topk_prob``) -> experts (gate, up, SiLU, down) -> sum
  weighted by the router probabilities; LoRA deltas are folded by the
  library's folds with a per-token adapter id (``-1`` = base model).
- :class:`AdapterPool`: a name -> slot registry over the ``MoELoRA`` of a
  model's layers: load PEFT adapters, replace or unload them.

Train LoRA weights with ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``: every
fold backend is differentiable (a custom VJP whose backward is traced ``jnp``,
``ops/autodiff.py``). The tables are
:class:`AdapterTable` variables, outside ``nnx.Param``, so no filter on
parameters ever selects them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_moelora._optional import needs_extra

with needs_extra("nnx", "jax_moelora.nnx"):
    from flax import nnx

from jax_moelora.geometry import padded_rank
from jax_moelora.ops.folds import (
    GATHER_MAX_ROWS,
    moe_lora_fold,
    moe_lora_gather_bgmv,
    moe_lora_grouped_down,
    sort_rows_by_expert,
)
from jax_moelora.peft import (
    PROJECTIONS,
    AdapterFormatError,
    PeftAdapter,
    ProjectionLoRA,
    load_peft_adapter,
)
from jax_moelora.tables import MoeExpertRoute

__all__ = [
    "AdapterPool",
    "AdapterTable",
    "ExpertLoRA",
    "MoEBlock",
    "MoELoRA",
    "MoELoRARoutes",
]

Array = jax.Array
ExpertPath = Literal["auto", "dense", "ragged"]


@jax.jit
def _set_rows(array: Array, rows: Array, start: Array) -> Array:
    """``array`` with ``rows`` written from row ``start`` (one compile per shape)."""
    return jax.lax.dynamic_update_slice_in_dim(array, rows.astype(array.dtype), start, 0)


class AdapterTable(nnx.Variable):
    """Adapter bookkeeping that is state but never trained: the int32 pool-slot
    tables ``[L, E_t]`` and the float32 scales ``[L, E_t]`` of a projection."""


class MoELoRARoutes(NamedTuple):
    """The four routes of one MoE layer (``MoeExpertRoute`` each)."""

    router: MoeExpertRoute
    gate: MoeExpertRoute
    up: MoeExpertRoute
    down: MoeExpertRoute


class ExpertLoRA(nnx.Module):
    """LoRA pools and tables of one projection for ``max_loras`` adapters.

    Args:
      n_experts: ``E_t``, the table length (the layer's expert count; 1 for
        the router).
      k_in: ``K``, the projection's input width.
      n_out: ``N``, its output width.
      max_loras: ``L``, adapter slots.
      max_rank: the pools' rank ``R``, rounded up to a multiple of 8.
      dtype: the pools' dtype (the activation dtype of the fold).
      param_type: the pools' variable type (``nnx.LoRAParam``).

    State: ``a_pool [P, R, K]`` and ``b_pool [P, N, R]`` with
    ``P = 1 + L * E_t``; ``a_table``/``b_table`` int32 ``[L, E_t]`` and
    ``scale_table`` float32 ``[L, E_t]`` (:class:`AdapterTable`).
    """

    def __init__(self, n_experts: int, k_in: int, n_out: int, *, max_loras: int,
                 max_rank: int, dtype: Any = jnp.float32,
                 param_type: type[nnx.Variable] = nnx.LoRAParam):
        for name, v in (("n_experts", n_experts), ("k_in", k_in), ("n_out", n_out),
                        ("max_loras", max_loras), ("max_rank", max_rank)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"ExpertLoRA: {name} must be a positive int, got {v!r}")
        self.n_experts, self.k_in, self.n_out = int(n_experts), int(k_in), int(n_out)
        self.max_loras, self.max_rank = int(max_loras), padded_rank(int(max_rank))
        self.dtype = jnp.dtype(dtype)
        P, R, L = 1 + self.max_loras * self.n_experts, self.max_rank, self.max_loras
        self.a_pool = param_type(jnp.zeros((P, R, self.k_in), self.dtype))
        self.b_pool = param_type(jnp.zeros((P, self.n_out, R), self.dtype))
        self.a_table = AdapterTable(jnp.zeros((L, self.n_experts), jnp.int32))
        self.b_table = AdapterTable(jnp.zeros((L, self.n_experts), jnp.int32))
        self.scale_table = AdapterTable(jnp.zeros((L, self.n_experts), jnp.float32))

    @property
    def pool_size(self) -> int:
        return 1 + self.max_loras * self.n_experts

    def pool_slot(self, slot: int, expert: int) -> int:
        """The pool slot of adapter ``slot``'s expert ``expert``."""
        return 1 + slot * self.n_experts + expert

    def route(self) -> MoeExpertRoute:
        """The projection's ``MoeExpertRoute`` (traceable)."""
        return MoeExpertRoute(a_pool=self.a_pool[...], b_pool=self.b_pool[...],
                              a_table=self.a_table[...], b_table=self.b_table[...],
                              scale_table=self.scale_table[...])

    def _check_slot(self, slot: int) -> int:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.max_loras:
            raise ValueError(f"adapter slot must be in [0, {self.max_loras}), got {slot!r}")
        return int(slot)

    def write_slot(self, slot: int, a: Any, b: Any, scale: Any, present: Any) -> None:
        """Install factors into adapter slot ``slot`` (host-side, not traced).

        Args:
          a: ``[e, r, K]`` with ``e <= E_t`` and ``r <= max_rank`` (zero-padded
            here); numpy or jax.
          b: ``[e, N, r]``.
          scale: ``[e]`` float scales.
          present: bool ``[e]``: experts that fold (table cells 0 elsewhere).
        """
        slot = self._check_slot(slot)
        e, r, k = a.shape
        if e > self.n_experts or k != self.k_in or r > self.max_rank or b.shape != (
                e, self.n_out, r):
            raise ValueError(f"write_slot: a {tuple(a.shape)} / b {tuple(b.shape)} do not fit "
                             f"[<= {self.n_experts}, <= {self.max_rank}, {self.k_in}] / "
                             f"[., {self.n_out}, .]")
        R, E = self.max_rank, self.n_experts
        a_blk = np.zeros((E, R, self.k_in), self.dtype)
        a_blk[:e, :r] = np.asarray(a, np.float32)
        b_blk = np.zeros((E, self.n_out, R), self.dtype)
        b_blk[:e, :, :r] = np.asarray(b, np.float32)
        start = self.pool_slot(slot, 0)
        self.a_pool[...] = _set_rows(self.a_pool[...], a_blk, np.int32(start))
        self.b_pool[...] = _set_rows(self.b_pool[...], b_blk, np.int32(start))
        present = np.zeros(E, bool) if present is None else np.asarray(present, bool)
        cells = np.zeros(E, np.int32)
        cells[:e] = np.where(present[:e], start + np.arange(e), 0)
        scales = np.zeros(E, np.float32)
        scales[:e] = np.where(present[:e], np.asarray(scale, np.float32), 0.0)
        self.a_table[...] = _set_rows(self.a_table[...], cells[None], np.int32(slot))
        self.b_table[...] = _set_rows(self.b_table[...], cells[None], np.int32(slot))
        self.scale_table[...] = _set_rows(self.scale_table[...], scales[None], np.int32(slot))

    def clear_slot(self, slot: int) -> None:
        """Zero adapter slot ``slot``: its table cells and its pool block."""
        slot = self._check_slot(slot)
        self.write_slot(slot, np.zeros((self.n_experts, self.max_rank, self.k_in), np.float32),
                        np.zeros((self.n_experts, self.n_out, self.max_rank), np.float32),
                        np.zeros(self.n_experts, np.float32), np.zeros(self.n_experts, bool))

    def check(self, lora: ProjectionLoRA, what: str) -> None:
        """Raise ``AdapterFormatError`` (naming the key) if ``lora`` does not fit."""
        if lora.n_experts > self.n_experts:
            bad = [e for e in range(self.n_experts, lora.n_experts) if lora.present[e]]
            if bad:
                raise AdapterFormatError(
                    f"expert id out of range: key {lora.key(bad[0])!r} adapts {what} expert "
                    f"{bad[0]}, the layer has {self.n_experts} experts")
        first = int(np.argmax(lora.present))
        if lora.k_in != self.k_in or lora.n_out != self.n_out:
            raise AdapterFormatError(
                f"shape mismatch: key {lora.key(first)!r} maps {lora.k_in} -> {lora.n_out} "
                f"for {what}, the layer's {what} maps {self.k_in} -> {self.n_out}")
        if int(lora.ranks.max(initial=0)) > self.max_rank:
            e = int(np.argmax(lora.ranks))
            raise AdapterFormatError(
                f"rank mismatch: key {lora.key(e)!r} has rank {int(lora.ranks[e])}, above the "
                f"pool's max_rank {self.max_rank} for {what}")

    def set_lora(self, slot: int, lora: ProjectionLoRA | None, what: str = "projection") -> None:
        """Install a loaded ``ProjectionLoRA`` (``None`` clears the slot)."""
        if lora is None:
            self.clear_slot(slot)
            return
        self.check(lora, what)
        e = min(lora.n_experts, self.n_experts)  # ids past E_t carry no pair (check)
        r = min(lora.max_rank, self.max_rank)  # ranks past r are zero padding (check)
        self.write_slot(slot, lora.a[:e, :r], lora.b[:e, :, :r], lora.scale[:e], lora.present[:e])


class MoELoRA(nnx.Module):
    """Per-layer LoRA state of an MoE layer: router, gate, up and down.

    Args:
      hidden_size: the model width ``H``.
      intermediate_size: each expert's width ``I``.
      num_experts: ``E``.
      max_loras: adapter slots ``L`` (a token's adapter id picks one).
      max_rank: pool rank, rounded up to a multiple of 8.
      dtype: the expert pools' dtype (the block's activation dtype).
      router_dtype: the router pools' dtype (the router runs in it).
      param_type: the pools' variable type.

    Attributes ``router`` (``E_t = 1``, ``K = H``, ``N = E``), ``gate`` and
    ``up`` (``K = H``, ``N = I``), ``down`` (``K = I``, ``N = H``) are
    :class:`ExpertLoRA`.
    """

    def __init__(self, *, hidden_size: int, intermediate_size: int, num_experts: int,
                 max_loras: int = 4, max_rank: int = 16, dtype: Any = jnp.float32,
                 router_dtype: Any = jnp.float32,
                 param_type: type[nnx.Variable] = nnx.LoRAParam):
        kw = dict(max_loras=max_loras, max_rank=max_rank, param_type=param_type)
        H, I, E = hidden_size, intermediate_size, num_experts
        self.hidden_size, self.intermediate_size, self.num_experts = H, I, E
        self.max_loras, self.max_rank = int(max_loras), padded_rank(int(max_rank))
        self.router = ExpertLoRA(1, H, E, dtype=router_dtype, **kw)
        self.gate = ExpertLoRA(E, H, I, dtype=dtype, **kw)
        self.up = ExpertLoRA(E, H, I, dtype=dtype, **kw)
        self.down = ExpertLoRA(E, I, H, dtype=dtype, **kw)

    def projection(self, name: str) -> ExpertLoRA:
        if name not in PROJECTIONS:
            raise AdapterFormatError(f"unknown projection {name!r}; known: {PROJECTIONS}")
        return getattr(self, name)

    def routes(self) -> MoELoRARoutes:
        """The four ``MoeExpertRoute`` of this layer (traceable)."""
        return MoELoRARoutes(*(self.projection(p).route() for p in PROJECTIONS))

    def check_adapter(self, projections: Mapping[str, ProjectionLoRA], where: str = "") -> None:
        """Raise ``AdapterFormatError`` naming the key if a projection does not fit."""
        for name, lora in projections.items():
            self.projection(name).check(lora, f"{where}{name}")

    def set_adapter(self, slot: int, projections: Mapping[str, ProjectionLoRA],
                    where: str = "") -> None:
        """Install one layer of an adapter into ``slot``; projections it lacks
        are cleared (they fold nothing for this adapter)."""
        self.check_adapter(projections, where)
        for name in PROJECTIONS:
            self.projection(name).set_lora(slot, projections.get(name), f"{where}{name}")

    def clear_adapter(self, slot: int) -> None:
        """Unload ``slot``: every table cell 0 and the pool blocks zeroed."""
        for name in PROJECTIONS:
            self.projection(name).clear_slot(slot)

    def init_adapter(self, slot: int, *, rngs: nnx.Rngs, rank: int | None = None,
                     alpha: float | None = None,
                     projections: Sequence[str] = PROJECTIONS) -> None:
        """A fresh trainable adapter in ``slot``, initialised as PEFT does:
        ``A`` He-uniform (kaiming, ``a = sqrt(5)``), ``B`` zero, scale
        ``alpha / rank`` (default ``alpha = rank``), every expert adapted."""
        rank = self.max_rank if rank is None else int(rank)
        if not 1 <= rank <= self.max_rank:
            raise ValueError(f"init_adapter: rank must be in [1, {self.max_rank}], got {rank}")
        scale = (rank if alpha is None else alpha) / rank
        for name in projections:
            proj = self.projection(name)
            E, K = proj.n_experts, proj.k_in
            bound = 1.0 / np.sqrt(K)  # kaiming_uniform(a=sqrt(5)) on fan_in K
            a = jax.random.uniform(rngs.params(), (E, rank, K), jnp.float32, -bound, bound)
            b = jnp.zeros((E, proj.n_out, rank), jnp.float32)
            proj.write_slot(slot, a, b, np.full(E, scale, np.float32), np.ones(E, bool))


# --------------------------------------------------------------------------
# the block
# --------------------------------------------------------------------------

def _take_slots(all_out: Array, topk_ids: Array) -> Array:
    """``all_out [E, T, N]`` -> flat rows ``[T * k, N]`` of the chosen experts."""
    t, k = topk_ids.shape
    return all_out[topk_ids, jnp.arange(t)[:, None]].reshape(t * k, -1)


def _dense_tokens(x: Array, w: Array, topk_ids: Array) -> Array:
    """Every expert on every token, then the chosen ones: ``[T * k, N]``.

    Written as a matmul batched over experts (``x`` broadcast), so ``w
    [E, K, N]`` is read in place: the unbatched ``"tk,ekn->ten"`` makes XLA
    transpose the whole weight on every call."""
    xb = jnp.broadcast_to(x[None], (w.shape[0],) + x.shape)
    return _take_slots(jnp.einsum("etk,ekn->etn", xb, w), topk_ids)


def _glu(g: Array, u: Array) -> Array:
    """``silu(g) * u`` in float32, rounded once to the activation dtype (so the
    result does not depend on how XLA fuses the elementwise ops)."""
    return (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(g.dtype)


def _dense_rows(h: Array, w: Array, topk_ids: Array) -> Array:
    """Per-row inputs ``h [T * k, K]`` through their own expert: ``[T * k, N]``.

    Rows are scattered to ``[E, T, K]`` (zeros elsewhere: a token's top-k
    experts are distinct) and multiplied expert by expert."""
    t, k = topk_ids.shape
    scat = jnp.zeros((w.shape[0], t, h.shape[-1]), h.dtype)
    scat = scat.at[topk_ids, jnp.arange(t)[:, None]].set(h.reshape(t, k, -1))
    return _take_slots(jnp.einsum("etk,ekn->etn", scat, w), topk_ids)


class MoEBlock(nnx.Module):
    """A Qwen3-MoE sparse block with multi-adapter LoRA on router and experts.

    ``y = sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))`` over the top-k
    experts ``e`` of ``softmax(router(x))``, each projection plus its LoRA
    delta ``scale * (x @ A^T) @ B^T`` for the token's adapter.

    Args:
      hidden_size, intermediate_size, num_experts, top_k: the layer's shape.
      norm_topk_prob: renormalise the top-k probabilities to sum to 1.
      max_loras, max_rank: the LoRA pools (see :class:`MoELoRA`).
      dtype: activation and expert weight dtype.
      router_dtype: the router's dtype (its weight, logits, LoRA pools).
      impl: fold backend (``"auto"``, ``"fast"``, ``"seed"``, ``"cpu"``,
        ``"jnp"``; every one is differentiable).
      expert_path: base expert matmuls: ``"ragged"`` (``jax.lax.ragged_dot``
        over rows sorted by expert), ``"dense"`` (every expert on every token,
        then the chosen rows: cheap for decode-sized batches), or ``"auto"``
        (dense for batches that take the gather fold, ragged otherwise).
      gather_max_rows: batches of at most this many ``T * top_k`` rows fold
        with the gather kernel in flat row order (decode); larger ones sort
        the rows by expert once and use ``ragged_dot`` and the grouped fold
        on the sorted rows (prefill).
      lora: build the LoRA state (``False``: a plain MoE block).
      rngs: initialisation keys.

    State: ``router`` (``nnx.Linear``, kernel ``[H, E]``), ``gate_proj`` and
    ``up_proj`` (``nnx.Param [E, H, I]``), ``down_proj`` (``[E, I, H]``),
    ``lora`` (:class:`MoELoRA` or ``None``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 *, norm_topk_prob: bool = True, max_loras: int = 4, max_rank: int = 16,
                 dtype: Any = jnp.float32, router_dtype: Any = jnp.float32,
                 impl: str = "auto", expert_path: ExpertPath = "auto",
                 gather_max_rows: int = GATHER_MAX_ROWS, lora: bool = True, rngs: nnx.Rngs):
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if expert_path not in ("auto", "dense", "ragged"):
            raise ValueError(
                f"expert_path must be 'auto', 'dense' or 'ragged', got {expert_path!r}")
        H, I, E = hidden_size, intermediate_size, num_experts
        self.hidden_size, self.intermediate_size, self.num_experts = H, I, E
        self.top_k, self.norm_topk_prob = int(top_k), bool(norm_topk_prob)
        self.dtype, self.router_dtype = jnp.dtype(dtype), jnp.dtype(router_dtype)
        self.impl, self.expert_path = impl, expert_path
        self.gather_max_rows = int(gather_max_rows)
        self.router = nnx.Linear(H, E, use_bias=False, dtype=router_dtype,
                                 param_dtype=router_dtype, rngs=rngs)
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.gate_proj = nnx.Param(init(rngs.params(), (E, H, I), self.dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (E, H, I), self.dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (E, I, H), self.dtype))
        self.lora = (MoELoRA(hidden_size=H, intermediate_size=I, num_experts=E,
                             max_loras=max_loras, max_rank=max_rank, dtype=dtype,
                             router_dtype=router_dtype) if lora else None)

    def route(self, x: Array, adapter_ids: Array | None, routes: MoELoRARoutes | None,
              impl: str) -> tuple[Array, Array]:
        """Router with its LoRA delta -> ``(weights f32 [T, k], ids int32 [T, k])``.

        The router's delta is the one-entry router route folded into the
        logits with the gather fold (all-zero expert ids, ``top_k = 1``,
        ``x_gather = 0``), before softmax and top-k."""
        xr = x.astype(self.router_dtype)
        logits = self.router(xr)
        if routes is not None:
            zeros = jnp.zeros((x.shape[0],), jnp.int32)
            logits = moe_lora_gather_bgmv(xr, logits, zeros, routes.router, adapter_ids,
                                          top_k=1, x_gather=0, impl=impl)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, ids = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, ids.astype(jnp.int32)

    def _path(self, grouped: bool) -> str:
        if self.expert_path != "auto":
            return self.expert_path
        return "ragged" if grouped else "dense"

    def experts(self, x: Array, topk_ids: Array, adapter_ids: Array | None,
                routes: MoELoRARoutes | None, impl: str) -> Array:
        """The chosen experts' outputs, flat rows ``[T * k, H]`` (token-major)."""
        t, k = topk_ids.shape
        n = t * k
        wg, wu, wd = self.gate_proj[...], self.up_proj[...], self.down_proj[...]
        grouped = n > self.gather_max_rows
        path = self._path(grouped)
        if grouped:
            # prefill: sort rows by expert once; everything below is in sorted order
            order, offsets, stok = sort_rows_by_expert(topk_ids, self.num_experts)
            inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n, dtype=jnp.int32))
            sizes = jnp.diff(offsets)
            if path == "ragged":
                xs = x[stok]
                g = jax.lax.ragged_dot(xs, wg, sizes)
                u = jax.lax.ragged_dot(xs, wu, sizes)
            else:
                g = _dense_tokens(x, wg, topk_ids)[order]
                u = _dense_tokens(x, wu, topk_ids)[order]
            if routes is not None:
                kw = dict(x_gather=1, impl=impl)
                g = moe_lora_grouped_down(x, g, offsets, stok, routes.gate, adapter_ids, **kw)
                u = moe_lora_grouped_down(x, u, offsets, stok, routes.up, adapter_ids, **kw)
            h = _glu(g, u)
            if path == "ragged":
                d = jax.lax.ragged_dot(h, wd, sizes)
            else:
                d = _dense_rows(h[inverse], wd, topk_ids)[order]
            if routes is not None:
                d = moe_lora_grouped_down(h, d, offsets, stok, routes.down, adapter_ids,
                                          x_gather=0, impl=impl)
            return d[inverse]
        # decode: flat token-major rows, gather folds
        if path == "ragged":
            order, offsets, stok = sort_rows_by_expert(topk_ids, self.num_experts)
            inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n, dtype=jnp.int32))
            sizes = jnp.diff(offsets)
            xs = x[stok]
            g = jax.lax.ragged_dot(xs, wg, sizes)[inverse]
            u = jax.lax.ragged_dot(xs, wu, sizes)[inverse]
        else:
            g = _dense_tokens(x, wg, topk_ids)
            u = _dense_tokens(x, wu, topk_ids)
        kw = dict(impl=impl, gather_max_rows=self.gather_max_rows)
        if routes is not None:
            g = moe_lora_fold(x, g, topk_ids, routes.gate, adapter_ids, x_gather=1, **kw)
            u = moe_lora_fold(x, u, topk_ids, routes.up, adapter_ids, x_gather=1, **kw)
        h = _glu(g, u)
        if path == "ragged":
            d = jax.lax.ragged_dot(h[order], wd, sizes)[inverse]
        else:
            d = _dense_rows(h, wd, topk_ids)
        if routes is not None:
            d = moe_lora_fold(h, d, topk_ids, routes.down, adapter_ids, x_gather=0, **kw)
        return d

    def __call__(self, x: Array, adapter_ids: Array | None = None, *, impl: str | None = None,
                 use_lora: bool = True) -> Array:
        """Run the block.

        Args:
          x: ``[..., H]`` activations (cast to ``dtype``).
          adapter_ids: int ``[...]`` (``x``'s leading shape): each token's
            adapter slot, ``-1`` for the base model (a slot ``>= max_loras``
            folds nothing). ``None``, or a block built with ``lora=False``:
            every token uses the base model.
          impl: fold backend for this call (default: the block's ``impl``).
          use_lora: ``False`` runs the plain block with no fold at all.

        Returns:
          ``[..., H]`` in ``dtype``.
        """
        lead = x.shape[:-1]
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoEBlock: x has width {x.shape[-1]}, hidden_size is "
                             f"{self.hidden_size}")
        x2 = x.reshape(-1, self.hidden_size).astype(self.dtype)
        impl = self.impl if impl is None else impl
        routes = None
        if use_lora and self.lora is not None and adapter_ids is not None:
            ids = jnp.asarray(adapter_ids)
            if ids.shape != lead:
                raise ValueError(f"MoEBlock: adapter_ids has shape {ids.shape}, x's tokens are "
                                 f"{lead}")
            if not jnp.issubdtype(ids.dtype, jnp.integer):
                raise TypeError(f"MoEBlock: adapter_ids must be integers, got {ids.dtype}")
            adapter_ids = ids.reshape(-1).astype(jnp.int32)
            routes = self.lora.routes()
        else:
            adapter_ids = None
        weights, topk_ids = self.route(x2, adapter_ids, routes, impl)
        d = self.experts(x2, topk_ids, adapter_ids, routes, impl)
        t = x2.shape[0]
        y = jnp.einsum("tk,tkh->th", weights,
                       d.reshape(t, self.top_k, -1).astype(jnp.float32))
        return y.astype(self.dtype).reshape(*lead, self.hidden_size)


# --------------------------------------------------------------------------
# adapter registry
# --------------------------------------------------------------------------

class AdapterPool:
    """Name -> slot registry of the adapters installed in a model's layers.

    Args:
      layers: the ``MoELoRA`` of each layer (layer ``i`` of an adapter goes to
        ``layers[i]``), or the ``MoEBlock``\\ s.

    ``load`` puts an adapter (a :class:`PeftAdapter` or a PEFT folder) in a
    free slot (or a given one), ``replace`` overwrites a slot, ``unload``
    zeroes it. A load is validated against every layer before anything is
    written, so a rejected adapter leaves the pool unchanged.
    """

    def __init__(self, layers: Sequence[MoELoRA | MoEBlock]):
        found = []
        for i, lay in enumerate(layers):
            lora = lay.lora if isinstance(lay, MoEBlock) else lay
            if not isinstance(lora, MoELoRA):
                raise TypeError(f"AdapterPool: layer {i} has no MoELoRA state")
            found.append(lora)
        if not found:
            raise ValueError("AdapterPool: no layers")
        if len({lay.max_loras for lay in found}) != 1:
            raise ValueError("AdapterPool: layers differ in max_loras")
        self.layers: list[MoELoRA] = found
        self.max_loras = found[0].max_loras
        self._slots: dict[str, int] = {}
        self._adapters: dict[int, PeftAdapter] = {}

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
        """Per-token adapter ids: ``None`` (or ``"base"``) -> -1, names -> slots."""
        return np.asarray([-1 if n is None or n == "base" else self.slot_of(n) for n in names],
                          np.int32)

    # -- changes ----------------------------------------------------------
    def _resolve(self, adapter: PeftAdapter | str | os.PathLike) -> PeftAdapter:
        if isinstance(adapter, PeftAdapter):
            return adapter
        lay = self.layers[0]
        return load_peft_adapter(adapter, num_experts=lay.num_experts,
                                 hidden_size=lay.hidden_size,
                                 intermediate_size=lay.intermediate_size)

    def _check(self, adapter: PeftAdapter) -> None:
        n = len(self.layers)
        for layer, projs in adapter.layers.items():
            if layer >= n:
                lora = next(iter(projs.values()))
                raise AdapterFormatError(
                    f"layer out of range: key {lora.key(int(np.argmax(lora.present)))!r} adapts "
                    f"layer {layer}, the model has {n} MoE layers")
            self.layers[layer].check_adapter(projs, where=f"layer {layer} ")

    def _write(self, slot: int, adapter: PeftAdapter) -> None:
        for i, lay in enumerate(self.layers):
            lay.set_adapter(slot, adapter.layers.get(i, {}), where=f"layer {i} ")

    def load(self, adapter: PeftAdapter | str | os.PathLike, name: str | None = None, *,
             slot: int | None = None) -> int:
        """Install an adapter in a free slot (the lowest, or ``slot``); returns it."""
        adapter = self._resolve(adapter)
        name = adapter.name if name is None else name
        if name in self._slots:
            raise ValueError(f"an adapter named {name!r} is installed (slot "
                             f"{self._slots[name]}); use replace() or another name")
        if slot is None:
            free = self.free_slots()
            if not free:
                raise ValueError(f"all {self.max_loras} adapter slots are taken "
                                 f"({sorted(self._slots)}); unload one first")
            slot = free[0]
        elif not 0 <= slot < self.max_loras:
            raise ValueError(f"slot must be in [0, {self.max_loras}), got {slot}")
        elif slot in self._adapters:
            raise ValueError(f"slot {slot} holds {self._adapters[slot].name!r}; use replace()")
        self._check(adapter)
        self._write(slot, adapter)
        self._slots[name] = slot
        self._adapters[slot] = _renamed(adapter, name)
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
        return slot

    def unload(self, name_or_slot: str | int) -> int:
        """Zero an adapter's slot (tables and pools) and forget it; returns the slot."""
        slot = self.slot_of(name_or_slot)
        for lay in self.layers:
            lay.clear_adapter(slot)
        del self._slots[self._adapters.pop(slot).name]
        return slot


def _renamed(adapter: PeftAdapter, name: str) -> PeftAdapter:
    return adapter if adapter.name == name else dataclasses.replace(adapter, name=name)
