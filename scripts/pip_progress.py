"""Turn pip's output into one line per package as it comes, with its size: scripts/setup.sh pipes pip through this.

    setup:   torch 2.13.0: downloading 190.5 MB
    setup:   numpy 2.4.6: cached 16.3 MB
    setup:   tqdm 4.70.1: 78 kB (local file)
    setup:   installing 21 packages: torch, numpy, ...

While pip is silent (unpacking 71 packages takes a minute and a half on 2 cores; a large download or a build
as long), a line every ``HEARTBEAT`` seconds says what it is still doing and for how long::

    setup:   ... still installing 71 packages (20 s)

pip prints a package's size on its "Downloading" and "Using cached" lines; for a local file ("Processing
PATH") the size is the file's. What pip says about packages already installed is dropped; its errors and
warnings pass through, except the lines setup.sh has always dropped (the data packages are installed without
their dependencies on purpose: docs/data.md). Reads stdin, writes stdout, one flushed line at a time.
"""

from __future__ import annotations

import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator

PREFIX = "setup:   "
HEARTBEAT = 10.0  # seconds of silence before a line that says pip is still at it
DROP = (
    re.compile(r"^WARNING: Location "),
    re.compile(r"^ERROR: pip's dependency resolver does not currently"),
    re.compile(r" requires .*, which is not installed\.$"),
    re.compile(r"^Requirement already satisfied"),
    re.compile(r"^Looking in (indexes|links)"),
    re.compile(r"^\s*(Preparing|Getting requirements|Installing build|Checking if build|Created wheel|Stored in)"),
    re.compile(r"^\s*(Attempting uninstall|Found existing installation|Uninstalling |Successfully uninstalled)"),
    re.compile(r"^\s*[━─ ]+[\d.]+/[\d.]+ "),  # a progress bar, should one be drawn
)


def package_of(filename: str) -> str:
    """``name version`` of a wheel or source archive's file name (``torch-2.13.0+cpu-cp311-...whl``)."""
    base = os.path.basename(filename.strip())
    for ext in (".whl", ".tar.gz", ".zip", ".tar.bz2"):
        if base.endswith(ext):
            base = base[: -len(ext)]
            break
    parts = base.split("-")
    return f"{parts[0]} {parts[1]}" if len(parts) > 1 else parts[0]


def _size(nbytes: int) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= k:
            return f"{nbytes / k:.1f} {unit}"
    return f"{nbytes} bytes"


def lines(pip_output: Iterable[str]) -> Iterator[str]:
    """The lines to print for pip's lines."""
    for raw in pip_output:
        line = raw.rstrip("\n")
        if not line.strip() or any(p.search(line) for p in DROP):
            continue
        m = re.match(r"^\s*(Downloading|Using cached) (\S+) \(([^)]+)\)", line)
        if m:
            if ".metadata" in m.group(2):  # the resolver reading a wheel's metadata, not the wheel
                continue
            how = "downloading" if m.group(1) == "Downloading" else "cached"
            yield f"{PREFIX}{package_of(m.group(2))}: {how} {m.group(3)}"
            continue
        m = re.match(r"^\s*Processing (\S+)", line)
        if m:
            path = m.group(1)
            if os.path.isfile(path):
                yield f"{PREFIX}{package_of(path)}: {_size(os.path.getsize(path))} (local file)"
            else:  # a folder (posenc itself, editable)
                yield f"{PREFIX}{path}: from its source folder"
            continue
        m = re.match(r"^\s*Collecting (\S+)", line)
        if m:
            continue  # its Downloading / Using cached / Processing line follows, with the size
        m = re.match(r"^Installing collected packages: (.*)", line)
        if m:
            names = [n.strip() for n in m.group(1).split(",") if n.strip()]
            yield f"{PREFIX}installing {len(names)} package{'s' if len(names) != 1 else ''}: {', '.join(names)}"
            continue
        m = re.match(r"^Successfully installed (.*)", line)
        if m:
            n = len(m.group(1).split())
            yield f"{PREFIX}installed {n} package{'s' if n != 1 else ''}"
            continue
        m = re.match(r"^\s*Building wheels for collected packages: (.*)", line)
        if m:
            yield f"{PREFIX}building {m.group(1).strip()} from source"
            continue
        m = re.match(r"^\s*Obtaining (file://)?(\S+)", line)
        if m:
            yield f"{PREFIX}{m.group(2)}: from its source folder (editable)"
            continue
        if re.match(r"^\s*(Building wheel for |Successfully built )", line):
            continue
        if re.match(r"^\s*(Obtaining|Installing|Building|Running|Created|Stored|  )", line):
            continue  # pip's other progress lines: said above in fewer words
        yield line  # errors, warnings: as pip wrote them


def doing(line: str) -> str:
    """What pip is busy with after it printed ``line`` (one of ours): ``installing 71 packages``,
    ``downloading torch 2.13.0 (190.5 MB)``, ``building posenc from source``; else ``working``."""
    text = line.removeprefix(PREFIX)
    m = re.match(r"^installing (\d+ packages?)", text)
    if m:
        return f"installing {m.group(1)}"
    m = re.match(r"^(\S+ \S+): downloading (.*)", text)
    if m:
        return f"downloading {m.group(1)} ({m.group(2)})"
    if text.startswith("building "):
        return text
    return "working"


def relay(
    pip_output: Iterable[str],
    write: Callable[[str], None],
    *,
    heartbeat: float = HEARTBEAT,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Write :func:`lines` of ``pip_output`` as they come, and after each ``heartbeat`` seconds without one a line
    ``... still <what pip is doing> (<seconds since its last line> s)``. ``pip_output`` is read in a thread."""
    got: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        try:
            for out in lines(pip_output):
                got.put(out)
        finally:
            got.put(None)

    threading.Thread(target=read, daemon=True).start()
    since, what = clock(), "working"
    while True:
        try:
            out = got.get(timeout=heartbeat)
        except queue.Empty:
            write(f"{PREFIX}... still {what} ({clock() - since:.0f} s)")
            continue
        if out is None:
            return
        write(out)
        since, what = clock(), doing(out)


def main() -> int:
    relay(sys.stdin, lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
