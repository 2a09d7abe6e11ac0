r"""Complex-order embeddings (Wang et al. 2020, "Encoding word order in complex embeddings", ICLR).

The paper asks for a word representation that is a *continuous function of
position*, ``f(j, pos) = g_j(pos)``, with two properties: a position-free
offset transformation ``g(pos + k) = T_k(g(pos))`` and boundedness. It proves
(its Theorem 1) that the solutions are, per dimension d,

.. math:: g_{j,d}(pos) = r_{j,d}\, e^{\,i(\omega_{j,d}\,pos + \theta_{j,d})}

with a learned amplitude ``r``, angular frequency ``ω`` and initial phase
``θ`` for every word j and dimension d -- ``3 × vocab × D`` parameters. Moving
by k multiplies by ``e^{iω k}``, a rotation that depends on k only.

Variants (both registered):

* ``complex-order``: the formula above.
* ``complex-vanilla``: the paper's ablation, a complex word embedding whose
  phase does not depend on position, ``r_j e^{iθ_j}`` (ω = 0). It tells the
  gain of complex-valued embeddings apart from the gain of encoding order.

Using it in a real-valued model. The paper feeds the complex embedding to
*complex-valued* networks (a Transformer with complex linear maps, whose real
and imaginary parts are concatenated before the classifier). posenc's models
are real-valued, so :meth:`ComplexOrder.embed` returns ``W [Re f ; Im f]``, a
learned linear map of the real and imaginary parts back to ``d_model``
(``output="project"``, the default), or only ``Re f = r cos(ωpos + θ)``
(``output="real"``). :meth:`ComplexOrder.complex` gives the complex tensor
itself for complex-valued models.

The amplitude ``r_j`` is the model's own token embedding (the ``x`` passed to
``embed``), so the parameter count matches the paper's ``3 × vocab × D``.

Where the authors' repository (FreedomIntelligence/complex-order, Transformer
text classification) differs from the paper, posenc follows the paper:

1. the repository's Transformer has no initial phase θ (only ``r`` and ``ω``);
2. it counts positions backwards (``pos = L-1, ..., 0``);
3. its "vanilla" model is the same code as "order" with a random instead of a
   sinusoidal initialisation of ω -- it still multiplies ω by the position;
4. it initialises ω of every word with the sinusoid's frequencies
   ``10000^{-2⌊d/2⌋/D}``. posenc uses that initialisation for ω (the paper
   does not fix one) and draws θ uniformly from [-π, π).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..base import Card, Cost, PositionalEncoding, as_position_rows, check_positions
from ..errors import ConfigError
from ..registry import register

_OUTPUTS = ("project", "real")


@register
class ComplexOrder(PositionalEncoding):
    r"""Complex-order embedding: word j at position pos is ``r_j e^{i(ω_j pos + θ_j)}``.

    .. math:: f(j, pos)_d = r_{j,d}\, e^{\,i(\omega_{j,d}\, pos + \theta_{j,d})}

    ``embed(x, positions, tokens)`` takes the amplitude ``r = x`` (the token
    embedding) and the token ids, and returns ``W [r cos φ ; r sin φ]`` with
    ``φ = ω_j pos + θ_j`` (see the module docstring for the real-valued use).
    """

    info = Card(
        name="complex-order",
        title="Complex-order embedding",
        paper="Wang et al., Encoding Word Order in Complex Embeddings (ICLR)",
        year=2020,
        family="absolute",
        position="absolute",
        learnable=True,
        summary="Word j at pos is r_j·exp(i(ω_j·pos + θ_j)): per-word learned frequency and phase.",
        reference="the paper's eq. (g(pos+k) = e^{iωk} g(pos)); differences from the authors' code documented",
        shortcoming="3 × vocab × d parameters",
    )
    requires_tokens = True
    position_dependent = True

    def __init__(self, d_model: int, vocab_size: int, output: str = "project"):
        super().__init__()
        if d_model < 1 or vocab_size < 1:
            raise ConfigError(f"d_model and vocab_size must be positive, got {d_model} and {vocab_size}")
        if output not in _OUTPUTS:
            raise ConfigError(f"output must be one of {_OUTPUTS}, got {output!r}")
        self.d_model, self.vocab_size, self.output = d_model, vocab_size, output
        self.theta = nn.Parameter(torch.empty(vocab_size, d_model))
        if self.position_dependent:
            self.omega = nn.Parameter(torch.empty(vocab_size, d_model))
        else:
            self.register_parameter("omega", None)
        self.proj = nn.Linear(2 * d_model, d_model) if output == "project" else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.theta, -math.pi, math.pi)
        if self.omega is not None:
            d = torch.arange(self.d_model, dtype=torch.float64)
            freq = 10000.0 ** (-2 * torch.div(d, 2, rounding_mode="floor") / self.d_model)
            with torch.no_grad():
                self.omega.copy_(freq.float().expand(self.vocab_size, -1))
        if self.proj is not None:
            self.proj.reset_parameters()

    def cost(self, head_dim: int) -> Cost:
        # per token, once per model: φ = ω·pos + θ (2·D, without ω: none), cos and sin (2·D), r·cos, r·sin (2·D);
        # output="project": W [Re; Im] is a (2·D -> D) product, 2·(2·D)·D
        d = self.d_model
        products = 4.0 * d * d if self.proj is not None else 0.0
        return Cost(
            embed=products,
            embed_elementwise=(6.0 if self.omega is not None else 4.0) * d,
            note="r·e^{iφ} per token and dimension, projected back to d_model once per model",
        )

    def phase(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """``φ = ω_j · pos + θ_j``: ``[B, L, D]``."""
        if tokens.dtype not in (torch.int32, torch.int64):
            raise ConfigError(f"tokens must be integer ids, got dtype {tokens.dtype}")
        if not torch.compiler.is_compiling() and tokens.numel() and int(tokens.max()) >= self.vocab_size:
            raise ConfigError(f"token id {int(tokens.max())} is outside the vocabulary of size {self.vocab_size}")
        phi = self.theta[tokens]
        if self.omega is not None:
            phi = phi + self.omega[tokens] * positions[..., None].to(phi.dtype)
        return phi

    def complex(self, amplitude: Tensor, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """The complex embedding ``r e^{iφ}`` ``[B, L, D]`` (complex64), for complex-valued models."""
        rows = as_position_rows(positions, tokens.shape[-1], tokens.device)
        check_positions(rows)
        phi = self.phase(tokens, rows)
        return torch.polar(amplitude.float(), phi.float())

    def embed(self, x: Tensor, positions: Tensor, tokens: Tensor | None = None) -> Tensor:
        if tokens is None:
            raise ConfigError(f"{self.info.name} needs the token ids: call embed(x, positions, tokens=ids)")
        if x.shape[-1] != self.d_model:
            raise ConfigError(f"{self.info.name} was built for d_model={self.d_model}, got width {x.shape[-1]}")
        rows = as_position_rows(positions, x.shape[1])
        check_positions(rows)
        phi = self.phase(tokens, rows)
        re, im = x * torch.cos(phi), x * torch.sin(phi)
        if self.proj is None:
            return re
        return self.proj(torch.cat([re, im], dim=-1))


@register
class ComplexVanilla(ComplexOrder):
    r"""Complex word embedding with a position-free phase (Wang et al. 2020's "Complex-vanilla").

    .. math:: f(j, pos)_d = r_{j,d}\, e^{\,i\theta_{j,d}}

    The paper's ablation: complex-valued, but ω = 0, so it carries no order at
    all (a bidirectional model with it is permutation-equivariant).
    """

    info = Card(
        name="complex-vanilla",
        title="Complex word embedding (no order)",
        paper="Wang et al., Encoding Word Order in Complex Embeddings (ICLR)",
        year=2020,
        family="absolute",
        position="none",
        learnable=True,
        summary="r_j·exp(iθ_j): complex-valued but position-free (the paper's ablation).",
        reference="the paper's definition (ω = 0)",
        shortcoming="no positional information",
    )
    position_dependent = False
