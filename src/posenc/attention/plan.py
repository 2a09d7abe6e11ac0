"""Why a call takes the kernel it takes: the facts of the call, named predicates on them, and the table.

:func:`plan_call` reads the facts of one call once (:class:`Facts`), asks the encoding for a fast form only where a
named predicate says one may apply, and hands what it got to :func:`choose_kernel`: the table whose first rule that
holds names the kernel and the reason the :class:`~posenc.attention.kernels.Plan` shows the user. Imports
:mod:`posenc.native`, :mod:`posenc.fused` and :mod:`posenc.block_bias` (kernels) and, of this package, the call and
plan records, the portability switch and :func:`~posenc.attention.blocked.decodable` (what the decode kernel computes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import block_bias, native
from ..errors import ConfigError
from ..fused import RelativeForm
from . import flex as flex_kernel
from .blocked import decodable
from .call import _Call
from .kernels import COMPILABLE_KERNELS, Plan
from .portability import portable_forced


@dataclass(slots=True)
class Facts:
    """What the plan reads about one call and its encoding, each read once (:meth:`of`)."""

    hooks: frozenset[str]  # the encoding's hooks among rotate / logits / bias / values (empty: no encoding)
    encoded: bool  # the call has an encoding
    reference: bool  # path="reference": the formulas as written
    weights: bool  # the probabilities are asked for (return_weights)
    dropout: float  # the attention dropout of this call (0 outside training)
    on_cpu: bool  # the CPU kernels may run: CPU tensors, the portable plan not forced
    compiling: bool  # torch.compile is tracing (only the CPU kernels that are custom ops may run: compilable())
    fused: bool  # AttentionCore.fused: the row-blocked kernel of offset tables is allowed
    grouped: bool  # grouped keys kept as they are (fewer key/value heads than query heads)
    queries: int  # Lq
    many_pairs: bool  # Lq·Lk >= the encoding's fused_min_pairs: the row-blocked kernels pay off
    floats: bool  # float32 or float64 (what the encoding's own CPU kernels and the decode kernel take)
    head_dim: int
    autograd: bool  # gradients are recorded
    qk_grad: bool  # q or k needs a gradient
    learnable: bool  # autograd is on and the encoding has a parameter that needs a gradient (terms not constants)
    reads_scores: bool  # the logits hook reads q·kᵀ itself (logits_read_scores: CoPE)
    causal_mask_only: bool  # no mask, or only the causal one (no padding, documents or custom mask)
    causal: bool = False  # the call is causal (query i sees keys up to its own, padding or documents beside)
    flex_forced: bool = False  # path="flex": flex_attention on any device (tests), or a clear error
    on_cuda: bool = False  # a CUDA device: flex_attention's fused kernels run
    flex_pairs: bool = False  # Lq·Lk >= FLEX_MIN_PAIRS: long enough for flex to pay off over SDPA with a bias

    @classmethod
    def of(
        cls,
        call: _Call,
        enc: Any,
        has: dict[str, bool],
        fused: bool,
        dropout: float,
        weights: bool,
        flex: bool = False,
    ) -> Facts:
        q, k = call.q, call.k
        autograd = torch.is_grad_enabled()
        return cls(
            hooks=frozenset(h for h, on in has.items() if on),
            encoded=enc is not None,
            reference=call.ctx.reference,
            weights=weights,
            dropout=dropout,
            on_cpu=q.device.type == "cpu" and not portable_forced(),
            compiling=torch.compiler.is_compiling(),
            fused=fused,
            grouped=k.shape[1] != q.shape[1],
            queries=q.shape[2],
            many_pairs=enc is not None and q.shape[2] * k.shape[2] >= max(1, enc.fused_min_pairs),
            floats=q.dtype in (torch.float32, torch.float64),
            head_dim=q.shape[-1],
            autograd=autograd,
            qk_grad=q.requires_grad or k.requires_grad,
            # read only with autograd on: a decoding step under no_grad skips the walk over the parameters
            learnable=autograd and enc is not None and any(p.requires_grad for p in enc.parameters()),
            reads_scores=enc is not None and enc.logits_read_scores,
            causal_mask_only=call.allowed is None or (call.causal and not call.any_padding),
            causal=call.causal,
            flex_forced=flex,
            on_cuda=q.device.type == "cuda",
            flex_pairs=q.shape[2] * k.shape[2] >= FLEX_MIN_PAIRS,
        )


#: below this many (query, key) pairs a CUDA call keeps SDPA with the terms as its mask rather than flex_attention
#: (a launch and a score_mod per element cost more than a small dense bias). A guess, not a measurement: no GPU was at
#: hand when it was set; benchmarks/gpu.sh measures the crossing (benchmarks/README.md)
FLEX_MIN_PAIRS = 1024 * 1024


# ---------------------------------------------------------------- the predicates
def rewritable(f: Facts) -> bool:
    """An encoding on ungrouped keys, no literal formula or weights asked for, the CPU kernels allowed: the
    encoding's fast forms may apply (while compiling, only those of a kernel that :func:`compilable` names)."""
    return f.encoded and not f.grouped and not f.reference and not f.weights and f.on_cpu


