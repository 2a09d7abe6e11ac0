"""The environment a run was trained in, stored with it (``record["env"]``).

Results can differ in the last digits between machines: the native C kernels
(:mod:`posenc.native`) are compiled for the instruction set the CPU has (a baseline,
AVX2 or AVX-512 build, or ``-march=native`` where asked for), torch's BLAS picks its
kernels by CPU, and torch versions and thread counts change summation orders. The
``kernels`` entry names the build that ran. :func:`run_environment` is called by :func:`posenc.bench.runner.run_one`,
that is in the process that trains the run (a worker process, a Ray task, torchrun's
rank 0), not in the parent that stores it. The report lists the environments of a
suite and warns where the runs of one table come from different ones
(:data:`COMPARED`).
"""

from __future__ import annotations

import functools
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: the keys of ``record["env"]``
KEYS = ("posenc", "git_commit", "git_dirty", "torch", "kernels", "cpu", "threads", "python", "platform")
#: the keys whose difference between two runs of one table the report warns about
COMPARED = ("cpu", "kernels", "torch")


def _git(*args: str, cwd: Path) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


@functools.cache
def git_state() -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the git tree posenc's source is in, or ``(None, None)`` (an installed package).

    The package counts as in a tree only where its own ``__init__.py`` is tracked there (a
    package installed into a virtual environment inside some repository is not). ``dirty``:
    tracked files under the package differ from the commit. Cached per process.
    """
    pkg = Path(__file__).resolve().parent
    if _git("ls-files", "--error-unmatch", "__init__.py", cwd=pkg) is None:
        return None, None
    commit = _git("rev-parse", "HEAD", cwd=pkg)
    if commit is None:
        return None, None
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", cwd=pkg)
    return commit, (None if status is None else bool(status))


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else :func:`platform.processor`, else the machine type."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name") and ":" in line:
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def kernel_path() -> str:
    """Which kernels this process runs rotary / FIRE positions with: the native C ones (and which build of them:
    ``"native C (avx2: -mavx2 -mfma)"``, ``"native C (baseline)"``) or PyTorch's.

    Asks :func:`posenc.native.build` (builds the kernels on the first call of a
    machine, then loads the cached build), as every caller of the kernels does.
    """
    from . import native

    if not native.enabled:
        return "PyTorch (posenc.native.enabled is False)"
    try:
        name = native.build()
        if name is not None:
            extra = " ".join(native.ISA_FLAGS.get(name, ()))
            return f"native C ({name}: {extra})" if extra else f"native C ({name})"
    except Exception as exc:  # noqa: BLE001 -- a record must not fail for this; it says why (POSENC_NATIVE=maybe ...)
        return f"PyTorch (native kernels failed: {type(exc).__name__}: {str(exc)[:200]})"
    why = str(getattr(native, "_state", {}).get("error", "unavailable"))
    return f"PyTorch (native kernels off: {why[:200]})"


@functools.cache
def _fixed() -> dict[str, Any]:
    import torch

    from ._version import __version__

    commit, dirty = git_state()
    return {
        "posenc": __version__,
        "git_commit": commit,
        "git_dirty": dirty,
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "platform": platform.platform(),
    }


def run_environment() -> dict[str, Any]:
    """posenc's version and git commit, torch's version, the kernel path, the CPU, torch's thread count,
    Python and the platform of this process (the keys :data:`KEYS`). Cheap: all but the thread count
    and the kernel path are computed once per process."""
    import torch

    env = {**_fixed(), "kernels": kernel_path(), "threads": torch.get_num_threads()}
    return {k: env[k] for k in KEYS}


def describe(env: dict[str, Any] | None) -> str:
    """One line for a stored ``env`` (``"not recorded"`` for runs stored before posenc recorded it)."""
    if not env:
        return "not recorded"
    commit = env.get("git_commit")
    rev = f" @ {commit[:10]}{' (modified)' if env.get('git_dirty') else ''}" if commit else ""
    return (
        f"{env.get('cpu', '?')}; {env.get('kernels', '?')}; torch {env.get('torch', '?')}, "
        f"{env.get('threads', '?')} thread(s); posenc {env.get('posenc', '?')}{rev}; "
        f"Python {env.get('python', '?')}; {env.get('platform', '?')}"
    )


def machines_and_commits(envs: Sequence[dict[str, Any] | None]) -> tuple[list[str], list[str]]:
    """Each machine of ``envs`` once (:func:`describe` without the commit), and each posenc commit once: records
    measured at several commits on one machine name that machine once."""
    machines = sorted({describe({k: v for k, v in e.items() if k not in ("git_commit", "git_dirty")} if e else e)
                       for e in envs})
    commits = sorted({f"{str(e['git_commit'])[:10]}{' (modified)' if e.get('git_dirty') else ''}"
                      for e in envs if e and e.get("git_commit")})
    return machines, commits


def differences(envs: list[dict[str, Any] | None]) -> dict[str, list[str]]:
    """The :data:`COMPARED` keys on which the recorded ``envs`` differ, with their values (runs without one
    are left out: their environment is unknown, not different)."""
    known = [e for e in envs if e]
    out = {}
    for key in COMPARED:
        values = sorted({str(e.get(key)) for e in known})
        if len(values) > 1:
            out[key] = values
    return out


if __name__ == "__main__":  # pragma: no cover
    import json

    json.dump(run_environment(), sys.stdout, indent=1)
    print()
