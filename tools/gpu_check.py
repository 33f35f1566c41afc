#!/usr/bin/env python3
"""The GPU check harness: on a GPU machine, build against its jaxlib, then run
the chosen steps one after the other on GPU 0 (timings never share the GPU
with the test suite).

    python3 tools/gpu_check.py --out DIR [--steps build,bench,...] [options]
    python3 tools/gpu_check.py carry RESULTS_TGZ [FOLDER]

For example, the build, the suite on the fast kernels' fold tests, the
training benchmark and its transformers + peft peer::

    python3 tools/gpu_check.py --out "$OUT" --steps build,suite,train,peer
        --tests="tests/test_folds.py -k fast"

(one command line). ``python3 tools/gpu_check.py --help`` lists the steps and
their options. The steps run in the repository root (the folder above this
one), with ``python3``'s standard library and what the project installs.

Every log lands in ``DIR/r/``, archived as ``DIR/results.tgz`` when the
harness ends, also when a step overruns: the steps get ``--budget`` seconds in
all (default 560), and each step has its own timeout too. ``phases.log`` has
a line per step and its exit status (124: cut at its timeout), and ``steps
rc=<status>`` at its end (124: the budget ran out).

A GPU machine without network takes the CUTLASS headers of ``expert_matmul``
from the nvidia-cutlass wheel in ``--wheels`` (default ``.whl/``; ``pip
download --no-deps "nvidia-cutlass==4.2.*" -d .whl`` beforehand); without it
that kernel is not built.

Option values that start with ``-`` are given with ``=``:
``--bench="--quick --methods fast"``.

``carry`` folds a ``sanall`` run's lists of tests done into FOLDER (default
``.san_done``, git-ignored), the ``--sanall-done`` folder of the next run, so a
sanitizer pass over the suite can be split over several runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import sys
import textwrap
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sanitizer  # noqa: E402  (this folder, not installed)
from harness import TIMED_OUT, BudgetSpent, Harness, words  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
MOELORA = [PY, "-m", "jax_moelora"]
#: The environment of every step: unbuffered output, NVLink multicast off, GPU 0,
#: JAX taking memory as it needs it (so test processes can share the GPU).
BASE_ENV = {"PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "CUDA_VISIBLE_DEVICES": "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
DEFAULT_STEPS = "build,bench,bench2,timing,suite,memcheck,racecheck,ncu"
CMDBUF_BENCH = ("--models qwen --projs gate --tokens 1,64 --ranks 16 --adapters 4 "
                "--methods fast --no-check --no-plot")
NCU_SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "MemoryWorkloadAnalysis",
                "WarpStateStats", "SchedulerStats")

Step = Callable[[Harness, argparse.Namespace], None]
#: The steps, in the order they run (whatever the order ``--steps`` names them in).
STEPS: dict[str, Step] = {}


def step(name: str) -> Callable[[Step], Step]:
    """Register a step; its docstring's first line is its ``--help`` entry."""
    def register(fn: Step) -> Step:
        STEPS[name] = fn
        return fn
    return register


def _command_step(h: Harness, name: str, cmd: list[str], limit: float,
                  log: str | None = None, env: dict[str, str] | None = None) -> int:
    """``cmd`` as step ``name``: a line before and one with its status after,
    output into ``<log or name>.log``."""
    h.step(name)
    rc = h.run(cmd, h.r / f"{log or name}.log", limit, env=env)
    h.step(f"{name} rc={rc}")
    return rc


def _install_cutlass(h: Harness, a: argparse.Namespace, log: Path) -> None:
    """The nvidia-cutlass wheel of ``--wheels``, when there is one."""
    wheels = sorted(Path(a.wheels).glob("nvidia_cutlass-*.whl"))
    if wheels:
        h.run([PY, "-m", "pip", "install", "--no-deps", *map(str, wheels)], log, 300)


