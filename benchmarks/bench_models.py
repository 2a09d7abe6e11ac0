#!/usr/bin/env python
"""Speed and memory of whole models: posenc's LanguageModel / SequenceClassifier for every encoding, and the
Hugging Face model a user would pick instead, at the same size.

Three benchmarks, each case in a fresh process (same method as ``bench_attention.py``: one thread,
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` set, CPU seconds of the single-threaded process):

* **training step** (``run``, the default): forward, loss, backward of a 2-layer model (d_model 512, 8 heads,
  d_ff 2048, batch 2, fp32) at each L. No optimizer step (its cost is the same for every encoding: one
  pass over the ~7M parameters). Cases ``lm:posenc:<enc>`` (``posenc.LanguageModel``, causal, next-token
  cross-entropy against random targets) or ``classifier:posenc:<enc>`` (``posenc.SequenceClassifier``,
  bidirectional, mean pooling, 2 classes); a no-grad forward of the same batch is timed too.
* **HF models of the same size**, the same step (``lm:hf:llama``, ``lm:hf:xlnet``, ``lm:hf457:transfo-xl``,
  ``classifier:hf:t5``, ``classifier:hf:deberta``, ``classifier:hf457:bert-relative_key``,
  ``classifier:hf457:bert-relative_key_query``, ``classifier:hf457:nezha``), randomly initialised from a
  config (no download); ``hf457`` cases run under transformers 4.57 (``POSENC_HF457_PYTHON``).
* **HF models patched by posenc.hf** (``run --hf-patch alibi t5 ...``): ``lm:hfpatch:<enc>`` is ``lm:hf:llama``
  with its encoding replaced by ``posenc.hf.patch(model, <enc>)``; its ratio is taken against the unpatched
  ``lm:hf:llama`` (issue target: <= 1.10x for rotary encodings, <= 1.25x for biases). With ``--decode`` the same
  as ``decode:hfpatch:<enc>`` against ``decode:hf:llama``.
* **KV-cache decoding** (``run --decode``): batch 1, prefill a context of L tokens with
  ``kv_cache=posenc.KVCache()``, then time single-token steps under ``torch.no_grad`` (``decode:posenc:<enc>``;
  ``decode-mem:posenc:transformer-xl`` decodes with Transformer-XL's segment memory instead of a cache;
  ``decode:hf:llama`` with HF's DynamicCache, ``decode-mem:hf457:transfo-xl`` with HF's ``mems``).

Ratios are taken against ``none`` of the same kind from the same results file (``lm:posenc:none``,
``classifier:posenc:none``, ``decode:posenc:none``), and HF cases also against the matching posenc encoding.

Usage (from the repository root)::

    .venv/bin/python benchmarks/bench_models.py run --quick                       # L=256,512, a few encodings
    .venv/bin/python benchmarks/bench_models.py run --model lm --lengths 512 1024 2048
    .venv/bin/python benchmarks/bench_models.py run --model classifier --lengths 512 1024 2048
    .venv/bin/python benchmarks/bench_models.py run --decode --lengths 1024 4096
    .venv/bin/python benchmarks/bench_models.py run --model lm --encodings none rope --lengths 4096 --no-hf
    .venv/bin/python benchmarks/bench_models.py run --model lm --encodings none --hf-patch rope alibi --lengths 1024
    .venv/bin/python benchmarks/bench_models.py run ... --dry-run                 # list the cases only
    .venv/bin/python benchmarks/bench_models.py report                            # -> results/models-cpu-fp32.md
    .venv/bin/python benchmarks/bench_models.py floors --tags TAG [TAG ...]       # measured / floor per L, threads

Results accumulate in ``benchmarks/results/<tag>.json`` (``--tag``, default ``models-cpu-fp32``); a (case, L)
already there is skipped unless ``--force``, so an interrupted run resumes.

The parts: :mod:`model_cases` (the models each case builds, what its ratios are against), :mod:`models_report`
(the tables), :mod:`floors` (each encoding's floor from its declared cost, and the table against it), and
:mod:`harness` (fresh processes, the timed loop, the JSON store, resume), which
``bench_attention.py`` shares.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from attention_cases import ENC_OPTIONS  # noqa: E402
from harness import MALLOC_ENV, RESULTS  # noqa: E402
from model_cases import (  # noqa: E402
    D_FF,
    DEFAULT_ENCODINGS,
    DH,
    HF_CASES,
    HF_DECODE,
    N_LAYERS,
    QUICK_ENCODINGS,
    TOO_BIG,
    D,
    H,
    decoder,
    floor_of,
    match_of,
    train_case,
)
from models_report import report  # noqa: E402


# ============================================================================ the workers (one fresh process)
def train_worker(case: str, L: int, repeats: int, threads: int, vocab: int, batch: int) -> dict:
    """One training step's time (forward, loss, backward; and the no-grad forward), allocator peak and RSS."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    rss_imports = harness.rss_bytes()
    module, loss_fn = train_case(case, L, vocab, batch)
    module.train()  # dropout is 0 everywhere; train mode is what a training step runs (randomized positions)
    rss_entry = harness.rss_bytes()

    def fwd():
        with torch.no_grad():
            loss_fn()

    def step():
        loss_fn().backward()
        for p in module.parameters():
            p.grad = None

    t0 = time.process_time()
    step()  # the first step: one-time work (native kernels, caches); its RSS high-water mark is recorded
    first_step_cpu = time.process_time() - t0
    rss_step = harness.maxrss_bytes() - rss_entry
    # the profiled runs are the warm-up; one more plain pass where it is cheap
    peak_step, peak_fwd, t = harness.fwd_and_step(fwd, step, "step", repeats, threads, L <= 1024)
    return {
        "case": case,
        "L": L,
        **harness.spread("step_cpu", t.cpu["step"]),
        **harness.spread("step", t.wall["step"]),
        "fwd_cpu_s": statistics.median(t.cpu["fwd"]),
        "fwd_s": statistics.median(t.wall["fwd"]),
        "first_step_cpu_s": first_step_cpu,
        "peak_step_MB": peak_step / 2**20,
        "peak_fwd_MB": peak_fwd / 2**20,
        "rss_step_MB": rss_step / 2**20,
        "rss_run_MB": (harness.maxrss_bytes() - rss_entry) / 2**20,
        "rss_model_MB": (rss_entry - rss_imports) / 2**20,
        "repeats": repeats,
        **t.summary(),
        "n_params": sum(p.numel() for p in module.parameters()),
        "torch": torch.__version__,
        **_versions(case),
    }


