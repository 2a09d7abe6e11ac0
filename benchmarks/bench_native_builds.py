"""The native kernels' builds against each other: time of each kernel with each build, in one process, interleaved.

    .venv/bin/python benchmarks/bench_native_builds.py [--repeats 7] [--threads 1]

Builds: ``baseline`` (portable: the compiler's default target), the build this CPU's flags pick (``avx2`` or
``avx512``), and ``old`` -- the flags posenc used before the portable builds (``-O3 -march=native``, the compiler
free to fuse multiply-adds). Each repeat times every kernel with every build in turn (the order rotating), so
load changes hit all builds alike; the table gives the median time per kernel and build (CPU time of the thread
with ``--threads 1``, else wall time) and its ratio to the build this CPU picks (the host build).
The builds must also agree: the outputs of the portable builds are compared bit for bit and the script stops if
they differ.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from posenc import native


def load_builds() -> dict[str, object]:
    cc = native._compiler()  # noqa: SLF001
    if cc is None:
        raise SystemExit("no C compiler: nothing to compare")
    names = ["baseline"] + [n for n in native.supported_isas() if n != "baseline"][:1]
    libs = {}
    for name in names:
        path, why = native._compile(cc, name)  # noqa: SLF001
        if path is None:
            raise SystemExit(why)
        libs[name] = native._load(path)  # noqa: SLF001
    tmp = Path(tempfile.mkdtemp())
    (tmp / "k.c").write_text(native._SOURCE)  # noqa: SLF001
    old = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c99"]
    subprocess.run([cc, *old, "-o", str(tmp / "old.so"), str(tmp / "k.c")], check=True)
    libs["old"] = native._load(tmp / "old.so")  # noqa: SLF001
    return libs


def cases() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1024, 8, 64, generator=g).transpose(1, 2)  # [B, H, L, d] view of a projection: 8 MiB
    ang = torch.rand(1, 1, 1024, 32, generator=g) * 100
    c, s = ang.cos(), ang.sin()
    x64, c64, s64 = x[:, :, :256].double(), c[:, :, :256].double(), s[:, :, :256].double()
    knots = torch.sort(torch.randn(12, generator=g)).values
    rel = torch.rand(1024, 1024, generator=g) * 4 - 2
    slope, inter = torch.randn(13, 8, generator=g), torch.randn(13, 8, generator=g)
    xg = rel.clone().requires_grad_()
    q = torch.randn(8, 8, 64, generator=g)
    k, v = torch.randn(2, 8, 8, 2048, 64, generator=g)
    tab, idx = torch.randn(4096, 8, 64, generator=g), torch.randint(0, 4096, (2048,), generator=g)

    def fire_fwd_bwd():
        out = native.fire_bias(xg, knots, slope, inter)
        (gx,) = torch.autograd.grad(out.sum(), xg)
        return torch.cat([out.reshape(-1), gx.reshape(-1)])

    return {
        "rope half (4x8x1024x64 f32)": lambda: native.rope_rotate(x, c, s, 64, False),
        "rope interleaved": lambda: native.rope_rotate(x, c, s, 64, True),
        "rope half, float64 (L 256)": lambda: native.rope_rotate(x64, c64, s64, 64, False),
        "fire forward (8x1024x1024)": lambda: native.fire_bias(rel, knots, slope, inter),
        "fire forward + backward": fire_fwd_bwd,
        "decode, key table (8x8x2048x64)": lambda: native.decode_attention(q, k, v, 0.125, key_table=(tab, idx)),
        "rows_dot (8x8x2048x64)": lambda: native.rows_dot(k, tab, idx),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # one thread: the calling thread's CPU time (what another process on the core does not change); else wall time
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    libs = load_builds()
    work = cases()
    names = list(libs)
    times: dict[tuple[str, str], list[float]] = {(c, n): [] for c in work for n in names}
    outs: dict[tuple[str, str], bytes] = {}
    for r in range(args.repeats):
        for case, fn in work.items():
            for n in names[r % len(names) :] + names[: r % len(names)]:
                native._state["lib"] = libs[n]  # noqa: SLF001
                t = clock()
                out = fn()
                times[case, n].append(clock() - t)
                if r == 0:
                    outs[case, n] = out.detach().contiguous().numpy().tobytes()
    portable = [n for n in names if n != "old"]
    host = portable[-1]
    for case in work:
        if any(outs[case, n] != outs[case, portable[0]] for n in portable):
            raise SystemExit(f"{case}: the portable builds give different bits")
    load = os.getloadavg()[0]
    print(f"load: {load:.2f}, threads {args.threads}, {args.repeats} repeats, median ms (ratio to {host})", flush=True)
    print(f"| kernel | {' | '.join(names)} |")
    print(f"|---|{'---|' * len(names)}")
    for case in work:
        ref = statistics.median(times[case, host])
        cells = [
            f"{statistics.median(times[case, n]) * 1e3:.2f} ({statistics.median(times[case, n]) / ref:.2f}×)"
            for n in names
        ]
        print(f"| {case} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
