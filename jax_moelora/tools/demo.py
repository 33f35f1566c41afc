"""End-to-end demo: ``python -m jax_moelora demo [--family qwen3|mixtral|gpt-oss|deepseek]``.

A small MoE model of the chosen family (embedding, ``--layers`` MoE layers with
RMSNorm and residual, tied LM head; the attention sublayers are left out:
this library folds the MoE part) with seeded random base weights. Three LoRA
adapters are drawn at random, written as real PEFT folders (per-expert and
``target_parameters`` key layouts; gpt-oss's fused ``gate_up_proj``
interleaved) into a temporary folder, and loaded back into one adapter pool.
DeepSeek's shared-expert LoRA pairs are drawn in memory and added to the
loaded adapters.
A mixed batch of streams (base model + the three adapters) runs a prefill
and ``--steps`` greedy decode steps through one jitted step function; every
layer's output is checked against the pure-JAX folds (``impl="jnp"``) on the
same layer input, within three times the per-fold tolerance of
docs/semantics.md §6 (three folds chain in a layer), and the base-model streams
must keep the bits
the same step gives with every stream on the base model.

``--timing`` measures instead the decode-step time of a stack of
Qwen3-30B-A3B-shaped MoE layers (``--size full``: E 128, top_k 8, hidden
2048, inter 768; 4 layers, 4 adapters, T = 64 by default) with and without
LoRA and prints the overhead in percent. ``--timing --prefill`` measures a
prefill step of the same stack instead (T = 4096 by default: ``T * top_k`` rows
sorted by expert, the grouped path): the base model and 4 adapters, each with
the ragged path's grouped GEMM as ``jax.lax.ragged_dot`` and as
``jax_moelora.expert_matmul`` (``MoEBlock(expert_gemm=...)``), and with
``expert_matmul`` once more reading the adapters' ``scale * B`` packed once
(``MoEStack.in_gemm_packs``, bf16/f16) instead of in every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_moelora import _ext
from jax_moelora._optional import needs_extra

with needs_extra("nnx", "the demo"):
    from flax import nnx
from jax_moelora.nnx import (
    AdapterPool,
    DeepSeekV2,
    DeepSeekV3,
    GptOss,
    Mixtral,
    MoEFamily,
    Qwen3MoE,
)
from jax_moelora.nnx.stack import MoEStack
from jax_moelora.nnx.experts import EXPERT_GEMMS, grouped_gemm_runs_kernel
from jax_moelora.ops.folds import GATHER_MAX_ROWS, GATHER_ROWS_PER_EXPERT, IMPLS, resolve_impl
from jax_moelora.ops.lora_pack import PACK_DTYPES
from jax_moelora.peft import ProjectionLoRA, load_peft_adapter, save_peft_adapter

__all__ = ["ModelConfig", "DemoModel", "DEMO_FAMILIES", "DTYPES", "SIZES", "TOLERANCES",
           "add_arguments", "device_name", "make_console", "run", "time_variants"]

#: Model shapes: "small" runs on a laptop CPU, "full" is Qwen3-30B-A3B's MoE.
SIZES = {
    "small": dict(hidden=256, inter=128, experts=16, top_k=4, vocab=512),
    "full": dict(hidden=2048, inter=768, experts=128, top_k=8, vocab=4096),
}

#: The family configs the demo builds (``--family``); "deepseek" is DeepSeek-V3.
DEMO_FAMILIES: dict[str, MoEFamily] = {
    "qwen3": Qwen3MoE(),
    "mixtral": Mixtral(),
    "gpt-oss": GptOss(),
    "deepseek": DeepSeekV3(n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared=1),
    "deepseek-v2": DeepSeekV2(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              n_shared=2),
}

#: docs/semantics.md §6: relative error of the LoRA delta by norm, per dtype.
TOLERANCES = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5}
#: A layer's output goes through three chained folds (gate, up, then down on
#: their product), so the demo allows each layer this many per-fold tolerances.
BLOCK_FOLDS = 3

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of the demo model."""

    hidden: int
    inter: int
    experts: int
    top_k: int
    vocab: int
    layers: int
    max_loras: int = 4
    max_rank: int = 16
    dtype: str = "float32"
    family: str = "qwen3"


