"""The sanitizer steps of the GPU check harness: compute-sanitizer over GPU-marked
tests, resuming after the tool crashes, and the summaries of its logs.

Under every tool XLA runs as the tools need it (docs/design.md, "Sanitizers"):

- command buffers off: every kernel is a plain launch the tool sees;
- each program compiled as one module: compute-sanitizer 2025.3 crashes
  (SIGSEGV) in programs XLA compiles in parallel pieces, the larger ones such
  as the block's backward passes;
- no autotuning: racecheck stops with an internal error inside the
  autotuner's runs of candidate GEMMs, and initcheck reports its comparisons
  of their outputs;
- the slices XLA cuts from a loop's stacked operands on the main stream (pass
  ``dynamic-slice-copy-fusion-async-wrapper`` off; ``async_slices`` leaves it
  on): on a stream of their own, initcheck counts their writes before or
  after the reads that follow them, in no fixed order.

Every process shares one JAX compilation cache (``/tmp/moelora_san_jax_cache``):
a program compiles once for all tools and processes. Each run loads the test
queue plugin (``san_queue.py``, ``-p san_queue``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from harness import BudgetSpent, Harness

TOOLS_DIR = Path(__file__).resolve().parent
#: XLA flags under every tool (the module docstring says why).
XLA_UNDER_TOOLS = ("--xla_gpu_enable_command_buffer=", "--xla_gpu_force_compilation_parallelism=1",
                   "--xla_gpu_autotune_level=0")
SLICES_ON_MAIN_STREAM = "--xla_disable_hlo_passes=dynamic-slice-copy-fusion-async-wrapper"
SAN_CACHE_ENV = {"JAX_COMPILATION_CACHE_DIR": "/tmp/moelora_san_jax_cache",
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
#: The claim folders of the sanall queues, one per tool.
CLAIMS = Path("/tmp/moelora_claims")
SANALL_TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")

_TEST_ID = r"^tests/[^ \n]+::[^ \n]+"
_ERROR_RECORD = re.compile(
    r"^========= (Invalid|Uninitialized|Error|Race|Barrier|Potential|Warning)", re.M)
#: The tool's exit status when it crashed (128 + SIGSEGV).
SEGFAULT = 139


@dataclasses.dataclass
class SanRun:
    """One sanitizer run: ``compute-sanitizer <tool_args> python -m pytest -m gpu
    <pytest_args>`` within ``seconds``, its output appended to ``log``.

    ``env``: more environment; ``done``: a file of test ids (one a line)
    checked by this tool before, deselected from the start; ``xla_flags``:
    more XLA flags, after the tools' own; ``async_slices``: a loop's slices
    on their own stream."""

    log: Path
    seconds: float
    tool_args: list[str]
    pytest_args: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    done: Path | None = None
    xla_flags: str = ""
    async_slices: bool = False

    def process_env(self) -> dict[str, str]:
        """The run's environment: XLA's flags, the shared cache, the queue plugin's path."""
        flags = [*XLA_UNDER_TOOLS, *([] if self.async_slices else [SLICES_ON_MAIN_STREAM])]
        pythonpath = [str(TOOLS_DIR), *filter(None, [self.env.get("PYTHONPATH",
                                                                  os.environ.get("PYTHONPATH"))])]
        return {**self.env, **SAN_CACHE_ENV, "XLA_FLAGS": " ".join([*flags, self.xla_flags]).strip(),
                "PYTHONPATH": ":".join(pythonpath)}

    def command(self, skip: Sequence[str]) -> list[str]:
        """The tool's command line, the tests of ``done`` and ``skip`` deselected."""
        done = self.done.read_text().split() if self.done and self.done.is_file() else []
        deselect = [w for t in [*done, *skip] for w in ("--deselect", t)]
        return ["compute-sanitizer", *self.tool_args, sys.executable, "-m", "pytest", "-v",
                "-p", "no:cacheprovider", "-p", "san_queue", "-m", "gpu", *self.pytest_args,
                *deselect]


