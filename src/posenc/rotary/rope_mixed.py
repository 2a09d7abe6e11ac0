r"""RoPE-Mixed: 2-D rotary embedding with learnable frequencies that mix the axes (Heo et al. 2024).

Heo, Park, Han, Yun, "Rotary Position Embedding for Vision Transformer" (ECCV 2024; code naver-ai/rope-vit).
Where axial 2-D RoPE (``rope-2d``) rotates half the pairs by the row and half by the column, RoPE-Mixed rotates
every pair by a learned mix of both. For a patch at column ``x`` and row ``y``, head ``h`` and pair ``j``:

.. math::
    \phi_{h,j}(x, y) = f^x_{h,j}\, x + f^y_{h,j}\, y, \qquad
    q_{(x,y)}^\top k_{(x',y')} \text{ depends only on } (x' - x,\ y' - y)

(the paper's ``R(n, t) = e^{i(θ^x_t p^x_n + θ^y_t p^y_n)}``), with ``f^x``, ``f^y`` learnable parameters of each
head and layer. They start as the paper (and its code) sets them: magnitudes ``m_j = base^{-4j/d}``,
``j < d/4`` (``base = 10`` for RoPE-Mixed), and one random direction ``a_h ~ U[0, 2π)`` per head, the first
``d/4`` pairs along ``a_h`` and the other ``d/4`` along ``a_h + π/2``:

.. math::
    f^x_{h} = [m \cos a_h;\ m \cos(a_h + \pi/2)], \qquad f^y_{h} = [m \sin a_h;\ m \sin(a_h + \pi/2)]

Layout rotate-every-two, as the paper's code (pair ``j`` is dimensions ``(2j, 2j + 1)``, a complex number):
``(o_{2j}, o_{2j+1}) = (x_{2j} \cos φ - x_{2j+1} \sin φ,\ x_{2j+1} \cos φ + x_{2j} \sin φ)``.

Positions, as ``rope-2d``: one flat patch index per token in row-major order, ``t -> (x, y) = (t % W, t // W)``
with ``W = grid_width``, after ``n_prefix`` leading tokens (a CLS token, registers) that are not rotated (angle 0),
as the paper's ViT leaves its CLS token unrotated. Positions must be integers; with ``grid_height`` no patch may
be past the grid.

The frequencies are parameters (``freqs``, ``[2, n_heads, head_dim / 2]``: ``f^x`` then ``f^y``), one set per
layer: a model gives each layer its own, freshly drawn. The phases are computed in float32 (float64 after
``.double()``; a half-precision cast of the model still computes them in float32), as the paper's code does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..base import AttentionContext, Card, Cost, as_position_rows, check_positions
from ..errors import ConfigError
from ..registry import register
from ._grid import check_count, check_grid, check_head_dim_2d, grid_rows_cols
from .rope import RoPE


def mixed_frequencies(head_dim: int, n_heads: int, base: float = 10.0, rotate: bool = True) -> Tensor:
    r"""The paper's initial ``[f^x, f^y]``: ``[2, n_heads, head_dim / 2]`` float32 (``rotate``: a random direction per
    head, drawn from torch's global generator; otherwise every head along the axes, ``a_h = 0``)."""
    quarter = head_dim // 4
    mag = 1.0 / (base ** (torch.arange(0, head_dim, 4, dtype=torch.int64)[:quarter].float() / head_dim))
    a = torch.rand(n_heads, 1, dtype=torch.float32) * (2 * math.pi) if rotate else torch.zeros(n_heads, 1)
    fx = torch.cat([mag * torch.cos(a), mag * torch.cos(a + math.pi / 2)], dim=-1)
    fy = torch.cat([mag * torch.sin(a), mag * torch.sin(a + math.pi / 2)], dim=-1)
    return torch.stack([fx, fy])


