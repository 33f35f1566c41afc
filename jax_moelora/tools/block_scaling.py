"""Scaling of ``MoEBlock`` on a mesh: weak and strong scaling of decode and
prefill steps, the collectives' bytes per step, and the cost model of
``docs/scaling.md``.

``python -m jax_moelora.tools.scaling --block [--small] [--json PATH]`` on a
machine with at least 2 devices (2 H200s; ``--small`` also runs on CPU
devices, ``XLA_FLAGS=--xla_force_host_platform_device_count=2``). The
experts are split over an expert axis of ``D`` devices (1, 2, 4, ... up to
the devices present); each case times a jitted program that runs the block
``--reps`` times back to back (its output is the next call's input), median
of ``--runs`` runs after warm-up, and reports per step:

- weak scaling: ``D`` devices on ``D x`` the tokens of one device:
  ``throughput_ratio = (D T / t_D) / (T / t_1)`` (``D`` is perfect);
- strong scaling: the same tokens on 1 and on ``D`` devices:
  ``speedup = t_1 / t_D``;
- ``collective_bytes``: the bytes each collective of one call moves per
  device (from the compiled program: the all-to-all buffers, the psums),
  ``wire_bytes`` (the part that leaves the device) and the model's
  prediction (:func:`dispatch_bytes`), whose ratio the criterion bounds
  (XLA:CPU runs bf16 collectives in f32: twice the bytes on CPU devices);
- ``bit_identical``: the sharded block's output on the global batch against
  the one-device block's on the experts' owners' path (``expert_path=
  "ragged"``); a capacity factor may drop rows, which this reports too.

Variants of the dispatch (:data:`VARIANTS`): ``exact`` (the default
capacity, every row a device holds per destination; ``exact_x4`` in four
pieces), ``cf2``
(``capacity_factor=2``), ``cf1.25x4`` (``capacity_factor=1.25`` and
``dispatch_chunks=4``: four pieces whose exchanges can overlap the others'
expert work) and, on GPUs, ``ragged`` and ``ragged_x4``
(``ragged_all_to_all``, exact; the second in four pieces).

``python -m jax_moelora.tools.block_scaling --model [--calibrate JSON]``
prints the model's step times at 8, 64 and 256 GPUs (:func:`model_table`),
with the constants of :class:`Hardware`, or refitted to a ``--block --json``
measurement of 1 and 2 GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jax_moelora.nnx import MoEBlock, shard_block
from jax_moelora.ops.dispatch import capacity
from jax_moelora.ops.sharding import put_global
from jax_moelora.tools.scaling import median_seconds

__all__ = ["Hardware", "ModelShape", "SHAPES", "VARIANTS", "dispatch_bytes", "step_time", "model_table",
           "hlo_collective_bytes", "run_block_cases", "main"]

DT = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """One MoE layer: experts ``E``, ``top_k``, ``hidden`` ``H``, expert
    width ``inter`` ``I``; LoRA ``rank`` and adapter slots ``loras``;
    ``dtype_bytes`` of the activations and weights."""

    name: str
    E: int
    top_k: int
    hidden: int
    inter: int
    rank: int = 16
    loras: int = 4
    dtype_bytes: int = 2


#: dispatch variants: name -> MoEBlock / shard_block options
VARIANTS = {
    "exact": {},
    "exact_x4": {"dispatch_chunks": 4},
    "cf2": {"capacity_factor": 2.0},
    "cf1.25x4": {"capacity_factor": 1.25, "dispatch_chunks": 4},
    "ragged": {"exchange": "ragged_all_to_all"},
    "ragged_x4": {"exchange": "ragged_all_to_all", "dispatch_chunks": 4},
}

SHAPES = {
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 128, 8, 2048, 768),
    "deepseek-v3": ModelShape("deepseek-v3", 256, 8, 7168, 2048),
    "small": ModelShape("small", 8, 2, 64, 32, rank=8, loras=2),
}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The model's machine: H200 GPUs, ``gpus_per_node`` to an NVLink domain.

    ``nvlink_gbs``: NVLink 4, 900 GB/s per GPU in both directions together,
    450 GB/s each way (an all-to-all sends and receives at once);
    ``ib_gbs``: InfiniBand NDR, 400 Gb/s = 50 GB/s per GPU each way (one
    NIC per GPU); ``link_eff``: the share of a link's bandwidth an
    all-to-all reaches; ``alpha_*``: a collective's fixed latency plus
    ``alpha_peer`` per peer (NCCL's all-to-all posts a send and a receive
    per peer); ``hbm_gbs``, ``hbm_eff``: HBM3e 4.8 TB/s; ``flops``,
    ``gemm_eff``: bf16 dense tensor-core peak and the grouped GEMM's share
    of it; ``lora_factor``: the LoRA folds' time as a share of the GEMMs'
    at prefill; ``row_s``: time per row of a device's buffers (router,
    sorts, gathers, activation, weighted sum: work over every row the owner
    holds, padding included); ``fixed_s``: per call (launches). Defaults:
    the link and latency terms assumed; the compute terms fitted to one
    H200 running 4 Qwen3-30B-A3B layers with 4 adapters (README: decode
    T = 64, 0.40 ms a layer; prefill T = 4096, 1.59 ms a layer; the GEMMs
    alone at 40 % of the bf16 peak, LoRA + 39 %). :func:`calibrate`
    refits them to a measurement."""

    gpus_per_node: int = 8
    nvlink_gbs: float = 450.0
    ib_gbs: float = 50.0
    link_eff: float = 0.7
    alpha_nvlink_s: float = 10e-6
    alpha_ib_s: float = 25e-6
    alpha_peer_s: float = 0.5e-6
    hbm_gbs: float = 4800.0
    hbm_eff: float = 0.7
    flops: float = 989e12
    gemm_eff: float = 0.4
    lora_factor: float = 0.39
    row_s: float = 15e-9
    fixed_s: float = 40e-6


