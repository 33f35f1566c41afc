"""The GPU check harness (``tools/gpu_check.py``), run here without a GPU: its
sanitizer runner with a stand-in ``compute-sanitizer`` (resuming after the
tool crashes, without the test it crashed in), the test queue plugin
(``tools/san_queue.py``), the results archive written when a step or the
budget runs out, and the commands its steps run (``--dry-run``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
sys.path.insert(0, str(TOOLS))

import gpu_check  # noqa: E402  (tools/, not installed)
import sanitizer  # noqa: E402
from harness import TIMED_OUT, Harness  # noqa: E402
from san_queue import claim, read_timings  # noqa: E402

NEEDS_BASH = pytest.mark.skipif(sys.platform == "win32", reason="stand-in tools are bash scripts")

# Stands in for `compute-sanitizer ... python -m pytest ...`: three tests, of
# which test_b kills the process with SIGSEGV after its id is printed (as the
# tool did on the GPU), unless it is deselected.
FAKE_TOOL = r"""#!/usr/bin/env bash
echo "$*" >> "$CALLS"
args=" $* "
for t in a b c; do
  id="tests/test_fake.py::test_$t"
  case "$args" in *" --deselect $id "*) continue;; esac
  if [ "$t" = b ]; then printf '%s ' "$id"; kill -SEGV $$; fi
  echo "$id PASSED [ 50%]"
done
echo "========= ERROR SUMMARY: 0 errors"
"""


def _stand_in(tmp_path: Path, name: str, text: str, monkeypatch=None) -> Path:
    """An executable ``name`` of ``text`` in ``tmp_path/bin``, first on PATH
    (with ``monkeypatch``); returns the folder."""
    exe = tmp_path / "bin" / name
    exe.parent.mkdir(exist_ok=True)
    exe.write_text(text)
    exe.chmod(0o755)
    if monkeypatch is not None:
        monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
    return exe.parent


def _run_san_shard(tmp_path, monkeypatch, tool_text: str, tool: str, done: str | None = None,
                   **settings):
    """``san_shard`` under the stand-in ``compute-sanitizer`` ``tool_text``
    (``done``: the list of tests checked before; ``settings``: the run's
    ``xla_flags``, ``async_slices``); returns the log's lines and the tool's
    command lines, one per run."""
    _stand_in(tmp_path, "compute-sanitizer", tool_text, monkeypatch)
    calls = tmp_path / "calls"
    monkeypatch.setenv("CALLS", str(calls))
    done_file = None
    if done is not None:
        done_file = tmp_path / "done.txt"
        done_file.write_text(done)
    h = Harness(tmp_path / "out", 120)
    log = tmp_path / "san.log"
    sanitizer.san_shard(h, sanitizer.SanRun(log, 60, ["--tool", tool], ["tests/test_fake.py"],
                                            done=done_file, **settings))
    return log.read_text().splitlines(), calls.read_text().splitlines()


@NEEDS_BASH
def test_san_shard_skips_the_test_the_tool_crashed_in(tmp_path, monkeypatch):
    lines, calls = _run_san_shard(tmp_path, monkeypatch, FAKE_TOOL, "memcheck")
    assert "CRASHED tests/test_fake.py::test_b" in lines      # on a line of its own
    assert sum("test_a PASSED" in ln for ln in lines) == 1     # not run again
    assert sum("test_c PASSED" in ln for ln in lines) == 1     # run after the crash
    assert len(calls) == 2
    assert "--deselect tests/test_fake.py::test_a" in calls[1]
    assert "--deselect tests/test_fake.py::test_b" in calls[1]
    assert "-p san_queue -m gpu tests/test_fake.py" in calls[0]
    assert sanitizer.san_errors("\n".join(lines)) == 0


@NEEDS_BASH
def test_san_shard_deselects_the_tests_checked_before(tmp_path, monkeypatch):
    """The run's ``done`` file lists tests checked under the tool by earlier
    runs: they are deselected from the first run on (test_b, which crashes the
    stand-in, among them: the run goes through)."""
    done = "tests/test_fake.py::test_a\ntests/test_fake.py::test_b\n"
    lines, calls = _run_san_shard(tmp_path, monkeypatch, FAKE_TOOL, "memcheck", done=done)
    assert [ln.split()[0] for ln in lines if "PASSED" in ln] == ["tests/test_fake.py::test_c"]
    assert not any(ln.startswith("CRASHED") for ln in lines)
    (first,) = calls
    assert "--deselect tests/test_fake.py::test_a" in first
    assert "--deselect tests/test_fake.py::test_b" in first


# Stands in for a tool that reports an internal error during test_b (as
# racecheck 2025.3 did in CUTLASS's GEMM on the GPU): the process goes on, and
# every later test fails, until test_b is deselected.
FAKE_TOOL_INTERNAL_ERROR = r"""#!/usr/bin/env bash
echo "$*" >> "$CALLS"
args=" $* "
broken=0
for t in a b c; do
  id="tests/test_fake.py::test_$t"
  case "$args" in *" --deselect $id "*) continue;; esac
  if [ "$t" = b ]; then
    echo "$id ========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware" \
      "exception."
    echo "FAILED [ 50%]"; broken=1; continue
  fi
  if [ $broken = 1 ]; then echo "$id FAILED [ 90%]"; else echo "$id PASSED [ 50%]"; fi
