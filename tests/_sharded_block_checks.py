"""Sharded ``MoEBlock`` checks, run in a subprocess with 8 host CPU devices.

``test_sharded_block.py`` runs ``python tests/_sharded_block_checks.py`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and reads one JSON
line per check. Every check compares the block on a mesh with the same block
on one device:

- forward, expert-parallel (``ep``), data-parallel (``dp``),
  tensor-parallel (``tp``) and their pairs, blocks with 1 and with 4
  adapters installed: bit for bit without a tensor axis; with one, within
  ``TP_TOL`` of the largest output (bf16: partial sums over ``I`` rounded
  on each device); rows of the base model bit for bit those of a batch
  with no adapter. By default every family with ``ep`` and with ``dp`` or
  ``tp``, and a few pairs (``FORWARD``); ``JAX_MOELORA_FULL_MATRIX=1``
  runs every layout with every family (forward and gradients);
- the prefill path (rows sorted by expert, grouped folds, ``ragged_dot``);
- gradients of the LoRA pools (f32), compared slot by slot through the
  sharded layout, within ``GRAD_TOL``, each with its variable's sharding;
- the dispatch: exact under any routing by default, the documented drop
  rule with a capacity factor, ``ragged_all_to_all`` (lowered, and run with
  an emulation of its documented semantics, which XLA:CPU does not run);
- ``AdapterPool`` load, replace, evict and unload on the mesh: per-device
  writes with no collective, the step compiled once;
- a block built on the mesh (``MoEBlock(mesh=...)``, also inside ``nnx.jit``)
  and the argument checks.

By hand: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/_sharded_block_checks.py [name ...]``.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _block_cases import random_adapter  # noqa: E402
from _sharded_checks import run_checks  # noqa: E402
from _sharded_block_cases import (  # noqa: E402
    E, FAMILIES, H, forward, host, inputs, lora_grad, make_block)

from jax_moelora.nnx import AdapterPool, MoEBlock, shard_block  # noqa: E402
from jax_moelora.nnx.block import weighted_sum  # noqa: E402
from jax_moelora.ops import sharding as ops_sharding  # noqa: E402

F32 = jnp.float32
T = 32
#: bf16 outputs with a tensor axis, by the largest |output|: 4 bf16 ulps at the top
TP_TOL = 2.0 ** -5
#: f32 gradients, relative error by norm (summation order only)
GRAD_TOL = 1e-5

#: layout -> (mesh shape, axis names, shard_block's axes)
LAYOUTS = {
    "ep": ((8,), ("ep",), dict(expert_axis="ep")),
    "dp": ((8,), ("dp",), dict(data_axis="dp")),
    "tp": ((8,), ("tp",), dict(tensor_axis="tp")),
    "ep_dp": ((4, 2), ("ep", "dp"), dict(expert_axis="ep", data_axis="dp")),
    "ep_tp": ((4, 2), ("ep", "tp"), dict(expert_axis="ep", tensor_axis="tp")),
    "dp_tp": ((2, 4), ("dp", "tp"), dict(data_axis="dp", tensor_axis="tp")),
}


def _mesh(layout: str) -> Mesh:
    shape, names, _ = LAYOUTS[layout]
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


def _sharded(block: MoEBlock, layout: str, **kw) -> MoEBlock:
    return shard_block(nnx.clone(block), _mesh(layout), **LAYOUTS[layout][2], **kw)


def _equal(got, want, what: str) -> None:
    got, want = host(got), host(want)
    if not np.array_equal(got, want):
        raise AssertionError(f"{what}: {np.sum(got != want)} of {got.size} outputs differ, "
                             f"max {np.max(np.abs(got - want)):.3g}")


def _close(got, want, what: str, tol: float) -> None:
    got, want = host(got), host(want)
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
    if not err <= tol:
        raise AssertionError(f"{what}: error {err:.3g} of the largest output > {tol:.3g}")


# ---- forward ------------------------------------------------------------------------------

def _forward_check(family: str, layout: str, **block_kw) -> None:
    exact = "tp" not in layout
    for adapters in (1, 4):
        ref = make_block(family, adapters=adapters, **block_kw)
        sharded = _sharded(ref, layout)
        x, ids = inputs(adapters, T, adapters)
        got, want = forward(sharded, x, ids), forward(ref, x, ids)
        tokens = jax.sharding.NamedSharding(sharded.sharding.mesh, sharded.sharding.token_spec(2))
        if not got.sharding.is_equivalent_to(tokens, 2):
            raise AssertionError(f"output sharded as {got.sharding.spec}")
        what = f"{family} {layout} {adapters} adapter(s)"
        (_equal if exact else functools.partial(_close, tol=TP_TOL))(got, want, what)
        # rows of the base model: the bits of a batch without any adapter
        base = np.asarray(ids) < 0
        _equal(host(got)[base], host(forward(sharded, x, jnp.full_like(ids, -1)))[base],
               f"{what}: base rows")


#: the forward checks that run by default (every family with the expert axis,
#: and with the data or the tensor axis); ``JAX_MOELORA_FULL_MATRIX=1``: all
FORWARD = [("ep", f) for f in FAMILIES] + [
    ("dp", "qwen3"), ("dp", "mixtral"), ("dp", "deepseek-v3"),
    ("tp", "gpt-oss"), ("tp", "deepseek-v2"), ("tp", "qwen3"),
    ("ep_dp", "mixtral"), ("ep_dp", "deepseek-v3"),
    ("ep_tp", "gpt-oss"), ("dp_tp", "deepseek-v2")]
GRADS = [("ep", "qwen3"), ("ep", "gpt-oss"), ("ep", "deepseek-v3"), ("dp", "mixtral"),
         ("tp", "deepseek-v2"), ("ep_dp", "qwen3")]


def _matrix(default: list) -> list:
    if os.environ.get("JAX_MOELORA_FULL_MATRIX") == "1":
        return [(layout, f) for layout in LAYOUTS for f in FAMILIES]
    return default


def _register_forward() -> dict:
    checks = {f"forward_{layout}_{family}": functools.partial(_forward_check, family, layout)
              for layout, family in _matrix(FORWARD)}
    # rows sorted by expert, grouped folds, ragged_dot (gpt-oss: biases by sorted row)
    checks["prefill_ep_dp_gpt-oss"] = functools.partial(_forward_check, "gpt-oss", "ep_dp",
                                                        gather_max_rows=0)
    return checks


# ---- gradients ----------------------------------------------------------------------------

def _relaid(ref: MoEBlock, grads: nnx.State, shards: int) -> dict:
    """The unsharded block's gradients in the sharded pool layout."""
    clone = nnx.clone(ref)
    nnx.update(clone, grads)
    clone.lora.set_expert_shards(shards)
    return dict(nnx.to_flat_state(nnx.state(clone, nnx.LoRAParam)))


