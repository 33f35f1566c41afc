"""Multi-device scaling of the sharded folds: correctness and weak scaling.

``python -m jax_moelora.tools.scaling [--json PATH] [--small]`` on a machine with at
least 2 devices (e.g. 2 H200s; ``impl="auto"``: the CUDA custom calls on a
GPU). For each case it

1. checks the 2-device sharded fold against the single-device fold of the
   same global inputs (forward: bit-identical; training gradients: relative
   error), and
2. times, docs/semantics.md §7 style (the fold run ``--reps`` times back to back inside one
   jitted program, median of ``--runs`` runs after warm-up), the 2-device
   program on 2x the total work against the single-device program on 1x, so
   the per-device work is fixed. ``ratio = (2x work / t2) / (1x work / t1)``:
   2.0 is perfect scaling; ``efficiency = ratio / 2``.

Cases (Qwen3-30B-A3B shapes: 128 experts, top_k 8, hidden 2048, inter 768;
rank 16; 4 adapters spread over the tokens):

- ``dp_decode``: data-parallel gate fold, 64 tokens per device (gather);
- ``dp_prefill``: data-parallel gate fold, 4096 tokens per device (sorted,
  grouped);
- ``ep_prefill``: expert-parallel down fold: 2x experts and 2x tokens over 2
  devices (tokens replicated, each device folds the rows of its experts, one
  psum);
- ``tp_prefill``: tensor-parallel down fold, 2x ``n_out`` over 2 devices;
- ``dp_train``: one SGD step of the pools through the fold's custom VJP,
  data-parallel (gradients summed over devices), 2048 tokens per device.

With ``--small`` the shapes shrink so that it also runs on CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=2``).

``--block``: the whole ``MoEBlock`` with its experts split over 1, 2, 4, ...
devices instead (weak and strong scaling of decode and prefill steps, the
collectives' bytes per step against the model of ``docs/scaling.md``):
``tools/block_scaling.py``, which takes the other options.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_moelora import _ext
from jax_moelora.ops import sharding as sh
from jax_moelora.ops.folds import moe_lora_fold
from jax_moelora.tables import MoeExpertRoute

__all__ = ["main", "run_cases"]

DT = jnp.bfloat16


def _shapes(small: bool) -> dict:
    if small:
        return dict(E=8, top_k=2, hidden=64, inter=32, rank=8, L=2, decode=8, prefill=256,
                    train=128)
    return dict(E=128, top_k=8, hidden=2048, inter=768, rank=16, L=4, decode=64, prefill=4096,
                train=2048)


def _route(key, E: int, L: int, K: int, N: int, R: int) -> MoeExpertRoute:
    """Every adapter adapts every expert: slot 1 + l * E + e."""
    ka, kb, ks = jax.random.split(key, 3)
    P_ = 1 + L * E
    slots = 1 + np.arange(L * E, dtype=np.int32).reshape(L, E)
    return MoeExpertRoute(
        a_pool=(jax.random.normal(ka, (P_, R, K), jnp.float32) / np.sqrt(K)).astype(DT),
        b_pool=(jax.random.normal(kb, (P_, N, R), jnp.float32) / np.sqrt(R)).astype(DT),
        a_table=slots, b_table=slots,
        scale_table=jax.random.uniform(ks, (L, E), jnp.float32, 0.5, 2.0))


def _inputs(key, T: int, top_k: int, E: int, L: int, K: int, N: int, x_gather: int):
    kx, kb, ki = jax.random.split(key, 3)
    x = jax.random.normal(kx, (T if x_gather else T * top_k, K), jnp.float32).astype(DT)
    base = jax.random.normal(kb, (T * top_k, N), jnp.float32).astype(DT)
    ids = jax.random.randint(ki, (T, top_k), 0, E, jnp.int32)
    ra = jnp.arange(T, dtype=jnp.int32) % L
    return x, base, ids, ra


def _repeat(fold: Callable, reps: int) -> Callable:
    """One jitted program folding ``reps`` times back to back (carrying base_out)."""
    def run(x, base, ids, route, ra):
        return jax.lax.fori_loop(0, reps, lambda i, b: fold(x, b, ids, route, ra), base)
    return jax.jit(run)


def median_seconds(fn: Callable, args, runs: int, warmup: int) -> float:
    """Median wall seconds of ``fn(*args)`` over ``runs`` calls, after
    ``warmup`` untimed ones."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time(fn: Callable, args, runs: int, reps: int) -> float:
    """Median seconds per fold."""
    return median_seconds(fn, args, runs, warmup=3) / reps


def _place(tree, mesh: Mesh, spec_tree):
    return jax.tree_util.tree_map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)),
                                  tree, spec_tree, is_leaf=lambda v: v is None)


def _compare(got, want) -> dict:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return {"bit_identical": bool(np.array_equal(got, want)),
            "max_abs_diff": float(np.max(np.abs(got - want)))}