class DemoModel(nnx.Module):
    """Embedding -> :class:`MoEStack` (``layers`` x (RMSNorm -> :class:`MoEBlock`
    -> residual)) -> RMSNorm -> tied LM head. ``blocks`` and ``norms`` are the
    stack's ``nnx.List``\\ s; a call runs every layer in one traced program."""

    def __init__(self, cfg: ModelConfig, *, impl: str = "auto", expert_path: str = "auto",
                 expert_gemm: str = "auto", gather_max_rows: int | None = None,
                 rngs: nnx.Rngs):
        dt = DTYPES[cfg.dtype]
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.hidden, dtype=dt, param_dtype=dt, rngs=rngs)
        self.stack = MoEStack(cfg.hidden, cfg.inter, cfg.experts, cfg.top_k, cfg.layers,
                              family=DEMO_FAMILIES[cfg.family], max_loras=cfg.max_loras,
                              max_rank=cfg.max_rank, dtype=dt, impl=impl,
                              expert_path=expert_path, expert_gemm=expert_gemm,
                              gather_max_rows=gather_max_rows, rngs=rngs)
        self.final_norm = nnx.RMSNorm(cfg.hidden, dtype=dt, param_dtype=dt, rngs=rngs)

    @property
    def blocks(self) -> nnx.List:
        return self.stack.blocks

    @property
    def norms(self) -> nnx.List:
        return self.stack.norms

    def layers(self, h: jax.Array, adapter_ids: jax.Array | None, *, impl: str | None = None,
               use_lora: bool = True, lora_packs=None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``h [T, H]`` through every layer -> ``(h, block_inputs [L, T, H],
        block_outputs [L, T, H])``; ``lora_packs`` as :class:`MoEStack` takes them."""
        return self.stack.layers(h, adapter_ids, impl=impl, use_lora=use_lora,
                                 lora_packs=lora_packs)

    def __call__(self, tokens: jax.Array, adapter_ids: jax.Array | None, *,
                 impl: str | None = None, use_lora: bool = True):
        """``tokens [T]`` -> ``(logits [T, V], block_inputs, block_outputs)``."""
        h, ins, outs = self.layers(self.embed(tokens), adapter_ids, impl=impl, use_lora=use_lora)
        return self.embed.attend(self.final_norm(h)), ins, outs


# --------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (``python -m jax_moelora demo --help``)."""
    parser.add_argument("--family", choices=list(DEMO_FAMILIES), default="qwen3",
                        help="model family of the MoE blocks (default qwen3; deepseek is "
                             "DeepSeek-V3)")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="model shape (default: small; full with --timing)")
    parser.add_argument("--layers", type=int, default=4, help="MoE layers (default 4)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per decode step: streams in the demo (default 8), "
                             "T in --timing (default 64; 4096 with --prefill)")
    parser.add_argument("--prompt-len", type=int, default=80,
                        help="prompt tokens per stream (default 80: the prefill takes the "
                             "sorted, grouped path)")
    parser.add_argument("--steps", type=int, default=None,
                        help="decode steps (default 16); steps per timed run in --timing "
                             "(default 16; 2 with --prefill)")
    parser.add_argument("--impl", choices=IMPLS, default="auto", help="fold backend")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="activation dtype (auto: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--expert-path", choices=["auto", "dense", "ragged"], default="auto",
                        help="base expert matmuls (see MoEBlock)")
    parser.add_argument("--expert-gemm", choices=EXPERT_GEMMS, default="auto",
                        help="grouped GEMM of the ragged path (see MoEBlock; --prefill times "
                             "ragged_dot and expert_matmul)")
    parser.add_argument("--gather-max-rows", type=int, default=None,
                        help="batches of at most this many T * top_k rows take the gather fold "
                             "in flat row order, larger ones are sorted by expert (see MoEBlock; "
                             f"default max({GATHER_MAX_ROWS}, {GATHER_ROWS_PER_EXPERT} * experts); "
                             "0 sorts every batch)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank in --timing (16)")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--trace", type=Path, default=None, metavar="DIR",
                        help="with --timing: profile one run of each variant into DIR, print "
                             "the GPU kernel time per step by kernel name and write each "
                             "variant's optimized HLO (DIR/*/program.hlo.txt)")
    parser.add_argument("--timing", action="store_true",
                        help="decode-step time with and without LoRA (GPU measurement)")
    parser.add_argument("--prefill", action="store_true",
                        help="with --timing: a prefill step (T = 4096 by default), base and "
                             "4 adapters, ragged_dot and expert_matmul as the grouped GEMM")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per variant in --timing (median; default 20, 5 "
                             "with --prefill)")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON")


def make_console() -> Any:
    """A ``rich`` console (the ``bench`` extra) for the commands' output."""
    with needs_extra("bench", "the demo's output"):
        from rich.console import Console

    return Console(highlight=False)


def _dtype_name(args) -> str:
    if args.dtype != "auto":
        return args.dtype
    return "bfloat16" if _ext.current_platform() == "gpu" else "float32"


def device_name() -> str:
    """JAX's first device as ``platform:kind`` (e.g. ``gpu:NVIDIA H200``)."""
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', d.platform)}"


def _cuda_kernels() -> str:
    """Whether the CUDA kernels can run here now, and why not."""
    if _ext.cuda_available():
        return "True"
    if not _ext.HAS_CUDA:
        return "False (built without CUDA)"
    if not _ext.gpu_devices():
        return "False (built, but no GPU visible)"
    return "False (built, but computations go to the CPU)"


