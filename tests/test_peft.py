"""PEFT adapter files for MoE layers: every written layout round-trips, every reject names its key.

The files are PEFT folders written with ``safetensors`` (through ``save_peft_adapter``, or key by
key with ``safetensors.numpy.save_file`` for the faults the writer does not produce). Adapters
made by real peft are tested against torch in ``test_peft_fixtures.py``.
"""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jax_moelora.peft import (
    CONFIG_NAME,
    LAYOUTS,
    WEIGHTS_NAME,
    AdapterFormatError,
    load_peft_adapter,
    save_peft_adapter,
)

E, H, I = 4, 24, 8  # experts, hidden, inter: H, I and 2 * I all differ
DIMS = dict(num_experts=E, hidden_size=H, intermediate_size=I)


def factors(rng, *, r=4, down_r=None, layers=2, router=True, shared_a=True):
    """Unscaled factors ``{layer: {proj: (A [E, r, K], B [E, N, r])}}``."""
    down_r = r if down_r is None else down_r

    def pair(e, rank, k, n):
        return (rng.standard_normal((e, rank, k)).astype(np.float32),
                rng.standard_normal((e, n, rank)).astype(np.float32))

    out = {}
    for layer in range(layers):
        p = {"gate": pair(E, r, H, I), "up": pair(E, r, H, I), "down": pair(E, down_r, I, H)}
        if shared_a:
            p["up"] = (p["gate"][0], p["up"][1])
        if router:
            p["router"] = pair(1, r, H, E)
        out[layer] = p
    return out


def assert_matches(adapter, weights, scales, atol=1e-5):
    """Every loaded pair reproduces ``scale * B @ A`` of the written factors."""
    for layer, projs in weights.items():
        assert set(projs) <= set(adapter.layers[layer])
        for proj, (a, b) in projs.items():
            lora = adapter.layers[layer][proj]
            assert lora.present.all()
            assert lora.max_rank % 8 == 0
            for e in range(a.shape[0]):
                ref = scales[proj] * (b[e].astype(np.float64) @ a[e].astype(np.float64))
                np.testing.assert_allclose(lora.delta(e), ref, atol=atol * np.abs(ref).max())
                r = a.shape[1]
                assert not lora.a[e, r:].any() and not lora.b[e, :, r:].any()  # zero padding


def write_raw(folder, tensors, config):
    """A PEFT folder written key by key."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    (folder / CONFIG_NAME).write_text(json.dumps(config))
    return folder


# --------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_round_trips(tmp_path, layout):
    rng = np.random.default_rng(hash(layout) % 2**32)
    w = factors(rng, r=4)
    save_peft_adapter(tmp_path / layout, w, r=4, lora_alpha=8, layout=layout, family="qwen3")
    ad = load_peft_adapter(tmp_path / layout, **DIMS)
    assert ad.name == layout and ad.num_layers == 2 and ad.num_experts == E
    assert ad.projections == ("router", "gate", "up", "down")
    assert ad.max_rank == 8  # rank 4 padded to a multiple of 8
    assert_matches(ad, w, {p: 8 / 4 for p in ("router", "gate", "up", "down")})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_without_model_widths(tmp_path, layout):
    w = factors(np.random.default_rng(1), r=8)
    save_peft_adapter(tmp_path, w, r=8, lora_alpha=4, layout=layout, family="qwen3")
    assert_matches(load_peft_adapter(tmp_path), w, {p: 0.5 for p in w[0]})


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_float_dtypes_load(tmp_path, dtype):
    w = factors(np.random.default_rng(2), r=4, layers=1)
    save_peft_adapter(tmp_path, w, r=4, lora_alpha=4, dtype=dtype)
    ad = load_peft_adapter(tmp_path, **DIMS)
    assert ad.dtype == np.dtype(dtype)
    rounded = {0: {p: tuple(np.asarray(v, np.float32).astype(dtype).astype(np.float32)
                            for v in ab) for p, ab in w[0].items()}}
    assert_matches(ad, rounded, {p: 1.0 for p in w[0]})


def test_rslora_scale_is_alpha_over_sqrt_r(tmp_path):
    w = factors(np.random.default_rng(3), r=16, layers=1)
    save_peft_adapter(tmp_path, w, r=16, lora_alpha=8, use_rslora=True, layout="experts",
                      family="qwen3")
    ad = load_peft_adapter(tmp_path, **DIMS)
    np.testing.assert_allclose(ad.layers[0]["gate"].scale, 8 / math.sqrt(16))
    assert_matches(ad, w, {p: 2.0 for p in w[0]})


def test_rank_and_alpha_patterns(tmp_path):
    """rank_pattern gives down rank 12 (padded to 16); alpha_pattern one expert's alpha."""
    w = factors(np.random.default_rng(4), r=4, down_r=12, layers=1, shared_a=False)
    save_peft_adapter(tmp_path, w, r=4, lora_alpha=8, rank_pattern={"down_proj": 12},
                      alpha_pattern={r"experts\.1\.gate_proj": 32}, layout="experts",
                      family="qwen3")
    ad = load_peft_adapter(tmp_path, **DIMS)
    down, gate = ad.layers[0]["down"], ad.layers[0]["gate"]
    assert down.max_rank == 16 and (down.ranks == 12).all()
    np.testing.assert_allclose(down.scale, 8 / 12)
    np.testing.assert_allclose(gate.scale, [2, 8, 2, 2])  # alpha 32 / r 4 on expert 1
    assert_matches(ad, {0: {"down": w[0]["down"], "up": w[0]["up"]}}, {"down": 8 / 12, "up": 2})


