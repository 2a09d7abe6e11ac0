"""Cross-check posenc's RULER scoring (posenc.extend.ruler_data) with NVIDIA/RULER's own scripts.

Given a RULER work tree (fetched, never committed here: ``git --git-dir=<RULER git dir> archive HEAD | tar -x -C
/tmp/ruler``), this script

1. runs RULER's ``scripts/data/prepare.py`` offline for the tasks that need no download (niah_single_1,
   niah_multikey_2, niah_multikey_3, vt, cwe, fwe) at ``--length`` tokens with a local Hugging Face tokenizer, and
   records what fails (the essay NIAH tasks want ``PaulGrahamEssays.json`` and qa_1 / qa_2 SQuAD and HotpotQA, all
   downloads); ``--template chat`` wraps the prompts in the tokenizer's chat template, registered in RULER's
   ``Templates`` at run time (RULER's files are not changed);
2. checks every line posenc's reader accepts and that ``length`` (RULER's token count plus its budget) fits;
3. writes predictions that exercise RULER's post-processing and metrics (exact, upper-cased, partial, wrapped in
   control characters, split by one, empty, whitespace only) in RULER's prediction format, or, with ``--model``,
   the model's own through ``score_ruler_data``;
4. scores them with RULER's ``scripts/eval/evaluate.py`` (run as a program: its summary.csv) and per sample with
   RULER's ``postprocess_pred`` and metric functions, and with posenc's ``ruler_data``; every per-sample score and
   every task score must be equal (exit status 1 where one is not).

RULER imports ``nemo`` only for ``read_manifest``; a stand-in module with that one function (written here) is put on
the path. RULER also wants ``tenacity`` (PyPI, 32 kB) and ``wonderwords`` (posenc's extend extra), and nltk's
``punkt``, which it tries to download and, offline, goes on without (only the essay haystacks use it).

    nice -n 10 .venv/bin/python benchmarks/ruler_crosscheck.py --ruler /tmp/ruler --length 1024 --samples 4
    nice -n 10 .venv/bin/python benchmarks/ruler_crosscheck.py --ruler /tmp/ruler --tasks niah_single_1 \\
        --length 4096 --samples 10 --model smollm2-135m --posenc      # SmolLM2 on RULER's data and on posenc's
"""

from __future__ import annotations

import argparse
import ast
import csv
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from posenc.extend import ruler_data

OFFLINE = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
DOWNLOADS = {
    **{
        t: "essay haystack: scripts/data/synthetic/json/PaulGrahamEssays.json, made by download_paulgraham_essay.py"
        for t in ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")
    },
    "qa_1": "SQuAD, downloaded by scripts/data/synthetic/json/download_qa_dataset.sh",
    "qa_2": "HotpotQA, downloaded by scripts/data/synthetic/json/download_qa_dataset.sh",
}
MANIFEST = '''"""Stand-in for nemo.collections.asr.parts.utils.manifest_utils (RULER imports only these two)."""
import json


def read_manifest(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_manifest(path, rows, ensure_ascii=True):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=ensure_ascii) + "\\n")
'''


def checkout_problem(ruler: Path | None) -> str | None:
    """Why ``ruler`` is not a usable RULER work tree (None when it is)."""
    if ruler is None:
        return "no RULER checkout given (--ruler DIR or POSENC_RULER_DIR)"
    need = (
        "scripts/data/prepare.py",
        "scripts/eval/evaluate.py",
        "scripts/eval/synthetic/constants.py",
        "scripts/synthetic.yaml",
    )
    missing = [p for p in need if not (ruler / p).is_file()]
    if missing:
        return f"{ruler} is not a RULER work tree: it lacks {', '.join(missing)}"
    for mod in ("wonderwords", "tenacity", "nltk", "yaml", "pandas", "scipy", "transformers"):
        if importlib.util.find_spec(mod) is None:
            return f"RULER's scripts need the {mod} package, which is not installed"
    return None


