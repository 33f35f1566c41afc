"""Command line: ``python -m jax_moelora {demo,bench,info}``."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_moelora", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what was built and registered")
    demo = sub.add_parser("demo", help="end-to-end demo (CPU when there is no GPU)")
    bench = sub.add_parser("bench", help="benchmark of SPEC section 7")
    from jax_moelora import bench as bench_mod
    from jax_moelora import demo as demo_mod

    demo_mod.add_arguments(demo)
    bench_mod.add_arguments(bench)
    args = parser.parse_args(argv)
    if args.command == "info":
        from jax_moelora import backends

        print(json.dumps(backends(), indent=2))
        return 0
    if args.command == "demo":
        return demo_mod.run(args)
    return bench_mod.run(args)


if __name__ == "__main__":
    sys.exit(main())
