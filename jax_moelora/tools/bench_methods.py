"""The folds the benchmark times (docs/semantics.md §7), the timing protocol, the copy
bandwidth and the correctness check.

Methods: the library backends ``fast``, ``simple``, ``cpu`` and ``jnp``
(``moe_lora_gather_bgmv`` for decode cases and the router,
``moe_lora_grouped_down`` for prefill ones), and two pure-JAX baselines
(float32 products at full precision for the router's float32 pools):

- ``ragged_dot``: rows grouped by (expert, adapter) pair, expert-major
  (``g = e * L + l``), then ``jax.lax.ragged_dot`` ``x @ A^T`` and
  ``xa @ B^T`` against pair-major stacked weights ``[E * L, K, R]`` /
  ``[E * L, R, N]``, scale, add, unsort. The stacked weights are that
  baseline's own layout (what a user with stacked LoRA weights holds), built
  from the route once outside the timed region. Decode sorts the rows by
  pair; prefill rows are sorted by expert (and by adapter within each expert
  by ``bench_cases``, which the baseline does not assume), so they are only
  sorted by pair when ``L > 1``.
- ``einsum``: a gather of each row's A and B block from the pool (through the
  tables) and two ``einsum``; rows are processed in chunks whose gathered
  blocks stay under ``EINSUM_CHUNK_BYTES`` (the approach of ``impl="jnp"``,
  with larger chunks).

Every method has the signature ``fold(base_out, args) -> base_out`` and the
docs/semantics.md §5 roundings and skip rules.

Any method name with the suffix ``@cold`` (``fast@cold``) times the same fold
with a cold L2: the program rotates through copies of the route (pools and
tables, ``COLD_BYTES`` in all, several times the L2), one copy per fold, as
the expert weights of the other layers flush the L2 between folds in a real
step. ``x`` and ``base_out`` stay as they are (in a step they come straight
from the kernel that wrote them).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_moelora import _ext
from jax_moelora.tools.bench_cases import Case, CaseInputs
from jax_moelora.ops import moe_lora_gather_bgmv, moe_lora_grouped_down
from jax_moelora.ops.jnp_fold import grouped_rows, resolve_pairs

__all__ = ["LIBRARY_METHODS", "CUSTOM_CALL_METHODS", "BASELINES", "ALL_METHODS",
           "default_methods", "make_fold",
           "prepare_args", "make_loop", "time_loop", "time_fold", "measure_bandwidth",
           "compare", "check_fold", "reference",
           "TOLERANCE", "ragged_dense_bytes", "skip_reason", "use_pallas_ragged_dot"]

LIBRARY_METHODS = ("fast", "simple", "cpu", "jnp")
CUSTOM_CALL_METHODS = ("fast", "simple", "cpu")
BASELINES = ("ragged_dot", "einsum")
ALL_METHODS = LIBRARY_METHODS + BASELINES

# Relative error by norm of the delta (docs/semantics.md §6, "any backend").
TOLERANCE = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3,
             jnp.dtype(jnp.float32): 1e-5}

EINSUM_CHUNK_BYTES = {"gpu": 1 << 30, "cpu": 64 << 20}

COLD = "@cold"
COLD_BYTES = 256 << 20   # route copies a cold-L2 program rotates through (H200 L2: 50 MB)
COLD_MAX_COPIES = 32


def base_method(method: str) -> str:
    """``method`` without its ``@cold`` suffix."""
    return method[:-len(COLD)] if method.endswith(COLD) else method


def is_method(method: str) -> bool:
    """A known method, with or without ``@cold``."""
    return base_method(method) in ALL_METHODS

Fold = Callable[[jax.Array, dict[str, Any]], jax.Array]


def default_methods() -> tuple[str, ...]:
    """``fast``, ``simple`` and the baselines on a GPU with the CUDA kernels;
    ``cpu``, ``jnp`` and the baselines on the CPU; else ``jnp`` and the baselines."""
    if _ext.cuda_available():
        return ("fast", "simple") + BASELINES
    if _ext.current_platform() == "cpu":
        return ("cpu", "jnp") + BASELINES
    return ("jnp",) + BASELINES


# --------------------------------------------------------------------- library

def _library_fold(case: Case, impl: str) -> Fold:
    top_k, xg = case.top_k, case.x_gather
    if case.gather:
        def fold(out, a):
            return moe_lora_gather_bgmv(a["x"], out, a["indices"], a["route"], a["row_adapter"],
                                        top_k=top_k, x_gather=xg, impl=impl)
    else:
        def fold(out, a):
            return moe_lora_grouped_down(a["x"], out, a["expert_offsets"], a["sorted_token_ids"],
                                         a["route"], a["row_adapter"], x_gather=xg, impl=impl)
    return fold


# ------------------------------------------------------------------ baselines

def _row_keys(case: Case, a: dict[str, Any]):
    """Per (sorted, for prefill) row: ``(token, expert, adapter)``."""
    rows = case.n_rows
    r = jnp.arange(rows, dtype=jnp.int32)
    if case.gather:
        tok = r // case.top_k
        expert = a["indices"]
    else:
        tok = a["sorted_token_ids"]
        expert = grouped_rows(a["expert_offsets"], tok, None, x_rows=1, row_offset=0,
                              row_end=rows, x_gather=0)[0]
    ra = a["row_adapter"]
    tok_ok = (tok >= 0) & (tok < ra.shape[0])
    adapter = jnp.where(tok_ok, ra[jnp.clip(tok, 0, ra.shape[0] - 1)], -1)
    return tok, expert, adapter


def _x_rows(case: Case, x, tok, rows=None):
    """Each row's input (``rows`` selects and orders them)."""
    if case.x_gather:
        return x[tok if rows is None else tok[rows]]
    return x if rows is None else x[rows]


