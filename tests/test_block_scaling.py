"""The block scaling benchmark and its cost model (``tools/block_scaling.py``).

- the model's bytes: an all-to-all moves whole blocks (``(D - 1) * C`` rows
  over links, three exchanges), a ragged one only the rows; a capacity
  factor shrinks the blocks; pieces (``dispatch_chunks``) overlap;
- the HLO parser counts each collective's result bytes once;
- a smoke run of ``scaling --block --small`` on 2 CPU devices (a
  subprocess): the sharded steps give the one-device bits, and the
  all-to-all bytes of the compiled program are the model's (twice them:
  XLA:CPU runs bf16 collectives in f32).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jax_moelora.tools.block_scaling import (SHAPES, dispatch_bytes, hlo_collective_bytes,
                                             model_table, step_time)

HERE = Path(__file__).resolve().parent
QWEN = SHAPES["qwen3-30b-a3b"]


def test_dispatch_bytes():
    row = 2 * QWEN.hidden * 2 + 8
    n = 64 * QWEN.top_k
    exact = dispatch_bytes(QWEN, 8, 64)
    assert exact == {"buffer": 8 * n * row, "wire": 7 * n * row, "collectives": 3}
    cf = dispatch_bytes(QWEN, 8, 64, capacity_factor=2.0)
    assert cf["wire"] == 7 * (2 * n // 8) * row
    ragged = dispatch_bytes(QWEN, 8, 64, exchange="ragged_all_to_all")
    assert ragged["wire"] == n * 7 / 8 * row + 64 and ragged["collectives"] == 4
    assert dispatch_bytes(QWEN, 1, 64)["wire"] == 0


def test_step_time_terms():
    one, two = step_time(QWEN, 1, 4096), step_time(QWEN, 2, 4096)
    assert one["comm"] == 0 and two["comm"] > 0
    piped = step_time(QWEN, 2, 4096, capacity_factor=1.25, dispatch_chunks=4)
    assert piped["total"] < piped["compute"] + piped["comm"]
    assert piped["total"] >= max(piped["compute"], piped["comm"])
    # off-node traffic over InfiniBand is slower than NVLink for the same bytes
    t8, t64 = (step_time(QWEN, d, 64, capacity_factor=2.0) for d in (8, 64))
    assert t64["comm"] / t64["wire"] > t8["comm"] / t8["wire"]
    rows = model_table()
    assert {r["gpus"] for r in rows} == {8, 64, 256}
    assert all(r["gpus"] <= SHAPES[r["model"]].E for r in rows)


def test_hlo_collective_bytes():
    text = """
  %all-to-all = (f32[16,64]{1,0}, f32[16,64]{1,0}) all-to-all(%a, %b), channel_id=1
  %gte = f32[16,64]{1,0} get-tuple-element(%all-to-all), index=1
  %all-reduce.1 = bf16[8,32]{1,0} all-reduce(%c), to_apply=%add
  %ars = bf16[8,32]{1,0} all-reduce-start(%d), to_apply=%add
  %ard = bf16[8,32]{1,0} all-reduce-done(%ars)
"""
    assert hlo_collective_bytes(text) == {"all-to-all": 2 * 16 * 64 * 4,
                                          "all-reduce": 2 * 8 * 32 * 2}


def test_block_scaling_smoke_on_two_cpu_devices(tmp_path):
    path = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path,
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = tmp_path / "block.json"
    proc = subprocess.run([sys.executable, "-m", "jax_moelora.tools.scaling", "--block",
                           "--small", "--runs", "1", "--reps", "1", "--variants", "exact",
                           "--phases", "decode", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600,
                          cwd=HERE.parent)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    rows = json.loads(out.read_text())["rows"]
    sharded = [r for r in rows if r["devices"] == 2]
    assert {(r["kind"], r["phase"]) for r in sharded} == {("weak", "decode"),
                                                           ("strong", "decode")}
    for r in sharded:
        assert r["bit_identical"], r
        assert r["bytes_ratio"] == pytest.approx(2.0, rel=0.05), r  # f32 on the CPU