@step("build")
def build(h: Harness, a: argparse.Namespace) -> None:
    """pip install of the checkout (the CUDA kernels built here), then ``info``."""
    log = h.r / "build.log"
    h.step("build")
    _install_cutlass(h, a, log)
    rc = h.run([PY, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-v", "."],
               log, 300, append=True)
    h.step(f"build rc={rc}")
    built = [ln for ln in log.read_text(errors="replace").splitlines()
             if re.search("expert_matmul:|jax_moelora CUDA", ln)] if log.is_file() else []
    if built:
        h.note("\n".join(built))
    h.run([*MOELORA, "info"], log, 120, append=True)


def readme_command(readme: Path) -> str | None:
    """The README's GPU command without its first (download) step."""
    for line in readme.read_text().splitlines():
        if line.startswith('python3 -m pip install "jax[cuda'):
            return line.split("&& ", 1)[-1]
    return None


@step("readme")
def readme(h: Harness, a: argparse.Namespace) -> None:
    """The README's GPU command (builds the kernels, runs the demo); replaces build."""
    log = h.r / "readme.log"
    h.step("readme")
    _install_cutlass(h, a, log)
    cmd = readme_command(Path("README.md")) or "false  # no GPU command in README.md"
    with open(log, "a") as f:
        f.write(cmd + "\n")
    rc = h.run(["bash", "-c", cmd], log, 400, append=True)
    h.step(f"readme rc={rc}")
    h.run([*MOELORA, "info"], log, 120, append=True)


@step("cmdbuf")
def cmdbuf(h: Harness, a: argparse.Namespace) -> None:
    """The same folds with XLA's command buffers forced around custom calls."""
    bench = [*MOELORA, "bench", *words(CMDBUF_BENCH)]
    forced = {"XLA_FLAGS": a.cmdbuf_flags}
    log = h.r / "cmdbuf.log"
    h.step("cmdbuf")
    h.run([*bench, "--out", str(h.r / "cb0")], log, 100)
    h.run([*bench, "--out", str(h.r / "cb1")], log, 100, env=forced, append=True)
    rc = h.run([*MOELORA, "demo", "--timing", "--repeats", "10"], h.r / "timing_cmdbuf.log", 90,
               env=forced)
    h.step(f"cmdbuf rc={rc}")


@step("bench")
def bench(h: Harness, a: argparse.Namespace) -> None:
    """``python -m jax_moelora bench`` with ``--bench``."""
    _command_step(h, "bench", [*MOELORA, "bench", *words(a.bench), "--out", str(h.r / "bench")],
                  a.bench_s)


@step("bench2")
def bench2(h: Harness, a: argparse.Namespace) -> None:
    """A second benchmark, with ``--bench2`` (skipped without it)."""
    if a.bench2:
        _command_step(h, "bench2", [*MOELORA, "bench", *words(a.bench2), "--out",
                                    str(h.r / "bench2")], a.bench2_s)


@step("gemm")
def gemm(h: Harness, a: argparse.Namespace) -> None:
    """``bench --gemm`` with ``--gemm``: the grouped expert GEMM."""
    _command_step(h, "gemm", [*MOELORA, "bench", "--gemm", *words(a.gemm), "--out",
                              str(h.r / "gemm")], a.gemm_s)


@step("train")
def train(h: Harness, a: argparse.Namespace) -> None:
    """``bench --train`` with ``--train``: the training benchmark."""
    _command_step(h, "train", [*MOELORA, "bench", "--train", *words(a.train), "--out",
                               str(h.r / "train")], a.train_s)


@step("peer")
def peer(h: Harness, a: argparse.Namespace) -> None:
    """scripts/peft_train_peer.py with ``--peer``: transformers + peft on the same GPU."""
    _command_step(h, "peer", [PY, "scripts/peft_train_peer.py", *words(a.peer), "--json",
                              str(h.r / "peer.json")], a.peer_s)


@step("timing")
def timing(h: Harness, a: argparse.Namespace) -> None:
    """``demo --timing`` (decode), then ``demo --timing --prefill`` (T = 4096, base and
    4 adapters, ragged_dot and expert_matmul as the grouped GEMM)."""
    _command_step(h, "timing", [*MOELORA, "demo", "--timing", "--repeats", "10",
                                *words(a.timing), "--json", str(h.r / "timing.json")], 90)
    if a.prefill_s > 0:
        _command_step(h, "timing prefill", [*MOELORA, "demo", "--timing", "--prefill",
                                            *words(a.prefill), "--json",
                                            str(h.r / "timing_prefill.json")],
                      a.prefill_s, log="timing_prefill")


def per_test_timeout(seconds: float) -> list[str]:
    """pytest-timeout's arguments that end a test after ``seconds`` (0: never),
    where the plugin is installed: a kernel that hangs fails its test and
    leaves the call's time to the others."""
    if seconds <= 0 or importlib.util.find_spec("pytest_timeout") is None:
        return []
    return [f"--timeout={seconds:g}", "--timeout-method=thread"]


@step("suite")
def suite(h: Harness, a: argparse.Namespace) -> None:
    """The test suite (8 workers) with ``--tests``, each test cut at ``--test-timeout``."""
    _command_step(h, "suite", [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *per_test_timeout(a.test_timeout), "-n", "8", "-rf",
                               *words(a.tests)], a.suite_s)


@step("soak")
def soak(h: Harness, a: argparse.Namespace) -> None:
    """The 10,000-step soak, its counts printed."""
    _command_step(h, "soak", [PY, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-m",
                              "gpu", "tests/test_soak.py"], 200)


@step("fuzz")
def fuzz(h: Harness, a: argparse.Namespace) -> None:
    """The GPU differential fuzzing, ``--fuzz-examples`` per test on ``--fuzz-n`` workers."""
    _command_step(h, "fuzz", [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n",
                              str(a.fuzz_n), "tests/test_differential.py"], a.fuzz_s,
                  env={"MOELORA_FUZZ_EXAMPLES": str(a.fuzz_examples)})


def _san_settings(a: argparse.Namespace) -> dict:
    return dict(xla_flags=a.san_xla_flags, async_slices=a.san_async_slices)


@step("sanall")
def sanall(h: Harness, a: argparse.Namespace) -> None:
    """Every ``--sanall-tools`` tool over the whole GPU-marked suite, ``--sanall-n``
    processes a tool taking the tests from one queue, all at once."""
    sanitizer.tool_info(h)
    done = Path(a.sanall_done) if a.sanall_done else None
    sanitizer.sanall(h, sanitizer.SanAll(
        tools=a.sanall_tools, n=a.sanall_n, shards=a.sanall_shards, done_dir=done,
        seconds=a.sanall_s, kernels=a.sanall_kernels, api_check=a.sanall_api_check,
        opts=words(a.sanall_opts), files=words(a.sanall_files), k=a.sanall_k,
        **_san_settings(a)))


@step("sanruns")
def sanruns(h: Harness, a: argparse.Namespace) -> None:
    """The sanitizer runs the lines of ``--sanruns`` files list, one process each, all at once."""
    if "sanall" not in a.steps:
        sanitizer.tool_info(h)
    sanitizer.sanruns(h, [Path(p) for p in a.sanruns], **_san_settings(a))


def _san_tool_step(tool: str, seconds: float) -> None:
    def run(h: Harness, a: argparse.Namespace) -> None:
        sanitizer.san_step(h, tool, seconds, words(a.san_files), a.san_k, **_san_settings(a))
    run.__doc__ = f"{tool} over ``--san-files`` / ``--san-k`` ({seconds:g} s)."
    step(tool)(run)


for _tool, _seconds in (("memcheck", 150), ("racecheck", 150), ("initcheck", 120),
                        ("synccheck", 120)):
    _san_tool_step(_tool, _seconds)


def _ncu(h: Harness, a: argparse.Namespace, log: str, bench_args: list[str]) -> int:
    """Nsight Compute on ``--ncu-launches`` launches of the kernels matching
    ``--kernels`` in one bench run (``bench_args`` come last: they may override
    the defaults, e.g. ``--gemm --methods gemm@pingpong``)."""
    sections = [w for s in NCU_SECTIONS for w in ("--section", s)]
    cmd = ["ncu", "--clock-control", "none", "-k", f"regex:{a.kernels}", "--launch-count",
           str(a.ncu_launches), *sections, *MOELORA, "bench", "--methods", "fast", "--reps", "1",
           "--runs", "1", "--warmup", "1", "--no-check", "--no-plot", "--bw-mib", "16", "--out",
           "/tmp/ncu_bench", *bench_args]
    return h.run(cmd, h.r / f"{log}.log", 120)


@step("ncu")
def ncu(h: Harness, a: argparse.Namespace) -> None:
    """Nsight Compute on the kernels matching ``--kernels`` in the ``--ncu`` bench,
    then in ``--ncu2``'s when given."""
    h.step("ncu")
    h.step(f"ncu rc={_ncu(h, a, 'ncu', words(a.ncu))}")
    if a.ncu2:
        h.step(f"ncu2 rc={_ncu(h, a, 'ncu2', words(a.ncu2))}")


@step("scaling")
def scaling(h: Harness, a: argparse.Namespace) -> None:
    """``python -m jax_moelora.tools.scaling`` with ``--scaling`` on GPUs 0 and 1
    (skipped on one GPU)."""
    if sanitizer.gpu_count() < 2:
        h.step("scaling skipped: one GPU")
        return
    _command_step(h, "scaling", [PY, "-m", "jax_moelora.tools.scaling", *words(a.scaling),
                                 "--json", str(h.r / "scaling.json")], a.scaling_s,
                  env={"CUDA_VISIBLE_DEVICES": "0,1"})


def run_steps(h: Harness, a: argparse.Namespace) -> int:
    """``nvidia-smi`` into ``nvidia-smi.txt``, then the chosen steps in order
    (a step that raises is logged with its error, and the next one runs);
    returns 0, or 124 when the budget ran out."""
    h.run(["nvidia-smi"], h.r / "nvidia-smi.txt", 60)
    for name, fn in STEPS.items():
        if name not in a.steps:
            continue
        try:
            fn(h, a)
        except BudgetSpent:
            h.step(f"budget spent: {name} and the steps after it cut")
            return TIMED_OUT
        except Exception as err:  # a bad option value or file: the other steps still run
            h.step(f"{name} failed: {err!r}")
            h.note(traceback.format_exc())
    if h.budget_cut:
        h.step("budget spent: the last step cut")
        return TIMED_OUT
    h.step("done")
    return 0


class _Stopped(BaseException):
    """The harness got SIGTERM (or SIGINT); a BaseException, as KeyboardInterrupt,
    so that no step's error handling stops it."""


def _stop(signum: int, _frame) -> None:
    raise _Stopped(signum)


def check(a: argparse.Namespace) -> int:
    """Run the steps of ``a`` in the repository root; the results archive is
    written whatever happens."""
    a.sanruns = [str(Path(p).resolve()) for p in a.sanruns]
    a.sanall_done = str(Path(a.sanall_done).resolve()) if a.sanall_done else ""
    a.wheels = str(Path(a.wheels).resolve())
    h = Harness(Path(a.out).resolve(), a.budget, dry_run=a.dry_run)
    os.chdir(ROOT)
    os.environ.update(BASE_ENV)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    rc = 1
    try:
        rc = run_steps(h, a)
    except _Stopped as stop:
        h.step(f"stopped by signal {stop.args[0]}")
        rc = 128 + stop.args[0]
    finally:
        h.kill_all()
        print(f"results: {h.pack(rc)}", flush=True)
    return 0


# -- options ---------------------------------------------------------------

def _names(choices: dict | tuple) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n for n in re.split(r"[,\s]+", text) if n]
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(choices)}")
        return names
    return parse


