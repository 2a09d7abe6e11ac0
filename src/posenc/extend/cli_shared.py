"""What ``posenc extend``'s command modules share (:mod:`posenc.extend.cli`, the training-free run and the RULER
data; :mod:`posenc.extend.variants_cli`, LongRoPE's search and fine-tuning): the flags made into an
:class:`~posenc.extend.config.ExtendConfig`, and the printed tables and verdicts of a run."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .config import (
    AS_TRAINED,
    FULL,
    QUICK,
    RULER_TASKS,
    SCALINGS,
    SEARCHED,
    TASK_NAMES,
    ExtendConfig,
    check_documents,
    check_fields,
    is_variant,
)

FLAGS = {
    "model": "--model",
    "documents": "--documents",
    "scalings": "--scalings",
    "loss_long_scalings": "--scalings",
    "passkey_scalings": "--passkey-scalings",
    "loss_short": "--loss-extension",
    "loss_extension": "--loss-extension",
    "passkey_lengths": "--passkey-lengths",
    "passkey_depths": "--passkey-depths",
    "chunk": "--chunk",
    "ruler_tasks": "--tasks",
    "ruler_scalings": "--ruler-scalings",
    "ruler_lengths": "--ruler-lengths",
    "ruler_floor_lengths": "--ruler-lengths",
    "ruler_relative": "--ruler-relative",
    "ruler_template": "--template",
    "ruler_haystacks": "--haystacks",
    "ruler_questions": "--questions",
    "ruler_fill_below": "--fill-below",
}


def _tasks(args: argparse.Namespace, changes: dict[str, Any]) -> None:
    """``--tasks``: keep the loss curves and the passkey grid only where named; the RULER tasks named (``ruler``:
    all six). A flag of a measurement left out is refused, naming both."""
    tasks = args.tasks
    if tasks is None:
        if args.ruler_relative or any(getattr(args, n) is not None for n in (
                "ruler_scalings", "ruler_lengths", "haystacks", "questions", "fill_below", "template")):
            raise ConfigError("--ruler-scalings / --ruler-lengths / --ruler-relative / --template / --haystacks / "
                              "--questions / --fill-below describe RULER cells: add --tasks ruler (or some of its "
                              "tasks)")
        return
    for t in tasks:
        if t not in TASK_NAMES:
            import difflib

            close = difflib.get_close_matches(t, TASK_NAMES, n=2, cutoff=0.5)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            from .config import RULER_NOT_RUN

            if t in RULER_NOT_RUN:
                raise ConfigError(f"--tasks: {t} is RULER's but does not run here: {RULER_NOT_RUN[t]}")
            raise ConfigError(f"--tasks: unknown task {t!r}{hint}; the tasks are {', '.join(TASK_NAMES)}")
    ruler = RULER_TASKS if "ruler" in tasks else tuple(t for t in RULER_TASKS if t in tasks)
    changes["ruler_tasks"] = ruler
    if "loss" not in tasks:
        given = [f for f, v in (("--documents", args.documents), ("--scalings", args.scalings),
                                ("--loss-extension", args.loss_extension)) if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} describe the loss curves, which --tasks leaves out: add loss")
        changes["scalings"] = changes["loss_long_scalings"] = ()
    if "passkey" not in tasks:
        given = [f for f, v in (("--passkey-scalings", args.passkey_scalings), ("--passkey-lengths",
                 args.passkey_lengths), ("--passkey-depths", args.passkey_depths)) if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} describe the passkey grid, which --tasks leaves out: add passkey")
        changes["passkey_scalings"] = ()
    if not ruler and any(getattr(args, n) is not None for n in ("ruler_scalings", "ruler_lengths")):
        raise ConfigError("--ruler-scalings / --ruler-lengths describe RULER cells, which --tasks leaves out")
    if args.ruler_scalings:
        changes["ruler_scalings"] = tuple(args.ruler_scalings)
    if args.ruler_relative:
        if not args.ruler_lengths:
            raise ConfigError("--ruler-relative says --ruler-lengths are multiples of L: give --ruler-lengths too")
        changes["ruler_relative"] = True
    if args.template is not None:
        changes["ruler_template"] = args.template
    if args.ruler_lengths:
        changes["ruler_lengths"] = tuple(args.ruler_lengths)
        changes["ruler_past_tasks"] = None  # the lengths given: every task and scaling at each
        changes["ruler_floor_lengths"] = ()
        changes["ruler_scaled_inside"] = True
    if args.haystacks is not None:
        changes["ruler_haystacks"] = args.haystacks
    if args.questions is not None:
        changes["ruler_questions"] = args.questions
    if args.fill_below is not None:
        changes["ruler_fill_below"] = args.fill_below


def config_from(args: argparse.Namespace, base: ExtendConfig | None = None) -> ExtendConfig:
    """The run's :class:`ExtendConfig`: the mode's (or ``base``), changed by the flags given. Every flag is checked
    here, before a model is loaded, and a bad one is named (``--loss-extension 0``, ``--passkey-depths nan``)."""
    cfg = base or (QUICK if args.quick else FULL)
    _refuse_variant_names(args)
    changes: dict[str, Any] = {"model": args.model}
    if args.documents:
        changes["documents"] = check_documents("--documents", args.documents)
    if args.scalings:
        changes["scalings"] = tuple(args.scalings)
        changes["loss_long_scalings"] = tuple(s for s in cfg.loss_long_scalings if s in args.scalings)
    if args.passkey_scalings:
        changes["passkey_scalings"] = tuple(args.passkey_scalings)
    if args.loss_extension is not None:  # one curve per scaling, to X (0 is a value to refuse, not "not given")
        changes["loss_short"] = changes["loss_extension"] = args.loss_extension
        changes["loss_long_scalings"] = ()
    if args.passkey_lengths:
        changes["passkey_lengths"] = tuple(args.passkey_lengths)
    if args.passkey_depths:
        changes["passkey_depths"] = tuple(args.passkey_depths)
    if args.no_passkey:
        if args.passkey_scalings or args.passkey_lengths or args.passkey_depths:
            raise ConfigError(
                "--no-passkey leaves out the passkey grid, which --passkey-scalings / --passkey-lengths / "
                "--passkey-depths describe: give one or the other"
            )
        changes["passkey_scalings"] = ()
    if args.chunk is not None:
        changes["chunk"] = args.chunk
    _tasks(args, changes)
    check_fields(changes, FLAGS)
    if len(changes) > 1:
        changes["mode"] = f"{cfg.mode}, changed"
    return replace(cfg, **changes)


def _refuse_variant_names(args: argparse.Namespace) -> None:
    """``--scalings`` and its kin name scalings to patch in; the searched and fine-tuned rows come from their own
    flags."""
    for flag, names in (("--scalings", args.scalings), ("--passkey-scalings", args.passkey_scalings),
                        ("--ruler-scalings", getattr(args, "ruler_scalings", None))):
        for n in names or ():
            if is_variant(n):
                by = "--longrope-search EVALS adds" if n == SEARCHED else "--finetune STEPS adds"
                raise ConfigError(f"{flag}: {n} is not a scaling to patch in: {by} its cells to every family the "
                                  f"run has; leave it out (the scalings are {AS_TRAINED}, {', '.join(SCALINGS)})")


def _run_only_flags(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """The flags that choose or pace cells to run (nothing a report of the stored cells uses), with their values."""
    names = ("documents", "scalings", "passkey_scalings", "loss_extension", "passkey_lengths", "passkey_depths",
             "no_passkey", "chunk", "threads", "max_cells", "tasks", "ruler_scalings", "ruler_lengths", "haystacks",
             "questions", "fill_below", "ruler_relative", "template", "longrope_search")
    return [("--" + n.replace("_", "-"), getattr(args, n)) for n in names]


def _command(argv: list[str]) -> str:
    return "posenc " + " ".join(argv) if argv else "posenc extend"


def _print_verdict(v: Any) -> None:
    """A verdict as the results page gives it: the finding and the verdict, then the claim it reads (posenc's own
    question marked so), its source and the numbers."""
    mark = "" if v.tests == "as published" else f" ({v.tests})"
    print(f"  {v.verdict}: {v.finding}{mark}")
    if v.claim:
        print(f"      claim: {v.claim} [{v.source}]")
    print(f"      on: {v.evidence}")


def _show(records: list[dict[str, Any]], out: Path, t0: float) -> None:
    """Write the report of ``records`` into ``out``; print the tables and the verdicts (those of the training-free
    rows: a fine-tuned one is no scaling "without fine-tuning")."""
    from . import report

    argv = sys.argv[1:] if sys.argv and os.path.basename(sys.argv[0]) in ("posenc", "__main__.py") else []
    paths = report.write(records, out, command=_command(argv))
    print("\n".join(report.ppl_table(records) + report.passkey_table(records)))
    free = report.training_free(records)
    if any(r.get("kind") in ("loss", "passkey") for r in free):
        print("verdicts:")
        for v in report.verdicts(records):
            _print_verdict(v)
    if any(r.get("kind") == "ruler" for r in records):
        from . import ruler_report

        print("\n".join(ruler_report.table(records)))
        print("RULER verdicts (on the intervals):")
        for rv in ruler_report.verdicts(free):
            _print_verdict(rv)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())} ({time.perf_counter() - t0:.0f} s)")
