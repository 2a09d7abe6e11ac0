"""RULER's synthetic tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?"), built the way NVIDIA/RULER's ``scripts/data`` builds them, and asked many questions per prefill where a
haystack carries several.

**The tasks** (:data:`TASKS`, RULER's ``scripts/synthetic.yaml``): eight needle-in-a-haystack tasks (:data:`NIAH`:
a noise, essay or needle haystack; word, number or UUID keys and values; 1 or 4 keys, values and queries), variable
tracking (``vt``: one chain of four hops in the noise, after a one-shot example), common-words extraction (``cwe``:
ten words 30 times each and the rest 3 times, 6 and 1 below 4096 tokens, after a one-shot example; past wonderwords'
lists the words come from :func:`posenc.extend.ruler_prose.vocabulary`, as RULER falls back to its own list) and
frequent-words extraction (``fwe``: Zipf counts, alpha 2, over ``(n - generate) / 50`` coded words). The essay
haystack is :mod:`posenc.extend.ruler_prose`'s substitute for Paul Graham's essays (named on every table). RULER's
``qa_1`` (SQuAD) and ``qa_2`` (HotpotQA) are not run: :data:`NOT_RUN` says why.

**The protocol** (RULER's ``prepare.py`` and the task scripts; written here from them):

* the prompt is the task's template filled in (:data:`TEMPLATES`), wrapped in the model's chat template where the
  tokenizer has one (``template="auto"``; ``"base"``: no wrapping, RULER's ``base``), the answer prefix after it,
  and the whole string tokenised at once: BOS and other special tokens as the tokenizer adds them (``base``) or as
  the chat template writes them (``chat``);
* the length: the number of haystack units (noise lines, needles, essay words, list words, coded words) is the
  largest whose prompt plus the task's generation budget (:data:`GENERATE`, RULER's ``tokens_to_generate``) fits in
  ``n`` tokens, found by a binary search on that number; the slack (fewer than a unit's tokens) is left at the end;
* a prediction is post-processed as RULER's ``evaluate.py`` does (:func:`postprocess`) and scored by RULER's
  ``string_match_all``.

Several questions on one haystack (niah_multikey_2 / 3, :data:`MULTI`): each question's prompt is still tokenised as
one string; the KV cache holds the longest id prefix they share (the template's head and the haystack), and each
question feeds the rest. Such questions are one cluster, not independent samples
(:func:`posenc.extend.ruler_report.cluster_interval`).
"""

from __future__ import annotations

import random
import re
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
from .config import RULER_NOT_RUN
from .evaluate import cache_kw

#: RULER's needle tasks: haystack, key and value kinds, keys, values per key, keys asked (scripts/synthetic.yaml)
NIAH: dict[str, dict[str, Any]] = {
    "niah_single_1": {"haystack": "noise", "key": "words", "value": "numbers", "k": 1, "v": 1, "q": 1},
    "niah_single_2": {"haystack": "essay", "key": "words", "value": "numbers", "k": 1, "v": 1, "q": 1},
    "niah_single_3": {"haystack": "essay", "key": "words", "value": "uuids", "k": 1, "v": 1, "q": 1},
    "niah_multikey_1": {"haystack": "essay", "key": "words", "value": "numbers", "k": 4, "v": 1, "q": 1},
    "niah_multikey_2": {"haystack": "needle", "key": "words", "value": "numbers", "k": 1, "v": 1, "q": 1},
    "niah_multikey_3": {"haystack": "needle", "key": "uuids", "value": "uuids", "k": 1, "v": 1, "q": 1},
    "niah_multivalue": {"haystack": "essay", "key": "words", "value": "numbers", "k": 1, "v": 4, "q": 1},
    "niah_multiquery": {"haystack": "essay", "key": "words", "value": "numbers", "k": 4, "v": 1, "q": 4},
}
TASKS = (*NIAH, "vt", "cwe", "fwe")
#: RULER's tasks that do not run here, and why
NOT_RUN = RULER_NOT_RUN
#: the tasks whose haystack is the essay substitute (:mod:`posenc.extend.ruler_prose`)
ESSAY = tuple(t for t, c in NIAH.items() if c["haystack"] == "essay")
ABOUT = {
    "niah_single_1": "noise haystack, word -> number",
    "niah_single_2": "essay haystack, word -> number",
    "niah_single_3": "essay haystack, word -> UUID",
    "niah_multikey_1": "essay haystack, 4 keys, one asked",
    "niah_multikey_2": "haystack of needles, word -> number",
    "niah_multikey_3": "haystack of needles, UUID -> UUID",
    "niah_multivalue": "essay haystack, 4 values of one key",
    "niah_multiquery": "essay haystack, 4 keys asked at once",
    "vt": "variable tracking, 1 chain x 4 hops",
    "cwe": "common-words extraction (10 words x 30)",
    "fwe": "frequent-words extraction (Zipf, alpha 2)",
}
#: RULER's tokens_to_generate: the tokens generated at most per question, and reserved in the length
GENERATE = {**dict.fromkeys(NIAH, 128), "vt": 30, "cwe": 120, "fwe": 50}
#: tasks whose haystack holds many askable keys (several questions per prefill, one cluster)
MULTI = ("niah_multikey_2", "niah_multikey_3")
#: ``auto``: the chat template where the tokenizer has one, else ``base``
TEMPLATE_MODES = ("auto", "chat", "base")

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
#: RULER's task templates and answer prefixes (scripts/data/synthetic/constants.py)
TEMPLATES = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will "
        "quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} "
        "for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    ),
    "vt": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
        "the value {query}, they are: ",
    ),
    "cwe": (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
        "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
    ),
    "fwe": (
        "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
    ),
}
#: RULER's needle depths: round(linspace(0, 100, 40)) per cent, sampled for the essay haystack
DEPTHS = tuple(round(100 * i / 39) for i in range(40))


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


