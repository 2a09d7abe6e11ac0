"""RULER's six synthetic tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context
Language Models?"), built to an exact number of tokens for a model's tokenizer, and asked many questions per prefill.

The tasks, as the paper's task configuration defines them (written here from the paper and its configuration):

* ``niah_single_1``: a noise haystack (``"The grass is green. The sky is blue. The sun is yellow. Here we go. There
  and back again."`` a line, repeated), one needle ``"One of the special magic numbers for {word} is: {number}."``
  (the key an adjective-noun pair of wonderwords' lists, the value seven digits) at a random line;
* ``niah_multikey_2``: a haystack made of needles (every line a word -> number needle, keys distinct); the
  question asks for one of them. Several keys of one haystack are asked in turn (one prefill, many questions);
* ``niah_multikey_3``: the same with UUID keys and UUID values;
* ``vt`` (variable tracking): one chain of four hops, ``VAR AAAAA = 12345``, ``VAR BBBBB = VAR AAAAA`` ... placed in
  order at random points of the noise; asked which variables hold the number (all five); after a one-shot example
  (three-letter names, a short noise);
* ``cwe`` (common-words extraction): a numbered list of words from wonderwords (nouns, adjectives, verbs): ten
  common words 30 times each and the rest 3 times each (6 and 1 below 4096 tokens), shuffled; asked for the ten
  most common; after a one-shot example;
* ``fwe`` (frequent-words extraction): random six-letter "coded words" drawn with Zipf counts
  ``floor(N k^-2 / zeta(2))`` over a vocabulary of ``n / 50`` words, the most frequent replaced by the noise word
  ``...``; asked for the three most frequent (ranks 2-4).

Templates, needles, questions and answer prefixes are RULER's (including its ``"assgined"``). Scoring is RULER's
``string_match_all``: the share of the references found, case-insensitive, in the generated text.

**Exact lengths.** An example of length ``n`` is built from pieces tokenized on their own and concatenated as ids
(so that counting is exact): the instruction, whole haystack units (lines, list items, words), a pad that fills the
remainder (the task's noise cut at a token), the question and the answer prefix. Its longest prompt (context plus
the longest of its questions and answer prefixes) is exactly ``n - generate`` tokens, where ``generate`` is the
task's generation budget (:data:`GENERATE`), so that prompt plus answer fit in ``n``, as RULER counts a length. The
ids decode to the example's text; they need not be the tokenizer's own segmentation of that text.

**Generation budgets** are smaller than RULER's reserve (128 tokens for NIAH, 120 for cwe, 50 for fwe; 30 for vt):
a CPU decodes a few tokens a second at 16k tokens. They fit each task's answer (a seven-digit number is about nine
tokens, a UUID about thirty, ten words about fifty), and generation stops early once every reference has been
generated (the score cannot change after that) or at the end-of-text token.
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .._stats import wilson_bounds
from ..errors import ConfigError
from .evaluate import cache_kw

TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
ABOUT = {
    "niah_single_1": "needle in a noise haystack, word -> number",
    "niah_multikey_2": "haystack of needles, word -> number",
    "niah_multikey_3": "haystack of needles, UUID -> UUID",
    "vt": "variable tracking, 1 chain x 4 hops",
    "cwe": "common-words extraction (10 words x 30)",
    "fwe": "frequent-words extraction (Zipf, alpha 2)",
}
#: the tokens generated at most per question (and reserved in the length); see the module's text
GENERATE = {"niah_single_1": 16, "niah_multikey_2": 16, "niah_multikey_3": 48, "vt": 30, "cwe": 64, "fwe": 32}
#: tasks whose haystack holds many askable keys (several questions per prefill)
MULTI = ("niah_multikey_2", "niah_multikey_3")

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_HEAD = "A special magic {one} is hidden within the following text. Make sure to memorize it. I will quiz you about the {one} afterwards.\n"  # noqa: E501
NIAH_QUESTION = "\nWhat is the special magic {one} for {key} mentioned in the provided text?"
NIAH_PREFIX = " The special magic {one} for {key} mentioned in the provided text is"
VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = "\nQuestion: Find all variables that are assigned the value {value} in the text above."
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {count} variables are assgined "
    "the value {value}, they are: "
)
CWE_HEAD = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
    "appear most often.\n"
)
CWE_QUESTION = "\nQuestion: What are the 10 most common words in the above list?"
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_HEAD = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words."
)
FWE_QUESTION = (
    "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently "
    "appeared words in the above coded text?"
)
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


# ---------------------------------------------------------------------------------------------- words
_WORDS: dict[str, list[str]] = {}


def wordlist(kind: str) -> list[str]:
    """wonderwords' list of ``kind`` (``"noun"``, ``"adjective"``, ``"verb"``), read from the package's files."""
    if kind not in _WORDS:
        try:
            from importlib.resources import files

            text = (files("wonderwords") / "assets" / f"{kind}list.txt").read_text(encoding="utf-8")
        except (ModuleNotFoundError, FileNotFoundError) as err:
            raise ConfigError(
                "RULER's niah and cwe tasks take their words from the wonderwords package, which is not installed "
                f"({err}): pip install 'wonderwords==3.0.1' --no-deps (scripts/extend.sh does)"
            ) from None
        _WORDS[kind] = sorted({w.strip() for w in text.splitlines() if w.strip() and " " not in w.strip()})
    return _WORDS[kind]


def _key_word(rng: random.Random) -> str:
    return f"{rng.choice(wordlist('adjective'))}-{rng.choice(wordlist('noun'))}"


def _number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


# ---------------------------------------------------------------------------------------------- examples
@dataclass(frozen=True)
class Question:
    """One question on an example's context: its ids (question and answer prefix), the references to find."""

    ids: tuple[int, ...]
    answers: tuple[str, ...]
    key: str
    #: where in the context (a fraction of its tokens) the needle / first chain link of this question starts
    depth: float


