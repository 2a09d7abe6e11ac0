"""Stretch a real pretrained model's context with each RoPE scaling, measured on real text (``posenc extend``).

* :mod:`.evaluate` -- per-token loss along a long document (chunked through the KV cache) and passkey retrieval;
* :mod:`.run` -- the cells of a run, the resumable store, the scalings as patches of the real model;
* :mod:`.report` -- the curves, heatmaps, tables and verdicts beside the published shapes.
"""

from .evaluate import PasskeyPrompt, passkey_ids, passkey_score, token_losses
from .runner import AS_TRAINED, FULL, QUICK, SCALINGS, ExtendConfig, plan, run

__all__ = [
    "AS_TRAINED",
    "ExtendConfig",
    "FULL",
    "PasskeyPrompt",
    "QUICK",
    "SCALINGS",
    "passkey_ids",
    "passkey_score",
    "plan",
    "run",
    "token_losses",
]
