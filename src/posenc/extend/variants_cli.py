"""``posenc extend``'s variants on the command line: LongRoPE's search (``--longrope-search``) and fine-tuning
(``--finetune``), each measured on the cells beside the training-free rows (:mod:`posenc.extend.cli` is the rest of
the command)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..settings import positive_int, whole
from .cli_shared import _show, config_from
from .config import AS_TRAINED, DOCUMENTS, QUICK, SEARCHED, ExtendConfig


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
