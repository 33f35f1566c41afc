"""``impl="auto"`` is picked per lowering platform; ``info`` says what can run
here; ``import jax_moelora`` needs only jax and numpy (docs/semantics.md §1)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_moelora as ml
from jax_moelora import _ext
from jax_moelora._optional import needs_extra
from jax_moelora.ops import resolve_impl

TARGETS = (_ext.GATHER_BGMV_TARGET, _ext.GROUPED_DOWN_TARGET)


def _fold_fn(gather_max_rows: int, impl: str = "auto"):
    L, E, r, K, N = 2, 4, 8, 32, 24
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    route = ml.route_from_dense(jax.random.normal(ka, (L, E, r, K)),
                                jax.random.normal(kb, (L, E, N, r)), jnp.ones((L, E)))

    def f(x, base_out, topk_ids, row_adapter):
        return ml.moe_lora_fold(x, base_out, topk_ids, route, row_adapter, x_gather=1,
                                gather_max_rows=gather_max_rows, impl=impl)

    T, top_k = 6, 2
    args = (jnp.ones((T, K)), jnp.zeros((T * top_k, N)),
            jnp.zeros((T, top_k), jnp.int32), jnp.zeros((T,), jnp.int32))
    return f, args


def _custom_calls(fn, args, platform: str) -> list[tuple[str, int]]:
    """(target, variant) of every custom call in ``fn`` lowered for ``platform``."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    calls = []
    for line in text.splitlines():
        m = re.search(r"stablehlo\.custom_call @(\w+)\(", line)
        if m and m.group(1) in TARGETS:
            variant = re.search(r"variant = (\d+)", line)
            calls.append((m.group(1), int(variant.group(1))))
    return calls


@pytest.mark.parametrize("path, target", [(4096, _ext.GATHER_BGMV_TARGET),
                                          (0, _ext.GROUPED_DOWN_TARGET)],
                         ids=["gather", "grouped"])
def test_auto_lowered_for_cpu_calls_the_cpu_handlers(path, target):
    fn, args = _fold_fn(path)
    assert _custom_calls(fn, args, "cpu") == [(target, _ext.VARIANT_SIMPLE)]


@pytest.mark.parametrize("path, target", [(4096, _ext.GATHER_BGMV_TARGET),
                                          (0, _ext.GROUPED_DOWN_TARGET)],
                         ids=["gather", "grouped"])
def test_auto_lowered_for_cuda_calls_the_fast_kernels(path, target):
    """Needs no GPU: lowering for CUDA only writes the program."""
    fn, args = _fold_fn(path)
    calls = _custom_calls(fn, args, "cuda")
    if _ext.HAS_CUDA:
        assert calls == [(target, _ext.VARIANT_FAST)]
    else:  # no CUDA kernels in this build: the pure-JAX fold
        assert calls == []


def test_auto_lowered_for_cpu_and_cuda_keeps_both_branches():
    """A multi-platform lowering keeps each platform's backend, chosen at compile time."""
    fn, args = _fold_fn(4096)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu", "cuda")).as_text()
    variants = {int(v) for v in re.findall(r"variant = (\d+)", text)}
    want = {_ext.VARIANT_SIMPLE} | ({_ext.VARIANT_FAST} if _ext.HAS_CUDA else set())
    assert variants == want


@pytest.mark.parametrize("path", [4096, 0], ids=["gather", "grouped"])
def test_auto_runs_the_backend_resolve_impl_names(path):
    """Bit for bit, on the default platform (the fold's rows are non-zero)."""
    fn, args = _fold_fn(path)
    named, _ = _fold_fn(path, resolve_impl("auto"))
    auto = jax.jit(fn)(*args)
    assert float(jnp.abs(auto).sum()) > 0
    assert jnp.array_equal(auto, jax.jit(named)(*args))


