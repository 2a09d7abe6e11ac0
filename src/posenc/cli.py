"""The ``posenc`` command line: ``list``, ``bench``, ``results``, ``inspect``, ``info``, ``readme-table``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__
from .errors import PosencError

# Only argparse and the error classes are imported here: `posenc --help` (and every subcommand's
# --help) must not import torch, which takes seconds. Each command imports what it needs.

EPILOG = """\
examples:
  posenc list                         every encoding with its family and paper
  posenc list --markdown              the same as a Markdown table
  posenc bench                        the quick suite: train, extrapolate, leaderboard, report
  posenc bench --list-suites          the paper reproductions (alibi, tener, chomsky ...)
  posenc results --write docs/results.md   the results page of every suite, from the committed data
  posenc bench --encodings rope alibi t5 --seeds 0 1 2 --out results/mine
  posenc inspect rope                 measured properties and pictures of one encoding
  posenc extend --quick               a real pretrained model (SmolLM2) stretched with RoPE scalings
  posenc info                         versions, threads, and whether the compiled CPU kernels are in use
  posenc readme-table --write README.md   regenerate the README's table of encodings
"""


def _cmd_list(args: argparse.Namespace) -> int:
    from ._cards import cards  # from a cache on disk: a listing imports no torch

    rows = []
    for c in cards():
        if args.family and c["family"] != args.family:
            continue
        rows.append((c["name"], c["family"], f"{c['paper']} ({c['year']})", c["summary"]))
    if args.markdown:
        from .readme_table import table

        print(table(args.family), end="")
        return 0
    width = max(len(r[0]) for r in rows) if rows else 4
    print(f"{'name':<{width}}  {'family':<8}  {'paper':<60}  summary")
    for name, family, paper, summary in rows:
        paper = paper if len(paper) <= 60 else paper[:57] + "..."
        print(f"{name:<{width}}  {family:<8}  {paper:<60}  {summary}")
    print(f"\n{len(rows)} encodings. `posenc list --markdown` for a table with references.")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    import platform

    import torch

    from . import native
    from .registry import available

    print(f"posenc {__version__}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, python {platform.python_version()}")
    print(f"encodings: {len(available())}")
    print(native.status())  # builds the kernels on first use (well under a second)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="posenc",
        description="Positional encodings for Transformers: list them, measure them, benchmark them.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"posenc {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    pl = sub.add_parser("list", help="list every registered encoding", description="List every registered encoding.")
    pl.add_argument("--markdown", action="store_true", help="print a Markdown table (name, family, paper, reference)")
    families = ["none", "absolute", "rotary", "relative", "bias", "temperature"]
    pl.add_argument("--family", choices=families, help="only this family")
    pl.set_defaults(func=_cmd_list)

    pi = sub.add_parser(
        "info",
        help="versions, threads, and whether the compiled CPU kernels are in use",
        description="Print posenc's and torch's versions, the thread count, and the state of posenc.native "
        "(the compiled one-pass CPU kernels: where they were built, or why PyTorch ops are used instead).",
    )
    pi.set_defaults(func=_cmd_info)

    from . import readme_table

    pr = sub.add_parser(
        "readme-table",
        help="print the table of encodings, or rewrite it in README.md (--write README.md)",
        description="Print the Markdown table of registered encodings, or put it into a file between the lines "
        f"{readme_table.START} and {readme_table.END} (--write), or check that it is there (--check).",
    )
    readme_table.add_arguments(pr)
    pr.set_defaults(func=readme_table.run)

    from .bench import cli as bench_cli
    from .bench import results_page

    bench_cli.add_parser(sub)
    results_page.add_parser(sub)
    from .extend import cli as extend_cli

    extend_cli.add_parser(sub)

    try:
        from .analysis import cli as inspect_cli

        inspect_cli.add_parser(sub)
    except (ImportError, AttributeError):
        pass
    return p


def _quiet_stdout() -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout (a test's capture): nothing to point anywhere
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # the reader of a pipe stopped early (`posenc inspect t5 | head`): not an error of ours; stdout is pointed
        # at devnull so that Python's flush at exit does not raise (and print a traceback) a second time
        _quiet_stdout()
        return 0
    except PosencError as exc:
        print(f"posenc: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nposenc: interrupted; finished runs are kept and the next run resumes from them", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