done
exit $broken
"""


@NEEDS_BASH
def test_san_shard_resumes_after_an_internal_tool_error(tmp_path, monkeypatch):
    """An internal error of the tool breaks the process: its test is logged as
    CRASHED, and the tests that failed after it run again without it."""
    lines, calls = _run_san_shard(tmp_path, monkeypatch, FAKE_TOOL_INTERNAL_ERROR, "racecheck")
    assert "CRASHED tests/test_fake.py::test_b" in lines
    assert [ln.split()[0] for ln in lines if "PASSED" in ln] == [
        "tests/test_fake.py::test_a", "tests/test_fake.py::test_c"]
    first, second = calls
    assert "--deselect" not in first
    assert "--deselect tests/test_fake.py::test_a" in second
    assert "--deselect tests/test_fake.py::test_b" in second
    assert "--deselect tests/test_fake.py::test_c" not in second


# Stands in for a tool that logs the XLA flags its process gets.
FAKE_TOOL_FLAGS = r"""#!/usr/bin/env bash
echo "$XLA_FLAGS" >> "$CALLS"
echo "tests/test_fake.py::test_a PASSED [100%]"
"""


@NEEDS_BASH
@pytest.mark.parametrize("async_slices", [False, True])
def test_san_shard_xla_flags(tmp_path, monkeypatch, async_slices):
    """Under every tool, XLA runs without command buffers or autotuning, in
    one compilation module, and with a loop's slices on the main stream, unless
    ``async_slices``; the run's own XLA flags come last."""
    _, (flags,) = _run_san_shard(tmp_path, monkeypatch, FAKE_TOOL_FLAGS, "initcheck",
                                 xla_flags="--xla_dump_to=/tmp/x", async_slices=async_slices)
    words = flags.split()
    assert {"--xla_gpu_enable_command_buffer=", "--xla_gpu_autotune_level=0",
            "--xla_gpu_force_compilation_parallelism=1"} <= set(words)
    assert (sanitizer.SLICES_ON_MAIN_STREAM in words) == (not async_slices)
    assert words[-1] == "--xla_dump_to=/tmp/x"


def test_a_command_is_cut_at_its_timeout_with_what_it_started(tmp_path):
    """A command over its time is killed with its process group: status 124."""
    h = Harness(tmp_path / "out", 60)
    pid_file = tmp_path / "pid"
    t0 = time.monotonic()
    rc = h.run(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], tmp_path / "log", 1)
    assert rc == TIMED_OUT and time.monotonic() - t0 < 20
    assert not _alive(int(pid_file.read_text()))               # the background sleep too


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not reaped, does not)."""
    for _ in range(50):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        except OSError:                                        # no /proc: ask the kernel
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            state = "R"
        if state == "Z":
            return False
        time.sleep(0.1)
    return True


# The work queue of the sanitizer runs (tools/san_queue.py: --claim, --order,
# --timings), on a file of quick tests that log which process ran them.
QUEUE_TESTS = r"""
import os, time
import pytest

