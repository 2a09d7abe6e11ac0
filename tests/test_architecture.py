"""The shape of the code: the layer contracts hold, each module is in a layer, the picture is current, files are short.

The layers (docs/architecture.md) are import-linter contracts in pyproject.toml: a new import circle, or a module
that imports from a layer above its own (a lazy import inside a function counts), fails here.
"""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "posenc"

pytest.importorskip("importlinter", reason="the test extra installs import-linter")


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_the_import_contracts_hold() -> None:
    """lint-imports over src/posenc: the layers of posenc and of posenc.bench, and no circles between siblings."""
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    kept = re.search(r"Contracts: (\d+) kept, (\d+) broken", out)
    assert kept is not None and int(kept.group(2)) == 0 and int(kept.group(1)) == len(_contracts()), out[-2000:]


LAYERED = [c["containers"][0] for c in _contracts() if c["type"] == "layers"]


def test_the_packages_are_layered() -> None:
    assert {"posenc", "posenc.bench", "posenc.attention", "posenc.bench.reporting"} <= set(LAYERED)


@pytest.mark.parametrize("container", LAYERED)
def test_every_module_has_a_layer(container: str) -> None:
    """A module that no layer names would be free of the contract: each submodule of the container is in a layer."""
    contract = next(c for c in _contracts() if c["type"] == "layers" and c["containers"] == [container])
    named = {n.strip().strip("()") for spec in contract["layers"] for n in re.split(r"[|:]", spec)}
    path = SRC.joinpath(*container.split(".")[1:])
    modules = {m.name for m in pkgutil.iter_modules([str(path)])}
    missing = sorted(modules - named)
    assert not missing, f"{container}: {missing} are in no layer of pyproject.toml's [tool.importlinter] contract"


def test_the_architecture_picture_is_current() -> None:
    """docs/img/architecture.svg is drawn from the contracts and the import graph by scripts/architecture.py."""
    run = subprocess.run(
        [sys.executable, "scripts/architecture.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr


#: files whose length is one method's (issue 26: "unless it is one method's file whose length is the method")
LONG_ALLOWED: dict[str, str] = {}
LIMIT = 750


def test_no_file_in_src_is_long() -> None:
    """No module over ~700 lines (a file a reader can hold), unless it is one method's file (listed above, with why)."""
    long = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        n = len(path.read_text().splitlines())
        if n > LIMIT and rel not in LONG_ALLOWED:
            long[rel] = n
    assert not long, f"over {LIMIT} lines: {long} — split by job (docs/architecture.md)"
