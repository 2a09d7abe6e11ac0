"""Golden fixture: HF transformers 4.57 Transformer-XL relative attention, with memory.

Run with a venv that has transformers==4.57.x (Transformer-XL was removed in 5.x)::

    /work/venv-hf457/bin/python scripts/fixtures_hf457_transfo_xl.py

It builds a tiny one-layer ``TransfoXLModel`` (random weights, fixed seed, float64,
dropout 0) and runs its layer's ``RelPartialLearnableMultiHeadAttn`` on a second
segment whose memory is the first segment, with the positional embedding and
causal mask built as ``TransfoXLModel.forward`` builds them (that forward
itself raises a TypeError in 4.57.6, see below). It records the inputs (``w``,
``r``, the mask, ``mems``), the outputs (layer output and attention
probabilities) and the attention's weights. Cases cover post-norm
(``pre_lnorm=False``, HF's default ``clamp_len=1000``) and pre-norm
(``pre_lnorm=True``, ``clamp_len=3`` so that clamping bites). ``d_head`` is
not ``d_model / n_head``, as HF allows.

Precision: HF's masking casts the scores to float32 and fills them with
``finfo(dtype).min``, which overflows for float64 input ("value cannot be
converted to type float without overflow"), so a causal mask can only be run
in float32. The fixture therefore holds two float32 cases (``qlen=5`` with a
4-token memory and the causal mask; compare at ~1e-5) and two float64 cases
with ``qlen=1`` (one decoding step after a 6-token memory: the mask is empty
and HF skips it; compare at ~1e-10). For the float64 cases HF's
``PositionalEmbedding.inv_freq`` (computed in float32 at build time) is
recomputed in float64 with HF's own formula ``1 / 10000 ** (arange(0, d, 2) / d)``.
Saved to ``tests/fixtures/hf457_transfo_xl.pt``; the test
``tests/test_relative_transformer_xl.py`` loads it (no 4.57 needed at test time).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers.models.deprecated.transfo_xl.configuration_transfo_xl import TransfoXLConfig
from transformers.models.deprecated.transfo_xl.modeling_transfo_xl import TransfoXLModel

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf457_transfo_xl.pt"


def run_case(pre_lnorm: bool, clamp_len: int, seed: int, dtype: torch.dtype, qlen: int, mem_len: int) -> dict:
    torch.manual_seed(seed)
    d_model, n_head, d_head, bsz = 8, 2, 3, 2
    config = TransfoXLConfig(
        vocab_size=16,
        cutoffs=[],
        d_model=d_model,
        d_embed=d_model,
        n_head=n_head,
        d_head=d_head,
        d_inner=16,
        n_layer=1,
        mem_len=mem_len,
        clamp_len=clamp_len,
        pre_lnorm=pre_lnorm,
        dropout=0.0,
        dropatt=0.0,
        untie_r=True,
        div_val=1,
        same_length=False,
    )
    model = TransfoXLModel(config).to(dtype).eval()
    if dtype == torch.float64:
        model.pos_emb.inv_freq = 1 / (10000 ** (torch.arange(0.0, d_model, 2.0, dtype=torch.float64) / d_model))
    attn = model.layers[0].dec_attn
    with torch.no_grad():  # random (not zero) biases and layer norm, so every weight matters
        attn.r_w_bias.normal_(0, 0.5)
        attn.r_r_bias.normal_(0, 0.5)
        attn.layer_norm.weight.normal_(1, 0.2)
        attn.layer_norm.bias.normal_(0, 0.2)

    # TransfoXLModel.forward itself fails in 4.57.6 (``torch.arange(...).type_as(dtype=...)`` raises
    # TypeError), so the two lines of it that feed the attention are repeated here: the positional
    # sequence klen-1 .. 0 clamped at clamp_len, and the causal mask triu(ones, 1 + mlen).
    # The memory is what TransfoXLModel._update_mems keeps of the first segment: the last mem_len
    # inputs of the layer (for one layer: the first segment's embeddings).
    x1 = torch.randn(mem_len, bsz, d_model, dtype=dtype)  # first segment (as long as the memory)
    w = torch.randn(qlen, bsz, d_model, dtype=dtype)  # second segment
    mems = x1[-mem_len:]
    mlen = mems.size(0)
    klen = mlen + qlen
    pos_seq = torch.arange(klen - 1, -1, -1.0, dtype=dtype)
    if clamp_len > 0:
        pos_seq.clamp_(max=clamp_len)
    r = model.pos_emb(pos_seq)  # [klen, 1, d_model]
    attn_mask = torch.triu(w.new_ones((qlen, klen), dtype=torch.bool), diagonal=1 + mlen)[:, :, None]
    with torch.no_grad():
        output, attn_prob = attn(w, r, attn_mask=attn_mask, mems=mems, output_attentions=True)
    seen = dict(w=w, r=r, attn_mask=attn_mask, mems=mems, output=output, attn_prob=attn_prob)
    return {
        "config": dict(d_model=d_model, n_head=n_head, d_head=d_head, pre_lnorm=pre_lnorm, clamp_len=clamp_len),
        "dtype": str(dtype),
        "weights": {k: v.clone() for k, v in attn.state_dict().items()},
        **seen,  # w [qlen, bsz, d], r [klen, 1, d], mems [mlen, bsz, d], output [qlen, bsz, d], attn_prob [q, k, b, n]
    }


def main() -> None:
    fixture = {
        "transformers_version": transformers.__version__,
        "torch_version": str(torch.__version__),
        "cases": [
            run_case(pre_lnorm=False, clamp_len=1000, seed=0, dtype=torch.float32, qlen=5, mem_len=4),
            run_case(pre_lnorm=True, clamp_len=3, seed=1, dtype=torch.float32, qlen=5, mem_len=4),
            run_case(pre_lnorm=False, clamp_len=1000, seed=2, dtype=torch.float64, qlen=1, mem_len=6),
            run_case(pre_lnorm=True, clamp_len=3, seed=3, dtype=torch.float64, qlen=1, mem_len=6),
        ],
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save(fixture, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes) with transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
