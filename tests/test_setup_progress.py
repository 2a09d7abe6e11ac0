"""scripts/setup.sh says what it installs as it goes (issue 27): one line per package with its size.

Independent truth: pip's own output, as pip 23-25 print it (from the registry, from the cache, from local
files), fed through the filter that setup.sh pipes pip into; the local file's size is the file's.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "pip_progress.py"


def _module():
    spec = importlib.util.spec_from_file_location("pip_progress", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PIP = """\
Looking in indexes: https://pypi.org/simple
Collecting torch==2.13.0
  Downloading torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl.metadata (29 kB)
Collecting numpy
  Using cached numpy-2.4.6-cp311-cp311-manylinux_2_27_x86_64.whl (16.9 MB)
Requirement already satisfied: tqdm in ./.venv/lib/python3.11/site-packages (4.70.1)
Downloading torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl (190.5 MB)
WARNING: Location 'file:///opt/x/' is ignored: it is neither a file nor a directory.
treebank 0.0.0 requires nltk, which is not installed.
Obtaining file:///home/me/posenc
Building wheels for collected packages: posenc
  Building wheel for posenc (pyproject.toml): started
Successfully built posenc
Installing collected packages: numpy, torch
Successfully installed numpy-2.4.6 torch-2.13.0+cpu
ERROR: Could not find a version that satisfies the requirement nosuch
"""


def test_one_line_per_package_with_its_size(tmp_path):
    mod = _module()
    wheel = tmp_path / "tiny_pkg-1.2-py3-none-any.whl"
    wheel.write_bytes(b"x" * 2500)
    out = list(mod.lines([*PIP.splitlines(keepends=True), f"Processing {wheel}\n"]))
    assert out == [
        "setup:   numpy 2.4.6: cached 16.9 MB",
        "setup:   torch 2.13.0+cpu: downloading 190.5 MB",
        "setup:   /home/me/posenc: from its source folder (editable)",
        "setup:   building posenc from source",
        "setup:   installing 2 packages: numpy, torch",
        "setup:   installed 2 packages",
        "ERROR: Could not find a version that satisfies the requirement nosuch",
        "setup:   tiny_pkg 1.2: 2.5 kB (local file)",
    ]


def test_setup_pipes_pip_through_it_line_by_line():
    text = (ROOT / "scripts" / "setup.sh").read_text()
    assert "scripts/pip_progress.py" in text and "--quiet" not in text.split("pip_install() {")[1].split("}")[0]
    # the filter prints each line as it comes (a pipe would otherwise hold them until pip ends)
    p = subprocess.Popen(
        [sys.executable, str(SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    p.stdin.write("  Using cached numpy-2.4.6-cp311-none.whl (16.9 MB)\n")
    p.stdin.flush()
    assert p.stdout.readline() == "setup:   numpy 2.4.6: cached 16.9 MB\n"
    p.stdin.close()
    assert p.wait(timeout=30) == 0


def test_a_silent_pip_gets_a_line_every_heartbeat_saying_what_it_does():
    # pip unpacking 71 packages printed nothing for 83 s (issue 48): the filter says it is still at it
    import threading

    mod = _module()
    release = threading.Event()
    out: list[str] = []

    def pip():  # pip's lines; after "Installing collected packages" it is silent until released
        yield "Installing collected packages: numpy, torch\n"
        release.wait(timeout=60)
        yield "Successfully installed numpy-2.4.6 torch-2.13.0\n"

    def write(line: str) -> None:
        out.append(line)
        if sum("still" in x for x in out) == 2:
            release.set()

    ticks = iter(range(0, 1000, 10))  # a clock that reads 10 s later at every look
    mod.relay(pip(), write, heartbeat=0.01, clock=lambda: next(ticks))
    assert out == [
        "setup:   installing 2 packages: numpy, torch",
        "setup:   ... still installing 2 packages (10 s)",
        "setup:   ... still installing 2 packages (20 s)",
        "setup:   installed 2 packages",
    ]
    assert mod.doing("setup:   torch 2.13.0: downloading 190.5 MB") == "downloading torch 2.13.0 (190.5 MB)"
    assert mod.doing("setup:   building posenc from source") == "building posenc from source"


def test_the_data_step_is_not_held_back_until_it_ends():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    data_line = next(line for line in setup.splitlines() if "bash scripts/install_data.sh" in line)
    assert "tail" not in data_line and "|" not in data_line  # `| tail -n 3` held every line for 126 s
    install = (ROOT / "scripts" / "install_data.sh").read_text()
    assert install.count('| "$PY" -u scripts/pip_progress.py') == 2  # the packages, then the source archives
