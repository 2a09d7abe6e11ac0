#!/usr/bin/env python
"""Stretch a small Llama's context with each RoPE scaling, through posenc.hf.

1. Train a Llama-config model (transformers' ``LlamaForCausalLM``, random init, no download) on Shakespeare's
   characters at a short length with plain RoPE.
2. Patch it with each RoPE scaling (``posenc.hf.patch(model, "rope-yarn", factor=...)`` ...) and measure the
   perplexity on held-out text at the trained length and beyond, without any further training.
3. Fine-tune each patched model for a few steps at a longer length, and measure again.

Prints a table of perplexity against length and writes ``results.json`` and ``perplexity.png`` to ``--out``.
The defaults run in a few minutes on 2 CPU cores; ``--quick`` is a smoke test of seconds.

    python examples/hf_context_extension.py --out hf-extension
    python examples/hf_context_extension.py --quick --out /tmp/hf-quick

Needs ``transformers`` and matplotlib (``pip install -c constraints.txt -e '.[hf,plots]'``) and the Shakespeare
data set (``bash scripts/install_data.sh``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import posenc.hf
from posenc.data.lm import load_shakespeare

SCALINGS = ["rope-linear", "rope-ntk", "rope-dynamic", "rope-yarn", "rope-llama3"]


def encode(text: str, index: dict[str, int]) -> torch.Tensor:
    unk = index.get(" ", 0)
    return torch.from_numpy(np.fromiter((index.get(c, unk) for c in text), dtype=np.int64, count=len(text)))


def batches(data: torch.Tensor, length: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, data.numel() - length - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + length + 1] for s in starts.tolist()])
        yield x[:, :-1], x[:, 1:]


def train(model, data: torch.Tensor, length: int, steps: int, batch: int, lr: float, seed: int, label: str) -> list:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    curve, t0 = [], time.perf_counter()
    for step, (x, y) in zip(range(steps), batches(data, length, batch, gen)):
        for g in opt.param_groups:  # linear warm-up over the first 10%, then cosine to 10%
            warm = max(1, steps // 10)
            g["lr"] = lr * min(1.0, (step + 1) / warm) * (0.55 + 0.45 * math.cos(math.pi * step / steps))
        loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        curve.append(loss.item())
        if (step + 1) % max(1, steps // 5) == 0 or step + 1 == steps:
            print(f"  {label}: step {step + 1}/{steps}  loss {loss.item():.3f}  ({time.perf_counter() - t0:.0f} s)")
    model.eval()
    return curve


@torch.no_grad()
def perplexity(model, data: torch.Tensor, length: int, tokens: int) -> float:
    """exp(mean next-character NLL) over non-overlapping windows of ``length`` (about ``tokens`` predictions)."""
    model.eval()
    n = max(1, min(tokens // length, (data.numel() - 1) // length))
    nll, count = 0.0, 0
    for i in range(0, n, 8):
        rows = torch.stack([data[j * length : j * length + length + 1] for j in range(i, min(n, i + 8))])
        logits = model(rows[:, :-1]).logits
        nll += float(F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum"))
        count += rows[:, 1:].numel()
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-len", type=int, default=64, help="the length the model is trained at (default 64)")
    ap.add_argument("--lengths", type=int, nargs="+", help="evaluation lengths (default: 1, 2, 4 and 8 x train-len)")
    ap.add_argument("--factor", type=float, default=4.0, help="the scaling factor of every RoPE scaling (default 4)")
    ap.add_argument("--steps", type=int, default=1500, help="training steps at train-len (default 1500)")
    ap.add_argument("--finetune-steps", type=int, default=100, help="fine-tuning steps per scaling (default 100)")
    ap.add_argument("--finetune-len", type=int, help="fine-tuning length (default: factor x train-len)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--eval-tokens", type=int, default=32768, help="predictions per perplexity (default 32768)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smoke test: tiny model, a few steps")
    ap.add_argument("--out", type=Path, default=Path("hf-extension"), help="output folder (default hf-extension)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.finetune_steps, args.eval_tokens, args.batch = 20, 4, 2048, 8
    lengths = args.lengths or [args.train_len * k for k in (1, 2, 4, 8)]
    ft_len = args.finetune_len or int(args.train_len * args.factor)

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    data = load_shakespeare()
    chars = sorted(set(data.train))
    index = {c: i for i, c in enumerate(chars)}
    train_ids, valid_ids = encode(data.train, index), encode(data.valid, index)
    width = 64 if args.quick else 128
    config = LlamaConfig(
        vocab_size=len(chars),
        hidden_size=width,
        intermediate_size=int(width * 8 / 3),
        num_hidden_layers=2 if args.quick else 4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=args.train_len,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    print(f"Llama {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {len(chars)} characters; "
          f"training at L={args.train_len} for {args.steps} steps")
    curve = train(model, train_ids, args.train_len, args.steps, args.batch, 3e-3, args.seed, "rope")

    results: dict = {"settings": {**vars(args), "out": str(args.out), "lengths": lengths, "finetune_len": ft_len},
                     "curve": curve, "rows": []}

    def measure(label: str, m, fine_tuned: bool) -> None:
        ppl = {L: perplexity(m, valid_ids, L, args.eval_tokens) for L in lengths}
        results["rows"].append({"method": label, "fine_tuned": fine_tuned, "perplexity": ppl})
        print(f"  {label:<14} {'fine-tuned' if fine_tuned else 'as trained':<11} "
              + "  ".join(f"L={L}: {p:7.2f}" for L, p in ppl.items()))

    print("perplexity on held-out text (characters):")
    measure("rope", model, False)
    for name in SCALINGS:
        patched = posenc.hf.patch(copy.deepcopy(model), name, factor=args.factor)
        measure(name, patched, False)
    print(f"fine-tuning each for {args.finetune_steps} steps at L={ft_len}:")
    for name in ["rope", *SCALINGS]:
        m = copy.deepcopy(model)
        if name != "rope":
            posenc.hf.patch(m, name, factor=args.factor)
        train(m, train_ids, ft_len, args.finetune_steps, max(1, args.batch * args.train_len // ft_len), 1e-3,
              args.seed + 1, name)
        measure(name, m, True)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "perplexity.png", args.train_len, ft_len)
    print(f"wrote {args.out / 'results.json'} and {args.out / 'perplexity.png'}")


def plot(results: dict, path: Path, train_len: int, ft_len: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    names = ["rope", *SCALINGS]
    colours = dict(zip(names, plt.get_cmap("tab10").colors))
    markers = dict(zip(names, "osD^vP"))
    for ax, tuned in zip(axes, (False, True)):
        for row in results["rows"]:
            if row["fine_tuned"] != tuned:
                continue
            xs = [int(k) for k in row["perplexity"]]
            ax.plot(xs, list(row["perplexity"].values()), marker=markers[row["method"]],
                    color=colours[row["method"]], label=row["method"])
        for at, what in [(train_len, "trained"), *([(ft_len, "fine-tuned")] if tuned else [])]:
            ax.axvline(at, color="0.6", ls=":", lw=1)
            ax.text(at, 0.98, f" {what}", transform=ax.get_xaxis_transform(), va="top", fontsize=8, color="0.4")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 4, 6)))
        ax.yaxis.set_minor_locator(LogLocator(subs=()))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("evaluation length (characters)")
        ax.set_title("fine-tuned briefly at the longer length" if tuned else "as trained (no fine-tuning)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("perplexity per character (log scale)")
    axes[1].legend(fontsize=8)
    fig.suptitle("A small Llama trained at a short length, its RoPE scaled by posenc.hf.patch")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
