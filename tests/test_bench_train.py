"""``bench --train``: the floor accounting, the inputs' row order, the timed
gradient against an independent formulation, and a tiny end-to-end run (no
timed assertions)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moelora.tools import bench_train as bt
from jax_moelora.__main__ import main
from jax_moelora.tools.bench_cases import parse_model

TINY = "tiny:8:2:32:16"


@pytest.fixture(scope="module")
def f32_inputs() -> bt.TrainInputs:
    return bt.make_train_inputs(bt.TrainCase(parse_model(TINY), 6, 8, 2), dtype=jnp.float32)


# ------------------------------------------------------------------ floors

def test_train_cost_hand_checked():
    c = bt.TrainCase(parse_model(TINY), tokens=4, rank=8, adapters=2)
    M, T, H, I, R, A, C, P = 8, 4, 32, 16, 8, 5, 7, 17
    base = bt.train_cost(c, "base_fwd", A, C)
    assert base == {"bytes": 2.0 * (T * H + 3 * A * H * I + 2 * M * I + M * H),
                    "flops": 6.0 * M * H * I}
    fwd = bt.train_cost(c, "fwd", A, C)
    assert fwd["flops"] == base["flops"] + 6.0 * M * R * (H + I)
    assert fwd["bytes"] == base["bytes"] + 2 * 3 * C * R * (H + I)
    bwd = bt.train_cost(c, "fwd_bwd", A, C)
    assert bwd["flops"] == (fwd["flops"] + 2 * M * H * I + 4 * M * R * (H + I)
                            + 4 * M * R * (2 * I + H))
    assert bwd["bytes"] == (fwd["bytes"] + 3 * 4 * 16  # f32 scale gradients [L, E] x 3
                            + 2 * (8 * M * I + M * H + A * I * H + M * I + T * H
                                   + 3 * C * R * (H + I) + 3 * P * R * (H + I)))
    dx = bt.train_cost(c, "fwd_bwd_dx", A, C)
    assert dx["flops"] == bwd["flops"] + 4 * M * H * I + 4 * M * R * H
    assert dx["bytes"] == bwd["bytes"] + 2 * (2 * A * H * I + T * H)
    # the block's rows take the expert MLP's floors
    assert bt.train_cost(c, "block_fwd", A, C) == fwd
    assert bt.train_cost(c, "block_fwd_bwd", A, C) == bwd


# ------------------------------------------------------------------ inputs and gradient

def test_rows_sorted_by_expert_then_adapter(f32_inputs):
    d, c = f32_inputs.data, f32_inputs.case
    sizes = np.asarray(d["group_sizes"])
    assert sizes.sum() == c.rows and f32_inputs.active_experts == int((sizes > 0).sum())
    expert = np.repeat(np.arange(sizes.size), sizes)
    adapter = np.asarray(d["row_adapter"])[np.asarray(d["sorted_token_ids"])]
    key = expert * c.adapters + adapter
    assert np.all(np.diff(key) >= 0)
    for leaf in jax.tree_util.tree_leaves((f32_inputs.pools, d)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert np.all(np.asarray(leaf) != 0), "inputs are drawn at random, never zero"


def _dense_loss(pools, x, d, c: bt.TrainCase):
    """The expert MLP row by row from its definition (f32, no rounding):
    gate, up with their LoRA deltas, silu(g) * u, down with its delta."""
    sizes = np.asarray(d["group_sizes"])
    e = jnp.asarray(np.repeat(np.arange(sizes.size), sizes))
    tok = d["sorted_token_ids"]
    slot = 1 + d["row_adapter"][tok] * c.model.n_experts + e
    adapter = d["row_adapter"][tok]

    def proj(v, w, name):
        a, b, s = pools[name]
        delta = jnp.einsum("mr,mnr->mn", jnp.einsum("mk,mrk->mr", v, a[slot]), b[slot])
        return jnp.einsum("mk,mkn->mn", v, w[e]) + s[adapter, e][:, None] * delta

    xs = x[tok]
    h = jax.nn.silu(proj(xs, d["w_gate"], "gate")) * proj(xs, d["w_up"], "up")
    return jnp.sum(proj(h, d["w_down"], "down") * d["cot"])


def test_timed_gradient_is_the_real_one(f32_inputs):
    """The timed ``fwd_bwd_dx`` step's loss and gradients (pools, scales and
    x) are those of the expert MLP written out row by row; the timed
    ``fwd_bwd``'s are the same without x."""
    d, c = f32_inputs.data, f32_inputs.case
    args = {"pools": f32_inputs.pools, "data": d}
    with jax.default_matmul_precision("highest"):
        loss, (grads, dx) = jax.jit(bt.mlp_program("fwd_bwd_dx"))(args)
        want_loss, (want, want_dx) = jax.value_and_grad(_dense_loss, argnums=(0, 1))(
            f32_inputs.pools, d["x"], d, c)
        loss2, grads2 = jax.jit(bt.mlp_program("fwd_bwd"))(args)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, ref in zip(jax.tree_util.tree_leaves((grads, dx)),
                        jax.tree_util.tree_leaves((want, want_dx))):
        assert np.abs(np.asarray(ref)).max() > 0
        err = np.linalg.norm(np.asarray(got - ref)) / np.linalg.norm(np.asarray(ref))
        assert err <= 1e-5, err
    np.testing.assert_allclose(loss2, loss, rtol=1e-6)
    for got, ref in zip(jax.tree_util.tree_leaves(grads2), jax.tree_util.tree_leaves(grads)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ end to end

def test_check_compares_the_first_run_with_the_reference():
    args = {"g": jnp.arange(1.0, 5.0)}

    def ref(a):
        return jnp.float32(0), {"g": a["g"]}

    row = {"check": None, "check_err": None}
    first = bt._checker(row, ref, args, 1e-2)
    first((jnp.float32(7), {"g": args["g"] * (1 + 1e-3)}))  # a loss is not compared
    assert row["check"] == "ok" and row["check_err"] == pytest.approx(1e-3, rel=1e-3)
    first((jnp.float32(0), {"g": args["g"][::-1]}))
    assert row["check"] == "MISMATCH"
    first((jnp.float32(0), {"g": args["g"] * jnp.nan}))
    assert row["check"] == "MISMATCH"

    def broken(a):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    row = {"check": None}
    assert bt._checker(row, broken, args, 1e-2) is None
    assert row["check"] == "not checked (reference failed)"


def test_call_loop_makes_reps_calls_and_returns_the_last():
    calls = []

    def step(a):
        calls.append(a)
        return len(calls)

    assert bt.call_loop(step, 3)(None, "args") == 3 and calls == ["args"] * 3


def test_bench_train_tiny_run(tmp_path):
    # the check's jnp reference is left out (compiles); it is tested above
    rc = main(["bench", "--train", "--models", TINY, "--tokens", "8", "--ranks", "8",
               "--adapters", "2", "--methods", "fwd,fwd_bwd,block_fwd_bwd", "--no-check",
               "--reps", "2", "--runs", "1", "--warmup", "1",
               "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "train.json").read_text())
    meta, rows = data["meta"], data["rows"]
    assert meta["bandwidth"] > 0 and meta["matmul_flops"] > 0
    assert [r["program"] for r in rows] == ["fwd", "fwd_bwd", "block_fwd_bwd"]
    for r in rows:
        assert set(r) == set(bt.ROW_FIELDS)
        assert r["error"] is None and r["check"] is None, r
        assert r["time_us"] > 0 and r["argument_bytes"] > 3 * 8 * 32 * 16 * 2
        assert r["peak_bytes"] == (r["argument_bytes"] + r["output_bytes"] + r["temp_bytes"]
                                   - r["alias_bytes"])
        assert r["byte_floor_us"] == pytest.approx(1e6 * r["bytes"] / meta["bandwidth"])
        assert r["tc_floor_us"] == pytest.approx(1e6 * r["flops"] / meta["matmul_flops"])
        assert r["floor_us"] == max(r["byte_floor_us"], r["tc_floor_us"])
        assert r["pct_floor"] == pytest.approx(100 * r["floor_us"] / r["time_us"])
    by = {r["program"]: r for r in rows}
    assert by["fwd"]["output_bytes"] == 16 * 32 * 2  # out [M, H] bf16
    assert by["fwd"]["vs_fwd"] == 1.0 and by["fwd"]["mem_vs_fwd"] == 1.0
    assert by["fwd_bwd"]["vs_fwd"] == pytest.approx(by["fwd_bwd"]["time_us"] / by["fwd"]["time_us"])
    assert by["block_fwd_bwd"]["vs_fwd"] is None  # its forward, block_fwd, was not run
    assert "| tiny | 8 | 8 | 2 | gather | fwd_bwd |" in (tmp_path / "train.md").read_text()


def test_bench_train_trace_reports_the_kernels_of_each_program(tmp_path, one_profiler):
    """``--trace``: one more run of each program under the profiler, a folder
    each; on a GPU a row gets its kernel time per step and its kernels by
    name, on the CPU both stay empty."""
    import jax

    trace = tmp_path / "trace"
    rc = main(["bench", "--train", "--models", TINY, "--tokens", "8", "--ranks", "8",
               "--adapters", "1", "--methods", "fwd,fwd_bwd", "--no-check", "--reps", "2",
               "--runs", "1", "--warmup", "1", "--trace", str(trace), "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "train.json").read_text())["rows"]
    folders = sorted(d.name for d in trace.iterdir())
    assert folders == ["tiny-T8-R8-L1-fwd", "tiny-T8-R8-L1-fwd_bwd"]
    for r in rows:
        if jax.default_backend() == "gpu":
            assert 0 < r["kernel_us"] <= 2 * r["time_us"] and r["kernels"], r
        else:
            assert r["kernel_us"] is None and r["kernels"] is None


def test_bench_train_refuses_an_unknown_program(tmp_path, capsys):
    rc = main(["bench", "--train", "--models", TINY, "--methods", "fwd,sgd", "--out",
               str(tmp_path)])
    assert rc == 2 and "unknown program" in capsys.readouterr().out
    assert not (tmp_path / "train.json").exists()


def test_quick_and_summary():
    args = argparse_namespace(quick=True)
    s = bt.settings_from_args(args)
    from jax_moelora import _ext

    if _ext.current_platform() == "gpu":  # the GPU's quick subset: Qwen3 at T = 512 and 4096
        assert [(c.model.name, c.tokens) for c in s.cases] == [
            ("Qwen3-30B-A3B", 512), ("Qwen3-30B-A3B", 4096)]
        assert s.reps == 32
    else:  # the CPU's: the tiny model, 1 and 4 adapters, fewer steps
        assert [c.model.name for c in s.cases] == ["tiny", "tiny"]
        assert s.reps == 2
    assert s.programs == bt.DEFAULT_PROGRAMS
    rows = [dict(model="Qwen3-30B-A3B", tokens=t, rank=16, adapters=1, program=p, time_us=v,
                 vs_fwd=v / 1000.0, mem_vs_fwd=1.5, peak_bytes=2**30)
            for t in (512, 4096) for p, v in (("fwd", 1000.0), ("fwd_bwd", 2500.0))]
    lines = bt.summary(rows)
    assert "at most 2.50x over 2 cases" in lines[0]
    assert any("T=4096 fwd_bwd: 2,500 µs; target <= 2,900 µs" in line for line in lines)
    assert any("peak memory / forward's, T = 4096: at most 1.50x" in line for line in lines)


def argparse_namespace(**kw):
    """``bench``'s parsed options with ``kw`` replaced."""
    import argparse

    from jax_moelora.tools import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return argparse.Namespace(**{**vars(parser.parse_args(["--train"])), **kw})
