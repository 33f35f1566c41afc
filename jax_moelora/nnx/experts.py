"""Expert MLPs: the base matmuls, biases and activations of the routed experts,
and the shared-expert MLP of DeepSeek layers.

Routed experts work on the rows of a :class:`ExpertRows` (``T * top_k`` rows,
token ``t``'s slot ``k`` in flat order ``t * top_k + k`` or sorted by expert,
as the fold plan says); their LoRA deltas are folded by the block between
:meth:`first` (gate and up) and :meth:`down`. Base matmuls take one of two
paths: ``"ragged"`` (a grouped GEMM on rows sorted by expert) or
``"dense"`` (every expert on every token, then the chosen rows: cheap for
decode-sized batches). On the ragged path the grouped GEMM itself is chosen by
the block's ``expert_gemm`` option (:data:`ExpertGemm`): ``jax.lax.ragged_dot``
or the library's :func:`jax_moelora.expert_matmul` (a CUTLASS grouped GEMM on
Hopper GPUs; XLA:GPU lowers ``ragged_dot`` to a dense zero-padded matmul).

- :class:`GluExperts`: bias-free ``gate_proj``, ``up_proj [E, H, I]`` and
  ``down_proj [E, I, H]``, ``silu(gate) * up`` (Qwen3-MoE, Mixtral, DeepSeek).
- :class:`GptOssExperts`: fused ``gate_up_proj [E, H, 2I]`` (gate on even
  columns, up on odd ones) with ``gate_up_proj_bias [E, 2I]``, ``down_proj
  [E, I, H]`` with ``down_proj_bias [E, H]``, and gpt-oss's clamped gated
  activation.
- :class:`SharedExperts`: a dense SiLU-GLU MLP ``H -> I_s -> H`` applied to
  every token (``nnx.Linear`` layers without bias).
"""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jax_moelora.nnx.families import GptOss
from jax_moelora.ops.expert_matmul import expert_matmul as _library_expert_matmul
from jax_moelora.ops import backend
from jax_moelora.ops.batching import ragged_dot
from jax_moelora.ops.folds import RowPlan, plan_rows
from jax_moelora.ops.take_rows import take_rows

__all__ = ["EXPERT_GEMMS", "ExpertGemm", "ExpertPath", "ExpertRows", "GluExperts",
           "GptOssExperts", "SharedExperts", "default_expert_init", "dense_all_rows",
           "dense_all_tokens", "expert_matmul", "expert_matmul_folded", "expert_matmul_pair",
           "folds_in_gemm", "grouped_gemm_runs_kernel", "per_expert", "scatter_rows",
           "take_slots"]

Array = jax.Array
ExpertPath = Literal["dense", "ragged"]
#: The grouped GEMM of the ragged path: ``"ragged_dot"`` (``jax.lax.ragged_dot``
#: in the activation dtype, XLA's default precision), ``"expert_matmul"``
#: (:func:`jax_moelora.expert_matmul` without LoRA, ``impl="auto"``: the CUTLASS
#: kernel where it runs, else its fp32-accumulated ``ragged_dot``), or
#: ``"auto"``: ``expert_matmul`` where its CUTLASS kernel runs (see
#: :func:`grouped_gemm_runs_kernel`) and the computation is lowered for CUDA,
#: ``ragged_dot`` everywhere else (so the CPU keeps ``ragged_dot``'s bits).
ExpertGemm = Literal["auto", "ragged_dot", "expert_matmul"]
EXPERT_GEMMS: tuple[str, ...] = ("auto", "ragged_dot", "expert_matmul")

#: LeCun normal over each expert's ``[K, N]`` matrix of ``[E, K, N]`` weights.
default_expert_init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))


