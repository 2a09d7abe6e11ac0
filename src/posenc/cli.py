"""The ``posenc`` command line: ``list``, ``bench``, ``results``, ``inspect``, ``info``, ``readme-table``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

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
  posenc export smollm2-135m out --encoding rope-yarn --factor 2   a native transformers folder of the patch
  posenc harness --model posenc --model_args pretrained=smollm2-135m,encoding=rope-yarn,factor=2 --tasks T
                                      lm-evaluation-harness's CLI on a patched model (posenc[eval])
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
    print(f"{'name':<{width}}  {'family':<11}  {'paper':<60}  summary")
    for name, family, paper, summary in rows:
        paper = paper if len(paper) <= 60 else paper[:57] + "..."
        print(f"{name:<{width}}  {family:<11}  {paper:<60}  {summary}")
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
    from . import export_cli

    export_cli.add_parser(sub)
    # `posenc harness ARGS`: lm-evaluation-harness's own CLI with --model posenc registered (posenc.lm_eval); a
    # parser with no option prefix, so that every argument (--model, --tasks, -h ...) is passed through as given
    ph = sub.add_parser(
        "harness",
        add_help=False,
        prefix_chars="\0",
        help="lm-evaluation-harness's CLI with --model posenc registered (needs posenc[eval])",
        description="lm-evaluation-harness's own CLI (lm_eval ARGS) with --model posenc registered.",
    )
    ph.add_argument("harness_args", nargs="*", help="every argument of lm_eval, passed through")
    ph.set_defaults(func=_cmd_harness)

    try:
        from .analysis import cli as inspect_cli

        inspect_cli.add_parser(sub)
    except (ImportError, AttributeError):
        pass
    return p


def _cmd_harness(args: argparse.Namespace) -> int:
    try:
        from .lm_eval import main as harness_main
    except ImportError as err:
        print(f"posenc harness: error: {err}", file=sys.stderr)
        return 2
    harness_main(list(args.harness_args))
    return 0


# ---------------------------------------------------------------------------- usage errors before torch
def _preflight(args: argparse.Namespace) -> None:
    """The usage errors that the arguments alone show, found before a command imports torch (seconds; 13-24 s on
    a busy machine): an unknown encoding (checked against the cards of :mod:`._cards`, with its close matches among
    the names ``posenc list`` shows), an unknown suite or task, an encoding or task not in the suite named, and the
    bench's numbers. Each command checks its arguments again in full when it runs; this is the early, cheap part.
    """
    from . import _cards

    if args.command == "inspect" and getattr(args, "name", None) and not getattr(args, "all", False):
        _cards.check_encodings([args.name])
    if args.command != "bench":
        return
    from .bench import cli as bench_cli

    for check in ("_check_numbers", "_check_text"):  # torch-free checks of the bench's own (bench/cli.py)
        if callable(fn := getattr(bench_cli, check, None)):
            fn(args)
    if args.list_suites or args.list_tasks or args.imports:  # a module of the user's may register names
        return
    in_suite = _suite_names(args.suite) if args.suite else None
    if args.encodings and args.encodings != ["all"]:
        if in_suite is None and not args.suite:
            _cards.check_encodings(args.encodings, "--encodings")
        elif in_suite is not None:
            _not_in_suite("--encodings", args.encodings, in_suite["name"], in_suite["encodings"])
    if args.tasks:
        if in_suite is not None:
            _not_in_suite("--tasks", args.tasks, in_suite["name"], in_suite["tasks"])
        elif not args.suite and (known := _cards.task_names()) is not None:
            bad = [t for t in args.tasks if t not in known]
            if bad:
                from .errors import UnknownNameError

                exc = UnknownNameError("task", bad[0], known)
                exc.args = (
                    f"--tasks: {exc.args[0]} A task of your own is found when its module is imported: "
                    "posenc bench --import my_tasks (a module name or a .py file)",
                )
                raise exc


def _suite_names(given: str) -> dict[str, Any] | None:
    """The name, encodings (names and labels) and tasks of the suite ``--suite`` names, read from its TOML file
    without building it (no torch); an unknown suite or a missing file is an error. None where the file cannot be
    read here as a suite (the full check, when the command runs, says why)."""
    import tomllib
    from pathlib import Path

    from .bench.types import default_label
    from .errors import ConfigError, UnknownNameError

    p = Path(given)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise ConfigError(f"suite file {p} does not exist")
    else:
        folder = Path(__file__).resolve().parent / "bench" / "suites"
        builtin = sorted(q.stem for q in folder.glob("*.toml"))
        if given not in builtin:
            raise UnknownNameError("suite", given, builtin)
        p = folder / f"{given}.toml"
    try:
        data = tomllib.loads(p.read_text())
        encodings: set[str] = set()
        tasks: set[str] = set()
        for part in [data, *data.get("grid", [])]:
            tasks |= {str(t) for t in part.get("tasks", [])}
            for e in part.get("encodings", []):
                if isinstance(e, str):
                    encodings.add(e)
                else:
                    encodings |= {e["name"], e.get("label") or default_label(e["name"], e.get("options", {}))}
        return {"name": data.get("name", p.stem), "encodings": sorted(encodings), "tasks": sorted(tasks)}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _not_in_suite(flag: str, given: list[str], suite: str, have: list[str]) -> None:
    """A usage error naming every one of ``given`` that suite ``suite`` does not have (with close matches)."""
    import difflib

    from .errors import ConfigError

    bad = [g for g in given if g not in have]
    if bad:
        said = [
            f"{g!r}"
            + (f" (did you mean: {', '.join(close)}?)" if (close := difflib.get_close_matches(g, have)) else "")
            for g in bad
        ]
        kind = "encodings" if flag == "--encodings" else "tasks"
        raise ConfigError(f"{flag}: not in suite {suite!r}: {', '.join(said)}; its {kind}: {', '.join(have)}")


def _quiet_stdout() -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout (a test's capture): nothing to point anywhere
        pass


def _check_command(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """A mistyped command name (``posenc benh``) is a usage error with its close matches (argparse lists them all)."""
    commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    given = next((a for a in argv if not a.startswith("-")), None)
    if not commands or given is None or given in commands[0].choices:
        return
    import difflib

    names = list(commands[0].choices)
    close = difflib.get_close_matches(given, names, n=3, cutoff=0.5)
    parser.error(
        f"unknown command {given!r}."
        + (f" Did you mean: {', '.join(close)}?" if close else "")
        + f" The commands: {', '.join(names)} (posenc --help says what each does)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    _check_command(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        _preflight(args)
    except PosencError as exc:
        where = "posenc inspect" if args.command == "inspect" else "posenc"
        print(f"{where}: error: {exc}", file=sys.stderr)
        return 2
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
    finally:
        from ._cards import keep

        keep()  # the names this command loaded anyway, for the next command's checks (no torch then)


if __name__ == "__main__":
    sys.exit(main())
