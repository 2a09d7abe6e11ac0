"""RULER by length, as the paper reports it: a score per task and on average for each scaling at each length, every
cell with its Wilson 95 % interval, its questions and the haystacks behind them; heatmaps; verdicts decided on the
intervals; the tasks the model is at the floor on inside its trained length (those carry no verdict).

A cell's score is the mean of RULER's ``string_match_all`` over its questions; its interval is
:func:`posenc.extend.ruler.wilson` of that mean over the question count (for a task of several references per
question, vt, cwe and fwe, this is at least as wide as needed: see there). The average over tasks is the mean of the
task scores (RULER's average); its interval adds the tasks' Wilson half-widths in quadrature over the task count
(independent tasks), and it is shown only where every task of the row was measured at that length.

A verdict compares two intervals: "A beats B" when A's lower end is above B's upper end; "no difference resolved"
when they overlap. "As trained fails past L": its interval past L lies wholly below its interval at the longest
length inside L. A task is **at the floor** inside L when the model as trained scores under :data:`FLOOR` there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import AS_TRAINED, LABELS, RULER_TASKS, SCALINGS

#: below this score inside L, with the interval's upper end below FLOOR_HIGH, a task is at the floor (no verdict);
#: a score below FLOOR on too few questions to bring the upper end under FLOOR_HIGH is said so, and not called
FLOOR, FLOOR_HIGH = 0.1, 0.5
ORDER = (AS_TRAINED, *SCALINGS)
Key = tuple[str, str, float, int]  # task, scaling, factor, tokens


@dataclass(frozen=True)
class CellScore:
    task: str
    scaling: str
    factor: float
    tokens: int
    questions: int
    haystacks: int
    score: float
    low: float
    high: float

    def text(self) -> str:
        return f"{self.score:.0%} [{self.low:.0%}–{self.high:.0%}] n={self.questions}/{self.haystacks}h"


def _wilson(successes: float, n: int) -> tuple[float, float]:
    from .ruler import wilson

    return wilson(successes, n)


def cells(records: Sequence[dict[str, Any]]) -> dict[Key, CellScore]:
    """The table's cells from the stored haystack records (kind ``ruler``)."""
    groups: dict[Key, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("kind") != "ruler":
            continue
        key = (r["task"], r["scaling"], float(r.get("factor") or 1.0), int(r["tokens"]))
        groups.setdefault(key, []).append(r)
    out = {}
    for key, rs in groups.items():
        scores = [a["score"] for r in rs for a in r["answers"]]
        lo, hi = _wilson(sum(scores), len(scores))
        out[key] = CellScore(*key, len(scores), len(rs), sum(scores) / len(scores), lo, hi)
    return out


def _order(names: Sequence[str]) -> list[str]:
    return sorted(set(names), key=lambda s: (ORDER.index(s) if s in ORDER else len(ORDER), s))


def trained_of(records: Sequence[dict[str, Any]]) -> int | None:
    return next((int(r["trained_length"]) for r in records if r.get("kind") == "ruler"), None)


def floor_tasks(records: Sequence[dict[str, Any]], trained: int | None = None) -> dict[str, str]:
    """``{task: why}``: the tasks the model as trained scores under :data:`FLOOR` on at the longest length it was
    measured at inside L (its questions there pooled)."""
    trained = trained or trained_of(records) or 0
    out = {}
    for task in RULER_TASKS:
        inside = [c for (t, s, _, n), c in cells(records).items() if t == task and s == AS_TRAINED and n <= trained]
        if not inside:
            continue
        c = max(inside, key=lambda c: c.tokens)
        if c.score < FLOOR and c.high < FLOOR_HIGH:
            out[task] = f"{c.score:.0%} [{c.low:.0%}–{c.high:.0%}] of {c.questions} question(s) at {c.tokens} tokens"
    return out


def too_few(records: Sequence[dict[str, Any]], trained: int | None = None) -> dict[str, str]:
    """The tasks scored under :data:`FLOOR` inside L on too few questions to call the floor."""
    trained = trained or trained_of(records) or 0
    floor = floor_tasks(records, trained)
    out = {}
    for task in RULER_TASKS:
        inside = [c for (t, s, _, n), c in cells(records).items() if t == task and s == AS_TRAINED and n <= trained]
        if inside and task not in floor:
            c = max(inside, key=lambda c: c.tokens)
            if c.score < FLOOR:
                out[task] = f"{c.score:.0%} [{c.low:.0%}–{c.high:.0%}] of {c.questions} question(s)"
    return out


def average(
    records: Sequence[dict[str, Any]], scaling: str, factor: float, tokens: int, tasks: Sequence[str] | None = None
) -> tuple[float, float, float, int] | None:
    """RULER's average over ``tasks`` (default: every task in the records) at one length: ``(score, low, high,
    tasks)``, or ``None`` where one of them was not measured there. One task: its own cell's interval."""
    cs = cells(records)
    if tasks is None:
        tasks = sorted({t for t, *_ in cs})
    got = [cs.get((t, scaling, factor, tokens)) for t in tasks]
    if not got or any(c is None for c in got):
        return None
    if len(got) == 1:
        return got[0].score, got[0].low, got[0].high, 1
    score = sum(c.score for c in got) / len(got)
    half = math.sqrt(sum(((c.high - c.low) / 2) ** 2 for c in got)) / len(got)
    return score, max(0.0, score - half), min(1.0, score + half), len(got)


def _mult(n: int, trained: int) -> str:
    x = n / trained
    if x == 1:
        return "L"
    return f"{x:g}L" if x >= 1 or abs(1 / x - round(1 / x)) > 1e-9 else f"L/{round(1 / x)}"


def _label(scaling: str, factor: float) -> str:
    base = LABELS.get(scaling, scaling)
    return base if scaling == AS_TRAINED else f"{base}, s={factor:g}"


def table(records: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown: a row per task and scaling, then the averages; a column per length."""
    cs = cells(records)
    if not cs:
        return []
    trained = trained_of(records) or 1
    lengths = sorted({n for *_, n in cs})
    scal = sorted({(s, f) for _, s, f, _ in cs}, key=lambda sf: (ORDER.index(sf[0]) if sf[0] in ORDER else 99, sf[1]))
    head = " | ".join(f"{_mult(n, trained)} ({n})" for n in lengths)
    lines = [
        f"RULER by length (L = {trained}): score [Wilson 95 %] n=questions/haystacks; the average is over the "
        "tasks, shown where every one was measured",
        "",
        f"| task | scaling | {head} |",
        "|---|---|" + "---:|" * len(lengths),
    ]
    for task in [t for t in RULER_TASKS if any(k[0] == t for k in cs)]:
        for s, f in scal:
            row = [cs[(task, s, f, n)].text() if (task, s, f, n) in cs else "—" for n in lengths]
            if any(x != "—" for x in row):
                lines.append(f"| {task} | {_label(s, f)} | " + " | ".join(row) + " |")
    floor = floor_tasks(records, trained)
    for name, tasks in (("average", None), ("average, tasks not at the floor", "live")):
        for s, f in scal:
            chosen = None
            if tasks == "live":
                chosen = sorted({t for t, *_ in cs if t not in floor})
                if not floor or not chosen:
                    continue
            row = []
            for n in lengths:
                a = average(records, s, f, n, chosen)
                row.append(f"{a[0]:.0%} [{a[1]:.0%}–{a[2]:.0%}] {a[3]} tasks" if a else "—")
            if all(x == "—" for x in row):
                continue
            lines.append(f"| **{name}** | {_label(s, f)} | " + " | ".join(row) + " |")
    lines.append("")
    if floor:
        lines += ["At the floor inside L (no verdict): " + "; ".join(f"{t} ({w})" for t, w in floor.items()), ""]
    few = too_few(records, trained)
    if few:
        lines += [
            "Under the floor's score inside L on too few questions to call it: "
            + "; ".join(f"{t} ({w})" for t, w in few.items()),
            "",
        ]
    return lines


def _live(records: Sequence[dict[str, Any]]) -> tuple[dict[Key, CellScore], int, dict[str, str], list[str]]:
    """The cells, the trained length, the tasks at the floor inside L and those not (in RULER's order)."""
    cs = cells(records)
    trained = trained_of(records) or 1
    floor = floor_tasks(records, trained) if cs else {}
    return cs, trained, floor, sorted({t for t, *_ in cs if t not in floor}, key=RULER_TASKS.index)


def readme_lines(records: Sequence[dict[str, Any]], link: str) -> list[str]:
    """The README's paragraph: RULER's average over the tasks the model is not at the floor on, per scaling and
    length, with its interval; ``link``: the results page's section. Nothing where there are no RULER cells."""
    cs, trained, floor, live = _live(records)
    if not cs or not live:
        return []
    lengths = sorted({n for *_, n in cs})
    scal = sorted({(s, f) for _, s, f, _ in cs}, key=lambda sf: (ORDER.index(sf[0]) if sf[0] in ORDER else 99, sf[1]))
    name = str(records[0].get("model", {}).get("name", "the model"))
    questions = sum(c.questions for c in cs.values())
    lines = [
        f"**RULER by length** ([the real model]({link})): {name} (L = {trained}), RULER's synthetic tasks, "
        f"{questions} questions, no fine-tuning: the mean score over the tasks not at the floor inside L "
        f"({', '.join(live)}) with Wilson 95 % intervals"
        + (f"; at the floor (no verdict): {', '.join(floor)}." if floor else "."),
        "",
        "| scaling | " + " | ".join(f"{_mult(n, trained)} ({n})" for n in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for s, f in scal:
        row = []
        for n in lengths:
            a = average(records, s, f, n, live)
            row.append(f"{a[0]:.0%} [{a[1]:.0%}–{a[2]:.0%}]" if a else "—")
        if any(x != "—" for x in row):
            lines.append(f"| {_label(s, f)} | " + " | ".join(row) + " |")
    return lines


#: the claim each kind of RULER verdict reads (a "quote" in quotes, else a close paraphrase), its source, and whether
#: posenc tests it as published or a question of its own
RULER_CLAIMS = {
    "fails": (
        'extrapolating RoPE past the trained context "may lead to catastrophically high attention scores that '
        'completely ruin the self-attention mechanism"; on RULER, "almost all models exhibit large performance drops '
        'as the context length increases"',
        "Chen et al. 2023, abstract; Hsieh et al. 2024, abstract",
        "as published",
    ),
    "pair": (
        "none of the papers compares these RoPE scalings of one model on RULER: which scores higher at this length "
        "is posenc's question (the scalings' own claims are on perplexity and passkey)",
        "Hsieh et al. 2024 (the tasks and their scoring); the comparison is posenc's",
        "posenc's question",
    ),
    "floor": (
        "no claim is read: the model as trained is at the floor of this task inside L",
        "Hsieh et al. 2024 (the task)",
        "posenc's question",
    ),
}


@dataclass(frozen=True)
class RulerVerdict:
    finding: str
    verdict: str  # "yes" | "no difference resolved" | "not measured" | "at the floor"
    evidence: str
    #: the claim read, as the paper states it (a "quote" in quotes, else a close paraphrase)
    claim: str = ""
    #: where it stands (author year, section)
    source: str = ""
    #: "as published" or "posenc's question"
    tests: str = "as published"


def _rv(kind: str, finding: str, verdict: str, evidence: str) -> RulerVerdict:
    claim, source, tests = RULER_CLAIMS[kind]
    return RulerVerdict(finding, verdict, evidence, claim, source, tests)


def verdicts(records: Sequence[dict[str, Any]]) -> list[RulerVerdict]:
    """Verdicts decided on the intervals, on the average of the tasks not at the floor: every pair of scalings at L
    and at every length past it, and the model as trained past L against itself inside L. Where the average
    resolves nothing, each task that resolves the comparison alone is said too ("... on niah_single_1"): RULER
    reports per task, and one task at the floor past L can hide another's clear difference in the average."""
    cs, trained, floor, live = _live(records)
    if not cs:
        return []
    out: list[RulerVerdict] = []
    if not live:
        return [
            _rv(
                "floor",
                "any verdict",
                "not measured",
                "every task measured is at the floor inside L: " + ", ".join(floor),
            )
        ]
    lengths = sorted({n for *_, n in cs})
    past = [n for n in lengths if n > trained]
    inside = [n for n in lengths if n <= trained]

    def common(pairs: Sequence[tuple[str, float, int]]) -> list[str]:
        """The tasks not at the floor measured in every (scaling, factor, length) of ``pairs``."""
        return [t for t in live if all((t, s, f, n) in cs for s, f, n in pairs)]

    def fmt(a: tuple[float, float, float, int] | None) -> str:
        return "—" if a is None else f"{a[0]:.0%} [{a[1]:.0%}–{a[2]:.0%}]"

    def over(tasks: Sequence[str]) -> str:
        return f"average of {', '.join(tasks)}" if len(tasks) > 1 else tasks[0]

    scal = sorted({(s, f) for _, s, f, _ in cs}, key=lambda sf: (ORDER.index(sf[0]) if sf[0] in ORDER else 99, sf[1]))
    # the model as trained past L, against itself at the longest length inside L where the same tasks were measured
    plain = next(((s, f) for s, f in scal if s == AS_TRAINED), None)
    if plain and inside and past:
        for n in past:
            ref_n = next((m for m in reversed(inside) if common([(*plain, m), (*plain, n)])), None)
            finding = f"as trained fails past L (at {_mult(n, trained)})"
            if ref_n is None:
                out.append(_rv("fails", finding, "not measured", "no task measured both inside L and here"))
                continue
            tasks = common([(*plain, ref_n), (*plain, n)])
            for group in [tasks, *([[t] for t in tasks] if len(tasks) > 1 else [])]:
                ref, got = average(records, *plain, ref_n, group), average(records, *plain, n, group)
                assert ref is not None and got is not None
                verdict = "yes" if got[2] < ref[1] else "no difference resolved"
                if group is not tasks and verdict != "yes":
                    continue  # a task alone is said where it resolves what the average does not
                if group is not tasks and out[-1].verdict == "yes" and out[-1].finding == finding:
                    continue
                out.append(
                    _rv(
                        "fails",
                        finding + ("" if group is tasks else f" on {group[0]}"),
                        verdict,
                        f"{over(group)}: {fmt(got)} at {_mult(n, trained)} against {fmt(ref)} at "
                        f"{_mult(ref_n, trained)}",
                    )
                )
    # every pair of scalings at L (the longest length inside) and past it
    for n in [*inside[-1:], *past]:
        for i, a in enumerate(scal):
            for b in scal[i + 1 :]:
                tasks = common([(*a, n), (*b, n)])
                if not tasks:
                    continue
                resolved = False
                # the average first; where it resolves nothing, each task alone that does (RULER reports per task)
                for group in [tasks, *([[t] for t in tasks] if len(tasks) > 1 else [])]:
                    x, y = average(records, *a, n, group), average(records, *b, n, group)
                    assert x is not None and y is not None
                    la, lb = _label(*a), _label(*b)
                    on = "" if group is tasks else f" on {group[0]}"
                    if x[1] > y[2]:
                        finding, verdict = f"{la} beats {lb} at {_mult(n, trained)}{on}", "yes"
                    elif y[1] > x[2]:
                        finding, verdict = f"{lb} beats {la} at {_mult(n, trained)}{on}", "yes"
                    else:
                        finding, verdict = f"{la} against {lb} at {_mult(n, trained)}{on}", "no difference resolved"
                    if group is not tasks and (resolved or verdict != "yes"):
                        continue
                    resolved = resolved or verdict == "yes"
                    out.append(_rv("pair", finding, verdict, f"{over(group)}: {la} {fmt(x)}, {lb} {fmt(y)}"))
    for t, why in floor.items():
        out.append(_rv("floor", f"{t}", "at the floor", f"as trained inside L: {why}; no verdict"))
    return out


def plot(records: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Heatmaps: a panel per task and one for the average (over the tasks not at the floor, where some are); rows
    the scalings, columns the lengths; each cell its score and Wilson interval."""
    cs = cells(records)
    if not cs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = trained_of(records) or 1
    lengths = sorted({n for *_, n in cs})
    scal = sorted({(s, f) for _, s, f, _ in cs}, key=lambda sf: (ORDER.index(sf[0]) if sf[0] in ORDER else 99, sf[1]))
    tasks = [t for t in RULER_TASKS if any(k[0] == t for k in cs)]
    panels = [*tasks, "average"]
    cols = min(4, len(panels))
    rws = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rws, cols, figsize=(3.2 * cols + 1, 0.55 * len(scal) * rws + 1.3 * rws), squeeze=False)
    floor = floor_tasks(records, trained)
    live = [t for t in tasks if t not in floor] if floor else None
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, name in zip(axes.flat, panels):
        grid = [[math.nan] * len(lengths) for _ in scal]
        notes = [[""] * len(lengths) for _ in scal]
        for i, (s, f) in enumerate(scal):
            for j, n in enumerate(lengths):
                if name == "average":
                    a = average(records, s, f, n, live)
                    if a:
                        grid[i][j], notes[i][j] = a[0], f"{a[0]:.0%}\n{a[1]:.0%}–{a[2]:.0%}"
                elif (name, s, f, n) in cs:
                    c = cs[(name, s, f, n)]
                    grid[i][j], notes[i][j] = c.score, f"{c.score:.0%}\n{c.low:.0%}–{c.high:.0%}\nn={c.questions}"
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(scal)):
            for j in range(len(lengths)):
                ax.text(
                    j,
                    i,
                    notes[i][j] or "not run",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if notes[i][j] else "grey",
                )
        ax.set_xticks(range(len(lengths)), [_mult(n, trained) for n in lengths], fontsize=8)
        ax.set_yticks(range(len(scal)), [_label(s, f) for s, f in scal], fontsize=8)
        title = "average, tasks not at the floor" if name == "average" and live else name
        ax.set_title(title + (" (floor)" if name in floor else ""), fontsize=9)
    fig.suptitle(f"RULER by length (L = {trained}): score and Wilson 95 % interval", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
