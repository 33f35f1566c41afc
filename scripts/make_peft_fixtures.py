"""Make the golden PEFT fixtures of ``tests/fixtures/peft/`` with real torch, transformers and peft.

Each fixture is a tiny random transformers model (one MoE layer, 4 experts, hidden 24, expert
width 8) with a LoRA adapter whose factors are set to random non-zero values, saved by peft's own
``save_pretrained``. Next to the adapter folder (``adapter/``) the fixture holds:

- ``reference.safetensors`` (float32):
  - ``x`` ``[T, hidden]``: the fixed hidden states fed to the MoE block;
  - ``out_base`` / ``out_lora`` ``[T, hidden]``: the model's MoE block (``model.layers.0.mlp``)
    on ``x`` without and with the adapter, the adapter loaded back from the saved folder with
    ``PeftModel.from_pretrained``;
  - ``base.<name>``: every parameter and buffer of that MoE block, ``<name>`` as in the model's
    ``state_dict`` (e.g. ``base.model.layers.0.mlp.experts.gate_up_proj`` ``[E, 2I, H]``);
  - ``delta.<name>``: for every adapted parameter, the dense delta peft adds to it when merging
    (``get_delta_weight`` of the loaded adapter), in the parameter's own layout.
- ``fixture.json``: the family, model widths, routing settings, the LoRA config passed, the
  ``PYTHONHASHSEED`` and the torch/transformers/peft versions that made it.

Each fixture names the peft release line it needs; a run makes those the installed peft can make
and skips the rest. Run with each environment, e.g.::

    /work/venv-torch/bin/python scripts/make_peft_fixtures.py           # peft 0.21, transformers 5
    /work/venv-peft018t5/bin/python scripts/make_peft_fixtures.py       # peft 0.18, transformers 5
    /work/venv-peft0190t5/bin/python scripts/make_peft_fixtures.py      # peft 0.19.0, tf 5.5
    /work/venv-peft018/bin/python scripts/make_peft_fixtures.py         # peft 0.18, transformers 4

Every fixture is made in its own subprocess with its ``PYTHONHASHSEED`` (peft keeps the rewritten
``target_parameters`` in a set, so the saved order follows the hash seed). Fixtures made by
converting another fixture's adapter (``source``) need that one first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "peft"

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 24, 8, 4, 2, 6


@dataclasses.dataclass(frozen=True)
class Fixture:
    """One fixture: the model family, the peft release line that writes it, the LoRA config."""

    name: str
    family: str  # qwen3_moe | mixtral | gpt_oss | deepseek_v2 | deepseek_v3
    peft: str  # the release line: "0.21" | "0.19" (0.19.0) | "0.18"
    transformers: int  # major version: 4 (per-expert nn.Linear experts) or 5 (fused experts)
    lora: dict[str, Any]
    hashseed: int = 0
    source: str | None = None  # convert this fixture's adapter instead of making a new one
    what: str = ""


FIXTURES = [
    # peft 0.21 + transformers 5: target_parameters on the fused experts
    Fixture("qwen3_dotted", "qwen3_moe", "0.21", 5,
            dict(r=4, lora_alpha=8, target_parameters=["experts.gate_up_proj", "experts.down_proj",
                                                       "mlp.gate.weight"]),
            what="explicit dotted target_parameters, router included"),
    Fixture("qwen3_dotted_rslora_patterns", "qwen3_moe", "0.21", 5,
            dict(r=4, lora_alpha=8, use_rslora=True,
                 target_parameters=["experts.gate_up_proj", "experts.down_proj"],
                 rank_pattern={r"experts\.down_proj": 2}, alpha_pattern={"down_proj": 3}),
            what="rsLoRA, rank_pattern and alpha_pattern (regex keys) on target_parameters"),
    Fixture("qwen3_bare", "qwen3_moe", "0.21", 5,
            dict(r=2, lora_alpha=4, target_parameters=["down_proj", "gate_up_proj", "gate.weight"]),
            what="bare target_parameters names, down_proj listed first"),
    Fixture("qwen3_down_only", "qwen3_moe", "0.21", 5,
            dict(r=2, lora_alpha=4, target_parameters=["experts.down_proj"]),
            what="one expert parameter only"),
    Fixture("qwen3_recipe_seed0", "qwen3_moe", "0.21", 5,
            dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj", "gate"]),
            hashseed=0, what="the usual target_modules recipe, rewritten by peft"),
    Fixture("qwen3_recipe_seed1", "qwen3_moe", "0.21", 5,
            dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj", "gate"]),
            hashseed=1, what="the same recipe under another hash seed (other config order)"),
    Fixture("mixtral_recipe", "mixtral", "0.21", 5,
            dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["w1", "w3", "w2", "gate"]),
            what="Mixtral's recipe (w1/w3/w2), rewritten by peft, rsLoRA"),
    Fixture("mixtral_dotted", "mixtral", "0.21", 5,
            dict(r=4, lora_alpha=4, target_parameters=["mlp.experts.gate_up_proj",
                                                       "mlp.experts.down_proj"],
                 rank_pattern={"gate_up_proj": 2}),
            what="dotted target_parameters with a rank_pattern"),
    Fixture("gpt_oss_dotted", "gpt_oss", "0.21", 5,
            dict(r=2, lora_alpha=4, target_parameters=["mlp.experts.gate_up_proj",
                                                       "mlp.experts.down_proj",
                                                       "mlp.router.weight"]),
            what="gpt-oss: interleaved gate_up_proj [E, H, 2I] with biases, router with a bias"),
    Fixture("deepseek_v2_shared", "deepseek_v2", "0.21", 5,
            dict(r=2, lora_alpha=4, target_parameters=[
                "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                "shared_experts.down_proj.weight", "experts.gate_up_proj", "experts.down_proj"]),
            what="DeepSeek-V2: shared experts (their 2-D weights as target_parameters) and routed "
                 "experts; peft 0.21 rewrites target_modules naming shared_experts.*_proj into "
                 "the routed experts' parameters, so they are targeted as parameters"),
    Fixture("deepseek_v3_shared", "deepseek_v3", "0.18", 5,
            dict(r=2, lora_alpha=4, target_modules=["shared_experts.gate_proj",
                                                    "shared_experts.up_proj",
                                                    "shared_experts.down_proj"],
                 target_parameters=["experts.gate_up_proj", "experts.down_proj", "gate.weight"]),
            what="DeepSeek-V3 with peft 0.18: shared experts as nn.Linear modules, routed experts "
                 "(0.18 factors) and the router"),
    # peft 0.18 + transformers 5: the factors of [E, out, in] parameters the other way round
    Fixture("qwen3_peft018", "qwen3_moe", "0.18", 5,
            dict(r=4, lora_alpha=8,
                 target_parameters=["experts.gate_up_proj", "experts.down_proj"]),
            what="peft 0.18 target_parameters on transformers 5 fused experts"),
    Fixture("qwen3_peft018_gate_up_only", "qwen3_moe", "0.18", 5,
            dict(r=2, lora_alpha=4, target_parameters=["experts.gate_up_proj"]),
            what="peft 0.18, one expert parameter"),
    Fixture("gpt_oss_peft018", "gpt_oss", "0.18", 5,
            dict(r=2, lora_alpha=4, target_parameters=["mlp.experts.gate_up_proj",
                                                       "mlp.experts.down_proj"]),
            what="peft 0.18 on gpt-oss ([E, in, out] parameters: the same factors as 0.21)"),
    # peft 0.19.0 + transformers 5: lora_A reads the output of both kinds of 3-D parameter
    Fixture("qwen3_peft0190", "qwen3_moe", "0.19", 5,
            dict(r=2, lora_alpha=4,
                 target_parameters=["experts.gate_up_proj", "experts.down_proj"]),
            what="peft 0.19.0 on [E, out, in] parameters (the same factors as 0.18)"),
    Fixture("gpt_oss_peft0190", "gpt_oss", "0.19", 5,
            dict(r=2, lora_alpha=4, target_parameters=["mlp.experts.gate_up_proj",
                                                       "mlp.experts.down_proj"]),
            what="peft 0.19.0 on gpt-oss ([E, in, out] parameters: lora_A reads the output)"),
    # peft 0.18 + transformers 4: per-expert nn.Linear experts
    Fixture("qwen3_v4_experts", "qwen3_moe", "0.18", 4,
            dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj", "gate"]),
            what="transformers 4 per-expert experts.{e}.gate_proj/up_proj/down_proj, router"),
    Fixture("mixtral_v4_experts", "mixtral", "0.18", 4,
            dict(r=2, lora_alpha=4, target_modules=["w1", "w3", "w2", "gate"]),
            what="transformers 4 Mixtral block_sparse_moe.experts.{e}.w1/w3/w2 and the router"),
    # peft 0.21 + transformers 5 loading those transformers 4 adapters, then saving them
    Fixture("qwen3_v4_converted", "qwen3_moe", "0.21", 5, {}, source="qwen3_v4_experts",
            what="the transformers 4 adapter loaded into transformers 5 by peft and saved again: "
                 "block-diagonal gate_up lora_B"),
    Fixture("mixtral_v4_converted", "mixtral", "0.21", 5, {}, source="mixtral_v4_experts",
            what="the Mixtral transformers 4 adapter converted by peft"),
]


# --------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------

def model_config(family: str):
    import transformers as tf

    common = dict(vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
                  max_position_embeddings=64)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, num_key_value_heads=1, head_dim=8, intermediate_size=16,
                                 moe_intermediate_size=INTER, num_experts=EXPERTS,
                                 num_experts_per_tok=TOP_K, norm_topk_prob=True)
    if family == "mixtral":
        return tf.MixtralConfig(**common, num_key_value_heads=1, head_dim=8,
                                intermediate_size=INTER, num_local_experts=EXPERTS,
                                num_experts_per_tok=TOP_K)
    if family == "gpt_oss":
        return tf.GptOssConfig(**common, num_key_value_heads=1, head_dim=8,
                               intermediate_size=INTER, num_local_experts=EXPERTS,
                               num_experts_per_tok=TOP_K)
    deepseek = dict(common, num_key_value_heads=2, intermediate_size=16,
                    moe_intermediate_size=INTER,
                    n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=TOP_K,
                    first_k_dense_replace=0, kv_lora_rank=8, qk_rope_head_dim=4,
                    qk_nope_head_dim=4, v_head_dim=8, n_group=2, topk_group=1,
                    routed_scaling_factor=1.5)
    if family == "deepseek_v2":
        return tf.DeepseekV2Config(**deepseek, q_lora_rank=None, topk_method="group_limited_greedy",
                                   norm_topk_prob=False)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(**deepseek, q_lora_rank=8, norm_topk_prob=True)
    raise ValueError(family)


def routing_settings(config) -> dict[str, Any]:
    keys = ("norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group", "topk_method",
            "scoring_func", "swiglu_limit", "swiglu_alpha", "hidden_act", "n_shared_experts",
            "router_jitter_noise")
    return {k: getattr(config, k) for k in keys if hasattr(config, k)}


def make_base_model(family: str, seed: int):
    """The tiny model in float32 with every MoE-block tensor set from ``seed``."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(model_config(family)).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    mlp = model.model.layers[0].mlp if hasattr(model.model.layers[0], "mlp") else None
    block = mlp if mlp is not None else model.model.layers[0].block_sparse_moe
    with torch.no_grad():
        for name, t in sorted(list(block.named_parameters()) + list(block.named_buffers())):
            if not t.is_floating_point():
                continue
            scale = 0.1 if name.endswith("bias") else 0.3
            t.copy_(torch.randn(t.shape, generator=gen) * scale)
    return model