def working_tree(ruler: Path, where: Path) -> tuple[Path, list[str]]:
    """A copy of RULER's scripts under ``where`` to run: a Git LFS pointer in place of a json file (the checkout's
    ``english_words.json``, cwe's fallback list) becomes ``{}``: cwe takes words from it only where it needs more
    than wonderwords' 8,166, which no length here does; where it would, RULER's ``random.sample`` fails loudly."""
    tree = where / "ruler"
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(ruler / "scripts", tree / "scripts")
    swapped = []
    for f in sorted((tree / "scripts").rglob("*.json")):
        if f.read_bytes().startswith(b"version https://git-lfs"):
            f.write_text("{}", encoding="utf-8")
            swapped.append(str(f.relative_to(tree)))
    return tree, swapped


def make_shim(where: Path) -> Path:
    pkg = where / "nemo" / "collections" / "asr" / "parts" / "utils"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "manifest_utils.py").write_text(MANIFEST, encoding="utf-8")
    return where


def _env(shim: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # prepare.py runs `python`
    return env


def chat_template(tokenizer_path: str) -> str:
    """The tokenizer's chat template around one user turn, with RULER's ``{task_template}`` slot."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "@@TASK@@"}], tokenize=False, add_generation_prompt=True
    )
    return text.replace("{", "{{").replace("}", "}}").replace("@@TASK@@", "{task_template}")


def prepare(
    ruler: Path, shim: Path, task: str, tokenizer: str, length: int, samples: int, save: Path, template: str, seed: int
) -> dict[str, Any]:
    """RULER's prepare.py for ``task``; the file it wrote (or why none) and the seconds it took."""
    argv = [
        "prepare.py",
        "--save_dir",
        str(save),
        "--benchmark",
        "synthetic",
        "--task",
        task,
        "--tokenizer_path",
        tokenizer,
        "--tokenizer_type",
        "hf",
        "--max_seq_length",
        str(length),
        "--num_samples",
        str(samples),
        "--random_seed",
        str(seed),
        "--model_template_type",
        "base" if template == "base" else "posenc-chat",
    ]
    chat = f"template.Templates['posenc-chat'] = {chat_template(tokenizer)!r}; " if template != "base" else ""
    boot = (
        f"import runpy, sys; sys.path.insert(0, '.'); import template; {chat}"
        f"sys.argv = {argv!r}; runpy.run_path('prepare.py', run_name='__main__')"
    )
    shutil.rmtree(save / task, ignore_errors=True)  # prepare.py keeps a file with as many lines, whatever its length
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-c", boot], cwd=ruler / "scripts" / "data", env=_env(shim), capture_output=True, text=True
    )
    seconds = round(time.perf_counter() - start, 1)
    path = save / task / "validation.jsonl"
    if run.returncode != 0 or not path.is_file():
        why = (run.stderr + run.stdout).strip().splitlines()
        tail = [x for x in why if "Error" in x or "error" in x][-1:] or why[-1:]
        return {"task": task, "ok": False, "seconds": seconds, "why": " ".join(tail)[:300]}
    return {"task": task, "ok": True, "seconds": seconds, "path": str(path)}