class ExpertRows(NamedTuple):
    """The rows the routed experts compute, and how the base matmuls run.

    ``plan``: the fold plan (flat or sorted rows). ``path``: ``"dense"`` or
    ``"ragged"``. ``ragged``: the plan sorted by expert that the grouped GEMM
    reads (``plan`` itself when it is sorted; ``None`` on the dense path).
    ``gemm``: the grouped GEMM of the ragged path (:data:`ExpertGemm`).
    """

    plan: RowPlan
    path: str
    ragged: RowPlan | None
    gemm: str = "auto"

    @classmethod
    def make(cls, plan: RowPlan, path: ExpertPath, num_experts: int,
             gemm: ExpertGemm = "auto") -> "ExpertRows":
        if gemm not in EXPERT_GEMMS:
            raise ValueError(f"expert_gemm must be one of {EXPERT_GEMMS}, got {gemm!r}")
        if path == "dense" or plan.grouped:
            return cls(plan, path, plan if path == "ragged" else None, gemm)
        return cls(plan, path, plan_rows(plan.topk_ids, num_experts, gather_max_rows=0), gemm)

    def experts(self) -> Array:
        """int32 ``[T * top_k]``: each row's expert, in plan order."""
        return self.plan.row_experts()


def take_slots(all_out: Array, topk_ids: Array) -> Array:
    """``all_out [E, T, N]`` -> flat rows ``[T * k, N]`` of the chosen experts."""
    t, k = topk_ids.shape
    return all_out[topk_ids, jnp.arange(t)[:, None]].reshape(t * k, -1)


def per_expert(h_all: Array, w: Array) -> Array:
    """Rows ``h_all [E, T, K]`` each through its expert's ``w [E, K, N]``:
    ``[E, T, N]`` (a matmul batched over experts, ``w`` read in place)."""
    return jnp.einsum("etk,ekn->etn", h_all, w)


def dense_all_tokens(x: Array, w: Array) -> Array:
    """Every expert on every token ``x [T, K]``: ``[E, T, N]``.

    Written as a matmul batched over experts (``x`` broadcast), so ``w
    [E, K, N]`` is read in place: the unbatched ``"tk,ekn->ten"`` makes XLA
    transpose the whole weight on every call."""
    return per_expert(jnp.broadcast_to(x[None], (w.shape[0],) + x.shape), w)


def scatter_rows(h: Array, topk_ids: Array, num_experts: int) -> Array:
    """Flat per-row inputs ``h [T * k, K]`` as rows ``(e, t)`` of ``[E, T, K]``
    (zeros elsewhere: a token's top-k experts are distinct)."""
    t, k = topk_ids.shape
    scat = jnp.zeros((num_experts, t, h.shape[-1]), h.dtype)
    return scat.at[topk_ids, jnp.arange(t)[:, None]].set(h.reshape(t, k, -1))


def dense_all_rows(h: Array, w: Array, topk_ids: Array) -> Array:
    """Flat per-row inputs ``h [T * k, K]`` through their own expert, as rows
    ``(e, t)`` of ``[E, T, N]`` (rows of experts a token did not choose: zero):
    :func:`scatter_rows`, then a matmul expert by expert."""
    return per_expert(scatter_rows(h, topk_ids, w.shape[0]), w)


def _dense_tokens(x: Array, w: Array, topk_ids: Array) -> Array:
    """Every expert on every token ``x [T, K]``, then the chosen ones: ``[T * k, N]``."""
    return take_slots(dense_all_tokens(x, w), topk_ids)


def _dense_rows(h: Array, w: Array, topk_ids: Array) -> Array:
    """Flat per-row inputs ``h [T * k, K]`` through their own expert: ``[T * k, N]``."""
    return take_slots(dense_all_rows(h, w, topk_ids), topk_ids)


def grouped_gemm_runs_kernel(dtype: Any, k: int, n: int) -> bool:
    """Whether ``expert_gemm="auto"`` takes :func:`jax_moelora.expert_matmul`
    for a ``[*, k] x [E, k, n]`` GEMM lowered for CUDA: its CUTLASS kernel is
    built for this machine's GPU and takes these operands
    (``ops.backend.cutlass_takes``: sm_90, bf16/f16, ``k`` and ``n``
    multiples of ``EXPERT_MATMUL_ALIGN``)."""
    return backend.cutlass_takes(dtype, k, n)


