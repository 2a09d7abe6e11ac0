"""``posenc bench``: the command line of the benchmark (suites, single runs, executors, report)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError, PosencError
from ..settings import key_value

DESCRIPTION = """\
Train small models with each positional encoding, test them on longer inputs, print a live
and a final leaderboard, and write results.sqlite, results.json, leaderboard.md/.json, plots
and report.html to --out. Finished runs are kept: the same command again resumes an
interrupted suite and never runs a finished one twice.

Without --suite it runs the quick suite (order, adjacent × 6 encodings × seeds 0 1);
--tasks/--encodings/--seeds then replace the quick suite's lists. With --suite they
keep only those parts of the suite."""

EXAMPLES = """\
examples:
  posenc bench                                  the quick suite (a few minutes on 2 cores)
  posenc bench --list-suites                    the built-in suites
  posenc bench --suite alibi --workers 2        a paper reproduction, 2 processes
  posenc bench --suite my_suite.toml            a suite file of your own
  posenc bench --task order --encodings rope alibi --seeds 0 1 2 --steps 200
  posenc bench --task order --encodings rope nope 'rope+nope' 'rope@w8+nope'   per layer: RoPE, then NoPE
  posenc bench --task order --encodings shaw --encoding-option max_relative_position=4
  posenc bench --suite quick --executor ray --ray-address auto
  posenc bench --task order --encodings rope --ddp 2     one run across 2 torchrun processes
  posenc bench --report-only --out posenc-results/quick  the report of a store, nothing run
  posenc bench --import my_tasks.py --task my-task       a task of your own (docs/tasks.md)
  posenc bench --task text --data notes.txt --encodings rope alibi   a character LM on your own text
