"""Sharded folds with ``jax.shard_map`` on 8 CPU devices (``ops/sharding.py``).

The contract: expert-parallel (experts, their table columns and pool slots
split over a mesh axis), tensor-parallel (``n_out`` split: ``b_pool`` and
``base_out`` columns) and data-parallel (tokens split) folds are bit-identical
to the unsharded fold, also combined with a token axis, and their gradients
equal the unsharded ones.

JAX in this process has already fixed its device count, so the checks run in
one subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(``tests/_sharded_checks.py``), one JSON line per check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _sharded_checks import CHECKS

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    path = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)  # the subprocess imports this checkout
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path,
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, str(HERE / "_sharded_checks.py")], env=env,
                          capture_output=True, text=True, timeout=600, cwd=HERE.parent)
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            found[r["check"]] = r
    if not found:
        pytest.fail(f"sharded checks produced no results (rc {proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return found


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_sharded_fold(results, name):
    r = results.get(name)
    assert r is not None, f"check {name} did not report"
    assert r["ok"], r.get("detail")
