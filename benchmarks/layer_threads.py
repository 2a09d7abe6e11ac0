"""One attention layer of each encoding at one and at more threads: how far each kernel scales with threads.

A training step of the 2-layer model mixes what scales (the projections, the MLP, flash) with an encoding's kernel;
this measures the kernel's layer alone, as ``train_interleaved.py``'s models build it (``posenc.MultiHeadAttention``,
d_model 512, 8 heads, batch 2, causal; the encodings' options from ``attention_cases.ENC_OPTIONS``): forward and
backward of the layer, the fastest of ``--repeats`` steps at each thread count, every encoding's steps interleaved
within a thread count. Prints, per encoding, the kernel the plan took, the seconds at each thread count, the speedup
from the first count to the last, and the ratio to ``none`` at each count with its change (``Δ``): the layer-level
side of issue 25's "every ratio within +0.1 of its one-thread value".

    .venv/bin/python benchmarks/layer_threads.py --length 2048
    .venv/bin/python benchmarks/layer_threads.py --length 2048 --encodings cope relative-key-query --profile

``--profile`` prints torch.profiler's table of the most expensive ops (self time) of one step of each encoding at
the last thread count, with their call counts (an op count that does not shrink with threads shows as the part
of a step that does not scale). Times are wall seconds (two threads share the step). Writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from model_cases import DEFAULT_ENCODINGS  # noqa: E402  (after the path)


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--encodings", nargs="+", default=DEFAULT_ENCODINGS, help="posenc encodings (none is added; default: the 23 of "
        "the model benchmarks, one per distinct cost)"
    )
    ap.add_argument("--length", type=int, default=2048, help="sequence length (default 2048)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts (default 1 2)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per encoding and thread count (default 3)")
    ap.add_argument("--profile", action="store_true", help="print the top ops of one step at the last thread count")
    args = ap.parse_args(argv)
    if args.length < 2 or args.repeats < 1 or min(args.threads) < 1:
        ap.error("--length must be >= 2, --repeats and every --threads >= 1")
    if "none" not in args.encodings:
        args.encodings = ["none", *args.encodings]
    return args


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    import torch
    from attention_cases import ENC_OPTIONS

    import posenc
    from posenc.registry import build, check_names

    check_names(args.encodings, "layer_threads")
    b, h, d_model, length = 2, 8, 512, args.length
    dims = dict(d_model=d_model, n_heads=h, head_dim=d_model // h, max_len=length)
    torch.manual_seed(0)
    x = torch.randn(b, length, d_model)
    layers = {}
    for name in args.encodings:
        enc = None if name == "none" else build(name, dims=dims, options=ENC_OPTIONS.get(name))
        layers[name] = posenc.MultiHeadAttention(d_model, h, enc)

    def step(layer) -> None:
        layer(x.detach().requires_grad_(), causal=True).sum().backward()

    best: dict[tuple[str, int], float] = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for layer in layers.values():
            step(layer)  # warm-up at this count
        for r in range(args.repeats):
            for name in args.encodings if r % 2 == 0 else args.encodings[::-1]:
                t0 = time.perf_counter()
                step(layers[name])
                took = time.perf_counter() - t0
                best[(name, threads)] = min(took, best.get((name, threads), took))
        print(f"threads {threads}: done", file=sys.stderr)
    first, last = args.threads[0], args.threads[-1]
    head = " | ".join(f"{t} thr s" for t in args.threads) + " | " + " | ".join(f"× none {t} thr" for t in args.threads)
    shape = f"L = {length}, batch {b}, {h} heads, d_model {d_model}"
    print(f"{shape}, causal, forward + backward, the fastest of {args.repeats} steps (wall seconds)")
    print()
    print(f"| encoding | kernel | {head} | speedup {first}→{last} | Δ × none |")
    print("|---|---|" + "---:|" * (2 * len(args.threads) + 2))
    for name, layer in layers.items():
        secs = [best[(name, t)] for t in args.threads]
        ratios = [best[(name, t)] / best[("none", t)] for t in args.threads]
        kernel = layer.last_plan.kernel if layer.last_plan is not None else "?"
        cells = " | ".join(f"{s:.4f}" for s in secs) + " | " + " | ".join(f"{r:.2f}" for r in ratios)
        print(f"| {name} | {kernel} | {cells} | {secs[0] / secs[-1]:.2f} | {ratios[-1] - ratios[0]:+.2f} |")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        torch.set_num_threads(last)
        for name, layer in layers.items():
            step(layer)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(layer)
            print(f"\n{name}, {last} thread(s):")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
