"""Suite-wide settings, markers and options.

Before JAX starts, ``XLA_PYTHON_CLIENT_PREALLOCATE`` defaults to ``false``:
JAX would otherwise take 75 % of a GPU's memory in each process, so only one
pytest-xdist worker (``pytest -n N``) could start on a GPU. A value set in
the environment wins.
"""

import collections
import hashlib
import math
import os
from pathlib import Path

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


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only every N-th collected test, starting at the I-th (0 <= I < N): "
                          "N such processes run the suite once between them (the sanitizer runs of "
                          "scripts/device_check.sh, one compute-sanitizer process per shard)")
    parser.addoption("--claim", default=None, metavar="DIR",
                     help="with --shard I/N: the N processes sharing DIR take the selected tests "
                          "from one queue instead (each test runs in the first process to claim "
                          "it, by a file in DIR); process I starts at the I-th of N equal slices, "
                          "or, with --order, every process takes the longest test left")
    parser.addoption("--order", default=None, metavar="FILE",
                     help="with --claim: a --timings FILE of earlier runs; tests run longest "
                          "first, those it lacks before all others")
    parser.addoption("--timings", default=None, metavar="FILE",
                     help="append a line per test to FILE: seconds (setup, call and teardown), "
                          "outcome, test id and, for a failure, its error message, tab-separated")


def _shard_spec(config) -> tuple[int, int] | None:
    spec = config.getoption("--shard")
    if spec is None:
        return None
    try:
        i, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard must be I/N with integers, got {spec!r}") from None
    if not 0 <= i < n:
        raise pytest.UsageError(f"--shard {spec}: need 0 <= I < N")
    return i, n


def read_timings(path) -> dict[str, float]:
    """Seconds per test id of a ``--timings`` file (the longest where a test
    appears more than once). A header line (``seconds<TAB>outcome<TAB>test``,
    as the copies under ``docs/bench_h200/runs/`` have) is skipped."""
    seconds: dict[str, float] = {}
    for line in Path(path).read_text().splitlines():
        s, _, nodeid = line.split("\t")[:3]
        if s == "seconds":
            continue
        seconds[nodeid] = max(seconds.get(nodeid, 0.0), float(s))
    return seconds


def _shard(config, items):
    spec = _shard_spec(config)
    if config.getoption("--claim") is not None:
        i, n = spec or (0, 1)
        order = config.getoption("--order")
        if order is not None and Path(order).exists():
            seconds = read_timings(order)
            items.sort(key=lambda item: -seconds.get(item.nodeid, math.inf))
        else:
            start = i * len(items) // n
            items[:] = items[start:] + items[:start]
        return
    if spec is None:
        return
    i, n = spec
    keep = [item for j, item in enumerate(items) if j % n == i]
    config.hook.pytest_deselected(items=[item for j, item in enumerate(items) if j % n != i])
    items[:] = keep


def claim(directory, nodeid: str, owner: str) -> bool:
    """True if test ``nodeid`` is ``owner``'s to run: ``owner`` claims it now
    (creates its file in ``directory``), or claimed it before (a process that
    starts again after its tool crashed runs the tests it claimed and did not
    pass)."""
    path = Path(directory) / hashlib.sha1(nodeid.encode()).hexdigest()
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return path.read_text() == owner
    with os.fdopen(fd, "w") as f:
        f.write(owner)
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """With ``--claim``: run the tests this process claims, in order, claiming
    each next test before the current one runs (pytest tears fixtures down by
    the next test that runs)."""
    directory = session.config.getoption("--claim")
    if directory is None or session.config.option.collectonly:
        return None
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} errors during collection")
    Path(directory).mkdir(parents=True, exist_ok=True)
    owner = session.config.getoption("--shard") or "0/1"
    items = session.items

    def next_claimed(j: int) -> int:
        while j < len(items) and not claim(directory, items[j].nodeid, owner):
            j += 1
        return j

    i = next_claimed(0)
    while i < len(items):
        j = next_claimed(i + 1)
        items[i].config.hook.pytest_runtest_protocol(
            item=items[i], nextitem=items[j] if j < len(items) else None)
        if session.shouldfail:
            raise session.Failed(session.shouldfail)
        if session.shouldstop:
            raise session.Interrupted(session.shouldstop)
        i = j
    return True


class _Timings:
    """Appends each test's seconds and outcome to a file as it ends, with a
    failure's error message (the sanitizer runs are killed when their time is
    up, before pytest prints its failure reports)."""

    RANK = {"passed": 0, "skipped": 1, "failed": 2}

    def __init__(self, path):
        self.path = path
        self.seconds: collections.Counter[str] = collections.Counter()
        self.outcome: dict[str, str] = {}
        self.reason: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] += report.duration
        worst = self.outcome.get(report.nodeid, "passed")
        if self.RANK[report.outcome] > self.RANK[worst]:
            worst = report.outcome
        self.outcome[report.nodeid] = worst
        if report.failed and report.nodeid not in self.reason:
            crash = getattr(report.longrepr, "reprcrash", None)
            text = crash.message if crash is not None else report.longreprtext
            self.reason[report.nodeid] = "\t" + " ".join(text.split())[:300]
        if report.when == "teardown":
            with open(self.path, "a") as f:
                f.write(f"{self.seconds.pop(report.nodeid):.3f}\t"
                        f"{self.outcome.pop(report.nodeid)}\t{report.nodeid}"
                        f"{self.reason.pop(report.nodeid, '')}\n")


def pytest_configure(config):
    if config.getoption("--timings") is not None:
        config.pluginmanager.register(_Timings(config.getoption("--timings")), "moelora-timings")


# The fold backends that run CUDA kernels. On a GPU, a test case of one is a
# GPU test (marked ``gpu``, so ``-m gpu`` selects it) however its file lists
# the backends (``backends()["impls"]`` holds them there); without a GPU the
# only such cases are the checks that they are refused.
CUDA_BACKENDS = ("seed", "fast")


def pytest_collection_modifyitems(config, items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if HAS_GPU and callspec is not None and callspec.params.get("impl") in CUDA_BACKENDS:
            item.add_marker(pytest.mark.gpu)
    _shard(config, items)
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
