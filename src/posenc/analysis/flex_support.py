"""Which kernel each registered encoding takes on a CUDA device (docs/gpu.md's table): flex_attention with a
score_mod from its fast forms (:mod:`posenc.attention.flex`), SDPA where it adds nothing in the attention, or the
kernel it keeps and why.

    python -m posenc.analysis.flex_support          print the table

Imports the registry, the attention and the errors.
"""

from __future__ import annotations

import torch

from ..attention import MultiHeadAttention
from ..errors import ConfigError
from ..registry import available, build, example_options


def support(names: list[str] | None = None) -> dict[str, str]:
    """For each registered encoding (or ``names``), what a long causal CUDA call takes: ``"flex: <the form>"``,
    ``"sdpa: ..."`` for an encoding with no terms in the attention, or the kernel it keeps and why (the plan's
    words). Probed on a small CPU call with ``path="flex"``: the forms
    asked are the ones a CUDA call asks (an offset-table or bias form does not depend on the device)."""

    dims = dict(d_model=32, n_heads=4, head_dim=8, max_len=64, n_layers=1, vocab_size=50, causal=True)
    out = {}
    for name in names if names is not None else [n for n in available() if not n.startswith("randomized-")]:
        enc = build(name, dims=dims, options=example_options(name, dims))
        if not enc.hooks() & {"logits", "bias", "values", "probabilities"}:
            out[name] = "sdpa: no terms in the attention (flash attention; a rotation acts on q and k before it)"
            continue
        layer = MultiHeadAttention(32, 4, enc, path="flex").eval()
        try:
            with torch.no_grad():
                layer(torch.zeros(1, 8, 32), causal=True)
            plan = layer.last_plan
            if plan is None or plan.kernel != "flex":
                out[name] = f"keeps {plan.kernel if plan else 'no'} kernel: {plan.reason if plan else 'no plan'}"
            else:
                out[name] = "flex: " + plan.reason.removeprefix("flex_attention with ").split(" (path=")[0]
        except ConfigError as err:
            out[name] = "keeps its CPU/portable kernels: " + str(err).split(": ", 1)[1].split("; take path")[0]
    return out


def support_table(cells: dict[str, str] | None = None) -> str:
    """:func:`support` as the Markdown table of docs/gpu.md (ending in a newline)."""
    cells = cells if cells is not None else support()
    lines = ["| encoding | on CUDA (long calls) |", "|---|---|"]
    lines += [f"| `{name}` | {what} |" for name, what in cells.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(support_table(), end="")
