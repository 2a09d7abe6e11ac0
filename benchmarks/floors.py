"""Each encoding's floor in the whole-model benchmark, and the table that measures ``bench_models.py`` against it.

The floor is the ratio of FLOPs the encoding's maths sets for one model step, to the FLOPs of the same model with
no encoding (``none``): ``(F_none + F_extra) / F_none``. ``F_extra`` comes from the encoding's own declaration
(:meth:`posenc.base.PositionalEncoding.cost`: products and elementwise work per pair, per token, per row of a
position table, per embedded token), nothing here lists encodings. ``F_none`` counts the model's matrix products
(``tests/test_floors.py`` checks the count against ``torch.utils.flop_counter`` on a ``none`` model):

* per layer: the q, k, v, o projections ``4 · 2·L·D²``, the MLP ``2 · 2·L·D·D_ff``, the attention's ``q·k`` and
  ``p·v`` ``2 · 2·d`` per pair and head (causal: the ``L(L+1)/2`` pairs a query may see); then the output layer
  ``2·L·D·V`` (the classifier's: ``2·D·2`` per sequence after pooling);
* a training step is forward + backward, about 3 forwards for the model and the encoding alike, so its floor is
  the forward's ratio;
* a decoding step is one token against a cache of C keys (batch 1): the per-token work of one token, ``C + 1``
  pairs per head, and no position table (a table of parameters only is kept between steps; a table of offsets
  gains one row per step).

Elementwise work (softmax, norms, GELU) is not in ``F_none``; an encoding's elementwise work is in ``F_extra``, so
a bias add's floor is a little above 1 rather than exactly 1. Time per FLOP differs between products and
elementwise passes: the floor is what the arithmetic sets, and ``measured / floor`` says how far a kernel is from it.

The report (``bench_models.py floors``) reads results files (``results/<tag>.json``, one per round: each time is the
median over the files that have it) and prints one table per (kind, L, threads): encoding | floor | measured ratio
to none | measured / floor | memory ratio to none | bound.
Targets (issue 25): measured / floor <= 1.10; memory <= 1.5x ``none`` unless the encoding declares an inherent
``O(L²)`` bound (``Cost.memory``), which the table then prints.

What it may import: the standard library, :mod:`harness` and :mod:`model_cases` at import time; ``posenc`` (to
build an encoding and read its declaration) inside the functions.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from attention_cases import ENC_OPTIONS
from harness import RESULTS, load, write_report
from model_cases import D_FF, DEFAULT_ENCODINGS, DH, N_CLASSES, N_LAYERS, D, H

TIME_TARGET = 1.10  # measured / floor
DECODE_ROOM = 35  # tokens a decoding case adds to its context (bench_models: 2 warm-up + 1 + 32 steps)
MEMORY_TARGET = 1.5  # peak / none's, for an encoding with no inherent O(L²) memory


@dataclass(frozen=True)
class Step:
    """One model step: ``kind`` ``lm`` (causal training), ``classifier`` (bidirectional training) or ``decode``
    (one token against a cache of ``L`` keys), at batch ``batch`` and vocabulary ``vocab``."""

    kind: str
    L: int
    batch: int
    vocab: int

    @property
    def causal(self) -> bool:
        return self.kind != "classifier"

    def queries(self) -> int:
        return 1 if self.kind == "decode" else self.L

    def pairs(self) -> int:
        """Query-key pairs per sequence and head that the maths needs."""
        if self.kind == "decode":
            return self.L + 1
        return self.L * (self.L + 1) // 2 if self.causal else self.L * self.L


def model_products(step: Step) -> float:
    """Matrix-product FLOPs of one forward of the ``none`` model (see the module docstring)."""
    n = step.batch * step.queries()  # tokens that go through the layers
    per_layer = 8.0 * n * D * D + 4.0 * n * D * D_FF + 4.0 * D * step.batch * step.pairs()
    head = 2.0 * D * N_CLASSES * step.batch if step.kind == "classifier" else 2.0 * n * D * step.vocab
    return N_LAYERS * per_layer + head


def extra_work(cost, step: Step) -> float:
    """FLOPs one forward spends on the encoding, from its :class:`posenc.base.Cost`."""
    n = step.batch * step.queries()
    pairs = step.batch * step.pairs() * H * (cost.pair + cost.pair_elementwise)
    tokens = n * H * (cost.token + cost.token_elementwise)
    if step.kind == "decode":  # a table of parameters is kept; a table of offsets gains the new offset's row
        rows = 0 if cost.rows is not None else 1
    else:  # the offsets the pairs take: 0 .. L-1 (causal) or -(L-1) .. L-1
        rows = cost.table_rows(step.L if step.causal else 2 * step.L - 1)
    embed = n * (cost.embed + cost.embed_elementwise)
    return N_LAYERS * (pairs + tokens + rows * cost.row) + embed


def declared_cost(encoding: str, max_len: int, vocab: int):
    """The :class:`posenc.base.Cost` of ``encoding`` as the benchmark's model builds it (its options included)."""
    import posenc  # noqa: F401
    from posenc.registry import build

    dims = dict(d_model=D, n_heads=H, head_dim=DH, max_len=max_len, vocab_size=vocab, n_layers=N_LAYERS, causal=True)
    return build(encoding, dims=dims, options=dict(ENC_OPTIONS.get(encoding, {})) or None).cost(DH)