def compilable(f: Facts, kernel: str) -> bool:
    """Nothing is tracing, or ``kernel`` is a custom op ``torch.compile`` keeps (:data:`COMPILABLE_KERNELS`)."""
    return not f.compiling or kernel in COMPILABLE_KERNELS


def grouped_step(f: Facts) -> bool:
    """One query on grouped keys kept as they are (:meth:`AttentionCore._keeps_groups`): of the form's kernels only
    decode reads them so (query head ``h`` on key head ``h // group``); for any other plan the core repeats them."""
    return f.encoded and f.grouped and f.queries == 1 and not f.reference and not f.weights and f.on_cpu


def form_may_apply(f: Facts) -> bool:
    """The encoding may give its logits as offset tables (relative_form) for the blocked or decode kernel."""
    return (rewritable(f) or grouped_step(f)) and f.fused and "bias" not in f.hooks and compilable(f, "blocked")


def worth_blocking(f: Facts) -> bool:
    """Enough pairs for row blocks to pay off, or dropout (CPU SDPA would materialise it)."""
    return f.encoded and (f.dropout > 0 or f.many_pairs)


def decode_may_apply(f: Facts, enc: Any) -> bool:
    """A decoding step (one query, no gradient) of an encoding that offers a form: the native one-pass kernel."""
    one_step = f.queries == 1 and f.dropout == 0 and f.floats and f.head_dim <= native.DECODE_MAX_HEAD_DIM
    gradient = f.autograd and (f.qk_grad or f.learnable)
    runs = compilable(f, "decode") and native.available()
    return form_may_apply(f) and one_step and not gradient and runs and enc.offers_relative_form()


def own_kernels_may_apply(f: Facts, any_pairs: bool = False) -> bool:
    """What the encoding's own CPU kernels (a bias per offset or per block, CoPE's row blocks) all need: enough pairs
    for them to pay off, unless ``any_pairs`` (a decoding step the encoding runs itself)."""
    return rewritable(f) and "values" not in f.hooks and f.dropout == 0 and f.floats and (any_pairs or f.many_pairs)


def bias_kernels_may_apply(f: Facts) -> bool:
    """A bias alone, and a mask that is at most the causal one: bias_offsets (or bias_blocks) may apply."""
    alone = "bias" in f.hooks and "logits" not in f.hooks
    return own_kernels_may_apply(f) and alone and f.causal_mask_only and compilable(f, "offset-bias")


def own_blocks_may_apply(f: Facts, enc: Any) -> bool:
    """Logits (or weights of its own, stick-breaking's) alone, and the encoding attends by blocks itself
    (blocked_attention): several queries, or one (a decoding step) where the encoding says it runs those too
    (``decodes_itself``), at any number of keys."""
    alone = bool(f.hooks & {"logits", "probabilities"}) and "bias" not in f.hooks
    step = f.queries == 1 and getattr(enc, "decodes_itself", False)
    traced = compilable(f, "own-blocked")
    fits = own_kernels_may_apply(f, any_pairs=step) and (step or f.queries > 1)
    order = f.causal or not getattr(enc, "blocks_causal_only", False)  # stick-breaking: an encoder takes its weights
    return fits and alone and traced and order and hasattr(enc, "blocked_attention")


def scores_once(f: Facts) -> bool:
    """One query whose logits hook reads ``q·kᵀ``: the materialised kernel computes it once for both."""
    return f.reads_scores and "logits" in f.hooks and f.queries == 1 and not f.compiling


def flex_may_apply(f: Facts) -> bool:
    """flex_attention may run: asked for (``path="flex"``), or a CUDA call with an encoding's terms and enough pairs;
    no weights asked for, no dropout (flex has none), not the literal formula, one key head per query head."""
    wanted = f.flex_forced or (f.on_cuda and f.encoded and bool(f.hooks - {"rotate"}) and f.flex_pairs)
    return wanted and not f.reference and not f.weights and f.dropout == 0 and not f.grouped