DECODE_WARMUP = 2


def decode_worker(case: str, C: int, n_steps: int, threads: int, vocab: int) -> dict:
    """Per-token time of KV-cache (or segment-memory) decoding from a context of C tokens, and the prefill's."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    n_tokens = DECODE_WARMUP + 1 + n_steps
    module, prefill, step = decoder(case, C, n_tokens, vocab)
    module.eval()
    ctx = torch.randint(0, vocab, (1, C))
    toks = torch.randint(0, vocab, (1, n_tokens))
    rss_entry = harness.rss_bytes()
    with torch.no_grad():
        # a throw-away prefill and step (one-time work), then the measured ones
        prefill(ctx[:, : min(C, 64)])
        step(toks[:, :1])
        peak_prefill = harness.profiled_peak(lambda: prefill(ctx))
        p0, t0 = time.process_time(), time.perf_counter()
        prefill(ctx)
        prefill_cpu, prefill_wall = time.process_time() - p0, time.perf_counter() - t0
        for i in range(DECODE_WARMUP):
            step(toks[:, i : i + 1])
        peak_step = harness.profiled_peak(lambda: step(toks[:, DECODE_WARMUP : DECODE_WARMUP + 1]))
        steps = (("token", lambda i=i: step(toks[:, i : i + 1])) for i in range(DECODE_WARMUP + 1, n_tokens))
        t = harness.timed(steps, threads)
    cf = t.cpu["token"]
    return {
        "case": case,
        "L": C,
        "token_cpu_ms": 1e3 * statistics.median(cf),
        "token_cpu_mean_ms": 1e3 * statistics.fmean(cf),
        "token_cpu_min_ms": 1e3 * min(cf),
        "token_cpu_max_ms": 1e3 * max(cf),
        "token_ms": 1e3 * statistics.median(t.wall["token"]),
        "prefill_cpu_s": prefill_cpu,
        "prefill_s": prefill_wall,
        "peak_prefill_MB": peak_prefill / 2**20,
        "peak_token_MB": peak_step / 2**20,
        "rss_run_MB": (harness.maxrss_bytes() - rss_entry) / 2**20,
        "steps": n_steps,
        **t.summary(),
        "n_params": sum(p.numel() for p in module.parameters()),
        "torch": torch.__version__,
        **_versions(case),
    }


def _versions(case: str) -> dict:
    if ":hf" not in case:
        return {}
    import transformers

    return {"transformers": transformers.__version__}


# ====================================================================== the orchestrator
def default_repeats(L: int) -> int:
    """Timed training steps per process (the median is reported)."""
    return 5 if L <= 512 else 3 if L <= 2048 else 2


def default_cases(
    kinds: list[str], encodings: list[str], hf: bool, decode: bool, patched: list[str] | None = None
) -> list[str]:
    encs = ["none"] + [e for e in encodings if e != "none"]  # the floor first, so ratios print as it goes
    patched = patched or []
    if decode:
        cases = [f"decode:posenc:{e}" for e in encs]
        if "transformer-xl" in encs:
            cases.append("decode-mem:posenc:transformer-xl")
        if hf:
            cases += [c for c, (e, _) in HF_DECODE.items() if e in encs]
        if patched:
            cases += [c for c in ["decode:hf:llama"] if c not in cases] + [f"decode:hfpatch:{e}" for e in patched]
        return cases
    cases = []
    for kind in kinds:
        cases += [f"{kind}:posenc:{e}" for e in encs]
        if hf:
            cases += [f"{kind}:{pid}" for pid, (k, e, _) in HF_CASES.items() if k == kind and e in encs]
    if patched:
        cases += [c for c in ["lm:hf:llama"] if c not in cases] + [f"lm:hfpatch:{e}" for e in patched]
    return cases


def unbuildable(encodings: list[str], vocab: int) -> dict[str, str]:
    """Encodings that cannot be built at this model size with the default options (plus ENC_OPTIONS)."""
    import posenc  # noqa: F401
    from posenc.registry import build

    dims = dict(d_model=D, n_heads=H, head_dim=DH, max_len=512, vocab_size=vocab, n_layers=N_LAYERS, causal=True)
    bad = {}
    for e in encodings:
        try:
            build(e, dims=dims, options=dict(ENC_OPTIONS.get(e, {})) or None)
        except Exception as exc:  # noqa: BLE001 (any failure to build is reported, not raised)
            bad[e] = f"{type(exc).__name__}: {exc}"
    return bad


def _fmt_line(rec: dict, records: list[dict]) -> str:
    """The progress line of one record, with its ratios to the records already there."""
    case, L = rec["case"], rec["L"]
    if "skipped" in rec or "error" in rec:
        return f"L={L:5d} {case:44s} {'ERROR: ' if 'error' in rec else ''}{harness.why_not(rec, 400)}"
    fl = next((r for r in records if r["case"] == floor_of(case) and r["L"] == L and "error" not in r), None)
    if "token_cpu_ms" in rec:
        line = (
            f"L={L:5d} {case:44s} {rec['token_cpu_ms']:8.2f} ms/token (wall {rec['token_ms']:.2f}) "
            f"prefill {rec['prefill_cpu_s']:.3f}s peak {rec['peak_prefill_MB']:.0f}MB"
        )
        if fl and "token_cpu_ms" in fl:
            line += f" ×none {rec['token_cpu_ms'] / fl['token_cpu_ms']:.2f}"
    else:
        line = (
            f"L={L:5d} {case:44s} step {rec['step_cpu_s']:.3f}s (wall {rec['step_s']:.3f}) "
            f"fwd {rec['fwd_cpu_s']:.3f}s peak {rec['peak_step_MB']:.0f}MB rss+{rec['rss_step_MB']:.0f}MB"
        )
        if fl and "step_cpu_s" in fl:
            line += (
                f" ×none {rec['step_cpu_s'] / fl['step_cpu_s']:.2f} "
                f"mem×{rec['peak_step_MB'] / max(fl['peak_step_MB'], 1e-9):.2f}"
            )
    m = match_of(case)
    mr = next((r for r in records if r["case"] == m and r["L"] == L and "error" not in r), None) if m else None
    if mr and "step_cpu_s" in mr and "step_cpu_s" in rec:
        line += f" posenc/HF {mr['step_cpu_s'] / rec['step_cpu_s']:.2f}"
    if mr and "token_cpu_ms" in mr and "token_cpu_ms" in rec:
        line += f" posenc/HF {mr['token_cpu_ms'] / rec['token_cpu_ms']:.2f}"
    return line + f" load {rec['loadavg_1m'][0]:.1f}"


def run(args: argparse.Namespace) -> None:
    store = harness.Store(RESULTS / f"{args.tag}.json", key=lambda r: (r["case"], r["L"]))
    kinds = ["lm", "classifier"] if args.model == "both" else [args.model]
    if args.decode:
        lengths = args.lengths or ([256, 512] if args.quick else [1024, 4096])
    else:
        lengths = args.lengths or ([256, 512] if args.quick else [512, 1024, 2048])
    skipped_encs: dict[str, str] = {}
    if args.cases:
        cases = args.cases
    else:
        if args.all:
            import posenc

            encs = posenc.available()
        else:
            encs = args.encodings or (QUICK_ENCODINGS if args.quick else DEFAULT_ENCODINGS)
        skipped_encs = unbuildable(encs, args.vocab)
        for e, why in skipped_encs.items():
            print(f"skip encoding {e}: cannot be built with default options ({why})", flush=True)
        cases = default_cases(
            kinds, [e for e in encs if e not in skipped_encs], not args.no_hf, args.decode, args.hf_patch
        )

    def too_big(case: str, L: int) -> bool:
        return L >= TOO_BIG.get(case, 1 << 30) and not args.allow_big

    if args.dry_run:
        have = store.keys()
        for L in lengths:
            for case in cases:
                done = (case, L) in have and not args.force
                note = " (too big: skipped)" if too_big(case, L) else " (done)" if done else ""
                print(f"L={L:5d} {case} [{harness.python_for(case)}]{note}")
        return
    env = harness.worker_env(args.threads)
    done = store.keys(failed=False)  # failed cases are tried again
    for e, why in skipped_encs.items():  # recorded so that the report lists them
        for L in lengths:
            for kind in ["decode"] if args.decode else kinds:
                c = f"{kind}:posenc:{e}"
                if (c, L) not in done:
                    store.records.append({"case": c, "L": L, "skipped": f"cannot be built with default options: {why}"})
    store.save()
    config = {"d_model": D, "n_heads": H, "d_ff": D_FF, "n_layers": N_LAYERS}

    def measure(job: tuple[str, int]) -> dict:
        case, L = job
        if too_big(case, L):
            return {"case": case, "L": L, "skipped": "does not fit in this machine's memory (--allow-big to try)"}
        spec = {
            "case": case,
            "L": L,
            "threads": args.threads,
            "vocab": args.vocab,
            "batch": args.batch,
            "steps": args.steps,
            "repeats": args.repeats or (1 if args.quick else default_repeats(L)),
        }
        rec, wall = harness.fresh_process(Path(__file__), spec, env, args.timeout)
        rec["process_wall_s"] = wall
        rec["config"] = {k: spec[k] for k in ("threads", "vocab", "batch")} | config
        if case.startswith("decode"):
            rec["config"]["batch"] = 1
        rec["malloc_env"] = MALLOC_ENV
        return rec

    t_start = time.perf_counter()
    jobs = [((case, L), (case, L)) for L in lengths for case in cases]
    harness.run_cases(store, jobs, measure, lambda rec: _fmt_line(rec, store.records), done, args.force)
    print(f"finished in {time.perf_counter() - t_start:.0f} s; results in {store.path}", flush=True)


def floors_report(args: argparse.Namespace) -> None:
    """``floors``: the measured ratios against each encoding's floor (:mod:`floors`, a report beside
    :mod:`models_report`; imported here only when asked, as it builds encodings to read their declared cost)."""
    import floors

    floors.report(args)


def _worker(spec: dict) -> dict:
    if spec["case"].startswith("decode"):
        return decode_worker(spec["case"], spec["L"], spec["steps"], spec["threads"], spec["vocab"])
    return train_worker(spec["case"], spec["L"], spec["repeats"], spec["threads"], spec["vocab"], spec["batch"])


def main() -> None:
    if harness.serve_worker(_worker):
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser(
        "run",
        help="measure (resumable: a (case, L) already in the JSON is skipped unless --force)",
        description="Measure the training step (default) or KV-cache decoding (--decode); one process per (case, L).",
    )
    r.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        help="sequence lengths (training; default 512 1024 2048) or contexts (--decode; default 1024 4096)",
    )
    r.add_argument("--encodings", nargs="+", help=f"posenc encodings (default: {' '.join(DEFAULT_ENCODINGS)})")
    r.add_argument("--all", action="store_true", help="every registered encoding (unbuildable ones are reported)")
    r.add_argument(
        "--hf-patch",
        nargs="+",
        metavar="ENC",
        default=[],
        help="also time HF's Llama patched by posenc.hf with each ENC (against the unpatched lm:hf:llama)",
    )
    r.add_argument(
        "--cases",
        nargs="+",
        help="explicit case ids, e.g. lm:posenc:rope lm:hf:llama classifier:hf457:nezha decode:posenc:t5 "
        "decode-mem:posenc:transformer-xl (overrides --encodings/--model/--no-hf)",
    )
    r.add_argument(
        "--model",
        choices=("lm", "classifier", "both"),
        default="lm",
        help="posenc.LanguageModel (causal; HF: Llama, XLNet, Transformer-XL) or posenc.SequenceClassifier "
        "(bidirectional; HF: T5 encoder, DeBERTa-v2, BERT relative_key(_query), NEZHA); default lm",
    )
    r.add_argument("--decode", action="store_true", help="KV-cache decoding per token instead of the training step")
    r.add_argument("--no-hf", action="store_true", help="posenc models only (no Hugging Face cases)")
    r.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: L=256 512, one repeat, encodings {' '.join(QUICK_ENCODINGS)} (unless given)",
    )
    r.add_argument("--repeats", type=int, help="timed training steps per process (default 5 / 3 / 2 by L)")
    r.add_argument("--steps", type=int, default=32, help="timed decoding steps (default 32)")
    r.add_argument("--vocab", type=int, default=8192, help="vocabulary size of every model (default 8192)")
    r.add_argument("--batch", type=int, default=2, help="training batch (default 2; decoding is batch 1)")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--timeout", type=int, default=3600, help="seconds per process (default 3600)")
    r.add_argument("--allow-big", action="store_true", help="also run the cases listed as too big (TOO_BIG)")
    r.add_argument("--tag", default="models-cpu-fp32", help="results/<tag>.json (default models-cpu-fp32)")
    r.add_argument("--force", action="store_true", help="re-measure (case, L) already in the JSON")
    r.add_argument("--dry-run", action="store_true", help="print the (case, L) that would run, and exit")
    p = sub.add_parser("report", help="markdown tables (results/<tag>.md) from the JSON")
    p.add_argument("--tag", default="models-cpu-fp32")
    p.add_argument(
        "--metric",
        choices=("cpu", "cpu-min", "wall"),
        default="cpu",
        help="median CPU seconds of the repeats (default), the fastest repeat's CPU seconds, or wall seconds",
    )
    f = sub.add_parser(
        "floors",
        help="each encoding's measured ratio to none against its floor (benchmarks/floors.py), per L and threads",
    )
    f.add_argument("--tags", nargs="+", default=["models-cpu-fp32"], help="results/<tag>.json files to read")
    f.add_argument(
        "--metric",
        choices=("auto", "cpu", "cpu-min", "wall"),
        default="auto",
        help="auto (default): CPU seconds at one thread, wall seconds at more (CPU seconds count every thread)",
    )
    args = ap.parse_args()
    {"run": run, "report": report, "floors": floors_report}[args.cmd](args)


if __name__ == "__main__":
    main()
