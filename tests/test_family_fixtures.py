"""Each family's block reproduces the torch outputs stored with the peft fixtures.

For every folder of ``tests/fixtures/peft/`` (real peft adapters on tiny
transformers models, with the MoE block's base tensors ``base.*``, fixed
hidden states ``x`` and the torch block's outputs ``out_base`` / ``out_lora``):
a :class:`MoEBlock` of the fixture's family gets the base tensors through
``load_transformers_weights`` and the adapter through ``AdapterPool``, and
must give both outputs. Skipped where the fixtures are absent.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_moelora.nnx import (
    AdapterPool,
    DeepSeekV2,
    DeepSeekV3,
    GptOss,
    Mixtral,
    MoEBlock,
    MoEFamily,
    Qwen3MoE,
    load_transformers_weights,
)

ROOT = Path(__file__).parent / "fixtures" / "peft"
FIXTURES = sorted(p.parent.name for p in ROOT.glob("*/fixture.json"))


def family_of(meta: dict) -> MoEFamily:
    """The family config of a fixture's ``fixture.json``."""
    m, kind = meta["model"], meta["family"]
    groups = dict(n_group=m.get("n_group") or 1, topk_group=m.get("topk_group") or 1,
                  routed_scaling_factor=m.get("routed_scaling_factor", 1.0),
                  n_shared=m.get("n_shared_experts") or 0)
    if kind == "qwen3_moe":
        return Qwen3MoE(norm_topk_prob=m.get("norm_topk_prob", True))
    if kind == "mixtral":
        return Mixtral()
    if kind == "gpt_oss":
        return GptOss(alpha=m.get("swiglu_alpha", 1.702), limit=m.get("swiglu_limit", 7.0))
    if kind == "deepseek_v2":
        return DeepSeekV2(topk_method=m.get("topk_method", "greedy"),
                          norm_topk_prob=m.get("norm_topk_prob", False), **groups)
    if kind == "deepseek_v3":
        return DeepSeekV3(norm_topk_prob=m.get("norm_topk_prob", True), **groups)
    raise ValueError(f"unknown fixture family {kind!r}")


def load_fixture(name: str):
    from safetensors.numpy import load_file

    meta = json.loads((ROOT / name / "fixture.json").read_text())
    ref = load_file(str(ROOT / name / "reference.safetensors"))
    return meta, ref


@pytest.mark.skipif(not FIXTURES, reason="no peft fixtures in tests/fixtures/peft")
@pytest.mark.parametrize("impl", ["jnp", "auto"])
@pytest.mark.parametrize("name", FIXTURES)
def test_block_reproduces_the_torch_block(name, impl):
    meta, ref = load_fixture(name)
    m = meta["model"]
    assert m["num_layers"] == 1
    block = MoEBlock(m["hidden_size"], m["intermediate_size"], m["num_experts"], m["top_k"],
                     family=family_of(meta), max_loras=2, max_rank=16, rngs=nnx.Rngs(0))
    base = {k[len("base."):]: v for k, v in ref.items() if k.startswith("base.")}
    module = next(iter(base)).split(".")[3]  # model.layers.0.<mlp | block_sparse_moe>.
    prefix = f"model.layers.0.{module}."
    used = load_transformers_weights(block, base, prefix)
    assert sorted(used) == sorted(base)
    AdapterPool([block]).load(ROOT / name / "adapter", name="a")
    x = jnp.asarray(ref["x"], jnp.float32)
    T = x.shape[0]
    tol = 2e-5 if impl == "jnp" else 1e-4  # "auto": the CUDA kernels on a GPU
    for ids, want in ((-1, ref["out_base"]), (0, ref["out_lora"])):
        got = np.asarray(block(x, jnp.full((T,), ids, jnp.int32), impl=impl))
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(),
                                   err_msg=f"{name} adapter {ids}")