def crashed_test(text: str, new_from: int, rc: int) -> str | None:
    """The test the tool broke in, from the log's ``text``: after a crash
    (``rc`` 139) the last test id the log names; else the test of an
    "Internal Sanitizer Error" (racecheck's "failed to handle a hardware
    exception", after which every CUDA call of the process fails) in the
    lines from ``new_from`` on; None when the run did not break. ``""``: a
    crash before any test."""
    if rc == SEGFAULT:
        ids = re.findall(_TEST_ID, text, re.M)
        return ids[-1] if ids else ""
    new = "\n".join(text.split("\n")[new_from:])
    m = re.search(_TEST_ID + r" =+ Internal Sanitizer Error", new, re.M)
    return m.group(0).split()[0] if m else None


def finished_tests(text: str) -> list[str]:
    """The tests a log shows passed or skipped, then those it lists as CRASHED."""
    ids = re.findall(r"(" + _TEST_ID + r") (?:PASSED|SKIPPED)", text, re.M)
    ids += re.findall(r"^CRASHED (\S+)", text, re.M)
    return list(dict.fromkeys(ids))


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def san_shard(h: Harness, run: SanRun) -> None:
    """``run`` until its tests are done or its time is up. When the tool
    crashes (SIGSEGV) or reports an internal error, the test it happened in is
    logged on a line of its own as ``CRASHED <id>`` and the run resumes
    without it and the tests already passed or skipped. Raises
    :class:`BudgetSpent` when the budget is spent before it starts."""
    end = h.remaining() - run.seconds        # the budget left when the run's time is up
    skip: list[str] = []
    while h.remaining() > end:
        new_from = _read(run.log).count("\n")
        rc = h.run(run.command(skip), run.log, h.remaining() - end, env=run.process_env(),
                   append=True)
        text = _read(run.log)
        broke = crashed_test(text, new_from, rc)
        if broke is None:
            return
        with open(run.log, "a") as f:
            f.write(f"\nCRASHED {broke or '(before any test)'}\n")
        if not broke:
            return
        skip = finished_tests(_read(run.log))


