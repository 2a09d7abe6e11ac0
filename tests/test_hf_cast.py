"""A model patched in float32, then cast (``model.to(torch.bfloat16)``, float16, float64), runs with every encoding
and gives float32's numbers (within what the dtype keeps).

DeBERTa (shared keys) and contextual-2 project their float32 position tables with the attention's own q_proj /
k_proj; after a cast those are half precision and ``F.linear`` refused the mixed dtypes at the forward (patching
an already-cast model passed, only the cast after the patch escaped). Tiny random Llama, no downloads.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("posenc.hf")

from posenc.errors import ConfigError  # noqa: E402
from posenc.registry import available  # noqa: E402

NAMES = [n for n in available() if not n.startswith("randomized-")]
CONFIG = dict(
    vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=64,
)


def _llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()


pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.mark.parametrize("name", NAMES)
def test_a_cast_after_patching_runs_and_equals_patching_the_cast_model(name):
    x = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    model = _llama()
    try:
        hf.patch(model, name)
    except ConfigError:
        pytest.skip(f"posenc.hf refuses {name} on a Llama (tests/test_hf_patch.py checks the refusal)")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(x).logits.double()
        for dtype in (torch.bfloat16, torch.float16, torch.float64):
            model = _llama()  # afresh: a half cast and back would leave fixed tables (buffers) rounded
            hf.patch(model, name)
            model.load_state_dict(state)
            model.to(dtype)
            got = model(x).logits
            assert got.dtype == dtype and torch.isfinite(got).all(), (name, dtype)
            tol = 1e-5 if dtype == torch.float64 else 0.1 * float(want.abs().max())
            gap = float((got.double() - want).abs().max())
            assert gap <= tol, f"{name} cast to {dtype}: {gap:.2e} from float32"
