"""What a schedule costs: a hybrid model's training and decoding step against the all-RoPE model, side by side.

The hybrid is issue 36's done-when model at benchmark size: ``rope@wW*3+nope`` (three RoPE layers attending within a
sliding window of W keys, then a global NoPE layer, repeated), against ``rope`` on every layer (global). Both are
:class:`posenc.LanguageModel` of the same sizes, built once in one process; the rounds interleave one step of each
(the order reversed every other round), so a slow spell of the machine hits both alike, and each ratio is the median
of the per-round ratios (hybrid / all-RoPE). Two kinds of step:

* ``train``: forward, cross-entropy and backward over ``batch × L`` tokens (the window is a boolean mask beside the
  causal one: SDPA with the mask, no materialised scores; the plan of every layer is printed);
* ``decode``: one token with a KV cache after a prompt of ``context`` tokens (the local layers' caches hold W - 1
  keys, the global layers' all of them: the hybrid reads fewer keys per step).

    .venv/bin/python benchmarks/bench_schedule.py                          # the full run (minutes)
    .venv/bin/python benchmarks/bench_schedule.py --quick                  # a smoke run (seconds)
    .venv/bin/python benchmarks/bench_schedule.py --length 4096 --context 16384 --window 1024 --threads 2

At one thread the times are the process's CPU seconds; at more, wall seconds. Prints a table (and, with
``--json``, the per-round seconds as one JSON line first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

FULL = dict(length=2048, context=8192, window=512, rounds=7, decode_steps=32, d_model=512, n_layers=8, n_heads=8)
QUICK = dict(length=64, context=96, window=16, rounds=2, decode_steps=4, d_model=32, n_layers=4, n_heads=4)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_schedule.py",
        description="A hybrid schedule (rope@wW*3+nope) against all-RoPE: training and decoding steps, interleaved.",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, two rounds: a smoke run in seconds")
    p.add_argument("--length", type=int, help=f"training length L (default {FULL['length']})")
    p.add_argument("--context", type=int, help=f"decoding: prompt tokens in the cache (default {FULL['context']})")
    p.add_argument("--window", type=int, help=f"the RoPE layers' sliding window W (default {FULL['window']})")
    p.add_argument("--rounds", type=int, help=f"interleaved rounds (default {FULL['rounds']})")
    p.add_argument("--decode-steps", type=int, help=f"decoding steps timed per round (default {FULL['decode_steps']})")
    p.add_argument("--d-model", type=int, help=f"model width (default {FULL['d_model']})")
    p.add_argument("--n-layers", type=int, help=f"layers, a multiple of 4 (default {FULL['n_layers']})")
    p.add_argument("--n-heads", type=int, help=f"attention heads (default {FULL['n_heads']})")
    p.add_argument("--batch", type=int, default=2, help="training batch (default 2)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", action="store_true", help="print the per-round seconds as one JSON line first")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("length", "context", "window", "rounds", "decode_steps", "d_model", "n_layers", "n_heads", "batch"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.n_layers % 4:
        p.error(f"--n-layers must be a multiple of 4 (the pattern rope*3+nope), got {args.n_layers}")
    if args.d_model % args.n_heads:
        p.error(f"--d-model {args.d_model} must be divisible by --n-heads {args.n_heads}")
    return args


def run(args: argparse.Namespace) -> dict:
    """The per-round seconds of each step of each model: ``{"train": {model: [...]}, "decode": {...}}``."""
    import torch
    import torch.nn.functional as F

    import posenc

    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    schedules = {"hybrid": f"rope@w{args.window}*3+nope", "all-rope": "rope"}
    models = {}
    for name, encoding in schedules.items():
        torch.manual_seed(0)
        models[name] = posenc.LanguageModel(
            args.vocab,
            encoding=encoding,
            d_model=args.d_model,
            n_layers=args.n_layers,
            n_heads=args.n_heads,
            max_len=max(args.length, args.context + args.rounds * args.decode_steps + 8),
        )
    torch.manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.length))
    targets = torch.randint(0, args.vocab, (args.batch, args.length))
    prompt = torch.randint(0, args.vocab, (1, args.context))

    def train_step(name: str) -> float:
        model = models[name].train()
        t0 = clock()
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        for p in model.parameters():
            p.grad = None
        return clock() - t0

    caches: dict[str, posenc.KVCache] = {}
    last: dict[str, torch.Tensor] = {}

    def decode_steps(name: str) -> float:
        model = models[name].eval()
        with torch.no_grad():
            if name not in caches:  # the prompt once (not timed)
                caches[name] = posenc.KVCache()
                last[name] = model(prompt, kv_cache=caches[name])[:, -1:].argmax(-1)
            t0 = clock()
            for _ in range(args.decode_steps):
                last[name] = model(last[name], kv_cache=caches[name])[:, -1:].argmax(-1)
            return (clock() - t0) / args.decode_steps

    names = list(models)
    for name in names:  # warm-up: the allocator's first growth, the caches' prompts
        train_step(name)
        decode_steps(name)
    plans = {n: [b.attn.last_plan.kernel if b.attn.last_plan else "?" for b in models[n].trunk.blocks] for n in names}
    times: dict[str, dict[str, list[float]]] = {"train": {n: [] for n in names}, "decode": {n: [] for n in names}}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times["train"][name].append(train_step(name))
            times["decode"][name].append(decode_steps(name))
        load.append(os.getloadavg()[0])
        print(
            f"round {r + 1}/{args.rounds}: "
            + "  ".join(
                f"{n} train {times['train'][n][-1]:.3f}s decode {1e3 * times['decode'][n][-1]:.2f}ms" for n in names
            ),
            file=sys.stderr,
            flush=True,
        )
    held = {n: [caches[n].cached(i) for i in range(args.n_layers)] for n in names}
    return {
        "schedules": schedules,
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "clock": "cpu" if args.threads == 1 else "wall",
        "load": load,
        "times": times,
        "plans": plans,
        "cached_keys": held,
    }


def table(result: dict) -> str:
    """The side-by-side table: median seconds of each step, and the median of the per-round ratios."""
    names = list(result["schedules"])
    a, b = names
    lines = [
        f"hybrid = {result['schedules'][a]}, all-rope = {result['schedules'][b]}; "
        f"L={result['args']['length']}, context={result['args']['context']}, {result['args']['n_layers']} layers, "
        f"d={result['args']['d_model']}, {result['args']['threads']} thread(s), {result['clock']} time, "
        f"{result['args']['rounds']} rounds",
        "",
        f"| step | {a} | {b} | {a} / {b} (median of rounds) | fastest {a} / fastest {b} |",
        "|---|---|---|---|---|",
    ]
    for step, unit, scale in (("train", "s", 1.0), ("decode", "ms", 1e3)):
        ta, tb = result["times"][step][a], result["times"][step][b]
        ratio = statistics.median(x / y for x, y in zip(ta, tb))
        lines.append(
            f"| {step} | {scale * statistics.median(ta):.3f} {unit} | {scale * statistics.median(tb):.3f} {unit} | "
            f"{ratio:.2f}x | {min(ta) / min(tb):.2f}x |"
        )
    lines += ["", "kernels (train, per layer): " + "; ".join(f"{n}: {', '.join(result['plans'][n])}" for n in names)]
    lines.append("keys held per layer after decoding: " + "; ".join(f"{n}: {result['cached_keys'][n]}" for n in names))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
