"""Training steps of several encodings in one process, interleaved, against each encoding's floor.

``bench_models.py run`` measures each case in a fresh process, one after the other: on a shared machine whose speed
drifts over the half hour a round takes (this benchmark's machine was 25 % slower one afternoon than that morning,
with nothing else of ours running), the ``none`` case measured first is then the wrong floor for the last case.
Here every model is built once and the rounds interleave one training step of each (the order reversed every other
round), so a slow spell hits every encoding alike; the ratio of each encoding to ``none`` is the median of the
per-round ratios. The models are ``bench_models.py``'s (``model_cases.posenc_model``: the 2-layer LanguageModel,
d 512, 8 heads, batch 2) and each encoding's floor is ``floors.floor`` (its declared extra FLOPs over the model's).
Peak memory is not measured here (one process holds every model): ``bench_models.py run`` measures it per process.

    .venv/bin/python benchmarks/train_interleaved.py --lengths 4096 --rounds 3 --tag train-interleaved-4096-t1
    .venv/bin/python benchmarks/train_interleaved.py --lengths 2048 --threads 2 --encodings none rope t5 deberta

At one thread the times are the process's CPU seconds (what other processes on the machine move least); at more,
wall seconds. Writes ``results/<tag>.json`` (every step's seconds) and ``results/<tag>.md`` (the table), and prints
the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import harness
from floors import TIME_TARGET, Step, floor
from model_cases import DEFAULT_ENCODINGS, posenc_model


def measure(encodings: list[str], L: int, rounds: int, threads: int, vocab: int, batch: int) -> dict:
    """Every encoding's step seconds per round (``{encoding: [s, ...]}``) and the load average around them."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    torch.manual_seed(0)
    tokens, targets = torch.randint(0, vocab, (batch, L)), torch.randint(0, vocab, (batch, L))
    models = {e: posenc_model("lm", e, L, vocab).train() for e in encodings}

    def step(e: str) -> float:
        model = models[e]
        t0 = clock()
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        for p in model.parameters():
            p.grad = None
        return clock() - t0

    load = [os.getloadavg()[0]]
    for e in encodings:  # warm-up: native builds, kept tables, the allocator's first growth
        step(e)
        print(f"L={L} warm-up {e}", flush=True)
    times: dict[str, list[float]] = {e: [] for e in encodings}
    for r in range(rounds):
        for e in encodings if r % 2 == 0 else encodings[::-1]:
            times[e].append(step(e))
        load.append(os.getloadavg()[0])
        print(f"L={L} round {r + 1}/{rounds}: " + " ".join(f"{e} {times[e][-1]:.2f}" for e in encodings), flush=True)
    return {"L": L, "threads": threads, "clock": "cpu" if threads == 1 else "wall", "load": load, "seconds": times}


def table(run: dict, vocab: int, batch: int) -> str:
    """Per encoding: floor, step seconds (median), × none (median of the per-round ratios) / floor, and × none from
    each model's fastest step / floor (contention on a shared machine only slows a step: the fastest steps are the
    estimate other tenants move least, the per-round ratios show the spread). ✗ where a ratio / floor > 1.10."""
    secs = run["seconds"]
    base = secs.get("none")
    lines = [
        f"L = {run['L']}, {run['threads']} thread(s), {run['clock']} seconds, {len(next(iter(secs.values())))} "
        f"rounds, load {min(run['load']):.1f}-{max(run['load']):.1f}",
        "",
        "| encoding | floor | step s | × none (per round) | × none | measured / floor | fastest × none "
        "| fastest / floor |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for e, xs in secs.items():
        f = floor(e, Step("lm", run["L"], batch, vocab))
        if base:
            ratios = [a / b for a, b in zip(xs, base)]
            ratio = statistics.median(ratios)
            per = " / ".join(f"{x:.2f}" for x in ratios)
            fast = min(xs) / min(base)
            mark, fmark = (" ✗" if x / f > TIME_TARGET else "" for x in (ratio, fast))
            med = statistics.median(xs)
            lines.append(
                f"| {e} | {f:.3f} | {med:.2f} | {per} | {ratio:.3f} | {ratio / f:.3f}{mark} | {fast:.3f} | "
                f"{fast / f:.3f}{fmark} |"
            )
        else:
            lines.append(f"| {e} | {f:.3f} | {statistics.median(xs):.2f} | | | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encodings", nargs="+", default=DEFAULT_ENCODINGS, help="posenc encodings (none is added)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096], help="sequence lengths (default 2048 4096)")
    ap.add_argument("--rounds", type=int, default=3, help="timed steps per encoding (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary (default 1024, as the floors' runs)")
    ap.add_argument("--batch", type=int, default=2, help="batch (default 2)")
    ap.add_argument("--tag", default="", help="results/<tag>.json and .md (default train-interleaved-<time>)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    encodings = list(dict.fromkeys(["none", *args.encodings]))
    tag = args.tag or time.strftime("train-interleaved-%Y%m%d-%H%M")
    runs, text = [], []
    for L in args.lengths:
        run = measure(encodings, L, args.rounds, args.threads, args.vocab, args.batch)
        runs.append(run)
        text.append(table(run, args.vocab, args.batch))
        print("\n" + text[-1], flush=True)
        harness.write_runs(tag, vars(args), runs, text)


if __name__ == "__main__":
    main()