def _ragged_dot(xs: Array, ws: tuple[Array, ...], sizes: Array, stacked: bool):
    outs = tuple(ragged_dot(xs, w, sizes) for w in ws)  # jax.lax.ragged_dot, vmappable
    return jnp.stack(outs) if stacked else outs


def _expert_matmul(xs: Array, ws: tuple[Array, ...], sizes: Array, stacked: bool):
    """The library's grouped GEMM without LoRA; a pair is one call (one launch)
    whose outputs are written stacked ``[2, M, N]``."""
    sizes = sizes.astype(jnp.int32)
    if len(ws) == 2:
        out = _library_expert_matmul(xs, ws, sizes, stacked=True)
        return out if stacked else (out[0], out[1])
    outs = tuple(_library_expert_matmul(xs, w, sizes) for w in ws)
    return jnp.stack(outs) if stacked else outs


def _grouped_gemm(xs: Array, ws: tuple[Array, ...], sizes: Array, gemm: str,
                  stacked: bool = False):
    """Rows ``xs [M, K]`` sorted by expert (``sizes [E]`` rows each) through
    each of ``ws`` (``[E, K, N]``, same shape): one ``[M, N]`` per weight, or
    with ``stacked`` one ``[len(ws), M, N]``."""
    ragged = functools.partial(_ragged_dot, stacked=stacked)
    library = functools.partial(_expert_matmul, stacked=stacked)
    if gemm == "ragged_dot":
        return ragged(xs, ws, sizes)
    if gemm == "expert_matmul":
        return library(xs, ws, sizes)
    _, k, n = ws[0].shape
    if not grouped_gemm_runs_kernel(xs.dtype, k, n):
        return ragged(xs, ws, sizes)
    # The kernel is built: take it when lowered for CUDA, ragged_dot on any
    # other platform (ops/backend.py).
    return backend.per_platform(xs, ws, sizes, cpu=ragged, cuda=library, default=ragged)


def expert_matmul_pair(x: Array, ws: tuple[Array, ...], rows: ExpertRows, *,
                       x_gather: bool, stacked: bool = False):
    """Each row through its expert's weights, for one or two weight sets of one
    shape ``[E, K, N]`` on the same rows (gate and up: on the ragged path with
    ``expert_matmul`` they are one grouped GEMM of ``2E`` problems).

    Args:
      x: ``[T, K]`` tokens (``x_gather``: row ``r`` reads its token) or
        ``[T * top_k, K]`` rows in plan order.
      ws: the experts' weights, ``x``'s dtype.
      rows: the rows and the matmul path.

    Returns:
      one ``[T * top_k, N]`` per weight set, in plan order; with ``stacked``
      one ``[len(ws), T * top_k, N]`` (the ragged path of a sorted plan writes
      it in place with ``expert_matmul``).
    """
    plan = rows.plan
    if rows.path == "ragged":
        srt = rows.ragged
        sizes = jnp.diff(srt.expert_offsets)
        if x_gather:
            xs = take_rows(x, srt.sorted_token_ids)
        else:
            xs = x if plan.grouped else srt.to_plan_order(x)
        if plan.grouped:
            return _grouped_gemm(xs, tuple(ws), sizes, rows.gemm, stacked)
        outs = [srt.to_flat_order(o) for o in _grouped_gemm(xs, tuple(ws), sizes, rows.gemm)]
    else:
        outs = [plan.to_plan_order(_dense_tokens(x, w, plan.topk_ids) if x_gather else
                                   _dense_rows(plan.to_flat_order(x), w, plan.topk_ids))
                for w in ws]
    return jnp.stack(outs) if stacked else tuple(outs)


def folds_in_gemm(rows: ExpertRows, dtype: Any, k: int, n: int, impl: str) -> bool:
    """Whether :func:`expert_matmul_folded` may fold in the GEMM's custom call:
    sorted rows on the ragged path, a grouped GEMM that is the library's
    kernel where it runs (``expert_gemm`` ``"auto"`` or ``"expert_matmul"``),
    a kernel built that takes these operands, and the fast folds (``impl``
    ``"auto"`` or ``"fast"``)."""
    return (rows.path == "ragged" and rows.plan.grouped and rows.gemm != "ragged_dot"
            and impl in ("auto", "fast") and grouped_gemm_runs_kernel(dtype, k, n))