def test_rank_pattern_for_target_parameters(tmp_path):
    """PEFT's per-expert rank of a target parameter: lora_A has E * r rows."""
    w = factors(np.random.default_rng(5), r=2, down_r=4, layers=1, router=False)
    save_peft_adapter(tmp_path, w, r=4, lora_alpha=8, layout="target_parameters",
                      rank_pattern={"experts.gate_up_proj": 2})
    ad = load_peft_adapter(tmp_path, **DIMS)
    assert (ad.layers[0]["gate"].ranks == 2).all() and (ad.layers[0]["down"].ranks == 4).all()
    assert_matches(ad, w, {"gate": 4.0, "up": 4.0, "down": 2.0})


def test_target_parameters_key_layout_is_peft_s(tmp_path):
    """lora_A [E * r, in] expert-major rows, lora_B [out, E * r] rank-major columns;
    gate_up_proj (listed first) is the inner wrapper: experts.base_layer."""
    w = factors(np.random.default_rng(6), r=4, layers=1, router=False)
    save_peft_adapter(tmp_path, w, r=4, lora_alpha=4, layout="target_parameters")
    t = load_file(str(tmp_path / WEIGHTS_NAME))
    pre = "base_model.model.model.layers.0.mlp.experts"
    a_gu, b_gu = t[f"{pre}.base_layer.lora_A.weight"], t[f"{pre}.base_layer.lora_B.weight"]
    assert a_gu.shape == (E * 4, H) and b_gu.shape == (2 * I, E * 4)
    assert t[f"{pre}.lora_A.weight"].shape == (E * 4, I)
    assert t[f"{pre}.lora_B.weight"].shape == (H, E * 4)
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert cfg["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    # PEFT's delta: einsum("o r e, e r i -> e i o", B.reshape(out, r, E), A.reshape(E, r, in))
    delta = np.einsum("ore,eri->eio", b_gu.reshape(2 * I, 4, E), a_gu.reshape(E, 4, H))
    a, bg = w[0]["gate"]
    np.testing.assert_allclose(delta[2, :, :I], (bg[2] @ a[2]).T, rtol=1e-5, atol=1e-5)


def test_nested_order_is_read_from_shapes(tmp_path):
    """down_proj as the inner wrapper, config in either order: the shapes decide."""
    w = factors(np.random.default_rng(7), r=4, layers=1, router=False)
    save_peft_adapter(tmp_path / "a", w, r=4, lora_alpha=4, layout="target_parameters")
    t = load_file(str(tmp_path / "a" / WEIGHTS_NAME))

    def swap(k):  # experts.base_layer.* <-> experts.*
        k = k.replace("experts.base_layer.", "experts.X.").replace("experts.lora",
                                                                  "experts.base_layer.lora")
        return k.replace("experts.X.", "experts.")

    swapped = {swap(k): v for k, v in t.items()}
    cfg = json.loads((tmp_path / "a" / CONFIG_NAME).read_text())
    cfg["target_parameters"] = ["experts.down_proj", "experts.gate_up_proj"]
    write_raw(tmp_path / "b", swapped, cfg)
    for kw in ({}, DIMS):
        assert_matches(load_peft_adapter(tmp_path / "b", **kw), w, {p: 1.0 for p in w[0]})
    # an order that contradicts the shapes: with the model's widths, shapes decide
    cfg["target_parameters"] = ["experts.gate_up_proj", "experts.down_proj"]
    write_raw(tmp_path / "c", swapped, cfg)
    assert_matches(load_peft_adapter(tmp_path / "c", **DIMS), w, {p: 1.0 for p in w[0]})


def test_interleaved_gate_up(tmp_path):
    w = factors(np.random.default_rng(8), r=4, layers=1)
    save_peft_adapter(tmp_path, w, r=4, lora_alpha=4, layout="target_parameters",
                      gate_up_split="interleaved")
    assert_matches(load_peft_adapter(tmp_path, gate_up_split="interleaved", **DIMS), w,
                   {p: 1.0 for p in w[0]})


@pytest.mark.parametrize("prefix,block,names,adapter", [
    ("", "mlp", ("gate_proj", "up_proj", "down_proj"), ""),
    ("base_model.model.model.language_model.", "mlp", ("gate_proj", "up_proj", "down_proj"),
     ".default"),
    ("model.", "block_sparse_moe", ("w1", "w3", "w2"), ""),
])
def test_key_spellings(tmp_path, prefix, block, names, adapter):
    """Any prefix before .layers., the adapter name in the key, Mixtral's w1/w3/w2;
    keys outside the MoE layers are skipped and listed."""
    w = factors(np.random.default_rng(9), r=4, layers=1, shared_a=False)
    t = {}
    for proj, name in zip(("gate", "up", "down"), names):
        a, b = w[0][proj]
        for e in range(E):
            base = f"{prefix}layers.0.{block}.experts.{e}.{name}"
            t[f"{base}.lora_A{adapter}.weight"] = a[e]
            t[f"{base}.lora_B{adapter}.weight"] = b[e]
    a, b = w[0]["router"]
    t[f"{prefix}layers.0.{block}.gate.lora_A{adapter}.weight"] = a[0]
    t[f"{prefix}layers.0.{block}.gate.lora_B{adapter}.weight"] = b[0]
    extra = {f"{prefix}layers.0.self_attn.q_proj.lora_A.weight": np.ones((4, H), np.float32),
             f"{prefix}layers.0.mlp.gate_proj.lora_A.weight": np.ones((4, H), np.float32),
             f"{prefix}embed_tokens.weight": np.ones((3, H), np.float32)}
    write_raw(tmp_path, t | extra, {"peft_type": "LORA", "r": 4, "lora_alpha": 4})
    ad = load_peft_adapter(tmp_path, **DIMS)
    assert set(ad.skipped_keys) == set(extra)
    assert_matches(ad, w, {p: 1.0 for p in w[0]})


def test_partial_experts_and_layers(tmp_path):
    """Only some experts and layers adapted: the rest is absent, not zero-filled pairs."""
    rng = np.random.default_rng(10)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in ((4, H), (I, 4)))
    t = {"m.layers.3.mlp.experts.2.gate_proj.lora_A.weight": a,
         "m.layers.3.mlp.experts.2.gate_proj.lora_B.weight": b}
    write_raw(tmp_path, t, {"r": 4, "lora_alpha": 8})
    ad = load_peft_adapter(tmp_path)
    assert list(ad.layers) == [3] and list(ad.layers[3]) == ["gate"]
    gate = ad.layers[3]["gate"]
    assert gate.n_experts == 3 and gate.present.tolist() == [False, False, True]
    np.testing.assert_allclose(gate.delta(2), 2 * b.astype(np.float64) @ a, rtol=1e-12)
    assert not gate.delta(0).any()
    assert load_peft_adapter(tmp_path, num_experts=E).layers[3]["gate"].n_experts == E


