"""The numbers ``posenc extend``'s report reads from the stored cells (the loss of a span of positions, the
passkey grid) and the verdict per published shape decided on them, each with the paper's claim as it states it,
its source, and whether posenc tests it as published (:mod:`posenc.extend.report` shows them; see its docstring
for the shapes and the rules).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._stats import wilson_bounds
from .config import AS_TRAINED, LABELS, SCALINGS


# ---------------------------------------------------------------------------------------------- numbers
def loss_groups(records: Sequence[dict[str, Any]]) -> dict[str, dict[float, dict[str, dict[str, Any]]]]:
    """``{document: {factor: {scaling: record}}}``: the scaled curves of each factor (the longest per scaling),
    with the model as trained (its longest curve) in every group; the groups in ascending factor."""
    plain: dict[str, dict[str, Any]] = {}
    scaled: dict[str, dict[float, dict[str, dict[str, Any]]]] = {}
    for r in records:
        if r.get("kind") != "loss":
            continue
        doc = r["document"]
        if r["scaling"] == AS_TRAINED:
            if doc not in plain or r["tokens"] > plain[doc]["tokens"]:
                plain[doc] = r
            scaled.setdefault(doc, {})
            continue
        group = scaled.setdefault(doc, {}).setdefault(float(r.get("factor") or 1.0), {})
        cur = group.get(r["scaling"])
        if cur is None or r["tokens"] > cur["tokens"]:
            group[r["scaling"]] = r
    out: dict[str, dict[float, dict[str, dict[str, Any]]]] = {}
    for doc, groups in scaled.items():
        if not groups:
            groups = {1.0: {}}
        out[doc] = {f: ({AS_TRAINED: plain[doc]} if doc in plain else {}) | groups[f] for f in sorted(groups)}
    return out


def comparison_set(records: Sequence[dict[str, Any]]) -> tuple[str | None, float | None, dict[str, dict[str, Any]]]:
    """The first document's curves that the verdicts compare: the factor most scalings were measured at (the
    smaller on a tie), so that no scaling is compared with another aiming at a longer context."""
    groups = loss_groups(records)
    doc = next(iter(groups), None)
    if doc is None:
        return None, None, {}
    factor = max(groups[doc], key=lambda f: (len(groups[doc][f]), -f))
    return doc, factor, groups[doc][factor]


def mean_loss(record: dict[str, Any], start: int, stop: int) -> float | None:
    """The mean next-token loss of the positions ``[start, stop)`` (position t predicts token t + 1), from the
    stored bins; ``None`` where the curve does not reach ``stop``. Exact where ``start`` and ``stop`` fall on
    bin edges (multiples of the bin, or the curve's end: the table's lengths do); a bin cut by them counts
    with its mean."""
    n = record["tokens"] - 1  # losses stored
    if stop > n or start >= stop:
        return None
    b = record["bin"]
    bins = record["loss_bins"]
    total = weight = 0.0
    for i, v in enumerate(bins):
        lo, hi = i * b, min((i + 1) * b, n)
        overlap = min(hi, stop) - max(lo, start)
        if overlap > 0:
            total += v * overlap
            weight += overlap
    return total / weight if weight else None


def perplexity(record: dict[str, Any], start: int, stop: int) -> float | None:
    m = mean_loss(record, start, stop)
    return None if m is None else math.exp(m)


def table_lengths(trained: int, longest: int) -> list[int]:
    """Prefix lengths for the table: 1/4, 1/2, 1, 1.5, 2, 3, 4 ... times L, up to the longest curve."""
    mults = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
    return [int(m * trained) for m in mults if int(m * trained) <= longest]


def passkey_grid(records: Sequence[dict[str, Any]]) -> dict[str, dict[tuple[int, float], dict[str, Any]]]:
    out: dict[str, dict[tuple[int, float], dict[str, Any]]] = {}
    for r in records:
        if r.get("kind") == "passkey":
            out.setdefault(r["scaling"], {})[(r["tokens"], float(r["depth"]))] = r
    return out


def passkey_accuracy(cells: dict[tuple[int, float], dict[str, Any]], lo: int, hi: int) -> tuple[float, int] | None:
    """The share of retrieved keys among the cells of length in ``(lo, hi]``, and their count."""
    got = [bool(r["correct"]) for (n, _), r in cells.items() if lo < n <= hi]
    return (sum(got) / len(got), len(got)) if got else None


# ---------------------------------------------------------------------------------------------- verdicts
#: a passkey verdict needs at least this many keys in every cell (scaling × length) it reads; below it the rates
#: move in steps of a third (3 keys) and no interval separates anything: "inconclusive"
PASSKEY_MIN_KEYS = 20
#: PI "keeps the model usable" when its perplexity is within this factor of the model's own inside L
PI_TOLERANCE = 1.1

AS_PUBLISHED, POSENC_QUESTION = "as published", "posenc's question"

#: the claim as each paper states it (a "quote" in quotes, else a close paraphrase), and where it stands
CLAIMS = {
    "plain": (
        'extrapolating RoPE past the trained context "may lead to catastrophically high attention scores that '
        'completely ruin the self-attention mechanism"; the perplexity of rotary rises within a few hundred tokens '
        "past L (close paraphrase of Press et al.)",
        "Chen et al. 2023, abstract; Press et al. 2022, §2, Figure 1",
        AS_PUBLISHED,
    ),
    "pi": (
        "a model extended by PI already has a modest language-modelling ability over the extended window before any "
        "fine-tuning, and PI preserves quality within the original window (close paraphrase)",
        "Chen et al. 2023, abstract; §3, the perplexity at step 0 of fine-tuning (table not checked)",
        AS_PUBLISHED,
    ),
    "ntk": (
        "NTK-aware scaling extends the context without any fine-tuning with minimal perplexity degradation, where PI "
        "without fine-tuning degrades (close paraphrase)",
        "bloc97 2023, the NTK-aware scaled RoPE post on r/LocalLLaMA (no sections); Peng et al. 2023, §3 (section "
        "not checked)",
        AS_PUBLISHED,
    ),
    "yarn": (
        "YaRN extends the context without fine-tuning further than PI and NTK-aware interpolation (close paraphrase)",
        "Peng et al. 2023 (section not checked)",
        AS_PUBLISHED,
    ),
    "passkey": (
        "the model as trained fails the passkey past L; the scaled models retrieve it at the extended length (close "
        "paraphrase). The papers measure it after fine-tuning; these cells patch the scalings in without any, so this "
        "is posenc's question",
        "Chen et al. 2023, §3, passkey retrieval (section not checked); Peng et al. 2023 (section not checked); "
        "Mohtashami and Jaggi 2023 (the task)",
        POSENC_QUESTION,
    ),
}


@dataclass(frozen=True)
class Verdict:
    finding: str
    source: str
    verdict: str  # reproduced | partly | not reproduced | inconclusive | not measured
    evidence: str
    #: the paper's claim as it states it (a "quote" in quotes, else a close paraphrase)
    claim: str = ""
    #: "as published" (the paper's claim) or "posenc's question" (a variant of posenc's own)
    tests: str = AS_PUBLISHED


def _verdict(kind: str, finding: str, verdict: str, evidence: str) -> Verdict:
    claim, source, tests = CLAIMS[kind]
    return Verdict(finding, source, verdict, evidence, claim, tests)


def _keys(n: int) -> str:
    return f"{n} key{'' if n == 1 else 's'}"


def _mult(n: int, trained: int) -> str:
    """``n`` tokens as a multiple of the trained length, to one decimal (the last position is ``tokens - 1``)."""
    return f"{round(n / trained, 1):g}L"


def _fmt(x: float | None) -> str:
    return "—" if x is None else (f"{x:.1f}" if x >= 100 else f"{x:.2f}")


def keys_per_cell(cells: dict[tuple[int, float], dict[str, Any]], lo: int, hi: int) -> list[int]:
    """The number of keys (examples) of each length in ``(lo, hi]`` of one scaling's passkey cells."""
    counts: dict[int, int] = {}
    for n, _ in cells:
        if lo < n <= hi:
            counts[n] = counts.get(n, 0) + 1
    return [counts[n] for n in sorted(counts)]


