"""``model.forward = torch.compile(model.forward)`` then ``generate()`` with posenc's attention: the tokens equal
eager's, with no cache, a dynamic cache, a static cache and a sliding-window cache (issue 48).

Before the fix, a branch on a tensor's values in ``_query_key_positions`` (the left-padding shift) broke the graph
inside the inlined attention and Dynamo crashed (``NameError: name 'device' is not defined``) with any cache.

Families: a tiny Llama (2 layers, hidden 64), Gemma 3 (sliding and full layers, window 4) and Llama 4 text (chunked
attention, chunk 4). Encodings, one of each kind that acts in posenc's attention: ``alibi`` (a bias), ``t5`` (a
bucket table), ``fire`` (a learned function of the normalised offset, reads the query's position), ``shaw`` (a
relative offset table on keys and values) and ``xpos`` (a rotation transformers' cos/sin cannot express, so posenc's
attention rotates, each key once in the cache). The prompt is left-padded in one row (the shift the fix is about).

Graph breaks (``torch._dynamo.utils.counters["graph_break"]``, backend ``eager``, 3 new tokens; ``GRAPH_BREAKS``):
"mapping proxy affected by dictionary mutation" (posenc.hf's forward pre-hook) once per compiled frame, and with
a static cache 4 ``Tensor.item()`` calls; none from the branch fixed here.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("posenc.hf")

import transformers as t  # noqa: E402

from posenc.hf.matrix_checks import LLAMA4  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")

VOCAB = 97
DEC = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)
def _build(family: str):
    torch.manual_seed(0)
    if family == "llama":
        model = t.LlamaForCausalLM(t.LlamaConfig(**DEC, pad_token_id=0))
    elif family == "gemma3":
        model = t.Gemma3ForCausalLM(
            t.Gemma3TextConfig(
                **DEC, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
            )
        )
    else:
        model = t.Llama4ForCausalLM(t.Llama4TextConfig(**LLAMA4, pad_token_id=0))
    with torch.no_grad():  # sharper attention than a fresh model's near-uniform one, so that position shows
        for m in model.modules():
            for name in ("q_proj", "k_proj"):
                lin = getattr(m, name, None)
                if isinstance(lin, torch.nn.Linear):
                    lin.weight.mul_(6)
    return model.eval()


def _generate(model, cache: str | None) -> torch.Tensor:
    x = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[0, :2] = 0  # row 0 left-padded
    kw: dict = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0, attention_mask=mask)
    if cache is None:
        kw["use_cache"] = False
    else:
        kw["cache_implementation"] = cache
    with torch.no_grad():
        return model.generate(x, **kw)


#: (family, encoding, cache): every cache on Llama with a bias, a cache each for the table, FIRE, Shaw and the
#: rotation, each family's own path (sliding layers, chunked attention); "sliding_window" is transformers' static
#: cache with the model's sliding (or chunked) layers as sliding-window layers
CASES = [
    *[("llama", "alibi", cache) for cache in (None, "dynamic", "static")],
    ("llama", "t5", "dynamic"),
    ("llama", "fire", "static"),
    ("llama", "shaw", "dynamic"),
    ("llama", "xpos", "dynamic"),
    ("llama", "mrope", "static"),
    ("gemma3", "alibi", "sliding_window"),
    ("llama4", "fire", "dynamic"),
    # an offset bias on Llama 4's chunked layers: id() of a position tensor made in the graph crashed dynamo there
    ("llama4", "t5", "dynamic"),
]
#: graph breaks measured per compiled generate (backend "eager", 3 new tokens): where one is listed it is asserted
GRAPH_BREAKS = {
    ("llama", None): 2,
    ("llama", "dynamic"): 1,
    ("llama", "static"): 5,
    ("gemma3", "sliding_window"): 6,
    ("llama4", "dynamic"): 2,
    # T5's table on Llama 4: 2 and 17 more of the pre-hook's kind ("mapping proxy affected by dictionary mutation"),
    # measured, not yet explained (the compile matrix has the other offset biases there)
    ("llama4", "t5", "dynamic"): 19,
}


@pytest.mark.parametrize(("family", "name", "cache"), CASES, ids=lambda v: str(v))
def test_compiled_generate_gives_the_eager_tokens(family: str, name: str, cache: str | None) -> None:
    model = _build(family)
    hf.patch(model, name)
    want = _generate(model, cache)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model.forward = torch.compile(model.forward, backend="eager")
    try:
        got = _generate(model, cache)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, want)
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    print(family, name, cache, "graph breaks:", sum(breaks.values()), [r.split(chr(10))[0] for r in breaks])
    expected = GRAPH_BREAKS.get((family, name, cache), GRAPH_BREAKS.get((family, cache)))
    if expected is not None:
        assert sum(breaks.values()) == expected, breaks


@pytest.mark.parametrize("name", ["mrope", "mrope-interleaved", "fire", "xpos"])
@pytest.mark.parametrize("cache", ["static", "sliding_window"])
def test_a_left_padded_static_cache_gives_the_uncached_tokens(name: str, cache: str) -> None:
    """A static cache's slots shifted to a left-padded row's positions put its pad queries before 0; they are
    clamped to 0 like the pad keys (an encoding rotating in posenc's attention, mrope, refused a position of -2)."""
    model = _build("llama")
    hf.patch(model, name)
    assert torch.equal(_generate(model, cache), _generate(model, None))
