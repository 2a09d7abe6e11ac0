import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

out, title, tags = sys.argv[1], sys.argv[2], sys.argv[3:]
fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
for i, t in enumerate(tags):
    r = json.load(open(os.path.join(os.environ.get("DIAG_OUT", "."), f"{t}.json")))
    col = f"C{i}"
    c = r["curve"]
    ax[0].plot([x[0] for x in c], [x[1] for x in c], color=col, label=t)
    s = [a["step"] for a in r["accs"]]
    if "20_tf" in r["accs"][0]:
        ax[1].plot(s, [a["20_tf"] for a in r["accs"]], marker="o", color=col, label=f"{t} (teacher-forced)")
    ax[1].plot(s, [a["20_token"] for a in r["accs"]], marker="x", ls="--", color=col, label=f"{t} (greedy)")
    ax[2].plot(s, [a["20"] for a in r["accs"]], marker="o", color=col, label=t)
ax[0].set(title="training loss (answer tokens, EMA 0.9)", xlabel="step", yscale="log")
ax[1].set(title="L=20 token accuracy", xlabel="step", ylim=(0, 1.02))
ax[2].set(title="L=20 exact match (greedy)", xlabel="step", ylim=(0, 1.02))
for a in ax:
    a.grid(alpha=0.3)
ax[0].legend(fontsize=7)
ax[1].legend(fontsize=6)
fig.suptitle(title)
fig.tight_layout()
fig.savefig(out, dpi=80)
