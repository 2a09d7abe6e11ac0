#!/usr/bin/env python
"""Speed and memory of whole models: posenc's LanguageModel / SequenceClassifier for every encoding, and the
Hugging Face model a user would pick instead, at the same size.

Three benchmarks, each case in a fresh process (same method as ``bench_attention.py``: one thread,
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` set, CPU seconds of the single-threaded process):

* **training step** (``run``, the default): forward, loss, backward of a 2-layer model (d_model 512, 8 heads,
  d_ff 2048, batch 2, fp32) at each L. No optimizer step (its cost is the same for every encoding: one
  pass over the ~7M parameters). Cases ``lm:posenc:<enc>`` (``posenc.LanguageModel``, causal, next-token
  cross-entropy against random targets) or ``classifier:posenc:<enc>`` (``posenc.SequenceClassifier``,
  bidirectional, mean pooling, 2 classes); a no-grad forward of the same batch is timed too.
* **HF models of the same size**, the same step (``lm:hf:llama``, ``lm:hf:xlnet``, ``lm:hf457:transfo-xl``,
  ``classifier:hf:t5``, ``classifier:hf:deberta``, ``classifier:hf457:bert-relative_key``,
  ``classifier:hf457:bert-relative_key_query``, ``classifier:hf457:nezha``), randomly initialised from a
  config (no download); ``hf457`` cases run under transformers 4.57 (``POSENC_HF457_PYTHON``).
* **HF models patched by posenc.hf** (``run --hf-patch alibi t5 ...``): ``lm:hfpatch:<enc>`` is ``lm:hf:llama``
  with its encoding replaced by ``posenc.hf.patch(model, <enc>)``; its ratio is taken against the unpatched
  ``lm:hf:llama`` (issue target: <= 1.10x for rotary encodings, <= 1.25x for biases). With ``--decode`` the same
  as ``decode:hfpatch:<enc>`` against ``decode:hf:llama``.
* **KV-cache decoding** (``run --decode``): batch 1, prefill a context of L tokens with
  ``kv_cache=posenc.KVCache()``, then time single-token steps under ``torch.no_grad`` (``decode:posenc:<enc>``;
  ``decode-mem:posenc:transformer-xl`` decodes with Transformer-XL's segment memory instead of a cache;
  ``decode:hf:llama`` with HF's DynamicCache, ``decode-mem:hf457:transfo-xl`` with HF's ``mems``).

Ratios are taken against ``none`` of the same kind from the same results file (``lm:posenc:none``,
``classifier:posenc:none``, ``decode:posenc:none``), and HF cases also against the matching posenc encoding.

Usage (from the repository root)::

    .venv/bin/python benchmarks/bench_models.py run --quick                       # L=256,512, a few encodings
    .venv/bin/python benchmarks/bench_models.py run --model lm --lengths 512 1024 2048
    .venv/bin/python benchmarks/bench_models.py run --model classifier --lengths 512 1024 2048
    .venv/bin/python benchmarks/bench_models.py run --decode --lengths 1024 4096
    .venv/bin/python benchmarks/bench_models.py run --model lm --encodings none rope --lengths 4096 --no-hf
    .venv/bin/python benchmarks/bench_models.py run --model lm --encodings none --hf-patch rope alibi --lengths 1024
    .venv/bin/python benchmarks/bench_models.py run ... --dry-run                 # list the cases only
    .venv/bin/python benchmarks/bench_models.py report                            # -> results/models-cpu-fp32.md

Results accumulate in ``benchmarks/results/<tag>.json`` (``--tag``, default ``models-cpu-fp32``); a (case, L)
already there is skipped unless ``--force``, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

# the shared methodology: malloc settings, the allocator-peak probe, the encodings' options (the same ones the
# attention benchmark and its peers use), the transformers 4.57 interpreter
from bench_attention import ENC_OPTIONS, HF457_PY, MALLOC_ENV, _profiled_peak  # noqa: E402

MAIN_PY = sys.executable

D, H, D_FF, N_LAYERS = 512, 8, 2048, 2
DH = D // H
N_CLASSES = 2
# Llama's MLP is SwiGLU (three d x d_ff matrices): 1365 ~ 2/3 * 2048 gives it the parameters and FLOPs of the
# two-matrix 2048 GELU MLP of posenc's blocks (the report prints both models' parameter counts)
LLAMA_FF = 1365

# the default encodings: one per distinct cost (the attention benchmark's list, minus kerple-power,
# relative-bias and contextual-2, plus nope); --all runs every registered encoding
DEFAULT_ENCODINGS = [
    "none",
    "nope",
    "sinusoidal",
    "learned",
    "rope",
    "rope-interleaved",
    "xpos",
    "rope-yarn",
    "alibi",
    "t5",
    "kerple-log",
    "fire",
    "dynamic-bias",
    "cope",
    "shaw",
    "nezha",
    "relative-key",
    "relative-key-query",
    "contextual-1",
    "transformer-xl",
    "xlnet",
    "tener",
    "deberta",
]
QUICK_ENCODINGS = ["none", "rope", "alibi", "t5", "transformer-xl", "deberta"]

# HF case -> (model kind, the posenc encoding it implements, what it is)
HF_CASES: dict[str, tuple[str, str, str]] = {
    "hf:llama": (
        "lm",
        "rope",
        f"transformers 5.x LlamaForCausalLM (sdpa, tied embeddings, attention and MLP biases, SwiGLU "
        f"intermediate {LLAMA_FF} = the parameters of a 2048 GELU MLP, RMSNorm)",
    ),
    "hf:xlnet": ("lm", "xlnet", "transformers 5.x XLNetLMHeadModel (attn_type='uni', no memory, post-LN)"),
    "hf457:transfo-xl": (
        "lm",
        "transformer-xl",
        "transformers 4.57 TransfoXLLMHeadModel (no adaptive softmax: cutoffs [], div_val 1; mem_len 0; post-LN)",
    ),
    "hf:t5": ("classifier", "t5", "transformers 5.x T5EncoderModel (sdpa; GELU MLP, no biases, RMSNorm)"),
    "hf:deberta": (
        "classifier",
        "deberta",
        "transformers 5.x DebertaV2Model (c2p+p2c, 256 buckets, max_relative_positions 512, shared keys, "
        "LayerNorm'd rel. embeddings, no absolute positions)",
    ),
    "hf457:bert-relative_key": (
        "classifier",
        "relative-key",
        "transformers 4.57 BertModel(position_embedding_type='relative_key'), eager, max_position_embeddings L",
    ),
    "hf457:bert-relative_key_query": (
        "classifier",
        "relative-key-query",
        "transformers 4.57 BertModel(position_embedding_type='relative_key_query'), eager, max_position_embeddings L",
    ),
    "hf457:nezha": ("classifier", "nezha", "transformers 4.57 NezhaModel (max_relative_position 64), eager"),
}
HF_DECODE = {
    "decode:hf:llama": ("rope", "transformers 5.x LlamaForCausalLM, DynamicCache"),
    "decode-mem:hf457:transfo-xl": ("transformer-xl", "transformers 4.57 TransfoXLLMHeadModel, mems of L tokens"),
}

# cases known not to fit in this machine's memory (23 GB, shared) from this L on: skipped unless --allow-big.
# L x L x d tensors (HF relative peers), or L x L per head kept for the backward (CoPE: 7.8 GB for one layer
# at B=4, L=2048 in the attention benchmark)
TOO_BIG = {
    "classifier:hf457:bert-relative_key": 4096,
    "classifier:hf457:bert-relative_key_query": 4096,
    "classifier:hf457:nezha": 4096,
    "classifier:hf:deberta": 4096,
    "lm:hf:xlnet": 4096,
    "lm:hf457:transfo-xl": 4096,
    "lm:posenc:cope": 4096,
    "classifier:posenc:cope": 4096,
}


# ============================================================================ the worker (one fresh process)
def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _posenc_model(kind: str, enc: str, max_len: int, vocab: int):
    import posenc

    opts = dict(ENC_OPTIONS.get(enc, {}))
    kw = dict(encoding=enc, encoding_options=opts or None, d_model=D, n_heads=H, d_ff=D_FF, n_layers=N_LAYERS)
    if kind == "classifier":
        return posenc.SequenceClassifier(vocab, N_CLASSES, max_len=max_len, **kw)
    return posenc.LanguageModel(vocab, max_len=max_len, **kw)


def _patch_type_as() -> None:
    """transformers 4.57.6's TransfoXLModel.forward calls ``tensor.type_as(dtype=...)``, which torch has never
    accepted (TypeError); accept that one spelling (``.to(dtype)``) and leave every other call alone."""
    import torch

    orig = torch.Tensor.type_as

    def type_as(self, other=None, dtype=None):
        return self.to(dtype) if other is None else orig(self, other)

    torch.Tensor.type_as = type_as


def _hf_model(pid: str, max_len: int, vocab: int, mem_len: int = 0):
    """The HF model of case ``pid`` (``hf:llama`` ...): (module, returns) with returns 'logits', 'logprobs' or
    'hidden' (the last hidden state, pooled and classified by the caller)."""
    import warnings

    warnings.filterwarnings("ignore")
    import transformers as tf

    tf.logging.set_verbosity_error()
    if pid.startswith("hfpatch:"):  # the Llama below, its encoding replaced by posenc.hf
        import posenc.hf

        enc = pid.split(":", 1)[1]
        model, returns = _hf_model("hf:llama", max_len, vocab)
        posenc.hf.patch(model, enc, **ENC_OPTIONS.get(enc, {}))
        return model, returns
    if pid == "hf:llama":
        cfg = tf.LlamaConfig(
            vocab_size=vocab,
            hidden_size=D,
            intermediate_size=LLAMA_FF,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=H,
            num_key_value_heads=H,
            head_dim=DH,
            max_position_embeddings=max_len,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            attention_dropout=0.0,
            attn_implementation="sdpa",
        )
        return tf.LlamaForCausalLM(cfg), "logits"
    if pid == "hf:xlnet":
        cfg = tf.XLNetConfig(
            vocab_size=vocab,
            d_model=D,
            n_layer=N_LAYERS,
            n_head=H,
            d_inner=D_FF,
            ff_activation="gelu",
            attn_type="uni",
            dropout=0.0,
            mem_len=None,
        )
        return tf.XLNetLMHeadModel(cfg), "logits"
    if pid == "hf457:transfo-xl":
        _patch_type_as()
        from transformers.models.deprecated.transfo_xl.configuration_transfo_xl import TransfoXLConfig
        from transformers.models.deprecated.transfo_xl.modeling_transfo_xl import TransfoXLLMHeadModel

        cfg = TransfoXLConfig(
            vocab_size=vocab,
            cutoffs=[],
            adaptive=False,
            div_val=1,
            d_model=D,
            d_embed=D,
            n_head=H,
            d_head=DH,
            d_inner=D_FF,
            n_layer=N_LAYERS,
            mem_len=mem_len,
            clamp_len=-1,
            same_length=False,
            dropout=0.0,
            dropatt=0.0,
        )
        return TransfoXLLMHeadModel(cfg), "logprobs"
    if pid == "hf:t5":
        cfg = tf.T5Config(
            vocab_size=vocab,
            d_model=D,
            d_kv=DH,
            num_heads=H,
            d_ff=D_FF,
            num_layers=N_LAYERS,
            feed_forward_proj="gelu",
            dropout_rate=0.0,
            relative_attention_num_buckets=32,
            relative_attention_max_distance=128,
            attn_implementation="sdpa",
        )
        return tf.T5EncoderModel(cfg), "hidden"
    if pid == "hf:deberta":
        cfg = tf.DebertaV2Config(
            vocab_size=vocab,
            hidden_size=D,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=H,
            intermediate_size=D_FF,
            relative_attention=True,
            position_buckets=256,
            max_position_embeddings=512,
            pos_att_type=["p2c", "c2p"],
            share_att_key=True,
            norm_rel_ebd="layer_norm",
            position_biased_input=False,
            type_vocab_size=0,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return tf.DebertaV2Model(cfg), "hidden"
    if pid.startswith("hf457:bert-"):
        kind = pid[len("hf457:bert-") :]
        cfg = tf.BertConfig(
            vocab_size=vocab,
            hidden_size=D,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=H,
            intermediate_size=D_FF,
            max_position_embeddings=max_len,
            position_embedding_type=kind,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="eager",  # sdpa falls back to eager for relative positions anyway
        )
        return tf.BertModel(cfg, add_pooling_layer=False), "hidden"
    if pid == "hf457:nezha":
        from transformers.models.deprecated.nezha.configuration_nezha import NezhaConfig
        from transformers.models.deprecated.nezha.modeling_nezha import NezhaModel

        cfg = NezhaConfig(
            vocab_size=vocab,
            hidden_size=D,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=H,
            intermediate_size=D_FF,
            max_relative_position=64,
            max_position_embeddings=max(max_len, 512),
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return NezhaModel(cfg, add_pooling_layer=False), "hidden"
    raise SystemExit(f"unknown HF case {pid!r}")


def _train_case(case: str, L: int, vocab: int, batch: int):
    """(module, loss_fn): ``loss_fn()`` runs the model on one batch and returns the scalar loss."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    kind, _, rest = case.partition(":")
    tokens = torch.randint(0, vocab, (batch, L))
    targets = torch.randint(0, vocab, (batch, L))
    labels = torch.randint(0, N_CLASSES, (batch,))
    if rest.startswith("posenc:"):
        model = _posenc_model(kind, rest.split(":", 1)[1], L, vocab)
        if kind == "lm":
            return model, lambda: F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        return model, lambda: F.cross_entropy(model(tokens), labels)
    base, returns = _hf_model(rest, L, vocab)
    if kind == "lm":
        extra = {"use_cache": False} if rest == "hf:llama" or rest.startswith("hfpatch:") else {}
        if returns == "logprobs":  # TransfoXL's head returns log-softmax (its ProjectedAdaptiveLogSoftmax)
            return base, lambda: F.nll_loss(base(tokens).prediction_scores.flatten(0, 1), targets.flatten())
        return base, lambda: F.cross_entropy(base(tokens, **extra).logits.flatten(0, 1), targets.flatten())

    class Pooled(nn.Module):  # what posenc.SequenceClassifier does: mean pooling, a linear head
        def __init__(self) -> None:
            super().__init__()
            self.base, self.head = base, nn.Linear(D, N_CLASSES)

        def forward(self, x):
            return self.head(self.base(input_ids=x).last_hidden_state.mean(1))

    model = Pooled()
    return model, lambda: F.cross_entropy(model(tokens), labels)


