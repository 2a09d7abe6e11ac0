"""The checks behind the support matrix of :mod:`posenc.hf` (:mod:`posenc.hf.matrix`): one tiny random model per
row, one check per column.

Each check patches a tiny random model of the family (hidden 64, 2 layers) and checks the feature against an
independent truth (the model's own logits, the tokens of ``generate`` without a cache, the positions a dynamic
cache gives ...). It returns when the feature works, raises :class:`NotApplicable` where the feature does not
exist for the family, :class:`Instead` where it passed with another encoding than its column's, a
:class:`~posenc.errors.ConfigError` where :func:`posenc.hf.patch` (or the feature) refuses, and
``AssertionError`` on a wrong answer.

Imports the other parts of :mod:`posenc.hf` (transformers and peft only inside functions); nothing in
:mod:`posenc.hf` imports it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ConfigError
from .attention import ATTENTION_NAME
from .families import _base_and_family
from .patching import patch, unpatch
from .rotary import HF_ROPE_TYPES
from .state import patched

VOCAB = 97
_DEC = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)


def _models() -> dict[str, Callable[[], Any]]:
    """One tiny random model per row: (family member, how it is built)."""
    import transformers as t

    return {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**_DEC)),
        "mistral (sliding window 4)": lambda: t.MistralForCausalLM(t.MistralConfig(**_DEC, sliding_window=4)),
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**_DEC)),
        "gemma2 (softcap)": lambda: t.Gemma2ForCausalLM(t.Gemma2Config(**_DEC, head_dim=16, sliding_window=4)),
        "gemma3 (RoPE per layer type)": lambda: t.Gemma3ForCausalLM(
            t.Gemma3TextConfig(
                **_DEC, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
            )
        ),
        "gpt-oss (sinks)": lambda: t.GptOssForCausalLM(
            t.GptOssConfig(
                **{**_DEC, "intermediate_size": 64}, head_dim=16, num_local_experts=4, num_experts_per_tok=2
            )
        ),
        "mixtral (MoE)": lambda: t.MixtralForCausalLM(
            t.MixtralConfig(**_DEC, num_local_experts=4, num_experts_per_tok=2)
        ),
        "qwen2-moe": lambda: t.Qwen2MoeForCausalLM(
            t.Qwen2MoeConfig(
                **_DEC, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
            )
        ),
        "phi3 (fused qkv_proj)": lambda: t.Phi3ForCausalLM(t.Phi3Config(**_DEC, pad_token_id=0)),
        "gpt-neox (fused, partial rotary)": lambda: t.GPTNeoXForCausalLM(
            t.GPTNeoXConfig(**{k: v for k, v in _DEC.items() if k != "num_key_value_heads"})
        ),
        "falcon (rotary)": lambda: t.FalconForCausalLM(
            t.FalconConfig(
                vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, alibi=False, new_decoder_architecture=True, num_kv_heads=2,
            )
        ),
        "gpt2": lambda: t.GPT2LMHeadModel(
            t.GPT2Config(
                vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
            )
        ),
        "bert": lambda: t.BertModel(
            t.BertConfig(
                vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                max_position_embeddings=64,
            )
        ),
    }


class NotApplicable(Exception):
    """The feature does not exist for this family."""


def _build(make: Callable[[], Any], dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(0)
    return make().to(dtype).eval()


def _tokens(b: int = 1, n: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


def _out(model: Any, x: torch.Tensor, **kw: Any) -> torch.Tensor:
    got = model(x, **kw)
    return got.logits if hasattr(got, "logits") else got.last_hidden_state


def _decoder(model: Any) -> None:
    if not model.can_generate():  # an encoder (BERT): no generate, no cache
        raise NotApplicable


def _greedy(model: Any, prompt: torch.Tensor, n: int = 8, **kw: Any) -> torch.Tensor:
    return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


def _transformers_runs(model: Any, **generate: Any) -> None:
    """The unpatched model generates with these arguments (else transformers itself does not offer them here)."""
    if generate:
        try:
            _greedy(model, _tokens(), n=2, **generate)
        except (ValueError, AssertionError, NotImplementedError, RuntimeError) as err:
            raise NotApplicable(f"transformers: {err}") from err


class Instead(Exception):
    """The check passed with another encoding than its column's (the column's cannot act in this family)."""


#: the encoding a check uses where its column's acts inside the attention and the family's attention takes none
#: (Falcon): an absolute one with parameters, so that the dtype, training, saving and PEFT columns still say something
OUTSIDE = "learned"


def _encoding_for(model: Any, wanted: str) -> str:
    return wanted if _base_and_family(model)[1].interface else OUTSIDE


def _instead(name: str, wanted: str) -> None:
    """The check passed; with another encoding than its column's, the cell says so."""
    if name != wanted:
        raise Instead(name)


