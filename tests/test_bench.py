"""The benchmark of docs/semantics.md §7: byte-floor accounting, the case grid, the
baselines' semantics, and a tiny end-to-end run (no timed assertions)."""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moelora.tools import bench
from jax_moelora.tools import bench_cases as bc
from jax_moelora.tools import bench_methods as bm

TINY = "tiny:8:2:32:16"


# ------------------------------------------------------------------ floor

def test_floor_bytes_hand_checked():
    topk = np.array([[0, 1], [1, 2], [0, 1]])
    ra = np.array([0, 1, 0])
    # pairs (0,0), (0,1), (1,1), (1,2); A+B block = 8 * (4 + 2) * 2 bytes = 96
    nb = bc.floor_bytes(topk, ra, rank=8, k_in=4, n_out=2, x_gather=1)
    assert nb["pairs"] == 4 and nb["folded_rows"] == 6 and nb["x_rows"] == 3
    assert nb["ab_bytes"] == 4 * 96
    assert nb["x_bytes"] == 3 * 4 * 2
    assert nb["out_bytes"] == 2 * 6 * 2 * 2
    assert nb["total"] == 384 + 24 + 48
    # x_gather 0 reads every folded row of x
    nb0 = bc.floor_bytes(topk, ra, rank=8, k_in=4, n_out=2, x_gather=0)
    assert nb0["x_rows"] == 6 and nb0["total"] == 384 + 48 + 48


def test_floor_bytes_skipped_rows_and_cells():
    topk = np.array([[0, 1], [1, 2], [0, 1]])
    # token 0 folds nothing: rows 2..5 remain, pairs (1,1), (1,2), (0,0), (0,1)
    nb = bc.floor_bytes(topk, np.array([-1, 1, 0]), rank=8, k_in=4, n_out=2, x_gather=1)
    assert (nb["pairs"], nb["folded_rows"], nb["x_rows"]) == (4, 4, 2)
    assert nb["total"] == 4 * 96 + 2 * 8 + 2 * 4 * 2 * 2
    # L == 1: every adapter value selects table row 0 -> pairs are experts
    one = np.ones((1, 3), bool)
    nb1 = bc.floor_bytes(topk, np.array([0, 3, 0]), rank=8, k_in=4, n_out=2, x_gather=1,
                         adapted=one)
    assert nb1["pairs"] == 3
    # an unadapted cell (row 0, expert 1) drops the rows routed to it
    cells = np.ones((1, 3), bool)
    cells[0, 1] = False
    nb2 = bc.floor_bytes(topk, None, rank=8, k_in=4, n_out=2, x_gather=0, adapted=cells)
    assert (nb2["pairs"], nb2["folded_rows"]) == (2, 3)


def test_inputs_bytes_match_routing():
    case = bc.Case(bc.parse_model(TINY), "down", 5, 8, 2)
    inputs = bc.make_inputs(case)
    topk, ra = bc.make_routing(case)
    assert inputs.bytes == bc.floor_bytes(topk, ra, rank=8, k_in=16, n_out=32, x_gather=0)


# ------------------------------------------------------------------- grid

def test_spec_grid():
    grid = bc.case_grid(list(bc.MODELS.values()))
    assert len(grid) == 3 * 2 * 6 * 2 * 2
    assert {c.tokens for c in grid} == {1, 16, 64, 256, 4096, 16384}
    assert {c.phase for c in grid if c.tokens <= 256} == {"decode"}
    assert {c.phase for c in grid if c.tokens > 256} == {"prefill"}
    q = bc.MODELS["Qwen3-30B-A3B"]
    assert (q.n_experts, q.top_k, q.hidden, q.inter) == (128, 8, 2048, 768)
    m = bc.MODELS["Mixtral-8x7B"]
    assert (m.n_experts, m.top_k, m.hidden, m.inter) == (8, 2, 4096, 14336)
    d = bc.MODELS["DeepSeek-V2-Lite"]
    assert (d.n_experts, d.top_k, d.hidden, d.inter) == (64, 6, 2048, 1408)
    gate, down = bc.Case(q, "gate", 1, 16, 1), bc.Case(q, "down", 1, 16, 1)
    assert (gate.x_gather, gate.k_in, gate.n_out) == (1, 2048, 768)
    assert (down.x_gather, down.k_in, down.n_out) == (0, 768, 2048)