def dispatch_bytes(shape: ModelShape, devices: int, tokens: int, *,
                   capacity_factor: float | None = None, exchange: str = "all_to_all",
                   sent_rows: float | None = None) -> dict[str, float]:
    """Bytes one device moves per block call under expert parallelism.

    ``tokens`` per device, ``n = tokens * top_k`` rows, ``C`` rows a block
    (``ops.dispatch.capacity``). Three exchanges: the rows' activations
    ``H`` out, their expert and adapter ids (8 bytes) out, the expert
    outputs ``H`` back. ``all_to_all`` moves whole blocks: ``D * C`` rows
    each way, ``(D - 1) * C`` of them over links; ``ragged_all_to_all``
    only the rows: ``sent_rows`` off the device (default ``n (D - 1) /
    D``, routing spread evenly), plus the ``D`` int32 counts.

    Returns ``{"buffer": ..., "wire": ..., "collectives": ...}``: bytes of
    the buffers, of the part that leaves the device, and the number of
    collectives.
    """
    n = tokens * shape.top_k
    row = 2 * shape.hidden * shape.dtype_bytes + 8
    if devices == 1:
        return {"buffer": 0.0, "wire": 0.0, "collectives": 0}
    c = capacity(n, devices, capacity_factor)
    if exchange == "all_to_all":
        return {"buffer": float(devices * c * row), "wire": float((devices - 1) * c * row),
                "collectives": 3}
    sent = n * (devices - 1) / devices if sent_rows is None else sent_rows
    return {"buffer": float(devices * c * row), "wire": float(sent * row + 8 * devices),
            "collectives": 4}


def _comm_time(wire: float, collectives: int, devices: int, hw: Hardware) -> float:
    """Seconds of the exchanges: the bytes to peers in the node over NVLink,
    to the others over InfiniBand (concurrently), plus the latencies."""
    if devices == 1:
        return 0.0
    peers = devices - 1
    local = min(peers, hw.gpus_per_node - 1)
    t_nv = wire * local / peers / (hw.nvlink_gbs * 1e9 * hw.link_eff)
    t_ib = wire * (peers - local) / peers / (hw.ib_gbs * 1e9 * hw.link_eff)
    alpha = hw.alpha_nvlink_s if devices <= hw.gpus_per_node else hw.alpha_ib_s
    return max(t_nv, t_ib) + collectives * (alpha + hw.alpha_peer_s * peers)