def run_all(h: Harness, runs: Iterable[SanRun]) -> None:
    """The runs at once, one thread (and tool process) each (those the budget
    leaves no time for do not start)."""
    def run_one(run: SanRun) -> None:
        try:
            san_shard(h, run)
        except BudgetSpent:
            pass

    threads = [threading.Thread(target=run_one, args=(run,), daemon=True) for run in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def san_errors(text: str) -> int:
    """How many error records the tool printed (each is printed when it
    happens, so those of runs that crashed count too)."""
    return len(_ERROR_RECORD.findall(text))


def san_summary(logs: Iterable[Path]) -> str:
    """One line on the runs in ``logs``: the tool's summaries (counted),
    pytest's, the tests the tool crashed in, and the error records."""
    text = "".join(_read(log) for log in logs)
    lines = [" ".join(line.split()) for line in text.splitlines()]
    summaries = Counter(ln for ln in lines if "ERROR SUMMARY" in ln or "RACECHECK SUMMARY" in ln)
    tools = ";".join(f"{n} {ln}" for ln, n in sorted(summaries.items()))
    pytest_lines = ";".join(ln for ln in lines if re.search(r"(passed|failed).* in ", ln))
    crashed = sum(ln.startswith("CRASHED ") for ln in lines)
    return f"{tools}; {pytest_lines}; crashed: {crashed}, error records: {san_errors(text)}"


def tool_info(h: Harness) -> None:
    """compute-sanitizer's version and options into ``sanall_tool.txt``."""
    log = h.r / "sanall_tool.txt"
    for i, flag in enumerate(("--version", "--help")):
        h.run(["compute-sanitizer", flag], log, 60, append=i > 0)


def san_step(h: Harness, tool: str, seconds: float, files: Sequence[str], k: str, *,
             xla_flags: str = "", async_slices: bool = False) -> None:
    """The step named after ``tool``: it over the tests of ``files`` that
    ``k`` selects (``-x``), within ``seconds``, into ``<tool>.log``."""
    h.step(tool)
    san_shard(h, SanRun(h.r / f"{tool}.log", seconds, ["--tool", tool, "--print-limit", "20"],
                        ["-x", "-k", k, *files], xla_flags=xla_flags, async_slices=async_slices))
    h.step(f"{tool} done")


# -- sanruns ---------------------------------------------------------------

def read_sanruns(h: Harness, files: Sequence[Path], *, xla_flags: str = "",
                 async_slices: bool = False) -> list[SanRun]:
    """The runs the lines of ``files`` list, a line each, tab-separated:
    name, environment (``VAR=value ...``, or ``-``), seconds,
    compute-sanitizer options (``--print-limit 20`` and ``--show-backtrace
    device`` unless given), pytest arguments (test ids, no -k expression with
    spaces). ``SAN_XLA_FLAGS`` and ``SAN_ASYNC_SLICES`` in the environment
    column are the run's ``xla_flags`` and ``async_slices`` (``=1``). Lines
    that are empty or start with ``#`` are skipped."""
    runs = []
    for path in files:
        for line in Path(path).read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            name, envs, secs, opts, args = (line.split("\t", 4) + [""] * 4)[:5]
            run = SanRun(h.r / f"sanrun_{name}.log", float(secs), _default_options(opts.split()),
                         [f"--timings={h.r / f'sanrun_times_{name}.tsv'}", *args.split()],
                         xla_flags=xla_flags, async_slices=async_slices)
            for word in [] if envs.strip() == "-" else envs.split():
                key, _, value = word.partition("=")
                if key == "SAN_XLA_FLAGS":
                    run.xla_flags = value
                elif key == "SAN_ASYNC_SLICES":
                    run.async_slices = value == "1"
                else:
                    run.env[key] = value
            runs.append(run)
    return runs


def _default_options(opts: list[str]) -> list[str]:
    if "--print-limit" not in opts:
        opts = ["--print-limit", "20", *opts]
    if "--show-backtrace" not in opts:
        opts = ["--show-backtrace", "device", *opts]
    return opts


def sanruns(h: Harness, files: Sequence[Path], **settings) -> None:
    """The ``sanruns`` step: every line of ``files`` (:func:`read_sanruns`)
    at once, each in its own process, a summary line each in ``phases.log``."""
    h.step(f"sanruns: {' '.join(map(str, files))}")
    run_all(h, read_sanruns(h, files, **settings))
    for log in sorted(h.r.glob("sanrun_*.log")):
        h.step(f"{log.stem}: {san_summary([log])}")


# -- sanall ----------------------------------------------------------------

@dataclasses.dataclass
class SanAll:
    """The ``sanall`` step's settings (the harness' ``--sanall-*`` options).

    ``tools`` each over the GPU-marked suite (or ``files`` and ``k``) in
    ``n`` processes that take the tests from one queue, every tool at once,
    within ``seconds``; ``shards``: the process numbers this run starts
    (default all); ``done_dir``: a folder of ``<tool>.txt`` lists of tests
    checked before (skipped) and ``<tool>_times.tsv``, their seconds, by
    which the queue runs the longest first; ``kernels``: a regex of the
    kernels checked (not initcheck's: it needs every kernel's writes
    tracked); ``api_check``: initcheck's ``--check-api-memory-access``."""

    tools: Sequence[str] = SANALL_TOOLS
    n: int = 4
    shards: Sequence[int] | None = None
    done_dir: Path | None = None
    seconds: float = 480
    kernels: str = ""
    api_check: str = "no"
    opts: Sequence[str] = ()
    files: Sequence[str] = ()
    k: str = ""
    xla_flags: str = ""
    async_slices: bool = False

    def tool_args(self, tool: str) -> list[str]:
        """compute-sanitizer's options for ``tool``: records with the device backtrace only."""
        args = ["--tool", tool, "--print-limit", "20", "--show-backtrace", "device", *self.opts]
        if tool == "initcheck":
            return [*args, "--check-api-memory-access", self.api_check]
        return [*args, "--kernel-name", f"regex={self.kernels}"] if self.kernels else args


def gpu_count() -> int:
    """The GPUs ``nvidia-smi -L`` lists (1 when it lists none or is missing)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 1
    return max(1, sum(line.startswith("GPU") for line in out.splitlines()))


def _order_file(h: Harness, done_dir: Path | None) -> Path | None:
    """The seconds of ``done_dir``'s ``*_times.tsv`` in one file, or None without any."""
    times = sorted(done_dir.glob("*_times.tsv")) if done_dir else []
    if not times:
        return None
    order = h.out / "sanall_order.tsv"
    order.write_text("".join(p.read_text() for p in times))
    return order


def sanall_runs(h: Harness, s: SanAll, gpus: int) -> list[SanRun]:
    """One run per tool and process; on a machine of several GPUs the
    processes take the GPUs in turn. initcheck runs with XLA's platform
    allocator (one cudaMalloc a buffer): under the default pool a buffer
    reuses bytes an earlier test of the process wrote."""
    order = _order_file(h, s.done_dir)
    runs, j = [], 0
    for tool in s.tools:
        for i in s.shards if s.shards is not None else range(s.n):
            env = {"CUDA_VISIBLE_DEVICES": str(j % gpus)}
            if tool == "initcheck":
                env["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
            queue = [f"--shard={i}/{s.n}", f"--claim={CLAIMS / tool}",
                     *([f"--order={order}"] if order else []),
                     f"--timings={h.r / f'sanall_times_{tool}.tsv'}"]
            runs.append(SanRun(h.r / f"sanall_{tool}_{i}.log", s.seconds, s.tool_args(tool),
                               [*queue, *s.files, *(["-k", s.k] if s.k else [])], env=env,
                               done=s.done_dir / f"{tool}.txt" if s.done_dir else None,
                               xla_flags=s.xla_flags, async_slices=s.async_slices))
            j += 1
    return runs


def write_done(r: Path, tool: str, done_dir: Path | None) -> Path:
    """``sanall_done_<tool>.txt``: the tests checked before (``done_dir``) and
    those this run did not fail (its seconds file: the tool's output can
    split a log's PASSED line)."""
    ids = set(_read(done_dir / f"{tool}.txt").split()) if done_dir else set()
    for line in _read(r / f"sanall_times_{tool}.tsv").splitlines():
        fields = line.split("\t")
        if len(fields) >= 3 and fields[1] != "failed":
            ids.add(fields[2])
    out = r / f"sanall_done_{tool}.txt"
    out.write_text("".join(f"{t}\n" for t in sorted(ids)))
    return out


def sanall(h: Harness, s: SanAll) -> None:
    """The ``sanall`` step: every tool of ``s`` over the suite, each tool's
    processes sharing one queue, all at once; per tool a summary line in
    ``phases.log`` with the tests it crashed in, and ``sanall_done_<tool>.txt``
    to carry to the next run (``gpu_check.py carry``)."""
    gpus = gpu_count()
    h.step(f"sanall: {' '.join(s.tools)}, {s.n} processes each, {gpus} GPU(s)")
    shutil.rmtree(CLAIMS, ignore_errors=True)
    run_all(h, sanall_runs(h, s, gpus))
    for tool in s.tools:
        write_done(h.r, tool, s.done_dir)
        logs = sorted(h.r.glob(f"sanall_{tool}_*.log"))
        h.step(f"sanall {tool}: {san_summary(logs)}")
        crashed = [ln for log in logs for ln in _read(log).splitlines() if ln.startswith("CRASHED ")]
        if crashed:
            h.note("\n".join(crashed))


def carry(tgz: Path, folder: Path) -> list[str]:
    """Fold a ``sanall`` run's lists (``results.tgz``) into ``folder``, the
    ``--sanall-done`` folder of the next run: each tool's list of tests done is
    replaced by the run's (which already holds the earlier lists), its seconds
    appended to ``<tool>_times.tsv``. Returns a line per tool: its count of
    tests done."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(tgz) as tar:
        tar.extractall(tmp, filter="data")
        r = Path(tmp) / "r"
        for done in sorted(r.glob("sanall_done_*.txt")):
            tool = done.stem.removeprefix("sanall_done_")
            shutil.copyfile(done, folder / f"{tool}.txt")
            times = r / f"sanall_times_{tool}.tsv"
            if times.is_file():
                with open(folder / f"{tool}_times.tsv", "a") as f:
                    f.write(times.read_text())
            count = len((folder / f"{tool}.txt").read_text().splitlines())
            lines.append(f"{tool}: {count} tests done")
    return lines
