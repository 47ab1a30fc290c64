"""The app's engine on the embedded model: transformers, one per test module (torn down at its end)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def engine(model_path):
    import torch

    from collab_app.engines import make_engine

    # One intra-op thread: on the 2-core box other processes (a trainer, a browser, other test
    # runs) share the cores, and OpenMP's spinning threads then slow generation 5-10x (measured:
    # 4 x 24 tokens took 77-114 s with 2 threads vs 11-13 s with 1 while 3 other jobs ran).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = make_engine("transformers", model=model_path)
    yield eng
    eng.close()
    torch.set_num_threads(threads)