def test_backends_lists_cuda_as_usable_only_with_a_gpu():
    info = ml.backends()
    assert info["gpu_visible"] == bool(info["gpus"])
    assert "cpu" in info["ffi_platforms_usable"]
    assert set(info["ffi_platforms_usable"]) <= set(info["ffi_platforms_built"])
    assert ("CUDA" in info["ffi_platforms_built"]) == info["cuda_kernels_built"] == _ext.HAS_CUDA
    assert ("CUDA" in info["ffi_platforms_usable"]) == info["cuda_kernels_usable"]
    assert info["cuda_kernels_usable"] == (_ext.HAS_CUDA and info["gpu_visible"])
    assert info["auto"] == resolve_impl("auto") == info["impls"][0]
    if not info["gpu_visible"]:
        assert not {"fast", "simple"} & set(info["impls"])


def test_info_command_prints_the_backends():
    out = subprocess.run([sys.executable, "-m", "jax_moelora", "info"], check=True,
                         capture_output=True, text=True).stdout
    info = json.loads(out)
    assert info["gpu_visible"] == ml.backends()["gpu_visible"]
    assert info["impls"] == ml.backends()["impls"]


# Import hook that hides the optional dependencies, as in a core-only install.
_HIDE = """
import sys
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'flax', 'safetensors', 'matplotlib', 'rich'}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Hide())
"""


def _run_without_extras(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _HIDE + code], capture_output=True, text=True)


def test_core_import_and_info_need_no_extra():
    res = _run_without_extras(
        "import jax_moelora, json\n"
        "from jax_moelora.__main__ import main\n"
        "assert main(['info']) == 0\n")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["impls"]


@pytest.mark.parametrize("module, extra", [("jax_moelora.nnx", "nnx"),
                                           ("jax_moelora.tools.bench", "bench"),
                                           ("jax_moelora.tools.bench_plot", "bench"),
                                           ("jax_moelora.tools.demo", "nnx")])
def test_missing_extra_names_it(module, extra):
    res = _run_without_extras(f"import {module}")
    assert res.returncode != 0
    assert f"pip install 'jax_moelora[{extra}]'" in res.stderr, res.stderr


def test_peft_files_without_safetensors_name_the_extra(tmp_path):
    res = _run_without_extras(
        "import numpy as np, jax_moelora.peft as p\n"
        "w = {0: {'down': (np.zeros((2, 4, 8), np.float32), np.zeros((2, 8, 4), np.float32))}}\n"
        f"p.save_peft_adapter({str(tmp_path / 'a')!r}, w, r=4, lora_alpha=8)\n")
    assert "writing PEFT adapters needs 'safetensors'" in res.stderr, res.stderr
    assert "pip install 'jax_moelora[peft]'" in res.stderr


def test_cli_without_extras_names_the_extra():
    res = _run_without_extras("from jax_moelora.__main__ import main\nmain(['demo'])\n")
    assert res.returncode == 2
    assert "python -m jax_moelora demo:" in res.stderr
    assert "pip install 'jax_moelora[nnx]'" in res.stderr


def test_needs_extra_rejects_an_unknown_extra():
    with pytest.raises(ValueError, match="extra must be one of"):
        with needs_extra("gpu", "x"):
            pass


def test_cuda_targets_are_registered_command_buffer_compatible(monkeypatch):
    """Every CUDA target is registered with the command-buffer trait its C++
    handler declares (so XLA may capture it in a CUDA graph); the CPU targets
    keep the default traits."""
    from jaxlib import xla_client

    seen = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target",
                        lambda name, capsule, platform, traits: seen.append(
                            (name, platform, traits)))
    platforms = _ext.register.__wrapped__()
    assert set(platforms) == {p for _, p, _ in seen}
    traits = xla_client.CustomCallTargetTraits
    assert {t for _, p, t in seen if p == "cpu"} == {traits.DEFAULT}
    cuda = [(n, t) for n, p, t in seen if p != "cpu"]
    assert all(t == traits.COMMAND_BUFFER_COMPATIBLE for _, t in cuda)
    if _ext.HAS_CUDA:
        assert {n for n, _ in cuda} >= set(TARGETS)
