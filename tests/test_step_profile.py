"""``step_profile``: what LoRA adds to a step, from two kernel profiles (``demo
--timing --trace``), and the kernels of a traced benchmark row."""

from __future__ import annotations

import pytest

from jax_moelora.tools import step_profile
from jax_moelora.tools.step_profile import LIBRARY_KERNEL_MARK, overhead_split, short_name


def _profile(kernels: dict[str, float], span: float) -> dict:
    return {"per_call_us": kernels, "total_us": sum(kernels.values()), "span_us": span}


def test_overhead_split_separates_library_kernels_xla_ops_and_gaps():
    fold = f"void {LIBRARY_KERNEL_MARK}fast::gather_rows_kernel<2, 4, 2>"
    router = f"void {LIBRARY_KERNEL_MARK}fast::gather_f32_kernel<2>"
    base = _profile({"gemm_fusion_dot": 1000.0, "loop_add_fusion": 10.0}, span=1020.0)
    lora = _profile({"gemm_fusion_dot": 1000.0, "loop_add_fusion": 8.0, fold: 100.0,
                     router: 30.0, "input_concatenate_fusion": 20.0}, span=1165.0)
    split = overhead_split(base, lora)
    assert split["kernels_us"] == pytest.approx(148.0)
    assert split["library_us"] == pytest.approx(130.0)
    assert split["xla_us"] == pytest.approx(18.0)     # +20 concatenation, -2 faster add
    assert split["gaps_us"] == pytest.approx({"base": 10.0, "lora": 7.0})
    assert split["library"] == {fold: 100.0, router: 30.0}


def test_overhead_split_counts_library_kernels_of_the_base_variant_out():
    """A base variant that already runs a library kernel (the block's
    expert_matmul GEMM at prefill) is not charged to LoRA."""
    gemm = f"{LIBRARY_KERNEL_MARK}expert_gemm"
    fold = f"{LIBRARY_KERNEL_MARK}fast::grouped_expand_kernel"
    split = overhead_split(_profile({gemm: 700.0}, 700.0), _profile({gemm: 700.0, fold: 90.0},
                                                                    790.0))
    assert split["library_us"] == pytest.approx(90.0) and split["xla_us"] == pytest.approx(0.0)


def test_long_kernel_names_keep_the_tail_that_tells_them_apart():
    head = "_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS1_17GroupProblemShape" * 3
    a, b = head + "Li128ELi64EEE", head + "Li128ELi128EEE"
    assert short_name(a) != short_name(b)
    assert len(short_name(a)) == 80 and short_name(a).startswith(head[:40])
    assert short_name("loop_add_fusion") == "loop_add_fusion"


def test_trace_into_records_time_span_and_launches_per_step(monkeypatch):
    """Each kernel (long names told apart by their tail): its µs and launches a
    step, the step's kernel time and span."""
    gemm = "g" * 90
    prof = {"per_call_us": {gemm + "1": 30.0, gemm + "2": 20.0, "loop_add_fusion": 5.0},
            "count": {gemm + "1": 3.0, gemm + "2": 2.0, "loop_add_fusion": 1.0},
            "total_us": 55.0, "span_us": 70.0, "processes": []}
    monkeypatch.setattr(step_profile, "kernel_times", lambda fn, calls, folder: prof)
    row: dict = {}
    step_profile.trace_into(row, lambda: None, calls=4, folder="unused")
    assert row["kernel_us"] == 55.0 and row["span_us"] == 70.0
    assert row["kernels"] == {short_name(gemm + "1"): 30.0, short_name(gemm + "2"): 20.0,
                              "loop_add_fusion": 5.0}
    assert sum(row["launches"].values()) == 6.0
