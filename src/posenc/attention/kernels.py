"""The names of the kernels an attention call may take (:data:`KERNELS`, :data:`PORTABLE_KERNELS`) and the record
of which one a call took and why (:class:`Plan`). The decision itself is in :mod:`posenc.attention.plan`.

Imports nothing of posenc.
"""

from __future__ import annotations

from dataclasses import dataclass

# the kernels an attention call may take (Plan.kernel), what each computes
KERNELS = {
    "sdpa": "torch's scaled_dot_product_attention (the flash kernel where there is no float mask)",
    "biased-sdpa": "flash forward with the bias as a constant mask; a blocked backward gives the bias its gradient",
    "decode": "posenc.native.decode_attention: one query, one pass over the keys, values and offset tables",
    "block-bias": "posenc.block_bias: flash on row blocks with the encoding's bias evaluated per block, and its "
    "gradient per block (no [H, Lq, Lk] bias or gradient)",
    "offset-bias": "posenc.offset_bias: flash on row blocks, the bias a strided view of its per-offset values; a "
    "blocked backward sums its gradient per offset (no [H, Lq, Lk] bias or gradient)",
    "blocked": "posenc.fused.relative_attention: row-blocked, offset tables skewed in place, no [B, H, Lq, Lk] tensor",
    "own-blocked": "the encoding's own row-blocked attention (blocked_attention; CoPE: its gates, their sums and "
    "interpolated positions per block of query rows, recomputed in the backward; no [B, H, Lq, Lk] tensor)",
    "materialised": "the logits as one [B, H, Lq, Lk] tensor, softmax, then the values (the formula as written)",
    "flex": "torch's flex_attention with a score_mod made from the encoding's fast forms and a block mask "
    "(posenc.attention.flex: no [B, H, Lq, Lk] bias; fused on CUDA and under torch.compile)",
}

#: the kernels of the portable plan: they exist on every device torch runs on (see :func:`~posenc.attention.portable`)
PORTABLE_KERNELS = ("sdpa", "materialised", "flex")

#: the CPU kernels ``torch.compile`` keeps: each is one ``torch.library`` custom op (``posenc::...``, with its fake
#: implementation and its backward a second op), which Dynamo records as it is instead of tracing its row loops
#: (block-bias where the encoding's block function is a :class:`~posenc.block_bias.BlockFunction`: FIRE's;
#: own-blocked for CoPE's ``posenc::cope_attention``, at contiguous positions). The C decode kernel is left out while
#: compiling.
COMPILABLE_KERNELS = ("offset-bias", "biased-sdpa", "blocked", "block-bias", "own-blocked")


@dataclass(frozen=True)
class Plan:
    """Which kernel one attention call takes, and why (:meth:`MultiHeadAttention.plan`).

    Attributes:
        kernel: one of :data:`KERNELS`.
        reason: the rule of :func:`choose_kernel` that picked it, in words.
        contiguous: whether the positions are ``start + arange`` per row with one key-minus-query start (the skew,
            Toeplitz and blocked forms apply) rather than arbitrary (gather forms).
        terms: what the encoding adds to the logits on this call: ``"form"`` (offset tables for the blocked
            kernel), ``"logits"`` and/or ``"bias"`` (tensors), or nothing.
        dropout: the attention dropout applied on this call.
        portable: whether the call was planned without the CPU kernels (a non-CPU device, :func:`portable` forced
            on CPU, or ``torch.compile`` tracing a call whose CPU kernel is not one of :data:`COMPILABLE_KERNELS`):
            the kernel is then one of :data:`PORTABLE_KERNELS`.
        grouped: whether the call kept grouped-query keys as they are (fewer key/value heads than query heads, each
            serving ``H / Hkv`` query heads: the query heads of a group are folded onto its key head, no copy of the
            keys; :meth:`AttentionCore.attend`). ``False`` also where grouped keys were repeated to ``H`` heads.
    """

    kernel: str
    reason: str
    contiguous: bool
    terms: tuple[str, ...] = ()
    dropout: float = 0.0
    portable: bool = False
    grouped: bool = False

    def __str__(self) -> str:
        pos = "contiguous" if self.contiguous else "arbitrary"
        terms = "+".join(self.terms) or "none"
        where = ", portable plan" if self.portable else ""
        where += ", grouped keys folded" if self.grouped else ""
        return f"{self.kernel}: {self.reason} (positions {pos}, terms {terms}, dropout {self.dropout:g}{where})"
