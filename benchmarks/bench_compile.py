"""Eager against compiled for every encoding: one training step of posenc's language model, eager and under
``torch.compile(model, fullgraph=True, dynamic=True)`` (Inductor), its time and its allocator peak (issue 25).

The model is ``model_cases``' (a 2-layer ``posenc.LanguageModel``, d_model 512, 8 heads, d_ff 2048, vocabulary
8192), batch 2, at each length L (default 2048). Each case runs in a fresh process (``harness.py``): a case is
``<encoding>:eager`` or ``<encoding>:compiled``. A compiled case records, beside the step's time and peak, its
first step (the compile), the graphs Dynamo made (one for the training step and one for the no-grad forward:
more means a recompile) and the kernels the attention layers took, to compare with the eager case's (a kernel
that is a ``torch.library`` custom op is kept by the compiled graph: ``posenc.attention.kernels.COMPILABLE_KERNELS``).

    python benchmarks/bench_compile.py                         # every default encoding at L = 2048
    python benchmarks/bench_compile.py --encodings t5 shaw --lengths 1024 2048
    python benchmarks/bench_compile.py --lengths 64 --repeats 1 --encodings t5 --tag compile-smoke   # a smoke run
    python benchmarks/bench_compile.py --report                # the table of what results/<tag>.json holds

Results go to ``results/<tag>.json`` (default ``compile-cpu-fp32``), one record per (case, L); a second run skips
what is stored (``--force`` measures again). The report (``results/<tag>.md``) gives, per encoding and L, the
compiled step's time and peak over the eager one's (target: at most 1).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import harness
from model_cases import DEFAULT_ENCODINGS, posenc_model

MODES = ("eager", "compiled")


# ============================================================================ the worker (one fresh process)
def _worker(spec: dict) -> dict:
    """One case: the training step's time (median of ``repeats``), its allocator peak, the no-grad forward's."""
    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    enc, mode = spec["case"].rsplit(":", 1)
    L, batch, vocab, threads = spec["L"], spec["batch"], spec["vocab"], spec["threads"]
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = posenc_model("lm", enc, L, vocab).train()
    run = torch.compile(model, fullgraph=True, dynamic=True) if mode == "compiled" else model
    tokens, targets = torch.randint(0, vocab, (batch, L)), torch.randint(0, vocab, (batch, L))

    def loss():
        return F.cross_entropy(run(tokens).flatten(0, 1), targets.flatten())

    def fwd():
        with torch.no_grad():
            loss()

    def step():
        loss().backward()
        for p in model.parameters():
            p.grad = None

    t0 = time.perf_counter()
    step()  # eager: one-time work (native kernels); compiled: the compile of the training graph
    first = time.perf_counter() - t0
    peak_step, peak_fwd, t = harness.fwd_and_step(fwd, step, "step", spec["repeats"], threads, True)
    plans = [m.last_plan for m in model.modules() if getattr(m, "last_plan", None) is not None]
    return {
        "case": spec["case"],
        "L": L,
        **harness.spread("step", t.wall["step"]),
        **harness.spread("step_cpu", t.cpu["step"]),
        "fwd_s": min(t.wall["fwd"]),
        "first_step_s": first,
        "peak_step_MB": peak_step / 2**20,
        "peak_fwd_MB": peak_fwd / 2**20,
        "kernels": sorted({p.kernel for p in plans}),
        "graphs": counters["stats"]["unique_graphs"] if mode == "compiled" else 0,
        "repeats": spec["repeats"],
        **t.summary(),
        "torch": torch.__version__,
    }


# ============================================================================ the parent
def run(args: argparse.Namespace) -> None:
    store = harness.Store(harness.RESULTS / f"{args.tag}.json", key=lambda r: (r["case"], r["L"]))
    cases = [f"{e}:{m}" for e in args.encodings for m in MODES]
    jobs = [((c, L), (c, L)) for L in args.lengths for c in cases]
    if args.dry_run:
        have = store.keys()
        for (c, L), _ in jobs:
            print(f"L={L:5d} {c}{' (done)' if (c, L) in have and not args.force else ''}")
        return
    env = harness.worker_env(args.threads)
    base = {"threads": args.threads, "vocab": args.vocab, "batch": args.batch, "repeats": args.repeats}

    def measure(job: tuple[str, int]) -> dict:
        case, L = job
        rec, wall = harness.fresh_process(Path(__file__), {"case": case, "L": L, **base}, env, args.timeout)
        rec["process_wall_s"], rec["config"] = wall, base
        return rec

    def show(rec: dict) -> str:
        if "step_s" not in rec:
            return f"L={rec['L']:5d} {rec['case']:32s} {harness.why_not(rec, 100)}"
        extra = (
            f", compile {rec['first_step_s']:.0f} s, {rec['graphs']} graphs"
            if rec["case"].endswith(":compiled")
            else ""
        )
        return (
            f"L={rec['L']:5d} {rec['case']:32s} step {rec['step_s']:.3f} s, peak {rec['peak_step_MB']:.0f} MB, "
            f"kernels {'/'.join(rec['kernels'])}{extra}"
        )

    harness.run_cases(store, jobs, measure, show, store.keys(failed=False), args.force)
    report(args)


def report(args: argparse.Namespace) -> None:
    """``results/<tag>.md``: per encoding and L, compiled over eager (time and peak), and the kernels of each."""
    recs = {(r["case"], r["L"]): r for r in harness.load(harness.RESULTS / f"{args.tag}.json")}
    # CPU seconds at one thread (what a shared machine's load moves least), wall seconds at more (CPU time would
    # count every thread)
    cpu = args.metric == "cpu" or (args.metric == "auto" and args.threads == 1)
    key, what = ("step_cpu_s", "CPU s") if cpu else ("step_s", "wall s")
    lines = [
        f"Step times: median {what} of the repeats ({args.threads} thread(s)).",
        "",
        f"| encoding | L | eager step {what} | compiled step {what} | time ratio | eager peak MB | compiled peak MB "
        "| memory ratio | kernels eager | kernels compiled | graphs | compile s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for enc, L in sorted({(c.rsplit(":", 1)[0], L) for c, L in recs}, key=lambda k: (k[1], k[0])):
        e, c = recs.get((f"{enc}:eager", L), {}), recs.get((f"{enc}:compiled", L), {})
        if key not in e or key not in c:
            why = harness.why_not(e if "step_s" not in e and e else c or e, 80) if (e or c) else "not measured"
            lines.append(f"| {enc} | {L} | {why} |||||||||")
            continue
        time_ratio, mem_ratio = c[key] / e[key], c["peak_step_MB"] / max(e["peak_step_MB"], 1e-9)
        lines.append(
            f"| {enc} | {L} | {e[key]:.3f} | {c[key]:.3f} | {time_ratio:.2f} | {e['peak_step_MB']:.0f} "
            f"| {c['peak_step_MB']:.0f} | {mem_ratio:.2f} | {'/'.join(e['kernels'])} | {'/'.join(c['kernels'])} "
            f"| {c['graphs']} | {c['first_step_s']:.0f} |"
        )
    harness.write_report("\n".join(lines) + "\n", harness.RESULTS / f"{args.tag}.md")


def main() -> None:
    if harness.serve_worker(_worker):
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--encodings", nargs="+", default=DEFAULT_ENCODINGS, help="posenc encodings (default: model_cases')"
    )
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048], help="sequence lengths L (default 2048)")
    ap.add_argument("--repeats", type=int, default=3, help="timed training steps per process (default 3)")
    ap.add_argument("--batch", type=int, default=2, help="training batch (default 2)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default 8192)")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads per process (default 1)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per process (default 3600)")
    ap.add_argument("--tag", default="compile-cpu-fp32", help="results/<tag>.json and .md (default compile-cpu-fp32)")
    ap.add_argument("--force", action="store_true", help="measure again the (case, L) already stored")
    ap.add_argument("--dry-run", action="store_true", help="print the (case, L) that would run, and exit")
    ap.add_argument("--report", action="store_true", help="only write the report of what is stored")
    ap.add_argument(
        "--metric",
        choices=("auto", "cpu", "wall"),
        default="auto",
        help="the report's step time: CPU seconds (auto: at one thread) or wall seconds (auto: at more)",
    )
    args = ap.parse_args()
    report(args) if args.report else run(args)


if __name__ == "__main__":
    main()
