"""The RULER report's statistics against direct computations (posenc.extend.ruler_report): the haystack as the unit
(Wilson over haystacks; a cluster of questions at Kish's effective size, computed here by hand), RULER's mean over
the tasks that ran, effective length on made-up scores, verdicts at the Bonferroni family level with the words the
evidence carries, the depth-by-length grid, the older protocol's records shown as superseded, each environment
once. No model: records are made up."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from posenc.extend import ruler_report as rr
from posenc.extend.config import AS_TRAINED

ROOT = Path(__file__).resolve().parents[1]
Z = 1.959963984540054


def wilson(p: float, n: float, z: float = Z) -> tuple[float, float]:
    """Wilson's interval written out again (Wilson 1927)."""
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


ENV = {"cpu": "AMD EPYC", "torch": "2", "python": "3.11", "threads": 2, "posenc": "0.1.0", "git_commit": "abc"}


def cell(task, scaling, tokens, haystacks, factor=2.0, trained=8192, depths=None):
    """Records of one cell: ``haystacks`` a list of score lists (one list a haystack)."""
    out = []
    for h, scores in enumerate(haystacks):
        ans = [
            {"score": s, "depth": None if depths is None else depths[(h + i) % len(depths)]}
            for i, s in enumerate(scores)
        ]
        out.append(
            {
                "kind": "ruler",
                "protocol": "ruler",
                "task": task,
                "scaling": scaling,
                "haystack": h,
                "factor": 1.0 if scaling == AS_TRAINED else factor,
                "tokens": tokens,
                "trained_length": trained,
                "answers": ans,
                "env": ENV,
                "model": {"name": "m"},
            }
        )
    return out


def test_one_question_a_haystack_is_wilson_over_the_haystacks():
    p, lo, hi, n_eff = rr.cluster_interval([[1.0]] * 18 + [[0.0]] * 7)
    assert n_eff == 25 and p == pytest.approx(18 / 25) and (lo, hi) == pytest.approx(wilson(18 / 25, 25))


def test_a_cluster_of_questions_is_wilson_at_kishs_effective_size():
    hay = [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]]
    means = [0.5, 1.0, 0.0, 0.25]
    p = sum(means) / 4
    var = sum((m - p) ** 2 for m in means) / 3 / 4  # the sample variance of the means, over their count
    n_eff = p * (1 - p) / var
    got = rr.cluster_interval(hay)
    assert got[0] == pytest.approx(p) and got[3] == pytest.approx(n_eff)
    assert got[1:3] == pytest.approx(wilson(p, n_eff))
    assert n_eff < 16  # narrower than treating the 16 questions as independent would be wrong
    # haystacks that agree exactly: the question count; all right: the haystack count
    assert rr.cluster_interval([[1, 0], [0, 1], [1, 0]])[3] == 6
    assert rr.cluster_interval([[1, 1, 1]] * 5)[3] == 5


def test_ruler_mean_is_over_the_tasks_that_ran_and_effective_length():
    recs = (
        cell("niah_single_1", AS_TRAINED, 4096, [[1.0]] * 25)
        + cell("vt", AS_TRAINED, 4096, [[0.8]] * 25)
        + cell("niah_single_1", AS_TRAINED, 8192, [[1.0]] * 20 + [[0.0]] * 5)
        + cell("vt", AS_TRAINED, 8192, [[0.8]] * 25)
        + cell("niah_single_1", AS_TRAINED, 16384, [[1.0]] * 25)
        + cell("vt", AS_TRAINED, 16384, [[1.0]] * 25)
    )
    m = rr.means(recs)[(AS_TRAINED, 1.0)]
    assert [round(m[n][0], 4) for n in (4096, 8192, 16384)] == [0.9, 0.8, 1.0] and m[4096][3] == 2
    # effective length: the longest length up to which every score stays at or above the threshold
    assert rr.effective_length({4096: 0.9, 8192: 0.8, 16384: 1.0}, 0.856) == 4096
    assert rr.effective_length({4096: 0.9, 8192: 0.86, 16384: 0.2}, 0.856) == 8192
    assert rr.effective_length({4096: 0.5}, 0.856) is None
    (eff,) = rr.effective_lengths(recs)
    assert eff[:4] == (AS_TRAINED, 1.0, 4096, 4096) and eff[4] == pytest.approx(0.9)
    text = "\n".join(rr.table(recs))
    assert "RULER mean over the 2 tasks that ran" in text and "| as trained (plain RoPE) | 4096 | 4096 |" in text
    assert "2 of RULER's 13 tasks ran; not run: qa_1 (SQuAD" in text and "Only the shape is comparable" in text
    assert text.count("Machine: ") == 1 and "Substitution" not in text


