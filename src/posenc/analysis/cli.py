"""The ``posenc inspect`` subcommand: :func:`add_parser` adds it to an argparse parser, :func:`run` runs it.

posenc inspect NAME [--dim 64 --length 128 --heads 4 --out DIR --format text]
posenc inspect SCHEDULE [...]   (e.g. "rope@w64*3+nope": each distinct layer encoding of the schedule in turn)
posenc inspect --all [--out DIR]
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError, PosencError
from .names import CARD_FORMATS, FORMATS, PROPERTIES

DEFAULT_OUT = "posenc-inspect"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``inspect`` to ``subparsers`` (from ``ArgumentParser.add_subparsers()``); return its parser."""
    props = "\n".join(f"  {title}: {meaning}" for _, title, meaning in PROPERTIES)
    p = subparsers.add_parser(
        "inspect",
        help="measure an encoding's properties and draw its pictures",
        description=(
            "Measure the properties a good encoding should have (uniqueness, boundedness, consistency across "
            "lengths, linear offsets, direction, relative-only scores, decay, extrapolation, parameters) "
            "for one encoding, print its property card and write its pictures (PNG and SVG); or, with "
            "--all, write the whole gallery and the side-by-side comparison (index.md, index.html). "
            "Encodings acting inside attention are measured on the scores they induce."
        ),
        epilog=f"properties:\n{props}\n\nexamples:\n  posenc inspect sinusoidal\n"
        "  posenc inspect rope --dim 256 --heads 2 --out rope-pictures\n  posenc inspect --all --out gallery",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "name",
        nargs="?",
        metavar="NAME",
        help="a registered encoding (see `posenc list`), or a schedule of encodings per layer such as "
        "'rope@w64*3+nope' (each distinct layer encoding is inspected in turn)",
    )
    p.add_argument("--all", action="store_true", help="inspect every registered encoding and write the gallery")
    p.add_argument("--dim", type=int, default=64, help="model width d_model (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads; head_dim = dim / heads (default 4)")
    p.add_argument(
        "--length",
        type=int,
        default=128,
        help="the trained length L (max_len); extrapolation is measured up to 4L, boundedness up to 8L (default 128)",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help=f"where the pictures and cards go (default {DEFAULT_OUT}/NAME, or {DEFAULT_OUT} with --all)",
    )
    p.add_argument(
        "--format",
        choices=sorted(CARD_FORMATS),
        default="text",
        help="how the card is printed: text (default), markdown, html or json",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting passed to the encoding, e.g. --option base=100 (repeatable; not with --all)",
    )
    p.add_argument("--no-plots", action="store_true", help="measure and print only; draw no pictures")
    p.add_argument(
        "--image-format",
        action="append",
        choices=FORMATS,
        default=None,
        help="picture formats (repeatable; default png and svg)",
    )
    p.set_defaults(func=run)
    return p


def _parse_options(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--option takes KEY=VALUE, got {item!r}")
        try:
            value: Any = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out[key.strip()] = value
    return out


def run(args: argparse.Namespace) -> int:
    """Run ``posenc inspect``; return the exit status (0 ok, 2 bad input or an encoding that cannot be built)."""
    try:
        return _run(args)
    except PosencError as e:
        print(f"posenc inspect: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    # imported here, not at the top: `posenc --help` and `posenc inspect --help` need no torch
    from .report import RENDERERS, gallery, inspect

    if args.all and args.name:
        raise ConfigError("give either an encoding NAME or --all, not both")
    if not args.all and not args.name:
        raise ConfigError("give an encoding NAME (see `posenc list`) or --all")
    formats = tuple(dict.fromkeys(args.image_format or FORMATS))
    sizes = dict(dim=args.dim, length=args.length, heads=args.heads)
    if args.all:
        if args.option:
            raise ConfigError("--option applies to one encoding; it cannot be used with --all")
        out = Path(args.out or DEFAULT_OUT)
        reports = gallery(
            out,
            formats=formats,
            pictures=not args.no_plots,
            progress=lambda n: print(f"inspecting {n}", file=sys.stderr),
            **sizes,
        )
        if args.format == "json":
            import json

            print(json.dumps([r.as_dict() for r in reports], indent=2, default=str))
        else:
            print((out / "comparison.md").read_text())
        print(f"wrote {out / 'index.md'}, {out / 'index.html'} and the pictures of {len(reports)} encodings")
        return 0
    from ..schedule import is_schedule_text

    if is_schedule_text(args.name):
        return _run_schedule(args, formats, sizes)
    options = _parse_options(args.option)
    out = None if args.no_plots else Path(args.out or Path(DEFAULT_OUT) / args.name)
    report, pictures = inspect(args.name, out, options=options or None, formats=formats, strict=True, **sizes)
    print(RENDERERS[args.format](report))
    if out is not None and args.format == "text":
        drawn = [n for n, v in pictures.items() if isinstance(v, list)]
        print(f"\n  pictures ({', '.join(drawn) or 'none'}) and card.md / card.html written to {out}")
    return 0


def _run_schedule(args: argparse.Namespace, formats: tuple[str, ...], sizes: dict[str, int]) -> int:
    """``posenc inspect SCHEDULE``: the card of each distinct encoding (with its options) of the schedule's pattern,
    headed by the layers that have it and their spans (a span is a mask on top of the encoding's scores: the cards
    measure the encoding itself). Pictures go to ``OUT/<k>-<name>``; ``--format json`` prints one list."""
    import json
    import re

    from ..schedule import Schedule
    from .report import RENDERERS, inspect

    if args.option:
        raise ConfigError(
            "--option goes with one encoding; in a schedule each layer carries its own options: "
            "'rope(base=500000.0)@w64*3+nope'"
        )
    sched = Schedule.parse(args.name)
    groups: list[tuple[Any, list[int]]] = []
    for i, spec in enumerate(sched.layers):
        for first, layers in groups:
            if first.same_encoding(spec):
                layers.append(i)
                break
        else:
            groups.append((spec, [i]))
    root = Path(args.out or Path(DEFAULT_OUT) / re.sub(r"[^A-Za-z0-9._-]+", "_", str(sched)))
    cards: list[dict[str, Any]] = []
    for k, (spec, layers) in enumerate(groups):
        spans = sorted({str(sched.layers[i].span) or "global" for i in layers})
        where = f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))} of {str(sched)!r}"
        out = None if args.no_plots else root / f"{k}-{spec.name}"
        report, pictures = inspect(
            spec.name, out, options=spec.built_options() or None, formats=formats, strict=True, **sizes
        )
        if args.format == "json":
            cards.append({"layers": layers, "spans": spans, "encoding": str(spec), "card": report.as_dict()})
            continue
        print(f"== {where}: {spec.name} (span: {', '.join(spans)}) ==")
        print(RENDERERS[args.format](report))
        if out is not None and args.format == "text":
            drawn = [n for n, v in pictures.items() if isinstance(v, list)]
            print(f"\n  pictures ({', '.join(drawn) or 'none'}) and card.md / card.html written to {out}\n")
    if args.format == "json":
        print(json.dumps({"schedule": str(sched), "encodings": cards}, indent=2, default=str))
    return 0