# --------------------------------------------------------------------------
# rejects
# --------------------------------------------------------------------------

def _good(tmp_path, router=True, layout="experts", **kw):
    w = factors(np.random.default_rng(11), r=4, layers=1, router=router)
    return save_peft_adapter(tmp_path / "good", w, r=4, lora_alpha=4, layout=layout,
                             **({"family": "qwen3"} | kw))


def _rewrite(src, dst, *, tensors=None, config=None):
    t = load_file(str(src / WEIGHTS_NAME))
    cfg = json.loads((src / CONFIG_NAME).read_text())
    return write_raw(dst, tensors(t) if tensors else t, config(cfg) if config else cfg)


def _raises(path, match, **kw):
    with pytest.raises(AdapterFormatError, match=match):
        load_peft_adapter(path, **kw)


def test_reject_expert_id_out_of_range(tmp_path):
    good = _good(tmp_path, router=False)
    _raises(good, r"expert id out of range: key '.*experts\.3\.\w+_proj\.lora_A\.weight' "
                  r"adapts expert 3, the model has 3 experts", num_experts=3)


def test_reject_expert_count_of_target_parameters(tmp_path):
    good = _good(tmp_path, router=False, layout="target_parameters")
    _raises(good, r"shape mismatch: key '.*experts(\.base_layer)?\.lora_A\.weight' holds 4 experts",
            num_experts=8)