def run(args: argparse.Namespace) -> int:
    """Run the demo (or ``--timing``); 0 when every check passes."""
    if args.prefill and not args.timing:
        raise SystemExit("--prefill is a --timing mode: pass --timing --prefill")
    if args.steps is None:
        args.steps = 2 if args.prefill else 16
    if args.repeats is None:
        args.repeats = 5 if args.prefill else 20
    for name in ("layers", "steps", "prompt_len", "repeats", "rank"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.tokens is not None and args.tokens < 1:
        raise SystemExit("--tokens must be >= 1")
    try:
        impl = resolve_impl(args.impl)
    except ValueError as err:
        raise SystemExit(f"--impl {args.impl}: {err}") from err
    console = make_console()
    if args.timing:
        if args.prefill:
            return _run_prefill_timing(args, impl, console)
        return _run_timing(args, impl, console)
    return _run_demo(args, impl, console)


# --------------------------------------------------------------------------
# adapters
# --------------------------------------------------------------------------

# name, rank, alpha, use_rslora, rank_pattern (per-expert layouts), projections
_ADAPTERS = (
    ("support-bot", 8, 16.0, False, None, ("router", "gate", "up", "down")),
    ("sql-writer", 16, 16.0, True, None, ("router", "gate", "up", "down")),
    ("poet", 4, 8.0, False, {"down_proj": 12}, ("gate", "up", "down")),
)

#: The PEFT key layouts of the three adapters, per family: gpt-oss's experts
#: are fused 3-D parameters, which PEFT adapts with ``target_parameters`` only.
_LAYOUTS = {"gpt-oss": ("target_parameters",) * 3}
_DEFAULT_LAYOUTS = ("experts", "target_parameters", "target_parameters")


def _random_factors(rng: np.random.Generator, cfg: ModelConfig, rank: int, down_rank: int,
                    projections, shared_a: bool) -> dict[int, dict[str, tuple]]:
    """Unscaled PEFT factors ``{layer: {proj: (A [E, r, K], B [E, N, r])}}``."""
    E, H, I = cfg.experts, cfg.hidden, cfg.inter

    def pair(e, r, k, n):
        return (rng.standard_normal((e, r, k), np.float32) / np.sqrt(k),
                rng.standard_normal((e, n, r), np.float32) * 0.5 / np.sqrt(r))

    out = {}
    for layer in range(cfg.layers):
        projs = {}
        if "router" in projections:
            a, b = pair(1, rank, H, E)
            projs["router"] = (a, b)
        projs["gate"] = pair(E, rank, H, I)
        projs["up"] = pair(E, rank, H, I)
        if shared_a:
            projs["up"] = (projs["gate"][0], projs["up"][1])
        projs["down"] = pair(E, down_rank, I, H)
        out[layer] = projs
    return out


def _shared_expert_lora(rng: np.random.Generator, cfg: ModelConfig, rank: int,
                        scale: float) -> dict[int, dict[str, ProjectionLoRA]]:
    """Random LoRA pairs for the shared-expert MLP of every layer (DeepSeek),
    ``{layer: {"shared_gate" | "shared_up" | "shared_down": ProjectionLoRA}}``."""
    H, S = cfg.hidden, DEMO_FAMILIES[cfg.family].n_shared_experts * cfg.inter
    out = {}
    for layer in range(cfg.layers):
        projs = {}
        for proj, (k, n) in (("shared_gate", (H, S)), ("shared_up", (H, S)),
                             ("shared_down", (S, H))):
            a = rng.standard_normal((rank, k), np.float32) / np.sqrt(k)
            b = rng.standard_normal((n, rank), np.float32) * 0.5 / np.sqrt(rank)
            projs[proj] = ProjectionLoRA.from_pairs(
                {0: (a, b, scale, f"layers.{layer}.mlp.{proj}")})
        out[layer] = projs
    return out


def _write_and_load(folder: Path, cfg: ModelConfig, seed: int):
    """Write the three demo adapters as PEFT folders and read them back; for
    families with shared experts, add in-memory shared-expert pairs.

    Returns ``[(adapter, layout, factors, scales)]``."""
    rng = np.random.default_rng(seed + 1)
    family = DEMO_FAMILIES[cfg.family]
    layouts = _LAYOUTS.get(cfg.family, _DEFAULT_LAYOUTS)
    loaded = []
    for (name, r, alpha, rslora, pattern, projections), layout in zip(_ADAPTERS, layouts):
        down_r = (pattern or {}).get("down_proj", r)
        factors = _random_factors(rng, cfg, r, down_r, projections,
                                  shared_a=layout != "experts")
        path = save_peft_adapter(folder / name, factors, r=r, lora_alpha=alpha, layout=layout,
                                 use_rslora=rslora, rank_pattern=pattern, family=family,
                                 base_model_name_or_path=f"demo/{cfg.family}-shaped")
        adapter = load_peft_adapter(path, num_experts=cfg.experts, hidden_size=cfg.hidden,
                                    intermediate_size=cfg.inter,
                                    gate_up_split=family.gate_up_split)

        def scale(rank):
            return alpha / np.sqrt(rank) if rslora else alpha / rank

        scales = {p: scale(down_r if p == "down" else r) for p in projections}
        if family.n_shared_experts:
            shared = _shared_expert_lora(rng, cfg, r, scale(r))
            adapter = dataclasses.replace(adapter, layers={
                layer: {**projs, **shared[layer]} for layer, projs in adapter.layers.items()})
        loaded.append((adapter, layout, factors, scales))
    return loaded


def _roundtrip_error(adapter, factors, scales) -> float:
    """Max relative error of the loaded dense deltas against the written factors."""
    worst = 0.0
    for layer, projs in factors.items():
        for proj, (a, b) in projs.items():
            lora = adapter.layers[layer][proj]
            got = np.einsum("enr,erk->enk", lora.b * lora.scale[:, None, None], lora.a)
            ref = scales[proj] * np.einsum("enr,erk->enk", b, a)
            err = np.abs(got - ref).max() / max(float(np.abs(ref).max()), 1e-30)
            worst = max(worst, float(err))
    return worst


# --------------------------------------------------------------------------
# the demo
# --------------------------------------------------------------------------

def _jit_step(graphdef, impl: str):
    """The one jitted step function (prefill and every decode step)."""

    def step(state, tokens, adapter_ids):
        model = nnx.merge(graphdef, state)
        logits, ins, outs = model(tokens, adapter_ids, impl=impl)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), ins, outs

    return jax.jit(step)


def _jit_reference(graphdef):
    """One layer again on the same input: pure-JAX folds, and no LoRA (every
    block has the same structure, so one program serves all layers)."""

    def ref(state, z, adapter_ids):
        block = nnx.merge(graphdef, state)
        return block(z, adapter_ids, impl="jnp"), block(z, adapter_ids, use_lora=False)

    return jax.jit(ref)


