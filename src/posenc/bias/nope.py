r"""NoPE: no positional encoding in a causal decoder (Kazemnejad et al. 2023).

A decoder-only Transformer with *no* position encoding at all still knows
order: the causal mask lets token ``t`` attend to ``t`` tokens, so, e.g., a
head that attends uniformly to its prefix outputs ``(1/t) Σ_{j<=t} v_j``, from
which the position ``t`` can be recovered (Kazemnejad et al., Theorem 1: the
first layer can recover absolute positions; Theorem 2: later layers can then
implement relative encodings). They report NoPE extrapolating better than
ALiBi, RoPE and T5's bias on small algorithmic tasks.

This is the same computation as ``none`` -- the attention is untouched:

.. math:: A_{ij} = q_i \cdot k_j / \sqrt{d} \quad (j \le i)

-- registered as a first-class choice so that "no encoding *in a decoder*" is a
named method. In a bidirectional encoder it is exactly ``none``: the model is
permutation-equivariant and order is invisible.
"""

from __future__ import annotations

from ..base import Card, NoPositionalEncoding
from ..registry import register


@register
class NoPE(NoPositionalEncoding):
    r"""NoPE: nothing added; in a causal decoder the causal mask leaks the order.

    .. math:: A_{ij} = q_i \cdot k_j / \sqrt{d_h}, \quad \text{masked for } j > i

    ``position="none"``: no hook carries position. The order information comes
    only from the causal mask (``Transformer(causal=True)``); use it with a
    decoder. With ``causal=False`` it is ``none`` and cannot see order.
    """

    info = Card(
        name="nope",
        title="NoPE (no positional encoding, causal decoder)",
        paper="Kazemnejad et al., The Impact of Positional Encoding on Length Generalization in Transformers",
        year=2023,
        family="none",
        position="none",
        learnable=False,
        summary="No encoding; a causal decoder still infers order through the causal mask.",
        reference="property tests: order-dependent in a causal decoder, permutation-equivariant without the mask",
        shortcoming="needs a causal mask: a bidirectional encoder with NoPE cannot see order",
    )
