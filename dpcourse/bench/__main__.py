"""Benchmarks: ``python -m dpcourse.bench NAME [options]``.

Each NAME is a module of this package with a ``HELP`` line, ``add_arguments(parser)`` and
``main(args) -> int``; it prints figures measured side by side in one run, with the ratios
the course quotes.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import __path__ as _bench_path


def _commands() -> dict:
    found = {}
    for info in pkgutil.iter_modules(_bench_path):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        if hasattr(module, "add_arguments") and hasattr(module, "main"):
            found[info.name] = module
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpcourse.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="name", required=True)
    commands = _commands()
    for name, module in sorted(commands.items()):
        module.add_arguments(sub.add_parser(name, help=module.HELP))
    args = parser.parse_args(argv)
    return commands[args.name].main(args)


if __name__ == "__main__":
    sys.exit(main())
