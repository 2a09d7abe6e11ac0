"""``posenc extend``: the command line of :mod:`posenc.extend`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..settings import positive_int, whole
from .cli_shared import _run_only_flags, _show, config_from
from .config import (
    AS_TRAINED,
    DOCUMENTS,
    FULL,
    QUICK,
    SCALINGS,
    SEARCHED,
    TASK_NAMES,
    count_cells,
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


def run(args: argparse.Namespace) -> int:
    from .finetune import check_finetune_args
    from .variants_cli import _add_searched, _check_search, _search_factor, _searched, run_finetuning

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