@pytest.mark.parametrize("k", range(8))
def test_q(k):
    time.sleep(0.02 * (k % 3))
    with open(os.environ["RAN"], "a") as f:
        f.write(f"{os.environ['WHO']} test_q[{k}]\n")
    assert os.environ.get("FAIL") != str(k), "planted failure"
"""


def _queue_run(tmp_path, who: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, RAN=str(tmp_path / "ran"), WHO=who, **(env or {}),
               PYTHONPATH=f"{TOOLS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "san_queue",
         "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_queue.py"), *args],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _ran(tmp_path) -> list[tuple[str, str]]:
    return [tuple(ln.split()) for ln in (tmp_path / "ran").read_text().splitlines()]


def test_claimed_queue_runs_every_test_once(tmp_path):
    """Processes sharing a --claim folder run each test exactly once between
    them, and --timings logs every test; alone, process I of N starts at the
    I-th of N slices."""
    (tmp_path / "test_queue.py").write_text(QUEUE_TESTS)
    claims, times = tmp_path / "claims", tmp_path / "times.tsv"
    procs = [_queue_run(tmp_path, str(i), "--shard", f"{i}/3", "--claim", str(claims),
                        "--timings", str(times)) for i in range(3)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode in (0, 5), out                  # 5: every test claimed elsewhere
    ran = _ran(tmp_path)
    assert sorted(t for _, t in ran) == sorted(f"test_q[{k}]" for k in range(8))
    rows = [ln.split("\t") for ln in times.read_text().splitlines()]
    assert sorted(r[2] for r in rows) == sorted(f"test_queue.py::test_q[{k}]" for k in range(8))
    assert {r[1] for r in rows} == {"passed"} and all(float(r[0]) >= 0 for r in rows)
    assert all(len(r) == 3 for r in rows)
    (tmp_path / "ran").unlink()
    p = _queue_run(tmp_path, "2", "--shard", "2/3", "--claim", str(tmp_path / "fresh"))
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert [int(t[7]) for _, t in _ran(tmp_path)] == [5, 6, 7, 0, 1, 2, 3, 4]   # from 8 * 2 // 3


def test_shard_alone_keeps_every_nth_selected_test(tmp_path):
    (tmp_path / "test_queue.py").write_text(QUEUE_TESTS)
    p = _queue_run(tmp_path, "1", "--shard", "1/3", "-k", "not test_q[0]")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert [t for _, t in _ran(tmp_path)] == ["test_q[2]", "test_q[5]"]   # of 1..7: 2nd, 5th


def test_claimed_queue_order_and_restart(tmp_path):
    """--order runs the longest test first, tests missing from the timings
    before it (a header line of the timings skipped); a test claimed by another
    process is not run, one claimed by this process (before a restart) is."""
    (tmp_path / "test_queue.py").write_text(QUEUE_TESTS)
    ids = [f"test_queue.py::test_q[{k}]" for k in range(8)]
    order = tmp_path / "order.tsv"
    order.write_text("seconds\toutcome\ttest\n"
                     + "".join(f"{1 + k}\tpassed\t{ids[k]}\n" for k in range(1, 8) if k != 3)
                     + f"0.5\tpassed\t{ids[1]}\n")
    assert read_timings(order)[ids[1]] == 2.0
    claims = tmp_path / "claims"
    claims.mkdir()
    assert claim(claims, ids[7], "1/2") and claim(claims, ids[6], "0/2")
    assert not claim(claims, ids[7], "0/2") and claim(claims, ids[7], "1/2")
    p = _queue_run(tmp_path, "0", "--shard", "0/2", "--claim", str(claims), "--order", str(order))
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert [t for _, t in _ran(tmp_path)] == [
        "test_q[0]", "test_q[3]", "test_q[6]", "test_q[5]", "test_q[4]", "test_q[2]", "test_q[1]"]


def test_timings_give_a_failure_its_message(tmp_path):
    (tmp_path / "test_queue.py").write_text(QUEUE_TESTS)
    times = tmp_path / "times.tsv"
    p = _queue_run(tmp_path, "0", "--timings", str(times), "-k", "test_q[3] or test_q[4]",
                   env={"FAIL": "3"})
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 1, out
    rows = {r[2]: r for r in (ln.split("\t") for ln in times.read_text().splitlines())}
    failed, passed = rows["test_queue.py::test_q[3]"], rows["test_queue.py::test_q[4]"]
    assert failed[1] == "failed" and "planted failure" in failed[3]
    assert passed[1] == "passed" and len(passed) == 3


def _cli(*args: str, env: dict | None = None, timeout: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / "gpu_check.py"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _results(out: Path) -> Path:
    """The unpacked ``r/`` of ``out/results.tgz`` (the harness removed ``out/r``)."""
    assert not (out / "r").exists()
    with tarfile.open(out / "results.tgz") as tar:
        tar.extractall(out / "unpacked", filter="data")
    return out / "unpacked" / "r"


def test_carry_folds_a_run_into_the_carried_lists(tmp_path):
    """``gpu_check.py carry``: a run's done lists replace the carried ones (they
    already include them), its seconds are appended."""
    r = tmp_path / "r"
    r.mkdir()
    (r / "sanall_done_memcheck.txt").write_text("tests/a.py::x\ntests/a.py::y\n")
    (r / "sanall_times_memcheck.tsv").write_text("1.5\tpassed\ttests/a.py::y\n")
    with tarfile.open(tmp_path / "results.tgz", "w:gz") as tar:
        tar.add(r, arcname="r")
    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / "memcheck.txt").write_text("tests/a.py::x\n")
    (carried / "memcheck_times.tsv").write_text("2.0\tpassed\ttests/a.py::x\n")
    out = _cli("carry", str(tmp_path / "results.tgz"), str(carried), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "memcheck: 2 tests done"
    assert (carried / "memcheck.txt").read_text().split() == ["tests/a.py::x", "tests/a.py::y"]
    assert (carried / "memcheck_times.tsv").read_text().splitlines() == [
        "2.0\tpassed\ttests/a.py::x", "1.5\tpassed\ttests/a.py::y"]


def test_sanall_writes_the_lists_of_tests_done(tmp_path):
    """The tests a run did not fail join those checked before."""
    (tmp_path / "memcheck.txt").write_text("tests/a.py::old\n")
    (tmp_path / "sanall_times_memcheck.tsv").write_text(
        "1.0\tpassed\ttests/a.py::x\n2.0\tfailed\ttests/a.py::y\tboom\n3.0\tskipped\ttests/a.py::z\n")
    done = sanitizer.write_done(tmp_path, "memcheck", tmp_path)
    assert done.read_text().split() == ["tests/a.py::old", "tests/a.py::x", "tests/a.py::z"]


# Stands in for compute-sanitizer in the sanruns step: logs its options and
# the allocator setting, passes every test id it is given.
RUNS_TOOL = r"""#!/usr/bin/env bash
echo "options: ${*%% -m pytest *} allocator=${XLA_PYTHON_CLIENT_ALLOCATOR:-default}"
echo "xla: $XLA_FLAGS"
for a in "$@"; do case "$a" in tests/*) echo "$a PASSED [ 50%]";; esac; done
echo "========= ERROR SUMMARY: 0 errors"
"""


@NEEDS_BASH
def test_sanruns_runs_each_line_in_its_own_process(tmp_path):
    """``--steps sanruns``: every line of the ``--sanruns`` files runs under the
    tool with its own environment, options and test ids (brackets kept), one
    log each, and a summary line of each in phases.log."""
    bin_dir = _stand_in(tmp_path, "compute-sanitizer", RUNS_TOOL)
    runs = tmp_path / "runs.tsv"
    runs.write_text("# a comment\n"
                    "one\tXLA_PYTHON_CLIENT_ALLOCATOR=platform SAN_ASYNC_SLICES=1\t60\t"
                    "--tool initcheck\ttests/test_a.py::test_x[bf16-r8] tests/test_a.py::test_y\n"
                    "two\t-\t60\t--tool racecheck --launch-count 5\ttests/test_b.py::test_z[*]\n")
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    done = _cli("--out", str(out), "--steps", "sanruns", "--sanruns", str(runs),
                "--budget", "100", env=env)
    assert done.returncode == 0, done.stderr
    r = _results(out)
    one, two = (r / "sanrun_one.log").read_text(), (r / "sanrun_two.log").read_text()
    assert "--tool initcheck" in one and "allocator=platform" in one
    assert "--show-backtrace device" in one and "--print-limit 20" in one
    assert "tests/test_a.py::test_x[bf16-r8] PASSED" in one and "test_a.py::test_y PASSED" in one
    assert sanitizer.SLICES_ON_MAIN_STREAM not in one            # SAN_ASYNC_SLICES=1
    assert "--tool racecheck --launch-count 5" in two and "allocator=default" in two
    assert "tests/test_b.py::test_z[*] PASSED" in two
    assert sanitizer.SLICES_ON_MAIN_STREAM in two
    phases = (r / "phases.log").read_text().splitlines()
    summary = {ln.split()[1]: ln for ln in phases
               if ln.split()[1:2] and ln.split()[1].startswith("sanrun_")}
    assert sorted(summary) == ["sanrun_one:", "sanrun_two:"]
    assert all("ERROR SUMMARY: 0 errors" in ln and "error records: 0" in ln
               for ln in summary.values())
    assert phases[-1] == "steps rc=0"


# Stands in for a tool whose tests take a minute.
SLOW_TOOL = r"""#!/usr/bin/env bash
case "$1" in --version|--help) echo "compute-sanitizer 2025.3"; exit 0;; esac
echo started
exec sleep 60
"""


@NEEDS_BASH
def test_results_are_written_when_the_budget_runs_out(tmp_path):
    """A run cut by the budget still leaves its logs in results.tgz, with
    ``steps rc=124``."""
    bin_dir = _stand_in(tmp_path, "compute-sanitizer", SLOW_TOOL)
    runs = tmp_path / "runs.tsv"
    runs.write_text("slow\t-\t60\t--tool memcheck\ttests/test_a.py::test_x\n")
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    t0 = time.monotonic()
    done = _cli("--out", str(out), "--steps", "sanruns,memcheck", "--sanruns", str(runs),
                "--budget", "3", env=env)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t0 < 60
    r = _results(out)
    assert "started" in (r / "sanrun_slow.log").read_text()
    phases = (r / "phases.log").read_text()
    assert "budget spent: memcheck" in phases
    assert phases.splitlines()[-1] == "steps rc=124"


@NEEDS_BASH
def test_results_are_written_when_the_harness_is_stopped(tmp_path):
    """SIGTERM to the harness: its commands are killed, the archive written."""
    bin_dir = _stand_in(tmp_path, "compute-sanitizer", SLOW_TOOL)
    runs = tmp_path / "runs.tsv"
    runs.write_text("slow\t-\t60\t--tool memcheck\ttests/test_a.py::test_x\n")
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.Popen([sys.executable, str(TOOLS / "gpu_check.py"), "--out", str(out),
                             "--steps", "sanruns", "--sanruns", str(runs)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = out / "r" / "sanrun_slow.log"
    deadline = time.monotonic() + 60
    while not (log.is_file() and "started" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, stdout
    phases = (_results(out) / "phases.log").read_text().splitlines()
    assert any("stopped by signal 15" in ln for ln in phases)
    assert phases[-1] == "steps rc=143"


def _dry_run(tmp_path, *args: str) -> list[str]:
    out = tmp_path / "out"
    done = _cli("--out", str(out), "--dry-run", *args, timeout=60)
    assert done.returncode == 0, done.stderr
    return (_results(out) / "phases.log").read_text().splitlines()


def test_dry_run_lists_the_commands_of_the_steps_in_order(tmp_path):
    """``--steps build,suite,train,peer --tests=...``: the build, then the steps
    in their fixed order, each with its arguments."""
    lines = _dry_run(tmp_path, "--steps", "peer,suite,train,build",
                     "--tests=tests/test_folds.py -k fast", "--train=--quick --models qwen")
    commands = [ln for ln in lines if ln.startswith("$ ")]
    assert [ln.split("] ")[1] for ln in lines if ln.startswith("[") and " rc=" in ln] == [
        "build rc=0", "train rc=0", "peer rc=0", "suite rc=0"]
    assert any("pip install --no-build-isolation --no-deps -v ." in c for c in commands)
    assert any(c.endswith("-n 8 -rf tests/test_folds.py -k fast > " + str(
        tmp_path / "out" / "r" / "suite.log")) for c in commands)
    assert any("jax_moelora bench --train --quick --models qwen --out" in c for c in commands)
    assert any("scripts/peft_train_peer.py --models qwen --tokens 512,4096 --rank 16 --json"
               in c for c in commands)


def test_dry_run_of_sanall_spreads_the_processes_over_one_queue(tmp_path):
    lines = _dry_run(tmp_path, "--steps", "sanall", "--sanall-tools", "memcheck,initcheck",
                     "--sanall-n", "2", "--sanall-kernels", "moelora")
    runs = [ln for ln in lines if ln.startswith("$ ") and "-m pytest" in ln]
    assert len(runs) == 4
    memcheck = [ln for ln in runs if "--tool memcheck" in ln]
    initcheck = [ln for ln in runs if "--tool initcheck" in ln]
    assert all("--kernel-name regex=moelora" in ln for ln in memcheck)
    assert all("--kernel-name" not in ln and "--check-api-memory-access no" in ln
               and "XLA_PYTHON_CLIENT_ALLOCATOR=platform" in ln for ln in initcheck)
    # the processes start at once, so their lines come in any order
    assert sorted(re.search(r"--shard=(\d)/2 --claim=/tmp/moelora_claims/memcheck", ln)[1]
                  for ln in memcheck) == ["0", "1"]
    assert all("-p san_queue -m gpu" in ln for ln in runs)


def test_unknown_step_is_refused(tmp_path):
    done = _cli("--out", str(tmp_path), "--steps", "build,bogus", timeout=60)
    assert done.returncode == 2 and "bogus" in done.stderr


def test_readme_command_skips_the_download_step():
    cmd = gpu_check.readme_command(ROOT / "README.md")
    assert cmd is not None and cmd.startswith("python3 -m pip install --no-build-isolation")
    assert "jax_moelora demo" in cmd


def test_a_step_that_fails_leaves_the_next_steps_running(tmp_path):
    runs = tmp_path / "runs.tsv"
    runs.write_text("bad\t-\tsoon\t--tool memcheck\ttests/test_a.py::test_x\n")
    lines = _dry_run(tmp_path, "--steps", "sanruns,memcheck", "--sanruns", str(runs))
    assert any("sanruns failed: ValueError" in ln for ln in lines)
    assert any(ln.endswith("] memcheck done") for ln in lines)
    assert lines[-1] == "steps rc=0"


def test_the_suite_cuts_a_test_at_its_timeout_where_pytest_timeout_is_installed(monkeypatch):
    """A kernel that hangs fails its own test (pytest-timeout's thread method
    ends the process that hangs); without the plugin, or with 0, no arguments."""
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: object())
    assert gpu_check.per_test_timeout(240) == ["--timeout=240", "--timeout-method=thread"]
    assert gpu_check.per_test_timeout(0) == []
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None)
    assert gpu_check.per_test_timeout(240) == []
