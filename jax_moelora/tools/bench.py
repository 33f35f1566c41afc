"""``python -m jax_moelora bench``: the benchmark of docs/semantics.md §7.

For each case (model, projection, tokens, rank, adapters; see
``bench_cases``) and method (``fast``, ``simple``, ``cpu``, ``jnp`` and the
``ragged_dot`` / ``einsum`` baselines; see ``bench_methods``) it

1. times it: one jitted program folds ``--reps`` times back to back (the
   carried ``base_out`` is donated; an optimization barrier keeps every part
   of the fold inside the loop), the median of ``--runs`` runs after
   ``--warmup`` untimed ones, divided by ``--reps``;
2. checks it against the ``jnp`` fold on the same inputs: the first,
   untimed run (``reps`` folds of ``base_out``) is compared with the same
   ``reps`` ``jnp`` folds (delta error by norm within docs/semantics.md §6's tolerance,
   rows the reference leaves alone bit-identical, finite); a mismatch is
   reported loudly and makes the exit status 1;
3. compares the time with the byte floor: the bytes a perfect fold moves
   (distinct touched (adapter, expert) A/B blocks, ``x`` once, ``base_out``
   read and written once) over the copy bandwidth measured in the same run
   (an in-place read + write of a large buffer, timed the same way);
4. with ``--trace DIR``, profiles one more run of the timed program
   (``step_profile.kernel_times``) and reports the GPU kernel time per fold
   (``kernel_us``) and its kernels: the wall time per fold minus
   ``kernel_us`` is what launches and the gaps between kernels cost.

``ragged_dot`` is skipped where XLA's default (dense, zero-padded) lowering
would need more than ``--ragged-max-gib``; ``--ragged-pallas`` switches it to
JAX's Pallas Triton grouped matmul on GPU where this JAX has one.

It prints a table, and writes ``bench.json`` (one row per case and method,
rewritten after every case), ``bench.md`` (the table) and ``bench.png``
(% of floor against tokens) to ``--out``. ``--merge`` joins the
``bench.json`` of several runs (each row keeps the floor of its own run's
bandwidth) into one report without measuring anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from jax_moelora import _ext
from jax_moelora._optional import needs_extra

with needs_extra("bench", "jax_moelora.tools.bench"):
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                               TextColumn, TimeElapsedColumn)
    from rich.table import Table

from jax_moelora.tools import bench_methods as bm
from jax_moelora.tools.bench_cases import (DECODE_MAX_TOKENS, DECODE_TOKENS, MODELS, PREFILL_TOKENS,
                                     PROJECTIONS, Case, case_grid, case_floor_bytes, make_inputs,
                                     make_routing, parse_model)

__all__ = ["add_arguments", "run", "run_bench", "merge_runs", "Settings", "PROTOCOL_REPS",
           "PROTOCOL_RUNS", "ROW_FIELDS"]

PROTOCOL_REPS = 32      # docs/semantics.md §7: at least 32 folds per program
PROTOCOL_RUNS = 20      # docs/semantics.md §7: median of at least 20 runs

# --quick: a subset. On the CPU (no GPU) the prefill point and the repetition
# counts are scaled down so it finishes in a minute or two on two cores.
QUICK = dict(models=("Qwen3-30B-A3B",), projs=PROJECTIONS, ranks=(16,), adapters=(1, 4))
QUICK_TOKENS = {"gpu": (1, 64, 4096), "cpu": (1, 64, 320)}
QUICK_CPU_REPS, QUICK_CPU_RUNS, QUICK_CPU_WARMUP = 8, 3, 1

# Copy-bandwidth buffer and the ragged_dot dense-expansion limit, by platform.
BW_BYTES = {"gpu": 1 << 30, "cpu": 256 << 20}
RAGGED_MAX_BYTES = {"gpu": 16 << 30, "cpu": 64 << 20}

ROW_FIELDS = ("model", "proj", "tokens", "phase", "rank", "adapters", "method", "time_us",
              "floor_us", "pct_floor", "bytes", "bandwidth", "check", "check_err", "skipped",
              "error", "pairs", "rows", "reps", "runs", "unroll", "kernel_us", "span_us", "kernels",
              "launches")


@dataclasses.dataclass
class Settings:
    """Everything one benchmark run needs (the parsed command line)."""

    cases: list[Case]
    methods: tuple[str, ...]
    reps: int = PROTOCOL_REPS
    runs: int = PROTOCOL_RUNS
    warmup: int = 2
    unroll: int | None = None
    bw_bytes: int = BW_BYTES["cpu"]
    ragged_max_bytes: float = RAGGED_MAX_BYTES["cpu"]
    ragged_pallas: bool = False
    check: bool = True
    out: Path | None = Path("bench_out")
    plot: bool = True
    trace: Path | None = None


def _platform() -> str:
    return "gpu" if _ext.current_platform() == "gpu" else "cpu"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.replace(",", " ").split())


def _names(text: str) -> tuple[str, ...]:
    return tuple(v for v in text.replace(",", " ").split() if v)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--gemm", action="store_true",
                        help="benchmark the grouped expert GEMM (expert_matmul, with and without "
                             "LoRA, against lax.ragged_dot) instead of the folds; see "
                             "jax_moelora/tools/bench_gemm.py (projections gate_up and down)")
    parser.add_argument("--train", action="store_true",
                        help="benchmark training of the expert MLP and the MoEBlock instead of "
                             "the folds: forward, forward + backward w.r.t. the LoRA pools, their "
                             "ratio, %% of the flop and byte floors, peak memory; see "
                             "jax_moelora/tools/bench_train.py (--methods picks its programs, "
                             "--ragged-max-gib bounds its jnp check)")
    parser.add_argument("--quick", action="store_true",
                        help="a subset: Qwen gate/down, rank 16, 1 and 4 adapters, tokens "
                             "1, 64, 4096 (CPU: 1, 64, 320 and fewer reps/runs)")
    parser.add_argument("--models", type=_names, default=None,
                        help=f"models ({', '.join(MODELS)}; qwen/mixtral/deepseek; or a custom "
                             "name:experts:top_k:hidden:inter), comma-separated")
    parser.add_argument("--projs", type=_names, default=None,
                        help="of gate, down (the default) and router (the router's fold: "
                             "float32 pools, one table column, the gather fold at every T)")
    parser.add_argument("--tokens", type=_ints, default=None,
                        help=f"token counts (<= --decode-max-tokens: decode, gather fold; larger: "
                             f"prefill, grouped fold); default {DECODE_TOKENS + PREFILL_TOKENS}")
    parser.add_argument("--decode-max-tokens", type=int, default=DECODE_MAX_TOKENS,
                        help=f"the largest token count timed as a decode case (default "
                             f"{DECODE_MAX_TOKENS}); raise it to time the gather fold at prefill "
                             "sizes")
    parser.add_argument("--ranks", type=_ints, default=None, help="LoRA ranks (default 16,64)")
    parser.add_argument("--adapters", type=_ints, default=None,
                        help="adapters spread over the tokens (default 1,4)")
    parser.add_argument("--methods", type=_names, default=None,
                        help=f"of {', '.join(bm.ALL_METHODS)}, each also with {bm.COLD} (the "
                             "route rotated through copies larger than the L2); default: fast, "
                             "simple and the baselines on a GPU; cpu, jnp and the baselines on "
                             "the CPU")
    parser.add_argument("--reps", type=int, default=None,
                        help=f"folds per timed program (default {PROTOCOL_REPS})")
    parser.add_argument("--runs", type=int, default=None,
                        help=f"timed runs, median taken (default {PROTOCOL_RUNS})")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed runs first, the first one compiles and checks (default 2)")
    parser.add_argument("--unroll", type=int, default=None,
                        help="fori_loop unroll factor of the timed program (default: all reps "
                             "for the custom-call methods, 8 for the pure-JAX ones)")
    parser.add_argument("--list", action="store_true",
                        help="list the cases, methods and floors without timing anything")
    parser.add_argument("--bw-mib", type=float, default=None,
                        help="copy-bandwidth buffer in MiB (default 1024 on GPU, 256 on CPU)")
    parser.add_argument("--ragged-max-gib", type=float, default=None,
                        help="skip ragged_dot where its dense lowering needs more (default 16 "
                             "on GPU, 1/16 on CPU; 0: never skip)")
    parser.add_argument("--ragged-pallas", action="store_true",
                        help="lower ragged_dot with JAX's Pallas Triton grouped matmul on GPU")
    parser.add_argument("--seed", type=int, default=0, help="routing and data seed")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the correctness check against the jnp fold")
    parser.add_argument("--no-plot", action="store_true", help="do not write bench.png")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                        help="join the bench.json of several runs into one report in --out "
                             "(measures nothing; a later file's row replaces an earlier one "
                             "of the same case and method)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"),
                        help="output folder (default bench_out/)")
    parser.add_argument("--trace", type=Path, default=None, metavar="DIR",
                        help="profile one more run of each timed program into DIR and report "
                             "the GPU kernel time per fold, GEMM call or training step "
                             "(kernel_us) and its kernels")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Resolve defaults (platform, ``--quick``) into ``Settings``."""
    plat = _platform()
    quick = bool(args.quick)
    models = args.models or (QUICK["models"] if quick else tuple(MODELS))
    projs = args.projs or PROJECTIONS
    tokens = args.tokens or (QUICK_TOKENS[plat] if quick else DECODE_TOKENS + PREFILL_TOKENS)
    ranks = args.ranks or (QUICK["ranks"] if quick else (16, 64))
    adapters = args.adapters or QUICK["adapters"]
    methods = args.methods or bm.default_methods()
    for m in methods:
        if not bm.is_method(m):
            raise ValueError(f"unknown method {m!r}; known: {', '.join(bm.ALL_METHODS)} "
                             f"(each also with {bm.COLD}: a cold L2)")
    small = quick and plat == "cpu"
    reps = args.reps or (QUICK_CPU_REPS if small else PROTOCOL_REPS)
    runs = args.runs or (QUICK_CPU_RUNS if small else PROTOCOL_RUNS)
    if reps < 1 or runs < 1:
        raise ValueError("--reps and --runs must be positive")
    bw = int(args.bw_mib * 2**20) if args.bw_mib else BW_BYTES[plat]
    ragged = (args.ragged_max_gib * 2**30 if args.ragged_max_gib is not None
              else RAGGED_MAX_BYTES[plat])
    if args.decode_max_tokens < 0:
        raise ValueError("--decode-max-tokens must be >= 0")
    cases = case_grid([parse_model(m) for m in models], projs, tokens, ranks, adapters,
                      seed=args.seed, decode_max_tokens=args.decode_max_tokens)
    warmup = args.warmup or (QUICK_CPU_WARMUP if small else 2)
    return Settings(cases=cases, methods=tuple(methods), reps=reps, runs=runs,
                    warmup=max(1, warmup), unroll=args.unroll, bw_bytes=bw,
                    ragged_max_bytes=0.0 if args.ragged_pallas else ragged,
                    ragged_pallas=bool(args.ragged_pallas), check=not args.no_check,
                    out=args.out, plot=not args.no_plot, trace=args.trace)


