"""Check that real peft loads what ``save_peft_adapter`` writes, with the deltas it was given.

Two steps, two environments (jax_moelora and torch do not share one here)::

    python scripts/check_peft_writer.py write /tmp/peft_writer            # with jax_moelora
    /work/venv-torch/bin/python scripts/check_peft_writer.py check /tmp/peft_writer  # torch, peft

``write`` draws random factors for the tiny models of ``make_peft_fixtures.py`` (one MoE layer,
4 experts, hidden 24, expert width 8), writes one adapter folder per case with
``save_peft_adapter`` and stores the deltas the factors mean, in each parameter's own
transformers 5 layout (``expected.safetensors``). ``check`` loads every folder into the
transformers 5 model with ``PeftModel.from_pretrained`` and compares (1) peft's
``get_delta_weight`` of every adapted parameter with the expected delta, and (2) the MoE block's
output with the adapter against the base block with the expected deltas added to its weights.
It prints one line per case and exits non-zero on any mismatch, missing or unexpected key.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HIDDEN, INTER, EXPERTS = 24, 8, 4

# name, family, save_peft_adapter keyword arguments, separate gate/up lora_A
CASES = [
    ("qwen3_target_parameters", "qwen3_moe", dict(r=4, lora_alpha=8), False),
    ("qwen3_target_parameters_block_diagonal_rslora", "qwen3_moe",
     dict(r=2, lora_alpha=4, use_rslora=True, rank_pattern={"down_proj": 4}), True),
    ("qwen3_experts", "qwen3_moe", dict(r=2, lora_alpha=4, layout="experts", family="qwen3"),
     True),
    ("mixtral_target_parameters", "mixtral", dict(r=2, lora_alpha=2), True),
    ("mixtral_experts", "mixtral", dict(r=2, lora_alpha=4, layout="experts", family="mixtral"),
     True),
    ("gpt_oss_target_parameters", "gpt_oss", dict(r=2, lora_alpha=4, family="gpt-oss"), False),
    ("deepseek_v2_target_parameters_shared", "deepseek_v2", dict(r=2, lora_alpha=4), True),
    ("deepseek_v3_target_parameters_shared", "deepseek_v3", dict(r=2, lora_alpha=2), False),
]
SHARED_INTER = INTER  # moe_intermediate_size * n_shared_experts (1) of the tiny DeepSeek models


def _scale(kw, proj):
    r = kw["r"]
    if proj == "down" and kw.get("rank_pattern"):
        r = kw["rank_pattern"]["down_proj"]
    alpha = kw["lora_alpha"]
    return alpha / np.sqrt(r) if kw.get("use_rslora") else alpha / r


def write(out: Path) -> None:
    from safetensors.numpy import save_file

    from jax_moelora.peft import save_peft_adapter

    rng = np.random.default_rng(0)
    for name, family, kw, separate in CASES:
        def pair(e, r, k, n):
            return (0.3 * rng.standard_normal((e, r, k)).astype(np.float32),
                    0.3 * rng.standard_normal((e, n, r)).astype(np.float32))

        r, down_r = kw["r"], (kw.get("rank_pattern") or {}).get("down_proj", kw["r"])
        w = {"router": pair(1, r, HIDDEN, EXPERTS), "gate": pair(EXPERTS, r, HIDDEN, INTER),
             "up": pair(EXPERTS, r, HIDDEN, INTER), "down": pair(EXPERTS, down_r, INTER, HIDDEN)}
        if not separate:
            w["up"] = (w["gate"][0], w["up"][1])
        shared = None
        if family.startswith("deepseek"):
            shared = {0: {p: tuple(m[0] for m in pair(1, r, k, n)) for p, k, n in (
                ("gate", HIDDEN, SHARED_INTER), ("up", HIDDEN, SHARED_INTER),
                ("down", SHARED_INTER, HIDDEN))}}
        folder = save_peft_adapter(out / name / "adapter", {0: w}, shared_experts=shared, **kw)
        d = {p: np.einsum("enr,erk->enk", w[p][1].astype(np.float64), w[p][0]) * _scale(kw, p)
             for p in w}  # [E, out, in]
        router = "router" if family == "gpt_oss" else "gate"
        pre = "model.layers.0.mlp"
        if family == "gpt_oss":  # [E, in, out], gate and up interleaved
            gu = np.stack([d["gate"], d["up"]], axis=2).reshape(EXPERTS, 2 * INTER, HIDDEN)
            gate_up, down = np.transpose(gu, (0, 2, 1)), np.transpose(d["down"], (0, 2, 1))
        else:
            gate_up, down = np.concatenate([d["gate"], d["up"]], axis=1), d["down"]
        expected = {f"{pre}.{router}.weight": d["router"][0],
                    f"{pre}.experts.gate_up_proj": gate_up, f"{pre}.experts.down_proj": down}
        for p, (a, b) in (shared or {0: {}})[0].items():
            expected[f"{pre}.shared_experts.{p}_proj.weight"] = _scale(kw, p) * (b @ a)
        save_file({k: np.ascontiguousarray(v, np.float32) for k, v in expected.items()},
                  str(out / name / "expected.safetensors"))
        (out / name / "case.json").write_text(json.dumps({"family": family, "kwargs": kw}))
        print(f"wrote {folder}")


def check(out: Path) -> int:
    import peft
    import torch
    import transformers
    from peft import PeftModel
    from safetensors.torch import load_file

    sys.path.insert(0, str(Path(__file__).parent))
    import make_peft_fixtures as mk

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"peft {peft.__version__}")
    failures = 0
    for name, family, _, _ in CASES:
        expected = load_file(str(out / name / "expected.safetensors"))
        base = mk.make_base_model(family, seed=5)
        base_sd = {k: v.clone() for k, v in base.state_dict().items()}
        model = PeftModel.from_pretrained(base, out / name / "adapter").eval()
        got = mk.lora_deltas(model)
        x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(1))
        out_lora = mk.block_forward(model, x)
        ref_model = mk.make_base_model(family, seed=5)
        merged = dict(base_sd)
        for k, v in expected.items():
            merged[k] = base_sd[k] + v
        ref_model.load_state_dict(merged)
        out_ref = mk.block_forward(ref_model, x)
        keys_ok = sorted(got) == sorted(expected)
        err = max((float((got[k] - expected[k]).abs().max()) for k in expected if k in got),
                  default=float("inf"))
        out_err = float((out_lora - out_ref).abs().max())
        ok = keys_ok and err < 1e-5 and out_err < 1e-4
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: deltas {sorted(got) if not keys_ok else 'all'}"
              f", max |delta err| {err:.2e}, max |block out err| {out_err:.2e}")
    return failures


if __name__ == "__main__":
    step, folder = sys.argv[1], Path(sys.argv[2])
    if step == "write":
        write(folder)
    elif step == "check":
        sys.exit(1 if check(folder) else 0)
    else:
        raise SystemExit(f"unknown step {step!r}: write or check")
