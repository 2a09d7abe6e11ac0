"""Chinese named-entity recognition on MSRA, TENER's set-up at small scale (Yan et al. 2019).

TENER (Yan, Deng, Li and Qiu, "TENER: Adapting Transformer Encoder for Named Entity
Recognition", 2019) tags characters with BMES tags over LOC/ORG/PER using a
Transformer encoder with direction- and distance-aware relative attention (``tener``),
a CRF on top, and reports entity-level F1 on MSRA's official test split.

Protocol (one run), reduced so that a run takes seconds to minutes on a CPU:

* data: :func:`posenc.data.load_msra` (official split: 50,658 training and 4,631 test
  sentences, cut at 100 characters by the source file); by default **a subsample of
  5,000 training and 1,000 test sentences** (``task_options n_train / n_test``; 0 means
  all), drawn with fixed generators (seed 0 for train, 1 for test; the same for every
  run and every ``cfg.seed``), kept in corpus order;
* characters -> ids with a vocabulary of the (subsampled) training sentences
  (``min_freq``, default 1), 13 tags (``O`` and ``B/M/E/S-LOC/ORG/PER``);
* a :class:`~posenc.models.TokenTagger` (``cfg.model``: encoder by default) trained
  for ``cfg.steps`` steps with per-character cross-entropy on mini-batches of
  ``cfg.batch_size`` sentences, training sentences cut to ``max_tokens`` (default 100:
  nothing is cut); **no CRF**: each character takes its most likely tag;
* metric ``"f1"`` (0..1), label ``"test"``: entity-level micro F1 (exact span and type,
  :func:`posenc.data.entity_f1`, ``conlleval``-style reading of ill-formed BMES) over
  the whole (subsampled) test sentences. The model's ``max_len`` is the larger of
  ``max_tokens`` and the longest test sentence.

``cfg.train_lengths``, ``cfg.test_lengths`` and ``cfg.eval_samples`` are not used (only
part of the run's key). ``task_options``: ``n_train`` (5000), ``n_test`` (1000),
``max_tokens`` (100), ``min_freq`` (1), ``dropout`` (0.1).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from ... import data as D
from ...models import TokenTagger
from ..real_training import EpochSampler, count_parameters, require, task_options, train_loop
from ..steps import model_options
from ..types import OnStep, RunConfig, Task, register_task

Split = tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]  # char ids, tag ids


def _subsample(n_total: int, n: int, seed: int) -> list[int]:
    if n <= 0 or n >= n_total:
        return list(range(n_total))
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(n_total, generator=g)[:n].tolist())


@functools.lru_cache(maxsize=8)
def encoded_msra(n_train: int, n_test: int, min_freq: int) -> tuple[int, list[str], Split, Split]:
    """``(vocab size, tag names, train, test)`` of the subsampled MSRA, cached per process."""
    data = D.load_msra()
    train = [data.train[i] for i in _subsample(len(data.train), n_train, 0)]
    test = [data.test[i] for i in _subsample(len(data.test), n_test, 1)]
    vocab = D.Vocab.build((chars for chars, _ in train), min_freq=min_freq)

    def enc(items: list) -> Split:
        return tuple(tuple(vocab.encode(c)) for c, _ in items), tuple(tuple(t) for _, t in items)

    return len(vocab), list(data.tags), enc(train), enc(test)


@torch.no_grad()
def predict_tags(model: TokenTagger, ids: tuple[tuple[int, ...], ...], batch: int = 128) -> list[list[int]]:
    """Most likely tag id of every character of every sentence."""
    model.eval()
    out: list[list[int]] = []
    for s in range(0, len(ids), batch):
        chunk = ids[s : s + batch]
        tokens, mask = D.pad_batch(chunk)
        best = model(tokens, attention_mask=mask).argmax(-1)
        out.extend(best[i, : len(x)].tolist() for i, x in enumerate(chunk))
    return out


@register_task
class MSRANERTask(Task):
    name = "msra-ner"
    description = (
        "MSRA Chinese NER, BMES tags per character (TENER's set-up, no CRF), entity F1 on a 1,000-sentence "
        "subsample of the official test split after training on 5,000 sentences"
    )
    metric = "f1"
    higher_is_better = True
    default_model = "encoder"
    DEFAULTS: dict[str, Any] = {"n_train": 5000, "n_test": 1000, "max_tokens": 100, "min_freq": 1, "dropout": 0.1}

    def options(self, cfg: RunConfig) -> dict[str, Any]:
        opts = task_options(self.name, cfg, self.DEFAULTS)
        for key in ("n_train", "n_test"):
            require(opts[key] >= 0, f"task_options {key} must be >= 0 (0 = all sentences), got {opts[key]}")
        require(opts["max_tokens"] >= 1, f"task_options max_tokens must be >= 1, got {opts['max_tokens']}")
        require(opts["min_freq"] >= 1, f"task_options min_freq must be >= 1, got {opts['min_freq']}")
        require(0 <= opts["dropout"] < 1, f"task_options dropout must be in [0, 1), got {opts['dropout']}")
        return opts

    def validate(self, cfg: RunConfig) -> None:
        self.options(cfg)

    def training_lengths(self, cfg: RunConfig) -> None:
        return None  # the sentences fix the lengths; cfg.train_lengths is not used

    def ranking_labels(self, cfg: RunConfig) -> tuple[str, ...]:
        return ("test",)

    def chance(self, cfg: RunConfig, label: str) -> float | None:
        return 0.0  # the majority tag (O) finds no entity

    def run(self, cfg: RunConfig, on_step: OnStep | None = None) -> dict[str, Any]:
        opts = self.options(cfg)
        vocab_size, tags, (train_x, train_y), (test_x, test_y) = encoded_msra(
            opts["n_train"], opts["n_test"], opts["min_freq"]
        )
        cut = opts["max_tokens"]
        torch.manual_seed(cfg.seed)
        longest = max(cut, max(len(x) for x in test_x))
        model = TokenTagger(vocab_size, len(tags), **model_options(cfg, max_len=longest, dropout=opts["dropout"]))
        sampler = EpochSampler(len(train_x), cfg.batch_size)

        def batch_loss(step: int, g: torch.Generator) -> torch.Tensor:
            idx = sampler.next(g)
            tokens, mask = D.pad_batch([train_x[i] for i in idx], max_len=cut)
            labels, _ = D.pad_batch([train_y[i] for i in idx], max_len=cut, pad_id=D.IGNORE_INDEX)
            logits = model(tokens, attention_mask=mask)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

        out = train_loop(cfg, model, batch_loss, on_step)
        pred = predict_tags(model, test_x)
        gold_names = [[tags[t] for t in y] for y in test_y]
        pred_names = [[tags[t] for t in p] for p in pred]
        f1 = D.entity_f1(gold_names, pred_names)["f1"]
        return {**out, "metrics": {"test": f1}, "parameters": count_parameters(model)}
