"""What one attention layer's training step costs against PyTorch's own flash kernel, and what its extra products
cost at the speed this CPU multiplies: the measured side of the floors (issue 25).

``floors.py`` sets each encoding's floor in FLOPs. Two things a FLOP count does not say, measured here in one process
with every case interleaved (each case: one causal forward and backward of ``[B, H, L, d]`` attention, batch 2,
8 heads, head width 64, float32, the benchmark model's layer):

* **a bias is not free in a flash kernel**: ``flash + given bias`` is PyTorch's own fused CPU kernels (forward and
  backward) on blocks of query rows with an additive bias that costs nothing to make (a strided view of one number
  per offset, what ALiBi's is): the least a kernel built on them pays for reading a bias, against ``flash``
  (``scaled_dot_product_attention``, what the ``none`` model runs). posenc's ``offset-bias`` kernel follows, without
  and with the per-offset gradient a learned bias (T5, KERPLE) needs;
* **the relative family's products run in blocks**: ``relative: no term`` is posenc's blocked kernel with plain
  ``q·k`` (its own cost against flash's), then one query term (relative-key, TENER, Transformer-XL's ``W_kR R``
  term) and one key term (relative-key-query's, DeBERTa's p2c) over a table of one row per offset shared by the heads.
  Beside each: its **product floor**, ``flash`` plus the term's FLOPs (``2·d`` per causal pair for the forward,
  twice that for the backward: the declared ``Cost.pair`` times 3) at the rate this CPU multiplies a block of the
  kernel's shape (``[H, 128, d] × [d, L]``, measured here).

The last column is the model step this implies: ``1 + layers · (case − flash) / none's step`` (``none``'s step
measured in this process too, the benchmark model's), to set beside the measured ratios of ``train_interleaved.py``.

    .venv/bin/python benchmarks/attention_floor.py --lengths 2048 4096 --rounds 5 --tag attention-floor-t1

Writes ``results/<tag>.json`` and ``.md``; prints the table. CPU seconds at one thread, wall seconds at more; the
median over the rounds (the rounds interleave the cases).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import harness
from model_cases import DH, N_LAYERS, H

BLOCK = 128  # rows of the block the product rate is measured at (posenc.fused.BLOCK_ROWS)


def cases(L: int, batch: int, inputs: dict | None = None):
    """``{name: (fn, extra FLOPs or None)}``: each fn runs one forward and backward (``flash + given bias`` returns
    its ``dq, dk, dv``). ``inputs`` (a dict) receives ``q, k, v, do, alibi, scale`` for a test to check against."""
    import torch
    import torch.nn.functional as F

    from posenc.fused import RelativeForm, relative_attention
    from posenc.offset_bias import offset_bias_attention

    g = torch.Generator().manual_seed(0)
    shape = (batch, H, L, DH)
    q, k, v, do = (torch.randn(shape, generator=g) for _ in range(4))
    scale = DH**-0.5
    offsets = torch.arange(-(L - 1), L, dtype=torch.float32)
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)
    alibi = -slopes[:, None] * offsets.abs()  # [H, 2L - 1]: one number per offset and head
    table = torch.randn(2 * L - 1, 1, DH, generator=g) * 0.1  # one row per offset, shared by the heads
    if inputs is not None:
        inputs.update(q=q, k=k, v=v, do=do, alibi=alibi, scale=scale)
    pairs = batch * H * L * (L + 1) // 2
    term_flops = 3 * 2 * DH * pairs  # forward + backward (twice the forward): the declared pair cost, times 3
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def grads(*xs):
        return [x.detach().requires_grad_() for x in xs]

    def sdpa():
        qq, kk, vv = grads(q, k, v)
        F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).backward(do)

    def given_bias(rows: int = 256):
        # reversed query rows: the block's bias is a strided view of one vector (posenc.offset_bias's layout)
        vals = alibi.clone()
        vals[:, L:] = torch.finfo(vals.dtype).min  # causal: offsets past the diagonal
        view = vals.unfold(-1, L, 1)  # [H, L, L]: row r is the bias of query L - 1 - r
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for r0 in range(0, L, rows):
            r1 = min(L, r0 + rows)
            mask = view[None, :, L - r1 : L - r0, :r1]
            qb = q[:, :, r0:r1].flip(2)
            o, lse = flash(qb, k[:, :, :r1], v[:, :, :r1], 0.0, False, attn_mask=mask, scale=scale)
            gq, gk, gv = flash_back(
                do[:, :, r0:r1].flip(2), qb, k[:, :, :r1], v[:, :, :r1], o, lse, 0.0, False, attn_mask=mask, scale=scale
            )
            dq[:, :, r0:r1] = gq.flip(2)
            dk[:, :, :r1] += gk
            dv[:, :, :r1] += gv
        return dq, dk, dv

    def offset_bias(learned: bool):
        def run():
            qq, kk, vv = grads(q, k, v)
            vals = alibi.clone().requires_grad_(learned)
            offset_bias_attention(qq, kk, vv, vals, scale, causal=True).backward(do)

        return run

    def relative(term: str | None):
        def run():
            qq, kk, vv = grads(q, k, v)
            tab = table.clone().requires_grad_()
            form = RelativeForm(q=qq, k=kk)
            if term == "query":
                form.query_terms.append((qq, tab))
            elif term == "key":
                form.key_terms.append((kk, tab))
            relative_attention(form, vv, scale, causal=True).backward(do)

        return run

    return {
        "flash": (sdpa, None),
        "flash + given bias": (given_bias, None),
        "offset-bias": (offset_bias(False), None),
        "offset-bias, learned": (offset_bias(True), None),
        "relative: no term": (relative(None), None),
        "relative: query term": (relative("query"), term_flops),
        "relative: key term": (relative("key"), term_flops),
    }


def product_rate(L: int, clock) -> float:
    """FLOP/s of one ``[H, 128, d] × [d, L]`` batched product (the block shape of posenc's relative kernel)."""
    import torch

    x, y = torch.randn(H, BLOCK, DH), torch.randn(H, DH, L)
    out = torch.empty(H, BLOCK, L)
    n = max(3, int(2e9 / (2 * H * BLOCK * DH * L)))
    for _ in range(2):
        torch.bmm(x, y, out=out)
    t0 = clock()
    for _ in range(n):
        torch.bmm(x, y, out=out)
    return n * 2 * H * BLOCK * DH * L / (clock() - t0)


def pass_rate(L: int, clock) -> float:
    """Elements per second of one elementwise pass (``a += b``) over an ``[H, 128, L]`` float32 block, a bias add's
    pass over a block of posenc's kernels."""
    import torch

    a, b = torch.zeros(H, BLOCK, L), torch.randn(H, BLOCK, L)
    n = max(3, int(1e9 / a.numel()))
    for _ in range(2):
        a.add_(b)
    t0 = clock()
    for _ in range(n):
        a.add_(b)
    return n * a.numel() / (clock() - t0)


def none_step(L: int, batch: int, vocab: int, clock, steps: int) -> float:
    """Seconds of the ``none`` model's training step (the benchmark's model), the fastest of ``steps``."""
    import torch
    import torch.nn.functional as F
    from model_cases import posenc_model

    model = posenc_model("lm", "none", L, vocab).train()
    tokens, targets = torch.randint(0, vocab, (batch, L)), torch.randint(0, vocab, (batch, L))
    times = []
    for _ in range(steps + 1):
        t0 = clock()
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        times.append(clock() - t0)
        model.zero_grad(set_to_none=True)
    return min(times[1:])


def measure(L: int, rounds: int, threads: int, batch: int, vocab: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    runs = cases(L, batch)
    load = [os.getloadavg()[0]]
    for fn, _ in runs.values():  # warm-up
        fn()
    secs: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = clock()
            runs[name][0]()
            secs[name].append(clock() - t0)
        load.append(os.getloadavg()[0])
        print(f"L={L} round {r + 1}/{rounds}: " + " ".join(f"{n} {secs[n][-1]:.3f}" for n in names), flush=True)
    rate, passes = product_rate(L, clock), pass_rate(L, clock)
    step = none_step(L, batch, vocab, clock, steps=2)
    extra = {name: flops for name, (_, flops) in runs.items()}
    return {"L": L, "threads": threads, "batch": batch, "load": load, "seconds": secs, "extra_flops": extra,
            "product_rate": rate, "pass_rate": passes, "none_step_s": step}  # fmt: skip


def table(run: dict) -> str:
    secs, extra = run["seconds"], run["extra_flops"]
    flash = statistics.median(secs["flash"])
    rate, step = run["product_rate"], run["none_step_s"]
    pairs = run["batch"] * H * run["L"] * (run["L"] + 1) // 2
    one_pass = pairs / run["pass_rate"]  # one elementwise pass over every causal pair of a layer
    lines = [
        f"L = {run['L']}, batch {run['batch']}, {H} heads, d {DH}, causal, {run['threads']} thread(s), "
        f"{len(secs['flash'])} rounds, load {min(run['load']):.1f}-{max(run['load']):.1f}; products of the "
        f"kernel's block shape at {rate / 1e9:.0f} GFLOP/s; the none model's step {step:.2f} s; one elementwise pass "
        f"over a layer's causal pairs {one_pass:.3f} s (+{N_LAYERS * one_pass / step:.3f} on the model step)",
        "",
        "| case | fwd + bwd s | × flash | product floor s | × its floor | model step implied (× none) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, xs in secs.items():
        t = statistics.median(xs)
        floor_s = flash + extra[name] / rate if extra[name] else None
        fl = f"{floor_s:.3f} | {t / floor_s:.2f}" if floor_s else "| "
        implied = 1 + N_LAYERS * (t - flash) / step
        lines.append(f"| {name} | {t:.3f} | {t / flash:.2f} | {fl} | {implied:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048], help="sequence lengths (default 2048)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--batch", type=int, default=2, help="batch (default 2, the benchmark model's)")
    ap.add_argument("--vocab", type=int, default=1024, help="the none model's vocabulary (default 1024)")
    ap.add_argument("--tag", default="", help="results/<tag>.json and .md (default attention-floor-<time>)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    tag = args.tag or time.strftime("attention-floor-%Y%m%d-%H%M")
    runs, text = [], []
    for L in args.lengths:
        runs.append(measure(L, args.rounds, args.threads, args.batch, args.vocab))
        text.append(table(runs[-1]))
        print("\n" + text[-1], flush=True)
        harness.write_runs(tag, vars(args), runs, text)


if __name__ == "__main__":
    main()