@dataclass(frozen=True)
class Example:
    """One haystack of ``task``: its context ids (asked once, prefilled once) and the questions on it."""

    task: str
    context: tuple[int, ...]
    questions: tuple[Question, ...]
    length: int  # n: the longest prompt plus ``generate``
    generate: int
    seed: int
    info: dict[str, Any] = field(default_factory=dict)
    text: str = ""

    def prompt(self, i: int = 0) -> list[int]:
        """The ids of question ``i``'s whole prompt (context, question, answer prefix)."""
        return [*self.context, *self.questions[i].ids]


def _encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    memo: dict[str, list[int]] = {}

    def enc(text: str) -> list[int]:
        if text not in memo:
            memo[text] = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return memo[text]

    return enc


def _pad(enc: Callable[[str], list[int]], unit: str, room: int) -> list[int]:
    """``room`` tokens of ``unit`` repeated, cut at a token."""
    if room <= 0:
        return []
    ids = enc(unit)
    if not ids:
        raise ConfigError(f"the tokenizer gives no tokens for the pad {unit!r}")
    return (ids * (room // len(ids) + 1))[:room]


def _too_short(task: str, n: int, need: int) -> ConfigError:
    return ConfigError(
        f"a {task} example needs more than {need} tokens with this tokenizer, got n={n}; ask for a longer one"
    )


def build(task: str, tokenizer: Any, n: int, seed: int, questions: int = 1) -> Example:
    """A ``task`` example of length ``n`` for ``tokenizer``, drawn from ``seed`` (the same seed, the same example),
    with ``questions`` questions where the task has several keys (:data:`MULTI`; others ask one)."""
    if task not in TASKS:
        raise ConfigError(f"unknown RULER task {task!r}; the tasks are {', '.join(TASKS)}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"n is a positive number of tokens, got {n!r}")
    if not isinstance(questions, int) or isinstance(questions, bool) or questions < 1:
        raise ConfigError(f"questions is a positive number, got {questions!r}")
    rng = random.Random(f"ruler|{task}|{n}|{seed}")
    enc = _encoder(tokenizer)
    make = {"niah_single_1": _niah_single, "niah_multikey_2": _niah_multi, "niah_multikey_3": _niah_multi,
            "vt": _vt, "cwe": _cwe, "fwe": _fwe}[task]
    ex = make(task, enc, n, rng, questions)
    ex = Example(ex.task, ex.context, ex.questions, n, ex.generate, seed, ex.info,
                 tokenizer.decode(list(ex.context)) if hasattr(tokenizer, "decode") else "")
    longest = len(ex.context) + max(len(q.ids) for q in ex.questions)
    assert longest + ex.generate == n, (task, n, longest, ex.generate)
    return ex


def _fill(
    n: int, generate: int, head: list[int], units: Sequence[list[int]], qmax: int, task: str
) -> tuple[list[int], list[int], int]:
    """Take whole ``units`` while they fit; returns (context ids without pad, the unit starts, units taken); the
    caller pads to ``room``."""
    room = n - generate - len(head) - qmax
    if room < 0:
        raise _too_short(task, n, generate + len(head) + qmax)
    out, starts, used = list(head), [], 0
    for u in units:
        if used + len(u) > room:
            break
        starts.append(len(out))
        out.extend(u)
        used += len(u)
    return out, starts, room - used


def _niah_single(task, enc, n, rng, _questions) -> Example:
    gen = GENERATE[task]
    key, value = _key_word(rng), _number(rng)
    head = enc(NIAH_HEAD.format(one="number"))
    needle = enc(NEEDLE.format(kind="numbers", key=key, value=value) + "\n")
    q = enc(NIAH_QUESTION.format(one="number", key=key)) + enc(NIAH_PREFIX.format(one="number", key=key))
    line = enc(NOISE + "\n")
    room = n - gen - len(head) - len(q) - len(needle)
    if room < 0:
        raise _too_short(task, n, n - room)
    lines = room // len(line)
    at = rng.randint(0, lines)  # the needle goes before noise line `at` (RULER: a random place)
    noise = [*(line * lines), *_pad(enc, NOISE + "\n", room - lines * len(line))]
    before = at * len(line)
    context = [*head, *noise[:before], *needle, *noise[before:]]
    depth = (len(head) + before) / len(context)
    return Example(task, tuple(context), (Question(tuple(q), (value,), key, depth),), n, gen, 0,
                   {"needle_line": at, "lines": lines})


def _niah_multi(task, enc, n, rng, questions) -> Example:
    gen = GENERATE[task]
    uuids = task == "niah_multikey_3"
    kind, one = ("uuids", "uuid") if uuids else ("numbers", "number")
    head = enc(NIAH_HEAD.format(one=one))
    keys: set[str] = set()
    values: set[str] = set()
    pool: list[tuple[str, str, list[int]]] = []
    budget = n - gen - len(head)
    total = 0
    while total < budget:  # lines until they overflow the room (a pool: the questions' length is not known yet)
        key = _uuid(rng) if uuids else _key_word(rng)
        value = _uuid(rng) if uuids else _number(rng)
        if key in keys or value in values:
            continue
        keys.add(key)
        values.add(value)
        ids = enc(NEEDLE.format(kind=kind, key=key, value=value) + "\n")
        pool.append((key, value, ids))
        total += len(ids)

    def qids(key: str) -> list[int]:
        return enc(NIAH_QUESTION.format(one=one, key=key)) + enc(NIAH_PREFIX.format(one=one, key=key))

    qpool = max(len(qids(k)) for k, _, _ in pool)
    out, starts, _ = _fill(n, gen, head, [u for _, _, u in pool], qpool, task)
    taken = len(starts)
    if taken < 1:
        raise _too_short(task, n, n)
    asked = sorted(rng.sample(range(taken), min(questions, taken)))
    qs = [qids(pool[i][0]) for i in asked]
    qmax = max(len(q) for q in qs)
    pad = _pad(enc, NOISE + "\n", n - gen - qmax - len(out))
    context = [*out, *pad]
    return Example(
        task, tuple(context),
        tuple(Question(tuple(q), (pool[i][1],), pool[i][0], starts[i] / len(context)) for q, i in zip(qs, asked)),
        n, gen, 0, {"needles": taken},
    )


def _chain(rng: random.Random, hops: int, letters: int) -> tuple[list[str], list[str], str]:
    names: list[str] = []
    while len(names) < hops + 1:
        v = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if v not in names:
            names.append(v)
    value = str(rng.randint(10000, 99999))
    links = [f"VAR {names[0]} = {value}", *(f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(hops))]
    return names, links, value


def _vt_text(rng: random.Random, noises: int, letters: int) -> tuple[list[str], list[str], str, list[int]]:
    """RULER's vt context as units: noise lines and the chain's links in order at random places."""
    names, links, value = _chain(rng, 4, letters)
    units = [NOISE + "\n"] * noises
    where = sorted(rng.sample(range(noises + 1), len(links))) if noises + 1 >= len(links) else list(range(len(links)))
    at = []
    for j, (p, link) in enumerate(zip(where, links)):
        units.insert(p + j, link + " ")
        at.append(p + j)
    return units, names, value, at


def _vt(task, enc, n, rng, _questions) -> Example:
    gen = GENERATE[task]
    # the one-shot example: three-letter names, five noise lines, answered
    units, names, value, _ = _vt_text(rng, 5, 3)
    shot = [*enc(VT_HEAD), *[t for u in units for t in enc(u)], *enc(VT_QUESTION.format(value=value)),
            *enc(VT_PREFIX.format(count=5, value=value)), *enc(" ".join(names) + "\n\n")]
    head = [*shot, *enc(VT_HEAD)]
    names, links, value = _chain(rng, 4, 5)
    q = enc(VT_QUESTION.format(value=value)) + enc(VT_PREFIX.format(count=len(names), value=value))
    link_ids = [enc(link + " ") for link in links]
    line = enc(NOISE + "\n")
    room = n - gen - len(head) - len(q) - sum(len(x) for x in link_ids)
    if room < 0:
        raise _too_short(task, n, n - room)
    noises = room // len(line)
    where = sorted(rng.sample(range(noises + 1), len(links))) if noises + 1 >= len(links) else [noises] * len(links)
    pad = _pad(enc, NOISE + "\n", room - noises * len(line))
    context = list(head)
    starts = []
    k = 0
    for i in range(noises + 1):
        while k < len(links) and where[k] == i:
            starts.append(len(context))
            context.extend(link_ids[k])
            k += 1
        if i < noises:
            context.extend(line)
    context.extend(pad)
    return Example(task, tuple(context), (Question(tuple(q), tuple(names), value, starts[0] / len(context)),),
                   n, gen, 0, {"noise_lines": noises, "links_at": [s / len(context) for s in starts]})


def _cwe_words(rng: random.Random, count: int) -> list[str]:
    words = sorted({*wordlist("noun"), *wordlist("adjective"), *wordlist("verb")})
    if count > len(words):
        raise ConfigError(f"cwe: {count} distinct words asked for, wonderwords has {len(words)}")
    return rng.sample(words, count)


def _cwe_list(enc, words: list[str], common: int, rep_c: int, rep_u: int, rng: random.Random) -> list[int]:
    items = words[:common] * rep_c + words[common:] * rep_u
    rng.shuffle(items)
    out: list[int] = []
    for i, w in enumerate(items):
        out.extend(enc(f"{i + 1}. {w}" + (" " if i + 1 < len(items) else "")))
    return out


def _cwe(task, enc, n, rng, _questions) -> Example:
    gen = GENERATE[task]
    long = n >= 4096
    rep_c, rep_u = (30, 3) if long else (6, 1)
    shot_words = _cwe_words(rng, 40 if long else 20)
    shot_c, shot_u = (10, 3) if long else (3, 1)
    shot = [*enc(CWE_HEAD), *_cwe_list(enc, shot_words, 10, shot_c, shot_u, random.Random(rng.random())),
            *enc(CWE_QUESTION), *enc(CWE_PREFIX),
            *enc(" " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_words[:10])) + "\n")]
    head = [*shot, *enc(CWE_HEAD)]
    q = enc(CWE_QUESTION) + enc(CWE_PREFIX)
    room = n - gen - len(head) - len(q)
    order_seed = rng.random()

    def listed(uncommon: int) -> tuple[list[int], list[str]]:
        words = _cwe_words(random.Random(order_seed), 10 + uncommon)
        return _cwe_list(enc, words, 10, rep_c, rep_u, random.Random(order_seed + 1)), words

    if room < len(listed(0)[0]):
        raise _too_short(task, n, n - room + len(listed(0)[0]))
    lo, hi = 0, 1
    while len(listed(hi)[0]) <= room and hi < 20000:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # the most uncommon words whose list fits (the length grows with the count)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(listed(mid)[0]) <= room else (lo, mid)
    ids, words = listed(lo)
    context = [*head, *ids, *_pad(enc, "\n", room - len(ids))]
    return Example(task, tuple(context), (Question(tuple(q), tuple(words[:10]), "", len(head) / len(context)),),
                   n, gen, 0, {"uncommon_words": lo, "common_repeats": rep_c, "uncommon_repeats": rep_u})


def zipf_counts(words: int, vocabulary: int, alpha: float = 2.0) -> list[int]:
    """RULER fwe's count of each rank ``k = 1..vocabulary``: ``floor(words k^-alpha / zeta(alpha))``."""
    zeta = sum(k**-alpha for k in range(1, 200_000)) + 200_000 ** (1 - alpha) / (alpha - 1)
    return [int(words * k**-alpha / zeta) for k in range(1, vocabulary + 1)]


def _fwe(task, enc, n, rng, _questions) -> Example:
    gen = GENERATE[task]
    size = max(5, n // 50)
    vocab: list[str] = []
    seen: set[str] = set()
    while len(vocab) < size:
        w = "".join(rng.choices(string.ascii_lowercase, k=6))
        if w not in seen:
            seen.add(w)
            vocab.append(w)
    vocab[0] = "..."  # the most frequent is noise
    head = enc(FWE_HEAD)
    q = enc(FWE_QUESTION) + enc(FWE_PREFIX)
    room = n - gen - len(head) - len(q)
    order_seed = rng.random()

    def text(words: int) -> list[int]:
        items = [w for w, c in zip(vocab, zipf_counts(words, size)) for _ in range(c)]
        random.Random(order_seed).shuffle(items)
        return [t for w in items for t in enc(" " + w)]

    if room < len(text(100)):
        raise _too_short(task, n, n - room + len(text(100)))
    lo, hi = 100, 200
    while len(text(hi)) <= room:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(text(mid)) <= room else (lo, mid)
    ids = text(lo)
    context = [*head, *ids, *_pad(enc, " ...", room - len(ids))]
    counts = zipf_counts(lo, size)
    return Example(task, tuple(context), (Question(tuple(q), tuple(vocab[1:4]), "", len(head) / len(context)),),
                   n, gen, 0, {"words": lo, "vocabulary": size, "top_counts": counts[:5]})


# ---------------------------------------------------------------------------------------------- scoring
def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's score: the share of ``answers`` that occur in ``prediction``, case-insensitive."""
    if not answers:
        raise ConfigError("string_match_all needs at least one reference answer")
    low = prediction.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


def wilson(successes: float, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval (95 % by default) of ``successes`` out of ``n``. A fractional ``successes`` (the
    sum of ``string_match_all`` scores in [0, 1]) is taken at its mean: a [0, 1] score of mean p has a variance of
    at most p (1 - p), so the interval is at least as wide as it needs to be."""
    if n < 1:
        raise ConfigError(f"a Wilson interval needs at least one trial, got n={n}")
    if not 0 <= successes <= n:
        raise ConfigError(f"successes must lie in [0, n={n}], got {successes}")
    return wilson_bounds(successes / n, n, z)


# ---------------------------------------------------------------------------------------------- asking
def _crop(cache: Any, keep: int) -> None:
    """Cut ``cache`` back to its first ``keep`` positions (the context), after a question."""
    have = cache.get_seq_length()
    if have > keep:
        cache.crop(keep - have)  # a negative count: remove that many from the end
    if cache.get_seq_length() != keep:
        raise RuntimeError(f"the KV cache was not cut back to {keep} positions (it holds {cache.get_seq_length()})")


@torch.no_grad()
def ask(
    model: nn.Module,
    tokenizer: Any,
    example: Example,
    *,
    chunk: int | None = 1024,
    progress: Callable[[str, int, int], None] | None = None,
    batch: int = 5,
) -> list[dict[str, Any]]:
    """Prefill ``example``'s context once (``chunk`` tokens a forward through transformers' ``DynamicCache``, or
    one whole forward with ``None``), then for each question: its ids on the cache, greedy generation of at most
    ``example.generate`` tokens (stopping at the end-of-text token or once every reference is in the text), and the
    cache cut back to the context. ``progress(what, done, total)``: after each chunk (``"prefill"``, tokens) and
    each ``batch`` questions (``"questions"``).

    Returns one record a question: ``{"key", "answers", "prediction", "score", "depth", "generated"}``.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ctx = torch.tensor(example.context, dtype=torch.long, device=device).reshape(1, -1)
    m = ctx.shape[1]
    cache = DynamicCache()
    step = m if chunk is None else chunk
    for start in range(0, m, step):
        stop = min(start + step, m)
        model(input_ids=ctx[:, start:stop], use_cache=True, logits_to_keep=1, **cache_kw(model, cache))
        if progress is not None:
            progress("prefill", stop, m)
    eos = getattr(tokenizer, "eos_token_id", None)
    out = []
    with decode_threads(model):
        for i, q in enumerate(example.questions):
            out.append(_answer(model, tokenizer, example, q, cache, m, eos))
            if progress is not None and ((i + 1) % batch == 0 or i + 1 == len(example.questions)):
                progress("questions", i + 1, len(example.questions))
    return out


#: a model under this many parameters decodes on one CPU thread (:func:`decode_threads`)
SMALL_MODEL = 10**9


@contextmanager
def decode_threads(model: nn.Module) -> Iterator[None]:
    """Decode a small model on one CPU thread. A decoding step of a model under :data:`SMALL_MODEL` parameters is
    hundreds of small operations, too small to split: on two threads each waits for the other, and where another
    process holds a core that wait is a scheduler slice. SmolLM2-135M from a 2k cache, 2 vCPUs at a load of 3.4:
    0.30-0.33 s a token on one thread, 1.14 on two (2026-11-28). The prefill keeps the threads it was given."""
    small = next(model.parameters()).device.type == "cpu" and sum(p.numel() for p in model.parameters()) < SMALL_MODEL
    before = torch.get_num_threads()
    if small:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _answer(model: nn.Module, tokenizer: Any, example: Example, q: Question, cache: Any, m: int,
            eos: int | None) -> dict[str, Any]:
    """Ask question ``q`` on ``cache`` (the context's ``m`` positions), cut the cache back; the question's record."""
    device = next(model.parameters()).device
    ids = torch.tensor(q.ids, dtype=torch.long, device=device).reshape(1, -1)
    gen = greedy(model, ids, cache, example.generate, eos,
                 lambda toks: string_match_all(tokenizer.decode(toks), q.answers) == 1.0)
    _crop(cache, m)
    text = tokenizer.decode(gen)
    return {"key": q.key, "answers": list(q.answers), "prediction": text,
            "score": string_match_all(text, q.answers), "depth": round(q.depth, 4), "generated": len(gen)}


def greedy(model: nn.Module, ids: Tensor, cache: Any, limit: int, eos: int | None,
           done: Callable[[list[int]], bool] | None = None) -> list[int]:
    """Greedy decoding of at most ``limit`` tokens after ``ids`` (``[1, k]``) on ``cache`` (with ``None``: no
    cache, each step a full forward of everything so far: the slow truth the tests compare with)."""
    gen: list[int] = []
    if cache is None:
        seq = ids
        for _ in range(limit):
            nxt = int(model(input_ids=seq, use_cache=False).logits[0, -1].argmax())
            gen.append(nxt)
            if nxt == eos or (done is not None and done(gen)):
                break
            seq = torch.cat([seq, seq.new_tensor([[nxt]])], dim=1)
        return gen
    feed = ids
    for _ in range(limit):
        logits = model(input_ids=feed, use_cache=True, logits_to_keep=1, **cache_kw(model, cache)).logits
        nxt = int(logits[0, -1].argmax())
        gen.append(nxt)
        if nxt == eos or (done is not None and done(gen)):
            break
        feed = ids.new_tensor([[nxt]])
    return gen
