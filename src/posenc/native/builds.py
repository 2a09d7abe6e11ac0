"""The builds of the kernels of :mod:`posenc.native`: which instruction set (ISA) to compile for, with which flags,
and the compile into the cache.

One C source (:mod:`posenc.native.source`), compiled with portable flags in one of a few builds chosen at run time
from the CPU's flags (``/proc/cpuinfo``), or the one ``POSENC_NATIVE_ISA`` forces. A file name carrying the hash of
the source, the compiler and the flags keeps builds apart; a build is written to a temporary name and renamed, so
concurrent processes never load half a file, and its SHA-256 is written beside it, so that a cached file damaged
later (truncated, overwritten) is built again rather than loaded. Imports :mod:`posenc.errors` and
:mod:`posenc.native.source` only (no torch, no ctypes: loading is :mod:`posenc.native.loader`'s job).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import ConfigError
from .source import SOURCE

#: the builds of the kernels, by name: the flags added to the common ones (:data:`_COMMON_FLAGS`). One source,
#: compiled for the instruction set that :func:`isa` picks from the CPU's flags (the runtime dispatch); the
#: vector code of each build is only what its flags allow, so a build runs on every CPU that has them.
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "baseline": (),  # the compiler's default target: x86-64 (SSE2) on x86, armv8-a on arm64 ...
    "avx2": ("-mavx2", "-mfma"),  # the vector units of x86-64-v3 (Haswell, Zen and later)
    "avx512": ("-mavx512f", "-mavx2", "-mfma"),  # adds the kernels' AVX-512 code (Skylake-X, Zen 4 ...)
    "native": ("-march=native",),  # this CPU exactly: only when asked for (POSENC_NATIVE_ISA=native)
}
#: the /proc/cpuinfo flags a build needs (every flag its compiler options let the compiler use)
ISA_NEEDS: dict[str, tuple[str, ...]] = {
    "baseline": (),
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx2", "fma"),
    "native": (),
}
_COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fno-tree-slp-vectorize", "-shared", "-fPIC", "-std=c99")


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from ``/proc/cpuinfo`` (Linux; the kernel lists only what the OS enables), or
    ``None`` where there is no such file."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags") and ":" in line:
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def supported_isas() -> list[str]:
    """The builds this CPU can run, best first (``native`` left out: it is always "this CPU").

    ``avx2`` and ``avx512`` only on x86 with the flags :data:`ISA_NEEDS` lists (read from ``/proc/cpuinfo``;
    elsewhere only ``baseline``, the one build known to run)."""
    flags = _cpu_flags() if _is_x86() else None
    out = ["baseline"]
    if flags is not None:
        out = [name for name in ("avx512", "avx2") if set(ISA_NEEDS[name]) <= flags] + out
    return out


def isa() -> str:
    """The build to use: ``$POSENC_NATIVE_ISA`` (``baseline``, ``avx2``, ``avx512`` or ``native``) if set, else the
    best one :func:`supported_isas` finds for this CPU.

    Raises:
        ConfigError: ``POSENC_NATIVE_ISA`` names no build, or a build this CPU cannot run (it would die of an
            illegal instruction).
    """
    want = os.environ.get("POSENC_NATIVE_ISA", "").strip().lower()
    if want in ("", "auto"):
        return supported_isas()[0]
    if want not in ISA_FLAGS:
        raise ConfigError(f"POSENC_NATIVE_ISA={want!r} names no build; use one of auto, {', '.join(ISA_FLAGS)}")
    flags = _cpu_flags() if _is_x86() else None
    missing = [f for f in ISA_NEEDS[want] if flags is not None and f not in flags]
    if missing or (ISA_NEEDS[want] and not _is_x86()):
        why = f"lacks {', '.join(missing)}" if missing else f"is not x86 ({platform.machine()})"
        raise ConfigError(
            f"POSENC_NATIVE_ISA={want!r}: this CPU {why}; it runs {', '.join(supported_isas())} (or unset it)"
        )
    return want


def _cpu_tag() -> str:
    """The CPU's model and flags: part of the cache key of a ``native`` build only (the others are portable)."""
    tag = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "model name")):
                    tag += line
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return tag or platform.processor() or platform.machine()


