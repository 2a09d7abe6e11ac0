"""Multi-head attention that composes an encoding's hooks and knows no paper by name.

    q, k      = rotate(x W_q, h W_k)                                  (rotary hook)
    A         = scale · (q kᵀ + logits(q, k)) + bias + mask           (logits / bias / scale hooks)
    z         = softmax(A) v + values(softmax(A))                     (values hook)

Two paths give the same numbers:

* the *reference* path materialises ``A`` exactly as written above, and hooks
  are asked to follow their paper literally (``ctx.reference = True``);
* the *fast* path hands ``A``'s extra terms to
  :func:`torch.nn.functional.scaled_dot_product_attention` as an additive mask
  (or no mask at all for rotary encodings), and hooks may use their
  O(L·d)-memory forms (skewing, gathers). An encoding with a ``values`` hook
  needs the probabilities, so it runs softmax itself but still with the fast
  hooks.

On CPU, an encoding that describes its logits (and values) as offset tables
(:meth:`~posenc.base.PositionalEncoding.relative_form`: Shaw, NEZHA, BERT
relative_key(_query), Transformer-XL, XLNet, TENER, DeBERTa) goes to
:func:`posenc.fused.relative_attention` instead, which computes the same numbers
one block of query rows at a time and never holds a ``[B, H, Lq, Lk]`` tensor.
An encoding whose bias depends on the offset alone and gives it per offset
(:meth:`~posenc.base.PositionalEncoding.bias_offsets`: T5, KERPLE, dynamic position
bias) goes to :func:`posenc.offset_bias.offset_bias_attention`, which never makes
the ``[H, Lq, Lk]`` bias or its gradient; one that evaluates its bias per block of query rows
(:meth:`~posenc.base.PositionalEncoding.bias_blocks`: FIRE) goes to
:func:`posenc.block_bias.block_bias_attention`. A decoding step (one query, no gradient) of an encoding with such a
form goes to :func:`posenc.native.decode_attention`: one pass over the keys, the values and the offset tables.

Those CPU kernels (the CPU flash op, the C code of :mod:`posenc.native`, the row loops of the blocked, offset-bias
and block-bias kernels) run only on CPU. On any other device (CUDA, MPS, XPU, ...) the plan is the *portable*
one: every call takes :func:`~torch.nn.functional.scaled_dot_product_attention` (the encoding's terms as its
additive mask) or the materialised formula, which exist wherever torch runs; see :func:`choose_kernel`. The
portable plan can be forced on CPU (``with posenc.attention.portable():`` or ``POSENC_PORTABLE=1``) to test
what another device would compute.
While ``torch.compile`` traces, the CPU kernels that are ``torch.library`` custom ops (``offset-bias``,
``biased-sdpa``, ``blocked``: one node of the graph each, forward and backward, for every length) still run; the
others give way as they do on another device.

The package, one idea a file (each imports only from the files above it in this list, and from below the
attention layer: :mod:`posenc.base`, :mod:`posenc.errors` and the kernels :mod:`posenc.native`, :mod:`posenc.fused`,
:mod:`posenc.block_bias`, :mod:`posenc.offset_bias`, and :mod:`posenc.ops`, which registers a kernel as a
``torch.library`` custom op):

* ``kernels``: the kernels' names (:data:`KERNELS`, :data:`PORTABLE_KERNELS`, and ``COMPILABLE_KERNELS``: those
  ``torch.compile`` keeps, each a custom op) and the :class:`Plan` record;
  ``portability``: :func:`portable`; ``checks``: the argument checks; ``masks``: :func:`build_mask`;
  ``cache``: :class:`KVCache`; ``call``: the record one call's steps hand each other, and :func:`repeat_kv`;
* one file per kernel family: ``sdpa`` (sdpa, biased-sdpa), ``blocked`` (blocked, decode), ``own`` (offset-bias,
  block-bias, own-blocked), ``materialised``;
* ``plan``: why a call takes its kernel: the facts of the call, named predicates, and :func:`choose_kernel`;
* ``core``: :class:`AttentionCore` (the plan and the kernels after the projections); ``multihead``:
  :class:`MultiHeadAttention` (projections, positions, KV cache and mask in front of the core).
"""

from __future__ import annotations

from .cache import KVCache
from .call import _Call as _Call
from .call import repeat_kv
from .checks import check_groups, check_int, check_probability
from .core import PATHS, AttentionCore
from .kernels import KERNELS, PORTABLE_KERNELS, Plan
from .masks import build_mask
from .multihead import MultiHeadAttention
from .plan import choose_kernel
from .portability import portable, portable_forced
from .sdpa import _BiasedSDPA as _BiasedSDPA

__all__ = [
    "KERNELS",
    "PATHS",
    "PORTABLE_KERNELS",
    "AttentionCore",
    "KVCache",
    "MultiHeadAttention",
    "Plan",
    "build_mask",
    "check_groups",
    "check_int",
    "check_probability",
    "choose_kernel",
    "portable",
    "portable_forced",
    "repeat_kv",
]