def _reference(model: "DemoModel", ins: jax.Array, adapter_ids) -> tuple[jax.Array, jax.Array]:
    """``(with_lora, base)`` ``[L, T, H]``: every layer on its recorded input."""
    graphdef, _ = nnx.split(model.blocks[0])
    fn = _REF_CACHE.setdefault(graphdef, _jit_reference(graphdef))
    pairs = [fn(nnx.state(block), z, adapter_ids) for block, z in zip(model.blocks, ins)]
    return jnp.stack([p[0] for p in pairs]), jnp.stack([p[1] for p in pairs])


_REF_CACHE: dict[Any, Callable] = {}


@dataclasses.dataclass
class _Check:
    num: float = 0.0  # worst ||out - ref|| / ||ref - base|| over calls and layers
    max_abs: float = 0.0
    base_bitwise: bool = True
    finite: bool = True

    def update(self, outs, ref, base, own_base, ids) -> None:
        """``own_base``: the same step run with every stream on the base model."""
        self.base_bitwise &= bool(np.array_equal(np.asarray(outs)[:, ids < 0],
                                                 np.asarray(own_base)[:, ids < 0]))
        outs, ref, base = (np.asarray(v, np.float64) for v in (outs, ref, base))
        self.finite &= bool(np.isfinite(outs).all())
        adapted = ids >= 0
        if adapted.any():
            for lay in range(outs.shape[0]):
                o, r, b = outs[lay, adapted], ref[lay, adapted], base[lay, adapted]
                denom = np.linalg.norm(r - b)
                rel = np.linalg.norm(o - r) / denom if denom > 0 else np.linalg.norm(o - r)
                self.num = max(self.num, float(rel))
                self.max_abs = max(self.max_abs, float(np.abs(o - r).max()))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


@dataclasses.dataclass
class _DemoRun:
    """What one demo run loaded, measured and generated.

    ``adapters``: ``(name, PEFT layout, slot, max rank, projections)`` each;
    ``calls``: ``(tokens, layer inputs, layer outputs, adapter ids)`` of the
    prefill and each decode step, checked against ``impl="jnp"`` afterwards."""

    adapters: list[tuple[str, str, int, int, tuple[str, ...]]]
    roundtrip: float
    compile_s: float = 0.0
    prefill_s: float = 0.0
    total_s: float = 0.0
    step_s: list[float] = dataclasses.field(default_factory=list)
    generated: list[np.ndarray] = dataclasses.field(default_factory=list)
    calls: list[tuple] = dataclasses.field(default_factory=list)
    check: _Check = dataclasses.field(default_factory=_Check)

    @property
    def names(self) -> list[str | None]:
        """The streams' adapters in turn: the base model (``None``), then each adapter."""
        return [None] + [a[0] for a in self.adapters]


def _progress(console):
    """The demo's progress bars (rich)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description:<30}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                    console=console)


def _load_adapters(progress, model: DemoModel, cfg: ModelConfig, folder: Path,
                   seed: int) -> tuple[AdapterPool, _DemoRun]:
    """Write the demo's PEFT adapters to ``folder``, load each into a slot of
    a pool over the model's blocks; the run records them and the worst
    round-trip error."""
    task = progress.add_task("write + load PEFT adapters", total=len(_ADAPTERS))
    pool = AdapterPool(list(model.blocks))
    adapters = []
    roundtrip = 0.0
    for adapter, layout, factors, scales in _write_and_load(folder, cfg, seed):
        roundtrip = max(roundtrip, _roundtrip_error(adapter, factors, scales))
        # from the folder (the pool reads it with the family's gate_up split);
        # with shared-expert pairs added in memory, the adapter object
        shared = DEMO_FAMILIES[cfg.family].n_shared_experts
        slot = pool.load(adapter if shared else folder / adapter.name)
        adapters.append((adapter.name, layout, slot, adapter.max_rank, adapter.projections))
        progress.advance(task)
    return pool, _DemoRun(adapters=adapters, roundtrip=roundtrip)


def _mixed_batch(pool: AdapterPool, names: list[str | None], streams: int, plen: int,
                 vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(stream_ids, prompts [streams, plen])``: stream ``i`` uses
    ``names[i % len(names)]``."""
    stream_ids = pool.ids([names[i % len(names)] for i in range(streams)])
    rng = np.random.default_rng(seed + 2)
    return stream_ids, rng.integers(0, vocab, (streams, plen), dtype=np.int32)


def _generate(progress, run: _DemoRun, step, state, prompts: np.ndarray,
              stream_ids: np.ndarray, steps: int) -> None:
    """Compile, then prefill the prompts and decode ``steps`` tokens per
    stream, timing each; fills ``run``'s times, tokens and calls."""
    streams, plen = prompts.shape
    prefill_ids = np.repeat(stream_ids, plen)  # per-token map of the packed batch
    task = progress.add_task("compile (prefill + decode)", total=2)
    t0 = time.perf_counter()
    jax.block_until_ready(step(state, prompts.reshape(-1), prefill_ids))
    progress.advance(task)
    jax.block_until_ready(step(state, prompts[:, -1], stream_ids))
    progress.advance(task)
    run.compile_s = time.perf_counter() - t0

    task = progress.add_task(f"prefill ({streams} x {plen} tokens)", total=1)
    t0 = time.perf_counter()
    nxt, ins, outs = jax.block_until_ready(step(state, prompts.reshape(-1), prefill_ids))
    run.prefill_s = time.perf_counter() - t0
    run.calls.append((prompts.reshape(-1), ins, outs, prefill_ids))
    tokens = np.asarray(nxt).reshape(streams, plen)[:, -1]
    run.generated.append(tokens)
    progress.advance(task)

    task = progress.add_task(f"decode ({streams} streams)", total=steps)
    for _ in range(steps):
        t0 = time.perf_counter()
        nxt, ins, outs = jax.block_until_ready(step(state, tokens, stream_ids))
        run.step_s.append(time.perf_counter() - t0)
        run.calls.append((tokens, ins, outs, stream_ids))
        tokens = np.asarray(nxt)
        run.generated.append(tokens)
        progress.advance(task)