def _grad_check(family: str, layout: str) -> None:
    ref = make_block(family, dtype=F32)
    sharded = _sharded(ref, layout)
    x, ids = inputs(7, T, 4, dtype=F32)
    w = jnp.asarray(np.random.default_rng(3).standard_normal((T, H)), F32)
    want = _relaid(ref, lora_grad(ref, x, ids, w), sharded.sharding.expert_shards)
    got = dict(nnx.to_flat_state(lora_grad(sharded, x, ids, w)))
    state = dict(nnx.to_flat_state(nnx.state(sharded, nnx.LoRAParam)))
    assert set(got) == set(want) == set(state), (sorted(got), sorted(want))
    for path, g in got.items():
        name = "/".join(map(str, path))
        g, ref_g, var = g[...], host(want[path][...]), state[path][...]
        if not g.sharding.is_equivalent_to(var.sharding, g.ndim):
            raise AssertionError(f"{name}: gradient sharded {g.sharding}, the variable "
                                 f"{var.sharding}")
        err = np.linalg.norm(host(g) - ref_g) / max(np.linalg.norm(ref_g), 1e-30)
        if not err <= GRAD_TOL:
            raise AssertionError(f"{family} {layout} d{name}: relative error {err:.3g}")
        if not np.any(ref_g):
            raise AssertionError(f"{name}: zero gradient, nothing checked")


def _register_grads() -> dict:
    return {f"grad_{layout}_{family}": functools.partial(_grad_check, family, layout)
            for layout, family in _matrix(GRADS)}


# ---- dispatch -----------------------------------------------------------------------------

@nnx.jit
def _routing(block: MoEBlock, x, ids):
    routes = block.lora.routes()
    return block.route(x, ids, routes, block.impl)


