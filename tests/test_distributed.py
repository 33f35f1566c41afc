"""Sharded programs across two ``jax.distributed`` processes (CPU, loopback).

Two subprocesses (2 host CPU devices each, 4 in the mesh) connect through a
coordinator on ``127.0.0.1`` at a free port and run the same program, each
checking the result bit for bit against its own unsharded run:

- a fold, expert-parallel and tensor-parallel over the 4 devices
  (``tests/_distributed_worker.py``);
- an ``MoEBlock`` on a mesh ``ep=2 x dp=2`` whose expert axis spans the
  processes, before and after an ``AdapterPool`` load
  (``tests/_distributed_block_worker.py``).

The workers import this checkout (``PYTHONPATH``). Bounded by a timeout;
never hangs CI.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two(worker: str) -> None:
    """Run ``worker`` as process 0 and 1; assert both report success on 4 devices."""
    path = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path,
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / worker), str(i),
                               str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=HERE.parent)
             for i in range(2)]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (rc, out, err) in enumerate(outputs):
        lines = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
        assert rc == 0 and lines, f"process {i} failed (rc {rc}):\n{out[-2000:]}\n{err[-4000:]}"
        assert lines[-1]["devices"] == 4
        assert all(lines[-1]["ok"].values()), lines[-1]


def test_two_process_sharded_fold():
    _run_two("_distributed_worker.py")


def test_two_process_sharded_block():
    _run_two("_distributed_block_worker.py")
