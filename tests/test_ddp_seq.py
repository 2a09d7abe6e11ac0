"""Issue 24: a sequence task (its own loop, ``train_seq``) under ``posenc bench --ddp 2`` is the local run split over
two ranks: the same batches, the full batch's mean loss and gradient (its shards hold different numbers of target
tokens), the parameters in sync; and the record says what its numbers are against a local run.

One tiny torchrun of two gloo processes (a few seconds of training, most of the time is starting them).
"""

from __future__ import annotations

import pytest
import torch

from posenc.bench import RunConfig, run_one, run_suite


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_sequence_task_under_ddp_is_the_local_run_split_over_the_ranks(tmp_path):
    # "reverse" at lengths 3..9: the rows of a batch have different numbers of output tokens, so a mean per shard
    # (what the loop did before) would weight the tokens differently from the local run
    cfg = RunConfig(
        task="reverse",
        encoding="rope",
        steps=4,
        batch_size=8,
        d_model=16,
        n_layers=1,
        n_heads=2,
        eval_samples=16,
        train_lengths=(3, 9),
        test_lengths=(9,),
    )
    local = run_one(cfg)
    res = run_suite([cfg], tmp_path, progress=False, ddp=2)
    assert res.failures == [] and len(res) == 1
    rec = res[0]
    ddp = rec["extra"]["ddp"]
    assert ddp["world_size"] == 2 and ddp["data_parallel"] and ddp["in_sync"]
    assert "summed in another order" in ddp["numerics"] and ddp["threads"] >= 1
    # every step's loss is the full batch's: the curve (recorded at the last step) equals the local one to rounding
    assert rec["final_loss"] == pytest.approx(local["final_loss"], rel=1e-4)
    assert [s for s, _ in rec["curve"]] == [s for s, _ in local["curve"]]
