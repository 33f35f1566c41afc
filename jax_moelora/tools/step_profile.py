"""Kernel time per name in a jitted program, from a JAX profiler trace.

``kernel_times(fn, *args, calls=...)`` runs ``fn(*args)`` under
``jax.profiler.trace`` (with a Perfetto trace), then sums the duration of
every GPU kernel by name and divides by ``calls``: the device time each kernel
costs per call, and the wall span from the first kernel's start to the last
one's end. ``demo --timing --trace DIR`` uses it to split a decode step into
its kernels (the LoRA folds, the router, XLA's fusions around them), and
``overhead_split`` to split what LoRA adds to a step.
"""

from __future__ import annotations

import collections
import gzip
import json
from pathlib import Path
from typing import Any, Callable

import jax

__all__ = ["kernel_times", "overhead_split", "read_trace", "trace_into", "top_kernels",
           "short_name", "LIBRARY_KERNEL_MARK"]

#: A substring of the name of every kernel of this library (its C++ namespace).
LIBRARY_KERNEL_MARK = "moelora::"


def read_trace(folder: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The GPU kernel events (``name``, ``ts``, ``dur`` in µs) of the newest
    trace under ``folder``: events of the processes named after a GPU, on the
    threads named after a stream; and the names of every traced process."""
    files = sorted(Path(folder).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    files += sorted(Path(folder).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no trace (*.trace.json.gz) under {folder}")
    with gzip.open(files[-1], "rt") as f:
        events = json.load(f).get("traceEvents", [])
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = str(e.get("args", {}).get("name", ""))
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    gpu = {pid for pid, name in procs.items() if "GPU" in name or "gpu" in name}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu]
    streams = [e for e in kernels if "Stream" in threads.get((e["pid"], e.get("tid")), "")]
    return ([{"name": e["name"], "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0))}
             for e in (streams or kernels)], sorted(procs.values()))


def kernel_times(fn: Callable, *args: Any, calls: int, folder: str | Path) -> dict[str, Any]:
    """Run ``fn(*args)`` (compiled beforehand by the caller) under the profiler.

    Returns ``{"per_call_us": {name: µs}, "total_us": µs, "span_us": µs,
    "count": {name: launches per call}, "processes": [traced process names]}``,
    every figure divided by ``calls`` (the number of steps ``fn`` runs); no
    kernels when no GPU process was traced."""
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        jax.block_until_ready(fn(*args))
    events, processes = read_trace(folder)
    if not events:
        return {"per_call_us": {}, "total_us": 0.0, "span_us": 0.0, "count": {},
                "processes": processes}
    dur, count = collections.Counter(), collections.Counter()
    for e in events:
        dur[e["name"]] += e["dur"]
        count[e["name"]] += 1
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    return {"per_call_us": {k: v / calls for k, v in dur.most_common()},
            "total_us": sum(dur.values()) / calls, "span_us": span / calls,
            "count": {k: v / calls for k, v in count.items()}, "processes": processes}


def short_name(name: str, width: int = 80) -> str:
    """``name`` cut to ``width`` characters, its head and its tail kept: the
    mangled names of two CUTLASS kernels share a long head (the kernel
    template) and differ in their tail (the configuration)."""
    if len(name) <= width:
        return name
    tail = width // 4
    return f"{name[:width - tail - 3]}...{name[-tail:]}"


def trace_into(row: dict[str, Any], fn: Callable[[], Any], *, calls: int,
               folder: str | Path) -> None:
    """Profile one more run of ``fn()`` (``calls`` steps, compiled beforehand)
    into ``folder``: ``row["kernel_us"]``, the GPU kernel time per step,
    ``row["span_us"]``, the wall time from the first kernel's start to the
    last one's end per step, ``row["kernels"]``, µs per step of each kernel,
    and ``row["launches"]``, its launches per step (names by
    :func:`short_name`). ``row`` is left as it is when no GPU kernel was
    traced."""
    prof = kernel_times(fn, calls=calls, folder=folder)
    if prof["per_call_us"]:
        kernels: dict[str, float] = collections.Counter()
        launches: dict[str, float] = collections.Counter()
        for name, us in prof["per_call_us"].items():  # names equal when cut: one sum
            kernels[short_name(name)] += us
            launches[short_name(name)] += prof["count"].get(name, 0.0)
        row["kernel_us"] = prof["total_us"]
        row["span_us"] = prof["span_us"]
        row["kernels"] = {k: round(v, 3) for k, v in kernels.items()}
        row["launches"] = {k: round(v, 3) for k, v in launches.items()}


def top_kernels(row: dict[str, Any], n: int = 12) -> str:
    """The ``n`` longest kernels of a :func:`trace_into` row, one ``µs  name``
    line each (empty without a trace)."""
    kernels = sorted((row.get("kernels") or {}).items(), key=lambda kv: -kv[1])[:n]
    return "".join(f"  {us:9.2f} µs  {name}\n" for name, us in kernels)


def overhead_split(base: dict[str, Any], lora: dict[str, Any]) -> dict[str, Any]:
    """What a variant with LoRA adds to a step over the base variant, from two
    ``kernel_times`` profiles of one step each.

    Returns ``{"kernels_us": added kernel time, "library_us": the library's
    kernels (names with ``LIBRARY_KERNEL_MARK``), "xla_us": the rest of the
    added kernel time (XLA's ops around the folds; negative when XLA's own
    kernels got faster), "gaps_us": {"base": span - kernels, "lora": ...}
    (idle time between the kernels), "library": {name: µs}}``, µs per step."""
    lib = {k: v for k, v in lora["per_call_us"].items() if LIBRARY_KERNEL_MARK in k}
    added = lora["total_us"] - base["total_us"]
    library = sum(lib.values()) - sum(v for k, v in base["per_call_us"].items()
                                      if LIBRARY_KERNEL_MARK in k)
    return {"kernels_us": added, "library_us": library, "xla_us": added - library,
            "gaps_us": {"base": base["span_us"] - base["total_us"],
                        "lora": lora["span_us"] - lora["total_us"]},
            "library": lib}
