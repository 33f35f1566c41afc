"""``bench --gemm``: the floor accounting and a tiny end-to-end run (no timed
assertions)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jax_moelora.tools import bench_gemm as bg
from jax_moelora.__main__ import main
from jax_moelora.tools.bench_cases import parse_model

TINY = "tiny:8:2:32:16"


def test_floor_counts_active_experts_and_both_weight_sets():
    c = bg.GemmCase(parse_model(TINY), "gate_up", tokens=4, rank=8, adapters=2)
    inputs = bg.make_gemm_inputs(c)
    sizes = np.asarray(inputs["group_sizes"])
    assert sizes.sum() == c.rows == 8 and inputs["active_experts"] == int((sizes > 0).sum())
    f = bg.gemm_floor(c, inputs, lora=False, bandwidth=1e9, matmul_rate=1e12)
    M, K, N, act = 8, 32, 16, inputs["active_experts"]
    assert f["bytes"] == 2 * (M * K + 2 * (act * K * N + M * N))
    assert f["flops"] == 2 * 2 * M * K * N
    assert f["floor"] == max(f["bytes"] / 1e9, f["flops"] / 1e12)
    fl = bg.gemm_floor(c, inputs, lora=True, bandwidth=1e9, matmul_rate=1e12)
    assert fl["bytes"] == f["bytes"] + 2 * 2 * inputs["active_cells"] * 8 * (K + N)


def test_bench_gemm_tiny_run(tmp_path):
    rc = main(["bench", "--gemm", "--models", TINY, "--projs", "gate_up", "--tokens", "8",
               "--reps", "2", "--runs", "1", "--warmup", "1", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "gemm.json").read_text())
    rows = data["rows"]
    assert [r["method"] for r in rows] == list(bg.GEMM_METHODS)
    for r in rows:
        assert r["error"] is None and r["time_us"] > 0 and r["floor_us"] > 0
        if r["method"] != "ragged_dot":
            assert r["check"] == "ok", r
    assert data["meta"]["bandwidth"] > 0 and data["meta"]["matmul_flops"] > 0
    assert "| tiny | gate_up | 8 | gemm |" in (tmp_path / "gemm.md").read_text()


def test_bench_gemm_places_of_the_fold(tmp_path):
    """``gemm_lora_in`` and ``gemm_lora_after`` (the fold inside the GEMM or
    after it) and ``gemm_lora_packed`` (inside, reading packs made once) run
    only when named, fold like ``gemm_lora`` and are checked against its
    reference (off the GPU all run the same fold)."""
    methods = ["gemm_lora_in", "gemm_lora_after", "gemm_lora_packed"]
    rc = main(["bench", "--gemm", "--models", TINY, "--projs", "down", "--tokens", "8",
               "--reps", "2", "--runs", "1", "--warmup", "1",
               "--methods", ",".join(methods), "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "gemm.json").read_text())["rows"]
    assert [r["method"] for r in rows] == methods
    for r in rows:
        assert r["error"] is None and r["check"] == "ok" and r["adapters"] > 0, r


def test_bench_gemm_times_but_does_not_check_past_the_reference_limit(tmp_path, monkeypatch):
    # --ragged-max-gib 0: ragged_dot is skipped; a reference limit of 0: so is
    # the check (its jnp reference lowers through ragged_dot); the GEMM rows are
    # still timed and written
    monkeypatch.setattr(bg, "reference_max_bytes", lambda ragged_max_bytes: 0)
    rc = main(["bench", "--gemm", "--models", TINY, "--projs", "down", "--tokens", "8",
               "--reps", "2", "--runs", "1", "--warmup", "1", "--ragged-max-gib", "0",
               "--out", str(tmp_path)])
    assert rc == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "gemm.json").read_text())["rows"]}
    assert rows["ragged_dot"]["skipped"] and rows["ragged_dot"]["time_us"] is None
    for method in ("gemm", "gemm_lora"):
        assert rows[method]["time_us"] > 0
        assert rows[method]["check"] == "not checked (reference too large)"


def test_reference_limit_is_at_least_the_ragged_dot_limit():
    assert bg.reference_max_bytes(3 << 30) >= 3 << 30


def test_a_failed_reference_leaves_the_row_timed(tmp_path, monkeypatch):
    # the jnp reference can fail where the estimate said it fits (XLA's
    # autotuner out of memory at T = 16384): the GEMM rows are still timed
    real = bg._method_fn

    def method_fn(method, c, impl):
        if impl == "jnp":
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        return real(method, c, impl)

    monkeypatch.setattr(bg, "_method_fn", method_fn)
    rc = main(["bench", "--gemm", "--models", TINY, "--projs", "gate_up", "--tokens", "8",
               "--reps", "2", "--runs", "1", "--warmup", "1", "--methods", "gemm,gemm_lora",
               "--out", str(tmp_path)])
    assert rc == 0
    for r in json.loads((tmp_path / "gemm.json").read_text())["rows"]:
        assert r["error"] is None and r["time_us"] > 0
        assert r["check"] == "not checked (reference failed)"


def test_methods_name_a_schedule():
    assert bg.parse_method("gemm") == ("gemm", "auto")
    assert bg.parse_method("gemm_lora@pingpong") == ("gemm_lora", "pingpong")
    assert bg.parse_method("gemm@cooperative") == ("gemm", "cooperative")
    assert bg.parse_method("gemm_lora_in@pingpong") == ("gemm_lora_in", "pingpong")
    assert bg.parse_method("gemm_lora_after") == ("gemm_lora_after", "auto")
    for bad in ("ragged_dot@pingpong", "gemm@warp", "einsum", "gemm_lora_inside"):
        with pytest.raises(ValueError, match="unknown method"):
            bg.parse_method(bad)


def test_bench_gemm_refuses_an_unknown_method(tmp_path, capsys):
    rc = main(["bench", "--gemm", "--models", TINY, "--tokens", "8", "--methods", "gemm@warp",
               "--out", str(tmp_path)])
    assert rc == 2 and "unknown method" in capsys.readouterr().out
    assert not (tmp_path / "gemm.json").exists()


def test_bench_gemm_times_each_schedule(tmp_path):
    # off the GPU the schedule changes nothing but the row's method name
    methods = ["gemm@cooperative", "gemm_lora@pingpong"]
    rc = main(["bench", "--gemm", "--models", TINY, "--projs", "down", "--tokens", "8",
               "--reps", "2", "--runs", "1", "--warmup", "1", "--methods", ",".join(methods),
               "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "gemm.json").read_text())["rows"]
    assert [r["method"] for r in rows] == methods
    assert all(r["check"] == "ok" and r["time_us"] > 0 for r in rows)
    assert rows[1]["adapters"] == 4 and rows[0]["adapters"] == 0


def test_bench_gemm_trace_reports_the_kernels_of_each_method(tmp_path, one_profiler):
    """``--trace``: one more run of each timed method under the profiler, a
    folder each; on a GPU every row gets its kernel time per call and its
    kernels by name, on the CPU no GPU kernel is traced and the rows say so
    by leaving both empty."""
    import jax

    trace = tmp_path / "trace"
    rc = main(["bench", "--gemm", "--models", TINY, "--projs", "gate_up", "--tokens", "8",
               "--reps", "2", "--runs", "1", "--warmup", "1", "--methods", "gemm,gemm_lora",
               "--no-check", "--trace", str(trace), "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "gemm.json").read_text())["rows"]
    assert len(rows) == 2 and len([d for d in trace.iterdir() if d.is_dir()]) == 2
    assert all(any(d.rglob("*.trace.json.gz")) for d in trace.iterdir())
    for r in rows:
        if jax.default_backend() == "gpu":
            assert 0 < r["kernel_us"] <= 2 * r["time_us"] and r["kernels"], r
        else:
            assert r["kernel_us"] is None and r["kernels"] is None
