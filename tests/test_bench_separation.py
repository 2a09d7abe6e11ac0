"""Which gaps of a task are separable, and the suite's controls (issue 40: a new user's first run).

Independent truth: Wilson's interval is solved here from its defining score inequality by bisection (not its closed
form); the difference of two proportions is checked against Newcombe's (1998) published Table II (method 10, the
hybrid score interval); the pooled interval's coverage is measured on simulated binomial counts; Student's t
quantiles against the closed form for one degree of freedom and a numerical integration of the density; the
verdicts' intervals are read back from their text and must lie within what the metric can take.
"""

from __future__ import annotations

import math
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posenc._stats import paired_t, t_quantile
from posenc.bench.reporting.markdown import markdown_table
from posenc.bench.reporting.rows import leaderboard
from posenc.bench.reporting.separation import compare, compare_all, family_level, mover, wilson
from posenc.bench.reporting.verdicts import learning_warnings, no_problems_text, problems, verdict
from posenc.bench.runner import RunConfig
from posenc.errors import ConfigError

N = 512  # the quick suite's examples per length
SMALL = dict(steps=5, batch_size=8, d_model=16, n_layers=1, n_heads=2, eval_samples=N)
CONTROLS = {"none": "no positions: a bag of words"}


def record(task, encoding, seed, metrics, **kw):
    cfg = RunConfig(task=task, encoding=encoding, seed=seed, **{**SMALL, **kw}).as_dict()
    return {
        "key": f"{task}/{encoding}/{seed}",
        "config": cfg,
        "metric": "accuracy",
        "higher_is_better": True,
        "metrics": metrics,
        "curve": [[1, 0.7]],
        "train_seconds": 0.5,
        "suite": "made-up",
    }


def counts(ind: int, *ood: int) -> dict[str, float]:
    """Accuracies at 16 (trained), 32 and 64 as counts of the 512 examples."""
    return {"16": ind / N, "32": ood[0] / N, "64": ood[1] / N}


# ---------------------------------------------------------------------------- the arithmetic
def _wilson_by_bisection(k: int, n: int, z: float) -> tuple[float, float]:
    """The ends of {p : |k/n - p| <= z sqrt(p(1-p)/n)}, found by bisection on each side of k/n."""
    ph = k / n

    def inside(p: float) -> bool:
        return abs(ph - p) <= z * math.sqrt(p * (1 - p) / n)

    def edge(a: float, b: float) -> float:  # a inside, b outside (or at the border 0 / 1)
        for _ in range(100):
            m = (a + b) / 2
            a, b = (m, b) if inside(m) else (a, m)
        return (a + b) / 2

    lo = 0.0 if inside(0.0) or ph == 0 else edge(ph, 0.0)
    hi = 1.0 if inside(1.0) or ph == 1 else edge(ph, 1.0)
    return lo, hi


@pytest.mark.parametrize(("k", "n"), [(0, 10), (1, 10), (5, 10), (10, 10), (81, 263), (300, 512), (511, 512)])
@pytest.mark.parametrize("z", [1.96, 2.935])
def test_wilson_is_the_score_interval(k, n, z):
    assert wilson(k, n, z) == pytest.approx(_wilson_by_bisection(k, n, z), abs=1e-9)


# Newcombe, "Interval estimation for the difference between independent proportions", Statistics in Medicine
# 17 (1998) 873-890, Table II, method 10 (score interval without continuity correction)
NEWCOMBE = [
    ((9, 10), (3, 10), (0.1705, 0.8090)),
    ((5, 56), (0, 29), (-0.0381, 0.1926)),
    ((0, 10), (0, 20), (-0.1611, 0.2775)),
    ((0, 10), (0, 10), (-0.2775, 0.2775)),
    ((10, 10), (0, 20), (0.6791, 1.0000)),
    ((10, 10), (0, 10), (0.6075, 1.0000)),
]


@pytest.mark.parametrize(("a", "b", "want"), NEWCOMBE)
def test_one_count_a_side_is_newcombes_interval(a, b, want):
    est, lo, hi = mover([a], [b], 1.959964)
    assert est == pytest.approx(a[0] / a[1] - b[0] / b[1])
    assert (lo, hi) == pytest.approx(want, abs=6e-5)


