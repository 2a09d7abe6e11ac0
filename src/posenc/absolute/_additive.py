"""Shared machinery of the additive absolute encodings: ``x + PE(positions)``."""

from __future__ import annotations

import torch
from torch import Tensor

from ..base import Cost, PositionalEncoding, as_position_rows, check_positions
from ..errors import ConfigError


class AdditiveAbsolute(PositionalEncoding):
    """An encoding that adds a code ``PE(t)`` of width ``d_model`` to the token at position ``t``.

    Subclasses implement :meth:`table` (positions ``[B, L]`` -> codes ``[B, L, D]``).
    Calling the module directly, as the classes of anon., "Positional encoding of the
    Transformer" do, accepts ``(b, l, d)`` and ``(b, h, l, d)`` inputs.
    """

    max_len: int | None = None  # positions 0..max_len-1 are defined (None: all)
    scale_token_embeddings = True  # a fixed unit-amplitude code: tokens at unit RMS too (Vaswani 3.4)
    integer_positions: bool = True

    def table(self, positions: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def cost(self, head_dim: int) -> Cost:
        # x + PE(t): d_model adds per token, once per model (the codes of a fixed encoding are a table lookup)
        d = getattr(self, "d_model", None) or 0
        return Cost(embed_elementwise=float(d), note="x + PE(t): d_model adds per token, once per model")

    def codes(self, positions: Tensor) -> Tensor:
        """The codes of ``positions`` (``[L]`` or ``[B, L]``), validated."""
        rows = as_position_rows(positions, positions.shape[-1])
        check_positions(rows, max_position=self.max_len, integer=self.integer_positions)
        out = self.table(rows)
        return out[0] if positions.dim() == 1 else out

    def matrix(self, length: int) -> Tensor:
        """The code table of positions ``0 .. length-1``: ``[length, D]``."""
        if not isinstance(length, int) or length < 0:
            raise ConfigError(f"length must be >= 0, got {length!r}")
        return self.codes(torch.arange(length, device=self._device()))

    def _device(self) -> torch.device:
        for t in [*self.parameters(), *self.buffers()]:
            return t.device
        return torch.device("cpu")

    def embed(self, x: Tensor, positions: Tensor, tokens: Tensor | None = None) -> Tensor:
        d = getattr(self, "d_model", None)
        if d is not None and x.shape[-1] != d:
            raise ConfigError(f"{self.info.name} was built for d_model={d} but the input has width {x.shape[-1]}")
        rows = as_position_rows(positions, x.shape[1])
        check_positions(rows, max_position=self.max_len, integer=self.integer_positions)
        return x + self.table(rows).to(x.dtype)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """``x + PE``: ``x`` is ``(b, l, d)``, or ``(b, h, l, d)`` whose heads concatenate to ``d``."""
        if x.dim() == 3:
            rows = as_position_rows(positions, x.shape[1], x.device)
            return self.embed(x, rows)
        if x.dim() == 4:
            b, h, n, dh = x.shape
            flat = x.transpose(1, 2).reshape(b, n, h * dh)
            rows = as_position_rows(positions, n, x.device)
            return self.embed(flat, rows).view(b, n, h, dh).transpose(1, 2)
        raise ConfigError(f"expected an input of shape (b, l, d) or (b, h, l, d), got {tuple(x.shape)}")
