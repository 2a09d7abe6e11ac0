#!/usr/bin/env python
"""Speed and memory of one attention layer: every posenc encoding beside its peers and the floor.

One *case* is one attention layer (projections included) run on ``x [B, L, D]``:

* ``floor``                 plain SDPA with q/k/v/o projections and no position at all;
* ``posenc:<name>``         :class:`posenc.attention.MultiHeadAttention` with that encoding (``path="fast"``);
* ``posenc-compiled:<name>`` the same, wrapped in ``torch.compile(fullgraph=True)``;
* ``peer:<id>``             the peer implementation of the same method (HF transformers 5.x, HF 4.57 in its own
                            environment, x-transformers, rotary-embedding-torch);
* ``apply:<id>``            RoPE *application* alone on q and k (``apply:copy`` clones q and k once: the
                            memory-bandwidth floor).

Every (case, L, round) runs in a fresh process (so one case's allocator state never leaks into the next), with
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` set (see the README) and ``torch.set_num_threads``.
Inside the process: one profiled forward+backward and one profiled forward (warm-ups that also give the
allocator peak from ``torch.profiler(profile_memory=True)``), one plain warm-up each, then ``repeats``
alternating forward / forward+backward timings; the record keeps the medians, the min/max, the process's CPU
utilisation during the timed loop and the load average (other work on the machine inflates timings).

Usage (from the repository root)::

    .venv/bin/python benchmarks/bench_attention.py run --lengths 256 512 1024 2048 --rounds 2
    .venv/bin/python benchmarks/bench_attention.py run --quick            # L=256,1024; one round
    .venv/bin/python benchmarks/bench_attention.py run --cases posenc:rope peer:hf-llama floor --lengths 2048
    .venv/bin/python benchmarks/bench_attention.py report                 # tables + plots from the JSON

Results accumulate in ``benchmarks/results/<tag>.json`` (``--tag``, default ``cpu-fp32``); a (case, L, round)
already there is skipped unless ``--force``, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
MAIN_PY = sys.executable
HF457_PY = os.environ.get("POSENC_HF457_PYTHON", "/work/venv-hf457/bin/python")
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "4294967296"}

B, H, DH = 4, 8, 64
D = H * DH

# posenc encodings benchmarked by default: one per distinct attention cost (randomized-* add only a
# position sampler in the model, rope-* scalings only change the frequency table; run them with --all)
DEFAULT_ENCODINGS = [
    "none",
    "sinusoidal",
    "learned",
    "rope",
    "rope-interleaved",
    "rope-yarn",
    "xpos",
    "alibi",
    "t5",
    "kerple-log",
    "kerple-power",
    "fire",
    "dynamic-bias",
    "relative-bias",
    "cope",
    "shaw",
    "relative-key",
    "relative-key-query",
    "nezha",
    "transformer-xl",
    "xlnet",
    "tener",
    "deberta",
    "contextual-1",
    "contextual-2",
]

# posenc encoding -> the peers implementing the same method
PEERS: dict[str, list[str]] = {
    "rope": ["hf-llama", "xt-rotary", "ret-rotary"],
    "rope-interleaved": ["hf-roformer", "xt-rotary", "ret-rotary"],
    "xpos": ["xt-xpos", "ret-xpos"],
    "alibi": ["xt-alibi"],
    "alibi-bidirectional": ["xt-alibi"],
    "t5": ["hf-t5", "xt-t5"],
    "dynamic-bias": ["xt-dynamic"],
    "deberta": ["hf-deberta"],
    "xlnet": ["hf-xlnet"],
    "relative-key": ["hf457-bert-relative_key"],
    "relative-key-query": ["hf457-bert-relative_key_query"],
    "nezha": ["hf457-nezha"],
    "transformer-xl": ["hf457-transfo-xl"],
}
PEER_NOTES = {
    "hf-llama": "transformers 5.x LlamaAttention (sdpa, bidirectional) + LlamaRotaryEmbedding, rotate-half",
    "hf-roformer": "transformers 5.x RoFormerAttention (eager: materialises L×L scores) + sinusoidal table",
    "xt-rotary": "x-transformers Attention(flash=True) + RotaryEmbedding (interleaved pairs)",
    "ret-rotary": "rotary-embedding-torch RotaryEmbedding (interleaved) + SDPA",
    "xt-xpos": "x-transformers RotaryEmbedding(use_xpos=True)",
    "ret-xpos": "rotary-embedding-torch RotaryEmbedding(use_xpos=True) + SDPA",
    "xt-alibi": "x-transformers AlibiPositionalBias (symmetric |i-j| when not causal)",
    "hf-t5": "transformers 5.x T5Attention(has_relative_attention_bias=True), sdpa",
    "xt-t5": "x-transformers RelativePositionBias (T5 buckets)",
    "xt-dynamic": "x-transformers DynamicPositionBias (depth 2, log distance)",
    "hf-deberta": "transformers 5.x DebertaV2Attention (c2p+p2c, position_buckets 256) + rel. embeddings/LayerNorm",
    "hf-xlnet": "transformers 5.x XLNetRelativeAttention (includes post-attention residual+LayerNorm)",
    "hf457-bert-relative_key": "transformers 4.57 BertAttention(relative_key), eager",
    "hf457-bert-relative_key_query": "transformers 4.57 BertAttention(relative_key_query), eager",
    "hf457-nezha": "transformers 4.57 NezhaAttention (max_relative_position 64), eager",
    "hf457-transfo-xl": "transformers 4.57 RelPartialLearnableMultiHeadAttn (includes residual+LayerNorm)",
}
APPLY_CASES = [
    "apply:copy",
    "apply:posenc-rope",
    "apply:posenc-rope-interleaved",
    "apply:hf-llama",
    "apply:ret",
    "apply:xt",
]

# RoPE application alone takes milliseconds: at least this many timed calls (median)
APPLY_REPEATS = 50

# settings shared by posenc and its peer so that both compute the same thing
ENC_OPTIONS: dict[str, dict] = {
    "deberta": {"max_len": 512, "position_buckets": 256},
    "nezha": {"max_relative_position": 64},
    "dynamic-bias": {"log_distance": True, "depth": 2},
    "rope-yarn": {"factor": 4.0, "original_max_len": 512},
    "rope-linear": {"factor": 4.0},
    "rope-ntk": {"factor": 4.0},
    "rope-dynamic": {"factor": 4.0, "original_max_len": 512},
    "rope-llama3": {"factor": 8.0, "original_max_len": 512},
    "rope-longrope": {"short_factor": [1.0] * 32, "long_factor": [4.0] * 32, "original_max_len": 512, "factor": 4.0},
}

# peers known not to fit in memory at a length (L x L x d tensors): skipped, recorded as such
TOO_BIG = {
    "hf457-bert-relative_key": 4096,
    "hf457-bert-relative_key_query": 4096,
    "hf457-nezha": 4096,
    "hf-deberta": 4096,
    "hf-roformer": 99999,  # never: listed only so that the mechanism is visible; RoFormer fits
}
TOO_BIG.pop("hf-roformer")


# ============================================================================ the worker (one fresh process)
def _floor_module():
    import torch.nn.functional as F
    from torch import nn

    class Floor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = (p(x).view(b, n, H, DH).transpose(1, 2) for p in (self.q, self.k, self.v))
            out = F.scaled_dot_product_attention(q, k, v)
            return self.o(out.transpose(1, 2).reshape(b, n, D))

    return Floor()


def _posenc_module(name: str, L: int):
    from torch import nn

    import posenc  # noqa: F401  (registers the encodings)
    from posenc.attention import MultiHeadAttention
    from posenc.registry import build

    dims = dict(d_model=D, n_heads=H, head_dim=DH, max_len=max(L, 512), n_layers=1, causal=False, vocab_size=1000)
    opts = dict(ENC_OPTIONS.get(name, {}))
    if name in ("relative-key", "relative-key-query"):
        opts["max_len"] = L  # HF's max_position_embeddings = L (its table has 2L - 1 rows)
    enc = build(name, dims=dims, options=opts)
    attn = MultiHeadAttention(D, H, enc, path="fast")
    uses_embed = "embed" in enc.hooks()

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attn

        def forward(self, x):
            if uses_embed:
                import torch

                pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
                x = enc.embed(x, pos)
            return self.attn(x)

    return Layer()


def _peer_module(pid: str, L: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    if pid == "hf-llama":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

        cfg = LlamaConfig(
            hidden_size=D,
            num_attention_heads=H,
            num_key_value_heads=H,
            head_dim=DH,
            max_position_embeddings=L,
            attention_bias=True,
        )
        cfg._attn_implementation = "sdpa"
        att, rot = LlamaAttention(cfg, layer_idx=0), LlamaRotaryEmbedding(cfg)
        att.is_causal = False

        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.att, self.rot = att, rot

            def forward(self, x):
                pos = torch.arange(x.shape[1])[None]
                return self.att(x, position_embeddings=self.rot(x, pos), attention_mask=None)[0]

        return M()
    if pid == "hf-roformer":
        from transformers import RoFormerConfig
        from transformers.models.roformer.modeling_roformer import (
            RoFormerAttention,
            RoFormerSinusoidalPositionalEmbedding,
        )

        cfg = RoFormerConfig(hidden_size=D, num_attention_heads=H, max_position_embeddings=L, embedding_size=D)
        cfg._attn_implementation = "eager"
        att = RoFormerAttention(cfg)
        table = RoFormerSinusoidalPositionalEmbedding(L, DH)

        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.att, self.table = att, table

            def forward(self, x):
                sp = self.table(x.shape[:-1])[None, None]
                return self.att(x, sinusoidal_pos=sp)[0]

        return M()
    if pid in ("xt-rotary", "xt-xpos", "xt-alibi", "xt-t5", "xt-dynamic"):
        from x_transformers.x_transformers import (
            AlibiPositionalBias,
            Attention,
            DynamicPositionBias,
            RelativePositionBias,
            RotaryEmbedding,
        )

        att = Attention(dim=D, heads=H, dim_head=DH, flash=True)
        rot = rel = None
        if pid == "xt-rotary":
            rot = RotaryEmbedding(DH)
        elif pid == "xt-xpos":
            rot = RotaryEmbedding(DH, use_xpos=True)
        elif pid == "xt-alibi":
            rel = AlibiPositionalBias(heads=H, total_heads=H)
        elif pid == "xt-t5":
            rel = RelativePositionBias(scale=DH**0.5, causal=False, num_buckets=32, max_distance=128, heads=H)
        else:
            rel = DynamicPositionBias(dim=D // 4, heads=H, depth=2, log_distance=True, norm=False)

        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.att, self.rot, self.rel = att, rot, rel

            def forward(self, x):
                kw = {}
                if self.rot is not None:
                    kw["rotary_pos_emb"] = self.rot.forward_from_seq_len(x.shape[1])
                if self.rel is not None:
                    kw["rel_pos"] = self.rel
                return self.att(x, **kw)

        return M()
    if pid in ("ret-rotary", "ret-xpos"):
        from rotary_embedding_torch import RotaryEmbedding

        xpos = pid == "ret-xpos"
        rot = RotaryEmbedding(dim=DH, use_xpos=xpos)

        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.rot = rot
                self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

            def forward(self, x):
                b, n, _ = x.shape
                q, k, v = (p(x).view(b, n, H, DH).transpose(1, 2) for p in (self.q, self.k, self.v))
                if xpos:
                    q, k = self.rot.rotate_queries_and_keys(q, k)
                else:
                    q, k = self.rot.rotate_queries_or_keys(q), self.rot.rotate_queries_or_keys(k)
                out = F.scaled_dot_product_attention(q, k, v)
                return self.o(out.transpose(1, 2).reshape(b, n, D))

        return M()
    if pid == "hf-t5":
        from transformers import T5Config
        from transformers.models.t5.modeling_t5 import T5Attention

        cfg = T5Config(d_model=D, d_kv=DH, num_heads=H, relative_attention_num_buckets=32, is_decoder=False)
        cfg._attn_implementation = "sdpa"
        att = T5Attention(cfg, has_relative_attention_bias=True)

        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.att = att

            def forward(self, x):
                return self.att(x)[0]

        return M()
    if pid == "hf-deberta":
        from transformers import DebertaV2Config
        from transformers.models.deberta_v2.modeling_deberta_v2 import DebertaV2Attention, DebertaV2Encoder

        cfg = DebertaV2Config(
            hidden_size=D,
            num_attention_heads=H,
            num_hidden_layers=0,
            relative_attention=True,
            position_buckets=256,
            max_position_embeddings=512,
            pos_att_type=["p2c", "c2p"],
            share_att_key=True,
            norm_rel_ebd="layer_norm",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        cfg._attn_implementation = "eager"
        enc, att = DebertaV2Encoder(cfg), DebertaV2Attention(cfg)

        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.enc, self.att = enc, att

            def forward(self, x):
                mask = self.enc.get_attention_mask(torch.ones(x.shape[:2], dtype=torch.long))
                rel = self.enc.get_rel_pos(x)
                return self.att(x, mask, relative_pos=rel, rel_embeddings=self.enc.get_rel_embedding())[0]

        return M()
    if pid == "hf-xlnet":
        from transformers import XLNetConfig
        from transformers.models.xlnet.modeling_xlnet import XLNetRelativeAttention

        cfg = XLNetConfig(d_model=D, n_head=H, d_head=DH, dropout=0.0)
        att = XLNetRelativeAttention(cfg)
        inv_freq = 1 / torch.pow(10000, torch.arange(0, D, 2.0) / D)

        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.att = att

            def forward(self, x):
                n, b = x.shape[1], x.shape[0]
                pos = torch.arange(n, -n, -1.0)[:, None] * inv_freq
                r = torch.cat([pos.sin(), pos.cos()], -1)[:, None, :].expand(-1, b, -1)
                h = x.transpose(0, 1)
                return self.att(h, None, None, None, r, None)[0].transpose(0, 1)

        return M()
    if pid.startswith("hf457-bert-"):
        from transformers import BertConfig
        from transformers.models.bert.modeling_bert import BertAttention

        kind = pid[len("hf457-bert-") :]
        cfg = BertConfig(
            hidden_size=D,
            num_attention_heads=H,
            max_position_embeddings=L,
            position_embedding_type=kind,
            attention_probs_dropout_prob=0.0,
            hidden_dropout_prob=0.0,
        )
        cfg._attn_implementation = "eager"
        att = BertAttention(cfg, position_embedding_type=kind)

        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.att = att

            def forward(self, x):
                return self.att(x)[0]

        return M()
    if pid == "hf457-nezha":
        from transformers.models.deprecated.nezha.configuration_nezha import NezhaConfig
        from transformers.models.deprecated.nezha.modeling_nezha import NezhaAttention

        cfg = NezhaConfig(
            hidden_size=D,
            num_attention_heads=H,
            max_relative_position=64,
            max_position_embeddings=max(L, 512),
            attention_probs_dropout_prob=0.0,
            hidden_dropout_prob=0.0,
        )
        att = NezhaAttention(cfg)

        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.att = att

            def forward(self, x):
                return self.att(x)[0]

        return M()
    if pid == "hf457-transfo-xl":
        from transformers.models.deprecated.transfo_xl.modeling_transfo_xl import (
            PositionalEmbedding,
            RelPartialLearnableMultiHeadAttn,
        )

        att = RelPartialLearnableMultiHeadAttn(H, D, DH, 0.0)
        pe = PositionalEmbedding(D)

        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.att, self.pe = att, pe

            def forward(self, x):
                n = x.shape[1]
                r = self.pe(torch.arange(n - 1, -1, -1.0))
                return self.att(x.transpose(0, 1), r)[0].transpose(0, 1)

        return M()
    raise SystemExit(f"unknown peer {pid!r}")


def _apply_fn(cid: str, L: int):
    """RoPE application alone: returns (fn, inputs) with fn(q, k) -> (q', k')."""
    import torch

    q = torch.randn(B, H, L, DH)
    k = torch.randn(B, H, L, DH)
    which = cid.split(":", 1)[1]
    if which == "copy":
        return (lambda q, k: (q.clone(), k.clone())), (q, k)
    if which.startswith("posenc-"):
        import posenc  # noqa: F401
        from posenc.base import AttentionContext
        from posenc.registry import get

        enc = get(which[len("posenc-") :], head_dim=DH)
        pos = torch.arange(L)[None]

        def fn(q, k):
            ctx = AttentionContext(q_pos=pos, k_pos=pos, n_heads=H, head_dim=DH)
            return enc.rotate(q, k, ctx)

        return fn, (q, k)
    if which == "hf-llama":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

        cfg = LlamaConfig(hidden_size=D, num_attention_heads=H, head_dim=DH, max_position_embeddings=L)
        cos, sin = LlamaRotaryEmbedding(cfg)(q, torch.arange(L)[None])
        return (lambda q, k: apply_rotary_pos_emb(q, k, cos, sin)), (q, k)
    if which == "ret":
        from rotary_embedding_torch import RotaryEmbedding

        rot = RotaryEmbedding(dim=DH)
        return (lambda q, k: (rot.rotate_queries_or_keys(q), rot.rotate_queries_or_keys(k))), (q, k)
    if which == "xt":
        from x_transformers.x_transformers import RotaryEmbedding, apply_rotary_pos_emb

        freqs, _ = RotaryEmbedding(DH).forward_from_seq_len(L)
        return (lambda q, k: (apply_rotary_pos_emb(q, freqs), apply_rotary_pos_emb(k, freqs))), (q, k)
    raise SystemExit(f"unknown apply case {cid!r}")


def _profiled_peak(fn) -> int:
    """Allocator peak (bytes above the level at entry) while ``fn()`` runs, from torch.profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    finally:
        os.unlink(path)
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not mem:
        return 0
    totals = [e["args"]["Total Allocated"] for e in mem]
    start = totals[0] - mem[0]["args"]["Bytes"]
    peak = lo = start
    for t in totals:  # frees of tensors allocated before the profile can push the total below the start
        lo = min(lo, t)
        peak = max(peak, t - (lo - start) if lo < start else t)
    return int(peak - start)


