"""posenc on a GPU: one training step of a :class:`posenc.LanguageModel` per encoding and length, in bf16, with
flex_attention (a score_mod from the encoding's forms), with SDPA and the encoding's dense ``[B, H, L, L]`` bias
(what the peer libraries do), and the ``none`` model on SDPA's flash kernel; time and peak memory as ratios to
``none`` in one run.

    .venv/bin/python benchmarks/bench_gpu.py                       # on a CUDA machine (benchmarks/gpu.sh runs it)
    .venv/bin/python benchmarks/bench_gpu.py --dry-run             # builds every case tiny, on the CPU; runs nothing
    .venv/bin/python benchmarks/bench_gpu.py --lengths 4096 16384 --encodings alibi t5 --budget 300

Each case builds the model once, runs ``--warmup`` steps (the first compiles flex_attention for that shape) and
times ``--steps`` steps with CUDA events (the median), reading ``torch.cuda.max_memory_allocated`` after a reset. A
case that runs out of memory says so in its row (the dense bias at 32k does: 2 × 8 heads × 32k² × 2 bytes per
layer). Cases are run shortest first; past ``--budget`` seconds the rest are named as cut, not run. Prints one
Markdown table (and, with ``--json``, one JSON line per case).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

ENCODINGS = ("alibi", "t5", "kerple-log", "fire", "dynamic-bias", "relative-key", "transformer-xl", "deberta")
LENGTHS = (4096, 16384, 32768)
#: the variants of each encoding: flex (the plan's choice on CUDA), and SDPA with the dense bias (flex turned off)
VARIANTS = ("flex", "dense")


@dataclass
class Case:
    encoding: str
    variant: str  # "flex", "dense" or "flash" (the none model)
    length: int


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_gpu.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="build every case tiny on the CPU, run nothing on CUDA")
    p.add_argument("--encodings", nargs="+", default=list(ENCODINGS), help="encodings (default: %(default)s)")
    p.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS), help="lengths (default: %(default)s)")
    p.add_argument("--d-model", type=int, default=512, help="model width (default 512)")
    p.add_argument("--n-layers", type=int, default=2, help="layers (default 2)")
    p.add_argument("--n-heads", type=int, default=8, help="heads (default 8)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary (default 1024)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per case (default 2)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per case (default 5)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all cases; the rest are cut (default 480)")
    p.add_argument("--json", action="store_true", help="one JSON line per case before the table")
    args = p.parse_args(argv)
    for key in ("d_model", "n_layers", "n_heads", "vocab", "steps"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if any(n < 2 for n in args.lengths):
        p.error(f"--lengths must be >= 2, got {args.lengths}")
    from posenc.registry import available

    known = set(available())
    unknown = [e for e in args.encodings if e not in known]
    if unknown:
        p.error(f"unknown encodings {unknown}; `posenc list` shows the names")
    return args


def cases(args: argparse.Namespace) -> list[Case]:
    """Shortest first: ``none`` on flash, then each encoding's variants, at each length."""
    out = []
    for n in sorted(args.lengths):
        out.append(Case("none", "flash", n))
        out += [Case(e, v, n) for e in args.encodings for v in VARIANTS]
    return out


def build(case: Case, args: argparse.Namespace, device: str, dtype: Any) -> Any:
    import posenc

    path = "flex" if case.variant == "flex" and device == "cpu" else "auto"
    model = posenc.LanguageModel(
        args.vocab, encoding=case.encoding, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
        max_len=case.length, path=path,
    )
    return model.to(device=device, dtype=dtype)


def _flex_off(off: bool) -> Any:
    """Turn the plan's flex rule off (the dense variant: SDPA with the bias as its mask) or back on."""
    from posenc.attention import plan

    if not hasattr(_flex_off, "default"):
        _flex_off.default = plan.FLEX_MIN_PAIRS  # type: ignore[attr-defined]
    plan.FLEX_MIN_PAIRS = 1 << 62 if off else _flex_off.default  # type: ignore[attr-defined]


def run_case(case: Case, args: argparse.Namespace, device: str) -> dict[str, Any]:
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    _flex_off(case.variant == "dense")
    model = build(case, args, device, dtype)
    tokens = torch.randint(0, args.vocab, (1, case.length), device=device)
    plans: set[str] = set()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if device == "cpu":  # the dry run: flex has no backward on CPU, so a forward only
            with torch.no_grad():
                model(tokens)
        else:
            model.loss(tokens).backward()
        for block in model.trunk.blocks:
            plan = getattr(block.attn, "last_plan", None)
            if plan is not None:
                plans.add(plan.kernel)

    row: dict[str, Any] = {"encoding": case.encoding, "variant": case.variant, "length": case.length}
    try:
        for _ in range(args.warmup):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args.steps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            row.update(seconds=statistics.median(times), peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        else:
            step()
            row.update(seconds=None, peak_gib=None)
    except torch.OutOfMemoryError:
        row.update(seconds=None, peak_gib=None, error="out of memory")
    finally:
        _flex_off(False)
    row["kernels"] = sorted(plans)
    return row


def table(rows: list[dict[str, Any]], cut: list[Case]) -> str:
    base = {r["length"]: r for r in rows if r["variant"] == "flash" and r.get("seconds")}
    lines = [
        "| encoding | variant | L | kernels | step (s) | × none | peak GiB | × none |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base.get(r["length"])
        t, m = r.get("seconds"), r.get("peak_gib")
        rt = f"{t / b['seconds']:.2f}" if t and b else "–"
        rm = f"{m / b['peak_gib']:.2f}" if m and b else "–"
        ts = f"{t:.4f}" if t else r.get("error", "–")
        ms = f"{m:.2f}" if m else "–"
        lines.append(
            f"| {r['encoding']} | {r['variant']} | {r['length']} | {', '.join(r['kernels']) or '–'} | {ts} | {rt} "
            f"| {ms} | {rm} |"
        )
    if cut:
        lines.append("")
        lines.append("Cut by --budget: " + ", ".join(f"{c.encoding}/{c.variant}@{c.length}" for c in cut))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    if args.dry_run:
        device = "cpu"
        args.lengths = [16]
        args.d_model, args.n_heads, args.n_layers, args.warmup, args.steps = 32, 4, 2, 0, 1
    elif not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA device here; --dry-run builds every case on the CPU", file=sys.stderr)
        return 2
    else:
        device = "cuda"
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows, cut = [], []
    start = time.monotonic()
    for case in cases(args):
        if time.monotonic() - start > args.budget:
            cut.append(case)
            continue
        row = run_case(case, args, device)
        rows.append(row)
        if device == "cuda":
            torch.cuda.empty_cache()  # the case's model is gone with run_case's frame
        if args.json:
            print(json.dumps(row), flush=True)
        elif not args.dry_run:
            print(f"# {case.encoding}/{case.variant}@{case.length}: {row.get('seconds')} s", flush=True)
    print(table(rows, cut))
    return 0


if __name__ == "__main__":
    sys.exit(main())