def _patched_outputs(make: Callable[[], Any], wanted: str) -> tuple[Any, str, torch.Tensor, torch.Tensor]:
    """A tiny model patched with ``wanted`` (or :data:`OUTSIDE`), the encoding's name, inputs and its outputs."""
    model = _build(make)
    name = _encoding_for(model, wanted)
    patch(model, name)
    x = _tokens(2, 10)
    return model, name, x, _out(model, x)


# ------------------------------------------------------------------------------------------------- the checks
def own_rope(make: Callable[[], Any]) -> None:
    """``patch(model, "rope")`` gives the model's own logits (its own RoPE settings, per layer type)."""
    model = _build(make)
    if _base_and_family(model)[1].rotary_path is None:
        raise NotApplicable
    params = getattr(model.config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        name = {v: k for k, v in HF_ROPE_TYPES.items()}[params["rope_type"]]
    else:
        name = "rope"
    x = _tokens(2, 20)
    want = _out(model, x)
    patch(model, name)
    got = _out(model, x)
    assert (got - want).abs().max() < 1e-4, f"{name}: {(got - want).abs().max():.2e} from the model's own logits"


def _cached_equals_uncached(name: str, **generate: Any) -> Callable[[Callable[[], Any]], None]:
    def check(make: Callable[[], Any]) -> None:
        model = _build(make)
        _decoder(model)
        _transformers_runs(model, **generate)
        patch(model, name)
        prompt = _tokens()
        with_cache = _greedy(model, prompt, **generate)
        without = _greedy(model, prompt, use_cache=False)
        assert torch.equal(with_cache, without), f"{name}: {generate or 'the dynamic cache'} gives other tokens"

    check.__doc__ = f"``{name}``: generate with the cache gives the tokens of generate without it"
    return check


def left_padding(make: Callable[[], Any]) -> None:
    """alibi: a left-padded row in a batch gives the logits of the row alone (an encoder: a right-padded one)."""
    model = _build(make)
    patch(model, "alibi")
    row, other = _tokens(1, 7, seed=2), _tokens(1, 10, seed=5)
    pad = torch.zeros(1, 3, dtype=torch.long)
    alone = _out(model, row)[0]
    if model.can_generate():
        batch = torch.cat([torch.cat([pad, row], 1), other])
        mask = torch.ones_like(batch)
        mask[0, :3] = 0
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        got = _out(model, batch, attention_mask=mask, position_ids=position_ids)[0, 3:]
    else:
        batch = torch.cat([torch.cat([row, pad], 1), other])
        mask = torch.ones_like(batch)
        mask[0, 7:] = 0
        got = _out(model, batch, attention_mask=mask)[0, :7]
    gap = float((got - alone).abs().max())
    assert gap < 1e-4, f"a padded row differs from the row alone by {gap:.2e}"


def quantized_cache(make: Callable[[], Any]) -> None:
    """alibi with transformers' fp8 quantized cache: every step's keys sit at the positions a dynamic cache gives
    (the fp8 values themselves are lossy, so tokens may differ)."""
    model = _build(make)
    _decoder(model)
    _transformers_runs(model, cache_implementation="quantized", cache_config={"backend": "fp8"})
    patch(model, "alibi")
    seen: dict[str, list] = {"dynamic": [], "quantized": []}
    now = ["dynamic"]
    core = patched(model).cores[0]
    original = type(core).attend

    def spy(self: Any, call: Any, *a: Any, **k: Any) -> Any:
        if self is core:
            seen[now[0]].append((call.ctx.q_pos.tolist(), call.ctx.k_pos.tolist()))
        return original(self, call, *a, **k)

    prompt = _tokens()
    try:
        type(core).attend = spy  # type: ignore[method-assign]
        _greedy(model, prompt, n=4)
        now[0] = "quantized"
        _greedy(model, prompt, n=4, cache_implementation="quantized", cache_config={"backend": "fp8"})
    finally:
        type(core).attend = original  # type: ignore[method-assign]
    assert seen["dynamic"] == seen["quantized"], "the quantized cache's positions differ from the dynamic cache's"


def _dtype_check(dtype: torch.dtype) -> Callable[[Callable[[], Any]], None]:
    def check(make: Callable[[], Any]) -> None:
        x = _tokens(2, 12)
        ref = _build(make)
        name = _encoding_for(ref, "t5")
        patch(ref, name)
        model = _build(make, dtype)
        try:  # transformers' own model in this dtype (its MoE kernels take no float64)
            _out(model, x)
        except (RuntimeError, NotImplementedError) as err:
            raise NotApplicable(f"transformers: {err}") from err
        patch(model, name)
        patched(model).load_state_dict(patched(ref).state_dict())
        got, want = _out(model, x), _out(ref, x)
        assert got.dtype == dtype and torch.isfinite(got).all()
        tol = 1e-5 if dtype == torch.float64 else 0.1 * float(want.abs().max())
        assert (got.double() - want.double()).abs().max() <= tol, f"{name} in {dtype}: far from float32"
        _instead(name, "t5")

    check.__doc__ = f"t5 in a {dtype} model: finite, close to the float32 model"
    return check


def training(make: Callable[[], Any]) -> None:
    """t5 while training: gradients reach the encoding's parameters, and with gradient checkpointing on they are
    the gradients of a plain backward."""
    x = _tokens(2, 10)
    grads = []
    name = _encoding_for(_build(make), "t5")
    for checkpointing in (False, True):
        model = _build(make).train()
        patch(model, name)
        if checkpointing:
            model.gradient_checkpointing_enable()
        torch.manual_seed(0)
        _out(model, x).float().pow(2).mean().backward()
        params = list(patched(model).parameters())
        assert params and all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
        grads.append([p.grad for p in params])
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), "gradient checkpointing changes the encoding's gradients"
    _instead(name, "t5")


