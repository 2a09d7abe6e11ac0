"""The training step of the offset-table family (issue 49) against ``none``, in one interleaved run, before and after
the native fused kernel (:mod:`posenc.native.offset_table`).

Every model is posenc's 2-layer LanguageModel of ``bench_models.py`` (``model_cases.posenc_model``: d 512, 8 heads,
batch 2, causal) and is built once. Each encoding is measured twice in the same process: with the native kernel
(``native``, key terms included: :data:`posenc.native.offset_table.KEY_TERMS`) and with it switched off (``blocked``:
:func:`posenc.fused.relative_attention`'s PyTorch blocks, the path before it), by flipping
:data:`posenc.native.offset_table.ENABLED` around its steps. The rounds interleave one
training step (forward, cross-entropy, backward) of every (encoding, variant), the order reversed every other round,
so a slow spell of the shared machine hits them all; the time ratio of each to ``none`` is the median of the
per-round ratios. At one thread the times are the process's CPU seconds. After the timed rounds, one profiled step of
each gives the allocator's peak above the level at its start (``harness.profiled_peak``: torch's own allocations,
which is where the kernels' buffers come from), and its ratio to ``none``'s.

    nice -n 10 env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_offset_table.py --lengths 1024 2048 \
        --rounds 3 --tag offset-table-t1

Writes ``results/<tag>.json`` (every step's seconds, the peaks) and ``results/<tag>.md`` (the tables).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import harness
from model_cases import posenc_model

ENCODINGS = ["shaw", "nezha", "relative-key", "relative-key-query", "deberta", "tener", "transformer-xl", "xlnet"]
# the targets: (time, memory) ratio to none
TARGETS = {
    "relative-key": (1.2, 1.3),
    "shaw": (1.2, 1.3),
    "relative-key-query": (1.45, 1.3),
    "deberta": (1.45, 1.3),
}


def _switch():
    """The module whose ``ENABLED`` turns the native kernel on and off (``None`` where this posenc has none)."""
    try:
        from posenc.native import offset_table
    except ImportError:
        return None
    return offset_table


def measure(encodings: list[str], L: int, rounds: int, threads: int, vocab: int, batch: int, variants: list[str]):
    """Every case's step seconds per round and its allocator peak: ``{"seconds": {case: [...]}, "peak_MB": ...}``."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    torch.manual_seed(0)
    tokens, targets = torch.randint(0, vocab, (batch, L)), torch.randint(0, vocab, (batch, L))
    encodings = list(dict.fromkeys(["none", *encodings]))
    models = {e: posenc_model("lm", e, L, vocab).train() for e in encodings}
    switch = _switch()
    cases = [("none", "native")] + [(e, v) for e in encodings if e != "none" for v in variants]

    def name(case: tuple[str, str]) -> str:
        return case[0] if case[0] == "none" else f"{case[0]}:{case[1]}"

    def step(case: tuple[str, str]) -> float:
        e, variant = case
        if switch is not None:  # native: every form the kernel takes, key terms included
            switch.ENABLED = switch.KEY_TERMS = variant == "native"
        model = models[e]
        t0 = clock()
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        for p in model.parameters():
            p.grad = None
        return clock() - t0

    load = [os.getloadavg()[0]]
    for c in cases:  # warm-up: native builds, kept tables, the allocator's first growth
        step(c)
        print(f"L={L} warm-up {name(c)}", flush=True)
    times: dict[str, list[float]] = {name(c): [] for c in cases}
    for r in range(rounds):
        for c in cases if r % 2 == 0 else cases[::-1]:
            times[name(c)].append(step(c))
        load.append(os.getloadavg()[0])
        print(f"L={L} round {r + 1}/{rounds}: " + " ".join(f"{name(c)} {times[name(c)][-1]:.2f}" for c in cases))
    peaks = {name(c): harness.profiled_peak(lambda c=c: step(c)) / 2**20 for c in cases}
    if switch is not None:
        switch.ENABLED, switch.KEY_TERMS = True, True  # the defaults
    clock_name = "cpu" if threads == 1 else "wall"
    return {"L": L, "threads": threads, "clock": clock_name, "load": load, "seconds": times, "peak_MB": peaks}


def table(run: dict) -> str:
    """Per case: step seconds (median), × none (median of the per-round ratios, and each round's), peak MB and
    × none, and the issue's target where it has one (✗ where missed)."""
    secs, peaks = run["seconds"], run["peak_MB"]
    base = secs["none"]
    lines = [
        f"L = {run['L']}, {run['threads']} thread(s), {run['clock']} seconds, {len(base)} rounds, "
        f"load {min(run['load']):.1f}-{max(run['load']):.1f}",
        "",
        "| encoding | path | step s | × none | per round | peak MB | memory × none | target (time, memory) |",
        "|---|---|---:|---:|---|---:|---:|---|",
    ]
    for case, xs in secs.items():
        enc, _, path = case.partition(":")
        ratios = [a / b for a, b in zip(xs, base)]
        ratio = statistics.median(ratios)
        mem = peaks[case] / max(peaks["none"], 1e-9)
        target = TARGETS.get(enc)
        mark = ""
        if target is not None:
            miss = ratio > target[0] or mem > target[1]
            mark = f"≤ {target[0]}×, ≤ {target[1]}×" + (" ✗" if miss else " ✓")
        per = " / ".join(f"{x:.2f}" for x in ratios)
        lines.append(
            f"| {enc} | {path or '—'} | {statistics.median(xs):.2f} | {ratio:.3f} | {per} | {peaks[case]:.0f} | "
            f"{mem:.2f} | {mark} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encodings", nargs="+", default=ENCODINGS, help="posenc encodings (none is added)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048], help="sequence lengths (1024 2048)")
    ap.add_argument("--rounds", type=int, default=3, help="timed steps per case (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary (default 1024, as the floors' runs)")
    ap.add_argument("--batch", type=int, default=2, help="batch (default 2)")
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["blocked", "native"],
        choices=["blocked", "native"],
        help="paths measured per encoding: blocked (the kernel off: PyTorch blocks) and native (default both)",
    )
    ap.add_argument("--tag", default="", help="results/<tag>.json and .md (default offset-table-<time>)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if _switch() is None:
        args.variants = ["blocked"]
    tag = args.tag or time.strftime("offset-table-%Y%m%d-%H%M")
    runs, text = [], []
    for L in args.lengths:
        run = measure(args.encodings, L, args.rounds, args.threads, args.vocab, args.batch, args.variants)
        runs.append(run)
        text.append(table(run))
        print("\n" + text[-1], flush=True)
        harness.write_runs(tag, vars(args), runs, text)


if __name__ == "__main__":
    main()
