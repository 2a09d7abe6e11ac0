"""Diagnosis runs (docs/diagnosis-kazemnejad.md): train_seq's loop with knobs and periodic in-distribution evaluation.

Run from the repository root:
    DIAG_OUT=dir OMP_NUM_THREADS=1 .venv/bin/python docs/diagnosis-kazemnejad/exp.py --tag T [options]
--bos 1 prepends a BOS token to the input (the loop now does this itself, so with the current loop
--bos 0 reproduces the fixed format and --bos 1 adds a second one)."""

import argparse
import json
import os
import random
import time

import torch
import torch.nn.functional as F

from posenc.bench import seq_training as st
from posenc.bench.api import get_task
from posenc.bench.runner import RunConfig

p = argparse.ArgumentParser()
p.add_argument("--enc", default="nope")
p.add_argument("--task", default="copy")
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--d", type=int, default=64)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--bos", type=int, default=0, help="prepend this many BOS tokens (id 2) to the input")
p.add_argument("--sched", default="onecycle")
p.add_argument("--every", type=int, default=100)
p.add_argument("--train", default="1,20")
p.add_argument("--symbols", type=int, default=10)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--tag", required=True)
p.add_argument("--test", default="20")
a = p.parse_args()
torch.manual_seed(a.seed)
rng = random.Random(a.seed)
task = get_task(a.task)
cfg = RunConfig(
    task=a.task,
    encoding=a.enc,
    seed=a.seed,
    train_lengths=tuple(map(int, a.train.split(","))),
    test_lengths=tuple(map(int, a.test.split(","))),
    steps=a.steps,
    batch_size=a.batch,
    d_model=a.d,
    n_layers=a.layers,
    n_heads=a.heads,
    lr=a.lr,
    model="decoder",
    task_options={"symbols": a.symbols} if a.task in ("copy", "reverse") else {},
)
opts = task.options(cfg)


def fmt(exs):
    return [([2] * a.bos + i, o) for i, o in exs]


longest = max(max(cfg.test_lengths), cfg.train_lengths[1])
max_len = max(task.max_total(n, opts) for n in {longest, *cfg.test_lengths}) + a.bos
model = st.build_model(cfg, task.vocab_size(opts), max_len)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
sched = (
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.steps, pct_start=0.1)
    if a.sched == "onecycle"
    else None
)
evals = {n: fmt(task.make(128, (n, n), st.eval_rng(a.seed, n), opts)) for n in cfg.test_lengths}
curve, accs, running = [], [], 0.0
t0 = time.perf_counter()


def evaluate(step):
    row = {"step": step}
    for n, ex in evals.items():
        w, t = st.score(ex, st.predict(model, "decoder", ex), task)
        row[str(n)] = w
        row[f"{n}_token"] = t
        with torch.no_grad():
            model.eval()
            tk, mk, tg = st.decoder_batch(ex)
            pr = model(tk, attention_mask=mk).argmax(-1)
            ok = (pr == tg)[tg != -100].float().view(len(ex), -1)
            row[f"{n}_tf"] = ok.mean().item()
            row[f"{n}_tf_pos"] = [round(v, 3) for v in ok.mean(0).tolist()]
    model.train()
    accs.append(row)
    print({k: v for k, v in row.items() if not k.endswith("_pos")}, round(time.perf_counter() - t0), flush=True)


model.train()
for step in range(1, a.steps + 1):
    tokens, mask, targets = st.decoder_batch(fmt(task.make(a.batch, cfg.train_lengths, rng, opts)))
    logits = model(tokens, attention_mask=mask)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if sched:
        sched.step()
    v = loss.item()
    running = v if step == 1 else 0.9 * running + 0.1 * v
    if step % 25 == 0:
        curve.append([step, running])
    if step % a.every == 0 or step == a.steps:
        evaluate(step)
out = dict(args=vars(a), curve=curve, accs=accs, seconds=round(time.perf_counter() - t0, 1))
# T5's learned bias table (one scalar per head and distance bucket): how far did training move it?
for name, prm in model.named_parameters():
    if "relative_attention_bias" in name:
        out["t5_bias"] = [[round(v, 3) for v in row] for row in prm.detach().t().tolist()]
        print("t5 bias by head (buckets 0..):", out["t5_bias"])
json.dump(out, open(os.path.join(os.environ.get("DIAG_OUT", "."), f"{a.tag}.json"), "w"))
print("done", a.tag, out["seconds"])
