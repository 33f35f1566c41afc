"""The backend registry (``ops/backend.py``): one place decides which kernels
run, and ``impl="auto"`` decides the same way for every op.

The same functions are lowered for the CPU and for CUDA (``jax.export``, no
GPU needed) and each lowering is read for the kernels it calls: the folds
take the C++ handlers for the CPU and the fast CUDA kernels for CUDA;
``expert_matmul``, its backward, the folds' backward and ``MoEBlock``'s
grouped GEMM take the CUTLASS kernels for CUDA only (where they are built:
stood in for here), XLA's dots and jnp for the CPU; ``take_rows`` moves
32-bit words for CUDA only. ``backends()`` reports the registry's table.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moelora as ml
from _transform_cases import make_case
from jax_moelora import _ext
from jax_moelora.ops import backend, expert_matmul_ffi
from jax_moelora.ops.take_rows import take_rows

TARGETS = (_ext.GATHER_BGMV_TARGET, _ext.GROUPED_DOWN_TARGET, _ext.EXPERT_MATMUL_TARGET,
           _ext.GROUPED_MATMUL_TARGET)


@pytest.fixture
def cutlass(monkeypatch):
    """The CUTLASS kernels as if built for a Hopper GPU (lowering only)."""
    monkeypatch.setattr(backend, "cutlass_built", lambda: True)
    monkeypatch.setattr(expert_matmul_ffi, "device_sm_count", lambda: 132)


def _lowered(f, *args, platform: str) -> str:
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in TARGETS]
    return jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(
        *args).mlir_module()


def _calls(text: str) -> dict[str, list[int]]:
    """Each custom call target of a lowering and the ``variant`` attributes of its calls."""
    found: dict[str, list[int]] = {}
    for m in re.finditer(r"stablehlo\.custom_call @(\w+)\(([^\n]*)", text):
        variant = re.search(r"variant = (\d+)", m.group(2))
        found.setdefault(m.group(1), []).append(int(variant.group(1)) if variant else -1)
    return found


@pytest.fixture(scope="module")
def case():
    return make_case(np.random.default_rng(0), T=40, top_k=2, x_gather=1, dtype=jnp.bfloat16,
                     K=64, N=64, R=16, P=9, E=6, L=2)


@pytest.mark.parametrize("path", ["gather", "sorted"])
def test_auto_folds_take_each_platforms_kernels(case, path):
    rows = case.base_out.shape[0]
    limit = rows if path == "gather" else 0

    def f(x, b, r):
        return ml.moe_lora_fold(x, b, case.topk_ids, r, case.row_adapter, x_gather=1,
                                gather_max_rows=limit)

    target = _ext.GATHER_BGMV_TARGET if path == "gather" else _ext.GROUPED_DOWN_TARGET
    cpu = _calls(_lowered(f, case.x, case.base_out, case.route, platform="cpu"))
    cuda = _calls(_lowered(f, case.x, case.base_out, case.route, platform="cuda"))
    assert cpu == {target: [backend.FFI_VARIANT[backend.AUTO["cpu"]]]}
    assert cuda == {target: [backend.FFI_VARIANT[backend.AUTO["cuda"]]]}


def _fold_grads(case):
    """The gradient w.r.t. x and the pools of a sorted fold: ``(x, base, a_pool, b_pool)``."""
    def loss(x, b, a_pool, b_pool):
        r = case.route.replace(a_pool=a_pool, b_pool=b_pool)
        out = ml.moe_lora_fold(x, b, case.topk_ids, r, case.row_adapter, x_gather=1,
                               gather_max_rows=0)
        return jnp.sum(out.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 2, 3))


def _grad_args(case):
    return case.x, case.base_out, case.route.a_pool, case.route.b_pool


def test_fold_backward_takes_the_grouped_gemms_for_cuda_only(case, cutlass):
    g = _fold_grads(case)
    cpu = _calls(_lowered(g, *_grad_args(case), platform="cpu"))
    cuda = _calls(_lowered(g, *_grad_args(case), platform="cuda"))
    assert _ext.GROUPED_MATMUL_TARGET not in cpu
    assert _ext.GROUPED_MATMUL_TARGET in cuda


def test_fold_backward_without_the_cutlass_kernels_is_jnp(case):
    """Where the CUTLASS kernels are not built for the GPU, CUDA's backward is jnp."""
    if backend.cutlass_built():
        pytest.skip("the CUTLASS kernels run here")
    cuda = _calls(_lowered(_fold_grads(case), *_grad_args(case), platform="cuda"))
    assert _ext.GROUPED_MATMUL_TARGET not in cuda