@nnx.jit
def _forward_with_weights(block: MoEBlock, x, ids, weights, topk_ids):
    """The unsharded block with the given routing weights (zero: a dropped row)."""
    routes = block.lora.routes()
    d = block.routed_rows(x, topk_ids, ids, routes, block.impl)
    y = weighted_sum(weights, d).astype(block.dtype)
    return y if block.shared_experts is None else y + block.shared(x, ids, routes, block.impl)


def _dropped_rows(topk_ids: np.ndarray, shards: int, devices: int, cap: int) -> np.ndarray:
    """The drop rule of ops/dispatch.py: per token shard, a row whose rank
    among the shard's rows bound for its destination is >= cap."""
    t, k = topk_ids.shape
    rows = topk_ids.reshape(shards, -1) // (E // devices)
    kept = np.zeros_like(rows, bool)
    for s in range(shards):
        seen = np.zeros(devices, int)
        for r, d in enumerate(rows[s]):
            kept[s, r] = seen[d] < cap
            seen[d] += 1
    return kept.reshape(t, k)


def check_capacity_drop_rule():
    """capacity_factor=1 over 8 expert devices: one row per destination and
    source; the rows past it are dropped, and the result equals the
    unsharded block with their weights zeroed, bit for bit."""
    ref = make_block("deepseek-v3")
    x, ids = inputs(5, T, 4)
    weights, topk_ids = _routing(ref, x, ids)
    for layout, shards, devices in (("ep", 8, 8), ("ep_dp", 8, 4)):
        sharded = _sharded(ref, layout, capacity_factor=1.0)
        n = T // shards * 2
        kept = _dropped_rows(np.asarray(topk_ids), shards, devices, -(-n // devices))
        assert 0 < kept.sum() < kept.size, kept.sum()
        want = _forward_with_weights(ref, x, ids, weights * jnp.asarray(kept, F32), topk_ids)
        _equal(forward(sharded, x, ids), want, f"{layout} capacity_factor=1")


def check_dispatch_chunks():
    """dispatch_chunks=2 (pieces dispatched independently): bit for bit the
    unsharded block, exact and with the drop rule applied per piece."""
    ref = make_block("qwen3")
    x, ids = inputs(4, T, 4)
    _equal(forward(_sharded(ref, "ep_dp", dispatch_chunks=2), x, ids), forward(ref, x, ids),
           "dispatch_chunks=2")
    weights, topk_ids = _routing(ref, x, ids)
    halves = np.asarray(topk_ids).reshape(16, -1)  # 8 token shards x 2 pieces
    kept = _dropped_rows(halves.reshape(-1, 2), 16, 4, -(-(T // 16 * 2) // 4))
    want = _forward_with_weights(ref, x, ids, weights * jnp.asarray(kept.reshape(T, 2), F32),
                                 topk_ids)
    assert 0 < kept.sum() < kept.size
    _equal(forward(_sharded(ref, "ep_dp", dispatch_chunks=2, capacity_factor=1.0), x, ids),
           want, "dispatch_chunks=2, capacity_factor=1")


def check_exact_under_skewed_routing():
    """Every token routed to experts 0 and 1 (one device): the default
    capacity sends every row, bit for bit the unsharded block."""
    ref = make_block("qwen3", adapters=4)
    ref.router.kernel.value = jnp.zeros_like(ref.router.kernel[...])  # ties -> experts 0, 1
    ref.lora.router.clear_slot(0)
    for slot in range(1, 4):
        ref.lora.router.clear_slot(slot)
    x, ids = inputs(6, T, 4)
    assert set(np.asarray(_routing(ref, x, ids)[1]).ravel()) == {0, 1}
    _equal(forward(_sharded(ref, "ep"), x, ids), forward(ref, x, ids), "skewed, exact")


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name, axis_index_groups=None):
    """``jax.lax.ragged_all_to_all`` as its docstring defines it, from
    ``all_gather`` (XLA:CPU does not run the collective itself)."""
    assert axis_index_groups is None
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)              # [D, M, ...]
    starts = jax.lax.all_gather(input_offsets, axis_name)[:, me]
    sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    lands = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    rows = jnp.arange(output.shape[0])
    result = output
    for src in range(ops.shape[0]):
        inside = (rows >= lands[src]) & (rows < lands[src] + sizes[src])
        taken = jnp.take(ops[src], jnp.clip(rows - lands[src] + starts[src], 0,
                                             operand.shape[0] - 1), axis=0)
        mask = inside.reshape((-1,) + (1,) * (output.ndim - 1))
        result = jnp.where(mask, taken, result)
    del recv_sizes  # what the sender sends decides; the receiver's sizes must agree
    return result


def check_ragged_all_to_all():
    """exchange="ragged_all_to_all": the lowered program holds the
    collective; run with an emulation of its documented semantics, the
    block gives the all_to_all bits (exact, and with a capacity factor)."""
    ref = make_block("gpt-oss")
    x, ids = inputs(8, T, 4)
    ragged = _sharded(ref, "ep_dp", exchange="ragged_all_to_all")
    text = jax.jit(lambda s, x, i: nnx.merge(nnx.graphdef(ragged), s)(x, i)).lower(
        nnx.state(ragged), x, ids).as_text()
    if "ragged_all_to_all" not in text:
        raise AssertionError("the lowered block has no ragged_all_to_all")
    real = jax.lax.ragged_all_to_all
    jax.lax.ragged_all_to_all = _emulated_ragged_all_to_all
    try:
        for cf in (None, 1.0):
            ragged = _sharded(ref, "ep_dp", exchange="ragged_all_to_all", capacity_factor=cf)
            dense = _sharded(ref, "ep_dp", capacity_factor=cf)
            _equal(forward(ragged, x, ids), forward(dense, x, ids), f"capacity_factor={cf}")
    finally:
        jax.lax.ragged_all_to_all = real


# ---- adapter pool -------------------------------------------------------------------------

_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute",
                "reduce-scatter")


def _no_collective_writes(block: MoEBlock) -> int:
    """Lower and compile the pool writer for every LoRA pool of ``block``;
    raise if one holds a collective. Returns the pools checked."""
    checked = 0
    for path, var in nnx.to_flat_state(nnx.state(block, nnx.LoRAParam)):
        array = var[...]
        lead = (0,) if array.ndim == 4 else ()
        module = block.lora
        for p in path[1:-1]:
            module = getattr(module, p)
        slots = module.slots_per_shard
        shape = list(array.shape)
        shape[len(lead)] = module.n_experts  # one adapter's rows
        if lead:
            shape[0] = 1
        block_arr = np.zeros(shape, array.dtype)
        sh = array.sharding
        fn = ops_sharding._shard_blocks_on_mesh(sh, len(lead), slots)
        blk = ops_sharding.put_global(block_arr, sh.mesh, sh.spec)
        hlo = fn.lower(array, blk, tuple(np.int32(i) for i in lead), np.int32(1)).compile()
        text = hlo.as_text()
        bad = [c for c in _COLLECTIVES if c in text]
        if bad:
            raise AssertionError(f"the writer of {'/'.join(map(str, path))} holds {bad}")
        checked += 1
    return checked


def check_adapter_pool_on_mesh():
    """load, use, evict (LRU), replace and unload on EP x DP: every output
    bit for bit the unsharded block's after the same changes, the pools keep
    their sharding, the jitted step compiles once, the writers hold no
    collective."""
    family = "deepseek-v2"
    ref = make_block(family, adapters=0)
    sharded = _sharded(ref, "ep_dp")
    rng = np.random.default_rng(0)
    adapters = {n: random_adapter(rng, ref, n, 4) for n in "abcd"}
    pools = (AdapterPool([ref]), AdapterPool([sharded]))
    specs = {p: v[...].sharding for p, v in nnx.to_flat_state(nnx.state(sharded))}
    graphdef = nnx.graphdef(sharded)
    step = jax.jit(lambda state, x, ids: nnx.merge(graphdef, state)(x, ids))
    x = inputs(9, T, 1)[0]
    ops = [("load", "a"), ("load", "b"), ("load", "c"), ("load", "d"), ("evict", "a"),
           ("replace", "b"), ("unload", "c")]
    for op, name in ops:
        for pool in pools:
            if op == "load":
                pool.load(adapters[name])
            elif op == "evict":  # every slot taken: the least recently used goes
                pool.ids(["b", "c", "d"])
                pool.load(adapters[name], name="a2", evict=True)
            elif op == "replace":
                pool.replace("b", adapters["a"], name="b2")
            else:
                pool.unload(name)
        names = list(pools[1].names)
        ids = jnp.asarray(pools[1].ids([names[i % len(names)] if i % 3 else None
                                        for i in range(T)]))
        _equal(step(nnx.state(sharded), x, ids), forward(ref, x, ids), f"after {op} {name}")
        for path, var in nnx.to_flat_state(nnx.state(sharded)):
            if not var[...].sharding.is_equivalent_to(specs[path], var[...].ndim):
                raise AssertionError(f"{op}: {path} now sharded {var[...].sharding}")
    if pools[0].names != pools[1].names:
        raise AssertionError(f"pools differ: {pools[0].names} vs {pools[1].names}")
    if step._cache_size() != 1:
        raise AssertionError(f"the step compiled {step._cache_size()} times")
    assert _no_collective_writes(sharded) == 10  # router, gate_up, down, shared: A and B


# ---- building on a mesh, argument checks --------------------------------------------------

def check_build_on_mesh():
    """MoEBlock(mesh=...) eagerly and inside nnx.jit: every variable placed
    with its spec, the same outputs as the unsharded block from the same
    keys."""
    mesh = _mesh("ep_tp")
    kw = dict(mesh=mesh, expert_axis="ep", tensor_axis="tp")
    ref = make_block("mixtral", dtype=F32)
    eager = make_block("mixtral", dtype=F32, **kw)
    built = nnx.jit(lambda: make_block("mixtral", dtype=F32, adapters=0, **kw))()
    for slot in range(4):  # host-side writes into the sharded pools, as make_block's
        built.lora.init_adapter(slot, rngs=nnx.Rngs(10 + slot), rank=4, alpha=8.0)
    x, ids = inputs(2, T, 4, dtype=F32)
    want = forward(ref, x, ids)
    for what, block in (("eager", eager), ("jit", built)):
        for path, var in nnx.to_flat_state(nnx.state(block)):
            spec = block.sharding.spec(tuple(map(str, path)), var[...].ndim)
            want_sharding = jax.sharding.NamedSharding(mesh, spec)
            if not var[...].sharding.is_equivalent_to(want_sharding, var[...].ndim):
                raise AssertionError(f"{what}: {path} sharded {var[...].sharding}, want {spec}")
        _close(forward(block, x, ids), want, what, 1e-5)
    ep = eager.experts.gate_proj[...]
    if ep.addressable_shards[0].data.shape != (E // 4, H, 16 // 2):
        raise AssertionError(f"local gate_proj shard {ep.addressable_shards[0].data.shape}")


def _raises(fn, *words) -> None:
    try:
        fn()
    except (ValueError, TypeError) as e:
        if not all(w in str(e) for w in words):
            raise AssertionError(f"message {e!r} lacks {words}") from e
        return
    raise AssertionError(f"no error for {words}")


def check_argument_errors():
    mesh = _mesh("ep_dp")
    block = make_block("qwen3", adapters=1)
    _raises(lambda: shard_block(nnx.clone(block), mesh, expert_axis="x"), "'x'", "mesh")
    _raises(lambda: shard_block(nnx.clone(block), mesh, expert_axis="ep", data_axis="ep"),
            "distinct")
    _raises(lambda: shard_block(nnx.clone(block), mesh, expert_axis="ep",
                                capacity_factor=0), "capacity_factor")
    _raises(lambda: shard_block(nnx.clone(block), mesh, expert_axis="ep", exchange="nccl"),
            "exchange")
    _raises(lambda: make_block("qwen3", expert_axis="ep"), "mesh")
    mesh3 = Mesh(np.array(jax.devices()[:3]), ("ep",))
    _raises(lambda: shard_block(nnx.clone(block), mesh3, expert_axis="ep"), "num_experts",
            "expert_axis")
    _raises(lambda: shard_block(nnx.clone(block), mesh3, tensor_axis="ep"),
            "intermediate_size", "tensor_axis")
    sharded = shard_block(nnx.clone(block), mesh, expert_axis="ep", data_axis="dp")
    x, ids = inputs(0, 12, 1)
    _raises(lambda: forward(sharded, x, ids), "12 tokens", "token axes")
    _raises(lambda: shard_block(nnx.clone(block), mesh, expert_axis="ep", dispatch_chunks=0),
            "dispatch_chunks")
    chunked = shard_block(nnx.clone(block), mesh, expert_axis="ep", dispatch_chunks=3)
    x, ids = inputs(0, 16, 1)
    _raises(lambda: forward(chunked, x, ids), "dispatch_chunks=3")


CHECKS = {**_register_forward(), **_register_grads(),
          **{name[len("check_"):]: fn for name, fn in globals().items()
             if name.startswith("check_")}}


if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, sys.argv[1:]))