def expert_matmul_folded(x: Array, ws: tuple[Array, ...], rows: ExpertRows, routes: tuple,
                         row_adapter: Array | None, fold, *, x_gather: bool,
                         packs: tuple | None = None) -> Array:
    """:func:`expert_matmul_pair` (stacked ``[len(ws), T * top_k, N]``, a
    sorted plan on the ragged path: :func:`folds_in_gemm`) with each weight
    set's LoRA route of ``routes`` folded. Lowered for CUDA, one custom call
    (:func:`jax_moelora.expert_matmul` with ``lora``, the grouped fold inside
    the GEMM's K loop where ``lora_in_gemm_default`` says so, else after it in
    the same call); on any other platform the GEMM, then ``fold`` of its
    stacked output (the block's grouped fold). ``packs``: the routes'
    ``pack_lora_in_gemm`` packs (one per route) or None, read by the kernel
    folding inside its K loop."""
    srt = rows.ragged
    sizes = jnp.diff(srt.expert_offsets).astype(jnp.int32)
    pair = len(ws) == 2

    def in_gemm(x, ws, sizes):
        # x_gather: the call gathers the tokens itself and its shrinks read them
        # where they lie (top_k sorted rows share one token row)
        out = _library_expert_matmul(
            x, ws if pair else ws[0], sizes, lora=tuple(routes) if pair else routes[0],
            row_adapter=row_adapter, sorted_token_ids=srt.sorted_token_ids,
            x_gather=int(x_gather), stacked=pair, impl="auto",
            gather_max_rows=0,  # "auto": traced whatever the default device
            lora_packs=None if packs is None else (tuple(packs) if pair else packs[0]))
        return out if pair else out[None]

    def after(x, ws, sizes):
        xs = take_rows(x, srt.sorted_token_ids) if x_gather else x
        return fold(_grouped_gemm(xs, ws, sizes, rows.gemm, stacked=True))

    return backend.per_platform(x, tuple(ws), sizes, cpu=after, cuda=in_gemm, default=after)


def expert_matmul(x: Array, w: Array, rows: ExpertRows, *, x_gather: bool) -> Array:
    """Each row through its expert's ``w [E, K, N]``: ``[T * top_k, N]`` in plan
    order (:func:`expert_matmul_pair` with one weight set)."""
    return expert_matmul_pair(x, (w,), rows, x_gather=x_gather)[0]


def _f32(v: Array) -> Array:
    return v.astype(jnp.float32)


