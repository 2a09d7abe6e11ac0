#!/usr/bin/env python
"""Speed of a real pretrained model patched by posenc.hf: SmolLM2-135M (``posenc.hf.load_pretrained``).

Cases, all on the same weights in one process:

* ``unpatched`` -- the model as loaded (its own RoPE, transformers' SDPA attention);
* ``hf-yarn`` -- transformers' own YaRN: ``config.rope_parameters = {"rope_type": "yarn", "factor": s, ...}``
  and a new ``LlamaRotaryEmbedding`` built from it (HF's code path for the same scaling);
* ``posenc-yarn`` -- ``posenc.hf.patch(model, "rope-yarn", factor=s)`` (the rotary module's cos/sin replaced;
  the attention stays transformers' own);
* ``posenc-alibi`` -- ``posenc.hf.patch(model, "alibi")``: an encoding inside posenc's attention function;
* ``posenc-<name>`` -- ``posenc.hf.patch(model, "<name>")`` for any registered encoding (``--encodings xpos t5``
  adds ``posenc-xpos`` and ``posenc-t5`` to ``--cases``); one that takes a ``factor`` gets ``--factor``.

Measured: **prefill** (one forward of N tokens with the cache on and ``logits_to_keep=1``, as ``generate``
does), and **decoding** per token with a cache of ``--decode-context`` tokens (the cache is filled once; each
case then decodes ``--decode-steps`` tokens from it and crops it back). Rounds alternate the order of the
cases (ABCD, DCBA, ...); the table gives each round's ratio to ``unpatched`` and the median of the medians.
Peak memory: the allocator peak of one prefill at the shortest length (``torch.profiler``, profile_memory).

    python benchmarks/bench_real_model.py --lengths 8192 16384 --decode-context 16384 --rounds 2
    python benchmarks/bench_real_model.py --quick        # 1k / 2k tokens, a smoke test of about a minute
    # decoding only, several encodings against unpatched in one interleaved run:
    python benchmarks/bench_real_model.py --lengths --decode-context 4096 --no-memory --cases unpatched \
        --encodings rope-yarn rope-interleaved xpos alibi t5

A case whose patch rotates the keys in posenc's attention (xPos, interleaved RoPE: rotary encodings that
transformers' rotate-half cos/sin cannot express) stores its keys rotated in the cache it decodes from, so it
decodes from its own copy of the filled cache (one more cache's memory per such case).

Writes ``benchmarks/results/real-model-<tag>.json`` and prints a Markdown table. Unlike the two other
benchmarks, every case runs in this one process (switching the cases costs no reload of the weights); from
:mod:`harness` it takes the round order and the results folder.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

import posenc.hf  # noqa: E402
from posenc.pretrained import identity  # noqa: E402
from posenc.registry import accepted_arguments, resolve  # noqa: E402
from posenc.runenv import run_environment  # noqa: E402

# what the cases are timed with: wall seconds, or the process's CPU seconds (--clock cpu: at --threads 1 what a
# shared machine's load moves least; at more threads it counts every thread)
CLOCK = time.perf_counter


def load():
    model, tok = posenc.hf.load_pretrained("smollm2-135m", quiet=True)
    return model.eval(), tok


def hf_yarn_rotary(model, factor: float):
    """transformers' own YaRN rotary module for ``model`` (its config with rope_parameters set to yarn)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = copy.deepcopy(model.config)
    theta = cfg.rope_parameters["rope_theta"]
    cfg.rope_parameters = {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": int(cfg.max_position_embeddings),
        "rope_theta": theta,
    }
    return LlamaRotaryEmbedding(cfg)


