"""The portable plan forced on CPU: :func:`portable` and :func:`portable_forced`.

On a non-CPU device the plan takes only the kernels that exist wherever torch runs
(:data:`~posenc.attention.kernels.PORTABLE_KERNELS`); this module lets a CPU-only machine ask for the same plan, to test
what another device would compute. It holds process-wide state (a stack of settings) and imports only
:mod:`posenc.native` (whose ``enabled`` switch it turns off inside the block) and :mod:`posenc.settings`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .. import native
from ..settings import env_flag

# the portable plan forced on CPU: ``POSENC_PORTABLE=1`` at import, or inside ``with portable():``; a value that is
# not a yes/no word (``POSENC_PORTABLE=banana``) is a ConfigError here, not taken as "off"
_forced: list[bool] = [env_flag("POSENC_PORTABLE", default=False)]
if _forced[0]:
    native.enabled = False  # the portable plan runs no native C code either


def portable_forced() -> bool:
    """Whether the portable plan is forced on CPU (:func:`portable`, or ``POSENC_PORTABLE=1`` at import)."""
    return _forced[-1]


@contextmanager
def portable(enabled: bool = True) -> Iterator[None]:
    """Force the device-portable plan on CPU inside the ``with`` block (``enabled=False``: lift it).

    The plan then takes what it takes on a GPU or any other non-CPU device: only the kernels of
    :data:`PORTABLE_KERNELS` (SDPA with the encoding's terms as its additive mask, or the materialised
    formula), never the CPU flash op, the blocked / offset-bias / block-bias / decode kernels, or the C code
    of :mod:`posenc.native` (``posenc.native.enabled`` is ``False`` inside the block, so the encodings' own
    hooks take their PyTorch forms too). It is how the test suite checks, on a CPU-only machine, what a CUDA,
    MPS or XPU call computes (tests/test_portable.py). The setting is process-wide (not per thread), and nests.
    ``POSENC_PORTABLE=1`` in the environment forces it for the whole process (and turns the native code off);
    ``portable(False)`` lifts the forcing inside its block and leaves ``posenc.native.enabled`` as it was.

    Example::

        with posenc.attention.portable():
            out = attn(x)
        print(attn.last_plan)  # sdpa: ... (portable plan: forced on CPU)
    """
    before = native.enabled
    _forced.append(bool(enabled))
    if enabled:
        native.enabled = False
    try:
        yield
    finally:
        _forced.pop()
        native.enabled = before