class GluExperts(nnx.Module):
    """Bias-free SiLU-GLU experts: ``down(silu(gate(x)) * up(x))``.

    Args:
      hidden_size, intermediate_size, num_experts: ``H``, ``I``, ``E``.
      dtype: the computation dtype (weights are cast to it).
      param_dtype: the weights' dtype.
      kernel_init: initializer of each ``[E, K, N]`` weight.
      rngs: initialisation keys.

    State: ``gate_proj``, ``up_proj`` (``nnx.Param [E, H, I]``), ``down_proj``
    (``nnx.Param [E, I, H]``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, *,
                 dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                 kernel_init: Any = default_expert_init, rngs: nnx.Rngs):
        H, I, E = hidden_size, intermediate_size, num_experts
        self.dtype, self.param_dtype = jnp.dtype(dtype), jnp.dtype(param_dtype)
        self.gate_proj = nnx.Param(kernel_init(rngs.params(), (E, H, I), self.param_dtype))
        self.up_proj = nnx.Param(kernel_init(rngs.params(), (E, H, I), self.param_dtype))
        self.down_proj = nnx.Param(kernel_init(rngs.params(), (E, I, H), self.param_dtype))

    def first(self, x: Array, rows: ExpertRows) -> tuple[Array, Array]:
        """Tokens ``x [T, H]`` -> base ``(gate, up)`` rows ``[T * top_k, I]`` each."""
        g, u = expert_matmul_pair(x, (self.gate_proj[...].astype(self.dtype),
                                      self.up_proj[...].astype(self.dtype)), rows, x_gather=True)
        return g, u

    def first_stacked(self, x: Array, rows: ExpertRows) -> Array:
        """:meth:`first` stacked ``[2, T * top_k, I]`` (gate, up), the layout
        of the stacked gate+up fold (written in place by ``expert_matmul``)."""
        return expert_matmul_pair(x, (self.gate_proj[...].astype(self.dtype),
                                      self.up_proj[...].astype(self.dtype)), rows, x_gather=True,
                                  stacked=True)

    def first_folded(self, x: Array, rows: ExpertRows, routes: tuple, row_adapter: Array | None,
                     fold, packs: tuple | None = None) -> Array:
        """:meth:`first_stacked` with the gate and up LoRA ``routes`` folded
        (:func:`expert_matmul_folded`; ``fold`` folds the stacked output where
        the GEMM's custom call does not; ``packs``: the routes' packs or None)."""
        return expert_matmul_folded(x, (self.gate_proj[...].astype(self.dtype),
                                        self.up_proj[...].astype(self.dtype)), rows, routes,
                                    row_adapter, fold, x_gather=True, packs=packs)

    def first_all(self, x: Array) -> tuple[Array, Array]:
        """Tokens ``x [T, H]`` -> base gate and up of every expert on every
        token, ``[E, T, I]`` each (the dense path's layout before the chosen
        rows are taken)."""
        return (dense_all_tokens(x, self.gate_proj[...].astype(self.dtype)),
                dense_all_tokens(x, self.up_proj[...].astype(self.dtype)))

    def activation(self, g: Array, u: Array) -> Array:
        """``silu(g) * u`` in float32, rounded once to the activation dtype (so
        the result does not depend on how XLA fuses the elementwise ops)."""
        return (jax.nn.silu(_f32(g)) * _f32(u)).astype(g.dtype)

    def down(self, h: Array, rows: ExpertRows) -> Array:
        """Rows ``h [T * top_k, I]`` -> base down rows ``[T * top_k, H]``."""
        return expert_matmul(h, self.down_proj[...].astype(self.dtype), rows, x_gather=False)

    def down_folded(self, h: Array, rows: ExpertRows, route, row_adapter: Array | None,
                    fold, pack=None) -> Array:
        """:meth:`down` with the down LoRA ``route`` folded (as
        :meth:`first_folded`; ``fold`` takes and returns ``[1, rows, H]``)."""
        return expert_matmul_folded(h, (self.down_proj[...].astype(self.dtype),), rows, (route,),
                                    row_adapter, fold, x_gather=False,
                                    packs=None if pack is None else (pack,))[0]

    def down_all(self, h_all: Array) -> Array:
        """Rows ``h_all [E, T, I]`` (:func:`scatter_rows` of the flat rows) ->
        base down ``[E, T, H]``, the dense path's layout."""
        return per_expert(h_all, self.down_proj[...].astype(self.dtype))


