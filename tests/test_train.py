"""The fine-tuning example (``python -m jax_moelora train``) on tiny shapes, and
the pieces it writes adapters with.

The command trains two adapters at once and its held-out loss falls; it
writes both as PEFT folders that ``load_peft_adapter`` reads back with the
trained factors (every projection, B moved off its zero init) and, where
torch, transformers and peft are installed, that peft loads into the
transformers model with the same MoE outputs (skipped otherwise). Below it:
``save_adapter_slot`` / ``slot_adapter`` for every family, an ``AdapterPool``
taking the saved folder back at the pool's rank (peft's block-diagonal fused
gate and up: ``compact_rank``), and ``transformers_weights`` inverting
``load_transformers_weights``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

from jax_moelora.__main__ import main
from jax_moelora.nnx import AdapterPool, MoEStack, save_adapter_slot, slot_adapter
from jax_moelora.nnx.lora import compact_rank
from jax_moelora.nnx.reference import adapter_deltas, block_params
from jax_moelora.nnx.weights import load_transformers_weights, transformers_weights
from jax_moelora.peft import ProjectionLoRA, load_peft_adapter
from jax_moelora.tools.train import ADAPTER_NAMES, PEER_TOL

H, I, E, RANK = 32, 16, 4, 4
TINY = ["--layers", "1", "--hidden", str(H), "--inter", str(I), "--experts", str(E),
        "--top-k", "2", "--tokens", "128", "--steps", "120", "--rank", str(RANK),
        "--lr", "2e-2"]


def run_train(tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    rc = main(["train", *TINY, "--out", str(tmp_path / "adapters"), "--json", str(out),
               *extra])
    return rc, json.loads(out.read_text())


def test_train_command_trains_two_adapters_and_writes_peft(tmp_path, capsys):
    rc, result = run_train(tmp_path, "--no-transformers")
    text = capsys.readouterr().out
    assert rc == 0 and result["passed"], text
    for item in ("start loss", "end loss", "training 2 adapters", "jax_moelora train summary",
                 "transformers + peft check skipped: --no-transformers", "PASS"):
        assert item in text, item
    start, end = result["start_loss"], result["end_loss"]
    assert end[0] <= 0.5 * start[0]
    assert all(e < s for s, e in zip(start[1:], end[1:]))  # each adapter learned
    assert len(result["curve"]) == 120
    for slot, (row, name) in enumerate(zip(result["adapters"], ADAPTER_NAMES)):
        assert row["name"] == name and row["slot"] == slot
        assert row["files"] == ["adapter_config.json", "adapter_model.safetensors"]
        assert row["roundtrip_error"] <= 1e-5 and row["reload_error"] <= 1e-5
        adapter = load_peft_adapter(row["path"], num_experts=E, hidden_size=H,
                                    intermediate_size=I)
        config = json.loads((tmp_path / "adapters" / name / "adapter_config.json").read_text())
        assert config["lora_alpha"] / config["r"] == pytest.approx(2.0)  # alpha 2 * rank
        assert sorted(adapter.layers[0]) == ["down", "gate", "router", "up"]
        for proj, lora in adapter.layers[0].items():
            assert lora.present.all() and np.abs(lora.b).max() > 0, proj  # B left its zeros


def test_timing_mode_times_the_forward_and_the_training_step(tmp_path, capsys):
    rc, result = run_train(tmp_path, "--timing", "--repeats", "2")
    assert rc == 0
    assert "training step with LoRA gradients:" in capsys.readouterr().out
    assert set(result["results"]) == {"forward, base model", "forward, 2 adapters",
                                      "train step: LoRA grads + adam"}
    assert all(r["step_s"] > 0 for r in result["results"].values())
    assert result["train_over_forward"] > 0
    assert not (tmp_path / "adapters").exists()


@pytest.mark.parametrize("family", ["gpt-oss", "deepseek"])
def test_trained_adapters_give_the_same_outputs_in_transformers_and_peft(tmp_path, family):
    """gpt-oss: interleaved fused gate_up, router "router"; DeepSeek-V3:
    shared-expert LoRA. Every token on one adapter, each MoE layer of the
    transformers model (folder loaded by peft) on our layer's input."""
    for name in ("torch", "transformers", "peft"):
        pytest.importorskip(name)
    from jax_moelora.tools.transformers_peer import peer_missing

    if peer_missing():
        pytest.skip(peer_missing())
    rc, result = run_train(tmp_path, "--family", family, "--experts", "8")  # 4 groups of 2
    assert rc == 0 and result["passed"]
    assert result["transformers_skipped"] is None
    assert len(result["transformers"]) == 2
    assert all(err <= PEER_TOL["float32"] for err in result["transformers"])


def test_bad_options_exit(tmp_path):
    with pytest.raises(SystemExit, match="--steps must be >= 1"):
        main(["train", "--steps", "0"])
    with pytest.raises(SystemExit, match="--tokens must be >= 2"):
        main(["train", "--tokens", "1"])
    with pytest.raises(SystemExit, match="--top-k 5"):
        main(["train", "--experts", "4", "--top-k", "5"])


