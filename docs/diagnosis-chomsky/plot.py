"""Learning curves of the chomsky sweep (docs/diagnosis-chomsky.md) from results.jsonl."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

here = Path(__file__).parent
rows = [json.loads(line) for line in open(sys.argv[1] if len(sys.argv) > 1 else here / "results.jsonl")]
fig, ax = plt.subplots(figsize=(7.5, 4.5))
for r in rows:
    if r["task"] != "reverse" or r["seed"] != 0 or r["steps"] != 2000 or r["layers"] != 2 or r["lr"] != 0.003:
        continue
    label = r["enc"] + (f", M = {r['M']}" if r["M"] else "")
    acc = r["acc16"].get("random", r["acc16"].get("-"))
    steps, loss = zip(*r["curve"])
    ax.plot(steps, loss, label=f"{label}: {acc[0]:.0f}% exact at L=16")
ax.set_xlabel("step")
ax.set_ylabel("training loss (nats/output token, EMA)")
ax.set_title("reverse, 2 layers × 64 d × 4 heads, lr 3e-3, seed 0")
ax.set_ylim(0, 0.8)
ax.axhline(0.693, color="grey", lw=0.8, ls=":")
ax.text(50, 0.70, "chance (ln 2)", color="grey", fontsize=8)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(here / "reverse-random-range.png", dpi=110)
