"""Command line: ``python -m jax_moelora {demo,train,bench,info}``.

``info`` needs only the core install; ``demo`` and ``train`` need the ``nnx``,
``peft`` and ``bench`` extras, ``bench`` the ``bench`` extra (``pip install
'jax_moelora[all]'``). The commands live in ``jax_moelora.tools``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from types import ModuleType


def _command_module(name: str) -> tuple[ModuleType | None, ImportError | None]:
    """``jax_moelora.tools.<name>``, or the ImportError (naming the extra) that importing it
    raised."""
    try:
        return importlib.import_module(f"jax_moelora.tools.{name}"), None
    except ImportError as err:
        return None, err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_moelora", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what was built, whether a GPU is visible, which backends run now")
    commands = {
        "demo": "end-to-end demo (on the GPU when one is visible, else on the CPU)",
        "train": "fine-tune two LoRA adapters at once",
        "bench": "the benchmark of docs/semantics.md §7",
    }
    modules: dict[str, tuple[ModuleType | None, ImportError | None]] = {}
    for name, help_text in commands.items():
        p = sub.add_parser(name, help=help_text)
        modules[name] = _command_module(name)
        module, _ = modules[name]
        if module is None:
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        else:
            module.add_arguments(p)
    args = parser.parse_args(argv)
    if args.command == "info":
        from jax_moelora import backends

        print(json.dumps(backends(), indent=2))
        return 0
    module, err = modules[args.command]
    if module is None:
        parser.exit(2, f"python -m jax_moelora {args.command}: {err}\n")
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