def worker(case: str, L: int, repeats: int, threads: int, seed: int = 0) -> dict:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    kind, _, name = case.partition(":")
    if kind == "apply":
        fn, inputs = _apply_fn(case, L)
        grad_inputs = tuple(t.requires_grad_() for t in inputs)
        module = None
    else:
        if kind == "floor":
            module = _floor_module()
        elif kind in ("posenc", "posenc-compiled"):
            module = _posenc_module(name, L)
        elif kind == "peer":
            module = _peer_module(name, L)
        else:
            raise SystemExit(f"unknown case {case!r}")
        module.eval()  # no dropout anywhere; gradients still flow
        if kind == "posenc-compiled":
            module = torch.compile(module, fullgraph=True)
        x = torch.randn(B, L, D)
        fn, grad_inputs = module, (x.requires_grad_(),)

    def outputs(res):
        return res if isinstance(res, tuple) else (res,)

    grads_cache: dict = {}

    def fwd():
        with torch.no_grad():
            return fn(*grad_inputs)

    def fwdbwd():
        outs = outputs(fn(*grad_inputs))
        if "g" not in grads_cache:
            grads_cache["g"] = tuple(torch.randn_like(o) for o in outs)
        torch.autograd.backward(outs, grads_cache["g"])
        for t in grad_inputs:
            t.grad = None
        if module is not None:
            for p in module.parameters():
                p.grad = None

    t_compile = None
    if kind == "posenc-compiled":
        t0 = time.perf_counter()
        fwdbwd()
        fwd()
        t_compile = time.perf_counter() - t0
    peak_fb = _profiled_peak(fwdbwd)
    peak_f = _profiled_peak(fwd)
    if L <= 1024 or kind == "apply":  # the profiled runs were the warm-up; one more plain pass where it is cheap
        fwdbwd()
        fwd()
    if kind == "apply":  # a few milliseconds each: a median of 2-3 calls is mostly noise
        repeats = max(repeats, APPLY_REPEATS)
    tf, tfb, cf, cfb = [], [], [], []
    load0 = os.getloadavg()[0]
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        for f, wall, cpu in ((fwd, tf, cf), (fwdbwd, tfb, cfb)):
            p0, t0 = time.process_time(), time.perf_counter()
            f()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - p0)
    c1, w1 = time.process_time(), time.perf_counter()
    n_params = 0 if module is None else sum(p.numel() for p in module.parameters())
    return {
        "case": case,
        "L": L,
        "fwd_s": statistics.median(tf),
        "fwd_min_s": min(tf),
        "fwd_max_s": max(tf),
        "fwdbwd_s": statistics.median(tfb),
        "fwdbwd_min_s": min(tfb),
        "fwdbwd_max_s": max(tfb),
        "fwd_cpu_s": statistics.median(cf),
        "fwdbwd_cpu_s": statistics.median(cfb),
        "fwdbwd_cpu_min_s": min(cfb),
        "fwdbwd_cpu_max_s": max(cfb),
        "peak_fwd_MB": peak_f / 2**20,
        "peak_fwdbwd_MB": peak_fb / 2**20,
        "repeats": repeats,
        "cpu_util": (c1 - c0) / max(w1 - w0, 1e-9) / threads,
        "loadavg_1m": [load0, os.getloadavg()[0]],
        "compile_s": t_compile,
        "n_params": n_params,
        "torch": torch.__version__,
    }