"""


#: the page that explains a built-in suite's results (why `normalized` wins `order` ...), by the suite's file
EXPLAINED = {
    "quick": "What these results show, and why `normalized` wins `order` (the order of t/(N-1) does not depend on "
    "N; `adjacent` needs distances): docs/quickstart-results.md",
}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    pb = sub.add_parser(
        "bench",
        help="train small models with each encoding, test extrapolation, print a leaderboard",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = pb.add_argument_group("what to run")
    what.add_argument("--suite", metavar="NAME|FILE", help="a built-in suite (see --list-suites) or a TOML file")
    what.add_argument("--list-suites", action="store_true", help="list the built-in suites and exit")
    what.add_argument("--list-tasks", action="store_true", help="list the registered tasks and exit")
    what.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE|FILE",
        help="import a module of tasks of your own (a name or a .py file; repeatable), here and in every worker",
    )
    what.add_argument("--tasks", "--task", nargs="+", metavar="TASK", dest="tasks", help="tasks (default: the suite's)")
    what.add_argument(
        "--encodings",
        nargs="+",
        metavar="NAME",
        help="encodings ('all' for every one), or schedules of encodings per layer: 'rope*3+nope' (NoPE on every "
        "4th layer), 'rope@w64*3+nope' (sliding windows of 64 keys), 'rope@c128' (chunks): docs/schedules.md",
    )
    what.add_argument("--seeds", nargs="+", type=int, help="seeds (default: the suite's; quick: 0 1)")
    what.add_argument(
        "--data",
        metavar="PATH",
        help="a text file of your own for task 'text' (a character-level LM; implies --task text)",
    )
    what.add_argument(
        "--tokenizer",
        metavar="NAME|DIR",
        help="with --data: tokens of this transformers tokenizer instead of characters (a local folder, or "
        "'smollm2-135m' where posenc's real-model extra is installed)",
    )
    what.add_argument(
        "--encoding-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='an option for every encoding of a run without --suite (VALUE is JSON: 4, 1e4, true, "x")',
    )
    st = pb.add_argument_group("settings (override the suite's)")
    st.add_argument("--steps", type=int, help="training steps per run")
    st.add_argument("--train-max", type=int, help="longest training length")
    st.add_argument("--test-lengths", nargs="+", type=int, metavar="L", help="test lengths")
    st.add_argument("--model", choices=["auto", "encoder", "decoder"], help="model style")
    where = pb.add_argument_group("where and how")
    where.add_argument("--out", help="output folder (default posenc-results/<suite>)")
    where.add_argument("--store", help="SQLite results store (default <out>/results.sqlite)")
    where.add_argument("--workers", type=int, default=1, help="parallel processes on this machine (default 1)")
    where.add_argument(
        "--executor",
        choices=["auto", "local", "process", "ray"],
        default="auto",
        help="local (this process), process (--workers processes), ray (a Ray cluster); auto: process if --workers > 1",
    )
    where.add_argument("--ray-address", help="Ray cluster address (default: start a local one)")
    where.add_argument(
        "--ddp", type=int, default=0, metavar="N", help="run each job across N torchrun processes (gloo)"
    )
    where.add_argument(
        "--on-error",
        choices=["continue", "stop"],
        default="continue",
        help="a run that fails (e.g. a data package not installed): record it and go on (default), or stop",
    )
    where.add_argument("--fresh", action="store_true", help="run finished runs again (rows replaced when they finish)")
    where.add_argument(
        "--no-wait",
        action="store_true",
        help="do not wait at the end for runs that another process on the same store is training; list them",
    )
    where.add_argument("--report-only", action="store_true", help="write the report of what is stored; run nothing")
    where.add_argument("--quiet", action="store_true", help="no progress bar and no live leaderboard")
    pb.set_defaults(func=run)
    return pb


def _suite(args: argparse.Namespace):
    from ..schedule import check_names
    from .suites import Grid, _encoding, load_suite

    if args.suite:
        if args.encoding_option:
            raise ConfigError("--encoding-option is for runs without --suite; give options in the suite file")
        suite = load_suite(args.suite)
        encodings = args.encodings
        if encodings:  # a suite's encodings go by name or by label ("shaw k=4"): every one not in it, at once
            have = sorted(
                {e.name for g in suite.grids for e in g.encodings} | {e.label for g in suite.grids for e in g.encodings}
            )
            bad = [e for e in encodings if e not in have]
            if bad:
                import difflib

                said = [
                    f"{e!r}"
                    + (f" (did you mean: {', '.join(close)}?)" if (close := difflib.get_close_matches(e, have)) else "")
                    for e in bad
                ]
                raise ConfigError(
                    f"--encodings: not in suite {suite.name!r}: {', '.join(said)}; its encodings: {', '.join(have)}"
                )
        return suite, dict(tasks=args.tasks, encodings=encodings, seeds=args.seeds)
    if args.encodings and args.encodings != ["all"]:
        check_names(args.encodings, "--encodings")  # every typo at once, each with its close matches
    suite = load_suite("quick")
    # the quick suite has a grid per task (adjacent has settings of its own); the lists replace those of every grid
    grids: list[Grid] = suite.grids
    options = dict(key_value(o, "--encoding-option") for o in args.encoding_option)
    if args.encodings:
        if args.encodings == ["all"]:  # each with the settings it declares (example_options), then --encoding-option
            entries = _all_buildable(suite)
            names = [e if isinstance(e, str) else e["name"] for e in entries]
            declared = {e["name"]: e["options"] for e in entries if isinstance(e, dict)}
        else:
            names, declared = args.encodings, {}
        for g in grids:
            g.encodings = [
                _encoding(
                    "--encodings",
                    {"name": n, "options": {**declared.get(n, {}), **options}} if options or n in declared else n,
                )
                for n in names
            ]
    elif options:
        for g in grids:
            g.encodings = [_encoding("--encodings", {"name": e.name, "options": options}) for e in g.encodings]
    if args.tasks:
        from .api import get_task

        for t in args.tasks:
            get_task(t)
        # a quick-suite task keeps its grid's settings; any other task gets the first grid's
        placed = {t for g in grids for t in g.tasks}
        for i, g in enumerate(grids):
            g.tasks = [t for t in args.tasks if t in g.tasks or (i == 0 and t not in placed)]
        suite.grids = [g for g in grids if g.tasks]
    if args.seeds:
        for g in grids:
            g.seeds = list(args.seeds)
    if args.tasks or args.encodings or args.seeds or options:
        suite.name, suite.description = "runs", ""
    return suite, {}


def _all_buildable(suite: Any) -> list[str | dict[str, Any]]:
    """Every registered encoding, with the settings it declares (``example_options``) at the quick suite's sizes:
    a name, or ``{"name", "options"}``. One that still cannot run there is left out, saying why on stderr."""
    from ..errors import PosencError
    from ..registry import available, example_options
    from .suites import check_reach
    from .types import RunConfig

    settings = suite.grids[0].settings
    entries: list[str | dict[str, Any]] = []
    skipped = []
    for name in available():
        try:
            cfg = RunConfig(task="order", encoding=name, **settings)
            dims = dict(d_model=cfg.d_model, n_heads=cfg.n_heads, max_len=max(cfg.test_lengths), n_layers=cfg.n_layers)
            options = example_options(name, dims)
            check_reach(RunConfig(task="order", encoding=name, encoding_options=options, **settings))
            entries.append({"name": name, "options": options} if options else name)
        except PosencError as exc:
            skipped.append(f"{name} ({exc})")
    if skipped:
        print("--encodings all: leaving out encodings that cannot run here: " + "; ".join(skipped), file=sys.stderr)
    return entries


def _text_options(args: argparse.Namespace) -> dict[str, Any]:
    """Task ``text``'s options from ``--data`` / ``--tokenizer``: the file (absolute), its digest (in the run key, so
    that another text is another run) and the tokenizer."""
    from .tasks.text import file_digest, read_text_file

    path = Path(args.data).expanduser()
    read_text_file(path, f"--data {args.data}")  # missing, a folder, empty, binary or not UTF-8: said before any run
    opts: dict[str, Any] = {"path": str(path.resolve()), "digest": file_digest(path)}
    if args.tokenizer:
        opts["tokenizer"] = args.tokenizer
    return opts


def _check_text(args: argparse.Namespace) -> None:
    """``--data`` belongs to task ``text`` alone (and implies it); ``--tokenizer`` needs ``--data``."""
    if args.tokenizer and not args.data:
        raise ConfigError("--tokenizer goes with --data PATH (task 'text'): give the text file too")
    if not args.data:
        return
    if args.suite:
        raise ConfigError("--data is for task 'text' without --suite: posenc bench --task text --data PATH")
    if not args.tasks:
        args.tasks = ["text"]
    elif args.tasks != ["text"]:
        raise ConfigError(f"--data is a file for task 'text' alone; got --task {' '.join(args.tasks)}")


def _check_numbers(args: argparse.Namespace) -> None:
    """The command line's numeric options, before anything runs (``--workers 0`` used to run as if it were 1)."""
    least = {"--workers": (args.workers, 1), "--ddp": (args.ddp, 0), "--steps": (args.steps, 1)}
    least["--train-max"] = (args.train_max, 1)
    for flag, (value, low) in least.items():
        if value is not None and value < low:
            raise ConfigError(f"{flag} must be an integer >= {low}, got {value}")
    for flag, values in (("--test-lengths", args.test_lengths), ("--seeds", args.seeds)):
        low = 1 if flag == "--test-lengths" else 0
        bad = [v for v in values or () if v < low]
        if bad:
            raise ConfigError(f"{flag} must be integers >= {low}, got {bad[0]}")


