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


@pytest.fixture
def quiet_transformers():
    """transformers' warnings and log lines silenced for a test (tiny random models warn about their configs);
    the posenc.hf test files use it for every test: ``pytestmark = pytest.mark.usefixtures("quiet_transformers")``."""
    import warnings

    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        yield
        transformers.logging.set_verbosity(verbosity)
