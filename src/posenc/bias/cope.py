r"""CoPE, Contextual Position Encoding (Golovneva et al. 2024).

Positions are counted by the content: a gate decides, for every key, whether
it counts as one step back from the query,

.. math::
    g_{ij} = \sigma(q_i^\top k_j), \qquad p_{ij} = \sum_{t=j}^{i} g_{it}, \qquad
    e[p_{ij}] = (p_{ij} - \lfloor p_{ij} \rfloor)\, e[\lceil p_{ij} \rceil]
              + (1 - p_{ij} + \lfloor p_{ij} \rfloor)\, e[\lfloor p_{ij} \rfloor],

    a_{ij} = \mathrm{softmax}_j\big(q_i^\top k_j + q_i^\top e[p_{ij}]\big)

with learned embeddings ``e[0 .. npos_max - 1]`` (``p`` clamped to ``npos_max - 1``),
so a head can attend to "the 3rd sentence back" or "the last noun".

Where the authors' reference code (paper appendix) and the equation differ,
this follows the code:

* the gate is computed from the *scaled* logits, ``σ(q_i·k_j / √d)``
  (``gate_scale=True``; ``False`` gives the equation's ``σ(q_i·k_j)``);
* the position term ``q_i·e[p_ij]`` is added *after* the ``1/√d`` temperature,
  i.e. not scaled (the ``logits`` hook returns it divided by the temperature);
* ``p`` is a cumulative sum reversed along the keys, over the keys the causal
  mask leaves visible (``gates.flip(-1).cumsum(-1).flip(-1)`` with masked
  gates ``σ(-∞) = 0``).

The ``logits`` hook sees q, k and the positions but not the attention mask, so
causality is taken from the positions (``causal=True``: key t counts for query
i when ``pos(t) <= pos(i)``), the sum runs over key *indices* ``t >= j`` (keys
must be in position order, as with ``arange`` positions, a KV cache or memory),
and padded keys are not excluded (their gates count): mask padding on the
right, or left-pad and start positions after the padding. ``causal=False`` is
the reference code with no mask: ``p_ij = Σ_{t >= j} g_it`` over all keys.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..base import AttentionContext, Card, PositionalEncoding
from ..errors import ConfigError
from ..registry import register


@register
class CoPE(PositionalEncoding):
    r"""CoPE: gated, content-counted positions with interpolated learned embeddings.

    .. math::
        A_{ij} = \frac{q_i^\top k_j}{\sqrt d} + q_i^\top e[p_{ij}], \quad
        p_{ij} = \sum_{t=j}^{i} \sigma\Big(\frac{q_i^\top k_t}{\sqrt d}\Big)

    Args:
        head_dim: width of q (the embeddings ``e[p]`` live in the key space).
        npos_max: number of embeddings; positions are clamped to ``npos_max - 1``.
        causal: count only keys at or before the query's position (the paper's decoder use).
        gate_scale: gate from ``q·k/√d`` as the reference code (``False``: ``q·k``, the equation).
    """

    info = Card(
        name="cope",
        title="CoPE (contextual position encoding)",
        paper="Golovneva et al., Contextual Position Encoding: Learning to Count What's Important",
        year=2024,
        family="bias",
        position="relative",
        learnable=True,
        summary="p_ij = Σ_{t=j..i} σ(q_i·k_t): positions counted by gates; q_i·e[p_ij] interpolated and added.",
        reference="a naive loop of the paper's equations (reference-code choices); fast == literal",
        shortcoming="the gates need the q·k matrix: no O(L) form, and padding must be handled by positions",
    )
    shared_across_layers = False
    logits_read_scores = True  # the gates are σ(q·k): a decoding step computes q·kᵀ once (ctx.scores)

    def __init__(self, head_dim: int, npos_max: int = 64, causal: bool = True, gate_scale: bool = True):
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise ConfigError(f"cope: head_dim must be a positive integer, got {head_dim!r}")
        if isinstance(npos_max, bool) or not isinstance(npos_max, int) or npos_max < 2:
            raise ConfigError(
                f"cope: npos_max (the number of position embeddings) must be an integer >= 2, got {npos_max!r}"
            )
        self.head_dim, self.npos_max = head_dim, npos_max
        self.causal, self.gate_scale = bool(causal), bool(gate_scale)
        # [head_dim, npos_max] as the reference code's pos_emb; zero at init as there
        self.pos_emb = nn.Parameter(torch.zeros(head_dim, npos_max))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.pos_emb)

    # ---------------------------------------------------------------- parts
    def gates(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        """``σ(q_i·k_t · s)``, zero for keys after the query when causal and for masked keys: ``[B, H, Lq, Lk]``."""
        s = self.scale(ctx.head_dim) if self.gate_scale else 1.0
        qk = ctx.scores  # the attention's own q·kᵀ where it computed it first (materialised kernel)
        if qk is None or ctx.reference or qk.shape[-2:] != (q.shape[-2], k.shape[-2]):
            qk = torch.matmul(q, k.transpose(-1, -2))
        g = torch.sigmoid(qk * s)
        if self.causal:
            visible = ctx.k_pos[:, None, :] <= ctx.q_pos[:, :, None]  # [B|1, Lq, Lk]
            g = g * visible[:, None].to(g.dtype)
        if ctx.mask is not None:  # padding and other documents' keys are not counted
            g = g * ctx.mask.to(g.dtype)
        return g

    def contextual_positions(self, gates: Tensor, literal: bool) -> Tensor:
        """``p_ij = Σ_{t >= j} g_it``, clamped to ``npos_max - 1``."""
        if literal:
            lk = gates.shape[-1]
            t = torch.arange(lk, device=gates.device)
            later = (t[:, None] >= t[None, :]).to(gates.dtype)  # [t, j]: t >= j
            p = torch.matmul(gates, later)
        else:
            p = gates.flip(-1).cumsum(-1).flip(-1)
        return p.clamp(max=self.npos_max - 1)

    def _check(self, q: Tensor) -> None:
        if q.shape[-1] != self.head_dim:
            raise ConfigError(f"cope was built for head_dim={self.head_dim}, got q with last dimension {q.shape[-1]}")

    def logits(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        self._check(q)
        p = self.contextual_positions(self.gates(q, k, ctx), literal=ctx.reference)
        lo = p.floor()
        w = p - lo
        lo_i, hi_i = lo.long(), p.ceil().long()
        emb = self.pos_emb.to(q.dtype)
        if ctx.reference:
            # e[p_ij] materialised: [B, H, Lq, Lk, head_dim]
            table = emb.t()
            e = w[..., None] * table[hi_i] + (1 - w[..., None]) * table[lo_i]
            term = (q[..., :, None, :] * e).sum(-1)
        else:
            # q_i·e[n] for every integer n, then gather: [B, H, Lq, npos_max]
            per_position = torch.matmul(q, emb)
            term = per_position.gather(-1, hi_i) * w + per_position.gather(-1, lo_i) * (1 - w)
        # added after the temperature, as the reference code: A = s·q·k + q·e[p]
        return term / self.scale(ctx.head_dim)