def _finish(base, delta, s, ok):
    dt = base.dtype
    folded = (base.astype(jnp.float32) + s[:, None] * delta.astype(jnp.float32)).astype(dt)
    return jnp.where(ok[:, None], folded, base)


def _precision(dt):
    """Full float32 products for float32 pools (the router's fold; XLA may
    otherwise take TF32 on the GPU), the default for 16-bit ones."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dt) == jnp.float32 else None


def _pair_weights(route) -> dict[str, jax.Array]:
    """Pair-major weights ``g = e * L + l`` of the ragged_dot baseline."""
    a_slot, b_slot = route.a_table.T.reshape(-1), route.b_table.T.reshape(-1)   # [E * L]
    P = route.pool_size
    ok = (a_slot > 0) & (b_slot > 0) & (a_slot < P) & (b_slot < P)
    a_slot, b_slot = jnp.where(ok, a_slot, 0), jnp.where(ok, b_slot, 0)
    return {"a": jnp.swapaxes(route.a_pool[a_slot], 1, 2),      # [G, K, R]
            "b": jnp.swapaxes(route.b_pool[b_slot], 1, 2),      # [G, R, N]
            "scale": route.scale_table.T.reshape(-1),
            "ok": ok}


def _ragged_fold(case: Case) -> Fold:
    def fold(out, a):
        pw, route = a["pairs"], a["route"]
        E, L = route.n_experts, route.max_loras
        G = E * L
        tok, expert, adapter = _row_keys(case, a)
        l = jnp.zeros_like(adapter) if L == 1 else adapter
        valid = (adapter >= 0) & (l < L) & (expert >= 0) & (expert < E)
        g = jnp.clip(expert, 0, E - 1) * L + jnp.clip(l, 0, L - 1)
        presorted = not case.gather and L == 1
        if presorted:
            # rows outside every expert span lie before or after them: keep
            # the group ids non-decreasing (their results are masked anyway)
            r = jnp.arange(g.shape[0], dtype=jnp.int32)
            g = jnp.where(expert >= 0, g, jnp.where(r < a["expert_offsets"][0], 0, G - 1))
        order = None if presorted else jnp.argsort(g, stable=True)
        gs = jnp.bincount(g, length=G).astype(jnp.int32)
        xs = _x_rows(case, a["x"], tok, order).astype(pw["a"].dtype)
        dt = out.dtype
        kw = dict(preferred_element_type=jnp.float32, precision=_precision(dt))
        xa = jax.lax.ragged_dot(xs, pw["a"], gs, **kw).astype(dt)
        delta = jax.lax.ragged_dot(xa, pw["b"], gs, **kw).astype(dt)
        if order is not None:
            delta = jnp.zeros_like(delta).at[order].set(delta, unique_indices=True)
        ok = valid & pw["ok"][g]
        return _finish(out, delta, pw["scale"][g], ok)
    return fold


def _einsum_fold(case: Case, chunk_bytes: int) -> Fold:
    def fold(out, a):
        route = a["route"]
        tok, expert, adapter = _row_keys(case, a)
        a_slot, b_slot, s, ok = resolve_pairs(route, adapter, expert)
        xr = _x_rows(case, a["x"], tok)
        dt = out.dtype
        per_row = route.max_rank * (route.k_in + route.n_out) * jnp.dtype(dt).itemsize
        chunk = max(1, chunk_bytes // per_row)

        kw = dict(preferred_element_type=jnp.float32, precision=_precision(dt))

        def rows(xc, a_c, b_c):
            xa = jnp.einsum("rk,rjk->rj", xc.astype(dt), route.a_pool[a_c], **kw).astype(dt)
            return jnp.einsum("rj,rnj->rn", xa, route.b_pool[b_c], **kw).astype(dt)

        n = out.shape[0]
        if n <= chunk:
            delta = rows(xr, a_slot, b_slot)
        else:
            steps = -(-n // chunk)
            pad = steps * chunk - n
            split = [jnp.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1)).reshape(
                (steps, chunk) + v.shape[1:]) for v in (xr, a_slot, b_slot)]
            delta = jax.lax.map(lambda c: rows(*c), split).reshape(steps * chunk, -1)[:n]
        return _finish(out, delta, s, ok)
    return fold


def ragged_dense_bytes(case: Case) -> int:
    """Bytes of the zero-padded ``[G, m, K]`` operands and ``[G, m, N]``
    results (f32) XLA's default ragged_dot lowering builds on GPU and CPU,
    for the larger of the baseline's two ragged_dots."""
    G = case.table_experts * case.adapters
    return 4 * G * case.n_rows * (max(case.k_in, case.n_out) + case.rank)


