"""The test queue of the sanitizer runs, a pytest plugin (``-p san_queue``, with
this folder on ``PYTHONPATH``; the GPU check harness loads it in every
sanitizer run).

- ``--shard I/N``: run only every N-th selected test, starting at the I-th, so
  N processes run the selection once between them.
- ``--claim DIR`` (with ``--shard I/N``): the N processes sharing DIR take the
  tests from one queue instead: each test runs in the first process to claim
  it (to create its file in DIR), so none idles while another has a backlog.
  Process I starts at the I-th of N equal slices of the selection, or, with
  ``--order FILE`` (a ``--timings`` file of earlier runs), every process takes
  the longest test left, tests the file lacks first. A process that starts
  again (after its tool crashed) runs the tests it claimed before.
- ``--timings FILE``: append a line per test as it ends: seconds (setup, call
  and teardown), outcome, test id and, for a failure, its error message,
  tab-separated. The sanitizer runs are killed when their time is up, before
  pytest prints its failure reports: the lines are what is left of them.
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("san_queue", "the sanitizer runs' test queue")
    group.addoption("--shard", default=None, metavar="I/N",
                    help="run only every N-th selected test, starting at the I-th (0 <= I < N): "
                         "N such processes run the selection once between them")
    group.addoption("--claim", default=None, metavar="DIR",
                    help="with --shard I/N: the N processes sharing DIR take the selected tests "
                         "from one queue instead (each test runs in the first process to claim "
                         "it, by a file in DIR); process I starts at the I-th of N equal slices, "
                         "or, with --order, every process takes the longest test left")
    group.addoption("--order", default=None, metavar="FILE",
                    help="with --claim: a --timings FILE of earlier runs; tests run longest "
                         "first, those it lacks before all others")
    group.addoption("--timings", default=None, metavar="FILE",
                    help="append a line per test to FILE: seconds (setup, call and teardown), "
                         "outcome, test id and, for a failure, its error message, tab-separated")


def shard_spec(config: pytest.Config) -> tuple[int, int] | None:
    """``(I, N)`` of ``--shard I/N``, or None without it."""
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


def read_timings(path: str | os.PathLike) -> dict[str, float]:
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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the selection for the queue (``--claim``), or keep this shard's
    tests (``--shard`` alone). Runs last: after ``-m``/``-k`` deselected."""
    spec = shard_spec(config)
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
    config.hook.pytest_deselected(items=[item for j, item in enumerate(items) if j % n != i])
    items[:] = [item for j, item in enumerate(items) if j % n == i]


def claim(directory: str | os.PathLike, nodeid: str, owner: str) -> bool:
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
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    """With ``--claim``: :func:`run_claimed` (pytest's hook argument)."""
    return run_claimed(session)


def run_claimed(run) -> bool | None:
    """With ``--claim``: run the tests this process claims, in order, claiming
    each next test before the current one runs (pytest tears fixtures down by
    the next test that runs). ``run``: pytest's object of the whole test run."""
    directory = run.config.getoption("--claim")
    if directory is None or run.config.option.collectonly:
        return None
    if run.testsfailed and not run.config.option.continue_on_collection_errors:
        raise run.Interrupted(f"{run.testsfailed} errors during collection")
    Path(directory).mkdir(parents=True, exist_ok=True)
    owner = run.config.getoption("--shard") or "0/1"
    items = run.items

    def next_claimed(j: int) -> int:
        while j < len(items) and not claim(directory, items[j].nodeid, owner):
            j += 1
        return j

    i = next_claimed(0)
    while i < len(items):
        j = next_claimed(i + 1)
        items[i].config.hook.pytest_runtest_protocol(
            item=items[i], nextitem=items[j] if j < len(items) else None)
        if run.shouldfail:
            raise run.Failed(run.shouldfail)
        if run.shouldstop:
            raise run.Interrupted(run.shouldstop)
        i = j
    return True


class Timings:
    """Appends each test's seconds and outcome to a file as it ends, with a
    failure's error message."""

    RANK = {"passed": 0, "skipped": 1, "failed": 2}

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = path
        self.seconds: collections.Counter[str] = collections.Counter()
        self.outcome: dict[str, str] = {}
        self.reason: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
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


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--timings") is not None:
        config.pluginmanager.register(Timings(config.getoption("--timings")), "san-queue-timings")
