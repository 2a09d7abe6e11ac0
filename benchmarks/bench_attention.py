#!/usr/bin/env python
"""Speed and memory of one attention layer: every posenc encoding beside its peers and the floor.

One *case* is one attention layer (projections included) run on ``x [B, L, D]``:

* ``floor``                 plain SDPA with q/k/v/o projections and no position at all;
* ``posenc:<name>``         :class:`posenc.attention.MultiHeadAttention` with that encoding (``path="fast"``);
* ``posenc-compiled:<name>`` the same, wrapped in ``torch.compile(fullgraph=True)``;
* ``peer:<id>``             the peer implementation of the same method (HF transformers 5.x, HF 4.57 in its own
                            environment, x-transformers, rotary-embedding-torch);
* ``apply:<id>``            RoPE *application* alone on q and k (``apply:copy`` clones q and k once: the
                            memory-bandwidth floor).

Every (case, L, round) runs in a fresh process (so one case's allocator state never leaks into the next), with
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` set (see the README) and ``torch.set_num_threads``.
Inside the process: one profiled forward+backward and one profiled forward (warm-ups that also give the
allocator peak from ``torch.profiler(profile_memory=True)``), one plain warm-up each, then ``repeats``
alternating forward / forward+backward timings; the record keeps the medians, the min/max, the process's CPU
utilisation during the timed loop and the load average (other work on the machine inflates timings).

Usage (from the repository root)::

    .venv/bin/python benchmarks/bench_attention.py run --lengths 256 512 1024 2048 --rounds 2
    .venv/bin/python benchmarks/bench_attention.py run --quick            # L=256,1024; one round
    .venv/bin/python benchmarks/bench_attention.py run --cases posenc:rope peer:hf-llama floor --lengths 2048
    .venv/bin/python benchmarks/bench_attention.py report                 # tables + plots from the JSON

Results accumulate in ``benchmarks/results/<tag>.json`` (``--tag``, default ``cpu-fp32``); a (case, L, round)
already there is skipped unless ``--force``, so an interrupted run resumes.

The parts: :mod:`attention_cases` (what each case builds), :mod:`attention_report` (tables, targets, plots), and
:mod:`harness` (fresh processes, the timed loop, the JSON store, resume), which ``bench_models.py`` shares.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from attention_cases import APPLY_CASES, APPLY_REPEATS, DEFAULT_ENCODINGS, PEERS, B, D, apply_fn, layer, too_big  # noqa: E402
from attention_report import report  # noqa: E402
from harness import MALLOC_ENV, RESULTS  # noqa: E402


# ============================================================================ the worker (one fresh process)
def worker(case: str, L: int, repeats: int, threads: int, seed: int = 0) -> dict:
    """Measure one case at length L in this process: forward and forward+backward time, allocator peaks."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    kind = case.partition(":")[0]
    if kind == "apply":
        fn, inputs = apply_fn(case, L)
        grad_inputs = tuple(t.requires_grad_() for t in inputs)
        module = None
    else:
        module = layer(case, L)
        module.eval()  # no dropout anywhere; gradients still flow
        if kind == "posenc-compiled":
            module = torch.compile(module, fullgraph=True)
        x = torch.randn(B, L, D)
        fn, grad_inputs = module, (x.requires_grad_(),)

    def outputs(res):
        return res if isinstance(res, tuple) else (res,)

    grads_cache: dict = {}

    def fwd():
        with torch.no_grad():
            return fn(*grad_inputs)

    def fwdbwd():
        outs = outputs(fn(*grad_inputs))
        if "g" not in grads_cache:
            grads_cache["g"] = tuple(torch.randn_like(o) for o in outs)
        torch.autograd.backward(outs, grads_cache["g"])
        for t in grad_inputs:
            t.grad = None
        if module is not None:
            for p in module.parameters():
                p.grad = None

    t_compile = None
    if kind == "posenc-compiled":
        t0 = time.perf_counter()
        fwdbwd()
        fwd()
        t_compile = time.perf_counter() - t0
    if kind == "apply":  # a few milliseconds each: a median of 2-3 calls is mostly noise
        repeats = max(repeats, APPLY_REPEATS)
    # the profiled runs are the warm-up; one more plain pass where it is cheap
    peak_fb, peak_f, t = harness.fwd_and_step(fwd, fwdbwd, "fwdbwd", repeats, threads, L <= 1024 or kind == "apply")
    return {
        "case": case,
        "L": L,
        **harness.spread("fwd", t.wall["fwd"]),
        **harness.spread("fwdbwd", t.wall["fwdbwd"]),
        "fwd_cpu_s": statistics.median(t.cpu["fwd"]),
        **harness.spread("fwdbwd_cpu", t.cpu["fwdbwd"]),
        "peak_fwd_MB": peak_f / 2**20,
        "peak_fwdbwd_MB": peak_fb / 2**20,
        "repeats": repeats,
        **t.summary(),
        "compile_s": t_compile,
        "n_params": 0 if module is None else sum(p.numel() for p in module.parameters()),
        "torch": torch.__version__,
    }


