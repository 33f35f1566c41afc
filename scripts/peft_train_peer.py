#!/usr/bin/env python3
"""The transformers + peft peer of ``python -m jax_moelora bench --train``.

Builds transformers' sparse MoE block of each model with its shapes, bf16, the
experts implementation ``grouped_mm`` (``config._experts_implementation``, the
attribute transformers 5's ``@use_experts_implementation`` experts dispatch
on), random weights (router included), and one peft LoRA adapter of rank
``--rank`` on ``experts.gate_up_proj`` and ``experts.down_proj``
(``LoraConfig(target_parameters=...)``; base weights frozen, adapter weights in
``--adapter-dtype``), then times with CUDA events, on ``x [1, T, H]`` (N(0, 1),
bf16, no gradient):

- ``base_fwd``: the block with the adapter disabled, under ``torch.no_grad``;
- ``fwd``: the block with the adapter, under ``torch.no_grad``;
- ``fwd_bwd``: the block with the adapter, ``loss = sum(y * cot)`` in f32 (a
  fixed N(0, 1) bf16 ``cot``) and ``loss.backward()`` (the adapter's
  gradients; they are set to None before each step, outside the timed span).

Each program: ``--warmup`` untimed steps, then the median of ``--iters`` steps,
each between two CUDA events. ``peak_bytes``: ``torch.cuda.max_memory_allocated``
during one step (the block's weights included); ``vs_fwd``: time over ``fwd``'s.

Models: ``qwen`` (Qwen3-30B-A3B: ``Qwen3MoeSparseMoeBlock``, hidden 2048,
moe_intermediate 768, 128 experts, top-8, norm_topk_prob), ``mixtral``
(Mixtral-8x7B: ``MixtralSparseMoeBlock``, 4096, 14336, 8, top-2),
``deepseek`` (DeepSeek-V2-Lite: ``DeepseekV2Moe``, 2048, 1408, 64, top-6, two
shared experts, without LoRA), or ``name:experts:top_k:hidden:inter`` (a
Qwen3-MoE block of those shapes). Needs torch with CUDA, transformers >= 5
and peft >= 0.21 (``--device cpu`` runs it on the CPU, wall-clock timed: a
smoke test). Prints a table; ``--json PATH`` writes ``{"meta", "rows"}``.

  python3 scripts/peft_train_peer.py --models qwen --tokens 512,4096 --rank 16 --json peer.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

TARGETS = ["experts.gate_up_proj", "experts.down_proj"]
PROGRAMS = ("base_fwd", "fwd", "fwd_bwd")
# name -> (module, config class, block class, config kwargs)
MODELS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "qwen": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
             dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                  num_experts_per_tok=8, norm_topk_prob=True)),
    "mixtral": ("mixtral", "MixtralConfig", "MixtralSparseMoeBlock",
                dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                     num_experts_per_tok=2)),
    "deepseek": ("deepseek_v2", "DeepseekV2Config", "DeepseekV2Moe",
                 dict(hidden_size=2048, moe_intermediate_size=1408, n_routed_experts=64,
                      num_experts_per_tok=6, n_shared_experts=2, topk_method="greedy",
                      norm_topk_prob=False, routed_scaling_factor=1.0)),
}
NAMES = {"qwen": "Qwen3-30B-A3B", "mixtral": "Mixtral-8x7B", "deepseek": "DeepSeek-V2-Lite"}


def _imports() -> tuple[Any, Any, Any]:
    """``(torch, transformers, peft)``, or exit 2 naming what is missing."""
    try:
        import peft
        import torch
        import transformers
    except ImportError as err:
        sys.exit(f"peft_train_peer: needs torch, transformers >= 5 and peft >= 0.21 ({err})")
    if int(transformers.__version__.split(".")[0]) < 5:
        sys.exit(f"peft_train_peer: needs transformers >= 5 (its experts implementations), "
                 f"found {transformers.__version__}")
    return torch, transformers, peft


def model_spec(name: str) -> tuple[str, str, str, dict[str, Any]]:
    """The ``MODELS`` entry of ``name``, or a Qwen3-MoE block of a custom
    ``name:experts:top_k:hidden:inter``."""
    if name in MODELS:
        return MODELS[name]
    parts = name.split(":")
    if len(parts) != 5:
        raise ValueError(f"unknown model {name!r}: one of {', '.join(MODELS)} or "
                         "name:experts:top_k:hidden:inter")
    e, k, h, i = (int(p) for p in parts[1:])
    return ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
            dict(hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k,
                 norm_topk_prob=True))


def build_block(name: str, rank: int, adapter_dtype: str, device: str, seed: int = 0):
    """The block of ``name`` with one LoRA adapter of rank ``rank`` on the
    expert weights: ``(block, lora_params)``; bf16 base weights (N(0,
    1/fan_in)), frozen."""
    torch, transformers, peft = _imports()
    import importlib

    module, config_cls, block_cls, kwargs = model_spec(name)
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config = getattr(transformers, config_cls)(**kwargs)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    block = getattr(mod, block_cls)(config)
    if block.experts.config._experts_implementation != "grouped_mm":
        raise RuntimeError("the experts do not dispatch on config._experts_implementation")
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5) if p.dim() > 1 else p.zero_()
    block = block.to(device=device, dtype=torch.bfloat16)
    lora = peft.LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=[],
                           target_parameters=TARGETS, init_lora_weights=False)
    block = peft.inject_adapter_in_model(lora, block)
    dtype = torch.bfloat16 if adapter_dtype == "bf16" else torch.float32
    params = []
    for n, p in block.named_parameters():
        p.requires_grad_("lora_" in n)
        if "lora_" in n:
            p.data = p.data.to(device=device, dtype=dtype)
            params.append(p)
    if not params:
        raise RuntimeError("peft injected no LoRA parameters")
    return block, params


def set_adapter(block, enabled: bool) -> None:
    """Enable or disable the block's LoRA layers (peft's ``enable_adapters``)."""
    from peft.tuners.lora import LoraLayer

    for m in block.modules():
        if isinstance(m, LoraLayer):
            m.enable_adapters(enabled)


def time_steps(step: Callable[[], None], before: Callable[[], None], *, warmup: int, iters: int,
               cuda: bool) -> list[float]:
    """Seconds of each of ``iters`` calls of ``step`` after ``warmup`` (CUDA
    events on a GPU, else wall clock); ``before`` runs untimed before each."""
    import torch

    times = []
    for i in range(warmup + iters):
        before()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            step()
            t = time.perf_counter() - t0
        if i >= warmup:
            times.append(t)
    return times


def peak_bytes(step: Callable[[], None], before: Callable[[], None], cuda: bool) -> int | None:
    """``torch.cuda.max_memory_allocated`` over one call of ``step``."""
    import torch

    if not cuda:
        return None
    before()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def programs(block, params: list, x, cot) -> dict[str, Callable[[], None]]:
    """The timed steps (``PROGRAMS``)."""
    import torch

    def fwd() -> None:
        with torch.no_grad():
            block(x)

    def fwd_bwd() -> None:
        loss = (block(x).float() * cot.float()).sum()
        loss.backward()

    def base_fwd() -> None:
        set_adapter(block, False)
        try:
            fwd()
        finally:
            set_adapter(block, True)

    return {"base_fwd": base_fwd, "fwd": fwd, "fwd_bwd": fwd_bwd}


def bench_model(name: str, tokens: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of one model and token count."""
    import torch

    cuda = args.device == "cuda"
    block, params = build_block(name, args.rank, args.adapter_dtype, args.device, args.seed)
    hidden = model_spec(name)[3]["hidden_size"]
    g = torch.Generator(device=args.device).manual_seed(args.seed + tokens)
    x = torch.randn(1, tokens, hidden, generator=g, device=args.device, dtype=torch.bfloat16)
    cot = torch.randn(1, tokens, hidden, generator=g, device=args.device, dtype=torch.bfloat16)

    def clear() -> None:
        for p in params:
            p.grad = None

    rows = []
    for prog, step in programs(block, params, x, cot).items():
        times = time_steps(step, clear, warmup=args.warmup, iters=args.iters, cuda=cuda)
        rows.append({"model": NAMES.get(name, name.split(":")[0]), "tokens": tokens,
                     "rank": args.rank, "adapters": 1, "program": prog,
                     "time_us": statistics.median(times) * 1e6,
                     "min_us": min(times) * 1e6, "peak_bytes": peak_bytes(step, clear, cuda),
                     "vs_fwd": None, "iters": args.iters})
    fwd = next(r for r in rows if r["program"] == "fwd")
    for r in rows:
        r["vs_fwd"] = r["time_us"] / fwd["time_us"]
    del block, params, x, cot
    if cuda:
        torch.cuda.empty_cache()
    return rows