def test_the_pooled_interval_covers_the_difference_as_often_as_it_says():
    rng = random.Random(40)
    z = 1.959964
    hits = trials = 0
    for _ in range(1200):
        strata = rng.choice([1, 2, 4])
        ps = [rng.uniform(0.05, 0.95) for _ in range(2 * strata)]
        ns = [rng.choice([40, 80, 160]) for _ in range(2 * strata)]
        ks = [sum(rng.random() < p for _ in range(n)) for p, n in zip(ps, ns)]
        plus = list(zip(ks[:strata], ns[:strata]))
        minus = list(zip(ks[strata:], ns[strata:]))
        truth = sum(ps[:strata]) / strata - sum(ps[strata:]) / strata
        _, lo, hi = mover(plus, minus, z)
        hits += lo <= truth <= hi
        trials += 1
    assert hits / trials >= 0.93, hits / trials  # nominal 95 %


@given(
    st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), min_size=1, max_size=6),
    st.floats(1.0, 4.0),
)
@settings(max_examples=200, deadline=None)
def test_the_pooled_interval_never_leaves_what_a_difference_of_accuracies_can_take(pairs, z):
    plus = [(min(k, 60), 60) for k, _ in pairs]
    minus = [(min(k, 60), 60) for _, k in pairs]
    est, lo, hi = mover(plus, minus, z)
    assert -1 - 1e-12 <= lo <= est <= hi <= 1 + 1e-12


def test_t_quantiles_are_students():
    assert t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-4)
    p = 1 - 0.05 / 30  # Bonferroni over 15 pairs: one degree of freedom has a closed form
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
    assert t_quantile(0.975, 2) == pytest.approx(4.302653, abs=1e-5)  # 2 / sqrt(q (1 - q) ...) closed form below
    q = 0.975
    assert t_quantile(q, 2) == pytest.approx((2 * q - 1) / math.sqrt(2 * q * (1 - q)), rel=1e-9)
    assert t_quantile(0.975, 200) == pytest.approx(1.971896, abs=1e-5)


def test_the_seeds_interval_is_cut_to_the_range_of_the_difference():
    lo, hi = paired_t([0.9, -0.7], 0.95, (-1.0, 1.0))  # the issue's kind: 12.7 standard errors wide
    assert (lo, hi) == (-1.0, 1.0)
    assert paired_t([0.1], 0.95) is None


def test_the_family_level_is_bonferronis():
    assert family_level(2) == pytest.approx(0.95)
    assert family_level(6) == pytest.approx(1 - 0.05 / 15)


# ---------------------------------------------------------------------------- the verdicts
def _issue_runs() -> list[dict]:
    """The first run's adjacent table, as counts: rope 19.7 points ahead of sinusoidal, both seeds agreeing;
    normalized split (one seed learned, one at chance); binary and none at chance."""
    table = {
        "rope": [counts(512, 492, 472), counts(512, 490, 474)],
        "sinusoidal": [counts(509, 384, 290), counts(507, 436, 414)],
        "normalized": [counts(251, 234, 246), counts(511, 490, 476)],
        "learned": [counts(510, 367, 324), counts(506, 353, 299)],
        "binary": [counts(261, 242, 240), counts(260, 238, 282)],
        "none": [counts(265, 259, 257), counts(253, 250, 235)],
    }
    return [record("adjacent", enc, s, m) for enc, runs in table.items() for s, m in enumerate(runs)]


def _intervals(text: str) -> list[tuple[float, float]]:
    return [(float(a), float(b)) for a, b in re.findall(r"([+-]\d+\.\d) to ([+-]\d+\.\d) points", text)]


def _by_hand(a_counts: list[tuple[int, int]], b_counts: list[tuple[int, int]], z: float) -> tuple[float, float]:
    """MOVER written out from the bisected Wilson ends: mean(a) - mean(b), each stratum weighted 1/S."""
    s = len(a_counts)
    est = sum(k / n for k, n in a_counts) / s - sum(k / n for k, n in b_counts) / s
    wa = [(k / n, *_wilson_by_bisection(k, n, z)) for k, n in a_counts]
    wb = [(k / n, *_wilson_by_bisection(k, n, z)) for k, n in b_counts]
    below = sum((p - lo) ** 2 for p, lo, _ in wa) + sum((hi - p) ** 2 for p, _, hi in wb)
    above = sum((hi - p) ** 2 for p, _, hi in wa) + sum((p - lo) ** 2 for p, lo, _ in wb)
    return est - math.sqrt(below) / s, est + math.sqrt(above) / s