# ====================================================================== the orchestrator
def python_for(case: str) -> str:
    return HF457_PY if case.startswith("peer:hf457-") else MAIN_PY


def default_repeats(L: int) -> int:
    """Timed repeats per process: more where a call is short (a median of 3 calls of 0.1 s moved by ±6–10 %
    on this shared machine, more than the differences the targets look at)."""
    return 20 if L <= 256 else 10 if L <= 512 else 5 if L <= 1024 else 3 if L <= 2048 else 2


def default_cases(encodings: list[str], peers: bool, apply: bool, compiled: list[str]) -> list[str]:
    cases = ["floor"]
    for e in encodings:
        cases.append(f"posenc:{e}")
        if peers:
            cases += [f"peer:{p}" for p in PEERS.get(e, []) if f"peer:{p}" not in cases]
    cases += [f"posenc-compiled:{e}" for e in compiled]
    if apply:
        cases += APPLY_CASES
    return cases


def load(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.exists() else []


def run(args: argparse.Namespace) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / (f"{args.tag}.part-{args.part}.json" if args.part else f"{args.tag}.json")
    records = load(path)
    if args.cases:
        cases = args.cases
    else:
        if args.all:
            import posenc  # noqa: F401
            from posenc.registry import available

            encs = available()
        else:
            encs = args.encodings or DEFAULT_ENCODINGS
        cases = default_cases(encs, not args.no_peers, not args.no_apply, args.compiled or [])
    lengths = args.lengths or ([256, 1024] if args.quick else [256, 512, 1024, 2048])
    rounds = 1 if args.quick else args.rounds
    done = {(r["case"], r["L"], r.get("round", 0)) for r in records}
    env = dict(os.environ, **MALLOC_ENV, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT / "src"))
    env.pop("POSENC_BENCH_WORKER", None)
    for rnd in range(rounds):
        for L in lengths:
            # alternate the order between rounds so that a slow spell of the machine hits different cases
            order = cases if rnd % 2 == 0 else list(reversed(cases))
            for case in order:
                key = (case, L, rnd)
                if key in done and not args.force:
                    continue
                pid = case.split(":", 1)[-1]
                if L >= TOO_BIG.get(pid, 1 << 30):
                    rec = {"case": case, "L": L, "round": rnd, "skipped": "does not fit in this machine's memory"}
                else:
                    reps = args.repeats or (2 if args.quick else default_repeats(L))
                    cmd = [python_for(case), str(Path(__file__)), "worker", case, str(L), str(reps), str(args.threads)]
                    t0 = time.perf_counter()
                    try:
                        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                        if p.returncode == 0 and lines:
                            rec = json.loads(lines[-1])
                        else:
                            rec = {"case": case, "L": L, "error": (p.stderr or p.stdout)[-800:]}
                    except subprocess.TimeoutExpired:
                        rec = {"case": case, "L": L, "error": f"timeout after {args.timeout} s"}
                    rec["round"] = rnd
                    rec["wall_s"] = time.perf_counter() - t0
                    rec["malloc_env"] = MALLOC_ENV
                    rec["threads"] = args.threads
                records = [r for r in records if (r["case"], r["L"], r.get("round", 0)) != key] + [rec]
                path.write_text(json.dumps(records, indent=1))
                if "fwdbwd_s" in rec:
                    print(
                        f"r{rnd} L={L:5d} {case:38s} fwd {rec['fwd_s']:.4f}s fwd+bwd {rec['fwdbwd_s']:.4f}s "
                        f"peak {rec['peak_fwdbwd_MB']:.0f}MB util {rec['cpu_util']:.2f} "
                        f"load {rec['loadavg_1m'][0]:.1f}",
                        flush=True,
                    )
                else:
                    print(f"r{rnd} L={L:5d} {case:38s} {rec.get('skipped') or rec.get('error', '')[-300:]}", flush=True)


