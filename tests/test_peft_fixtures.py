"""Adapters written by real peft load into the deltas torch applies.

Each folder of ``tests/fixtures/peft/`` (made by ``scripts/make_peft_fixtures.py``; its
``fixture.json`` names the torch/transformers/peft versions) holds a peft adapter, the dense delta
peft adds to every adapted parameter (``delta.<parameter>``, in the parameter's own layout), the
MoE block's base tensors (``base.<parameter>``) and the block's output on fixed hidden states
with and without the adapter. Reading needs only numpy and safetensors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from jax_moelora.peft import AdapterFormatError, load_peft_adapter

ROOT = Path(__file__).parent / "fixtures" / "peft"
FIXTURES = sorted(p.name for p in ROOT.iterdir() if (p / "fixture.json").is_file())


def fixture(name):
    meta = json.loads((ROOT / name / "fixture.json").read_text())
    ref = load_file(str(ROOT / name / "reference.safetensors"))
    return meta, ref


def widths(meta):
    m = meta["model"]
    return dict(num_experts=m["num_experts"], hidden_size=m["hidden_size"],
                intermediate_size=m["intermediate_size"])


def split(meta):
    return "interleaved" if meta["family"] == "gpt_oss" else "halves"


def torch_deltas(meta, ref):
    """``{(where, layer, projection, expert): delta [out, in]}`` from the stored torch deltas.

    ``where`` is ``"routed"`` or ``"shared"``. Fused parameters: ``[E, 2I, H]`` / ``[E, H, I]``
    (``[E, out, in]``) except gpt-oss's ``[E, H, 2I]`` / ``[E, I, H]`` (``[E, in, out]``, gate and
    up interleaved)."""
    out = {}
    I = meta["model"]["intermediate_size"]
    for key, d in ref.items():
        if not key.startswith("delta."):
            continue
        m = re.match(r"delta\.model\.layers\.(\d+)\.\w+\.(.+)$", key)
        layer, rest = int(m[1]), m[2]
        d = d.astype(np.float64)
        if rest in ("gate.weight", "router.weight"):
            out["routed", layer, "router", 0] = d
        elif rest in ("experts.gate_up_proj", "experts.down_proj"):
            for e in range(d.shape[0]):
                lin = d[e].T if meta["family"] == "gpt_oss" else d[e]
                if rest.endswith("down_proj"):
                    out["routed", layer, "down", e] = lin
                elif meta["family"] == "gpt_oss":
                    out["routed", layer, "gate", e] = lin[0::2]
                    out["routed", layer, "up", e] = lin[1::2]
                else:
                    out["routed", layer, "gate", e] = lin[:I]
                    out["routed", layer, "up", e] = lin[I:]
        elif m2 := re.match(r"experts\.(\d+)\.(\w+)\.weight$", rest):
            proj = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                    "down_proj": "down", "w2": "down"}[m2[2]]
            out["routed", layer, proj, int(m2[1])] = d
        elif m2 := re.match(r"shared_experts\.(\w+)_proj\.weight$", rest):
            out["shared", layer, m2[1], 0] = d
        else:
            raise AssertionError(f"unexpected delta {key}")
    return out


def loaded_deltas(adapter):
    out = {}
    for where, layers in (("routed", adapter.layers), ("shared", adapter.shared_experts)):
        for layer, projs in layers.items():
            for proj, lora in projs.items():
                for e in np.flatnonzero(lora.present):
                    out[where, layer, proj, int(e)] = lora.delta(int(e))
    return out


def assert_same_deltas(adapter, meta, ref):
    want, got = torch_deltas(meta, ref), loaded_deltas(adapter)
    assert sorted(got) == sorted(want)
    for k, d in want.items():
        assert got[k].shape == d.shape, k
        np.testing.assert_allclose(got[k], d, rtol=1e-5, atol=1e-6 * np.abs(d).max(),
                                   err_msg=str(k))


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_loads_into_the_torch_deltas(name):
    """With the model's widths every fixture loads, and scale * B @ A is peft's delta."""
    meta, ref = fixture(name)
    ad = load_peft_adapter(ROOT / name / "adapter", gate_up_split=split(meta), **widths(meta))
    assert_same_deltas(ad, meta, ref)
    assert all(lora.max_rank % 8 == 0 for lay in ad.layers.values() for lora in lay.values())


@pytest.mark.parametrize("name", [n for n in FIXTURES if n != "qwen3_peft018_gate_up_only"])
def test_fixture_loads_without_model_widths(name):
    """The shapes decide nesting and factor order whenever the file holds enough of them."""
    meta, ref = fixture(name)
    assert_same_deltas(load_peft_adapter(ROOT / name / "adapter", gate_up_split=split(meta)),
                       meta, ref)


def test_one_old_fused_parameter_needs_the_widths():
    """peft 0.18 on [E, out, in]: one gate_up_proj pair fits both factor orders."""
    meta, ref = fixture("qwen3_peft018_gate_up_only")
    path = ROOT / "qwen3_peft018_gate_up_only" / "adapter"
    with pytest.raises(AdapterFormatError, match=r"ambiguous target_parameters keys .*pass "
                                                 r"hidden_size= and intermediate_size="):
        load_peft_adapter(path)
    assert_same_deltas(load_peft_adapter(path, lora_a_reads="output"), meta, ref)
    with pytest.raises(AdapterFormatError, match=r"shape mismatch: .*fit no reading"):
        load_peft_adapter(path, lora_a_reads="input", hidden_size=24, intermediate_size=8)


def test_recipe_configs_differ_only_in_order():
    """The rewritten recipe's target_parameters order follows the hash seed; the files read the
    same way (gate_up_proj is always the inner wrapper)."""
    cfgs = [json.loads((ROOT / n / "adapter" / "adapter_config.json").read_text())
            for n in ("qwen3_recipe_seed0", "qwen3_recipe_seed1")]
    assert cfgs[0]["target_parameters"] != cfgs[1]["target_parameters"]
    assert sorted(cfgs[0]["target_parameters"]) == sorted(cfgs[1]["target_parameters"])
    assert cfgs[0]["rank_pattern"] == {r".*\.gate_up_proj": 2 * cfgs[0]["r"]}


def test_converted_adapter_keeps_block_diagonal_b():
    """peft 0.21 fuses a transformers-4 adapter's gate and up: rank 2r, lora_B block-diagonal;
    the old peft_version stays in the config, so it cannot decide the factor order."""
    meta, ref = fixture("qwen3_v4_converted")
    path = ROOT / "qwen3_v4_converted" / "adapter"
    assert json.loads((path / "adapter_config.json").read_text())["peft_version"].startswith("0.18")
    ad = load_peft_adapter(path)
    gate, up = ad.layers[0]["gate"], ad.layers[0]["up"]
    r = 2
    assert (gate.ranks == 2 * r).all()
    assert not gate.b[:, :, r:2 * r].any() and not up.b[:, :, :r].any()


# --------------------------------------------------------------------------
# the MoE block outputs
# --------------------------------------------------------------------------

BLOCK_FAMILIES = ("qwen3_moe", "mixtral")


@pytest.mark.parametrize("impl", ["jnp", "auto"])
@pytest.mark.parametrize("name", [n for n in FIXTURES if fixture(n)[0]["family"] in BLOCK_FAMILIES])
def test_moe_block_matches_torch(name, impl):
    """jax_moelora.nnx.MoEBlock with the fixture's base weights and adapter reproduces the
    transformers block (Qwen3-MoE, Mixtral) with and without the adapter."""
    import jax.numpy as jnp
    from flax import nnx

    from jax_moelora.nnx import AdapterPool, MoEBlock

    meta, ref = fixture(name)
    m = meta["model"]
    w = _canonical(meta, ref, with_delta=False)
    block = MoEBlock(m["hidden_size"], m["intermediate_size"], m["num_experts"], m["top_k"],
                     norm_topk_prob=bool(m.get("norm_topk_prob", True)), max_loras=2,
                     max_rank=16, dtype=jnp.float32, rngs=nnx.Rngs(0))
    block.router.kernel[...] = jnp.asarray(w["router"].T, jnp.float32)
    for proj in ("gate", "up", "down"):
        getattr(block, f"{proj}_proj")[...] = jnp.asarray(np.transpose(w[proj], (0, 2, 1)),
                                                          jnp.float32)
    AdapterPool([block]).load(ROOT / name / "adapter", name="a")
    x = jnp.asarray(ref["x"])
    T = x.shape[0]
    tol = 2e-5 if impl == "jnp" else 1e-4  # "auto": the CUDA kernels on a GPU
    for ids, want in ((-1, ref["out_base"]), (0, ref["out_lora"])):
        got = np.asarray(block(x, jnp.full((T,), ids, jnp.int32), impl=impl))
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


# --------------------------------------------------------------------------
# the fixtures are self-consistent: a float64 NumPy block of each family, fed the stored base
# tensors (plus the stored deltas), reproduces the stored torch outputs
# --------------------------------------------------------------------------

def _silu(v):
    return v / (1 + np.exp(-v))


def _canonical(meta, ref, with_delta):
    """The block's tensors as float64 ``[out, in]`` maps: router ``[E, H]`` (+ bias), gate and up
    ``[E, I, H]``, down ``[E, H, I]`` (+ biases), shared ``{gate, up, down}``."""
    t = {}
    for k, v in ref.items():
        if k.startswith("base."):
            name = re.sub(r"^base\.model\.layers\.0\.\w+\.", "", k)
            d = ref.get("delta." + k[len("base."):]) if with_delta else None
            t[name] = v.astype(np.float64) + (0 if d is None else d)
    E, I = meta["model"]["num_experts"], meta["model"]["intermediate_size"]
    out = {"router": t.get("gate.weight", t.get("router.weight")), "router_bias": t.get(
        "router.bias"), "e_bias": t.get("gate.e_score_correction_bias")}
    if "experts.gate_up_proj" in t:
        gu, down = t["experts.gate_up_proj"], t["experts.down_proj"]
        if meta["family"] == "gpt_oss":  # [E, H, 2I] interleaved, [E, I, H]
            gu, down = np.transpose(gu, (0, 2, 1)), np.transpose(down, (0, 2, 1))
            out["gate"], out["up"] = gu[:, 0::2], gu[:, 1::2]
            out["gate_bias"] = t["experts.gate_up_proj_bias"][:, 0::2]
            out["up_bias"] = t["experts.gate_up_proj_bias"][:, 1::2]
            out["down_bias"] = t["experts.down_proj_bias"]
        else:
            out["gate"], out["up"] = gu[:, :I], gu[:, I:]
        out["down"] = down
    else:  # transformers 4: experts.{e}.{gate_proj,up_proj,down_proj | w1,w3,w2}.weight
        names = ("w1", "w3", "w2") if "experts.0.w1.weight" in t else ("gate_proj", "up_proj",
                                                                        "down_proj")
        for proj, n in zip(("gate", "up", "down"), names):
            out[proj] = np.stack([t[f"experts.{e}.{n}.weight"] for e in range(E)])
    if "shared_experts.gate_proj.weight" in t:
        out["shared"] = {p: t[f"shared_experts.{p}_proj.weight"] for p in ("gate", "up", "down")}
    return out


def _route(meta, w, x):
    """``(ids [T, k], weights [T, k])`` as the family's router picks them."""
    m, fam = meta["model"], meta["family"]
    k, E = m["top_k"], m["num_experts"]
    logits = x @ w["router"].T + (0 if w["router_bias"] is None else w["router_bias"])
    if fam == "gpt_oss":  # top-k on the logits, softmax over the chosen
        ids = np.argsort(-logits, axis=1)[:, :k]
        top = np.take_along_axis(logits, ids, 1)
        e = np.exp(top - top.max(1, keepdims=True))
        return ids, e / e.sum(1, keepdims=True)
    if fam == "deepseek_v3":  # sigmoid, bias-corrected choice, top-2 sum per group
        s = 1 / (1 + np.exp(-logits))
        choice = s + w["e_bias"]
        g = choice.reshape(len(x), m["n_group"], -1)
        gscore = np.sort(g, axis=2)[:, :, -2:].sum(2)
        keep = np.argsort(-gscore, axis=1)[:, :m["topk_group"]]
        mask = np.zeros_like(gscore, bool)
        np.put_along_axis(mask, keep, True, 1)
        choice = np.where(np.repeat(mask, E // m["n_group"], 1), choice, -np.inf)
        ids = np.argsort(-choice, axis=1)[:, :k]
        wts = np.take_along_axis(s, ids, 1)
        if m["norm_topk_prob"]:
            wts = wts / (wts.sum(1, keepdims=True) + 1e-20)
        return ids, wts * m["routed_scaling_factor"]
    e = np.exp(logits - logits.max(1, keepdims=True))
    p = e / e.sum(1, keepdims=True)
    if fam == "deepseek_v2":  # group-limited greedy on the softmax, no renormalisation
        g = p.reshape(len(x), m["n_group"], -1).max(2)
        keep = np.argsort(-g, axis=1)[:, :m["topk_group"]]
        mask = np.zeros_like(g, bool)
        np.put_along_axis(mask, keep, True, 1)
        p = np.where(np.repeat(mask, E // m["n_group"], 1), p, 0.0)
        ids = np.argsort(-p, axis=1)[:, :k]
        return ids, np.take_along_axis(p, ids, 1) * m["routed_scaling_factor"]
    ids = np.argsort(-p, axis=1)[:, :k]  # Qwen3-MoE, Mixtral
    wts = np.take_along_axis(p, ids, 1)
    if m.get("norm_topk_prob", True):
        wts = wts / wts.sum(1, keepdims=True)
    return ids, wts


def numpy_block(meta, w, x):
    """The family's sparse MoE block in float64 on ``x [T, H]``."""
    ids, wts = _route(meta, w, x)
    y = np.zeros_like(x)
    gpt = meta["family"] == "gpt_oss"
    for t in range(len(x)):
        for e, c in zip(ids[t], wts[t]):
            g, u = w["gate"][e] @ x[t], w["up"][e] @ x[t]
            if gpt:
                # transformers 5.5 hard-codes limit 7.0 and alpha 1.702 in the experts
                lim = meta["model"].get("swiglu_limit", 7.0)
                alpha = meta["model"].get("swiglu_alpha", 1.702)
                g = np.minimum(g + w["gate_bias"][e], lim)
                u = np.clip(u + w["up_bias"][e], -lim, lim)
                h = (u + 1) * g / (1 + np.exp(-alpha * g))
            else:
                h = _silu(g) * u
            y[t] += c * (w["down"][e] @ h + (w["down_bias"][e] if gpt else 0))
    if "shared" in w:
        s = w["shared"]
        y += (_silu(x @ s["gate"].T) * (x @ s["up"].T)) @ s["down"].T
    return y


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_outputs_follow_from_its_tensors(name):
    """out_base and out_lora of every fixture are the family's block on base.* (+ delta.*)."""
    meta, ref = fixture(name)
    x = ref["x"].astype(np.float64)
    for with_delta, key in ((False, "out_base"), (True, "out_lora")):
        got = numpy_block(meta, _canonical(meta, ref, with_delta), x)
        want = ref[key]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=key)


# --------------------------------------------------------------------------
# the writer writes peft's own keys
# --------------------------------------------------------------------------

@pytest.mark.parametrize("name,kw", [
    ("qwen3_dotted", dict(layout="target_parameters", family="qwen3")),
    ("mixtral_dotted", dict(layout="target_parameters", family="mixtral")),
    ("gpt_oss_dotted", dict(layout="target_parameters", family="gpt-oss")),
    pytest.param("gpt_oss_dotted", dict(layout="target_parameters", router="router",
                                        gate_up_split="interleaved"), id="gpt_oss_dotted-no_family"),
    ("qwen3_v4_experts", dict(layout="experts", family="qwen3")),
    ("mixtral_v4_experts", dict(layout="experts", family="mixtral")),
    ("deepseek_v2_shared", dict(layout="target_parameters", family="deepseek-v2")),
])
def test_writer_reproduces_peft_keys(tmp_path, name, kw):
    """Read a peft-made fixture, write its factors back: the file peft wrote, key for key and
    bit for bit."""
    from jax_moelora.peft import WEIGHTS_NAME, save_peft_adapter

    meta, ref = fixture(name)
    src = ROOT / name / "adapter"
    ad = load_peft_adapter(src, gate_up_split=split(meta), **widths(meta))

    def unpadded(lora):
        r = int(lora.ranks.max())
        return lora.a[:, :r], lora.b[:, :, :r]

    weights = {layer: {p: unpadded(lora) for p, lora in projs.items()}
               for layer, projs in ad.layers.items()}
    shared = {layer: {p: tuple(f[0] for f in unpadded(lora)) for p, lora in projs.items()}
              for layer, projs in ad.shared_experts.items()}
    cfg = ad.config
    out = save_peft_adapter(tmp_path, weights, r=cfg["r"], lora_alpha=cfg["lora_alpha"],
                            use_rslora=cfg["use_rslora"], rank_pattern=cfg["rank_pattern"],
                            alpha_pattern=cfg["alpha_pattern"], shared_experts=shared or None,
                            **kw)
    theirs, ours = load_file(str(src / WEIGHTS_NAME)), load_file(str(out / WEIGHTS_NAME))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    for k, v in theirs.items():
        np.testing.assert_array_equal(ours[k], v, err_msg=k)
    assert_same_deltas(load_peft_adapter(out, gate_up_split=split(meta)), meta, ref)