def _gemm_case(rng):
    E, K, N, M = 4, 64, 48, 40
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(E, K, N)) / 8, jnp.bfloat16)
    sizes = jnp.asarray([10, 0, 20, 10], jnp.int32)
    return x, w, sizes


def test_expert_matmul_auto_is_decided_at_lowering(cutlass):
    """One function, two lowerings: the CUTLASS custom call (forward) and the
    grouped GEMMs (backward) for CUDA; ragged_dot for the CPU."""
    x, w, sizes = _gemm_case(np.random.default_rng(1))

    def f(x, w):
        return jnp.sum(ml.expert_matmul(x, w, sizes).astype(jnp.float32))

    g = jax.value_and_grad(f, argnums=(0, 1))
    cpu, cuda = (_lowered(g, x, w, platform=p) for p in ("cpu", "cuda"))
    assert "dot_general" in cpu and not set(_calls(cpu)) & set(TARGETS)
    assert {_ext.EXPERT_MATMUL_TARGET, _ext.GROUPED_MATMUL_TARGET} <= set(_calls(cuda))


def test_block_grouped_gemm_follows_the_registry(cutlass):
    from flax import nnx

    from jax_moelora.nnx import MoEBlock

    block = MoEBlock(64, 48, num_experts=4, top_k=2, family="qwen3", lora=False,
                     dtype=jnp.bfloat16, gather_max_rows=8, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(16, 64)), jnp.bfloat16)
    cpu, cuda = (_lowered(lambda x: block(x), x, platform=p) for p in ("cpu", "cuda"))
    assert _ext.EXPERT_MATMUL_TARGET not in _calls(cpu)
    assert _ext.EXPERT_MATMUL_TARGET in _calls(cuda)


def test_take_rows_moves_words_for_cuda_only():
    x = jnp.ones((8, 6), jnp.bfloat16)
    ids = jnp.asarray([3, 1, 1], jnp.int32)
    cpu, cuda = (_lowered(take_rows, x, ids, platform=p) for p in ("cpu", "cuda"))
    assert "ui32" in cuda and "ui32" not in cpu


def test_backends_reads_the_registry():
    info = ml.backends()
    assert info["kernels"] == backend.KERNELS
    assert info["auto"] == backend.resolve_impl("auto") == info["impls"][0]
    assert set(info["impls"]) <= set(backend.IMPLS) and "jnp" in info["impls"]


def test_explicit_impl_is_checked_against_the_default_platform():
    with jax.default_device(jax.devices("cpu")[0]):
        assert backend.check_impl("auto") == "auto"
        assert backend.check_impl("cpu") == "cpu"
        with pytest.raises(ValueError, match="needs the CUDA kernels on a GPU"):
            backend.check_impl("fast")
    with pytest.raises(ValueError, match="impl must be one of"):
        backend.check_impl("cuda")


def test_seed_is_a_deprecated_alias_of_simple():
    """``impl="seed"`` (the old name of ``"simple"``) is not a backend of its
    own: ``check_impl`` warns and checks it as ``"simple"``, so on the CPU it
    is refused as ``"simple"`` is, naming ``"simple"``."""
    assert "seed" not in backend.IMPLS and "simple" in backend.IMPLS
    assert backend.DEPRECATED_IMPLS == {"seed": "simple"}
    assert backend.FFI_VARIANT["simple"] == _ext.VARIANT_SIMPLE
    with jax.default_device(jax.devices("cpu")[0]):
        with pytest.warns(DeprecationWarning, match="impl='seed' is deprecated; use impl='simple'"):
            with pytest.raises(ValueError, match="impl='simple' needs the CUDA kernels on a GPU"):
                backend.check_impl("seed")
        with pytest.warns(DeprecationWarning, match="use impl='simple'"):
            with pytest.raises(ValueError, match="impl='simple' needs the CUDA kernels"):
                backend.resolve_impl("seed")