def test_the_first_runs_clear_gap_is_separable_within_the_metrics_range():
    rows = leaderboard(_issue_runs(), CONTROLS)
    text = verdict(rows)
    assert text.startswith("rope wins, 19.7 points ahead of sinusoidal"), text
    assert "every seed has rope ahead" in text and "2 seeds × 2 lengths × 512 examples a row" in text
    (lo, hi), *_ = _intervals(text)
    z = 2.935199  # 95 % over the table's 15 pairs: the normal quantile at 1 - 0.05 / 30
    rope = [(492, N), (472, N), (490, N), (474, N)]
    sinusoidal = [(384, N), (290, N), (436, N), (414, N)]
    want = _by_hand(rope, sinusoidal, z)
    assert (lo, hi) == pytest.approx((100 * want[0], 100 * want[1]), abs=0.051)
    assert 0 < lo < hi <= 100


def test_a_gap_that_one_seed_carries_is_not_separable():
    rows = leaderboard(_issue_runs(), CONTROLS)
    seps = compare_all([r for r in rows if r["task"] == "adjacent"])
    split = seps[("normalized", "binary")]
    assert split.interval_excludes_zero and not split.seeds_agree and not split.separable
    only = [r for r in rows if r["label"] in ("normalized", "binary")]
    text = verdict(only)
    assert "not separable" in text and "the seeds disagree" in text


def test_one_seed_is_never_separable():
    res = [record("order", "rope", 0, counts(512, 500, 480)), record("order", "alibi", 0, counts(512, 300, 260))]
    text = verdict(leaderboard(res))
    assert "on one seed: not separable" in text


def test_equal_rows_are_not_separable_and_no_interval_leaves_the_range():
    res = [record("order", enc, s, counts(300, 256 + s, 250)) for enc in ("rope", "alibi") for s in range(3)]
    text = verdict(leaderboard(res))
    assert "not separable" in text and "includes 0" in text
    for lo, hi in _intervals(text):
        assert -100 <= lo <= hi <= 100


@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=2, max_size=5))
@settings(max_examples=60, deadline=None)
def test_no_verdict_interval_leaves_what_accuracies_can_take(pairs):
    # values that are no count of the examples (0.123456...): the seeds' t interval, cut to [-100, +100] points
    res = [record("order", "rope", s, {"16": 1.0, "32": a, "64": a}) for s, (a, _) in enumerate(pairs)]
    res += [record("order", "alibi", s, {"16": 1.0, "32": b, "64": b}) for s, (_, b) in enumerate(pairs)]
    for lo, hi in _intervals(verdict(leaderboard(res))):
        assert -100 <= lo <= hi <= 100


def test_compare_falls_back_to_the_seeds_where_the_task_counts_no_examples():
    res = [
        record("order", enc, s, {"16": 5.0 + d, "32": 6.0 + d, "64": 7.0 + d + 0.01 * s}, eval_samples=8)
        for s in range(3)
        for enc, d in (("alibi", 0.0), ("rope", 3.0))
    ]
    for r in res:
        r["metric"], r["higher_is_better"] = "perplexity", False
    rows = leaderboard(res)
    sep = compare(rows[0], rows[1])
    assert sep.method == "seeds" and sep.separable and rows[0]["label"] == "alibi"


# ---------------------------------------------------------------------------- controls
def test_a_control_at_chance_is_no_failure_and_what_beat_it_is_said(tmp_path):
    rows = leaderboard(_issue_runs(), CONTROLS)
    text = verdict(rows)
    assert "Separably ahead of the control none: rope, sinusoidal, learned; not separable from it:" in text
    assert (
        "normalized" in text.split("not separable from it:")[1] and "binary" in text.split("not separable from it:")[1]
    )
    probs = problems(rows, None)
    assert [p["run"] for p in probs["not learned"]] == ["adjacent/binary (2 seeds)"]  # not the control
    assert probs["control not at chance"] == []
    warns = learning_warnings(rows)
    assert len(warns) == 1 and "binary" in warns[0] and "none" not in warns[0]
    table = markdown_table(rows)
    assert "| 6 | none (control) |" in table and "(control): none is at chance by design" in table
    only_control_weak = [r for r in rows if r["label"] != "binary"]
    assert not any(problems(only_control_weak, None).values())
    assert "at chance as designed" in no_problems_text(only_control_weak)


