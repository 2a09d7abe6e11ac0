"""KV-cache decoding of several encodings in one process, their steps interleaved.

Per-token CPU ms (median over the rounds) and the ratio to ``none`` measured under the same machine load
(``bench_models.py run --decode`` runs one process per case, minutes apart, which on a shared, loaded machine moves
the floor between cases). The models are those of ``bench_models.py`` (``model_cases.decoder``), the timed loop
the harness's (``harness.timed``: the rounds interleave the encodings' steps, every other round in reverse
order).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/decode_interleaved.py 4096 none,t5,deberta 20
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/decode_interleaved.py 4096 none,t5,deberta 20 2   # two threads

The fourth argument is the thread count (default 1): at one thread the times are CPU seconds (what a shared
machine's load moves least), at more the wall seconds of the step (CPU seconds would add up the threads).

Another checkout's code: ``BENCH_DIR=<checkout>/benchmarks PYTHONPATH=<checkout>/src``. Prints one JSON line, then
a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("context", type=int, help="tokens in the KV cache before the timed steps (e.g. 4096, 16384)")
    ap.add_argument("encodings", help="comma-separated posenc encodings, none first for the ratios (none,t5,deberta)")
    ap.add_argument("rounds", type=int, nargs="?", default=20, help="timed steps per encoding (default 20)")
    ap.add_argument("threads", type=int, nargs="?", default=1, help="torch threads (default 1)")
    args = ap.parse_args(argv)
    if args.context < 1 or args.rounds < 1 or args.threads < 1:
        ap.error(f"context, rounds and threads must be >= 1, got {args.context}, {args.rounds}, {args.threads}")
    return args


def main() -> None:
    args = _args()
    here = os.path.dirname(os.path.abspath(__file__))
    bench = os.environ.get("BENCH_DIR", here)
    sys.path[:0] = [bench, here]
    import torch
    from harness import timed

    if os.path.exists(os.path.join(bench, "model_cases.py")):
        from model_cases import decoder
    else:  # a checkout from before the harness: the loop was bench_models._decoder
        from bench_models import _decoder as decoder

    from posenc.registry import check_names

    context, encs, rounds, threads = args.context, args.encodings.split(","), args.rounds, args.threads
    check_names(encs, "decode_interleaved")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    ctx = torch.randint(0, 1024, (1, context))
    toks = torch.randint(0, 1024, (1, rounds + 10))
    steps = {}
    load0 = os.getloadavg()[0]
    with torch.no_grad():
        for e in encs:
            model, prefill, step = decoder(f"decode:posenc:{e}", context, rounds + 10, 1024)
            model.eval()
            prefill(ctx)
            for i in range(3):  # warm-up steps (a KV cache's first growth, kept tables)
                step(toks[:, i : i + 1])
            steps[e] = step
        # every other round in reverse order: a place in the round (what ran just before, the caches it left) hits
        # every encoding alike
        calls = (
            (e, lambda e=e, r=r: steps[e](toks[:, 3 + r : 4 + r]))
            for r in range(rounds)
            for e in (encs if r % 2 == 0 else encs[::-1])
        )
        got = timed(calls, threads=threads)
        times = got.cpu if threads == 1 else got.wall
    med = {e: 1e3 * statistics.median(times[e]) for e in encs}
    floor = med.get("none")
    ratio = {e: med[e] / floor for e in med} if floor else {}
    clock = "cpu" if threads == 1 else "wall"
    load = [load0, os.getloadavg()[0]]
    print(json.dumps({"C": context, "threads": threads, "clock": clock, "load": load, "ms": med, "ratio": ratio}))
    for e in encs:
        print(f"{e:20s} {med[e]:7.2f} ms" + (f"  {ratio[e]:.2f}x" if ratio else ""))


if __name__ == "__main__":
    main()