def edge_predictions(task: str, refs: list[str], i: int) -> str:
    """A prediction for sample ``i`` that exercises one of RULER's post-processing or metric cases."""
    joined = " ".join(refs)
    cases = [
        " " + joined + ".",  # all found
        joined.upper(),  # case-insensitive
        " ".join(refs[: max(1, len(refs) // 2)]) if len(refs) > 1 else "nothing here",  # partial / none
        "\x00\t " + joined + " \x1f\n",  # control characters at the ends: stripped
        refs[0][:2] + "\x01" + refs[0][2:] + " " + " ".join(refs[1:]),  # one split by a control character
        "",  # empty: a null
        " \n\t ",  # only whitespace: a null after post-processing
        joined + "\x7f",  # DEL is not in RULER's range: kept
    ]
    return cases[i % len(cases)]


def write_predictions(rows: list[dict[str, Any]], task: str, out: Path) -> None:
    """RULER's prediction lines (call_api.py's fields) with the edge predictions."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{task}.jsonl").open("w", encoding="utf-8") as f:
        for i, r in enumerate(rows):
            line = {
                "index": r["index"],
                "pred": edge_predictions(task, r["outputs"], i),
                "input": r["input"],
                "outputs": r["outputs"],
                "others": {},
                "truncation": -1,
                "length": r.get("length", -1),
            }
            f.write(json.dumps(line) + "\n")


def ruler_evaluate(ruler: Path, shim: Path, pred_dir: Path) -> dict[str, tuple[float, str]]:
    """RULER's evaluate.py on ``pred_dir``: {task: (score, nulls)} from the summary it writes."""
    run = subprocess.run(
        [sys.executable, "evaluate.py", "--data_dir", str(pred_dir), "--benchmark", "synthetic"],
        cwd=ruler / "scripts" / "eval",
        env=_env(shim),
        capture_output=True,
        text=True,
    )
    files = sorted(pred_dir.glob("summary*.csv"))
    if run.returncode != 0 or not files:
        raise RuntimeError(f"RULER's evaluate.py failed (exit {run.returncode}): {run.stderr.strip()[-800:]}")
    with files[0].open(encoding="utf-8") as f:
        table = list(csv.reader(f))[1:]  # pandas' header row of column numbers
    rows = {r[0]: r[1:] for r in table}
    return {t: (float(s), n) for t, s, n in zip(rows["Tasks"], rows["Score"], rows["Nulls"])}


def ruler_functions(ruler: Path) -> tuple[Any, dict[str, Any]]:
    """RULER's own ``postprocess_pred`` (compiled from evaluate.py's source: importing it would run its command
    line) and its metric of each family (eval/synthetic/constants.py)."""
    source = (ruler / "scripts" / "eval" / "evaluate.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "postprocess_pred"]
    space: dict[str, Any] = {"re": __import__("re")}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(ruler / "scripts/eval/evaluate.py"), "exec"), space)
    spec = importlib.util.spec_from_file_location("ruler_eval_constants", ruler / "scripts/eval/synthetic/constants.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return space["postprocess_pred"], {k: v["metric_fn"] for k, v in mod.TASKS.items()}


def compare(ruler: Path, shim: Path, pred_dir: Path, ours: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each task's per-sample and task scores, RULER's against posenc's."""
    post, metrics = ruler_functions(ruler)
    official = ruler_evaluate(ruler, shim, pred_dir)
    out = []
    for task, s in ours.items():
        rows = ruler_data.read_jsonl(pred_dir / f"{task}.jsonl")
        theirs = [metrics[ruler_data.family(task)]([post(r["pred"], {})], [r["outputs"]]) for r in rows]
        mine = [round(100 * x, 2) for x in s["scores"]]
        bad = [i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b]
        out.append(
            {
                "task": task,
                "samples": len(rows),
                "ruler_task": official.get(task),
                "posenc_task": (s["score"], s["nulls"]),
                "per_sample_equal": not bad and len(theirs) == len(mine),
                "task_equal": official.get(task) == (s["score"], s["nulls"]),
                "differ_at": bad[:10],
            }
        )
    return out


def posenc_side(model: Any, tok: Any, task: str, length: int, samples: int, template: str) -> dict[str, Any]:
    """posenc's own generator and asking (posenc.extend.ruler) on ``samples`` haystacks of ``task`` at ``length``,
    one question each, under the template RULER's data was prepared with (``base`` or ``chat``)."""
    from posenc.extend import ruler

    start = time.perf_counter()
    scores = []
    for seed in range(samples):
        ex = ruler.build(task, tok, length, seed=seed, template=template)
        scores += [r["score"] for r in ruler.ask(model, tok, ex)]
    return {
        "task": task,
        "length": length,
        "samples": len(scores),
        "score": ruler_data.task_score(scores),
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ruler", type=Path, default=os.environ.get("POSENC_RULER_DIR"), help="a RULER work tree")
    p.add_argument("--tokenizer", help="a local Hugging Face tokenizer folder (default: posenc's SmolLM2 folder)")
    p.add_argument("--tasks", nargs="+", default=list(OFFLINE))
    p.add_argument("--length", type=int, default=1024, help="RULER's --max_seq_length")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seed", type=int, default=42, help="RULER's --random_seed")
    p.add_argument("--template", choices=("base", "chat"), default="base")
    p.add_argument("--out", type=Path, default=Path("/tmp/ruler-crosscheck"))
    p.add_argument("--model", help="score this model (posenc.hf.load_pretrained's name or path) on RULER's data")
    p.add_argument("--posenc", action="store_true", help="with --model: also posenc's own generator, same length")
    p.add_argument("--threads", type=int, default=1, help="torch's CPU threads (the machine is shared)")
    a = p.parse_args(argv)
    problem = checkout_problem(a.ruler)
    if problem:
        print(f"ruler_crosscheck: skipped: {problem}", file=sys.stderr)
        return 2
    model = tok = None
    if a.model:
        import torch

        import posenc.hf

        torch.set_num_threads(a.threads)

        model, tok = posenc.hf.load_pretrained(a.model, quiet=True)
    if a.tokenizer is None:
        folders = sorted(Path.home().glob(".cache/posenc/models/SmolLM2-135M-Instruct*/tokenizer.json"))
        if not folders:
            print(
                "ruler_crosscheck: no --tokenizer and no posenc SmolLM2 folder (run posenc extend once)",
                file=sys.stderr,
            )
            return 2
        a.tokenizer = str(folders[-1].parent)
    shim = make_shim(a.out / "shim")
    tree, swapped = working_tree(a.ruler, a.out)
    data, preds = a.out / "data", a.out / "pred"
    for old in (preds, a.out / "model"):
        shutil.rmtree(old, ignore_errors=True)
    report: dict[str, Any] = {
        "ruler": str(a.ruler),
        "tokenizer": a.tokenizer,
        "length": a.length,
        "samples": a.samples,
        "template": a.template,
        "prepare": [],
        "not_offline": DOWNLOADS,
        "lfs_pointers_as_empty": swapped,
    }
    for task in a.tasks:
        r = prepare(tree, shim, task, a.tokenizer, a.length, a.samples, data, a.template, a.seed)
        if not r["ok"] and task in DOWNLOADS:
            r["why"] = f"needs a download ({DOWNLOADS[task]}): {r['why']}"
        if r["ok"]:
            rows = ruler_data.read_jsonl(r["path"])
            r["lengths"] = sorted({row["length"] for row in rows})
            r["fits"] = all(row["length"] <= a.length for row in rows)
            write_predictions(rows, task, preds)
        report["prepare"].append(r)
        print(f"prepare {task}: {'ok' if r['ok'] else 'FAILED: ' + r['why']} ({r['seconds']} s)", flush=True)
    if not any(r["ok"] for r in report["prepare"]):
        print(json.dumps(report, indent=1))
        return 1
    report["edge"] = compare(tree, shim, preds, ruler_data.score_predictions(preds))
    ok = all(c["per_sample_equal"] and c["task_equal"] for c in report["edge"])
    if model is not None:
        tasks = [r["task"] for r in report["prepare"] if r["ok"]]
        scored = a.out / "model"
        start = time.perf_counter()
        ruler_data.score_ruler_data(
            model, tok, data, scored, tasks=tasks, progress=lambda t, d, n: print(f"  {t} {d}/{n}", flush=True)
        )
        report["model_seconds"] = round(time.perf_counter() - start, 1)
        report["model"] = compare(tree, shim, scored, ruler_data.score_predictions(scored))
        ok = ok and all(c["per_sample_equal"] and c["task_equal"] for c in report["model"])
        if a.posenc:
            report["posenc"] = [
                posenc_side(model, tok, t, a.length, a.samples, a.template) for t in tasks if t in OFFLINE
            ]
    report["equal"] = ok
    (a.out / "crosscheck.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in report.items() if k != "not_offline"}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
