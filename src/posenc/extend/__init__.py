"""Stretch a real pretrained model's context with each RoPE scaling, measured on real text (``posenc extend``).

* :mod:`.config` -- the scalings, documents and modes of a run (imports no torch);
* :mod:`.evaluate` -- per-token loss along a long document (chunked through the KV cache) and passkey retrieval;
* :mod:`.runner` -- the cells of a run, the resumable store, the scalings as patches of the real model;
* :mod:`.report` -- the curves, heatmaps, tables and verdicts beside the published shapes;
* :mod:`.ruler` -- 11 of RULER's 13 tasks built as NVIDIA/RULER builds them (the model's chat template, one string
  tokenised at once, the unit count by binary search), asked from one prefill per haystack;
* :mod:`.ruler_prose` -- the essay haystack's substitute (Shakespeare's Gutenberg plays for Paul Graham's essays);
* :mod:`.ruler_report` -- RULER by length: the per-task table (the haystack as the unit), RULER's mean, effective
  length, heatmaps by task and by depth, verdicts at the family level, the floor;
* :mod:`.ruler_data` -- a model on the data NVIDIA/RULER's own prepare.py writes, scored as its evaluate.py does;
* :mod:`.finetune` -- fine-tuning a stretched model at the extended length (PI's and YaRN's settings; full or LoRA;
  checkpoints that resume; torch.distributed), ``posenc extend --finetune``;
* :mod:`.longrope_search` -- LongRoPE's evolutionary search of per-pair rescale factors (Ding et al. 2024).

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
    "FinetuneSettings": "finetune",
    "search": "longrope_search",
    "score_ruler_data": "ruler_data",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