def train_worker(case: str, L: int, repeats: int, threads: int, vocab: int, batch: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    rss_imports = _rss_bytes()
    module, loss_fn = _train_case(case, L, vocab, batch)
    module.train()  # dropout is 0 everywhere; train mode is what a training step runs (randomized positions)
    rss_entry = _rss_bytes()

    def fwd():
        with torch.no_grad():
            loss_fn()

    def step():
        loss_fn().backward()
        for p in module.parameters():
            p.grad = None

    t0 = time.process_time()
    step()  # the first step: one-time work (native kernels, caches); its RSS high-water mark is recorded
    first_step_cpu = time.process_time() - t0
    rss_step = _maxrss_bytes() - rss_entry
    peak_step = _profiled_peak(step)
    peak_fwd = _profiled_peak(fwd)
    if L <= 1024:  # one more plain pass where it is cheap
        step()
        fwd()
    tf, ts, cf, cs = [], [], [], []
    load0 = os.getloadavg()[0]
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        for f, wall, cpu in ((fwd, tf, cf), (step, ts, cs)):
            p0, t0 = time.process_time(), time.perf_counter()
            f()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - p0)
    c1, w1 = time.process_time(), time.perf_counter()
    return {
        "case": case,
        "L": L,
        "step_cpu_s": statistics.median(cs),
        "step_cpu_min_s": min(cs),
        "step_cpu_max_s": max(cs),
        "step_s": statistics.median(ts),
        "step_min_s": min(ts),
        "step_max_s": max(ts),
        "fwd_cpu_s": statistics.median(cf),
        "fwd_s": statistics.median(tf),
        "first_step_cpu_s": first_step_cpu,
        "peak_step_MB": peak_step / 2**20,
        "peak_fwd_MB": peak_fwd / 2**20,
        "rss_step_MB": rss_step / 2**20,
        "rss_run_MB": (_maxrss_bytes() - rss_entry) / 2**20,
        "rss_model_MB": (rss_entry - rss_imports) / 2**20,
        "repeats": repeats,
        "cpu_util": (c1 - c0) / max(w1 - w0, 1e-9) / threads,
        "loadavg_1m": [load0, os.getloadavg()[0]],
        "n_params": sum(p.numel() for p in module.parameters()),
        "torch": torch.__version__,
        **_versions(case),
    }


