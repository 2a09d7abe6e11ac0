"""Golden outputs of HF transformers 4.57 BertSelfAttention (relative_key, relative_key_query) and NezhaSelfAttention.

Both modules were removed in transformers 5, so the tests compare posenc against these stored
outputs. Run with a transformers==4.57.x environment (torch 2.13):

    /work/venv-hf457/bin/python scripts/fixtures_hf457_bert_nezha.py

It writes tests/fixtures/hf457_bert_relative.pt and tests/fixtures/hf457_nezha.pt: the inputs,
the module weights (state dicts) and the outputs, all float64 (each module is run in float64).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import BertConfig, DynamicCache, NezhaConfig
from transformers.models.bert.modeling_bert import BertSelfAttention
from transformers.models.deprecated.nezha.modeling_nezha import NezhaSelfAttention

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
DT = torch.float64


def extended_mask(mask: torch.Tensor) -> torch.Tensor:
    """HF's additive [B, 1, 1, L] mask from a 0/1 key-padding mask."""
    return (1.0 - mask[:, None, None, :].to(DT)) * torch.finfo(DT).min


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}  # a plain dict


def bert_fixtures() -> dict:
    out: dict = {"transformers": transformers.__version__, "torch": str(torch.__version__)}
    for i, kind in enumerate(("relative_key", "relative_key_query")):
        torch.manual_seed(100 + i)
        cfg = BertConfig(
            hidden_size=16,
            num_attention_heads=2,
            max_position_embeddings=6,
            position_embedding_type=kind,
            attention_probs_dropout_prob=0.0,
            attn_implementation="eager",
        )
        m = BertSelfAttention(cfg, layer_idx=0).to(DT).eval()
        with torch.no_grad():
            # a larger spread than the 0.02 init, so that the position terms matter in the comparison
            m.distance_embedding.weight.normal_(0.0, 0.5)
            # (1) a full sequence of max_position_embeddings tokens (every table row is used), key padding
            x = torch.randn(2, 6, 16, dtype=DT)
            mask = torch.ones(2, 6)
            mask[1, -2:] = 0
            full = m(x, attention_mask=extended_mask(mask))[0]
            # (2) with a cache: 4 tokens, then 1 more token. With a cache HF 4.57 gives *every* query the
            # position key_length - 1: right for the 1-token step, wrong for the 4-token prompt ("out_first");
            # "out_first_nocache" is the same prompt without a cache (true positions 0..3)
            x1, x2 = torch.randn(2, 4, 16, dtype=DT), torch.randn(2, 1, 16, dtype=DT)
            first_nocache = m(x1)[0]
            cache = DynamicCache()
            first = m(x1, past_key_values=cache)[0]
            step = m(x2, past_key_values=cache)[0]
        out[kind] = {
            "config": {"hidden_size": 16, "num_attention_heads": 2, "max_position_embeddings": 6},
            "state_dict": state(m),
            "x": x,
            "mask": mask,
            "out": full,
            "x1": x1,
            "x2": x2,
            "out_first": first,
            "out_first_nocache": first_nocache,
            "out_step": step,
        }
    return out


def nezha_fixtures() -> dict:
    out: dict = {"transformers": transformers.__version__, "torch": str(torch.__version__)}
    # (max_relative_position, max_position_embeddings, sequence length): clipped and default k = 64
    for name, k, max_pos, length in (("clipped", 3, 12, 10), ("default", 64, 130, 9)):
        torch.manual_seed(7 + k)
        cfg = NezhaConfig(
            hidden_size=16,
            num_attention_heads=2,
            max_position_embeddings=max_pos,
            max_relative_position=k,
            attention_probs_dropout_prob=0.0,
        )
        m = NezhaSelfAttention(cfg).to(DT).eval()
        x = torch.randn(2, length, 16, dtype=DT)
        mask = torch.ones(2, length)
        mask[0, -3:] = 0
        with torch.no_grad():
            y = m(x, attention_mask=extended_mask(mask))[0]
        pe = m.relative_positions_encoding.positions_encoding  # [max_pos, max_pos, d]: table[clip(j-i)+k]
        table = pe[k, : 2 * k + 1].clone()  # row p = the table HF built for index p (float32 math, cast)
        out[name] = {
            "config": {"hidden_size": 16, "num_attention_heads": 2, "max_relative_position": k},
            "state_dict": {kk: v for kk, v in state(m).items() if "relative_positions_encoding" not in kk},
            "hf_table": table,
            "x": x,
            "mask": mask,
            "out": y,
        }
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    torch.save(bert_fixtures(), OUT / "hf457_bert_relative.pt")
    torch.save(nezha_fixtures(), OUT / "hf457_nezha.pt")
    for f in ("hf457_bert_relative.pt", "hf457_nezha.pt"):
        print(f, (OUT / f).stat().st_size, "bytes")


if __name__ == "__main__":
    main()
