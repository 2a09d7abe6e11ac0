"""Every cache transformers offers gives, with every kind of encoding patched in, the tokens and logits of generate
without a cache (MHA and GQA, one-token and longer prompts, left padding), and docs/hf.md's cache table is the one
these checks generate.

Why the earlier static-cache checks missed a wrong answer: they ran on the transformers that constraints.txt pinned
(5.23), while ``pip install posenc[hf]`` took 5.24, whose models name the KV cache argument ``cache`` instead of
``past_key_values``. posenc.hf read only the old name, so with a static cache it took the cache's slots for keys at
``0 .. Lk-1`` with the queries at the end: the encodings whose logits depend on the query's position beyond a shift
(T5's buckets, FIRE, Shaw; ALiBi with grouped keys) generated other tokens. The pin now follows the release users
get, the cache is found by what it is under any name, and ``patch`` warns on a transformers newer than the tested
one. Tiny random Llamas, no downloads.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("posenc.hf")

from posenc.hf import (
    hooks,  # noqa: E402
    matrix_checks,  # noqa: E402
)
from posenc.hf import matrix as hf_matrix  # noqa: E402
from posenc.hf.patching import TESTED_TRANSFORMERS, check_transformers_version  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "hf.md"
ROWS: dict[str, dict[str, str]] = {}
NEEDS_CUDA = ("offloaded", "offloaded_static")


pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.mark.parametrize("encoding", matrix_checks.CACHE_ENCODINGS)
def test_every_cache_gives_the_uncached_tokens_and_logits(encoding):
    ROWS[encoding] = cells = hf_matrix.cache_row(encoding)
    assert set(cells) == set(matrix_checks.CACHES)
    for cache, got in cells.items():
        if cache in NEEDS_CUDA and not torch.cuda.is_available():
            assert got == "n/a", (cache, got)  # transformers itself cannot run it without CUDA
        else:
            assert got == "yes", (encoding, cache, got)


def test_docs_hf_md_holds_the_generated_cache_table():
    for encoding in matrix_checks.CACHE_ENCODINGS:
        if encoding not in ROWS:  # run alone (-k)
            ROWS[encoding] = hf_matrix.cache_row(encoding)
    have = hf_matrix.current(DOC.read_text(), hf_matrix.CACHE_START, hf_matrix.CACHE_END)
    want = hf_matrix.cache_table({e: ROWS[e] for e in matrix_checks.CACHE_ENCODINGS})
    assert have == want, f"docs/hf.md's cache table is not the generated one; run: {hf_matrix.COMMAND}"


@pytest.mark.parametrize("encoding", ["t5", "fire", "shaw"])
def test_the_check_finds_a_cache_read_under_the_old_argument_name_only(encoding, monkeypatch):
    """The check is not blind: with the cache read as before the fix (``past_key_values`` only), a static cache
    gives other logits than no cache, and the check says so."""
    monkeypatch.setattr(hooks, "_the_cache", lambda bound: bound.get("past_key_values"))
    with pytest.raises(AssertionError, match="static cache"):
        matrix_checks.cache_check(encoding, "static")


def test_the_cache_is_found_under_any_name():
    class FakeCache:
        def get_mask_sizes(self, *a):  # the interface posenc.hf reads
            return 0, 0

        def get_seq_length(self, *a):
            return 0

    c = FakeCache()
    for name in (*hooks.CACHE_ARGUMENTS, "kv_cache_of_a_later_release"):
        assert hooks._the_cache({"input_ids": torch.zeros(1, 2), name: c}) is c
    assert hooks._the_cache({"input_ids": torch.zeros(1, 2), "past_key_values": None}) is None


def test_a_newer_transformers_gets_one_warning_and_the_tested_one_none(monkeypatch):
    monkeypatch.setattr("posenc.hf.patching._warned_version", [])
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        check_transformers_version(TESTED_TRANSFORMERS)
        check_transformers_version("5.24.3")  # a patch release of the tested minor
        assert not got
        check_transformers_version("5.99.0.dev0")
        check_transformers_version("5.99.0.dev0")
        check_transformers_version("6.0.0")
    texts = [str(w.message) for w in got]
    assert len(texts) == 2 and "5.99.0.dev0" in texts[0] and "posenc.hf_matrix" in texts[0], texts


def test_the_tested_release_is_the_pinned_one():
    pins = dict(
        line.split("==", 1) for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line
    )
    assert pins["transformers"].strip() == TESTED_TRANSFORMERS


@pytest.mark.parametrize("cache", ["dynamic", "static", "sliding_window"])
def test_an_encoding_that_reads_the_query_position_sees_it_with_a_cache_and_left_padding(cache):
    """Llama 4's temperature reads the query's own position (a floor of 2 makes it change every other token):
    with a cache, posenc.hf once placed a left-padded row's queries at the cache's slots, pads included, so the
    cached logits differed from the uncached ones (3e-3 with a dynamic cache, 2e-2 with a static one). The slots are
    now shifted per row to the forward's own positions."""
    import posenc.hf as hf

    model = matrix_checks._sharp_llama(4)
    hf.patch(model, "qtemp-llama4", floor_scale=2, attn_scale=0.5)
    lengths = (9, 5)  # the second row left-padded by 4
    seq, logits = matrix_checks._steps(model, lengths, **matrix_checks.CACHES[cache])
    want_seq, want = matrix_checks._steps(model, lengths, use_cache=False)
    assert float((logits - want).abs().max()) < 1e-4
    assert torch.equal(seq, want_seq)
