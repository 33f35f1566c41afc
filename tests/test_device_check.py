"""``scripts/san_shard.sh``: the sanitizer runner of ``scripts/device_check.sh``
resumes after the tool crashes, without the test it crashed in (run here with
a stand-in ``compute-sanitizer``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEEDS_BASH = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")

# Stands in for `compute-sanitizer ... python3 -m pytest ...`: three tests, of
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


def _run_san_shard(tmp_path, tool_text: str, tool: str, done: str | None = None,
                   **env_vars: str):
    """``san_shard`` under the stand-in ``compute-sanitizer`` ``tool_text``
    (``done``: the SAN_DONE list of earlier calls; ``env_vars``: more
    environment); returns the run's stdout, the log's lines and the tool's
    command lines, one per run."""
    exe = tmp_path / "bin" / "compute-sanitizer"
    exe.parent.mkdir()
    exe.write_text(tool_text)
    exe.chmod(0o755)
    log, calls = tmp_path / "san.log", tmp_path / "calls"
    env = dict(os.environ, PATH=f"{exe.parent}:{os.environ['PATH']}", CALLS=str(calls), **env_vars)
    if done is not None:
        (tmp_path / "done.txt").write_text(done)
        env["SAN_DONE"] = str(tmp_path / "done.txt")
    script = (f"ulimit -c 0; source {ROOT / 'scripts' / 'san_shard.sh'}; "
              f"san_shard {log} 60 --tool {tool} -- tests/test_fake.py; "
              f"echo errors=$(san_errors {log})")
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout, log.read_text().splitlines(), calls.read_text().splitlines()


@NEEDS_BASH
def test_san_shard_skips_the_test_the_tool_crashed_in(tmp_path):
    stdout, lines, calls = _run_san_shard(tmp_path, FAKE_TOOL, "memcheck")
    assert "CRASHED tests/test_fake.py::test_b" in lines      # on a line of its own
    assert sum("test_a PASSED" in ln for ln in lines) == 1     # not run again
    assert sum("test_c PASSED" in ln for ln in lines) == 1     # run after the crash
    assert len(calls) == 2
    assert "--deselect tests/test_fake.py::test_a" in calls[1]
    assert "--deselect tests/test_fake.py::test_b" in calls[1]
    assert "errors=0" in stdout


@NEEDS_BASH
def test_san_shard_deselects_the_tests_an_earlier_call_checked(tmp_path):
    """SAN_DONE lists tests an earlier run checked under the tool: they
    are deselected from the first run on (test_b, which crashes the stand-in,
    among them: the run goes through)."""
    done = "tests/test_fake.py::test_a\ntests/test_fake.py::test_b\n"
    _, lines, calls = _run_san_shard(tmp_path, FAKE_TOOL, "memcheck", done=done)
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
def test_san_shard_resumes_after_an_internal_tool_error(tmp_path):
    """An internal error of the tool breaks the process: its test is logged as
    CRASHED, and the tests that failed after it run again without it."""
    _, lines, calls = _run_san_shard(tmp_path, FAKE_TOOL_INTERNAL_ERROR, "racecheck")
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
ASYNC_SLICES_OFF = "--xla_disable_hlo_passes=dynamic-slice-copy-fusion-async-wrapper"


@NEEDS_BASH
@pytest.mark.parametrize("async_slices", [None, "1"])
def test_san_shard_xla_flags(tmp_path, async_slices):
    """Under every tool, XLA runs without command buffers or autotuning, in
    one compilation module, and with a loop's slices on the main stream, unless
    SAN_ASYNC_SLICES=1; SAN_XLA_FLAGS comes last."""
    env = {"SAN_XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    if async_slices:
        env["SAN_ASYNC_SLICES"] = async_slices
    _, _, (flags,) = _run_san_shard(tmp_path, FAKE_TOOL_FLAGS, "initcheck", **env)
    words = flags.split()
    assert {"--xla_gpu_enable_command_buffer=", "--xla_gpu_autotune_level=0",
            "--xla_gpu_force_compilation_parallelism=1"} <= set(words)
    assert (ASYNC_SLICES_OFF in words) == (async_slices is None)
    assert words[-1] == "--xla_dump_to=/tmp/x"



# The work queue of the sanitizer runs (tests/conftest.py: --claim, --order,
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
               PYTHONPATH=f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
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


def test_claimed_queue_order_and_restart(tmp_path):
    """--order runs the longest test first, tests missing from the timings
    before it (a header line of the timings skipped); a test claimed by another process is not run, one claimed by
    this process (before a restart) is."""
    from conftest import claim, read_timings

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


@NEEDS_BASH
def test_san_carry_folds_a_call_into_the_carried_lists(tmp_path):
    """scripts/san_carry.sh: a call's done lists replace the carried ones (they
    already include them), its seconds are appended."""
    import tarfile

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
    out = subprocess.run(["bash", str(ROOT / "scripts" / "san_carry.sh"),
                          str(tmp_path / "results.tgz"), str(carried)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "memcheck: 2 tests done"
    assert (carried / "memcheck.txt").read_text().split() == ["tests/a.py::x", "tests/a.py::y"]
    assert (carried / "memcheck_times.tsv").read_text().splitlines() == [
        "2.0\tpassed\ttests/a.py::x", "1.5\tpassed\ttests/a.py::y"]


# Stands in for compute-sanitizer in device_check.sh's sanruns step: logs its
# options and the allocator setting, passes every test id it is given.
RUNS_TOOL = r"""#!/usr/bin/env bash
echo "options: ${*%% python3 *} allocator=${XLA_PYTHON_CLIENT_ALLOCATOR:-default}"
for a in "$@"; do case "$a" in tests/*) echo "$a PASSED [ 50%]";; esac; done
echo "========= ERROR SUMMARY: 0 errors"
"""


@NEEDS_BASH
def test_sanruns_runs_each_line_in_its_own_process(tmp_path):
    """STEPS=sanruns: every line of the SANRUNS files runs under the tool with
    its own environment, options and test ids (brackets kept), one log each,
    and a summary line of each in phases.log."""
    exe = tmp_path / "bin" / "compute-sanitizer"
    exe.parent.mkdir()
    exe.write_text(RUNS_TOOL)
    exe.chmod(0o755)
    runs = tmp_path / "runs.tsv"
    runs.write_text("# a comment\n"
                    "one\tXLA_PYTHON_CLIENT_ALLOCATOR=platform\t60\t--tool initcheck\t"
                    "tests/test_a.py::test_x[bf16-r8] tests/test_a.py::test_y\n"
                    "two\t-\t60\t--tool racecheck --launch-count 5\ttests/test_b.py::test_z[*]\n")
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{exe.parent}:{os.environ['PATH']}", OUT=str(out),
               STEPS="sanruns", SANRUNS=str(runs), BUDGET="100")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr
    subprocess.run(["tar", "xzf", str(out / "results.tgz"), "-C", str(out)], check=True)
    one = (out / "r" / "sanrun_one.log").read_text()
    two = (out / "r" / "sanrun_two.log").read_text()
    assert "--tool initcheck" in one and "allocator=platform" in one
    assert "tests/test_a.py::test_x[bf16-r8] PASSED" in one and "test_a.py::test_y PASSED" in one
    assert "--tool racecheck --launch-count 5" in two and "allocator=default" in two
    assert "tests/test_b.py::test_z[*] PASSED" in two
    summary = {ln.split()[1]: ln for ln in (out / "r" / "phases.log").read_text().splitlines()
               if ln.split()[1:2] and ln.split()[1].startswith("sanrun_")}
    assert sorted(summary) == ["sanrun_one:", "sanrun_two:"]
    assert all("ERROR SUMMARY: 0 errors" in ln and "error records: 0" in ln
               for ln in summary.values())