def test_router_cases_fold_the_logits_with_float32_pools():
    """The router's fold: a row a token over one table column, the gather
    fold at every token count, float32 pools and logits read and written at
    4 bytes, the activations at their own width."""
    q = bc.MODELS["Qwen3-30B-A3B"]
    case = bc.Case(q, "router", 4096, 16, 4)
    assert (case.k_in, case.n_out, case.top_k, case.n_rows, case.table_experts) == (
        2048, 128, 1, 4096, 1)
    assert case.phase == "prefill" and case.gather and case.x_gather == 0
    topk, ra = bc.make_routing(case)
    assert topk.shape == (4096, 1) and not topk.any()
    np.testing.assert_array_equal(ra, bc.make_routing(bc.Case(q, "gate", 4096, 16, 4))[1])
    nb = bc.case_floor_bytes(case, topk, ra)
    assert nb["pairs"] == 4 and nb["folded_rows"] == 4096
    assert nb["ab_bytes"] == 4 * 16 * (2048 + 128) * 4
    assert nb["x_bytes"] == 4096 * 2048 * 2 and nb["out_bytes"] == 2 * 4096 * 128 * 4
    tiny = bc.make_inputs(bc.Case(bc.parse_model(TINY), "router", 300, 8, 2))
    route = tiny.args["route"]
    assert tiny.base_out.dtype == jnp.float32 and tiny.base_out.shape == (300, 8)
    assert route.a_pool.dtype == jnp.float32 and route.a_table.shape == (2, 1)
    assert tiny.args["x"].dtype == jnp.bfloat16 and tiny.args["x"].shape == (300, 32)
    assert not np.asarray(tiny.args["indices"]).any()
    with pytest.raises(ValueError, match="projection"):
        bc.case_grid([q], ("gate_up",))


def test_parse_model():
    assert bc.parse_model("qwen") is bc.MODELS["Qwen3-30B-A3B"]
    assert bc.parse_model("mixtral-8x7b") is bc.MODELS["Mixtral-8x7B"]
    assert bc.parse_model(TINY) == bc.Model("tiny", 8, 2, 32, 16)
    for bad in ("nope", "x:1:2:3", "x:2:3:4:5"):
        with pytest.raises(ValueError):
            bc.parse_model(bad)
    with pytest.raises(ValueError):
        bc.case_grid([bc.MODELS["Qwen3-30B-A3B"]], projs=("up",))


def test_routing_seeded_and_distinct():
    case = bc.Case(bc.MODELS["DeepSeek-V2-Lite"], "gate", 40, 16, 4, seed=3)
    topk, ra = bc.make_routing(case)
    again, ra2 = bc.make_routing(case)
    np.testing.assert_array_equal(topk, again)
    np.testing.assert_array_equal(ra, ra2)
    assert topk.shape == (40, 6) and topk.dtype == np.int32
    assert all(len(set(row)) == 6 for row in topk)
    assert topk.min() >= 0 and topk.max() < 64
    assert set(ra.tolist()) <= {0, 1, 2, 3} and len(set(ra.tolist())) > 1


def test_quick_settings():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    s = bench.settings_from_args(p.parse_args(["--quick"]))
    assert {c.model.name for c in s.cases} == {"Qwen3-30B-A3B"}
    assert {c.proj for c in s.cases} == {"gate", "down"}
    assert {c.rank for c in s.cases} == {16} and {c.adapters for c in s.cases} == {1, 4}
    assert {c.phase for c in s.cases} == {"decode", "prefill"}
    assert set(s.methods) >= set(bm.BASELINES)


def test_decode_max_tokens_moves_the_gather_fold_boundary():
    grid = bc.case_grid([bc.MODELS["Qwen3-30B-A3B"]], ("gate",), (256, 512, 1024), (16,), (4,),
                        decode_max_tokens=512)
    assert [c.phase for c in grid] == ["decode", "decode", "prefill"]


def test_merge_keeps_the_same_case_in_both_phases(tmp_path):
    """A token count timed as decode in one run and as prefill in another:
    both rows survive the merge (the phase is part of a row's key)."""
    def run(*extra):
        p = argparse.ArgumentParser()
        bench.add_arguments(p)
        return bench.run(p.parse_args(list(extra) + ["--no-plot"]))

    case = ["--models", TINY, "--projs", "down", "--tokens", "6", "--ranks", "8", "--adapters",
            "2", "--methods", "jnp", "--reps", "2", "--runs", "1", "--warmup", "1",
            "--bw-mib", "4"]
    assert run(*case, "--out", str(tmp_path / "d")) == 0
    assert run(*case, "--decode-max-tokens", "4", "--out", str(tmp_path / "p")) == 0
    assert run("--merge", str(tmp_path / "d" / "bench.json"), str(tmp_path / "p" / "bench.json"),
               "--out", str(tmp_path / "m")) == 0
    rows = json.loads((tmp_path / "m" / "bench.json").read_text())["rows"]
    assert sorted(r["phase"] for r in rows) == ["decode", "prefill"]
    assert all(r["time_us"] > 0 and r["error"] is None for r in rows)


# -------------------------------------------------------------- baselines

def _messy_inputs(phase: str, proj: str, adapters: int) -> bc.CaseInputs:
    """Tiny inputs with skipped rows: adapter -1, adapter >= L, a 0 cell."""
    tokens = 6 if phase == "decode" else 300
    case = bc.Case(bc.parse_model(TINY), proj, tokens, 8, adapters)
    inputs = bc.make_inputs(case)
    ra = np.array(inputs.args["row_adapter"])
    ra[0] = -1
    if adapters > 1:
        ra[1] = adapters + 3
    route = inputs.args["route"]
    a_table = np.array(route.a_table)
    if a_table.shape[1] > 1 or adapters > 1:  # the router with one adapter keeps its cell
        a_table[0, min(1, a_table.shape[1] - 1)] = 0
    inputs.args = {**inputs.args, "row_adapter": jnp.asarray(ra),
                   "route": route.replace(a_table=jnp.asarray(a_table))}
    return inputs


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("proj", ["gate", "down", "router"])
@pytest.mark.parametrize("adapters", [1, 3])
def test_baselines_match_jnp(phase, proj, adapters):
    inputs = _messy_inputs(phase, proj, adapters)
    ref = bm.reference(inputs)
    assert not np.array_equal(np.asarray(ref), np.asarray(inputs.base_out))
    for method in bm.default_methods():  # the baselines and this platform's custom calls
        fold = bm.make_fold(method, inputs.case)
        chk = bm.check_fold(fold, inputs, bm.prepare_args(method, inputs), ref)
        assert chk["ok"] and chk["kept"], (method, chk)


def test_loop_is_reps_folds():
    inputs = _messy_inputs("decode", "gate", 2)
    fold = bm.make_fold("einsum", inputs.case)
    want = inputs.base_out
    for _ in range(5):
        want = jax.jit(fold)(want, inputs.args)
    got = bm.make_loop(fold, 5, unroll=2)(jnp.copy(inputs.base_out), inputs.args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_compare_flags_wrong_and_touched_rows():
    inputs = _messy_inputs("decode", "down", 2)
    base, ref = inputs.base_out, bm.reference(inputs)
    assert bm.compare(ref, ref, base)["ok"]
    wrong = base + 2 * (ref - base)
    assert not bm.compare(wrong, ref, base)["ok"]
    skipped_row = 0          # token 0 maps to adapter -1
    poked = ref.at[skipped_row, 0].add(1)
    chk = bm.compare(poked, ref, base)
    assert not chk["kept"] and not chk["ok"]


def test_ragged_skip_reason():
    big = bc.Case(bc.MODELS["Qwen3-30B-A3B"], "gate", 4096, 16, 4)
    assert bm.skip_reason("ragged_dot", big, ragged_max_bytes=1 << 30)
    assert bm.skip_reason("ragged_dot", big, ragged_max_bytes=0) is None
    assert bm.skip_reason("einsum", big, ragged_max_bytes=1) is None


# ------------------------------------------------------------------- run

def _run(tmp_path, *extra):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--models", TINY, "--tokens", "2,300", "--ranks", "8", "--adapters",
                         "2", "--reps", "2", "--runs", "2", "--warmup", "1", "--bw-mib", "4",
                         "--out", str(tmp_path), *extra])
    return bench.run(args)


def test_smoke_run_writes_json_and_png(tmp_path):
    assert _run(tmp_path) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    rows, meta = data["rows"], data["meta"]
    methods = bm.default_methods()
    assert len(rows) == 2 * 2 * len(methods)          # (gate, down) x tokens x methods
    for r in rows:
        assert set(bench.ROW_FIELDS) <= set(r)
        assert r["bytes"] > 0 and r["floor_us"] > 0 and r["bandwidth"] == meta["bandwidth"]
        if r["skipped"] is None:
            assert r["time_us"] > 0 and r["pct_floor"] > 0
            assert r["check"] in ("ok", "ref") and r["error"] is None
    assert {r["phase"] for r in rows} == {"decode", "prefill"}
    assert meta["bandwidth"] > 0 and meta["reps"] == 2 and meta["runs"] == 2
    png = tmp_path / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| method |" in (tmp_path / "bench.md").read_text()


def test_smoke_run_of_the_router(tmp_path):
    assert _run(tmp_path, "--projs", "router") == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert len(rows) == 2 * len(bm.default_methods())
    assert {r["proj"] for r in rows} == {"router"} and {r["rows"] for r in rows} == {2, 300}
    assert all(r["check"] in ("ok", "ref") and r["error"] is None for r in rows)


def test_wrong_method_reported(tmp_path, monkeypatch):
    real = bm.make_fold

    def broken(method, case):
        fold = real(method, case)
        if method != "einsum":
            return fold
        return lambda out, a: (2 * fold(out, a).astype(jnp.float32)
                               - out.astype(jnp.float32)).astype(out.dtype) * 1.5
    monkeypatch.setattr(bm, "make_fold", broken)
    assert _run(tmp_path, "--methods", "jnp,einsum", "--tokens", "2", "--no-plot") == 1
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert {r["check"] for r in rows if r["method"] == "einsum"} == {"MISMATCH"}
    assert not (tmp_path / "bench.png").exists()


@pytest.mark.parametrize("method", ["einsum", "ragged_dot", "jnp"])
def test_loop_keeps_the_fold_inside(method):
    """No dot of the fold is hoisted out of the timed loop (docs/semantics.md §7)."""
    case = bc.Case(bc.parse_model(TINY), "gate", 6, 8, 2)
    inputs = bc.make_inputs(case)
    loop = bm.make_loop(bm.make_fold(method, case), 4, unroll=2)
    hlo = loop.lower(inputs.base_out, bm.prepare_args(method, inputs)).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    assert "while(" in entry
    assert " dot(" not in entry and " gather(" not in entry


def test_merge_joins_runs_and_keeps_each_rows_floor(tmp_path):
    """--merge: rows of several runs in one report; a later run's row of the
    same case and method wins; each row keeps its own run's floor."""
    assert _run(tmp_path / "a", "--methods", "jnp,einsum", "--tokens", "2", "--no-plot") == 0
    first = json.loads((tmp_path / "a" / "bench.json").read_text())
    again = {"meta": {**first["meta"], "bandwidth": 2 * first["meta"]["bandwidth"]},
             "rows": [{**r, "bandwidth": 2 * r["bandwidth"], "pct_floor": r["pct_floor"] / 2,
                       "time_us": 7.0} for r in first["rows"] if r["method"] == "einsum"]}
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bench.json").write_text(json.dumps(again))
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--merge", str(tmp_path / "a" / "bench.json"),
                         str(tmp_path / "b" / "bench.json"), "--out", str(tmp_path / "m")])
    assert bench.run(args) == 0
    merged = json.loads((tmp_path / "m" / "bench.json").read_text())
    assert len(merged["rows"]) == len(first["rows"])
    by = {(r["proj"], r["method"]): r for r in merged["rows"]}
    for r in first["rows"]:
        got = by[(r["proj"], r["method"])]
        if r["method"] == "einsum":
            assert got["time_us"] == 7.0 and got["bandwidth"] == 2 * r["bandwidth"]
        else:
            assert got == r
    assert [m["rows"] for m in merged["meta"]["merged"]] == [len(first["rows"]),
                                                              len(again["rows"])]
    assert "2 runs, copy bandwidth" in (tmp_path / "m" / "bench.md").read_text()
    assert (tmp_path / "m" / "bench.png").read_bytes()[:4] == b"\x89PNG"
    bad = p.parse_args(["--merge", str(tmp_path / "m" / "bench.md"), "--out", str(tmp_path)])
    assert bench.run(bad) == 2


def test_trace_reports_kernel_time_per_fold(tmp_path, one_profiler):
    """``--trace``: one more run of each timed program under the profiler; on
    a GPU every timed row gets its kernel time per fold (positive, and at most
    the wall time per fold it was measured against, give or take the timing
    noise) and the fold's kernels by name; on the CPU no GPU kernel is traced
    and the rows say nothing."""
    trace = tmp_path / "trace"
    assert _run(tmp_path, "--methods", "jnp", "--projs", "gate", "--trace", str(trace)) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert rows and any(trace.rglob("*.trace.json.gz"))
    for r in rows:
        if jax.default_backend() == "gpu":
            assert 0 < r["kernel_us"] <= 2 * r["time_us"] and r["kernels"]
            assert "kernel µs" in (tmp_path / "bench.md").read_text()
        else:
            assert r["kernel_us"] is None and r["kernels"] is None
