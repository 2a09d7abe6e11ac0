"""Stretch a real pretrained model's context with each RoPE scaling, measured on real text (``posenc extend``).

* :mod:`.config` -- the scalings, documents and modes of a run (imports no torch);
* :mod:`.evaluate` -- per-token loss along a long document (chunked through the KV cache) and passkey retrieval;
* :mod:`.runner` -- the cells of a run, the resumable store, the scalings as patches of the real model;
* :mod:`.report` -- the curves, heatmaps, tables and verdicts beside the published shapes;
* :mod:`.ruler` -- RULER's six synthetic tasks built to an exact token count, asked many questions per prefill;
* :mod:`.ruler_report` -- RULER by length: the table with Wilson intervals, heatmaps, verdicts, the floor.

The names below load their module on first use, so that ``posenc --help`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "AS_TRAINED": "config",
    "ExtendConfig": "config",
    "FULL": "config",
    "QUICK": "config",
    "SCALINGS": "config",
    "PasskeyPrompt": "evaluate",
    "passkey_ids": "evaluate",
    "passkey_score": "evaluate",
    "token_losses": "evaluate",
    "plan": "runner",
    "RULER_TASKS": "config",
    "run": "runner",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
