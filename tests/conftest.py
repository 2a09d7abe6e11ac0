import os

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
# the tests use tiny tensors: one thread is fastest, and on a shared 2-core machine two threads
# competing with other processes were measured 10-100x slower
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
