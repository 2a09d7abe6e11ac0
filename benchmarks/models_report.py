"""The report of the whole-model benchmark: Markdown tables from its results JSON (``bench_models.py report``).

Tables: the training step of each posenc model against ``none`` (time and allocator peak, then the no-grad
forward and the RSS growth), KV-cache decoding, each Hugging Face model beside the posenc encoding it implements,
HF's Llama patched by ``posenc.hf`` against the unpatched one, and what was not measured.

What it may import: the standard library, :mod:`harness` and :mod:`model_cases` (the case lists, what a ratio
is taken against).
"""

from __future__ import annotations

import argparse

from harness import RESULTS, load, why_not, write_report
from model_cases import D_FF, DEFAULT_ENCODINGS, HF_CASES, HF_DECODE, N_LAYERS, D, H, floor_of, match_of


def _cell(v: float | None, base: float | None, fmt: str) -> str:
    """``v`` and its ratio to ``base`` ("—" where ``v`` was not measured, no ratio where ``base`` was not)."""
    if v is None:
        return "—"
    s = format(v, fmt)
    return f"{s} ({v / base:.2f}×)" if base else s


def _rows(ok: dict, rows: list[tuple[str, str]], lengths: list[int], base: str, columns: list) -> list[str]:
    """One Markdown row per ``(label, case)``: at each L, each ``(value, fmt)`` column's value of the case and its
    ratio to the same value of case ``base`` at that L."""
    out = []
    for label, case in rows:
        cells = []
        for L in lengths:
            r, fl = ok.get((case, L)), ok.get((base, L))
            cells += [_cell(value(r) if r else None, value(fl) if fl else None, fmt) for value, fmt in columns]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def report(args: argparse.Namespace) -> None:
    records = load(RESULTS / f"{args.tag}.json")
    cpu = args.metric in ("cpu", "cpu-min")
    best = args.metric == "cpu-min"  # the fastest repeat: another process on the machine only ever adds time
    ok = {(r["case"], r["L"]): r for r in records if "error" not in r and "skipped" not in r}

    def step_t(r):
        return (r["step_cpu_min_s"] if best else r["step_cpu_s"]) if cpu else r["step_s"]

    def tok_t(r):
        return (r["token_cpu_min_ms"] if best else r["token_cpu_ms"]) if cpu else r["token_ms"]

    def fwd_t(r):
        return r["fwd_cpu_s"] if cpu else r["fwd_s"]

    def prefill_t(r):
        return r["prefill_cpu_s"] if cpu else r["prefill_s"]

    out = [f"# {args.tag}: whole models, CPU fp32, one thread ({args.metric} time)", ""]
    suffix = "" if args.metric == "cpu" else f"-{args.metric}"
    cfg = {k: sorted({r["config"][k] for r in ok.values() if "config" in r}) for k in ("vocab", "threads")}
    cfg_s = {k: ", ".join(map(str, v)) for k, v in cfg.items()}
    train_b = sorted({r["config"]["batch"] for r in ok.values() if "config" in r and "step_cpu_s" in r})
    out.append(
        f"{N_LAYERS} layers, d_model {D}, {H} heads, d_ff {D_FF}; vocabulary {cfg_s['vocab']}, training batch "
        f"{', '.join(map(str, train_b))}, decoding batch 1, threads {cfg_s['threads']}. "
        "Each cell: value (ratio to `none` of the same model and L, from this file)."
    )
    if any(len(v) > 1 for v in (*cfg.values(), train_b)):
        out.append("**Warning: this file mixes runs of different settings; ratios across them are not meaningful.**")
    order = {e: i for i, e in enumerate(DEFAULT_ENCODINGS)}

    def encs_of(prefix: str) -> list[str]:
        es = {c[len(prefix) :] for c, _ in ok if c.startswith(prefix)}
        return sorted(es, key=lambda e: (order.get(e, 999), e))

    # ---- training step
    for kind, title in (("lm", "LanguageModel (causal)"), ("classifier", "SequenceClassifier (bidirectional)")):
        prefix = f"{kind}:posenc:"
        encs = encs_of(prefix)
        if not encs:
            continue
        lengths = sorted({L for c, L in ok if c.startswith(prefix)})
        out += ["", f"## Training step: {title}", ""]
        out.append(
            "Forward + loss + backward (no optimizer step), batch 2. Time: median "
            f"{args.metric} seconds of the repeats; memory: allocator peak of one step above the level at entry "
            "(torch.profiler). Ratios: / the `none` model at the same L."
        )
        out += ["", "| encoding | " + " | ".join(f"L={L} step s | L={L} peak MB" for L in lengths) + " |"]
        out.append("|---|" + "---|---|" * len(lengths))
        rows = [(e, prefix + e) for e in encs]
        out += _rows(ok, rows, lengths, prefix + "none", [(step_t, ".3f"), (lambda r: r["peak_step_MB"], ".0f")])
        out += ["", "No-grad forward of the same batch, and the process's RSS growth during one step (ru_maxrss):", ""]
        out += ["| encoding | " + " | ".join(f"L={L} fwd s | L={L} RSS+ MB" for L in lengths) + " |"]
        out.append("|---|" + "---|---|" * len(lengths))
        out += _rows(ok, rows, lengths, prefix + "none", [(fwd_t, ".3f"), (lambda r: r["rss_step_MB"], ".0f")])

    # ---- decoding
    dec = {c for c, _ in ok if c.startswith("decode")}
    if dec:
        lengths = sorted({L for c, L in ok if c.startswith("decode")})
        cases = [f"decode:posenc:{e}" for e in encs_of("decode:posenc:")]
        cases += sorted(
            (c for c in dec if not c.startswith("decode:posenc:")), key=lambda c: (":hf" in c, c.split(":")[-1], c)
        )
        out += ["", "## KV-cache decoding: LanguageModel, batch 1", ""]
        out.append(
            "Prefill a context of L tokens, then single-token steps under `torch.no_grad` (median of the steps, "
            "after 2 warm-up steps). Peak: allocator peak of the prefill (cache included). "
            "`decode-mem:` rows decode with Transformer-XL's segment memory (each layer's input for the last L "
            "tokens, re-projected every step) instead of a KV cache. Ratios: / `decode:posenc:none`."
        )
        hdr = " | ".join(f"L={L} ms/token | L={L} prefill s | L={L} peak MB" for L in lengths)
        out += ["", f"| case | {hdr} |", "|---|" + "---|---|---|" * len(lengths)]
        rows = [(c[len("decode:posenc:") :] if c.startswith("decode:posenc:") else c, c) for c in cases]
        columns = [(tok_t, ".2f"), (prefill_t, ".3f"), (lambda r: r["peak_prefill_MB"], ".0f")]
        out += _rows(ok, rows, lengths, "decode:posenc:none", columns)

    # ---- HF beside posenc
    hf_rows = sorted(
        ((c, L) for c, L in ok if ":hf" in c and ":hfpatch:" not in c),
        key=lambda t: (not t[0].startswith("lm"), t[0].startswith("decode"), t[0], t[1]),
    )
    if hf_rows:
        out += ["", "## posenc beside the Hugging Face model of the same size", ""]
        out.append(
            "Same step, same batch, same sizes. `HF ×none`: the HF model / posenc's `none` model of the same "
            "kind; `posenc / HF`: the matching posenc encoding / the HF model (< 1: posenc faster or smaller). "
            "For decoding rows the times are ms per token."
        )
        out += [
            "",
            "| HF case | posenc match | L | HF time | HF peak MB | HF ×none time | HF ×none mem | posenc time "
            "| posenc peak MB | posenc / HF time | posenc / HF mem | params HF / posenc |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c, L in hf_rows:
            r, fl, m = ok[(c, L)], ok.get((floor_of(c), L)), ok.get((match_of(c) or "", L))
            if "token_cpu_ms" in r:
                t, mem = tok_t, (lambda x: x["peak_prefill_MB"])
                fmt = ".2f"
            else:
                t, mem = step_t, (lambda x: x["peak_step_MB"])
                fmt = ".3f"
            row = [c, (match_of(c) or "—").split(":")[-1], str(L), format(t(r), fmt), f"{mem(r):.0f}"]
            row += [f"{t(r) / t(fl):.2f}", f"{mem(r) / max(mem(fl), 1e-9):.2f}"] if fl else ["—", "—"]
            if m:
                row += [format(t(m), fmt), f"{mem(m):.0f}", f"{t(m) / t(r):.2f}", f"{mem(m) / max(mem(r), 1e-9):.2f}"]
                row.append(f"{r['n_params'] / 1e6:.2f}M / {m['n_params'] / 1e6:.2f}M")
            else:
                row += ["—"] * 5
            out.append("| " + " | ".join(row) + " |")
        out += ["", "HF models as built:", ""]
        for pid, (kind, enc, note) in HF_CASES.items():
            out.append(f"- `{kind}:{pid}` (vs posenc `{enc}`): {note}")
        for c, (enc, note) in HF_DECODE.items():
            out.append(f"- `{c}` (vs posenc `{enc}`): {note}")

    # ---- HF models patched by posenc.hf
    patched = sorted(((c, L) for c, L in ok if ":hfpatch:" in c), key=lambda t: (t[0].startswith("decode"), t))
    if patched:
        out += ["", "## Hugging Face Llama patched by posenc.hf", ""]
        out.append(
            "`lm:hf:llama` above with `posenc.hf.patch(model, <encoding>)`: its training step (or ms per decoded "
            "token) and allocator peak / the unpatched model's at the same L. Targets (issue 16): <= 1.10x for "
            "rotary encodings, <= 1.25x for biases."
        )
        out += ["", "| case | L | time | × unpatched | peak MB | × unpatched |", "|---|---|---|---|---|---|"]
        for c, L in patched:
            r, fl = ok[(c, L)], ok.get((floor_of(c), L))
            dec = "token_cpu_ms" in r
            t = tok_t if dec else step_t
            mem = (lambda x: x["peak_prefill_MB"]) if dec else (lambda x: x["peak_step_MB"])
            fmt = ".2f" if dec else ".3f"
            ratio = [f"{t(r) / t(fl):.2f}", f"{mem(r):.0f}", f"{mem(r) / max(mem(fl), 1e-9):.2f}"] if fl else [
                "—", f"{mem(r):.0f}", "—"]
            out.append(f"| {c} | {L} | {format(t(r), fmt)} | " + " | ".join(ratio) + " |")

    bad = [r for r in records if ("error" in r or "skipped" in r) and (r["case"], r["L"]) not in ok]
    if bad:
        out += ["", "## Not measured", ""]
        for r in sorted(bad, key=lambda r: (r["case"], r["L"])):
            out.append(f"- {r['case']} at L={r['L']}: {why_not(r, 300)}")
    text = "\n".join(out) + "\n"
    dest = RESULTS / f"{args.tag}{suffix}.md"
    write_report(text, dest)
    print(f"wrote {dest}")