def _stored_suite(args: argparse.Namespace) -> str | None:
    """The suite of a store's runs, for ``--report-only`` without ``--suite`` (its runs carry the suite's name): the
    report of ``posenc-results/alibi`` is then alibi's, not an empty one of the quick suite. ``None`` where the
    store is missing or its runs name no suite, or several."""
    from .store import open_store
    from .suites import load_suite

    path = Path(args.store) if args.store else Path(args.out or Path("posenc-results") / "quick") / "results.sqlite"
    if not path.exists():
        return None
    names = {r.get("suite") for r in open_store(path).results()}
    if len(names) != 1 or None in names or names == {"quick"}:
        return None
    name = names.pop()
    try:
        load_suite(name)
    except PosencError:  # a suite file of the user's, not at hand: the quick suite's report, as before
        return None
    return name


def _stored_report(
    store: Any, jobs: list[Any], suite_name: str, by_suite: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """``--report-only``: the stored runs to report, the failures, and the suite's name for the title.

    ``by_suite``: the runs of ``jobs`` (what the flags select); else every stored run as it is (a store of
    ``--task/--encodings`` runs, or of a suite file not at hand, is not reported as "0 of the quick suite's runs").
    A selection that finds none of the stored runs is a :class:`ConfigError`, and the report on disk is left as it
    was; an empty store gives an empty report, with a warning on stderr."""
    stored = store.load()
    all_failures = store.failures()
    if not stored and not all_failures:  # nothing to lose: the (empty) report of an empty store, said on stderr
        print(
            f"posenc bench: warning: --report-only: {store.path} holds no runs, so the report is empty; give the --out "
            "(or --store) of a run that finished",
            file=sys.stderr,
        )
        return [], [], suite_name
    if by_suite:
        res = [{**stored[j.key], "label": j.label} for j in jobs if j.key in stored]
        keys = {j.key for j in jobs} - set(stored)
        failures = [f for f in all_failures if f["key"] in keys]
        if not res and not failures:
            suites = sorted({str(r.get("suite")) for r in stored.values()})
            raise ConfigError(
                f"--report-only: none of the {len(jobs)} runs of suite {suite_name!r} that these flags select is in "
                f"{store.path}, which holds {len(stored)} runs (of {', '.join(suites)}): give the flags that ran "
                "them, or none to report every stored run (the report was not rewritten)"
            )
        print(f"posenc bench: {len(res)} of {len(jobs)} runs of suite {suite_name!r} are in {store.path}")
        return res, failures, suite_name
    res = [{**r, "label": r.get("label") or r.get("config", {}).get("encoding", "?")} for r in stored.values()]
    failures = [f for f in all_failures if f["key"] not in stored]
    name = " + ".join(sorted({str(r.get("suite") or "runs") for r in res})) or suite_name
    print(f"posenc bench: {len(res)} runs in {store.path} (suite {name}), reported as stored")
    return res, failures, name


def run(args: argparse.Namespace) -> int:
    _check_numbers(args)
    _check_text(args)
    if args.imports:
        from .api import load_tasks

        load_tasks(*args.imports)
    if args.list_suites:
        from .suites import describe_suites  # the TOML files only: no torch

        listed = describe_suites()
        width = max((len(name) for name, _, _ in listed), default=4)
        digits = max((len(str(n)) for _, _, n in listed), default=1)
        for name, desc, n in listed:
            print(f"{name:<{width}}  {n:>{digits}} runs  {desc}")
        print("\nposenc bench --suite NAME runs one; a suite file of your own: see docs/bench.md")
        return 0
    if args.list_tasks:
        from .api import available_tasks, get_task

        names = available_tasks()
        width = max((len(t) for t in names), default=4)
        for t in names:
            task = get_task(t)
            print(f"{t:<{width}}  {task.metric:<12} {task.description}")
        return 0
    from .report import leaderboard, learning_warnings, markdown_table, write_report
    from .runner import run_suite
    from .store import open_store

    selected = bool(args.suite or args.tasks or args.encodings or args.seeds or args.encoding_option or args.data)
    if args.report_only and not selected:
        args.suite = _stored_suite(args)
    suite, filters = _suite(args)
    overrides: dict[str, Any] = {}
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.train_max is not None:
        lo = min(g.settings.get("train_lengths", (4, 16))[0] for g in suite.grids)
        overrides["train_lengths"] = (min(lo, args.train_max), args.train_max)
    if args.test_lengths:
        overrides["test_lengths"] = tuple(args.test_lengths)
    if args.model:
        overrides["model"] = args.model
    if args.data:
        overrides["task_options"] = _text_options(args)
    jobs = suite.jobs(**filters, overrides=overrides)
    out = Path(args.out or Path("posenc-results") / suite.name)
    store = open_store(args.store or out / "results.sqlite")
    t0 = time.perf_counter()
    if args.report_only:
        # by the suite's runs where flags select them or the store's suite is known; else every stored run as it is
        res, failures, name = _stored_report(store, jobs, suite.name, by_suite=selected or args.suite is not None)
        if name != suite.name:
            suite.name, suite.published, suite.description = name, {}, ""
    else:
        tasks = sorted({j.config.task for j in jobs})
        labels = sorted({j.label for j in jobs})
        seeds = sorted({j.config.seed for j in jobs})
        how = (
            f"{args.workers} processes" if args.workers > 1 and args.executor in ("auto", "process") else args.executor
        )
        if args.ddp:
            how = f"torchrun × {args.ddp}"
        print(
            f"posenc bench: suite {suite.name!r}: {len(jobs)} runs ({len(labels)} encodings × {len(tasks)} tasks × "
            f"{len(seeds)} seeds) -> {out}/ (store {store.path}; {how})",
            flush=True,
        )
        res = run_suite(
            jobs,
            out,
            store=store,
            workers=args.workers,
            executor=args.executor,
            ray_address=args.ray_address,
            ddp=args.ddp,
            progress=not args.quiet,
            resume=not args.fresh,
            on_error=args.on_error,
            wait_for_others=not args.no_wait,
        )
        failures = res.failures
    title = f"posenc bench — {suite.name}"
    explained = EXPLAINED.get(suite.name, "")
    files = write_report(
        list(res),
        out,
        title,
        published=suite.published,
        failures=failures,
        description=" ".join(x for x in (suite.description, explained) if x),
        controls=suite.controls,
    )
    rows = leaderboard(list(res), suite.controls)
    print()
    print(markdown_table(rows))
    if suite.published:
        from .report import published_table

        print(published_table(suite.published, rows))
    if explained:
        print(explained)
    for text in learning_warnings(rows):  # what only the report said before: a run that learned nothing
        print(f"posenc bench: warning: {text}", file=sys.stderr)
    print(f"finished in {time.perf_counter() - t0:.0f} s; wrote " + ", ".join(str(p) for p in files.values()))
    if failures:
        print(
            f"posenc bench: {len(failures)} run(s) failed (listed above and in {files['report']}); "
            "they are recorded as failures, not results: fix the cause and run the same command again",
            file=sys.stderr,
        )
        return 1
    return 0