def test_cli_lists_the_train_command(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert "fine-tune two LoRA adapters at once" in capsys.readouterr().out


# --- the pieces: a slot as a PEFT folder and back -------------------------------------------

def random_slot(stack: MoEStack, slot: int, seed: int) -> None:
    """Random factors of rank RANK in ``slot`` of every block and projection
    (gate and up with different A), scale 1.5."""
    rng = np.random.default_rng(seed)
    for block in stack.blocks:
        for name in block.lora.projections:
            p = block.lora.projection(name)
            a = rng.standard_normal((p.n_experts, RANK, p.k_in)).astype(np.float32)
            b = rng.standard_normal((p.n_experts, p.n_out, RANK)).astype(np.float32)
            p.write_slot(slot, a / np.sqrt(p.k_in), b, np.full(p.n_experts, 1.5, np.float32),
                         np.ones(p.n_experts, bool))


def delta_error(want: dict, got: dict) -> float:
    worst = 0.0
    for layer in want:
        assert sorted(want[layer]) == sorted(got[layer]), layer
        dw, dg = adapter_deltas(want[layer]), adapter_deltas(got[layer])
        worst = max([worst] + [float(np.abs(dg[p] - dw[p]).max() / np.abs(dw[p]).max())
                               for p in dw])
    return worst


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss", "deepseek-v2"])
def test_a_saved_slot_reads_back_and_fits_the_pool_again(tmp_path, family):
    """``save_adapter_slot`` then ``load_peft_adapter``: the slot's deltas
    (routed and shared experts); an ``AdapterPool`` loads the folder into
    another slot of the same rank (gate and up with different A come back
    fused at rank 2 * RANK, and ``compact_rank`` fits them)."""
    from jax_moelora.tools.demo import DEMO_FAMILIES

    fam = DEMO_FAMILIES[family]
    stack = MoEStack(H, I, E, 2, 2, family=fam, max_loras=2, max_rank=RANK,
                     rngs=nnx.Rngs(0))
    random_slot(stack, 0, seed=1)
    blocks = list(stack.blocks)
    folder = save_adapter_slot(tmp_path / "a", blocks, 0)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == pytest.approx(1.5 * RANK)
    want = slot_adapter(blocks, 0)
    assert sorted(want.layers) == [0, 1]
    assert bool(want.shared_experts) == bool(fam.n_shared_experts)
    got = load_peft_adapter(folder, num_experts=E, hidden_size=H, intermediate_size=I,
                            gate_up_split=fam.gate_up_split)
    assert delta_error(want.layers, got.layers) <= 1e-6
    assert delta_error(want.shared_experts, got.shared_experts) <= 1e-6
    assert got.layers[0]["gate"].max_rank > RANK  # block-diagonal, as peft fuses it
    AdapterPool(blocks).load(folder, slot=1)
    again = slot_adapter(blocks, 1)
    assert delta_error(want.layers, again.layers) <= 1e-6
    assert delta_error(want.shared_experts, again.shared_experts) <= 1e-6
    tensors = {}
    for i, block in enumerate(blocks):  # base weights: transformers tensors and back
        tensors |= transformers_weights(block, f"model.layers.{i}.mlp.")
    other = MoEStack(H, I, E, 2, 2, family=fam, max_loras=2, max_rank=RANK, rngs=nnx.Rngs(7))
    for i, (mine, theirs) in enumerate(zip(blocks, other.blocks)):
        used = load_transformers_weights(theirs, tensors, f"model.layers.{i}.mlp.")
        assert sorted(used) == sorted(k for k in tensors if k.startswith(f"model.layers.{i}."))
        want_p, got_p = block_params(mine), block_params(theirs)
        assert sorted(want_p) == sorted(got_p)
        for k in want_p:
            np.testing.assert_array_equal(got_p[k], want_p[k], err_msg=k)


def test_compact_rank_drops_the_components_with_a_zero_factor():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 16, 5)).astype(np.float32)
    b = rng.standard_normal((2, 6, 16)).astype(np.float32)
    b[0, :, 8:] = 0  # a block-diagonal half
    b[1, :, [1, 9, 12]] = 0
    a[1, 3] = 0
    lora = ProjectionLoRA(a=a, b=b, scale=np.array([2.0, 0.5], np.float32),
                          present=np.ones(2, bool), ranks=np.full(2, 16, np.int32),
                          keys=("k0", "k1"))
    small = compact_rank(lora)
    assert small.max_rank == 16 and small.ranks.tolist() == [8, 12]
    first = compact_rank(ProjectionLoRA(a=a[:1], b=b[:1], scale=lora.scale[:1],
                                        present=lora.present[:1], ranks=lora.ranks[:1],
                                        keys=("k0",)))
    assert first.max_rank == 8 and first.ranks.tolist() == [8]
    for e in range(2):
        np.testing.assert_allclose(small.delta(e), lora.delta(e), rtol=1e-12, atol=1e-12)
