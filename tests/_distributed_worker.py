"""One process of the 2-process ``jax.distributed`` test (CPU, loopback).

Usage: ``python tests/_distributed_worker.py PROCESS_ID PORT``, two processes
with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (4 devices in
all). Each builds the same random case, folds it expert-parallel and
tensor-parallel over a mesh spanning both processes, and checks the result
against its own unsharded fold; prints one JSON line and exits 0 on success.
"""

from __future__ import annotations

import json
import sys

import jax

process_id, port = int(sys.argv[1]), int(sys.argv[2])
jax.config.update("jax_platforms", "cpu")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=process_id, initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _transform_cases import make_case  # noqa: E402

from jax_moelora import moe_lora_fold  # noqa: E402
from jax_moelora.ops import sharding as sh  # noqa: E402


def replicated(v, mesh):
    v = np.asarray(v)
    return jax.make_array_from_callback(v.shape, NamedSharding(mesh, P()), lambda i: v[i])


def main() -> None:
    assert jax.process_count() == 2 and len(jax.devices()) == 4, jax.devices()
    c = make_case(np.random.default_rng(0), T=16, top_k=2, x_gather=1, E=6, N=16,
                  dtype=jnp.bfloat16)
    with jax.default_device(jax.local_devices()[0]):
        want = np.asarray(moe_lora_fold(c.x, c.base_out, c.topk_ids, c.route, c.row_adapter,
                                        x_gather=1), np.float32)
    mesh = Mesh(np.array(jax.devices()), ("shard",))
    args = [replicated(v, mesh) for v in (c.x, c.base_out, c.topk_ids, c.row_adapter)]
    x, base, ids, ra = args
    ep_route = sh.shard_expert_parallel(c.route, mesh, "shard")
    ep = jax.jit(lambda *a: sh.moe_lora_fold_expert_parallel(
        *a, mesh=mesh, axis="shard", x_gather=1))(x, base, ids, ep_route, ra)
    tp_route = sh.shard_tensor_parallel(c.route, mesh, "shard")
    tp = jax.jit(lambda *a: sh.moe_lora_fold_tensor_parallel(
        *a, mesh=mesh, axis="shard", x_gather=1))(x, base, ids, tp_route, ra)
    results = {
        "expert_parallel": np.asarray(ep.addressable_data(0), np.float32),
        "tensor_parallel": np.asarray(multihost_utils.process_allgather(tp, tiled=True),
                                      np.float32),
    }
    ok = {k: bool(np.array_equal(v, want)) for k, v in results.items()}
    print(json.dumps({"process": process_id, "ok": ok, "devices": len(jax.devices())}),
          flush=True)
    jax.distributed.shutdown()
    sys.exit(0 if all(ok.values()) else 1)


main()
