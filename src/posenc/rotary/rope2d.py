r"""2-D (axial) rotary position embedding for image patches.

Half of the rotary pairs rotate by the patch's row, the other half by its
column (RoPE-Axial of Heo et al. 2024, "Rotary Position Embedding for Vision
Transformer"; also EVA-02 and FiT). For a patch at ``(r, c)``:

.. math::
    \mathrm{RoPE2D}(x, (r, c)) = R_{\Theta, r} \oplus R_{\Theta, c}, \qquad
    q_{(r,c)}^\top k_{(r',c')} \text{ depends only on } (r' - r,\ c' - c)

with one frequency set per axis, ``θ_j = base^{-4j/d}``, ``j = 0 .. d/4 - 1``
(each axis has ``d/4`` pairs), and ``base = 100`` by default as Heo et al.'s
RoPE-Axial (``theta=100``).

Positions. The attention passes one position per token, so the positions of
this encoding are *flat patch indices* in row-major order: ``t -> (t // W, t % W)``
with ``W = grid_width``. A CLS or register token can be given any flat index
(e.g. one past the grid) or kept out of the rotated sequence. Positions must be
integers; with ``grid_height`` they must also be ``< grid_height · grid_width``.

Layout: rotate-half, as ``rope``: pair ``i`` is dimensions ``(i, i + d/2)``;
pairs ``0 .. d/4 - 1`` rotate by the row, pairs ``d/4 .. d/2 - 1`` by the column.

Precision: as ``rope`` (:func:`~posenc.rotary.rope.rope_angles`), with the row and the
column as the multipliers: float32 products below ``2**24``, reduced modulo 2π in
float64 beyond. Unlike ``rope``, ``.double()`` makes ``θ`` and the table float64
(and ``.float()`` float32 again); half-precision casts (``.half()``,
``.to(torch.bfloat16)``) leave them as they are.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..base import Card
from ..errors import ConfigError, PositionError
from ..registry import register
from .rope import RoPE, rope_angles


@register
class RoPE2D(RoPE):
    r"""Axial 2-D RoPE: pairs ``i < d/4`` rotate by the row ``t // W``, the rest by the column ``t % W``.

    .. math::
        \phi_i(t) = \begin{cases} \lfloor t / W \rfloor\,\theta_i & i < d/4 \\
                                   (t \bmod W)\,\theta_{i - d/4} & d/4 \le i < d/2 \end{cases},
        \qquad \theta_j = \mathrm{base}^{-4j/d}

    and each pair ``(x_i, x_{i+d/2})`` is rotated by ``φ_i(t)`` as in RoPE.

    Args:
        head_dim: head width, divisible by 4.
        grid_width: ``W``, patches per row.
        grid_height: optional number of rows; positions beyond the grid are then refused.
        base: frequency base (100, as RoPE-Axial).
    """

    info = Card(
        name="rope-2d",
        title="2-D axial RoPE",
        paper="Heo et al., Rotary Position Embedding for Vision Transformer",
        year=2024,
        family="rotary",
        position="relative",
        learnable=False,
        summary="Half the rotary pairs rotate by the patch row, half by the column: q·k depends on (Δrow, Δcol).",
        reference="the formula as a naive per-pair loop; 2-D translation invariance",
        aliases=("rope-axial", "axial-rope"),
    )
    randomized_variant = False
    # relative in (row, column) of a grid, not in the flattened 1-D positions the analysis shifts:
    # a shift by a multiple of grid_width leaves its scores unchanged, a shift by 1 does not
    claims = {"relative_only": None}
    # a square grid of about max_len cells
    example_options = staticmethod(lambda dims: {"grid_width": max(2, math.isqrt(dims["max_len"]))})
    # no HF numbers to keep here: .double() / .float() still give float64 / float32 phases (as before),
    # half-precision casts leave them as they are
    phase_casts = (torch.float32, torch.float64)

    def __init__(self, head_dim: int, grid_width: int, grid_height: int | None = None, base: float = 100.0):
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 4:
            raise ConfigError(
                f"rope-2d splits the rotary pairs between rows and columns, so head_dim must be a positive "
                f"multiple of 4, got {head_dim!r}"
            )
        super().__init__(head_dim, base)
        for what, value in (("grid_width", grid_width), ("grid_height", grid_height)):
            if value is None and what == "grid_height":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"rope-2d: {what} must be a positive integer (patches per row/column), got {value!r}")
        self.grid_width, self.grid_height = grid_width, grid_height
        quarter = head_dim // 4
        axis = 1.0 / (base ** (torch.arange(0, head_dim, 4, dtype=torch.int64)[:quarter].float() / head_dim))
        self.inv_freq = torch.cat([axis, axis])

    def rows_cols(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``(t // W, t % W)`` of flat patch indices."""
        return torch.div(positions, self.grid_width, rounding_mode="floor"), positions % self.grid_width

    def angles(self, positions: Tensor) -> Tensor:
        row, col = self.rows_cols(positions)
        quarter = self.head_dim // 4
        return torch.cat(
            [
                rope_angles(row[..., None], self.inv_freq[:quarter]),
                rope_angles(col[..., None], self.inv_freq[quarter:]),
            ],
            -1,
        )

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        if positions.is_floating_point():
            raise PositionError(
                f"rope-2d positions are flat patch indices t = row * {self.grid_width} + col and must be integers "
                f"(torch.long), got dtype {positions.dtype}"
            )
        if self.grid_height is not None and positions.numel():
            top = int(positions.max())
            if top >= self.grid_height * self.grid_width:
                raise PositionError(
                    f"rope-2d: flat patch index {top} is outside the {self.grid_height} x {self.grid_width} grid "
                    f"(indices 0..{self.grid_height * self.grid_width - 1}); build it with a larger grid_height "
                    "or grid_height=None"
                )
        return super().cos_sin(positions)