def test_reject_unknown_projection(tmp_path):
    good = _good(tmp_path)
    bad = _rewrite(good, tmp_path / "bad", tensors=lambda t: {
        k.replace("experts.1.up_proj", "experts.1.foo_proj"): v for k, v in t.items()})
    _raises(bad, r"unknown projection: key '.*experts\.1\.foo_proj\.lora_A\.weight'")


def test_reject_target_parameters_that_miss_a_nested_pair(tmp_path):
    good = _good(tmp_path, layout="target_parameters")
    bad = _rewrite(good, tmp_path / "bad", config=lambda c: c | {
        "target_parameters": ["experts.gate_up_proj", "experts.bogus_proj"]})
    _raises(bad, r"keys \['.*experts\.lora_A\.weight', '.*experts\.base_layer\.lora_A\.weight'\] "
                 r"hold 2 nested target_parameters pair\(s\), but adapter_config\.json lists 1 "
                 r"expert parameter\(s\): \['gate_up_proj'\]")


def test_reject_target_pair_without_target_parameters(tmp_path):
    good = _good(tmp_path, layout="target_parameters")
    bad = _rewrite(good, tmp_path / "bad", config=lambda c: c | {"target_parameters": None})
    _raises(bad, r"key '.*experts\..*lora_A\.weight' is a target_parameters LoRA pair")


def test_reject_shape_mismatch_with_the_model(tmp_path):
    good = _good(tmp_path, router=False)
    _raises(good, r"shape mismatch: down key '.*experts\.0\.down_proj\.lora_B\.weight' writes "
                  r"24 outputs, the model's down projection writes 32",
            num_experts=E, hidden_size=32, intermediate_size=I)
    _raises(good, r"shape mismatch: down key '.*experts\.0\.down_proj\.lora_A\.weight' reads 8 "
                  r"inputs, the model's down projection reads 16",
            num_experts=E, hidden_size=H, intermediate_size=16)
    _raises(_good(tmp_path / "r"), r"shape mismatch: router key '.*mlp\.gate\.lora_B\.weight' has "
                                   r"4 outputs", num_experts=5)


def test_reject_experts_of_different_widths(tmp_path):
    good = _good(tmp_path)
    bad = _rewrite(good, tmp_path / "bad", tensors=lambda t: t | {
        k: np.ones((4, H + 1), np.float32) for k in t if "experts.2.gate_proj.lora_A" in k})
    _raises(bad, r"shape mismatch: the experts of one projection have different widths")