def _interval(rate: float, n: int) -> str:
    low, high = wilson_bounds(rate, n, 1.959963984540054)
    return f"{rate:.0%} [{low:.0%}–{high:.0%}]"


def pi_rule(a_in: float, a_late: float, p_in: float, p_out: float) -> tuple[str, str]:
    """The PI verdict and the reason, judged against the model's own perplexity inside L, never against plain RoPE's
    blow-up past L (next to which anything is "smoother"): ``a_in``, ``p_in``: the model as trained and PI over the
    first L tokens (equal context); ``a_late``: the model as trained over L/2..L (the most context it was trained
    to use), the bar for ``p_out``, PI's perplexity past L. Reproduced when PI is within :data:`PI_TOLERANCE` of the
    model's own both inside L and past it; partly when only one holds."""
    usable_in, usable_out = p_in <= PI_TOLERANCE * a_in, p_out <= PI_TOLERANCE * a_late
    v = "reproduced" if usable_in and usable_out else "partly" if usable_in or usable_out else "not reproduced"
    tol = f"{PI_TOLERANCE - 1:.0%}"
    return v, (
        f"inside L PI is x{p_in / a_in:.2f} the model's own ({'within' if usable_in else 'beyond'} {tol}); past L "
        f"x{p_out / a_late:.2f} what the model gives over L/2..L ({'within' if usable_out else 'beyond'} {tol})"
    )