def _ints(text: str) -> list[int]:
    return [int(n) for n in re.split(r"[,\s]+", text) if n]


def _steps_help() -> str:
    lines = ["steps (they run in this order):"]
    for name, fn in STEPS.items():
        doc = " ".join((fn.__doc__ or "").split("\n\n")[0].split()).replace("``", "")
        lines += textwrap.wrap(f"{name:<10} {doc}", 96, initial_indent="  ",
                               subsequent_indent=" " * 13)
    return "\n".join(lines)


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The epilog as written, the defaults in the options' help."""


def parser() -> argparse.ArgumentParser:
    """The harness' options (``carry`` has its own: :func:`carry_parser`)."""
    p = argparse.ArgumentParser(
        prog="python3 tools/gpu_check.py", description=__doc__.replace("``", ""),
        epilog=_steps_help(), formatter_class=_Formatter)
    p.add_argument("--out", required=True, help="the folder of r/ and results.tgz")
    p.add_argument("--steps", type=_names(STEPS), default=DEFAULT_STEPS,
                   help="the steps, comma-separated")
    p.add_argument("--budget", type=float, default=560, help="seconds for all steps")
    p.add_argument("--wheels", default=".whl", help="the folder of the nvidia-cutlass wheel")
    p.add_argument("--dry-run", action="store_true",
                   help="log the commands ($ lines in phases.log) instead of running them")
    _add_step_options(p)
    _add_sanitizer_options(p)
    return p