class Cases:
    """Switch one model between the cases (no copies of the weights)."""

    def __init__(self, model, factor: float):
        self.model = model
        self.own_rotary = model.model.rotary_emb
        self.hf_rotary = hf_yarn_rotary(model, factor)
        self.factor = factor

    def enter(self, name: str) -> None:
        posenc.hf.unpatch(self.model)
        self.model.model.rotary_emb = self.own_rotary
        if name == "hf-yarn":
            self.model.model.rotary_emb = self.hf_rotary
        elif name == "posenc-yarn":
            posenc.hf.patch(self.model, "rope-yarn", factor=self.factor)
        elif name.startswith("posenc-"):
            encoding = "alibi" if name == "posenc-alibi" else name[len("posenc-") :]
            try:
                cls = resolve(encoding)
            except Exception as err:
                raise SystemExit(f"unknown case {name}: {err}") from err
            factor = {"factor": self.factor} if "factor" in accepted_arguments(cls) else {}
            posenc.hf.patch(self.model, encoding, **factor)
        elif name != "unpatched":
            raise SystemExit(f"unknown case {name}")

    def own_cache(self) -> bool:
        """Whether the current case writes its keys rotated into the cache (so decodes from a copy of its own)."""
        state = posenc.hf.patched(self.model)
        return state is not None and state.rotary_mode == "identity" and bool(state.cores)


