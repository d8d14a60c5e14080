"""Benchmarks: ``python -m dpcourse.bench NAME``. Each prints figures measured side by side
in one run, with the ratio the course quotes. NAME: pool."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpcourse.bench", description=__doc__)
    sub = parser.add_subparsers(dest="name", required=True)
    pool = sub.add_parser("pool", help="the worker pool: start, call overhead, recovery")
    pool.add_argument("--world-size", type=int, default=4)
    pool.add_argument("--rounds", type=int, default=3, help="rounds of the slow measurements")
    args = parser.parse_args(argv)
    if args.name == "pool":
        from .pool import main as run

        return run(world_size=args.world_size, rounds=args.rounds)
    return 2


if __name__ == "__main__":
    sys.exit(main())