def _check_calls(progress, model: DemoModel, step, state, calls: list[tuple]) -> _Check:
    """Every recorded call against ``impl="jnp"`` layer by layer, and its
    base-model streams against the same step run with every stream on the base."""
    task = progress.add_task("check vs impl='jnp'", total=len(calls))
    check = _Check()
    for toks, ins, outs, ids in calls:
        ref, base = _reference(model, ins, ids)
        own_base = step(state, toks, np.full_like(ids, -1))[2]
        check.update(outs, ref, base, own_base, np.asarray(ids))
        progress.advance(task)
    return check


def _run_demo(args, impl: str, console) -> int:
    """Build the model, load the PEFT adapters, prefill and decode a mixed
    batch, check every step against ``impl="jnp"``; print the summary."""
    size = args.size or "small"
    dtype = _dtype_name(args)
    cfg = ModelConfig(**SIZES[size], layers=args.layers, dtype=dtype, family=args.family)
    streams = args.tokens or 8
    console.print(f"[bold]jax_moelora demo[/bold]: {size} {cfg.family} MoE model, "
                  f"{cfg.layers} layers, E {cfg.experts}, top_k {cfg.top_k}, hidden "
                  f"{cfg.hidden}, inter {cfg.inter}, {dtype}; impl {impl} on {device_name()}")
    t_start = time.perf_counter()
    progress = _progress(console)
    with progress, tempfile.TemporaryDirectory(prefix="jax_moelora_demo_") as tmp:
        task = progress.add_task("build model", total=1)
        model = DemoModel(cfg, impl=impl, expert_path=args.expert_path,
                          expert_gemm=args.expert_gemm, gather_max_rows=args.gather_max_rows,
                          rngs=nnx.Rngs(args.seed))
        progress.advance(task)
        pool, run = _load_adapters(progress, model, cfg, Path(tmp), args.seed)
        stream_ids, prompts = _mixed_batch(pool, run.names, streams, args.prompt_len,
                                              cfg.vocab, args.seed)
        graphdef, state = nnx.split(model)
        step = _jit_step(graphdef, impl)
        _generate(progress, run, step, state, prompts, stream_ids, args.steps)
        run.check = _check_calls(progress, model, step, state, run.calls)
    run.total_s = time.perf_counter() - t_start
    return _report(args, impl, cfg, streams, run, console)


def _report(args, impl: str, cfg: ModelConfig, streams: int, run: _DemoRun, console) -> int:
    """Print the summary table, write the JSON (``--json``); 0 when the run passed."""
    tol = BLOCK_FOLDS * TOLERANCES[cfg.dtype]
    check = run.check
    passed = (check.num <= tol and check.finite and check.base_bitwise
              and run.roundtrip <= 1e-5)
    console.print(_summary_table(args, impl, cfg, streams, run, tol, passed))
    if args.json:
        args.json.write_text(json.dumps(dict(
            mode="demo", backend=jax.default_backend(), device=device_name(), impl=impl,
            dtype=cfg.dtype, config=dataclasses.asdict(cfg), streams=streams,
            prompt_len=args.prompt_len, steps=args.steps, compile_s=run.compile_s,
            prefill_s=run.prefill_s, decode_step_s=run.step_s, max_rel_error=check.num,
            max_abs_error=check.max_abs, tolerance=tol, base_bitwise=check.base_bitwise,
            roundtrip_error=run.roundtrip, passed=passed,
            adapters=[dict(name=n, layout=l, slot=s, rank=r) for n, l, s, r, _ in run.adapters]),
            indent=2))
    return 0 if passed else 1


def _summary_table(args, impl: str, cfg: ModelConfig, streams: int, run: _DemoRun,
                   tol: float, passed: bool):
    """The demo's summary (a rich ``Table``)."""
    from rich.table import Table

    plen, steps, check, names = args.prompt_len, args.steps, run.check, run.names
    gen = np.stack(run.generated, axis=1)
    table = Table(title="jax_moelora demo summary", show_header=True, header_style="bold")
    table.add_column("item")
    table.add_column("value")
    table.add_row("backend", f"{jax.default_backend()} ({device_name()}), "
                             f"cuda kernels: {_cuda_kernels()}")
    table.add_row("impl used", f"{impl} (requested {args.impl}); expert path "
                               f"{args.expert_path}, grouped GEMM {args.expert_gemm}")
    table.add_row("family", f"{cfg.family}: {DEMO_FAMILIES[cfg.family]}")
    table.add_row("model", f"{cfg.layers} layers, E {cfg.experts}, top_k {cfg.top_k}, hidden "
                           f"{cfg.hidden}, inter {cfg.inter}, vocab {cfg.vocab}, {cfg.dtype}")
    for name, layout, slot, rank, projs in run.adapters:
        table.add_row(f"adapter slot {slot}", f"{name}: PEFT layout {layout}, rank <= {rank}, "
                                              f"{'/'.join(projs)}")
    table.add_row("batch", f"{streams} streams: "
                           + ", ".join(str(n or 'base') for n in
                                       (names[i % len(names)] for i in range(streams))))
    table.add_row("compile", _ms(run.compile_s))
    table.add_row("prefill", f"{_ms(run.prefill_s)} ({streams * plen} tokens, "
                             f"{streams * plen * cfg.top_k} rows: "
                             f"{'grouped' if streams * plen * cfg.top_k > 2048 else 'gather'})")
    table.add_row("decode step", f"{_ms(statistics.median(run.step_s))} median, "
                                 f"{_ms(min(run.step_s))} min over {steps} steps")
    table.add_row("max error vs jnp", f"{check.num:.2e} (delta-relative, tol {tol:g}), "
                                      f"{check.max_abs:.2e} abs")
    table.add_row("base tokens bit-identical", str(check.base_bitwise))
    table.add_row("PEFT round-trip error", f"{run.roundtrip:.2e}")
    table.add_row("generated (stream 0..3)",
                  "; ".join(" ".join(map(str, g[:6])) + " ..." for g in gen[:4]))
    table.add_row("wall time", f"{run.total_s:.1f} s")
    table.add_row("result", "[green]PASS[/green]" if passed else "[red]FAIL[/red]")
    return table


