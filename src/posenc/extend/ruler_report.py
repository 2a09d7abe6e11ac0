"""RULER by length, as the paper reports it: a score per task for each scaling at each length, RULER's mean over the
tasks that ran, the effective length, a depth-by-length heatmap of the needle tasks, and verdicts corrected for the
number of comparisons.

**The unit is the haystack.** A cell (task, scaling, length) holds independent haystacks, each prefilled once; its
score is the mean over its haystacks of each haystack's mean ``string_match_all``. Its interval
(:func:`cluster_interval`): with one question a haystack, Wilson's over the haystacks (for a task of several
references a question, vt, cwe, fwe and the multi-value / multi-query needles, a fractional score in [0, 1] of mean
p has a variance of at most p (1 - p), so this is at least as wide as needed); with several questions on each
haystack (niah_multikey_2 / 3 with ``--questions``), the questions of a haystack are one cluster and the interval is
Wilson's at Kish's effective sample size (Kish 1965, "Survey Sampling"): ``p (1 - p)`` over the variance of the
haystack means' mean, between the haystack count (at p = 0 or 1, where that variance says nothing) and the question
count. A cell carries a verdict only with at least :data:`MIN_HAYSTACKS` haystacks.

**RULER's mean** is the mean of the task scores at one length over the tasks that ran there (RULER's "Avg."), named
with their count; its interval adds the tasks' half-widths in quadrature over the task count (independent tasks).

**Effective length** (RULER's: the longest length whose score exceeds a threshold; the paper's threshold 85.6 % is
Llama-2-7B's at 4k): the longest length up to which RULER's mean stays at or above the threshold at every length
measured, on the point estimates as RULER reads them; given at 85.6 % and at the model as trained's own mean at its
shortest length (a 135M model never reaches 85.6 %).

**Verdicts** compare two intervals at the family level (as ``posenc bench`` does, Bonferroni over the comparisons
of the table: each interval at ``1 - 0.05 / m`` for ``m`` comparisons): "yes" where they are apart there;
"suggestive" where they are apart at 95 % but not at the family level; "no difference resolved" where they overlap
at 95 %; "too few haystacks" where a cell has fewer than :data:`MIN_HAYSTACKS`. A task is **at the floor** inside L
when the model as trained scores under :data:`FLOOR` there with the interval's upper end under :data:`FLOOR_HIGH`.

Records stored under the older protocol (pieces tokenised apart, no chat template, lengths relative to L; no
``"protocol"`` key) are shown as they are, with a line that says so, where no record of RULER's protocol is there;
where both are, the older ones are left out, superseded.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import AS_TRAINED, LABELS, RULER_NOT_RUN, RULER_TASKS, SCALINGS

#: below this score inside L, with the interval's upper end below FLOOR_HIGH, a task is at the floor (no verdict)
FLOOR, FLOOR_HIGH = 0.1, 0.5
#: the fewest independent haystacks of a cell that carries a verdict
MIN_HAYSTACKS = 25
#: the family-wise error rate of the verdicts
ALPHA = 0.05
#: RULER's threshold for the effective length (Llama-2-7B at 4k; Hsieh et al. 2024, section 4)
RULER_THRESHOLD = 0.856
#: the needle tasks of the depth heatmap
NIAH_TASKS = tuple(t for t in RULER_TASKS if t.startswith("niah_"))
#: the depth bins of the heatmap (fractions of the prompt)
DEPTH_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0001)
ORDER = (AS_TRAINED, *SCALINGS)
Key = tuple[str, str, float, int]  # task, scaling, factor, tokens
OLD_NOTE = (
    "These RULER records were built under posenc's older protocol (prompt pieces tokenised apart, no chat template, "
    "lengths relative to L, 1-20 questions a cell): superseded by RULER's protocol (issue 45), shown as stored."
)
SHAPE_NOTE = (
    "Only the shape is comparable with the papers' models: they have 7B+ parameters and long-context training; "
    "RULER's published numbers are 500 samples a cell at 4k-128k tokens."
)


def _z(level: float) -> float:
    return statistics.NormalDist().inv_cdf(0.5 + level / 2)


Z95 = _z(0.95)


def _wilson(p: float, n: float, z: float) -> tuple[float, float]:
    from .._stats import wilson_bounds

    return wilson_bounds(p, n, z)  # type: ignore[arg-type]


def cluster_interval(haystacks: Sequence[Sequence[float]], z: float = Z95) -> tuple[float, float, float, float]:
    """``(score, low, high, n_eff)``: the mean of each haystack's mean score and its interval (see the module's
    text): Wilson over the haystacks with one question each; else Wilson at Kish's effective sample size."""
    if not haystacks or any(not h for h in haystacks):
        raise ValueError("cluster_interval needs at least one haystack, each with at least one score")
    means = [sum(h) / len(h) for h in haystacks]
    k = len(means)
    p = sum(means) / k
    questions = sum(len(h) for h in haystacks)
    if questions == k or p in (0.0, 1.0) or k < 2:
        n_eff = float(k)
    else:
        var = statistics.variance(means) / k  # of the mean of the haystack means
        n_eff = float(questions) if var == 0 else min(float(questions), max(1.0, p * (1 - p) / var))
    lo, hi = _wilson(p, n_eff, z)
    return p, lo, hi, n_eff


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
    scores: tuple[tuple[float, ...], ...] = field(default=(), repr=False)

    def text(self) -> str:
        few = "" if self.haystacks >= MIN_HAYSTACKS else "*"
        qs = "" if self.questions == self.haystacks else f", {self.questions}q"
        return f"{self.score:.0%} [{self.low:.0%}–{self.high:.0%}] {self.haystacks}h{qs}{few}"

    def interval(self, z: float) -> tuple[float, float]:
        return cluster_interval(self.scores, z)[1:3] if self.scores else (self.low, self.high)