def plan_call(f: Facts, enc: Any, call: _Call, scale: float | None = None) -> tuple[Plan, RelativeForm | None, Any]:
    """Ask the encoding for the fast forms the predicates allow, then :func:`choose_kernel`.

    Returns the plan, the encoding's offset-table form (``relative_form``) and the input of its own kernel (its
    bias per offset, ``bias_offsets``, or per block, ``bias_blocks``, or its ``blocked_attention``; for ``flex``,
    its :class:`~posenc.attention.flex.FlexForm`), each ``None`` unless the plan uses it. ``scale``: the call's
    temperature (the flex form folds it into its per-query tables)."""
    if flex_may_apply(f):
        got = flex_kernel.flex_form(enc, call, scale if scale is not None else call.q.shape[-1] ** -0.5)
        if got is not None:
            what = got.source if got.score_mod is not None else "no encoding terms to add"
            reason = f"flex_attention with {what}" + (
                " (path='flex')" if f.flex_forced else " (CUDA, long enough to pay off)"
            )
            terms = () if got.score_mod is None else ("score_mod",)
            return Plan("flex", reason, call.ctx.contiguous, terms, f.dropout, not f.on_cpu, f.grouped), None, got
        if f.flex_forced:
            raise ConfigError(f"path='flex': {flex_kernel.why_not(enc, call)}; take path='auto' for this encoding")
    elif f.flex_forced:
        why = "return_weights needs the probabilities" if f.weights else (
            "attention dropout (flex_attention has none)" if f.dropout else
            "grouped keys (one key head per query head)" if f.grouped else "path='reference'"
        )
        raise ConfigError(f"path='flex' cannot run this call: {why}")
    form = offsets = blocks = own = None
    wants_decode = decode_may_apply(f, enc)
    blocks_rows = worth_blocking(f) and not f.grouped  # the blocked kernel takes one key head per query head
    if form_may_apply(f) and (blocks_rows or wants_decode):
        form = enc.relative_form(call.q, call.k, call.ctx)
    decode = wants_decode and form is not None and decodable(form)
    if form is not None and not decode and not blocks_rows:
        form = None  # asked for the decode kernel only, and it does not fit: the hooks as usual
    if bias_kernels_may_apply(f):
        offsets = enc.bias_offsets(call.ctx)
        blocks = enc.bias_blocks(call.ctx) if offsets is None and compilable(f, "block-bias") else None
        if blocks is not None and f.compiling and not block_bias.compilable(blocks[0]):
            blocks = None  # a plain block function: an autograd.Function, which tracing cannot keep
    if own_blocks_may_apply(f, enc):
        own = enc.blocked_attention(call.ctx)
    has_logits = "logits" in f.hooks and form is None
    has_bias = "bias" in f.hooks
    kernel, reason = choose_kernel(
        reference=f.reference,
        return_weights=f.weights,
        has_form=form is not None,
        one_query=decode,
        scores_once=scores_once(f),
        has_offsets=offsets is not None,
        has_blocks=blocks is not None,
        has_own=own is not None,
        needs_values="values" in f.hooks and form is None,
        has_terms=has_logits or has_bias,
        learned_bias=f.autograd and ((has_bias and f.learnable) or (has_logits and (f.learnable or f.qk_grad))),
        dropout=f.dropout,
        on_cpu=f.on_cpu,
        compiling=f.compiling,
    )
    terms = tuple(t for t, on in (("form", form is not None), ("logits", has_logits), ("bias", has_bias)) if on)
    portable = not f.on_cpu or not compilable(f, kernel)  # while compiling, sdpa and materialised are portable
    plan = Plan(kernel, reason, call.ctx.contiguous, terms, f.dropout, portable, f.grouped)
    return plan, form, offsets if offsets is not None else blocks if blocks is not None else own


