"""One MR run of the complex-order set-up with knobs the suite does not expose (docs/diagnosis-complex-order.md).

    OMP_NUM_THREADS=1 python docs/diagnosis-complex-order/exp.py NAME --encoding sinusoidal --steps 400 --lr 1e-3

Trains through the harness's own task (``posenc.bench.tasks.text.MRTask.run``) with a ``RunConfig``; ``--scale``
overrides the model's ``embedding_scale`` (default: the encoding's), ``--warmup`` the one-cycle warm-up share
(default 0.1, as ``posenc.bench.steps.one_cycle``). Appends one JSON line (metrics, final loss, curve, wall and
CPU seconds) to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch

import posenc.bench.real_training as rt
import posenc.bench.tasks.text as text
from posenc.bench.api import get_task
from posenc.bench.runner import RunConfig

p = argparse.ArgumentParser()
p.add_argument("name")
p.add_argument("--encoding", default="sinusoidal")
p.add_argument("--task", default="mr")
p.add_argument("--steps", type=int, default=400)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--d", type=int, default=256)
p.add_argument("--heads", type=int, default=8)
p.add_argument("--d-ff", type=int, default=512)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--scale", choices=("default", "on", "off"), default="default")
p.add_argument("--warmup", type=float, default=0.1)
p.add_argument("--out", default="/tmp/co/sweep.jsonl")
a = p.parse_args()

if a.scale != "default":
    text.SequenceClassifier = functools.partial(text.SequenceClassifier, embedding_scale=a.scale == "on")
if a.warmup != 0.1:

    def one_cycle(opt, lr, steps):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=a.warmup)

    rt.one_cycle = one_cycle

cfg = RunConfig(
    task=a.task,
    encoding=a.encoding,
    seed=a.seed,
    steps=a.steps,
    batch_size=a.batch,
    d_model=a.d,
    n_layers=1,
    n_heads=a.heads,
    d_ff=a.d_ff,
    lr=a.lr,
    model="encoder",
)
t0, c0 = time.perf_counter(), time.process_time()
out = get_task(a.task).run(cfg)
row = dict(
    name=a.name,
    **{k: v for k, v in vars(a).items() if k not in ("name", "out")},
    metrics=out["metrics"],
    final_loss=out["curve"][-1][1],
    train_seconds=out["train_seconds"],
    seconds=round(time.perf_counter() - t0, 1),
    cpu_seconds=round(time.process_time() - c0, 1),
    curve=out["curve"],
    threads=torch.get_num_threads(),
)
print(json.dumps({k: v for k, v in row.items() if k != "curve"}))
print("curve", [(s, round(v, 3)) for s, v in out["curve"]])
with open(a.out, "a") as f:
    f.write(json.dumps(row) + "\n")
