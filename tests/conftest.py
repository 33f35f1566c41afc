"""Suite-wide settings and markers, the GPU skip and the skip-reason summary.

Before JAX starts, ``XLA_PYTHON_CLIENT_PREALLOCATE`` defaults to ``false``:
JAX would otherwise take 75 % of a GPU's memory in each process, so only one
pytest-xdist worker (``pytest -n N``) could start on a GPU. A value set in
the environment wins.

Tests that run JAX's profiler take the ``one_profiler`` fixture: one of them
at a time on the machine, whichever pytest-xdist worker runs it (a GPU's
profiling interface serves one process at a time).

The sanitizer runs' test queue (``--shard``, ``--claim``, ``--order``,
``--timings``) is a plugin of the GPU check harness: ``tools/san_queue.py``.
"""

import collections
import fcntl
import os
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402  (after the setting above)
import pytest

# The suite checks the math against float64 references. XLA's default for f32
# dots on a GPU may round their operands to TF32 (a speed setting of the JAX
# program, not of this library's folds, which set their own precision): run
# every test at full f32.
jax.config.update("jax_default_matmul_precision", "highest")


def _has_gpu() -> bool:
    try:
        from jax_moelora import _ext

        return _ext.cuda_available()
    except Exception:
        return False


HAS_GPU = _has_gpu()

# Host round trips that traced routing and table code must never contain.
HOST_CALLBACKS = ("callback", "debug_print", "debug_callback", "pure_callback", "io_callback")


def assert_pure_device(fn, *args) -> None:
    """``fn(*args)`` traces to a jaxpr and an HLO module with no host callback,
    no custom call and no while loop (routing and table packing are traced
    jnp; on the GPU a while loop reads its predicate back to the host every
    step)."""
    jaxpr = str(jax.make_jaxpr(fn)(*args))
    hlo = jax.jit(fn).lower(*args).as_text()
    for word in HOST_CALLBACKS:
        assert word not in jaxpr, f"{word} in jaxpr"
        assert word not in hlo, f"{word} in HLO"
    assert "custom_call" not in hlo
    assert "while" not in jaxpr and "stablehlo.while" not in hlo, "a while loop"


@pytest.fixture
def one_profiler():
    """Hold the machine-wide profiler lock (a file lock, released when the
    test ends or its process dies) for the test's duration."""
    path = os.path.join(tempfile.gettempdir(), "jax_moelora_tests_profiler.lock")
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# The fold backends that run CUDA kernels. On a GPU, a test case of one is a
# GPU test (marked ``gpu``, so ``-m gpu`` selects it) however its file lists
# the backends (``backends()["impls"]`` holds them there); without a GPU the
# only such cases are the checks that they are refused.
CUDA_BACKENDS = ("simple", "fast")


def pytest_collection_modifyitems(config, items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if HAS_GPU and callspec is not None and callspec.params.get("impl") in CUDA_BACKENDS:
            item.add_marker(pytest.mark.gpu)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and the CUDA kernels")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """One line per skip reason with its count (pytest's own -rs lists every
    skipping test location)."""
    reasons: collections.Counter[str] = collections.Counter()
    for rep in terminalreporter.stats.get("skipped", []):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.section("skip reasons")
        for reason, n in reasons.most_common():
            terminalreporter.write_line(f"{n:5d} skipped: {reason}")


# a test phase at least this long is named as it ends (SLOW lines)
SLOW_TEST_S = 20.0


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    """A failed test's id on its own line as soon as it fails, and a phase
    that took ``SLOW_TEST_S`` or more with its seconds (also under
    pytest-xdist, whose progress dots name no test), so a run cut short
    still says what failed and what took its time. Written by the
    controller (a worker's report reaches it too)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    import sys

    if report.failed:
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when})\n")
    if report.duration >= SLOW_TEST_S:
        sys.stderr.write(f"\nSLOW {report.nodeid} ({report.when}) {report.duration:.0f} s\n")
