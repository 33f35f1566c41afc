"""``python -m jax_moelora bench --gemm``: the grouped expert GEMM benchmark.

For each model (``bench_cases.MODELS``), projection (``gate_up``: the gate and
up weight sets ``[E, hidden, inter]`` in one call; ``down``: ``[E, inter,
hidden]``) and token count, rows are sorted by expert and, within an expert,
by adapter (``top_k`` distinct experts per token, seeded; the order of
``MoEBlock``) and three methods are timed with the protocol of
``bench`` (``bench_methods.make_loop``: ``--reps`` calls back to back in one
jitted program, the median of ``--runs`` runs, divided by ``--reps``):

- ``gemm``: ``expert_matmul`` (``impl="auto"``) without LoRA;
- ``gemm_lora``: the same with ``--adapters`` adapters of rank ``--rank``
  folded (one per token, every (adapter, expert) cell adapted), where
  ``lora_in_gemm_default`` puts the fold; ``gemm_lora_in`` and
  ``gemm_lora_after`` put it inside the GEMM's K loop or after the GEMM
  (``lora_in_gemm=True``/``False``; the gather fold's row counts fold after
  the GEMM either way unless ``gather_max_rows`` is lowered: both fold with
  the grouped fold, ``gather_max_rows=0``); ``gemm_lora_packed`` folds inside
  the K loop reading the routes' ``pack_lora_in_gemm`` packs, made once
  with the inputs (a server makes them once per adapter change);
- ``ragged_dot``: ``jax.lax.ragged_dot`` (bf16 operands, fp32 accumulation)
  per weight set; skipped where XLA's dense lowering would need more than
  ``--ragged-max-gib`` (its ``[E, M, N]`` fp32 intermediate).

``gemm@<schedule>`` and ``gemm_lora@<schedule>`` take the CUTLASS kernel of
that schedule (``cooperative`` or ``pingpong``) instead of ``gemm_schedule``'s
choice.

Floors, per row: ``max(bytes / copy bandwidth, flops / matmul rate)``, both
measured in the same run (an in-place copy of a large buffer, a large dense
bf16 matmul). Bytes: ``x`` once, the weights of the experts that own rows,
the output written once (plus the touched A/B blocks with LoRA); flops ``2 M
K N`` per weight set. ``gemm`` and ``gemm_lora`` are checked against
``impl="jnp"`` on the same inputs (relative error by norm), where that
reference (``ragged_dot``, dense on a GPU) fits :func:`reference_max_bytes`.
``gemm.json`` and ``gemm.md`` are rewritten after every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

from jax_moelora import _ext
from jax_moelora.tools import bench_methods as bm
from jax_moelora.tools.bench_cases import MODELS, Model, make_routing, parse_model
from jax_moelora.tools.step_profile import top_kernels, trace_into
from jax_moelora.ops.expert_matmul import EXPERT_MATMUL_SCHEDULES, expert_matmul
from jax_moelora.ops.lora_pack import PACK_DTYPES, pack_lora_in_gemm
from jax_moelora.tables import MoeExpertRoute

__all__ = ["GemmCase", "GEMM_TOKENS", "GEMM_PROJS", "GEMM_METHODS", "run_gemm_bench",
           "parse_method", "measure_matmul_rate", "gemm_floor"]

GEMM_TOKENS = (64, 256, 4096, 16384)
GEMM_PROJS = ("gate_up", "down")
GEMM_METHODS = ("gemm", "gemm_lora", "ragged_dot")
#: Methods run only when named: the LoRA inside the GEMM or after it, and
#: inside it reading packs made once.
LORA_PLACE_METHODS = {"gemm_lora_in": True, "gemm_lora_after": False, "gemm_lora_packed": True}
# --quick on the CPU: a small custom model, few tokens and repetitions.
QUICK_CPU_MODEL = "tiny:16:2:256:128"
QUICK_CPU_TOKENS = (16, 64)
TOLERANCE = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}


@dataclasses.dataclass(frozen=True)
class GemmCase:
    """One (model, projection, tokens) point."""

    model: Model
    proj: str
    tokens: int
    rank: int = 16
    adapters: int = 4
    seed: int = 0

    @property
    def k_in(self) -> int:
        return self.model.hidden if self.proj == "gate_up" else self.model.inter

    @property
    def n_out(self) -> int:
        return self.model.inter if self.proj == "gate_up" else self.model.hidden

    @property
    def n_weights(self) -> int:
        return 2 if self.proj == "gate_up" else 1

    @property
    def rows(self) -> int:
        return self.tokens * self.model.top_k

    @property
    def label(self) -> str:
        return f"{self.model.name} {self.proj} T={self.tokens}"


def _routing_case(c: GemmCase):
    """The fold benchmark's routing of the same model and tokens."""
    from jax_moelora.tools.bench_cases import Case
    return Case(c.model, "gate", c.tokens, c.rank, c.adapters, c.seed)


