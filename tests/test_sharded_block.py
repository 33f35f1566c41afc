"""``MoEBlock`` on a mesh of 8 CPU devices (``nnx/sharded.py``).

The contract: expert-parallel (experts, their weights and their adapters'
pool slots split over a mesh axis, rows dispatched to the experts' owners
with an all-to-all), data-parallel and tensor-parallel blocks, and their
pairs, give the unsharded block's outputs (bit for bit without a tensor
axis, within the documented tolerance with one) and its LoRA gradients,
each with its variable's sharding; ``AdapterPool`` changes the sharded
pools in place, device by device, without recompiling the step.

JAX in this process has already fixed its device count, so the checks run
in subprocesses with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(``tests/_sharded_block_checks.py``), one JSON line per check; two of them
at once, each with half of the checks (a family's checks together, so its
unsharded programs compile once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _sharded_block_checks import CHECKS, FAMILIES

HERE = Path(__file__).resolve().parent
WORKERS = 2
TIMEOUT_S = 900


def _share(name: str) -> int:
    """Which subprocess runs check ``name``: by family, else by name."""
    family = next((i for i, f in enumerate(FAMILIES) if name.endswith(f)), None)
    return (family if family is not None else sum(map(ord, name))) % WORKERS


def _env() -> dict:
    path = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path,
                XLA_FLAGS="--xla_force_host_platform_device_count=8")


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    shares = [[n for n in CHECKS if _share(n) == w] for w in range(WORKERS)]
    procs = [subprocess.Popen([sys.executable, str(HERE / "_sharded_block_checks.py"), *names],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=HERE.parent) for names in shares if names]
    found, logs = {}, []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            logs.append(f"rc {p.returncode}:\n{out[-2000:]}\n{err[-3000:]}")
            for line in out.splitlines():
                if line.startswith("{"):
                    r = json.loads(line)
                    found[r["check"]] = r
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if not found:
        pytest.fail("sharded block checks produced no results:\n" + "\n".join(logs))
    return found


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_sharded_block(results, name):
    r = results.get(name)
    assert r is not None, f"check {name} did not report"
    assert r["ok"], r.get("detail")