# ========================================================================== the report
def summarise(records: list[dict], metric: str = "cpu") -> dict[tuple[str, int], dict]:
    """Median over rounds of each (case, L); spread = min/max of the per-round medians.

    ``metric="cpu"``: process CPU seconds of the (single-threaded) timed calls, which other processes on a
    shared machine barely change; ``"wall"``: wall-clock seconds.
    """
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        if "fwdbwd_s" in r and (metric == "wall" or "fwdbwd_cpu_s" in r):
            groups.setdefault((r["case"], r["L"]), []).append(r)
    sfx = "_cpu_s" if metric == "cpu" else "_s"
    lo_k, hi_k = ("fwdbwd_cpu_min_s", "fwdbwd_cpu_max_s") if metric == "cpu" else ("fwdbwd_min_s", "fwdbwd_max_s")
    out = {}
    for key, rs in groups.items():
        out[key] = {
            "fwd_s": statistics.median(r["fwd" + sfx] for r in rs),
            "fwdbwd_s": statistics.median(r["fwdbwd" + sfx] for r in rs),
            "fwdbwd_lo": min(r[lo_k] for r in rs),
            "fwdbwd_hi": max(r[hi_k] for r in rs),
            "wall_fwdbwd_s": statistics.median(r["fwdbwd_s"] for r in rs),
            "peak_fwd_MB": statistics.median(r["peak_fwd_MB"] for r in rs),
            "peak_fwdbwd_MB": statistics.median(r["peak_fwdbwd_MB"] for r in rs),
            "cpu_util": statistics.median(r["cpu_util"] for r in rs),
            "n": len(rs),
            "compile_s": rs[0].get("compile_s"),
        }
    return out


