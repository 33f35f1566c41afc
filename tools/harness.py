"""What every step of the GPU check harness runs on: an overall budget, the
step log (``phases.log``), commands run with their output in a log file and
killed (with everything they started) at their timeout or at the budget's end,
and the results archive.

Standard library only: the harness runs on a GPU machine with ``python3`` and
what the project installs.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tarfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

#: The exit status of a command cut at its timeout (as coreutils ``timeout``).
TIMED_OUT = 124
#: The exit status of a command that could not start (as a shell's).
NOT_FOUND = 127
#: Seconds between SIGTERM and SIGKILL when a command is cut.
KILL_AFTER = 5.0


class BudgetSpent(Exception):
    """The overall budget ran out: no further step starts."""


class Harness:
    """One run of the harness: results under ``out/r`` (archived as
    ``out/results.tgz`` by :meth:`pack`), ``budget`` seconds in all.

    ``dry_run``: commands are logged (``$ ...`` lines in ``phases.log``)
    instead of run, with status 0."""

    def __init__(self, out: Path, budget: float, *, dry_run: bool = False) -> None:
        self.out = Path(out)
        self.r = self.out / "r"
        self.r.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget
        self.dry_run = dry_run
        self.budget_cut = False
        self.stopping = False
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()

    # -- time -------------------------------------------------------------
    def remaining(self) -> float:
        """Seconds left of the budget."""
        return self.deadline - time.monotonic()

    def seconds(self, limit: float) -> float:
        """``limit`` or what is left of the budget, whichever is less; raises
        :class:`BudgetSpent` when nothing is left (or the harness is stopping)."""
        left = self.remaining()
        if left <= 0 or self.stopping:
            self.budget_cut = True
            raise BudgetSpent
        return min(limit, left)

    # -- logs -------------------------------------------------------------
    def step(self, message: str) -> None:
        """``[<seconds since the start>s] message`` into ``phases.log`` and on stdout."""
        line = f"[{int(time.monotonic() - self.t0)}s] {message}"
        self.note(line)
        print(line, flush=True)

    def note(self, text: str) -> None:
        """A line (or lines) into ``phases.log`` as is."""
        with self._lock, open(self.r / "phases.log", "a") as f:
            f.write(text.rstrip("\n") + "\n")

    # -- commands ---------------------------------------------------------
    def run(self, cmd: Sequence[str], log: Path, limit: float, *,
            env: Mapping[str, str] | None = None, append: bool = False,
            cwd: Path | None = None) -> int:
        """Run ``cmd`` with stdout and stderr into ``log`` (appended with
        ``append``), within ``limit`` seconds and the budget; ``env``: more
        environment. Returns its exit status: 128 + N when signal N ended it,
        :data:`TIMED_OUT` when it was cut (its process group killed),
        :data:`NOT_FOUND` when it could not start."""
        seconds = self.seconds(limit)
        if self.dry_run:
            self.note(f"$ {_shell_line(cmd, env)} {'>>' if append else '>'} {log}")
            return 0
        full_env = {**os.environ, **(env or {})}
        with open(log, "a" if append else "w") as f:
            try:
                proc = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT,
                                        env=full_env, cwd=cwd, start_new_session=True)
            except OSError as err:  # not found, not executable
                f.write(f"{cmd[0]}: {err}\n")
                return NOT_FOUND
            with self._lock:
                self._running.add(proc)
            try:
                return self._wait(proc, seconds)
            finally:
                with self._lock:
                    self._running.discard(proc)

    def _wait(self, proc: subprocess.Popen, seconds: float) -> int:
        try:
            rc = proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            if self.remaining() <= 0:
                self.budget_cut = True
            _kill_group(proc)
            return TIMED_OUT
        return 128 - rc if rc < 0 else rc

    def kill_all(self) -> None:
        """Kill every command still running and start no other (the harness is stopping)."""
        self.stopping = True
        with self._lock:
            running = list(self._running)
        for proc in running:
            _kill_group(proc)

    # -- results ----------------------------------------------------------
    def pack(self, rc: int) -> Path:
        """``steps rc=<rc>`` into ``phases.log``, then ``r/`` into
        ``results.tgz`` (and ``r/`` removed); returns the archive's path."""
        self.note(f"steps rc={rc}")
        tgz = self.out / "results.tgz"
        with tarfile.open(tgz, "w:gz") as tar:
            tar.add(self.r, arcname="r")
        shutil.rmtree(self.r)
        return tgz


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL after :data:`KILL_AFTER` seconds."""
    for sig, wait in ((signal.SIGTERM, KILL_AFTER), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _shell_line(cmd: Sequence[str], env: Mapping[str, str] | None) -> str:
    """``cmd`` with its extra environment as one shell line."""
    words = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()] + [shlex.quote(c)
                                                                          for c in cmd]
    return " ".join(words)


def words(text: str | None) -> list[str]:
    """A command line's words (shell quoting), none for ``None`` or ``""``."""
    return shlex.split(text) if text else []
