"""The two measurements of a long context: per-token loss along one long document, and passkey retrieval.

**Per-token loss.** :func:`token_losses` feeds a document of ``N`` tokens through a causal LM in chunks of
``chunk`` tokens, each chunk attending to the KV cache of all earlier ones (transformers' ``DynamicCache``),
and returns the ``N - 1`` next-token losses ``-log p(x_{t+1} | x_{<=t})``. Memory is bounded by the cache and
one chunk's activations, and for an encoding that depends on positions only (every static RoPE scaling) the
losses equal one full forward's (tests/test_extend.py). A *length-dependent* scaling (``rope-dynamic``,
LongRoPE) picks its frequencies from the longest position of each call: chunked, each chunk's cached keys
would keep the rotation of their own chunk (what transformers' generate does with such a scaling), which is
not the method its paper evaluates. So :func:`token_losses` with ``chunk=None`` runs **one whole forward**
(every key rotated for the whole length) and applies the output layer a slice at a time, which bounds the
memory of the ``[N, vocabulary]`` logits just the same; ``posenc extend`` does that for those scalings.

**Passkey retrieval** (Mohtashami and Jaggi 2023, "Landmark Attention"): a random number hidden at a chosen
depth in filler text that repeats, asked for at the end::

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz
    you about the important information there. The grass is green. The sky is blue. ... The pass key is
    68548. Remember it. 68548 is the pass key. ... The grass is green. ... What is the pass key? The pass
    key is 68548

:func:`passkey_ids` builds it to an exact number of tokens (the filler is cut at a token) with the key
sentence at ``depth`` (0: right after the instruction, 1: right before the question). :func:`passkey_score`
takes one forward of the prompt with the answer appended, and the example counts as retrieved when every
answer token is the model's argmax (teacher-forced, which is greedy decoding for as long as every token is
right).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_SENTENCE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"


#: rows of the output layer at a time (2048 x a 49k vocabulary: 400 MB of logits)
HEAD_ROWS = 2048


class _LayerProgress:
    """During one whole forward of ``n`` tokens, ``progress(done, n)`` after each decoder layer (a whole 32k forward
    of SmolLM2 takes minutes on a CPU: a line per layer instead of silence). ``done`` is the tokens of a chunked
    prefill that would have done the same share of the work, ``n·√(share)`` (the attention's ``n²`` dominates a
    long forward; the layers, then the output layer, each a share of ``1 / (layers + 1)``), below ``n`` until the
    forward is finished, when the caller reports ``(n, n)``. A model without ``model.layers`` reports nothing."""

    def __init__(self, model: nn.Module, n: int, progress: Callable[[int, int], None] | None):
        layers = getattr(getattr(model, "model", None), "layers", None)
        self.layers = list(layers) if isinstance(layers, nn.ModuleList) and progress is not None else []
        self.n, self.progress, self.seen, self.handles = n, progress, 0, []

    def _after_layer(self, *_: Any) -> None:
        self.seen += 1
        share = min(self.seen, len(self.layers)) / (len(self.layers) + 1)
        if self.progress is not None:
            self.progress(min(self.n - 1, int(self.n * math.sqrt(share))), self.n)

    def __enter__(self) -> _LayerProgress:
        self.handles = [layer.register_forward_hook(self._after_layer) for layer in self.layers]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()


def _cache():
    from transformers import DynamicCache

    return DynamicCache()


def cache_kw(model: nn.Module, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` under the name ``model``'s forward takes a KV cache by: ``cache`` since transformers 5.24
    (which warns on the old name), ``past_key_values`` before."""
    import inspect

    fwd = type(model).forward
    try:
        params = inspect.signature(fwd).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        params = {}
    return {"cache" if "cache" in params else "past_key_values": cache}


def _losses(model: nn.Module, ids: Tensor, targets: Tensor, head_rows: int, **call: Any) -> Tensor:
    """The losses of the first ``m`` positions of ``ids`` (``[1, n]``, ``m <= n``) against ``targets`` (``[m]``):
    one call of the base model on all of ``ids`` (``call``: the cache, if any; a length-dependent scaling sees the
    whole length), then the output layer ``head_rows`` rows at a time, so that the ``[m, vocabulary]`` logits
    never exist whole (a model without a separate base, or with soft-capped logits: one call of the whole model)."""
    m = targets.shape[0]
    head = model.get_output_embeddings()
    cfg = getattr(model, "config", None)
    if head is None or getattr(cfg, "final_logit_softcapping", None) or not hasattr(model, "model"):
        logits = model(input_ids=ids, **call).logits[0, :m]
        return F.cross_entropy(logits.float(), targets, reduction="none").cpu()
    hidden = model.model(input_ids=ids, **call).last_hidden_state[0, :m]
    out = torch.empty(hidden.shape[0], dtype=torch.float32)
    for s in range(0, hidden.shape[0], head_rows):
        logits = head(hidden[s : s + head_rows]).float()
        out[s : s + head_rows] = F.cross_entropy(logits, targets[s : s + head_rows], reduction="none").cpu()
    return out


