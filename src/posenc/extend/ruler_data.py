"""Score a model on the data NVIDIA/RULER's own scripts write, the way RULER scores it (Hsieh et al. 2024, "RULER:
What's the Real Context Size of Your Long-Context Language Models?"; github.com/NVIDIA/RULER).

**What it reads.** RULER's ``scripts/data/prepare.py`` writes one folder a task, ``DIR/<task>/<subset>.jsonl``
(subset ``validation`` by default), one sample a line: ``index``, ``input`` (the prompt with the model template
prepare.py was given, without the answer prefix), ``outputs`` (the references), ``length`` (the prompt's tokens
plus the task's generation budget), ``length_w_model_temp``, ``answer_prefix`` and, for the NIAH tasks,
``token_position_answer``. (Its NIAH script overwrites ``index`` with the character offset of the first answer in
``input``, so an ``index`` need not be unique: samples are kept in file order here.) A folder of RULER
predictions, ``DIR/<task>.jsonl`` with a ``pred`` on each line (what ``scripts/pred/call_api.py`` writes), is read
too.

**How it asks.** As RULER's ``scripts/pred/model_wrappers.py`` (``HuggingFaceModel``) does: the prompt is
``input + answer_prefix``, tokenised as one string with the tokenizer's special tokens (a BOS where the tokenizer
adds one); greedy decoding through transformers' ``generate`` of at most the task's budget (RULER's
``scripts/data/synthetic/constants.py``: 128 tokens for NIAH, 30 vt, 120 cwe, 50 fwe, 32 qa), stopping where the
model's generation config stops; the prediction is the decoded sequence (special tokens skipped) with the decoded
prompt cut off its front, as transformers' text-generation pipeline and RULER's wrapper do. RULER's default stop
words are none.

**How it scores.** As RULER's ``scripts/eval/evaluate.py`` and ``scripts/eval/synthetic/constants.py`` do: the
prediction stripped, every character from U+0000 to U+001F replaced by a newline, stripped again; then
``string_match_all`` (the share of the references found in the prediction, case-insensitive) for the NIAH tasks, vt,
cwe and fwe, ``string_match_part`` (1 if any reference is found) for qa_1 and qa_2. A sample's ``score`` here is in
[0, 1], unrounded; RULER's per-sample number is ``round(100 * score, 2)``. A task's score is RULER's:
``round(100 * mean, 2)``, and its ``nulls`` RULER's ``"empty/total"``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .ruler import postprocess, string_match_all

#: RULER's scripts/synthetic.yaml: each task's family (the key of its budget, template and metric)
FAMILY = {
    **{
        t: "niah"
        for t in (
            "niah_single_1",
            "niah_single_2",
            "niah_single_3",
            "niah_multikey_1",
            "niah_multikey_2",
            "niah_multikey_3",
            "niah_multivalue",
            "niah_multiquery",
        )
    },
    "vt": "variable_tracking",
    "cwe": "common_words_extraction",
    "fwe": "freq_words_extraction",
    "qa_1": "qa",
    "qa_2": "qa",
}
#: RULER's scripts/data/synthetic/constants.py: the tokens generated at most, per family
TOKENS_TO_GENERATE = {
    "niah": 128,
    "variable_tracking": 30,
    "common_words_extraction": 120,
    "freq_words_extraction": 50,
    "qa": 32,
}
#: RULER's scripts/eval/synthetic/constants.py: the metric of each family
METRIC = {
    "niah": "string_match_all",
    "variable_tracking": "string_match_all",
    "common_words_extraction": "string_match_all",
    "freq_words_extraction": "string_match_all",
    "qa": "string_match_part",
}



def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any of ``references`` is found in ``prediction``, case-insensitive, else 0.0 (RULER's qa metric)."""
    low = prediction.lower()
    return max(1.0 if r.lower() in low else 0.0 for r in references)


def family(task: str) -> str:
    """RULER's family of ``task`` (synthetic.yaml's names; a name starting ``niah`` counts as NIAH)."""
    if task in FAMILY:
        return FAMILY[task]
    if task.startswith("niah"):
        return "niah"
    raise ConfigError(
        f"{task!r} is not one of RULER's synthetic.yaml tasks ({', '.join(FAMILY)}): name the folder "
        "or file after the task RULER's prepare.py was run for"
    )


