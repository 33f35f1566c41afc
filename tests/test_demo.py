"""The end-to-end demo (``python -m jax_moelora demo``) on tiny sizes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import pytest

from jax_moelora.tools import demo


def run_demo(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return demo.run(parser.parse_args(list(argv)))


def test_demo_passes_on_tiny_sizes(tmp_path, capsys):
    """Prefill of 4 x 130 tokens (2080 rows: the sorted, grouped path), then
    decode steps (gather path), checked against impl="jnp"."""
    out = tmp_path / "demo.json"
    assert run_demo("--layers", "1", "--tokens", "4", "--prompt-len", "130", "--steps", "2",
                    "--json", str(out)) == 0
    text = capsys.readouterr().out
    for item in ("jax_moelora demo summary", "impl used", "prefill", "decode step",
                 "max error vs jnp", "support-bot", "sql-writer", "poet", "PASS"):
        assert item in text, item
    result = json.loads(out.read_text())
    assert result["passed"] and result["base_bitwise"]
    assert result["max_rel_error"] <= result["tolerance"]
    assert [a["layout"] for a in result["adapters"]] == ["experts", "target_parameters",
                                                        "target_parameters"]
    assert len(result["decode_step_s"]) == 2


@pytest.mark.parametrize("family", ["mixtral", "gpt-oss", "deepseek"])
def test_demo_runs_every_family(tmp_path, capsys, family):
    """Each family's blocks, adapters (gpt-oss: interleaved fused gate_up;
    DeepSeek: shared-expert LoRA too) and checks."""
    out = tmp_path / "demo.json"
    assert run_demo("--family", family, "--layers", "1", "--tokens", "4", "--prompt-len", "8",
                    "--steps", "1", "--json", str(out)) == 0
    assert "family" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["passed"] and result["config"]["family"] == family
    assert result["roundtrip_error"] <= 1e-5


def test_timing_mode_prints_the_overhead(tmp_path, capsys):
    out = tmp_path / "timing.json"
    assert run_demo("--timing", "--size", "small", "--layers", "1", "--tokens", "8",
                    "--steps", "2", "--repeats", "2", "--json", str(out)) == 0
    text = capsys.readouterr().out
    assert "LoRA overhead:" in text and "%" in text
    result = json.loads(out.read_text())
    assert result["tokens"] == 8 and len(result["results"]) == 3
    assert isinstance(result["overhead_percent"], float)


def test_timing_trace_splits_the_lora_overhead(tmp_path, capsys, one_profiler):
    """``--timing --trace DIR``: each variant profiled once, its optimized HLO
    written beside the profile; on a GPU the LoRA variants' kernel time over
    the base model is split into the library's kernels, XLA's other kernels
    and idle gaps (on the CPU no GPU kernel is traced, and there is nothing to
    split)."""
    out = tmp_path / "timing.json"
    assert run_demo("--timing", "--size", "small", "--layers", "1", "--tokens", "8",
                    "--steps", "2", "--repeats", "2", "--trace", str(tmp_path / "trace"),
                    "--json", str(out)) == 0
    results = json.loads(out.read_text())["results"]
    assert all("kernels" in r for r in results.values())
    lora = results["LoRA, 4 adapters over T tokens"]
    hlo = Path(lora["kernels"]["hlo"])  # the optimized program the kernel names refer to
    assert hlo.parent == tmp_path / "trace" / "variant2"
    assert "HloModule" in hlo.read_text()
    if jax.default_backend() == "gpu":
        split = lora["overhead_split"]
        assert split["library_us"] > 0 and split["library"]
        assert "of kernels a step over the base model" in capsys.readouterr().out
    else:
        assert lora["overhead_split"] is None


def test_timing_with_every_batch_sorted(tmp_path, capsys):
    """``--gather-max-rows 0``: the decode step's blocks sort every batch by
    expert (grouped folds, the ragged base path)."""
    out = tmp_path / "timing.json"
    assert run_demo("--timing", "--size", "small", "--layers", "1", "--tokens", "8",
                    "--steps", "2", "--repeats", "2", "--gather-max-rows", "0",
                    "--json", str(out)) == 0
    assert "gather_max_rows 0" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["gather_max_rows"] == 0 and len(result["results"]) == 3


def test_prefill_timing_compares_the_grouped_gemms(tmp_path, capsys):
    """``--timing --prefill``: 520 tokens x top_k 4 = 2080 rows (the grouped
    path), base and LoRA with ragged_dot and expert_matmul as the GEMM, and
    LoRA with expert_matmul reading packs made once (bf16)."""
    out = tmp_path / "prefill.json"
    assert run_demo("--timing", "--prefill", "--size", "small", "--layers", "1", "--tokens",
                    "520", "--steps", "1", "--repeats", "1", "--dtype", "bfloat16", "--json",
                    str(out)) == 0
    text = capsys.readouterr().out
    assert "prefill timing" in text and "vs ragged_dot" in text
    result = json.loads(out.read_text())
    assert result["mode"] == "prefill_timing" and result["tokens"] == 520
    assert result["rows"] == 2080 and result["grouped"] and not result["errors"]
    assert result["dtype"] == "bfloat16"
    assert {(r["expert_gemm"], r["lora"], r["packs"]) for r in result["results"].values()} == {
        (g, lora, False) for g in ("ragged_dot", "expert_matmul") for lora in (False, True)
    } | {("expert_matmul", True, True)}
    assert all(r["step_s"] > 0 for r in result["results"].values())


def test_bad_options_exit():
    with pytest.raises(SystemExit, match="--steps must be >= 1"):
        run_demo("--steps", "0")
    with pytest.raises(SystemExit, match="--prefill is a --timing mode"):
        run_demo("--prefill")


def test_cli_entry(capsys):
    main = pytest.importorskip("jax_moelora.__main__").main
    pytest.importorskip("jax_moelora.tools.bench")
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "demo" in out and "--steps" in out