def _unroll(s: Settings, method: str) -> int:
    """The unroll factor of ``method``'s timed loop: ``--unroll``, else every
    rep for the custom calls (no loop overhead at all), 8 for pure JAX."""
    if s.unroll:
        return max(1, min(s.unroll, s.reps))
    return s.reps if bm.base_method(method) in bm.CUSTOM_CALL_METHODS else min(8, s.reps)


def _row(case: Case, method: str, nbytes: dict, bandwidth: float, s: Settings) -> dict:
    floor_s = nbytes["total"] / bandwidth
    return {"model": case.model.name, "proj": case.proj, "tokens": case.tokens,
            "phase": case.phase, "rank": case.rank, "adapters": case.adapters, "method": method,
            "time_us": None, "floor_us": floor_s * 1e6, "pct_floor": None,
            "bytes": nbytes["total"], "bandwidth": bandwidth, "check": None, "check_err": None,
            "skipped": None, "error": None, "pairs": nbytes["pairs"], "rows": case.n_rows,
            "reps": s.reps, "runs": s.runs, "unroll": _unroll(s, method), "kernel_us": None,
            "span_us": None, "kernels": None, "launches": None}


def _bench_case(case: Case, s: Settings, bandwidth: float, progress: Progress, task,
                console: Console) -> list[dict]:
    """Check and time every method on one case's inputs.

    The check compares the first (untimed) run of each method's program,
    ``reps`` folds of ``base_out``, with the same program of the ``jnp``
    fold: one compile per method serves both.
    """
    inputs = make_inputs(case)
    base = inputs.base_out
    loops: dict[str, Any] = {}
    ref = None
    if s.check:
        progress.update(task, description=f"{case.label} [bold]jnp reference[/]")
        try:
            loops["jnp"] = bm.make_loop(bm.make_fold("jnp", case), s.reps, _unroll(s, "jnp"))
            ref = jax.block_until_ready(loops["jnp"](jnp.copy(base), inputs.args))
        except Exception as err:  # noqa: BLE001 - the methods still run, unchecked
            console.print(f"[red]error[/] {case.label}: the jnp reference failed, methods are "
                          f"unchecked: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
    rows = []
    for method in s.methods:
        progress.update(task, description=f"{case.label} [bold]{method}[/]")
        row = _row(case, method, inputs.bytes, bandwidth, s)
        reason = bm.skip_reason(method, case, ragged_max_bytes=s.ragged_max_bytes)
        if reason:
            row["skipped"] = reason
        else:
            def first(out, row=row, method=method):
                if ref is None:
                    return
                if method == "jnp":
                    row["check"], row["check_err"] = "ref", 0.0
                    return
                chk = bm.compare(out, ref, base)
                row["check"] = "ok" if chk["ok"] else "MISMATCH"
                row["check_err"] = chk["err"]

            try:
                args = bm.prepare_args(method, inputs)
                loop = loops.get(method) or bm.make_loop(
                    bm.make_fold(method, case), s.reps, _unroll(s, method),
                    cold=method.endswith(bm.COLD))
                t = bm.time_loop(loop, base, args, reps=s.reps, runs=s.runs, warmup=s.warmup,
                                 first=first)
                row["time_us"] = t * 1e6
                row["pct_floor"] = 100.0 * row["floor_us"] / row["time_us"]
                if s.trace is not None:
                    _trace_row(row, loop, base, args, s, case, method)
                del args, loop
            except Exception as err:  # noqa: BLE001 - reported per row, the run goes on
                row["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
                console.print(f"[red]error[/] {case.label} {method}: {row['error']}")
            if row["check"] == "MISMATCH":
                console.print(f"[bold red]MISMATCH[/] {case.label} {method}: delta error "
                              f"{row['check_err']:.3g} against the jnp fold")
        rows.append(row)
        progress.advance(task)
    return rows


def _trace_row(row: dict, loop, base: jax.Array, args: Any, s: Settings, case: Case,
               method: str) -> None:
    """``row["kernel_us"]``: GPU kernel time per fold in one traced run of
    ``loop`` (the copy of ``base_out`` that the run starts from included, 1 /
    ``reps`` of it), and ``row["kernels"]``: µs per fold of each kernel."""
    from jax_moelora.tools.step_profile import trace_into

    slug = f"{case.label}-{method}".replace(" ", "_").replace("=", "").replace("@", "_")
    trace_into(row, lambda: loop(jnp.copy(base), args), calls=s.reps, folder=s.trace / slug)


def _fmt(v: float | None, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:,.{digits}f}"


def _status(row: dict) -> str:
    if row["skipped"]:
        return "skipped"
    if row["error"]:
        return "ERROR"
    return row["check"] or "unchecked"


def make_table(rows: Sequence[dict], title: str = "") -> Table:
    """The rich table of ``rows``: one line per case and method."""
    table = Table(title=title or None, show_lines=False, header_style="bold")
    for name, just in (("model", "left"), ("proj", "left"), ("phase", "left"), ("T", "right"),
                       ("R", "right"), ("L", "right"), ("method", "left"),
                       ("time µs", "right"), ("floor µs", "right"), ("% floor", "right"),
                       ("check", "left")):
        table.add_column(name, justify=just)
    prev = None
    for r in rows:
        key = (r["model"], r["proj"], r["tokens"], r["rank"], r["adapters"])
        if prev is not None and key != prev:
            table.add_section()
        status = _status(r)
        style = {"MISMATCH": "bold red", "ERROR": "red", "skipped": "dim"}.get(status, "")
        status_txt = status
        if status == "MISMATCH":
            status_txt = f"✗ MISMATCH (err {r['check_err']:.2g})"
        elif status == "ok" and r["check_err"]:
            status_txt = f"ok ({r['check_err']:.1g})"
        table.add_row(*(str(v) for v in (r["model"] if key != prev else "",
                                          r["proj"] if key != prev else "",
                                          r["phase"] if key != prev else "",
                                          r["tokens"], r["rank"], r["adapters"])),
                      r["method"], _fmt(r["time_us"], 2), _fmt(r["floor_us"], 2),
                      _fmt(r["pct_floor"]), status_txt, style=style)
        prev = key
    return table


def markdown_table(rows: Sequence[dict]) -> str:
    """The rows as a Markdown table (for notes and the README)."""
    traced = any(r.get("kernel_us") for r in rows)  # a `kernel µs` column (--trace)
    head = ("| model | proj | phase | T | R | L | method | time µs | floor µs | % floor "
            + ("| kernel µs " if traced else "") + "| check |\n|---|---|---|---:|---:|---:|---|"
            "---:|---:|---:|" + ("---:|" if traced else "") + "---|")
    lines = [head]
    for r in rows:
        kern = f" {_fmt(r.get('kernel_us'), 2)} |" if traced else ""
        lines.append(f"| {r['model']} | {r['proj']} | {r['phase']} | {r['tokens']} | {r['rank']} "
                     f"| {r['adapters']} | {r['method']} | {_fmt(r['time_us'], 2)} | "
                     f"{_fmt(r['floor_us'], 2)} | {_fmt(r['pct_floor'])} |{kern} {_status(r)} |")
    return "\n".join(lines) + "\n"


def _meta(s: Settings, bandwidth: float) -> dict[str, Any]:
    dev = jax.devices()[0]
    return {"device": f"{dev.platform}: {dev.device_kind}", "platform": _platform(),
            "jax": jax.__version__, "python": platform.python_version(),
            "bandwidth": bandwidth, "bandwidth_buffer_bytes": s.bw_bytes, "reps": s.reps,
            "runs": s.runs, "warmup": s.warmup, "unroll": s.unroll or "auto",
            "methods": list(s.methods),
            "ragged_pallas": s.ragged_pallas, "ragged_max_bytes": s.ragged_max_bytes,
            "backends": _ext.backends(), "dtype": "bfloat16",
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _case_line(rows: Sequence[dict]) -> str:
    """One line per finished case (a log that survives an interrupted run)."""
    r0 = rows[0]
    parts = []
    for r in rows:
        if r["time_us"] is not None:
            flag = "" if r["check"] in ("ok", "ref", None) else f" [bold red]{r['check']}[/]"
            kern = f", kernels {r['kernel_us']:,.2f} µs" if r.get("kernel_us") else ""
            parts.append(f"{r['method']} {r['time_us']:,.2f} µs ({r['pct_floor']:.0f}%{kern}){flag}")
        else:
            parts.append(f"{r['method']} {_status(r)}")
    return (f"{r0['model']} {r0['proj']} T={r0['tokens']} R={r0['rank']} L={r0['adapters']} "
            f"floor {r0['floor_us']:,.2f} µs: " + ", ".join(parts))


def run_bench(s: Settings, console: Console | None = None) -> tuple[list[dict], dict]:
    """Measure the bandwidth, then every case and method; returns ``(rows, meta)``.

    With ``s.out`` set, ``bench.json`` is rewritten after every case, so an
    interrupted run keeps what it measured.
    """
    console = console or Console()
    if s.ragged_pallas and "ragged_dot" in s.methods:
        if not bm.use_pallas_ragged_dot():
            console.print("[yellow]--ragged-pallas: this JAX has no Pallas ragged_dot lowering; "
                          "using the default one[/]")
    if s.reps < PROTOCOL_REPS or s.runs < PROTOCOL_RUNS:
        console.print(f"[yellow]note:[/] {s.reps} reps x {s.runs} runs is below the protocol of "
                      f"docs/semantics.md §7 ({PROTOCOL_REPS} x {PROTOCOL_RUNS}): a smoke run")
    rows: list[dict] = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("copy bandwidth", total=len(s.cases) * len(s.methods))
        bandwidth = bm.measure_bandwidth(s.bw_bytes, reps=s.reps, runs=s.runs, warmup=s.warmup)
        console.print(f"copy bandwidth: [bold]{bandwidth / 1e9:,.1f} GB/s[/] (read + write, "
                      f"{s.bw_bytes / 2**20:,.0f} MiB buffer) on {jax.devices()[0].device_kind}")
        meta = _meta(s, bandwidth)
        for case in s.cases:
            case_rows = _bench_case(case, s, bandwidth, progress, task, console)
            rows.extend(case_rows)
            console.print(_case_line(case_rows), highlight=False)
            if s.out is not None:
                write_json(rows, meta, s.out)
    return rows, meta


def merge_runs(paths: Sequence[Path]) -> tuple[list[dict], dict]:
    """The rows of several ``bench.json`` files and a meta that lists the runs.

    Rows keep their own ``bandwidth`` and ``pct_floor`` (docs/semantics.md §7: the floor
    of a row comes from the bandwidth measured in its run). A later file's
    row replaces an earlier one of the same case (phase included) and method;
    the order of first appearance is kept.
    """
    if not paths:
        raise ValueError("--merge needs at least one bench.json")
    merged: dict[tuple, dict] = {}
    runs, metas = [], []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
            rows, meta = data["rows"], data["meta"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: not a bench.json ({err})") from None
        metas.append(meta)
        runs.append({"file": str(path), "rows": len(rows),
                     **{k: meta.get(k) for k in ("device", "bandwidth", "reps", "runs", "time")}})
        for r in rows:
            merged[tuple(r.get(k) for k in ("model", "proj", "tokens", "phase", "rank",
                                            "adapters", "method"))] = r
    bws = [r["bandwidth"] for r in runs if r["bandwidth"]]
    meta = {**metas[0], "merged": runs,
            "bandwidth": min(bws) if bws else 0.0, "bandwidth_max": max(bws) if bws else 0.0}
    return list(merged.values()), meta


def _bandwidth_text(meta: dict, short: bool = False) -> str:
    if meta.get("merged"):
        return (f"{len(meta['merged'])} runs, copy bandwidth {meta['bandwidth'] / 1e9:,.1f}-"
                f"{meta['bandwidth_max'] / 1e9:,.1f} GB/s"
                + ("" if short else " (each row against its own run's)"))
    return f"copy bandwidth {meta['bandwidth'] / 1e9:,.1f} GB/s"


def write_json(rows: list[dict], meta: dict, out: Path) -> Path:
    """Write ``{"meta", "rows"}`` to ``out/bench.json``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    tmp.replace(path)
    return path


def write_outputs(rows: list[dict], meta: dict, out: Path, plot: bool = True) -> list[Path]:
    """Write ``bench.json``, ``bench.md`` and (``plot``) ``bench.png`` to ``out``."""
    paths = [write_json(rows, meta, out), out / "bench.md"]
    text = _bandwidth_text(meta)
    paths[1].write_text(f"{text[0].upper()}{text[1:]} on {meta['device']}, "
                        f"{meta['reps']} folds x {meta['runs']} runs.\n\n"
                        + markdown_table(rows))
    if plot:
        from jax_moelora.tools.bench_plot import plot_rows

        title = f"{meta['device']} ({_bandwidth_text(meta, short=True)})"
        paths.append(plot_rows(rows, out / "bench.png", title=title))
    return paths


def list_cases(s: Settings, console: Console) -> None:
    """Print the grid: each case's floor bytes, and which methods it skips."""
    table = Table(title=f"{len(s.cases)} cases x {len(s.methods)} methods", header_style="bold")
    for name in ("case", "rows", "pairs", "floor MB", "skipped"):
        table.add_column(name)
    for case in s.cases:
        topk, ra = make_routing(case)
        nb = case_floor_bytes(case, topk, ra)
        skips = [m for m in s.methods
                 if bm.skip_reason(m, case, ragged_max_bytes=s.ragged_max_bytes)]
        table.add_row(case.label, str(case.n_rows), str(nb["pairs"]),
                      f"{nb['total'] / 1e6:,.2f}", ", ".join(skips))
    console.print(table)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m jax_moelora bench``; 1 on any mismatch or error."""
    console = Console() if sys.stdout.isatty() else Console(width=150)
    if getattr(args, "train", False):
        if getattr(args, "gemm", False):
            console.print("[red]bench:[/] --train and --gemm are separate benchmarks")
            return 2
        from jax_moelora.tools import bench_train

        return bench_train.run(args)
    if getattr(args, "gemm", False):
        from jax_moelora.tools import bench_gemm

        return bench_gemm.run(args)
    if args.merge:
        try:
            rows, meta = merge_runs(args.merge)
        except ValueError as err:
            console.print(f"[red]bench --merge:[/] {err}")
            return 2
        console.print(make_table(rows, title=f"MoE LoRA folds on {meta['device']}, "
                                             f"{_bandwidth_text(meta)}"))
        for p in write_outputs(rows, meta, args.out, not args.no_plot):
            console.print(f"wrote {p}")
        return 0
    try:
        s = settings_from_args(args)
    except ValueError as err:
        console.print(f"[red]bench:[/] {err}")
        return 2
    if args.list:
        list_cases(s, console)
        return 0
    console.print(f"{len(s.cases)} cases x {len(s.methods)} methods ({', '.join(s.methods)}), "
                  f"{s.reps} folds per program, median of {s.runs} runs")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        rows, meta = run_bench(s, console)
    written = write_outputs(rows, meta, s.out, s.plot) if s.out is not None else []
    console.print(make_table(rows, title=f"MoE LoRA folds on {meta['device']}, bf16, "
                                         f"copy {meta['bandwidth'] / 1e9:,.1f} GB/s"))
    for p in written:
        console.print(f"wrote {p}")
    bad = [r for r in rows if r["check"] == "MISMATCH" or r["error"]]
    if bad:
        console.print(f"[bold red]{len(bad)} method(s) failed the check or raised[/]")
        return 1
    return 0