def _meta(args: argparse.Namespace) -> dict[str, Any]:
    torch, transformers, peft = _imports()
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__,
            "device": (torch.cuda.get_device_name() if args.device == "cuda" else "cpu"),
            "experts_implementation": "grouped_mm", "targets": TARGETS, "dtype": "bfloat16",
            "adapter_dtype": args.adapter_dtype, "warmup": args.warmup, "iters": args.iters,
            "grouped_mm": ("torch.nn.functional.grouped_mm"
                           if hasattr(torch.nn.functional, "grouped_mm") else
                           "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else None),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen",
                   help="comma-separated: qwen, mixtral, deepseek or "
                        "name:experts:top_k:hidden:inter")
    p.add_argument("--tokens", default="512,4096", help="comma-separated token counts")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapter-dtype", choices=("bf16", "fp32"), default="bf16",
                   help="the adapter weights' dtype (peft's get_peft_model default would "
                        "upcast them to fp32)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke test, wall-clock timed")
    p.add_argument("--json", default=None, metavar="PATH", help="write {meta, rows} here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch, _, _ = _imports()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("peft_train_peer: torch sees no CUDA device (--device cpu for a smoke test)")
    if args.iters < 1 or args.warmup < 0:
        sys.exit("peft_train_peer: --iters must be >= 1 and --warmup >= 0")
    meta, rows = _meta(args), []
    print(f"torch {meta['torch']}, transformers {meta['transformers']}, peft {meta['peft']} "
          f"on {meta['device']}; grouped_mm: {meta['grouped_mm']}")
    for name in args.models.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            for r in bench_model(name.strip(), tokens, args):
                rows.append(r)
                peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:,.0f}"
                print(f"{r['model']:>16} T={tokens:<6} r={r['rank']} {r['program']:<9} "
                      f"{r['time_us']:>10,.1f} µs  x{r['vs_fwd']:.2f} fwd  peak {peak} MiB",
                      flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