def _compute_time(shape: ModelShape, devices: int, tokens: int, hw: Hardware,
                  buffer_rows: float | None = None) -> float:
    """Seconds of one device's expert work: its ``E / D`` experts' weights
    and adapters read once (decode is bound by it) or its rows' GEMM flops
    with the LoRA folds (prefill), whichever is longer; plus ``row_s`` per
    row of its buffers (``buffer_rows``, default the rows it holds) and
    ``fixed_s``."""
    e_d = shape.E / devices
    rows = tokens * shape.top_k  # received rows, routing spread evenly
    H, I, R = shape.hidden, shape.inter, shape.rank
    weights = e_d * 3 * H * I * shape.dtype_bytes
    lora = e_d * shape.loras * 3 * R * (H + I) * shape.dtype_bytes
    t_mem = (weights + lora) / (hw.hbm_gbs * 1e9 * hw.hbm_eff)
    t_flop = 2 * rows * 3 * H * I / (hw.flops * hw.gemm_eff) * (1 + hw.lora_factor)
    held = rows if buffer_rows is None else max(rows, buffer_rows)
    return max(t_mem, t_flop) + held * hw.row_s + hw.fixed_s


def step_time(shape: ModelShape, devices: int, tokens: int, hw: Hardware = Hardware(), *,
              capacity_factor: float | None = None, exchange: str = "all_to_all",
              dispatch_chunks: int = 1) -> dict[str, float]:
    """The model of one block call with ``tokens`` per device on ``devices``
    (expert axis ``D``). One piece: compute, then the exchanges, no overlap;
    ``P = dispatch_chunks`` pieces: the longer of the two plus ``1 / P`` of
    the shorter (a pipeline's fill), each piece paying the latencies.
    Returns seconds (``compute``, ``comm``, ``total``) and the bytes."""
    P = dispatch_chunks
    b = dispatch_bytes(shape, devices, tokens // P, capacity_factor=capacity_factor,
                       exchange=exchange)
    b = {k: v * P for k, v in b.items()}
    held = None
    if devices > 1:
        held = P * devices * capacity(tokens // P * shape.top_k, devices, capacity_factor)
    comp = _compute_time(shape, devices, tokens, hw, held)
    comm = _comm_time(b["wire"], b["collectives"], devices, hw)
    total = comp + comm if P == 1 else max(comp, comm) + min(comp, comm) / P
    return {"compute": comp, "comm": comm, "total": total, **b}


def model_table(hw: Hardware = Hardware(), gpus=(8, 64, 256)) -> list[dict[str, Any]]:
    """Predicted weak scaling at ``gpus``: decode (64 tokens a GPU) and
    prefill (4096 a GPU), for Qwen3-30B-A3B (up to its 128 experts) and
    DeepSeek-V3, each dispatch variant. ``efficiency = t_1 / t_D`` (one GPU
    on its share of the tokens with every expert, where they fit)."""
    rows = []
    for shape in (SHAPES["qwen3-30b-a3b"], SHAPES["deepseek-v3"]):
        for phase, tokens in (("decode", 64), ("prefill", 4096)):
            one = step_time(shape, 1, tokens, hw)["total"]
            for d in gpus:
                if d > shape.E:
                    continue
                for variant, kw in VARIANTS.items():
                    t = step_time(shape, d, tokens, hw, **kw)
                    rows.append({"model": shape.name, "phase": phase, "gpus": d,
                                 "variant": variant, "tokens_per_gpu": tokens,
                                 "compute_us": t["compute"] * 1e6, "comm_us": t["comm"] * 1e6,
                                 "step_us": t["total"] * 1e6,
                                 "wire_mb": t["wire"] / 1e6, "efficiency": one / t["total"]})
    return rows


def calibrate(rows: list[dict[str, Any]], hw: Hardware = Hardware()) -> Hardware:
    """``hw`` refitted to a ``--block`` measurement's weak-scaling rows (1
    and 2 devices, exact dispatch): ``gemm_eff`` from the 1-device prefill
    step and ``fixed_s`` from the 1-device decode step (the other compute
    terms as they are), then ``link_eff`` from the 2-device steps' time
    beyond the model's compute and latencies, over their bytes."""
    by = {(r["phase"], r["devices"], r["variant"]): r for r in rows if r["kind"] == "weak"}
    shape = SHAPES[rows[0]["shape"]]
    dec1, pre1 = by.get(("decode", 1, "exact")), by.get(("prefill", 1, "exact"))
    if dec1 is None or pre1 is None:
        raise ValueError("calibrate: the rows lack the 1-device decode and prefill steps")
    n = pre1["tokens_per_device"] * shape.top_k
    rest = n * hw.row_s + hw.fixed_s
    gemm = max(pre1["t_us"] * 1e-6 - rest, 1e-9) / (1 + hw.lora_factor)
    hw = dataclasses.replace(hw, gemm_eff=min(1.0, 2 * n * 3 * shape.hidden * shape.inter
                                              / hw.flops / gemm))
    t_dec = _compute_time(shape, 1, dec1["tokens_per_device"], hw) - hw.fixed_s
    hw = dataclasses.replace(hw, fixed_s=max(dec1["t_us"] * 1e-6 - t_dec, 0.0))
    extra, wire = [], []
    for phase in ("decode", "prefill"):
        r = by.get((phase, 2, "exact"))
        if r is not None:
            held = 2 * r["tokens_per_device"] * shape.top_k
            comp = _compute_time(shape, 2, r["tokens_per_device"], hw, held)
            lat = 3 * (hw.alpha_nvlink_s + hw.alpha_peer_s)
            extra.append(max(r["t_us"] * 1e-6 - comp - lat, 1e-9))
            wire.append(r["wire_bytes"])
    if extra:
        eff = sum(wire) / sum(extra) / (hw.nvlink_gbs * 1e9)
        hw = dataclasses.replace(hw, link_eff=min(1.0, eff))
    return hw


_SHAPE_RE = re.compile(r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_COLLECTIVES = ("ragged-all-to-all", "all-to-all", "all-reduce", "all-gather",
                "reduce-scatter", "collective-permute")


def hlo_collective_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes of each kind of collective in a compiled program's HLO text
    (the result shapes of the ops, once each: a loop body counts once).
    ``-start``/``-done`` pairs count once."""
    out: dict[str, int] = {}
    for line in hlo_text.splitlines():
        if "=" not in line:
            continue
        lhs, rhs = line.split("=", 1)
        op = next((c for c in _COLLECTIVES if re.search(rf"\s{c}(-start)?\(", rhs)), None)
        if op is None:
            continue
        result = rhs.split(op)[0]
        nbytes = sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
                     for t, dims in _SHAPE_RE.findall(result))
        out[op] = out.get(op, 0) + nbytes
    return out


def _block(shape: ModelShape, seed: int = 0) -> MoEBlock:
    """A Qwen3-MoE-style block of ``shape``, bf16, every adapter slot filled
    (random ``A`` and ``B``)."""
    block = MoEBlock(shape.hidden, shape.inter, shape.E, shape.top_k, family="qwen3",
                     max_loras=shape.loras, max_rank=shape.rank, dtype=DT,
                     lora_b_initializer=nnx.initializers.normal(0.02), rngs=nnx.Rngs(seed))
    for slot in range(shape.loras):
        block.lora.init_adapter(slot, rngs=nnx.Rngs(seed + 1 + slot))
    return block


def _batch(shape: ModelShape, tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, shape.hidden)).astype(np.float32)
    ids = (np.arange(tokens) % (shape.loras + 1) - 1).astype(np.int32)  # -1: base model
    return x, ids


def _steps(block: MoEBlock, reps: int):
    """``(one call, reps calls chained)``, jitted over the block's state."""
    graphdef = nnx.graphdef(block)

    def chained(state, x, ids):
        model = nnx.merge(graphdef, state)
        return jax.lax.fori_loop(0, reps, lambda i, h: model(h, ids), x)

    one = jax.jit(lambda state, x, ids: nnx.merge(graphdef, state)(x, ids))
    return one, jax.jit(chained)


def _sent_rows(topk_ids: np.ndarray, devices: int, num_experts: int) -> float:
    """Rows a device sends to others, the most over the devices (the
    ragged exchange's bytes): tokens split evenly, in order."""
    dest = topk_ids.reshape(devices, -1) // (num_experts // devices)
    return float(max(np.sum(dest[d] != d) for d in range(devices)))


def _measure(shape: ModelShape, ref: MoEBlock, devices: int, tokens: int, variant: str,
             runs: int, reps: int) -> dict[str, Any]:
    """One case: ``tokens`` in all on ``devices`` (``variant`` of the
    dispatch), timed, bytes counted, checked against ``ref`` on one device."""
    x, ids = _batch(shape, tokens, seed=tokens)
    dev0 = jax.devices()[0]
    if devices == 1:
        block, args = ref, (jax.device_put(x, dev0).astype(DT), jax.device_put(ids, dev0))
    else:
        mesh = Mesh(np.array(jax.devices()[:devices]), ("ep",))
        block = shard_block(nnx.clone(ref), mesh, expert_axis="ep", **VARIANTS[variant])
        spec = block.sharding.token_spec
        args = (put_global(x, mesh, spec(2)).astype(DT), put_global(ids, mesh, spec(1)))
    one, chained = _steps(block, reps)
    state = nnx.state(block)
    out = one(state, *args)
    hlo = one.lower(state, *args).compile().as_text()
    t = median_seconds(chained, (state, *args), runs, warmup=2) / reps
    row = {"devices": devices, "tokens": tokens, "variant": variant, "t_us": t * 1e6,
           "collective_bytes": hlo_collective_bytes(hlo)}
    if devices > 1:  # against one device running the owners' expert path
        single = nnx.clone(ref)
        single.expert_path = "ragged" if ref.expert_path == "auto" else ref.expert_path
        with jax.default_device(dev0):
            want = one_device_output(single, x, ids)
        got = np.asarray(jax.device_get(out), np.float32)
        row["bit_identical"] = bool(np.array_equal(got, want))
        row["max_abs_diff"] = float(np.max(np.abs(got - want)))
    return row


def one_device_output(block: MoEBlock, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``block`` on one device (the default), float32 host array."""
    y = nnx.jit(lambda m, x, i: m(x, i))(block, jnp.asarray(x, DT), jnp.asarray(ids))
    return np.asarray(jax.device_get(y), np.float32)


def _with_model(shape: ModelShape, ref: MoEBlock, row: dict[str, Any], kind: str,
                phase: str) -> dict[str, Any]:
    """``row`` with the model's bytes for it and the measured wire bytes."""
    d, tokens_d = row["devices"], row["tokens"] // row["devices"]
    opts = VARIANTS[row["variant"]]
    exchange = opts.get("exchange", "all_to_all")
    pieces = opts.get("dispatch_chunks", 1)
    sent = None
    if d > 1 and exchange == "ragged_all_to_all":
        x, ids = _batch(shape, row["tokens"], seed=row["tokens"])
        with jax.default_device(jax.devices()[0]):
            topk = nnx.jit(lambda m, x, i: m.route(x, i, m.lora.routes(), m.impl)[1])(
                ref, jnp.asarray(x, DT), jnp.asarray(ids))
        sent = _sent_rows(np.asarray(topk), d, shape.E)
    model = dispatch_bytes(shape, d, tokens_d // pieces,
                           capacity_factor=opts.get("capacity_factor"), exchange=exchange,
                           sent_rows=None if sent is None else sent / pieces)
    model = {k: v * pieces for k, v in model.items()}
    a2a = sum(v for k, v in row["collective_bytes"].items() if "all-to-all" in k)
    wire = a2a * (d - 1) / d if exchange == "all_to_all" else model["wire"]
    return {**row, "kind": kind, "phase": phase, "shape": shape.name,
            "tokens_per_device": tokens_d, "wire_bytes": wire, "model_wire_bytes": model["wire"],
            "bytes_ratio": wire / model["wire"] if model["wire"] else 1.0}


def run_block_cases(small: bool = False, runs: int = 10, reps: int = 8,
                    variants: list[str] | None = None,
                    phases: tuple[str, ...] = ("decode", "prefill")) -> list[dict[str, Any]]:
    """Weak and strong scaling of ``phases`` over 1, 2, 4, ... devices (as
    many as there are), each dispatch variant. Returns the rows."""
    shape = SHAPES["small" if small else "qwen3-30b-a3b"]
    n_dev = len(jax.devices())
    if n_dev < 2:
        raise SystemExit(f"needs at least 2 devices, found {jax.devices()}")
    counts = [2 ** i for i in range(int(math.log2(n_dev)) + 1) if shape.E % 2 ** i == 0]
    if variants is None:
        variants = ["exact", "exact_x4", "cf2", "cf1.25x4"] + (
            ["ragged", "ragged_x4"] if jax.default_backend() == "gpu" else [])
    per_dev = {"decode": 8 if small else 64, "prefill": 128 if small else 4096}
    ref = _block(shape)
    rows = []
    for phase in phases:
        t_d = per_dev[phase]
        for kind in ("weak", "strong"):
            base = None
            for d in counts:
                tokens = t_d * d if kind == "weak" else t_d * counts[-1]
                for variant in (["exact"] if d == 1 else variants):
                    row = _with_model(shape, ref, _measure(shape, ref, d, tokens, variant,
                                                           runs, reps), kind, phase)
                    base = row if d == 1 else base
                    scale = d if kind == "weak" else 1
                    row["throughput_ratio"] = scale * base["t_us"] / row["t_us"]
                    rows.append(row)
                    _print_row(row)
    return rows


def _print_row(r: dict[str, Any]) -> None:
    ok = "" if "bit_identical" not in r else f"  bit_identical={r['bit_identical']}"
    print(f"{r['phase']:<7} {r['kind']:<6} {r['variant']:<6} D={r['devices']:<3} "
          f"T={r['tokens']:<6} {r['t_us']:10.1f} us/step  x{r['throughput_ratio']:.2f}  "
          f"wire {r['wire_bytes'] / 1e6:8.3f} MB (model x{r['bytes_ratio']:.2f}){ok}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_moelora.tools.block_scaling",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="store_true", help="print the model's table")
    parser.add_argument("--calibrate", help="a --block --json file to refit the model to")
    parser.add_argument("--small", action="store_true", help="small shapes (CPU smoke run)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--variants", nargs="*", help=", ".join(VARIANTS))
    parser.add_argument("--phases", nargs="*", default=["decode", "prefill"],
                        choices=["decode", "prefill"])
    args = parser.parse_args(argv)
    if args.model:
        hw = Hardware()
        if args.calibrate:
            with open(args.calibrate) as f:
                hw = calibrate(json.load(f)["rows"], hw)
        print(json.dumps(dataclasses.asdict(hw)))
        for r in model_table(hw):
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                              for k, v in r.items()}))
        return 0
    env = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
           "platform": jax.default_backend(), "runs": args.runs, "reps": args.reps,
           "small": args.small}
    print(json.dumps(env), flush=True)
    rows = run_block_cases(args.small, args.runs, args.reps, args.variants, tuple(args.phases))
    correct = all(r.get("bit_identical", True) or "capacity_factor" in VARIANTS[r["variant"]]
                  for r in rows)
    from jax_moelora.tools.scaling import report

    return report(env, rows, correct, args.json)


if __name__ == "__main__":
    sys.exit(main())