@register
class RoPEMixed(RoPE):
    r"""RoPE-Mixed: pair ``j`` of head ``h`` rotates by ``f^x_{h,j} x + f^y_{h,j} y``, ``f`` learnable.

    .. math::
        \phi_{h,j}(t) = f^x_{h,j}\,(t \bmod W) + f^y_{h,j}\,\lfloor t / W \rfloor

    Args:
        head_dim: head width, a multiple of 4.
        n_heads: heads (each has its own frequencies).
        grid_width: ``W``, patches per row.
        grid_height: optional number of rows; positions past the grid are then refused.
        base: the base of the initial magnitudes ``base^{-4j/d}`` (10, as the paper's RoPE-Mixed).
        n_prefix: leading tokens that are not patches (CLS, registers): positions ``0 .. n_prefix - 1``, not
            rotated; patch ``t`` is at position ``n_prefix + t``.
        rotate: draw a random direction per head at initialisation (the paper's); ``False`` starts every head
            along the axes.
    """

    info = Card(
        name="rope-mixed",
        title="RoPE-Mixed (2-D, learnable mixed frequencies)",
        paper="Heo et al., Rotary Position Embedding for Vision Transformer (ECCV)",
        year=2024,
        family="rotary",
        position="relative",
        learnable=True,
        summary="Each pair rotates by f_x·x + f_y·y of patch (x, y), f learned per head: q·k depends on (Δx, Δy).",
        reference=(
            "the paper's formula written out (a ViT attention layer with a CLS token, as naver-ai/rope-vit): max "
            "|Δ| 1.7e-16 float64, 7.7e-8 float32; its initialisation; gradcheck of the frequencies"
        ),
        aliases=("rope-vit-mixed", "mixed-rope"),
    )
    shared_across_layers = False  # one set of frequencies per layer, as the paper's
    interleaved = True
    randomized_variant = False
    # relative in (x, y) of a grid, not in the flat 1-D positions the analysis shifts; the parameters do not
    # depend on max_len
    claims = {"relative_only": None, "params_constant": True}
    example_options = staticmethod(lambda dims: {"grid_width": max(2, math.isqrt(dims["max_len"]))})

    def __init__(
        self,
        head_dim: int,
        n_heads: int,
        grid_width: int,
        grid_height: int | None = None,
        base: float = 10.0,
        n_prefix: int = 0,
        rotate: bool = True,
    ):
        name = self.info.name
        check_head_dim_2d(name, head_dim)
        check_grid(name, grid_width, grid_height)
        check_count(name, "n_prefix", n_prefix)
        if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
            raise ConfigError(
                f"{name}: n_heads must be a positive integer (one set of frequencies each), got {n_heads!r}"
            )
        super().__init__(head_dim, base)
        self.n_heads, self.grid_width, self.grid_height = n_heads, grid_width, grid_height
        self.n_prefix, self.rotate_init = n_prefix, rotate
        # no single frequency schedule (each head has its own, learned): nothing for RoFormer's bound to read
        self.inv_freq = torch.empty(0)
        self.freqs = nn.Parameter(mixed_frequencies(head_dim, n_heads, base, rotate))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            init = mixed_frequencies(self.head_dim, self.n_heads, self.base, self.rotate_init)
            self.freqs.copy_(init.to(self.freqs.dtype))

    # ------------------------------------------------------------ the phases
    def angles(self, positions: Tensor) -> Tensor:
        """``f^x x + f^y y`` of flat patch indices ``[B, L]``: ``[B, H, L, head_dim / 2]`` (float32, or float64 for
        float64 parameters); 0 at the prefix tokens."""
        row, col = grid_rows_cols(self.info.name, positions, self.grid_width, self.grid_height, self.n_prefix)
        f = self.freqs
        if f.dtype != torch.float64:  # float32 at least: half-precision phases would lose the position
            f = f.float()
        x, y = col.to(f.dtype)[:, None, :, None], row.to(f.dtype)[:, None, :, None]
        phi = x * f[0][None, :, None, :] + y * f[1][None, :, None, :]
        if self.n_prefix:
            phi = torch.where((positions < self.n_prefix)[:, None, :, None], phi.new_zeros(()), phi)
        return phi

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin of :meth:`angles`: ``[B, H, L, head_dim / 2]`` each."""
        if not positions.is_floating_point():
            check_positions(positions)  # negative positions refused, as the attention does
        a = self.angles(positions)
        return a.cos(), a.sin()

    def _check_heads(self, x: Tensor, what: str) -> None:
        if x.dim() != 4 or x.shape[1] != self.n_heads:
            raise ConfigError(
                f"{self.info.name} has frequencies for {self.n_heads} heads and rotates [B, {self.n_heads}, L, "
                f"{self.head_dim}] tensors, got {what} of shape {tuple(x.shape)}"
                + (
                    " (grouped keys with fewer heads cannot share one rotation per key head: repeat them first)"
                    if x.dim() == 4 and what == "k"
                    else ""
                )
            )

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        self._check_heads(q, "q")
        self._check_heads(k, "k")
        key = ("rope-mixed-cos-sin", id(self))
        got = ctx.cache.get(key)
        if got is None or got[0] is not ctx.q_pos or got[1] is not ctx.k_pos:
            qc, qs = self.cos_sin(ctx.q_pos)
            kc, ks = (qc, qs) if ctx.k_pos is ctx.q_pos else self.cos_sin(ctx.k_pos)
            got = (ctx.q_pos, ctx.k_pos, qc, qs, kc, ks)
            ctx.cache[key] = got
        _, _, qc, qs, kc, ks = got
        return self.apply(q, qc, qs), self.apply(k, kc, ks)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Rotate one tensor ``x`` ``(b, n_heads, l, d)``; positions ``[L]`` or ``[B, L]`` (flat patch indices)."""
        self._check_heads(x, "x")
        rows = as_position_rows(positions, x.shape[-2], x.device)
        cos, sin = self.cos_sin(rows)
        return self.apply(x, cos, sin)

    def cost(self, head_dim: int) -> Cost:
        # each pair of q and of k rotated once per token and head (2 × 3·d); the phases f^x x + f^y y and their
        # cos / sin depend on the grid cell and the parameters only: one table per cell and head per step, shared
        # by the batch and the queries / keys at that cell
        return Cost(
            token_elementwise=6.0 * head_dim,
            note="q and k rotated once per token and head; the phases are a table per grid cell and head",
        )
