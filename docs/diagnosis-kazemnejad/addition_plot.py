"""Learning curves of the addition diagnosis runs (addition_exp.py's JSON files in $DIAG_OUT)."""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

src = os.environ.get("DIAG_OUT", ".")
tags = sys.argv[2:]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
for tag in tags:
    d = json.load(open(os.path.join(src, f"{tag}.json")))
    st = [c[0] for c in d["curve"]]
    ax1.plot(st, [c[2] for c in d["curve"]], label=tag)
    ax2.plot(
        [r["step"] for r in d["accs"]], [100 * r[f"{d['args']['test']}_digit"] for r in d["accs"]], "o-", label=tag
    )
ax1.axhline(2.303, color="grey", ls=":", lw=1)
ax1.text(50, 2.33, "ln 10 (digits at chance)", fontsize=8, color="grey")
ax1.set_xlabel("step")
ax1.set_ylabel("training loss on answer digits (nats, EMA)")
ax1.set_title("addition, RoPE, operands of 1..4 digits")
ax2.axhline(10, color="grey", ls=":", lw=1)
ax2.set_xlabel("step")
ax2.set_ylabel("greedy digit accuracy at L = 4 (%)")
ax2.set_ylim(0, 100)
ax1.legend(fontsize=8)
ax2.legend(fontsize=8)
fig.tight_layout()
fig.savefig(sys.argv[1], dpi=100)
