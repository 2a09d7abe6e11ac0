"""Flat patch indices on a grid, for the 2-D rotary encodings that take them (``rope-mixed``, ``rope-dinov3``).

The attention passes one position per token, so a 2-D encoding's positions are flat patch indices in row-major
order, as ``rope-2d``'s: ``t -> (t // W, t % W)`` with ``W = grid_width`` (after ``n_prefix`` leading tokens,
where an encoding has them). Holds the checks of the settings and of the positions, with errors that name the
encoding; no encoding is registered here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError, PositionError


def check_head_dim_2d(name: str, head_dim: int) -> None:
    """A head split between two axes, each with pairs: a positive multiple of 4."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 4:
        near = ""
        if isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim > 0:
            lo, hi = head_dim - head_dim % 4, head_dim - head_dim % 4 + 4
            near = f"; use head_dim={hi}" if lo == 0 else f"; use head_dim={lo} or {hi}"
        raise ConfigError(
            f"{name} splits the rotary pairs between the two axes of the grid, so head_dim must be a positive "
            f"multiple of 4, got {head_dim!r}{near}"
        )


def check_grid(name: str, grid_width: int, grid_height: int | None) -> None:
    """``grid_width`` a positive integer; ``grid_height`` one too, or ``None``."""
    for what, value in (("grid_width", grid_width), ("grid_height", grid_height)):
        if value is None and what == "grid_height":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name}: {what} must be a positive integer (patches per row / column), got {value!r}")


def check_count(name: str, what: str, value: int) -> None:
    """A count of tokens: an integer >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}: {what} must be an integer >= 0, got {value!r}")


def grid_rows_cols(
    name: str, positions: Tensor, grid_width: int, grid_height: int | None = None, n_prefix: int = 0
) -> tuple[Tensor, Tensor]:
    """``(row, col)`` of the patch each position names: ``t = position - n_prefix`` -> ``(t // W, t % W)``.

    Positions must be integers (flat indices); with ``grid_height`` set, none may be past the grid. Positions below
    ``n_prefix`` (the prefix tokens) give a negative ``t``, which the caller treats as it says. The checks that read
    the data are skipped while ``torch.compile`` traces.
    """
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise PositionError(
            f"{name} positions are flat patch indices t = row * {grid_width} + col"
            + (f" (after {n_prefix} prefix tokens)" if n_prefix else "")
            + f" and must be integers (torch.long), got dtype {positions.dtype}"
        )
    if grid_height is not None and positions.numel() and not torch.compiler.is_compiling():
        top = int(positions.max())
        cells = grid_height * grid_width
        if top - n_prefix >= cells:
            raise PositionError(
                f"{name}: position {top} is patch {top - n_prefix}, outside the {grid_height} x {grid_width} grid "
                f"(patches 0..{cells - 1}"
                + (f", at positions {n_prefix}..{n_prefix + cells - 1}" if n_prefix else "")
                + "); build it with a larger grid_height or grid_height=None"
            )
    t = positions - n_prefix if n_prefix else positions
    return torch.div(t, grid_width, rounding_mode="floor"), torch.remainder(t, grid_width)