def test_verdicts_are_corrected_for_the_comparisons_and_need_25_haystacks():
    strong = [[1.0]] * 25 + [[0.0]] * 5  # 83 %
    recs = (
        cell("niah_single_1", AS_TRAINED, 8192, strong)
        + cell("niah_single_1", "rope-yarn", 8192, [[1.0]] * 3 + [[0.0]] * 27)  # 10 %: apart at any level
        + cell("niah_single_1", "rope-ntk", 8192, [[1.0]] * 11 + [[0.0]] * 19)  # 37 %
        + cell("niah_single_1", "rope-linear", 8192, [[1.0]] * 2 + [[0.0]] * 3)
    )  # 5 haystacks
    v = {x.finding: x for x in rr.verdicts(recs)}
    m = 6  # the pairs of four scalings at one length, one task
    lvl = 1 - 0.05 / m
    z_f = __import__("statistics").NormalDist().inv_cdf(0.5 + lvl / 2)
    assert v["as trained (plain RoPE) beats YaRN, s=2 at 8192 tokens (L)"].verdict == "yes"
    # as trained 25/30 against NTK 11/30: apart at 95 %, not at the family level, by the intervals written out here
    a95, b95 = wilson(25 / 30, 30), wilson(11 / 30, 30)
    af, bf = wilson(25 / 30, 30, z_f), wilson(11 / 30, 30, z_f)
    assert a95[0] > b95[1] and not af[0] > bf[1]
    got = v["as trained (plain RoPE) beats NTK-aware, s=2 at 8192 tokens (L)"]
    assert got.verdict == "suggestive" and f"{m} comparisons" in got.evidence
    few = [x for x in v.values() if "PI" in x.finding]
    assert few and {x.verdict for x in few} == {"too few haystacks"} and not any("beats" in x.finding for x in few)
    assert all(x.claim and x.source and x.tests for x in v.values())


def test_the_depth_grid_and_the_picture(tmp_path):
    recs = (
        cell("niah_single_1", AS_TRAINED, 4096, [[1.0]] * 10, depths=[0.1])
        + cell("niah_multikey_1", AS_TRAINED, 4096, [[0.0]] * 10, depths=[0.9])
        + cell("niah_single_1", AS_TRAINED, 8192, [[0.0]] * 20, depths=[0.5])
        + cell("fwe", AS_TRAINED, 4096, [[0.5]] * 3)
    )
    lengths, grid, counts = rr.depth_grid(recs, AS_TRAINED, 1.0)
    assert lengths == [4096, 8192] and counts[0][0] == 10 and counts[4][0] == 10 and counts[2][1] == 20
    assert grid[0][0] == 1.0 and grid[4][0] == 0.0 and grid[2][1] == 0.0 and math.isnan(grid[1][0])
    path = rr.plot(recs, tmp_path / "r.png")
    assert path is not None and path.stat().st_size > 10_000


def test_the_stored_records_of_the_older_protocol_render_as_superseded():
    records = [json.loads(x) for x in (ROOT / "docs/results/data/extend-ruler.jsonl").read_text().splitlines() if x]
    assert records and not any(rr.is_new(r) for r in records)
    text = "\n".join(rr.table(records))
    assert rr.OLD_NOTE in text and text.count("Machine: ") == 1 and "posenc commits: " in text
    assert "under the older protocol (superseded)" in rr.readme_lines(records, "x")[0]
    # beside a record of the new protocol, the old ones are left out
    new = cell("vt", AS_TRAINED, 4096, [[1.0]])
    assert set(rr.cells([*records, *new])) == {("vt", AS_TRAINED, 1.0, 4096)}


def test_the_time_left_leaves_out_the_cells_the_floor_will_cut(tmp_path):
    from posenc.extend.runner import Cell, Store, cell_work, work_left

    store = Store(tmp_path)
    at_floor = cell("cwe", AS_TRAINED, 25, [[0.0]] * 20, trained=100)  # 0 of 20 inside L = 100: at the floor
    live = cell("vt", AS_TRAINED, 25, [[1.0]] * 20, trained=100)
    for i, r in enumerate(at_floor + live):
        store.add({**r, "key": f"k{i}"})
    cells = [
        Cell("ruler", AS_TRAINED, 1.0, tokens=200, task=t, unless_floor=u)
        for t, u in (("cwe", True), ("vt", True), ("cwe", False))
    ]
    assert work_left(cells, store, 100) == pytest.approx(cell_work(cells[1], 100) + cell_work(cells[2], 100))
    assert work_left(cells, Store(tmp_path / "empty"), 100) == pytest.approx(sum(cell_work(c, 100) for c in cells))


def test_each_machine_and_commit_is_named_once_in_both_reports():
    """Cells measured at three commits on one machine, and one on another: two machines, three commits, each once
    (the results page once repeated a machine's whole line per commit)."""
    from posenc.extend import report
    from posenc.runenv import describe

    a = {"cpu": "AMD EPYC", "kernels": "native C (avx2)", "torch": "2.13.0+cpu", "threads": 2, "posenc": "0.1.0",
         "python": "3.11.7", "platform": "Linux"}
    b = {**a, "kernels": "native C (avx512)"}
    envs = [{**a, "git_commit": "1" * 40}, {**a, "git_commit": "2" * 40, "git_dirty": True},
            {**a, "git_commit": "3" * 40}, {**b, "git_commit": "1" * 40}]
    recs = []
    for i, env in enumerate(envs):
        (r,) = cell("niah_single_1", AS_TRAINED, 4096 * (i + 1), [[1.0]])
        r["env"] = env
        recs.append(r)
    (machine, commits) = rr.environments(recs)
    assert machine == f"Machine: {describe(a)} / {describe(b)}" or machine == f"Machine: {describe(b)} / {describe(a)}"
    assert commits == f"posenc commits: {'1' * 10}, {'2' * 10} (modified), {'3' * 10}"
    s = report.summary(recs)
    assert sorted(s["machines"]) == sorted([describe(a), describe(b)]) and len(s["commits"]) == 3
    text = report.markdown(recs)
    assert text.count(describe(a)) == 1 and text.count(describe(b)) == 1 and "**posenc commits:**" in text
