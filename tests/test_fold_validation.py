"""Bad input to the folds gets a clear Python error at trace time.

Each case starts from a valid call and breaks one thing; the error's type
and message must name what is wrong. (The table packers and route
constructors of ``tables.py`` have their own invalid-input tests in
``test_tables.py``; here: ``MoeExpertRoute`` as the folds see it.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import HAS_GPU
from jax_moelora import (MoeExpertRoute, _ext, moe_lora_fold, moe_lora_gather_bgmv,
                         moe_lora_grouped_down)
from jax_moelora.ops import resolve_impl

GPU = pytest.mark.gpu
T, TOP_K, K, N, R, E, L, P = 6, 2, 16, 12, 8, 3, 2, 5
N_SLOTS = T * TOP_K
TE = 20
BF16 = jnp.bfloat16


def _route(**over):
    rng = np.random.default_rng(0)
    fields = dict(a_pool=jnp.asarray(rng.normal(size=(P, R, K)), BF16),
                  b_pool=jnp.asarray(rng.normal(size=(P, N, R)), BF16),
                  a_table=jnp.asarray(rng.integers(1, P, (L, E)), jnp.int32),
                  b_table=jnp.asarray(rng.integers(1, P, (L, E)), jnp.int32),
                  scale_table=jnp.ones((L, E), jnp.float32))
    fields.update(over)
    return MoeExpertRoute(**fields)


def _arr(shape, dtype=BF16):
    rng = np.random.default_rng(sum(shape) + 1)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(0, 3, shape), dtype)
    return jnp.asarray(rng.normal(size=shape), dtype)


def _gather_args():
    return dict(x=_arr((N_SLOTS, K)), base_out=_arr((N_SLOTS, N)),
                indices=_arr((N_SLOTS,), jnp.int32), route=_route(),
                row_adapter=_arr((T,), jnp.int32), top_k=TOP_K, x_gather=0, impl="auto")


def _grouped_args():
    return dict(x=_arr((TE, K)), base_out=_arr((TE, N)),
                expert_offsets=jnp.asarray([0, 4, 9, 15, 20], jnp.int32),
                sorted_token_ids=_arr((TE,), jnp.int32), route=_route(),
                row_adapter=_arr((T,), jnp.int32), x_gather=0, impl="auto")


def _fold_args():
    return dict(x=_arr((T, K)), base_out=_arr((N_SLOTS, N)), topk_ids=_arr((T, TOP_K), jnp.int32),
                route=_route(), row_adapter=_arr((T,), jnp.int32), x_gather=1, impl="auto")


STATIC = ("top_k", "x_gather", "impl", "row_offset", "row_end", "gather_max_rows")


def _split(args):
    """(positional operands in call order, static keywords)."""
    return ([v for k, v in args.items() if k not in STATIC],
            {k: v for k, v in args.items() if k in STATIC})


def _call(fn, args):
    pos, kw = _split(args)
    return fn(*pos, **kw)


def _cases(*cases):
    return pytest.mark.parametrize("change,err,match", [c[1:] for c in cases],
                                   ids=[c[0] for c in cases])


# --------------------------------------------------------- shared by both

COMMON = [
    ("route_not_a_route", {"route": (1, 2)}, TypeError, "route must be a MoeExpertRoute"),
    ("x_not_an_array", {"x": [[1.0] * K]}, TypeError, "x must be an array"),
    ("base_out_1d", {"base_out": _arr((N,))}, ValueError, r"base_out must be 2-D \[rows, n_out\]"),
    ("x_3d", {"x": _arr((2, 3, K))}, ValueError, r"x must be 2-D \[rows, k_in\]"),
    ("base_out_dtype_vs_pools", {"base_out": "f16"}, TypeError,
     "base_out dtype float16 differs from the route's pools"),
    ("x_dtype_vs_base_out", {"x": "f32"}, TypeError,
     "x dtype float32 differs from base_out dtype bfloat16"),
    ("base_out_columns_vs_n_out", {"base_out": "wide"}, ValueError,
     f"base_out has {N + 1} columns but the route's n_out is {N}"),
    ("x_columns_vs_k_in", {"x": "wide"}, ValueError,
     f"x has {K + 1} columns but the route's k_in is {K}"),
    ("rank_above_kernel_limit",
     {"route": dict(a_pool=_arr((P, _ext.MAX_RANK + 8, K)), b_pool=_arr((P, N, _ext.MAX_RANK + 8)))},
     ValueError, f"max_rank {_ext.MAX_RANK + 8} exceeds the kernels' limit {_ext.MAX_RANK}"),
    ("x_gather_2", {"x_gather": 2}, ValueError, "x_gather must be 0 or 1, got 2"),
    ("x_gather_float", {"x_gather": 0.0}, ValueError, "x_gather must be 0 or 1, got 0.0"),
    ("x_gather_none", {"x_gather": None}, ValueError, "x_gather must be 0 or 1, got None"),
    ("row_adapter_uint32", {"row_adapter": "uint32"}, TypeError,
     "row_adapter must be int32, got uint32"),
    ("row_adapter_2d", {"row_adapter": "2d"}, ValueError, "row_adapter must be 1-D"),
    ("impl_unknown", {"impl": "cuda"}, ValueError, "impl must be one of"),
]


def _apply(args, change):
    """Apply a change; string values are edits of the current argument."""
    args = dict(args)
    for k, v in change.items():
        cur = args.get(k)
        if k == "route" and isinstance(v, dict):
            v = _route(**v)
        elif not isinstance(v, str):
            pass
        elif v in ("f16", "f32"):
            v = cur.astype(jnp.float16 if v == "f16" else jnp.float32)
        elif v == "wide":
            v = jnp.concatenate([cur, cur[:, :1]], axis=1)
        elif v == "uint32":
            v = cur.astype(jnp.uint32)
        elif v == "2d":
            v = cur.reshape(1, -1)
        args[k] = v
    return args


@pytest.mark.parametrize("op", ["gather", "grouped"])
@_cases(*COMMON)
def test_bad_common_input_is_rejected(op, change, err, match):
    fn, args = ((moe_lora_gather_bgmv, _gather_args()) if op == "gather"
                else (moe_lora_grouped_down, _grouped_args()))
    with pytest.raises(err, match=match):
        _call(fn, _apply(args, change))


# -------------------------------------------------------------- gather

@_cases(
    ("no_rows", {"x": _arr((0, K)), "base_out": _arr((0, N)), "indices": _arr((0,), jnp.int32),
                 "row_adapter": None}, ValueError, "moe_lora_gather_bgmv: base_out has no rows"),
    ("top_k_zero", {"top_k": 0}, ValueError, "top_k must be a positive int, got 0"),
    ("top_k_float", {"top_k": 2.0}, ValueError, "top_k must be a positive int, got 2.0"),
    ("top_k_bool", {"top_k": True}, ValueError, "top_k must be a positive int, got True"),
    ("n_slots_not_multiple_of_top_k", {"top_k": 5}, ValueError,
     f"n_slots {N_SLOTS} is not a multiple of top_k 5"),
    ("x_rows_for_x_gather_1", {"x_gather": 1}, ValueError,
     f"x has {N_SLOTS} rows; x_gather=1 needs {T}"),
    ("x_rows_for_x_gather_0", {"x": _arr((T, K))}, ValueError,
     f"x has {T} rows; x_gather=0 needs {N_SLOTS}"),
    ("indices_float", {"indices": _arr((N_SLOTS,), jnp.float32)}, TypeError,
     "indices must be int32 or uint32, got float32"),
    ("indices_int64_numpy", {"indices": np.zeros(N_SLOTS, np.int64)}, TypeError,
     "indices must be int32 or uint32, got int64"),
    ("indices_2d", {"indices": _arr((T, TOP_K), jnp.int32)}, ValueError, "indices must be 1-D"),
    ("indices_length", {"indices": _arr((N_SLOTS - 1,), jnp.int32)}, ValueError,
     f"indices has {N_SLOTS - 1} entries, base_out has {N_SLOTS} rows"),
    ("row_adapter_length", {"row_adapter": _arr((T - 1,), jnp.int32)}, ValueError,
     f"row_adapter has {T - 1} entries, the batch has {T} tokens"),
)
def test_bad_gather_input_is_rejected(change, err, match):
    with pytest.raises(err, match=match):
        _call(moe_lora_gather_bgmv, _apply(_gather_args(), change))


# ------------------------------------------------------------- grouped

@_cases(
    ("no_rows", {"x": _arr((0, K)), "base_out": _arr((0, N)),
                 "sorted_token_ids": _arr((0,), jnp.int32)}, ValueError,
     "moe_lora_grouped_down: base_out has no rows"),
    ("expert_offsets_shorter_than_n_experts_plus_1",
     {"expert_offsets": jnp.asarray([0, 4, 20], jnp.int32)}, ValueError,
     f"expert_offsets has 3 entries; the route's {E} experts need at least {E + 1}"),
    ("expert_offsets_empty", {"expert_offsets": _arr((0,), jnp.int32)}, ValueError,
     f"expert_offsets has 0 entries; the route's {E} experts need at least {E + 1}"),
    ("expert_offsets_uint32", {"expert_offsets": "uint32"}, TypeError,
     "expert_offsets must be int32, got uint32"),
    ("expert_offsets_2d", {"expert_offsets": "2d"}, ValueError, "expert_offsets must be 1-D"),
    ("sorted_token_ids_length", {"sorted_token_ids": _arr((TE - 1,), jnp.int32)}, ValueError,
     f"sorted_token_ids has {TE - 1} entries, base_out has {TE} rows"),
    ("sorted_token_ids_float", {"sorted_token_ids": _arr((TE,), jnp.float32)}, TypeError,
     "sorted_token_ids must be int32, got float32"),
    ("x_rows_for_x_gather_0", {"x": _arr((T, K))}, ValueError,
     f"x has {T} rows; x_gather=0 needs one per sorted row \\({TE}\\)"),
    ("x_empty_for_x_gather_1", {"x": _arr((0, K)), "x_gather": 1, "row_adapter": None},
     ValueError, "moe_lora_grouped_down: x has no rows"),
    ("row_adapter_empty", {"row_adapter": _arr((0,), jnp.int32)}, ValueError,
     "row_adapter is empty"),
    ("row_adapter_vs_x_tokens", {"x": _arr((T + 1, K)), "x_gather": 1}, ValueError,
     f"row_adapter has {T} entries but x has {T + 1} tokens"),
    ("row_offset_float", {"row_offset": 1.0}, TypeError, "row_offset must be a static int"),
    ("row_end_array", {"row_end": jnp.int32(5)}, TypeError, "row_end must be a static int"),
    ("row_offset_bool", {"row_offset": True}, TypeError, "row_offset must be a static int"),
    ("window_negative", {"row_offset": -1, "row_end": 5}, ValueError,
     rf"window \[-1, 5\) is not inside \[0, {TE}\]"),
    ("window_past_te", {"row_offset": 5, "row_end": TE + 1}, ValueError,
     rf"window \[5, {TE + 1}\) is not inside \[0, {TE}\]"),
    ("window_reversed", {"row_offset": 6, "row_end": 5}, ValueError,
     rf"window \[6, 5\) is not inside \[0, {TE}\]"),
)
def test_bad_grouped_input_is_rejected(change, err, match):
    with pytest.raises(err, match=match):
        _call(moe_lora_grouped_down, _apply(_grouped_args(), change))


# ------------------------------------------------------- moe_lora_fold

@pytest.mark.parametrize("gather_max_rows", [2048, 0], ids=["gather_path", "sorted_path"])
@_cases(
    ("topk_ids_1d", {"topk_ids": _arr((N_SLOTS,), jnp.int32)}, ValueError,
     r"topk_ids must be \[T, top_k\]"),
    ("topk_ids_no_slots", {"topk_ids": _arr((T, 0), jnp.int32)}, ValueError,
     "topk_ids has no slots"),
    ("topk_ids_float", {"topk_ids": _arr((T, TOP_K), jnp.float32)}, TypeError,
     "topk_ids must be int32 or uint32, got float32"),
    ("base_out_rows", {"base_out": _arr((N_SLOTS + 1, N))}, ValueError,
     rf"base_out must be \[T \* top_k = {N_SLOTS}, n_out\]"),
    ("no_tokens", {"x": _arr((0, K)), "base_out": _arr((0, N)),
                   "topk_ids": _arr((0, TOP_K), jnp.int32), "row_adapter": None},
     ValueError, "base_out has no rows"),
    ("x_rows_for_x_gather_1", {"x": _arr((N_SLOTS, K))}, ValueError,
     rf"x must be \[{T}, k_in\] with x_gather=1"),
    ("x_rows_for_x_gather_0", {"x_gather": 0}, ValueError,
     rf"x must be \[{N_SLOTS}, k_in\] with x_gather=0"),
    ("row_adapter_length", {"row_adapter": _arr((T - 1,), jnp.int32)}, ValueError,
     f"row_adapter has {T - 1} entries, the batch has {T} tokens"),
    ("x_gather_2", {"x_gather": 2}, ValueError, "x_gather must be 0 or 1"),
    ("impl_unknown", {"impl": "fastest"}, ValueError, "impl must be one of"),
)
def test_bad_fold_input_is_rejected_on_both_paths(gather_max_rows, change, err, match):
    """moe_lora_fold rejects the same inputs whichever fold it would pick."""
    args = _apply(_fold_args(), change)
    with pytest.raises(err, match=match):
        _call(moe_lora_fold, dict(args, gather_max_rows=gather_max_rows))


# ------------------------------------------------------ MoeExpertRoute

@_cases(
    ("pool_not_an_array", {"a_pool": "pool"}, TypeError, "a_pool and b_pool must be arrays"),
    ("a_pool_2d", {"a_pool": _arr((P, R))}, ValueError, r"a_pool must be \[P, R, K\]"),
    ("b_pool_2d", {"b_pool": _arr((P, N))}, ValueError, r"b_pool must be \[P, N, R\]"),
    ("pool_int", {"a_pool": _arr((P, R, K), jnp.int32), "b_pool": _arr((P, N, R), jnp.int32)},
     TypeError, "a_pool dtype must be bf16, f16 or f32, got int32"),
    ("pool_dtypes_differ", {"b_pool": _arr((P, N, R), jnp.float16)}, TypeError,
     "b_pool dtype float16 differs from a_pool dtype bfloat16"),
    ("pool_slots_differ", {"b_pool": _arr((P + 1, N, R))}, ValueError,
     f"a_pool has {P} slots but b_pool has {P + 1}"),
    ("pool_ranks_differ", {"b_pool": _arr((P, N, 2 * R))}, ValueError,
     f"a_pool rank {R} differs from b_pool rank {2 * R}"),
    ("rank_not_multiple_of_8", {"a_pool": _arr((P, 12, K)), "b_pool": _arr((P, N, 12))},
     ValueError, "max_rank 12 must be a positive multiple of 8"),
    ("rank_zero", {"a_pool": _arr((P, 0, K)), "b_pool": _arr((P, N, 0))}, ValueError,
     "max_rank 0 must be a positive multiple of 8"),
    ("pool_empty", {"a_pool": _arr((0, R, K)), "b_pool": _arr((0, N, R))}, ValueError,
     "empty pool"),
    ("k_in_zero", {"a_pool": _arr((P, R, 0))}, ValueError, "empty pool"),
    ("a_table_float", {"a_table": _arr((L, E), jnp.float32)}, TypeError,
     "a_table must be an integer array, got float32"),
    ("scale_table_bool", {"scale_table": jnp.ones((L, E), bool)}, TypeError,
     "scale_table must be a float array, got bool"),
    ("table_3d", {"b_table": _arr((1, L, E), jnp.int32)}, ValueError,
     r"b_table must be \[L, E_t\] or \[E_t\]"),
    ("table_shapes_differ", {"b_table": _arr((L, E + 1), jnp.int32)}, ValueError,
     "table shapes differ"),
    ("tables_empty", {"a_table": _arr((L, 0), jnp.int32), "b_table": _arr((L, 0), jnp.int32),
                      "scale_table": _arr((L, 0), jnp.float32)}, ValueError,
     r"tables must be non-empty \[L, E_t\]"),
)
def test_bad_route_is_rejected(change, err, match):
    with pytest.raises(err, match=match):
        _route(**change)
    with pytest.raises(err, match=match):  # replace() validates too
        _route().replace(**change)


def test_route_accepts_1d_tables_as_single_adapter():
    route = _route(a_table=jnp.ones(E, jnp.int32), b_table=jnp.ones(E, jnp.int32),
                   scale_table=jnp.ones(E))
    assert (route.max_loras, route.n_experts) == (1, E)


# ----------------------------------------------------------- trace time

@pytest.mark.parametrize("op,change,match", [
    ("gather", {"top_k": 5}, "not a multiple of top_k"),
    ("grouped", {"expert_offsets": jnp.asarray([0, 20], jnp.int32)}, "need at least"),
    ("fold", {"row_adapter": _arr((T + 1,), jnp.int32)}, "row_adapter has"),
])
def test_errors_are_raised_at_trace_time(op, change, match):
    """The checks need only shapes: abstract evaluation (nothing runs) raises."""
    fn, args = {"gather": (moe_lora_gather_bgmv, _gather_args()),
                "grouped": (moe_lora_grouped_down, _grouped_args()),
                "fold": (moe_lora_fold, _fold_args())}[op]
    pos, kw = _split(_apply(args, change))
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda *a: fn(*a, **kw), *pos)


# --------------------------------------------------------------- impl

@pytest.mark.skipif(HAS_GPU, reason="on a GPU with the CUDA kernels simple/fast are available")
@pytest.mark.parametrize("impl", ["simple", "fast"])
def test_cuda_impl_without_cuda_says_why(impl):
    why = ("the extension was built without CUDA" if not _ext.HAS_CUDA
           else "computations go to 'cpu', not 'gpu'")
    with pytest.raises(ValueError, match=f"impl='{impl}' needs the CUDA kernels on a GPU: {why}"):
        _call(moe_lora_gather_bgmv, dict(_gather_args(), impl=impl))
    with pytest.raises(ValueError, match=f"impl='{impl}' needs the CUDA kernels"):
        _call(moe_lora_grouped_down, dict(_grouped_args(), impl=impl))


@GPU
@pytest.mark.parametrize("impl", ["simple", "fast"])
def test_cuda_impl_while_computations_go_to_cpu_says_why(impl):
    with jax.default_device(jax.devices("cpu")[0]):
        with pytest.raises(ValueError, match="computations go to 'cpu', not 'gpu'"):
            resolve_impl(impl)


@GPU
@pytest.mark.parametrize("op", ["gather", "grouped"])
def test_cpu_impl_while_computations_go_to_gpu_says_why(op):
    fn, args = ((moe_lora_gather_bgmv, _gather_args()) if op == "gather"
                else (moe_lora_grouped_down, _grouped_args()))
    with pytest.raises(ValueError, match="impl='cpu' runs the C\\+\\+ handlers on the CPU; "
                                         "computations go to 'gpu'"):
        _call(fn, dict(args, impl="cpu"))
