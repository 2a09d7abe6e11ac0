"""Settings checked where they enter: environment variables, command-line flags and configuration fields.

One way for every surface, so that a bad value is never taken silently as "off" or as the default:

* :func:`env_flag` reads a yes/no environment variable (``POSENC_NATIVE``, ``POSENC_PORTABLE`` ...): ``1``, ``true``,
  ``yes``, ``on`` or ``0``, ``false``, ``no``, ``off`` in any case, unset or empty for the default; anything else
  (``POSENC_NATIVE=maybe``) is a :class:`~posenc.errors.ConfigError` naming the variable, its value and the words it
  takes;
* :func:`env_choice` reads a variable that names one of a few choices (``POSENC_NATIVE_ISA``);
* :func:`whole` and :func:`positive_int` check an integer option (``--threads 0``, ``--chunk -1``), :func:`number`
  a real one (finite, within bounds: ``--loss-extension nan``, ``inf``, ``0``), :func:`fraction` one in ``[0, 1]``.

Each error names the option as the user wrote it (``--loss-extension``, ``ExtendConfig.loss_extension``), the
value, and what would be right. Imports only :mod:`posenc.errors` (no torch), so a command line can check its
flags before anything heavy is imported.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable, Mapping

from .errors import ConfigError

#: the words a yes/no environment variable takes (any case, surrounding spaces ignored)
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_flag(name: str, value: str, default: bool) -> bool:
    """``value`` of the yes/no setting ``name`` as a bool (empty: ``default``).

    Raises:
        ConfigError: ``value`` is none of :data:`TRUE_WORDS` / :data:`FALSE_WORDS`.
    """
    word = value.strip().lower()
    if word == "":
        return default
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigError(
        f"{name}={value!r} is not a yes/no setting; use one of {', '.join(TRUE_WORDS)} (on) or "
        f"{', '.join(FALSE_WORDS)} (off), or unset it (default: {'on' if default else 'off'})"
    )


def env_flag(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """The yes/no environment variable ``name`` (unset or empty: ``default``); see :func:`parse_flag`."""
    env = os.environ if environ is None else environ
    return parse_flag(name, env.get(name, ""), default)


def env_choice(
    name: str, choices: Iterable[str], default: str, environ: Mapping[str, str] | None = None
) -> str:
    """The environment variable ``name``, lower-cased, one of ``choices`` (unset or empty: ``default``).

    Raises:
        ConfigError: a value that is none of ``choices``, named with the choices.
    """
    env = os.environ if environ is None else environ
    allowed = list(choices)
    word = env.get(name, "").strip().lower()
    if word == "":
        return default
    if word not in allowed:
        raise ConfigError(f"{name}={env.get(name)!r} names no choice; use one of {', '.join(allowed)} (or unset it)")
    return word


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def whole(name: str, value: object, low: int = 0, high: int | None = None) -> int:
    """``value`` as an ``int`` in ``[low, high]``: an int, or a float with no fractional part (``4.0``).

    Raises:
        ConfigError: not a whole number (``True``, ``2.5``, ``nan``, ``"4"``), or out of range; the message names
            ``name``, the value and the range.
    """
    where = f">= {low}" if high is None else f"in [{low}, {high}]"
    if not _is_real(value) or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer())):
        raise ConfigError(f"{name} must be a whole number {where}, got {value!r}")
    out = int(value)  # type: ignore[call-overload]
    if out < low or (high is not None and out > high):
        raise ConfigError(f"{name} must be a whole number {where}, got {value!r}")
    return out


def positive_int(name: str, value: object) -> int:
    """``value`` as an ``int`` of at least 1 (a count: threads, tokens, steps); see :func:`whole`."""
    return whole(name, value, low=1)


def number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    why: str = "",
) -> float:
    """``value`` as a finite ``float`` with ``low <= value <= high`` (``low < value`` with ``low_open``).

    ``why`` is said after the range (what the number is: "a multiple of the trained length").

    Raises:
        ConfigError: not a real number, NaN or infinite, or out of range; the message names ``name``, the value and
            the range.
    """
    lo = "" if low is None else (f"> {low:g}" if low_open else f">= {low:g}")
    hi = "" if high is None else f"<= {high:g}"
    where = " and ".join(p for p in (lo, hi) if p)
    expected = f"a finite number{' ' + where if where else ''}{f' ({why})' if why else ''}"
    if not _is_real(value):
        raise ConfigError(f"{name} must be {expected}, got {value!r}")
    x = float(value)  # type: ignore[arg-type]
    if not math.isfinite(x):
        raise ConfigError(f"{name} must be {expected}, got {value!r}")
    if low is not None and (x <= low if low_open else x < low):
        raise ConfigError(f"{name} must be {expected}, got {value!r}")
    if high is not None and x > high:
        raise ConfigError(f"{name} must be {expected}, got {value!r}")
    return x


def fraction(name: str, value: object, why: str = "") -> float:
    """``value`` as a finite ``float`` in ``[0, 1]``; see :func:`number`."""
    return number(name, value, low=0.0, high=1.0, why=why)


def nonempty_text(name: str, value: object, expected: str) -> str:
    """``value`` as a non-blank ``str``.

    Raises:
        ConfigError: ``None``, not a string, or blank; the message names ``name`` and says what ``expected`` is.
    """
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name} must be {expected}, got {value!r}")
    return value


def key_value(text: str, flag: str, example: str = "") -> tuple[str, object]:
    """One ``KEY=VALUE`` item of a repeatable option (``--option beta_fast=16``): the key, and the value read as
    JSON where it parses (``16``, ``1.5``, ``true``, ``[1, 2]``), else as the text itself. A missing ``=`` or key
    is a :class:`~posenc.errors.ConfigError` naming ``flag`` (and ``example``, the option as a user would write it)."""
    import json

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        hint = f" (e.g. {example})" if example else ""
        raise ConfigError(f"{flag} takes KEY=VALUE{hint}, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value