@torch.no_grad()
def prefill(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache()
    t0 = CLOCK()
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return CLOCK() - t0, cache


@torch.no_grad()
def decode(model, cache, context: int, steps: int, token: int) -> float:
    """Seconds per token of ``steps`` one-token forwards from a cache of ``context`` tokens (cropped back)."""
    x = torch.tensor([[token]])
    times = []
    for _ in range(steps):
        t0 = CLOCK()
        model(input_ids=x, past_key_values=cache, use_cache=True)
        times.append(CLOCK() - t0)
    cache.crop(-steps)  # back to the context it had (transformers 5 crops by the number of tokens to remove)
    assert cache.get_seq_length() == context
    return statistics.median(times)


def peak_memory(model, ids) -> float:
    """MiB: the allocator peak of one prefill above the level before it (:func:`harness.profiled_peak`, the
    measure of the two other benchmarks).

    Until 2026-11-25 this summed the profiler events' ``cpu_memory_usage``, which counts an op's allocations again
    in each op that encloses it: 3-4x too much (``results/real-model-smollm2-*.json`` before that date hold the
    old measure; benchmarks/README.md says which numbers are which)."""
    return harness.profiled_peak(lambda: prefill(model, ids)) / 2**20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="*", default=[8192, 16384], help="prefill lengths (none: decode only)")
    p.add_argument("--decode-context", type=int, default=16384)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument(
        "--cases",
        nargs="+",
        default=["unpatched", "hf-yarn", "posenc-yarn", "posenc-alibi"],
        help="unpatched, hf-yarn, posenc-yarn, posenc-alibi or posenc-<encoding name> (ratios are to unpatched, "
        "which is added where missing)",
    )
    p.add_argument(
        "--encodings",
        nargs="+",
        default=[],
        metavar="NAME",
        help="registered encodings to add as cases posenc-<NAME> (after --cases)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measure")
    p.add_argument("--memory-only", action="store_true", help="only the peak memory of one prefill per case")
    p.add_argument("--quick", action="store_true", help="1k / 2k tokens, decode at 2k: a smoke test")
    p.add_argument("--tag", default="")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time the cases in wall seconds (default) or the process's CPU seconds (for --threads 1 on a shared "
        "machine)",
    )
    args = p.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.quick:
        args.lengths, args.decode_context, args.decode_steps, args.rounds = [1024, 2048], 2048, 4, 1
    if args.memory_only:
        args.rounds = 0
    args.cases = list(dict.fromkeys(["unpatched", *args.cases, *(f"posenc-{e}" for e in args.encodings)]))
    if not args.lengths:
        if args.memory_only:
            raise SystemExit("--memory-only measures one prefill: give --lengths")
        args.no_memory = True  # the peak memory is one prefill's
    torch.set_num_threads(args.threads)
    model, tok = load()
    cases = Cases(model, args.factor)
    gen = torch.Generator().manual_seed(0)
    longest = max([*args.lengths, args.decode_context])
    for c in args.cases:  # an unknown case fails now, not after the prefill
        cases.enter(c)
    ids = torch.randint(100, 40000, (1, longest), generator=gen)
    # the same text for every case: random token ids are as costly as real ones
    times: dict[str, dict[str, list[float]]] = {c: {} for c in args.cases}
    load_avg = []
    # the decoding cache is filled once (by the unpatched model: the values do not change the cost) and cropped
    # back to its length after each case's steps
    cases.enter("unpatched")
    cache = None
    own: dict[str, object] = {}  # the cases that decode from their own copy of the cache
    if args.rounds:
        fill, cache = prefill(model, ids[:, : args.decode_context])
        print(f"filled a cache of {args.decode_context} tokens in {fill:.0f} s", flush=True)
    for rnd in range(args.rounds):
        order = harness.round_order(args.cases, rnd)
        for n in args.lengths:
            for c in order:
                cases.enter(c)
                load_avg.append(os.getloadavg()[0])
                t, _ = prefill(model, ids[:, :n])
                times[c].setdefault(f"prefill-{n}", []).append(t)
                print(f"round {rnd + 1} prefill {n:>6} {c:>13}: {t:7.2f} s (load {load_avg[-1]:.1f})", flush=True)
        for c in order:
            cases.enter(c)
            load_avg.append(os.getloadavg()[0])
            if cases.own_cache() and c not in own:
                own[c] = copy.deepcopy(cache)  # its keys are stored rotated: not to be shared with other cases
            t = decode(model, own.get(c, cache), args.decode_context, args.decode_steps, 1000)
            times[c].setdefault(f"decode-{args.decode_context}", []).append(t)
            print(f"round {rnd + 1} decode @{args.decode_context} {c:>13}: {t * 1e3:7.1f} ms/token", flush=True)
    del cache, own
    memory = {}
    if not args.no_memory:
        for c in args.cases:
            cases.enter(c)
            load_avg.append(os.getloadavg()[0])
            memory[c] = peak_memory(model, ids[:, : min(args.lengths)])
            print(f"peak memory, prefill {min(args.lengths)}, {c:>13}: {memory[c]:.0f} MiB", flush=True)
    cases.enter("unpatched")
    base = times["unpatched"]
    rows = []
    for c in args.cases:
        for k, v in times[c].items():
            ratios = [a / b for a, b in zip(v, base[k])]
            rows.append(
                {"case": c, "measure": k, "seconds": v, "ratios": ratios, "median_ratio": statistics.median(ratios)}
            )
    out = {
        "tag": args.tag or time.strftime("%Y%m%d-%H%M"),
        "args": vars(args),
        "model": identity(model),
        "env": run_environment(),
        "machine": platform.node(),
        "load_average_during": [min(load_avg), max(load_avg)],
        "rows": rows,
        "peak_memory_mib": memory,
    }
    path = harness.RESULTS / f"real-model-{out['tag']}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    if not rows:  # --memory-only: the peaks were printed as they were measured
        print(f"\nload average during the run: {min(load_avg):.1f}-{max(load_avg):.1f}; wrote {path}")
        return 0
    peak = f"peak MiB (prefill {min(args.lengths)})" if memory else "peak MiB"
    print(f"\n| case | measure | seconds per round | × unpatched per round | {peak} |")
    print("|---|---|---|---|---|")
    for r in rows:
        secs = " / ".join(f"{s:.3f}" for s in r["seconds"])
        rat = " / ".join(f"{x:.2f}" for x in r["ratios"])
        mem = memory.get(r["case"])
        print(f"| {r['case']} | {r['measure']} | {secs} | {rat} | {'' if mem is None else f'{mem:.0f}'} |")
    print(f"\nload average during the run: {min(load_avg):.1f}-{max(load_avg):.1f}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
