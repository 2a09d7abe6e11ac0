"""Addition diagnosis runs (docs/diagnosis-kazemnejad.md, section "addition"): train_seq's loop on the
`addition` task with knobs, and a periodic evaluation at one length (greedy exact sums, digit accuracy,
teacher-forced digit accuracy) plus the training loss split into answer digits and hint tokens.

Run from the repository root:
    DIAG_OUT=dir OMP_NUM_THREADS=1 .venv/bin/python docs/diagnosis-kazemnejad/addition_exp.py --tag T [options]
--offset fixed: hints start at h_0 in every example (s = 0) instead of a random offset;
--loss digits: the loss is taken on the answer digits only (the hints stay teacher-forced inputs;
greedy decoding then copies the hints from the reference, so the score measures the digits alone)."""

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
from posenc.bench.tasks import arithmetic as ar

p = argparse.ArgumentParser()
p.add_argument("--enc", default="rope")
p.add_argument("--steps", type=int, default=2000)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--d", type=int, default=64)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--train", default="1,8")
p.add_argument("--test", default="8")
p.add_argument("--hints", type=int, default=0, help="number of hint tokens (0: the task's automatic choice)")
p.add_argument("--offset", default="random", choices=["random", "fixed"])
p.add_argument("--loss", default="all", choices=["all", "digits"])
p.add_argument("--every", type=int, default=250)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--tag", required=True)
a = p.parse_args()
torch.manual_seed(a.seed)
rng = random.Random(a.seed)
task = get_task("addition")
cfg = RunConfig(
    task="addition",
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
    task_options={"hints": a.hints},
)
task.validate(cfg)
opts = task.eval_options(cfg)
if a.offset == "fixed":
    # the task draws a, b (2n calls of rng.randrange), then s: answer 0 for that call only
    orig = task.example

    def example(n, r, o):
        calls = {"k": 0}
        real = r.randrange

        def rr(*args):
            calls["k"] += 1
            return 0 if calls["k"] == 2 * n + 1 else real(*args)

        r.randrange = rr
        try:
            return orig(n, r, o)
        finally:
            del r.randrange

    task.example = example


def is_digit(t):
    return ar.DIGIT0 <= t < ar.DIGIT0 + 10


longest = max(max(cfg.test_lengths), cfg.train_lengths[1])
max_len = max(task.max_total(n, opts) for n in {longest, *cfg.test_lengths}) + 1
model = st.build_model(cfg, task.vocab_size(opts), max_len)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.steps, pct_start=0.1)
evals = {n: task.make(128, (n, n), st.eval_rng(a.seed, n), opts) for n in cfg.test_lengths}
for exs in evals.values():  # the checks of the task itself: every target decodes to a + b
    for inp, out in exs:
        i = inp.index(ar.PLUS)
        assert ar.decode_number(inp[:i]) + ar.decode_number(inp[i + 1 :]) == ar.decode_number(out)
curve, accs = [], []
ema = {"all": None, "digits": None, "hints": None}
t0 = time.perf_counter()
c0 = time.process_time()


@torch.no_grad()
def greedy_digits(exs):
    """Greedy decoding; with --loss digits the hint tokens are forced to the reference ones."""
    if a.loss == "all":
        return st.predict(model, "decoder", exs)
    model.eval()
    prompts = torch.tensor([[st.BOS] + i + [st.SEP] for i, _ in exs])
    seq = prompts
    outs = [[] for _ in exs]
    for j in range(len(exs[0][1])):
        nxt = model(seq)[:, -1].argmax(-1)
        ref = torch.tensor([o[j] for _, o in exs])
        if not is_digit(exs[0][1][j]):
            nxt = ref
        for r in range(len(exs)):
            outs[r].append(int(nxt[r]))
        seq = torch.cat([seq, nxt[:, None]], 1)
    return outs


def evaluate(step):
    row = {"step": step, "s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1)}
    for n, ex in evals.items():
        w, t = st.score(ex, greedy_digits(ex), task)
        row[str(n)] = w
        row[f"{n}_digit"] = t
        with torch.no_grad():
            model.eval()
            tk, mk, tg = st.decoder_batch(ex)
            pr = model(tk, attention_mask=mk).argmax(-1)
            dig = (tg >= ar.DIGIT0) & (tg < ar.DIGIT0 + 10)
            row[f"{n}_tf_digit"] = (pr == tg)[dig].float().mean().item()
    model.train()
    accs.append(row)
    print(row, {k: round(v, 3) for k, v in ema.items()}, flush=True)


model.train()
for step in range(1, a.steps + 1):
    tokens, mask, targets = st.decoder_batch(task.make(a.batch, cfg.train_lengths, rng, opts))
    logits = model(tokens, attention_mask=mask)
    per = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="none"
    )
    tg = targets.reshape(-1)
    dig = (tg >= ar.DIGIT0) & (tg < ar.DIGIT0 + 10)
    hint = tg >= ar.HINT0
    parts = {"all": per[tg != -100].mean(), "digits": per[dig].mean(), "hints": per[hint].mean()}
    loss = parts[a.loss]
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    for k, v in parts.items():
        ema[k] = v.item() if ema[k] is None else 0.9 * ema[k] + 0.1 * v.item()
    if step % 25 == 0:
        curve.append([step, ema["all"], ema["digits"], ema["hints"]])
    if step % a.every == 0 or step == a.steps:
        evaluate(step)
out = dict(
    args=vars(a),
    curve=curve,
    accs=accs,
    seconds=round(time.perf_counter() - t0, 1),
    cpu_seconds=round(time.process_time() - c0, 1),
)
json.dump(out, open(os.path.join(os.environ.get("DIAG_OUT", "."), f"{a.tag}.json"), "w"))
print("done", a.tag, out["seconds"])