def auto_save_load(make: Callable[[], Any]) -> None:
    """fire: plain ``model.save_pretrained`` then the Auto class's ``from_pretrained`` gives the patched model,
    with the same outputs; ``from_config`` builds it patched."""
    import transformers

    model, name, x, want = _patched_outputs(make, "fire")
    auto = transformers.AutoModelForCausalLM if "Bert" not in type(model).__name__ else transformers.AutoModel
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        back = auto.from_pretrained(folder).eval()
    assert patched(back) is not None and patched(back).name == name
    assert (_out(back, x) - want).abs().max() < 1e-5
    assert patched(auto.from_config(model.config)) is not None
    _instead(name, "fire")


def attn_switch(make: Callable[[], Any]) -> None:
    """alibi, then ``set_attn_implementation("eager")``: refused, as it would drop the encoding (``yes``: the refusal
    happens and the patch stays)."""
    model = _build(make)
    patch(model, "alibi")
    try:
        model.set_attn_implementation("eager")
    except ConfigError:
        assert patched(model) is not None and model.config._attn_implementation == ATTENTION_NAME
        return
    raise AssertionError("set_attn_implementation('eager') was accepted and dropped the encoding")


def peft_lora(make: Callable[[], Any]) -> None:
    """t5 patched, then wrapped by PEFT's LoRA: ``patched()`` sees the patch through the wrapper, the wrapper's
    forward gives the patched model's outputs, and ``unpatch`` works through it."""
    try:
        import peft
    except ImportError as err:
        raise NotApplicable from err
    model, name, x, want = _patched_outputs(make, "t5")
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    target = [n for n in ("q_proj", "qkv_proj", "query_key_value", "query", "c_attn") if n in names][:1]
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=target))
    assert patched(wrapped) is not None
    assert (_out(wrapped, x) - want).abs().max() < 1e-5
    unpatch(wrapped)
    assert patched(wrapped) is None
    _instead(name, "t5")
