r"""FIRE, functional interpolation for relative positions (Li et al. 2024, ICLR).

FIRE learns the bias as a function of a *normalised* distance, so that a longer
input maps into the range of distances seen in training (progressive
interpolation):

.. math::
    b(i, j) = f_\theta\!\left( \frac{\psi(i - j)}{\psi(\max\{L, i\})} \right), \qquad
    \psi(x) = \log(c\,x + 1), \qquad j \le i

with ``f_θ : R -> R^H`` a small MLP (1 -> hidden -> heads, ReLU), ``c > 0`` a learned
scalar and ``L`` a learned threshold: for queries at ``i < L`` the normaliser is
``ψ(L)``, so short contexts are not stretched to ``[0, 1]``. The bias is added
after the temperature (the ``bias`` hook).

Where the paper's equation and its appendix pseudo-code differ we follow the
pseudo-code and say so:

* ``c`` enters as ``|c|`` (``ψ(x) = log(|c x| + 1)``), which keeps ``c > 0`` in effect;
* ``L = |ℓ · L_0|`` with a fixed ``L_0`` (``init_L``, 512) and a learned multiplier
  ``ℓ`` (init 1);
* ``ε`` (1e-6) is added to the denominator ``ψ(max{L, i})``;
* for a key after the query (``j > i``, only without a causal mask) the distance
  enters as ``|i - j|``, so FIRE is then symmetric.

FIRE is *not* translation invariant: the normaliser depends on the query
position ``i`` once ``i > L``. Each layer has its own FIRE by default
(``shared=False``); ``shared=True`` is the paper's layer-shared ablation.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..base import AttentionContext, Card, PositionalEncoding
from ..errors import ConfigError
from ..registry import register


@register
class FIRE(PositionalEncoding):
    r"""FIRE: :math:`b(i,j) = f_\theta(\psi(i-j)/\psi(\max\{L,i\}))`, :math:`\psi(x) = \log(cx+1)`.

    Args:
        n_heads: heads (the MLP's output width).
        hidden: the MLP's hidden width (32 in the paper).
        init_c: initial ``c`` (0.1).
        init_L: the threshold's base ``L_0`` (512); ``L = |ℓ L_0|`` with learned ``ℓ``.
        learn_threshold: whether ``ℓ`` is learned (True, the paper's progressive interpolation).
        eps: added to the normaliser.
        shared: one FIRE for all layers (the paper's FIRE-S) instead of one per layer.
    """

    info = Card(
        name="fire",
        title="FIRE (functional interpolation for relative positions)",
        paper="Li et al., Functional Interpolation for Relative Positions Improves Long Context Transformers",
        year=2024,
        family="bias",
        position="relative",
        learnable=True,
        summary="MLP of log(c(i-j)+1)/log(c max(L,i)+1) per head, added after scaling.",
        reference="the paper's equation (and appendix pseudo-code) on hand-computed cases",
        shortcoming="not translation invariant past the threshold L; an MLP per pair costs O(L^2 · hidden)",
    )

    def __init__(
        self,
        n_heads: int,
        hidden: int = 32,
        init_c: float = 0.1,
        init_L: float = 512.0,
        learn_threshold: bool = True,
        eps: float = 1e-6,
        shared: bool = False,
    ):
        super().__init__()
        if not isinstance(n_heads, int) or isinstance(n_heads, bool) or n_heads < 1:
            raise ConfigError(f"fire needs n_heads >= 1 (an integer), got {n_heads!r}")
        if not isinstance(hidden, int) or hidden < 1:
            raise ConfigError(f"fire: hidden must be a positive integer, got {hidden!r}")
        if not init_c > 0:
            raise ConfigError(f"fire: init_c must be > 0 (psi(x) = log(c x + 1)), got {init_c}")
        if not init_L > 0:
            raise ConfigError(f"fire: init_L (the threshold L) must be > 0, got {init_L}")
        if not eps >= 0:
            raise ConfigError(f"fire: eps must be >= 0, got {eps}")
        self.n_heads, self.hidden, self.eps = n_heads, hidden, eps
        self.init_c_value, self.init_L_value = float(init_c), float(init_L)
        self.shared_across_layers = bool(shared)  # type: ignore[misc]  # instance override of the ClassVar
        self.mlp = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, n_heads))
        self.c = nn.Parameter(torch.tensor(self.init_c_value))
        self.register_buffer("L0", torch.tensor(self.init_L_value))
        self.L_multiplier = nn.Parameter(torch.tensor(1.0), requires_grad=learn_threshold)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            self.c.fill_(self.init_c_value)
            self.L_multiplier.fill_(1.0)

    def threshold(self) -> Tensor:
        """``L = |ℓ L_0|``."""
        return (self.L_multiplier * self.L0).abs()

    def psi(self, x: Tensor) -> Tensor:
        r"""``ψ(x) = log(|c x| + 1)``."""
        return torch.log1p((self.c * x).abs())

    def normalized_distance(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``ψ(|i - j|) / (ψ(max{L, i}) + ε)``: ``[B, Lq, Lk]``."""
        dtype = self.c.dtype
        i = q_pos.to(dtype)
        dist = (i[:, :, None] - k_pos.to(dtype)[:, None, :]).abs()
        norm = self.psi(torch.maximum(i, self.threshold())) + self.eps  # [B, Lq]
        return self.psi(dist) / norm[:, :, None]

    def bias(self, ctx: AttentionContext) -> Tensor:
        if ctx.n_heads != self.n_heads:
            raise ConfigError(f"fire was built for n_heads={self.n_heads} but the attention has {ctx.n_heads}")
        x = self.normalized_distance(ctx.q_pos, ctx.k_pos)  # [B, Lq, Lk]
        return self.mlp(x[..., None]).permute(0, 3, 1, 2)  # [B, H, Lq, Lk]

    def matrix(self, length: int) -> Tensor:
        """The ``[H, L, L]`` bias for positions ``0 .. length-1``."""
        pos = torch.arange(length)[None]
        return self.bias(AttentionContext(q_pos=pos, k_pos=pos, n_heads=self.n_heads, head_dim=1))[0]
