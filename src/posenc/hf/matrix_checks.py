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
from .state import patched

VOCAB = 97
_DEC = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)

#: four layers: the per-layer schemes repeat every four layers (NoPE every fourth, three local and one global)
_DEC4 = {**_DEC, "num_hidden_layers": 4}
#: Gemma 3 as released (the 4B): local layers θ = 1e4, global layers θ = 1e6 with linear scaling ×8
GEMMA3_4B_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
}
#: OLMo 3: plain RoPE on the sliding layers, YaRN on the full ones
OLMO3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
    "full_attention": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 500000.0,
    },
}
#: a tiny Llama 4 text model: NoPE on every fourth layer with the query temperature (its blocks of 4 positions,
#: so that it shows), chunked attention of 4 tokens on the others, a mixture of experts on every second layer
LLAMA4 = dict(
    **{**_DEC4, "intermediate_size_mlp": 128}, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
    interleave_moe_layer_step=2, attention_chunk_size=4, floor_scale=4,
)


#: the special tokens of the tiny Qwen2-VL models (inside their vocabulary)
QWEN2_VL_TOKENS = dict(image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
#: their text model: M-RoPE sections of the 8 rotary pairs of a 16-wide head (Qwen2-VL's [16, 24, 24] of 64, scaled)
_QWEN2_VL_TEXT = {
    **_DEC, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
}
#: DeepSeek-V3's YaRN (mscale = mscale_all_dim = 1) at factor 4 over a trained length of 16
DEEPSEEK_YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
    "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
}


def qwen2_vl() -> Any:
    """A tiny random Qwen2-VL (its vision encoder one block deep)."""
    import transformers as t

    vision = dict(
        depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=2, temporal_patch_size=2,
        spatial_merge_size=2, in_channels=3,
    )
    config = t.Qwen2VLConfig(text_config=_QWEN2_VL_TEXT, vision_config=vision, **QWEN2_VL_TOKENS)
    return t.Qwen2VLForConditionalGeneration(config)


def qwen2_5_vl() -> Any:
    """A tiny random Qwen2.5-VL (its vision encoder one block deep)."""
    import transformers as t

    vision = dict(
        depth=1, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=64, patch_size=2,
        temporal_patch_size=2, spatial_merge_size=2, window_size=8, fullatt_block_indexes=[0], in_channels=3,
    )
    config = t.Qwen2_5_VLConfig(text_config=_QWEN2_VL_TEXT, vision_config=vision, **QWEN2_VL_TOKENS)
    return t.Qwen2_5_VLForConditionalGeneration(config)


