"""``posenc export``: load a model, patch it with a RoPE scaling and write it in a runtime's own format
(:func:`posenc.hf.export`). Only argparse at import: ``posenc export --help`` does not import torch."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .errors import ConfigError
from .settings import key_value

DESCRIPTION = """\
Load a model (a packaged name such as smollm2-135m, a transformers folder or a .gguf file, as posenc.hf.load_pretrained
does), patch it with --encoding and its options, and write it with its tokenizer in a runtime's own format:
--format transformers (default) writes a folder whose config.json says the patch in transformers' native
rope_parameters, which stock transformers loads without posenc; --format gguf writes a llama.cpp file.
A patch no native config expresses (alibi, t5, fire, trained parameters) is refused: posenc.hf.save_pretrained keeps
posenc's own format.
"""

EPILOG = """\
examples:
  posenc export smollm2-135m /tmp/smol-yarn --encoding rope-yarn --factor 2
  posenc export smollm2-135m /tmp/smol-ntk --encoding rope-ntk --factor 4
  posenc export ./my-model /tmp/my-yarn --encoding rope-yarn --factor 4 --option beta_fast=16 --max-length 32768
  posenc export smollm2-135m /tmp/smol-yarn.gguf --encoding rope-yarn --factor 2 --format gguf
"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "export",
        help="write a model patched with a RoPE scaling as a native transformers folder (or GGUF)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", metavar="SOURCE", help="a packaged model name, a transformers folder or a .gguf file")
    p.add_argument("folder", metavar="FOLDER", help="where to write (a folder; the .gguf file for --format gguf)")
    p.add_argument(
        "--encoding",
        required=True,
        metavar="NAME",
        help="the RoPE scaling to patch in: rope (with --option base=...), rope-ntk, rope-linear, rope-dynamic, "
        "rope-yarn, rope-llama3, rope-longrope",
    )
    p.add_argument("--factor", type=float, metavar="S", help="the scaling's factor (new length / trained length)")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another option of the encoding (repeatable; the value is read as JSON, else as text): beta_fast=16",
    )
    p.add_argument("--format", choices=("transformers", "gguf"), default="transformers", help="default transformers")
    p.add_argument(
        "--max-length", type=int, metavar="N", help="max_position_embeddings of the export (default: factor × trained)"
    )
    p.set_defaults(func=run)
    return p


def parse_options(items: list[str]) -> dict[str, Any]:
    """``--option KEY=VALUE`` items as a dict (values as JSON where they parse, else text)."""
    return dict(key_value(item, "--option", "--option beta_fast=16") for item in items)


def options_for(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    """The encoding's options: ``--factor`` and ``--option``; LongRoPE without its factor lists gets posenc extend's
    (short factors 1, long factors YaRN's per-pair ones: :func:`posenc.extend.runner.scaling_options`)."""
    options = parse_options(args.option)
    if args.factor is not None:
        if "factor" in options:
            raise ConfigError("the factor is given twice (--factor and --option factor=...): give it once")
        options["factor"] = args.factor
    if args.encoding == "rope-longrope" and "long_factor" not in options and "factor" in options:
        from .extend.runner import scaling_options

        filled = scaling_options("rope-longrope", model, float(options["factor"]))
        options = {**filled, **options}
    return options


def run(args: argparse.Namespace) -> int:
    from . import _cards

    _cards.check_encodings([args.encoding], "--encoding")
    if args.max_length is not None and args.max_length <= 0:
        raise ConfigError(f"--max-length must be a positive number of tokens, got {args.max_length}")
    parse_options(args.option)  # a malformed --option before the model loads

    import posenc.hf

    model, tokenizer = posenc.hf.load_pretrained(args.source)
    posenc.hf.patch(model, args.encoding, **options_for(args, model))
    out = posenc.hf.export(model, args.folder, format=args.format, tokenizer=tokenizer, max_length=args.max_length)
    params = posenc.hf.native_rope_parameters(model)
    print(f"wrote {out} ({args.format}): rope_parameters {json.dumps(params)}")
    return 0