def verdicts(records: Sequence[dict[str, Any]]) -> list[Verdict]:
    """One verdict per published shape, from the first document's curves at one factor (:func:`comparison_set`)
    and the passkey grid; each carries the paper's claim, its source and whether posenc tests it as published."""
    doc, _, curves = comparison_set(records)
    trained = next((r["trained_length"] for r in records), 0)
    L = trained
    out: list[Verdict] = []

    def ppl(scaling: str, start: int, stop: int) -> float | None:
        r = curves.get(scaling)
        return perplexity(r, start, stop) if r else None

    # 1. plain RoPE past L
    finding = "Plain RoPE fails within about 1.2-1.5x the trained length"
    inside, past = ppl(AS_TRAINED, L // 2, L), ppl(AS_TRAINED, L, int(1.5 * L))
    if inside is None or past is None:
        out.append(_verdict("plain", finding, "not measured", "needs the as-trained loss curve to 1.5 L"))
    else:
        ratio = past / inside
        v = "reproduced" if ratio >= 2 else "partly" if ratio >= 1.2 else "not reproduced"
        out.append(
            _verdict(
                "plain",
                finding,
                v,
                f"{doc}: perplexity {_fmt(inside)} over positions L/2..L, {_fmt(past)} over L..1.5L "
                f"(x{ratio:.1f}; reproduced at x2 or more, partly from x1.2)",
            )
        )

    # 2. PI without fine-tuning, judged against the model's own perplexity inside L (pi_rule)
    finding = "PI without fine-tuning keeps the model usable: near its own perplexity inside L, and past L"
    longest = {s: r["tokens"] - 1 for s, r in curves.items()}
    far = min([longest.get(AS_TRAINED, 0), longest.get("rope-linear", 0)])
    a_in, a_late, p_in = ppl(AS_TRAINED, 0, L), ppl(AS_TRAINED, L // 2, L), ppl("rope-linear", 0, L)
    a_out, p_out = ppl(AS_TRAINED, L, far), ppl("rope-linear", L, far)
    if a_in is None or a_late is None or p_in is None or p_out is None or far <= L:
        out.append(_verdict("pi", finding, "not measured", "needs the as-trained and rope-linear curves past L"))
    else:
        v, why = pi_rule(a_in, a_late, p_in, p_out)
        out.append(
            _verdict(
                "pi",
                finding,
                v,
                f"{doc}: PI {_fmt(p_in)} over the first L against the model as trained {_fmt(a_in)}; PI {_fmt(p_out)} "
                f"over L..{_mult(far, L)} against the model's {_fmt(a_late)} over L/2..L: {why}. Plain RoPE past L "
                f"({_fmt(a_out)}) is no bar: beside its blow-up anything is smoother",
            )
        )

    # 3./4. comparisons past L among the scalings
    scal = [s for s in SCALINGS if s in curves]
    reach = min((longest[s] for s in scal), default=0)
    beyond = {s: ppl(s, L, reach) for s in scal} if reach > L else {}
    ntk_like = [s for s in ("rope-ntk", "rope-dynamic") if s in beyond]
    finding = "NTK-aware and dynamic NTK beat PI without fine-tuning"
    if "rope-linear" not in beyond or not ntk_like:
        out.append(
            _verdict("ntk", finding, "not measured", "needs rope-linear and rope-ntk / rope-dynamic curves past L")
        )
    else:
        wins = [s for s in ntk_like if beyond[s] < beyond["rope-linear"]]  # type: ignore[operator]
        v = "reproduced" if len(wins) == len(ntk_like) else "partly" if wins else "not reproduced"
        out.append(
            _verdict(
                "ntk",
                finding,
                v,
                f"{doc}, perplexity over L..{_mult(reach, L)}: PI {_fmt(beyond['rope-linear'])}, "
                + ", ".join(f"{LABELS[s]} {_fmt(beyond[s])}" for s in ntk_like),
            )
        )
    finding = "YaRN is the best scaling without fine-tuning"
    if "rope-yarn" not in beyond or len(beyond) < 2:
        out.append(_verdict("yarn", finding, "not measured", "needs rope-yarn and another scaling's curve past L"))
    else:
        ranked = sorted(beyond, key=lambda s: beyond[s])  # type: ignore[arg-type,return-value]
        rank = ranked.index("rope-yarn") + 1
        v = "reproduced" if rank == 1 else "partly" if rank <= 2 else "not reproduced"
        out.append(
            _verdict(
                "yarn",
                finding,
                v,
                f"{doc}, perplexity over L..{_mult(reach, L)}, best first: "
                + ", ".join(f"{LABELS[s]} {_fmt(beyond[s])}" for s in ranked),
            )
        )
    out.append(passkey_verdict(records, L))
    return out


def passkey_verdict(records: Sequence[dict[str, Any]], L: int) -> Verdict:
    """The passkey verdict: none below :data:`PASSKEY_MIN_KEYS` keys in any cell (scaling × length) it reads
    ("inconclusive", with the numbers); else decided on Wilson 95 % intervals: plain RoPE *fails* past L when its
    interval there lies wholly below its interval inside L, and the scalings *retrieve* when the best one's
    interval past L lies wholly above plain RoPE's and it finds at least half of its keys."""
    finding = "Passkey: plain RoPE fails past L, the scalings retrieve past it"
    grid = passkey_grid(records)
    plain = grid.get(AS_TRAINED, {})
    at_in = passkey_accuracy(plain, 0, L) if plain else None
    at_out = passkey_accuracy(plain, L, 10**9) if plain else None
    scaled = {s: passkey_accuracy(c, L, 10**9) for s, c in grid.items() if s != AS_TRAINED}
    scaled = {s: a for s, a in scaled.items() if a is not None}
    if at_in is None or at_out is None or not scaled:
        return _verdict(
            "passkey", finding, "not measured", "needs passkey cells inside and past L, as trained and scaled"
        )
    counts = keys_per_cell(plain, 0, 10**9) + [n for s in scaled for n in keys_per_cell(grid[s], L, 10**9)]
    fewest = min(counts)
    order = sorted(scaled.items(), key=lambda x: -x[1][0])
    numbers = (
        f"as trained: {at_in[0]:.0%} of {_keys(at_in[1])} up to L, {at_out[0]:.0%} of {_keys(at_out[1])} past L; "
        "past L " + ", ".join(f"{LABELS.get(s, s)} {a[0]:.0%} of {a[1]}" for s, a in order)
    )
    weak = (
        f" (the model as trained finds only {at_in[0]:.0%} of its keys inside L: weak at this task at any length)"
        if at_in[0] < 0.5
        else ""
    )
    if fewest < PASSKEY_MIN_KEYS:
        why = f"inconclusive: {_keys(fewest)} a cell, ≥ {PASSKEY_MIN_KEYS} needed"
        return _verdict("passkey", finding, "inconclusive", f"{why}; {numbers}{weak}")
    z = 1.959963984540054
    in_low, _ = wilson_bounds(at_in[0], at_in[1], z)
    _, out_high = wilson_bounds(at_out[0], at_out[1], z)
    best_s, best = order[0]
    best_low, _ = wilson_bounds(best[0], best[1], z)
    fails = out_high < in_low
    ahead = best_low > out_high
    helps = ahead and best[0] >= 0.5
    v = "reproduced" if fails and helps else "partly" if fails or ahead else "not reproduced"
    intervals = (
        f"as trained {_interval(*at_in)} up to L, {_interval(*at_out)} past L; "
        + ", ".join(f"{LABELS.get(s, s)} {_interval(*a)}" for s, a in order)
        + f" past L (Wilson 95 %; at least {_keys(fewest)} a cell)"
    )
    return _verdict("passkey", finding, v, intervals + weak)