class GptOssExperts(nnx.Module):
    """gpt-oss experts: fused interleaved gate/up with biases, clamped gated
    activation, down with a bias.

    Args:
      hidden_size, intermediate_size, num_experts: ``H``, ``I``, ``E``.
      family: the :class:`GptOss` config (``alpha``, ``limit``).
      dtype, param_dtype, kernel_init, rngs: as :class:`GluExperts`.
      bias_init: initializer of the biases.

    State: ``gate_up_proj [E, H, 2I]`` (gate on even columns, up on odd
    ones), ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``,
    ``down_proj_bias [E, H]`` (``nnx.Param``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, *,
                 family: GptOss, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                 kernel_init: Any = default_expert_init,
                 bias_init: Any = nnx.initializers.zeros_init(), rngs: nnx.Rngs):
        H, I, E = hidden_size, intermediate_size, num_experts
        self.dtype, self.param_dtype = jnp.dtype(dtype), jnp.dtype(param_dtype)
        self.alpha, self.limit = float(family.alpha), float(family.limit)
        pd = self.param_dtype
        self.gate_up_proj = nnx.Param(kernel_init(rngs.params(), (E, H, 2 * I), pd))
        self.gate_up_proj_bias = nnx.Param(bias_init(rngs.params(), (E, 2 * I), pd))
        self.down_proj = nnx.Param(kernel_init(rngs.params(), (E, I, H), pd))
        self.down_proj_bias = nnx.Param(bias_init(rngs.params(), (E, H), pd))

    def first(self, x: Array, rows: ExpertRows) -> tuple[Array, Array]:
        """Tokens ``x [T, H]`` -> base ``(gate, up)`` rows ``[T * top_k, I]``
        each, biases included (the even and odd columns of ``gate_up``)."""
        gu = expert_matmul(x, self.gate_up_proj[...].astype(self.dtype), rows, x_gather=True)
        gu = gu + self.gate_up_proj_bias[...].astype(self.dtype)[rows.experts()]
        return gu[:, 0::2], gu[:, 1::2]

    def first_stacked(self, x: Array, rows: ExpertRows) -> Array:
        """:meth:`first` stacked ``[2, T * top_k, I]`` (gate, up)."""
        return jnp.stack(self.first(x, rows))

    def activation(self, g: Array, u: Array) -> Array:
        """``(clip(u, -limit, limit) + 1) * gc * sigmoid(alpha * gc)`` with
        ``gc = min(g, limit)``, in float32, rounded once."""
        gc = jnp.minimum(_f32(g), self.limit)
        uc = jnp.clip(_f32(u), -self.limit, self.limit)
        return ((uc + 1.0) * (gc * jax.nn.sigmoid(self.alpha * gc))).astype(g.dtype)

    def down(self, h: Array, rows: ExpertRows) -> Array:
        """Rows ``h [T * top_k, I]`` -> base down rows ``[T * top_k, H]``, bias included."""
        d = expert_matmul(h, self.down_proj[...].astype(self.dtype), rows, x_gather=False)
        return d + self.down_proj_bias[...].astype(self.dtype)[rows.experts()]


class SharedExperts(nnx.Module):
    """DeepSeek's shared experts: one dense SiLU-GLU MLP ``H -> I_s -> H``.

    Args:
      hidden_size: ``H``.
      intermediate_size: ``I_s`` (``n_shared * moe_intermediate_size``).
      dtype, param_dtype: computation and weight dtypes.
      kernel_init: initializer of the ``[in, out]`` kernels.
      rngs: initialisation keys.

    State: ``gate_proj``, ``up_proj`` (``nnx.Linear``, kernel ``[H, I_s]``),
    ``down_proj`` (kernel ``[I_s, H]``), no biases. The block folds the
    ``shared_*`` LoRA deltas between :meth:`first` and :meth:`down`.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32, kernel_init: Any = None, rngs: nnx.Rngs):
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if kernel_init is not None:
            kw["kernel_init"] = kernel_init
        self.gate_proj = nnx.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nnx.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nnx.Linear(intermediate_size, hidden_size, **kw)

    def first(self, x: Array) -> tuple[Array, Array]:
        """``x [T, H]`` -> base ``(gate, up)`` ``[T, I_s]``."""
        return self.gate_proj(x), self.up_proj(x)

    def activation(self, g: Array, u: Array) -> Array:
        """``silu(g) * u`` in float32, rounded once."""
        return (jax.nn.silu(_f32(g)) * _f32(u)).astype(g.dtype)

    def down(self, h: Array) -> Array:
        """``h [T, I_s]`` -> ``[T, H]``."""
        return self.down_proj(h)

    def __call__(self, x: Array) -> Array:
        """The MLP without LoRA: ``x [T, H]`` -> ``[T, H]``."""
        return self.down(self.activation(*self.first(x)))
