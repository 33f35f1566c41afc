"""Sharded-fold checks, run in a subprocess with 8 host CPU devices.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX
initialises its backends, which the pytest process has already done; so
``test_sharding.py`` runs ``python tests/_sharded_checks.py`` with that
environment and reads one JSON line per check. Each check compares a sharded
fold (or its gradients) with the unsharded fold on one device.

Run by hand: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/_sharded_checks.py [name ...]``.
"""

from __future__ import annotations

import json
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _transform_cases import make_case  # noqa: E402

from jax_moelora import moe_lora_fold  # noqa: E402
from jax_moelora.ops import sharding as sh  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


def _case(seed, dtype=BF16, **kw):
    kw.setdefault("E", 13)  # not a multiple of the device count: padded
    kw.setdefault("N", 32)
    return make_case(np.random.default_rng(seed), dtype=dtype, **kw)


def _equal(got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.array_equal(got, want):
        raise AssertionError(f"{what}: {np.sum(got != want)} of {got.size} outputs differ")


def _close(got, want, what, tol=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
    if not err < tol:
        raise AssertionError(f"{what}: relative error {err:.3g}")


def _fold(c, **kw):
    return moe_lora_fold(c.x, c.base_out, c.topk_ids, c.route, c.row_adapter,
                         x_gather=c.x_gather, **kw)


def _fold_ep(c, mesh, axis, route, **kw):
    f = lambda x, b, i, r, ra: sh.moe_lora_fold_expert_parallel(
        x, b, i, r, ra, mesh=mesh, axis=axis, x_gather=c.x_gather, **kw)
    return jax.jit(f)(c.x, c.base_out, c.topk_ids, route, c.row_adapter)


# ---- checks -----------------------------------------------------------------------------------

def check_expert_parallel_gather():
    mesh = _mesh((8,), ("expert",))
    for seed, x_gather, with_ra in ((0, 1, True), (1, 0, True), (2, 1, False)):
        c = _case(seed, T=16, top_k=4, x_gather=x_gather, with_row_adapter=with_ra)
        route = sh.shard_expert_parallel(c.route, mesh, "expert")
        assert route.n_experts == 16 and route.pool_size % 8 == 0
        _equal(_fold_ep(c, mesh, "expert", route), _fold(c), f"x_gather={x_gather}")
    # uint32 ids (>= 2**31 reads as negative: skipped), as moe_lora_fold accepts them.
    c = c._replace(topk_ids=jax.lax.bitcast_convert_type(c.topk_ids, jnp.uint32))
    _equal(_fold_ep(c, mesh, "expert", route), _fold(c), "uint32 ids")


def check_expert_parallel_grouped():
    mesh = _mesh((8,), ("expert",))
    c = _case(3, T=64, top_k=2, x_gather=0)
    route = sh.shard_expert_parallel(c.route, mesh, "expert")
    _equal(_fold_ep(c, mesh, "expert", route, gather_max_rows=0), _fold(c, gather_max_rows=0),
           "sorted path")


def check_expert_parallel_with_row_axis():
    mesh = _mesh((4, 2), ("expert", "data"))
    c = _case(4, T=16, top_k=2, x_gather=1)
    route = sh.shard_expert_parallel(c.route, mesh, "expert")
    _equal(_fold_ep(c, mesh, "expert", route, row_axis="data"), _fold(c), "expert x data")


def check_tensor_parallel():
    for shape, names, row_axis in (((8,), ("model",), None), ((2, 4), ("data", "model"), "data")):
        mesh = _mesh(shape, names)
        for x_gather, gmr in ((1, 4096), (0, 0)):
            c = _case(5 + x_gather, T=16, top_k=2, x_gather=x_gather)
            route = sh.shard_tensor_parallel(c.route, mesh, "model")
            f = lambda x, b, i, r, ra: sh.moe_lora_fold_tensor_parallel(
                x, b, i, r, ra, mesh=mesh, axis="model", row_axis=row_axis,
                x_gather=x_gather, gather_max_rows=gmr)
            out = jax.jit(f)(c.x, c.base_out, c.topk_ids, route, c.row_adapter)
            assert out.sharding.spec[-1] == "model"
            _equal(out, _fold(c, gather_max_rows=gmr), f"{names} x_gather={x_gather}")


def check_data_parallel():
    mesh = _mesh((8,), ("data",))
    for gmr in (4096, 0):
        c = _case(7, T=32, top_k=2, x_gather=1)
        f = lambda x, b, i, r, ra: sh.moe_lora_fold_data_parallel(
            x, b, i, r, ra, mesh=mesh, axis="data", x_gather=1, gather_max_rows=gmr)
        _equal(jax.jit(f)(c.x, c.base_out, c.topk_ids, c.route, c.row_adapter),
               _fold(c, gather_max_rows=gmr), f"gather_max_rows={gmr}")


def _grads(fold, c, route, w):
    def loss(x, base, a_pool, b_pool, scale):
        r = route.tree_unflatten(None, (a_pool, b_pool, route.a_table, route.b_table, scale))
        return jnp.sum(fold(x, base, r).astype(F32) * w)
    return jax.jit(jax.grad(loss, argnums=range(5)))(
        c.x, c.base_out, route.a_pool, route.b_pool, route.scale_table)


def check_gradients_through_shard_map():
    """f32 gradients of every layout equal the unsharded ones (EP pools are
    compared slot by slot through the re-packing)."""
    c = _case(8, dtype=F32, T=16, top_k=2, x_gather=1)
    w = jnp.asarray(np.random.default_rng(0).normal(size=c.base_out.shape), F32)
    ref = _grads(lambda x, b, r: moe_lora_fold(x, b, c.topk_ids, r, c.row_adapter, x_gather=1),
                 c, c.route, w)
    names = ("x", "base_out", "a_pool", "b_pool", "scale_table")
    # data-parallel and tensor-parallel: same layouts as the unsharded route.
    mesh = _mesh((8,), ("d",))
    for layout, route in (("data", c.route), ("tensor", sh.shard_tensor_parallel(c.route, mesh, "d"))):
        fn = (sh.moe_lora_fold_data_parallel if layout == "data"
              else sh.moe_lora_fold_tensor_parallel)
        got = _grads(lambda x, b, r: fn(x, b, c.topk_ids, r, c.row_adapter, mesh=mesh, axis="d",
                                        x_gather=1), c, route, w)
        for n, g, want in zip(names, got, ref):
            _close(g, want, f"{layout}: d{n}")
    # expert-parallel
    ep = sh.shard_expert_parallel(c.route, mesh, "d")
    got = _grads(lambda x, b, r: sh.moe_lora_fold_expert_parallel(
        x, b, c.topk_ids, r, c.row_adapter, mesh=mesh, axis="d", x_gather=1), c, ep, w)
    for n, g, want in zip(names[:2], got[:2], ref[:2]):
        _close(g, want, f"expert: d{n}")
    E = c.route.n_experts
    _close(got[4][:, :E], ref[4], "expert: dscale_table")
    e_loc, p_loc = ep.n_experts // 8, ep.pool_size // 8
    for k, (gt, lt) in enumerate(((c.route.a_table, ep.a_table), (c.route.b_table, ep.b_table))):
        gt, lt = np.asarray(gt), np.asarray(lt)[:, :E]
        stacked = lt + (np.arange(E) // e_loc)[None, :] * p_loc
        summed = np.zeros_like(np.asarray(ref[2 + k]))
        seen = set()
        for g_slot, s_slot in zip(gt[lt > 0], stacked[lt > 0]):
            if s_slot not in seen:
                seen.add(s_slot)
                summed[g_slot] += np.asarray(got[2 + k][s_slot])
        _close(summed, ref[2 + k], f"expert: d{names[2 + k]}")


def check_expert_matmul_gradients_through_shard_map():
    """``expert_matmul`` (gate/up with LoRA) data-parallel over 8 devices, each
    with its own expert-sorted rows, weights and routes replicated: f32
    gradients w.r.t. x, both weight sets and both routes' pools and scales
    equal the unsharded ones (per-device rows; weights and routes summed over
    the devices)."""
    from jax.sharding import PartitionSpec as P

    from jax_moelora import expert_matmul

    rng = np.random.default_rng(9)
    D, M, K, N, E = 8, 24, 16, 12, 5
    routes = tuple(_case(seed, dtype=F32, K=K, N=N, E=E - 1).route for seed in (9, 10))
    x = jnp.asarray(rng.normal(size=(D, M, K)), F32)
    ws = tuple(jnp.asarray(rng.normal(size=(E, K, N)) / K ** 0.5, F32) for _ in range(2))
    sizes = jnp.asarray([np.bincount(rng.integers(0, E, M - 2), minlength=E) for _ in range(D)],
                        jnp.int32)
    ra = jnp.asarray(rng.integers(-1, routes[0].max_loras + 1, (D, M)), jnp.int32)
    cot = jnp.asarray(rng.normal(size=(D, 2, M, N)), F32)

    pools = tuple((r.a_pool, r.b_pool, r.scale_table) for r in routes)

    def one(x, ws, pools, sizes, ra, cot):  # one device's rows
        lora = tuple(r.tree_unflatten(None, (a, b, r.a_table, r.b_table, s))
                     for r, (a, b, s) in zip(routes, pools))
        out = expert_matmul(x, ws, sizes, lora=lora, row_adapter=ra, stacked=True)
        return jnp.sum(out * cot)

    grad = jax.grad(one, argnums=(0, 1, 2))
    mesh = _mesh((D,), ("d",))

    def sharded_loss(x, ws, pools, sizes, ra, cot):  # the loss of every device's rows
        def local(x, ws, pools, sizes, ra, cot):
            return jax.lax.psum(one(x[0], ws, pools, sizes[0], ra[0], cot[0]), "d")
        return sh.shard_map(local, mesh=mesh, in_specs=(P("d"), P(), P(), P("d"), P("d"), P("d")),
                            out_specs=P())(x, ws, pools, sizes, ra, cot)

    got_x, *got_wp = jax.jit(jax.grad(sharded_loss, argnums=(0, 1, 2)))(x, ws, pools, sizes,
                                                                          ra, cot)
    parts = [jax.jit(grad)(x[d], ws, pools, sizes[d], ra[d], cot[d]) for d in range(D)]
    _close(got_x, jnp.stack([p[0] for p in parts]), "dx")
    summed = jax.tree.map(lambda *g: sum(g), *[(p[1], p[2]) for p in parts])
    names = [f"dw[{i}]" for i in range(2)] + [f"route {i}: d{n}" for i in range(2)
                                              for n in ("a_pool", "b_pool", "scale_table")]
    for name, g, want in zip(names, jax.tree.leaves(got_wp), jax.tree.leaves(summed)):
        _close(g, want, name)


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items()
          if name.startswith("check_")}


def run_checks(checks: dict, names: list[str]) -> int:
    """Run ``checks`` (all, or those named), one JSON line each; 1 if any failed."""
    assert len(jax.devices()) >= 8, f"needs 8 devices, got {jax.devices()}"
    failed = 0
    for name in names or list(checks):
        try:
            checks[name]()
            result = {"check": name, "ok": True}
        except Exception:  # report every check, not only the first failure
            failed += 1
            result = {"check": name, "ok": False, "detail": traceback.format_exc()}
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, sys.argv[1:]))