def choose_kernel(
    *,
    reference: bool,
    return_weights: bool,
    has_form: bool,
    one_query: bool = False,
    scores_once: bool = False,
    has_offsets: bool = False,
    has_blocks: bool = False,
    has_own: bool = False,
    needs_values: bool,
    has_terms: bool,
    learned_bias: bool,
    dropout: float,
    on_cpu: bool,
    compiling: bool,
) -> tuple[str, str]:
    """The one place that picks a kernel: the first rule that holds, top to bottom.

    ``on_cpu`` says whether the CPU kernels may run: the tensors are on CPU and the portable plan is not forced
    (:func:`portable`). They are the CPU flash op (biased-sdpa, offset-bias, block-bias and SDPA's causal call
    with a bias), the C code of :mod:`posenc.native` (decode) and the row loops of the blocked kernels, which
    would launch one small kernel per block on a GPU. Without them (``on_cpu=False``: CUDA, MPS, XPU, ...)
    a call takes SDPA or the materialised formula, both of which exist on every device (:data:`PORTABLE_KERNELS`).

    ================================================  ==============  ==================================
    condition                                         kernel          why
    ================================================  ==============  ==================================
    ``path="reference"`` or ``return_weights``        materialised    the formula as written / the weights
    ``path="flex"``, or CUDA and >= FLEX_MIN_PAIRS   flex            a score_mod from the encoding's forms (2)
    one query, no gradient, a form that fits it (1)   decode          keys, values, tables read once
    the encoding's own row-blocked attention (1)      own-blocked     no ``[B, H, L, L]`` tensor (CoPE)
    one query whose logits read ``q·kᵀ`` (CoPE)        materialised    ``q·kᵀ`` computed once, shared
    an offset-table form (relative encodings) (1)     blocked         no ``L × L`` or ``L × L × d`` tensor
    a bias given per offset (no dropout, no pad) (1)  offset-bias     no ``[H, L, L]`` bias or gradient
    a bias given per block of rows (the same) (1)     block-bias      no ``[H, L, L]`` bias or gradient
    a ``values`` hook without a form                  materialised    a^V needs the probabilities
    dropout (1)                                       blocked         CPU SDPA has no fused dropout
    a learned bias (1)                                biased-sdpa     flash forward, blocked backward
    the encoding's logits or bias as tensors          sdpa            SDPA with the terms as its mask
    anything else                                     sdpa            SDPA's own kernel (flash)
    ================================================  ==============  ==================================

    (1) CPU kernels only (``on_cpu``). Elsewhere the rule is skipped and a later one holds: a relative encoding's
    hooks give their logits (and a^V) as tensors, so it takes ``sdpa`` with them as the additive mask, or
    ``materialised`` for a^V; a bias per offset or per block is laid out as a tensor for ``sdpa``; dropout is SDPA's
    own (fused on GPUs); a learned bias gets its gradient from SDPA's backward (the memory-efficient kernel on
    CUDA). While ``torch.compile`` traces, a CPU kernel runs only if it is a custom op that the compiler keeps
    as one node (:data:`~posenc.attention.kernels.COMPILABLE_KERNELS`); the others' rules are skipped as in (1).
    (2) Decided in :func:`plan_call` before this table (:func:`flex_may_apply`): no weights, no dropout, one key
    head per query head, and an encoding whose terms have a flex form (:func:`posenc.attention.flex.flex_form`: a
    bias per offset, offset tables, or its own ``flex_score``); ``path="flex"`` without one is a clear error that
    says why (a values term, CoPE's gates ...). On a CPU flex runs forward only; the CPU tests check that forward
    against the reference path, and ``benchmarks/gpu.sh`` the backward on CUDA.
    """

    def cpu(kernel: str) -> bool:  # the CPU kernel may run: on CPU, and not tracing unless it is a custom op
        return on_cpu and (not compiling or kernel in COMPILABLE_KERNELS)

    if reference:
        return "materialised", "path='reference' follows the formulas literally"
    if return_weights:
        return "materialised", "return_weights needs the probabilities"
    if one_query and cpu("decode"):
        return "decode", "one query (a decoding step): one pass over the keys with the offset tables (native)"
    if has_own and cpu("own-blocked"):
        return "own-blocked", "the encoding attends one block of query rows at a time (blocked_attention)"
    if scores_once:
        return "materialised", "one query whose logits read q·kᵀ: computed once and handed to them (ctx.scores)"
    if has_form and cpu("blocked"):
        return "blocked", "the encoding gave its logits as offset tables (relative_form)"
    if has_offsets and cpu("offset-bias"):
        return "offset-bias", "the encoding gave its bias per offset (bias_offsets)"
    if has_blocks and cpu("block-bias"):
        return "block-bias", "the encoding evaluates its bias per block of query rows (bias_blocks)"
    if needs_values:
        return "materialised", (
            "a values hook needs the probabilities (no offset-table form on this call: none offered, "
            "fewer pairs than fused_min_pairs, or positions not start + arange)"
        )
    if dropout and cpu("blocked"):
        return "blocked", "attention dropout on CPU (SDPA's CPU kernels would materialise it)"
    if learned_bias and cpu("biased-sdpa"):
        return "biased-sdpa", "a bias with a gradient (SDPA's math path would keep [B, H, Lq, Lk] tensors)"
    if has_terms:
        if not on_cpu:
            return "sdpa", "the encoding's terms as SDPA's additive mask (portable: no CPU kernels on this call)"
        return "sdpa", "the encoding's terms as SDPA's additive mask"
    return "sdpa", "no extra terms: SDPA's own kernel"