def _decoder(case: str, C: int, n_tokens: int, vocab: int):
    """(module, prefill(ctx), step(tok)): the decoding loop of one case; state lives in the closures."""
    import torch

    kind, _, rest = case.partition(":")
    max_len = C + n_tokens
    if rest.startswith("posenc:"):
        import posenc

        model = _posenc_model("lm", rest.split(":", 1)[1], max_len, vocab)
        state: dict = {}
        if kind == "decode":

            def prefill(ctx):
                state["cache"] = posenc.KVCache()
                return model(ctx, kv_cache=state["cache"])

            def step(tok):
                return model(tok, kv_cache=state["cache"])

        else:  # Transformer-XL segment memory: each layer's inputs of the last C tokens, no cache

            def prefill(ctx):
                logits, state["mem"] = model(ctx, return_memory=True)
                return logits

            def step(tok):
                logits, new = model(tok, memory=state["mem"], return_memory=True)
                state["mem"] = [torch.cat([m, n], 1)[:, -C:] for m, n in zip(state["mem"], new)]
                return logits

        return model, prefill, step
    model, _ = _hf_model(rest, max_len, vocab, mem_len=C)
    state = {}
    if rest == "hf:llama" or rest.startswith("hfpatch:"):

        def prefill(ctx):
            out = model(ctx, use_cache=True)
            state["pkv"] = out.past_key_values
            return out.logits

        def step(tok):
            out = model(tok, past_key_values=state["pkv"], use_cache=True)
            state["pkv"] = out.past_key_values
            return out.logits

    elif rest == "hf457:transfo-xl":

        def prefill(ctx):
            out = model(ctx)
            state["mems"] = out.mems
            return out.prediction_scores

        def step(tok):
            out = model(tok, mems=state["mems"])
            state["mems"] = out.mems
            return out.prediction_scores

    else:
        raise SystemExit(f"no decoding loop for {case!r}")
    return model, prefill, step


