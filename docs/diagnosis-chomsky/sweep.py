"""Sweep for docs/diagnosis-chomsky.md: train like posenc.bench.seq_training.train_seq, evaluate at L=16
with the randomized encodings' at_eval 'ordinary' (0..N-1) and 'random' (sampled, as in training)."""

import json
import random
import sys
import time

import torch
import torch.nn.functional as F

from posenc.bench.api import get_task
from posenc.bench.runner import RunConfig
from posenc.bench.seq_training import build_model, encoder_batch, eval_rng, predict, score
from posenc.bench.steps import one_cycle, optimise

torch.set_num_threads(1)


def run(task_name, enc, seed, steps=500, lr=3e-3, n_layers=2, n_heads=4, rml=None, test=64, bs=32, evals=256):
    opts_enc = {"random_max_len": rml} if (rml and enc.startswith("randomized")) else {}
    cfg = RunConfig(
        task=task_name,
        encoding=enc,
        seed=seed,
        train_lengths=(2 if task_name == "even-pairs" else 1, 16),
        test_lengths=(16,),
        steps=steps,
        batch_size=bs,
        n_layers=n_layers,
        n_heads=n_heads,
        lr=lr,
        eval_samples=evals,
        model="encoder",
        encoding_options=opts_enc,
    )
    task = get_task(task_name)
    opts = task.options(cfg)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    max_len = task.max_total(test, opts)
    model = build_model(cfg, task.vocab_size(opts), max_len)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def loss_at(step):
        tokens, mask, targets = encoder_batch(task.make(bs, cfg.train_lengths, rng, opts))
        logits = model(tokens, attention_mask=mask)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)

    t0 = time.time()
    curve, train_s = optimise(model, opt, one_cycle(opt, lr, steps), steps, loss_at)
    ex = task.make(evals, (16, 16), eval_rng(seed, 16), opts)
    out = {}
    encm = model.trunk.encoding if hasattr(model, "trunk") else None
    encm = next((m for m in model.modules() if hasattr(m, "at_eval")), None)
    modes = ["ordinary", "random"] if encm is not None else ["-"]
    for mode in modes:
        if encm is not None:
            encm.at_eval = mode
        torch.manual_seed(1234)
        w, t = score(ex, predict(model, "encoder", ex), task)
        out[mode] = (round(100 * w, 1), round(100 * t, 1))
    rec = dict(
        task=task_name,
        enc=enc,
        seed=seed,
        steps=steps,
        lr=lr,
        layers=n_layers,
        heads=n_heads,
        M=(encm.max_len if encm is not None else None),
        acc16=out,
        final_loss=round(curve[-1][1], 3),
        curve=curve,
        seconds=round(time.time() - t0, 1),
        load=open("/proc/loadavg").read().split()[0],
    )
    print(json.dumps({k: v for k, v in rec.items() if k != "curve"}), flush=True)
    with open("/tmp/chs/results.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        kw = json.loads(spec)
        run(**kw)