def use_pallas_ragged_dot() -> bool:
    """Switch ``jax.lax.ragged_dot`` on GPU to JAX's Pallas Triton grouped
    matmul (a real grouped GEMM instead of a dense expansion); False when
    this JAX has no such lowering."""
    try:
        import jax._src.lax.pallas_lowerings.gpu.ragged_dot  # noqa: F401
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
    except (ImportError, AttributeError, KeyError):
        return False
    return True


def skip_reason(method: str, case: Case, *, ragged_max_bytes: float) -> str | None:
    """Why ``method`` is not run on ``case`` (None: it is)."""
    if base_method(method) == "ragged_dot" and ragged_max_bytes > 0:
        need = ragged_dense_bytes(case)
        if need > ragged_max_bytes:
            return (f"dense ragged_dot lowering needs ~{need / 2**30:.1f} GiB "
                    f"(limit {ragged_max_bytes / 2**30:.2f} GiB)")
    return None


def make_fold(method: str, case: Case) -> Fold:
    """``fold(base_out, args) -> base_out`` of ``method`` for ``case``."""
    method = base_method(method)
    if method in LIBRARY_METHODS:
        return _library_fold(case, method)
    if method == "ragged_dot":
        return _ragged_fold(case)
    if method == "einsum":
        platform = "gpu" if _ext.current_platform() == "gpu" else "cpu"
        return _einsum_fold(case, EINSUM_CHUNK_BYTES[platform])
    raise ValueError(f"unknown method {method!r}; known: {', '.join(ALL_METHODS)}")