def moe_block(model):
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    layer = model.model.layers[0]
    return layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe


def block_forward(model, x):
    import torch

    with torch.no_grad():
        out = moe_block(model)(x[None])
    if isinstance(out, tuple):
        out = out[0]
    return out[0].float()


def block_state(model) -> dict[str, Any]:
    layer_prefix = "model.layers.0." + ("mlp" if hasattr(model.model.layers[0], "mlp")
                                        else "block_sparse_moe")
    block = moe_block(model)
    out = {}
    for name, t in list(block.named_parameters()) + list(block.named_buffers()):
        if t.is_floating_point():
            out[f"{layer_prefix}.{name}"] = t.detach().float().clone()
    return out


# --------------------------------------------------------------------------
# one fixture
# --------------------------------------------------------------------------

def randomize_lora(peft_model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def lora_deltas(peft_model, adapter: str = "default") -> dict[str, Any]:
    """``{parameter name in the base model: delta in its layout}`` of every LoRA layer."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for mod_name, mod in peft_model.named_modules():
        if not isinstance(mod, LoraLayer) or adapter not in getattr(mod, "lora_A", {}):
            continue
        param = getattr(mod, "parameter_name", None) or "weight"
        path = mod_name.removeprefix("base_model.model.").replace(".base_layer", "")
        out[f"{path}.{param}"] = mod.get_delta_weight(adapter).detach().float().clone()
    return out


def make_one(fx: Fixture, out_root: Path) -> None:
    import numpy as np
    import peft
    import safetensors
    import torch
    import transformers as tf
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import save_file

    folder = out_root / fx.name
    adapter_dir = folder / "adapter"
    folder.mkdir(parents=True, exist_ok=True)
    seed = sum(map(ord, fx.name))
    base = make_base_model(fx.family, seed)
    base_sd = {k: v.clone() for k, v in base.state_dict().items()}

    if fx.source is None:
        cfg = LoraConfig(lora_dropout=0.0, init_lora_weights=True, **fx.lora)
        model = get_peft_model(base, cfg)
        randomize_lora(model, seed + 7)
        model.save_pretrained(adapter_dir)
    else:
        src = out_root / fx.source / "adapter"
        model = PeftModel.from_pretrained(base, src)
        model.save_pretrained(adapter_dir)
    (adapter_dir / "README.md").unlink(missing_ok=True)

    fresh = make_base_model(fx.family, seed)
    fresh.load_state_dict(base_sd)
    base_block = block_state(fresh)
    loaded = PeftModel.from_pretrained(fresh, adapter_dir).eval()
    gen = torch.Generator().manual_seed(seed + 11)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    out_lora = block_forward(loaded, x)
    with loaded.disable_adapter():
        out_base = block_forward(loaded, x)
    deltas = lora_deltas(loaded)
    if not deltas:
        raise SystemExit(f"{fx.name}: peft loaded no LoRA layer")
    tensors = {"x": x, "out_base": out_base, "out_lora": out_lora}
    tensors |= {f"base.{k}": v for k, v in base_block.items()}
    tensors |= {f"delta.{k}": v for k, v in deltas.items()}
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(folder / "reference.safetensors"))
    config = model_config(fx.family)
    meta = {
        "name": fx.name,
        "family": fx.family,
        "what": fx.what,
        "made_with": {"torch": torch.__version__, "transformers": tf.__version__,
                      "peft": peft.__version__, "safetensors": safetensors.__version__,
                      "numpy": np.__version__, "python": sys.version.split()[0]},
        "pythonhashseed": fx.hashseed,
        "lora_config": fx.lora,
        "converted_from": fx.source,
        "model": {"model_type": config.model_type, "hidden_size": HIDDEN,
                  "intermediate_size": INTER, "num_experts": EXPERTS, "top_k": TOP_K,
                  "num_layers": 1, **routing_settings(config)},
        "max_abs_out_diff": float((out_lora - out_base).abs().max()),
    }
    (folder / "fixture.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(f"{fx.name}: {sorted(p.name for p in adapter_dir.iterdir())}, deltas {sorted(deltas)}, "
          f"max |out_lora - out_base| {meta['max_abs_out_diff']:.3g}")


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------

def installed() -> tuple[str, int]:
    import peft
    import transformers

    line = ".".join(peft.__version__.split(".")[:2])
    return line, int(transformers.__version__.split(".")[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="fixtures to make (default: all this peft can make)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    by_name = {f.name: f for f in FIXTURES}
    if args.one:
        make_one(by_name[args.one], args.out)
        return
    line, tf_major = installed()
    for fx in FIXTURES:
        if args.names and fx.name not in args.names:
            continue
        if (fx.peft, fx.transformers) != (line, tf_major):
            print(f"skip {fx.name}: needs peft {fx.peft}, transformers {fx.transformers}")
            continue
        env = dict(os.environ, PYTHONHASHSEED=str(fx.hashseed))
        subprocess.run([sys.executable, __file__, "--one", fx.name, "--out", str(args.out)],
                       env=env, check=True)


if __name__ == "__main__":
    main()
