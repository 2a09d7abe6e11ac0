"""Suites: named grids of runs, kept in TOML files.

A suite file (see ``docs/bench.md`` and the built-in ones in ``posenc/bench/suites/``)::

    name = "mine"
    description = "rope against alibi on order"
    tasks = ["order"]
    seeds = [0, 1, 2]
    encodings = ["rope", {name = "alibi", label = "ALiBi"}, {name = "shaw", options = {max_relative_position = 4}}]
    measured = "42 min with --workers 2 on 2 shared vCPUs, 2026-11-24"   # optional, free text

    [settings]                      # shared RunConfig fields
    steps = 300
    train_lengths = [4, 16]
    test_lengths = [16, 32, 64]

    [[grid]]                        # optional: more grids, each with its own tasks/encodings/seeds/settings
    tasks = ["adjacent"]
    encodings = ["t5"]
    settings = {steps = 100}

    [published]                     # optional: the paper's numbers, shown beside ours
    source = "..."; metric = "..."; note = "..."; columns = [...]
    rows = {rope = [...], alibi = [...]}

    [controls]                      # optional: encodings at chance by design, and why (not a failure)
    none = "no positions: a bag of words, at chance where word order decides"

    [[findings]]                    # optional: a verdict per finding of the paper (docs/results.md)
    finding = "ALiBi stays flat beyond the training length"
    claim = '"ALiBi ... extrapolates to longer sequences"'   # the paper's claim: a "quote" or a close paraphrase
    source = "Press et al. 2022, §4, Figure 4"              # author year, and section / table / figure
    tests = "as published"          # or "posenc's question" (a variant of posenc's own)
    verdict = "reproduced"          # or "partly", "not reproduced", "inconclusive", "not tested"
    evidence = "ptb-lm: 512 within 5 % of 64"
    written = "2026-11-24"          # the date (UTC) the verdict was written

    [[comparisons]]                 # optional: paired differences, per seed, shown on the results page
    name = "randomized - plain"
    pairs = [["randomized-rope", "rope"]]   # [a, b] labels: the page shows a - b
    column = "token"                # a metric column suffix ("16_token" -> "token"); "" = the main metric
    lengths = "beyond"              # "beyond" the training lengths, "train" (at most the longest), or "all"

Every name and setting is checked when the file is loaded: unknown keys, tasks
and encodings (with close matches), impossible lengths, encoding options that
the encoding does not take, and an encoding that cannot reach the longest test
length (e.g. ``learned`` with ``max_len`` below it).
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import ConfigError, PosencError, PositionError, UnknownNameError
from .types import Job, RunConfig, default_label

TOP_KEYS = (
    "name",
    "description",
    "paper",
    "tasks",
    "encodings",
    "seeds",
    "settings",
    "grid",
    "published",
    "notes",
    "measured",
    "findings",
    "comparisons",
    "controls",
)
GRID_KEYS = ("name", "tasks", "encodings", "seeds", "settings")
ENCODING_KEYS = ("name", "label", "options")
PUBLISHED_KEYS = ("source", "metric", "note", "columns", "rows", "text", "task", "higher_is_better")
FINDING_KEYS = ("finding", "claim", "source", "tests", "verdict", "evidence", "written")
#: the keys every finding must give (``evidence`` may be left out where there is none yet)
REQUIRED_FINDING_KEYS = ("finding", "claim", "source", "tests", "verdict", "written")
#: what a finding tests: the paper's claim as the paper states it, or a variant of posenc's own
TESTS = ("as published", "posenc's question")
COMPARISON_KEYS = ("name", "pairs", "column", "lengths")
#: which test lengths a comparison averages over
COMPARISON_LENGTHS = ("beyond", "train", "all")
#: the verdicts a finding may have (``[[findings]]``), in the order the results page counts them; "not tested":
#: the task cannot test the claim (the evidence says why), which is no evidence against it
VERDICTS = ("reproduced", "partly", "not reproduced", "inconclusive", "not tested")
PER_RUN = ("task", "encoding", "seed", "encoding_options", "task_version")
SETTING_KEYS = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name not in PER_RUN)


def _check_keys(where: str, got: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for k in got:
        if k not in allowed:
            close = difflib.get_close_matches(k, allowed, n=3, cutoff=0.5)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise ConfigError(f"{where}: unknown key {k!r}.{hint} Allowed: {', '.join(allowed)}")


@dataclass(frozen=True)
class EncodingSpec:
    """An encoding of a grid: registry name, display label, options passed to it."""

    name: str
    label: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    """A verdict on one finding of the paper a suite reproduces (``[[findings]]`` in the suite file).

    ``written`` is when the verdict was written: an ISO date (``"2026-11-24"``, a UTC day) or
    date and time (``"2026-11-24T18:30"``, UTC unless it carries an offset). The results page
    warns when the suite has runs that finished after it.
    """

    finding: str
    verdict: str
    evidence: str = ""
    written: str = ""
    #: the paper's claim as the paper states it: a short "quote" (in quotes) or a close paraphrase
    claim: str = ""
    #: where the claim stands: author year, section, table or figure ("Shaw et al. 2018, §4, Table 3")
    source: str = ""
    #: ``"as published"`` (the paper's own claim) or ``"posenc's question"`` (a variant of posenc's own)
    tests: str = "as published"

    @property
    def as_published(self) -> bool:
        """Whether the finding tests the paper's claim as published (else it is posenc's own question)."""
        return self.tests == "as published"

    def written_before(self, when: datetime.datetime) -> bool:
        """Whether the verdict was written before ``when`` (an aware datetime): a date counts as its whole
        UTC day, so only a run of a later day makes a verdict dated by day stale."""
        w = _written(self.written)
        if isinstance(w, datetime.datetime):
            return w < when
        return w < when.astimezone(datetime.UTC).date()


def _written(text: str) -> datetime.date | datetime.datetime:
    """The date or (aware, UTC by default) datetime of a finding's ``written``; ValueError if it is neither."""
    if "T" in text or " " in text.strip():
        dt = datetime.datetime.fromisoformat(text)
        return dt if dt.tzinfo else dt.replace(tzinfo=datetime.UTC)
    return datetime.date.fromisoformat(text)