def _add_step_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("steps' arguments (a command line's words) and timeouts (s)")
    g.add_argument("--bench", default="--quick --methods fast,einsum", help="bench's arguments")
    g.add_argument("--bench-s", type=float, default=240, help="timeout (s)")
    g.add_argument("--bench2", default="", help="a second bench's arguments")
    g.add_argument("--bench2-s", type=float, default=200, help="timeout (s)")
    g.add_argument("--gemm", default="--models qwen", help="bench --gemm's arguments")
    g.add_argument("--gemm-s", type=float, default=240, help="timeout (s)")
    g.add_argument("--train", default="--quick", help="bench --train's arguments")
    g.add_argument("--train-s", type=float, default=240, help="timeout (s)")
    g.add_argument("--peer", default="--models qwen --tokens 512,4096 --rank 16",
                   help="scripts/peft_train_peer.py's arguments")
    g.add_argument("--peer-s", type=float, default=150, help="timeout (s)")
    g.add_argument("--timing", default="",
                   help="more arguments of the decode timing, e.g. --timing=\"--trace DIR\"")
    g.add_argument("--prefill", default="", help="more arguments of the prefill timing")
    g.add_argument("--prefill-s", type=float, default=150,
                   help="timeout (s); 0 skips the prefill timing")
    g.add_argument("--tests", default="", help="the suite's pytest arguments")
    g.add_argument("--suite-s", type=float, default=300, help="timeout (s)")
    g.add_argument("--test-timeout", type=float, default=240,
                   help="one test's timeout (s) in the suite, where pytest-timeout is "
                   "installed; 0: none")
    g.add_argument("--fuzz-examples", type=int, default=100, help="examples per fuzz test")
    g.add_argument("--fuzz-n", type=int, default=8, help="fuzz workers")
    g.add_argument("--fuzz-s", type=float, default=300, help="timeout (s)")
    g.add_argument("--cmdbuf-flags", default="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,"
                   "CUBLASLT,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1",
                   help="XLA_FLAGS of the cmdbuf step's second runs")
    g.add_argument("--scaling", default="", help="python -m jax_moelora.tools.scaling's arguments")
    g.add_argument("--scaling-s", type=float, default=90, help="timeout (s)")
    g.add_argument("--kernels", default="cells", help="ncu's kernel name regex")
    g.add_argument("--ncu", default="--models qwen --projs gate --tokens 64 --ranks 16 "
                   "--adapters 4", help="bench arguments of the ncu step")
    g.add_argument("--ncu2", default="", help="a second ncu bench")
    g.add_argument("--ncu-launches", type=int, default=2, help="launches profiled per ncu run")


