"""The sparse MoE block with multi-adapter LoRA on the router and every expert.

``y = sum_k w_k * expert_{e_k}(x) (+ shared(x))``: the router picks the top-k
experts ``e_k`` and their weights ``w_k`` with its family's rule, each expert
and the shared MLP run their projections plus the LoRA delta ``scale *
(x @ A^T) @ B^T`` of the token's adapter. The deltas are folded by the
library's folds, in the row order ``plan_rows`` chooses for the batch (flat
rows and the gather fold for decode, rows sorted by expert and, within an
expert, by adapter, and the grouped fold for prefill), computed once per call
and shared by the expert folds.

Folds per call with LoRA: the router's (one gather fold); gate and up
together (one fold of their ``StackedRoute``, ``MoELoRA.gate_up``: they read
the same rows, so one launch folds both; on the dense path of GLU experts
``fold_dense_experts`` folds the chosen rows inside the dense ``[E, T, I]``
outputs, before the chosen rows are taken; on other flat rows
``fold_token_projections`` interleaves them per token and reads ``x`` in
place; on sorted rows the experts' ``first_stacked`` hands them over stacked
``[2, rows, I]``, which ``expert_matmul`` writes in place); down (one fold,
in the dense ``[E, T, H]`` output on the dense path, reading its input rows
in the ``[E, T, I]`` the down GEMM reads); with shared experts,
shared gate and up together and shared down (one gather fold each).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jax_moelora.int_range import check_int32_values
from jax_moelora.nnx.experts import (
    EXPERT_GEMMS,
    ExpertGemm,
    ExpertRows,
    GluExperts,
    GptOssExperts,
    SharedExperts,
    default_expert_init,
    folds_in_gemm,
    scatter_rows,
    take_slots,
)
from jax_moelora.nnx.families import MoEFamily, family_config
from jax_moelora.nnx.lora import MoELoRA, MoELoRAPacks, MoELoRARoutes, default_a_initializer
from jax_moelora.nnx.routers import Router
from jax_moelora.nnx.sharded import BlockSharding, place_block, sharded_call
from jax_moelora.ops.dense_fold import fold_dense_experts
from jax_moelora.ops.folds import (
    fold_planned,
    fold_token_projections,
    gather_rows_limit,
    moe_lora_gather_bgmv,
    plan_rows,
    reads_narrow_x,
)
from jax_moelora.tables import MoeExpertRoute

__all__ = ["MoEBlock", "weighted_sum"]

Array = jax.Array
ExpertPathOption = Literal["auto", "dense", "ragged"]


def weighted_sum(weights: Array, rows: Array) -> Array:
    """``sum_k weights[t, k] * rows[t * top_k + k]``: float32 ``[T, N]`` from
    routing weights f32 ``[T, top_k]`` and expert output rows ``[T * top_k,
    N]`` in flat order (upcast to float32 first)."""
    t, k = weights.shape
    return jnp.einsum("tk,tkh->th", weights, rows.reshape(t, k, -1).astype(jnp.float32))


def _fold_dense(x: Array, base: Array, route: MoeExpertRoute, adapter_ids: Array,
                impl: str) -> Array:
    """A one-entry route (router, shared down) folded over tokens ``[T, .]``."""
    zeros = jnp.zeros((x.shape[0],), jnp.int32)
    return moe_lora_gather_bgmv(x, base, zeros, route, adapter_ids, top_k=1, x_gather=0,
                                impl=impl)


class MoEBlock(nnx.Module):
    """A sparse MoE block of one of the families in ``families.py``, with
    per-token LoRA adapters.

    Args:
      hidden_size, intermediate_size, num_experts, top_k: the layer's shape
        (``intermediate_size`` is one routed expert's width).
      family: a family config (:class:`Qwen3MoE`, :class:`Mixtral`,
        :class:`GptOss`, :class:`DeepSeekV2`, :class:`DeepSeekV3`) or its name
        (``"qwen3"``, ``"mixtral"``, ``"gpt-oss"``, ``"deepseek-v2"``,
        ``"deepseek-v3"``); default Qwen3-MoE.
      norm_topk_prob: overrides the family's ``norm_topk_prob`` (families
        that have the flag only).
      max_loras, max_rank: the LoRA pools (see :class:`MoELoRA`).
      dtype: the activation dtype (and the expert LoRA pools').
      param_dtype: the base weights' dtype (default ``dtype``).
      router_dtype: the router's dtype (its weight, logits, LoRA pools).
      impl: fold backend (``"auto"``, ``"fast"``, ``"simple"``, ``"cpu"``,
        ``"jnp"``; every one is differentiable).
      expert_path: base expert matmuls: ``"ragged"`` (the grouped GEMM
        ``expert_gemm`` over rows sorted by expert), ``"dense"`` (every
        expert on every token, then the chosen rows), or ``"auto"`` (dense
        for batches that take the gather fold, ragged otherwise; with an
        expert axis, ragged on the experts' owners, whose dense work would
        grow with the padded rows they receive).
      expert_gemm: the grouped GEMM of the ragged path: ``"ragged_dot"``
        (``jax.lax.ragged_dot``), ``"expert_matmul"`` (the library's
        :func:`jax_moelora.expert_matmul`, no LoRA: the CUTLASS grouped GEMM
        on a Hopper GPU for bf16/f16, its fp32-accumulated ``ragged_dot``
        elsewhere), or ``"auto"``: ``expert_matmul`` where its CUTLASS kernel
        runs and the computation is lowered for CUDA, ``ragged_dot`` on every
        other platform and dtype (XLA:GPU lowers ``ragged_dot`` to a dense
        zero-padded matmul). The LoRA deltas are folded after the GEMM in
        every case. The dense path does not use it.
      gather_max_rows: batches of at most this many ``T * top_k`` rows fold
        with the gather fold in flat row order (decode); larger ones are
        sorted by expert (and adapter) once and take the grouped fold
        (prefill). None (default): ``gather_rows_limit(num_experts)``,
        ``max(2048, 96 * num_experts)``; the attribute holds the number.
      lora: build the LoRA state (``False``: a plain MoE block).
      kernel_init: initializer of the routed experts' ``[E, K, N]`` weights
        (and of the shared experts' kernels).
      bias_init: initializer of the expert biases (gpt-oss).
      router_kernel_init, router_bias_init: the router's (``None``:
        ``nnx.Linear``'s defaults).
      lora_a_initializer, lora_b_initializer: a fresh adapter's factors
        (:meth:`MoELoRA.init_adapter`).
      mesh: a ``jax.sharding.Mesh`` to run the block on (``None``: no
        sharding). With a mesh, the state is created placed on it and every
        call runs under ``shard_map`` (``nnx/sharded.py``); the axes:
      expert_axis: the mesh axis that splits the routed experts (their
        weights and the LoRA pool slots of their adapters, one expert
        range per device) and the tokens; rows go to their experts' owners
        and back with an all-to-all.
      data_axis: mesh axis name(s) that split the tokens (weights replicated).
      tensor_axis: the mesh axis that splits the expert (and shared expert)
        intermediate dimension; partial outputs summed with a ``psum``.
      capacity_factor, exchange, dispatch_chunks: the expert-parallel
        dispatch (``ops/dispatch.py``): ``None`` (default) sends blocks of
        every row a device holds, exact; a factor ``f`` sends at most
        ``ceil(f * rows / D)`` rows to each device and drops the rest;
        ``exchange`` is ``"all_to_all"`` or ``"ragged_all_to_all"`` (GPU
        backends); ``dispatch_chunks`` splits a device's tokens into
        independent pieces whose exchanges can overlap the others' expert
        work (:class:`BlockSharding`).
      rngs: initialisation keys.

    State: ``router`` (:class:`Router`, kernel ``[H, E]``), ``experts``
    (:class:`GluExperts` or :class:`GptOssExperts`), ``shared_experts``
    (:class:`SharedExperts` of width ``n_shared * I``, or ``None``), ``lora``
    (:class:`MoELoRA` or ``None``; with an expert axis its routed pools are
    laid out in one shard per device, ``MoELoRA(expert_shards=...)``).
    ``sharding``: the :class:`BlockSharding` or ``None``
    (:func:`jax_moelora.nnx.shard_block` puts an existing block on a mesh).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 *, family: MoEFamily | str | None = None, norm_topk_prob: bool | None = None,
                 max_loras: int = 4, max_rank: int = 16, dtype: Any = jnp.float32,
                 param_dtype: Any = None, router_dtype: Any = jnp.float32,
                 impl: str = "auto", expert_path: ExpertPathOption = "auto",
                 expert_gemm: ExpertGemm = "auto",
                 gather_max_rows: int | None = None, lora: bool = True,
                 kernel_init: Any = default_expert_init,
                 bias_init: Any = nnx.initializers.zeros_init(),
                 router_kernel_init: Any = None, router_bias_init: Any = None,
                 lora_a_initializer: Any = default_a_initializer,
                 lora_b_initializer: Any = nnx.initializers.zeros_init(),
                 mesh: Mesh | None = None, expert_axis: str | None = None,
                 data_axis: str | Sequence[str] | None = None, tensor_axis: str | None = None,
                 capacity_factor: float | None = None, exchange: str = "all_to_all",
                 dispatch_chunks: int = 1, rngs: nnx.Rngs):
        sharding = None
        if mesh is not None:
            sharding = BlockSharding.make(mesh, expert_axis=expert_axis, data_axis=data_axis,
                                          tensor_axis=tensor_axis,
                                          capacity_factor=capacity_factor, exchange=exchange,
                                          dispatch_chunks=dispatch_chunks)
        elif any(a is not None for a in (expert_axis, data_axis, tensor_axis)):
            raise ValueError("MoEBlock: expert_axis, data_axis and tensor_axis need a mesh")
        family = family_config(family)
        if norm_topk_prob is not None:
            if "norm_topk_prob" not in {f.name for f in dataclasses.fields(family)}:
                raise ValueError(f"norm_topk_prob: the {family.name} family has no such option")
            family = dataclasses.replace(family, norm_topk_prob=bool(norm_topk_prob))
        family.check(num_experts, top_k)
        if expert_path not in ("auto", "dense", "ragged"):
            raise ValueError(
                f"expert_path must be 'auto', 'dense' or 'ragged', got {expert_path!r}")
        if expert_gemm not in EXPERT_GEMMS:
            raise ValueError(f"expert_gemm must be one of {EXPERT_GEMMS}, got {expert_gemm!r}")
        H, I, E = hidden_size, intermediate_size, num_experts
        if sharding is not None:  # before any weight is created
            sharding.check_sizes(E, I, family.n_shared_experts * I)
        self.hidden_size, self.intermediate_size, self.num_experts = H, I, E
        self.top_k, self.family = int(top_k), family
        self.dtype, self.router_dtype = jnp.dtype(dtype), jnp.dtype(router_dtype)
        self.param_dtype = self.dtype if param_dtype is None else jnp.dtype(param_dtype)
        self.impl, self.expert_path, self.expert_gemm = impl, expert_path, expert_gemm
        self.gather_max_rows = int(gather_rows_limit(E, gather_max_rows))
        self.router = Router(H, E, family=family, top_k=top_k, dtype=router_dtype,
                             param_dtype=router_dtype, kernel_init=router_kernel_init,
                             bias_init=router_bias_init, rngs=rngs)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=kernel_init,
                  rngs=rngs)
        if family.experts == "gpt_oss":
            self.experts = GptOssExperts(H, I, E, family=family, bias_init=bias_init, **kw)
        else:
            self.experts = GluExperts(H, I, E, **kw)
        shared = family.n_shared_experts * I
        self.shared_experts = (SharedExperts(H, shared, dtype=self.dtype,
                                             param_dtype=self.param_dtype, rngs=rngs)
                               if shared else None)
        self.lora = (MoELoRA(hidden_size=H, intermediate_size=I, num_experts=E,
                             shared_intermediate_size=shared, max_loras=max_loras,
                             max_rank=max_rank, dtype=dtype, router_dtype=router_dtype,
                             a_initializer=lora_a_initializer,
                             b_initializer=lora_b_initializer,
                             expert_shards=1 if sharding is None else sharding.expert_shards)
                     if lora else None)
        self.sharding = sharding
        if sharding is not None:
            place_block(self)

    # The routed experts' weights under the names of the GLU families.
    @property
    def gate_proj(self) -> nnx.Param:
        return self.experts.gate_proj

    @property
    def up_proj(self) -> nnx.Param:
        return self.experts.up_proj

    @property
    def down_proj(self) -> nnx.Param:
        return self.experts.down_proj

    @property
    def norm_topk_prob(self) -> bool | None:
        return getattr(self.family, "norm_topk_prob", None)

    def route(self, x: Array, adapter_ids: Array | None, routes: MoELoRARoutes | None,
              impl: str) -> tuple[Array, Array]:
        """Router with its LoRA delta -> ``(weights f32 [T, k], ids int32 [T, k])``.

        ``x [T, H]``; the router's delta is its one-entry route folded into
        the logits (gather fold, all-zero expert ids, ``top_k = 1``,
        ``x_gather = 0``) before the family's choice. Under a float32 router
        the fold reads bf16/f16 ``x`` as it is (widened in the fold, the bits
        of ``x`` in float32), so ``x`` is never written out in float32."""
        xr = x.astype(self.router_dtype)
        logits = self.router(xr)
        if routes is not None:
            xf = x if reads_narrow_x(x.dtype, self.router_dtype) else xr
            logits = _fold_dense(xf, logits, routes.router, adapter_ids, impl)
        return self.router.select(logits)

    def _path(self, grouped: bool, option: ExpertPathOption | None = None) -> str:
        option = self.expert_path if option is None else option
        if option != "auto":
            return option
        return "ragged" if grouped else "dense"

    def routed(self, x: Array, weights: Array, topk_ids: Array, adapter_ids: Array | None,
               routes: MoELoRARoutes | None, impl: str) -> Array:
        """The routed experts' weighted sum ``[T, H]`` (float32) for tokens ``x [T, H]``."""
        return weighted_sum(weights, self.routed_rows(x, topk_ids, adapter_ids, routes, impl))

    def routed_rows(self, x: Array, topk_ids: Array, adapter_ids: Array | None,
                    routes: MoELoRARoutes | None, impl: str, *,
                    num_experts: int | None = None,
                    expert_path: ExpertPathOption | None = None) -> Array:
        """Each token's chosen experts on it: ``[T * top_k, H]`` (``dtype``)
        in flat order (row ``t * top_k + k``), LoRA deltas folded.

        ``x [T, H]``, ``topk_ids`` int32 ``[T, top_k]`` in ``[0,
        num_experts)`` (ids past it: rows of no expert, whose values are
        unspecified), ``adapter_ids`` int32 ``[T]`` or None. ``num_experts``:
        the experts the weights and routes hold (default the block's; the
        local experts of a device under expert parallelism). ``expert_path``
        replaces the block's option for this call."""
        E = self.num_experts if num_experts is None else int(num_experts)
        plan = plan_rows(topk_ids, E, gather_max_rows=self.gather_max_rows,
                         row_adapter=adapter_ids if routes is not None else None,
                         num_adapters=self.lora.max_loras if routes is not None else 0)
        path = self._path(plan.grouped, expert_path)
        rows = ExpertRows.make(plan, path, E, self.expert_gemm)
        if (routes is not None and rows.path == "dense" and not plan.grouped
                and isinstance(self.experts, GluExperts)):
            return self._routed_dense(x, topk_ids, adapter_ids, routes, impl)
        in_gemm = (routes is not None and isinstance(self.experts, GluExperts)
                   and folds_in_gemm(rows, x.dtype, self.hidden_size,
                                     self.intermediate_size, impl)
                   and folds_in_gemm(rows, x.dtype, self.intermediate_size,
                                     self.hidden_size, impl))
        # gate and up with LoRA: one fold of their stacked route
        packs = routes.packs if routes is not None else None
        if in_gemm:  # sorted rows, the folds in the GEMMs' custom calls
            gu = self.experts.first_folded(
                x, rows, (routes.gate, routes.up), adapter_ids,
                lambda base: fold_planned(x, base, plan, routes.gate_up, adapter_ids,
                                          x_gather=1, impl=impl),
                None if packs is None else (packs.gate, packs.up))
            g, u = gu[0], gu[1]
        elif routes is not None and plan.grouped:  # sorted rows, stacked [2, rows, I]
            gu = fold_planned(x, self.experts.first_stacked(x, rows), plan, routes.gate_up,
                              adapter_ids, x_gather=1, impl=impl)
            g, u = gu[0], gu[1]
        else:
            g, u = self.experts.first(x, rows)
            if routes is not None:  # flat rows, interleaved per token (x read in place)
                g, u = fold_token_projections(x, (g, u), plan.topk_ids, routes.gate_up,
                                              adapter_ids, impl=impl)
        h = self.experts.activation(g, u)
        if in_gemm:
            d = self.experts.down_folded(
                h, rows, routes.down, adapter_ids,
                lambda base: fold_planned(h, base[0], plan, routes.down, adapter_ids,
                                          x_gather=0, impl=impl)[None],
                None if packs is None else packs.down)
            return plan.to_flat_order(d)
        d = self.experts.down(h, rows)
        if routes is not None:
            d = fold_planned(h, d, plan, routes.down, adapter_ids, x_gather=0, impl=impl)
        return plan.to_flat_order(d)

    def _routed_dense(self, x: Array, topk_ids: Array, adapter_ids: Array,
                      routes: MoELoRARoutes, impl: str) -> Array:
        """The dense path of GLU experts with LoRA: the folds write the dense
        outputs ``[E, T, N]`` in place (``fold_dense_experts``), and the
        chosen rows are taken after them, as without LoRA. Returns the down
        rows ``[T * top_k, H]`` in flat order."""
        experts = self.experts
        g_all, u_all = fold_dense_experts(x, experts.first_all(x), topk_ids, routes.gate_up,
                                          adapter_ids, x_gather=1, impl=impl)
        h = experts.activation(take_slots(g_all, topk_ids), take_slots(u_all, topk_ids))
        h_all = scatter_rows(h, topk_ids, g_all.shape[0])  # what the down GEMM reads
        (d_all,) = fold_dense_experts(h_all, (experts.down_all(h_all),), topk_ids, routes.down,
                                      adapter_ids, x_gather=2, impl=impl)
        return take_slots(d_all, topk_ids)

    def shared(self, x: Array, adapter_ids: Array | None, routes: MoELoRARoutes | None,
               impl: str) -> Array:
        """The shared experts' output ``[T, H]`` (``dtype``) with their LoRA deltas."""
        mlp = self.shared_experts
        g, u = mlp.first(x)
        if routes is not None:  # shared gate and up: one fold of their stacked route
            zeros = jnp.zeros((x.shape[0], 1), jnp.int32)
            g, u = fold_token_projections(x, (g, u), zeros, routes.shared_gate_up, adapter_ids,
                                          impl=impl)
        h = mlp.activation(g, u)
        d = mlp.down(h)
        if routes is not None:
            d = _fold_dense(h, d, routes.shared_down, adapter_ids, impl)
        return d

    def __call__(self, x: Array, adapter_ids: Array | None = None, *, impl: str | None = None,
                 use_lora: bool = True, lora_packs: MoELoRAPacks | None = None) -> Array:
        """Run the block.

        Args:
          x: ``[..., H]`` activations (cast to ``dtype``).
          adapter_ids: int ``[...]`` (``x``'s leading shape): each token's
            adapter slot, ``-1`` for the base model (a slot ``>= max_loras``
            folds nothing). ``None``, or a block built with ``lora=False``:
            every token uses the base model.
          impl: fold backend for this call (default: the block's ``impl``).
          use_lora: ``False`` runs the plain block with no fold at all.
          lora_packs: ``self.lora.in_gemm_packs()`` made beforehand (once per
            adapter change), or None. Where the expert GEMM folds the LoRA
            inside its K loop, it reads them instead of packing ``scale * B``
            in every call (the same bits); they must be the packs of the
            adapters as they are now. Not taken by a sharded block.

        Returns:
          ``[..., H]`` in ``dtype``. On a mesh (``sharding``), ``x``'s tokens
          are split over the data and expert axes (their count must divide),
          and the result is sharded the same way.
        """
        lead = x.shape[:-1]
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoEBlock: x has width {x.shape[-1]}, hidden_size is "
                             f"{self.hidden_size}")
        x2 = x.reshape(-1, self.hidden_size).astype(self.dtype)
        impl = self.impl if impl is None else impl
        routes = None
        if use_lora and self.lora is not None and adapter_ids is not None:
            check_int32_values(adapter_ids, "adapter_ids", "MoEBlock")
            ids = jnp.asarray(adapter_ids)
            if ids.shape != lead:
                raise ValueError(f"MoEBlock: adapter_ids has shape {ids.shape}, x's tokens are "
                                 f"{lead}")
            if not jnp.issubdtype(ids.dtype, jnp.integer):
                raise TypeError(f"MoEBlock: adapter_ids must be integers, got {ids.dtype}")
            adapter_ids = ids.reshape(-1).astype(jnp.int32)
            routes = self.lora.routes()._replace(packs=lora_packs)
        else:
            adapter_ids = None
        if self.sharding is not None:
            if lora_packs is not None:
                raise ValueError("MoEBlock: lora_packs is not taken by a sharded block")
            y = sharded_call(self, x2, adapter_ids, impl=impl, lora=routes is not None)
            return y.reshape(*lead, self.hidden_size)
        weights, topk_ids = self.route(x2, adapter_ids, routes, impl)
        y = self.routed(x2, weights, topk_ids, adapter_ids, routes, impl).astype(self.dtype)
        if self.shared_experts is not None:
            y = y + self.shared(x2, adapter_ids, routes, impl)
        return y.reshape(*lead, self.hidden_size)
