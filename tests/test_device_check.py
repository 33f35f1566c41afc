"""``scripts/san_shard.sh``: the sanitizer runner of ``scripts/device_check.sh``
resumes after the tool crashes, without the test it crashed in (run here with
a stand-in ``compute-sanitizer``)."""

from __future__ import annotations

import os
import shutil
import subprocess
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


def _run_san_shard(tmp_path, tool_text: str, tool: str, done: str | None = None):
    """``san_shard`` under the stand-in ``compute-sanitizer`` ``tool_text``
    (``done``: the SAN_DONE list of earlier calls); returns the run's stdout,
    the log's lines and the tool's command lines, one per run."""
    exe = tmp_path / "bin" / "compute-sanitizer"
    exe.parent.mkdir()
    exe.write_text(tool_text)
    exe.chmod(0o755)
    log, calls = tmp_path / "san.log", tmp_path / "calls"
    env = dict(os.environ, PATH=f"{exe.parent}:{os.environ['PATH']}", CALLS=str(calls))
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
    """SAN_DONE lists tests an earlier device call ran under the tool: they
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
