"""The learning-curve figure of docs/diagnosis-kazemnejad.md, section "The quick suite's `adjacent` task".

usage (from the repository root): .venv/bin/python docs/diagnosis-kazemnejad/adjacent_plot.py
reads docs/diagnosis-kazemnejad/adjacent-runs.jsonl (written by adjacent_exp.py)
"""

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).parent
rows = [json.loads(line) for line in (here / "adjacent-runs.jsonl").read_text().splitlines() if line]
pick = {
    "sinusoidal": [
        ("L2_300", 0, "batch 64, 300 steps (old quick suite)"),
        ("L2_800", 0, "batch 64, 800 steps"),
        ("L2_800", 1, "batch 64, 800 steps, seed 1"),
        ("bs128_400", 0, "batch 128, 400 steps (new)"),
        ("bs128_400", 1, "batch 128, 400 steps (new), seed 1"),
        ("bs256_600", 0, "batch 256, 600 steps"),
    ],
    "binary": [
        ("bs128_400", 0, "batch 128, 400 steps (new)"),
        ("bs128_400", 1, "batch 128, 400 steps (new), seed 1"),
        ("long_bs256_1200", 0, "batch 256, 1200 steps"),
    ],
}
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for ax, (enc, runs) in zip(axes, pick.items()):
    colours = {}
    for tag, seed, label in runs:
        colour = colours.setdefault(tag, f"C{len(colours)}" if tag != "L2_300" else "black")
        for r in rows:
            if r["tag"] == tag and r["enc"] == enc and r["seed"] == seed:
                ax.plot(
                    [s for s, _ in r["curve"]],
                    [v for _, v in r["curve"]],
                    label=label,
                    color=colour,
                    ls="--" if seed else "-",
                    lw=3 if tag == "L2_300" else 1.5,
                    marker="." if seed else None,
                )
    ax.axhline(math.log(2), color="grey", lw=0.8, ls=":")
    ax.text(ax.get_xlim()[1], math.log(2) + 0.015, "ln 2: a constant answer", ha="right", color="grey", fontsize=8)
    ax.set_title(f"adjacent, {enc} positions (2 layers, d 64)")
    ax.set_xlabel("step")
    ax.set_ylim(0, 0.8)
    ax.legend(fontsize=7, loc="lower left")
axes[0].set_ylabel("training loss (EMA 0.9, every 25 steps)")
fig.tight_layout()
fig.savefig(here / "adjacent-plateau.png", dpi=110)