def test_a_control_that_is_not_at_chance_gets_a_note():
    res = [record("order", "none", s, counts(500, 400, 300)) for s in range(2)]
    res += [record("order", "rope", s, counts(512, 500, 480)) for s in range(2)]
    rows = leaderboard(res, CONTROLS)
    probs = problems(rows, None)
    assert [p["run"] for p in probs["control not at chance"]] == ["order/none (2 seeds)"]
    assert "meant to be at chance" in probs["control not at chance"][0]["error"]
    assert any("the control none is not at chance" in w for w in learning_warnings(rows))
    assert "The control none is not at chance" in verdict(rows)


def test_without_controls_none_at_chance_is_a_row_that_did_not_learn():
    rows = leaderboard(_issue_runs())
    assert "adjacent/none (2 seeds)" in [p["run"] for p in problems(rows, None)["not learned"]]


def test_the_ahead_column_names_ranks():
    from posenc.bench.reporting.model import RunSet

    table = RunSet(_issue_runs(), controls=CONTROLS).tables[0]
    got = {r["label"]: table.ahead_text(r) for r in table.rows}
    assert got["rope"] == "#2, #4–6"  # not normalized (#3): its seeds disagree
    assert got["learned"] == "all below" and got["none"] == "—"


def test_the_quick_suite_declares_none_its_control_and_a_bad_one_is_a_clear_error():
    from posenc.bench.suites import load_suite, parse_suite

    quick = load_suite("quick")
    assert "bag of words" in quick.controls["none"]
    assert {j.label for j in quick.jobs() if j.control} == {"none"}
    base = {"name": "t", "tasks": ["order"], "encodings": ["rope", "none"], "seeds": [0]}
    with pytest.raises(ConfigError, match=r"'nnone' is not an encoding of this suite. Did you mean: none"):
        parse_suite({**base, "controls": {"nnone": "why"}})
    with pytest.raises(ConfigError, match="needs the reason"):
        parse_suite({**base, "controls": {"none": ""}})


def test_the_live_line_of_a_control_at_chance_says_so_without_a_warning():
    import io

    from posenc.bench.live import LiveBoard
    from posenc.bench.types import Job

    class Empty:
        def keys(self):
            return set()

        def load(self):
            return {}

    cfg = RunConfig(task="order", encoding="none", seed=0, steps=5)
    jobs = [Job(cfg, "none", "quick", "a bag of words"), Job(RunConfig(task="order", encoding="binary", steps=5))]
    out = io.StringIO()
    board = LiveBoard(jobs, Empty(), progress=False, live=True, per_step=False, stream=out)
    rec = {"config": cfg.as_dict(), "metrics": {"16": 0.51, "32": 0.5, "64": 0.5}, "train_seconds": 1.0}
    board.finished(jobs[0], {**rec, "label": "none"})
    board.finished(jobs[1], {**rec, "config": jobs[1].config.as_dict(), "label": "binary"})
    first, second = out.getvalue().splitlines()
    assert "control: at chance, as designed" in first and "!!" not in first
    assert "!! did not learn" in second


def test_a_row_whose_chance_is_unknown_is_neither_a_failure_nor_a_crash():
    res = [record("order", enc, s, counts(512, 400, 300)) for enc in ("rope", "none") for s in range(2)]
    for r in res:
        r["config"]["task"] = "a-task-not-registered-here"  # an old store's task: chance unknown
    rows = leaderboard(res, CONTROLS)
    assert all(r["chance"]["16"] is None for r in rows)
    probs = problems(rows, None)
    assert probs["not learned"] == [] and probs["control not at chance"] == []
    assert "points" in verdict(rows)


def test_the_tasks_say_how_many_examples_a_length_counts():
    from posenc.bench.outcomes import examples

    order = RunConfig(task="order", encoding="rope", eval_samples=100).as_dict()
    assert examples(order, "32") == 100 and examples(order, "test") is None
    copy = RunConfig(task="copy", encoding="rope", eval_samples=64).as_dict()
    assert examples(copy, "16") == 64 and examples(copy, "16_token") is None  # tokens are not independent examples
    passkey = RunConfig(
        task="passkey", encoding="rope", train_lengths=(28, 64), test_lengths=(64,), eval_samples=103
    ).as_dict()
    depths = 5  # passkey's default number of depths: 103 // 5 = 20 keys at each, 100 in all
    from posenc.bench.api import get_task

    assert get_task("passkey").options(RunConfig.from_dict(passkey))["depths"] == depths
    assert examples(passkey, "64") == 100