DECODE_WARMUP = 2


def decode_worker(case: str, C: int, n_steps: int, threads: int, vocab: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    n_tokens = DECODE_WARMUP + 1 + n_steps
    module, prefill, step = _decoder(case, C, n_tokens, vocab)
    module.eval()
    ctx = torch.randint(0, vocab, (1, C))
    toks = torch.randint(0, vocab, (1, n_tokens))
    rss_entry = _rss_bytes()
    with torch.no_grad():
        # a throw-away prefill and step (one-time work), then the measured ones
        prefill(ctx[:, : min(C, 64)])
        step(toks[:, :1])
        peak_prefill = _profiled_peak(lambda: prefill(ctx))
        p0, t0 = time.process_time(), time.perf_counter()
        prefill(ctx)
        prefill_cpu, prefill_wall = time.process_time() - p0, time.perf_counter() - t0
        for i in range(DECODE_WARMUP):
            step(toks[:, i : i + 1])
        peak_step = _profiled_peak(lambda: step(toks[:, DECODE_WARMUP : DECODE_WARMUP + 1]))
        cf, wf = [], []
        load0 = os.getloadavg()[0]
        c0, w0 = time.process_time(), time.perf_counter()
        for i in range(DECODE_WARMUP + 1, n_tokens):
            p0, t0 = time.process_time(), time.perf_counter()
            step(toks[:, i : i + 1])
            wf.append(time.perf_counter() - t0)
            cf.append(time.process_time() - p0)
        c1, w1 = time.process_time(), time.perf_counter()
    return {
        "case": case,
        "L": C,
        "token_cpu_ms": 1e3 * statistics.median(cf),
        "token_cpu_mean_ms": 1e3 * statistics.fmean(cf),
        "token_cpu_min_ms": 1e3 * min(cf),
        "token_cpu_max_ms": 1e3 * max(cf),
        "token_ms": 1e3 * statistics.median(wf),
        "prefill_cpu_s": prefill_cpu,
        "prefill_s": prefill_wall,
        "peak_prefill_MB": peak_prefill / 2**20,
        "peak_token_MB": peak_step / 2**20,
        "rss_run_MB": (_maxrss_bytes() - rss_entry) / 2**20,
        "steps": n_steps,
        "cpu_util": (c1 - c0) / max(w1 - w0, 1e-9) / threads,
        "loadavg_1m": [load0, os.getloadavg()[0]],
        "n_params": sum(p.numel() for p in module.parameters()),
        "torch": torch.__version__,
        **_versions(case),
    }


def _versions(case: str) -> dict:
    if ":hf" not in case:
        return {}
    import transformers

    return {"transformers": transformers.__version__}


# ====================================================================== the orchestrator
def python_for(case: str) -> str:
    return HF457_PY if ":hf457:" in case else MAIN_PY


def floor_of(case: str) -> str:
    """The ``none`` case every ratio of ``case`` is taken against (a patched HF model: the unpatched one)."""
    kind = case.split(":", 1)[0]
    if ":hfpatch:" in case:
        return f"{kind}:hf:llama"
    return "decode:posenc:none" if kind.startswith("decode") else f"{kind}:posenc:none"


def match_of(case: str) -> str | None:
    """The posenc case an HF case is compared with."""
    kind, _, rest = case.partition(":")
    if kind.startswith("decode"):
        enc = HF_DECODE.get(case, (None,))[0]
        return f"{kind}:posenc:{enc}" if enc else None
    if rest in HF_CASES:
        return f"{kind}:posenc:{HF_CASES[rest][1]}"
    return None


def default_repeats(L: int) -> int:
    """Timed training steps per process (the median is reported)."""
    return 5 if L <= 512 else 3 if L <= 2048 else 2


def default_cases(
    kinds: list[str], encodings: list[str], hf: bool, decode: bool, patched: list[str] | None = None
) -> list[str]:
    encs = ["none"] + [e for e in encodings if e != "none"]  # the floor first, so ratios print as it goes
    patched = patched or []
    if decode:
        cases = [f"decode:posenc:{e}" for e in encs]
        if "transformer-xl" in encs:
            cases.append("decode-mem:posenc:transformer-xl")
        if hf:
            cases += [c for c, (e, _) in HF_DECODE.items() if e in encs]
        if patched:
            cases += [c for c in ["decode:hf:llama"] if c not in cases] + [f"decode:hfpatch:{e}" for e in patched]
        return cases
    cases = []
    for kind in kinds:
        cases += [f"{kind}:posenc:{e}" for e in encs]
        if hf:
            cases += [f"{kind}:{pid}" for pid, (k, e, _) in HF_CASES.items() if k == kind and e in encs]
    if patched:
        cases += [c for c in ["lm:hf:llama"] if c not in cases] + [f"lm:hfpatch:{e}" for e in patched]
    return cases


def unbuildable(encodings: list[str], vocab: int) -> dict[str, str]:
    """Encodings that cannot be built at this model size with the default options (plus ENC_OPTIONS)."""
    import posenc  # noqa: F401
    from posenc.registry import build

    dims = dict(d_model=D, n_heads=H, head_dim=DH, max_len=512, vocab_size=vocab, n_layers=N_LAYERS, causal=True)
    bad = {}
    for e in encodings:
        try:
            build(e, dims=dims, options=dict(ENC_OPTIONS.get(e, {})) or None)
        except Exception as exc:  # noqa: BLE001 (any failure to build is reported, not raised)
            bad[e] = f"{type(exc).__name__}: {exc}"
    return bad


def load(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.exists() else []


def _fmt_line(rec: dict, records: list[dict]) -> str:
    case, L = rec["case"], rec["L"]
    if "skipped" in rec or "error" in rec:
        lines = [ln for ln in (rec.get("skipped") or rec.get("error", "")).splitlines() if ln.strip()] or ["?"]
        return f"L={L:5d} {case:44s} {'ERROR: ' if 'error' in rec else ''}{lines[-1][-400:]}"
    fl = next((r for r in records if r["case"] == floor_of(case) and r["L"] == L and "error" not in r), None)
    if "token_cpu_ms" in rec:
        line = (
            f"L={L:5d} {case:44s} {rec['token_cpu_ms']:8.2f} ms/token (wall {rec['token_ms']:.2f}) "
            f"prefill {rec['prefill_cpu_s']:.3f}s peak {rec['peak_prefill_MB']:.0f}MB"
        )
        if fl and "token_cpu_ms" in fl:
            line += f" ×none {rec['token_cpu_ms'] / fl['token_cpu_ms']:.2f}"
    else:
        line = (
            f"L={L:5d} {case:44s} step {rec['step_cpu_s']:.3f}s (wall {rec['step_s']:.3f}) "
            f"fwd {rec['fwd_cpu_s']:.3f}s peak {rec['peak_step_MB']:.0f}MB rss+{rec['rss_step_MB']:.0f}MB"
        )
        if fl and "step_cpu_s" in fl:
            line += (
                f" ×none {rec['step_cpu_s'] / fl['step_cpu_s']:.2f} "
                f"mem×{rec['peak_step_MB'] / max(fl['peak_step_MB'], 1e-9):.2f}"
            )
    m = match_of(case)
    mr = next((r for r in records if r["case"] == m and r["L"] == L and "error" not in r), None) if m else None
    if mr and "step_cpu_s" in mr and "step_cpu_s" in rec:
        line += f" posenc/HF {mr['step_cpu_s'] / rec['step_cpu_s']:.2f}"
    if mr and "token_cpu_ms" in mr and "token_cpu_ms" in rec:
        line += f" posenc/HF {mr['token_cpu_ms'] / rec['token_cpu_ms']:.2f}"
    return line + f" load {rec['loadavg_1m'][0]:.1f}"


def run(args: argparse.Namespace) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.tag}.json"
    records = load(path)
    kinds = ["lm", "classifier"] if args.model == "both" else [args.model]
    if args.decode:
        lengths = args.lengths or ([256, 512] if args.quick else [1024, 4096])
    else:
        lengths = args.lengths or ([256, 512] if args.quick else [512, 1024, 2048])
    skipped_encs: dict[str, str] = {}
    if args.cases:
        cases = args.cases
    else:
        if args.all:
            import posenc

            encs = posenc.available()
        else:
            encs = args.encodings or (QUICK_ENCODINGS if args.quick else DEFAULT_ENCODINGS)
        skipped_encs = unbuildable(encs, args.vocab)
        for e, why in skipped_encs.items():
            print(f"skip encoding {e}: cannot be built with default options ({why})", flush=True)
        cases = default_cases(
            kinds, [e for e in encs if e not in skipped_encs], not args.no_hf, args.decode, args.hf_patch
        )
    if args.dry_run:
        for L in lengths:
            for case in cases:
                big = L >= TOO_BIG.get(case, 1 << 30) and not args.allow_big
                have = any(r["case"] == case and r["L"] == L for r in records)
                note = " (too big: skipped)" if big else " (done)" if have and not args.force else ""
                print(f"L={L:5d} {case} [{python_for(case)}]{note}")
        return
    env = dict(os.environ, **MALLOC_ENV, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT / "src"))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    done = {(r["case"], r["L"]) for r in records if "error" not in r}  # failed cases are tried again
    for e, why in skipped_encs.items():  # recorded so that the report lists them
        for L in lengths:
            for kind in ["decode"] if args.decode else kinds:
                c = f"{kind}:posenc:{e}"
                if (c, L) not in done:
                    records.append({"case": c, "L": L, "skipped": f"cannot be built with default options: {why}"})
    path.write_text(json.dumps(records, indent=1))
    t_start = time.perf_counter()
    for L in lengths:
        for case in cases:
            key = (case, L)
            if key in done and not args.force:
                continue
            if L >= TOO_BIG.get(case, 1 << 30) and not args.allow_big:
                rec = {"case": case, "L": L, "skipped": "does not fit in this machine's memory (--allow-big to try)"}
            else:
                spec = {
                    "case": case,
                    "L": L,
                    "threads": args.threads,
                    "vocab": args.vocab,
                    "batch": args.batch,
                    "steps": args.steps,
                    "repeats": args.repeats or (1 if args.quick else default_repeats(L)),
                }
                cmd = [python_for(case), str(Path(__file__)), "worker", json.dumps(spec)]
                t0 = time.perf_counter()
                try:
                    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                    if p.returncode == 0 and lines:
                        rec = json.loads(lines[-1])
                    else:
                        rec = {"case": case, "L": L, "error": (p.stderr or p.stdout)[-1500:] or f"exit {p.returncode}"}
                except subprocess.TimeoutExpired:
                    rec = {"case": case, "L": L, "error": f"timeout after {args.timeout} s"}
                rec["process_wall_s"] = time.perf_counter() - t0
                rec["config"] = {k: spec[k] for k in ("threads", "vocab", "batch")} | {
                    "d_model": D,
                    "n_heads": H,
                    "d_ff": D_FF,
                    "n_layers": N_LAYERS,
                }
                if case.startswith("decode"):
                    rec["config"]["batch"] = 1
                rec["malloc_env"] = MALLOC_ENV
            records = [r for r in records if (r["case"], r["L"]) != key] + [rec]
            path.write_text(json.dumps(records, indent=1))
            print(_fmt_line(rec, records), flush=True)
    print(f"finished in {time.perf_counter() - t_start:.0f} s; results in {path}", flush=True)