# --------------------------------------------------------------------------
# --timing
# --------------------------------------------------------------------------

def _install_random_adapters(model: DemoModel, rank: int, seed: int) -> None:
    """Fill every slot of every layer with random factors, on the device."""
    key = jax.random.key(seed + 7)
    for block in model.blocks:
        for proj_name in block.lora.projections:
            proj = getattr(block.lora, proj_name)
            for slot in range(proj.max_loras):
                key, ka, kb = jax.random.split(key, 3)
                E, K, N = proj.n_experts, proj.k_in, proj.n_out
                a = jax.random.normal(ka, (E, rank, K), jnp.float32) / np.sqrt(K)
                b = jax.random.normal(kb, (E, N, rank), jnp.float32) * 0.5 / np.sqrt(rank)
                proj.write_slot(slot, a, b, np.ones(E, np.float32), np.ones(E, bool))


def _timed_loop(graphdef, impl: str, use_lora: bool, steps: int,
                packs: bool | None = None) -> Callable:
    """``steps`` steps of the layer stack in one program (output fed back).
    ``packs`` None: the state is the model's; else it is ``(the model's, the
    stack's in_gemm_packs)``, and the steps read the packs when ``packs``."""

    def run_steps(state, h, ids):
        state, lora_packs = (state, None) if packs is None else state
        model = nnx.merge(graphdef, state)

        def body(_, h):
            out, _, _ = model.layers(h, ids, impl=impl, use_lora=use_lora,
                                     lora_packs=lora_packs if packs else None)
            return out.astype(h.dtype)

        return jax.lax.fori_loop(0, steps, body, h)

    return jax.jit(run_steps)


def _trace_kernels(console, label: str, fn, state, h, ids, calls: int, folder: Path) -> dict:
    """GPU kernel time per step of one timed variant (``step_profile``),
    printed with its top kernels; returns the profile for the JSON, with
    ``"hlo"``: the path of the variant's optimized HLO (``program.hlo.txt`` in
    ``folder``), where the fusions the profile names are defined."""
    from jax_moelora.tools.step_profile import kernel_times

    prof = kernel_times(fn, state, h, ids, calls=calls, folder=folder)
    hlo = folder / "program.hlo.txt"
    hlo.write_text(fn.lower(state, h, ids).compile().as_text())
    prof["hlo"] = str(hlo)
    top = ", ".join(f"{name[:60]} {us:.1f}" for name, us in
                    list(prof["per_call_us"].items())[:12])
    console.print(f"[bold]{label}[/]: kernels {prof['total_us']:.1f} µs per step, span "
                  f"{prof['span_us']:.1f} µs; top (µs per step): {top}")
    return prof


def _print_split(console, label: str, base: dict, lora: dict) -> dict | None:
    """Print and return ``step_profile.overhead_split`` of a traced variant
    against the traced base variant (``None`` when no GPU kernel was traced)."""
    from jax_moelora.tools.step_profile import overhead_split

    if not base["per_call_us"] or not lora["per_call_us"]:
        return None
    split = overhead_split(base, lora)
    console.print(f"[bold]{label}[/]: {split['kernels_us']:+.1f} µs of kernels a step over the "
                  f"base model: the library's kernels {split['library_us']:.1f} µs, XLA's "
                  f"other kernels {split['xla_us']:+.1f} µs; idle gaps between kernels "
                  f"{split['gaps_us']['base']:.1f} µs (base) and {split['gaps_us']['lora']:.1f} "
                  f"µs")
    return split


def _timing_config(args, *, default_tokens: int) -> tuple[str, int, ModelConfig]:
    """The timing modes' dtype name, tokens and model config (full size and 4
    adapters unless asked otherwise)."""
    dtype = _dtype_name(args)
    cfg = ModelConfig(**SIZES[args.size or "full"], layers=args.layers, dtype=dtype,
                      family=args.family, max_loras=4, max_rank=args.rank)
    return dtype, args.tokens or default_tokens, cfg


