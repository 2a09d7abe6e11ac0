"""The whole compile matrix of issue 48: ``model.forward = torch.compile(model.forward)`` then ``generate()``, for
every encoding that acts in posenc's attention on a patched transformers model, on a tiny Llama, Gemma 3 (sliding
and full layers) and Llama 4 text (chunked attention), with no cache, a dynamic, a static and a sliding-window
cache: whether the generated tokens equal eager's, and the graph breaks (``torch._dynamo`` counters, backend
``eager``, one left-padded row, 3 new tokens; the models and the prompt of tests/test_hf_compile_cache.py, whose
representative cases run in the test suite).

Each case is written to the JSON file as soon as it is done (a run cut short resumes where it stopped), and a
markdown table of the results beside it.

    nice -n 10 .venv/bin/python benchmarks/compile_matrix.py          # about 30 min on 2 loaded cores
    .venv/bin/python benchmarks/compile_matrix.py --families llama --encodings alibi t5   # a quick look
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

FAMILIES = ("llama", "gemma3", "llama4")
CACHES = (None, "dynamic", "static", "sliding_window")


def acting_encodings() -> list[str]:
    """The registered encodings that ``posenc.hf.patch`` puts into posenc's attention on a tiny Llama (the others
    run in transformers' own attention, or are refused there)."""
    import transformers as t
    from test_hf_compile_cache import DEC

    import posenc
    import posenc.hf as hf

    out = []
    for name in posenc.available():
        model = t.LlamaForCausalLM(t.LlamaConfig(**DEC, pad_token_id=0))
        try:
            hf.patch(model, name)
        except Exception:  # noqa: BLE001 -- refused on a Llama: not in the matrix
            continue
        if model.config._attn_implementation == hf.ATTENTION_NAME:
            out.append(name)
    return out


def one(family: str, name: str, cache: str | None) -> dict:
    from test_hf_compile_cache import _build, _generate

    import posenc.hf as hf

    model = _build(family)
    try:
        hf.patch(model, name)
    except Exception as err:  # noqa: BLE001 -- a family that refuses the encoding says why
        return {"status": "refused", "why": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    if model.config._attn_implementation != hf.ATTENTION_NAME:
        return {"status": "not in posenc's attention on this family"}
    try:
        want = _generate(model, cache)
    except Exception as err:  # noqa: BLE001 -- eager itself fails: a result of the matrix too
        return {"status": "eager fails", "why": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager_forward = model.forward
    model.forward = torch.compile(model.forward, backend="eager")
    try:
        got = _generate(model, cache)
    except Exception as err:  # noqa: BLE001 -- a crash is a result of the matrix
        return {
            "status": "crash",
            "why": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}",
            "where": traceback.format_exc().splitlines()[-3:],
        }
    finally:
        torch._dynamo.reset()
        model.forward = eager_forward
    breaks = Counter({k.split("\n")[0][:120]: v for k, v in torch._dynamo.utils.counters["graph_break"].items()})
    return {
        "status": "equal" if torch.equal(got, want) else "differs",
        "graph_breaks": sum(breaks.values()),
        "breaks": dict(breaks),
    }


def table(cells: dict) -> str:
    rows = [
        "| family | encoding | " + " | ".join(str(c or "no cache") for c in CACHES) + " |",
        "|---|---|" + "---|" * len(CACHES),
    ]
    keys = sorted({tuple(k.split("|")[:2]) for k in cells})
    for family, name in keys:
        line = []
        for cache in CACHES:
            r = cells.get(f"{family}|{name}|{cache}")
            if r is None:
                line.append("")
            elif r["status"] == "equal":
                line.append(f"= ({r['graph_breaks']})")
            else:
                line.append(r["status"])
        rows.append(f"| {family} | {name} | " + " | ".join(line) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--encodings", nargs="+", default=None, help="default: every encoding in posenc's attention")
    ap.add_argument("--out", default="benchmarks/results/compile-matrix.json")
    ap.add_argument("--report-only", action="store_true", help="only rewrite the markdown table from the JSON")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    names = args.encodings or acting_encodings()
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.is_file() else {"cells": {}}
    result.update(
        what="torch.compile(model.forward) + generate() against eager, per family, encoding and cache",
        command=result.get("command") if args.report_only and result.get("command") else
        "nice -n 10 .venv/bin/python benchmarks/compile_matrix.py " + " ".join(sys.argv[1:]),
        env={
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cpu": platform.processor() or platform.machine(),
        },
        legend="= (n): the compiled tokens equal eager's, with n graph breaks; differs / crash / refused",
    )
    cells = result["cells"]
    # the most used first, so that a run cut short has covered every encoding once: generate's default (dynamic)
    # on Llama, then each family's own cache (Gemma 3's sliding window, Llama 4's dynamic), then the rest
    first = [("llama", "dynamic"), ("gemma3", "sliding_window"), ("llama4", "dynamic"), ("llama", "static")]
    pairs = [p for p in first if p[0] in args.families]
    pairs += [(f, c) for f in args.families for c in CACHES if (f, c) not in pairs]
    todo = [(f, n, c) for f, c in pairs for n in names if f"{f}|{n}|{c}" not in cells]
    t0 = time.perf_counter()
    for i, (family, name, cache) in enumerate([] if args.report_only else todo):
        cells[f"{family}|{name}|{cache}"] = r = one(family, name, cache)
        print(
            f"[{i + 1}/{len(todo)} {time.perf_counter() - t0:.0f} s] {family} {name} {cache}: {r['status']}"
            + (f" ({r['graph_breaks']} graph breaks)" if "graph_breaks" in r else f" {r.get('why', '')}"),
            flush=True,
        )
        write(out, result, names, args.families)
    write(out, result, names, args.families)
    print(result["summary"])


def write(out: Path, result: dict, names: list[str], families: list[str]) -> None:
    """The JSON and the markdown table beside it, as far as the run got (a run cut short says how far)."""
    import transformers

    cells = result["cells"]
    planned = len(names) * len(families) * len(CACHES)
    counts = Counter(r["status"] for r in cells.values())
    result["summary"] = {**dict(counts), "cases run": len(cells), "cases planned": planned}
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(
        f"# Compile matrix\n\n{result['what']}; {result['legend']}; an empty cell: not run yet.\n\n"
        f"`{result['command']}` (torch {torch.__version__}, transformers {transformers.__version__}). "
        f"{len(cells)} of {planned} cases run: {dict(counts)}.\n\n" + table(cells) + "\n"
    )

if __name__ == "__main__":
    main()