def report(args: argparse.Namespace) -> None:
    records = load(RESULTS / f"{args.tag}.json")
    for part in sorted(RESULTS.glob(f"{args.tag}.part-*.json")):  # runs made side by side (--part)
        records += load(part)
    s = summarise(records, args.metric)
    lengths = sorted({L for _, L in s})
    encs = []
    for c, _ in s:
        if c.startswith("posenc:") and c[7:] not in encs:
            encs.append(c[7:])
    order = {e: i for i, e in enumerate(DEFAULT_ENCODINGS)}
    encs.sort(key=lambda e: (order.get(e, 999), e))
    lines = [f"# {args.tag} ({args.metric} time): one attention layer, B={B}, H={H}, d_head={DH}, fp32", ""]
    lines.append(
        f"Times ({args.metric} seconds, min–max of the repeats in brackets) are medians (of repeats, then of "
        "rounds); ratios: posenc / floor (plain SDPA, no "
        "position) and posenc / fastest peer of the same method (<1 = posenc faster). Memory: allocator peak of "
        "forward+backward, MB."
    )
    for L in lengths:
        fl = s.get(("floor", L))
        if fl is None:
            continue
        lines += ["", f"## L = {L}", ""]
        lines.append(
            f"floor: fwd {fl['fwd_s']:.4f} s, fwd+bwd {fl['fwdbwd_s']:.4f} s "
            f"({fl['fwdbwd_lo']:.4f}-{fl['fwdbwd_hi']:.4f}), peak {fl['peak_fwdbwd_MB']:.0f} MB",
        )
        lines += [
            "",
            "| encoding | fwd s | fwd+bwd s | peak MB | ×floor time | ×floor mem | fastest peer | peer fwd+bwd s "
            "| peer MB | ×peer time | ×peer mem | ×peer fwd |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for e in encs:
            r = s.get((f"posenc:{e}", L))
            if r is None:
                continue
            peers = [(p, s[(f"peer:{p}", L)]) for p in PEERS.get(e, []) if (f"peer:{p}", L) in s]
            row = (
                f"| {e} | {r['fwd_s']:.4f} | {r['fwdbwd_s']:.4f} | {r['peak_fwdbwd_MB']:.0f} | "
                f"{r['fwdbwd_s'] / fl['fwdbwd_s']:.2f} | {r['peak_fwdbwd_MB'] / max(fl['peak_fwdbwd_MB'], 1e-9):.2f} |"
            )
            if peers:
                pid, pr = min(peers, key=lambda t: t[1]["fwdbwd_s"])
                pmem = min(p[1]["peak_fwdbwd_MB"] for p in peers)
                pfwd = min(p[1]["fwd_s"] for p in peers)
                row += (
                    f" {pid} | {pr['fwdbwd_s']:.4f} | {pmem:.0f} | {r['fwdbwd_s'] / pr['fwdbwd_s']:.2f} | "
                    f"{r['peak_fwdbwd_MB'] / max(pmem, 1e-9):.2f} | {r['fwd_s'] / pfwd:.2f} |"
                )
            else:
                missing = [p for p in PEERS.get(e, [])]
                row += f" {'(skipped: ' + ', '.join(missing) + ')' if missing else '—'} | | | | | |"
            lines.append(row)
        peer_rows = [(c, v) for (c, LL), v in s.items() if LL == L and c.startswith("peer:")]
        if peer_rows:
            lines += [
                "",
                "| peer | fwd s | fwd+bwd s | peak MB | ×floor time | ×floor mem |",
                "|---|---|---|---|---|---|",
            ]
            for c, v in sorted(peer_rows):
                lines.append(
                    f"| {c[5:]} | {v['fwd_s']:.4f} | {v['fwdbwd_s']:.4f} | {v['peak_fwdbwd_MB']:.0f} | "
                    f"{v['fwdbwd_s'] / fl['fwdbwd_s']:.2f} | "
                    f"{v['peak_fwdbwd_MB'] / max(fl['peak_fwdbwd_MB'], 1e-9):.2f} |"
                )
        comp = [(c, v) for (c, LL), v in s.items() if LL == L and c.startswith("posenc-compiled:")]
        if comp:
            lines += [
                "",
                "| compiled (fullgraph) | fwd s | fwd+bwd s | peak MB | ×eager fwd+bwd | ×floor time | compile s |",
                "|---|---|---|---|---|---|---|",
            ]
            for c, v in sorted(comp):
                eager = s.get((f"posenc:{c.split(':', 1)[1]}", L))
                ratio = f"{v['fwdbwd_s'] / eager['fwdbwd_s']:.2f}" if eager else "—"
                lines.append(
                    f"| {c.split(':', 1)[1]} | {v['fwd_s']:.4f} | {v['fwdbwd_s']:.4f} | {v['peak_fwdbwd_MB']:.0f} | "
                    f"{ratio} | {v['fwdbwd_s'] / fl['fwdbwd_s']:.2f} | {v['compile_s'] or 0:.1f} |"
                )
        app = [(c, v) for (c, LL), v in s.items() if LL == L and c.startswith("apply:")]
        cp = s.get(("apply:copy", L))
        if app and cp:
            lines += [
                "",
                "| RoPE application (q and k) | fwd s | ×copy | fwd+bwd s | ×copy fwd+bwd |",
                "|---|---|---|---|---|",
            ]
            for c, v in sorted(app):
                lines.append(
                    f"| {c[6:]} | {v['fwd_s']:.5f} | {v['fwd_s'] / cp['fwd_s']:.2f} | {v['fwdbwd_s']:.5f} | "
                    f"{v['fwdbwd_s'] / cp['fwdbwd_s']:.2f} |"
                )
    lines += targets(s, lengths)
    errs = [r for r in records if ("error" in r or "skipped" in r) and (r["case"], r["L"]) not in s]
    if errs:
        lines += ["", "## Not measured", ""]
        for r in errs:
            why = r.get("skipped") or r["error"].strip().splitlines()[-1][:200]
            lines.append(f"- {r['case']} at L={r['L']} (round {r.get('round', 0)}): {why}")
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{args.tag}.md").write_text(text)
    print(text)
    if not args.no_plot:
        plot(s, encs, lengths, RESULTS / f"{args.tag}.png")


ROTARY_AND_BIAS = ["rope", "rope-interleaved", "xpos", "alibi", "t5", "kerple-log", "kerple-power", "fire"]
RELATIVE_2X = ["shaw", "relative-key", "relative-key-query", "nezha", "transformer-xl", "tener", "deberta"]


def targets(s: dict, lengths: list[int]) -> list[str]:
    """The issue's targets, each with its numbers and met / NOT met (ratios from this one report)."""

    def ok(flag: bool) -> str:
        return "met" if flag else "**NOT met**"

    def vs_peer(t: float, m: float) -> str:
        if t <= 1.0 and m <= 1.0:
            return "met"
        if t <= 1.05 and m <= 1.02:  # the run-to-run spread of this machine (see the README)
            return "tie (within the measurement spread)"
        return "**NOT met**"

    out = ["", "## Targets", ""]
    out.append("1. Time and peak memory (forward+backward) ≤ the fastest peer's, at every L:")
    for e, peers in PEERS.items():
        for L in lengths:
            r = s.get((f"posenc:{e}", L))
            ps = [s[(f"peer:{p}", L)] for p in peers if (f"peer:{p}", L) in s]
            if r is None or not ps:
                continue
            t = r["fwdbwd_s"] / min(p["fwdbwd_s"] for p in ps)
            m = r["peak_fwdbwd_MB"] / min(p["peak_fwdbwd_MB"] for p in ps)
            out.append(f"   - {e} L={L}: time ×{t:.2f}, memory ×{m:.2f}: {vs_peer(t, m)}")
    out.append("2. Rotary and bias encodings: forward+backward ≤ 1.25 × floor at L=2048:")
    fl = s.get(("floor", 2048))
    for e in ROTARY_AND_BIAS:
        r = s.get((f"posenc:{e}", 2048))
        if r and fl:
            t = r["fwdbwd_s"] / fl["fwdbwd_s"]
            out.append(f"   - {e}: ×{t:.2f}: {ok(t <= 1.25)}")
    out.append("3. Relative encodings with an L×L×d form in the paper: ≤ 2 × floor at L=2048:")
    for e in RELATIVE_2X:
        r = s.get((f"posenc:{e}", 2048))
        if r and fl:
            t = r["fwdbwd_s"] / fl["fwdbwd_s"]
            out.append(f"   - {e}: ×{t:.2f} (peak {r['peak_fwdbwd_MB']:.0f} MB): {ok(t <= 2.0)}")
    out.append(
        "4. RoPE application (q and k, forward): ≤ 1.5 × copying q and k, and faster than HF / rotary-embedding-torch:"
    )
    for L in lengths:
        cp = s.get(("apply:copy", L))
        if cp is None:
            continue
        rivals = [s[(c, L)]["fwd_s"] for c in ("apply:hf-llama", "apply:ret") if (c, L) in s]
        for mine in ("posenc-rope", "posenc-rope-interleaved"):
            r = s.get((f"apply:{mine}", L))
            if r is None:
                continue
            x = r["fwd_s"] / cp["fwd_s"]
            faster = all(r["fwd_s"] < t for t in rivals)
            out.append(f"   - {mine} L={L}: ×{x:.2f} copy, faster than peers: {faster}: {ok(x <= 1.5 and faster)}")
    return out


def plot(s: dict, encs: list[str], lengths: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [
        ("rotary", ["rope", "rope-interleaved", "xpos"]),
        ("bias", ["alibi", "t5", "kerple-log", "fire", "dynamic-bias"]),
        ("relative (logits)", ["shaw", "relative-key", "relative-key-query", "nezha", "transformer-xl", "deberta"]),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), dpi=70)
    for col, (title, names) in enumerate(groups):
        for row, (metric, label) in enumerate((("fwdbwd_s", "fwd+bwd time, s"), ("peak_fwdbwd_MB", "peak MB"))):
            ax = axes[row, col]
            cases = [("floor", "floor (SDPA)", "k", "-")]
            for i, e in enumerate(names):
                color = f"C{i}"
                cases.append((f"posenc:{e}", f"posenc {e}", color, "-"))
                for p in PEERS.get(e, []):
                    cases.append((f"peer:{p}", f"{p}", color, "--"))
            seen = set()
            for c, lab, color, ls in cases:
                if c in seen:
                    continue
                seen.add(c)
                xs = [L for L in lengths if (c, L) in s]
                if not xs:
                    continue
                ax.plot(xs, [s[(c, L)][metric] for L in xs], ls, color=color, marker="o", ms=3, label=lab)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("L")
            ax.set_ylabel(label)
            ax.set_title(title)
            if row == 0:
                ax.legend(fontsize=6)
    fig.suptitle(f"one attention layer, B={B}, H={H}, d_head={DH}; solid: posenc, dashed: peers")
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        case, L, reps, threads = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(worker(case, L, reps, threads)))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure (resumable)")
    r.add_argument("--lengths", type=int, nargs="+")
    r.add_argument("--encodings", nargs="+", help="posenc registry names (default: one per distinct cost)")
    r.add_argument("--all", action="store_true", help="every registered encoding")
    r.add_argument("--cases", nargs="+", help="explicit case ids (floor, posenc:rope, peer:hf-t5, apply:copy ...)")
    r.add_argument("--compiled", nargs="+", help="also run these encodings under torch.compile(fullgraph=True)")
    r.add_argument("--no-peers", action="store_true")
    r.add_argument("--no-apply", action="store_true")
    r.add_argument("--quick", action="store_true", help="L=256,1024, one round, 2 repeats")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--repeats", type=int)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--timeout", type=int, default=900)
    r.add_argument("--tag", default="cpu-fp32")
    r.add_argument("--force", action="store_true")
    r.add_argument(
        "--part", help="write to <tag>.part-<PART>.json (two runs side by side; the report reads every part)"
    )
    p = sub.add_parser("report", help="tables and plots from the results JSON")
    p.add_argument("--tag", default="cpu-fp32")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--metric", choices=("cpu", "wall"), default="cpu", help="CPU seconds (default) or wall seconds")
    args = ap.parse_args()
    (run if args.cmd == "run" else report)(args)


if __name__ == "__main__":
    main()