def _run_timing(args, impl: str, console) -> int:
    from rich.table import Table

    dtype, T, cfg = _timing_config(args, default_tokens=64)
    inner = args.steps
    model = DemoModel(cfg, impl=impl, expert_path=args.expert_path,
                      expert_gemm=args.expert_gemm, gather_max_rows=args.gather_max_rows,
                      rngs=nnx.Rngs(args.seed))
    gather_max_rows = model.blocks[0].gather_max_rows
    console.print(f"[bold]jax_moelora decode timing[/bold]: {cfg.layers} x {cfg.family} MoE "
                  f"layer (E "
                  f"{cfg.experts}, top_k {cfg.top_k}, hidden {cfg.hidden}, inter {cfg.inter}), "
                  f"T {T}, rank {args.rank}, 4 adapters, {dtype}, impl {impl}, expert path "
                  f"{args.expert_path}, gather_max_rows {gather_max_rows} on {device_name()}")
    _install_random_adapters(model, args.rank, args.seed)
    graphdef, state = nnx.split(model)
    h = jax.random.normal(jax.random.key(args.seed + 3), (T, cfg.hidden), jnp.float32)
    h = h.astype(DTYPES[dtype])
    spread = jnp.arange(T, dtype=jnp.int32) % cfg.max_loras
    variants = [
        ("base model (no LoRA ops)", False, spread),
        ("LoRA state, all tokens base (-1)", True, jnp.full((T,), -1, jnp.int32)),
        ("LoRA, 4 adapters over T tokens", True, spread),
    ]
    fns = {label: _timed_loop(graphdef, impl, use_lora, inner)
           for label, use_lora, _ in variants}
    results, _ = time_variants([(label, fns[label], ids) for label, _, ids in variants],
                                state, h, repeats=args.repeats, inner=inner, console=console)
    base = results[variants[0][0]]["step_s"]
    table = Table(title=f"decode step, {cfg.layers} layers, T = {T} (median of {args.repeats} "
                        f"runs of {inner} steps)", header_style="bold")
    for col in ("variant", "time / step", "min", "overhead vs base"):
        table.add_column(col)
    for label, r in results.items():
        table.add_row(label, _ms(r["step_s"]), _ms(r["min_s"]),
                      f"{100.0 * (r['step_s'] - base) / base:+.1f} %")
    console.print(table)
    lora = results[variants[2][0]]["step_s"]
    console.print(f"LoRA overhead: {100.0 * (lora - base) / base:+.1f} % "
                  f"({_ms(base)} -> {_ms(lora)} per decode step)")
    if args.trace:
        for i, (label, _, ids) in enumerate(variants):
            results[label]["kernels"] = _trace_kernels(console, label, fns[label], state, h, ids,
                                                       inner, args.trace / f"variant{i}")
        for label, *_ in variants[1:]:
            results[label]["overhead_split"] = _print_split(
                console, label, results[variants[0][0]]["kernels"], results[label]["kernels"])
    if args.json:
        args.json.write_text(json.dumps(dict(
            mode="timing", backend=jax.default_backend(), device=device_name(), impl=impl,
            dtype=dtype, tokens=T, rank=args.rank, config=dataclasses.asdict(cfg),
            expert_path=args.expert_path, expert_gemm=args.expert_gemm,
            gather_max_rows=gather_max_rows, steps_per_run=inner,
            repeats=args.repeats, results=results,
            overhead_percent=100.0 * (lora - base) / base), indent=2))
    return 0


def time_variants(variants, state, h, *, repeats: int, inner: int, console,
                   catch: bool = False) -> tuple[dict[str, dict], dict[str, str]]:
    """Compile each ``(label, fn, ids)`` (one run of ``fn(state, h, ids)``),
    then time ``repeats`` runs of each, round robin (so drifts hit every
    variant alike). Returns ``({label: {"step_s": median, "min_s": min}},
    {label: error})``; with ``catch``, a variant whose first run raises a
    runtime error (out of memory: XLA:GPU's dense ``ragged_dot`` at prefill
    sizes) is left out with its error instead of stopping the run."""
    times, errors = {}, {}
    for label, fn, ids in variants:
        t0 = time.perf_counter()
        try:
            jax.block_until_ready(fn(state, h, ids))
        except (jax.errors.JaxRuntimeError, MemoryError) as err:
            if not catch:
                raise
            errors[label] = str(err).strip().splitlines()[0][:200]
            console.print(f"  [yellow]{label}: failed ({errors[label]})[/]")
            continue
        times[label] = []
        console.print(f"  compiled {label} ({time.perf_counter() - t0:.1f} s)")
    for _ in range(repeats):
        for label, fn, ids in variants:
            if label in errors:
                continue
            t0 = time.perf_counter()
            jax.block_until_ready(fn(state, h, ids))
            times[label].append((time.perf_counter() - t0) / inner)
    return ({label: dict(step_s=statistics.median(t), min_s=min(t))
             for label, t in times.items()}, errors)


#: The grouped GEMMs ``--timing --prefill`` compares (``MoEBlock(expert_gemm=...)``).
PREFILL_GEMMS = ("ragged_dot", "expert_matmul")
#: The prefill variant whose expert GEMMs read packs made once for the adapters.
PACKED_LABEL = "LoRA, 4 adapters, packs made once"