# ====================================================================== the orchestrator
def default_repeats(L: int) -> int:
    """Timed repeats per process: more where a call is short (a median of 3 calls of 0.1 s moved by ±6–10 %
    on this shared machine, more than the differences the targets look at)."""
    return 20 if L <= 256 else 10 if L <= 512 else 5 if L <= 1024 else 3 if L <= 2048 else 2


def default_cases(encodings: list[str], peers: bool, apply: bool, compiled: list[str]) -> list[str]:
    cases = ["floor"]
    for e in encodings:
        cases.append(f"posenc:{e}")
        if peers:
            cases += [f"peer:{p}" for p in PEERS.get(e, []) if f"peer:{p}" not in cases]
    cases += [f"posenc-compiled:{e}" for e in compiled]
    if apply:
        cases += APPLY_CASES
    return cases


def _line(rec: dict) -> str:
    """The progress line of one record."""
    head = f"r{rec['round']} L={rec['L']:5d} {rec['case']:38s}"
    if "fwdbwd_s" not in rec:
        return f"{head} {harness.why_not(rec, 300)}"
    return (
        f"{head} fwd {rec['fwd_s']:.4f}s fwd+bwd {rec['fwdbwd_s']:.4f}s peak {rec['peak_fwdbwd_MB']:.0f}MB "
        f"util {rec['cpu_util']:.2f} load {rec['loadavg_1m'][0]:.1f}"
    )


def run(args: argparse.Namespace) -> None:
    store = harness.Store(
        RESULTS / (f"{args.tag}.part-{args.part}.json" if args.part else f"{args.tag}.json"),
        key=lambda r: (r["case"], r["L"], r.get("round", 0)),
    )
    if args.cases:
        cases = args.cases
    else:
        if args.all:
            import posenc  # noqa: F401
            from posenc.registry import available

            encs = available()
        else:
            encs = args.encodings or DEFAULT_ENCODINGS
        cases = default_cases(encs, not args.no_peers, not args.no_apply, args.compiled or [])
    lengths = args.lengths or ([256, 1024] if args.quick else [256, 512, 1024, 2048])
    rounds = 1 if args.quick else args.rounds
    env = harness.worker_env(args.threads)

    def measure(job: tuple[str, int, int]) -> dict:
        case, L, rnd = job
        if too_big(case, L):
            return {"case": case, "L": L, "round": rnd, "skipped": "does not fit in this machine's memory"}
        reps = args.repeats or (2 if args.quick else default_repeats(L))
        spec = {"case": case, "L": L, "repeats": reps, "threads": args.threads}
        rec, wall = harness.fresh_process(Path(__file__), spec, env, args.timeout)
        return rec | {"round": rnd, "wall_s": wall, "malloc_env": MALLOC_ENV, "threads": args.threads}

    # alternate the order between rounds so that a slow spell of the machine hits different cases
    jobs = [(c, L, rnd) for rnd in range(rounds) for L in lengths for c in harness.round_order(cases, rnd)]
    harness.run_cases(store, [(job, job) for job in jobs], measure, _line, store.keys(), args.force)


def main() -> None:
    if harness.serve_worker(lambda s: worker(s["case"], s["L"], s["repeats"], s["threads"])):
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure (resumable)")
    r.add_argument("--lengths", type=int, nargs="+")
    r.add_argument("--encodings", nargs="+", help="posenc registry names (default: one per distinct cost)")
    r.add_argument("--all", action="store_true", help="every registered encoding")
    r.add_argument("--cases", nargs="+", help="explicit case ids (floor, posenc:rope, peer:hf-t5, apply:copy ...)")
    r.add_argument("--compiled", nargs="+", help="also run these encodings under torch.compile(fullgraph=True)")
    r.add_argument("--no-peers", action="store_true")
    r.add_argument("--no-apply", action="store_true")
    r.add_argument("--quick", action="store_true", help="L=256,1024, one round, 2 repeats")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--repeats", type=int)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--timeout", type=int, default=900)
    r.add_argument("--tag", default="cpu-fp32")
    r.add_argument("--force", action="store_true")
    r.add_argument(
        "--part", help="write to <tag>.part-<PART>.json (two runs side by side; the report reads every part)"
    )
    p = sub.add_parser("report", help="tables and plots from the results JSON")
    p.add_argument("--tag", default="cpu-fp32")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--metric", choices=("cpu", "wall"), default="cpu", help="CPU seconds (default) or wall seconds")
    args = ap.parse_args()
    (run if args.cmd == "run" else report)(args)


if __name__ == "__main__":
    main()