def test_reject_rank_mismatch(tmp_path):
    good = _good(tmp_path)
    bad = _rewrite(good, tmp_path / "bad", tensors=lambda t: t | {
        k: np.ones((I, 5), np.float32) for k in t if "experts.0.up_proj.lora_B" in k})
    _raises(bad, r"rank mismatch: key '.*experts\.0\.up_proj\.lora_A\.weight' has rank 4 but "
                 r"'.*experts\.0\.up_proj\.lora_B\.weight' has rank 5")
    bad2 = _rewrite(good, tmp_path / "bad2", config=lambda c: c | {"r": 8})
    _raises(bad2, r"rank mismatch: key '.*lora_A\.weight' has rank 4, the config gives")
    tp = _good(tmp_path / "tp", router=False, layout="target_parameters")
    bad3 = _rewrite(tp, tmp_path / "bad3", config=lambda c: c | {"r": 3})
    _raises(bad3, r"shape mismatch: the target_parameters keys \['.*experts\.lora_A\.weight', .*\] "
                  r"\(lora_A, lora_B shapes .*\) fit no reading of .* with the config's ranks")


def test_reject_missing_partner_and_non_float(tmp_path):
    good = _good(tmp_path)
    lonely = _rewrite(good, tmp_path / "lonely", tensors=lambda t: {
        k: v for k, v in t.items() if "experts.2.down_proj.lora_B" not in k})
    _raises(lonely, r"key '.*experts\.2\.down_proj\.lora_A\.weight' has no matching lora_B")
    ints = _rewrite(good, tmp_path / "ints", tensors=lambda t: t | {
        k: v.astype(np.int32) for k, v in t.items() if "experts.1.down_proj.lora_A" in k})
    _raises(ints, r"non-float tensor: key '.*experts\.1\.down_proj\.lora_A\.weight' has dtype "
                  r"int32")


def test_reject_lora_bias_and_dora(tmp_path):
    good = _good(tmp_path)
    bias = _rewrite(good, tmp_path / "bias", tensors=lambda t: t | {
        "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_B.bias":
            np.ones(I, np.float32)})
    _raises(bias, r"key '.*experts\.0\.gate_proj\.lora_B\.bias' is a LoRA bias")
    dora = _rewrite(good, tmp_path / "dora", config=lambda c: c | {"use_dora": True})
    _raises(dora, r"use_dora is set")


@pytest.mark.parametrize("config,match", [
    (None, r"missing config: .*adapter_config\.json does not exist"),
    ("{not json", r"malformed config .*: not valid JSON"),
    ("[1, 2]", r"malformed config .*: expected a JSON object"),
    ({"lora_alpha": 8}, r"malformed config adapter_config\.json: missing 'r'"),
    ({"r": 4}, r"malformed config adapter_config\.json: missing 'lora_alpha'"),
    ({"r": 0, "lora_alpha": 8}, r"'r' must be a positive int"),
    ({"r": 4, "lora_alpha": "8"}, r"'lora_alpha' must be a number"),
    ({"r": 4, "lora_alpha": 8, "rank_pattern": [1]}, r"'rank_pattern' must be an object"),
    ({"r": 4, "lora_alpha": 8, "rank_pattern": {"down_proj": 0}},
     r"rank_pattern\['down_proj'\] must be a positive int"),
    ({"r": 4, "lora_alpha": 8, "alpha_pattern": {"(": 2}}, r"alpha_pattern key '\(' is not"),
    ({"r": 4, "lora_alpha": 8, "peft_type": "IA3"}, r"peft_type is 'IA3'"),
    ({"r": 4, "lora_alpha": 8, "target_parameters": "experts.down_proj"},
     r"'target_parameters' must be a list"),
])
def test_reject_missing_or_malformed_config(tmp_path, config, match):
    good = _good(tmp_path)
    cfg_path = good / CONFIG_NAME
    if config is None:
        cfg_path.unlink()
    else:
        cfg_path.write_text(config if isinstance(config, str) else json.dumps(config))
    _raises(good, match)