def _tables(where: str, raw: Any, key: str, allowed: tuple[str, ...]) -> list[tuple[str, dict[str, Any]]]:
    """The tables of an array of tables (``[[key]]``), each with where it is (for errors), keys checked."""
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise ConfigError(f"{where}: {key} must be an array of tables ([[{key}]]), got {raw!r}")
    out = []
    for i, table in enumerate(raw, 1):
        at = f"{where} {key} {i}"
        _check_keys(at, table, allowed)
        out.append((at, table))
    return out


_FINDING_HELP = {
    "finding": "what posenc checked, in a line",
    "claim": 'the claim as the paper states it: a short "quote" in quotes, or a close paraphrase',
    "source": 'author year, and where the claim stands: section, table or figure, e.g. "Shaw et al. 2018, §4, '
    'Table 3" ("(section not checked)" where it was not)',
    "tests": '"as published" (the paper\'s claim) or "posenc\'s question" (a variant of posenc\'s own)',
    "verdict": ", ".join(VERDICTS),
    "written": "the date (UTC) the verdict was written, YYYY-MM-DD",
}


def _findings(where: str, raw: Any) -> list[Finding]:
    out = []
    for at, f in _tables(where, raw, "findings", FINDING_KEYS):
        if isinstance(f.get("finding"), str):
            at = f"{at} ({f['finding']!r})"
        for key in REQUIRED_FINDING_KEYS:
            if key not in f:
                raise ConfigError(
                    f"{at}: no {key} (a finding needs {', '.join(REQUIRED_FINDING_KEYS)}; {_FINDING_HELP[key]})"
                )
        tests = f["tests"]
        if tests not in TESTS:
            close = difflib.get_close_matches(str(tests), TESTS, n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{at}: tests {tests!r} is not one of {', '.join(repr(t) for t in TESTS)} (the paper's claim as "
                f"published, or a variant of posenc's own).{hint}"
            )
        for key in ("claim", "source"):
            if not isinstance(f[key], str) or not f[key].strip():
                raise ConfigError(f"{at}: {key} must be a non-empty string ({_FINDING_HELP[key]}), got {f[key]!r}")
        verdict = f["verdict"]
        if verdict not in VERDICTS:
            close = difflib.get_close_matches(str(verdict), VERDICTS, n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{at}: verdict {verdict!r} is not one of {', '.join(repr(v) for v in VERDICTS)}.{hint}")
        for key in ("finding", "evidence"):
            if not isinstance(f.get(key, ""), str):
                raise ConfigError(f"{at}: {key} must be a string, got {f[key]!r}")
        written = f["written"]
        if isinstance(written, datetime.datetime | datetime.date):  # an unquoted TOML date or date-time
            written = written.isoformat()
        try:
            _written(str(written))
        except ValueError:
            raise ConfigError(
                f"{at}: written must be a date YYYY-MM-DD (or YYYY-MM-DDTHH:MM, UTC), got {written!r}"
            ) from None
        out.append(
            Finding(
                f["finding"],
                verdict,
                f.get("evidence", ""),
                str(written),
                claim=f["claim"].strip(),
                source=f["source"].strip(),
                tests=tests,
            )
        )
    return out


@dataclass(frozen=True)
class Comparison:
    """Paired differences ``a - b`` of encodings (by label), per task and seed (``[[comparisons]]``).

    For each pair and task the results page takes, per seed, the mean of ``column`` over the test ``lengths``
    of ``a`` minus that of ``b`` (same seed), then the mean and std over seeds; and the mean over every task and
    pair (Ruoss et al.'s "+12 points of randomized over plain positions" is such a number).
    """

    name: str
    pairs: tuple[tuple[str, str], ...]
    column: str = ""
    lengths: str = "beyond"


def _controls(where: str, raw: Any, names: set[str]) -> dict[str, str]:
    """``[controls]``: label (or encoding name) -> why it is at chance by design (a non-empty string)."""
    if not isinstance(raw, dict):
        raise ConfigError(f'{where}: controls must be a table of label = "why it is at chance by design", got {raw!r}')
    for label, why in raw.items():
        if label not in names:
            close = difflib.get_close_matches(label, sorted(names), n=3, cutoff=0.5)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise ConfigError(f"{where} controls: {label!r} is not an encoding of this suite.{hint}")
        if not isinstance(why, str) or not why.strip():
            raise ConfigError(f"{where} controls: {label!r} needs the reason it is at chance by design (a string)")
    return {str(k): str(v) for k, v in raw.items()}


def _comparisons(where: str, raw: Any, labels: set[str]) -> list[Comparison]:
    out = []
    for i, (at, c) in enumerate(_tables(where, raw, "comparisons", COMPARISON_KEYS), 1):
        pairs = c.get("pairs")
        if (
            not isinstance(pairs, list)
            or not pairs
            or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in pairs)
        ):
            raise ConfigError(f'{at}: pairs must be a list of [a, b] label pairs, e.g. [["randomized-rope", "rope"]]')
        for label in (x for p in pairs for x in p):
            if label not in labels:
                close = difflib.get_close_matches(label, sorted(labels), n=3, cutoff=0.5)
                hint = f" Did you mean: {', '.join(close)}?" if close else ""
                raise ConfigError(f"{at}: {label!r} is not the label of an encoding of this suite.{hint}")
        lengths = c.get("lengths", "beyond")
        if lengths not in COMPARISON_LENGTHS:
            raise ConfigError(f"{at}: lengths must be one of {', '.join(COMPARISON_LENGTHS)}, got {lengths!r}")
        column = c.get("column", "")
        if not isinstance(column, str):
            raise ConfigError(f"{at}: column must be a string (a metric column suffix such as 'token'), got {column!r}")
        name = c.get("name", f"comparison {i}")
        out.append(Comparison(str(name), tuple((a, b) for a, b in pairs), column, lengths))
    return out


@dataclass
class Grid:
    tasks: list[str]
    encodings: list[EncodingSpec]
    seeds: list[int]
    settings: dict[str, Any]
    name: str = ""


@dataclass
class Suite:
    """A named set of grids (tasks × encodings × seeds with shared settings), plus published numbers."""

    name: str
    description: str = ""
    paper: str = ""
    grids: list[Grid] = field(default_factory=list)
    published: dict[str, Any] = field(default_factory=dict)
    notes: str = ""
    path: Path | None = None
    #: how long the suite took, as its author measured it (free text, ``measured = "..."``)
    measured: str = ""
    #: the verdicts on the paper's findings (``[[findings]]``)
    findings: list[Finding] = field(default_factory=list)
    #: paired differences of encodings shown on the results page (``[[comparisons]]``)
    comparisons: list[Comparison] = field(default_factory=list)
    #: the encodings (by label or name) at chance by design, and why (``[controls]``): the report does not count
    #: them as failures, notes one that is not at chance, and says which encodings beat them
    controls: dict[str, str] = field(default_factory=dict)

    def control(self, spec: EncodingSpec) -> str:
        """Why the encoding ``spec`` is a control ("": it is not one)."""
        return self.controls.get(spec.label) or self.controls.get(spec.name, "")

    def jobs(
        self,
        *,
        tasks: list[str] | None = None,
        encodings: list[str] | None = None,
        seeds: list[int] | None = None,
        overrides: dict[str, Any] | None = None,
        check: bool = True,
    ) -> list[Job]:
        """Every run of the suite (optionally only these tasks / encodings or labels / seeds)."""
        all_tasks = {t for g in self.grids for t in g.tasks}
        all_encs = {e.name for g in self.grids for e in g.encodings} | {
            e.label for g in self.grids for e in g.encodings
        }
        for kind, want, have in (("task", tasks, all_tasks), ("encoding", encodings, all_encs)):
            for w in want or ():
                if w not in have:
                    raise UnknownNameError(f"{kind} of suite {self.name!r},", w, have)
        out: list[Job] = []
        seen: set[str] = set()
        for gi, g in enumerate(self.grids, 1):
            for t in g.tasks:
                if tasks and t not in tasks:
                    continue
                for e in g.encodings:
                    if encodings and e.name not in encodings and e.label not in encodings:
                        continue
                    for s in g.seeds if seeds is None else seeds:
                        where = f"suite {self.name!r}" + (f" grid {g.name or gi}" if len(self.grids) > 1 else "")
                        where += f", task {t!r}, encoding {e.label!r}, seed {s}"
                        settings = {**g.settings, **(overrides or {})}
                        try:
                            cfg = RunConfig(
                                task=t, encoding=e.name, seed=s, encoding_options=dict(e.options), **settings
                            )
                            if check:
                                check_reach(cfg)
                        except UnknownNameError:
                            raise
                        except PosencError as exc:
                            raise ConfigError(f"{where}: {exc}") from None
                        except TypeError as exc:
                            raise ConfigError(f"{where}: {exc}") from None
                        if cfg.key() not in seen:
                            seen.add(cfg.key())
                            out.append(Job(cfg, e.label, self.name, self.control(e)))
        return out

    def configs(self, **kw: Any) -> list[RunConfig]:
        return [j.config for j in self.jobs(**kw)]

    def validate(self) -> list[Job]:
        """Check every run of the suite (raises :class:`ConfigError`); return the runs."""
        return self.jobs()


def check_reach(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` if ``cfg.encoding`` with its options cannot take the test lengths.

    The encoding is built as a model built for ``max(cfg.test_lengths)`` would build it;
    options it does not take fail here. Positions up to the longest test length then go
    through its position hooks (cheap: no attention), so that a table too short
    (``learned`` with a small ``max_len``, ``binary`` with too few bits) fails before
    anything is trained. Whatever cannot be known without a model is left to the run.
    A schedule (:mod:`posenc.schedule`) is checked layer encoding by layer encoding.
    """
    from ..schedule import Schedule, is_schedule_text

    if not is_schedule_text(cfg.encoding):
        _check_reach(cfg, cfg.encoding, cfg.encoding_options)
        return
    done: list[Any] = []
    for spec in Schedule.parse(cfg.encoding).for_layers(cfg.n_layers):
        if not any(spec.same_encoding(d) for d in done):
            done.append(spec)
            _check_reach(cfg, spec.name, spec.built_options())


def _check_reach(cfg: RunConfig, encoding: str, options: dict[str, Any]) -> None:
    import torch

    from ..registry import build

    longest = max(cfg.test_lengths)
    dims = dict(
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        head_dim=cfg.d_model // cfg.n_heads,
        max_len=longest,
        vocab_size=64,
        n_layers=cfg.n_layers,
        causal=cfg.model == "decoder",
    )
    enc = build(encoding, dims=dims, options=options or None)
    sample = getattr(enc, "sample", None)
    if callable(sample):  # randomized positions: the random range must hold the training length
        try:
            sample(torch.arange(cfg.train_lengths[1])[None])
        except PositionError as exc:
            raise ConfigError(f"encoding {encoding!r} cannot train at length {cfg.train_lengths[1]}: {exc}") from None
        except Exception:  # noqa: BLE001 -- not knowable up front
            pass
    try:
        with torch.no_grad():
            pos = enc.positions(torch.arange(longest)[None], training=False)
            enc.embed(torch.zeros(1, longest, cfg.d_model), pos)
    except PositionError as exc:
        raise ConfigError(
            f"encoding {encoding!r} with options {options} cannot reach test length {longest}: {exc}"
        ) from None
    except Exception:  # noqa: BLE001 -- e.g. an embed hook that needs tokens: left to the run
        pass


def _encoding(where: str, e: Any) -> EncodingSpec:
    from ..schedule import Schedule, is_schedule_text

    if isinstance(e, str) and is_schedule_text(e):  # a schedule of encodings per layer, named by its string
        try:
            name = str(Schedule.parse(e))
        except PosencError as exc:
            raise type(exc)(f"{where}: {e!r}: {exc}") from None
        return EncodingSpec(name, name, {})
    from ..registry import resolve  # torch: only when a suite is built (a listing of the suites needs none)

    if isinstance(e, str):
        resolve(e)
        return EncodingSpec(e, e, {})
    if not isinstance(e, dict):
        raise ConfigError(f"{where}: an encoding is a name or a table {{name, label, options}}, got {e!r}")
    _check_keys(where, e, ENCODING_KEYS)
    if "name" not in e:
        raise ConfigError(f"{where}: an encoding table needs a name, got {e!r}")
    if is_schedule_text(e["name"]):
        if e.get("options"):
            raise ConfigError(
                f"{where}: the schedule {e['name']!r} takes no options table; give each layer its own in the "
                "string (rope(base=500000.0)@w64*3+nope)"
            )
        spec = _encoding(where, e["name"])
        return EncodingSpec(spec.name, str(e.get("label") or spec.label), {})
    resolve(e["name"])
    options = e.get("options", {})
    if not isinstance(options, dict):
        raise ConfigError(f"{where}: options of {e['name']!r} must be a table, got {options!r}")
    label = e.get("label") or default_label(e["name"], options)
    return EncodingSpec(e["name"], str(label), dict(options))


def _list(where: str, key: str, v: Any, typ: type | tuple[type, ...], what: str) -> list[Any]:
    if not isinstance(v, list) or not v or not all(isinstance(x, typ) and not isinstance(x, bool) for x in v):
        raise ConfigError(f"{where}: {key} must be a non-empty list of {what}, got {v!r}")
    return v


def _grid(where: str, d: dict[str, Any], base: dict[str, Any]) -> Grid:
    from .api import get_task

    _check_keys(where, d, GRID_KEYS)
    merged = {k: d.get(k, base.get(k)) for k in ("tasks", "encodings", "seeds")}
    for k, v in merged.items():
        if v is None:
            raise ConfigError(f"{where}: no {k} (give {k} = [...] in the grid or at the top of the file)")
    tasks = _list(where, "tasks", merged["tasks"], str, "task names")
    for t in tasks:
        get_task(t)  # unknown names: close matches
    seeds = _list(where, "seeds", merged["seeds"], int, "integers")
    encs = [
        _encoding(f"{where} encodings", e)
        for e in _list(where, "encodings", merged["encodings"], (str, dict), "names or tables")
    ]
    labels = [e.label for e in encs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ConfigError(f"{where}: two encodings share the label(s) {dup}; give each a distinct label")
    settings = {**base.get("settings", {}), **d.get("settings", {})}
    _check_keys(f"{where} settings", settings, SETTING_KEYS)
    for k in ("train_lengths", "test_lengths"):
        if k in settings:
            settings[k] = tuple(settings[k])
    return Grid(tasks, encs, seeds, settings, str(d.get("name", "")))


def parse_suite(data: dict[str, Any], *, name: str = "suite", path: Path | None = None) -> Suite:
    """A :class:`Suite` from the parsed TOML ``data`` (everything validated)."""
    where = f"suite {data.get('name', name)!r}" + (f" ({path})" if path else "")
    _check_keys(where, data, TOP_KEYS)
    settings = data.get("settings", {})
    if not isinstance(settings, dict):
        raise ConfigError(f"{where}: settings must be a table")
    _check_keys(f"{where} settings", settings, SETTING_KEYS)
    published = data.get("published", {})
    _check_keys(f"{where} published", published, PUBLISHED_KEYS)
    cols = published.get("columns")
    for row, vals in published.get("rows", {}).items():
        if cols is not None and len(vals) != len(cols):
            raise ConfigError(f"{where} published: row {row!r} has {len(vals)} values for {len(cols)} columns")
    raw_grids = data.get("grid") or [{}]
    grids = [_grid(f"{where} grid {i}", g, data) for i, g in enumerate(raw_grids, 1)]
    measured = data.get("measured", "")
    if not isinstance(measured, str):
        raise ConfigError(f"{where}: measured must be a string (how long the suite took, and where), got {measured!r}")
    findings = _findings(where, data.get("findings", []))
    ptask = published.get("task")
    if ptask is not None and ptask not in {t for g in grids for t in g.tasks}:
        raise ConfigError(f"{where} published: task {ptask!r} is not a task of this suite")
    suite = Suite(
        name=str(data.get("name", name)),
        description=str(data.get("description", "")),
        paper=str(data.get("paper", "")),
        grids=grids,
        published=published,
        notes=str(data.get("notes", "")),
        path=path,
        measured=measured,
        findings=findings,
        comparisons=_comparisons(where, data.get("comparisons", []), {e.label for g in grids for e in g.encodings}),
        controls=_controls(
            where, data.get("controls", {}), {x for g in grids for e in g.encodings for x in (e.label, e.name)}
        ),
    )
    suite.validate()
    return suite


def _builtin_dir() -> Path:
    return Path(str(resources.files("posenc.bench") / "suites"))


def available_suites() -> list[str]:
    """Names of the built-in suites."""
    return sorted(p.stem for p in _builtin_dir().glob("*.toml"))


def suite_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.exists():
            raise ConfigError(f"suite file {p} does not exist")
        return p
    q = _builtin_dir() / f"{name_or_path}.toml"
    if not q.exists():
        raise UnknownNameError("suite", str(name_or_path), available_suites())
    return q


def load_suite(name_or_path: str | Path) -> Suite:
    """A built-in suite by name (``quick``, ``alibi`` ...) or a suite file by path, validated."""
    path = suite_path(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"suite file {path} is not valid TOML: {exc}") from None
    return parse_suite(data, name=path.stem, path=path)


def describe_suites() -> list[tuple[str, str, int]]:
    """(name, description, number of runs) of every built-in suite, read from the TOML files without building them
    (no torch: ``posenc bench --list-suites`` answers at once); a file that cannot be read says why. The count is
    that of :meth:`Suite.jobs` (distinct runs over the grids), the suites' full checks are left to a run."""
    out = []
    for n in available_suites():
        try:
            data = tomllib.loads(suite_path(n).read_text())
            out.append((n, str(data.get("description", "")), _count_runs(data)))
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            out.append((n, f"cannot be loaded here: {exc}", 0))
    return out


def _count_runs(data: dict[str, Any]) -> int:
    """The number of distinct runs of a suite's parsed TOML: tasks × encodings × seeds per grid, a run that two
    grids share (same task, encoding, options, seed and settings) counted once, as :meth:`Suite.jobs` does."""
    import json

    seen: set[tuple[Any, ...]] = set()
    for grid in data.get("grid") or [{}]:
        merged = {k: grid.get(k, data.get(k)) or [] for k in ("tasks", "encodings", "seeds")}
        settings = json.dumps({**data.get("settings", {}), **grid.get("settings", {})}, sort_keys=True)
        for t in merged["tasks"]:
            for e in merged["encodings"]:
                name, options = (e, {}) if isinstance(e, str) else (e["name"], e.get("options", {}))
                for seed in merged["seeds"]:
                    seen.add((t, name, json.dumps(options, sort_keys=True), seed, settings))
    return len(seen)