def test_seed_alias_warns_at_the_folds_entry(case):
    """The folds validate ``impl`` through ``check_impl``: ``"seed"`` warns
    there and is then refused on the CPU exactly as ``"simple"`` is."""
    def fold(impl):
        return ml.moe_lora_fold(case.x, case.base_out, case.topk_ids, case.route,
                                case.row_adapter, x_gather=1, impl=impl)

    with jax.default_device(jax.devices("cpu")[0]):
        with pytest.raises(ValueError, match="impl='simple' needs the CUDA kernels") as simple:
            fold("simple")
        with pytest.warns(DeprecationWarning, match="impl='seed' is deprecated"):
            with pytest.raises(ValueError, match="impl='simple' needs the CUDA kernels") as seed:
                fold("seed")
    assert str(seed.value) == str(simple.value)


def _no_locations(text: str) -> str:
    """A lowering without its source locations (the two lambdas' lines differ)."""
    text = "\n".join(line for line in text.splitlines() if not line.startswith("#loc"))
    return re.sub(r"\s*loc\([^\n]*?\)(?=\s*$)", "", text, flags=re.MULTILINE)


@pytest.mark.parametrize("path", ["gather", "sorted"])
def test_seed_alias_lowers_to_the_simple_kernels(case, path, monkeypatch):
    """Lowered for CUDA (as if computations went to a GPU), ``impl="seed"`` and
    ``impl="simple"`` give the same program: the simple kernels' variant."""
    monkeypatch.setattr(backend, "gpu_now", lambda: True)
    limit = case.base_out.shape[0] if path == "gather" else 0

    def lowered(impl):
        def f(x, b, r):
            return ml.moe_lora_fold(x, b, case.topk_ids, r, case.row_adapter, x_gather=1,
                                    gather_max_rows=limit, impl=impl)

        return _lowered(f, case.x, case.base_out, case.route, platform="cuda")

    simple = lowered("simple")
    with pytest.warns(DeprecationWarning, match="use impl='simple'"):
        seed = lowered("seed")
    target = _ext.GATHER_BGMV_TARGET if path == "gather" else _ext.GROUPED_DOWN_TARGET
    assert _calls(simple) == {target: [_ext.VARIANT_SIMPLE]}
    assert _no_locations(seed) == _no_locations(simple)


@pytest.mark.gpu
def test_seed_alias_folds_as_simple_on_a_gpu(case):
    """On a GPU the alias runs the simple kernels: the same bits as ``"simple"``."""
    def fold(impl):
        return ml.moe_lora_fold(case.x, case.base_out, case.topk_ids, case.route,
                                case.row_adapter, x_gather=1, impl=impl)

    want = fold("simple")
    with pytest.warns(DeprecationWarning, match="use impl='simple'"):
        got = fold("seed")
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_block_prefill_folds_inside_the_gemm_for_cuda(cutlass):
    """``MoEBlock``'s prefill with adapters, lowered for CUDA: gate/up and down
    fold inside the GEMMs' custom calls (``lora_in_gemm = 1`` on both, the
    default for 2 adapters of rank 16 at K = 512 and 256), and its LoRA
    gradient lowers onto the grouped GEMMs (no ``ragged_dot`` left); lowered
    for the CPU, neither custom call appears."""
    from flax import nnx

    from jax_moelora.nnx import MoEBlock

    block = MoEBlock(512, 256, num_experts=8, top_k=2, max_loras=2, max_rank=16,
                     dtype=jnp.bfloat16, gather_max_rows=0, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(96, 512)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(-1, 2, 96), jnp.int32)
    cpu, cuda = (_lowered(lambda x, i: block(x, i), x, ids, platform=p) for p in ("cpu", "cuda"))
    assert re.findall(r"lora_in_gemm = (\d+)", cuda) == ["1", "1"]
    assert not {_ext.EXPERT_MATMUL_TARGET, _ext.GROUPED_MATMUL_TARGET} & set(_calls(cpu))
    graph, lora, rest = nnx.split(block, nnx.LoRAParam, ...)

    def loss(lora, x, i):
        out = nnx.merge(graph, lora, rest)(x, i)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grad = _lowered(jax.grad(loss), lora, x, ids, platform="cuda")
    assert _ext.EXPERT_MATMUL_TARGET in _calls(grad) and _ext.GROUPED_MATMUL_TARGET in _calls(grad)
    assert "ragged_dot" not in grad  # no dense zero-padded transpose of the expert GEMMs
