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

import json
import os
import statistics
import sys


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    bench = os.environ.get("BENCH_DIR", here)
    sys.path[:0] = [bench, here]
    import torch
    from harness import timed

    if os.path.exists(os.path.join(bench, "model_cases.py")):
        from model_cases import decoder
    else:  # a checkout from before the harness: the loop was bench_models._decoder
        from bench_models import _decoder as decoder

    context, encs = int(sys.argv[1]), sys.argv[2].split(",")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else 1
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
