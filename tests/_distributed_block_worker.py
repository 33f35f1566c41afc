"""One process of the 2-process sharded ``MoEBlock`` test (CPU, loopback).

Usage: ``python tests/_distributed_block_worker.py PROCESS_ID PORT``, two
processes with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (4
devices in all). Each builds the same block (same keys) and batch, puts the
block on a mesh ``ep=2 x dp=2`` whose expert axis spans the two processes
(``shard_block``: every process passes the same block), runs it, loads one
more adapter into a free slot through ``AdapterPool`` (per-device writes of
the global pools) and runs it again; each result, gathered, must equal the
process' own unsharded block bit for bit. Prints one JSON line, exits 0 on
success.
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
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _block_cases import random_adapter  # noqa: E402
from _sharded_block_cases import forward, host, inputs, make_block  # noqa: E402

from jax_moelora.nnx import AdapterPool, shard_block  # noqa: E402
from jax_moelora.ops.sharding import put_global  # noqa: E402

T = 16


def run(ref, sharded, x, ids) -> bool:
    mesh, spec = sharded.sharding.mesh, sharded.sharding.token_spec
    got = forward(sharded, put_global(x, mesh, spec(2)), put_global(ids, mesh, spec(1)))
    got = multihost_utils.process_allgather(got, tiled=True)
    return bool(np.array_equal(host(got), host(forward(ref, x, ids))))


def main() -> None:
    assert jax.process_count() == 2 and len(jax.devices()) == 4, jax.devices()
    ref = make_block("deepseek-v3", adapters=2)  # on this process' first device
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("ep", "dp"))  # ep across processes
    sharded = shard_block(nnx.clone(ref), mesh, expert_axis="ep", data_axis="dp")
    x, ids = inputs(0, T, 2)
    ok = {"forward": run(ref, sharded, x, ids)}
    adapter = random_adapter(np.random.default_rng(1), ref, "c", 4)
    for block in (ref, sharded):
        AdapterPool([block]).load(adapter, slot=2)
    ids = jnp.asarray(np.where(np.arange(T) % 3 == 0, 2, np.asarray(ids)), jnp.int32)
    ok["after_load"] = run(ref, sharded, x, ids)
    print(json.dumps({"process": process_id, "ok": ok, "devices": len(jax.devices())}),
          flush=True)
    jax.distributed.shutdown()
    sys.exit(0 if all(ok.values()) else 1)


main()
