"""Fine-tune two LoRA adapters at once: ``python -m jax_moelora train``.

The model: ``--layers`` x (RMSNorm -> :class:`MoEBlock` -> residual)
(:class:`MoEStack`) of the chosen family, seeded random base weights, frozen.
The task (synthetic): a teacher, the same model with two hidden adapters of
random factors in its slots 0 and 1, maps random hidden states ``x [T, H]`` to
targets; the student trains two fresh adapters (PEFT's init: ``A`` random,
``B`` zero, so both start as the base model) at once: the tokens of every
batch alternate between them (``adapter_ids`` 0, 1, 0, 1, ...), each adapter
learns its teacher from its own tokens. Loss: the mean squared error of the
stack's output; optax adam on the LoRA pools only (``nnx.split(model,
nnx.LoRAParam, ...)`` and ``jax.value_and_grad`` w.r.t. the LoRA state: the
base weights and the adapter tables are constants of the step), every adapter
projection trained (router, gate, up, down; DeepSeek's shared experts).

Then both adapters are written as PEFT folders (``--out``,
``save_adapter_slot``), read back with ``load_peft_adapter`` and checked
against the trained state (their deltas, and the block outputs once installed
in a copy of the model). Where torch, transformers >= 5 and peft >= 0.21
import, each folder is loaded into a transformers model of the family with
the same base weights (``PeftModel.from_pretrained``), and the max difference
between its MoE layers' outputs and ours is printed.

``--timing`` measures the jitted step times instead: the forward of the base
model, the forward with the two adapters, and the training step with LoRA
gradients (``value_and_grad`` + adam update), median of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_moelora._optional import needs_extra

with needs_extra("nnx", "python -m jax_moelora train"):
    import optax
    from flax import nnx
from jax_moelora.tools.demo import DEMO_FAMILIES, DTYPES, device_name, make_console, time_variants
from jax_moelora.nnx import AdapterPool, MoEStack, save_adapter_slot, slot_adapter
from jax_moelora.nnx.reference import adapter_deltas
from jax_moelora.ops.folds import IMPLS, resolve_impl
from jax_moelora.peft import load_peft_adapter

__all__ = ["ADAPTER_NAMES", "TrainConfig", "add_arguments", "run"]

#: The two trained adapters: slot ``i`` is written as ``--out/ADAPTER_NAMES[i]``.
ADAPTER_NAMES = ("adapter_a", "adapter_b")
#: The end loss must be at most this fraction of the start loss.
MIN_LOSS_DROP = 0.5
#: Max relative difference of the reloaded adapters' deltas and block outputs.
ROUNDTRIP_TOL = 1e-5
#: Max difference to the transformers + peft block outputs (float32), relative
#: to the outputs' max, per activation dtype (the torch model runs float32).
PEER_TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The model, the task and the optimizer."""

    family: str = "qwen3"
    layers: int = 2
    hidden: int = 64
    inter: int = 32
    experts: int = 8
    top_k: int = 2
    rank: int = 4
    alpha: float = 8.0
    tokens: int = 256
    steps: int = 300
    lr: float = 1e-2
    teacher_amp: float = 0.5
    dtype: str = "float32"
    impl: str = "auto"
    seed: int = 0


# --------------------------------------------------------------------------
# model and task
# --------------------------------------------------------------------------

def build_student(cfg: TrainConfig) -> MoEStack:
    """The stack with two fresh adapters (slots 0 and 1) of rank ``cfg.rank``:
    ``A`` PEFT's init, ``B`` zero, scale ``alpha / rank``."""
    model = MoEStack(cfg.hidden, cfg.inter, cfg.experts, cfg.top_k, cfg.layers,
                     family=DEMO_FAMILIES[cfg.family], max_loras=len(ADAPTER_NAMES),
                     max_rank=cfg.rank, dtype=DTYPES[cfg.dtype], impl=cfg.impl,
                     rngs=nnx.Rngs(cfg.seed))
    rngs = nnx.Rngs(cfg.seed + 1)
    for block in model.blocks:
        for slot in range(len(ADAPTER_NAMES)):
            block.lora.init_adapter(slot, rngs=rngs, rank=cfg.rank, alpha=cfg.alpha)
    return model