# ========================================================================== the report
def _cell(v: float | None, base: float | None, fmt: str) -> str:
    if v is None:
        return "—"
    s = format(v, fmt)
    return f"{s} ({v / base:.2f}×)" if base else s


def report(args: argparse.Namespace) -> None:
    records = load(RESULTS / f"{args.tag}.json")
    cpu = args.metric in ("cpu", "cpu-min")
    best = args.metric == "cpu-min"  # the fastest repeat: another process on the machine only ever adds time
    ok = {(r["case"], r["L"]): r for r in records if "error" not in r and "skipped" not in r}

    def step_t(r):
        return (r["step_cpu_min_s"] if best else r["step_cpu_s"]) if cpu else r["step_s"]

    def tok_t(r):
        return (r["token_cpu_min_ms"] if best else r["token_cpu_ms"]) if cpu else r["token_ms"]

    def fwd_t(r):
        return r["fwd_cpu_s"] if cpu else r["fwd_s"]

    def prefill_t(r):
        return r["prefill_cpu_s"] if cpu else r["prefill_s"]

    out = [f"# {args.tag}: whole models, CPU fp32, one thread ({args.metric} time)", ""]
    suffix = "" if args.metric == "cpu" else f"-{args.metric}"
    cfg = {k: sorted({r["config"][k] for r in ok.values() if "config" in r}) for k in ("vocab", "threads")}
    cfg_s = {k: ", ".join(map(str, v)) for k, v in cfg.items()}
    train_b = sorted({r["config"]["batch"] for r in ok.values() if "config" in r and "step_cpu_s" in r})
    out.append(
        f"{N_LAYERS} layers, d_model {D}, {H} heads, d_ff {D_FF}; vocabulary {cfg_s['vocab']}, training batch "
        f"{', '.join(map(str, train_b))}, decoding batch 1, threads {cfg_s['threads']}. "
        "Each cell: value (ratio to `none` of the same model and L, from this file)."
    )
    if any(len(v) > 1 for v in (*cfg.values(), train_b)):
        out.append("**Warning: this file mixes runs of different settings; ratios across them are not meaningful.**")
    order = {e: i for i, e in enumerate(DEFAULT_ENCODINGS)}

    def encs_of(prefix: str) -> list[str]:
        es = {c[len(prefix) :] for c, _ in ok if c.startswith(prefix)}
        return sorted(es, key=lambda e: (order.get(e, 999), e))

    # ---- training step
    for kind, title in (("lm", "LanguageModel (causal)"), ("classifier", "SequenceClassifier (bidirectional)")):
        prefix = f"{kind}:posenc:"
        encs = encs_of(prefix)
        if not encs:
            continue
        lengths = sorted({L for c, L in ok if c.startswith(prefix)})
        out += ["", f"## Training step: {title}", ""]
        out.append(
            "Forward + loss + backward (no optimizer step), batch 2. Time: median "
            f"{args.metric} seconds of the repeats; memory: allocator peak of one step above the level at entry "
            "(torch.profiler). Ratios: / the `none` model at the same L."
        )
        out += ["", "| encoding | " + " | ".join(f"L={L} step s | L={L} peak MB" for L in lengths) + " |"]
        out.append("|---|" + "---|---|" * len(lengths))
        for e in encs:
            cells = []
            for L in lengths:
                r, fl = ok.get((prefix + e, L)), ok.get((prefix + "none", L))
                cells.append(_cell(step_t(r) if r else None, step_t(fl) if fl else None, ".3f"))
                cells.append(_cell(r["peak_step_MB"] if r else None, fl["peak_step_MB"] if fl else None, ".0f"))
            out.append(f"| {e} | " + " | ".join(cells) + " |")
        out += ["", "No-grad forward of the same batch, and the process's RSS growth during one step (ru_maxrss):", ""]
        out += ["| encoding | " + " | ".join(f"L={L} fwd s | L={L} RSS+ MB" for L in lengths) + " |"]
        out.append("|---|" + "---|---|" * len(lengths))
        for e in encs:
            cells = []
            for L in lengths:
                r, fl = ok.get((prefix + e, L)), ok.get((prefix + "none", L))
                cells.append(_cell(fwd_t(r) if r else None, fwd_t(fl) if fl else None, ".3f"))
                cells.append(_cell(r["rss_step_MB"] if r else None, fl["rss_step_MB"] if fl else None, ".0f"))
            out.append(f"| {e} | " + " | ".join(cells) + " |")

    # ---- decoding
    dec = {c for c, _ in ok if c.startswith("decode")}
    if dec:
        lengths = sorted({L for c, L in ok if c.startswith("decode")})
        rows = [f"decode:posenc:{e}" for e in encs_of("decode:posenc:")]
        rows += sorted(
            (c for c in dec if not c.startswith("decode:posenc:")), key=lambda c: (":hf" in c, c.split(":")[-1], c)
        )
        out += ["", "## KV-cache decoding: LanguageModel, batch 1", ""]
        out.append(
            "Prefill a context of L tokens, then single-token steps under `torch.no_grad` (median of the steps, "
            "after 2 warm-up steps). Peak: allocator peak of the prefill (cache included). "
            "`decode-mem:` rows decode with Transformer-XL's segment memory (each layer's input for the last L "
            "tokens, re-projected every step) instead of a KV cache. Ratios: / `decode:posenc:none`."
        )
        hdr = " | ".join(f"L={L} ms/token | L={L} prefill s | L={L} peak MB" for L in lengths)
        out += ["", f"| case | {hdr} |", "|---|" + "---|---|---|" * len(lengths)]
        for c in rows:
            cells = []
            for L in lengths:
                r, fl = ok.get((c, L)), ok.get(("decode:posenc:none", L))
                cells.append(_cell(tok_t(r) if r else None, tok_t(fl) if fl else None, ".2f"))
                cells.append(_cell(prefill_t(r) if r else None, prefill_t(fl) if fl else None, ".3f"))
                cells.append(_cell(r["peak_prefill_MB"] if r else None, fl["peak_prefill_MB"] if fl else None, ".0f"))
            name = c[len("decode:posenc:") :] if c.startswith("decode:posenc:") else c
            out.append(f"| {name} | " + " | ".join(cells) + " |")

    # ---- HF beside posenc
    hf_rows = sorted(
        ((c, L) for c, L in ok if ":hf" in c and ":hfpatch:" not in c),
        key=lambda t: (not t[0].startswith("lm"), t[0].startswith("decode"), t[0], t[1]),
    )
    if hf_rows:
        out += ["", "## posenc beside the Hugging Face model of the same size", ""]
        out.append(
            "Same step, same batch, same sizes. `HF ×none`: the HF model / posenc's `none` model of the same "
            "kind; `posenc / HF`: the matching posenc encoding / the HF model (< 1: posenc faster or smaller). "
            "For decoding rows the times are ms per token."
        )
        out += [
            "",
            "| HF case | posenc match | L | HF time | HF peak MB | HF ×none time | HF ×none mem | posenc time "
            "| posenc peak MB | posenc / HF time | posenc / HF mem | params HF / posenc |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c, L in hf_rows:
            r, fl, m = ok[(c, L)], ok.get((floor_of(c), L)), ok.get((match_of(c) or "", L))
            if "token_cpu_ms" in r:
                t, mem = tok_t, (lambda x: x["peak_prefill_MB"])
                fmt = ".2f"
            else:
                t, mem = step_t, (lambda x: x["peak_step_MB"])
                fmt = ".3f"
            row = [c, (match_of(c) or "—").split(":")[-1], str(L), format(t(r), fmt), f"{mem(r):.0f}"]
            row += [f"{t(r) / t(fl):.2f}", f"{mem(r) / max(mem(fl), 1e-9):.2f}"] if fl else ["—", "—"]
            if m:
                row += [format(t(m), fmt), f"{mem(m):.0f}", f"{t(m) / t(r):.2f}", f"{mem(m) / max(mem(r), 1e-9):.2f}"]
                row.append(f"{r['n_params'] / 1e6:.2f}M / {m['n_params'] / 1e6:.2f}M")
            else:
                row += ["—"] * 5
            out.append("| " + " | ".join(row) + " |")
        out += ["", "HF models as built:", ""]
        for pid, (kind, enc, note) in HF_CASES.items():
            out.append(f"- `{kind}:{pid}` (vs posenc `{enc}`): {note}")
        for c, (enc, note) in HF_DECODE.items():
            out.append(f"- `{c}` (vs posenc `{enc}`): {note}")

    # ---- HF models patched by posenc.hf
    patched = sorted(((c, L) for c, L in ok if ":hfpatch:" in c), key=lambda t: (t[0].startswith("decode"), t))
    if patched:
        out += ["", "## Hugging Face Llama patched by posenc.hf", ""]
        out.append(
            "`lm:hf:llama` above with `posenc.hf.patch(model, <encoding>)`: its training step (or ms per decoded "
            "token) and allocator peak / the unpatched model's at the same L. Targets (issue 16): <= 1.10x for "
            "rotary encodings, <= 1.25x for biases."
        )
        out += ["", "| case | L | time | × unpatched | peak MB | × unpatched |", "|---|---|---|---|---|---|"]
        for c, L in patched:
            r, fl = ok[(c, L)], ok.get((floor_of(c), L))
            dec = "token_cpu_ms" in r
            t = tok_t if dec else step_t
            mem = (lambda x: x["peak_prefill_MB"]) if dec else (lambda x: x["peak_step_MB"])
            fmt = ".2f" if dec else ".3f"
            ratio = [f"{t(r) / t(fl):.2f}", f"{mem(r):.0f}", f"{mem(r) / max(mem(fl), 1e-9):.2f}"] if fl else [
                "—", f"{mem(r):.0f}", "—"]
            out.append(f"| {c} | {L} | {format(t(r), fmt)} | " + " | ".join(ratio) + " |")

    bad = [r for r in records if ("error" in r or "skipped" in r) and (r["case"], r["L"]) not in ok]
    if bad:
        out += ["", "## Not measured", ""]
        for r in sorted(bad, key=lambda r: (r["case"], r["L"])):
            why = r.get("skipped") or (r["error"].strip().splitlines() or ["?"])[-1][:300]
            out.append(f"- {r['case']} at L={r['L']}: {why}")
    text = "\n".join(out) + "\n"
    dest = RESULTS / f"{args.tag}{suffix}.md"
    dest.write_text(text)
    print(text)
    print(f"wrote {dest}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        spec = json.loads(sys.argv[2])
        if spec["case"].startswith("decode"):
            rec = decode_worker(spec["case"], spec["L"], spec["steps"], spec["threads"], spec["vocab"])
        else:
            rec = train_worker(spec["case"], spec["L"], spec["repeats"], spec["threads"], spec["vocab"], spec["batch"])
        print(json.dumps(rec))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser(
        "run",
        help="measure (resumable: a (case, L) already in the JSON is skipped unless --force)",
        description="Measure the training step (default) or KV-cache decoding (--decode); one process per (case, L).",
    )
    r.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        help="sequence lengths (training; default 512 1024 2048) or contexts (--decode; default 1024 4096)",
    )
    r.add_argument("--encodings", nargs="+", help=f"posenc encodings (default: {' '.join(DEFAULT_ENCODINGS)})")
    r.add_argument("--all", action="store_true", help="every registered encoding (unbuildable ones are reported)")
    r.add_argument(
        "--hf-patch",
        nargs="+",
        metavar="ENC",
        default=[],
        help="also time HF's Llama patched by posenc.hf with each ENC (against the unpatched lm:hf:llama)",
    )
    r.add_argument(
        "--cases",
        nargs="+",
        help="explicit case ids, e.g. lm:posenc:rope lm:hf:llama classifier:hf457:nezha decode:posenc:t5 "
        "decode-mem:posenc:transformer-xl (overrides --encodings/--model/--no-hf)",
    )
    r.add_argument(
        "--model",
        choices=("lm", "classifier", "both"),
        default="lm",
        help="posenc.LanguageModel (causal; HF: Llama, XLNet, Transformer-XL) or posenc.SequenceClassifier "
        "(bidirectional; HF: T5 encoder, DeBERTa-v2, BERT relative_key(_query), NEZHA); default lm",
    )
    r.add_argument("--decode", action="store_true", help="KV-cache decoding per token instead of the training step")
    r.add_argument("--no-hf", action="store_true", help="posenc models only (no Hugging Face cases)")
    r.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: L=256 512, one repeat, encodings {' '.join(QUICK_ENCODINGS)} (unless given)",
    )
    r.add_argument("--repeats", type=int, help="timed training steps per process (default 5 / 3 / 2 by L)")
    r.add_argument("--steps", type=int, default=32, help="timed decoding steps (default 32)")
    r.add_argument("--vocab", type=int, default=8192, help="vocabulary size of every model (default 8192)")
    r.add_argument("--batch", type=int, default=2, help="training batch (default 2; decoding is batch 1)")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--timeout", type=int, default=3600, help="seconds per process (default 3600)")
    r.add_argument("--allow-big", action="store_true", help="also run the cases listed as too big (TOO_BIG)")
    r.add_argument("--tag", default="models-cpu-fp32", help="results/<tag>.json (default models-cpu-fp32)")
    r.add_argument("--force", action="store_true", help="re-measure (case, L) already in the JSON")
    r.add_argument("--dry-run", action="store_true", help="print the (case, L) that would run, and exit")
    p = sub.add_parser("report", help="markdown tables (results/<tag>.md) from the JSON")
    p.add_argument("--tag", default="models-cpu-fp32")
    p.add_argument(
        "--metric",
        choices=("cpu", "cpu-min", "wall"),
        default="cpu",
        help="median CPU seconds of the repeats (default), the fastest repeat's CPU seconds, or wall seconds",
    )
    args = ap.parse_args()
    (run if args.cmd == "run" else report)(args)


if __name__ == "__main__":
    main()
