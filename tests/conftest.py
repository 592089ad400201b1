import os

import pytest
import torch

os.environ.setdefault("TQDM_DISABLE", "1")
# tiny models: intra-op threads only add OpenMP spin overhead (20x slower when cores are shared)
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
