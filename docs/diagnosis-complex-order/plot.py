"""The learning-curve figure of docs/diagnosis-complex-order.md from the stored runs.

    python docs/diagnosis-complex-order/plot.py OLD_RESULTS.json HEAD_RESULTS.json SWEEP.jsonl OUT.png

OLD/HEAD_RESULTS.json: ``posenc bench`` results of the 400-step reproduction at commit 044036b and at HEAD;
SWEEP.jsonl: the lines written by exp.py.
"""

import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

old, head, sweep, out = sys.argv[1:5]
lines = []
for r in json.load(open(old))["runs"]:
    lines.append((f"{r['config']['encoding']}, commit 044036b (0.02 tokens)", r["curve"], "--"))
for r in json.load(open(head))["runs"]:
    lines.append((f"{r['config']['encoding']}, HEAD", r["curve"], "-"))
for line in open(sweep):
    r = json.loads(line)
    if r["name"] == "sin_scaleoff":
        lines.append(("sinusoidal, HEAD, embedding_scale=False", r["curve"], ":"))
    if r["name"] == "sin_scaleoff_lr2e-3":
        lines.append(("sinusoidal, HEAD, embedding_scale=False, lr 2e-3", r["curve"], ":"))
fig, ax = plt.subplots(figsize=(7, 4))
for label, curve, style in lines:
    ax.plot([s for s, _ in curve], [v for _, v in curve], style, marker=".", label=label)
ax.axhline(math.log(2), color="grey", lw=0.8)
ax.text(400, math.log(2) + 0.008, "ln 2 (constant prediction)", color="grey", fontsize=8, ha="right")
ax.set_xlabel("step")
ax.set_ylabel("training loss (EMA 0.9)")
ax.set_title("MR, 1 layer × 256 d × 8 heads, d_ff 512, lr 1e-3 (unless said), 400 steps, seed 0", fontsize=10)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(out, dpi=110)
