"""The documentation describes the repository as it is: every file that README,
CHANGELOG and docs/ cite exists, docs/ stays small, and no file speaks of the
machinery that once ran the measurements instead of the library."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

DOCS_MAX_BYTES = 400_000
DOC_FILE_MAX_BYTES = 60_000

# Directories that hold build outputs, caches or tool outputs, never sources.
_SKIP_DIRS = {".git", "build", "_skbuild", "dist", "__pycache__", ".venv", "venv",
              ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache", "node_modules",
              "bench_out", "train_out"}

# Names of files the tools write into their output folders (cited as outputs).
_OUTPUT_NAMES = {"bench.json", "bench.md", "bench.png", "gemm.json", "gemm.md"}

_EXT = r"(?:py|md|cu|cuh|h|cc|json|png|sh|tsv|txt|toml)"
# A file name or path, possibly with glob parts (`*`, `{a,b}`, `<a|b>`).
_CITED = re.compile(r"(?<![\w/.$-])((?:[\w.*{}<>|,-]+/)*[\w*{}<>|,-]+\." + _EXT + r")(?![\w/])")

# The words the project keeps out of itself, spelled so that this file holds
# none of them.
_SESS = "sess" + "ion"
_WORDS = re.compile(r"\b(" + _SESS + r"s?|device[ -]calls?|device[ ]tool|KINDS\.md|METHOD\.md|"
                    r"HOPPER\.md|H200\.md)\b", re.IGNORECASE)
# pytest's object of that name (hook arguments, attribute access) is code, not prose.
_PYTEST_SESSION = re.compile(r"\b" + _SESS + r"(?=\.\w|\)|: pytest\.)|\bpytest\." +
                             _SESS.capitalize() + r"\b")


def _tree_files() -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames
                       if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
        for name in filenames:
            out.append(Path(dirpath, name).relative_to(ROOT).as_posix())
    return out


def _project_files() -> list[str]:
    """The files of the project: git's tracked and not-ignored files when this
    is a git checkout, else the tree without build outputs."""
    try:
        res = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        res = None
    if res is not None and res.returncode == 0 and res.stdout.strip():
        return [f for f in res.stdout.splitlines() if (ROOT / f).is_file()]
    return _tree_files()


def _doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.is_file()]


def _glob_regex(token: str) -> re.Pattern:
    out, i = "", 0
    while i < len(token):
        c = token[i]
        if c == "*":
            out += r"[^/]*"
        elif c in "{<":
            j = token.index("}" if c == "{" else ">", i)
            out += "(?:" + "|".join(re.escape(a) for a in re.split(r"[,|]", token[i + 1:j])) + ")"
            i = j
        else:
            out += re.escape(c)
        i += 1
    return re.compile(r"(?:^|.*/)" + out + "$")


def _cited_exists(token: str, doc: Path, files: list[str]) -> bool:
    """A path from the root or the citing file, a path's tail (`ops/folds.py`,
    `fast/decode_rows.cu`), or a bare file name found anywhere in the tree."""
    if token in _OUTPUT_NAMES:
        return True
    if any(c in token for c in "*{<"):
        rx = _glob_regex(token)
        return any(rx.match(f) for f in files)
    if (ROOT / token).is_file() or (doc.parent / token).is_file():
        return True
    return any(f == token or f.endswith("/" + token) for f in files)


def test_docs_cite_only_files_the_repository_has():
    files = _tree_files()
    missing = []
    for doc in _doc_files():
        text = doc.read_text(encoding="utf-8")
        for m in _CITED.finditer(text):
            if not _cited_exists(m.group(1), doc, files):
                line = text.count("\n", 0, m.start()) + 1
                missing.append(f"{doc.relative_to(ROOT)}:{line}: {m.group(1)}")
    assert not missing, "cited files that do not exist:\n" + "\n".join(missing)


def test_the_citation_check_finds_a_missing_file(tmp_path):
    doc = tmp_path / "x.md"
    files = ["docs/design.md", "jax_moelora/ops/folds.py", "ffi_src/fast/decode_rows.cu"]
    assert _cited_exists("docs/design.md", doc, files)
    assert _cited_exists("ops/folds.py", doc, files)
    assert _cited_exists("decode_rows.cu", doc, files)
    assert _cited_exists("ffi_src/fast/decode_{rows,cells}.cu", doc, files)
    assert not _cited_exists("docs/perf_log.md", doc, files)
    assert not _cited_exists("moe_lora_fast.cu", doc, files)
    assert [m.group(1) for m in _CITED.finditer("see `docs/a.md` and b.py, not x.y")] == [
        "docs/a.md", "b.py"]


def test_docs_stay_small():
    sizes = {p.relative_to(ROOT).as_posix(): p.stat().st_size
             for p in (ROOT / "docs").rglob("*") if p.is_file()}
    big = {p: n for p, n in sizes.items() if n > DOC_FILE_MAX_BYTES}
    assert not big, f"docs/ files over {DOC_FILE_MAX_BYTES} bytes: {big}"
    assert sum(sizes.values()) < DOCS_MAX_BYTES, f"docs/ holds {sum(sizes.values())} bytes"


def test_no_file_speaks_of_how_measurements_were_run():
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()
    hits = []
    for rel in _project_files():
        if rel == this or rel.startswith("tests/fixtures/"):
            continue
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            probe = _PYTEST_SESSION.sub("", line) if rel.endswith(".py") else line
            if _WORDS.search(probe):
                hits.append(f"{rel}:{n}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("line, found", [
    (f"def pytest_runtestloop({_SESS}):", False),
    (f"def pytest_runtestloop({_SESS}: pytest.{_SESS.capitalize()}) -> bool | None:", False),
    (f"    raise {_SESS}.Interrupted({_SESS}.shouldstop)", False),
    (f"# measured in the third {_SESS}", True),
    ("see KINDS.md", True),
    ("four consecutive device " + "calls", True),
])
def test_the_word_check(line, found):
    assert bool(_WORDS.search(_PYTEST_SESSION.sub("", line))) == found
