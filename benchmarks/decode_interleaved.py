"""KV-cache decoding of several encodings in one process, their steps interleaved.

Per-token CPU ms (median over the rounds) and the ratio to ``none`` measured under the same machine load
(``bench_models.py run --decode`` runs one process per case, minutes apart, which on a shared, loaded machine moves
the floor between cases). The models are those of ``bench_models.py`` (its ``_decoder``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/decode_interleaved.py 4096 none,t5,deberta 20

Another checkout's code: ``BENCH_DIR=<checkout>/benchmarks PYTHONPATH=<checkout>/src``. Prints one JSON line, then
a table.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def main() -> None:
    sys.path.insert(0, os.environ.get("BENCH_DIR", os.path.dirname(os.path.abspath(__file__))))
    import torch
    from bench_models import _decoder

    torch.set_num_threads(1)
    context, encs = int(sys.argv[1]), sys.argv[2].split(",")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    torch.manual_seed(0)
    ctx = torch.randint(0, 1024, (1, context))
    toks = torch.randint(0, 1024, (1, rounds + 10))
    steps, times = {}, {}
    load0 = os.getloadavg()[0]
    with torch.no_grad():
        for e in encs:
            model, prefill, step = _decoder(f"decode:posenc:{e}", context, rounds + 10, 1024)
            model.eval()
            prefill(ctx)
            for i in range(3):  # warm-up steps (a KV cache's first growth, kept tables)
                step(toks[:, i : i + 1])
            steps[e], times[e] = step, []
        for r in range(rounds):
            for e in encs:
                p = time.process_time()
                steps[e](toks[:, 3 + r : 4 + r])
                times[e].append(time.process_time() - p)
    med = {e: 1e3 * statistics.median(v) for e, v in times.items()}
    floor = med.get("none")
    ratio = {e: med[e] / floor for e in med} if floor else {}
    print(json.dumps({"C": context, "load": [load0, os.getloadavg()[0]], "ms": med, "ratio": ratio}))
    for e in encs:
        print(f"{e:20s} {med[e]:7.2f} ms" + (f"  {ratio[e]:.2f}x" if ratio else ""))


if __name__ == "__main__":
    main()
