r"""KERPLE, kernelized relative positional embedding (Chi, Fan, Ramadge and Rudnicky 2022).

KERPLE generalises ALiBi: the bias is a *conditionally positive definite* kernel
of the distance, shifted by a constant that softmax ignores, with learned
per-head parameters. The paper's two variants (section 4, eqs. for the power
and logarithmic kernels):

.. math::
    \text{power:}\quad \tilde k(m, n) = -r_1 |m - n|^{r_2}, \qquad r_1 > 0,\ 0 < r_2 \le 2 \\
    \text{log:}\quad   \tilde k(m, n) = -r_1 \log(1 + r_2 |m - n|), \qquad r_1, r_2 > 0

added to the scaled logits: ``A = q·k/sqrt(d) + \tilde k``. Each layer has its
own ``r_1, r_2`` per head (the reference implementation builds one module per
layer), so ``shared_across_layers = False``.

Keeping the parameters in range. ``constraint="clamp"`` (default) does what the
paper's code (chijames/KERPLE, ``ParallelKerpleLog``/``ParallelKerplePower``)
does: before every use the raw parameters are clamped in place (no gradient)
to ``r >= eps`` (``eps = 1e-2``) and, for the power exponent, ``r_2 <= 2``; the
bias then uses them as they are. ``constraint="softplus"`` instead uses
``r = softplus(raw)`` (and ``r_2 = 2·sigmoid(raw)`` for the power exponent), a
smooth reparametrisation that never writes to the parameters.
Initialisation (unless ``r1``/``r2`` are given): uniform, ``r_1 ~ U(0, 2)``,
``r_2 ~ U(0, 1)`` for log; ``r_1 ~ U(0, 1)``, ``r_2 ~ U(0, 2)`` for power, then
clamped into range -- our choice in the spirit of the reference code's uniform
initialisation, not checked against it number for number.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base import AttentionContext, Card, Cost, PositionalEncoding
from ..errors import ConfigError
from ..registry import register
from ..relative._skew import kept_offset_table, offset_rows, offsets, toeplitz

CONSTRAINTS = ("clamp", "softplus")


def _inverse_softplus(x: Tensor) -> Tensor:
    return x + torch.log(-torch.expm1(-x))


class _Kerple(PositionalEncoding):
    """Shared machinery of the two KERPLE kernels."""

    shared_across_layers = False
    randomized_variant = True
    claims = {"relative_only": True}  # a function of |i - j| only
    r2_max: float | None = None  # the power kernel's 0 < r2 <= 2
    r1_init_scale = 1.0
    r2_init_scale = 1.0

    def __init__(
        self,
        n_heads: int,
        r1: float | None = None,
        r2: float | None = None,
        constraint: str = "clamp",
        eps: float = 1e-2,
    ):
        super().__init__()
        name = self.info.name
        if not isinstance(n_heads, int) or isinstance(n_heads, bool) or n_heads < 1:
            raise ConfigError(f"{name} needs n_heads >= 1 (an integer), got {n_heads!r}")
        if constraint not in CONSTRAINTS:
            raise ConfigError(f"{name}: constraint must be one of {CONSTRAINTS}, got {constraint!r}")
        if not eps > 0:
            raise ConfigError(f"{name}: eps must be > 0, got {eps}")
        if r1 is not None and not r1 > 0:
            raise ConfigError(f"{name}: r1 must be > 0, got {r1}")
        if r2 is not None:
            if not r2 > 0:
                raise ConfigError(f"{name}: r2 must be > 0, got {r2}")
            if self.r2_max is not None and r2 > self.r2_max:
                raise ConfigError(
                    f"{name}: the exponent r2 must satisfy 0 < r2 <= {self.r2_max:g} (the kernel is then "
                    f"conditionally positive definite), got {r2}"
                )
        self.n_heads, self.constraint, self.eps = n_heads, constraint, eps
        self.init_r1, self.init_r2 = r1, r2
        self.raw_r1 = nn.Parameter(torch.empty(n_heads))
        self.raw_r2 = nn.Parameter(torch.empty(n_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            r1 = torch.full((self.n_heads,), float(self.init_r1)) if self.init_r1 else None
            r2 = torch.full((self.n_heads,), float(self.init_r2)) if self.init_r2 else None
            if r1 is None:
                r1 = (torch.rand(self.n_heads) * self.r1_init_scale).clamp(min=self.eps)
            if r2 is None:
                r2 = (torch.rand(self.n_heads) * self.r2_init_scale).clamp(min=self.eps)
                if self.r2_max is not None:
                    r2 = r2.clamp(max=self.r2_max)
            if self.constraint == "clamp":
                self.raw_r1.copy_(r1)
                self.raw_r2.copy_(r2)
            else:
                self.raw_r1.copy_(_inverse_softplus(r1))
                if self.r2_max is not None:
                    p = (r2 / self.r2_max).clamp(1e-6, 1 - 1e-6)
                    self.raw_r2.copy_(torch.log(p) - torch.log1p(-p))
                else:
                    self.raw_r2.copy_(_inverse_softplus(r2))

    def parameters_in_range(self) -> tuple[Tensor, Tensor]:
        """``(r_1, r_2)`` as the kernel uses them, ``[H]`` each (clamping the raw values first)."""
        if self.constraint == "clamp":
            hi = self.r2_max if self.r2_max is not None else math.inf
            with torch.no_grad():
                # write only when something is out of range: an in-place write bumps the version
                # counter and would break a backward through an earlier use in the same graph
                if torch.compiler.is_compiling():  # no data-dependent branch in a traced graph (it is functional)
                    self.raw_r1.clamp_(min=self.eps)
                    self.raw_r2.clamp_(min=self.eps, max=hi)
                else:
                    if bool((self.raw_r1 < self.eps).any()):
                        self.raw_r1.clamp_(min=self.eps)
                    if bool(((self.raw_r2 < self.eps) | (self.raw_r2 > hi)).any()):
                        self.raw_r2.clamp_(min=self.eps, max=hi)
            return self.raw_r1, self.raw_r2
        r1 = F.softplus(self.raw_r1)
        r2 = self.r2_max * torch.sigmoid(self.raw_r2) if self.r2_max is not None else F.softplus(self.raw_r2)
        return r1, r2

    def kernel(self, dist: Tensor, r1: Tensor, r2: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def cost(self, head_dim: int) -> Cost:
        # the kernel of |i - j| (log or power) is one value per offset and head (O(L)); each pair adds it
        return Cost(pair_elementwise=1.0, note="one add per pair and head; the kernel per offset (offset-bias kernel)")

    def _check_heads(self, ctx: AttentionContext) -> None:
        if ctx.n_heads != self.n_heads:
            raise ConfigError(
                f"{self.info.name} was built for n_heads={self.n_heads} but the attention has {ctx.n_heads}"
            )

    def bias_offsets(self, ctx: AttentionContext) -> Tensor | None:
        """The kernel at the ``Lq + Lk - 1`` distances of contiguous positions: ``[H, P]`` (else ``None``)."""
        if ctx.reference or not offset_rows(ctx):
            return None
        self._check_heads(ctx)
        kept = self._kept_offsets(ctx)
        if kept is not None:
            return kept
        r1, r2 = self.parameters_in_range()
        dist = offsets(ctx).abs().to(r1.dtype)[None, :]  # [1, P]
        return self.kernel(dist, r1[:, None], r2[:, None])  # [H, P]

    def _kept_offsets(self, ctx: AttentionContext) -> Tensor | None:
        """The kernel at the call's offsets from a table of it per offset kept between calls: ``[H, P]``, or ``None``
        (under autograd, in training, while ``torch.compile`` traces).

        A decoding step's ``Lk`` offsets are one run of a table over ``-N .. N``: the step reads a slice instead of a
        ``log1p`` (or ``pow``) per cached key and head. The table gains offsets as the cache grows (a half more at a
        time) and is rebuilt when ``raw_r1`` or ``raw_r2`` changed (version counters); the range clamp runs when it
        is built (a parameter that has not changed since is still in range)."""
        if torch.is_grad_enabled() or self.training or torch.compiler.is_compiling():
            return None
        lq, lk = ctx.q_pos.shape[-1], ctx.k_pos.shape[-1]
        low = int(ctx.k_pos[0, 0]) - int(ctx.q_pos[0, -1])  # the first offset j - i; the others follow one by one
        n = max(abs(low), abs(low + lq + lk - 2))

        def of_distance(d: Tensor) -> Tensor:
            r1, r2 = self.parameters_in_range()
            return self.kernel(d[None, :], r1[:, None], r2[:, None])  # [H, 2N + 1]

        table = kept_offset_table(self, "_offsets_memo", n, of_distance, [self.raw_r1, self.raw_r2], self.raw_r1)
        mid = table.shape[-1] // 2  # offset 0
        return table[:, mid + low : mid + low + lq + lk - 1]

    def bias(self, ctx: AttentionContext) -> Tensor:
        self._check_heads(ctx)
        vals = self.bias_offsets(ctx)
        if vals is not None:  # offset-only: laid out as a Toeplitz matrix
            return toeplitz(vals, ctx.q_pos.shape[-1], ctx.k_pos.shape[-1])
        r1, r2 = self.parameters_in_range()
        dist = ctx.relative().abs().to(r1.dtype)[:, None]  # |i - j|, [B, 1, Lq, Lk]
        return self.kernel(dist, r1[None, :, None, None], r2[None, :, None, None])

    def matrix(self, length: int) -> Tensor:
        """The ``[H, L, L]`` bias for positions ``0 .. length-1``."""
        pos = torch.arange(length)
        ctx = AttentionContext(q_pos=pos[None], k_pos=pos[None], n_heads=self.n_heads, head_dim=1)
        return self.bias(ctx)[0]


@register
class KerpleLog(_Kerple):
    r"""KERPLE, logarithmic kernel: :math:`\tilde k(m,n) = -r_1 \log(1 + r_2 |m-n|)`, ``r_1, r_2 > 0``.

    Per head and per layer learned ``r_1`` (outside the log) and ``r_2`` (inside);
    see the module docstring for how they stay positive. The paper's best variant
    for extrapolation; the bias grows only logarithmically with distance.
    """

    info = Card(
        name="kerple-log",
        title="KERPLE (logarithmic kernel)",
        paper="Chi, Fan, Ramadge, Rudnicky, KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation",
        year=2022,
        family="bias",
        position="relative",
        learnable=True,
        summary="-r1 log(1 + r2 |i-j|), learned r1, r2 > 0 per head and layer.",
        reference="the paper's log-kernel equation on hand-computed cases",
    )
    r1_init_scale = 2.0
    r2_init_scale = 1.0

    def kernel(self, dist: Tensor, r1: Tensor, r2: Tensor) -> Tensor:
        return -r1 * torch.log1p(r2 * dist)


@register
class KerplePower(_Kerple):
    r"""KERPLE, power kernel: :math:`\tilde k(m,n) = -r_1 |m-n|^{r_2}`, ``r_1 > 0``, ``0 < r_2 <= 2``.

    ``r_2 = 1`` with fixed ``r_1 = m_h`` is ALiBi. An ``r2`` outside ``(0, 2]`` at
    construction is a :class:`~posenc.ConfigError`.
    """

    info = Card(
        name="kerple-power",
        title="KERPLE (power kernel)",
        paper="Chi, Fan, Ramadge, Rudnicky, KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation",
        year=2022,
        family="bias",
        position="relative",
        learnable=True,
        summary="-r1 |i-j|^r2, learned r1 > 0, 0 < r2 <= 2 per head and layer.",
        reference="the paper's power-kernel equation on hand-computed cases",
    )
    r2_max = 2.0
    r1_init_scale = 1.0
    r2_init_scale = 2.0

    def kernel(self, dist: Tensor, r1: Tensor, r2: Tensor) -> Tensor:
        # |0|^r2 = 0 with a finite gradient in r2 (pow's gradient at 0 is log(0) * 0 = nan)
        safe = torch.where(dist > 0, dist, torch.ones_like(dist))
        return torch.where(dist > 0, -r1 * safe.pow(r2), torch.zeros_like(safe * r2))