@torch.no_grad()
def token_losses(
    model: nn.Module,
    ids: Tensor,
    *,
    chunk: int | None = 2048,
    progress: Callable[[int, int], None] | None = None,
) -> Tensor:
    """The next-token losses of one document ``ids`` (``[N]`` or ``[1, N]``), in nats: ``[N - 1]`` float32.

    The document goes through ``model`` ``chunk`` tokens at a time with a KV cache, or in one whole forward
    with ``chunk=None`` (the output layer then runs 2048 rows at a time); ``progress(done, total)`` is called
    after each chunk, and in one whole forward after each decoder layer (:class:`_LayerProgress`).
    """
    if chunk is not None and chunk < 1:
        raise ConfigError(f"chunk must be a positive number of tokens (or None: one whole forward), got {chunk}")
    ids = ids.reshape(1, -1)
    n = ids.shape[1]
    if n < 2:
        raise ConfigError(f"a document of {n} token(s) has no next-token loss; pass at least 2 tokens")
    device = next(model.parameters()).device
    ids = ids.to(device)
    if chunk is None:
        with _LayerProgress(model, n - 1, progress):
            out = _losses(model, ids, ids[0, 1:], HEAD_ROWS, use_cache=False)
        if progress is not None:
            progress(n - 1, n - 1)
        return out
    cache = _cache()
    out = torch.empty(n - 1, dtype=torch.float32)
    for start in range(0, n - 1, chunk):
        stop = min(start + chunk, n - 1)
        out[start:stop] = _losses(
            model, ids[:, start:stop], ids[0, start + 1 : stop + 1], HEAD_ROWS, use_cache=True, **cache_kw(model, cache)
        )
        if progress is not None:
            progress(stop, n - 1)
    return out


@dataclass(frozen=True)
class PasskeyPrompt:
    """One passkey example: its token ids (the answer at the end), where the answer starts, the key."""

    ids: Tensor  # [n] long: prompt + answer
    answer_start: int  # ids[answer_start:] are the answer's tokens
    key: str
    depth: float
    key_at: int  # the token index where the key sentence starts


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def passkey_ids(tokenizer: Any, n: int, depth: float, key: str) -> PasskeyPrompt:
    """A passkey example of exactly ``n`` tokens with the key sentence at ``depth`` in [0, 1]."""
    if not 0.0 <= depth <= 1.0 or math.isnan(depth):
        raise ConfigError(f"depth is a fraction of the filler in [0, 1], got {depth}")
    if not key.isdigit():
        raise ConfigError(f"the pass key is a number, got {key!r}")
    head = _encode(tokenizer, INSTRUCTION)
    sentence = _encode(tokenizer, KEY_SENTENCE.format(key=key))
    question = _encode(tokenizer, QUESTION)
    answer = _encode(tokenizer, ANSWER.format(key=key))
    filler_unit = _encode(tokenizer, FILLER)
    fixed = len(head) + len(sentence) + len(question) + len(answer)
    room = n - fixed
    if room < 0:
        raise ConfigError(f"a passkey example needs at least {fixed} tokens with this tokenizer, got n={n}")
    reps = room // len(filler_unit) + 1
    filler = (filler_unit * reps)[:room]
    # the key sentence goes between two whole filler sentences: at the unit boundary nearest to depth
    units = room // len(filler_unit)
    before = min(room, round(depth * units) * len(filler_unit))
    ids = [*head, *filler[:before], *sentence, *filler[before:], *question, *answer]
    assert len(ids) == n
    return PasskeyPrompt(torch.tensor(ids, dtype=torch.long), n - len(answer), key, depth, len(head) + before)


def random_key(rng: random.Random, digits: int = 5) -> str:
    """A key of ``digits`` digits, without a leading zero."""
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


@torch.no_grad()
def passkey_score(
    model: nn.Module,
    prompt: PasskeyPrompt,
    *,
    chunk: int | None = 2048,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Whether ``model`` retrieves the key: one forward of prompt + answer (chunked through the KV cache, or
    whole with ``chunk=None``), argmax at each answer token.

    Returns ``{"correct": bool, "tokens_right": share of answer tokens right, "answer_loss": mean nats}``;
    ``progress(done, total)`` is called after each chunk (in one whole forward: after each decoder layer too).
    """
    losses, hits = [], []
    ids = prompt.ids.reshape(1, -1).to(next(model.parameters()).device)
    n = ids.shape[1]
    if chunk is None:
        chunk = n
    cache = _cache()
    first = prompt.answer_start - 1  # the logit at this position predicts the first answer token
    for start in range(0, n - 1, chunk):
        stop = min(start + chunk, n - 1)
        # only the chunk(s) holding answer positions need logits (skip the vocabulary matmul elsewhere)
        keep = max(0, stop - max(start, first))
        with _LayerProgress(model, n - 1, progress if stop - start == n - 1 else None):  # one whole forward
            out = model(
                input_ids=ids[:, start:stop], use_cache=True, logits_to_keep=max(keep, 1), **cache_kw(model, cache)
            )
        if keep:
            logits = out.logits[0, -keep:].float()
            targets = ids[0, stop - keep + 1 : stop + 1]
            losses.append(F.cross_entropy(logits, targets, reduction="none"))
            hits.append(logits.argmax(-1) == targets)
        if progress is not None:
            progress(stop, n - 1)
    right = torch.cat(hits)
    return {
        "correct": bool(right.all()),
        "tokens_right": float(right.float().mean()),
        "answer_loss": float(torch.cat(losses).mean()),
    }
