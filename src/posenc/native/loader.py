"""Loading the kernels of :mod:`posenc.native`: the switch (:data:`enabled`), the one build a process loads (on
first use, under a lock), the ctypes signatures of its functions, and what :func:`available`, :func:`build` and
:func:`status` say about it.

Where there is no compiler or the build fails, :func:`available` is ``False``, one line on stderr says so, and
every caller keeps its PyTorch path; ``POSENC_NATIVE=0`` turns the kernels off without that line (a value that is
not a yes/no word, ``POSENC_NATIVE=maybe``, is a :class:`~posenc.errors.ConfigError`: :func:`posenc.settings.env_flag`).
Imports :mod:`posenc.native.builds` (which build, and the compile) and :mod:`posenc.settings`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

import torch

from ..settings import env_flag
from .builds import _compile, _compiler, flags, isa, supported_isas

# set to False to keep every caller on its PyTorch path (tests compare the two)
enabled = True

_lock = threading.Lock()
_state: dict[str, object] = {}
# the C name of the kernels for a dtype (posenc_<kernel>_float, posenc_<kernel>_double)
_CTYPE = {torch.float32: "float", torch.float64: "double"}


def _build() -> ctypes.CDLL | None:
    # POSENC_NATIVE=maybe is a ConfigError (each call that reaches the kernels says so), never taken as on or off
    if not env_flag("POSENC_NATIVE", default=True):
        _state["error"] = f"disabled by POSENC_NATIVE={os.environ.get('POSENC_NATIVE', '').strip()}"
        return None
    want = isa()  # raises ConfigError for a POSENC_NATIVE_ISA this CPU cannot run
    cc = _compiler()
    if cc is None:
        return _off("no C compiler (cc, gcc or clang) on PATH")
    # a compiler too old for a vector build's flags: the next build down (only when the build was not asked for)
    forced = os.environ.get("POSENC_NATIVE_ISA", "").strip().lower() not in ("", "auto")
    names = [want] if forced else supported_isas()[supported_isas().index(want) :]
    why = ""
    for chosen in names:
        lib_path, why = _compile(cc, chosen)
        if lib_path is not None:
            break
    else:
        return _off(why)
    try:
        lib = _load(lib_path)
    except (OSError, AttributeError) as exc:  # not a loadable build of this source (a foreign file, a missing symbol)
        return _off(f"cannot load {lib_path}: {exc}; delete it to build it again")
    _state["path"], _state["isa"] = str(lib_path), chosen
    return lib


def _load(lib_path: Path) -> ctypes.CDLL:
    """Load a build and declare its functions' argument types."""
    lib = ctypes.CDLL(str(lib_path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name, real in (("posenc_rope_f32", ctypes.c_float), ("posenc_rope_f64", ctypes.c_double)):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ptr] * 4 + [i64] * 13 + [ctypes.c_int, real, ctypes.c_int]
    for t in ("float", "double"):
        fwd = getattr(lib, f"posenc_fire_forward_{t}")
        fwd.restype = None
        fwd.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
        bwd = getattr(lib, f"posenc_fire_backward_{t}")
        bwd.restype = None
        bwd.argtypes = [ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64]
    for t in ("float", "double"):
        fn = getattr(lib, f"posenc_rows_dot_{t}")
        fn.restype = None
        fn.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64, i64, i64]
    for t in ("float", "double"):
        fn = getattr(lib, f"posenc_decode_{t}")
        fn.restype = None
        real = ctypes.c_float if t == "float" else ctypes.c_double
        fn.argtypes = [ptr, i64, i64] + [ptr, i64, i64, i64] * 2 + [ptr, i64, i64] + [ptr, i64, i64, ptr, i64]
        fn.argtypes += [ptr, i64, i64, ptr] + [ptr, i64, i64, ptr, i64, ptr]  # the key term; the value table, scratch
        fn.argtypes += [ptr, i64, i64, ptr, real, i64, i64, i64, i64, i64, i64]  # ... H, lk, d, G, n0, n1
    for t in ("float", "double"):
        for kind in ("forward", "backward"):
            fn = getattr(lib, f"posenc_offset_{kind}_{t}")
            fn.restype = None
            fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(i64), ctypes.c_double]
        lanes = getattr(lib, f"posenc_offset_lanes_{t}")
        lanes.restype, lanes.argtypes = ctypes.c_int, []
    lib.posenc_populate.restype = ctypes.c_int
    lib.posenc_populate.argtypes = [ptr, i64]
    return lib


def _off(why: str) -> None:
    """Record why the kernels are off and say so in one line on stderr (once a process): the PyTorch paths give
    the same results, slower. Not said where POSENC_NATIVE=0 asked for it."""
    _state["error"] = why
    first = why.splitlines()[0] if why else "unknown"
    sys.stderr.write(
        f"posenc: native CPU kernels off ({first}); using the PyTorch paths (POSENC_NATIVE=0 hides this)\n"
    )
    return None


def _lib() -> ctypes.CDLL | None:
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _build()
    return _state["lib"]  # type: ignore[return-value]


def available() -> bool:
    """Whether the compiled kernels can be used on this machine (builds them on first call)."""
    return enabled and _lib() is not None


def build() -> str | None:
    """The name of the build in use (a key of :data:`ISA_FLAGS`: ``baseline``, ``avx2``, ``avx512`` or ``native``),
    or ``None`` where the kernels are off. Builds the kernels on first call, as :func:`available` does."""
    return str(_state["isa"]) if available() else None


def status() -> str:
    """A line saying whether the kernels are in use, and from where or why not (``posenc info`` prints it)."""
    if not enabled:
        return "native CPU kernels: off (posenc.native.enabled is False); PyTorch ops are used instead"
    if available():
        return f"native CPU kernels: {_state['path']} ({build()} build: {' '.join(flags(str(build())))})"
    return f"native CPU kernels: off ({_state.get('error', 'unknown')}); PyTorch ops are used instead"