def test_reject_missing_files(tmp_path):
    _raises(tmp_path / "nowhere", r"missing adapter: .* is not a folder")
    good = _good(tmp_path)
    (good / WEIGHTS_NAME).unlink()
    _raises(good, r"missing weights: .*adapter_model\.safetensors does not exist")
    (good / WEIGHTS_NAME).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    _raises(good, r"malformed weights")


def test_writer_fuses_separate_gate_and_up_block_diagonally(tmp_path):
    """Gate and up with their own lora_A: peft's fusion (A stacked, B block-diagonal, rank 2r,
    alpha_pattern keeping the scale), plain and rsLoRA."""
    w = factors(np.random.default_rng(12), r=4, layers=2, shared_a=False)
    for rslora, scale in ((False, 8 / 4), (True, 8 / 2)):
        folder = save_peft_adapter(tmp_path / str(rslora), w, r=4, lora_alpha=8,
                                   use_rslora=rslora, rank_pattern={"down_proj": 4})
        cfg = json.loads((folder / CONFIG_NAME).read_text())
        assert cfg["rank_pattern"] == {r".*\.gate_up_proj": 8, "down_proj": 4}
        ad = load_peft_adapter(folder)
        assert (ad.layers[1]["gate"].ranks == 8).all()
        for layer, projs in w.items():
            for proj, (a, b) in projs.items():
                for e in range(a.shape[0]):
                    ref = scale * (b[e].astype(np.float64) @ a[e])
                    np.testing.assert_allclose(ad.layers[layer][proj].delta(e), ref,
                                               atol=1e-5 * np.abs(ref).max())
    with pytest.raises(ValueError, match="layout must be one of"):
        save_peft_adapter(tmp_path, w, r=4, lora_alpha=4, layout="gate_up")


# Per-expert module names of each family's transformers 4 model (modeling_qwen3_moe,
# modeling_mixtral, modeling_deepseek_v2, modeling_deepseek_v3): block, gate, up, down.
V4_EXPERT_NAMES = {"qwen3": ("mlp", "gate_proj", "up_proj", "down_proj"),
                   "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                   "deepseek-v2": ("mlp", "gate_proj", "up_proj", "down_proj"),
                   "deepseek-v3": ("mlp", "gate_proj", "up_proj", "down_proj")}


@pytest.mark.parametrize("family", sorted(V4_EXPERT_NAMES))
def test_experts_layout_writes_the_family_module_names(tmp_path, family):
    w = factors(np.random.default_rng(13), r=4, layers=1, shared_a=False)
    folder = save_peft_adapter(tmp_path, w, r=4, lora_alpha=4, layout="experts", family=family)
    block, *names = V4_EXPERT_NAMES[family]
    keys = set(load_file(str(folder / WEIGHTS_NAME)))
    assert keys == {f"base_model.model.model.layers.0.{block}.{m}.lora_{ab}.weight"
                    for m in ["gate", *(f"experts.{e}.{n}" for e in range(E) for n in names)]
                    for ab in "AB"}
    assert json.loads((folder / CONFIG_NAME).read_text())["target_modules"] == ["gate", *names]
    assert_matches(load_peft_adapter(folder, **DIMS), w, {p: 1.0 for p in w[0]})


def test_experts_layout_takes_a_family_config_and_a_matching_expert_names(tmp_path):
    from jax_moelora.nnx import Mixtral

    w = factors(np.random.default_rng(13), r=4, layers=1)
    a = save_peft_adapter(tmp_path / "a", w, r=4, lora_alpha=4, layout="experts",
                          family=Mixtral())
    b = save_peft_adapter(tmp_path / "b", w, r=4, lora_alpha=4, layout="experts",
                          family="mixtral", expert_names="mixtral")
    c = save_peft_adapter(tmp_path / "c", w, r=4, lora_alpha=4, layout="experts",
                          expert_names="mixtral")  # the names alone, no family to check
    want = load_file(str(a / WEIGHTS_NAME))
    assert "base_model.model.model.layers.0.block_sparse_moe.experts.2.w3.lora_B.weight" in want
    for folder in (b, c):
        got = load_file(str(folder / WEIGHTS_NAME))
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_experts_layout_without_the_family_is_refused(tmp_path):
    """Qwen3-MoE's names in a file for a Mixtral model load into peft without a warning and
    apply wrong deltas: the writer does not guess the family."""
    w = factors(np.random.default_rng(13), r=4, layers=1)
    with pytest.raises(ValueError, match=r"layout='experts' .* differ between families .*"
                                         r"pass family= \(one of \["):
        save_peft_adapter(tmp_path / "a", w, r=4, lora_alpha=4, layout="experts")
    assert not (tmp_path / "a").exists()
    save_peft_adapter(tmp_path / "b", w, r=4, lora_alpha=4)  # target_parameters: no names