def make_gemm_inputs(c: GemmCase, dtype=jnp.bfloat16) -> dict[str, Any]:
    """Seeded device inputs: sorted rows ``x [M, K]`` (x_gather=0),
    ``group_sizes``, weights, the routes and the token of each row."""
    m = c.model
    E, K, N, R, L = m.n_experts, c.k_in, c.n_out, c.rank, c.adapters
    topk, row_adapter = make_routing(_routing_case(c))
    flat = topk.reshape(-1)
    # by expert, then by adapter (the order MoEBlock and moe_lora_fold sort rows in)
    order = np.lexsort((row_adapter[np.arange(flat.size) // m.top_k], flat))
    sizes = np.bincount(flat, minlength=E).astype(np.int32)
    stids = (order // m.top_k).astype(np.int32)
    key = jax.random.key(c.seed)
    ks = jax.random.split(key, 4 + 2 * c.n_weights)

    def normal(k, shape, std):
        return (jax.random.normal(k, shape, jnp.float32) * std).astype(dtype)

    x = normal(ks[0], (c.rows, K), 1.0)
    ws = tuple(normal(ks[1 + i], (E, K, N), K ** -0.5) for i in range(c.n_weights))
    P = 1 + L * E
    slots = jnp.asarray((1 + np.arange(L)[:, None] * E + np.arange(E)[None, :]).astype(np.int32))
    scale = jnp.asarray(np.random.default_rng(c.seed).uniform(0.25, 1.0, (L, E)), jnp.float32)
    routes = tuple(
        MoeExpertRoute(a_pool=normal(ks[3 + 2 * i], (P, R, K), K ** -0.5),
                       b_pool=normal(ks[4 + 2 * i], (P, N, R), R ** -0.5),
                       a_table=slots, b_table=slots, scale_table=scale)
        for i in range(c.n_weights))
    active = int((sizes > 0).sum())
    packs = tuple(pack_lora_in_gemm(r) for r in routes) if jnp.dtype(dtype) in PACK_DTYPES else None
    return {"x": x, "w": ws if c.n_weights == 2 else ws[0], "group_sizes": jnp.asarray(sizes),
            "routes": routes if c.n_weights == 2 else routes[0],
            "packs": packs if packs is None or c.n_weights == 2 else packs[0],
            "row_adapter": jnp.asarray(row_adapter), "sorted_token_ids": jnp.asarray(stids),
            "active_experts": active,
            "active_cells": len({(int(a), int(e)) for a, e in
                                 zip(row_adapter[order // m.top_k], flat[order])})}


def gemm_floor(c: GemmCase, inputs: dict[str, Any], *, lora: bool, bandwidth: float,
               matmul_rate: float, itemsize: int = 2) -> dict[str, float]:
    """Bytes, flops and the floor (seconds) of one call."""
    M, K, N, nw = c.rows, c.k_in, c.n_out, c.n_weights
    nbytes = itemsize * (M * K + nw * (inputs["active_experts"] * K * N + M * N))
    flops = 2.0 * M * K * N * nw
    if lora:
        nbytes += itemsize * nw * inputs["active_cells"] * c.rank * (K + N)
        flops += 2.0 * M * c.rank * (K + N) * nw
    return {"bytes": nbytes, "flops": flops, "byte_floor": nbytes / bandwidth,
            "tc_floor": flops / matmul_rate,
            "floor": max(nbytes / bandwidth, flops / matmul_rate)}


def measure_matmul_rate(n: int, *, reps: int, runs: int, warmup: int = 2) -> float:
    """FLOP/s of a dense bf16 ``[n, n] @ [n, n]`` (fp32 accumulation), timed
    with the benchmark's loop."""
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(jnp.bfloat16) * n ** -0.5

    def fold(a, args):
        return jnp.matmul(a, args, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    a = jax.random.normal(jax.random.key(2), (n, n), jnp.float32).astype(jnp.bfloat16)
    t = bm.time_loop(bm.make_loop(fold, reps, min(8, reps)), a, b, reps=reps, runs=runs,
                     warmup=warmup)
    return 2.0 * n ** 3 / t


def _chained_sizes(out, a):
    """``group_sizes`` made to depend on the previous call's output (plus 0
    unless its first element is NaN): without it the call would not depend on
    the loop's carry, and XLA would hoist it out of the timed loop."""
    return a["group_sizes"] + jnp.isnan(out.reshape(-1)[0]).astype(jnp.int32)


def parse_method(method: str) -> tuple[str, str]:
    """``"gemm_lora@pingpong"`` -> ``("gemm_lora", "pingpong")``; the schedule
    is ``"auto"`` when none is named. ValueError for an unknown method or
    schedule, or a schedule on ``ragged_dot``."""
    base, at, schedule = method.partition("@")
    schedule = schedule if at else "auto"
    if (base not in (*GEMM_METHODS, *LORA_PLACE_METHODS) or schedule not in EXPERT_MATMUL_SCHEDULES
            or (at and base == "ragged_dot")):
        raise ValueError(f"unknown method {method!r}; known: "
                         f"{', '.join((*GEMM_METHODS, *LORA_PLACE_METHODS))}, and those but "
                         f"ragged_dot @ one of {', '.join(EXPERT_MATMUL_SCHEDULES[1:])}")
    return base, schedule


def _method_fn(method: str, c: GemmCase, impl: str):
    """``fn(out, args) -> out`` for the benchmark loop (out: the first output)."""
    method, schedule = parse_method(method)

    def call(out, a, lora, impl=impl, in_gemm=None):
        grouped = {} if in_gemm is None else {"gather_max_rows": 0}
        packs = a["packs"] if method == "gemm_lora_packed" else None
        out = expert_matmul(a["x"], a["w"], _chained_sizes(out, a),
                            lora=a["routes"] if lora else None,
                            row_adapter=a["row_adapter"] if lora else None,
                            sorted_token_ids=a["sorted_token_ids"], impl=impl,
                            schedule=schedule, lora_in_gemm=in_gemm, lora_packs=packs, **grouped)
        return out if c.n_weights == 1 else jnp.stack(out)

    if method == "gemm":
        return lambda out, a: call(out, a, False)
    if method == "gemm_lora":
        return lambda out, a: call(out, a, True)
    if method in LORA_PLACE_METHODS:
        return lambda out, a: call(out, a, True, in_gemm=LORA_PLACE_METHODS[method])
    if method == "ragged_dot":
        def ragged(out, a):
            ws = a["w"] if c.n_weights == 2 else (a["w"],)
            gs = _chained_sizes(out, a)
            outs = [jax.lax.ragged_dot(a["x"], w, gs,
                                       preferred_element_type=jnp.float32).astype(a["x"].dtype)
                    for w in ws]
            return outs[0] if c.n_weights == 1 else jnp.stack(outs)
        return ragged
    raise AssertionError(method)  # parse_method accepted it


def run_gemm_bench(cases: list[GemmCase], methods: tuple[str, ...], *, reps: int, runs: int,
                   warmup: int, bw_bytes: int, matmul_n: int, ragged_max_bytes: float,
                   check: bool = True, console: Console | None = None,
                   out: Path | None = None, trace: Path | None = None
                   ) -> tuple[list[dict], dict]:
    """Time every method on every case; returns the rows and the run's metadata.

    With ``trace``, one more run of each timed program is profiled into a
    folder of ``trace`` and its rows get ``kernel_us`` and ``kernels``
    (``step_profile.trace_into``), the kernels printed.

    With ``out``, ``gemm.json`` and ``gemm.md`` are rewritten after every row,
    so a run cut short keeps what it measured. Where the jnp reference's dense
    ``ragged_dot`` lowering would exceed :func:`reference_max_bytes`, a row is
    timed but not checked (``check`` says so)."""
    console = console or Console()
    bandwidth = bm.measure_bandwidth(bw_bytes, reps=reps, runs=runs, warmup=warmup)
    rate = measure_matmul_rate(matmul_n, reps=reps, runs=runs, warmup=warmup)
    meta = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "bandwidth": bandwidth, "matmul_flops": rate, "matmul_n": matmul_n,
            "reps": reps, "runs": runs, "kernel": _ext.HAS_EXPERT_MATMUL,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    console.print(f"copy {bandwidth / 1e9:,.1f} GB/s, dense bf16 matmul "
                  f"{rate / 1e12:,.1f} TFLOP/s (n = {matmul_n})")
    ref_max_bytes = reference_max_bytes(ragged_max_bytes)
    rows = []
    for c in cases:
        inputs = make_gemm_inputs(c)
        args = {k: v for k, v in inputs.items() if k not in ("active_experts", "active_cells")}
        shape = (c.rows, c.n_out) if c.n_weights == 1 else (2, c.rows, c.n_out)
        out0 = jnp.zeros(shape, jnp.bfloat16)
        refs = {}
        for method in methods:
            lora = parse_method(method)[0].startswith("gemm_lora")
            f = gemm_floor(c, inputs, lora=lora, bandwidth=bandwidth, matmul_rate=rate)
            row = {"model": c.model.name, "proj": c.proj, "tokens": c.tokens, "rows": c.rows,
                   "method": method, "adapters": c.adapters if lora else 0,
                   "rank": c.rank if lora else 0, "time_us": None, "floor_us": f["floor"] * 1e6,
                   "byte_floor_us": f["byte_floor"] * 1e6, "tc_floor_us": f["tc_floor"] * 1e6,
                   "pct_floor": None, "bytes": f["bytes"], "flops": f["flops"], "check": None,
                   "check_err": None, "skipped": None, "error": None, "kernel_us": None,
                   "span_us": None, "kernels": None, "launches": None}
            dense = 4 * c.model.n_experts * c.rows * c.n_out
            if method == "ragged_dot" and dense > ragged_max_bytes:
                row["skipped"] = f"dense lowering needs {dense / 2**30:.1f} GiB"
            else:
                _time_row(row, c, method, args, out0, refs, c.n_weights * dense > ref_max_bytes,
                          reps=reps, runs=runs, warmup=warmup, check=check, console=console,
                          trace=trace)
            rows.append(row)
            console.print(f"{c.label} {method}: {_fmt(row['time_us'])} µs "
                          f"({_fmt(row['pct_floor'], 0)} % floor) "
                          f"{row['skipped'] or row['error'] or row['check'] or ''}")
            if row["kernel_us"]:
                console.print(f"  kernels {row['kernel_us']:,.2f} µs a call:\n"
                              + top_kernels(row), highlight=False, end="")
            if out is not None:
                write_gemm_outputs(rows, meta, out)
        refs.clear()
    return rows, meta


def reference_max_bytes(ragged_max_bytes: float) -> float:
    """The largest dense ``ragged_dot`` intermediate the check's jnp reference
    may build: half the device's memory where JAX reports it, and never less
    than ``ragged_max_bytes`` (the bound of the timed ``ragged_dot``)."""
    stats = jax.devices()[0].memory_stats() or {}
    return max(ragged_max_bytes, stats.get("bytes_limit", 0) / 2)


def _time_row(row: dict, c: GemmCase, method: str, args: dict, out0: jax.Array, refs: dict,
              ref_too_large: bool, *, reps: int, runs: int, warmup: int, check: bool,
              console: Console, trace: Path | None = None) -> None:
    """Fill ``row``'s time (and check) for one method on one case; an error is
    reported in the row and the run goes on. A jnp reference that fails (e.g.
    out of memory in XLA's autotuner) leaves the row timed and not checked."""
    try:
        first = None
        base = parse_method(method)[0]
        # a reference per base method, shared by the schedules and the fold's places
        base = "gemm_lora" if base.startswith("gemm_lora") else base
        if check and base in ("gemm", "gemm_lora"):
            if ref_too_large:  # the jnp reference lowers through ragged_dot, dense on a GPU
                row["check"] = "not checked (reference too large)"
            elif base not in refs and not _reference(refs, base, c, args, out0):
                row["check"] = "not checked (reference failed)"
            else:
                def first(out, row=row, ref=refs[base]):
                    o, r = out.astype(jnp.float32), ref.astype(jnp.float32)
                    err = float(jnp.linalg.norm(o - r) / jnp.maximum(jnp.linalg.norm(r), 1e-30))
                    row["check_err"] = err
                    row["check"] = "ok" if err <= TOLERANCE[jnp.dtype(out.dtype)] else "MISMATCH"

        # every call unrolled for the custom call, 8 per loop step for ragged_dot
        unroll = reps if base != "ragged_dot" else min(8, reps)
        loop = bm.make_loop(_method_fn(method, c, "auto"), reps, unroll)
        t = bm.time_loop(loop, out0, args, reps=reps, runs=runs, warmup=warmup,
                         first=first)
        row["time_us"] = t * 1e6
        row["pct_floor"] = 100.0 * row["floor_us"] / row["time_us"]
        if trace is not None:
            slug = f"{c.label}-{method}".replace(" ", "_").replace("=", "").replace("@", "_")
            trace_into(row, lambda: loop(jnp.copy(out0), args), calls=reps, folder=trace / slug)
    except Exception as err:  # noqa: BLE001 - reported per row, the run goes on
        row["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        console.print(f"[red]error[/] {c.label} {method}: {row['error']}")


def _reference(refs: dict, method: str, c: GemmCase, args: dict, out0: jax.Array) -> bool:
    """Compute ``method``'s jnp reference into ``refs``; False where it fails."""
    try:
        ref_loop = bm.make_loop(_method_fn(method, c, "jnp"), 1)
        refs[method] = jax.block_until_ready(ref_loop(jnp.copy(out0), args))
        return True
    except Exception:  # noqa: BLE001 - the row is still timed, and says it is not checked
        return False


def write_gemm_outputs(rows: list[dict], meta: dict, out: Path) -> None:
    """``gemm.json`` and ``gemm.md`` in ``out`` (rewritten after every row)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "gemm.md").write_text(markdown(rows))


def _fmt(v, digits: int = 1) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table (one line per case and method)."""
    head = ("| model | proj | T | method | floor µs (bytes / tc) | time µs | % floor | "
            "vs ragged_dot | check |\n|---|---|---:|---|---:|---:|---:|---:|---|\n")
    ragged = {(r["model"], r["proj"], r["tokens"]): r["time_us"] for r in rows
              if r["method"] == "ragged_dot"}
    lines = []
    for r in rows:
        rd = ragged.get((r["model"], r["proj"], r["tokens"]))
        speed = (f"{rd / r['time_us']:,.1f}x" if rd and r["time_us"] and r["method"] != "ragged_dot"
                 else "–")
        status = r["skipped"] or r["error"] or r["check"] or ""
        lines.append(f"| {r['model']} | {r['proj']} | {r['tokens']} | {r['method']} | "
                     f"{_fmt(r['floor_us'])} ({_fmt(r['byte_floor_us'])} / "
                     f"{_fmt(r['tc_floor_us'])}) | {_fmt(r['time_us'])} | "
                     f"{_fmt(r['pct_floor'], 0)} | {speed} | {status} |")
    return head + "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """``bench --gemm``: 1 on a mismatch or an error."""
    console = Console(width=150)
    plat = "gpu" if _ext.current_platform() == "gpu" else "cpu"
    small = args.quick and plat == "cpu"
    models = args.models or ((QUICK_CPU_MODEL,) if small else
                             (("Qwen3-30B-A3B",) if args.quick else tuple(MODELS)))
    projs = args.projs or GEMM_PROJS
    for p in projs:
        if p not in GEMM_PROJS:
            console.print(f"[red]bench --gemm:[/] projection must be one of {GEMM_PROJS}, got {p!r}")
            return 2
    tokens = args.tokens or (QUICK_CPU_TOKENS if small else
                             ((64, 4096) if args.quick else GEMM_TOKENS))
    rank = (args.ranks or (16,))[0]
    adapters = (args.adapters or (4,))[0]
    methods = args.methods or GEMM_METHODS
    for m in methods:
        try:
            parse_method(m)
        except ValueError as err:
            console.print(f"[red]bench --gemm:[/] {err}")
            return 2
    cases = [GemmCase(parse_model(m), p, t, rank, adapters, args.seed)
             for m in models for p in projs for t in tokens]
    reps = args.reps or (4 if small else 32)
    runs = args.runs or (3 if small else 20)
    warmup = args.warmup or (1 if small else 2)
    bw = int(args.bw_mib * 2**20) if args.bw_mib else (1 << 30 if plat == "gpu" else 64 << 20)
    ragged = (args.ragged_max_gib * 2**30 if args.ragged_max_gib is not None
              else (16 << 30 if plat == "gpu" else 256 << 20))
    rows, meta = run_gemm_bench(cases, tuple(methods), reps=reps, runs=runs, warmup=warmup,
                                bw_bytes=bw, matmul_n=8192 if plat == "gpu" else 512,
                                ragged_max_bytes=ragged, check=not args.no_check,
                                console=console,
                                out=None if args.out is None else Path(args.out),
                                trace=args.trace)
    table = Table(title=f"expert_matmul on {meta['device']}, copy {meta['bandwidth'] / 1e9:,.0f} "
                        f"GB/s, matmul {meta['matmul_flops'] / 1e12:,.1f} TFLOP/s")
    for col in ("case", "method", "floor µs", "time µs", "% floor", "check"):
        table.add_column(col)
    for r in rows:
        table.add_row(f"{r['model']} {r['proj']} T={r['tokens']}", r["method"],
                      _fmt(r["floor_us"]), _fmt(r["time_us"]), _fmt(r["pct_floor"], 0),
                      r["skipped"] or r["error"] or r["check"] or "")
    console.print(table)
    if args.out is not None:
        console.print(f"wrote {Path(args.out) / 'gemm.json'} and {Path(args.out) / 'gemm.md'}")
    bad = [r for r in rows if r["check"] == "MISMATCH" or r["error"]]
    return 1 if bad else 0
