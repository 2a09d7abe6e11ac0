r"""One-pass CPU kernels in C, compiled on first use with the system's C compiler and loaded with ctypes.

PyTorch has no single elementwise op for a rotary rotation: the rotate-half layout pairs dimension ``i``
with ``i + d/2``, so eager code needs four half-width passes (or temporaries and a ``cat``), each as slow
as a full one. :func:`rope_rotate` does it in one pass: it reads ``x`` once (any strides with a contiguous
last dimension, e.g. the ``[B, L, H, d] -> [B, H, L, d]`` view a projection gives), reads the broadcast
``cos`` / ``sin`` rows, and writes the output once -- with non-temporal stores where the output is larger
than a cache (the store then skips reading the destination first), so it runs at about the speed of a
copy (``benchmarks/README.md``).

The C source (:mod:`posenc.native.source`) is compiled on first use into ``$POSENC_CACHE_DIR`` (default
``~/.cache/posenc``) with portable flags, in one of a few builds chosen at run time from the CPU's flags
(``/proc/cpuinfo``): ``baseline`` (``-O3``, the compiler's default target), ``avx2`` (``-mavx2 -mfma``) or
``avx512`` (adds ``-mavx512f`` and the kernels' AVX-512 code). ``POSENC_NATIVE_ISA=baseline|avx2|avx512|native``
forces one (``native``: ``-march=native``, this CPU only); :func:`build` says which is in use, and the benchmark
records it with every run. A file name carrying the hash of the source, the compiler and the flags keeps builds
apart, and a build is written to a temporary name and renamed, so concurrent processes never load half a file. The
builds compute the same sums in the same order (no ``-ffast-math``; ``-std=c99`` keeps the compiler from fusing
multiply-adds), so they agree to the last bit except where the AVX-512 code uses explicit fused multiply-adds
(tests/test_native.py compares them). Where there is no compiler or the build fails, :func:`available` is ``False``,
one line on stderr says so, and every caller keeps its PyTorch path (the same numbers up to rounding;
tests/test_native.py compares both); ``POSENC_NATIVE=0`` turns the kernels off without that line (``0``/``false``/
``no``/``off`` or ``1``/``true``/``yes``/``on``; any other value is a :class:`~posenc.errors.ConfigError`, never taken
as either). A cached build is loaded only where its SHA-256 is the one written beside it when it was compiled
(``<file>.sha256``): a truncated file is compiled again, not loaded (loading one can end the process with a bus
error). Large tensors are split over ``torch.get_num_threads()`` threads (ctypes releases the GIL during the call).

The package, by job (bottom to top; a name with a leading underscore is private to the package, not to its module):

* :mod:`~posenc.native.source`: the C source, one translation unit;
* :mod:`~posenc.native.builds`: which build (:func:`isa`, :func:`supported_isas`, :data:`ISA_FLAGS`), its
  flags, and the compile into the cache (:func:`cache_dir`);
* :mod:`~posenc.native.loader`: the switch :data:`enabled`, loading the build once a process (ctypes), and
  :func:`available`, :func:`build`, :func:`status`;
* :mod:`~posenc.native.threads`: splitting a call over torch's thread count;
* the wrappers, one module per kernel family: :mod:`~posenc.native.rope` (:func:`rope_rotate`),
  :mod:`~posenc.native.fire` (:func:`fire_bias`, :func:`fire_bias_grad`), :mod:`~posenc.native.decode`
  (:func:`rows_dot`, :func:`decode_attention`), :mod:`~posenc.native.offset_table` (:func:`offset_table_attention`:
  the offset-table family's attention fused, forward and backward).

Everything is used as ``posenc.native.<name>``. A name set on the package (``posenc.native.enabled = False``, a
test's ``monkeypatch.setattr(native, "POPULATE_BYTES", ...)``) is set in the module that defines it too, where the
code reads it. Imports torch, ctypes and :mod:`posenc.errors`; nothing else of posenc.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from . import builds, decode, fire, loader, offset_table, rope, threads
from .builds import ISA_FLAGS, ISA_NEEDS, cache_dir, flags, isa, supported_isas
from .decode import DECODE_MAX_HEAD_DIM, decode_attention, rows_dot
from .fire import fire_bias, fire_bias_grad
from .loader import available, build, enabled, status
from .offset_table import form_attention, offset_table_attention
from .rope import NT_BYTES, POPULATE_BYTES, rope_rotate
from .threads import PARALLEL_NUMEL

# isort: split
# the package's private names that tests and benchmarks/bench_native_builds.py reach (and patch) through it
from .builds import _compile, _compiler, _cpu_flags, _is_x86  # noqa: F401
from .loader import _load, _state  # noqa: F401
from .rope import _rope  # noqa: F401
from .source import SOURCE as _SOURCE  # noqa: F401
from .threads import _threads  # noqa: F401

# the module each re-exported name lives in (where its readers look it up): a function or class by its
# ``__module__``, a value by the module whose namespace holds it (a name another module imports is not its home)
_HOMES: dict[str, ModuleType] = {
    name: home
    for home in (builds, loader, threads, rope, fire, decode, offset_table)
    for name, value in vars(home).items()
    if name in globals()
    and not name.startswith("__")
    and not isinstance(value, ModuleType)
    and globals().get(name) is value
    and getattr(value, "__module__", home.__name__) == home.__name__
}


class _Package(ModuleType):
    """``posenc.native`` itself: setting a re-exported name sets it in its home module too, so that
    ``posenc.native.enabled = False`` turns every wrapper off and a test's monkeypatch reaches the code it patches."""

    def __setattr__(self, name: str, value: Any) -> None:
        home = _HOMES.get(name)
        if home is not None:
            setattr(home, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "available",
    "build",
    "cache_dir",
    "decode_attention",
    "fire_bias",
    "fire_bias_grad",
    "form_attention",
    "offset_table_attention",
    "rope_rotate",
    "rows_dot",
    "status",
    "supported_isas",
    "isa",
    "flags",
    # the settings: the switch, the build table and the kernels' thresholds
    "enabled",
    "ISA_FLAGS",
    "ISA_NEEDS",
    "DECODE_MAX_HEAD_DIM",
    "NT_BYTES",
    "POPULATE_BYTES",
    "PARALLEL_NUMEL",
]