def _fold_case(name, s, mesh, dev0, runs, reps, *, layout, T1, x_gather, K, N, E1):
    """Time one fold layout: 1 device on (T1, E1, N) vs 2 devices on 2x."""
    key = jax.random.PRNGKey(zlib.crc32(name.encode()))
    L, R, top_k = s["L"], s["rank"], s["top_k"]
    # The 2-device problem: 2x tokens (dp, ep), 2x experts (ep) or 2x n_out (tp).
    T2 = T1 if layout == "tp" else 2 * T1
    E2 = 2 * E1 if layout == "ep" else E1
    N2 = 2 * N if layout == "tp" else N
    k1, k2, k3, k4 = jax.random.split(key, 4)
    with jax.default_device(dev0):
        route1 = _route(k1, E1, L, K, N, R)
        in1 = _inputs(k2, T1, top_k, E1, L, K, N, x_gather)
        route2 = _route(k3, E2, L, K, N2, R)
        in2 = _inputs(k4, T2, top_k, E2, L, K, N2, x_gather)
    axis = "dev"
    kw = dict(mesh=mesh, axis=axis, x_gather=x_gather)
    if layout == "dp":
        sharded = lambda x, b, i, r, ra: sh.moe_lora_fold_data_parallel(x, b, i, r, ra, **kw)
        r2 = _place(route2, mesh, jax.tree_util.tree_map(lambda _: P(), route2))
        args2 = _place(in2, mesh, (P(axis), P(axis), P(axis), P(axis)))
    elif layout == "ep":
        sharded = lambda x, b, i, r, ra: sh.moe_lora_fold_expert_parallel(x, b, i, r, ra, **kw)
        r2 = sh.shard_expert_parallel(route2, mesh, axis)
        args2 = _place(in2, mesh, (P(), P(), P(), P()))
    else:
        sharded = lambda x, b, i, r, ra: sh.moe_lora_fold_tensor_parallel(x, b, i, r, ra, **kw)
        r2 = sh.shard_tensor_parallel(route2, mesh, axis)
        args2 = _place(in2, mesh, (P(), P(None, axis), P(), P()))
    single = lambda x, b, i, r, ra: moe_lora_fold(x, b, i, r, ra, x_gather=x_gather)
    x2, b2, i2, ra2 = args2
    # Correctness: the 2-device fold == the 1-device fold of the same 2x inputs.
    got = jax.jit(sharded)(x2, b2, i2, r2, ra2)
    with jax.default_device(dev0):
        want = jax.jit(single)(*in2[:3], route2, in2[3])
    check = _compare(got, want)
    # Weak scaling: 1 device on 1x work vs 2 devices on 2x work.
    with jax.default_device(dev0):
        t1 = _time(_repeat(single, reps), (*in1[:3], route1, in1[3]), runs, reps)
    t2 = _time(_repeat(sharded, reps), (x2, b2, i2, r2, ra2), runs, reps)
    rows1, rows2 = T1 * top_k, T2 * top_k
    work = {"dp": (rows1, rows2), "ep": (rows1, rows2), "tp": (rows1 * N, rows2 * N2)}[layout]
    ratio = (work[1] / t2) / (work[0] / t1)
    return {"case": name, "layout": layout, "x_gather": x_gather, "tokens_1dev": T1,
            "tokens_2dev": T2, "experts_1dev": E1, "experts_2dev": E2, "k_in": K,
            "n_out_1dev": N, "n_out_2dev": N2, "t1_us": t1 * 1e6, "t2_us": t2 * 1e6,
            "throughput_ratio": ratio, "efficiency": ratio / 2, **check}


def _train_case(s, mesh, dev0, runs, reps):
    """Data-parallel SGD on the pools through the fold's custom VJP."""
    L, R, top_k, E, K, N = s["L"], s["rank"], s["top_k"], s["E"], s["hidden"], s["inter"]
    T1 = s["train"]
    axis = "dev"
    key = jax.random.PRNGKey(7)
    k1, k2, k3 = jax.random.split(key, 3)
    with jax.default_device(dev0):
        route = _route(k1, E, L, K, N, R)
        in1 = _inputs(k2, T1, top_k, E, L, K, N, 1)
        in2 = _inputs(k3, 2 * T1, top_k, E, L, K, N, 1)

    def step_fn(fold):
        def loss(pools, x, base, ids, ra, tables):
            r = MoeExpertRoute.tree_unflatten(None, (*pools, *tables))
            out = fold(x, base, ids, r, ra)
            return jnp.mean(out.astype(jnp.float32) ** 2)

        def train(x, base, ids, pools, ra, tables):
            def body(i, p):
                g = jax.grad(loss)(p, x, base, ids, ra, tables)
                return jax.tree_util.tree_map(lambda v, d: v - (1e-3 * d).astype(v.dtype), p, g)
            return jax.lax.fori_loop(0, reps, body, pools)
        return jax.jit(train), jax.jit(jax.grad(loss))

    single = lambda x, b, i, r, ra: moe_lora_fold(x, b, i, r, ra, x_gather=1)
    dp = lambda x, b, i, r, ra: sh.moe_lora_fold_data_parallel(x, b, i, r, ra, mesh=mesh,
                                                               axis=axis, x_gather=1)
    pools = (route.a_pool, route.b_pool)
    train1, grad1 = step_fn(single)
    train2, grad2 = step_fn(dp)
    tables = (route.a_table, route.b_table, route.scale_table)
    pools2, tables2 = _place((pools, tables), mesh, ((P(), P()), (P(), P(), P())))
    args2 = _place(in2, mesh, (P(axis), P(axis), P(axis), P(axis)))
    g2 = grad2(pools2, *args2, tables2)
    with jax.default_device(dev0):
        g1 = grad1(pools, *in2, tables)
    errs = [float(np.linalg.norm(np.asarray(a, np.float32) - np.asarray(b, np.float32))
                  / max(np.linalg.norm(np.asarray(b, np.float32)), 1e-30))
            for a, b in zip(g2, g1)]
    with jax.default_device(dev0):
        t1 = _time(train1, (*in1[:3], pools, in1[3], tables), runs, reps)
    t2 = _time(train2, (*args2[:3], pools2, args2[3], tables2), runs, reps)
    ratio = 2 * t1 / t2
    return {"case": "dp_train", "layout": "dp", "x_gather": 1, "tokens_1dev": T1,
            "tokens_2dev": 2 * T1, "experts_1dev": E, "experts_2dev": E, "k_in": K,
            "n_out_1dev": N, "n_out_2dev": N, "t1_us": t1 * 1e6, "t2_us": t2 * 1e6,
            "throughput_ratio": ratio, "efficiency": ratio / 2,
            "grad_rel_err_a_pool": errs[0], "grad_rel_err_b_pool": errs[1]}