@pytest.mark.parametrize("layout, family, kw, match", [
    ("experts", "mixtral", dict(expert_names="qwen3"),
     "expert_names='qwen3' contradicts family='mixtral', whose models use expert_names='mixtral'"),
    ("experts", "qwen3", dict(expert_names="mixtral"),
     "expert_names='mixtral' contradicts family='qwen3', whose models use expert_names='qwen3'"),
    ("experts", "deepseek-v3", dict(expert_names="mixtral"),
     "expert_names='mixtral' contradicts family='deepseek-v3'"),
    ("experts", "deepseek-v2", dict(router="router"),
     "router='router' contradicts family='deepseek-v2', whose models use router='gate'"),
    ("target_parameters", "qwen3", dict(router="router"),
     "router='router' contradicts family='qwen3'"),
    ("target_parameters", "mixtral", dict(gate_up_split="interleaved"),
     "gate_up_split='interleaved' contradicts family='mixtral'"),
])
def test_arguments_contradicting_the_family_are_refused(tmp_path, layout, family, kw, match):
    w = factors(np.random.default_rng(13), r=4, layers=1)
    with pytest.raises(ValueError, match=match):
        save_peft_adapter(tmp_path / "a", w, r=4, lora_alpha=4, layout=layout, family=family,
                          **kw)
    assert not (tmp_path / "a").exists()


def test_gpt_oss_has_no_experts_layout(tmp_path):
    """transformers 4's gpt-oss experts are fused parameters, not per-expert modules."""
    w = factors(np.random.default_rng(13), r=4, layers=1)
    with pytest.raises(ValueError, match=r"family='gpt-oss' has no layout='experts'.*fused.*"
                                         r"layout='target_parameters'"):
        save_peft_adapter(tmp_path / "a", w, r=4, lora_alpha=4, layout="experts",
                          family="gpt-oss")
    with pytest.raises(ValueError, match="router='gate' contradicts family='gpt-oss'"):
        save_peft_adapter(tmp_path / "a", w, r=4, lora_alpha=4, family="gpt-oss", router="gate")
    # the family gives gpt-oss's router name and gate/up interleaving
    folder = save_peft_adapter(tmp_path / "b", w, r=4, lora_alpha=4, family="gpt-oss")
    assert "base_model.model.model.layers.0.mlp.router.lora_A.weight" in set(
        load_file(str(folder / WEIGHTS_NAME)))
    assert_matches(load_peft_adapter(folder, gate_up_split="interleaved", **DIMS), w,
                   {p: 1.0 for p in w[0]})


def test_writer_families_are_the_model_families(tmp_path):
    """The writer knows every family name of ``jax_moelora.nnx`` and its router and gate/up
    layout; an unknown name is refused."""
    from jax_moelora.nnx.families import FAMILIES
    from jax_moelora.peft.writer import FAMILY_LAYOUTS

    assert set(FAMILY_LAYOUTS) == set(FAMILIES)
    for name, (_, router, split) in FAMILY_LAYOUTS.items():
        assert router == ("router" if FAMILIES[name].router_bias else "gate"), name
        assert split == FAMILIES[name].gate_up_split, name
    with pytest.raises(ValueError, match=r"family must be one of \[.*'qwen3'\].*got 'llama'"):
        save_peft_adapter(tmp_path, factors(np.random.default_rng(13), layers=1), r=4,
                          lora_alpha=4, family="llama")


