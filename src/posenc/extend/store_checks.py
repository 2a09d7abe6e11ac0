"""The checks ``posenc extend`` makes before it runs a cell: that each cell of a LongRoPE search's or a fine-tuned
model's name has its :class:`~posenc.extend.runner.Variant` at its factor, and that the cells a store already holds
are of this model and of these very settings (else a rerun would take another model's, search's or fine-tune's
cells for its own). Each raises a :class:`~posenc.errors.ConfigError` that names what differs and what to do.
(The cells and variants are :class:`~posenc.extend.runner.Cell` and :class:`~posenc.extend.runner.Variant`,
typed ``Any`` here: this module sits below the runner.)"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .config import is_variant


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=float))


def check_variants(cells: Sequence[Any], variants: dict[str, Any]) -> None:
    """Every cell of a variant's name has its :class:`Variant`, at the variant's factor."""
    for c in cells:
        if not is_variant(c.scaling):
            continue
        v = variants.get(c.scaling)
        if v is None:
            raise ConfigError(
                f"{c.describe()}: {c.scaling} names the cells of a LongRoPE search or a fine-tuned model, which "
                "posenc extend --longrope-search / --finetune measure (posenc.extend.run(..., variants=[Variant(...)]))"
            )
        if not math.isclose(c.factor, v.factor, rel_tol=1e-9):
            raise ConfigError(
                f"{c.describe()}: {c.scaling} is at factor {v.factor:g} (what it was searched or fine-tuned for), this "
                f"cell at {c.factor:g}: give its cells lengths whose factor is {v.factor:g}"
            )


def _pretrained(model: dict[str, Any]) -> tuple[Any, Any]:
    """The pretrained file a model identity is of (a fine-tuned model's: the one it was tuned from)."""
    return model.get("sha256"), model.get("finetuned_from", model.get("name"))


def check_store(have: Sequence[dict[str, Any]], ident: dict[str, Any], names: set[str],
                variants: dict[str, Any], path: Path) -> None:
    """The store's cells are of the pretrained file ``ident`` is (or was tuned from); those of the ``names`` a run
    measures are of this very model and variant (else a rerun would take another fine-tune's or search's cells for
    its own). Raises a :class:`ConfigError` naming what differs and what to do."""
    base = _pretrained(ident)
    own = _jsonable({k: ident.get(k) for k in ("sha256", "name", "finetuned")})
    for r in have:
        m = r.get("model", {})
        if _pretrained(m) != base:
            raise ConfigError(
                f"{path} holds cells of another model ({m.get('name')}, sha256 {str(m.get('sha256'))[:12]}); use "
                f"another --out for {ident.get('name')}"
            )
    for r in have:
        name = r.get("scaling")
        if name not in names:
            continue
        m = r.get("model", {})
        want = variants[name].record() if name in variants else None
        if {k: m.get(k) for k in own} != own:
            a, b = m.get("finetuned"), own["finetuned"]
            diff = _settings_diff(a, b) if a and b else ("stored not fine-tuned, this model fine-tuned" if b else
                                                         "stored fine-tuned, this model not" if a else "another name")
            raise ConfigError(
                f"{path} holds {name} cells of {m.get('name')} ({diff}), and this run measures them on "
                f"{ident.get('name')}: use another --out, or the settings stored"
            )
        if r.get("variant") != want:
            raise ConfigError(
                f"{path} holds {name} cells of another search or fine-tune ("
                f"{_settings_diff(r.get('variant') or {}, want or {})}): use another --out, or the settings stored"
            )


def _settings_diff(stored: Any, asked: Any) -> str:
    """The first few settings that differ, as ``name: stored X, asked Y``."""
    def flat(d: Any, pre: str = "") -> dict[str, Any]:
        if not isinstance(d, dict):
            return {pre or "value": d}
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{pre}{k}.") if isinstance(v, dict) else {f"{pre}{k}": v})
        return out

    a, b = flat(stored), flat(asked)
    diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    shown = [f"{k}: stored {_short(a.get(k))}, asked {_short(b.get(k))}" for k in diff[:3]]
    return "; ".join(shown) + (f"; {len(diff) - 3} more" if len(diff) > 3 else "") if diff else "the same settings"


def _short(v: Any) -> str:
    text = json.dumps(v, default=float)
    return text if len(text) <= 40 else text[:37] + "..."