def cache_dir() -> Path:
    """Where compiled kernels live: ``$POSENC_CACHE_DIR`` or ``~/.cache/posenc``."""
    env = os.environ.get("POSENC_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "posenc"


def _compiler() -> str | None:
    """``$CC`` where it is set and found, else the first of ``cc``, ``gcc``, ``clang`` on ``PATH``; a ``CC`` that is
    not found is said on stderr (not passed over in silence) before another is used."""
    want = os.environ.get("CC", "").strip()
    if want and shutil.which(want):
        return want
    found = next((cc for cc in ("cc", "gcc", "clang") if shutil.which(cc)), None)
    if want:
        instead = f"building the kernels with {found}" if found else "and no other C compiler either"
        sys.stderr.write(f"posenc: CC={want!r} is not found on PATH; {instead}\n")
    return found


def flags(name: str) -> list[str]:
    """The compiler flags of the build ``name`` (a key of :data:`ISA_FLAGS`)."""
    return [*_COMMON_FLAGS, *ISA_FLAGS[name]]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(lib_path: Path) -> bool:
    """Whether a cached build is whole: its SHA-256 is the one written beside it (``<file>.sha256``) when it was
    built. A truncated or damaged file fails (loading one can kill the process with a bus error, not an
    exception), and so does a build cached before the digests were written (it is built again, once)."""
    try:
        return lib_path.with_name(lib_path.name + ".sha256").read_text().strip() == _digest(lib_path)
    except OSError:
        return False


def _compile(cc: str, name: str) -> tuple[Path | None, str]:
    """Compile the build ``name`` into the cache (once: the file name carries the hash of the source, compiler and
    flags) and return ``(path, "")``, or ``(None, why)``.

    A cached build is used only where it is whole (:func:`_intact`); a damaged one is built again, saying so on
    stderr. Where the cache directory cannot be written, the build goes to a private folder under the temporary
    directory, saying so too."""
    opts = flags(name)
    parts = [SOURCE, cc, *opts, platform.machine()] + ([_cpu_tag()] if name == "native" else [])
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    file = f"native-{name}-{key[:16]}.so"
    errors = []
    # the cache directory, else a private one under the temporary directory (a read-only home)
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"posenc-{os.getuid() if hasattr(os, 'getuid') else 0}"):
        lib_path = folder / file
        if lib_path.exists():
            if _intact(lib_path):
                return lib_path, ""
            if lib_path.with_name(file + ".sha256").exists():  # damaged since (one from before the digests: quietly)
                sys.stderr.write(f"posenc: the cached kernel build {lib_path} is damaged (truncated?); rebuilding\n")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                src = Path(tmp) / "posenc_native.c"
                src.write_text(SOURCE)
                so = Path(tmp) / "posenc_native.so"
                res = subprocess.run([cc, *opts, "-o", str(so), str(src)], capture_output=True, text=True)
                if res.returncode:
                    why = res.stderr.strip()[:500] or "no message"
                    return None, f"{cc} exited with status {res.returncode} building the {name} kernels: {why}"
                digest = Path(tmp) / "digest"
                digest.write_text(_digest(so) + "\n")
                # atomic, the digest first: a concurrent process loads the old file or the new one, never half of one
                os.replace(digest, lib_path.with_name(file + ".sha256"))
                os.replace(so, lib_path)
            if errors:
                sys.stderr.write(f"posenc: {errors[0]}; built the {name} kernels in {folder} instead\n")
            return lib_path, ""
        except OSError as exc:
            errors.append(f"could not build in {folder}: {exc}")
    return None, "; ".join(errors)