def test_reject_adapter_without_moe_lora(tmp_path):
    """A file with no LoRA pair of an MoE block would serve the base model under its name."""
    empty = write_raw(tmp_path / "empty", {}, {"r": 4, "lora_alpha": 4})
    _raises(empty, r"no LoRA pair: .*adapter_model\.safetensors holds no lora_A/lora_B tensor")
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    attn = write_raw(tmp_path / "attn", {f"{q}.lora_A.weight": np.ones((4, H), np.float32),
                                         f"{q}.lora_B.weight": np.ones((H, 4), np.float32)},
                     {"r": 4, "lora_alpha": 4})
    _raises(attn, r"no LoRA pair: .* \(2 key\(s\), e\.g\. \['base_model\.model\.model\.layers\.0"
                  r"\.self_attn")


def test_ambiguous_fused_pair_names_what_to_pass(tmp_path):
    """One fused pair, no peft_version: lora_A [E*r, H] could read gate_up's input (peft >= 0.19.1)
    or its output (older peft on [E, out, in] with 2I = H); the model's widths decide."""
    rng = np.random.default_rng(14)
    r, E_, I_ = 2, 4, 12  # 2 * I_ == H
    a = rng.standard_normal((E_ * r, H)).astype(np.float32)
    b = rng.standard_normal((H, E_ * r)).astype(np.float32)
    pre = "base_model.model.model.layers.0.mlp.experts"
    folder = write_raw(tmp_path, {f"{pre}.lora_A.weight": a, f"{pre}.lora_B.weight": b},
                       {"r": r, "lora_alpha": r, "target_parameters": ["experts.gate_up_proj"]})
    _raises(folder, r"ambiguous target_parameters keys .*pass hidden_size= and "
                    r"intermediate_size= .*lora_a_reads=")
    _raises(folder, r"ambiguous", hidden_size=H, intermediate_size=I_)  # square: still open
    new = load_peft_adapter(folder, lora_a_reads="input")
    old = load_peft_adapter(folder, lora_a_reads="output")
    d_new = new.layers[0]["gate"].delta(1)
    want = (b.reshape(H, r, E_)[:, :, 1] @ a.reshape(E_, r, H)[1])  # [2I, H]
    np.testing.assert_allclose(d_new, want[:I_], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(old.layers[0]["gate"].delta(1), want.T[:I_], rtol=1e-5, atol=1e-5)
    cfg = json.loads((folder / CONFIG_NAME).read_text())
    (folder / CONFIG_NAME).write_text(json.dumps(cfg | {"peft_version": "0.21.2"}))
    np.testing.assert_allclose(load_peft_adapter(folder).layers[0]["gate"].delta(1), d_new)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shared_experts_and_router_name_round_trip(tmp_path, layout):
    """DeepSeek's shared expert MLP and gpt-oss's router module name."""
    rng = np.random.default_rng(15)
    w = factors(rng, r=2, layers=1)
    shared = {0: {p: (rng.standard_normal((2, k)).astype(np.float32),
                      rng.standard_normal((n, 2)).astype(np.float32))
                  for p, k, n in (("gate", H, 16), ("up", H, 16), ("down", 16, H))}}
    folder = save_peft_adapter(tmp_path, w, r=2, lora_alpha=4, layout=layout, router="router",
                               expert_names="qwen3", shared_experts=shared)
    keys = set(load_file(str(folder / WEIGHTS_NAME)))
    assert "base_model.model.model.layers.0.mlp.router.lora_A.weight" in keys
    assert "base_model.model.model.layers.0.mlp.shared_experts.down_proj.lora_B.weight" in keys
    ad = load_peft_adapter(folder, **DIMS)
    assert_matches(ad, w, {p: 2.0 for p in w[0]})
    assert list(ad.shared_experts[0]) == ["gate", "up", "down"]
    for p, (a, b) in shared[0].items():
        lora = ad.shared_experts[0][p]
        assert lora.n_experts == 1
        np.testing.assert_allclose(lora.delta(0), 2 * b.astype(np.float64) @ a, rtol=1e-6)
