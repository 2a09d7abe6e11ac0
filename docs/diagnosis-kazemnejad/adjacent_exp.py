"""One run of the quick suite's `adjacent` task with some settings changed; appends a JSON row to OUT.

usage: OMP_NUM_THREADS=1 python adjacent_exp.py TAG ENCODING SEED [key=json-value ...]
e.g.   OMP_NUM_THREADS=1 python adjacent_exp.py bs128_400 sinusoidal 1 batch_size=128 steps=400
"""

import json
import os
import sys
import time

from posenc.bench.runner import RunConfig, run_one

OUT = os.environ.get("OUT", "adjacent-runs.jsonl")
tag, enc, seed, *kv = sys.argv[1:]
kw = {}
for s in kv:
    k, v = s.split("=")
    kw[k] = json.loads(v)
cfg = RunConfig(task="adjacent", encoding=enc, seed=int(seed), **kw)
t = time.perf_counter()
r = run_one(cfg)
dt = time.perf_counter() - t
m = r["metrics"]
c = r["curve"]
row = dict(
    tag=tag,
    enc=enc,
    seed=int(seed),
    kw=kw,
    acc={k: m[k] for k in ("16", "32", "64")},
    final=c[-1][1],
    curve=c,
    s=round(dt, 1),
    train_s=r["train_seconds"],
)
print(
    tag,
    enc,
    seed,
    kw,
    {k: round(v * 100, 1) for k, v in row["acc"].items()},
    f"loss {row['final']:.3f}",
    "s",
    row["s"],
    "curve",
    [(a, round(b, 3)) for a, b in c[::4]],
    flush=True,
)
open(OUT, "a").write(json.dumps(row) + "\n")
