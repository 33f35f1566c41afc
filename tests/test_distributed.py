"""A sharded fold across two ``jax.distributed`` processes (CPU, loopback).

Two subprocesses (2 host CPU devices each, 4 in the mesh) connect through a
coordinator on ``127.0.0.1`` at a free port, fold one random case
expert-parallel and tensor-parallel over the 4 devices, and each checks the
result bit for bit against its own unsharded fold
(``tests/_distributed_worker.py``). Bounded by a timeout; never hangs CI.
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


def test_two_process_sharded_fold():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "_distributed_worker.py"), str(i),
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