def prepare_args(method: str, inputs: CaseInputs) -> Any:
    """The args ``method`` folds with: the case's, plus (for ``ragged_dot``)
    its pair-major weights, built here, outside any timed region; for a
    ``@cold`` method a tuple of such args, each with its own copy of the route
    (and of the pair-major weights)."""
    args = inputs.args
    if base_method(method) == "ragged_dot":
        pairs = jax.jit(_pair_weights)(inputs.args["route"])
        args = {**inputs.args, "pairs": jax.block_until_ready(pairs)}
    if not method.endswith(COLD):
        return args
    heavy = {k: v for k, v in args.items() if k in ("route", "pairs")}
    nbytes = sum(v.nbytes for v in jax.tree_util.tree_leaves(heavy))
    copies = int(min(COLD_MAX_COPIES, max(2, -(-COLD_BYTES // max(1, nbytes)))))
    return tuple({**args, **jax.tree_util.tree_map(jnp.copy, heavy)} for _ in range(copies))


# ------------------------------------------------------------------- timing

def make_loop(fold: Fold, reps: int, unroll: int = 1, cold: bool = False):
    """One jitted program ``loop(base_out, args)`` running ``fold`` ``reps``
    times back to back.

    ``base_out`` is carried (and donated); each iteration passes the inputs
    through an optimization barrier together with the carry, so no part of
    the fold is loop-invariant: XLA can neither hoist nor CSE it. ``cold``:
    ``args`` is a tuple of copies (``prepare_args``) and fold ``i`` reads copy
    ``i % len(args)`` (an unrolled program, so each fold reads its copy in
    place).
    """
    def run_cold(out, copies):
        for i in range(reps):
            out, args_i = jax.lax.optimization_barrier((out, copies[i % len(copies)]))
            out = fold(out, args_i)
        return out

    if cold:
        return jax.jit(run_cold, donate_argnums=0)

    def run(out, args):
        def body(_, out):
            out, args_i = jax.lax.optimization_barrier((out, args))
            return fold(out, args_i)

        return jax.lax.fori_loop(0, reps, body, out, unroll=max(1, min(unroll, reps)))

    return jax.jit(run, donate_argnums=0)


def time_loop(loop, base_out: jax.Array, args: Any, *, reps: int, runs: int, warmup: int = 2,
              first: Callable[[Any], None] | None = None) -> float:
    """Seconds per fold of ``loop`` (``make_loop``): the median of ``runs``
    timed runs after ``warmup`` untimed ones, divided by ``reps``.

    ``base_out`` (an array or a pytree of arrays) is copied first (the loop
    donates its carry) and each run continues from the last one's output;
    ``first`` is called with the output of the first run (``reps`` folds of
    ``base_out``).
    """
    out = jax.block_until_ready(loop(jax.tree_util.tree_map(jnp.copy, base_out), args))
    if first is not None:
        first(out)
    for _ in range(max(1, warmup) - 1):
        out = jax.block_until_ready(loop(out, args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = jax.block_until_ready(loop(out, args))
        times.append(time.perf_counter() - t0)
    del out
    return statistics.median(times) / reps


def time_fold(fold: Fold, base_out: jax.Array, args: dict[str, Any], *, reps: int, runs: int,
              warmup: int = 2, unroll: int = 1) -> float:
    """Seconds per fold of ``fold`` (``make_loop`` then ``time_loop``)."""
    return time_loop(make_loop(fold, reps, unroll), base_out, args, reps=reps, runs=runs,
                     warmup=warmup)


def measure_bandwidth(nbytes: int, *, reps: int, runs: int, warmup: int = 2) -> float:
    """Copy bandwidth in bytes/s (read + write) of a ``nbytes`` device buffer,
    timed like the folds: each iteration reads and writes the whole buffer."""
    n = max(1, nbytes // 4)

    def body(_, buf):
        return jax.lax.optimization_barrier(buf) + jnp.uint32(1)

    loop = jax.jit(lambda b, _args: jax.lax.fori_loop(0, reps, body, b), donate_argnums=0)
    per_iter = time_loop(loop, jnp.zeros((n,), jnp.uint32), None, reps=reps, runs=runs,
                         warmup=warmup)
    return 2 * n * 4 / per_iter


# -------------------------------------------------------------------- check

@jax.jit
def _compare(out, ref, base):
    d = out.astype(jnp.float32) - base.astype(jnp.float32)
    dr = ref.astype(jnp.float32) - base.astype(jnp.float32)
    err = jnp.linalg.norm(d - dr) / jnp.maximum(jnp.linalg.norm(dr), 1e-30)
    untouched = jnp.all(ref == base, axis=1)
    kept = jnp.all(jnp.where(untouched[:, None], out == base, True))
    return err, jnp.all(jnp.isfinite(out.astype(jnp.float32))), kept


def compare(out: jax.Array, ref: jax.Array, base: jax.Array) -> dict:
    """Compare ``out`` with the reference ``ref``, both folded from ``base``.

    Returns ``{"ok", "err", "finite", "kept"}``: ``err`` is the relative
    error of the delta ``out - base`` by norm; ``ok`` needs it within docs/semantics.md
    §6's tolerance for the dtype, a finite output, and every row the
    reference left alone bit-identical (``kept``).
    """
    err, finite, kept = (np.asarray(v) for v in _compare(out, ref, base))
    tol = TOLERANCE[jnp.dtype(base.dtype)]
    err = float(err)
    return {"ok": bool(finite and kept and err <= tol), "err": err, "finite": bool(finite),
            "kept": bool(kept)}


def check_fold(fold: Fold, inputs: CaseInputs, args: dict[str, Any], ref: jax.Array) -> dict:
    """Fold ``inputs`` once with ``fold`` and ``compare`` with ``ref``."""
    return compare(jax.jit(fold)(inputs.base_out, args), ref, inputs.base_out)


def reference(inputs: CaseInputs) -> jax.Array:
    """One ``jnp`` fold of the case's inputs."""
    fold = _library_fold(inputs.case, "jnp")
    return jax.block_until_ready(jax.jit(fold)(inputs.base_out, inputs.args))
