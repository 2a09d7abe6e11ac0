r"""Axial 2-D RoPE on normalised patch coordinates, with training-time augmentations (DINOv3).

Siméoni et al., "DINOv3" (Meta AI 2025), as transformers' ``DINOv3ViTRopePositionEmbedding`` computes it. Like
``rope-2d``, half of the rotary pairs rotate by the patch's row and half by its column; unlike it, the coordinates
are the patch centres normalised to ``[-1, 1]`` whatever the grid's size, so that one model sees images of any
resolution on the same range. For patch ``(r, c)`` of an ``H × W`` grid:

.. math::
    y = 2\,\frac{r + 1/2}{H} - 1, \qquad x = 2\,\frac{c + 1/2}{W} - 1, \qquad
    \phi_i = \begin{cases} 2\pi\, y\, \theta_i & i < d/4 \\ 2\pi\, x\, \theta_{i - d/4} & d/4 \le i < d/2 \end{cases},
    \qquad \theta_j = \mathrm{base}^{-4j/d}

(``base = 100``), and pair ``(x_i, x_{i+d/2})`` rotates by ``φ_i`` as in RoPE (rotate-half layout, the row pairs
first, as DINOv3). In training, DINOv3 augments the coordinates of each forward (the same draw for every layer and
every image of the batch), in this order:

* ``shift``: ``(y, x) += (s_y, s_x)``, each ``~ U[-shift, shift]``;
* ``jitter``: ``(y, x) *= (j_y, j_x)``, each log-uniform in ``[1/jitter, jitter]``;
* ``rescale``: ``(y, x) *= s``, one log-uniform in ``[1/rescale, rescale]`` (DINOv3's default: ``rescale = 2``).

Positions, as ``rope-2d``: one flat patch index per token in row-major order, ``t -> (t // W, t % W)``, after
``n_prefix`` leading tokens (DINOv3's CLS and register tokens) that are not rotated. ``H`` is ``grid_height``;
without it, the rows the call's positions reach (as DINOv3 reads it from the image), which makes the encoding
length-dependent (a KV cache then recomputes, see :meth:`cache_problem`).

Precision: the coordinates and their augmentations are float32 (as transformers computes them, whatever the
model's dtype), the inverse frequencies float32 -- float64 after ``.double()``, as transformers' buffer is -- and
the angle ``(2π y) θ_j`` is computed in the frequencies' dtype: cos and sin are transformers' numbers bit for bit
in float32 and in float64.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..base import AttentionContext, Card, check_positions
from ..registry import register
from ._grid import check_count, check_grid, check_head_dim_2d, grid_rows_cols
from .rope import RoPE


def dinov3_inverse_frequencies(head_dim: int, base: float) -> Tensor:
    r"""``θ_j = base^{-4j/d}``, ``j < d/4``, in float32, computed as transformers' DINOv3 does (exponents
    ``j · (4/d)``)."""
    exponents = (torch.arange(head_dim // 4, dtype=torch.float64) * (4 / head_dim)).float()
    return 1 / base**exponents


@register
class RoPEDINOv3(RoPE):
    r"""Axial 2-D RoPE on patch centres normalised to ``[-1, 1]``, with DINOv3's shift / jitter / rescale in training.

    .. math::
        \phi_i(r, c) = 2\pi\,\theta_{i \bmod d/4} \cdot
            \begin{cases} 2 (r + \tfrac12)/H - 1 & i < d/4 \\ 2 (c + \tfrac12)/W - 1 & \text{otherwise} \end{cases}

    Args:
        head_dim: head width, a multiple of 4.
        grid_width: ``W``, patches per row.
        grid_height: ``H``, rows of patches; ``None``: the rows the positions of each call reach.
        base: frequency base (DINOv3: 100).
        n_prefix: leading tokens that are not patches (DINOv3: 1 CLS + 4 registers): positions
            ``0 .. n_prefix - 1``, not rotated; patch ``t`` is at position ``n_prefix + t``.
        shift: training: add ``U[-shift, shift]`` to each coordinate axis (``None``: no shift).
        jitter: training: multiply each axis by a log-uniform factor in ``[1/jitter, jitter]`` (``None``: none).
        rescale: training: multiply both axes by one log-uniform factor in ``[1/rescale, rescale]`` (``None``:
            none; DINOv3's default is 2).
    """

    info = Card(
        name="rope-dinov3",
        title="2-D axial RoPE on normalised coordinates (DINOv3)",
        paper="Siméoni et al., DINOv3 (transformers' DINOv3ViTRopePositionEmbedding)",
        year=2025,
        family="rotary",
        position="relative",
        learnable=False,
        summary="Axial 2-D RoPE on patch centres in [-1, 1] (any grid size); shift, jitter, rescale in training.",
        reference=(
            "HF transformers 5.24 DINOv3ViTRopePositionEmbedding + DINOv3ViTAttention (CLS + registers, the training "
            "augmentations from the same seed): cos/sin bit for bit; layer max |Δ| 2.8e-16 float64, 1.2e-7 float32"
        ),
        aliases=("dinov3-rope", "rope-2d-normalized", "rope-2d-normalised"),
    )
    randomized_variant = False
    # relative in (row, column) of a fixed grid, not in the flat 1-D positions the analysis shifts
    claims = {"relative_only": None}
    # a square-ish grid of at least max_len cells
    example_options = staticmethod(
        lambda dims: {
            "grid_width": (w := max(2, math.isqrt(dims["max_len"]))),
            "grid_height": -(-dims["max_len"] // w),
        }
    )
    # as transformers: .double() makes θ float64 (its buffer is cast), half-precision casts leave it float32
    phase_casts = (torch.float32, torch.float64)
    option_limits = {
        "shift": (lambda v: v >= 0, ">= 0 (the half-width of the uniform shift of each coordinate axis)"),
        "jitter": (lambda v: v >= 1, ">= 1 (the per-axis factor is log-uniform in [1/jitter, jitter]; 1: none)"),
        "rescale": (lambda v: v >= 1, ">= 1 (the factor is log-uniform in [1/rescale, rescale]; 1: none)"),
    }

    def __init__(
        self,
        head_dim: int,
        grid_width: int,
        grid_height: int | None = None,
        base: float = 100.0,
        n_prefix: int = 0,
        shift: float | None = None,
        jitter: float | None = None,
        rescale: float | None = 2.0,
    ):
        name = self.info.name
        check_head_dim_2d(name, head_dim)
        check_grid(name, grid_width, grid_height)
        check_count(name, "n_prefix", n_prefix)
        super().__init__(head_dim, base)
        self.grid_width, self.grid_height, self.n_prefix = grid_width, grid_height, n_prefix
        self.shift, self.jitter, self.rescale = shift, jitter, rescale
        axis = dinov3_inverse_frequencies(head_dim, base)
        self.inv_freq = torch.cat([axis, axis])  # the row pairs, then the column pairs

    @property
    def length_dependent(self) -> bool:
        """Without ``grid_height`` the coordinates are normalised by the rows the positions reach: a model then
        gives right padding position 0, so that a row's real length decides, not its padded one."""
        return self.grid_height is None

    # ---------------------------------------------------------- coordinates
    def rows_spanned(self, *positions: Tensor) -> int | Tensor:
        """The rows of patches that ``positions`` reach (at least 1): ``H`` when ``grid_height`` is ``None``.

        While ``torch.compile`` traces, a 0-d int64 tensor (an int would need the data)."""
        tops = [p.max() for p in positions if p.numel()]
        if not tops:
            return 1
        top = torch.stack(tops).max() if len(tops) > 1 else tops[0]
        rows = torch.div(top - self.n_prefix, self.grid_width, rounding_mode="floor") + 1
        if torch.compiler.is_compiling():
            return rows.clamp(min=1)
        return max(int(rows), 1)

    def augmentation(self, device: torch.device | None = None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """One draw of DINOv3's training augmentations: ``(shift [1, 2], jitter [1, 2], rescale [1])`` float32 (each
        ``None`` where its setting is), from torch's global generator, drawn as transformers draws them."""
        shift = jitter = rescale = None
        if self.shift is not None:
            shift = torch.empty((1, 2), device=device, dtype=torch.float32).uniform_(-self.shift, self.shift)
        if self.jitter is not None:
            r = math.log(self.jitter)
            jitter = torch.empty((1, 2), device=device, dtype=torch.float32).uniform_(-r, r).exp()
        if self.rescale is not None:
            r = math.log(self.rescale)
            rescale = torch.empty(1, device=device, dtype=torch.float32).uniform_(-r, r).exp()
        return shift, jitter, rescale

    def coordinates(
        self,
        positions: Tensor,
        height: int | Tensor | None = None,
        augmentation: tuple[Tensor | None, Tensor | None, Tensor | None] | None = None,
    ) -> Tensor:
        """The (augmented) normalised centres ``(y, x)`` of the patches at ``positions [B, L]``: ``[B, L, 2]``
        float32. ``height`` defaults to ``grid_height``, else to the rows the positions reach."""
        if not positions.is_floating_point():
            check_positions(positions)
        row, col = grid_rows_cols(self.info.name, positions, self.grid_width, self.grid_height, self.n_prefix)
        if height is None:
            height = self.grid_height if self.grid_height is not None else self.rows_spanned(positions)
        y = (row.float() + 0.5) / height
        x = (col.float() + 0.5) / self.grid_width
        coords = 2.0 * torch.stack([y, x], dim=-1) - 1.0
        if augmentation is not None:
            shift, jitter, rescale = augmentation
            if shift is not None:
                coords = coords + shift
            if jitter is not None:
                coords = coords * jitter
            if rescale is not None:
                coords = coords * rescale
        return coords

    def angles(
        self,
        positions: Tensor,
        height: int | Tensor | None = None,
        augmentation: tuple[Tensor | None, Tensor | None, Tensor | None] | None = None,
    ) -> Tensor:
        """``2π · coordinate · θ_j``: ``[B, L, head_dim / 2]`` (the row pairs, then the column pairs); 0 at the prefix
        tokens."""
        coords = self.coordinates(positions, height, augmentation)
        quarter = self.head_dim // 4
        a = (2 * math.pi * coords[..., None] * self.inv_freq[:quarter]).flatten(-2)
        if self.n_prefix:
            a = torch.where((positions < self.n_prefix)[..., None], a.new_zeros(()), a)
        return a

    def cos_sin(
        self,
        positions: Tensor,
        height: int | Tensor | None = None,
        augmentation: tuple[Tensor | None, Tensor | None, Tensor | None] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """cos and sin of :meth:`angles`, ``[B, L, head_dim / 2]``. Called alone (``forward``), it draws the
        augmentations itself in training."""
        if augmentation is None and self.training:
            augmentation = self.augmentation(positions.device)
        a = self.angles(positions, height, augmentation)
        return a.cos(), a.sin()

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        key = ("rope-dinov3-cos-sin", id(self))
        got = ctx.cache.get(key)
        if got is None or got[0] is not ctx.q_pos or got[1] is not ctx.k_pos:
            aug = None
            if self.training:  # one draw per forward: every layer and both q and k take the same
                aug_key = ("rope-dinov3-augmentation", id(self))
                aug = ctx.cache.get(aug_key)
                if aug is None:
                    aug = ctx.cache[aug_key] = self.augmentation(ctx.q_pos.device)
            height = self.grid_height
            if height is None:
                height = self.rows_spanned(ctx.q_pos, ctx.k_pos)
            qc, qs = self.cos_sin(ctx.q_pos, height, aug)
            kc, ks = (qc, qs) if ctx.k_pos is ctx.q_pos else self.cos_sin(ctx.k_pos, height, aug)
            got = (ctx.q_pos, ctx.k_pos, qc[:, None], qs[:, None], kc[:, None], ks[:, None])
            ctx.cache[key] = got
        _, _, qc, qs, kc, ks = got
        return self.apply(q, qc, qs), self.apply(k, kc, ks)

    def cache_problem(self, shortest: int, longest: int) -> str | None:
        """Without ``grid_height``, ``H`` is the rows the positions reach: a longer sequence that starts a new row
        changes every row's coordinate, while keys already in a cache keep the rotation they were stored with."""
        if self.grid_height is not None:
            return None

        def rows(n: int) -> int:
            return max(-(-(n - self.n_prefix) // self.grid_width), 1)

        if rows(shortest) == rows(longest):
            return None
        return (
            f"{self.info.name} without grid_height normalises the rows by the rows the positions reach, which go from "
            f"{rows(shortest)} to {rows(longest)} over {shortest} to {longest} tokens, while keys already in a cache "
            "keep the rotation they were stored with"
        )