def build_teacher(student: MoEStack, cfg: TrainConfig) -> MoEStack:
    """A copy of the student whose slots hold random teacher adapters: every
    projection, ``A ~ N(0, 1 / K)``, ``B ~ N(0, teacher_amp^2 / rank)``."""
    teacher = nnx.clone(student)
    rng = np.random.default_rng(cfg.seed + 2)  # host draws: no compile per shape
    scale = np.float32(cfg.alpha / cfg.rank)
    for block in teacher.blocks:
        for name in block.lora.projections:
            proj = block.lora.projection(name)
            E, K, N = proj.n_experts, proj.k_in, proj.n_out
            for slot in range(len(ADAPTER_NAMES)):
                a = rng.standard_normal((E, cfg.rank, K), np.float32) / np.sqrt(K)
                b = rng.standard_normal((E, N, cfg.rank), np.float32) * (
                    cfg.teacher_amp / np.sqrt(cfg.rank))
                proj.write_slot(slot, a / scale, b, np.full(E, scale), np.ones(E, bool))
    return teacher


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Adam, its learning rate decayed from ``cfg.lr`` to ``cfg.lr / 100`` over
    the steps on a cosine (each step draws a new batch: the decay takes the
    noise of the last steps away)."""
    return optax.adam(optax.cosine_decay_schedule(cfg.lr, cfg.steps, alpha=0.01))


def task_ids(tokens: int) -> jax.Array:
    """int32 ``[tokens]``: 0, 1, 0, 1, ... (each token's adapter slot)."""
    return jnp.arange(tokens, dtype=jnp.int32) % len(ADAPTER_NAMES)


def mse(out: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error, float32."""
    return jnp.mean(jnp.square(out.astype(jnp.float32) - target.astype(jnp.float32)))


def make_batch_fn(graphdef: Any, cfg: TrainConfig) -> Callable:
    """Jitted ``(teacher_state, key) -> (x [T, H] dtype, target [T, H] f32)``:
    random hidden states and the teacher's outputs on them."""
    ids = task_ids(cfg.tokens)

    def batch(state, key):
        x = jax.random.normal(key, (cfg.tokens, cfg.hidden), jnp.float32)
        x = x.astype(DTYPES[cfg.dtype])
        return x, nnx.merge(graphdef, state)(x, ids).astype(jnp.float32)

    return jax.jit(batch)


def make_train_step(graphdef: Any, tx: optax.GradientTransformation, impl: str, *,
                    donate: bool = True) -> Callable:
    """Jitted ``(lora, opt_state, rest, x, ids, target) -> (lora, opt_state,
    loss)``: the MSE's gradient w.r.t. the LoRA state alone (``lora``: the
    ``nnx.LoRAParam`` pools; ``rest``: everything else, held constant), then
    one optax update. ``donate`` reuses the old LoRA and optimizer buffers."""

    def step(lora, opt_state, rest, x, ids, target):
        def loss_fn(lora):
            return mse(nnx.merge(graphdef, lora, rest)(x, ids, impl=impl), target)

        loss, grads = jax.value_and_grad(loss_fn)(lora)
        updates, opt_state = tx.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def make_forward(graphdef: Any, impl: str, *, use_lora: bool = True) -> Callable:
    """Jitted ``(lora, rest, x, ids) -> (out, block_inputs, block_outputs)``."""

    def forward(lora, rest, x, ids):
        return nnx.merge(graphdef, lora, rest).layers(x, ids, impl=impl, use_lora=use_lora)

    return jax.jit(forward)


def eval_losses(forward: Callable, lora, rest, x, ids, target) -> list[float]:
    """``[MSE over all tokens, over adapter 0's tokens, over adapter 1's]``."""
    err = np.square(np.asarray(forward(lora, rest, x, ids)[0], np.float32) - np.asarray(target))
    ids = np.asarray(ids)
    return [float(err.mean())] + [float(err[ids == s].mean()) for s in range(len(ADAPTER_NAMES))]


# --------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------

@dataclasses.dataclass
class TrainResult:
    """What a training run produced."""

    student: MoEStack
    start: list[float]  # eval losses: all tokens, adapter 0's, adapter 1's
    end: list[float]
    curve: list[tuple[int, float]]  # (step, training loss)
    train_s: float  # wall time of the steps, compile included
    compile_s: float  # of the first step
    eval_batch: tuple[Any, Any, Any]  # (x, ids, target) of the eval losses


def _progress(console) -> Any:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"),
                    TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                    console=console)


def train(cfg: TrainConfig, console, *, log_every: int = 10) -> TrainResult:
    """Train the student's two adapters on the teacher task for ``cfg.steps``
    steps with a progress bar (the loss fetched every ``log_every`` steps);
    evaluate on a fixed held-out batch before and after. The steps donate the
    LoRA and optimizer buffers; the student gets the trained LoRA state at
    the end."""
    student = build_student(cfg)
    teacher = build_teacher(student, cfg)
    t_graph, t_state = nnx.split(teacher)
    graphdef, lora, rest = nnx.split(student, nnx.LoRAParam, ...)
    tx = optimizer(cfg)
    opt_state = tx.init(lora)
    batch = make_batch_fn(t_graph, cfg)
    step = make_train_step(graphdef, tx, cfg.impl)
    forward = make_forward(graphdef, cfg.impl)
    ids = task_ids(cfg.tokens)
    key = jax.random.key(cfg.seed + 3)
    x_eval, t_eval = batch(t_state, jax.random.key(cfg.seed + 4))
    start = eval_losses(forward, lora, rest, x_eval, ids, t_eval)
    console.print(f"start loss {start[0]:.5g} ({ADAPTER_NAMES[0]} {start[1]:.5g}, "
                  f"{ADAPTER_NAMES[1]} {start[2]:.5g}) on a held-out batch")
    curve, pending = [], []
    t0 = time.perf_counter()
    with _progress(console) as progress:
        task = progress.add_task("training 2 adapters", total=cfg.steps, loss="-")
        for i in range(cfg.steps):
            x, target = batch(t_state, jax.random.fold_in(key, i))
            lora, opt_state, loss = step(lora, opt_state, rest, x, ids, target)
            if i == 0:
                compile_s = time.perf_counter() - t0
            pending.append((i, loss))
            if len(pending) == log_every or i == cfg.steps - 1:
                curve += [(j, float(v)) for j, v in pending]  # waits for the steps
                pending = []
                progress.update(task, completed=i + 1, loss=f"{curve[-1][1]:.4g}")
    train_s = time.perf_counter() - t0
    end = eval_losses(forward, lora, rest, x_eval, ids, t_eval)
    console.print(f"end loss {end[0]:.5g} ({ADAPTER_NAMES[0]} {end[1]:.5g}, "
                  f"{ADAPTER_NAMES[1]} {end[2]:.5g}) after {cfg.steps} steps: "
                  f"x{end[0] / start[0]:.3g}")
    nnx.update(student, lora)
    return TrainResult(student, start, end, curve, train_s, compile_s, (x_eval, ids, t_eval))


# --------------------------------------------------------------------------
# PEFT export and the checks of what was written
# --------------------------------------------------------------------------

def _delta_error(want: dict, got: dict) -> float:
    """Max relative difference of two ``{layer: {projection: ProjectionLoRA}}``'s
    dense deltas (``inf`` when their projections differ)."""
    if sorted(want) != sorted(got):
        return float("inf")
    worst = 0.0
    for layer, projs in want.items():
        if sorted(projs) != sorted(got[layer]):
            return float("inf")
        dw, dg = adapter_deltas(projs), adapter_deltas(got[layer])
        for name, d in dw.items():
            scale = max(float(np.abs(d).max()), 1e-30)
            worst = max(worst, float(np.abs(dg[name] - d).max()) / scale)
    return worst


def roundtrip_error(student: MoEStack, slot: int, folder: Path) -> float:
    """Max relative difference between adapter ``slot``'s trained deltas and
    those ``load_peft_adapter`` reads from ``folder`` (every layer and
    projection, shared experts included)."""
    blocks = list(student.blocks)
    b0 = blocks[0]
    trained = slot_adapter(blocks, slot)
    loaded = load_peft_adapter(folder, num_experts=b0.num_experts, hidden_size=b0.hidden_size,
                               intermediate_size=b0.intermediate_size,
                               gate_up_split=b0.family.gate_up_split)
    return max(_delta_error(trained.layers, loaded.layers),
               _delta_error(trained.shared_experts, loaded.shared_experts))


def reload_error(student: MoEStack, slot: int, folder: Path, forward: Callable, x,
                 ids) -> float:
    """The folder loaded into a copy of the student (``AdapterPool.load`` into
    ``slot``): max difference of the stack's outputs over adapter ``slot``'s
    tokens, relative to their max."""
    copy = nnx.clone(student)
    AdapterPool(list(copy.blocks)).load(folder, slot=slot)
    _, lora, rest = nnx.split(student, nnx.LoRAParam, ...)
    _, lora2, rest2 = nnx.split(copy, nnx.LoRAParam, ...)
    mine = np.asarray(forward(lora, rest, x, ids)[0], np.float32)[np.asarray(ids) == slot]
    got = np.asarray(forward(lora2, rest2, x, ids)[0], np.float32)[np.asarray(ids) == slot]
    return float(np.abs(got - mine).max() / max(np.abs(mine).max(), 1e-30))


def export_adapters(student: MoEStack, cfg: TrainConfig, out: Path, forward: Callable,
                    x, ids) -> list[dict[str, Any]]:
    """Write both adapters under ``out`` and check each one read back."""
    rows = []
    for slot, name in enumerate(ADAPTER_NAMES):
        folder = save_adapter_slot(out / name, list(student.blocks), slot,
                                   base_model_name_or_path=f"jax_moelora-train/{cfg.family}")
        rows.append(dict(name=name, slot=slot, path=str(folder),
                         files=sorted(p.name for p in folder.iterdir()),
                         roundtrip_error=roundtrip_error(student, slot, folder),
                         reload_error=reload_error(student, slot, folder, forward, x, ids)))
    return rows


def peer_errors(student: MoEStack, rows: list[dict[str, Any]], forward: Callable,
                x) -> list[float]:
    """Per adapter: every token on it, each MoE layer of the transformers +
    peft model (the adapter's folder loaded) on our layer's input; the max
    difference of the outputs relative to their max, over layers."""
    from jax_moelora.tools.transformers_peer import peft_block_outputs

    _, lora, rest = nnx.split(student, nnx.LoRAParam, ...)
    errors = []
    for row in rows:
        ids = jnp.full((x.shape[0],), row["slot"], jnp.int32)
        _, ins, outs = forward(lora, rest, x, ids)
        ins, outs = np.asarray(ins, np.float32), np.asarray(outs, np.float32)
        theirs = peft_block_outputs(list(student.blocks), row["path"], list(ins))
        errors.append(max(float(np.abs(t - o).max() / max(np.abs(o).max(), 1e-30))
                          for t, o in zip(theirs, outs)))
    return errors


# --------------------------------------------------------------------------
# --timing
# --------------------------------------------------------------------------

def run_timing(cfg: TrainConfig, console, *, repeats: int) -> dict[str, Any]:
    """Median step times (``repeats`` runs, round robin, after one compile
    run each) of the base forward, the forward with both adapters and the
    training step with LoRA gradients; prints a table with the ratios."""
    from rich.table import Table

    student = build_student(cfg)
    teacher = build_teacher(student, cfg)
    graphdef, lora, rest = nnx.split(student, nnx.LoRAParam, ...)
    tx = optimizer(cfg)
    t_graph, t_state = nnx.split(teacher)
    x, target = make_batch_fn(t_graph, cfg)(t_state, jax.random.key(cfg.seed + 3))
    state = dict(lora=lora, rest=rest, opt=tx.init(lora), target=target)
    fwd_base = make_forward(graphdef, cfg.impl, use_lora=False)
    fwd_lora = make_forward(graphdef, cfg.impl)
    step = make_train_step(graphdef, tx, cfg.impl, donate=False)
    variants = [
        ("forward, base model", lambda s, h, i: fwd_base(s["lora"], s["rest"], h, i)[0]),
        ("forward, 2 adapters", lambda s, h, i: fwd_lora(s["lora"], s["rest"], h, i)[0]),
        ("train step: LoRA grads + adam",
         lambda s, h, i: step(s["lora"], s["opt"], s["rest"], h, i, s["target"])),
    ]
    ids = task_ids(cfg.tokens)
    results, _ = time_variants([(label, fn, ids) for label, fn in variants], state, x,
                               repeats=repeats, inner=1, console=console)
    fwd = results["forward, 2 adapters"]["step_s"]
    table = Table(title=f"step time, {cfg.layers} x {cfg.family} layer, T = {cfg.tokens} "
                        f"(median of {repeats} runs)", header_style="bold")
    for col in ("variant", "time / step", "min", "vs forward with LoRA"):
        table.add_column(col)
    for label, r in results.items():
        table.add_row(label, f"{r['step_s'] * 1e3:.3f} ms", f"{r['min_s'] * 1e3:.3f} ms",
                      f"{r['step_s'] / fwd:.2f}x")
    console.print(table)
    ratio = results["train step: LoRA grads + adam"]["step_s"] / fwd
    console.print(f"training step with LoRA gradients: {ratio:.2f}x the forward with LoRA")
    return dict(mode="timing", results=results, train_over_forward=ratio)


# --------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The example's options (``python -m jax_moelora train --help``)."""
    d = TrainConfig()
    parser.add_argument("--family", choices=list(DEMO_FAMILIES), default=d.family,
                        help=f"model family (default {d.family}; deepseek is DeepSeek-V3)")
    parser.add_argument("--steps", type=int, default=d.steps,
                        help=f"training steps (default {d.steps})")
    parser.add_argument("--tokens", type=int, default=d.tokens,
                        help=f"tokens per step, alternating between the two adapters "
                             f"(default {d.tokens})")
    parser.add_argument("--rank", type=int, default=d.rank,
                        help=f"LoRA rank of the trained and the teacher adapters "
                             f"(default {d.rank})")
    parser.add_argument("--alpha", type=float, default=None,
                        help="lora_alpha (default 2 * rank): scale alpha / rank")
    parser.add_argument("--lr", type=float, default=d.lr,
                        help=f"adam learning rate (default {d.lr})")
    parser.add_argument("--layers", type=int, default=d.layers,
                        help=f"MoE layers (default {d.layers})")
    for name, help_text in (("hidden", "hidden size"), ("inter", "expert width"),
                            ("experts", "routed experts"), ("top-k", "experts per token")):
        default = getattr(d, name.replace("-", "_"))
        parser.add_argument(f"--{name}", type=int, default=default,
                            help=f"{help_text} (default {default})")
    parser.add_argument("--dtype", choices=list(DTYPES), default=d.dtype,
                        help=f"activation and parameter dtype (default {d.dtype})")
    parser.add_argument("--impl", choices=IMPLS, default=d.impl, help="fold backend")
    parser.add_argument("--seed", type=int, default=d.seed, help="random seed")
    parser.add_argument("--out", type=Path, default=Path("train_out"),
                        help="folder for the two PEFT adapter folders (default train_out)")
    parser.add_argument("--no-transformers", action="store_true",
                        help="skip loading the adapters into transformers + peft")
    parser.add_argument("--timing", action="store_true",
                        help="time the forward and the training step instead of training")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed runs per variant in --timing (median; default 20)")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """A validated :class:`TrainConfig` (``SystemExit`` naming a bad option)."""
    for name in ("steps", "tokens", "rank", "layers", "hidden", "inter", "experts", "top_k",
                 "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.tokens < len(ADAPTER_NAMES):
        raise SystemExit(f"--tokens must be >= {len(ADAPTER_NAMES)} (one per adapter)")
    if not args.lr > 0:
        raise SystemExit("--lr must be > 0")
    try:
        impl = resolve_impl(args.impl)
    except ValueError as err:
        raise SystemExit(f"--impl {args.impl}: {err}") from err
    alpha = 2.0 * args.rank if args.alpha is None else args.alpha
    cfg = TrainConfig(family=args.family, layers=args.layers, hidden=args.hidden,
                      inter=args.inter, experts=args.experts, top_k=args.top_k,
                      rank=args.rank, alpha=alpha, tokens=args.tokens, steps=args.steps,
                      lr=args.lr, dtype=args.dtype, impl=impl, seed=args.seed)
    try:
        DEMO_FAMILIES[cfg.family].check(cfg.experts, cfg.top_k)
    except ValueError as err:
        raise SystemExit(f"--experts {cfg.experts} / --top-k {cfg.top_k}: {err}") from err
    return cfg


def _peer(result: TrainResult, rows: list[dict], forward: Callable, cfg: TrainConfig,
          console, skip: bool) -> tuple[list[float] | None, str]:
    """The transformers + peft comparison, or why it was skipped."""
    from jax_moelora.tools.transformers_peer import peer_missing

    why = "--no-transformers" if skip else peer_missing()
    if why is not None:
        console.print(f"transformers + peft check skipped: {why}")
        return None, why
    errors = peer_errors(result.student, rows, forward, result.eval_batch[0])
    for row, err in zip(rows, errors):
        console.print(f"{row['name']} in transformers + peft: max |ours - theirs| / max |ours| "
                      f"= {err:.2e} over {cfg.layers} MoE layers (tol {PEER_TOL[cfg.dtype]:g})")
    return errors, ""


def _summary(console, cfg: TrainConfig, result: TrainResult, rows, peer, why) -> None:
    from rich.table import Table

    table = Table(title="jax_moelora train summary", header_style="bold")
    table.add_column("item")
    table.add_column("value")
    table.add_row("model", f"{cfg.layers} x {cfg.family} MoE layer: E {cfg.experts}, top_k "
                           f"{cfg.top_k}, hidden {cfg.hidden}, inter {cfg.inter}, {cfg.dtype}")
    table.add_row("training", f"{cfg.steps} steps of {cfg.tokens} tokens (2 adapters), rank "
                              f"{cfg.rank}, alpha {cfg.alpha:g}, adam lr {cfg.lr:g} (cosine "
                              f"decay), impl {cfg.impl} on {device_name()}")
    table.add_row("loss (held-out batch)", f"{result.start[0]:.5g} -> {result.end[0]:.5g} "
                                           f"(x{result.end[0] / result.start[0]:.3g})")
    for s, name in enumerate(ADAPTER_NAMES):
        table.add_row(f"  {name}", f"{result.start[s + 1]:.5g} -> {result.end[s + 1]:.5g}")
    steps_s = (result.train_s - result.compile_s) / max(cfg.steps - 1, 1)
    table.add_row("time", f"{result.train_s:.1f} s ({result.compile_s:.1f} s compile, then "
                          f"{steps_s * 1e3:.2f} ms a step, the teacher's batch included)")
    for row in rows:
        table.add_row(f"PEFT {row['name']}", f"{row['path']}: {', '.join(row['files'])}")
        table.add_row("  read back", f"delta error {row['roundtrip_error']:.1e}, outputs "
                                     f"{row['reload_error']:.1e}")
    table.add_row("transformers + peft", why if peer is None else
                  ", ".join(f"{r['name']} {e:.1e}" for r, e in zip(rows, peer)))
    console.print(table)


def run(args: argparse.Namespace) -> int:
    """Train (or ``--timing``); 0 when the loss fell and every check passed."""
    cfg = config_from_args(args)
    console = make_console()
    console.print(f"[bold]jax_moelora train[/bold]: {cfg.layers} x {cfg.family} MoE layer (E "
                  f"{cfg.experts}, top_k {cfg.top_k}, hidden {cfg.hidden}, inter {cfg.inter}), "
                  f"2 adapters of rank {cfg.rank}, {cfg.tokens} tokens a step, {cfg.dtype}, "
                  f"impl {cfg.impl} on {device_name()}")
    if args.timing:
        out = run_timing(cfg, console, repeats=args.repeats)
        if args.json:
            args.json.write_text(json.dumps(dict(out, config=dataclasses.asdict(cfg)), indent=2))
        return 0
    result = train(cfg, console)
    graphdef = nnx.split(result.student, nnx.LoRAParam, ...)[0]
    forward = make_forward(graphdef, cfg.impl)
    x, ids, _ = result.eval_batch
    rows = export_adapters(result.student, cfg, args.out, forward, x, ids)
    for row in rows:
        console.print(f"wrote {row['path']} ({', '.join(row['files'])}); read back: delta "
                      f"error {row['roundtrip_error']:.1e}, outputs {row['reload_error']:.1e}")
    peer, why = _peer(result, rows, forward, cfg, console, args.no_transformers)
    _summary(console, cfg, result, rows, peer, why)
    fell = result.end[0] <= MIN_LOSS_DROP * result.start[0]
    read_ok = all(max(r["roundtrip_error"], r["reload_error"]) <= ROUNDTRIP_TOL for r in rows)
    peer_ok = peer is None or all(e <= PEER_TOL[cfg.dtype] for e in peer)
    passed = fell and read_ok and peer_ok
    console.print("[green]PASS[/green]" if passed else
                  f"[red]FAIL[/red]: loss fell {fell}, read back {read_ok}, transformers {peer_ok}")
    if args.json:
        args.json.write_text(json.dumps(dict(
            mode="train", config=dataclasses.asdict(cfg), device=device_name(),
            start_loss=result.start, end_loss=result.end, curve=result.curve,
            train_s=result.train_s, compile_s=result.compile_s, adapters=rows,
            transformers=peer, transformers_skipped=why or None, passed=passed), indent=2))
    return 0 if passed else 1
