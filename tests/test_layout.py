"""The library's import graph is the library: nothing in ``jax_moelora`` outside
``jax_moelora/tools/`` (and the command line, ``__main__``) imports the tools."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jax_moelora"
TOOLS = "jax_moelora.tools"
# The command line imports the commands of jax_moelora.tools on purpose.
NOT_LIBRARY = {"jax_moelora.__main__"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_modules() -> dict[str, Path]:
    """Every module of the library: the package's files outside ``tools/``."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        if not name.startswith(TOOLS) and name not in NOT_LIBRARY:
            modules[name] = path
    return modules


def imported_names(path: Path, module: str) -> set[str]:
    """The modules ``path`` (module ``module``) imports, relative imports made absolute."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_library_files_never_import_the_tools():
    offenders = {module: sorted(n for n in imported_names(path, module) if n.startswith(TOOLS))
                 for module, path in library_modules().items()}
    assert not {m: n for m, n in offenders.items() if n}


def test_importing_the_library_loads_no_tool():
    """Import every library module in a fresh interpreter (those whose optional
    dependencies are missing aside): ``jax_moelora.tools`` stays unloaded."""
    script = (
        "import importlib, json, sys\n"
        "skipped = []\n"
        f"for name in {sorted(library_modules())!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:\n"
        "        skipped.append(name)\n"
        "print(json.dumps({'tools': sorted(m for m in sys.modules "
        f"if m.startswith({TOOLS!r})), 'skipped': skipped}}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["tools"] == []
    assert "jax_moelora" not in result["skipped"]


def test_the_package_top_level_holds_the_library():
    """The tools are in their subpackage, not beside ``routing.py`` and ``tables.py``."""
    tool_names = {p.stem for p in (PACKAGE / "tools").glob("*.py")} - {"__init__"}
    assert not tool_names & {p.stem for p in PACKAGE.glob("*.py")}


#: Longest a function in the package may be, unless a comment on the line
#: before its ``def`` (or on the ``def`` line) says why, with "long:".
MAX_FUNCTION_LINES = 80


def test_no_function_is_over_80_lines_without_a_reason():
    long_ones = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source, str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = node.end_lineno - node.lineno + 1
            said = any("long:" in ln for ln in lines[max(first - 2, 0):node.lineno])
            if length > MAX_FUNCTION_LINES and not said:
                long_ones.append(f"{path.relative_to(PACKAGE.parent)}:{node.name}:{length}")
    assert not long_ones