def _run_prefill_timing(args, impl: str, console) -> int:
    """``--timing --prefill``: a prefill step of the layer stack at T tokens
    (default 4096), base model and 4 adapters, with each of ``PREFILL_GEMMS``
    as the ragged path's grouped GEMM (one model: the blocks' ``expert_gemm``
    is set before each split, the weights are shared)."""
    from rich.table import Table

    dtype, T, cfg = _timing_config(args, default_tokens=4096)
    inner = args.steps
    rows = T * cfg.top_k
    model = DemoModel(cfg, impl=impl, expert_path=args.expert_path,
                      gather_max_rows=args.gather_max_rows, rngs=nnx.Rngs(args.seed))
    block = model.blocks[0]
    grouped = rows > block.gather_max_rows
    dt = DTYPES[dtype]
    kernel = {"gate/up": grouped_gemm_runs_kernel(dt, cfg.hidden, cfg.inter),
              "down": grouped_gemm_runs_kernel(dt, cfg.inter, cfg.hidden)}
    console.print(f"[bold]jax_moelora prefill timing[/bold]: {cfg.layers} x {cfg.family} MoE "
                  f"layer (E {cfg.experts}, top_k {cfg.top_k}, hidden {cfg.hidden}, inter "
                  f"{cfg.inter}), T {T} ({rows} rows: "
                  f"{'grouped' if grouped else 'gather'} path), rank {args.rank}, 4 adapters, "
                  f"{dtype}, impl {impl}, expert path {args.expert_path} on {device_name()}; "
                  f"expert_matmul runs its CUTLASS kernel: "
                  + ", ".join(f"{k} {v}" for k, v in kernel.items()))
    _install_random_adapters(model, args.rank, args.seed)
    h = jax.random.normal(jax.random.key(args.seed + 3), (T, cfg.hidden), jnp.float32)
    h = h.astype(dt)
    spread = jnp.arange(T, dtype=jnp.int32) % cfg.max_loras
    variants, meta, state = _prefill_variants(model, impl, inner, spread)
    results, errors = time_variants(variants, state, h, repeats=args.repeats, inner=inner,
                                     console=console, catch=True)
    for label, r in results.items():
        r.update(meta[label])

    def step(gemm: str, lora: bool) -> float | None:  # the step without packs
        r = results.get(f"{'LoRA, 4 adapters' if lora else 'base model'}, {gemm}")
        return None if r is None else r["step_s"]

    table = Table(title=f"prefill step, {cfg.layers} layers, T = {T} (median of "
                        f"{args.repeats} runs of {inner} steps)", header_style="bold")
    for col in ("variant", "time / step", "min", "LoRA overhead", "vs ragged_dot"):
        table.add_column(col)
    for label, *_ in variants:
        if label in errors:
            table.add_row(label, "failed", errors[label], "", "")
            continue
        r = results[label]
        base, ragged = step(r["expert_gemm"], False), step("ragged_dot", r["lora"])
        over = (f"{100.0 * (r['step_s'] - base) / base:+.1f} %" if r["lora"] and base
                else "")
        speed = (f"{ragged / r['step_s']:.2f}x" if ragged and r["expert_gemm"] != "ragged_dot"
                 else "")
        table.add_row(label, _ms(r["step_s"]), _ms(r["min_s"]), over, speed)
    console.print(table)
    if args.trace:
        _trace_prefill(console, variants, results, state, h, inner, args.trace)
    if args.json:
        args.json.write_text(json.dumps(dict(
            mode="prefill_timing", backend=jax.default_backend(), device=device_name(),
            impl=impl, dtype=dtype, tokens=T, rows=rows, grouped=grouped, rank=args.rank,
            config=dataclasses.asdict(cfg), expert_path=args.expert_path,
            expert_matmul_kernel=kernel, steps_per_run=inner, repeats=args.repeats,
            results=results, errors=errors), indent=2))
    return 0


def _prefill_variants(model: DemoModel, impl: str, inner: int, ids) -> tuple[list, dict, Any]:
    """``(variants, meta, state)`` of ``--timing --prefill``: per grouped GEMM
    of ``PREFILL_GEMMS`` the base model and 4 adapters, and with
    ``expert_matmul`` (bf16/f16) the adapters once more with packs made once
    (``pack_lora_in_gemm``); ``state``: the model's and the stack's packs."""
    packable = jnp.dtype(DTYPES[model.cfg.dtype]) in PACK_DTYPES
    variants, meta = [], {}
    for gemm in PREFILL_GEMMS:
        for b in model.blocks:
            b.expert_gemm = gemm
        graphdef, state = nnx.split(model)
        runs = [(False, "base model", False), (True, "LoRA, 4 adapters", False)]
        if gemm == "expert_matmul" and packable:
            runs.append((True, PACKED_LABEL, True))
        for use_lora, what, packed in runs:
            label = f"{what}, {gemm}"
            variants.append((label, _timed_loop(graphdef, impl, use_lora, inner, packs=packed),
                             ids))
            meta[label] = dict(expert_gemm=gemm, lora=use_lora, packs=packed)
    packs = (jax.jit(lambda s: nnx.merge(graphdef, s).stack.in_gemm_packs())(state)
             if packable else None)
    return variants, meta, (state, packs)


def _trace_prefill(console, variants, results: dict[str, dict], state, h, inner: int,
                   folder: Path) -> None:
    """``--trace`` of ``--timing --prefill``: the kernels of each variant that
    ran (``results[label]["kernels"]``, under ``folder/prefill<i>``), and the
    LoRA variants' overhead split against their grouped GEMM's base model."""
    for i, (label, fn, ids) in enumerate(variants):
        if label in results:
            results[label]["kernels"] = _trace_kernels(console, label, fn, state, h, ids,
                                                       inner, folder / f"prefill{i}")
    for gemm in PREFILL_GEMMS:
        b = results.get(f"base model, {gemm}")
        for name in ("LoRA, 4 adapters", PACKED_LABEL):
            lo = results.get(f"{name}, {gemm}")
            if b and lo and "kernels" in b and "kernels" in lo:
                lo["overhead_split"] = _print_split(console, f"{name}, {gemm}", b["kernels"],
                                                    lo["kernels"])


def _main(argv: list[str] | None = None) -> int:  # pragma: no cover - convenience
    parser = argparse.ArgumentParser(prog="python -m jax_moelora.tools.demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(_main())