def step_cost(encoding: str, step: Step):
    """The declared cost of ``encoding`` built as the model of ``step`` builds it (``max_len`` the longest call)."""
    return declared_cost(encoding, step.L + (DECODE_ROOM if step.kind == "decode" else 0), step.vocab)


def floor(encoding: str, step: Step, cost=None) -> float:
    """The floor of ``encoding`` at ``step``: the model's FLOPs with it / without it."""
    cost = step_cost(encoding, step) if cost is None else cost
    return 1.0 + extra_work(cost, step) / model_products(step)


# ============================================================================ the report
def _time(rec: dict, metric: str) -> float:
    dec = "token_cpu_ms" in rec
    if metric == "wall":
        return rec["token_ms"] if dec else rec["step_s"]
    if metric == "cpu-min":
        return rec["token_cpu_min_ms"] if dec else rec["step_cpu_min_s"]
    return rec["token_cpu_ms"] if dec else rec["step_cpu_s"]


def _memory(rec: dict) -> float:
    return rec["peak_prefill_MB"] if "token_cpu_ms" in rec else rec["peak_step_MB"]


def _median(records: list[dict], value, *args) -> float:
    """The median of ``value(record, *args)`` over the rounds' records of one case."""
    return statistics.median(value(r, *args) for r in records)


def _mark(ok: bool) -> str:
    return "" if ok else " ✗"


def floors_table(records: list[dict], metric: str = "auto") -> str:
    """The Markdown tables of ``records`` (``bench_models.py`` records, of one or more results files)."""
    ok = [r for r in records if "error" not in r and "skipped" not in r and ":posenc:" in r["case"]]
    groups: dict[tuple, dict[str, dict]] = {}
    for r in ok:
        kind, _, enc = r["case"].split(":", 2)
        if kind not in ("lm", "classifier", "decode"):
            continue
        cfg = r.get("config", {})
        key = (kind, r["L"], cfg.get("threads", 1), cfg.get("batch", 1 if kind == "decode" else 2), cfg.get("vocab"))
        groups.setdefault(key, {}).setdefault(enc, []).append(r)  # one record per results file (round)
    order = {e: i for i, e in enumerate(DEFAULT_ENCODINGS)}
    titles = {"lm": "training step, LanguageModel (causal)", "classifier": "training step, SequenceClassifier",
              "decode": "KV-cache decoding, ms per token"}  # fmt: skip
    out = ["# Floors: each encoding's model step against the limit its maths sets", ""]
    out.append(
        f"{N_LAYERS} layers, d_model {D}, {H} heads, d_ff {D_FF}. Floor: the step's FLOPs with the encoding / "
        "without (benchmarks/floors.py, from each encoding's declared cost). Measured: its time / `none`'s in the "
        "same setting (medians over the rounds: the results files read). ✗: above the targets (measured / floor "
        f"<= {TIME_TARGET}, memory <= {MEMORY_TARGET}x none unless a bound is declared)."
    )
    for key in sorted(groups, key=lambda k: (["lm", "classifier", "decode"].index(k[0]), k[2], k[1])):
        kind, L, threads, batch, vocab = key
        rows = groups[key]
        if "none" not in rows or vocab is None:
            continue
        use = metric if metric != "auto" else ("cpu" if threads == 1 else "wall")

        step = Step(kind, L, batch, vocab)
        label = "context" if kind == "decode" else "L"
        rounds = max(len(v) for v in rows.values())
        out += ["", f"## {titles[kind]}: {label}={L}, {threads} thread(s), batch {batch} ({use} time, median of "
                f"{rounds} round(s))", ""]  # fmt: skip
        out += ["| encoding | floor | measured / none | measured / floor | memory / none | bound |"]
        out.append("|---|---|---|---|---|---|")
        for enc in sorted(rows, key=lambda e: (order.get(e, 999), e)):
            cost = step_cost(enc, step)
            fl = floor(enc, step, cost)
            ratio = _median(rows[enc], _time, use) / _median(rows["none"], _time, use)
            mem = _median(rows[enc], _memory) / max(_median(rows["none"], _memory), 1e-9)
            bound = cost.memory or f"<= {MEMORY_TARGET}x"
            mem_ok = cost.memory is not None or mem <= MEMORY_TARGET
            out.append(
                f"| {enc} | {fl:.3f} | {ratio:.3f} | {ratio / fl:.3f}{_mark(ratio / fl <= TIME_TARGET)} "
                f"| {mem:.2f}{_mark(mem_ok)} | {bound} |"
            )
    return "\n".join(out) + "\n"


def report(args: argparse.Namespace) -> None:
    """``bench_models.py floors``: the tables of ``results/<tag>.json`` for each ``--tags``, into
    ``results/<first tag>-floors.md``."""
    records = [r for tag in args.tags for r in load(RESULTS / f"{tag}.json")]
    dest = RESULTS / f"{args.tags[0]}-floors.md"
    write_report(floors_table(records, args.metric), dest)
    print(f"wrote {dest}")