def is_new(r: dict[str, Any]) -> bool:
    """Whether a record was built under RULER's protocol (issue 45)."""
    return r.get("protocol") == "ruler"


def current(records: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """The RULER records the report reads and whether they are of the older protocol (only where no new one is)."""
    rs = [r for r in records if r.get("kind") == "ruler"]
    new = [r for r in rs if is_new(r)]
    return (new, False) if new else (rs, bool(rs))


def cells(records: Sequence[dict[str, Any]]) -> dict[Key, CellScore]:
    """The table's cells from the stored haystack records (kind ``ruler``; see :func:`current`)."""
    groups: dict[Key, list[dict[str, Any]]] = {}
    for r in current(records)[0]:
        key = (r["task"], r["scaling"], float(r.get("factor") or 1.0), int(r["tokens"]))
        groups.setdefault(key, []).append(r)
    out = {}
    for key, rs in groups.items():
        scores = tuple(tuple(float(a["score"]) for a in r["answers"]) for r in rs if r["answers"])
        p, lo, hi, _ = cluster_interval(scores)
        out[key] = CellScore(*key, sum(len(s) for s in scores), len(scores), p, lo, hi, scores)
    return out


def _order(names: Sequence[str]) -> list[str]:
    return sorted(set(names), key=lambda s: (ORDER.index(s) if s in ORDER else len(ORDER), s))


def _scalings(cs: dict[Key, CellScore]) -> list[tuple[str, float]]:
    return sorted({(s, f) for _, s, f, _ in cs}, key=lambda sf: (ORDER.index(sf[0]) if sf[0] in ORDER else 99, sf[1]))


def trained_of(records: Sequence[dict[str, Any]]) -> int | None:
    return next((int(r["trained_length"]) for r in records if r.get("kind") == "ruler"), None)


def floor_tasks(records: Sequence[dict[str, Any]], trained: int | None = None) -> dict[str, str]:
    """``{task: why}``: the tasks the model as trained scores under :data:`FLOOR` on at the longest length it was
    measured at inside L."""
    trained = trained or trained_of(records) or 0
    cs = cells(records)
    out = {}
    for task in RULER_TASKS:
        inside = [c for (t, s, _, n), c in cs.items() if t == task and s == AS_TRAINED and n <= trained]
        if not inside:
            continue
        c = max(inside, key=lambda c: c.tokens)
        if c.score < FLOOR and c.high < FLOOR_HIGH:
            out[task] = f"{c.score:.0%} [{c.low:.0%}–{c.high:.0%}] of {c.haystacks} haystack(s) at {c.tokens} tokens"
    return out


def too_few(records: Sequence[dict[str, Any]], trained: int | None = None) -> dict[str, str]:
    """The tasks scored under :data:`FLOOR` inside L on too few haystacks to call the floor."""
    trained = trained or trained_of(records) or 0
    floor = floor_tasks(records, trained)
    cs = cells(records)
    out = {}
    for task in RULER_TASKS:
        inside = [c for (t, s, _, n), c in cs.items() if t == task and s == AS_TRAINED and n <= trained]
        if inside and task not in floor:
            c = max(inside, key=lambda c: c.tokens)
            if c.score < FLOOR:
                out[task] = f"{c.score:.0%} [{c.low:.0%}–{c.high:.0%}] of {c.haystacks} haystack(s)"
    return out


def average(
    records: Sequence[dict[str, Any]],
    scaling: str,
    factor: float,
    tokens: int,
    tasks: Sequence[str] | None = None,
    z: float = Z95,
    cs: dict[Key, CellScore] | None = None,
) -> tuple[float, float, float, int] | None:
    """RULER's mean over ``tasks`` (default: every task in the records) at one length: ``(score, low, high,
    tasks)``, or ``None`` where one of them was not measured there. One task: its own cell's interval."""
    cs = cells(records) if cs is None else cs
    if tasks is None:
        tasks = sorted({t for t, *_ in cs})
    got = [cs.get((t, scaling, factor, tokens)) for t in tasks]
    if not got or any(c is None for c in got):
        return None
    ivs = [c.interval(z) for c in got if c is not None]
    if len(got) == 1:
        return got[0].score, ivs[0][0], ivs[0][1], 1  # type: ignore[union-attr]
    score = sum(c.score for c in got if c is not None) / len(got)
    half = math.sqrt(sum(((hi - lo) / 2) ** 2 for lo, hi in ivs)) / len(got)
    return score, max(0.0, score - half), min(1.0, score + half), len(got)


def _mult(n: int, trained: int) -> str:
    x = n / trained
    if x == 1:
        return "L"
    return f"{x:g}L" if x >= 1 or abs(1 / x - round(1 / x)) > 1e-9 else f"L/{round(1 / x)}"


def _label(scaling: str, factor: float) -> str:
    base = LABELS.get(scaling, scaling)
    return base if scaling == AS_TRAINED else f"{base}, s={factor:g}"


def _tasks_that_ran(cs: dict[Key, CellScore]) -> list[str]:
    return [t for t in RULER_TASKS if any(k[0] == t for k in cs)]


def means(records: Sequence[dict[str, Any]]) -> dict[tuple[str, float], dict[int, tuple[float, float, float, int]]]:
    """RULER's mean over the tasks that ran, per scaling and length (only where every one of them was measured)."""
    cs = cells(records)
    tasks = _tasks_that_ran(cs)
    out: dict[tuple[str, float], dict[int, tuple[float, float, float, int]]] = {}
    for s, f in _scalings(cs):
        for n in sorted({n for *_, n in cs}):
            a = average(records, s, f, n, tasks, cs=cs)
            if a is not None:
                out.setdefault((s, f), {})[n] = a
    return out


def effective_length(scores: dict[int, float], threshold: float) -> int | None:
    """The longest length up to which every score (by length) is at or above ``threshold``; ``None`` where the
    shortest is below it."""
    best = None
    for n in sorted(scores):
        if scores[n] < threshold:
            break
        best = n
    return best


def effective_lengths(records: Sequence[dict[str, Any]]) -> list[tuple[str, float, int | None, int | None, float]]:
    """Per scaling: ``(scaling, factor, at RULER's 85.6 %, at the model's own threshold, that threshold)``; the own
    threshold is the model as trained's RULER mean at its shortest length."""
    m = means(records)
    plain = next((v for (s, _), v in m.items() if s == AS_TRAINED), None)
    own = plain[min(plain)][0] if plain else None
    out = []
    for (s, f), by in m.items():
        pts = {n: a[0] for n, a in by.items()}
        mine = effective_length(pts, own) if own is not None else None
        out.append((s, f, effective_length(pts, RULER_THRESHOLD), mine, own if own is not None else math.nan))
    return out


def environments(records: Sequence[dict[str, Any]]) -> list[str]:
    """Each environment of the RULER records once: the machine (what the records share), then the posenc commits
    they were measured at."""
    from ..runenv import machines_and_commits

    envs = [r.get("env") or {} for r in current(records)[0]]
    if not envs:
        return []
    machine, commits = machines_and_commits(envs)
    return [f"Machine: {' / '.join(machine)}", f"posenc commits: {', '.join(commits) or 'not recorded'}"]


def table(records: Sequence[dict[str, Any]], *, environment: bool = True) -> list[str]:
    """Markdown: a row per task and scaling, then RULER's mean; a column per length; then the effective length and
    the notes (the substitution, the tasks not run, the older protocol, the shape, the environment; ``environment``
    off where the page around the table names the machine already)."""
    from .ruler_prose import SUBSTITUTE

    cs = cells(records)
    if not cs:
        return []
    _, old = current(records)
    trained = trained_of(records) or 1
    lengths = sorted({n for *_, n in cs})
    scal = _scalings(cs)
    tasks = _tasks_that_ran(cs)
    head = " | ".join(f"{n} ({_mult(n, trained)})" for n in lengths)
    lines = [
        f"RULER by length (L = {trained}): score [Wilson 95 %, clustered by haystack] and haystacks (h; q: questions "
        f"where a haystack carries several); * fewer than {MIN_HAYSTACKS} haystacks, no verdict",
        "",
        f"| task | scaling | {head} |",
        "|---|---|" + "---:|" * len(lengths),
    ]
    for task in tasks:
        for s, f in scal:
            row = [cs[(task, s, f, n)].text() if (task, s, f, n) in cs else "—" for n in lengths]
            if any(x != "—" for x in row):
                lines.append(f"| {task} | {_label(s, f)} | " + " | ".join(row) + " |")
    m = means(records)
    name = f"RULER mean over the {len(tasks)} tasks that ran"
    for s, f in scal:
        row = [f"{a[0]:.0%} [{a[1]:.0%}–{a[2]:.0%}]" if (a := m.get((s, f), {}).get(n)) else "—" for n in lengths]
        if any(x != "—" for x in row):
            lines.append(f"| **{name}** | {_label(s, f)} | " + " | ".join(row) + " |")
    lines.append("")
    eff = effective_lengths(records)
    if eff:
        own = eff[0][4]
        lines += [
            f"Effective length (the longest length up to which RULER's mean stays at or above the threshold; point "
            f"estimates, as RULER reads them): at RULER's {RULER_THRESHOLD:.1%} and at the model as trained's own "
            f"mean at its shortest length ({own:.0%})",
            "",
            f"| scaling | at {RULER_THRESHOLD:.1%} | at {own:.0%} (own) |",
            "|---|---:|---:|",
        ]
        for s, f, ruler_eff, mine, _ in eff:
            fmt = [f"{x}" if x is not None else f"below {lengths[0]}" for x in (ruler_eff, mine)]
            lines.append(f"| {_label(s, f)} | {fmt[0]} | {fmt[1]} |")
        lines.append("")
    notes = []
    if any(
        t in tasks for t in ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")
    ):
        notes.append(f"Substitution: {SUBSTITUTE}.")
    missing = [t for t in RULER_TASKS if t not in tasks]
    notes.append(
        f"{len(tasks)} of RULER's 13 tasks ran; not run: "
        + "; ".join([*(f"{t} ({why})" for t, why in RULER_NOT_RUN.items()), *(f"{t} (not asked)" for t in missing)])
        + "."
    )
    if old:
        notes.append(OLD_NOTE)
    floor = floor_tasks(records, trained)
    if floor:
        notes.append("At the floor inside L (no verdict): " + "; ".join(f"{t} ({w})" for t, w in floor.items()) + ".")
    few = too_few(records, trained)
    if few:
        notes.append(
            "Under the floor's score inside L on too few haystacks to call it: "
            + "; ".join(f"{t} ({w})" for t, w in few.items())
            + "."
        )
    notes.append(SHAPE_NOTE)
    if environment:
        notes += [e + "." for e in environments(records)]
    for note in notes:
        lines += [note, ""]
    return lines


def readme_lines(records: Sequence[dict[str, Any]], link: str) -> list[str]:
    """The README's paragraph: RULER's mean over the tasks that ran, per scaling and length, with its interval;
    ``link``: the results page's section. Nothing where there are no RULER cells."""
    cs = cells(records)
    if not cs:
        return []
    trained = trained_of(records) or 1
    lengths = sorted({n for *_, n in cs})
    tasks = _tasks_that_ran(cs)
    _, old = current(records)
    name = str(records[0].get("model", {}).get("name", "the model"))
    hay = sum(c.haystacks for c in cs.values())
    if old:  # no table of superseded numbers on the front page: the page keeps them, marked
        return [
            f"**RULER by length** ([the real model]({link})): {name}'s {hay} stored haystacks are under the older "
            "protocol (superseded); the run under RULER's own protocol is still to come."
        ]
    lines = [
        f"**RULER by length** ([the real model]({link})): {name} (L = {trained}), {len(tasks)} of RULER's 13 tasks, "
        f"{hay} haystacks, no fine-tuning: RULER's mean over the {len(tasks)} tasks that ran, with 95 % intervals"
        + (" (older protocol: superseded, see the page)." if old else "."),
        "",
        "| scaling | " + " | ".join(f"{n} ({_mult(n, trained)})" for n in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    m = means(records)
    for s, f in _scalings(cs):
        row = [f"{a[0]:.0%} [{a[1]:.0%}–{a[2]:.0%}]" if (a := m.get((s, f), {}).get(n)) else "—" for n in lengths]
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
    verdict: str  # "yes" | "suggestive" | "no difference resolved" | "too few haystacks" | "not measured" | ...
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


@dataclass(frozen=True)
class _Comparison:
    kind: str
    finding: str  # with {better} / {worse} where the order is read from the data
    a: tuple[str, float, int]  # (scaling, factor, tokens)
    b: tuple[str, float, int]
    tasks: tuple[str, ...]
    whole: bool  # the mean over the tasks both sides measured (else one task of them)


def verdicts(records: Sequence[dict[str, Any]]) -> list[RulerVerdict]:
    """Verdicts on the intervals at the family level (see the module's text): the model as trained past L against
    itself at the longest length inside L, and every pair of scalings at L and past it; each on RULER's mean over
    the tasks not at the floor that both sides measured, and on each such task alone (said where it resolves
    more than the mean does)."""
    cs = cells(records)
    if not cs:
        return []
    trained = trained_of(records) or 1
    floor = floor_tasks(records, trained)
    live = [t for t in _tasks_that_ran(cs) if t not in floor]
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
    scal = _scalings(cs)

    def common(pairs: Sequence[tuple[str, float, int]]) -> tuple[str, ...]:
        return tuple(t for t in live if all((t, s, f, n) in cs for s, f, n in pairs))

    comps: list[_Comparison] = []
    plain = next(((s, f) for s, f in scal if s == AS_TRAINED), None)
    if plain and inside:
        for n in past:
            ref = next((m for m in reversed(inside) if common([(*plain, m), (*plain, n)])), None)
            if ref is None:
                continue
            tasks = common([(*plain, ref), (*plain, n)])
            for group in [tasks, *([(t,) for t in tasks] if len(tasks) > 1 else [])]:
                comps.append(
                    _Comparison(
                        "fails",
                        f"as trained fails past L (at {n} tokens, {_mult(n, trained)})",
                        (*plain, n),
                        (*plain, ref),
                        group,
                        group is tasks,
                    )
                )
    for n in [*inside[-1:], *past]:
        for i, a in enumerate(scal):
            for b in scal[i + 1 :]:
                tasks = common([(*a, n), (*b, n)])
                for group in [tasks, *([(t,) for t in tasks] if len(tasks) > 1 else [])] if tasks else []:
                    comps.append(
                        _Comparison(
                            "pair",
                            f"{{x}} at {n} tokens ({_mult(n, trained)})",
                            (*a, n),
                            (*b, n),
                            group,
                            group is tasks,
                        )
                    )
    m = max(1, len(comps))
    z_family = _z(1 - ALPHA / m)

    def fmt(a: tuple[float, float, float, int] | None) -> str:
        return "—" if a is None else f"{a[0]:.0%} [{a[1]:.0%}–{a[2]:.0%}]"

    out: list[RulerVerdict] = []
    said: set[tuple[str, Any, Any]] = set()  # (kind, a, b) whose mean resolved at the family level
    for c in comps:
        whole = c.whole
        over = f"RULER mean over {', '.join(c.tasks)}" if len(c.tasks) > 1 else c.tasks[0]
        few = [t for t in c.tasks for side in (c.a, c.b) if cs[(t, *side)].haystacks < MIN_HAYSTACKS]
        x95, y95 = average(records, *c.a, c.tasks, cs=cs), average(records, *c.b, c.tasks, cs=cs)
        xf, yf = average(records, *c.a, c.tasks, z=z_family, cs=cs), average(records, *c.b, c.tasks, z=z_family, cs=cs)
        assert x95 and y95 and xf and yf
        la, lb = _label(*c.a[:2]), _label(*c.b[:2])
        if c.kind == "fails":
            apart_f, apart_95 = xf[2] < yf[1], x95[2] < y95[1]
            finding = c.finding
            ev = f"{over}: {fmt(x95)} at {c.a[2]} against {fmt(y95)} at {c.b[2]} (95 %)"
        else:
            a_up = x95[0] >= y95[0]
            apart_95 = x95[1] > y95[2] or y95[1] > x95[2]
            apart_f = xf[1] > yf[2] or yf[1] > xf[2]
            what = f"{la} beats {lb}" if a_up else f"{lb} beats {la}"
            resolved = apart_95 and all(
                cs[(t, *side)].haystacks >= MIN_HAYSTACKS for t in c.tasks for side in (c.a, c.b)
            )
            finding = c.finding.format(x=what if resolved else f"{la} against {lb}")
            ev = f"{over}: {la} {fmt(x95)}, {lb} {fmt(y95)} (95 %)"
        if not whole:
            finding += f" on {c.tasks[0]}"
        if few:
            verdict = "too few haystacks"
            ev += f"; fewer than {MIN_HAYSTACKS} haystacks in {', '.join(sorted(set(few)))}"
        elif apart_f:
            verdict = "yes"
        elif apart_95:
            verdict = "suggestive"
        else:
            verdict = "no difference resolved"
        ev += f"; {m} comparisons, family level {1 - ALPHA / m:.4g}"
        pair = (c.kind, c.a, c.b)
        if whole:
            if verdict == "yes":
                said.add(pair)
            out.append(_rv(c.kind, finding, verdict, ev))
        elif verdict in ("yes", "suggestive") and pair not in said:
            out.append(_rv(c.kind, finding, verdict, ev))
    for t, why in floor.items():
        out.append(_rv("floor", f"{t}", "at the floor", f"as trained inside L: {why}; no verdict"))
    return out


def depth_grid(
    records: Sequence[dict[str, Any]], scaling: str, factor: float
) -> tuple[list[int], list[list[float]], list[list[int]]]:
    """The needle tasks' questions of one scaling by depth bin (:data:`DEPTH_BINS`, rows) and length (columns):
    ``(lengths, mean scores (NaN: none), question counts)``."""
    rs = [
        r
        for r in current(records)[0]
        if r["task"] in NIAH_TASKS and r["scaling"] == scaling and float(r.get("factor") or 1.0) == factor
    ]
    lengths = sorted({int(r["tokens"]) for r in rs})
    bins = len(DEPTH_BINS) - 1
    tot = [[0.0] * len(lengths) for _ in range(bins)]
    cnt = [[0] * len(lengths) for _ in range(bins)]
    for r in rs:
        j = lengths.index(int(r["tokens"]))
        for a in r["answers"]:
            d = a.get("depth")
            if d is None:
                continue
            i = next(b for b in range(bins) if DEPTH_BINS[b] <= d < DEPTH_BINS[b + 1])
            tot[i][j] += float(a["score"])
            cnt[i][j] += 1
    grid = [[tot[i][j] / cnt[i][j] if cnt[i][j] else math.nan for j in range(len(lengths))] for i in range(bins)]
    return lengths, grid, cnt


def plot(records: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Heatmaps: a panel per task and one for RULER's mean (rows the scalings, columns the lengths, each cell its
    score and interval), then the needle tasks' depth-by-length panels, one per scaling."""
    cs = cells(records)
    if not cs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = trained_of(records) or 1
    lengths = sorted({n for *_, n in cs})
    scal = _scalings(cs)
    tasks = _tasks_that_ran(cs)
    m = means(records)
    has_depth = any(
        a.get("depth") is not None for r in current(records)[0] if r["task"] in NIAH_TASKS for a in r["answers"]
    )
    panels: list[tuple[str, Any]] = [*((t, None) for t in tasks), ("mean", None)]
    if has_depth:
        panels += [("depth", sf) for sf in scal]
    cols = min(4, len(panels))
    rws = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rws, cols, figsize=(3.4 * cols + 1, max(0.55 * len(scal), 2.6) * rws + 1.0), squeeze=False)
    floor = floor_tasks(records, trained)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (name, sf) in zip(axes.flat, panels):
        if name == "depth":
            ls, grid, cnt = depth_grid(records, *sf)
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
            for i in range(len(grid)):
                for j in range(len(ls)):
                    txt = f"{grid[i][j]:.0%}\nn={cnt[i][j]}" if cnt[i][j] else "none"
                    ax.text(j, i, txt, ha="center", va="center", fontsize=6.5, color="black" if cnt[i][j] else "grey")
            ax.set_xticks(range(len(ls)), [str(n) for n in ls], fontsize=7)
            ax.set_yticks(
                range(len(DEPTH_BINS) - 1),
                [f"{DEPTH_BINS[b]:.0%}–{min(DEPTH_BINS[b + 1], 1):.0%}" for b in range(len(DEPTH_BINS) - 1)],
                fontsize=7,
            )
            ax.set_ylabel("needle depth", fontsize=7)
            ax.set_title(f"needle tasks by depth: {_label(*sf)}", fontsize=8)
            continue
        grid = [[math.nan] * len(lengths) for _ in scal]
        notes = [[""] * len(lengths) for _ in scal]
        for i, (s, f) in enumerate(scal):
            for j, n in enumerate(lengths):
                if name == "mean":
                    a = m.get((s, f), {}).get(n)
                    if a:
                        grid[i][j], notes[i][j] = a[0], f"{a[0]:.0%}\n{a[1]:.0%}–{a[2]:.0%}"
                elif (name, s, f, n) in cs:
                    c = cs[(name, s, f, n)]
                    grid[i][j], notes[i][j] = c.score, f"{c.score:.0%}\n{c.low:.0%}–{c.high:.0%}\n{c.haystacks}h"
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(scal)):
            for j in range(len(lengths)):
                ax.text(
                    j,
                    i,
                    notes[i][j] or "not run",
                    ha="center",
                    va="center",
                    fontsize=6.5,
                    color="black" if notes[i][j] else "grey",
                )
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(scal)), [_label(s, f) for s, f in scal], fontsize=7)
        title = f"RULER mean, {len(tasks)} tasks" if name == "mean" else name
        ax.set_title(title + (" (floor)" if name in floor else ""), fontsize=8)
    _, old = current(records)
    fig.suptitle(
        f"RULER by length (L = {trained}; tokens): score and Wilson 95 % interval, clustered by haystack"
        + (" (older protocol, superseded)" if old else ""),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
