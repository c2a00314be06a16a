"""Benchmarks of this package, run by `make bench`."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profile_analyzer.bench")
    parser.add_argument("--out", default="bench-results")
    parser.parse_args(argv)
    print("profile_analyzer: no benchmarks yet")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