def deepseek_v3(**overrides: Any) -> Any:
    """A tiny random DeepSeek-V3: MLA with 16 unrotated and 8 rotated channels per query/key head, values 12 wide,
    DeepSeek's YaRN; a dense first layer, then 4 routed experts (2 per token) and a shared one; transformers' eager
    experts (its grouped kernel takes no float64)."""
    import transformers as t

    sizes = dict(
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=12, rope_parameters=DEEPSEEK_YARN,
    )
    config = t.DeepseekV3Config(**{**_DEC, "num_key_value_heads": 4, **sizes, **overrides})
    model = t.DeepseekV3ForCausalLM(config)
    model.set_experts_implementation("eager")
    return model


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
        "gemma3 (θ 1e4 local, 1e6 ×8 global)": lambda: t.Gemma3ForCausalLM(
            t.Gemma3TextConfig(
                **_DEC4, head_dim=16, sliding_window=4, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                rope_parameters=GEMMA3_4B_ROPE,
            )
        ),
        "smollm3 (NoPE every 4th layer)": lambda: t.SmolLM3ForCausalLM(t.SmolLM3Config(**_DEC4, pad_token_id=0)),
        "cohere2 (3 sliding RoPE, 1 global NoPE)": lambda: t.Cohere2ForCausalLM(
            t.Cohere2Config(**_DEC4, sliding_window=4, pad_token_id=0)
        ),
        "llama4 (NoPE layers, chunks, temperature, MoE)": lambda: t.Llama4ForCausalLM(
            t.Llama4TextConfig(**LLAMA4, pad_token_id=0)
        ),
        "olmo3 (sliding RoPE, YaRN on full layers)": lambda: t.Olmo3ForCausalLM(
            t.Olmo3Config(**_DEC4, sliding_window=4, rope_parameters=OLMO3_ROPE)
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
        "qwen2-vl (M-RoPE, 3 position rows)": qwen2_vl,
        "qwen2.5-vl (M-RoPE, 3 position rows)": qwen2_5_vl,
        "deepseek-v3 (MLA, YaRN mscale², MoE)": deepseek_v3,
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
        "modernbert (encoder, θ per layer type)": lambda: t.ModernBertModel(
            t.ModernBertConfig(
                vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=3, pad_token_id=0,
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
    """``patch(model, "rope")`` gives the model's own logits: its own RoPE settings on each layer (per layer type,
    the scaling its ``rope_parameters`` name included) and its layers without RoPE kept (NoPE, Llama 4's
    temperature), within 1e-6."""
    model = _build(make)
    if _base_and_family(model)[1].rotary_path is None:
        raise NotApplicable
    x = _tokens(2, 20)
    want = _out(model, x)
    patch(model, "rope")
    got = _out(model, x)
    assert (got - want).abs().max() <= 1e-6, f"rope: {(got - want).abs().max():.2e} from the model's own logits"


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
            # transformers 5.24 deprecated gradient_checkpointing_enable (it warns) for activation_checkpointing_enable
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
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
    kind = type(model).__name__
    auto = (
        transformers.AutoModel if "Bert" in kind
        else transformers.AutoModelForImageTextToText if kind.endswith("ForConditionalGeneration")  # Qwen2-VL
        else transformers.AutoModelForCausalLM
    )
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
    target = [n for n in ("q_proj", "qkv_proj", "query_key_value", "query", "c_attn", "Wqkv") if n in names][:1]
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=target))
    assert patched(wrapped) is not None
    assert (_out(wrapped, x) - want).abs().max() < 1e-5
    unpatch(wrapped)
    assert patched(wrapped) is None
    _instead(name, "t5")


# ------------------------------------------------------------------------------- every cache against no cache
#: the caches of transformers' ``cache_implementation`` that the cache matrix checks, with what ``generate`` takes
#: for each (the fp8 quantized cache needs no extra package; quanto's does). The offloaded ones need CUDA.
CACHES: dict[str, dict[str, Any]] = {
    "dynamic": {},
    "static": {"cache_implementation": "static"},
    "sliding_window": {"cache_implementation": "sliding_window"},
    "hybrid": {"cache_implementation": "hybrid"},
    "hybrid_chunked": {"cache_implementation": "hybrid_chunked"},
    "quantized (fp8)": {"cache_implementation": "quantized", "cache_config": {"backend": "fp8"}},
    "offloaded": {"cache_implementation": "offloaded"},
    "offloaded_static": {"cache_implementation": "offloaded_static"},
}
#: the encodings the cache matrix checks: each kind of hook (a rotation HF's cos/sin express, rotations it does not,
#: biases with and without parameters, a bucket table, per-layer relative tables, an absolute code)
CACHE_ENCODINGS = ("rope", "xpos", "rope-interleaved", "alibi", "kerple-log", "t5", "fire", "shaw", "sinusoidal")
#: the models each cache cell runs on: multi-head and grouped-query attention, and a sliding-window model
CACHE_MODELS = {"MHA": 4, "GQA": 2}
#: the prompts of a cell: (batch rows' lengths); a shorter row is left-padded to the longest
CACHE_PROMPTS = ((1,), (7,), (9, 5))
#: tokens generated per prompt
CACHE_STEPS = 6


def _sharp_llama(kv_heads: int) -> Any:
    """A tiny random Llama whose attention is sharp enough for position to change its tokens (q/k weights × 8: a
    fresh model's attention is near uniform, and an offset error could leave its tokens alone)."""
    import transformers as t

    torch.manual_seed(0)
    model = t.LlamaForCausalLM(t.LlamaConfig(**{**_DEC, "num_key_value_heads": kv_heads})).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


def _prompt(lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of these lengths, left-padded with 0 to the longest, and their attention mask."""
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, length in enumerate(lengths):
        ids[r, n - length :] = _tokens(1, length, seed=3 + r)[0]
        mask[r, n - length :] = 1
    return ids, mask


def _steps(model: Any, lengths: tuple[int, ...], **generate: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy tokens of ``generate`` and the logits it saw at each step."""
    ids, mask = _prompt(lengths)
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=CACHE_STEPS, min_new_tokens=CACHE_STEPS, do_sample=False,
        pad_token_id=0, return_dict_in_generate=True, output_logits=True, **generate,
    )
    return out.sequences, torch.stack(out.logits, dim=1)


def _spy_positions(model: Any, lengths: tuple[int, ...], **generate: Any) -> list[Any]:
    """The (query, key) positions the first patched layer's attention saw while ``model`` generated; for an
    encoding that acts outside the attention, the positions of each forward."""
    state = patched(model)
    seen: list[Any] = []
    if not state.cores:
        handle = model.register_forward_hook(lambda *_: seen.append(state.positions.tolist()))
        try:
            _steps(model, lengths, **generate)
        finally:
            handle.remove()
        return seen
    core = state.cores[0]
    original = type(core).attend

    def spy(self: Any, call: Any, *a: Any, **k: Any) -> Any:
        if self is core:
            seen.append((call.ctx.q_pos.tolist(), call.ctx.k_pos.tolist()))
        return original(self, call, *a, **k)

    try:
        type(core).attend = spy  # type: ignore[method-assign]
        _steps(model, lengths, **generate)
    finally:
        type(core).attend = original  # type: ignore[method-assign]
    return seen


def cache_check(encoding: str, cache: str) -> None:
    """``encoding`` patched into tiny Llamas with multi-head and grouped-query attention: ``generate`` with the
    ``cache`` gives, for each prompt of :data:`CACHE_PROMPTS` (one token, several, a left-padded batch), the tokens
    of ``generate`` without a cache and, at every step, its logits (within 1e-4). The fp8 quantized cache stores
    keys lossily, so there the check is that every step's attention sees the positions a dynamic cache gives.
    :class:`NotApplicable` where transformers itself does not run the cache here (offloaded caches need CUDA)."""
    generate = CACHES[cache]
    for heads, kv in CACHE_MODELS.items():
        model = _sharp_llama(kv)
        _transformers_runs(model, **generate)
        patch(model, encoding)
        for lengths in CACHE_PROMPTS:
            what = f"{encoding} with the {cache} cache ({heads}, prompt rows {lengths})"
            if cache.startswith("quantized"):
                dynamic = _spy_positions(model, lengths)
                quantized = _spy_positions(model, lengths, **generate)
                assert dynamic == quantized, f"{what}: the attention sees other positions than with a dynamic cache"
                continue
            seq, logits = _steps(model, lengths, **generate)
            want_seq, want_logits = _steps(model, lengths, use_cache=False)
            gap = float((logits - want_logits).abs().max())
            assert gap < 1e-4, f"{what}: logits {gap:.2e} from generate without a cache"
            assert torch.equal(seq, want_seq), f"{what}: other tokens than generate without a cache"