def _draw(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(wordlist('adjective'))}-{rng.choice(wordlist('noun'))}"


# ---------------------------------------------------------------------------------------------- the template
def template_mode(tokenizer: Any, template: str = "auto") -> str:
    """``"chat"`` or ``"base"``: ``template`` (one of :data:`TEMPLATE_MODES`) for ``tokenizer`` (``auto``: chat where
    ``tokenizer.chat_template`` is set)."""
    if template not in TEMPLATE_MODES:
        raise ConfigError(f"template is one of {', '.join(TEMPLATE_MODES)}, got {template!r}")
    has = bool(getattr(tokenizer, "chat_template", None))
    if template == "chat" and not has:
        raise ConfigError(
            "template='chat' needs a tokenizer with a chat template (tokenizer.chat_template is unset); "
            "use 'auto' or 'base'"
        )
    return "chat" if (template == "chat" or (template == "auto" and has)) else "base"


def render(tokenizer: Any, body: str, prefix: str, mode: str) -> str:
    """The prompt's text: ``body`` as the user's turn of the chat template (``mode="chat"``, with the assistant's
    turn opened) or alone (``"base"``), then the answer ``prefix``."""
    if mode == "chat":
        head = tokenizer.apply_chat_template(
            [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True
        )
        return head + prefix
    return body + prefix


def encode(tokenizer: Any, text: str, mode: str) -> list[int]:
    """``text`` tokenised as one string: with the tokenizer's special tokens (BOS) in ``base`` mode; as written in
    ``chat`` mode, where the chat template's text carries them."""
    return list(tokenizer(text, add_special_tokens=mode == "base")["input_ids"])


# ---------------------------------------------------------------------------------------------- examples
@dataclass(frozen=True)
class Question:
    """One question on an example's context: its ids (the rest of its prompt after the shared context), the
    references to find."""

    ids: tuple[int, ...]
    answers: tuple[str, ...]
    key: str
    #: where in the prompt (a fraction of its tokens) the question's first needle / chain link starts (None: cwe, fwe)
    depth: float | None


@dataclass(frozen=True)
class Example:
    """One haystack of ``task``: the ids its prompts share (prefilled once) and the questions on it."""

    task: str
    context: tuple[int, ...]
    questions: tuple[Question, ...]
    length: int  # n: the longest prompt plus ``generate`` fits in it
    generate: int
    seed: int
    info: dict[str, Any] = field(default_factory=dict)
    text: str = ""  # the whole text of question 0's prompt

    def prompt(self, i: int = 0) -> list[int]:
        """The ids of question ``i``'s whole prompt."""
        return [*self.context, *self.questions[i].ids]


@dataclass(frozen=True)
class _Draft:
    """A task's prompts at one unit count: for each question its text, references, key and needle text."""

    texts: list[str]
    answers: list[tuple[str, ...]]
    keys: list[str]
    needles: list[str | None]
    info: dict[str, Any]


def _join_query(keys: Sequence[str]) -> str:
    return ", ".join(keys[:-1]) + ", and " + keys[-1] if len(keys) > 1 else keys[0]


def _niah(task: str, count: int, seed: str, questions: int, render_: Callable[[str, str], str]) -> _Draft:
    from . import ruler_prose

    c = NIAH[task]
    rng = random.Random(seed)
    asked = questions if task in MULTI else 1
    k = max(c["k"], c["q"], asked)
    keys, values, needles = [], [], []
    for _ in range(k):
        keys.append(_draw(c["key"], rng))
        vs = [_draw(c["value"], rng) for _ in range(c["v"])]
        values.append(vs)
        needles += [NEEDLE.format(type_needle_v=c["value"], key=keys[-1], value=v) for v in vs]
    random.Random(rng.random()).shuffle(needles)
    if c["haystack"] == "essay":
        sents = ruler_prose.sentences(ruler_prose.haystack(count))
        at = [0, *sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles))), len(sents)]
        parts = []
        for i in range(1, len(at)):
            parts.append(" ".join(sents[at[i - 1] : at[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(p for p in parts if p)
    else:
        if c["haystack"] == "noise":
            lines = [NOISE] * count
        else:
            lines = [
                NEEDLE.format(type_needle_v=c["value"], key=_draw(c["key"], rng), value=_draw(c["value"], rng))
                for _ in range(count)
            ]
        for i, nd in zip(sorted(rng.sample(range(count), len(needles)), reverse=True), needles):
            lines.insert(i, nd)
        context = "\n".join(lines)
    body, prefix = TEMPLATES["niah"]
    groups = [[i] for i in rng.sample(range(k), asked)] if task in MULTI else [rng.sample(range(k), c["q"])]
    texts, answers, qkeys, first = [], [], [], []
    for g in groups:
        b, p, kind = body, prefix, c["value"]
        if len(g) * c["v"] == 1:  # RULER's singular wording
            for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                b, p = b.replace(old, new), p.replace(old, new)
            kind = kind[:-1]
        query = _join_query([keys[i] for i in g])
        texts.append(
            render_(
                b.format(type_needle_v=kind, context=context, query=query), p.format(type_needle_v=kind, query=query)
            )
        )
        answers.append(tuple(v for i in g for v in values[i]))
        qkeys.append(query)
        first.append(min((nd for nd in needles if any(f"for {keys[i]} is:" in nd for i in g)), key=context.find))
    return _Draft(texts, answers, qkeys, first, {"units": count, "haystack": c["haystack"], "needles": len(needles)})


#: the tokens of vt's one-shot example, its answer left out (RULER's ``max_seq_length=500`` for it)
VT_SHOT_TOKENS = 500


def _vt_shot_lines(tokenizer: Any) -> int:
    """The most noise lines whose one-shot example (template and answer prefix, no answer) is at most
    :data:`VT_SHOT_TOKENS` tokens (at least 5), as RULER sizes its in-context example."""
    body, prefix = TEMPLATES["vt"]
    links = ["VAR AAA = 12345", *(f"VAR {c * 3} = VAR {p * 3} " for p, c in zip("ABCD", "BCDE"))]

    def size(lines: int) -> int:
        text = "\n".join([*links, *[NOISE] * lines]) + "\n"
        return len(
            tokenizer(
                body.format(context=text, query="12345") + prefix.format(num_v=5, query="12345"),
                add_special_tokens=False,
            )["input_ids"]
        )

    lines = 5
    while size(lines + 1) <= VT_SHOT_TOKENS and lines < 1000:
        lines += 1
    return lines


def _vt(
    task: str, count: int, seed: str, questions: int, render_: Callable[[str, str], str], shot_lines: int = 5
) -> _Draft:
    rng = random.Random(seed)
    body, prefix = TEMPLATES["vt"]

    def chain(letters: int, value: str) -> tuple[list[str], list[str]]:
        names: list[str] = []
        while len(names) < 5:
            v = "".join(rng.choices(string.ascii_uppercase, k=letters))
            if v not in names:
                names.append(v)
        return names, [f"VAR {names[0]} = {value}", *(f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(4))]

    def context(noises: int, links: list[str]) -> str:
        lines = [NOISE] * noises
        for j, p in enumerate(sorted(rng.sample(range(noises), len(links)))):
            lines.insert(p + j, links[j])
        return "\n".join(lines).replace(". \n", ".\n")

    # the one-shot example: three-letter names, the noise lines that fill about 500 tokens, answered (RULER's
    # randomised in-context example)
    shot_value = str(rng.randint(10000, 99999))
    shot_names, shot_links = chain(3, shot_value)
    shot = (
        body.format(context=context(shot_lines, shot_links), query=shot_value)
        + prefix.format(num_v=5, query=shot_value)
        + " "
        + " ".join(shot_names)
        + "\n"
    )
    value = str(rng.randint(10000, 99999))
    names, links = chain(5, value)
    text = render_(
        shot + "\n" + body.format(context=context(count, links), query=value), prefix.format(num_v=5, query=value)
    )
    return _Draft([text], [tuple(names)], [value], [links[0]], {"units": count, "haystack": "noise"})


def _cwe_vocabulary(rng: random.Random) -> list[str]:
    words = sorted({*wordlist("noun"), *wordlist("adjective"), *wordlist("verb")})
    random.Random(rng.random()).shuffle(words)
    return words


def _cwe(task: str, count: int, seed: str, questions: int, render_: Callable[[str, str], str], n: int = 0) -> _Draft:
    from . import ruler_prose

    rng = random.Random(seed)
    words = _cwe_vocabulary(rng)
    long = n >= 4096
    body, prefix = TEMPLATES["cwe"]

    def example(num: int, rep_c: int, rep_u: int) -> tuple[str, list[str], bool]:
        fallback = num > len(words)
        pool = ruler_prose.vocabulary() if fallback else words
        if num > len(pool):
            raise ConfigError(f"cwe: {num} distinct words asked for, the fallback vocabulary has {len(pool)}")
        chosen = rng.sample(pool, num)
        items = chosen[:10] * rep_c + chosen[10:] * rep_u
        random.Random(rng.random()).shuffle(items)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), chosen[:10], fallback

    shot_ctx, shot_ans, _ = example(40, 10, 3) if long else example(20, 3, 1)
    shot = (
        render_(body.format(context=shot_ctx), prefix) + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_ans))
    )
    ctx, ans, fallback = example(count, 30, 3) if long else example(count, 6, 1)
    text = shot + "\n" + render_(body.format(context=ctx), prefix)
    return _Draft(
        [text],
        [tuple(ans)],
        [""],
        [None],
        {"units": count, "fallback_vocabulary": fallback, "repeats": [30, 3] if long else [6, 1]},
    )


def zipf_counts(words: int, vocabulary: int, alpha: float = 2.0) -> list[int]:
    """RULER fwe's count of each rank ``k = 1..vocabulary``: ``floor(words k^-alpha / zeta(alpha))``."""
    zeta = sum(k**-alpha for k in range(1, 200_000)) + 200_000 ** (1 - alpha) / (alpha - 1)
    return [int(words * k**-alpha / zeta) for k in range(1, vocabulary + 1)]


def _fwe(task: str, count: int, seed: str, questions: int, render_: Callable[[str, str], str], n: int = 0) -> _Draft:
    rng = random.Random(seed)
    size = max(5, (n - GENERATE[task]) // 50)
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    order = sorted(vocab)
    random.Random(rng.random()).shuffle(order)
    order[0] = "..."  # the most frequent is noise
    items = [w for w, c in zip(order, zipf_counts(count, size)) for _ in range(c)]
    random.Random(rng.random()).shuffle(items)
    body, prefix = TEMPLATES["fwe"]
    text = render_(body.format(context=" ".join(items)), prefix)
    return _Draft(
        [text],
        [tuple(order[1:4])],
        [""],
        [None],
        {"units": count, "vocabulary": size, "top_counts": zipf_counts(count, size)[:5]},
    )


#: the fewest haystack units each kind of task is built with
_LEAST = {"niah": 4, "vt": 5, "cwe": 11, "fwe": 100}


def _too_short(task: str, n: int, need: int) -> ConfigError:
    return ConfigError(
        f"a {task} example needs more than {need} tokens with this tokenizer (its fewest haystack units and the "
        f"{GENERATE[task]} tokens of its generation budget), got n={n}; ask for a longer one"
    )


def build_at(
    task: str, tokenizer: Any, n: int, seed: int, questions: int = 1, *, count: int, template: str = "auto"
) -> list[str]:
    """The prompt texts :func:`build` draws for ``seed`` with ``count`` haystack units (one per question), whatever
    their length: what its binary search tries (the tests check that ``count + 1`` overflows ``n``)."""
    mode = template_mode(tokenizer, template)
    kind = "niah" if task in NIAH else task
    make = {"niah": _niah, "vt": _vt, "cwe": _cwe, "fwe": _fwe}[kind]
    extra: dict[str, Any] = {"n": n} if kind in ("cwe", "fwe") else {}
    if kind == "vt":
        extra["shot_lines"] = _vt_shot_lines(tokenizer)
    return make(
        task, count, f"ruler|{task}|{seed}", questions, lambda b, p: render(tokenizer, b, p, mode), **extra
    ).texts


def build(task: str, tokenizer: Any, n: int, seed: int, questions: int = 1, template: str = "auto") -> Example:
    """A ``task`` example of at most ``n`` tokens (prompt plus generation budget) for ``tokenizer``, drawn from
    ``seed`` (the same seed, the same example), with ``questions`` questions where the task has several keys
    (:data:`MULTI`; others ask one); ``template``: one of :data:`TEMPLATE_MODES`."""
    if task not in TASKS:
        extra = f" ({task} is RULER's but not run here: {NOT_RUN[task]})" if task in NOT_RUN else ""
        raise ConfigError(f"unknown RULER task {task!r}{extra}; the tasks are {', '.join(TASKS)}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"n is a positive number of tokens, got {n!r}")
    if not isinstance(questions, int) or isinstance(questions, bool) or questions < 1:
        raise ConfigError(f"questions is a positive number, got {questions!r}")
    mode = template_mode(tokenizer, template)
    gen = GENERATE[task]
    kind = "niah" if task in NIAH else task
    make = {"niah": _niah, "vt": _vt, "cwe": _cwe, "fwe": _fwe}[kind]
    key = f"ruler|{task}|{seed}"

    def render_(body: str, prefix: str) -> str:
        return render(tokenizer, body, prefix, mode)

    memo: dict[int, tuple[_Draft, list[list[int]]]] = {}
    fixed: dict[str, Any] = {"n": n} if kind in ("cwe", "fwe") else {}
    if kind == "vt":
        fixed["shot_lines"] = _vt_shot_lines(tokenizer)

    def at(count: int) -> tuple[_Draft, list[list[int]]]:
        if count not in memo:
            d = make(task, count, key, questions, render_, **fixed)
            memo[count] = (d, [encode(tokenizer, t, mode) for t in d.texts])
        return memo[count]

    def fits(count: int) -> bool:
        return max(len(ids) for ids in at(count)[1]) + gen <= n

    lo = _LEAST[kind]
    if not fits(lo):
        raise _too_short(task, n, max(len(ids) for ids in at(lo)[1]) + gen)
    hi = lo * 2
    while fits(hi):  # RULER's binary search on the unit count (from above by doubling)
        lo, hi = hi, hi * 2
        if hi > 1 << 26:
            raise ConfigError(f"{task}: no unit count overflows n={n} (the tokenizer gives no tokens?)")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    draft, prompts = at(lo)
    memo.clear()
    shared = 0
    shortest = min(len(p) for p in prompts)
    while shared < shortest - 1 and all(p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    qs = []
    for text, ids, answers, qkey, needle in zip(draft.texts, prompts, draft.answers, draft.keys, draft.needles):
        depth = None
        if needle is not None:
            where = text.find(needle)
            depth = len(encode(tokenizer, text[:where], mode)) / len(ids)
        qs.append(Question(tuple(ids[shared:]), answers, qkey, depth))
    info = {**draft.info, "template": mode, "prompt_tokens": [len(p) for p in prompts]}
    return Example(task, tuple(prompts[0][:shared]), tuple(qs), n, gen, seed, info, draft.texts[0])


# ---------------------------------------------------------------------------------------------- scoring
_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred`` (scripts/eval/evaluate.py): strip, every control character (``\\x00``-``\\x1f``)
    a newline, strip again."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


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


def _answer(
    model: nn.Module, tokenizer: Any, example: Example, q: Question, cache: Any, m: int, eos: int | None
) -> dict[str, Any]:
    """Ask question ``q`` on ``cache`` (the context's ``m`` positions), cut the cache back; the question's record."""
    device = next(model.parameters()).device
    ids = torch.tensor(q.ids, dtype=torch.long, device=device).reshape(1, -1)
    gen = greedy(
        model,
        ids,
        cache,
        example.generate,
        eos,
        lambda toks: string_match_all(postprocess(tokenizer.decode(toks)), q.answers) == 1.0,
    )
    _crop(cache, m)
    text = tokenizer.decode(gen)
    return {
        "key": q.key,
        "answers": list(q.answers),
        "prediction": text,
        "score": string_match_all(postprocess(text), q.answers),
        "depth": None if q.depth is None else round(q.depth, 4),
        "generated": len(gen),
    }


def greedy(
    model: nn.Module,
    ids: Tensor,
    cache: Any,
    limit: int,
    eos: int | None,
    done: Callable[[list[int]], bool] | None = None,
) -> list[int]:
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
