r"""Dynamic position bias: a small MLP of the relative distance (x-transformers, SwinV2).

Instead of a table of biases (T5, Swin v1), a small network maps the relative
distance to one bias per head (Liu et al. 2022, Swin Transformer V2, "continuous
relative position bias"; lucidrains' x-transformers ``DynamicPositionBias``):

.. math::
    B^{(h)}_{ij} = \mathrm{MLP}(\hat\Delta_{ij})_h, \qquad \Delta_{ij} = i - j, \qquad
    \hat\Delta = \operatorname{sign}(\Delta)\,\log(1 + |\Delta|) \text{ (log\_distance) or } \Delta

The MLP is ``Linear(1, w) -> SiLU -> [Linear(w, w) -> SiLU] x (depth - 1) -> Linear(w, H)``
(optionally with LayerNorm before each SiLU, ``norm=True``), as x-transformers.
SwinV2 uses ``log2`` with a scale of 8 on a 2-D window; here, for sequences, the
natural-log form of x-transformers. One MLP serves every layer (x-transformers
builds one per stack). The bias is added after the temperature.

Fast path: the MLP runs once per *distinct* distance and the result is gathered
into the ``[B, H, Lq, Lk]`` bias (O(#distances · w) instead of O(Lq · Lk · w));
the reference path runs the MLP on every (i, j) pair as the formula is written.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..base import AttentionContext, Card, Cost, PositionalEncoding
from ..errors import ConfigError
from ..registry import register
from ..relative._skew import offset_rows, offsets, toeplitz


@register
class DynamicPositionBias(PositionalEncoding):
    r"""Dynamic position bias: :math:`B^{(h)}_{ij} = \mathrm{MLP}(\operatorname{sign}(i-j)\log(1+|i-j|))_h`.

    Args:
        n_heads: heads (the MLP's output width).
        d_model: the model width; the MLP width defaults to ``max(d_model // 4, 8)``
            (x-transformers uses ``dim // 4``), or 32 without ``d_model``.
        hidden: the MLP width (overrides the default above).
        depth: number of hidden layers (x-transformers' default 2).
        log_distance: use ``sign(Δ) log(1 + |Δ|)`` instead of ``Δ``.
        norm: LayerNorm after each hidden linear layer.
    """

    info = Card(
        name="dynamic-bias",
        title="Dynamic position bias (MLP of the distance)",
        paper="Liu et al., Swin Transformer V2 (continuous position bias); lucidrains x-transformers",
        year=2022,
        family="bias",
        position="relative",
        learnable=True,
        summary="A small MLP maps (log-scaled) i-j to a bias per head, added after scaling.",
        reference="the MLP applied to every (i, j) pair (reference path) vs the per-distance table",
        aliases=("dynamic-position-bias", "dpb"),
    )
    randomized_variant = True

    def __init__(
        self,
        n_heads: int,
        d_model: int | None = None,
        hidden: int | None = None,
        depth: int = 2,
        log_distance: bool = True,
        norm: bool = False,
    ):
        super().__init__()
        if not isinstance(n_heads, int) or isinstance(n_heads, bool) or n_heads < 1:
            raise ConfigError(f"dynamic-bias needs n_heads >= 1 (an integer), got {n_heads!r}")
        if hidden is None:
            hidden = max(d_model // 4, 8) if d_model else 32
        if not isinstance(hidden, int) or hidden < 1:
            raise ConfigError(f"dynamic-bias: hidden must be a positive integer, got {hidden!r}")
        if not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"dynamic-bias: depth must be >= 1, got {depth!r}")
        self.n_heads, self.hidden, self.depth, self.log_distance = n_heads, hidden, depth, bool(log_distance)
        layers: list[nn.Module] = []
        width_in = 1
        for _ in range(depth):
            layers.append(nn.Linear(width_in, hidden))
            if norm:
                layers.append(nn.LayerNorm(hidden))
            layers.append(nn.SiLU())
            width_in = hidden
        layers.append(nn.Linear(hidden, n_heads))
        self.mlp = nn.Sequential(*layers)

    def features(self, delta: Tensor) -> Tensor:
        """The MLP input for signed distances ``Δ = i - j``."""
        delta = delta.to(self.mlp[0].weight.dtype)
        return torch.sign(delta) * torch.log1p(delta.abs()) if self.log_distance else delta

    def of_distance(self, delta: Tensor) -> Tensor:
        """The bias for signed distances ``Δ = i - j`` of any shape: ``[..., H]``."""
        return self.mlp(self.features(delta)[..., None])

    def cost(self, head_dim: int) -> Cost:
        # the MLP of one distance: Linear(1, w), (depth - 1) x Linear(w, w), Linear(w, H): 2·(w + (depth-1)·w² + w·H)
        # products per offset (a table of the offsets, kept between decoding steps); then one add per pair and head
        w, h = self.hidden, self.n_heads
        return Cost(
            pair_elementwise=1.0,
            row=2.0 * (w + (self.depth - 1) * w * w + w * h),
            note="the MLP once per distinct offset (not per pair), one add per pair and head",
        )

    def check_sizes(self, **sizes: int | None) -> None:
        sizes.pop("d_model", None)  # only sets the MLP's default width: any model width works
        super().check_sizes(**sizes)

    def _kept_span(self, ctx: AttentionContext, p: int) -> Tensor | None:
        """The MLP at the distances ``i - j`` of a contiguous call, ``[H, P]`` in ``-offsets`` order, from a table
        this module keeps between calls without autograd (decoding: no ``Lk``-row MLP per layer and step), rebuilt
        (a half larger) when a distance falls outside it or a weight changed (version counters); ``None`` with
        autograd, in training, or for a call of many queries (the table would be built for one use)."""
        if torch.is_grad_enabled() or self.training or ctx.q_pos.shape[-1] > 16 or torch.compiler.is_compiling():
            return None
        params = list(self.mlp.parameters())
        key = tuple((id(t), t._version, t.dtype, t.device) for t in params)
        top = int(ctx.q_pos[0, -1] - ctx.k_pos[0, 0])  # the largest i - j; then down by one, P of them
        lo, hi = top - p + 1, top
        memo = self.__dict__.get("_distance_memo")
        if memo is None or memo[0] != key or lo < memo[1] or hi >= memo[1] + memo[2].shape[1]:
            pad = max(64, p // 2)
            new_lo, new_hi = (lo if lo >= 0 else lo - pad), hi + pad
            if memo is not None and memo[0] == key:
                new_lo, new_hi = min(new_lo, memo[1]), max(new_hi, memo[1] + memo[2].shape[1] - 1)
            d = torch.arange(new_lo, new_hi + 1, device=ctx.q_pos.device)
            memo = (key, new_lo, self.of_distance(d).t().contiguous(), params)  # [H, N]; params kept: ids stay
            self.__dict__["_distance_memo"] = memo
        return memo[2][:, lo - memo[1] : hi - memo[1] + 1].flip(-1)

    def _check_heads(self, ctx: AttentionContext) -> None:
        if ctx.n_heads != self.n_heads:
            raise ConfigError(f"dynamic-bias was built for n_heads={self.n_heads} but the attention has {ctx.n_heads}")

    def bias_offsets(self, ctx: AttentionContext) -> Tensor | None:
        """The MLP at the ``Lq + Lk - 1`` distances of contiguous positions: ``[H, P]`` (else ``None``)."""
        if ctx.reference or not offset_rows(ctx):
            return None
        self._check_heads(ctx)
        p = ctx.q_pos.shape[-1] + ctx.k_pos.shape[-1] - 1
        kept = self._kept_span(ctx, p)
        return kept if kept is not None else self.of_distance(-offsets(ctx)).t()

    def bias(self, ctx: AttentionContext) -> Tensor:
        self._check_heads(ctx)
        vals = self.bias_offsets(ctx)
        if vals is not None:  # offset-only: Lq + Lk - 1 MLP rows laid out as a Toeplitz matrix
            return toeplitz(vals, ctx.q_pos.shape[-1], ctx.k_pos.shape[-1])
        delta = -ctx.relative()  # i - j, [B, Lq, Lk]
        if ctx.reference:
            return self.of_distance(delta).permute(0, 3, 1, 2)
        values, inverse = torch.unique(delta, return_inverse=True)
        table = self.of_distance(values)  # [U, H]
        return table.t()[:, inverse].permute(1, 0, 2, 3)  # [H, B, Lq, Lk] -> [B, H, Lq, Lk]

    def matrix(self, length: int) -> Tensor:
        """The ``[H, L, L]`` bias for positions ``0 .. length-1``."""
        pos = torch.arange(length)[None]
        return self.bias(AttentionContext(q_pos=pos, k_pos=pos, n_heads=self.n_heads, head_dim=1))[0]
