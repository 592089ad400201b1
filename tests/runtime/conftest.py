import pytest

from k3compile.model_def.loader import load_model


@pytest.fixture(scope="module")
def model():
    """k3-tiny with the default seed: the model the engine tests run."""
    return load_model("k3-tiny")
