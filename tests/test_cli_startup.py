"""`posenc --help` starts without importing torch (issue 14: a newcomer's first hour).

Independent truth: Python's own record of what a process imported (``-X importtime`` on
stderr, and ``sys.modules`` at exit), not a timing, which would flake on a shared machine.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HELPS = [
    ["--help"],
    ["--version"],
    ["list", "--help"],
    ["info", "--help"],
    ["bench", "--help"],
    ["bench", "--list-suites"],  # read from the suites' TOML files, not built (issue 48)
    ["inspect", "--help"],
    ["extend", "--help"],
    ["results", "--help"],
]

# run the CLI, then report which torch modules the process holds
PROBE = """
import sys
from posenc.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("TORCH-MODULES:", sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
print("EXIT:", code)
"""


def _torch_lines(importtime_stderr: str) -> list[str]:
    # lines look like "import time:   1234 |   5678 |   torch.nn"
    return [
        line
        for line in importtime_stderr.splitlines()
        if line.startswith("import time:") and line.rsplit("|", 1)[-1].strip().split(".")[0] == "torch"
    ]


def _run(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("argv", HELPS, ids=" ".join)
def test_help_does_not_import_torch(argv):
    proc = _run([sys.executable, "-X", "importtime", "-m", "posenc.cli", *argv])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "posenc" in proc.stdout
    assert _torch_lines(proc.stderr) == []
    probe = _run([sys.executable, "-c", PROBE, *argv])
    assert "TORCH-MODULES: []" in probe.stdout and "EXIT: 0" in probe.stdout, probe.stdout + probe.stderr


def test_the_probes_do_see_torch_when_it_is_imported(tmp_path):
    # the same two checks on a command that needs torch (the registry, with no cards cached): they must notice it
    env = dict(os.environ, POSENC_CACHE=str(tmp_path / "a"))
    proc = _run([sys.executable, "-X", "importtime", "-m", "posenc.cli", "list", "--family", "bias"], env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "alibi" in proc.stdout
    assert any(line.rsplit("|", 1)[-1].strip() == "torch" for line in _torch_lines(proc.stderr))
    probe = _run([sys.executable, "-c", PROBE, "list", "--family", "bias"], dict(env, POSENC_CACHE=str(tmp_path / "b")))
    assert "'torch'" in probe.stdout.split("TORCH-MODULES:")[1]


def test_list_imports_no_torch_once_its_cards_are_cached(tmp_path):
    env = dict(os.environ, POSENC_CACHE=str(tmp_path))
    first = _run([sys.executable, "-c", PROBE, "list"], env)
    assert "'torch'" in first.stdout.split("TORCH-MODULES:")[1]  # built from the registry, then stored
    again = _run([sys.executable, "-c", PROBE, "list"], env)
    assert "TORCH-MODULES: []" in again.stdout and "EXIT: 0" in again.stdout, again.stdout + again.stderr
    listing = again.stdout.split("TORCH-MODULES:")[0]
    assert listing == first.stdout.split("TORCH-MODULES:")[0]  # the same table from the cache
    import posenc

    listed = {line.split()[0] for line in listing.splitlines()[1:] if line.strip() and not line.startswith(" ")}
    assert set(posenc.available()) <= listed


def test_the_cards_cache_key_follows_every_source_file(tmp_path, monkeypatch):
    from posenc import _cards

    pkg = tmp_path / "posenc"
    (pkg / "bias").mkdir(parents=True)
    (pkg / "base.py").write_text("x = 1\n")
    monkeypatch.setattr(_cards, "_PACKAGE", pkg)
    first = _cards.source_key()
    (pkg / "bias" / "new_encoding.py").write_text("y = 2\n")  # adding an encoding file
    second = _cards.source_key()
    (pkg / "base.py").write_text("x = 10\n")  # editing one
    assert len({first, second, _cards.source_key()}) == 3


def test_a_broken_cards_cache_is_rebuilt(tmp_path, monkeypatch):
    from posenc import _cards

    monkeypatch.setenv("POSENC_CACHE", str(tmp_path))
    want = _cards.cards()
    (tmp_path / f"cards-{_cards.source_key()}.json").write_text("{not json")
    assert _cards.cards() == want
    assert [c["name"] for c in want] == __import__("posenc").available()


def test_import_posenc_is_lazy_but_complete():
    code = (
        "import sys, posenc\n"
        "assert 'torch' not in sys.modules, 'import posenc imported torch'\n"
        "from posenc import ConfigError, __version__\n"
        "assert 'torch' not in sys.modules\n"
        "import posenc.models, posenc.attention, posenc.registry, posenc.base\n"
        "assert posenc.Transformer is posenc.models.Transformer\n"
        "assert posenc.Encoder is posenc.models.Encoder and posenc.get is posenc.registry.get\n"
        "assert posenc.KVCache is posenc.attention.KVCache and posenc.Card is posenc.base.Card\n"
        "missing = [n for n in posenc.__all__ if not hasattr(posenc, n)]\n"
        "assert not missing, missing\n"
        "assert set(posenc.__all__) <= set(dir(posenc))\n"
        "assert posenc.native.__name__ == 'posenc.native'\n"  # a submodule, as before
        "try:\n"
        "    posenc.no_such_name\n"
        "except AttributeError as e:\n"
        "    assert 'no_such_name' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
        "from posenc import bench, analysis\n"
        "import posenc.bench.runner, posenc.analysis.properties\n"
        "assert bench.run_suite is posenc.bench.runner.run_suite\n"
        "assert analysis.measure is posenc.analysis.properties.measure\n"
        "assert analysis.PROPERTIES is posenc.analysis.properties.PROPERTIES\n"
        "missing = [n for m in (bench, analysis) for n in m.__all__ if not hasattr(m, n)]\n"
        "assert not missing, missing\n"
        "print('ok')\n"
    )
    proc = _run([sys.executable, "-c", code])
    assert proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_inspect_help_lists_what_the_library_offers():
    # the torch-free names of `posenc inspect --help` agree with the modules that use them
    from posenc.analysis import names
    from posenc.analysis.plots import FORMATS
    from posenc.analysis.properties import PROPERTY_KEYS
    from posenc.analysis.report import RENDERERS

    assert tuple(sorted(RENDERERS)) == tuple(sorted(names.CARD_FORMATS))
    assert FORMATS == names.FORMATS
    assert PROPERTY_KEYS == tuple(k for k, _, _ in names.PROPERTIES)


# ---------------------------------------------------------------------------- usage errors before torch (issue 40)
# the PROBE with torch made impossible to import: a usage error must be found without it
BLOCKED = (
    "import sys\n"
    "class _NoTorch:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'torch' or name.startswith('torch.'):\n"
    "            raise ImportError('torch is blocked in this test')\n"
    "sys.meta_path.insert(0, _NoTorch())\n"
) + PROBE

USAGE_ERRORS = [
    (["bench", "--encodings", "ropee"], ["--encodings: unknown encoding 'ropee'", "Did you mean: rope"]),
    (["bench", "--encodings", "rope", "alibii", "sinusiodal"], ["'alibii' (did you mean: alibi", "sinusoidal"]),
    (["bench", "--encodings", "yarnn"], ["Did you mean: rope-yarn?"]),  # by its alias yarn, named as listed
    # a schedule's layer names are checked from the cards too (issue 48: 6.5 s before, for a typo)
    (["bench", "--encodings", "rope*3+nopee"], ["'rope*3+nopee': layer 3: unknown encoding 'nopee'", "nope"]),
    (["bench", "--encodings", "rope(base=5e5)@w64*2+t5+alibii#qk"], ["layer 3: unknown encoding 'alibii'", "alibi"]),
    (["bench", "--tasks", "ordr"], ["unknown task 'ordr'", "Did you mean: order"]),
    (["bench", "--suite", "quik"], ["unknown suite 'quik'", "Did you mean: quick"]),
    (["bench", "--suite", "no-such-file.toml"], ["suite file no-such-file.toml does not exist"]),
    (["bench", "--suite", "quick", "--encodings", "ropee"], ["not in suite 'quick': 'ropee' (did you mean: rope"]),
    (["bench", "--suite", "shaw-k", "--encodings", "shaw k=44"], ["'shaw k=44' (did you mean: shaw k=4"]),
    (["bench", "--suite", "quick", "--tasks", "ordr"], ["not in suite 'quick': 'ordr' (did you mean: order"]),
    (["bench", "--steps", "0"], ["--steps must be an integer >= 1, got 0"]),
    (["inspect", "ropee"], ["posenc inspect: error: unknown encoding 'ropee'", "Did you mean: rope"]),
]


@pytest.fixture(scope="module")
def names_cached(tmp_path_factory):
    """The environment of a cache folder that holds the cards and the task names (as any earlier `posenc` command
    leaves them)."""
    return dict(os.environ, POSENC_CACHE=str(tmp_path_factory.mktemp("cache")))


def _cached_run(env: dict, args: list[str]) -> subprocess.CompletedProcess[str]:
    """``args`` run with the names cached for posenc's files as they are. The cache's key follows those files: where
    one changed while the command ran (someone editing the tree), the cache is filled again and the command rerun."""
    from posenc import _cards

    fill = "from posenc import _cards\nassert _cards.cards() and _cards.task_names()\n"
    for _ in range(5):
        key = _cards.source_key()
        proc = _run([sys.executable, "-c", fill], env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        got = _run(args, env)
        if _cards.source_key() == key:
            return got
    return got


@pytest.mark.parametrize(("argv", "says"), USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_a_usage_error_is_found_before_torch_is_imported(names_cached, argv, says):
    probe = _cached_run(names_cached, [sys.executable, "-c", BLOCKED, *argv])
    assert "TORCH-MODULES: []" in probe.stdout and "EXIT: 2" in probe.stdout, probe.stdout + probe.stderr
    assert "Traceback" not in probe.stderr and "blocked" not in probe.stderr, probe.stderr
    for text in says:
        assert text in probe.stderr, probe.stderr
    # the same command, its imports recorded by Python itself
    proc = _cached_run(names_cached, [sys.executable, "-X", "importtime", "-m", "posenc.cli", *argv])
    assert proc.returncode == 2 and _torch_lines(proc.stderr) == [], proc.stderr[-3000:]


def test_a_typo_suggests_only_names_posenc_list_shows(names_cached):
    import posenc
    from posenc import _cards, registry

    listed = set(posenc.available())
    aliases = registry.aliases()
    assert aliases  # the registry has aliases: the test below would be empty without
    for alias, target in aliases.items():
        close = registry.unknown_encoding(alias + "x").close_matches
        assert close and set(close) <= listed, (alias, close)
        assert target in close, (alias, close)  # the alias typed with a slip leads to what it stands for
        assert close == _cards.close_names(alias + "x", listed, aliases)
    with pytest.raises(posenc.UnknownNameError) as exc:
        posenc.get("rope-pii")
    assert "rope-pi" not in str(exc.value).replace("'rope-pii'", "") and "rope-linear" in str(exc.value)


def test_a_command_that_loaded_the_names_leaves_them_for_the_next(tmp_path):
    env = dict(os.environ, POSENC_CACHE=str(tmp_path))
    argv = ["bench", "--report-only", "--out", str(tmp_path / "r"), "--encodings", "rope", "--tasks", "order"]
    probe = _run([sys.executable, "-c", PROBE, *argv], env)
    assert "EXIT: 0" in probe.stdout, probe.stdout + probe.stderr
    # (more than one of each where posenc's files changed while it ran: the key follows them)
    assert list(tmp_path.glob("cards-*.json")) and list(tmp_path.glob("tasks-*.json"))
    again = _cached_run(env, [sys.executable, "-c", BLOCKED, "bench", "--encodings", "ropee"])
    assert "EXIT: 2" in again.stdout and "Did you mean: rope" in again.stderr, again.stdout + again.stderr


def test_in_a_process_that_loaded_the_registry_the_registry_is_asked(monkeypatch):
    # a program that registered an encoding or a task of its own, then called the command line: no false "unknown"
    import posenc.registry
    from posenc import _cards
    from posenc.bench import types

    monkeypatch.setattr(_cards, "cards", lambda: pytest.fail("the cards were read with the registry loaded"))
    _cards.check_encodings(["rope", "rope-pi"])
    with pytest.raises(posenc.UnknownNameError, match=r"--encodings: unknown encoding 'ropee'\. Did you mean: rope"):
        _cards.check_encodings(["ropee"], "--encodings")
    monkeypatch.setitem(types._TASKS, "a-task-of-mine", object())
    assert "a-task-of-mine" in _cards.task_names() and "order" in _cards.task_names()


def test_a_schedule_typo_says_what_the_full_parse_says(names_cached):
    # the torch-free check and the schedule's own parse (with the registry) name the same layer and matches
    from posenc import _cards
    from posenc.errors import UnknownNameError
    from posenc.schedule import check_names

    for text in ("rope*3+nopee", "t5+rope@w64*2+alibii#qk", "rope(base=10000.0)*2+ropee..."):
        with pytest.raises(UnknownNameError) as full:
            check_names([text], "--encodings")
        probe = _cached_run(names_cached, [sys.executable, "-c", BLOCKED, "bench", "--encodings", text])
        assert "EXIT: 2" in probe.stdout, probe.stdout + probe.stderr
        assert f"posenc: error: {full.value}" in probe.stderr, (probe.stderr, str(full.value))
    assert _cards._schedule_names("rope(base=5e5)@w64*3+nope#qk+t5") == [(0, "rope"), (3, "nope"), (4, "t5")]


def test_the_listing_counts_the_runs_a_suite_builds():
    from posenc.bench.suites import _count_runs, describe_suites, load_suite, parse_suite

    listed = {n: count for n, _, count in describe_suites()}
    for name in ("quick", "shaw-k"):  # grids with settings of their own; encodings with options
        assert listed[name] == len(load_suite(name).jobs(check=False))
    data = {  # two grids that share the runs of one encoding: counted once, as the suite runs them once
        "tasks": ["order"],
        "seeds": [0, 1],
        "settings": {"steps": 5},
        "grid": [
            {"encodings": ["rope", "alibi"]},
            {"encodings": ["rope", {"name": "shaw", "options": {"max_relative_position": 2}}]},
            {"encodings": ["rope"], "settings": {"steps": 6}},
        ],
    }
    assert _count_runs(data) == len(parse_suite(data).jobs(check=False)) == 8