def _add_sanitizer_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sanitizer steps (memcheck, racecheck, initcheck, synccheck, "
                             "sanall, sanruns)")
    g.add_argument("--san-files", default="tests/test_folds.py tests/test_stacked.py",
                   help="test files of the single-tool steps")
    g.add_argument("--san-k", default="fast and not large", help="their -k expression")
    g.add_argument("--san-xla-flags", default="", help="more XLA flags under every tool")
    g.add_argument("--san-async-slices", action="store_true",
                   help="a loop's slices on their own stream (docs/design.md, \"Sanitizers\")")
    g.add_argument("--sanall-tools", type=_names(sanitizer.SANALL_TOOLS),
                   default=list(sanitizer.SANALL_TOOLS), help="sanall's tools")
    g.add_argument("--sanall-n", type=int, default=4, help="processes per tool")
    g.add_argument("--sanall-shards", type=_ints, default=None,
                   help="the process numbers this run starts; all without it")
    g.add_argument("--sanall-done", default="", metavar="FOLDER",
                   help="<tool>.txt lists of tests checked before (skipped) and "
                        "<tool>_times.tsv, their seconds (longest run first); see carry")
    g.add_argument("--sanall-s", type=float, default=480, help="sanall's seconds")
    g.add_argument("--sanall-kernels", default="",
                   help="check only the kernels matching this regex (not initcheck's)")
    g.add_argument("--sanall-api-check", choices=("yes", "no"), default="no",
                   help="initcheck's --check-api-memory-access")
    g.add_argument("--sanall-opts", default="", help="more compute-sanitizer options")
    g.add_argument("--sanall-files", default="", help="test files instead of the whole suite")
    g.add_argument("--sanall-k", default="", help="a -k expression")
    g.add_argument("--sanruns", nargs="+", default=[], metavar="TSV",
                   help="files of sanitizer runs (tools/san_runs/*.tsv)")


def carry_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 tools/gpu_check.py carry",
                                description=sanitizer.carry.__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a sanall run's results.tgz")
    p.add_argument("folder", type=Path, nargs="?", default=Path(".san_done"))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["carry"]:
        a = carry_parser().parse_args(argv[1:])
        print("\n".join(sanitizer.carry(a.results, a.folder)))
        return 0
    return check(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