def run_cases(small: bool = False, runs: int = 20, reps: int = 32,
              only: list[str] | None = None) -> list[dict]:
    """Run every case (or those named in ``only``); returns the result rows."""
    devices = jax.devices()
    if len(devices) < 2:
        raise SystemExit(f"needs at least 2 devices, found {devices}")
    mesh = Mesh(np.array(devices[:2]), ("dev",))
    dev0 = devices[0]
    s = _shapes(small)
    E, H, I = s["E"], s["hidden"], s["inter"]
    cases = {
        "dp_decode": dict(layout="dp", T1=s["decode"], x_gather=1, K=H, N=I, E1=E),
        "dp_prefill": dict(layout="dp", T1=s["prefill"], x_gather=1, K=H, N=I, E1=E),
        "ep_prefill": dict(layout="ep", T1=s["prefill"], x_gather=0, K=I, N=H, E1=E),
        "tp_prefill": dict(layout="tp", T1=s["prefill"], x_gather=0, K=I, N=H, E1=E),
    }
    rows = []
    for name, kw in cases.items():
        if only and name not in only:
            continue
        rows.append(_fold_case(name, s, mesh, dev0, runs, reps, **kw))
        _print_row(rows[-1])
    if not only or "dp_train" in only:
        rows.append(_train_case(s, mesh, dev0, runs, reps))
        _print_row(rows[-1])
    return rows


def _print_row(r: dict) -> None:
    ok = (f"bit_identical={r['bit_identical']}" if "bit_identical" in r else
          f"grad_rel_err a={r['grad_rel_err_a_pool']:.2e} b={r['grad_rel_err_b_pool']:.2e}")
    print(f"{r['case']:<11} 1 dev {r['t1_us']:9.1f} us   2 dev (2x work) {r['t2_us']:9.1f} us   "
          f"throughput x{r['throughput_ratio']:.2f} (efficiency {r['efficiency']:.0%})   {ok}",
          flush=True)


def report(env: dict, rows: list[dict], correct: bool, path: str | None) -> int:
    """Print whether every row is correct, write ``{env, rows, correct}`` to
    ``path`` (JSON) when given; the exit status."""
    print(f"correct: {correct}")
    if path:
        with open(path, "w") as f:
            json.dump({"env": env, "rows": rows, "correct": correct}, f, indent=2)
    return 0 if correct else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--block" in argv:
        from jax_moelora.tools import block_scaling

        return block_scaling.main([a for a in argv if a != "--block"])
    parser = argparse.ArgumentParser(prog="python -m jax_moelora.tools.scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows (and the environment) here")
    parser.add_argument("--small", action="store_true", help="small shapes (CPU smoke run)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--reps", type=int, default=32)
    parser.add_argument("--only", nargs="*", help="case names")
    args = parser.parse_args(argv)
    env = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()[:2]],
           "device_kind": jax.devices()[0].device_kind, "platform": jax.default_backend(),
           "impl": "fast" if _ext.cuda_available() else
           ("cpu" if _ext.current_platform() == "cpu" else "jnp"),
           "runs": args.runs, "reps": args.reps, "small": args.small}
    print(json.dumps(env), flush=True)
    rows = run_cases(args.small, args.runs, args.reps, args.only)
    correct = all(r.get("bit_identical", True) for r in rows) and all(
        r.get(k, 0.0) < 2e-2 for r in rows for k in ("grad_rel_err_a_pool", "grad_rel_err_b_pool"))
    return report(env, rows, correct, args.json)


if __name__ == "__main__":
    sys.exit(main())