def score_sample(task: str, prediction: str, references: Sequence[str]) -> float:
    """One sample's score in [0, 1]: ``prediction`` post-processed, then the task's metric."""
    metric = string_match_part if METRIC[family(task)] == "string_match_part" else string_match_all
    return metric(postprocess(prediction), references)


def task_score(scores: Sequence[float]) -> float:
    """RULER's task score from the samples' scores in [0, 1]: ``round(100 * mean, 2)``."""
    if not scores:
        raise ConfigError("a task score needs at least one sample")
    return round(sum(scores) / len(scores) * 100, 2)


# ---------------------------------------------------------------------------------------------- reading
def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The samples of one RULER jsonl file, each checked for ``input`` (a string) and ``outputs`` (a non-empty
    list of strings)."""
    path = Path(path)
    rows = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{i} is not a JSON line ({err})") from None
            if not isinstance(row, dict) or not isinstance(row.get("input"), str):
                raise ConfigError(
                    f"{path}:{i} has no string 'input': a RULER sample has 'index', 'input', "
                    "'outputs' (prepare.py writes them)"
                )
            refs = row.get("outputs", [row.get("output", "")])
            if not isinstance(refs, list) or not refs or not all(isinstance(r, str) for r in refs):
                raise ConfigError(f"{path}:{i}: 'outputs' must be a non-empty list of strings, got {refs!r}")
            rows.append(row)
    if not rows:
        raise ConfigError(f"{path} holds no samples")
    return rows


def find_tasks(folder: str | Path, subset: str = "validation") -> dict[str, Path]:
    """The task files under ``folder``: prepare.py's ``<task>/<subset>.jsonl`` or call_api.py's ``<task>.jsonl``,
    in RULER's task order (synthetic.yaml), others after in name order."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"--ruler-data wants a folder of RULER jsonl files, {folder} is not a folder")
    found: dict[str, Path] = {}
    for p in sorted(folder.iterdir()):
        if p.is_dir() and (p / f"{subset}.jsonl").is_file():
            found[p.name] = p / f"{subset}.jsonl"
        elif p.is_file() and p.suffix == ".jsonl" and p.stem not in found:
            found[p.stem] = p
    if not found:
        raise ConfigError(
            f"{folder} holds no RULER data: expected <task>/{subset}.jsonl (prepare.py's --save_dir) "
            "or <task>.jsonl (call_api.py's --save_dir)"
        )
    order = {t: i for i, t in enumerate(FAMILY)}
    return dict(sorted(found.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


# ---------------------------------------------------------------------------------------------- asking
@torch.no_grad()
def predict(model: nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int) -> tuple[str, int]:
    """Greedy generation on ``prompt`` as RULER's HuggingFaceModel runs it; returns (prediction, tokens generated)."""
    device = next(model.parameters()).device
    enc = tokenizer(prompt, return_tensors="pt")
    ids = enc["input_ids"].to(device)
    mask = enc.get("attention_mask")
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    out = model.generate(
        input_ids=ids,
        attention_mask=None if mask is None else mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=pad,
    )
    full = tokenizer.decode(out[0].tolist(), skip_special_tokens=True)
    head = tokenizer.decode(ids[0].tolist(), skip_special_tokens=True)
    return full[len(head) :], int(out.shape[1] - ids.shape[1])


def _record(task: str, row: dict[str, Any], pred: str, generated: int | None) -> dict[str, Any]:
    """A line of RULER's prediction file (call_api.py's fields) with this module's score added."""
    refs = row.get("outputs", [row.get("output", "")])
    rec = {
        "index": row.get("index"),
        "pred": pred,
        "input": row["input"],
        "outputs": refs,
        "others": row.get("others", {}),
        "truncation": row.get("truncation", -1),
        "length": row.get("length", -1),
        "score": score_sample(task, pred, refs),
    }
    if generated is not None:
        rec["generated"] = generated
    return rec


def _summary(task: str, recs: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "task": task,
        "metric": METRIC[family(task)],
        "samples": len(recs),
        "score": task_score([r["score"] for r in recs]),
        "nulls": f"{sum(len(postprocess(r['pred'])) == 0 for r in recs)}/{len(recs)}",
        **extra,
    }


def _write(out: Path, task: str, recs: list[dict[str, Any]]) -> None:
    with (out / f"{task}.jsonl").open("w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def score_ruler_data(
    model: nn.Module,
    tokenizer: Any,
    folder: str | Path,
    out: str | Path,
    *,
    tasks: Sequence[str] | None = None,
    subset: str = "validation",
    limit: int | None = None,
    tokens_to_generate: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Ask ``model`` every sample of the RULER data under ``folder`` (see :func:`find_tasks`), score each as RULER's
    evaluate.py does, and write ``out/<task>.jsonl`` (RULER's prediction lines plus ``score`` and ``generated``:
    RULER's evaluate.py reads the folder as it is) and ``out/summary.json`` (per task: RULER's score, nulls, the
    samples, the seconds). ``tasks``: only these; ``limit``: the first ``limit`` samples of each task;
    ``tokens_to_generate``: a budget for every task instead of RULER's. A task file already in ``out`` whose lines
    are this data's first samples is continued, not redone. ``progress(task, done, total)`` after each sample.

    Returns the summary, one entry a task.
    """
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ConfigError(f"limit is a positive number of samples per task, got {limit!r}")
    if tokens_to_generate is not None and (not isinstance(tokens_to_generate, int) or tokens_to_generate < 1):
        raise ConfigError(f"tokens_to_generate is a positive number of tokens, got {tokens_to_generate!r}")
    found = find_tasks(folder, subset)
    if tasks is not None:
        missing = [t for t in tasks if t not in found]
        if missing:
            raise ConfigError(f"no RULER data for {', '.join(missing)} under {folder}; it holds {', '.join(found)}")
        found = {t: found[t] for t in tasks}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, dict[str, Any]] = {}
    for task, path in found.items():
        rows = read_jsonl(path)[:limit]
        budget = tokens_to_generate or TOKENS_TO_GENERATE[family(task)]
        recs: list[dict[str, Any]] = []
        if (out / f"{task}.jsonl").is_file():
            for old, row in zip(read_jsonl(out / f"{task}.jsonl"), rows):
                if old["input"] != row["input"] or "pred" not in old:
                    break
                recs.append(_record(task, row, old["pred"], old.get("generated")))
        start = time.perf_counter()
        for row in rows[len(recs) :]:
            pred, gen = predict(model, tokenizer, row["input"] + row.get("answer_prefix", ""), budget)
            recs.append(_record(task, row, pred, gen))
            _write(out, task, recs)
            if progress is not None:
                progress(task, len(recs), len(rows))
        _write(out, task, recs)
        summary[task] = _summary(
            task, recs, tokens_to_generate=budget, source=str(path), seconds=round(time.perf_counter() - start, 1)
        )
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary


def score_predictions(folder: str | Path, out: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """Score the predictions already in RULER's prediction files under ``folder`` (``<task>.jsonl`` with a ``pred``
    on each line, as call_api.py writes them), as RULER's evaluate.py does; with ``out``, write the scored lines
    and ``summary.json`` there. Returns the summary with each task's per-sample ``scores`` added."""
    summary: dict[str, dict[str, Any]] = {}
    for task, path in find_tasks(folder).items():
        rows = read_jsonl(path)
        if not all(isinstance(r.get("pred"), str) for r in rows):
            raise ConfigError(
                f"{path} has lines without a string 'pred': score_predictions reads RULER's "
                "prediction files; for prepare.py's data, use score_ruler_data with a model"
            )
        recs = [_record(task, r, r["pred"], r.get("generated")) for r in rows]
        summary[task] = {**_summary(task, recs, source=str(path)), "scores": [r["score"] for r in recs]}
        if out is not None:
            Path(out).mkdir(parents=True, exist_ok=True)
            _write(Path(out), task, recs)
    if out is not None:
        (Path(out) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary
